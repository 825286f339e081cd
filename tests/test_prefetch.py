"""Prefetcher (stocaching/prefetch.py) with real DataLoaders, processes and torchrun.

The invariants of issue 10, part one: through a real DataLoader of every start method, every
index of the base order comes exactly once per epoch with its right value; no index is loaded
twice at once (loads are counted in files, across the prefetcher's threads, DataLoader workers
and ranks: see tests/children/prefetch_common.py); errors in the load function reach the
training loop as PrefetchError naming the index, and change nothing in the cache; threads stop
with the epoch; a killed trainer leaves nothing behind; resume and DDP.

Sizes are tiny (64 indices of 32 bytes, half of them with a slot); waits are bounded by events
(joins, pipes, pidfds), never by sleeping.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from _helpers import CHILDREN, budget_for, free_port, rank_env, users, wait_exit

if str(CHILDREN) not in sys.path:  # prefetch_common, for this module and spawned workers
    sys.path.insert(0, str(CHILDREN))

from prefetch_common import (BATCH, DIMS, N, SLOTS, Loads,  # noqa: E402
                             PrefetchedDataset, Shuffled, check_epoch, load_counts, loads_since,
                             make_cache, oob_of, overlaps, read_epoch, value_of)
from stocaching import (OpenSizeCache, PrefetchError, Prefetcher,  # noqa: E402
                        ReadyFirstSampler, SharedCache)
from stocaching.prefetch import _WaitMeter  # noqa: E402

THREAD_PREFIX = "stocaching-prefetch"


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def wait_prefetch_threads_gone(bound: float = 60) -> list[str]:
    """Join every prefetcher thread (each returns as soon as it ends; ``bound`` only guards
    against a hang) and return the names of those still running."""
    deadline = time.monotonic() + bound
    for t in prefetch_threads():
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in prefetch_threads()]


@pytest.fixture
def loads_dir(tmp_path):
    d = tmp_path / "loads"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def no_prefetch_threads_left():
    """Each test ends with every prefetcher thread it started gone."""
    yield
    assert wait_prefetch_threads_gone() == []


# ----------------------------------------------------------------------------------------------
# Through a real DataLoader: exactly once, right values, loaded once, by the prefetcher
# ----------------------------------------------------------------------------------------------

# fork is cheap: every window setting with both worker lifetimes. spawn and forkserver start
# torch in each worker (seconds on 2 busy cores): one window setting per lifetime.
CASES = [(m, p, w, mode) for m in ("fork",) for p in (False, True)
         for w, mode in ((None, "adaptive"), (8, "fixed"), (8, "adaptive"))] + [
    ("spawn", False, 8, "adaptive"), ("spawn", True, None, "adaptive"),
    ("forkserver", False, None, "adaptive"), ("forkserver", True, 8, "fixed")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method, persistent, window, mode", CASES)
def test_dataloader_every_index_once_loaded_once_by_the_prefetcher(
        shm_dir, loads_dir, method, persistent, window, mode):
    """2 workers, half the indices with a slot, staging slots for the rest: each epoch yields
    the base order's indices exactly once with their values; every miss is loaded by the
    prefetcher (the workers only hit), once per epoch and never while another load of it runs."""
    cache = make_cache(shm_dir)
    oob = oob_of(cache)
    assert len(oob) == N - SLOTS
    base = Shuffled(N, seed=1)
    pf = Prefetcher(base, cache, Loads(loads_dir, "prefetcher"), window=window, mode=mode,
                    threads=4, lookahead=8, stand_aside=False)
    ds = PrefetchedDataset(cache, N, Loads(loads_dir, "worker"))
    loader = DataLoader(ds, batch_size=BATCH, sampler=pf, num_workers=2,
                        multiprocessing_context=method, persistent_workers=persistent)
    for epoch in range(2):
        pf.set_epoch(epoch)
        before, loaded = cache.stats(), load_counts(loads_dir)
        check_epoch(read_epoch(loader), base.order(epoch), window)
        s = cache.stats(since=before)
        assert (s["hits"], s["misses"], s["staged_hits"]) == (N, 0, len(oob))
        assert s["staged"] == 0  # every staged sample was read once, which freed its slot
        new = loads_since(loads_dir, loaded)
        expect = {i: ["prefetcher"] for i in range(N) if epoch == 0 or i in oob}
        assert new == expect
    assert overlaps(loads_dir) == []
    del loader


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging", [0, 8])
def test_small_or_no_staging_area_still_loads_each_index_once(shm_dir, loads_dir, staging):
    """With a staging area smaller than the lookahead (8 slots: 4 ahead) the prefetcher stops
    at it and loads every miss before it is yielded; 8 slots are also fewer than the DataLoader
    holds (docs/prefetch.md's rule), so a loaded sample may find no free slot by the time it is
    due and is dropped: then, and only then, the worker loads it again, and ``dropped`` counts
    exactly those. Without staging (0) the workers load the indices without a slot, as without
    a prefetcher. Never two loads of one index at once."""
    cache = make_cache(shm_dir, staging=staging)
    oob = oob_of(cache)
    base = Shuffled(N, seed=2)
    pf = Prefetcher(base, cache, Loads(loads_dir, "prefetcher"), window=8, mode="adaptive",
                    threads=4, lookahead=16, stand_aside=False)
    ds = PrefetchedDataset(cache, N, Loads(loads_dir, "worker"))
    loader = DataLoader(ds, batch_size=BATCH, sampler=pf, num_workers=2,
                        multiprocessing_context="fork")
    for epoch in range(2):
        pf.set_epoch(epoch)
        loaded, dropped = load_counts(loads_dir), pf.dropped
        check_epoch(read_epoch(loader), base.order(epoch), 8)
        new = loads_since(loads_dir, loaded)
        who_oob = "prefetcher" if staging else "worker"
        again = {i for i, who in new.items() if who == ["prefetcher", "worker"]}
        assert again <= oob and len(again) == pf.dropped - dropped
        assert {i: ["prefetcher"] if i in again else who for i, who in new.items()} == \
            {i: [who_oob if i in oob else "prefetcher"] for i in range(N) if epoch == 0 or i in oob}
    assert overlaps(loads_dir) == [] and cache.stats()["staged"] == 0


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def load_that_fails(bad: int):
    def load(i):
        if i == bad:
            raise OSError(f"disk gone while reading {i}")
        return value_of(i)
    return load


@pytest.mark.parametrize("bad", [10, 40])  # with a slot, without one (staged)
def test_load_that_raises_is_a_prefetch_error_with_index_and_cause(shm_dir, bad):
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, load_that_fails(bad), threads=2, lookahead=4,
                    stand_aside=False)
    got = []
    with pytest.raises(PrefetchError, match=rf"load\({bad}\) failed.*OSError.*disk gone") as e:
        for i in pf:
            got.append(i)
    assert got == list(range(bad))  # everything before it came, with its sample ready
    assert cache.ready_mask(got).all()
    err = e.value
    assert err.index == bad
    assert isinstance(err.__cause__, OSError) and str(err.__cause__) == f"disk gone while " \
                                                                         f"reading {bad}"
    frames = [f.name for f in traceback.extract_tb(err.__cause__.__traceback__)]
    assert "load" in frames  # the original traceback, down to the user's function
    again = pickle.loads(pickle.dumps(err))  # it may cross process boundaries
    assert type(again) is PrefetchError and again.index == bad and str(again) == str(err)


@pytest.mark.timeout(300)
def test_load_that_raises_reaches_the_training_loop(shm_dir):
    cache = make_cache(shm_dir)
    pf = Prefetcher(Shuffled(N, seed=3), cache, load_that_fails(45), window=8,
                    mode="adaptive", threads=4, stand_aside=False)
    ds = PrefetchedDataset(cache, N, value_of)
    loader = DataLoader(ds, batch_size=BATCH, sampler=pf, num_workers=2,
                        multiprocessing_context="fork")
    with pytest.raises(PrefetchError) as e:
        read_epoch(loader)
    assert e.value.index == 45 and isinstance(e.value.__cause__, OSError)
    # The epoch's DataLoader iterator, abandoned by the error, is in a reference cycle with its
    # traceback: stop its workers now (0.1 s). Collected in a later test instead, its workers
    # took 10 s to stop (two joins of torch's 5 s status interval), in whichever test ran gc.
    del e, loader
    gc.collect()


BAD_VALUES = {
    "shape": lambda i: torch.full((2, 4, 5), i % 251, dtype=torch.uint8),
    "dtype": lambda i: torch.full(DIMS, 0.5),  # float that uint8 would change
    "type": lambda i: None,
}


@pytest.mark.parametrize("bad", [5, 50])  # with a slot, without one
@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_load_returning_a_wrong_value_changes_nothing(shm_dir, bad, kind):
    cache = make_cache(shm_dir)
    aux = cache.aux_array.numpy().copy()
    wrong = BAD_VALUES[kind]

    def load(i):
        return wrong(i) if i == bad else value_of(i)

    # One thread, one position ahead: the bad index (first in the order) is the only load.
    pf = Prefetcher([bad] + [i for i in range(N) if i != bad], cache, load, threads=1,
                    lookahead=1, stand_aside=False)
    with pytest.raises(PrefetchError, match=rf"load\({bad}\) failed") as e:
        next(iter(pf))
    assert e.value.index == bad and isinstance(e.value.__cause__, (TypeError, ValueError))
    s = cache.stats()
    assert (s["writes"], s["stages"], s["staged"], s["filled"]) == (0, 0, 0, 0)
    assert (cache.aux_array.numpy() == aux).all() and not cache.ready_mask([bad]).any()
    assert cache.get_slot(bad) is None


def test_load_that_hangs_times_out_naming_the_index(shm_dir):
    """The prefetcher's own timeout: a load blocked on an Event that is never set (during the
    test) is reported after timeout=1 s, naming its index; the others went on."""
    cache = make_cache(shm_dir)
    never = threading.Event()
    hang = 3

    def load(i):
        if i == hang:
            never.wait()
        return value_of(i)

    pf = Prefetcher(list(range(N)), cache, load, threads=2, lookahead=4, timeout=1,
                    stand_aside=False)
    got = []
    try:
        with pytest.raises(PrefetchError, match=rf"load\({hang}\) did not finish within "
                                                r"timeout=1 s") as e:
            for i in pf:
                got.append(i)
        assert e.value.index == hang and got == [0, 1, 2]
    finally:
        never.set()  # let the stuck thread finish, so that it ends


@pytest.mark.parametrize("kwargs, error, match", [
    ({"threads": 0}, ValueError, r"threads should be a positive int, but got threads=0"),
    ({"threads": True}, TypeError, r"threads should be a positive int, but got threads=True"),
    ({"threads": 2.0}, TypeError, r"threads should be .*threads=2\.0"),
    ({"lookahead": -1}, ValueError, r"lookahead should be a positive int, but got "
                                    r"lookahead=-1"),
    ({"lookahead": 0}, ValueError, r"lookahead=0"),
    ({"window": 0}, ValueError, r"window should be a positive int, but got window=0"),
    ({"window": -8}, ValueError, r"window=-8"),
    ({"window": 8.0}, TypeError, r"window should be .*window=8\.0"),
    ({"timeout": 0}, ValueError, r"timeout should be a positive number .*timeout=0"),
    ({"timeout": -1.5}, ValueError, r"timeout=-1\.5"),
    ({"timeout": float("inf")}, ValueError, r"timeout=inf"),
    ({"timeout": "1"}, TypeError, r"timeout=\'1\'"),
    ({"window": 8, "mode": "eager"}, ValueError, r"mode should be 'fixed' or 'adaptive', but "
                                                 r"got mode='eager'"),
    ({"load": 3}, TypeError, r"load should be a callable .*load of type int"),
    ({"cache": "cache"}, TypeError, r"cache should be a SharedCache or an OpenSizeCache, but "
                                    r"got cache of type str"),
    ({"sampler": 5}, TypeError, r"sampler should be .*sampler of type int"),
])
def test_bad_arguments_name_the_parameter_and_value(shm_dir, kwargs, error, match):
    cache = make_cache(shm_dir)
    args = {"sampler": list(range(N)), "cache": cache, "load": value_of}
    for k in ("sampler", "cache", "load"):
        if k in kwargs:
            args[k] = kwargs.pop(k)
    with pytest.raises(error, match=match):
        Prefetcher(args["sampler"], args["cache"], args["load"], **kwargs, stand_aside=False)


@pytest.mark.parametrize("kwargs, error", [({"timeout": True}, TypeError),
                                           ({"mode": "eager"}, ValueError)])
def test_bool_timeout_and_bad_mode_are_refused(shm_dir, kwargs, error):
    cache = make_cache(shm_dir)
    with pytest.raises(error, match=next(iter(kwargs))):
        Prefetcher(list(range(N)), cache, value_of, **kwargs, stand_aside=False)


def test_staging_area_smaller_than_a_batch_is_not_a_load_timeout(shm_dir, caplog):
    """2 staging slots (1 ahead), batches of 4 indices without a slot, no workers: the batch
    being assembled holds every staging slot, so some indices cannot be staged until the batch
    is read. The epoch completes well within the load timeout: a sample that finds no room by
    the time its index is due is left to the dataset, and the prefetcher says so once."""
    cache = make_cache(shm_dir, staging=2)
    order = sorted(oob_of(cache))
    pf = Prefetcher(order, cache, value_of, threads=2, timeout=30, stand_aside=False)
    loader = DataLoader(PrefetchedDataset(cache, N, value_of), batch_size=BATCH, sampler=pf)
    with caplog.at_level("WARNING", logger="stocaching"):
        seen = read_epoch(loader)
    assert seen == order
    assert pf.dropped > 0
    assert "found no free staging slot" in caplog.text and "staging_slots (2" in caplog.text


# ----------------------------------------------------------------------------------------------
# Lifecycle
# ----------------------------------------------------------------------------------------------


def test_threads_start_and_stop_with_the_epoch(shm_dir):
    """Threads exist while an epoch is iterated and end when it is exhausted or abandoned; an
    epoch after an abandoned one yields every index once and leaves nothing staged."""
    cache = make_cache(shm_dir)
    base = Shuffled(N, seed=4)
    pf = Prefetcher(base, cache, value_of, window=8, mode="adaptive", threads=3,
                    stand_aside=False)
    others = set(prefetch_threads())  # (none, unless another test leaked some)
    it = iter(pf)
    assert set(prefetch_threads()) == others  # nothing before the first step
    first = next(it)
    assert len(set(prefetch_threads()) - others) == 3
    rest = [first] + list(it)
    check_epoch(rest, base.order(0), 8)
    assert wait_prefetch_threads_gone() == []

    pf.set_epoch(1)
    it = iter(pf)
    taken = [next(it) for _ in range(5)]  # abandoned mid-epoch, its staged samples never read
    assert len(set(prefetch_threads()) - others) == 3
    del it
    gc.collect()
    assert wait_prefetch_threads_gone() == []
    assert set(taken) <= set(range(N))

    pf.set_epoch(2)
    seen = []
    for i in pf:  # a worker's read of each index (staged ones are taken)
        x = cache.get_slot(i)
        assert x is not None and torch.equal(x, value_of(i))
        seen.append(i)
    check_epoch(seen, base.order(2), 8)
    assert cache.stats()["staged"] == 0
    assert wait_prefetch_threads_gone() == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("persistent", [False, True])
def test_abandoned_dataloader_epoch_then_a_full_one(shm_dir, loads_dir, persistent):
    """break out of an epoch after 3 batches, then read the next: every index once, nothing
    staged afterwards, no thread left. (With persistent workers the DataLoader keeps the
    abandoned iterator until the next epoch starts, which stops its prefetcher.)"""
    cache = make_cache(shm_dir)
    base = Shuffled(N, seed=5)
    pf = Prefetcher(base, cache, Loads(loads_dir, "prefetcher"), window=8, mode="adaptive",
                    threads=4, stand_aside=False)
    ds = PrefetchedDataset(cache, N, Loads(loads_dir, "worker"))
    loader = DataLoader(ds, batch_size=BATCH, sampler=pf, num_workers=2,
                        multiprocessing_context="fork", persistent_workers=persistent)
    it = iter(loader)
    for _ in range(3):
        next(it)
    del it
    gc.collect()
    if not persistent:
        assert wait_prefetch_threads_gone() == []
    pf.set_epoch(1)
    check_epoch(read_epoch(loader), base.order(1), 8)
    assert cache.stats()["staged"] == 0
    assert wait_prefetch_threads_gone() == []
    assert overlaps(loads_dir) == []
    del loader


@pytest.mark.timeout(120)
def test_load_left_running_by_an_abandoned_epoch_is_not_started_again(shm_dir):
    """One loader thread. Epoch 0 yields 0..4 and is abandoned while its thread is in the load
    of 5, which waits on an Event; epoch 1 needs 5 too. It must not start a second load of 5
    while the first runs: it may wait for that load or use its result. The first load is
    released once epoch 1 has gone past 5 (its thread starts the load of 6, which it reaches
    only after 5, one job at a time) or has started 5 again (the bug)."""
    cache = make_cache(shm_dir)
    release, entered, progress = threading.Event(), threading.Event(), threading.Event()
    lock, running, calls, overlapped = threading.Lock(), set(), {5: 0, 6: 0}, []

    def load(i):
        with lock:
            if i in running:
                overlapped.append(i)
                progress.set()
            running.add(i)
            if i in calls:
                calls[i] += 1
            first5 = i == 5 and calls[5] == 1
        if i == 6:
            progress.set()
        try:
            if first5:
                entered.set()
                release.wait()
            return value_of(i)
        finally:
            with lock:
                running.discard(i)

    pf = Prefetcher(list(range(N)), cache, load, threads=1, lookahead=8, stand_aside=False)
    it = iter(pf)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert entered.wait(60)
    del it
    gc.collect()
    assert calls[6] == 0  # the only thread of epoch 0 is held in the load of 5

    def next_epoch():
        for i in pf:
            cache.get_slot(i)

    t = threading.Thread(target=next_epoch, daemon=True)
    t.start()
    try:
        assert progress.wait(60)
    finally:
        release.set()
        t.join(60)
    assert overlapped == []


@pytest.mark.timeout(300)
def test_sigkill_of_the_trainer_leaves_nothing(shm_dir, tmp_path):
    """SIGKILL of a training process mid-epoch (2 fork workers, prefetcher threads with a load
    in flight): its workers notice and exit, nothing is left in shm_dir, nobody maps it."""
    err = open(tmp_path / "train.stderr", "w")
    workers: list[int] = []
    p = subprocess.Popen([sys.executable, str(CHILDREN / "prefetch_train.py")],
                         env=rank_env(shm_dir), stdout=subprocess.PIPE, stderr=err, text=True,
                         start_new_session=True)
    try:
        line = p.stdout.readline()  # returns at READY, or at EOF if the child died
        assert line.strip() == "READY", (tmp_path / "train.stderr").read_text()[-3000:]
        workers += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        assert len(workers) == 2
        assert set(users(shm_dir)) == {p.pid, *workers}
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(60) == -signal.SIGKILL
        # DataLoader workers poll their parent every 5 s: a generous, event-bound wait.
        assert all(wait_exit(w, 120) for w in workers)
        assert users(shm_dir) == {} and os.listdir(shm_dir) == []
    finally:
        if p.poll() is None or not all(wait_exit(w, 0) for w in workers):
            try:
                os.killpg(p.pid, signal.SIGKILL)  # this test's own process group
            except ProcessLookupError:
                pass
        p.wait(60)
        err.close()


def test_a_prefetcher_unstages_only_what_it_staged(shm_dir):
    """Two prefetchers on one cache, as two ranks of a node. A stages index 40 in its epoch 0
    and a worker reads it; in the next epoch 40 belongs to B (A reads 42, 43), and B stages it
    and yields it.
    A's next epoch starts before B's worker reads 40: B's sample must still be there."""
    class Split(torch.utils.data.Sampler):  # rank A's share: 40, 41 in epoch 0; 42, 43 then
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 2

        def __iter__(self):
            return iter([40, 41] if self.epoch == 0 else [42, 43])

    cache = make_cache(shm_dir)
    a = Prefetcher(Split(), cache, value_of, threads=1, stand_aside=False)
    for i in a:
        assert cache.get_slot(i) is not None  # A's worker reads 40 and 41
    b = Prefetcher([40], cache, value_of, threads=1, stand_aside=False)
    a.set_epoch(1)
    it_b, it_a = iter(b), iter(a)
    try:
        assert next(it_b) == 40 and cache.ready_mask([40]).all()  # staged by B, not yet read
        assert next(it_a) == 42  # A's epoch 1 begins
        assert cache.get_slot(40) is not None  # B's worker reads 40
    finally:
        it_a.close()  # (a suspended iterator keeps its threads)
        it_b.close()


# ----------------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_resume_through_the_prefetcher_gives_the_rest_once(shm_dir, mode):
    """5 batches of epoch 1 are consumed, the state saved (what the model consumed), the
    loader thrown away; a new Prefetcher and DataLoader resume: the rest, exactly once."""
    cache = make_cache(shm_dir)
    base = Shuffled(N, seed=6)

    def loader_of(pf):
        return DataLoader(PrefetchedDataset(cache, N, value_of), batch_size=BATCH, sampler=pf,
                          num_workers=2, multiprocessing_context="fork")

    pf = Prefetcher(base, cache, value_of, window=8, mode=mode, threads=4, stand_aside=False)
    pf.set_epoch(1)
    first, loader = [], loader_of(pf)
    for step, (idx, x) in enumerate(loader):
        first += idx.tolist()
        if step == 4:
            break
    state = pf.state_dict(consumed=len(first))
    # What it staged and nobody read is given back when it is collected, which is once its
    # loader threads have finished the loads the abandoned epoch left running (they hold
    # it): a load may stage its sample after the iterator has stopped (a suite run saw 1).
    del loader, pf
    gc.collect()
    assert wait_prefetch_threads_gone() == []
    gc.collect()
    assert cache.stats()["staged"] == 0
    assert state["consumed"] == 20 and state["epoch"] == 1 and state["mode"] == mode

    pf2 = Prefetcher(Shuffled(N, seed=6), cache, value_of, window=8, mode=mode, threads=4,
                     stand_aside=False)
    pf2.load_state_dict(state)
    pf2.set_epoch(1)  # a training loop's set_epoch for the same epoch keeps the position
    rest = read_epoch(loader_of(pf2))
    check_epoch(first + rest, base.order(1), 8)
    assert cache.stats()["staged"] == 0


class Mixture:
    """A WeightedMixtureSampler over two halves of the N indices: it resumes from a position."""

    def __new__(cls):
        from stocaching.mixtures import WeightedMixtureSampler
        return WeightedMixtureSampler([N // 2, N // 2], [1, 2], seed=9)


class CacheAware:
    """A CacheAwareSampler over a dataset of the N indices: it resumes from a position."""

    def __new__(cls, cache):
        from stocaching import CacheAwareSampler
        return CacheAwareSampler(PrefetchedDataset(cache, N, value_of), batch_size=BATCH,
                                 seed=9)


def resumable_base(kind, cache):
    return {"mixture": Mixture, "cache-aware": lambda: CacheAware(cache),
            "shuffled": lambda: Shuffled(N, seed=9)}[kind]()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [0, 1])
@pytest.mark.parametrize("window, mode", [(None, "fixed"), (8, "fixed"), (8, "adaptive")])
@pytest.mark.parametrize("kind", ["mixture", "cache-aware", "shuffled"])
def test_default_state_is_what_the_prefetcher_yielded(shm_dir, kind, window, mode, processes):
    """state_dict() with no consumed records the indices the iterator yielded (not what it read
    ahead of the base sampler: the whole epoch); a new prefetcher loading it yields exactly the
    rest, so the two runs give each index of the epoch once (issue 25, item 1)."""
    cache = make_cache(shm_dir)
    whole = list(resumable_base(kind, cache))
    pf = Prefetcher(resumable_base(kind, cache), cache, value_of, window=window, mode=mode,
                    threads=2, processes=processes, stand_aside=False)
    it = iter(pf)
    first = [next(it) for _ in range(37)]
    state = pf.state_dict()
    assert state["consumed"] == 37
    it.close()
    pf.close()
    pf2 = Prefetcher(resumable_base(kind, cache), cache, value_of, window=window, mode=mode,
                     threads=2, processes=processes, stand_aside=False)
    pf2.load_state_dict(state)
    assert pf2.state_dict()["consumed"] == 37  # loaded, not yet iterated
    rest = list(pf2)
    assert pf2.state_dict()["consumed"] == len(whole)
    pf2.close()
    assert sorted(first + rest) == sorted(whole) and len(rest) == len(whole) - 37
    if window is None:
        assert first + rest == whole
    assert cache.stats()["staged"] == 0


class CountsItself(Shuffled):
    """A base with a state_dict that takes no consumed: its own count of what was taken."""

    taken = 0

    def __iter__(self):
        for i in super().__iter__():
            self.taken += 1
            yield i

    def state_dict(self):
        return {"taken": self.taken}

    def load_state_dict(self, state):
        self.taken = state["taken"]


@pytest.mark.parametrize("make", [lambda: Shuffled(N, seed=4), lambda: CountsItself(N, seed=4)],
                         ids=["no state_dict", "state_dict without consumed"])
def test_a_base_that_cannot_record_a_position_is_skipped_to_it(shm_dir, make):
    """Without a window, over a base that cannot resume from a position, the prefetcher's own
    state (epoch, consumed, a fingerprint of the base order) resumes the rest exactly once."""
    cache = make_cache(shm_dir)
    pf = Prefetcher(make(), cache, value_of, threads=2, stand_aside=False)
    pf.set_epoch(3)
    it = iter(pf)
    first = [next(it) for _ in range(21)]
    state = pf.state_dict()
    assert state["consumed"] == 21 and state["epoch"] == 3
    it.close()
    pf2 = Prefetcher(make(), cache, value_of, threads=2, stand_aside=False)
    pf2.load_state_dict(state)
    pf2.set_epoch(3)  # the same epoch keeps the position
    assert pf2.state_dict() == state
    rest = list(pf2)
    assert first + rest == Shuffled(N, seed=4).order(3)
    assert pf2.state_dict()["consumed"] == N


def test_a_skipped_resume_into_another_base_order_is_refused(shm_dir):
    cache = make_cache(shm_dir)
    pf = Prefetcher(Shuffled(N, seed=4), cache, value_of, threads=2, stand_aside=False)
    it = iter(pf)
    next(it)
    state = pf.state_dict()
    it.close()
    other = Prefetcher(Shuffled(N, seed=5), cache, value_of, threads=2, stand_aside=False)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"the base order of epoch None differs from the one "
                                         r"the loaded state was saved from"):
        next(iter(other))
    with pytest.raises(ValueError, match=r"state\['len'\] should be this prefetcher's len=3"):
        Prefetcher([0, 1, 2], cache, value_of, threads=1).load_state_dict(state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [0, 1])
def test_closing_the_prefetcher_mid_epoch_ends_its_iterator_with_prefetch_error(shm_dir,
                                                                               processes):
    """close() stops the running epoch's loads; its iterator, advanced again, raises (once
    it reaches an index that was not loaded yet) rather than wait for its timeout."""
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, value_of, threads=2, lookahead=4,
                    processes=processes, timeout=600, stand_aside=False)
    it = iter(pf)
    first = [next(it) for _ in range(10)]
    pf.close()
    with pytest.raises(PrefetchError, match="the prefetcher was closed"):
        for i in it:
            first.append(i)
    assert first == list(range(len(first))) and len(first) < N
    assert cache.stats()["staged"] == 0


def test_an_index_whose_load_failed_is_not_counted_as_yielded(shm_dir):
    """A PrefetchError for index i: i was not yielded, so a state saved then resumes with i."""
    base = Shuffled(N, seed=2)
    bad = base.order()[5]
    cache = make_cache(shm_dir)
    pf = Prefetcher(base, cache, load_that_fails(bad), window=4, threads=2,
                    stand_aside=False)
    it = iter(pf)
    got = []
    with pytest.raises(PrefetchError):
        for i in it:
            got.append(i)
    state = pf.state_dict()
    assert state["consumed"] == len(got)
    pf2 = Prefetcher(Shuffled(N, seed=2), cache, value_of, window=4, threads=2,
                     stand_aside=False)
    pf2.load_state_dict(state)
    rest = list(pf2)
    assert bad in rest and sorted(got + rest) == list(range(N))


@pytest.mark.timeout(300)
def test_resume_with_workers_ahead_of_the_model_takes_what_the_model_used(shm_dir):
    """With num_workers > 0 the DataLoader draws indices ahead of the model, so the default
    state is ahead of it; state_dict(consumed=steps * batch_size) is what resumes the rest of
    the epoch exactly once (docs/prefetch.md, Resume)."""
    cache = make_cache(shm_dir)
    whole = list(Mixture())

    def loader_of(pf):
        return DataLoader(PrefetchedDataset(cache, N, value_of), batch_size=BATCH, sampler=pf,
                          num_workers=2, multiprocessing_context="fork")

    pf = Prefetcher(Mixture(), cache, value_of, threads=2, stand_aside=False)
    pf.set_epoch(0)
    first, loader = [], loader_of(pf)
    for step, (idx, x) in enumerate(loader):
        first += idx.tolist()
        if step == 4:
            break
    ahead = pf.state_dict()["consumed"]
    state = pf.state_dict(consumed=5 * BATCH)
    del loader
    assert ahead > 5 * BATCH  # the workers had been handed more than the model used
    pf2 = Prefetcher(Mixture(), cache, value_of, threads=2, stand_aside=False)
    pf2.load_state_dict(state)
    pf2.set_epoch(0)
    rest = read_epoch(loader_of(pf2))
    assert first + rest == whole


def test_resumed_epoch_prefetches_its_rest(shm_dir, loads_dir):
    """After a resume at 48 of 64, the prefetcher should load the misses of the remaining 16
    (so that each is ready when yielded) and nothing that was consumed before."""
    base = Shuffled(N, seed=7)
    cache = make_cache(shm_dir, name="before")
    pf = Prefetcher(base, cache, value_of, window=4, mode="fixed", threads=2, lookahead=4,
                    stand_aside=False)
    it = iter(pf)
    first = [next(it) for _ in range(48)]
    state = pf.state_dict()
    del it
    gc.collect()

    fresh = make_cache(shm_dir, name="after")  # a new process: nothing cached
    pf2 = Prefetcher(Shuffled(N, seed=7), fresh, Loads(loads_dir, "prefetcher"), window=4,
                     mode="fixed", threads=2, lookahead=4, stand_aside=False)
    pf2.load_state_dict(state)
    rest, ready = [], []
    for i in pf2:
        rest.append(i)
        ready.append(bool(fresh.ready_mask([i])[0]))
        fresh.get_slot(i)
    assert sorted(first + rest) == list(range(N))
    assert set(load_counts(loads_dir)) <= set(rest)
    assert all(ready)


# ----------------------------------------------------------------------------------------------
# DDP: one prefetcher per rank on one node's cache, under the real torchrun
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_ddp_two_ranks_one_cache_each_index_once(shm_dir, tmp_path):
    (tmp_path / "loads").mkdir()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--master_port", str(free_port()), str(CHILDREN / "prefetch_ddp.py")],
                       env=rank_env(shm_dir, TEST_OUT=tmp_path), capture_output=True,
                       text=True, timeout=360)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert [o["rank"] for o in ranks] == [0, 1]
    assert all(o["local_world_size"] == 2 and o["values_ok"] for o in ranks)
    # one segment on the node: both ranks map the same file, whose name is already gone
    assert ranks[0]["segments"] == ranks[1]["segments"] and len(ranks[0]["segments"]) == 1
    assert ranks[0]["listed"] == ranks[1]["listed"] == []
    oob = set(ranks[0]["oob"])
    assert len(oob) == 32 and ranks[0]["staging_slots"] == 96
    for epoch in range(2):
        together = ranks[0]["epochs"][epoch] + ranks[1]["epochs"][epoch]
        assert sorted(together) == list(range(N))  # all ranks: every index exactly once
    assert overlaps(tmp_path / "loads") == []  # never two loads of one index at once
    # Epoch 0: every index loaded once, by the prefetcher of the rank that read it; all hits.
    after = [{int(i): w for i, w in a.items()} for a in ranks[0]["loads_after"]]
    reader = [{i: k for k in range(2) for i in ranks[k]["epochs"][e]} for e in range(2)]
    assert ranks[0]["stats"][0] == {"hits": N, "misses": 0, "staged_hits": len(oob)}
    assert after[0] == {i: [f"prefetcher{reader[0][i]}"] for i in range(N)}
    # Epoch 1: the indices without a slot are loaded again, each by the prefetcher of the rank
    # that reads it (its staging slot was freed by epoch 0's read), and all are hits again:
    # a rank starting its epoch gives back only what it staged itself
    # (test_a_prefetcher_unstages_only_what_it_staged).
    assert ranks[0]["stats"][1] == {"hits": N, "misses": 0, "staged_hits": len(oob)}
    again = {i: after[1][i][len(after[0][i]):] for i in range(N)}
    assert all(again[i] == [] for i in range(N) if i not in oob)
    assert all(again[i] == [f"prefetcher{reader[1][i]}"] for i in oob)
    assert ranks[0]["staged_after"] == 0
    # The holder, which keeps the segment for a restart while the agent lives, exits a moment
    # after torchrun returns (it waits on the agent's pidfd): an event-bound wait, as for
    # workers that are still exiting. (A CI run caught it holding the segment's descriptor.)
    assert all(wait_exit(pid, 60) for pid in users(shm_dir))
    assert os.listdir(shm_dir) == [] and users(shm_dir) == {}


def test_a_sample_another_ranks_prefetcher_staged_is_not_taken_for_this_ranks(shm_dir,
                                                                             tmp_path):
    """Two prefetchers on one node's cache (two ranks whose epochs drift apart: one has staged
    index i for its epoch and not read it yet, the other's next epoch holds i too). The second
    must load i itself instead of counting the first's copy as ready, or one rank's worker
    takes the other's copy and that rank loads i again in its DataLoader. Each read then takes
    one of the two copies."""
    cache = make_cache(shm_dir)
    i = min(oob_of(cache))
    loads = tmp_path / "loads"
    loads.mkdir()
    a = Prefetcher([i], cache, Loads(loads, "rank0"), threads=1, stand_aside=False)
    b = Prefetcher([i], cache, Loads(loads, "rank1"), threads=1, stand_aside=False)
    try:
        assert list(a) == [i]  # staged by a, not read yet
        assert cache.ready_mask([i]).tolist() == [True]
        assert list(b) == [i]
        assert load_counts(loads) == {i: ["rank0", "rank1"]}
        assert cache.stats()["staged"] == 2
        for pf in (a, b):  # each rank's worker reads its own rank's copy (read_tags)
            cache.read_tags = {pf._tag}
            assert torch.equal(cache.get_slot(i), value_of(i))
        assert cache.get_slot(i) is None and cache.stats()["staged"] == 0
    finally:
        cache.close()


def test_each_ranks_workers_read_their_own_ranks_staged_copy(shm_dir):
    """Found from outside under torchrun (ranks drifting apart, no barrier): B staged index i
    for its epoch, A staged it for its next one; A's worker took B's copy, A's next epoch gave
    back its own (unread, it thought), and B's worker found nothing and loaded i again. A
    worker now reads the copy of its own rank's prefetcher (the cache's read_tags)."""
    class Epochs(torch.utils.data.Sampler):  # rank A: index i in epoch 0, j in epoch 1
        epoch = 0

        def __init__(self, *orders):
            self.orders = orders

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 1

        def __iter__(self):
            return iter(self.orders[self.epoch])

    cache = make_cache(shm_dir)
    i, j = sorted(oob_of(cache))[:2]
    b = Prefetcher([i], cache, value_of, threads=1, stand_aside=False)
    a = Prefetcher(Epochs([i], [j]), cache, value_of, threads=1, stand_aside=False)
    try:
        assert cache.read_tags == {a._tag, b._tag}  # every prefetcher on this cache object
        cache.read_tags = {a._tag}  # as in rank A's process, which made only A
        assert list(b) == [i] and list(a) == [i]  # B's copy first, then A's
        assert cache.stats()["staged"] == 2
        assert torch.equal(cache.get_slot(i), value_of(i))  # A's worker
        a.set_epoch(1)
        assert list(a) == [j]  # A's next epoch: gives back what it staged and was not read
        cache.read_tags = {b._tag}  # B's worker
        assert torch.equal(cache.get_slot(i), value_of(i))
    finally:
        cache.close()


@pytest.mark.parametrize("bad, error", [({-1}, ValueError), ({1.0}, TypeError), ("a", TypeError),
                                        ({True}, TypeError), (5, TypeError)])
def test_read_tags_must_be_a_set_of_tags(shm_dir, bad, error):
    cache = make_cache(shm_dir)
    with pytest.raises(error, match=r"read_tags"):
        cache.read_tags = bad
    assert cache.read_tags == frozenset()
    cache.read_tags = {5, 7}
    assert cache.read_tags == {5, 7}
    cache.read_tags = ()
    assert cache.read_tags == frozenset()


def test_two_prefetchers_of_one_process_both_have_their_staged_copies_read(shm_dir):
    """Train and validation loaders of one process, each with a Prefetcher on the same cache
    object: the workers of each read what its prefetcher staged (found by a review: with one
    tag per cache, the later prefetcher's tag hid the earlier one's copies)."""
    cache = make_cache(shm_dir)
    i, j = sorted(oob_of(cache))[:2]
    train = Prefetcher([i], cache, value_of, threads=1, stand_aside=False)
    val = Prefetcher([j], cache, value_of, threads=1, stand_aside=False)
    try:
        assert list(train) == [i] and list(val) == [j]
        assert torch.equal(cache.get_slot(i), value_of(i))
        assert torch.equal(cache.get_slot(j), value_of(j))
        assert cache.stats()["staged"] == 0
    finally:
        cache.close()


# ----------------------------------------------------------------------------------------------
# Standing aside (the CPU-bound side is tested in test_prefetch_processes.py)
# ----------------------------------------------------------------------------------------------


def waits_on_storage(i):
    """A load that waits 2 ms, as for a read from slow storage, and computes next to nothing."""
    time.sleep(0.002)
    return value_of(i)


def test_loads_that_wait_on_storage_are_all_prefetched(shm_dir):
    n = 128
    cache = SharedCache(budget_for(n, DIMS, dataset_len=n), n, DIMS, shm_dir=shm_dir)
    pf = Prefetcher(Shuffled(n, seed=8), cache, waits_on_storage, threads=4)
    try:
        for i in pf:
            assert cache.get_slot(i).equal(value_of(i))  # loaded before it was yielded
        assert (pf.loaded, pf.left) == (n, 0)
        assert not pf._load_times.cpu_bound(), str(pf._load_times)
    finally:
        cache.close()


@pytest.mark.skipif(not _WaitMeter.WORKS, reason="no per-thread scheduler statistics")
@pytest.mark.parametrize("processes", [0, 1])
def test_once_measured_one_load_in_8_is_timed(shm_dir, processes):
    # Timing a load costs a loader thread two reads of its scheduler statistics: every load
    # submitted before the verdict (32 to 64 of them), then one in _TIME_EVERY = 8; none
    # without standing aside.
    n = 320
    for stand_aside, lo, hi in ((True, 32 + (n - 32) // 8 - 1, 64 + (n - 64) // 8 + 1),
                                (False, 0, 0)):
        cache = SharedCache(budget_for(n, DIMS, dataset_len=n), n, DIMS, shm_dir=shm_dir)
        pf = Prefetcher(list(range(n)), cache, waits_on_storage, threads=4, processes=processes,
                        stand_aside=stand_aside, multiprocessing_context="fork")
        try:
            assert sorted(pf) == list(range(n))
            assert (pf.loaded, pf.left) == (n, 0)
            times = pf._load_times
            assert times.seen == n
            assert lo <= times.timed <= hi, (stand_aside, times.timed, str(times))
            assert not times.cpu_bound(), str(times)
        finally:
            pf.close()
            cache.close()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_stand_aside_must_be_a_bool(shm_dir, bad):
    cache = make_cache(shm_dir)
    with pytest.raises(TypeError, match=rf"stand_aside should be True or False, but got "
                                        rf"stand_aside={bad!r}"):
        Prefetcher(list(range(N)), cache, value_of, stand_aside=bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [0, 1])
def test_a_sample_an_open_size_cache_refused_is_left_to_the_workers_until_a_clear(
        shm_dir, loads_dir, processes):
    """With open sizes and an arena that holds 20 of the 64 samples, the prefetcher's load of
    a sample that no longer fits is refused by the cache and the worker loads it again; from
    the next epoch on the prefetcher leaves such an index to the workers (one load an epoch,
    not two). A clear() gives the arena back and the prefetcher loads every miss ahead again,
    whether the epoch before it filled the arena or started with it full."""
    dims, words = (2, None, 4), 4 + 1
    arena = 20 * 32  # value_of(i) is 2 x 4 x 4 uint8: 32 bytes, a multiple of the alignment
    cache = OpenSizeCache((arena + N * (1 + 8 * words)) / 2**30, N, dims, shm_dir=shm_dir)
    assert cache.stats()["arena_bytes"] == arena
    base = Shuffled(N, seed=12)
    pf = Prefetcher(base, cache, Loads(loads_dir, "prefetcher"), threads=1, lookahead=4,
                    processes=processes, stand_aside=False)
    worker = Loads(loads_dir, "worker")
    try:
        def epoch(e):
            """Loads of epoch e by index, and the indices the cache holds after it."""
            pf.set_epoch(e)
            before = load_counts(loads_dir)
            for i in pf:  # the dataset's two lines, as a worker runs them
                x = cache.get_slot(i)
                if x is None:
                    x = worker(i)
                    cache.set_slot(i, x)
                assert x.equal(value_of(i))
            stored = set(np.flatnonzero(cache.ready_mask()).tolist())
            assert len(stored) == 20
            return loads_since(loads_dir, before), stored

        def all_ahead(loads, stored):
            """Every index loaded by the prefetcher; the refused ones by the worker too."""
            assert loads == {i: ["prefetcher"] if i in stored else ["prefetcher", "worker"]
                             for i in range(N)}

        # Epoch 0 fills the arena; a clear() right after, then epoch 1 fills it again.
        all_ahead(*epoch(0))
        cache.clear()
        loads, stored = epoch(1)
        all_ahead(loads, stored)
        # Epoch 2 starts full: the refused ones are the worker's alone, once each.
        loads, _ = epoch(2)
        assert loads == {i: ["worker"] for i in range(N) if i not in stored}
        cache.clear()
        all_ahead(*epoch(3))
    finally:
        pf.close()
        cache.close()


@pytest.mark.parametrize("window, mode", [(None, "adaptive"), (8, "fixed"), (8, "adaptive")])
@pytest.mark.parametrize("bad", [N, -1])
def test_a_sampler_index_outside_the_dataset_names_the_sampler(shm_dir, window, mode, bad):
    cache = make_cache(shm_dir)
    pf = Prefetcher([0, bad, 1], cache, value_of, window=window, mode=mode, threads=1,
                    stand_aside=True)
    try:
        with pytest.raises(ValueError, match=rf"should yield indices in \[0, {N}\).*but it "
                                             rf"yielded {min(0, bad)}\.\.{max(1, bad)}"):
            next(iter(pf))
        assert cache.stats()["filled"] == 0 and pf.loaded == 0
    finally:
        cache.close()


def test_a_job_ends_once_and_wakes_its_waiter_whenever_it_ends():
    """``_Job``: a wait times out (False) while the job runs, and returns True once it ended,
    whether the end came before the wait, during it (from another thread), or between the
    wait making its waiter and blocking on it; the first outcome stays."""
    from stocaching.prefetch import _Job
    job = _Job(3, staged=False)
    assert not job.done() and job.wait(0.01) is False  # (its waiter is made and kept)
    ended = threading.Timer(0.05, job.end, args=(_Job.DONE,))
    ended.start()
    t0 = time.monotonic()
    assert job.wait(60.0) is True and job.outcome is _Job.DONE
    assert time.monotonic() - t0 < 30.0  # woken by the end (at 0.05 s), not by the timeout
    ended.join()
    job.end(_Job.CANCELLED)  # a second end changes nothing
    assert job.outcome is _Job.DONE and job.wait(0.0)
    early = _Job(4, staged=True)
    early.end(ValueError("no file"))  # before any wait: no waiter to wake
    assert early.wait(30.0) and isinstance(early.outcome, ValueError)
    for _ in range(200):  # ends racing the first wait, on any side of its checks
        raced = _Job(5, staged=False)
        t = threading.Thread(target=raced.end, args=(_Job.DONE,))
        t.start()
        t0 = time.monotonic()
        assert raced.wait(60.0) and raced.outcome is _Job.DONE
        assert time.monotonic() - t0 < 30.0
        t.join()


# ----------------------------------------------------------------------------------------------
# A base whose order comes from torch's global generator cannot resume mid-epoch
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 16])
def test_an_unseeded_random_sampler_warns_at_the_save_and_the_refusal_says_the_fix(
        shm_dir, window):
    # A RandomSampler made without a generator draws each epoch from torch's global generator,
    # which no state holds: its resume is refused. Say so when a mid-epoch state is saved (once,
    # at the caller's line), and name the fix in the refusal; say nothing before an iterator
    # or at an epoch's end; a seeded one neither warns nor is refused.
    cache = make_cache(shm_dir)
    fix = r"make it with generator=torch\.Generator\(\)\.manual_seed\(seed\)"
    made = []

    def prefetcher(generator=None):
        made.append(Prefetcher(torch.utils.data.RandomSampler(range(N), generator=generator),
                               cache, value_of, window=window, threads=2, stand_aside=False))
        return made[-1]

    try:
        pf = prefetcher()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert pf.state_dict()["consumed"] == 0  # no iterator yet: nothing to refuse
        it = iter(pf)
        first = [next(it) for _ in range(7)]
        with pytest.warns(UserWarning, match=r"this state cannot resume the epoch: the base "
                                             r"sampler \(RandomSampler\) has no generator.*" +
                                             fix) as got:
            state = pf.state_dict()
        assert got[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert pf.state_dict()["consumed"] == len(first)  # once a sampler
        it.close()
        other = prefetcher()
        other.load_state_dict(state)
        with pytest.raises(ValueError, match=r"differs from the one the loaded state was saved "
                                             r"from: the base sampler \(RandomSampler\) has no "
                                             r"generator.*" + fix):
            list(other)
        done = prefetcher()
        assert sorted(done) == list(range(N))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert done.state_dict()["consumed"] == N  # the epoch's end: the next one is new
        seeded = [prefetcher(torch.Generator().manual_seed(3)) for _ in range(2)]
        it = iter(seeded[0])
        first = [next(it) for _ in range(7)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            state = seeded[0].state_dict()
        it.close()
        seeded[1].load_state_dict(state)
        assert sorted(first + list(seeded[1])) == list(range(N))
    finally:
        for pf in made:
            pf.close()
        cache.close()


def test_a_ready_first_sampler_over_an_unseeded_random_sampler_warns_at_the_save(shm_dir):
    cache = make_cache(shm_dir)
    try:
        order = ReadyFirstSampler(torch.utils.data.RandomSampler(range(N)), cache, window=8)
        it = iter(order)
        next(it)
        with pytest.warns(UserWarning, match=r"this state cannot resume the epoch") as got:
            order.state_dict()
        assert got[0].filename == __file__  # the caller's line
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            order.state_dict()  # once a sampler
    finally:
        cache.close()


def test_a_base_whose_own_state_has_no_consumed_key_is_saved_mid_epoch(shm_dir):
    # Without a window the state of a base whose state_dict takes `consumed` is the base's own,
    # whatever its keys: the prefetcher must not look for its own key in it.
    class Resumable(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n, self.at = n, 0

        def __len__(self):
            return self.n

        def __iter__(self):
            return iter(range(self.at, self.n))

        def state_dict(self, consumed=None):
            return {"at": consumed}

        def load_state_dict(self, state):
            self.at = state["at"]

    cache = make_cache(shm_dir)
    made = [Prefetcher(Resumable(N), cache, value_of, threads=2, stand_aside=False)
            for _ in range(2)]
    try:
        it = iter(made[0])
        first = [next(it) for _ in range(5)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            state = made[0].state_dict()
        assert state == {"at": 5}
        it.close()
        made[1].load_state_dict(state)
        assert first + list(made[1]) == list(range(N))
    finally:
        for pf in made:
            pf.close()
        cache.close()
