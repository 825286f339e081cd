"""CacheAwareSampler: a DistributedSampler whose ranks get the samples their node caches.

Kept in its own file while the core is being written; it is pasted into ``stocaching.py``
(after ``SharedCache``) without the import block below, which holds only names the core
already defines or imports.
"""

# --- imports (dropped when merged) ---
from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from .stocaching import CacheLayout, World, _check_int

logger = logging.getLogger("stocaching")
# --- end of imports ---

# ----------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------


def _owner_kinds(owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group dataset indices by the set of nodes caching them (their "kind").

    Args:
        owners: bool matrix ``(num_nodes, dataset_len)``, as from ``CacheLayout.owners()``.

    Returns:
        ``kind`` (int64, ``dataset_len``) and ``masks`` (bool, ``(num_kinds, num_nodes)``):
        ``owners[:, i] == masks[kind[i]]``. A ``CacheLayout`` has at most ``2 * num_nodes + 1``
        kinds.
    """
    owners = np.asarray(owners, dtype=bool)
    kind = np.zeros(owners.shape[1], dtype=np.int64)
    masks = np.zeros((1, 0), dtype=bool)
    for row in owners:  # split every kind by one more node, then renumber the kinds seen
        code = kind * 2 + row
        seen = np.bincount(code, minlength=2 * len(masks)) > 0
        kind = (np.cumsum(seen) - 1)[code]
        old = np.flatnonzero(seen)
        masks = np.c_[masks[old // 2], old % 2 == 1]
    return kind, masks


def _max_flow(count: np.ndarray, masks: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Place as many samples of each batch as possible on a node that caches them.

    A maximum flow per batch, all batches at once: a greedy start (least flexible kinds first),
    then one shortest augmenting path per batch and round until none is left.

    Args:
        count: ``(num_batches, num_kinds)``, samples of each kind in each batch.
        masks: ``(num_kinds, num_nodes)``, the nodes caching each kind.
        cap: ``(num_batches,)``, samples each node takes from each batch.

    Returns:
        ``flow`` ``(num_batches, num_kinds, num_nodes)``: samples of kind t of batch j that
        go to node k, only where ``masks[t, k]``.
    """
    n = masks.shape[1]
    flow = np.zeros(count.shape + (n,), dtype=np.int64)
    left = np.where(masks.any(axis=1), count, 0)  # cached somewhere, not placed yet
    room = np.repeat(cap[:, None], n, axis=1)
    for t in np.argsort(masks.sum(axis=1), kind="stable"):
        for k in np.flatnonzero(masks[t]):
            x = np.minimum(left[:, t], room[:, k])
            flow[:, t, k] += x
            left[:, t] -= x
            room[:, k] -= x
    todo = np.arange(len(count))
    while True:
        todo = todo[(left[todo] > 0).any(axis=1) & (room[todo] > 0).any(axis=1)]
        if not todo.size:
            return flow
        f, lf, r = flow[todo], left[todo], room[todo]
        # Breadth-first over nodes. The source reaches the nodes caching an unplaced sample;
        # node a reaches node b when a holds a sample b also caches (moving it frees a slot).
        fm = masks.astype(np.float32)
        adj = (f > 0).transpose(0, 2, 1).astype(np.float32) @ fm > 0
        reached = frontier = lf.astype(np.float32) @ fm > 0
        parent = np.full(r.shape, -1)  # -1: reached from the source
        sink = np.full(len(todo), -1)
        while frontier.any():
            at = frontier & (r > 0) & (sink < 0)[:, None]
            found = at.any(axis=1)
            sink[found] = at[found].argmax(axis=1)
            step = frontier[:, :, None] & adj & ~reached[:, None, :] & (sink < 0)[:, None, None]
            frontier = step.any(axis=1)
            parent = np.where(frontier, step.argmax(axis=1), parent)
            reached = reached | frontier
        # Walk each path back from its sink, then push its bottleneck along it.
        todo, j = todo[sink >= 0], np.flatnonzero(sink >= 0)
        b, delta = sink[j], r[j, sink[j]]
        path, live = [], np.arange(len(j))
        while live.size:
            jj, bb = j[live], b[live]
            a = parent[jj, bb]
            src = a < 0
            held = np.where(src[:, None], lf[jj], f[jj, :, a])
            t = ((held > 0) & masks[:, bb].T).argmax(axis=1)
            delta[live] = np.minimum(delta[live], held[np.arange(len(live)), t])
            path.append((live, t, a, bb))
            b[live] = a
            live = live[~src]
        for live, t, a, bb in path:
            jj, d, src = j[live], delta[live], a < 0
            f[jj, t, bb] += d
            f[jj[~src], t[~src], a[~src]] -= d[~src]
            lf[jj[src], t[src]] -= d[src]
        r[j, sink[j]] -= delta
        flow[todo], left[todo], room[todo] = f[j], lf[j], r[j]


class _Owners:
    """Who caches what, and the split of each global batch over the nodes."""

    def __init__(self, owners: np.ndarray) -> None:
        self.kind, self.masks = _owner_kinds(owners)

    def assign(self, order: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
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
        flow = _max_flow(count, self.masks, cap)
        split = np.c_[flow.reshape(-1, n), count.ravel() - flow.sum(axis=2).ravel()]
        node = np.empty(order.size, dtype=np.int64)
        node[np.argsort(key, kind="stable")] = np.repeat(
            np.tile(np.r_[np.arange(n), -1], nb * nk), split.ravel())
        hit = node >= 0
        room = cap[:, None] - flow.sum(axis=1)
        node[~hit] = np.repeat(np.tile(np.arange(n), nb), room.ravel())
        return node, hit


class CacheAwareSampler(torch.utils.data.Sampler[int]):
    """Drop-in for ``DistributedSampler`` that sends each rank the samples cached on its node.

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
    numbering), so ``num_replicas`` must be ``layout.num_nodes * local_world_size``.

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
        cache_or_dataset_or_layout: a ``SharedCache``, a ``Dataset`` with a ``.cache``
            attribute holding one, or a bare ``CacheLayout`` (for simulations). Only its
            ``layout`` (``dataset_len``, ``num_nodes``, ``owners()``) and ``world`` are used.
        batch_size: indices per batch on each rank (the ``DataLoader``'s ``batch_size``).
        num_replicas: number of ranks. Default: ``torch.distributed``'s world size if it is
            initialised, else the cache's ``world`` (for a ``CacheLayout``: ``World.from_env()``,
            that is ``torchrun``'s or SLURM's variables, else 1).
        rank: this rank, in ``[0, num_replicas)``. Default: from the same source as
            ``num_replicas``, else 0.
        shuffle: shuffle the global order; if False it is index order (the deal of a node's
            samples to its local ranks is still seeded). Default: True.
        seed: seed of the order, in ``[0, 2**63)``; identical on every rank. Default: 0.
        drop_last: truncate instead of pad, as in ``DistributedSampler``. Default: False.
        local_world_size: ranks per node. Default: the cache's ``world.local_world_size``, for a
            ``CacheLayout`` ``World.from_env().local_world_size``.
    """

    def __init__(self, cache_or_dataset_or_layout: Any, batch_size: int,
                 num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, *,
                 local_world_size: int | None = None) -> None:
        self.layout, world = self._resolve(cache_or_dataset_or_layout)
        if None in (num_replicas, rank, local_world_size):
            here = world if world is not None else World.from_env()
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                ws, r = dist.get_world_size(), dist.get_rank()
            else:
                ws, r = here.world_size, here.rank
            num_replicas = ws if num_replicas is None else num_replicas
            rank = r if rank is None else rank
            local_world_size = here.local_world_size if local_world_size is None \
                else local_world_size
        self.batch_size = _check_int("batch_size", batch_size, low=1)
        self.num_replicas = _check_int("num_replicas", num_replicas, low=1)
        self.rank = _check_int("rank", rank, low=0, high=self.num_replicas - 1)
        self.seed = _check_int("seed", seed, low=0, high=2**63 - 1)
        self.local_world_size = _check_int("local_world_size", local_world_size, low=1)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)

        num_nodes, length = self.layout.num_nodes, self.layout.dataset_len
        if self.num_replicas != num_nodes * self.local_world_size:
            raise ValueError(
                f"num_replicas should be num_nodes * local_world_size = {num_nodes} * "
                f"{self.local_world_size} = {num_nodes * self.local_world_size} (the cache layout "
                f"has num_nodes={num_nodes}), but got num_replicas={self.num_replicas}; pass "
                f"local_world_size=num_replicas // num_nodes if the ranks per node are wrong")
        self.node_rank = self.rank // self.local_world_size
        if world is not None and world.node_rank != self.node_rank:
            warnings.warn(f"rank={self.rank} is on node {self.node_rank} (rank // "
                          f"local_world_size), but its cache was built on node "
                          f"{world.node_rank}: it would be sent samples cached elsewhere",
                          stacklevel=2)
        self.num_samples = length // self.num_replicas if self.drop_last \
            else math.ceil(length / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.epoch = 0
        self._owners = _Owners(self.layout.owners())
        self._resume = 0  # indices of self.epoch to skip at the next __iter__
        self._it: Iterator[int] | None = None  # the latest iterator, and what it covers:
        self._it_epoch = self._it_start = self._it_len = 0

    @staticmethod
    def _resolve(source: Any) -> tuple[CacheLayout, World | None]:
        if hasattr(source, "owners"):
            return source, None
        cache = source if hasattr(source, "layout") else getattr(source, "cache", None)
        if not hasattr(cache, "layout"):
            raise TypeError(f"cache_or_dataset_or_layout should be a SharedCache, a CacheLayout "
                            f"or a Dataset with a .cache attribute, but got "
                            f"{type(source).__name__}")
        layout = cache.layout
        if cache is not source and hasattr(source, "__len__") and \
                len(source) != layout.dataset_len:
            raise ValueError(f"len(cache_or_dataset_or_layout) should be its cache's "
                             f"dataset_len={layout.dataset_len}, but got "
                             f"len(cache_or_dataset_or_layout)={len(source)}")
        return layout, getattr(cache, "world", None)

    def __len__(self) -> int:
        """Indices per rank per epoch (the whole epoch, also right after a resume)."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; call it on every rank before each epoch.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = _check_int("epoch", epoch, low=0)
        if epoch != self.epoch:
            if 0 < self._resume < self.num_samples:
                warnings.warn(f"set_epoch({epoch}) discards the resume position loaded for epoch "
                              f"{self.epoch} ({self._resume} of {self.num_samples} indices "
                              f"consumed)", stacklevel=2)
            self._resume = 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle and self._it is not None and self._it_epoch == self.epoch:
            warnings.warn(f"epoch {self.epoch} is iterated again, in the same order; call "
                          f"sampler.set_epoch(epoch) before each epoch", stacklevel=2)
        start, self._resume = self._resume, 0
        indices = self.epoch_indices(self.epoch)[start:].tolist()
        self._it = iter(indices)
        self._it_epoch, self._it_start, self._it_len = self.epoch, start, len(indices)
        return self._it

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's indices for ``epoch`` (int64, ``len(self)`` of them), without changing
        the sampler's state.

        Args:
            epoch: the epoch number, an int >= 0.
        """
        epoch = _check_int("epoch", epoch, low=0)
        if self.total_size == 0:
            return np.zeros(0, dtype=np.int64)
        t0 = time.perf_counter()
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.layout.dataset_len, generator=g).numpy()
        else:
            order = np.arange(self.layout.dataset_len, dtype=np.int64)
        order = np.resize(order, self.total_size)  # repeats from the start, or truncates

        node, hit = self._owners.assign(order, self.batch_size * self.num_replicas)
        here = node == self.node_rank
        mine = order[here]
        # Node blocks are batch_size * local_world_size long (the last one shorter): shuffle
        # each and deal it out in slices of its length / local_world_size.
        block = self.batch_size * self.local_world_size
        full = mine.size // block * block
        lr = self.rank % self.local_world_size
        rng = np.random.default_rng([self.seed, epoch])
        out = np.concatenate([
            rng.permuted(b, axis=1).reshape(len(b), self.local_world_size, -1)[:, lr].ravel()
            for b in (mine[:full].reshape(-1, block), mine[full:].reshape(1, -1)) if b.size])
        logger.debug("epoch %d, rank %d: %d indices, %.1f%% cached on node %d, built in %.3f s",
                     epoch, self.rank, out.size, 100 * hit[here].mean(), self.node_rank,
                     time.perf_counter() - t0)
        return out

    def _consumed(self) -> int:
        if self._it is None or self._it_epoch != self.epoch:
            return self._resume
        # A list iterator's length hint is exactly the number of items it has left.
        return self._it_start + self._it_len - self._it.__length_hint__()  # type: ignore

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch, with everything that fixes the order.

        Args:
            consumed: indices of this epoch this rank has used. Default: the number the
                latest iterator has yielded (plus the resumed position it started from).
        """
        consumed = self._consumed() if consumed is None else \
            _check_int("consumed", consumed, low=0, high=self.num_samples)
        layout = self.layout
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_len": layout.dataset_len, "num_replicas": self.num_replicas,
                "batch_size": self.batch_size, "rank": self.rank,
                "local_world_size": self.local_world_size, "num_nodes": layout.num_nodes,
                "slots": getattr(layout, "slots", None),
                "layout_seed": getattr(layout, "seed", None)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iterator yields the rest of its epoch.

        The fields that fix the global batches (seed, shuffle, drop_last, dataset_len,
        num_replicas, batch_size) must match. The node layout (local_world_size, num_nodes,
        slots, layout_seed) may differ when ``consumed`` is at a batch boundary: then only the
        split of the remaining global batches over ranks changes. ``rank`` is not checked.

        Args:
            state: a dict from ``state_dict()``.
        """
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state)) if isinstance(state, Mapping) else ["all"]
        if missing:
            raise ValueError(f"state should be a dict from CacheAwareSampler.state_dict(), but "
                             f"it lacks {missing}")
        consumed = _check_int("state['consumed']", state["consumed"], low=0,
                              high=self.num_samples)
        at_boundary = consumed % self.batch_size == 0 or consumed == self.num_samples
        layout_fields = () if at_boundary else ("local_world_size", "num_nodes", "slots",
                                                "layout_seed")
        for field in ("seed", "shuffle", "drop_last", "dataset_len", "num_replicas",
                      "batch_size", *layout_fields):
            if state[field] != mine[field]:
                raise ValueError(f"state['{field}'] should be this sampler's {field}="
                                 f"{mine[field]!r}, but got state['{field}']={state[field]!r}; "
                                 f"the rest of the epoch would differ")
        self.epoch = _check_int("state['epoch']", state["epoch"], low=0)
        self._resume, self._it = consumed, None
