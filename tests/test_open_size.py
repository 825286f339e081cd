"""Open sizes: a None in ``data_dims`` stores each sample at its own size in an arena inside
the segment, with a record per index (offset, bytes, open sizes); samples are admitted while
there is room, and every guarantee of the fixed-size cache holds."""

from __future__ import annotations

import copy
import math
import os
import re
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import (TwoLineDataset, assert_no_leak, assert_the_killed_write_is_a_miss,
                      racing_writers, ranks_with_a_killed_writer, value_of)
from stocaching import (BYTES_PER_GIB, BaseCache, CacheCapacityError, CacheConfigError,
                        OpenSizeCache, SharedCache, World, plan)
from stocaching import cli, open_size

N = 40


def cloud(i: int, points: int | None = None) -> torch.Tensor:
    """A point cloud of ``i % 7 + 1`` (or ``points``) points: (points, 3) float32, values of i."""
    p = i % 7 + 1 if points is None else points
    return torch.arange(p * 3, dtype=torch.float32).reshape(p, 3) + i * 1000


def limit_for(arena: int, n: int = N, words: int = 5) -> float:
    """size_limit_gib that leaves an arena of exactly ``arena`` bytes (a multiple of 16)."""
    return (arena + n * (1 + 8 * words)) / BYTES_PER_GIB


def test_samples_of_any_size_round_trip(shm_dir):
    with OpenSizeCache(0.001, N, (None, 3), torch.float32, shm_dir=shm_dir) as c:
        assert isinstance(c, BaseCache) and not isinstance(c, SharedCache) and len(c) == N
        for i in range(N):
            c.set_slot(i, cloud(i))
        for i in range(N):
            assert torch.equal(c.get_slot(i), cloud(i))
        view = c.get_slot(5, copy=False)
        assert torch.equal(view, cloud(5))
        got = c.get_slot(5)
        got += 1  # a copy
        assert torch.equal(c.get_slot(5), cloud(5))
        s = c.stats()
        assert (s["filled"], s["writes"], s["hits"], s["full"]) == (N, N, N + 3, 0)
        # the bytes handed out are the samples', each rounded up to 16
        assert s["arena_used"] == sum(-(-cloud(i).numel() * 4 // 16) * 16 for i in range(N))


def _store_large(cache, i, value, done):
    cache.set_slot(i, value, allow_overwrite=True)
    done.put(i)


def test_large_samples_are_written_through_the_file_and_read_everywhere(shm_dir):
    # A sample of at least _WRITE_THROUGH_FILE bytes goes into the arena by pwrite on the
    # segment's file, not through the mapping; readers (this process and another) see it.
    import multiprocessing as mp

    big = torch.arange(3 * 100 * 110, dtype=torch.int64).remainder(251).to(torch.uint8)
    big = big.reshape(3, 100, 110)
    assert big.numel() >= open_size._WRITE_THROUGH_FILE > 3 * 10 * 10
    small = torch.full((3, 10, 10), 7, dtype=torch.uint8)
    with OpenSizeCache(0.001, N, (3, None, None), torch.uint8, shm_dir=shm_dir) as c:
        c.set_slot(0, big)
        c.set_slot(1, small)
        assert torch.equal(c.get_slot(0), big) and torch.equal(c.get_slot(1), small)
        ctx = mp.get_context("fork")
        done = ctx.SimpleQueue()
        for i, value in ((2, big.flip(0)), (0, 255 - big)):  # new room; overwrite in place
            p = ctx.Process(target=_store_large, args=(c, i, value, done))
            p.start()
            assert done.get() == i
            p.join(60)
            assert p.exitcode == 0
        assert torch.equal(c.get_slot(2), big.flip(0))
        assert torch.equal(c.get_slot(0), 255 - big)
        assert torch.equal(c.get_slot(0, copy=False), 255 - big)
        assert torch.equal(c.get_slot(1), small)
        s = c.stats()
        assert (s["filled"], s["full"]) == (3, 0)
        assert s["arena_used"] == 2 * -(-big.numel() // 16) * 16 + 304  # 0 kept its place


def test_images_of_many_sizes_and_fields_with_open_and_fixed_sizes(shm_dir):
    dims = {"image": (3, None, None), "label": (), "boxes": (None, 4)}
    dtype = {"image": torch.uint8, "label": torch.int64, "boxes": torch.float32}
    rng = np.random.default_rng(0)
    samples = {}
    with OpenSizeCache(0.001, N, dims, dtype, shm_dir=shm_dir) as c:
        assert c.fields == ("image", "label", "boxes") and c.data_dims == dims
        for i in range(N):
            h, w, b = (int(x) for x in rng.integers(1, 12, 3))
            samples[i] = {"image": value_of(i, (3, h, w)), "label": torch.tensor(i),
                          "boxes": torch.rand(b, 4, generator=torch.Generator().manual_seed(i))}
            c.set_slot(i, {**samples[i], "label": i})  # a number for the scalar
        for i in range(N):
            got = c.get_slot(i)
            assert list(got) == list(dims)
            assert all(torch.equal(got[k], samples[i][k]) for k in dims)


def test_the_budget_is_honoured_exactly_and_a_full_arena_makes_misses(shm_dir):
    arena = 16 * 20  # room for 20 samples of 1-4 points padded to 16 B... or fewer bigger ones
    limit = limit_for(arena)
    sizes = [cloud(i, 3).numel() * 4 for i in range(N)]  # 36 B each: 48 with padding
    with OpenSizeCache(limit, N, (None, 3), torch.float32, shm_dir=shm_dir) as c:
        s = c.stats()
        assert s["arena_bytes"] == arena
        # the budget: aux (1 B) and a record (5 int64) per index, and the arena
        assert N * (1 + 8 * 5) + arena == round(limit * BYTES_PER_GIB)
        for i in range(N):
            c.set_slot(i, cloud(i, 3))
        fits = arena // 48
        assert [c.get_slot(i) is not None for i in range(N)] == [True] * fits + \
            [False] * (N - fits)
        s = c.stats()
        assert (s["filled"], s["full"], s["writes"], s["arena_used"]) == \
            (fits, N - fits, fits, fits * 48)
        assert sum(sizes[:fits]) <= s["arena_used"] <= arena
        # a smaller sample still fits in what is left
        assert arena - fits * 48 == 32
        c.set_slot(N - 1, cloud(N - 1, 2))  # 24 B: 32 with padding
        assert torch.equal(c.get_slot(N - 1), cloud(N - 1, 2))
        assert c.stats()["arena_used"] == arena


def test_overwrite_keeps_its_place_or_moves_or_empties_and_clear_gives_all_back(shm_dir):
    arena = 16 * 12
    with OpenSizeCache(limit_for(arena), N, (None, 3), torch.float32, shm_dir=shm_dir) as c:
        c.set_slot(0, cloud(0, 4))  # 48 B
        c.set_slot(1, cloud(1, 4))  # 48 B: 96 used
        c.set_slot(0, cloud(0, 2), allow_overwrite=True)  # 24 B fits its 48: in place
        assert torch.equal(c.get_slot(0), cloud(0, 2)) and c.stats()["arena_used"] == 96
        c.set_slot(0, cloud(0, 5), allow_overwrite=True)  # 60 B: moves to new room (64)
        assert torch.equal(c.get_slot(0), cloud(0, 5)) and c.stats()["arena_used"] == 160
        c.set_slot(1, cloud(1, 8), allow_overwrite=True)  # 96 B: no room left (32): emptied
        assert c.get_slot(1) is None
        s = c.stats()
        assert (s["filled"], s["full"], s["arena_used"]) == (1, 1, 160)
        # the emptied index keeps no place: a sample that would fit its old 48 B needs new
        # room (issue 11's fuzz model had it written in place)
        c.set_slot(2, cloud(2, 2))  # 24 B: the last 32 B of the arena
        c.set_slot(1, cloud(1, 2), allow_overwrite=True)  # 24 B, no room: still a miss
        s = c.stats()
        assert c.get_slot(1) is None and (s["filled"], s["full"], s["arena_used"]) == (2, 2, 192)
        with pytest.raises(RuntimeError, match="already set to a different value"):
            c.set_slot(0, cloud(0, 1))
        c.set_slot(0, cloud(0, 5))  # the same value again: a no-op
        c.set_slot(0, cloud(0, 1), exist_ok=True)
        assert torch.equal(c.get_slot(0), cloud(0, 5))
        c.clear()
        s = c.stats()
        assert (s["filled"], s["arena_used"]) == (0, 0) and c.get_slot(0) is None
        assert not c._arena.any()
        for i in range(4):  # the whole arena is back
            c.set_slot(i, cloud(i, 4))
        assert c.stats()["arena_used"] == 4 * 48


def _bad_values():
    yield torch.zeros(4, 4), ValueError, r"value should have shape \(None, 3\).*None is any " \
        r"size.* value\.shape=\(4, 4\)"
    yield torch.zeros(3), ValueError, r"value\.shape=\(3,\)"
    yield torch.full((2, 3), 0.5, dtype=torch.float64).to(torch.complex64) + 1j, ValueError, \
        "imaginary parts"
    yield [[1.0, 2.0, 3.0]], TypeError, r"value should be a torch\.Tensor"
    yield torch.zeros(1000, 3), ValueError, r"value should fit in the cache's arena \(320 " \
        r"bytes.*a sample of 12000 bytes"


@pytest.mark.parametrize("value,exc,match", list(_bad_values()))
def test_bad_values_are_refused_and_change_nothing(shm_dir, value, exc, match):
    with OpenSizeCache(limit_for(320), N, (None, 3), torch.float32, shm_dir=shm_dir) as c:
        c.set_slot(2, cloud(2))
        def state():
            s = c.stats()
            del s["hit_rate"]  # nan without reads
            return c._arena.tobytes(), c._records_np.tobytes(), c._index_states_np.tobytes(), s

        before = state()
        for idx in (2, 3):
            with pytest.raises(exc, match=match):
                c.set_slot(idx, value, allow_overwrite=True)
        assert state() == before


def test_a_field_dict_that_does_not_match_is_refused(shm_dir):
    dims = {"points": (None, 3), "label": ()}
    with OpenSizeCache(0.001, N, dims, {"points": torch.float32, "label": torch.int64},
                     shm_dir=shm_dir) as c:
        with pytest.raises(ValueError, match=r"missing \['label'\]"):
            c.set_slot(0, {"points": cloud(0)})
        with pytest.raises(ValueError, match=r"value\['points'\] should have shape \(None, 3\)"):
            c.set_slot(0, {"points": torch.zeros(2, 2), "label": 1})
        with pytest.raises(TypeError, match="value should be a dict"):
            c.set_slot(0, (cloud(0), 1))
        assert c.stats()["writes"] == 0 and c.stats()["arena_used"] == 0


def test_it_honours_everything_the_base_offers(shm_dir):
    """Every public name of BaseCache works on an OpenSizeCache (its refusals were those of a
    subclass of SharedCache); what needs rows of one size is not there at all."""
    offered = {n for n in dir(BaseCache) if not n.startswith("_")}
    assert offered == {"aux_array", "cached_indices", "clear", "close", "data_dims",
                       "dataset_len", "dtype", "fields", "get_slot", "layout", "may_refuse",
                       "name", "owner_rows", "read_tags", "read_tier", "ready_mask", "set_slot",
                       "slot_mask", "staging_slots", "stats", "stored_mask", "unstage", "world"}
    with OpenSizeCache(0.001, N, {"points": (None, 3), "label": ()}, shm_dir=shm_dir) as c:
        sample = {"points": cloud(0).to(torch.uint8), "label": 7}
        c.set_slot(0, sample)
        got = c.get_slot(0)
        assert torch.equal(got["points"], sample["points"]) and int(got["label"]) == 7
        c.read_tags = {3}
        assert c.read_tags == frozenset({3}) and c.unstage(0) is False
        assert c.ready_mask([0, 1]).tolist() == [True, False]
        assert c.stored_mask([0, 1]).tolist() == [True, False] and c.slot_mask().all()
        assert c.may_refuse and c.staging_slots == 0 and c.arena_used > 0
        assert c.aux_array[0] == 1 and len(c.cached_indices()) == len(c) == c.dataset_len == N
        assert c.fields == ("points", "label") and c.data_dims["points"] == (None, 3)
        assert c.dtype["label"] == torch.uint8 and c.layout.slots == N and c.name
        assert c.world.num_nodes == 1 and c.stats()["filled"] == 1
        assert c.read_tier(0) is None and c.stats()["disk_tier_rows"] == 0  # no disk tier
        assert [row.all() for row in c.owner_rows()] == [True]
        c.clear()
        assert c.get_slot(0) is None
        for name in ("get_batch", "locate", "confirm", "rows", "unpack_rows", "array", "stage",
                     "save"):
            assert not hasattr(c, name), name
        with pytest.raises(TypeError, match="not subscriptable"):
            c[0]


@pytest.mark.parametrize("kind,kw,exc,match", [
    (OpenSizeCache, dict(data_dims=(None, 0)), ValueError,
     r"positive ints or None .* data_dims=\(None, 0\)"),
    (OpenSizeCache, dict(data_dims=(None, 3), staging_slots=2), TypeError, "staging_slots"),
    (OpenSizeCache, dict(data_dims=(None, 3), load_from="x"), TypeError, "load_from"),
    (OpenSizeCache, dict(data_dims=(4, 3)), TypeError,
     r"data_dims should leave a size open \(a None\) in an OpenSizeCache; samples of a fixed "
     r"size go in a SharedCache.* data_dims=\(4, 3\)"),
    (SharedCache, dict(data_dims=(None, 3)), TypeError,
     r"construct it as OpenSizeCache\(.*but got data_dims=\(None, 3\)"),
    (SharedCache, dict(data_dims={"a": (None,)}), TypeError, "OpenSizeCache"),
    (SharedCache, dict(data_dims=(4, 3), mean_sample_bytes=100), TypeError, "mean_sample_bytes"),
    (OpenSizeCache, dict(data_dims=(None, 3), mean_sample_bytes=0), ValueError,
     "mean_sample_bytes=0"),
    (OpenSizeCache, dict(data_dims=(None, 3), mean_sample_bytes=True), TypeError,
     "mean_sample_bytes=True"),
])
def test_bad_arguments_name_the_parameter(shm_dir, kind, kw, exc, match):
    with pytest.raises(exc, match=match):
        kind(0.001, N, shm_dir=shm_dir, **kw)
    assert os.listdir(shm_dir) == []


def test_ranks_must_agree_on_the_open_sizes(shm_dir):
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    key = f"var{os.getpid()}"
    with OpenSizeCache(0.001, N, (None, 3), name="v", job_key=key, world=worlds[0],
                     shm_dir=shm_dir, timeout=60) as lead:
        with pytest.raises(CacheConfigError, match=r"has data_dims=\(None, 3\), but this "
                                                   r"process asked for data_dims=\(3, None\)"):
            OpenSizeCache(0.001, N, (3, None), name="v", job_key=key, world=worlds[1],
                        shm_dir=shm_dir, timeout=60)
        with OpenSizeCache(0.001, N, (None, 3), name="v", job_key=key, world=worlds[1],
                         shm_dir=shm_dir, timeout=60) as other:
            lead.set_slot(3, cloud(3).to(torch.uint8))
            assert torch.equal(other.get_slot(3), cloud(3).to(torch.uint8))


@pytest.mark.parametrize("mean,share", [(None, N // 2), (48, N)])
def test_nodes_admit_only_their_subset(shm_dir, mean, share):
    """Without a size hint each of two nodes may admit an even, disjoint half; with a mean
    size whose samples the arena holds for more, the subsets grow (and overlap)."""
    held = []
    for node in range(2):
        w = World(rank=node, world_size=2, node_rank=node, num_nodes=2)
        with OpenSizeCache(limit_for(48 * N), N, (None, 3), torch.float32, world=w,
                         shm_dir=shm_dir, mean_sample_bytes=mean) as c:
            mine = set(c.cached_indices().tolist())
            assert len(c) == len(mine) == share
            for i in range(N):
                c.set_slot(i, cloud(i, 3))  # a no-op outside the subset
            assert {i for i in range(N) if c.get_slot(i) is not None} == mine
            s = c.stats()
            assert (s["filled"], s["oob_misses"]) == (share, N - share)
            held.append(mine)
    if mean is None:
        assert not held[0] & held[1] and held[0] | held[1] == set(range(N))


def test_plan_sizes_from_a_mean_and_matches_the_cache(shm_dir):
    limit = limit_for(48 * 25)
    p = plan(N, (None, 3), torch.float32, size_limit_gib=limit, shm_dir=shm_dir,
             mean_sample_bytes=36)
    assert p["slots"] == 25 and p["arena_gib"] * BYTES_PER_GIB == 48 * 25
    with OpenSizeCache(limit, N, (None, 3), torch.float32, shm_dir=shm_dir) as c:
        for i in range(N):
            c.set_slot(i, cloud(i, 3))  # 36 B each
        assert c.stats()["filled"] == 25
        assert c.stats()["bytes"] <= p["segment_gib"] * BYTES_PER_GIB
    with pytest.raises(ValueError, match="mean_sample_bytes should be given"):
        plan(N, (None, 3), size_limit_gib=limit)
    out = cli.main(["--shm-dir", shm_dir, "plan", "--dataset-len", str(N), "--dims", "None,3",
                     "--dtype", "float32", "--mean-bytes", "36", "--size-gib", repr(limit)])
    assert out == 0


def test_plan_without_a_budget_proposes_what_the_dataset_needs(shm_dir):
    """Without size_limit_gib, plan proposes the budget that holds every sample at the mean
    size (found by a newcomer's try: it proposed all of /dev/shm, 20 GiB for a 1.4 GiB
    dataset, which an arena would reserve whole); a room smaller than that is the limit."""
    p = plan(10_000, (3, None, None), mean_sample_bytes=150_000, shm_dir=shm_dir)
    assert p["slots"] == 10_000 and p["size_limit_gib"] == p["dataset_gib"] < 1.5
    big = plan(10**6, (3, None, None), mean_sample_bytes=10**9 // 2, shm_dir=shm_dir)
    assert big["size_limit_gib"] < big["dataset_gib"] and big["slots"] < 10**6


def test_a_deep_copy_is_private_and_equal(shm_dir):
    with OpenSizeCache(0.001, N, (None, 3), torch.float32, shm_dir=shm_dir) as c:
        for i in range(5):
            c.set_slot(i, cloud(i))
        with copy.deepcopy(c) as twin:
            assert all(torch.equal(twin.get_slot(i), cloud(i)) for i in range(5))
            twin.set_slot(0, cloud(0, 7), allow_overwrite=True)
            twin.set_slot(6, cloud(6))
            assert twin.stats()["arena_used"] > c.stats()["arena_used"]
        assert torch.equal(c.get_slot(0), cloud(0)) and c.get_slot(6) is None


# ----------------------------------------------------------------------------------------------
# Processes: racing writers and clears, workers of every start method, a writer killed
# ----------------------------------------------------------------------------------------------


def _version(i: int, v: int) -> torch.Tensor:
    """Index i at version v: (v % 5 + 1) * 8 bytes, byte 0 = v, byte 1 = i, the rest a pattern
    of both, so a torn read (bytes of two versions, or a record of one and bytes of another)
    is caught."""
    n = (v % 5 + 1) * 8
    t = (torch.arange(n) * 7 + i * 31 + v * 17 + 3) % 251 + 1
    t[0], t[1] = v, i
    return t.to(torch.uint8)


def _overwrite(cache: OpenSizeCache, seed: int, writing, stop) -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        for i, v, p in zip(*(rng.integers(0, m, 500).tolist() for m in (N, 256, 400))):
            if p == 0:
                cache.clear()
            cache.set_slot(i, _version(i, v), allow_overwrite=True)
            writing.set()


@pytest.mark.timeout(300)
def test_writers_and_clears_never_give_a_torn_sample(tmpfs):
    with OpenSizeCache(limit_for(16 * 5 * N, words=5), N, (None,), shm_dir=tmpfs) as c:
        with racing_writers(_overwrite, c):
            torn, hits, reads = [], 0, 0
            before = c.stats()["writes"]
            deadline = time.monotonic() + 120  # a ceiling for a hang; the loop counts writes
            while reads < 20000 or c.stats()["writes"] - before < 20000:
                assert time.monotonic() < deadline, "writers stalled"
                for i in range(N):
                    got = c.get_slot(i)
                    reads += 1
                    if got is not None:
                        hits += 1
                        if got.numel() < 2 or not torch.equal(got, _version(i, int(got[0]))):
                            torn.append((i, got.tolist()))
        assert torn == [] and hits > 0
    assert_no_leak(tmpfs)


def keep_list(batch):
    """collate_fn: the samples as they are (they do not stack)."""
    return batch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_share_a_cache_of_open_sizes(tmpfs, method):
    arena = sum(-(-cloud(i).numel() * 4 // 16) * 16 for i in range(N - 6))  # all but 6 fit
    with OpenSizeCache(limit_for(arena), N, (None, 3), torch.float32, shm_dir=tmpfs) as c:
        dl = DataLoader(TwoLineDataset(c, N, cloud), batch_size=4, num_workers=2,
                        collate_fn=keep_list, multiprocessing_context=method)
        stored = 0
        for epoch in range(2):
            seen = []
            for batch in dl:
                for i, x, hit in batch:
                    assert torch.equal(x, cloud(i)), (epoch, i)
                    seen.append((i, hit))
            assert sorted(i for i, _ in seen) == list(range(N))
            assert sum(h for _, h in seen) == stored  # what the epoch before stored
            s = c.stats()
            if epoch == 0:  # every index was written once: stored, or refused for want of room
                assert s["filled"] + s["full"] == N and 0 < s["full"] < N
            stored = s["filled"]
            assert s["arena_used"] <= s["arena_bytes"] == arena
    assert_no_leak(tmpfs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("late", [False, True], ids=["mid-copy", "after-state-set"])
def test_a_writer_killed_mid_write_leaves_a_miss(tmpfs, children, late):
    """Two local ranks (processes); rank 1 dies inside set_slot of the last index, halfway
    through copying its bytes into the arena or right after its state became SET: rank 0
    reads it as a miss and writes it again; nothing leaks."""
    n = 32
    lead = ranks_with_a_killed_writer(children, tmpfs, f"vkill{int(late)}{os.getpid()}", n - 1,
                                      late=late, FT_VARIABLE="1")
    assert_the_killed_write_is_a_miss(lead, n)
    assert_no_leak(tmpfs)


def test_an_arena_too_big_for_the_tmpfs_says_what_would_fit(tmpfs):
    """A 0.1 GiB open-size cache in a 64 MiB tmpfs: CacheCapacityError names the arena, the
    tmpfs size that would hold it (as the fixed-size error does) and a size_limit_gib that fits
    now; that size does fit; nothing is left behind by the refusal."""
    with pytest.raises(CacheCapacityError) as info:
        OpenSizeCache(0.1, N, (None, 3), torch.float32, shm_dir=tmpfs)
    e, msg = info.value, str(info.value)
    assert e.path == tmpfs and e.needed > e.free
    assert "(an arena of " in msg and f"--shm-size={math.ceil(e.needed / 2**30)}g" in msg, msg
    assert os.listdir(tmpfs) == []
    fit = float(re.search(r"about ([0-9.]+) fits now", msg).group(1))
    with OpenSizeCache(fit, N, (None, 3), torch.float32, shm_dir=tmpfs) as c:
        assert c.stats()["arena_bytes"] > 0.9 * e.free - 8 * 5 * N
    assert_no_leak(tmpfs)
