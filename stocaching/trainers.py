"""What a trainer did to a sampler: public helpers for the opt-in samplers and their authors.

Lightning and accelerate drive a sampler from outside: Lightning's ``_DatasetSamplerWrapper``
lists a sampler to split it over the ranks again, and a loader prepared by ``accelerate`` deals
the batches a sampler draws to its processes. These functions tell a sampler's ``__iter__``
which of them is at work, so that it can warn or deal itself (``samplers.py``, ``order.py``,
``prefetch.py`` and ``mixtures.py`` use them). They need only the standard library: copy this
file beside ``stocaching.py`` with those modules.
"""

from __future__ import annotations

__all__ = ["accelerate_epoch", "dealt_by_accelerate", "in_lightnings_wrapper"]

import sys
from typing import Any


def in_lightnings_wrapper() -> bool:
    """True when the caller, a sampler's ``__iter__``, runs for Lightning's
    ``_DatasetSamplerWrapper``, which lists a sampler that is not a ``DistributedSampler`` to
    split it over the ranks again (its ``reset`` and ``__getitem__`` call ``list(sampler)``, so
    it is the frame right above ``__iter__``). Lightning offers no other sign; if it changes,
    this says False and only the warning is lost. The frame's code and module are read, never
    its ``f_locals``: that builds a snapshot of the caller's locals which the frame keeps, so
    an object the caller then deletes (a prefetcher, whose finalizer stops its loader
    processes) would live on until the caller returns."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # __iter__ called from no Python frame
        return False
    code, module = frame.f_code, frame.f_globals.get("__name__", "")
    del frame
    name = getattr(code, "co_qualname", None)  # Python 3.11+
    where = name.split(".")[0] == "_DatasetSamplerWrapper" if name is not None else \
        code.co_name in ("reset", "__getitem__")
    return where and module.startswith(("lightning", "pytorch_lightning"))


def dealt_by_accelerate(sampler: Any) -> Any:
    """The ``BatchSamplerShard`` of a loader prepared by ``accelerate`` that draws its batches
    from ``sampler`` right now and deals them to its processes, else None. ``sampler`` may sit
    inside the loader's sampler, as the ``base`` of a ``Prefetcher`` or a
    ``ReadyFirstSampler``, and the shard inside wrappers of its own (the ``SkipBatchSampler``
    of ``skip_first_batches``, which the Hugging Face ``Trainer`` puts around it to resume mid-
    epoch). A prepared loader registers as the ``active_dataloader`` of accelerate's
    ``GradientState`` before it starts drawing, which is when a sampler's ``__iter__`` runs.
    Nothing is imported: without accelerate, None."""
    found = _accelerate_deal(sampler)
    return None if found is None else found[1]


def accelerate_epoch(sampler: Any) -> int | None:
    """The epoch of the loader prepared by ``accelerate`` that deals from ``sampler`` right now
    (see ``dealt_by_accelerate``), else None: its ``iteration``, which the prepared loader
    passes to ``set_epoch`` at every ``iter()``, also where that call cannot reach the sampler
    (inside the ``SkipBatchSampler`` of a resumed epoch)."""
    found = _accelerate_deal(sampler)
    epoch = None if found is None else getattr(found[0], "iteration", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def _accelerate_deal(sampler: Any) -> tuple[Any, Any] | None:
    """(the prepared loader, its ``BatchSamplerShard``) when it deals from ``sampler``."""
    state, loaders = sys.modules.get("accelerate.state"), sys.modules.get("accelerate.data_loader")
    if state is None or loaders is None or not getattr(state.GradientState, "_shared_state", None):
        return None
    try:
        active = state.GradientState().active_dataloader
    except Exception:  # noqa: BLE001 - a state we do not understand is not a prepared loader
        return None
    shard = getattr(active, "batch_sampler", None)
    for _ in range(4):  # down wrappers such as SkipBatchSampler to the shard
        if isinstance(shard, loaders.BatchSamplerShard):
            break
        shard = getattr(shard, "batch_sampler", None)
    if not isinstance(shard, loaders.BatchSamplerShard) or shard.num_processes < 2:
        return None
    inner = shard.batch_sampler
    drawn = inner if inner is sampler else getattr(inner, "sampler", None)
    for _ in range(8):  # down the wrappers' bases
        if drawn is sampler:
            return active, shard
        drawn = getattr(drawn, "base", None)
    return None
