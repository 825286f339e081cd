"""A process of a cache job, driven by the fault and neighbour tests one command per line on
stdin, answering with progress markers on stdout (tests/_helpers.py: ``Child``).

It is started the way torchrun starts a local rank (``python job.py`` with the rank variables
in its environment, see ``rank_env``). Commands:

  create [pause_create|pause_attach]   construct the cache ("ATTACHED" or "ERROR <type> ...")
  write                 set this rank's share (i % local_world_size == local_rank, but the last)
  writehang I           set_slot(I) and stop halfway through copying the bytes
  writehang_late I      set_slot(I) and stop right after aux[I] = SET, before the seq update
  readloop              read everything forever, checking every value
  fill                  set every index that reads as a miss, without allow_overwrite
  check                 read everything: "CHECK hits misses bad missing..."
  batch                 read everything with one get_batch: "BATCH hits misses bad missing..."
  loader CTX PHASE      one DataLoader epoch, 2 workers; worker 0 stops at PHASE
  epoch                 one clean DataLoader epoch (fork), checking every sample
  exit                  close and exit 0

A stop prints "<MARKER> <pid>" and waits for the file $FT_GO (or forever). To stop at an exact
phase the program wraps one function or one buffer of the library (``os.posix_fallocate``,
``SharedCache._check_header``, ``cache._slot_samples``, ``cache._index_states``); the wrappers
call the real code.
"""

import faulthandler
import functools
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from _helpers import value_of
from stocaching import OpenSizeCache, SharedCache
from stocaching import stocaching as core

N = int(os.environ.get("FT_N", "32"))
D = int(os.environ.get("FT_D", "1024"))
GO = os.environ.get("FT_GO", "")
GATE = os.environ.get("FT_GATE", "")
# Created by the main process once iter(DataLoader) has returned. Workers wait for it before
# they announce a stop, so that the test's signal never reaches the main process while it is
# still inside torch's DataLoader set-up: torch's SIGCHLD handler raises from wherever the
# main thread is, and raised inside multiprocessing.Queue.put (a threading.Condition entered,
# not yet exited) it leaves that queue's lock held, and the iterator's own shutdown then
# deadlocks on it. That is torch's hazard, not the cache's; this test is about the cache.
ITER_READY = os.environ.get("FT_ITER_READY", "")
# How long a non-leader waits for its leader: a ceiling, unless the test expects the wait to
# run out (then it passes a short one).
TIMEOUT = float(os.environ.get("FT_TIMEOUT", "60"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LWS = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
# FT_FIELDS=1: a cache of two fields a sample, {"x": (D,) uint8, "label": () int64}
# (create, write, writehang, writehang_late, check, fill, batch and exit only).
FIELDS = os.environ.get("FT_FIELDS", "") == "1"
# FT_VARIABLE=1: a cache of open sizes, (None,) uint8, sample i of D - 7 i bytes (the same
# commands but batch; writehang stops in the arena's copy).
VARIABLE = os.environ.get("FT_VARIABLE", "") == "1"
# FT_PERSISTENT=NAME: a persistent cache of that name (key "k1"), which outlives the job.
PERSISTENT = os.environ.get("FT_PERSISTENT", "")
# SIGINT and SIGTERM act as in a terminal even when the test runner was started with them
# ignored (a shell does that to SIGINT of a command run with '&'), a disposition children
# inherit. At module level, so that spawned DataLoader workers (which import this module) set
# them too.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks on a hang


def say(*a):
    print(*a, flush=True)


def pattern(i):
    if VARIABLE:  # D - 7 * i bytes: every sample its own size
        return value_of(i, (D - 7 * i,))
    if FIELDS:
        return {"x": value_of(i, (D,)), "label": torch.tensor(i * 1000 + 7)}
    return value_of(i, (D,))


def same(a, b):
    """Equal samples: tensors, or dicts of tensors (a cache of fields)."""
    if isinstance(a, dict):
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def row(batch, i):
    """Row i of a get_batch result (a dict of batches for a cache of fields)."""
    return {k: v[i] for k, v in batch.items()} if isinstance(batch, dict) else batch[i]


def zero_like(x):
    return {k: torch.zeros_like(v) for k, v in x.items()} if isinstance(x, dict) else \
        torch.zeros_like(x)


def wait_iter_ready():
    deadline = time.monotonic() + 60
    while ITER_READY and not os.path.exists(ITER_READY):
        if time.monotonic() > deadline:
            say("NOREADY", os.getpid())  # the test fails on this line, not on a timeout
            os._exit(7)
        time.sleep(0.01)


def hold(marker, after_iter=False):
    if after_iter:
        wait_iter_ready()
    say(marker, os.getpid())
    while not (GO and os.path.exists(GO)):
        time.sleep(0.01)


def arm_create():
    real = os.posix_fallocate

    def fallocate(fd, offset, length):  # the leader stops once the file exists, full size
        real(fd, offset, length)
        hold("CREATING")
    os.posix_fallocate = fallocate


def arm_attach():
    real = SharedCache._check_header

    def check_header(self, head, size):  # holds the segment's flock and mapping here
        real(self, head, size)
        hold("ATTACHING")
    SharedCache._check_header = check_header


class MidCopy:
    """Stands in for cache._slot_samples in the writer: stops with half of the bytes copied."""

    def __init__(self, real, marker, after_iter=False):
        self.real, self.marker, self.after_iter = real, marker, after_iter

    def __getitem__(self, k):
        return self.real[k]

    def __setitem__(self, k, v):
        h = D // 2
        self.real[k][:h] = v[:h]
        hold(self.marker, self.after_iter)
        self.real[k][h:] = v[h:]


class AfterSet:
    """Stands in for cache._index_states in the writer: stops right after the state becomes SET."""

    def __init__(self, real, marker):
        self.real, self.marker = real, marker

    def __getitem__(self, k):
        return self.real[k]

    def __setitem__(self, k, v):
        self.real[k] = v
        if v == core.SET:
            hold(self.marker)


def scan(cache):
    hits = misses = bad = 0
    missing = []
    for i in range(N):
        v = cache.get_slot(i)
        if v is None:
            misses += 1
            missing.append(i)
        elif same(v, pattern(i)):
            hits += 1
        else:
            bad += 1
    return hits, misses, bad, missing


class Gate:
    """Unpickled after the cache in a spawned worker: the first worker to get here stops."""

    def __reduce__(self):
        return _gate, ()


def _gate():
    if GATE:
        try:
            os.close(os.open(GATE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            hold("WATTACHING", after_iter=True)
    return None


class DS(Dataset):
    def __init__(self, cache, phase):
        self.cache = cache  # pickled first, so a spawned worker has mapped it at the Gate
        self.phase = phase
        self.gate = Gate() if phase == "attach" else None

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None and info.id == 0 and i == 0:
            if self.phase == "write":
                self.cache._slot_samples = MidCopy(self.cache._slot_samples, "WINSIDE", True)
            elif self.phase == "read":
                wait_iter_ready()
                say("WREADING", os.getpid())
                while True:
                    if scan(self.cache)[2]:
                        os._exit(4)
        x = self.cache.get_slot(i)
        if x is None:
            x = pattern(i)
            self.cache.set_slot(i, x)
        return x


def init_worker(phase, worker_id):
    if phase == "startup" and worker_id == 0:
        hold("WSTARTING", after_iter=True)


def epoch(cache, ctx="fork", phase="none"):
    """One epoch. No DataLoader timeout: a dead worker is noticed by torch's SIGCHLD handler or
    its worker status check, and a hang by the test, which then asks for every stack."""
    dl = DataLoader(DS(cache, phase), batch_size=4, num_workers=2, multiprocessing_context=ctx,
                    worker_init_fn=functools.partial(init_worker, phase))
    if ITER_READY and os.path.exists(ITER_READY):
        os.unlink(ITER_READY)
    it = iter(dl)  # starts the workers and queues their first batches
    if ITER_READY:
        open(ITER_READY, "w").close()
    seen = bad = 0
    for b, batch in enumerate(it):
        for j, x in enumerate(batch):
            seen += 1
            bad += not torch.equal(x, pattern(4 * b + j))
    return seen, bad


def main():
    cache = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "create":
            if "pause_create" in args:
                arm_create()
            if "pause_attach" in args:
                arm_attach()
            say("CONSTRUCTING", os.getpid())
            try:
                dims = {"x": (D,), "label": ()} if FIELDS else (None,) if VARIABLE else (D,)
                dtype = {"x": torch.uint8, "label": torch.int64} if FIELDS else torch.uint8
                # (open sizes: the whole budget is the arena, reserved: 1 MiB is plenty)
                kind = OpenSizeCache if VARIABLE else SharedCache
                cache = kind(1 / 1024 if VARIABLE else 1, N, dims, dtype,
                                    name=PERSISTENT or "f", timeout=TIMEOUT,
                                    **({"persistent": True, "key": "k1"} if PERSISTENT else {}))
            except Exception as e:
                say("ERROR", type(e).__name__, str(e).replace("\n", " "))
                sys.exit(3)
            say("ATTACHED", len(cache))
        elif cmd == "write":
            n = 0
            for i in range(N - 1):
                if i % LWS == LOCAL_RANK:
                    cache.set_slot(i, pattern(i))
                    n += 1
            say("WROTE", n)
        elif cmd == "writehang" and VARIABLE:
            cache._arena = MidCopy(cache._arena, "INSIDE")
            cache.set_slot(int(args[0]), pattern(int(args[0])))
        elif cmd == "writehang":
            cache._slot_samples = MidCopy(cache._slot_samples, "INSIDE")
            cache.set_slot(int(args[0]), pattern(int(args[0])))
        elif cmd == "writehang_late":
            cache._index_states = AfterSet(cache._index_states, "INSIDE")
            cache.set_slot(int(args[0]), pattern(int(args[0])))
        elif cmd == "readloop":
            say("READING", os.getpid())
            while True:
                if scan(cache)[2]:
                    say("BAD")
                    sys.exit(4)
        elif cmd == "fill":
            filled = []
            for i in range(N):
                if cache.get_slot(i) is None:
                    try:
                        cache.set_slot(i, pattern(i))
                    except Exception as e:
                        say("ERROR", type(e).__name__, str(e).replace("\n", " "))
                        sys.exit(5)
                    filled.append(i)
            say("FILLED", len(filled), *filled)
        elif cmd == "check":
            hits, misses, bad, missing = scan(cache)
            say("CHECK", hits, misses, bad, *missing)
        elif cmd == "batch":
            rows, hit = cache.get_batch(range(N))
            bad = sum(not same(row(rows, i), pattern(i) if hit[i] else zero_like(pattern(i)))
                      for i in range(N))
            missing = [i for i in range(N) if not hit[i]]
            say("BATCH", N - len(missing), len(missing), bad, *missing)
        elif cmd == "loader":
            ctx, phase = args
            try:
                seen, bad = epoch(cache, ctx, phase)
                say("EPOCH", seen, bad)
            except RuntimeError as e:
                say("DLERROR", str(e).replace("\n", " "))
        elif cmd == "epoch":
            seen, bad = epoch(cache)
            say("EPOCH", seen, bad)
        elif cmd == "exit":
            if cache is not None:
                cache.close()
            say("BYE")
            return


if __name__ == "__main__":
    main()
