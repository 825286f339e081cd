"""One job of a training run that a launcher resizes, read through a Prefetcher with a window:
``torchrun --nproc_per_node=N resized_prefetch_job.py STATE_IN STATE_OUT BATCHES OUT``.

Each rank builds a cache of 600 indices, a CacheAwareSampler over it (batch_size 8) and a
Prefetcher over that with a window (its order reorders each rank's indices, ready first: a
third of the samples are cached before the epoch); it loads STATE_IN if it is not "-" (the
list of every rank's state, saved by a job of another size), iterates epoch 1 through a DataLoader with 2 workers for BATCHES batches ("all": to the
end of the epoch), and writes the indices it got to OUT.rank<R> (JSON). The ranks' states,
gathered with all_gather_object, are saved by rank 0 to STATE_OUT as one list.
"""

import json
import sys

import torch
import torch.distributed as dist

from stocaching import CacheAwareSampler, Prefetcher, SharedCache

N, BATCH = 600, 8


def load(i):
    return torch.full((4,), i % 251, dtype=torch.uint8)


class Indices(torch.utils.data.Dataset):
    def __init__(self):
        self.cache = SharedCache(1e-3, N, (4,), random_subset=True, staging_slots=64)

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = self.cache.get_slot(i)
        if x is None:
            x = load(i)
            self.cache.set_slot(i, x)
        assert torch.equal(x, load(i))
        return i


if __name__ == "__main__":
    state_in, state_out, batches, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    ds = Indices()
    if dist.get_rank() == 0:  # a third of the samples cached before the epoch: ready first
        for i in range(0, N, 3):
            ds.cache.set_slot(i, load(i), exist_ok=True)
    dist.barrier()
    sampler = Prefetcher(CacheAwareSampler(ds, batch_size=BATCH, seed=11), ds.cache, load,
                         window=16, threads=2)
    if state_in != "-":
        sampler.load_state_dict(torch.load(state_in))  # every saved rank's state, a list
    sampler.set_epoch(1)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)
    got = []
    for k, batch in enumerate(loader):
        if batches != "all" and k == int(batches):
            break
        got += batch.tolist()
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        json.dump(got, f)
    consumed = None if batches == "all" else int(batches) * BATCH
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, sampler.state_dict(consumed=consumed))
    if dist.get_rank() == 0:
        torch.save(states, state_out)
    dist.barrier()
    del loader
    sampler.close()
    ds.cache.close()
    dist.destroy_process_group()
