"""Keep misses off the training path: a prefetcher.

:class:`Prefetcher` is a ``DataLoader`` sampler that loads the samples the loader will ask for
next, with many loads in flight, into the cache (or, for indices without a slot, into the
cache's staging slots), and yields an index only once its sample is there. The dataset keeps
its two lines (``get_slot``, and ``load`` + ``set_slot`` on a miss); enabling it is one line::

    from torch.utils.data import DataLoader, RandomSampler
    from stocaching import Prefetcher

    # dataset.cache = SharedCache(..., staging_slots=512); dataset.load(i) -> decoded tensor
    sampler = Prefetcher(RandomSampler(dataset), dataset.cache, dataset.load, window=256)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=2)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                 # forwarded to the base sampler, if it has one
        for batch in loader:
            ...

With a ``window``, the prefetcher yields the cache-preferring order of :class:`ReadyFirstSampler`
(``order.py``): within a window of ``W`` positions, the indices whose samples are ready come
before those that are not; every index of the base order still comes exactly once per epoch.

Reordering cannot change how many misses an epoch has ((1 - f) * N with a fraction f of the
dataset cached); the prefetcher hides their latency, and the order gives it lead time and
routes around misses that are not loaded yet. See docs/prefetch.md and docs/order.md.

This module imports only public names of ``stocaching`` and the order's module, and what the
opt-in modules share in ``_common.py`` (internal), so it also works copied next to
``stocaching.py``, ``_common.py`` and ``order.py``.

Contents: 1. its error and how loader processes start, 2. standing aside (measuring the
loads), 3. the ``Prefetcher``, which holds one collaborator per concern: 4. staging (its staged
samples, given back however an epoch ends), 5. what a cache of open sizes refused, 6. its own
resume over a base that cannot record a position; then 7. an epoch's loads and a load, 8. the
loaders in threads, 9. the loaders in processes.
"""

from __future__ import annotations

__all__ = ["PrefetchError", "Prefetcher"]

import collections
import contextlib
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import secrets
import signal
import threading
import time
import traceback
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

try:  # inside the package
    from ._common import (_checked_generator_state, _class_over_base, _generator_state,
                          _order_differs, _OverDistributed, _positions_dealt, _RecordingSampler,
                          _set_generator_state, _warn_unseeded, _wrapped_by_lightning,
                          check_state_fields, refuse_changed_fields, warn_position_discarded)
    from .order import ReadyFirstSampler
    from .stocaching import MAX_STAGE_TAG, BaseCache, check_int
    from .trainers import dealt_by_accelerate, in_lightnings_wrapper
except ImportError:  # copied beside stocaching.py, _common.py, trainers.py and order.py
    from _common import (_checked_generator_state,  # type: ignore[no-redef]
                         _class_over_base, _generator_state, _order_differs, _OverDistributed,
                         _positions_dealt, _RecordingSampler, _set_generator_state,
                         _warn_unseeded, _wrapped_by_lightning, check_state_fields,
                         refuse_changed_fields, warn_position_discarded)
    from order import ReadyFirstSampler  # type: ignore[no-redef]
    from stocaching import MAX_STAGE_TAG, BaseCache, check_int  # type: ignore[no-redef]
    from trainers import dealt_by_accelerate, in_lightnings_wrapper  # type: ignore[no-redef]

logger = logging.getLogger("stocaching")


# ----------------------------------------------------------------------------------------------
# 1. Its error, and how its loader processes start
# ----------------------------------------------------------------------------------------------


class PrefetchError(RuntimeError):
    """The load function failed (or timed out) for a sample the prefetcher loaded ahead.

    The original exception, with its traceback, is the ``__cause__`` (from a loader process,
    ``processes=N``: a RuntimeError carrying its type, message and traceback as text).

    Attributes:
        index: the dataset index whose load failed.
    """

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.index)


def _start_context(ctx: Any) -> Any:
    """The multiprocessing context named by ``multiprocessing_context`` (checked)."""
    if ctx is None:
        return multiprocessing.get_context()
    if isinstance(ctx, str):
        if ctx not in multiprocessing.get_all_start_methods():
            raise ValueError(f"multiprocessing_context should be one of "
                             f"{multiprocessing.get_all_start_methods()}, a context or None, "
                             f"but got multiprocessing_context={ctx!r}")
        return multiprocessing.get_context(ctx)
    if not isinstance(ctx, multiprocessing.context.BaseContext):
        raise TypeError(f"multiprocessing_context should be a start method name, a "
                        f"multiprocessing context or None, but got multiprocessing_context of "
                        f"type {type(ctx).__name__}")
    return ctx


# ----------------------------------------------------------------------------------------------
# 2. Standing aside: measuring the loads
# ----------------------------------------------------------------------------------------------


# Loads are CPU-bound while they wait (for storage, a socket, a sleep) less than this share of
# the CPU time they use.
_CPU_BOUND_WAIT_SHARE = 0.25
# While the loads are CPU-bound, one miss in this many is still loaded, to keep measuring.
_PROBE_EVERY = 16
# Once the loads are measured and not CPU-bound, one load in this many is timed; probes, and
# loads before the verdict, always are. See docs/design.md, "Where a miss's CPU goes on 2 cores".
_TIME_EVERY = 8


class _WaitMeter:
    """Times the loads of one thread: how long a load waited neither running nor ready to run
    (on storage, a socket, a sleep, or the GIL) and how much CPU it used, from Linux's
    per-thread scheduler statistics, so that time spent waiting for a core, as on a machine
    busy with the loads themselves, counts as neither. Where that file does not exist it
    measures nothing (and the prefetcher never stands aside). Made by the thread it times."""

    PATH = "/proc/thread-self/schedstat"
    WORKS = os.path.exists(PATH)  # (on Linux, with the kernel's scheduler statistics)

    def __init__(self) -> None:
        try:
            self._fd = os.open(self.PATH, os.O_RDONLY)
        except OSError:
            self._fd = -1

    def now(self) -> tuple[int, int, int] | None:
        """(wall, CPU, ready to run) in nanoseconds, or None. The CPU time is the clock's:
        the file's lags behind for a thread that is running (it reads it)."""
        if self._fd < 0:
            return None
        try:
            ready = int(os.pread(self._fd, 128, 0).split()[1])
            return time.monotonic_ns(), time.thread_time_ns(), ready
        except (OSError, ValueError, IndexError):
            return None

    def since(self, t0: tuple[int, int, int] | None) -> tuple[int, int] | None:
        """(waited, CPU) in nanoseconds since ``t0`` from :meth:`now`, or None (``t0`` None:
        an untimed load, and nothing is read)."""
        if t0 is None:
            return None
        t1 = self.now()
        if t1 is None:
            return None
        wall, cpu, ready = (b - a for a, b in zip(t0, t1))
        return max(0, wall - cpu - ready), cpu

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _ReadyUnlessCpuBound:
    """The ready bits of the adaptive order under a prefetcher: the cache's, but every index
    while the loads are CPU-bound. A miss left to the ``DataLoader`` then costs its workers
    the same CPU at any position, so putting ready samples first saves nothing; it only
    gathers the misses into a few batches (the last ones of an epoch), which a worker builds
    slowly while the trainer waits, having raced through batches of hits. (A class, not a
    bound method of the prefetcher: its order must not keep the prefetcher alive.)"""

    def __init__(self, cache: BaseCache, times: "_LoadTimes") -> None:
        self.cache, self.times = cache, times

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        if self.times.cpu_bound():
            return np.ones(indices.shape, dtype=bool)
        return self.cache.ready_mask(indices)


class _LoadTimes:
    """The waiting and CPU times of a prefetcher's latest timed loads (a
    :class:`_WaitMeter`'s; which loads are timed: ``_TIME_EVERY``). A load is CPU-bound when
    it waited less than ``_CPU_BOUND_WAIT_SHARE`` of its CPU time, and the loads are when
    most of the latest ``KEEP`` timed ones are (most, so that a few loads held up
    by a page fault or the GIL do not decide). Loading CPU-bound samples ahead cannot shorten
    an epoch, since the ``DataLoader``'s workers would spend the same CPU on them, and it
    costs the prefetcher's own work."""

    KEEP = 32  # loads

    def __init__(self) -> None:
        self._recent: collections.deque = collections.deque()  # (waited, CPU, CPU-bound)
        self._bound = 0  # CPU-bound loads in _recent
        self._lock = threading.Lock()
        self.seen = 0  # loads finished, timed or not
        self.timed = 0  # of those, the timed ones

    def add(self, times: tuple[int, int] | None) -> None:
        with self._lock:
            self.seen += 1
            if times is None:
                return
            self.timed += 1
            waited, cpu = times
            bound = int(waited < _CPU_BOUND_WAIT_SHARE * cpu)
            self._recent.append((waited, cpu, bound))
            self._bound += bound
            if len(self._recent) > self.KEEP:
                self._bound -= self._recent.popleft()[2]

    def known(self) -> bool:
        return len(self._recent) >= self.KEEP  # (KEEP + 1 for a moment inside add)

    def cpu_bound(self) -> bool:
        with self._lock:
            return len(self._recent) == self.KEEP and 2 * self._bound > self.KEEP

    def __str__(self) -> str:
        with self._lock:
            recent, bound = list(self._recent), self._bound
        n = max(1, len(recent))
        return (f"{bound} of the latest {len(recent)} timed loads were, and they waited "
                f"{sum(r[0] for r in recent) / n / 1e6:.2f} ms a load for "
                f"{sum(r[1] for r in recent) / n / 1e6:.2f} ms of CPU")


class _EpochMeasuring:
    """One epoch's measuring of the loads, for standing aside: the measuring throttle while
    the first loads are measured (:meth:`throttled`), which loads are timed
    (:meth:`submitted`), and the probes while standing aside (:meth:`stands_aside`). The
    verdict is the prefetcher's :class:`_LoadTimes`, over epochs; the counts here are this
    epoch's."""

    __slots__ = ("times", "stand_aside", "on", "submitted", "finished_before",
                 "in_flight_while_measuring", "aside")

    times: _LoadTimes  # the prefetcher's, written by its loaders
    stand_aside: bool  # the prefetcher's stand_aside
    on: bool  # measuring at all: stand_aside, where the loads can be timed (_WaitMeter.WORKS)
    submitted: int  # loads submitted this epoch
    finished_before: int  # loads finished before this epoch (times.seen at its start)
    in_flight_while_measuring: int  # loads in flight at most while measuring
    aside: int  # misses seen while standing aside, probes included

    def __init__(self, times: _LoadTimes, *, stand_aside: bool,
                 in_flight_while_measuring: int) -> None:
        self.times, self.stand_aside = times, stand_aside
        self.on = stand_aside and _WaitMeter.WORKS
        self.submitted, self.finished_before = 0, times.seen
        self.in_flight_while_measuring = in_flight_while_measuring
        self.aside = 0

    def cpu_bound(self) -> bool:
        """Whether the prefetcher stands aside now: the loads are CPU-bound."""
        return self.stand_aside and self.times.cpu_bound()

    def stands_aside(self) -> bool:
        """With CPU-bound loads, whether the next miss is left to the DataLoader: all but one
        miss in ``_PROBE_EVERY``, which is still loaded, to measure."""
        self.aside += 1
        return bool(self.aside % _PROBE_EVERY)

    def throttled(self, bound: bool) -> bool:
        """Whether no load may be submitted now: the measuring throttle.

        Until the loads are measured, at most 2 x _LoadTimes.KEEP are submitted; and until
        then, and while standing aside (``bound``: the probes), one load a loader process
        runs at a time (each job goes to the least busy; two with threads): loads that share
        a GIL wait for it, which would count as waiting on storage and hide CPU-bound loads.
        See docs/design.md, "The measuring throttle"."""
        known = self.times.known()
        return self.on and (bound or not known) and (
            (not known and self.submitted >= 2 * _LoadTimes.KEEP) or
            self.submitted - (self.times.seen - self.finished_before) >=
            self.in_flight_while_measuring)

    def submitted_one(self, bound: bool) -> bool:
        """Count a load submitted; whether its loader times it (see ``_TIME_EVERY``)."""
        timed = self.on and (bound or not self.times.known() or
                             self.submitted % _TIME_EVERY == 0)
        self.submitted += 1
        return timed


# ----------------------------------------------------------------------------------------------
# 3. The Prefetcher
# ----------------------------------------------------------------------------------------------


class Prefetcher(torch.utils.data.Sampler[int]):
    """Loads the samples the ``DataLoader`` will ask for next, before it asks, with many
    loads in flight; yields an index only once its sample is in the cache.

    It is the ``DataLoader``'s sampler: it wraps the order you would use (``RandomSampler``,
    ``DistributedSampler``, ``CacheAwareSampler``, ...) and, with a ``window``, reorders it
    with :class:`ReadyFirstSampler` so that ready samples go first and a miss gets lead time.
    It runs where the ``DataLoader`` draws indices (the training process of each rank), keeps
    the next ``lookahead`` positions of the base order loading in ``threads`` threads (the
    user's ``load`` function: read and decode, phase one of the two-phase transforms), and
    stores each result with ``cache.set_slot`` (an index with a slot) or ``cache.stage`` (an
    index without one, if the cache has ``staging_slots``). The ``DataLoader`` workers then
    find the sample with ``get_slot``, in any start method; the dataset is unchanged.

    Never twice at once: an index it loads is yielded only after its load has finished, so
    no worker loads it too; indices it did not load (beyond the cache and the staging area)
    are loaded by the workers as without it, and so, from the next epoch on, are those whose
    sample a cache of open sizes refused (its arena full), until a ``clear()``. One prefetcher
    per rank: each rank's order (``DistributedSampler``, ``CacheAwareSampler``) holds the
    indices that rank reads, so ranks do not load each other's samples; they share the node's
    staging slots, each taking at most ``staging_slots // (2 * local_world_size)`` ahead of
    its position.

    Threads or processes: by default the loads run in ``threads`` threads of this process,
    which the ``DataLoader``'s main loop leaves idle while it waits. That suits slow reads
    (files on network storage, sockets) and decoders that release the GIL; the threads start
    with each epoch's iterator and stop with it, and none outlives the process. When decoding
    is what costs, pass ``processes=N``: the loads then run in N processes, started when the
    prefetcher is made (so that starting them overlaps the rest of the setup), kept for every
    epoch like ``persistent_workers`` and stopped by ``close()`` or with the prefetcher; each
    runs ``threads`` loader threads and stores what they load itself, so N x ``threads``
    loads are in flight: slow reads overlap as with threads, and decoding uses N cores.
    (For decoding in pure Python, which holds the GIL, a few threads per process suffice.)
    They start as ``multiprocessing_context`` says, like a ``DataLoader``'s
    workers: by default the platform's default ("fork" on Linux up to Python 3.13, which
    starts in milliseconds and takes ``load`` as it is). With "spawn" or "forkserver",
    ``load`` must be picklable: a function or a bound method of a picklable dataset, defined
    at the top level of a module (the main script's top level works when the training code
    runs under ``if __name__ == "__main__":``), and each process takes a second or more
    (several on busy cores) to import torch. The processes die with this process, also by
    SIGKILL (``PR_SET_PDEATHSIG``, or with "forkserver" a thread of each that watches this
    process; the first follows the thread that started them, so make the prefetcher, and
    iterate it, in a thread that lives as long as the training: the epoch after a
    ``close()`` or a dead loader process starts new ones from the iterating thread). A loader
    process that died is reported by the epoch that meets it; the next epoch starts new ones.
    With "fork", a loader process is a copy of this process when it starts: later changes to
    the dataset behind ``load`` are not seen, and the threads of clients made before (HTTP or
    object-store connection pools) are not copied, so make such clients in ``load`` lazily.

    Under trainers: over a ``DistributedSampler`` (``CacheAwareSampler`` is one) the
    prefetcher is one too, as :class:`ReadyFirstSampler` is, so Lightning's default
    (``use_distributed_sampler=True``) leaves it as it is and calls its ``set_epoch``; over
    another sampler Lightning wraps it in a distributed sampler of its own, which lists the
    whole epoch first (every sample loaded before the first batch), and it warns once. Under
    accelerate's ``prepare()``, which deals the loader's batches to its processes, give it the
    sampler accelerate expects (``CacheAwareSampler(...).for_accelerate()``, or a
    ``RandomSampler``, whose generator it shares with accelerate so that every process draws
    the same order): each process's prefetcher loads only the positions its process reads,
    and with a window reorders only those, so each process reads exactly its own batches. A
    base that gives each rank its share (a ``CacheAwareSampler`` itself) warns once there,
    since ``prepare()`` splits that share again. The resume of a prefetcher under
    ``prepare()`` is not supported.

    Errors: an exception in ``load`` (or in storing its result, e.g. a wrong shape) is raised
    by the iterator as :class:`PrefetchError` naming the index, with the original exception
    and traceback as its cause (with ``processes``, as the text of a RuntimeError); a load
    running longer than ``timeout`` seconds raises one too.

    Args:
        sampler: the base order; ``set_epoch`` is forwarded to it.
        cache: the cache (a ``SharedCache`` or an ``OpenSizeCache``) that the dataset reads
            with ``get_slot``.
        load: ``load(index) -> tensor``: the sample as the dataset would cache it.
        window: W of the cache-preferring order (no index moves more than W positions), or
            None to keep the base order. Default: None.
        mode: "fixed" or "adaptive", as in :class:`ReadyFirstSampler` (with a window):
            "fixed" is deterministic (same seed and cache state at the epoch's start, same
            order; a resume continues it exactly); "adaptive" serves what is ready now (the
            order depends on timing), which hides a load that finishes late. Default: "fixed".
        threads: loads in flight, in threads of this process (or of each loader process
            with ``processes``), an int >= 1. Default: 16.
        processes: when an int >= 1, load in this many loader processes, each with
            ``threads`` threads, instead of threads of this process. Default: 0.
        lookahead: positions of the base order kept loading ahead of the ``DataLoader``
            (beyond the window), an int >= 1. Default: 4 x the loads in flight
            (``threads``, or ``processes * threads``).
        timeout: seconds to wait for one load before raising. Default: 120.
        multiprocessing_context: how loader processes start (``processes=N``): "fork",
            "spawn", "forkserver", a context from ``multiprocessing.get_context``, or None
            for the platform's default. Default: None.
        stand_aside: while the loads are CPU-bound (they wait on storage for less than a
            quarter of their CPU time, as measured on Linux), leave the misses to the
            ``DataLoader``'s workers, as without a prefetcher, and load only one in 16 to
            keep measuring; loading them ahead would cost CPU and save none. Meanwhile an
            adaptive window serves the base order (ready-first would only gather the
            misses into the epoch's last batches). Default: True.

    Attributes:
        base: the base order, ``sampler``.
        loaded: loads this prefetcher finished, over all epochs.
        dropped: loads whose sample found no free staging slot by the time its index was
            due, and which were left to the DataLoader (not counted in ``loaded``), over all
            epochs.
        left: misses left to the ``DataLoader`` because the loads were CPU-bound
            (``stand_aside``), over all epochs.
    """

    # configuration (checked arguments)
    cache: BaseCache
    load: Callable[[int], Any]
    window: int | None
    threads: int
    processes: int
    lookahead: int
    timeout: float
    stand_aside: bool
    _mp_context: Any
    # the order: the user's sampler recorded as it passes, and the order iterated over it
    _recording: _RecordingSampler
    _order: Any  # _recording itself, or a ReadyFirstSampler over it
    # collaborators, one concern each
    _load_times: _LoadTimes  # standing aside: the latest timed loads, over epochs
    _tag: int  # this prefetcher's number in the cache (its staged samples, read_tags)
    _staging: _Staging  # its staged samples, given back however an epoch ends
    _refusals: _ArenaRefusals  # what a cache of open sizes did not keep
    _resume_by_skipping: _ResumeBySkipping  # its own resume, over a base without a position
    _give_back: weakref.finalize  # gives back every staged sample when the prefetcher goes
    # the loaders: threads of the running epoch, or processes for every epoch
    _pool: "_LoaderPool | None"
    _procs: "_ProcessLoaderPool | None"
    _running: dict[int, "_Job"]  # loads running in a loader thread, over epochs
    _lock: threading.Lock  # guards _running and the counters
    # counters, over all epochs
    loaded: int
    dropped: int
    left: int
    # the position: [start, yielded] of the latest iterator of this epoch, the latest set_epoch
    _progress: list | None
    _epoch: int | None
    _warned: set[str]  # the trainers it warned about

    def __new__(cls, *args: Any, **kwargs: Any) -> "Prefetcher":
        return super().__new__(_class_over_base(cls, Prefetcher, _DistributedPrefetcher, args,
                                                kwargs, "sampler"))

    def __init__(self, sampler: Any, cache: BaseCache, load: Callable[[int], Any], *,
                 window: int | None = None, mode: str = "fixed", threads: int = 16,
                 lookahead: int | None = None, timeout: float = 120.0,
                 processes: int = 0, multiprocessing_context: Any = None,
                 stand_aside: bool = True) -> None:
        if not isinstance(cache, BaseCache):
            raise TypeError(f"cache should be a SharedCache or an OpenSizeCache, but got cache "
                            f"of type {type(cache).__name__}")
        if not callable(load):
            raise TypeError(f"load should be a callable load(index) -> tensor, but got "
                            f"load of type {type(load).__name__}")
        self.threads = check_int("threads", threads, low=1)
        self.processes = check_int("processes", processes, low=0)
        self.lookahead = 4 * self.threads * max(1, self.processes) if lookahead is None else \
            check_int("lookahead", lookahead, low=1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout should be a positive number of seconds, but got "
                            f"timeout={timeout!r}")
        if not 0 < timeout < float("inf"):
            raise ValueError(f"timeout should be a positive number of seconds, but got "
                             f"timeout={timeout!r}")
        if mode not in ("fixed", "adaptive"):
            raise (ValueError if isinstance(mode, str) else TypeError)(
                f"mode should be 'fixed' or 'adaptive', but got mode={mode!r}")
        if not isinstance(stand_aside, bool):
            raise TypeError(f"stand_aside should be True or False, but got "
                            f"stand_aside={stand_aside!r}")
        self.timeout = float(timeout)
        self.stand_aside = stand_aside
        self._mp_context = _start_context(multiprocessing_context)
        self.cache, self.load = cache, load
        self._recording = _RecordingSampler(sampler, cache.dataset_len)
        self.window = None if window is None else check_int("window", window, low=1)
        self._load_times = _LoadTimes()
        # The adaptive order serves the base order while standing aside (see
        # _ReadyUnlessCpuBound); the fixed one stays a function of the cache state at the
        # epoch's start.
        ready = cache if mode == "fixed" or not stand_aside else \
            _ReadyUnlessCpuBound(cache, self._load_times)
        self._order = self._recording if window is None else \
            ReadyFirstSampler(self._recording, ready, window=self.window, mode=mode)
        self._tag = secrets.randbelow(MAX_STAGE_TAG + 1)
        self._staging = _Staging(cache, self._tag)
        self._refusals = _ArenaRefusals(cache)
        self._resume_by_skipping = _ResumeBySkipping(self._recording)
        # Given back when the prefetcher goes: another rank's prefetcher does not take them
        # (each counts only its own tag as ready), so they would hold staging slots.
        self._give_back = weakref.finalize(self, self._staging.give_back_all)
        self._pool = None
        # An epoch abandoned mid-load leaves its loads running, and the next epoch waits for
        # those instead of starting again.
        self._running = {}
        self._lock = threading.Lock()
        self.loaded = 0  # loads finished: what the benchmark reports
        self.dropped = 0  # loads whose sample found no free staging slot in time
        self.left = 0  # misses left to the DataLoader while the loads were CPU-bound
        self._procs = None
        self._progress = None  # (the default position of state_dict(); None before one ran)
        self._epoch = None
        self._warned = set()
        if self.processes:
            self._procs = self._start_processes()
        # This rank's workers read this rank's copies only: with epochs that drift apart, two
        # ranks may both have staged an index, and each gives back (unstage) its own copy.
        # (A set: a process may run several prefetchers on one cache, train and validation.)
        cache.read_tags = cache.read_tags | {self._tag}

    def _start_processes(self) -> "_ProcessLoaderPool":
        flags = 4 * self.loads_ahead + 64  # > jobs alive, as a rule
        return _ProcessLoaderPool(self, self.cache, self.load, self.processes, self.threads,
                                  flags, self._mp_context, tag=self._tag,
                                  settled=weakref.WeakMethod(self._settled))

    def _settled(self, idx: int, kind: str, times: tuple[int, int] | None) -> None:
        """Count what a loader process did with its load of ``idx`` (``kind``: 'stored',
        'refused' (no room for an open size), 'staged' or 'dropped'), measured by
        ``times`` (see :class:`_WaitMeter`)."""
        self._load_times.add(times)
        if kind == "refused":
            self._refusals.add(idx)
        if kind == "staged":
            self._staging.add(idx)
        with self._lock:
            if kind == "dropped":
                self.dropped += 1
            else:
                self.loaded += 1

    def close(self) -> None:
        """Stop the loads (the loader threads of a running epoch, whose iterator then raises
        :class:`PrefetchError` if it is advanced; the loader processes with ``processes=N``:
        a later epoch starts new ones) and give back every staging slot holding a sample it
        staged. Idempotent and quiet, also after the cache was closed; also done when the
        prefetcher is collected or the program exits."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
        if self._procs is not None:
            self._procs.close()
            self._procs = None
        self._staging.give_back_all(final=False)

    def __len__(self) -> int:
        return len(self._recording.base)

    @property
    def base(self) -> Any:
        """The base order, ``sampler``."""
        return self._recording.base

    @property
    def generator(self) -> Any:
        """The base sampler's ``generator`` (an AttributeError if it has none): accelerate's
        ``prepare()`` shares it between its processes, as for a ``RandomSampler`` of its own,
        so that every process draws the same order."""
        return self._recording.base.generator

    @generator.setter
    def generator(self, value: Any) -> None:
        self._recording.base.generator = value

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the order (and so to the base sampler, if it has one)."""
        if hasattr(self._order, "set_epoch"):
            self._order.set_epoch(epoch)
        if epoch != self._epoch:  # (the same epoch again keeps the position)
            self._progress = None
            self._resume_by_skipping.discard(epoch)
        self._epoch = epoch

    @property
    def stage_ahead(self) -> int:
        """The most samples this prefetcher keeps staged ahead of what it has yielded: half
        of the cache's staging slots, shared among its local ranks."""
        return self._staging.most_ahead

    @property
    def loads_ahead(self) -> int:
        """The most positions of the base order past the one the ``DataLoader`` is at that
        this prefetcher keeps loading: ``window`` (0 without one) plus ``lookahead``."""
        return (self.window or 0) + self.lookahead

    @property
    def position(self) -> int:
        """Indices of the current epoch used so far: the position the latest iterator of the
        epoch started from (a resume's) plus what it has yielded; 0 before one started."""
        progress = self._progress
        return 0 if progress is None else progress[0] + progress[1]

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch, with what is needed to continue it.

        The prefetcher reads its base order ahead (the whole epoch, when an iterator starts),
        so the base's own count says nothing about what was yielded: the position is always
        the prefetcher's. It goes to the order: with a window, to :class:`ReadyFirstSampler`
        (its state); without one, to a base whose ``state_dict`` takes ``consumed``
        (``CacheAwareSampler``, ``WeightedMixtureSampler``: the state is the base's). Any
        other base gets the prefetcher's own state: ``epoch``, ``consumed``, ``len``,
        ``base`` (the base's ``state_dict()`` at the epoch's start, or None),
        ``order_digest`` (a fingerprint of the epoch's base order), and ``generator`` and
        ``generator_after`` (for a base that draws its epochs from a ``torch.Generator``, as
        ``RandomSampler(generator=...)`` does: its state at the epoch's start and after the
        epoch's order was drawn, bytes; else None). A resume sets the generator to its state
        at the epoch's start, takes the base's epoch again and skips ``consumed`` indices
        (the generator then ends where it did, so later epochs are the uninterrupted run's;
        ``set_epoch`` of another epoch instead sets it to its state after the saved epoch),
        and refuses (``ValueError``) a base order that differs: the base's order must be a
        function of its seed and epoch, or of its generator's state. With a window over a
        base whose order does not depend on the world, the state carries what another world
        needs (``ReadyFirstSampler.state_dict``'s ``world``).

        Args:
            consumed: indices of this epoch that were used. Default: the number the latest
                iterator of this epoch has yielded (plus the position it was resumed from);
                with a ``DataLoader`` of ``num_workers > 0``, which draws indices ahead of
                the model, pass ``steps * batch_size``.
        """
        progress = self._progress
        if consumed is None and progress is not None:
            consumed = progress[0] + progress[1]
        if self.window is None and not self._recording.positional:
            state = self._resume_by_skipping.state(self._epoch, consumed, progress is not None)
        elif consumed is None:  # no iterator of this epoch has started: the order knows
            state = self._order.state_dict()
        else:
            state = self._order.state_dict(consumed=consumed)
        # (not state["consumed"]: a base's own state need not have it; and under accelerate's
        # prepare(), consumed counts this process's positions: len(self._recording))
        if progress is not None and consumed < len(self._recording):
            _warn_unseeded(self._recording, self._warned)
        return state

    def load_state_dict(self, state: Mapping[str, Any] | list[Mapping[str, Any]]) -> None:
        """Continue from ``state``, a dict from ``state_dict()``: the next iterator yields
        the rest of its epoch.

        On another world (other ranks, nodes or per-rank batch size), over a base whose
        order does not depend on it (``CacheAwareSampler``, ``WeightedMixtureSampler``):
        without a window the base's state serves, at a batch boundary (as the base
        resumes it); with a window pass the list of every saved rank's state, saved at the
        same step (``[rank 0's, rank 1's, ...]``): each holds what its rank consumed out of
        the base order (see ``ReadyFirstSampler.load_state_dict``), and the next iterator
        yields every index no rank consumed, once (the new world pads as its base does).
        A list is taken on the same world too.

        Args:
            state: a dict from ``state_dict()``, or the list of every rank's (see above).
        """
        if isinstance(state, (list, tuple)):
            self._load_world(state)
            return
        if self.window is None and not self._recording.positional:
            self._resume_by_skipping.load(state)
        else:
            self._order.load_state_dict(state)
        self._progress = None
        self._epoch = state.get("epoch")  # a set_epoch of this epoch keeps the position

    def _load_world(self, states: list[Mapping[str, Any]]) -> None:
        """``load_state_dict`` of the states of every rank of a world."""
        if not states or not all(isinstance(x, Mapping) for x in states):
            raise ValueError("state should be a dict from state_dict(), or the list of every "
                             "rank's, but got an empty list or one of other things")
        if self.window is not None:
            self._order.load_state_dict(list(states))
        elif self._recording.positional:
            # Without a window each rank consumed a prefix of its base order: at one step,
            # the same on every rank, so any rank's state says what all consumed.
            for k, x in enumerate(states):
                for field in ("epoch", "consumed"):
                    if x.get(field) != states[0].get(field):
                        raise ValueError(f"state[{k}]['{field}'] should be that of the first "
                                         f"state, {states[0].get(field)!r} (the ranks of one "
                                         f"world at one step), but got {x.get(field)!r}")
            self._order.load_state_dict(states[0])
        else:
            raise ValueError(
                f"state should be this rank's state alone: this prefetcher's base sampler "
                f"({type(self._recording.base).__name__}) gives each rank an order that "
                f"depends on the world, so the states of another world's ranks cannot resume "
                f"it; make the base a CacheAwareSampler (or WeightedMixtureSampler), whose "
                f"order does not depend on the world")
        self._progress = None
        self._epoch = states[0].get("epoch")

    def __iter__(self) -> Iterator[int]:
        if "lightning" not in self._warned and in_lightnings_wrapper():
            self._warned.add("lightning")
            warnings.warn(_wrapped_by_lightning(
                "Prefetcher", self._recording.base, " (the prefetcher loads every sample of it "
                "before the first batch)"), stacklevel=2)
        mine = self._dealt_positions()
        self._recording.keep = mine
        if mine is None:
            for block in self._iter_loaded(1):
                yield block[0]
            return
        # Under accelerate's prepare(): every position is yielded, this process's once loaded,
        # in the order of the loads (the window reorders them among themselves); the others,
        # which the shard passes over here, at once.
        self._recording.take()
        loaded = self._iter_loaded(1)
        try:
            for idx, ours in zip(self._recording.full.tolist(), mine.tolist()):
                yield next(loaded)[0] if ours else idx
        finally:
            loaded.close()

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """The epoch's indices, as iterating the prefetcher gives them, in int64 arrays of
        ``batch_size`` (the last may be shorter), each yielded once every sample of it is
        loaded: the iterator of a loader that gathers whole batches (``DeviceLoader``).
        Without a window the arrays are slices of the epoch's order, with no Python int made
        per index (see "The batch path's costs" in docs/design.md). Not under accelerate's
        ``prepare()``."""
        batch_size = check_int("batch_size", batch_size, low=1)
        self._recording.keep = None
        return self._iter_loaded(batch_size, arrays=True)

    def _dealt_positions(self) -> np.ndarray | None:
        """Under accelerate's ``prepare()``, the positions of the epoch this process reads
        (see ``_positions_dealt``); else None. Warns once when the base already gives each
        rank its share, which ``prepare()`` splits again."""
        shard = dealt_by_accelerate(self)
        if shard is None:
            return None
        base = self._recording.base
        # (a base with for_accelerate(), a CacheAwareSampler, says so itself)
        if getattr(base, "num_replicas", 1) > 1 and not hasattr(base, "for_accelerate") and \
                "accelerate" not in self._warned:
            self._warned.add("accelerate")
            warnings.warn(
                f"accelerate's prepare() deals this loader's batches to its "
                f"{shard.num_processes} processes, but this Prefetcher's sampler "
                f"({type(base).__name__}) already gives each of {base.num_replicas} ranks its "
                f"share: each rank reads 1/{shard.num_processes} of its share. Give the "
                f"prefetcher sampler.for_accelerate() (of a CacheAwareSampler), which yields "
                f"every rank's batches in the turn prepare() deals them", stacklevel=3)
        return _positions_dealt(shard, self, len(self))

    def _iter_loaded(self, block: int, arrays: bool = False) -> Iterator[Any]:
        """The epoch's indices of this process (all of them, but under ``prepare()``), in
        lists of ``block`` positions (int64 arrays if ``arrays``), each yielded once its
        samples are loaded: refill the window ahead, wait for the loads now due, yield."""
        self._staging.give_back_unread()
        self._refusals.note_arena(clear_refused=True)  # (a clear() gives room back)
        # Without a window, iterating yields the base order from ``pos`` on: it is sliced.
        sliced = arrays and self.window is None
        if sliced:
            self._recording.epoch()  # the base order is taken now
            order_it: Iterator[int] = iter(())
        else:
            order_it = iter(self._order)  # (recorded by self._recording)
        order_it, start, pos, skip = self._resume(order_it)
        progress = self._progress = [start, 0]
        measuring = _EpochMeasuring(self._load_times, stand_aside=self.stand_aside,
                                    in_flight_while_measuring=self.processes or 2)
        run = _EpochLoads(self._recording.order, pos, skip, self.loads_ahead, self._loaders(),
                          measuring, dropped=self.dropped, left=self.left)
        half, pool = run.span // 2, run.pool
        try:
            while True:
                if sliced:
                    ids = run.base[run.pos:run.pos + block]
                else:
                    ids = list(itertools.islice(order_it, block))
                if not len(ids):
                    break
                due = run.pos + len(ids)  # the positions [pos, due) are yielded now
                # Refill half a span at a time: one ready_mask call per chunk.
                if run.refill_from - (due - 1) <= half:
                    self._refill(run, due)
                pool.flush()  # the jobs of this refill go out together
                if run.pending:
                    self._wait_due(run, ids.tolist() if sliced else ids)
                run.pos = due
                progress[1] += len(ids)  # counted as yielded once the caller has them
                yield ids if sliced or not arrays else np.array(ids, dtype=np.int64)
        finally:
            self._end_epoch(run)

    def _resume(self, order_it: Iterator[int]
                ) -> tuple[Iterator[int], int, int, np.ndarray]:
        """The resume skip: the epoch's order from where this iterator starts, the position
        of the epoch it starts from, the same in the base order (``_RecordingSampler.order``),
        and which base positions from 0 on were yielded before it (not loaded again)."""
        base = self._recording.order
        if self.window is not None:
            # A resumed ReadyFirstSampler yields from step ``start`` on; base positions it
            # emitted before are not loaded again.
            start, skip = self._order.resumed_from()
            pos = start
        else:
            # The position this iterator starts from: a resumed base yields only the rest,
            # and one that cannot resume is skipped to the loaded position.
            start, pos, skip = self._recording.epoch_length() - len(base), 0, \
                np.zeros(0, dtype=bool)
        loaded = self._resume_by_skipping.take()
        if loaded is not None and self.window is None:
            if base.size != loaded["len"] or self._recording.digest != loaded["order_digest"]:
                raise _order_differs(loaded["epoch"], self._recording)
            pos = start = loaded["consumed"]
            skip = np.ones(pos, dtype=bool)
            order_it = itertools.islice(order_it, pos, None)
        return order_it, start, pos, skip

    def _loaders(self) -> "_Loaders":
        """The loaders of this epoch: the loader processes (started again if one died), or
        new loader threads."""
        if self.processes:
            if self._procs is not None and self._procs.dead():
                self.close()  # an epoch raised that one died: start afresh
            if self._procs is None:
                self._procs = self._start_processes()
            return self._procs
        self._pool = _LoaderPool(self.threads, self._fetch, self._running, self._lock)
        return self._pool

    def _refill(self, run: "_EpochLoads", due: int) -> None:
        """Submit the misses among the base positions from ``run.refill_from`` up to a span
        past the last position due, in order; stop early where the measuring throttle
        (``_EpochMeasuring.throttled``) or the staging limit says so."""
        end = min(run.base.size, due - 1 + run.span)
        first = run.refill_from
        if first >= end:
            return
        measuring = run.measuring
        if measuring.throttled(False):
            # While the first loads are measured, none may go before one ends: what the
            # loop below would do, without looking at the chunk (once a position, then).
            run.refill_from = max(first, due)
            return
        chunk = run.base[first:end]
        need = ~self.cache.ready_mask(chunk, tag=self._tag)
        if first < run.skip.size:
            need[:run.skip.size - first] &= ~run.skip[first:end]
        oob = ~self.cache.slot_mask(chunk)
        for j in np.flatnonzero(need):
            i, staged = int(chunk[j]), bool(oob[j])
            if i in run.pending or self._left_to_workers(i, staged):
                continue
            bound = measuring.cpu_bound()
            # (never one whose load is running already)
            if bound and run.pool.live(i) is None and measuring.stands_aside():
                self.left += 1  # the workers load it, as without a prefetcher
                continue
            if measuring.throttled(bound):
                if first + j < due:  # due now: loaded here, the training thread
                    continue  # would wait for it; the workers load it instead
                end = first + int(j)  # first see whether loading ahead pays
                break  # (never before due: a yielded index is not loaded)
            if staged:
                if run.ahead >= self._staging.most_ahead:
                    end = first + int(j)  # the staging area is the limit: stop here
                    break
                run.ahead += 1
            timed = measuring.submitted_one(bound)
            run.pending[i] = (self._submit(run.pool, i, staged, timed), staged)
        run.refill_from = end

    def _left_to_workers(self, idx: int, staged: bool) -> bool:
        """Whether the miss ``idx`` is never loaded ahead: the DataLoader's workers load it
        (once, where the cache of open sizes refused it)."""
        return staged and not self._staging.most_ahead or idx in self._refusals

    def _wait_due(self, run: "_EpochLoads", ids: list[int]) -> None:
        """Wait for the loads of ``ids``, the positions yielded now, submitted ahead."""
        for idx in ids:
            got = run.pending.pop(idx, None)
            if got is not None:
                job, staged = got
                job.mark_due()  # a sample waiting for a staging slot must not wait
                self._wait(idx, job, run.pool)
                run.ahead -= staged

    def _end_epoch(self, run: "_EpochLoads") -> None:
        """However the epoch's iterator ended: stop its loads, give back what was staged
        ahead and never yielded, and log what was left to the DataLoader or dropped."""
        run.pool.stop()  # threads end; processes stay, their queued jobs are cancelled
        if self._pool is run.pool:
            self._pool = None
        # Whatever was closed first (the cache, the prefetcher, the interpreter), the
        # clean-up is quiet; once the prefetcher's finalizer has run, nothing is left to
        # give back and the cache's descriptor may be gone.
        self._staging.settle()  # no thread of this epoch stages after this
        if not self._staging.closed:
            with contextlib.suppress(ValueError, OSError):  # the cache may be closed
                self._refusals.note_arena(clear_refused=False)
                self._staging.unstage(  # loaded ahead and never yielded
                    i for i, (_, staged) in run.pending.items() if staged)
        if self.left > run.left_before:
            logger.info(
                "stocaching: the prefetcher left %d misses of this epoch to the DataLoader: "
                "its loads were CPU-bound (%s), so loading them ahead could not save time, "
                "only cost it; see 'Standing aside' in docs/prefetch.md",
                self.left - run.left_before, self._load_times)
        if self.dropped > run.dropped_before:
            logger.warning(
                "stocaching: %d samples the prefetcher loaded this epoch found no free "
                "staging slot by the time the DataLoader needed them, and the DataLoader "
                "loaded them again (in its workers, or in this process with num_workers=0): "
                "staging_slots (%d, shared by %d local ranks) is smaller than the lead plus "
                "what the DataLoader holds; see 'Sizing staging_slots' in docs/prefetch.md: "
                "2 x ranks x (1 - f) x max(window + lookahead, (num_workers x "
                "prefetch_factor + 1) x batch_size)", self.dropped - run.dropped_before,
                self._staging.slots, self.cache.world.local_world_size)

    def _submit(self, pool: "_Loaders", idx: int, staged: bool, timed: bool) -> "_Job":
        """A load of ``idx``: the one still running from an earlier epoch, or a new one
        (timed by its loader when ``timed``: see ``_TIME_EVERY``)."""
        job = pool.live(idx)
        if job is not None and job.staged == staged:
            return job
        return pool.submit(idx, staged, timed)

    def _fetch(self, job: "_Job", stop: threading.Event, meter: "_WaitMeter") -> None:
        """Load one sample and store it; runs in a loader thread."""
        idx = job.idx
        t0 = meter.now() if job.timed else None
        # An index without a slot may have its row on the cache's disk tier: read, not loaded
        value = self.cache.read_tier(idx) if job.staged else None
        if value is None:
            value = self.load(idx)
        self._load_times.add(meter.since(t0))
        if not job.staged:
            self.cache.set_slot(idx, value, exist_ok=True)
            self._refusals.add_unless_stored(idx)
        else:
            # Full: the DataLoader frees staging slots as its workers read what was
            # yielded. Once the index is due, waiting could only deadlock (the slots may
            # all be held by the batch being assembled): the workers load it instead.
            while True:
                staged = self._staging.stage(idx, value, stop)
                if staged is None:  # the epoch (or the prefetcher) is over: not staged
                    return
                if staged:
                    break
                if job.due:
                    with self._lock:
                        self.dropped += 1
                    return
                if stop.wait(0.002):  # the epoch was abandoned
                    return
        with self._lock:
            self.loaded += 1

    def _wait(self, idx: int, job: "_Job", pool: "_Loaders") -> None:
        """Wait for the load of ``idx``. A job cancelled meanwhile (queued by an epoch that
        was abandoned, and never started) is submitted again; a loader process that died
        is reported as soon as it is seen, not at the timeout."""
        deadline = time.monotonic() + self.timeout
        def closed() -> PrefetchError:
            return PrefetchError(f"load({idx}): the prefetcher was closed (close()) while this "
                                 f"iterator ran", idx)

        while True:
            if pool.stopped and not job.done():  # (a job the pool will never run)
                raise closed()
            if not job.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                dead = pool.dead()
                if dead:
                    raise PrefetchError(f"load({idx}): a loader process of the prefetcher "
                                        f"died ({dead}); the loads it held are lost", idx)
                if time.monotonic() >= deadline:
                    raise PrefetchError(f"load({idx}) did not finish within timeout="
                                        f"{self.timeout:g} s (prefetcher)", idx)
                continue
            outcome = job.outcome
            if outcome is _Job.DONE:
                return
            if outcome is _Job.CANCELLED:
                if pool.stopped:  # (cancelled by the stop)
                    raise closed()
                job = pool.submit(idx, job.staged, job.timed)
                job.mark_due()
                pool.flush()
                continue
            if isinstance(outcome, (KeyboardInterrupt, SystemExit)):
                raise outcome
            raise PrefetchError(f"load({idx}) failed in the prefetcher: "
                                f"{type(outcome).__name__}: {outcome}", idx) from outcome


class _DistributedPrefetcher(Prefetcher, _OverDistributed):
    """A ``Prefetcher`` over a ``DistributedSampler``: one too (see ``_OverDistributed``)."""

    def _distributed_base(self) -> torch.utils.data.DistributedSampler:
        return self._recording.base

    @property
    def epoch(self) -> int:
        """The base sampler's ``epoch``."""
        return self._recording.base.epoch


# ----------------------------------------------------------------------------------------------
# 4. Staging: the samples a prefetcher staged, given back however an epoch ends
# ----------------------------------------------------------------------------------------------


class _Staging:
    """A prefetcher's use of the cache's staging slots: its tag, how many samples it may keep
    staged ahead, the indices its loads staged, and how many stages are under way. A loader
    thread stages only while its epoch (``stop``) and the prefetcher (``closed``) go on, so
    that once both are over and :meth:`settle` has returned, nothing more is staged by a
    thread and the give-back finds everything. What it staged is tagged with a number of its
    own (``tag``), so that it gives back only its own samples (another rank's prefetcher may
    stage the same index)."""

    SETTLE_S = 10.0  # a stage is a copy into shared memory: far less, unless the lock hangs

    # configuration
    cache: BaseCache
    tag: int
    most_ahead: int  # staged ahead of what was yielded at most: the prefetcher's stage_ahead
    slots: int  # the cache's staging slots, shared by its local ranks
    # what it staged, guarded by cond
    cond: threading.Condition
    indices: set[int]
    busy: int  # stages under way
    closed: bool  # the prefetcher is gone: no thread stages any more

    def __init__(self, cache: BaseCache, tag: int) -> None:
        self.cache, self.tag = cache, tag
        self.slots = cache.staging_slots
        self.most_ahead = self.slots // (2 * cache.world.local_world_size)
        self.cond = threading.Condition()
        self.indices = set()
        self.busy = 0
        self.closed = False

    def stage(self, idx: int, value: Any, stop: threading.Event) -> bool | None:
        """``cache.stage``'s answer, or None (nothing staged) once the epoch or the
        prefetcher is over."""
        with self.cond:
            if stop.is_set() or self.closed:
                return None
            self.busy += 1
        done = False
        try:
            done = self.cache.stage(idx, value, tag=self.tag)
        finally:
            with self.cond:
                self.busy -= 1
                if done:
                    self.indices.add(idx)
                self.cond.notify_all()
        return done

    def add(self, idx: int) -> None:
        """Count ``idx`` as staged (by a loader process)."""
        with self.cond:
            self.indices.add(idx)

    def take(self) -> set[int]:
        with self.cond:
            taken, self.indices = self.indices, set()
        return taken

    def settle(self) -> None:
        """Wait until no stage is under way."""
        with self.cond:
            self.cond.wait_for(lambda: self.busy == 0, self.SETTLE_S)

    def give_back_unread(self) -> None:
        """Give back what was staged last epoch, yielded and never read."""
        staged = self.take()
        if staged:
            staged_idx = np.fromiter(staged, dtype=np.int64, count=len(staged))
            for idx in staged_idx[self.cache.ready_mask(staged_idx, tag=self.tag)].tolist():
                self.cache.unstage(idx, tag=self.tag)

    def unstage(self, indices: Iterator[int]) -> None:
        """Give back the samples of ``indices`` (staged ahead and never yielded)."""
        for idx in indices:
            self.cache.unstage(idx, tag=self.tag)

    def give_back_all(self, final: bool = True) -> None:
        """Free every staging slot that holds a sample staged with this tag (found in the
        staging map, so that loads whose result has not been seen are included), once the
        stages under way are done; with ``final`` (the prefetcher is gone, or the program
        ends), no loader thread stages anything afterwards. Quiet whatever was closed
        first."""
        if final:
            with self.cond:
                self.closed = True
        self.settle()
        self.take()
        _unstage_tagged(self.cache, self.tag)


def _unstage_tagged(cache: BaseCache, tag: int) -> None:
    """Free every staging slot that holds a sample staged with ``tag``; quiet when the
    cache is closed."""
    with contextlib.suppress(ValueError, OSError):  # the cache may be closed by now
        oob = np.flatnonzero(~cache.slot_mask())
        for idx in oob[cache.ready_mask(oob, tag=tag)].tolist():
            cache.unstage(idx, tag=tag)


# ----------------------------------------------------------------------------------------------
# 5. What a cache of open sizes refused
# ----------------------------------------------------------------------------------------------


class _ArenaRefusals:
    """The indices whose loaded sample a cache of open sizes did not keep (its arena full),
    which the prefetcher leaves to the DataLoader's workers from the next epoch on: loaded
    ahead, each would be refused again and a worker would load it a second time. A
    ``clear()``, the only way the arena's use goes down, gives room back: they are loaded
    ahead again. (Seen as less in use than the most seen at an epoch's start or end: a
    ``clear()`` whose arena filled up again past that before the next epoch's start goes
    unseen, and those stay with the workers.) Nothing, for a cache of fixed sizes."""

    cache: BaseCache
    may_refuse: bool  # a cache of open sizes
    refused: np.ndarray  # a bool an index (none for a cache of fixed sizes); guarded by lock
    most_used: int  # the most of the arena seen in use
    lock: threading.Lock

    def __init__(self, cache: BaseCache) -> None:
        self.cache, self.may_refuse = cache, cache.may_refuse
        self.refused = np.zeros(cache.dataset_len if self.may_refuse else 0, dtype=bool)
        self.most_used = 0
        self.lock = threading.Lock()

    def __contains__(self, idx: int) -> bool:
        return self.may_refuse and bool(self.refused[idx])

    def add(self, idx: int) -> None:
        if self.may_refuse:
            with self.lock:
                self.refused[idx] = True

    def add_unless_stored(self, idx: int) -> None:
        """After ``set_slot(idx, ...)``: count ``idx`` if the cache did not keep it."""
        if self.may_refuse and not self.cache.stored_mask([idx])[0]:  # no room
            self.add(idx)

    def note_arena(self, clear_refused: bool) -> None:
        """Keep the most of the arena seen in use; with ``clear_refused``, forget the refused
        indices if less is in use now (a clear())."""
        if not self.may_refuse:
            return
        used = self.cache.arena_used
        if clear_refused and used < self.most_used:
            with self.lock:
                self.refused[:] = False
            self.most_used = used
        else:
            self.most_used = max(self.most_used, used)


# ----------------------------------------------------------------------------------------------
# 6. The prefetcher's own resume, for a base that cannot record a position
# ----------------------------------------------------------------------------------------------


class _ResumeBySkipping:
    """The resume of a base that cannot record a position (no ``state_dict(consumed=...)``),
    without a window: the prefetcher's own state says how many indices of the epoch's base
    order were used, with a fingerprint of that order, and a resume takes the base's epoch
    again and skips them (the base's epoch must be reproducible: seeded, ``set_epoch``, or its
    generator's state restored, see ``_generator_of``; another order is refused). The
    generator fields are not required: older states lack them."""

    FIELDS = ("epoch", "consumed", "len", "base", "order_digest")

    recording: _RecordingSampler  # the prefetcher's base order
    loaded: dict | None  # the state loaded, which the next iterator skips to

    def __init__(self, recording: _RecordingSampler) -> None:
        self.recording = recording
        self.loaded = None

    def take(self) -> dict | None:
        """The state loaded, for the iterator that starts now (then forgotten)."""
        loaded, self.loaded = self.loaded, None
        return loaded

    def discard(self, epoch: int) -> None:
        """``set_epoch(epoch)`` of another epoch than the one loaded: its position is
        discarded (with a warning, at the caller of ``set_epoch``, if it was mid-epoch), and
        the base's generator goes on from after the loaded epoch."""
        loaded = self.take()
        if loaded is not None:  # the loaded epoch is not drawn again: go on from after it
            warn_position_discarded(epoch, loaded["epoch"], loaded["consumed"], loaded["len"],
                                    stacklevel=3)
            _set_generator_state(self.recording.base, _checked_generator_state(
                self.recording.base, loaded, "generator_after"))  # (checked when loaded)

    def state(self, epoch: int | None, consumed: int | None, started: bool
              ) -> dict[str, Any]:
        """The state at ``consumed`` of ``epoch``; ``started``: whether an iterator of this
        epoch has started."""
        n, loaded = len(self.recording.base), self.loaded
        if consumed is not None:
            consumed = check_int("consumed", consumed, low=0, high=n)
        if not started:
            if loaded is not None:
                if consumed is not None and consumed != loaded["consumed"]:
                    raise ValueError(f"consumed should be {loaded['consumed']} (the position "
                                     f"loaded by load_state_dict; no iterator has run since), "
                                     f"but got consumed={consumed}")
                return dict(loaded)
            if consumed:
                raise ValueError(f"consumed should be 0: no iterator of this epoch has run, "
                                 f"but got consumed={consumed}")
            return {"epoch": epoch, "consumed": 0, "len": n,
                    "base": self.recording.state_now(), "order_digest": None,
                    "generator": _generator_state(self.recording.base),
                    "generator_after": None}
        before, after = self.recording.generators
        return {"epoch": epoch, "consumed": consumed, "len": n,
                "base": self.recording.start_state, "order_digest": self.recording.digest,
                "generator": before, "generator_after": after}

    def load(self, state: Mapping[str, Any]) -> None:
        """Check ``state`` and set the base to the start of its epoch; the next iterator
        skips to its position."""
        base = self.recording.base
        check_state_fields(state, "Prefetcher", self.FIELDS,
                           detail=f" (without a window, over {type(base).__name__})")
        n = len(base)
        refuse_changed_fields(state, {"len": n}, ("len",), owner="prefetcher", consequence=(
            f"; if it was saved on another world: its base sampler ({type(base).__name__}) "
            f"gives each rank an order that depends on the world, so another world cannot "
            f"resume it; make the base a CacheAwareSampler (or WeightedMixtureSampler), whose "
            f"order does not depend on the world"))
        consumed = check_int("state['consumed']", state["consumed"], low=0, high=n)
        epoch = state["epoch"]
        if epoch is not None:
            epoch = check_int("state['epoch']", epoch, low=0)
        digest = state["order_digest"]
        if digest is not None and not isinstance(digest, str) or digest is None and consumed:
            raise ValueError(f"state['order_digest'] should be a str for consumed={consumed}, "
                             f"but got state['order_digest']={digest!r}")
        generator = _checked_generator_state(base, state, "generator")
        _checked_generator_state(base, state, "generator_after")
        if state["base"] is not None and hasattr(base, "load_state_dict"):
            base.load_state_dict(state["base"])
        elif epoch is not None and hasattr(base, "set_epoch"):
            base.set_epoch(epoch)
        _set_generator_state(base, generator)
        self.loaded = dict(state, consumed=consumed, epoch=epoch) if digest else None


# ----------------------------------------------------------------------------------------------
# 7. An epoch's loads, and a load
# ----------------------------------------------------------------------------------------------


class _EpochLoads:
    """The state of one epoch's iterator (``Prefetcher._iter_loaded``): where it is in the
    base order, the loads it submitted ahead, and its measuring of the loads
    (:class:`_EpochMeasuring`). Its steps are the prefetcher's (``_refill``, ``_wait_due``,
    ``_end_epoch``)."""

    __slots__ = ("base", "pos", "skip", "refill_from", "span", "pool", "pending", "ahead",
                 "measuring", "dropped_before", "left_before")

    # where it is in the base order
    base: np.ndarray  # the epoch's base order (this process's positions)
    pos: int  # the base position yielded next
    skip: np.ndarray  # base positions [0, skip.size) yielded before a resume: not loaded again
    refill_from: int  # the base position the next refill looks at first
    span: int  # positions loaded ahead of the last one due: the prefetcher's loads_ahead
    # its loads
    pool: "_Loaders"
    pending: dict[int, tuple["_Job", bool]]  # index -> (its load, staged or not)
    ahead: int  # staged loads submitted and not yet yielded
    measuring: _EpochMeasuring
    # the prefetcher's counters at the start, for the epoch's log lines
    dropped_before: int
    left_before: int

    def __init__(self, base: np.ndarray, pos: int, skip: np.ndarray, span: int,
                 pool: "_Loaders", measuring: _EpochMeasuring, *, dropped: int,
                 left: int) -> None:
        self.base, self.pos, self.skip, self.span = base, pos, skip, span
        self.refill_from = int(np.argmin(skip)) if skip.size and not skip.all() else skip.size
        self.pool, self.pending, self.ahead = pool, {}, 0
        self.measuring = measuring
        self.dropped_before, self.left_before = dropped, left


class _Job:
    """One load: the index, whether its sample goes to a staging slot, whether its loader
    times it (``timed``, for standing aside: see ``_TIME_EVERY``), its ``outcome`` once
    it ended (``DONE``, ``CANCELLED`` or the exception it raised; set once, by ``end``), and
    ``due``, set (by ``mark_due``) once the iterator needs the index now. The iterator
    waits for it (``wait``); were two threads to wait at once (an abandoned epoch's iterator
    still waiting in another thread), one of them would see the end only at its timeout.
    Not a concurrent.futures.Future: see docs/design.md, "The prefetcher's machinery per
    load"."""

    __slots__ = ("idx", "staged", "timed", "outcome", "_waiter", "due", "flag", "due_flag")

    DONE, CANCELLED = "done", "cancelled"

    def __init__(self, idx: int, staged: bool, timed: bool = True) -> None:
        self.idx, self.staged, self.timed = idx, staged, timed
        self.outcome: Any = None
        self._waiter: threading.Lock | None = None  # held while the iterator waits
        self.due = False  # (a plain flag: see docs/design.md, "The loaders' small shapes")
        # Tells a loader process too (set by _ProcessLoaderPool.submit when it has a flag).
        self.flag: Callable[[], None] | None = None
        self.due_flag = -1  # its entry in the due flags (processes=N); -1: none, or given back

    def done(self) -> bool:
        return self.outcome is not None

    def end(self, outcome: Any) -> None:
        """The job ended with ``outcome``; wakes the iterator if it waits. Once only."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        waiter = self._waiter
        if waiter is not None:
            waiter.release()

    def wait(self, timeout: float) -> bool:
        """Whether the job ended, waiting up to ``timeout`` seconds for it. (The waiter is
        made and taken before ``outcome`` is looked at again: an ``end`` in between either
        sees it and releases it, or came first and is seen.)"""
        if self.outcome is None:
            waiter = self._waiter
            if waiter is None:
                waiter = threading.Lock()
                waiter.acquire()
                self._waiter = waiter
            if self.outcome is None:
                waiter.acquire(timeout=timeout)
        return self.outcome is not None

    def mark_due(self) -> None:
        self.due = True
        if self.flag is not None:
            self.flag()


# ----------------------------------------------------------------------------------------------
# 8. The loaders: threads
# ----------------------------------------------------------------------------------------------


def _halt_threads(stop: threading.Event, jobs: queue.SimpleQueue,
                  threads: list[threading.Thread], timeout: float = 10.0) -> None:
    """Stop a loader pool's threads and wait, up to ``timeout`` in all, for the loads they
    run (a load that hangs on storage must not hold the exit for long)."""
    stop.set()
    for _ in threads:
        jobs.put(None)
    deadline = time.monotonic() + timeout
    for t in threads:
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


class _Loaders:
    """What a prefetcher asks of its loaders, threads (:class:`_LoaderPool`) or processes
    (:class:`_ProcessLoaderPool`): ``submit(idx, staged, timed)`` a load (timed by its
    loader or not) and get its :class:`_Job`, which the iterator waits for; ``flush()`` once
    the jobs of a refill are submitted; ``live(idx)``, a load of ``idx`` still running from
    an earlier epoch, which the next epoch waits for instead of loading it again; ``stop()``
    at the end of an epoch (its jobs not started are cancelled); ``stopped``, whether a job
    not done yet will never run; ``dead()``, the loaders that died."""

    def submit(self, idx: int, staged: bool, timed: bool = True) -> _Job:
        raise NotImplementedError

    def flush(self) -> None:
        """Hand over the jobs submitted since the last flush, which a pool may hold back
        until then so that the jobs of one refill go out together (processes: one message
        each). The default holds none back: a loader thread takes each job as it is
        submitted."""

    def live(self, idx: int) -> _Job | None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def stopped(self) -> bool:
        raise NotImplementedError

    def dead(self) -> str:
        """The loaders that died, as text; '' if none (the default: threads do not die)."""
        return ""


class _LoaderPool(_Loaders):
    """Daemon threads running ``fetch(job, stop, meter)`` for submitted jobs, in the order
    submitted; ``stop()`` lets each finish its current load and go, and cancels the jobs
    that no thread has started. ``running`` (guarded by ``lock``) holds the loads running
    in a loader thread, of this pool or an earlier epoch's: see ``live``."""

    def __init__(self, n: int, fetch: Callable[[_Job, threading.Event, "_WaitMeter"], None],
                 running: dict[int, _Job], lock: threading.Lock) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._fetch = fetch
        self._running, self._lock = running, lock
        # Started one per job submitted, up to n: an epoch whose samples are all cached
        # starts none. See docs/design.md, "The loaders' small shapes".
        self._most = n
        self._threads: list[threading.Thread] = []
        # At interpreter exit, stop the threads and wait for their current loads: a daemon
        # thread still inside a load (torch's C++) when the interpreter finalizes is ended by
        # pthread_exit, whose unwinding through C++ aborts the process ("terminate called
        # without an active exception", seen once in a full CI run). The threads drop their
        # target when they end, so this does not keep a finished pool alive.
        weakref.finalize(self, _halt_threads, self._stop, self._jobs, self._threads)

    def submit(self, idx: int, staged: bool, timed: bool = True) -> _Job:
        job = _Job(idx, staged, timed)
        self._jobs.put(job)
        if len(self._threads) < self._most:
            thread = threading.Thread(target=self._run, daemon=True,
                                      name=f"stocaching-prefetch-{len(self._threads)}")
            self._threads.append(thread)
            thread.start()
        return job

    def live(self, idx: int) -> _Job | None:
        """The load of ``idx`` running in a loader thread, of this pool or an earlier one."""
        with self._lock:
            return self._running.get(idx)

    def _run(self) -> None:
        meter = _WaitMeter()
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                if self._stop.is_set():
                    job.end(_Job.CANCELLED)
                    continue
                try:
                    self._load(job, meter)
                except BaseException as e:  # handed to the iterator, which raises it
                    job.end(e)
                else:
                    job.end(_Job.DONE)
        finally:
            meter.close()

    def _load(self, job: _Job, meter: "_WaitMeter") -> None:
        """Run ``fetch`` for ``job``, which is in ``running`` meanwhile."""
        with self._lock:
            self._running[job.idx] = job
        try:
            self._fetch(job, self._stop, meter)
        finally:
            with self._lock:
                if self._running.get(job.idx) is job:
                    del self._running[job.idx]

    def stop(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._jobs.put(None)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


# ----------------------------------------------------------------------------------------------
# 9. The loaders: processes
# ----------------------------------------------------------------------------------------------


def _unpicklable_load(load: Any, ctx: Any, error: BaseException) -> TypeError:
    return TypeError(f"load should be picklable to start loader processes with "
                     f"multiprocessing_context={ctx.get_start_method()!r} (a function, or a "
                     f"bound method of a picklable dataset, defined at the top level of a "
                     f"module; or use 'fork'), but got load={load!r}: "
                     f"{type(error).__name__}: {error}")


class _ProcessLoaderPool(_Loaders):
    """Loader processes for ``Prefetcher(processes=N)``: each runs the user's ``load`` in its
    loader threads and stores the result in the cache itself (``set_slot``, or ``stage``
    until the index is due). Jobs and results travel in batches: ``submit`` collects jobs and
    ``flush`` sends each to the least busy live process, one message to each; in a process, one
    thread hands them to the loader threads and another sends back, in one message, every
    result that is ready (see docs/design.md, "The loaders' small shapes"). A thread of this
    process turns results into the jobs' outcomes. Jobs of an abandoned epoch that no process
    has started are cancelled (an epoch counter in shared memory); the processes stay for the
    next epoch."""

    def __init__(self, owner: "Prefetcher", cache: BaseCache, load: Callable[[int], Any],
                 processes: int, threads: int, flags: int, ctx: Any, *, tag: int,
                 settled: Callable[[], Callable[[int, str, Any], None] | None]) -> None:
        """``processes`` loader processes of ``threads`` threads each, running ``load`` and
        storing into ``cache``; they end with ``owner`` (or ``close()``)."""
        if ctx.get_start_method() != "fork":  # refused before anything starts (queues, too)
            try:
                multiprocessing.reduction.ForkingPickler.dumps(load)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise _unpicklable_load(load, ctx, e) from e
        self._jobs = [ctx.SimpleQueue() for _ in range(processes)]  # one a process
        self._results = ctx.SimpleQueue()
        self._batch: list[tuple] = []  # submitted, not sent yet
        self._busy = [0] * processes  # jobs sent to each process, results not back
        # A live job's "due now" flag, one entry each: an entry is taken at submit and given
        # back when the job's last message has come (its process reads it no more by then).
        # A job submitted while all are taken gets none and counts as due from the start.
        # Beside it, whether a loader process has begun the job (for ``live``).
        self._due, self._started = ctx.RawArray("b", flags), ctx.RawArray("b", flags)
        self._free_flags = list(range(flags))
        self._epoch = ctx.RawValue("q", 0)
        self._next_id = 0
        self._live: dict[int, _Job] = {}  # job id -> job, until its result came
        self._by_idx: dict[int, _Job] = {}  # index -> its latest job, while it lives
        self._lock = threading.Lock()
        self._settled = settled  # the prefetcher's counts of a result, while it lives
        self._procs = [ctx.Process(target=_load_in_process, name=f"stocaching-prefetch-{k}",
                                   args=(cache, load, tag, self._jobs[k],
                                         self._results, self._due, self._started,
                                         self._epoch, threads, os.getpid(), k),
                                   daemon=True)
                       for k in range(processes)]
        try:
            for p in self._procs:
                p.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            for p in self._procs:  # those started already
                if p.pid is not None:
                    p.kill()
                    p.join()
            if ctx.get_start_method() == "fork":
                raise
            raise _unpicklable_load(load, ctx, e) from e
        self._reader = threading.Thread(target=self._read, name="stocaching-prefetch-results",
                                        daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(owner, _ProcessLoaderPool._shut, self._procs,
                                           self._jobs, self._results)

    def submit(self, idx: int, staged: bool, timed: bool = True) -> _Job:
        with self._lock:
            j, self._next_id = self._next_id, self._next_id + 1
            flag = self._free_flags.pop() if self._free_flags else -1
            job = _Job(idx, staged, timed)
            if flag >= 0:
                self._due[flag] = self._started[flag] = 0
                job.flag = functools.partial(self._mark_due, job)
            job.due_flag = flag
            self._live[j] = self._by_idx[idx] = job
            self._batch.append((j, idx, staged, timed, self._epoch.value, flag))
        return job

    def flush(self) -> None:
        """Send the jobs submitted since the last flush, each to the live process with the
        fewest jobs not finished, one message a process. None goes to a dead process, whose
        pipe would fill up and block this call for good; with none alive, nothing is sent and
        the iterator's wait reports the dead processes."""
        if not self._batch:  # (most positions: is_alive() is a system call a process)
            return
        with self._lock:
            batch, self._batch = self._batch, []
            alive = [k for k, p in enumerate(self._procs) if p.is_alive()]
            share: dict[int, list] = {k: [] for k in alive}
            for job in batch if alive else ():
                k = min(alive, key=self._busy.__getitem__)  # the least busy (first of equals)
                share[k].append(job)
                self._busy[k] += 1
        for k, jobs in share.items():
            if jobs:
                self._jobs[k].put(jobs)

    def _mark_due(self, job: _Job) -> None:
        """Set the due flag of ``job`` if it still holds one: the iterator also marks jobs
        that finished long before, whose flag may belong to a later job by then."""
        with self._lock:
            if job.due_flag >= 0:
                self._due[job.due_flag] = 1

    def _read(self) -> None:
        while True:
            msg = self._results.get()
            if msg is None:
                return
            sender, batch = msg
            with self._lock:
                self._busy[sender] -= len(batch)
            for msg in batch:
                self._settle(*msg)  # (its locals must not keep the prefetcher alive meanwhile)

    def _settle(self, j: int, kind: str, payload: Any) -> None:
        """Turn one result of a loader process into its job's outcome."""
        with self._lock:
            job = self._live.pop(j, None)
            if job is not None and self._by_idx.get(job.idx) is job:
                del self._by_idx[job.idx]
            if job is not None and job.due_flag >= 0:
                self._free_flags.append(job.due_flag)
                job.due_flag = -1  # no longer its own: _mark_due must not touch it
        if job is None:
            return
        if kind == "cancelled":
            job.end(_Job.CANCELLED)
            return
        if kind in ("stored", "refused", "staged", "dropped"):
            settled = self._settled()
            if settled is not None:
                settled(job.idx, kind, payload)
        if kind == "error":
            name, text, tb = payload
            job.end(RuntimeError(f"{name}: {text}\n\nTraceback in the loader process:\n{tb}"))
        else:
            job.end(_Job.DONE)

    def live(self, idx: int) -> _Job | None:
        """The latest job of ``idx`` if a loader process has started it and its result has
        not come yet (a job only queued by an abandoned epoch will be cancelled: not that;
        nor a job without a due flag, whose start is not known)."""
        with self._lock:
            job = self._by_idx.get(idx)
            if job is not None and job.due_flag >= 0 and self._started[job.due_flag]:
                return job
        return None

    def stop(self) -> None:
        """The epoch's iterator ended: jobs not started yet are cancelled."""
        self._epoch.value += 1

    def dead(self) -> str:
        """The loader processes that died, as text ('' if none)."""
        return ", ".join(f"pid {p.pid} exit code {p.exitcode}" for p in self._procs
                         if not p.is_alive())

    def close(self) -> None:
        self._epoch.value += 1
        self._finalizer()

    @property
    def stopped(self) -> bool:
        """Closed: its processes are gone."""
        return not self._finalizer.alive

    @staticmethod
    def _shut(procs: list, jobs: list, results: Any) -> None:
        for q, p in zip(jobs, procs):  # each live process's threads end
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    q.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        with contextlib.suppress(OSError, ValueError):
            results.put(None)  # the reader thread ends


def _load_in_process(cache: BaseCache, load: Callable[[int], Any], tag: int, jobs: Any,
                     results: Any, due: Any, started: Any, epoch: Any, threads: int,
                     parent: int, me: int) -> None:
    """A loader process of ``Prefetcher(processes=N)``: ``threads`` loader threads, fed the
    jobs of this process's batches by this thread until a None comes, and a thread that sends
    their results back in batches."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process
    torch.set_num_threads(1)
    mine: queue.SimpleQueue = queue.SimpleQueue()  # jobs, for this process's threads
    done: queue.SimpleQueue = queue.SimpleQueue()  # their results, to send
    loaders = [threading.Thread(target=_load_jobs, name=f"stocaching-prefetch-{k}",
                                args=(cache, load, tag, mine, done, due, started, epoch),
                                daemon=True) for k in range(threads)]
    sender = threading.Thread(target=_send_results, args=(done, results, me),
                              name="stocaching-prefetch-send", daemon=True)
    for t in loaders + [sender]:
        t.start()
    while True:
        batch = jobs.get()
        if batch is None:  # every loader thread ends
            for _ in range(threads):
                mine.put(None)
            break
        for job in batch:
            mine.put(job)
    for t in loaders:
        t.join()
    # The prefetcher is closing: what this process staged is of no use any more, and the
    # training process may not be able to give it back (its cache closed first).
    _unstage_tagged(cache, tag)
    done.put(None)
    sender.join()


def _send_results(done: queue.SimpleQueue, results: Any, me: int) -> None:
    """Send the results of this process's loader threads, as ``(me, [result, ...])``: each
    message holds every result ready by then (one, when loads finish one by one), until a
    None comes."""
    while True:
        batch = [done.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                batch.append(done.get_nowait())
        end = batch[-1] is None
        if len(batch) > end:
            results.put((me, batch[:len(batch) - end]))
        if end:
            return


def _load_jobs(cache: BaseCache, load: Callable[[int], Any], tag: int, jobs: Any,
               results: Any, due: Any, started: Any, epoch: Any) -> None:
    """One loader thread of a loader process: takes jobs from ``jobs`` and puts each result
    in ``results`` (this process's queues), with how long the load waited and the CPU it used
    (see :class:`_WaitMeter`) if the job is timed, else None."""
    meter = _WaitMeter()
    while True:
        msg = jobs.get()
        if msg is None:
            meter.close()
            return
        j, idx, staged, timed, ep, flag = msg
        if ep != epoch.value:
            results.put((j, "cancelled", None))
            continue
        if flag >= 0:
            started[flag] = 1
        try:
            t0 = meter.now() if timed else None
            value = cache.read_tier(idx) if staged else None  # (see Prefetcher._fetch)
            if value is None:
                value = load(idx)
            times = meter.since(t0)
            if not staged:
                cache.set_slot(idx, value, exist_ok=True)
                kind = "refused" if cache.may_refuse and not cache.stored_mask([idx])[0] \
                    else "stored"
            else:
                kind = "staged"
                while not cache.stage(idx, value, tag=tag):
                    is_due = flag < 0 or due[flag]
                    if is_due or ep != epoch.value:
                        kind = "dropped" if is_due else "cancelled"
                        break
                    time.sleep(0.002)
            results.put((j, kind, times))
        except BaseException as e:  # noqa: B902 - handed to the training process
            results.put((j, "error", (type(e).__name__, str(e), traceback.format_exc())))


def _die_with_parent(parent: int) -> None:
    """End with the training process ``parent``, even when it is killed by SIGKILL: the
    kernel kills this process with its parent (``PR_SET_PDEATHSIG``, Linux) when that parent is
    the training process; otherwise (started by a fork server, whose process is the parent, or
    not on Linux) a thread checks every half second that the training process still lives, and
    ends this process when it does not. Gone already: end now."""
    deathsig = False
    with contextlib.suppress(Exception):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        deathsig = libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    if deathsig and os.getppid() == parent:
        return
    if not _lives(parent):
        os._exit(0)
    threading.Thread(target=_watch, args=(parent,), name="stocaching-prefetch-watch",
                     daemon=True).start()


def _watch(parent: int) -> None:
    while _lives(parent):
        time.sleep(0.5)
    os._exit(0)


def _lives(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # (no /proc: it answered the signal)
