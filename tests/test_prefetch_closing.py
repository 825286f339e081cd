"""Ending with a prefetcher's iterator unfinished, in every order, in a real child process
(issue 25, items 2 and C): the iterator abandoned, the cache closed first, the prefetcher
closed first, the interpreter's exit, an exception in the training loop. Each is quiet
(nothing on the child's stderr: no "Exception ignored in <generator object
Prefetcher.__iter__>", no "Bad file descriptor") and leaves no staging slot taken.

The test makes the cache as local rank 0 of two and the child attaches as local rank 1, as a
rank of a real job shares its node's staging area: the test still sees that area once the
child is gone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from stocaching import SharedCache, World

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "children"))
from _helpers import budget_for, rank_env, run_child  # noqa: E402
from prefetch_common import DIMS  # noqa: E402

N, SLOTS, STAGING = 64, 16, 64  # as in tests/children/prefetch_closing.py

SCENARIOS = ["abandoned", "cache-closed-first", "prefetcher-closed-first", "exit", "exception"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [0, 1])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ending_in_any_order_is_quiet_and_frees_the_staging_area(shm_dir, scenario, processes):
    key = f"closing-{os.getpid()}-{scenario}-{processes}"
    world = World(rank=0, world_size=2, local_rank=0, local_world_size=2)
    cache = SharedCache(budget_for(SLOTS, DIMS, staging=STAGING, dataset_len=N), N, DIMS,
                        staging_slots=STAGING, name="closing", world=world, shm_dir=shm_dir,
                        job_key=key)
    try:
        run = run_child("prefetch_closing.py", scenario, processes,
                        env=rank_env(shm_dir, key), timeout=100)
        assert run.returncode == 0, run.stderr
        assert run.stdout == "ENDING\n"
        assert run.stderr == ""
        assert cache.stats()["staged"] == 0
    finally:
        cache.close()
