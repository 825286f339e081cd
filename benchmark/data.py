"""The benchmark's data: a synthetic JPEG dataset on disk and the two-phase transform.

Phase one (:func:`decode`) reads a JPEG, decodes it with Pillow and resizes it to a uint8
``(3, D, D)`` tensor. That is the deterministic, expensive part and the only thing that goes
into the cache. Phase two (:class:`Augment`) runs after the cache on every read: random crop
with padding, random horizontal flip, conversion to float32 and normalisation, in plain torch.
Caching the output of phase two would freeze the augmentation and take 4x the memory.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

#: Bumped whenever the synthetic images change, so old dataset directories are not reused.
GENERATOR_VERSION = 1
MANIFEST = "manifest.json"

#: Per-channel mean and std used by :class:`Augment` (fixed, roughly those of the synthetic
#: images; the point is the cost of the arithmetic, not its exact values).
MEAN = (0.45, 0.45, 0.45)
STD = (0.25, 0.25, 0.25)


# ----------------------------------------------------------------------------------------------
# Dataset generation
# ----------------------------------------------------------------------------------------------


def default_data_dir(num_images: int, image_size: int, quality: int, seed: int,
                     num_classes: int) -> Path:
    """``$XDG_CACHE_HOME/stocaching-benchmark/<params>`` (``~/.cache/...`` by default)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = f"n{num_images}-s{image_size}-q{quality}-c{num_classes}-seed{seed}-v{GENERATOR_VERSION}"
    return base / "stocaching-benchmark" / name


def image_path(root: str | Path, index: int) -> str:
    return os.path.join(root, f"{index:07d}.jpg")


def label_of(index: int, num_classes: int) -> int:
    """The label of sample ``index``: ``index % num_classes``."""
    return index % num_classes


def synth_image(index: int, size: int, seed: int, num_classes: int) -> Image.Image:
    """A deterministic ``size`` x ``size`` RGB image for ``index``.

    Stripes whose orientation depends on the label (so the CNN has something to learn), a
    colour gradient, a few filled ellipses (sharp edges) and pixel noise (so the JPEG is about
    as large, and as slow to decode, as a photo of the same size).
    """
    rng = np.random.default_rng([seed, index])
    label = label_of(index, num_classes)
    c = np.linspace(0.0, 1.0, size, dtype=np.float32)
    theta = np.pi * label / num_classes + rng.normal(0.0, 0.05)
    freq = rng.uniform(3.0, 10.0)
    phase = rng.uniform(0.0, 2 * np.pi)
    u = (np.cos(theta) * c)[None, :] + (np.sin(theta) * c)[:, None]
    stripes = np.sin(u * (2 * np.pi * freq) + phase).astype(np.float32)
    fg, bg = rng.uniform(0, 200, (2, 3)).astype(np.float32)
    grad = c[:, None] * 0.6 + 0.2
    img = (stripes[..., None] * 0.5 + 0.5) * fg + grad[..., None] * bg * 0.5
    img = np.clip(img, 0, 225).astype(np.uint8)
    img += rng.integers(0, 30, img.shape, dtype=np.uint8)
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    for _ in range(int(rng.integers(3, 8))):
        x0, y0 = (int(v) for v in rng.integers(0, size, 2))
        w, h = (int(v) for v in rng.integers(max(1, size // 16), max(2, size // 3), 2))
        draw.ellipse([x0, y0, x0 + w, y0 + h], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return pil


def _write_one(job: tuple[str, int, int, int, int, int]) -> int:
    root, index, size, quality, seed, num_classes = job
    path = image_path(root, index)
    if os.path.exists(path):
        return index
    buf = io.BytesIO()
    synth_image(index, size, seed, num_classes).save(buf, format="JPEG", quality=quality)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
    return index


def dataset_params(num_images: int, image_size: int, quality: int, seed: int,
                   num_classes: int) -> dict[str, Any]:
    return {"num_images": num_images, "image_size": image_size, "jpeg_quality": quality,
            "seed": seed, "num_classes": num_classes, "generator_version": GENERATOR_VERSION}


class _Progress:
    """A tqdm bar on a terminal. Elsewhere (a log file, CI) a plain line on stderr at each
    quarter instead: tqdm's redraws would fill the log with one long line of ``\\r`` updates."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self.total, self.desc, self.done = total, desc, 0
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True,
                        disable=None)  # None: disabled when stderr is not a terminal

    def update(self) -> None:
        self.done += 1
        if not self.bar.disable:
            self.bar.update()
        elif 4 * self.done // self.total > 4 * (self.done - 1) // self.total:
            print(f"{self.desc}: {self.done}/{self.total} "
                  f"({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


def ensure_dataset(root: str | Path, num_images: int, image_size: int, *, quality: int = 90,
                   seed: int = 0, num_classes: int = 10, processes: int | None = None,
                   progress: bool = True) -> tuple[Path, float]:
    """Generate the JPEG dataset in ``root`` unless a complete one with the same parameters is
    there already (its ``manifest.json`` is written last, so an interrupted run resumes).

    Returns:
        ``(root, seconds spent generating)``; 0 seconds when the dataset was reused.

    Raises:
        ValueError: ``root`` holds a dataset generated with other parameters.
    """
    root = Path(root)
    params = dataset_params(num_images, image_size, quality, seed, num_classes)
    manifest = root / MANIFEST
    if manifest.exists():
        found = json.loads(manifest.read_text())
        if found == params:
            return root, 0.0
        raise ValueError(f"--data-dir {root} holds a dataset generated with {found}, but this run "
                         f"needs {params}; pass another --data-dir or delete that directory")
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(str(root), i, image_size, quality, seed, num_classes) for i in range(num_images)]
    processes = processes or min(8, os.cpu_count() or 1)
    bar = _Progress(num_images, f"generating {num_images} JPEGs in {root}") if progress else None
    if processes > 1 and num_images > 64:
        with mp.get_context("spawn").Pool(processes) as pool:
            for _ in pool.imap_unordered(_write_one, jobs, chunksize=32):
                if bar is not None:
                    bar.update()
    else:
        for job in jobs:
            _write_one(job)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    manifest.write_text(json.dumps(params, indent=1))
    return root, time.perf_counter() - t0


def warm_page_cache(root: str | Path, num_images: int) -> tuple[float, int]:
    """Read every file once so that no configuration pays for cold disk reads the others don't.
    Returns ``(seconds, bytes read)``."""
    t0 = time.perf_counter()
    total = 0
    for i in range(num_images):
        with open(image_path(root, i), "rb") as f:
            total += len(f.read())
    return time.perf_counter() - t0, total


# ----------------------------------------------------------------------------------------------
# The two phases of the transform
# ----------------------------------------------------------------------------------------------


def decode(data: bytes, size: int) -> torch.Tensor:
    """Phase one: JPEG bytes -> uint8 tensor ``(3, size, size)``, contiguous (decode + bilinear
    resize with Pillow). This is what the cache stores."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB").resize((size, size), Image.BILINEAR)
        arr = np.array(img, dtype=np.uint8)  # (H, W, 3), a writable copy
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class Augment:
    """Phase two: uint8 ``(3, H, W)`` -> normalised float32 ``(3, H, W)``.

    Zero-pad by ``pad`` pixels, take a random ``H`` x ``W`` crop, flip horizontally with
    probability 1/2, scale to [0, 1] and normalise with :data:`MEAN` / :data:`STD`. It never
    writes to its input, so it is safe on a read-only view of the cache. Randomness comes from
    torch's default generator, which the DataLoader seeds differently in every worker and epoch.

    Args:
        pad: padding before the random crop. Default: 4.
        flip: random horizontal flip. Default: True.
    """

    def __init__(self, pad: int = 4, flip: bool = True) -> None:
        self.pad = pad
        self.flip = flip
        self.mean = torch.tensor(MEAN, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(STD, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, h, w = x.shape
        if self.pad:
            p = self.pad
            x = F.pad(x, (p, p, p, p))
            i, j = (int(v) for v in torch.randint(0, 2 * p + 1, (2,)))
            x = x[:, i:i + h, j:j + w]
        if self.flip and bool(torch.rand(()) < 0.5):
            x = x.flip(-1)
        return x.float().div_(255.0).sub_(self.mean).div_(self.std)


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------


class JpegDataset(torch.utils.data.Dataset):
    """Reads, decodes and resizes one JPEG per sample, through the cache when there is one.

    ``__getitem__`` returns ``(image float32 (3, D, D), label int, hit bool)``; ``hit`` says the
    decoded sample came from the cache (the benchmark counts hits per rank with it). With
    ``cache=None`` this is the "no cache" baseline: the same code path, every read a miss.

    Args:
        root: dataset directory (see :func:`ensure_dataset`).
        num_images: number of samples.
        decoded_size: side ``D`` of the phase-one output.
        num_classes: for the labels.
        cache: a ``stocaching.SharedCache`` of ``(3, D, D)`` uint8 slots, or None.
        read_latency_ms: extra sleep before every read from disk (a cache miss), emulating
            network storage. Default: 0.
        copy: ``cache.get_slot(i, copy=copy)``; False returns a read-only view, which phase two
            never writes to. Default: True.
        augment: phase two. Default: ``Augment()``.
    """

    def __init__(self, root: str | Path, num_images: int, decoded_size: int, num_classes: int,
                 *, cache: Any = None, read_latency_ms: float = 0.0, copy: bool = True,
                 augment: Augment | None = None) -> None:
        self.root = str(root)
        self.num_images = num_images
        self.decoded_size = decoded_size
        self.num_classes = num_classes
        self.cache = cache
        self.read_latency_s = read_latency_ms / 1000.0
        self.copy = copy
        self.augment = augment if augment is not None else Augment()

    def __len__(self) -> int:
        return self.num_images

    def load(self, index: int) -> torch.Tensor:
        """Phase one from disk (plus the emulated read latency)."""
        if self.read_latency_s > 0:
            time.sleep(self.read_latency_s)
        with open(image_path(self.root, index), "rb") as f:
            data = f.read()
        return decode(data, self.decoded_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, bool]:
        x = None
        if self.cache is not None:
            x = self.cache.get_slot(index) if self.copy else self.cache.get_slot(index, copy=False)
        hit = x is not None
        if x is None:
            x = self.load(index)
            if self.cache is not None:
                self.cache.set_slot(index, x)  # a no-op when index has no slot
        return self.augment(x), label_of(index, self.num_classes), hit


class DecodeOnly(torch.utils.data.Dataset):
    """Phase one only, returning ``(index, uint8 (3, D, D))``: used to build the in-RAM bound."""

    def __init__(self, root: str | Path, indices: list[int] | range, decoded_size: int) -> None:
        self.root = str(root)
        self.indices = indices
        self.decoded_size = decoded_size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> tuple[int, torch.Tensor]:
        i = self.indices[k]
        with open(image_path(self.root, i), "rb") as f:
            return i, decode(f.read(), self.decoded_size)


class InRamDataset(torch.utils.data.Dataset):
    """The upper bound: every decoded sample in one in-RAM uint8 tensor ``(N, 3, D, D)`` (moved
    to shared memory, so DataLoader workers of any start method read the same pages), then the
    same phase two. Returns ``(image, label, True)``."""

    def __init__(self, data: torch.Tensor, num_classes: int,
                 augment: Augment | None = None) -> None:
        self.data = data
        self.num_classes = num_classes
        self.augment = augment if augment is not None else Augment()

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, bool]:
        return self.augment(self.data[index]), label_of(index, self.num_classes), True


def build_in_ram(root: str | Path, num_images: int, decoded_size: int, *, workers: int,
                 start_method: str | None, indices: list[int] | range | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``indices`` (default: all) into ``out`` (allocated when None, zero-filled) with a
    DataLoader of ``workers`` workers. Returns ``out``."""
    if out is None:
        out = torch.zeros((num_images, 3, decoded_size, decoded_size), dtype=torch.uint8)
    indices = range(num_images) if indices is None else indices
    ds = DecodeOnly(root, indices, decoded_size)
    kw: dict[str, Any] = {}
    if workers > 0 and start_method:
        kw["multiprocessing_context"] = start_method
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=workers, **kw)
    for idx, xs in loader:
        out[idx] = xs
    return out
