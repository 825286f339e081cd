"""The disk tier behind the cache (``SharedCache(disk_tier=...)``): every index without a slot
in /dev/shm gets a row in a sparse file on a real filesystem (``tmp_path``, on the machine's
disk), read back equal by the process that wrote it, by fork and spawn DataLoader workers and
by two torchrun ranks; a writer killed mid-row never serves that row; a full disk leaves
samples untiered with one message; a read-only directory is refused; the file is gone after
close, or kept for a persistent cache and removed by ``clean``."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from _helpers import (CHILDREN, TwoLineDataset, age, assert_no_leak, budget_for, fields_of,
                      free_port, named, rank_env, run_bounded, value_of)
from stocaching import CacheLayout, OpenSizeCache, SharedCache, World, clean_segments
from stocaching.cli import main
from stocaching.disk_tier import _TIER_PREFIX, _tier_indices

DIMS = (3, 8, 8)
N, SLOTS = 32, 8  # 8 indices in /dev/shm, 24 on the tier


def tiered(shm_dir, tier, *, n=N, slots=SLOTS, dims=DIMS, **kwargs) -> SharedCache:
    return SharedCache(budget_for(slots, dims, dataset_len=n), n, dims, shm_dir=shm_dir,
                       disk_tier=str(tier), **kwargs)


def tier_files(tier) -> list[str]:
    return sorted(f for f in os.listdir(tier) if f.startswith(_TIER_PREFIX))


@contextlib.contextmanager
def mounted(options: str):
    """A fresh tmpfs mounted with ``options``; skipped, with the reason, where mount fails."""
    d = tempfile.mkdtemp(prefix="stocaching-tier-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", d], capture_output=True,
                       text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); the "
                    "test needs root or CAP_SYS_ADMIN")
    try:
        yield d
    finally:
        if subprocess.run(["umount", d], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", d], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(d)


def test_every_value_reads_back_from_the_tier_and_nothing_is_left(private_shm_dir, tmp_path):
    shm_dir = private_shm_dir  # a tmpfs of its own: the leak check counts its bytes
    cache = tiered(shm_dir, tmp_path)
    assert tier_files(tmp_path) == []  # one process: the file never has a name
    for i in range(N):
        assert cache.get_slot(i) is None
        cache.set_slot(i, value_of(i))
    for i in range(N):
        assert torch.equal(cache.get_slot(i), value_of(i))
    s = cache.stats()
    assert (s["filled"], s["disk_rows"], s["disk_tier_rows"]) == (SLOTS, N - SLOTS, N - SLOTS)
    assert (s["disk_hits"], s["disk_writes"], s["hits"]) == (N - SLOTS, N - SLOTS, N)
    cache.close()
    assert tier_files(tmp_path) == []
    assert_no_leak(shm_dir)


def test_a_cache_of_fields_and_a_random_subset_read_back_from_the_tier(shm_dir, tmp_path):
    dims = {"image": (3, 4, 4), "label": (), "box": (4,)}
    dtype = {"image": torch.uint8, "label": torch.int64, "box": torch.float32}
    row = 3 * 4 * 4 + 8 + 16
    with SharedCache((SLOTS * row + N + 0.5) / 2**30, N, dims, dtype, shm_dir=shm_dir,
                     random_subset=True, disk_tier=tmp_path) as cache:
        for i in range(N):
            cache.set_slot(i, fields_of(i, dims))
        for i in range(N):
            got, want = cache.get_slot(i), fields_of(i, dims)
            assert all(torch.equal(got[k], want[k]) for k in dims), i
        assert cache.stats()["disk_hits"] == N - SLOTS


def test_a_different_value_for_a_stored_row_raises_and_clear_empties_the_tier(
        shm_dir, tmp_path):
    """set_slot's flags mean on a tier row what they mean on a slot: the same value again is
    done already, another raises, exist_ok keeps the first, allow_overwrite replaces it (a
    newcomer found it silently kept)."""
    with tiered(shm_dir, tmp_path) as cache:
        cache.set_slot(20, value_of(20))
        cache.set_slot(20, value_of(20))  # the same value: a second load, done already
        with pytest.raises(RuntimeError, match="idx=20 is already set to a different value"):
            cache.set_slot(20, value_of(21))
        cache.set_slot(20, value_of(21), exist_ok=True)  # kept as it was
        assert torch.equal(cache.get_slot(20), value_of(20))
        cache.set_slot(20, value_of(22), allow_overwrite=True)  # replaced, as a slot would be
        assert torch.equal(cache.get_slot(20), value_of(22))
        cache.set_slot(3, value_of(3))
        cache.set_slot(3, value_of(22), allow_overwrite=True)
        assert torch.equal(cache.get_slot(3), value_of(22))  # (a slot: the same behaviour)
        cache.clear()
        assert cache.get_slot(20) is None and cache.stats()["disk_rows"] == 0
        cache.set_slot(20, value_of(21))
        assert torch.equal(cache.get_slot(20), value_of(21))


def test_disk_tier_gib_gives_rows_to_the_first_indices_of_the_share(shm_dir, tmp_path):
    row = 3 * 8 * 8
    with tiered(shm_dir, tmp_path, disk_tier_gib=(5 * row + 0.5) / 2**30) as cache:
        for i in range(N):
            cache.set_slot(i, value_of(i))
        hits = [i for i in range(SLOTS, N) if cache.get_slot(i) is not None]
        assert hits == list(range(SLOTS, SLOTS + 5))
        assert cache.stats()["disk_tier_rows"] == 5


@pytest.mark.parametrize("nodes,slots,random_subset", [
    (1, 8, False), (1, 8, True), (2, 5, False), (3, 7, False), (4, 3, False), (3, 12, False)])
def test_each_nodes_tier_holds_its_own_indices_that_no_node_holds_in_memory(
        nodes, slots, random_subset):
    lay = CacheLayout(N, slots, nodes, seed=3, random_subset=random_subset)
    memory = lay.owners().any(axis=0)
    tiers = [_tier_indices(lay, k) for k in range(nodes)]
    every = np.concatenate(tiers)
    assert len(np.unique(every)) == len(every)  # disjoint, each index once
    assert not memory[every].any()
    if nodes * slots < N:  # every index is in some node's memory or some node's tier
        assert memory.sum() + len(every) == N
    else:
        assert len(every) == 0
    assert list(_tier_indices(lay, nodes - 1, 2)) == list(tiers[-1][:2])


def test_two_nodes_tiers_hold_disjoint_shares_next_to_their_memory(shm_dir, tmp_path):
    nodes = [tiered(shm_dir, tmp_path, slots=5, layout_seed=1,
                    world=World(rank=k, world_size=2, node_rank=k, num_nodes=2))
             for k in range(2)]
    held = []
    for cache in nodes:
        for i in range(N):
            cache.set_slot(i, value_of(i))
        hits = {i for i in range(N) if cache.get_slot(i) is not None}
        assert all(torch.equal(cache.get_slot(i), value_of(i)) for i in hits)
        memory = set(cache.cached_indices().tolist())
        tier = hits - memory
        assert memory <= hits and len(tier) == cache.stats()["disk_rows"] == (N - 2 * 5) // 2
        held.append((memory, tier))
    (m0, t0), (m1, t1) = held
    assert not (t0 & t1) and not ((t0 | t1) & (m0 | m1))  # disjoint, none held in memory
    assert t0 | t1 | m0 | m1 == set(range(N))  # every index on some node
    for cache in nodes:
        cache.close()
    assert tier_files(tmp_path) == []


def _collate(batch):
    return batch


def _hits_per_epoch(cache, method: str) -> dict[int, int]:
    """Two epochs of a DataLoader with two workers over ``TwoLineDataset``: every value checked,
    the hits of each epoch counted. (Returns no tensor: those of the workers hold /dev/shm.)"""
    loader = torch.utils.data.DataLoader(TwoLineDataset(cache, N), batch_size=4, num_workers=2,
                                         multiprocessing_context=method, collate_fn=_collate)
    hits = {0: 0, 1: 0}
    for epoch in range(2):
        for batch in loader:
            for i, x, hit in batch:
                assert torch.equal(x, value_of(i)), (epoch, i)
                hits[epoch] += hit
    return hits


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_share_the_tier(private_shm_dir, tmp_path, method):
    shm_dir = private_shm_dir  # a tmpfs of its own: the leak check counts its bytes
    with tiered(shm_dir, tmp_path) as cache:
        # the second epoch: 8 from /dev/shm, 24 from the tier
        assert _hits_per_epoch(cache, method) == {0: 0, 1: N}
        s = cache.stats()
        assert (s["disk_hits"], s["disk_rows"]) == (N - SLOTS, N - SLOTS)
    assert tier_files(tmp_path) == []
    assert_no_leak(shm_dir)


def _write_half_then_wait(cache, idx, half_written):
    tier = cache._disk_tier

    def put(offset, data):  # the hook: half of the row, then wait to be killed
        os.pwrite(tier.fd, data[: len(data) // 2], offset)
        half_written.set()
        signal.pause()

    tier._put = put
    cache.set_slot(idx, value_of(idx))


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_row_never_serves_it(shm_dir, tmp_path):
    with tiered(shm_dir, tmp_path) as cache:
        half_written = mp.get_context("fork").Event()
        writer = mp.get_context("fork").Process(target=_write_half_then_wait,
                                                args=(cache, 20, half_written))
        writer.start()
        assert half_written.wait(30), "the writer never wrote half of the row"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        tier = cache._disk_tier
        start = tier._data_off + tier._positions[20] * tier._row_bytes
        half = value_of(20).reshape(-1).numpy()[: 3 * 8 * 8 // 2].tobytes()
        assert os.pread(tier.fd, len(half), start) == half  # the kill came mid-row
        assert cache.get_slot(20) is None
        assert cache.stats()["disk_rows"] == 0
        cache.set_slot(20, value_of(20))  # written again by the next writer (lock released)
        assert torch.equal(cache.get_slot(20), value_of(20))


@pytest.mark.timeout(60)
def test_a_full_disk_leaves_samples_untiered_with_one_message(shm_dir, caplog):
    dims, n, slots = (3, 64, 64), 200, 8  # 192 rows of 12 KiB: 2.3 MiB on a 1 MiB disk
    with mounted("size=1m,mode=0700") as tier:
        with pytest.warns(RuntimeWarning, match="rows that find the disk full are not stored"):
            cache = tiered(shm_dir, tier, n=n, slots=slots, dims=dims)
        with cache, caplog.at_level(logging.WARNING, logger="stocaching"):
            for i in range(n):
                cache.set_slot(i, value_of(i, dims))
            read = [cache.get_slot(i) for i in range(n)]
            stored = cache.stats()["disk_rows"]
        told = [r for r in caplog.records if "failed a write" in r.getMessage()]
        assert len(told) == 1 and "No space left" in told[0].getMessage()
        assert 0 < stored < n - slots
        assert sum(x is not None for x in read) == slots + stored
        assert all(x is None or torch.equal(x, value_of(i, dims)) for i, x in enumerate(read))
        assert tier_files(tier) == []


def test_a_read_only_directory_is_refused_naming_disk_tier(private_shm_dir):
    shm_dir = private_shm_dir  # a tmpfs of its own: the leak check counts its bytes
    with mounted("size=1m,ro") as tier:
        with pytest.raises(OSError, match=f"disk_tier should be a directory where this user "
                                          f"can write files, but got disk_tier='{tier}'"):
            tiered(shm_dir, tier)
        assert os.listdir(tier) == []
    assert_no_leak(shm_dir)


def test_a_persistent_tier_is_read_by_the_next_job_and_cleaned_by_name(shm_dir, tmp_path,
                                                                       capsys):
    kw = dict(name="kept", persistent=True, key="v1")
    with tiered(shm_dir, tmp_path, **kw) as cache:
        for i in range(N):
            cache.set_slot(i, value_of(i))
    assert tier_files(tmp_path) == [f"{_TIER_PREFIX}_{os.getuid()}_persistent_n0_kept"]
    with tiered(shm_dir, tmp_path, **kw) as cache:  # the next job: every sample a hit at once
        assert all(torch.equal(cache.get_slot(i), value_of(i)) for i in range(N))
        assert cache.stats()["disk_hits"] == N - SLOTS
        assert clean_segments(shm_dir, persistent=["kept"], disk_tier=tmp_path) == []  # in use
    assert clean_segments(shm_dir, disk_tier=tmp_path) == []  # kept unless asked by name
    assert main(["--shm-dir", shm_dir, "clean", "--persistent", "kept", "--disk-tier",
                 str(tmp_path)]) == 0
    assert f"removed {tmp_path}/{_TIER_PREFIX}_" in capsys.readouterr().out
    assert tier_files(tmp_path) == [] and named(shm_dir) == []


def _lead_and_wait(shm_dir, tier, made):
    SharedCache(budget_for(SLOTS, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir, name="d",
                job_key="dead", world=World(rank=0, world_size=2, local_world_size=2),
                disk_tier=tier)
    made.set()
    signal.pause()


@pytest.mark.timeout(60)
def test_the_tier_of_a_job_killed_before_its_ranks_attached_is_removed_by_clean(
        shm_dir, tmp_path):
    made = mp.get_context("fork").Event()
    leader = mp.get_context("fork").Process(target=_lead_and_wait,
                                            args=(shm_dir, str(tmp_path), made))
    leader.start()
    assert made.wait(30), "the leader never made its cache"
    os.kill(leader.pid, signal.SIGKILL)
    leader.join(30)
    left = [os.path.join(tmp_path, f) for f in tier_files(tmp_path)]
    assert len(left) == 1 and "_dead_n0_d" in left[0]
    age(left + [os.path.join(shm_dir, f) for f in named(shm_dir)])
    assert left[0] in clean_segments(shm_dir, disk_tier=tmp_path)
    assert tier_files(tmp_path) == [] and named(shm_dir) == []


def test_an_open_size_cache_refuses_a_disk_tier(shm_dir, tmp_path):
    with pytest.raises(ValueError, match="disk_tier is for samples of a fixed size .* but got "
                                         "disk_tier="):
        OpenSizeCache(0.001, N, (None,), shm_dir=shm_dir, disk_tier=tmp_path)
    assert named(shm_dir) == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs,error,match", [
    ({"disk_tier": 5}, TypeError, "disk_tier should be the path of a directory .* but got "
                                  "disk_tier=5"),
    ({"disk_tier": "MISSING"}, ValueError, "disk_tier should be an existing directory"),
    ({"disk_tier": "HERE", "disk_tier_gib": 0}, ValueError, "disk_tier_gib should be a positive"
                                                            " finite number .* disk_tier_gib=0"),
    ({"disk_tier": "HERE", "disk_tier_gib": -1.5}, ValueError, "disk_tier_gib=-1.5"),
    ({"disk_tier": "HERE", "disk_tier_gib": "1"}, TypeError, "disk_tier_gib='1'"),
    ({"disk_tier": "HERE", "disk_tier_gib": True}, TypeError, "disk_tier_gib=True"),
    ({"disk_tier_gib": 1.0}, ValueError, "disk_tier_gib is the budget of a disk tier, so it "
                                         "needs disk_tier="),
])
def test_bad_tier_arguments_are_refused_and_nothing_is_made(private_shm_dir, tmp_path, kwargs,
                                                            error, match):
    shm_dir = private_shm_dir  # a tmpfs of its own: the leak check counts its bytes
    paths = {"HERE": str(tmp_path), "MISSING": str(tmp_path / "missing")}
    kwargs = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        SharedCache(budget_for(SLOTS, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir, **kwargs)
    assert named(shm_dir) == [] and os.listdir(tmp_path) == []
    assert_no_leak(shm_dir)


@pytest.mark.timeout(200)
def test_two_torchrun_ranks_read_each_others_tier_rows(private_shm_dir, tmp_path):
    shm_dir = private_shm_dir  # a tmpfs of its own: the leak check counts its bytes
    tier = tmp_path / "tier"
    tier.mkdir()
    r = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                     "--master_port", str(free_port()), str(CHILDREN / "tier_rank.py")],
                    env=rank_env(shm_dir, TEST_SYNC=tmp_path, TEST_TIER=tier), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads((tmp_path / f"result.{k}.json").read_text()) for k in range(2)]
    assert all(o["ok"] for o in outs) and all(o["named"] == [] for o in outs)
    # each rank read all 24 tier rows, half of them written by the other rank
    assert [o["stats"]["disk_rows"] for o in outs] == [N - SLOTS] * 2
    assert [o["stats"]["disk_hits"] for o in outs] == [2 * (N - SLOTS)] * 2  # node-wide
    assert os.listdir(tier) == []
    assert_no_leak(shm_dir)


def test_the_cache_aware_sampler_routes_tier_rows_to_their_node(shm_dir, tmp_path):
    from stocaching import CacheAwareSampler

    n, slots = 64, 8  # 16 in memory over both nodes; 48 on the tiers, 24 each
    nodes = [tiered(shm_dir, tmp_path, n=n, slots=slots, layout_seed=2,
                    world=World(rank=k, world_size=2, node_rank=k, num_nodes=2))
             for k in range(2)]
    fast = [set(np.flatnonzero(c.slot_mask()).tolist()) |
            set(_tier_indices(c.layout, k).tolist()) for k, c in enumerate(nodes)]
    assert not fast[0] & fast[1] and len(fast[0] | fast[1]) == n
    rows = list(nodes[0].owner_rows())
    assert [set(np.flatnonzero(r).tolist()) for r in rows] == fast
    for k, cache in enumerate(nodes):
        # A global batch goes half to each node, so a batch with more than its half on one
        # node's rows spills some: most, not all, of each rank's indices are its node's own.
        got = list(CacheAwareSampler(cache, num_replicas=2, rank=k, batch_size=8, seed=0))
        memory_only = list(CacheAwareSampler(cache.layout, num_replicas=2, rank=k,
                                             batch_size=8, seed=0))
        own = sum(i in fast[k] for i in got)
        assert len(got) == n // 2 and own >= 0.8 * len(got)
        assert own > sum(i in fast[k] for i in memory_only)
    for cache in nodes:
        cache.close()


@pytest.mark.timeout(120)
def test_a_prefetcher_stages_tier_rows_instead_of_loading_them(shm_dir, tmp_path):
    sys.path.insert(0, str(CHILDREN))  # prefetch_common, as tests/test_prefetch.py does
    from prefetch_common import (BATCH, DIMS, STAGING, Loads, PrefetchedDataset, Shuffled,
                                 load_counts, loads_since, read_epoch)
    from stocaching import Prefetcher

    n, slots = 64, 32
    loads, tier = tmp_path / "loads", tmp_path / "tier"
    loads.mkdir()
    tier.mkdir()
    cache = SharedCache(budget_for(slots, DIMS, staging=STAGING, dataset_len=n), n, DIMS,
                        shm_dir=shm_dir, staging_slots=STAGING, disk_tier=tier)
    pf = Prefetcher(Shuffled(n, seed=1), cache, Loads(loads, "prefetcher"), threads=2,
                    lookahead=8, stand_aside=False)
    loader = torch.utils.data.DataLoader(PrefetchedDataset(cache, n, Loads(loads, "worker")),
                                         batch_size=BATCH, sampler=pf)
    new = []
    for epoch in range(2):
        pf.set_epoch(epoch)
        before, loaded = cache.stats(), load_counts(loads)
        assert sorted(read_epoch(loader)) == list(range(n))
        s = cache.stats(since=before)
        new.append(loads_since(loads, loaded))
    assert new[0] == {i: ["prefetcher"] for i in range(n)}  # epoch 1 loads every index
    assert new[1] == {}  # epoch 2: /dev/shm, or the tier's rows read and staged: no load
    assert (s["hits"], s["staged_hits"], s["disk_reads"], s["misses"]) == (n, n - slots,
                                                                           n - slots, 0)
    pf.close()
    cache.close()


def test_a_disk_tier_in_memory_warns_and_still_works(shm_dir):
    """A tier on a tmpfs (here the segment's own /dev/shm directory) takes RAM the segment
    could use faster: a warning says so, at the caller's line; the tier still works."""
    with pytest.warns(RuntimeWarning, match="in memory") as caught:
        cache = tiered(shm_dir, shm_dir)
    assert caught[0].filename == __file__
    with cache:
        cache.set_slot(20, value_of(20))
        assert torch.equal(cache.get_slot(20), value_of(20))
        assert cache.stats()["disk_hits"] == 1
