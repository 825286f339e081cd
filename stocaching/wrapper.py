"""Cache a map-style dataset you did not write, without editing it: ``CachedDataset``.

The dataset's items are split in two at a point you name: what comes before the cache must be
deterministic (reading and decoding, the expensive part), what comes after may be random (the
augmentation). Item ``i`` of the wrapper is ``transform(decode(base[i]))``, where the value of
``decode(base[i])`` is kept in a :class:`SharedCache` after its first load, so from the second
epoch on the cached part of the dataset costs a memory copy::

    from stocaching import CachedDataset

    base = SomeLibraryDataset(root)                     # items: (uint8 image, label)
    ds = CachedDataset(base, decode=resize_to_128,      # deterministic: before the cache
                       transform=random_flip)           # random: after it
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=8)

Without ``cache=``, the cache is made from the first item: its tensors' shapes and dtypes
(a tuple or a dict of them becomes a cache of fields, a Python number a 0-d tensor), with
``size_limit_gib="auto"`` unless given. Items must then all have those shapes: pass a cache
you made yourself (an ``OpenSizeCache`` for sizes that vary) otherwise.

A random transform before the cache would be frozen into it (every epoch the same crop). The
wrapper loads the first ``verify_loads`` (3) items of each process twice and raises if the
two differ, naming the split point; two processes that load one index at once are compared by
the cache itself (``set_slot`` refuses a different value), and their error is given the same
explanation.

An opt-in part of stocaching: it imports only public names of the core module
(``stocaching.py``) and the rules for values it shares with ``streams.py`` in ``_common.py``
(internal), so copying the three files side by side into a project also works.
See docs/sources.md.
"""

from __future__ import annotations

__all__ = ["CachedDataset"]

import os
from typing import Any, Callable

import torch

try:  # inside the package
    from ._common import (_PART, _as_fields, _as_tensors, _check_options, _dims_and_dtypes,
                          _same, _unfit_value)
    from .stocaching import BaseCache, SharedCache, check_int
except ImportError:  # copied beside stocaching.py and _common.py
    from _common import (_PART, _as_fields, _as_tensors,  # type: ignore[no-redef]
                         _check_options, _dims_and_dtypes, _same, _unfit_value)
    from stocaching import BaseCache, SharedCache, check_int  # type: ignore[no-redef]


class CachedDataset(torch.utils.data.Dataset):
    """``transform(decode(base[i]))``, with ``decode(base[i])`` kept in a shared cache.

    It is a map-style dataset that works wherever ``base`` did: DataLoader workers (fork,
    spawn, forkserver), DDP ranks (every local rank builds it with the same arguments, as a
    cache; the local leader makes the segment), ``CacheAwareSampler`` (it has ``.cache``),
    and the ``Prefetcher`` and ``DeviceLoader`` (give them ``ds.cache`` and ``ds.load``).

    A value that is a tuple (an image and its label, say) is kept as a cache of fields named
    ``item0``, ``item1``, ... in its order, since field names must be identifiers; a dict's
    keys are its field names. ``ds.cache.fields`` lists them (``('item0', 'item1')``);
    ``ds[i]`` is a tuple again, while ``ds.load(i)`` and ``ds.cache.get_slot(i)`` are the
    dict of fields the cache keeps. A ``cache=`` of your own for tuple items needs those
    fields: ``SharedCache(gib, len(base), {"item0": (3, 256, 256), "item1": ()},
    {"item0": torch.uint8, "item1": torch.int64})``.

    Args:
        base: a map-style dataset (``len`` and ``base[i]``), e.g. a library's image folder or
            a Hugging Face ``datasets.Dataset``; it is not changed.
        cache: the cache to keep the values in (a ``SharedCache`` or ``OpenSizeCache`` whose
            ``dataset_len`` is ``len(base)``; for tuple values, with fields ``item0``,
            ``item1``, ...), or None to make a ``SharedCache`` from the first item's shapes
            and dtypes. Default: None.
        size_limit_gib: without ``cache``: the new cache's budget, as ``SharedCache``'s.
            Default: ``"auto"``.
        decode: ``decode(base[i])``, the deterministic part of loading that ``base`` does not
            do itself (decoding bytes, resizing to a fixed size), returning the value to
            cache: a tensor, a numpy array, a Python number, or a tuple or dict of them.
            Default: None, ``base[i]`` as it is.
        transform: ``transform(value)``, the part after the cache (random augmentation,
            normalisation), given the cached value as ``decode`` returned it (tuples as
            tuples, arrays and numbers as tensors), a new copy each time. Default: None.
        verify_loads: how many loads each process makes twice and compares, to catch a base
            or ``decode`` that is not deterministic. A random flip (p=0.5) inside the base
            escapes one comparison half the time, three 1 time in 8, in each process that
            loads (every DataLoader worker does, every epoch unless persistent). Default: 3
            (0: none).
        **cache_options: without ``cache``: other keyword arguments of ``SharedCache``
            (``name``, ``disk_tier``, ``random_subset``, ``world``, ...).

    Raises:
        RuntimeError: (from ``ds[i]``) two loads of one index gave different values.
        TypeError: an item that the cache cannot hold (a PIL image, a string): say in
            ``decode`` how to make tensors of it.
    """

    base: Any
    cache: BaseCache
    decode: Callable[[Any], Any] | None
    transform: Callable[[Any], Any] | None
    verify_loads: int
    _as_tuple: bool  # the values are tuples, kept as fields item0, item1, ...
    _verified: tuple[int, int]  # (pid, loads verified in that process)

    def __init__(self, base: Any, cache: BaseCache | None = None, *,
                 size_limit_gib: float | str = "auto",
                 decode: Callable[[Any], Any] | None = None,
                 transform: Callable[[Any], Any] | None = None, verify_loads: int = 3,
                 **cache_options: Any) -> None:
        _check_options(cache_options, "CachedDataset")
        if isinstance(base, torch.utils.data.IterableDataset):
            raise TypeError(f"base should be a map-style dataset (with __len__ and "
                            f"__getitem__), but got an IterableDataset "
                            f"({type(base).__name__}): for a stream of shards, see CachedStream")
        if not (hasattr(base, "__len__") and hasattr(base, "__getitem__")):
            raise TypeError(f"base should be a map-style dataset (with __len__ and "
                            f"__getitem__), but got base={type(base).__name__}")
        for name, fn in (("decode", decode), ("transform", transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} should be a function of one item or None, but got "
                                f"{name}={fn!r}")
        if cache is not None and not isinstance(cache, BaseCache):
            raise TypeError(f"cache should be a SharedCache or OpenSizeCache, or None to make "
                            f"one, but got cache={type(cache).__name__}")
        if cache is not None and cache_options:
            raise TypeError(f"cache options ({', '.join(sorted(cache_options))}) are for the "
                            f"cache that CachedDataset makes, but got cache= as well: give them "
                            f"to the cache you made")
        n = len(base)
        if n < 1:
            raise ValueError(f"base should have at least one item, but got len(base)={n}")
        if cache is not None and cache.dataset_len != n:
            raise ValueError(f"cache should have dataset_len=len(base)={n}, but got a cache "
                             f"with dataset_len={cache.dataset_len}")
        self.base, self.decode, self.transform = base, decode, transform
        self.verify_loads = check_int("verify_loads", verify_loads, low=0)
        self._verified = (os.getpid(), 0)
        first = self._decoded(0)
        self._as_tuple = isinstance(first, tuple)
        if cache is None:
            cache = SharedCache(size_limit_gib, n, *_dims_and_dtypes(first), **cache_options)
        self.cache = cache

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        if type(i) is int and -len(self.base) <= i < 0:
            i += len(self.base)  # (as a list, and most datasets, read base[-1])
        value = self.cache.get_slot(i)
        if value is None:
            value = self.load(i)
            self._store(i, value)
        value = self._as_given(value)
        return value if self.transform is None else self.transform(value)

    def load(self, i: int) -> Any:
        """The value of item ``i`` as the cache keeps it (``decode(base[i])``, made of tensors):
        what a ``Prefetcher`` or ``DeviceLoader`` over ``ds.cache`` is given as ``load``."""
        value = self._decoded(i)
        pid, verified = self._verified
        if pid != os.getpid():  # a DataLoader worker: its own first loads are checked
            verified = 0
        if verified < self.verify_loads:
            again = self._decoded(i)
            if not _same(value, again):
                raise RuntimeError(self._not_deterministic(i, "two loads in one process"))
            verified += 1
        self._verified = (os.getpid(), verified)
        return _as_fields(value) if self._as_tuple else value

    def close(self) -> None:
        """Close the cache (in this process)."""
        self.cache.close()

    def __enter__(self) -> "CachedDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the split point ------------------------------------------------------------------

    def _decoded(self, i: int) -> Any:
        item = self.base[i]
        value = item if self.decode is None else self.decode(item)
        return _as_tensors(value, "decode(base[i])" if self.decode else "base[i]")

    def _store(self, i: int, value: Any) -> None:
        try:
            self.cache.set_slot(i, value)
        except (ValueError, TypeError) as e:  # not what the cache was made for
            raise _unfit_value(e, f"index {i}", "decode(base[i])" if self.decode else
                               "base[i]", "index 0") from e
        except RuntimeError as e:  # another process stored a different value first?
            held = self.cache.get_slot(i)
            if held is None or _same(held, value):
                raise
            raise RuntimeError(self._not_deterministic(i, "two processes' loads")) from e

    def _as_given(self, value: Any) -> Any:
        if self._as_tuple:
            return tuple(value[_PART.format(k)] for k in range(len(value)))
        return value

    def _not_deterministic(self, i: int, how: str) -> str:
        before = "base[i]" if self.decode is None else \
            f"base[i] then decode={getattr(self.decode, '__name__', self.decode)!r}"
        return (f"CachedDataset: {how} of index {i} gave different values, so the part "
                f"before the cache ({before}) is not deterministic: a random transform "
                f"inside {type(self.base).__name__} or decode would be frozen into the cache "
                "(the same crop every epoch). Move the random part after the cache: give "
                "the base dataset no random transform, and pass it as transform=")
