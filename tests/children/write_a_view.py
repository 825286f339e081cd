"""Try every way of writing through the read-only view that get_slot(copy=False) returns, in a
cache of each kind: each must raise RuntimeError (or numpy's ValueError for ``x.numpy()``) and
leave the cache as it was; before ReadOnlyView, the first one killed the process with SIGSEGV.

Usage: write_a_view.py SHM_DIR. Prints one line "KIND WAY raised|WROTE" per try, then "done".
"""

import sys

import numpy as np
import torch

import stocaching

WAYS = {
    "add_": lambda v: v.add_(1),
    "copy_": lambda v: v.copy_(torch.ones_like(v)),
    "setitem": lambda v: v.__setitem__(0, 5),
    "iadd": lambda v: v.__iadd__(1),
    "fill_ of a view of it": lambda v: v[:2].fill_(3),
    "mul_ of a dtype view": lambda v: v.view(torch.int8).mul_(2),
    "zero_ of its .data": lambda v: v.data.zero_(),
    "add_ of its detach()": lambda v: v.detach().add_(1),
    "add_ of a reshape": lambda v: v.reshape(-1).add_(1),
    "add_ of unbind()'s": lambda v: v.unbind(0)[0].add_(1),
    "torch.add out=": lambda v: torch.add(v, 1, out=v),
    "torch.Tensor.add_": lambda v: torch.Tensor.add_(v, 1),
    "its numpy()": lambda v: v.numpy().__setitem__(0, 1),
    "np.asarray of it": lambda v: np.asarray(v).__setitem__(0, 1),
}


def tries(kind: str, cache, first: torch.Tensor, fields: bool = False) -> None:
    cache.set_slot(1, {"x": first} if fields else first)
    for way, write in WAYS.items():
        view = cache.get_slot(1, copy=False)
        view = view if isinstance(view, torch.Tensor) else view["x"]
        try:
            write(view)
            print(kind, way, "WROTE", flush=True)
        except (RuntimeError, ValueError):
            print(kind, way, "raised", flush=True)
        got = cache.get_slot(1)
        assert torch.equal(got if isinstance(got, torch.Tensor) else got["x"], first), way
    view = cache.get_slot(1, copy=False)
    view = view if isinstance(view, torch.Tensor) else view["x"]
    out = view.float().div_(255)  # what a transform after the cache does: a new tensor
    assert type(out) is torch.Tensor and torch.equal(out, first.float() / 255)
    assert type(view.clone().add_(1)) is torch.Tensor  # a clone is the caller's own


d = sys.argv[1]
x = torch.arange(8, dtype=torch.uint8).reshape(2, 4)
tries("rows", stocaching.SharedCache(1e-4, 10, (2, 4), shm_dir=d, name="rows"), x)
tries("fields", stocaching.SharedCache(1e-4, 10, {"x": (2, 4)}, dtype={"x": torch.uint8},
                                       shm_dir=d, name="fields"), x, fields=True)
tries("open", stocaching.OpenSizeCache(1e-4, 10, (None, 4), shm_dir=d, name="open"), x)
print("done", flush=True)
