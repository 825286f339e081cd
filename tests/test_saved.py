"""A cache saved to a file and loaded in a later job: the samples come back as they were and
the rest are misses; a save killed mid-write leaves the previous file loadable; a truncated,
damaged or foreign file is refused and nothing of it is loaded; a file of other data or another
configuration is refused by name (or ignored when asked); a save of an unchanged cache writes
nothing; under torchrun the leader loads once and the other local rank attaches."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch

from _helpers import (CHILDREN, FIELD_DTYPES, FIELDS, SAVED_DIMS, fields_of, free_port,
                      rank_env, saved_cache, saved_file, used_bytes, value_of)
from stocaching import (CacheCapacityError, CacheConfigError, CacheFileError, OpenSizeCache,
                        SharedCache, World, describe_saved_file)


def _job(shm_dir, path, steps, n=64, slow_mib=0, **kw):
    return subprocess.Popen([sys.executable, str(CHILDREN / "saved.py"), str(path), str(n),
                             str(slow_mib)], env=rank_env(shm_dir, SAVED_STEPS=steps),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _run(shm_dir, path, steps, n=64) -> str:
    p = _job(shm_dir, path, steps, n)
    out, err = p.communicate(timeout=100)
    assert p.returncode == 0, err[-3000:]
    return out


def _holds(c: SharedCache, filled) -> None:
    """``c`` serves value_of(i) for every i in ``filled``, and misses for the others."""
    for i in range(c.dataset_len):
        got = c.get_slot(i)
        assert (got is not None) == (i in filled), i
        assert got is None or torch.equal(got, value_of(i, SAVED_DIMS))


@pytest.mark.timeout(120)
def test_a_saved_cache_loads_in_a_new_process_with_the_same_samples(shm_dir, tmp_path):
    path = tmp_path / "c.stc"
    out = _run(shm_dir, path, "load,fill:0:64:3,save")
    assert "LOADED 0" in out and "SAVED 22 " in out
    assert os.listdir(shm_dir) == []  # a plain cache: nothing is left in shared memory
    out = _run(shm_dir, path, "load,check")
    assert "LOADED 22" in out and "CHECKED 22" in out and "WRONG" not in out
    with saved_cache(shm_dir, path) as c:
        _holds(c, set(range(0, 64, 3)))
        assert c.stats()["filled"] == 22


@pytest.mark.parametrize("image", [(3, 8, 8), (4, 32, 32)],
                         ids=["rows under a page",
                              "rows of a page or more"])
def test_fields_and_another_slot_count_load_by_index(shm_dir, tmp_path, image):
    path = str(tmp_path / "f.stc")
    dims = dict(FIELDS, image=image)
    kw = dict(size_limit_gib=1e-3, dataset_len=40, data_dims=dims,
              dtype=FIELD_DTYPES, shm_dir=shm_dir)
    with SharedCache(**kw) as c:
        for i in range(0, 40, 2):
            c.set_slot(i, fields_of(i, dims))
        assert c.save(path)["samples"] == 20
    with SharedCache(**kw, load_from=path) as c:
        for i in range(40):
            got = c.get_slot(i)
            assert (got is None) == (i % 2 == 1)
            assert got is None or all(torch.equal(got[k], v)
                                      for k, v in fields_of(i, dims).items())
        row = c._slot_bytes
    # A smaller cache (10 slots, a random subset) takes the saved samples of its own indices.
    small = dict(kw, size_limit_gib=(10 * row + 40.5) / 2**30)
    with SharedCache(**small, random_subset=True, load_from=path) as c:
        held = set(c.cached_indices().tolist())
        assert len(c) == 10 and c.stats()["filled"] == len(held & set(range(0, 40, 2)))
        for i in held & set(range(0, 40, 2)):
            assert all(torch.equal(c.get_slot(i)[k], v) for k, v in fields_of(i, dims).items())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["first save (a new file)", "later save (appended)"])
def test_a_save_killed_mid_write_leaves_the_previous_file_loadable(shm_dir, tmp_path, kind):
    path = tmp_path / "c.stc"
    n = 2048  # 8 MiB of samples
    _run(shm_dir, path, "load,fill:0:100:1,save", n=n)
    before = path.read_bytes()
    # A process that never saved to the file writes it anew; one that loaded it appends.
    first = kind.startswith("first")
    p = _job(shm_dir, path, ("new" if first else "load") + ",fill:0:2048:1,save", n=n,
             slow_mib=4)
    try:
        assert p.stdout.readline().startswith("LOADED")
        assert p.stdout.readline() == "MID\n"  # rows written, nothing committed yet
        temporaries = [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
        assert len(temporaries) == (1 if first else 0)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.communicate(timeout=30)
    if first:
        assert path.read_bytes() == before  # the new file was never renamed over it
    else:
        assert path.stat().st_size > len(before)  # rows appended past the committed end
    with saved_cache(shm_dir, path, n=n) as c:
        assert c.stats()["filled"] == 100  # the previous save, and nothing of the killed one
        _holds(c, set(range(100)))
        assert c.save(path)["rewritten"] is False  # the file is its own again: appended to
        c.set_slot(200, value_of(200, SAVED_DIMS))
        assert c.save(path)["samples"] == 1
    with saved_cache(shm_dir, None, key="", n=n) as c:
        c.set_slot(0, value_of(0, SAVED_DIMS))
        assert c.save(path)["rewritten"]  # a new file, and the dead save's temporary goes
    assert sorted(os.listdir(tmp_path)) == ["c.stc"]


@pytest.mark.parametrize("damage,match", [
    ("truncate", r"is truncated"),
    ("flip a sample byte", r"the samples of the save record at byte \d+ fail their check"),
    ("flip an index byte", r"the indices of the save record .* fail their check"),
    ("zero the header", r"not a file saved by SharedCache.save, or its header is damaged"),
    ("not a saved file", r"not a file saved by SharedCache.save"),
])
def test_a_truncated_or_damaged_file_is_refused_and_nothing_is_loaded(shm_dir, tmp_path,
                                                                       damage, match):
    path = saved_file(shm_dir, tmp_path)
    data = bytearray(open(path, "rb").read())
    rows_at = 3 * 4096  # superblocks, config, then the first chunk's samples
    if damage == "truncate":
        data = data[:len(data) - 5000]
    elif damage == "flip a sample byte":
        data[rows_at + 4096 * 7 + 100] ^= 1
    elif damage == "flip an index byte":
        data[rows_at + 4096 * 32 + 8] ^= 1
    elif damage == "zero the header":
        data[:8192] = bytes(8192)
    else:
        data = bytearray(b"#!/bin/sh\n" * 2000)
    open(path, "wb").write(data)
    with pytest.raises(CacheFileError, match=match) as e:
        saved_cache(shm_dir, path)
    assert e.value.path == path and "remove it" in str(e.value).lower()
    assert os.listdir(shm_dir) == []  # nothing made


@pytest.mark.parametrize("kw,field,match", [
    (dict(key="k2"), "key", r"holds key='k1', but this cache has key='k2'"),
    (dict(data_dims=(4, 32, 16)), "data_dims", r"holds data_dims=\(4, 32, 32\), but this cache "
                                               r"has data_dims=\(4, 32, 16\)"),
    (dict(dtype=torch.int16), "dtype", r"holds dtype='uint8', but this cache has dtype='int16'"),
    (dict(n=65), "dataset_len", r"holds dataset_len=64, but this cache has dataset_len=65"),
])
def test_a_file_of_other_data_is_refused_by_name_or_ignored_when_asked(shm_dir, tmp_path,
                                                                        caplog, kw, field,
                                                                        match):
    path = saved_file(shm_dir, tmp_path)
    with pytest.raises(CacheConfigError, match=match) as e:
        saved_cache(shm_dir, path, **kw)
    assert e.value.field == field and "on_mismatch='replace'" in str(e.value)
    assert os.listdir(shm_dir) == []
    with caplog.at_level(logging.WARNING, "stocaching"):
        with saved_cache(shm_dir, path, on_mismatch="replace", **kw) as c:
            assert c.stats()["filled"] == 0
            assert c.save(path)["rewritten"]  # never appended to a file of other data
    assert f"ignored the saved file {path}" in caplog.text
    with pytest.raises(CacheConfigError):  # the file is the new cache's now
        saved_cache(shm_dir, path)


def test_saving_an_unchanged_cache_writes_nothing(shm_dir, tmp_path):
    path = saved_file(shm_dir, tmp_path)
    with saved_cache(shm_dir, path) as c:  # loaded from the file: its saves append to it
        st = os.stat(path)
        for _ in range(3):
            assert c.save(path) == {"path": path, "samples": 0, "emptied": 0, "bytes": 0,
                                    "rewritten": False, "saved": True}
        after = os.stat(path)
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == \
            (st.st_size, st.st_mtime_ns, st.st_ino)
        c.set_slot(1, value_of(1, SAVED_DIMS))
        out = c.save(path)  # one sample: its row, its index, a trailer and a superblock
        assert (out["samples"], out["rewritten"]) == (1, False)
        assert out["bytes"] <= 2 * 4096 + 128
        c.clear()
        assert c.save(path)["emptied"] == 33
        assert c.save(path)["bytes"] == 0
    with saved_cache(shm_dir, path) as c:
        assert c.stats()["filled"] == 0


def test_only_the_local_leader_saves_and_each_node_names_its_file(shm_dir, tmp_path):
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    path = str(tmp_path / "n{node}.stc")
    lead = saved_cache(shm_dir, path, world=worlds[0], timeout=60)
    other = saved_cache(shm_dir, path, world=worlds[1], timeout=60)
    other.set_slot(5, value_of(5, SAVED_DIMS))
    assert other.save(path) == {"path": str(tmp_path / "n0.stc"), "samples": 0, "emptied": 0,
                                "bytes": 0, "rewritten": False, "saved": False}
    assert not os.path.exists(tmp_path / "n0.stc")
    assert lead.save(path)["samples"] == 1 and os.path.exists(tmp_path / "n0.stc")
    other.close()
    lead.close()


def test_a_persistent_cache_is_filled_from_the_file_only_when_made(shm_dir, tmp_path):
    path = saved_file(shm_dir, tmp_path)
    kw = dict(name="kept", persistent=True)
    with saved_cache(shm_dir, path, **kw) as c:
        assert c.stats()["filled"] == 32
        c.set_slot(1, value_of(1, SAVED_DIMS))
        assert c.save(path)["samples"] == 1  # it loaded the file: appends to it
    with saved_cache(shm_dir, None, **kw) as c:  # attached: the segment as it was
        assert c.stats()["filled"] == 33


def test_bad_arguments_and_open_sizes_are_refused(shm_dir, tmp_path):
    with pytest.raises(TypeError, match=r"load_from should be the path .* load_from=3"):
        saved_cache(shm_dir, 3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'load_from'"):
        OpenSizeCache(1e-3, 10, (None, 3), shm_dir=shm_dir, load_from=str(tmp_path / "x"))
    with OpenSizeCache(1e-3, 10, (None, 3), shm_dir=shm_dir) as c:
        assert not hasattr(c, "save")  # a file holds rows of one size
    with saved_cache(shm_dir, None, key="") as c:
        with pytest.raises(TypeError, match=r"path should be a str or os.PathLike"):
            c.save(None)
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(200)
def test_two_local_ranks_under_torchrun_load_once(shm_dir, tmp_path):
    path = tmp_path / "c.stc"
    _run(shm_dir, path, "load,fill:0:64:2,save")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master-port={free_port()}", str(CHILDREN / "saved.py"), str(path), "64", "0"]
    r = subprocess.run(cmd, env=rank_env(shm_dir, SAVED_STEPS="load,check,save",
                                         SAVED_LOG="1"),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("LOADED 32") == 2 and r.stdout.count("CHECKED 32") == 2, r.stdout
    assert r.stdout.count("SAVED 0 0 False") == 1, r.stdout  # the leader alone: unchanged
    assert r.stdout.count("stocaching: loaded 32 samples") == 1, r.stdout  # it alone loads
    with saved_cache(shm_dir, path) as c:
        _holds(c, set(range(0, 64, 2)))


@pytest.mark.parametrize("sendfile", [True, False],
                         ids=["copied by the kernel", "read into the mapping"])
def test_rows_load_in_pieces_straight_or_scattered_and_a_bad_row_anywhere_is_refused(
        shm_dir, tmp_path, monkeypatch, sendfile):
    """Pieces of 3 rows (the check chained over them): the first chunk's rows go straight
    into consecutive slots, the appended chunk's (slots 41, 45, 50-53) are scattered, then
    straight; a flipped byte in the appended rows refuses the whole file."""
    import stocaching.saved as saved
    monkeypatch.setattr(saved, "_SENDFILE", sendfile)
    monkeypatch.setattr(saved, "_SAVE_IO", 3 * 4096)
    path = str(tmp_path / "c.stc")
    filled = set(range(40)) | {41, 45, 50, 51, 52, 53}
    with saved_cache(shm_dir, path) as c:  # (no file yet: it starts empty)
        for i in range(40):
            c.set_slot(i, value_of(i, SAVED_DIMS))
        appended_at = c.save(path)["bytes"]  # (the end of the first chunk)
        for i in sorted(filled - set(range(40))):
            c.set_slot(i, value_of(i, SAVED_DIMS))
        assert c.save(path)["samples"] == 6
    with saved_cache(shm_dir, path) as c:
        _holds(c, filled)
    data = bytearray(open(path, "rb").read())
    data[appended_at + 4096 + 100] ^= 1  # the second appended row: slot 45's
    open(path, "wb").write(data)
    with pytest.raises(CacheFileError, match=rf"record at byte {appended_at} fail their check"):
        saved_cache(shm_dir, path)
    assert os.listdir(shm_dir) == []


def test_staged_samples_are_not_saved(shm_dir, tmp_path):
    path = str(tmp_path / "c.stc")
    kw = dict(size_limit_gib=(8 * 4096 + 4 * 4096 + 64) / 2**30, dataset_len=64,
              data_dims=SAVED_DIMS, staging_slots=4, random_subset=True, shm_dir=shm_dir)
    with SharedCache(**kw) as c:
        held = c.cached_indices()
        outside = sorted(set(range(64)) - set(held.tolist()))[:2]
        c.set_slot(int(held[0]), value_of(int(held[0]), SAVED_DIMS))
        assert all(c.stage(i, value_of(i, SAVED_DIMS)) for i in outside)
        assert c.save(path)["samples"] == 1
    with SharedCache(**kw, load_from=path) as c:
        assert c.stats()["filled"] == 1 and not c.ready_mask(outside).any()
        assert c.get_slot(outside[0]) is None


def test_a_loaded_segment_is_reserved_whole_once_loaded(shm_dir, tmp_path):
    """The copy by sendfile allocates the pages of the slots it fills; the rest (here the
    empty slots) is reserved before the cache is handed out, as for any new cache."""
    path = saved_file(shm_dir, tmp_path)  # every other slot filled
    with saved_cache(shm_dir, path) as c:
        st = os.fstat(c._segment.fd)
        assert st.st_blocks * 512 >= st.st_size == c.stats()["bytes"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sendfile", [True, False],
                         ids=["copied by the kernel", "read into the mapping"])
def test_a_load_that_finds_the_tmpfs_full_fails_clearly_and_leaves_nothing(
        shm_dir, tmp_path, tmpfs, monkeypatch, sendfile):
    """Another process takes the space after the free-space check (faked: statvfs reports
    room the tmpfs does not have): the copy or the reservation fails with ENOSPC, which is
    a CacheCapacityError, and the half-made segment is gone."""
    import stocaching.saved as saved
    path, n, dims = str(tmp_path / "big.stc"), 2048, (16, 32, 32)  # 32 MiB of samples
    kw = dict(size_limit_gib=n * (16 * 1024 + 1) / 2**30, dataset_len=n, data_dims=dims)
    with SharedCache(**kw, shm_dir=shm_dir) as c:
        for i in range(n):
            c.set_slot(i, value_of(i, dims))
        c.save(path)
    with open(os.path.join(tmpfs, "neighbour"), "wb") as f:
        f.write(bytes(40 * 2**20))  # of the 64 MiB tmpfs
    real = os.statvfs

    def roomy(p):
        st = real(p)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks * 4, st.f_bfree * 4,
                                  st.f_bavail * 4, *st[5:]))

    monkeypatch.setattr(saved, "_SENDFILE", sendfile)
    monkeypatch.setattr(os, "statvfs", roomy)
    with pytest.raises(CacheCapacityError, match=rf"{tmpfs} has .* free but the cache needs"):
        SharedCache(**kw, shm_dir=tmpfs, load_from=path)
    monkeypatch.undo()
    os.unlink(os.path.join(tmpfs, "neighbour"))
    assert os.listdir(tmpfs) == [] and used_bytes(tmpfs) == 0


def test_a_saved_file_is_described_without_loading_it(shm_dir, tmp_path):
    path = saved_file(shm_dir, tmp_path)  # 32 samples, one save
    with saved_cache(shm_dir, path) as c:
        c.set_slot(1, value_of(1, SAVED_DIMS))
        c.set_slot(0, value_of(0, SAVED_DIMS), allow_overwrite=True)  # (a row replaced)
        c.save(path)
        c.clear()
        c.save(path)  # (every index emptied: nothing to load)
        c.set_slot(3, value_of(3, SAVED_DIMS))
        c.save(path)
    os.utime(path, (os.path.getatime(path), os.path.getmtime(path) - 3600))
    d = describe_saved_file(path, verify=True)
    age_s = d.pop("age_s")
    assert 3600 <= age_s < 3700 and d == {
        "path": path, "key": "k1", "dataset_len": 64, "data_dims": SAVED_DIMS, "dtype": "uint8",
        "node_rank": 0, "num_nodes": 1, "samples": 1, "rows": 35, "saves": 4,
        "bytes": os.path.getsize(path), "verified": True}
    assert os.listdir(shm_dir) == []  # nothing loaded
    fields = str(tmp_path / "fields.stc")
    with SharedCache(1e-3, 8, FIELDS, dtype=FIELD_DTYPES, shm_dir=shm_dir) as c:
        c.set_slot(2, fields_of(2, FIELDS))
        c.save(fields)
    d = describe_saved_file(fields)
    assert d["data_dims"] == {k: tuple(v) for k, v in FIELDS.items()} and \
        d["dtype"] == {k: str(v).replace("torch.", "") for k, v in FIELD_DTYPES.items()} and \
        (d["key"], d["samples"], d["verified"]) == ("", 1, False)
    with pytest.raises(TypeError, match=r"path should be a str or os.PathLike, but got path=3"):
        describe_saved_file(3)




def test_a_crc_put_together_from_parts_is_the_crc_of_the_whole():
    import zlib

    from stocaching.saved import _crc32_combine
    data = bytes(value_of(5, (3, 64, 64)).reshape(-1).tolist()) * 3
    for cut in (0, 1, 7, 4096, 12289, len(data) - 1, len(data)):
        a, b = data[:cut], data[cut:]
        assert _crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data), cut


def test_a_save_into_a_missing_directory_names_the_path_and_writes_nothing(shm_dir, tmp_path):
    path = tmp_path / "missing" / "c.stc"
    with saved_cache(shm_dir, None, key="") as c:
        c.set_slot(1, value_of(1, SAVED_DIMS))
        with pytest.raises(FileNotFoundError, match=r"path should be a file in an existing "
                           r"directory, but got path='.*/missing/c\.stc' \(.*/missing is not"):
            c.save(path)
    assert os.listdir(tmp_path) == []

@pytest.mark.parametrize("saved_with", ["zlib", "zlib-ng"])
def test_a_file_saved_with_either_crc_32_loads_with_the_other(shm_dir, tmp_path, monkeypatch,
                                                               saved_with):
    """saved.py takes zlib-ng's CRC-32 where it is installed and zlib's where not (a copied
    saved.py): the same function, so a file written by one loads with the other."""
    import zlib

    import stocaching.saved as saved
    zlib_ng = pytest.importorskip("zlib_ng.zlib_ng")
    data = bytes(value_of(3, (3, 64, 64)).reshape(-1).tolist())
    assert zlib_ng.crc32(data) == zlib.crc32(data) and zlib_ng.crc32(data, 7) == \
        zlib.crc32(data, 7)
    first, then = (zlib.crc32, zlib_ng.crc32) if saved_with == "zlib" else \
        (zlib_ng.crc32, zlib.crc32)
    monkeypatch.setattr(saved, "_crc32", first)
    path = saved_file(shm_dir, tmp_path)  # (every even index of 64)
    monkeypatch.setattr(saved, "_crc32", then)
    with saved_cache(shm_dir, path) as c:
        _holds(c, set(range(0, 64, 2)))


def _parted(monkeypatch, sendfile=True):
    """Load in parts of 4 rows (3 threads at most) and pieces of 2 rows, so that a small
    file takes every path of a large one."""
    import stocaching.saved as saved
    monkeypatch.setattr(saved, "_SENDFILE", sendfile)
    monkeypatch.setattr(saved, "_LOAD_PIECE", 2 * 4096)
    monkeypatch.setattr(saved, "_LOAD_PART", 4 * 4096)
    monkeypatch.setattr(saved, "_LOAD_THREADS", 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})


@pytest.mark.parametrize("sendfile", [True, False],
                         ids=["copied by the kernel", "read into the mapping"])
def test_rows_load_in_parts_by_threads_and_a_bad_row_in_any_part_is_refused(
        shm_dir, tmp_path, monkeypatch, sendfile):
    """Three threads each copy a part of each chunk (the chunk's check put together from the
    parts'): straight rows, a replaced one and scattered ones load as saved; a byte flipped
    in the middle of the first chunk's last part or first part, or in a scattered row of the
    second chunk, refuses the whole file."""
    _parted(monkeypatch, sendfile)
    path = str(tmp_path / "c.stc")
    filled = set(range(30)) | {31, 37, 44, 50, 51, 52, 53, 54}
    with saved_cache(shm_dir, path) as c:
        for i in range(30):
            c.set_slot(i, value_of(i, SAVED_DIMS))
        first_end = c.save(path)["bytes"]
        c.set_slot(4, value_of(4, SAVED_DIMS), allow_overwrite=True)  # (its first row dies)
        for i in sorted(filled - set(range(30))):
            c.set_slot(i, value_of(i, SAVED_DIMS))
        assert c.save(path)["samples"] == 9
    import stocaching.saved as saved
    shares, real = [], saved._SavedFileReader._copy_share

    def noted(self, share, *args):
        shares.append(len(share))
        return real(self, share, *args)

    monkeypatch.setattr(saved._SavedFileReader, "_copy_share", noted)
    with saved_cache(shm_dir, path) as c:
        _holds(c, filled)
    assert sorted(shares) == [1, 2, 2]  # (parts of each chunk: 3 of the first, 2 of the other)
    good = open(path, "rb").read()
    rows = 3 * 4096  # (where the first chunk's rows start: past the header)
    for at, record in ((rows + 26 * 4096 + 9, rows), (rows + 3 * 4096 + 9, rows),
                       (first_end + 4096 + 9, first_end)):  # (slot 31's row: scattered)
        data = bytearray(good)
        data[at] ^= 0x40
        open(path, "wb").write(data)
        with pytest.raises(CacheFileError, match=rf"record at byte {record} fail their check"):
            saved_cache(shm_dir, path)
        assert os.listdir(shm_dir) == []


def test_a_file_truncated_in_the_middle_of_a_chunk_is_refused(shm_dir, tmp_path, monkeypatch):
    _parted(monkeypatch)
    path = saved_file(shm_dir, tmp_path)  # 32 rows in one chunk
    size = os.path.getsize(path)
    os.truncate(path, 3 * 4096 + 20 * 4096 + 100)
    with pytest.raises(CacheFileError, match=rf"is truncated: .* ends at byte {size}"):
        saved_cache(shm_dir, path)
    assert os.listdir(shm_dir) == []


def test_a_file_that_shrinks_during_the_load_is_refused_as_truncated(shm_dir, tmp_path,
                                                                       monkeypatch):
    """The size is checked before the copy; a file cut short after that (by another process)
    fails the copy of the part that reaches past its end, and nothing is loaded."""
    import stocaching.saved as saved
    _parted(monkeypatch)
    path = saved_file(shm_dir, tmp_path)
    real = saved._read_chunks

    def then_cut(fd, *args):
        found = real(fd, *args)
        os.truncate(path, 3 * 4096 + 20 * 4096 + 100)
        return found

    monkeypatch.setattr(saved, "_read_chunks", then_cut)
    with pytest.raises(CacheFileError, match=r"is truncated: it ends at byte \d+, inside a saved"):
        saved_cache(shm_dir, path)
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("parted", [False, True], ids=["as it is", "in parts"])
def test_a_file_written_by_stocaching_0_3_0_loads(shm_dir, tmp_path, monkeypatch, parted):
    """tests/data/saved-by-0.3.0.stc, written before the load was split among threads (at
    0efacba): samples 0-9 saved, then 0 replaced and 12, 20 and 33 added (a second chunk)."""
    if parted:
        import stocaching.saved as saved
        _parted(monkeypatch)
        monkeypatch.setattr(saved, "_LOAD_PIECE", 2 * 128)
        monkeypatch.setattr(saved, "_LOAD_PART", 3 * 128)
    dims = (2, 8, 8)
    with SharedCache(64 * 200 / 2**30, 64, dims, key="old-format", shm_dir=shm_dir,
                     load_from=os.path.join(os.path.dirname(__file__), "data",
                                            "saved-by-0.3.0.stc")) as c:
        for i in range(64):
            got = c.get_slot(i)
            assert (got is not None) == (i in {*range(10), 12, 20, 33}), i
            assert got is None or torch.equal(got, value_of(i, dims))
