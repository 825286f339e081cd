"""DeviceLoader (stocaching/device.py): batches gathered from the segment by the training
process. The machines that run this suite have no GPU: every test here walks the CPU path
(which shares the batching, staging, misses, resume and DDP code with the CUDA path); the CUDA
tests at the end run where CUDA is present and are skipped otherwise, and there the tests that
name no device run on the GPU (the loader's default). The read that a GPU
makes (locate, copy the rows elsewhere, confirm) is tested here with a numpy copy standing in
for the GPU's, racing real writer processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler

from _helpers import CHILDREN, FIELD_DTYPES, FIELDS, budget_for, fields_of, free_port, racing_writers, \
    rank_env, run_child, value_of
from stocaching import (CacheAwareSampler, DeviceLoader, OpenSizeCache, SharedCache,
                        WeightedMixtureSampler, World)

DIMS = (3, 8, 8)
N = 50


def load(i: int) -> torch.Tensor:
    return value_of(i, DIMS)


@pytest.fixture
def cache(shm_dir):
    """Half of N with a slot, the rest staged: every path of a batch's rows."""
    c = SharedCache(budget_for(N // 2 + 40, DIMS, dataset_len=N), N, DIMS, staging_slots=40,
                    shm_dir=shm_dir)
    yield c
    c.close()


def seeded(n: int = N, seed: int = 0) -> RandomSampler:
    return RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))


def read_epoch(loader: DeviceLoader) -> list[int]:
    seen = []
    for batch, idx in loader:
        assert batch.dtype == torch.uint8 and batch.shape == (len(idx), *DIMS)
        for row, i in zip(batch.cpu(), idx.tolist()):
            assert torch.equal(row, load(i)), f"row of index {i}"
        seen += idx.tolist()
    return seen


def test_every_index_once_per_epoch_rows_equal_get_slot(cache):
    with DeviceLoader(cache, seeded(), load, batch_size=8, device="cpu", threads=4) as loader:
        assert loader.path == "cpu" and len(loader) == 7
        orders = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            seen = read_epoch(loader)
            assert sorted(seen) == list(range(N))
            orders.append(seen)
            assert cache.stats()["staged"] == 0  # every staged sample was gathered and freed
        assert orders[0] != orders[1]
        for i in range(N // 2):  # the slots were filled, and hold what get_slot gives
            assert torch.equal(cache.get_slot(i), load(i))
        stats = cache.stats()
        assert stats["misses"] == 0 and stats["staged_hits"] == 3 * (N - len(cache))


def test_drop_last_and_len(cache):
    loader = DeviceLoader(cache, SequentialSampler(range(N)), load, batch_size=8,
                          drop_last=True, device="cpu")
    seen = read_epoch(loader)
    assert len(loader) == 6 and seen == list(range(48))
    loader.close()
    with pytest.raises(ValueError, match="closed"):
        iter(loader).__next__()


def test_a_cache_of_fields(shm_dir):
    c = SharedCache(1e-3, N, FIELDS, dtype=FIELD_DTYPES, shm_dir=shm_dir)
    with DeviceLoader(c, seeded(), fields_of, batch_size=7, device="cpu") as loader:
        for _ in range(2):
            seen = []
            for batch, idx in loader:
                assert set(batch) == set(FIELDS)
                for k, i in enumerate(idx.tolist()):
                    for name, want in fields_of(i).items():
                        assert torch.equal(batch[name][k], want), (name, i)
                seen += idx.tolist()
            assert sorted(seen) == list(range(N))
    c.close()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_a_large_block_is_copied_by_two_threads_and_equals_get_slot(shm_dir, dtype):
    """On a CPU, a block of 4 MiB or more (here 2 batches of 16 x (3, 128, 128)) is copied
    in two halves, one by a second thread: every row is still its index's sample, in order,
    once an epoch; and the first epoch, which loads, is whole too."""
    dims, n = (3, 128, 128), 96
    c = SharedCache(budget_for(n, dims, dataset_len=n, dtype=dtype), n, dims, dtype=dtype,
                    shm_dir=shm_dir)

    def big(i: int) -> torch.Tensor:
        return value_of(i, dims).to(dtype)

    with DeviceLoader(c, seeded(n), big, batch_size=16, device="cpu") as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            seen = []
            for batch, idx in loader:
                assert batch.dtype == dtype and batch.is_contiguous()
                for row, i in zip(batch, idx.tolist()):
                    assert torch.equal(row, big(i)), f"row of index {i}"
                seen += idx.tolist()
            assert sorted(seen) == list(range(n))
        assert loader._gather.helper is not None  # (white-box: the split ran)
    c.close()


def test_a_transform_runs_on_each_batch(cache):
    def flip(batch):
        return batch.flip(-1)

    with DeviceLoader(cache, seeded(), load, batch_size=10, transform=flip) as loader:
        for batch, idx in loader:
            for row, i in zip(batch.cpu(), idx.tolist()):
                assert torch.equal(row, load(i).flip(-1))


def test_misses_without_staging_are_loaded_by_the_loader(shm_dir):
    c = SharedCache(budget_for(10, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir)
    with DeviceLoader(c, seeded(), load, batch_size=8, threads=2) as loader:
        assert sorted(read_epoch(loader)) == list(range(N))
        assert sorted(read_epoch(loader)) == list(range(N))
    assert c.stats()["filled"] == 10
    c.close()


class Cached(torch.utils.data.Dataset):
    """What CacheAwareSampler asks of a dataset: its length and its cache."""

    def __init__(self, cache: SharedCache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return self.cache.dataset_len


@pytest.mark.parametrize("sampler_kind", ["cache_aware", "mixture"])
def test_the_package_samplers(cache, sampler_kind):
    if sampler_kind == "cache_aware":
        sampler = CacheAwareSampler(Cached(cache), batch_size=8, seed=1, num_replicas=1, rank=0)
    else:
        sampler = WeightedMixtureSampler([range(N // 2), range(N - N // 2)], weights=[1, 1],
                                         seed=1, num_replicas=1, rank=0)
    with DeviceLoader(cache, sampler, load, batch_size=8, window=8) as loader:
        seen = read_epoch(loader)
        assert len(seen) == len(sampler)
        if sampler_kind == "cache_aware":
            assert sorted(seen) == list(range(N))


def test_an_unseeded_sampler_warns_at_the_callers_save(cache):
    # Its order comes from torch's global generator: a mid-epoch state will be refused. The
    # warning names the line that called the loader's state_dict, not stocaching's own.
    with DeviceLoader(cache, RandomSampler(range(N)), load, batch_size=6, threads=2) as loader:
        it = iter(loader)
        next(it)
        with pytest.warns(UserWarning, match=r"cannot resume the epoch: the base sampler "
                                             r"\(RandomSampler\) has no generator") as got:
            loader.state_dict()
        assert got[0].filename == __file__
        it.close()


@pytest.mark.parametrize("saved", ["in_the_loop", "after_leaving_it"])
def test_a_resume_continues_the_epoch_exactly(cache, saved):
    """The state is the position of the batches handed out, not of those gathered ahead,
    also once the loop was left (the loader's thread had gathered more by then)."""
    first = DeviceLoader(cache, seeded(seed=5), load, batch_size=6, threads=2)
    first.set_epoch(1)
    it, got = iter(first), []
    for _ in range(3):
        got += next(it)[1].tolist()
    if saved == "in_the_loop":
        state = first.state_dict()
    it.close()
    if saved == "after_leaving_it":
        state = first.state_dict()
    first.close()
    again = DeviceLoader(cache, seeded(seed=5), load, batch_size=6, threads=2)
    again.load_state_dict(state)
    again.set_epoch(1)
    rest = read_epoch(again)
    full = DeviceLoader(cache, seeded(seed=5), load, batch_size=6, threads=2)
    full.set_epoch(1)
    assert got + rest == read_epoch(full)
    again.close()
    full.close()


@pytest.mark.parametrize("window", [None, 6])
def test_the_epochs_after_a_resumed_one_are_an_uninterrupted_runs(cache, window):
    """Over a RandomSampler whose epoch k is its seeded generator's k-th draw: stopped after 3
    batches of epoch 1, resumed in a new loader and sampler, epochs 1 and 2 are the
    uninterrupted run's."""
    for i in range(N):  # ready at each epoch's start: the same in every run, and so the order
        cache.set_slot(i, load(i))

    def loader() -> DeviceLoader:
        return DeviceLoader(cache, seeded(seed=5), load, batch_size=6, threads=2, window=window)

    def epochs(of: DeviceLoader, first: int, stop: int) -> list[list[int]]:
        out = []
        for epoch in range(first, stop):
            of.set_epoch(epoch)
            out.append(read_epoch(of))
        return out

    with loader() as full:
        whole = epochs(full, 0, 3)
    with loader() as first:
        got = epochs(first, 0, 1)
        first.set_epoch(1)
        it, head = iter(first), []
        for _ in range(3):
            head += next(it)[1].tolist()
        state = first.state_dict()
        it.close()
    with loader() as again:
        again.load_state_dict(state)
        again.set_epoch(1)
        got.append(head + read_epoch(again))
        got += epochs(again, 2, 3)
    assert all(sorted(epoch) == list(range(N)) for epoch in got)
    assert got == whole


def test_an_epoch_left_early_gives_back_its_staging_slots(cache):
    loader = DeviceLoader(cache, seeded(), load, batch_size=4, threads=4)
    it = iter(loader)
    next(it)
    it.close()
    assert cache.stats()["staged"] == 0
    assert sorted(read_epoch(loader)) == list(range(N))  # the next epoch is whole
    loader.close()


# ----------------------------------------------------------------------------------------------
# Closing with an iterator alive (issue 36)
# ----------------------------------------------------------------------------------------------
#
# Each in a child program (tests/children/device_close_alive.py), which a loader that hangs
# leaves to run_child's timeout instead of hanging the suite. The child attaches, as local rank
# 1, to a cache made here as local rank 0, so that this process sees its staging area, also
# once the child is gone.

CLOSING_N, CLOSING_SLOTS, CLOSING_STAGING = 64, 16, 64


def closed_in_a_child(shm_dir: str, scenario: str) -> dict:
    """Run the child's ``scenario``; what it printed, once it ended with nothing staged."""
    key = f"device-close-{os.getpid()}-{scenario}"
    world = World(rank=0, world_size=2, local_rank=0, local_world_size=2)
    cache = SharedCache(budget_for(CLOSING_SLOTS, DIMS, staging=CLOSING_STAGING,
                                   dataset_len=CLOSING_N), CLOSING_N, DIMS,
                        staging_slots=CLOSING_STAGING, name="device-close", world=world,
                        shm_dir=shm_dir, job_key=key)
    try:
        run = run_child("device_close_alive.py", scenario, CLOSING_N, CLOSING_SLOTS,
                        CLOSING_STAGING, env=rank_env(shm_dir, key), timeout=60)
        assert run.returncode == 0, run.stderr[-4000:]
        assert run.stderr == ""
        assert cache.stats()["staged"] == 0
        return json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        cache.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["plain", "another-thread", "with-block"])
def test_closing_with_an_iterator_alive_returns_frees_the_staging_and_ends_the_iterator(
        shm_dir, scenario):
    """close() while the iterator is suspended at its yield, from another thread while the
    iterator waits for a batch (it wakes up with the error), or by leaving a ``with`` block:
    it returns, every staging slot is free, and the iterator raises a clear error."""
    seen = closed_in_a_child(shm_dir, scenario)
    assert seen["staged_at_close"] > 0  # (else the check below would show nothing)
    assert seen["staged_after"] == 0
    assert seen["next"] == "ValueError: this DeviceLoader was closed while this iterator " \
                           "was alive"
    assert seen["iter"] == "ValueError: this DeviceLoader is closed"
    if scenario == "another-thread":
        assert seen["close_returned"]


@pytest.mark.timeout(120)
def test_the_program_ends_with_an_iterator_alive_and_the_loader_never_closed(shm_dir):
    """The interpreter's exit stops the loader's thread, which waited for room in the queue
    (no ThreadPoolExecutor thread for the exit to join), and gives back what was staged."""
    seen = closed_in_a_child(shm_dir, "exit")
    assert seen["staged_at_close"] > 0


@pytest.mark.timeout(120)
def test_a_newer_iterator_stops_the_one_alive_which_then_raises(shm_dir):
    """One epoch at a time: the second iterator gathers its whole epoch, and the first,
    stopped by it, raises instead of waiting for a batch that never comes."""
    seen = closed_in_a_child(shm_dir, "replaced")
    assert sorted(seen["second"]) == list(range(CLOSING_N))
    assert seen["staged_after"] == 0
    assert seen["next"].startswith("RuntimeError: this iterator of the DeviceLoader was "
                                   "replaced by a newer one")


# ----------------------------------------------------------------------------------------------
# The read a GPU makes: locate, copy elsewhere, confirm
# ----------------------------------------------------------------------------------------------


def test_confirm_refuses_rows_written_cleared_or_unstaged_after_locate(shm_dir):
    c = SharedCache(budget_for(8, DIMS, dataset_len=8), 8, DIMS, staging_slots=4,
                    shm_dir=shm_dir)
    for i in range(4):
        c.set_slot(i, load(i))
    for i in range(4, 8):
        assert c.stage(i, load(i))
    located = c.locate([0, 1, 4, 5, 6, 0])
    assert located.found.tolist() == [True, True, True, True, True, True]
    c.set_slot(1, load(9), allow_overwrite=True)  # written after locate: the copy may be torn
    assert c.unstage(5)  # freed after locate: its staging slot may hold another sample
    copied = c.rows[torch.from_numpy(located.rows)].clone()  # the "GPU's" copy
    hit = c.confirm(located).tolist()
    assert hit == [True, False, True, False, True, True]
    batch = c.unpack_rows(copied)
    assert torch.equal(batch[0], load(0)) and torch.equal(batch[2], load(4))
    assert c.stats()["staged"] == 1  # 4 and 6 were taken by the confirmed read, 7 stays
    c.clear()
    located = c.locate([0, 2])
    assert located.found.tolist() == [False, False]  # cleared: nothing to copy


def test_locate_and_confirm_agree_with_get_batch_on_fields(shm_dir):
    c = SharedCache(1e-3, 10, FIELDS, dtype=FIELD_DTYPES, shm_dir=shm_dir)
    for i in range(0, 10, 2):
        c.set_slot(i, fields_of(i))
    located = c.locate(range(10))
    batch = c.unpack_rows(c.rows[torch.from_numpy(located.rows)].clone())
    hit = c.confirm(located)
    want, want_hit = c.get_batch(range(10))
    assert torch.equal(hit, want_hit)
    for name in FIELDS:
        assert torch.equal(batch[name][hit], want[name][hit])


def _overwrite_forever(cache: SharedCache, k: int, writing, stop) -> None:
    """A writer: every slot again and again, each sample one byte value (a torn row mixes
    two)."""
    writing.set()
    turn = k
    while not stop.is_set():
        turn += 2
        for i in range(len(cache)):
            cache.set_slot(i, torch.full(DIMS, (i + turn) % 256, dtype=torch.uint8),
                           allow_overwrite=True)


def uniform_rows(loader: DeviceLoader, epochs: int) -> tuple[int, int]:
    """(rows of one byte value, rows mixing values) over ``epochs`` epochs."""
    whole = torn = 0
    for _ in range(epochs):
        for batch, _ in loader:
            flat = batch.reshape(len(batch), -1).cpu()
            same = (flat == flat[:, :1]).all(dim=1)
            torn += int((~same).sum())
            whole += int(same.sum())
    return whole, torn


def one_value(i: int) -> torch.Tensor:
    return torch.full(DIMS, 7, dtype=torch.uint8)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("device, path, epochs", [
    ("cpu", "cpu", 300), pytest.param("cuda", "cuda", 200, marks=cuda)])
def test_a_writer_racing_the_gather_never_yields_a_torn_row(shm_dir, device, path, epochs):
    n = 16
    c = SharedCache(1e-3, n, DIMS, shm_dir=shm_dir)
    for i in range(n):
        c.set_slot(i, torch.full(DIMS, i, dtype=torch.uint8))
    with racing_writers(_overwrite_forever, c), \
            DeviceLoader(c, RandomSampler(range(n)), one_value, batch_size=n, threads=1,
                         device=device) as loader:
        assert loader.path == path
        assert uniform_rows(loader, epochs) == (epochs * n, 0)
    c.close()


# ----------------------------------------------------------------------------------------------
# Bad arguments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": True}, TypeError, "batch_size"),
    ({"batch_size": 4, "depth": 0}, ValueError, "depth"),
    ({"batch_size": 4, "drop_last": 1}, TypeError, "drop_last"),
    ({"batch_size": 4, "transform": 3}, TypeError, "transform"),
    ({"batch_size": 4, "device": "tpu"}, TypeError, "device"),
    ({"batch_size": 4, "device": "meta"}, ValueError, "device"),
    ({"batch_size": 4, "stand_aside": True}, TypeError, "stand_aside"),
    ({"batch_size": 4, "threads": 0}, ValueError, "threads"),
])
def test_bad_arguments_are_refused_by_name(cache, kwargs, error, match):
    with pytest.raises(error, match=match):
        DeviceLoader(cache, seeded(), load, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_a_cuda_device_without_cuda_is_refused(cache):
    with pytest.raises(ValueError, match="CUDA is not available"):
        DeviceLoader(cache, seeded(), load, batch_size=4, device="cuda")


def test_a_cache_of_open_sizes_is_refused(shm_dir):
    c = OpenSizeCache(1e-3, N, (None, 3), shm_dir=shm_dir)
    with pytest.raises(TypeError, match=r"an OpenSizeCache, of open sizes .* has no rows of one "
                                        r"size"):
        DeviceLoader(c, seeded(), load, batch_size=4)
    assert not hasattr(c, "rows") and not hasattr(c, "locate")  # what the loader gathers with
    c.close()


# ----------------------------------------------------------------------------------------------
# DDP: torchrun and mp.spawn
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher, device", [
    ("torchrun", "cpu"), ("spawn", "cpu"),
    pytest.param("torchrun", "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_two_ranks_share_one_segment_every_index_once(shm_dir, launcher, device):
    """On CUDA, each rank's process registers the node's one segment with its GPU (with one
    GPU, both with the same one)."""
    child = str(CHILDREN / "device_ddp.py")
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_port", str(free_port()), child]
    else:
        cmd = [sys.executable, child, "spawn", str(free_port())]
    r = subprocess.run(cmd, env=rank_env(shm_dir, STOCACHING_TEST_DEVICE=device),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ranks = out["ranks"]
    assert all(o["right"] for o in ranks) and out["staged"] == 0
    assert [o["path"] for o in ranks] == [device] * 2
    assert ranks[0]["segments"] == ranks[1]["segments"] and len(ranks[0]["segments"]) == 1
    for epoch in range(2):
        together = ranks[0]["epochs"][epoch] + ranks[1]["epochs"][epoch]
        assert sorted(together) == list(range(60))


# ----------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ----------------------------------------------------------------------------------------------

def read_epoch_cuda(loader: DeviceLoader) -> list[int]:
    seen = []
    for batch, idx in loader:
        assert batch.is_cuda and idx.is_cuda
        for row, i in zip(batch.cpu(), idx.tolist()):
            assert torch.equal(row, load(i))
        seen += idx.tolist()
    return seen


@cuda
@pytest.mark.parametrize("register", [True, False])
def test_cuda_batches_equal_get_slot(cache, register):
    with DeviceLoader(cache, seeded(), load, batch_size=8, device="cuda",
                      register=register) as loader:
        assert loader.path == ("cuda" if register else "pinned")
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sorted(read_epoch_cuda(loader)) == list(range(N))
            assert cache.stats()["staged"] == 0


@pytest.mark.parametrize("window", [None, 6])
def test_the_prefetchers_batches_are_its_order_in_arrays(cache, shm_dir, window):
    """Prefetcher.batches(n), the DeviceLoader's iterator: the same indices in the same order
    as iterating the prefetcher, n at a time as int64 arrays, each loaded whole by the time it
    comes; without a window as slices of the order, with one as arrays made of its lists."""
    from stocaching import Prefetcher

    one = Prefetcher(seeded(seed=2), cache, load, threads=2, window=window)
    by_index = list(one)
    other = SharedCache(budget_for(N // 2 + 40, DIMS, dataset_len=N), N, DIMS,
                        staging_slots=40, shm_dir=shm_dir)
    two = Prefetcher(seeded(seed=2), other, load, threads=2, stand_aside=False, window=window)
    arrays = []
    for ids in two.batches(7):
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
        assert all(other.get_slot(i) is not None for i in ids.tolist())  # a hit, or staged
        arrays.append(ids.copy())
    assert [len(b) for b in arrays] == [7] * 7 + [1]
    assert np.concatenate(arrays).tolist() == by_index
    with pytest.raises(ValueError, match="batch_size"):
        two.batches(0)
    two.close()
    other.close()


@pytest.mark.timeout(120)
def test_loader_processes_load_the_misses(cache):
    """processes=1: the misses are loaded ahead by a loader process (fork), stored in the
    segment, and gathered by the loader like the rest."""
    with DeviceLoader(cache, seeded(seed=4), load, batch_size=8, processes=1, threads=2,
                      multiprocessing_context="fork") as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sorted(read_epoch(loader)) == list(range(N))
        assert loader.prefetcher.loaded >= N
    assert cache.stats()["staged"] == 0


def test_the_cpu_paths_memory_is_reused_only_once_no_batch_holds_it(cache):
    """White-box: on a CPU the batches are made of blocks of memory that are written again
    only once nothing holds a batch made of them (a tensor, a view, a numpy array of it): a
    caller who keeps every batch gets each whole, and the blocks kept stay few over epochs."""
    with DeviceLoader(cache, seeded(), load, batch_size=8, depth=2, device="cpu") as loader:
        kept = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch, idx in loader:
                kept.append((batch[1:], idx.numpy(), batch.numpy()[:1]))  # views only
        for rest, idx, first in kept:  # what the loader gathered since did not overwrite it
            assert torch.equal(torch.from_numpy(first[0]), load(int(idx[0])))
            for row, i in zip(rest, idx[1:].tolist()):
                assert torch.equal(row, load(i))
        del kept, rest, first
        for epoch in range(3, 9):
            loader.set_epoch(epoch)
            read_epoch(loader)
            assert len(loader._gather.memory.blocks) <= loader.depth + 2
        before = [arrays[0].ctypes.data for arrays, _ in loader._gather.memory.blocks]
        read_epoch(loader)  # batches dropped at once: the same memory again
        assert [arrays[0].ctypes.data for arrays, _ in loader._gather.memory.blocks] == before


@cuda
def test_cuda_a_cache_of_fields_with_a_transform(shm_dir):
    """Fields gathered on the GPU as one row each, split into their tensors there, then the
    transform on the side stream."""
    c = SharedCache(1e-3, N, FIELDS, dtype=FIELD_DTYPES, shm_dir=shm_dir)

    def double(batch):
        assert all(t.is_cuda for t in batch.values())
        return {name: t * 2 for name, t in batch.items()}

    with DeviceLoader(c, seeded(), fields_of, batch_size=7, device="cuda",
                      transform=double) as loader:
        assert loader.path == "cuda"
        for _ in range(2):
            seen = []
            for batch, idx in loader:
                for k, i in enumerate(idx.tolist()):
                    for name, want in fields_of(i).items():
                        assert torch.equal(batch[name][k].cpu(), want * 2), (name, i)
                seen += idx.tolist()
            assert sorted(seen) == list(range(N))
    c.close()



@cuda
def test_cuda_two_loaders_over_one_cache_share_its_registration(cache):
    """A training and an evaluation loader over the same cache in one process: CUDA refuses
    to register the same pages twice, so the second shares the first's registration (both
    read through it), and it ends once both are closed (a third registers afresh)."""
    train = DeviceLoader(cache, seeded(), load, batch_size=8, device="cuda")
    evaluate = DeviceLoader(cache, SequentialSampler(range(N)), load, batch_size=16,
                            device="cuda")
    assert (train.path, evaluate.path) == ("cuda", "cuda")
    for loader in (train, evaluate, train):
        assert sorted(read_epoch_cuda(loader)) == list(range(N))
    train.close()
    evaluate.close()
    from stocaching import device as device_module
    assert not device_module._registrations  # (white-box: the registration ended)
    with DeviceLoader(cache, seeded(), load, batch_size=8, device="cuda") as again:
        assert again.path == "cuda"
        assert sorted(read_epoch_cuda(again)) == list(range(N))



@cuda
def test_cuda_a_refused_registration_falls_back_and_leaves_no_error(cache):
    """CUDA refuses to register pages twice: registered here first, behind the loader's
    back, the loader warns, gathers through pinned buffers, and the refusal's error is not
    left for torch to raise on a later, unrelated operation."""
    rows = cache.rows
    start = rows.data_ptr() // 4096 * 4096
    size = -(-(rows.data_ptr() + rows.numel()) // 4096) * 4096 - start
    assert int(torch.cuda.cudart().cudaHostRegister(start, size, 0)) == 0
    try:
        with pytest.warns(RuntimeWarning, match="could not be registered"):
            loader = DeviceLoader(cache, seeded(), load, batch_size=8, device="cuda")
        assert loader.path == "pinned"
        torch.ones(3, device="cuda").sum().item()  # no error of the refusal left over
        assert sorted(read_epoch_cuda(loader)) == list(range(N))
        loader.close()
    finally:
        torch.cuda.cudart().cudaHostUnregister(start)


@cuda
def test_cuda_a_loader_left_open_over_a_closed_cache_does_not_serve_the_next(shm_dir):
    """Its cache closed under it, a loader left open still holds its registration, which
    pins the old pages; a new cache mapped at the same address must not be read through it
    (its rows would be the old cache's): the new loader registers afresh and reads the new
    values."""
    old = SharedCache(budget_for(N, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir)
    for i in range(N):
        old.set_slot(i, torch.zeros(DIMS, dtype=torch.uint8))
    stale = DeviceLoader(old, seeded(), load, batch_size=8, device="cuda")
    assert stale.path == "cuda"
    address = old.rows.data_ptr()
    old.close()
    new = SharedCache(budget_for(N, DIMS, dataset_len=N), N, DIMS, shm_dir=shm_dir)
    for i in range(N):
        new.set_slot(i, load(i))
    with DeviceLoader(new, seeded(), load, batch_size=8, device="cuda") as loader:
        assert loader.path == "cuda"
        assert sorted(read_epoch_cuda(loader)) == list(range(N))
    print("the new segment reused the old address:", new.rows.data_ptr() == address)
    stale.close()
    new.close()
