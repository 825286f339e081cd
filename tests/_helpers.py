"""Helpers of the tests and of the programs they start (the fixtures are in conftest.py).

Not a test module: pytest collects ``test_*.py`` only. Who imports it from where:

* test modules and conftest.py: pytest puts ``tests/`` on ``sys.path`` (it has no
  ``__init__.py``, so its rootdir-relative folder is prepended);
* DataLoader workers started with spawn or forkserver: multiprocessing hands the parent's
  ``sys.path`` to its children, so what they unpickle (``TwoLineDataset``) is found here;
* the child programs in ``tests/children/``: ``rank_env()`` puts the checkout and ``tests/``
  on their ``PYTHONPATH``.

It provides

* values: ``value_of(i, dims)``, the sample of index ``i`` in every process,
  ``TwoLineDataset``, the README's two-line pattern, and ``BatchedDataset``, its
  ``__getitems__`` recipe; ``fields_of(i)`` (a ``load`` for them) for a cache of several
  fields a sample; ``outcome``, ``bits`` and ``same``, how the fuzz tests compare results;
* sizes: ``budget_for``, the ``size_limit_gib`` that gives exactly ``n_slots`` slots (and
  staging slots); ``FIELDS_ROW``, the bytes of a packed row of ``FIELDS``;
* saved files: ``saved_cache`` and ``saved_file`` (a cache of ``SAVED_DIMS`` samples saved to
  a file, as ``tests/children/saved.py`` makes them);
* launchers: ``LAUNCHERS``, the variables of each launcher and the ``World`` they mean, and
  ``RAY_2_PLUS_1``, Ray Train's of an uneven placement;
* references: ``load_ref``, stocaching 0.2.1 imported beside the one under test;
* child processes: ``rank_env()`` (the environment torchrun gives a local rank), ``free_port()``,
  ``run_child``/``start_child`` for a program of ``tests/children/``,
  ``spawn_without_launcher`` (ranks of ``torch.multiprocessing.spawn`` as its tutorial runs
  them), and ``Child``, a job driven one command per line (``tests/children/job.py``); ``ranks_with_a_killed_writer`` (two ranks,
  one killed inside a write) and ``assert_the_killed_write_is_a_miss`` (what rank 0 then sees);
  ``racing_writers``, writer processes that overwrite a cache while a test reads it;
* trainers (``tests/children/lightning_train.py``, ``accelerate_train.py``):
  ``training_data(kind)``, a dataset of ``TRAIN_LEN`` samples with one cache (or a mixture of
  two) and its ``CacheAwareSampler`` (or a ``Prefetcher`` over it, whose loads
  ``RecordedLoad`` records); ``TrainRecord``, what a
  rank trained on, written as JSON; ``run_bounded``, a launcher run whose whole process group
  is killed past its timeout; ``assert_ended_well``, its exit checked, with the one abort of
  torch's gloo backend that follows a program's last line (see there);
* the copied layout: ``run_copied(folder, files, code)``, a program run beside modules of the
  package copied into a folder, as a user copies them;
* leak probes that read /proc: which names are left in a directory (``named``), who maps or
  holds a file of it (``mappers``, ``holders``, both: ``users``; ``mapped_segments``, which
  segments one process maps), and how much of a tmpfs is still in use (``used_bytes``).

The prefetcher's tests have a few more of their own, beside their child programs:
``tests/children/prefetch_common.py``, which takes its values and sizes from here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import re
import select
import shutil
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import psutil
import torch

from stocaching import SharedCache, World
from stocaching.stocaching import SEGMENT_PREFIX

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CHILDREN = TESTS / "children"
BYTES_PER_GIB = 1024**3

# ----------------------------------------------------------------------------------------------
# Values: a function of the index, the same in the test and in its children
# ----------------------------------------------------------------------------------------------


def value_of(i: int, dims=(3, 8, 8)) -> torch.Tensor:
    """The uint8 sample stored for index ``i``: indices below 251 never share one, none is all
    zeros, and any process can check what it reads."""
    n = math.prod(dims)
    return ((torch.arange(n) * 13 + i * 7 + 1) % 251).to(torch.uint8).reshape(dims)


class TwoLineDataset(torch.utils.data.Dataset):
    """The two-line pattern of the README over ``load`` (a module-level function of the index,
    so spawn workers can pickle it; default: ``value_of(i, cache.data_dims)``): items are
    ``(i, sample, hit)``, where hit says whether the cache had it."""

    def __init__(self, cache: SharedCache, n: int, load=None):
        self.cache, self.n, self.load = cache, n, load

    def __len__(self) -> int:
        return self.n

    def _load(self, i: int):
        return value_of(i, self.cache.data_dims) if self.load is None else self.load(i)

    def __getitem__(self, i: int):
        x = self.cache.get_slot(i)
        hit = x is not None
        if x is None:
            x = self._load(i)
            self.cache.set_slot(i, x)
        return i, x, hit


class BatchedDataset(TwoLineDataset):
    """The README's ``__getitems__`` recipe on top of ``TwoLineDataset``: a whole batch with one
    ``get_batch`` (a tensor, or a dict of them for a cache of fields), the misses loaded and
    stored one by one; items as ``TwoLineDataset``'s."""

    def __getitems__(self, indices):
        batch, hit = self.cache.get_batch(indices)
        fields = batch if isinstance(batch, dict) else {None: batch}
        for k in torch.nonzero(~hit).flatten().tolist():
            x = self._load(indices[k])
            self.cache.set_slot(indices[k], x)
            for name, b in fields.items():
                b[k] = x if name is None else x[name]
        return [(i, batch[k] if None in fields else {n: b[k] for n, b in fields.items()},
                 bool(hit[k])) for k, i in enumerate(indices)]


def outcome(fn):
    """``("ok", result)`` of ``fn()``, or ``("err", type of the exception)``: what the fuzz
    tests compare between the cache and their models."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return "err", type(e)


def bits(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` (a 0-dim tensor too)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a, b) -> bool:
    """Equal as the fuzz tests mean it: tensors of the same dtype, shape and bits (so NaNs
    compare), tuples (``get_batch``'s) and dicts (samples of fields) item by item, or both
    None."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    return a is None and b is None


FIELDS = {"image": (3, 8, 8), "label": (), "box": (4,)}
FIELD_DTYPES = {"image": torch.uint8, "label": torch.int64, "box": torch.float32}
FIELDS_ROW = 216  # image 192 B at 0, label 8 B at 192, box 16 B at 200 (tests/test_fields.py)


def fields_of(i: int, dims=FIELDS) -> dict:
    """The sample of index ``i`` in a cache of the fields ``FIELDS``: an image, a label and a
    box that all depend on ``i`` (so a row of another index, or a mix, is caught)."""
    return {"image": value_of(i, dims["image"]), "label": torch.tensor(i * 1000 + 7),
            "box": torch.arange(4, dtype=torch.float32) + i / 4}


def budget_for(n_slots: int, dims, dtype: torch.dtype = torch.uint8, *, dataset_len: int,
               staging: int = 0) -> float:
    """A ``size_limit_gib`` that gives exactly ``n_slots`` slots (``n_slots < dataset_len``)
    after ``staging`` staging slots (which are paid first).

    0.2.1's sizing rule: the budget covers the slots and one aux byte per sample of the dataset,
    so the dataset's length is part of the answer. Half a byte more keeps the float division
    from rounding down to one slot less."""
    slot_bytes = math.prod(dims) * dtype.itemsize
    return ((n_slots + staging) * slot_bytes + dataset_len + 0.5) / BYTES_PER_GIB


def rerun(shm_dir: str, job_key: str, name: str, n: int, d: int, local_world_size: int) -> None:
    """Run the same job again, right away, in this process: the leader and (if any) the other
    local rank construct, one writes, the other reads everything back, both close."""
    worlds = [World(rank=r, world_size=local_world_size, local_rank=r,
                    local_world_size=local_world_size) for r in range(local_world_size)]
    caches = [SharedCache(1, n, (d,), name=name, job_key=job_key, world=w, shm_dir=shm_dir,
                          timeout=60) for w in worlds]
    try:
        for i in range(n):
            caches[0].set_slot(i, value_of(i, (d,)))
        for i in range(n):
            got = caches[-1].get_slot(i)
            assert got is not None and torch.equal(got, value_of(i, (d,))), f"rerun: index {i}"
    finally:
        for c in caches:
            c.close()


# ----------------------------------------------------------------------------------------------
# Saved files: a cache saved to a file, as tests/children/saved.py makes them too
# ----------------------------------------------------------------------------------------------

SAVED_DIMS = (4, 32, 32)  # 4 KiB a sample


def saved_cache(shm_dir, path, n=64, **kw):
    args = dict(size_limit_gib=n * 4200 / 2**30, dataset_len=n, data_dims=SAVED_DIMS,
                name="saved", load_from=path, key="k1", shm_dir=shm_dir)
    args.update(kw)
    return SharedCache(**args)


def saved_file(shm_dir, tmp_path) -> str:
    path = str(tmp_path / "c.stc")
    with saved_cache(shm_dir, path) as c:
        for i in range(0, 64, 2):
            c.set_slot(i, value_of(i, SAVED_DIMS))
        c.save(path)
    return path


# ----------------------------------------------------------------------------------------------
# References: what a result is checked against
# ----------------------------------------------------------------------------------------------


def load_ref(ref_dir: str):
    """Import the stocaching installed in ``ref_dir`` (``pip install --target ref_dir
    stocaching==0.2.1``) as the module ``stocaching_ref``, beside the stocaching under test."""
    spec = importlib.util.spec_from_file_location(
        "stocaching_ref", os.path.join(ref_dir, "stocaching", "__init__.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------
# Leak probes
# ----------------------------------------------------------------------------------------------


def named(shm_dir: str) -> list[str]:
    """Names in ``shm_dir`` that carry the stocaching prefix."""
    return sorted(n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX))


_MEMFD = "/memfd:"  # how /proc names a file made by memfd_create


def _mapped(shm_dir: str, pid: int | str, start: str = "") -> list[list[str]]:
    """The lines of ``/proc/<pid>/maps`` that map a file of ``shm_dir`` whose name begins
    with ``start`` (named or already unlinked), split into their six fields; none if ``pid`` is
    gone. The one reader of /proc/*/maps. An anonymous segment (``size_limit_gib="auto"``)
    counts as a file of the directory it is named after: its line reads "/memfd:<path>"."""
    prefix = os.path.realpath(shm_dir) + "/" + start
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = [ln.split(maxsplit=5) for ln in f]
    except OSError:
        return []
    return [ln for ln in lines if len(ln) == 6 and
            ln[5].removeprefix(_MEMFD).startswith(prefix)]


def mappers(shm_dir: str) -> dict[int, list[str]]:
    """Processes that map a file of ``shm_dir`` (named or already unlinked), from /proc."""
    out: dict[int, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        hits = sorted({ln[5].strip() for ln in _mapped(shm_dir, pid)})
        if hits:
            out[int(pid)] = hits
    return out


def mapped_segments(shm_dir: str, pid: int | str = "self") -> set[tuple[str, str]]:
    """(device, inode) of every stocaching file of ``shm_dir`` that process ``pid`` maps."""
    return {(ln[3], ln[4]) for ln in _mapped(shm_dir, pid, SEGMENT_PREFIX)}


def holders(shm_dir: str) -> dict[int, list[str]]:
    """Processes with an open descriptor on a file of ``shm_dir``, from /proc/*/fd."""
    prefix = os.path.realpath(shm_dir) + "/"
    out: dict[int, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.removeprefix(_MEMFD).startswith(prefix):
                out.setdefault(int(pid), []).append(target)
    return out


def users(shm_dir: str) -> dict[int, list[str]]:
    """Processes that map, or hold a descriptor on, a file of ``shm_dir``: ``mappers`` and
    ``holders`` together."""
    found: dict[int, set[str]] = {}
    for probe in (mappers, holders):
        for pid, names in probe(shm_dir).items():
            found.setdefault(pid, set()).update(names)
    return {pid: sorted(names) for pid, names in found.items()}


def used_bytes(shm_dir: str) -> int:
    """Bytes in use on the tmpfs: files still named *and* unlinked files someone still holds."""
    st = os.statvfs(shm_dir)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def wait_until_unmapped(shm_dir: str, *, within: float = 60.0) -> dict:
    """Wait until no process maps or holds a file of ``shm_dir`` (processes that were just
    killed, and DataLoader workers noticing their parent is gone, take a moment); return what
    is still mapped and held. ``within`` is a ceiling for a hang, not a time anything takes."""
    deadline = time.monotonic() + within
    while True:
        state = {"mapped by": mappers(shm_dir), "held by": holders(shm_dir)}
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def assert_no_leak(shm_dir: str, *, within: float = 60.0) -> None:
    """Nothing named, mapped or held in ``shm_dir`` and its memory returned, waiting up to
    ``within`` s for processes that are still exiting."""
    deadline = time.monotonic() + within
    while True:
        state = {"named": named(shm_dir), "mapped by": mappers(shm_dir),
                 "held by": holders(shm_dir), "bytes used": used_bytes(shm_dir)}
        if not any(state.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leak in {shm_dir}: {state}")
        time.sleep(0.05)


def age(paths, seconds: float = 10.0) -> None:
    """Make files look ``seconds`` old: ``clean_segments`` leaves files younger than 2 s alone
    (a leader may be creating them), so this stands for the time a relaunch takes."""
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t), follow_symlinks=False)


# ----------------------------------------------------------------------------------------------
# Launchers: the variables each sets, and the World they mean
# ----------------------------------------------------------------------------------------------

LAUNCHERS = {
    # name: (variables as the launcher sets them, the World they mean)
    "torchrun, 2 nodes": (dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                               GROUP_RANK="1", GROUP_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x"),
                          World(rank=3, world_size=4, local_rank=1, local_world_size=2,
                                node_rank=1, num_nodes=2)),
    "accelerate launch (torchrun's variables)": (
        dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
             ACCELERATE_MIXED_PRECISION="no"),
        World(rank=1, world_size=2, local_rank=1, local_world_size=2)),
    "srun": (dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NODEID="1",
                  SLURM_NNODES="2", SLURM_JOB_ID="77"),
             World(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
                   num_nodes=2)),
    "Lightning (LOCAL_RANK, NODE_RANK, WORLD_SIZE; no RANK)": (
        dict(LOCAL_RANK="1", NODE_RANK="0", WORLD_SIZE="2"),
        World(rank=1, world_size=2, local_rank=1, local_world_size=2)),
    "none": ({}, World()),
}

# What Ray Train 2.60 set in three workers it placed 2 + 1 on two Ray nodes
# (tests/test_ray.py's test_ray_places_three_workers_2_plus_1_... records it again on every
# run), by world rank.
RAY_2_PLUS_1 = {
    0: dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", NODE_RANK="0"),
    1: dict(RANK="1", WORLD_SIZE="3", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", NODE_RANK="0"),
    2: dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK="1"),
}


# ----------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------

_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "SLURM_PROCID", "MASTER_PORT", "MASTER_ADDR",
                   "STOCACHING_JOB_KEY")


# What torchrun, srun and friends set, which a rank reads to find its place.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "GROUP_WORLD_SIZE", "NODE_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def spawn_without_launcher(fn, args: tuple, nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn`` of ``fn`` as PyTorch's DDP tutorial runs it: no
    launcher's variables in the environment (the test's own are dropped first)."""
    import torch.multiprocessing
    for var in _LAUNCHER_VARIABLES:
        os.environ.pop(var, None)
    torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(shm_dir: str | None = None, job_key: str | None = None, *, rank: int | None = None,
             world_size: int = 2, port: int | None = None, **extra) -> dict[str, str]:
    """The environment of a child process: torchrun's variables for local rank ``rank`` of a
    one-node job of ``world_size`` ranks when ``rank`` is given (else none: a single-process
    job, or torchrun sets them), the job key and segment directory when given, the checkout and
    ``tests/`` on the path, one OpenMP thread, unbuffered output, tracebacks on a crash, and
    ``extra`` variables."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(TESTS),
                                                        env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if shm_dir is not None:
        env["STOCACHING_SHM_DIR"] = shm_dir
    if job_key is not None:
        env["STOCACHING_JOB_KEY"] = job_key
    if rank is not None:
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port if port is not None else free_port()))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def ranks_with_a_killed_writer(children, shm_dir: str, job_key: str, idx: int, *,
                               late: bool = False, write_first: bool = True, sig: int = 9,
                               **env: str):
    """Two local ranks of tests/children/job.py (``children`` is the fixture) make one cache;
    both write their share first (unless ``write_first`` is False); then rank 1 stops inside
    its write of ``idx`` (mid-copy, or with ``late`` between setting the state and the even
    sequence number) and is killed by ``sig``. Returns rank 0's child, still running."""
    port = free_port()
    lead = children("rank0", rank_env(shm_dir, job_key, rank=0, port=port, **env))
    other = children("rank1", rank_env(shm_dir, job_key, rank=1, port=port, **env))
    for c in (lead, other):
        c.send("create")
    for c in (lead, other):
        c.expect("ATTACHED")
    if write_first:
        for c in (lead, other):
            c.send("write")
        for c in (lead, other):
            c.expect("WROTE")
    other.send(f"{'writehang_late' if late else 'writehang'} {idx}")
    other.expect("INSIDE")
    other.signal(sig)
    assert other.wait() == -sig
    return lead


def assert_the_killed_write_is_a_miss(lead, n: int, probes=("check",)) -> None:
    """After ``ranks_with_a_killed_writer`` of index ``n - 1`` (its other indices written):
    each probe of rank 0 (``check``: get_slot of every index, ``batch``: get_batch) sees that
    index as the one miss; ``fill`` writes it again; then each probe hits all ``n``; rank 0
    exits cleanly."""
    for probe in probes:
        lead.send(probe)
        assert lead.expect(probe.upper()).split()[1:] == [str(n - 1), "1", "0", str(n - 1)]
    lead.send("fill")
    assert lead.expect("FILLED").split()[2:] == [str(n - 1)]
    for probe in probes:
        lead.send(probe)
        assert lead.expect(probe.upper()).split()[1:] == [str(n), "0", "0"]
    lead.send("exit")
    assert lead.wait() == 0


@contextlib.contextmanager
def racing_writers(target, cache: SharedCache, method: str = "fork", count: int = 2):
    """Run the block while ``count`` processes (started with ``method``) run
    ``target(cache, k, writing, stop)``: it starts once each has set its ``writing`` event;
    afterwards ``stop`` is set, each is joined (killed if still running after 60 s, a hang)
    and must have exited with 0."""
    ctx = mp.get_context(method)
    stop, writing = ctx.Event(), [ctx.Event() for _ in range(count)]
    procs = [ctx.Process(target=target, args=(cache, k, writing[k], stop)) for k in range(count)]
    for p in procs:
        p.start()
    try:
        assert all(e.wait(120) for e in writing), "a writer did not start within 120 s"
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * count


# ----------------------------------------------------------------------------------------------
# Trainers: what each rank trains on
# ----------------------------------------------------------------------------------------------

TRAIN_LEN, TRAIN_BATCH, TRAIN_EPOCHS = 200, 5, 2
_MIX_LENGTHS = (120, 80)


class WithIndex(torch.utils.data.Dataset):
    """Items ``(i, sample)`` of a dataset whose items are ``(j, sample, hit)``, ``i`` the index
    asked for (a ``MixtureDataset``'s items carry the index in the sub-dataset)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return i, self.dataset[i][1]


class RecordedLoad:
    """``value_of`` as a prefetcher's ``load`` (in its threads), recording the indices."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __call__(self, i: int) -> torch.Tensor:
        self.indices.append(int(i))
        return value_of(i)


#: The training_data kinds with a Prefetcher, and its window.
PREFETCH_KINDS = {"prefetch": None, "prefetch window": 2 * TRAIN_BATCH, "random prefetch": None}


def training_data(kind: str, *, for_accelerate: bool = False):
    """``(dataset, sampler, plan)`` for a trainer's loader, made on every rank once the ranks
    can find each other; ``plan`` is the ``CacheAwareSampler`` whose ``epoch_indices`` say
    what this rank should train on (None where no sampler plans per rank). ``kind``:
    ``"cache"``, one cache of a third of ``TRAIN_LEN`` samples; ``"prefetch"``, the same (a
    cache of its own) with a ``Prefetcher`` (2 threads, loads recorded by a ``RecordedLoad``)
    over the sampler, ``sampler.for_accelerate()`` with ``for_accelerate``; ``"prefetch
    window"``, the same with a window of two batches (over a cache of a random subset, as the
    docs make it for a window); ``"random prefetch"``, a
    ``Prefetcher`` over a ``RandomSampler`` (no plan); ``"mixture"``, two sub-datasets with a
    cache each, mixed by a ``WeightedMixtureSampler`` with its default weights (every sample
    once an epoch) that a ``CacheAwareSampler`` routes; ``"bare mixture"``, the same with the
    ``WeightedMixtureSampler`` alone. Otherwise the sampler is the plan itself, or with
    ``for_accelerate`` its ``for_accelerate()``."""
    from stocaching import CacheAwareSampler, MixtureDataset, Prefetcher, WeightedMixtureSampler
    dims = (3, 8, 8)
    if kind == "cache" or kind in PREFETCH_KINDS:
        n = TRAIN_LEN
        name = "train" if kind == "cache" else kind.replace(" ", "-")
        # (with a window, the documented cache: a random subset, not the first indices)
        ds = TwoLineDataset(SharedCache(budget_for(n // 3, dims, dataset_len=n), n, dims,
                                       name=name, timeout=60,
                                       random_subset=bool(PREFETCH_KINDS.get(kind))), n)
        if kind == "random prefetch":
            base, plan = torch.utils.data.RandomSampler(ds), None
        else:
            plan = CacheAwareSampler(ds, batch_size=TRAIN_BATCH, seed=1)
            base = plan.for_accelerate() if for_accelerate else plan
        if kind in PREFETCH_KINDS:
            return WithIndex(ds), Prefetcher(base, ds.cache, RecordedLoad(), threads=2,
                                             window=PREFETCH_KINDS[kind]), plan
        return WithIndex(ds), base, plan
    if kind in ("mixture", "bare mixture"):
        parts = [TwoLineDataset(SharedCache(budget_for(n // 2, dims, dataset_len=n), n, dims,
                                           name=f"mix{k}", timeout=60), n)
                 for k, n in enumerate(_MIX_LENGTHS)]
        mix = MixtureDataset(parts)
        order = WeightedMixtureSampler(mix, seed=2)
        if kind == "bare mixture":
            return WithIndex(mix), order, None
        plan = CacheAwareSampler(mix, batch_size=TRAIN_BATCH, order=order)
        return WithIndex(mix), plan.for_accelerate() if for_accelerate else plan, plan
    raise ValueError(f"kind should be 'cache', 'prefetch', 'prefetch window', 'random "
                     f"prefetch', 'mixture' or 'bare mixture', but got kind={kind!r}")


def loaded_by_prefetchers(samplers: dict) -> dict[str, list[int]]:
    """By kind, the indices that the prefetcher of each sampler (the sampler, or the one
    inside Lightning's wrapper) loaded, for those that have one."""
    out = {}
    for kind, sampler in samplers.items():
        inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's
        for s in (sampler, inner):
            if isinstance(getattr(s, "load", None), RecordedLoad):
                out[kind] = sorted(s.load.indices)
    return out


class TrainRecord:
    """What one rank trained on from each of its loaders (by kind) epoch by epoch, the
    stocaching segments it saw while training (at each kind's first batch, together), and the
    warnings raised in it that speak of a sampler or a cache (the trainers' other advice, such
    as Lightning's about DataLoader workers, is left out); ``write`` saves it as
    ``<out>/rank<r>.json``."""

    def __init__(self) -> None:
        self.epochs: dict[str, dict[int, list[int]]] = {}
        self.segments: dict[str, int] | None = None
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def batch(self, kind: str, epoch: int, indices) -> None:
        if kind not in self.epochs:  # every local rank has the kind's caches by its first batch
            from stocaching import list_segments
            shm = os.environ.get("STOCACHING_SHM_DIR", "/dev/shm")
            names = [os.path.basename(s["path"]).split("_n0_")[-1] for s in list_segments(shm)]
            seen = self.segments or {}  # (loaders trained one after another: the union)
            for n in set(names):
                seen[n] = max(seen.get(n, 0), names.count(n))
            self.segments = dict(sorted(seen.items()))
        self.epochs.setdefault(kind, {}).setdefault(epoch, []).extend(int(i) for i in indices)

    def write(self, out: str, rank: int, **extra) -> None:
        self._catcher.__exit__(None, None, None)
        ours = [f"{w.category.__name__}: {w.message}" for w in self._caught
                if any(word in str(w.message).lower() for word in ("stocaching", "sampler",
                                                                   "cache"))]
        epochs = {kind: [got.get(e, []) for e in range(TRAIN_EPOCHS)]
                  for kind, got in self.epochs.items()}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "epochs": epochs, "segments": self.segments,
                       "warnings": ours, **extra}, f)


def read_records(out: str, ranks: int = 2) -> list[dict]:
    records = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            records.append(json.load(f))
    return records


def run_bounded(cmd: list[str], *, env: dict[str, str], timeout: float,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own and return its outcome; past ``timeout`` seconds
    kill it and every process below it and fail with the tail of its output. Below it, not
    only its process group: torchrun starts each rank in a session of its own, so killing the
    launcher's group left a hung rank holding the output pipes, and this wait with it. The
    kill is a SIGABRT first: with ``rank_env``'s PYTHONFAULTHANDLER each process then prints
    where every thread of it waited, which is what a hang in CI needs."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = _process_tree(p.pid)
        _signal_all(tree, signal.SIGABRT)
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_all(tree, signal.SIGKILL)
            out, err = p.communicate()
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s (hung?) and was killed; "
                             f"stdout: {out[-2000:]}\nstderr: {err[-12000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # ranks left behind by a launcher that exited
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# torch's gloo backend can abort a DDP program after its last line (pytorch/pytorch#190489,
# open): each backward stashes the autograd context in the thread's state, the gradient
# all-reduces launched in it keep a copy, and a gloo worker thread frees the last one just
# after completing it. When the main thread reaches the interpreter's finalization first (the
# worker descheduled on a busy machine), that free needs the GIL, CPython (3.11 to 3.13) ends
# the thread with pthread_exit, and unwinding it through a noexcept destructor calls
# std::terminate. Seen in 1 of 12 runs of docs/distributed.md's torchrun example on this 2-core
# machine (core dump: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState ->
# SafePyObject decref -> take_gil -> pthread_exit, the main thread in Py_FinalizeEx's gc), and in
# the same loop with a plain Dataset and DistributedSampler. Nothing a Python program can do
# waits for that thread (destroy_process_group leaves gloo's threads running), so the checks of
# a DDP program's exit accept this one abort, recognised as is_torch_gloo_exit_abort says.
TORCH_GLOO_EXIT_ABORT = ("terminate called without an active exception",
                         "Fatal Python error: Aborted")


def is_torch_gloo_exit_abort(r: subprocess.CompletedProcess) -> bool:
    """Whether ``r`` ended by the abort above and nothing else: libstdc++'s and faulthandler's
    messages (the second needs PYTHONFAULTHANDLER, which ``rank_env`` sets), no Python frame
    in any thread of the dump (the rank had run its last line), no traceback but the
    launcher's own (torchrun's ChildFailedError, or torch.multiprocessing's report of a
    process killed by SIGABRT, which Lightning's ddp_spawn raises from ``fit()``), and no rank
    that exited but by SIGABRT or torchrun's SIGTERM (without torchrun, the process itself
    by SIGABRT or, under a spawning launcher, with that report)."""
    err = r.stderr
    if not all(mark in err for mark in TORCH_GLOO_EXIT_ABORT):
        return False
    dumps = [d.split("Extension modules", 1)[0] for d in err.split(TORCH_GLOO_EXIT_ABORT[1])[1:]]
    if any("<no Python frame>" not in d or 'File "' in d for d in dumps):
        return False
    spawned = re.findall(r"^\S*ProcessExitedException: process \d+ terminated with signal "
                         r"SIGABRT *$", err, re.M)
    launcher_errors = re.findall(r"^\S*ChildFailedError: *$", err, re.M) + spawned
    if err.count("Traceback (most recent call last)") != len(launcher_errors):
        return False
    exits = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    if exits:
        return set(exits) <= {"-6", "-15"} and "-6" in exits
    return r.returncode == (1 if spawned else -6)


def assert_ended_well(r: subprocess.CompletedProcess) -> None:
    """``r`` exited with 0, or (a DDP program on gloo) with torch's abort after its last line,
    which says nothing of the program (see ``TORCH_GLOO_EXIT_ABORT``): the caller's checks of
    what the ranks did and left still apply."""
    if r.returncode != 0 and is_torch_gloo_exit_abort(r):
        warnings.warn("torch's gloo backend aborted a rank after the program's last line "
                      "(pytorch/pytorch#190489); its other checks apply", stacklevel=2)
        return
    assert r.returncode == 0, r.stderr[-4000:]


def _process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants, whatever their session (psutil
    processes, which check their start time before a signal: no pid reused by then is hit)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    return []


def _signal_all(processes: list[psutil.Process], signum: int) -> None:
    for q in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.send_signal(signum)


def _command(program: str, args) -> list[str]:
    return [sys.executable, str(CHILDREN / program), *map(str, args)]


def run_child(program: str, *args, env: dict[str, str] | None = None, timeout: float = 120,
              **kwargs) -> subprocess.CompletedProcess:
    """Run ``tests/children/<program>`` with ``args`` to its end; text output captured."""
    return subprocess.run(_command(program, args), env=rank_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def start_child(program: str, *args, env: dict[str, str] | None = None,
                **kwargs) -> subprocess.Popen:
    """Start ``tests/children/<program>`` with ``args``; text pipes as ``kwargs`` ask."""
    return subprocess.Popen(_command(program, args), env=rank_env() if env is None else env,
                            text=True, **kwargs)


class Child:
    """A ``tests/children/job.py`` process: commands go to its stdin, its stdout lines are
    collected by a thread. It leads its own session (so its DataLoader workers can be killed
    with it)."""

    def __init__(self, env: dict[str, str], log: Path, label: str) -> None:
        self.label = label
        self.log = log
        self._err = open(log, "wb")
        self.p = start_child("job.py", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=self._err, cwd=log.parent, bufsize=1,
                             start_new_session=True)
        self.pid = self.p.pid
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """The next stdout line starting with ``prefix`` (others are kept in ``lines``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.dump_stacks()
                raise AssertionError(f"{self.label}: no {prefix!r} within {timeout} s; stdout "
                                     f"{self.lines}; stderr:\n{self.stderr()}") from None
            if line is None:
                self._q.put(None)
                raise AssertionError(f"{self.label}: exited (rc={self.p.poll()}) before "
                                     f"{prefix!r}; stdout {self.lines}; stderr:\n"
                                     f"{self.stderr()}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line
            if line.startswith("NOREADY"):
                raise AssertionError(f"{self.label}: a worker waited 60 s for iter(loader) to "
                                     f"return; stdout {self.lines}")

    def dump_stacks(self) -> None:
        """Ask a stuck child for the Python stack of every thread (to its stderr, via
        faulthandler), so that a hang reports where it hangs."""
        if self.p.poll() is None:  # the child and its DataLoader workers (its session)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGUSR1)
            time.sleep(0.5)

    def send(self, command: str) -> None:
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()

    def wait(self, timeout: float = 60.0) -> int:
        """Return code; a child still running after ``timeout`` s is a hang: fail."""
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill_group()
            raise AssertionError(f"{self.label} hung: still running {timeout} s later; stdout "
                                 f"{self.lines}; stderr:\n{self.stderr()}") from None

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the session this child leads (it and the DataLoader workers it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.p.wait(5)

    def close(self) -> None:
        self.kill_group()  # also when it has exited: its workers may outlive it for a moment
        for s in (self.p.stdin, self.p.stdout):
            with contextlib.suppress(Exception):
                s.close()
        self._err.close()


def wait_exit(pid: int, bound: float) -> bool:
    """Wait until process ``pid`` (not necessarily our child) has ended: a pidfd becomes
    readable then. True if it ended within ``bound`` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], bound)[0])
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# Where users run: a memory cgroup (a container's --memory), a small /dev/shm (docker's 64 MiB)
# ----------------------------------------------------------------------------------------------


def _writable_memory_hierarchy() -> tuple[int, str] | None:
    """(version, directory) of a memory cgroup hierarchy where a new cgroup can be made here
    (as root): v1's memory mount, or a v2 mount whose root hands the memory controller down."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3]
            point = fields[4]
            if fstype == "cgroup" and "memory" in options.split(","):
                found = (1, point)
            elif fstype == "cgroup2":
                with contextlib.suppress(OSError):
                    with open(os.path.join(point, "cgroup.subtree_control")) as s:
                        if "memory" not in s.read().split():
                            continue
                found = (2, point)
            else:
                continue
            if os.access(found[1], os.W_OK):
                return found
    return None


class MemoryCgroup:
    """A fresh memory cgroup limited to ``limit`` bytes, for child processes started with
    ``preexec_fn=cgroup.enter`` (they and their children are charged to it); removed by
    ``remove``. ``oom_kills`` reads the kernel's count of kills in it."""

    def __init__(self, limit: int) -> None:
        found = _writable_memory_hierarchy()
        if found is None:
            raise OSError("no writable memory cgroup hierarchy (cgroup v1 memory, or v2 with "
                          "the memory controller) here")
        self.version, root = found
        self.path = os.path.join(root, f"stocaching-test-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(self.path)
        limit_file = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        with open(os.path.join(self.path, limit_file), "w") as f:
            f.write(str(limit))
        if self.version == 2:  # no swap: tmpfs pages stay in memory, as in most containers
            with contextlib.suppress(OSError), \
                    open(os.path.join(self.path, "memory.swap.max"), "w") as f:
                f.write("0")

    def enter(self) -> None:
        """preexec_fn of a child: move the calling process into the cgroup."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with open(os.path.join(self.path, name)) as f:
            counts = dict(line.split() for line in f if line.strip())
        return int(counts.get("oom_kill", 0))

    def remove(self) -> None:
        for _ in range(50):  # a child's last exit may still be accounted for
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def small_shm_command(size_mib: int, argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own where /dev/shm is a fresh tmpfs of
    ``size_mib`` MiB (docker's default is 64), as a container sees it; the machine's /dev/shm
    is untouched. Needs root (or CAP_SYS_ADMIN) and util-linux's unshare."""
    script = f'mount -t tmpfs -o size={size_mib}m,mode=1777 tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def run_container_child(spec: dict, *, cgroup: MemoryCgroup | None = None,
                        shm_mib: int | None = None, env: dict[str, str] | None = None,
                        timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``tests/children/container.py`` with ``spec`` inside ``cgroup`` and/or with a
    /dev/shm of ``shm_mib`` MiB; returns the process and the JSON lines it printed."""
    argv = _command("container.py", [json.dumps(spec)])
    if shm_mib is not None:
        argv = small_shm_command(shm_mib, argv)
    r = subprocess.run(argv, env=rank_env() if env is None else env, capture_output=True,
                       text=True, timeout=timeout,
                       preexec_fn=None if cgroup is None else cgroup.enter)
    said = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return r, said


def run_copied(folder: Path, files: tuple[str, ...], code: str) -> str:
    """What ``code`` (dedented) prints, run by a fresh interpreter in ``folder`` beside
    ``files`` of the package (``stocaching/<file>``) copied into it, as a user copies them,
    with the package off the path (the environment is this one's, so /dev/shm is the test's);
    asserts that it exits 0."""
    for name in files:
        shutil.copy(REPO / "stocaching" / name, folder / name)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=folder,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    return r.stdout
