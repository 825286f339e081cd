"""Which indices a cache holds, as masks and lists: what the opt-in samplers, orders and the
prefetcher ask a cache (``slot_mask``, ``stored_mask``, ``ready_mask``, ``cached_indices``,
``owner_rows``).

A feature module of stocaching (see the core's section "The seam"): these functions are the
cache's methods (``BaseCache.ready_mask = _FromFeature("masks")``), so their first argument is
the cache. Copy it beside ``stocaching.py`` with the opt-in modules; the two lines never call
it.
"""

from __future__ import annotations

__all__ = []
STOCACHING_FEATURE = "masks"  # (the core reads this line before it imports the file)

from typing import Any, Iterator

import numpy as np

try:  # inside the package
    from .stocaching import MAX_STAGE_TAG, OOB, SET, check_int
except ImportError:  # copied beside stocaching.py
    from stocaching import MAX_STAGE_TAG, OOB, SET, check_int  # type: ignore[no-redef]


def cached_indices(self) -> np.ndarray:
    """Dataset indices that have a slot on this node, in slot order."""
    return self._layout.indices(self._world.node_rank)


def owner_rows(self) -> Iterator[np.ndarray]:
    """For each node in turn, which dataset indices it reads without loading them, as a
    bool array of ``dataset_len``: those with a slot there (``layout.owner_rows()``) and,
    with a disk tier, those with a row on that node's tier. ``CacheAwareSampler`` routes
    each sample to a node whose row holds it."""
    if self._disk_tier is not None:
        return self._disk_tier.owner_rows(self._layout)
    return self._layout.owner_rows()


def slot_mask(self, indices: Any = None) -> np.ndarray:
    """True where the dataset index has a slot on this node (``set_slot`` can store its
    sample; without one, only a staging slot can hold it), for ``indices`` (default:
    every dataset index). Fixed for the cache's life.

    Args:
        indices: dataset indices. Default: None, every index.
    """
    self._check_open()
    states = self._index_states_np
    return states != OOB if indices is None else \
        states[np.asarray(indices, dtype=np.int64)] != OOB


def stored_mask(self, indices: Any = None) -> np.ndarray:
    """True where the index's slot holds its sample now (staged samples do not count:
    see ``ready_mask``), for ``indices`` (default: every dataset index). A snapshot.

    Args:
        indices: dataset indices. Default: None, every index.
    """
    self._check_open()
    states = self._index_states_np
    return states == SET if indices is None else \
        states[np.asarray(indices, dtype=np.int64)] == SET


def ready_mask(self, indices: Any = None, *, tag: int | None = None) -> np.ndarray:
    """True where ``get_slot`` would return a sample now (its slot is set, or it is
    staged), for ``indices`` (default: every dataset index). A snapshot: it may change
    right after.

    Args:
        indices: dataset indices. Default: None, every index.
        tag: when given, a staged sample counts only if it was staged with this tag (a
            prefetcher asks what *it* staged: a sample another rank staged is that rank's
            to read). Default: None, any staged sample.
    """
    if tag is not None:
        tag = check_int("tag", tag, low=0, high=MAX_STAGE_TAG)
    aux = self._index_states_np
    idx = np.arange(self._dataset_len) if indices is None else \
        np.asarray(indices, dtype=np.int64)
    ready = aux[idx] == SET
    if self._staging_slots:
        staged = self._staging.staged_indices(() if tag is None else (tag,))
        if staged.size:
            # A binary search in the sorted staged indices, not np.isin: see
            # docs/design.md, "The staged indices in ready_mask".
            pos = np.minimum(np.searchsorted(staged, idx), staged.size - 1)
            ready |= staged[pos] == idx
    return ready
