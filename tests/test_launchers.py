"""Every way people launch DDP gets one cache per node, the README example survives ranks that
load one index at once, and the 0.2.1 names and behaviours that code relies on still work."""

from __future__ import annotations

import copy
import ctypes
import json
import os
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, Subset

from _helpers import (CHILDREN, LAUNCHERS, TwoLineDataset, assert_no_leak, budget_for, free_port,
                      named, rank_env, run_child, value_of)
from stocaching import (BYTES_PER_GIB, C_DTYPES, CacheAwareSampler, SharedCache, SlotState,
                        World)
from stocaching.stocaching import _job_key

# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun, 2 nodes", "srun", "none"])
def test_launchers_that_start_local_ranks_side_by_side_need_no_agreement(launcher):
    """torchrun, srun and mp.spawn (no variables; a World made by hand) start the local ranks
    from one parent: the key comes from it, with no process group to ask."""
    env, world = LAUNCHERS[launcher]
    if launcher == "none":
        world = World(rank=1, world_size=2, local_rank=1, local_world_size=2)
    key = _job_key(world, env)
    assert re.fullmatch(r"[0-9a-f]{12}", key) and key == _job_key(world, env)
    assert _job_key(world, {**env, "STOCACHING_JOB_KEY": "mine"}) == "mine"


def test_lightnings_variables_without_a_process_group_fail_at_once(shm_dir, monkeypatch):
    """Lightning's launcher starts ranks 1.. as children of rank 0: without a process group
    to agree through, the parent process id says nothing, and a cache made then would wait
    its whole timeout for a segment it cannot find."""
    env, world = LAUNCHERS["Lightning (LOCAL_RANK, NODE_RANK, WORLD_SIZE; no RANK)"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("STOCACHING_JOB_KEY", raising=False)
    with pytest.raises(RuntimeError, match=r"local rank 1 of 2 cannot find .*LOCAL_RANK=1, "
                                           r"NODE_RANK=0, WORLD_SIZE=2.*STOCACHING_JOB_KEY"):
        SharedCache(1e-4, 10, (4,), timeout=300)
    assert named(shm_dir) == []
    monkeypatch.setenv("STOCACHING_JOB_KEY", "by-hand")  # the way out it names
    assert _job_key(world) == "by-hand"


@pytest.mark.timeout(180)
def test_mp_spawn_ranks_share_one_cache(tmpfs):
    """PyTorch's DDP tutorial: mp.spawn + init_process_group, no launcher variables."""
    r = run_child("spawn_ranks.py", tmpfs, free_port(), env=rank_env(tmpfs), timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for local_rank, rank in enumerate(out["ranks"]):
        assert rank["world"] == [local_rank, 2, 0, 1]  # local rank, ranks per node, node, nodes
        assert rank["reads_rank0_write"], "rank 1 does not see what rank 0 wrote"
        assert rank["segments"] == 1, "each rank has a cache of its own"
        assert rank["len"] == rank["len_distributed"] == 50
    assert out["covered"] == list(range(100))  # the ranks' samplers cover it exactly once
    assert_no_leak(tmpfs)


@pytest.mark.timeout(300)
def test_readme_example_under_torchrun_with_every_rank_reading_every_index(tmpfs):
    """Two ranks, two workers each, no DistributedSampler: processes load one index at once.
    Ten rounds, each with a new cache; each must end full, once per node, without an error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(CHILDREN / "readme_every_rank.py")]
    r = subprocess.run(cmd, env=rank_env(tmpfs), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rounds = re.findall(r"round (\d) filled (\d+) of 96, segments (\d+)", r.stdout)
    assert [int(k) for k, _, _ in rounds] == list(range(10)), r.stdout
    assert all(filled == "96" and segs == "1" for _, filled, segs in rounds), rounds
    assert_no_leak(tmpfs)


@pytest.mark.timeout(200)
def test_a_leader_done_before_another_rank_constructs_waits_for_it(tmpfs, tmp_path):
    """Rank 0 fills the cache and closes it before rank 1 constructs it: rank 0's close waits
    for rank 1 to attach (its timeout) instead of taking the segment away, so rank 1 attaches
    and reads everything rank 0 wrote, and nothing is left behind."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(CHILDREN / "leader_leaves_first.py"), tmpfs,
           str(tmp_path / "closing")]
    r = subprocess.run(cmd, env=rank_env(tmpfs), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hits 32 of 32" in r.stdout and "closed" in r.stdout, r.stdout
    assert_no_leak(tmpfs)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sibling", [True, False])
def test_a_leader_waits_for_missing_ranks_only_while_one_may_come(tmpfs, sibling):
    """Rank 1 never constructs the cache. With another process of the same parent alive (as
    the other local ranks are under torchrun or mp.spawn), the leader's close waits its
    timeout, then warns and lets go; when it is its parent's only child, nobody can come, and
    close returns at once. Either way nothing is left in the tmpfs."""
    child = f"'{sys.executable}' '{CHILDREN / 'lone_leader.py'}' '{tmpfs}'"
    script = f"sleep 120 & {child} 2; kill $!" if sibling else f"{child} 100; true"
    r = subprocess.run(["sh", "-c", script], env=rank_env(tmpfs, rank=0), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    took = float(re.fullmatch(r"closed in ([\d.]+) s", r.stdout.strip()).group(1))
    if sibling:
        assert took >= 2 and "not all of them did" in r.stderr, (took, r.stderr[-2000:])
    else:
        assert took < 50 and "not all of them did" not in r.stderr, (took, r.stderr[-2000:])
    assert_no_leak(tmpfs)


# ----------------------------------------------------------------------------------------------
# CacheAwareSampler with DistributedSampler's arguments
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def cached(shm_dir):
    cache = SharedCache(budget_for(50, (3, 8, 8), dataset_len=100), 100, (3, 8, 8),
                        shm_dir=shm_dir, world=World())
    yield TwoLineDataset(cache, 100)
    cache.close()


def test_explicit_replicas_and_rank_with_no_environment(cached):
    per_rank = []
    for rank in range(4):
        ours = CacheAwareSampler(cached, 4, rank, True, 0, False, batch_size=16)  # positional
        theirs = DistributedSampler(cached, 4, rank)
        assert len(ours) == len(theirs) == 25
        per_rank.append(list(ours))
    assert sorted(sum(per_rank, [])) == list(range(100))


def test_a_dataset_without_a_cache_gets_what_distributed_sampler_gives():
    class NoCache(torch.utils.data.Dataset):
        cache = None

        def __len__(self):
            return 37

    with pytest.warns(UserWarning, match="has no cache"):
        ours = CacheAwareSampler(NoCache(), num_replicas=3, rank=2, batch_size=4)
    theirs = DistributedSampler(NoCache(), num_replicas=3, rank=2)
    for epoch in range(3):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)


def test_a_subset_of_a_cached_dataset_is_routed_by_the_index_behind_it(shm_dir):
    world = World(rank=0, world_size=2, node_rank=0, num_nodes=2)  # node 0 of 2
    cache = SharedCache(budget_for(30, (3, 8, 8), dataset_len=100), 100, (3, 8, 8),
                        shm_dir=shm_dir, world=world)
    try:
        behind = np.random.default_rng(0).permutation(100)[:60]
        subset = Subset(TwoLineDataset(cache, 100), behind.tolist())
        held = set(cache.cached_indices().tolist())
        with warnings.catch_warnings():  # rank 1 is on node 1, this cache on node 0
            warnings.simplefilter("ignore")
            ranks = [list(CacheAwareSampler(subset, 2, r, batch_size=10)) for r in range(2)]
        assert sorted(ranks[0] + ranks[1]) == list(range(60))  # positions in the subset
        plain = list(DistributedSampler(subset, 2, 0))
        hits = sum(int(behind[p]) in held for p in ranks[0])
        assert hits >= sum(int(behind[p]) in held for p in plain)
    finally:
        cache.close()


# ----------------------------------------------------------------------------------------------
# 0.2.1 names and behaviours
# ----------------------------------------------------------------------------------------------


def test_the_021_module_names_are_exported():
    assert [s.value for s in SlotState][:3] == [0, 1, 2]
    assert SlotState(1) is SlotState.SET and SlotState.OOB.value == 2
    assert BYTES_PER_GIB == 1024**3
    for dtype, ctype in {torch.bool: ctypes.c_bool, torch.uint8: ctypes.c_uint8,
                         torch.int8: ctypes.c_int8, torch.int16: ctypes.c_int16,
                         torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64,
                         torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}.items():
        assert C_DTYPES[dtype] is ctype


def test_extra_leading_unit_dimensions_are_dropped_as_in_021(shm_dir):
    with SharedCache(1e-4, 10, (3, 4, 4), shm_dir=shm_dir) as c:
        x = value_of(2, (3, 4, 4))
        c.set_slot(2, x.unsqueeze(0))
        c.set_slot(3, x[None, None])
        assert torch.equal(c.get_slot(2), x) and torch.equal(c.get_slot(3), x)
        with pytest.raises(ValueError, match=r"shape \(3, 4, 4\).*value.shape=\(2, 3, 4, 4\)"):
            c.set_slot(4, torch.stack([x, x]))
        with pytest.raises(ValueError, match=r"value.shape=\(1, 4, 4\)"):
            c.set_slot(4, x[:1])  # broadcasting along a real dimension stays refused
        assert c.aux_array[4] == 0


def test_the_same_value_twice_is_a_no_op_and_a_different_one_raises(shm_dir):
    with SharedCache(1e-4, 10, (3, 4, 4), shm_dir=shm_dir) as c:
        x = value_of(1, (3, 4, 4))
        c.set_slot(1, x)
        c.set_slot(1, x.clone())  # what a second process loading index 1 does
        with pytest.raises(RuntimeError, match="already set to a different value.*augment"):
            c.set_slot(1, x + 1)
        assert torch.equal(c.get_slot(1), x) and c.stats()["writes"] == 2  # the no-op counts
        nan = SharedCache(1e-4, 10, (2,), torch.float32, shm_dir=shm_dir)
        nan.set_slot(0, torch.tensor([float("nan"), 1.0]))
        nan.set_slot(0, torch.tensor([float("nan"), 1.0]))  # NaN bytes equal: still a no-op
        nan.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_pickle_outside_a_process_start_is_refused_and_deepcopy_is_private(shm_dir):
    c = SharedCache(1e-4, 10, (3, 4, 4), shm_dir=shm_dir)
    c.set_slot(1, value_of(1, (3, 4, 4)))

    def round_trip():
        with pytest.raises(TypeError, match="pickled only by multiprocessing"):
            pickle.dumps(c)
        twin = copy.deepcopy(c)
        assert torch.equal(twin.get_slot(1), value_of(1, (3, 4, 4)))
        twin.set_slot(2, value_of(2, (3, 4, 4)))
        assert c.get_slot(2) is None  # independent of the original
        twin.close()

    round_trip()  # the first may open what a process keeps open (lazy imports)
    before = _fds()
    for _ in range(100):
        round_trip()
    assert _fds() == before, "a round trip leaked a descriptor"
    assert copy.copy(c) is c
    assert os.listdir(shm_dir) == []  # private copies never had a name
    c.close()
    with pytest.raises(ValueError, match="closed.*construct it again"):
        c.get_slot(1)


def test_a_bfloat16_value_into_an_integer_cache_is_checked_not_a_numpy_error(shm_dir):
    with SharedCache(1e-4, 10, (4,), shm_dir=shm_dir) as c:
        c.set_slot(0, torch.ones(4, dtype=torch.bfloat16))
        assert torch.equal(c.get_slot(0), torch.ones(4, dtype=torch.uint8))
        with pytest.raises(ValueError, match="value.dtype=torch.bfloat16"):
            c.set_slot(1, torch.full((4,), 0.5, dtype=torch.bfloat16))


def test_stats_since_gives_the_rate_of_an_interval(shm_dir):
    with SharedCache(1e-4, 10, (4,), shm_dir=shm_dir) as c:
        c.get_slot(0)  # a miss before the "epoch"
        c.set_slot(0, torch.zeros(4, dtype=torch.uint8))
        before = c.stats()
        c.get_slot(0)
        assert c.stats(since=before)["hit_rate"] == 1.0
        assert c.stats()["hit_rate"] == 0.5
        with pytest.raises(TypeError, match="since should be a dict from this cache's stats"):
            c.stats(since={"hits": 1})


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


