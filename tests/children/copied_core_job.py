"""The README's Dataset over a copy of the core alone, as a user who copied one file runs it.

The test copies ``stocaching/stocaching.py`` and this file into an empty directory, with the
README's example block as ``readme_example.py``, and runs this file from there (no PYTHONPATH),
so ``import stocaching`` finds the copy and no feature module. Usage::

    python copied_core_job.py fork|spawn|mp_spawn     (torchrun: under torchrun, "torchrun")

Two epochs of 64 samples through a DataLoader with 2 workers (fork or spawn) on every rank;
the Dataset returns float32 (the README's random_augment after the cache). Prints one line a
rank: ``RESULT rank=R world=W file=F filled=N epoch2_hits=H epoch2_misses=M``.
"""

import os
import sys

import torch
import torch.distributed as dist

import stocaching

N = 64


def load_and_resize(path: str) -> torch.Tensor:
    """A decode stand-in: the same uint8 (3, 256, 256) image for the same path."""
    g = torch.Generator().manual_seed(int(path))
    return torch.randint(0, 256, (3, 256, 256), dtype=torch.uint8, generator=g)


def random_augment(x: torch.Tensor) -> torch.Tensor:
    """A random flip, then float32, as a training pipeline does after the cache."""
    x = x.flip(-1) if torch.rand(()) < 0.5 else x
    return x.float() / 255


with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "readme_example.py")) as f:
    exec(f.read())  # the README's block: defines MyDataset  # noqa: S102


def counters(cache) -> dict:
    s = cache.stats()
    return {"hits": s["hits"], "misses": s["misses"]}


def epochs(mode: str, rank: int, world: int) -> None:
    ds = MyDataset([str(i) for i in range(N)])  # noqa: F821 (from the README's block)
    context = "spawn" if mode == "spawn" else "fork"
    before = None
    for epoch in range(2):
        if world > 1:
            dist.barrier()  # every rank's epoch 1 is done before epoch 2's counters start
        if epoch == 1:
            before = counters(ds.cache)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2,
                                             multiprocessing_context=context)
        for batch in loader:
            assert batch.dtype == torch.float32 and batch.shape[1:] == (3, 256, 256)
    if world > 1:
        dist.barrier()
    after = counters(ds.cache)
    filled = ds.cache.stats()["filled"]
    # One write of the whole line: the ranks share this stdout, and print() writes the line
    # and its newline apart, which interleaved two ranks' lines.
    sys.stdout.write(f"RESULT rank={rank} world={world} file={stocaching.__file__} "
                     f"filled={filled} epoch2_hits={after['hits'] - before['hits']} "
                     f"epoch2_misses={after['misses'] - before['misses']}\n")
    sys.stdout.flush()
    ds.cache.close()
    if world > 1:
        dist.barrier()


def spawned(rank: int, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        epochs("mp_spawn", rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "torchrun":
        dist.init_process_group("gloo")
        try:
            epochs(mode, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    elif mode == "mp_spawn":
        torch.multiprocessing.spawn(spawned, args=(2, sys.argv[2]), nprocs=2)
    else:
        epochs(mode, 0, 1)
