"""Running configurations: build each loader, train the small CNN, measure every epoch.

A *configuration* is one way of feeding the data: ``no cache`` (``JpegDataset`` with
``cache=None``), ``cache N%`` (the same Dataset with a ``SharedCache`` holding N% of the decoded
samples) or ``in-RAM`` (every decoded sample in one shared tensor, built before timing). A *setup*
is the loader around it (workers, batch size, start method, sampler, emulated read latency...);
``run`` measures one setup, ``sweep`` a grid of them. Each configuration starts from the same
seed (same model initialisation, same sample order), and its cache is closed, and its memory
handed back, before the next one starts.

With varied sizes (``Options.sides``, ``--sizes varied``) the JPEGs have sides drawn from a
range and are cached at their native size (``data_dims=(3, None, None)``, an arena); phase two
crops every read to ``decoded_size``. ``cache N%`` is then a budget that holds N% of the
dataset's decoded bytes, and the ``slots`` and ``cached`` columns say how many samples it held
at the end of each epoch (``stats()["filled"]``); ``in-RAM`` is a :class:`~benchmark.data.
PackedImages` (one flat shared tensor plus offsets).

Threads: the training process runs ``torch.set_num_threads(--threads)``; the default is one
thread per core left after the DataLoader workers, at least one
(``max(1, cores // local ranks - workers)``). Workers run one thread each (the DataLoader sets
that), so on the 2-core reference machine with 2 workers the trainer gets 1 thread: more threads
would spin against the decoding workers and make the no-cache runs slower and noisier.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import platform
import resource
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch import nn

import stocaching

from . import data as D
from . import report
from .model import SmallCNN

GIB = 1024**3
MIB = 1024**2


# ----------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """The loader around a configuration: one group of rows."""

    workers: int
    batch_size: int
    start_method: str
    persistent_workers: bool
    sampler: str
    get_slot: str
    read_latency_ms: float
    # "dataloader", or "device": the caches read by stocaching.DeviceLoader (phase two on the
    # training device, batches gathered from the segment); the baselines keep the DataLoader
    loader: str = "dataloader"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration: ``kind`` is ``none``, ``cache`` or ``ram``; a cache is sized by
    ``fraction`` of the dataset or by ``gib``."""

    kind: str
    fraction: float | None = None
    gib: float | None = None
    tier: bool = False  # the indices without a slot on a disk tier (SharedCache(disk_tier=))

    @property
    def requested(self) -> str:
        if self.kind != "cache":
            return self.kind
        size = f"{self.fraction:g}" if self.fraction is not None else f"{self.gib:g}GiB"
        return size + ("+tier" if self.tier else "")

    @property
    def label(self) -> str:
        """The configuration's name in tables and plots: ``no cache``, ``cache 50%``..."""
        if self.kind == "none":
            return "no cache"
        if self.kind == "ram":
            return "in-RAM"
        tier = report.TIER_SUFFIX if self.tier else ""
        if self.fraction is not None:
            return f"cache {100 * self.fraction:g}%{tier}"
        return f"cache {self.gib:g}GiB{tier}"


@dataclasses.dataclass
class Options:
    """What stays fixed within a run or sweep."""

    data_dir: Path | None
    num_images: int
    image_size: int
    decoded_size: int
    jpeg_quality: int
    num_classes: int
    epochs: int
    threads: int | None
    lr: float
    seed: int
    warm_page_cache: bool
    gen_processes: int | None
    repeats: int = 1
    sides: tuple[int, int] | None = None  # varied sizes: each side drawn from this range
    disk_tier_dir: Path | None = None  # where the tiered arms' disk tiers go (None: temp dir)

    @property
    def sizes(self) -> str:
        """``fixed``, or ``varied LO-HI``: the ``sizes`` column of every row."""
        return "fixed" if self.sides is None else f"varied {self.sides[0]}-{self.sides[1]}"

    def shapes(self) -> list[tuple[int, int]]:
        """``(H, W)`` of every image of a varied-size dataset."""
        assert self.sides is not None
        return [D.varied_shape(i, self.seed, self.sides) for i in range(self.num_images)]


def specs_from(fractions: Sequence[float] | None, gibs: Sequence[float] | None,
               in_ram: bool, tiered: Sequence[float] = ()) -> list[Spec]:
    """The configurations of a run: ``no cache`` first (always: it is the baseline), then the
    caches by increasing size, then the tiered caches (``tiered``: fractions in /dev/shm, the
    rest on a disk tier), then ``in-RAM`` unless disabled."""
    out = [Spec("none")]
    if gibs:
        out += [Spec("cache", gib=g) for g in sorted(set(gibs)) if g > 0]
    else:
        out += [Spec("cache", fraction=f) for f in sorted(set(fractions or ())) if f > 0]
    out += [Spec("cache", fraction=f, tier=True) for f in sorted(set(tiered)) if f < 1]
    if in_ram:
        out.append(Spec("ram"))
    return out


def default_threads(workers: int, local_world_size: int) -> int:
    cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size) - workers)


def gib_for_slots(slots: int, dataset_len: int, slot_bytes: int) -> float:
    """``size_limit_gib`` that gives ``slots`` slots under the documented sizing rule (the budget
    covers the slots plus one byte per sample, as in stocaching 0.2.1); half a byte of slack
    against float rounding."""
    return (slots * slot_bytes + dataset_len + 0.5) / GIB


ARENA_ALIGN = 16  # an open-size cache stores each sample at a multiple of 16 bytes


def gib_for_arena(sample_bytes: Sequence[int], fraction: float, open_sizes: int) -> float:
    """``size_limit_gib`` of an open-size cache whose arena holds ``fraction`` of the bytes the
    samples take there (each padded to 16), under the documented sizing rule: the budget covers
    1 byte and a record of 32 + 8 x ``open_sizes`` bytes per index, then the arena. Eight bytes
    of slack against float rounding (less than the 16 that would hold more)."""
    n = len(sample_bytes)
    padded = sum(-(-b // ARENA_ALIGN) * ARENA_ALIGN for b in sample_bytes)
    return (n * (1 + 8 * (4 + open_sizes)) + int(fraction * padded) + 8) / GIB


# ----------------------------------------------------------------------------------------------
# Distributed helpers (a world of one without torchrun)
# ----------------------------------------------------------------------------------------------


class Dist:
    """Who this process is (``stocaching.World.from_env()``: torchrun's or SLURM's variables) and
    the collectives the benchmark needs, which are no-ops in a world of one."""

    def __init__(self) -> None:
        self.world = stocaching.World.from_env()
        self.enabled = self.world.world_size > 1
        if self.enabled and not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.world.rank,
                                    world_size=self.world.world_size,
                                    timeout=datetime.timedelta(minutes=60))

    @property
    def device(self) -> torch.device:
        """Where the model trains: this rank's GPU when CUDA is available (as the peer's
        benchmark trains), else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.world.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.world.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def shm_used_bytes(path: str | None = None) -> int | None:
    """Bytes in use on the filesystem that holds the caches (statvfs of ``$STOCACHING_SHM_DIR``,
    else /dev/shm), or None where there is none."""
    path = path or os.environ.get("STOCACHING_SHM_DIR") or "/dev/shm"
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# ----------------------------------------------------------------------------------------------
# One configuration: build its data, train the epochs, give its memory back
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Columns:
    """What every row of one configuration (one row per epoch) says about the configuration."""

    spec: Spec
    cached_pct: float
    cache_gib: float | None = None
    slots: int | None = None
    shm_construct_bytes: int | None = None
    cache_bytes: int | None = None
    sampler_used: str = "random"
    arena: bool = False  # open sizes: slots and cached_pct come from stats()["filled"]


@dataclasses.dataclass
class ConfigData:
    """One configuration, built: the Dataset, its sampler and loader, and what holds the memory
    that :func:`release` gives back (``cache``, a ``SharedCache``, or ``in_ram``, the decoded
    dataset). ``info`` describes the configuration in results.json."""

    columns: Columns
    info: dict[str, Any]
    dataset: torch.utils.data.Dataset | None
    cache: Any = None
    in_ram: torch.Tensor | None = None
    sampler: Any = None
    loader: torch.utils.data.DataLoader | None = None


def _cache_aware_class() -> Any:
    """``stocaching.CacheAwareSampler``, or a clear exit where the imported stocaching has none."""
    aware = getattr(stocaching, "CacheAwareSampler", None)
    if aware is None:
        raise SystemExit(
            f"--sampler cache-aware needs stocaching.CacheAwareSampler, but the stocaching "
            f"imported from {stocaching.__file__} (version "
            f"{getattr(stocaching, '__version__', '?')}) has none; use --sampler random")
    return aware


def _cache_data(opts: Options, setup: Setup, spec: Spec, name: str, root: Path, dw: Dist,
                say: Callable[[str], None], info: dict[str, Any]) -> ConfigData:
    """The files read through a new ``SharedCache`` of ``spec``'s size, measured as it is built."""
    n, d = opts.num_images, opts.decoded_size
    varied = opts.sides is not None
    if spec.fraction is not None and varied:
        gib = gib_for_arena([3 * h * w for h, w in opts.shapes()], spec.fraction, 2)
    elif spec.fraction is not None:
        target = min(n, round(spec.fraction * n))
        gib = gib_for_slots(target, n, 3 * d * d)
        info["target_slots"] = target
    else:
        gib = float(spec.gib)
    dw.barrier()
    before = shm_used_bytes()
    t0 = time.perf_counter()
    staging = 0
    if setup.loader == "device":
        if varied:
            raise SystemExit("--loader device needs samples of one size: the DeviceLoader "
                             "gathers rows of one size (use --sizes fixed)")
        # The misses its prefetcher loads ahead wait in staging slots (docs/device.md).
        staging = device_staging_slots(setup)
        gib += staging * 3 * d * d / GIB
    tier_dir = None
    if spec.tier:
        if varied or setup.loader == "device":
            raise SystemExit("a tiered arm (--tiered-fraction) needs samples of one size and "
                             "the DataLoader (the disk tier holds rows of one size, and the "
                             "DeviceLoader's loader does not read it)")
        # The same directory on every rank of a node (the name comes from rank 0's token).
        base = opts.disk_tier_dir or Path(tempfile.gettempdir())
        tier_dir = base / f"stocaching-{name}-tier"
        tier_dir.mkdir(parents=True, exist_ok=True)
        info["disk_tier"] = str(tier_dir)
    if varied:
        cache = stocaching.OpenSizeCache(gib, n, (3, None, None), torch.uint8, name=name)
    else:
        cache = stocaching.SharedCache(gib, n, (3, d, d), torch.uint8, name=name,
                                       staging_slots=staging, disk_tier=tier_dir)
    info["construct_s"] = time.perf_counter() - t0
    dw.barrier()
    after = shm_used_bytes()
    slots = len(cache)
    shm_construct = None if before is None or after is None else after - before
    info.update(name=name, size_limit_gib=gib, slots=slots, shm_before_bytes=before,
                shm_construct_bytes=shm_construct, cache_bytes=cache.stats().get("bytes"))
    if "target_slots" in info and slots != info["target_slots"]:
        info["slots_note"] = (f"size_limit_gib={gib!r} gave {slots} slots; the documented "
                              f"sizing rule gives {info['target_slots']}")
        say(f"  NOTE: {info['slots_note']}")
    if varied:
        info["arena_bytes"] = cache.stats().get("arena_bytes")
    ds = jpeg_dataset(opts, root, cache=cache, read_latency_ms=setup.read_latency_ms,
                      copy=setup.get_slot == "copy")
    columns = Columns(spec, 100.0 * slots / n, cache_gib=gib, slots=slots,
                      shm_construct_bytes=shm_construct, cache_bytes=info["cache_bytes"],
                      arena=varied)
    return ConfigData(columns, info, ds, cache=cache)


def device_loader_threads(setup: Setup) -> tuple[int, int]:
    """(loader processes, threads each) of the DeviceLoader's prefetcher: the DataLoader's
    workers become loader processes, of 4 threads each (with --read-latency-ms, enough to keep
    the emulated waits overlapped); without workers, 4 threads of the training process."""
    return setup.workers, 4 if not setup.read_latency_ms else 16


def device_staging_slots(setup: Setup) -> int:
    """The staging slots of a cache read by the DeviceLoader: twice the prefetcher's lookahead
    (4 x the loads in flight) plus the batches held (the depth, 2, the gather running ahead and
    the caller's one)."""
    processes, threads = device_loader_threads(setup)
    return 2 * 4 * max(1, processes) * threads + 4 * setup.batch_size


def jpeg_dataset(opts: Options, root: Path, **kw: Any) -> D.JpegDataset:
    """The files as ``opts`` describes them: resized to ``decoded_size``, or, with varied sizes,
    decoded at their native size and cropped to ``decoded_size`` after the cache."""
    if opts.sides is None:
        return D.JpegDataset(root, opts.num_images, opts.decoded_size, opts.num_classes, **kw)
    return D.JpegDataset(root, opts.num_images, None, opts.num_classes,
                         augment=D.Augment(size=opts.decoded_size), **kw)


def _in_ram_data(opts: Options, setup: Setup, spec: Spec, root: Path, dw: Dist,
                 info: dict[str, Any]) -> ConfigData:
    """Every decoded sample in one shared tensor, built before timing."""
    n, d = opts.num_images, opts.decoded_size
    t0 = time.perf_counter()
    if opts.sides is not None:
        packed = D.PackedImages(opts.shapes())
        D.build_in_ram_packed(root, packed, workers=setup.workers,
                              start_method=setup.start_method,
                              indices=range(dw.world.rank, n, dw.world.world_size))
        if dw.enabled:  # every rank decoded a disjoint share: the sum is the whole dataset
            dist.all_reduce(packed.flat)
        packed.share_memory_()
        info["build_s"] = time.perf_counter() - t0
        info["bytes"] = packed.flat.numel()
        ds = D.InRamDataset(packed, opts.num_classes, augment=D.Augment(size=d))
        return ConfigData(Columns(spec, 100.0), info, ds, in_ram=packed.flat)
    data = torch.zeros((n, 3, d, d), dtype=torch.uint8)
    D.build_in_ram(root, n, d, workers=setup.workers, start_method=setup.start_method,
                   indices=range(dw.world.rank, n, dw.world.world_size), out=data)
    if dw.enabled:  # every rank decoded a disjoint share: the sum is the whole dataset
        dist.all_reduce(data)
    data.share_memory_()
    info["build_s"] = time.perf_counter() - t0
    info["bytes"] = data.numel()
    return ConfigData(Columns(spec, 100.0), info, D.InRamDataset(data, opts.num_classes),
                      in_ram=data)


def _make_sampler(setup: Setup, ds: torch.utils.data.Dataset, cache: Any,
                  world: stocaching.World, seed: int) -> tuple[Any, str]:
    """The sampler and its name. ``cache-aware`` applies only where there is a cache; the
    no-cache and in-RAM baselines use the random sampler (and say so in their rows)."""
    if setup.sampler == "cache-aware" and cache is not None:
        aware = _cache_aware_class()
        return aware(cache, batch_size=setup.batch_size, num_replicas=world.world_size,
                     rank=world.rank, shuffle=True, seed=seed, drop_last=False), "cache-aware"
    if world.world_size > 1:
        return torch.utils.data.DistributedSampler(ds, num_replicas=world.world_size,
                                                   rank=world.rank, shuffle=True,
                                                   seed=seed), "random"
    return torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(seed)), \
        "random"


def build_data(opts: Options, setup: Setup, spec: Spec, name: str, root: Path, dw: Dist,
               say: Callable[[str], None]) -> ConfigData:
    """Build one configuration: its Dataset (through a new cache named ``name``, over the
    in-RAM tensor, or straight from the files), then the sampler and the DataLoader."""
    info: dict[str, Any] = {"kind": spec.kind, "requested": spec.requested}
    if spec.kind == "cache":
        data = _cache_data(opts, setup, spec, name, root, dw, say, info)
    elif spec.kind == "ram":
        data = _in_ram_data(opts, setup, spec, root, dw, info)
    else:
        ds = jpeg_dataset(opts, root, cache=None, read_latency_ms=setup.read_latency_ms)
        data = ConfigData(Columns(spec, 0.0), info, ds)
    info["config"] = spec.label
    torch.manual_seed(opts.seed)  # the same initial model and augmentations in every config
    data.sampler, sampler_used = _make_sampler(setup, data.dataset, data.cache, dw.world,
                                               opts.seed)
    data.columns = dataclasses.replace(data.columns, sampler_used=sampler_used)
    if setup.loader == "device" and data.cache is not None:
        data.loader = DeviceBatches(data.cache, data.sampler, data.dataset, setup, dw.device,
                                    opts.num_classes)
        return data
    kw: dict[str, Any] = {}
    if setup.workers > 0:
        kw.update(multiprocessing_context=setup.start_method,
                  persistent_workers=setup.persistent_workers)
    data.loader = torch.utils.data.DataLoader(data.dataset, batch_size=setup.batch_size,
                                              sampler=data.sampler, num_workers=setup.workers,
                                              drop_last=False,
                                              pin_memory=torch.cuda.is_available(), **kw)
    return data


class DeviceBatches:
    """A cache's batches through ``stocaching.DeviceLoader``, as the training loop takes a
    DataLoader's: ``(images, labels, hits)`` on the training device. The misses are loaded
    ahead by its prefetcher (``JpegDataset.load``: read and decode) into the cache or staging
    slots; phase two (:class:`~benchmark.data.BatchAugment`) runs on the gathered batch there.
    ``hits`` is empty: the epoch's hits come from ``cache.stats()`` (see ``_row``)."""

    def __init__(self, cache: Any, sampler: Any, ds: D.JpegDataset, setup: Setup,
                 device: torch.device, num_classes: int) -> None:
        processes, threads = device_loader_threads(setup)
        self.loader = stocaching.DeviceLoader(
            cache, sampler, ds.load, batch_size=setup.batch_size, device=device,
            transform=D.BatchAugment(), processes=processes, threads=threads,
            **({"multiprocessing_context": setup.start_method} if processes else {}))
        self.labels = torch.arange(len(ds), device=device) % num_classes  # D.label_of
        self.none = torch.zeros(0, dtype=torch.bool)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Any:
        for images, indices in self.loader:
            yield images, self.labels[indices], self.none

    def close(self) -> None:
        self.loader.close()


def train_epochs(opts: Options, setup: Setup, data: ConfigData, dw: Dist,
                 say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Train a new model ``opts.epochs`` epochs on ``data``; return one row per epoch (the same
    on every rank) and add every rank's measurements to ``data.info["per_rank"]``."""
    device = dw.device
    model: nn.Module = SmallCNN(opts.num_classes).to(device)
    if dw.enabled:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    cache, sampler, label = data.cache, data.sampler, data.columns.spec.label
    rows = []
    for epoch in range(1, opts.epochs + 1):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch - 1)
        if isinstance(data.loader, DeviceBatches):
            data.loader.set_epoch(epoch - 1)
        s0 = cache.stats() if cache is not None else None  # nothing runs between epochs
        dw.barrier()
        elapsed, wait, seen, hits, loss, cpu = _train_epoch(data.loader, model, opt, loss_fn,
                                                            device)
        dw.barrier()
        delta = None
        if cache is not None:
            s1 = cache.stats()
            delta = {k: s1.get(k, 0) - s0.get(k, 0)
                     for k in ("hits", "misses", "writes", "staged_hits")}
            delta["filled"] = s1.get("filled")
        mine = {"rank": dw.world.rank, "local_rank": dw.world.local_rank, "time": elapsed,
                "device": str(device),
                "wait": wait, "samples": seen, "hits": hits, "loss": loss, "cpu": cpu,
                "stats": delta}
        per_rank = dw.all_gather(mine)
        row = _row(opts, setup, data.columns, epoch, per_rank, dw.world.world_size)
        rows.append(row)
        hr = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
        say(f"  {label:>12} epoch {epoch}/{opts.epochs}: {row['epoch_time_s']:6.2f} s, "
            f"{row['samples_per_s']:8,.0f} samples/s, hit rate {hr}, "
            f"stall {100 * row['stall_fraction']:3.0f}%, loss {row['loss']:.3f}")
        data.info.setdefault("per_rank", []).append(per_rank)
    return rows


def _row(opts: Options, setup: Setup, columns: Columns, epoch: int,
         per_rank: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    t = max(r["time"] for r in per_rank)
    # Samples/s of the whole job; the stall fraction is the mean over ranks.
    samples = sum(r["samples"] for r in per_rank)
    row: dict[str, Any] = {
        "config": columns.spec.label, "kind": columns.spec.kind,
        "requested": columns.spec.requested, "cache_gib": columns.cache_gib,
        "slots": columns.slots, "cached_pct": columns.cached_pct, "epoch": epoch,
        "epoch_time_s": t, "samples": samples, "samples_per_s": samples / t if t > 0 else None,
        "data_wait_s": statistics.mean(r["wait"] for r in per_rank),
        "stall_fraction": statistics.mean(r["wait"] / r["time"] for r in per_rank if r["time"]),
        "loss": statistics.mean(r["loss"] for r in per_rank),
        "cpu_s": sum(r["cpu"] for r in per_rank),
        "hit_rate": None, "hits": None, "misses": None, "writes": None, "bench_hits": None,
        "rank_hit_rates": None, "shm_construct_bytes": columns.shm_construct_bytes,
        "cache_bytes": columns.cache_bytes,
        "workers": setup.workers, "batch_size": setup.batch_size,
        "start_method": setup.start_method if setup.workers > 0 else "none",
        "persistent_workers": setup.persistent_workers and setup.workers > 0,
        "sampler": setup.sampler, "sampler_used": columns.sampler_used, "get_slot": setup.get_slot,
        "read_latency_ms": setup.read_latency_ms,
        "world_size": world_size, "threads": torch.get_num_threads(),
        "num_images": opts.num_images, "image_size": opts.image_size,
        "decoded_size": opts.decoded_size, "sizes": opts.sizes,
        "loader": setup.loader,  # (the no-cache and in-RAM rows: a DataLoader regardless)
        "device": per_rank[0].get("device", "cpu"),
    }
    if opts.sides is not None:
        row["image_size"] = None  # the sides vary: see ``sizes``
    if columns.spec.kind == "cache":
        # cache.stats() counts every process attached to the node's cache: sum one view per node.
        leaders = [r["stats"] for r in per_rank if r["local_rank"] == 0 and r["stats"]]
        hits = sum(s["hits"] for s in leaders)
        misses = sum(s["misses"] for s in leaders)
        bench_hits = sum(r["hits"] for r in per_rank)
        if setup.loader == "device":
            # The DeviceLoader counts every row it reads from the segment as a hit (a slot, a
            # staging slot, a slot its prefetcher filled this epoch) and counts no miss: the
            # cache's hits are the slots' rows less those written this epoch; every other
            # sample was loaded.
            hits -= sum(s["staged_hits"] + s["writes"] for s in leaders)
            misses, bench_hits = samples - hits, hits
        row.update(hits=hits, misses=misses, writes=sum(s["writes"] for s in leaders),
                   hit_rate=hits / (hits + misses) if hits + misses else None,
                   bench_hits=bench_hits,
                   rank_hit_rates=[r["hits"] / r["samples"] if r["samples"] else None
                                   for r in per_rank])
        if columns.arena:  # what the budget held at the end of this epoch
            filled = sum(s["filled"] for s in leaders)
            row.update(slots=filled, cached_pct=100.0 * filled / opts.num_images)
    return row


def release(data: ConfigData, dw: Dist) -> None:
    """Give a configuration's memory back before the next one starts: the workers (they map
    the cache) first, then the cache or the in-RAM tensor. Records /dev/shm use in ``info``."""
    if isinstance(data.loader, DeviceBatches):
        data.loader.close()  # (its CUDA registration ends before the cache is unmapped)
    data.loader = data.sampler = data.dataset = None
    gc.collect()
    info = data.info
    if data.cache is not None:
        info["shm_after_epochs_bytes"] = shm_used_bytes()
        st = data.cache.stats()
        if "arena_used" in st:
            info.update(filled=st["filled"], arena_used=st["arena_used"], full=st["full"])
        if st.get("disk_tier_rows"):
            info.update(disk_rows=st["disk_rows"], disk_hits=st["disk_hits"])
        data.cache.close()
        data.cache = None
        gc.collect()
        dw.barrier()
        if info.get("disk_tier"):
            shutil.rmtree(info["disk_tier"], ignore_errors=True)
        after_close = shm_used_bytes()
        if info.get("shm_before_bytes") is not None and after_close is not None:
            info["shm_not_released_bytes"] = after_close - info["shm_before_bytes"]
    if data.in_ram is not None:
        data.in_ram = None
        gc.collect()


def run_config(opts: Options, setup: Setup, spec: Spec, index: int, token: str, root: Path,
               dw: Dist, say: Callable[[str], None]) -> tuple[list[dict[str, Any]],
                                                               dict[str, Any]]:
    """Train ``opts.epochs`` epochs with one configuration; return its rows (one per epoch, the
    same on every rank) and a description (construction time, /dev/shm use...)."""
    data = build_data(opts, setup, spec, f"bench-{token}-{index}", root, dw, say)
    rows = train_epochs(opts, setup, data, dw, say)
    release(data, dw)
    return rows, data.info


def _cpu_snapshot() -> tuple[float, dict[int, float]]:
    """CPU seconds (user + system) of this process and of its waited-for children, and of each
    live child (persistent workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = {}
    for ch in psutil.Process().children(recursive=True):
        try:
            t = ch.cpu_times()
        except psutil.Error:
            continue
        live[ch.pid] = t.user + t.system
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, live


def _cpu_between(a: tuple[float, dict[int, float]], b: tuple[float, dict[int, float]]) -> float:
    return b[0] - a[0] + sum(v - a[1].get(pid, 0.0) for pid, v in b[1].items())


def _train_epoch(loader: torch.utils.data.DataLoader, model: nn.Module,
                 opt: torch.optim.Optimizer, loss_fn: nn.Module,
                 device: torch.device = torch.device("cpu")
                 ) -> tuple[float, float, int, int, float, float]:
    """One epoch. Returns (seconds, seconds waiting in ``next(loader)``, samples, samples that
    came from the cache, mean loss, CPU seconds). The epoch starts at ``iter(loader)`` (worker
    start-up included, as a training loop pays it) and ends after the last step; the batches
    die with this frame, so the shared memory they use is released when it returns.

    CPU seconds are those of this process and its DataLoader workers (not counted: forkserver
    workers, which are children of the fork server). Unlike wall time they barely change when
    other programs compete for the cores, so they show a configuration's own cost."""
    wait = 0.0
    seen = hits = batches = 0
    loss_sum = 0.0
    cpu0 = _cpu_snapshot()
    t0 = time.perf_counter()
    it = iter(loader)
    while True:
        tw = time.perf_counter()
        try:
            x, y, hit = next(it)
        except StopIteration:
            break
        if device.type != "cpu":  # (pinned by the DataLoader: the copies overlap)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        wait += time.perf_counter() - tw
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        seen += y.shape[0]
        hits += int(hit.sum())
        batches += 1
        loss_sum += loss.item()
    elapsed = time.perf_counter() - t0
    return elapsed, wait, seen, hits, loss_sum / max(1, batches), \
        _cpu_between(cpu0, _cpu_snapshot())


def warm_up(opts: Options, setup: Setup, root: Path, dw: Dist) -> float:
    """A few untimed steps of the no-cache pipeline with this setup's loader, so that one-time
    costs (first worker start, first allocations of the model) land on no configuration."""
    t0 = time.perf_counter()
    n = min(opts.num_images, 4 * setup.batch_size)
    ds = jpeg_dataset(opts, root)
    kw: dict[str, Any] = {}
    if setup.workers > 0:
        kw["multiprocessing_context"] = setup.start_method
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, range(dw.world.rank, n,
                                                                            dw.world.world_size)),
                                         batch_size=setup.batch_size,
                                         num_workers=setup.workers, **kw)
    model = SmallCNN(opts.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=opts.lr)
    _train_epoch(loader, model, opt, nn.CrossEntropyLoss())
    dw.barrier()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# A run or a sweep
# ----------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import PIL

    env: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "numpy": np.__version__, "pillow": PIL.__version__,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    env["stocaching"] = getattr(stocaching, "__version__", "?")
    env["stocaching_file"] = stocaching.__file__
    return env


def run_grid(opts: Options, setups: Sequence[Setup], specs: Sequence[Spec],
             threads_override: int | None, say: Callable[[str], None],
             on_group: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Run every configuration of ``specs`` under every setup. On rank 0 returns the results
    (``rows``, ``configs``, ``checks``, ...); the other ranks return the same rows."""
    dw = Dist()
    threads = torch.get_num_threads()
    try:
        return _run_grid(opts, setups, specs, threads_override, say if dw.is_main else _quiet,
                         on_group if dw.is_main else None, dw)
    finally:
        torch.set_num_threads(threads)
        dw.close()


def _quiet(_: str) -> None:
    pass


def _run_grid(opts: Options, setups: Sequence[Setup], specs: Sequence[Spec],
              threads_override: int | None, say: Callable[[str], None],
              on_group: Callable[[list[dict[str, Any]]], None] | None,
              dw: Dist) -> dict[str, Any]:
    load_before = os.getloadavg()[0]  # before we add any load of our own
    if any(s.kind == "cache" for s in specs) and any(st.sampler == "cache-aware" for st in setups):
        _cache_aware_class()  # fail before any work when it is missing
    root = opts.data_dir or D.default_data_dir(opts.num_images, opts.image_size,
                                               opts.jpeg_quality, opts.seed, opts.num_classes,
                                               opts.sides)
    gen_s = 0.0
    if dw.world.is_local_leader:
        _, gen_s = D.ensure_dataset(root, opts.num_images, opts.image_size,
                                    quality=opts.jpeg_quality, seed=opts.seed,
                                    num_classes=opts.num_classes, processes=opts.gen_processes,
                                    progress=dw.is_main, sides=opts.sides)
    dw.barrier()
    if opts.sides is None:
        what = f"{opts.image_size}x{opts.image_size}"
    else:
        shapes = opts.shapes()
        mean = sum(3 * h * w for h, w in shapes) / len(shapes)
        what = (f"varied sizes (height and width each {opts.sides[0]}..{opts.sides[1]}), "
                f"cached at native size (3, None, None), {mean / 1024:.0f} KiB a sample on "
                f"average, {sum(3 * h * w for h, w in shapes) / MIB:.0f} MiB in all; random "
                f"{opts.decoded_size}x{opts.decoded_size} crop after the cache")
    say(f"dataset: {opts.num_images} JPEGs of {what}, in {root}"
        + (f" (generated in {gen_s:.1f} s)" if gen_s else " (reused)"))
    if opts.warm_page_cache:
        ws, nbytes = D.warm_page_cache(root, opts.num_images)
        say(f"page cache warmed: read {nbytes / MIB:.0f} MiB in {ws:.1f} s")
    token = dw.broadcast(secrets.token_hex(4))
    all_rows: list[dict[str, Any]] = []
    all_info: list[dict[str, Any]] = []
    t_start, others_before = time.perf_counter(), _others_cpu()
    for g, setup in enumerate(setups):
        threads = threads_override or default_threads(setup.workers, dw.world.local_world_size)
        torch.set_num_threads(threads)
        lat = (f"; EMULATED read latency {setup.read_latency_ms:g} ms per miss"
               if setup.read_latency_ms else "")
        say(f"setup {g + 1}/{len(setups)}: workers={setup.workers} batch={setup.batch_size} "
            f"start={setup.start_method} persistent={setup.persistent_workers} "
            f"sampler={setup.sampler} get_slot={setup.get_slot} ranks={dw.world.world_size} "
            f"trainer threads={threads}{lat}")
        warm_up(opts, setup, Path(root), dw)
        group_rows = []
        for rep in range(opts.repeats):
            # Odd repeats run the configurations in reverse order, so a drift in the machine's
            # speed does not always favour the same configurations.
            order = list(enumerate(specs))
            if rep % 2:
                order.reverse()
                say(f" repeat {rep + 1}/{opts.repeats} (configurations in reverse order)")
            elif opts.repeats > 1:
                say(f" repeat {rep + 1}/{opts.repeats}")
            for k, spec in order:
                index = (g * opts.repeats + rep) * len(specs) + k
                rows, info = run_config(opts, setup, spec, index, token, Path(root), dw, say)
                for r in rows:
                    r["repeat"] = rep + 1
                info["setup"] = dataclasses.asdict(setup)
                info["repeat"] = rep + 1
                group_rows += rows
                all_info.append(info)
        all_rows += group_rows
        if on_group is not None:
            on_group(group_rows)
    checks = [{"setup": report.group_title(g), **c} for g in report.groups(all_rows)
              for c in report.check_targets(g)]
    return {"rows": all_rows, "configs": all_info, "checks": checks, "data_dir": str(root),
            "generate_s": gen_s, "elapsed_s": time.perf_counter() - t_start,
            "world_size": dw.world.world_size, "is_main": dw.is_main, "environment": environment(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0],
            "others_cpu_cores": (_others_cpu() - others_before) /
            max(1e-9, time.perf_counter() - t_start)}


def _others_cpu() -> float:
    """CPU seconds the whole machine has spent busy, less this process's and its children's
    (the workers, waited for or alive): what other programs took. Over a run, divided by its
    wall time, the cores they used meanwhile (the load average counts the run's own workers)."""
    t = psutil.cpu_times()
    busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + \
        getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
    ours, live = _cpu_snapshot()
    return busy - ours - sum(live.values())


def describe_shm(results: dict[str, Any]) -> str:
    """/dev/shm use per cache configuration (measured on rank 0's node)."""
    lines = []
    several = len({tuple(sorted(i["setup"].items())) for i in results["configs"]}) > 1
    for info in results["configs"]:
        if info["kind"] != "cache":
            continue
        st = info["setup"]
        where = (f"[workers={st['workers']}, batch={st['batch_size']}, {st['start_method']}, "
                 f"{st['sampler']}, latency {st['read_latency_ms']:g} ms, repeat "
                 f"{info.get('repeat', 1)}] " if several else "")
        c, b, na = (info.get("shm_construct_bytes"), info.get("cache_bytes"),
                    info.get("shm_not_released_bytes"))
        after = info.get("shm_after_epochs_bytes")
        before = info.get("shm_before_bytes")
        filled = None if after is None or before is None else after - before

        def mib(v: Any) -> str:
            return "?" if v is None else f"{v / MIB:.1f} MiB"

        held = (f"{info['filled']} samples held ({mib(info['arena_used'])} of the "
                f"{mib(info.get('arena_bytes'))} arena, {info['full']} writes refused), "
                if "arena_used" in info else f"{info.get('slots')} slots, ")
        lines.append(f"  {where}{info['config']:>12}: {held}"
                     f"stats()['bytes'] {mib(b)}, /dev/shm used +{mib(c)} after construction, "
                     f"+{mib(filled)} after the epochs, {mib(na)} left after close(); "
                     f"construction {info.get('construct_s', math.nan):.2f} s")
    return "\n".join(lines)


def stats_consistency(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where cache.stats()'s hit count disagrees with the hits the Dataset saw."""
    out = []
    for r in rows:
        if r["kind"] == "cache" and r.get("hits") is not None and r["hits"] != r["bench_hits"]:
            out.append(f"{r['config']} epoch {r['epoch']}: cache.stats() counted {r['hits']} "
                       f"hits, the Dataset got {r['bench_hits']} samples from the cache")
        if r["kind"] == "cache" and r.get("hits") is not None and \
                r["hits"] + r["misses"] != r["samples"]:
            out.append(f"{r['config']} epoch {r['epoch']}: cache.stats() counted "
                       f"{r['hits']} hits + {r['misses']} misses = {r['hits'] + r['misses']} "
                       f"reads, the loop consumed {r['samples']} samples")
    return out


def timestamp_dir(base: str | Path = "benchmark-results") -> Path:
    return Path(base) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
