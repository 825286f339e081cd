"""A state saved on one world resumes on another: ReadyFirstSampler, the Prefetcher, DeviceLoader
and torchdata's StatefulDataLoader with another num_workers.

Ranks are simulated in one process with explicit rank and num_replicas (each rank's sampler,
prefetcher or loader run in turn); the prefetchers load into a real SharedCache. The invariant
is the one of tests/test_sampler.py's RESIZES: over the runs, every index of the epoch comes
once; the only repeats are a new world's padding (fewer than its ranks), with drop_last none,
and fewer indices missing than the new world's ranks. A reordering sampler consumes its base
order out of order, so its resume on another world takes the states of every rank of the saved
world (``load_state_dict([rank 0's, rank 1's, ...])``).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

CHILDREN = Path(__file__).resolve().parent / "children"
if str(CHILDREN) not in sys.path:
    sys.path.insert(0, str(CHILDREN))

from _helpers import assert_ended_well, budget_for, rank_env, run_bounded  # noqa: E402
from prefetch_common import DIMS, PrefetchedDataset, value_of  # noqa: E402
from stocaching import (CacheAwareSampler, CacheLayout, DeviceLoader, Prefetcher,  # noqa: E402
                        SharedCache)
from stocaching._common import EpochRest  # noqa: E402
from stocaching.mixtures import WeightedMixtureSampler  # noqa: E402
from stocaching.order import ReadyFirstSampler  # noqa: E402

# torchdata's own deprecation notice, raised by every StatefulDataLoader it makes.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

# Worlds: (num_nodes, local_world_size, batch_size) of a job, then of the job that resumes it.
RESIZES = [((2, 2, 8), (1, 2, 8)),    # 4 ranks resumed on 2
           ((1, 2, 8), (3, 1, 8)),    # 2 ranks on 3
           ((2, 2, 8), (3, 1, 5))]    # 4 ranks on 3, with another batch size
EPOCH = 2


def ready_at_random(rank):
    """What a rank's node has ready: half of the indices, another half on every rank."""
    rng = np.random.default_rng([7, rank])
    return lambda indices: rng.random(indices.size) < 0.5


def bases(world, n, drop_last=False):
    """The CacheAwareSampler of every rank of ``world`` over ``n`` indices."""
    nodes, lws, batch = world
    layout = CacheLayout(n, n // 3, nodes, seed=2)
    return [CacheAwareSampler(layout, nodes * lws, r, batch_size=batch, local_world_size=lws,
                              seed=5, drop_last=drop_last) for r in range(nodes * lws)]


def ready_first(world, n, drop_last=False, mode="fixed", window=12):
    return [ReadyFirstSampler(b, ready_at_random(b.rank), window=window, mode=mode)
            for b in bases(world, n, drop_last)]


def run(samplers, batches, states=None, batch=None):
    """Each rank's sampler loads ``states`` (the list of every saved rank's state), takes
    ``batches`` batches of ``epoch`` (all: None) and saves its state: (every index taken, the
    states)."""
    taken, saved = [], []
    for s in samplers:
        if states is not None:
            s.load_state_dict(states)
        s.set_epoch(EPOCH)  # the training loop's call keeps the position
        b = batch or s.base.batch_size
        got = list(s) if batches is None else list(itertools.islice(iter(s), batches * b))
        taken += got
        saved.append(s.state_dict(consumed=None if batches is None else len(got)))
    return taken, saved


def assert_each_index_once(taken, n, ranks, drop_last):
    """Every index of the epoch once over the runs, but padding (``ranks``: the ranks of the
    worlds that resumed, each padding fewer than its ranks) or, with drop_last, cuts."""
    counts = collections.Counter(taken)
    if drop_last:
        assert max(counts.values()) == 1 and n - len(counts) < ranks
    else:
        assert set(counts) == set(range(n)) and sum(counts.values()) - n < ranks


# ------------------------------------------------------------------------------------------------
# What a rest records: the set of the order's positions consumed
# ------------------------------------------------------------------------------------------------


def consumed_set(rest):
    return set(range(rest.done)) | set(rest.taken)


@settings(max_examples=200)
@given(data=st.data(), length=st.integers(1, 80))
def test_a_rest_is_the_set_of_positions_consumed(data, length):
    """Consuming positions, the first k left, joining rests, and the state's fields agree with
    a plain set of positions; done is always the first position not consumed."""
    def rest_of(label):
        used = data.draw(st.sets(st.integers(0, length - 1)), label=label)
        return EpochRest(3, 0).consume(sorted(used)), used

    rest, used = rest_of("used")
    assert consumed_set(rest) == used and rest.done not in used
    other, used2 = rest_of("other")
    assert consumed_set(rest.union([other])) == used | used2
    k = data.draw(st.integers(0, length), label="k")
    left = [p for p in range(length) if p not in used]
    assert consumed_set(rest.after_first(k, length)) == used | set(left[:k])
    assert rest.left(length).tolist() == left
    assert EpochRest.of_fields(rest.fields(), 3, length) == rest
    assert rest.per_rank(length, 3, False) == -(-len(left) // 3)


# ------------------------------------------------------------------------------------------------
# ReadyFirstSampler
# ------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:set_epoch")
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
@pytest.mark.parametrize("n", [1000, 1003])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("before, after", RESIZES)
def test_ready_first_resumes_on_another_world_with_every_index_once(before, after, drop_last, n,
                                                                    mode):
    """Ranks that reorder their base order (ready first, within a window) consumed no prefix
    of it: the states of every rank together say what was consumed, and the new world
    deals exactly the rest. The next epoch is whole on the new world."""
    first, states = run(ready_first(before, n, drop_last, mode), 5)
    assert all(s["consumed"] == 5 * before[2] for s in states)
    rest, _ = run(ready_first(after, n, drop_last, mode), None, states)
    assert_each_index_once(first + rest, n, after[0] * after[1], drop_last)
    nxt = ready_first(after, n, drop_last, mode)
    for s in nxt:
        s.load_state_dict(states)
        s.set_epoch(EPOCH + 1)  # discards the position (with a warning: mid-epoch)
    assert_each_index_once([i for s in nxt for i in s], n, after[0] * after[1], drop_last)


@pytest.mark.filterwarnings("ignore:set_epoch")
@pytest.mark.parametrize("n", [1000, 1001])
def test_ready_first_resized_twice_in_one_epoch_gives_every_index_once(n):
    """2 nodes, then 3, then 2 again within one epoch: each resume takes what the worlds
    before consumed, however reordered (the state records it: epoch_done and epoch_taken)."""
    two, three = (2, 2, 8), (3, 2, 8)
    first, states = run(ready_first(two, n), 4)
    second, states = run(ready_first(three, n), 3, states)
    assert states[0]["world"]["epoch_taken"]  # some positions were consumed out of order
    third, _ = run(ready_first(two, n), None, states)
    assert_each_index_once(first + second + third, n, 6 + 4, False)


def test_ready_first_on_the_same_world_resumes_a_rest_exactly():
    """After a resize, the new world's own states resume its rest exactly, rank by rank:
    the fixed order continues as it would have."""
    n = 1003
    _, states = run(ready_first((2, 2, 8), n), 5)
    whole, _ = run(ready_first((1, 2, 8), n), None, states)
    part, mid = run(ready_first((1, 2, 8), n), 3, states)
    assert mid[0]["steps"] < mid[0]["len"]  # the rest of the epoch, shorter
    again = ready_first((1, 2, 8), n)
    rest = []
    for s, m in zip(again, mid):
        s.load_state_dict(m)  # one rank's own state: the same world
        s.set_epoch(EPOCH)
        rest.append(list(s))
    per_rank = len(whole) // 2
    assert part[:24] + rest[0] == whole[:per_rank] and part[24:] + rest[1] == whole[per_rank:]


def test_ready_first_over_a_mixture_resumes_on_another_world():
    """A WeightedMixtureSampler deals index by index: 4 ranks, then 2, then 3."""
    def samplers(ranks):
        return [ReadyFirstSampler(WeightedMixtureSampler([300, 203], [1, 2], num_replicas=ranks,
                                                         rank=r, seed=6),
                                  ready_at_random(r), window=10) for r in range(ranks)]

    first, states = run(samplers(4), 5, batch=8)
    second, states = run(samplers(2), 7, states, batch=8)
    third, _ = run(samplers(3), None, states, batch=8)
    whole = samplers(1)[0]
    whole.set_epoch(EPOCH)
    expect = collections.Counter(whole)  # (a mixture may draw an index more than once)
    got = collections.Counter(first + second + third)
    assert got - expect == collections.Counter() or sum((got - expect).values()) < 2 + 3
    assert expect - got == collections.Counter()


def test_a_single_state_of_another_world_is_refused_naming_the_list():
    _, states = run(ready_first((2, 2, 8), 1000), 5)
    fresh = ready_first((1, 2, 8), 1000)[0]
    with pytest.raises(ValueError, match=r"state\['len'\] should be this sampler's len=500, "
                                         r"but got state\['len'\]=250; a state of another "
                                         r"world .* load_state_dict\(\[rank 0's state"):
        fresh.load_state_dict(states[0])


@pytest.mark.parametrize("bad, match", [
    (lambda st: st[:3], r"every rank of the world they were saved in \(num_replicas=4\), "
                        r"each once, but they are of ranks \[0, 1, 2\]"),
    (lambda st: st[:3] + st[:1], r"each once, but they are of ranks \[0, 0, 1, 2\]"),
    (lambda st: [dict(st[0], consumed=32)] + st[1:],
     r"states\[1\]\['consumed'\] should be that of the first state, 32"),
    (lambda st: [], r"states should be the states of every rank .* empty list"),
    (lambda st: [{"epoch": 2}] * 4, r"state should be a dict from ReadyFirstSampler.state_dict"
                                    r"\(\) \(states\[0\]\), but it lacks \['consumed'\]"),
])
def test_bad_lists_of_states_are_refused_and_change_nothing(bad, match):
    _, states = run(ready_first((2, 2, 8), 1000), 5)
    fresh = ready_first((1, 2, 8), 1000)[0]
    fresh.set_epoch(EPOCH)
    before = list(fresh)
    again = ready_first((1, 2, 8), 1000)[0]
    again.set_epoch(EPOCH)
    with pytest.raises(ValueError, match=match):
        again.load_state_dict(bad(states))
    assert list(again) == before


@pytest.mark.parametrize("change, match", [
    ({"seed": 6}, r"state\['seed'\] should be this sampler's seed=6, but got "
                  r"state\['seed'\]=5; the rest of the epoch would differ"),
    ({"n": 999}, r"state\['dataset_len'\] should be this sampler's dataset_len=999"),
])
def test_states_of_another_order_are_refused_by_the_base(change, match):
    """Another seed or another dataset: the base refuses the joined state, naming the field."""
    _, states = run(ready_first((2, 2, 8), 1000), 5)
    n = change.get("n", 1000)
    nodes, lws, batch = 1, 2, 8
    base = CacheAwareSampler(CacheLayout(n, 300, nodes, seed=2), 2, 0, batch_size=batch,
                             local_world_size=lws, seed=change.get("seed", 5))
    with pytest.raises(ValueError, match=match):
        ReadyFirstSampler(base, ready_at_random(0), window=12).load_state_dict(states)


def test_states_over_a_base_of_the_world_are_refused_naming_the_fix():
    """Over a DistributedSampler each rank's order depends on the world: refused, saying
    what resumes on another world."""
    ds = list(range(100))
    states = []
    for r in range(2):
        s = ReadyFirstSampler(DistributedSampler(ds, num_replicas=2, rank=r, seed=1),
                              ready_at_random(r), window=4)
        list(itertools.islice(iter(s), 8))
        states.append(s.state_dict(consumed=8))
    fresh = ReadyFirstSampler(DistributedSampler(ds, num_replicas=3, rank=0, seed=1),
                              ready_at_random(0), window=4)
    with pytest.raises(ValueError, match=r"states\[0\]\['world'\] is missing: .* make the base "
                                         r"a CacheAwareSampler \(or WeightedMixtureSampler\)"):
        fresh.load_state_dict(states)


def test_a_state_of_another_sampler_is_refused():
    """A CacheAwareSampler's states given to a ReadyFirstSampler: not its states."""
    samplers = bases((2, 2, 8), 1000)
    for s in samplers:
        s.set_epoch(EPOCH)
    states = [s.state_dict(consumed=16) for s in samplers]
    fresh = ready_first((1, 2, 8), 1000)[0]
    with pytest.raises(ValueError, match=r"states\[0\]\['world'\] is missing"):
        fresh.load_state_dict(states)
    with pytest.raises(ValueError, match=r"state should be a dict from ReadyFirstSampler"):
        fresh.load_state_dict(states[0])


# ------------------------------------------------------------------------------------------------
# The Prefetcher and DeviceLoader, over a real cache
# ------------------------------------------------------------------------------------------------

N_CACHED = 203  # indices of the prefetchers' dataset: no world of these divides it


@pytest.fixture
def cache(shm_dir):
    c = SharedCache(budget_for(64, DIMS, staging=64, dataset_len=N_CACHED), N_CACHED, DIMS,
                    shm_dir=shm_dir, staging_slots=64, random_subset=True)
    yield c
    c.close()


def prefetchers(world, cache, window, drop_last=False):
    return [Prefetcher(b, cache, value_of, window=window, threads=2)
            for b in bases(world, N_CACHED, drop_last)]


def run_prefetchers(world, cache, window, batches, states, drop_last=False):
    """As ``run``, through each rank's prefetcher (closed after its run), checking what a
    loaded index's sample is."""
    taken, saved = [], []
    for p in prefetchers(world, cache, window, drop_last):
        if states is not None:
            p.load_state_dict(states)
        p.set_epoch(EPOCH)
        b = p.base.batch_size
        got = list(p) if batches is None else list(itertools.islice(iter(p), batches * b))
        for i in got:  # (an index without a slot was staged, and given back)
            x = cache.get_slot(i)
            assert x is None or torch.equal(x, value_of(i))
        taken += got
        saved.append(p.state_dict(consumed=None if batches is None else len(got)))
        assert p.state_dict() == saved[-1]  # (its own count, also in a resumed rest)
        p.close()
    return taken, saved


@pytest.mark.timeout(120)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("before, after", [((2, 2, 4), (1, 2, 4)), ((1, 2, 4), (3, 1, 6))])
def test_a_prefetcher_resumes_on_another_world_with_every_index_once(cache, before, after,
                                                                     drop_last, window):
    """4 ranks on 2, 2 on 3 with another batch size; with a window from the states of every
    rank, without one from any rank's (a prefix at a batch boundary) or the list too."""
    first, states = run_prefetchers(before, cache, window, 5, None, drop_last)
    rest, _ = run_prefetchers(after, cache, window, None, states, drop_last)
    assert_each_index_once(first + rest, N_CACHED, after[0] * after[1], drop_last)
    if window is None:  # one rank's state serves every rank
        again, _ = run_prefetchers(after, cache, window, None, states[1], drop_last)
        assert collections.Counter(again) == collections.Counter(rest)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("window", [None, 8])
def test_a_prefetcher_resized_twice_in_one_epoch_gives_every_index_once(cache, window):
    """2 nodes, 3, then 2: the second world's states count from where it resumed."""
    first, states = run_prefetchers((2, 1, 4), cache, window, 6, None)
    second, states = run_prefetchers((3, 1, 4), cache, window, 4, states)
    third, _ = run_prefetchers((2, 1, 4), cache, window, None, states)
    assert_each_index_once(first + second + third, N_CACHED, 3 + 2, False)


def test_a_prefetcher_over_a_base_of_the_world_refuses_the_states_of_another():
    """Without a window over a DistributedSampler: a state of another world is refused, and
    so is a list of states, both naming the base that would resume it."""
    ds = list(range(N_CACHED))
    with pytest.raises(ValueError, match=r"state\['len'\] should be this prefetcher's len=68, "
                                         r"but got state\['len'\]=102; .*DistributedSampler.* "
                                         r"make the base a CacheAwareSampler"):
        c = SharedCache(budget_for(8, DIMS, dataset_len=N_CACHED), N_CACHED, DIMS)
        try:
            states = []
            for r in range(2):
                p = Prefetcher(DistributedSampler(ds, num_replicas=2, rank=r, seed=1), c,
                               value_of, threads=2)
                list(itertools.islice(iter(p), 8))
                states.append(p.state_dict(consumed=8))
                p.close()
            fresh = Prefetcher(DistributedSampler(ds, num_replicas=3, rank=0, seed=1), c,
                               value_of, threads=2)
            with pytest.raises(ValueError, match=r"this rank's state alone: .*DistributedSampler"):
                fresh.load_state_dict(states)
            fresh.load_state_dict(states[0])
        finally:
            fresh.close()
            c.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("window", [None, 8])
def test_a_device_loader_resumes_on_another_world(cache, window):
    """A DeviceLoader's state is its prefetcher's: 2 ranks' loaders interrupted after 5
    batches, 3 ranks' loaders (another batch size) finish the epoch, every index once."""
    def loaders(world):
        return [DeviceLoader(cache, b, value_of, batch_size=b.batch_size, device="cpu",
                             window=window, threads=2) for b in bases(world, N_CACHED)]

    first, states = [], []
    for loader in loaders((1, 2, 4)):
        loader.prefetcher.set_epoch(EPOCH)
        for k, (x, idx) in enumerate(loader):
            assert all(torch.equal(xi, value_of(i)) for xi, i in zip(x, idx.tolist()))
            first += idx.tolist()
            if k == 4:
                break
        states.append(loader.state_dict())
        loader.close()
    assert all(s["consumed"] == 5 * 4 for s in states if "consumed" in s)
    rest = []
    for loader in loaders((3, 1, 6)):
        loader.load_state_dict(states if window else states[0])
        loader.prefetcher.set_epoch(EPOCH)
        for x, idx in loader:
            assert all(torch.equal(xi, value_of(i)) for xi, i in zip(x, idx.tolist()))
            rest += idx.tolist()
        loader.close()
    assert_each_index_once(first + rest, N_CACHED, 3, False)


# ------------------------------------------------------------------------------------------------
# torchdata's StatefulDataLoader with another num_workers
# ------------------------------------------------------------------------------------------------


def stateful_loader(sampler, cache, workers):
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = PrefetchedDataset(cache, N_CACHED, value_of)
    return tdl.StatefulDataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers,
                                  multiprocessing_context="fork" if workers else None)


@pytest.mark.timeout(120)
def test_torchdata_refuses_its_own_state_with_another_num_workers(cache):
    """The reason for the way below: StatefulDataLoader asserts on its own state's shape
    (a state of 2 workers has '_snapshot', one of 0 has '_num_yielded')."""
    base = bases((1, 1, 4), N_CACHED)[0]
    loader = stateful_loader(base, cache, 2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it, loader
    for workers in (0, 3):
        fresh = stateful_loader(bases((1, 1, 4), N_CACHED)[0], cache, workers)
        fresh.load_state_dict(state)
        with pytest.raises(AssertionError):
            next(iter(fresh))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers_after", [0, 3])
@pytest.mark.parametrize("kind", ["CacheAwareSampler", "ReadyFirstSampler", "Prefetcher"])
def test_a_stateful_loader_with_another_num_workers_resumes_from_the_samplers_state(
        cache, kind, workers_after):
    """The way that works: save the sampler's state (consumed: the batches the model took
    times the batch size; the workers run ahead), and resume it in a fresh StatefulDataLoader
    with any num_workers; here on another world too (2 ranks, 2 workers each, then 3 ranks)."""
    def samplers(world):
        made = bases(world, N_CACHED)
        if kind == "ReadyFirstSampler":
            return [ReadyFirstSampler(b, cache, window=8) for b in made]
        if kind == "Prefetcher":
            return [Prefetcher(b, cache, value_of, window=8, threads=2) for b in made]
        return made

    first, states = [], []
    for s in samplers((1, 2, 4)):
        s.set_epoch(EPOCH)
        loader = stateful_loader(s, cache, 2)
        for step, (idx, x) in enumerate(loader):
            first += idx.tolist()
            if step == 4:
                break
        states.append(s.state_dict(consumed=(step + 1) * 4))
        del loader
    rest = []
    for s in samplers((3, 1, 4)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no "iterated again": the loader is fresh)
            s.load_state_dict(states if kind != "CacheAwareSampler" else states[0])
        s.set_epoch(EPOCH)
        for idx, x in stateful_loader(s, cache, workers_after):
            assert all(torch.equal(xi, value_of(i)) for i, xi in zip(idx.tolist(), x))
            rest += idx.tolist()
        if kind == "Prefetcher":
            s.close()
    assert_each_index_once(first + rest, N_CACHED, 3, False)


# ------------------------------------------------------------------------------------------------
# A real torchrun job resized
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_torchrun_job_read_through_a_prefetcher_resumes_on_another_number_of_ranks(
        tmp_path, shm_dir):
    """Real torchrun, DataLoader workers, a Prefetcher with a window over a CacheAwareSampler:
    2 ranks take 5 batches of epoch 1 and save every rank's state (all_gather_object); 3 ranks
    load the list and finish the epoch. Every index of the 600 comes once over both jobs, but
    the padding of the second (fewer than its 3 ranks); each job cleans up after itself."""
    out = str(tmp_path / "got")

    def job(ranks, state_in, state_out, batches):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", str(CHILDREN / "resized_prefetch_job.py"),
               state_in, state_out, batches, f"{out}{ranks}"]
        assert_ended_well(run_bounded(cmd, env=rank_env(shm_dir), timeout=300))
        return [i for r in range(ranks) for i in json.load(open(f"{out}{ranks}.rank{r}"))]

    first = job(2, "-", str(tmp_path / "state2"), "5")
    assert len(first) == 2 * 5 * 8
    states = torch.load(tmp_path / "state2")
    assert len(states) == 2 and all(s["world"] is not None for s in states)
    rest = job(3, str(tmp_path / "state2"), str(tmp_path / "state3"), "all")
    both = collections.Counter(first + rest)
    assert set(both) == set(range(600)) and sum(both.values()) - 600 < 3
    assert [f for f in os.listdir(shm_dir) if f.startswith("stocaching")] == []
