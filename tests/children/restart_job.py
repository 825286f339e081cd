"""A job that torchrun restarts: ``torchrun --max-restarts=1 ... restart_job.py OUT KILL_AT``.

Each rank builds a cache of all N indices and a CacheAwareSampler (batch_size 8). Attempt 0
goes through epoch 0, and after each step (a barrier, as a gradient all-reduce would be)
rank 0 saves the sampler's state at that batch boundary and every rank records the indices
it used; at step KILL_AT, rank 1 SIGKILLs itself in the middle of the step. The restarted
attempt loads the state, finishes epoch 0, then runs epoch 1. Every rank of each attempt
writes OUT/attempt<A>.rank<R>.json: the indices of epoch 0 it used (as of the last saved
state), the cache's filled slots when the attempt began, and, for epoch 1, how many of its
reads of indices that attempt 0 cached were hits, and whether any value read was wrong.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from stocaching import SharedCache

try:
    from stocaching import CacheAwareSampler
except ImportError:  # the core copied alone, with samplers.py beside it
    from samplers import CacheAwareSampler

N, BATCH = 480, 8


def value_of(i):
    return torch.full((16,), i % 251, dtype=torch.uint8)


class Indices(torch.utils.data.Dataset):
    def __init__(self):
        self.cache = SharedCache(1e-3, N, (16,), name="restart")
        self.hits = []  # (index, hit) of each read

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = self.cache.get_slot(i)
        self.hits.append((i, x is not None))
        if x is None:
            x = value_of(i)
            self.cache.set_slot(i, x)
        elif not torch.equal(x, value_of(i)):
            raise AssertionError(f"index {i} reads {x.tolist()}, a value it was never set to")
        return i


def dump(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    out, kill_at = sys.argv[1], int(sys.argv[2])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # A store of the attempt's own: in the agent's store, the restarted group's gloo found
    # the failed attempt's addresses and timed out connecting to them (torch 2.13).
    dist.init_process_group("gloo", init_method=f"file://{out}/store{attempt}",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    ds = Indices()
    filled = ds.cache.stats()["filled"]
    sampler = CacheAwareSampler(ds, batch_size=BATCH, seed=5)
    state_path = os.path.join(out, "state.pt")
    if attempt > 0:
        sampler.load_state_dict(torch.load(state_path))
    record_path = os.path.join(out, f"attempt{attempt}.rank{rank}.json")
    record = {"filled_at_start": filled, "epoch0": [], "pid": os.getpid()}
    for epoch in range(sampler.epoch, 2):
        sampler.set_epoch(epoch)
        start = sampler.state_dict()["consumed"]
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler)
        ds.hits = []
        for step, batch in enumerate(loader):
            if attempt == 0 and rank == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # in the middle of a step
            dist.barrier()
            if epoch == 0:
                record["epoch0"] += batch.tolist()
                if rank == 0:
                    torch.save(sampler.state_dict(consumed=start + (step + 1) * BATCH),
                               state_path + ".tmp")
                    os.replace(state_path + ".tmp", state_path)
                dump(record_path, record)
                dist.barrier()  # (the state and the records agree)
        if epoch == 1:
            record["epoch1"] = ds.hits
    dump(record_path, record)
    dist.barrier()
    ds.cache.close()
    dist.destroy_process_group()
