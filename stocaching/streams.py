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
depends on ``(seed, epoch)`` only, never on what is cached, so ``state_dict`` (the epoch and
the count of samples yielded, per worker, as torchdata's ``StatefulDataLoader`` keeps them)
resumes an epoch exactly: the samples already yielded are skipped without being decoded.

The default layout caches the first ``len(cache)`` indices: whole shards, in the shards' own
order, which is what lets later epochs skip them. One node only (each node would cache a part
of its own); with a cache of a random subset (``random_subset=True``) most shards hold some
uncached sample and are still read.

An opt-in part of stocaching: it imports only public names of the core module
(``stocaching.py``) and the rules for values it shares with ``wrapper.py`` in ``_common.py``
(internal), so copying the three files side by side into a project also works. See docs/sources.md.
"""

from __future__ import annotations

__all__ = ["CachedStream"]

import itertools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

try:  # inside the package
    from ._common import (_PART, _as_fields, _as_tensors, _check_options, _dims_and_dtypes,
                          _same, _unfit_value)
    from .stocaching import BaseCache, SharedCache, check_int
except ImportError:  # copied beside stocaching.py and _common.py
    from _common import (_PART, _as_fields, _as_tensors,  # type: ignore[no-redef]
                         _check_options, _dims_and_dtypes, _same, _unfit_value)
    from stocaching import BaseCache, SharedCache, check_int  # type: ignore[no-redef]


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
        cache: the cache (``dataset_len`` the number of samples), or None to make a
            ``SharedCache`` from the first sample's decoded shapes and dtypes. Default: None.
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
            cache = SharedCache(size_limit_gib, total, *_dims_and_dtypes(first), **cache_options)
        elif cache.dataset_len != total:
            raise ValueError(f"cache should have dataset_len={total} (the shards' samples), but "
                             f"got a cache with dataset_len={cache.dataset_len}")
        if cache.layout.num_nodes > 1:
            if made:
                cache.close()  # (refused: nothing of it is left)
            raise ValueError(f"CachedStream is for one node: each node would stream the shards "
                             f"its own cache holds, which it does not do yet; but got a cache "
                             f"of {cache.layout.num_nodes} nodes")
        self.cache = cache
        self._epoch, self._resume, self._position = 0, None, {"epoch": 0, "yielded": 0}

    def __len__(self) -> int:
        """The samples this rank yields in the epoch ``set_epoch`` set, read in the training
        process (``num_workers=0``): its share of the shards, and with ``even`` as many as the
        fullest rank's. With DataLoader workers, ``even`` may add up to a shard per worker
        (each is padded to the fullest worker's count), which torch then reports as more
        samples than ``len``."""
        order = self._order(self._epoch)
        world = self.cache.world
        counts = [self._samples_in(_share(order, r, world.world_size, 0, 1))
                  for r in range(world.world_size)]
        return max(counts) if self.even else counts[world.rank]

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
        world = self.cache.world
        here = {"ranks": world.world_size, "workers": workers}
        epoch, skip = self._epoch, 0
        if self._resume is not None:
            resume, self._resume = self._resume, None
            saved = {k: resume[k] for k in here if k in resume}  # (older states lack them)
            if saved and saved != here:
                raise ValueError(
                    f"state should be one of a job with this one's {here['ranks']} ranks and "
                    f"{here['workers']} DataLoader workers, but got a state of "
                    f"{saved.get('ranks')} ranks and {saved.get('workers')} workers: a stream's "
                    "position is a count of its worker's samples, which another world deals "
                    "otherwise; resume it on the same world (see docs/interruptions.md)")
            epoch, skip = resume["epoch"], resume["yielded"]
        self._epoch = epoch + 1  # (a persistent worker's next epoch)
        order = self._order(epoch)
        mine = _share(order, world.rank, world.world_size, worker, workers)
        entries: Iterable[tuple[int, Any]] = self._entries(mine)
        if self.even:  # padded with its own first samples (any shard's, if it has none)
            fullest = max(self._samples_in(_share(order, r, world.world_size, w, workers))
                          for r in range(world.world_size) for w in range(workers))
            extra = fullest - self._samples_in(mine)
            if extra:
                again = itertools.cycle(mine if len(mine) else order)
                entries = itertools.chain(entries, itertools.islice(self._entries(again),
                                                                    extra))
        rng = np.random.default_rng([self.seed, epoch, world.rank, worker])
        self._position = {"epoch": epoch, "yielded": skip, **here}
        for n, (index, raw) in enumerate(_shuffled(entries, self.shuffle_buffer, rng)):
            if n < skip:
                continue  # (resumed: already yielded before the state was saved)
            value = self._value(index, raw)
            self._position = {"epoch": epoch, "yielded": n + 1, **here}
            yield value

    def _entries(self, shards: Iterable[int]) -> Iterator[tuple[int, Any]]:
        """(index, raw sample or None) of each sample of ``shards`` in order: a shard whose
        samples are all stored is not opened (None: read it from the cache)."""
        for k in shards:
            first, end = int(self._offsets[k]), int(self._offsets[k + 1])
            if end > first and self.cache.stored_mask(np.arange(first, end)).all():
                yield from ((i, None) for i in range(first, end))
                continue
            count = 0
            for raw in self._open(self.shards[k]):
                if count == end - first:
                    count += 1  # (one more than its length: enough to say so)
                    break
                yield first + count, raw
                count += 1
            if count != end - first:
                raise ValueError(f"shard {self.shards[k]!r} held {'more than ' if count > end - first else ''}"
                                 f"{min(count, end - first)} samples, but shard_lengths says "
                                 f"{end - first}: the lengths must be right for every index to "
                                 "be one sample")

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
        return int(sum(self._offsets[k + 1] - self._offsets[k] for k in shards))

    def _count(self, shard: Any) -> int:
        return sum(1 for _ in self._open(shard))

    # -- resuming (torchdata's StatefulDataLoader calls these in each worker) ----------------

    def state_dict(self) -> dict:
        """Where this process's iteration is: its epoch, how many samples it yielded, and the
        world it ran in (``ranks``, DataLoader ``workers``: another one is refused)."""
        return dict(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iterator runs that epoch and skips what was
        yielded (without decoding it)."""
        if not isinstance(state, Mapping) or not {"epoch", "yielded"} <= set(state) or \
                not set(state) <= {"epoch", "yielded", "ranks", "workers"}:
            raise ValueError(f"state should be a dict from CachedStream.state_dict() with "
                             f"'epoch' and 'yielded', but got state={state!r}")
        self._resume = {"epoch": check_int("state['epoch']", state["epoch"], low=0),
                        "yielded": check_int("state['yielded']", state["yielded"], low=0)}
        for k in ("ranks", "workers"):  # (where the state says: checked by the iterator)
            if k in state:
                self._resume[k] = check_int(f"state['{k}']", state[k], low=1)


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
