"""Batch reads of a ``SharedCache``: ``get_batch``, and the read whose copy the caller makes
(``locate``, ``rows``, ``confirm``, ``unpack_rows``), as the device loader makes it on a GPU.

A feature module of stocaching (see the core's section "The seam"): these functions are the
cache's methods (``SharedCache.get_batch = _FromFeature("batches")``), so their first
argument is the cache. The seqlock of many rows (``_locate``, ``_confirm``) stays in the core,
beside the one of a row.
"""

from __future__ import annotations

__all__ = []
STOCACHING_FEATURE = "batches"  # (the core reads this line before it imports the file)

from typing import Any

import numpy as np
import torch

try:  # inside the package
    from .stocaching import (OOB, SET, STATS_MISSES, STATS_OOB_MISSES, BatchRows, is_int,
                             is_integer_dtype)
except ImportError:  # copied beside stocaching.py
    from stocaching import (OOB, SET, STATS_MISSES, STATS_OOB_MISSES, BatchRows, is_int,
                            is_integer_dtype)


def check_out(out: Any, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """``out`` (or a field of it, ``what``) of ``get_batch`` if it can take a batch of
    ``shape`` and ``dtype``, or raise naming it."""
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or out.layout != torch.strided:
        got = f"dtype {out.dtype}, layout {out.layout}" if isinstance(out, torch.Tensor) \
            else f"type {type(out).__name__}"
        raise TypeError(f"{what} should be a dense tensor of dtype {dtype} (the cache's), but "
                        f"got {what} of {got}")
    if tuple(out.shape) != shape or out.device.type != "cpu" or not out.is_contiguous() or \
            out.requires_grad:
        raise ValueError(
            f"{what} should be a contiguous CPU tensor of shape {shape} (len(indices), "
            f"*data_dims) without requires_grad, but got {what} of shape {tuple(out.shape)} "
            f"on {out.device}, contiguous={out.is_contiguous()}, "
            f"requires_grad={out.requires_grad}")
    return out


def get_batch(self, indices: Any, *, out: Any = None) -> tuple[Any, torch.Tensor]:
    """The cached samples of several dataset indices, gathered into one batch tensor, and
    which of them were cached: what ``get_slot`` gives for each index, in one call.

    Made for a Dataset's ``__getitems__``, which a DataLoader calls with the indices of a
    whole batch (see the README's recipe): one vectorised copy of every row instead of a
    ``get_slot`` call per index and a ``torch.stack``. Each row keeps ``get_slot``'s
    guarantee: a row whose slot was being written, or was written or cleared during the
    copy, is read again on its own and otherwise reported as a miss, never half-written.
    A staged sample (see ``stage``) is taken as ``get_slot`` takes it: its staging slot
    is freed, so a second occurrence of that index in ``indices`` is a miss. Hits and
    misses are counted in ``stats()`` as ``get_slot`` counts them; an index without a slot
    on this node is a miss, counted in ``oob_misses`` too, even where the disk tier holds
    its row: a Dataset's fallback (``get_slot``) then reads the row from there.

    Args:
        indices: dataset indices in ``[0, dataset_len)``: a sequence of ints (the list a
            DataLoader's batch sampler gives ``__getitems__``, a tuple, a range) or a 1-D
            integer numpy array or tensor. Repeats are allowed.
        out: where to gather: a contiguous CPU tensor of shape ``(len(indices),
            *data_dims)`` and the cache's dtype, returned as the batch (with fields: a dict
            of such tensors, one per field). Default: new tensors.

    Returns:
        ``(batch, hit)``: ``batch`` of shape ``(len(indices), *data_dims)`` and the
        cache's dtype, whose row ``k`` is the cached sample of ``indices[k]`` where
        ``hit[k]`` and zeros elsewhere (with fields: a dict of such batches, one per
        field); ``hit``, a bool tensor of shape ``(len(indices),)``.

    Raises:
        TypeError: ``indices`` is not a sequence or 1-D array of integers (bool and float
            included), or ``out`` is not a tensor of the cache's dtype.
        IndexError: an index outside ``[0, dataset_len)`` (as ``get_slot``).
        ValueError: ``out`` has another shape, or is not a contiguous CPU tensor.
        Nothing is read or counted when one of these is raised.
    """
    self._check_open()
    idx = _checked_indices(indices, self._dataset_len)
    batch, pairs = self._batch_buffers(len(idx), out)
    located = self._locate(idx)
    if located.found.any():  # (a cache without slots has no row 0)
        for src, dst in pairs:  # (mode="clip" does not buffer; the rows are in range)
            np.take(src, located.rows, axis=0, out=dst, mode="clip")
    hit = self._confirm(located)
    if not hit.all():
        aux = self._index_states_np[idx]
        for k in np.flatnonzero(~hit).tolist():  # raced rows and a staged repeat: alone
            i = int(idx[k])
            if aux[k] == SET:
                row = self._read_again(i, True)
            elif aux[k] == OOB and self._staging_slots:
                row = self._take_staged(i)
            else:
                continue
            if row is not None:  # (counted as a hit by _read or _take_staged)
                self._put_row(batch, k, row)
                hit[k] = True
        for _, dst in pairs:
            dst[~hit] = 0
        miss = ~hit
        self._own_counters[STATS_MISSES] += int(np.count_nonzero(miss))
        self._own_counters[STATS_OOB_MISSES] += int(np.count_nonzero(miss & (aux == OOB)))
    return batch, torch.from_numpy(hit)


@property
def rows(self) -> torch.Tensor:
    """Every slot, then every staging slot, as bytes: a uint8 tensor of shape
    ``(slots + staging_slots, row_bytes)`` viewing the segment, for a reader that copies
    rows with its own means (the device loader gathers them on a GPU). Read the rows
    that ``locate`` names and keep only those that ``confirm`` then confirms; turn the
    bytes into samples with ``unpack_rows``.

    .. warning::
        Never write through it: a write here bypasses the locks and sequence numbers, and
        every process reading the cache sees it.
    """
    self._check_open()
    samples = self._slot_samples
    return torch.from_numpy(samples.reshape(len(samples), -1).view(np.uint8))


def unpack_rows(self, rows: torch.Tensor) -> Any:
    """Rows copied from ``rows`` (a uint8 tensor of shape ``(k, row_bytes)`` on any
    device) as a batch: a tensor of shape ``(k, *data_dims)`` and the cache's dtype (with
    fields, a dict of such tensors), viewing ``rows`` (no copy)."""
    return rows.view(self._dtype).view(len(rows), *self._dims)


def locate(self, indices: Any) -> BatchRows:
    """Where the cached samples of ``indices`` are: the first half of a read whose copy
    the caller makes itself (from ``rows``), the second being ``confirm``. ``get_batch``
    is this read with a numpy copy.

    A staged sample (of one of ``read_tags``, if any are set) is located in its staging
    slot, and freed by ``confirm``: until then it stays staged, so that a copy still in
    flight (a GPU's) never reads a slot given to another sample. A second occurrence of a
    staged index in ``indices`` is not found (as for ``get_batch``).

    Args:
        indices: as for ``get_batch``.

    Returns:
        a :class:`BatchRows`: ``rows[k]`` is the row of ``rows`` to copy for
        ``indices[k]`` (0 where ``found[k]`` is False: copy it anyway, or skip it).

    Raises:
        As ``get_batch`` for bad ``indices``.
    """
    self._check_open()
    return self._locate(_checked_indices(indices, self._dataset_len))


def confirm(self, located: BatchRows) -> torch.Tensor:
    """The second half of a read begun by ``locate``, once the copy of its rows is
    complete: True where the row copied holds the sample of its index, whole (no write,
    clear or unstaging ran since ``locate``); the staged samples read are freed. Call it
    once per ``locate``. Rows not confirmed are the caller's to read again
    (``get_slot``) or load; confirmed rows count as hits in ``stats()``, nothing else is
    counted.

    Returns:
        a bool tensor of shape ``(len(indices),)``.
    """
    self._check_open()
    return torch.from_numpy(self._confirm(located))


def _batch_buffers(self, k: int, out: Any) -> tuple[Any, list]:
    """The batch that ``get_batch`` returns (``out``, checked, or new) and the pairs
    (rows of every slot, numpy view of the batch) that it gathers from and into."""
    shape = (k, *self._dims)
    batch = torch.empty(shape, dtype=self._dtype) if out is None else \
        check_out(out, shape, self._dtype, "out")
    dst = (batch if self._view_as is None else batch.view(torch.uint16)).numpy()
    return batch, [(self._slot_samples, dst)]


def _put_row(self, batch: Any, k: int, row: Any) -> None:
    batch[k] = row


def _checked_indices(indices: Any, dataset_len: int) -> np.ndarray:
    """``indices`` of ``get_batch`` (and ``locate``) as a 1-D int64 array in
    ``[0, dataset_len)``, or raise naming them."""
    expect = ("a sequence or 1-D array of dataset indices "
              f"(ints in [0, {dataset_len - 1}])")
    if isinstance(indices, torch.Tensor):
        if indices.ndim != 1 or not is_integer_dtype(indices.dtype):
            raise TypeError(f"indices should be {expect}, but got a tensor of shape "
                            f"{tuple(indices.shape)} and dtype {indices.dtype}")
        idx = indices.detach().cpu().numpy().astype(np.int64, copy=False)
    elif isinstance(indices, np.ndarray):
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise TypeError(f"indices should be {expect}, but got an array of shape "
                            f"{indices.shape} and dtype {indices.dtype}")
        idx = indices.astype(np.int64, copy=False)
    elif isinstance(indices, (list, tuple, range)):
        if not all(type(i) is int for i in indices):
            for k, i in enumerate(indices):
                if not is_int(i):
                    raise TypeError(f"indices should be {expect}, but got "
                                    f"indices[{k}]={i!r} (type {type(i).__name__})")
            indices = [int(i) for i in indices]
        try:
            idx = np.array(indices, dtype=np.int64)
        except OverflowError:  # an int past int64: out of range whatever the dataset
            k = next(k for k, i in enumerate(indices) if not -2**63 <= i < 2**63)
            raise IndexError(f"indices should be dataset indices in "
                             f"[0, {dataset_len - 1}], but got "
                             f"indices[{k}]={indices[k]}") from None
        if idx.ndim != 1:  # an empty nested sequence
            raise TypeError(f"indices should be {expect}, but got indices={indices!r}")
    else:
        raise TypeError(f"indices should be {expect}, but got indices={indices!r} "
                        f"(type {type(indices).__name__})")
    bad = np.flatnonzero((idx < 0) | (idx >= dataset_len))
    if bad.size:
        k = int(bad[0])
        raise IndexError(f"indices should be dataset indices in "
                         f"[0, {dataset_len - 1}], but got indices[{k}]={int(idx[k])}")
    return idx
