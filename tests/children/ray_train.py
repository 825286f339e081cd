"""Two CPU workers trained by Ray Train on one cached dataset, as
``python ray_train.py OUT MODE``.

MODE says where the dataset is made:

* "inside": in ``train_loop_per_worker``, a ``SharedCache`` in its constructor (the recipe of
  docs/distributed.md);
* "driver": in this driver, with a ``SharedCache`` in its constructor, and sent to the workers
  in ``train_loop_config`` (what the cache's ``TypeError`` refuses);
* "lazy": in this driver, with the cache made at first use and left out of its pickle (the
  advice of that ``TypeError``), read once here (so this driver holds a cache of its own) and
  sent in ``train_loop_config``;
* "uneven": as "inside", but with three workers over two Ray nodes on this one machine, one
  of 2 CPUs and one of 1 CPU at another loopback address (``ray.cluster_utils.Cluster``),
  so that Ray places them 2 + 1 and sets the variables of an uneven placement. Both Ray nodes
  share this machine's /dev/shm: one node, for the cache.

The workers build a ``CacheAwareSampler``, pass their loader through ``prepare_data_loader``
and train ``EPOCHS`` epochs. Each writes ``OUT/rank<r>.json``: the launcher variables Ray set
in it, the world its cache found, its pid, the address of its Ray node, the type of its loader's sampler, and per epoch
the indices it read with whether each was a hit. This driver writes ``OUT/driver.json``: its
pid, the pids of the workers' Ray actors, every stocaching segment that any process mapped
while ``fit()`` ran (its path and the pids seen mapping it; polled every 20 ms) and, in
"driver" mode, the error ``fit()`` raised.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, Dataset

from _helpers import value_of
from stocaching import CacheAwareSampler, SharedCache, list_segments

LEN, DIMS, BATCH, EPOCHS = 240, (3, 8, 8), 8, 3  # 240: 2 or 3 ranks read it without padding
VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def read(cache: SharedCache, i: int) -> tuple[torch.Tensor, int, bool]:
    x = cache.get_slot(i)
    hit = x is not None
    if x is None:
        x = value_of(i, DIMS)  # the "decode"
        cache.set_slot(i, x)
    return x, i, hit


class Images(Dataset):
    """The recipe: the cache made in the constructor, so make the dataset in each worker."""

    def __init__(self, n: int = LEN) -> None:
        self.n = n
        self.cache = SharedCache(0.001, n, DIMS, name="ray", timeout=60)  # 1 MiB: all fit

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return read(self.cache, i)


class LazyImages(Dataset):
    """The TypeError's advice: the cache is made at first use, in the process that reads it,
    and left out of a pickle, so an unpickled copy holds none until it is read."""

    def __init__(self, n: int = LEN) -> None:
        self.n = n
        self._cache = None

    @property
    def cache(self) -> SharedCache:
        if self._cache is None:
            self._cache = SharedCache(0.001, self.n, DIMS, name="ray", timeout=60)
        return self._cache

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return read(self.cache, i)


def train(config: dict) -> None:
    ds = config["dataset"] if "dataset" in config else Images()
    sampler = CacheAwareSampler(ds, batch_size=BATCH)  # reads ds.cache: a lazy one is made here
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler,
                        num_workers=config["loader_workers"])
    loader = ray.train.torch.prepare_data_loader(loader)
    model = ray.train.torch.prepare_model(torch.nn.Linear(3 * 8 * 8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs: list[list[list]] = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        read_now = []
        for x, i, hit in loader:
            read_now += [[int(a), bool(b)] for a, b in zip(i, hit)]
            loss = model(x.float().flatten(1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        epochs.append(read_now)
    rank = ray.train.get_context().get_world_rank()
    w = ds.cache.world
    record = {"rank": rank, "pid": os.getpid(), "epochs": epochs,
              "ray_node": ray.util.get_node_ip_address(),
              "env": {k: os.environ[k] for k in VARIABLES if k in os.environ},
              "world": [w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank,
                        w.num_nodes],
              "sampler": type(loader.sampler).__name__}
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


class Segments(threading.Thread):
    """Every stocaching segment of STOCACHING_SHM_DIR that any process maps, polled. A
    segment being made (state "starting": the leader's temporary name, an instant before it
    is published under its own) is not one more segment: it is skipped, or a poll that lands
    in that instant would count the cache twice."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.shm = os.environ["STOCACHING_SHM_DIR"]
        self.seen: dict[str, set[int]] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.02):
            for s in list_segments(self.shm):
                if s["state"] != "starting":
                    self.seen.setdefault(s["path"], set()).update(s["pids"])


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    assert os.environ.get("STOCACHING_SHM_DIR"), "the test gives the segments a folder"
    t0 = time.monotonic()
    cluster = None
    if mode == "uneven":
        from ray.cluster_utils import Cluster

        # Each Ray node starts its workers from its own raylet, and the cache's job key is
        # derived from the parent process: on one real machine all the workers of a job are
        # the raylet's children. Here two raylets share the machine, so the key is given.
        os.environ["STOCACHING_JOB_KEY"] = f"ray-uneven-{os.getpid()}"
        here = ray.util.get_node_ip_address()
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=2, include_dashboard=False, node_ip_address=here))
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.2" if here != "127.0.0.2"
                         else "127.0.0.3")
        ray.init(address=cluster.address)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    started = time.monotonic() - t0
    workers = 3 if mode == "uneven" else 2
    config: dict = {"out": out, "loader_workers": 0 if mode == "uneven" else 2}
    if mode == "driver":
        config["dataset"] = Images()
    elif mode == "lazy":
        config["dataset"] = LazyImages()
        assert torch.equal(config["dataset"][0][0], value_of(0, DIMS))  # a cache of its own
    watch = Segments()
    watch.start()
    error = None
    t1 = time.monotonic()
    try:
        TorchTrainer(train, train_loop_config=config,
                     scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                     run_config=RunConfig(storage_path=os.path.join(out, "ray_results"),
                                          name=mode)).fit()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        error = f"{type(e).__name__}: {e}"
    fitted = time.monotonic() - t1
    watch.stopping.set()
    watch.join()
    with open(os.path.join(out, "driver.json"), "w") as f:
        json.dump({"pid": os.getpid(), "error": error, "ray_init_s": started, "fit_s": fitted,
                   "segments": {p: sorted(pids) for p, pids in watch.seen.items()}}, f)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
