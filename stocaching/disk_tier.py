"""The disk tier of a cache (``SharedCache(..., disk_tier=dir)``): the rows of the indices
without a slot, in a sparse file on local disk that every local rank shares.

A feature module of stocaching (see the core's section "The seam"): the cache holds a
``_DiskTier`` as its ``_disk_tier`` and asks it for rows (``read``, ``read_for_stager``),
stores them (``store``, ``set_value``), clears and closes it; ``clean_segments(disk_tier=)``
calls ``_clean_tier_files``.

Keywords:
    disk_tier: a directory on local disk (an NVMe) for a second tier behind the segment: the
        sample of an index without a slot on this node is written to a file there when
        ``set_slot`` stores it, and ``get_slot`` reads it from there on later misses (a new
        tensor, even with ``copy=False``), for every local rank and DataLoader worker;
        ``stats()`` counts its hits in ``hits`` and also apart, ``disk_hits``. The file
        (``stocaching-tier_<uid>_<job>_n<node>_<name>``, owner-only) is sparse: only stored
        rows take disk. It is freed with the cache's last process (its name is dropped once
        every local rank has opened it), kept under the cache's name with ``persistent`` (the
        next job reads what this one stored at once: remove it with ``python -m stocaching
        clean --persistent NAME --disk-tier DIR``), and a file left by a job killed early is
        removed by ``clean --disk-tier DIR``. With several nodes each node's tier holds its
        own share of the indices that no node holds in memory, and ``CacheAwareSampler``
        routes them there (``owner_rows``). A full disk leaves a sample untiered (logged
        once), never an error. ``get_batch`` and ``locate`` see tier rows as misses: the
        Dataset's fallback reads them with ``get_slot``. Reads go through the page cache,
        which yields to /dev/shm; it is not counted by ``size_limit_gib="auto"``. A
        ``disk_tier`` that is not an existing directory raises ValueError, one where no file
        can be made (read-only, not this user's) OSError; nothing is left behind. Default:
        None, no disk tier.
    disk_tier_gib: the disk tier's budget in GiB for its rows: the first of this node's share
        of indices that it pays for get a row (the metadata, about 9 bytes per dataset index,
        comes on top). A disk with less free space only warns: rows that find it full are not
        stored. Not a positive number, or without ``disk_tier``: a ValueError, and nothing is
        made. Default: None, a row for every index of the node's share.
"""

from __future__ import annotations

__all__ = []
STOCACHING_FEATURE = "disk_tier"  # (the core reads this line before it imports the file)

import contextlib
import errno
import fcntl
import math
import mmap
import os
import secrets
import struct
import threading
import warnings
import weakref
from typing import Any, Iterator, Sequence

import numpy as np

try:  # inside the package
    from .stocaching import (BYTES_PER_GIB, EMPTY, HEADER_BYTES, KEY_OFF, MEMORY_FILESYSTEMS,
                             PERSISTENT_JOB_KEY, SEGMENT_PREFIX, WRITING, CacheConfigError,
                             CacheLayout, CacheTimeoutError, Closed, RecordLocks, SharedCache,
                             World, check_positive, claim_stats_row, close_fd, fmt_bytes,
                             free_bytes, fs_type, hash_of_key, is_stale_file, logger, names_file,
                             open_existing, open_leaders_file, parse_segment_name, try_stale,
                             unlink_if_same)
except ImportError:  # copied beside stocaching.py
    from stocaching import (BYTES_PER_GIB, EMPTY, HEADER_BYTES, KEY_OFF, MEMORY_FILESYSTEMS,
                            PERSISTENT_JOB_KEY, SEGMENT_PREFIX, WRITING, CacheConfigError,
                            CacheLayout, CacheTimeoutError, Closed, RecordLocks, SharedCache,
                            World, check_positive, claim_stats_row, close_fd, fmt_bytes,
                            free_bytes, fs_type, hash_of_key, is_stale_file, logger, names_file,
                            open_existing, open_leaders_file, parse_segment_name, try_stale,
                            unlink_if_same)


# ----------------------------------------------------------------------------------------------
# A disk tier: rows of the indices without a slot, in a sparse file on local disk
# ----------------------------------------------------------------------------------------------


#
# One file per cache and node, in the disk_tier directory, named like the segment with the
# prefix "stocaching-tier_":
#   [header, 4 KiB: magic, fields, a persistent cache's key at KEY_OFF][stats table]
#   [states: 1 byte per dataset index][versions: uint32 per dataset index]
#   [position map: int32/int64 per dataset index, -1 where the tier holds none][pad to a page]
#   [rows: row_bytes each, at data_off + position * row_bytes]
# The file is ftruncated to its whole size and only written rows take disk (a sparse file).
# Everything before data_off is mapped shared by every process; the rows are read with
# os.preadv and written with os.pwrite, through the page cache. A row is written under a
# POSIX record lock on its index's byte (offsets past the end of the file, as the segment's;
# the kernel drops the lock of a writer that dies): the writer makes the index's version odd
# and its state WRITING, writes the row, sets the state READY, and makes the version even.
# A reader takes no lock: state READY and an even version, the row read, then the same
# version and state again, or a miss. A writer killed mid-row leaves WRITING and an odd
# version: never served, and the next writer (who holds the lock) writes it again. A shared
# flock held by every process using the file tells a live file from a stale one for `clean`.

_TIER_PREFIX = SEGMENT_PREFIX + "-tier"
_TIER_MAGIC = b"STOCTIER"
_TIER_VERSION = 1
_TIER_FIELDS = (
    "version", "row_bytes", "dataset_len", "rows", "rows_cap", "slots", "num_nodes", "node_rank",
    "layout_seed", "random_subset", "config_hash", "persistent", "key_hash", "uid", "boot",
    "local_world_size", "attached", "ready", "stats_off", "states_off", "versions_off",
    "map_off", "data_off", "total_bytes",
)
_TIER_HEADER = struct.Struct("<8s" + "q" * len(_TIER_FIELDS))
_TIER_FIELD_OFFSET = {f: 8 + 8 * i for i, f in enumerate(_TIER_FIELDS)}
# What a job checks when it opens a tier another process made (the rest is where things are).
_TIER_CONFIG = ("version", "row_bytes", "dataset_len", "rows", "rows_cap", "slots", "num_nodes",
                "node_rank", "layout_seed", "random_subset", "config_hash", "persistent",
                "key_hash", "uid")
_TIER_STATS_ROWS = 1024
_TIER_STATS_COLS = 5  # pid, process start, disk hits, rows written, rows read by read_tier
_TIER_HITS, _TIER_WRITES, _TIER_READS = 2, 3, 4
_TIER_READY = 1  # a state: EMPTY, WRITING as the segment's; READY where the segment has SET
_TIER_LOCK_BASE = 1 << 50  # lockf offsets: the header's, then one byte per dataset index


def _tier_indices(layout: CacheLayout, node_rank: int, rows: int | None = None) -> np.ndarray:
    """The dataset indices whose rows node ``node_rank``'s disk tier holds, in row order:
    those of the node's share without a slot in memory. With one node, every index without
    a slot (in index order, or in the layout's permutation with ``random_subset``); with
    several, the layout's permutation goes on being dealt after the memory deal: the entries
    past ``num_nodes * slots`` are cut into ``num_nodes`` contiguous runs, node k taking run k
    (disjoint, none held in memory anywhere; nothing when the memory deal covers the
    dataset). ``rows`` keeps the first ``rows`` of them (a tier budget), default all."""
    n, s, k = layout.dataset_len, layout.slots, layout.num_nodes
    if layout.is_prefix:
        share = np.arange(s, n, dtype=np.int64)
    elif k == 1:
        share = layout._perm()[s:].astype(np.int64, copy=False)
    elif k * s >= n:
        share = np.empty(0, np.int64)
    else:
        per = -(-(n - k * s) // k)
        lo = k * s + node_rank * per
        share = layout._perm()[lo: min(n, lo + per)].astype(np.int64, copy=False)
    return share if rows is None else share[:rows]


def _tier_cap(row_bytes: int, disk_tier_gib: float | None) -> int:
    """The most rows a disk tier of any node has: those ``disk_tier_gib`` pays for (rows
    only: the metadata, about 9 bytes per dataset index, comes on top), -1 for no limit."""
    if disk_tier_gib is None:
        return -1
    return int(disk_tier_gib * BYTES_PER_GIB) // max(1, row_bytes)


def _tier_share(layout: CacheLayout, node_rank: int, cap: int) -> np.ndarray:
    """The indices with a row on node ``node_rank``'s disk tier of at most ``cap`` rows (-1:
    no limit): the first of its share."""
    return _tier_indices(layout, node_rank, None if cap < 0 else cap)


def _tier_offsets(dataset_len: int, rows: int, row_bytes: int) -> dict:
    """Where each part of a tier file starts, and its total size (see the layout above)."""
    stats_off = HEADER_BYTES
    states_off = stats_off + _TIER_STATS_ROWS * _TIER_STATS_COLS * 8
    versions_off = states_off + (dataset_len + 7) // 8 * 8
    map_off = versions_off + (dataset_len * 4 + 7) // 8 * 8
    map_item = 4 if rows < 2**31 else 8
    data_off = map_off + dataset_len * map_item
    data_off = (data_off + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    return {"stats_off": stats_off, "states_off": states_off, "versions_off": versions_off,
            "map_off": map_off, "data_off": data_off, "total_bytes": data_off + rows * row_bytes}


def _boot_id() -> int:
    """This boot of the machine, as 63 bits: a tier file kept across a reboot may hold a
    READY state whose row never reached the disk, so its states are dropped then."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return hash_of_key(f.read().strip().decode())
    except OSError:
        return 0


def _tier_path(disk_tier: str, segment_path: str) -> str:
    """The one place that names tier files: the segment's name with the tier's prefix."""
    return os.path.join(disk_tier, _TIER_PREFIX + os.path.basename(segment_path)[
        len(SEGMENT_PREFIX):])


def _check_disk_tier(disk_tier: Any, disk_tier_gib: Any) -> tuple[str | None, float | None]:
    """The constructor's ``disk_tier`` and ``disk_tier_gib``, checked before anything is
    made."""
    if disk_tier is None:
        if disk_tier_gib is not None:
            raise ValueError(f"disk_tier_gib is the budget of a disk tier, so it needs "
                             f"disk_tier= (a directory), but got disk_tier_gib={disk_tier_gib!r} "
                             "with disk_tier=None")
        return None, None
    if not isinstance(disk_tier, (str, os.PathLike)):
        raise TypeError(f"disk_tier should be the path of a directory on local disk, or None, "
                        f"but got disk_tier={disk_tier!r}")
    path = os.fspath(disk_tier)
    if not os.path.isdir(path):
        raise ValueError(f"disk_tier should be an existing directory on local disk, but got "
                         f"disk_tier={path!r}, which is not a directory")
    if disk_tier_gib is not None:
        disk_tier_gib = check_positive("disk_tier_gib", disk_tier_gib, "GiB, or None for "
                                       "room for every index without a slot")
    fstype = fs_type(path)
    if fstype in MEMORY_FILESYSTEMS:
        warnings.warn(f"disk_tier={path!r} is on a {fstype} filesystem, in memory: the tier's "
                      "rows then take the RAM that the cache's segment could hold faster. Put "
                      "the disk tier on local disk (an NVMe), or give the segment more "
                      "size_limit_gib instead.", RuntimeWarning, stacklevel=3)
    return path, disk_tier_gib


class _DiskTier(RecordLocks):
    """The disk tier of one cache on one node: the rows of dataset indices that have no slot
    in the node's segment, in a sparse file on local disk shared by every local rank and
    DataLoader worker (see the layout above). The cache holds it and calls ``read`` where an
    index has no slot, ``store`` where ``set_slot`` gets the sample of such an index,
    ``clear``, ``stats`` and ``close``; everything else (making, opening, sending to another
    process) is its own."""

    # -- state, by role ------------------------------------------------------------------
    # What it is: the same in every process.
    _path: str  # the file's name (gone once every local rank holds it, unless persistent)
    _cap: int  # the most rows of any node's tier (-1: no limit), for every node's share
    _row_dtype: np.dtype  # one row as the segment's rows: dtype and shape
    _row_shape: tuple
    _row_bytes: int
    _rows: int  # rows in the file
    _data_off: int
    # The mapped metadata: views of the same pages in every process.
    _mapping: mmap.mmap
    _states: memoryview  # one state byte per dataset index
    _states_np: np.ndarray
    _versions: memoryview  # one version per dataset index: odd while its row is written
    _versions_np: np.ndarray
    _positions: memoryview  # the row of each dataset index, -1 for none
    _stats_rows: np.ndarray
    # This process's own.
    _own_counters: memoryview
    _told: bool  # a failed write was logged
    _finalizer: weakref.finalize | None
    _file_id: tuple[int, int]

    @classmethod
    def open(cls, cache: "SharedCache", directory: str, disk_tier_gib: float | None
             ) -> "_DiskTier":
        """The tier of ``cache`` (constructed up to its segment) in ``directory``: the local
        leader makes it (or, persistent, attaches to the one of its name and key), the other
        local ranks attach to the leader's."""
        self = cls.__new__(cls)
        self._finalizer = None
        self._path = _tier_path(directory, cache._path)
        samples = cache._slot_samples
        self._row_dtype, self._row_shape = samples.dtype, tuple(samples.shape[1:])
        self._row_bytes = samples.dtype.itemsize * math.prod(self._row_shape)
        lay, world = cache._layout, cache._world
        cap = _tier_cap(self._row_bytes, disk_tier_gib)
        rows = len(_tier_share(lay, world.node_rank, cap))
        want = {"version": _TIER_VERSION, "row_bytes": self._row_bytes,
                "dataset_len": lay.dataset_len, "rows": rows, "rows_cap": cap, "slots": lay.slots,
                "num_nodes": lay.num_nodes, "node_rank": world.node_rank,
                "layout_seed": lay.seed, "random_subset": int(lay.random_subset),
                "config_hash": hash_of_key(cache._describe()),
                "persistent": int(cache._persistent),
                "key_hash": hash_of_key(cache._key) if cache._persistent else 0,
                "uid": os.getuid(), "boot": _boot_id(),
                "local_world_size": world.local_world_size, "attached": 1, "ready": 0,
                **_tier_offsets(lay.dataset_len, rows, self._row_bytes)}
        if not world.is_local_leader:
            self._attach(want, cache._timeout)
        elif cache._persistent:
            self._open_persistent(want, cache, directory)
        else:
            self._create(want, lay, world, directory, publish=world.local_world_size > 1)
        logger.info("stocaching: the disk tier of cache %r holds up to %d rows of %s in %s "
                    "(%d stored now)", cache._name, self._rows, fmt_bytes(self._row_bytes),
                    self._path, self.filled())
        return self

    # -- making, attaching ---------------------------------------------------------------

    def _create(self, want: dict, lay: CacheLayout, world: World, directory: str, *,
                publish: bool) -> bool:
        """Make the file under a temporary name, write its metadata and map it; then give it
        its name (``publish``: other local ranks or jobs look for it) or not (one process:
        the kernel frees it with the last descriptor, even after a SIGKILL). False when
        another process named one first (a persistent cache: attach to theirs)."""
        _clean_tier_files(directory)  # files of dead jobs: their disk is free room
        tmp = f"{self._path}.{os.getpid()}.{secrets.token_hex(4)}.init"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as e:
            raise OSError(e.errno, f"disk_tier should be a directory where this user can write "
                          f"files, but got disk_tier={directory!r}: making {tmp} failed "
                          f"({e.strerror})") from None
        st = os.fstat(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, want["total_bytes"])
            try:  # the mapped metadata: a store into a hole of a full disk would be a SIGBUS
                os.posix_fallocate(fd, 0, want["data_off"])
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise OSError(e.errno, f"disk_tier={directory!r} cannot hold the disk "
                                  f"tier's {fmt_bytes(want['data_off'])} of metadata "
                                  f"({e.strerror}); free some room there") from None
            data = want["rows"] * want["row_bytes"]
            free = free_bytes(directory)
            if data > free:
                warnings.warn(
                    f"disk_tier={directory!r} has {fmt_bytes(free)} free but the tier's "
                    f"{want['rows']} rows take {fmt_bytes(data)}: rows that find the disk "
                    "full are not stored (logged once) and stay misses. Free some room or pass "
                    "a smaller disk_tier_gib", RuntimeWarning, stacklevel=5)
            mm = mmap.mmap(fd, want["data_off"], mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
            head = dict(want)
            _TIER_HEADER.pack_into(mm, 0, _TIER_MAGIC, *(head[f] for f in _TIER_FIELDS))
            if head["persistent"]:
                key = self._key.encode()
                mm[KEY_OFF: KEY_OFF + len(key)] = key
            self._map(fd, mm, head)
            self._positions_np()[:] = -1
            held = _tier_share(lay, world.node_rank, want["rows_cap"])
            self._positions_np()[held] = np.arange(len(held))
            self._set("ready", 1)
            if publish:
                try:
                    os.link(tmp, self._path)
                except FileExistsError:
                    if want["persistent"]:
                        self.close()
                        return False
                    other = self._path
                    if not _tier_is_stale(other, remove=True, min_age=0.0):
                        raise CacheConfigError(
                            f"a live disk tier is already named {other}: another job or cache "
                            "uses the same job_key and name. Pass a distinct name= or set "
                            "STOCACHING_JOB_KEY per job", "name", other, other) from None
                    os.link(tmp, self._path)
        except BaseException:
            self.close() if self.fd == fd else close_fd(fd)
            raise
        finally:
            unlink_if_same(tmp, st.st_ino, st.st_dev)
        return True

    _key = ""  # a persistent cache's key, written into a new file's header

    def _open_persistent(self, want: dict, cache: "SharedCache", directory: str) -> None:
        """The local leader of a persistent cache: attach to the tier of this name if it holds
        this configuration and key (dropping its states after a reboot, or a mismatch: raise,
        or with on_mismatch="replace" make a new one), else make it."""
        self._key = cache._key
        for _ in range(5):
            try:
                fd = open_existing(self._path)
            except FileNotFoundError:
                if self._create(want, cache._layout, cache._world, directory, publish=True):
                    return
                continue
            except OSError as e:
                raise OSError(e.errno, f"disk_tier={directory!r}: cannot open the persistent "
                              f"tier {self._path} ({e.strerror})") from None
            alone = try_stale(fd)
            if not alone:
                fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                head = self._check(fd, want)
            except CacheConfigError as e:
                if cache._on_mismatch != "replace" or not alone:
                    os.close(fd)
                    raise
                st = os.fstat(fd)
                unlink_if_same(self._path, st.st_ino, st.st_dev)
                os.close(fd)
                logger.warning("stocaching: replaced the persistent disk tier %s: %s",
                               self._path, e.args[0])
                continue
            self._map(fd, mmap.mmap(fd, head["data_off"], mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE), head)
            if alone:
                if head["boot"] != want["boot"]:  # rows may not have reached the disk
                    self._states_np[:] = EMPTY
                    self._set("boot", want["boot"])
                self._states_np[self._states_np == WRITING] = EMPTY  # (killed writers)
                fcntl.flock(fd, fcntl.LOCK_SH)  # (flock drops the exclusive lock first)
            st = os.fstat(fd)
            if names_file(self._path, st.st_ino, st.st_dev):
                return
            self.close()  # removed meanwhile by a clean: look again
        raise CacheConfigError(f"could not open or make the persistent disk tier {self._path}: "
                               "it keeps changing", "name", cache._name, self._path)

    def _attach(self, want: dict, timeout: float) -> None:
        """Another local rank: open the leader's file by its name (waiting for it up to
        ``timeout``), check it, map it, and drop the name once every local rank holds it."""
        opened = open_leaders_file(self._path, timeout)
        if opened is None:
            raise CacheTimeoutError(
                f"waited {timeout:.0f} s for local rank 0 to make the disk tier "
                f"{self._path}, but it never arrived: construct the cache with the same "
                "disk_tier on every local rank", self._path, timeout)
        fd = opened[0]
        try:
            head = self._check(fd, want)
            self._map(fd, mmap.mmap(fd, head["data_off"], mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE), head)
        except BaseException:
            if self.fd == fd:
                self.close()
            else:
                os.close(fd)
            raise
        self.lock(_TIER_LOCK_BASE - 1)
        try:
            attached = self._get("attached") + 1
            self._set("attached", attached)
        finally:
            self.unlock(_TIER_LOCK_BASE - 1)
        if attached >= head["local_world_size"] and not head["persistent"]:
            unlink_if_same(self._path, self._file_id[1], self._file_id[0])

    def _check(self, fd: int, want: dict) -> dict:
        """The header of a tier file someone else made, checked against ``want``."""
        size = os.fstat(fd).st_size
        raw = os.pread(fd, _TIER_HEADER.size, 0)
        if len(raw) < _TIER_HEADER.size or _TIER_HEADER.unpack(raw)[0] != _TIER_MAGIC:
            raise CacheConfigError(f"{self._path} is not a stocaching disk tier", "magic",
                                   _TIER_MAGIC, raw[:8])
        head = dict(zip(_TIER_FIELDS, _TIER_HEADER.unpack(raw)[1:]))
        for field in _TIER_CONFIG:
            if head[field] != want[field]:
                raise CacheConfigError(
                    f"the disk tier {self._path} was made with {field}={head[field]}, but this "
                    f"cache asks for {field}={want[field]}: construct the cache with the same "
                    "arguments (and disk_tier_gib) on every local rank and job, or pass "
                    "another name=", field, want[field], head[field])
        if not head["ready"] or size < head["total_bytes"] or \
                any(head[k] != want[k] for k in ("states_off", "data_off", "total_bytes")):
            raise CacheConfigError(f"{self._path} is damaged or from another stocaching "
                                   "version", "layout", want["total_bytes"], head["total_bytes"])
        return head

    def _map(self, fd: int, mm: mmap.mmap, head: dict) -> None:
        """Build the views of the metadata and claim this process's stats row."""
        n = head["dataset_len"]
        self.fd, self._mapping = fd, mm
        st = os.fstat(fd)
        self._file_id = (st.st_dev, st.st_ino)
        self._rows, self._data_off, self._cap = head["rows"], head["data_off"], head["rows_cap"]
        view = memoryview(mm)
        self._states_np = np.frombuffer(mm, np.uint8, n, head["states_off"])
        self._states = view[head["states_off"]: head["states_off"] + n]
        self._versions_np = np.frombuffer(mm, np.uint32, n, head["versions_off"])
        self._versions = view[head["versions_off"]: head["versions_off"] + 4 * n].cast("I")
        item = "i" if head["rows"] < 2**31 else "q"
        self._positions = view[head["map_off"]: head["map_off"] + n * (4 if item == "i" else 8)
                               ].cast(item)
        self._stats_rows = np.frombuffer(mm, np.int64, _TIER_STATS_ROWS * _TIER_STATS_COLS,
                                         head["stats_off"]).reshape(_TIER_STATS_ROWS,
                                                                    _TIER_STATS_COLS)
        self.thread_lock = threading.RLock()
        self._told = False
        self._claim_stats_row()
        _LIVE_TIERS.add(self)
        self._finalizer = weakref.finalize(self, close_fd, fd)

    def _positions_np(self) -> np.ndarray:
        return np.frombuffer(self._positions, self._positions.format)

    def _get(self, field: str) -> int:
        return struct.unpack_from("<q", self._mapping, _TIER_FIELD_OFFSET[field])[0]

    def _set(self, field: str, value: int) -> None:
        struct.pack_into("<q", self._mapping, _TIER_FIELD_OFFSET[field], value)

    # -- locks, stats, processes -----------------------------------------------------------

    def _claim_stats_row(self) -> None:
        """This process's row of counters, as the segment's stats table has it."""
        free = claim_stats_row(self._stats_rows, self, _TIER_LOCK_BASE - 1, _TIER_HITS,
                               "disk tier")
        self._own_counters = memoryview(self._stats_rows[free])

    def after_fork(self) -> None:
        """In a forked child: a fresh thread lock and a stats row of its own."""
        super().after_fork()
        if self._finalizer is not None and self._finalizer.alive:
            try:
                self._claim_stats_row()
            except Exception:  # never break the child over statistics
                self._own_counters = memoryview(np.zeros(_TIER_STATS_COLS, np.int64))

    def __reduce__(self) -> tuple:
        """Sent to another process by multiprocessing's pickler (with the cache): a duplicate
        of the descriptor, which the receiver maps (the name may be gone already)."""
        from multiprocessing.reduction import DupFd

        return _rebuild_tier, (DupFd(self.fd), self._path, self._row_dtype.str,
                               self._row_shape)

    # -- rows -------------------------------------------------------------------------------

    def read(self, idx: int, count: int = _TIER_HITS) -> np.ndarray | None:
        """The row of ``idx`` (a new array, shaped as the segment's rows), or None: the tier
        holds none, or it is being written or cleared. No lock: the states and versions.
        Counted in the stats column ``count`` (a disk hit, or a read for a stager), or not
        (-1)."""
        if self._states[idx] != _TIER_READY:
            return None
        seq = self._versions[idx]
        if seq & 1:
            return None
        out = np.empty(self._row_shape, self._row_dtype)
        try:
            got = os.preadv(self.fd, [out], self._data_off +
                            self._positions[idx] * self._row_bytes)
        except OSError as e:
            self._tell("read", e)
            return None
        if got != self._row_bytes or self._versions[idx] != seq or \
                self._states[idx] != _TIER_READY:
            return None
        if count >= 0:
            self._own_counters[count] += 1
        return out

    def read_for_stager(self, idx: int) -> np.ndarray | None:
        """``read`` for a loader that fills staging slots: counted as a disk read, not a hit
        (the read that takes it once staged is one)."""
        return self.read(idx, _TIER_READS)

    def set_value(self, cache: Any, idx: int, value: Any, allow_overwrite: bool,
                  exist_ok: bool) -> None:
        """``set_slot`` of an index without a slot: its row here, as for a slot: rewritten
        with ``allow_overwrite``; else a stored row is kept when the value is the same (or
        with ``exist_ok``), and a different value raises."""
        src = cache._source_array(value)
        stored = self.store(idx, src, overwrite=allow_overwrite)
        before = self.read(idx, count=-1) if stored and not exist_ok else None
        if before is not None and not np.array_equal(
                before.reshape(-1).view(np.uint8),
                np.ascontiguousarray(src).reshape(-1).view(np.uint8)):
            raise RuntimeError(
                f"the disk tier's row of idx={idx} is already set to a different value; pass "
                "allow_overwrite=True to replace it, or exist_ok=True to keep it. (Two loads "
                "of one index that give different values mean that the load is not "
                "deterministic, most often random augmentation before the cache.)")

    def owner_rows(self, layout: CacheLayout) -> Iterator[np.ndarray]:
        """``layout.owner_rows()`` with each node's tier rows (those of its share that every
        node's tier of at most ``_cap`` rows holds) added to its row."""
        for k, row in enumerate(layout.owner_rows()):
            row[_tier_share(layout, k, self._cap)] = True
            yield row

    def store(self, idx: int, src: np.ndarray, *, overwrite: bool = False) -> bool:
        """Write ``src`` (a row's values) as the row of ``idx`` unless one is stored already
        (then True: ``read(idx, count=-1)`` gives it, to compare), or, with ``overwrite``,
        in its place (readers of the old row meanwhile get a miss). False when written, or
        when the tier has no row for ``idx``, or the write failed (logged once)."""
        pos = self._positions[idx]
        if pos < 0:
            return False
        if self._states[idx] == _TIER_READY and not overwrite:
            return True
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        lock = _TIER_LOCK_BASE + idx
        self.lock(lock)
        try:
            if self._states[idx] == _TIER_READY and not overwrite:
                return True
            seq = self._versions[idx]
            seq += seq & 1  # odd: left by a writer that died
            self._versions[idx] = (seq + 1) & 0xFFFFFFFF
            self._states[idx] = WRITING
            try:
                self._put(self._data_off + pos * self._row_bytes, data)
            except OSError as e:
                self._states[idx] = EMPTY
                self._versions[idx] = (seq + 2) & 0xFFFFFFFF
                self._tell("write", e)
                return False
            self._states[idx] = _TIER_READY
            self._versions[idx] = (seq + 2) & 0xFFFFFFFF
        finally:
            self.unlock(lock)
        self._own_counters[_TIER_WRITES] += 1
        return False

    def _put(self, offset: int, data: np.ndarray) -> None:
        """Write ``data`` at ``offset`` (a short write goes on where it stopped)."""
        view = memoryview(data)
        while len(view):
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def _tell(self, what: str, e: OSError) -> None:
        """A failed read or write: the sample is not tiered (a miss); logged once here."""
        if not self._told:
            self._told = True
            logger.warning("stocaching: the disk tier %s failed a %s (%s): such samples are "
                           "not stored there and load as misses; logged once per process",
                           self._path, what, e.strerror or e)

    def clear(self) -> None:
        """Empty every row (safe while others read: they see misses; writers finish first)."""
        n = len(self._states_np)
        self.lock(_TIER_LOCK_BASE, max(1, n))
        try:
            self._versions_np[:] |= 1
            self._states_np[:] = EMPTY
            self._versions_np[:] += 1
        finally:
            self.unlock(_TIER_LOCK_BASE, max(1, n))

    def filled(self) -> int:
        return int(np.count_nonzero(self._states_np == _TIER_READY))

    def stats(self) -> dict[str, int]:
        """``disk_hits``, ``disk_writes``, ``disk_reads`` (summed over every process),
        ``disk_rows`` (stored now) and ``disk_tier_rows``."""
        self.lock(_TIER_LOCK_BASE - 1)
        try:
            rows = self._stats_rows.copy()
        finally:
            self.unlock(_TIER_LOCK_BASE - 1)
        return {"disk_hits": int(rows[:, _TIER_HITS].sum()),
                "disk_writes": int(rows[:, _TIER_WRITES].sum()),
                "disk_reads": int(rows[:, _TIER_READS].sum()), "disk_rows": self.filled(),
                "disk_tier_rows": self._rows}

    @property
    def path(self) -> str:
        return self._path

    def close(self) -> None:
        """Close this process's descriptor and mapping (idempotent). The file goes with the
        last descriptor once its name is gone (a persistent tier keeps its name)."""
        _LIVE_TIERS.discard(self)
        closed = Closed(SharedCache)  # every view goes, so that the mapping can close now
        self._states = self._versions = self._positions = closed  # type: ignore
        self._states_np = self._versions_np = self._stats_rows = closed  # type: ignore
        self._own_counters = closed  # type: ignore
        mm = getattr(self, "_mapping", None)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
        if self._finalizer is not None:
            self._finalizer()


# Process-wide: the tiers open in this process, which `clean` must not open and close (closing
# any descriptor of a file drops every record lock this process holds on it).
_LIVE_TIERS: "weakref.WeakSet[_DiskTier]" = weakref.WeakSet()


def _rebuild_tier(dupfd: Any, path: str, dtype: str, shape: tuple) -> _DiskTier:
    """Unpickle a disk tier in a spawned worker: map the inherited descriptor."""
    fd = dupfd.detach()
    self = _DiskTier.__new__(_DiskTier)
    self._finalizer = None
    self._path, self._row_dtype, self._row_shape = path, np.dtype(dtype), tuple(shape)
    self._row_bytes = self._row_dtype.itemsize * math.prod(self._row_shape)
    try:
        raw = os.pread(fd, _TIER_HEADER.size, 0)
        head = dict(zip(_TIER_FIELDS, _TIER_HEADER.unpack(raw)[1:]))
        self._map(fd, mmap.mmap(fd, head["data_off"], mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE), head)
    except BaseException:
        os.close(fd)
        raise
    return self


def _tier_is_stale(path: str, *, remove: bool, min_age: float) -> bool:
    """``is_stale_file`` for a tier file: never one that a tier of this process holds."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if any(t._file_id == (st.st_dev, st.st_ino) for t in list(_LIVE_TIERS)):
        return False
    return is_stale_file(path, remove=remove, min_age=min_age)


def _clean_tier_files(directory: str, *, dry_run: bool = False,
                      persistent: bool | Sequence[str] = ()) -> list[str]:
    """``clean_segments`` for the tier files in ``directory``: this user's that no live
    process holds, and persistent ones only by name (or all, with ``persistent=True``)."""
    removed = []
    for fname in sorted(os.listdir(directory)):
        if not fname.startswith(_TIER_PREFIX + "_"):
            continue
        info = parse_segment_name(SEGMENT_PREFIX + fname[len(_TIER_PREFIX):])
        if info is None or info["uid"] != os.getuid():
            continue
        kept = info["job_key"] == PERSISTENT_JOB_KEY and not info["starting"]
        if kept and persistent is not True and info["name"] not in persistent:
            continue
        path = os.path.join(directory, fname)
        if _tier_is_stale(path, remove=not dry_run, min_age=0.0 if kept else 2.0):
            removed.append(path)
            logger.info("stocaching: removed stale disk tier %s", path)
    return removed
