"""Several fields a sample: ``data_dims`` and ``dtype`` as dicts keyed by field name, one slot
holding every field packed, ``set_slot`` taking a dict and ``get_slot`` / ``get_batch`` giving
dicts; everything else (layout, staging, stats, attach checks, pickling) as for one tensor."""

from __future__ import annotations

import collections
import copy
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from _helpers import (FIELD_DTYPES, FIELDS, FIELDS_ROW, BatchedDataset, TwoLineDataset,
                      assert_no_leak, assert_the_killed_write_is_a_miss, budget_for, fields_of,
                      ranks_with_a_killed_writer)
from stocaching import CacheConfigError, Prefetcher, SharedCache, World, plan
from stocaching import fields as fields_module
from stocaching import stocaching as core

N = 40


def budget(slots: int, n: int = N, staging: int = 0) -> float:
    """size_limit_gib that buys exactly ``slots`` slots of FIELDS (rows of FIELDS_ROW bytes)."""
    return budget_for(slots, (FIELDS_ROW,), staging=staging, dataset_len=n)


def fields_cache(shm_dir, slots=30, n=N, **kw) -> SharedCache:
    return SharedCache(budget(slots, n, kw.get("staging_slots", 0)), n, FIELDS, FIELD_DTYPES,
                       shm_dir=shm_dir, **kw)


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def snapshot(c: SharedCache) -> tuple:
    """Everything a refused call must leave as it was."""
    s = c.stats()
    return (c._slot_samples.tobytes(), c._index_states_np.tobytes(), s["hits"], s["misses"],
            s["writes"])


def test_fields_are_packed_in_order_each_aligned_to_its_itemsize(shm_dir):
    fields, row = fields_module.check_fields(FIELDS, FIELD_DTYPES)
    assert [(f.name, f.offset, f.nbytes) for f in fields] == \
        [("image", 0, 192), ("label", 192, 8), ("box", 200, 16)]
    assert row == 216
    fields, row = fields_module.check_fields({"a": (3,), "b": (), "c": (1,)},
                                             {"a": torch.uint8, "b": torch.int64, "c": torch.int16})
    assert [f.offset for f in fields] == [0, 8, 16] and row == 24  # a struct's padding
    with fields_cache(shm_dir) as c:
        assert len(c) == 30 and c._slot_samples.shape[1] == 216
        assert c.fields == ("image", "label", "box")
        assert c.data_dims == FIELDS and c.dtype == FIELD_DTYPES
        assert plan(N, FIELDS, FIELD_DTYPES, size_limit_gib=budget(30), shm_dir=shm_dir)[
            "slots"] == 30


def test_a_sample_goes_in_as_a_dict_and_comes_back_as_one(shm_dir):
    with fields_cache(shm_dir) as c:
        for i in range(0, 30, 3):
            c.set_slot(i, fields_of(i))
        for i in range(N):
            got = c.get_slot(i)
            if i % 3 or i >= 30:
                assert got is None
                continue
            assert same(got, fields_of(i))
            assert {k: (v.shape, v.dtype) for k, v in got.items()} == \
                {k: (torch.Size(FIELDS[k]), FIELD_DTYPES[k]) for k in FIELDS}
        view = c.get_slot(3, copy=False)
        assert same(view, fields_of(3))
        ro = np.frombuffer(c._segment.read_only_mapping, np.uint8)  # views of that mapping, not copies
        lo, hi = ro.ctypes.data, ro.ctypes.data + ro.size
        assert all(lo <= v.data_ptr() < hi for v in view.values())
        got = c.get_slot(3)
        got["image"] += 1  # a copy: the cache is not changed
        got["label"] -= 1
        assert same(c.get_slot(3), fields_of(3))
        s = c.stats()
        assert (s["writes"], s["filled"], s["hits"], s["misses"], s["oob_misses"]) == \
            (10, 10, 13, 30, 10)


def test_numbers_fill_scalar_fields_and_lossless_casts_are_accepted(shm_dir):
    with fields_cache(shm_dir) as c:
        x = fields_of(5)
        c.set_slot(5, {"image": x["image"].numpy(), "label": 5007, "box": x["box"].double()})
        assert same(c.get_slot(5), x)
        c.set_slot(6, {"box": x["box"], "label": np.int64(6007), "image": fields_of(6)["image"]})
        assert c.get_slot(6)["label"].item() == 6007  # the keys in any order


@pytest.mark.parametrize("dtypes", [
    {"a": torch.bfloat16, "b": torch.complex128, "c": torch.bool},
    {"a": torch.float16, "b": torch.uint64, "c": torch.int8},
])
def test_every_dtype_round_trips_in_a_field(shm_dir, dtypes):
    dims = {"a": (2, 3), "b": (), "c": (5,)}
    vals = {"a": torch.randn(2, 3).to(dtypes["a"]), "b": torch.tensor(3).to(dtypes["b"]),
            "c": (torch.arange(5) % 2).to(dtypes["c"])}
    with SharedCache(0.001, 4, dims, dtypes, shm_dir=shm_dir) as c:
        c.set_slot(2, vals)
        assert same(c.get_slot(2), vals)
        batch, hit = c.get_batch([2, 1])
        assert hit.tolist() == [True, False]
        assert same({k: v[0] for k, v in batch.items()}, vals)
        assert all(not v[1].any() for v in batch.values())


def test_get_batch_gives_a_batch_per_field(shm_dir):
    with fields_cache(shm_dir) as c:
        for i in range(0, 30, 2):
            c.set_slot(i, fields_of(i))
        idx = np.random.default_rng(0).integers(0, N, 50).tolist()
        batch, hit = c.get_batch(idx)
        assert list(batch) == list(FIELDS)
        for k, i in enumerate(idx):
            single = c.get_slot(i)
            assert bool(hit[k]) == (single is not None)
            want = single if single is not None else {n: torch.zeros_like(v) for n, v in
                                                      fields_of(i).items()}
            assert same({n: b[k] for n, b in batch.items()}, want)
        assert all(b.is_contiguous() for b in batch.values())
        out = {n: torch.full((2, *FIELDS[n]), 9, dtype=FIELD_DTYPES[n]) for n in FIELDS}
        got, hit = c.get_batch([0, 1], out=out)
        assert all(got[n] is out[n] for n in FIELDS) and hit.tolist() == [True, False]
        assert same({n: b[0] for n, b in out.items()}, fields_of(0))
        assert all(not b[1].any() for b in out.values())


@pytest.mark.parametrize("out,exc,match", [
    (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), TypeError, "dict of tensors .*'image', "
     "'label', 'box'.* type Tensor"),
    ({"image": torch.zeros(2, 3, 8, 8, dtype=torch.uint8)}, TypeError, r"keys \['image'\]"),
    ({"image": torch.zeros(2, 3, 8, 8, dtype=torch.uint8), "label": torch.zeros(2),
      "box": torch.zeros(2, 4)}, TypeError, r"out\['label'\] should be a dense tensor of dtype "
     r"torch\.int64"),
    ({"image": torch.zeros(2, 3, 8, 8, dtype=torch.uint8),
      "label": torch.zeros(2, dtype=torch.int64), "box": torch.zeros(3, 4)}, ValueError,
     r"out\['box'\] should be .* shape \(2, 4\)"),
])
def test_a_bad_out_dict_names_the_field(shm_dir, out, exc, match):
    with fields_cache(shm_dir) as c:
        c.set_slot(0, fields_of(0))
        before = snapshot(c)
        with pytest.raises(exc, match=match):
            c.get_batch([0, 1], out=out)
        assert snapshot(c) == before


def _bad_values():
    x = fields_of(1)
    yield (x["image"], x["label"]), TypeError, r"value should be a dict with the fields " \
        r"\['image', 'label', 'box'\].* type tuple"
    yield x["image"], TypeError, r"value should be a dict.* type Tensor"
    yield {"image": x["image"], "label": x["label"]}, ValueError, r"missing \['box'\]"
    yield {**x, "mask": x["image"]}, ValueError, r"unknown \['mask'\]"
    yield {**x, "image": x["image"][0]}, ValueError, \
        r"value\['image'\] should have shape \(3, 8, 8\).*data_dims\['image'\].* " \
        r"value\['image'\]\.shape=\(8, 8\)"
    yield {**x, "box": torch.zeros(5)}, ValueError, r"value\['box'\].*shape \(4,\).*\(5,\)"
    yield {**x, "label": torch.tensor([1, 2])}, ValueError, r"value\['label'\] should have " \
        r"shape \(\)"
    yield {**x, "image": x["image"].float() + 0.5}, ValueError, \
        r"value\['image'\] should have dtype torch\.uint8.* value\['image'\]\[0, 0, 0\]=8\.5"
    yield {**x, "label": 0.5}, ValueError, r"value\['label'\] should have dtype torch\.int64"
    yield {**x, "label": "7"}, TypeError, r"value\['label'\] should be a torch\.Tensor.* str"


@pytest.mark.parametrize("value,exc,match", list(_bad_values()))
@pytest.mark.parametrize("idx", [1, 35], ids=["slot", "no-slot"])
def test_a_value_that_does_not_match_the_fields_is_refused_and_changes_nothing(
        shm_dir, value, exc, match, idx):
    with fields_cache(shm_dir) as c:
        c.set_slot(2, fields_of(2))
        before = snapshot(c)
        with pytest.raises(exc, match=match):
            c.set_slot(idx, value)
        with pytest.raises(exc, match=match):
            c.set_slot(2, value, allow_overwrite=True)
        assert snapshot(c) == before
        assert same(c.get_slot(2), fields_of(2))


@pytest.mark.parametrize("dims,dtype,exc,match", [
    ({}, torch.uint8, ValueError, r"a dict of 1 to 16 fields, but got data_dims=\{\}"),
    ({f"f{k}": () for k in range(17)}, torch.uint8, ValueError, "1 to 16 fields"),
    ({1: (3,)}, torch.uint8, TypeError, r"field names \(str\), but got 1 \(type int\)"),
    ({"a-b": (3,)}, torch.uint8, ValueError, r"field names .* but got 'a-b'"),
    ({"x" * 33: (3,)}, torch.uint8, ValueError, "1 to 32 ASCII letters"),
    ({"a": (3, 0)}, torch.uint8, ValueError, r"data_dims\['a'\] should be a tuple of positive "
     r"ints or None \(\(\) for a scalar\).* data_dims\['a'\]=\(3, 0\)"),
    ({"a": 3}, torch.uint8, TypeError, r"data_dims\['a'\] should be .* data_dims\['a'\]=3"),
    ({"a": (3,), "b": ()}, {"a": torch.uint8}, ValueError, r"dtype should be .* keys of "
     r"data_dims in its order \['a', 'b'\], but got dtype with keys \['a'\] \(missing \['b'\]\)"),
    ({"a": (3,)}, {"a": torch.uint8, "z": torch.uint8}, ValueError, r"unknown \['z'\]"),
    ({"a": (3,), "b": ()}, {"b": torch.uint8, "a": torch.uint8}, ValueError, "in its order"),
    ({"a": (3,)}, {"a": "uint8"}, TypeError, r"dtype\['a'\] should be one of .* "
     r"dtype\['a'\]='uint8'"),
])
def test_bad_fields_at_construction_name_the_field(shm_dir, dims, dtype, exc, match):
    with pytest.raises(exc, match=match):
        SharedCache(0.001, 10, dims, dtype, shm_dir=shm_dir)
    with pytest.raises(exc, match=match):
        plan(10, dims, dtype, size_limit_gib=0.001, shm_dir=shm_dir)
    assert os.listdir(shm_dir) == []


def _pair(shm_dir, lead_kw, other_kw):
    """A leader and a second local rank (in this process) with their own arguments."""
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    key = f"fields{os.getpid()}"
    # (The leader's timeout is also how long its close() waits for a rank that never
    # attached, while a process beside the test runner lives: a refused rank never does.)
    lead = SharedCache(0.001, 10, **lead_kw, name="p", job_key=key, world=worlds[0],
                       shm_dir=shm_dir, timeout=3)
    try:
        return lead, SharedCache(0.001, 10, **other_kw, name="p", job_key=key, world=worlds[1],
                                 shm_dir=shm_dir, timeout=60)
    except BaseException:
        lead.close()
        raise


FD = {"a": (3,), "b": ()}


@pytest.mark.parametrize("other,field", [
    (dict(data_dims={"a": (4,), "b": ()}), "data_dims"),
    (dict(data_dims={"b": (), "a": (3,)}), "data_dims.*in another order"),
    (dict(data_dims={"a": (3,), "c": ()}), "data_dims"),
    (dict(data_dims={"a": (3,)}), "data_dims"),
    (dict(data_dims=(3,)), "data_dims"),
    (dict(data_dims=FD, dtype={"a": torch.uint8, "b": torch.int32}), "dtype"),
])
def test_a_local_rank_with_other_fields_gets_a_config_error(shm_dir, other, field):
    with pytest.raises(CacheConfigError, match=f"has {field.split('.')[0]}=.* asked for {field}") \
            as e:
        _pair(shm_dir, dict(data_dims=FD), other)
    field = field.split(".")[0]
    exp, found = e.value.expected, e.value.found  # in their order: dicts of another order
    assert e.value.field == field and \
        (exp != found or list(exp.items()) != list(found.items()))
    assert os.listdir(shm_dir) == []


def test_a_fields_rank_refuses_a_single_tensor_segment(shm_dir):
    with pytest.raises(CacheConfigError, match=r"has data_dims=\(3,\), but this process asked "
                                               r"for data_dims=\{'a'"):
        _pair(shm_dir, dict(data_dims=(3,)), dict(data_dims=FD))


def test_ranks_that_agree_share_a_fields_cache_and_an_older_layout_is_refused(shm_dir):
    lead, other = _pair(shm_dir, dict(data_dims=FD, dtype={"a": torch.uint8, "b": torch.int64}),
                        dict(data_dims=FD, dtype={"a": torch.uint8, "b": torch.int64}))
    with lead, other:
        lead.set_slot(4, {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": 9})
        assert other.get_slot(4)["b"].item() == 9
        # A segment of another layout version: the attach check names the version.
        head = core.read_header(lead._segment.mapping)
        assert head["version"] == core.LAYOUT_VERSION == 5 and head["nfields"] == 2
        with pytest.raises(CacheConfigError, match="version=3") as e:
            old = dict(head, version=3)
            other._check_header(old, lead._segment.size)
        assert e.value.field == "version"


def test_staging_clear_deepcopy_and_raw_access_work_per_field(shm_dir):
    with fields_cache(shm_dir, slots=10, staging_slots=2) as c:
        c.set_slot(1, fields_of(1))
        assert c.stage(30, fields_of(30))
        with pytest.raises(ValueError, match=r"value\['image'\]"):
            c.stage(31, {**fields_of(31), "image": torch.zeros(2)})
        assert c.stats()["staged"] == 1
        twin = copy.deepcopy(c)
        with twin:
            assert same(twin.get_slot(1), fields_of(1)) and twin.fields == c.fields
            twin.set_slot(1, fields_of(2), allow_overwrite=True)
        assert same(c.get_slot(1), fields_of(1))  # independent
        assert same(c.get_slot(30), fields_of(30)) and c.get_slot(30) is None  # taken once
        assert set(c.array) == set(FIELDS) and c.array["box"].shape == (10, 4)
        assert torch.equal(c[1]["box"], fields_of(1)["box"])
        c[2] = {"image": 5, "label": 6, "box": 7.0}  # torch's assignment rules, per field
        assert c.array["label"][2] == 6 and (c.array["image"][2] == 5).all()
        with pytest.raises(TypeError, match="a dict with the fields"):
            c[2] = 5
        c.set_slot(3, fields_of(3))
        c.clear()
        assert c.get_slot(1) is None and c.get_slot(3) is None
        assert not c._slot_samples[:len(c)].any()  # (the staging rows follow)


def test_several_nodes_cache_disjoint_parts_of_a_fields_dataset(shm_dir):
    held = []
    for node in range(2):
        w = World(rank=node, world_size=2, node_rank=node, num_nodes=2)
        with fields_cache(shm_dir, slots=15, world=w) as c:
            mine = c.cached_indices().tolist()
            held.append(set(mine))
            for i in range(N):
                c.set_slot(i, fields_of(i))  # a no-op where there is no slot
            batch, hit = c.get_batch(range(N))
            assert [i for i in range(N) if hit[i]] == sorted(mine)
            assert all(same(c.get_slot(i), fields_of(i)) for i in mine)
            assert c.stats()["writes"] == 15
    assert not held[0] & held[1] and len(held[0]) == len(held[1]) == 15


def test_the_prefetcher_stages_and_stores_dicts(shm_dir):
    """The Prefetcher stores whatever ``load`` returns with set_slot or stage, so a cache of
    fields works with it as it is (threads here)."""
    with fields_cache(shm_dir, slots=24, staging_slots=8) as c:
        ds = TwoLineDataset(c, N, fields_of)
        sampler = Prefetcher(RandomSampler(ds, generator=torch.Generator().manual_seed(0)), c,
                             fields_of, window=8, mode="adaptive", stand_aside=False)
        try:
            seen = []
            for i, x, hit in DataLoader(ds, batch_size=4, sampler=sampler):
                seen += i.tolist()
                for k, j in enumerate(i.tolist()):
                    assert same({n: v[k] for n, v in x.items()}, fields_of(j))
        finally:
            sampler.close()
        assert sorted(seen) == list(range(N))
        s = c.stats()
        assert s["filled"] == 24 and s["staged_hits"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batched", [False, True], ids=["getitem", "getitems"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_share_a_fields_cache(tmpfs, method, batched):
    n = 48
    with SharedCache(budget(40, n), n, FIELDS, FIELD_DTYPES, shm_dir=tmpfs) as c:
        ds = (BatchedDataset if batched else TwoLineDataset)(c, n, fields_of)
        dl = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2,
                        multiprocessing_context=method, generator=torch.Generator().manual_seed(0))
        for epoch in range(2):
            seen = []
            for idx, x, hit in dl:
                for k, i in enumerate(idx.tolist()):
                    assert same({f: v[k] for f, v in x.items()}, fields_of(i)), (epoch, i)
                seen += [(i, h) for i, h in zip(idx.tolist(), hit.tolist())]
            assert sorted(i for i, _ in seen) == list(range(n))
            assert sum(h for _, h in seen) == (0 if epoch == 0 else 40)
        s = c.stats()
        assert (s["hits"], s["misses"], s["writes"]) == (40, n + 8, 40)
    assert_no_leak(tmpfs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("late", [False, True], ids=["mid-copy", "after-state-set"])
def test_a_writer_of_a_fields_sample_killed_mid_write_leaves_a_miss(tmpfs, children, late):
    """Two local ranks (separate processes, as torchrun starts them) share a cache of two
    fields; rank 1 is killed inside set_slot (halfway through copying the packed bytes, or
    right after the state became SET); rank 0 sees that index as a miss, through get_slot and
    get_batch, and writes it again; nothing leaks."""
    n = 32
    lead = ranks_with_a_killed_writer(children, tmpfs, f"fkill{int(late)}{os.getpid()}", n - 1,
                                      late=late, FT_FIELDS="1")
    assert_the_killed_write_is_a_miss(lead, n, probes=("check", "batch"))
    assert_no_leak(tmpfs)


def test_random_operations_on_a_fields_cache_match_a_model(shm_dir):
    """A seeded random sequence of writes, overwrites, refused writes (bad dicts, a different
    value for a set slot), reads, batch reads and clears, against a dict of what each index
    holds; every read, every refused call and the counters must agree with it."""
    rng = np.random.default_rng(7)
    n, slots = 24, 16
    model: dict[int, dict] = {}
    want = {"hits": 0, "misses": 0, "oob_misses": 0, "writes": 0}
    ops = collections.Counter()

    def read(i):
        if i in model:
            want["hits"] += 1
            return model[i]
        want["misses"] += 1
        want["oob_misses"] += i >= slots
        return None

    with fields_cache(shm_dir, slots=slots, n=n) as c:
        for _ in range(1500):
            op = ["overwrite", "write", "bad", "get", "batch", "batch", "get", "clear"][
                int(rng.integers(0, 8 if rng.random() < 0.05 else 7))]
            i = int(rng.integers(0, n))
            v = fields_of(int(rng.integers(0, 6)))
            ops[op] += 1
            if op == "overwrite":
                c.set_slot(i, v, allow_overwrite=True)
                if i < slots:
                    model[i] = v
                    want["writes"] += 1
            elif op == "write" and i in model and not same(model[i], v):
                before = snapshot(c)
                with pytest.raises(RuntimeError, match="already set to a different value"):
                    c.set_slot(i, v)
                assert snapshot(c) == before
                ops["refused"] += 1
            elif op == "write":
                c.set_slot(i, v)
                if i < slots:
                    model[i] = v
                    want["writes"] += 1
            elif op == "bad":
                bad = dict(v)
                k = list(FIELDS)[int(rng.integers(0, 3))]
                bad[k] = bad[k][..., :1] if bad[k].ndim else torch.zeros(2)
                if rng.random() < 0.3:
                    del bad[k]
                before = snapshot(c)
                with pytest.raises(ValueError, match=rf"value\['{k}'\]|missing \['{k}'\]"):
                    c.set_slot(i, bad, allow_overwrite=True)
                assert snapshot(c) == before
            elif op == "get":
                got, exp = c.get_slot(i), read(i)
                assert (got is None and exp is None) or same(got, exp)
            elif op == "batch":
                idx = rng.integers(0, n, int(rng.integers(0, 9))).tolist()
                batch, hit = c.get_batch(idx)
                for k, j in enumerate(idx):
                    exp = read(j)
                    assert bool(hit[k]) == (exp is not None)
                    exp = exp if exp is not None else {f: torch.zeros_like(t) for f, t in
                                                       fields_of(0).items()}
                    assert same({f: b[k] for f, b in batch.items()}, exp)
            else:
                c.clear()
                model.clear()
            s = c.stats()
            assert {k: s[k] for k in want} == want and s["filled"] == len(model)
    assert min(ops.values()) >= 5, ops  # every kind of step ran (a count, seeded)
