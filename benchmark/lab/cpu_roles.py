"""Where the data pipeline's CPU goes: the plain DataLoader against the Prefetcher, no training.

The latency benchmark's CPU-bound case (``python -m benchmark latency --cpu-bound-only``) shows
the prefetching arms slower than the plain DataLoader when nothing waits on storage. This tool
finds out which process pays: it iterates the same loader (the latency scenario's JPEGs, half
of them with a cache slot, 2 workers, batch 64, no emulated latency) for a few epochs without a
model, and prints the CPU seconds (user + system) of

- the training process itself (the sampler runs there, so the Prefetcher's bookkeeping too),
- the DataLoader workers (reaped children: decode and augment in arm (a), augment only when
  the Prefetcher has loaded the sample),
- the Prefetcher's loader processes (``processes=N``: the decodes they took over).

Arms alternate, ``--repeats`` times each; the load average is printed before and after. Run
from the repository root::

    python -m benchmark.lab.cpu_roles
    python -m benchmark.lab.cpu_roles --threads 32 --processes 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import psutil
import torch

import stocaching
from benchmark import data as D
from benchmark.latency import LatencyDataset, _gib


def run_arm(arm: str, root: str, args: argparse.Namespace) -> dict[str, float]:
    """One arm, ``args.epochs`` epochs: CPU seconds by role, the wall time and how many
    samples the Prefetcher loaded."""
    n, d = args.num_images, args.decoded_size
    staging = args.staging_slots if arm == "prefetcher" else 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*leaves no slots.*")
        cache = stocaching.SharedCache(_gib(n // 2, staging, n, 3 * d * d), n, (3, d, d),
                                       torch.uint8, name=f"cpuroles{os.getpid()}",
                                       staging_slots=staging)
    ds = LatencyDataset(root, n, d, 10, cache=cache)
    base = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    sampler = base if arm == "plain" else stocaching.Prefetcher(
        base, cache, ds.load, threads=args.threads, processes=args.processes)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2)
    loaders = []
    if arm == "prefetcher" and args.processes:
        loaders = [psutil.Process(p.pid) for p in sampler._procs._procs]  # their pids only
    t0, w0 = os.times(), time.perf_counter()
    l0 = sum(sum(p.cpu_times()[:2]) for p in loaders)
    try:
        for epoch in range(args.epochs):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for _ in loader:
                pass
        l1 = sum(sum(p.cpu_times()[:2]) for p in loaders)
        t1, wall = os.times(), time.perf_counter() - w0
    finally:
        if arm == "prefetcher":
            sampler.close()
        cache.close()
    return {"trainer": (t1.user - t0.user) + (t1.system - t0.system),
            "workers": (t1.children_user - t0.children_user)
            + (t1.children_system - t0.children_system),
            "loaders": l1 - l0, "wall": wall, "loaded": getattr(sampler, "loaded", 0),
            "left": getattr(sampler, "left", 0)}


def main(argv=None) -> dict[str, list[dict[str, float]]]:
    ap = argparse.ArgumentParser(prog="python -m benchmark.lab.cpu_roles",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=None,
                    help="where the JPEGs are (made if missing); default: the benchmark's")
    ap.add_argument("--num-images", type=int, default=1500)
    ap.add_argument("--decoded-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="Prefetcher threads (per process)")
    ap.add_argument("--processes", type=int, default=2, help="Prefetcher loader processes")
    ap.add_argument("--staging-slots", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    root, _ = D.ensure_dataset(args.data_dir or D.default_data_dir(args.num_images, 128, 90, 0, 10),
                               args.num_images, 128, progress=False)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.num_images} JPEGs, half with a slot, {args.epochs} epochs, no model; "
          f"Prefetcher(threads={args.threads}, processes={args.processes})")
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "prefetcher": []}
    for _ in range(args.repeats):
        for arm in rows:
            rows[arm].append(run_arm(arm, str(root), args))
            r = rows[arm][-1]
            print(f"  {arm:10s} trainer {r['trainer']:5.2f}  workers {r['workers']:5.2f}  "
                  f"loader processes {r['loaders']:5.2f}  total "
                  f"{r['trainer'] + r['workers'] + r['loaders']:5.2f} CPU s; wall "
                  f"{r['wall']:5.2f} s; prefetched {r['loaded']}, left {r['left']}", flush=True)
    print("medians:")
    for arm, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"  {arm:10s} trainer {med['trainer']:5.2f}  workers {med['workers']:5.2f}  "
              f"loader processes {med['loaders']:5.2f} CPU s")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return rows


if __name__ == "__main__":
    main()
