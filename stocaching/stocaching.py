"""stocaching: cache a fixed fraction of a dataset's decoded samples in shared memory.

One file, importable as ``stocaching``: copy it into your project, or ``pip install`` the
package. It needs only the standard library, torch, numpy and psutil.

Example::

    import torch
    from stocaching import SharedCache

    class MyDataset(torch.utils.data.Dataset):
        def __init__(self, paths):
            self.paths = paths
            self.cache = SharedCache(size_limit_gib=8, dataset_len=len(paths), data_dims=(3, 256, 256))

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            x = self.cache.get_slot(i)         # a copy of the cached sample, or None
            if x is None:
                x = decode_and_resize(self.paths[i])   # uint8 (3, 256, 256)
                self.cache.set_slot(i, x)      # no-op when sample i has no slot
            return augment(x)                  # random transforms come *after* the cache

The segment lives in /dev/shm and is shared by every DataLoader worker (fork, spawn or
forkserver) and every local rank of a ``torchrun`` job: the local leader creates it, the other
local ranks attach to it. Its name is removed from /dev/shm as soon as every local rank has
attached, so the kernel frees the memory when the last process using it exits, however it
exits. Run ``python -m stocaching`` to see /dev/shm, RAM and the live caches.

Contents (``grep -n "^# [0-9]*[.] " stocaching.py`` lists the sections with their lines):

 1. Constants                            7. Segment files: names, listing
 2. Argument checks                      8. Processes: liveness, locks
 3. Who am I: World                      9. The seam: features in modules beside this one
 4. Which indices each node caches      10. The segment, as a process holds it
 5. Exceptions                          11. The cache contract: BaseCache
 6. The segment's layout and sizing     12. Fixed-size rows: SharedCache (the hit path)

Each advanced feature is a module beside this one, loaded when its keyword is used (section 9).
"""

from __future__ import annotations

__all__ = [
    "BYTES_PER_GIB",
    "BaseCache",
    "BatchRows",
    "C_DTYPES",
    "CacheCapacityError",
    "CacheConfigError",
    "CacheFileError",
    "CacheLayout",
    "CacheTimeoutError",
    "MAX_STAGE_TAG",
    "SharedCache",
    "SlotState",
    "World",
    "check_int",
    "clean_segments",
    "get_shm_size",
]

__version__ = "0.3.0"

import contextlib
import ctypes
import dataclasses
import enum
import errno
import fcntl
import hashlib
import importlib
import importlib.util
import itertools
import logging
import math
import mmap
import multiprocessing
import os
import secrets
import socket
import stat
import struct
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import psutil
import torch


# ----------------------------------------------------------------------------------------------
# 1. Constants
# ----------------------------------------------------------------------------------------------


BYTES_PER_GIB = 1024**3
BYTES_PER_MIB = 1024**2

#: Values of ``SharedCache.aux_array``. 0, 1 and 2 are those of stocaching 0.2.1.
EMPTY, SET, OOB, WRITING = 0, 1, 2, 3


class SlotState(enum.Enum):
    """The states of ``SharedCache.aux_array`` as an enum, as stocaching 0.2.1 names them
    (``SlotState(int(cache.aux_array[i]))``); WRITING is new: a write is in progress."""

    EMPTY = EMPTY
    SET = SET
    OOB = OOB  # no slot on this node: outside the cache, inside the dataset
    WRITING = WRITING


SEGMENT_PREFIX = "stocaching"
DEFAULT_SHM_DIR = "/dev/shm"
_MAX_DIMS = 8
MAX_FIELDS = 16  # fields of one sample (a dict data_dims)
FIELD_NAME_BYTES = 32

#: Free memory that a new cache should leave, below which we warn, and which
#: ``size_limit_gib="auto"`` keeps free: the larger of RAM_MARGIN_FRACTION of the memory and
#: RAM_MARGIN_BYTES, the latter at most a quarter of it. The memory is the RAM (available, per
#: psutil), or a memory cgroup's limit where it is lower; under a limit the margin is at least
#: half of what is free, and the memory of the DataLoader workers to come
#: (``_MemoryRoom.margin``).
RAM_MARGIN_BYTES = 2 * BYTES_PER_GIB
RAM_MARGIN_FRACTION = 0.05
#: What ``size_limit_gib="auto"`` leaves free in /dev/shm for its other users (DataLoader
#: workers' batches and semaphores, NCCL's buffers, another cache): the larger of these two
#: (see docs/sizing.md, "Containers and clusters").
SHM_HEADROOM_BYTES = 32 * BYTES_PER_MIB
SHM_HEADROOM_FRACTION = 1 / 16
#: DataLoader workers per local rank that ``size_limit_gib="auto"`` leaves memory for under a
#: memory limit (``_MemoryRoom.margin``); more workers need a smaller, explicit budget.
AUTO_WORKERS_PER_RANK = 2
# Filesystems whose files live in memory; a cache elsewhere gets a warning.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})

# torch dtype -> (code stored in the segment header, numpy dtype of the same size and layout).
# bfloat16 has no numpy twin: it is stored as uint16 and viewed back as bfloat16.
DTYPE_CODES: dict[torch.dtype, tuple[int, Any]] = {
    torch.bool: (1, np.bool_),
    torch.uint8: (2, np.uint8),
    torch.int8: (3, np.int8),
    torch.int16: (4, np.int16),
    torch.int32: (5, np.int32),
    torch.int64: (6, np.int64),
    torch.float16: (7, np.float16),
    torch.bfloat16: (8, np.uint16),
    torch.float32: (9, np.float32),
    torch.float64: (10, np.float64),
    torch.uint16: (11, np.uint16),
    torch.uint32: (12, np.uint32),
    torch.uint64: (13, np.uint64),
    torch.complex64: (14, np.complex64),
    torch.complex128: (15, np.complex128),
}
_DTYPE_BY_CODE = {code: dt for dt, (code, _) in DTYPE_CODES.items()}

#: torch dtype -> ctypes type, as stocaching 0.2.1 exports it (its supported dtypes, plus the
#: unsigned ones). The cache stores every dtype of the table above, float16, bfloat16 and the
#: complex ones included, which ctypes has no type for.
C_DTYPES: dict[torch.dtype, Any] = {
    torch.bool: ctypes.c_bool, torch.uint8: ctypes.c_uint8, torch.int8: ctypes.c_int8,
    torch.int16: ctypes.c_int16, torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64,
    torch.float32: ctypes.c_float, torch.float64: ctypes.c_double,
    torch.uint16: ctypes.c_uint16, torch.uint32: ctypes.c_uint32, torch.uint64: ctypes.c_uint64,
}

# Casts that set_slot accepts without looking at the values, because every value of the source
# dtype is exactly representable in the cache's dtype. Others: see SharedCache._check_value.
_LOSSLESS: dict[torch.dtype, frozenset[torch.dtype]] = {
    torch.bool: frozenset(DTYPE_CODES),
    torch.uint8: frozenset({torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                            torch.uint64, torch.float16, torch.bfloat16, torch.float32,
                            torch.float64, torch.complex64, torch.complex128}),
    torch.int8: frozenset({torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                           torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.int16: frozenset({torch.int32, torch.int64, torch.float32, torch.float64,
                            torch.complex64, torch.complex128}),
    torch.uint16: frozenset({torch.int32, torch.int64, torch.uint32, torch.uint64, torch.float32,
                             torch.float64, torch.complex64, torch.complex128}),
    torch.int32: frozenset({torch.int64, torch.float64, torch.complex128}),
    torch.uint32: frozenset({torch.int64, torch.uint64, torch.float64, torch.complex128}),
    torch.float16: frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.bfloat16: frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.float32: frozenset({torch.float64, torch.complex64, torch.complex128}),
    torch.float64: frozenset({torch.complex128}),
    torch.complex64: frozenset({torch.complex128}),
}

logger = logging.getLogger("stocaching")


# ----------------------------------------------------------------------------------------------
# 2. Argument checks
# ----------------------------------------------------------------------------------------------


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def is_int(x: Any) -> bool:
    """True for Python, numpy and 0-dim integer torch scalars; False for bool."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and is_integer_dtype(x.dtype)
    return False


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None,
              expect: str | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``name``, the expectation and the value.

    The argument check of the package, public so that the opt-in modules (and code that
    extends them) raise the same errors.

    Args:
        name: the parameter's name, for the message.
        value: what was passed; an int, or a numpy or torch integer scalar (not a bool).
        low: the smallest value allowed, or None. Default: None.
        high: the largest value allowed, or None. Default: None.
        expect: the expectation in words, instead of the one made from low and high.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value`` is outside ``[low, high]``.
    """
    if low is not None and high is not None:
        what = expect or f"an int in [{low}, {high}]"
    elif low is not None:
        what = expect or (f"an int >= {low}" if low != 1 else "a positive int")
    else:
        what = expect or "an int"
    if not is_int(value):
        raise TypeError(f"{name} should be {what}, but got {name}={value!r} "
                        f"(type {type(value).__name__})")
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(f"{name} should be {what}, but got {name}={v}")
    return v


def check_positive(name: str, value: Any, unit: str) -> float:
    """Return a positive finite int or float, or raise naming ``name`` and the value."""
    expect = f"{name} should be a positive finite number of {unit}, but got {name}={value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(expect)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(expect)
    return value


def check_dims(data_dims: Any, name: str = "data_dims", *, scalar: bool = False
                ) -> tuple[Any, ...]:
    """``data_dims`` (or a field's dims, ``name``) as a tuple of ints, None for a size left
    open; ``()`` only if ``scalar``."""
    expect = ("a tuple of positive ints or None (() for a scalar)" if scalar else
              "a non-empty tuple of positive ints or None (an open size)")
    if isinstance(data_dims, torch.Size):
        data_dims = tuple(data_dims)
    if not isinstance(data_dims, (tuple, list)) or (len(data_dims) == 0 and not scalar):
        if name == "data_dims" and not isinstance(data_dims, (tuple, list)):
            expect += ", or a dict of fields {name: dims}"
        raise (TypeError if not isinstance(data_dims, (tuple, list)) else ValueError)(
            f"{name} should be {expect}, but got {name}={data_dims!r}")
    if not all(is_int(d) or d is None for d in data_dims):
        raise TypeError(f"{name} should be {expect}, but got {name}={tuple(data_dims)!r}")
    dims = tuple(None if d is None else int(d) for d in data_dims)
    if any(d is not None and d <= 0 for d in dims) or len(dims) > _MAX_DIMS:
        raise ValueError(f"{name} should be {expect} (at most {_MAX_DIMS} of them), "
                         f"but got {name}={dims!r}")
    return dims


def check_dtype(dtype: Any, name: str = "dtype") -> torch.dtype:
    if isinstance(dtype, Mapping):
        raise TypeError(f"{name} should be a torch dtype; a dict of dtypes, one a field, "
                        f"comes with a dict data_dims of those fields, but got {name}={dtype!r}")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise (ValueError if isinstance(dtype, torch.dtype) else TypeError)(
            f"{name} should be one of the fixed-size torch dtypes ({names}), "
            f"but got {name}={dtype!r}")
    return dtype


class Field(NamedTuple):
    """One field of a sample: where it sits in a slot (``offset``, ``nbytes``)."""

    name: str
    dims: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def pack_fields(dims: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype]
          ) -> tuple[tuple[Field, ...], int]:
    """Fields of these sizes packed in their order, each at a multiple of its itemsize (as a
    C struct), and the bytes of the whole (a multiple of the largest itemsize). A field with
    an open size (None) gets offset and nbytes 0: a cache of open sizes packs each sample as it
    comes (``OpenSizeCache``)."""
    if any(None in d for d in dims.values()):
        return tuple(Field(n, d, dtypes[n], 0, 0) for n, d in dims.items()), 0
    fields, end, align = [], 0, 1
    for n, d in dims.items():
        size = dtypes[n].itemsize
        offset = -(-end // size) * size
        fields.append(Field(n, d, dtypes[n], offset, math.prod(d) * size))
        end, align = offset + fields[-1].nbytes, max(align, size)
    return tuple(fields), -(-end // align) * align


def torch_of(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A numpy array of the cache's storage as a tensor of ``dtype`` (bfloat16 is stored as
    uint16)."""
    t = torch.from_numpy(arr)
    return t.view(dtype) if dtype is torch.bfloat16 else t


def _check_name(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{param} should be a str of 1 to 64 letters, digits, '-' and '.', "
                        f"but got {param}={value!r} (type {type(value).__name__})")
    if not value or len(value) > 64 or \
            not all(c.isalnum() or c in "-." for c in value):
        raise ValueError(f"{param} should be 1 to 64 characters of letters, digits, '-' and "
                         f"'.', but got {param}={value!r}")
    return value


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", BYTES_PER_GIB), ("MiB", BYTES_PER_MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# The files of stocaching: this one, its feature modules and the opt-in modules beside it
# (copied or installed).
_OWN_FILES = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
                       for name in ("stocaching", "batches", "cli", "disk_tier", "fields",
                                    "open_size", "persistent", "saved", "staging", "samplers",
                                    "order", "prefetch", "mixtures", "device", "wrapper",
                                    "streams", "_common"))

def _stacklevel_of_caller() -> int:
    """The ``stacklevel`` of ``warnings.warn``, called by the caller of this function, that
    names the user's line: the first frame outside stocaching's files (the construction
    reaches a warning through a different number of frames on each path)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _OWN_FILES:
        frame, level = frame.f_back, level + 1
    return level



def checked_value(value: Any, dims: tuple[int, ...], dst: torch.dtype, what: str,
                  where: str) -> torch.Tensor:
    """``value`` (called ``what`` in messages) checked against ``dims`` (``where``) and
    ``dst``, as a tensor; raise if it cannot be stored.

    Accepted: a tensor or array of shape data_dims whose dtype is the cache's, casts to it
    without loss (uint8 into float32), is a float or complex rounded into a narrower one
    (as torch does), or has values that the cache's dtype holds exactly (int64 0..255 into
    uint8). Tensors on other devices are accepted (and copied when stored)."""
    if isinstance(value, np.ndarray):
        if value.dtype == np.uint16 and dst is torch.bfloat16:
            raise TypeError(f"{what} should be a torch.bfloat16 tensor or float values, but "
                            "got a numpy uint16 array, which would be taken as numbers, not "
                            "as bfloat16 bits (numpy has no bfloat16; pass "
                            "torch.from_numpy(a).view(torch.bfloat16) for bits)")
        try:  # negative strides (img[:, :, ::-1]) and foreign byte order need a copy
            if any(st < 0 for st in value.strides) or not value.dtype.isnative:
                value = np.ascontiguousarray(value, value.dtype.newbyteorder("="))
            value = torch.from_numpy(value)
        except TypeError:
            raise TypeError(f"{what} should be a tensor of dtype {dst}, but got a "
                            f"numpy array of dtype {value.dtype}") from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} should be a torch.Tensor of shape {dims} and dtype "
                        f"{dst}, but got {what} of type {type(value).__name__}")
    if tuple(value.shape) != dims:
        extra = value.ndim - len(dims)
        if extra <= 0 or tuple(value.shape[extra:]) != dims or \
                any(d != 1 for d in value.shape[:extra]):
            raise ValueError(f"{what} should have shape {dims} (the cache's {where}; "
                             f"extra leading dimensions of size 1 are dropped, as 0.2.1 "
                             f"did), but got {what}.shape={tuple(value.shape)}")
        value = value.reshape(dims)  # (1, C, H, W) from a loader's unsqueeze(0)
    src = value.dtype
    if src not in DTYPE_CODES or value.layout != torch.strided or value.device.type == "meta":
        raise TypeError(f"{what} should be a dense tensor with data and a dtype the cache "
                        f"can store ({dst} or one that casts to it), but got "
                        f"{what}.dtype={src}, layout={value.layout}, device={value.device}")
    if src == dst or dst in _LOSSLESS.get(src, ()):
        return value
    if (src.is_floating_point or src.is_complex) and \
            (dst.is_floating_point or dst.is_complex) and (dst.is_complex or not src.is_complex):
        return value  # rounding into a narrower float or complex, as torch does
    # 0.2.1 stored any dtype with torch's casting rules, so 0.2.1 code may pass float64
    # arrays to a float32 cache (intended rounding) or int64 masks to a uint8 cache
    # (values that fit). Both keep working; a cast that would change a value (0.7 into
    # uint8, 300 into uint8, 1+2j into float32) is refused instead of stored wrong.
    cpu = value.detach().to("cpu").resolve_conj().resolve_neg()
    if src.is_complex and not dst.is_complex:
        if cpu.imag.count_nonzero():
            raise ValueError(
                f"{what} should have dtype {dst}, or values that it holds exactly, but "
                f"got {what}.dtype={src} with imaginary parts that are not 0")
        if dst.is_floating_point:
            return value
        cpu = cpu.real
    bad = _first_changed(cpu, dst)
    if bad is not None:
        raise ValueError(
            f"{what} should have dtype {dst}, or values that it holds exactly, but "
            f"got {what}.dtype={src} with values that change in {dst}, e.g. "
            f"{what}[{', '.join(map(str, bad))}]={cpu[bad].item()!r}")
    return value


def _first_changed(value: torch.Tensor, dst: torch.dtype) -> tuple[int, ...] | None:
    """Index of the first element of the CPU tensor ``value`` that ``dst`` does not hold
    exactly, or None."""
    if is_integer_dtype(value.dtype) and is_integer_dtype(dst):
        # A cast back cannot tell: int8 -84 becomes uint8 172 and then -84 again.
        a, info = value.numpy(), np.iinfo(DTYPE_CODES[dst][1])
        if a.size == 0 or (int(a.min()) >= info.min and int(a.max()) <= info.max):
            return None
        have = np.iinfo(a.dtype)  # bounds within a's own range: safe for any numpy
        changed = (a < max(info.min, have.min)) | (a > min(info.max, have.max))
    else:  # through torch: numpy has no bfloat16
        changed = (value.to(dst).to(value.dtype) != value).numpy()
        if not changed.any():
            return None
    return tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(changed)[0]),
                                                  tuple(value.shape)))


def slot_array(value: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A value that passed ``checked_value`` as the array to copy into a slot: on the CPU,
    in ``dtype``, the cache's (the rounding or exact cast that the check allowed)."""
    value = value.detach().to("cpu").resolve_conj().resolve_neg()
    if value.is_complex() and not dtype.is_complex:
        value = value.real  # its imaginary parts were checked to be 0
    if value.dtype != dtype:
        value = value.to(dtype)
    if dtype is torch.bfloat16:
        value = value.view(torch.uint16)
    return value.numpy()



# ----------------------------------------------------------------------------------------------
# 3. Who am I: the world and rank description
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process sits in a (possibly distributed) job.

    Built from the environment that ``torchrun`` or SLURM sets, so it works before
    ``torch.distributed.init_process_group``; tests and unusual launchers can build one by hand.

    Args:
        rank: global rank, in ``[0, world_size)``.
        world_size: number of processes in the job.
        local_rank: rank on this machine, in ``[0, local_world_size)``.
        local_world_size: processes on this machine that share one cache.
        node_rank: index of this machine, in ``[0, num_nodes)``.
        num_nodes: number of machines.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, low=1)
        check_int("rank", self.rank, low=0, high=self.world_size - 1)
        check_int("local_world_size", self.local_world_size, low=1, high=self.world_size,
                  expect=f"an int in [1, world_size={self.world_size}]")
        check_int("local_rank", self.local_rank, low=0, high=self.local_world_size - 1)
        check_int("num_nodes", self.num_nodes, low=1, high=self.world_size,
                  expect=f"an int in [1, world_size={self.world_size}]")
        check_int("node_rank", self.node_rank, low=0, high=self.num_nodes - 1)

    @property
    def is_local_leader(self) -> bool:
        """True for the process that creates the node's cache (local rank 0)."""
        return self.local_rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "World":
        """Read torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
        GROUP_WORLD_SIZE; Lightning's and Ray Train's NODE_RANK), else SLURM's (SLURM_PROCID,
        SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES); a process with neither is a
        world of one. Without LOCAL_WORLD_SIZE every rank of WORLD_SIZE is taken to be on this
        machine.

        Where the variables leave a count out (no GROUP_WORLD_SIZE: the number of nodes is
        WORLD_SIZE // LOCAL_WORLD_SIZE; under SLURM the tasks on this node are SLURM_NTASKS //
        SLURM_NNODES), it is derived as if every node ran as many ranks, and variables that
        rule that out raise a ``ValueError``: read from one node of an uneven placement, the
        derived count would differ from the other nodes' (``discover`` asks the process group
        instead)."""
        env = os.environ if env is None else env

        def get(*names: str) -> int | None:
            for n in names:
                v = env.get(n)
                if v not in (None, ""):
                    try:
                        return int(v)
                    except ValueError:
                        raise ValueError(f"environment variable {n} should be an int, "
                                         f"but got {n}={v!r}") from None
            return None

        def uneven(rule: str, count: str, *names: str) -> ValueError:
            got = ", ".join(f"{n}={env[n]}" for n in names if env.get(n) not in (None, ""))
            return ValueError(
                f"{rule}, but got {got}: {count} cannot be derived from this node's "
                "variables (the ranks may be spread unevenly over the nodes, and each node "
                "would derive another). Construct the cache after init_process_group "
                "(World.discover then asks the process group), or pass world=World(...)")

        if "LOCAL_RANK" in env or "RANK" in env:  # torchrun, accelerate, Lightning, Ray Train
            world_size = get("WORLD_SIZE") or 1
            local_rank = get("LOCAL_RANK") or 0
            local_ws = get("LOCAL_WORLD_SIZE") or (world_size if "LOCAL_RANK" in env else 1)
            node_rank = get("GROUP_RANK", "NODE_RANK")  # Lightning, Ray Train: NODE_RANK
            num_nodes = get("GROUP_WORLD_SIZE") or None
            if num_nodes is None:  # derived: as many ranks on every node as on this one
                names = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK",
                         "NODE_RANK")
                if world_size % local_ws:
                    raise uneven("with no GROUP_WORLD_SIZE to name the number of nodes, "
                                 "WORLD_SIZE should be a multiple of LOCAL_WORLD_SIZE",
                                 "the number of nodes", *names)
                num_nodes = world_size // local_ws
                if node_rank is not None and node_rank >= num_nodes:
                    alone = "" if "LOCAL_WORLD_SIZE" in env else \
                        " (with no LOCAL_WORLD_SIZE, every rank is on this node)"
                    raise uneven(f"with no GROUP_WORLD_SIZE to name the number of nodes, the "
                                 f"node rank should be below WORLD_SIZE // LOCAL_WORLD_SIZE = "
                                 f"{num_nodes}{alone}", "the number of nodes", *names)
            elif local_ws + num_nodes - 1 > world_size:  # each other node runs a rank or more
                raise ValueError(f"LOCAL_WORLD_SIZE + GROUP_WORLD_SIZE - 1 should be at most "
                                 f"WORLD_SIZE (each other node runs a rank at least), but got "
                                 f"WORLD_SIZE={world_size}, LOCAL_WORLD_SIZE={local_ws}, "
                                 f"GROUP_WORLD_SIZE={num_nodes}")
            rank = get("RANK")
            if rank is None:
                rank = (node_rank or 0) * local_ws + local_rank
            if node_rank is None:
                node_rank = rank // local_ws
        elif "SLURM_PROCID" in env:
            world_size = get("SLURM_NTASKS") or 1
            rank = get("SLURM_PROCID") or 0
            local_rank = get("SLURM_LOCALID") or 0
            num_nodes = get("SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
            node_rank = get("SLURM_NODEID") or 0
            if num_nodes > 0 and world_size % num_nodes:
                raise uneven("with no count of the tasks on each node, SLURM_NTASKS should be "
                             "a multiple of SLURM_NNODES", "the tasks on this node",
                             "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                             "SLURM_NODEID")
            local_ws = max(1, world_size // num_nodes)
        else:
            return cls()
        return cls(rank=rank, world_size=world_size, local_rank=local_rank,
                   local_world_size=local_ws, node_rank=node_rank, num_nodes=num_nodes)

    @staticmethod
    def _env_names_the_nodes(env: Mapping[str, str]) -> bool:
        """True when the variables ``from_env`` would read name the number of nodes and the
        ranks on this one (torchrun and accelerate: GROUP_WORLD_SIZE and LOCAL_WORLD_SIZE;
        srun: SLURM_NNODES, with SLURM_NTASKS a multiple of it), so that no count is derived
        from one node's view. Ray Train and Lightning set no GROUP_WORLD_SIZE."""
        if "LOCAL_RANK" in env or "RANK" in env:
            return all(env.get(n) for n in ("RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"))
        if "SLURM_PROCID" in env:
            tasks = env.get("SLURM_NTASKS", "")
            nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES", "")
            return tasks.isdigit() and nodes.isdigit() and int(nodes) > 0 and \
                int(tasks) % int(nodes) == 0
        return False

    @classmethod
    def from_process_group(cls, group: Any = None) -> "World":
        """Ask an initialised ``torch.distributed`` process group: one ``all_gather_object``
        of every rank's host identity (host name and boot id) groups the ranks by machine.
        Every rank of the group must call it (a collective). Ranks are numbered node by node
        in the order of each machine's lowest rank."""
        dist = torch.distributed
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        hosts: list[Any] = [None] * ws
        dist.all_gather_object(hosts, _host_identity(), group=group)
        nodes = list(dict.fromkeys(hosts))
        here = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        return cls(rank=rank, world_size=ws, local_rank=here.index(rank),
                   local_world_size=len(here), node_rank=nodes.index(hosts[rank]),
                   num_nodes=len(nodes))

    @classmethod
    def discover(cls, env: Mapping[str, str] | None = None) -> "World":
        """Who this process is, from the first source that knows (the default of
        ``SharedCache(world=...)``):

        1. an initialised ``torch.distributed`` process group whose rank and size agree with
           launcher variables that name the number of nodes and the ranks on this one
           (torchrun, torchelastic and accelerate set GROUP_WORLD_SIZE and LOCAL_WORLD_SIZE;
           SLURM's srun sets SLURM_NNODES): those variables, no collective;
        2. an initialised process group otherwise (Ray Train and Lightning, which set no
           GROUP_WORLD_SIZE; ``torch.multiprocessing.spawn`` with ``init_process_group``):
           ``from_process_group()``, a collective, so every rank must construct its caches in
           the same order, in its own process (not in a DataLoader worker);
        3. no process group: the launcher's variables (``from_env``), else a world of one.
        """
        env = os.environ if env is None else env
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            if cls._env_names_the_nodes(env):
                world = cls.from_env(env)
                if (world.rank, world.world_size) == (dist.get_rank(), dist.get_world_size()):
                    return world
            info = torch.utils.data.get_worker_info()
            if info is not None:
                # A forked worker inherits the group but must not use it: its collective
                # would run over the training process's connections.
                raise RuntimeError(
                    f"a cache constructed in DataLoader worker {info.id} would have to ask the "
                    f"process group who its node's ranks are, which only the training process "
                    f"may do: construct the cache in the training process before the "
                    f"DataLoader starts its workers (with a cache made at first use, read "
                    f"dataset.cache once there; CacheAwareSampler(dataset) does)")
            return cls.from_process_group()
        return cls.from_env(env)


def _host_identity() -> str:
    """What tells this machine from another: its host name and boot id (containers with
    their own host name and /dev/shm count as machines of their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


# ----------------------------------------------------------------------------------------------
# 4. Which dataset indices each node caches
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Which dataset indices get a slot on which node: a pure function of its five fields.

    With one node the first ``slots`` indices are cached, as in stocaching 0.2.1, or, with
    ``random_subset``, the first ``slots`` entries of a permutation drawn from ``seed``. With
    several, that permutation is dealt out: node k takes the ``slots`` entries starting at
    ``k * slots``, so the nodes' subsets are uniformly random and disjoint
    while ``num_nodes * slots <= dataset_len``. When the cluster holds more than the dataset,
    the deal goes round the permutation again, each pass shifted so that its nodes' windows
    straddle those of the pass before (identical subsets on two nodes would waste the overlap
    the sampler can use): every index is then held by floor or ceil of
    ``num_nodes * slots / dataset_len`` nodes, and no node holds an index twice.

    Args:
        dataset_len: number of samples in the dataset.
        slots: slots per node (the same on every node).
        num_nodes: number of nodes. Default: 1.
        seed: seed of the permutation (with one node, used only with ``random_subset``).
            Default: 0.
        random_subset: with one node, cache a random subset rather than the first indices
            (several nodes always do). Default: False.
    """

    dataset_len: int
    slots: int
    num_nodes: int = 1
    seed: int = 0
    random_subset: bool = False

    def __post_init__(self) -> None:
        check_int("dataset_len", self.dataset_len, low=1)
        check_int("slots", self.slots, low=0, high=self.dataset_len)
        check_int("num_nodes", self.num_nodes, low=1)
        check_int("seed", self.seed, low=0, high=2**63 - 1)
        if not isinstance(self.random_subset, bool):
            raise TypeError(f"random_subset should be a bool, but got "
                            f"random_subset={self.random_subset!r}")

    @property
    def is_prefix(self) -> bool:
        """True when the cached indices are ``0 .. slots - 1`` in slot order: the dataset
        index is the slot, and the segment needs no slot map."""
        return self.num_nodes == 1 and (not self.random_subset or
                                        self.slots == self.dataset_len)

    def _perm(self) -> np.ndarray:
        return np.random.default_rng(self.seed).permutation(self.dataset_len)

    def _positions(self, node_rank: int) -> np.ndarray:
        """Positions in the permutation of the entries node ``node_rank`` takes."""
        n = self.dataset_len
        t = node_rank * self.slots + np.arange(self.slots, dtype=np.int64)
        # Shift each pass so its windows straddle the previous pass's by half a window, but by
        # at most n - slots, which keeps the entries of a node that spans two passes distinct.
        shift = min((n + self.slots // 2) % max(self.slots, 1), n - self.slots)
        return (t % n + t // n * shift) % n

    def indices(self, node_rank: int) -> np.ndarray:
        """Dataset indices cached by ``node_rank``, in slot order (int64)."""
        node_rank = check_int("node_rank", node_rank, low=0, high=self.num_nodes - 1)
        if self.is_prefix:
            return np.arange(self.slots, dtype=np.int64)
        return self._perm()[self._positions(node_rank)].astype(np.int64, copy=False)

    def owners(self) -> np.ndarray:
        """Boolean matrix ``(num_nodes, dataset_len)``: ``owners()[k, i]`` is True when node k
        caches index i."""
        out = np.empty((self.num_nodes, self.dataset_len), dtype=bool)
        for k, row in enumerate(self.owner_rows()):
            out[k] = row
        return out

    def owner_rows(self) -> Iterator[np.ndarray]:
        """The rows of ``owners()`` one at a time: the sampler never holds the whole matrix
        (64 nodes x 10 M indices would be 640 MB)."""
        if self.is_prefix:
            row = np.zeros(self.dataset_len, dtype=bool)
            row[: self.slots] = True
            yield row
            return
        perm = self._perm()
        if self.dataset_len < 2**31:
            perm = perm.astype(np.int32)
        for k in range(self.num_nodes):
            row = np.zeros(self.dataset_len, dtype=bool)
            row[perm[self._positions(k)]] = True
            yield row


# ----------------------------------------------------------------------------------------------
# 5. Exceptions (they cross DataLoader worker boundaries, so they pickle with their attributes)
# ----------------------------------------------------------------------------------------------


class CacheCapacityError(RuntimeError):
    """The shared-memory filesystem cannot hold the cache. Raised at construction, never later.

    Attributes:
        path: the directory (normally /dev/shm).
        needed: bytes the cache needs.
        free: bytes free there.
    """

    def __init__(self, message: str, path: str = "", needed: int = 0, free: int = 0) -> None:
        super().__init__(message)
        self.path, self.needed, self.free = path, needed, free

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.path, self.needed, self.free)


class CacheConfigError(ValueError):
    """A segment with this cache's name exists but was made for another configuration.

    Attributes:
        field: the first differing field (e.g. ``"data_dims"``).
        expected: this process's value.
        found: the segment's value.
    """

    def __init__(self, message: str, field: str = "", expected: Any = None,
                 found: Any = None) -> None:
        super().__init__(message)
        self.field, self.expected, self.found = field, expected, found

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.field, self.expected, self.found)


class CacheFileError(ValueError):
    """A file given to ``SharedCache(load_from=...)`` is not a whole saved cache: truncated,
    damaged, or not written by ``SharedCache.save``. Nothing of it is loaded.

    Attributes:
        path: the file.
        reason: what is wrong with it, in words.
    """

    def __init__(self, message: str, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path, self.reason = path, reason

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.path, self.reason)


class CacheTimeoutError(TimeoutError):
    """A local rank waited too long for the local leader to create the cache.

    Attributes:
        path: the segment name it waited for.
        timeout: seconds waited.
    """

    def __init__(self, message: str, path: str = "", timeout: float = 0.0) -> None:
        super().__init__(message)
        self.path, self.timeout = path, timeout

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.path, self.timeout)


# ----------------------------------------------------------------------------------------------
# 6. The segment's layout, and how many slots a budget buys
# ----------------------------------------------------------------------------------------------


#
# One file in /dev/shm holds everything:
#   [header, 4 KiB][stats table][aux: 1 byte per dataset index][seq: uint32 per slot]
#   [staging map: int64 per staging slot][slot map: int32/int64 per dataset index, multi-node
#   only][pad to a page][slots][staging slots]
# A staging slot holds the sample of an index without a slot here until one read takes it
# (for a prefetcher); its map entry is that index plus the stager's tag times 2**40 (so a
# prefetcher gives back only what it staged itself), -1 when free, -2 - pid while pid fills it.
# The header is written by the creator before the segment gets its public name, so a segment
# found under its name is complete. POSIX record locks (fcntl.lockf) on byte offsets far past
# the end of the file serialise writers of one slot and the few slow-path updates of the header;
# the kernel drops them when a process dies, so a crash never leaves a lock behind. A shared
# flock() held by every process using the segment tells a live segment from a stale one.
#
# A cache sized by size_limit_gib="auto" in /dev/shm's filesystem is not a file there but an
# anonymous one (memfd_create), so that it never takes the room DataLoader workers hand their
# batches over in (docs/design.md, "An anonymous segment for 'auto'"); its pages count against
# the memory (and a cgroup's limit) as a tmpfs file's do, and the kernel frees it with its last
# descriptor and mapping. Where other local ranks must attach, its name in /dev/shm is a pointer
# file instead of the segment: the leader's pid and process start, the descriptor number, and
# the memfd's (st_dev, st_ino); a rank opens /proc/<pid>/fd/<fd> and checks all of them.

_MAGIC = b"STOCACH1"
_POINTER_MAGIC = b"STOCMFD1"
POINTER = struct.Struct("<8sqqqqq")  # magic, pid, process start, fd, st_dev, st_ino
LAYOUT_VERSION = 5  # 4: the field table (nfields, and one record per field at _FIELDS_OFF);
# 5: random_subset
HEADER_BYTES = 4096
_HEADER_FIELDS = (
    "version", "total_bytes", "dataset_len", "slots", "dtype_code", "ndim",
    *(f"dim{i}" for i in range(_MAX_DIMS)),
    "num_nodes", "node_rank", "layout_seed", "creator_pid", "creator_start", "uid",
    "local_world_size", "stats_off", "stats_rows", "aux_off", "seq_off", "map_off", "data_off",
    "attached", "ready", "staging", "stage_off", "nfields",
    "arena_bytes", "arena_top", "record_words", "mean_bytes", "arena_full",  # open sizes
    "random_subset", "persistent", "key_hash",
)
_HEADER = struct.Struct("<8s" + "q" * len(_HEADER_FIELDS))
_FIELD_OFFSET = {f: 8 + 8 * i for i, f in enumerate(_HEADER_FIELDS)}
# The field table of a cache of several fields per sample, in the header after the fields
# above: per field, its name, dtype code, ndim, byte offset in the slot and dims.
_FIELDS_OFF = 1024
# A persistent cache's key (what data it holds), as UTF-8, at the end of the header.
KEY_OFF, _KEY_BYTES = 3072, 1024
# The job key of every persistent segment: its name alone identifies it.
PERSISTENT_JOB_KEY = "persistent"
_FIELD_RECORD = struct.Struct(f"<{FIELD_NAME_BYTES}sqqq" + "q" * _MAX_DIMS)
STATS_ROWS = 1024
STATS_COLS = 8  # pid, process start, hits, misses, oob misses, writes, staged hits, stages
(STATS_PID, STATS_START, STATS_HITS, STATS_MISSES, STATS_OOB_MISSES, STATS_WRITES,
 STATS_STAGED_HITS, STATS_STAGES) = range(8)
LOCK_BASE = 1 << 50  # lockf offsets: LOCK_BASE is the header, then one byte per slot
STAGE_LOCK = LOCK_BASE - 1  # the staging map
STAGE_TAG_SHIFT = 40  # a staging map entry: index | tag << 40
STAGE_INDEX_MASK = (1 << STAGE_TAG_SHIFT) - 1
MAX_STAGE_TAG = (1 << (63 - STAGE_TAG_SHIFT)) - 1


def slot_lock_offset(slot: int) -> int:
    return LOCK_BASE + 1 + slot


def segment_offsets(lay: CacheLayout, slot_bytes: int, staging: int = 0) -> dict:
    """Where each part of a segment starts, and its total size (see the layout above)."""
    stats_off = HEADER_BYTES
    aux_off = stats_off + STATS_ROWS * STATS_COLS * 8
    seq_off = aux_off + (lay.dataset_len + 7) // 8 * 8
    stage_off = seq_off + ((lay.slots + staging) * 4 + 7) // 8 * 8
    map_off = stage_off + staging * 8
    map_item = 0 if lay.is_prefix else _slot_map_dtype(lay).itemsize
    data_off = map_off + lay.dataset_len * map_item
    data_off = (data_off + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    return {"stats_off": stats_off, "aux_off": aux_off, "seq_off": seq_off,
            "stage_off": stage_off if staging else 0, "map_off": map_off if map_item else 0,
            "data_off": data_off, "total_bytes": data_off + max(1, (lay.slots + staging) *
                                                                slot_bytes)}


def _slot_map_dtype(layout: CacheLayout) -> np.dtype:
    """dtype of the slot map of a layout that is not a prefix (dataset index -> slot, -1 for
    none)."""
    return np.dtype(np.int32 if layout.slots < 2**31 else np.int64)


def bytes_per_slot(dims: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(dims) * dtype.itemsize


def slots_for_budget(size_limit_gib: float, dataset_len: int, slot_bytes: int,
                     staging: int = 0) -> int:
    """0.2.1's sizing rule: the budget covers the slots plus one aux byte per sample (and the
    staging slots, which are paid first)."""
    limit = size_limit_gib * BYTES_PER_GIB - staging * slot_bytes
    if slot_bytes * dataset_len + dataset_len <= limit:
        return dataset_len
    return max(0, min(dataset_len, int((limit - dataset_len) / slot_bytes)))


def budget_for_slots(slots: int, dataset_len: int, slot_bytes: int, staging: int = 0) -> float:
    """The inverse of ``slots_for_budget``: the size_limit_gib that buys exactly ``slots``
    slots (half a byte over, so that rounding cannot lose one)."""
    return ((slots + staging) * slot_bytes + dataset_len + 0.5) / BYTES_PER_GIB


def slots_fitting(free: int, like: CacheLayout, slot_bytes: int, staging: int = 0) -> int:
    """The most slots whose whole segment (metadata included) takes at most ``free`` bytes,
    for a layout like ``like`` (its slots aside)."""
    dataset_len = like.dataset_len

    def total(slots: int) -> int:
        layout = dataclasses.replace(like, slots=slots)
        return segment_offsets(layout, slot_bytes, staging)["total_bytes"]

    empty = total(0) - max(1, staging * slot_bytes)  # the metadata of a segment without slots
    slots = max(0, min(dataset_len, (free - empty - staging * slot_bytes) // (slot_bytes + 4)))
    while slots and total(slots) > free:  # page rounding: a few steps at most
        slots -= 1
    return slots


def _auto_budget(dataset_len: int, slot_bytes: int, staging: int, shm_dir: str,
                 like: CacheLayout, tiered: bool, local_world_size: int,
                 anonymous: bool = False) -> float:
    """``size_limit_gib="auto"``: the budget of the whole dataset, or of the most slots whose
    segment fits in the memory this process may use less the margin the RAM warning keeps
    (``memory_room``) and, unless the segment is ``anonymous`` (not a file in ``shm_dir``),
    in what ``shm_dir`` has free less the headroom left for its other users
    (``shm_headroom``); the choice is logged with its numbers. ``tiered``: a disk tier takes
    the indices without a slot. A directory that cannot hold even the metadata of a cache
    without slots raises ``CacheCapacityError``."""
    clean_segments(shm_dir)  # what dead jobs left is free room
    shm_free, headroom = free_bytes(shm_dir), shm_headroom(shm_dir)
    memory = memory_room(local_world_size)
    room = auto_room(shm_free, headroom, memory, anonymous)
    slots = min(dataset_len, slots_fitting(room, like, slot_bytes, staging))
    metadata = segment_offsets(dataclasses.replace(like, slots=0), slot_bytes,
                               staging)["total_bytes"]
    if slots == 0 and metadata > shm_free and not anonymous:
        raise CacheCapacityError(
            f"size_limit_gib='auto' finds {fmt_bytes(shm_free)} free in {shm_dir}, but even a "
            f"cache without slots needs {fmt_bytes(metadata)} there for the metadata of its "
            f"{dataset_len} samples" + (" (the disk tier holds the samples, not this)"
                                        if tiered else "") + f". {more_room(shm_dir, metadata)}"
            + ("" if tiered else ", and pass disk_tier=DIR to keep the samples that do not "
               "fit decoded on local disk"), shm_dir, metadata, shm_free)
    # Where the margin leaves no room, a cache without slots may still take its metadata from
    # it, up to a sixteenth of what is available: a job that runs without the cache must not
    # fail over a cache's few KiB (it warns, below, that every read misses).
    if slots == 0 and anonymous and metadata > max(room, memory.available // 16):
        more_gib = math.ceil((memory.total - memory.available + 2 * metadata) / BYTES_PER_GIB)
        raise CacheCapacityError(
            f"size_limit_gib='auto' finds {fmt_bytes(memory.available)} of memory available "
            f"({memory.describe()}, of which {fmt_bytes(memory.margin)} is kept free), but "
            f"even a cache without slots needs {fmt_bytes(metadata)} for the metadata of its "
            f"{dataset_len} samples" + (" (the disk tier holds the samples, not this)"
                                        if tiered else "") + ". " +
            (f"Raise the limit to about {more_gib} GiB (docker run --memory={more_gib}g, "
             f"Kubernetes resources.limits.memory: {more_gib}Gi, SLURM --mem={more_gib}G)"
             if memory.limited else "Free some memory") + " (a disk tier does not hold the "
            "metadata)", memory.source, metadata, room)
    budget = budget_for_slots(slots, dataset_len, slot_bytes, staging)
    whole = budget_for_slots(dataset_len, dataset_len, slot_bytes, staging)
    segment = segment_offsets(dataclasses.replace(like, slots=slots), slot_bytes,
                              staging)["total_bytes"]
    rest = dataset_len - slots
    logger.info(
        "stocaching: size_limit_gib='auto' takes %s of shared memory for %d of %d samples%s: "
        "the whole dataset needs %s; %s has %s free, of which %s, and %s is available (%s), "
        "of which %s is kept free",
        fmt_bytes(segment), slots, dataset_len,
        f" (the disk tier takes the other {rest})" if tiered and rest else "",
        fmt_bytes(whole * BYTES_PER_GIB), shm_dir, fmt_bytes(shm_free),
        "it takes none (an anonymous segment: all of it is left to its other users)"
        if anonymous else f"{fmt_bytes(headroom)} is left for its other users",
        fmt_bytes(memory.available), memory.describe(), fmt_bytes(memory.margin))
    if slots == 0 and not tiered:
        short_of_memory = anonymous or memory.available - memory.margin < shm_free - headroom
        fix = (f"Raise the memory limit (docker run --memory, Kubernetes "
               f"resources.limits.memory, SLURM --mem) by about "
               f"{fmt_bytes(2 * whole * BYTES_PER_GIB)}" if short_of_memory and memory.limited
               else "Free some memory" if short_of_memory else
               more_room(shm_dir, whole * BYTES_PER_GIB))
        spawned = memory.margin == memory.workers > 0 and not _workers_fork()
        warnings.warn(
            f"size_limit_gib='auto' finds room for no slot: {shm_dir} has {fmt_bytes(shm_free)}"
            f" free (of which {fmt_bytes(headroom)} is left for its other users) and "
            f"{fmt_bytes(memory.available)} of memory is available ({memory.describe()}, of "
            f"which {fmt_bytes(memory.margin)} is kept free" +
            (f" for {AUTO_WORKERS_PER_RANK} DataLoader workers a local rank, counted as "
             "started by spawn: if yours fork, call multiprocessing.set_start_method('fork') "
             "before the cache is made, and they count as forks" if spawned else "") +
            f"); every read will miss. {fix}, or pass disk_tier=DIR to keep the samples "
            "decoded on local disk", RuntimeWarning, stacklevel=_stacklevel_of_caller())
    return budget


def auto_room(shm_free: int, headroom: int, memory: _MemoryRoom, anonymous: bool) -> int:
    """The bytes a segment sized by ``size_limit_gib="auto"`` (or by ``plan`` without a
    budget) may take: the memory available less its margin, and, unless the segment is
    ``anonymous``, what its directory has free less its headroom."""
    room = memory.available - memory.margin
    return max(0, room if anonymous else min(shm_free - headroom, room))


def auto_is_anonymous(shm_dir: str) -> bool:
    """Whether ``size_limit_gib="auto"`` makes its segment anonymous (memfd_create): in
    /dev/shm's filesystem, whose room the DataLoader's batches need (section 6)."""
    return shm_headroom(shm_dir) > 0


def shm_headroom(shm_dir: str) -> int:
    """What ``size_limit_gib="auto"`` leaves free in ``shm_dir`` for its other users, and what
    a cache should leave there without a warning: the larger of ``SHM_HEADROOM_BYTES`` and
    ``SHM_HEADROOM_FRACTION`` of the filesystem where it is /dev/shm's (DataLoader workers
    hand their batches over through /dev/shm, and keep their semaphores there; NCCL's
    shared-memory transport has its buffers there); 0 on a filesystem of the caches' own."""
    try:
        if os.stat(shm_dir).st_dev != os.stat(DEFAULT_SHM_DIR).st_dev:
            return 0
    except OSError:
        return 0
    st = os.statvfs(shm_dir)
    return max(SHM_HEADROOM_BYTES, int(SHM_HEADROOM_FRACTION * st.f_blocks * st.f_frsize))


@dataclasses.dataclass(frozen=True)
class _MemoryRoom:
    """The memory this process may still take: the machine's RAM, or less where a memory
    cgroup limits it (docker run --memory, a Kubernetes pod's limit, a SLURM job's --mem).
    A cache's pages in /dev/shm are charged to the cgroup of the process that reserves them
    (the local leader), and cannot be reclaimed: past the limit, the OOM killer ends the job."""

    total: int  # bytes: the RAM, or the limit of the cgroup with the least room
    available: int  # bytes that may still be taken: RAM available, or the limit less the use
    source: str  # "RAM", or the file that holds the limit
    workers: int = 0  # bytes the DataLoader workers to come will take (_workers_to_come)

    @property
    def limited(self) -> bool:
        return self.source != "RAM"

    @property
    def margin(self) -> int:
        """What a cache should leave free (see ``RAM_MARGIN_BYTES``); under a memory limit
        at least half of what is free now, and what the DataLoader workers to come will take.
        What a job allocates after its cache is made counts against the limit too, and is not
        small (design note "The memory a cache leaves under a limit")."""
        margin = max(int(RAM_MARGIN_FRACTION * self.total), min(RAM_MARGIN_BYTES,
                                                                self.total // 4))
        return max(margin, self.available // 2, self.workers) if self.limited else margin

    def describe(self) -> str:
        if not self.limited:
            return f"RAM, of {fmt_bytes(self.total)}"
        return f"a memory limit of {fmt_bytes(self.total)}, in {self.source}"


# A memory cgroup's files, by version: its limit, its use, and (in memory.stat) the use that
# the kernel reclaims before it kills anything (file pages not used lately).
_CGROUP_MEMORY_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                        1: ("memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file")}


def memory_room(local_world_size: int = 1) -> _MemoryRoom:
    """The RAM available, or a memory cgroup's room where it is less: of the cgroups from
    this process's own up to the root of the hierarchy (a limit on any of them applies), the
    one with the least room, its limit less what it uses, file pages the kernel would reclaim
    aside (as Kubernetes counts a pod's working set); with, under a limit, what the DataLoader
    workers of ``local_world_size`` ranks will take. Unreadable cgroup files count as no
    limit."""
    vm = psutil.virtual_memory()
    room = _MemoryRoom(vm.total, vm.available, "RAM")
    try:
        levels = _memory_cgroup_levels()
    except (OSError, ValueError, IndexError):
        return room
    for path, limit, used in levels:
        if limit - used < room.available:
            room = _MemoryRoom(min(limit, vm.total), max(0, limit - used), path,
                               _workers_to_come(local_world_size))
    return room


def _workers_to_come(local_world_size: int) -> int:
    """What ``AUTO_WORKERS_PER_RANK`` DataLoader workers per local rank will take: each about
    half of this process's own resident memory (its anonymous pages: resident less the shared
    files' pages) where workers fork (the pages they write are copied), 1.5 times it where
    each starts a new interpreter that imports torch again (spawn, forkserver). Workers are
    counted as forks only where ``multiprocessing``'s start method is fork (set by the user,
    or by a DataLoader that started workers with the default): a DataLoader's own
    ``multiprocessing_context`` is not visible here, and a spawned worker counted as a fork
    was an OOM kill. Measured: design note "The memory a cache leaves under a limit"."""
    info = psutil.Process().memory_info()
    own = max(0, info.rss - getattr(info, "shared", 0))
    per_worker = own // 2 if _workers_fork() else own * 3 // 2
    return local_world_size * AUTO_WORKERS_PER_RANK * per_worker


def _workers_fork() -> bool:
    """Whether ``_workers_to_come`` counts DataLoader workers as forks: ``multiprocessing``'s
    start method is fork."""
    return multiprocessing.get_start_method(allow_none=True) == "fork"


def _memory_cgroup_levels(proc: str = "/proc/self") -> list[tuple[str, int, int]]:
    """(limit file, limit, use) of each memory cgroup above this process that has a limit,
    its own first: found through ``proc``/cgroup (its path in each hierarchy) and
    ``proc``/mountinfo (where the hierarchy is mounted, and which part of it: a container
    sees its own cgroup as the root). The v1 memory hierarchy if mounted (systems with both
    mount v2 without the memory controller), else v2."""
    with open(os.path.join(proc, "cgroup")) as f:
        paths = {}
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                paths[2] = path
            elif "memory" in controllers.split(","):
                paths[1] = path
    with open(os.path.join(proc, "mountinfo")) as f:
        mounts = {}
        for line in f.read().splitlines():
            fields = line.split()
            fstype, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3]
            if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in options.split(",")):
                mounts.setdefault(2 if fstype == "cgroup2" else 1, (fields[3], fields[4]))
    version = 1 if 1 in mounts and 1 in paths else 2
    if version not in mounts or version not in paths:
        return []
    (root, point), path = mounts[version], paths[version]
    inside = root == "/" or path == root or path.startswith(root.rstrip("/") + "/")
    here = os.path.normpath(point + "/" + path[len(root.rstrip("/")):]) if inside else point
    if not os.path.isdir(here) or not (here + "/").startswith(point.rstrip("/") + "/"):
        here = point  # (a path with "..": this process sits outside its cgroup namespace)
    limit_file, use_file, reclaimable = _CGROUP_MEMORY_FILES[version]
    levels = []
    while True:
        with contextlib.suppress(FileNotFoundError):
            with open(os.path.join(here, limit_file)) as f:
                text = f.read().strip()
            limit = None if text == "max" else int(text)
            if limit is not None and limit < 1 << 62:  # (v1 writes "no limit" as about 2**63)
                with open(os.path.join(here, use_file)) as f:
                    used = int(f.read())
                with open(os.path.join(here, "memory.stat")) as f:
                    stat_of = dict(line.split() for line in f.read().splitlines() if line)
                used -= min(used, int(stat_of.get(reclaimable, 0)))
                levels.append((os.path.join(here, limit_file), limit, used))
        if os.path.normpath(here) == os.path.normpath(point):
            return levels
        here = os.path.dirname(here)


def _memory_limit_error(memory: _MemoryRoom, needed: int, fit_gib: float
                        ) -> CacheCapacityError:
    """The error of a cache that would take more than a memory cgroup has room for."""
    # the limit under which the cache would leave its margin: at least half of what is free
    more_gib = math.ceil((memory.total - memory.available + max(2 * needed, needed +
                                                                memory.margin)) / BYTES_PER_GIB)
    return CacheCapacityError(
        f"this process may use {fmt_bytes(memory.total)} of memory (the limit in "
        f"{memory.source}), of which {fmt_bytes(memory.available)} is free, but the cache "
        f"needs {fmt_bytes(needed)} of shared memory, which counts against that limit: the "
        f"kernel would kill the job (OOM) while it is made. Raise the limit to about "
        f"{more_gib} GiB (docker run --memory={more_gib}g, Kubernetes "
        f"resources.limits.memory: {more_gib}Gi, SLURM --mem={more_gib}G)" +
        (f" or pass a smaller size_limit_gib (about {fit_gib:.3f} fits, leaving "
         f"{fmt_bytes(memory.margin)} for the rest of the job)"
         if memory.available > memory.margin else
         f"; no cache fits beside the {fmt_bytes(memory.margin)} that the rest of the job "
         "(its DataLoader workers) needs"), memory.source, needed, memory.available)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user can still allocate on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fs_type(path: str) -> str | None:
    """Type of the filesystem that holds ``path`` ("tmpfs", "ext4", ...), None if unknown."""
    path = os.path.realpath(path)
    best, fstype = "", None
    try:
        parts = psutil.disk_partitions(all=True)
    except (OSError, RuntimeError):
        return None
    for p in parts:
        mnt = p.mountpoint
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):  # the last of equal mounts is the visible one
            best, fstype = mnt, p.fstype
    return fstype


def get_shm_size(shm_dir: str = DEFAULT_SHM_DIR) -> int:
    """Total size of /dev/shm in whole GiB, as in 0.2.1 (``df -h /dev/shm`` shows the same).

    Resize it with ``mount -o remount,size=64G /dev/shm``, or ``docker run --shm-size=64g``.
    """
    st = os.statvfs(shm_dir)
    return int(st.f_blocks * st.f_frsize / BYTES_PER_GIB)


# ----------------------------------------------------------------------------------------------
# 7. Segment files: names, the header, opening, listing and cleaning up
# ----------------------------------------------------------------------------------------------


def _job_key(world: World, env: Mapping[str, str] | None = None) -> str:
    """A key shared by the local ranks of one job and by no other job of this user here.

    Derived from the parent process id, which the local ranks share where the launcher starts
    them side by side: torchrun (and accelerate launch), srun, ``mp.spawn`` (no variables).
    Lightning's own launcher starts ranks 1.. as children of rank 0, so their parents differ:
    where the variables do not come from torchrun or srun, an initialised process group carries
    each node's local rank 0's key to the others (one collective); without one, nothing lets
    the ranks agree, and a local rank that would wait ``timeout`` seconds for a cache it
    cannot find raises at once, saying what to set instead."""
    env = os.environ if env is None else env
    if env.get("STOCACHING_JOB_KEY"):
        return _check_name("STOCACHING_JOB_KEY", env["STOCACHING_JOB_KEY"])
    if world.local_world_size == 1:
        return f"p{os.getpid()}"  # nobody else needs to find it
    parts = [str(os.getppid())]
    parts += [env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                       "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
                                       "SLURM_STEP_ID")]
    key = hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
    siblings = ("LOCAL_WORLD_SIZE" in env and "RANK" in env) or "SLURM_PROCID" in env or \
        not ("LOCAL_RANK" in env or "RANK" in env)  # torchrun, srun; no variables: mp.spawn
    if siblings:
        return key
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and \
            (dist.get_rank(), dist.get_world_size()) == (world.rank, world.world_size):
        return _leaders_key(world, key)
    shown = ", ".join(f"{k}={env[k]}" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")
                      if k in env)
    raise RuntimeError(
        f"local rank {world.local_rank} of {world.local_world_size} cannot find the other local "
        f"ranks' cache: the launcher's variables ({shown}) do not come from torchrun or srun, "
        f"whose ranks share a parent process, and no torch.distributed process group of its "
        f"{world.world_size} ranks is initialised to agree on a job key through (Lightning's "
        "launcher starts ranks 1.. as children of rank 0). Construct the cache once the "
        "process group exists (under "
        "Lightning: in setup() or train_dataloader(), not at import or before Trainer.fit, "
        "when rank 0 has not yet started the others), or, with a launcher that starts every "
        "rank with its variables, set STOCACHING_JOB_KEY to one value for all its ranks")


def _leaders_key(world: World, key: str) -> str:
    """Every rank sends (node, local rank, key) to every rank, and each takes the key of its
    node's local rank 0: a collective, so every rank of the group must call it."""
    dist = torch.distributed
    got: list[Any] = [None] * world.world_size
    dist.all_gather_object(got, (world.node_rank, world.local_rank, key))
    leaders = {node: k for node, local_rank, k in got if local_rank == 0}
    return leaders.get(world.node_rank, key)


def _segment_name(job_key: str, node_rank: int, name: str) -> str:
    """The one place that names segments: prefix, user id, job key, node, cache name."""
    return f"{SEGMENT_PREFIX}_{os.getuid()}_{job_key}_n{node_rank}_{name}"


def parse_segment_name(fname: str) -> dict | None:
    if not fname.startswith(SEGMENT_PREFIX + "_"):
        return None
    parts = fname[len(SEGMENT_PREFIX) + 1:].split("_", 3)
    if len(parts) != 4 or not parts[0].isdigit():
        return None
    return {"uid": int(parts[0]), "job_key": parts[1], "node": parts[2],
            "name": parts[3].split(".", 1)[0], "starting": fname.endswith(".init")}


def open_existing(path: str) -> int:
    """Open a segment without following a symlink and check that it is ours and private."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:  # the same refusal for the leader (publish) and the others (attach)
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symbolic link; stocaching does not follow "
                                  "links. Remove it") from None
        if e.errno == errno.EISDIR:
            raise PermissionError(f"{path} is not a regular file; stocaching will not use it. "
                                  "Remove it or choose another name=") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path} is not a regular file; stocaching will not use it. "
                                  "Remove it or choose another name=")
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(
                f"{path} belongs to uid {st.st_uid} with mode {stat.filemode(st.st_mode)}, but a "
                f"cache segment must belong to uid {os.getuid()} with mode -rw-------; it is "
                "not trusted. Remove it, or set another job_key= / name=")
    except BaseException:
        os.close(fd)
        raise
    return fd


def pointer_of(fd: int) -> tuple[int, int, int, int, int] | None:
    """What the pointer file open at ``fd`` names (pid, process start, descriptor, st_dev,
    st_ino: section 6), or None where the file is not a pointer (a segment, a disk tier)."""
    if os.fstat(fd).st_size != POINTER.size:
        return None
    data = os.pread(fd, POINTER.size, 0)
    if len(data) != POINTER.size:
        return None
    magic, *named = POINTER.unpack(data)
    return tuple(named) if magic == _POINTER_MAGIC else None  # type: ignore[return-value]


def _open_pointed(pointer: tuple[int, int, int, int, int]) -> int | None:
    """The anonymous segment a pointer names, opened read-write through its leader's
    /proc/<pid>/fd; None where the leader or its descriptor is gone, or the descriptor is now
    another file (a pid or a descriptor number reused), or not this user's."""
    pid, start, num, dev, ino = pointer
    if not process_alive(pid, start):
        return None
    try:
        fd = os.open(f"/proc/{pid}/fd/{num}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino) or not stat.S_ISREG(st.st_mode) or \
            st.st_uid != os.getuid():
        os.close(fd)
        return None
    return fd


def read_header(buf: Any) -> dict:
    magic, *values = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise CacheConfigError("the segment is not a stocaching segment (bad magic)", "magic",
                               _MAGIC, magic)
    head = dict(zip(_HEADER_FIELDS, values))
    head["fields"] = tuple(_read_field(buf, k) for k in range(min(head["nfields"], MAX_FIELDS)))
    return head


def hash_of_key(key: str) -> int:
    """A persistent cache's key as a header field: 63 bits of its SHA-1."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little") >> 1


def read_key(buf: Any) -> str:
    raw = bytes(buf[KEY_OFF: KEY_OFF + _KEY_BYTES])
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def _head_dims(head: dict) -> tuple[Any, ...]:
    """The single tensor's dims in a header (None for an open size)."""
    return tuple(None if head[f"dim{i}"] < 0 else head[f"dim{i}"]
                 for i in range(min(head["ndim"], _MAX_DIMS)))


def has_open_size(dims: Any) -> bool:
    """True when ``data_dims`` (a tuple, or a dict of them) leaves a size open (None)."""
    try:
        if isinstance(dims, Mapping):
            return any(d is None for v in dims.values() for d in v)
        return any(d is None for d in dims)
    except TypeError:  # not iterable: the checks say what is wrong with it
        return False


def _read_field(buf: Any, k: int) -> tuple:
    """Record ``k`` of a segment's field table: (name, dims, dtype or its code, offset)."""
    name, code, ndim, offset, *dims = _FIELD_RECORD.unpack_from(
        buf, _FIELDS_OFF + k * _FIELD_RECORD.size)
    return (name.rstrip(b"\0").decode("ascii", "replace"),
            tuple(None if d < 0 else d for d in dims[:min(ndim, _MAX_DIMS)]),
            _DTYPE_BY_CODE.get(code, code), offset)


def names_file(path: str, ino: int, dev: int) -> bool:
    """True while ``path`` is still the name of the file we made (inode ``ino`` on ``dev``)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_ino == ino and st.st_dev == dev


def unlink_if_same(path: str, ino: int, dev: int) -> None:
    """Remove ``path`` only if it is still the file we made (never someone else's)."""
    if names_file(path, ino, dev):
        with contextlib.suppress(OSError):
            os.unlink(path)


def close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def open_to_look(path: str) -> int | None:
    """A read-only descriptor of ``path`` to look at it (no link followed, never blocking), or
    None where it cannot be opened."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None


def is_stale_file(path: str, *, remove: bool = False, min_age: float = 2.0) -> bool:
    """True when no live process holds the segment at ``path``; optionally remove it then.
    Files of other users, links, files younger than ``min_age`` seconds (a segment being
    made is open for an instant before its maker locks it) and files of this process's own
    caches are never stale."""
    fd = None if _held_here(path) else open_to_look(path)
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or \
                time.time() - st.st_mtime < min_age:
            return False
        if not try_stale(fd):
            return False
        if remove:
            unlink_if_same(path, st.st_ino, st.st_dev)
        return True
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: Any, offset: int) -> int:
    """Write all of ``data`` (bytes or a contiguous array) at ``offset``; returns its length."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def clean_segments(shm_dir: str = DEFAULT_SHM_DIR, *, dry_run: bool = False,
                   persistent: bool | Sequence[str] = (),
                   disk_tier: str | os.PathLike | None = None) -> list[str]:
    """Remove this user's segments in ``shm_dir`` that no live process holds (left by a job
    killed during start-up). Live segments are never touched, and persistent caches only when
    asked for.

    Args:
        persistent: persistent caches to remove too, by name, or True for all of them (those
            that no process uses now). Default: none.
        disk_tier: a directory of disk tiers (``SharedCache(disk_tier=...)``) to clean too,
            by the same rules: the tier files there that no live process holds (a job killed
            before its local ranks all opened its tier), and persistent ones by name.
            Default: None, only ``shm_dir``.

    Returns:
        The paths removed (or that would be, with ``dry_run=True``).
    """
    if isinstance(persistent, str) or not isinstance(persistent, (bool, Sequence)):
        raise TypeError(f"persistent should be a bool or a list of names, but got "
                        f"persistent={persistent!r}")
    names = () if persistent is False else persistent
    if disk_tier is not None and (not isinstance(disk_tier, (str, os.PathLike)) or
                                  not os.path.isdir(disk_tier)):
        raise (ValueError if isinstance(disk_tier, (str, os.PathLike)) else TypeError)(
            f"disk_tier should be an existing directory (where caches keep their disk "
            f"tiers), or None, but got disk_tier={disk_tier!r}")
    removed = [] if disk_tier is None else \
        feature_module("disk_tier")._clean_tier_files(os.fspath(disk_tier), dry_run=dry_run,
                                                      persistent=names)
    for fname in sorted(os.listdir(shm_dir)):
        info = parse_segment_name(fname)
        if info is not None and info["job_key"] == PERSISTENT_JOB_KEY and \
                not info["starting"] and names is not True and info["name"] not in names:
            continue
        if info is not None and info["uid"] == os.getuid():
            path = os.path.join(shm_dir, fname)
            # A persistent cache gets its name only once made and locked: asked for by name,
            # it goes as soon as no process holds it (a job script's last line runs at once)
            kept = info["job_key"] == PERSISTENT_JOB_KEY and not info["starting"]
            if is_stale_file(path, remove=not dry_run, min_age=0.0 if kept else 2.0):
                removed.append(path)
                logger.info("stocaching: removed stale segment %s", path)
    return removed


def check_key(key: Any, on_mismatch: Any) -> None:
    """The key of a persistent cache or of a saved file, and what to do when it differs."""
    if not isinstance(key, str):
        raise TypeError(f"key should be a str (which data the cache holds), but got key={key!r}")
    if len(key.encode()) >= _KEY_BYTES or "\0" in key:
        raise ValueError(f"key should be a str of less than {_KEY_BYTES} UTF-8 bytes without "
                         f"NUL, but got key={key[:80]!r}... ({len(key.encode())} bytes)")
    if on_mismatch not in ("raise", "replace"):
        raise ValueError(f"on_mismatch should be 'raise' or 'replace', but got "
                         f"on_mismatch={on_mismatch!r}")


def what_fits(cache: BaseCache, shm_dir: str, total: int, free: int) -> str:
    """The capacity error's second fix: the budget that fits in what ``shm_dir`` has free,
    less the headroom its other users need (``shm_headroom``)."""
    headroom = shm_headroom(shm_dir)
    fit_gib = cache._budget_fitting(max(0, free - headroom), total)
    return f"about {fit_gib:.3f} fits now" + (f", leaving {fmt_bytes(headroom)} for the "
                                              "DataLoader's workers" if headroom else "")


def more_room(shm_dir: str, total: int) -> str:
    """The capacity error's first fix: the size ``shm_dir`` should have to hold ``total`` more
    bytes than it holds now, as a docker option and a remount."""
    vfs = os.statvfs(shm_dir)
    need_gib = math.ceil(((vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize + total) / BYTES_PER_GIB)
    return (f"Give it more room (docker run --shm-size={need_gib}g, or mount -o "
            f"remount,size={need_gib}G {shm_dir})")


# ----------------------------------------------------------------------------------------------
# 8. Processes: liveness, the caches this process holds, sending, record locks
# ----------------------------------------------------------------------------------------------


def try_stale(fd: int) -> bool:
    """True when no live process holds the segment (we then hold an exclusive flock on it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def process_start(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown): tells a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int, start: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start == 0 or process_start(pid) in (0, start)


def _public_name(kind: type) -> str:
    """A cache class's name as the user knows it: ``SharedCache``, ``OpenSizeCache``, or the
    user's subclass; never a private class of ours."""
    return next(c.__name__ for c in kind.__mro__ if not c.__name__.startswith("_"))


def closed_error(kind: type) -> ValueError:
    """The error of any use of a closed cache of class ``kind``."""
    return ValueError(f"this {_public_name(kind)} is closed (close() was called, or its with "
                      "block ended); keep the cache open while its Dataset is used, or "
                      "construct it again")


class Closed:
    """Stands in for the shared buffers of a closed cache: any access says so."""

    __slots__ = ("_kind",)

    def __init__(self, kind: type) -> None:
        self._kind = kind

    def __getitem__(self, key: Any) -> Any:
        raise closed_error(self._kind)

    __setitem__ = __getitem__


# Process-wide by nature: the caches open in this process, which a forked child must give
# fresh thread locks and stats rows (one fork hook for all of them, registered once), and
# which a segment being cleaned up is checked against.
_LIVE_CACHES: "weakref.WeakSet[SharedCache]" = weakref.WeakSet()
_FORK_HOOK_REGISTERED = False
# Process-wide: numbers the caches made without a name in this process (their default names).
_NAME_COUNTER = itertools.count()
COPY_COUNTER = itertools.count()  # apart, so copies do not shift the default names


_MADV_POPULATE_READ = 22  # Linux >= 5.14; an older kernel refuses it and nothing is done
# What the attach maps itself, and each piece the thread then maps: see docs/design.md,
# "Populating the mapping at attach".
_POPULATE_NOW = 64 * BYTES_PER_MIB
_POPULATE_PIECE = 256 * BYTES_PER_MIB


def _madvise_populate(addr: int, nbytes: int) -> bool:
    """Map ``nbytes`` of this process's mapping at ``addr`` into its page table now (one
    ``madvise`` call, without the GIL); False where the kernel or the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = addr - addr % mmap.PAGESIZE
    return madvise(start, addr + nbytes - start, _MADV_POPULATE_READ) == 0


def _populate_in_background(addr: int, nbytes: int) -> tuple[threading.Thread, threading.Event]:
    """Map the ``nbytes`` of this process's mapping at ``addr`` (a segment's slots) into its
    page table, so that the first epoch after attaching to a filled cache does not fault in
    each page on its first read: the first ``_POPULATE_NOW`` bytes now, the rest in a daemon
    thread, piece by piece. Returns the thread and the event that stops it after the piece
    at hand; whoever unmaps sets it and joins first."""
    stop = threading.Event()
    first = min(nbytes, _POPULATE_NOW)

    def populate() -> None:
        for off in range(first, nbytes, _POPULATE_PIECE):
            if stop.is_set() or \
                    not _madvise_populate(addr + off, min(_POPULATE_PIECE, nbytes - off)):
                return

    thread = threading.Thread(target=populate, name="stocaching-populate", daemon=True)
    if nbytes and _madvise_populate(addr, first) and first < nbytes:
        thread.start()  # (an older kernel refuses the first: the reads fault, as before)
    return thread, stop


def _held_here(path: str) -> bool:
    """True when a live cache of this process maps the file at ``path``. Such a file must not
    be opened and closed again here: closing any descriptor of a file drops every POSIX record
    lock this process holds on it, slot locks of other threads included."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    ids = (st.st_dev, st.st_ino)
    return any(ids in (c._segment.file_id, c._segment.name_id) for c in list(_LIVE_CACHES))


def _after_fork_in_child() -> None:
    for cache in list(_LIVE_CACHES):
        cache._after_fork()


# Process-wide: the cache classes registered with multiprocessing's pickler (once each).
_SENDABLE_CLASSES: set = set()


def _sendable_by_multiprocessing(cls: type) -> None:
    """Register ``cls``'s reducer with multiprocessing's pickler, once per class, at the first
    cache of the class rather than at import. The pickler looks reducers up by exact class,
    so every subclass is registered on its own."""
    if cls not in _SENDABLE_CLASSES:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.register(cls, cls._reduce_for_process)
        _SENDABLE_CLASSES.add(cls)


def _a_local_rank_may_come() -> bool:
    """True while another local rank may still attach: a sibling process is alive (same
    parent, even init; not one of multiprocessing's helper processes), or a child of ours that
    a launcher started as another local rank (its LOCAL_RANK differs from ours). Our own
    forks and DataLoader workers do not count."""
    try:
        me = psutil.Process()
        mine = os.environ.get("LOCAL_RANK")
        kin = [c for c in me.children() if _environ(c).get("LOCAL_RANK", mine) != mine]
        parent = me.ppid()
        if parent > 0:  # pid 1 too: in a container the launcher often is pid 1
            kin += [p for p in psutil.Process(parent).children()
                    if p.pid != me.pid and not _is_multiprocessing_helper(p)]
    except psutil.Error:
        return False
    return any(_running(p) for p in kin)


def _environ(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _is_multiprocessing_helper(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return True
    return "multiprocessing.resource_tracker" in cmd or "multiprocessing.forkserver" in cmd


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def finalize_segment(fd: int, path: str | None, ino: int, dev: int, owner: int = 0,
                     wait: float = 0.0, name_fd: int = -1) -> None:
    """Close our descriptor (and ``name_fd``, an anonymous segment's pointer file). The
    creating process (not its forks, which inherit this finalizer) first waits up to ``wait``
    seconds for the local ranks that have not attached yet (the last one to attach drops the
    public name), then drops the name itself (``ino``, ``dev``: the name's file)."""
    try:
        if path is not None and os.getpid() == owner:
            _wait_for_attachers(path, ino, dev, wait)
            unlink_if_same(path, ino, dev)
    finally:
        close_fd(fd)
        if name_fd >= 0:
            close_fd(name_fd)


def _wait_for_attachers(path: str, ino: int, dev: int, wait: float) -> None:
    """A leader that is done before another local rank has even constructed the cache (a
    short job, a slow import on that rank) must not take the segment away from under it: the
    latecomer would find nothing to attach to and time out. Holding our descriptor keeps the
    segment alive and not stale while we wait. We wait only while another local rank may
    still come: the launchers start the local ranks as siblings (torchrun, mp.spawn, srun) or
    as children of rank 0 (Lightning), so when no such process is alive (see
    ``_a_local_rank_may_come``), the missing ranks died or were never started, and nobody is
    left to wait for. A leader that ends on an uncaught exception does not wait: its job is
    failing, its launcher stops the other ranks, and waiting would hold back the report (and
    a restart) for ``timeout`` seconds."""
    if getattr(sys, "last_value", None) is not None:  # (set for an uncaught exception)
        return
    start = time.monotonic()
    delay, told = 0.005, False
    while names_file(path, ino, dev) and _a_local_rank_may_come():
        waited = time.monotonic() - start
        if waited >= wait:
            warnings.warn(
                f"local rank 0 closed the cache {path} after waiting {wait:.0f} s for the other "
                "local ranks to attach, and not all of them did; a local rank that constructs "
                "it later will time out. Construct each cache on every local rank (see "
                "docs/distributed.md), or pass a World with local_world_size=1 for a cache of "
                "one process", RuntimeWarning, stacklevel=2)
            return
        if waited > 10 and not told:
            logger.warning("stocaching: local rank 0 is done with %s but waits (up to %.0f s) "
                           "for the other local ranks to attach before it lets go", path, wait)
            told = True
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _rebuild_cache(dupfd: Any, cls: type, state: dict) -> BaseCache:
    """Unpickle a SharedCache in a spawned or forkserver worker: map the inherited descriptor."""
    fd = dupfd.detach()
    cache = cls.__new__(cls)
    cache.__dict__.update(state)
    segment = cache._segment = Segment(cache._path)
    try:
        segment.map_existing(cache, fd)
    except BaseException:
        os.close(fd)
        raise
    segment.finalizer = weakref.finalize(segment, finalize_segment, fd, None, 0, 0)
    return cache


def open_leaders_file(path: str, timeout: float) -> tuple[int, tuple[int, int]] | None:
    """A local rank other than the leader: the leader's file at ``path`` (a segment, a disk
    tier; for a pointer file, the anonymous segment it names) open, with a shared flock (what
    tells `clean` it is in use), once it exists and is not left by a dead job (that one is for
    the leader to replace), and the (st_dev, st_ino) of the file named ``path``; None after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            fd = open_existing(path)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            if try_stale(fd):  # left by a dead job: wait for our leader to replace it
                os.close(fd)
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)  # a cleaner holds it for a moment
                else:
                    st = os.fstat(fd)
                    pointer = pointer_of(fd)
                    if pointer is None:
                        return fd, (st.st_dev, st.st_ino)
                    os.close(fd)
                    fd = _open_pointed(pointer)
                    if fd is not None:  # (else its leader is gone: wait for the next one)
                        fcntl.flock(fd, fcntl.LOCK_SH)
                        return fd, (st.st_dev, st.st_ino)
        if time.monotonic() > deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class RecordLocks:
    """This process's record locks on one shared file (a segment, a disk tier): the lock idiom
    every writer of shared state uses. ``lock(offset)`` takes this process's thread lock, then
    the POSIX record lock on bytes at ``offset`` (record locks do not exclude the threads of
    one process, and the kernel drops those of a process that dies); ``unlock(offset)``
    releases both. The thread lock is reentrant: the arena's lock is taken inside an index's.

    Every path calls the pair: ``x.lock(offset)``, then ``try: ... finally:
    x.unlock(offset)``. A pair of methods rather than a context manager because set_slot takes
    it: a ``with`` on an object made for each call cost more than the pair (docs/design.md,
    "One lock idiom")."""

    fd: int = -1  # the file's descriptor in this process
    thread_lock: threading.RLock  # the threads of this process, around its record locks

    def lock(self, offset: int, length: int = 1) -> None:
        """Take the thread lock, then the record lock on ``length`` bytes at ``offset``."""
        self.thread_lock.acquire()
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, length, offset)
        except BaseException:
            self.thread_lock.release()
            raise

    def unlock(self, offset: int, length: int = 1) -> None:
        """Release what ``lock(offset, length)`` took."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, length, offset)
        finally:
            self.thread_lock.release()

    def after_fork(self) -> None:
        """In a forked child: a thread lock of its own (the parent's may be held)."""
        self.thread_lock = threading.RLock()


def claim_stats_row(rows: np.ndarray, locks: RecordLocks, offset: int, first: int,
                    what: str) -> int:
    """This process's row of a table of per-process counters in a shared file (``rows``:
    pid, process start, then counters from column ``first``), taken under the record lock at
    ``offset``: its own row if it has one (every handle of a process counts in one row, so a
    process that receives a cache in each of its Pool tasks does not use up the rows), else a
    free one; the rows of dead processes are folded into row 0 first. Row 0 when none is
    free (with a warning naming ``what``)."""
    pid = os.getpid()
    locks.lock(offset)
    try:
        for r in np.flatnonzero(rows[1:, STATS_PID]) + 1:
            if not process_alive(int(rows[r, STATS_PID]), int(rows[r, STATS_START])):
                rows[0, first:] += rows[r, first:]
                rows[r] = 0
        mine = np.flatnonzero(rows[1:, STATS_PID] == pid)  # alive, so ours (a reused pid folded)
        if len(mine):
            return int(mine[0]) + 1
        empty = np.flatnonzero(rows[1:, STATS_PID] == 0)
        if not len(empty):
            warnings.warn(f"more than {len(rows) - 1} processes use this {what}; their stats "
                          "share one row and may undercount", RuntimeWarning)
            return 0
        free = int(empty[0]) + 1
        rows[free, STATS_PID], rows[free, STATS_START] = pid, process_start(pid)
        return free
    finally:
        locks.unlock(offset)


# ----------------------------------------------------------------------------------------------
# 9. The seam: features in modules beside this one
# ----------------------------------------------------------------------------------------------
# Each capability that the two-line user does not need is a module beside this one (in the
# package, or copied next to this file), loaded when its keyword is first used: see
# docs/design.md, "The core and its feature modules". A feature module uses the names of
# __all__ and those of _SEAM, and the core reaches it only through feature_module, _FromFeature and
# the module __getattr__ below, and through the collaborators it makes (a cache's _disk_tier
# and _staging, a segment filled by saved._SavedFileReader).

_FEATURES = {  # module: what uses it (the error when its file is missing says so)
    "batches": "reading batches (get_batch, locate, confirm, rows, unpack_rows)",
    "cli": "the command line (python stocaching.py, plan, list_segments)",
    "disk_tier": "a disk tier (disk_tier=)",
    "fields": "a cache of several fields a sample (a dict data_dims)",
    "holder": "keeping a cache for torchrun's restarts (under its elastic agent)",
    "open_size": "OpenSizeCache (samples of open sizes, a None in data_dims)",
    "persistent": "a persistent cache (persistent=True)",
    "saved": "saving or loading a cache (save, load_from=, describe_saved_file)",
    "masks": "asking which indices a cache holds (slot_mask, stored_mask, ready_mask, "
             "cached_indices, owner_rows)",
    "staging": "staging (staging_slots=, stage, unstage, read_tier)",
    "views": "reading a sample without a copy (get_slot(i, copy=False), a ReadOnlyView)",
}
_PUBLIC_IN_FEATURES = {"OpenSizeCache": "open_size", "ReadOnlyView": "views",
                       "describe_saved_file": "saved", "list_segments": "cli", "plan": "cli"}
# The names of this module, public but not in __all__, that the feature modules use besides
# __all__ (tests/test_docs.py checks that they use no other, and nothing private): the
# segment's format, sizing, locks and the cache's hooks. They are the seam's, not a user's API.
_SEAM = frozenset({
    "BYTES_PER_MIB", "COPY_COUNTER", "DEFAULT_SHM_DIR", "DTYPE_CODES", "EMPTY",
    "FIELD_NAME_BYTES", "HEADER_BYTES", "KEY_OFF", "LAYOUT_VERSION", "LOCK_BASE", "MAX_FIELDS",
    "MEMORY_FILESYSTEMS", "OOB", "PERSISTENT_JOB_KEY", "POINTER", "SEGMENT_PREFIX", "SET",
    "STAGE_INDEX_MASK", "STAGE_LOCK", "STAGE_TAG_SHIFT", "STATS_COLS", "STATS_HITS",
    "STATS_MISSES", "STATS_OOB_MISSES", "STATS_ROWS", "STATS_STAGED_HITS", "STATS_STAGES",
    "STATS_WRITES", "WRITING", "Closed", "Field", "RecordLocks", "Segment", "auto_is_anonymous",
    "auto_room", "budget_for_slots", "bytes_per_slot", "check_dims", "check_dtype", "check_key",
    "check_positive", "checked_value", "claim_stats_row", "close_fd",
    "closed_error", "feature_module", "finalize_segment", "fmt_bytes", "free_bytes", "fs_type",
    "has_open_size", "hash_of_key", "is_int", "is_integer_dtype", "is_stale_file", "logger",
    "memory_room", "more_room", "names_file", "open_existing", "open_leaders_file",
    "open_to_look", "pack_fields", "parse_segment_name", "pointer_of", "process_alive",
    "process_start", "pwrite_all", "read_header", "read_key", "segment_offsets", "shm_headroom",
    "slot_array", "slot_lock_offset", "slots_fitting", "slots_for_budget", "torch_of",
    "try_stale", "unlink_if_same", "what_fits"
})


def _kept_for_restarts() -> bool:
    """True under torchrun's elastic agent with holder.py beside this file: the local leader
    keeps its cache for the agent's restarts (docs/interruptions.md). Without the file, a
    restarted group starts cold, as a copied core alone always did."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        feature_module("holder")
    except ImportError as e:
        logger.info("stocaching: %s; a restart of this job starts with an empty cache", e)
        return False
    return True


def feature_module(module: str) -> types.ModuleType:
    """The feature module ``module``: ``<package>.<module>`` inside a package, else the
    top-level ``module`` (this file copied into a project, the feature's file beside it).
    Raises ImportError naming the file to copy when it is not there, and, without running
    it, when the module of that name is not stocaching's (a project's own ``holder.py``)."""
    name = f"{__package__}.{module}" if __package__ else module
    found = sys.modules.get(name)
    if found is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            here = os.path.dirname(os.path.abspath(__file__))
            raise ImportError(
                f"{_FEATURES[module]} needs {module}.py beside stocaching.py (in {here}): copy "
                "it there from the stocaching package, which has one file per feature",
                name=name) from None
        source = None
        with contextlib.suppress(ImportError, OSError, AttributeError):
            source = spec.loader.get_source(name)  # type: ignore[union-attr]
        if source is not None and f'\nSTOCACHING_FEATURE = "{module}"' not in source:
            raise _not_the_feature(module, name, spec.origin)
        found = importlib.import_module(name)
    if getattr(found, "STOCACHING_FEATURE", None) != module:
        raise _not_the_feature(module, name, getattr(found, "__file__", None))
    return found


def _not_the_feature(module: str, name: str, path: str | None) -> ImportError:
    """The error for a module named as a feature that is not stocaching's (it lacks the line
    ``STOCACHING_FEATURE = "<module>"`` that each feature module has)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return ImportError(
        f"{_FEATURES[module]} needs stocaching's {module}.py beside stocaching.py (in {here}), "
        f"but the module {name} is {path}, which is not stocaching's (it lacks the line "
        f"STOCACHING_FEATURE = \"{module}\"): copy stocaching's files into a folder of their "
        "own (a package) so that their names are theirs", name=name)


class _FromFeature:
    """A method or property of a cache whose code is in a feature module, looked up there at
    its first use: ``help()`` and the API docs show the feature's own docstring."""

    module: str
    name: str = ""
    code: Any = None  # the feature's function (or property), once looked up

    def __init__(self, module: str) -> None:
        self.module = module

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cache: Any, owner: type | None = None) -> Any:
        code = self.code
        if code is None:
            code = self.code = getattr(feature_module(self.module), self.name)
        return code.__get__(cache, owner)


# The public names of the opt-in modules, which a copied core does not serve: asked of it, they
# raise the ImportError that says where they are (tests/test_docs.py checks this list).
_OPT_IN_NAMES = {
    "samplers": ("CacheAwareSampler", "ideal_hit_rate"),
    "order": ("ReadyFirstSampler", "WIDE_WINDOW_PART", "ready_first_order"),
    "prefetch": ("PrefetchError", "Prefetcher"),
    "mixtures": ("MixtureDataset", "WeightedMixtureSampler"),
    "device": ("DeviceLoader",), "wrapper": ("CachedDataset",),
    "streams": ("CachedStream", "ShardLayout"),
    "trainers": ("accelerate_epoch", "dealt_by_accelerate", "in_lightnings_wrapper"),
}


def __getattr__(name: str) -> Any:
    """The public names that live in feature modules (``stocaching.OpenSizeCache`` of a
    copied core, with open_size.py beside it); of a copied core, an opt-in's name raises an
    ImportError naming its file (``from stocaching import CacheAwareSampler``)."""
    module = _PUBLIC_IN_FEATURES.get(name)
    if module is not None:
        return getattr(feature_module(module), name)
    opt_in = next((m for m, names in _OPT_IN_NAMES.items() if name in names), None)
    if opt_in is not None and not __package__:
        raise ImportError(
            f"{name} is in {opt_in}.py, an opt-in module of stocaching, not in the core "
            f"stocaching.py: copy {opt_in}.py beside it (with the files it needs: see the "
            f"README) and import it from there: from {opt_in} import {name}", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# 10. The segment: made, adopted or attached, mapped, locked and closed (Segment)
# ----------------------------------------------------------------------------------------------


class Segment(RecordLocks):
    """A cache's file of shared memory on this node, as this process holds it: the
    descriptor, the two mappings, the record locks and the header's counters.

    The local leader makes it (``make``; a persistent cache's is adopted where it exists:
    ``open_persistent``), the other local ranks attach to it by name (``attach``), and a
    process the cache is sent to maps the descriptor it received (``map_existing``). What the
    segment holds is the cache's to say: each of those takes the cache as ``owner``, which
    gives the header it expects (``_expected_header``), checks one someone else wrote
    (``_check_header``), builds its views on the mapping (``_map``), marks which indices
    have a slot (``_mark_slots``) and fills it from a saved file (``_load``).
    """

    # -- state: this process's handle (a forked child inherits it; a process the cache is
    # sent to makes its own in _rebuild_cache) ---------------------------------------------
    path: str  # the segment's name in the shm directory (gone once every local rank holds it)
    mapping: mmap.mmap | None = None  # read-write: every copying read and every write
    read_only_mapping: mmap.mmap | None = None  # backs copy=False views: writing one crashes
    size: int = 0
    file_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file this handle maps
    # ... of its name in the shm directory: the file itself, or an anonymous segment's pointer
    name_id: tuple[int, int] = (0, 0)
    pointer_fd: int = -1  # the leader's descriptor of an anonymous segment's pointer file
    finalizer: weakref.finalize | None = None  # closes fd (the leader: drops the name too)
    populating: tuple[threading.Thread, threading.Event] | None = None  # pages mapped in
    # Under torchrun's agent, the leader's: lets the holder go at close() (holder.py)
    release: weakref.finalize | None = None

    def __init__(self, path: str) -> None:
        self.path = path
        self.thread_lock = threading.RLock()

    # -- making, adopting and attaching -----------------------------------------------------

    def _make_file(self, owner: BaseCache, publish: Callable[[str, int], None],
                   load_from: str | None = None) -> tuple[int, os.stat_result, dict]:
        """Make ``owner``'s segment in a private temporary file (header written, mapped),
        fill it from the saved file ``load_from`` if given, then ``publish(tmp, fd)`` gives it
        its name, or not. The temporary name is gone afterwards; on any error (``publish``'s
        included) so are the mapping and the descriptor, and the error is raised."""
        head = owner._expected_header()
        self._preflight(owner, os.path.dirname(self.path), head["total_bytes"])
        if owner._anonymous:  # (named after its path, for /proc's maps and list_segments)
            tmp = None
            fd = os.memfd_create(self.path, os.MFD_CLOEXEC)
            os.fchmod(fd, 0o600)
        else:
            tmp = f"{self.path}.{os.getpid()}.{secrets.token_hex(4)}.init"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        try:
            # A load by sendfile writes the slots through the file, which allocates their
            # pages as it goes (no SIGBUS: a full filesystem fails the write): reserving the
            # rest afterwards spares it a pass over the memory before the copy can start.
            late = load_from is not None and feature_module("saved")._SENDFILE
            self._init_file(owner, fd, head, reserve=head["data_off"] if late else None)
            if load_from is not None:
                owner._load(load_from, head["data_off"], reserved=not late)
            if late:
                self.reserve(owner, fd, head["total_bytes"])
            publish(tmp, fd)
        except BaseException:
            if self.mapping is not None:
                owner._unmap()  # the traceback keeps the cache alive: free the memory now
            close_fd(fd)
            raise
        finally:
            if tmp is not None:
                unlink_if_same(tmp, st.st_ino, st.st_dev)
        return fd, st, head

    def make(self, owner: BaseCache, load_from: str | None = None) -> None:
        """The local leader of a cache that is not persistent: make the segment (filled from
        ``load_from`` if given) and, when other local ranks will attach, publish its name."""
        shared = owner._world.local_world_size > 1

        def publish(tmp: str | None, fd: int) -> None:
            if not shared:
                return
            if tmp is None:
                self._publish_pointer(owner, fd)
            else:
                self._publish(owner, tmp, fd)

        fd, st, head = self._make_file(owner, publish, load_from)
        shm_dir = os.path.dirname(self.path)
        wait = owner._timeout if shared else 0.0
        dev, ino = self.name_id
        self.finalizer = weakref.finalize(self, finalize_segment, fd, self.path, ino, dev,
                                          os.getpid(), wait, self.pointer_fd)
        lay = owner._layout
        logger.info(
            "stocaching: cache %r holds %d of %d samples (%.1f%%) of %s on node %d: "
            "%s in %s, %s free there afterwards", owner._name, lay.slots, lay.dataset_len,
            100.0 * lay.slots / lay.dataset_len, owner._describe(), owner._world.node_rank,
            fmt_bytes(head["total_bytes"]),
            f"anonymous shared memory (memfd), not in {shm_dir}" if owner._anonymous else
            shm_dir, fmt_bytes(free_bytes(shm_dir)))

    def populate(self, data_off: int) -> None:
        """Map the pages of the slots of a segment that holds samples into this process
        ahead of the reads, the first now and the rest in the background (the read-write
        mapping: the one every copying read reads); ``unmap`` stops the thread first."""
        rows = np.frombuffer(self.mapping, np.uint8, self.size - data_off, data_off)
        self.populating = _populate_in_background(rows.ctypes.data, rows.nbytes)

    def _preflight(self, owner: BaseCache, shm_dir: str, total: int) -> None:
        """Before anything is made: drop stale segments, refuse what cannot fit (in the
        directory, or under a memory cgroup's limit), warn about a directory on disk, a
        machine left short of memory, or a /dev/shm left short for its other users."""
        clean_segments(shm_dir)  # segments of this user whose processes are all gone
        free = free_bytes(shm_dir)
        if total > free and not owner._anonymous:
            raise owner._capacity_error(shm_dir, total, free)
        fstype = fs_type(shm_dir)
        on_disk = fstype is not None and fstype not in MEMORY_FILESYSTEMS and \
            not owner._anonymous
        if on_disk:
            warnings.warn(f"shm_dir={shm_dir!r} is on a {fstype} filesystem, not in memory: "
                          "the cache is a file there, and may be as slow as the data it "
                          "caches. Use /dev/shm or another tmpfs.", RuntimeWarning,
                          stacklevel=_stacklevel_of_caller())
            return
        memory = memory_room(owner._world.local_world_size)
        if memory.limited and total > memory.available:
            raise _memory_limit_error(memory, total, owner._budget_fitting(
                max(0, memory.available - memory.margin), total))
        if owner._auto_sized:
            return  # (it kept the margin and the headroom, as it logged, its metadata aside)
        if memory.available - total < memory.margin:
            warnings.warn(
                f"the cache needs {fmt_bytes(total)} of shared memory but only "
                f"{fmt_bytes(memory.available)} of "
                + ("RAM is available" if not memory.limited else
                   f"memory is free under the limit in {memory.source}") +
                f"; less than {fmt_bytes(memory.margin)} would be left for everything else"
                + (". Pass a smaller size_limit_gib if the machine starts swapping or the OOM "
                   "killer strikes." if not memory.limited else
                   f" (DataLoader workers: {AUTO_WORKERS_PER_RANK} per local rank take about "
                   f"{fmt_bytes(memory.workers)}). Pass a smaller size_limit_gib if the OOM "
                   "killer ends the job (exit 137)."), RuntimeWarning,
                stacklevel=_stacklevel_of_caller())
        headroom = shm_headroom(shm_dir)
        if free - total < headroom:
            warnings.warn(
                f"the cache takes {fmt_bytes(total)} of the {fmt_bytes(free)} free in "
                f"{shm_dir} and leaves {fmt_bytes(free - total)}, less than the "
                f"{fmt_bytes(headroom)} a cache should leave there for its other users: "
                "DataLoader workers hand over each batch there (about batch bytes x "
                "num_workers x prefetch_factor at once, per rank) and keep their semaphores "
                "there, and NCCL's shared-memory transport its buffers. If they run out, a "
                "worker dies with 'unable to allocate shared memory' or 'No space left on "
                f"device'. {more_room(shm_dir, total + headroom)}, pass a smaller "
                "size_limit_gib, or pass size_limit_gib='auto' (its segment takes no room in "
                "/dev/shm).", RuntimeWarning, stacklevel=_stacklevel_of_caller())

    def reserve(self, owner: BaseCache, fd: int, nbytes: int) -> str | None:
        """Allocate the first ``nbytes`` of the new segment now (pages already written stay
        as they are): no SIGBUS mid-epoch. Returns why not where the filesystem cannot
        reserve ahead, else None; a full one raises ``CacheCapacityError``."""
        shm_dir = os.path.dirname(self.path)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise owner._capacity_error(shm_dir, os.fstat(fd).st_size,
                                            free_bytes(shm_dir)) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            return e.strerror
        return None

    def _init_file(self, owner: BaseCache, fd: int, head: dict, reserve: int | None = None
                   ) -> None:
        """Reserve the memory of a new segment (its first ``reserve`` bytes, default all),
        write its header, map it and let ``owner`` mark which indices have a slot here; the
        segment is ready (but not yet public) afterwards."""
        shm_dir, total = os.path.dirname(self.path), head["total_bytes"]
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, total)
        why = self.reserve(owner, fd, total if reserve is None else reserve)
        if why is not None:
            warnings.warn(f"{shm_dir} cannot reserve memory ahead (posix_fallocate: "
                          f"{why}); a full filesystem may raise SIGBUS later",
                          RuntimeWarning, stacklevel=5)
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        head.update(creator_pid=os.getpid(), creator_start=process_start(os.getpid()),
                    local_world_size=owner._world.local_world_size, attached=1, ready=0)
        _HEADER.pack_into(mm, 0, _MAGIC, *(head[f] for f in _HEADER_FIELDS))
        if owner._persistent:
            mm[KEY_OFF: KEY_OFF + len(owner._key.encode())] = owner._key.encode()
        for k, f in enumerate(owner._fields):
            _FIELD_RECORD.pack_into(mm, _FIELDS_OFF + k * _FIELD_RECORD.size, f.name.encode(),
                                    DTYPE_CODES[f.dtype][0], len(f.dims), f.offset,
                                    *(-1 if d is None else d for d in f.dims),
                                    *[0] * (_MAX_DIMS - len(f.dims)))
        self._take(fd, mm, total)
        owner._map(head)
        owner._mark_slots(head)
        struct.pack_into("<q", mm, _FIELD_OFFSET["ready"], 1)

    def _publish(self, owner: BaseCache, tmp: str, fd: int) -> None:
        """Give the finished segment its public name so the other local ranks can attach."""
        for _ in range(3):
            try:
                os.link(tmp, self.path)
                return
            except FileExistsError:
                pass
            if _held_here(self.path):  # a live cache of this very process: do not open it
                raise CacheConfigError(f"a live cache is already named {self.path} (in this "
                                       "process); pass a distinct name=", "name",
                                       owner._name, self.path)
            try:
                other = open_existing(self.path)
            except FileNotFoundError:
                continue
            try:
                stale = try_stale(other)
                if not stale:  # an attacher probing for staleness holds it for an instant
                    time.sleep(0.05)
                    stale = try_stale(other)
                if not stale:
                    raise CacheConfigError(
                        f"a live cache is already named {self.path}: another job or cache of "
                        "this job uses the same job_key and name. Pass a distinct name= (e.g. "
                        "'train' and 'val') or set STOCACHING_JOB_KEY per job",
                        "name", owner._name, self.path)
                st = os.fstat(other)
                unlink_if_same(self.path, st.st_ino, st.st_dev)  # left by a dead job
            finally:
                os.close(other)
        raise CacheConfigError(f"could not publish {self.path}: it keeps reappearing", "name",
                               owner._name, self.path)

    def _publish_pointer(self, owner: BaseCache, fd: int) -> None:
        """Name an anonymous segment for the other local ranks: a pointer file to it (section
        7) published as a segment is, and held with a shared flock until the name goes."""
        st, me = os.fstat(fd), os.getpid()
        tmp = f"{self.path}.{me}.{secrets.token_hex(4)}.init"
        pfd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
        pst = os.fstat(pfd)
        try:
            os.pwrite(pfd, POINTER.pack(_POINTER_MAGIC, me, process_start(me), fd,
                                        st.st_dev, st.st_ino), 0)
            fcntl.flock(pfd, fcntl.LOCK_SH)
            self._publish(owner, tmp, pfd)
        except BaseException:
            close_fd(pfd)
            raise
        finally:
            unlink_if_same(tmp, pst.st_ino, pst.st_dev)
        self.pointer_fd, self.name_id = pfd, (pst.st_dev, pst.st_ino)

    def attach(self, owner: BaseCache, timeout: float) -> None:
        """A local rank other than the leader: wait up to ``timeout`` s for the leader's
        segment, map it and count this rank in; the last rank to attach drops the name."""
        opened = open_leaders_file(self.path, timeout)
        if opened is None:
            raise CacheTimeoutError(
                f"local rank {owner._world.local_rank} waited {timeout:.0f} s for local rank "
                f"0 (the local leader) to create {self.path}, but it never arrived. Check "
                "that every local rank constructs its caches with the same arguments and in "
                "the same order, that rank 0 is alive, and that all ranks see the same "
                "STOCACHING_JOB_KEY", self.path, timeout)
        fd, name_id = opened
        try:
            head = self.map_existing(owner, fd)
            self.name_id = name_id
            self.lock(LOCK_BASE)
            try:
                attached = self.header_get("attached") + 1
                self.header_set("attached", attached)
            finally:
                self.unlock(LOCK_BASE)
            # All here: drop the name (a persistent cache keeps it: the next job attaches by it).
            if attached >= head["local_world_size"] and not head["persistent"]:
                dev, ino = self.name_id
                unlink_if_same(self.path, ino, dev)
        except BaseException:
            os.close(fd)
            raise
        self.finalizer = weakref.finalize(self, finalize_segment, fd, None, 0, 0)
        if head["persistent"]:  # (it may hold a past job's samples)
            self.populate(head["data_off"])

    def map_existing(self, owner: BaseCache, fd: int) -> dict:
        """Map a segment someone else made (by name, or a descriptor this process received),
        let ``owner`` check its header and build its views. Returns the header."""
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise CacheConfigError(f"{self.path} is too small to be a cache segment",
                                   "total_bytes", HEADER_BYTES, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        head = read_header(mm)
        if owner._slots_from_leader and 0 <= head["slots"] <= owner._layout.dataset_len:
            owner._layout = dataclasses.replace(owner._layout, slots=head["slots"])
        owner._check_header(head, size)
        self._take(fd, mm, head["total_bytes"])
        owner._map(head)
        return head

    # -- the header ------------------------------------------------------------------------

    def header_get(self, field: str) -> int:
        return struct.unpack_from("<q", self.mapping, _FIELD_OFFSET[field])[0]

    def header_set(self, field: str, value: int) -> None:
        struct.pack_into("<q", self.mapping, _FIELD_OFFSET[field], value)

    def _take(self, fd: int, mm: mmap.mmap, size: int) -> None:
        """Hold the descriptor and read-write mapping of the segment, and map it read-only."""
        self.fd, self.mapping, self.size = fd, mm, size
        st = os.fstat(fd)
        self.file_id = self.name_id = (st.st_dev, st.st_ino)  # (a pointer's name: its own)
        # A read-only mapping of the same pages backs the copy=False views (ReadOnlyView
        # refuses writes; one that got past it would crash, never change a cached sample).
        self.read_only_mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)

    # -- closing ----------------------------------------------------------------------------

    def stop_populating(self) -> None:
        """Stop mapping pages in, and wait for it: it reads the mapping's addresses."""
        thread, stop = self.populating or (None, None)
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            stop.set()
            thread.join()

    def unmap(self) -> None:
        """Unmap now, not when collected (a tensor the caller still holds keeps its pages)."""
        self.stop_populating()
        for mm in (self.mapping, self.read_only_mapping):
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()

    def close(self) -> None:
        """Close this process's descriptor: ``finalizer`` (the leader first waits for the
        local ranks still to attach, then drops the name), and let a holder go (``release``).
        Idempotent."""
        if self.finalizer is not None:
            self.finalizer()
        if self.release is not None:
            self.release()


# ----------------------------------------------------------------------------------------------
# 11. The cache contract: BaseCache (construction, views, sending, the public API)
# ----------------------------------------------------------------------------------------------


class BatchRows(NamedTuple):
    """Where the cached samples of a batch are (``SharedCache.locate``): for each position
    ``k`` of ``indices``, the row of ``SharedCache.rows`` holding its sample, whether one was
    found, and what ``confirm`` checks once the row is copied."""

    indices: np.ndarray  # the dataset indices (int64)
    rows: np.ndarray  # the row of cache.rows to copy for each (int64; 0 where not found)
    found: np.ndarray  # True where the row held the index's sample when located (bool)
    versions: np.ndarray  # the rows' sequence numbers when located (uint32)
    entries: np.ndarray  # the staging map entry of a staged sample, -1 for a slot (int64)


class BaseCache:
    """What every kind of cache offers: a segment of shared memory, one per node, shared by
    the local ranks and their DataLoader workers, holding one sample per dataset index.

    The kinds are :class:`SharedCache` (samples of a fixed size, in slots: stocaching 0.2.1's
    API, batches, staging, saving) and :class:`OpenSizeCache` (samples of varying sizes, a
    None in ``data_dims``, in an arena). Construct one of those; this class is what they
    share, and what the opt-in modules accept where any kind will do (``Prefetcher``,
    ``ReadyFirstSampler``, ``MixtureDataset``, ``CacheAwareSampler``).

    Every kind offers ``get_slot``, ``set_slot``, ``clear``, ``stats``, ``ready_mask``,
    ``unstage`` and ``read_tags`` (a kind without staging slots has nothing staged),
    ``aux_array``, ``cached_indices``, ``len(cache)``, ``dataset_len``, ``data_dims``,
    ``dtype``, ``fields``, ``world``, ``layout``, ``name``, ``close`` and ``with``; it goes to
    other processes as a shared tensor does, and ``copy.deepcopy`` makes a private copy. The
    processes, the concurrency contract and the common arguments are SharedCache's.

    A kind supplies its segment's parts after the aux array (``_offsets``, ``_map_samples``,
    ``_capacity_error``), the read of one sample (``_read``), ``set_slot``, ``clear`` and
    ``__deepcopy__``.
    """

    # -- state: every attribute a cache holds, by role (set in _configure, _map and
    # claim_stats_row; a closed cache's views are replaced by a Closed) ------------------
    # What it is: its configuration, the same in every process that holds it.
    _layout: CacheLayout  # which dataset indices have a slot on which node
    _world: World  # who this process is
    _name: str  # the cache's name within its job
    _path: str  # the segment's name in the shm directory (gone once every local rank holds it)
    _dataset_len: int
    _dims: Any  # data_dims as given (a dict of them for a cache of fields)
    _dtype: Any  # dtype as given (a dict of them for a cache of fields)
    _staging_slots: int
    _timeout: float  # how long a local rank waits for its leader's segment
    _fields: tuple = ()  # the fields of a sample (_FieldsCache, OpenSizeCache with a dict)
    _persistent = False  # a persistent cache (it outlives its job: keep=True)
    _key = ""  # the key of the data a persistent cache holds
    _on_mismatch = "raise"  # a persistent cache's, or a saved file's, other key or configuration
    _slots_from_leader = False  # size_limit_gib="auto" on a rank that is not the local leader
    _auto_sized = False  # size_limit_gib="auto" on the local leader: it said why, and what
    _anonymous = False  # the local leader makes it with memfd_create, not as a file in shm_dir
    _disk_tier: Any = None  # disk_tier._DiskTier: rows of the indices without a slot, on disk
    # The segment this process holds (descriptor, mappings, record locks), and views of its
    # pages, the same in every process (the hot path reads them).
    _segment: Segment
    _index_states: memoryview  # one state byte per dataset index (aux_array)
    _index_states_np: np.ndarray  # the same bytes, for numpy
    _slot_map: memoryview | None  # slot of each dataset index (a random subset), else None
    _staging: Any = None  # staging._StagingTable: what each staging slot holds (in the segment)
    _stats_rows: np.ndarray  # the counters of every process that used the cache
    # This process's own: made anew in a forked child (_after_fork).
    _own_counters: memoryview  # this process's row of _stats_rows
    _closed: bool
    _read_tags: frozenset = frozenset()  # the staging tags this process reads (prefetchers')
    # The read_tags this process set, with its pid: its stagers' (prefetchers'), whose staged
    # samples close() gives back. A forked child inherits them with its parent's pid, and a
    # process the cache is sent to gets none: neither gives back its parent's.
    _own_tags: tuple[int, frozenset] = (0, frozenset())
    # Process-wide: views.ReadOnlyView, looked up once, at the first read without a copy
    # (docs/design.md, "A read-only view": a lookup at each read cost a fifth of it).
    _view_type: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("BaseCache is what every kind of cache offers, not a cache: construct "
                        "a SharedCache (samples of a fixed size) or an OpenSizeCache (a None "
                        "in data_dims)")

    def _configure(self, dataset_len: int, *, world: Any, layout_seed: Any, random_subset: Any,
                   timeout: Any, persistent: Any, key: Any, on_mismatch: Any, name: Any,
                   job_key: Any, shm_dir: Any, load_from: Any,
                   layout: Any = None) -> tuple[World, str | None]:
        """Check the constructor's arguments that every kind takes (each kind checks its own
        first), and set who this process is, the cache's name, path, timeout and layout (0
        slots: the kind sizes it, then calls ``_open``). Returns the world and ``load_from``
        (None for a kind that loads no file) with ``{node}`` filled in."""
        world = World.discover() if world is None else world
        if not isinstance(world, World):
            raise TypeError(f"world should be a stocaching.World, but got world={world!r}")
        layout_seed = check_int("layout_seed", layout_seed, low=0, high=2**63 - 1)
        if not isinstance(random_subset, bool):
            raise TypeError(f"random_subset should be a bool, but got "
                            f"random_subset={random_subset!r}")
        timeout = check_positive("timeout", timeout, "seconds")
        if not isinstance(persistent, bool):
            raise TypeError(f"persistent should be a bool, but got persistent={persistent!r}")
        if load_from is not None:
            if not isinstance(load_from, (str, os.PathLike)):
                raise TypeError(f"load_from should be the path of a file that save() wrote, or "
                                f"None, but got load_from={load_from!r}")
            load_from = os.fspath(load_from).replace("{node}", str(world.node_rank))
            feature_module("saved")  # (its ImportError before anything is made)
        if persistent:
            feature_module("persistent")._check_persistent(name, job_key, key, on_mismatch)
            job_key = PERSISTENT_JOB_KEY
            self._persistent, self._key, self._on_mismatch = True, key, on_mismatch
        elif load_from is not None:
            check_key(key, on_mismatch)
            if key:  # (set on the instance only where it differs from the class's)
                self._key = key
            if on_mismatch != "raise":
                self._on_mismatch = on_mismatch
        elif key or on_mismatch != "raise":
            raise ValueError(f"key and on_mismatch are for a persistent cache (persistent=True) "
                             f"or one loaded from a file (load_from=), but got key={key!r}, "
                             f"on_mismatch={on_mismatch!r} with persistent=False")
        name = _check_name("name", name) if name is not None else f"c{next(_NAME_COUNTER)}"
        job_key = _check_name("job_key", job_key) if job_key is not None else _job_key(world)
        if job_key == PERSISTENT_JOB_KEY and not persistent:
            raise ValueError(f"job_key (or $STOCACHING_JOB_KEY) should not be "
                             f"{PERSISTENT_JOB_KEY!r}, the key of persistent caches, but got "
                             f"job_key={job_key!r} with persistent=False")
        shm_dir = shm_dir if shm_dir is not None else \
            os.environ.get("STOCACHING_SHM_DIR", DEFAULT_SHM_DIR)
        if not isinstance(shm_dir, (str, os.PathLike)) or not os.path.isdir(shm_dir):
            raise (ValueError if isinstance(shm_dir, (str, os.PathLike)) else TypeError)(
                f"shm_dir should be an existing directory on a tmpfs, but got shm_dir={shm_dir!r}")
        if layout is None:
            layout = CacheLayout(dataset_len, 0, world.num_nodes, layout_seed, random_subset)
        elif not isinstance(layout, CacheLayout):
            raise TypeError(f"layout should be a CacheLayout or None, but got layout={layout!r}")
        elif (layout.dataset_len, layout.num_nodes) != (dataset_len, world.num_nodes) or \
                layout_seed or random_subset:
            raise ValueError(f"layout should be one of dataset_len={dataset_len} over the "
                             f"world's num_nodes={world.num_nodes}, with no layout_seed or "
                             f"random_subset besides (the layout has its own), but got "
                             f"{layout!r} with layout_seed={layout_seed}, "
                             f"random_subset={random_subset}")
        self._layout = dataclasses.replace(layout, slots=0)
        self._world = world
        self._name = name
        self._path = os.path.join(os.fspath(shm_dir), _segment_name(job_key, world.node_rank,
                                                                    name))
        self._timeout = float(timeout)
        return world, load_from

    def _open(self, slots: int, dims: Any, dtype: Any, fields: tuple, staging: int,
              load_from: str | None) -> None:
        """Make the segment, with ``slots`` on this node (the local leader: filled from
        ``load_from`` if given), or attach to the leader's (the other local ranks)."""
        self._layout = dataclasses.replace(self._layout, slots=slots)
        self._dims, self._dtype, self._staging_slots = dims, dtype, staging
        if fields:  # (else the class's (): see _fields below)
            self._fields = fields
        self._segment = Segment(self._path)
        if not self._world.is_local_leader:
            self._segment.attach(self, self._timeout)
        elif self._persistent:
            feature_module("persistent").open_persistent(self._segment, self, load_from)
        elif _kept_for_restarts():
            feature_module("holder").open_kept(self._segment, self, load_from)
        else:
            self._segment.make(self, load_from)

    # -- construction ---------------------------------------------------------------------

    def _expected_header(self) -> dict:
        lay = self._layout
        one = () if self._fields else self._dims  # a fields cache: the field table instead
        h = {"version": LAYOUT_VERSION, "dataset_len": lay.dataset_len, "slots": lay.slots,
             "dtype_code": 0 if self._fields else DTYPE_CODES[self._dtype][0], "ndim": len(one),
             "num_nodes": lay.num_nodes, "node_rank": self._world.node_rank,
             "layout_seed": lay.seed, "random_subset": int(lay.random_subset),
             "persistent": int(self._persistent),
             "key_hash": hash_of_key(self._key) if self._persistent else 0,
             "uid": os.getuid(), "stats_rows": STATS_ROWS,
             "staging": self._staging_slots, "nfields": len(self._fields), "arena_bytes": 0,
             "arena_top": 0, "record_words": 0, "mean_bytes": 0, "arena_full": 0}
        for i in range(_MAX_DIMS):
            h[f"dim{i}"] = (-1 if one[i] is None else one[i]) if i < len(one) else 0
        h.update(self._offsets())
        return h

    def _describe(self) -> str:
        """The samples, for messages: "(3, 256, 256) uint8", or each field's."""
        if self._fields:
            return ", ".join(f"{f.name} {f.dims} {str(f.dtype).replace('torch.', '')}"
                             for f in self._fields)
        return f"{tuple(self._dims)} {str(self._dtype).replace('torch.', '')}"

    def _check_header(self, head: dict, size: int) -> None:
        want = self._expected_header()
        # A node's share is the same in a world of another number of nodes, unless a layout is
        # the first indices (one node, no random_subset): the segment of a job before a
        # resize serves this one (docs/design.md, "A node's share across a resize").
        prefix = head["num_nodes"] == 1 and (not head["random_subset"] or
                                             head["slots"] == head["dataset_len"])
        if not prefix and not self._layout.is_prefix:  # (several nodes: random_subset is moot)
            want.update(num_nodes=head["num_nodes"], random_subset=head["random_subset"])
        # One of them has fields (and the same layout version): compare those first, in order.
        if (head["nfields"] or self._fields) and head["version"] == LAYOUT_VERSION:
            theirs = [(n, d, t) for n, d, t, _ in head["fields"]]
            mine = [(f.name, f.dims, f.dtype) for f in self._fields]
            if not head["nfields"] or not self._fields or \
                    [(n, d) for n, d, _ in theirs] != [(n, d) for n, d, _ in mine]:
                label, exp = "data_dims", self._dims
                got: Any = {n: d for n, d, _ in theirs} if head["nfields"] else \
                    _head_dims(head)
            else:
                label, exp, got = "dtype", self._dtype, {n: t for n, _, t in theirs}
            if theirs != mine:
                order = " (the same fields in another order: another layout)" \
                    if isinstance(got, dict) and got == exp else ""
                raise CacheConfigError(
                    f"the cache {self._path} made by local rank 0 has {label}={got}, but this "
                    f"process asked for {label}={exp}{order}; construct the cache with the same "
                    "arguments on every local rank", label, exp, got)
        names = {"dataset_len": "dataset_len", "dtype_code": "dtype", "ndim": "data_dims",
                 "slots": "slot count (from size_limit_gib)", "num_nodes": "num_nodes",
                 "staging": "staging_slots",
                 "node_rank": "node_rank", "layout_seed": "layout_seed",
                 "random_subset": "random_subset", "persistent": "persistent",
                 "key_hash": "key (its hash)", "version": "version"}
        found = [(label, want[field], head[field]) for field, label in names.items()]
        if not self._fields:  # (a fields cache has ndim 0 and its dims in the field table)
            found.append(("data_dims", self._dims,  # after ndim: a damaged ndim is named first
                          _head_dims(head)))
        for label, exp, got in found:
            if got != exp:
                if label == "dtype":
                    exp, got = self._dtype, _DTYPE_BY_CODE.get(got, got)
                raise CacheConfigError(
                    f"the cache {self._path} made by local rank 0 has {label}={got}, but this "
                    f"process asked for {label}={exp}; construct the cache with the same "
                    "arguments on every local rank", label, exp, got)
        if not head["ready"] or head["total_bytes"] > size or \
                any(head[k] != want[k] for k in ("stats_off", "aux_off", "seq_off", "stage_off",
                                                 "map_off", "data_off", "total_bytes")):
            raise CacheConfigError(f"{self._path} is damaged or from another stocaching "
                                   "version", "layout", want["total_bytes"], head["total_bytes"])

    def _map(self, head: dict) -> None:
        """Build every view of the segment's mapping and claim this process's stats row."""
        global _FORK_HOOK_REGISTERED
        lay = self._layout
        mm = self._segment.mapping
        self._dataset_len = lay.dataset_len
        view = memoryview(mm)
        self._index_states_np = np.frombuffer(mm, np.uint8, lay.dataset_len, head["aux_off"])
        self._index_states = view[head["aux_off"]: head["aux_off"] + lay.dataset_len]
        if self._staging_slots:
            self._staging = feature_module("staging")._StagingTable(
                np.frombuffer(mm, np.int64, self._staging_slots, head["stage_off"]),
                self._segment)
        self._stats_rows = np.frombuffer(mm, np.int64, STATS_ROWS * STATS_COLS,
                                         head["stats_off"]).reshape(STATS_ROWS, STATS_COLS)
        if head["map_off"]:
            dt = _slot_map_dtype(lay)
            self._slot_map = view[head["map_off"]: head["map_off"] + dt.itemsize *
                                  lay.dataset_len].cast(dt.char)
        else:
            self._slot_map = None
        self._map_samples(head)
        self._closed = False
        self._claim_stats_row()
        _LIVE_CACHES.add(self)
        _sendable_by_multiprocessing(type(self))
        if not _FORK_HOOK_REGISTERED:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOK_REGISTERED = True

    def _mark_slots(self, head: dict) -> None:
        """In a new segment: mark the indices without a slot here, write the slot map, and
        free every staging slot."""
        lay = self._layout
        if self._slot_map is not None or lay.slots < lay.dataset_len:
            aux = self._index_states_np
            aux[:] = OOB
            held = lay.indices(self._world.node_rank)
            aux[held] = EMPTY
            if self._slot_map is not None:
                smap = np.frombuffer(self._segment.mapping, _slot_map_dtype(lay),
                                     lay.dataset_len, head["map_off"])
                smap[:] = -1
                smap[held] = np.arange(len(held))
        if self._staging_slots:
            self._staging.entries[:] = -1

    # -- this process's stats row -------------------------------------------------------

    def _claim_stats_row(self) -> None:
        """Give this process its own row of counters; fold rows of dead processes into row 0.
        Every handle of this process on the segment counts in one row (a process that receives
        the cache in each of its Pool tasks must not use up the rows)."""
        free = claim_stats_row(self._stats_rows, self._segment, LOCK_BASE, STATS_HITS, "cache")
        row_off = HEADER_BYTES + free * STATS_COLS * 8
        row = memoryview(self._segment.mapping)[row_off: row_off + STATS_COLS * 8]
        self._own_counters = row.cast("q")

    def _after_fork(self) -> None:
        """In a forked child (e.g. a DataLoader worker): fresh thread lock, own stats row."""
        self._segment.after_fork()
        if not self._closed:
            try:
                self._claim_stats_row()
            except Exception:  # never break the child over statistics
                self._own_counters = memoryview(bytearray(STATS_COLS * 8)).cast("q")
            if self._disk_tier is not None:
                self._disk_tier.after_fork()

    # -- sending to another process, and copying -------------------------------------------
    #
    # A cache travels to another process the way a shared tensor does: through
    # multiprocessing's own pickler (what a process start, Pool tasks and results, Queue and
    # Pipe use, in the standard library and in torch.multiprocessing), which hands the receiver
    # a duplicate of the segment's descriptor, so the receiver maps the same memory. While a
    # process starts, the duplicate goes with the start; on the channel of a running process,
    # multiprocessing's resource sharer keeps it in this process until the receiver takes it
    # (or this process exits). Plain pickle has no way to hand over a descriptor, so
    # pickle.dumps and torch.save are refused rather than giving a pickle nobody can load.

    # What a process that receives the cache needs to map it (see _rebuild_cache).
    _STATE = ("_layout", "_world", "_dims", "_dtype", "_name", "_path", "_staging_slots",
              "_fields", "_read_tags")

    # (The class-level defaults among the state declared at the top of the class are set on
    # the instance only where they differ; how many attributes an instance holds made no
    # difference to a hit on CPython 3.11: docs/design.md, "Instance attributes".)

    def _reduce_for_process(self) -> tuple:
        """What multiprocessing's pickler sends: a duplicate of the descriptor and the
        configuration (registered for each cache class by ``_sendable_by_multiprocessing``)."""
        if self._closed:
            raise ValueError(f"a closed {_public_name(type(self))} cannot be sent to another "
                             "process")
        from multiprocessing.reduction import DupFd

        state = {k: getattr(self, k) for k in self._STATE}
        if self._persistent or self._key:  # (on the instance only where not the class's)
            state.update(_persistent=self._persistent, _key=self._key)
        if self._disk_tier is not None:  # (it sends a duplicate of its own descriptor)
            state.update(_disk_tier=self._disk_tier)
        return _rebuild_cache, (DupFd(self._segment.fd), type(self), state)

    def __reduce__(self) -> tuple:
        # Reached by picklers other than multiprocessing's (which looks up the registered
        # reducer first): allowed only while a process starts, when the start carries the
        # descriptor, as it did for picklers that wrap multiprocessing's start.
        from multiprocessing import context

        if context.get_spawning_popen() is None:
            raise TypeError(
                "a SharedCache can be pickled only by multiprocessing (starting a process, "
                "Pool tasks and results, Queue, Pipe; torch.multiprocessing and DataLoader "
                "workers included), which shares it with the receiver; pickle.dumps, "
                "torch.save or another pickler (Ray's, sending a train_loop_config) would give "
                "a pickle that no other process can load. To pickle a Dataset that holds one, "
                "leave the cache out in __getstate__ and create it at first use in the "
                "process that reads it (a property that builds it while it is None), not in "
                "__setstate__: a framework may unpickle copies in processes that never read "
                "them (Ray does, in its controller), and each would build a cache of its own. "
                "Under Ray Train, build the Dataset inside train_loop_per_worker. "
                "copy.copy(cache) is the same cache, copy.deepcopy(cache) a private copy")
        return self._reduce_for_process()

    def __copy__(self) -> "BaseCache":
        """A shallow copy is the cache itself: a handle on shared memory, like a file."""
        return self

    # -- the public API -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise closed_error(type(self))

    @property
    def aux_array(self) -> torch.Tensor:
        """State of every dataset index, a uint8 tensor of shape ``(dataset_len,)`` in shared
        memory: 0 empty, 1 set, 2 out of bounds (no slot on this node), 3 being written."""
        self._check_open()
        return torch.from_numpy(self._index_states_np)

    @property
    def dataset_len(self) -> int:
        """Number of samples in the full dataset."""
        return self._layout.dataset_len

    @property
    def data_dims(self) -> Any:
        """Shape of one sample (a tuple); with fields, a dict of the shape of each field."""
        return self._dims

    @property
    def dtype(self) -> Any:
        """dtype of the samples; with fields, a dict of the dtype of each field."""
        return self._dtype

    @property
    def fields(self) -> tuple[str, ...]:
        """Names of the fields of a sample, in their order; ``()`` for one tensor a sample."""
        return tuple(f.name for f in self._fields)

    @property
    def world(self) -> World:
        """Who this process is (rank, local rank, node)."""
        return self._world

    @property
    def layout(self) -> CacheLayout:
        """Which dataset indices each node caches."""
        return self._layout

    @property
    def name(self) -> str:
        """Name of the cache within its job."""
        return self._name

    @property
    def staging_slots(self) -> int:
        """Staging slots of the node's cache, shared by its local ranks (0: none)."""
        return self._staging_slots

    # Whether set_slot may decline a sample for lack of room (a cache of open sizes, whose
    # arena can fill up): the fixed-size caches store every sample that has a slot.
    may_refuse: bool = False

    def __len__(self) -> int:
        return self._layout.slots

    def _oob_error(self, idx: int) -> IndexError:
        return IndexError(f"idx={idx} has no slot in this cache ({len(self)} slots for "
                          f"{self._dataset_len} samples) and allow_oob_idx=False")

    def _index(self, idx: Any) -> int:
        """``idx`` as a dataset index, an int in ``[0, dataset_len)``, or raise naming it. (The
        get_slots test for an int in range before they call it: on a hit the call would cost
        a tenth of the read.)"""
        if type(idx) is int and 0 <= idx < self._dataset_len:
            return idx
        if not is_int(idx):
            raise TypeError(f"idx should be an int in [0, {self._dataset_len - 1}] (a dataset "
                            f"index), but got idx={idx!r} of type {type(idx).__name__}")
        i = int(idx)
        if not 0 <= i < self._dataset_len:
            raise IndexError(f"idx should be a dataset index in [0, {self._dataset_len - 1}], "
                             f"but got idx={i}")
        return i

    def get_slot(self, idx: int, allow_oob_idx: bool = True, allow_empty_slot: bool = True, *,
                 copy: bool = True) -> Any:
        """The cached sample of dataset index ``idx``, or None if it is not cached: a tensor
        (with fields, a dict ``{field: tensor}``; with open sizes, in its own sizes).

        Args:
            idx: dataset index (int, numpy or torch integer scalar) in ``[0, dataset_len)``.
            allow_oob_idx: when False, an index without a slot on this node raises
                IndexError instead of returning None. Default: True.
            allow_empty_slot: when False, an index whose slot is empty (or being written)
                raises RuntimeError instead of returning None. Default: True.
            copy: when True, return a new tensor that the caller owns. When False, return a
                view of the shared slot (no copy). Default: True.

        .. warning::
            With ``copy=False`` the returned tensor is a :class:`ReadOnlyView` of the
            segment's read-only mapping: an operation that would write into it (``add_``,
            ``x[0] = v``, ``+=``, ``out=``) raises RuntimeError and changes nothing, and a
            later overwrite or ``clear()`` changes what it shows. Use it only where the
            sample is copied anyway (e.g. collated, or ``.float()``) before any transform.

        Raises:
            IndexError: ``idx`` outside the dataset, or without a slot and not allow_oob_idx.
            TypeError: ``idx`` is not an integer (bool and float included).
            RuntimeError: the slot is empty and not allow_empty_slot.
        """
        if type(idx) is not int or idx < 0 or idx >= self._dataset_len:
            idx = self._index(idx)
        if self._index_states[idx] == SET:
            out = self._read(idx, copy)
            if out is None:
                out = self._read_again(idx, copy)
            if out is not None:
                return out
        elif self._index_states[idx] == OOB and (self._staging_slots or self._disk_tier):
            out = self._read_oob(idx)
            if out is not None:
                return out
        return self._miss(idx, allow_oob_idx, allow_empty_slot, copy)

    def _read_oob(self, idx: int) -> Any:
        """The sample of an index without a slot here, if one is staged (else None); a kind
        with a disk tier looks there too."""
        return self._take_staged(idx) if self._staging_slots else None

    def _view_of(self, sample: Any) -> Any:
        """``sample`` (a tensor viewing the read-only mapping, or a dict of them) as what
        ``get_slot(copy=False)`` returns: ``ReadOnlyView``s (views.py)."""
        kind = BaseCache._view_type
        if kind is None:
            kind = self._view_kind()
        if type(sample) is dict:
            return {name: t.as_subclass(kind) for name, t in sample.items()}
        return sample.as_subclass(kind)

    @staticmethod
    def _view_kind() -> type:
        """views.ReadOnlyView, looked up once: at the first read without a copy, a hit or a
        miss, so that a missing views.py is an ImportError at the first call, not at a hit."""
        kind = BaseCache._view_type = feature_module("views").ReadOnlyView
        return kind

    def _read_again(self, idx: int, copy: bool) -> Any:
        """A read that met a writer: yield the CPU and try twice more while the slot is set."""
        for _ in range(2):
            time.sleep(0)
            if self._index_states[idx] != SET:
                return None
            out = self._read(idx, copy)
            if out is not None:
                return out
        return None

    def _miss(self, idx: int, allow_oob_idx: bool, allow_empty_slot: bool,
              copy: bool = True) -> None:
        if not copy and BaseCache._view_type is None:
            self._view_kind()
        if self._index_states[idx] == OOB:
            if not allow_oob_idx:
                raise self._oob_error(idx)
            self._own_counters[STATS_OOB_MISSES] += 1
        elif not allow_empty_slot:
            raise RuntimeError(f"the slot of idx={idx} is empty (or being written) and "
                               "allow_empty_slot=False")
        self._own_counters[STATS_MISSES] += 1
        return None

    def set_slot(self, idx: int, value: Any, allow_oob_idx: bool = True,
                 allow_overwrite: bool = False, *, exist_ok: bool = False) -> None:
        """Store ``value`` as the sample of dataset index ``idx``: each kind's (see
        ``SharedCache.set_slot``, ``OpenSizeCache.set_slot``)."""
        raise NotImplementedError

    def clear(self) -> None:
        """Empty every index: each kind's. Safe while other processes read (they see
        misses) or write (they finish first)."""
        raise NotImplementedError

    @property
    def read_tags(self) -> frozenset:
        """The staging tags whose staged samples this process's reads take (staging.py);
        empty: any. Each ``Prefetcher`` adds its own, and the set travels to workers."""
        return self._read_tags

    @read_tags.setter
    def read_tags(self, tags: Any) -> None:
        if isinstance(tags, (str, bytes)) or not hasattr(tags, "__iter__"):
            raise TypeError(f"read_tags should be a set of ints in [0, {MAX_STAGE_TAG}], but "
                            f"got read_tags={tags!r}")
        self._read_tags = frozenset(check_int("read_tags", t, low=0, high=MAX_STAGE_TAG)
                                    for t in tags)
        self._own_tags = (os.getpid(), self._read_tags)

    def _take_staged(self, idx: int) -> Any:
        """The staged sample of ``idx`` (its staging slot freed), or None. A kind with staging
        slots reads them here; one without has nothing staged."""
        return None

    # -- in feature modules: which indices it holds (masks.py), and a stager's reads and
    # give-backs (staging.py) --

    cached_indices = _FromFeature("masks")
    owner_rows = _FromFeature("masks")
    slot_mask = _FromFeature("masks")
    stored_mask = _FromFeature("masks")
    ready_mask = _FromFeature("masks")
    read_tier = _FromFeature("staging")
    unstage = _FromFeature("staging")

    def stats(self, *, since: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Counters summed over every process that used this cache on this node.

        Args:
            since: an earlier ``stats()`` of this cache: the counters (and ``hit_rate``) are
                then those of the time between the two, e.g. of one epoch::

                    before = cache.stats()
                    train_one_epoch()
                    print(cache.stats(since=before)["hit_rate"])

                Default: None, counters since the cache was made.

        Returns:
            A dict with ``hits``, ``misses`` (get_slot returned None), ``oob_misses`` (of
            those, indices without a slot here), ``writes`` (set_slot calls that stored, or
            found the same value there already),
            ``staged_hits`` (of the hits, staged samples taken), ``stages`` (samples staged),
            ``full`` (an ``OpenSizeCache``'s only: writes that found no room in the arena),
            ``disk_hits`` (of the hits, rows read from the disk tier), ``disk_writes`` (rows
            written there), ``disk_reads`` (rows read there by ``read_tier``, for a stager:
            not hits), ``disk_rows`` (rows stored there now), ``disk_tier_rows`` (rows it has
            room for; all five 0 without a disk tier),
            ``filled`` (slots set now), ``slots``, ``dataset_len``, ``bytes`` (size of the
            segment), ``staging_slots``, ``staged`` (samples staged now), ``hit_rate`` (hits /
            reads, nan without reads) and ``processes`` (live processes that have used it).
        """
        self._check_open()
        counters = ("hits", "misses", "oob_misses", "writes", "staged_hits", "stages")
        if since is not None and (not isinstance(since, Mapping) or
                                  not all(is_int(since.get(k)) for k in counters)):
            raise TypeError(f"since should be a dict from this cache's stats(), but got "
                            f"since={since!r}")
        self._segment.lock(LOCK_BASE)
        try:
            rows = self._stats_rows.copy()
        finally:
            self._segment.unlock(LOCK_BASE)
        counts = dict(zip(counters, (int(x) for x in rows[:, STATS_HITS:STATS_STAGES + 1].sum(0))))
        disk = self._disk_tier.stats() if self._disk_tier is not None else dict.fromkeys(
            ("disk_hits", "disk_writes", "disk_reads", "disk_rows", "disk_tier_rows"), 0)
        counts.update({k: disk.pop(k) for k in ("disk_hits", "disk_writes", "disk_reads")})
        counts["hits"] += counts["disk_hits"]  # (a tier hit is counted by the tier alone)
        if since is not None:
            counts = {k: v - int(since.get(k, 0)) for k, v in counts.items()}
        reads = counts["hits"] + counts["misses"]
        return {**counts, **disk, "filled": int(np.count_nonzero(self._index_states_np == SET)),
                "slots": len(self), "dataset_len": self._dataset_len, "bytes": self._segment.size,
                "staging_slots": self._staging_slots,
                "staged": self._staging.count() if self._staging_slots else 0,
                "hit_rate": counts["hits"] / reads if reads else float("nan"),
                "processes": sum(process_alive(int(p), int(t))
                                 for p, t in rows[1:, :STATS_START + 1] if p)}

    def close(self) -> None:
        """Release this process's handle on the segment. Other processes keep theirs; the
        memory is freed by the kernel when the last one is gone. Idempotent.

        Staging slots holding samples staged under the ``read_tags`` set in this process
        (its prefetchers') are freed first: nothing could give them back through a closed
        handle, and the other local ranks share the staging area."""
        if getattr(self, "_closed", True):
            return
        self._free_own_staging()
        if self._disk_tier is not None:
            self._disk_tier.close()
        self._unmap()
        self._segment.close()

    def _free_own_staging(self) -> None:
        (pid, tags), self._own_tags = self._own_tags, BaseCache._own_tags
        if pid != os.getpid() or not tags or not self._staging_slots:
            return
        with contextlib.suppress(OSError):  # (the descriptor closed at exit: nothing to do)
            self._staging.drop_tags_at_close(tags)

    def _unmap(self) -> None:
        """Drop every view of the segment and unmap it now rather than when the object is
        collected (a Dataset keeps its closed cache). A tensor the caller still holds
        (``array``, ``aux_array``, a copy=False view) keeps its mapping until it goes."""
        closed = Closed(type(self))
        self._closed = True
        _LIVE_CACHES.discard(self)
        self._segment.stop_populating()  # (it reads the mapping's addresses: they stay mapped)
        self._index_states = self._index_states_np = closed  # type: ignore
        self._own_counters = self._stats_rows = closed  # type: ignore
        self._slot_map = self._staging = closed  # type: ignore
        self._segment.unmap()

    def __enter__(self) -> "BaseCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        release = getattr(getattr(self, "_segment", None), "release", None)
        if exc[0] is not None and release is not None:
            release.detach()  # a failing block under torchrun's agent: kept for its restart
        self.close()

    def __repr__(self) -> str:
        state = "closed" if getattr(self, "_closed", True) else f"{len(self)} slots"
        kind = "SharedCache" if isinstance(self, SharedCache) else "OpenSizeCache"
        return (f"{kind}(name={self._name!r}, dataset_len={self._layout.dataset_len}, "
                f"data_dims={self._dims}, dtype={self._dtype}, {state}, "
                f"node={self._world.node_rank})")


# ----------------------------------------------------------------------------------------------
# 12. Fixed-size rows: SharedCache (the hit path, batches, writes, staging, saving)
# ----------------------------------------------------------------------------------------------


class SharedCache(BaseCache):
    """A cache of fixed-shape samples in shared memory, one per node, for PyTorch datasets.

    A drop-in superset of stocaching 0.2.1's ``SharedCache``: same positional arguments, same
    sizing rule, same ``array`` / ``aux_array`` / ``get_slot`` / ``set_slot`` / ``clear``.
    It offers all that :class:`BaseCache` offers, and batches (``get_batch``; ``locate``,
    ``rows``, ``confirm``), staging slots (``stage``), raw slot access (``array``,
    ``cache[s]``) and saving (``save``, ``load_from``). Samples whose sizes vary (a None in
    ``data_dims``) go in an :class:`OpenSizeCache`.

    Sizing: if the whole dataset (slots plus one aux byte per sample) fits in ``size_limit_gib``,
    every index gets a slot; otherwise ``int((limit - dataset_len) / slot_bytes)`` of them do and
    the rest are out of bounds (OOB): ``get_slot`` returns None for them and ``set_slot`` ignores
    them. The segment adds a 4 KiB header, a 64 KiB stats table, 4 bytes per slot (write
    sequence numbers) and, with several nodes or ``random_subset``, a 4-byte slot map entry
    per sample on top of that budget. With one node the first ``len(cache)`` indices get slots
    (as in 0.2.1), or a random subset with ``random_subset=True``; with several, each node
    caches a random subset given by :class:`CacheLayout`.

    Processes: in a job launched by ``torchrun`` (or SLURM), the local leader (LOCAL_RANK 0)
    creates the segment and the other local ranks attach to it, checking that dataset_len,
    data_dims, dtype and slot count match. Construct it with the same arguments on every local
    rank, in the same order as any other cache. DataLoader workers (fork, spawn, forkserver,
    persistent or not) get the cache with the dataset and share it. The segment's name is
    removed as soon as every local rank has attached, so the memory is freed when the last
    process using it exits, even by SIGKILL. A leader that closes the cache (or exits) before
    every local rank has attached waits for them, up to ``timeout``.

    Concurrency contract: any number of processes and threads may call ``get_slot``,
    ``set_slot``, ``clear`` and ``stats`` at the same time. ``get_slot`` takes no lock and makes
    no system call; it returns either a consistent copy of a completely written slot or a miss
    (None), never a half-written slot. Writers of one slot are serialised by a per-slot lock
    that the kernel releases if the writer dies; a slot whose writer died mid-write reads as
    empty and can be written again. The per-process counters behind ``stats`` may lose an
    increment when several threads of one process read at once. The reader's check relies on
    the CPU keeping loads and stores in order (x86-64); on weakly ordered CPUs (ARM64) a read
    racing a write of the same slot is not guaranteed to be caught (untested there).

    Args:
        size_limit_gib: budget in GiB (int or float) for the slots and the aux array; or
            ``"auto"``: what the whole dataset needs, or less if /dev/shm or the memory cannot
            hold it: it leaves /dev/shm a headroom for its other users (``SHM_HEADROOM_BYTES``)
            and the memory a margin (``RAM_MARGIN_BYTES``); the memory is the RAM, or a memory
            cgroup's limit where one applies (a container's, a SLURM job's), decided once by
            the local leader and logged with its numbers; the other local ranks take the
            leader's slot count. With ``disk_tier``, the tier takes the rest. A budget more
            than a memory limit leaves free raises ``CacheCapacityError`` before anything is
            made; one that leaves less than the margin or the headroom warns.
            ``"auto"`` is for one node, samples of fixed size and a cache that is not
            persistent.
        dataset_len: number of samples in the full dataset.
        data_dims: shape of one sample, e.g. ``(3, 256, 256)``; or, for samples of several
            tensors, a dict of 1 to 16 fields ``{name: shape}`` (``()`` for a scalar), e.g.
            ``{"image": (3, 256, 256), "label": ()}``: then ``set_slot`` takes a dict with
            those keys, ``get_slot`` returns one and ``get_batch`` a dict of batches. The
            fields are packed in one slot in this order, each at a multiple of its itemsize.
            (A None, an open size, is for an ``OpenSizeCache``: here a TypeError says so.)
        dtype: torch dtype of the samples; any fixed-size dtype. With fields: one dtype for
            all of them, or a dict with the keys of ``data_dims``, in its order, e.g.
            ``{"image": torch.uint8, "label": torch.int64}``. Default: ``torch.uint8``.
        name: name of this cache within the job, to tell several caches apart (e.g.
            ``"train"``, ``"val"``). Default: ``"c<k>"`` for the k-th cache this process makes,
            which matches across ranks that make their caches in the same order.
        job_key: key shared by the local ranks of one job. Default: ``$STOCACHING_JOB_KEY``, or
            derived from the launcher (the parent pid and torchrun/SLURM variables); under
            other variables (Lightning's launcher) local rank 0's, sent through the process
            group (a collective), and without one a ``RuntimeError`` at once.
        world: who this process is. Default: ``World.discover()`` (the launcher's variables,
            or an initialised process group).
        shm_dir: directory of a tmpfs to put the segment in (elsewhere: a RuntimeWarning).
            Default: ``$STOCACHING_SHM_DIR`` or ``/dev/shm``.
        layout_seed: seed of the layout's permutation (all nodes must agree). Default: 0.
        random_subset: with one node, give slots to a random subset of the indices (drawn
            from ``layout_seed``) rather than to the first ``len(cache)``, as several nodes
            always do. Pass True when the dataset is ordered (by class, as ImageFolder orders
            it) and a cache-preferring order reads it (``ReadyFirstSampler``, a ``Prefetcher``
            with a ``window``): with the first indices cached, the cached samples are the first
            classes, and preferring them puts those classes first in every epoch. It costs a
            4-byte slot map entry per sample on top of the budget, as with several nodes.
            Default: False (0.2.1's layout: index ``i < len(cache)`` has slot ``i``).
        timeout: seconds a non-leader waits for the leader's segment, and seconds the leader,
            when it closes the cache (or exits) before every local rank has attached, waits
            for them. Default: 300.
        staging_slots: slots where a prefetcher holds samples of indices without a slot
            until they are read once, paid from ``size_limit_gib`` first (staging.py).
            Default: 0.
        persistent: keep the cache after the job under ``name``, for the next job that asks
            for it (persistent.py). Default: False (freed with the job's last process).
        key: with ``persistent`` or ``load_from``: which data the cache holds, checked when a
            job attaches to it or loads a file. Default: "".
        on_mismatch: with ``persistent`` or ``load_from``, when the cache or file holds
            another key or configuration: ``"raise"`` or ``"replace"`` (persistent.py).
            Default: "raise".
        load_from: a file that ``save`` wrote, which fills the new segment (saved.py).
            Default: None.
        disk_tier: a directory on local disk for a second tier behind the segment, holding
            the samples of the indices without a slot (disk_tier.py). Default: None.
        disk_tier_gib: the disk tier's budget in GiB (disk_tier.py). Default: None, a row for
            every index of the node's share.
        layout: which indices each node caches, for a source that knows which samples each
            node reads (``CachedStream`` passes the shards each node streams): a
            ``CacheLayout`` of ``dataset_len`` over the world's nodes, whose ``slots`` the
            budget sets; ``layout_seed`` and ``random_subset`` then stay at their defaults.
            Default: None, ``CacheLayout(dataset_len, slots, num_nodes, layout_seed,
            random_subset)``.

    Raises:
        CacheCapacityError: the tmpfs has not enough free space (nothing is left behind).
        CacheConfigError: the leader's segment (or the ``load_from`` file) has another
            configuration.
        CacheFileError: the ``load_from`` file is truncated, damaged or not a saved cache.
        CacheTimeoutError: a non-leader waited ``timeout`` seconds for the leader.
        RuntimeError: the local ranks have no way to agree on a job key (see ``job_key``).
        PermissionError: a file under the segment's name is not ours or not private.
        OSError, ValueError: a ``disk_tier`` that cannot be used (disk_tier.py).
    """

    # -- state: BaseCache's, and its views of the slots (set in _map_samples / _map_slots) --
    _slot_samples: np.ndarray  # the slots' bytes, one row a slot
    _array: torch.Tensor  # the slots as samples (the 0.2.1 name: what get_slot copies from)
    _read_only_slots: torch.Tensor  # the same through the read-only mapping (copy=False)
    _slot_versions: memoryview  # each slot's sequence number: odd while it is written
    _slot_versions_np: np.ndarray  # the same, for numpy
    _view_as: torch.dtype | None  # bfloat16, whose slots are stored as int16
    _fast_dtype: torch.dtype | None  # the dtype the hit path copies as, where one is exact
    _packs_fields = False  # fields._FieldsCache: the fields of a sample packed in a slot
    # This process's own: what it knows of the file it saved to or loaded from last (a
    # process the cache is sent to knows none, and writes its first save anew).
    _saved_file: Any = None  # saved._SaveState

    def __new__(cls, size_limit_gib: Any = None, dataset_len: Any = None, data_dims: Any = None,
                *args: Any, **kwargs: Any) -> "SharedCache":
        """A dict ``data_dims`` (several fields a sample) makes a ``_FieldsCache``, the
        SharedCache whose slot holds the fields packed: its reads and writes of a slot are its
        own, so that the single-tensor hit path has no branch for fields. It offers all that
        SharedCache offers."""
        if cls is SharedCache and isinstance(data_dims, Mapping):
            cls = feature_module("fields")._FieldsCache
        return super().__new__(cls)

    def __init__(self, size_limit_gib: float | str, dataset_len: int,
                 data_dims: Sequence[int] | Mapping[str, Sequence[int]],
                 dtype: torch.dtype | Mapping[str, torch.dtype] = torch.uint8, *,
                 name: str | None = None, job_key: str | None = None,
                 world: World | None = None, shm_dir: str | None = None, layout_seed: int = 0,
                 random_subset: bool = False, timeout: float = 300.0, staging_slots: int = 0,
                 persistent: bool = False, key: str = "", on_mismatch: str = "raise",
                 load_from: str | os.PathLike | None = None,
                 disk_tier: str | os.PathLike | None = None,
                 disk_tier_gib: float | None = None,
                 layout: CacheLayout | None = None) -> None:
        if disk_tier is not None or disk_tier_gib is not None:
            disk_tier, disk_tier_gib = feature_module("disk_tier")._check_disk_tier(disk_tier,
                                                                                    disk_tier_gib)
        auto = isinstance(size_limit_gib, str) and size_limit_gib == "auto"
        if not auto:
            size_limit_gib = check_positive("size_limit_gib", size_limit_gib, "GiB or 'auto'")
        dataset_len = check_int("dataset_len", dataset_len, low=1)
        if isinstance(data_dims, Mapping):
            fields, slot_bytes = feature_module("fields").check_fields(data_dims, dtype)
            dims: Any = {f.name: f.dims for f in fields}
            dtype = {f.name: f.dtype for f in fields}
        else:
            dims, dtype, fields = check_dims(data_dims), check_dtype(dtype), ()
            slot_bytes = 0 if None in dims else bytes_per_slot(dims, dtype)
        if has_open_size(dims):
            raise TypeError(f"data_dims with a None (an open size) make a cache of samples of "
                            f"their own sizes: construct it as OpenSizeCache(size_limit_gib, "
                            f"dataset_len, data_dims, ...); SharedCache takes fixed sizes, but "
                            f"got data_dims={dims}")
        if self._packs_fields != bool(fields):  # SharedCache.__new__ chose the class
            raise TypeError(f"construct the cache as SharedCache(...), not as "
                            f"{type(self).__name__}(...)")
        world, load_from = self._configure(
            dataset_len, world=world, layout_seed=layout_seed, random_subset=random_subset,
            timeout=timeout, persistent=persistent, key=key, on_mismatch=on_mismatch,
            name=name, job_key=job_key, shm_dir=shm_dir, load_from=load_from, layout=layout)
        shm_dir = os.path.dirname(self._path)
        staging = check_int("staging_slots", staging_slots, low=0)
        staging_checks = feature_module("staging").check_staging_slots if staging else None
        if auto:
            if persistent:
                raise ValueError("size_limit_gib='auto' cannot make a persistent cache: the size "
                                 "it finds depends on what is free at the time, so the next job "
                                 "would ask for another slot count than the cache it should "
                                 "attach to; pass a number, but got size_limit_gib='auto' with "
                                 "persistent=True")
            if world.num_nodes > 1:
                raise ValueError(f"size_limit_gib='auto' is for one node: each node would choose "
                                 f"its own size, and the {world.num_nodes} nodes' layouts must "
                                 "agree; pass a number (python -m stocaching plan sizes it), but "
                                 "got size_limit_gib='auto'")
            if world.is_local_leader:
                # In /dev/shm's filesystem, the segment of "auto" is anonymous: it leaves all
                # of /dev/shm to the DataLoader's batches (docs/design.md, "An anonymous
                # segment for 'auto'"); a directory of the caches' own is sized as it is.
                self._auto_sized = True
                self._anonymous = auto_is_anonymous(shm_dir)
                size_limit_gib = _auto_budget(dataset_len, slot_bytes, staging, shm_dir,
                                              self._layout, disk_tier is not None,
                                              world.local_world_size, self._anonymous)
            else:  # the leader decides; this rank takes the slot count of its segment
                self._slots_from_leader = True
                size_limit_gib = budget_for_slots(0, dataset_len, slot_bytes, staging) + \
                    slot_bytes / BYTES_PER_GIB
        slots = slots_for_budget(size_limit_gib, dataset_len, slot_bytes, staging)
        if staging_checks:
            staging_checks(staging, dataset_len, slot_bytes, slots, None if auto else
                           size_limit_gib, world.is_local_leader)
        if slots == 0 and not auto:  # ("auto" says why itself)
            warnings.warn(f"size_limit_gib={size_limit_gib} leaves no slots: the aux array alone "
                          f"needs {fmt_bytes(dataset_len)} and a slot {fmt_bytes(slot_bytes)}"
                          + (f" (after {staging} staging slots)" if staging else "") +
                          "; only staged samples can hit", RuntimeWarning, stacklevel=2)
        self._open(slots, dims, dtype, fields, staging, load_from)
        if disk_tier is not None:
            try:
                self._disk_tier = feature_module("disk_tier")._DiskTier.open(self, disk_tier,
                                                                             disk_tier_gib)
            except BaseException:
                self.close()
                raise

    # -- the hit path (get_slot, and the one read of a row) --------------------------------

    def get_slot(self, idx: int, allow_oob_idx: bool = True, allow_empty_slot: bool = True, *,
                 copy: bool = True) -> torch.Tensor | None:
        """The cached sample of dataset index ``idx`` (a copy, or with ``copy=False`` a
        read-only view), or None if it is not cached: ``BaseCache.get_slot`` (its arguments,
        warning and errors), with its first read inlined."""
        if type(idx) is not int or idx < 0 or idx >= self._dataset_len:
            idx = self._index(idx)
        if self._index_states[idx] == SET:  # the hit path: no lock, no system call
            # The first try is _read and _read_row inlined, the one copy of them (else this is
            # BaseCache.get_slot): the two calls cost more than 5 % of a small hit (docs/design.md,
            # "get_slot's inlined read"), and tests/test_concurrency.py checks that the two give the
            # same answer whatever write or clear() lands before any of their reads.
            slot = idx if self._slot_map is None else self._slot_map[idx]
            seq = self._slot_versions[slot]
            if not seq & 1:
                out = torch.from_numpy(self._slot_samples[slot].copy()) if copy \
                    else self._view_of(self._read_only_slots[slot])
                if self._index_states[idx] == SET and self._slot_versions[slot] == seq:
                    self._own_counters[STATS_HITS] += 1
                    return out if self._view_as is None or not copy else out.view(self._view_as)
            out = self._read_again(idx, copy)
            if out is not None:
                return out
        elif self._index_states[idx] == OOB and (self._staging_slots or self._disk_tier):
            out = self._read_oob(idx)
            if out is not None:
                return out
        return self._miss(idx, allow_oob_idx, allow_empty_slot, copy)

    def _read_oob(self, idx: int) -> Any:
        """The sample of an index without a slot here: staged, or on the disk tier (a new
        tensor, whatever ``copy`` asked: the row was read from the file), or None."""
        out = self._take_staged(idx) if self._staging_slots else None
        if out is None and self._disk_tier is not None:
            row = self._disk_tier.read(idx)  # (counted there: stats() adds its hits to ours)
            out = None if row is None else self._from_row(row)
        return out

    def _read(self, idx: int, copy: bool) -> Any:
        """The sample in the slot of ``idx`` (a copy, or with ``copy=False`` a read-only view),
        read with ``_read_row`` and counted as a hit; or None."""
        slot = idx if self._slot_map is None else self._slot_map[idx]
        row = self._read_row(slot, copy, self._index_states, idx, SET)
        if row is None:
            return None
        self._own_counters[STATS_HITS] += 1
        return self._from_row(row) if copy else row

    def _read_row(self, row: int, copy: bool, marks: Any, at: int, mark: int) -> Any:
        """The seqlock read of one row (a slot or a staging slot): every read of a row of a
        fixed size is this one, or, for many rows at once, ``_locate`` and ``_confirm``.

        The row's sequence number is odd while a writer is at work and changes with every
        write and ``clear()``; writers change the slot states only while it is odd. So a row
        copied between two reads of one even number is whole, and ``marks[at] == mark`` read
        after the copy and *before* the second read of the number says that it still holds
        what was asked for: the index's state SET, for a slot (a clear() or write that ended
        between the caller's check of the state and the first read of the number leaves an
        even number and an emptied slot); the staging map's entry, for a staging slot
        (readers free one without a write). Read after the number, the mark would be outside
        the window the number guards: a clear() before the first read and a write between
        the second read and the mark's gave a row of zeros with the state SET
        (docs/design.md, "The seqlock's window").

        Returns:
            a copy of the row as ``_slot_samples`` holds it (``copy=False``: its read-only view,
            ``_view_row``), or None: a writer was at work, or the row holds something else.
        """
        seq = self._slot_versions[row]
        if seq & 1:
            return None
        out = self._slot_samples[row].copy() if copy else self._view_row(row)
        if marks[at] != mark or self._slot_versions[row] != seq:
            return None
        return out

    def _view_row(self, row: int) -> Any:
        """The sample in a row, viewed through the read-only mapping (``get_slot(copy=False)``)."""
        return self._view_of(self._read_only_slots[row])

    # -- sizing and views of the segment ----------------------------------------------------

    def _offsets(self) -> dict:
        return segment_offsets(self._layout, self._slot_bytes, self._staging_slots)

    @property
    def _slot_bytes(self) -> int:
        return bytes_per_slot(self._dims, self._dtype)

    def _budget_fitting(self, room: int, total: int) -> float:
        """The size_limit_gib of the largest cache like this one whose segment (of ``total``
        bytes now) takes at most ``room`` bytes."""
        lay, per_slot = self._layout, self._slot_bytes
        fits = slots_fitting(room, lay, per_slot, self._staging_slots)
        return budget_for_slots(fits, lay.dataset_len, per_slot, self._staging_slots)

    def _capacity_error(self, shm_dir: str, total: int, free: int) -> CacheCapacityError:
        lay, per_slot = self._layout, self._slot_bytes
        return CacheCapacityError(
            f"{shm_dir} has {fmt_bytes(free)} free but the cache needs {fmt_bytes(total)} "
            f"({lay.slots} slots of {fmt_bytes(per_slot)}). {more_room(shm_dir, total)}, "
            f"pass a smaller size_limit_gib ({what_fits(self, shm_dir, total, free)})" +
            (", or pass size_limit_gib='auto' (its segment takes memory, not room in "
             f"{shm_dir})" if lay.num_nodes == 1 and not self._persistent and
             auto_is_anonymous(shm_dir) else ""), shm_dir, total, free)

    def _map_samples(self, head: dict) -> None:
        """The views of the slots' sequence numbers and of the slots (``_map_slots``), the
        staging slots after the others."""
        n_slots, mm = self._layout.slots + self._staging_slots, self._segment.mapping
        self._slot_versions_np = np.frombuffer(mm, np.uint32, n_slots, head["seq_off"])
        self._slot_versions = memoryview(mm)[
            head["seq_off"]: head["seq_off"] + 4 * n_slots].cast("I")
        self._map_slots(head["data_off"], n_slots)

    def _map_slots(self, data_off: int, n_slots: int) -> None:
        """The views of the slots: ``_slot_samples`` (one row per slot, written by ``_write``),
        ``array`` and the read-only ``_read_only_slots``."""
        np_dtype = DTYPE_CODES[self._dtype][1]

        def slots_of(buf: mmap.mmap) -> np.ndarray:
            return np.frombuffer(buf, np_dtype, n_slots * math.prod(self._dims),
                                 data_off).reshape(n_slots, *self._dims)

        self._slot_samples = slots_of(self._segment.mapping)
        self._view_as = self._dtype if self._dtype is torch.bfloat16 else None
        # set_slot takes a tensor of this dtype as it is (numpy has no bfloat16, and a complex
        # tensor may carry a conjugate bit that numpy cannot see)
        self._fast_dtype = None if self._view_as is not None or self._dtype.is_complex \
            else self._dtype
        self._array = self._to_torch(self._slot_samples[:self._layout.slots])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": intended
            self._read_only_slots = self._to_torch(slots_of(self._segment.read_only_mapping))

    def _to_torch(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        return t.view(self._view_as) if self._view_as is not None else t

    @contextlib.contextmanager
    def _writing(self, first: int, count: int) -> Iterator[None]:
        """Lock slots ``[first, first + count)`` and keep their sequence numbers odd while the
        caller writes them: concurrent readers of those slots see misses."""
        lock, length = slot_lock_offset(first), max(1, count)
        self._segment.lock(lock, length)
        try:
            seq = self._slot_versions_np[first: first + count]
            seq |= 1
            try:
                yield
            finally:
                seq += 1
        finally:
            self._segment.unlock(lock, length)

    def __deepcopy__(self, memo: dict) -> "SharedCache":
        """An independent cache with this one's configuration and contents, private to this
        process (a new segment as large as this one), as a deep copy of a 0.2.1 cache gave
        private tensors. A slot whose writer died mid-write is copied as empty."""
        self._check_open()
        w, lay = self._world, self._layout
        twin = SharedCache(
            budget_for_slots(lay.slots, lay.dataset_len, self._slot_bytes, self._staging_slots),
            lay.dataset_len, self._dims, self._dtype, name=f"copy{next(COPY_COUNTER)}",
            staging_slots=self._staging_slots,
            world=World(rank=w.node_rank, world_size=w.num_nodes, node_rank=w.node_rank,
                        num_nodes=w.num_nodes),
            shm_dir=os.path.dirname(self._path), layout=lay)
        memo[id(self)] = twin
        every = max(1, lay.slots)
        self._segment.lock(slot_lock_offset(0), every)  # no writer meanwhile
        try:
            aux = self._index_states_np.copy()
            held = np.flatnonzero(aux == SET)
            slots = held if self._slot_map is None else \
                np.frombuffer(self._slot_map, self._slot_map.format)[held]
            aux[held[self._slot_versions_np[slots] & 1 == 1]] = EMPTY  # torn by a writer that died
            aux[aux == WRITING] = EMPTY
            twin._slot_samples[:lay.slots] = self._slot_samples[:lay.slots]
            twin._index_states_np[:] = aux  # (staged samples are not copied: they wait for a read)
        finally:
            self._segment.unlock(slot_lock_offset(0), every)
        return twin

    @property
    def array(self) -> torch.Tensor:
        """The slots, a tensor of shape ``(len(cache), *data_dims)`` backed by shared memory;
        with fields, a dict of such tensors, one per field.

        .. warning::
            This is a raw view: writing into it bypasses the slot states and the protection of
            concurrent readers. Use ``set_slot``.
        """
        self._check_open()
        return self._array

    def __getitem__(self, slot: Any) -> torch.Tensor:
        """Raw slot access, as in 0.2.1: ``cache[s]`` is a view of slot ``s`` (not a dataset
        index when several nodes share the dataset)."""
        return self._array[slot]

    def __setitem__(self, slot: Any, value: Any) -> None:
        """Raw slot write, as in 0.2.1: torch's assignment rules (broadcasting, casting), and
        the aux state is not changed. Concurrent ``get_slot`` readers of the slots written see
        a miss rather than a half-written sample."""
        self._check_open()
        slot, first, count = self._raw_slots(slot)
        with self._writing(first, count):
            self._array[slot] = value

    def _raw_slots(self, slot: Any) -> tuple[Any, int, int]:
        """``slot`` of ``cache[slot] = v`` (an int made non-negative, or as it is) and the
        range of slots it may write."""
        n = len(self)
        if is_int(slot):
            if not -n <= int(slot) < n:  # as cache[slot] and 0.2.1 do
                raise IndexError(f"slot should be an int in [-{n}, {n - 1}], "
                                 f"but got slot={int(slot)}")
            slot = int(slot) % n
            return slot, slot, 1
        return slot, 0, n

    # -- in feature modules: batches (batches.py), staging (staging.py), saving (saved.py) --

    get_batch = _FromFeature("batches")
    rows = _FromFeature("batches")
    unpack_rows = _FromFeature("batches")
    locate = _FromFeature("batches")
    confirm = _FromFeature("batches")
    _batch_buffers = _FromFeature("batches")
    _put_row = _FromFeature("batches")
    stage = _FromFeature("staging")
    _take_staged = _FromFeature("staging")
    save = _FromFeature("saved")

    # -- reading many rows: locate, copy, confirm (get_batch, saving, the device loader) ----

    def _locate(self, idx: np.ndarray) -> BatchRows:
        # The seqlock of _read_row for every row at once: the states, the sequence numbers (even),
        # the states again; confirm() then checks the numbers once the rows are copied.
        aux = self._index_states_np[idx]
        found = aux == SET
        rows = idx if self._slot_map is None else \
            np.frombuffer(self._slot_map, self._slot_map.format)[idx].astype(np.int64)
        rows = np.where(aux == OOB, 0, rows)  # (the slot of an empty index: its version)
        entries = np.full(len(idx), -1, dtype=np.int64)
        if self._staging_slots:
            oob = np.flatnonzero(aux == OOB)
            if oob.size:
                self._staging.locate(idx, oob, rows, found, entries, self._read_tags,
                                     self._layout.slots)
        if not len(self._slot_versions_np):  # a cache without slots or staging slots
            return BatchRows(idx, rows, found, np.zeros(len(idx), np.uint32), entries)
        versions = self._slot_versions_np[rows]
        found &= versions & 1 == 0
        found[entries < 0] &= self._index_states_np[idx[entries < 0]] == SET
        return BatchRows(idx, rows, found, versions, entries)

    def _confirm(self, located: BatchRows, count: bool = True) -> np.ndarray:
        hit = located.found.copy()
        if not hit.any():
            return hit
        hit &= self._slot_versions_np[located.rows] == located.versions
        staged = np.flatnonzero(hit & (located.entries >= 0))
        if staged.size:
            k = located.rows[staged] - self._layout.slots
            hit[staged] &= self._staging.entries[k] == located.entries[staged]
            taken = staged[hit[staged]]
            if taken.size:
                self._staging.take(located.rows[taken] - self._layout.slots,
                                   located.entries[taken])
                self._own_counters[STATS_STAGED_HITS] += int(taken.size)
        if count:
            self._own_counters[STATS_HITS] += int(np.count_nonzero(hit))
        return hit

    def _check_value(self, value: Any) -> torch.Tensor:
        """Raise unless ``value`` may be stored; return it as a tensor (a numpy array wrapped,
        not copied). Nothing is stored and nothing of the cache changes. See ``_checked``."""
        return checked_value(value, self._dims, self._dtype, "value", "data_dims")

    def _write(self, slot: int, src: np.ndarray, idx: int | None) -> None:
        """Write one slot, and set the state of ``idx`` (None for a staging slot); the caller
        holds the slot's lock. Odd sequence numbers mean "in progress"."""
        seq = self._slot_versions[slot]
        seq += seq & 1  # an odd number left by a writer that died: round up
        self._slot_versions[slot] = (seq + 1) & 0xFFFFFFFF
        if idx is not None:
            self._index_states[idx] = WRITING
        self._slot_samples[slot] = src
        if idx is not None:
            self._index_states[idx] = SET
        self._slot_versions[slot] = (seq + 2) & 0xFFFFFFFF

    def _source_array(self, value: Any) -> np.ndarray:
        """The array to copy into a slot: a CPU tensor of the cache's dtype and shape as it is
        (the fast lane), anything else checked and converted."""
        if type(value) is torch.Tensor and value.dtype is self._fast_dtype and \
                value.shape == self._dims and value.layout is torch.strided and value.is_cpu \
                and not value.requires_grad:
            return value.numpy()
        return slot_array(self._check_value(value), self._dtype)

    def set_slot(self, idx: int, value: Any, allow_oob_idx: bool = True,
                 allow_overwrite: bool = False, *, exist_ok: bool = False) -> None:
        """Store ``value`` as the sample of dataset index ``idx``.

        A no-op when ``idx`` has no slot on this node (unless ``allow_oob_idx=False``), after
        the value is checked as for any other index. The value is copied; later changes to it
        do not reach the cache.

        Args:
            idx: dataset index (int, numpy or torch integer scalar) in ``[0, dataset_len)``.
            value: tensor (or numpy array) of shape ``data_dims``, or with extra leading
                dimensions of size 1 (as 0.2.1 accepted; no other broadcasting). Its dtype
                is the cache's; or casts to it without loss (uint8 into float32, ...); or is a
                float or complex of which the cache keeps the rounded value (float64 into
                float32, as torch rounds: past float16's range that is inf; into a real dtype
                only if every imaginary part is 0); or holds values that the cache's dtype
                represents exactly (int64 masks of 0..255 into uint8; checked, as 0.2.1 code
                may rely on it). A value that would change (0.7 or 300 into uint8) is refused
                with ValueError. Tensors on another device are copied. With fields: a dict
                with exactly the fields as keys (in any order), each value as above for its
                field's dims and dtype (a number for a field of shape ``()``); a missing or
                unknown key is a ValueError that names it.
            allow_oob_idx: when False, an index without a slot raises IndexError. Default:
                True.
            allow_overwrite: when False, writing a slot that is already set to a different
                value raises RuntimeError; the same value again is a no-op, so two processes
                that load one index at once (ranks that all read every index, as in a
                validation loop) are safe. Default: False.
            exist_ok: when True, a slot that is already set is left as it is, whatever the
                new value. Default: False.

        Raises:
            IndexError, TypeError, ValueError: bad ``idx`` or ``value``; nothing is changed.
            RuntimeError: the slot is set to a different value, and neither allow_overwrite
                nor exist_ok (often a sign of random augmentation before the cache); nothing
                is changed.
        """
        idx = self._index(idx)
        if self._index_states[idx] == OOB:
            if not allow_oob_idx:
                raise self._oob_error(idx)
            if self._disk_tier is not None:
                self._disk_tier.set_value(self, idx, value, allow_overwrite, exist_ok)
                return
            # Checked even where there is no slot, so that a bad value fails on every node and
            # for every index, not only where a slot happens to be (0.2.1 let it pass there).
            self._check_value(value)
            return
        src = self._source_array(value)
        slot = idx if self._slot_map is None else self._slot_map[idx]
        lock = slot_lock_offset(slot)
        self._segment.lock(lock)
        try:
            # A slot left WRITING, or SET with an odd sequence number, by a writer that
            # died (or was interrupted) is empty: we hold its lock, so nobody writes it.
            if self._index_states[idx] == SET and not allow_overwrite and \
                    not self._slot_versions[slot] & 1:
                if exist_ok:
                    return
                if self._holds(slot, src):  # a second load of one index: done already
                    self._own_counters[STATS_WRITES] += 1
                    return
                raise RuntimeError(
                    f"the slot of idx={idx} is already set to a different value; pass "
                    "allow_overwrite=True to replace it, or exist_ok=True to keep it. "
                    "(Two loads of one index that give different values mean that the "
                    "load is not deterministic, most often random augmentation before "
                    "the cache: cache the decoded sample and augment after get_slot.)")
            self._write(slot, src, idx)
        finally:
            self._segment.unlock(lock)
        self._own_counters[STATS_WRITES] += 1

    def _holds(self, slot: int, src: np.ndarray) -> bool:
        """True when ``slot`` holds exactly the bytes of ``src`` (NaNs included)."""
        have = self._slot_samples[slot].reshape(-1).view(np.uint8)
        return bool(np.array_equal(have, np.ascontiguousarray(src).reshape(-1).view(np.uint8)))

    def _from_row(self, row: np.ndarray) -> Any:
        """The sample in a copy of a slot's row (a tensor; a dict of them with fields)."""
        out = torch.from_numpy(row)
        return out if self._view_as is None else out.view(self._view_as)

    def clear(self) -> None:
        """Mark every slot empty and zero the slots (as 0.2.1 does), and empty the disk
        tier. Safe while other processes read (they see misses) or write (they finish
        first)."""
        self._check_open()
        with self._writing(0, len(self)):
            aux = self._index_states_np
            aux[aux != OOB] = EMPTY
            self._slot_samples[:len(self)].reshape(-1).view(np.uint8).fill(0)
        if self._disk_tier is not None:
            self._disk_tier.clear()
        if self._staging_slots:
            self._staging.drop_all()  # staged samples are dropped (fillers finish)

    # -- saving to a file, and loading one ---------------------------------------------------

    def _load(self, path: str, data_off: int, *, reserved: bool) -> None:
        """Fill this new segment from the saved file at ``path`` (``_SavedFileReader``)."""
        feature_module("saved")._SavedFileReader(self).load(path, data_off, reserved=reserved)

    def _unmap(self) -> None:
        closed = Closed(type(self))
        self._slot_versions = self._slot_versions_np = self._slot_samples = closed  # type: ignore
        self._array = self._read_only_slots = closed  # type: ignore
        super()._unmap()


if __name__ == "__main__":
    try:
        _cli = feature_module("cli")
    except ImportError as e:  # (a copied core without cli.py: one line, not a traceback)
        sys.exit(f"{os.path.basename(sys.argv[0])}: {e}")
    sys.exit(_cli.run_cli())
