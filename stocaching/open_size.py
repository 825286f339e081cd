"""Samples of open sizes (``OpenSizeCache``, a None in ``data_dims``): an arena in the segment
where each sample takes the bytes of its own size.

A feature module of stocaching (see the core's section "The seam"); the core's
``stocaching.OpenSizeCache`` loads it.
"""

from __future__ import annotations

__all__ = ["OpenSizeCache"]
STOCACHING_FEATURE = "open_size"  # (the core reads this line before it imports the file)
# The names besides __all__ that cli.py (python -m stocaching) uses, as the core's _SEAM
# lists its own.
_SEAM = frozenset({"ARENA_ALIGN", "arena_size_for"})

import mmap
import operator
import os
import struct
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

try:  # inside the package
    from .stocaching import (BYTES_PER_GIB, COPY_COUNTER, DTYPE_CODES, EMPTY, LOCK_BASE, OOB, SET,
                             STATS_HITS, STATS_WRITES, WRITING, BaseCache, CacheCapacityError,
                             Closed, Field, World, check_dims, check_dtype,
                             check_int, check_positive, checked_value, feature_module,
                             fmt_bytes, has_open_size, is_int, more_room, pack_fields,
                             segment_offsets, slot_array, slot_lock_offset, torch_of, what_fits)
except ImportError:  # copied beside stocaching.py
    from stocaching import (BYTES_PER_GIB, COPY_COUNTER, DTYPE_CODES, EMPTY, LOCK_BASE, OOB, SET,
                            STATS_HITS, STATS_WRITES, WRITING, BaseCache, CacheCapacityError,
                            Closed, Field, World, check_dims, check_dtype,
                            check_int, check_positive, checked_value, feature_module,
                            fmt_bytes, has_open_size, is_int, more_room, pack_fields,
                            segment_offsets, slot_array, slot_lock_offset, torch_of, what_fits)


# ----------------------------------------------------------------------------------------------
# Open sizes: OpenSizeCache (an arena of samples at their own sizes)
# ----------------------------------------------------------------------------------------------


_ARENA_LOCK = LOCK_BASE - 2  # lockf offset of a cache of open sizes' arena allocator
ARENA_ALIGN = 16  # every sample's bytes start at a multiple of this in the arena
_REC_SEQ, _REC_OFF, _REC_BYTES, _REC_CAP = range(4)  # a record: these, then the open sizes


def arena_size_for(size_limit_gib: float, dataset_len: int, record_words: int) -> int:
    """The arena that ``size_limit_gib`` buys once the aux array (1 byte) and the record
    (``record_words`` int64) of every index are paid, in whole units of ARENA_ALIGN."""
    rest = int(size_limit_gib * BYTES_PER_GIB) - dataset_len * (1 + 8 * record_words)
    return max(0, rest // ARENA_ALIGN * ARENA_ALIGN)


def _candidates(dataset_len: int, num_nodes: int, arena: int, mean: int | None) -> int:
    """How many indices a node of a cache of open sizes may admit (its CacheLayout subset):
    every index with one node; with several, an even share (the nodes' subsets are then
    disjoint and cover the dataset), or as many as ``arena`` holds of samples of ``mean`` bytes
    if that is more (the subsets then overlap, which the sampler can use)."""
    if num_nodes == 1:
        return dataset_len
    share = -(-dataset_len // num_nodes)
    if mean:
        share = max(share, arena // (-(-mean // ARENA_ALIGN) * ARENA_ALIGN))
    return min(dataset_len, share)


# Samples of at least this many bytes are written into the arena through the segment's file
# (pwrite), not through the mapping: see docs/design.md, "Open-size samples written through
# the file".
_WRITE_THROUGH_FILE = 16384


def _write_at(fd: int, data: np.ndarray, offset: int) -> None:
    """Write all of ``data`` (a contiguous array) at ``offset`` of file ``fd``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class OpenSizeCache(BaseCache):
    """A cache of samples whose sizes vary (a None in ``data_dims``) in shared memory, one
    per node, for PyTorch datasets: each sample is stored at its own size in an arena.

    Example: ``OpenSizeCache(size_limit_gib=32, dataset_len=len(paths), data_dims=(3, None,
    None))`` for images at their native sizes, used as a SharedCache is (``get_slot``,
    ``set_slot``). It offers all that :class:`BaseCache` offers. Samples of different sizes do
    not stack into rows, so what SharedCache adds on rows of one size is not here: batches
    (``get_batch``, ``locate``), staging slots, raw slot access and saving to a file.

    Sizing: ``size_limit_gib`` pays for the aux array and one record per index (4 + the
    number of Nones int64 words) and the rest is the arena. Samples are admitted, at their own
    size (16-byte aligned), while the arena has room; a ``set_slot`` that does not fit stores
    nothing, counts in ``stats()["full"]``, and the index stays a miss. An overwrite keeps
    the sample's place if it fits there, else takes new room (the old place is lost until
    ``clear()``, which gives back the whole arena) or, without room, empties the index, which
    then keeps no place: its old place is lost as well, and its next write needs new room.
    ``len(cache)`` is the number of indices this node may admit (every index with one node),
    ``stats()["filled"]`` how many are stored, ``stats()["arena_used"]`` the bytes handed out.

    Inside the segment: after the aux array, one record per dataset index (int64 words:
    sequence number, offset in the arena, bytes, bytes reserved, then the open sizes of the
    sample in the order of the Nones), then the arena, where each admitted sample's fields lie
    packed (each at a multiple of its itemsize) at its offset, 16-aligned, handed out from the
    bottom up (the header's ``arena_top``, under a lock). An index emptied for want of room
    keeps no place (``_drop`` zeroes its record). Readers and writers use the record's
    sequence number and a per-index lock exactly as slots do, so every guarantee of
    SharedCache holds.

    Args:
        size_limit_gib: budget in GiB (int or float) for the aux array, the records and the
            arena (``python -m stocaching plan --dims 3,None,None --mean-bytes M`` sizes it).
        dataset_len: number of samples in the full dataset.
        data_dims: shape of one sample with a None for each open size, e.g. ``(None, 3)`` or
            ``(3, None, None)``; or a dict of fields ``{name: shape}`` (as SharedCache's), at
            least one with a None, e.g. ``{"image": (3, None, None), "label": ()}``.
        dtype: torch dtype of the samples, or a dict of one per field, as SharedCache's.
            Default: ``torch.uint8``.
        mean_sample_bytes: with several nodes, the expected bytes of a sample: each node's
            candidate set (its ``CacheLayout`` subset) is then as many indices as its arena
            holds of such samples, if that is more than an even share of the dataset.
            Default: None (an even share: the nodes' subsets are disjoint).
        name, job_key, world, shm_dir, layout_seed, random_subset, timeout, persistent, key,
            on_mismatch, layout: as SharedCache's.

    Raises:
        As SharedCache's (no file is loaded here).
    """

    _STATE = BaseCache._STATE + ("_sample_fields", "_arena_size", "_record_words",
                                 "_mean_sample_bytes", "_limit_gib")

    # -- state: BaseCache's, and the records and the arena (set in _size_arena and
    # _map_samples) --------------------------------------------------------------------------
    # What it is: the same in every process.
    _sample_fields: tuple  # the Field of each part of a sample (one for a tensor)
    _np_dtypes: list  # the numpy dtype of each part
    _record_words: int  # 8-byte words of one index's record (where its bytes are, its sizes)
    _arena_size: int  # bytes of the arena
    _mean_sample_bytes: int  # the sizing's guess of a sample's bytes (0: none was given)
    _limit_gib: float  # size_limit_gib as given
    _view_as: torch.dtype | None  # bfloat16, whose samples are stored as int16
    # For a sample of one tensor (None with fields): its element's bytes, the sizes of its
    # dims that are not None, the arena as elements, and the shape of a sample from its record.
    _itemsize: int
    _fixed_sizes: tuple[int, ...] | None
    _arena_items: np.ndarray | None
    _shape_of: Callable[[Any], tuple] | None
    # The mapped records and arena: views of the same pages in every process.
    _records_np: np.ndarray  # one record an index
    _records_bytes: memoryview
    _records: memoryview  # the same, as 8-byte words
    _record_struct: struct.Struct  # unpacks one record
    _arena: np.ndarray  # the samples' bytes
    _arena_file_off: int  # where the arena starts in the segment's file
    _read_only_arena: torch.Tensor  # the arena through the read-only mapping (copy=False)

    def __init__(self, size_limit_gib: float, dataset_len: int,
                 data_dims: Sequence[int | None] | Mapping[str, Sequence[int | None]],
                 dtype: torch.dtype | Mapping[str, torch.dtype] = torch.uint8, *,
                 name: str | None = None, job_key: str | None = None,
                 world: World | None = None, shm_dir: str | None = None, layout_seed: int = 0,
                 random_subset: bool = False, timeout: float = 300.0,
                 mean_sample_bytes: int | None = None, persistent: bool = False,
                 key: str = "", on_mismatch: str = "raise", disk_tier: Any = None,
                 disk_tier_gib: Any = None, layout: Any = None) -> None:
        if disk_tier is not None or disk_tier_gib is not None:
            raise ValueError(f"disk_tier is for samples of a fixed size (a SharedCache, whose "
                             f"rows have one size and so one place in the tier's file); an "
                             f"OpenSizeCache has none, so disk_tier and disk_tier_gib should be "
                             f"None, but got disk_tier={disk_tier!r}, "
                             f"disk_tier_gib={disk_tier_gib!r}")
        if isinstance(size_limit_gib, str) and size_limit_gib == "auto":
            raise ValueError(f"size_limit_gib='auto' needs samples of a fixed size; with open "
                             f"sizes (data_dims={data_dims}) pass a number (python -m stocaching "
                             "plan --mean-bytes sizes it), but got size_limit_gib='auto'")
        size_limit_gib = check_positive("size_limit_gib", size_limit_gib, "GiB")
        dataset_len = check_int("dataset_len", dataset_len, low=1)
        if isinstance(data_dims, Mapping):
            fields = feature_module("fields").check_fields(data_dims, dtype)[0]
            dims: Any = {f.name: f.dims for f in fields}
            dtype = {f.name: f.dtype for f in fields}
        else:
            dims, dtype, fields = check_dims(data_dims), check_dtype(dtype), ()
        if not has_open_size(dims):
            raise TypeError(f"data_dims should leave a size open (a None) in an OpenSizeCache; "
                            f"samples of a fixed size go in a SharedCache(size_limit_gib, "
                            f"dataset_len, data_dims, ...), but got data_dims={dims}")
        if mean_sample_bytes is not None:
            mean_sample_bytes = check_int("mean_sample_bytes", mean_sample_bytes, low=1)
        world, _ = self._configure(
            dataset_len, world=world, layout_seed=layout_seed, random_subset=random_subset,
            timeout=timeout, persistent=persistent, key=key, on_mismatch=on_mismatch,
            name=name, job_key=job_key, shm_dir=shm_dir, load_from=None, layout=layout)
        candidates = self._size_arena(size_limit_gib, dataset_len, dims, dtype, world.num_nodes,
                                      mean_sample_bytes)
        self._open(candidates, dims, dtype, fields, 0, None)

    # -- sizing and layout ------------------------------------------------------------------

    def _size_arena(self, size_limit_gib: float, dataset_len: int, dims: Any, dtype: Any,
                    num_nodes: int, mean: int | None) -> int:
        """Set the arena's size and the record's; return how many indices this node may
        admit (its candidates)."""
        self._sample_fields = pack_fields(dims, dtype)[0] if isinstance(dims, Mapping) else \
            (Field("", dims, dtype, 0, 0),)
        self._record_words = 4 + sum(d is None for f in self._sample_fields for d in f.dims)
        self._arena_size = arena_size_for(size_limit_gib, dataset_len, self._record_words)
        self._mean_sample_bytes, self._limit_gib = mean or 0, float(size_limit_gib)
        if not self._arena_size:
            warnings.warn(f"size_limit_gib={size_limit_gib} leaves no room for samples: the "
                          f"aux array and the records alone need "
                          f"{fmt_bytes(dataset_len * (1 + 8 * self._record_words))}",
                          RuntimeWarning, stacklevel=3)
        return _candidates(dataset_len, num_nodes, self._arena_size, mean)

    def _offsets(self) -> dict:
        lay = self._layout
        offsets = segment_offsets(lay, 0, 0)  # the header, stats and aux array as for slots
        rec_off = offsets["aux_off"] + (lay.dataset_len + 7) // 8 * 8
        data_off = rec_off + lay.dataset_len * self._record_words * 8
        data_off = (data_off + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        offsets.update(seq_off=rec_off, stage_off=0, map_off=0, data_off=data_off,
                       total_bytes=data_off + max(1, self._arena_size),
                       arena_bytes=self._arena_size, arena_top=0, record_words=self._record_words,
                       mean_bytes=self._mean_sample_bytes)
        return offsets

    def _budget_fitting(self, room: int, total: int) -> float:
        """The size_limit_gib of the largest arena whose segment (of ``total`` bytes now)
        takes at most ``room`` bytes."""
        return max(0, room - (total - self._arena_size)) / BYTES_PER_GIB

    def _capacity_error(self, shm_dir: str, total: int, free: int) -> CacheCapacityError:
        return CacheCapacityError(
            f"{shm_dir} has {fmt_bytes(free)} free but the cache needs {fmt_bytes(total)} "
            f"(an arena of {fmt_bytes(self._arena_size)}). {more_room(shm_dir, total)} or pass "
            f"a smaller size_limit_gib ({what_fits(self, shm_dir, total, free)})", shm_dir,
            total, free)

    def _map_samples(self, head: dict) -> None:
        """The views of the records and of the arena. A hit of one tensor is one read of its
        record (as a tuple: ``_record_struct``), one slice of the arena in the tensor's own
        dtype (``_arena_items``: offsets are multiples of 16) reshaped to the shape that
        ``_shape_of`` picks out of the record and the fixed sizes appended to it
        (``_fixed_sizes``), and one copy; a sample of fields is unpacked from its bytes."""
        n, words = self._layout.dataset_len, self._record_words
        rec_off, data_off = head["seq_off"], head["data_off"]
        self._records_np = np.frombuffer(self._segment.mapping, np.int64, n * words, rec_off
                                         ).reshape(n, words)
        self._records_bytes = memoryview(self._segment.mapping)[rec_off: rec_off + n * words * 8]
        self._records = self._records_bytes.cast("q")
        self._record_struct = struct.Struct(f"{words}q")
        self._arena = np.frombuffer(self._segment.mapping, np.uint8, self._arena_size, data_off)
        self._arena_file_off = data_off  # (the segment is mapped from its start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": intended
            self._read_only_arena = torch.from_numpy(np.frombuffer(
                self._segment.read_only_mapping, np.uint8, self._arena_size, data_off))
        self._np_dtypes = [DTYPE_CODES[f.dtype][1] for f in self._sample_fields]
        first = self._sample_fields[0]
        self._view_as = first.dtype if first.dtype is torch.bfloat16 else None
        self._fixed_sizes = self._arena_items = self._shape_of = None
        if not self._fields:
            self._itemsize = np.dtype(self._np_dtypes[0]).itemsize
            self._fixed_sizes = tuple(d for d in first.dims if d is not None)
            opened = iter(range(4, words))
            fixed = iter(range(words, words + len(self._fixed_sizes)))
            self._shape_of = operator.itemgetter(
                *(next(opened) if d is None else next(fixed) for d in first.dims))
            self._arena_items = np.frombuffer(self._segment.mapping, self._np_dtypes[0],
                                              self._arena_size // self._itemsize, data_off)

    def _unmap(self) -> None:
        closed = Closed(type(self))
        self._records_np = self._records = closed  # type: ignore
        self._arena = self._read_only_arena = closed  # type: ignore
        self._records_bytes = self._arena_items = closed  # type: ignore
        super()._unmap()

    # -- reading ----------------------------------------------------------------------------

    def _read(self, idx: int, copy: bool) -> Any:
        """The seqlock read of the record and bytes of ``idx``, the one read of an open-size
        sample: a sample (counted as a hit), or None. As ``_read_row`` for a slot: the
        record's sequence number (its first word, read first) even, the bytes the record names
        copied, then the state SET and the number again, unchanged, in that order (writers
        change both only while the number is odd). A record read while a writer changes it
        may not fit its bytes: a retry, not an error."""
        r = self._record_struct.unpack_from(self._records_bytes, idx * self._record_struct.size)
        seq = r[0]
        if seq & 1:
            return None
        off = r[_REC_OFF]
        end = off + r[_REC_BYTES]
        if self._fixed_sizes is not None and copy:  # one tensor: the shape, then a single copy
            try:
                data = self._arena_items[off // self._itemsize: end // self._itemsize].reshape(
                    self._shape_of(r + self._fixed_sizes)).copy()
            except ValueError:
                return None
        else:
            data = self._arena[off: end].copy() if copy else self._read_only_arena[off: end]
        if self._index_states[idx] != SET or self._records[idx * self._record_words] != seq:
            return None
        self._own_counters[STATS_HITS] += 1
        if self._fixed_sizes is not None and copy:  # already in its shape and dtype
            return torch.from_numpy(data) if self._view_as is None else \
                torch.from_numpy(data).view(self._view_as)
        if copy:
            return self._unpack(data, r[4:])
        sample = self._unpack(data.numpy(), r[4:])  # views of the read-only arena
        return self._view_of(sample)

    def _shapes(self, sizes: Sequence[int]) -> list[tuple[int, ...]]:
        it = iter(sizes)
        return [tuple(next(it) if d is None else d for d in f.dims) for f in self._sample_fields]

    def _unpack(self, data: np.ndarray, sizes: Sequence[int]) -> Any:
        """The sample in ``data`` (its packed bytes) with these open sizes."""
        if not self._fields:  # one tensor
            f = self._sample_fields[0]
            shape = self._shapes(sizes)[0]
            arr = data.view(self._np_dtypes[0]).reshape(shape)
            return torch_of(arr, f.dtype)
        fields, _ = pack_fields(
            {f.name: s for f, s in zip(self._sample_fields, self._shapes(sizes))},
            {f.name: f.dtype for f in self._sample_fields})
        return {f.name: torch_of(data[f.offset: f.offset + f.nbytes].view(dt).reshape(f.dims),
                                 f.dtype) for f, dt in zip(fields, self._np_dtypes)}

    # -- writing ----------------------------------------------------------------------------

    def _check_value(self, value: Any) -> Any:
        """Check ``value`` against the fields with their open sizes; return the checked
        tensor (or dict of them) and the open sizes, in the order of the Nones."""
        if self._fields:
            value = feature_module("fields").check_keys(value, self._dims)
        checked, sizes = {}, []
        for f in self._sample_fields:
            v, what = (value[f.name], f"value[{f.name!r}]") if f.name else (value, "value")
            where = f"data_dims[{f.name!r}]" if f.name else "data_dims"
            if not f.dims and isinstance(v, (int, float, complex, np.generic)):
                v = torch.tensor(v)
            shape = tuple(getattr(v, "shape", ()))
            while len(shape) > len(f.dims) and shape[0] == 1:  # (1, ...) as 0.2.1 took it
                shape = shape[1:]
            if isinstance(v, (torch.Tensor, np.ndarray)) and (
                    len(shape) != len(f.dims) or
                    any(d is not None and d != s for d, s in zip(f.dims, shape))):
                raise ValueError(f"{what} should have shape {f.dims} (the cache's {where}; None "
                                 f"is any size), but got {what}.shape={tuple(v.shape)}")
            dims = shape if isinstance(v, (torch.Tensor, np.ndarray)) else f.dims
            checked[f.name] = checked_value(v, dims, f.dtype, what, where)
            sizes += [s for d, s in zip(f.dims, shape) if d is None]
        return checked, sizes

    def _source_array(self, value: Any) -> tuple[np.ndarray, list[int]]:
        """The packed bytes of a sample and its open sizes, checked."""
        checked, sizes = self._check_value(value)
        if not self._fields:
            a = slot_array(checked[""], self._sample_fields[0].dtype)
            return np.ascontiguousarray(a).reshape(-1).view(np.uint8), sizes
        fields, total = pack_fields(
            {f.name: tuple(checked[f.name].shape) for f in self._sample_fields},
            {f.name: f.dtype for f in self._sample_fields})
        row = np.zeros(total, np.uint8)
        for f in fields:
            a = np.ascontiguousarray(slot_array(checked[f.name], f.dtype))
            row[f.offset: f.offset + f.nbytes] = a.reshape(-1).view(np.uint8)
        return row, sizes

    def set_slot(self, idx: int, value: Any, allow_oob_idx: bool = True,
                 allow_overwrite: bool = False, *, exist_ok: bool = False) -> None:
        """Store ``value`` (in its own sizes) as the sample of ``idx`` if the arena has room;
        as ``SharedCache.set_slot`` otherwise. A sample that does not fit in what is left of
        the arena is not stored (``stats()["full"]`` counts it; the index stays a miss); one
        larger than the whole arena raises ValueError. An overwrite that does not fit leaves
        the index empty and without a place: a later write of it needs new room."""
        idx = self._index(idx)
        src, sizes = self._source_array(value)
        if src.size > self._arena_size:
            raise ValueError(f"value should fit in the cache's arena ({self._arena_size} bytes, "
                             f"from size_limit_gib={self._limit_gib}), but got a sample of "
                             f"{src.size} bytes")
        if self._index_states[idx] == OOB:
            if not allow_oob_idx:
                raise self._oob_error(idx)
            return
        lock = slot_lock_offset(idx)
        self._segment.lock(lock)
        try:
            if not self._store(idx, src, sizes, allow_overwrite, exist_ok):
                return
        finally:
            self._segment.unlock(lock)
        self._own_counters[STATS_WRITES] += 1

    def _store(self, idx: int, src: np.ndarray, sizes: list[int], allow_overwrite: bool,
               exist_ok: bool) -> bool:
        """set_slot under the index's lock; True when the write counts as one."""
        rec, base, state = self._records, idx * self._record_words, self._index_states[idx]
        if state == SET and not allow_overwrite and not rec[base] & 1:
            if exist_ok:
                return False
            off, nbytes = rec[base + _REC_OFF], rec[base + _REC_BYTES]
            if nbytes == src.size and rec[base + 4: base + self._record_words].tolist() == sizes \
                    and np.array_equal(self._arena[off: off + nbytes], src):
                return True  # a second load of one index: done already
            raise RuntimeError(
                f"the sample of idx={idx} is already set to a different value; pass "
                "allow_overwrite=True to replace it, or exist_ok=True to keep it. (Two loads "
                "of one index that give different values mean that the load is not "
                "deterministic, most often random augmentation before the cache.)")
        if state in (SET, WRITING) and rec[base + _REC_CAP] >= src.size:
            off, cap = rec[base + _REC_OFF], rec[base + _REC_CAP]  # its place, reused
        else:
            cap = -(-src.size // ARENA_ALIGN) * ARENA_ALIGN
            self._segment.lock(_ARENA_LOCK)
            try:
                off = self._segment.header_get("arena_top")
                if off + cap <= self._arena_size:
                    self._segment.header_set("arena_top", off + cap)
                else:  # counted here, under the lock: one counter for the node
                    off = -1
                    full = self._segment.header_get("arena_full")
                    self._segment.header_set("arena_full", full + 1)
            finally:
                self._segment.unlock(_ARENA_LOCK)
            if off < 0:  # full: nothing stored; an overwritten sample is dropped
                if state != EMPTY:
                    self._drop(idx)
                return False
        seq = rec[base]
        seq += seq & 1  # an odd number left by a writer that died: round up
        rec[base] = seq + 1
        self._index_states[idx] = WRITING
        rec[base + _REC_OFF], rec[base + _REC_BYTES], rec[base + _REC_CAP] = off, src.size, cap
        for k, size in enumerate(sizes):
            rec[base + 4 + k] = size
        if src.size < _WRITE_THROUGH_FILE:
            self._arena[off: off + src.size] = src
        else:
            _write_at(self._segment.fd, src, self._arena_file_off + off)
        self._index_states[idx] = SET
        rec[base] = seq + 2
        return True

    def _drop(self, idx: int) -> None:
        """Empty ``idx`` (its lock held): readers see a miss, its place is given up."""
        rec, base = self._records, idx * self._record_words
        seq = rec[base] + (rec[base] & 1)
        rec[base] = seq + 1
        self._index_states[idx] = EMPTY
        for k in range(1, self._record_words):
            rec[base + k] = 0
        rec[base] = seq + 2

    def clear(self) -> None:
        """Empty every index and give back the whole arena. Safe while other processes read
        (they see misses) or write (they finish first)."""
        self._check_open()
        self._segment.lock(slot_lock_offset(0), self._dataset_len)
        try:
            self._segment.lock(_ARENA_LOCK)
            try:
                seq = self._records_np[:, _REC_SEQ]
                seq |= 1
                aux = self._index_states_np
                aux[aux != OOB] = EMPTY
                self._records_np[:, 1:] = 0
                self._arena[: self._segment.header_get("arena_top")].fill(0)
                self._segment.header_set("arena_top", 0)
                seq += 1
            finally:
                self._segment.unlock(_ARENA_LOCK)
        finally:
            self._segment.unlock(slot_lock_offset(0), self._dataset_len)

    may_refuse = True  # set_slot declines a sample that finds no room in the arena

    @property
    def arena_used(self) -> int:
        """Bytes of the arena handed out since the last ``clear()`` (overwritten places
        included): it falls only when the cache is cleared."""
        self._check_open()
        return self._segment.header_get("arena_top")

    def stats(self, *, since: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """As ``SharedCache.stats``, plus ``arena_bytes`` (the arena's size) and ``arena_used``
        (bytes handed out since the last ``clear()``, overwritten places included); ``full``
        counts writes that found no room. ``slots`` is the number of indices this node may
        admit."""
        self._check_open()  # (before the header is read: a closed mapping says less)
        full = self._segment.header_get("arena_full")
        if since is not None and not is_int(since.get("full")):
            raise TypeError(f"since should be a dict from this cache's stats(), but got "
                            f"since={since!r}")
        out = super().stats(since=since)
        out.update(full=full - (int(since["full"]) if since is not None else 0),
                   arena_bytes=self._arena_size, arena_used=self._segment.header_get("arena_top"))
        return out

    # -- copies and raw access ----------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> "OpenSizeCache":
        """An independent private cache with this one's configuration and contents (an entry
        whose writer died mid-write is copied as empty)."""
        self._check_open()
        w, lay = self._world, self._layout
        twin = OpenSizeCache(self._limit_gib, lay.dataset_len, self._dims, self._dtype,
                             name=f"copy{next(COPY_COUNTER)}",
                             world=World(rank=w.node_rank, world_size=w.num_nodes,
                                         node_rank=w.node_rank, num_nodes=w.num_nodes),
                             shm_dir=os.path.dirname(self._path), layout=lay,
                             mean_sample_bytes=self._mean_sample_bytes or None)
        memo[id(self)] = twin
        self._segment.lock(slot_lock_offset(0), self._dataset_len)
        try:
            aux = self._index_states_np.copy()
            aux[(aux == SET) & (self._records_np[:, _REC_SEQ] & 1 == 1)] = EMPTY
            aux[aux == WRITING] = EMPTY
            top = self._segment.header_get("arena_top")
            twin._arena[:top] = self._arena[:top]
            twin._records_np[:] = self._records_np
            twin._records_np[:, _REC_SEQ] = 0
            twin._segment.header_set("arena_top", top)
            twin._index_states_np[:] = aux
        finally:
            self._segment.unlock(slot_lock_offset(0), self._dataset_len)
        return twin
