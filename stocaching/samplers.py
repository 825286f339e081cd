"""Samplers that read a cache's layout: ``CacheAwareSampler`` for several nodes.

An opt-in part of stocaching. It imports only the public names of the core module
(``stocaching.py``) and the opt-ins' internal module (``_common.py``), so copying the three
files side by side into a project also works.

Example::

    from stocaching import CacheAwareSampler

    sampler = CacheAwareSampler(dataset, batch_size=64)  # where DistributedSampler would go
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...
"""

from __future__ import annotations

__all__ = ["CacheAwareSampler", "ideal_hit_rate"]

import logging
import math
import time
import warnings
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

try:  # inside the package
    from ._common import (EpochPosition, EpochRest, SavedEpoch, check_state_fields,
                          refuse_changed_fields, rest_state)
    from .stocaching import CacheLayout, World, check_int
    from .trainers import accelerate_epoch, dealt_by_accelerate
except ImportError:  # copied beside stocaching.py, _common.py and trainers.py
    from _common import (EpochPosition, EpochRest,  # type: ignore[no-redef]
                         SavedEpoch, check_state_fields, refuse_changed_fields, rest_state)
    from stocaching import CacheLayout, World, check_int  # type: ignore[no-redef]
    from trainers import accelerate_epoch, dealt_by_accelerate  # type: ignore[no-redef]

logger = logging.getLogger("stocaching")

class CacheAwareSampler(torch.utils.data.DistributedSampler):
    """A ``DistributedSampler`` that sends each rank the samples cached on its node.

    The epoch is one global shuffle, padded or truncated exactly as ``DistributedSampler`` does
    (same ``seed + epoch`` generator, so the same global order), and cut into global batches of
    ``batch_size * num_replicas`` indices. Global batch j is the same multiset as under
    ``DistributedSampler`` with ``DataLoader(batch_size=batch_size)``; what changes is which
    rank gets which of its samples. Each node gets ``batch_size * local_world_size`` of them,
    chosen so that as many samples of the batch as possible are read by a node that caches
    them (an exact maximum flow, computed identically on every rank), shuffled and dealt
    ``batch_size`` to each of its ranks. Every rank yields ``len(self)`` indices per epoch;
    all ranks together yield every dataset index exactly once, plus the padding.

    Padding (``drop_last=False``): the shuffled order is repeated from its start up to
    ``num_replicas * ceil(dataset_len / num_replicas)`` indices. With ``drop_last=True`` it is
    cut to ``num_replicas * floor(dataset_len / num_replicas)``. Either way the last global
    batch may be short: every rank then gets ``len(self) % batch_size`` indices of it, so a
    ``DataLoader(drop_last=True)`` drops that same global batch on every rank.

    Ranks ``[k * local_world_size, (k + 1) * local_world_size)`` form node k (torchrun's
    numbering), so ``num_replicas`` must be a multiple of the layout's ``num_nodes``.

    It is a subclass of ``DistributedSampler`` with the same arguments, attributes
    (``dataset``, ``num_replicas``, ``rank``, ``epoch``, ``shuffle``, ``seed``, ``drop_last``,
    ``num_samples`` = ``len(self)`` per rank, ``total_size``) and ``set_epoch``, so trainers that
    replace any other sampler with a distributed one of their own (Lightning's default
    ``use_distributed_sampler=True``) leave it as it is. Under Accelerate, whose ``prepare``
    deals the loader's batches to the processes itself, give the loader ``for_accelerate()``.

    Without a cache (a dataset whose ``.cache`` is None, e.g. caching switched off) it yields
    exactly what ``DistributedSampler`` yields, after a one-time warning. A
    ``torch.utils.data.Subset`` of a cached dataset works: the sampler yields positions in the
    subset and routes each by the dataset index behind it.

    Resume: ``state_dict()`` records the epoch and how many indices of it this rank's latest
    iterator has yielded (the ``DataLoader`` pulls them as it builds batches). With
    ``num_workers > 0`` the loader prefetches, so pass what the model actually consumed:
    ``state_dict(consumed=steps * batch_size)``. After ``load_state_dict`` the next iterator
    yields the rest of that epoch; every rank may load rank 0's state.

    .. warning::
        Call ``set_epoch(epoch)`` before each epoch, as with ``DistributedSampler``: without it
        every epoch repeats the same order (with ``shuffle=True``, iterating an epoch twice
        issues a warning).

    Args:
        dataset: a ``Dataset`` whose ``.cache`` is a cache (``SharedCache``,
            ``OpenSizeCache``) or None, a ``MixtureDataset`` (one cache per sub-dataset, all
            with the same ``num_nodes``; routed over their layouts side by side), a ``Subset``
            of either, a cache, or a bare ``CacheLayout`` (for simulations).
        num_replicas: number of ranks. Default: ``torch.distributed``'s world size if it is
            initialised, else the cache's ``world`` (for a ``CacheLayout``: ``World.from_env()``,
            that is the launcher's variables, else 1).
        rank: this rank, in ``[0, num_replicas)``. Default: from the same source as
            ``num_replicas``, else 0.
        shuffle: shuffle the global order; if False it is index order (the deal of a node's
            samples to its local ranks is still seeded). Default: True.
        seed: seed of the order, in ``[0, 2**63)``; identical on every rank. Default: 0.
        drop_last: truncate instead of pad, as in ``DistributedSampler``. Default: False.
        batch_size: indices per batch on each rank (the ``DataLoader``'s ``batch_size``);
            keyword-only and required, since it fixes the global batches.
        local_world_size: ranks per node. Default: ``num_replicas // num_nodes``.
        order: where the global order comes from instead of a shuffle of the dataset: an
            object with ``global_order(epoch)`` (the epoch's dataset indices, before padding)
            and ``num_samples`` (their number), such as a ``WeightedMixtureSampler`` over the
            sub-datasets whose concatenation the cache covers. Its order is padded, cut into
            global batches and routed as the shuffle would be; ``shuffle`` is then unused.
            This sampler starts at the order's ``epoch`` (if it has one), ``set_epoch`` is
            forwarded to it, and its ``state_dict`` is part of this sampler's, so resuming
            restores it too (with its rule for changed weights); load a mid-epoch state into
            this sampler, not into the order (whose own position it does not use). Default:
            None (the shuffle).
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 batch_size: int, local_world_size: int | None = None,
                 order: Any = None) -> None:
        # DistributedSampler.__init__ is not called: its defaults need an initialised process
        # group and it takes len(dataset) as the epoch; every attribute it sets is set here,
        # with the same meaning.
        self.dataset = dataset
        self.layout, world, self._positions, length, owners = self._resolve(dataset)
        if order is not None:
            if not (callable(getattr(order, "global_order", None))
                    and hasattr(order, "num_samples")):
                raise TypeError(f"order should have global_order(epoch) and num_samples (a "
                                f"WeightedMixtureSampler, say), but got order of type "
                                f"{type(order).__name__}")
            lengths = getattr(order, "lengths", None)
            if lengths is not None and sum(lengths) != length:
                raise ValueError(f"order should draw from the {length} indices of dataset, but "
                                 f"its sub-datasets have sum(lengths)={sum(lengths)}")
            if lengths is not None and isinstance(self.layout, _JoinedLayout) and \
                    self._positions is None and list(lengths) != self.layout.lengths:
                raise ValueError(f"order should draw from the sub-datasets of dataset, of "
                                 f"lengths {self.layout.lengths}, but its sub-datasets have "
                                 f"lengths={list(lengths)}")
            length = check_int("order.num_samples", order.num_samples, low=0)
        self.order = order
        if num_replicas is None or rank is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                ws, r = dist.get_world_size(), dist.get_rank()
            else:
                here = world if world is not None else World.from_env()
                ws, r = here.world_size, here.rank
            num_replicas = ws if num_replicas is None else num_replicas
            rank = r if rank is None else rank
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.num_replicas = check_int("num_replicas", num_replicas, low=1)
        self.rank = check_int("rank", rank, low=0, high=self.num_replicas - 1)
        self.seed = check_int("seed", seed, low=0, high=2**63 - 1)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        num_nodes = self.layout.num_nodes if self.layout is not None else 1
        if world is not None and world.world_size != world.num_nodes * world.local_world_size:
            raise ValueError(
                f"dataset's cache should come from a job with the same number of ranks on "
                f"every node (the sampler sends rank r to node r // local_world_size), but its "
                f"world has world_size={world.world_size} ranks on num_nodes={world.num_nodes} "
                f"nodes with local_world_size={world.local_world_size} on this one: uneven "
                "placement is not supported. Start as many ranks on every node (torchrun "
                "does; under Ray Train, num_workers a multiple of the nodes with "
                "resources_per_worker that fill each node, such as one GPU each, or "
                "placement_strategy='STRICT_SPREAD' for one worker a node), or use a "
                "DistributedSampler")
        if local_world_size is None:
            if self.num_replicas % num_nodes:
                raise ValueError(
                    f"num_replicas should be a multiple of the cache layout's num_nodes="
                    f"{num_nodes} (the same ranks on every node), but got "
                    f"num_replicas={self.num_replicas}")
            local_world_size = self.num_replicas // num_nodes
        self.local_world_size = check_int("local_world_size", local_world_size, low=1)
        if self.num_replicas != num_nodes * self.local_world_size:
            raise ValueError(
                f"num_replicas should be num_nodes * local_world_size = {num_nodes} * "
                f"{self.local_world_size} = {num_nodes * self.local_world_size} (the cache layout "
                f"has num_nodes={num_nodes}), but got num_replicas={self.num_replicas}")
        self.node_rank = self.rank // self.local_world_size
        if world is not None and world.node_rank != self.node_rank:
            warnings.warn(f"rank={self.rank} is on node {self.node_rank} (rank // "
                          f"local_world_size), but its cache was built on node "
                          f"{world.node_rank}: it would be sent samples cached elsewhere",
                          stacklevel=2)
        self.num_samples = length // self.num_replicas if self.drop_last \
            else math.ceil(length / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.dataset_len = length
        # With an order, start at its epoch: a state loaded into it before it was wrapped keeps
        # its epoch (and, for a mixture, the weights that epoch was saved with).
        self.epoch = check_int("order.epoch", getattr(order, "epoch", 0), low=0)
        self._router = None
        if self.layout is not None:
            rows = owners.owner_rows()
            if self._positions is not None:
                rows = (row[self._positions] for row in rows)
            self._router = _BatchRouter(rows)
        self._position = EpochPosition()
        self._epoch_rest = None
        self._positions_kept: tuple[Any, np.ndarray] | None = None  # see epoch_positions
        self._warned_dealt = False

    @staticmethod
    def _resolve(source: Any) -> tuple[Any, World | None, np.ndarray | None, int, Any]:
        """The layout, the cache's world, the dataset index of each sampler position (None:
        the same), the number of positions, and what says which indices each node reads
        without a load (``owner_rows()``: the cache, whose disk tier counts, or the layout),
        for any source the constructor accepts."""
        if isinstance(source, CacheLayout):
            return source, None, None, source.dataset_len, source
        if isinstance(getattr(source, "layout", None), CacheLayout):  # a cache, of any kind
            return source.layout, getattr(source, "world", None), None, \
                source.layout.dataset_len, _owners(source)
        if not hasattr(source, "__len__"):
            raise TypeError(f"dataset should be a Dataset with a .cache attribute (a cache or "
                            f"None), a Subset of one, a cache (SharedCache, OpenSizeCache) or a "
                            f"CacheLayout, but got {type(source).__name__}")
        length, positions = len(source), None
        while isinstance(source, torch.utils.data.Subset):
            idx = np.asarray(source.indices, dtype=np.int64)
            positions = idx if positions is None else idx[positions]
            source = source.dataset
        cache = getattr(source, "cache", None)
        caches = getattr(source, "caches", None)
        if cache is None and isinstance(caches, (list, tuple)) and any(
                c is not None for c in caches):  # a MixtureDataset: one cache per sub-dataset
            joined = _JoinedLayout(caches, getattr(source, "lengths", None))
            if positions is None and length != joined.dataset_len:
                raise ValueError(f"len(dataset) should be the sum of its sub-datasets' lengths="
                                 f"{joined.dataset_len}, but got len(dataset)={length}")
            world = next(getattr(c, "world", None) for c in caches if c is not None)
            return joined, world, positions, length, joined
        if cache is None:
            warnings.warn(f"{type(source).__name__} has no cache (no .cache, or None): "
                          "CacheAwareSampler yields what DistributedSampler would", stacklevel=3)
            return None, None, None, length, None
        if not isinstance(getattr(cache, "layout", None), CacheLayout):
            raise TypeError(f"dataset.cache should be a SharedCache, an OpenSizeCache or None, "
                            f"but got {type(cache).__name__}")
        layout = cache.layout
        if positions is None and length != layout.dataset_len:
            raise ValueError(f"len(dataset) should be its cache's dataset_len="
                             f"{layout.dataset_len}, but got len(dataset)={length}")
        return layout, getattr(cache, "world", None), positions, length, _owners(cache)

    def __len__(self) -> int:
        """Indices per rank per epoch (the whole epoch, also right after a resume)."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; call it on every rank before each epoch.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = check_int("epoch", epoch, low=0)
        if epoch != self.epoch:
            self._position.leave_epoch(epoch, self.epoch, self.num_samples)
            self._epoch_rest = None  # (the rest of a resumed epoch is that epoch's)
        self.epoch = epoch
        if self.order is not None and hasattr(self.order, "set_epoch"):
            self.order.set_epoch(epoch)  # so that its state_dict is the epoch's

    def __iter__(self) -> Iterator[int]:
        """This rank's indices for the current epoch, from the loaded position if any."""
        if self.num_replicas > 1 and not self._warned_dealt and \
                dealt_by_accelerate(self) is not None:
            self._warned_dealt = True
            warnings.warn(
                f"accelerate's prepare() deals this loader's batches to its processes, and this "
                f"CacheAwareSampler already yields only rank {self.rank}'s: each rank trains on "
                f"1/{self.num_replicas} of its share. Build the loader with "
                f"sampler=sampler.for_accelerate(), or a Prefetcher over it "
                f"(see docs/distributed.md)", stacklevel=2)
        # (without a shuffle every epoch is the same order: iterating one again is no mistake)
        return self._position.iterate(self.epoch, self.epoch_indices, warn_again=self.shuffle)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's indices for ``epoch`` (int64, ``len(self)`` of them), without changing
        the sampler's state.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        return self._ranks_indices(epoch, [self.rank])[0]

    def epoch_positions(self, epoch: int) -> np.ndarray:
        """Where in ``epoch``'s global order (before padding) each of this rank's indices
        for the epoch comes from (int64, as many as ``epoch_indices``): what a sampler that
        reorders them (``ReadyFirstSampler``) records of the positions it consumed, so that
        another world resumes exactly the rest.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        # Kept for the epoch: a reordering sampler asks at each state_dict, and each answer
        # is a routing of the epoch. See docs/design.md, "A reordered epoch's state on
        # another world".
        key = (epoch, self._epoch_rest)
        if self._positions_kept is None or self._positions_kept[0] != key:
            self._positions_kept = (key, self._ranks_indices(epoch, [self.rank],
                                                             positions=True)[0])
        return self._positions_kept[1]

    def epoch_length(self, epoch: int) -> int:
        """Indices this rank's iterator of ``epoch`` yields from the epoch's start:
        ``len(self)``, or fewer in an epoch resumed from a state of another world."""
        rest = self._epoch_rest
        if rest is None or rest.epoch != epoch:
            return self.num_samples
        return rest.per_rank(self.dataset_len, self.num_replicas, self.drop_last)

    def _ranks_indices(self, epoch: int, ranks: Sequence[int], *, positions: bool = False
                       ) -> list[np.ndarray]:
        """The indices of each of ``ranks`` for ``epoch``, from one routing of the epoch (or,
        with ``positions``, where in the epoch's order each comes from)."""
        epoch = check_int("epoch", epoch, low=0)
        if self.total_size == 0:
            return [np.zeros(0, dtype=np.int64) for _ in ranks]
        t0 = time.perf_counter()
        if self.order is not None:
            order = np.asarray(self.order.global_order(epoch), dtype=np.int64)
            if order.size != self.dataset_len:
                raise ValueError(f"order.global_order({epoch}) should have num_samples="
                                 f"{self.dataset_len} indices (as when this sampler was made), "
                                 f"but got {order.size}")
        elif self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=g).numpy()
        else:
            order = np.arange(self.dataset_len, dtype=np.int64)
        where = self._epoch_positions(epoch)
        order = order[where]
        picked = where if positions else order
        if self._router is None:  # no cache: DistributedSampler's split
            return [picked[r::self.num_replicas] for r in ranks]

        rng = np.random.default_rng([self.seed, epoch])
        node, hit = self._router.assign(order, self.batch_size * self.num_replicas, rng)
        routed = rng.bit_generator.state  # each node deals from here, whichever rank asks
        dealt: dict[int, np.ndarray] = {}
        for r in ranks:
            k = r // self.local_world_size
            if k not in dealt:
                rng.bit_generator.state = routed
                # (a deal's permutation depends on the number of samples, not their values:
                # positions are dealt as the indices at them)
                dealt[k] = self._deal(picked[node == k], rng)
        if self.rank in ranks and not positions:
            here = node == self.node_rank
            logger.debug("epoch %d, rank %d: %d indices, %.1f%% cached on node %d, built in "
                         "%.3f s", epoch, self.rank, self.num_samples, 100 * hit[here].mean(),
                         self.node_rank, time.perf_counter() - t0)
        return [dealt[r // self.local_world_size][r % self.local_world_size] for r in ranks]

    def _epoch_positions(self, epoch: int) -> np.ndarray:
        """The positions of ``epoch``'s order in the global sequence its ranks split: the
        order padded (from its start) or truncated to ``total_size``, as DistributedSampler
        pads it. After a resume on another world (``load_state_dict``), the positions of the
        order that no rank consumed, each once, padded from their own start or truncated to
        a multiple of this world's ``num_replicas``."""
        rest = self._epoch_rest
        if rest is None or rest.epoch != epoch:  # repeats from the start, or truncates
            return np.resize(np.arange(self.dataset_len, dtype=np.int64), self.total_size)
        return rest.positions(self.dataset_len, self.num_replicas, self.drop_last)

    def _deal(self, mine: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A node's samples, in node blocks of batch_size * local_world_size (the last one
        shorter): each block shuffled and dealt in slices of its length / local_world_size.
        Row lr of the result is local rank lr's indices."""
        block = self.batch_size * self.local_world_size
        full = mine.size // block * block
        return np.concatenate([
            rng.permuted(b, axis=1).reshape(len(b), self.local_world_size, -1).transpose(1, 0, 2)
            .reshape(self.local_world_size, -1)
            for b in (mine[:full].reshape(-1, block), mine[full:].reshape(1, -1)) if b.size],
            axis=1)

    def for_accelerate(self) -> "torch.utils.data.Sampler[int]":
        """The sampler to give the ``DataLoader`` that ``accelerate``'s ``prepare`` will shard.

        ``prepare`` (with its default ``split_batches=False``) deals the loader's batches to
        the processes in turn: batch b goes to process ``b % num_processes``. The returned
        sampler yields every rank's indices of the epoch, batch by batch in that turn (rank
        0's first batch, rank 1's first, ..., rank 0's second, ...), the same on every rank,
        so that the batches ``prepare`` gives rank r are exactly this sampler's batches for
        rank r: the epoch, the routing to nodes and the padding are this sampler's, and
        ``len(loader)`` after ``prepare`` is ``ceil(len(self) / batch_size)``. Give the loader
        the same ``batch_size``. With ``len(self)`` a multiple of ``batch_size`` every index
        of the epoch comes exactly once (with the padding, as ``DistributedSampler``'s);
        otherwise the last, short batches are cut and padded by accelerate's rules
        (``even_batches``). ``set_epoch`` is forwarded to this sampler (the prepared loader
        calls it every epoch), and under a prepared loader the epoch is the loader's own also
        where that call does not reach (a resumed epoch inside ``skip_first_batches``, as
        Hugging Face's ``Trainer`` resumes): the Trainer's ``resume_from_checkpoint``
        continues an epoch exactly; this sampler's own ``state_dict`` is not used this way.

        Iterated outside a prepared loader with several ranks, every rank would read every
        rank's batches: that gives a warning, once.
        """
        return _AccelerateOrder(self)

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch, with everything that fixes the order: the
        global order's fields, this rank's place, and the cache layout the epoch was routed
        over (``num_nodes``, ``slots``, ``layout_seed``, ``random_subset``).

        Args:
            consumed: indices of this epoch this rank has used. Default: the number the
                latest iterator has yielded (plus the resumed position it started from).
        """
        consumed = self._position.consumed(self.epoch) if consumed is None else \
            check_int("consumed", consumed, low=0, high=self.num_samples)
        layout = self.layout
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_len": self.dataset_len, "num_replicas": self.num_replicas,
                "batch_size": self.batch_size, "rank": self.rank,
                "local_world_size": self.local_world_size,
                "num_nodes": layout.num_nodes if layout is not None else 1,
                "slots": layout.slots if layout is not None else 0,
                "layout_seed": layout.seed if layout is not None else 0,
                "random_subset": layout.random_subset if layout is not None else False,
                "order": self._order_state(), **self._sequence_state()}

    def _sequence_state(self) -> dict[str, Any]:
        """The positions of the current epoch's order consumed before this world took it
        over (none unless it resumed a state of another world): ``epoch_done`` and
        ``epoch_taken`` (see ``EpochRest.fields``)."""
        rest = self._epoch_rest
        return (EpochRest(self.epoch, 0) if rest is None or rest.epoch != self.epoch
                else rest).fields()

    def rest_state(self, consumed: int, taken: Any = ()) -> dict[str, Any]:
        """This rank's state of the current epoch as its rest (see ``_common.rest_state``),
        for a sampler that reorders this one's indices (``ReadyFirstSampler``): the ranks
        consumed their first ``consumed`` indices, and this rank also those at the
        positions ``taken`` of its epoch (as ``epoch_indices`` lists them), out of order.
        The states of every rank, joined, resume the rest on any world.

        Args:
            consumed: indices of this epoch every rank has used, a prefix.
            taken: positions (ints, ``>= consumed``) of this rank's epoch also used.
        """
        return rest_state(self, consumed, taken, batch_size=self.batch_size,
                          length=self.dataset_len)

    def _order_state(self) -> Any:
        sd = getattr(self.order, "state_dict", None)
        return None if sd is None else sd(consumed=0)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iterator yields the rest of its epoch.

        The fields that fix the epoch's global order (seed, shuffle, drop_last, dataset_len)
        must match. The world may differ: another ``num_replicas``, ``batch_size``,
        ``local_world_size`` or cache layout (num_nodes, slots, layout_seed, random_subset),
        when ``consumed`` is at a batch boundary of the saved sampler (or the end of its
        epoch), as a checkpoint of one job resumed by a job of another size is. Then every
        index the saved epoch had not yet given to any rank comes once, split over this
        sampler's ranks (padded as DistributedSampler pads, or cut with ``drop_last``), and
        the next epochs are this world's. Mid-batch, only the same world resumes. ``rank``
        is not checked: any rank's state serves every rank. A state saved before
        ``random_subset`` (or ``epoch_done``) was recorded loads without that check.
        With an ``order``, its saved state is loaded into it (a ``WeightedMixtureSampler``
        checks its own fields, and finishes the saved epoch with the saved weights).

        Args:
            state: a dict from ``state_dict()``, of this sampler or of the same sampler in
                another world.
        """
        own = self.state_dict()
        # (states saved before order=, random_subset or epoch_done existed lack them)
        check_state_fields(state, "CacheAwareSampler",
                           set(own) - {"order", "random_subset", "epoch_done", "epoch_taken"})
        refuse_changed_fields(state, own, ("seed", "shuffle", "drop_last", "dataset_len"),
                              consequence="; the rest of the epoch would differ")
        saved = SavedEpoch.of(state, self.drop_last, self.dataset_len)
        consumed = check_int("state['consumed']", state["consumed"], low=0,
                              high=saved.per_rank)
        if not saved.at_boundary(consumed):
            refuse_changed_fields(
                state, own, ("num_replicas", "batch_size", "local_world_size", "num_nodes",
                             "slots", "layout_seed", "random_subset"),
                consequence="; the rest of the epoch would differ (another world resumes "
                            "a state saved at a batch boundary only)")
        epoch = check_int("state['epoch']", state["epoch"], low=0)
        saved_order = state.get("order")
        if (saved_order is None) != (own["order"] is None):
            expect = "None" if own["order"] is None else \
                f"a state of this sampler's order ({type(self.order).__name__})"
            raise ValueError(f"state['order'] should be {expect}, but got state['order'] of "
                             f"type {type(saved_order).__name__}")
        if saved_order is not None:
            self.order.load_state_dict(saved_order)  # may refuse; nothing changed yet
        self.epoch = epoch
        if saved.num_replicas == self.num_replicas and saved.batch_size == self.batch_size:
            # The same global batches: each rank goes on at the saved position.
            self._epoch_rest = saved.rest_before(epoch)
            self._position.load(consumed)
        else:  # another world: the positions no rank consumed, dealt anew
            self._epoch_rest = saved.rest_after(epoch, consumed)
            self._position.load(0)


def ideal_hit_rate(num_nodes: int, fraction: float, node_batch: int) -> float:
    """The best hit rate a node can reach, on average, when each batch of the epoch is drawn
    at random and dealt to ``num_nodes`` nodes that each cache ``fraction`` of the dataset at
    random and take ``node_batch`` samples of it: E[min(B, X)] / B for X ~ Binomial(num_nodes
    * B, fraction), B = ``node_batch``, from the binomial pmf (in log space: the binomial
    coefficients overflow floats). ``CacheAwareSampler`` is measured against it
    (docs/sampler.md)."""
    m = num_nodes * node_batch
    if fraction <= 0.0 or fraction >= 1.0:
        return min(max(fraction, 0.0), 1.0)
    log_f, log_1f, log_m = math.log(fraction), math.log1p(-fraction), math.lgamma(m + 1)
    return sum(min(node_batch, x) * math.exp(log_m - math.lgamma(x + 1) - math.lgamma(m - x + 1)
                                             + x * log_f + (m - x) * log_1f)
               for x in range(m + 1)) / node_batch


class _AccelerateOrder(torch.utils.data.Sampler[int]):
    """``CacheAwareSampler.for_accelerate()``: every rank's batches, dealt in turn."""

    def __init__(self, sampler: CacheAwareSampler) -> None:
        self.sampler = sampler
        self._warned = False

    def __len__(self) -> int:
        return self.sampler.num_samples * self.sampler.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        s = self.sampler
        # The prepared loader passes its epoch to set_epoch at every iter(), but not through
        # the SkipBatchSampler of a resumed epoch (Hugging Face's Trainer): read it here, or
        # the resumed epoch would be drawn in the order of the epoch the sampler was left at.
        epoch = accelerate_epoch(self)
        if epoch is not None and epoch != s.epoch:
            s.set_epoch(epoch)
        if s.num_replicas > 1 and not self._warned:
            shard = dealt_by_accelerate(self)
            if shard is None or shard.num_processes != s.num_replicas:
                self._warned = True
                warnings.warn(
                    f"sampler.for_accelerate() yields the batches of all {s.num_replicas} ranks "
                    "for accelerate's prepare() to deal out, but this loader was not prepared "
                    f"for {s.num_replicas} processes: every rank reads every rank's batches. "
                    "Pass the loader to accelerator.prepare() (on a machine without GPUs: "
                    "Accelerator(cpu=True)), or give it the CacheAwareSampler itself",
                    stacklevel=2)
            elif shard.split_batches:
                self._warned = True
                warnings.warn(
                    "sampler.for_accelerate() yields whole batches for each rank in turn, but "
                    "accelerate's prepare() was given split_batches=True and cuts every batch "
                    "over the ranks: each rank reads slices of the others' batches. Leave "
                    "split_batches at its default, False", stacklevel=2)
        per_rank = np.stack(s._ranks_indices(s.epoch, range(s.num_replicas)))
        b = s.batch_size
        full = per_rank.shape[1] // b * b  # (after a resume on another world: the rest)
        turns = per_rank[:, :full].reshape(s.num_replicas, -1, b).transpose(1, 0, 2).ravel()
        return iter(np.concatenate([turns, per_rank[:, full:].ravel()]).tolist())


def _owners(cache: Any) -> Any:
    """What says which indices each node of ``cache`` reads without a load: the cache
    (``owner_rows()``, a disk tier's rows included), or its layout where it has no such
    method (an object that only carries ``layout`` and ``world``)."""
    return cache if callable(getattr(cache, "owner_rows", None)) else cache.layout


class _JoinedLayout:
    """The node layouts of several caches side by side: one layout over the concatenation of
    their datasets (a ``MixtureDataset``'s ``caches``; a sub-dataset without a cache is cached
    on no node). ``slots``, ``seed`` and ``random_subset`` are lists, one entry per cache (0 or
    False without one)."""

    def __init__(self, caches: Any, lengths: Any) -> None:
        layouts = []
        for k, c in enumerate(caches):
            layout = getattr(c, "layout", None)
            if c is not None and not isinstance(layout, CacheLayout):
                raise TypeError(f"dataset.caches[{k}] should be a SharedCache, an OpenSizeCache "
                                f"or None, but got {type(c).__name__}")
            layouts.append(layout)
        if lengths is None:
            lengths = [None if x is None else x.dataset_len for x in layouts]
        if len(lengths) != len(layouts) or any(n is None for n in lengths):
            raise ValueError("dataset.lengths should give the length of every sub-dataset (a "
                             f"MixtureDataset's does), but got lengths={lengths!r}")
        for k, (x, n) in enumerate(zip(layouts, lengths)):
            if x is not None and x.dataset_len != n:
                raise ValueError(f"dataset.caches[{k}].dataset_len should be the sub-dataset's "
                                 f"length {n}, but got {x.dataset_len}")
        nodes = sorted({x.num_nodes for x in layouts if x is not None})
        if len(nodes) != 1:
            raise ValueError(f"dataset.caches should all have the same num_nodes, but got "
                             f"num_nodes {nodes}")
        self.layouts, self.lengths = layouts, [int(n) for n in lengths]
        self._caches = list(caches)  # (their owner_rows count a disk tier's rows too)
        self.num_nodes = nodes[0]
        self.dataset_len = sum(self.lengths)
        self.slots = [0 if x is None else x.slots for x in layouts]
        self.seed = [0 if x is None else x.seed for x in layouts]
        self.random_subset = [False if x is None else x.random_subset for x in layouts]

    def owner_rows(self) -> Iterator[np.ndarray]:
        rows = [None if c is None else _owners(c).owner_rows() for c in self._caches]
        for _ in range(self.num_nodes):
            yield np.concatenate([np.zeros(n, dtype=bool) if r is None else next(r)
                                  for r, n in zip(rows, self.lengths)])


# ----------------------------------------------------------------------------------------------
# The router: which node reads each sample of a global batch
# ----------------------------------------------------------------------------------------------


def _group_by_owner_set(owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group dataset indices by the set of nodes caching them (their "kind").

    Args:
        owners: bool matrix ``(num_nodes, dataset_len)``, as from ``CacheLayout.owners()``,
            or its rows one by one.

    Returns:
        ``kind`` (``dataset_len`` ints: int32, or int64 from 2**30 indices) and ``masks``
        (bool, ``(num_kinds, num_nodes)``): ``owners[:, i] == masks[kind[i]]``. A
        ``CacheLayout`` has at most ``2 * num_nodes + 1`` kinds.
    """
    kind: np.ndarray | None = None
    masks = np.zeros((1, 0), dtype=bool)
    for row in owners:  # split every kind by one more node, then renumber the kinds seen
        row = np.asarray(row, dtype=bool)
        if kind is None:
            # kinds < 2 * dataset_len, so twice a kind fits int32 below 2**30 indices
            kind = row.astype(np.int32 if len(row) < 2**30 else np.int64)
        else:
            if row.shape != kind.shape:
                raise ValueError(f"owners should have rows of dataset_len={len(kind)} entries, "
                                 f"but got a row of shape {row.shape}")
            kind *= 2
            kind += row
        seen = np.bincount(kind, minlength=2 * len(masks)) > 0
        np.take((np.cumsum(seen) - 1).astype(kind.dtype), kind, out=kind)
        old = np.flatnonzero(seen)
        masks = np.c_[masks[old // 2], old % 2 == 1]
    if kind is None:
        raise ValueError("owners should have at least one row (node), but got none")
    return kind, masks


def _even_split(amount: np.ndarray, room: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Split ``amount[j]`` (at most ``room[j].sum()``) over the columns of ``room[j]`` as evenly
    as the rooms allow (water filling); the odd units go to columns at random."""
    d = room.shape[1]
    rs = np.sort(room, axis=1)
    below = np.cumsum(rs, axis=1) - rs
    full = (below + (d - np.arange(d)) * rs <= amount[:, None]).sum(axis=1)  # columns filled
    filled = np.c_[below, below[:, -1] + rs[:, -1]][np.arange(len(room)), full]
    level = np.where(full < d, (amount - filled) // np.maximum(d - full, 1), rs[:, -1])
    x = np.minimum(room, level[:, None])
    key = np.where(room > x, rng.random(room.shape), 2.0)
    return x + (key.argsort(axis=1).argsort(axis=1) < (amount - x.sum(axis=1))[:, None])


def _max_flow(count: np.ndarray, masks: np.ndarray, cap: np.ndarray,
              rng: np.random.Generator) -> np.ndarray:
    """Place as many samples of each batch as possible on a node that caches them.

    A maximum flow per batch, all batches at once: a greedy start (least flexible kinds first,
    each split evenly over its nodes), then one shortest augmenting path per batch and round,
    ending on the reachable node with the most room, until none is left. The even split and
    that choice of ends spread the misses evenly over the nodes.

    Args:
        count: ``(num_batches, num_kinds)``, samples of each kind in each batch.
        masks: ``(num_kinds, num_nodes)``, the nodes caching each kind.
        cap: ``(num_batches,)``, samples each node takes from each batch.
        rng: breaks ties.

    Returns:
        ``flow`` ``(num_batches, num_kinds, num_nodes)``: samples of kind t of batch j that
        go to node k, only where ``masks[t, k]``.
    """
    n = masks.shape[1]
    flow = np.zeros(count.shape + (n,), dtype=np.int64)
    left = np.where(masks.any(axis=1), count, 0)  # cached somewhere, not placed yet
    room = np.repeat(cap[:, None], n, axis=1)
    degree = masks.sum(axis=1)
    for t in np.argsort(degree, kind="stable")[np.count_nonzero(degree == 0):]:
        own = np.flatnonzero(masks[t])
        x = _even_split(np.minimum(left[:, t], room[:, own].sum(axis=1)), room[:, own], rng)
        flow[:, t, own] = x
        left[:, t] -= x.sum(axis=1)
        room[:, own] -= x
    todo = np.arange(len(count))
    while True:
        todo = todo[(left[todo] > 0).any(axis=1) & (room[todo] > 0).any(axis=1)]
        if not todo.size:
            return flow
        f, lf, r = flow[todo], left[todo], room[todo]
        done = _push_augmenting_paths(f, lf, r, masks, rng)
        todo = todo[done]
        flow[todo], left[todo], room[todo] = f[done], lf[done], r[done]


def _push_augmenting_paths(flow: np.ndarray, left: np.ndarray, room: np.ndarray, masks: np.ndarray,
             rng: np.random.Generator) -> np.ndarray:
    """One round of ``_max_flow``: push flow along a shortest augmenting path in every batch
    that has one (updating the arrays in place); return which batches had one."""
    fm = masks.astype(np.float32)
    # Breadth-first over nodes. The source reaches the nodes caching an unplaced sample; node a
    # reaches node b when a holds a sample b also caches (moving it there frees a slot on a).
    adj = (flow > 0).transpose(0, 2, 1).astype(np.float32) @ fm > 0
    reached = frontier = left.astype(np.float32) @ fm > 0
    parent = np.full(room.shape, -1)  # -1: reached from the source
    sink = np.full(len(room), -1)
    while frontier.any():
        at = frontier & (room > 0) & (sink < 0)[:, None]
        found = at.any(axis=1)
        sink[found] = np.where(at, room + rng.random(room.shape), -1)[found].argmax(axis=1)
        step = frontier[:, :, None] & adj & ~reached[:, None, :] & (sink < 0)[:, None, None]
        frontier = step.any(axis=1)
        parent = np.where(frontier, step.argmax(axis=1), parent)
        reached = reached | frontier
    # Walk each path back from its sink, then push its bottleneck along it.
    j = np.flatnonzero(sink >= 0)
    b, delta = sink[j], room[j, sink[j]]
    path, live = [], np.arange(len(j))
    while live.size:
        jj, bb = j[live], b[live]
        a = parent[jj, bb]
        src = a < 0
        held = np.where(src[:, None], left[jj], flow[jj, :, a])
        t = ((held > 0) & masks[:, bb].T).argmax(axis=1)
        delta[live] = np.minimum(delta[live], held[np.arange(len(live)), t])
        path.append((live, t, a, bb))
        b[live] = a
        live = live[~src]
    for live, t, a, bb in path:
        jj, d, src = j[live], delta[live], a < 0
        flow[jj, t, bb] += d
        flow[jj[~src], t[~src], a[~src]] -= d[~src]
        left[jj[src], t[src]] -= d[src]
    room[j, sink[j]] -= delta
    return sink >= 0


class _BatchRouter:
    """Who caches what, and the split of each global batch over the nodes."""

    def __init__(self, owners: Any) -> None:
        self.kind, self.masks = _group_by_owner_set(owners)

    def assign(self, order: np.ndarray, group: int, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray]:
        """Node of each position of ``order``, and whether that node caches it.

        ``order`` is cut into global batches of ``group`` positions (the last may be shorter;
        both are multiples of the number of nodes). Each node gets ``1 / num_nodes`` of every
        batch, as many cached samples as possible (a maximum flow): within a batch, the
        samples of one kind go to their nodes in order, the unplaced ones fill the rest.
        """
        n, nk = self.masks.shape[1], len(self.masks)
        batch = np.arange(order.size) // group
        nb = int(batch[-1]) + 1
        cap = np.full(nb, group // n)
        cap[-1] = (order.size - (nb - 1) * group) // n
        key = batch * nk + self.kind[order]
        count = np.bincount(key, minlength=nb * nk).reshape(nb, nk)
        flow = _max_flow(count, self.masks, cap, rng)
        split = np.c_[flow.reshape(-1, n), count.ravel() - flow.sum(axis=2).ravel()]
        node = np.empty(order.size, dtype=np.int64)
        node[np.argsort(key, kind="stable")] = np.repeat(
            np.tile(np.r_[np.arange(n), -1], nb * nk), split.ravel())
        hit = node >= 0
        room = cap[:, None] - flow.sum(axis=1)
        node[~hit] = np.repeat(np.tile(np.arange(n), nb), room.ravel())
        return node, hit

