"""Tests for the exact sort-free top-k selection (jaxopt_dist/_src/selection.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxopt_dist._src import selection as sel

# ----------------------------------------------------------------------------
# NumPy reference: the integer keys of the magnitudes, a stable sort.


def np_keys(x):
    x = np.asarray(x)
    bits = x.dtype.itemsize * 8
    as_int = x.view({16: np.int16, 32: np.int32, 64: np.int64}[bits]).astype(np.int64)
    return as_int & (2 ** (bits - 1) - 1)


def np_top(x, k):
    """Indices of the k largest magnitudes (NaN above inf, ties: lower index), increasing."""
    return np.sort(np.argsort(-np_keys(x), kind="stable")[:k])


def run(x, k):
    f = jax.jit(lambda v: sel.top_indices(v, k))
    return np.asarray(f(jnp.asarray(x)))


def make(d, kind, seed=0):
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    if kind == "ties":
        x = np.round(x)
    if kind == "zeros":
        x[: d // 2] = 0.0
        x[-3:] = -0.0
    if kind == "specials":
        x[d // 3], x[d // 2], x[d // 4] = np.inf, -np.inf, np.nan
    return x


# ----------------------------------------------------------------------------
# Against the reference.


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "specials"])
@pytest.mark.parametrize(
    "d, k",
    [
        (1, 1),
        (10, 3),
        (33, 32),
        (1000, 7),
        (5000, 40),
        (40001, 3),
        (70001, 701),
        (200000, 2000),
        (150000, 40000),
        (150000, 70000),
    ],
)
def test_top_indices_match_reference(d, k, kind):
    """Direct and sampled paths, ties / zeros / inf / NaN, sizes off the 32-bit words."""
    np.testing.assert_array_equal(run(make(d, kind), k), np_top(make(d, kind), k))


@pytest.mark.parametrize("n", [1, 37, sel._SCAN_MIN - 1, sel._SCAN_MIN, 3 * sel._SCAN_MIN + 5])
def test_running_sum_and_max_match_numpy(n):
    """Both sides of the length where the running reductions become log-depth scans."""
    x = np.random.default_rng(n).integers(-50, 50, n).astype(np.int32)
    got_sum = jax.jit(sel._running_sum)(x)
    got_max = jax.jit(sel._running_max)(x)
    np.testing.assert_array_equal(got_sum, np.cumsum(x))
    np.testing.assert_array_equal(got_max, np.maximum.accumulate(x))


def test_sampled_path_is_planned_for_large_leaves():
    assert sel._sample_plan(70001, 701) is not None
    assert sel._sample_plan(200000, 2000) is not None
    assert sel._sample_plan(1000, 7) is None  # small: all entries at once
    assert sel._sample_plan(150000, 40000) is not None
    assert sel._sample_plan(150000, 70000) is None  # k too large for the sample to help


def _sampled_count(x, k):
    keys = sel.magnitude_keys(jnp.asarray(x))
    rank, room = sel._sample_plan(x.shape[0], k)
    t = sel._kth_key(keys[:: sel._STRIDE], rank)
    return int(jnp.sum(keys >= t)), room


@pytest.mark.parametrize("case", ["too_few_pass", "too_many_pass"])
def test_a_misleading_sample_still_gives_the_exact_answer(case):
    """The sampled threshold passes fewer than k (or more than the room): the whole leaf is used."""
    d, k = 200000, 2000
    x = make(d, "normal", seed=3) * 1e-3
    if case == "too_few_pass":
        x[:: sel._STRIDE] = 1.0 + np.arange(x[:: sel._STRIDE].shape[0])  # the sample sees only large ones
    else:
        x[:: sel._STRIDE] = 0.0  # the sample sees only zeros
    count, room = _sampled_count(x, k)
    assert count < k if case == "too_few_pass" else count > room
    np.testing.assert_array_equal(run(x, k), np_top(x, k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keys(dtype):
    x = np.asarray(jnp.asarray(make(70001, "ties", seed=5) * 3.3, dtype))
    np.testing.assert_array_equal(run(x, 701), np_top(x, 701))


def test_float64_keys():
    with jax.enable_x64(True):
        x = make(5000, "specials", seed=6).astype(np.float64) * 1e-300
        np.testing.assert_array_equal(run(x, 40), np_top(x, 40))


def test_keys_order_as_magnitudes():
    x = np.array([0.0, -0.0, 1e-45, -1.0, 2.0, -np.inf, np.nan, 3.0], np.float32)
    keys = np.asarray(sel.magnitude_keys(jnp.asarray(x)))
    assert keys[0] == keys[1] == 0
    assert list(np.argsort(keys[1:], kind="stable") + 1) == [1, 2, 3, 4, 7, 5, 6]


# ----------------------------------------------------------------------------
# Properties, with the sample used on small vectors too.


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, 2.0, -3.0, 1e-30]), min_size=1, max_size=300),
    frac=st.floats(0.0, 1.0),
    sampled=st.booleans(),
)
def test_any_ties_and_any_k(values, frac, sampled):
    x = np.asarray(values, np.float32)
    k = max(1, int(frac * x.shape[0]))
    with pytest.MonkeyPatch.context() as mp:  # undone after each example
        mp.setattr(sel, "_SAMPLED_MIN", 0 if sampled else 1 << 16)
        mp.setattr(sel, "_STRIDE", 3)
        got = run(x, k)
    np.testing.assert_array_equal(got, np_top(x, k))
    assert np.all(np.diff(got) > 0)
