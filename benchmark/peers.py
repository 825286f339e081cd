"""Side by side with the peers: ``python -m benchmark peers``.

The benchmark's JPEGs (``--num-images`` of ``--image-size``, generated once) decoded once to
uint8 ``(3, D, D)`` (``--decoded-size``; timed: the shared preprocessing of the in-RAM bound
and of the peers, which write these arrays out in their own formats), then read by every arm
with ``--workers`` workers, batches of ``--batch-size``, shuffled, each through its documented
fast path, loader only (no model) and with augmentation:

- **decode_every_epoch**: ``JpegDataset`` without a cache, a ``DataLoader``: every sample is
  read and decoded every epoch (the floor);
- **stocaching_dataloader**: a ``SharedCache`` of every sample, the two-line ``get_slot``
  pattern in a ``DataLoader``; its epoch 1 decodes and fills the cache;
- **stocaching_batch**: stocaching's batch path (:func:`batch_loader`) over a cache of its own,
  filled by its own epoch 1; augmentation is ``BatchAugment`` on each batch;
- **in_ram**: the decoded set as one shared tensor, a ``DataLoader`` (the ceiling of a
  per-sample loader);
- **litdata**: ``litdata.optimize`` of the arrays, ``StreamingDataset`` + ``StreamingDataLoader``;
- **mosaicml**: ``MDSWriter`` with an ``ndarray`` column, ``streaming.StreamingDataset``, a
  ``DataLoader``;
- **webdataset**: tar shards of ``.npy``, a shuffle buffer of 1,000, ``WebLoader``;
- **ffcv**: ``DatasetWriter`` with an ``NDArrayField`` of the HWC arrays, ``ffcv.loader.Loader``
  (``os_cache=True``, ``OrderOption.RANDOM``; its workers are threads); augmentation is its own
  compiled ops (``RandomHorizontalFlip``, ``RandomTranslate(4)``, ``NormalizeImage``), the
  batch a channels-last view, as FFCV's examples deliver it.

Per-sample loaders apply ``data.Augment()`` per sample (pad 4, random crop, flip, float,
normalise); FFCV's ops do the same work per batch. A peer that is not installed is listed as
skipped with its install command; an arm that raises is listed as failed with its error, and
the others go on.

Each arm's preprocessing and epoch 1 run once, then one untimed warm epoch of each of its two
loaders (workers started, FFCV's pipeline compiled, the batch path's buffers touched);
``--repeats`` interleaved rounds then run ``--epochs`` warm epochs of every arm, loader only
and with augmentation, and more until ``--min-seconds`` have passed (odd rounds in reverse
order). Reported: preprocessing seconds, epoch-1 seconds, warm samples/s (median and range over
rounds), CPU seconds of the process tree per 1,000 samples, and the load average.

Target checks (measured, not asserted): stocaching_batch >= 1.0 x FFCV, loader only and with
augmentation; and the ratio of stocaching_dataloader to every other arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from . import arguments as A

FFCV_MIN = 1.0  # stocaching_batch against FFCV, loader only and with augmentation
WDS_SHUFFLE = 1000
WDS_SHARD_SAMPLES = 1000
MODES = ("loader", "augment")

#: The peers: the module to import and how to install it.
PEERS = {
    "litdata": ("litdata", "pip install litdata==0.2.76"),
    "mosaicml": ("streaming", "pip install mosaicml-streaming==0.13.0"),
    "webdataset": ("webdataset", "pip install webdataset==1.0.2"),
    "ffcv": ("ffcv", "apt-get install libopencv-dev libturbojpeg0-dev pkg-config; "
                     "pip install ffcv==1.0.2"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-images", type=A.positive_int, default=6000,
                   help="samples (default: %(default)s)")
    p.add_argument("--image-size", type=A.positive_int, default=512,
                   help="side of the source JPEGs (default: %(default)s)")
    p.add_argument("--decoded-size", type=A.positive_int, default=128,
                   help="side of the decoded uint8 image (default: %(default)s)")
    p.add_argument("--workers", type=A.positive_int, default=2,
                   help="workers of every arm (FFCV: threads) (default: %(default)s)")
    p.add_argument("--batch-size", type=A.positive_int, default=64, help="default: %(default)s")
    p.add_argument("--repeats", type=A.positive_int, default=3,
                   help="interleaved rounds of warm epochs (default: %(default)s)")
    p.add_argument("--epochs", type=A.positive_int, default=1,
                   help="warm epochs of each arm and mode per round, at least (default: "
                        "%(default)s)")
    p.add_argument("--min-seconds", type=A.non_negative_float, default=1.0,
                   help="and more epochs until this many seconds have passed, for the loaders "
                        "whose epoch takes a few ms (default: %(default)s)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), metavar="ARM",
                   help=f"a subset of {', '.join(ARMS)} (default: all)")
    p.add_argument("--threads", type=A.positive_int, default=None,
                   help="torch's threads in this process, for every arm (the batch path gathers "
                        "and augments here; the DataLoader's workers run one each). Default: the "
                        "cores the workers leave, at least 1, as python -m benchmark does: with "
                        "every core given to torch, its threads wait for each other whenever "
                        "another process runs (BatchAugment took 32 ms a batch instead of 1.3)")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the JPEGs live (default: the main benchmark's cache directory)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory; the peers' files go to a temporary directory in it, "
                        "removed at the end (default: ./benchmark-results/<timestamp>/peers)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plot")


# ----------------------------------------------------------------------------------------------
# The data every arm reads, and how an epoch is measured
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Data:
    """What the arms share: the JPEGs, their decoded arrays and the loader settings."""

    root: Path
    images: Any  # torch uint8 (N, 3, D, D), in shared memory
    labels: Any  # torch int64 (N,)
    num_classes: int
    work: Path  # the peers' files
    workers: int
    batch_size: int
    seed: int
    threads: int  # torch's intra-op threads in this process, set again before every arm runs

    @property
    def n(self) -> int:
        return len(self.images)

    @property
    def size(self) -> int:
        return int(self.images.shape[-1])


def tree_cpu_s() -> float:
    """CPU seconds of this process, its live descendants and its reaped children."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # ended meanwhile: counted below once reaped
            pass
    t = os.times()
    return total + t.children_user + t.children_system


def measure(epoch: Callable[[], int], epochs: int = 1, at_least: float = 0.0
            ) -> dict[str, float]:
    """Run ``epochs`` epochs, and more until ``at_least`` seconds have passed (an epoch of a
    fast loader is a few ms here, as noisy as a scheduler's tick): their samples, seconds and
    CPU seconds, summed, and how many epochs ran."""
    c0, t0 = tree_cpu_s(), time.perf_counter()
    samples = runs = 0
    while runs < epochs or time.perf_counter() - t0 < at_least:
        samples += epoch()
        runs += 1
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": samples, "cpu_s": tree_cpu_s() - c0,
            "epochs": runs}


def _as_is(x: Any) -> Any:
    return x


def _count(batches: Iterable[Any]) -> int:
    """Samples in an epoch of ``(images, ...)`` batches."""
    return sum(len(b[0]) for b in batches)


def _dataloader(ds: Any, data: Data, **kw: Any) -> Any:
    import torch

    return torch.utils.data.DataLoader(ds, batch_size=data.batch_size, num_workers=data.workers,
                                       persistent_workers=True, drop_last=False, **kw)


class Rows:
    """Sample ``i`` of the decoded set: ``(image, label)``, ``transform(image)`` when given; a
    torch Dataset, and the rows of the peers' writers (of numpy arrays for FFCV's)."""

    def __init__(self, images: Any, labels: Any, transform: Callable[[Any], Any] = _as_is):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.transform(self.images[i]), int(self.labels[i])


class ArrayAugment:
    """``data.Augment`` of a peer's uint8 CHW ndarray."""

    def __init__(self) -> None:
        from .data import Augment
        self.augment = Augment()

    def __call__(self, x: Any) -> Any:
        import torch
        return self.augment(torch.from_numpy(x))


# ----------------------------------------------------------------------------------------------
# The arms
# ----------------------------------------------------------------------------------------------


class Arm:
    """One loader stack. ``prepare()`` once (timed: preprocessing), then ``make(augment)``
    returns an epoch function (``() -> samples delivered``), called once per epoch; ``close()``
    releases what the arm holds. ``peer`` names an entry of :data:`PEERS`."""

    peer: str | None = None

    def __init__(self, data: Data) -> None:
        self.data = data
        self.closers: list[Callable[[], None]] = []

    def prepare(self) -> None:
        pass

    def make(self, augment: bool) -> Callable[[], int]:
        raise NotImplementedError

    def close(self) -> None:
        while self.closers:
            self.closers.pop()()


class DecodeEveryEpoch(Arm):
    def make(self, augment: bool) -> Callable[[], int]:
        from .data import Augment, JpegDataset

        d = self.data
        ds = JpegDataset(d.root, d.n, d.size, d.num_classes, cache=None,
                         augment=Augment() if augment else _as_is)  # type: ignore[arg-type]
        loader = _dataloader(ds, d, shuffle=True)
        return lambda: _count(loader)


def _full_cache(data: Data, label: str) -> Any:
    from stocaching import SharedCache

    from .run import gib_for_slots
    return SharedCache(gib_for_slots(data.n, data.n, 3 * data.size ** 2), data.n,
                       (3, data.size, data.size), name=f"peers-{label}-{os.getpid()}")


class _CachingArm(Arm):
    """An arm over a cache of every sample of its own, filled by its epoch 1."""

    label = ""  # (the cache's name)

    def prepare(self) -> None:
        self.cache = _full_cache(self.data, self.label)
        self.closers.append(self.cache.close)


class StocachingDataLoader(_CachingArm):
    label = "dataloader"

    def make(self, augment: bool) -> Callable[[], int]:
        from .data import Augment, JpegDataset

        d = self.data
        ds = JpegDataset(d.root, d.n, d.size, d.num_classes, cache=self.cache,
                         augment=Augment() if augment else _as_is)  # type: ignore[arg-type]
        loader = _dataloader(ds, d, shuffle=True)
        return lambda: _count(loader)


def batch_loader(cache: Any, sampler: Any, load: Callable[[int], Any], *, batch_size: int,
                 workers: int, transform: Callable[[Any], Any] | None) -> Any:
    """stocaching's batch path, the one place that builds it: an iterable of ``(batch,
    indices)`` over ``cache`` in ``sampler``'s order, whose misses ``load(index)`` fills (the
    arm's epoch 1), ``transform(batch)`` applied to each batch, with ``set_epoch`` and
    ``close``."""
    from stocaching import DeviceLoader

    return DeviceLoader(cache, sampler, load, batch_size=batch_size, device="cpu",
                        transform=transform, processes=workers, threads=4)


class StocachingBatch(_CachingArm):
    label = "batch"

    def make(self, augment: bool) -> Callable[[], int]:
        import torch

        from .data import BatchAugment, JpegDataset

        d = self.data
        ds = JpegDataset(d.root, d.n, d.size, d.num_classes)
        sampler = torch.utils.data.RandomSampler(
            range(d.n), generator=torch.Generator().manual_seed(d.seed + augment))
        loader = batch_loader(self.cache, sampler, ds.load, batch_size=d.batch_size,
                              workers=d.workers, transform=BatchAugment() if augment else None)
        self.closers.insert(0, loader.close)  # before the cache
        epochs = iter(range(sys.maxsize))

        def epoch() -> int:
            loader.set_epoch(next(epochs))
            return _count(loader)
        return epoch


class InRam(Arm):
    def make(self, augment: bool) -> Callable[[], int]:
        from .data import Augment

        d = self.data
        loader = _dataloader(Rows(d.images, d.labels, Augment() if augment else _as_is), d,
                             shuffle=True)
        return lambda: _count(loader)


class LitData(Arm):
    peer = "litdata"

    def prepare(self) -> None:
        import litdata

        self.dir = self.data.work / "litdata"
        # optimize() sets the global start method (spawn by default, which would pickle the
        # arrays to every worker); fork here, and the other arms' default back afterwards.
        before = mp.get_start_method(allow_none=True)
        try:
            litdata.optimize(fn=_LitRow(self.data.images.numpy(), self.data.labels.numpy()),
                             inputs=list(range(self.data.n)), output_dir=str(self.dir),
                             chunk_bytes="64MB", num_workers=self.data.workers,
                             start_method="fork", verbose=False)
        finally:
            mp.set_start_method(before, force=True)

    def make(self, augment: bool) -> Callable[[], int]:
        import litdata

        d = self.data
        ds = litdata.StreamingDataset(str(self.dir), shuffle=True, seed=d.seed,
                                      transform=_LitAugment() if augment else None)
        loader = litdata.StreamingDataLoader(ds, batch_size=d.batch_size, num_workers=d.workers,
                                             persistent_workers=True)
        return lambda: sum(len(b["label"]) for b in loader)


class _LitRow:
    def __init__(self, images: Any, labels: Any) -> None:
        self.images, self.labels = images, labels

    def __call__(self, i: int) -> dict[str, Any]:
        return {"image": self.images[i], "label": int(self.labels[i])}


class _LitAugment(ArrayAugment):
    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        return {"image": super().__call__(sample["image"]), "label": sample["label"]}


class MosaicML(Arm):
    peer = "mosaicml"

    def prepare(self) -> None:
        from streaming import MDSWriter

        d = self.data
        self.dir = d.work / "mds"
        columns = {"image": f"ndarray:uint8:3,{d.size},{d.size}", "label": "int64"}
        images, labels = d.images.numpy(), d.labels.numpy()
        with MDSWriter(out=str(self.dir), columns=columns) as out:
            for i in range(d.n):
                out.write({"image": images[i], "label": int(labels[i])})

    def make(self, augment: bool) -> Callable[[], int]:
        # One StreamingDataset per local directory at a time: the augmenting one reads a
        # link to the same shards.
        d = self.data
        local = self.augment_dir() if augment else self.dir
        ds = _mds_class()(local=str(local), shuffle=True, shuffle_seed=d.seed,
                          batch_size=d.batch_size)
        ds.transform = ArrayAugment() if augment else _as_is
        loader = _dataloader(ds, d)
        return lambda: _count(loader)

    def augment_dir(self) -> Path:
        """A second local directory of the written shards: a link to them, by their absolute
        path (a relative target is resolved from the link's folder, and ``--out`` is relative
        by default)."""
        local = self.data.work / "mds-augment"
        local.symlink_to(self.dir.resolve(), target_is_directory=True)
        return local

    def close(self) -> None:
        super().close()
        from streaming.base.util import clean_stale_shared_memory
        clean_stale_shared_memory()


@functools.lru_cache(maxsize=None)
def _mds_class() -> type:
    """streaming's documented way to transform: a subclass whose ``__getitem__`` does it
    (made here: streaming may not be installed; the workers fork, nothing pickles it)."""
    from streaming import StreamingDataset

    class MdsImages(StreamingDataset):
        transform: Callable[[Any], Any] = staticmethod(_as_is)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            s = super().__getitem__(i)
            return self.transform(s["image"]), s["label"]

    return MdsImages


class WebDataset(Arm):
    peer = "webdataset"

    def prepare(self) -> None:
        import webdataset as wds

        d = self.data
        out = d.work / "wds"
        out.mkdir()
        shards = min(d.n, max(2 * d.workers, -(-d.n // WDS_SHARD_SAMPLES)))
        per = -(-d.n // shards)
        self.urls = []
        images, labels = d.images.numpy(), d.labels.numpy()
        for k in range(shards):
            self.urls.append(str(out / f"train-{k:05d}.tar"))
            with wds.TarWriter(self.urls[-1]) as sink:
                for i in range(k * per, min(d.n, (k + 1) * per)):
                    sink.write({"__key__": f"{i:08d}", "npy": images[i], "cls": int(labels[i])})

    def make(self, augment: bool) -> Callable[[], int]:
        import webdataset as wds

        d = self.data
        ds = (wds.WebDataset(self.urls, shardshuffle=len(self.urls), seed=d.seed,
                             nodesplitter=wds.split_by_node)
              .shuffle(WDS_SHUFFLE).decode().to_tuple("npy", "cls")
              .map_tuple(ArrayAugment() if augment else _as_is, _as_is))
        loader = wds.WebLoader(ds, batch_size=d.batch_size, num_workers=d.workers,
                               persistent_workers=True)
        return lambda: _count(loader)


class Ffcv(Arm):
    peer = "ffcv"

    def prepare(self) -> None:
        import numpy as np
        from ffcv.fields import IntField, NDArrayField
        from ffcv.writer import DatasetWriter

        d = self.data
        self.beton = d.work / "data.beton"
        fields = {"image": NDArrayField(np.dtype("uint8"), (d.size, d.size, 3)),
                  "label": IntField()}
        # HWC numpy arrays made here: the writer's forked workers then run no torch op, which
        # hangs in a child forked after torch's OpenMP threads ran (seen with 2 threads).
        hwc = d.images.permute(0, 2, 3, 1).contiguous().numpy()
        DatasetWriter(str(self.beton), fields, num_workers=d.workers).from_indexed_dataset(
            Rows(hwc, d.labels.numpy()))

    def make(self, augment: bool) -> Callable[[], int]:
        import numpy as np
        from ffcv.fields.decoders import IntDecoder, NDArrayDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import (NormalizeImage, RandomHorizontalFlip, RandomTranslate,
                                     Squeeze, ToTensor, ToTorchImage)

        from .data import MEAN, STD
        d = self.data
        ops = [RandomHorizontalFlip(), RandomTranslate(padding=4),
               NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255, np.float32)]
        loader = Loader(str(self.beton), batch_size=d.batch_size, num_workers=d.workers,
                        os_cache=True, order=OrderOption.RANDOM, seed=d.seed, drop_last=False,
                        pipelines={"image": [NDArrayDecoder(), *(ops if augment else []),
                                             ToTensor(), ToTorchImage()],
                                   "label": [IntDecoder(), ToTensor(), Squeeze()]})
        return lambda: _count(loader)


ARM_CLASSES: dict[str, type[Arm]] = {
    "decode_every_epoch": DecodeEveryEpoch, "stocaching_dataloader": StocachingDataLoader,
    "stocaching_batch": StocachingBatch, "in_ram": InRam, "litdata": LitData,
    "mosaicml": MosaicML, "webdataset": WebDataset, "ffcv": Ffcv}
ARMS = tuple(ARM_CLASSES)


def unavailable(peer: str | None) -> str | None:
    """Why ``peer`` cannot run here ("skipped (not installed: ...)", or "failed: ..." when its
    import raises), or None."""
    if peer is None:
        return None
    module, hint = PEERS[peer]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return f"skipped (not installed: {hint})"
        return f"failed: import {module}: {type(e).__name__}: {e}{_reinstall(e, hint)}"
    except Exception as e:  # a broken install: say how
        return f"failed: import {module}: {type(e).__name__}: {e}{_reinstall(e, hint)}"
    return None


def _reinstall(error: BaseException, hint: str) -> str:
    """How to mend a peer whose import raised ``error``."""
    if "torchvision" in str(error):
        import torch
        return (f" (the torchvision pip installed was not built for this torch, "
                f"{torch.__version__}: install the torchvision built for it, or a torch and "
                f"torchvision from one index; then {hint})")
    return f" (reinstall: {hint})"


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    status: str = "ok"  # "ok", "skipped (...)" or "failed: ..."
    preprocess_s: float | None = None
    epoch1: dict[str, float] | None = None
    warm: dict[str, list[dict[str, float]]] = dataclasses.field(
        default_factory=lambda: {m: [] for m in MODES})

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def rates(self, mode: str) -> list[float]:
        return [e["samples"] / e["seconds"] for e in self.warm[mode]]

    def rate(self, mode: str) -> float | None:
        r = self.rates(mode)
        return statistics.median(r) if r and self.ok else None

    def cpu_per_1k(self, mode: str) -> float | None:
        e = self.warm[mode]
        return statistics.median(1000 * x["cpu_s"] / x["samples"] for x in e) if e else None

    def short_epochs(self, n: int) -> list[int]:
        every = ([self.epoch1] if self.epoch1 else []) + self.warm["loader"] + self.warm["augment"]
        return sorted({int(e["samples"] / e["epochs"]) for e in every
                       if e["samples"] != n * e["epochs"]})


def _failed(e: BaseException) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _load(la: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in la)


def run_arms(data: Data, names: list[str], repeats: int, epochs: int, at_least: float,
             say: Callable[[str], None]) -> dict[str, Result]:
    """Prepare every arm, then the interleaved rounds; every arm is closed at the end.

    Before each arm runs, torch's threads in this process are set to ``data.threads``
    (``--threads``): FFCV sets them to its workers at every epoch."""
    import torch

    results = {name: Result() for name in names}
    arms: dict[str, Arm] = {}
    loaders: dict[str, dict[str, Callable[[], int]]] = {}
    try:
        for name in names:
            arm = ARM_CLASSES[name](data)
            res = results[name]
            why = unavailable(arm.peer)
            if why:
                res.status = why
                say(f"{name}: {why}")
                continue
            arms[name] = arm
            torch.set_num_threads(data.threads)
            try:
                t0 = time.perf_counter()
                arm.prepare()
                res.preprocess_s = time.perf_counter() - t0
                loaders[name] = {"loader": arm.make(augment=False)}
                res.epoch1 = measure(loaders[name]["loader"])
                loaders[name]["loader"]()  # untimed: the first warm epoch (fresh buffers)
                loaders[name]["augment"] = arm.make(augment=True)
                loaders[name]["augment"]()  # untimed: workers started, pipeline compiled
            except Exception as e:
                res.status = _failed(e)
                loaders.pop(name, None)
                arms.pop(name).close()
                say(f"{name}: {res.status}")
                continue
            say(f"{name}: preprocessing {res.preprocess_s:.2f} s, epoch 1 "
                f"{res.epoch1['seconds']:.2f} s")
        for r in range(repeats):
            order = list(loaders)[::-1 if r % 2 else 1]
            line = []
            for name in order:
                torch.set_num_threads(data.threads)
                try:
                    for mode in MODES:
                        results[name].warm[mode].append(
                            measure(loaders[name][mode], epochs, at_least))
                except Exception as e:
                    results[name].status = _failed(e)
                    del loaders[name]
                    arms.pop(name).close()
                    say(f"{name}: {results[name].status}")
                    continue
                rates = [results[name].rates(m)[-1] for m in MODES]
                line.append(f"{name} {rates[0]:,.0f}/{rates[1]:,.0f}")
            say(f"round {r + 1} (samples/s, loader only/with augment): {', '.join(line)}")
    finally:
        for arm in arms.values():
            arm.close()
    return results


def _rate_cell(res: Result, mode: str) -> str:
    r = res.rates(mode)
    return f"{statistics.median(r):,.0f} ({min(r):,.0f}-{max(r):,.0f})" if r else "-"


def format_table(results: dict[str, Result], n: int) -> str:
    def num(x: float | None, f: str = ".2f") -> str:
        return "-" if x is None else format(x, f)

    lines = ["| arm | preprocess s | epoch 1 s | loader only /s | with augment /s "
             "| CPU s / 1k, loader only | CPU s / 1k, augment | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, res in results.items():
        notes = [] if res.ok else [res.status]
        short = res.short_epochs(n)
        if short:
            notes.append(f"epochs of {', '.join(map(str, short))} samples, not {n}")
        lines.append(" | ".join([
            f"| {name}", num(res.preprocess_s),
            num(res.epoch1["seconds"] if res.epoch1 else None),
            _rate_cell(res, "loader"), _rate_cell(res, "augment"),
            num(res.cpu_per_1k("loader"), ".3f"), num(res.cpu_per_1k("augment"), ".3f"),
            "; ".join(notes)]) + " |")
    return "\n".join(lines)


def check_targets(results: dict[str, Result]) -> tuple[list[str], list[dict[str, Any]]]:
    """The target lines and their records: stocaching_batch against FFCV, and the ratios of
    stocaching_dataloader to every other arm."""
    lines, checks = [], []
    ours, ffcv = results.get("stocaching_batch"), results.get("ffcv")
    for mode, words in (("loader", "loader only"), ("augment", "with augment")):
        what = (f"stocaching_batch {words} >= {FFCV_MIN:g} x ffcv {words}")
        if ffcv is None or not ffcv.ok:
            why = ("ffcv not run" if ffcv is None else "ffcv not installed"
                   if ffcv.status.startswith("skipped") else f"ffcv {ffcv.status}")
            lines.append(f"[SKIP] {why}: {what}")
            checks.append({"check": what, "result": "SKIP", "why": why})
            continue
        if ours is None or not ours.ok:
            why = "stocaching_batch not run" if ours is None else f"stocaching_batch {ours.status}"
            lines.append(f"[SKIP] {why}: {what}")
            checks.append({"check": what, "result": "SKIP", "why": why})
            continue
        a, b = ours.rate(mode), ffcv.rate(mode)
        assert a is not None and b is not None
        ok = a >= FFCV_MIN * b
        lines.append(f"[{'PASS' if ok else 'MISS'}] {what}: {a:,.0f} vs {b:,.0f} samples/s "
                     f"({a / b:.2f} x)")
        checks.append({"check": what, "result": "PASS" if ok else "MISS", "ours": a,
                       "ffcv": b, "ratio": a / b})
    base = results.get("stocaching_dataloader")
    if base is not None and base.ok:
        parts = []
        for name, res in results.items():
            if name == "stocaching_dataloader":
                continue
            if not res.ok:
                parts.append(f"{name} {res.status.split(' (')[0].split(':')[0]}")
                continue
            parts.append(f"{name} " + " / ".join(
                f"{base.rate(m) / res.rate(m):.2f} x" for m in MODES))  # type: ignore[operator]
        lines.append("stocaching_dataloader against each arm, warm samples/s (loader only / "
                     "with augment): " + ", ".join(parts))
    return lines, checks


def make_plot(results: dict[str, Result], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if r.ok and r.rates("loader")]
    fig, ax = plt.subplots(figsize=(1.2 * max(4, len(names)) + 2, 4.5))
    width = 0.4
    for k, (mode, label) in enumerate((("loader", "loader only"), ("augment", "with augment"))):
        med = [results[n].rate(mode) or 0.0 for n in names]
        lo = [m - min(results[n].rates(mode)) for n, m in zip(names, med)]
        hi = [max(results[n].rates(mode)) - m for n, m in zip(names, med)]
        ax.bar([i + (k - 0.5) * width for i in range(len(names))], med, width, yerr=[lo, hi],
               capsize=3, label=label)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_yscale("log")  # (the arms span three orders of magnitude)
    ax.set_ylabel("warm samples/s (median, range over rounds)")
    ax.set_title("the same decoded samples through each loader")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("torch", "numpy", "stocaching", "litdata", "mosaicml-streaming", "webdataset",
                 "ffcv", "numba"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    import torch

    from .data import build_in_ram, default_data_dir, ensure_dataset, label_of
    from .run import default_threads, timestamp_dir

    out = args.out or timestamp_dir() / "peers"
    out.mkdir(parents=True, exist_ok=True)
    n, size, classes = args.num_images, args.decoded_size, 10
    root = args.data_dir or default_data_dir(n, args.image_size, 90, 0, classes)
    ensure_dataset(root, n, args.image_size)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    images = build_in_ram(root, n, size, workers=args.workers, start_method=None)
    decode_s = time.perf_counter() - t0
    images.share_memory_()
    labels = torch.tensor([label_of(i, classes) for i in range(n)], dtype=torch.int64)
    names = [a for a in ARMS if a in args.arms]
    threads = args.threads or default_threads(args.workers, 1)
    say(f"{n} JPEGs of {args.image_size} px decoded once to (3, {size}, {size}) in "
        f"{decode_s:.2f} s (the shared preprocessing of in_ram and the peers, not in their "
        f"column); {args.workers} workers, batch {args.batch_size}, {args.repeats} rounds of "
        f"{args.epochs} warm epoch(s) or more, for {args.min_seconds:g} s at least; torch "
        f"threads in this process: {threads}; load average "
        f"{_load(load_before)}")
    work = Path(tempfile.mkdtemp(prefix="peers-files-", dir=out))
    threads_before = torch.get_num_threads()
    try:
        data = Data(root=Path(root), images=images, labels=labels, num_classes=classes,
                    work=work, workers=args.workers, batch_size=args.batch_size, seed=args.seed,
                    threads=threads)
        results = run_arms(data, names, args.repeats, args.epochs, args.min_seconds, say)
    finally:
        torch.set_num_threads(threads_before)
        shutil.rmtree(work, ignore_errors=True)
    if "in_ram" in results and results["in_ram"].ok:
        results["in_ram"].preprocess_s = decode_s
    load_after = os.getloadavg()
    say("")
    say(format_table(results, n))
    say(f"load average at the start {_load(load_before)}, at the end {_load(load_after)} "
        f"({os.cpu_count()} cores)")
    say("target checks (measured, not asserted):")
    lines, checks = check_targets(results)
    for line in lines:
        say(line)
    files = [out / "results.json"]
    if args.plot:
        files.append(make_plot(results, out / "peers.png"))
    (out / "results.json").write_text(json.dumps({
        "command": "python -m benchmark peers " + " ".join(argv[1:]),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data_dir": str(root), "decode_s": decode_s, "versions": _versions(),
        "loadavg_before": load_before, "loadavg_after": load_after, "cores": os.cpu_count(),
        "arms": {name: {"status": r.status, "preprocess_s": r.preprocess_s, "epoch1": r.epoch1,
                        "warm": r.warm, "rate": {m: r.rate(m) for m in MODES},
                        "cpu_s_per_1k": {m: r.cpu_per_1k(m) for m in MODES}}
                 for name, r in results.items()},
        "checks": checks}, indent=1, default=str))
    say(f"wrote {', '.join(str(f) for f in files)}")
    return 0
