"""One rank of a CachedStream job over two nodes: ``torchrun --nnodes=2 --nproc_per_node=2
--node_rank=K stream_nodes.py OUT SLOTS URL...`` (each node's agent with its own
STOCACHING_SHM_DIR, as each machine has its own /dev/shm).

Each rank streams WebDataset shards of 10 samples (``x.bin``: value_of(i) bytes) through a
DataLoader of 2 workers for two epochs with a cache of SLOTS slots a node, and writes
OUT.rank<R> (JSON): per epoch, the indices it got (checked against value_of) and its node's
cache hits in that epoch (after a barrier: every local rank's reads counted)."""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds

from _helpers import value_of
from stocaching import CachedStream, World

DIMS, PER = (3, 8, 8), 10
BY_FIRST = {int(value_of(i, DIMS)[0, 0, 0]): i for i in range(251)}


def open_shard(url):
    return wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None,
                          empty_check=False)


def decode(raw):
    return torch.from_numpy(np.frombuffer(raw["x.bin"], np.uint8).copy()).reshape(DIMS)


if __name__ == "__main__":
    out, slots, urls = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    world = World.discover()
    budget = (slots * 192 + len(urls) * PER + 0.5) / 2**30  # 192-byte slots, an aux byte each
    ds = CachedStream(urls, open_shard, decode=decode, shard_lengths=[PER] * len(urls),
                      size_limit_gib=budget, name="stream", even=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        dist.barrier()
        before = ds.cache.stats()
        seen = []
        for batch in loader:
            for x in batch:
                i = BY_FIRST[int(x[0, 0, 0])]
                assert torch.equal(x, value_of(i, DIMS)), i
                seen.append(i)
        dist.barrier()
        epochs.append({"seen": seen, "hits": ds.cache.stats(since=before)["hits"]})
    with open(f"{out}.rank{world.rank}", "w") as f:
        json.dump({"node": world.node_rank, "epochs": epochs,
                   "shards": ds.cache.layout.shards_of(world.node_rank).tolist()}, f)
    dist.barrier()
    ds.close()
    dist.destroy_process_group()
