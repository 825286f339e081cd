"""Two simulated nodes on one machine: a real ``torchrun --nnodes=2`` run, twice on 127.0.0.1.

Run: ``python -m benchmark.two_nodes [--dataset-len 8192] [--fraction 0.25] [--epochs 3]``

Each "node" is its own torchrun agent with its own local ranks and its own SharedCache segment
(as two machines would have), caching a random half-disjoint part of the dataset given by
``CacheLayout``. The job runs once with torch's ``DistributedSampler`` and once with
``CacheAwareSampler``; every rank reads through its node's cache, and the per-node hit rates of
the epochs after the first come from ``cache.stats()``. gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import torch

from .two_lines import TwoLineDataset


class _Filled(TwoLineDataset):
    """The two lines over samples of ``dims`` filled with ``i % 256`` (the "decode"); an item
    is its index."""

    def __init__(self, cache: Any, n: int, dims: tuple[int, ...]) -> None:
        self.cache, self.n, self.dims = cache, n, dims

    def __len__(self) -> int:
        return self.n

    def load(self, i: int) -> torch.Tensor:
        return torch.full(self.dims, i % 256, dtype=torch.uint8)

    def item(self, i: int, x: torch.Tensor, hit: bool) -> int:
        return i


def _worker(args: argparse.Namespace) -> None:
    """One rank: build the cache of its node, run the epochs, report per-epoch stats."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from stocaching import CacheAwareSampler, SharedCache, World

    dist.init_process_group("gloo")
    world = World.from_env()
    dims = (3, 16, 16)
    slot_bytes = 3 * 16 * 16
    gib = (int(args.fraction * args.dataset_len) * slot_bytes + args.dataset_len) / 2**30
    cache = SharedCache(gib, args.dataset_len, dims, name="twonodes", layout_seed=args.seed)
    ds = _Filled(cache, args.dataset_len, dims)
    if args.sampler == "cache-aware":
        sampler = CacheAwareSampler(cache, batch_size=args.batch_size, seed=args.seed)
    else:
        sampler = DistributedSampler(ds, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    rows = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        before = cache.stats()
        seen = [i for batch in loader for i in batch.tolist()]
        dist.barrier()  # every local rank's reads are in the node's stats
        after = cache.stats()
        hits = after["hits"] - before["hits"]
        reads = hits + after["misses"] - before["misses"]
        gathered = [None] * world.world_size
        dist.all_gather_object(gathered, seen)
        everyone = sorted(i for part in gathered for i in part)
        rows.append({"epoch": epoch, "node": world.node_rank, "rank": world.rank,
                     "node_hit_rate": hits / reads if reads else float("nan"),
                     "slots": after["slots"],
                     "covers_all": everyone[: args.dataset_len] == list(range(args.dataset_len))})
    out = [None] * world.world_size
    dist.all_gather_object(out, rows)
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump([r for part in out for r in part], f)
    cache.close()
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous of agents on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(sampler: str, args: argparse.Namespace) -> list[dict]:
    """Start two torchrun agents (node 0 and node 1) and return the ranks' rows."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("STOCACHING_JOB_KEY", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--nproc_per_node={args.nproc_per_node}", "--master_addr=127.0.0.1",
               f"--master_port={port}"]
        tail = ["-m", "benchmark.two_nodes", "--worker", "--sampler", sampler,
                "--dataset-len", str(args.dataset_len), "--fraction", str(args.fraction),
                "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
                "--workers", str(args.workers), "--seed", str(args.seed), "--out", out]
        procs = [subprocess.Popen(cmd + [f"--node_rank={k}"] + tail, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for k in range(2)]
        logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        for p, log in zip(procs, logs):
            if p.returncode != 0:
                raise RuntimeError(f"a torchrun agent failed ({p.returncode}):\n{log[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset-len", type=int, default=8192)
    ap.add_argument("--fraction", type=float, default=0.25, help="cached per node")
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--sampler", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    results = {s: run(s, args) for s in ("distributed", "cache-aware")}
    print(f"two nodes on 127.0.0.1, {args.nproc_per_node} rank(s) each, dataset_len="
          f"{args.dataset_len}, f={args.fraction} per node, batch {args.batch_size} per rank")
    print("sampler       epoch  node 0 hit rate  node 1 hit rate  every index once")
    for s, rows in results.items():
        for epoch in range(1, args.epochs):
            per_node = {}
            for r in rows:
                if r["epoch"] == epoch and r["rank"] % args.nproc_per_node == 0:
                    per_node[r["node"]] = r
            print(f"{s:12s}  {epoch:5d}  {per_node[0]['node_hit_rate']:15.3f}  "
                  f"{per_node[1]['node_hit_rate']:15.3f}  "
                  f"{all(r['covers_all'] for r in rows if r['epoch'] == epoch)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
