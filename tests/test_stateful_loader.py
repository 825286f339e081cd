"""Resume through torchdata's StatefulDataLoader (an optional test dependency: skipped without
it), and what a sampler's state records when something reads ahead of the caller.

The loader saves ``loader.state_dict()`` after 7 batches of epoch 1; a fresh cache, sampler and
loader load it and read the rest. Over the two runs every index of the epoch comes exactly once,
for every sampler of the package, the prefetcher with and without a window, and torch's own,
with 0 and 2 workers; and no "iterated again" warning comes, although the loader creates the
sampler's iterator more than once (a resume creates one, loads the state, creates another).
"""

from __future__ import annotations

import collections
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

CHILDREN = Path(__file__).resolve().parent / "children"
if str(CHILDREN) not in sys.path:
    sys.path.insert(0, str(CHILDREN))

from _helpers import budget_for  # noqa: E402
from prefetch_common import DIMS, PrefetchedDataset, value_of  # noqa: E402
from stocaching import CacheAwareSampler, Prefetcher, SharedCache  # noqa: E402
from stocaching.mixtures import WeightedMixtureSampler  # noqa: E402
from stocaching.order import ReadyFirstSampler  # noqa: E402

# torchdata's own deprecation notice, raised by every StatefulDataLoader it makes.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

N, SLOTS, STAGING, BATCH, STEPS = 96, 48, 96, 8, 7


def make_cache(shm_dir, name):
    return SharedCache(budget_for(SLOTS, DIMS, staging=STAGING, dataset_len=N), N, DIMS,
                       shm_dir=shm_dir, staging_slots=STAGING, name=name)


def seeded_random(ds, cache=None):
    return RandomSampler(ds, generator=torch.Generator().manual_seed(5))


# name -> sampler(dataset, cache); each order is a function of its seeds and the epoch.
SAMPLERS = {
    "RandomSampler": seeded_random,
    "DistributedSampler": lambda ds, c: DistributedSampler(ds, num_replicas=1, rank=0, seed=3),
    "CacheAwareSampler": lambda ds, c: CacheAwareSampler(ds, batch_size=BATCH, seed=4),
    "WeightedMixtureSampler": lambda ds, c: WeightedMixtureSampler([N // 2, N // 2], [1, 3],
                                                                   seed=6),
    "ReadyFirstSampler": lambda ds, c: ReadyFirstSampler(
        CacheAwareSampler(ds, batch_size=BATCH, seed=4), c, window=BATCH),
    "ReadyFirstSampler(RandomSampler)": lambda ds, c: ReadyFirstSampler(
        seeded_random(ds, c), c, window=BATCH),
    "ReadyFirstSampler-adaptive": lambda ds, c: ReadyFirstSampler(
        DistributedSampler(ds, num_replicas=1, rank=0, seed=3), c, window=BATCH,
        mode="adaptive"),
    "Prefetcher(CacheAwareSampler)": lambda ds, c: Prefetcher(
        CacheAwareSampler(ds, batch_size=BATCH, seed=4), c, value_of, threads=2),
    "Prefetcher(WeightedMixtureSampler)": lambda ds, c: Prefetcher(
        WeightedMixtureSampler([N // 2, N // 2], [1, 3], seed=6), c, value_of, threads=2),
    "Prefetcher(RandomSampler)": lambda ds, c: Prefetcher(seeded_random(ds, c), c, value_of,
                                                          threads=2),
    "Prefetcher(DistributedSampler)": lambda ds, c: Prefetcher(
        DistributedSampler(ds, num_replicas=1, rank=0, seed=3), c, value_of, threads=2),
    "Prefetcher(RandomSampler, window)": lambda ds, c: Prefetcher(
        seeded_random(ds, c), c, value_of, window=BATCH, threads=2),
    "Prefetcher(CacheAwareSampler, window, adaptive)": lambda ds, c: Prefetcher(
        CacheAwareSampler(ds, batch_size=BATCH, seed=4), c, value_of, window=BATCH,
        mode="adaptive", threads=2),
}


def again_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "iterated again" in str(w.message)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_stateful_dataloader_resumes_the_rest_of_the_epoch_exactly_once(shm_dir, name, workers):
    tdl = pytest.importorskip("torchdata.stateful_dataloader")

    def loader_of(cache):
        ds = PrefetchedDataset(cache, N, value_of)
        sampler = SAMPLERS[name](ds, cache)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(1)
        loader = tdl.StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler,
                                        num_workers=workers,
                                        multiprocessing_context="fork" if workers else None)
        return sampler, loader

    cache = make_cache(shm_dir, "whole")  # the epoch uninterrupted, for reference
    sampler, loader = loader_of(cache)
    whole = [i for idx, _ in loader for i in idx.tolist()]
    del sampler, loader

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_cache = make_cache(shm_dir, "first")
        sampler, loader = loader_of(first_cache)
        first = []
        for step, (idx, x) in enumerate(loader):
            first += idx.tolist()
            if step == STEPS - 1:
                break
        state = loader.state_dict()
        del sampler, loader, idx, x

        resumed_cache = make_cache(shm_dir, "resumed")  # a new process: nothing cached
        sampler, loader = loader_of(resumed_cache)
        loader.load_state_dict(state)
        rest = []
        for idx, x in loader:
            assert all(torch.equal(xi, value_of(i)) for i, xi in zip(idx.tolist(), x))
            rest += idx.tolist()

    assert len(first) == STEPS * BATCH
    assert collections.Counter(first + rest) == collections.Counter(whole)
    assert len(rest) == len(whole) - len(first)
    assert again_warnings(caught) == []


@pytest.mark.parametrize("name", ["CacheAwareSampler", "WeightedMixtureSampler",
                                  "ReadyFirstSampler", "ReadyFirstSampler-adaptive"])
def test_an_iterator_that_yielded_nothing_does_not_count(shm_dir, name):
    """A second iter() of the same epoch before the first yielded anything replaces the first:
    no warning, the same position (also a resumed one), and the older iterator is not used."""
    cache = make_cache(shm_dir, "c")
    ds = PrefetchedDataset(cache, N, value_of)
    s = SAMPLERS[name](ds, cache)
    s.set_epoch(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iter(s)
        whole = list(iter(s))
        t = SAMPLERS[name](ds, cache)
        t.load_state_dict(s.state_dict(consumed=10))
        iter(t)
        rest = list(iter(t))
    assert again_warnings(caught) == []
    assert rest == whole[10:]
    with pytest.warns(UserWarning, match="iterated again"):
        again = list(iter(s))  # an epoch that was yielded, iterated again without set_epoch
    assert collections.Counter(again) == collections.Counter(whole)


def test_a_replaced_ready_first_iterator_refuses_to_run(shm_dir):
    cache = make_cache(shm_dir, "c")
    s = ReadyFirstSampler(list(range(N)), cache, window=4)
    old = iter(s)
    new = iter(s)
    assert next(new) == 0
    with pytest.raises(RuntimeError, match="replaced by a newer one"):
        next(old)


# ----------------------------------------------------------------------------------------------
# A resume that spans epochs: the epochs after the resumed one are an uninterrupted run's
# ----------------------------------------------------------------------------------------------

EPOCHS = 3


def filled_cache(shm_dir, name):
    """A cache whose slots are all set before the first epoch: what is ready at each epoch's
    start is then the same in every run, and so is a window's order."""
    cache = make_cache(shm_dir, name)
    for i in range(N):
        cache.set_slot(i, value_of(i))
    return cache


# name -> order(cache); each one's base draws its epochs from one seeded generator, so epoch e's
# order depends on the epochs drawn before it.
ACROSS = {
    "Prefetcher(RandomSampler)": lambda c: Prefetcher(seeded_random(range(N)), c, value_of,
                                                      threads=2),
    "Prefetcher(RandomSampler, window)": lambda c: Prefetcher(
        seeded_random(range(N)), c, value_of, window=BATCH, threads=2),
    "ReadyFirstSampler(RandomSampler)": lambda c: ReadyFirstSampler(seeded_random(range(N)), c,
                                                                    window=BATCH),
}


def epochs_of(order, first: int, stop: int) -> list[list[int]]:
    out = []
    for epoch in range(first, stop):
        order.set_epoch(epoch)
        out.append(list(order))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_at", [37, N])
@pytest.mark.parametrize("stopped_in", [0, 1])
@pytest.mark.parametrize("name", list(ACROSS))
def test_the_epochs_after_a_resumed_one_are_an_uninterrupted_runs(shm_dir, name, stopped_in,
                                                                  stop_at):
    """Stopped after ``stop_at`` indices of epoch ``stopped_in``, resumed in a new order object
    from its state: that epoch and every later one are the uninterrupted run's, each index once
    per epoch. A finished epoch (``stop_at=N``) is not iterated again: the loop goes on with
    set_epoch of the next, which discards the loaded position."""
    whole = epochs_of(ACROSS[name](filled_cache(shm_dir, "whole")), 0, EPOCHS)

    order = ACROSS[name](filled_cache(shm_dir, "first"))
    got = epochs_of(order, 0, stopped_in)
    order.set_epoch(stopped_in)
    it = iter(order)
    head = [next(it) for _ in range(stop_at)]
    state = order.state_dict()
    it.close()
    del it, order

    again = ACROSS[name](filled_cache(shm_dir, "resumed"))
    again.load_state_dict(state)
    if stop_at < N:
        again.set_epoch(stopped_in)
        head += list(again)
    got.append(head)
    got += epochs_of(again, stopped_in + 1, EPOCHS)

    assert all(sorted(epoch) == list(range(N)) for epoch in got)
    assert got == whole
