"""Samples of several fields (``SharedCache(..., data_dims={"image": (3, 256, 256),
"label": ()})``): the cache whose slot holds the fields packed one after the other.

A feature module of stocaching (see the core's section "The seam"): ``SharedCache.__new__``
makes a ``_FieldsCache`` for a dict ``data_dims``, whose fields ``check_fields`` checks and packs
(the packing rule, ``pack_fields``, and the field table of the segment's header are the core's:
the format every kind of cache shares). ``OpenSizeCache`` and ``plan`` check a dict
``data_dims`` here too.
"""

from __future__ import annotations

__all__ = []
STOCACHING_FEATURE = "fields"  # (the core reads this line before it imports the file)

import mmap
import warnings
from typing import Any, Mapping

import numpy as np
import torch

try:  # inside the package
    from .stocaching import (DTYPE_CODES, FIELD_NAME_BYTES, MAX_FIELDS, BaseCache, Closed,
                             Field, SharedCache, check_dims, check_dtype, checked_value,
                             feature_module, pack_fields, slot_array, torch_of)
except ImportError:  # copied beside stocaching.py
    from stocaching import (DTYPE_CODES, FIELD_NAME_BYTES, MAX_FIELDS, BaseCache, Closed, Field,
                            SharedCache, check_dims, check_dtype, checked_value, feature_module,
                            pack_fields, slot_array, torch_of)


def check_fields(data_dims: Mapping, dtype: Any) -> tuple[tuple[Field, ...], int]:
    """The fields of ``data_dims={name: dims}`` and ``dtype`` (one dtype for every field, or a
    dict with the same keys), packed in the order given, each at a multiple of its itemsize
    (as a C struct); returns them and the bytes of one slot (a multiple of the largest
    itemsize, so every slot is aligned too)."""
    if not 1 <= len(data_dims) <= MAX_FIELDS:
        raise ValueError(f"data_dims should be a tuple of positive ints, or a dict of 1 to "
                         f"{MAX_FIELDS} fields, but got data_dims={dict(data_dims)!r}")
    for name in data_dims:
        if not isinstance(name, str):
            raise TypeError(f"data_dims keys should be field names (str), but got "
                            f"{name!r} (type {type(name).__name__})")
        if not (name.isascii() and name.isidentifier() and len(name) <= FIELD_NAME_BYTES):
            raise ValueError(f"data_dims keys should be field names of 1 to "
                             f"{FIELD_NAME_BYTES} ASCII letters, digits and '_', not starting "
                             f"with a digit, but got {name!r}")
    dims = {n: check_dims(d, f"data_dims[{n!r}]", scalar=True) for n, d in data_dims.items()}
    if isinstance(dtype, Mapping):
        if list(dtype) != list(dims):
            missing = [n for n in dims if n not in dtype]
            extra = [n for n in dtype if n not in dims]
            why = (f"missing {missing}" if missing else "") + \
                (", " if missing and extra else "") + (f"unknown {extra}" if extra else "")
            raise ValueError(f"dtype should be a torch dtype, or a dict with the keys of "
                             f"data_dims in its order {list(dims)}, but got dtype with keys "
                             f"{list(dtype)}" + (f" ({why})" if why else ""))
        dtypes = {n: check_dtype(dtype[n], f"dtype[{n!r}]") for n in dims}
    else:
        one = check_dtype(dtype)
        dtypes = {n: one for n in dims}
    return pack_fields(dims, dtypes)


def check_keys(value: Any, dims: Mapping) -> Mapping:
    """``value`` if it is a dict with exactly the fields of ``dims`` (a cache's
    ``data_dims``) as keys, or raise."""
    names = list(dims)
    if not isinstance(value, Mapping):
        raise TypeError(f"value should be a dict with the fields {names} (the keys of "
                        f"data_dims), but got value of type {type(value).__name__}")
    missing = [n for n in names if n not in value]
    extra = [k for k in value if k not in dims]
    if missing or extra:
        why = ", ".join(([f"missing {missing}"] if missing else []) +
                        ([f"unknown {extra}"] if extra else []))
        raise ValueError(f"value should be a dict with the fields {names} (the keys of "
                         f"data_dims), but got value with keys {list(value)} ({why})")
    return value


class _FieldsCache(SharedCache):
    """A SharedCache of several fields per sample (``data_dims`` a dict): ``SharedCache(...)``
    makes one. A slot holds the fields packed one after the other (``Field.offset``), and is
    read and written whole under the slot's sequence number and lock, as a single tensor is;
    ``get_slot`` returns a dict of tensors and ``set_slot`` takes one. The single-tensor class
    keeps its own hit path, untouched by this one."""

    _packs_fields = True

    # -- state: SharedCache's, and the fields' views of each slot's row ---------------------
    _row_bytes: int  # one slot: every field, packed
    _field_arrays: dict[str, torch.Tensor]  # each field of every slot
    _read_only_fields: dict[str, torch.Tensor]  # the same through the read-only mapping

    @property
    def _slot_bytes(self) -> int:
        return check_fields(self._dims, self._dtype)[1]

    def _map_slots(self, data_off: int, n_slots: int) -> None:
        self._row_bytes = row_bytes = self._slot_bytes

        def rows_of(buf: mmap.mmap) -> np.ndarray:
            return np.frombuffer(buf, np.uint8, n_slots * row_bytes, data_off).reshape(
                n_slots, row_bytes)

        def fields_of(rows: np.ndarray) -> dict[str, np.ndarray]:  # views, never copies
            return {f.name: rows[:, f.offset: f.offset + f.nbytes].view(
                DTYPE_CODES[f.dtype][1]).reshape(n_slots, *f.dims) for f in self._fields}

        self._slot_samples = rows_of(self._segment.mapping)  # _write, clear() and deepcopy's
        self._view_as = self._fast_dtype = None
        self._field_arrays = fields_of(self._slot_samples)
        self._array = {f.name: torch_of(self._field_arrays[f.name][:self._layout.slots], f.dtype)
                       for f in self._fields}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": intended
            ro = fields_of(rows_of(self._segment.read_only_mapping))
            self._read_only_fields = {f.name: torch_of(ro[f.name], f.dtype) for f in self._fields}

    def _unmap(self) -> None:
        closed = Closed(type(self))
        self._field_arrays = self._read_only_fields = closed  # type: ignore
        super()._unmap()

    get_slot = BaseCache.get_slot

    def _view_row(self, row: int) -> dict[str, torch.Tensor]:
        return self._view_of({n: t[row] for n, t in self._read_only_fields.items()})

    def _from_row(self, row: np.ndarray) -> dict[str, torch.Tensor]:
        """The fields in a copy of a slot's bytes: tensors that share that one copy."""
        return {f.name: torch_of(row[f.offset: f.offset + f.nbytes].view(
            DTYPE_CODES[f.dtype][1]).reshape(f.dims), f.dtype) for f in self._fields}

    def _check_value(self, value: Any) -> dict[str, torch.Tensor]:
        """Raise unless ``value`` is a dict of exactly the cache's fields, each of which
        ``SharedCache._checked`` accepts (a number is taken for a field of shape ``()``);
        return the checked tensors. Nothing is stored."""
        value = check_keys(value, self._dims)
        out = {}
        for f in self._fields:
            v = value[f.name]
            if not f.dims and isinstance(v, (int, float, complex, np.generic)):
                v = torch.tensor(v)  # a label as a number (bool too)
            out[f.name] = checked_value(v, f.dims, f.dtype, f"value[{f.name!r}]",
                                        f"data_dims[{f.name!r}]")
        return out

    def _source_array(self, value: Any) -> np.ndarray:
        """The bytes of a slot: every field of ``value``, checked, packed at its offset."""
        checked = self._check_value(value)
        row = np.zeros(self._row_bytes, np.uint8)  # the padding is 0 too
        for f in self._fields:
            a = np.ascontiguousarray(slot_array(checked[f.name], f.dtype))
            row[f.offset: f.offset + f.nbytes] = a.reshape(-1).view(np.uint8)
        return row

    def _batch_buffers(self, k: int, out: Any) -> tuple[Any, list]:
        names = list(self._dims)
        if out is not None and (not isinstance(out, Mapping) or set(out) != set(names)):
            got = f"keys {list(out)}" if isinstance(out, Mapping) else \
                f"type {type(out).__name__}"
            raise TypeError(f"out should be a dict of tensors with the fields {names}, but "
                            f"got out of {got}")
        batch = {f.name: torch.empty((k, *f.dims), dtype=f.dtype) if out is None else
                 feature_module("batches").check_out(out[f.name], (k, *f.dims), f.dtype,
                                                     f"out[{f.name!r}]")
                 for f in self._fields}
        views = {n: b.view(torch.uint16) if b.dtype is torch.bfloat16 else b
                 for n, b in batch.items()}
        return batch, [(self._field_arrays[n], views[n].numpy()) for n in names]

    def _put_row(self, batch: Any, k: int, row: Any) -> None:
        for n, t in row.items():
            batch[n][k] = t

    def unpack_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f.name: rows[:, f.offset: f.offset + f.nbytes].view(f.dtype).view(
            len(rows), *f.dims) for f in self._fields}

    def __getitem__(self, slot: Any) -> dict[str, torch.Tensor]:
        """Raw slot access: ``cache[s]`` is a dict of views of slot ``s``'s fields."""
        return {n: t[slot] for n, t in self._array.items()}

    def __setitem__(self, slot: Any, value: Any) -> None:
        """Raw slot write of a dict of every field, with torch's assignment rules per field
        (as ``SharedCache.__setitem__``)."""
        self._check_open()
        if not isinstance(value, Mapping) or set(value) != set(self._dims):
            got = f"keys {list(value)}" if isinstance(value, Mapping) else \
                f"type {type(value).__name__}"
            raise TypeError(f"value should be a dict with the fields {list(self._dims)}, but "
                            f"got value of {got}")
        slot, first, count = self._raw_slots(slot)
        with self._writing(first, count):
            for n, t in self._array.items():
                t[slot] = value[n]
