"""The cache-preferring order: ready samples first, within a window.

:class:`ReadyFirstSampler` wraps any base order (``RandomSampler``, ``DistributedSampler``,
:class:`~stocaching.CacheAwareSampler`, ...) and, within a window of ``W`` positions, emits the
indices whose samples are ready (in the cache) before those that are not. Every index of the
base order still comes exactly once per epoch, and none moves more than ``W`` positions from
where the base order put it::

    from torch.utils.data import DataLoader, RandomSampler
    from stocaching import ReadyFirstSampler

    sampler = ReadyFirstSampler(RandomSampler(dataset), dataset.cache, window=256)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=2)

``ready_first_order`` is the rule itself, on a ready mask. Reordering cannot change how many
misses an epoch has; with a :class:`~stocaching.Prefetcher` (``prefetch.py``, which uses this
order when given a ``window``) the order gives the loads lead time. See docs/order.md.

This module imports only public names of ``stocaching`` and what the opt-in modules share in
``_common.py`` (internal), so it also works copied next to ``stocaching.py`` and
``_common.py``; ``prefetch.py`` needs it beside them.

Contents: 1. the rule (``ready_first_order``), 2. one epoch's iteration, 3. the sampler
(``ReadyFirstSampler``). What a resume needs of the base order, and the samplers under
trainers, are in ``_common.py``, shared with the prefetcher.
"""

from __future__ import annotations

__all__ = ["ReadyFirstSampler", "WIDE_WINDOW_PART", "ready_first_order"]

import inspect
import logging
import time
import warnings
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

try:  # inside the package
    from ._common import (_GENERATOR_FIELDS, _check_in_range, _checked_generator_state,
                          _class_over_base, _digest, _generator_state, _level_outside_stocaching,
                          _order_differs, _OverDistributed, _RecordingSampler,
                          _set_generator_state, _warn_unseeded, _wrapped_by_lightning,
                          check_state_fields, joined_rest, refuse_changed_fields,
                          warn_position_discarded)
    from .stocaching import BaseCache, check_int
    from .trainers import dealt_by_accelerate, in_lightnings_wrapper
except ImportError:  # copied beside stocaching.py, _common.py and trainers.py
    from _common import (_GENERATOR_FIELDS, _check_in_range,  # type: ignore[no-redef]
                         _checked_generator_state, _class_over_base, _digest, _generator_state,
                         _level_outside_stocaching, _order_differs, _OverDistributed,
                         _RecordingSampler, _set_generator_state, _warn_unseeded,
                         _wrapped_by_lightning, check_state_fields, joined_rest,
                         refuse_changed_fields, warn_position_discarded)
    from stocaching import BaseCache, check_int  # type: ignore[no-redef]
    from trainers import dealt_by_accelerate, in_lightnings_wrapper  # type: ignore[no-redef]

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
# 1. The rule: ready first within a window, on a mask
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
# 2. One epoch's iteration
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



# ----------------------------------------------------------------------------------------------
# 3. The sampler: ReadyFirstSampler
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
    The state is per rank: each rank saves and loads its own. On another world (other ranks,
    nodes or per-rank batch size), over a base whose order does not depend on the world
    (``CacheAwareSampler``, ``WeightedMixtureSampler``), load the list of every saved rank's
    state, saved at the same step: together they say which positions of the epoch's global
    order were consumed (a reordered epoch consumes no prefix), and the new world's bases deal
    exactly the others, each once (see ``load_state_dict``).

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
        return super().__new__(_class_over_base(cls, ReadyFirstSampler,
                                                _DistributedReadyFirstSampler, args, kwargs,
                                                "base"))

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
            warn_position_discarded(epoch, self.epoch, self._loaded["consumed"],
                                    self._loaded["len"])
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
        n = self._epoch_length()
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
            expect = f"len(base)={n} indices per epoch" if n == len(self) else \
                f"{n} indices in epoch {self.epoch} (the rest it resumed on another world)"
            raise ValueError(f"base should yield {expect}, but it yielded {indices.size}; if "
                             f"the base sampler was resumed on its own, resume the "
                             f"ReadyFirstSampler instead")
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
            Over a base whose order does not depend on the world (one with ``rest_state``,
            ``epoch_positions`` and ``epoch_length``: ``CacheAwareSampler``,
            ``WeightedMixtureSampler``) also ``steps`` (the indices of the epoch: fewer than
            ``len`` in an epoch resumed on another world) and ``world``: what this rank
            consumed, as the base's state of the epoch's rest (``epoch_done`` and
            ``epoch_taken``, the positions of the global order consumed out of order, as
            ``[start, stop)`` runs: with every rank at the same step, the base positions
            below ``consumed - window`` cut back to a batch boundary, and those emitted after
            them, at most ``batch_size + 2 * window`` a rank).
        """
        ep = self._ep if self._ep is not None and self._ep.epoch == self.epoch else None
        n = self._epoch_length() if ep is None else ep.n
        if consumed is not None:
            consumed = check_int("consumed", consumed, low=0, high=n)
        if self._loaded is not None:
            if consumed is not None and consumed != self._loaded["consumed"]:
                raise ValueError(f"consumed should be {self._loaded['consumed']} (the position "
                                 f"loaded by load_state_dict; no iterator has run since), but "
                                 f"got consumed={consumed}")
            return dict(self._loaded)
        if ep is None:
            if consumed:
                raise ValueError(f"consumed should be 0: no iterator of epoch {self.epoch} "
                                 f"has run, but got consumed={consumed}")
            state = self._state(0, self._base_state())
            if self._resizable():
                state["world"] = self.base.rest_state(0)
            return state
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
        if self._resizable():
            state["world"] = self._world_state(ep, consumed)
        # (not a prefetcher's order: the prefetcher warns)
        if consumed < n and not isinstance(self.base, _RecordingSampler):
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

        A list (or tuple) of states is the states of every rank of a world, saved at the
        same step (``state_dict(consumed=steps * batch_size)`` on each rank, gathered, say,
        with ``torch.distributed.all_gather_object``): the base (over which they must carry
        a ``world``) loads their joined ``world`` states, the positions of the epoch's order
        that any rank consumed, and deals the rest over its own world (another
        ``num_replicas``, nodes or ``batch_size``; the same one too), padded as it pads an
        epoch, or cut with ``drop_last``. The next iterator yields this rank's share of the
        rest from its start, in this sampler's order (``window`` and ``mode`` may differ);
        a list missing a rank, or of ranks at different steps, is refused.

        Args:
            state: a dict from ``state_dict()`` of a sampler of the same rank, or the list of
                every rank's state of a world.
        """
        if isinstance(state, (list, tuple)):
            self._load_world(state)
            return
        own = self._state(0, None)
        check_state_fields(state, "ReadyFirstSampler", set(own) - self._NEWER_FIELDS)
        refuse_changed_fields(state, own, ("window", "mode"))
        refuse_changed_fields(state, own, ("len",), consequence=(
            "; a state of another world (other ranks, nodes or batch size) resumes from the "
            "states of all its ranks: load_state_dict([rank 0's state, rank 1's, ...])"
            if state.get("world") is not None else ""))
        n = check_int("state['steps']", state.get("steps", own["len"]), low=0,
                      high=own["len"])
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

    # Fields that states saved by older versions lack.
    _NEWER_FIELDS = {*_GENERATOR_FIELDS, "steps", "world"}

    def _state(self, consumed: int, base_state: Any) -> dict[str, Any]:
        state = {"epoch": self.epoch, "consumed": consumed, "window": self.window,
                 "mode": self.mode, "len": len(self), "base": base_state,
                 "order_digest": None, "emitted": None, "ready": None,
                 "generator": _generator_state(self.base), "generator_after": None}
        if self._resizable():  # (the fields of a base whose epoch another world resumes)
            state["steps"], state["world"] = self._epoch_length(), None
        return state

    def _resizable(self) -> bool:
        """Whether the base's order does not depend on the world, and it says where each of
        its indices is in it (``CacheAwareSampler``, ``WeightedMixtureSampler``)."""
        return all(callable(getattr(self.base, name, None))
                   for name in ("rest_state", "epoch_positions", "epoch_length"))

    def _epoch_length(self) -> int:
        """Indices the base yields in the current epoch: ``len(base)``, or fewer in an epoch
        it resumed on another world (a base with ``epoch_length``)."""
        length_of = getattr(self.base, "epoch_length", None)
        return len(self) if length_of is None else length_of(self.epoch)

    def _world_state(self, ep: _Epoch, consumed: int) -> dict[str, Any]:
        """What this rank consumed of the epoch at ``consumed``, as the base's state of the
        epoch's rest (``rest_state``; a base that is ``_resizable``).

        Every base position below ``consumed - window`` was emitted (its deadline), the
        same on every rank at the same step: that prefix, and the positions emitted after
        it (``emitted_before``), are what the rank consumed."""
        rest_of = self.base.rest_state
        if consumed == ep.n:  # (with drop_last, what the saved world cut stays cut)
            return rest_of(consumed)
        lo = max(0, consumed - self.window)
        hi = min(ep.n, consumed + self.window + 1)
        return rest_of(lo, lo + np.flatnonzero(ep.emitted_before(consumed, lo, hi)))

    def _load_world(self, states: Any) -> None:
        """``load_state_dict`` of the states of every rank of a world (any world): the
        base resumes the epoch's rest, what no rank consumed, and the next iterator yields
        it from its start, in this sampler's order."""
        if not states:
            raise ValueError("states should be the states of every rank of the world they "
                             "were saved in, but got an empty list")
        worlds = []
        for k, state in enumerate(states):
            check_state_fields(state, "ReadyFirstSampler", ("epoch", "consumed"),
                               detail=f" (states[{k}])")
            if state.get("world") is None:
                raise ValueError(
                    f"states[{k}]['world'] is missing: the base sampler it was saved over gives "
                    f"each rank an order that depends on the world (or says nothing of it), "
                    f"so another world cannot resume it; load the state of this rank alone "
                    f"on the same world, or make the base a CacheAwareSampler (or "
                    f"WeightedMixtureSampler), whose order does not depend on the world")
            for field in ("epoch", "consumed"):  # (each rank's world assumes the others')
                if state[field] != states[0][field]:
                    raise ValueError(f"states[{k}]['{field}'] should be that of the first "
                                     f"state, {states[0][field]!r} (the ranks of one world at "
                                     f"one step), but got {state[field]!r}")
            worlds.append(state["world"])
        merged = joined_rest(worlds, "states[{k}]['world']")
        if not hasattr(self.base, "load_state_dict"):
            raise TypeError(f"the base sampler ({type(self.base).__name__}) has no "
                            f"load_state_dict, so it cannot resume another world's epoch")
        self.base.load_state_dict(merged)  # may refuse; ours is unchanged then
        self.epoch = check_int("states[0]['epoch']", states[0]["epoch"], low=0)
        self._ep, self._spare, self._loaded = None, None, None

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
