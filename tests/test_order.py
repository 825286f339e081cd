"""ReadyFirstSampler, the cache-preferring shuffle-buffer order: invariants, resume, ranks."""

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from _helpers import run_copied
from stocaching import CacheAwareSampler, CacheLayout, SharedCache, World
from stocaching.order import ReadyFirstSampler, ready_first_order

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
MODES = ["fixed", "adaptive"]
# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def reference_order(mask, window):
    """The rule, step by step, as docs/order.md states it: base positions in output order."""
    n, pending, out, admitted = len(mask), set(), [], 0
    for t in range(n):
        while admitted <= min(t + window, n - 1):
            pending.add(admitted)
            admitted += 1
        if t - window in pending:
            b = t - window
        else:
            ready = [p for p in pending if mask[p]]
            b = min(ready) if ready else min(pending)
        pending.remove(b)
        out.append(b)
    return out


def displacement(base, out):
    """Largest |output position - base position|, matching equal indices in order (the
    matching that minimises the largest move); fails unless ``out`` is a permutation of
    ``base`` as a multiset."""
    base, out = np.asarray(base), np.asarray(out)
    assert base.shape == out.shape
    b, o = np.argsort(base, kind="stable"), np.argsort(out, kind="stable")
    np.testing.assert_array_equal(base[b], out[o])  # exactly once (as often as in the base)
    return int(np.abs(b - o).max()) if base.size else 0


def from_set(ready_set):
    """A ``ready`` callable: an index is ready when it is in ``ready_set`` (read at each call)."""
    return lambda idx: np.isin(idx, np.fromiter(ready_set, dtype=np.int64))


def random_ready(seed, p=0.5):
    """A ``ready`` callable whose answers change at every call (adaptive readiness)."""
    rng = np.random.default_rng(seed)
    return lambda idx: rng.random(idx.shape) < p


def dist_base(n, rank=0, num_replicas=1, seed=0):
    return DistributedSampler(range(n), num_replicas=num_replicas, rank=rank, shuffle=True,
                              seed=seed)


def roundtrip(state):
    """A state as a checkpoint sees it: through torch.save and a weights_only torch.load."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture
def cache(shm_dir):
    """A 64-index cache of (4,) uint8 samples with a slot for every index, in a fresh
    directory on /dev/shm (removed by the shm_dir fixture)."""
    c = SharedCache(1e-6, 64, (4,), shm_dir=shm_dir, world=World())
    assert len(c) == 64
    yield c
    c.close()


# ------------------------------------------------------------------------------------------------
# The order
# ------------------------------------------------------------------------------------------------


def test_small_case_by_hand():
    # W = 2, base positions 0..7, ready at 2, 4, 5. Step by step (window [t-2, t+2]):
    # t0: 2 (ready)  t1: 0 (none ready, smallest)  t2: 4 (ready)  t3: 1 (deadline)
    # t4: 5 (ready)  t5: 3 (deadline)  t6: 6  t7: 7
    mask = np.zeros(8, dtype=bool)
    mask[[2, 4, 5]] = True
    assert ready_first_order(mask, 2).tolist() == [2, 0, 4, 1, 5, 3, 6, 7]
    base = list(range(10, 18))
    for mode in MODES:
        s = ReadyFirstSampler(base, from_set({12, 14, 15}), window=2, mode=mode)
        assert list(s) == [12, 10, 14, 11, 15, 13, 16, 17]


@SETTINGS
@given(st.lists(st.booleans(), max_size=80), st.integers(1, 12))
def test_vectorised_order_is_the_rule(mask, window):
    order = ready_first_order(np.array(mask, dtype=bool), window)
    assert order.dtype == np.int64
    assert order.tolist() == reference_order(mask, window)


@SETTINGS
@given(st.integers(0, 300), st.integers(1, 40), st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_permutation_within_window(n, window, f, seed):
    mask = np.random.default_rng(seed).random(n) < f
    order = ready_first_order(mask, window)
    assert sorted(order.tolist()) == list(range(n))
    assert n == 0 or np.abs(order - np.arange(n)).max() <= window


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("everything_ready", [True, False])
def test_all_or_nothing_ready_keeps_the_base_order(mode, everything_ready):
    base = dist_base(100, seed=3)
    s = ReadyFirstSampler(base, lambda idx: np.full(idx.shape, everything_ready), window=7,
                          mode=mode)
    assert list(s) == list(base)


@pytest.mark.parametrize("mode", MODES)
def test_ready_come_first_within_the_window(mode):
    # Ready: base positions 5..9. With W = 5 they are all in the first window and go first.
    base = np.random.default_rng(0).permutation(40).tolist()
    s = ReadyFirstSampler(base, from_set(set(base[5:10])), window=5, mode=mode)
    out = list(s)
    assert out[:5] == base[5:10]
    assert out[5:10] == base[:5]
    assert out[10:] == base[10:]


@SETTINGS
@given(st.lists(st.integers(0, 20), max_size=120), st.integers(1, 15), st.integers(1, 9),
       st.integers(0, 2**32 - 1))
def test_exactly_once_and_displacement_with_repeated_indices(base, window, refresh, seed):
    # Repeated indices, as DistributedSampler's padding makes: positions, not values, count.
    ready = set(np.random.default_rng(seed).choice(21, 10).tolist())
    fixed = list(ReadyFirstSampler(base, from_set(ready), window=window))
    assert displacement(base, fixed) <= window
    adaptive = list(ReadyFirstSampler(base, random_ready(seed), window=window,
                                      mode="adaptive", refresh_every=refresh))
    assert displacement(base, adaptive) <= window


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 20), st.integers(1, 30), st.integers(0, 2**32 - 1))
def test_adaptive_with_unchanging_readiness_is_fixed(n, window, refresh, seed):
    ready = set(np.random.default_rng(seed).choice(n, n // 2).tolist())
    base = np.random.default_rng(seed + 1).permutation(n).tolist()
    fixed = list(ReadyFirstSampler(base, from_set(ready), window=window))
    adaptive = list(ReadyFirstSampler(base, from_set(ready), window=window, mode="adaptive",
                                      refresh_every=refresh))
    assert adaptive == fixed


def test_adaptive_serves_what_became_ready():
    ready = set()
    s = ReadyFirstSampler(list(range(100)), from_set(ready), window=10, mode="adaptive",
                          refresh_every=5)
    f = ReadyFirstSampler(list(range(100)), from_set(ready), window=10)
    it, it_fixed = iter(s), iter(f)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]  # nothing ready: the base order
    assert [next(it_fixed) for _ in range(5)] == [0, 1, 2, 3, 4]
    ready.add(12)  # staged by a prefetcher; inside the window of step 5 ([-5, 15])
    assert next(it) == 12
    assert next(it_fixed) == 5  # fixed mode keeps what it saw at the epoch's start
    rest = list(it)
    assert displacement(list(range(100)), [0, 1, 2, 3, 4, 12] + rest) <= 10


def test_adaptive_reads_readiness_in_chunks():
    calls = []

    def ready(idx):
        calls.append(idx.size)
        assert not idx.flags.writeable
        return np.zeros(idx.shape, dtype=bool)

    n, window, refresh = 1000, 16, 8
    assert len(list(ReadyFirstSampler(list(range(n)), ready, window=window, mode="adaptive",
                                      refresh_every=refresh))) == n
    assert len(calls) == n // refresh
    assert max(calls) <= window + 1 + refresh  # the waiting ones plus those entering
    calls.clear()
    list(ReadyFirstSampler(list(range(n)), ready, window=window))
    assert calls == [n]  # fixed: once, at the epoch's start


# ------------------------------------------------------------------------------------------------
# Determinism and epochs
# ------------------------------------------------------------------------------------------------


def test_same_seed_epoch_and_mask_same_order_different_epochs_differ():
    mask = np.random.default_rng(1).random(500) < 0.4

    def order(epoch):
        s = ReadyFirstSampler(dist_base(500, seed=7), lambda idx: mask[idx], window=32)
        s.set_epoch(epoch)
        return list(s)

    assert order(0) == order(0)
    assert order(3) == order(3)
    assert order(0) != order(1)
    s = ReadyFirstSampler(dist_base(500, seed=7), lambda idx: mask[idx], window=32)
    s.set_epoch(1)
    assert s.base.epoch == 1  # forwarded
    assert list(s) == order(1)


def test_iterating_an_epoch_twice_warns():
    s = ReadyFirstSampler(dist_base(20), from_set(set()), window=3)
    list(s)
    with pytest.warns(UserWarning, match="set_epoch"):
        list(s)
    s.set_epoch(1)
    list(s)


def test_works_as_a_dataloader_sampler():
    s = ReadyFirstSampler(RandomSampler(range(50), generator=torch.Generator().manual_seed(0)),
                          from_set({1, 2, 3}), window=8)
    loader = DataLoader(range(50), batch_size=8, sampler=s)
    assert sorted(torch.cat(list(loader)).tolist()) == list(range(50))
    assert len(s) == 50


# ------------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("consumed", [1, 17, 40, 99, 100])
def test_resume_fixed_gives_the_identical_rest_in_a_new_sampler(consumed):
    mask = np.random.default_rng(2).random(100) < 0.5
    s = ReadyFirstSampler(dist_base(100, seed=5), lambda idx: mask[idx], window=9)
    s.set_epoch(2)
    it = iter(s)
    full = [next(it) for _ in range(100)]
    state = roundtrip(s.state_dict(consumed=consumed))
    assert state["epoch"] == 2 and state["consumed"] == consumed
    # A new process: its cache state is different (here: everything ready).
    t = ReadyFirstSampler(dist_base(100, seed=5), lambda idx: np.ones(idx.shape, bool),
                          window=9)
    t.load_state_dict(state)
    t.set_epoch(2)  # the training loop's call at the start of the resumed epoch keeps it
    assert list(t) == full[consumed:]
    t.set_epoch(3)
    assert len(list(t)) == 100


@pytest.mark.parametrize("consumed", [1, 10, 23, 64])
def test_resume_adaptive_gives_a_valid_rest(consumed):
    base = dist_base(100, seed=5)
    s = ReadyFirstSampler(base, random_ready(0), window=9, mode="adaptive", refresh_every=4)
    it = iter(s)
    yielded = [next(it) for _ in range(consumed + 3)]  # the loader ran ahead a little
    state = roundtrip(s.state_dict(consumed=consumed))
    t = ReadyFirstSampler(dist_base(100, seed=5), random_ready(1), window=9, mode="adaptive")
    t.load_state_dict(state)
    rest = list(t)
    assert len(rest) == 100 - consumed
    assert displacement(list(base), yielded[:consumed] + rest) <= 9


@SETTINGS
@given(st.integers(1, 120), st.integers(1, 12), st.integers(0, 2**32 - 1), st.data())
def test_resume_property(n, window, seed, data):
    base = np.random.default_rng(seed).integers(0, 30, n).tolist()  # repeats included
    mask = np.random.default_rng(seed + 1).random(30) < 0.5
    for mode in MODES:
        ready = (lambda idx: mask[idx]) if mode == "fixed" else random_ready(seed)
        s = ReadyFirstSampler(base, ready, window=window, mode=mode, refresh_every=3)
        it = iter(s)
        ahead = data.draw(st.integers(0, n), label="yielded")
        yielded = [next(it) for _ in range(ahead)]
        consumed = data.draw(st.integers(0, ahead), label="consumed")
        t = ReadyFirstSampler(base, random_ready(seed + 2), window=window, mode=mode)
        t.load_state_dict(s.state_dict(consumed=consumed))
        rest = list(t)
        assert displacement(base, yielded[:consumed] + rest) <= window
        if mode == "fixed":
            assert yielded[:consumed] + rest == list(ReadyFirstSampler(base, ready,
                                                                       window=window))


def test_state_dict_defaults_to_what_the_iterator_yielded():
    s = ReadyFirstSampler(list(range(30)), from_set({3}), window=4)
    assert s.state_dict()["consumed"] == 0
    it = iter(s)
    for _ in range(7):
        next(it)
    state = s.state_dict()
    assert state["consumed"] == 7
    assert set(state) == {"epoch", "consumed", "window", "mode", "len", "base", "order_digest",
                          "emitted", "ready", "generator", "generator_after"}
    assert state["generator"] is None and state["generator_after"] is None  # a list has none
    assert len(state["emitted"]) == math.ceil((2 * 4 + 1) / 8)
    assert len(state["ready"]) == math.ceil((30 - 3) / 8)  # from position consumed - W on


def test_resume_of_a_resumed_sampler():
    mask = np.random.default_rng(3).random(60) < 0.5
    full = list(ReadyFirstSampler(list(range(60)), lambda idx: mask[idx], window=6))
    s = ReadyFirstSampler(list(range(60)), lambda idx: mask[idx], window=6)
    list(s)
    a = ReadyFirstSampler(list(range(60)), from_set(set()), window=6)
    a.load_state_dict(s.state_dict(consumed=20))
    assert a.state_dict()["consumed"] == 20  # loaded, not yet iterated
    it = iter(a)
    for _ in range(15):
        next(it)
    b = ReadyFirstSampler(list(range(60)), from_set(set()), window=6)
    b.load_state_dict(a.state_dict())
    assert list(b) == full[35:]


def test_resume_through_cache_aware_sampler():
    layout = CacheLayout(40, 10, num_nodes=2)
    mask = np.random.default_rng(4).random(40) < 0.5

    def make():
        base = CacheAwareSampler(layout, num_replicas=4, rank=1, seed=9, batch_size=4,
                                 local_world_size=2)
        return ReadyFirstSampler(base, lambda idx: mask[idx], window=5)

    s = make()
    s.set_epoch(3)
    full = list(s)
    state = roundtrip(s.state_dict(consumed=4))
    assert state["base"]["epoch"] == 3 and state["base"]["consumed"] == 0
    t = make()
    t.load_state_dict(state)
    assert t.base.epoch == 3
    assert list(t) == full[4:]
    bad = dict(state, base=dict(state["base"], seed=1))
    with pytest.raises(ValueError, match="seed"):
        make().load_state_dict(bad)


def test_resume_into_another_base_order_is_refused():
    s = ReadyFirstSampler(dist_base(50, seed=1), from_set(set()), window=4)
    it = iter(s)
    next(it)
    state = s.state_dict()
    t = ReadyFirstSampler(dist_base(50, seed=2), from_set(set()), window=4)
    t.load_state_dict(state)
    with pytest.raises(ValueError, match="base order of epoch 0 differs"):
        iter(t)
    t.base.seed = 1
    assert len(list(t)) == 49  # the state was kept: fixing the base and retrying works


def test_a_finished_epoch_resumes_empty_then_the_next_starts_fresh():
    s = ReadyFirstSampler(dist_base(30), from_set(set()), window=4)
    list(s)
    t = ReadyFirstSampler(dist_base(30), from_set(set()), window=4)
    t.load_state_dict(s.state_dict())
    assert list(t) == []
    t.set_epoch(1)
    assert len(list(t)) == 30


def test_set_epoch_to_another_epoch_discards_a_loaded_position():
    s = ReadyFirstSampler(dist_base(30), from_set(set()), window=4)
    it = iter(s)
    next(it)
    t = ReadyFirstSampler(dist_base(30), from_set(set()), window=4)
    t.load_state_dict(s.state_dict())
    with pytest.warns(UserWarning, match="discards the resume position"):
        t.set_epoch(5)
    assert len(list(t)) == 30


@pytest.mark.parametrize("field, value", [("window", 5), ("mode", "adaptive"), ("len", 31)])
def test_state_from_another_configuration_is_refused(field, value):
    s = ReadyFirstSampler(dist_base(30), from_set(set()), window=4)
    it = iter(s)
    next(it)
    state = dict(s.state_dict(), **{field: value})
    t = ReadyFirstSampler(dist_base(30), from_set(set()), window=4)
    t.set_epoch(2)
    with pytest.raises(ValueError, match=f"state\\['{field}'\\] should be"):
        t.load_state_dict(state)
    assert t.epoch == 2 and t.base.epoch == 2 and len(list(t)) == 30  # nothing changed


@pytest.mark.parametrize("change, match", [
    (lambda s: {k: v for k, v in s.items() if k != "emitted"}, "lacks \\['emitted'\\]"),
    (lambda s: dict(s, consumed=31), "state\\['consumed'\\] should be an int in \\[0, 30\\]"),
    (lambda s: dict(s, consumed=True), "state\\['consumed'\\] should be"),
    (lambda s: dict(s, emitted=b""), "state\\['emitted'\\] should be 2 bytes"),
    (lambda s: dict(s, ready=None), "state\\['ready'\\] should be 3 bytes"),
    (lambda s: dict(s, epoch=-1), "state\\['epoch'\\] should be an int >= 0"),
    (lambda s: dict(s, order_digest=None), "state\\['order_digest'\\] should be a str"),
])
def test_malformed_state_is_refused(change, match):
    s = ReadyFirstSampler(list(range(30)), from_set(set()), window=4)
    it = iter(s)
    for _ in range(10):  # the window is base positions 6..14: 9 bits, 24 ready bits from 6 on
        next(it)
    t = ReadyFirstSampler(list(range(30)), from_set(set()), window=4)
    with pytest.raises((ValueError, TypeError), match=match):
        t.load_state_dict(change(s.state_dict()))
    with pytest.raises(TypeError, match="state should be a dict"):
        t.load_state_dict([1, 2])


def seeded_random(n: int = 30, seed: int = 0) -> RandomSampler:
    return RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("base, change, match", [
    (seeded_random, lambda s: dict(s, generator=b"x"),
     "state\\['generator'\\] should be the \\d+ bytes of the state of the base sampler's "
     "generator, but got 1 bytes"),
    (seeded_random, lambda s: dict(s, generator_after=7), "but got type int"),
    (lambda: RandomSampler(range(30)), lambda s: s,
     "this base sampler \\(RandomSampler\\) has no torch.Generator"),
])
def test_a_generator_state_that_cannot_be_restored_is_refused(base, change, match):
    s = ReadyFirstSampler(seeded_random(), from_set(set()), window=4)
    s.set_epoch(1)
    it = iter(s)
    next(it)
    t = ReadyFirstSampler(base(), from_set(set()), window=4)
    with pytest.raises(ValueError, match=match):
        t.load_state_dict(change(s.state_dict()))
    assert t.epoch == 0  # nothing changed


def test_a_state_without_the_generator_fields_loads_as_before():
    """States saved before the generator fields existed: nothing is restored, and the rest of
    an epoch whose order the fresh generator gives again (the first) continues exactly."""
    s = ReadyFirstSampler(seeded_random(), from_set({1, 5}), window=4)
    whole = list(s)
    s = ReadyFirstSampler(seeded_random(), from_set({1, 5}), window=4)
    it = iter(s)
    head = [next(it) for _ in range(11)]
    old = {k: v for k, v in s.state_dict().items() if not k.startswith("generator")}
    t = ReadyFirstSampler(seeded_random(), from_set({1, 5}), window=4)
    t.load_state_dict(old)
    assert head + list(t) == whole


def test_consumed_beyond_what_is_known_is_refused():
    s = ReadyFirstSampler(list(range(30)), from_set(set()), window=4, mode="adaptive",
                          refresh_every=2)
    with pytest.raises(ValueError, match="no iterator of epoch 0 has run"):
        s.state_dict(consumed=3)
    it = iter(s)
    next(it)
    with pytest.raises(ValueError, match="consumed should be in \\[0, 2\\]"):
        s.state_dict(consumed=3)
    with pytest.raises(ValueError, match="consumed should be an int in \\[0, 30\\]"):
        s.state_dict(consumed=31)


# ------------------------------------------------------------------------------------------------
# Ranks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [101, 128])  # 101: DistributedSampler pads by repeating
@pytest.mark.parametrize("mode", MODES)
def test_ddp_split_is_unchanged(n, mode):
    mask = np.random.default_rng(5).random(n) < 0.5
    ours, theirs = [], []
    for rank in range(2):
        base = DistributedSampler(range(n), num_replicas=2, rank=rank, seed=11)
        s = ReadyFirstSampler(DistributedSampler(range(n), num_replicas=2, rank=rank, seed=11),
                              lambda idx: mask[idx], window=6, mode=mode)
        base.set_epoch(1)
        s.set_epoch(1)
        out = list(s)
        assert displacement(list(base), out) <= 6  # this rank's base indices, exactly once
        ours += out
        theirs += list(base)
    assert sorted(ours) == sorted(theirs)
    assert set(ours) == set(range(n))


@pytest.mark.parametrize("window, batch", [(1, 4), (4, 4), (5, 4), (13, 4), (64, 8)])
def test_batch_displacement_under_cache_aware_sampler(window, batch):
    layout = CacheLayout(203, 60, num_nodes=2)
    mask = np.random.default_rng(window).random(203) < 0.5
    limit = math.ceil(window / batch)
    ours, theirs = [], []
    for rank in range(4):
        def base():
            b = CacheAwareSampler(layout, num_replicas=4, rank=rank, seed=3, batch_size=batch,
                                  local_world_size=2)
            b.set_epoch(2)
            return b
        s = ReadyFirstSampler(base(), lambda idx: mask[idx], window=window)
        s.set_epoch(2)
        out, ref = list(s), list(base())
        # Match equal indices in order (padding repeats some), then compare batch numbers.
        b, o = np.argsort(ref, kind="stable"), np.argsort(out, kind="stable")
        np.testing.assert_array_equal(np.asarray(ref)[b], np.asarray(out)[o])
        assert np.abs(b // batch - o // batch).max() <= limit
        ours += out
        theirs += ref
    assert sorted(ours) == sorted(theirs)


# ------------------------------------------------------------------------------------------------
# With a real SharedCache
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_set_slots_go_first_within_the_window(cache, mode):
    base = np.random.default_rng(6).permutation(64).tolist()
    for i in base[8:12]:
        cache.set_slot(i, torch.full((4,), i, dtype=torch.uint8))
    s = ReadyFirstSampler(base, cache, window=8, mode=mode)
    out = list(s)
    assert out[:4] == base[8:12]
    assert out[4:12] == base[:8]
    mask = cache.aux_array.numpy()[base] == 1
    assert out == np.asarray(base)[ready_first_order(mask, 8)].tolist()


def test_adaptive_sees_slots_set_during_the_epoch(cache):
    s = ReadyFirstSampler(list(range(64)), cache, window=8, mode="adaptive", refresh_every=4)
    it = iter(s)
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
    cache.set_slot(10, torch.zeros(4, dtype=torch.uint8))
    assert next(it) == 10
    state = s.state_dict()
    cache.clear()
    t = ReadyFirstSampler(list(range(64)), cache, window=8, mode="fixed")
    with pytest.raises(ValueError, match="state\\['mode'\\]"):
        t.load_state_dict(state)


def test_base_indices_outside_the_cache_are_refused(cache):
    with pytest.raises(ValueError, match="base should yield indices in \\[0, 64\\)"):
        iter(ReadyFirstSampler(list(range(65)), cache, window=4))


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"window": 0}, ValueError, "window should be a positive int, but got window=0"),
    ({"window": -3}, ValueError, "window should be a positive int, but got window=-3"),
    ({"window": True}, TypeError, "window should be a positive int, but got window=True"),
    ({"window": 2.0}, TypeError, "window should be a positive int, but got window=2.0"),
    ({"window": "4"}, TypeError, "window should be a positive int, but got window='4'"),
    ({"window": 4, "mode": "random"}, ValueError, "mode should be 'fixed' or 'adaptive'"),
    ({"window": 4, "mode": 1}, TypeError, "mode should be 'fixed' or 'adaptive'"),
    ({"window": 4, "refresh_every": 0}, ValueError, "refresh_every should be a positive int"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ReadyFirstSampler(list(range(10)), from_set(set()), **kwargs)


def test_bad_base_and_ready():
    with pytest.raises(TypeError, match="base should be a Sampler or an iterable of ints"):
        ReadyFirstSampler(5, from_set(set()), window=2)
    with pytest.raises(TypeError, match="ready should be a SharedCache, an OpenSizeCache or a "
                                        "callable"):
        ReadyFirstSampler([1, 2], [True, False], window=2)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'window'"):
        ReadyFirstSampler([1, 2], from_set(set()))
    with pytest.raises(TypeError):
        ReadyFirstSampler([1, 2], from_set(set()), 2)  # flags are keyword-only
    with pytest.raises(ValueError, match="should return one bool per index"):
        list(ReadyFirstSampler([1, 2], lambda idx: [True], window=2))
    with pytest.raises(TypeError, match="should return bools, but got dtype float64"):
        list(ReadyFirstSampler([1, 2], lambda idx: np.ones(idx.shape), window=2))
    assert list(ReadyFirstSampler([1, 2], lambda idx: idx % 2, window=2)) == [1, 2]
    with pytest.raises(ValueError, match="epoch should be an int >= 0, but got epoch=-1"):
        ReadyFirstSampler([1, 2], from_set(set()), window=2).set_epoch(-1)
    with pytest.raises(TypeError, match="ready should be a 1-D bool array"):
        ready_first_order([0, 1], 2)
    with pytest.raises(ValueError, match="window should be a positive int, but got window=0"):
        ready_first_order([True], 0)


def test_base_that_yields_less_than_its_length_is_refused():
    class Short(list):
        def __len__(self):
            return 5

    with pytest.raises(ValueError, match="should yield len\\(base\\)=5 indices"):
        iter(ReadyFirstSampler(Short([1, 2]), from_set(set()), window=2))


# ------------------------------------------------------------------------------------------------
# Copied next to stocaching.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["order", "prefetch"])
def test_the_order_works_copied_next_to_stocaching_py(module, tmp_path):
    """order.py copied beside stocaching.py, _common.py, masks.py and trainers.py, and
    prefetch.py beside them: the copies import each other, not the package."""
    out = run_copied(tmp_path, ("stocaching.py", "_common.py", "masks.py", "trainers.py",
                                "order.py", *(["prefetch.py"] if module == "prefetch" else [])),
                     f"""
        import os, order, stocaching, {module} as m
        assert os.path.dirname(stocaching.__file__) == os.getcwd()  # the copy, not the package
        assert os.path.dirname(m.__file__) == os.getcwd()
        assert m.ReadyFirstSampler is order.ReadyFirstSampler
        s = m.ReadyFirstSampler(list(range(6)), lambda i: i == 4, window=3)
        print(list(s))
    """)
    assert out.strip() == "[0, 4, 1, 2, 3, 5]"


# ------------------------------------------------------------------------------------------------
# A wide window over a cache of the first indices
# ------------------------------------------------------------------------------------------------


def first_indices_cache(shm_dir, **kwargs):
    """523 of 1,000 indices cached: with the default layout, the first 523."""
    return SharedCache(0.0005, 1000, (1024,), **kwargs)


def zeros(i):
    return torch.zeros(1024, dtype=torch.uint8)


@pytest.mark.parametrize("make", ["order", "fixed prefetcher", "adaptive prefetcher",
                                  "device loader"])
def test_a_window_over_a_sixteenth_of_the_epoch_over_the_first_indices_warns_at_the_callers_line(
        make, shm_dir):
    """The README's window (256) over a cache of the first indices, the default: the cached
    samples would come first in every epoch (the first classes of an ImageFolder), so the
    construction warns, naming random_subset=True and the widest window that does not warn,
    at the caller's line, whichever of the three documented ways built the order."""
    from stocaching import DeviceLoader, Prefetcher
    cache = first_indices_cache(shm_dir)
    assert (cache.layout.slots, cache.layout.random_subset) == (523, False)
    build = {"order": lambda: ReadyFirstSampler(range(1000), cache, window=256),
             "fixed prefetcher": lambda: Prefetcher(range(1000), cache, zeros, window=256),
             "adaptive prefetcher": lambda: Prefetcher(range(1000), cache, zeros, window=256,
                                                       mode="adaptive"),
             "device loader": lambda: DeviceLoader(cache, range(1000), zeros, batch_size=4,
                                                   device="cpu", window=256)}[make]
    with pytest.warns(UserWarning, match=r"window=256 is 26 % of the epoch .* first 523 of "
                                         r"1000 .* random_subset=True, or keep window <= 62") \
            as caught:
        made = build()
    assert len(caught) == 1 and caught[0].filename == __file__
    getattr(made, "close", lambda: None)()
    cache.close()


@pytest.mark.parametrize("case", ["random subset", "window of a sixteenth", "all cached",
                                  "a ready function", "several nodes"])
def test_an_order_that_cannot_bring_the_first_classes_first_does_not_warn(case, shm_dir):
    """No warning where the cached samples are not the first indices (random_subset=True,
    several nodes, every index cached), the window is at most a sixteenth of the epoch, or
    the order is given a ready function (whose samples it cannot know)."""
    import warnings
    kwargs = {"random subset": {"random_subset": True},
              "several nodes": {"world": World(rank=0, world_size=2, local_rank=0,
                                               local_world_size=1, node_rank=0,
                                               num_nodes=2)}}.get(case, {})
    cache = SharedCache(0.01, 1000, (1024,)) if case == "all cached" else \
        first_indices_cache(shm_dir, **kwargs)
    ready = (lambda idx: np.zeros(len(idx), dtype=bool)) if case == "a ready function" \
        else cache
    window = 62 if case == "window of a sixteenth" else 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReadyFirstSampler(range(1000), ready, window=window)
    cache.close()
