"""Torture: processes started by fork and by spawn hammer one cache with random reads, writes,
overwrites and clears on the same few indices, and every read is checked.

What overwriting guarantees (``set_slot(..., allow_overwrite=True)`` racing ``get_slot``): a
reader gets the old value, the new value, or a miss (None), never a mix of the two. Each write
is serialised with the other writers of its slot by a per-slot lock; readers take no lock and
detect a write that overlapped their copy by the slot's sequence number, retrying or returning
a miss. The core's docstring says the same ("a consistent copy of a completely written slot or
a miss (None), never a half-written slot"), and adds that the check relies on x86-64 keeping
stores in order. ``clear()`` racing a read must give the old value or a miss as well.

Every value written is a function of (index, version): byte 0 is the version, bytes 1-4 the
index, bytes 5-59 a pattern of both, bytes 60-63 a CRC-32 of bytes 0-59. A read is correct when
it is None or exactly the value of *its* index for *some* version: a torn read (bytes from two
versions), a value of another index or a zeroed slot fails the check. Reads are checked in
batches with numpy against a table of every valid value, so the check costs less than the read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import zlib

import numpy as np
import pytest
import torch

from _helpers import assert_no_leak, budget_for
from stocaching import BaseCache, SharedCache

N_SLOTS, N_OOB, WIDTH = 48, 8, 64  # 48 cached indices, 8 without a slot, (64,) uint8 samples
DATASET_LEN = N_SLOTS + N_OOB
BUDGET_GIB = budget_for(N_SLOTS, (WIDTH,), dataset_len=DATASET_LEN)
READS_PER_PROC = 260_000
CHUNK = 20_000


def _table() -> np.ndarray:
    """Every valid value: table[i, v] is the sample of index i at version v."""
    i = np.arange(DATASET_LEN)[:, None, None]
    v = np.arange(256)[None, :, None]
    k = np.arange(WIDTH)[None, None, :]
    t = ((i * 31 + v * 17 + k * 7 + 3) & 255).astype(np.uint8)
    t = np.array(np.broadcast_to(t, (DATASET_LEN, 256, WIDTH)))
    t[:, :, 0] = np.arange(256)[None, :]
    t[:, :, 1:5] = np.arange(DATASET_LEN, dtype="<u4").view(np.uint8).reshape(-1, 1, 4)
    for a in range(DATASET_LEN):
        for b in range(256):
            t[a, b, 60:] = np.frombuffer(zlib.crc32(t[a, b, :60].tobytes()).to_bytes(4, "little"),
                                         np.uint8)
    return t


def _torture(cache: SharedCache, seed: int, with_clear: bool, out) -> None:
    """One process: random operations until READS_PER_PROC reads; counts go to ``out``."""
    torch.set_num_threads(1)
    table = _table()
    values = torch.from_numpy(table)
    rng = np.random.default_rng(seed)
    buf = np.empty((CHUNK, WIDTH), np.uint8)
    got = np.empty(CHUNK, np.int64)
    reads = misses = corrupt = stored = refused = clears = 0
    examples = []
    start = time.perf_counter()
    while reads < READS_PER_PROC:
        idx = rng.integers(0, DATASET_LEN, CHUNK).tolist()
        ver = rng.integers(0, 256, CHUNK).tolist()
        op = rng.random(CHUNK).tolist()
        n = 0
        for i, v, p in zip(idx, ver, op):
            if p < 0.05:  # overwrite
                cache.set_slot(i, values[i, v], allow_overwrite=True)
                stored += i < N_SLOTS
            elif p < 0.10:  # write if empty
                try:
                    cache.set_slot(i, values[i, v])
                    stored += i < N_SLOTS
                except RuntimeError:
                    refused += 1
            elif with_clear and p > 0.9999:
                cache.clear()
                clears += 1
            else:
                x = cache.get_slot(i)
                reads += 1
                if x is None:
                    misses += 1
                else:
                    buf[n] = x.numpy()
                    got[n] = i
                    n += 1
        rows = buf[:n]
        bad = ~(rows == table[got[:n], rows[:, 0]]).all(1)
        corrupt += int(bad.sum())
        for j in np.flatnonzero(bad)[:3 - len(examples)]:
            examples.append((int(got[j]), rows[j].tolist()))
    out.put({"pid": os.getpid(), "reads": reads, "misses": misses, "corrupt": corrupt,
             "stored": stored, "refused": refused, "clears": clears, "examples": examples,
             "seconds": time.perf_counter() - start})


def _clearer(cache: SharedCache, stop, out) -> None:
    """Refill every slot and clear() them all, over and over, while the others read."""
    torch.set_num_threads(1)
    values = torch.from_numpy(_table())
    clears = v = 0
    while not stop.is_set():
        v = (v + 1) % 256
        for i in range(N_SLOTS):
            cache.set_slot(i, values[i, v], allow_overwrite=True)
        cache.clear()
        clears += 1
    out.put({"clears": clears, "stored": clears * N_SLOTS})


def _run(with_clear: bool, tmp_shm: str) -> tuple[list[dict], float, dict, dict]:
    cache = SharedCache(BUDGET_GIB, DATASET_LEN, (WIDTH,), name="torture", shm_dir=tmp_shm)
    assert len(cache) == N_SLOTS
    before = cache.stats()
    fork, spawn = mp.get_context("fork"), mp.get_context("spawn")
    out = spawn.Queue()  # usable by fork and spawn children alike
    procs = [ctx.Process(target=_torture, args=(cache, seed, with_clear, out))
             for seed, ctx in enumerate([fork, fork, spawn, spawn])]
    stop = spawn.Event()
    clearer = fork.Process(target=_clearer, args=(cache, stop, out)) if with_clear else None
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    if clearer is not None:
        clearer.start()
    results = []
    deadline = time.monotonic() + 400  # a ceiling for a hang: the work is a count of reads
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"torture processes: {dead}"
    wall = time.perf_counter() - t0
    if clearer is not None:
        stop.set()
        extra = out.get(timeout=120)
        results[0]["clears"] += extra["clears"]
        results[0]["stored"] += extra["stored"]
        procs.append(clearer)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    after = cache.stats()
    # What the cache holds at the end is valid too.
    table = _table()
    for i in range(DATASET_LEN):
        x = cache.get_slot(i)
        if x is not None:
            row = x.numpy()
            assert (row == table[i, row[0]]).all(), f"final value of index {i}: {row.tolist()}"
    cache.close()
    del cache
    return results, wall, before, after


@pytest.mark.timeout(600)
@pytest.mark.parametrize("with_clear", [
    pytest.param(False, id="overwrite"),
    pytest.param(True, id="overwrite+clear"),
])
def test_torture_reads_are_never_corrupt(with_clear, tmpfs, capsys):
    results, wall, before, after = _run(with_clear, tmpfs)
    assert_no_leak(tmpfs)
    total = {k: sum(r[k] for r in results) for k in
             ("reads", "misses", "corrupt", "stored", "refused", "clears")}
    with capsys.disabled():
        print(f"\n[torture {'overwrite+clear' if with_clear else 'overwrite'}] "
              f"{total['reads']:,} reads ({total['misses']:,} misses), {total['stored']:,} "
              f"writes, {total['refused']:,} refused (already set), {total['clears']} clears, "
              f"{total['corrupt']} corrupt, in {wall:.1f} s by 2 fork + 2 spawn processes"
              f"{' + 1 fork clearer' if with_clear else ''}")
    assert total["reads"] >= 1_000_000
    assert total["stored"] > 10_000 and total["misses"] > 10_000  # the races were exercised
    if with_clear:
        assert total["clears"] >= 20
    assert total["corrupt"] == 0, [r["examples"] for r in results if r["examples"]]
    # Every read and write is counted, each process in its own stats row.
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == total["reads"]
    assert after["misses"] - before["misses"] == total["misses"]
    assert after["writes"] - before["writes"] == total["stored"]


def test_read_racing_clear_is_a_miss_not_zeros(tmpfs):
    """The interleaving the torture finds by chance, pinned: a reader has seen the slot SET,
    then clear() (in another process: here the same shared memory through the same object)
    completes before the reader reads the sequence number. The wrapper around the reader's
    sequence-number view only decides *when* clear() runs."""
    with SharedCache(1, 4, (8,), name="race", shm_dir=tmpfs) as cache:
        cache.set_slot(0, torch.full((8,), 7, dtype=torch.uint8))
        seq = cache._slot_versions

        class ClearFirst:
            done = False

            def __getitem__(self, k):
                if not ClearFirst.done:
                    ClearFirst.done = True
                    cache.clear()
                return seq[k]

        cache._slot_versions = ClearFirst()
        got = cache.get_slot(0)
        cache._slot_versions = seq
    assert got is None, f"read after clear() returned {got.tolist()}"


# ----------------------------------------------------------------------------------------------
# get_slot's inlined first try against the one seqlock read (_read, _read_row)
# ----------------------------------------------------------------------------------------------

_RETRY = "retry"  # what get_slot gives below when its first try failed


def _overwrite_with(value):
    def event(cache):
        cache.set_slot(0, value, allow_overwrite=True)
    return event


def _clear(cache):
    cache.clear()


def _begin_write(cache):  # a writer in the middle of its copy (it finishes after the read)
    cache._slot_versions_np[0] |= 1
    cache._index_states_np[0] = 3  # WRITING


class _Views:
    """Stands in for the cache's views of shared memory that a read uses (``_index_states``,
    ``_slot_versions``, ``_slot_samples``, ``_read_only_slots``), counts the items read through
    them, and runs ``events[at](cache)`` just before the ``at``-th (never, if the read makes
    fewer); ``ran`` lists the positions whose event ran."""

    NAMES = ("_index_states", "_slot_versions", "_slot_samples", "_read_only_slots")

    def __init__(self, cache, events: dict):
        self.cache, self.events, self.reads, self.busy, self.ran = cache, events, 0, False, []
        self.real = {n: getattr(cache, n) for n in self.NAMES}

    def __enter__(self):
        outer = self

        class View:
            def __init__(self, real):
                self.real = real

            def __getitem__(self, k):
                if not outer.busy:  # (the event's own reads are not the reader's)
                    outer.reads += 1
                    if outer.reads in outer.events:
                        outer.busy = True
                        outer.events[outer.reads](outer.cache)
                        outer.busy = False
                        outer.ran.append(outer.reads)
                return self.real[k]

            def __setitem__(self, k, v):
                self.real[k] = v

        for n, real in self.real.items():
            setattr(self.cache, n, View(real))
        return self

    def __exit__(self, *exc):
        for n, real in self.real.items():
            setattr(self.cache, n, real)


@pytest.mark.parametrize("copy", [True, False])
def test_get_slots_inlined_read_agrees_with_read_row(tmpfs, copy):
    """get_slot's first try is _read (_read_row) inlined; BaseCache.get_slot, the get_slot of
    the caches of fields and of open sizes, calls it. For every write, clear() or unfinished
    write landing before each read of shared memory the two make, both give the same answer:
    the same sample, or both give up (and call _read_again, replaced here so that this shows),
    or a miss; with the same counts; and each sample is one that the slot held."""
    old, new = torch.full((8,), 1, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)
    with SharedCache(1, 4, (8,), name="agree", shm_dir=tmpfs) as cache:
        cache._read_again = lambda idx, copy: _RETRY

        def inlined():
            return cache.get_slot(0, copy=copy)

        def by_function():  # the get_slot of the other kinds of cache
            return BaseCache.get_slot(cache, 0, copy=copy)

        seen = set()
        for name, event in [("overwrite", _overwrite_with(new)), ("clear", _clear),
                            ("unfinished write", _begin_write)]:
            for at in range(1, 8):
                answers = []
                for read in (inlined, by_function):
                    cache._slot_versions_np[0] |= 1
                    cache._slot_versions_np[0] += 1  # a writer that finished (even again)
                    cache.set_slot(0, old, allow_overwrite=True)
                    before = cache.stats()
                    with _Views(cache, {at: event}) as views:
                        got = read()
                    got = got if got is None or got is _RETRY else got.clone()
                    after = cache.stats()
                    answers.append((got, [after[k] - before[k] for k in ("hits", "misses")],
                                    views.reads))
                (a, a_counts, a_reads), (b, b_counts, b_reads) = answers
                where = f"{name} before read {at}"
                assert a_reads == b_reads, where  # the same reads of shared memory
                assert a_counts == b_counts == [int(isinstance(a, torch.Tensor)),
                                                int(a is None)], where
                if isinstance(a, torch.Tensor):
                    assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
                    assert torch.equal(a, old) or torch.equal(a, new), where
                    seen.add("sample")
                else:
                    assert a is b, (where, a, b)
                    seen.add(a)
        assert seen == {"sample", _RETRY, None}  # every kind of answer was compared


@pytest.mark.parametrize("read", ["get_slot", "BaseCache.get_slot"])
def test_read_racing_clear_then_a_write_is_a_miss_not_zeros(tmpfs, read):
    """The zeroed read of the torture (issue 47), pinned. A read of index 0 makes five reads of
    shared memory: its state (SET), the slot's number, the row, then the state and the number
    again, in either order. Here another process's clear() lands before the first read of the
    number, so the reader copies zeros between two reads of one even number, and another
    process's set_slot of index 0 lands before the fifth read. When the state was checked last,
    outside the window the number guards, it read SET and the zeros passed as a hit."""
    value = torch.full((8,), 9, dtype=torch.uint8)
    with SharedCache(1, 4, (8,), name="race2", shm_dir=tmpfs) as cache:
        cache.set_slot(0, torch.full((8,), 7, dtype=torch.uint8))
        cache._read_again = lambda idx, copy: None  # the first try's answer, not a retry's
        events = {2: _clear, 5: lambda c: c.set_slot(0, value)}
        with _Views(cache, events) as views:
            got = cache.get_slot(0) if read == "get_slot" else BaseCache.get_slot(cache, 0)
        assert views.ran == [2, 5]  # both landed where they were meant to
        assert got is None, f"a read racing clear() and a write returned {got.tolist()}"
        assert torch.equal(cache.get_slot(0), value)  # the next read hits the new value
