"""Batches straight to the device: ``python -m benchmark device``.

Loader only, every sample cached (a cache filled with random bytes, no JPEGs), for each sample
shape: samples per second and GB/s of

- ``dataloader_get_slot``: a ``DataLoader`` (``--workers`` fork workers) over a dataset whose
  ``__getitem__`` is ``get_slot``, the two-line pattern; with CUDA, ``pin_memory`` and the
  batch sent to the GPU;
- ``dataloader_get_batch``: the same with ``get_batch`` in ``__getitems__`` (the README's recipe);
- ``bare_get_batch``: a loop of ``get_batch(indices, out=buffer)`` in this process (with CUDA,
  a pinned buffer then ``.cuda(non_blocking=True)``): the training-process gather without any
  loader around it;
- ``device_loader``: :class:`stocaching.DeviceLoader` (on CUDA the GPU gathers from the
  registered segment; on a CPU ``get_batch`` in its background thread);
- with CUDA, ``pinned_copy``: one pinned host-to-device copy of a batch's bytes per batch, the
  bandwidth reference; and ``gather_kernel_only``: the GPU's gathers of random rows from the
  registered segment with nothing around them, the device path's own ceiling.

With CUDA, end to end: the benchmark's CNN, one step per batch with per-sample random crop and
flip done on the GPU (``affine_grid`` + ``grid_sample`` on the uint8 batch), fed by the
DeviceLoader, against the same model fed from one batch already on the GPU (the model's own
rate); and the same training with only ``--latency-fraction`` of ``--latency-samples`` samples
cached, the rest read with ``--latency-ms`` of EMULATED latency (a sleep before a read from
RAM) by the loader's prefetcher, against the same run without the latency. Each arm runs
``--repeats`` rounds; the median round is reported with its spread, the process's CPU time
per 1,000 samples and per batch, and the load average.

Target checks (measured, not asserted): without CUDA, the DeviceLoader >= 3 x the DataLoader
with ``get_batch`` and >= 0.9 x the bare loop; with CUDA, the device gather >= 10 x the
DataLoader for (3, 256, 256) and >= 0.8 x the pinned copy's GB/s, end to end >= 0.9 x the
model's own rate, and with half the dataset cached and 20 ms EMULATED reads >= 0.85 x the same
run without latency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from . import arguments as A

CPU_VS_DATALOADER = 3.0
CPU_VS_BARE = 0.9  # issue 43
CUDA_VS_DATALOADER = 10.0
CUDA_VS_COPY = 0.8
CUDA_END_TO_END = 0.9
CUDA_LATENCY = 0.85


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-samples", type=A.positive_int, default=6000,
                   help="samples in the cache (default: %(default)s)")
    p.add_argument("--batch-size", type=A.positive_int, default=None,
                   help="default: 256 with CUDA, 64 without")
    p.add_argument("--workers", type=A.positive_int, default=2,
                   help="DataLoader workers of the DataLoader arms (default: %(default)s)")
    p.add_argument("--repeats", type=A.positive_int, default=3,
                   help="rounds of every arm (default: %(default)s)")
    p.add_argument("--latency-ms", type=float, default=20.0,
                   help="with CUDA: EMULATED read latency of the misses in the end-to-end arm "
                        "with a part of the dataset cached (default: %(default)s)")
    p.add_argument("--latency-fraction", type=float, default=0.5,
                   help="the fraction cached in that arm (default: %(default)s)")
    p.add_argument("--latency-samples", type=A.positive_int, default=24000,
                   help="samples of (3, 256, 256) in that arm (default: %(default)s)")
    p.add_argument("--latency-loaders", type=A.positive_int, nargs=2, default=(8, 64),
                   metavar=("PROCESSES", "THREADS"),
                   help="loader processes and threads each for the misses in that arm "
                        "(default: 8 64)")
    p.add_argument("--shapes", default=None,
                   help="sample shapes, e.g. '3,128,128 3,32,32' (default: 3,256,256 and "
                        "4,32,32 with CUDA, 3,128,128 and 3,32,32 without)")


class _SlotDataset(Dataset):
    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return self.cache.dataset_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.cache.get_slot(i)


class _BatchDataset(_SlotDataset):
    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return self.cache.get_batch(indices)[0]


def _unbatched(batch: torch.Tensor) -> torch.Tensor:
    return batch  # __getitems__ returns the batch already collated


def _rounds(fn: Callable[[], int], repeats: int) -> dict[str, float]:
    """Run ``fn`` (one epoch; returns the samples it delivered) ``repeats`` times: the median
    round's samples/s, the spread, and CPU seconds of this process per 1,000 samples."""
    rates, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        n = fn()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        rates.append(n / dt)
        cpus.append(1e6 * dc / n)  # CPU ms per 1,000 samples
    return {"rate": statistics.median(rates), "lo": min(rates), "hi": max(rates),
            "cpu_ms_per_1k": statistics.median(cpus)}


def _arms(cache: Any, n: int, batch: int, workers: int, cuda: bool,
          repeats: int) -> dict[str, dict[str, float]]:
    from stocaching import DeviceLoader

    device = torch.device("cuda") if cuda else torch.device("cpu")
    order = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(0))
    out: dict[str, dict[str, float]] = {}

    def through(loader: DataLoader) -> Callable[[], int]:
        def epoch() -> int:
            got = 0
            for b in loader:
                if cuda:
                    b = b.to(device, non_blocking=True)
                got += len(b)
            if cuda:
                torch.cuda.synchronize()
            return got
        return epoch

    for name, ds, collate in (("dataloader_get_slot", _SlotDataset(cache), None),
                              ("dataloader_get_batch", _BatchDataset(cache), _unbatched)):
        loader = DataLoader(ds, batch_size=batch, sampler=order, num_workers=workers,
                            multiprocessing_context="fork", persistent_workers=True,
                            pin_memory=cuda, collate_fn=collate)
        through(loader)()  # workers started, pages touched
        out[name] = _rounds(through(loader), repeats)
        del loader

    buffer = cache.get_batch(list(range(batch)))[0]
    if cuda:
        buffer = buffer.pin_memory()

    def bare() -> int:
        idx = torch.randperm(n).numpy()
        got = 0
        for s in range(0, n, batch):
            part = idx[s:s + batch]
            b, _ = cache.get_batch(part, out=buffer[:len(part)])
            if cuda:
                b = b.to(device, non_blocking=True)
                torch.cuda.current_stream().synchronize()  # the buffer is reused next
            got += len(part)
        return got

    out["bare_get_batch"] = _rounds(bare, repeats)
    if cuda:
        def copy() -> int:
            for s in range(0, n, batch):
                buffer[:min(batch, n - s)].to(device, non_blocking=True)
            torch.cuda.synchronize()
            return n
        out["pinned_copy"] = _rounds(copy, repeats)

    loader = DeviceLoader(cache, order, lambda i: None, batch_size=batch, device=device)

    def device_epoch() -> int:
        got = 0
        for b, _ in loader:
            got += len(b)
        if cuda:
            torch.cuda.synchronize()
        return got

    device_epoch()
    out["device_loader"] = _rounds(device_epoch, repeats)
    out["device_loader"]["path"] = loader.path  # type: ignore[assignment]
    if loader.path == "cuda":
        words = loader._gather.words  # the registered segment, as the loader reads it

        def gather_only() -> int:
            idx = torch.randperm(n, device=device)
            for s in range(0, n, batch):
                words.index_select(0, idx[s:s + batch])
            torch.cuda.synchronize()
            return n
        gather_only()
        out["gather_kernel_only"] = _rounds(gather_only, repeats)
    loader.close()
    return out


def _augment(batch: torch.Tensor, size: int) -> torch.Tensor:
    """Per-sample random resized crop and flip on the device, then float and normalise."""
    k = len(batch)
    scale = torch.empty(k, device=batch.device).uniform_(0.6, 1.0)
    flip = torch.where(torch.rand(k, device=batch.device) < 0.5, -1.0, 1.0)
    shift = (1 - scale)[:, None] * torch.empty(k, 2, device=batch.device).uniform_(-1, 1)
    theta = torch.zeros(k, 2, 3, device=batch.device)
    theta[:, 0, 0], theta[:, 1, 1] = scale * flip, scale
    theta[:, :, 2] = shift
    grid = torch.nn.functional.affine_grid(theta, (k, batch.shape[1], size, size),
                                           align_corners=False)
    x = torch.nn.functional.grid_sample(batch.float(), grid, align_corners=False)
    return (x / 255 - 0.45) / 0.25


def _training(n: int, device: torch.device) -> tuple[Callable[..., None], torch.Tensor]:
    """The benchmark's CNN with Adam on ``device``: one training step ``step(x, y)``, and
    random labels for ``n`` samples there."""
    from .model import SmallCNN

    model = SmallCNN(num_classes=10).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    labels = torch.randint(0, 10, (n,), device=device)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step, labels


def _fed_by(loader: Any, step: Callable[..., None], labels: torch.Tensor,
            device: torch.device) -> Callable[[], int]:
    """One epoch of ``step`` on the loader's batches: returns the samples trained on."""
    def epoch() -> int:
        got = 0
        for x, idx in loader:
            step(x, labels[idx])
            got += len(idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return got
    return epoch


def _end_to_end(cache: Any, n: int, batch: int, repeats: int) -> dict[str, dict[str, float]]:
    from stocaching import DeviceLoader

    device = torch.device("cuda")
    side = cache.data_dims[-1]
    step, labels = _training(n, device)
    resident = cache.get_batch(list(range(batch)))[0].to(device)

    def model_only() -> int:
        for _ in range(n // batch):
            step(_augment(resident, side), labels[:batch])
        torch.cuda.synchronize()
        return n // batch * batch

    order = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(1))
    loader = DeviceLoader(cache, order, lambda i: None, batch_size=batch, device=device,
                          drop_last=True, transform=lambda b: _augment(b, side))
    fed = _fed_by(loader, step, labels, device)
    model_only()
    fed()
    out = {"model_only": _rounds(model_only, repeats), "device_loader_train": _rounds(fed, repeats)}
    loader.close()
    return out


def _with_latency(dims: tuple[int, ...], n: int, batch: int, repeats: int, latency_ms: float,
                  fraction: float, processes: int, threads: int,
                  device: torch.device = torch.device("cuda")) -> dict[str, dict[str, float]]:
    """End to end with ``fraction`` of the dataset cached and the rest read from EMULATED
    storage (a sleep of ``latency_ms`` before each read of a decoded row kept in RAM): the
    misses are loaded ahead by the DeviceLoader's prefetcher (``processes`` loader processes
    of ``threads`` threads) into staging slots. The same run with no latency is the reference."""
    from stocaching import DeviceLoader, SharedCache

    nbytes = int(np.prod(dims))
    storage = torch.empty((n, *dims), dtype=torch.uint8)
    storage.copy_((torch.arange(n) % 251).to(torch.uint8).view(n, *[1] * len(dims))
                  .expand(n, *dims))
    delay = torch.zeros(1, dtype=torch.float64).share_memory_()  # read by forked loaders too

    def load(i: int) -> torch.Tensor:
        if delay[0] > 0:
            time.sleep(float(delay[0]))
        return storage[i]

    slots, staging = int(fraction * n), 4096
    cache = SharedCache(((slots + staging) * nbytes + n + 0.5) / 2**30, n, dims,
                        staging_slots=staging)
    for i in range(n):
        cache.set_slot(i, storage[i])  # (ignored for an index without a slot)
    side = dims[-1]
    step, labels = _training(n, device)
    order = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(2))
    loader = DeviceLoader(cache, order, load, batch_size=batch, device=device, drop_last=True,
                          transform=lambda b: _augment(b, side), processes=processes,
                          threads=threads, multiprocessing_context="fork")
    fed = _fed_by(loader, step, labels, device)
    out = {}
    for name, ms in (("no_latency", 0.0), (f"latency_{latency_ms:g}ms", latency_ms)):
        delay[0] = ms / 1000
        fed()
        out[name] = _rounds(fed, repeats)
    out["stats"] = {"slots": len(cache), "staging_slots": staging,  # type: ignore[dict-item]
                    "dropped": loader.prefetcher.dropped}
    loader.close()
    cache.close()
    return out


def _check(name: str, got: float, want: float, detail: str) -> str:
    return f"[{'PASS' if got >= want else 'MISS'}] {name}: {got:.2f} x (target >= {want:g} x; {detail})"


def main(args: argparse.Namespace, argv: Sequence[str],
         say: Callable[[str], None] = print) -> int:
    from stocaching import SharedCache

    cuda = torch.cuda.is_available()
    batch = args.batch_size or (256 if cuda else 64)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split()] if args.shapes \
        else ([(3, 256, 256), (4, 32, 32)] if cuda else [(3, 128, 128), (3, 32, 32)])
    cores = os.cpu_count() or 1
    say(f"device benchmark: {'CUDA ' + torch.cuda.get_device_name() if cuda else 'no CUDA (CPU only)'}"
        f"; {cores} cores; {args.num_samples} samples; batch {batch}; {args.workers} workers; "
        f"{args.repeats} rounds an arm; load average before: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    checks = []
    for dims in shapes:
        nbytes = int(np.prod(dims))
        cache = SharedCache(args.num_samples * (nbytes + 1) / 2**30 + 1e-3, args.num_samples,
                            dims)
        rng = np.random.default_rng(0)
        for s in range(0, args.num_samples, 256):
            k = min(256, args.num_samples - s)
            for j, row in enumerate(rng.integers(0, 256, (k, *dims), dtype=np.uint8)):
                cache.set_slot(s + j, torch.from_numpy(row))
        arms = _arms(cache, args.num_samples, batch, args.workers, cuda, args.repeats)
        say(f"\n== samples {dims} uint8 ({nbytes / 1024:.1f} KiB), every one cached")
        say(f"{'arm':24} {'samples/s':>12} {'GB/s':>7} {'spread':>22} {'CPU ms/1k':>10} "
            f"{'us/batch':>9}  (CPU: this process's, not the DataLoader workers')")
        for name, r in arms.items():
            say(f"{name:24} {r['rate']:12,.0f} {r['rate'] * nbytes / 1e9:7.2f} "
                f"{r['lo']:10,.0f}-{r['hi']:<10,.0f} {r['cpu_ms_per_1k']:10.1f} "
                f"{r['cpu_ms_per_1k'] * batch:9.0f}"
                + (f"  (path {r['path']})" if "path" in r else ""))
        dev = arms["device_loader"]["rate"]
        if cuda:
            if dims == (3, 256, 256):
                checks.append(_check(f"{dims} device gather vs DataLoader + get_slot",
                                     dev / arms["dataloader_get_slot"]["rate"],
                                     CUDA_VS_DATALOADER, "samples/s"))
            checks.append(_check(f"{dims} device gather vs the pinned copy's GB/s",
                                 dev / arms["pinned_copy"]["rate"], CUDA_VS_COPY, "same bytes"))
            if dims[0] != 3:  # (the CNN takes images)
                cache.close()
                continue
            e2e = _end_to_end(cache, args.num_samples, batch, args.repeats)
            say(f"end to end (SmallCNN, GPU crop/flip/normalise): model only "
                f"{e2e['model_only']['rate']:,.0f} samples/s, fed by the DeviceLoader "
                f"{e2e['device_loader_train']['rate']:,.0f}")
            checks.append(_check(f"{dims} end to end vs the model's own rate",
                                 e2e["device_loader_train"]["rate"] / e2e["model_only"]["rate"],
                                 CUDA_END_TO_END, "samples/s"))
            lat = _with_latency(dims, args.latency_samples, batch, args.repeats,
                                args.latency_ms, args.latency_fraction, *args.latency_loaders)
            slow = f"latency_{args.latency_ms:g}ms"
            say(f"end to end, {args.latency_fraction:.0%} cached, the misses read with "
                f"{args.latency_ms:g} ms EMULATED latency by {args.latency_loaders[0]} x "
                f"{args.latency_loaders[1]} loaders ({args.latency_samples} samples, "
                f"{lat['stats']}): no latency {lat['no_latency']['rate']:,.0f} samples/s "
                f"({lat['no_latency']['lo']:,.0f}-{lat['no_latency']['hi']:,.0f}), with "
                f"latency {lat[slow]['rate']:,.0f} ({lat[slow]['lo']:,.0f}-"
                f"{lat[slow]['hi']:,.0f})")
            checks.append(_check(f"{dims} {args.latency_fraction:.0%} cached: "
                                 f"{args.latency_ms:g} ms reads vs none",
                                 lat[slow]["rate"] / lat["no_latency"]["rate"],
                                 CUDA_LATENCY, "samples/s, end to end"))
        else:
            checks.append(_check(f"{dims} DeviceLoader vs DataLoader + get_batch",
                                 dev / arms["dataloader_get_batch"]["rate"], CPU_VS_DATALOADER,
                                 "samples/s"))
            checks.append(_check(f"{dims} DeviceLoader vs a bare get_batch(out=) loop",
                                 dev / arms["bare_get_batch"]["rate"], CPU_VS_BARE, "samples/s"))
        cache.close()
    say("\nload average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    say("targets:")
    for line in checks:
        say(line)
    return 0
