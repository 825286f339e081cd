"""Reading a cached sample without a copy: ``get_slot(i, copy=False)`` returns a
``ReadOnlyView`` of the segment's read-only mapping.

A feature module of stocaching (see the core's section "The seam"): each kind of cache reads
the row of a sample through the read-only mapping, and ``BaseCache._view_of`` makes what it
read a ``ReadOnlyView``. Why a tensor subclass and not a plain tensor: docs/design.md, "A read-only
view". The two lines (``get_slot(i)``, a copy) never load it.
"""

from __future__ import annotations

__all__ = ["ReadOnlyView"]
STOCACHING_FEATURE = "views"  # (the core reads this line before it imports the file)

from typing import Any

import torch


# The in-place operators of a tensor (every other in-place method's name ends in one "_").
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
    "lshift", "rshift")) | {"__setitem__"}
_WRITES_FIRST: dict[str, bool] = {}  # does the torch function of this name write its input?


def _writes(name: str) -> bool:
    writes = _WRITES_FIRST.get(name)
    if writes is None:
        writes = _WRITES_FIRST[name] = (name[-1:] == "_" and name[-2:] != "__" and
                                        name != "requires_grad_") or name in _INPLACE_DUNDERS
    return writes


def _is_view(x: Any) -> bool:
    """True when ``x`` (a tensor, or a sequence of them: ``out=``) holds a ReadOnlyView."""
    return type(x) is ReadOnlyView or (isinstance(x, (tuple, list)) and
                                       any(type(t) is ReadOnlyView for t in x))


def _views_read_only(res: Any, of: torch.Tensor) -> Any:
    """``res`` with each tensor in it that shares ``of``'s memory made a ``ReadOnlyView``."""
    if type(res) is torch.Tensor:
        same = res.untyped_storage().data_ptr() == of.untyped_storage().data_ptr()
        return res.as_subclass(ReadOnlyView) if same else res
    if isinstance(res, (tuple, list)) and res and isinstance(res[0], torch.Tensor):
        return type(res)(_views_read_only(r, of) for r in res)
    return res


class ReadOnlyView(torch.Tensor):
    """What ``get_slot(i, copy=False)`` returns: a tensor viewing the cached sample in the
    segment's read-only mapping, without a copy. Every operation that only reads it works as
    on any tensor (and gives plain tensors); one that would write into it (an in-place method
    such as ``add_`` or ``copy_``, ``x[k] = v``, ``+=``, ``out=x``) raises RuntimeError
    instead of writing, as the memory is shared by every process of the node (a write would
    be a crash: the mapping is read-only). Its views (``x[0]``, ``x.view(...)``, ``x.t()``)
    are read-only views too, and ``x.numpy()`` and ``np.asarray(x)`` are read-only arrays.
    ``x.clone()`` gives a tensor of your own. Each operation on it costs a few microseconds
    more than on a plain tensor (docs/design.md, "A read-only view")."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func.__name__
        view = args[0] if args and type(args[0]) is ReadOnlyView else None
        if (view is not None and _writes(name)) or (kwargs and _is_view(kwargs.get("out"))):
            raise RuntimeError(
                f"{name} would write into a read-only view of the cache (get_slot(..., "
                "copy=False) views the shared memory of every process of the node, without a "
                "copy): clone it first (x = x.clone()), or read it with get_slot(i), a copy")
        with torch._C.DisableTorchFunctionSubclass():  # (the checks below too: no recursion)
            res = func(*args, **kwargs) if kwargs else func(*args)
            if view is None:
                return res
            if name in ("numpy", "__array__"):  # (np.asarray(x) calls __array__)
                res.flags.writeable = False
                return res
            return _views_read_only(res, view)
