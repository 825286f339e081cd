"""Ray Train (tested with ray 2.60.0): the sampler on an uneven placement, a cache inside a
pickle, and real TorchTrainer runs on this machine's CPUs (``tests/children/ray_train.py``),
skipped where ray is not installed. What its workers' variables tell a rank about the nodes,
and how the process group reconciles them, is in test_world.py.

Ray Train 2.60 sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and NODE_RANK in each worker
before it initialises the process group (``ray/train/torch/config.py``,
``_set_torch_distributed_env_vars``), and no GROUP_WORLD_SIZE: the number of nodes is not among
them. What two machines would show is run here as far as one machine allows: two Ray nodes on
one machine for Ray's variables, and host identities given by hand for the process group."""

from __future__ import annotations

import json
import pickle
import socket
import sys

import pytest
import torch
from torch.utils.data import Dataset

from _helpers import (CHILDREN, RAY_2_PLUS_1, assert_ended_well, assert_no_leak, named, rank_env,
                      run_bounded, value_of)
from stocaching import CacheAwareSampler, SharedCache, World, list_segments

DIMS = (3, 8, 8)


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
