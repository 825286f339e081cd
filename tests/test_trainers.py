"""The trainers' own launchers and data handling, run for real on CPU with gloo, 2 ranks,
small data: Lightning (its launcher, ``python script.py``, and ddp_spawn) and Accelerate (under
torchrun). Each rank records the indices it trained on; every run is bounded by a timeout that
kills its whole process group."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from torch.utils.data import DataLoader

from _helpers import (CHILDREN, PREFETCH_KINDS, REPO, TRAIN_BATCH, TRAIN_EPOCHS, TRAIN_LEN,
                      TwoLineDataset, WithIndex, budget_for, free_port, named, rank_env,
                      assert_ended_well, read_records, run_bounded, value_of)
from stocaching import (CacheAwareSampler, CacheLayout, Prefetcher, ReadyFirstSampler,
                        SharedCache, WeightedMixtureSampler, World)

KINDS = ["cache", "mixture", "prefetch", "prefetch window"]
SEGMENTS = {"cache": {"train": 1}, "mixture": {"mix0": 1, "mix1": 1},
            **{kind: {kind.replace(" ", "-"): 1} for kind in PREFETCH_KINDS}}
SAMPLERS = {"cache": "CacheAwareSampler", "mixture": "CacheAwareSampler",
            "prefetch": "_DistributedPrefetcher", "prefetch window": "_DistributedPrefetcher"}


def assert_trained_as_planned(records: list[dict], kinds: list[str]) -> None:
    """One segment per cache on the node; for each kind, each rank trained on exactly the
    indices its CacheAwareSampler planned for it (in its order; with a prefetcher's window,
    reordered within it) and a prefetcher loaded only some of those, and all ranks together
    trained on every index once per epoch."""
    segments = {name: 1 for kind in kinds for name in SEGMENTS[kind]}
    for rec in records:
        assert rec["segments"] == segments, rec["segments"]
    for kind in kinds:
        for rec in records:
            got, plan = rec["epochs"][kind], rec["planned"].get(kind)
            if PREFETCH_KINDS.get(kind) and plan is not None:
                got, plan = [sorted(e) for e in got], [sorted(e) for e in plan]
            assert plan is None or got == plan, f"{kind}: rank {rec['rank']} trained on others"
            assert len(got[0]) == TRAIN_LEN // 2
            if kind in PREFETCH_KINDS:
                loaded = set(rec["loaded"][kind])
                assert loaded and loaded <= {i for e in got for i in e}, \
                    f"{kind}: rank {rec['rank']} loaded what another rank reads"
        for epoch in range(TRAIN_EPOCHS):
            every = sorted(i for rec in records for i in rec["epochs"][kind][epoch])
            assert every == list(range(TRAIN_LEN)), f"{kind}, epoch {epoch}: not every index once"
        got = records[0]["epochs"][kind]
        assert got[0] != got[1], f"{kind}: set_epoch was not called"


# ----------------------------------------------------------------------------------------------
# Lightning
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_trains_each_rank_on_its_own_cache_aware_share(strategy, shm_dir, tmp_path):
    """Trainer(devices=2) with its defaults (use_distributed_sampler=True), the datasets made
    in train_dataloader() (one cache; a mixture of two; a cache under a Prefetcher, without
    and with a window), trained on together. Under "ddp" rank 0 starts rank 1 as its child,
    so the ranks have different parent processes and agree on each segment through the
    process group; the samplers, DistributedSamplers (a Prefetcher over one is one too), are
    left unwrapped, and each rank's prefetcher loads only what its rank reads."""
    pytest.importorskip("lightning")
    cmd = [sys.executable, str(CHILDREN / "lightning_train.py"), str(tmp_path), strategy,
           ",".join(KINDS)]
    r = run_bounded(cmd, env=rank_env(shm_dir), timeout=180)
    assert_ended_well(r)
    records = read_records(str(tmp_path))
    for rec in records:
        assert rec["samplers"] == SAMPLERS
        assert rec["warnings"] == []
    assert_trained_as_planned(records, KINDS)


@pytest.mark.timeout(200)
def test_lightning_cache_made_before_the_launch_fails_at_once(shm_dir, tmp_path):
    """A dataset made as the script runs, before Trainer.fit: rank 0 is alone then, and its
    child rank 1 has Lightning's variables and no process group. Rank 1 raises at once, naming
    what to do, instead of waiting out the attach timeout (60 s here); Lightning then ends
    rank 0."""
    pytest.importorskip("lightning")
    cmd = [sys.executable, str(CHILDREN / "lightning_train.py"), str(tmp_path), "ddp",
           "import"]
    r = run_bounded(cmd, env=rank_env(shm_dir), timeout=180)
    assert r.returncode != 0
    assert "RuntimeError: local rank 1 of 2 cannot find" in r.stderr, r.stderr[-4000:]
    assert "train_dataloader()" in r.stderr and "STOCACHING_JOB_KEY" in r.stderr
    assert "CacheTimeoutError" not in r.stderr


@pytest.mark.timeout(200)
def test_lightning_wrapping_a_sampler_that_is_not_distributed_warns_once_with_the_fix(
        shm_dir, tmp_path):
    """A WeightedMixtureSampler alone, and a Prefetcher over a RandomSampler, are not
    DistributedSamplers: Lightning's default wraps them (splitting the mixture's per-rank share
    again). Each rank warns once for each, naming the way out."""
    pytest.importorskip("lightning")
    cmd = [sys.executable, str(CHILDREN / "lightning_train.py"), str(tmp_path), "ddp",
           "bare mixture,random prefetch"]
    r = run_bounded(cmd, env=rank_env(shm_dir), timeout=180)
    assert_ended_well(r)
    for rec in read_records(str(tmp_path)):
        assert rec["samplers"] == {"bare mixture": "DistributedSamplerWrapper",
                                   "random prefetch": "DistributedSamplerWrapper"}
        wrapped = [w for w in rec["warnings"] if "use_distributed_sampler=True" in w]
        assert len(wrapped) == 2, rec["warnings"]
        mixture, prefetcher = sorted(wrapped, key=lambda w: "Prefetcher" in w)
        assert "order=this sampler" in mixture and "use_distributed_sampler=False" in mixture
        assert "put this Prefetcher inside" in prefetcher
        assert "Give the Prefetcher a DistributedSampler or a CacheAwareSampler" in prefetcher
        # (Lightning cycles the shorter loader, the mixture's, to the other's length)
        assert len(set(rec["epochs"]["bare mixture"][0])) == TRAIN_LEN // 4
        assert len(rec["epochs"]["random prefetch"][0]) == TRAIN_LEN // 2


def test_a_mixture_sampler_in_lightnings_wrapper_warns_once_and_alone_does_not():
    """Lightning's DistributedSamplerWrapper, as its default puts around a sampler that is
    not a DistributedSampler, in this process: the WeightedMixtureSampler of rank 0 of 2
    inside it warns once over two epochs; the same sampler iterated by itself does not."""
    lightning_distributed = pytest.importorskip("lightning.fabric.utilities.distributed")
    mixture = WeightedMixtureSampler([30, 20], num_replicas=2, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(mixture)) == 25
    wrapper = lightning_distributed.DistributedSamplerWrapper(mixture, num_replicas=2, rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            wrapper.set_epoch(epoch)
            assert len(list(wrapper)) == 13  # half of this rank's 25
    ours = [str(w.message) for w in caught if "Lightning" in str(w.message)]
    assert len(ours) == 1 and "use_distributed_sampler=False" in ours[0], ours


# ----------------------------------------------------------------------------------------------
# Accelerate
# ----------------------------------------------------------------------------------------------


def run_accelerate(tmp_path, shm_dir: str, kind: str, use: str,
                   launcher: str = "torchrun") -> list[dict]:
    program = [str(CHILDREN / "accelerate_train.py"), str(tmp_path), kind, use]
    cmd = [sys.executable, *program, "notebook"] if launcher == "notebook" else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master-port={free_port()}", *program]
    r = run_bounded(cmd, env=rank_env(shm_dir), timeout=150)
    assert_ended_well(r)
    return read_records(str(tmp_path))


ACCELERATE_KINDS = ["cache", "mixture", "prefetch", "prefetch window", "random prefetch"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher, kinds", [("torchrun", ACCELERATE_KINDS),
                                             ("notebook", ["cache"])], ids=["torchrun", "notebook"])
def test_accelerate_prepare_deals_each_rank_its_own_cache_aware_batches(launcher, kinds,
                                                                        shm_dir, tmp_path):
    """accelerator.prepare(model, optimizer, loader) with its defaults, the loader's sampler
    sampler.for_accelerate() (or a Prefetcher over it, without and with a window; or a
    Prefetcher over a RandomSampler), under torchrun (what accelerate launch runs) and
    Accelerate's notebook_launcher: prepare's dealing of batches gives each rank exactly its
    CacheAwareSampler's batches (and, from a RandomSampler, the ranks every index once: they
    share its generator), len(loader) counts them, and each rank's prefetcher loads only
    what its rank reads."""
    pytest.importorskip("accelerate")
    records = run_accelerate(tmp_path, shm_dir, ",".join(kinds), "for_accelerate", launcher)
    assert [rec["warnings"] for rec in records] == [[], []]
    assert [rec["batches"] for rec in records] == \
        [{kind: TRAIN_LEN // 2 // TRAIN_BATCH for kind in kinds}] * 2
    assert_trained_as_planned(records, kinds)


@pytest.mark.timeout(180)
def test_accelerate_prepare_of_a_per_rank_sampler_warns_once_with_the_fix(shm_dir, tmp_path):
    """The CacheAwareSampler itself in a prepared loader, alone and under a Prefetcher:
    prepare deals its batches again and each rank trains on half its share. Each rank warns
    once for each loader (not once an epoch), naming for_accelerate()."""
    pytest.importorskip("accelerate")
    records = run_accelerate(tmp_path, shm_dir, "cache,prefetch", "sampler")
    for rec in records:
        assert len(rec["warnings"]) == 2, rec["warnings"]
        assert all("sampler=sampler.for_accelerate()" in w for w in rec["warnings"])
        for kind in ("cache", "prefetch"):
            assert len(rec["epochs"][kind][0]) == TRAIN_LEN // 4


@pytest.mark.parametrize("length, batch_size, num_nodes, ranks_per_node",
                         [(200, 5, 1, 2), (240, 4, 2, 2), (210, 7, 3, 1)])
def test_for_accelerate_gives_batch_sampler_shard_each_ranks_batches(length, batch_size,
                                                                      num_nodes, ranks_per_node):
    """accelerate's BatchSamplerShard over a BatchSampler of for_accelerate(), as prepare
    builds it for process r, yields exactly rank r's batches of the CacheAwareSampler."""
    accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
    layout = CacheLayout(length, length // (num_nodes + 1), num_nodes)
    ranks = num_nodes * ranks_per_node
    for r in range(ranks):
        sampler = CacheAwareSampler(layout, ranks, r, batch_size=batch_size)
        sampler.set_epoch(3)
        batches = torch.utils.data.BatchSampler(sampler.for_accelerate(), batch_size, False)
        shard = accelerate_data_loader.BatchSamplerShard(batches, num_processes=ranks,
                                                         process_index=r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # not in a prepared loader: it says so
            got = [i for batch in shard for i in batch]
        assert len(shard) == len(sampler) // batch_size
        assert np.array_equal(got, sampler.epoch_indices(3)), r


@pytest.mark.parametrize("use, split, warns", [
    ("for_accelerate", False, None),
    ("for_accelerate", True, r"split_batches=True and cuts every batch"),
    ("sampler", False,
     r"prepare\(\) deals this loader's batches .* sampler=sampler.for_accelerate\(\)")])
def test_a_loader_prepared_for_two_processes_reads_what_each_rank_planned_or_warns_once(
        use, split, warns, shm_dir):
    """accelerate's prepare_data_loader, as prepare() calls it, for process r of 2, in this
    process: the right use reads exactly rank r's batches without a warning; the wrong ones
    (prepare's split_batches=True, the per-rank sampler itself) warn once over two epochs."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    cache = SharedCache(budget_for(13, (3, 8, 8), dataset_len=40), 40, (3, 8, 8), world=World())
    ds = TwoLineDataset(cache, 40)
    for r in range(2):
        sampler = CacheAwareSampler(ds, 2, r, batch_size=4)
        order = sampler.for_accelerate() if use == "for_accelerate" else sampler
        loader = DataLoader(WithIndex(ds), batch_size=4, sampler=order)
        prepared = data_loader.prepare_data_loader(loader, num_processes=2, process_index=r,
                                                   split_batches=split)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            epochs = [[i for idx, _ in prepared for i in idx.tolist()] for _ in range(2)]
        ours = [str(w.message) for w in caught if "sampler" in str(w.message)]
        if warns is None:
            assert ours == [] and len(prepared) == 5
            assert epochs == [sampler.epoch_indices(e).tolist() for e in range(2)]
        else:
            assert len(ours) == 1 and re.search(warns, ours[0]), ours
    cache.close()


@pytest.mark.parametrize("use", ["for_accelerate", "random"])
@pytest.mark.parametrize("window", [None, 8])
def test_a_prefetcher_prepared_for_two_processes_loads_and_reads_only_its_own_positions(
        use, window, shm_dir):
    """accelerate's prepare_data_loader for process r of 2, in this process, over a
    Prefetcher of sampler.for_accelerate() or of a RandomSampler (the same generator seed on
    both, as prepare() makes it): process r reads exactly rank r's batches (with a window, the
    same indices reordered), the two together every index once an epoch, and each loads only
    indices it reads. No warning."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    cache = SharedCache(budget_for(13, (3, 8, 8), dataset_len=40), 40, (3, 8, 8), world=World())
    ds = TwoLineDataset(cache, 40)
    read = []
    for r in range(2):
        loads: list[int] = []
        sampler = CacheAwareSampler(ds, 2, r, batch_size=4)
        base = sampler.for_accelerate() if use == "for_accelerate" else \
            torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3))
        prefetcher = Prefetcher(base, cache, lambda i: loads.append(i) or value_of(i),
                                threads=2, window=window)
        loader = DataLoader(WithIndex(ds), batch_size=4, sampler=prefetcher)
        prepared = data_loader.prepare_data_loader(loader, num_processes=2, process_index=r)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            epochs = [[i for idx, _ in prepared for i in idx.tolist()] for _ in range(2)]
        assert len(prepared) == 5 and set(loads) and set(loads) <= set(epochs[0] + epochs[1])
        if use == "for_accelerate":
            planned = [sampler.epoch_indices(e).tolist() for e in range(2)]
            if window:
                epochs, planned = [sorted(e) for e in epochs], [sorted(e) for e in planned]
            assert epochs == planned
        read.append(epochs)
        prefetcher.close()
    for e in range(2):
        assert sorted(read[0][e] + read[1][e]) == list(range(40))
    cache.close()


def test_a_ready_first_sampler_prepared_for_two_processes_warns_once():
    """Each process would reorder the whole epoch by what it saw ready: the message names
    the prefetcher, which reorders only its own process's batches."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    sampler = CacheAwareSampler(CacheLayout(40, 13), 2, 0, batch_size=4)
    order = ReadyFirstSampler(sampler.for_accelerate(), lambda i: i % 3 == 0, window=4)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(40)), batch_size=4,
                        sampler=order)
    prepared = data_loader.prepare_data_loader(loader, num_processes=2, process_index=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            order.set_epoch(epoch)
            list(prepared)
    ours = [str(w.message) for w in caught if "ReadyFirstSampler" in str(w.message)]
    assert len(ours) == 1 and "Prefetcher(sampler, cache, load, window=...)" in ours[0], ours


@pytest.mark.parametrize("make", ["ReadyFirstSampler", "Prefetcher"])
def test_a_sampler_over_a_distributed_sampler_is_one_with_its_attributes(make, shm_dir):
    """What Lightning reads: over a CacheAwareSampler (a DistributedSampler) the sampler is a
    DistributedSampler with the base's arguments, so Lightning's default leaves it alone;
    over a RandomSampler it is not one. The same sampler, the same indices."""
    cache = SharedCache(budget_for(13, (3, 8, 8), dataset_len=40), 40, (3, 8, 8), world=World())
    ds = TwoLineDataset(cache, 40)
    base = CacheAwareSampler(ds, 2, 1, shuffle=True, seed=5, drop_last=True, batch_size=4)
    wrap = (lambda b: ReadyFirstSampler(b, cache, window=4)) if make == "ReadyFirstSampler" \
        else (lambda b: Prefetcher(sampler=b, cache=cache, load=value_of, threads=2))
    ours = wrap(base)
    assert isinstance(ours, torch.utils.data.DistributedSampler) and isinstance(ours, eval(make))
    for name in ("dataset", "num_replicas", "rank", "shuffle", "seed", "drop_last",
                 "num_samples", "total_size"):
        assert getattr(ours, name) == getattr(base, name), name
    ours.set_epoch(3)
    assert ours.epoch == 3 and len(ours) == len(base)
    assert sorted(ours) == sorted(base.epoch_indices(3).tolist())
    plain = wrap(torch.utils.data.RandomSampler(ds))
    assert not isinstance(plain, torch.utils.data.DistributedSampler)
    for s in (ours, plain):
        getattr(s, "close", lambda: None)()
    cache.close()


@pytest.mark.parametrize("make", ["ReadyFirstSampler", "Prefetcher"])
def test_a_sampler_over_a_plain_order_in_lightnings_wrapper_warns_once(make, shm_dir):
    """Lightning's DistributedSamplerWrapper, as its default puts around a sampler that is
    not a DistributedSampler, in this process: a ReadyFirstSampler or a Prefetcher over a
    RandomSampler inside it warns once over two epochs, naming the fix."""
    lightning_distributed = pytest.importorskip("lightning.fabric.utilities.distributed")
    cache = SharedCache(budget_for(13, (3, 8, 8), dataset_len=40), 40, (3, 8, 8), world=World())
    base = torch.utils.data.RandomSampler(range(40))
    sampler = ReadyFirstSampler(base, cache, window=4) if make == "ReadyFirstSampler" else \
        Prefetcher(base, cache, value_of, threads=2)
    wrapper = lightning_distributed.DistributedSamplerWrapper(sampler, num_replicas=2, rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            wrapper.set_epoch(epoch)
            assert len(list(wrapper)) == 20
    ours = [str(w.message) for w in caught if "Lightning" in str(w.message)]
    assert len(ours) == 1 and f"Give the {make} a DistributedSampler" in ours[0], ours
    getattr(sampler, "close", lambda: None)()
    cache.close()


def test_for_accelerate_outside_a_prepared_loader_warns_once():
    sampler = CacheAwareSampler(CacheLayout(100, 30), 2, 0, batch_size=5)
    order = sampler.for_accelerate()
    assert len(order) == 100
    with pytest.warns(UserWarning, match=r"was not prepared for 2 processes: every rank reads"):
        assert sorted(order) == list(range(100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(order)


def test_cache_aware_sampler_is_a_distributed_sampler_with_its_attributes():
    """What trainers read of a DistributedSampler (Lightning leaves one unwrapped)."""
    ds = torch.utils.data.TensorDataset(torch.arange(103))
    ds.cache = None  # no cache: it yields what DistributedSampler yields
    with pytest.warns(UserWarning, match="has no cache"):
        ours = CacheAwareSampler(ds, 4, 1, shuffle=True, seed=5, drop_last=True, batch_size=3)
    theirs = torch.utils.data.DistributedSampler(ds, 4, 1, shuffle=True, seed=5,
                                                 drop_last=True)
    assert isinstance(ours, torch.utils.data.DistributedSampler)
    for name in ("dataset", "num_replicas", "rank", "epoch", "shuffle", "seed", "drop_last",
                 "num_samples", "total_size"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for s in (ours, theirs):
        s.set_epoch(2)
    assert list(ours) == list(theirs) and len(ours) == len(theirs)


# ----------------------------------------------------------------------------------------------
# Hugging Face Trainer
# ----------------------------------------------------------------------------------------------


def run_hf(out, shm_dir: str, phase: str, workers: int = 0, sampler: str = "") -> list[dict]:
    """hf_train.py under torchrun on 2 ranks; each rank's record of ``phase``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(CHILDREN / "hf_train.py"), str(out), phase,
           str(workers), *([sampler] if sampler else [])]
    r = run_bounded(cmd, env=rank_env(shm_dir), timeout=150, cwd=str(CHILDREN))
    assert_ended_well(r)
    records = [json.loads((out / f"{phase}-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rec["rank"] for rec in records] == [0, 1]
    assert [rec["world_size"] for rec in records] == [2, 2], "the Trainer did not start DDP"
    return records


def every_index_once(parts: list[list[int]]) -> bool:
    return sorted(i for part in parts for i in part) == list(range(TRAIN_LEN))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
def test_hugging_face_trainer_trains_each_rank_on_its_cache_aware_batches(workers, shm_dir,
                                                                          tmp_path):
    """The Trainer subclass of docs/distributed.md under torchrun, with use_cpu=True, an
    evaluation dataset with a cache of its own, and DataLoader workers or none: each rank
    trains on exactly the batches its CacheAwareSampler planned, all ranks on every index once
    an epoch, one segment per cache on the node, the second evaluation hits its cache, nothing
    warns, and nothing is left in /dev/shm."""
    pytest.importorskip("transformers")
    records = run_hf(tmp_path, shm_dir, "whole", workers)
    for rec in records:
        assert rec["segments"] == {"eval": 1, "train": 1}, rec["segments"]
        assert rec["warnings"] == []
        assert [rec["trained"][str(e)] for e in range(TRAIN_EPOCHS)] == rec["planned"]
        assert rec["eval_hits"] > 0 and rec["train_hits"] > 0
    for epoch in range(TRAIN_EPOCHS):
        assert every_index_once([rec["trained"][str(epoch)] for rec in records]), epoch
    assert records[0]["planned"][0] != records[0]["planned"][1], "one order for every epoch"
    assert named(shm_dir) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sampler", ["", "prefetch"], ids=["for_accelerate", "prefetcher"])
def test_hugging_face_trainer_resumed_mid_epoch_trains_the_rest_of_that_epoch(sampler, shm_dir,
                                                                             tmp_path):
    """A checkpoint 4 batches into epoch 1, training stopped there, then
    trainer.train(resume_from_checkpoint=...) in new processes: accelerate's
    skip_first_batches wraps the sampler where the Trainer's set_epoch does not reach it, and
    the resumed processes must still read epoch 1's order (not epoch 0's, where a new sampler
    starts): over both runs, every index of epoch 1 exactly once, each rank the rest of its
    own planned batches, and no warning (the wrapped loader is still a prepared one); also
    through a Prefetcher over the sampler."""
    pytest.importorskip("transformers")
    first = run_hf(tmp_path, shm_dir, "interrupt", sampler=sampler)
    resumed = run_hf(tmp_path, shm_dir, "resume", sampler=sampler)
    for before, after in zip(first, resumed):
        assert before["trained"]["0"] == before["planned"][0]
        head, tail = before["trained"]["1"], after["trained"]["1"]
        assert len(head) == 4 * TRAIN_BATCH and set(after["trained"]) == {"1"}
        assert head + tail == before["planned"][1], f"rank {before['rank']}: not its epoch 1"
        assert before["warnings"] == [] and after["warnings"] == []
    assert every_index_once([rec["trained"]["1"] for rec in first + resumed])
    assert named(shm_dir) == []


# torch's abort after a DDP program's last line, as torchrun printed it (trimmed) in CI
GLOO_EXIT_ABORT = """terminate called without an active exception
Fatal Python error: Aborted

Thread 0x00007f0f64071b80 (most recent call first):
  <no Python frame>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 12721)  (SIGTERM)
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 12720)  (SIGABRT)
"""


@pytest.mark.parametrize("change, accepted", [
    (None, True),
    (("<no Python frame>", '  File "train.py", line 9 in <module>'), False),  # still running
    (("exitcode  : -15", "exitcode  : 1"), False),  # a rank failed
    (("terminate called", "Traceback (most recent call last):\nValueError: x\nterminate called"),
     False),  # a rank's own error beside the abort
])
def test_only_torchs_abort_after_the_last_line_passes_for_an_ending(change, accepted):
    """assert_ended_well lets through torch's gloo abort after a DDP program's last line
    (pytorch/pytorch#190489, see _helpers) and no other failure that looks like it."""
    err = GLOO_EXIT_ABORT if change is None else GLOO_EXIT_ABORT.replace(*change)
    expect_to_end(subprocess.CompletedProcess([], 1, "", err), accepted)


# The same abort of a rank of Lightning's ddp_spawn, as the launching process reports it (a
# newcomer's run, trimmed): fit() raises, after the ranks had trained and written everything
SPAWNED_EXIT_ABORT = """terminate called without an active exception
Fatal Python error: Aborted

Current thread 0x00007f2b1c2d4b80 (most recent call first):
  <no Python frame>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
W1127 15:50:53.038000 17459 torch/multiprocessing/spawn.py:165] Terminating process 17463 via \
signal SIGTERM
Traceback (most recent call last):
  File "lightning_train.py", line 67, in <module>
    trainer.fit(Recorded())
  File "torch/multiprocessing/spawn.py", line 192, in join
    raise ProcessExitedException(
torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGABRT
"""


@pytest.mark.parametrize("change, accepted", [
    (None, True),
    (("signal SIGABRT", "signal SIGSEGV"), False),  # another death
    (("<no Python frame>", '  File "lightning_train.py", line 60 in on_train_end'), False),
])
def test_a_spawned_ranks_abort_after_its_last_line_passes_for_an_ending(change, accepted):
    err = SPAWNED_EXIT_ABORT if change is None else SPAWNED_EXIT_ABORT.replace(*change)
    expect_to_end(subprocess.CompletedProcess([], 1, "", err), accepted)


def expect_to_end(r: subprocess.CompletedProcess, accepted: bool) -> None:
    if accepted:
        with pytest.warns(UserWarning, match="190489"):
            assert_ended_well(r)
    else:
        with pytest.raises(AssertionError):
            assert_ended_well(r)


# ----------------------------------------------------------------------------------------------
# The examples of docs/distributed.md, run as they say
# ----------------------------------------------------------------------------------------------


def doc_programs() -> dict[str, tuple[str, str]]:
    """{file name: (code, command)} of each ```python block of docs/distributed.md whose first
    line is "# <name>.py" or "# <name>.py: <command>"."""
    text = (REPO / "docs" / "distributed.md").read_text()
    out = {}
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        head = re.match(r"# (\w+\.py)(?:: (.*))?\n", code)
        if head:
            out[head.group(1)] = (code, head.group(2) or "")
    return out


# A printed warning: "<file>:<line>: <Category>: <message>", the file being whoever warned (with
# Ray's "(RayTrainWorker pid=...) " before it).
WARNING_LINE = re.compile(r"\b(\w*Warning): (.*)")
ABOUT_THE_CACHE = re.compile(r"stocaching|sampler|cache", re.I)
ABSOLUTE_PATH = re.compile(r"(?<![\w.])/\S*")


def warnings_about_the_cache(stderr: str) -> list[str]:
    """The warnings printed in ``stderr`` whose text, category and message, speaks of
    stocaching, a sampler or a cache. What the warning says, not where: the file before it,
    and any absolute path in its message, may name the checkout (a clone named stocaching,
    with its venv inside, puts "/stocaching/.venv/" in every warning of Ray's), and our own
    warnings point at the caller's line (stacklevel=2) anyway."""
    said = ((m.group(1), ABSOLUTE_PATH.sub("", m.group(2)))
            for m in map(WARNING_LINE.search, stderr.splitlines()) if m)
    return [f"{cat}: {msg}" for cat, msg in said if ABOUT_THE_CACHE.search(f"{cat}: {msg}")]


CLONE = "/home/u/stocaching"  # a newcomer's clone, its venv inside it
RAYS = f"{CLONE}/.venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize("where, category, message, about", [
    (f"{RAYS}/data/context.py", DeprecationWarning,
     "`use_push_based_shuffle` is deprecated! Configure `shuffle_strategy` instead.", False),
    (f"(RayTrainWorker pid=4242) {RAYS}/train/_internal/session.py", UserWarning,
     f"the checkpoint of {CLONE}/runs/x was written twice", False),
    ("/tmp/pytest-of-u/pytest-3/test_each0/train_ray.py", UserWarning,
     "epoch 1 is iterated again, in the same order; call sampler.set_epoch(epoch) before "
     "each epoch", True),
    (f"(RayTrainWorker pid=4242) {CLONE}/stocaching/samplers.py", UserWarning,
     "Images has no cache (no .cache, or None): every index counts as missing", True),
    (f"{CLONE}/.venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py",
     UserWarning, "/dev/shm has 64.0 MiB free but the cache needs 9.1 GiB", True),
])
def test_the_docs_examples_warning_filter_reads_what_a_warning_says(where, category, message,
                                                                     about):
    """A warning counts as one about the cache by its category and message, as printed (with
    PYTHONWARNINGS=always), whatever the paths in the line: a clone named stocaching does not
    make Ray's own warnings ours."""
    printed = "some output\n" + warnings.formatwarning(message, category, where, 12) + "more\n"
    assert bool(warnings_about_the_cache(printed)) is about, printed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("program, needs", [("train_torchrun.py", None),
                                            ("train_lightning.py", "lightning"),
                                            ("train_accelerate.py", "accelerate"),
                                            ("train_hf.py", "transformers"),
                                            ("train_ray.py", "ray.train.torch")])
def test_each_trainers_example_in_the_docs_runs_as_shown(program, needs, shm_dir, tmp_path):
    """The example, with the docs' images.py beside it, run by its own command (accelerate
    launch as the torchrun it runs): it ends well, warns of nothing about the cache or the
    sampler, and leaves no segment behind."""
    if needs:
        pytest.importorskip(needs)
    programs = doc_programs()
    for name in ("images.py", program):
        (tmp_path / name).write_text(programs[name][0])
    command = programs[program][1].split()
    assert command[-1] == program, command
    launcher = {"python": [sys.executable],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master-port={free_port()}"],
                "accelerate": [sys.executable, "-m", "torch.distributed.run",
                               "--nproc_per_node=2", f"--master-port={free_port()}"]}
    assert command[0] in launcher and ("=2" in command[-2] or command[0] == "python"), command
    env = rank_env(shm_dir, PYTHONWARNINGS="always")
    r = run_bounded([*launcher[command[0]], program], env=env, timeout=180, cwd=str(tmp_path))
    assert_ended_well(r)
    warned = warnings_about_the_cache(r.stderr)
    assert warned == [], warned
    assert named(shm_dir) == []
