"""CacheAwareSampler: ranks simulated in one process with explicit rank and num_replicas."""

import collections
import dataclasses
import itertools
import json
import math
import os
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from _helpers import (CHILDREN, TwoLineDataset, assert_ended_well, rank_env, run_bounded,
                      run_copied)
from stocaching import CacheAwareSampler, CacheLayout, World, ideal_hit_rate

SETTINGS = settings(max_examples=40)  # derandomized, no deadline: conftest.py


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class MatrixLayout(CacheLayout):
    """A CacheLayout whose owners are any boolean matrix ``(num_nodes, dataset_len)``, for
    layouts that CacheLayout itself does not make (the sampler reads only dataset_len,
    num_nodes and owner_rows())."""

    matrix: np.ndarray = None

    @classmethod
    def of(cls, matrix):
        matrix = np.asarray(matrix, dtype=bool)
        return cls(matrix.shape[1], int(matrix.sum(axis=1).max(initial=0)), matrix.shape[0],
                   matrix=matrix)

    def owner_rows(self):
        yield from self.matrix.copy()


def make_samplers(layout, batch_size, local_world_size=1, **kwargs):
    """One sampler per rank of a job with ``local_world_size`` ranks on each node."""
    world_size = layout.num_nodes * local_world_size
    return [CacheAwareSampler(layout, world_size, r, batch_size=batch_size,
                              local_world_size=local_world_size, **kwargs)
            for r in range(world_size)]


def run_epoch(samplers, epoch=0):
    """(num_replicas, len(sampler)) array: each rank's indices for ``epoch``."""
    for s in samplers:
        s.set_epoch(epoch)
    return np.array([list(s) for s in samplers], dtype=np.int64).reshape(len(samplers), -1)


def distributed_epoch(dataset_len, num_replicas, epoch=0, **kwargs):
    """The same array for torch's DistributedSampler."""
    out = []
    for r in range(num_replicas):
        s = DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=r, **kwargs)
        s.set_epoch(epoch)
        out.append(list(s))
    return np.array(out, dtype=np.int64).reshape(num_replicas, -1)


def global_batches(per_rank, batch_size):
    """Sorted contents of each global batch: batch j of every rank, together."""
    return [sorted(per_rank[:, j:j + batch_size].ravel().tolist())
            for j in range(0, per_rank.shape[1], batch_size)]


def node_hits(per_rank, owners, batch_size, local_world_size):
    """(num_batches, num_nodes): samples of each global batch read by a node that caches them."""
    node = np.arange(len(per_rank)) // local_world_size
    cached = owners[node[:, None], per_rank].astype(np.int64)
    if not cached.size:
        return np.zeros((0, owners.shape[0]), dtype=np.int64)
    per_batch = np.add.reduceat(cached, np.arange(0, cached.shape[1], batch_size), axis=1)
    return per_batch.reshape(owners.shape[0], local_world_size, -1).sum(axis=1).T


def optimum_hits(owners, batch, cap):
    """Most samples of ``batch`` that nodes taking ``cap`` each can read from their own cache:
    the minimum cut, min over node sets A of cap * |A| + #(samples cached outside A)."""
    n = owners.shape[0]
    kind = (owners[:, batch] << np.arange(n)[:, None]).sum(axis=0)
    count = np.bincount(kind, minlength=1 << n)
    return min(cap * bin(a).count("1") + count[[t for t in range(1 << n) if t & ~a]].sum()
               for a in range(1 << n))


def assert_best_split(per_rank, owners, batch_size, local_world_size):
    """Every global batch has as many samples read from their node's cache as possible."""
    hits = node_hits(per_rank, owners, batch_size, local_world_size).sum(axis=1)
    for j, start in enumerate(range(0, per_rank.shape[1], batch_size)):
        batch = per_rank[:, start:start + batch_size]
        assert hits[j] == optimum_hits(owners, batch.ravel(), batch.shape[1] * local_world_size)


# ------------------------------------------------------------------------------------------------
# Every index once, the same global batches as DistributedSampler, the best split over nodes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset_len, num_nodes, slots, local_world_size, batch_size", [
    (1000, 4, 250, 1, 8),     # disjoint caches, even split
    (1003, 2, 300, 3, 5),     # nothing divides
    (500, 4, 250, 2, 7),      # overlap: every index cached on two nodes
    (10, 2, 3, 4, 3),         # fewer indices than ranks ask for: padding
    (3, 2, 1, 4, 2),          # padding longer than the dataset
])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_index_once_per_epoch(dataset_len, num_nodes, slots, local_world_size, batch_size,
                                    drop_last):
    samplers = make_samplers(CacheLayout(dataset_len, slots, num_nodes, seed=3), batch_size,
                             local_world_size, drop_last=drop_last)
    per_rank = run_epoch(samplers, epoch=1)
    num_replicas = len(samplers)
    assert per_rank.shape == (num_replicas, len(samplers[0]))
    counts = np.bincount(per_rank.ravel(), minlength=dataset_len)
    if drop_last:
        assert per_rank.size == dataset_len // num_replicas * num_replicas
        assert counts.max() <= 1
    else:
        total = math.ceil(dataset_len / num_replicas) * num_replicas
        assert per_rank.size == total
        # Padding repeats the shuffled order from its start, so no index is repeated more than
        # once beyond the others.
        assert counts.min() == total // dataset_len
        assert counts.max() == math.ceil(total / dataset_len)


@st.composite
def jobs(draw):
    num_nodes = draw(st.integers(1, 4))
    dataset_len = draw(st.integers(1, 400))
    return dict(layout=CacheLayout(dataset_len, draw(st.integers(0, dataset_len)), num_nodes,
                                   seed=draw(st.integers(0, 99))),
                batch_size=draw(st.integers(1, 16)), local_world_size=draw(st.integers(1, 3)),
                shuffle=draw(st.booleans()), drop_last=draw(st.booleans()),
                seed=draw(st.integers(0, 2**63 - 1)), epoch=draw(st.integers(0, 5)))


@SETTINGS
@given(jobs())
def test_global_batches_are_those_of_distributed_sampler_split_optimally(job):
    layout, batch_size, lws = job["layout"], job["batch_size"], job["local_world_size"]
    samplers = make_samplers(layout, batch_size, lws, shuffle=job["shuffle"],
                             drop_last=job["drop_last"], seed=job["seed"])
    per_rank = run_epoch(samplers, job["epoch"])
    reference = distributed_epoch(layout.dataset_len, len(samplers), job["epoch"],
                                  shuffle=job["shuffle"], drop_last=job["drop_last"],
                                  seed=job["seed"])
    assert per_rank.shape == reference.shape
    assert len(samplers[0]) == per_rank.shape[1]
    assert global_batches(per_rank, batch_size) == global_batches(reference, batch_size)

    assert_best_split(per_rank, layout.owners(), batch_size, lws)


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 300), st.integers(1, 8), st.integers(1, 3),
       st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_any_owner_matrix_is_split_optimally(num_nodes, dataset_len, batch_size, lws, density,
                                             seed):
    # A layout with arbitrary, not CacheLayout's, sets of nodes per sample.
    owners = np.random.default_rng(seed).random((num_nodes, dataset_len)) < density
    layout = MatrixLayout.of(owners)
    per_rank = run_epoch(make_samplers(layout, batch_size, lws, seed=seed), epoch=1)
    assert sorted(per_rank.ravel()) == sorted(distributed_epoch(
        dataset_len, len(per_rank), epoch=1, seed=seed).ravel())
    assert_best_split(per_rank, owners, batch_size, lws)


# ------------------------------------------------------------------------------------------------
# Order: a pure function of (seed, epoch)
# ------------------------------------------------------------------------------------------------


def test_same_seed_same_order_whatever_the_global_rng():
    layout = CacheLayout(2000, 500, 4, seed=1)
    torch.manual_seed(0)
    np.random.seed(0)
    first = run_epoch(make_samplers(layout, 16, 2, seed=7), epoch=3)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    torch.manual_seed(123)
    np.random.seed(123)
    again = run_epoch(make_samplers(layout, 16, 2, seed=7), epoch=3)
    assert np.array_equal(first, again)
    torch.manual_seed(0)
    np.random.seed(0)
    run_epoch(make_samplers(layout, 16, 2, seed=7), epoch=3)
    assert torch.equal(torch.get_rng_state(), torch_state)  # the global RNGs are not used
    assert np.array_equal(np.random.get_state()[1], np_state[1])


@pytest.mark.parametrize("change", [dict(epoch=1), dict(seed=1)])
def test_other_epoch_or_seed_other_order(change):
    layout = CacheLayout(2000, 500, 4, seed=1)
    base = run_epoch(make_samplers(layout, 16, 2, seed=0), epoch=0)
    other = run_epoch(make_samplers(layout, 16, 2, seed=change.get("seed", 0)),
                      epoch=change.get("epoch", 0))
    assert not np.array_equal(base, other)
    assert global_batches(base, 16)[0] != global_batches(other, 16)[0]
    # ... while every rank still reads mostly from its own node
    owners = layout.owners()
    assert node_hits(other, owners, 16, 2).mean() > 0.8 * 16 * 2


def test_epoch_indices_matches_iteration_and_keeps_state():
    s = CacheAwareSampler(CacheLayout(500, 100, 2), 4, 3, batch_size=8, local_world_size=2)
    s.set_epoch(2)
    before = s.state_dict()
    assert s.epoch_indices(2).tolist() == list(s)
    assert s.epoch_indices(5).tolist() != s.epoch_indices(2).tolist()
    assert before == {**s.state_dict(), "consumed": 0}


# ------------------------------------------------------------------------------------------------
# Locality: hit rate against the ideal and DistributedSampler
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("local_world_size", [1, 2])
def test_hit_rate_is_near_ideal(local_world_size):
    n, f, batch_size, dataset_len = 4, 0.25, 64, 2**15
    layout = CacheLayout(dataset_len, int(dataset_len * f), n, seed=0)
    owners = layout.owners()
    per_rank = run_epoch(make_samplers(layout, batch_size, local_world_size), epoch=0)
    hits = node_hits(per_rank, owners, batch_size, local_world_size)
    node_batch = batch_size * local_world_size
    ideal = ideal_hit_rate(n, f, node_batch)
    assert hits.mean() / node_batch >= 0.95 * ideal

    # Disjoint caches: each node reads every cached sample of the batch it can take.
    for j, start in enumerate(range(0, per_rank.shape[1], batch_size)):
        batch = per_rank[:, start:start + batch_size].ravel()
        assert np.array_equal(hits[j], np.minimum(node_batch, owners[:, batch].sum(axis=1)))

    # DistributedSampler with the 0.2.1 layout (every node caches the first slots indices)
    # hits about f, far below the threshold.
    reference = distributed_epoch(dataset_len, n * local_world_size)
    baseline = (reference < layout.slots).mean()
    assert abs(baseline - f) < 0.01
    assert baseline < 0.95 * ideal


@pytest.mark.parametrize("slots", [1600, 2000, 3000])
def test_overlapping_caches_are_used(slots):
    # 4 nodes each caching 40%, 50% or 75% of the data: n * f > 1, many samples on two nodes.
    layout = CacheLayout(4000, slots, 4, seed=5)
    owners = layout.owners()
    assert (owners.sum(axis=0) > 1).mean() >= 0.6
    per_rank = run_epoch(make_samplers(layout, 32), epoch=0)
    hits = node_hits(per_rank, owners, 32, 1)
    assert hits.sum() / per_rank.size >= 0.95 * ideal_hit_rate(4, slots / 4000, 32)
    assert_best_split(per_rank, owners, 32, 1)


def twin_layout(dataset_len, num_nodes, seed):
    """A layout in which nodes k and k + num_nodes / 2 cache the same half of the dataset.
    CacheLayout avoids identical subsets; this one makes them, to check that twins share
    their misses."""
    twin = num_nodes // 2
    parts = np.array_split(np.random.default_rng(seed).permutation(dataset_len), twin)
    owners = np.zeros((num_nodes, dataset_len), dtype=bool)
    for k, part in enumerate(parts):
        owners[k, part] = owners[k + twin, part] = True
    return MatrixLayout.of(owners)


@pytest.mark.parametrize("num_nodes", [4, 8])
def test_nodes_caching_the_same_samples_share_the_misses(num_nodes):
    layout = twin_layout(4096, num_nodes, seed=2)
    owners = layout.owners()
    twin = num_nodes // 2
    assert np.array_equal(owners[:twin], owners[twin:])
    hits = node_hits(run_epoch(make_samplers(layout, 16), epoch=0), owners, 16, 1)
    assert hits.min() < 16  # there are misses to share...
    assert np.abs(hits[:, :twin] - hits[:, twin:]).max() <= 1  # ... and they are shared


# ------------------------------------------------------------------------------------------------
# Quality: a rank's batch is as mixed as a random batch
# ------------------------------------------------------------------------------------------------


def batch_stats(per_rank, labels, batch_size):
    """Unique classes and label entropy (nats) of every batch of every rank."""
    uniq, entropy = [], []
    for row in per_rank:
        for start in range(0, len(row) - batch_size + 1, batch_size):
            counts = np.bincount(labels[row[start:start + batch_size]])
            p = counts[counts > 0] / batch_size
            uniq.append(len(p))
            entropy.append(-(p * np.log(p)).sum())
    return np.array(uniq), np.array(entropy)


def test_batches_are_as_mixed_as_random_batches():
    dataset_len, classes, batch_size, lws = 2**14, 128, 32, 2
    labels = np.arange(dataset_len) // (dataset_len // classes)  # sorted by class
    layout = CacheLayout(dataset_len, dataset_len // 4, 4, seed=0)
    samplers = make_samplers(layout, batch_size, lws)
    ours = np.hstack([run_epoch(samplers, e) for e in range(2)])
    plain = np.hstack([distributed_epoch(dataset_len, len(samplers), e) for e in range(2)])
    # A negative control: the same global batches, each sorted and cut into contiguous pieces.
    bad = np.hstack([np.sort(np.array(b).reshape(-1)).reshape(len(samplers), -1)
                     for b in global_batches(ours, batch_size)])
    stats = [batch_stats(x, labels, batch_size) for x in (ours, plain, bad)]
    for a, b, c in zip(*stats):
        noise = 4 * math.sqrt(a.var() / len(a) + b.var() / len(b))
        assert abs(a.mean() - b.mean()) < noise
        assert abs(c.mean() - b.mean()) > 10 * noise


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_node_deals_its_share_at_random(shuffle):
    # One node, two ranks: with shuffle=False too, rank 0 does not get the lower half of
    # every batch (a fixed split would happen 1 time in C(8, 4) = 70 by chance).
    per_rank = run_epoch(make_samplers(CacheLayout(4000, 1000), 4, 2, shuffle=shuffle))
    lower = [np.array_equal(np.sort(a), np.sort(np.r_[a, b])[:4])
             for a, b in zip(per_rank[0].reshape(-1, 4), per_rank[1].reshape(-1, 4))]
    assert np.mean(lower) < 0.05


# ------------------------------------------------------------------------------------------------
# Length, padding, drop_last
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset_len, num_nodes, lws", [(100, 1, 1), (101, 2, 2), (7, 2, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_that_of_distributed_sampler(dataset_len, num_nodes, lws, drop_last):
    samplers = make_samplers(CacheLayout(dataset_len, 5, num_nodes), 6, lws, drop_last=drop_last)
    reference = DistributedSampler(range(dataset_len), num_replicas=num_nodes * lws, rank=0,
                                   drop_last=drop_last)
    for s in samplers:
        assert len(s) == len(reference) == len(list(s))


def test_last_global_batch_is_short_on_every_rank():
    samplers = make_samplers(CacheLayout(1000, 100, 2), 32, 2)
    for s in samplers:
        sizes = [len(b) for b in DataLoader(range(1000), batch_size=32, sampler=s)]
        assert sizes == [32] * 7 + [250 - 7 * 32]


# ------------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("consumed", [0, 8, 37, 125])
@pytest.mark.parametrize("lws", [1, 2])
def test_resume_mid_epoch(consumed, lws):
    layout = CacheLayout(1000, 200, 2, seed=4)
    for s in make_samplers(layout, 8, lws, seed=9):
        s.set_epoch(3)
        full = s.epoch_indices(3).tolist()
        it = iter(s)
        assert list(itertools.islice(it, consumed)) == full[:consumed]
        state = s.state_dict()
        assert (state["epoch"], state["consumed"]) == (3, consumed)

        fresh = make_samplers(layout, 8, lws, seed=9)[s.rank]
        fresh.load_state_dict(state)
        fresh.set_epoch(3)  # the training loop's call keeps the position
        assert fresh.state_dict() == state
        assert list(fresh) == full[consumed:]
        fresh.set_epoch(4)
        assert len(list(fresh)) == len(fresh)  # the next epoch is whole


def test_resume_counts_what_the_dataloader_took():
    s = CacheAwareSampler(CacheLayout(1000, 200, 2), 2, 1, batch_size=16, local_world_size=1)
    s.set_epoch(1)
    loader = DataLoader(range(1000), batch_size=16, sampler=s)
    batches = list(itertools.islice(loader, 3))
    assert s.state_dict()["consumed"] == 3 * 16
    assert s.state_dict(consumed=32)["consumed"] == 32

    fresh = CacheAwareSampler(CacheLayout(1000, 200, 2), 2, 1, batch_size=16, local_world_size=1)
    fresh.load_state_dict(s.state_dict())
    rest = [int(i) for b in DataLoader(range(1000), batch_size=16, sampler=fresh) for i in b]
    assert [int(i) for b in batches for i in b] + rest == s.epoch_indices(1).tolist()


def test_any_rank_may_load_rank_0_state():
    samplers = make_samplers(CacheLayout(600, 100, 3), 10, 2)
    list(itertools.islice(iter(samplers[0]), 20))
    state = samplers[0].state_dict()
    other = make_samplers(CacheLayout(600, 100, 3), 10, 2)[5]
    other.load_state_dict(state)
    assert list(other) == other.epoch_indices(0).tolist()[20:]


@pytest.mark.parametrize("field, value", [("seed", 1), ("dataset_len", 999), ("batch_size", 4),
                                          ("num_replicas", 6), ("shuffle", False),
                                          ("drop_last", True)])
def test_load_state_from_another_setup_names_the_field(field, value):
    setup = dict(dataset_len=1000, batch_size=8, num_replicas=4, seed=0, shuffle=True,
                 drop_last=False)
    changed = {**setup, field: value}

    def sampler(dataset_len, num_replicas, **kwargs):
        return CacheAwareSampler(CacheLayout(dataset_len, 100, 2), num_replicas=num_replicas,
                                 rank=0, local_world_size=num_replicas // 2, **kwargs)

    # (mid-batch for both batch sizes: another world resumes only at a batch boundary)
    state = sampler(**changed).state_dict(consumed=3)
    with pytest.raises(ValueError, match=rf"state\['{field}'\] should be this sampler's {field}"):
        sampler(**setup).load_state_dict(state)


# Worlds: (num_nodes, local_world_size, batch_size) of a job, then of the job that resumes it.
RESIZES = [((2, 2, 8), (1, 2, 8)),    # 4 ranks resumed on 2
           ((1, 2, 8), (2, 4, 4)),    # 2 ranks on 8, each with half the batch
           ((2, 2, 8), (3, 1, 16))]   # 4 ranks on 3 nodes of one


def interrupted(world, *, epoch, batches, drop_last=False, state=None, n=1000):
    """Samplers of ``world`` over a cache of ``n`` indices, each rank's indices of ``epoch``
    taken up to ``batches`` batches (all of them for None), after loading ``state`` if given;
    returns (taken indices of every rank, rank 0's state then)."""
    nodes, lws, batch = world
    samplers = make_samplers(CacheLayout(n, 300, nodes, seed=2), batch, lws, seed=5,
                             drop_last=drop_last)
    taken = []
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch)  # the training loop's call keeps the position
        it = iter(s)
        taken += list(it) if batches is None else list(itertools.islice(it, batches * batch))
    return taken, samplers[0].state_dict(consumed=None if batches is None else
                                         batches * batch)


@pytest.mark.parametrize("n", [1000, 1003])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("before, after", RESIZES)
def test_a_state_resumes_on_another_world_with_every_index_of_the_epoch_once(
        before, after, drop_last, n):
    """A job of one world interrupted after 5 batches, resumed from rank 0's state by a job
    of another (other num_replicas, nodes, batch_size): over both, every index of the epoch
    comes once; the only repeats are the new world's padding (fewer than its ranks: the first
    world's padding, where n does not divide, is not repeated), or with drop_last none, and
    fewer indices missing than the new world's ranks. The next epoch is whole on the new
    world."""
    first, state = interrupted(before, epoch=2, batches=5, drop_last=drop_last, n=n)
    assert state["consumed"] == 5 * before[2] and state["epoch_done"] == 0
    rest, _ = interrupted(after, epoch=2, batches=None, drop_last=drop_last, state=state, n=n)
    both = collections.Counter(first + rest)
    ranks = after[0] * after[1]
    if drop_last:
        assert max(both.values()) == 1 and n - len(both) < ranks
    else:
        assert set(both) == set(range(n)) and sum(both.values()) - n < ranks
    nxt, _ = interrupted(after, epoch=3, batches=None, drop_last=drop_last, state=state, n=n)
    assert len(set(nxt)) == len(nxt) if drop_last else set(nxt) == set(range(n))


@pytest.mark.parametrize("n", [1000, 1001])
def test_a_job_resized_twice_in_one_epoch_gives_every_index_once(n):
    """2 nodes, then 3, then 2 again, interrupted within one epoch each time: the second
    resume takes the rest of the rest (the state says how much of the epoch's order the
    worlds before had taken), and the three jobs give every index once but the last padding."""
    two, three = (2, 2, 8), (3, 2, 8)
    first, state = interrupted(two, epoch=1, batches=4, n=n)
    second, state = interrupted(three, epoch=1, batches=3, state=state, n=n)
    assert state["epoch_done"] == 4 * 8 * 4 and state["consumed"] == 3 * 8
    third, _ = interrupted(two, epoch=1, batches=None, state=state, n=n)
    both = collections.Counter(first + second + third)
    assert set(both) == set(range(n)) and sum(both.values()) - n < 4


def test_another_world_mid_batch_is_refused_naming_the_field():
    """A position inside a batch is not a prefix of the epoch's global sequence: another
    world cannot resume it, and the error says so, naming num_replicas and both values."""
    _, state = interrupted((2, 2, 8), epoch=0, batches=None)
    state = {**state, "consumed": 13}
    fresh = make_samplers(CacheLayout(1000, 300, 1, seed=2), 8, 2, seed=5)[0]
    with pytest.raises(ValueError, match=r"state\['num_replicas'\] should be this sampler's "
                                         r"num_replicas=2, but got state\['num_replicas'\]=4;.*"
                                         r"batch boundary only"):
        fresh.load_state_dict(state)
    assert list(fresh) == fresh.epoch_indices(0).tolist()  # nothing was changed


@pytest.mark.timeout(600)
def test_a_torchrun_job_resumed_on_another_number_of_ranks_gives_every_index_once(tmp_path,
                                                                                  shm_dir):
    """Real torchrun: 2 ranks take 5 batches of epoch 1 and save rank 0's state; 3 ranks
    load it and finish the epoch. Every index of the 600 comes once over both jobs, but the
    padding of the second (fewer than its 3 ranks); each job cleans up after itself."""
    out = str(tmp_path / "got")

    def job(ranks, state_in, state_out, batches):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", str(CHILDREN / "resized_job.py"), state_in,
               state_out, batches, f"{out}{ranks}"]
        assert_ended_well(run_bounded(cmd, env=rank_env(shm_dir), timeout=300))
        return [i for r in range(ranks)
                for i in json.load(open(f"{out}{ranks}.rank{r}"))]

    first = job(2, "-", str(tmp_path / "state2"), "5")
    assert len(first) == 2 * 5 * 8
    rest = job(3, str(tmp_path / "state2"), str(tmp_path / "state3"), "all")
    both = collections.Counter(first + rest)
    assert set(both) == set(range(600)) and sum(both.values()) - 600 < 3
    assert [f for f in os.listdir(shm_dir) if f.startswith("stocaching")] == []


def test_cache_layout_may_change_only_at_a_batch_boundary():
    def sampler(slots):
        return CacheAwareSampler(CacheLayout(1000, slots, 2), 2, 0, batch_size=8, local_world_size=1)

    sampler(100).load_state_dict(sampler(300).state_dict(consumed=16))
    with pytest.raises(ValueError, match=r"state\['slots'\] should be this sampler's slots=100"):
        sampler(100).load_state_dict(sampler(300).state_dict(consumed=17))


def test_a_cache_made_with_another_random_subset_is_refused_mid_batch():
    """The layout's identity includes random_subset (a cache made differently): refused where
    the other layout fields are, mid-batch, naming the field and both values."""
    def sampler(random_subset):
        return CacheAwareSampler(CacheLayout(1000, 300, random_subset=random_subset), 2, 0,
                                 batch_size=8, local_world_size=2)

    state = sampler(True).state_dict(consumed=17)
    assert state["random_subset"] is True
    with pytest.raises(ValueError, match=r"state\['random_subset'\] should be this sampler's "
                                         r"random_subset=False, but got "
                                         r"state\['random_subset'\]=True"):
        sampler(False).load_state_dict(state)
    sampler(False).load_state_dict(sampler(True).state_dict(consumed=16))  # a batch boundary


def test_a_state_saved_without_random_subset_loads_unchecked():
    s = CacheAwareSampler(CacheLayout(1000, 300, random_subset=True), 2, 0, batch_size=8,
                          local_world_size=2)
    s.set_epoch(2)
    old = {k: v for k, v in s.state_dict(consumed=17).items() if k != "random_subset"}
    fresh = CacheAwareSampler(CacheLayout(1000, 300), 2, 0, batch_size=8, local_world_size=2)
    fresh.load_state_dict(old)
    assert list(fresh) == s.epoch_indices(2).tolist()[17:]


def test_set_epoch_after_load_to_another_epoch_warns():
    s = CacheAwareSampler(CacheLayout(100, 10), 1, 0, batch_size=4)
    s.load_state_dict({**s.state_dict(), "consumed": 8, "epoch": 2})
    with pytest.warns(UserWarning, match=r"discards the resume position loaded for epoch 2"):
        s.set_epoch(3)
    assert len(list(s)) == 100


def test_iterating_an_epoch_twice_warns():
    s = CacheAwareSampler(CacheLayout(100, 10), 1, 0, batch_size=4)
    list(s)
    with pytest.warns(UserWarning, match=r"call sampler.set_epoch\(epoch\)"):
        list(s)


# ------------------------------------------------------------------------------------------------
# What the sampler accepts
# ------------------------------------------------------------------------------------------------


def fake_cache(layout, world):
    """The attributes a SharedCache offers the sampler."""
    return types.SimpleNamespace(layout=layout, world=world, dataset_len=layout.dataset_len)


def test_defaults_come_from_the_cache_world():
    world = World(rank=5, world_size=6, local_rank=2, local_world_size=3, node_rank=1,
                  num_nodes=2)
    cache = fake_cache(CacheLayout(100, 30, 2), world)
    for source in (cache, TwoLineDataset(cache, 100)):
        s = CacheAwareSampler(source, batch_size=4)
        assert (s.num_replicas, s.rank, s.local_world_size, s.node_rank) == (6, 5, 3, 1)


def test_defaults_come_from_the_environment(monkeypatch):
    layout = CacheLayout(100, 30, 2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = CacheAwareSampler(layout, batch_size=4)
    assert (s.num_replicas, s.rank, s.local_world_size, s.node_rank) == (4, 3, 2, 1)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    single = CacheAwareSampler(CacheLayout(100, 30), batch_size=4)
    assert (single.num_replicas, single.rank, single.local_world_size) == (1, 0, 1)


def test_rank_on_another_node_than_its_cache_warns():
    world = World(rank=0, world_size=4, local_rank=0, local_world_size=2, node_rank=0,
                  num_nodes=2)
    with pytest.warns(UserWarning, match=r"rank=2 is on node 1 .* cache was built on node 0"):
        CacheAwareSampler(fake_cache(CacheLayout(100, 30, 2), world), rank=2, batch_size=4)


LAYOUT = CacheLayout(100, 25, 2)


POSITIVE = r"should be a positive int, but got"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_size=0), ValueError, rf"batch_size {POSITIVE} batch_size=0"),
    (dict(batch_size=True), TypeError, rf"batch_size {POSITIVE} batch_size=True"),
    (dict(batch_size=8.0), TypeError, rf"batch_size {POSITIVE} batch_size=8.0"),
    (dict(num_replicas=0), ValueError, rf"num_replicas {POSITIVE} num_replicas=0"),
    (dict(num_replicas="2"), TypeError, rf"num_replicas {POSITIVE} num_replicas='2'"),
    (dict(rank=2), ValueError, r"rank should be an int in \[0, 1\], but got rank=2"),
    (dict(rank=-1), ValueError, r"rank should be an int in \[0, 1\], but got rank=-1"),
    (dict(rank=False), TypeError, r"rank should be an int in \[0, 1\], but got rank=False"),
    (dict(seed=-1), ValueError, r"seed should be an int in \[0, 9223372036854775807\], but got "
     r"seed=-1"),
    (dict(seed=None), TypeError, r"seed should be an int in .*, but got seed=None"),
    (dict(num_replicas=4, rank=0), ValueError, r"num_replicas should be num_nodes \* "
     r"local_world_size = 2 \* 1 = 2 .* but got num_replicas=4"),
    (dict(source=object()), TypeError,
     r"dataset should be a Dataset with a \.cache attribute \(a cache or None\), a Subset of "
     r"one, a cache \(SharedCache, OpenSizeCache\) or a CacheLayout, but got object"),
    (dict(source=TwoLineDataset(fake_cache(LAYOUT, World()), 99)), ValueError,
     r"len\(dataset\) should be its cache's dataset_len=100, but got len\(dataset\)=99"),
])
def test_bad_arguments_name_the_parameter_and_the_value(kwargs, error, match):
    args = dict(source=LAYOUT, batch_size=4, num_replicas=2, rank=1, local_world_size=1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        CacheAwareSampler(args.pop("source"), **args)


@pytest.mark.parametrize("call, error, match", [
    (lambda s: s.set_epoch(-1), ValueError, r"epoch should be an int >= 0, but got epoch=-1"),
    (lambda s: s.set_epoch(1.0), TypeError, r"epoch should be an int >= 0, but got epoch=1.0"),
    (lambda s: s.state_dict(consumed=51), ValueError,
     r"consumed should be an int in \[0, 50\], but got consumed=51"),
    (lambda s: s.load_state_dict({"epoch": 0}), ValueError, r"state should be a dict from "
     r"CacheAwareSampler.state_dict\(\), but it lacks \['batch_size'"),
    (lambda s: s.load_state_dict([0]), TypeError, r"state should be a dict from "
     r"CacheAwareSampler.state_dict\(\), but got list"),
    (lambda s: s.load_state_dict({**s.state_dict(), "consumed": 51}), ValueError,
     r"state\['consumed'\] should be an int in \[0, 50\], but got state\['consumed'\]=51"),
])
def test_bad_calls_name_the_parameter_and_the_value(call, error, match):
    with pytest.raises(error, match=match):
        call(CacheAwareSampler(LAYOUT, 2, 1, batch_size=4, local_world_size=1))


# ------------------------------------------------------------------------------------------------
# CacheLayout: which node caches what
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset_len", [10, 100, 4000])
@pytest.mark.parametrize("frac", [0.1, 0.25, 1 / 3, 0.4, 0.5, 2 / 3, 0.99, 1.0])
@pytest.mark.parametrize("num_nodes", [1, 2, 3, 4, 8])
def test_layout_properties(dataset_len, frac, num_nodes):
    slots = max(1, int(dataset_len * frac))
    layout = CacheLayout(dataset_len, slots, num_nodes, seed=11)
    owners = layout.owners()
    for k in range(num_nodes):
        idx = layout.indices(k)
        assert len(np.unique(idx)) == slots == len(idx)      # no index twice on a node
        assert np.array_equal(np.sort(idx), np.flatnonzero(owners[k]))
    held = owners.sum(axis=0)
    lo = num_nodes * slots // dataset_len
    assert lo <= held.min() and held.max() <= lo + 1         # the surplus is spread evenly
    if num_nodes == 1:
        assert np.array_equal(layout.indices(0), np.arange(slots))   # 0.2.1's layout
    elif num_nodes * slots <= dataset_len:
        assert held.max() == 1                               # disjoint
        if slots >= 25:  # a random subset, not a block of the index order (4+ sigma margin)
            assert abs(layout.indices(0).mean() - (dataset_len - 1) / 2) < dataset_len / 4
    elif slots < dataset_len and num_nodes * slots <= 2 * dataset_len and slots > 1:
        assert len({owners[k].tobytes() for k in range(num_nodes)}) == num_nodes
    again = CacheLayout(dataset_len, slots, num_nodes, seed=11)
    assert all(np.array_equal(again.indices(k), layout.indices(k)) for k in range(num_nodes))


def test_layout_depends_on_the_seed():
    a, b = CacheLayout(1000, 100, 4, seed=1), CacheLayout(1000, 100, 4, seed=2)
    assert not np.array_equal(a.indices(0), b.indices(0))


def test_the_sampler_never_builds_the_owner_matrix(monkeypatch):
    """The nodes x dataset_len matrix is built row by row (640 MB at 64 nodes and 10 M
    indices otherwise); the order is the same as from the full matrix."""
    lay = CacheLayout(dataset_len=5000, slots=700, num_nodes=6, seed=3)
    matrix = lay.owners()
    full = CacheAwareSampler(MatrixLayout.of(matrix), batch_size=8, num_replicas=6, rank=2,
                             seed=1)
    monkeypatch.setattr(CacheLayout, "owners", lambda self: pytest.fail("owners() was built"))
    rows = CacheAwareSampler(lay, batch_size=8, num_replicas=6, rank=2, seed=1)
    for epoch in (0, 1):
        assert np.array_equal(full.epoch_indices(epoch), rows.epoch_indices(epoch))


# ------------------------------------------------------------------------------------------------
# Copied next to stocaching.py
# ------------------------------------------------------------------------------------------------


def test_samplers_py_works_copied_next_to_stocaching_py(tmp_path):
    """samplers.py copied beside stocaching.py, _common.py, masks.py and trainers.py imports the
    copies, not the package, and resumes an epoch from a state."""
    out = run_copied(tmp_path, ("stocaching.py", "_common.py", "masks.py", "trainers.py",
                                "samplers.py"), """
        import os, samplers, stocaching
        assert os.path.dirname(stocaching.__file__) == os.getcwd()  # the copy, not the package
        assert samplers.CacheLayout is stocaching.CacheLayout
        layout = stocaching.CacheLayout(dataset_len=12, slots=6, num_nodes=2)
        make = lambda: samplers.CacheAwareSampler(layout, batch_size=2, num_replicas=2, rank=0)
        first = make()
        it = iter(first)
        head = [next(it) for _ in range(2)]
        second = make()
        second.load_state_dict(first.state_dict())
        print(head + list(second) == list(make()))
    """)
    assert out.strip() == "True"
