"""The README's two lines, written once for every scenario that reads through a cache.

:class:`TwoLineDataset` is the pattern the README asks of a user's Dataset: ``get_slot`` and,
on a miss, decode the sample and ``set_slot`` it. A scenario says only what its samples are
(``load``) and what an item is (``item``), so every scenario measures the same two lines.
"""

from __future__ import annotations

from typing import Any

import torch


class TwoLineDataset(torch.utils.data.Dataset):
    """``__getitem__`` is the two lines around ``load``: ``cache.get_slot(index)``, else
    ``x = load(index)`` and ``cache.set_slot(index, x)``; it returns ``item(index, x, hit)``,
    where ``hit`` says the sample came from the cache.

    A subclass gives ``__len__``, ``load(index)`` (phase one: what the cache stores) and, if an
    item is more than the sample, ``item`` (phase two: an augmentation, a label). It sets
    ``cache`` to a ``SharedCache`` (or an ``OpenSizeCache``), or leaves it None: then every read
    is a miss that loads, the no-cache baseline on the same code path. ``copy`` False reads
    ``cache.get_slot(index, copy=False)``, a read-only view, which ``item`` must not write to.
    """

    cache: Any = None
    copy: bool = True

    def load(self, index: int) -> torch.Tensor:
        """Phase one: the sample ``index``, decoded (what the cache stores)."""
        raise NotImplementedError

    def item(self, index: int, x: torch.Tensor, hit: bool) -> Any:
        """What ``__getitem__`` returns for the sample ``x`` of ``index``. Default: ``x``."""
        return x

    def __getitem__(self, index: int) -> Any:
        x = None
        if self.cache is not None:
            x = self.cache.get_slot(index) if self.copy else self.cache.get_slot(index, copy=False)
        hit = x is not None
        if x is None:
            x = self.load(index)
            if self.cache is not None:
                self.cache.set_slot(index, x)  # a no-op when index has no slot
        return self.item(index, x, hit)
