"""Command line: ``python -m benchmark [run|sweep|analyze|latency|quality|mixture|persistent|elastic|device|tier|stream|peers] ...``
omitted).

    python -m benchmark                                   # the default run, a few minutes
    python -m benchmark --cache-fraction 0 0.25 0.5 0.75 1 --epochs 4
    python -m benchmark --read-latency-ms 5               # emulate network storage
    python -m benchmark --cache-fraction 0.5 1 --tiered-fraction 0.5  # + a disk tier arm
    python -m benchmark sweep --workers 1 2 4 --read-latency-ms 0 5
    python -m benchmark analyze benchmark-results/<stamp>/results.csv
    torchrun --nproc_per_node=2 -m benchmark              # DDP, one cache per node
    python -m benchmark latency                           # EMULATED storage latency, Prefetcher
    python -m benchmark quality                           # accuracy and batch diversity, digits
    python -m benchmark mixture                           # weighted mixtures: shares, hits, build
    python -m benchmark persistent                        # a cache that outlives its job
    python -m benchmark elastic                           # restarts and resizes, torchrun agents
    python -m benchmark device                            # batches straight to the device
    python -m benchmark tier                              # the disk tier alone
    python -m benchmark stream                            # WebDataset shards, cached or not
    python -m benchmark peers                             # LitData, MosaicML, WebDataset, FFCV
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import multiprocessing as mp
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from . import arguments as A

SUBCOMMANDS = ("run", "sweep", "analyze", "latency", "quality", "mixture", "persistent", "elastic",
               "device", "tier", "stream", "peers")


def _default_start_method() -> str:
    return mp.get_all_start_methods()[0]  # the platform's default, as the DataLoader uses


def _add_common(p: argparse.ArgumentParser, *, sweep: bool) -> None:
    def grid(default: Any) -> dict[str, Any]:
        return {"nargs": "+", "default": default} if sweep else {"default": default}

    d = p.add_argument_group("dataset (generated once, then reused)")
    d.add_argument("--data-dir", type=Path, default=None,
                   help="where the JPEGs live (default: ~/.cache/stocaching-benchmark/<params>)")
    d.add_argument("--num-images", type=A.positive_int, default=None,
                   help="dataset size (default: 6000, or 1500 with --sizes varied)")
    d.add_argument("--sizes", choices=("fixed", "varied"), default="fixed",
                   help="fixed: square JPEGs of --image-size, resized to --decoded-size before "
                        "the cache; varied: height and width each drawn from --sides, cached "
                        "at native size (data_dims=(3, None, None)) and cropped to "
                        "--decoded-size after the cache (default: %(default)s)")
    d.add_argument("--sides", type=A.positive_int, nargs=2, default=[192, 512],
                   metavar=("LO", "HI"),
                   help="with --sizes varied: range of the sides in pixels, both included; LO "
                        "at least --decoded-size (default: 192 512, about the sizes of ImageNet's "
                        "photos)")
    d.add_argument("--image-size", type=A.positive_int, default=512,
                   help="side of the source JPEGs in pixels, with --sizes fixed "
                        "(default: %(default)s)")
    d.add_argument("--decoded-size", type=A.positive_int, default=128,
                   help="side of the decoded, resized uint8 image that is cached; with --sizes "
                        "varied, the side of the crop after the cache (default: %(default)s)")
    d.add_argument("--jpeg-quality", type=int, default=90, help="default: %(default)s")
    d.add_argument("--num-classes", type=A.positive_int, default=10, help="default: %(default)s")
    d.add_argument("--gen-processes", type=A.positive_int, default=None,
                   help="processes generating the JPEGs (default: cores, at most 8)")

    c = p.add_argument_group("cache configurations (no-cache and in-RAM baselines always run)")
    size = c.add_mutually_exclusive_group()
    size.add_argument("--cache-fraction", type=A.fraction, nargs="+",
                      default=[0.0, 0.25, 0.5, 0.75, 1.0] if sweep else [0.0, 0.5, 1.0],
                      help="fractions of the dataset to cache (default: %(default)s)")
    size.add_argument("--cache-gib", type=A.non_negative_float, nargs="+", default=None,
                      help="cache sizes in GiB (size_limit_gib), instead of fractions")
    c.add_argument("--no-in-ram", dest="in_ram", action="store_false",
                   help="skip the in-RAM upper bound")
    c.add_argument("--tiered-fraction", type=A.fraction, nargs="+", default=[],
                   help="tiered arms: this fraction of the dataset in /dev/shm and the rest on "
                        "a disk tier (SharedCache(disk_tier=)), e.g. 0.5; checked against the "
                        "cache of the same fraction and the 100%% one (default: none)")
    c.add_argument("--disk-tier-dir", type=Path, default=None,
                   help="where the tiered arms' disk tiers go, on local disk (default: the "
                        "system's temp directory)")

    lo = p.add_argument_group("loader and training" + (" (lists: every combination runs)"
                                                        if sweep else ""))
    lo.add_argument("--workers", type=A.non_negative_int,
                    **grid([1, 2, 4] if sweep else 2), help="DataLoader workers "
                    "(default: %(default)s)")
    lo.add_argument("--batch-size", type=A.positive_int, **grid([64] if sweep else 64),
                    help="default: %(default)s")
    lo.add_argument("--start-method", choices=("fork", "spawn", "forkserver"),
                    **grid([_default_start_method()] if sweep else _default_start_method()),
                    help="DataLoader workers' start method (default: %(default)s)")
    lo.add_argument("--sampler", choices=("random", "cache-aware"),
                    **grid(["random"] if sweep else "random"),
                    help="random: RandomSampler (DistributedSampler under torchrun); cache-aware: "
                         "stocaching.CacheAwareSampler for the cached configurations "
                         "(default: %(default)s)")
    lo.add_argument("--read-latency-ms", type=A.non_negative_float,
                    **grid([0.0, 5.0] if sweep else 0.0),
                    help="EMULATED storage latency: sleep this long before every read from "
                         "disk (every cache miss); 0 = local files (default: %(default)s)")
    lo.add_argument("--loader", choices=("dataloader", "device"),
                    **grid(["dataloader"] if sweep else "dataloader"),
                    help="what reads the caches: a DataLoader over the two-line Dataset, or "
                         "stocaching.DeviceLoader (batches gathered from the segment onto the "
                         "training device, phase two there; the workers become its loader "
                         "processes); the no-cache and in-RAM baselines keep the DataLoader "
                         "(default: %(default)s)")
    lo.add_argument("--persistent-workers", action="store_true",
                    help="keep the workers between epochs")
    lo.add_argument("--get-slot", choices=("copy", "view"), default="copy",
                    help="copy: cache.get_slot(i) returns a copy; view: get_slot(i, copy=False), "
                         "a read-only view (default: %(default)s)")
    lo.add_argument("--epochs", type=A.positive_int, default=3, help="default: %(default)s")
    lo.add_argument("--repeats", type=A.positive_int, default=1,
                    help="run every configuration this many times (fresh cache each time, odd "
                         "repeats in reverse order); tables, checks and plots use the medians. "
                         "Use 3 or more on a busy machine (default: %(default)s)")
    lo.add_argument("--threads", type=A.positive_int, default=None,
                    help="torch threads of the training process (default: cores per local "
                         "rank minus workers, at least 1)")
    lo.add_argument("--lr", type=float, default=0.05, help="default: %(default)s")
    lo.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    lo.add_argument("--no-warm-page-cache", dest="warm_page_cache", action="store_false",
                    help="don't read every file once before the first configuration")

    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: ./benchmark-results/<timestamp>)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plots")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmark",
        description="Measure what stocaching.SharedCache does to a realistic JPEG -> small CNN "
                    "training pipeline: epoch time, samples/s, hit rate and data stall against "
                    "the fraction of the dataset cached, with no-cache and in-RAM baselines.",
        epilog="Without a subcommand, 'run' is assumed.  Under torchrun every rank runs the same "
               "command; rank 0 prints and writes the results.")
    sub = parser.add_subparsers(dest="command",
                                metavar="{run,sweep,analyze,latency,quality,mixture,persistent,elastic,"
                                        "device,tier,stream,peers}")
    run = sub.add_parser("run", help="one loader setup, a few cache fractions (the default)",
                         description="One loader setup: no cache, each cache fraction, in-RAM.")
    _add_common(run, sweep=False)
    sweep = sub.add_parser("sweep", help="a grid of setups (fractions x workers x latency ...), "
                                          "one CSV",
                           description="Every combination of the list-valued options; writes "
                                       "sweep.csv (rewritten after each setup), sweep.json and "
                                       "the plots.")
    _add_common(sweep, sweep=True)
    an = sub.add_parser("analyze", help="plots, tables and target checks from a CSV",
                        description="Redo the plots, tables and target checks of a run's or "
                                    "sweep's CSV.")
    an.add_argument("csv", type=Path)
    an.add_argument("--out", type=Path, default=None,
                    help="where the PNGs go (default: next to the CSV)")
    from . import device, elastic, latency, mixture, peers, persistent, quality, stream, tier

    lat = sub.add_parser("latency", help="EMULATED storage latency: plain DataLoader vs the "
                                         "Prefetcher (plain, fixed and adaptive window)",
                         description=latency.__doc__.split("\n\n")[0])
    latency.add_arguments(lat)
    qual = sub.add_parser("quality", help="learning quality of the Prefetcher's orders on "
                                          "sklearn's digits: accuracy and batch diversity",
                          description=quality.__doc__.split("\n\n")[0])
    quality.add_arguments(qual)
    mix = sub.add_parser("mixture", help="weighted mixtures: realised shares and per-sub-dataset "
                                         "hit rates, and the epoch build time for 10 M indices",
                         description=mixture.__doc__.split("\n\n")[0])
    mixture.add_arguments(mix)
    per = sub.add_parser("persistent", help="a cache that outlives its job: the next job's attach "
                                            "and epoch 1", description=persistent.__doc__.split("\n\n")[0])
    persistent.add_arguments(per)
    ela = sub.add_parser("elastic", help="a job interrupted and resumed on the same world and on "
                                         "a resized one (torchrun agents as nodes)",
                         description=elastic.__doc__.split("\n\n")[0])
    elastic.add_arguments(ela)
    dev = sub.add_parser("device", help="batches straight to the device: DataLoader, the "
                                        "training-process gather and the DeviceLoader",
                         description=device.__doc__.split("\n\n")[0])
    device.add_arguments(dev)
    tie = sub.add_parser("tier", help="the disk tier alone: get_slot from the tier against a "
                                      "bare os.preadv loop, cold and warm; a second job",
                         description=tier.__doc__.split("\n\n")[0])
    tier.add_arguments(tie)
    stre = sub.add_parser("stream", help="WebDataset shards: the source alone against "
                                         "CachedStream at 50 and 100 %%",
                          description=stream.__doc__.split("\n\n")[0])
    stream.add_arguments(stre)
    pee = sub.add_parser("peers", help="the same decoded samples through stocaching, LitData, "
                                       "MosaicML streaming, WebDataset and FFCV",
                         description=peers.__doc__.split("\n\n")[0])
    peers.add_arguments(pee)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "run")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("run", "sweep"):
        if args.num_images is None:
            args.num_images = 1500 if args.sizes == "varied" else 6000
        lo, hi = args.sides
        if args.sizes == "varied" and not args.decoded_size <= lo <= hi:
            parser.error(f"--sides should be LO HI with --decoded-size <= LO <= HI, but got "
                         f"--sides {lo} {hi} with --decoded-size {args.decoded_size}")
    return args


def _say(msg: str) -> None:
    print(msg, flush=True)


def _latency_note(lats: Sequence[float]) -> str | None:
    lats = sorted({x for x in lats if x})
    if not lats:
        return None
    return (f"NOTE: EMULATED storage latency: every read from disk (every cache miss) sleeps "
            f"{', '.join(f'{x:g}' for x in lats)} ms (--read-latency-ms); these are not "
            f"local-disk numbers.")


def _run(args: argparse.Namespace, argv: Sequence[str], say: Callable[[str], None]) -> int:
    from stocaching import World

    from . import plot, report
    from . import run as R

    sweep = args.command == "sweep"

    def as_list(v: Any) -> list[Any]:
        return list(v) if isinstance(v, (list, tuple)) else [v]

    setups = [R.Setup(workers=w, batch_size=b, start_method=sm,
                      persistent_workers=args.persistent_workers, sampler=s,
                      get_slot=args.get_slot, read_latency_ms=lat, loader=ld)
              for w, b, sm, s, lat, ld in itertools.product(
                  as_list(args.workers), as_list(args.batch_size), as_list(args.start_method),
                  as_list(args.sampler), as_list(args.read_latency_ms), as_list(args.loader))]
    specs = R.specs_from(args.cache_fraction, args.cache_gib, args.in_ram,
                         args.tiered_fraction)
    opts = R.Options(data_dir=args.data_dir, num_images=args.num_images,
                     image_size=args.image_size, decoded_size=args.decoded_size,
                     jpeg_quality=args.jpeg_quality, num_classes=args.num_classes,
                     epochs=args.epochs, threads=args.threads, lr=args.lr, seed=args.seed,
                     warm_page_cache=args.warm_page_cache, gen_processes=args.gen_processes,
                     repeats=args.repeats,
                     sides=tuple(args.sides) if args.sizes == "varied" else None,
                     disk_tier_dir=args.disk_tier_dir)
    is_main = World.from_env().rank == 0
    out = args.out or R.timestamp_dir()
    stem = "sweep" if sweep else "results"
    note = _latency_note([s.read_latency_ms for s in setups])
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        if note:
            say(note)
    done: list[dict[str, Any]] = []

    def on_group(rows: list[dict[str, Any]]) -> None:
        done.extend(rows)
        report.write_csv(done, out / f"{stem}.csv")  # a partial sweep is still usable
        say(f"\n== {report.group_title(rows)}")
        say(report.format_table(rows))
        say("target checks (measured, not asserted):")
        say(report.format_checks(report.check_targets(rows)))
        say("")

    res = R.run_grid(opts, setups, specs, args.threads, say, on_group)
    if not res["is_main"]:
        return 0
    rows = res["rows"]  # already in the CSV: on_group wrote it after every group
    say("/dev/shm (rank 0's node; statvfs deltas around construction, cache.stats()['bytes']):")
    say(R.describe_shm(res) or "  (no cache configuration)")
    bad = R.stats_consistency(rows)
    if bad:
        say("WARNING: cache.stats() disagrees with what the Dataset saw:")
        for b in bad:
            say(f"  {b}")
    elif any(r["kind"] == "cache" for r in rows):
        say("cache.stats() agrees with the Dataset's own hit count in every epoch.")
    cores = os.cpu_count() or 1
    busy = res["loadavg_before"] > 0.5 * cores
    others = res["others_cpu_cores"]
    busy_during = others > 0.25
    say(f"1-minute load average when the benchmark started: {res['loadavg_before']:.2f} "
        f"({cores} cores); other programs used {others:.2f} cores on average during the run"
        + ("; other processes were using the CPU, so expect noisy wall times (compare the "
           "CPU seconds, or use --repeats 3)" if busy or busy_during else ""))
    if note:
        say(note)
    plots = plot.make_plots(rows, out) if args.plot else []
    report.write_json({
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "benchmark", *argv]),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "note": note, "data_dir": res["data_dir"], "generate_s": res["generate_s"],
        "elapsed_s": res["elapsed_s"], "world_size": res["world_size"],
        "loadavg_before": res["loadavg_before"], "loadavg_after": res["loadavg_after"],
        "others_cpu_cores": res["others_cpu_cores"],
        "environment": res["environment"], "setups": [dataclasses.asdict(s) for s in setups],
        "configs": res["configs"], "checks": res["checks"], "stats_mismatches": bad,
        "rows": rows,
    }, out / f"{stem}.json")
    files = [out / f"{stem}.csv", out / f"{stem}.json", *plots]
    say(f"wrote {', '.join(str(f) for f in files)} ({res['elapsed_s']:.0f} s of runs)")
    return 0


def _analyze(args: argparse.Namespace, argv: Sequence[str], say: Callable[[str], None]) -> int:
    from . import plot

    paths, text = plot.analyze(args.csv, args.out)
    say(text)
    say("wrote " + ", ".join(str(p) for p in paths))
    return 0


#: A scenario's entry: ``main(args, argv, say) -> int``, the exit status. ``args`` are its
#: parsed options, ``argv`` the command line after ``python -m benchmark`` (recorded with the
#: results, so that a run can be repeated), ``say`` prints a line of the report.
Entry = Callable[[argparse.Namespace, Sequence[str], Callable[[str], None]], int]


def _entry(command: str) -> Entry:
    """The entry of the subcommand ``command``: ``run``, ``sweep`` and ``analyze`` are here, every
    other scenario is the ``main`` of its module (``benchmark/<command>.py``)."""
    if command in ("run", "sweep"):
        return _run
    if command == "analyze":
        return _analyze
    return importlib.import_module(f".{command}", __package__).main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    return _entry(args.command)(args, argv, _say)


if __name__ == "__main__":
    sys.exit(main())
