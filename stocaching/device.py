"""Batches of cached samples gathered straight onto the training device.

A ``DataLoader`` copies a cached sample several times on its way to the GPU (out of the
segment in a worker, into a collated batch, through the worker queue, into pinned memory, then
to the device), and on a GPU machine that CPU path, not the cache, sets the pace once the data
is cached. :class:`DeviceLoader` replaces it for the samples of a :class:`SharedCache`: the
training process gathers each batch from the segment itself. On CUDA the segment is registered
with the driver (page-locked in place) and the GPU reads the batch's rows from it directly, on a
side stream; where registering is refused, ``get_batch`` gathers the batch into pinned buffers
in a background thread, copied to the device from there; on a CPU the caller's thread gathers
several batches at a time, into memory reused once no batch holds it (docs/device.md). Misses
are loaded ahead by a :class:`Prefetcher` into the cache or its staging slots, so that every
row of a batch is read from the segment.

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
``stocaching.py``, ``prefetch.py`` with what it needs beside it (``order.py``, ``_common.py``)
and this file into a project works.
"""

from __future__ import annotations

__all__ = ["DeviceLoader"]

import collections
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
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

def _sample_kinds(cache: SharedCache) -> dict[str | None, tuple[torch.Size, torch.dtype]]:
    """The dims and dtype of each field of the cache's samples, in its order, from its
    ``fields``, ``data_dims`` and ``dtype`` (one entry, named None, for a cache of one
    tensor a sample)."""
    if cache.fields:
        return {name: (torch.Size(cache.data_dims[name]), cache.dtype[name])
                for name in cache.fields}
    return {None: (torch.Size(cache.data_dims), cache.dtype)}


def _empty_batch(cache: SharedCache, n: int, pin: bool = False) -> Any:
    made = {name: torch.empty((n, *dims), dtype=dtype, pin_memory=pin)
            for name, (dims, dtype) in _sample_kinds(cache).items()}
    return made[None] if None in made else made


def _rows_between(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, Mapping):
        return {name: t[start:stop] for name, t in batch.items()}
    return batch[start:stop]

class _HostGather:
    """The CPU path: the rows of ``block`` batches at a time, read in the caller's thread
    into host memory that is reused once no batch made of it is held (``_HostMemory``).

    No thread of the loader's hands batches over: on a CPU device a gather is a copy at
    memory speed, and handing each batch over from another thread cost more than the copy of
    a small batch. A cache of one tensor is read as the GPU reads it (``locate``, copy the
    rows, ``confirm``), the copy of a large block split with a second thread; a cache of
    fields with ``get_batch``, whose batches are contiguous tensors per field (see "The batch
    path's costs" in docs/design.md). The prefetcher still loads the misses ahead, in its own
    threads or processes."""

    rereads: bool  # get_batch reads a raced row again alone; a located row is not reread

    def __init__(self, cache: SharedCache, batch_size: int, most: int) -> None:
        self.cache, self.batch_size = cache, batch_size
        rows = cache.rows
        row_bytes = int(rows.shape[1])
        self.most_batches = max(1, min(_MOST_BATCHES_A_GATHER,
                                       _GATHER_BYTES // max(1, batch_size * row_bytes)))
        self.fields = bool(cache.fields)
        self.rereads = self.fields
        # A cache of one tensor: its rows, copied as bytes into blocks of rows.
        self.rows = None if self.fields else rows.numpy()
        kinds = _sample_kinds(cache) if self.fields else \
            {None: (torch.Size([row_bytes]), torch.uint8)}
        self.memory = _HostMemory(kinds, batch_size * self.most_batches, most)
        self.helper: ThreadPoolExecutor | None = None  # the second thread of a split copy
        self.helper_pid = 0

    def batches_a_gather(self, loaded_ahead: int) -> int:
        """Batches to gather at once this epoch: as many as fit ``_GATHER_BYTES`` where every
        sample is in the cache; else at most ``loaded_ahead`` positions, so that the loads of
        the next block run while this one is read."""
        if self.cache.ready_mask().all():
            return self.most_batches
        return max(1, min(self.most_batches, loaded_ahead // self.batch_size))

    def gather(self, idx: np.ndarray) -> tuple[Any, np.ndarray, torch.Tensor]:
        """The rows of ``idx`` (a block of batches), which were found, and the indices as a
        tensor of their own."""
        indices = torch.from_numpy(idx.copy())
        out = _rows_between(self.memory.take(), 0, len(idx))
        if self.fields:
            block, hit = self.cache.get_batch(idx, out=out)
            return block, hit.numpy(), indices
        located = self.cache.locate(idx)
        self._copy(located.rows, out.numpy())
        return self.cache.unpack_rows(out), self.cache.confirm(located).numpy(), indices

    def _copy(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[k] = self.rows[rows[k]]``; a block of ``_SPLIT_BYTES`` or more in two halves,
        one copied by a second thread (numpy's copy runs without the GIL)."""
        if out.nbytes < _SPLIT_BYTES or _cores() < 2:
            np.take(self.rows, rows, axis=0, out=out, mode="clip")
            return
        if self.helper is None or self.helper_pid != os.getpid():  # (none survives a fork)
            self.helper = ThreadPoolExecutor(1, thread_name_prefix="stocaching-copy")
            self.helper_pid = os.getpid()
        half = len(rows) // 2
        later = self.helper.submit(np.take, self.rows, rows[half:], 0, out[half:], "clip")
        np.take(self.rows, rows[:half], axis=0, out=out[:half], mode="clip")
        later.result()

    def close(self) -> None:
        self.memory.blocks.clear()
        if self.helper is not None and self.helper_pid == os.getpid():
            self.helper.shutdown(wait=False)
        self.helper = None


# A CPU gather takes this many bytes of batches at once, in at most this many batches: one
# call and one step of the prefetcher for several small batches; a block of _SPLIT_BYTES or
# more is copied by two threads. See docs/design.md, "The batch path's costs".
_GATHER_BYTES = 8 << 20
_MOST_BATCHES_A_GATHER = 8
_SPLIT_BYTES = 4 << 20


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


class _HostMemory:
    """Blocks of host memory for batches, each reused once nothing holds a batch made of it.

    A block is one numpy array per field; the batches handed out are tensors made of it with
    ``torch.from_numpy``, whose storage holds a reference to the array until the last tensor,
    view or numpy array made of the batch is freed. A block whose arrays are back to the
    references they had when it was made is no one's, and is written again: batches stay
    the caller's to keep, as a DataLoader's are. At most ``most`` blocks are kept: past that,
    one still held is forgotten (its memory is freed with its last batch)."""

    def __init__(self, kinds: dict[str | None, tuple[torch.Size, torch.dtype]], rows: int,
                 most: int) -> None:
        """Blocks of ``rows`` batch rows of ``kinds``: each field's dims and dtype (one
        entry, named None, for a batch that is one tensor)."""
        self.kinds, self.rows, self.most = kinds, rows, most
        self.blocks: list[tuple[tuple[np.ndarray, ...], tuple[int, ...]]] = []

    @staticmethod
    def _references(arrays: tuple[np.ndarray, ...]) -> tuple[int, ...]:
        return tuple(sys.getrefcount(a) for a in arrays)

    def take(self) -> Any:
        """A block's tensors of ``rows`` rows, in memory that no batch holds."""
        for arrays, free in self.blocks:
            if self._references(arrays) == free:
                return self._tensors(arrays)
        if len(self.blocks) >= self.most:
            del self.blocks[0]
        arrays = tuple(np.empty(self.rows * dtype.itemsize * int(np.prod(dims, dtype=np.int64)),
                                dtype=np.uint8) for dims, dtype in self.kinds.values())
        self.blocks.append((arrays, self._references(arrays)))
        return self._tensors(arrays)

    def _tensors(self, arrays: tuple[np.ndarray, ...]) -> Any:
        made = {name: torch.from_numpy(a).view(dtype).view(self.rows, *dims)
                for a, (name, (dims, dtype)) in zip(arrays, self.kinds.items())}
        return made[None] if None in made else made


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

    def context(self) -> Any:
        return torch.cuda.stream(self.stream)

    def start(self, idx: np.ndarray) -> Any:
        k, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        buf = _rows_between(self.buffers[k], 0, len(idx))
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


class _ProducerThreadEpoch:
    """One iterator's epoch on CUDA: the loader's thread that gathers it, the queue it hands the
    batches over through, ``stop``, and ``ended``, the error its iterator raises once it was
    stopped from outside (the loader closed, or a newer iterator started).

    The thread is a daemon, stopped at interpreter exit by a finalizer (atexit), so that an
    iterator still alive then does not hold the exit: a ``ThreadPoolExecutor``'s thread is
    joined by the interpreter before atexit runs, and it waited for room in the queue that
    only the iterator's ``finally`` could stop."""

    def __init__(self, produce: Callable[..., None], order: Iterator[np.ndarray],
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


class _CallerThreadEpoch:
    """One iterator's epoch on a CPU, gathered in the caller's thread, with
    ``_ProducerThreadEpoch``'s interface (``ended``, ``end``, ``halt``). ``lock`` is held
    while a batch is gathered or transformed, so that a ``halt`` from another thread
    (``close()``) waits for that batch; whoever halts closes the prefetcher's iterator
    (which gives back what it staged ahead), or the interpreter's exit does (a finalizer, as
    ``_ProducerThreadEpoch``'s)."""

    def __init__(self, order: Iterator[np.ndarray]) -> None:
        self.order = order
        self.ended: BaseException | None = None
        self.lock = threading.RLock()  # (a transform may close its own loader)
        self._at_exit = weakref.finalize(self, order.close)

    def next(self) -> np.ndarray | None:
        """The next block of indices, None at the epoch's end; with ``lock`` held. Raises
        the error of an end from outside, also where it stopped the prefetcher's wait."""
        if self.ended is not None:
            raise self.ended
        try:
            return next(self.order, None)
        except BaseException:
            if self.ended is not None:
                raise self.ended from None
            raise

    def end(self, error: BaseException) -> None:
        if self.ended is None:
            self.ended = error

    def halt(self) -> None:
        self._at_exit.detach()
        with self.lock:
            self.order.close()


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
    - where registering is refused (a locked-memory limit, no unified addressing; one
      warning says why and how to fix it), ``get_batch`` gathers the batch in a background
      thread into pinned buffers, which are then copied to the GPU;
    - on a CPU, ``get_batch`` gathers in the caller's thread when a batch is asked for,
      several batches at once where every sample is cached (up to 8 MiB), into memory that
      is reused once nothing holds a batch made of it (batches stay yours to keep): a thread
      handing batches over cost more than copying them (docs/design.md, "The batch path's
      costs"). ``depth`` does not apply there.

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
        depth: on CUDA, batches gathered ahead of the one the caller holds; on a CPU,
            blocks of batches kept for reuse past the one in use; an int >= 1. Default: 2.
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
        self._run: _ProducerThreadEpoch | None = None
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

    def _loaded_ahead(self) -> int:
        """Half of the positions the prefetcher loads ahead (of those it stages, where
        indices have no slot): a block of a CPU gather is at most that, so that the next
        block's loads run while this one is read."""
        ahead = self.prefetcher.loads_ahead
        if not self.cache.slot_mask().all():
            ahead = min(ahead, self.prefetcher.stage_ahead)
        return ahead // 2

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
        block = self._gather.batches_a_gather(self._loaded_ahead()) if self.path == "cpu" else 1
        order = self.prefetcher.batches(self.batch_size * block)
        self._position = self.prefetcher.position
        if self.path == "cpu":
            run: _CallerThreadEpoch | _ProducerThreadEpoch = _CallerThreadEpoch(order)
            batches = self._gathered_here(run)
        else:
            run = _ProducerThreadEpoch(self._produce, order, self.depth)
            batches = self._handed_over(run)
        self._run = run
        try:
            yield from batches
        finally:
            run.halt()
            if self._run is run:
                self._run = None

    def _gathered_here(self, run: "_CallerThreadEpoch") -> Iterator[tuple[Any, torch.Tensor]]:
        """The CPU path's epoch: each block of batches gathered in this thread when the
        first of them is asked for, then each batch handed out (``transform`` applied)."""
        size = self.batch_size
        while True:
            with run.lock:
                ids = run.next()
                if ids is None:
                    return
                block, hit, indices = self._gather.gather(ids)
                if not hit.all():
                    self._fill_misses(block, indices, hit)
            for start in range(0, len(indices), size):
                n = min(size, len(indices) - start)
                if n < size and self.drop_last:
                    return
                with run.lock:
                    if run.ended is not None:
                        raise run.ended
                    batch = _rows_between(block, start, start + n)
                    if self.transform is not None:
                        batch = self.transform(batch)
                self._position += n
                yield batch, indices[start:start + n]

    def _handed_over(self, run: "_ProducerThreadEpoch") -> Iterator[tuple[Any, torch.Tensor]]:
        """A CUDA path's epoch: the batches the loader's thread gathers (``_produce``), taken
        from its queue."""
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
            stream = torch.cuda.current_stream(self.device)  # it waits for the gather
            stream.wait_event(ready)
            for t in _tensors(batch, indices):
                t.record_stream(stream)
            self._position += len(indices)
            yield batch, indices

    def _produce(self, order: Iterator[np.ndarray], out: queue.Queue, stop: threading.Event
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
                        started.append(self._gather.start(ids))
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

    def load_state_dict(self, state: Mapping[str, Any] | list[Mapping[str, Any]]) -> None:
        """Continue from ``state``, a dict from ``state_dict()``, or the list of every rank's
        state of another world (see ``Prefetcher.load_state_dict``)."""
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
