"""Saved caches: ``SharedCache.save(path)``, ``SharedCache(..., load_from=path)`` and
``describe_saved_file``; the file format (a superblock, chunks of rows and indices, CRCs).

A feature module of stocaching (see the core's section "The seam"): ``save`` is the cache's
method (``SharedCache.save = _FromFeature("saved")``), and a segment made with ``load_from``
is filled by ``_SavedFileReader``.

Keywords:
    load_from: a file that ``save`` wrote: the local leader fills the new segment from it
        before the other local ranks attach (they wait as for any new segment), each sample
        into the slot its index has here (so the file may come from a cache of another size);
        the next ``save`` to it appends. A missing file starts empty (logged); ``{node}`` in
        it becomes the node's rank. A persistent cache that exists already is attached as it
        is, without reading the file. ``key`` and ``on_mismatch`` apply (persistent.py says
        how). A file truncated, damaged or not a saved cache raises ``CacheFileError``.
        Default: None.
"""

from __future__ import annotations

__all__ = ["describe_saved_file"]
STOCACHING_FEATURE = "saved"  # (the core reads this line before it imports the file)
# The names besides __all__ that cli.py (python -m stocaching) uses, as the core's _SEAM
# lists its own.
_SEAM = frozenset({"SAVE_BLOCK", "SAVE_MAGIC"})

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import os
import re
import secrets
import struct
import sys
import threading
import time
import zlib
from typing import Any

import numpy as np

try:  # the same CRC-32 (zlib's polynomial, the same values) at several times zlib's speed
    from zlib_ng.zlib_ng import crc32 as _crc32  # (docs/design.md, "Loading a saved file")
except ImportError:  # (zlib-ng is a dependency of the package; a copied saved.py may lack it)
    _crc32 = zlib.crc32

try:  # inside the package
    from .stocaching import (BYTES_PER_MIB, LAYOUT_VERSION, SET, CacheConfigError, CacheFileError,
                             Field, SharedCache, close_fd, fmt_bytes, free_bytes, logger,
                             process_alive, pwrite_all)
except ImportError:  # copied beside stocaching.py
    from stocaching import (BYTES_PER_MIB, LAYOUT_VERSION, SET, CacheConfigError, CacheFileError,
                            Field, SharedCache, close_fd, fmt_bytes, free_bytes, logger,
                            process_alive, pwrite_all)


# ----------------------------------------------------------------------------------------------
# Saved files: the filled slots of a cache on disk (SharedCache.save, load_from=)
# ----------------------------------------------------------------------------------------------


#
# One file:
#   [superblock 0, 4 KiB][superblock 1, 4 KiB][config: JSON, padded to 4 KiB][chunk]...
# A chunk is one save's records: [rows: row_bytes each][int64 dataset index of each row]
# [int64 indices emptied since the last save][pad][trailer, 64 bytes], its end 4 KiB aligned;
# its trailer says where it starts, so the chunks are found from the end backwards. A later
# chunk's record of an index replaces an earlier one's. A superblock (magic, generation, the
# end of the last chunk, the chunk count, the config's length and CRC, and its own CRC) commits
# a save: the valid one with the higher generation counts, and bytes past its end do not exist.
# A first save writes a new file under a temporary name, syncs it and renames it over ``path``;
# a later one appends a chunk past the committed end, syncs it, then writes the other
# superblock (the one not in force) and syncs again. A save killed at any point leaves the
# previous commit in force (or no file at all), and every byte of a commit is covered by a
# CRC-32, so a truncated or damaged file is refused rather than loaded in part.

SAVE_MAGIC = b"STOSAVE1"
_SAVE_VERSION = 1
SAVE_BLOCK = 4096
_SUPER = struct.Struct("<8sqqqqqqq")  # magic, version, generation, end, chunks, config
_SUPER_CRC = struct.Struct("<I")      # length and CRC, rows in the file; then the CRC of those
_CONFIG_OFF = 2 * SAVE_BLOCK
_TRAILER = struct.Struct("<8sqqqqqq")  # magic, rows, emptied, row bytes, start, rows' CRC,
_CHUNK_MAGIC = b"STOCHUNK"             # the indices' CRC; then the CRC of those
_TRAILER_BYTES = 64
_SAVE_IO = 64 * BYTES_PER_MIB  # bytes read or written at a time (rows gathered and saved)


def _align(n: int) -> int:
    return -(-n // SAVE_BLOCK) * SAVE_BLOCK


def _pack_super(gen: int, end: int, chunks: int, config: bytes, rows: int) -> bytes:
    body = _SUPER.pack(SAVE_MAGIC, _SAVE_VERSION, gen, end, chunks, len(config),
                       _crc32(config), rows)
    return body + _SUPER_CRC.pack(_crc32(body))


def _super_off(gen: int) -> int:
    """Where the superblock of generation ``gen`` goes: the one not in force."""
    return (gen % 2) * SAVE_BLOCK


def _pack_trailer(rows: int, emptied: int, row_bytes: int, start: int, rows_crc: int,
                  meta_crc: int) -> bytes:
    body = _TRAILER.pack(_CHUNK_MAGIC, rows, emptied, row_bytes, start, rows_crc, meta_crc)
    return (body + _SUPER_CRC.pack(_crc32(body))).ljust(_TRAILER_BYTES, b"\0")


def _pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``offset``; a file that ends first is truncated."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise CacheFileError(f"{path} is truncated: it ends at byte {offset + done}, inside "
                                 "a saved chunk; remove it (the next save writes it anew)",
                                 path, "truncated")
        done += got


def _send_into(dst_fd: int, dst_off: int, src_fd: int, src_off: int, nbytes: int, path: str
               ) -> None:
    """Copy ``nbytes`` of the saved file at ``src_fd`` from ``src_off`` into the segment at
    ``dst_fd`` at ``dst_off``, in the kernel (``sendfile``): no copy through this process, and
    the segment's pages, written whole through the file, are not zeroed first as pages first
    touched through a mapping are. A file that ends first is truncated."""
    os.lseek(dst_fd, dst_off, os.SEEK_SET)  # (sendfile writes at the destination's position)
    done = 0
    while done < nbytes:
        got = os.sendfile(dst_fd, src_fd, src_off + done, nbytes - done)
        if got == 0:
            raise CacheFileError(f"{path} is truncated: it ends at byte {src_off + done}, "
                                 "inside a saved chunk; remove it (the next save writes it "
                                 "anew)", path, "truncated")
        done += got


# Whether os.sendfile writes into a regular file here (Linux); elsewhere the rows are read
# into the segment's mapping.
_SENDFILE = hasattr(os, "sendfile") and sys.platform.startswith("linux")


def _reopen(fd: int) -> int:
    """A new descriptor of the file open at ``fd`` (the same file, even if its name now
    names another), with a file position and readahead of its own; OSError without /proc."""
    new = os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if fcntl.fcntl(fd, fcntl.F_GETFL) &
                                          os.O_ACCMODE == os.O_RDWR else os.O_RDONLY) |
                  os.O_CLOEXEC)
    a, b = os.fstat(fd), os.fstat(new)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(new)
        raise OSError(errno.ESTALE, "not the same file")
    return new


# The load's sizes: each thread copies a piece of a chunk's rows, then checks it while it is
# still in the CPU's cache, and a chunk is split among threads in parts of at least
# _LOAD_PART bytes (see docs/design.md, "Loading a saved file").
_LOAD_PIECE = 256 * 1024
_LOAD_PART = 32 * BYTES_PER_MIB
_LOAD_THREADS = 4  # at most; and no more than the CPUs this process may run on


def _crc32_zeros(crc: int, nbytes: int) -> int:
    """The CRC-32 register ``crc`` after ``nbytes`` zero bytes, unconditioned: what the CRC of
    a stretch contributes to the CRC of itself followed by ``nbytes`` more bytes."""
    power = 0
    while nbytes:
        if nbytes & 1:
            crc = _gf2_apply(_zeros_operator(power), crc)
        nbytes >>= 1
        power += 1
    return crc


def _gf2_apply(matrix: tuple[int, ...], vector: int) -> int:
    """A 32 x 32 matrix over GF(2) (its columns) times ``vector``."""
    out, k = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[k]
        vector >>= 1
        k += 1
    return out


@functools.lru_cache(maxsize=None)
def _zeros_operator(power: int) -> tuple[int, ...]:
    """The linear map of the CRC-32 register over 2**power zero bytes, as 32 columns."""
    if power == 0:  # one zero byte, read off zlib's own CRC (conditioning undone)
        return tuple(~_crc32(b"\0", ~(1 << k) & 0xFFFFFFFF) & 0xFFFFFFFF
                     for k in range(32))
    half = _zeros_operator(power - 1)
    return tuple(_gf2_apply(half, col) for col in half)


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of two stretches one after the other, from the CRC of each and the length
    of the second (as zlib's crc32_combine, which Python does not expose)."""
    return _crc32_zeros(crc1, len2) ^ crc2


@dataclasses.dataclass
class _LoadPart:
    """One thread's share of a chunk's rows: its rows ``first`` to ``first + rows``, in
    pieces; their CRC-32 once copied."""

    first: int
    rows: int
    crc: int = 0


class _ChunkPlan:
    """How the rows of one saved chunk go into the segment, worked out for all of them at
    once: per row its slot (``target``, -1: none here) and whether it is the record in force
    (``live``); in pieces of ``per`` rows, ``straight`` where every row of the piece is live
    and their slots are consecutive (copied straight into the slots), else read into a
    buffer and the live rows scattered (``scattered``: such a piece has a live row)."""

    start: int  # the chunk's first byte in the file
    rows: int
    per: int
    target: np.ndarray
    live: np.ndarray
    straight: np.ndarray  # per piece
    scattered: np.ndarray  # per piece
    copied: list[_LoadPart]  # its parts, in order, once the load has shared them out

    def __init__(self, chunk: dict, slot_of: np.ndarray, last: np.ndarray, per: int) -> None:
        idx = chunk["indices"]
        self.start, self.rows, self.per = chunk["start"], chunk["rows"], per
        self.target = slot_of[idx]
        self.live = (last[idx] == chunk["first"] + np.arange(self.rows)) & (self.target >= 0)
        if not self.rows:
            self.straight = self.scattered = np.zeros(0, bool)
            return
        firsts = np.arange(0, self.rows, per)
        lasts = np.minimum(firsts + per, self.rows) - 1
        breaks = np.concatenate([[0], np.cumsum(np.diff(self.target) != 1)])
        self.straight = np.logical_and.reduceat(self.live, firsts) & \
            (breaks[lasts] == breaks[firsts])
        self.scattered = ~self.straight & np.logical_or.reduceat(self.live, firsts)

    def parts(self, threads: int, row_bytes: int) -> list[_LoadPart]:
        """This chunk's rows in up to ``threads`` parts of whole pieces, one per thread,
        none of them under ``_LOAD_PART`` bytes (one part for a small chunk)."""
        pieces = len(self.straight)
        k = max(1, min(threads, pieces, self.rows * row_bytes // max(1, _LOAD_PART)))
        cuts = [self.per * (pieces * j // k) for j in range(k)] + [self.rows]
        return [_LoadPart(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


def _fsync_dir(path: str) -> None:
    """Make a rename in the directory of ``path`` durable."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError:  # (some filesystems cannot sync a directory: the rename is all they give)
        pass
    finally:
        os.close(fd)


def _read_super(fd: int, path: str) -> dict:
    """The superblock in force of the saved file open at ``fd``, checked against its size."""
    raw = os.pread(fd, _CONFIG_OFF, 0)
    best = None
    for k in range(2):
        block = raw[k * SAVE_BLOCK: k * SAVE_BLOCK + _SUPER.size + _SUPER_CRC.size]
        if len(block) < _SUPER.size + _SUPER_CRC.size:
            continue
        body, (crc,) = block[:_SUPER.size], _SUPER_CRC.unpack(block[_SUPER.size:])
        magic, version, gen, end, chunks, config_len, config_crc, rows = _SUPER.unpack(body)
        if magic != SAVE_MAGIC or _crc32(body) != crc:
            continue
        if version != _SAVE_VERSION:
            raise CacheFileError(f"{path} was saved by another stocaching version (file format "
                                 f"{version}, this one reads {_SAVE_VERSION}); remove it",
                                 path, "version")
        if best is None or gen > best["gen"]:
            best = {"gen": gen, "end": end, "chunks": chunks, "config_len": config_len,
                    "config_crc": config_crc, "rows": rows, "slot": k}
    if best is None:
        raise CacheFileError(f"{path} is not a file saved by SharedCache.save, or its header is "
                             "damaged; remove it (the next save writes it anew)", path, "header")
    size = os.fstat(fd).st_size
    if size < best["end"]:
        raise CacheFileError(f"{path} is truncated: {size} bytes, but its last save ends at "
                             f"byte {best['end']}; remove it (the next save writes it anew)",
                             path, "truncated")
    return best


def _read_config(fd: int, sup: dict, path: str) -> dict:
    raw = os.pread(fd, sup["config_len"], _CONFIG_OFF)
    if len(raw) != sup["config_len"] or _crc32(raw) != sup["config_crc"]:
        raise CacheFileError(f"{path}: its configuration block is damaged; remove it",
                             path, "config")
    return json.loads(raw)


def _read_chunks(fd: int, sup: dict, path: str, dataset_len: int, row_bytes: int
                 ) -> list[dict]:
    """Every committed chunk of the file, first to last, with its indices (checked)."""
    first, end, chunks = _CONFIG_OFF + _align(sup["config_len"]), sup["end"], []
    while end > first:
        raw = os.pread(fd, _TRAILER_BYTES, end - _TRAILER_BYTES)
        body = raw[:_TRAILER.size]
        crc = _SUPER_CRC.unpack_from(raw, _TRAILER.size)[0] if len(raw) == _TRAILER_BYTES \
            else -1
        magic, rows, emptied, rb, start, rows_crc, meta_crc = _TRAILER.unpack(body) \
            if len(body) == _TRAILER.size else (b"", 0, 0, 0, 0, 0, 0)
        meta_off = start + rows * rb
        if magic != _CHUNK_MAGIC or _crc32(body) != crc or rb != row_bytes or \
                not first <= start < end or meta_off + 8 * (rows + emptied) > end - \
                _TRAILER_BYTES or rows < 0 or emptied < 0:
            raise CacheFileError(f"{path} is damaged: no valid save record ends at byte {end}; "
                                 "remove it (the next save writes it anew)", path, "chunk")
        meta = os.pread(fd, 8 * (rows + emptied), meta_off)
        if _crc32(meta) != meta_crc:
            raise CacheFileError(f"{path} is damaged: the indices of the save record at byte "
                                 f"{start} fail their check; remove it", path, "chunk")
        idx = np.frombuffer(meta, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= dataset_len):
            raise CacheFileError(f"{path} is damaged: the save record at byte {start} names "
                                 f"indices outside [0, {dataset_len}); remove it", path, "chunk")
        chunks.append({"start": start, "rows": rows, "rows_crc": rows_crc,
                       "indices": idx[:rows], "emptied": idx[rows:]})
        end = start
    if len(chunks) != sup["chunks"]:
        raise CacheFileError(f"{path} is damaged: {len(chunks)} save records, but its header "
                             f"counts {sup['chunks']}; remove it", path, "chunk")
    return chunks[::-1]


def _damaged_rows(path: str, chunk: dict) -> CacheFileError:
    """The error for a save record whose rows fail their CRC (nothing of the file loads)."""
    return CacheFileError(f"{path} is damaged: the samples of the save record at byte "
                          f"{chunk['start']} fail their check; nothing of the file was loaded. "
                          "Remove it (the next save writes it anew)", path, "rows")


def _config_dims(cfg: dict) -> Any:
    """The ``data_dims`` of a saved file's configuration: a tuple, or a dict for fields."""
    fs = cfg.get("fields") or [["", [], "", 0]]
    if len(fs) == 1 and fs[0][0] == "":
        return tuple(fs[0][1])
    return {f[0]: tuple(f[1]) for f in fs}


def _config_dtypes(cfg: dict) -> Any:
    """The dtype of a saved file's configuration, by name ("uint8"), or a dict for fields."""
    fs = cfg.get("fields") or [["", [], "", 0]]
    if len(fs) == 1 and fs[0][0] == "":
        return fs[0][2]
    return {f[0]: f[2] for f in fs}


def describe_saved_file(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """What a file written by ``SharedCache.save`` holds, read from its header and its save
    records' indices (a few KiB), without loading it: what ``python -m stocaching inspect``
    shows.

    Args:
        path: the saved file.
        verify: also read every sample row and check it against its CRC (reads the whole
            file), as ``load_from`` does. Default: False (the header, the configuration and
            the indices are checked; the rows are not read).

    Returns:
        A dict with ``path``, ``key``, ``dataset_len``, ``data_dims`` (a tuple, or a dict of
        fields), ``dtype`` (its name, or a dict), ``node_rank`` and ``num_nodes`` (of the job
        that saved it), ``samples`` (samples a load would take: the last record of each
        index, less those emptied), ``rows`` (sample rows in the file, replaced ones
        included), ``saves`` (save records: 1 for a file written anew, one more per
        incremental save), ``bytes`` (the committed size), ``age_s`` (seconds since it was
        last saved to) and ``verified`` (True where ``verify`` read every row).

    Raises:
        TypeError: ``path`` is not a str or path.
        FileNotFoundError: there is no file at ``path``.
        CacheFileError: the file is truncated, damaged or not a saved cache.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path should be a str or os.PathLike, but got path={path!r}")
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        sup = _read_super(fd, path)
        cfg = _read_config(fd, sup, path)
        try:
            dataset_len, row_bytes = int(cfg["dataset_len"]), int(cfg["row_bytes"])
        except (KeyError, TypeError, ValueError):
            raise CacheFileError(f"{path}: its configuration block is damaged; remove it",
                                 path, "config") from None
        chunks = _read_chunks(fd, sup, path, dataset_len, row_bytes)
        held = np.zeros(dataset_len, bool)
        for c in chunks:
            held[c["indices"]] = True
            held[c["emptied"]] = False
        if verify:
            buf = bytearray(min(_SAVE_IO, max((c["rows"] * row_bytes for c in chunks),
                                              default=0)))
            for c in chunks:
                crc, off, end = 0, c["start"], c["start"] + c["rows"] * row_bytes
                while off < end:
                    view = memoryview(buf)[:min(len(buf), end - off)]
                    _pread_into(fd, view, off, path)
                    crc, off = _crc32(view, crc), off + len(view)
                if crc != c["rows_crc"]:
                    raise _damaged_rows(path, c)
    finally:
        os.close(fd)
    return {"path": path, "key": cfg.get("key"), "dataset_len": dataset_len,
            "data_dims": _config_dims(cfg), "dtype": _config_dtypes(cfg),
            "node_rank": cfg.get("node_rank"), "num_nodes": cfg.get("num_nodes"),
            "samples": int(np.count_nonzero(held)), "rows": sup["rows"],
            "saves": sup["chunks"], "bytes": sup["end"], "age_s": time.time() - st.st_mtime,
            "verified": verify}


def _stale_temporaries(path: str) -> list[str]:
    """Temporary files of saves to ``path`` whose process is gone (killed mid-save)."""
    d, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.(\d+)\.[0-9a-f]+\.tmp$")
    found = []
    with contextlib.suppress(OSError):
        for fname in os.listdir(d):
            m = pattern.match(fname)
            if m and not process_alive(int(m.group(1)), 0):
                found.append(os.path.join(d, fname))
    return found


@dataclasses.dataclass
class _SaveState:
    """What this process knows of the file it saved to (or loaded from) last: the file's
    identity and commit, and per slot the sequence number it had when the file last took it
    (a slot whose number differs has changed since) and whether the file holds its sample."""

    path: str
    dev: int
    ino: int
    gen: int
    end: int
    chunks: int
    rows: int  # rows in the file, the replaced ones included
    seq: np.ndarray
    held: np.ndarray


_SAVE_LOCK = threading.Lock()  # one save at a time in a process


# ----------------------------------------------------------------------------------------------
# Saving and loading a cache (_SavedFileWriter, _SavedFileReader)
# ----------------------------------------------------------------------------------------------


class _SavedFileWriter:
    """Writes one cache's filled slots to a saved file (``SharedCache.save``): a new file the
    first time in a process (or when the file holds mostly replaced records), else one chunk
    of what changed since the save (or load) the cache's ``_saved_file`` describes. Made for
    one call; the cache keeps only its ``_saved_file``."""

    cache: SharedCache

    def __init__(self, cache: SharedCache) -> None:
        self.cache = cache

    def save(self, path: str) -> dict[str, Any]:
        """Save to ``path`` (under ``_SAVE_LOCK``): what ``SharedCache.save`` returns, but
        ``path`` and ``saved``."""
        found = self._state_of(path)
        if found is None:
            return {**self._write_anew(path), "rewritten": True}
        state, fd = found
        try:
            return self._append_changes(state, fd, path)
        finally:
            os.close(fd)

    def _state_of(self, path: str) -> tuple[_SaveState, int] | None:
        """The state of the last save to (or load from) ``path`` in this process and the
        file, open and locked, if the file is still the one it describes and not mostly
        replaced records; else None (the save writes it anew)."""
        c = self.cache
        state = c._saved_file
        if state is None or state.path != os.path.realpath(path):
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (another process that appends to it waits)
            st = os.fstat(fd)
            sup = _read_super(fd, path)
            same = (st.st_dev, st.st_ino, sup["gen"], sup["end"]) == \
                (state.dev, state.ino, state.gen, state.end)
            compact = state.rows > 2 * int(np.count_nonzero(state.held)) + 1024
        except (OSError, CacheFileError):
            same = False
        if not same or compact:
            os.close(fd)
            return None
        return state, fd

    def config(self) -> dict[str, Any]:
        """What a saved file says of the samples it holds, checked by ``load_from``."""
        c = self.cache
        lay = c._layout
        fields = c._fields or (Field("", c._dims, c._dtype, 0, c._slot_bytes),)
        return {"key": c._key, "dataset_len": lay.dataset_len,
                "fields": [[f.name, list(f.dims), str(f.dtype).replace("torch.", ""),
                            f.offset] for f in fields],
                "row_bytes": c._slot_bytes, "segment_layout_version": LAYOUT_VERSION,
                "node_rank": c._world.node_rank, "num_nodes": lay.num_nodes,
                "slots": lay.slots, "layout_seed": lay.seed,
                "random_subset": lay.random_subset}

    def _write_anew(self, path: str) -> dict[str, Any]:
        """A first save (or a compaction): a new file under a temporary name, renamed over
        ``path`` once complete and synced."""
        c = self.cache
        for old in _stale_temporaries(path):  # left by saves that were killed
            with contextlib.suppress(OSError):
                os.unlink(old)
        config = json.dumps(self.config()).encode()
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            pwrite_all(fd, config, _CONFIG_OFF)
            first = _CONFIG_OFF + _align(len(config))
            n = c._layout.slots
            chunk = self._write_chunk(fd, first, np.arange(n), np.zeros(n, np.uint32),
                                      np.zeros(n, bool))
            rows = chunk["samples"]
            end, chunks = (chunk["end"], 1) if rows else (first, 0)
            pwrite_all(fd, _pack_super(1, end, chunks, config, rows), _super_off(1))
            os.ftruncate(fd, end)
            os.fsync(fd)
            st = os.fstat(fd)
            os.replace(tmp, path)
        except BaseException:
            close_fd(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        _fsync_dir(path)
        c._saved_file = _SaveState(os.path.realpath(path), st.st_dev, st.st_ino, 1, end, chunks,
                                   rows, chunk["seq"], chunk["held"])
        logger.info("stocaching: saved %d samples of cache %r to %s (%s)", rows, c._name,
                    path, fmt_bytes(end))
        return {"samples": rows, "bytes": end}

    def _append_changes(self, state: _SaveState, fd: int, path: str) -> dict[str, Any]:
        """An incremental save: one chunk of what changed since ``state``, appended past the
        committed end, synced, then committed by the superblock not in force."""
        c = self.cache
        changed = np.flatnonzero(c._slot_versions_np[:c._layout.slots] != state.seq)
        if not changed.size:
            return {}
        chunk = self._write_chunk(fd, state.end, changed, state.seq, state.held)
        if not chunk["samples"] and not chunk["emptied"]:  # (written and emptied since)
            state.seq, state.held = chunk["seq"], chunk["held"]
            return {}
        os.fdatasync(fd)
        config_len = _read_super(fd, path)["config_len"]
        config = os.pread(fd, config_len, _CONFIG_OFF)
        gen, rows = state.gen + 1, state.rows + chunk["samples"]
        written = chunk["end"] - state.end
        written += pwrite_all(fd, _pack_super(gen, chunk["end"], state.chunks + 1, config,
                                              rows), _super_off(gen))
        os.fdatasync(fd)
        c._saved_file = _SaveState(state.path, state.dev, state.ino, gen, chunk["end"],
                                   state.chunks + 1, rows, chunk["seq"], chunk["held"])
        logger.info("stocaching: saved %d more samples of cache %r to %s (%d emptied, %s)",
                    chunk["samples"], c._name, path, chunk["emptied"], fmt_bytes(written))
        return {"samples": chunk["samples"], "emptied": chunk["emptied"], "bytes": written}

    def _write_chunk(self, fd: int, start: int, slots: np.ndarray, seq: np.ndarray,
                     held: np.ndarray) -> dict[str, Any]:
        """Write one chunk at ``start``: the complete samples of ``slots`` (each read with
        the seqlock, as ``get_slot`` reads), and the indices of those the file holds
        (``held``, per slot) that are not complete samples now. Returns its end, the counts,
        and the per-slot sequence numbers (``seq`` as the file took them) and ``held`` for
        the next save."""
        c = self.cache
        indices = c._layout.indices(c._world.node_rank)
        seq, held = seq.copy(), held.copy()
        before = c._slot_versions_np[slots]  # (read before the states, as the seqlock reads)
        filled = c._index_states_np[indices[slots]] == SET
        seq[slots[~filled]] = before[~filled]  # empty at that number: changed if it moves
        rows = _slot_rows(c)
        per = max(1, _SAVE_IO // max(1, rows.shape[1]))
        todo = slots[filled]
        buf = np.empty((min(per, len(todo)), rows.shape[1]), np.uint8)
        off, crc, kept = start, 0, []
        for k in range(0, len(todo), per):
            sl = todo[k: k + per]
            located = c._locate(indices[sl])  # (rows: the slots sl, as the file has them)
            np.take(rows, located.rows, axis=0, out=buf[:len(sl)], mode="clip")
            good, got = c._confirm(located, count=False), located.versions
            data = buf[:len(sl)] if good.all() else buf[:len(sl)][good]
            off += pwrite_all(fd, data, off)
            crc = _crc32(data, crc)
            kept.append(sl[good])
            seq[sl] = got
        kept_slots = np.concatenate(kept) if kept else np.zeros(0, np.int64)
        gone = slots[held[slots]]
        gone = gone[~np.isin(gone, kept_slots)]
        held[gone] = False
        held[kept_slots] = True
        meta = np.concatenate([indices[kept_slots], indices[gone]]).astype(np.int64)
        off += pwrite_all(fd, meta, off)
        end = _align(off + _TRAILER_BYTES)
        pwrite_all(fd, _pack_trailer(len(kept_slots), len(gone), rows.shape[1], start, crc,
                                     _crc32(meta)), end - _TRAILER_BYTES)
        return {"end": end, "samples": len(kept_slots), "emptied": len(gone), "seq": seq,
                "held": held}


class _SavedFileReader:
    """Fills a new segment from a saved file (``load_from=``), checked first against the
    cache's configuration (``mismatch``) and every row against its CRC. Made for one call."""

    cache: SharedCache

    def __init__(self, cache: SharedCache) -> None:
        self.cache = cache

    def load(self, path: str, data_off: int, *, reserved: bool) -> None:
        """Fill this new segment (not yet public: nobody reads it) from the saved file at
        ``path``: every sample of an index that has a slot here, the last record of each;
        a sample's state is set only once every row of the file has passed its check.
        ``data_off``: where the slots start in the segment; ``reserved``: whether its slots'
        memory is reserved yet (if not, it is before the first write through the mapping).

        Rows that go to consecutive slots are copied by the kernel straight from the file
        into the segment (``_send_into``), the others read into a buffer and scattered, by
        up to ``_LOAD_THREADS`` threads (``_copy``), each checking what it copied while it is
        in its CPU's cache; a chunk's CRC is then put together from its parts' and checked
        (see docs/design.md, "Loading a saved file")."""
        cache = self.cache
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            logger.info("stocaching: no saved file at %s: cache %r starts empty", path,
                        cache._name)
            return
        try:
            t0 = time.perf_counter()
            st = os.fstat(fd)
            sup = _read_super(fd, path)
            mismatch = self.mismatch(_read_config(fd, sup, path), path)
            if mismatch is not None:
                if cache._on_mismatch != "replace":
                    raise mismatch
                logger.warning("stocaching: ignored the saved file %s: %s", path,
                               mismatch.args[0])
                return
            rows = _slot_rows(cache)
            row_bytes = rows.shape[1]
            chunks = _read_chunks(fd, sup, path, cache._dataset_len, row_bytes)
            indices = cache._layout.indices(cache._world.node_rank)
            slot_of = np.full(cache._dataset_len, -1, np.int64)
            slot_of[indices] = np.arange(len(indices))
            last = np.full(cache._dataset_len, -1, np.int64)  # the record in force of each index
            first = 0
            for c in chunks:
                c["first"] = first
                last[c["indices"]] = first + np.arange(c["rows"])
                last[c["emptied"]] = -1
                first += c["rows"]
            per = max(1, _LOAD_PIECE // max(1, row_bytes))
            plans = [_ChunkPlan(c, slot_of, last, per) for c in chunks]
            if not reserved and any(p.scattered.any() for p in plans):  # (written through
                cache._segment.reserve(cache, cache._segment.fd, cache._segment.size)  # the map)
            self._copy(plans, fd, path, data_off, rows)
            loaded = np.zeros(len(indices), bool)
            for c, p in zip(chunks, plans):
                crc = 0
                for part in p.copied:
                    crc = _crc32_combine(crc, part.crc, part.rows * row_bytes)
                if crc != c["rows_crc"]:
                    raise _damaged_rows(path, c)
                loaded[p.target[p.live]] = True
            cache._index_states_np[indices[loaded]] = SET
        finally:
            os.close(fd)
        seq = cache._slot_versions_np[:cache._layout.slots].copy()
        cache._saved_file = _SaveState(os.path.realpath(path), st.st_dev, st.st_ino, sup["gen"],
                                       sup["end"], sup["chunks"], sup["rows"], seq, loaded)
        took = time.perf_counter() - t0
        logger.info("stocaching: loaded %d samples of cache %r from %s (%s in %.2f s)",
                    int(np.count_nonzero(loaded)), cache._name, path, fmt_bytes(sup["end"]),
                    took)

    def _copy(self, plans: list[_ChunkPlan], fd: int, path: str, data_off: int,
              rows: np.ndarray) -> None:
        """Copy every row of ``plans`` into the segment and set each part's CRC (the parts
        in each plan's ``copied``): a chunk's parts are shared among threads, each with its
        own descriptors of the file and of the segment (its own readahead and, for
        ``sendfile``, its own position), reading its share in file order. The first error
        of any thread is raised, once every thread has stopped."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        threads = max(1, min(_LOAD_THREADS, cpus))
        shares: list[list[tuple[_ChunkPlan, _LoadPart]]] = []
        for p in plans:
            p.copied = p.parts(threads, rows.shape[1])
            for j, part in enumerate(p.copied):
                if j == len(shares):
                    shares.append([])
                shares[j].append((p, part))
        handles = [(fd, self.cache._segment.fd)]
        try:
            for _ in shares[1:]:
                handles.append((_reopen(fd), _reopen(self.cache._segment.fd)))
        except OSError:  # (no /proc: one thread copies every part, in file order)
            shares = [[job for p in plans for job in ((p, q) for q in p.copied)]]
        stop = threading.Event()
        try:
            if len(shares) == 1:
                self._copy_share(shares[0], *handles[0], path, data_off, rows, stop)
                return
            with concurrent.futures.ThreadPoolExecutor(len(shares) - 1,
                                                       "stocaching-load") as pool:
                done = [pool.submit(self._copy_share, share, *h, path, data_off, rows, stop)
                        for share, h in zip(shares[1:], handles[1:])]
                try:
                    self._copy_share(shares[0], *handles[0], path, data_off, rows, stop)
                finally:
                    errors = [f.exception() for f in done]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        finally:
            for src, seg in handles[1:]:
                close_fd(src)
                close_fd(seg)

    def _copy_share(self, share: list[tuple[_ChunkPlan, _LoadPart]], src_fd: int,
                    seg_fd: int, path: str, data_off: int, rows: np.ndarray,
                    stop: threading.Event) -> None:
        """One thread's parts, in order, piece by piece: a straight piece goes into its
        slots (``sendfile`` where it can) and is checked there in ``_LOAD_PIECE`` bytes at a
        time, another is read into a buffer, checked and its live rows scattered. Stops
        early once ``stop`` is set; sets it when it fails."""
        row_bytes = rows.shape[1]
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        flat = rows.reshape(-1)
        buf = None
        try:
            for plan, part in share:
                crc = 0
                for first in range(part.first, part.first + part.rows, plan.per):
                    if stop.is_set():
                        return
                    n = min(plan.per, part.first + part.rows - first)
                    off = plan.start + first * row_bytes
                    if plan.straight[first // plan.per]:
                        at = int(plan.target[first]) * row_bytes
                        for k in range(0, n * row_bytes, _LOAD_PIECE):
                            m = min(_LOAD_PIECE, n * row_bytes - k)
                            dst = flat[at + k: at + k + m]
                            if _SENDFILE:
                                self._send_rows(seg_fd, data_off + at + k, src_fd, off + k, m,
                                                path)
                            else:
                                _pread_into(src_fd, memoryview(dst), off + k, path)
                            crc = _crc32(dst, crc)
                    else:
                        if buf is None:
                            buf = np.empty((plan.per, row_bytes), np.uint8)
                        got = buf[:n]
                        _pread_into(src_fd, memoryview(got).cast("B"), off, path)
                        crc = _crc32(got, crc)
                        live = plan.live[first: first + n]
                        rows[plan.target[first: first + n][live]] = got[live]
                part.crc = crc
        except BaseException:
            stop.set()
            raise

    def _send_rows(self, seg_fd: int, dst_off: int, src_fd: int, src_off: int, nbytes: int,
                   path: str) -> None:
        """``_send_into`` this segment (open at ``seg_fd``); a full filesystem raises
        ``CacheCapacityError``."""
        cache = self.cache
        try:
            _send_into(seg_fd, dst_off, src_fd, src_off, nbytes, path)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            shm_dir = os.path.dirname(cache._path)
            raise cache._capacity_error(shm_dir, cache._segment.size,
                                        free_bytes(shm_dir)) from None

    def mismatch(self, theirs: dict, path: str) -> CacheConfigError | None:
        """The first difference between a saved file's configuration and this cache's that
        makes its samples not this cache's, as the error that names it; None if none."""
        mine = _SavedFileWriter(self.cache).config()
        for label, exp, got in (
                ("key", mine["key"], theirs.get("key")),
                ("dataset_len", mine["dataset_len"], theirs.get("dataset_len")),
                ("data_dims", _config_dims(mine), _config_dims(theirs)),
                ("dtype", _config_dtypes(mine), _config_dtypes(theirs)),
                ("layout", (mine["fields"], mine["row_bytes"]),
                 (theirs.get("fields"), theirs.get("row_bytes")))):
            if exp != got:
                return CacheConfigError(
                    f"the saved file {path} holds {label}={got!r}, but this cache has "
                    f"{label}={exp!r}: its samples are not this cache's. Pass another "
                    "load_from=, or on_mismatch='replace' to start empty instead (the next "
                    "save writes the file anew)", label, exp, got)
        return None


# ----------------------------------------------------------------------------------------------
# A cache's method of saving (SharedCache.save)
# ----------------------------------------------------------------------------------------------


def save(self, path: str | os.PathLike) -> dict[str, Any]:
    """Write the filled slots of this node to ``path``, atomically, for a later
    ``SharedCache(..., load_from=path)`` (after a reboot, or on another machine).

    The first save to a path in this process writes a new file under a temporary name
    in the same directory, syncs it and renames it over ``path``. A later save to the
    same path (by this process, or after this cache was loaded from it) appends only what
    changed since: the samples filled (or overwritten) since, and the indices emptied
    since; an unchanged cache writes nothing, so calling it every epoch costs a compare of
    the slots' sequence numbers. When the file holds more replaced records than live
    ones it is written anew. Either way a save killed at any point leaves the previous
    state of the file loadable (or, for a first save, no file at ``path``), and a
    truncated or damaged file is refused by ``load_from`` rather than loaded in part.

    Only slots whose write is complete are saved (each is read as ``get_slot`` reads
    it); a slot being written meanwhile is left for the next save. Training may go on in
    other processes and threads during a save. Staged samples (``stage``: a prefetcher's
    samples of indices without a slot, held until it hands them over) are not saved:
    they belong to this job's prefetchers and last an epoch at most.

    Under DDP, only the local leader (LOCAL_RANK 0) writes: on the other local ranks the
    call returns at once and writes nothing (it is not a barrier). With several nodes,
    each node saves its own slots: give each node its own path, e.g. on a shared
    filesystem ``"cache-{node}.stc"`` (``{node}`` is replaced by the node's rank, in
    ``load_from`` as well).

    Args:
        path: the file to write; ``{node}`` in it becomes this node's rank.

    Returns:
        A dict with ``path`` (as written), ``samples`` (samples written now), ``emptied``
        (indices recorded as emptied), ``bytes`` (bytes written to the file), ``rewritten``
        (True when the file was written anew) and ``saved`` (False on a rank that does
        not save).

    Raises:
        TypeError: ``path`` is not a str or path.
        FileNotFoundError: ``path``'s directory does not exist (nothing is written).
        OSError: the file cannot be written (the previous state stays in force).
        NotImplementedError: a cache with open sizes (None in ``data_dims``).
    """
    self._check_open()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path should be a str or os.PathLike, but got path={path!r}")
    path = os.fspath(path).replace("{node}", str(self._world.node_rank))
    out = {"path": path, "samples": 0, "emptied": 0, "bytes": 0, "rewritten": False,
           "saved": self._world.is_local_leader}
    if not self._world.is_local_leader:
        return out
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, f"path should be a file in an existing "
                                f"directory, but got path={path!r} ({folder} is not a "
                                "directory)", path)
    with _SAVE_LOCK:
        out.update(_SavedFileWriter(self).save(path))
    return out


def _slot_rows(self: Any) -> np.ndarray:
    """The bytes of every slot (not the staging slots): one row per slot."""
    n = self._layout.slots
    if not n:
        return np.empty((0, self._slot_bytes), np.uint8)
    return self._slot_samples[:n].reshape(n, -1).view(np.uint8)
