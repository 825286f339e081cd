"""Batches of cached samples gathered straight onto the training device.

A ``DataLoader`` copies a cached sample several times on its way to the GPU (out of the
segment in a worker, into a collated batch, through the worker queue, into pinned memory, then
to the device), and on a GPU machine that CPU path, not the cache, sets the pace once the data
is cached. :class:`DeviceLoader` replaces it for the samples of a :class:`SharedCache`: the
training process gathers each batch from the segment itself. On CUDA the segment is registered
with the driver (page-locked in place) and the GPU reads the batch's rows from it directly, on a
side stream; elsewhere (a CPU, or where registering is refused) ``get_batch`` gathers the batch
in a background thread (into pinned buffers copied to the device, for a GPU). Misses are loaded
ahead by a :class:`Prefetcher` into the cache or its staging slots, so that every row of a batch
is read from the segment.

Example::

    cache = SharedCache(size_limit_gib=32, dataset_len=len(paths), data_dims=(3, 256, 256),
                        staging_slots=4096)
    loader = DeviceLoader(cache, RandomSampler(range(len(paths))), load=decode,
                          batch_size=256, device="cuda", transform=augment_on_gpu)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, indices in loader:        # both on the GPU
            loss = step(model, images, labels_on_gpu[indices])

This module imports only the core's public names and the prefetcher, so copying
``stocaching.py``, ``prefetch.py`` and this file into a project works.
"""

from __future__ import annotations

__all__ = ["DeviceLoader"]

import collections
import contextlib
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

try:  # the package, or the modules copied side by side into a project
    from .prefetch import Prefetcher
    from .stocaching import OpenSizeCache, SharedCache, check_int
except ImportError:  # pragma: no cover - the copied-files layout
    from prefetch import Prefetcher  # type: ignore[no-redef]
    from stocaching import (OpenSizeCache, SharedCache,  # type: ignore[no-redef]
                            check_int)

logger = logging.getLogger("stocaching")

# -- the gathers: start(indices) -> ticket, finish(ticket) -> (batch, confirmed, indices) -----
#
# A gather is started, then finished (the rows it read confirmed, which frees their staging
# slots); ``ahead`` more gathers may be started before the oldest is finished, so that a GPU's
# copy of one batch runs while the CPU locates the next.

def _empty_batch(cache: SharedCache, n: int, pin: bool = False) -> Any:
    row = cache.get_batch([])[0]  # an empty batch of the cache's dims and dtype(s)
    if isinstance(row, Mapping):
        return {name: torch.empty((n, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                for name, t in row.items()}
    return torch.empty((n, *row.shape[1:]), dtype=row.dtype, pin_memory=pin)


def _rows_of(batch: Any, n: int) -> Any:
    if isinstance(batch, Mapping):
        return {name: t[:n] for name, t in batch.items()}
    return batch[:n]

class _HostGather:
    """``get_batch`` into new tensors (a CPU device): each batch is the caller's to keep.

    The tensors are made by the caller's thread (``replenish``), which is also where they are
    freed: made in the loader's thread and freed in another, each batch's memory came back
    from the kernel page by page (the thread's malloc arena gives freed memory back), 160 us
    for a 192 KiB batch, more than gathering it."""

    rereads = True  # get_batch reads a raced row again alone: what it misses is a miss
    ahead = 0

    def __init__(self, cache: SharedCache, batch_size: int, most: int) -> None:
        self.cache, self.batch_size, self.most = cache, batch_size, most
        self.blanks: queue.SimpleQueue = queue.SimpleQueue()

    def context(self) -> Any:
        return contextlib.nullcontext()

    def replenish(self) -> None:
        """Make the tensors of a batch to come, unless ``most`` wait already (an epoch that
        ends leaves its unused ones for the next)."""
        if self.blanks.qsize() < self.most:
            self.blanks.put(_empty_batch(self.cache, self.batch_size))

    def start(self, idx: np.ndarray) -> Any:
        try:
            blank = self.blanks.get_nowait()
        except queue.Empty:
            blank = _empty_batch(self.cache, self.batch_size)
        batch, hit = self.cache.get_batch(idx, out=_rows_of(blank, len(idx)))
        return batch, hit.numpy(), torch.from_numpy(idx)

    def finish(self, ticket: Any) -> tuple[Any, np.ndarray, torch.Tensor]:
        return ticket

    def ready(self) -> None:
        return None

    def close(self) -> None:
        pass



# -- the CUDA part: register the segment, view it from the device, gather on a side stream --

_PAGE = 4096


class _HostPointer:
    """Rows of registered host memory as a CUDA array (``__cuda_array_interface__``): with
    unified addressing, every 64-bit Linux CUDA setup, a registered host address is valid on
    the device, so ``torch.as_tensor`` makes a CUDA tensor of it without a copy."""

    def __init__(self, address: int, shape: tuple[int, int]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None}


class _Registration:
    """One registration of a cache's segment with CUDA in this process. It ends when the
    view made of it is collected, or earlier when another segment is mapped where it was (its
    cache was closed first: the registration still pins the old pages, which the GPU would
    read in place of the new ones)."""

    def __init__(self, cache: SharedCache, start: int, end: int, device: torch.device) -> None:
        self.cache = weakref.ref(cache)
        self.start, self.end, self.device = start, end, device
        self.view: "weakref.ref[torch.Tensor] | None" = None
        self.active, self.pid = True, os.getpid()

    def close(self) -> None:
        if not self.active:
            return
        self.active = False
        _registrations.remove(self)
        if os.getpid() != self.pid:
            return  # a forked child's copy: the registration is its parent's, and CUDA too
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # no gather may still read the pages
            if int(torch.cuda.cudart().cudaHostUnregister(self.start)):
                _take_cuda_error(self.device)


# The registrations of this process, one per cache and device: a second loader over the same
# cache (a training and an evaluation loader, say) reads through the first one's, since CUDA
# refuses to register the same pages twice.
_registrations: list[_Registration] = []


def _take_cuda_error(device: torch.device) -> None:
    """A failed CUDA runtime call leaves its error to the next check in this thread, which
    torch makes after its next kernel launch and raises there, on an unrelated operation: a
    launch here, whose check takes the error."""
    with contextlib.suppress(Exception):
        torch.ones(1, device=device)


def _register(cache: SharedCache, rows: torch.Tensor, device: torch.device
              ) -> tuple[torch.Tensor | None, str]:
    """Register the pages under ``rows`` (the cache's rows, a uint8 CPU tensor viewing its
    segment) with CUDA and view them from ``device``: (the CUDA view, "") or (None, why it
    was refused). The registration ends when no view of it is left."""
    if rows.numel() == 0:
        return None, "the cache has no rows"
    start = rows.data_ptr() // _PAGE * _PAGE
    end = -(-(rows.data_ptr() + rows.numel()) // _PAGE) * _PAGE
    for known in list(_registrations):
        if known.start < end and start < known.end:
            if known.cache() is not cache:
                known.close()  # a closed cache's, whose segment was where this one is now
                continue
            view = known.view() if known.view is not None else None
            if known.device == device and view is not None:
                return view, ""
            return None, (f"this process registered the segment with {known.device} already "
                          f"(one process gathers for one GPU)")
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        err = int(cudart.cudaHostRegister(start, end - start, 0))
        if err:
            _take_cuda_error(device)
            return None, f"cudaHostRegister returned error {err}"
        registration = _Registration(cache, start, end, device)
        _registrations.append(registration)
        try:
            view = torch.as_tensor(_HostPointer(rows.data_ptr(), tuple(rows.shape)),
                                   device=device)
        except Exception as exc:  # an old driver without unified addressing, say
            registration.close()
            return None, f"the registered segment could not be viewed from {device}: {exc}"
    registration.view = weakref.ref(view)
    weakref.finalize(view, registration.close)
    return view, ""


def _as_words(view: torch.Tensor) -> torch.Tensor:
    """The rows as 8-byte words where their size and address allow: the GPU then reads the
    host's memory 8 bytes a thread instead of 1."""
    if view.shape[1] % 8 == 0 and view.data_ptr() % 8 == 0:
        return view.view(torch.int64)
    return view


class _DeviceGather:
    """Gathers a batch's rows on the GPU from the registered segment, on a side stream; the
    rows are confirmed only once the gather has completed. One gather runs ahead: the next
    batch's rows are located and its copy queued before the last one is waited for."""

    rereads = False  # rows not confirmed are read again alone by the loader
    ahead = 1

    def __init__(self, cache: SharedCache, view: torch.Tensor, device: torch.device,
                 batch_size: int) -> None:
        self.cache, self.view, self.device = cache, view, device
        self.words = _as_words(view)
        self.stream = torch.cuda.Stream(device)
        # Rows to read, then dataset indices, in pinned memory: one copy to the GPU a batch.
        # A buffer is written again only after the gather that used it finished (ahead + 1
        # are in use at most).
        self.where = [torch.empty(2 * batch_size, dtype=torch.int64, pin_memory=True)
                      for _ in range(self.ahead + 2)]
        self.turn = 0

    def replenish(self) -> None:
        pass  # (batches are made on the device)

    def context(self) -> Any:
        return torch.cuda.stream(self.stream)

    def start(self, idx: np.ndarray) -> Any:
        located = self.cache.locate(idx)
        n = len(idx)
        where, self.turn = self.where[self.turn], (self.turn + 1) % len(self.where)
        both = where.numpy()
        both[:n], both[n:2 * n] = located.rows, idx
        on_device = where[:2 * n].to(self.device, non_blocking=True)
        raw = self.words.index_select(0, on_device[:n])
        done = torch.cuda.Event()
        done.record(self.stream)
        return located, raw, on_device[n:], done

    def finish(self, ticket: Any) -> tuple[Any, np.ndarray, torch.Tensor]:
        located, raw, indices, done = ticket
        done.synchronize()  # the GPU has read the rows: now check they were whole
        hit = self.cache.confirm(located).numpy()
        return _contiguous(self.cache.unpack_rows(raw.view(torch.uint8))), hit, indices

    def ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def close(self) -> None:
        self.view = self.words = None  # type: ignore[assignment]  # the finalizer unregisters


def _contiguous(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return {n: t.contiguous() for n, t in batch.items()}
    return batch.contiguous()

class _PinnedGather:
    """``get_batch`` into pinned buffers, then an asynchronous copy to the GPU on a side
    stream: the path where the segment cannot be registered. A buffer is reused only once
    its copy has completed."""

    rereads = True  # get_batch reads a raced row again alone: what it misses is a miss
    ahead = 0

    def __init__(self, cache: SharedCache, device: torch.device, batch_size: int,
                 buffers: int) -> None:
        self.cache, self.device = cache, device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [_empty_batch(cache, batch_size, pin=True) for _ in range(buffers)]
        self.copied: list[torch.cuda.Event | None] = [None] * buffers
        self.turn = 0

    def replenish(self) -> None:
        pass  # (batches are made on the device)

    def context(self) -> Any:
        return torch.cuda.stream(self.stream)

    def start(self, idx: np.ndarray) -> Any:
        k, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        buf = _rows_of(self.buffers[k], len(idx))
        _, hit = self.cache.get_batch(idx, out=buf)
        batch = _to(buf, self.device)
        self.copied[k] = torch.cuda.Event()
        self.copied[k].record(self.stream)
        return batch, hit.numpy(), torch.from_numpy(idx).to(self.device, non_blocking=True)

    def finish(self, ticket: Any) -> tuple[Any, np.ndarray, torch.Tensor]:
        return ticket

    def ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def close(self) -> None:
        self.buffers = []

def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Mapping):
        return {name: t.to(device, non_blocking=True) for name, t in batch.items()}
    return batch.to(device, non_blocking=True)

# -- the loader -------------------------------------------------------------------------

_END = object()  # the producer's last item of an epoch
_POLL_S = 0.05  # how often a waiting thread looks whether its epoch was stopped
_EXIT_WAIT_S = 10.0  # at interpreter exit, the most to wait for the batch being gathered


def _hand_over(out: queue.Queue, item: Any, stop: threading.Event) -> None:
    """Put ``item`` in the queue as soon as there is room, unless the epoch stops first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _halt(stop: threading.Event, out: queue.Queue, thread: threading.Thread,
          within: float | None = None) -> None:
    """Stop an epoch's producer and wait for it (up to ``within`` seconds; None: until it
    ends), then drop the batches it handed over that nobody will take."""
    stop.set()
    if thread is not threading.current_thread():  # (a transform that closes its loader)
        thread.join(within)
    # Not get_nowait until queue.Empty: a generator finalised at the interpreter's exit may run
    # this after the queue module's globals are cleared, when raising Empty is a TypeError.
    while not out.empty():
        out.get_nowait()  # (this is the queue's one reader, and its producer has stopped)


class _Run:
    """One iterator's epoch: the loader's thread that gathers it, the queue it hands the
    batches over through, ``stop``, and ``ended``, the error its iterator raises once it was
    stopped from outside (the loader closed, or a newer iterator started).

    The thread is a daemon, stopped at interpreter exit by a finalizer (atexit), so that an
    iterator still alive then does not hold the exit: a ``ThreadPoolExecutor``'s thread is
    joined by the interpreter before atexit runs, and it waited for room in the queue that
    only the iterator's ``finally`` could stop."""

    def __init__(self, produce: Callable[..., None], order: Iterator[list[int]],
                 depth: int) -> None:
        self.out: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        self.ended: BaseException | None = None
        self.thread = threading.Thread(target=produce, args=(order, self.out, self.stop),
                                       name="stocaching-gather", daemon=True)
        # (The thread drops its target, and so the loader, when it ends.)
        self._at_exit = weakref.finalize(self, _halt, self.stop, self.out, self.thread,
                                         _EXIT_WAIT_S)
        self.thread.start()

    def end(self, error: BaseException) -> None:
        """Stop the epoch from outside: its iterator raises ``error`` if it is advanced, also
        one waiting for its next batch in another thread."""
        if self.ended is None:
            self.ended = error
        self.stop.set()

    def halt(self) -> None:
        """Stop the epoch and wait until its thread has ended: it finishes the batch it
        gathers (which frees the staging slots that batch read) and closes the prefetcher's
        iterator (which gives back what was staged ahead). Any thread may call it, any
        number of times."""
        self._at_exit.detach()
        _halt(self.stop, self.out, self.thread)


class DeviceLoader:
    """Batches of a :class:`SharedCache`'s samples, gathered by the training process and
    delivered on ``device``, with the dataset indices of each batch.

    It replaces a ``DataLoader`` over a dataset that reads the cache: it takes the order
    (any sampler: ``RandomSampler``, ``DistributedSampler``, ``CacheAwareSampler``, a
    mixture sampler), and a :class:`Prefetcher` over that order loads the misses ahead (your
    ``load`` function, phase one: read and decode) into the cache or its staging slots, in
    threads or loader processes. Each batch is then read from the segment in one gather:

    - on CUDA, the segment is registered with the driver once per process
      (``cudaHostRegister``) and the GPU reads the batch's rows from it directly, on a side
      stream, while the model runs; only the batch's bytes cross PCIe, once;
    - on a CPU, or where registering is refused (a locked-memory limit, no unified
      addressing; one warning says why and how to fix it), ``get_batch`` gathers the batch in
      a background thread (for a GPU, into pinned buffers that are then copied to it).

    Every row keeps ``get_batch``'s guarantee: a row whose slot was written, cleared or
    unstaged while it was copied (on the GPU too: the check follows the completed gather) is
    read again, or loaded, never yielded torn. A staged sample is freed once the gather that
    read it has completed. A row that nothing holds by its turn (a miss that found no staging
    slot, or one the prefetcher could not load ahead) is loaded by the loader's thread, and
    stored with ``set_slot`` when it has a slot.

    ``transform(batch)`` (phase two: random crops, flips, normalisation) runs on each
    gathered batch on the device, in the loader's thread (on the side stream, on CUDA), so it
    overlaps the model's step; it must return the batch it makes.

    One loader per rank, as one ``DataLoader`` per rank: each rank's process registers the
    node's one segment with its own GPU. Close the loader (``close()`` or ``with``) before the
    cache: the registration must end before the segment is unmapped.

    Args:
        cache: the ``SharedCache`` (fixed sizes; a cache of open sizes cannot be gathered as
            rows of one size and is refused).
        sampler: the order of dataset indices, as a ``DataLoader``'s ``sampler``.
        load: ``load(index)``: the sample as it is cached (a tensor; a dict of them for a
            cache of fields).
        batch_size: samples per batch, an int >= 1.
        device: where batches are delivered: "cuda", "cuda:1", a ``torch.device``, or "cpu".
            Default: None, the current CUDA device if CUDA is available, else "cpu".
        transform: ``transform(batch) -> batch`` on the device, or None. Default: None.
        drop_last: drop the last batch of an epoch if it is smaller than ``batch_size``.
            Default: False.
        depth: batches gathered ahead of the one the caller holds, an int >= 1. Default: 2.
        register: on CUDA, gather from the registered segment (True) or always through
            pinned buffers (False). Default: True.
        **prefetch: passed to :class:`Prefetcher` (``window``, ``mode``, ``threads``,
            ``processes``, ``lookahead``, ``timeout``, ``multiprocessing_context``).
            ``stand_aside`` is always False: no ``DataLoader`` worker is there to take a miss.

    Attributes:
        path: how batches are gathered: "cuda" (the GPU reads the registered segment),
            "pinned" (pinned buffers copied to the GPU) or "cpu".
        prefetcher: the :class:`Prefetcher` that loads misses ahead.
    """

    def __init__(self, cache: SharedCache, sampler: Any, load: Callable[[int], Any], *,
                 batch_size: int, device: Any = None,
                 transform: Callable[[Any], Any] | None = None, drop_last: bool = False,
                 depth: int = 2, register: bool = True, **prefetch: Any) -> None:
        if isinstance(cache, OpenSizeCache):
            raise TypeError("cache should have fixed sizes: an OpenSizeCache, of open sizes (a "
                            f"None in data_dims={cache.data_dims!r}), has no rows of one size to "
                            "gather as a batch; use a DataLoader with get_slot in __getitem__")
        if not isinstance(cache, SharedCache):
            raise TypeError(f"cache should be a SharedCache, but got cache of type "
                            f"{type(cache).__name__}")
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.depth = check_int("depth", depth, low=1)
        for name, flag in (("drop_last", drop_last), ("register", register)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} should be True or False, but got {name}={flag!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform should be a callable transform(batch) -> batch or "
                            f"None, but got transform of type {type(transform).__name__}")
        if "stand_aside" in prefetch:
            raise TypeError("stand_aside is not an argument of DeviceLoader: no DataLoader "
                            "worker is there to load a miss the prefetcher stands aside from")
        self.device = _device_of(device)
        self.cache, self.load, self.transform, self.drop_last = cache, load, transform, drop_last
        self.prefetcher = Prefetcher(sampler, cache, load, stand_aside=False, **prefetch)
        self._gather, self.path = self._choose_gather(register)
        # The epoch of the latest iterator, while it is alive: close() stops it.
        self._run: _Run | None = None
        # The position in the epoch: its indices in the batches handed out by the latest
        # iterator (None before one of this epoch started): kept when an iterator is left
        # early, since the batches gathered ahead were never handed out.
        self._position: int | None = None
        self._epoch: int | None = None
        self._closed = False

    def _choose_gather(self, register: bool) -> tuple[Any, str]:
        if self.device.type != "cuda":
            return _HostGather(self.cache, self.batch_size, self.depth + 2), "cpu"
        why = "register=False"
        if register:
            t0 = time.perf_counter()
            view, why = _register(self.cache, self.cache.rows, self.device)
            if view is not None:
                logger.info("stocaching: the DeviceLoader's GPU (%s) reads the cache's segment "
                            "itself: %.1f MiB registered in %.3f s", self.device,
                            view.numel() / 2**20, time.perf_counter() - t0)
                return _DeviceGather(self.cache, view, self.device, self.batch_size), "cuda"
            warnings.warn(f"stocaching: the cache's segment could not be registered with CUDA "
                          f"({why}); batches go through pinned buffers instead, at the CPU's "
                          f"copy speed. In a container, raise the locked-memory limit "
                          f"(docker run --ulimit memlock=-1, or ulimit -l unlimited)",
                          RuntimeWarning, stacklevel=3)
        return _PinnedGather(self.cache, self.device, self.batch_size, self.depth + 2), "pinned"

    def __len__(self) -> int:
        n = len(self.prefetcher)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the prefetcher, and so to the sampler."""
        self.prefetcher.set_epoch(epoch)
        if epoch != self._epoch:  # (the same epoch again keeps the position)
            self._position = None
        self._epoch = epoch

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """The epoch's batches: ``(batch, indices)``, both on the device; ``batch`` is a
        tensor of shape ``(n, *data_dims)`` (a dict of them for a cache of fields) after
        ``transform``, ``indices`` an int64 tensor of the n dataset indices."""
        if self._closed:
            raise ValueError("this DeviceLoader is closed")
        if self._run is not None:  # one epoch at a time: the loader's gather is not shared
            self._run.end(RuntimeError(
                "this iterator of the DeviceLoader was replaced by a newer one (iter(loader) "
                "was advanced while it was alive); iterate the newest"))
            self._run.halt()
        order = self.prefetcher.batches(self.batch_size)
        start = self.prefetcher.position
        self._position = start
        for _ in range(self.depth + 1):  # the first batches' tensors, made here
            self._gather.replenish()
        run = self._run = _Run(self._produce, order, self.depth)
        try:
            while True:
                try:  # (returns at once when a batch is there)
                    item = run.out.get(timeout=_POLL_S)
                except queue.Empty:
                    item = None
                if run.ended is not None:  # closed or replaced meanwhile, from any thread
                    raise run.ended
                if item is None:
                    continue
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                batch, indices, ready = item
                self._gather.replenish()  # the tensors of a later batch, made in this thread
                if ready is not None:  # on CUDA: the caller's stream waits for the gather
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(ready)
                    for t in _tensors(batch, indices):
                        t.record_stream(stream)
                self._position += len(indices)
                yield batch, indices
        finally:
            run.halt()
            if self._run is run:
                self._run = None

    def _produce(self, order: Iterator[list[int]], out: queue.Queue, stop: threading.Event
                 ) -> None:
        """The loader's thread: take a batch of indices, start its gather, and finish and
        hand over the oldest gather once ``ahead`` more are started. It closes ``order``
        itself (a generator cannot be closed while another thread runs it), and always hands
        over an end or a failure, unless the epoch was stopped."""
        started: collections.deque = collections.deque()
        try:
            try:
                with self._gather.context():
                    for ids in order:
                        started.append(self._gather.start(np.array(ids, dtype=np.int64)))
                        if len(started) > self._gather.ahead:
                            self._deliver(started.popleft(), out, stop)
                        if stop.is_set():
                            break
                    while started:
                        self._deliver(started.popleft(), out, stop)
            finally:
                order.close()  # the prefetcher gives back what it staged and was never read
            item = _END
        except BaseException as exc:  # handed to the caller's thread, raised there
            item = _Failure(exc)
            with contextlib.suppress(BaseException):
                while started:  # (their staged samples are freed by finishing them)
                    self._gather.finish(started.popleft())
        _hand_over(out, item, stop)

    def _deliver(self, ticket: Any, out: queue.Queue, stop: threading.Event) -> None:
        """Finish a gather (always: that frees the staged samples it read) and hand the batch
        over, unless the epoch stopped or it is a last batch to drop; with its misses filled
        in, ``transform`` applied, and the event the caller's stream waits for (CUDA)."""
        batch, hit, indices = self._gather.finish(ticket)
        if stop.is_set() or (len(indices) < self.batch_size and self.drop_last):
            return
        if not hit.all():
            self._fill_misses(batch, indices, hit)
        if self.transform is not None:
            batch = self.transform(batch)
        _hand_over(out, (batch, indices, self._gather.ready()), stop)

    def _fill_misses(self, batch: Any, indices: torch.Tensor, hit: np.ndarray) -> None:
        """Rows the gather did not confirm: read again alone (unless the gather did), else
        loaded here (and stored with ``set_slot`` when the index has a slot, as the two-line
        pattern does)."""
        idx = indices.cpu().numpy()
        slotted = self.cache.slot_mask(idx)
        for k in np.flatnonzero(~hit).tolist():
            i = int(idx[k])
            sample = None if self._gather.rereads else self.cache.get_slot(i)
            if sample is None:
                sample = self.load(i)
                if slotted[k]:
                    self.cache.set_slot(i, sample, exist_ok=True)  # (a writer may be first)
            if isinstance(batch, Mapping):
                for name, t in batch.items():
                    t[k] = torch.as_tensor(sample[name])
            else:
                batch[k] = torch.as_tensor(sample)

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch (the samples of the batches handed out so far),
        as the prefetcher's state: ``load_state_dict`` on a new loader continues the epoch
        with the next batch."""
        if self._position is None:  # no iterator of this epoch: the prefetcher knows
            return self.prefetcher.state_dict()
        return self.prefetcher.state_dict(consumed=self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``, a dict from ``state_dict()``."""
        self.prefetcher.load_state_dict(state)
        self._position = None

    def close(self) -> None:
        """Stop the prefetcher's loads, the loader's thread, and end the registration of the
        segment (on CUDA). Idempotent; also done when the loader is collected.

        An iterator still alive (a loop left by ``break`` or an exception, whose iterator is
        still referenced) is stopped: close() waits for the batch being gathered (a ``load``
        or ``transform`` of yours running in it ends first), every staging slot is given
        back, and the iterator raises ``ValueError`` if it is advanced, also in a thread
        waiting for its next batch meanwhile."""
        if self._closed:
            return
        self._closed = True
        run, self._run = self._run, None
        if run is not None:
            run.end(ValueError("this DeviceLoader was closed while this iterator was alive"))
        # Before the wait: the loader's thread, waiting for the loads of its batch, then
        # raises PrefetchError at once instead of waiting for them.
        self.prefetcher.close()
        if run is not None:
            run.halt()
        self._gather.close()

    def __enter__(self) -> "DeviceLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _device_of(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TypeError(f"device should be a torch.device or a string such as 'cuda:0' or "
                        f"'cpu', but got device={device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device should be one this machine has, but got device={device!r} "
                             f"and CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device should be 'cpu' or a CUDA device, but got device={device!r}")
    return dev


def _tensors(batch: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    found = list(batch.values()) if isinstance(batch, Mapping) else [batch]
    return [t for t in found + [indices] if isinstance(t, torch.Tensor)]
