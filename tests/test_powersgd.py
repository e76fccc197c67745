"""PowerSGD against a NumPy reference that loops over workers, plus its identities and contract."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxopt_dist as jd
from jaxopt_dist import PowerSGDState, communication_cost, compressed_leaves, powersgd
from jaxopt_dist._src import powersgd as psgd_mod
from jaxopt_dist._src.powersgd import orthogonalize
from tests import helpers

# Two leaves share the matrix shape (12, 6) and are batched (at rank 2 exactly on the
# size rule's boundary, 2 * 18 * 2 == 72); "c" is a conv-like kernel viewed as
# (2*3*4, 6); "b" and "small" stay dense.
SHAPES = {"w": (12, 6), "v": (12, 6), "c": (2, 3, 4, 6), "b": (6,), "small": (2, 2)}
EPS = 0.0


def _grads_seq(T, n, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in shapes.items()}


def _zeros(shapes=SHAPES):
    return {k: np.zeros(s, np.float32) for k, s in shapes.items()}


# ----------------------------------------------------------------------------
# NumPy reference.


def np_orthogonalize(x):
    """Gram-Schmidt twice per column, eps added to the norm; x is (b, n, r), float64."""
    x = np.array(x, np.float64)
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for i in range(x.shape[2]):
            v = x[b, :, i].copy()
            for _ in range(2 if i else 0):
                basis = out[b, :, :i]
                v = v - basis @ (basis.T @ v)
            d = np.linalg.norm(v) + EPS
            out[b, :, i] = v / d if d > 0 else v
    return out


def np_plan(shapes, rank, mcr):
    """Groups of compressed leaves by matrix shape, in leaf order; dense leaf indices."""
    groups, dense = {}, []
    for i, s in enumerate(shapes):
        if len(s) >= 2:
            n, m = math.prod(s[:-1]), s[-1]
            r = min(rank, n, m)
            if r * (n + m) * mcr <= n * m:
                groups.setdefault((n, m, r), []).append(i)
                continue
        dense.append(i)
    return [(n, m, r, idx) for (n, m, r), idx in groups.items()], dense


def np_powersgd(
    grads, *, rank, start_step=0, mcr=2.0, ef=True, warm=True, one=False, p0=(), q0=(), fresh=None
):
    """PowerSGD over T steps; ``grads`` is a list (steps) of lists (workers) of lists (leaves).

    Returns the outputs of every step (lists of float64 leaves) and the final residuals.
    """
    T, n = len(grads), len(grads[0])
    shapes = [g.shape for g in grads[0][0]]
    groups, dense = np_plan(shapes, rank, mcr)
    residual = [[np.zeros(s) for s in shapes] for _ in range(n)]
    p = [np.array(x, np.float64) for x in p0]
    q = [np.array(x, np.float64) for x in q0]
    outputs = []
    for t in range(T):
        corrected = [
            [grads[t][w][i].astype(np.float64) + residual[w][i] for i in range(len(shapes))] for w in range(n)
        ]
        out = [None] * len(shapes)
        if t < start_step:
            for i in range(len(shapes)):
                total = np.zeros(shapes[i])
                for w in range(n):
                    total += corrected[w][i]
                out[i] = total / n
            outputs.append(out)
            continue  # the residual stays what it was (zero)
        for i in dense:
            total = np.zeros(shapes[i])
            for w in range(n):
                total += corrected[w][i]
            out[i] = total / n
        for g, (rows, cols, r, idx) in enumerate(groups):
            mats = [np.stack([corrected[w][i].reshape(rows, cols) for i in idx]) for w in range(n)]
            if not one:
                q_in = np_orthogonalize(q[g] if warm else fresh[t][g])
                p_sum = np.zeros((len(idx), rows, r))
                for w in range(n):
                    p_sum += mats[w] @ q_in
                p_hat = np_orthogonalize(p_sum / n)
                q_sum = np.zeros((len(idx), cols, r))
                for w in range(n):
                    q_sum += np.swapaxes(mats[w], 1, 2) @ p_hat
                q_new = q_sum / n
                approx = p_hat @ np.swapaxes(q_new, 1, 2)
                if warm:
                    q[g] = q_new
            elif (t - start_step) % 2 == 0:  # Q from the stored P
                p_in = np_orthogonalize(p[g])
                q_sum = np.zeros((len(idx), cols, r))
                for w in range(n):
                    q_sum += np.swapaxes(mats[w], 1, 2) @ p_in
                p[g], q[g] = p_in, q_sum / n
                approx = p[g] @ np.swapaxes(q[g], 1, 2)
            else:  # P from the stored Q
                q_in = np_orthogonalize(q[g])
                p_sum = np.zeros((len(idx), rows, r))
                for w in range(n):
                    p_sum += mats[w] @ q_in
                p[g], q[g] = p_sum / n, q_in
                approx = p[g] @ np.swapaxes(q[g], 1, 2)
            for j, i in enumerate(idx):
                out[i] = approx[j].reshape(shapes[i])
        if ef:
            for w in range(n):
                for i in range(len(shapes)):
                    is_dense = i in dense
                    residual[w][i] = np.zeros(shapes[i]) if is_dense else corrected[w][i] - out[i]
        outputs.append(out)
    return outputs, residual


def _as_lists(tree_seq, T, n):
    leaves = jax.tree.leaves(tree_seq)
    return [[[np.asarray(x[t, w]) for x in leaves] for w in range(n)] for t in range(T)]


def _reference_for(tx_kwargs, grads_seq, params):
    """Runs np_powersgd with the JAX transform's own initial (random) factors."""
    T, n = jax.tree.leaves(grads_seq)[0].shape[:2]
    tx = powersgd(**tx_kwargs)
    inner = tx.init(params).inner_state
    rank = tx_kwargs.get("rank", 1)
    mcr = tx_kwargs.get("min_compression_rate", 2.0)
    warm = tx_kwargs.get("warm_start", True)
    fresh = None
    if not warm:
        shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
        groups, _ = np_plan(shapes, rank, mcr)
        dims = [(len(idx), r_n, r_m, r) for r_n, r_m, r, idx in groups]
        fresh = [
            [np.asarray(x) for x in psgd_mod.fresh_q(inner.key, jnp.int32(t), dims, jnp.float32)]
            for t in range(T)
        ]
    return np_powersgd(
        _as_lists(grads_seq, T, n),
        rank=rank,
        start_step=tx_kwargs.get("start_step", 0),
        mcr=mcr,
        ef=tx_kwargs.get("error_feedback", True),
        warm=warm,
        one=tx_kwargs.get("one_allreduce", False),
        p0=[np.asarray(x) for x in inner.p],
        q0=[np.asarray(x) for x in inner.q],
        fresh=fresh,
    )


def _check_against_reference(kwargs, backend, n, T=5, seed=0):
    grads_seq = _grads_seq(T, n, seed)
    params = _zeros()
    updates, _, state = helpers.run_steps(powersgd(**kwargs), grads_seq, params, backend=backend)
    want, want_res = _reference_for(kwargs, grads_seq, params)
    leaves = [np.asarray(x) for x in jax.tree.leaves(updates)]
    for t in range(T):
        for i, x in enumerate(leaves):
            np.testing.assert_allclose(x[t], want[t][i], rtol=1e-5, atol=1e-5, err_msg=f"step {t} leaf {i}")
    if kwargs.get("error_feedback", True):
        for w in range(n):
            for i, e in enumerate(jax.tree.leaves(state.residual)):
                np.testing.assert_allclose(np.asarray(e)[w], want_res[w][i], rtol=1e-5, atol=1e-5)


# (config, backend): every config on one backend at least, the main ones on both
# (compilation dominates the run time of these tests).
CONFIGS = [
    ("warm", {"rank": 2}, "vmap"),
    ("warm", {"rank": 2}, "shard_map"),
    ("cold", {"rank": 2, "warm_start": False}, "vmap"),
    (
        "start_step_no_ef",
        {"rank": 3, "start_step": 2, "error_feedback": False, "min_compression_rate": 1.0},
        "shard_map",
    ),
    ("one_allreduce", {"rank": 2, "one_allreduce": True, "start_step": 1}, "vmap"),
    ("one_allreduce", {"rank": 2, "one_allreduce": True, "start_step": 1}, "shard_map"),
]


@pytest.mark.parametrize("name,kwargs,backend", CONFIGS, ids=[f"{c[0]}-{c[2]}" for c in CONFIGS])
def test_matches_numpy_reference(name, kwargs, backend):
    _check_against_reference(kwargs, backend, n=3)


@pytest.mark.parametrize("n,backend", [(1, "vmap"), (2, "shard_map"), (8, "shard_map")])
def test_matches_numpy_reference_worker_counts(n, backend):
    _check_against_reference({"rank": 1, "one_allreduce": n == 2}, backend, n=n, T=3, seed=n)


# ----------------------------------------------------------------------------
# Identities.


def _low_rank_mean_grads(T, n, shapes, true_rank, seed=0):
    """Per-worker full-rank gradients whose mean over workers has rank ``true_rank``."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, s in shapes.items():
        rows, cols = math.prod(s[:-1]), s[-1]
        mean = rng.standard_normal((T, rows, true_rank)) @ rng.standard_normal((T, true_rank, cols))
        noise = rng.standard_normal((T, n, rows, cols))
        noise -= noise.mean(axis=1, keepdims=True)  # sums to zero over workers
        out[k] = (mean[:, None] + noise).reshape(T, n, *s).astype(np.float32)
    return out


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_rank_at_least_true_rank_of_mean_reproduces_mean(backend, n=3):
    shapes = {"w": (8, 6), "c": (2, 4, 6)}
    grads = _low_rank_mean_grads(4, n, shapes, true_rank=2, seed=n)
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    # Error feedback on: residuals are local minus mean, sum to zero, and leave the mean unchanged.
    updates, _, _ = helpers.run_steps(powersgd(2, min_compression_rate=1.0), grads, params, backend=backend)
    assert all(compressed_leaves(params, rank=2, min_compression_rate=1.0).values())
    helpers.assert_trees_close(updates, jax.tree.map(lambda g: g.mean(axis=1), grads), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_full_rank_equals_mean(backend):
    grads = _grads_seq(1, 4, seed=3, shapes={"w": (5, 3), "c": (2, 2, 3)})
    grads = jax.tree.map(lambda g: g[0], grads)
    tx = powersgd(rank=3, min_compression_rate=0.0)
    got = helpers.run_transform(tx, grads, backend=backend)
    helpers.assert_trees_close(got, jax.tree.map(lambda g: g.mean(0), grads), rtol=1e-5, atol=1e-5)


def test_one_allreduce_full_rank_square_equals_mean(backend="shard_map"):
    # With square matrices and rank = n, both half steps project onto the whole space.
    grads = _grads_seq(4, 3, seed=5, shapes={"w": (4, 4)})
    tx = powersgd(rank=4, min_compression_rate=0.0, one_allreduce=True)
    updates, _, _ = helpers.run_steps(tx, grads, {"w": np.zeros((4, 4), np.float32)}, backend=backend)
    helpers.assert_trees_close(updates, jax.tree.map(lambda g: g.mean(axis=1), grads), rtol=1e-5, atol=1e-5)


def test_before_start_step_dense_mean_and_zero_residual(backend="shard_map"):
    grads = _grads_seq(3, 4, seed=7)
    updates, _, state = helpers.run_steps(powersgd(1, start_step=3), grads, _zeros(), backend=backend)
    helpers.assert_trees_close(updates, jax.tree.map(lambda g: g.mean(axis=1), grads), rtol=1e-6, atol=1e-6)
    for e in jax.tree.leaves(state.residual):
        assert not np.any(np.asarray(e))
    assert int(np.asarray(state.inner_state.count)[0]) == 3


def test_replicas_bit_identical_after_30_steps():
    shapes = {"w": (6, 5), "c": (2, 3, 5), "b": (5,)}
    grads = _grads_seq(30, 8, seed=11, shapes=shapes)
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    tx = optax.chain(
        powersgd(2, one_allreduce=True, start_step=3, min_compression_rate=1.0), jd.sgd(0.05, 0.9)
    )
    # shard_map: out_specs=P() proves the updates and params replicated; state q/p are replicated too.
    _, final, state = helpers.run_steps(tx, grads, params, backend="shard_map")
    inner = state[0].inner_state
    helpers.assert_replicas_equal(inner.q)
    helpers.assert_replicas_equal(inner.p)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(final))


# ----------------------------------------------------------------------------
# Error feedback and numerics.


_EF_STEPS: dict[int, object] = {}


def _ef_step(rank):
    """One jitted vmapped update from a given residual (cached: hypothesis calls it often)."""
    if rank not in _EF_STEPS:
        tx = powersgd(rank)

        def step(g, e, p):
            state = tx.init(p)._replace(residual=e)
            out, new = tx.update(g, state, p)
            return out, new.residual

        _EF_STEPS[rank] = jax.jit(jax.vmap(step, in_axes=(0, 0, None), axis_name="data"))
    return _EF_STEPS[rank]


@settings(max_examples=10, deadline=None)
@given(
    rank=st.integers(1, 2),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_conserves_what_each_worker_had(rank, scale, seed):
    # approximation + new residual == gradient + old residual, per worker (dense leaves: residual 0).
    rng = np.random.default_rng(seed)
    n = 3
    g = {k: (scale * rng.standard_normal((n, *s))).astype(np.float32) for k, s in SHAPES.items()}
    e = {k: (scale * rng.standard_normal((n, *s))).astype(np.float32) for k, s in SHAPES.items()}
    out, res = _ef_step(rank)(g, e, _zeros())
    helpers.assert_replicas_equal(out)
    out = jax.tree.map(lambda x: np.asarray(x)[0].astype(np.float64), out)
    res = jax.tree.map(np.asarray, res)
    dense = {k: not v for k, v in compressed_leaves(_zeros(), rank=rank).items()}
    assert not all(dense.values())
    for k in SHAPES:
        for w in range(n):
            if dense[k]:
                assert not np.any(res[k][w])
            else:
                x = g[k][w].astype(np.float64) + e[k][w]
                np.testing.assert_allclose(
                    out[k] + res[k][w].astype(np.float64), x, rtol=1e-5, atol=1e-5 * scale
                )


def test_zero_factor_is_redrawn_instead_of_sticking():
    # Step 0's gradient is exactly zero, so the aggregated factor is zero; warm start
    # alone would then keep P = M Q = 0 on every later step.
    grads = _grads_seq(3, 2, seed=9, shapes={"w": (8, 6)})
    grads["w"][0] = 0.0
    params = {"w": np.zeros((8, 6), np.float32)}
    for kwargs in ({}, {"one_allreduce": True}):
        updates, _, _ = helpers.run_steps(powersgd(1, **kwargs), grads, params, backend="vmap")
        w = np.asarray(updates["w"])
        assert np.all(w[0] == 0) and np.all(np.isfinite(w)) and np.abs(w[2]).sum() > 0, kwargs


@pytest.mark.parametrize("rank", (1, 2, 4, 8, 16, 32))
def test_orthogonalize_is_orthonormal_for_ill_conditioned_inputs(rank):
    rng = np.random.default_rng(rank)
    # Singular values spread over 4 decades (a warm-started factor), tiny overall scale.
    u, _ = np.linalg.qr(rng.standard_normal((2, 64, rank)))
    v, _ = np.linalg.qr(rng.standard_normal((2, rank, rank)))
    x = 1e-6 * u @ (np.logspace(0, -4, rank)[:, None] * v)
    q = np.asarray(orthogonalize(jnp.asarray(x, jnp.float32)), np.float64)
    gram = np.swapaxes(q, 1, 2) @ q
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(rank), gram.shape), atol=2e-5)
    # The same span as the input, the first column along the input's; zero columns stay zero (no NaN).
    # float32 Gram-Schmidt on a condition number of 1e4 leaves about eps * 1e4 ~ 6e-4 outside the span
    # in the weakest direction (the exact figure depends on XLA's fusion, hence the margin).
    np.testing.assert_allclose(u @ (np.swapaxes(u, 1, 2) @ q), q, atol=1e-3)
    first = x[:, :, 0] / np.linalg.norm(x[:, :, 0], axis=1, keepdims=True)
    np.testing.assert_allclose(q[:, :, 0], first, atol=1e-5)
    z = np.asarray(orthogonalize(jnp.zeros((1, 5, 2))))
    assert np.all(z == 0)


def test_matrix_view_flattens_leading_dims_and_batches_same_shapes():
    params = {"w": jnp.zeros((6, 5)), "v": jnp.zeros((6, 5)), "c": jnp.zeros((2, 3, 4, 5)), "b": jnp.zeros(5)}
    assert compressed_leaves(params, rank=1) == {"w": True, "v": True, "c": True, "b": False}
    # At rank 2 a (6, 5) matrix would need 2 * 11 * 2 = 44 > 30 entries: dense.
    assert compressed_leaves(params, rank=2) == {"w": False, "v": False, "c": True, "b": False}
    inner = powersgd(1).init(params).inner_state
    # Groups in leaf order ("b", "c", "v", "w"): c -> (24, 5); v and w -> (6, 5), batched.
    assert [q.shape for q in inner.q] == [(1, 5, 1), (2, 5, 1)]
    assert inner.p == ()
    # Rank is clamped to min(n, m) and the size rule uses the clamped rank: (4, 3) at rank 3
    # would need 3 * 7 * 2 > 12 entries, so it stays dense; with rate 0 it is compressed.
    assert compressed_leaves({"x": jnp.zeros((4, 3))}, rank=8) == {"x": False}
    assert compressed_leaves({"x": jnp.zeros((4, 3))}, rank=8, min_compression_rate=0.0) == {"x": True}
    assert powersgd(8, min_compression_rate=0.0).init({"x": jnp.zeros((4, 3))}).inner_state.q[0].shape == (
        1,
        3,
        3,
    )
    # One matmul per product and compressed matrix (the matrices are never stacked into a batch,
    # which would copy them): 2 (P, Q) x 3 compressed leaves at rank 1, and ``P Q^T`` is no
    # matmul (a sum of outer products, fused into its consumers).
    grads = jax.tree.map(lambda x: jnp.ones((2, *x.shape)), params)
    tx = powersgd(1)
    jaxpr = jax.make_jaxpr(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data"))(grads)
    assert str(jaxpr).count("dot_general") == 6


@pytest.mark.parametrize(
    "kwargs,calls",
    [({}, 2), ({"one_allreduce": True}, 1), ({"start_step": 5}, 1), ({"warm_start": False}, 2)],
)
def test_one_collective_for_all_ps_and_one_for_all_qs(kwargs, calls):
    # Two groups of compressed leaves plus dense leaves: still two all-reduces per step
    # (one with one_allreduce; one before start_step), each of one flat buffer.
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    cost = communication_cost(powersgd(2, **kwargs), params, num_workers=4, steps=1)
    assert cost.calls == calls
    for c in cost.steps[0].collectives:
        assert c.kind == "all_reduce" and len(c.operands) == 1 and len(c.operands[0][0]) == 1


# ----------------------------------------------------------------------------
# optax contract.


def test_no_recompilation_unknown_extra_args_and_stable_dtypes():
    tx = powersgd(2, one_allreduce=True, start_step=1)
    params = _zeros()
    grads = jax.tree.map(lambda x: x[0], _grads_seq(1, 2))
    traces = []

    @jax.jit
    def step(g, s):
        traces.append(1)
        return jax.vmap(lambda g, s: tx.update(g, s, params, foo=1.0, bar=None), axis_name="data")(g, s)

    state = jax.vmap(tx.init)(jax.tree.map(lambda x: np.broadcast_to(x, (2, *x.shape)), params))
    dtypes = jax.tree.map(lambda x: x.dtype, state)
    for _ in range(3):
        _, state = step(grads, state)
    assert len(traces) == 1
    assert jax.tree.map(lambda x: x.dtype, state) == dtypes
    abstract = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(
        lambda x: (x.shape[1:], x.dtype), state
    )
    assert isinstance(state.inner_state, PowerSGDState)


def test_bf16_updates_keep_dtype():
    grads = {k: v.astype(jnp.bfloat16) for k, v in jax.tree.map(lambda x: x[0], _grads_seq(1, 2)).items()}
    tx = powersgd(2)

    def step(g):
        p = jax.tree.map(jnp.zeros_like, g)
        return tx.update(g, tx.init(p), p)

    out, state = helpers.run_on_workers(step, grads, backend="vmap", replicated=(True, False))
    helpers.assert_dtypes_equal(out, grads)
    assert all(q.dtype == jnp.bfloat16 for q in state.inner_state.q)


def test_chained_before_sgd_and_adam():
    grads = _grads_seq(3, 2, seed=2)
    # The local optimizer sees PowerSGD's (replicated) output: compare with doing it by hand.
    ref_updates, _, _ = helpers.run_steps(powersgd(2), grads, _zeros(), backend="vmap")
    for local, backend in ((jd.sgd(0.1, 0.9), "vmap"), (jd.adam(1e-2), "shard_map")):
        tx = optax.chain(powersgd(2), local)
        updates, _, _ = helpers.run_steps(tx, grads, _zeros(), backend=backend)
        state = local.init(_zeros())
        for t in range(3):
            want, state = local.update(jax.tree.map(lambda x: x[t], ref_updates), state, _zeros())
            helpers.assert_trees_close(jax.tree.map(lambda x: x[t], updates), want, rtol=1e-5, atol=1e-6)


def test_multi_steps_and_inject_hyperparams():
    grads = _grads_seq(4, 2, seed=4)
    # MultiSteps: the inner PowerSGD sees the mean of every 2 mini-batches.
    tx = optax.MultiSteps(optax.chain(powersgd(2), jd.sgd(1.0)), every_k_schedule=2)
    updates, _, _ = helpers.run_steps(tx.gradient_transformation(), grads, _zeros(), backend="vmap")
    averaged = jax.tree.map(lambda g: (g[0::2] + g[1::2]) / 2, grads)
    ref, _, _ = helpers.run_steps(optax.chain(powersgd(2), jd.sgd(1.0)), averaged, _zeros(), backend="vmap")
    for t in range(2):
        helpers.assert_trees_close(
            jax.tree.map(lambda x: x[2 * t], updates), jax.tree.map(lambda x: 0 * x[t], ref)
        )
        helpers.assert_trees_close(
            jax.tree.map(lambda x: x[2 * t + 1], updates), jax.tree.map(lambda x: x[t], ref), rtol=1e-5
        )
    # inject_hyperparams: the shape-setting ints must be static.
    injected = optax.inject_hyperparams(
        powersgd, static_args=("rank", "start_step", "seed", "min_compression_rate")
    )(rank=2)
    got, _, state = helpers.run_steps(injected, grads, _zeros(), backend="vmap")
    want, _, _ = helpers.run_steps(powersgd(2), grads, _zeros(), backend="vmap")
    # eps arrives as a traced array instead of a Python 0.0, so XLA may fuse differently and
    # roundings compound through the warm-started factors over the steps.
    helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(np.asarray(state.hyperparams["eps"])[0]) == 0.0


# ----------------------------------------------------------------------------
# Bad inputs.


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"`rank` must be an int >= 1; got 0"):
        powersgd(0)
    with pytest.raises(TypeError, match=r"`rank` must be a Python int"):
        powersgd(1.5)
    with pytest.raises(ValueError, match=r"`start_step` must be an int >= 0"):
        powersgd(start_step=-1)
    with pytest.raises(ValueError, match=r"`min_compression_rate` must be a finite float >= 0"):
        powersgd(min_compression_rate=-1.0)
    with pytest.raises(TypeError, match=r"`min_compression_rate` must be a Python float"):
        powersgd(min_compression_rate="2")
    with pytest.raises(ValueError, match=r"`one_allreduce=True` needs `warm_start=True`"):
        powersgd(one_allreduce=True, warm_start=False)
    with pytest.raises(TypeError, match=r"`warm_start` must be a bool"):
        powersgd(warm_start=1)
    with pytest.raises(TypeError, match=r"`error_feedback` must be a bool"):
        powersgd(error_feedback="yes")
    with pytest.raises(TypeError, match=r"`seed` must be a Python int"):
        powersgd(seed=1.0)
    with pytest.raises(ValueError, match=r"`eps` must lie in \[0, inf\)"):
        powersgd(eps=-1e-3)
    with pytest.raises(TypeError, match=r"`axis_name` must be a hashable name or a tuple"):
        powersgd(axis_name=["data"])
    tx = powersgd(axis_name="batch")
    with pytest.raises(jd.UnboundAxisError, match=r"`powersgd` communicates over the axis 'batch'"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(jnp.ones((2, 4, 4)))
