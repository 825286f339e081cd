"""Prefetcher(processes=N): the loads run in loader processes (started with the prefetcher, by
fork or spawn) that store what they load themselves. The invariants of tests/test_prefetch.py for that mode: every index once per
epoch with its value, every miss loaded once per epoch and never by the training process or
twice at once, errors with the index and the loader process's traceback, the processes kept
across epochs and stopped by close(), and none outliving a killed trainer.
"""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from torch.utils.data import DataLoader

from _helpers import CHILDREN, budget_for, rank_env, users, wait_exit

if str(CHILDREN) not in sys.path:  # prefetch_common, for this module and spawned workers
    sys.path.insert(0, str(CHILDREN))

from prefetch_common import (BATCH, DIMS, N, Loads, PrefetchedDataset, Shuffled, check_epoch,
                             load_counts, loads_since, make_cache, oob_of, overlaps, read_epoch,
                             value_of)
from stocaching import PrefetchError, Prefetcher, SharedCache, SlotState  # noqa: E402


class PidLoads(Loads):
    """``Loads`` that records the loading process's pid as who loaded."""

    def __init__(self, directory) -> None:
        super().__init__(directory, "")

    def __call__(self, i):
        self.who = str(os.getpid())
        return super().__call__(i)


class FailsAt:
    """A load that raises for one index (picklable, for the loader processes)."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, i):
        if i == self.bad:
            raise KeyError(f"no file for sample {i}")
        return value_of(i)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["fork", "spawn", "forkserver"])
def test_loader_processes_load_each_miss_once_outside_the_trainer(shm_dir, tmp_path, start):
    loads = tmp_path / "loads"
    loads.mkdir()
    cache = make_cache(shm_dir)
    oob = oob_of(cache)
    base = Shuffled(N, seed=5)
    pf = Prefetcher(base, cache, PidLoads(loads), window=8, mode="adaptive", processes=2,
                    multiprocessing_context=start, stand_aside=False)
    # The loader processes start with the prefetcher, before its first epoch.
    assert [p.is_alive() for p in pf._procs._procs] == [True, True]
    # (children of the fork server with "forkserver": its loader processes are not the
    # trainer's children, and end with it all the same, see the kill test)
    assert {p.pid for p in pf._procs._procs} <= {c.pid for c in psutil.Process().children(
        recursive=True)}
    loader = DataLoader(PrefetchedDataset(cache, N, PidLoads(loads)), batch_size=BATCH,
                        sampler=pf, num_workers=2, multiprocessing_context="fork")
    try:
        for epoch in range(2):
            pf.set_epoch(epoch)
            before = cache.stats()
            seen = read_epoch(loader)
            assert sorted(seen) == list(range(N))
            st = cache.stats(since=before)
            assert st["hits"] == N and st["misses"] == 0 and st["staged_hits"] == len(oob)
            counts = load_counts(loads)
            per_index = {i: len(w) for i, w in counts.items()}
            # Epoch 0 loads everything once; epoch 1 only what has no slot, once more.
            assert per_index == {i: 1 + (epoch == 1 and i in oob) for i in range(N)}
        loaders = {int(w) for ws in counts.values() for w in ws}
        assert os.getpid() not in loaders and len(loaders) <= 2
        assert loaders == {p.pid for p in pf._procs._procs} & loaders  # the loader processes
        assert overlaps(loads) == [] and pf.loaded == N + len(oob) and pf.dropped == 0
        procs = list(pf._procs._procs)
    finally:
        pf.close()
    assert all(not p.is_alive() for p in procs)  # close() stops them
    cache.close()


@pytest.mark.timeout(200)
def test_an_error_in_a_loader_process_names_the_index_and_carries_its_traceback(shm_dir):
    cache = make_cache(shm_dir)
    bad = 45
    pf = Prefetcher(list(range(N)), cache, FailsAt(bad), processes=1, stand_aside=False)
    try:
        got = []
        with pytest.raises(PrefetchError, match=f"load\\({bad}\\) failed") as info:
            for i in pf:
                got.append(i)
                cache.get_slot(i)
        assert got == list(range(bad)) and info.value.index == bad
        cause = str(info.value.__cause__)
        assert "KeyError" in cause and "no file for sample 45" in cause
        assert "Traceback in the loader process" in cause and "in __call__" in cause
        assert cache.get_slot(bad) is None  # nothing stored for it
        assert all(p.is_alive() for p in pf._procs._procs)  # an error does not end them
        other = Prefetcher(list(range(bad)), cache, FailsAt(bad), processes=1, stand_aside=False)
        assert list(other) == list(range(bad))
        procs = list(other._procs._procs)
        del other  # a prefetcher that is collected stops its loader processes
        assert procs and all(not p.is_alive() for p in procs)
    finally:
        pf.close()
        cache.close()


class HeldAt(Loads):
    """``Loads`` whose first load of ``held`` creates the file ``entered`` and then waits
    until the file ``release`` exists (files: it runs in a loader process)."""

    def __init__(self, directory, held: int) -> None:
        super().__init__(directory, "")
        self.held = held

    def __call__(self, i):
        entered = os.path.join(self.directory, "entered")
        if i == self.held and not os.path.exists(entered):
            open(entered, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(self.directory, "release")):
                assert time.monotonic() < deadline, "never released"
                time.sleep(0.01)
        return super().__call__(i)


@pytest.mark.timeout(300)
def test_load_left_running_by_an_abandoned_epoch_is_not_loaded_again(shm_dir, tmp_path):
    """One loader process with one thread. Epoch 0 yields 0..4 and is abandoned while the process is in the
    load of 5; epoch 1 needs 5 too and must wait for that load, not queue a second one (which
    the process would run after the first; with more threads, at the same time). The load is released once epoch 1 has yielded
    0..4, by when it has submitted its first 8 positions, 5 among them."""
    loads = tmp_path / "loads"
    loads.mkdir()
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, HeldAt(loads, 5), processes=1, threads=1,
                    lookahead=8, stand_aside=False)
    try:
        it = iter(pf)
        assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
        deadline = time.monotonic() + 120
        while not (loads / "entered").exists():
            assert time.monotonic() < deadline, "the load of 5 never started"
            time.sleep(0.01)
        del it
        gc.collect()
        got = []
        for i in pf:
            got.append(i)
            if i == 4:
                (loads / "release").touch()
            assert cache.get_slot(i) is not None
        assert got == list(range(N))
        assert len(load_counts(loads)[5]) == 1 and overlaps(loads) == []
    finally:
        pf.close()
        cache.close()


@pytest.mark.timeout(300)
def test_every_live_job_keeps_its_own_due_flag(shm_dir, tmp_path):
    """Jobs queued behind a slow load (here: more than there are due flags) never share a
    flag: marking one due tells its loader process about that job only (a shared flag could
    leave a staged load waiting for a staging slot until its timeout). Jobs beyond the flags
    get none and count as due; every flag is given back when its job has finished."""
    loads = tmp_path / "loads"
    loads.mkdir()
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, HeldAt(loads, 0), processes=1, threads=1,
                    lookahead=1, stand_aside=False)
    pool = pf._procs
    flags = len(pool._due)
    try:
        jobs = [pool.submit(i % N, False) for i in range(flags + 2)]  # 0 is held meanwhile
        pool.flush()
        given = [j.due_flag for j in jobs]
        assert sorted(given[:flags]) == list(range(flags)) and given[flags:] == [-1, -1]
        jobs[1].mark_due()
        assert [pool._due[f] for f in range(flags)] == [int(f == given[1]) for f in range(flags)]
        (loads / "release").touch()
        for j in jobs:
            assert j.wait(120) and j.outcome is j.DONE, j.outcome
        assert sorted(pool._free_flags) == list(range(flags))
    finally:
        (loads / "release").touch()
        pf.close()
        cache.close()


class Together:
    """A load that returns only once ``n`` loads have begun (files: it runs in loader
    processes), so it finishes only if ``n`` loads are in flight at once."""

    def __init__(self, directory, n: int) -> None:
        self.directory, self.n = str(directory), n

    def __call__(self, i):
        open(os.path.join(self.directory, f"entered-{i}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(self.directory)) < self.n:
            assert time.monotonic() < deadline, f"only {os.listdir(self.directory)} began"
            time.sleep(0.01)
        return value_of(i)


@pytest.mark.timeout(300)
def test_processes_times_threads_loads_run_at_once_and_close_ends_every_thread(shm_dir,
                                                                                 tmp_path):
    """processes=2, threads=3: six loads in flight at once (each waits for the others), and
    close() ends every loader thread with its sentinel, so the processes exit by themselves
    (exit code 0) instead of being killed after the join timeout."""
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, Together(tmp_path, 6), processes=2, threads=3,
                    stand_aside=False)
    procs = pf._procs._procs
    try:
        jobs = [pf._procs.submit(i, False) for i in range(6)]
        pf._procs.flush()  # three jobs to each process
        for j in jobs:
            assert j.wait(120) and j.outcome is j.DONE, j.outcome
        assert all(cache.get_slot(i) is not None for i in range(6))
        t0 = time.monotonic()
        pf.close()
        assert [p.exitcode for p in procs] == [0, 0] and time.monotonic() - t0 < 8
    finally:
        pf.close()
        cache.close()


@pytest.mark.timeout(300)
def test_a_finished_job_marked_due_leaves_its_reused_flag_alone(shm_dir, tmp_path):
    """The iterator marks a job due when it reaches the job's index, also a job that finished
    long before; its flag has been given back by then and may belong to a later live job,
    which must not be told that it is due (a staged one would then drop its load as soon as
    the staging area is full, and the workers would load the sample a second time)."""
    loads = tmp_path / "loads"
    loads.mkdir()
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, HeldAt(loads, 1), processes=1, threads=1,
                    lookahead=1, stand_aside=False)
    pool = pf._procs
    try:
        done = pool.submit(0, False)
        pool.flush()
        flag = done.due_flag
        assert done.wait(120) and done.outcome is done.DONE, done.outcome
        later = pool.submit(1, False)  # held in its load meanwhile
        pool.flush()
        assert later.due_flag == flag  # the flag given back is the next one taken
        done.mark_due()
        assert pool._due[flag] == 0
        later.mark_due()
        assert pool._due[flag] == 1
    finally:
        (loads / "release").touch()
        pf.close()
        cache.close()


@pytest.mark.timeout(300)
def test_jobs_go_to_live_loader_processes_only_and_close_returns(shm_dir):
    """A loader process killed between two epochs gets no more jobs: sending them, more than
    its pipe holds, would block flush() for good (and close() after it), outside every
    timeout. The live process loads them all, and close() returns."""
    cache = make_cache(shm_dir)
    pf = Prefetcher(list(range(N)), cache, value_of, processes=2, threads=1,
                    stand_aside=False)
    pool = pf._procs
    dead = pool._procs[1]
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(60)
        jobs = [pool.submit(i % N, False) for i in range(12000)]  # ~100 KB each way
        sender = threading.Thread(target=pool.flush, daemon=True)
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "flush() blocked on the dead process's pipe"
        for j in jobs:
            assert j.wait(120) and j.outcome is j.DONE, j.outcome
        oob = oob_of(cache)  # (not staged: these jobs were submitted as set_slot jobs)
        assert all(cache.get_slot(i) is not None for i in range(N) if i not in oob)
    finally:
        closer = threading.Thread(target=pf.close, daemon=True)
        closer.start()
        closer.join(60)
        cache.close()
    assert not closer.is_alive(), "close() blocked"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_sigkill_of_the_trainer_takes_its_loader_processes_along(shm_dir, tmp_path, start):
    """fork: the kernel kills them with their parent (PR_SET_PDEATHSIG). forkserver: their
    parent is the fork server, so a thread of each watches the trainer (before, they took
    the fork server for a dead trainer and exited at once)."""
    err = open(tmp_path / "train.stderr", "w")
    p = subprocess.Popen([sys.executable, str(CHILDREN / "prefetch_train_processes.py")],
                         env={**rank_env(shm_dir), "PREFETCH_START": start},
                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    loaders: list[int] = []
    try:
        line = p.stdout.readline()  # returns at READY, or at EOF if the child died
        assert line.startswith("READY "), (tmp_path / "train.stderr").read_text()[-3000:]
        loaders = [int(x) for x in line.split()[1:]]
        assert len(loaders) == 2 and all(pid in users(shm_dir) for pid in loaders)
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(60) == -signal.SIGKILL
        assert all(wait_exit(pid, 60) for pid in loaders)  # at once, or within 0.5 s
        # The DataLoader's fork workers poll their parent every 5 s: an event-bound wait.
        assert all(wait_exit(pid, 120) for pid in users(shm_dir))
        assert users(shm_dir) == {} and os.listdir(shm_dir) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)
        for pid in loaders:
            if not wait_exit(pid, 0):
                os.kill(pid, signal.SIGKILL)
        err.close()


def test_bad_processes_argument_names_it(shm_dir):
    cache = make_cache(shm_dir)
    children = {c.pid for c in psutil.Process().children()}  # e.g. a resource tracker
    try:
        for bad, exc in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(exc, match="processes"):
                Prefetcher(list(range(N)), cache, value_of, processes=bad, stand_aside=False)
        for bad, exc in (("thread", ValueError), (3, TypeError)):
            with pytest.raises(exc, match=f"multiprocessing_context.*{bad!r}|"
                                          f"multiprocessing_context of type int"):
                Prefetcher(list(range(N)), cache, value_of, processes=1,
                           multiprocessing_context=bad, stand_aside=False)
        # A load that spawn cannot pickle: the error names load and the start method.
        with pytest.raises(TypeError, match=r"load should be picklable to start loader "
                                            r"processes with multiprocessing_context='spawn'"):
            Prefetcher(list(range(N)), cache, lambda i: value_of(i), processes=2,
                       multiprocessing_context="spawn", stand_aside=False)
        # A refused prefetcher started nothing.
        assert {c.pid for c in psutil.Process().children()} == children
    finally:
        cache.close()


# ----------------------------------------------------------------------------------------------
# Standing aside: loads that only compute are left to the DataLoader (docs/prefetch.md)
# ----------------------------------------------------------------------------------------------


class Computes:
    """A load that computes for 2 ms of its thread's CPU time and never waits: hashing,
    which releases the GIL, until the thread's CPU clock has advanced that far. A machine
    busy with other work stretches its wall time but not what it measures as waiting (time
    ready to run is not waiting), so it is CPU-bound by any clock."""

    BLOCK = bytes(65536)

    def __call__(self, i):
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            hashlib.sha256(self.BLOCK)
        return value_of(i)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stand_aside", [True, False])
def test_cpu_bound_loads_are_left_to_the_dataloader(shm_dir, stand_aside):
    # One loader process with one thread: nothing else in it holds the GIL, so the load
    # waits on nothing at all (in threads of the trainer it could wait for the GIL, which
    # the meter counts as waiting: the prefetcher then keeps loading, the safe side).
    n = 256
    cache = SharedCache(budget_for(n, DIMS, dataset_len=n), n, DIMS, shm_dir=shm_dir)
    pf = Prefetcher(Shuffled(n, seed=9), cache, Computes(), processes=1, threads=1,
                    stand_aside=stand_aside)
    try:
        loaded_here = set()
        for i in pf:  # the dataset's two lines, as a DataLoader worker would run them
            x = cache.get_slot(i)
            if x is None:
                x = value_of(i)
                cache.set_slot(i, x)
                loaded_here.add(i)
            assert x.equal(value_of(i))
        # Every miss was loaded once: by the prefetcher, or else here.
        assert pf.loaded + len(loaded_here) == n
        assert pf.left == len(loaded_here)
        if stand_aside:
            # Once 32 loads were measured, 15 misses in 16 are left: far more than half.
            assert pf.left >= n // 2, (pf.loaded, pf.left, str(pf._load_times))
            assert pf._load_times.cpu_bound()
        else:
            assert (pf.loaded, pf.left) == (n, 0)
    finally:
        pf.close()
        cache.close()


class ComputesHoldingTheGil:
    """A load that computes for 5 ms of its thread's CPU time in pure Python, holding the GIL
    (a decoder written in Python): loader threads of one process that run such loads at once
    wait for each other's GIL, which the meter counts as waiting."""

    def __call__(self, i):
        end = time.thread_time() + 0.005
        x = 0
        while time.thread_time() < end:
            for _ in range(1000):
                x += 1
        return value_of(i)


@pytest.mark.timeout(300)
def test_cpu_bound_loads_holding_the_gil_are_left_with_the_default_threads(shm_dir):
    """processes=2 with the default 16 threads each, under a DataLoader that draws indices in
    bursts: the measured loads and the probes run one per process at a time, so the GIL they
    hold is not taken for storage waits. (Before, bursts of probes ran together, the verdict
    turned to "not CPU-bound" and half the misses were loaded ahead: left was 300 of 600.)"""
    n = 400
    cache = SharedCache(budget_for(n, DIMS, dataset_len=n), n, DIMS, shm_dir=shm_dir)
    pf = Prefetcher(Shuffled(n, seed=11), cache, ComputesHoldingTheGil(), processes=2)
    loader = DataLoader(PrefetchedDataset(cache, n, value_of), batch_size=16, sampler=pf,
                        num_workers=2, multiprocessing_context="fork")
    try:
        assert sorted(read_epoch(loader)) == list(range(n))
        # 32 measured loads, then one miss in 16: at least three quarters are left
        assert pf.left >= 3 * n // 4, (pf.loaded, pf.left, str(pf._load_times))
        assert pf._load_times.cpu_bound(), str(pf._load_times)
    finally:
        pf.close()
        cache.close()


class ComputingLoads(Loads):
    """``Loads`` (recorded in files) that first compute as :class:`Computes` does."""

    def __call__(self, i):
        Computes()(i)
        return super().__call__(i)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("window, mode", [(None, "adaptive"), (8, "fixed"), (8, "adaptive")])
def test_standing_aside_still_loads_each_miss_once(shm_dir, tmp_path, window, mode):
    """Through a DataLoader, with misses left to the workers mid-epoch: every index once per
    epoch with its value, and every miss loaded once, by the prefetcher or by a worker,
    never by both and never twice at once."""
    loads = tmp_path / "loads"
    loads.mkdir()
    n, slots, staging = 512, 256, 128
    cache = SharedCache(budget_for(slots, DIMS, staging=staging, dataset_len=n), n, DIMS,
                        shm_dir=shm_dir, staging_slots=staging)
    assert len(cache) == slots
    oob = oob_of(cache)
    base = Shuffled(n, seed=4)
    pf = Prefetcher(base, cache, ComputingLoads(loads, "prefetcher"), window=window, mode=mode,
                    processes=1, threads=1)
    ds = PrefetchedDataset(cache, n, Loads(loads, "worker"))
    loader = DataLoader(ds, batch_size=BATCH, sampler=pf, num_workers=2,
                        multiprocessing_context="fork")
    try:
        for epoch in range(2):
            pf.set_epoch(epoch)
            before = load_counts(loads)
            check_epoch(read_epoch(loader), base.order(epoch), window)
            new = loads_since(loads, before)
            assert sorted(new) == [i for i in range(n) if epoch == 0 or i in oob]
            assert [i for i, who in new.items() if len(who) != 1] == []
        assert overlaps(loads) == []
        assert pf.loaded > 0 and pf.left > 0  # both loaded some: it did stand aside
    finally:
        del loader
        pf.close()
        cache.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_standing_aside_the_adaptive_window_keeps_the_base_order(shm_dir, mode):
    """While the loads are CPU-bound, ready-first would only gather the misses into the last
    batches of the epoch: the adaptive order then is the base order. The fixed order stays
    what the cache state at the epoch's start gives (deterministic), ready samples first."""
    n, window = 256, 8
    cache = SharedCache(budget_for(n // 2, DIMS, dataset_len=n), n, DIMS, shm_dir=shm_dir)
    base = Shuffled(n, seed=6)
    pf = Prefetcher(base, cache, Computes(), window=window, mode=mode, processes=1, threads=1)
    try:
        orders = []
        for epoch in range(2):
            pf.set_epoch(epoch)
            seen = []
            for i in pf:  # the dataset's two lines
                if cache.get_slot(i) is None and cache.aux_array[i] != SlotState.OOB.value:
                    cache.set_slot(i, value_of(i))
                seen.append(i)
            check_epoch(seen, base.order(epoch), window)
            orders.append(seen)
        assert pf._load_times.cpu_bound(), str(pf._load_times)
        # Epoch 1 began with the verdict known and half the indices cached.
        if mode == "adaptive":
            assert orders[1] == base.order(1)
        else:
            assert orders[1] != base.order(1)
    finally:
        pf.close()
        cache.close()
