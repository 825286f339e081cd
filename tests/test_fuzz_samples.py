"""Model-based fuzzing of the caches of issue 11: several fields a sample, open sizes (``None``
in the dims, the arena) and both at once; random sequences of construct / set_slot / get_slot /
get_batch / clear against a plain in-memory model. Two more rules write caches of open sizes
hard: ``fill`` writes index after index until the arena refuses a sample, and ``overwrite``
replaces held samples and writes the indices that overwrites emptied, which the others
seldom reach (samples are small and clears many).

The model is written from docs/how-it-works.md ("Open sizes: the arena"), not from the code:

- a sample's fields are packed in the declared order, each at a multiple of its itemsize; with
  open sizes a sample takes that many bytes rounded up to 16 from the arena, handed out from
  the bottom; ``stats()["arena_used"]`` is the top;
- a write that does not fit in what is left stores nothing, counts in ``full``, and leaves the
  index a miss; an overwrite that fits in the bytes the index reserved is written in place, a
  larger one takes new room at the top (the old place is lost until ``clear()``), and without
  room the index becomes a miss that keeps no place (its next write needs new room, whatever
  its size); a sample larger than the whole arena raises ``ValueError``;
- without ``allow_overwrite``, writing an index that holds another sample raises
  ``RuntimeError`` (the same sample again is a no-op), and with ``exist_ok`` changes nothing;
- ``clear()`` empties every index and gives the whole arena back;
- ``get_batch`` stacks fixed-size fields only: a cache with an open field (an
  ``OpenSizeCache``) has no ``get_batch``.

Values are generated in the cache's own dtypes (casting is test_fuzz.py's subject). Bad
values (a missing or extra key, a dict for a one-tensor cache and the reverse, a leading dim
of size 2 too many, a wrong fixed size) must raise and change nothing: every index's sample and the
counters are compared before and after. After every step the cache and the model must agree
on every index's sample and on ``filled``, ``full`` and ``arena_used``.
"""

from __future__ import annotations

import collections
import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from _helpers import assert_no_leak, outcome, same
from stocaching import BYTES_PER_GIB, OpenSizeCache, SharedCache, World

CALLS: collections.Counter = collections.Counter()
# "open fields" twice: it covers fixed and open fields at once, and most of the arena's rules
KINDS = ["fields", "open", "open fields", "open fields"]
SHM: list[str] = []  # the tmpfs of the running test
DTYPES = [torch.uint8, torch.int16, torch.int64, torch.float32, torch.float64]


class Model:
    """What the docs say the cache holds: one sample (or None) per index, the bytes each
    index reserved in the arena, the arena's top, and the counters compared."""

    def __init__(self, n: int, fields: dict, dtypes: dict, single: bool, arena: int) -> None:
        self.n, self.fields, self.dtypes, self.single = n, fields, dtypes, single
        self.open = any(None in dims for dims in fields.values())
        self.arena = arena  # bytes; 0 for a cache of fixed slots
        self.samples: list = [None] * n
        self.reserved = [0] * n
        self.top = self.full = 0
        self.emptied: set[int] = set()  # emptied by an overwrite without room (for counts)

    def packed(self, value: dict) -> int:
        at = 0
        for name, dt in self.dtypes.items():
            at = -(-at // dt.itemsize) * dt.itemsize + value[name].numel() * dt.itemsize
        return at

    def set_slot(self, i: int, value: dict, how: str) -> None:
        # The value is checked before "already set" (as test_fuzz.py's model has it): a
        # sample larger than the whole arena is a bad value whatever the index holds.
        need = -(-self.packed(value) // 16) * 16
        if self.open and need > self.arena:
            raise ValueError("larger than the whole arena")
        if self.samples[i] is not None and how != "allow_overwrite":
            if how == "exist_ok" or same(self.samples[i], value):
                return
            raise RuntimeError("already set to a different value")
        if self.open:
            if need > self.reserved[i]:
                if need > self.arena - self.top:
                    # stores nothing; an overwritten index is emptied and gives up its
                    # place (lost until clear()): its next write needs room at the top
                    self.full += 1
                    if self.samples[i] is not None:
                        self.emptied.add(i)
                    self.samples[i] = None
                    self.reserved[i] = 0
                    return
                self.top += need
                self.reserved[i] = need
        self.samples[i] = {k: v.clone() for k, v in value.items()}
        self.emptied.discard(i)

    def get_slot(self, i: int):
        s = self.samples[i]
        if s is None or not self.single:
            return s
        return next(iter(s.values()))

    def get_batch(self, idx: list):
        if self.open:
            raise AttributeError("an open field does not stack: no get_batch")
        hit = torch.tensor([self.samples[i] is not None for i in idx], dtype=torch.bool)
        batch = {}
        for name, dims in self.fields.items():
            b = torch.zeros((len(idx), *dims), dtype=self.dtypes[name])
            for k, i in enumerate(idx):
                if self.samples[i] is not None:
                    b[k] = self.samples[i][name]
            batch[name] = b
        return (batch[next(iter(batch))] if self.single else batch), hit

    def clear(self) -> None:
        self.samples = [None] * self.n
        self.reserved = [0] * self.n
        self.top = 0
        self.emptied.clear()


def sample_for(data, fields: dict, dtypes: dict, label: str) -> dict:
    """A valid sample: open sizes drawn in 1..5, values small enough for every dtype."""
    out = {}
    for name, dims in fields.items():
        shape = tuple(data.draw(st.integers(1, 5), f"{label} {name} size") if d is None else d
                      for d in dims)
        seed = data.draw(st.integers(0, 2**16), f"{label} {name} seed")
        g = torch.Generator().manual_seed(seed)
        out[name] = torch.randint(0, 100, shape, generator=g).to(dtypes[name])
    return out


def spoil(data, value: dict, fields: dict, single: bool):
    """A bad version of ``value``, as the caller would pass it (a tensor for a one-tensor
    cache, else a dict): an extra key, a missing one, the other form (a dict for one tensor,
    one tensor for fields), a wrong number of dims, or a wrong fixed size."""
    names = list(fields)
    fixed = [(n, k) for n in names for k, d in enumerate(fields[n]) if d is not None]
    how = data.draw(st.sampled_from(["extra", "form", "ndim"] + ["missing"] * (not single)
                                    + ["fixed"] * bool(fixed)), "spoil")
    bad = dict(value)
    if how == "extra":
        bad["surplus"] = torch.zeros(1)
        return bad
    if how == "form":
        return bad if single else bad[names[0]]
    if how == "missing":
        del bad[data.draw(st.sampled_from(names), "drop")]
        return bad
    if how == "ndim":
        name = data.draw(st.sampled_from(names), "field")
        # one leading dim more, of size 2 (extra leading dims of size 1 are dropped, as 0.2.1
        # did: such a value is valid)
        bad[name] = torch.zeros((2, *bad[name].shape), dtype=bad[name].dtype)
    else:
        name, k = data.draw(st.sampled_from(fixed), "fixed dim")
        shape = list(bad[name].shape)
        shape[k] += 1
        bad[name] = torch.zeros(shape, dtype=bad[name].dtype)
    return bad[names[0]] if single else bad


class SamplesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: SharedCache | None = None
        self.model: Model | None = None

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.cache = self.model = None

    def snapshot(self):
        c = self.cache
        st_ = c.stats()
        return [c.get_slot(i) for i in range(self.model.n)], \
            {k: st_.get(k) for k in ("filled", "full", "arena_used", "writes")}

    @initialize(data=st.data())
    def first(self, data) -> None:
        self.construct(data)

    @rule(data=st.data())
    def construct(self, data) -> None:
        n = data.draw(st.integers(1, 8), "dataset_len")
        kind = data.draw(st.sampled_from(KINDS), "kind")
        count = 1 if kind == "open" else data.draw(st.integers(1, 3), "fields")
        fields, dtypes = {}, {}
        for k in range(count):
            rank = data.draw(st.integers(0 if kind != "open" else 1, 3), f"rank {k}")
            dims = [data.draw(st.integers(1, 3), f"dim {k}.{j}") for j in range(rank)]
            if kind != "fields" and rank and data.draw(st.booleans(), f"open {k}"):
                for j in range(rank):
                    if data.draw(st.booleans(), f"open {k}.{j}") or j == rank - 1:
                        dims[j] = None
            fields[f"f{k}"] = tuple(dims)
            dtypes[f"f{k}"] = data.draw(st.sampled_from(DTYPES), f"dtype {k}")
        if kind == "open" and None not in fields["f0"]:
            fields["f0"] = (None,) + fields["f0"][1:]
        single = kind == "open" or (count == 1 and fields["f0"] != ()  # () only as a field
                                    and data.draw(st.booleans(), "single"))
        is_open = any(None in d for d in fields.values())
        if is_open:
            opens = sum(d is None for dims in fields.values() for d in dims)
            arena = 16 * data.draw(st.integers(1, 24), "arena / 16")
            limit = (n + n * 8 * (4 + opens) + arena) / BYTES_PER_GIB
        else:
            arena, limit = 0, 1.0
        dims_arg = fields["f0"] if single else fields
        dtype_arg = dtypes["f0"] if single else dtypes
        kind_of_cache = OpenSizeCache if is_open else SharedCache
        cache = kind_of_cache(limit, n, dims_arg, dtype_arg, world=World(), shm_dir=SHM[0])
        CALLS["construct", kind] += 1
        if is_open:
            assert cache.stats()["arena_bytes"] == arena  # the budget, exactly
        assert len(cache) == n
        if self.cache is not None:
            self.cache.close()
        self.cache, self.model = cache, Model(n, fields, dtypes, single, arena)

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data())
    def set_slot(self, data) -> None:
        m = self.model
        i = data.draw(st.integers(0, m.n - 1), "i")
        value = sample_for(data, m.fields, m.dtypes, "value")
        if m.samples[i] is not None and data.draw(st.booleans(), "the same again"):
            value = m.samples[i]
        how = data.draw(st.sampled_from(["allow_overwrite", "allow_overwrite", "exist_ok",
                                         "neither"]), "overwrite")
        self.write(i, value, how)
        self.write_again_if_emptied(data, i)

    @precondition(lambda self: self.model is not None and self.model.open)
    @rule(data=st.data())
    def fill(self, data) -> None:
        """Fresh samples into index after index (from 0 again after the last, overwriting),
        until one finds no room or after 4 rounds: the arena is then full or nearly, and
        further overwrites find no room (otherwise rare: samples are small, clears many)."""
        m = self.model
        full = m.full
        for k in range(4 * m.n):
            value = sample_for(data, m.fields, m.dtypes, f"value {k}")
            self.write(k % m.n, value, "allow_overwrite")
            if m.full > full:
                self.write_again_if_emptied(data, k % m.n)
                break

    @precondition(lambda self: self.model is not None and self.model.open
                  and (self.model.emptied or any(s is not None for s in self.model.samples)))
    @rule(data=st.data())
    def overwrite(self, data) -> None:
        """An overwrite of an index that holds a sample or that an overwrite emptied: moves
        fill the arena, so that overwrites find no room and empty their index, and the next
        write of such an index is checked (issue 11's divergence)."""
        m = self.model
        held = sorted(m.emptied | {k for k, s in enumerate(m.samples) if s is not None})
        if m.emptied and data.draw(st.booleans(), "an emptied one"):
            held = sorted(m.emptied)
        i = data.draw(st.sampled_from(held), "i")
        self.write(i, sample_for(data, m.fields, m.dtypes, "value"), "allow_overwrite")
        self.write_again_if_emptied(data, i)

    def write_again_if_emptied(self, data, i: int) -> None:
        """The next write of an index that an overwrite emptied, at once: the divergence of
        issue 11 needs it, and later steps seldom reach it (a clear or a construct comes
        first: 1 in 24 such indices in one run before this was done here)."""
        if i in self.model.emptied:
            m = self.model
            self.write(i, sample_for(data, m.fields, m.dtypes, "again"), "allow_overwrite")

    def write(self, i: int, value: dict, how: str) -> None:
        """set_slot(i, value) on the cache and the model, with ``allow_overwrite``,
        ``exist_ok`` or neither (``how``): the same outcome, the same exception type."""
        m = self.model
        arg = next(iter(value.values())) if m.single else value
        emptied, held = i in m.emptied, m.samples[i] is not None
        want = outcome(lambda: m.set_slot(i, value, how))
        got = outcome(lambda: self.cache.set_slot(i, arg, **({how: True} if how != "neither"
                                                             else {})))
        CALLS["set_slot", want[0]] += 1
        if held and i in m.emptied:
            CALLS["overwrite", "emptied"] += 1
        if emptied:  # an index that an overwrite without room emptied keeps no place
            CALLS["set_slot emptied", "stored" if m.samples[i] is not None else "not"] += 1
        assert got[0] == want[0] and (got[0] == "ok" or got[1] is want[1]), (got, want)

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data())
    def set_slot_bad(self, data) -> None:
        m = self.model
        i = data.draw(st.integers(0, m.n - 1), "i")
        value = sample_for(data, m.fields, m.dtypes, "value")
        bad = spoil(data, value, m.fields, m.single)
        before = self.snapshot()
        got = outcome(lambda: self.cache.set_slot(i, bad, allow_overwrite=True))
        CALLS["set_slot bad", got[0]] += 1
        assert got[0] == "err" and got[1] in (TypeError, ValueError), \
            f"set_slot({i}, {bad!r}) of a cache of {m.fields}: {got}"
        after = self.snapshot()
        assert after[1] == before[1] and all(same(a, b) for a, b in zip(after[0], before[0]))

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data())
    def get_batch(self, data) -> None:
        idx = data.draw(st.lists(st.integers(0, self.model.n - 1), max_size=5), "indices")
        want = outcome(lambda: self.model.get_batch(idx))
        got = outcome(lambda: self.cache.get_batch(idx))
        CALLS["get_batch", want[0]] += 1
        assert got[0] == want[0], (got, want)
        if got[0] == "ok":
            assert same(got[1], want[1])
        else:
            assert got[1] is want[1]

    @precondition(lambda self: self.cache is not None)
    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model.clear()
        CALLS["clear", "ok"] += 1

    @invariant()
    def agrees_with_model(self) -> None:
        if self.cache is None:
            return
        c, m = self.cache, self.model
        for i in range(m.n):
            assert same(c.get_slot(i), m.get_slot(i)), (i, c.get_slot(i), m.get_slot(i))
        stats = c.stats()
        assert stats["filled"] == sum(s is not None for s in m.samples)
        if m.open:
            assert (stats["full"], stats["arena_used"]) == (m.full, m.top), (stats, m.top)


# Counts, not time (see test_fuzz.py): no shrinking by default; derandomized, so a failure
# reproduces; STOCACHING_FUZZ_PROFILE=fuzz-shrink shrinks it.
settings.register_profile("fuzz-samples", max_examples=120, stateful_step_count=30,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate),
                          suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(600)
def test_fields_and_open_sizes_match_model(tmpfs, capsys):
    SHM[:] = [tmpfs]
    CALLS.clear()
    name = os.environ.get("STOCACHING_FUZZ_PROFILE", "fuzz-samples")
    profile = settings.get_profile(name)
    if name == "fuzz-shrink":
        profile = settings(settings.get_profile("fuzz-samples"), phases=tuple(Phase))
    assert profile.deadline is None and profile.derandomize  # conftest.py's profile
    run_state_machine_as_test(SamplesMachine, settings=profile)
    gc.collect()
    assert_no_leak(tmpfs)
    with capsys.disabled():
        print("\n[fuzz samples] " + ", ".join(f"{op} {kind} {n}"
                                            for (op, kind), n in sorted(CALLS.items())))
    for kind in set(KINDS):
        assert CALLS["construct", kind] >= 10, CALLS
    # with fill and overwrite, 63-442 refused writes in randomized runs of 120 examples
    assert CALLS["set_slot", "ok"] >= 300 and CALLS["set_slot", "err"] >= 20, CALLS
    # overwrites that found no room, and the next writes of the indices they emptied (issue
    # 11's divergence): 19-51 and 28-269 in 8 randomized runs of 120 examples. (The examples
    # of this derandomized run depend on which modules are loaded, see conftest.py: the whole
    # suite and this file alone draw others, so every count asserted here has a wide margin.)
    assert CALLS["overwrite", "emptied"] >= 5, CALLS
    assert CALLS["set_slot emptied", "not"] + CALLS["set_slot emptied", "stored"] >= 5, CALLS
    assert CALLS["set_slot bad", "err"] >= 100, CALLS
    assert CALLS["get_batch", "err"] >= 30, CALLS  # an open field: no get_batch
    assert CALLS["get_batch", "ok"] >= 30 and CALLS["clear", "ok"] >= 20, CALLS
