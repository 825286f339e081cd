"""A cache that outlives its job: ``python -m benchmark persistent``.

Three jobs, each a process of its own, one after the other, on the benchmark's JPEGs:

1. the first job makes a persistent cache (``persistent=True``) and reads the dataset twice in
   its main process (the two-line ``__getitem__``, augmentation included): epoch 1 loads,
   decodes and stores every sample, epoch 2 is warm (every sample a hit); then it returns;
2. the second job constructs the same persistent cache (timed: the attach), and reads one epoch:
   its epoch 1, which should run at the warm rate;
3. apart, a persistent cache of ``--attach-gib`` GiB is made by one job, and the time a new job
   takes to attach to it is measured;
4. saved: the first job saves its cache to a file (``save``) after its epochs, then saves it
   again unchanged (timed: the incremental save); a job with a plain cache made with
   ``load_from=`` that file reads one epoch; and a plain cache of ``--save-gib`` GiB, filled, is
   saved by one job and loaded by a new one (timed: the constructor), against a sequential
   read of the same file (``dd`` to /dev/null) in the same run, both after dropping the file
   from the page cache where the machine allows it (``/proc/sys/vm/drop_caches``), else both
   warm, and said so; and, printed beside them, ``dd``'s copy of the file into the shared
   memory directory: the copy into new pages that a load cannot avoid, which a read to
   /dev/null does not make.

Target checks (measured, not asserted): the attach of ``--attach-gib`` <= 0.1 s; the second
job's epoch 1 >= 0.95 x the first job's warm epoch; loading the saved file >= 0.8 x the
sequential read; the incremental save of an unchanged cache <= 1 % of a warm epoch. Every cache
and file this command makes is removed at the end, also when it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import arguments as A
from . import data as D

ATTACH_MAX_S = 0.1
WARM_MIN = 0.95
LOAD_MIN = 0.8  # of the sequential read of the same file
INCREMENTAL_MAX = 0.01  # of a warm epoch
DIMS_OF_BIG = (3, 256, 256)


def job(role: str, options: str) -> None:
    """One job of the scenario, in a process of its own; prints one JSON line of figures."""
    import torch

    from stocaching import SharedCache

    o = json.loads(options)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"role": role}
    if role in ("save", "load"):  # a plain cache of save_gib, filled and saved, or loaded
        slot = 3 * 256 * 256
        n = int(o["save_gib"] * 2**30 // (slot + 1))
        t0 = time.perf_counter()
        cache = SharedCache(o["save_gib"], n, DIMS_OF_BIG, name=o["name"] + "-" + role,
                            load_from=o["file"] + "-big", key="big")  # (none yet: empty)
        out.update(construct_s=time.perf_counter() - t0, slots=len(cache))
        if role == "save":
            for i in range(len(cache)):
                cache.set_slot(i, torch.full(DIMS_OF_BIG, i % 251, dtype=torch.uint8))
            t0 = time.perf_counter()
            out["save"] = cache.save(o["file"] + "-big")
            out["save_s"] = time.perf_counter() - t0
        out["filled"] = cache.stats()["filled"]
        cache.close()
    elif role == "big":  # make (or, for the timing, attach to) a large persistent cache
        slot = 3 * 256 * 256
        n = int(o["attach_gib"] * 2**30 // (slot + 1))
        t0 = time.perf_counter()
        cache = SharedCache(o["attach_gib"], n, DIMS_OF_BIG, name=o["name"] + "-big",
                            persistent=True, key="big")
        out.update(construct_s=time.perf_counter() - t0, slots=len(cache),
                   bytes=cache.stats()["bytes"])
        if o.get("fill"):
            x = torch.full(DIMS_OF_BIG, 7, dtype=torch.uint8)
            for i in range(0, len(cache), max(1, len(cache) // 1000)):
                cache.set_slot(i, x)
        out["filled"] = cache.stats()["filled"]
        cache.close()
    else:
        t0 = time.perf_counter()
        kept = dict(persistent=True) if role != "loaded" else dict(load_from=o["file"])
        cache = SharedCache(o["size_gib"], o["num_images"], (3, o["decoded_size"],
                                                                o["decoded_size"]),
                            name=o["name"], key="jpegs", **kept)
        out["construct_s"] = time.perf_counter() - t0
        ds = D.JpegDataset(o["root"], o["num_images"], o["decoded_size"], 10, cache=cache)
        for epoch in range(3 if role == "first" else 1):
            torch.manual_seed(epoch)
            c0, t1 = time.process_time(), time.perf_counter()
            hits = sum(ds[i][2] for i in range(len(ds)))
            wall = time.perf_counter() - t1
            out[f"epoch{epoch + 1}"] = {"samples_per_s": len(ds) / wall, "wall_s": wall,
                                        "cpu_s": time.process_time() - c0, "hits": hits}
        if role == "first":  # saved to a file, then again unchanged: the incremental save
            t0 = time.perf_counter()
            out["save"] = cache.save(o["file"])
            out["save_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            out["again"] = cache.save(o["file"])
            out["again_s"] = time.perf_counter() - t0
        ds.cache = None
        cache.close()
    print(json.dumps(out), flush=True)


def _run_job(role: str, options: dict[str, Any]) -> dict[str, Any]:
    code = f"from benchmark.persistent import job; job({role!r}, {json.dumps(options)!r})"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                                    os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"the {role} job failed (exit {r.returncode}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-images", type=A.positive_int, default=2000, help="default: %(default)s")
    p.add_argument("--image-size", type=A.positive_int, default=256, help="default: %(default)s")
    p.add_argument("--decoded-size", type=A.positive_int, default=128,
                   help="default: %(default)s")
    p.add_argument("--attach-gib", type=float, default=2.0,
                   help="size of the large persistent cache whose attach is timed (the target "
                        "is stated for 8; default: %(default)s)")
    p.add_argument("--repeats", type=A.positive_int, default=3,
                   help="attaches timed (the median is checked; default: %(default)s)")
    p.add_argument("--save-gib", type=float, default=1.0,
                   help="size of the plain cache saved to a file and loaded in a new job, "
                        "whose load is timed against a sequential read (default: %(default)s)")
    p.add_argument("--save-dir", type=Path, default=None,
                   help="where the saved files go (on the disk to measure; default: a new "
                        "temporary directory)")
    p.add_argument("--data-dir", type=Path, default=None, help="default: the benchmark's cache")


def _drop_page_cache() -> bool:
    """Drop clean pages from the page cache, if this process may; True if it did."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _sequential_read_s(path: str) -> float:
    """Seconds ``dd`` takes to read ``path`` to /dev/null in 16 MiB blocks."""
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True,
                   capture_output=True)
    return time.perf_counter() - t0


def _copy_into_s(path: str, shm_dir: str) -> float:
    """Seconds ``dd`` takes to copy ``path`` into a new file in ``shm_dir`` (then removed):
    the copy a load cannot avoid, without its checks."""
    dst = os.path.join(shm_dir, f"stocaching-bench-copy-{secrets.token_hex(4)}")
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", f"of={dst}", "bs=16M"], check=True,
                       capture_output=True)
        return time.perf_counter() - t0
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    import statistics

    from stocaching import clean_segments

    load_before = os.getloadavg()
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)}")
    root = args.data_dir or D.default_data_dir(args.num_images, args.image_size, 90, 0, 10)
    D.ensure_dataset(root, args.num_images, args.image_size, quality=90, seed=0,
                     num_classes=10)
    D.warm_page_cache(root, args.num_images)
    name = f"bench-{secrets.token_hex(4)}"
    slot = 3 * args.decoded_size ** 2
    opts = {"name": name, "root": str(root), "num_images": args.num_images,
            "decoded_size": args.decoded_size, "attach_gib": args.attach_gib,
            "size_gib": (args.num_images * (slot + 1) + 1) / 2**30}
    shm_dir = os.environ.get("STOCACHING_SHM_DIR", "/dev/shm")
    import shutil
    import tempfile

    save_dir = tempfile.mkdtemp(prefix="stocaching-bench-", dir=args.save_dir)
    opts.update(file=os.path.join(save_dir, "jpegs.stc"), save_gib=args.save_gib)
    try:
        first = _run_job("first", opts)
        seconds = [_run_job("second", opts) for _ in range(args.repeats)]
        loaded = _run_job("loaded", opts)
        made = _run_job("big", {**opts, "fill": True})
        attaches = [_run_job("big", opts)["construct_s"] for _ in range(args.repeats)]
        saved = _run_job("save", opts)
        cold = _drop_page_cache()
        dd_s = _sequential_read_s(opts["file"] + "-big")
        _drop_page_cache()
        copy_s = _copy_into_s(opts["file"] + "-big", shm_dir)
        _drop_page_cache()
        load = _run_job("load", opts)
        file_bytes = os.path.getsize(opts["file"] + "-big")
    finally:
        clean_segments(shm_dir, persistent=[name, name + "-big"])
        shutil.rmtree(save_dir, ignore_errors=True)
    e1 = first["epoch1"]
    warm = min((first["epoch2"], first["epoch3"]), key=lambda e: -e["samples_per_s"])
    second = sorted(seconds, key=lambda j: j["epoch1"]["samples_per_s"])[len(seconds) // 2]
    again = second["epoch1"]
    say(f"{args.num_images} JPEGs of {args.image_size}x{args.image_size} -> uint8 3x"
        f"{args.decoded_size}x{args.decoded_size}, read in the job's main process, one thread")
    say(f"{'':36s} {'samples/s':>10s} {'wall s':>7s} {'cpu s':>6s} {'hits':>6s}")
    for label, e in (("first job, epoch 1 (decodes)", e1),
                     ("first job, epoch 2 (warm)", first["epoch2"]),
                     ("first job, epoch 3 (warm)", first["epoch3"]),
                     *((f"second job #{k + 1}, epoch 1 (attached)", j["epoch1"])
                       for k, j in enumerate(seconds)),
                     ("job loaded from the file, epoch 1", loaded["epoch1"])):
        say(f"{label:36s} {e['samples_per_s']:10,.0f} {e['wall_s']:7.2f} {e['cpu_s']:6.2f} "
            f"{e['hits']:6d}")
    attach_ms = ", ".join(f"{1000 * j['construct_s']:.1f}" for j in seconds)
    say(f"second jobs: attach (the constructor) {attach_ms} ms; first job: make "
        f"{1000 * first['construct_s']:.1f} ms")
    med = statistics.median(attaches)
    say(f"persistent cache of {made['bytes'] / 2**30:.2f} GiB ({made['slots']} slots of "
        f"3x256x256, {made['filled']} filled): made in {made['construct_s']:.2f} s; attached "
        f"in {', '.join(f'{1000 * a:.1f}' for a in attaches)} ms")
    say(f"first job: saved {first['save']['samples']} samples to a file "
        f"({first['save']['bytes'] / 2**20:.1f} MiB) in {first['save_s']:.3f} s; saved again "
        f"unchanged in {1000 * first['again_s']:.2f} ms ({first['again']['bytes']} bytes "
        f"written); the job that loaded the file constructed its cache in "
        f"{loaded['construct_s']:.3f} s")
    mib = file_bytes / 2**20
    say(f"plain cache of {args.save_gib:g} GiB ({saved['filled']} samples of 3x256x256): saved "
        f"in {saved['save_s']:.2f} s ({mib / saved['save_s']:,.0f} MiB/s); a new job loaded it "
        f"in {load['construct_s']:.2f} s ({mib / load['construct_s']:,.0f} MiB/s, "
        f"{load['filled']} samples); dd read the file in {dd_s:.2f} s "
        f"({mib / dd_s:,.0f} MiB/s) and copied it into {shm_dir} in {copy_s:.2f} s "
        f"({mib / copy_s:,.0f} MiB/s, {dd_s / copy_s:.2f} x dd's read); page cache "
        f"{'dropped before each' if cold else 'not droppable here: both read it warm'}")
    load_after = os.getloadavg()
    say(f"load average at the start: {' '.join(f'{x:.2f}' for x in load_before)}; at the end: "
        f"{' '.join(f'{x:.2f}' for x in load_after)}")
    ratio = again["samples_per_s"] / warm["samples_per_s"]
    say("target checks (measured, not asserted):")
    say(f"[{'PASS' if med <= ATTACH_MAX_S else 'MISS'}] attach to a persistent cache of "
        f"{args.attach_gib:g} GiB, target <= {ATTACH_MAX_S:g} s: median of {len(attaches)} "
        f"{med:.3f} s")
    say(f"[{'PASS' if ratio >= WARM_MIN else 'MISS'}] the second job's epoch 1 (median of "
        f"{len(seconds)} jobs) vs the first job's faster warm epoch, target >= {WARM_MIN:g} x: "
        f"{again['samples_per_s']:,.0f} vs "
        f"{warm['samples_per_s']:,.0f} samples/s ({ratio:.2f} x; the first job's epoch 1: "
        f"{e1['samples_per_s']:,.0f}, {again['samples_per_s'] / e1['samples_per_s']:.1f} x "
        "slower than the second's)")
    speed = dd_s / load["construct_s"]
    say(f"[{'PASS' if speed >= LOAD_MIN else 'MISS'}] load a saved file of {mib:,.0f} MiB vs a "
        f"sequential read of it ({'cold' if cold else 'both warm'}), target >= {LOAD_MIN:g} x: "
        f"{mib / load['construct_s']:,.0f} vs {mib / dd_s:,.0f} MiB/s ({speed:.2f} x)")
    share = first["again_s"] / warm["wall_s"]
    say(f"[{'PASS' if share <= INCREMENTAL_MAX else 'MISS'}] incremental save of an unchanged "
        f"cache vs a warm epoch, target <= {100 * INCREMENTAL_MAX:g} %: "
        f"{1000 * first['again_s']:.2f} ms vs {warm['wall_s']:.2f} s ({100 * share:.2f} %)")
    return 0
