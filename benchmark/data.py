"""The benchmark's data: a synthetic JPEG dataset on disk and the two-phase transform.

Phase one (:func:`decode`) reads a JPEG, decodes it with Pillow and resizes it to a uint8
``(3, D, D)`` tensor. That is the deterministic, expensive part and the only thing that goes
into the cache. Phase two (:class:`Augment`) runs after the cache on every read: random crop
with padding, random horizontal flip, conversion to float32 and normalisation, in plain torch.
Caching the output of phase two would freeze the augmentation and take 4x the memory.

With varied sizes (``sides=(lo, hi)``: each image's width and height drawn from ``lo..hi``,
:func:`varied_shape`), phase one decodes at the native size, with no resize, into a cache of
``data_dims=(3, None, None)``, and phase two crops every read to the model's input
(``Augment(size=D)``); the in-RAM bound is then :class:`PackedImages`.
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

from .two_lines import TwoLineDataset

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
                     num_classes: int, sides: tuple[int, int] | None = None) -> Path:
    """``$XDG_CACHE_HOME/stocaching-benchmark/<params>`` (``~/.cache/...`` by default)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    size = f"s{image_size}" if sides is None else f"sides{sides[0]}to{sides[1]}"
    name = f"n{num_images}-{size}-q{quality}-c{num_classes}-seed{seed}-v{GENERATOR_VERSION}"
    return base / "stocaching-benchmark" / name


def varied_shape(index: int, seed: int, sides: tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of image ``index`` of a varied-size dataset: each drawn uniformly from
    ``sides[0]..sides[1]`` (both included), a pure function of ``(seed, index)``."""
    h, w = np.random.default_rng([seed, index, 1]).integers(sides[0], sides[1] + 1, 2)
    return int(h), int(w)


def image_path(root: str | Path, index: int) -> str:
    return os.path.join(root, f"{index:07d}.jpg")


def label_of(index: int, num_classes: int) -> int:
    """The label of sample ``index``: ``index % num_classes``."""
    return index % num_classes


def synth_image(index: int, size: int | tuple[int, int], seed: int,
                num_classes: int) -> Image.Image:
    """A deterministic RGB image for ``index``, ``size`` x ``size`` or ``size = (height,
    width)``.

    Stripes whose orientation depends on the label (so the CNN has something to learn), a
    colour gradient, a few filled ellipses (sharp edges) and pixel noise (so the JPEG is about
    as large, and as slow to decode, as a photo of the same size).
    """
    rng = np.random.default_rng([seed, index])
    label = label_of(index, num_classes)
    rows, cols = (size, size) if isinstance(size, int) else size
    cy = np.linspace(0.0, 1.0, rows, dtype=np.float32)
    cx = np.linspace(0.0, 1.0, cols, dtype=np.float32)
    theta = np.pi * label / num_classes + rng.normal(0.0, 0.05)
    freq = rng.uniform(3.0, 10.0)
    phase = rng.uniform(0.0, 2 * np.pi)
    u = (np.cos(theta) * cx)[None, :] + (np.sin(theta) * cy)[:, None]
    stripes = np.sin(u * (2 * np.pi * freq) + phase).astype(np.float32)
    fg, bg = rng.uniform(0, 200, (2, 3)).astype(np.float32)
    grad = cy[:, None] * 0.6 + 0.2
    img = (stripes[..., None] * 0.5 + 0.5) * fg + grad[..., None] * bg * 0.5
    img = np.clip(img, 0, 225).astype(np.uint8)
    img += rng.integers(0, 30, img.shape, dtype=np.uint8)
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    short = min(rows, cols)
    for _ in range(int(rng.integers(3, 8))):
        if rows == cols:  # the draws of the square datasets generated before varied sizes
            x0, y0 = (int(v) for v in rng.integers(0, short, 2))
        else:
            x0, y0 = (int(v) for v in rng.integers(0, (cols, rows)))
        w, h = (int(v) for v in rng.integers(max(1, short // 16), max(2, short // 3), 2))
        draw.ellipse([x0, y0, x0 + w, y0 + h], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return pil


def _write_one(job: tuple[str, int, int | tuple[int, int], int, int, int]) -> int:
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
                   num_classes: int, sides: tuple[int, int] | None = None) -> dict[str, Any]:
    """What a dataset directory's manifest records (``sides`` only for varied sizes, so the
    manifests of square datasets stay as they were)."""
    out: dict[str, Any] = {"num_images": num_images, "image_size": image_size,
                           "jpeg_quality": quality, "seed": seed, "num_classes": num_classes,
                           "generator_version": GENERATOR_VERSION}
    if sides is not None:
        out.update(image_size=None, sides=list(sides))
    return out


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
                   progress: bool = True,
                   sides: tuple[int, int] | None = None) -> tuple[Path, float]:
    """Generate the JPEG dataset in ``root`` unless a complete one with the same parameters is
    there already (its ``manifest.json`` is written last, so an interrupted run resumes).
    Images are ``image_size`` x ``image_size``, or with ``sides=(lo, hi)`` of varied sizes
    (:func:`varied_shape`; ``image_size`` is then unused).

    Returns:
        ``(root, seconds spent generating)``; 0 seconds when the dataset was reused.

    Raises:
        ValueError: ``root`` holds a dataset generated with other parameters.
    """
    root = Path(root)
    params = dataset_params(num_images, image_size, quality, seed, num_classes, sides)
    manifest = root / MANIFEST
    if manifest.exists():
        found = json.loads(manifest.read_text())
        if found == params:
            return root, 0.0
        raise ValueError(f"--data-dir {root} holds a dataset generated with {found}, but this run "
                         f"needs {params}; pass another --data-dir or delete that directory")
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(str(root), i, image_size if sides is None else varied_shape(i, seed, sides),
             quality, seed, num_classes) for i in range(num_images)]
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


def decode(data: bytes, size: int | None) -> torch.Tensor:
    """Phase one: JPEG bytes -> uint8 tensor ``(3, size, size)``, contiguous (decode + bilinear
    resize with Pillow), or ``(3, H, W)`` at the native size when ``size`` is None. This is
    what the cache stores."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB")
        if size is not None:
            img = img.resize((size, size), Image.BILINEAR)
        arr = np.array(img, dtype=np.uint8)  # (H, W, 3), a writable copy
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class Augment:
    """Phase two: uint8 ``(3, H, W)`` -> normalised float32 ``(3, H, W)``, or ``(3, size,
    size)`` when ``size`` is given.

    Zero-pad by ``pad`` pixels, take a random ``H`` x ``W`` (or ``size`` x ``size``) crop, flip
    horizontally with probability 1/2, scale to [0, 1] and normalise with :data:`MEAN` /
    :data:`STD`. It never writes to its input, so it is safe on a read-only view of the cache.
    Randomness comes from torch's default generator, which the DataLoader seeds differently in
    every worker and epoch.

    Args:
        pad: padding before the random crop. Default: 4.
        flip: random horizontal flip. Default: True.
        size: side of the crop, for inputs of varied sizes (each side at least ``size - 2 *
            pad``); None keeps the input's size. Default: None.
    """

    def __init__(self, pad: int = 4, flip: bool = True, size: int | None = None) -> None:
        self.pad = pad
        self.flip = flip
        self.size = size
        self.mean = torch.tensor(MEAN, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(STD, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, h, w = x.shape
        p = self.pad
        if self.size is not None:
            c = self.size
            if h + 2 * p < c or w + 2 * p < c:
                raise ValueError(f"Augment(size={c}, pad={p}) needs inputs of at least "
                                 f"{c - 2 * p}x{c - 2 * p}, but got {h}x{w}")
            # The window (i, j) of the padded image, cut from the image first and padded where
            # it leaves it: the same pixels as padding the whole image, without copying it.
            i = int(torch.randint(0, h + 2 * p - c + 1, ())) - p
            j = int(torch.randint(0, w + 2 * p - c + 1, ())) - p
            x = x[:, max(0, i):min(h, i + c), max(0, j):min(w, j + c)]
            edges = (max(0, -j), max(0, j + c - w), max(0, -i), max(0, i + c - h))
            if any(edges):
                x = F.pad(x, edges)
        elif p:
            x = F.pad(x, (p, p, p, p))
            i, j = (int(v) for v in torch.randint(0, 2 * p + 1, (2,)))
            x = x[:, i:i + h, j:j + w]
        if self.flip and bool(torch.rand(()) < 0.5):
            x = x.flip(-1)
        return x.float().div_(255.0).sub_(self.mean).div_(self.std)


class BatchAugment:
    """Phase two of a whole uint8 batch ``(B, 3, H, W)`` where it is (the batch loader's
    ``transform``): for each sample, what :class:`Augment` does with a fixed size (zero-pad by
    ``pad``, a random ``H`` x ``W`` crop, a horizontal flip with probability 1/2), then float,
    [0, 1] and :data:`MEAN` / :data:`STD`.

    On a CPU each sample's window of the padded batch is copied on its own into the float
    batch (by numpy), then the batch is normalised in place: 1.6 ms for 64 x (3, 128, 128) on
    this project's 2-core machine, where one gather of a ``(B, H, W)`` index over the batch
    took 5 to 16 ms. On a GPU that one gather is one kernel instead of 2 B, and is kept there."""

    def __init__(self, pad: int = 4, flip: bool = True) -> None:
        self.pad, self.flip = pad, flip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._windows(x) if x.device.type == "cpu" else self._gathered(x)
        # (x / 255 - mean) / std as a multiply then an add in place: two passes over the float
        # batch instead of three (it differs from Augment's by float rounding only).
        std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
        shift = -torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1) / std
        return out.mul_(1.0 / (255.0 * std)).add_(shift)

    def _draws(self, b: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Each sample's crop (top, left, in the padded sample) and flip."""
        top = torch.randint(0, 2 * self.pad + 1, (b,), device=device)
        left = torch.randint(0, 2 * self.pad + 1, (b,), device=device)
        flip = torch.rand(b, device=device) < 0.5 if self.flip else \
            torch.zeros(b, dtype=torch.bool, device=device)
        return top, left, flip

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        # The copies in numpy: a torch copy of a sample is big enough for torch to split it
        # over its threads, and with every core busy the 2 B parallel regions of a batch each
        # waited for a thread (7-108 ms a batch with 2 threads on a busy 2-core machine,
        # against 1 ms here, whatever the threads and the load).
        b, c, h, w = x.shape
        p = self.pad
        padded = (F.pad(x, (p, p, p, p)) if p else x).contiguous().numpy()
        top, left, flip = (t.tolist() for t in self._draws(b, x.device))
        out = torch.empty((b, c, h, w), dtype=torch.float32)
        into = out.numpy()
        for k in range(b):
            window = padded[k, :, top[k]:top[k] + h, left[k]:left[k] + w]
            into[k] = window[..., ::-1] if flip[k] else window  # (cast to float32 as copied)
        return out

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p, dev = self.pad, x.device
        padded = F.pad(x, (p, p, p, p))
        top, left, flip = self._draws(b, dev)
        rows = top[:, None] + torch.arange(h, device=dev)  # (B, H)
        cols = torch.arange(w, device=dev).expand(b, w)
        cols = torch.where(flip[:, None], cols.flip(-1), cols)
        cols = left[:, None] + cols  # (B, W)
        out = padded[torch.arange(b, device=dev)[:, None, None], :, rows[:, :, None],
                     cols[:, None, :]]  # (B, H, W, C)
        return out.permute(0, 3, 1, 2).float()


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------


class JpegDataset(TwoLineDataset):
    """Reads, decodes and resizes one JPEG per sample, through the cache when there is one
    (:class:`benchmark.two_lines.TwoLineDataset`: the README's two lines).

    ``__getitem__`` returns ``(image float32 (3, D, D), label int, hit bool)``; ``hit`` says the
    decoded sample came from the cache (the benchmark counts hits per rank with it). With
    ``cache=None`` this is the "no cache" baseline: the same code path, every read a miss.

    Args:
        root: dataset directory (see :func:`ensure_dataset`).
        num_images: number of samples.
        decoded_size: side ``D`` of the phase-one output; None decodes at the native size
            (varied sizes: pass ``augment=Augment(size=...)`` so that batches stack).
        num_classes: for the labels.
        cache: a ``stocaching.SharedCache`` of ``(3, D, D)`` uint8 slots (an
            ``OpenSizeCache`` of ``(3, None, None)`` when ``decoded_size`` is None), or None.
        read_latency_ms: extra sleep before every read from disk (a cache miss), emulating
            network storage. Default: 0.
        copy: ``cache.get_slot(i, copy=copy)``; False returns a read-only view, which phase two
            never writes to. Default: True.
        augment: phase two. Default: ``Augment()``.
    """

    def __init__(self, root: str | Path, num_images: int, decoded_size: int | None,
                 num_classes: int, *, cache: Any = None, read_latency_ms: float = 0.0, copy: bool = True,
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

    def item(self, index: int, x: torch.Tensor, hit: bool) -> tuple[torch.Tensor, int, bool]:
        return self.augment(x), label_of(index, self.num_classes), hit


class DecodeOnly(torch.utils.data.Dataset):
    """Phase one only, returning ``(index, uint8 (3, D, D))`` (the native size when
    ``decoded_size`` is None): used to build the in-RAM bound."""

    def __init__(self, root: str | Path, indices: list[int] | range,
                 decoded_size: int | None) -> None:
        self.root = str(root)
        self.indices = indices
        self.decoded_size = decoded_size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> tuple[int, torch.Tensor]:
        i = self.indices[k]
        with open(image_path(self.root, i), "rb") as f:
            return i, decode(f.read(), self.decoded_size)


class PackedImages:
    """Images of varied sizes in one flat uint8 tensor: image ``i`` is ``(3, H_i, W_i)`` at
    ``offsets[i]``. ``images[i]`` is a view; ``len(images)`` the number of images. Only the flat
    tensor is large: :meth:`share_memory_` it and workers of any start method read the same
    pages.

    Args:
        shapes: ``(H_i, W_i)`` of every image.
    """

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        sizes = torch.tensor([3 * h * w for h, w in shapes], dtype=torch.int64)
        self.shapes = torch.tensor(shapes, dtype=torch.int64).reshape(-1, 2)
        self.offsets = torch.cumsum(sizes, 0) - sizes
        self.flat = torch.zeros(int(sizes.sum()), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.shapes.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        h, w = (int(v) for v in self.shapes[index])
        o = int(self.offsets[index])
        return self.flat[o:o + 3 * h * w].view(3, h, w)

    def share_memory_(self) -> "PackedImages":
        self.flat.share_memory_()
        return self


class InRamDataset(torch.utils.data.Dataset):
    """The upper bound: every decoded sample in one in-RAM uint8 tensor ``(N, 3, D, D)``, or a
    :class:`PackedImages` for varied sizes (moved to shared memory, so DataLoader workers of
    any start method read the same pages), then the same phase two. Returns ``(image, label,
    True)``."""

    def __init__(self, data: torch.Tensor | PackedImages, num_classes: int,
                 augment: Augment | None = None) -> None:
        self.data = data
        self.num_classes = num_classes
        self.augment = augment if augment is not None else Augment()

    def __len__(self) -> int:
        return len(self.data)

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


def build_in_ram_packed(root: str | Path, out: PackedImages, *, workers: int,
                        start_method: str | None,
                        indices: list[int] | range | None = None) -> PackedImages:
    """Decode ``indices`` (default: all) of a varied-size dataset at their native sizes into
    ``out``, with a DataLoader of ``workers`` workers. Returns ``out``.

    Raises:
        ValueError: a file's decoded shape is not the one ``out`` was laid out for.
    """
    indices = range(len(out)) if indices is None else indices
    kw: dict[str, Any] = {}
    if workers > 0 and start_method:
        kw["multiprocessing_context"] = start_method
    loader = torch.utils.data.DataLoader(DecodeOnly(root, indices, None), batch_size=None,
                                         num_workers=workers, **kw)
    for i, x in loader:
        dst = out[int(i)]
        if dst.shape != x.shape:
            raise ValueError(f"image {int(i)} in {root} decodes to {tuple(x.shape)}, but the "
                             f"in-RAM layout expects {tuple(dst.shape)}")
        dst.copy_(x)
    return out
