"""A persistent cache outlives its job: it is made only when asked for by name, the next job on
the machine attaches to it with every filled slot a hit, a slot that a killed job left
half-written is a miss, other data (key) or another configuration is refused by name, and it is
removed only when asked for by name."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

from _helpers import (age, assert_the_killed_write_is_a_miss, named, rank_env,
                      ranks_with_a_killed_writer, value_of)
from stocaching import CacheConfigError, SharedCache, World, clean_segments, list_segments

DIMS = (3, 8, 8)


def write_slot(cache: SharedCache, idx: int) -> bool:
    """A Pool task (module level, so that spawned workers can import it)."""
    cache.set_slot(idx, value_of(idx, DIMS))
    return cache.stats()["filled"] > 0


def _persistent(shm_dir, **kw):
    args = dict(size_limit_gib=1e-3, dataset_len=50, data_dims=DIMS, name="digits",
                persistent=True, key="v1", shm_dir=shm_dir)
    args.update(kw)
    return SharedCache(**args)


@pytest.mark.timeout(120)
def test_the_next_job_attaches_with_every_filled_slot_a_hit(shm_dir):
    """Two jobs in two processes: the first fills and returns, the second finds the samples."""
    fill = ("import torch; from _helpers import value_of; from stocaching import SharedCache\n"
            "c = SharedCache(1e-3, 50, (3, 8, 8), name='digits', persistent=True, key='v1')\n"
            "[c.set_slot(i, value_of(i, (3, 8, 8))) for i in range(0, 50, 2)]\n")
    r = subprocess.run([sys.executable, "-c", fill], env=rank_env(shm_dir), capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert len(named(shm_dir)) == 1  # the name stays after the job
    with _persistent(shm_dir) as c:
        assert c.stats()["filled"] == 25
        for i in range(50):
            got = c.get_slot(i)
            assert (got is None) == (i % 2 == 1)
            assert got is None or torch.equal(got, value_of(i, DIMS))
    (seg,) = [s for s in list_segments(shm_dir) if "key" in s]
    assert (seg["name"], seg["key"], seg["filled"], seg["slots"]) == ("digits", "v1", 25, 50)


@pytest.mark.timeout(240)
def test_a_slot_half_written_when_a_job_was_killed_is_a_miss_in_the_next_job(children,
                                                                              shm_dir):
    n = 32  # job.py's N
    lead = ranks_with_a_killed_writer(children, shm_dir, "first", n - 1, FT_PERSISTENT="kept")
    lead.send("exit")
    assert lead.wait() == 0
    assert named(shm_dir) == [f"stocaching_{os.getuid()}_persistent_n0_kept"]
    # A new job (another job key, one process) finds the cache the first one left.
    again = children("again", rank_env(shm_dir, "second", FT_PERSISTENT="kept"))
    again.send("create")
    again.expect("ATTACHED")
    assert_the_killed_write_is_a_miss(again, n, probes=("check", "batch"))


@pytest.mark.parametrize("kw,field,match", [
    (dict(key="v2"), "key", r"holds key='v1', but this job asked for key='v2'"),
    (dict(data_dims=(3, 8, 4)), "data_dims", r"holds data_dims=\(3, 8, 8\), but this job asked "
                                             r"for data_dims=\(3, 8, 4\)"),
    (dict(dataset_len=60), "dataset_len", r"holds dataset_len=50"),
    (dict(dtype=torch.int16), "dtype", r"holds dtype="),
])
def test_other_data_or_another_configuration_is_refused_by_name_or_replaced(shm_dir, kw,
                                                                             field, match):
    with _persistent(shm_dir) as c:
        c.set_slot(1, value_of(1, DIMS))
    with pytest.raises(CacheConfigError, match=match) as e:
        _persistent(shm_dir, **kw)
    assert e.value.field == field and "on_mismatch='replace'" in str(e.value)
    with _persistent(shm_dir) as c:  # refused: the old one is intact
        assert torch.equal(c.get_slot(1), value_of(1, DIMS))
    with _persistent(shm_dir, on_mismatch="replace", **kw) as fresh:
        assert fresh.stats()["filled"] == 0  # never reads the old bytes as its own
    assert len(named(shm_dir)) == 1


GIB_20 = (20 * 3 * 8 * 8 + 50) / 2**30  # 20 slots of DIMS for 50 samples


def _node(node_rank, num_nodes):
    return World(rank=node_rank, world_size=num_nodes, node_rank=node_rank, num_nodes=num_nodes)


def test_a_job_on_another_number_of_nodes_finds_its_nodes_share_warm(shm_dir):
    """Node 0's share of the layout is the same in a world of 2 nodes, 3 or one with
    random_subset, so a job resized from 2 nodes to 3 (or 1) attaches to what node 0 cached; a
    world of one node without random_subset caches the first indices instead, and is refused
    by name."""
    with _persistent(shm_dir, size_limit_gib=GIB_20, world=_node(0, 2)) as c:
        share = c.cached_indices()
        assert len(share) == 20
        for i in share.tolist():
            c.set_slot(i, value_of(i, DIMS))
    for world, kw in ((_node(0, 3), {}), (World(), dict(random_subset=True))):
        with _persistent(shm_dir, size_limit_gib=GIB_20, world=world, **kw) as c:
            assert c.cached_indices().tolist() == share.tolist()
            assert all(torch.equal(c.get_slot(i), value_of(i, DIMS)) for i in share.tolist())
            assert c.stats()["filled"] == len(share)
    with pytest.raises(CacheConfigError, match=r"holds num_nodes=2, but this job asked for "
                                               r"num_nodes=1") as e:
        _persistent(shm_dir, size_limit_gib=GIB_20, world=World())
    assert e.value.field == "num_nodes"


def test_a_cache_in_use_is_not_replaced(shm_dir):
    with _persistent(shm_dir):
        with pytest.raises(CacheConfigError, match="not replaced: another process uses it"):
            _persistent(shm_dir, key="v2", on_mismatch="replace")


def test_two_local_ranks_attach_once_and_the_name_stays(shm_dir):
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    for _ in range(2):  # two jobs, one after the other
        lead = _persistent(shm_dir, world=worlds[0], timeout=60)
        other = _persistent(shm_dir, world=worlds[1], timeout=60)
        other.set_slot(7, value_of(7, DIMS))
        assert torch.equal(lead.get_slot(7), value_of(7, DIMS))
        assert lead.stats()["bytes"] == other.stats()["bytes"]
        assert len(named(shm_dir)) == 1
        other.close()
        lead.close()
    assert len(named(shm_dir)) == 1


@pytest.mark.timeout(120)
def test_a_persistent_cache_goes_to_spawned_processes_too(shm_dir):
    with _persistent(shm_dir) as c:
        with mp.get_context("spawn").Pool(2) as pool:
            assert pool.starmap(write_slot, [(c, 2), (c, 9)]) == [True, True]
        assert torch.equal(c.get_slot(9), value_of(9, DIMS))


def test_clean_removes_a_persistent_cache_only_by_name_or_flag(shm_dir):
    for name in ("a", "b"):
        _persistent(shm_dir, name=name).close()
    with SharedCache(1e-3, 50, DIMS, shm_dir=shm_dir):  # a plain cache: never named at all
        pass
    # (no age(): a persistent cache asked for by name goes at once, as on a script's last line)
    assert clean_segments(shm_dir) == [] and len(named(shm_dir)) == 2
    assert clean_segments(shm_dir, persistent=False) == [] and len(named(shm_dir)) == 2
    r = subprocess.run([sys.executable, "-m", "stocaching", "--shm-dir", shm_dir, "clean",
                        "--persistent", "a"], capture_output=True, text=True, timeout=60,
                       env=rank_env(shm_dir))
    assert r.returncode == 0 and r.stdout.count("removed") == 1 and r.stdout.endswith("_a\n")
    assert named(shm_dir) == [f"stocaching_{os.getuid()}_persistent_n0_b"]
    b = os.path.join(shm_dir, f"stocaching_{os.getuid()}_persistent_n0_b")
    assert clean_segments(shm_dir, persistent=True) == [b]
    assert named(shm_dir) == []


def test_the_listing_says_how_long_ago_a_job_last_attached(shm_dir):
    _persistent(shm_dir).close()
    age([os.path.join(shm_dir, n) for n in named(shm_dir)], 3600.0)
    [seg] = list_segments(shm_dir)
    assert 3590 < seg["age_s"] < 3700 and seg["state"] == "kept"
    _persistent(shm_dir).close()  # the next job attaches: the age starts again
    [seg] = list_segments(shm_dir)
    assert seg["age_s"] < 60


def test_a_cache_removed_while_a_job_turns_its_lock_shared_is_made_anew(shm_dir,
                                                                         monkeypatch):
    """flock turns exclusive into shared by dropping the lock first: a `clean` of the name
    may run in between. The attaching job then makes a new cache rather than keep one that
    has no name (the next job could not find it)."""
    with _persistent(shm_dir) as c:
        c.set_slot(1, value_of(1, DIMS))
    import stocaching.stocaching as core
    flock, cleaned = core.fcntl.flock, []

    def flock_with_a_clean_in_between(fd, op):
        if op == core.fcntl.LOCK_SH and not cleaned:  # (the first one: the switch)
            flock(fd, core.fcntl.LOCK_UN)
            cleaned.extend(clean_segments(shm_dir, persistent=["digits"]))
        return flock(fd, op)

    monkeypatch.setattr(core.fcntl, "flock", flock_with_a_clean_in_between)
    with _persistent(shm_dir) as c:
        assert len(cleaned) == 1 and c.stats()["filled"] == 0
        st = os.stat(os.path.join(shm_dir, named(shm_dir)[0]))
        assert (st.st_dev, st.st_ino) == c._segment.file_id  # the name is this cache's


@pytest.mark.parametrize("kw,exc,match", [
    (dict(name=None), ValueError, r"a persistent cache needs a name=.* name=None"),
    (dict(job_key="j1"), ValueError, r"found by its name alone.* job_key='j1'"),
    (dict(key=3), TypeError, r"key should be a str .* key=3"),
    (dict(key="x" * 1024), ValueError, r"key should be a str of less than 1024"),
    (dict(on_mismatch="keep"), ValueError, r"on_mismatch should be 'raise' or 'replace'.*'keep'"),
    (dict(persistent=1), TypeError, r"persistent should be a bool, but got persistent=1"),
    (dict(persistent=False, key="v1"), ValueError, r"key and on_mismatch are for a persistent"),
    (dict(size_limit_gib="auto"), ValueError, r"size_limit_gib='auto' cannot make a persistent"),
    (dict(persistent=False, key="", job_key="persistent"), ValueError,
     r"job_key .* should not be 'persistent'"),
])
def test_bad_persistent_arguments_make_nothing(shm_dir, kw, exc, match):
    with pytest.raises(exc, match=match):
        _persistent(shm_dir, **kw)
    assert os.listdir(shm_dir) == []
