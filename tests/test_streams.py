"""CachedStream over real WebDataset tar shards (webdataset's own reader and writer): every
index once an epoch over ranks and DataLoader workers, later epochs read only the shards with
uncached samples (counted), values equal to the source's, an exact resume mid-epoch with
torchdata's StatefulDataLoader, a random decode caught, nothing left in /dev/shm."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from _helpers import (CHILDREN, assert_ended_well, free_port, mappers, named, rank_env,
                      run_copied, value_of)
from stocaching import (CacheConfigError, CachedStream, SharedCache, ShardLayout, World,
                        clean_segments, list_segments)

wds = pytest.importorskip("webdataset")

SHARDS, PER = 6, 10
DIMS = (3, 8, 8)


def make_shards(root, shards=SHARDS, per=PER) -> list[str]:
    """Tar shards of samples {"x.bin": value_of(index) bytes, "cls": label}, in index order."""
    urls = []
    for k in range(shards):
        url = os.path.join(str(root), f"train-{k:04d}.tar")
        with wds.TarWriter(url) as sink:
            for j in range(per):
                i = k * per + j
                sink.write({"__key__": f"{i:06d}", "x.bin": value_of(i, DIMS).numpy().tobytes(),
                            "cls": str(i % 3).encode()})
        urls.append(url)
    return urls


class OpenShard:
    """WebDataset's reader for one shard, logging each open to a file (DataLoader workers are
    other processes: the log is how the test counts the source's reads)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, url):
        with open(self.log, "a") as f:
            f.write(os.path.basename(url) + "\n")
        return wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None,
                              empty_check=False)

    def opened(self) -> list[str]:
        with open(self.log) as f:
            names = f.read().split()
        open(self.log, "w").close()
        return names


def decode(raw):
    x = torch.from_numpy(np.frombuffer(raw["x.bin"], np.uint8).copy()).reshape(DIMS)
    return x, int(raw["cls"])


def index_of(x: torch.Tensor) -> int:
    """value_of(i) starts with (i * 7 + 1) % 251: the index of a sample, for i < 251."""
    return next(i for i in range(251) if int(value_of(i, DIMS)[0, 0, 0]) == int(x[0, 0, 0]))


def epoch_of(ds, loader) -> list[int]:
    seen = []
    for x, label in loader:
        for xi, li in zip(x, label):
            i = index_of(xi)
            assert torch.equal(xi, value_of(i, DIMS)) and int(li) == i % 3
            seen.append(i)
    return seen


@pytest.fixture
def shards(tmp_path):
    return make_shards(tmp_path), OpenShard(str(tmp_path / "opened.log"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cached_shards", [SHARDS, SHARDS // 2])
def test_later_epochs_read_only_the_shards_with_uncached_samples(shm_dir, shards, cached_shards):
    urls, open_shard = shards
    # slots of 200 bytes (the image and the int64 label) and an aux byte per sample
    budget = (cached_shards * PER * 200 + SHARDS * PER + 0.5) / 2**30
    ds = CachedStream(urls, open_shard, decode=decode, shard_lengths=[PER] * SHARDS,
                      size_limit_gib=budget, shuffle_buffer=16)
    assert len(ds.cache) == cached_shards * PER
    open_shard.opened()  # (the construction's decode of the first sample)
    loader = torch.utils.data.DataLoader(ds, batch_size=7, num_workers=2)
    for epoch in range(3):
        ds.set_epoch(epoch)
        seen = epoch_of(ds, loader)
        assert sorted(seen) == list(range(SHARDS * PER)), epoch
        opened = open_shard.opened()
        if epoch == 0:
            assert sorted(opened) == sorted(os.path.basename(u) for u in urls)
        else:  # the cached shards are the first ones (the default layout): never opened
            assert sorted(opened) == [os.path.basename(u) for u in urls[cached_shards:]]
    # Shuffled: the order differs between epochs.
    ds.set_epoch(0)
    first = epoch_of(ds, loader)
    ds.set_epoch(1)
    assert epoch_of(ds, loader) != first
    ds.cache.close()
    assert named(shm_dir) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("even", [False, True])
def test_two_ranks_of_two_workers_read_every_index_once(shm_dir, shards, even):
    # 6 shards over 2 ranks x 2 workers: 2 and 1 shards a worker. even=False: every sample
    # once, the workers uneven; even=True: every worker yields 2 shards' worth (its own first
    # samples again), so every rank takes as many steps (DDP needs it).
    urls, open_shard = shards
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    args = dict(decode=decode, shard_lengths=[PER] * SHARDS, size_limit_gib=1, name="s",
                job_key=f"streams{os.getpid()}", timeout=60, even=even)
    ranks = [CachedStream(urls, open_shard, world=worlds[0], **args)]
    ranks.append(CachedStream(urls, open_shard, world=worlds[1], **args))  # attaches
    open_shard.opened()
    for epoch in range(2):
        seen, per_rank = [], []
        for ds in ranks:
            ds.set_epoch(epoch)
            got = epoch_of(ds, torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2))
            seen += got
            per_rank.append(len(got))
        if even:
            assert sorted(set(seen)) == list(range(SHARDS * PER)), epoch
            assert per_rank == [2 * 2 * PER, 2 * 2 * PER]
        else:
            assert sorted(seen) == list(range(SHARDS * PER)), epoch
            assert per_rank == [3 * PER, 3 * PER]
        # epoch 1 reads every shard (and, padding, 2 of them again before they are stored);
        # epoch 2 none
        assert len(open_shard.opened()) == ((SHARDS + 2 * even) if epoch == 0 else 0)
    # len(): this rank's samples when read without workers (3 shards each: even already)
    assert [len(ds) for ds in ranks] == [3 * PER, 3 * PER]
    assert ranks[0].cache.stats()["filled"] == SHARDS * PER
    for ds in reversed(ranks):
        ds.cache.close()
    assert named(shm_dir) == []


@pytest.mark.timeout(120)
def test_a_resume_mid_epoch_is_exact(shm_dir, shards):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    urls, open_shard = shards
    ds = CachedStream(urls, open_shard, decode=decode, shard_lengths=[PER] * SHARDS,
                      size_limit_gib=1, shuffle_buffer=8, seed=3)

    def loader():
        return stateful.StatefulDataLoader(ds, batch_size=4, num_workers=2)

    ds.set_epoch(1)
    whole = [index_of(x) for xs, _ in loader() for x in xs]
    ds.set_epoch(1)
    first = loader()
    it, before = iter(first), []
    for _ in range(5):
        before += [index_of(x) for x in next(it)[0]]
    state = first.state_dict()
    del it, first
    again = loader()
    again.load_state_dict(state)
    after = [index_of(x) for xs, _ in again for x in xs]
    assert before + after == whole
    assert sorted(whole) == list(range(SHARDS * PER))
    ds.cache.close()


@pytest.mark.parametrize("world", [{"ranks": 1, "workers": 2}, {"ranks": 2, "workers": 1}])
def test_a_state_of_another_world_is_refused(shm_dir, shards, world):
    """A stream's position is a count of one worker's samples, which another number of ranks
    or DataLoader workers deals otherwise: a state saved in another world (here: of 2
    workers, or of 2 ranks, loaded where the stream runs alone) is refused, naming both
    worlds, before anything is read; a state without the world (saved before it was
    recorded) loads. (torchdata's StatefulDataLoader refuses another num_workers itself.)"""
    urls, open_shard = shards
    with CachedStream(urls, open_shard, decode=decode, shard_lengths=[PER] * SHARDS,
                      size_limit_gib=1, seed=3) as ds:
        ds.load_state_dict({"epoch": 1, "yielded": 3, **world})
        opened = ds.shards_opened  # (the construction's check of decode opened one)
        with pytest.raises(ValueError, match=rf"state should be one of a job with this one's 1 "
                                             rf"ranks and 1 DataLoader workers, but got a state "
                                             rf"of {world['ranks']} ranks and "
                                             rf"{world['workers']} workers"):
            next(iter(ds))
        assert ds.shards_opened == opened
        ds.load_state_dict({"epoch": 1, "yielded": 2})  # an older state: no world to check
        assert len(list(ds)) == SHARDS * PER - 2


def test_a_random_decode_is_caught_at_construction(shm_dir, shards):
    urls, open_shard = shards

    def random_decode(raw):
        x, label = decode(raw)
        return x ^ torch.randint(1, 256, DIMS, dtype=torch.uint8), label

    with pytest.raises(RuntimeError, match=r"CachedStream: decode='random_decode' gave two "
                                           r"different values for the first sample.*pass it as "
                                           r"transform="):
        CachedStream(urls, open_shard, decode=random_decode, shard_lengths=[PER] * SHARDS,
                     size_limit_gib=1)
    assert named(shm_dir) == []


@pytest.mark.parametrize("last,match", [(PER + 1, r"held 10 samples, but shard_lengths says 11"),
                                        (PER - 1, r"held more than 9 samples, but shard_lengths "
                                                  r"says 9")])
def test_lengths_are_counted_and_checked(shm_dir, shards, last, match):
    urls, open_shard = shards
    with CachedStream(urls, open_shard, decode=decode, size_limit_gib=1) as ds:
        assert len(ds) == SHARDS * PER and ds.cache.dataset_len == SHARDS * PER
    with CachedStream(urls, open_shard, decode=decode, size_limit_gib=1, even=False,
                      shard_lengths=[PER] * (SHARDS - 1) + [last], name="wrong") as wrong:
        with pytest.raises(ValueError, match=match):
            list(wrong)
    assert named(shm_dir) == []


def test_a_loaded_state_gives_way_to_another_epoch(shm_dir, shards):
    urls, open_shard = shards
    with CachedStream(urls, open_shard, decode=decode, shard_lengths=[PER] * SHARDS,
                      size_limit_gib=1) as ds:
        ds.set_epoch(1)
        assert len(list(ds)) == SHARDS * PER
        state = ds.state_dict()
        assert state == {"epoch": 1, "yielded": SHARDS * PER, "ranks": 1, "workers": 1}
        ds.load_state_dict(state)
        assert list(ds) == []  # the saved epoch was over
        ds.load_state_dict(state)
        ds.set_epoch(2)  # a new epoch: the state of epoch 1 no longer applies
        assert len(list(ds)) == SHARDS * PER


@pytest.mark.parametrize("kw,error,match", [
    (dict(shards="a.tar"), TypeError, r"shards should be a non-empty list"),
    (dict(shards=[]), TypeError, r"shards should be a non-empty list"),
    (dict(open_shard=None), TypeError, r"open_shard should be a function"),
    (dict(shard_lengths=[PER]), ValueError, r"one length per shard \(6\), but got 1"),
    (dict(shuffle_buffer=0), ValueError, r"shuffle_buffer"),
    (dict(cache=SharedCache), TypeError, r"cache should be a SharedCache or OpenSizeCache"),
    (dict(shard_lengths=PER), TypeError, r"shard_lengths should be a list of ints"),
    (dict(shard_lengths=[PER] * 5 + [-1]), ValueError, r"shard_lengths\[5\]"),
    (dict(open_shard=lambda url: []), ValueError, r"open_shard\('.*train-0000.tar'\) gave no "
                                                  r"sample, but shard_lengths says 10"),
    (dict(open_shard=lambda url: None), TypeError, r"open_shard should return the shard's "
                                                   r"samples \(an iterable\)"),
    (dict(shuffle=True), TypeError, r"CachedStream got an unexpected keyword argument "
                                    r"'shuffle'"),
    (dict(even=1), TypeError, r"even should be True or False"),
])
def test_bad_arguments_are_refused(shm_dir, shards, kw, error, match):
    urls, open_shard = shards
    args = dict(shards=urls, open_shard=open_shard, decode=decode, size_limit_gib=1,
                shard_lengths=[PER] * SHARDS)
    args.update(kw)
    with pytest.raises(error, match=match):
        CachedStream(**args)
    assert named(shm_dir) == []


NODES_SHARDS, SLOTS = 8, 25  # 8 shards of 10 over 2 nodes: 4 a node, of which 2.5 fit


def node_ranks(shm_dir, shards, nodes=2, local=2, *, slots=SLOTS, job="a", **kw):
    """The ranks of a job of ``nodes`` simulated nodes of ``local`` ranks each, every node with
    its own shared-memory directory (as each machine has its own /dev/shm)."""
    urls, open_shard = shards
    budget = (slots * 200 + len(urls) * PER + 0.5) / 2**30  # 200-byte slots, an aux byte each
    ranks = []
    for node in range(nodes):
        node_dir = os.path.join(shm_dir, job, f"node{node}")
        os.makedirs(node_dir, exist_ok=True)
        for lr in range(local):
            world = World(rank=node * local + lr, world_size=nodes * local, local_rank=lr,
                          local_world_size=local, node_rank=node, num_nodes=nodes)
            ranks.append(CachedStream(urls, open_shard, decode=decode,
                                      shard_lengths=[PER] * len(urls), size_limit_gib=budget,
                                      world=world, shm_dir=node_dir, name="s",
                                      job_key=f"{job}{os.getpid()}", timeout=60,
                                      **kw))
    return ranks


@pytest.mark.timeout(180)
def test_two_nodes_cache_the_shards_they_read_and_read_every_sample_once(shm_dir, tmp_path):
    """2 simulated nodes x 2 ranks x 2 DataLoader workers, two epochs: every sample once an
    epoch over the 4 ranks; each node's cache holds samples of its own shards only (its first
    2.5 shards: 25 slots), so epoch 2 serves those from the node's cache, opens only the
    shards not wholly cached there, and decodes only their uncached samples."""
    shards = make_shards(tmp_path, NODES_SHARDS), OpenShard(str(tmp_path / "opened.log"))
    urls = shards[0]
    total = NODES_SHARDS * PER
    ranks = node_ranks(shm_dir, shards, even=False)
    layout = ranks[0].cache.layout
    assert isinstance(layout, ShardLayout) and layout.slots == SLOTS
    node_shards = [layout.shards_of(k).tolist() for k in range(2)]
    assert sorted(node_shards[0] + node_shards[1]) == list(range(NODES_SHARDS))
    assert [len(s) for s in node_shards] == [4, 4]
    held = [set(range(k * PER, k * PER + PER)) for k in range(NODES_SHARDS)]
    shards[1].opened()
    for epoch in range(2):
        before = [ranks[2 * k].cache.stats() for k in range(2)]
        seen, read_on = [], [[], []]
        for r, ds in enumerate(ranks):
            ds.set_epoch(epoch)
            got = epoch_of(ds, torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2))
            seen += got
            # a rank reads the shards of its own node only, every epoch
            assert {i // PER for i in got} <= set(node_shards[r // 2]), (epoch, r)
            read_on[r // 2] += got
        assert sorted(seen) == list(range(total)), epoch
        opened = sorted(shards[1].opened())
        hits = [ranks[2 * k].cache.stats(since=before[k])["hits"] for k in range(2)]
        print(f"epoch {epoch + 1}: hit rate {sum(hits) / total:.3f} (nodes {hits[0]}, "
              f"{hits[1]} of {len(read_on[0])}, {len(read_on[1])}); shards opened {len(opened)}")
        if epoch == 0:
            assert opened == sorted(os.path.basename(u) for u in urls) and hits == [0, 0]
        else:  # each node: its first 2 shards from its cache (not opened), 5 of the third
            assert hits == [SLOTS, SLOTS] and sum(hits) / total == 2 * SLOTS / total
            assert opened == sorted(os.path.basename(urls[s[k]]) for s in node_shards
                                    for k in (2, 3))
    for k in range(2):  # each node cached samples of its own shards, whole shards first
        cache = ranks[2 * k].cache
        cached = cache.cached_indices()
        assert cache.stored_mask(cached).all() and cache.stats()["filled"] == SLOTS
        assert set(cached.tolist()) == held[node_shards[k][0]] | held[node_shards[k][1]] | \
            set(range(node_shards[k][2] * PER, node_shards[k][2] * PER + 5))
        with copy.deepcopy(cache) as twin:  # a copy keeps the layout, so the same samples
            assert twin.layout == cache.layout and twin.stored_mask(cached).all()
            assert torch.equal(twin.get_slot(int(cached[0]))["item0"], value_of(int(cached[0]),
                                                                                 DIMS))
    # a worker's state resumes on its own rank only
    ranks[1].load_state_dict({"epoch": 1, "yielded": 3, "ranks": 4, "workers": 1, "nodes": 2,
                              "rank": 0})
    with pytest.raises(ValueError, match=r"state should be this rank's \(1\), but got the "
                                         r"state of rank 0"):
        next(iter(ranks[1]))
    for ds in reversed(ranks):
        ds.close()
    assert named(os.path.join(shm_dir, "a", "node0")) == [] == \
        named(os.path.join(shm_dir, "a", "node1"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_torchrun_agents_as_two_nodes_each_cache_their_own_shards(shm_dir, tmp_path):
    """Two real torchrun agents on 127.0.0.1 (--nnodes=2, 2 ranks each, 2 DataLoader workers a
    rank), each node with its own shared-memory directory: every sample once an epoch over the
    4 ranks, each rank reading its node's shards only, epoch 2 hitting each node's 25 slots;
    nothing left in either directory."""
    urls = make_shards(tmp_path, NODES_SHARDS)
    out, port = str(tmp_path / "seen"), free_port()
    agents = []
    for node in range(2):
        node_dir = os.path.join(shm_dir, f"node{node}")
        os.makedirs(node_dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
               str(CHILDREN / "stream_nodes.py"), out, str(SLOTS), *urls]
        agents.append(subprocess.Popen(
            cmd, env=rank_env(node_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True))
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=360)
        assert_ended_well(subprocess.CompletedProcess(agent.args, agent.returncode, stdout,
                                                      stderr))
    ranks = [json.loads(open(f"{out}.rank{r}").read()) for r in range(4)]
    for epoch in range(2):
        seen = [i for rank in ranks for i in rank["epochs"][epoch]["seen"]]
        assert sorted(seen) == list(range(NODES_SHARDS * PER)), epoch
        for rank in ranks:
            assert {i // PER for i in rank["epochs"][epoch]["seen"]} <= set(rank["shards"])
        hits = [ranks[2 * k]["epochs"][epoch]["hits"] for k in range(2)]
        print(f"real torchrun, epoch {epoch + 1}: node hits {hits}, hit rate "
              f"{sum(hits) / len(seen):.3f}")
        assert hits == ([0, 0] if epoch == 0 else [SLOTS, SLOTS])
    for node in range(2):
        node_dir = os.path.join(shm_dir, f"node{node}")
        assert named(node_dir) == [] and mappers(node_dir) == {}


def interrupted(ranks, workers, batches, resume=None):
    """Each rank of a job runs ``batches`` batches of epoch 1 under a StatefulDataLoader of
    ``workers`` workers (after loading ``resume``, a job_state), then saves its loader's state:
    (the samples yielded, each rank's state)."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    seen, states = [], []
    for ds in ranks:
        ds.set_epoch(1)
        if resume is not None:
            ds.load_state_dict(resume)
        loader = stateful.StatefulDataLoader(ds, batch_size=3, num_workers=workers)
        it = iter(loader)
        for _ in range(batches):
            seen += [index_of(x) for x in next(it)[0]]
        states.append(loader.state_dict())
        del it
    return seen, states


def rest_of_epoch(ranks, resume, workers):
    seen = []
    for ds in ranks:
        ds.set_epoch(1)
        ds.load_state_dict(resume)
        seen += epoch_of(ds, torch.utils.data.DataLoader(ds, batch_size=3, num_workers=workers))
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("even", [False, True])
def test_a_state_of_two_nodes_resumes_once_on_other_worlds(shm_dir, tmp_path, even):
    """Interrupted on 2 nodes x 2 ranks x 2 workers, resumed on 1 node x 3 ranks x 1 worker
    (job_state of the 4 ranks' StatefulDataLoader states), interrupted again and resumed on
    3 nodes x 1 rank x 2 workers: every sample of the epoch once over the three runs (with
    ``even``, at least once: each run pads its workers to the fullest); and the second run's
    own states resume on its own world."""
    pytest.importorskip("torchdata.stateful_dataloader")
    shards = make_shards(tmp_path, NODES_SHARDS), OpenShard(str(tmp_path / "opened.log"))
    total = NODES_SHARDS * PER
    first, states = interrupted(node_ranks(shm_dir, shards, job="a", even=even), 2, 3)
    job = CachedStream.job_state(states)
    assert (job["ranks"], job["workers"], job["nodes"]) == (4, 2, 2)
    assert sum(map(sum, job["yielded_by"])) == len(first) == 4 * 3 * 3
    second_ranks = node_ranks(shm_dir, shards, 1, 3, job="b", even=even)
    shards[1].opened()
    second, states = interrupted(second_ranks, 0, 4, resume=job)
    job2 = CachedStream.job_state(states)
    assert job2["after"] == job and (job2["ranks"], job2["workers"]) == (3, 1)
    rest = rest_of_epoch(node_ranks(shm_dir, shards, 3, 1, job="c", even=even), job2, 2)
    print(f"epoch 2 over three worlds: {len(first)} + {len(second)} + {len(rest)} samples")
    def once(seen):  # with even: every sample, some twice (padding)
        return sorted(set(seen) if even else seen)

    assert once(first + second + rest) == list(range(total))
    assert len(second) == sum(map(sum, job2["yielded_by"])) and len(rest) > 0
    # On the same world, a worker's own state resumes too (its count, in the rest's order).
    again = node_ranks(shm_dir, shards, 1, 3, job="d", even=even)
    for ds, st in zip(again, states):
        ds.set_epoch(1)
        ds.load_state_dict(st["dataset_state"])
    assert once(first + second + [i for ds in again for i in epoch_of(
        ds, torch.utils.data.DataLoader(ds, batch_size=3))]) == \
        list(range(total))


TWO = World(rank=1, world_size=2, node_rank=1, num_nodes=2)


@pytest.mark.parametrize("kw,error,match", [
    (dict(layout="shards"), TypeError, r"layout should be a CacheLayout or None, but got "
                                       r"layout='shards'"),
    (dict(layout=ShardLayout.for_shards([PER] * 5, 2)), ValueError,
     r"layout should be one of dataset_len=60 over the world's num_nodes=2"),
    (dict(layout=ShardLayout.for_shards([PER] * SHARDS, 3)), ValueError,
     r"layout should be one of dataset_len=60 over the world's num_nodes=2"),
    (dict(layout=ShardLayout.for_shards([PER] * SHARDS, 2), layout_seed=4), ValueError,
     r"with no layout_seed or random_subset besides"),
])
def test_a_layout_a_cache_cannot_take_is_refused(shm_dir, kw, error, match):
    with pytest.raises(error, match=match):
        SharedCache(1, SHARDS * PER, DIMS, world=TWO, **kw)
    assert named(shm_dir) == []


def test_a_cache_given_a_shard_layout_holds_its_nodes_shards(shm_dir):
    layout = ShardLayout.for_shards([PER] * SHARDS, 2, seed=5)
    budget = (2 * PER * DIMS[0] * 64 + SHARDS * PER + 0.5) / 2**30  # 20 slots
    with SharedCache(budget, SHARDS * PER, DIMS, world=TWO, layout=layout) as cache:
        mine = layout.shards_of(1)
        assert cache.layout == dataclasses.replace(layout, slots=20)
        assert cache.cached_indices().tolist() == [k * PER + j for k in mine[:2]
                                                   for j in range(PER)]
        assert [row.sum() for row in cache.owner_rows()] == [20, 20]
        assert sorted(np.concatenate([layout.shards_of(0), mine])) == list(range(SHARDS))


def test_a_persistent_stream_cache_of_another_number_of_nodes_is_not_taken(shm_dir):
    """A stream node's shards depend on the number of nodes (unlike CacheLayout's share), so
    the segment of node 0 of 2 is refused by node 0 of 3 (ShardLayout's seed digests the
    count), never served as if it held the 3-node share."""
    lengths = [PER] * SHARDS
    args = dict(size_limit_gib=1, dataset_len=SHARDS * PER, data_dims=DIMS, persistent=True,
                name="stream-nodes", key="k")
    try:
        for nodes in (2, 3):
            world = World(rank=0, world_size=nodes, node_rank=0, num_nodes=nodes)
            layout = ShardLayout.for_shards(lengths, nodes)
            if nodes == 2:
                SharedCache(world=world, layout=layout, **args).close()
                continue
            with pytest.raises(CacheConfigError, match=r"layout_seed"):
                SharedCache(world=world, layout=layout, **args)
    finally:
        clean_segments(shm_dir, persistent=["stream-nodes"])
    assert named(shm_dir) == []


W = {"epoch": 1, "ranks": 2, "workers": 1}


@pytest.mark.parametrize("states,error,match", [
    ([{**W, "yielded": 3}], ValueError, r"should hold every rank's state \(2 ranks of 1 "
                                        r"DataLoader workers saved them\), but got 1 ranks"),
    ([{**W, "yielded": 3}, {**W, "epoch": 2, "yielded": 1}], ValueError,
     r"states should be of one epoch of one job, but rank 0 worker 0 and rank 1 worker 0 "
     r"differ: epoch=1 and 2"),
    ([{**W, "yielded": 3, "nodes": 2, "rank": 1}, {**W, "yielded": 1, "nodes": 2, "rank": 0}],
     ValueError, r"states should be in rank order, but the state at rank 0 was saved by rank 1"),
    ([{"epoch": 1, "yielded": 3}, {"epoch": 1, "yielded": 2}], ValueError,
     r"states should record their world"),
    ([{"epoch": 1, "shuffle": 3}], ValueError, r"states\[0\]\[0\] should be a dict from "
                                                r"CachedStream.state_dict\(\)"),
    ({"epoch": 1, "yielded": 3}, TypeError, r"states should be a list with each rank's state"),
])
def test_states_that_are_not_one_jobs_are_refused(states, error, match):
    with pytest.raises(error, match=match):
        CachedStream.job_state(states)


def test_a_job_state_of_nothing_yielded_starts_the_epoch_afresh():
    job = CachedStream.job_state([{"epoch": 0, "yielded": 0}, {**W, "yielded": 0}])
    assert job == {"epoch": 1, "ranks": 2, "workers": 1, "nodes": 1, "yielded_by": [[0], [0]]}


def test_a_job_state_of_another_stream_is_refused(shm_dir, shards):
    """Rank 1 of 2 runs 3 of the 6 shards (30 samples): a count of 31 is another stream's."""
    urls, open_shard = shards
    with CachedStream(urls, open_shard, decode=decode, shard_lengths=[PER] * SHARDS,
                      size_limit_gib=1, even=False) as ds:
        job = CachedStream.job_state([{**W, "yielded": 30}, {**W, "yielded": 31}])
        with pytest.raises(ValueError, match=r"state\['yielded_by'\]\[1\]\[0\] should be at "
                                             r"most the 30 samples that worker runs in epoch 1, "
                                             r"but got 31: a state of another stream"):
            ds.load_state_dict(job)
        ds.load_state_dict(CachedStream.job_state([{**W, "yielded": 30}, {**W, "yielded": 29}]))
        ds.set_epoch(1)
        assert len(list(ds)) == 1  # the one sample that rank 1 had not yielded


@pytest.mark.parametrize("world,cache,match", [
    # uneven: 3 ranks over 2 nodes of 1 local rank (the deal counts each node's ranks)
    (World(rank=0, world_size=3, local_rank=0, local_world_size=1, node_rank=0, num_nodes=2),
     False, r"should run as many ranks on every node, but got world_size=3 over num_nodes=2"),
    # a disk tier: its share of a node's indices would be the default layout's
    (World(rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0, num_nodes=2),
     "tier", r"disk_tier is for one node in CachedStream"),
    # a cache of the default layout: its nodes would cache what they do not read
    (World(rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0, num_nodes=2),
     True, r"cache should have the layout of this stream over 2 nodes .*pass cache=None, or "
           r"make it with layout=ShardLayout.for_shards\(shard_lengths, 2, seed=0\)"),
])
def test_a_world_of_several_nodes_it_cannot_deal_is_refused_and_not_left(shm_dir, shards,
                                                                          tmp_path, world,
                                                                          cache, match):
    urls, open_shard = shards
    given = SharedCache(1, SHARDS * PER, DIMS, world=world, name="given") if cache is True \
        else None
    options = {} if cache is True else {"size_limit_gib": 1, "world": world}
    if cache == "tier":
        options["disk_tier"] = str(tmp_path)
    with pytest.raises(ValueError, match=match) as refused:
        CachedStream(urls, open_shard, given, decode=decode, shard_lengths=[PER] * SHARDS,
                     **options)
    if given is not None:
        given.get_slot(0)  # the caller's cache: still open, the caller closes it
        given.close()
    elif cache != "tier":  # (refused before a cache is made)  # The cache it made is closed, not left to the garbage collector (the traceback,
        # which a caller may keep, holds it).
        made = next(tb.tb_frame.f_locals["cache"] for tb in _frames(refused.tb)
                    if tb.tb_frame.f_code.co_name == "__init__" and "made" in
                    tb.tb_frame.f_locals)
        with pytest.raises(ValueError, match=r"closed"):
            made.get_slot(0)
        del made
    del refused
    assert list_segments(shm_dir) == []


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_the_stream_works_copied_next_to_stocaching_py(shm_dir, tmp_path):
    """streams.py copied beside stocaching.py, _common.py and masks.py, without wrapper.py: the
    copies import each other, not the package."""
    out = run_copied(tmp_path, ("stocaching.py", "_common.py", "masks.py", "streams.py"), """
        import os, stocaching, streams, torch
        assert os.path.dirname(stocaching.__file__) == os.getcwd()  # the copy, not the package
        assert streams.SharedCache is stocaching.SharedCache
        ds = streams.CachedStream([0, 1], lambda k: [torch.full((2,), 2 * k + j) for j in (0, 1)],
                                  shard_lengths=[2, 2], shuffle_buffer=1, size_limit_gib=0.001)
        print(sorted(int(x[0]) for x in ds))
        ds.close()
    """)
    assert out.strip() == "[0, 1, 2, 3]"
