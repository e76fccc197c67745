"""Tests for the error-feedback mechanism (jaxopt_dist/_src/error_feedback.py) and its
conservation law on every compressor built on it: with error feedback,

    what a worker contributed + its new residual == its gradient + its old residual

to one rounding; for the sparsifiers and quantizers the output is moreover the
mean over workers of the contributions, so nothing is lost, only delayed.
"""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxopt_dist as jd
from jaxopt_dist._src import comm
from jaxopt_dist._src import error_feedback as ef
from jaxopt_dist._src import quantize as q
from jaxopt_dist._src import sparsify as sp
from tests import helpers

N = 3
SHAPES = {"w": (4, 5), "b": (3,)}
EPS32 = float(np.finfo(np.float32).eps)


def _round_compressor(axis_name="data"):
    """A toy compressor: send each entry rounded to an integer."""

    def compress(updates, state, params=None, **extra_args):
        sent = jax.tree.map(jnp.round, updates)
        return comm.pmean(sent, axis_name), sent, state

    return jd.Compressor(lambda params: optax.EmptyState(), compress)


# name -> (compressor, output is the mean of the contributions)
COMPRESSORS = {
    "round": (lambda: _round_compressor(), True),
    "top_k": (lambda: sp._top_k_compressor(3, None, True, "data"), True),
    "top_k_density": (lambda: sp._top_k_compressor(None, 0.3, True, "data"), True),
    "top_k_flat": (lambda: sp._top_k_compressor(4, None, False, "data"), True),
    "threshold": (lambda: sp._threshold_compressor(0.5, 2, "data"), True),
    "random_k": (
        lambda: sp._shared_compressor(
            3, None, 0, "data", "random_k", jd.RandomKState, sp._pick_random("strided")
        ),
        True,
    ),
    "block_k": (
        lambda: sp._shared_compressor(3, None, 0, "data", "block_k", jd.BlockKState, sp._pick_block),
        True,
    ),
    "scaled_sign": (lambda: q._scaled_sign_compressor("data"), True),
    "qsgd": (lambda: q._qsgd_compressor(3, None, 0, "data"), True),
    "qsgd_buckets": (lambda: q._qsgd_compressor(1, 4, 0, "data"), True),
    "qsgd_all_gather": (lambda: q._qsgd_compressor(3, 4, 0, "data", "all_gather"), True),
    "majority_vote": (lambda: q._majority_vote_compressor("data"), False),
}


def recording(compressor: jd.Compressor) -> jd.Compressor:
    """The same compressor, also keeping its last contribution in its state."""

    def init(params):
        return compressor.init(params), jax.tree.map(jnp.zeros_like, params)

    def compress(updates, state, params=None, **extra_args):
        out, second, inner = compressor.compress(updates, state[0], params, **extra_args)
        # A compressor that returns the residual: its contribution is what it took away.
        contribution = jax.tree.map(jnp.subtract, updates, second) if compressor.returns_residual else second
        return out, second, (inner, contribution)

    return jd.Compressor(init, compress, returns_residual=compressor.returns_residual)


@functools.cache
def _one_step(name):
    """Jitted: (grads, old residuals) of N workers -> (output, contributions, new residuals)."""
    tx = jd.error_feedback(recording(COMPRESSORS[name][0]()))

    def worker(g, e):
        state = tx.init(g)._replace(residual=e)
        out, state = tx.update(g, state)
        return out, state.inner_state[1], state.residual

    return jax.jit(jax.vmap(worker, axis_name="data"))


def _tree_strategy(low, high):
    floats = st.floats(low, high, width=32, allow_subnormal=False)
    return st.fixed_dictionaries(
        {k: hnp.arrays(np.float32, (N, *s), elements=floats) for k, s in SHAPES.items()}
    )


def _check_conservation(name, g, e_old):
    out, c, e_new = _one_step(name)(g, e_old)
    for k in SHAPES:
        g64, e64 = g[k].astype(np.float64), e_old[k].astype(np.float64)
        c64, n64 = np.asarray(c[k], np.float64), np.asarray(e_new[k], np.float64)
        # x = fl(g + e); e_new = fl(x - c): two roundings of at most eps/2 each.
        x = g64 + e64
        bound = EPS32 * (np.abs(x) + np.abs(x - c64)) + 1e-30
        assert np.all(np.abs(c64 + n64 - x) <= bound), f"leaf {k}: contribution + residual != input"
        if COMPRESSORS[name][1]:
            mean_c = c64.mean(axis=0)
            scale = np.abs(c64).max(axis=0)
            # The output is the mean of the contributions, to the rounding of a sum of N terms.
            np.testing.assert_array_less(
                np.abs(np.asarray(out[k][0], np.float64) - mean_c), 8 * EPS32 * scale + 1e-30, err_msg=k
            )


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@given(g=_tree_strategy(-100.0, 100.0), e_old=_tree_strategy(-10.0, 10.0))
def test_contribution_plus_residual_is_gradient_plus_old_residual(name, g, e_old):
    _check_conservation(name, g, e_old)


@pytest.mark.parametrize("name", ["top_k", "threshold", "scaled_sign", "qsgd"])
@given(
    g=_tree_strategy(-0.0009765625, 0.0009765625),
    e_old=_tree_strategy(-1e4, 1e4),
)
def test_conservation_with_large_residuals(name, g, e_old):
    """Residuals far larger than the gradients (long-delayed mass) are still conserved."""
    _check_conservation(name, g, e_old)


def test_sent_part_of_top_k_is_exact():
    """Top-k sends entries bit for bit: the residual is exactly zero where sent."""
    rng = np.random.default_rng(0)
    g = {k: rng.standard_normal((N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    e = jax.tree.map(np.zeros_like, g)
    _, c, e_new = _one_step("top_k")(g, e)
    for k in SHAPES:
        sent = np.asarray(c[k]) != 0
        assert np.all(np.asarray(e_new[k])[sent] == 0)
        np.testing.assert_array_equal(np.asarray(c[k])[sent], g[k][sent])
        assert np.all(sent.reshape(N, -1).sum(axis=1) <= 3)


# ----------------------------------------------------------------------------
# Nothing lost, only delayed: the telescoping sum over many steps.

PUBLIC = {
    "top_k": lambda: jd.top_k(3),
    "top_k_flat": lambda: jd.top_k(4, per_leaf=False),
    "threshold": lambda: jd.threshold(0.8, capacity=2),
    "random_k": lambda: jd.random_k(2),
    "block_k": lambda: jd.block_k(2),
    "scaled_sign": lambda: jd.scaled_sign(),
    "qsgd_ef": lambda: jd.qsgd(2, error_feedback=True),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_sum_of_outputs_plus_mean_residual_is_sum_of_mean_gradients(name):
    T = 25
    rng = np.random.default_rng(1)
    grads = {k: rng.standard_normal((T, N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    tx = PUBLIC[name]()

    def worker(gs):
        def body(s, g):
            u, s = tx.update(g, s)
            return s, u

        s, us = jax.lax.scan(body, tx.init(jax.tree.map(lambda x: x[0], gs)), gs)
        return jax.tree.map(lambda x: x.sum(0), us), s.residual

    total, residual = jax.jit(jax.vmap(worker, in_axes=1, axis_name="data"))(grads)
    for k in SHAPES:
        lhs = np.asarray(total[k][0], np.float64) + np.asarray(residual[k], np.float64).mean(0)
        rhs = grads[k].astype(np.float64).mean(1).sum(0)
        np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-4)
    # ... and compression really happened: some residual is left.
    assert max(np.abs(np.asarray(r)).max() for r in residual.values()) > 0


# ----------------------------------------------------------------------------
# The wrapper itself.


def test_disabled_keeps_no_residual_and_compresses_raw_updates():
    tx = jd.error_feedback(_round_compressor(), enabled=False)
    g = {"v": np.full((2, 3), 0.4, np.float32)}

    def run(g):
        s = tx.init(g)
        outs = []
        for _ in range(3):
            u, s = tx.update(g, s)
            outs.append(u)
        return outs, s

    outs, state = jax.jit(jax.vmap(run, axis_name="data"))(g)
    assert state.residual == ()
    for u in outs:
        np.testing.assert_array_equal(u["v"], np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(state.count, [3, 3])


def test_enabled_delays_what_rounding_drops():
    """0.4 per step rounded to integers: the error-fed output sends 1 on steps 2 and 4 (0-based: 1, 3)."""
    tx = jd.error_feedback(_round_compressor())
    g = {"v": np.full((1, 1), 0.4, np.float32)}

    def run(g):
        s = tx.init(g)
        outs = []
        for _ in range(5):
            u, s = tx.update(g, s)
            outs.append(u["v"])
        return jnp.stack(outs), ef.residual(s)

    outs, res = jax.jit(jax.vmap(run, axis_name="data"))(g)
    np.testing.assert_array_equal(outs[0, :, 0], np.float32([0, 1, 0, 1, 0]))
    np.testing.assert_allclose(res["v"][0], [0.0], atol=1e-6)


def test_residual_keeps_the_updates_dtype_and_output_is_cast_back():
    def compress(updates, state, params=None, **extra_args):
        out = jax.tree.map(lambda x: comm.pmean(x.astype(jnp.float32), "data"), updates)
        return out, jax.tree.map(lambda x: x.astype(jnp.float32), updates), state

    tx = jd.error_feedback(jd.Compressor(lambda p: optax.EmptyState(), compress))
    g = {"v": jnp.ones((2, 4), jnp.bfloat16)}

    def run(g):
        s = tx.init(g)
        return tx.update(g, s)

    u, s = jax.jit(jax.vmap(run, axis_name="data"))(g)
    assert u["v"].dtype == jnp.bfloat16
    assert s.residual["v"].dtype == jnp.bfloat16
    assert s.count.dtype == jnp.int32


def test_placement_of_the_wrapper_state():
    tx = jd.error_feedback(_round_compressor())
    placement = jd.opt_state_placement(tx, {"v": jnp.zeros(3)}, mesh=helpers.make_mesh(2))
    assert placement.per_worker.residual["v"] and not placement.per_worker.count
    assert not placement.updates_per_worker


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"compressor": (lambda p: None, lambda *a: None)},
            TypeError,
            r"`compressor` must be a jaxopt_dist.Compressor",
        ),
        ({"compressor": _round_compressor(), "enabled": 1}, TypeError, r"`enabled` must be a bool"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    compressor = kwargs.pop("compressor")
    with pytest.raises(error, match=match):
        jd.error_feedback(compressor, **kwargs)


def test_reshard_rules_regroup_the_residual():
    from jaxopt_dist._src import base

    assert base.reshard_rule(jd.ErrorFeedbackState, "residual") == base.REGROUP
    assert base.reshard_rule(jd.ErrorFeedbackState, "count") is None
