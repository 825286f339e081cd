"""The CPU the Prefetcher's own machinery costs a load:
``python -m benchmark.lab.prefetch_cost``.

A ``Prefetcher`` over a plain order of ``--samples`` indices, every one a miss, with a trivial
load (one preallocated 3x64x64 tensor: no decode, no storage), iterated as a ``DataLoader``
would iterate its sampler, with the dataset's ``get_slot`` after each index. As in the latency
scenario, the cache has slots for half the indices (``--cached-fraction``); the other half's
samples go through staging slots (1,024), written by a loader process and read back once. What is left is the
machinery: the jobs and their results between the training process and the loader processes,
the waits, the writes into the cache. Printed: the CPU of the training process per index and
of the loader processes per load (user + system), and the wall time.

``--before DIR`` runs the same with the ``stocaching`` package found in ``DIR`` (for example an
older commit's: ``git worktree add /tmp/before <commit>``, then ``--before /tmp/before``),
alternating with this checkout's, ``--repeats`` times each, each run in a process of its own:
the machine is shared and noisy, so compare the two in the same run. Load averages are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmark import arguments as A

HERE = Path(__file__).resolve().parents[2]  # the checkout this module belongs to


def measure(samples: int, threads: int, processes: int, lookahead: int | None = None,
            fraction: float = 0.5) -> dict[str, float]:
    """One run in this process, with whichever ``stocaching`` it imports."""
    import psutil
    import torch

    import stocaching

    x = torch.zeros(3, 64, 64, dtype=torch.uint8)

    def load(i: int) -> torch.Tensor:
        return x

    slots, staging = round(fraction * samples), 1024
    gib = ((slots + staging) * x.numel() + samples + 0.5) / 2**30  # the sizing rule
    cache = stocaching.SharedCache(gib, samples, tuple(x.shape), torch.uint8,
                                   name=f"prefetchcost{os.getpid()}", staging_slots=staging)
    pf = stocaching.Prefetcher(list(range(samples)), cache, load, threads=threads,
                               processes=processes, lookahead=lookahead,
                               stand_aside=False)
    try:
        # The loader processes: this process's children, but multiprocessing's resource
        # tracker if one started.
        loaders = [c for c in psutil.Process().children()
                   if not any("resource_tracker" in a for a in c.cmdline())]
        time.sleep(0.3)  # the loader processes started

        def loader_cpu() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in loaders)

        l0, t0, w0 = loader_cpu(), os.times(), time.perf_counter()
        for i in pf:
            cache.get_slot(i)
        wall, t1, l1 = time.perf_counter() - w0, os.times(), loader_cpu()
        return {"wall_s": wall, "loaded": pf.loaded, "slots": len(cache),
                "trainer_us_per_index": 1e6 * (t1.user + t1.system - t0.user - t0.system)
                / samples,
                "loaders_us_per_load": 1e6 * (l1 - l0) / max(1, pf.loaded)}
    finally:
        pf.close()
        cache.close()


def run_with(package_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """``measure`` in a new process that imports ``stocaching`` from ``package_dir``."""
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); "
            f"from benchmark.lab.prefetch_cost import measure; "
            f"print(json.dumps(measure({args.samples}, {args.threads}, {args.processes}, "
            f"{args.lookahead}, {args.cached_fraction})))")
    env = {**os.environ, "PYTHONPATH": str(package_dir)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run, print, and return every run's figures by arm ('this checkout', 'before')."""
    p = argparse.ArgumentParser(prog="python -m benchmark.lab.prefetch_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=A.positive_int, default=12000, help="default: %(default)s")
    p.add_argument("--threads", type=A.positive_int, default=32, help="default: %(default)s")
    p.add_argument("--processes", type=A.positive_int, default=2, help="default: %(default)s")
    p.add_argument("--lookahead", type=A.positive_int, default=None,
                   help="default: the Prefetcher's (4 x threads x processes)")
    p.add_argument("--cached-fraction", type=A.fraction, default=0.5,
                   help="indices with a slot; the others are staged (default: %(default)s)")
    p.add_argument("--repeats", type=A.positive_int, default=3, help="default: %(default)s")
    p.add_argument("--before", type=Path, default=None,
                   help="a directory holding an older stocaching package, run alternately")
    args = p.parse_args(argv)
    if args.before is not None and not (args.before / "stocaching" / "prefetch.py").exists():
        p.error(f"--before should be a directory holding stocaching/prefetch.py, but got "
                f"--before={args.before}")
    arms = [("this checkout", HERE)] + ([("before", args.before)] if args.before else [])
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.samples} misses, a trivial load, threads={args.threads}, "
          f"processes={args.processes}, lookahead={args.lookahead or 'default'}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in arms}
    for k in range(args.repeats):
        for name, where in (arms if k % 2 == 0 else arms[::-1]):
            r = run_with(where, args)
            results[name].append(r)
            print(f"  {name:>13}: wall {r['wall_s']:.2f} s, trainer {r['trainer_us_per_index']:.0f}"
                  f" us CPU an index, loader processes {r['loaders_us_per_load']:.0f} us CPU a "
                  f"load ({r['loaded']} loaded, {r['slots']} slots)", flush=True)
    for name, rs in results.items():
        med = {key: statistics.median(r[key] for r in rs)
               for key in ("wall_s", "trainer_us_per_index", "loaders_us_per_load")}
        print(f"{name} (median of {len(rs)}): trainer {med['trainer_us_per_index']:.0f} us CPU "
              f"an index, loader processes {med['loaders_us_per_load']:.0f} us CPU a load, "
              f"wall {med['wall_s']:.2f} s")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return results


if __name__ == "__main__":
    main()
