"""Staging slots: a bounded area in the segment where a prefetcher holds samples of indices
that have no slot, until one read takes them."""

from __future__ import annotations

import math
import multiprocessing as mp
import warnings

import numpy as np
import pytest
import torch

from _helpers import budget_for, value_of
from stocaching import BYTES_PER_GIB, MAX_STAGE_TAG, CacheConfigError, SharedCache, World, plan

DIMS = (3, 4, 4)
SLOT = math.prod(DIMS)


def staged_cache(shm_dir, slots=10, staging=4, n=100, **kw):
    """A cache of ``slots`` slots plus ``staging`` staging slots for ``n`` indices."""
    gib = budget_for(slots, DIMS, dataset_len=n) + staging * SLOT / BYTES_PER_GIB
    return SharedCache(gib, n, DIMS, shm_dir=shm_dir, staging_slots=staging, **kw)


def test_staging_slots_are_paid_from_the_budget_and_plan_counts_them(shm_dir):
    with staged_cache(shm_dir) as c:
        assert len(c) == 10 and c.stats()["staging_slots"] == 4
        gib = budget_for(10, DIMS, dataset_len=100) + 4 * SLOT / BYTES_PER_GIB
        assert plan(100, DIMS, size_limit_gib=gib, shm_dir=shm_dir, staging_slots=4)["slots"] \
            == 10
        assert plan(100, DIMS, size_limit_gib=gib, shm_dir=shm_dir)["slots"] == 14
        with SharedCache(gib, 100, DIMS, shm_dir=shm_dir) as no_staging:  # 14 slots instead
            assert len(no_staging) == 14
            assert no_staging.stats()["bytes"] == c.stats()["bytes"]


def test_a_staged_sample_is_read_once_then_its_slot_is_free(shm_dir):
    with staged_cache(shm_dir) as c:
        assert c.stage(50, value_of(50, DIMS))
        assert c.stage(50, value_of(50, DIMS))  # already staged: nothing more taken
        assert list(c.ready_mask([0, 50, 51])) == [False, True, False]
        assert c.stats()["staged"] == 1
        got = c.get_slot(50)
        assert torch.equal(got, value_of(50, DIMS))
        assert c.get_slot(50) is None  # evicted once read
        s = c.stats()
        assert (s["staged"], s["staged_hits"], s["hits"], s["stages"]) == (0, 1, 1, 1)


def test_the_masks_tell_a_slot_a_stored_sample_and_a_staged_one_apart(shm_dir):
    """What the opt-in modules ask instead of reading slot codes: slot_mask (the index has a
    slot on this node), stored_mask (its slot holds the sample), ready_mask (stored, or
    staged); also staging_slots, and that a cache of fixed sizes never refuses a sample."""
    with staged_cache(shm_dir) as c:
        c.set_slot(0, value_of(0, DIMS))
        assert c.stage(50, value_of(50, DIMS))
        idx = [0, 1, 50, 51]
        assert c.slot_mask(idx).tolist() == [True, True, False, False]
        assert c.stored_mask(idx).tolist() == [True, False, False, False]
        assert c.ready_mask(idx).tolist() == [True, False, True, False]
        assert c.slot_mask().sum() == c.layout.slots and c.stored_mask().sum() == 1
        assert c.staging_slots == c.stats()["staging_slots"] > 0 and not c.may_refuse
    with pytest.raises(ValueError, match="closed"):
        c.slot_mask([0])


def test_a_full_staging_area_says_so_and_changes_nothing(shm_dir):
    with staged_cache(shm_dir, staging=2) as c:
        assert c.stage(50, value_of(50, DIMS)) and c.stage(51, value_of(51, DIMS))
        assert not c.stage(52, value_of(52, DIMS))
        assert list(c.ready_mask([50, 51, 52])) == [True, True, False]
        assert c.unstage(51) and not c.unstage(51)
        assert c.stage(52, value_of(52, DIMS))
        assert torch.equal(c.get_slot(52), value_of(52, DIMS))


def test_a_reservation_of_a_dead_filler_is_taken_back(shm_dir):
    with staged_cache(shm_dir, staging=1) as c:
        p = mp.get_context("fork").Process(target=lambda: None)
        p.start()
        p.join()
        # Stands in for a process killed while it filled the only staging slot (the slot's
        # map entry then holds -2 - its pid); the fault tests kill real writers mid-copy.
        c._staging.entries[0] = -2 - p.pid
        assert c.stage(50, value_of(50, DIMS))
        assert torch.equal(c.get_slot(50), value_of(50, DIMS))


def test_unstage_with_a_tag_frees_only_what_that_tag_staged(shm_dir):
    """Two stagers (two ranks' prefetchers) each keep their own copy of an index; a tag
    frees and asks about its own copies only; each read takes one copy."""
    with staged_cache(shm_dir) as c:
        assert c.stage(50, value_of(50, DIMS), tag=7) and c.stage(51, value_of(51, DIMS), tag=7)
        assert c.stage(51, value_of(51, DIMS), tag=7)  # the same stager again: replaced
        assert c.stats()["staged"] == 2
        assert c.stage(51, value_of(51, DIMS), tag=9)  # another stager: a copy of its own
        assert c.stats()["staged"] == 3 and c.ready_mask([50, 51]).all()
        assert c.ready_mask([50, 51], tag=9).tolist() == [False, True]
        assert c.ready_mask([50, 51], tag=8).tolist() == [False, False]
        assert c.unstage(51, tag=7) and c.unstage(50, tag=7) and not c.unstage(50, tag=7)
        assert c.ready_mask([50, 51]).tolist() == [False, True]
        assert c.ready_mask([50, 51], tag=7).tolist() == [False, False]
        assert torch.equal(c.get_slot(51), value_of(51, DIMS)) and c.stats()["staged"] == 0
        assert c.stage(52, value_of(52, DIMS), tag=1) and c.stage(52, value_of(52, DIMS), tag=2)
        assert c.get_slot(52) is not None and c.get_slot(52) is not None  # one copy each
        assert c.get_slot(52) is None
        assert c.stage(52, value_of(52, DIMS), tag=MAX_STAGE_TAG) and c.unstage(52)  # any tag
        for bad in (-1, MAX_STAGE_TAG + 1, True):
            with pytest.raises((ValueError, TypeError), match="tag"):
                c.stage(53, value_of(53, DIMS), tag=bad)
            with pytest.raises((ValueError, TypeError), match="tag"):
                c.unstage(53, tag=bad)
            with pytest.raises((ValueError, TypeError), match="tag"):
                c.ready_mask([53], tag=bad)
        assert c.stats()["staged"] == 0


def test_clear_drops_what_is_staged(shm_dir):
    with staged_cache(shm_dir) as c:
        c.stage(50, value_of(50, DIMS))
        c.set_slot(1, value_of(1, DIMS))
        c.clear()
        assert c.get_slot(50) is None and c.get_slot(1) is None and c.stats()["staged"] == 0


def _read_in_child(cache, idx, out):
    got = cache.get_slot(idx)
    out.put(None if got is None else got.tolist())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_process_takes_what_the_main_process_staged(shm_dir, method):
    with staged_cache(shm_dir) as c:
        c.stage(60, value_of(60, DIMS))
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_read_in_child, args=(c, 60, q))
        p.start()
        got = q.get(timeout=100)
        p.join(timeout=100)
        assert got == value_of(60, DIMS).tolist()
        assert c.get_slot(60) is None and c.stats()["staged_hits"] == 1


def test_ranks_must_agree_on_the_staging_slots(shm_dir):
    lead = World(rank=0, world_size=2, local_world_size=2)
    other = World(rank=1, world_size=2, local_rank=1, local_world_size=2)
    c = staged_cache(shm_dir, staging=4, world=lead, job_key="stg", name="s", timeout=0.2)
    try:
        gib = budget_for(10, DIMS, dataset_len=100) + 4 * SLOT / BYTES_PER_GIB
        with pytest.raises(CacheConfigError, match="staging_slots") as e:
            SharedCache(gib - SLOT / BYTES_PER_GIB, 100, DIMS, shm_dir=shm_dir,
                        staging_slots=3, world=other, job_key="stg", name="s", timeout=10)
        assert e.value.field == "staging_slots"  # the same 10 slots, 3 staging slots not 4
    finally:
        c.close()  # rank 1 never came: waits at most 0.2 s


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"staging_slots": -1}, ValueError, r"staging_slots should be an int >= 0, but got "
                                        r"staging_slots=-1"),
    ({"staging_slots": True}, TypeError, r"staging_slots should be an int >= 0"),
    ({"staging_slots": 10**6}, ValueError, r"staging_slots should leave room in size_limit_gib"),
])
def test_bad_staging_slots_name_the_parameter(shm_dir, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SharedCache(1e-4, 100, DIMS, shm_dir=shm_dir, **kwargs)


def test_bad_stage_calls_change_nothing(shm_dir):
    with staged_cache(shm_dir) as c:
        with pytest.raises(ValueError, match="idx=1 has a slot in this cache"):
            c.stage(1, value_of(1, DIMS))
        with pytest.raises(ValueError, match=r"value should have shape \(3, 4, 4\)"):
            c.stage(50, torch.zeros(2, 2, dtype=torch.uint8))
        with pytest.raises(TypeError, match="value should be a torch.Tensor"):
            c.stage(50, "not a tensor")
        with pytest.raises(IndexError, match="idx should be a dataset index"):
            c.stage(100, value_of(0, DIMS))
        assert c.stats()["staged"] == 0 and not np.any(c.ready_mask())
    with SharedCache(1e-4, 100, DIMS, shm_dir=shm_dir) as plain:
        with pytest.raises(ValueError, match="no staging slots; construct it with "
                                             "staging_slots"):
            plain.stage(99, value_of(99, DIMS))


def test_close_frees_what_this_processs_prefetchers_staged_and_nothing_else(shm_dir):
    """close() frees the staging slots staged under the read_tags this process set (its
    prefetchers': nothing could give them back through a closed handle); another local rank,
    attached to the same segment, sees them free and keeps its own."""
    ranks = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in (0, 1)]
    lead = staged_cache(shm_dir, world=ranks[0], job_key="close-frees", name="s")
    other = staged_cache(shm_dir, world=ranks[1], job_key="close-frees", name="s")
    try:
        lead.read_tags = {5}
        other.read_tags = {6}
        assert lead.stage(50, value_of(50, DIMS), tag=5)
        assert lead.stage(51, value_of(51, DIMS), tag=5)
        assert other.stage(52, value_of(52, DIMS), tag=6)
        assert other.stats()["staged"] == 3
        lead.close()
        assert list(other.ready_mask([50, 51, 52])) == [False, False, True]
        with pytest.raises(ValueError, match="closed"):
            lead.stage(53, value_of(53, DIMS), tag=5)
    finally:
        lead.close()
        other.close()


def test_staging_slots_where_every_index_has_a_slot_warn_at_construction(shm_dir):
    """A staging slot holds only a sample of an index without a slot (issue 47: the device
    recipe reserved 768 MiB of staging for a dataset that fit whole): said at construction."""
    with pytest.warns(RuntimeWarning, match=r"staging_slots=4 take 768 B that no sample can "
                                            r"use: every index of the 10 has a slot"):
        c = SharedCache(1e-3, 10, (3, 8, 8), staging_slots=4, shm_dir=shm_dir, name="whole")
    assert len(c) == 10
    c.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cache that does not hold every index: no warning
        c = SharedCache(budget_for(5, (3, 8, 8), dataset_len=10, staging=4), 10, (3, 8, 8),
                        staging_slots=4, shm_dir=shm_dir, name="part")
    assert len(c) == 5
    c.close()
