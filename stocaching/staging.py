"""Staging slots (``SharedCache(..., staging_slots=N)``, ``stage``): the slots where a
prefetcher holds samples of indices without a slot until a read takes them.

A feature module of stocaching (see the core's section "The seam"): the cache holds a
``_StagingTable`` as its ``_staging``; ``stage``, ``_take_staged``, ``unstage`` and
``read_tier`` (the reads of a loader that fills staging slots) are its methods
(``SharedCache.stage = _FromFeature("staging")``).

Keywords:
    staging_slots: ``SharedCache``'s extra slots where a prefetcher holds samples of indices
        without a slot until they are read once (see ``stage`` and ``stocaching.prefetch``);
        they are paid from ``size_limit_gib`` first. Default: 0.
    read_tags: (the cache's attribute) when not empty (a frozenset of ints, as ``stage``'s
        ``tag``), ``get_slot`` and ``get_batch`` take a staged sample only from the copies
        staged with one of these tags: local ranks whose epochs drift apart may each have
        staged the same index, and each rank's workers must read their own rank's copy,
        which its prefetcher accounts for. Each ``Prefetcher`` adds its own tag; the set
        travels to ``DataLoader`` workers with the cache. Default: empty (any copy).
"""

from __future__ import annotations

__all__ = []
STOCACHING_FEATURE = "staging"  # (the core reads this line before it imports the file)

import os
import warnings
from typing import Any, Iterable

import numpy as np
import torch

try:  # inside the package
    from .stocaching import (BYTES_PER_GIB, MAX_STAGE_TAG, OOB, STAGE_INDEX_MASK, STAGE_LOCK,
                             STAGE_TAG_SHIFT, STATS_HITS, STATS_STAGED_HITS, STATS_STAGES,
                             Segment, check_int, closed_error, fmt_bytes, process_alive,
                             slot_lock_offset)
except ImportError:  # copied beside stocaching.py
    from stocaching import (BYTES_PER_GIB, MAX_STAGE_TAG, OOB, STAGE_INDEX_MASK, STAGE_LOCK,
                            STAGE_TAG_SHIFT, STATS_HITS, STATS_STAGED_HITS, STATS_STAGES,
                            Segment, check_int, closed_error, fmt_bytes, process_alive,
                            slot_lock_offset)


def check_staging_slots(staging: int, dataset_len: int, slot_bytes: int, slots: int,
                        size_limit_gib: float | None, is_local_leader: bool) -> None:
    """SharedCache's checks of ``staging_slots`` (a positive int) against the rest of its
    configuration, before anything is made: raises ValueError for staging slots that cannot
    work, and warns (on the local leader) of ones that no sample can use. ``size_limit_gib``
    is None for ``"auto"``, which sizes around them."""
    if dataset_len > STAGE_INDEX_MASK:
        raise ValueError(f"staging_slots should be 0 for a dataset_len above "
                         f"{STAGE_INDEX_MASK}, but got staging_slots={staging} with "
                         f"dataset_len={dataset_len}")
    if size_limit_gib is not None and staging * slot_bytes >= size_limit_gib * BYTES_PER_GIB:
        raise ValueError(f"staging_slots should leave room in size_limit_gib={size_limit_gib}"
                         f" (they take {fmt_bytes(staging * slot_bytes)} of it), but got "
                         f"staging_slots={staging}")
    if slots >= dataset_len and is_local_leader:
        warnings.warn(f"staging_slots={staging} take {fmt_bytes(staging * slot_bytes)} that "
                      f"no sample can use: every index of the {dataset_len} has a slot on "
                      "this node, and staging holds only samples of indices without one; "
                      "pass staging_slots=0", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Staging slots: what each one holds (_StagingTable)
# ----------------------------------------------------------------------------------------------


def _staged_entries(table: np.ndarray, idx: int) -> np.ndarray:
    """Positions in a staging map (or a piece of one) whose entry holds ``idx``."""
    found = np.flatnonzero(table & STAGE_INDEX_MASK == idx)  # a free (-1) or filling
    return found[table[found] >= 0]  # (-2 - pid) entry may match too: dropped here


class _StagingTable:
    """What each staging slot of a segment holds, and every change to it: the one place that
    knows the entries' encoding and the staging lock.

    One int64 entry per staging slot: -1 free; ``-2 - pid`` reserved by process ``pid``
    while it writes the slot's row; else ``index | tag << 40``, the sample of ``index``
    staged with ``tag``, set only once the row is whole. Entries change only under the
    staging lock (``STAGE_LOCK``, a record lock of the segment); readers take a snapshot
    and look at an entry again under the lock before they free it, so a slot is freed once.
    """

    entries: np.ndarray  # the table, in the segment (int64, one per staging slot)
    segment: Segment  # whose record lock at STAGE_LOCK guards changes to entries
    # Set in this process once close() gave back its stagers' samples: a stage of this
    # process that publishes afterwards withdraws its sample instead (see publish).
    closing: bool = False

    def __init__(self, entries: np.ndarray, segment: Segment) -> None:
        self.entries, self.segment = entries, segment

    @staticmethod
    def entry(idx: int, tag: int) -> int:
        """The entry of ``idx``'s sample staged with ``tag``."""
        return idx | tag << STAGE_TAG_SHIFT

    # -- a stager: reserve a slot, write its row, then publish it ---------------------------

    def reserve(self, entry: int) -> int | None:
        """Reserve a free staging slot for this process to write ``entry``'s sample in: its
        position; -1 when ``entry`` is staged already (kept: a load gives the same sample);
        None when every slot is taken. Slots reserved by processes that died are freed."""
        table = self.entries
        self.segment.lock(STAGE_LOCK)
        try:
            # Staged already by the same stager (the same entry): kept; another stager's
            # copy stays its own. One comparison of the whole table: a few microseconds.
            if (table == entry).any():
                return -1
            k = int(np.argmax(table == -1))  # the first free staging slot, if any
            if table[k] != -1:  # fillers that died keep their slot: give it back
                for j in np.flatnonzero(table < -1):
                    if not process_alive(-2 - int(table[j]), 0):
                        table[j] = -1
                k = int(np.argmax(table == -1))
                if table[k] != -1:
                    return None
            table[k] = -2 - os.getpid()  # reserved by us while we fill it
        finally:
            self.segment.unlock(STAGE_LOCK)
        return k

    def abandon(self, k: int) -> None:
        """Free the slot ``k`` this process reserved and could not fill."""
        self.entries[k] = -1

    def publish(self, k: int, entry: int) -> bool:
        """Make the sample written in the reserved slot ``k`` readable as ``entry``; False
        (the slot freed instead) once this process's close() has begun."""
        with self.segment.thread_lock:  # not while close() gives back this process's entries
            closing = self.closing
            self.entries[k] = -1 if closing else entry  # published only once the row is in
        return not closing

    # -- readers ------------------------------------------------------------------------------

    def find(self, idx: int, tags: frozenset) -> tuple[int, int] | None:
        """A staging slot holding ``idx``'s sample, staged with one of ``tags`` (any tag when
        empty), and its entry; or None."""
        table = self.entries
        if tags:  # the entries of idx with one of these tags: exact values
            found = []
            for tag in tags:  # (one or two: one comparison of the table each)
                found += np.flatnonzero(table == self.entry(idx, tag)).tolist()
        else:
            found = _staged_entries(table, idx).tolist()
        if not found:
            return None
        k = found[0]
        entry = int(table[k])  # (the scan's entry unless another reader took it meanwhile)
        if entry < 0 or entry & STAGE_INDEX_MASK != idx or \
                (tags and entry >> STAGE_TAG_SHIFT not in tags):
            return None
        return k, entry

    def live(self, tags: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """A snapshot of the published entries, staged with one of ``tags`` (any tag when
        empty): their slots and their entries (stagers change the table meanwhile)."""
        table = self.entries.copy()
        slots = np.flatnonzero(table >= 0)
        tags = list(tags)
        if tags:
            slots = slots[np.isin(table[slots] >> STAGE_TAG_SHIFT, tags)]
        return slots, table[slots]

    def staged_indices(self, tags: Iterable[int] = ()) -> np.ndarray:
        """The indices staged now (with one of ``tags``, any when empty), sorted: a snapshot."""
        return np.sort(self.live(tags)[1] & STAGE_INDEX_MASK)

    def count(self) -> int:
        """Samples staged now."""
        return int(np.count_nonzero(self.entries >= 0))

    # -- freeing ------------------------------------------------------------------------------

    def take(self, k: np.ndarray | int, entry: np.ndarray | int) -> None:
        """Free the slots ``k`` whose entries are still ``entry`` (a reader took their
        samples; freed once however many readers raced)."""
        table = self.entries
        self.segment.lock(STAGE_LOCK)
        try:
            k = np.atleast_1d(k)
            table[k[table[k] == entry]] = -1
        finally:
            self.segment.unlock(STAGE_LOCK)

    def drop(self, idx: int, tag: int | None = None) -> bool:
        """Free the slots of ``idx`` (staged with ``tag`` only, when given); whether any."""
        table = self.entries
        self.segment.lock(STAGE_LOCK)
        try:
            found = _staged_entries(table, idx)
            if tag is not None:
                found = found[table[found] >> STAGE_TAG_SHIFT == tag]
            table[found] = -1
        finally:
            self.segment.unlock(STAGE_LOCK)
        return bool(found.size)

    def drop_all(self) -> None:
        """Free every published slot (``clear()``; a stager writing one publishes after)."""
        self.segment.lock(STAGE_LOCK)
        try:
            self.entries[self.entries >= 0] = -1
        finally:
            self.segment.unlock(STAGE_LOCK)

    def drop_tags_at_close(self, tags: Iterable[int]) -> None:
        """Free what this process's stagers (``tags``) staged, and have any stage of this
        process that publishes later withdraw: close() has begun."""
        self.segment.lock(STAGE_LOCK)
        try:  # (it holds the thread lock: a publish of this process waits, then withdraws)
            self.closing = True
            table = self.entries
            table[(table >= 0) & np.isin(table >> STAGE_TAG_SHIFT, list(tags))] = -1
        finally:
            self.segment.unlock(STAGE_LOCK)

    def locate(self, idx: np.ndarray, oob: np.ndarray, rows: np.ndarray, found: np.ndarray,
               entries: np.ndarray, read_tags: frozenset, first_row: int) -> None:
        """``SharedCache._locate``'s staged samples: fill in the rows (``first_row`` is the
        first staging slot's) of the positions ``oob`` of ``idx`` (indices without a slot)
        that hold a sample staged with one of ``read_tags``: each staging slot once, the
        first occurrence."""
        live, staged = self.live(read_tags)
        if not live.size:
            return
        where: dict[int, tuple[int, int]] = {}
        for j, e in zip(live[::-1].tolist(), staged[::-1].tolist()):  # the first slot wins
            where[e & STAGE_INDEX_MASK] = (j, e)
        for k in oob.tolist():
            got = where.pop(int(idx[k]), None)
            if got is not None:
                rows[k], found[k], entries[k] = first_row + got[0], True, got[1]


# ----------------------------------------------------------------------------------------------
# A cache's methods of staging (SharedCache.stage, and the read that takes a staged sample)
# ----------------------------------------------------------------------------------------------


def stage(self, idx: int, value: Any, *, tag: int = 0) -> bool:
    """Hold the sample of an index that has no slot on this node in a staging slot, until
    a ``get_slot`` of it takes it (which frees the staging slot). This is for a prefetcher
    that loads samples shortly before they are read (see ``stocaching.prefetch``); the
    two-line pattern never needs it.

    Args:
        idx: dataset index without a slot here (``slot_mask([idx])`` is False).
        value: as for ``set_slot``.
        tag: who stages it, an int in ``[0, MAX_STAGE_TAG]``, for ``unstage(idx,
            tag=...)``; staging an index already staged with the same tag keeps the
            sample staged first (a load is deterministic: the same sample) and returns
            True; staged with another tag (another rank's prefetcher), both are kept,
            and each ``get_slot`` of the index takes one.
            Default: 0.

    With a disk tier, the sample is also stored there (if its row is not stored yet), so
    that a later epoch reads it from the tier (``read_tier``) instead of loading it.

    Returns:
        True when the sample is staged; False when every staging slot
        is taken (nothing changed: try again once some were read).

    Raises:
        ValueError: ``idx`` has a slot (use ``set_slot``), or the cache was made without
            ``staging_slots``; nothing is changed. As ``set_slot`` for a bad ``idx`` or
            ``value``.
    """
    idx = self._index(idx)
    if not self._staging_slots:
        raise ValueError("this cache has no staging slots; construct it with "
                         "staging_slots=N to stage samples")
    if self._index_states[idx] != OOB:
        raise ValueError(f"idx={idx} has a slot in this cache: store it with set_slot; "
                         "stage() holds samples of indices without one")
    tag = check_int("tag", tag, low=0, high=MAX_STAGE_TAG)
    src = self._source_array(value)
    if self._disk_tier is not None:  # kept for later epochs too (a row stored is kept)
        self._disk_tier.store(idx, src)
    entry = self._staging.entry(idx, tag)
    k = self._staging.reserve(entry)
    if k is None or k < 0:
        return k is not None  # every slot taken; or staged already, by the same stager
    slot = self._layout.slots + k
    lock = slot_lock_offset(slot)
    try:
        self._segment.lock(lock)
        try:
            self._write(slot, src, None)
        finally:
            self._segment.unlock(lock)
    except BaseException:
        self._staging.abandon(k)
        raise
    if not self._staging.publish(k, entry):
        raise closed_error(type(self))
    self._own_counters[STATS_STAGES] += 1
    return True


def _take_staged(self, idx: int) -> torch.Tensor | None:
    """The staged sample of ``idx`` (a copy; its staging slot is freed), or None: a copy
    staged with one of ``read_tags`` if there are any."""
    found = self._staging.find(idx, self._read_tags)
    if found is None:
        return None
    k, entry = found
    row = self._read_row(self._layout.slots + k, True, self._staging.entries, k, entry)
    if row is None:
        return None
    self._staging.take(k, entry)
    self._own_counters[STATS_HITS] += 1
    self._own_counters[STATS_STAGED_HITS] += 1
    return self._from_row(row)


def read_tier(self, idx: int) -> Any:
    """The sample of ``idx`` from the disk tier (a new tensor; with fields, a dict of
    them), counted in ``disk_reads`` (not a hit: the read that takes it once staged is);
    or None: the cache has no disk tier, or no row there for
    ``idx``, or its row is not stored (or is being written). For loaders that fill
    staging slots (the ``Prefetcher``): unlike ``get_slot``, it never takes a staged
    sample.

    Args:
        idx: dataset index (int, numpy or torch integer scalar) in ``[0, dataset_len)``.
    """
    self._check_open()
    idx = self._index(idx)
    if self._disk_tier is None:
        return None
    row = self._disk_tier.read_for_stager(idx)  # (not a hit: it will be, once staged)
    return None if row is None else self._from_row(row)


def unstage(self, idx: int, *, tag: int | None = None) -> bool:
    """Free the staging slot of ``idx`` if it is staged (a prefetcher gives back what was
    never read, e.g. after an epoch that stopped early); with a ``tag``, only if it was
    staged (last) with that tag. Returns whether a staging slot was freed."""
    self._check_open()
    idx = self._index(idx)
    if tag is not None:
        tag = check_int("tag", tag, low=0, high=MAX_STAGE_TAG)
    return bool(self._staging_slots) and self._staging.drop(idx, tag)
