"""Endurance: many epochs, DataLoader workers started anew for each (persistent_workers=False),
and the main process must not accumulate descriptors, mappings, memory or stats rows.

Each epoch forks (or spawns) 2 workers that read every sample through the cache (the first
epoch fills it). After every epoch we record, in the main process: open descriptors
(/proc/self/fd), mappings (lines of /proc/self/maps), RSS, and ``stats()["processes"]`` (stats
rows held). Epoch 0 fills the cache and epoch 1 warms up what the DataLoader itself allocates
once (its threads' stacks, the allocator's arenas, import-time caches); from epoch 2 on,
every figure must stay within a small tolerance of its epoch-2 value:

* descriptors: +0 (every pipe, queue and segment handle of an epoch is closed with it);
* mappings: +2 (the allocator may keep or drop one arena or thread stack between epochs;
  a leak of one mapping per epoch shows as +18 after 20 epochs);
* RSS: +8 MiB (allocator caching and fragmentation; a leaked segment view or one 3 KiB
  sample per index per epoch would exceed it well before epoch 20);

where "growth" is the least of the last three epochs over epoch 2, so that one epoch caught
while a thread of the DataLoader (or of an earlier test) is still exiting does not count as a
leak, while a real leak, which raises every later epoch, does. Such a spike is bounded too
(4 descriptors, 8 mappings, 16 MiB).
* stats rows: at most the main process plus the workers of one epoch and of the epoch
  before (a new process folds the rows of dead ones into row 0 when it claims its own).
"""

from __future__ import annotations

import gc
import os
import threading

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import TwoLineDataset, assert_no_leak, holders, mappers, used_bytes, value_of
from stocaching import SharedCache

N, DIMS = 512, (3, 32, 32)
WORKERS = 2


def _workers() -> list[psutil.Process]:
    """Children of this process, but multiprocessing's helpers that live as long as the
    session: its resource tracker (started by the first spawn context that needs it) and its
    forkserver (started by the first forkserver DataLoader of any earlier test)."""
    out = []
    for p in psutil.Process().children():
        try:
            if not any("resource_tracker" in a or "multiprocessing.forkserver" in a
                       for a in p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _settle() -> None:
    """Let the epoch's queue feeder threads finish: the DataLoader closes its queues without
    joining them, and a feeder still exiting holds a thread stack and a pipe for a moment."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("QueueFeederThread"):
            t.join(60)  # returns as soon as it ends; 60 s is a ceiling for a hang


def _probe(cache: SharedCache) -> dict:
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps,
            "rss": psutil.Process().memory_info().rss, "rows": cache.stats()["processes"]}


def _run(ctx: str, epochs: int, shm: str) -> tuple[list[dict], dict]:
    cache = SharedCache(1, N, DIMS, name=f"endure{ctx}", shm_dir=shm)
    ds = TwoLineDataset(cache, N)
    marks = []
    for epoch in range(epochs):
        loader = DataLoader(ds, batch_size=32, num_workers=WORKERS, persistent_workers=False,
                            multiprocessing_context=ctx, timeout=300)
        seen = 0
        for idx, batch, _ in loader:
            want = torch.stack([value_of(i, DIMS) for i in idx.tolist()])
            assert torch.equal(batch, want), f"epoch {epoch}"
            seen += len(batch)
        assert seen == N
        del loader, idx, batch
        gc.collect()
        _settle()
        assert _workers() == []  # the epoch's workers are gone, and reaped
        # Only this process maps the segment now (its read-write and read-only views).
        assert list(mappers(shm)) == [os.getpid()] and len(mappers(shm)[os.getpid()]) == 1
        marks.append(_probe(cache))
    stats = cache.stats()
    cache.close()
    del cache, ds
    return marks, stats


def _check(marks: list[dict], stats: dict, epochs: int) -> None:
    base = marks[2]
    # Growth: the least of the last 3 epochs over epoch 2 (a leak raises every later epoch;
    # a thread of some other test still exiting raises one). Spikes are bounded too.
    grow = {k: min(m[k] for m in marks[-3:]) - base[k] for k in ("fds", "maps", "rss")}
    spike = {k: max(m[k] for m in marks[2:]) - base[k] for k in ("fds", "maps", "rss")}
    print(f"\n[endurance] {epochs} epochs: fds {[m['fds'] for m in marks]} maps "
          f"{[m['maps'] for m in marks]} rss MiB {[round(m['rss'] / 2**20, 1) for m in marks]} "
          f"rows {[m['rows'] for m in marks]}; growth {grow}, spike {spike}")
    assert grow["fds"] == 0 and spike["fds"] <= 4, (grow, spike)
    assert grow["maps"] <= 2 and spike["maps"] <= 8, (grow, spike)
    assert grow["rss"] <= 8 * 2**20 and spike["rss"] <= 16 * 2**20, (grow, spike)
    assert max(m["rows"] for m in marks) <= 1 + 2 * WORKERS
    # Every read is counted once, whatever process made it and however many rows were folded.
    assert (stats["hits"], stats["misses"], stats["writes"], stats["filled"]) == \
        ((epochs - 1) * N, N, N, N)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method,epochs", [("fork", 20), ("spawn", 5)])
def test_workers_recreated_every_epoch_leak_nothing(method, epochs, tmpfs):
    marks, stats = _run(method, epochs, tmpfs)
    _check(marks, stats, epochs)
    assert_no_leak(tmpfs)


def test_close_releases_the_mapping_while_the_object_lives(tmpfs):
    cache = SharedCache(1, 64, (1024,), name="closing", shm_dir=tmpfs)
    cache.set_slot(0, torch.ones(1024, dtype=torch.uint8))
    assert mappers(tmpfs) and used_bytes(tmpfs) > 0
    cache.close()
    assert (mappers(tmpfs), holders(tmpfs), used_bytes(tmpfs)) == ({}, {}, 0)


def test_dropping_a_closed_cache_releases_everything(tmpfs):
    cache = SharedCache(1, 64, (1024,), name="dropping", shm_dir=tmpfs)
    cache.set_slot(0, torch.ones(1024, dtype=torch.uint8))
    cache.close()
    del cache
    gc.collect()
    assert (mappers(tmpfs), holders(tmpfs), used_bytes(tmpfs)) == ({}, {}, 0)
