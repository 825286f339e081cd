"""Per-node cache hit rate of DistributedSampler vs CacheAwareSampler, simulated without processes.

Every rank of an ``n``-node job is built in this one process (index arithmetic only, no data):

- ``DistributedSampler`` (torch's, ``num_replicas = n * L``) with stocaching 0.2.1's layout, where
  every node caches the same first ``f * dataset_len`` indices: each node hits about ``f``;
- ``CacheAwareSampler`` with ``CacheLayout``: node k caches a random ``f`` of the dataset;
- the ideal ``E[min(B, X)] / B``, ``X ~ Binomial(n * B, f)``, ``B = batch_size * L``: a node
  cannot read more of a global batch from its cache than its share ``B`` or than the samples of
  the batch it caches. (It is exact for disjoint caches up to sampling without replacement, and
  an upper bound when ``n * f > 1`` makes the caches overlap.)

Run from the repository root::

    python -m benchmark.sampler_hit_rate
    python -m benchmark.sampler_hit_rate --batch-size 32 --local-world-size 4 --csv hit_rate.csv
    python -m benchmark.sampler_hit_rate --cost 10000000   # what the sampler costs, not hits
"""

from __future__ import annotations

import argparse
import csv
import time
import tracemalloc
from typing import Sequence

import numpy as np
from torch.utils.data import DistributedSampler

from stocaching import CacheAwareSampler, CacheLayout, ideal_hit_rate

NODES = (1, 2, 4, 8, 16)
FRACTIONS = (0.0625, 0.125, 0.25, 0.5)
COLUMNS = ("nodes", "cache_fraction", "nodes_x_fraction", "distributed_sampler",
           "cache_aware_sampler", "cache_aware_worst_node", "ideal", "cache_aware_over_ideal")


def per_node_rate(indices: Sequence[np.ndarray], cached: np.ndarray, local_world_size: int
                  ) -> np.ndarray:
    """Hit rate of each node: ``indices[r]`` are what rank r read, ``cached[k, i]`` whether
    node k caches index i."""
    hits = np.array([cached[r // local_world_size, idx].mean() for r, idx in enumerate(indices)])
    return hits.reshape(-1, local_world_size).mean(axis=1)


def simulate(num_nodes: int, fraction: float, dataset_len: int, batch_size: int,
             local_world_size: int, epochs: int, seed: int) -> dict[str, float]:
    """One row of the table: per-node hit rates over ``epochs`` epochs."""
    world = num_nodes * local_world_size
    slots = round(fraction * dataset_len)
    layout = CacheLayout(dataset_len, slots, num_nodes, seed=seed)
    cached = layout.owners()
    first_slots = np.zeros((num_nodes, dataset_len), dtype=bool)  # the 0.2.1 layout
    first_slots[:, :slots] = True
    ours = [CacheAwareSampler(layout, batch_size=batch_size, num_replicas=world, rank=r,
                              seed=seed, local_world_size=local_world_size)
            for r in range(world)]
    theirs = [DistributedSampler(range(dataset_len), num_replicas=world, rank=r, seed=seed)
              for r in range(world)]
    ours_rate, theirs_rate = np.zeros(num_nodes), np.zeros(num_nodes)
    for epoch in range(epochs):
        for s in ours + theirs:
            s.set_epoch(epoch)
        ours_rate += per_node_rate([np.fromiter(s, np.int64) for s in ours], cached,
                                   local_world_size) / epochs
        theirs_rate += per_node_rate([np.fromiter(s, np.int64) for s in theirs], first_slots,
                                     local_world_size) / epochs
    ideal = ideal_hit_rate(num_nodes, slots / dataset_len, batch_size * local_world_size)
    return {"nodes": num_nodes, "cache_fraction": fraction,
            "nodes_x_fraction": num_nodes * fraction,
            "distributed_sampler": theirs_rate.mean(), "cache_aware_sampler": ours_rate.mean(),
            "cache_aware_worst_node": ours_rate.min(), "ideal": ideal,
            "cache_aware_over_ideal": ours_rate.mean() / ideal if ideal else float("nan")}


def cost(dataset_len: int, nodes: Sequence[int], batch_size: int) -> None:
    """Print what rank 0's sampler costs with ``n`` nodes each caching ``1 / n`` of the data:
    construction (time, peak and kept memory from tracemalloc), building one epoch, and
    iterating it."""
    print(f"sampler cost; dataset_len={dataset_len}, f=1/nodes, batch_size={batch_size}, "
          "rank 0, one rank per node")
    print(f"{'nodes':>5} {'construct s':>12} {'peak MiB':>9} {'kept MiB':>9} {'epoch s':>8} "
          f"{'ns/index':>9}")
    for n in nodes:
        lay = CacheLayout(dataset_len, dataset_len // n, n, seed=0)
        tracemalloc.start()
        t = time.perf_counter()
        s = CacheAwareSampler(lay, batch_size=batch_size, num_replicas=n, rank=0)
        built = time.perf_counter() - t
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        t = time.perf_counter()
        s.epoch_indices(1)
        epoch = time.perf_counter() - t
        s.set_epoch(2)
        it = iter(s)  # builds epoch 2 here, then only yields
        t = time.perf_counter()
        k = sum(1 for _ in it)
        per = (time.perf_counter() - t) / k * 1e9
        print(f"{n:>5} {built:>12.2f} {peak / 2**20:>9.0f} {kept / 2**20:>9.0f} {epoch:>8.2f} "
              f"{per:>9.1f}")


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    """Print the hit-rate table; return its rows."""
    p = argparse.ArgumentParser(prog="python -m benchmark.sampler_hit_rate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset-len", type=int, default=2**17, help="default: %(default)s")
    p.add_argument("--batch-size", type=int, default=64, help="per rank; default: %(default)s")
    p.add_argument("--local-world-size", type=int, default=1,
                   help="ranks per node; default: %(default)s")
    p.add_argument("--epochs", type=int, default=2, help="default: %(default)s")
    p.add_argument("--nodes", type=int, nargs="+",
                   help=f"default: {' '.join(map(str, NODES))} (with --cost: 1 8 64)")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                   help="cache fraction f of each node; default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--csv", metavar="PATH", help="also write the table to PATH")
    p.add_argument("--cost", type=int, metavar="DATASET_LEN",
                   help="instead of hit rates, measure the sampler's time and memory with this "
                        "many indices for --nodes (default 1 8 64) and f = 1/nodes")
    args = p.parse_args(argv)
    if args.cost:
        cost(args.cost, args.nodes or [1, 8, 64], args.batch_size)
        return []
    args.nodes = args.nodes or list(NODES)

    t0 = time.perf_counter()
    rows = [simulate(n, f, args.dataset_len, args.batch_size, args.local_world_size,
                     args.epochs, args.seed) for n in args.nodes for f in args.fractions]
    print(f"per-node hit rate; dataset_len={args.dataset_len}, batch_size={args.batch_size} "
          f"per rank, {args.local_world_size} rank(s) per node, {args.epochs} epoch(s), "
          f"seed={args.seed}")
    print(f"{'nodes':>5} {'f':>7} {'n*f':>5} {'Distributed':>12} {'CacheAware':>11} "
          f"{'worst node':>11} {'ideal':>7} {'CA/ideal':>9}")
    for r in rows:
        print(f"{r['nodes']:>5} {r['cache_fraction']:>7.4f} {r['nodes_x_fraction']:>5.2f} "
              f"{r['distributed_sampler']:>12.3f} {r['cache_aware_sampler']:>11.3f} "
              f"{r['cache_aware_worst_node']:>11.3f} {r['ideal']:>7.3f} "
              f"{r['cache_aware_over_ideal']:>9.3f}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
