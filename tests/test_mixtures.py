"""Weighted mixtures (stocaching/mixtures.py): coverage, shares, repetition, determinism, the
rank split, resume from any rank, weight changes, bad input, the caches of the sub-datasets
(real SharedCaches, KiB-sized), ReadyFirstSampler on top, and one real torchrun run."""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import CHILDREN, TwoLineDataset, budget_for, free_port, rank_env, run_copied
from stocaching import (CacheAwareSampler, CacheLayout, MixtureDataset, Prefetcher,
                        ReadyFirstSampler, SharedCache, WeightedMixtureSampler, World)

DIMS = (4,)


def sampler(lengths, weights=None, **kw):
    kw.setdefault("num_replicas", 1)
    kw.setdefault("rank", 0)
    return WeightedMixtureSampler(list(lengths), weights, **kw)


def ranks(lengths, weights=None, num_replicas=3, **kw):
    return [sampler(lengths, weights, num_replicas=num_replicas, rank=r, **kw)
            for r in range(num_replicas)]


def occurrences(order, n):
    return np.bincount(order, minlength=n)


# ----------------------------------------------------------------------------------------------
# What an epoch holds
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(5, 3, 2), (1,), (7, 1, 13), (100, 37, 1000),
                                     (70000, 50000, 30)])
@pytest.mark.parametrize("weights", ["default", "lengths", "floats"])
def test_size_proportional_weights_give_every_element_exactly_once(lengths, weights):
    w = {"default": None, "lengths": list(lengths),
         "floats": [n / min(lengths) / 3 for n in lengths]}[weights]
    s = sampler(lengths, w, seed=3)
    n = sum(lengths)
    assert len(s) == n
    assert s.global_order(0).dtype == np.int32  # as documented: int32 while it fits
    for epoch in range(3):
        order = s.global_order(epoch)
        assert order.size == n and (occurrences(order, n) == 1).all()
        assert s.counts(epoch).tolist() == list(lengths)
    if n > 10:  # randomly interleaved: not concatenated, not sorted by sub-dataset
        sub, _ = s.locate(s.global_order(0))
        assert (np.diff(sub) != 0).sum() > len(lengths)


def test_counts_are_the_floor_or_ceil_of_the_quotas_and_sum_exactly():
    lengths, weights = (50, 200, 400), (0.7, 0.25, 0.05)
    s = sampler(lengths, weights, num_samples=333)
    quota = 333 * np.asarray(weights) / sum(weights)
    seen = set()
    for epoch in range(200):
        c = s.counts(epoch)
        assert c.sum() == 333
        assert ((c == np.floor(quota)) | (c == np.ceil(quota))).all(), (epoch, c)
        seen.add(tuple(c))
    assert len(seen) > 1  # the extra units move between sub-datasets from epoch to epoch


def test_realised_shares_are_within_binomial_noise_of_the_weights():
    """Over 300 epochs with a fixed seed: the epochs' shares, what one rank reads and what
    the first batch of each epoch holds all average to the weights, within 4 standard
    deviations of a binomial of that many draws."""
    lengths, weights = (50, 200, 400), np.array([0.7, 0.25, 0.05])
    p = weights / weights.sum()
    rank0, = [sampler(lengths, weights, num_replicas=2, rank=0, seed=11)]
    epochs, batch = 300, 32
    whole, mine, first = [], [], []
    for epoch in range(epochs):
        whole.append(rank0.shares(epoch))
        idx = rank0.epoch_indices(epoch)
        sub, _ = rank0.locate(idx)
        mine.append(np.bincount(sub, minlength=3))
        first.append(np.bincount(sub[:batch], minlength=3))
    n = sum(lengths)
    for got, draws in ((np.mean(whole, axis=0), n * epochs),
                       (np.sum(mine, axis=0) / (len(rank0) * epochs), len(rank0) * epochs),
                       (np.sum(first, axis=0) / (batch * epochs), batch * epochs)):
        sigma = np.sqrt(p * (1 - p) / draws)
        assert (np.abs(got - p) <= 4 * sigma).all(), (got, p, sigma)


def test_up_weighted_repeats_at_most_ceil_and_spread_down_weighted_never_repeats():
    lengths = (100, 1000)
    s = sampler(lengths, (0.5, 0.5), seed=5)  # 550 of each: 5.5 passes of the first
    n = sum(lengths)
    close = gaps = 0
    for epoch in range(20):
        order = s.global_order(epoch)
        c = s.counts(epoch)
        assert c.tolist() == [550, 550]
        occ = occurrences(order, n)
        assert set(occ[:100].tolist()) <= {5, 6} and occ[:100].max() <= math.ceil(550 / 100)
        assert set(occ[100:].tolist()) <= {0, 1} and occ[100:].sum() == 550
        pos = np.flatnonzero(order < 100)
        for x in range(100):
            g = np.diff(np.sort(pos[order[pos] == x]))
            close += int((g < n // 20).sum())
            gaps += g.size
    # Copies spread over the epoch: the p-th copy in the p-th sixth or so. Placed at random,
    # about 24% of consecutive copies would be closer than n/20 positions (measured: 4.5%).
    assert close / gaps < 0.10, close / gaps


def test_down_weighted_subsets_differ_across_epochs():
    s = sampler((1000, 100), (0.1, 0.9), seed=2)
    subsets = [frozenset(s.global_order(e)[s.global_order(e) < 1000].tolist())
               for e in range(10)]
    assert all(len(x) == 110 for x in subsets)
    assert len(set(subsets)) == 10
    assert len(frozenset().union(*subsets)) > 500  # not the same few elements again


def test_same_seed_same_order_other_seed_or_epoch_differs():
    a, b = sampler((30, 40, 50), (1, 2, 3), seed=7), sampler((30, 40, 50), (1, 2, 3), seed=7)
    for e in range(4):
        assert np.array_equal(a.epoch_indices(e), b.epoch_indices(e))
    c = sampler((30, 40, 50), (1, 2, 3), seed=8)
    assert not np.array_equal(a.epoch_indices(0), c.epoch_indices(0))
    orders = [a.global_order(e).tolist() for e in range(5)]
    assert len({tuple(o) for o in orders}) == 5


def test_global_rng_is_neither_used_nor_changed():
    torch.manual_seed(0)
    np.random.seed(0)
    t_state, n_state = torch.get_rng_state(), np.random.get_state()
    a = sampler((30, 40), (1, 3), seed=1).global_order(2)
    assert torch.equal(torch.get_rng_state(), t_state)
    assert np.array_equal(np.random.get_state()[1], n_state[1])
    torch.manual_seed(123)
    np.random.seed(123)
    assert np.array_equal(sampler((30, 40), (1, 3), seed=1).global_order(2), a)


@pytest.mark.parametrize("lengths, weights, num_samples, outcomes", [
    ((3, 2), None, None, 120),   # every element once: the 5! orders
    ((4, 2), (1, 1), 4, 144),    # 2 of the first 4 and both others: 6 subsets times 4! orders
])
def test_without_repeats_every_order_is_equally_likely(monkeypatch, lengths, weights,
                                                       num_samples, outcomes):
    """The order is built from shuffles of groups of a pass and of blocks of the epoch, and
    draws of how many of each go where; with groups and blocks of 2 here (instead of 32768),
    every possible order of the epoch should come equally often (a chi-square test over 25
    epochs per order, fixed seed)."""
    from stocaching import mixtures
    monkeypatch.setattr(mixtures, "_GROUP", 2)
    monkeypatch.setattr(mixtures, "_BLOCK", 2)
    monkeypatch.setattr(mixtures, "_MIN_BLOCKS", 1)
    s = sampler(lengths, weights, seed=12, num_samples=num_samples)
    epochs = 25 * outcomes
    seen: dict[tuple, int] = {}
    for epoch in range(epochs):
        order = tuple(s.global_order(epoch).tolist())
        seen[order] = seen.get(order, 0) + 1
    assert len(seen) == outcomes
    expected = epochs / outcomes
    chi2 = sum((k - expected) ** 2 / expected for k in seen.values())
    dof = outcomes - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_up_weighted_passes_are_whole_at_every_block_boundary():
    """The first sub-dataset (40000 elements, two groups of a pass) comes 2.25 times, the
    second (1000) 10 times: at every block boundary of the epoch, what came of each so far is
    whole passes and part of the next one (each element k or k + 1 times)."""
    lengths = (40000, 1000)
    s = sampler(lengths, (0.9, 0.1), seed=6, num_samples=100_000)
    block = math.ceil(100_000 / 64)  # the documented block size for this epoch
    for epoch in range(2):
        order = s.global_order(epoch)
        assert s.counts(epoch).tolist() == [90_000, 10_000]
        for end in range(block, order.size + block, block):
            occ = occurrences(order[:end], sum(lengths))
            for a, n in ((0, 40000), (40000, 1000)):
                part = occ[a:a + n]
                low = int(part.sum()) // n
                assert part.min() == low and part.max() <= low + 1, (epoch, end, a)


def test_indices_beyond_int32_come_as_int64():
    """A mixture of more than 2**31 indices: the order is int64 and the second sub-dataset's
    indices start at 2**31. (Its first sub-dataset gets no position in these epochs, so
    nothing of its size is allocated; checked first.)"""
    s = sampler((2**31, 10), (0.0011, 1), num_samples=20, seed=1)
    for epoch in range(3):
        assert s.counts(epoch).tolist() == [0, 20]
        order = s.global_order(epoch)
        assert order.dtype == np.int64
        assert (np.bincount(order - 2**31, minlength=10) == 2).all()


# ----------------------------------------------------------------------------------------------
# Ranks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_ddp_split_is_distributed_samplers(num_replicas, drop_last):
    lengths = (7, 1, 13)
    rs = ranks(lengths, None, num_replicas=num_replicas, drop_last=drop_last, seed=4)
    n = sum(lengths)
    per = n // num_replicas if drop_last else math.ceil(n / num_replicas)
    for epoch in range(3):
        order = rs[0].global_order(epoch)
        padded = np.resize(order, per * num_replicas)  # DistributedSampler's padding
        for r, s in enumerate(rs):
            assert len(s) == per
            assert s.epoch_indices(epoch).tolist() == padded[r::num_replicas].tolist()
        together = np.concatenate([s.epoch_indices(epoch) for s in rs])
        occ = occurrences(together, n)
        if drop_last:
            assert occ.max() == 1 and occ.sum() == per * num_replicas
        else:  # every index once, and the padding once more
            assert occ.min() == 1 and occ.sum() - n == per * num_replicas - n


def test_iterating_yields_epoch_indices_and_set_epoch_selects():
    s = sampler((9, 4), (2, 1), num_replicas=2, rank=1)
    s.set_epoch(3)
    assert list(s) == s.epoch_indices(3).tolist()
    with pytest.warns(UserWarning, match="set_epoch"):
        list(s)


# ----------------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:epoch 2 is iterated again")
@pytest.mark.parametrize("weights", [None, (0.5, 0.3, 0.2), (5, 1, 1)])
def test_state_of_any_rank_restores_every_rank_mid_epoch(weights):
    lengths, R = (7, 13, 5), 3
    originals = ranks(lengths, weights, num_replicas=R, seed=9)
    for s in originals:
        s.set_epoch(2)
    full = [list(s) for s in originals]
    per = len(originals[0])
    for consumed in (0, 1, 4, per - 1, per):
        for src in range(R):  # the state of one rank, taken from its iterator
            s = originals[src]
            s.set_epoch(2)
            it = iter(s)
            for _ in range(consumed):
                next(it)
            state = s.state_dict()
            assert state["consumed"] == consumed and state["epoch"] == 2
            state = json.loads(json.dumps(state))  # plain values: it survives a checkpoint
            for r in range(R):
                fresh = sampler(lengths, weights, num_replicas=R, rank=r, seed=9)
                fresh.load_state_dict(state)
                assert len(fresh) == per
                assert list(fresh) == full[r][consumed:], (consumed, src, r)
                fresh.set_epoch(3)  # and the next epoch is the usual one
                assert list(fresh) == originals[r].epoch_indices(3).tolist()


def test_changed_weights_finish_the_saved_epoch_then_apply():
    lengths = (20, 30, 10)
    old = sampler(lengths, (1, 1, 1), num_replicas=2, rank=1, seed=1, num_samples=40)
    old.set_epoch(4)
    full = list(old)
    state = old.state_dict(consumed=7)
    new = sampler(lengths, (1, 5, 1), num_replicas=2, rank=1, seed=1)  # and num_samples
    new.load_state_dict(state)
    assert len(new) == 20  # still the saved epoch's length
    assert list(new) == full[7:]
    assert new.counts(4).tolist() == old.counts(4).tolist()
    assert new.state_dict()["weights"] == [1.0, 1.0, 1.0]
    new.set_epoch(5)
    assert len(new) == 30
    fresh = sampler(lengths, (1, 5, 1), num_replicas=2, rank=1, seed=1)
    assert list(new) == fresh.epoch_indices(5).tolist()
    assert new.state_dict()["weights"] == [1.0, 5.0, 1.0]


@pytest.mark.parametrize("field, value", [("seed", 2), ("drop_last", True),
                                          ("lengths", [20, 30]), ("lengths", [20, 31, 10])])
def test_a_state_of_another_setup_is_refused_and_changes_nothing(field, value):
    lengths = (20, 30, 10)
    s = sampler(lengths, num_replicas=2, rank=0, seed=1)
    s.set_epoch(1)
    before = s.state_dict()
    state = {**sampler(lengths, num_replicas=2, rank=1, seed=1).state_dict(), "epoch": 6,
             "consumed": 3, field: value}
    with pytest.raises(ValueError, match=re.escape(f"state['{field}'] should be ") + ".*" +
                       re.escape(f", but got state['{field}']={value!r}")):
        s.load_state_dict(state)
    assert s.state_dict() == before


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("before, after", [(4, 2), (2, 3), (3, 8)])
def test_a_state_resumes_on_another_number_of_ranks_with_every_position_once(before, after,
                                                                            drop_last):
    """Ranks of one world take 5 indices of epoch 2 each; ranks of another (another
    num_replicas) load rank 0's state and finish the epoch: together they give every
    position of the epoch's order once (a mixture's order may hold an index twice), but the
    new world's padding (fewer than its ranks), or with drop_last none, fewer missing than
    its ranks; the next epoch is the new world's, whole. A second resume, back
    on the first world, takes the rest of the rest."""
    lengths, weights = (20, 31, 10), (1, 2, 1)  # (61 positions: no world here divides them)
    old = ranks(lengths, weights, num_replicas=before, seed=4, drop_last=drop_last)
    taken = []
    for s in old:
        s.set_epoch(2)
        taken += list(itertools.islice(iter(s), 5))
    state = json.loads(json.dumps(old[0].state_dict()))
    assert state["consumed"] == 5 and state["epoch_done"] == 0
    new = ranks(lengths, weights, num_replicas=after, seed=4, drop_last=drop_last)
    rest = []
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(2)
        rest += list(s)
    want, got = collections.Counter(old[0].global_order(2).tolist()), \
        collections.Counter(taken + rest)
    if drop_last:
        assert not got - want and sum((want - got).values()) < after
    else:
        assert not want - got and sum((got - want).values()) < after
    for s in new:  # the next epoch: the new world's own split of its order
        s.set_epoch(3)
        assert list(s) == sampler(lengths, weights, num_replicas=after, rank=s.rank, seed=4,
                                  drop_last=drop_last).epoch_indices(3).tolist()

    # the new world interrupted too (2 indices each), resumed by the first world
    again = ranks(lengths, weights, num_replicas=after, seed=4, drop_last=drop_last)
    second = []
    for s in again:
        s.load_state_dict(state)
        s.set_epoch(2)
        second += list(itertools.islice(iter(s), 2))
    state2 = again[0].state_dict()
    assert state2["epoch_done"] == 5 * before
    last = []
    for s in ranks(lengths, weights, num_replicas=before, seed=4, drop_last=drop_last):
        s.load_state_dict(state2)
        s.set_epoch(2)
        last += list(s)
    got = collections.Counter(taken + second + last)
    if drop_last:
        assert not got - want and sum((want - got).values()) < before
    else:
        assert not want - got and sum((got - want).values()) < before


@pytest.mark.parametrize("state, exc, match", [
    ([1, 2], TypeError, "state should be a dict"),
    ({"epoch": 1}, ValueError, "it lacks"),
])
def test_a_state_that_is_not_one_is_refused(state, exc, match):
    with pytest.raises(exc, match=match):
        sampler((3, 4)).load_state_dict(state)


@pytest.mark.filterwarnings("ignore:epoch 2 is iterated again")
def test_readyfirst_on_a_mixture_resumes_on_its_rank():
    lengths = (12, 20)
    ready = lambda idx: idx % 3 == 0  # noqa: E731
    base = sampler(lengths, (2, 1), num_replicas=2, rank=1, seed=3)
    rf = ReadyFirstSampler(base, ready, window=4)
    rf.set_epoch(2)
    full = list(rf)
    assert sorted(full) == sorted(base.epoch_indices(2).tolist())
    it = iter(rf)
    for _ in range(6):
        next(it)
    state = rf.state_dict()
    again = ReadyFirstSampler(sampler(lengths, (2, 1), num_replicas=2, rank=1, seed=3), ready,
                              window=4)
    again.load_state_dict(state)
    assert list(again) == full[6:]


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, kw, exc, match", [
    (([],), {}, ValueError, r"datasets should hold at least one dataset, but got datasets=\[\]"),
    (("abc",), {}, TypeError, "datasets should be a MixtureDataset or a sequence"),
    (([3, 0, 2],), {}, ValueError, r"datasets\[1\] should have at least one element, but got "
                                   r"len\(datasets\[1\]\)=0"),
    (([3, [], 2],), {}, ValueError, r"len\(datasets\[1\]\)=0"),
    (([3, 2.5],), {}, TypeError, r"datasets\[1\] should be a dataset with a length"),
    (([3, True],), {}, TypeError, r"datasets\[1\] .* type bool"),
    (([3, 2], [1, 0.001]), {}, ValueError, r"weights\[1\] should be a finite number > 0.001, "
                                           r"but got weights\[1\]=0.001"),
    (([3, 2], [1, -1]), {}, ValueError, r"weights\[1\]=-1.0"),
    (([3, 2], [float("nan"), 1]), {}, ValueError, r"weights\[0\]=nan"),
    (([3, 2], [float("inf"), 1]), {}, ValueError, r"weights\[0\]=inf"),
    (([3, 2], [1, True]), {}, TypeError, r"weights\[1\] should be a finite number .*\(type bool\)"),
    (([3, 2], [1, "2"]), {}, TypeError, r"weights\[1\]='2'"),
    (([3, 2], [1]), {}, ValueError, r"weights should have one number per dataset \(2\), but "
                                    r"got 1: weights=\[1\]"),
    (([3, 2], 1.0), {}, TypeError, "weights should be a sequence"),
    (([3, 2],), {"num_samples": 0}, ValueError, "num_samples should be a positive int, but got "
                                                "num_samples=0"),
    (([3, 2],), {"num_samples": 2.0}, TypeError, "num_samples should be a positive int"),
    (([3, 2],), {"seed": -1}, ValueError, r"seed should be an int in \[0, .*\], but got seed=-1"),
    (([3, 2],), {"num_replicas": 2, "rank": 2}, ValueError, "rank should be .* but got rank=2"),
    (([3, 2],), {"num_replicas": True}, TypeError, "num_replicas should be a positive int"),
    (([3, 2],), {"drop_last": 1}, TypeError, "drop_last should be a bool, but got drop_last=1"),
    (([1],), {"num_replicas": 2, "rank": 0, "drop_last": True}, ValueError,
     "num_samples should be at least num_replicas=2"),
])
def test_bad_arguments_name_the_parameter_and_the_value(args, kw, exc, match):
    kw = {"num_replicas": 1, "rank": 0, **kw}
    with pytest.raises(exc, match=match):
        WeightedMixtureSampler(*args, **kw)


def test_bad_epochs_and_indices():
    s = sampler((3, 2))
    with pytest.raises(ValueError, match="epoch should be an int >= 0, but got epoch=-1"):
        s.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch should be"):
        s.global_order(1.0)
    with pytest.raises(ValueError, match=r"indices should be in \[0, 5\), but got 0..5"):
        s.locate([0, 5])
    with pytest.raises(ValueError, match="consumed should be an int in"):
        s.state_dict(consumed=6)


class Sized(torch.utils.data.Dataset):
    def __init__(self, n, tag):
        self.n, self.tag = n, tag

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.tag, i


def test_mixture_dataset_maps_global_indices_and_refuses_bad_input(shm_dir):
    mix = MixtureDataset([Sized(3, "a"), Sized(1, "b"), Sized(4, "c")])
    assert len(mix) == 8 and mix.lengths == (3, 1, 4)
    assert [mix[i] for i in range(8)] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0),
                                          ("c", 1), ("c", 2), ("c", 3)]
    assert mix[-1] == ("c", 3)
    sub, local = mix.locate([0, 3, 7])
    assert sub.tolist() == [0, 1, 2] and local.tolist() == [0, 0, 3]
    assert mix.counts([0, 1, 4, 5, 6]).tolist() == [2, 0, 3]
    assert mix.stats() == [None, None, None]
    assert not mix.ready_mask().any()
    with pytest.raises(ValueError, match=r"index should be an int in \[-8, 8\), but got index=8"):
        mix[8]
    with pytest.raises(ValueError, match=r"datasets should hold at least one dataset"):
        MixtureDataset([])
    with pytest.raises(ValueError, match=r"len\(datasets\[1\]\)=0"):
        MixtureDataset([Sized(3, "a"), Sized(0, "b")])
    with pytest.raises(TypeError, match=r"datasets\[0\] should be a dataset"):
        MixtureDataset([3])
    with pytest.raises(ValueError, match=r"caches should have one entry per dataset \(2\)"):
        MixtureDataset([Sized(3, "a"), Sized(2, "b")], caches=[None])
    with pytest.raises(TypeError, match=r"caches\[1\] should be a SharedCache, an "
                                        r"OpenSizeCache or None"):
        MixtureDataset([Sized(3, "a"), Sized(2, "b")], caches=[None, "x"])
    a = SharedCache(1e-4, 3, (4,), name="a")
    b = SharedCache(1e-4, 2, (5,), name="b")
    try:
        with pytest.raises(ValueError, match=r"caches\[1\].dataset_len should be "
                                             r"len\(datasets\[1\]\)=4, but got 2"):
            MixtureDataset([Sized(3, "a"), Sized(4, "b")], caches=[a, b])
        with pytest.raises(ValueError, match=r"datasets\[1\] should hold samples like "
                                             r"datasets\[0\] .*data_dims=\(4,\).* but its cache "
                                             r"has data_dims=\(5,\)"):
            MixtureDataset([Sized(3, "a"), Sized(2, "b")], caches=[a, b])
        mix = MixtureDataset([Sized(3, "a"), Sized(2, "b")], caches=[a, b], check_samples=False)
        assert mix.caches == [a, b]
        with pytest.raises(TypeError, match="since should be a list from this dataset's stats"):
            mix.stats(since={"hits": 0})
    finally:
        a.close()
        b.close()


# ----------------------------------------------------------------------------------------------
# With caches
# ----------------------------------------------------------------------------------------------


def cached_parts(sizes, slots):
    """One TwoLineDataset per sub-dataset, each with a KiB-sized cache of ``slots[k]`` slots."""
    parts = []
    for k, (n, m) in enumerate(zip(sizes, slots)):
        cache = SharedCache(budget_for(m, DIMS, dataset_len=n) if m < n else 1e-4, n, DIMS,
                            name=f"sub{k}")
        assert len(cache) == m
        parts.append(TwoLineDataset(cache, n))
    return parts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("weights", [None, (1, 1, 1)])
def test_hits_per_sub_dataset_through_a_dataloader(shm_dir, weights):
    """Three sub-datasets with real caches holding all, half and none... of their samples,
    read by two fork workers: each sub-dataset's counters in mix.stats() agree with what the
    dataset saw, and from the second epoch on its hit rate is what its cache holds."""
    sizes, slots = (40, 60, 30), (40, 30, 10)
    parts = cached_parts(sizes, slots)
    mix = MixtureDataset(parts)
    assert mix.caches == [p.cache for p in parts]
    s = WeightedMixtureSampler(mix, weights, seed=0)
    assert (s.num_replicas, s.rank) == (1, 0)
    loader = DataLoader(mix, batch_size=8, sampler=s, num_workers=2,
                        multiprocessing_context="fork")
    read: set[int] = set()
    try:
        for epoch in range(3):
            s.set_epoch(epoch)
            before = mix.stats()
            seen, hits = [], []
            for idx, x, hit in loader:
                seen += idx.tolist()
                hits += hit.tolist()
            after = mix.stats(since=before)
            # what the dataset returned were the sub-dataset's local indices
            sub, local = mix.locate(s.epoch_indices(epoch))
            assert seen == local.tolist()
            hits = np.asarray(hits)
            for k in range(3):
                mine = sub == k
                assert after[k]["hits"] == hits[mine].sum()
                assert after[k]["hits"] + after[k]["misses"] == mine.sum() == s.counts(epoch)[k]
                if epoch and weights is None:  # each element once: its slot, if any, is set
                    assert after[k]["hits"] == slots[k]
                    assert after[k]["hit_rate"] == pytest.approx(slots[k] / sizes[k])
            read |= set(s.epoch_indices(epoch).tolist())
            # cached now: exactly the elements read so far that have a slot
            assert np.flatnonzero(mix.ready_mask()).tolist() == sorted(
                i for i in read if mix.locate([i])[1][0] < slots[mix.locate([i])[0][0]])
    finally:
        for p in parts:
            p.cache.close()


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:size_limit_gib=.* leaves no slots")
def test_ready_first_over_the_mixture_puts_cached_samples_first(shm_dir):
    """ReadyFirstSampler with MixtureDataset.ready_mask as its ready: the epoch still has every
    index once, and with only sub-dataset 0 cached its samples move ahead, within the window."""
    sizes, slots = (30, 30), (30, 0)
    parts = cached_parts(sizes, slots)
    try:
        mix = MixtureDataset(parts)
        for i in range(30):
            parts[0].cache.set_slot(i, torch.zeros(DIMS, dtype=torch.uint8))
        base = WeightedMixtureSampler(mix, seed=1, num_replicas=1, rank=0)
        rf = ReadyFirstSampler(base, mix.ready_mask, window=8)
        rf.set_epoch(0)
        out = np.asarray(list(rf))
        order = base.epoch_indices(0)
        assert sorted(out.tolist()) == list(range(60))
        where = {int(i): t for t, i in enumerate(order)}
        assert max(abs(where[int(i)] - t) for t, i in enumerate(out)) <= 8
        first = np.flatnonzero(out < 30)[:15].mean()
        assert first < np.flatnonzero(order < 30)[:15].mean()
    finally:
        for p in parts:
            p.cache.close()


@pytest.mark.timeout(120)
def test_prefetcher_over_one_cache_of_the_concatenation(shm_dir):
    """One SharedCache over all sub-datasets: the mixture's global indices are the cache's, so
    the Prefetcher takes the mixture sampler as its base; it yields the mixture's epoch (with
    an up-weighted sub-dataset's repeats) and loads each distinct index once, then all hit."""
    lengths = (20, 10)
    cache = SharedCache(1e-4, sum(lengths), DIMS, name="whole")
    loads = []

    def load(i):
        loads.append(i)
        return torch.full(DIMS, i, dtype=torch.uint8)

    try:
        base = WeightedMixtureSampler(list(lengths), (1, 2), seed=4, num_replicas=1, rank=0)
        pf = Prefetcher(base, cache, load, threads=2, stand_aside=False)
        for epoch in range(2):
            pf.set_epoch(epoch)
            got = list(pf)
            assert got == base.epoch_indices(epoch).tolist()
            for i in got:
                assert torch.equal(cache.get_slot(i), torch.full(DIMS, i, dtype=torch.uint8))
        assert sorted(loads) == sorted(set(loads))  # no index loaded twice
        assert set(loads) == set(base.global_order(0).tolist()) | \
            set(base.global_order(1).tolist())
        pf.close()
    finally:
        cache.close()


# ----------------------------------------------------------------------------------------------
# CacheAwareSampler routing a mixture's order across nodes
# ----------------------------------------------------------------------------------------------


def routed(layout, weights, num_replicas=4, local_world_size=2, batch_size=8, seed=5):
    lengths = (300, 200, 100)
    return [CacheAwareSampler(layout, num_replicas, r, batch_size=batch_size,
                              local_world_size=local_world_size,
                              order=sampler(lengths, weights, seed=seed))
            for r in range(num_replicas)]


def test_cache_aware_sampler_routes_the_mixture_order_batch_by_batch():
    """2 nodes x 2 ranks, one cache layout over the concatenation (each node caches half):
    every global batch is the mixture's global batch (same multiset), the epoch is the
    mixture's epoch, and the ranks read far more from their node's cache than the mixture's
    own DistributedSampler-like split does."""
    layout = CacheLayout(600, 300, 2, seed=1)
    owners = layout.owners()
    R, B = 4, 8
    mix = sampler((300, 200, 100), (1, 1, 2), seed=5)
    plain = ranks((300, 200, 100), (1, 1, 2), num_replicas=R, seed=5)
    for epoch in (0, 3):
        rs = routed(layout, (1, 1, 2))
        for s in rs:
            s.set_epoch(epoch)
        got = [np.asarray(list(s)) for s in rs]
        padded = np.resize(mix.global_order(epoch), len(rs[0]) * R)
        for j in range(math.ceil(len(rs[0]) / B)):
            batch = np.concatenate([g[j * B:(j + 1) * B] for g in got])
            assert sorted(batch.tolist()) == sorted(padded[j * B * R:(j + 1) * B * R].tolist())
        hit = np.mean([owners[r // 2, got[r]].mean() for r in range(R)])
        split = np.mean([owners[r // 2, p.epoch_indices(epoch)].mean()
                         for r, p in enumerate(plain)])
        assert hit > split + 0.3, (hit, split)  # measured: 0.93 vs 0.51


@pytest.mark.filterwarnings("ignore:epoch 2 is iterated again")
def test_cache_aware_over_a_mixture_resumes_with_the_saved_weights():
    layout = CacheLayout(600, 300, 2, seed=1)
    before = routed(layout, (1, 1, 2))
    for s in before:
        s.set_epoch(2)
    full = [list(s) for s in before]
    it = iter(before[1])
    for _ in range(13):
        next(it)
    state = json.loads(json.dumps(before[1].state_dict()))
    assert state["order"]["weights"] == [1.0, 1.0, 2.0]
    after = routed(layout, (3, 1, 1))  # new weights: epoch 2 finishes with the saved ones
    for r, s in enumerate(after):
        s.load_state_dict(state)
        assert list(s) == full[r][13:]
        s.set_epoch(3)
        assert list(s) == routed(layout, (3, 1, 1))[r].epoch_indices(3).tolist()
    other = routed(layout, (1, 1, 2), seed=6)[0]
    with pytest.raises(ValueError, match=r"state\['seed'\] should be this sampler's seed=6, "
                                         r"but got state\['seed'\]=5"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['order'\] should be None"):
        CacheAwareSampler(layout, 4, 0, batch_size=8, local_world_size=2).load_state_dict(state)


def test_cache_aware_starts_at_the_epoch_of_a_mixture_that_was_resumed_before_wrapping():
    """A mixture whose state (epoch 2, weights (1, 1, 2)) was loaded before it was wrapped:
    the wrapper starts at epoch 2 with the saved weights, as if it had been resumed itself at
    the epoch's start, instead of resetting the mixture to epoch 0."""
    layout = CacheLayout(600, 300, 2, seed=1)
    saved = sampler((300, 200, 100), (1, 1, 2), seed=5)
    saved.set_epoch(2)
    mix = sampler((300, 200, 100), (3, 1, 1), seed=5)
    mix.load_state_dict(saved.state_dict(consumed=0))
    wrapped = CacheAwareSampler(layout, 4, 1, batch_size=8, local_world_size=2, order=mix)
    assert wrapped.epoch == 2 and mix.epoch == 2
    assert list(wrapped) == routed(layout, (1, 1, 2))[1].epoch_indices(2).tolist()
    wrapped.set_epoch(3)  # the new weights from the next epoch on
    assert list(wrapped) == routed(layout, (3, 1, 1))[1].epoch_indices(3).tolist()


def test_cache_aware_refuses_an_order_of_other_indices():
    layout = CacheLayout(600, 300, 2, seed=1)
    with pytest.raises(ValueError, match=r"order should draw from the 600 indices of dataset, "
                                         r"but its sub-datasets have sum\(lengths\)=500"):
        CacheAwareSampler(layout, 4, 0, batch_size=8, order=sampler((300, 200)))
    with pytest.raises(TypeError, match="order should have global_order"):
        CacheAwareSampler(layout, 4, 0, batch_size=8, order=[1, 2])


def test_cache_aware_refuses_an_order_over_other_sub_datasets(shm_dir):
    """Same total, other sub-dataset lengths: the order's indices would land in the wrong
    sub-datasets of the MixtureDataset (wrong shares, silently)."""
    caches = [SharedCache(budget_for(n, DIMS, dataset_len=n), n, DIMS, name=f"o{k}")
              for k, n in enumerate((300, 200))]
    try:
        mix = MixtureDataset([TwoLineDataset(c, len(c)) for c in caches])
        CacheAwareSampler(mix, 1, 0, batch_size=8, order=sampler((300, 200)))
        with pytest.raises(ValueError, match=r"order should draw from the sub-datasets of "
                                             r"dataset, of lengths \[300, 200\], but its "
                                             r"sub-datasets have lengths=\[200, 300\]"):
            CacheAwareSampler(mix, 1, 0, batch_size=8, order=sampler((200, 300)))
    finally:
        for c in caches:
            c.close()


@pytest.mark.filterwarnings("ignore:rank=1 is on node 1")
def test_cache_aware_routes_over_one_cache_per_sub_dataset(shm_dir):
    """A MixtureDataset whose three sub-datasets have their own 2-node caches (real
    SharedCaches, built here as node 0 of a 2-node job): CacheAwareSampler routes the mixture's
    order over their layouts side by side. Global batches keep their multisets, and the ranks
    read far more from their node's caches than the mixture's own split does."""
    sizes, R, B = (300, 200, 100), 2, 8
    world = World(rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0,
                  num_nodes=2)
    caches = [SharedCache(budget_for(n // 2, DIMS, dataset_len=n), n, DIMS, name=f"m{k}",
                          world=world) for k, n in enumerate(sizes)]
    try:
        mix = MixtureDataset([TwoLineDataset(c, n) for c, n in zip(caches, sizes)])
        owners = np.concatenate([c.layout.owners() for c in caches], axis=1)
        assert owners.shape == (2, 600) and (owners.sum(axis=0) == 1).all()  # halves, disjoint
        rs = [CacheAwareSampler(mix, R, r, batch_size=B, local_world_size=1,
                                order=sampler(sizes, (1, 1, 2), seed=5)) for r in range(R)]
        plain = ranks(sizes, (1, 1, 2), num_replicas=R, seed=5)
        for s in rs:
            s.set_epoch(1)
        got = [np.asarray(list(s)) for s in rs]
        padded = np.resize(plain[0].global_order(1), len(rs[0]) * R)
        for j in range(math.ceil(len(rs[0]) / B)):
            batch = np.concatenate([g[j * B:(j + 1) * B] for g in got])
            assert sorted(batch.tolist()) == sorted(padded[j * B * R:(j + 1) * B * R].tolist())
        hit = np.mean([owners[r, got[r]].mean() for r in range(R)])
        split = np.mean([owners[r, p.epoch_indices(1)].mean() for r, p in enumerate(plain)])
        assert hit > split + 0.3, (hit, split)
        state = rs[0].state_dict()
        assert state["slots"] == [len(c) for c in caches] and state["num_nodes"] == 2
        with pytest.raises(ValueError, match=r"dataset.caches should all have the same "
                                             r"num_nodes, but got num_nodes \[1, 2\]"):
            one = SharedCache(1e-4, 10, DIMS, name="one")
            try:
                CacheAwareSampler(MixtureDataset([TwoLineDataset(caches[2], 100),
                                                  TwoLineDataset(one, 10)]), R, 0, batch_size=B)
            finally:
                one.close()
    finally:
        for c in caches:
            c.close()


# ----------------------------------------------------------------------------------------------
# torchrun
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_torchrun_two_ranks_cover_the_mixture_and_resume_from_rank_1(shm_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(CHILDREN / "mixture_ddp.py"), str(tmp_path)]
    r = subprocess.run(cmd, env=rank_env(shm_dir), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    sizes, slots = out[0]["sizes"], out[0]["slots"]
    n = sum(sizes)
    assert [o["num_replicas"] for o in out] == [2, 2] and [o["rank"] for o in out] == [0, 1]
    for epoch in range(2):  # both ranks together: every element of every sub-dataset once
        together = out[0]["epochs"][epoch] + out[1]["epochs"][epoch]
        assert sorted(together) == list(range(n))
    # one cache per sub-dataset on the node, shared by both ranks: epoch 1 hits every slot
    assert out[0]["hits"][1] == slots and out[0]["reads"][1] == sizes
    # every rank loaded rank 1's state, taken mid-epoch 2, and continued where it would have
    for o in out:
        assert o["resumed"] == o["epochs"][2][o["consumed"]:]
    assert out[0]["consumed"] == out[1]["consumed"] > 0


def test_mixtures_py_works_copied_next_to_stocaching_py(tmp_path):
    out = run_copied(tmp_path, ("stocaching.py", "_common.py", "masks.py", "trainers.py",
                                "mixtures.py"), """
        import os, mixtures, stocaching
        assert os.path.dirname(stocaching.__file__) == os.getcwd()  # the copy, not the package
        assert mixtures.BaseCache is stocaching.BaseCache
        s = mixtures.WeightedMixtureSampler([3, 2], num_replicas=1, rank=0)
        print(sorted(s))
    """)
    assert out.strip() == "[0, 1, 2, 3, 4]"
