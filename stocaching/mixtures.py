"""Weighted mixtures of datasets: ``WeightedMixtureSampler`` and ``MixtureDataset``.

An epoch draws from several sub-datasets in proportion to their weights. With weights
proportional to their lengths (the default), it sees every element of every sub-dataset exactly
once, randomly interleaved; an up-weighted sub-dataset repeats (spread over the epoch), a
down-weighted one is subsampled without repetition. The order is a pure function of
``(seed, epoch)``, split over ranks as ``DistributedSampler`` does, and one ``state_dict()`` of
any rank restores every rank. ``MixtureDataset`` concatenates the sub-datasets (each may hold its
own ``SharedCache``) and reports each one's hit rate.

Example::

    from stocaching import MixtureDataset, WeightedMixtureSampler

    mix = MixtureDataset([imagenet, lsun, cifar])      # each with its own .cache, or none
    sampler = WeightedMixtureSampler(mix, [0.7, 0.25, 0.05], seed=0)
    loader = torch.utils.data.DataLoader(mix, batch_size=64, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        before = mix.stats()
        for batch in loader:
            ...
        print(sampler.shares(epoch), [s["hit_rate"] for s in mix.stats(since=before)])

An opt-in part of stocaching: it imports only public names of the core module
(``stocaching.py``) and the opt-ins' internal module (``_common.py``), so copying the three
files side by side into a project also works.
See docs/mixtures.md.
"""

from __future__ import annotations

__all__ = ["MixtureDataset", "WeightedMixtureSampler"]

import logging
import math
import time
import warnings
from fractions import Fraction
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

try:  # inside the package
    from ._common import (EpochPosition, EpochRest, SavedEpoch, check_state_fields,
                          refuse_changed_fields, rest_state)
    from .stocaching import BaseCache, World, check_int
    from .trainers import in_lightnings_wrapper
except ImportError:  # copied beside stocaching.py, _common.py and trainers.py
    from _common import (EpochPosition, EpochRest,  # type: ignore[no-redef]
                         SavedEpoch, check_state_fields, refuse_changed_fields, rest_state)
    from stocaching import BaseCache, World, check_int  # type: ignore[no-redef]
    from trainers import in_lightnings_wrapper  # type: ignore[no-redef]

logger = logging.getLogger("stocaching")

#: Weights must be above this (conveyer's bound): a smaller one is almost surely a mistake.
MIN_WEIGHT = 0.001
# Positions per block of the interleave and elements per group of a pass (see _interleave and
# _Stream): every shuffle is of one block or one group, small enough for the CPU's cache and
# for torch.randperm to run on one thread (see _permutation). Blocks are also at most
# 1/_MIN_BLOCKS of the epoch, so that an up-weighted sub-dataset's passes stay apart in epochs
# of any size.
_BLOCK = 32768
_GROUP = 32768
_MIN_BLOCKS = 64
# Weights within this relative distance of proportional to the lengths count as proportional.
_PROPORTIONAL_RTOL = 1e-9


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _lengths_of(source: Any) -> tuple[int, ...]:
    """The sub-dataset lengths of a ``MixtureDataset`` or of a sequence of sized objects or
    ints, checked: at least one, none empty."""
    if isinstance(source, MixtureDataset):
        return source.lengths
    if isinstance(source, (str, bytes)) or not isinstance(source, Sequence):
        raise TypeError(f"datasets should be a MixtureDataset or a sequence of datasets (or of "
                        f"their lengths), but got datasets of type {type(source).__name__}")
    if len(source) == 0:
        raise ValueError("datasets should hold at least one dataset, but got datasets=[]")
    lengths = []
    for k, d in enumerate(source):
        if hasattr(d, "__len__"):
            n = len(d)
        elif isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            n = int(d)
        else:
            raise TypeError(f"datasets[{k}] should be a dataset with a length, or a length, but "
                            f"got datasets[{k}] of type {type(d).__name__}")
        if n < 1:
            raise ValueError(f"datasets[{k}] should have at least one element, but got "
                             f"len(datasets[{k}])={n}")
        lengths.append(n)
    return tuple(lengths)


def _check_weights(weights: Any, count: int) -> tuple[float, ...]:
    """``count`` finite numbers above ``MIN_WEIGHT``, as floats."""
    if isinstance(weights, (str, bytes, Mapping)) or not hasattr(weights, "__len__"):
        raise TypeError(f"weights should be a sequence of {count} numbers > {MIN_WEIGHT}, but "
                        f"got weights of type {type(weights).__name__}")
    weights = list(weights)
    if len(weights) != count:
        raise ValueError(f"weights should have one number per dataset ({count}), but got "
                         f"{len(weights)}: weights={weights!r}")
    out = []
    for k, w in enumerate(weights):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.integer,
                                                                  np.floating)):
            raise TypeError(f"weights[{k}] should be a finite number > {MIN_WEIGHT}, but got "
                            f"weights[{k}]={w!r} (type {type(w).__name__})")
        w = float(w)
        if not math.isfinite(w) or w <= MIN_WEIGHT:
            raise ValueError(f"weights[{k}] should be a finite number > {MIN_WEIGHT}, but got "
                             f"weights[{k}]={w!r}")
        out.append(w)
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# The epoch: counts, then the order
# ----------------------------------------------------------------------------------------------


def _quotas(lengths: Sequence[int], weights: Sequence[float], total: int) -> list[Fraction]:
    """Each sub-dataset's exact share of ``total`` positions. Weights proportional to the
    lengths (within a relative 1e-9) are taken as exactly proportional, so that float weights
    such as (0.5, 0.3, 0.2) for lengths (50, 30, 20) still give every element once."""
    n = np.asarray(lengths, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if np.allclose(w / w.sum(), n / n.sum(), rtol=_PROPORTIONAL_RTOL, atol=0):
        exact = [Fraction(int(x)) for x in lengths]
    else:
        exact = [Fraction(x) for x in weights]  # a float is an exact fraction
    s = sum(exact)
    return [total * x / s for x in exact]


def _round_counts(quotas: Sequence[Fraction], u: float) -> np.ndarray:
    """Round ``quotas`` (summing to an int) to ints with the same sum: each is its floor plus
    at most one, and the extra units go to sub-dataset k with probability equal to its
    remainder (systematic sampling with the offset ``u`` in [0, 1)), so over epochs the mean
    count is the quota exactly."""
    floors = [math.floor(q) for q in quotas]
    acc, prev, out = Fraction(u), math.floor(Fraction(u)), []
    for q, f in zip(quotas, floors):
        acc += q - f
        now = math.floor(acc)
        out.append(f + now - prev)
        prev = now
    return np.asarray(out, dtype=np.int64)


def _runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``range(s, s + c)`` over the starts ``s`` and counts ``c``."""
    nz = np.flatnonzero(counts)
    s, c = starts[nz], counts[nz]
    ends = np.cumsum(c)
    return np.repeat(s - (ends - c), c) + np.arange(int(ends[-1]))


def _permutation(m: int, g: torch.Generator) -> np.ndarray:
    """A uniformly random permutation of ``range(m)``, for ``m`` up to 32768: torch's (about
    twice as fast as numpy's, in cache). Above 32768 elements torch splits the work over
    threads, which on a machine whose other core is busy was measured 6 to 20 times slower
    (39000 or 65536 elements) than on one thread; hence blocks and groups of 32768."""
    return torch.randperm(m, generator=g, dtype=torch.int32).numpy()


class _Stream:
    """A sub-dataset's ``count`` positions of an epoch, handed out block by block in the
    order of ``count // n`` passes over its ``n`` elements (each a uniformly random
    permutation), then the start of one more: a uniformly random subset of ``count % n``
    distinct elements. Values are global indices (the sub-dataset's offset added).

    A pass is not permuted as a whole (``torch.randperm`` of millions of elements misses the
    CPU's caches on almost every step): it is cut into groups of consecutive elements, each
    shuffled on its own (in cache), and ``take(m)`` draws how many of its ``m`` items come
    from each group as a uniformly random permutation of the pass would (multivariate
    hypergeometric over what each group has left), then takes the next ones of each group.
    So the ``m`` items are a uniformly random subset of what the pass has left, as the next
    ``m`` of one permutation of the pass would be; only their order differs (grouped), and
    the caller shuffles the block they go to."""

    def __init__(self, n: int, count: int, offset: int, dtype: type, size: int,
                 rng: np.random.Generator, g: torch.Generator) -> None:
        self.n, self.left, self.offset, self.rng, self.g = n, count, offset, rng, g
        self.starts = np.arange(0, n, size, dtype=np.int64)
        self.sizes = np.minimum(size, n - self.starts)
        self.items = np.empty(n, dtype=dtype)
        self._new_pass()

    def _new_pass(self) -> None:
        for s, m in zip(self.starts.tolist(), self.sizes.tolist()):
            np.add(_permutation(m, self.g), self.items.dtype.type(self.offset + s),
                   out=self.items[s:s + m])
        self.avail = self.sizes.copy()  # per group: not handed out yet in this pass
        self.in_pass = self.n

    def take(self, m: int, out: np.ndarray) -> None:
        """Writes the next ``m`` items into ``out`` (``m`` long)."""
        at = 0
        while m:
            if self.in_pass == self.n and m >= self.n:
                # Whole passes: every element once each, in any order (the block is
                # shuffled), so the untouched current pass's items serve for all of them and
                # stay untouched for the next pass (their order, unused here, is still a
                # uniform draw for it).
                whole = m // self.n * self.n
                out[at:at + whole].reshape(-1, self.n)[:] = self.items
                self.left -= whole
                at += whole
                m -= whole
                continue
            if m >= self.in_pass:  # the rest of the pass
                t = self.avail
            elif self.avail.size == 1:
                t = np.asarray([m])
            else:
                t = self.rng.multivariate_hypergeometric(self.avail, m)
            k = int(t.sum())
            used = self.sizes - self.avail
            if self.avail.size == 1:
                out[at:at + k] = self.items[int(used[0]):int(used[0]) + k]
            else:
                np.take(self.items, _runs(self.starts + used, t), out=out[at:at + k])
            self.avail = self.avail - t
            self.in_pass -= k
            self.left -= k
            at += k
            m -= k
            if self.in_pass == 0 and self.left:
                self._new_pass()


def _interleave(lengths: Sequence[int], counts: np.ndarray, offsets: np.ndarray,
                rng: np.random.Generator, dtype: type) -> np.ndarray:
    """The order of an epoch: the sub-datasets' streams (``_Stream``) interleaved block by
    block (blocks of ``_BLOCK`` positions, or 1/64 of the epoch if that is less). Each block
    takes from every stream as many items as a uniformly random interleave would put there
    (multivariate hypergeometric over what each stream has left), and is shuffled. So when
    no sub-dataset repeats, the order is a uniformly random permutation of the chosen
    elements (the first block is a uniformly random subset of them in random order, and so
    on); an up-weighted sub-dataset's passes follow one another through the epoch.

    Every shuffle is of a block or a group (at most 32768 elements), small enough to stay in
    the CPU's cache and on one thread (see ``_permutation``). The draws of each block's share
    of every group grow with blocks times groups, the square of the epoch: with the rest of
    ``_Stream.take``'s own time, about a tenth of the build at 10 M positions and a quarter
    at 100 M (cProfile)."""
    g = torch.Generator()
    g.manual_seed(int(rng.integers(2**63)))
    total = int(counts.sum())
    streams = [_Stream(n, c, o, dtype, _GROUP, rng, g)
               for n, c, o in zip(lengths, counts.tolist(), offsets[:-1].tolist()) if c]
    left = np.asarray([s.left for s in streams], dtype=np.int64)
    out = np.empty(total, dtype=dtype)
    step = max(1, min(_BLOCK, -(-total // _MIN_BLOCKS)))
    block = np.empty(step, dtype=dtype)
    for start in range(0, total, step):
        size = min(step, total - start)
        take = rng.multivariate_hypergeometric(left, size) if len(streams) > 1 else \
            np.asarray([size])
        at = 0
        for stream, m in zip(streams, take.tolist()):
            if m:
                stream.take(m, block[at:at + m])
                at += m
        np.take(block[:size], _permutation(size, g), out=out[start:start + size])
        left -= take
    return out


# ----------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------


class WeightedMixtureSampler(torch.utils.data.Sampler[int]):
    """Sampler of a weighted mixture of datasets; also a drop-in for ``DistributedSampler``.

    It yields global indices of the concatenation of the sub-datasets (``MixtureDataset``'s
    indices: sub-dataset k's element j is ``sum(lengths[:k]) + j``).

    **Epoch length**: ``num_samples`` positions per epoch (all ranks together, before the
    padding below); default: the sum of the sub-datasets' lengths.

    **Counts**: sub-dataset k gets ``quota_k = num_samples * w_k / sum(w)`` positions, rounded
    so that the counts sum to ``num_samples`` exactly: each count is the floor of its quota or
    one more, and the extra units go to sub-dataset k with probability equal to its quota's
    fractional part, drawn from ``(seed, epoch)`` (systematic sampling). So every epoch is
    within one position of the quotas, and over epochs the mean count equals the quota.
    Weights proportional to the lengths (within a relative 1e-9) count as exactly proportional.

    **Elements**: a sub-dataset with count ``c`` and length ``n`` gives ``c // n`` whole passes
    (every element once each) and then ``c % n`` distinct elements drawn at random, so each
    element comes ``c // n`` or ``ceil(c / n)`` times. Hence: weights proportional to the
    lengths with the default length = every element of every sub-dataset exactly once; a
    down-weighted sub-dataset (``c < n``) is subsampled without repetition, a new random subset
    each epoch (independent across epochs); an up-weighted one repeats at most
    ``ceil(c / n)`` times. The passes are spread over the epoch: the p-th copy of an element
    lies in about the fraction ``[p n / c, (p + 1) n / c)`` of it.

    **Order**: the sub-datasets are interleaved at random (in each block of
    ``min(32768, ceil(num_samples / 64))`` positions exactly as a uniformly random shuffle
    would; without repeats the order is a uniformly random permutation of the epoch's
    elements), a pure function of ``(seed, epoch)`` through local generators. Ranks get
    ``order[rank::num_replicas]`` after padding by repeating the order's start up to a
    multiple of ``num_replicas`` (or truncating, with ``drop_last``), as
    ``DistributedSampler`` does; padding may repeat an element once more.

    **Resume**: ``state_dict()`` records the epoch, how many indices of it this rank has
    yielded and everything that fixes the order; since every rank consumes the same number
    per step, the state of *any* rank restores *every* rank (``load_state_dict`` on each).
    With ``num_workers > 0`` the loader prefetches, so pass what the model consumed:
    ``state_dict(consumed=steps * batch_size)``. The seed, ``num_replicas``, ``drop_last`` and
    the sub-dataset lengths must match. **Weights or num_samples may differ**: the saved epoch
    then finishes with the weights and length it was saved with (the rest of the same order,
    so its guarantees hold), and the new ones apply from the next epoch on.

    .. warning::
        Call ``set_epoch(epoch)`` before each epoch, as with ``DistributedSampler``: without it
        every epoch repeats the same order (iterating an epoch twice issues a warning).

    Args:
        datasets: a ``MixtureDataset``, or a sequence of the sub-datasets (anything with a
            length) or of their lengths; at least one, none empty.
        weights: one finite number > 0.001 per sub-dataset, relative (they need not sum to
            1). Default: the lengths (every element once per epoch).
        num_replicas: number of ranks. Default: ``torch.distributed``'s world size if it is
            initialised, else ``World.from_env()``'s (the launcher's variables, else 1).
        rank: this rank, in ``[0, num_replicas)``. Default: from the same source.
        seed: seed of the order, in ``[0, 2**63)``; identical on every rank. Default: 0.
        drop_last: truncate instead of pad, as in ``DistributedSampler``. Default: False.
        num_samples: positions per epoch over all ranks, an int >= 1. Default: the sum of the
            lengths.
    """

    def __init__(self, datasets: Any, weights: Sequence[float] | None = None, *,
                 num_replicas: int | None = None, rank: int | None = None, seed: int = 0,
                 drop_last: bool = False, num_samples: int | None = None) -> None:
        lengths = _lengths_of(datasets)
        weights = tuple(float(n) for n in lengths) if weights is None else \
            _check_weights(weights, len(lengths))
        if num_replicas is None or rank is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                ws, r = dist.get_world_size(), dist.get_rank()
            else:
                here = World.from_env()
                ws, r = here.world_size, here.rank
            num_replicas = ws if num_replicas is None else num_replicas
            rank = r if rank is None else rank
        self.num_replicas = check_int("num_replicas", num_replicas, low=1)
        self.rank = check_int("rank", rank, low=0, high=self.num_replicas - 1)
        self.seed = check_int("seed", seed, low=0, high=2**63 - 1)
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last should be a bool, but got drop_last={drop_last!r}")
        self.drop_last = bool(drop_last)
        self.num_samples = sum(lengths) if num_samples is None else \
            check_int("num_samples", num_samples, low=1)
        if self.drop_last and self.num_samples < self.num_replicas:
            raise ValueError(f"num_samples should be at least num_replicas={self.num_replicas} "
                             f"with drop_last=True (else every rank gets nothing), but got "
                             f"num_samples={self.num_samples}")
        self.lengths = lengths
        self.weights = weights
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.epoch = 0
        # The recipe (weights, num_samples) of an epoch loaded from a state saved with others.
        self._saved: tuple[int, tuple[float, ...], int] | None = None
        self._position = EpochPosition()
        self._epoch_rest: EpochRest | None = None  # a resume of another world's state
        self._warned_wrapped = False

    # -- what an epoch is ----------------------------------------------------------------------

    def _recipe(self, epoch: int) -> tuple[tuple[float, ...], int]:
        if self._saved is not None and self._saved[0] == epoch:
            return self._saved[1], self._saved[2]
        return self.weights, self.num_samples

    def _per_rank(self, total: int) -> int:
        return total // self.num_replicas if self.drop_last else \
            math.ceil(total / self.num_replicas)

    def counts(self, epoch: int | None = None) -> np.ndarray:
        """Positions of each sub-dataset in ``epoch`` (default: the current one), over all
        ranks and before padding: the realised shares are ``counts / counts.sum()``.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = self.epoch if epoch is None else check_int("epoch", epoch, low=0)
        weights, total = self._recipe(epoch)
        rng = np.random.default_rng([self.seed, epoch, 0])
        return _round_counts(_quotas(self.lengths, weights, total), float(rng.random()))

    def shares(self, epoch: int | None = None) -> np.ndarray:
        """The realised share of each sub-dataset in ``epoch`` (default: the current one):
        ``counts(epoch) / num_samples``, floats summing to 1."""
        c = self.counts(epoch)
        return c / c.sum()

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """The sub-dataset and the index in it of each global index.

        Args:
            indices: global indices, in ``[0, sum(lengths))``.

        Returns:
            ``(sub, local)``, two int64 arrays of the shape of ``indices``.
        """
        return _locate(self.offsets, indices)

    def global_order(self, epoch: int) -> np.ndarray:
        """The whole order of ``epoch`` (every rank's indices before the split and padding),
        without changing the sampler's state: int32 while the indices fit (half the memory
        of 10 M indices), else int64.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = check_int("epoch", epoch, low=0)
        t0 = time.perf_counter()
        counts = self.counts(epoch)
        rng = np.random.default_rng([self.seed, epoch, 1])
        total = int(self.offsets[-1])
        dtype = np.int32 if max(total, int(counts.sum())) < 2**31 else np.int64
        order = _interleave(self.lengths, counts, self.offsets, rng, dtype)
        logger.debug("mixture epoch %d: counts %s, built in %.3f s", epoch, counts.tolist(),
                     time.perf_counter() - t0)
        return order

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's indices for ``epoch`` (int64, ``len(self)`` of them for the current
        epoch), without changing the sampler's state.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        order = self.global_order(epoch)
        return order[self._positions_of(epoch, order.size)].astype(np.int64)

    def epoch_positions(self, epoch: int) -> np.ndarray:
        """Where in ``epoch``'s order (``global_order``, before padding) each of this rank's
        indices for the epoch comes from (int64, as many as ``epoch_indices``): what a
        sampler that reorders them (``ReadyFirstSampler``) records of the positions it
        consumed, so that another world resumes exactly the rest.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        return self._positions_of(check_int("epoch", epoch, low=0), self._recipe(epoch)[1])

    def epoch_length(self, epoch: int) -> int:
        """Indices this rank's iterator of ``epoch`` yields from the epoch's start:
        ``len(self)``, or fewer in an epoch resumed from a state of another world."""
        rest = self._epoch_rest
        total = self._recipe(epoch)[1]
        if rest is not None and rest.epoch == epoch:
            return rest.per_rank(total, self.num_replicas, self.drop_last)
        return self._per_rank(total)

    def _positions_of(self, epoch: int, total: int) -> np.ndarray:
        """This rank's positions of ``epoch``'s order of ``total`` positions: every
        ``num_replicas``-th of the sequence the ranks split, the order repeated from its
        start (padding) or cut (drop_last), as DistributedSampler splits it; after a resume
        of another world's state, the sequence of the positions no rank consumed."""
        rest = self._epoch_rest
        if rest is not None and rest.epoch == epoch:  # another world's state: its rest
            return rest.positions(total, self.num_replicas, self.drop_last)[
                self.rank::self.num_replicas]
        per_rank = self._per_rank(total)
        return np.arange(self.rank, per_rank * self.num_replicas, self.num_replicas,
                         dtype=np.int64) % max(total, 1)

    # -- the Sampler protocol ------------------------------------------------------------------

    def __len__(self) -> int:
        """Indices per rank in the current epoch (the whole epoch, also right after a resume)."""
        return self._per_rank(self._recipe(self.epoch)[1])

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; call it on every rank before each epoch.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = check_int("epoch", epoch, low=0)
        if epoch != self.epoch:
            self._position.leave_epoch(epoch, self.epoch, len(self))
            self._epoch_rest = None  # (the rest of a resumed epoch is that epoch's)
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        """This rank's indices for the current epoch, from the loaded position if any."""
        if self.num_replicas > 1 and not self._warned_wrapped and in_lightnings_wrapper():
            self._warned_wrapped = True
            warnings.warn(
                f"Lightning (use_distributed_sampler=True) put this WeightedMixtureSampler, "
                f"which already gives each of its {self.num_replicas} ranks its share, inside "
                f"a DistributedSampler of its own: each rank trains on 1/{self.num_replicas} "
                f"of its share, and set_epoch does not reach it. Give the loader "
                f"CacheAwareSampler(dataset, batch_size=..., order=this sampler), a "
                f"DistributedSampler that Lightning leaves alone, or pass "
                f"Trainer(use_distributed_sampler=False)", stacklevel=2)
        return self._position.iterate(self.epoch, self.epoch_indices)

    # -- resume --------------------------------------------------------------------------------

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch, with everything that fixes the order.

        Args:
            consumed: indices of this epoch this rank has used. Default: the number the
                latest iterator has yielded (plus the resumed position it started from).

        Returns:
            A dict of plain values: ``epoch``, ``consumed``, ``seed``, ``num_replicas``,
            ``drop_last``, ``lengths``, ``weights`` and ``num_samples`` (those the epoch is
            built with), ``epoch_done`` and ``epoch_taken`` (the positions of the epoch's
            order that a world before this one consumed: a prefix, and packed bits over
            positions after it), and ``rank`` (informative: any rank's state fits every
            rank).
        """
        consumed = self._position.consumed(self.epoch) if consumed is None else \
            check_int("consumed", consumed, low=0, high=len(self))
        weights, total = self._recipe(self.epoch)
        rest = self._epoch_rest
        if rest is None or rest.epoch != self.epoch:
            rest = EpochRest(self.epoch, 0)
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed,
                "num_replicas": self.num_replicas, "drop_last": self.drop_last,
                "lengths": list(self.lengths), "weights": list(weights),
                "num_samples": total, **rest.fields(), "rank": self.rank}

    def rest_state(self, consumed: int, taken: Any = ()) -> dict[str, Any]:
        """This rank's state of the current epoch as its rest, as
        ``CacheAwareSampler.rest_state`` gives it (the same arguments): for
        ``ReadyFirstSampler`` over a mixture."""
        return rest_state(self, consumed, taken, batch_size=1,
                          length=self._recipe(self.epoch)[1])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (of any rank): the next iterator yields the rest of its epoch.

        ``seed``, ``drop_last`` and ``lengths`` must match this sampler's. ``weights`` and
        ``num_samples`` may differ: the saved epoch finishes with the saved ones, later epochs
        use this sampler's. ``num_replicas`` may differ too (a job resumed by one of another
        size): each rank's indices are every ``num_replicas``-th position of the epoch's
        sequence, so what the saved ranks consumed is a prefix of it, and the rest is split
        over this sampler's ranks, each index once (padded, or cut with ``drop_last``).
        Nothing changes when the state is refused.

        Args:
            state: a dict from ``state_dict()``.
        """
        own = self.state_dict(consumed=0)
        # (states saved before epoch_done existed lack it)
        check_state_fields(state, "WeightedMixtureSampler",
                           set(own) - {"epoch_done", "epoch_taken"})
        refuse_changed_fields(state, own, ("seed", "drop_last"),
                              consequence="; the rest of the epoch would differ")
        if list(state["lengths"]) != own["lengths"]:
            raise ValueError(f"state['lengths'] should be this sampler's sub-dataset lengths "
                             f"{own['lengths']} (the same sub-datasets in the same order), but "
                             f"got state['lengths']={list(state['lengths'])!r}")
        epoch = check_int("state['epoch']", state["epoch"], low=0)
        weights = _check_weights(state["weights"], len(self.lengths))
        total = check_int("state['num_samples']", state["num_samples"], low=1)
        saved = SavedEpoch.of(state, self.drop_last, total)
        consumed = check_int("state['consumed']", state["consumed"], low=0,
                             high=saved.per_rank)
        if weights != self.weights or total != self.num_samples:
            logger.info("resuming epoch %d with its saved weights %s and num_samples %d; the "
                        "new weights %s and num_samples %d apply from epoch %d", epoch,
                        list(weights), total, list(self.weights), self.num_samples, epoch + 1)
            self._saved = (epoch, weights, total)
        else:
            self._saved = None
        self.epoch = epoch
        if saved.num_replicas == self.num_replicas:
            self._epoch_rest = saved.rest_before(epoch)
            self._position.load(consumed)
        else:  # another world: the positions no rank consumed, split anew
            self._epoch_rest = saved.rest_after(epoch, consumed)
            self._position.load(0)


def _locate(offsets: np.ndarray, indices: Any) -> tuple[np.ndarray, np.ndarray]:
    idx = np.asarray(indices)
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices should be ints, but got an array of dtype {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < 0 or idx.max() >= offsets[-1]):
        raise ValueError(f"indices should be in [0, {offsets[-1]}), but got "
                         f"{idx.min()}..{idx.max()}")
    sub = np.searchsorted(offsets, idx, side="right") - 1
    return sub, idx - offsets[sub]


# ----------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------


class MixtureDataset(torch.utils.data.Dataset):
    """The concatenation of several datasets, with each one's cache at hand.

    Index ``sum(lengths[:k]) + j`` is element j of sub-dataset k (as
    ``torch.utils.data.ConcatDataset``). Each sub-dataset may have its own cache (a
    ``SharedCache`` or an ``OpenSizeCache``): by default its ``.cache`` attribute (the README's pattern), or the ones given in
    ``caches``. ``stats()`` gives each cache's counters and hit rate, ``ready_mask()`` tells
    which samples are in their caches (the ``ready`` of ``ReadyFirstSampler``).

    Args:
        datasets: the sub-datasets, a non-empty sequence of datasets with a length >= 1.
        caches: one cache or None per sub-dataset, for datasets that keep their cache
            elsewhere than ``.cache``. Default: each dataset's ``.cache`` if it is a cache
            (``SharedCache``, ``OpenSizeCache``), else None.
        check_samples: require the caches' ``data_dims`` and ``dtype`` to be the same (what
            the default ``collate_fn`` needs to batch samples of different sub-datasets
            together); pass False if your ``collate_fn`` handles different ones. Default: True.
    """

    def __init__(self, datasets: Sequence[Any], *, caches: Sequence[Any] | None = None,
                 check_samples: bool = True) -> None:
        if isinstance(datasets, (str, bytes)) or not isinstance(datasets, Sequence):
            raise TypeError(f"datasets should be a sequence of datasets, but got datasets of "
                            f"type {type(datasets).__name__}")
        for k, d in enumerate(datasets):
            if not (hasattr(d, "__len__") and hasattr(d, "__getitem__")):
                raise TypeError(f"datasets[{k}] should be a dataset (with __len__ and "
                                f"__getitem__), but got datasets[{k}] of type "
                                f"{type(d).__name__}")
        self.lengths = _lengths_of(list(datasets))
        if caches is None:
            caches = [c if isinstance(c := getattr(d, "cache", None), BaseCache) else None
                      for d in datasets]
        else:
            if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
                raise TypeError(f"caches should be a sequence of caches (SharedCache, "
                                f"OpenSizeCache) or None, one per dataset, but got caches of "
                                f"type {type(caches).__name__}")
            caches = list(caches)
            if len(caches) != len(datasets):
                raise ValueError(f"caches should have one entry per dataset ({len(datasets)}), "
                                 f"but got {len(caches)}")
            for k, c in enumerate(caches):
                if c is not None and not isinstance(c, BaseCache):
                    raise TypeError(f"caches[{k}] should be a SharedCache, an OpenSizeCache or "
                                    f"None, but got caches[{k}] of type {type(c).__name__}")
        for k, c in enumerate(caches):
            if c is not None and c.dataset_len != self.lengths[k]:
                raise ValueError(f"caches[{k}].dataset_len should be len(datasets[{k}])="
                                 f"{self.lengths[k]}, but got {c.dataset_len}")
        if check_samples:
            kinds = [(k, c.data_dims if isinstance(c.data_dims, dict) else tuple(c.data_dims),
                      c.dtype) for k, c in enumerate(caches) if c is not None]  # (dicts: fields)
            for k, dims, dtype in kinds[1:]:
                k0, dims0, dtype0 = kinds[0]
                if (dims, dtype) != (dims0, dtype0):
                    raise ValueError(
                        f"datasets[{k}] should hold samples like datasets[{k0}] (its cache has "
                        f"data_dims={dims0}, dtype={dtype0}), but its cache has "
                        f"data_dims={dims}, dtype={dtype}; pass check_samples=False if your "
                        f"collate_fn batches different samples")
        self.datasets = list(datasets)
        self.caches: list[BaseCache | None] = caches
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> Any:
        i = check_int("index", index, low=-len(self), high=len(self) - 1,
                      expect=f"an int in [-{len(self)}, {len(self)})")
        if i < 0:
            i += len(self)
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.datasets[k][i - int(self.offsets[k])]

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """The sub-dataset and the index in it of each global index.

        Args:
            indices: global indices, in ``[0, len(self))``.

        Returns:
            ``(sub, local)``, two int64 arrays of the shape of ``indices``.
        """
        return _locate(self.offsets, indices)

    def counts(self, indices: Any) -> np.ndarray:
        """How many of ``indices`` fall in each sub-dataset (e.g. what one rank read in an
        epoch): one int per sub-dataset.

        Args:
            indices: global indices, in ``[0, len(self))``.
        """
        sub, _ = self.locate(np.asarray(indices).ravel())
        return np.bincount(sub, minlength=len(self.lengths)).astype(np.int64)

    def ready_mask(self, indices: Any = None) -> np.ndarray:
        """True where the sample is in its sub-dataset's cache now (``SharedCache.ready_mask``;
        always False for a sub-dataset without a cache), for ``indices`` (default: all). Pass
        this method as ``ReadyFirstSampler``'s ``ready``."""
        idx = np.arange(len(self)) if indices is None else np.asarray(indices)
        sub, local = self.locate(idx)
        out = np.zeros(idx.shape, dtype=bool)
        for k, c in enumerate(self.caches):
            if c is not None:
                here = sub == k
                if here.any():
                    out[here] = c.ready_mask(local[here])
        return out

    def stats(self, *, since: Sequence[Any] | None = None) -> list[dict[str, Any] | None]:
        """Each sub-dataset's cache counters (``SharedCache.stats()``), None where it has no
        cache; ``hit_rate`` in each is that sub-dataset's.

        Args:
            since: an earlier ``stats()`` of this dataset: counters of the time between, e.g.
                of one epoch. Default: None, since each cache was made.
        """
        if since is not None:
            if isinstance(since, (str, bytes, Mapping)) or not isinstance(since, Sequence) \
                    or len(since) != len(self.caches):
                raise TypeError(f"since should be a list from this dataset's stats() (one "
                                f"entry per sub-dataset), but got since={since!r}")
        return [None if c is None else c.stats(since=None if since is None else since[k])
                for k, c in enumerate(self.caches)]
