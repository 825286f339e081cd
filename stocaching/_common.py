"""An internal module shared by the opt-in modules: not public API.

Nothing here is for users, and any of it may change without notice. It holds what opt-in
modules share and none offers its users: the order as a prefetcher reads it ahead, and what a
resume needs of it (``order.py`` and ``prefetch.py``); a sampler over a ``DistributedSampler``
that is one too, and what accelerate deals a process (the same two); where a resumable
sampler's epoch stands and how a saved state is checked (``samplers.py``, ``mixtures.py``,
``order.py`` and ``prefetch.py``); the values a cache can hold (``wrapper.py`` and
``streams.py``). It imports only the core's public names, so it works copied beside
``stocaching.py``; an opt-in module that imports from it needs it copied beside it too.

Each part has a banner of its own (``grep '^# .* ####' _common.py`` lists them): Orders shared
by the prefetcher; Samplers under trainers; Resuming a sampler; The values a cache can hold.
"""

from __future__ import annotations

__all__: list[str] = []  # (internal: nothing to import with *)

import hashlib
import inspect
import itertools
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

try:  # inside the package
    from .stocaching import SharedCache, check_int
except ImportError:  # copied beside stocaching.py
    from stocaching import SharedCache, check_int  # type: ignore[no-redef]


####################################################################################################
# Orders shared by the prefetcher ##################################################################
####################################################################################################
# (order.py and prefetch.py: the base order as it passes, its fingerprint, the state of the
# generator it draws from, and the refusal or warning of a resume that cannot continue it)


def _digest(indices: np.ndarray) -> str:
    return hashlib.blake2b(indices.astype("<i8", copy=False).tobytes(),
                           digest_size=16).hexdigest()


def _check_in_range(name: str, indices: np.ndarray, dataset_len: int) -> None:
    """Raise unless every index that ``name`` yielded is in ``[0, dataset_len)``."""
    if indices.size and (indices.min() < 0 or indices.max() >= dataset_len):
        raise ValueError(f"{name} should yield indices in [0, {dataset_len}) (the cache's "
                         f"dataset_len), but it yielded {indices.min()}..{indices.max()}")


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
    """The user's sampler behind ``base`` (a prefetcher's order reads it through a
    ``_RecordingSampler``)."""
    return base.base if isinstance(base, _RecordingSampler) else base


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


# The modules' names when they are copied side by side into a project, without the package.
_COPIED_MODULES = ("stocaching", "_common", "order", "prefetch", "device", "samplers",
                   "mixtures")


def _level_outside_stocaching() -> int:
    """The ``stacklevel`` of ``warnings.warn``, called by the caller of this function, that
    names the first frame outside stocaching's modules (the package's, or the modules copied
    side by side into a project)."""
    package = __name__.rpartition(".")[0]
    frame, level = sys._getframe(1), 1  # level 1: the frame that calls warnings.warn
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        ours = name.startswith(package + ".") if package else name in _COPIED_MODULES
        if not ours:
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


class _RecordingSampler:
    """The user's sampler, passed through, with the order of its latest epoch recorded:
    the prefetcher reads ahead in it (``order``), and a resume checks its fingerprint
    (``digest``) and restores the base's state at its start. Other attributes are the
    sampler's."""

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
        return iter(self.epoch().tolist())

    def epoch(self) -> np.ndarray:
        """The order that ``__iter__`` passes on, as an array (listed now, unless ``take``
        did it already)."""
        if not self._taken:
            self.take()
        self._taken = False
        return self.order

    def epoch_length(self, epoch: int | None = None) -> int:
        """Indices the base yields in ``epoch`` (default: its own) from the epoch's start:
        ``len(self)``, or fewer in an epoch it resumed on another world (a base with
        ``epoch_length``)."""
        length_of = getattr(self.base, "epoch_length", None)
        if length_of is None or self.keep is not None:
            return len(self)
        return length_of(getattr(self.base, "epoch", 0) if epoch is None else epoch)

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


####################################################################################################
# Samplers under trainers ##########################################################################
####################################################################################################
# (order.py and prefetch.py: a DistributedSampler over one, and the class their __new__ makes;
# the positions accelerate deals a process; Lightning's wrapper)


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


def _class_over_base(cls: type, public: type, over_distributed: type, args: tuple, kwargs: dict,
                     keyword: str) -> type:
    """The class that ``cls(*args, **kwargs)`` makes, for the ``__new__`` of ``public`` (a
    sampler over a base sampler): ``over_distributed``, its subclass that is a
    ``DistributedSampler`` too, when the base (the first argument, by position or as
    ``keyword``) is a ``DistributedSampler``; else ``cls`` (a user's subclass stays itself)."""
    base = args[0] if args else kwargs.get(keyword)
    if cls is public and isinstance(base, torch.utils.data.DistributedSampler):
        return over_distributed
    return cls


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


####################################################################################################
# Resuming a sampler ###############################################################################
####################################################################################################
# (samplers.py, mixtures.py, order.py and prefetch.py: where an epoch's iterator stands, and
# the checks of a saved state)


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


class EpochRest(NamedTuple):
    """What of an epoch's order the worlds before this one consumed (another ``num_replicas``,
    say): its first ``done`` positions, and the positions ``taken`` after them (sorted; a
    reordering sampler such as ``ReadyFirstSampler`` consumes positions out of order). The
    positions left are this world's. Its operations work on ``taken``, not on the epoch's
    positions: see docs/design.md, "A reordered epoch's state on another world"."""

    epoch: int
    done: int
    taken: tuple[int, ...] = ()

    def left(self, length: int) -> np.ndarray:
        """The positions of the epoch's order (of ``length`` positions) not consumed, in
        order (int64)."""
        keep = np.ones(max(0, length - self.done), dtype=bool)
        keep[np.asarray(self.taken, dtype=np.int64) - self.done] = False
        return self.done + np.flatnonzero(keep)

    def positions(self, length: int, num_replicas: int, drop_last: bool) -> np.ndarray:
        """The positions of the epoch's order (of ``length``) that this world's ranks split:
        those not consumed, padded from their own start (or cut, with ``drop_last``) to a
        multiple of ``num_replicas``, as DistributedSampler pads an epoch (the padding of the
        worlds before is not repeated)."""
        left = self.left(length)
        per_rank = left.size // num_replicas if drop_last else -(-left.size // num_replicas)
        return np.resize(left, per_rank * num_replicas) if left.size else left

    def sequence(self, order: np.ndarray, num_replicas: int, drop_last: bool) -> np.ndarray:
        """What this world's ranks split of the epoch's ``order``: ``order`` at
        :meth:`positions`."""
        return order[self.positions(order.size, num_replicas, drop_last)]

    def per_rank(self, length: int, num_replicas: int, drop_last: bool) -> int:
        """Indices each rank of this world iterates of the rest (of an order of ``length``)."""
        left = max(0, length - self.done - len(self.taken))
        return left // num_replicas if drop_last else -(-left // num_replicas)

    def union(self, others: Iterable["EpochRest"]) -> "EpochRest":
        """The positions that this rest or any of ``others`` (of the same epoch) consumed."""
        rests = sorted([self, *others], key=lambda r: r.done)
        joined = rests[0]._replace(epoch=self.epoch)
        for rest in rests[1:]:
            joined = joined.consume(np.r_[np.arange(joined.done, rest.done),
                                          np.asarray(rest.taken, dtype=np.int64)])
        return joined

    def consume(self, positions: Any) -> "EpochRest":
        """This rest with ``positions`` of the order consumed too (in time and memory of
        the order of the positions given and taken, not of the epoch's length)."""
        p = np.asarray(positions, dtype=np.int64)
        return self._settled(self.done, np.union1d(np.asarray(self.taken, dtype=np.int64),
                                                   p[p >= self.done]))

    def after_first(self, k: int, length: int) -> "EpochRest":
        """This rest with the first ``k`` positions it has left (of an order of ``length``)
        consumed too."""
        k = min(k, length - self.done - len(self.taken))
        if k <= 0:
            return self
        taken = np.asarray(self.taken, dtype=np.int64)
        left_before = taken - self.done - np.arange(taken.size)  # (non-decreasing)
        last = self.done + k - 1 + int(np.searchsorted(left_before, k - 1, side="right"))
        return self._settled(last + 1, taken[taken > last])

    def _settled(self, done: int, taken: np.ndarray) -> "EpochRest":
        """The rest consuming every position below ``done`` and ``taken`` (sorted, unique,
        all >= ``done``), with ``done`` the first position not consumed."""
        gap = np.flatnonzero(taken != done + np.arange(taken.size))
        first = int(gap[0]) if gap.size else taken.size
        return EpochRest(self.epoch, done + first, tuple(taken[first:].tolist()))

    def fields(self) -> dict[str, Any]:
        """The state's fields for this rest: ``epoch_done`` (``done``) and ``epoch_taken``,
        the ``taken`` positions as a list of ``[start, stop)`` runs (plain ints, so that a
        state stays JSON; empty for a prefix)."""
        taken = np.asarray(self.taken, dtype=np.int64)
        cut = np.flatnonzero(np.diff(taken) != 1) + 1
        starts, stops = np.r_[taken[:1], taken[cut]], np.r_[taken[cut - 1] + 1, taken[-1:] + 1]
        return {"epoch_done": self.done,
                "epoch_taken": [[int(a), int(b)] for a, b in zip(starts, stops)]}

    @classmethod
    def of_fields(cls, state: Mapping[str, Any], epoch: int, length: int | None
                  ) -> "EpochRest":
        """The rest that ``state``'s ``epoch_done`` and ``epoch_taken`` say (checked; a state
        saved before they were recorded began its epoch itself) for an order of ``length``
        positions (None: not known, not checked)."""
        done = check_int("state['epoch_done']", state.get("epoch_done", 0), low=0, high=length)
        length = 2**63 if length is None else length
        runs = state.get("epoch_taken") or []
        taken: list[int] = []
        low = done + 1
        for run in runs if isinstance(runs, (list, tuple)) else [runs]:
            if not (isinstance(run, (list, tuple)) and len(run) == 2 and
                    all(isinstance(x, int) and not isinstance(x, bool) for x in run) and
                    low <= run[0] < run[1] <= length):
                raise ValueError(f"state['epoch_taken'] should be increasing [start, stop) runs "
                                 f"of positions in [{done + 1}, {length}] (after "
                                 f"state['epoch_done']={done}, in the epoch's order of "
                                 f"{length}), but got the run {run!r}")
            taken.extend(range(run[0], run[1]))
            low = run[1] + 1
        return cls(epoch, done, tuple(taken))


class SavedEpoch(NamedTuple):
    """The world a state was saved in, as far as the rest of its epoch depends on it."""

    num_replicas: int
    batch_size: int  # 1 for a sampler that deals its ranks index by index
    length: int  # the epoch's order: its positions (before any padding)
    before: EpochRest  # ... consumed before the saved world took the epoch over
    per_rank: int  # indices each rank of the saved world iterates in the epoch
    drop_last: bool

    @classmethod
    def of(cls, state: Mapping[str, Any], drop_last: bool, length: int) -> "SavedEpoch":
        """The saved world of ``state``, whose epoch's order has ``length`` positions; a
        state saved before ``epoch_done`` was recorded began its epoch itself."""
        replicas = check_int("state['num_replicas']", state["num_replicas"], low=1)
        batch = check_int("state['batch_size']", state.get("batch_size", 1), low=1)
        before = EpochRest.of_fields(state, state.get("epoch", 0), length)
        return cls(replicas, batch, length, before,
                   before.per_rank(length, replicas, drop_last), drop_last)

    @property
    def done(self) -> int:
        """Whether (non-zero) and how much of the epoch's order the worlds before consumed."""
        return self.before.done + len(self.before.taken)

    def rest_before(self, epoch: int) -> EpochRest | None:
        """What the worlds before the saved one consumed of ``epoch`` (None: nothing)."""
        return self.before._replace(epoch=epoch) if self.done else None

    def at_boundary(self, consumed: int) -> bool:
        """Whether ``consumed`` indices of each rank are a prefix of the order: whole global
        batches, or the whole epoch."""
        return consumed % self.batch_size == 0 or consumed == self.per_rank

    def rest_after(self, epoch: int, consumed: int) -> EpochRest:
        """The rest of ``epoch`` once each rank of the saved world consumed ``consumed`` (at
        a boundary): the first ``consumed * num_replicas`` positions its ranks split; none
        once it finished its epoch (with ``drop_last``, what it cut stays cut)."""
        if consumed == self.per_rank:
            return EpochRest(epoch, self.length)
        return self.before._replace(epoch=epoch).after_first(consumed * self.num_replicas,
                                                            self.length)


def rest_state(sampler: Any, consumed: int, taken: Any, *, batch_size: int,
               length: int) -> dict[str, Any]:
    """The ``rest_state`` of a sampler that deals a world-independent order of ``length``
    positions in global batches of ``batch_size`` indices a rank (``CacheAwareSampler``;
    ``WeightedMixtureSampler``, index by index: 1): its state of the current epoch saved at
    the batch boundary at or below ``consumed``, made a state of the epoch's rest at its start
    (``consumed`` 0). The rest has consumed what the worlds before did, the ranks' indices
    before the boundary, and this rank's indices from the boundary to ``consumed`` and at
    the positions ``taken`` of its epoch (out of order, as a reordering sampler consumes
    them), each where ``sampler.epoch_positions`` puts it in the order. Joined with the same
    of every other rank (:func:`joined_rest`), it resumes on any world."""
    n = sampler.epoch_length(sampler.epoch)
    consumed = check_int("consumed", consumed, low=0, high=n)
    taken = np.asarray(taken, dtype=np.int64)
    if taken.size and (taken.min() < consumed or taken.max() >= n):
        raise ValueError(f"taken should be positions in [{consumed}, {n}) of this rank's "
                         f"epoch, but got {taken.min()}..{taken.max()}")
    boundary = consumed if consumed == n else consumed - consumed % batch_size
    state = sampler.state_dict(consumed=boundary)
    saved = SavedEpoch.of(state, sampler.drop_last, length)
    mine = np.union1d(np.arange(boundary, consumed), taken).astype(np.int64)
    rest = saved.rest_after(sampler.epoch, boundary).consume(
        sampler.epoch_positions(sampler.epoch)[mine])
    return {**state, "consumed": 0, **rest.fields()}


def joined_rest(states: Sequence[Mapping[str, Any]], what: str) -> dict[str, Any]:
    """One state from the rest states (:func:`rest_state`) of every rank of a world, one
    each: what any of them consumed is consumed. ``what`` names the states in errors (where
    they came from, such as "states[k]['world']")."""
    first = states[0]
    for field in ("num_replicas", "epoch", "rank"):
        for k, state in enumerate(states):
            if not isinstance(state, Mapping) or field not in state:
                raise ValueError(f"{what.format(k=k)} should be a sampler's state with "
                                 f"'{field}', but got {state!r:.80}")
    replicas = first["num_replicas"]
    ranks = sorted(state["rank"] for state in states)
    if ranks != list(range(replicas)):
        raise ValueError(f"the states should be those of every rank of the world they were "
                         f"saved in (num_replicas={replicas}), each once, but they are of "
                         f"ranks {ranks}")
    for k, state in enumerate(states):
        for field in ("num_replicas", "epoch", "consumed"):
            if state.get(field) != first.get(field):
                raise ValueError(f"{what.format(k=k)}['{field}'] should be that of the first "
                                 f"state, {first.get(field)!r} (the ranks of one world at one "
                                 f"step), but got {state.get(field)!r}")
    epoch = first["epoch"]
    rests = [EpochRest.of_fields(state, epoch, None) for state in states]
    return {**first, **rests[0].union(rests[1:]).fields()}


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


####################################################################################################
# The values a cache can hold ######################################################################
####################################################################################################
# (wrapper.py and streams.py: what a value becomes on its way into a cache)


# The field names a tuple item's parts get in a cache of fields (names must be identifiers).
_PART = "item{}"


def _as_tensors(value: Any, what: str, nested: bool = False) -> Any:
    """``value`` with numpy arrays and Python numbers made tensors (a Python float a float32
    one, as torch makes it), a list made a tuple; a TypeError for what a cache cannot hold:
    other types, tuples or dicts inside tuples or dicts, dict keys that are not identifiers,
    a bare number."""
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, (np.ndarray, np.generic)):
        tensor = torch.from_numpy(np.array(value, order="C"))  # (a copy: 0-d stays 0-d)
    elif isinstance(value, (bool, int, float)):
        tensor = torch.as_tensor(value)
    elif isinstance(value, (Mapping, tuple, list)) and not nested:
        if isinstance(value, Mapping):
            for k in value:
                if not (isinstance(k, str) and k.isascii() and k.isidentifier()):
                    raise TypeError(f"{what} should have keys that are Python identifiers (the "
                                    f"cache's field names), but got the key {k!r}: rename it in "
                                    "decode")
            return {k: _as_tensors(v, f"{what}[{k!r}]", True) for k, v in value.items()}
        return tuple(_as_tensors(v, f"{what}[{k}]", True) for k, v in enumerate(value))
    else:
        raise TypeError(f"{what} should be made of tensors, numpy arrays or numbers (a tuple or "
                        f"dict of them, not nested), which the cache can hold, but got "
                        f"{type(value).__name__}: pass decode= turning each item into that "
                        "(for an image, its uint8 pixels)")
    if tensor.dim() == 0 and not nested:
        raise TypeError(f"{what} should be a tensor with at least one dimension, or a tuple or "
                        f"dict, but got a single number ({value!r}): return it as a tensor of "
                        "shape (1,), or in a tuple with the rest of the item")
    return tensor


def _unfit_value(error: Exception, where: str, what: str, first: str) -> Exception:
    """The cache's refusal of a value (another shape or dtype than the first item's), with
    what it means here."""
    return type(error)(
        f"{where}: {what} gave a value the cache cannot hold ({error}). The cache was made "
        f"for the shapes and dtypes of {first}: items of other sizes need a decode that makes "
        "them one size (resize, crop), or a cache made for them passed as cache= (an "
        "OpenSizeCache for sizes that vary)")


def _as_fields(value: tuple) -> dict:
    return {_PART.format(k): v for k, v in enumerate(value)}


def _dims_and_dtypes(value: Any) -> tuple[Any, Any]:
    """The ``data_dims`` and ``dtype`` of a cache holding values like ``value``."""
    if isinstance(value, tuple):
        value = _as_fields(value)
    if isinstance(value, dict):
        return ({k: tuple(v.shape) for k, v in value.items()},
                {k: v.dtype for k, v in value.items()})
    return tuple(value.shape), value.dtype


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and \
            bool(torch.equal(a, b) or (a.is_floating_point() and
                                        torch.equal(a.isnan(), b.isnan()) and
                                        torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))


def _check_options(options: Mapping[str, Any], who: str) -> None:
    """A keyword that is neither the caller's nor ``SharedCache``'s is named as the caller's
    mistake (not as one of SharedCache's, which the user did not call)."""
    known = set(inspect.signature(SharedCache.__init__).parameters) - {
        "self", "size_limit_gib", "dataset_len", "data_dims", "dtype"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{who} got an unexpected keyword argument {unknown[0]!r} (neither "
                        f"one of its own nor one of SharedCache's: {', '.join(sorted(known))})")
