"""Whole-batch reads: ``SharedCache.get_batch`` gathers the rows of several indices at once and
says which were cached; every row is what ``get_slot`` would give, never a half-written one."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import (BatchedDataset, assert_no_leak, assert_the_killed_write_is_a_miss,
                      budget_for, racing_writers, ranks_with_a_killed_writer, value_of)
from stocaching import BYTES_PER_GIB, SharedCache, World

DIMS = (3, 4, 4)
N = 60


def node_world(node: int, nodes: int) -> World:
    """One process per node: node ``node`` of a job of ``nodes`` nodes."""
    return World(rank=node, world_size=nodes, node_rank=node, num_nodes=nodes)


def filled(c: SharedCache, dtype: torch.dtype, every: int = 2) -> list[int]:
    """Store every ``every``-th index that has a slot here; return those indices."""
    held = [int(i) for i in c.cached_indices()][::every]
    for i in held:
        c.set_slot(i, value_of(i, DIMS).to(dtype))
    return held


def counters(c: SharedCache) -> tuple[int, int, int]:
    s = c.stats()
    return s["hits"], s["misses"], s["oob_misses"]


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.complex64,
                                   torch.bool])
def test_rows_hits_and_counts_are_those_of_get_slot(shm_dir, dtype, nodes):
    gib = budget_for(40, DIMS, dtype, dataset_len=N)
    with SharedCache(gib, N, DIMS, dtype, shm_dir=shm_dir, world=node_world(nodes - 1, nodes)) \
            as c:
        held = filled(c, dtype)
        assert 0 < len(held) < len(c) < N  # hits, empty slots and indices without a slot
        idx = np.random.default_rng(0).integers(0, N, 200).tolist()  # with repeats
        before = counters(c)
        batch, hit = c.get_batch(idx)
        after = counters(c)
        assert batch.shape == (len(idx), *DIMS) and batch.dtype == dtype
        assert hit.dtype == torch.bool and hit.shape == (len(idx),)
        singles = [c.get_slot(i) for i in idx]
        assert [h.item() for h in hit] == [s is not None for s in singles]
        assert {idx[k] for k in range(len(idx)) if hit[k]} == set(held) & set(idx)
        for k, s in enumerate(singles):
            assert torch.equal(batch[k], s if s is not None else torch.zeros(DIMS, dtype=dtype))
        # the same counts as the get_slot calls that followed
        assert tuple(a - b for a, b in zip(after, before)) == \
            tuple(a - b for a, b in zip(counters(c), after))


@pytest.mark.parametrize("make", [list, tuple, np.array, torch.tensor,
                                  lambda x: np.array(x, dtype=np.uint16),
                                  lambda x: torch.tensor(x, dtype=torch.int32),
                                  lambda x: [np.int64(i) for i in x],
                                  lambda x: [torch.tensor(i) for i in x]],
                         ids=["list", "tuple", "ndarray", "tensor", "uint16", "int32",
                              "numpy-scalars", "tensor-scalars"])
def test_every_form_of_indices_gives_the_same_batch(shm_dir, make):
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        filled(c, torch.uint8)
        idx = [5, 0, 59, 4, 4, 7]
        want, want_hit = c.get_batch(idx)
        got, hit = c.get_batch(make(idx))
        assert torch.equal(got, want) and torch.equal(hit, want_hit)
        assert hit.tolist() == [False, True, False, True, True, False]
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        rng = c.get_batch(range(3, 9))[0]
        assert rng.shape == (6, *DIMS)


def test_no_indices_give_an_empty_batch(shm_dir):
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        batch, hit = c.get_batch([])
        assert batch.shape == (0, *DIMS) and hit.shape == (0,)
        assert counters(c) == (0, 0, 0)


def test_out_is_filled_and_returned_and_rows_of_misses_are_zeroed(shm_dir):
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        filled(c, torch.uint8)
        out = torch.full((4, *DIMS), 7, dtype=torch.uint8)
        batch, hit = c.get_batch([0, 1, 2, 50], out=out)
        assert batch is out
        assert hit.tolist() == [True, False, True, False]
        assert torch.equal(out[0], value_of(0, DIMS)) and torch.equal(out[2], value_of(2, DIMS))
        assert not out[1].any() and not out[3].any()


def test_a_cache_without_slots_misses_every_row(shm_dir):
    with pytest.warns(RuntimeWarning, match="no slots"):
        c = SharedCache(N / 2 / BYTES_PER_GIB, N, DIMS, shm_dir=shm_dir)
    with c:
        batch, hit = c.get_batch([0, 1, 59])
        assert not hit.any() and not batch.any()
        assert counters(c) == (0, 3, 3)


def test_staged_samples_are_taken_once_as_get_slot_takes_them(shm_dir):
    gib = budget_for(10, DIMS, dataset_len=N) + 2 * math.prod(DIMS) / BYTES_PER_GIB
    with SharedCache(gib, N, DIMS, shm_dir=shm_dir, staging_slots=2) as c:
        c.set_slot(3, value_of(3, DIMS))
        assert c.stage(50, value_of(50, DIMS))
        batch, hit = c.get_batch([3, 50, 50, 51])
        assert hit.tolist() == [True, True, False, False]
        assert torch.equal(batch[1], value_of(50, DIMS)) and not batch[2:].any()
        s = c.stats()
        assert (s["hits"], s["staged_hits"], s["staged"], s["misses"], s["oob_misses"]) == \
            (2, 1, 0, 2, 2)
        assert c.stage(51, value_of(51, DIMS))  # its staging slot was freed


def test_a_slot_being_written_or_cleared_is_a_miss(shm_dir):
    """The writer's own protocol (the slot's lock, an odd sequence number) held around the
    read: the row is a miss, not the half-written bytes; the other rows still hit."""
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        for i in range(4):
            c.set_slot(i, value_of(i, DIMS))
        with c._writing(2, 1):
            c._slot_samples[2] = 0
            batch, hit = c.get_batch(range(4))
        assert hit.tolist() == [True, True, False, True]
        assert not batch[2].any() and torch.equal(batch[3], value_of(3, DIMS))
        c.clear()
        batch, hit = c.get_batch(range(4))
        assert not hit.any() and not batch.any()


def _bad_index_cases():
    yield [1.5], TypeError, r"indices\[0\]=1\.5 \(type float\)"
    yield [0, True], TypeError, r"indices\[1\]=True \(type bool\)"
    yield "012", TypeError, r"indices='012' \(type str\)"
    yield None, TypeError, r"indices=None"
    yield {0, 1}, TypeError, r"type set"
    yield np.array([[0, 1]]), TypeError, r"shape \(1, 2\)"
    yield np.array([0.0]), TypeError, r"dtype float64"
    yield torch.tensor([True]), TypeError, r"dtype torch\.bool"
    yield [[0]], TypeError, r"indices\[0\]=\[0\]"
    yield [0, N], IndexError, rf"\[0, {N - 1}\], but got indices\[1\]={N}"
    yield np.array([-1]), IndexError, r"indices\[0\]=-1"


@pytest.mark.parametrize("indices,exc,match", list(_bad_index_cases()))
def test_bad_indices_name_the_parameter_and_change_nothing(shm_dir, indices, exc, match):
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        c.set_slot(0, value_of(0, DIMS))
        with pytest.raises(exc, match=match) as e:
            c.get_batch(indices)
        assert "indices should be" in str(e.value)
        assert counters(c) == (0, 0, 0)


@pytest.mark.parametrize("out,exc,match", [
    (np.zeros((2, *DIMS), np.uint8), TypeError, "type ndarray"),
    (torch.zeros((2, *DIMS), dtype=torch.float32), TypeError, "dtype torch.float32"),
    (torch.zeros((3, *DIMS), dtype=torch.uint8), ValueError, r"shape \(2, 3, 4, 4\).*\(3, 3"),
    (torch.zeros((2, 3, 4, 8), dtype=torch.uint8)[..., ::2], ValueError, "contiguous=False"),
])
def test_a_bad_out_names_the_parameter_and_is_left_alone(shm_dir, out, exc, match):
    with SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir) as c:
        c.set_slot(0, value_of(0, DIMS))
        keep = out.copy() if isinstance(out, np.ndarray) else out.clone()
        with pytest.raises(exc, match=match) as e:
            c.get_batch([0, 1], out=out)
        assert "out should be" in str(e.value)
        assert (out == keep).all() and counters(c) == (0, 0, 0)


def test_out_with_requires_grad_is_refused(shm_dir):
    with SharedCache(budget_for(40, DIMS, torch.float32, dataset_len=N), N, DIMS, torch.float32,
                     shm_dir=shm_dir) as c:
        out = torch.zeros((1, *DIMS), requires_grad=True)
        with pytest.raises(ValueError, match="requires_grad=True"):
            c.get_batch([0], out=out)


def test_a_closed_cache_says_so(shm_dir):
    c = SharedCache(budget_for(40, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir)
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.get_batch([0])


# ----------------------------------------------------------------------------------------------
# Concurrent writers and clears: real processes, every row checked
# ----------------------------------------------------------------------------------------------

WIDTH, SLOTS = 64, 24


def _versions() -> np.ndarray:
    """table[i, v]: the value of index i at version v. Byte 0 is v, so a row names the version
    it must equal in full; a torn row (bytes of two versions) or a zeroed one cannot."""
    i = np.arange(SLOTS)[:, None, None]
    v = np.arange(256)[None, :, None]
    k = np.arange(WIDTH)[None, None, :]
    t = ((i * 31 + v * 17 + k * 7 + 3) % 251 + 1).astype(np.uint8)
    t = np.array(np.broadcast_to(t, (SLOTS, 256, WIDTH)))
    t[:, :, 0] = np.arange(256)
    return t


def _overwrite(cache: SharedCache, seed: int, writing, stop) -> None:
    """A writer process: overwrite random slots with random versions, and clear() now and
    then, until ``stop`` is set; ``writing`` is set after its first write."""
    torch.set_num_threads(1)
    values = torch.from_numpy(_versions())
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        for i, v, p in zip(*(rng.integers(0, m, 500).tolist() for m in (SLOTS, 256, 1000))):
            if p == 0:
                cache.clear()
            cache.set_slot(i, values[i, v], allow_overwrite=True)
            writing.set()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_writers_and_clears_never_give_a_torn_row(tmpfs, method):
    table = _versions()
    with SharedCache(budget_for(SLOTS, (WIDTH,), dataset_len=SLOTS), SLOTS, (WIDTH,),
                     shm_dir=tmpfs) as c:
        for i in range(SLOTS):
            c.set_slot(i, torch.from_numpy(table[i, 0]))
        with racing_writers(_overwrite, c, method):
            rng = np.random.default_rng(1)
            hits = misses = batches = 0
            torn = []
            writes_before = c.stats()["writes"]
            # Read until the writers have stored 20000 values meanwhile (a count, not a time;
            # the deadline is only a ceiling for a hang).
            deadline = time.monotonic() + 120
            while batches < 2000 or c.stats()["writes"] - writes_before < 20000:
                assert time.monotonic() < deadline, "writers stalled"
                batches += 1
                idx = rng.integers(0, SLOTS, 32)
                batch, hit = c.get_batch(idx)
                rows, h = batch.numpy(), hit.numpy()
                want = table[idx, rows[:, 0]]
                bad = h & (rows != want).any(1)
                torn += [(int(i), rows[k].tolist()) for k, i in enumerate(idx) if bad[k]]
                assert not rows[~h].any()  # a miss is zeros
                hits += int(h.sum())
                misses += int((~h).sum())
            written = c.stats()["writes"] - writes_before
        assert torn == []
        assert hits > 0 and written > 0, (hits, misses, written)  # it did race real writes
    assert_no_leak(tmpfs)


# ----------------------------------------------------------------------------------------------
# A writer killed halfway through a copy; the recipe in DataLoader workers
# ----------------------------------------------------------------------------------------------

FT_N, FT_D = 32, 1024  # tests/children/job.py's defaults


@pytest.mark.timeout(300)
def test_a_writer_killed_mid_copy_leaves_a_miss_in_a_batch(tmpfs, children):
    """Rank 1 stops halfway through copying index N-1 and is killed: rank 0's get_batch of
    every index hits the others and misses that one, which can then be written."""
    lead = ranks_with_a_killed_writer(children, tmpfs, f"batchkill{os.getpid()}", FT_N - 1)
    assert_the_killed_write_is_a_miss(lead, FT_N, probes=("batch",))
    assert_no_leak(tmpfs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_getitems_recipe_in_dataloader_workers(tmpfs, method):
    """Two epochs through the README's ``__getitems__`` recipe: the first loads and stores
    every sample in the workers, the second reads them all back from the cache."""
    n, dims = 48, (3, 8, 8)
    with SharedCache(budget_for(n - 8, dims, dataset_len=n), n, dims, shm_dir=tmpfs) as c:
        dl = DataLoader(BatchedDataset(c, n), batch_size=8, shuffle=True, num_workers=2,
                        multiprocessing_context=method,
                        generator=torch.Generator().manual_seed(0))
        for epoch in range(2):
            seen = []
            for idx, x, hit in dl:
                for i, v in zip(idx.tolist(), x):
                    assert torch.equal(v, value_of(i, dims)), (epoch, i)
                seen += [(i, h) for i, h in zip(idx.tolist(), hit.tolist())]
            assert sorted(i for i, _ in seen) == list(range(n))
            assert sum(h for _, h in seen) == (0 if epoch == 0 else n - 8)
        s = c.stats()
        assert (s["hits"], s["misses"], s["oob_misses"]) == (n - 8, n + 8, 16)
    assert_no_leak(tmpfs)
