"""Sharded streams: ``python -m benchmark stream``.

The benchmark's JPEGs (``--num-images`` of 512 x 512, generated once) written as WebDataset tar
shards of ``--shard-size`` samples (the JPEG bytes and the label; written once, beside the
JPEGs), then read through a ``DataLoader`` (``--workers``, ``--batch-size``, loader only: no
model, no augmentation) for ``--epochs`` epochs by three arms, interleaved, ``--repeats`` rounds:

- **source**: WebDataset alone, as its docs read shards with a DataLoader (``WebDataset(urls,
  shardshuffle=...)``, a shuffle buffer of ``--shuffle-buffer``, the decode in ``.map``): every
  sample is read and decoded every epoch;
- **cached 50 %** and **cached 100 %**: ``CachedStream`` over the same shards (WebDataset's
  reader per shard, the same decode and shuffle buffer), with a cache of half or all of the
  samples: epoch 1 streams and fills, later epochs skip the shards that are all cached.

Every arm opens its shards through one counting scheme of WebDataset's ``gopen`` (``counted:``),
so the bytes each epoch reads from the shards are measured the same way for all three.
Target checks (measured, not asserted): at 100 % a warm epoch >= 3 x the source's own rate;
at 50 % a warm epoch reads at most half of the source's bytes (plus one shard, where the cache's
edge falls inside one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import arguments as A

WARM_MIN = 3.0  # a warm epoch at 100 % against the source's rate
SCHEME = "counted"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-images", type=A.positive_int, default=4000,
                   help="samples (default: %(default)s)")
    p.add_argument("--shard-size", type=A.positive_int, default=100,
                   help="samples per shard (default: %(default)s)")
    p.add_argument("--decoded-size", type=A.positive_int, default=128,
                   help="side of the decoded uint8 image (default: %(default)s)")
    p.add_argument("--epochs", type=A.positive_int, default=3, help="default: %(default)s")
    p.add_argument("--workers", type=A.positive_int, default=2, help="default: %(default)s")
    p.add_argument("--batch-size", type=A.positive_int, default=64, help="default: %(default)s")
    p.add_argument("--shuffle-buffer", type=A.positive_int, default=1000,
                   help="default: %(default)s")
    p.add_argument("--repeats", type=A.positive_int, default=2,
                   help="rounds of the three arms, interleaved (default: %(default)s)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the JPEGs live (default: the main benchmark's cache directory)")


class ReadLog:
    """Bytes read from the shards, across processes: each open appends the shard's size to a
    file (DataLoader workers are other processes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        open(path, "w").close()

    def open(self, url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        path = url[len(SCHEME) + 1:]
        with open(self.path, "a") as f:
            f.write(f"{os.path.getsize(path)}\n")
        return open(path, "rb", buffering=bufsize)

    def take(self) -> int:
        with open(self.path) as f:
            total = sum(int(x) for x in f.read().split())
        open(self.path, "w").close()
        return total


def write_shards(root: Path, num_images: int, shard_size: int, num_classes: int = 10) -> list[str]:
    """The JPEGs of ``root`` as tar shards in ``root/wds-<shard_size>`` (written once)."""
    import webdataset as wds

    from .data import image_path, label_of
    out = root / f"wds-{shard_size}"
    shards = [str(out / f"train-{k:05d}.tar") for k in range(-(-num_images // shard_size))]
    done = out / "complete"
    if not done.exists():
        out.mkdir(exist_ok=True)
        for k, shard in enumerate(shards):
            with wds.TarWriter(shard) as sink:
                for i in range(k * shard_size, min(num_images, (k + 1) * shard_size)):
                    with open(image_path(root, i), "rb") as f:
                        sink.write({"__key__": f"{i:08d}", "jpg": f.read(),
                                    "cls": str(label_of(i, num_classes)).encode()})
        done.write_text("")
    return shards


class Decode:
    """The deterministic part, the same in every arm: JPEG bytes to uint8 (3, D, D), label."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, raw: dict) -> tuple:
        from .data import decode
        return decode(raw["jpg"], self.size), int(raw["cls"])


def open_shard(url: str) -> Any:
    import webdataset as wds
    return wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None)


def run_epochs(loader: Any, epochs: int, log: ReadLog, set_epoch: Any) -> list[tuple]:
    """(seconds, samples, bytes read) per epoch."""
    out = []
    for epoch in range(epochs):
        set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for images, _ in loader:
            n += len(images)
        out.append((time.perf_counter() - t0, n, log.take()))
    return out


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    import torch
    import webdataset as wds

    from stocaching import CachedStream, clean_segments

    from .data import default_data_dir, ensure_dataset
    root = args.data_dir or default_data_dir(args.num_images, 512, 90, 0, 10)
    ensure_dataset(root, args.num_images, 512)
    shards = write_shards(Path(root), args.num_images, args.shard_size)
    log = ReadLog(os.path.join(str(root), f"reads-{os.getpid()}.log"))
    sys.modules["webdataset.gopen"].gopen_schemes[SCHEME] = log.open
    urls = [f"{SCHEME}:{s}" for s in shards]
    total_bytes = sum(os.path.getsize(s) for s in shards)
    decode = Decode(args.decoded_size)
    sample = 3 * args.decoded_size ** 2 + 8  # the image and an int64 label
    n = args.num_images
    load_before = os.getloadavg()
    say(f"{n} samples in {len(shards)} shards of {args.shard_size} ({total_bytes / 2**20:.1f} "
        f"MiB of JPEG), decoded to (3, {args.decoded_size}, {args.decoded_size}); "
        f"{args.workers} workers, batch {args.batch_size}, {args.epochs} epochs, "
        f"{args.repeats} rounds; load average {' '.join(f'{x:.2f}' for x in load_before)}")
    results: dict[str, list[list[tuple]]] = {}
    try:
        for round_ in range(args.repeats):
            for arm in ("source", "cached 50 %", "cached 100 %"):
                if arm == "source":
                    ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=round_,
                                         nodesplitter=wds.split_by_node)
                          .shuffle(args.shuffle_buffer).map(decode))
                    epochs = run_epochs(torch.utils.data.DataLoader(
                        ds, batch_size=args.batch_size, num_workers=args.workers),
                        args.epochs, log, lambda e: None)
                else:
                    fraction = 0.5 if "50" in arm else 1.0
                    slots = int(fraction * n)
                    gib = (slots * sample + n + 0.5) / 2**30
                    ds = CachedStream(urls, open_shard, decode=decode, size_limit_gib=gib,
                                      shard_lengths=[min(args.shard_size, n - k * args.shard_size)
                                                     for k in range(len(shards))],
                                      shuffle_buffer=args.shuffle_buffer, seed=round_,
                                      name=f"stream{round_}", verify_decodes=0)
                    log.take()  # (the construction's read of the first sample)
                    epochs = run_epochs(torch.utils.data.DataLoader(
                        ds, batch_size=args.batch_size, num_workers=args.workers),
                        args.epochs, log, ds.set_epoch)
                    ds.cache.close()
                results.setdefault(arm, []).append(epochs)
                line = ", ".join(f"{s:.1f} s {k / s:,.0f}/s {b / 2**20:.0f} MiB read"
                                 for s, k, b in epochs)
                say(f"round {round_ + 1} {arm:13s}: {line}")
    finally:
        sys.modules["webdataset.gopen"].gopen_schemes.pop(SCHEME, None)
        os.unlink(log.path)
        clean_segments()
    load_after = os.getloadavg()

    def warm(arm: str, what: int) -> float:
        return statistics.median(e[what] if what else e[1] / e[0]
                                 for r in results[arm] for e in r[1:])

    say(f"\n{'arm':13s} {'epoch 1 /s':>11s} {'warm /s':>9s} {'warm MiB read':>14s}")
    for arm in results:
        first = statistics.median(r[0][1] / r[0][0] for r in results[arm])
        say(f"{arm:13s} {first:11,.0f} {warm(arm, 0):9,.0f} {warm(arm, 2) / 2**20:14.1f}")
    say(f"load average at the end: {' '.join(f'{x:.2f}' for x in load_after)}")
    say("target checks (measured, not asserted):")
    ratio = warm("cached 100 %", 0) / warm("source", 0)
    say(f"[{'PASS' if ratio >= WARM_MIN else 'MISS'}] a warm epoch at 100 % cached vs the "
        f"source's own, target >= {WARM_MIN:g} x: {warm('cached 100 %', 0):,.0f} vs "
        f"{warm('source', 0):,.0f} samples/s ({ratio:.2f} x)")
    half, source = warm("cached 50 %", 2), warm("source", 2)
    bound = source / 2 + total_bytes / len(shards)
    say(f"[{'PASS' if half <= bound else 'MISS'}] bytes a warm epoch reads at 50 % cached, "
        f"target <= half of the source's (+ one shard): {half / 2**20:.1f} vs "
        f"{source / 2**20:.1f} MiB ({half / source:.2f} x)")
    return 0
