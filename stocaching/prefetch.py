"""Keep misses off the training path: a prefetcher and the cache-preferring order.

:class:`Prefetcher` is a ``DataLoader`` sampler that loads the samples the loader will ask for
next, with many loads in flight, into the cache (or, for indices without a slot, into the
cache's staging slots), and yields an index only once its sample is there. The dataset keeps
its two lines (``get_slot``, and ``load`` + ``set_slot`` on a miss); enabling it is one line::

    from torch.utils.data import DataLoader, RandomSampler
    from stocaching import Prefetcher

    # dataset.cache = SharedCache(..., staging_slots=512); dataset.load(i) -> decoded tensor
    sampler = Prefetcher(RandomSampler(dataset), dataset.cache, dataset.load, window=256)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=2)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                 # forwarded to the base sampler, if it has one
        for batch in loader:
            ...

:class:`ReadyFirstSampler` (which the prefetcher uses when given a ``window``) wraps any base
order (``RandomSampler``, ``DistributedSampler``, :class:`~stocaching.CacheAwareSampler`, ...)
and, within a window of ``W`` positions, emits the indices whose samples are ready before those
that are not. Every index of the base order still comes exactly once per epoch, and none moves
more than ``W`` positions from where the base order put it.

Reordering cannot change how many misses an epoch has ((1 - f) * N with a fraction f of the
dataset cached); the prefetcher hides their latency, and the order gives it lead time and
routes around misses that are not loaded yet. See docs/prefetch.md and docs/order.md.

This module imports only public names of ``stocaching``, so it also works copied next to
``stocaching.py``.
"""

from __future__ import annotations

__all__ = ["PrefetchError", "Prefetcher", "ReadyFirstSampler", "WIDE_WINDOW_PART", "ready_first_order"]

import collections
import contextlib
import functools
import hashlib
import inspect
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import secrets
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

try:  # inside the package
    from .stocaching import (MAX_STAGE_TAG, BaseCache, SharedCache, check_int,
                             dealt_by_accelerate, in_lightnings_wrapper)
except ImportError:  # copied beside stocaching.py
    from stocaching import (MAX_STAGE_TAG, BaseCache, SharedCache,  # type: ignore[no-redef]
                            check_int, dealt_by_accelerate, in_lightnings_wrapper)

logger = logging.getLogger("stocaching")

#: The two modes of :class:`ReadyFirstSampler`.
MODES = ("fixed", "adaptive")
#: Steps between two readiness queries in "adaptive" mode, unless ``refresh_every`` is given
#: (at most this, and at most the window).
DEFAULT_REFRESH = 64
# Indices converted to Python ints at a time while yielding.
_YIELD_CHUNK = 65536

ReadyFn = Callable[[np.ndarray], Any]


def _nbytes(bits: int) -> int:
    return (bits + 7) // 8


# ----------------------------------------------------------------------------------------------
# The order itself
# ----------------------------------------------------------------------------------------------


def _dtype(n: int, window: int) -> type:
    """The integer type for base positions and steps of an n-index epoch: int32 when
    everything fits (half the memory traffic), else int64."""
    return np.int32 if 2 * n + window < 2**31 else np.int64


def _split(mask: np.ndarray, lo: int, dtype: type,
           keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``lo + i`` (where ``keep[i]``, if given) split into (not ready, ready) by
    ``mask[i]``, both sorted."""
    pos = np.arange(lo, lo + mask.size, dtype=dtype)
    if keep is not None:
        pos, mask = pos[keep], mask[keep]
    return pos[~mask], pos[mask]


def _schedule(u: np.ndarray, r: np.ndarray, t0: int, window: int, nsteps: int) -> np.ndarray:
    """Base positions emitted at output steps ``t0 .. t0 + nsteps - 1``.

    The rule, at output step t: the pending position t - window, if any, is emitted (its
    deadline); otherwise the smallest pending ready position <= t + window; otherwise the
    smallest pending position. Pending ready and pending not-ready positions thus each leave
    in increasing order, and the order is a merge of the two: the k-th not-ready one leaves at

        s_k = min(u_k + W - t0, max(s_{k-1} + 1, T_k))       (steps relative to t0)

    where T_k is the first step at which no ready position is pending after k not-ready ones
    have left. Both ``u_k + W - t0 - k`` and ``T_k - k`` are non-decreasing, which makes
    ``s_k - k`` the running maximum of their minimum: the whole merge is vectorised, O(n).

    Args:
        u: sorted positions not yet emitted at step t0 that are not ready, all >= t0 - window.
        r: the same for the ready ones.
        t0: the first step to compute.
        window: W.
        nsteps: steps to compute. Every position that may be admitted during them (up to
            t0 + nsteps - 1 + window) must be in ``u`` or ``r``; positions past the last one
            given are treated as past the end of the epoch.
    """
    it = np.result_type(u.dtype, r.dtype)
    if nsteps <= 0:
        return np.zeros(0, dtype=it)
    nu = u.size
    if nu == 0:
        return r[:nsteps].copy()
    edge = t0 + window  # the last position admitted at step t0
    first = int(np.searchsorted(r, edge, side="right"))  # ready ones admitted at step t0
    late = r[first:int(np.searchsorted(r, edge + nsteps))] - edge
    admits_ready = np.zeros(nsteps, dtype=bool)  # steps 1 .. nsteps-1 admitting a ready one
    admits_ready[late] = True
    # h(d) = d - (ready ones admitted by step d) starts at -first and rises by one at each
    # step d >= 1 that admits no ready position; T_k is the first step with h(d) >= k, that
    # is rises[k + first - 1] (0 if k + first - 1 < 0, past the steps if there is none).
    rises = np.flatnonzero(~admits_ready)[1:]  # step 0 never admits: drop it
    del admits_ready, late
    T = np.full(nu, nsteps, dtype=it)
    skip = 1 if first == 0 else 0  # T_0 = 0 when no ready position is admitted at step 0
    T[:skip] = 0
    got = rises[first - 1 + skip:first - 1 + nu]
    T[skip:skip + got.size] = got
    del rises, got
    k = np.arange(nu, dtype=it)
    T -= k
    slack = u - k  # deadline - k, less (window - t0)
    slack += window - t0
    np.minimum(T, slack, out=T)
    del slack
    np.maximum.accumulate(T, out=T)
    T += k  # T is now s_k, the step at which the k-th not-ready position leaves
    del k
    m = int(np.searchsorted(T, nsteps))  # not-ready ones emitted within the steps
    take_u = np.zeros(nsteps, dtype=bool)
    take_u[T[:m]] = True
    out = np.empty(nsteps, dtype=it)
    out[take_u] = u[:m]
    out[~take_u] = r[:nsteps - m]
    return out


def ready_first_order(ready: Any, window: int) -> np.ndarray:
    """Base positions in the cache-preferring shuffle-buffer order, for a fixed ready mask.

    The pure function behind ``ReadyFirstSampler(mode="fixed")``: output position t takes
    base position t - ``window`` if that one is still pending, else the ready pending
    position with the smallest base position up to t + ``window``, else the smallest pending
    position. The result is a permutation of ``range(len(ready))`` with
    ``abs(result[t] - t) <= window`` for every t. O(n) time and memory.

    Args:
        ready: a 1-D bool array (or sequence): ``ready[b]`` says whether the sample at base
            position b is ready.
        window: W, an int >= 1.

    Returns:
        An int64 array of base positions, one per output position.
    """
    window = check_int("window", window, low=1)
    mask = np.asarray(ready)
    if mask.ndim != 1 or mask.dtype != np.bool_:
        raise TypeError(f"ready should be a 1-D bool array, but got an array of shape "
                        f"{mask.shape} and dtype {mask.dtype}")
    order = _schedule(*_split(mask, 0, _dtype(mask.size, window)), 0, window, mask.size)
    return order.astype(np.int64, copy=False)


# ----------------------------------------------------------------------------------------------
# One epoch's iteration
# ----------------------------------------------------------------------------------------------


class _Epoch:
    """What one iterator knows about its epoch: the base order, the output positions it has
    computed, what was emitted before its first step, and (fixed mode) the ready mask."""

    def __init__(self, epoch: int, indices: np.ndarray, window: int, start: int,
                 pre_bits: np.ndarray, base_state: Any, mask: np.ndarray | None) -> None:
        self.epoch = epoch
        self.indices = indices                 # the base order (int64)
        self.n = indices.size
        self.window = window
        self.start = start                     # first output step this iterator yields
        # Emitted before ``start``: every position below pre_lo, and those whose bit is set
        # in pre_bits (over positions [pre_lo, pre_lo + pre_bits.size)); none above.
        self.pre_lo = max(0, start - window)
        self.pre_bits = pre_bits
        # out[t - start]: the base position emitted at step t, for start <= t < computed.
        self.out = np.empty(self.n - start, dtype=_dtype(self.n, window))
        self.computed = start
        # The list iterator being yielded from, with the step of its first item and its
        # length: its length hint tells how many it has handed out.
        self.chunk: tuple[int, int, Iterator[int]] = (start, 0, iter(()))
        self.base_state = base_state           # the base's state at the epoch's start
        # The state of the base's generator at the epoch's start and after its draw (None:
        # no generator, or not known).
        self.generators: tuple[bytes | None, bytes | None] = (None, None)
        self.mask = mask                       # fixed: ready bits seen at the epoch's start
        self._digest: str | None = None
        self.owner = object()                  # the iterator that may yield from it

    @property
    def done(self) -> int:
        """Steps yielded so far (counting those before ``start``)."""
        first, size, it = self.chunk
        return first + size - it.__length_hint__()  # type: ignore[attr-defined]

    @property
    def digest(self) -> str:
        """Fingerprint of the base order, to refuse a resume into another order."""
        if self._digest is None:
            self._digest = _digest(self.indices)
        return self._digest

    def emitted_before(self, c: int, lo: int, hi: int) -> np.ndarray:
        """Bits over positions [lo, hi): emitted at a step < c. Needs lo >= c - window and
        start <= c <= computed."""
        bits = np.zeros(hi - lo, dtype=bool)
        bits[:max(0, min(hi, self.pre_lo) - lo)] = True
        a, b = max(lo, self.pre_lo), min(hi, self.pre_lo + self.pre_bits.size)
        if a < b:
            bits[a - lo:b - lo] = self.pre_bits[a - self.pre_lo:b - self.pre_lo]
        # A step t emits a position <= t + window, so only steps >= lo - window matter.
        seg = self.out[max(0, lo - self.window - self.start):c - self.start]
        seg = seg[(seg >= lo) & (seg < hi)]
        bits[seg - lo] = True
        return bits


def _digest(indices: np.ndarray) -> str:
    return hashlib.blake2b(indices.astype("<i8", copy=False).tobytes(),
                           digest_size=16).hexdigest()


# A base that draws each epoch from a torch.Generator of its own (RandomSampler,
# SubsetRandomSampler, WeightedRandomSampler with generator=...) gives as epoch k the generator's
# k-th draw: its order is a function of the generator's state, not of a seed and an epoch
# number, and a fresh sampler made with the same seed gives the first epoch's order again. A
# resume therefore restores the generator's state: the one at the epoch's start (the epoch is
# drawn again and the generator ends where it did), or, when the resumed epoch is not iterated
# again (set_epoch of another epoch discards the position), the one after the epoch's draw.
# States saved before these fields existed lack them: nothing is restored then.
_GENERATOR_FIELDS = ("generator", "generator_after")


def _generator_of(base: Any) -> torch.Generator | None:
    """The ``torch.Generator`` the base order draws its epochs from, or None."""
    generator = getattr(base, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _generator_state(base: Any) -> bytes | None:
    """The state of the base's generator now, or None if it has none."""
    generator = _generator_of(base)
    return None if generator is None else generator.get_state().numpy().tobytes()


def _checked_generator_state(base: Any, state: Mapping[str, Any], field: str
                             ) -> torch.Tensor | None:
    """``state[field]`` (a ``_generator_state``; None or absent: nothing to restore) as the
    state of the base's generator; a ValueError where it cannot be one."""
    value = state.get(field)
    if value is None:
        return None
    generator = _generator_of(base)
    if generator is None:
        raise ValueError(f"state['{field}'] is the state of the base sampler's generator, but "
                         f"this base sampler ({type(base).__name__}) has no torch.Generator: "
                         f"make it as it was saved, with generator=torch.Generator()")
    size = generator.get_state().numel()
    if not isinstance(value, (bytes, bytearray)) or len(value) != size:
        got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else \
            f"type {type(value).__name__}"
        raise ValueError(f"state['{field}'] should be the {size} bytes of the state of the base "
                         f"sampler's generator, but got {got}")
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)


_GLOBAL_RNG_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
                        torch.utils.data.WeightedRandomSampler)


def _users_base(base: Any) -> Any:
    """The user's sampler behind ``base`` (a prefetcher's order reads it through a _Tap)."""
    return base.base if isinstance(base, _Tap) else base


def _unseeded(base: Any) -> str:
    """Why a mid-epoch state of ``base`` cannot be resumed, if its order comes from torch's
    global generator (a ``RandomSampler`` made without a ``generator``); else ''."""
    base = _users_base(base)
    if isinstance(base, _GLOBAL_RNG_SAMPLERS) and base.generator is None:
        return (f"the base sampler ({type(base).__name__}) has no generator, so it draws each "
                f"epoch's order from torch's global generator, which the state does not hold; "
                f"make it with generator=torch.Generator().manual_seed(seed) to resume mid-epoch")
    return ""


def _warn_unseeded(base: Any, warned: set[str]) -> None:
    """Warn once (per sampler: ``warned``) that a mid-epoch state saved now will be refused
    on resume, pointing at the first caller outside these modules (a ``state_dict`` may be
    called by a ``Prefetcher`` or a ``DeviceLoader``)."""
    why = _unseeded(base)
    if why and "unseeded" not in warned:
        warned.add("unseeded")
        warnings.warn(f"this state cannot resume the epoch: {why}",
                      stacklevel=_level_outside_stocaching())


def _level_outside_stocaching() -> int:
    """The ``stacklevel`` of ``warnings.warn``, called by the caller of this function, that
    names the first frame outside stocaching's modules (this one, or the package's)."""
    package = __name__.rpartition(".")[0]
    frame, level = sys._getframe(1), 1  # level 1: the frame that calls warnings.warn
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != __name__ and not (package and name.startswith(package + ".")):
            return level
        frame, level = frame.f_back, level + 1
    return level


def _order_differs(epoch: Any, base: Any) -> ValueError:
    """The refusal of a resume whose base order is not the saved one."""
    why = _unseeded(base) or (f"the base sampler ({type(_users_base(base)).__name__}) "
                              f"should give the same order for the same seed and epoch "
                              f"(set_epoch): load its seed and epoch as saved (and each rank "
                              f"its own state)")
    return ValueError(f"the base order of epoch {epoch} differs from the one the loaded state "
                      f"was saved from: {why}")


def _set_generator_state(base: Any, value: torch.Tensor | None) -> None:
    """Set the base's generator to ``value`` (from ``_checked_generator_state``), if any."""
    if value is not None:
        _generator_of(base).set_state(value)  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------------
# Under trainers: a DistributedSampler over one, and the positions accelerate deals a process
# ----------------------------------------------------------------------------------------------

#: What a sampler over a ``DistributedSampler`` shows of it, to be one too.
_MIRRORED = ("dataset", "num_replicas", "rank", "shuffle", "seed", "drop_last", "num_samples",
             "total_size")


class _OverDistributed(torch.utils.data.DistributedSampler):
    """What makes a sampler over a ``DistributedSampler`` one too: the base's arguments and
    attributes (``_MIRRORED``), read from it, so that trainers which replace any sampler that
    is not distributed (Lightning's ``use_distributed_sampler=True``) leave it as it is.
    ``DistributedSampler.__init__`` is not called: the base has done what it does. The
    subclass says where its base is (``_distributed_base``)."""

    def _distributed_base(self) -> torch.utils.data.DistributedSampler:
        raise NotImplementedError


def _mirror(name: str) -> property:
    return property(lambda self: getattr(self._distributed_base(), name),
                    doc=f"The base sampler's ``{name}``.")


for _name in _MIRRORED:
    setattr(_OverDistributed, _name, _mirror(_name))
del _name


def _base_of(args: tuple, kwargs: dict, keyword: str) -> Any:
    """The first argument of a constructor, given by position or as ``keyword``."""
    return args[0] if args else kwargs.get(keyword)


def _positions_dealt(shard: Any, sampler: Any, n: int) -> np.ndarray | None:
    """Which of the ``n`` positions of ``sampler``'s epoch the process of ``shard`` (accelerate's
    ``BatchSamplerShard``) reads, as a bool mask: found by running a shard like it over the
    positions themselves, so that accelerate's own rules (batches dealt in turn or split, the
    last round evened out or dropped) decide. None unless the shard's batches are a torch
    ``BatchSampler`` drawing from ``sampler`` itself (positions of anything else are unknown)."""
    inner = shard.batch_sampler
    if not isinstance(inner, torch.utils.data.BatchSampler) or inner.sampler is not sampler \
            or inner.batch_size is None:
        return None
    positions = torch.utils.data.BatchSampler(range(n), inner.batch_size, inner.drop_last)
    like = type(shard)(positions, num_processes=shard.num_processes,
                       process_index=shard.process_index, split_batches=shard.split_batches,
                       even_batches=shard.even_batches)
    read = np.fromiter(itertools.chain.from_iterable(like), dtype=np.int64)
    # Positions come in increasing order until even_batches fills the last round with the
    # epoch's first indices again: those the shard takes from batches already drawn.
    back = np.flatnonzero(np.diff(read) <= 0)
    mine = np.zeros(n, dtype=bool)
    mine[read[:back[0] + 1] if back.size else read] = True
    return mine


def _wrapped_by_lightning(what: str, base: Any, cost: str = "") -> str:
    """The warning of a sampler that Lightning's default wrapped: what it costs, the fix."""
    split = ", of this rank's share, already split over the ranks" \
        if getattr(base, "num_replicas", 1) > 1 else ""
    return (f"Lightning (use_distributed_sampler=True) put this {what} inside a "
            f"DistributedSampler of its own, since its base sampler ({type(base).__name__}) is "
            f"not one: that wrapper lists the whole epoch at its start{cost} and trains each "
            f"rank on a share of the list{split}. Give the {what} a DistributedSampler or a "
            f"CacheAwareSampler as its base (for a WeightedMixtureSampler: "
            f"CacheAwareSampler(dataset, batch_size=..., order=it)): the {what} is then a "
            f"DistributedSampler too, which Lightning leaves alone")


# ----------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------


# A window wider than this part of the epoch, over a cache of the first indices, gives a
# warning: see NOTE [ A wide window over the first indices ] in docs/order.md.
WIDE_WINDOW_PART = 16


def _warn_wide_window_over_first_indices(ready: Any, window: int, length: int) -> None:
    """Warn, pointing at the caller's line, when an order that prefers the cached samples
    runs over a cache whose cached samples are its first indices (0.2.1's layout, the
    default on one node) with a window wider than ``1 / WIDE_WINDOW_PART`` of the epoch."""
    cache = ready if isinstance(ready, BaseCache) else getattr(ready, "cache", None)
    layout = getattr(cache, "layout", None)
    if layout is None or layout.num_nodes > 1 or layout.random_subset or \
            not 0 < layout.slots < layout.dataset_len or window * WIDE_WINDOW_PART <= length \
            or length < WIDE_WINDOW_PART:  # (no window is that short)
        return
    warnings.warn(
        f"window={window} is {100 * window / length:.0f} % of the epoch ({length} indices), "
        f"over a cache that holds the first {layout.slots} of {layout.dataset_len} indices "
        f"(the default layout on one node): the cached samples come first in every epoch, and "
        f"on data ordered by class (as ImageFolder orders it) they are the first classes, "
        f"which can wreck training. Make the cache with random_subset=True, or keep window <= "
        f"{length // WIDE_WINDOW_PART} (see 'Which samples are cached' in docs/order.md)",
        stacklevel=_level_outside_stocaching())


def _check_in_range(name: str, indices: np.ndarray, dataset_len: int) -> None:
    """Raise unless every index that ``name`` yielded is in ``[0, dataset_len)``."""
    if indices.size and (indices.min() < 0 or indices.max() >= dataset_len):
        raise ValueError(f"{name} should yield indices in [0, {dataset_len}) (the cache's "
                         f"dataset_len), but it yielded {indices.min()}..{indices.max()}")


class ReadyFirstSampler(torch.utils.data.Sampler[int]):
    """The cache-preferring shuffle-buffer order: ready samples first, within a window.

    Wraps a base order and reorders it within a window of ``window`` (W) positions: output
    position t may take any index whose base position b is in ``[t - W, t + W]``. It takes
    the one at ``b = t - W`` if that is still waiting (its deadline), otherwise the ready one
    with the smallest b, otherwise the waiting one with the smallest b. So:

    - every index of the base order comes exactly once per epoch (repeated indices, such as
      ``DistributedSampler``'s padding, as often as in the base order);
    - no index moves more than W positions from its base position. With per-rank batches of
      B indices, a sample stays within ``ceil(W / B)`` batches of its batch in the base order;
      under ``CacheAwareSampler`` or ``DistributedSampler`` each rank wraps its own base
      sampler, so which rank gets which index is unchanged, and a sample of global batch j is
      trained in a global step between ``j - ceil(W / B)`` and ``j + ceil(W / B)``;
    - with every sample ready, or none, the order is the base order.

    Over a ``DistributedSampler`` (``CacheAwareSampler`` is one) it is one too: the sampler
    made is of a subclass that is also a ``DistributedSampler``, with the base's
    ``num_replicas``, ``rank``, ``shuffle``, ``seed``, ``drop_last``, ``num_samples`` and
    ``total_size``, so Lightning's default (``use_distributed_sampler=True``) leaves it as it
    is. Over another sampler Lightning wraps it in a distributed sampler of its own, and it
    warns once. Under accelerate's ``prepare()`` it warns once: each process would reorder the
    epoch by what it sees ready, and the processes would deal batches from different orders;
    use a :class:`Prefetcher` with a window there.

    Ready means: for a ``SharedCache``, the index's slot holds its sample on this node or it
    is staged (``SharedCache.ready_mask``); for a callable, what it returns.

    Modes (the default, ``"fixed"``, is the same here and in :class:`Prefetcher`):

    - ``"fixed"`` (default): the ready mask is read once, at the start of each epoch (when
      its first iterator is created), and the whole epoch's order is computed then
      (vectorised, O(N)). The order is a pure function of (base order, W, the ready mask
      seen at the epoch's start), that is of (seed, epoch, cache state at the epoch's start)
      for a seeded base: the same inputs give the same order, and a resume continues it
      exactly. See :func:`ready_first_order`.
    - ``"adaptive"``: the order is computed ``refresh_every`` steps at a time, each time
      after reading the ready bits of the positions that may be emitted in those steps (the
      waiting ones of the window plus the ``refresh_every`` positions entering it, one call
      of ``ready`` for all of them); it serves whatever is ready now, so the order depends on
      timing, and a resume gives a valid rest, not the same one. Pick it with a prefetcher
      whose loads may finish late (slow or uneven storage): a late miss is then passed over
      until its deadline instead of holding up the batch.

    Resume: as with ``CacheAwareSampler``, ``state_dict()`` records the epoch and how many
    indices of it the latest iterator yielded; with ``num_workers > 0`` pass what the model
    consumed, ``state_dict(consumed=steps * batch_size)``. After ``load_state_dict`` the next
    iterator yields the rest of that epoch: in "fixed" mode exactly the sequence the original
    would have yielded (the state carries the ready bits it observed, so the cache of the new
    process does not matter), in "adaptive" mode a valid continuation (the rest of the epoch
    exactly once, each within W of its base position) that again prefers what is ready now.
    The state is per rank: each rank saves and loads its own.

    Cost: the fixed-mode state carries 1 bit per remaining index plus ``2 W + 1`` bits
    (at most 125 KB per million indices), the adaptive-mode state ``2 W + 1`` bits. While
    iterating, an epoch holds the base order and the output order (12 bytes per index below
    2**30 indices) plus, in fixed mode, the ready mask (1 byte per index).

    Not thread-safe: create and advance its iterators from one thread (the ``DataLoader``
    does so in the main process).

    .. warning::
        Call ``set_epoch(epoch)`` before each epoch, as with ``DistributedSampler``: it is
        forwarded to the base sampler, without which every epoch repeats the same base order.

    Args:
        base: the base order: a ``Sampler`` or any iterable of ints with a ``len``. It is
            iterated once per epoch, when the iterator is created. ``set_epoch`` is forwarded
            to it when it has one; its ``state_dict``/``load_state_dict`` are used when it has
            them. Do not resume it separately: resume this sampler.
        ready: a ``SharedCache`` (an index is ready when its slot is set on this node), or a
            callable ``ready(indices)`` taking a read-only int64 array of dataset indices and
            returning one bool per index.
        window: W, how far an index may move from its base position, an int >= 1. A
            multiple of the batch size (1 to 8 batches) is a good start: larger gives a
            prefetcher more lead time but mixes batches more.
        mode: "fixed" (deterministic, ready mask read at the epoch's start) or "adaptive"
            (ready bits read as the iterator advances). Default: "fixed".
        refresh_every: in "adaptive" mode, output steps computed per reading of the ready
            bits, an int >= 1. Smaller reacts sooner to samples becoming ready and costs
            more (one ``ready`` call of about ``W + refresh_every`` indices each time).
            Default: ``min(window, 64)``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "ReadyFirstSampler":
        if cls is ReadyFirstSampler and isinstance(_base_of(args, kwargs, "base"),
                                                   torch.utils.data.DistributedSampler):
            cls = _DistributedReadyFirstSampler
        return super().__new__(cls)

    def __init__(self, base: Any, ready: BaseCache | ReadyFn, *, window: int,
                 mode: str = "fixed", refresh_every: int | None = None) -> None:
        if not (hasattr(base, "__iter__") and hasattr(base, "__len__")):
            raise TypeError(f"base should be a Sampler or an iterable of ints with a length, "
                            f"but got base of type {type(base).__name__}")
        if isinstance(ready, BaseCache):
            cache, fn = ready, None
        elif callable(ready):
            cache, fn = None, ready
        else:
            raise TypeError(f"ready should be a SharedCache, an OpenSizeCache or a callable "
                            f"ready(indices) -> bool array, but got ready of type "
                            f"{type(ready).__name__}")
        window = check_int("window", window, low=1)
        if not isinstance(mode, str):
            raise TypeError(f"mode should be 'fixed' or 'adaptive', but got mode={mode!r} "
                            f"(type {type(mode).__name__})")
        if mode not in MODES:
            raise ValueError(f"mode should be 'fixed' or 'adaptive', but got mode={mode!r}")
        refresh_every = min(window, DEFAULT_REFRESH) if refresh_every is None else \
            check_int("refresh_every", refresh_every, low=1)
        self.base = base
        self.window, self.mode, self.refresh_every = window, mode, refresh_every
        self._cache, self._fn = cache, fn
        self.epoch = 0
        self._ep: _Epoch | None = None          # the latest iterator's epoch
        self._loaded: dict | None = None        # a state to resume from at the next __iter__
        self._spare: np.ndarray | None = None   # see load_state_dict
        self._warned: set[str] = set()          # the trainers it warned about
        _warn_wide_window_over_first_indices(ready, window, len(base))

    # -- the public surface -----------------------------------------------------------------

    def __len__(self) -> int:
        """Indices per epoch: ``len(base)`` (the whole epoch, also right after a resume)."""
        return len(self.base)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch, and forward it to the base sampler if it has ``set_epoch``.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = check_int("epoch", epoch, low=0)
        if epoch != self.epoch and self._loaded is not None:
            if 0 < self._loaded["consumed"] < self._loaded["len"]:
                warnings.warn(f"set_epoch({epoch}) discards the resume position loaded for "
                              f"epoch {self.epoch} ({self._loaded['consumed']} of "
                              f"{self._loaded['len']} indices consumed)", stacklevel=2)
            # The loaded epoch is not drawn again: its base goes on from after it.
            _set_generator_state(self.base, _checked_generator_state(
                self.base, self._loaded, "generator_after"))  # (checked when loaded)
            self._loaded = None
        set_base = getattr(self.base, "set_epoch", None)
        if set_base is not None:
            set_base(epoch)
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        """The current epoch's indices, from the loaded position if any.

        An iterator that has yielded nothing does not count as an iteration of the epoch: the
        next ``iter()`` of the same epoch replaces it and continues the same order from the
        same position (loaders such as torchdata's ``StatefulDataLoader`` create one, load a
        state, and create another). Iterating an epoch again after an iterator has yielded
        warns, unless ``set_epoch`` was called meanwhile.
        """
        if "lightning" not in self._warned and in_lightnings_wrapper():
            self._warned.add("lightning")
            warnings.warn(_wrapped_by_lightning("ReadyFirstSampler", self.base), stacklevel=2)
        shard = dealt_by_accelerate(self) if "accelerate" not in self._warned else None
        if shard is not None:
            self._warned.add("accelerate")
            warnings.warn(
                f"accelerate's prepare() deals this loader's batches to its "
                f"{shard.num_processes} processes, each drawing them from its own "
                f"ReadyFirstSampler, whose order depends on what that process saw ready: the "
                f"processes deal from different orders, and samples are lost or doubled. Give "
                f"the loader Prefetcher(sampler, cache, load, window=...) instead, which under "
                f"prepare() reorders only the batches of its own process", stacklevel=2)
        ep = self._ep
        if self._loaded is None and ep is not None and ep.epoch == self.epoch:
            if ep.done == ep.start:  # never advanced: the same epoch, order and position
                ep.owner = object()
                return self._yield(ep, ep.owner)
            if hasattr(self.base, "set_epoch"):
                warnings.warn(f"epoch {self.epoch} is iterated again; call "
                              f"sampler.set_epoch(epoch) before each epoch", stacklevel=2)
        t0 = time.perf_counter()
        base_state = self._base_state()
        n = len(self)
        spare, self._spare = self._spare, None
        if spare is not None and self._loaded is not None and spare.size == n and \
                _digest(spare) == self._loaded["order_digest"]:
            indices = spare  # the order the state continues, taken before it was loaded
            generators = (None, _generator_state(self.base))  # its start is not known
        else:
            before = _generator_state(self.base)
            indices = np.fromiter(iter(self.base), dtype=np.int64)  # the base order, once
            generators = (before, _generator_state(self.base))
        if indices.size != n:
            raise ValueError(f"base should yield len(base)={n} indices per epoch, but it "
                             f"yielded {indices.size}; if the base sampler was resumed on its "
                             f"own, resume the ReadyFirstSampler instead")
        if self._cache is not None:
            _check_in_range("base", indices, self._cache.dataset_len)
        ep = self._start(indices, base_state)
        ep.generators = generators
        self._ep = ep
        if self.mode == "fixed":
            logger.debug("epoch %d: %d indices from step %d, %.1f%% ready at the start, order "
                         "built in %.3f s", self.epoch, n, ep.start,
                         100 * ep.mask.mean() if n else 0.0, time.perf_counter() - t0)
        return self._yield(ep, ep.owner)

    def resumed_from(self) -> tuple[int, np.ndarray]:
        """Where the latest iterator starts, for a loader that loads the base order ahead of
        it (:class:`Prefetcher`): the step it yields first (0, or the position of a loaded
        state), and one bool per base position from 0 up to that step plus ``window``, set
        for those emitted before that step, which it does not yield again (an empty array
        from step 0). Call it after ``iter()``."""
        ep = self._ep
        if ep is None:
            raise RuntimeError("resumed_from() tells where the latest iterator starts: call "
                               "iter(sampler) first")
        if not ep.start:
            return 0, np.zeros(0, dtype=bool)
        return ep.start, ep.emitted_before(ep.start, 0, min(ep.n, ep.start + ep.window + 1))

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch, with what is needed to continue it.

        Once an iterator of the current epoch exists, the state carries what it observed,
        also at ``consumed=0``: a "fixed" epoch resumes in the order it started with.

        Args:
            consumed: indices of this epoch that were used. Default: the number the latest
                iterator has yielded (plus the position it was resumed from). At most the
                number whose order is known: in "fixed" mode the whole epoch, in "adaptive"
                mode those yielded plus at most ``refresh_every`` more.

        Returns:
            A dict of plain values (ints, str, bytes, None, and the base's own state):
            ``epoch``, ``consumed``, ``window``, ``mode``, ``len``, ``base`` (the base
            sampler's state at the epoch's start, or None), ``order_digest`` (a fingerprint of
            the epoch's base order), ``emitted`` (packed bits: which base positions in
            ``[consumed - W, consumed + W]`` were already emitted), ``ready`` (fixed mode:
            packed ready bits seen at the epoch's start, from base position
            ``consumed - W`` on), and, for a base that draws its epochs from a
            ``torch.Generator`` (``RandomSampler(generator=...)``), ``generator`` and
            ``generator_after``: that generator's state at the epoch's start and after the
            epoch's order was drawn (bytes; None where there is none, or before the draw).
        """
        n = len(self)
        if consumed is not None:
            consumed = check_int("consumed", consumed, low=0, high=n)
        if self._loaded is not None:
            if consumed is not None and consumed != self._loaded["consumed"]:
                raise ValueError(f"consumed should be {self._loaded['consumed']} (the position "
                                 f"loaded by load_state_dict; no iterator has run since), but "
                                 f"got consumed={consumed}")
            return dict(self._loaded)
        ep = self._ep if self._ep is not None and self._ep.epoch == self.epoch else None
        if ep is None:
            if consumed:
                raise ValueError(f"consumed should be 0: no iterator of epoch {self.epoch} "
                                 f"has run, but got consumed={consumed}")
            return self._state(0, self._base_state())
        if consumed is None:
            consumed = ep.done
        if not ep.start <= consumed <= ep.computed:
            raise ValueError(f"consumed should be in [{ep.start}, {ep.computed}] (from where "
                             f"this epoch's iterator started to the last position whose order "
                             f"is known), but got consumed={consumed}")
        W = self.window
        lo, hi = max(0, consumed - W), min(n, consumed + W + 1)
        state = self._state(consumed, ep.base_state)
        state["generator"], state["generator_after"] = ep.generators
        state["order_digest"] = ep.digest
        state["emitted"] = np.packbits(ep.emitted_before(consumed, lo, hi)).tobytes()
        if self.mode == "fixed":
            state["ready"] = np.packbits(ep.mask[lo:]).tobytes()
        if consumed < n and not isinstance(self.base, _Tap):  # (a prefetcher's: it warns)
            _warn_unseeded(self.base, self._warned)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iterator yields the rest of its epoch.

        ``window``, ``mode`` and ``len`` must match; the base sampler's state is loaded into
        the base sampler (or, without ``load_state_dict``, its epoch is set), its generator
        (if the state has one) is set to its state at the epoch's start, and the next
        iterator checks that the base order is the one the state was saved from. If
        ``set_epoch`` of another epoch discards the position instead, the generator is set to
        its state after the saved epoch, so later epochs are those of an uninterrupted run.
        Nothing is changed when the state is refused. States without the ``generator``
        fields (saved by an older version) load; their generator is left as it is.

        Args:
            state: a dict from ``state_dict()`` of a sampler of the same rank.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state should be a dict from ReadyFirstSampler.state_dict(), but "
                            f"got {type(state).__name__}")
        mine = self._state(0, None)
        missing = sorted(set(mine) - set(state) - set(_GENERATOR_FIELDS))
        if missing:
            raise ValueError(f"state should be a dict from ReadyFirstSampler.state_dict(), but "
                             f"it lacks {missing}")
        for field in ("window", "mode", "len"):
            if state[field] != mine[field]:
                raise ValueError(f"state['{field}'] should be this sampler's {field}="
                                 f"{mine[field]!r}, but got state['{field}']={state[field]!r}")
        n = mine["len"]
        epoch = check_int("state['epoch']", state["epoch"], low=0)
        consumed = check_int("state['consumed']", state["consumed"], low=0, high=n)
        loaded = dict(state)
        loaded["epoch"], loaded["consumed"] = epoch, consumed
        started = state["order_digest"] is not None  # the epoch's order had been computed
        if started or consumed:
            if not isinstance(state["order_digest"], str):
                raise ValueError(f"state['order_digest'] should be a str for "
                                 f"consumed={consumed}, but got "
                                 f"state['order_digest']={state['order_digest']!r}")
            lo, hi = max(0, consumed - self.window), min(n, consumed + self.window + 1)
            expect = {"emitted": _nbytes(hi - lo),
                      "ready": _nbytes(n - lo) if self.mode == "fixed" else None}
            for field, size in expect.items():
                value = state[field]
                if size is None:
                    continue
                if not isinstance(value, (bytes, bytearray)) or len(value) != size:
                    got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) \
                        else repr(type(value).__name__)
                    raise ValueError(f"state['{field}'] should be {size} bytes of packed bits "
                                     f"for consumed={consumed}, window={self.window}, "
                                     f"len={n}, but got {got}")
        generator = _checked_generator_state(self.base, state, "generator")
        _checked_generator_state(self.base, state, "generator_after")
        if state["base"] is not None and hasattr(self.base, "load_state_dict"):
            self.base.load_state_dict(state["base"])  # may refuse; ours is unchanged then
        elif hasattr(self.base, "set_epoch"):
            self.base.set_epoch(epoch)
        _set_generator_state(self.base, generator)
        self.epoch = epoch
        # The base order that an iterator which never yielded took: a base whose order
        # depends on how often it was iterated (RandomSampler with a generator whose state
        # the state does not carry) would give another one if iterated again.
        ep = self._ep
        self._spare = ep.indices if ep is not None and ep.done == ep.start and \
            generator is None else None
        self._ep = None
        self._loaded = loaded if started else None

    # -- internals ---------------------------------------------------------------------------

    def _state(self, consumed: int, base_state: Any) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": consumed, "window": self.window,
                "mode": self.mode, "len": len(self), "base": base_state,
                "order_digest": None, "emitted": None, "ready": None,
                "generator": _generator_state(self.base), "generator_after": None}

    def _base_state(self) -> Any:
        """The base sampler's state now, positioned at the start of its epoch when its
        ``state_dict`` takes ``consumed`` (as ``CacheAwareSampler``'s does)."""
        sd = getattr(self.base, "state_dict", None)
        if sd is None:
            return None
        try:
            takes_consumed = "consumed" in inspect.signature(sd).parameters
        except (TypeError, ValueError):
            takes_consumed = False
        return sd(consumed=0) if takes_consumed else sd()

    def _query(self, indices: np.ndarray) -> np.ndarray:
        """One bool per index: is its sample ready now."""
        if self._cache is not None:
            return self._cache.ready_mask(indices)
        view = indices.view()
        view.flags.writeable = False
        got = np.asarray(self._fn(view))
        if got.shape != indices.shape:
            raise ValueError(f"ready(indices) should return one bool per index, shape "
                             f"{indices.shape}, but got shape {got.shape}")
        if got.dtype != np.bool_:
            if not np.issubdtype(got.dtype, np.integer):
                raise TypeError(f"ready(indices) should return bools, but got dtype "
                                f"{got.dtype}")
            got = got != 0
        return got

    def _start(self, indices: np.ndarray, base_state: Any) -> _Epoch:
        """The epoch of a new iterator: fresh, or resumed from ``self._loaded``."""
        n, W = indices.size, self.window
        loaded, start = self._loaded, 0
        pre_bits = np.zeros(0, dtype=bool)
        if loaded is not None:
            if _digest(indices) != loaded["order_digest"]:
                raise _order_differs(self.epoch, self.base)
            start = loaded["consumed"]
            lo, hi = max(0, start - W), min(n, start + W + 1)
            pre_bits = np.unpackbits(np.frombuffer(loaded["emitted"], dtype=np.uint8),
                                     count=hi - lo).astype(bool)
            if loaded["base"] is not None:
                base_state = loaded["base"]
        ep = _Epoch(self.epoch, indices, W, start, pre_bits, base_state, None)
        if self.mode == "fixed":
            if loaded is None:
                mask = self._query(indices)
                order = _schedule(*_split(mask, 0, ep.out.dtype), 0, W, n)
            else:
                mask = np.zeros(n, dtype=bool)
                lo = ep.pre_lo
                mask[lo:] = np.unpackbits(np.frombuffer(loaded["ready"], dtype=np.uint8),
                                          count=n - lo).astype(bool)
                left = ~ep.emitted_before(start, lo, n)
                order = _schedule(*_split(mask[lo:], lo, ep.out.dtype, left), start, W,
                                  n - start)
            ep.mask, ep.out[:], ep.computed = mask, order, n
        self._loaded = None
        return ep

    def _extend(self, ep: _Epoch) -> None:
        """Adaptive mode: compute the next ``refresh_every`` steps from the ready bits now."""
        t0, W, n = ep.computed, self.window, ep.n
        steps = min(self.refresh_every, n - t0)
        lo, hi = max(0, t0 - W), min(n, t0 + steps + W)
        left = lo + np.flatnonzero(~ep.emitted_before(t0, lo, hi))
        ready = self._query(ep.indices[left])
        left = left.astype(ep.out.dtype)
        order = _schedule(left[~ready], left[ready], t0, W, steps)
        ep.out[t0 - ep.start:t0 - ep.start + steps] = order
        ep.computed = t0 + steps

    def _yield(self, ep: _Epoch, owner: object) -> Iterator[int]:
        if ep.owner is not owner:
            raise RuntimeError(f"this iterator of epoch {ep.epoch} was replaced by a newer one "
                               f"before it yielded anything (iter(sampler) was called again); "
                               f"iterate the newest")
        t = ep.start
        while t < ep.n:
            if t >= ep.computed:
                self._extend(ep)
            stop = min(ep.computed, t + _YIELD_CHUNK)
            chunk = ep.indices[ep.out[t - ep.start:stop - ep.start]].tolist()
            ep.chunk = (t, len(chunk), iter(chunk))
            yield from ep.chunk[2]
            t = stop


class _DistributedReadyFirstSampler(ReadyFirstSampler, _OverDistributed):
    """A ``ReadyFirstSampler`` over a ``DistributedSampler``: one too (see ``_OverDistributed``)."""

    def _distributed_base(self) -> torch.utils.data.DistributedSampler:
        return self.base


# ----------------------------------------------------------------------------------------------
# The prefetcher: misses loaded ahead of need, with many reads in flight
# ----------------------------------------------------------------------------------------------


class PrefetchError(RuntimeError):
    """The load function failed (or timed out) for a sample the prefetcher loaded ahead.

    The original exception, with its traceback, is the ``__cause__`` (from a loader process,
    ``processes=N``: a RuntimeError carrying its type, message and traceback as text).

    Attributes:
        index: the dataset index whose load failed.
    """

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.index)


def _start_context(ctx: Any) -> Any:
    """The multiprocessing context named by ``multiprocessing_context`` (checked)."""
    if ctx is None:
        return multiprocessing.get_context()
    if isinstance(ctx, str):
        if ctx not in multiprocessing.get_all_start_methods():
            raise ValueError(f"multiprocessing_context should be one of "
                             f"{multiprocessing.get_all_start_methods()}, a context or None, "
                             f"but got multiprocessing_context={ctx!r}")
        return multiprocessing.get_context(ctx)
    if not isinstance(ctx, multiprocessing.context.BaseContext):
        raise TypeError(f"multiprocessing_context should be a start method name, a "
                        f"multiprocessing context or None, but got multiprocessing_context of "
                        f"type {type(ctx).__name__}")
    return ctx


# Loads are CPU-bound while they wait (for storage, a socket, a sleep) less than this share of
# the CPU time they use.
_CPU_BOUND_WAIT_SHARE = 0.25
# While the loads are CPU-bound, one miss in this many is still loaded, to keep measuring.
_PROBE_EVERY = 16
# Once the loads are measured and not CPU-bound, one load in this many is timed; probes, and
# loads before the verdict, always are. (Reading the scheduler statistics twice cost a loader
# thread about 50 us of CPU a load on 2 busy cores, 3 us when idle: docs/benchmarks.md.)
_TIME_EVERY = 8


class _WaitMeter:
    """Times the loads of one thread: how long a load waited neither running nor ready to run
    (on storage, a socket, a sleep, or the GIL) and how much CPU it used, from Linux's
    per-thread scheduler statistics, so that time spent waiting for a core, as on a machine
    busy with the loads themselves, counts as neither. Where that file does not exist it
    measures nothing (and the prefetcher never stands aside). Made by the thread it times."""

    PATH = "/proc/thread-self/schedstat"
    WORKS = os.path.exists(PATH)  # (on Linux, with the kernel's scheduler statistics)

    def __init__(self) -> None:
        try:
            self._fd = os.open(self.PATH, os.O_RDONLY)
        except OSError:
            self._fd = -1

    def now(self) -> tuple[int, int, int] | None:
        """(wall, CPU, ready to run) in nanoseconds, or None. The CPU time is the clock's:
        the file's lags behind for a thread that is running (it reads it)."""
        if self._fd < 0:
            return None
        try:
            ready = int(os.pread(self._fd, 128, 0).split()[1])
            return time.monotonic_ns(), time.thread_time_ns(), ready
        except (OSError, ValueError, IndexError):
            return None

    def since(self, t0: tuple[int, int, int] | None) -> tuple[int, int] | None:
        """(waited, CPU) in nanoseconds since ``t0`` from :meth:`now`, or None (``t0`` None:
        an untimed load, and nothing is read)."""
        if t0 is None:
            return None
        t1 = self.now()
        if t1 is None:
            return None
        wall, cpu, ready = (b - a for a, b in zip(t0, t1))
        return max(0, wall - cpu - ready), cpu

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _ReadyOrAside:
    """The ready bits of the adaptive order under a prefetcher: the cache's, but every index
    while the loads are CPU-bound. A miss left to the ``DataLoader`` then costs its workers
    the same CPU at any position, so putting ready samples first saves nothing; it only
    gathers the misses into a few batches (the last ones of an epoch), which a worker builds
    slowly while the trainer waits, having raced through batches of hits. (A class, not a
    bound method of the prefetcher: its order must not keep the prefetcher alive.)"""

    def __init__(self, cache: BaseCache, times: "_LoadTimes") -> None:
        self.cache, self.times = cache, times

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        if self.times.cpu_bound():
            return np.ones(indices.shape, dtype=bool)
        return self.cache.ready_mask(indices)


class _LoadTimes:
    """The waiting and CPU times of a prefetcher's latest timed loads (a
    :class:`_WaitMeter`'s; which loads are timed: ``_TIME_EVERY``). A load is CPU-bound when
    it waited less than ``_CPU_BOUND_WAIT_SHARE`` of its CPU time, and the loads are when
    most of the latest ``KEEP`` timed ones are (most, so that a few loads held up
    by a page fault or the GIL do not decide). Loading CPU-bound samples ahead cannot shorten
    an epoch, since the ``DataLoader``'s workers would spend the same CPU on them, and it
    costs the prefetcher's own work."""

    KEEP = 32  # loads

    def __init__(self) -> None:
        self._recent: collections.deque = collections.deque()  # (waited, CPU, CPU-bound)
        self._bound = 0  # CPU-bound loads in _recent
        self._lock = threading.Lock()
        self.seen = 0  # loads finished, timed or not
        self.timed = 0  # of those, the timed ones

    def add(self, times: tuple[int, int] | None) -> None:
        with self._lock:
            self.seen += 1
            if times is None:
                return
            self.timed += 1
            waited, cpu = times
            bound = int(waited < _CPU_BOUND_WAIT_SHARE * cpu)
            self._recent.append((waited, cpu, bound))
            self._bound += bound
            if len(self._recent) > self.KEEP:
                self._bound -= self._recent.popleft()[2]

    def known(self) -> bool:
        return len(self._recent) >= self.KEEP  # (KEEP + 1 for a moment inside add)

    def cpu_bound(self) -> bool:
        with self._lock:
            return len(self._recent) == self.KEEP and 2 * self._bound > self.KEEP

    def __str__(self) -> str:
        with self._lock:
            recent, bound = list(self._recent), self._bound
        n = max(1, len(recent))
        return (f"{bound} of the latest {len(recent)} timed loads were, and they waited "
                f"{sum(r[0] for r in recent) / n / 1e6:.2f} ms a load for "
                f"{sum(r[1] for r in recent) / n / 1e6:.2f} ms of CPU")


class Prefetcher(torch.utils.data.Sampler[int]):
    """Loads the samples the ``DataLoader`` will ask for next, before it asks, with many
    loads in flight; yields an index only once its sample is in the cache.

    It is the ``DataLoader``'s sampler: it wraps the order you would use (``RandomSampler``,
    ``DistributedSampler``, ``CacheAwareSampler``, ...) and, with a ``window``, reorders it
    with :class:`ReadyFirstSampler` so that ready samples go first and a miss gets lead time.
    It runs where the ``DataLoader`` draws indices (the training process of each rank), keeps
    the next ``lookahead`` positions of the base order loading in ``threads`` threads (the
    user's ``load`` function: read and decode, phase one of the two-phase transforms), and
    stores each result with ``cache.set_slot`` (an index with a slot) or ``cache.stage`` (an
    index without one, if the cache has ``staging_slots``). The ``DataLoader`` workers then
    find the sample with ``get_slot``, in any start method; the dataset is unchanged.

    Never twice at once: an index it loads is yielded only after its load has finished, so
    no worker loads it too; indices it did not load (beyond the cache and the staging area)
    are loaded by the workers as without it, and so, from the next epoch on, are those whose
    sample a cache of open sizes refused (its arena full), until a ``clear()``. One prefetcher
    per rank: each rank's order (``DistributedSampler``, ``CacheAwareSampler``) holds the
    indices that rank reads, so ranks do not load each other's samples; they share the node's
    staging slots, each taking at most ``staging_slots // (2 * local_world_size)`` ahead of
    its position.

    Threads or processes: by default the loads run in ``threads`` threads of this process,
    which the ``DataLoader``'s main loop leaves idle while it waits. That suits slow reads
    (files on network storage, sockets) and decoders that release the GIL; the threads start
    with each epoch's iterator and stop with it, and none outlives the process. When decoding
    is what costs, pass ``processes=N``: the loads then run in N processes, started when the
    prefetcher is made (so that starting them overlaps the rest of the setup), kept for every
    epoch like ``persistent_workers`` and stopped by ``close()`` or with the prefetcher; each
    runs ``threads`` loader threads and stores what they load itself, so N x ``threads``
    loads are in flight: slow reads overlap as with threads, and decoding uses N cores.
    (For decoding in pure Python, which holds the GIL, a few threads per process suffice.)
    They start as ``multiprocessing_context`` says, like a ``DataLoader``'s
    workers: by default the platform's default ("fork" on Linux up to Python 3.13, which
    starts in milliseconds and takes ``load`` as it is). With "spawn" or "forkserver",
    ``load`` must be picklable: a function or a bound method of a picklable dataset, defined
    at the top level of a module (the main script's top level works when the training code
    runs under ``if __name__ == "__main__":``), and each process takes a second or more
    (several on busy cores) to import torch. The processes die with this process, also by
    SIGKILL (``PR_SET_PDEATHSIG``, or with "forkserver" a thread of each that watches this
    process; the first follows the thread that started them, so make the prefetcher, and
    iterate it, in a thread that lives as long as the training: the epoch after a
    ``close()`` or a dead loader process starts new ones from the iterating thread). A loader
    process that died is reported by the epoch that meets it; the next epoch starts new ones.
    With "fork", a loader process is a copy of this process when it starts: later changes to
    the dataset behind ``load`` are not seen, and the threads of clients made before (HTTP or
    object-store connection pools) are not copied, so make such clients in ``load`` lazily.

    Under trainers: over a ``DistributedSampler`` (``CacheAwareSampler`` is one) the
    prefetcher is one too, as :class:`ReadyFirstSampler` is, so Lightning's default
    (``use_distributed_sampler=True``) leaves it as it is and calls its ``set_epoch``; over
    another sampler Lightning wraps it in a distributed sampler of its own, which lists the
    whole epoch first (every sample loaded before the first batch), and it warns once. Under
    accelerate's ``prepare()``, which deals the loader's batches to its processes, give it the
    sampler accelerate expects (``CacheAwareSampler(...).for_accelerate()``, or a
    ``RandomSampler``, whose generator it shares with accelerate so that every process draws
    the same order): each process's prefetcher loads only the positions its process reads,
    and with a window reorders only those, so each process reads exactly its own batches. A
    base that gives each rank its share (a ``CacheAwareSampler`` itself) warns once there,
    since ``prepare()`` splits that share again. The resume of a prefetcher under
    ``prepare()`` is not supported.

    Errors: an exception in ``load`` (or in storing its result, e.g. a wrong shape) is raised
    by the iterator as :class:`PrefetchError` naming the index, with the original exception
    and traceback as its cause (with ``processes``, as the text of a RuntimeError); a load
    running longer than ``timeout`` seconds raises one too.

    Args:
        sampler: the base order; ``set_epoch`` is forwarded to it.
        cache: the cache (a ``SharedCache`` or an ``OpenSizeCache``) that the dataset reads
            with ``get_slot``.
        load: ``load(index) -> tensor``: the sample as the dataset would cache it.
        window: W of the cache-preferring order (no index moves more than W positions), or
            None to keep the base order. Default: None.
        mode: "fixed" or "adaptive", as in :class:`ReadyFirstSampler` (with a window):
            "fixed" is deterministic (same seed and cache state at the epoch's start, same
            order; a resume continues it exactly); "adaptive" serves what is ready now (the
            order depends on timing), which hides a load that finishes late. Default: "fixed".
        threads: loads in flight, in threads of this process (or of each loader process
            with ``processes``), an int >= 1. Default: 16.
        processes: when an int >= 1, load in this many loader processes, each with
            ``threads`` threads, instead of threads of this process. Default: 0.
        lookahead: positions of the base order kept loading ahead of the ``DataLoader``
            (beyond the window), an int >= 1. Default: 4 x the loads in flight
            (``threads``, or ``processes * threads``).
        timeout: seconds to wait for one load before raising. Default: 120.
        multiprocessing_context: how loader processes start (``processes=N``): "fork",
            "spawn", "forkserver", a context from ``multiprocessing.get_context``, or None
            for the platform's default. Default: None.
        stand_aside: while the loads are CPU-bound (they wait on storage for less than a
            quarter of their CPU time, as measured on Linux), leave the misses to the
            ``DataLoader``'s workers, as without a prefetcher, and load only one in 16 to
            keep measuring; loading them ahead would cost CPU and save none. Meanwhile an
            adaptive window serves the base order (ready-first would only gather the
            misses into the epoch's last batches). Default: True.

    Attributes:
        base: the base order, ``sampler``.
        loaded: loads this prefetcher finished, over all epochs.
        dropped: loads whose sample found no free staging slot by the time its index was
            due, and which were left to the DataLoader (not counted in ``loaded``), over all
            epochs.
        left: misses left to the ``DataLoader`` because the loads were CPU-bound
            (``stand_aside``), over all epochs.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Prefetcher":
        if cls is Prefetcher and isinstance(_base_of(args, kwargs, "sampler"),
                                            torch.utils.data.DistributedSampler):
            cls = _DistributedPrefetcher
        return super().__new__(cls)

    def __init__(self, sampler: Any, cache: BaseCache, load: Callable[[int], Any], *,
                 window: int | None = None, mode: str = "fixed", threads: int = 16,
                 lookahead: int | None = None, timeout: float = 120.0,
                 processes: int = 0, multiprocessing_context: Any = None,
                 stand_aside: bool = True) -> None:
        if not isinstance(cache, BaseCache):
            raise TypeError(f"cache should be a SharedCache or an OpenSizeCache, but got cache "
                            f"of type {type(cache).__name__}")
        if not callable(load):
            raise TypeError(f"load should be a callable load(index) -> tensor, but got "
                            f"load of type {type(load).__name__}")
        self.threads = check_int("threads", threads, low=1)
        self.processes = check_int("processes", processes, low=0)
        self.lookahead = 4 * self.threads * max(1, self.processes) if lookahead is None else \
            check_int("lookahead", lookahead, low=1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout should be a positive number of seconds, but got "
                            f"timeout={timeout!r}")
        if not 0 < timeout < float("inf"):
            raise ValueError(f"timeout should be a positive number of seconds, but got "
                             f"timeout={timeout!r}")
        if mode not in ("fixed", "adaptive"):
            raise (ValueError if isinstance(mode, str) else TypeError)(
                f"mode should be 'fixed' or 'adaptive', but got mode={mode!r}")
        if not isinstance(stand_aside, bool):
            raise TypeError(f"stand_aside should be True or False, but got "
                            f"stand_aside={stand_aside!r}")
        self.timeout = float(timeout)
        self.stand_aside = stand_aside
        self._mp_context = _start_context(multiprocessing_context)
        self.cache, self.load = cache, load
        self._tap = _Tap(sampler, cache.dataset_len)
        self.window = None if window is None else check_int("window", window, low=1)
        self._load_times = _LoadTimes()
        # The adaptive order serves the base order while standing aside (see _ReadyOrAside);
        # the fixed one stays a function of the cache state at the epoch's start.
        ready = cache if mode == "fixed" or not stand_aside else \
            _ReadyOrAside(cache, self._load_times)
        self._order: Any = self._tap if window is None else \
            ReadyFirstSampler(self._tap, ready, window=self.window, mode=mode)
        lws = cache.world.local_world_size
        self._stage_ahead = cache.staging_slots // (2 * lws)
        # What this prefetcher staged is tagged with a number of its own, so that it gives
        # back only its own samples (another rank's prefetcher may stage the same index).
        self._tag = secrets.randbelow(MAX_STAGE_TAG + 1)
        self._staged = _Staged()  # what this prefetcher staged, and the stages under way
        self._staging_slots = cache.staging_slots
        self._pool: _LoaderPool | None = None  # the loader threads of the running epoch
        # Indices whose loaded sample the cache did not keep (open sizes, arena full; a byte
        # an index), and the most of the arena seen in use: see __iter__.
        self._may_refuse = cache.may_refuse  # a cache of open sizes
        self._refused = np.zeros(cache.dataset_len if self._may_refuse else 0, dtype=bool)
        self._arena_used = 0
        # Given back when the prefetcher goes: another rank's prefetcher does not take them
        # (each counts only its own tag as ready), so they would hold staging slots.
        self._give_back = weakref.finalize(self, _give_back_staged, cache, self._tag,
                                           self._staged)
        # Loads running in a loader thread, over epochs: an epoch abandoned mid-load leaves
        # its loads running, and the next epoch waits for those instead of starting again.
        self._running: dict[int, _Job] = {}
        self._lock = threading.Lock()  # guards the two above and the counters
        self.loaded = 0  # loads finished, over all epochs: what the benchmark reports
        self.dropped = 0  # loads whose sample found no free staging slot in time, all epochs
        self.left = 0  # misses left to the DataLoader while the loads were CPU-bound
        self._procs: _ProcessLoaderPool | None = None  # with processes=N
        # What the latest iterator of this epoch yielded: [the position it started from,
        # indices yielded], the default position of state_dict(); None before one started.
        self._progress: list | None = None
        self._epoch: int | None = None  # the latest set_epoch
        self._skip_loaded: dict | None = None  # see _skip_state
        self._warned: set[str] = set()  # the trainers it warned about
        if self.processes:
            self._procs = self._start_processes()
        # This rank's workers read this rank's copies only: with epochs that drift apart, two
        # ranks may both have staged an index, and each gives back (unstage) its own copy.
        # (A set: a process may run several prefetchers on one cache, train and validation.)
        cache.read_tags = cache.read_tags | {self._tag}

    def _start_processes(self) -> "_ProcessLoaderPool":
        flags = 4 * ((self.window or 0) + self.lookahead) + 64  # > jobs alive, as a rule
        return _ProcessLoaderPool(self, flags, self._mp_context, tag=self._tag,
                                  settled=weakref.WeakMethod(self._settled))

    def _settled(self, idx: int, kind: str, times: tuple[int, int] | None) -> None:
        """Count what a loader process did with its load of ``idx`` (``kind``: 'stored',
        'refused' (no room for an open size), 'staged' or 'dropped'), measured by
        ``times`` (see :class:`_WaitMeter`)."""
        self._load_times.add(times)
        with self._lock:
            if kind != "dropped":
                self.loaded += 1
            if kind == "refused" and self._may_refuse:
                self._refused[idx] = True
            if kind == "staged":
                self._staged.add(idx)
            if kind == "dropped":
                self.dropped += 1

    def close(self) -> None:
        """Stop the loads (the loader threads of a running epoch, whose iterator then raises
        :class:`PrefetchError` if it is advanced; the loader processes with ``processes=N``:
        a later epoch starts new ones) and give back every staging slot holding a sample it
        staged. Idempotent and quiet, also after the cache was closed; also done when the
        prefetcher is collected or the program exits."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
        if self._procs is not None:
            self._procs.close()
            self._procs = None
        _give_back_staged(self.cache, self._tag, self._staged, final=False)

    def __len__(self) -> int:
        return len(self._tap.base)

    @property
    def base(self) -> Any:
        """The base order, ``sampler``."""
        return self._tap.base

    @property
    def generator(self) -> Any:
        """The base sampler's ``generator`` (an AttributeError if it has none): accelerate's
        ``prepare()`` shares it between its processes, as for a ``RandomSampler`` of its own,
        so that every process draws the same order."""
        return self._tap.base.generator

    @generator.setter
    def generator(self, value: Any) -> None:
        self._tap.base.generator = value

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the order (and so to the base sampler, if it has one)."""
        if hasattr(self._order, "set_epoch"):
            self._order.set_epoch(epoch)
        if epoch != self._epoch:  # (the same epoch again keeps the position)
            self._progress = None
            loaded, self._skip_loaded = self._skip_loaded, None
            if loaded is not None and 0 < loaded["consumed"] < loaded["len"]:
                warnings.warn(f"set_epoch({epoch}) discards the resume position loaded for "
                              f"epoch {loaded['epoch']} ({loaded['consumed']} of "
                              f"{loaded['len']} indices consumed)", stacklevel=2)
            if loaded is not None:  # the loaded epoch is not drawn again: go on from after it
                _set_generator_state(self._tap.base, _checked_generator_state(
                    self._tap.base, loaded, "generator_after"))  # (checked when loaded)
        self._epoch = epoch

    @property
    def position(self) -> int:
        """Indices of the current epoch used so far: the position the latest iterator of the
        epoch started from (a resume's) plus what it has yielded; 0 before one started."""
        progress = self._progress
        return 0 if progress is None else progress[0] + progress[1]

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch, with what is needed to continue it.

        The prefetcher reads its base order ahead (the whole epoch, when an iterator starts),
        so the base's own count says nothing about what was yielded: the position is always
        the prefetcher's. It goes to the order: with a window, to :class:`ReadyFirstSampler`
        (its state); without one, to a base whose ``state_dict`` takes ``consumed``
        (``CacheAwareSampler``, ``WeightedMixtureSampler``: the state is the base's). Any
        other base gets the prefetcher's own state: ``epoch``, ``consumed``, ``len``,
        ``base`` (the base's ``state_dict()`` at the epoch's start, or None),
        ``order_digest`` (a fingerprint of the epoch's base order), and ``generator`` and
        ``generator_after`` (for a base that draws its epochs from a ``torch.Generator``, as
        ``RandomSampler(generator=...)`` does: its state at the epoch's start and after the
        epoch's order was drawn, bytes; else None). A resume sets the generator to its state
        at the epoch's start, takes the base's epoch again and skips ``consumed`` indices
        (the generator then ends where it did, so later epochs are the uninterrupted run's;
        ``set_epoch`` of another epoch instead sets it to its state after the saved epoch),
        and refuses (``ValueError``) a base order that differs: the base's order must be a
        function of its seed and epoch, or of its generator's state.

        Args:
            consumed: indices of this epoch that were used. Default: the number the latest
                iterator of this epoch has yielded (plus the position it was resumed from);
                with a ``DataLoader`` of ``num_workers > 0``, which draws indices ahead of
                the model, pass ``steps * batch_size``.
        """
        progress = self._progress
        if consumed is None and progress is not None:
            consumed = progress[0] + progress[1]
        if self.window is None and not self._tap.positional:
            state = self._skip_state(consumed)
        elif consumed is None:  # no iterator of this epoch has started: the order knows
            state = self._order.state_dict()
        else:
            state = self._order.state_dict(consumed=consumed)
        # (not state["consumed"]: a base's own state need not have it; and under accelerate's
        # prepare(), consumed counts this process's positions: len(self._tap))
        if progress is not None and consumed < len(self._tap):
            _warn_unseeded(self._tap, self._warned)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``, a dict from ``state_dict()``: the next iterator yields
        the rest of its epoch."""
        if self.window is None and not self._tap.positional:
            self._load_skip_state(state)
        else:
            self._order.load_state_dict(state)
        self._progress = None
        self._epoch = state.get("epoch")  # a set_epoch of this epoch keeps the position

    # A base that cannot record a position (no state_dict(consumed=...)), without a window:
    # the prefetcher's own state says how many indices of the epoch's base order were used,
    # with a fingerprint of that order, and a resume takes the base's epoch again and skips
    # them (the base's epoch must be reproducible: seeded, set_epoch, or its generator's state
    # restored, see _generator_of; another order is refused). The generator fields are not
    # required: older states lack them.
    _SKIP_FIELDS = ("epoch", "consumed", "len", "base", "order_digest")

    def _skip_state(self, consumed: int | None) -> dict[str, Any]:
        n, loaded = len(self), self._skip_loaded
        if consumed is not None:
            consumed = check_int("consumed", consumed, low=0, high=n)
        if self._progress is None:  # no iterator of this epoch has started
            if loaded is not None:
                if consumed is not None and consumed != loaded["consumed"]:
                    raise ValueError(f"consumed should be {loaded['consumed']} (the position "
                                     f"loaded by load_state_dict; no iterator has run since), "
                                     f"but got consumed={consumed}")
                return dict(loaded)
            if consumed:
                raise ValueError(f"consumed should be 0: no iterator of this epoch has run, "
                                 f"but got consumed={consumed}")
            return {"epoch": self._epoch, "consumed": 0, "len": n,
                    "base": self._tap.state_now(), "order_digest": None,
                    "generator": _generator_state(self._tap.base), "generator_after": None}
        before, after = self._tap.generators
        return {"epoch": self._epoch, "consumed": consumed, "len": n,
                "base": self._tap.start_state, "order_digest": self._tap.digest,
                "generator": before, "generator_after": after}

    def _load_skip_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state should be a dict from Prefetcher.state_dict(), but got "
                            f"{type(state).__name__}")
        missing = sorted(set(self._SKIP_FIELDS) - set(state))
        if missing:
            raise ValueError(f"state should be a dict from Prefetcher.state_dict() (without a "
                             f"window, over {type(self._tap.base).__name__}), but it lacks "
                             f"{missing}")
        n = len(self)
        if state["len"] != n:
            raise ValueError(f"state['len'] should be this prefetcher's len={n}, but got "
                             f"state['len']={state['len']!r}")
        consumed = check_int("state['consumed']", state["consumed"], low=0, high=n)
        epoch = state["epoch"]
        if epoch is not None:
            epoch = check_int("state['epoch']", epoch, low=0)
        digest = state["order_digest"]
        if digest is not None and not isinstance(digest, str) or digest is None and consumed:
            raise ValueError(f"state['order_digest'] should be a str for consumed={consumed}, "
                             f"but got state['order_digest']={digest!r}")
        base = self._tap.base
        generator = _checked_generator_state(base, state, "generator")
        _checked_generator_state(base, state, "generator_after")
        if state["base"] is not None and hasattr(base, "load_state_dict"):
            base.load_state_dict(state["base"])
        elif epoch is not None and hasattr(base, "set_epoch"):
            base.set_epoch(epoch)
        _set_generator_state(base, generator)
        self._skip_loaded = dict(state, consumed=consumed, epoch=epoch) if digest else None

    def __iter__(self) -> Iterator[int]:
        if "lightning" not in self._warned and in_lightnings_wrapper():
            self._warned.add("lightning")
            warnings.warn(_wrapped_by_lightning(
                "Prefetcher", self._tap.base, " (the prefetcher loads every sample of it before "
                "the first batch)"), stacklevel=2)
        mine = self._dealt_positions()
        self._tap.keep = mine
        if mine is None:
            for block in self._iter_loaded(1):
                yield block[0]
            return
        # Under accelerate's prepare(): every position is yielded, this process's once loaded,
        # in the order of the loads (the window reorders them among themselves); the others,
        # which the shard passes over here, at once.
        self._tap.take()
        loaded = self._iter_loaded(1)
        try:
            for idx, ours in zip(self._tap.full.tolist(), mine.tolist()):
                yield next(loaded)[0] if ours else idx
        finally:
            loaded.close()

    def batches(self, batch_size: int) -> Iterator[list[int]]:
        """The epoch's indices, as iterating the prefetcher gives them, in lists of
        ``batch_size`` (the last may be shorter), each yielded once every sample of it is
        loaded: the iterator of a loader that gathers whole batches (``DeviceLoader``), which
        costs a fraction of a call per index. Not under accelerate's ``prepare()``."""
        batch_size = check_int("batch_size", batch_size, low=1)
        self._tap.keep = None
        return self._iter_loaded(batch_size)

    def _dealt_positions(self) -> np.ndarray | None:
        """Under accelerate's ``prepare()``, the positions of the epoch this process reads
        (see ``_positions_dealt``); else None. Warns once when the base already gives each
        rank its share, which ``prepare()`` splits again."""
        shard = dealt_by_accelerate(self)
        if shard is None:
            return None
        base = self._tap.base
        # (a base with for_accelerate(), a CacheAwareSampler, says so itself)
        if getattr(base, "num_replicas", 1) > 1 and not hasattr(base, "for_accelerate") and \
                "accelerate" not in self._warned:
            self._warned.add("accelerate")
            warnings.warn(
                f"accelerate's prepare() deals this loader's batches to its "
                f"{shard.num_processes} processes, but this Prefetcher's sampler "
                f"({type(base).__name__}) already gives each of {base.num_replicas} ranks its "
                f"share: each rank reads 1/{shard.num_processes} of its share. Give the "
                f"prefetcher sampler.for_accelerate() (of a CacheAwareSampler), which yields "
                f"every rank's batches in the turn prepare() deals them", stacklevel=3)
        return _positions_dealt(shard, self, len(self))

    def _iter_loaded(self, block: int) -> Iterator[list[int]]:
        """The epoch's indices of this process (all of them, but under ``prepare()``), in
        lists of ``block`` positions, each yielded once its samples are loaded: refill the
        window ahead, wait for the loads now due, yield."""
        self._give_back_unread()
        # A miss whose sample the cache refused (open sizes, the arena full) is left to the
        # workers from the next epoch on: loaded ahead, it would be refused again and the
        # worker would load it a second time. A clear(), the only way the arena's use goes
        # down, gives room back: they are loaded ahead again. (Seen as less in use than the
        # most seen at an epoch's start or end: a clear() whose arena filled up again past
        # that before the next epoch's start goes unseen, and those stay with the workers.)
        self._note_arena(clear_refused=True)
        order_it = iter(self._order)  # the base order is taken now (by the tap)
        order_it, start, pos, skip = self._resume(order_it)
        progress = self._progress = [start, 0]
        run = _EpochLoads(self._tap.order, pos, skip, (self.window or 0) + self.lookahead,
                          self._loaders(), dropped=self.dropped, left=self.left,
                          measuring=self.stand_aside and _WaitMeter.WORKS,
                          measured=self._load_times.seen, careful=self.processes or 2)
        half, pool = run.span // 2, run.pool
        try:
            while True:
                ids = list(itertools.islice(order_it, block))
                if not ids:
                    break
                due = run.pos + len(ids)  # the positions [pos, due) are yielded now
                # Refill half a span at a time: one ready_mask call per chunk.
                if run.nxt - (due - 1) <= half:
                    self._refill(run, due)
                pool.flush()  # the jobs of this refill go out together
                if run.pending:
                    self._wait_due(run, ids)
                run.pos = due
                progress[1] += len(ids)  # counted as yielded once the caller has them
                yield ids
        finally:
            self._end_epoch(run)

    def _give_back_unread(self) -> None:
        """Give back what this prefetcher staged last epoch, yielded and never read."""
        staged = self._staged.take()
        if staged:
            staged_idx = np.fromiter(staged, dtype=np.int64, count=len(staged))
            for idx in staged_idx[self.cache.ready_mask(staged_idx, tag=self._tag)].tolist():
                self.cache.unstage(idx, tag=self._tag)

    def _resume(self, order_it: Iterator[int]
                ) -> tuple[Iterator[int], int, int, np.ndarray]:
        """The resume skip: the epoch's order from where this iterator starts, the position
        of the epoch it starts from, the same in the base order (``_Tap.order``), and which
        base positions from 0 on were yielded before it (not loaded again)."""
        base = self._tap.order
        if self.window is not None:
            # A resumed ReadyFirstSampler yields from step ``start`` on; base positions it
            # emitted before are not loaded again.
            start, skip = self._order.resumed_from()
            pos = start
        else:
            # The position this iterator starts from: a resumed base yields only the rest,
            # and one that cannot resume is skipped to the loaded position.
            start, pos, skip = len(self._tap) - len(base), 0, np.zeros(0, dtype=bool)
        loaded, self._skip_loaded = self._skip_loaded, None
        if loaded is not None and self.window is None:
            if base.size != loaded["len"] or self._tap.digest != loaded["order_digest"]:
                raise _order_differs(loaded["epoch"], self._tap)
            pos = start = loaded["consumed"]
            skip = np.ones(pos, dtype=bool)
            order_it = itertools.islice(order_it, pos, None)
        return order_it, start, pos, skip

    def _loaders(self) -> "_Loaders":
        """The loaders of this epoch: the loader processes (started again if one died), or
        new loader threads."""
        if self.processes:
            if self._procs is not None and self._procs.dead():
                self.close()  # an epoch raised that one died: start afresh
            if self._procs is None:
                self._procs = self._start_processes()
            return self._procs
        self._pool = _LoaderPool(self.threads, self._fetch, self._running, self._lock)
        return self._pool

    def _refill(self, run: "_EpochLoads", due: int) -> None:
        """Submit the misses among the base positions from ``run.nxt`` up to a span past the
        last position due, in order; stop early where the measuring throttle
        (``_throttled``) or the staging limit says so."""
        end = min(run.base.size, due - 1 + run.span)
        nxt = run.nxt
        if nxt >= end:
            return
        if not self._load_times.known() and self._throttled(run, False):
            # While the first loads are measured, none may go before one ends: what the
            # loop below would do, without looking at the chunk (once a position, then).
            run.nxt = max(nxt, due)
            return
        chunk = run.base[nxt:end]
        need = ~self.cache.ready_mask(chunk, tag=self._tag)
        if nxt < run.skip.size:
            need[:run.skip.size - nxt] &= ~run.skip[nxt:end]
        oob = ~self.cache.slot_mask(chunk)
        for j in np.flatnonzero(need):
            i, staged = int(chunk[j]), bool(oob[j])
            if i in run.pending or self._left_to_workers(i, staged):
                continue
            bound = self.stand_aside and self._load_times.cpu_bound()
            if bound and self._stands_aside(run, i):
                continue
            if self._throttled(run, bound):
                if nxt + j < due:  # due now: loaded here, the training thread
                    continue  # would wait for it; the workers load it instead
                end = nxt + int(j)  # first see whether loading ahead pays
                break  # (never before due: a yielded index is not loaded)
            if staged:
                if run.ahead >= self._stage_ahead:
                    end = nxt + int(j)  # the staging area is the limit: stop here
                    break
                run.ahead += 1
            timed = run.measuring and (bound or not self._load_times.known() or
                                       run.submitted % _TIME_EVERY == 0)
            run.submitted += 1
            run.pending[i] = (self._submit(run.pool, i, staged, timed), staged)
        run.nxt = end

    def _left_to_workers(self, idx: int, staged: bool) -> bool:
        """Whether the miss ``idx`` is never loaded ahead: the DataLoader's workers load it."""
        if staged and not self._stage_ahead:
            return True  # no staging slots: the workers load it
        # The cache refused it: the workers load it, once.
        return self._may_refuse and bool(self._refused[idx])

    def _stands_aside(self, run: "_EpochLoads", idx: int) -> bool:
        """With CPU-bound loads, whether the miss ``idx`` is left to the DataLoader (counted
        in ``left``): all but one miss in ``_PROBE_EVERY``, which is still loaded, to
        measure; never one whose load is running already."""
        if run.pool.live(idx) is not None:
            return False
        run.aside += 1
        if run.aside % _PROBE_EVERY:
            self.left += 1  # the workers load it, as without a prefetcher
            return True
        return False

    def _throttled(self, run: "_EpochLoads", bound: bool) -> bool:
        """Whether no load may be submitted now: the measuring throttle.

        Until the loads are measured, at most 2 x _LoadTimes.KEEP are submitted; and until
        then, and while standing aside (the probes), one load a loader process runs at a time
        (each job goes to the least busy; two with threads): loads that share a GIL wait for
        it, which would count as waiting on storage and hide CPU-bound loads (575 of 1,500
        misses loaded before standing aside with 32 threads a process; and bursts of probes
        turned a GIL-holding load's verdict back to "not CPU-bound")."""
        known = self._load_times.known()
        return run.measuring and (bound or not known) and (
            (not known and run.submitted >= 2 * _LoadTimes.KEEP) or
            run.submitted - (self._load_times.seen - run.measured0) >= run.careful_in_flight)

    def _wait_due(self, run: "_EpochLoads", ids: list[int]) -> None:
        """Wait for the loads of ``ids``, the positions yielded now, submitted ahead."""
        for idx in ids:
            got = run.pending.pop(idx, None)
            if got is not None:
                job, staged = got
                job.mark_due()  # a sample waiting for a staging slot must not wait
                self._wait(idx, job, run.pool)
                run.ahead -= staged

    def _end_epoch(self, run: "_EpochLoads") -> None:
        """However the epoch's iterator ended: stop its loads, give back what was staged
        ahead and never yielded, and log what was left to the DataLoader or dropped."""
        run.pool.stop()  # threads end; processes stay, their queued jobs are cancelled
        if self._pool is run.pool:
            self._pool = None
        # Whatever was closed first (the cache, the prefetcher, the interpreter), the
        # clean-up is quiet; once the prefetcher's finalizer has run, nothing is left to
        # give back and the cache's descriptor may be gone.
        self._staged.settle()  # no thread of this epoch stages after this
        if not self._staged.closed:
            with contextlib.suppress(ValueError, OSError):  # the cache may be closed
                self._note_arena(clear_refused=False)
                for i, (_, staged) in run.pending.items():  # loaded ahead and never yielded
                    if staged:
                        self.cache.unstage(i, tag=self._tag)
        if self.left > run.left_before:
            logger.info(
                "stocaching: the prefetcher left %d misses of this epoch to the DataLoader: "
                "its loads were CPU-bound (%s), so loading them ahead could not save time, "
                "only cost it; see 'Standing aside' in docs/prefetch.md",
                self.left - run.left_before, self._load_times)
        if self.dropped > run.dropped_before:
            logger.warning(
                "stocaching: %d samples the prefetcher loaded this epoch found no free "
                "staging slot by the time the DataLoader needed them, and the DataLoader "
                "loaded them again (in its workers, or in this process with num_workers=0): "
                "staging_slots (%d, shared by %d local ranks) is smaller than the lead plus "
                "what the DataLoader holds; see 'Sizing staging_slots' in docs/prefetch.md: "
                "2 x ranks x (1 - f) x max(window + lookahead, (num_workers x "
                "prefetch_factor + 1) x batch_size)", self.dropped - run.dropped_before,
                self._staging_slots, self.cache.world.local_world_size)

    def _note_arena(self, clear_refused: bool) -> None:
        """Keep the most of an open-size arena seen in use; with ``clear_refused``, forget
        the refused indices if less is in use now (a clear())."""
        if not self._may_refuse:
            return
        used = self.cache.arena_used
        if clear_refused and used < self._arena_used:
            with self._lock:
                self._refused[:] = False
            self._arena_used = used
        else:
            self._arena_used = max(self._arena_used, used)

    def _submit(self, pool: "_Loaders", idx: int, staged: bool, timed: bool) -> "_Job":
        """A load of ``idx``: the one still running from an earlier epoch, or a new one
        (timed by its loader when ``timed``: see ``_TIME_EVERY``)."""
        job = pool.live(idx)
        if job is not None and job.staged == staged:
            return job
        return pool.submit(idx, staged, timed)

    def _fetch(self, job: "_Job", stop: threading.Event, meter: "_WaitMeter") -> None:
        """Load one sample and store it; runs in a loader thread."""
        idx = job.idx
        t0 = meter.now() if job.timed else None
        value = self.load(idx)
        self._load_times.add(meter.since(t0))
        if not job.staged:
            self.cache.set_slot(idx, value, exist_ok=True)
            if self._may_refuse and not self.cache.stored_mask([idx])[0]:  # no room
                with self._lock:
                    self._refused[idx] = True
        else:
            # Full: the DataLoader frees staging slots as its workers read what was
            # yielded. Once the index is due, waiting could only deadlock (the slots may
            # all be held by the batch being assembled): the workers load it instead.
            while True:
                staged = self._staged.stage(self.cache, idx, value, self._tag, stop)
                if staged is None:  # the epoch (or the prefetcher) is over: not staged
                    return
                if staged:
                    break
                if job.due:
                    with self._lock:
                        self.dropped += 1
                    return
                if stop.wait(0.002):  # the epoch was abandoned
                    return
        with self._lock:
            self.loaded += 1

    def _wait(self, idx: int, job: "_Job", pool: "_Loaders") -> None:
        """Wait for the load of ``idx``. A job cancelled meanwhile (queued by an epoch that
        was abandoned, and never started) is submitted again; a loader process that died
        is reported as soon as it is seen, not at the timeout."""
        deadline = time.monotonic() + self.timeout
        def closed() -> PrefetchError:
            return PrefetchError(f"load({idx}): the prefetcher was closed (close()) while this "
                                 f"iterator ran", idx)

        while True:
            if pool.stopped and not job.done():  # (a job the pool will never run)
                raise closed()
            if not job.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                dead = pool.dead()
                if dead:
                    raise PrefetchError(f"load({idx}): a loader process of the prefetcher "
                                        f"died ({dead}); the loads it held are lost", idx)
                if time.monotonic() >= deadline:
                    raise PrefetchError(f"load({idx}) did not finish within timeout="
                                        f"{self.timeout:g} s (prefetcher)", idx)
                continue
            outcome = job.outcome
            if outcome is _Job.DONE:
                return
            if outcome is _Job.CANCELLED:
                if pool.stopped:  # (cancelled by the stop)
                    raise closed()
                job = pool.submit(idx, job.staged, job.timed)
                job.mark_due()
                pool.flush()
                continue
            if isinstance(outcome, (KeyboardInterrupt, SystemExit)):
                raise outcome
            raise PrefetchError(f"load({idx}) failed in the prefetcher: "
                                f"{type(outcome).__name__}: {outcome}", idx) from outcome


class _DistributedPrefetcher(Prefetcher, _OverDistributed):
    """A ``Prefetcher`` over a ``DistributedSampler``: one too (see ``_OverDistributed``)."""

    def _distributed_base(self) -> torch.utils.data.DistributedSampler:
        return self._tap.base

    @property
    def epoch(self) -> int:
        """The base sampler's ``epoch``."""
        return self._tap.base.epoch


class _Staged:
    """The indices a prefetcher's loads staged, and how many stages are under way. A loader
    thread stages only while its epoch (``stop``) and the prefetcher (``closed``) go on, so
    that once both are over and :meth:`settle` has returned, nothing more is staged by a
    thread and the give-back finds everything."""

    SETTLE_S = 10.0  # a stage is a copy into shared memory: far less, unless the lock hangs

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.indices: set[int] = set()
        self.busy = 0
        self.closed = False

    def stage(self, cache: SharedCache, idx: int, value: Any, tag: int,
              stop: threading.Event) -> bool | None:
        """``cache.stage``'s answer, or None (nothing staged) once the epoch or the
        prefetcher is over."""
        with self.cond:
            if stop.is_set() or self.closed:
                return None
            self.busy += 1
        done = False
        try:
            done = cache.stage(idx, value, tag=tag)
        finally:
            with self.cond:
                self.busy -= 1
                if done:
                    self.indices.add(idx)
                self.cond.notify_all()
        return done

    def add(self, idx: int) -> None:
        with self.cond:
            self.indices.add(idx)

    def take(self) -> set[int]:
        with self.cond:
            taken, self.indices = self.indices, set()
        return taken

    def settle(self) -> None:
        """Wait until no stage is under way."""
        with self.cond:
            self.cond.wait_for(lambda: self.busy == 0, self.SETTLE_S)


def _give_back_staged(cache: BaseCache, tag: int, staged: _Staged, final: bool = True
                      ) -> None:
    """Free every staging slot that holds a sample staged with ``tag`` (found in the staging
    map, so that loads whose result has not been seen are included), once the stages under
    way are done; with ``final`` (the prefetcher is gone, or the program ends), no loader
    thread stages anything afterwards. Quiet whatever was closed first."""
    if final:
        with staged.cond:
            staged.closed = True
    staged.settle()
    staged.take()
    _unstage_tagged(cache, tag)


def _unstage_tagged(cache: BaseCache, tag: int) -> None:
    """Free every staging slot that holds a sample staged with ``tag``; quiet when the
    cache is closed."""
    with contextlib.suppress(ValueError, OSError):  # the cache may be closed by now
        oob = np.flatnonzero(~cache.slot_mask())
        for idx in oob[cache.ready_mask(oob, tag=tag)].tolist():
            cache.unstage(idx, tag=tag)


class _Tap:
    """Passes a sampler through and keeps the order of its latest epoch, which the
    prefetcher reads ahead in; other attributes are the sampler's."""

    def __init__(self, base: Any, dataset_len: int) -> None:
        if not (hasattr(base, "__iter__") and hasattr(base, "__len__")):
            raise TypeError(f"sampler should be a Sampler or an iterable of ints with a length, "
                            f"but got sampler of type {type(base).__name__}")
        self.base, self.dataset_len = base, dataset_len
        self.order = np.zeros(0, dtype=np.int64)
        # Whether the base records a position (its state_dict takes consumed), and else its
        # state when the latest epoch started (None without state_dict).
        state_dict = getattr(base, "state_dict", None)
        try:
            self.positional = state_dict is not None and \
                "consumed" in inspect.signature(state_dict).parameters
        except (TypeError, ValueError):
            self.positional = False
        self.start_state: Any = None
        # The state of its generator (see _generator_of) before and after the latest epoch's
        # order was drawn.
        self.generators: tuple[bytes | None, bytes | None] = (None, None)
        self._digest: str | None = None
        # Under accelerate's prepare(): the positions of the epoch this process reads (bool),
        # which alone it passes on; the whole epoch's order; whether take() has listed an
        # epoch that __iter__ has not passed on yet.
        self.keep: np.ndarray | None = None
        self.full = self.order
        self._taken = False

    def __len__(self) -> int:
        return len(self.base) if self.keep is None else int(np.count_nonzero(self.keep))

    def take(self) -> None:
        """List the base's epoch now; the next ``__iter__`` passes it on."""
        self.start_state = self.state_now()
        before = _generator_state(self.base)
        order = np.asarray(list(self.base), dtype=np.int64)
        self.generators = (before, _generator_state(self.base))
        _check_in_range("sampler", order, self.dataset_len)
        if self.keep is not None and order.size != self.keep.size:
            raise ValueError(f"sampler should yield len(sampler)={self.keep.size} indices per "
                             f"epoch, but it yielded {order.size}")
        self.full = order
        self.order = order if self.keep is None else order[self.keep]
        self._digest, self._taken = None, True

    def __iter__(self) -> Iterator[int]:
        if not self._taken:
            self.take()
        self._taken = False
        return iter(self.order.tolist())

    def state_now(self) -> Any:
        """The base's own state now (None if it has none, or records a position)."""
        state_dict = getattr(self.base, "state_dict", None)
        return None if state_dict is None or self.positional else state_dict()

    @property
    def digest(self) -> str:
        """Fingerprint of the latest epoch's order."""
        if self._digest is None:
            self._digest = _digest(self.order)
        return self._digest

    def __getattr__(self, name: str) -> Any:  # set_epoch, state_dict, ... of the sampler
        return getattr(self.__dict__["base"], name)


class _EpochLoads:
    """The state of one epoch's iterator (``Prefetcher._iter_loaded``): where it is in the
    base order, the loads it submitted ahead, and its counts for the measuring throttle and
    standing aside. Its steps are the prefetcher's (``_refill``, ``_wait_due``,
    ``_end_epoch``)."""

    __slots__ = ("base", "pos", "skip", "nxt", "span", "pool", "pending", "ahead",
                 "submitted", "aside", "measuring", "measured0", "careful_in_flight",
                 "dropped_before", "left_before")

    def __init__(self, base: np.ndarray, pos: int, skip: np.ndarray, span: int,
                 pool: "_Loaders", *, dropped: int, left: int, measuring: bool,
                 measured: int, careful: int) -> None:
        self.base, self.span, self.pool = base, span, pool
        self.pos = pos  # the base position yielded next
        self.skip = skip  # base positions [0, skip.size) yielded before: not loaded again
        # The base position the next refill looks at first.
        self.nxt = int(np.argmin(skip)) if skip.size and not skip.all() else skip.size
        self.pending: dict[int, tuple[_Job, bool]] = {}  # index -> (its load, staged or not)
        self.ahead = 0  # staged loads submitted and not yet yielded
        self.dropped_before, self.left_before = dropped, left  # the counters at the start
        self.aside = 0  # misses seen while standing aside
        # The measuring throttle (``Prefetcher._throttled``): on or not, loads submitted,
        # loads finished before the epoch, loads a loader process runs at a time.
        self.measuring, self.submitted = measuring, 0
        self.measured0, self.careful_in_flight = measured, careful


class _Job:
    """One load: the index, whether its sample goes to a staging slot, whether its loader
    times it (``timed``, for standing aside: see ``_TIME_EVERY``), its ``outcome`` once
    it ended (``DONE``, ``CANCELLED`` or the exception it raised; set once, by ``end``), and
    ``due``, set (by ``mark_due``) once the iterator needs the index now. The iterator
    waits for it (``wait``); were two threads to wait at once (an abandoned epoch's iterator
    still waiting in another thread), one of them would see the end only at its timeout.
    (Not a concurrent.futures.Future: making, ending and waiting for one cost about 10 us of
    the training process's CPU a load, against 0.5 us.)"""

    __slots__ = ("idx", "staged", "timed", "outcome", "_waiter", "due", "flag", "due_flag")

    DONE, CANCELLED = "done", "cancelled"

    def __init__(self, idx: int, staged: bool, timed: bool = True) -> None:
        self.idx, self.staged, self.timed = idx, staged, timed
        self.outcome: Any = None
        self._waiter: threading.Lock | None = None  # held while the iterator waits
        self.due = False  # (a plain flag: an Event per job cost about 30 us of CPU a load)
        # Tells a loader process too (set by _ProcessLoaderPool.submit when it has a flag).
        self.flag: Callable[[], None] | None = None
        self.due_flag = -1  # its entry in the due flags (processes=N); -1: none, or given back

    def done(self) -> bool:
        return self.outcome is not None

    def end(self, outcome: Any) -> None:
        """The job ended with ``outcome``; wakes the iterator if it waits. Once only."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        waiter = self._waiter
        if waiter is not None:
            waiter.release()

    def wait(self, timeout: float) -> bool:
        """Whether the job ended, waiting up to ``timeout`` seconds for it. (The waiter is
        made and taken before ``outcome`` is looked at again: an ``end`` in between either
        sees it and releases it, or came first and is seen.)"""
        if self.outcome is None:
            waiter = self._waiter
            if waiter is None:
                waiter = threading.Lock()
                waiter.acquire()
                self._waiter = waiter
            if self.outcome is None:
                waiter.acquire(timeout=timeout)
        return self.outcome is not None

    def mark_due(self) -> None:
        self.due = True
        if self.flag is not None:
            self.flag()


def _halt_threads(stop: threading.Event, jobs: queue.SimpleQueue,
                  threads: list[threading.Thread], timeout: float = 10.0) -> None:
    """Stop a loader pool's threads and wait, up to ``timeout`` in all, for the loads they
    run (a load that hangs on storage must not hold the exit for long)."""
    stop.set()
    for _ in threads:
        jobs.put(None)
    deadline = time.monotonic() + timeout
    for t in threads:
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


class _Loaders:
    """What a prefetcher asks of its loaders, threads (:class:`_LoaderPool`) or processes
    (:class:`_ProcessLoaderPool`): ``submit(idx, staged, timed)`` a load (timed by its
    loader or not) and get its :class:`_Job`, which the iterator waits for; ``flush()`` once
    the jobs of a refill are submitted; ``live(idx)``, a load of ``idx`` still running from
    an earlier epoch, which the next epoch waits for instead of loading it again; ``stop()``
    at the end of an epoch (its jobs not started are cancelled); ``stopped``, whether a job
    not done yet will never run; ``dead()``, the loaders that died."""

    def submit(self, idx: int, staged: bool, timed: bool = True) -> _Job:
        raise NotImplementedError

    def flush(self) -> None:
        """Hand over the jobs submitted since the last flush, which a pool may hold back
        until then so that the jobs of one refill go out together (processes: one message
        each). The default holds none back: a loader thread takes each job as it is
        submitted."""

    def live(self, idx: int) -> _Job | None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def stopped(self) -> bool:
        raise NotImplementedError

    def dead(self) -> str:
        """The loaders that died, as text; '' if none (the default: threads do not die)."""
        return ""


class _LoaderPool(_Loaders):
    """Daemon threads running ``fetch(job, stop, meter)`` for submitted jobs, in the order
    submitted; ``stop()`` lets each finish its current load and go, and cancels the jobs
    that no thread has started. ``running`` (guarded by ``lock``) holds the loads running
    in a loader thread, of this pool or an earlier epoch's: see ``live``."""

    def __init__(self, n: int, fetch: Callable[[_Job, threading.Event, "_WaitMeter"], None],
                 running: dict[int, _Job], lock: threading.Lock) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._fetch = fetch
        self._running, self._lock = running, lock
        # Started one per job submitted, up to n: an epoch whose samples are all cached
        # starts none (starting 16 took 26 ms an epoch on 2 busy cores, 4 us a sample of a
        # 6,000-sample epoch, more than the DeviceLoader's whole gather of a small sample).
        self._most = n
        self._threads: list[threading.Thread] = []
        # At interpreter exit, stop the threads and wait for their current loads: a daemon
        # thread still inside a load (torch's C++) when the interpreter finalizes is ended by
        # pthread_exit, whose unwinding through C++ aborts the process ("terminate called
        # without an active exception", seen once in a full CI run). The threads drop their
        # target when they end, so this does not keep a finished pool alive.
        weakref.finalize(self, _halt_threads, self._stop, self._jobs, self._threads)

    def submit(self, idx: int, staged: bool, timed: bool = True) -> _Job:
        job = _Job(idx, staged, timed)
        self._jobs.put(job)
        if len(self._threads) < self._most:
            thread = threading.Thread(target=self._run, daemon=True,
                                      name=f"stocaching-prefetch-{len(self._threads)}")
            self._threads.append(thread)
            thread.start()
        return job

    def live(self, idx: int) -> _Job | None:
        """The load of ``idx`` running in a loader thread, of this pool or an earlier one."""
        with self._lock:
            return self._running.get(idx)

    def _run(self) -> None:
        meter = _WaitMeter()
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                if self._stop.is_set():
                    job.end(_Job.CANCELLED)
                    continue
                try:
                    self._load(job, meter)
                except BaseException as e:  # handed to the iterator, which raises it
                    job.end(e)
                else:
                    job.end(_Job.DONE)
        finally:
            meter.close()

    def _load(self, job: _Job, meter: "_WaitMeter") -> None:
        """Run ``fetch`` for ``job``, which is in ``running`` meanwhile."""
        with self._lock:
            self._running[job.idx] = job
        try:
            self._fetch(job, self._stop, meter)
        finally:
            with self._lock:
                if self._running.get(job.idx) is job:
                    del self._running[job.idx]

    def stop(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._jobs.put(None)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


def _unpicklable_load(load: Any, ctx: Any, error: BaseException) -> TypeError:
    return TypeError(f"load should be picklable to start loader processes with "
                     f"multiprocessing_context={ctx.get_start_method()!r} (a function, or a "
                     f"bound method of a picklable dataset, defined at the top level of a "
                     f"module; or use 'fork'), but got load={load!r}: "
                     f"{type(error).__name__}: {error}")


class _ProcessLoaderPool(_Loaders):
    """Loader processes for ``Prefetcher(processes=N)``: each runs the user's ``load`` in its
    loader threads and stores the result in the cache itself (``set_slot``, or ``stage``
    until the index is due). Jobs and results travel in batches: ``submit`` collects jobs and
    ``flush`` sends each to the least busy live process, one message to each; in a process, one
    thread hands them to the loader threads and another sends back, in one message, every
    result that is ready. (One message per job cost about 200 us of CPU a load on this
    project's 2-core machine, as much as a decode.) A thread of this process turns results
    into the jobs' outcomes. Jobs of an abandoned epoch that no process has started are
    cancelled (an epoch counter in shared memory); the processes stay for the next epoch."""

    def __init__(self, owner: "Prefetcher", flags: int, ctx: Any, *, tag: int,
                 settled: Callable[[], Callable[[int, str, Any], None] | None]) -> None:
        if ctx.get_start_method() != "fork":  # refused before anything starts (queues, too)
            try:
                multiprocessing.reduction.ForkingPickler.dumps(owner.load)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise _unpicklable_load(owner.load, ctx, e) from e
        self._jobs = [ctx.SimpleQueue() for _ in range(owner.processes)]  # one a process
        self._results = ctx.SimpleQueue()
        self._batch: list[tuple] = []  # submitted, not sent yet
        self._busy = [0] * owner.processes  # jobs sent to each process, results not back
        # A live job's "due now" flag, one entry each: an entry is taken at submit and given
        # back when the job's last message has come (its process reads it no more by then).
        # A job submitted while all are taken gets none and counts as due from the start.
        # Beside it, whether a loader process has begun the job (for ``live``).
        self._due, self._started = ctx.RawArray("b", flags), ctx.RawArray("b", flags)
        self._free_flags = list(range(flags))
        self._epoch = ctx.RawValue("q", 0)
        self._next_id = 0
        self._live: dict[int, _Job] = {}  # job id -> job, until its result came
        self._by_idx: dict[int, _Job] = {}  # index -> its latest job, while it lives
        self._lock = threading.Lock()
        self._settled = settled  # the prefetcher's counts of a result, while it lives
        self._procs = [ctx.Process(target=_load_in_process, name=f"stocaching-prefetch-{k}",
                                   args=(owner.cache, owner.load, tag, self._jobs[k],
                                         self._results, self._due, self._started,
                                         self._epoch, owner.threads, os.getpid(), k),
                                   daemon=True)
                       for k in range(owner.processes)]
        try:
            for p in self._procs:
                p.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            for p in self._procs:  # those started already
                if p.pid is not None:
                    p.kill()
                    p.join()
            if ctx.get_start_method() == "fork":
                raise
            raise _unpicklable_load(owner.load, ctx, e) from e
        self._reader = threading.Thread(target=self._read, name="stocaching-prefetch-results",
                                        daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(owner, _ProcessLoaderPool._shut, self._procs,
                                           self._jobs, self._results)

    def submit(self, idx: int, staged: bool, timed: bool = True) -> _Job:
        with self._lock:
            j, self._next_id = self._next_id, self._next_id + 1
            flag = self._free_flags.pop() if self._free_flags else -1
            job = _Job(idx, staged, timed)
            if flag >= 0:
                self._due[flag] = self._started[flag] = 0
                job.flag = functools.partial(self._mark_due, job)
            job.due_flag = flag
            self._live[j] = self._by_idx[idx] = job
            self._batch.append((j, idx, staged, timed, self._epoch.value, flag))
        return job

    def flush(self) -> None:
        """Send the jobs submitted since the last flush, each to the live process with the
        fewest jobs not finished, one message a process. None goes to a dead process, whose
        pipe would fill up and block this call for good; with none alive, nothing is sent and
        the iterator's wait reports the dead processes."""
        if not self._batch:  # (most positions: is_alive() is a system call a process)
            return
        with self._lock:
            batch, self._batch = self._batch, []
            alive = [k for k, p in enumerate(self._procs) if p.is_alive()]
            share: dict[int, list] = {k: [] for k in alive}
            for job in batch if alive else ():
                k = min(alive, key=self._busy.__getitem__)  # the least busy (first of equals)
                share[k].append(job)
                self._busy[k] += 1
        for k, jobs in share.items():
            if jobs:
                self._jobs[k].put(jobs)

    def _mark_due(self, job: _Job) -> None:
        """Set the due flag of ``job`` if it still holds one: the iterator also marks jobs
        that finished long before, whose flag may belong to a later job by then."""
        with self._lock:
            if job.due_flag >= 0:
                self._due[job.due_flag] = 1

    def _read(self) -> None:
        while True:
            msg = self._results.get()
            if msg is None:
                return
            sender, batch = msg
            with self._lock:
                self._busy[sender] -= len(batch)
            for msg in batch:
                self._settle(*msg)  # (its locals must not keep the prefetcher alive meanwhile)

    def _settle(self, j: int, kind: str, payload: Any) -> None:
        """Turn one result of a loader process into its job's outcome."""
        with self._lock:
            job = self._live.pop(j, None)
            if job is not None and self._by_idx.get(job.idx) is job:
                del self._by_idx[job.idx]
            if job is not None and job.due_flag >= 0:
                self._free_flags.append(job.due_flag)
                job.due_flag = -1  # no longer its own: _mark_due must not touch it
        if job is None:
            return
        if kind == "cancelled":
            job.end(_Job.CANCELLED)
            return
        if kind in ("stored", "refused", "staged", "dropped"):
            settled = self._settled()
            if settled is not None:
                settled(job.idx, kind, payload)
        if kind == "error":
            name, text, tb = payload
            job.end(RuntimeError(f"{name}: {text}\n\nTraceback in the loader process:\n{tb}"))
        else:
            job.end(_Job.DONE)

    def live(self, idx: int) -> _Job | None:
        """The latest job of ``idx`` if a loader process has started it and its result has
        not come yet (a job only queued by an abandoned epoch will be cancelled: not that;
        nor a job without a due flag, whose start is not known)."""
        with self._lock:
            job = self._by_idx.get(idx)
            if job is not None and job.due_flag >= 0 and self._started[job.due_flag]:
                return job
        return None

    def stop(self) -> None:
        """The epoch's iterator ended: jobs not started yet are cancelled."""
        self._epoch.value += 1

    def dead(self) -> str:
        """The loader processes that died, as text ('' if none)."""
        return ", ".join(f"pid {p.pid} exit code {p.exitcode}" for p in self._procs
                         if not p.is_alive())

    def close(self) -> None:
        self._epoch.value += 1
        self._finalizer()

    @property
    def stopped(self) -> bool:
        """Closed: its processes are gone."""
        return not self._finalizer.alive

    @staticmethod
    def _shut(procs: list, jobs: list, results: Any) -> None:
        for q, p in zip(jobs, procs):  # each live process's threads end
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    q.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        with contextlib.suppress(OSError, ValueError):
            results.put(None)  # the reader thread ends


def _load_in_process(cache: BaseCache, load: Callable[[int], Any], tag: int, jobs: Any,
                     results: Any, due: Any, started: Any, epoch: Any, threads: int,
                     parent: int, me: int) -> None:
    """A loader process of ``Prefetcher(processes=N)``: ``threads`` loader threads, fed the
    jobs of this process's batches by this thread until a None comes, and a thread that sends
    their results back in batches."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process
    torch.set_num_threads(1)
    mine: queue.SimpleQueue = queue.SimpleQueue()  # jobs, for this process's threads
    done: queue.SimpleQueue = queue.SimpleQueue()  # their results, to send
    loaders = [threading.Thread(target=_load_jobs, name=f"stocaching-prefetch-{k}",
                                args=(cache, load, tag, mine, done, due, started, epoch),
                                daemon=True) for k in range(threads)]
    sender = threading.Thread(target=_send_results, args=(done, results, me),
                              name="stocaching-prefetch-send", daemon=True)
    for t in loaders + [sender]:
        t.start()
    while True:
        batch = jobs.get()
        if batch is None:  # every loader thread ends
            for _ in range(threads):
                mine.put(None)
            break
        for job in batch:
            mine.put(job)
    for t in loaders:
        t.join()
    # The prefetcher is closing: what this process staged is of no use any more, and the
    # training process may not be able to give it back (its cache closed first).
    _unstage_tagged(cache, tag)
    done.put(None)
    sender.join()


def _send_results(done: queue.SimpleQueue, results: Any, me: int) -> None:
    """Send the results of this process's loader threads, as ``(me, [result, ...])``: each
    message holds every result ready by then (one, when loads finish one by one), until a
    None comes."""
    while True:
        batch = [done.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                batch.append(done.get_nowait())
        end = batch[-1] is None
        if len(batch) > end:
            results.put((me, batch[:len(batch) - end]))
        if end:
            return


def _load_jobs(cache: BaseCache, load: Callable[[int], Any], tag: int, jobs: Any,
               results: Any, due: Any, started: Any, epoch: Any) -> None:
    """One loader thread of a loader process: takes jobs from ``jobs`` and puts each result
    in ``results`` (this process's queues), with how long the load waited and the CPU it used
    (see :class:`_WaitMeter`) if the job is timed, else None."""
    meter = _WaitMeter()
    while True:
        msg = jobs.get()
        if msg is None:
            meter.close()
            return
        j, idx, staged, timed, ep, flag = msg
        if ep != epoch.value:
            results.put((j, "cancelled", None))
            continue
        if flag >= 0:
            started[flag] = 1
        try:
            t0 = meter.now() if timed else None
            value = load(idx)
            times = meter.since(t0)
            if not staged:
                cache.set_slot(idx, value, exist_ok=True)
                kind = "refused" if cache.may_refuse and not cache.stored_mask([idx])[0] \
                    else "stored"
            else:
                kind = "staged"
                while not cache.stage(idx, value, tag=tag):
                    is_due = flag < 0 or due[flag]
                    if is_due or ep != epoch.value:
                        kind = "dropped" if is_due else "cancelled"
                        break
                    time.sleep(0.002)
            results.put((j, kind, times))
        except BaseException as e:  # noqa: B902 - handed to the training process
            results.put((j, "error", (type(e).__name__, str(e), traceback.format_exc())))


def _die_with_parent(parent: int) -> None:
    """End with the training process ``parent``, even when it is killed by SIGKILL: the
    kernel kills this process with its parent (``PR_SET_PDEATHSIG``, Linux) when that parent is
    the training process; otherwise (started by a fork server, whose process is the parent, or
    not on Linux) a thread checks every half second that the training process still lives, and
    ends this process when it does not. Gone already: end now."""
    deathsig = False
    with contextlib.suppress(Exception):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        deathsig = libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    if deathsig and os.getppid() == parent:
        return
    if not _lives(parent):
        os._exit(0)
    threading.Thread(target=_watch, args=(parent,), name="stocaching-prefetch-watch",
                     daemon=True).start()


def _watch(parent: int) -> None:
    while _lives(parent):
        time.sleep(0.5)
    os._exit(0)


def _lives(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # (no /proc: it answered the signal)
