"""Ray Train (tested with ray 2.60.0): what its workers' variables tell a rank about the
nodes, the sampler on an uneven placement, a cache inside a pickle, and real TorchTrainer runs
on this machine's CPUs (``tests/children/ray_train.py``), skipped where ray is not installed.

Ray Train 2.60 sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and NODE_RANK in each worker
before it initialises the process group (``ray/train/torch/config.py``,
``_set_torch_distributed_env_vars``), and no GROUP_WORLD_SIZE: the number of nodes is not among
them. What two machines would show is run here as far as one machine allows: two Ray nodes on
one machine for Ray's variables, and host identities given by hand for the process group."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import socket
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import stocaching.stocaching as core
from _helpers import (CHILDREN, assert_ended_well, assert_no_leak, free_port, named, rank_env,
                      run_bounded, value_of)
from stocaching import CacheAwareSampler, SharedCache, World, list_segments

DIMS = (3, 8, 8)

# What Ray Train 2.60 set in three workers it placed 2 + 1 on two Ray nodes
# (test_ray_places_three_workers_2_plus_1_... records it again on every run), by world rank.
RAY_2_PLUS_1 = {
    0: dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", NODE_RANK="0"),
    1: dict(RANK="1", WORLD_SIZE="3", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", NODE_RANK="0"),
    2: dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK="1"),
}


# ----------------------------------------------------------------------------------------------
# Launcher variables
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", range(4))
def test_rays_variables_of_an_even_placement_give_each_rank_its_world(rank):
    env = dict(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
               NODE_RANK=str(rank // 2))
    assert World.from_env(env) == World(rank=rank, world_size=4, local_rank=rank % 2,
                                        local_world_size=2, node_rank=rank // 2, num_nodes=2)


@pytest.mark.parametrize("rank", [0, 1])
def test_on_the_node_of_two_in_a_2_plus_1_placement_the_variables_refuse_to_count_the_nodes(
        rank):
    with pytest.raises(ValueError, match=r"WORLD_SIZE should be a multiple of LOCAL_WORLD_SIZE, "
                                         r"but got WORLD_SIZE=3, LOCAL_WORLD_SIZE=2, "
                                         rf"LOCAL_RANK={rank}, NODE_RANK=0: the number of "
                                         r"nodes cannot be derived from this node's variables "
                                         r"\(the ranks may be spread unevenly.*after "
                                         r"init_process_group"):
        World.from_env(RAY_2_PLUS_1[rank])


def test_on_the_node_of_one_in_a_2_plus_1_placement_the_variables_cannot_tell():
    """Its own variables are those of an even placement of three nodes: nothing in them can
    be refused, and the other node derives one node. That is why ``discover`` asks the
    process group under Ray."""
    assert World.from_env(RAY_2_PLUS_1[2]).num_nodes == 3


@pytest.mark.parametrize("env, match", [
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
          GROUP_WORLD_SIZE="2"),
     r"LOCAL_WORLD_SIZE \+ GROUP_WORLD_SIZE - 1 should be at most WORLD_SIZE \(each other node "
     r"runs a rank at least\), but got WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2"),
    (dict(LOCAL_RANK="0", NODE_RANK="1", WORLD_SIZE="4"),  # Lightning's, node 1, no group yet
     r"the node rank should be below WORLD_SIZE // LOCAL_WORLD_SIZE = 1 \(with no "
     r"LOCAL_WORLD_SIZE, every rank is on this node\), but got WORLD_SIZE=4, LOCAL_RANK=0, "
     r"NODE_RANK=1"),
    (dict(SLURM_PROCID="2", SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_NODEID="1",
          SLURM_NNODES="2"),
     r"SLURM_NTASKS should be a multiple of SLURM_NNODES, but got SLURM_NTASKS=3, "
     r"SLURM_NNODES=2, SLURM_NODEID=1: the tasks on this node cannot be derived"),
], ids=["GROUP_WORLD_SIZE too many", "NODE_RANK past the nodes", "SLURM tasks uneven"])
def test_variables_that_contradict_each_other_raise_naming_them(env, match):
    with pytest.raises(ValueError, match=match):
        World.from_env(env)
    with pytest.raises(ValueError, match=match):
        World.discover(env)  # no process group here: the variables decide


def test_torchrun_with_other_ranks_per_node_names_its_nodes_and_is_read_as_it_is():
    """torchrun may run another --nproc-per-node on each node; GROUP_WORLD_SIZE names the
    nodes then, and nothing has to be derived."""
    env = dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="1",
               GROUP_WORLD_SIZE="2")
    assert World.from_env(env) == World(rank=2, world_size=3, local_rank=0, local_world_size=1,
                                        node_rank=1, num_nodes=2)


# ----------------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------------


def _discover_as(rank: int, host: str, port: int, out) -> None:
    """One rank of a gloo group of three in a forked process, on the host it is told."""
    try:
        core._host_identity = lambda: host  # two machines cannot run here: see the test
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=3)
        w = World.discover(RAY_2_PLUS_1[rank])
        out.put((rank, [w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank,
                        w.num_nodes]))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.timeout(120)
def test_ranks_placed_2_plus_1_on_two_hosts_agree_on_the_nodes_through_the_process_group():
    """Three real gloo ranks with Ray's variables of a 2 + 1 placement. Their host identities
    are given by hand (ranks 0 and 1 on host A, rank 2 on host B): two machines cannot run
    here, and the exchange itself is real. Every rank finds two nodes, and its own."""
    ctx, port = mp.get_context("fork"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_discover_as, args=(r, "AAB"[r], port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == {0: [0, 3, 0, 2, 0, 2], 1: [1, 3, 1, 2, 0, 2], 2: [2, 3, 0, 1, 1, 2]}


class Discovering(Dataset):
    """Each item is what ``World.discover`` says in the process that reads it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> str:
        try:
            return repr(World.discover(dict(RAY_2_PLUS_1[0], WORLD_SIZE="1",
                                            LOCAL_WORLD_SIZE="1")))
        except RuntimeError as e:
            return str(e)


@pytest.mark.timeout(120)
def test_a_forked_dataloader_worker_is_refused_the_process_groups_collective(
        process_group_of_one):
    """A forked worker inherits the group, but a collective from it would run over the
    training process's connections; under Ray's variables the world needs one."""
    assert Discovering()[0] == repr(World())  # in the training process: asked the group
    loader = DataLoader(Discovering(), batch_size=None, num_workers=1,
                        multiprocessing_context="fork")
    (said,) = list(loader)
    assert said.startswith("a cache constructed in DataLoader worker 0 would have to ask the "
                           "process group"), said
    assert "construct the cache in the training process before the DataLoader starts" in said


# ----------------------------------------------------------------------------------------------
# The sampler on an uneven placement
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [
    World(rank=0, world_size=3, local_rank=0, local_world_size=2, node_rank=0, num_nodes=2),
    World(rank=2, world_size=3, local_rank=0, local_world_size=1, node_rank=1, num_nodes=2),
    World(rank=0, world_size=4, local_rank=0, local_world_size=3, node_rank=0, num_nodes=2),
], ids=["2+1, node 0", "2+1, node 1", "3+1, node 0"])
def test_cache_aware_sampler_refuses_a_cache_of_an_uneven_placement_and_says_how_to_even_it(
        world, shm_dir):
    # (timeout: no other local rank ever attaches, and the leader's close() waits for one while
    # a sibling process may be it, such as the tee of "pytest | tee log")
    cache = SharedCache(1e-4, 100, DIMS, shm_dir=shm_dir, world=world, timeout=3)
    try:
        with pytest.raises(ValueError, match=rf"world has world_size={world.world_size} ranks on "
                                             rf"num_nodes=2 nodes with local_world_size="
                                             rf"{world.local_world_size} on this one: uneven "
                                             r"placement is not supported.*Ray Train.*"
                                             r"resources_per_worker.*STRICT_SPREAD"):
            CacheAwareSampler(cache, batch_size=4)
    finally:
        cache.close()


# ----------------------------------------------------------------------------------------------
# A cache inside a pickle
# ----------------------------------------------------------------------------------------------


class LazyImages(Dataset):
    """The advice of the pickling TypeError: the cache made at first use, left out of a
    pickle."""

    def __init__(self, n: int = 50) -> None:
        self.n = n
        self._cache = None

    @property
    def cache(self) -> SharedCache:
        if self._cache is None:
            self._cache = SharedCache(1e-4, self.n, DIMS)
        return self._cache

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.cache.get_slot(i)
        if x is None:
            x = value_of(i, DIMS)
            self.cache.set_slot(i, x)
        return x


def test_a_pickled_cache_gives_advice_whose_pickle_builds_nothing_where_it_is_unpickled(shm_dir):
    ds = LazyImages()
    assert torch.equal(ds[3], value_of(3, DIMS))  # this process's cache
    with pytest.raises(TypeError, match=r"pickled only by multiprocessing .*Pool.*Queue.*Ray's, "
                                        r"sending a train_loop_config.* leave the cache out in "
                                        r"__getstate__ and create it at first use in the "
                                        r"process that reads it .*not in __setstate__.*"
                                        r"inside train_loop_per_worker.*copy\.copy.*deepcopy"):
        pickle.dumps(ds.cache)
    before = list_segments(shm_dir)
    twin = pickle.loads(pickle.dumps(ds))
    assert twin._cache is None and list_segments(shm_dir) == before  # nothing was built
    ds.cache.close()
    assert torch.equal(twin[4], value_of(4, DIMS))  # built here, at first use
    twin.cache.close()
    assert named(shm_dir) == []


# ----------------------------------------------------------------------------------------------
# Ray Train for real
# ----------------------------------------------------------------------------------------------


def train_with_ray(mode: str, shm_dir: str, out, timeout: float = 240) -> tuple[dict, list]:
    """Run ``ray_train.py`` in MODE to its end; its driver's record and its ranks' records."""
    pytest.importorskip("ray.train.torch", reason="ray[train] is not installed")
    r = run_bounded([sys.executable, str(CHILDREN / "ray_train.py"), str(out), mode],
                    env=rank_env(shm_dir, RAY_USAGE_STATS_ENABLED="0"), timeout=timeout)
    assert_ended_well(r)
    with open(out / "driver.json") as f:
        driver = json.load(f)
    ranks = []
    for name in sorted(p.name for p in out.glob("rank*.json")):
        with open(out / name) as f:
            ranks.append(json.load(f))
    return driver, ranks


def assert_read_every_index_once_hits_after_the_first_epoch(ranks: list[dict]) -> None:
    epochs = len(ranks[0]["epochs"])
    for e in range(epochs):
        got = sorted(i for rec in ranks for i, _ in rec["epochs"][e])
        assert got == list(range(len(got))) and len(got) == 240, f"epoch {e}: not each once"
        hits = [hit for rec in ranks for _, hit in rec["epochs"][e]]
        assert hits == [e > 0] * len(hits), f"epoch {e}: {sum(hits)} hits of {len(hits)}"
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1], "set_epoch was not called"


@pytest.mark.timeout(300)
def test_ray_workers_that_build_the_dataset_in_train_loop_per_worker_share_one_cache(
        private_shm_dir, tmp_path):
    """The recipe of docs/distributed.md: TorchTrainer, two CPU workers, the dataset made in
    train_loop_per_worker with a CacheAwareSampler, prepare_data_loader (which leaves it as it
    is) and two DataLoader workers each. One segment for the node, mapped by both ranks."""
    driver, ranks = train_with_ray("inside", private_shm_dir, tmp_path)
    assert driver["error"] is None
    assert [rec["world"] for rec in ranks] == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]
    for rec in ranks:
        assert rec["sampler"] == "CacheAwareSampler"
        assert set(rec["env"]) >= {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                   "NODE_RANK"} and "GROUP_WORLD_SIZE" not in rec["env"]
    assert_read_every_index_once_hits_after_the_first_epoch(ranks)
    ((segment, pids),) = driver["segments"].items()
    assert segment.endswith("_n0_ray") and {rec["pid"] for rec in ranks} <= set(pids)
    assert_no_leak(private_shm_dir)


@pytest.mark.timeout(300)
def test_a_dataset_holding_a_cache_in_train_loop_config_fails_at_fit_with_the_advice(
        private_shm_dir, tmp_path):
    driver, ranks = train_with_ray("driver", private_shm_dir, tmp_path)
    assert ranks == []
    assert driver["error"].startswith("TypeError: Could not serialize"), driver["error"][:500]
    assert "a SharedCache can be pickled only by multiprocessing" in driver["error"]
    assert "create it at first use in the process that reads it" in driver["error"]
    assert "build the Dataset inside train_loop_per_worker" in driver["error"]
    assert list(driver["segments"].values()) == [[driver["pid"]]]  # the driver's own only
    assert_no_leak(private_shm_dir)


@pytest.mark.timeout(300)
def test_the_advice_sent_in_train_loop_config_builds_one_cache_per_node(
        private_shm_dir, tmp_path):
    """The dataset made in the driver and read there once (the driver's own cache), then sent
    in train_loop_config: Ray unpickles it in its controller and in each worker, which builds
    nothing; the workers' CacheAwareSampler reads dataset.cache and makes one cache for the
    node. With the old advice (rebuild in __setstate__) this run made five segments."""
    driver, ranks = train_with_ray("lazy", private_shm_dir, tmp_path)
    assert driver["error"] is None
    assert [rec["world"] for rec in ranks] == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]
    others = {s: pids for s, pids in driver["segments"].items() if pids != [driver["pid"]]}
    assert len(driver["segments"]) == 2 and len(others) == 1, driver["segments"]
    (pids,) = others.values()
    assert {rec["pid"] for rec in ranks} <= set(pids) and driver["pid"] not in pids
    assert_read_every_index_once_hits_after_the_first_epoch(ranks)
    assert_no_leak(private_shm_dir)


def _second_loopback_address_works() -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError:
            return False
    return True


@pytest.mark.timeout(300)
def test_ray_places_three_workers_2_plus_1_and_the_process_group_reconciles_the_nodes(
        private_shm_dir, tmp_path):
    """Two Ray nodes on this machine (2 CPUs and 1 CPU, at two loopback addresses), three
    workers: Ray places them 2 + 1 and gives each node's workers that node's variables (those
    of RAY_2_PLUS_1). From them alone the ranks would disagree on the nodes (1 and 3); every
    rank asks the process group instead, which finds one machine of three ranks: one cache,
    read by all three."""
    if not _second_loopback_address_works():
        pytest.skip("a second Ray node needs the loopback address 127.0.0.2")
    driver, ranks = train_with_ray("uneven", private_shm_dir, tmp_path)
    assert driver["error"] is None
    assert len({rec["ray_node"] for rec in ranks}) == 2
    for rec in ranks:
        env = {k: v for k, v in rec["env"].items() if not k.startswith("MASTER_")}
        assert env == RAY_2_PLUS_1[rec["rank"]], rec["env"]
    assert [rec["world"] for rec in ranks] == [[r, 3, r, 3, 0, 1] for r in range(3)]
    assert_read_every_index_once_hits_after_the_first_epoch(ranks)
    ((segment, pids),) = driver["segments"].items()
    assert {rec["pid"] for rec in ranks} <= set(pids)
    assert_no_leak(private_shm_dir)
