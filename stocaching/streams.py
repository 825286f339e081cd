"""Sharded streams as sources of the cache: ``CachedStream``.

Formats read as streams (WebDataset tar shards, Hugging Face ``load_dataset(...,
streaming=True)``, any list of files read in order) have no index to key a cache by. This
module gives each sample one: its position in the unshuffled order of the shards (shard k's
j-th sample is ``offset[k] + j``). The first epoch streams every shard, decodes each sample and
stores it; from the second on, a shard whose samples are all cached is not opened at all
(served from the cache), and a shard with some cached samples is read, but only its uncached
samples are decoded::

    import webdataset as wds
    from stocaching import CachedStream

    urls = [f"shards/train-{k:04d}.tar" for k in range(64)]

    def open_shard(url):        # the raw samples of one shard, in its order
        return wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None)

    def decode(raw):            # deterministic: before the cache
        return {"image": decode_jpeg_and_resize(raw["jpg"]), "label": int(raw["cls"])}

    ds = CachedStream(urls, open_shard, decode=decode, transform=augment,
                      shard_lengths=[1000] * 64)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=8)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in loader: ...

Each epoch, the shards are dealt out in an order drawn from ``(seed, epoch)`` to the ranks,
round-robin, and each rank's to its DataLoader workers, so every sample is read once an epoch;
each worker streams its shards through a shuffle buffer of ``shuffle_buffer`` samples. With
``even`` (the default) every worker of every rank yields as many samples as the fullest one
(repeating its first), so that the ranks of a DDP job take the same number of steps. The order
depends on ``(seed, epoch)`` and the world only, never on what is cached, so ``state_dict``
(the epoch and the count of samples yielded, per worker, as torchdata's ``StatefulDataLoader``
keeps them) resumes an epoch exactly on the same world: the samples already yielded are
skipped without being decoded. On another world, ``job_state`` of every rank's states resumes
the rest of the epoch, each sample once, in the new world's order.

On one node the cache holds the first ``len(cache)`` indices: whole shards, in the shards' own
order, which is what lets later epochs skip them (with ``random_subset=True`` most shards would
hold some uncached sample and still be read). Over several nodes, each shard is read by one
node in every epoch (``ShardLayout``: a rendezvous deal bounded to balance the nodes, fixed by
the seed), the epoch's order deals each node's shards over its own ranks, and each node's cache
holds the samples of its own shards, whole shards first: what a node caches is what it reads.

An opt-in part of stocaching: it imports only public names of the core module
(``stocaching.py``) and the rules for values it shares with ``wrapper.py`` in ``_common.py``
(internal), so copying the three files side by side into a project also works. See docs/sources.md.
"""

from __future__ import annotations

__all__ = ["CachedStream", "ShardLayout"]

import dataclasses
import functools
import hashlib
import itertools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

try:  # inside the package
    from ._common import (_PART, _as_fields, _as_tensors, _check_options, _dims_and_dtypes,
                          _same, _unfit_value)
    from .stocaching import BaseCache, CacheLayout, SharedCache, World, check_int
except ImportError:  # copied beside stocaching.py and _common.py
    from _common import (_PART, _as_fields, _as_tensors,  # type: ignore[no-redef]
                         _check_options, _dims_and_dtypes, _same, _unfit_value)
    from stocaching import (BaseCache, CacheLayout, SharedCache,  # type: ignore[no-redef]
                            World, check_int)


class CachedStream(torch.utils.data.IterableDataset):
    """The samples of a list of shards, read in order by ``open_shard``, with
    ``decode(raw)`` of each kept in a shared cache keyed by its position.

    Args:
        shards: what ``open_shard`` opens, one entry per shard (URLs, paths, shard numbers),
            in a fixed order: the order that numbers the samples.
        open_shard: ``open_shard(shard)``, an iterable of the shard's raw samples in a fixed
            order (for WebDataset: ``wds.WebDataset(url, shardshuffle=False,
            nodesplitter=None, workersplitter=None)``, so that it does not split the one
            shard among workers itself).
        cache: the cache (``dataset_len`` the number of samples; over several nodes, with
            ``layout=ShardLayout.for_shards(shard_lengths, num_nodes, seed=seed)``), or None to
            make a ``SharedCache`` from the first sample's decoded shapes and dtypes (over
            several nodes, with that layout). Default: None.
        shard_lengths: the number of samples of each shard, or None to count them by
            reading every shard once at construction (in every process that constructs it).
            Default: None.
        decode: ``decode(raw)``, deterministic: the value to cache (tensors, arrays, numbers,
            or a tuple or dict of them). Default: None, the raw sample as it is.
        transform: ``transform(value)``, the random part, after the cache. Default: None.
        size_limit_gib: without ``cache``: the new cache's budget. Default: ``"auto"``.
        shuffle_buffer: samples held to shuffle each worker's stream (1: none). Default: 1000.
        seed: the seed of the shard order and the shuffle. Default: 0.
        even: every (rank, DataLoader worker) pair yields as many samples as the fullest one,
            repeating the first of its own (as ``DistributedSampler`` pads), so that every
            rank takes the same number of steps: a DDP job whose ranks take different numbers
            of steps hangs in its last all-reduce. False: each sample exactly once, and the
            ranks differ by up to a shard where the shards do not deal evenly. Default: True.
        verify_decodes: how many more times the first sample is decoded at construction and
            compared, to catch a ``decode`` that is not deterministic (a random flip escapes
            three comparisons 1 time in 8). Default: 3 (0: none).
        **cache_options: without ``cache``: other keyword arguments of ``SharedCache``.

    Attributes:
        shards_opened: shards this process opened (its iterators and the construction's
            count), a measure of the source's reads.
    """

    shards: list
    open_shard: Callable[[Any], Iterable[Any]]
    cache: BaseCache
    decode: Callable[[Any], Any] | None
    transform: Callable[[Any], Any] | None
    shuffle_buffer: int
    seed: int
    even: bool
    shards_opened: int
    _offsets: np.ndarray  # the index of each shard's first sample; the last entry is the total
    _as_tuple: bool
    _epoch: int  # the epoch the next iterator runs
    _resume: dict | None  # a state to resume from (load_state_dict), used by the next iterator
    _position: dict  # the running iterator's epoch and yielded count, for state_dict
    # A loaded job_state and the samples its workers had yielded, replayed once when loaded
    # (in the training process, so that its DataLoader workers inherit it)
    _done: tuple[dict, np.ndarray] | None = None

    def __init__(self, shards: Sequence[Any], open_shard: Callable[[Any], Iterable[Any]],
                 cache: BaseCache | None = None, *,
                 shard_lengths: Sequence[int] | None = None,
                 decode: Callable[[Any], Any] | None = None,
                 transform: Callable[[Any], Any] | None = None,
                 size_limit_gib: float | str = "auto", shuffle_buffer: int = 1000,
                 seed: int = 0, even: bool = True, verify_decodes: int = 3,
                 **cache_options: Any) -> None:
        _check_options(cache_options, "CachedStream")
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or not shards:
            raise TypeError(f"shards should be a non-empty list of what open_shard opens (URLs, "
                            f"paths), but got shards={shards!r}")
        for name, fn in (("open_shard", open_shard), ("decode", decode),
                         ("transform", transform)):
            if fn is not None and not callable(fn) or (name == "open_shard" and fn is None):
                raise TypeError(f"{name} should be a function, but got {name}={fn!r}")
        if cache is not None and not isinstance(cache, BaseCache):
            raise TypeError(f"cache should be a SharedCache or OpenSizeCache, or None to make "
                            f"one, but got cache={type(cache).__name__}")
        if cache is not None and cache_options:
            raise TypeError(f"cache options ({', '.join(sorted(cache_options))}) are for the "
                            f"cache that CachedStream makes, but got cache= as well")
        self.shards, self.open_shard = list(shards), open_shard
        self.decode, self.transform = decode, transform
        self.shuffle_buffer = check_int("shuffle_buffer", shuffle_buffer, low=1)
        self.seed = check_int("seed", seed, low=0)
        if not isinstance(even, bool):
            raise TypeError(f"even should be True or False, but got even={even!r}")
        self.even = even
        self.shards_opened = 0
        if shard_lengths is None:
            shard_lengths = [self._count(shard) for shard in self.shards]
        elif not isinstance(shard_lengths, Sequence) or isinstance(shard_lengths, (str, bytes)):
            raise TypeError(f"shard_lengths should be a list of ints, one per shard, or None, "
                            f"but got shard_lengths={shard_lengths!r}")
        elif len(shard_lengths) != len(self.shards):
            raise ValueError(f"shard_lengths should give one length per shard ({len(shards)}), "
                             f"but got {len(shard_lengths)} lengths")
        lengths = [check_int(f"shard_lengths[{k}]", n, low=0)
                   for k, n in enumerate(shard_lengths)]
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        total = int(self._offsets[-1])
        if total < 1:
            raise ValueError("shards should hold at least one sample, but every shard is empty")
        k = _first_nonempty(lengths)
        raw = next(iter(self._open(self.shards[k])), _NOTHING)
        if raw is _NOTHING:
            raise ValueError(f"open_shard({self.shards[k]!r}) gave no sample, but shard_lengths "
                             f"says {lengths[k]}")
        first = self._decoded(raw)
        for _ in range(check_int("verify_decodes", verify_decodes, low=0)):
            if not _same(first, self._decoded(raw)):
                raise RuntimeError(
                    f"CachedStream: decode={getattr(decode, '__name__', decode)!r} gave two "
                    "different values for the first sample, so the part before the cache is not "
                    "deterministic: a random transform in decode would be frozen into the cache "
                    "(the same crop every epoch). Move the random part after the cache: pass it "
                    "as transform=")
        self._as_tuple = isinstance(first, tuple)
        made = cache is None
        if cache is None:
            world = cache_options.pop("world", None)
            world = World.discover() if world is None else world
            if isinstance(world, World) and world.num_nodes > 1:
                if cache_options.get("disk_tier") is not None:
                    raise ValueError(f"disk_tier is for one node in CachedStream: its share of "
                                     f"a node's indices is the default layout's, not the "
                                     f"node's shards; but got disk_tier="
                                     f"{cache_options['disk_tier']!r} over {world.num_nodes} "
                                     f"nodes")
                cache_options["layout"] = ShardLayout.for_shards(lengths, world.num_nodes,
                                                                 seed=self.seed)
            cache = SharedCache(size_limit_gib, total, *_dims_and_dtypes(first), world=world,
                                **cache_options)
        elif cache.dataset_len != total:
            raise ValueError(f"cache should have dataset_len={total} (the shards' samples), but "
                             f"got a cache with dataset_len={cache.dataset_len}")
        try:
            self._check_world(cache, lengths)
        except ValueError:
            if made:
                cache.close()  # (refused: nothing of it is left)
            raise
        self.cache = cache
        self._epoch, self._resume, self._position = 0, None, {"epoch": 0, "yielded": 0}

    def _check_world(self, cache: BaseCache, lengths: list[int]) -> None:
        """A cache of several nodes must have the stream's layout (each node caches the shards
        it reads), and every node as many ranks (the deal counts each node's ranks)."""
        world, layout = cache.world, cache.layout
        if layout.num_nodes == 1:
            return
        want = ShardLayout.for_shards(lengths, layout.num_nodes, seed=self.seed,
                                      slots=layout.slots)
        if layout != want:
            raise ValueError(
                f"cache should have the layout of this stream over {layout.num_nodes} nodes "
                f"(each node caches the samples of the shards it reads): pass cache=None, or "
                f"make it with layout=ShardLayout.for_shards(shard_lengths, "
                f"{layout.num_nodes}, seed={self.seed}); but got a cache of {layout!r}")
        if world.world_size != world.num_nodes * world.local_world_size:
            raise ValueError(
                f"CachedStream over several nodes should run as many ranks on every node, "
                f"but got world_size={world.world_size} over num_nodes={world.num_nodes} with "
                f"local_world_size={world.local_world_size} here")

    def __len__(self) -> int:
        """The samples this rank yields in the epoch ``set_epoch`` set, read in the training
        process (``num_workers=0``): its share of its node's shards, and with ``even`` as many
        as the fullest rank's. With DataLoader workers, ``even`` may add up to a shard per
        worker (each is padded to the fullest worker's count), which torch then reports as
        more samples than ``len``."""
        nodes, rank, ranks = self._place()
        deal = self._deal(self._epoch, nodes, ranks, 1)
        counts = [self._samples_in(row[0]) for row in deal]
        return max(counts) if self.even else counts[rank]

    def close(self) -> None:
        """Close the cache (in this process)."""
        self.cache.close()

    def __enter__(self) -> "CachedStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs (its shard order and shuffle); call it in the main
        process before each epoch, as for a ``DistributedSampler``. Persistent workers, which
        do not see it, count their epochs themselves. Another epoch than a loaded state's
        (``load_state_dict``) starts that epoch afresh."""
        self._epoch = check_int("epoch", epoch, low=0)
        if self._resume is not None and self._resume["epoch"] != self._epoch:
            self._resume = None

    # -- the epoch --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        nodes, rank, ranks = self._place()
        here = {"ranks": ranks, "workers": workers, **({"nodes": nodes} if nodes > 1 else {})}
        epoch, skip, after = self._epoch, 0, None
        if self._resume is not None:
            resume, self._resume = self._resume, None
            if "yielded_by" in resume:  # a job's state: the rest of its epoch, on this world
                epoch, after = resume["epoch"], resume
            else:
                self._check_same_world(resume, here)
                if resume.get("rank", rank) != rank:
                    raise ValueError(f"state should be this rank's ({rank}), but got the state "
                                     f"of rank {resume['rank']}: load each rank's own")
                epoch, skip, after = resume["epoch"], resume["yielded"], resume.get("after")
        self._epoch = epoch + 1  # (a persistent worker's next epoch)
        if after is None:
            keep = None
        else:
            keep = ~(self._done[1] if self._done is not None and self._done[0] == after
                     else self._consumed(after))
        tail = {} if after is None else {"after": after}
        if nodes > 1:
            tail["rank"] = rank
        self._position = {"epoch": epoch, "yielded": skip, **here, **tail}
        run = self._run(epoch, nodes, ranks, workers, rank, worker, keep, read=True,
                        depth=_depth(after))
        for n, (index, raw) in enumerate(run):
            if n < skip:
                continue  # (resumed: already yielded before the state was saved)
            value = self._value(index, raw)
            self._position = {"epoch": epoch, "yielded": n + 1, **here, **tail}
            yield value

    @staticmethod
    def _check_same_world(resume: Mapping[str, Any], here: Mapping[str, int]) -> None:
        """A worker's count resumes on the world that counted it only."""
        saved = {k: resume[k] for k in ("ranks", "workers") if k in resume}
        if not saved:
            return  # (older states lack the world)
        saved["nodes"] = resume.get("nodes", 1)
        if saved != {"nodes": 1, **here}:
            nodes = (f" on {saved['nodes']} nodes", f" on {here.get('nodes', 1)} nodes") \
                if saved["nodes"] > 1 or "nodes" in here else ("", "")
            raise ValueError(
                f"state should be one of a job with this one's {here['ranks']} ranks and "
                f"{here['workers']} DataLoader workers{nodes[1]}, but got a state of "
                f"{saved['ranks']} ranks and {saved['workers']} workers{nodes[0]}: a stream's "
                "position is a count of its worker's samples, which another world deals "
                "otherwise; resume it on the same world, or gather the states of every rank "
                "and load CachedStream.job_state(states), which resumes on any world (see "
                "docs/interruptions.md)")

    def _place(self) -> tuple[int, int, int]:
        """This process's place in the deal: (nodes, rank, ranks). With several nodes the
        ranks are numbered node by node (node_rank, then local_rank)."""
        world = self.cache.world
        if world.num_nodes == 1:
            return 1, world.rank, world.world_size
        return (world.num_nodes, world.node_rank * world.local_world_size + world.local_rank,
                world.world_size)

    def _deal(self, epoch: int, nodes: int, ranks: int, workers: int) -> list[list[np.ndarray]]:
        """The shards of each worker of each rank in ``epoch``: the epoch's order restricted to
        each node's shards (which ``ShardLayout`` fixes for every epoch), dealt round-robin to
        the node's ranks, then to their workers."""
        order = self._order(epoch)
        per = ranks // nodes
        if nodes == 1:
            node_orders = [order]
        else:
            node_of = self._layout_of(nodes).node_of_shards()
            node_orders = [order[node_of[order] == k] for k in range(nodes)]
        return [[_share(node_orders[r // per], r % per, per, w, workers)
                 for w in range(workers)] for r in range(ranks)]

    def _layout_of(self, nodes: int) -> "ShardLayout":
        layout = self.cache.layout
        if isinstance(layout, ShardLayout) and layout.num_nodes == nodes:
            return layout
        return ShardLayout.for_shards(np.diff(self._offsets).tolist(), nodes, seed=self.seed)

    def _run(self, epoch: int, nodes: int, ranks: int, workers: int, rank: int, worker: int,
             keep: np.ndarray | None, *, read: bool, depth: int) -> Iterator[tuple[int, Any]]:
        """What worker ``worker`` of rank ``rank`` yields in ``epoch`` in a world of that
        shape: its shards' samples (those of ``keep`` only, when given), padded with
        ``even``, through the shuffle buffer. ``read``: (index, raw) as ``_entries`` gives
        them, else (index, None) without opening anything (to replay a saved world)."""
        deal = self._deal(epoch, nodes, ranks, workers)
        per_shard = self._per_shard(keep)
        mine = deal[rank][worker]
        listed = self._entries if read else self._listed
        entries: Iterable[tuple[int, Any]] = listed(mine, keep)
        if self.even:  # padded with its own first samples (any shard's, if it has none)
            fullest = max(int(per_shard[d].sum()) for row in deal for d in row)
            extra = fullest - int(per_shard[mine].sum())
            if extra:
                pad, pad_keep = (mine, keep) if per_shard[mine].sum() else \
                    (self._order(epoch), None)
                entries = itertools.chain(entries, itertools.islice(
                    listed(itertools.cycle(pad), pad_keep), extra))
        rng = np.random.default_rng([self.seed, epoch, rank, worker] + [depth] * bool(depth))
        return _shuffled(entries, self.shuffle_buffer, rng)

    def _per_shard(self, keep: np.ndarray | None) -> np.ndarray:
        """The samples of each shard (of ``keep`` only, when given)."""
        if keep is None:
            return np.diff(self._offsets)
        return np.diff(np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])[self._offsets])

    def _wanted(self, k: int, keep: np.ndarray | None) -> np.ndarray:
        first, end = int(self._offsets[k]), int(self._offsets[k + 1])
        if keep is None:
            return np.arange(first, end)
        return first + np.flatnonzero(keep[first:end])

    def _listed(self, shards: Iterable[int], keep: np.ndarray | None
                ) -> Iterator[tuple[int, Any]]:
        """(index, None) of each sample of ``shards`` (of ``keep``) in order, nothing read."""
        for k in shards:
            yield from ((int(i), None) for i in self._wanted(k, keep))

    def _entries(self, shards: Iterable[int], keep: np.ndarray | None = None
                 ) -> Iterator[tuple[int, Any]]:
        """(index, raw sample or None) of each sample of ``shards`` (of ``keep`` only, when
        given) in order: a shard whose samples are all stored is not opened (None: read it
        from the cache), nor one with none to yield."""
        for k in shards:
            wanted = self._wanted(k, keep)
            if not len(wanted):
                continue
            if self.cache.stored_mask(wanted).all():
                yield from ((int(i), None) for i in wanted)
                continue
            first, end = int(self._offsets[k]), int(self._offsets[k + 1])
            count = 0
            for raw in self._open(self.shards[k]):
                if count == end - first:
                    count += 1  # (one more than its length: enough to say so)
                    break
                if keep is None or keep[first + count]:
                    yield first + count, raw
                count += 1
            if count != end - first:
                raise ValueError(f"shard {self.shards[k]!r} held {'more than ' if count > end - first else ''}"
                                 f"{min(count, end - first)} samples, but shard_lengths says "
                                 f"{end - first}: the lengths must be right for every index to "
                                 "be one sample")

    def _consumed(self, job: Mapping[str, Any]) -> np.ndarray:
        """Which samples of its epoch the workers of ``job`` (a ``job_state``) yielded: each
        one's run replayed in the world it ran in, without reading a shard."""
        after = job.get("after")
        done = np.zeros(int(self._offsets[-1]), dtype=bool) if after is None else \
            self._consumed(after)
        keep = None if after is None else ~done
        out = done.copy()
        for rank, row in enumerate(job["yielded_by"]):
            for worker, count in enumerate(row):
                run = self._run(job["epoch"], job["nodes"], job["ranks"], job["workers"], rank,
                                worker, keep, read=False, depth=_depth(after))
                replayed = 0
                for index, _ in itertools.islice(run, count):
                    out[index] = True
                    replayed += 1
                if replayed < count:
                    raise ValueError(
                        f"state['yielded_by'][{rank}][{worker}] should be at most the "
                        f"{replayed} samples that worker runs in epoch {job['epoch']}, but got "
                        f"{count}: a state of another stream (other shards, seed or even)")
        return out

    def _value(self, index: int, raw: Any) -> Any:
        """The sample of ``index``: from the cache, else decoded from ``raw`` (reading the
        shard again if the cache lost it meanwhile) and stored; then transformed."""
        value = self.cache.get_slot(index)
        if value is None:
            if raw is None:  # cleared since the shard was skipped: read that one sample
                k = int(np.searchsorted(self._offsets, index, side="right")) - 1
                raw = next(itertools.islice(self._open(self.shards[k]),
                                            index - int(self._offsets[k]), None))
            value = self._decoded(raw)
            if self._as_tuple:
                value = _as_fields(value)
            try:
                self.cache.set_slot(index, value)
            except (ValueError, TypeError) as e:  # not what the cache was made for
                raise _unfit_value(e, f"sample {index}", "decode(raw)" if self.decode else
                                   "the raw sample", "the first sample") from e
        if self._as_tuple:
            value = tuple(value[_PART.format(k)] for k in range(len(value)))
        return value if self.transform is None else self.transform(value)

    def _decoded(self, raw: Any) -> Any:
        value = raw if self.decode is None else self.decode(raw)
        return _as_tensors(value, "decode(raw)" if self.decode else "the raw sample")

    def _open(self, shard: Any) -> Iterable[Any]:
        self.shards_opened += 1
        samples = self.open_shard(shard)
        if not isinstance(samples, Iterable):
            raise TypeError(f"open_shard should return the shard's samples (an iterable), but "
                            f"open_shard({shard!r}) returned {type(samples).__name__}")
        return samples

    def _order(self, epoch: int) -> np.ndarray:
        """The shards in the order of ``epoch`` (drawn from the seed and the epoch)."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))

    def _samples_in(self, shards: np.ndarray) -> int:
        return int(np.diff(self._offsets)[shards].sum())

    def _count(self, shard: Any) -> int:
        return sum(1 for _ in self._open(shard))

    # -- resuming (torchdata's StatefulDataLoader calls these in each worker) ----------------

    def state_dict(self) -> dict:
        """Where this process's iteration is: its epoch, how many samples it yielded, and the
        world it ran in (``ranks``, DataLoader ``workers``, and with several nodes ``nodes``
        and its ``rank`` in the deal); after a resume on another world, also ``after``, the
        ``job_state`` it resumed from. Such a count resumes on the same world; gather every
        worker's (``job_state``) to resume on another."""
        return dict(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` (on the same world: the next iterator runs that epoch
        and skips what was yielded, without decoding it), or from ``job_state(states)`` (on
        any world: the next iterator of each worker yields its share of the epoch's samples
        that no worker of the saved job yielded)."""
        self._resume = _checked_state(state)
        job = self._resume if "yielded_by" in self._resume else self._resume.get("after")
        self._done = None if job is None else (job, self._consumed(job))

    @staticmethod
    def job_state(states: Sequence[Any]) -> dict:
        """One state of a whole job, from the states of each of its ranks, in rank order
        (``torch.distributed.all_gather_object`` gathers them): for each rank, its
        StatefulDataLoader's ``state_dict()``, or the list of its DataLoader workers'
        ``CachedStream.state_dict()`` (one, without workers). ``load_state_dict`` of it
        resumes the epoch on any world (other numbers of nodes, ranks or workers): every
        sample that no worker yielded, once (with ``even``, padded as every epoch is). The
        order of the rest differs from the one the saved world would have given: a stream
        reads its shards in order, and the new world deals them otherwise. Loading it
        replays what every saved worker yielded, index by index, without reading a shard.

        Raises:
            ValueError: the states are not of one epoch of one world (a rank missing, two
                epochs), or not CachedStream's.
        """
        if isinstance(states, (str, bytes, Mapping)) or not isinstance(states, Sequence) or \
                not states:
            raise TypeError(f"states should be a list with each rank's state, in rank order, "
                            f"but got states={states!r}")
        rows = [_worker_states(r, s) for r, s in enumerate(states)]
        started = [(r, w, st) for r, row in enumerate(rows) for w, st in enumerate(row)
                   if st["yielded"]]
        if not started:  # nothing yielded: the epoch afresh, on any world
            epoch = max(st["epoch"] for row in rows for st in row)
            return {"epoch": epoch, "ranks": len(rows), "workers": 1, "nodes": 1,
                    "yielded_by": [[0] for _ in rows]}
        r0, w0, first = started[0]
        shape = {"epoch": first["epoch"], "ranks": first.get("ranks"),
                 "workers": first.get("workers"), "nodes": first.get("nodes", 1),
                 "after": first.get("after")}
        for r, w, st in started:
            got = {"epoch": st["epoch"], "ranks": st.get("ranks"),
                   "workers": st.get("workers"), "nodes": st.get("nodes", 1),
                   "after": st.get("after")}
            if got != shape:
                differ = ", ".join(f"{k}={shape[k]!r} and {got[k]!r}" for k in shape
                                   if got[k] != shape[k])
                raise ValueError(f"states should be of one epoch of one job, but rank {r0} "
                                 f"worker {w0} and rank {r} worker {w} differ: {differ}")
            if st.get("rank", r) != r:
                raise ValueError(f"states should be in rank order, but the state at rank {r} "
                                 f"was saved by rank {st['rank']}")
        if shape["ranks"] is None:
            raise ValueError("states should record their world (ranks, workers), but got "
                             "states saved before CachedStream recorded it: resume those on "
                             "the world that saved them")
        if shape["ranks"] != len(rows) or any(len(row) not in (1, shape["workers"])
                                              for row in rows):
            raise ValueError(f"states should hold every rank's state ({shape['ranks']} ranks "
                             f"of {shape['workers']} DataLoader workers saved them), but got "
                             f"{len(rows)} ranks with {[len(row) for row in rows]} workers")
        yielded_by = [[0] * shape["workers"] for _ in rows]
        for r, w, st in started:
            yielded_by[r][w] = st["yielded"]
        job = {"epoch": shape["epoch"], "ranks": shape["ranks"], "workers": shape["workers"],
               "nodes": shape["nodes"], "yielded_by": yielded_by}
        if shape["after"] is not None:
            job["after"] = shape["after"]
        return _checked_state(job)


_NOTHING = object()


def _share(order: np.ndarray, rank: int, ranks: int, worker: int, workers: int) -> np.ndarray:
    """The shards of one DataLoader worker of one rank: the rank's share of the epoch's order
    dealt round-robin (the same whatever the number of workers), then the worker's of it."""
    return order[rank::ranks][worker::workers]



def _first_nonempty(lengths: Sequence[int]) -> int:
    return next(k for k, n in enumerate(lengths) if n)


def _shuffled(items: Iterable[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """``items`` through a shuffle buffer of ``size``: each item leaves at a random place of
    the buffer once it is full (the buffer then drains in random order)."""
    buffer: list = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        k = int(rng.integers(size))
        buffer[k], item = item, buffer[k]
        yield item
    rng.shuffle(buffer)
    yield from buffer


# -- which node reads (and caches) which shards ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardLayout(CacheLayout):
    """The layout of a ``CachedStream`` over several nodes: each shard is read by one node
    every epoch, and a node caches the samples of its own shards (whole shards first, in
    shard order, as far as its ``slots`` go), so that what it caches is what it reads again.

    Which node reads a shard is a rendezvous hash of the shard and the node (the node of the
    highest score wins), bounded so that no node takes more than ``ceil(total / num_nodes)
    + longest shard - 1`` samples: the nodes read within a shard of one another, and when a
    node joins or leaves, the shards of the nodes that stay mostly stay with them (a node
    that stays keeps the shards it reads and caches). A pure function of its fields: every
    node, rank and DataLoader worker computes the same deal; the sizes (``slots``) play no
    part in it. (Why bounded rendezvous: docs/design.md, "A stream's shards over nodes".)

    Build one with ``ShardLayout.for_shards``; ``CachedStream`` does, and passes it to the
    ``SharedCache`` it makes (``layout=``). Its ``seed`` is a digest of the stream's seed, the
    number of nodes and the shard lengths, so that a segment of another stream, of the default
    layout, or of another number of nodes (whose node reads other shards) under the same name
    is told apart when a process attaches: a node's share here depends on the number of nodes,
    unlike ``CacheLayout``'s.

    Args (besides ``CacheLayout``'s):
        shard_lengths: the number of samples of each shard, in the shards' order (they sum
            to ``dataset_len``).
    """

    shard_lengths: tuple = ()

    @classmethod
    def for_shards(cls, shard_lengths: Sequence[int], num_nodes: int, *, seed: int = 0,
                   slots: int = 0) -> "ShardLayout":
        """The layout of a stream of shards of ``shard_lengths`` samples over ``num_nodes``,
        with the stream's ``seed``."""
        lengths = tuple(check_int(f"shard_lengths[{k}]", n, low=0)
                        for k, n in enumerate(shard_lengths))
        seed = check_int("seed", seed, low=0)
        digest = hashlib.blake2b(repr(("ShardLayout", seed, num_nodes, lengths)).encode(),
                                 digest_size=8)
        return cls(sum(lengths), slots, num_nodes, int.from_bytes(digest.digest(), "little")
                   >> 1, False, lengths)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.shard_lengths, tuple) or \
                sum(self.shard_lengths) != self.dataset_len:
            raise ValueError(f"shard_lengths should be a tuple of lengths that sum to "
                             f"dataset_len={self.dataset_len}, but got "
                             f"shard_lengths={self.shard_lengths!r}")

    @property
    def is_prefix(self) -> bool:
        return self.num_nodes == 1  # (one node reads every shard: its first samples)

    @functools.cached_property
    def _shard_nodes(self) -> np.ndarray:
        return _deal_shards(np.asarray(self.shard_lengths, dtype=np.int64), self.num_nodes,
                            self.seed)

    def node_of_shards(self) -> np.ndarray:
        """The node that reads each shard (int64, one entry per shard)."""
        return self._shard_nodes

    def shards_of(self, node_rank: int) -> np.ndarray:
        """The shards ``node_rank`` reads, in shard order."""
        node_rank = check_int("node_rank", node_rank, low=0, high=self.num_nodes - 1)
        return np.flatnonzero(self._shard_nodes == node_rank)

    def indices(self, node_rank: int) -> np.ndarray:
        """The samples of the shards of ``node_rank``, in shard order, as far as its slots
        go (int64)."""
        offsets = np.concatenate([[0], np.cumsum(self.shard_lengths, dtype=np.int64)])
        mine = self.shards_of(node_rank)
        held = np.concatenate([np.arange(offsets[k], offsets[k + 1], dtype=np.int64)
                               for k in mine]) if len(mine) else np.zeros(0, np.int64)
        return held[:self.slots]

    def owner_rows(self) -> Iterator[np.ndarray]:
        for k in range(self.num_nodes):
            row = np.zeros(self.dataset_len, dtype=bool)
            row[self.indices(k)] = True
            yield row


def _scores(seed: int, shards: np.ndarray, node: int) -> np.ndarray:
    """A 64-bit hash of (seed, shard, node) for every shard (splitmix64's finaliser)."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + shards.astype(np.uint64)
             * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(node + 1) * np.uint64(0x94D049BB133111EB))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _deal_shards(lengths: np.ndarray, num_nodes: int, seed: int) -> np.ndarray:
    """The node of each shard: in an order drawn from ``seed`` (not from ``num_nodes``), each
    shard goes to the node of its highest score that has room left under the bound
    (``ShardLayout``). Some node always has room: were every node at ``ceil(total / nodes)``
    or more, the shards placed would already hold ``total`` samples."""
    n = len(lengths)
    if num_nodes == 1:
        return np.zeros(n, dtype=np.int64)
    shards = np.arange(n, dtype=np.int64)
    scores = np.stack([_scores(seed, shards, k) for k in range(num_nodes)], axis=1)
    preference = np.argsort(scores, axis=1, kind="stable")[:, ::-1]
    bound = -(-int(lengths.sum()) // num_nodes) + int(lengths.max(initial=0)) - 1
    load = np.zeros(num_nodes, dtype=np.int64)
    nodes = np.empty(n, dtype=np.int64)
    for k in np.argsort(_scores(seed, shards, -1), kind="stable"):
        node = next(int(j) for j in preference[k] if load[j] + lengths[k] <= bound)
        nodes[k] = node
        load[node] += lengths[k]
    return nodes


# -- states ------------------------------------------------------------------------------------


_WORKER_KEYS = {"epoch", "yielded", "ranks", "workers", "nodes", "rank", "after"}
_JOB_KEYS = {"epoch", "ranks", "workers", "nodes", "yielded_by", "after"}


def _checked_state(state: Any, name: str = "state") -> dict:
    """A copy of a worker's ``state_dict()`` or of a ``job_state``, checked."""
    keys = set(state) if isinstance(state, Mapping) else set()
    worker = "yielded" in keys and keys <= _WORKER_KEYS
    job = {"yielded_by", "ranks", "workers", "nodes"} <= keys <= _JOB_KEYS
    if "epoch" not in keys or not (worker or job):
        raise ValueError(f"{name} should be a dict from CachedStream.state_dict() with "
                         f"'epoch' and 'yielded', or from CachedStream.job_state(), but got "
                         f"{name}={state!r}")
    out: dict = {"epoch": check_int(f"{name}['epoch']", state["epoch"], low=0)}
    for k in ("yielded", "ranks", "workers", "nodes", "rank"):
        if k in state:
            out[k] = check_int(f"{name}['{k}']", state[k], low=0 if k in ("yielded", "rank")
                               else 1)
    if "yielded_by" in state:
        rows = state["yielded_by"]
        if not isinstance(rows, Sequence) or len(rows) != out["ranks"] or any(
                not isinstance(row, Sequence) or len(row) != out["workers"] for row in rows) \
                or out["ranks"] % out["nodes"]:
            raise ValueError(f"{name}['yielded_by'] should hold a count for each of "
                             f"{out['workers']} workers of each of {out['ranks']} ranks (over "
                             f"{out['nodes']} nodes), but got {rows!r}")
        out["yielded_by"] = [[check_int(f"{name}['yielded_by'][{r}][{w}]", n, low=0)
                              for w, n in enumerate(row)] for r, row in enumerate(rows)]
    if state.get("after") is not None:
        after = _checked_state(state["after"], f"{name}['after']")
        if "yielded_by" not in after or after["epoch"] != out["epoch"]:
            raise ValueError(f"{name}['after'] should be the job_state of the same epoch that "
                             f"{name} resumed from, but got {state['after']!r}")
        out["after"] = after
    return out


def _worker_states(rank: int, state: Any) -> list[dict]:
    """The CachedStream states of one rank's workers, from its StatefulDataLoader's state
    (``_snapshot``'s worker snapshots, or ``dataset_state`` without workers), a list of
    them, or one."""
    if isinstance(state, Mapping) and "_snapshot" in state:  # StatefulDataLoader, workers
        snaps = state["_snapshot"].get("_worker_snapshots", {})
        state = [snaps[f"worker_{w}"]["dataset_state"] for w in range(len(snaps))]
    elif isinstance(state, Mapping) and "dataset_state" in state:  # without workers
        state = [state["dataset_state"]]
    elif isinstance(state, Mapping):
        state = [state]
    if isinstance(state, (str, bytes)) or not isinstance(state, Sequence) or not state:
        raise TypeError(f"states[{rank}] should be a rank's StatefulDataLoader state_dict() or "
                        f"its workers' CachedStream.state_dict(), but got {state!r}")
    return [_checked_state(st, f"states[{rank}][{w}]") for w, st in enumerate(state)]


def _depth(job: Mapping[str, Any] | None) -> int:
    """How many resumes on another world lie behind a run (0: a whole epoch)."""
    return 0 if job is None else 1 + _depth(job.get("after"))
