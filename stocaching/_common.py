"""An internal module shared by the opt-in modules: its names are not public API.

It imports only the core's public names (those in ``stocaching.py``'s ``__all__``), so it also
works copied beside ``stocaching.py``, next to the opt-in modules that use it.

Contents: resuming a sampler (where an epoch's iterator stands, and how a saved state is
checked).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

####################################################################################################
# Resuming a sampler ###############################################################################
####################################################################################################


class EpochPosition:
    """Where a sampler stands in its epoch: the position a loaded state resumes from, and
    the latest iterator, which tells how many indices of its epoch were consumed.

    For a sampler whose epoch is an array of indices computed when an iterator starts
    (``CacheAwareSampler``, ``WeightedMixtureSampler``). The sampler keeps its own ``epoch``
    and passes it in; this object keeps only the position.
    """

    def __init__(self) -> None:
        self.resume_from = 0  # indices of the epoch that the next iterator skips (a resume)
        self._iterator: Iterator[int] | None = None  # the latest iterator, and what it covers:
        self._iterator_epoch = self._iterator_start = self._iterator_len = 0

    def consumed(self, epoch: int) -> int:
        """Indices of ``epoch`` consumed: where the latest iterator of that epoch started plus
        what it has yielded, else the position a resume would start from."""
        if self._iterator is None or self._iterator_epoch != epoch:
            return self.resume_from
        # A list iterator's length hint is exactly the number of items it has left.
        left = self._iterator.__length_hint__()  # type: ignore[attr-defined]
        return self._iterator_start + self._iterator_len - left

    def load(self, consumed: int) -> None:
        """Resume at ``consumed`` (checked by the caller): the next iterator starts there."""
        self.resume_from, self._iterator = consumed, None

    def leave_epoch(self, new_epoch: int, epoch: int, length: int) -> None:
        """``set_epoch(new_epoch)`` of another epoch than ``epoch`` (of ``length`` indices per
        rank): a loaded position is dropped, with a warning if it was mid-epoch."""
        warn_position_discarded(new_epoch, epoch, self.resume_from, length, stacklevel=3)
        self.resume_from = 0

    def iterate(self, epoch: int, indices_of: Callable[[int], np.ndarray], *,
                warn_again: bool = True) -> Iterator[int]:
        """A new iterator of ``epoch``: ``indices_of(epoch)`` from the loaded position, if any.

        An iterator of the same epoch that has yielded nothing is replaced, at its position
        (loaders such as torchdata's ``StatefulDataLoader`` create one, then load a state,
        then create another). Iterating an epoch again after its iterator has yielded starts
        it over and, with ``warn_again``, warns that ``set_epoch`` was forgotten.
        """
        start, self.resume_from = self.resume_from, 0
        if self._iterator is not None and self._iterator_epoch == epoch:
            if self.consumed(epoch) == self._iterator_start:
                start = self._iterator_start
            elif warn_again:
                warnings.warn(f"epoch {epoch} is iterated again, in the same order; call "
                              f"sampler.set_epoch(epoch) before each epoch", stacklevel=3)
        indices = indices_of(epoch)[start:].tolist()
        self._iterator = iter(indices)
        self._iterator_epoch, self._iterator_start = epoch, start
        self._iterator_len = len(indices)
        return self._iterator


def warn_position_discarded(new_epoch: int, loaded_epoch: int, consumed: int, length: int, *,
                            stacklevel: int = 2) -> None:
    """Warn, when ``consumed`` is mid-epoch (of ``length`` indices), that ``set_epoch
    (new_epoch)`` drops the position loaded for ``loaded_epoch``. ``stacklevel`` counts from
    the caller, as ``warnings.warn``'s: 2 names the line that called the caller."""
    if 0 < consumed < length:
        warnings.warn(f"set_epoch({new_epoch}) discards the resume position loaded for epoch "
                      f"{loaded_epoch} ({consumed} of {length} indices consumed)",
                      stacklevel=stacklevel + 1)


def check_state_fields(state: Any, source: str, required: Iterable[str], *,
                       detail: str = "") -> None:
    """Refuse what is not a saved state of ``source`` (a class's name): a ``TypeError`` for
    anything but a mapping, a ``ValueError`` naming the ``required`` fields it lacks.
    ``detail`` follows ``source.state_dict()`` in the second message."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state should be a dict from {source}.state_dict(), but got "
                        f"{type(state).__name__}")
    missing = sorted(set(required) - set(state))
    if missing:
        raise ValueError(f"state should be a dict from {source}.state_dict(){detail}, but it "
                         f"lacks {missing}")


def refuse_changed_fields(state: Mapping[str, Any], own: Mapping[str, Any],
                          fields: Iterable[str], *, owner: str = "sampler",
                          consequence: str = "") -> None:
    """Refuse a saved state whose ``fields`` differ from ``own`` (the loader's own values):
    the ``ValueError`` names the field, both values and ``consequence``. A field that the
    state lacks (saved by an older version) is not compared."""
    for field in fields:
        if field in state and state[field] != own[field]:
            raise ValueError(f"state['{field}'] should be this {owner}'s {field}="
                             f"{own[field]!r}, but got state['{field}']={state[field]!r}"
                             f"{consequence}")
