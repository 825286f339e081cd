"""A cache sent to processes that are already running, as a shared tensor is: Pool tasks and
results, Queue, Pipe, in the standard library and in torch.multiprocessing, with every start
method. The receiver maps the same segment: it sees every slot, and its writes are seen by all.
Plain pickle and torch.save still refuse (a pickle nobody could load)."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest
import torch
import torch.multiprocessing as tmp

from _helpers import FIELD_DTYPES, FIELDS, assert_no_leak, fields_of, holders, same, value_of
from stocaching import OpenSizeCache, SharedCache

DIMS = (3, 4, 4)
METHODS = ["fork", "spawn", "forkserver"]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _segment_fds(shm_dir: str) -> int:
    """This process's descriptors on the files of ``shm_dir`` (its caches' segments)."""
    return len(holders(shm_dir).get(os.getpid(), []))


# -- what the receiving processes run (module level, so that spawned ones can import it) -------

def write_slot(cache: SharedCache, idx: int) -> int:
    cache.set_slot(idx, value_of(idx, DIMS))
    return os.getpid()


def write_given(cache: SharedCache, idx: int, value) -> None:
    cache.set_slot(idx, value)


def read_slot(cache: SharedCache, idx: int) -> torch.Tensor | None:
    return cache.get_slot(idx)


def give_back(cache: SharedCache) -> SharedCache:
    return cache


def descriptors_in_task(cache: SharedCache) -> int:
    assert cache.get_slot(1) is not None
    return os.getpid(), _fds()


def serve(inbox, outbox) -> None:
    """A running process: for every cache it is sent, read slot 1, write slot 2, answer with
    what it read; stop at None."""
    while (cache := inbox.get()) is not None:
        seen = cache.get_slot(1)
        cache.set_slot(2, value_of(2, DIMS))
        outbox.put(seen)


def serve_pipe(conn) -> None:
    while (cache := conn.recv()) is not None:
        seen = cache.get_slot(1)
        cache.set_slot(2, value_of(2, DIMS))
        conn.send(seen)


def hold(inbox, outbox) -> None:
    cache = inbox.get()
    cache.set_slot(3, value_of(3, DIMS))
    outbox.put("written")
    signal.pause()  # until killed


# -- the tests -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_pool_tasks_write_and_a_second_pool_reads_what_they_wrote(shm_dir, method):
    """0.2.1's own test_slots_multiprocess, with every start method."""
    cache = SharedCache(1e-3, 50, DIMS, shm_dir=shm_dir)
    ctx = mp.get_context(method)
    with ctx.Pool(2) as pool:
        writers = pool.starmap(write_slot, [(cache, 1), (cache, 7)])
    assert all(pid != os.getpid() for pid in writers)
    assert torch.equal(cache.get_slot(1), value_of(1, DIMS))
    assert torch.equal(cache.get_slot(7), value_of(7, DIMS))
    with ctx.Pool(2) as pool:
        read = pool.starmap(read_slot, [(cache, 1), (cache, 7), (cache, 9)])
        assert cache.stats()["writes"] == 2
        returned = pool.apply_async(give_back, (cache,)).get(timeout=60)  # a result, too
    assert [torch.equal(r, value_of(i, DIMS)) for r, i in zip(read[:2], (1, 7))] == [True] * 2
    assert read[2] is None
    assert returned is not cache
    returned.set_slot(9, value_of(9, DIMS))  # the returned handle maps the same memory
    assert torch.equal(cache.get_slot(9), value_of(9, DIMS))
    returned.close()
    cache.close()
    assert os.listdir(shm_dir) == []


SAMPLES = {  # one of each cache class (multiprocessing looks reducers up by exact class)
    "fixed": (SharedCache, DIMS, torch.uint8, lambda i: value_of(i, DIMS)),
    "fields": (SharedCache, FIELDS, FIELD_DTYPES, fields_of),
    "open sizes": (OpenSizeCache, (None, 3), torch.float32,
                   lambda i: torch.arange(3.0 * (i + 1)).view(-1, 3)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", SAMPLES)
def test_every_kind_of_cache_goes_through_a_pool(shm_dir, kind):
    kind_of_cache, dims, dtype, sample = SAMPLES[kind]
    cache = kind_of_cache(1e-3, 50, dims, dtype, shm_dir=shm_dir)
    with mp.get_context("spawn").Pool(2) as pool:
        pool.starmap(write_given, [(cache, i, sample(i)) for i in (3, 8)])
        read = pool.starmap(read_slot, [(cache, 3), (cache, 8)])
    assert (type(cache) is kind_of_cache) == (kind != "fields")  # _FieldsCache: a subclass
    for i, got in zip((3, 8), read):
        assert same(cache.get_slot(i), sample(i)) and same(got, sample(i)), (kind, i)
    cache.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("channel", ["queue", "pipe"])
def test_a_running_process_gets_the_cache_by_queue_or_pipe(shm_dir, method, channel):
    cache = SharedCache(1e-3, 50, DIMS, shm_dir=shm_dir)
    cache.set_slot(1, value_of(1, DIMS))
    ctx = mp.get_context(method)
    if channel == "queue":
        inbox, outbox = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=serve, args=(inbox, outbox))
        send, receive = inbox.put, lambda: outbox.get(timeout=60)
    else:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=serve_pipe, args=(there,))
        send, receive = here.send, lambda: here.recv() if here.poll(60) else "no answer"
    proc.start()
    try:
        for round_ in range(3):  # the same cache, sent again to the same process
            send(cache)
            assert torch.equal(receive(), value_of(1, DIMS)), f"round {round_}"
            assert torch.equal(cache.get_slot(2), value_of(2, DIMS))
            cache.clear()
            cache.set_slot(1, value_of(1, DIMS))
        send(None)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()
    cache.close()


@pytest.mark.timeout(120)
def test_torch_multiprocessing_pool_queue_and_process(shm_dir):
    cache = SharedCache(1e-3, 50, DIMS, shm_dir=shm_dir)
    cache.set_slot(1, value_of(1, DIMS))
    ctx = tmp.get_context("spawn")
    with ctx.Pool(2) as pool:
        pool.starmap(write_slot, [(cache, 4), (cache, 5)])
    assert torch.equal(cache.get_slot(4), value_of(4, DIMS))
    assert torch.equal(cache.get_slot(5), value_of(5, DIMS))
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=serve, args=(inbox, outbox))
    proc.start()
    try:
        inbox.put(cache)
        assert torch.equal(outbox.get(timeout=60), value_of(1, DIMS))
        assert torch.equal(cache.get_slot(2), value_of(2, DIMS))
        inbox.put(None)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()
    cache.close()


@pytest.mark.timeout(300)
def test_a_thousand_sends_leave_descriptors_and_stats_rows_flat(shm_dir):
    """Each send hands over one duplicate descriptor, which the sender closes once the receiver
    has taken it, and each receiver closes its own when the task lets go of the cache."""
    cache = SharedCache(1e-3, 50, DIMS, shm_dir=shm_dir)
    cache.set_slot(1, value_of(1, DIMS))
    with mp.get_context("fork").Pool(2) as pool:
        pool.map(descriptors_in_task, [cache] * 4, chunksize=1)  # starts the resource sharer
        # Counted on the segment's files only: this process's other descriptors come and go
        # with threads of earlier tests (a collected cache, a finished prefetcher), which made
        # the whole count move by one now and then.
        before = _segment_fds(shm_dir)
        in_tasks = pool.map(descriptors_in_task, [cache] * 1000, chunksize=1)
        # The sender's resource sharer closes each duplicate right after handing it over, on
        # its own thread, which may still be closing the last ones: wait for that (the
        # deadline is a ceiling for a hang; the count itself must come back exactly).
        deadline = time.monotonic() + 60
        while _segment_fds(shm_dir) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _segment_fds(shm_dir) == before, \
            f"{_segment_fds(shm_dir) - before} descriptors more after 1,000 sends"
        # in a worker, a task's handle is closed before the next task: its count is flat
        per_worker: dict[int, list[int]] = {}
        for pid, n in in_tasks:
            per_worker.setdefault(pid, []).append(n)
        assert all(len(set(n)) == 1 for n in per_worker.values()), \
            {pid: sorted(set(n)) for pid, n in per_worker.items()}
        # every handle of one process counts in that process's one row of stats
        assert cache.stats()["processes"] == 3
    cache.close()


def test_plain_pickle_and_torch_save_refuse_and_say_what_to_do(shm_dir):
    cache = SharedCache(1e-4, 10, DIMS, shm_dir=shm_dir)
    before = _fds()
    for dump in (pickle.dumps, lambda c: torch.save(c, io.BytesIO())):
        with pytest.raises(TypeError, match=r"pickled only by multiprocessing .*Pool.*Queue.*"
                                            r"__getstate__"):
            dump(cache)
    assert _fds() == before  # a refusal pins nothing
    cache.close()


@pytest.mark.timeout(120)
def test_a_receiver_killed_with_sigkill_leaves_nothing(tmpfs):
    cache = SharedCache(1e-3, 50, DIMS, shm_dir=tmpfs)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=hold, args=(inbox, outbox))
    proc.start()
    try:
        inbox.put(cache)
        assert outbox.get(timeout=60) == "written"
        assert torch.equal(cache.get_slot(3), value_of(3, DIMS))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    cache.close()
    assert_no_leak(tmpfs)
