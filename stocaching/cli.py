"""stocaching's command line (``python -m stocaching``): /dev/shm, the memory and the live
caches; ``plan``; listing segments; ``clean``; inspecting saved files.

A feature module of stocaching (see the core's section "The seam"). Copied beside
stocaching.py with the feature modules it reads (saved.py, open_size.py, fields.py), it runs
as ``python stocaching.py ...``.
"""

from __future__ import annotations

__all__ = ["list_segments", "main", "plan", "run_cli"]
STOCACHING_FEATURE = "cli"  # (the core reads this line before it imports the file)

import argparse
import contextlib
import mmap
import os
import re
import stat
import struct
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import psutil
import torch

try:  # inside the package
    from .stocaching import (BYTES_PER_GIB, DEFAULT_SHM_DIR, HEADER_BYTES, PERSISTENT_JOB_KEY,
                             POINTER, SEGMENT_PREFIX, SET, STATS_COLS, STATS_ROWS, CacheFileError,
                             CacheLayout, auto_is_anonymous, auto_room, budget_for_slots,
                             bytes_per_slot, check_dims, check_dtype, check_int,
                             check_positive, clean_segments, feature_module, fmt_bytes, free_bytes,
                             is_stale_file, memory_room, open_to_look, parse_segment_name,
                             pointer_of, read_header, read_key, segment_offsets, shm_headroom,
                             slots_fitting, slots_for_budget)
except ImportError:  # copied beside stocaching.py
    from stocaching import (BYTES_PER_GIB, DEFAULT_SHM_DIR, HEADER_BYTES, PERSISTENT_JOB_KEY,
                            POINTER, SEGMENT_PREFIX, SET, STATS_COLS, STATS_ROWS, CacheFileError,
                            CacheLayout, auto_is_anonymous, auto_room, budget_for_slots,
                            bytes_per_slot, check_dims, check_dtype, check_int,
                            check_positive, clean_segments, feature_module, fmt_bytes, free_bytes,
                            is_stale_file, memory_room, open_to_look, parse_segment_name,
                            pointer_of, read_header, read_key, segment_offsets, shm_headroom,
                            slots_fitting, slots_for_budget)


def _mapped_segments(shm_dir: str) -> dict[int, dict]:
    """Segments in ``shm_dir`` mapped by any process we can see, by inode, from /proc."""
    found: dict[int, dict] = {}
    prefix = os.path.join(os.path.realpath(shm_dir), SEGMENT_PREFIX + "_")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                lines = [ln for ln in f if prefix in ln]
        except OSError:
            continue
        for ln in lines:
            fields = ln.split(maxsplit=5)
            if len(fields) < 6:
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            seg = found.setdefault(int(fields[4]), {  # (an anonymous one: "/memfd:<path>")
                "path": fields[5].strip().removesuffix(" (deleted)").removeprefix("/memfd:"),
                "bytes": 0, "pids": set(), "anonymous": fields[5].startswith("/memfd:")})
            seg["bytes"] = max(seg["bytes"], hi - lo)
            seg["pids"].add(int(entry))
    return found


def list_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[dict]:
    """Every stocaching segment in ``shm_dir``: those with a name there and those whose name
    is already gone but that processes still map.

    Returns:
        Dicts with ``path`` (for an unlinked segment, its name as it was or, for one that
        never had it, as it would have been),
        ``named``, ``uid``, ``bytes``, ``pids`` (processes mapping it, as far as /proc shows)
        and ``state``: "live" (in use), "starting" (being created), "stale" (nobody holds
        it: ``clean_segments`` removes it) or "kept" (a persistent cache nobody uses now);
        a persistent cache's dict adds ``name``, ``key``, ``filled`` (samples stored),
        ``slots`` and ``age_s`` (seconds since a job last made or attached to it: the
        file's mtime, which each attach sets; a job attached for days shows days, and its
        ``state`` says "live"); one not named adds ``anonymous`` (True for the segment of
        a ``size_limit_gib="auto"`` cache, made with memfd_create: never a file there).
    """
    mapped = _mapped_segments(shm_dir)
    out = []
    for fname in sorted(os.listdir(shm_dir)):
        info = parse_segment_name(fname)
        path = os.path.join(shm_dir, fname)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if info is None or not stat.S_ISREG(st.st_mode):
            continue
        m = mapped.pop(st.st_ino, None)
        pointer = _read_pointer(path) if st.st_size == POINTER.size else None
        if pointer is not None:  # the name of an anonymous segment: list that one here
            m = mapped.pop(pointer[4], m)
        pids = sorted(m["pids"]) if m else []
        state = "starting" if info["starting"] else "live"
        if not pids and is_stale_file(path):
            state = "stale"
        entry = {"path": path, "named": True, "uid": st.st_uid,
                 "bytes": st.st_size if pointer is None else m["bytes"] if m else 0,
                 "pids": pids, "state": state}
        if info["job_key"] == PERSISTENT_JOB_KEY and not info["starting"]:
            entry.update(_describe_persistent(path, info["name"]))
            if state == "stale":
                entry["state"] = "kept"
        out.append(entry)
    for m in mapped.values():
        info = parse_segment_name(os.path.basename(m["path"])) or {}
        # A segment of a single-process job never had its name: it was mapped under the
        # leader's temporary ``<name>.<pid>.<hex>.init``; show the name it stands for.
        path = re.sub(r"\.\d+\.[0-9a-f]+\.init$", "", m["path"])
        out.append({"path": path, "named": False, "uid": info.get("uid", -1),
                    "bytes": m["bytes"], "pids": sorted(m["pids"]), "state": "live",
                    "anonymous": m["anonymous"]})
    return out


def _read_pointer(path: str) -> tuple[int, int, int, int, int] | None:
    """``pointer_of`` the file at ``path``; None where it cannot be read."""
    fd = open_to_look(path)
    if fd is None:
        return None
    try:
        return pointer_of(fd)
    finally:
        os.close(fd)


def _describe_persistent(path: str, name: str) -> dict:
    """What ``list_segments`` says of a persistent cache: its name, key, fill and age."""
    out: dict = {"name": name, "key": None, "filled": None, "slots": None, "age_s": None}
    fd = open_to_look(path)
    if fd is None:
        return out
    try:
        st = os.fstat(fd)
        out["age_s"] = time.time() - st.st_mtime
        head_bytes = os.pread(fd, HEADER_BYTES, 0)
        head = read_header(head_bytes)
        aux = np.frombuffer(os.pread(fd, head["dataset_len"], head["aux_off"]), np.uint8)
        out.update(key=read_key(head_bytes), filled=int(np.count_nonzero(aux == SET)),
                   slots=head["slots"])
    except (OSError, ValueError, struct.error):
        pass  # not a whole segment: shown without them
    finally:
        os.close(fd)
    return out


# ----------------------------------------------------------------------------------------------
# Planning a cache, and the command line
# ----------------------------------------------------------------------------------------------


def plan(dataset_len: int, data_dims: Sequence[int] | Mapping[str, Sequence[int]],
         dtype: torch.dtype | Mapping[str, torch.dtype] = torch.uint8,
         size_limit_gib: float | None = None, shm_dir: str = DEFAULT_SHM_DIR, *,
         staging_slots: int = 0, mean_sample_bytes: int | None = None) -> dict:
    """How many samples fit: in ``size_limit_gib`` if given, else in what ``shm_dir`` has free
    and the memory can hold, as ``size_limit_gib="auto"`` sizes a cache.
    ``data_dims`` and ``dtype`` as for ``SharedCache`` (dicts for several fields a sample), or
    for ``OpenSizeCache`` (a None for an open size).

    Args:
        staging_slots: staging slots for a prefetcher (see ``SharedCache``), paid first.
        mean_sample_bytes: with open sizes (required then): the mean bytes of a sample (or a
            higher percentile, for a margin); ``slots`` is then how many such samples the
            arena holds.

    Returns:
        A dict with ``slots``, ``fraction`` (of the dataset), ``size_limit_gib`` used,
        ``dataset_gib`` (what the whole dataset would need), ``segment_gib`` (the whole
        segment of this plan, metadata and staging included), ``shm_free_gib``,
        ``shm_headroom_gib`` (what "auto" leaves free in ``shm_dir`` for its other users),
        ``ram_available_gib`` (the memory this process may still take: the RAM available, or
        less under a memory cgroup's limit), ``memory_gib`` (the RAM, or that limit),
        ``memory_margin_gib`` (what "auto" keeps free of it) and ``memory_limit`` (the file
        of the limit, or None where the RAM is the limit). Without ``size_limit_gib``, the
        plan is what ``size_limit_gib="auto"`` would take now.
    """
    dataset_len = check_int("dataset_len", dataset_len, low=1)
    if isinstance(data_dims, Mapping):
        fields, slot_bytes = feature_module("fields").check_fields(data_dims, dtype)
        opened = sum(d is None for f in fields for d in f.dims)
    else:
        dims = check_dims(data_dims)
        opened = sum(d is None for d in dims)
        slot_bytes = 0 if opened else bytes_per_slot(dims, check_dtype(dtype))
        check_dtype(dtype)
    staging = check_int("staging_slots", staging_slots, low=0)
    if opened:
        return _plan_arena(dataset_len, opened, size_limit_gib, shm_dir, staging,
                           mean_sample_bytes)
    if mean_sample_bytes is not None:
        raise ValueError(f"mean_sample_bytes is for a cache with open sizes (None in "
                         f"data_dims), but got mean_sample_bytes={mean_sample_bytes!r}")
    room, auto_bytes = _plan_room(shm_dir)
    if size_limit_gib is not None:
        limit = check_positive("size_limit_gib", size_limit_gib, "GiB")
        slots = slots_for_budget(limit, dataset_len, slot_bytes, staging)
    else:  # the largest cache whose whole segment (metadata included) fits, as with "auto"
        slots = slots_fitting(auto_bytes, CacheLayout(dataset_len, 0), slot_bytes, staging)
        limit = budget_for_slots(slots, dataset_len, slot_bytes, staging)
    segment = segment_offsets(CacheLayout(dataset_len, slots), slot_bytes,
                              staging)["total_bytes"]
    return {"slots": slots, "fraction": slots / dataset_len, "size_limit_gib": limit,
            "dataset_gib": (slot_bytes + 1) * dataset_len / BYTES_PER_GIB,
            "segment_gib": segment / BYTES_PER_GIB, **room}


def _plan_room(shm_dir: str) -> tuple[dict, int]:
    """What ``plan`` reports of the machine (in GiB, the limit's file as a str or None), and
    the bytes a segment sized as by ``size_limit_gib="auto"`` may take."""
    free, headroom, memory = free_bytes(shm_dir), shm_headroom(shm_dir), memory_room()
    return {"shm_free_gib": free / BYTES_PER_GIB, "shm_headroom_gib": headroom / BYTES_PER_GIB,
            "ram_available_gib": memory.available / BYTES_PER_GIB,
            "memory_gib": memory.total / BYTES_PER_GIB, "memory_margin_gib":
            memory.margin / BYTES_PER_GIB, "memory_limit": memory.source if memory.limited
            else None}, auto_room(free, headroom, memory, auto_is_anonymous(shm_dir))


def _plan_arena(dataset_len: int, opened: int, size_limit_gib: float | None, shm_dir: str,
                staging: int, mean: Any) -> dict:
    """``plan`` for a cache of open sizes: the arena's size, and how many samples of ``mean``
    bytes it holds (each padded to 16 bytes)."""
    if mean is None:
        raise ValueError("mean_sample_bytes should be given to plan a cache with open sizes "
                         "(None in data_dims), but got mean_sample_bytes=None")
    mean = check_int("mean_sample_bytes", mean, low=1)
    if staging:
        raise ValueError(f"staging_slots should be 0 for a cache with open sizes, but got "
                         f"staging_slots={staging}")
    words = 4 + opened
    meta = dataset_len * (1 + 8 * words)
    room, free = _plan_room(shm_dir)
    open_size = feature_module("open_size")  # (its _SEAM: the arena's rules)
    align = open_size.ARENA_ALIGN
    need = (-(-mean // align) * align * dataset_len + meta) / BYTES_PER_GIB
    if size_limit_gib is not None:
        limit = check_positive("size_limit_gib", size_limit_gib, "GiB")
    else:  # what the dataset needs, if the segment fits its room (header, stats and page
        # rounding come on top), as for samples of a fixed size; else that room
        limit = min(need, max(0, free - HEADER_BYTES - STATS_ROWS * STATS_COLS * 8 -
                              2 * mmap.PAGESIZE) / BYTES_PER_GIB)
    arena = open_size.arena_size_for(limit, dataset_len, words)
    slots = min(dataset_len, arena // (-(-mean // align) * align))
    return {"slots": slots, "fraction": slots / dataset_len, "size_limit_gib": limit,
            "arena_gib": arena / BYTES_PER_GIB, "dataset_gib": need,
            "segment_gib": (arena + meta + HEADER_BYTES + STATS_ROWS * STATS_COLS * 8 +
                            mmap.PAGESIZE) / BYTES_PER_GIB, **room}


def _saved_files_in(path: str) -> list[str]:
    """``path`` if it is not a directory, else the files in it that start as a saved file."""
    if not os.path.isdir(path):
        return [path]
    found, saved = [], feature_module("saved")  # (its _SEAM: how a saved file starts)
    block, magic = saved.SAVE_BLOCK, saved.SAVE_MAGIC
    for fname in sorted(os.listdir(path)):
        full = os.path.join(path, fname)
        with contextlib.suppress(OSError):
            with open(full, "rb") as f:  # (the superblock in force is the first or second)
                head = f.read(block + len(magic)) if os.path.isfile(full) else b""
            if magic in (head[:len(magic)], head[block:]):
                found.append(full)
    return found


def _inspect_saved_files(paths: Sequence[str], verify: bool,
                         out: Callable[[str], Any]) -> int:
    """``python -m stocaching inspect``: one paragraph per saved file; 1 if any is missing
    or damaged (said on its line), else 0."""
    failed, files = False, [f for p in paths for f in _saved_files_in(p)]
    for p in paths:
        if os.path.isdir(p) and not _saved_files_in(p):
            out(f"{p}: no saved files\n")
    for path in files:
        try:
            d = feature_module("saved").describe_saved_file(path, verify=verify)
        except OSError as e:
            out(f"{path}: {e.strerror}\n")
            failed = True
            continue
        except CacheFileError as e:  # (a file given by mistake is not one to remove)
            out(f"{path}: not a file saved by SharedCache.save, or its header is damaged\n"
                if e.reason == "header" else f"{path}: {e}\n")
            failed = True
            continue
        dtype = d["dtype"] if isinstance(d["dtype"], str) else \
            ", ".join(f"{k}: {v}" for k, v in d["dtype"].items())
        out(f"{path}: {fmt_bytes(d['bytes'])}, saved {d['age_s'] / 3600:.1f} h ago\n"
            f"  key={d['key']!r} dataset_len={d['dataset_len']} data_dims={d['data_dims']} "
            f"dtype={dtype} node {d['node_rank']} of {d['num_nodes']}\n"
            f"  {d['samples']} samples to load ({d['rows']} rows in {d['saves']} "
            f"save{'' if d['saves'] == 1 else 's'}){'; every row checked' if verify else ''}\n")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stocaching [info|plan|clean|inspect]``: see the shared memory, size a
    cache, clean up, look into saved files."""
    parser = argparse.ArgumentParser(
        prog=None if os.path.basename(sys.argv[0]) == "stocaching.py" else "python -m stocaching",
        description="See the shared memory, size a cache, clean up, look into saved files.")
    parser.add_argument("--shm-dir", default=os.environ.get("STOCACHING_SHM_DIR",
                                                            DEFAULT_SHM_DIR),
                        help="the tmpfs directory of the caches (default: $STOCACHING_SHM_DIR "
                             "or /dev/shm)")
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("info", help="/dev/shm, RAM and live caches (the default)")
    p = sub.add_parser("plan", help="how many samples of a shape fit")
    p.add_argument("--dataset-len", type=int, required=True, help="samples in the dataset")
    p.add_argument("--dims", help="sample shape, e.g. 3,256,256 or 3x256x256; None for an "
                                  "open size, e.g. None,3 (with --mean-bytes)")
    p.add_argument("--mean-bytes", type=int, default=None,
                   help="with open sizes: the mean bytes of a sample (or a percentile)")
    p.add_argument("--dtype", default="uint8",
                   help="sample dtype, e.g. uint8 or torch.float16 (default: uint8)")
    p.add_argument("--field", action="append", default=[], metavar="NAME=DIMS[:DTYPE]",
                   help="instead of --dims, one field of a sample, e.g. --field image=3x256x256 "
                        "--field label=:int64 (empty dims: a scalar; DTYPE default: --dtype)")
    p.add_argument("--size-gib", type=float, default=None,
                   help="budget in GiB, as size_limit_gib (default: what size_limit_gib='auto' "
                        "would take now)")
    p.add_argument("--staging-slots", type=int, default=0,
                   help="staging slots for a prefetcher, paid from the budget (default: 0)")
    c = sub.add_parser("clean", help="remove your segments whose processes are all gone")
    c.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    c.add_argument("--persistent", action="append", default=[], metavar="NAME",
                   help="also remove the persistent cache of this name, if no process uses it "
                        "(repeat for several)")
    c.add_argument("--all-persistent", action="store_true",
                   help="also remove every persistent cache that no process uses")
    c.add_argument("--disk-tier", default=None, metavar="DIR",
                   help="also clean the disk tiers in DIR (the disk_tier= of your caches): "
                        "those no process uses, and persistent ones as above")
    f = sub.add_parser("inspect", help="what files written by SharedCache.save hold, without "
                                       "loading them")
    f.add_argument("paths", nargs="+", metavar="PATH",
                   help="a saved file, or a directory: the saved files in it")
    f.add_argument("--verify", action="store_true",
                   help="also read every sample and check its CRC (reads the whole file)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.shm_dir):
        parser.error(f"--shm-dir should be an existing directory (a tmpfs such as /dev/shm), "
                     f"but got --shm-dir={args.shm_dir}")
    out = sys.stdout.write
    if args.cmd == "plan":
        def dtype_of(name: str) -> Any:
            return getattr(torch, name.removeprefix("torch."), name)

        def dims_of(text: str, flag: str) -> tuple[int, ...]:
            try:
                return tuple(None if d == "None" else int(d)
                             for d in text.replace("x", ",").split(",") if d != "")
            except ValueError:
                parser.error(f"{flag} should be ints separated by ',' or 'x', e.g. 3,256,256, "
                             f"but got {flag}={text}")

        dtype: Any = dtype_of(args.dtype)
        if (args.dims is None) == (not args.field):
            parser.error("give either --dims (one tensor a sample) or --field (once per field)"
                         f", but got --dims={args.dims} and --field={args.field}")
        if args.field:
            dims: Any = {}
            dtype = {}
            for spec in args.field:
                name, eq, rest = spec.partition("=")
                if not eq:
                    parser.error(f"--field should be NAME=DIMS[:DTYPE], e.g. image=3x256x256 "
                                 f"or label=:int64, but got --field={spec}")
                shape, _, dt = rest.partition(":")
                dims[name] = dims_of(shape, "--field")
                dtype[name] = dtype_of(dt) if dt else dtype_of(args.dtype)
        else:
            dims = dims_of(args.dims, "--dims")
        try:
            r = plan(args.dataset_len, dims, dtype, args.size_gib, args.shm_dir,
                     staging_slots=args.staging_slots, mean_sample_bytes=args.mean_bytes)
        except (TypeError, ValueError) as e:
            msg = re.sub(r"\bdata_dims\['(\w+)'\]", r"--field \1", str(e))
            msg = re.sub(r"\bdtype\['(\w+)'\]", r"the DTYPE of --field \1", msg)
            for param, flag in (("dataset_len", "--dataset-len"),
                                ("data_dims", "--field" if args.field else "--dims"),
                                ("size_limit_gib", "--size-gib"), ("dtype", "--dtype"),
                                ("staging_slots", "--staging-slots"),
                                ("mean_sample_bytes", "--mean-bytes")):
                msg = re.sub(rf"\b{param}\b", flag, msg)
            parser.error(msg)
        what = f"{dims} {args.dtype}" if not args.field else " + ".join(args.field)
        gib = {k: fmt_bytes(v * BYTES_PER_GIB) for k, v in r.items() if k.endswith("_gib")}
        out(f"{r['slots']} of {args.dataset_len} samples of {what} fit in "
            f"{gib['size_limit_gib']}"
            + (f" beside {args.staging_slots} staging slots" if args.staging_slots else "") +
            f": {100 * r['fraction']:.1f}% of the dataset\n"
            f"the whole dataset needs {gib['dataset_gib']}; {args.shm_dir} has "
            f"{gib['shm_free_gib']} free, of which a cache of a given size leaves "
            f"{gib['shm_headroom_gib']} to its other users (DataLoader batches, NCCL)"
            + (" and 'auto' all of it (an anonymous segment)" if r["shm_headroom_gib"] else "")
            + "\n"
            + (f"RAM {gib['ram_available_gib']} available" if r["memory_limit"] is None
               else f"memory limit {gib['memory_gib']} ({r['memory_limit']}), "
               f"{gib['ram_available_gib']} of it free") +
            f", of which 'auto' keeps {gib['memory_margin_gib']} free\n")
        segment, limited = r["segment_gib"], r["memory_limit"] is not None
        anonymous = args.size_gib is None and r["shm_headroom_gib"] > 0  # (as "auto" makes it)
        if segment > r["shm_free_gib"] and not anonymous:
            out(f"error: the segment ({gib['segment_gib']}) does not fit in what {args.shm_dir} "
                "has free: the cache would refuse to start; enlarge it or pass a smaller "
                "--size-gib\n")
            return 1
        if limited and segment > r["ram_available_gib"]:
            out(f"error: the segment ({gib['segment_gib']}) is more than the memory limit "
                "leaves free: the cache would refuse to start; raise the limit or pass a "
                "smaller --size-gib\n")
            return 1
        if r["ram_available_gib"] - segment < r["memory_margin_gib"]:
            out(f"warning: the segment ({gib['segment_gib']}) leaves less than "
                f"{gib['memory_margin_gib']} of the memory free: "
                + ("the machine would swap\n" if not limited else
                   "the DataLoader's workers may get the job killed (OOM)\n"))
        if r["shm_free_gib"] - segment < r["shm_headroom_gib"] and not anonymous:
            out(f"warning: the segment ({gib['segment_gib']}) leaves less than "
                f"{gib['shm_headroom_gib']} of {args.shm_dir} to the DataLoader's batches and "
                "NCCL: enlarge it or pass a smaller --size-gib\n")
    elif args.cmd == "inspect":
        return _inspect_saved_files(args.paths, args.verify, out)
    elif args.cmd == "clean":
        if args.disk_tier is not None and not os.path.isdir(args.disk_tier):
            parser.error(f"--disk-tier should be an existing directory (the disk_tier= of your "
                         f"caches), but got --disk-tier={args.disk_tier}")
        removed = clean_segments(args.shm_dir, dry_run=args.dry_run,
                                 persistent=True if args.all_persistent else args.persistent,
                                 disk_tier=args.disk_tier)
        verb = "would remove" if args.dry_run else "removed"
        out("".join(f"{verb} {p}\n" for p in removed) or "nothing to clean\n")
    else:
        st = os.statvfs(args.shm_dir)
        vm, memory = psutil.virtual_memory(), memory_room()
        out(f"{args.shm_dir}: {fmt_bytes(st.f_blocks * st.f_frsize)} total, "
            f"{fmt_bytes(free_bytes(args.shm_dir))} free\n"
            f"RAM: {fmt_bytes(vm.total)} total, {fmt_bytes(vm.available)} available\n")
        if memory.limited:
            out(f"memory limit: {fmt_bytes(memory.total)} ({memory.source}), "
                f"{fmt_bytes(memory.available)} of it free\n")
        segs = list_segments(args.shm_dir)
        out(f"stocaching segments: {len(segs)}\n")
        for s in segs:
            name = s["path"] if s["named"] else s["path"] + (
                " (anonymous: not a file there)" if s.get("anonymous") else " (unlinked)")
            out(f"  {s['state']:8s} uid={s['uid']} {fmt_bytes(s['bytes']):>10s} "
                f"pids={','.join(map(str, s['pids'])) or '-'} {name}\n")
            if "key" in s:
                age = "?" if s["age_s"] is None else f"{s['age_s'] / 3600:.1f} h"
                out(f"           persistent: name={s['name']} key={s['key']!r} filled "
                    f"{s['filled']} of {s['slots']} slots, last attached {age} ago\n")
    return 0


def run_cli() -> int:
    """:func:`main` for the command line: output cut short by a reader that went away
    (``python -m stocaching plan ... | head -2``) ends quietly, as other commands do."""
    try:
        status = main()
        sys.stdout.flush()  # (here, not at exit, where the error would be printed)
        return status
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
