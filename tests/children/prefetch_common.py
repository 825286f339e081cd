"""What tests/test_prefetch.py and its child programs (tests/children/prefetch_*.py) share.

Not a program: a module imported by the test, by the child programs (their own directory is on
``sys.path``), and by DataLoader workers started with spawn or forkserver (multiprocessing hands
them the parent's ``sys.path``, where the test put this directory).

* ``value_of(i)``: the sample of index ``i``, ``_helpers.value_of`` at ``DIMS``;
* ``Loads``: a load function that records every call in a directory, so that loads in the
  prefetcher's threads and in DataLoader workers of any start method, and in several ranks, are
  counted in one place: a file ``<i>.<k>`` for the k-th load of index i (claimed with O_EXCL,
  so two processes never take the same k), holding who loaded it, and a file ``overlap.<i>.*``
  whenever a load of i starts while another load of i is still running;
* ``PrefetchedDataset``: the README's two lines, with ``Loads`` as the load on a miss;
* ``Shuffled``: a seeded shuffle whose order the test can compute;
* the tests' sizes (``N``, ``SLOTS``, ``STAGING``, ``BATCH``), ``make_cache``, ``oob_of``,
  ``loads_since``, ``check_epoch`` and ``read_epoch``, shared by tests/test_prefetch.py and
  tests/test_prefetch_processes.py.

The rest (sizes, environments, /proc probes) is in ``tests/_helpers.py``, which this imports:
``rank_env()`` puts ``tests/`` on the path of every child program.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

import _helpers
from stocaching import SharedCache, SlotState

DIMS = (2, 4, 4)
value_of = functools.partial(_helpers.value_of, dims=DIMS)
N, SLOTS, STAGING, BATCH = 64, 32, 64, 4  # the tests' dataset: half of it with a slot


def make_cache(shm_dir, *, slots=SLOTS, staging=STAGING, name=None) -> SharedCache:
    cache = SharedCache(_helpers.budget_for(slots, DIMS, staging=staging, dataset_len=N), N, DIMS,
                        shm_dir=shm_dir, staging_slots=staging, name=name)
    assert len(cache) == slots and cache.stats()["staging_slots"] == staging
    return cache


def oob_of(cache) -> set[int]:
    """Indices without a slot in ``cache`` (with one node: the last N - SLOTS)."""
    return {int(i) for i in (cache.aux_array.numpy() == SlotState.OOB.value).nonzero()[0]}


def loads_since(directory, before: dict[int, list[str]]) -> dict[int, list[str]]:
    """Loads recorded since the snapshot ``before``: index -> who, one entry per load."""
    now = load_counts(directory)
    return {i: w[len(before.get(i, [])):] for i, w in now.items()
            if len(w) > len(before.get(i, []))}


def check_epoch(seen, base_order, window):
    """Every index of the base order exactly once, none moved more than ``window``."""
    assert sorted(seen) == sorted(base_order) == list(range(len(base_order)))
    if window is None:
        assert seen == base_order
    else:
        where = {i: p for p, i in enumerate(base_order)}
        assert max(abs(t - where[i]) for t, i in enumerate(seen)) <= window


def read_epoch(loader):
    """Indices of one epoch through ``loader``, each value checked."""
    seen = []
    for idx, x in loader:
        for i, xi in zip(idx.tolist(), x):
            assert torch.equal(xi, value_of(i)), f"wrong sample for index {i}"
        seen += idx.tolist()
    return seen


class Loads:
    """``load(i) -> value_of(i)`` that records the call in ``directory`` under the name
    ``who``. Picklable (it holds two strings), so DataLoader workers of every start method get
    one that writes to the same directory."""

    def __init__(self, directory: str, who: str) -> None:
        self.directory, self.who = str(directory), who

    def __call__(self, i: int) -> torch.Tensor:
        i = int(i)
        active = os.path.join(self.directory, f"active.{i}")
        mine = False
        try:
            os.close(os.open(active, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            mine = True
        except FileExistsError:  # another load of i is running right now
            tag = f"{os.getpid()}.{threading.get_ident()}.{self.who}"
            open(os.path.join(self.directory, f"overlap.{i}.{tag}"), "w").close()
        try:
            k = 0
            while True:
                try:
                    fd = os.open(os.path.join(self.directory, f"{i}.{k}"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                    break
                except FileExistsError:
                    k += 1
            os.write(fd, self.who.encode())
            os.close(fd)
            return value_of(i)
        finally:
            if mine:
                os.unlink(active)


def load_counts(directory: str) -> dict[int, list[str]]:
    """index -> who loaded it, one entry per load, in load order."""
    out: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir(directory):
        parts = name.split(".")
        if len(parts) == 2 and parts[0].isdigit():
            with open(os.path.join(directory, name)) as f:
                out.setdefault(int(parts[0]), []).append((int(parts[1]), f.read()))
    return {i: [who for _, who in sorted(v)] for i, v in out.items()}


def overlaps(directory: str) -> list[str]:
    """Files recording a load that started while another load of the same index ran."""
    return sorted(n for n in os.listdir(directory) if n.startswith("overlap."))


class PrefetchedDataset(torch.utils.data.Dataset):
    """The two-line pattern: ``get_slot``, and on a miss ``load`` + ``set_slot``. Items are
    ``(i, sample)``."""

    def __init__(self, cache, n: int, load) -> None:
        self.cache, self.n, self.load = cache, n, load

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = self.cache.get_slot(i)
        if x is None:
            x = self.load(i)
            self.cache.set_slot(i, x)
        return i, x


class Shuffled(torch.utils.data.Sampler):
    """A seeded shuffle whose order is a pure function of (seed, epoch), so the test can
    compute the base order of every epoch."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int | None = None) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + (self.epoch if epoch is None
                                                               else epoch))
        return torch.randperm(self.n, generator=g).tolist()

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(self.order())

