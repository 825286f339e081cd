"""SharedCache in one process: the 0.2.1 API and sizing, every dtype, copies, stats, bad input."""

from __future__ import annotations

import copy
import os
import re
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import stocaching
from _helpers import budget_for, load_ref, named, run_child, value_of
from stocaching import CacheConfigError, SharedCache, World

REF_DIR = os.environ.get("STOCACHING_REF_DIR", os.path.join(os.path.dirname(__file__), "..",
                                                            ".ci", "ref"))
KIB = 1 / 1024**2  # size_limit_gib of one KiB


def _ref():
    """stocaching 0.2.1 from PyPI, installed by .ci/run with pip --target into .ci/ref."""
    init = os.path.join(REF_DIR, "stocaching", "__init__.py")
    if not os.path.exists(init):
        pytest.skip("stocaching 0.2.1 is not installed in .ci/ref (run .ci/run, or "
                    "pip install --no-deps --target .ci/ref stocaching==0.2.1)")
    return load_ref(REF_DIR)


def make(shm_dir, size=64 * KIB, n=100, dims=(3, 4, 4), dtype=torch.uint8, **kw):
    return SharedCache(size, n, dims, dtype, shm_dir=shm_dir, **kw)


def sample(dims, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, dims, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(dims, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(dims, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, dims, generator=g, dtype=torch.int64).to(dtype)


# -- compatibility with 0.2.1 --------------------------------------------------------------------

SIZES = [  # (size_limit_gib, dataset_len, dims, dtype)
    (1, 1000, (3, 32, 32), torch.uint8),           # everything fits
    (0.001, 1000, (3, 32, 32), torch.uint8),       # a float budget, part fits
    (8 * KIB, 5000, (4,), torch.float32),          # the aux array eats most of the budget
    (0.0005, 333, (7, 5), torch.int64),
]


@pytest.mark.parametrize("size,n,dims,dtype", SIZES)
def test_len_and_layout_match_021(shm_dir, size, n, dims, dtype, capsys):
    ref = _ref()
    r = ref.SharedCache(size, n, dims, dtype)
    c = SharedCache(size, n, dims, dtype, shm_dir=shm_dir)
    assert len(c) == len(r)
    assert tuple(c.array.shape) == tuple(r.array.shape)
    assert c.array.dtype == r.array.dtype
    assert torch.equal(c.aux_array, r.aux_array)
    assert c.aux_array.dtype == torch.uint8 and c.aux_array.shape == (n,)


def _call(obj, meth, *args, **kw):
    try:
        out = getattr(obj, meth)(*args, **kw)
    except Exception as e:  # the exception type is the result we compare
        return type(e)
    return None if out is None else out.clone()


def test_same_results_as_021(shm_dir):
    """One script of calls, run on both; identical results and exceptions."""
    ref = _ref()
    n, dims = 50, (2, 3)
    size = budget_for(30, dims, dataset_len=n)
    r, c = ref.SharedCache(size, n, dims), SharedCache(size, n, dims, shm_dir=shm_dir)
    assert len(c) == len(r) == 30
    x = sample(dims, torch.uint8, 1)
    script = [
        ("get_slot", (3,), {}), ("set_slot", (3, x), {}), ("get_slot", (3,), {}),
        ("set_slot", (3, x + 2), {}),  # a different value for a set slot raises in both
        ("set_slot", (3, x + 1), {"allow_overwrite": True}),
        ("get_slot", (3,), {}), ("get_slot", (40,), {}), ("set_slot", (40, x), {}),
        ("get_slot", (40,), {"allow_oob_idx": False}),
        ("set_slot", (40, x), {"allow_oob_idx": False}),
        ("get_slot", (4,), {"allow_empty_slot": False}), ("get_slot", (50,), {}),
        ("get_slot", (-1,), {}), ("set_slot", (50, x), {}), ("get_slot", (np.int64(3),), {}),
        ("get_slot", (torch.tensor(3),), {}), ("clear", (), {}), ("get_slot", (3,), {}),
    ]
    for meth, args, kw in script:
        a, b = _call(r, meth, *args, **kw), _call(c, meth, *args, **kw)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b), (meth, args, kw)
        else:
            assert a == b, (meth, args, kw, a, b)
        assert torch.equal(r.aux_array, c.aux_array), (meth, args, kw)
    assert torch.equal(r.array, c.array)  # clear() zeroes, as in 0.2.1


@pytest.mark.parametrize("kind", ["one tensor", "fields", "open sizes", "staging slots"])
def test_every_attribute_of_a_cache_is_declared_in_its_class(kind, shm_dir):
    """A cache's state is declared at the top of its class, grouped by role (what it is, the
    mapped segment, this process's own): every attribute an instance holds once used is
    among the annotations or class attributes of a class of its MRO, so that a reader finds
    all of it there; the same for the collaborators it holds."""
    from stocaching import OpenSizeCache
    make = {"one tensor": lambda: SharedCache(1e-3, 10, (3, 4), shm_dir=shm_dir),
            "fields": lambda: SharedCache(1e-3, 10, {"x": (3, 4), "y": ()}, shm_dir=shm_dir),
            "open sizes": lambda: OpenSizeCache(1e-3, 10, (None, 4), shm_dir=shm_dir),
            "staging slots": lambda: SharedCache(500 / 2**30, 10, (3, 40), staging_slots=1,
                                                 shm_dir=shm_dir)}[kind]
    sample = {"one tensor": torch.ones(3, 4, dtype=torch.uint8),
              "fields": {"x": torch.ones(3, 4, dtype=torch.uint8), "y": torch.tensor(1)},
              "open sizes": torch.ones(2, 4, dtype=torch.uint8),
              "staging slots": torch.ones(3, 40, dtype=torch.uint8)}[kind]
    def undeclared(obj) -> list:
        declared = {name for cls in type(obj).__mro__
                    for name in (*getattr(cls, "__annotations__", {}), *vars(cls))}
        return sorted(set(vars(obj)) - declared)

    with make() as c:
        c.set_slot(1, sample)
        assert c.get_slot(1) is not None
        assert undeclared(c) == []
        # and so is the state of the collaborators it holds (the segment, the staging table:
        # a cache has one where it has staging slots)
        assert (c._staging is not None) == (kind == "staging slots")
        assert undeclared(c._segment) == [] and (c._staging is None or
                                                 undeclared(c._staging) == [])


def test_budget_below_the_aux_array_gives_no_slots_and_a_warning(shm_dir):
    """0.2.1 crashes here (negative array length); we make an empty cache and say why."""
    with pytest.warns(RuntimeWarning, match="no slots"):
        c = SharedCache(2 * KIB, 5000, (4,), torch.float32, shm_dir=shm_dir)
    assert len(c) == 0 and c.get_slot(0) is None and c.aux_array.eq(2).all()
    c.set_slot(0, torch.zeros(4))  # a no-op, as for any index without a slot


def test_get_shm_size_matches_df():
    st = os.statvfs("/dev/shm")
    assert stocaching.get_shm_size() == int(st.f_blocks * st.f_frsize / 1024**3)


# -- values ------------------------------------------------------------------------------------

ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint16,
              torch.uint32, torch.uint64, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips(shm_dir, dtype):
    c = make(shm_dir, size=1, n=20, dims=(2, 5), dtype=dtype)
    values = {i: sample((2, 5), dtype, i) for i in range(0, 20, 3)}
    for i, v in values.items():
        c.set_slot(i, v)
    for i in range(20):
        got = c.get_slot(i)
        if i in values:
            assert got.dtype == dtype and torch.equal(got, values[i])
            assert torch.equal(c.get_slot(i, copy=False), values[i])
        else:
            assert got is None
    assert c.array.dtype == dtype
    assert c.stats()["filled"] == len(values)


def test_returned_tensor_is_a_copy(shm_dir):
    c = make(shm_dir)
    x = sample((3, 4, 4), torch.uint8, 0)
    c.set_slot(7, x)
    y = c.get_slot(7)
    y.add_(1)          # an in-place augmentation on the returned tensor
    y.zero_()
    assert torch.equal(c.get_slot(7), x)
    x.fill_(9)         # and the stored value does not alias the caller's tensor
    assert not torch.equal(c.get_slot(7), x)


@pytest.mark.timeout(300)
def test_writing_a_read_only_view_raises_and_changes_nothing(shm_dir):
    """copy=False returns a ReadOnlyView of a read-only mapping: every way of writing into it
    that tests/children/write_a_view.py tries (in-place methods, of views of it too, item
    assignment, +=, out=, its numpy array) raises, for each kind of cache, and the cache keeps
    its sample. In a child process, as it used to end with SIGSEGV."""
    r = run_child("write_a_view.py", shm_dir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "done" and len(lines) == 1 + 3 * 14, r.stdout
    assert [ln for ln in lines[:-1] if not ln.endswith(" raised")] == []


@pytest.mark.parametrize("src,dst", [(torch.uint8, torch.float32), (torch.bool, torch.uint8),
                                     (torch.float16, torch.float32), (torch.int8, torch.int16)])
def test_lossless_casts_are_accepted(shm_dir, src, dst):
    c = make(shm_dir, dtype=dst)
    x = sample((3, 4, 4), src, 3)
    c.set_slot(0, x)
    assert torch.equal(c.get_slot(0), x.to(dst))


def test_narrowing_casts_that_0_2_1_code_relies_on_are_accepted(shm_dir):
    """0.2.1 assigned with torch's casting rules, so its users may rely on a float32 cache
    rounding float64 numpy arrays, or on int64 masks of small values going into a uint8
    cache."""
    c = make(shm_dir, dtype=torch.float32)
    x = np.random.default_rng(0).standard_normal((3, 4, 4))  # float64, numpy's default
    c.set_slot(0, x)
    assert torch.equal(c.get_slot(0), torch.from_numpy(x).float())
    c = make(shm_dir, dtype=torch.uint8, name="masks")
    m = torch.randint(0, 256, (3, 4, 4), dtype=torch.int64)
    c.set_slot(0, m)
    assert torch.equal(c.get_slot(0).long(), m)
    c.set_slot(1, m.float())  # integral floats 0..255 are exact in uint8 too
    assert torch.equal(c.get_slot(1).long(), m)


@pytest.mark.parametrize("dst,value", [
    (torch.float16, torch.randn(3, 4, 4, dtype=torch.float64)),
    (torch.complex64, torch.randn(3, 4, 4, dtype=torch.float64)),
    (torch.float32, torch.complex(torch.randn(3, 4, 4, dtype=torch.float64),
                                  torch.zeros(3, 4, 4, dtype=torch.float64))),
    (torch.float32, torch.full((3, 4, 4), float("nan"), dtype=torch.float64)),
    (torch.bfloat16, torch.full((3, 4, 4), 1e6)),
])
def test_floats_round_into_narrower_floats(shm_dir, dst, value):
    """Float and complex into float or complex: rounded as torch rounds (NaN stays NaN)."""
    c = make(shm_dir, dtype=dst)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "discards the imaginary part" warning either
        c.set_slot(0, value)
    want = (value.real if value.is_complex() and not dst.is_complex else value).to(dst)
    assert torch.equal(c.get_slot(0).isnan(), want.isnan())
    assert torch.equal(c.get_slot(0).nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dst,value,match", [
    (torch.float32, lambda: torch.zeros(3, 4, 4, dtype=torch.complex32),
     r"value.dtype=torch.complex32"),
    (torch.uint8, lambda: torch.zeros(3, 4, 4, dtype=torch.uint8).to_sparse(),
     r"layout=torch.sparse_coo"),
    (torch.uint8, lambda: torch.zeros(3, 4, 4, dtype=torch.uint8, device="meta"),
     r"device=meta"),
    (torch.bfloat16, lambda: np.full((3, 4, 4), 0x3F80, dtype=np.uint16),
     r"numpy uint16 array"),
])
def test_values_the_cache_cannot_take_are_type_errors(shm_dir, dst, value, match):
    c = make(shm_dir, size=budget_for(50, (3, 4, 4), dst, dataset_len=100), dtype=dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        value = value()
    assert c.aux_array[99] == 2  # OOB
    for idx in (0, 99):  # with a slot, and without one
        with pytest.raises(TypeError, match=match):
            c.set_slot(idx, value)
    assert c.get_slot(0) is None and c.stats()["writes"] == 0


@pytest.mark.parametrize("dst,value,bad", [
    (torch.uint8, torch.full((3, 4, 4), 0.5), "0.5 truncates"),
    (torch.uint8, torch.full((3, 4, 4), 300, dtype=torch.int64), "300 wraps"),
    (torch.uint8, torch.full((3, 4, 4), -1, dtype=torch.int16), "-1 wraps"),
    # found by the fuzz test: these wrap and wrap back, so a cast back cannot see them
    (torch.uint8, torch.full((3, 4, 4), -84, dtype=torch.int8), "-84 wraps to 172"),
    (torch.int8, torch.full((3, 4, 4), 200, dtype=torch.uint8), "200 wraps to -56"),
    (torch.uint16, torch.full((3, 4, 4), -1, dtype=torch.int8), "-1 wraps to 65535"),
    (torch.int16, torch.full((3, 4, 4), 2**20, dtype=torch.int32), "2**20 wraps"),
    (torch.float32, torch.full((3, 4, 4), 2**24 + 1, dtype=torch.int64), "2**24+1 rounds"),
    (torch.int32, torch.full((3, 4, 4), float("nan")), "nan has no int"),
    (torch.bool, torch.full((3, 4, 4), 2, dtype=torch.uint8), "2 is not a bool"),
    (torch.float32, torch.full((3, 4, 4), 1 + 1j, dtype=torch.complex64), "imaginary part lost"),
    (torch.int16, torch.full((3, 4, 4), 1 + 1j, dtype=torch.complex64), "imaginary part lost"),
])
def test_casts_that_change_a_value_are_refused(shm_dir, dst, value, bad):
    c = make(shm_dir, dtype=dst)
    value[1, 2, 3] = 0  # one element that would survive does not make the rest acceptable
    with pytest.raises(ValueError, match=rf"value should have dtype {dst}, or values that it "
                                         rf"holds exactly, but got value.dtype={value.dtype}"):
        c.set_slot(0, value)
    assert c.get_slot(0) is None and c.stats()["writes"] == 0, bad


def test_a_refused_cast_names_the_first_value_that_would_change(shm_dir):
    c = make(shm_dir, dtype=torch.uint8)
    x = torch.zeros(3, 4, 4, dtype=torch.int64)
    x[1, 2, 3], x[2, 0, 0] = 300, -5
    with pytest.raises(ValueError, match=r"e\.g\. value\[1, 2, 3\]=300$"):
        c.set_slot(0, x)
    with pytest.raises(ValueError, match=r"e\.g\. value\[0, 1, 2\]=0\.5$"):
        c.set_slot(0, torch.zeros(3, 4, 4).index_put_((torch.tensor(0), torch.tensor(1),
                                                        torch.tensor(2)), torch.tensor(0.5)))


def test_numpy_values_are_accepted(shm_dir):
    c = make(shm_dir)
    x = np.arange(48, dtype=np.uint8).reshape(3, 4, 4)
    c.set_slot(1, x)
    assert c.get_slot(1).numpy().tolist() == x.tolist()


@pytest.mark.parametrize("idx", [5, np.int64(5), np.uint8(5), np.int32(5), torch.tensor(5),
                                 torch.tensor(5, dtype=torch.int16)], ids=repr)
def test_integer_scalars_are_indices(shm_dir, idx):
    c = make(shm_dir)
    x = sample((3, 4, 4), torch.uint8, 5)
    c.set_slot(idx, x)
    assert torch.equal(c.get_slot(idx), x)
    assert torch.equal(c.get_slot(5), x)


def test_raw_item_access_is_021_compatible(shm_dir):
    c = make(shm_dir)
    x = sample((3, 4, 4), torch.uint8, 8)
    c[2] = x                          # writes slot 2, leaves its state alone (as 0.2.1)
    assert torch.equal(c[2], x) and c.aux_array[2] == 0
    assert c.get_slot(2) is None
    c[3:5] = x                        # slices work as on a tensor
    assert torch.equal(c.array[4], x)
    assert len(c) == c.array.shape[0]


# -- stats and clear ---------------------------------------------------------------------------

def test_stats_count_hits_misses_writes(shm_dir):
    c = make(shm_dir, size=budget_for(10, (3, 4, 4), dataset_len=100))
    assert len(c) == 10
    x = sample((3, 4, 4), torch.uint8, 0)
    for i in range(5):
        assert c.get_slot(i) is None
        c.set_slot(i, x)
        assert c.get_slot(i) is not None
    c.get_slot(50)                     # out of bounds
    c.set_slot(50, x)                  # a no-op: not a write
    s = c.stats()
    assert (s["hits"], s["misses"], s["oob_misses"], s["writes"], s["filled"]) == (5, 6, 1, 5, 5)
    assert (s["slots"], s["dataset_len"]) == (10, 100)
    assert s["hit_rate"] == pytest.approx(5 / 11)
    assert s["bytes"] >= 10 * 48 + 100
    c.clear()
    s = c.stats()
    assert s["filled"] == 0 and s["hits"] == 5
    assert c.get_slot(1) is None


def test_no_reads_means_nan_hit_rate(shm_dir):
    assert np.isnan(make(shm_dir).stats()["hit_rate"])


# -- several caches, names ---------------------------------------------------------------------

def test_two_caches_in_one_job_do_not_collide(shm_dir):
    a = make(shm_dir, name="train")
    b = make(shm_dir, name="val")
    a.set_slot(0, torch.zeros(3, 4, 4, dtype=torch.uint8))
    assert b.get_slot(0) is None
    d1, d2 = make(shm_dir), make(shm_dir)  # default names differ too
    assert d1.name != d2.name


def test_close_is_idempotent_and_closed_cache_says_so(shm_dir):
    c = make(shm_dir)
    c.set_slot(0, torch.zeros(3, 4, 4, dtype=torch.uint8))
    with c:
        pass
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.get_slot(0)
    with pytest.raises(ValueError, match="closed"):
        c.set_slot(1, torch.zeros(3, 4, 4, dtype=torch.uint8))


def test_ram_warning(shm_dir, monkeypatch):
    monkeypatch.setattr(stocaching.stocaching, "RAM_MARGIN_FRACTION", 1.0)  # keep all RAM free
    with pytest.warns(RuntimeWarning, match="RAM is available"):
        make(shm_dir)


def test_a_cache_outside_memory_warns(shm_dir, tmp_path):
    """0.2.1 fell back to a disk directory silently; a shm_dir on a disk filesystem works but
    says so. (Needs tmp_path on a disk filesystem, as on this machine's ext4 /tmp.)"""
    fstype = stocaching.stocaching.fs_type(str(tmp_path))
    if fstype is None or fstype in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {fstype or 'an unknown filesystem'} here; no disk "
                    "directory to try")
    with pytest.warns(RuntimeWarning, match=re.escape(f"shm_dir='{tmp_path}' is on a {fstype} "
                                                      "filesystem, not in memory")):
        make(str(tmp_path)).close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make(shm_dir).close()  # /dev/shm: no such warning
    assert not [w for w in seen if "not in memory" in str(w.message)]


def test_allocation_summary_is_logged_once_by_the_leader(shm_dir, caplog):
    with caplog.at_level("INFO", logger="stocaching"):
        make(shm_dir, size=budget_for(10, (3, 4, 4), dataset_len=100), name="logged")
    msgs = [r.getMessage() for r in caplog.records if "holds" in r.getMessage()]
    assert len(msgs) == 1 and "10 of 100 samples (10.0%)" in msgs[0]


def test_nothing_is_printed(shm_dir, capfd):
    c = make(shm_dir)
    c.set_slot(0, torch.zeros(3, 4, 4, dtype=torch.uint8))
    c.get_slot(0), c.stats(), c.clear()
    assert capfd.readouterr() == ("", "")


# -- bad input ---------------------------------------------------------------------------------

BAD_CTOR = [
    (dict(size_limit_gib=0), ValueError, r"size_limit_gib should be a positive finite .*=0"),
    (dict(size_limit_gib=-1.5), ValueError, r"size_limit_gib=-1.5"),
    (dict(size_limit_gib=float("nan")), ValueError, r"size_limit_gib=nan"),
    (dict(size_limit_gib=float("inf")), ValueError, r"size_limit_gib=inf"),
    (dict(size_limit_gib="1"), TypeError, r"size_limit_gib='1'"),
    (dict(size_limit_gib=True), TypeError, r"size_limit_gib=True"),
    (dict(dataset_len=0), ValueError, r"dataset_len should be a positive int, but got dataset_len=0"),
    (dict(dataset_len=-3), ValueError, r"dataset_len=-3"),
    (dict(dataset_len=True), TypeError, r"dataset_len=True"),
    (dict(dataset_len=10.0), TypeError, r"dataset_len=10.0"),
    (dict(data_dims=()), ValueError, r"data_dims should be a non-empty tuple .* data_dims=\(\)"),
    (dict(data_dims=(3, 0, 32)), ValueError, r"data_dims=\(3, 0, 32\)"),
    (dict(data_dims=(3, -1)), ValueError, r"data_dims=\(3, -1\)"),
    (dict(data_dims=(3, 2.0)), TypeError, r"data_dims=\(3, 2.0\)"),
    (dict(data_dims=(3, True)), TypeError, r"data_dims=\(3, True\)"),
    (dict(data_dims=32), TypeError, r"data_dims=32"),
    (dict(dtype=torch.float8_e4m3fn), ValueError, r"dtype should be one of .* dtype=torch.float8"),
    (dict(dtype=np.uint8), TypeError, r"dtype should be one of"),
    (dict(dtype=[torch.uint8]), TypeError, r"dtype should be one of .* dtype=\[torch.uint8\]"),
    (dict(dtype={"a": torch.uint8}), TypeError,
     r"a dict of dtypes, one a field, comes with a dict data_dims .* dtype=\{'a': torch.uint8\}"),
    (dict(name="a/b"), ValueError, r"name should be .* name='a/b'"),
    (dict(job_key=""), ValueError, r"job_key should be"),
    (dict(timeout=0), ValueError, r"timeout should be a positive .* timeout=0"),
    (dict(layout_seed=-1), ValueError, r"layout_seed"),
    (dict(random_subset=1), TypeError, r"random_subset should be a bool, but got random_subset=1"),
    (dict(shm_dir="/nonexistent/dir"), ValueError, r"shm_dir should be an existing directory"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_CTOR, ids=lambda v: repr(v)[:40])
def test_bad_constructor_arguments(shm_dir, kw, exc, match):
    args = dict(size_limit_gib=KIB, dataset_len=10, data_dims=(3, 4), shm_dir=shm_dir)
    args.update(kw)
    with pytest.raises(exc, match=match):
        SharedCache(**args)
    assert named(shm_dir) == []


def _snapshot(c):
    s = c.stats()
    return c.array.clone(), c.aux_array.clone(), {k: v for k, v in s.items() if k != "hit_rate"}


BAD_CALLS = [
    ("get_slot", (1.0,), {}, TypeError, r"idx should be an int .* idx=1.0"),
    ("get_slot", (True,), {}, TypeError, r"idx=True"),
    ("get_slot", (100,), {}, IndexError, r"idx should be a dataset index in \[0, 99\], but got idx=100"),
    ("get_slot", (-1,), {}, IndexError, r"idx=-1"),
    ("get_slot", ("3",), {}, TypeError, r"idx='3'"),
    ("get_slot", (torch.tensor([1, 2]),), {}, TypeError, r"idx=tensor"),
    ("get_slot", (60,), {"allow_oob_idx": False}, IndexError, r"idx=60 has no slot"),
    ("get_slot", (4,), {"allow_empty_slot": False}, RuntimeError, r"slot of idx=4 is empty"),
    ("set_slot", (1.5, "x"), {}, TypeError, r"idx=1.5"),
    ("set_slot", (100, "x"), {}, IndexError, r"idx=100"),
    ("set_slot", (60, "x"), {"allow_oob_idx": False}, IndexError, r"idx=60 has no slot"),
    ("set_slot", (4, torch.zeros(3, 4)), {}, ValueError, r"shape \(3, 4, 4\) .* value.shape=\(3, 4\)"),
    ("set_slot", (4, torch.full((3, 4, 4), 0.5)), {}, ValueError, r"dtype torch.uint8.* value.dtype=torch.float32"),
    ("set_slot", (4, [[1]]), {}, TypeError, r"value of type list"),
    ("set_slot", (3, "x"), {}, RuntimeError, r"slot of idx=3 is already set"),
    # an index without a slot checks the value too (0.2.1 let a bad one pass there)
    ("set_slot", (60, torch.zeros(3, 4)), {}, ValueError, r"value.shape=\(3, 4\)"),
    ("set_slot", (60, torch.full((3, 4, 4), 0.5)), {}, ValueError, r"value.dtype=torch.float32"),
]


@pytest.mark.parametrize("meth,args,kw,exc,match", BAD_CALLS, ids=lambda v: repr(v)[:30])
def test_bad_calls_raise_and_change_nothing(shm_dir, meth, args, kw, exc, match):
    c = make(shm_dir, size=budget_for(50, (3, 4, 4), dataset_len=100))
    x = sample((3, 4, 4), torch.uint8, 0)
    c.set_slot(3, x)
    c.get_slot(3)
    if args[-1] == "x":
        args = (*args[:-1], x + 1)
    before = _snapshot(c)
    with pytest.raises(exc, match=match):
        getattr(c, meth)(*args, **kw)
    after = _snapshot(c)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2] == after[2]


def test_other_device_is_copied(shm_dir):
    """A value on another device is copied to the CPU. This machine has no GPU, so the test uses
    torch's 'meta' device only to show that the check does not reject non-CPU tensors by device;
    the copy itself needs a real device and is skipped where none exists."""
    if not torch.cuda.is_available():
        pytest.skip("no second device (GPU) on this machine to copy from")
    c = make(shm_dir)
    x = sample((3, 4, 4), torch.uint8, 1)
    c.set_slot(0, x.cuda())
    assert torch.equal(c.get_slot(0), x)


def test_every_call_on_a_closed_cache_says_it_is_closed(shm_dir):
    c = make(shm_dir)
    c.close()
    x = torch.zeros(3, 4, 4, dtype=torch.uint8)
    for call in (lambda: c.array, lambda: c.aux_array, lambda: c[0], lambda: c.stats(),
                 lambda: c.clear(), lambda: c.get_slot(0), lambda: c.set_slot(0, x)):
        with pytest.raises(ValueError, match="^this SharedCache is closed"):
            call()
    with pytest.raises(ValueError, match="^this SharedCache is closed"):
        c.__setitem__(0, x)


class MyCache(stocaching.OpenSizeCache):
    pass


@pytest.mark.parametrize("kind, dims, dtype, value, name", [
    (SharedCache, {"image": (3, 4, 4), "label": ()}, {"image": torch.uint8, "label": torch.int64},
     {"image": torch.zeros(3, 4, 4, dtype=torch.uint8), "label": 1}, "SharedCache"),
    (stocaching.OpenSizeCache, (3, None, None), torch.uint8,
     torch.zeros(3, 4, 5, dtype=torch.uint8), "OpenSizeCache"),
    (MyCache, (3, None, None), torch.uint8, torch.zeros(3, 4, 5, dtype=torch.uint8),
     "MyCache"),  # a user's subclass, by its own name
], ids=["fields", "open sizes", "subclass"])
def test_a_closed_cache_names_its_own_kind(shm_dir, kind, dims, dtype, value, name):
    """The message names the class the user made (a cache with fields is a SharedCache to
    them), both where a call checks first and where a read finds the views gone."""
    c = kind(64 * KIB, 100, dims, dtype, shm_dir=shm_dir)
    c.set_slot(0, value)
    c.close()
    for call in (lambda: c.aux_array, lambda: c.stats(), lambda: c.clear(),
                 lambda: c.get_slot(0), lambda: c.set_slot(1, value)):
        with pytest.raises(ValueError, match=f"^this {name} is closed"):
            call()
    with pytest.raises(ValueError, match=f"^a closed {name} cannot be sent"):
        ForkingPickler.dumps(c)  # what a Queue, a Pool task or a process start does


# -- found in review ---------------------------------------------------------------------------

def test_raw_item_write_follows_torch_rules_as_in_021(shm_dir):
    """cache[s] = v broadcasts and casts like a tensor assignment, as 0.2.1's did."""
    ref = _ref()
    r = ref.SharedCache(1, 4, (2, 3))
    c = SharedCache(1, 4, (2, 3), shm_dir=shm_dir)
    for key, value in [(0, 7), (1, torch.arange(3)), (2, torch.full((2, 3), 2.7)),
                       (-1, np.int64(5)), (slice(0, 2), 9)]:
        r[key] = value
        c[key] = value
        assert torch.equal(r.array, c.array), key
    assert c.aux_array.eq(0).all()
    with pytest.raises(IndexError, match=r"slot should be an int in \[-4, 3\], but got slot=4"):
        c[4] = 1


@pytest.mark.parametrize("make_value", [
    lambda: np.arange(48, dtype=np.uint8).reshape(3, 4, 4)[:, :, ::-1],   # cv2's BGR->RGB flip
    lambda: np.arange(48, dtype=">u2").reshape(3, 4, 4).astype(">u2"),    # big-endian
], ids=["negative-strides", "big-endian"])
def test_numpy_arrays_torch_cannot_wrap_are_copied(shm_dir, make_value):
    value = make_value()
    c = make(shm_dir, dtype=torch.int32)
    c.set_slot(2, value)
    assert c.get_slot(2).tolist() == value.astype(np.int32).tolist()


def test_exist_ok_keeps_the_stored_value(shm_dir):
    c = make(shm_dir)
    x = sample((3, 4, 4), torch.uint8, 0)
    c.set_slot(5, x)
    c.set_slot(5, x + 1, exist_ok=True)  # a second loader of the same index: no error
    assert torch.equal(c.get_slot(5), x) and c.stats()["writes"] == 1
    with pytest.raises(RuntimeError, match="exist_ok=True to keep it"):
        c.set_slot(5, x + 1)


def test_plan_without_a_budget_fits_the_filesystem(tmpfs):
    for dims, n in [((3, 256, 256), 5000), ((3, 64, 64), 100_000), ((7,), 100)]:
        r = stocaching.plan(n, dims, shm_dir=tmpfs)
        c = SharedCache(r["size_limit_gib"], n, dims, shm_dir=tmpfs)
        assert len(c) == r["slots"] > 0
        c.close()


@pytest.mark.timeout(120)
def test_stats_count_live_processes_only(shm_dir):
    import multiprocessing as mp
    c = make(shm_dir)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=c.get_slot, args=(1,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()  # however long a loaded machine takes; the timeout mark catches a hang
    s = c.stats()
    assert s["processes"] == 1 and s["misses"] == 3  # the children counted, then died


def test_wide_unsigned_values_are_checked_against_the_range(shm_dir):
    """uint64 values past int64's range, from numpy (torch cannot build them from an int)."""
    c = make(shm_dir, dtype=torch.int64)
    x = np.zeros((3, 4, 4), dtype=np.uint64)
    c.set_slot(0, x + 5)
    x[2, 3, 3] = 2**63
    with pytest.raises(ValueError, match=r"e\.g\. value\[2, 3, 3\]=9223372036854775808$"):
        c.set_slot(1, x)
    assert c.get_slot(1) is None and torch.equal(c.get_slot(0), torch.full((3, 4, 4), 5))


# -- which indices one node caches ---------------------------------------------------------------

def test_random_subset_caches_a_seeded_spread_of_the_indices_on_one_node(shm_dir):
    """0.2.1's layout caches the first indices, so on a dataset ordered by class the cached
    samples are the first classes; random_subset spreads them over the whole dataset."""
    n, dims = 1000, (3, 8, 8)
    plain = SharedCache(1e-4, n, dims, shm_dir=shm_dir)
    c = SharedCache(1e-4, n, dims, shm_dir=shm_dir, random_subset=True, layout_seed=3)
    other_seed = SharedCache(1e-4, n, dims, shm_dir=shm_dir, random_subset=True, layout_seed=4)
    assert len(c) == len(plain) < n  # the slot map is paid on top of the budget
    held = np.flatnonzero(c.aux_array.numpy() == stocaching.SlotState.EMPTY.value)
    assert sorted(stocaching.CacheLayout(n, len(c), 1, 3, True).indices(0).tolist()) == held.tolist()
    assert held.tolist() != list(range(len(c)))
    assert set(held) != set(np.flatnonzero(other_seed.aux_array.numpy() == stocaching.SlotState.EMPTY.value))
    share = len(c) / n
    for tenth in np.array_split(np.arange(n), 10):  # (seeded: the same counts every run)
        assert abs(np.isin(tenth, held).mean() - share) < 0.15
    for i in held.tolist():
        c.set_slot(i, value_of(i, dims))
    missing = [i for i in range(n) if i not in set(held.tolist())][:5]
    for i in missing:
        c.set_slot(i, value_of(i, dims))  # no slot: ignored, as for any index without one
        assert c.get_slot(i) is None
    assert all(torch.equal(c.get_slot(i), value_of(i, dims)) for i in held.tolist())
    batch, hit = c.get_batch(held[:4].tolist() + missing[:2])
    assert hit.tolist() == [True] * 4 + [False] * 2
    assert torch.equal(batch[3], value_of(int(held[3]), dims))
    twin = copy.deepcopy(c)
    assert torch.equal(twin.aux_array, c.aux_array)
    assert torch.equal(twin.get_slot(int(held[0])), value_of(int(held[0]), dims))
    for cache in (plain, c, other_seed, twin):
        cache.close()


def test_local_ranks_must_agree_on_random_subset(shm_dir):
    worlds = [World(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    args = dict(size_limit_gib=1e-4, dataset_len=1000, data_dims=(3, 8, 8), name="r",
                job_key=f"subset{os.getpid()}", shm_dir=shm_dir, timeout=60)
    # (The leader's timeout is also how long its close() waits for the refused rank, while a
    # process beside the test runner lives.)
    with SharedCache(**{**args, "timeout": 3}, world=worlds[0], random_subset=True):
        with pytest.raises(CacheConfigError, match="random_subset") as e:
            SharedCache(**args, world=worlds[1])
        assert (e.value.field, e.value.expected, e.value.found) == ("random_subset", 0, 1)
