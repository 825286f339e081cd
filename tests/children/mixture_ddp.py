"""One rank of tests/test_mixtures.py's torchrun test, started by ``torchrun --nproc_per_node=2``.

Three sub-datasets, each with its own cache (one per node, shared by both ranks), mixed with
size-proportional weights by a WeightedMixtureSampler that takes its rank and world size from
torch.distributed. Epochs 0 and 1 are read through a DataLoader; in epoch 2 rank 1 saves its
sampler's state after 5 indices, and every rank loads that one state into a fresh sampler and
reads the rest. Writes ``<out>/rank<r>.json``: the sampler's indices per epoch, rank 0's
per-sub-dataset hits and reads per epoch, and the resumed indices.
"""

import json
import os
import sys

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

from _helpers import TwoLineDataset, budget_for
from stocaching import MixtureDataset, SharedCache, WeightedMixtureSampler

SIZES, SLOTS, DIMS, CONSUMED = (24, 40, 16), (24, 20, 4), (4,), 5

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
parts = [TwoLineDataset(SharedCache(budget_for(m, DIMS, dataset_len=n) if m < n else 1e-4, n,
                                   DIMS, name=f"sub{k}", timeout=120), n)
         for k, (n, m) in enumerate(zip(SIZES, SLOTS))]
mix = MixtureDataset(parts)
sampler = WeightedMixtureSampler(mix, seed=3)
loader = DataLoader(mix, batch_size=4, sampler=sampler)
result = {"rank": sampler.rank, "num_replicas": sampler.num_replicas, "sizes": SIZES,
          "slots": [len(p.cache) for p in parts], "epochs": [], "hits": [], "reads": []}
for epoch in range(2):
    sampler.set_epoch(epoch)
    before = mix.stats()  # before the barrier: once past it, the other rank reads at once
    dist.barrier()
    expected = sampler.epoch_indices(epoch)
    seen = [i for idx, _, _ in loader for i in idx.tolist()]
    assert seen == mix.locate(expected)[1].tolist(), "the loader read what the sampler yielded"
    result["epochs"].append(expected.tolist())
    dist.barrier()  # both ranks done: the node's counters are final
    after = mix.stats(since=before)
    result["hits"].append([s["hits"] for s in after])
    result["reads"].append([s["hits"] + s["misses"] for s in after])
    dist.barrier()

sampler.set_epoch(2)
it = iter(sampler)
for _ in range(CONSUMED):
    next(it)
result["epochs"].append(sampler.epoch_indices(2).tolist())
states = [None, None]
dist.all_gather_object(states, sampler.state_dict())
fresh = WeightedMixtureSampler(mix, seed=3)
fresh.load_state_dict(states[1])  # rank 1's state, on every rank
result["consumed"] = states[1]["consumed"]
result["resumed"] = [int(i) for i in fresh]
assert np.array_equal(result["resumed"], result["epochs"][2][CONSUMED:])
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
for p in parts:
    p.cache.close()
dist.destroy_process_group()
