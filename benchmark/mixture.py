"""Weighted mixtures: ``python -m benchmark mixture``.

Two measurements, in one run:

1. **Shares and hit rates.** Three synthetic sub-datasets, each with its own ``SharedCache``
   holding a different fraction of it, mixed by ``WeightedMixtureSampler`` and read through a
   ``DataLoader`` for a few epochs. Per epoch and sub-dataset: the weight's share, the
   realised share of the epoch (``sampler.shares``), the share of what the loader read
   (``MixtureDataset.counts``), and the hits, reads and hit rate of its cache
   (``MixtureDataset.stats(since=...)``), next to the fraction of it that has a slot (the hit
   rate once every element has been read).
2. **Epoch build time.** Building the whole order of an epoch of 3 sub-datasets totalling
   10 M indices, for a few weightings, against the issue's 1 s target and against
   ``torch.randperm`` of the same length (what ``DistributedSampler`` does every epoch),
   measured in the same run; medians of ``--repeats``.

The "decode" is a deterministic function of the index (no files): what is measured is the
sampler and the caches, not image decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from stocaching import MixtureDataset, SharedCache, WeightedMixtureSampler

from . import arguments as A
from .two_lines import TwoLineDataset

BYTES_PER_GIB = 1024**3
TARGET_S = 1.0


class Synthetic(TwoLineDataset):
    """Sub-dataset ``tag``: the README's two-line pattern around a computed sample."""

    def __init__(self, tag: int, n: int, dims: tuple[int, ...], fraction: float) -> None:
        self.tag, self.n, self.dims = tag, n, dims
        slot = int(np.prod(dims))
        slots = round(fraction * n)
        # 0.2.1's sizing rule: slots * slot bytes + one aux byte per index (+ half a byte)
        budget = (slots * slot + n + 0.5) / BYTES_PER_GIB if slots < n else \
            (n * (slot + 1) + 1) / BYTES_PER_GIB
        self.cache = SharedCache(budget, n, dims, name=f"mixture-bench-{tag}")

    def __len__(self) -> int:
        return self.n

    def load(self, i: int) -> torch.Tensor:
        k = int(np.prod(self.dims))
        return ((torch.arange(k) * 7 + i * 13 + self.tag * 29) % 251).to(torch.uint8) \
            .reshape(self.dims)


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--sizes", type=A.positive_int, nargs="+", default=[3000, 1500, 500],
                   help="lengths of the sub-datasets (default: %(default)s)")
    p.add_argument("--weights", type=float, nargs="+", default=[0.5, 0.3, 0.2],
                   help="their weights (default: %(default)s: with the default sizes the first "
                        "is down-weighted, the second read once, the third twice per epoch)")
    p.add_argument("--cache-fractions", type=A.fraction, nargs="+", default=[1.0, 0.5, 0.2],
                   help="fraction of each sub-dataset its cache holds (default: %(default)s)")
    p.add_argument("--dims", type=A.positive_int, nargs="+", default=[3, 16, 16],
                   help="shape of a sample, uint8 (default: %(default)s)")
    p.add_argument("--epochs", type=A.positive_int, default=4, help="default: %(default)s")
    p.add_argument("--workers", type=A.non_negative_int, default=2,
                   help="DataLoader workers (default: %(default)s)")
    p.add_argument("--batch-size", type=A.positive_int, default=64, help="default: %(default)s")
    p.add_argument("--seed", type=A.non_negative_int, default=0, help="default: %(default)s")
    p.add_argument("--build-total", type=A.positive_int, default=10_000_000,
                   help="indices of the epoch whose build is timed, split 5:3:2 over 3 "
                        "sub-datasets (default: %(default)s)")
    p.add_argument("--repeats", type=A.positive_int, default=3,
                   help="builds timed per weighting; medians reported (default: %(default)s)")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def shares_and_hits(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict]:
    k = len(args.sizes)
    if len(args.weights) != k or len(args.cache_fractions) != k:
        raise SystemExit(f"--weights and --cache-fractions need one value per --sizes entry "
                         f"({k}), but got {len(args.weights)} and {len(args.cache_fractions)}")
    parts = [Synthetic(t, n, tuple(args.dims), f)
             for t, (n, f) in enumerate(zip(args.sizes, args.cache_fractions))]
    rows = []
    try:
        mix = MixtureDataset(parts)
        sampler = WeightedMixtureSampler(mix, args.weights, seed=args.seed, num_replicas=1,
                                         rank=0)
        loader = DataLoader(mix, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers)
        w = np.asarray(args.weights) / sum(args.weights)
        say(f"sub-datasets {args.sizes}, weights {args.weights}, caches holding "
            f"{args.cache_fractions} of each; epoch = {len(sampler)} indices; "
            f"{args.workers} workers, batch {args.batch_size}")
        say(f"{'epoch':>5} {'sub':>3} {'len':>6} {'weight':>7} {'realised':>8} {'read':>7} "
            f"{'count':>6} {'passes':>6} {'hits':>6} {'reads':>6} {'hit rate':>8} "
            f"{'slots/len':>9}")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            before = mix.stats()
            order = sampler.epoch_indices(epoch)
            t0 = time.perf_counter()
            n_read = 0
            for batch in loader:
                n_read += len(batch)
            wall = time.perf_counter() - t0
            read = mix.counts(order[:n_read])
            after = mix.stats(since=before)
            counts, realised = sampler.counts(epoch), sampler.shares(epoch)
            for t in range(k):
                s = after[t]
                reads = s["hits"] + s["misses"]
                row = {"epoch": epoch, "sub": t, "len": args.sizes[t], "weight": float(w[t]),
                       "realised": float(realised[t]), "read": float(read[t] / read.sum()),
                       "count": int(counts[t]), "passes": counts[t] / args.sizes[t],
                       "hits": s["hits"], "reads": reads, "hit_rate": s["hit_rate"],
                       "slots_fraction": s["slots"] / args.sizes[t], "wall_s": wall}
                rows.append(row)
                say(f"{epoch:>5} {t:>3} {row['len']:>6} {row['weight']:>7.3f} "
                    f"{row['realised']:>8.3f} {row['read']:>7.3f} {row['count']:>6} "
                    f"{row['passes']:>6.2f} {row['hits']:>6} {reads:>6} "
                    f"{row['hit_rate']:>8.1%} {row['slots_fraction']:>9.1%}")
        shares = np.asarray([[r["realised"] for r in rows if r["sub"] == t] for t in range(k)])
        say(f"mean realised share over {args.epochs} epochs: "
            + ", ".join(f"sub {t}: {shares[t].mean():.4f} (weight {w[t]:.4f})"
                        for t in range(k)))
    finally:
        for p in parts:
            p.cache.close()
    return rows


def build_times(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict]:
    total = args.build_total
    lengths = [total // 2, total * 3 // 10]
    lengths.append(total - sum(lengths))
    if min(lengths) < 1:
        raise SystemExit(f"--build-total should be at least 3, but got {total}")
    weightings = {"proportional to sizes": None, "equal (1, 1, 1)": [1, 1, 1],
                  "(0.7, 0.25, 0.05)": [0.7, 0.25, 0.05]}
    say(f"\nepoch build: 3 sub-datasets of {lengths} (total {total:,} indices), "
        f"median of {args.repeats}; baseline torch.randperm({total:,}) in the same run")
    rows = []
    for label, weights in weightings.items():
        s = WeightedMixtureSampler(lengths, weights, seed=args.seed, num_replicas=1, rank=0)
        mine, base = [], []
        for r in range(args.repeats):
            g = torch.Generator()
            g.manual_seed(args.seed + r)
            t0 = time.perf_counter()
            torch.randperm(total, generator=g)
            base.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            order = s.epoch_indices(r)  # what an iterator starts with (int64)
            mine.append(time.perf_counter() - t0)
            del order
        m, b = statistics.median(mine), statistics.median(base)
        verdict = "PASS" if m <= TARGET_S else "MISS"
        say(f"  [{verdict}] {label}: epoch built in {m:.3f} s (target <= {TARGET_S:.1f} s); "
            f"torch.randperm baseline {b:.3f} s, ratio {m / b:.2f}; counts "
            f"{s.counts(0).tolist()}")
        rows.append({"weights": label, "build_s": m, "randperm_s": b, "pass": m <= TARGET_S})
    return rows


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    say(f"start: {_uptime()}")
    shares_and_hits(args, say)
    build_times(args, say)
    say(f"end: {_uptime()}")
    return 0
