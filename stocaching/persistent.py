"""Persistent caches (``SharedCache(..., persistent=True, name=..., key=...)``): a segment
that keeps its name after the job, adopted by the next job that asks for the same name,
configuration and key.

A feature module of stocaching (see the core's section "The seam"): the local leader's
``Segment`` is opened by ``open_persistent`` here instead of being made.

Keywords:
    persistent: keep the cache after the job, under ``name`` (required then): the next job on
        this machine that asks for a persistent cache of that name, with the same ``key`` and
        configuration, attaches to it with every filled slot a hit. It is removed only by
        ``python -m stocaching clean --persistent NAME`` (or
        ``clean_segments(persistent=[NAME])``), never while in use. Default: False (the cache
        is freed when the job's last process exits).
    key: with ``persistent`` or ``load_from``: which data the cache holds (a dataset version,
        a hash of the file list, the transform's parameters), checked when a job attaches,
        or loads a file (``save`` writes it there). Default: "".
    on_mismatch: with ``persistent`` or ``load_from``, when the cache of that name, or the
        file, holds another key or configuration: ``"raise"`` a ``CacheConfigError`` naming
        what differs, or ``"replace"`` the cache with a new empty one (not while another
        process uses it), or ignore the file with a warning (the next ``save`` writes it
        anew). Default: "raise".
"""

from __future__ import annotations

__all__ = []
STOCACHING_FEATURE = "persistent"  # (the core reads this line before it imports the file)

import contextlib
import fcntl
import mmap
import os
import time
import weakref
from typing import Any

import numpy as np

try:  # inside the package
    from .stocaching import (HEADER_BYTES, SET, BaseCache, CacheConfigError, Segment, check_key,
                             finalize_segment, fmt_bytes, hash_of_key, logger, names_file,
                             open_existing, pwrite_all, read_header, read_key, try_stale,
                             unlink_if_same)
except ImportError:  # copied beside stocaching.py
    from stocaching import (HEADER_BYTES, SET, BaseCache, CacheConfigError, Segment, check_key,
                            finalize_segment, fmt_bytes, hash_of_key, logger, names_file,
                            open_existing, pwrite_all, read_header, read_key, try_stale,
                            unlink_if_same)


def _check_persistent(name: Any, job_key: Any, key: Any, on_mismatch: Any) -> None:
    """The arguments of a persistent cache (see ``SharedCache``)."""
    if name is None:
        raise ValueError("a persistent cache needs a name= (the next job finds it by its name), "
                         "but got name=None with persistent=True")
    if job_key is not None:
        raise ValueError(f"a persistent cache is found by its name alone, not by a job key, but "
                         f"got job_key={job_key!r} with persistent=True")
    check_key(key, on_mismatch)


def open_persistent(segment: Segment, owner: BaseCache, load_from: str | None = None
                    ) -> None:
    """The local leader of a persistent cache: attach to the segment of this name if it
    holds this configuration and key (a mismatch raises, or with on_mismatch="replace"
    makes way for a new one), else make it (filled from ``load_from`` if given). Its name
    stays after the job."""
    for _ in range(5):
        try:
            fd = open_existing(segment.path)
        except FileNotFoundError:
            if _create_persistent(segment, owner, load_from):
                return
            continue  # another job made it at the same moment: attach to theirs
        try:
            if _adopt_persistent(segment, owner, fd):
                if load_from is not None:
                    logger.info("stocaching: the persistent cache %r exists: attached to it "
                                "as it is, without reading %s", owner._name, load_from)
                return
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # replaced: make a new one
    raise CacheConfigError(f"could not open or make the persistent cache {segment.path}: it "
                           "keeps changing", "name", owner._name, segment.path)

def _create_persistent(segment: Segment, owner: BaseCache, load_from: str | None = None
                       ) -> bool:
    """Make the segment and give it its name; False if another process named one first."""
    try:
        fd, _, head = segment._make_file(owner, lambda tmp, fd: os.link(tmp, segment.path),
                                      load_from)
    except FileExistsError:
        return False
    segment.finalizer = weakref.finalize(segment, finalize_segment, fd, None, 0, 0)
    logger.info("stocaching: made the persistent cache %r (key %r): %d of %d samples of %s, "
                "%s in %s; it stays after this job (python -m stocaching clean --persistent "
                "%s removes it)", owner._name, owner._key, owner._layout.slots,
                owner._layout.dataset_len, owner._describe(),
                fmt_bytes(head["total_bytes"]), os.path.dirname(segment.path), owner._name)
    return True

def _adopt_persistent(segment: Segment, owner: BaseCache, fd: int) -> bool:
    """Attach to an existing persistent segment; False if it was removed to be replaced."""
    for _ in range(3):  # (another process may probe it for an instant, as we do)
        alone = try_stale(fd)  # no other process uses it (we then hold it exclusively)
        if alone:
            break
        time.sleep(0.05)
    if not alone:
        fcntl.flock(fd, fcntl.LOCK_SH)
    st = os.fstat(fd)
    if not names_file(segment.path, st.st_ino, st.st_dev):
        return False  # removed (or replaced) meanwhile: look again
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, min(size, HEADER_BYTES), mmap.MAP_SHARED, mmap.PROT_READ) as mm:
        head = read_header(mm) if size >= HEADER_BYTES else None
        theirs = read_key(mm) if head is not None else None
    mismatch = None
    if head is None or not head["persistent"]:
        mismatch = CacheConfigError(f"{segment.path} is not a persistent cache", "persistent",
                                    1, 0)
    elif head["key_hash"] != hash_of_key(owner._key):
        mismatch = CacheConfigError(
            f"the persistent cache {segment.path} holds key={theirs!r}, but this job asked "
            f"for key={owner._key!r}: it holds other data. Pass on_mismatch='replace' to "
            "make a new cache in its place, or another name=", "key", owner._key, theirs)
    else:
        try:
            owner._check_header(head, size)
        except CacheConfigError as e:
            mismatch = CacheConfigError(
                f"the persistent cache {segment.path} holds {e.field}={e.found}, but this job "
                f"asked for {e.field}={e.expected}. Pass on_mismatch='replace' to make a new "
                "cache in its place, or another name=", e.field, e.expected, e.found)
    if mismatch is not None:
        if owner._on_mismatch == "replace" and not alone:
            raise CacheConfigError(f"{mismatch} (not replaced: another process uses it "
                                   "now)", mismatch.field, mismatch.expected, mismatch.found)
        if owner._on_mismatch != "replace":
            raise mismatch
        st = os.fstat(fd)
        unlink_if_same(segment.path, st.st_ino, st.st_dev)
        logger.warning("stocaching: replaced the persistent cache %s: %s", segment.path,
                       mismatch.args[0])
        return False
    if alone:
        # What the last job left staged is nobody's now (cleared before mapping, still
        # alone). flock cannot turn exclusive into shared atomically: it drops the lock
        # first, and a `clean` of this name or a job replacing it may take the segment
        # in between. Once shared it is ours to keep, so look at the name again then.
        pwrite_all(fd, np.full(owner._staging_slots, -1, np.int64), head["stage_off"])
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not names_file(segment.path, st.st_ino, st.st_dev):
            return False  # removed meanwhile: look again
    with contextlib.suppress(OSError):
        os.utime(fd)  # the listing's age: since a job last attached
    head = segment.map_existing(owner, fd)
    segment.finalizer = weakref.finalize(segment, finalize_segment, fd, None, 0, 0)
    segment.populate(head["data_off"])
    logger.info("stocaching: attached to the persistent cache %r (key %r): %d of %d slots "
                "filled", owner._name, owner._key,
                int(np.count_nonzero(owner._index_states_np == SET)), owner._layout.slots)
    return True

