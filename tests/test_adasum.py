"""adasum against a NumPy loop over the documented tree; identities, typing, HLO."""

from __future__ import annotations

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxopt_dist as jd
from jaxopt_dist import adasum, adasum_tree
from tests import helpers

SHAPES = {"w": (5, 3), "b": (4,), "s": ()}
WORKERS = (1, 2, 3, 5, 6, 8)
METHODS = ("butterfly", "halving")


def _worker_grads(n, seed=0, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n, *s)).astype(dtype) for k, s in shapes.items()}


# ----------------------------------------------------------------------------
# NumPy reference.


def np_pair(a, b):
    """AdaSum of two vectors in float64; a vector of zero norm gets coefficient 1."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dot, na, nb = np.dot(a, b), np.dot(a, a), np.dot(b, b)
    ca = 1.0 - dot / (2.0 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb > 0 else 1.0
    return ca * a + cb * b


def np_adasum_vectors(xs):
    """The documented order: fold workers p..n-1 into 0..r-1, then pair consecutive groups."""
    n = len(xs)
    p = 1
    while 2 * p <= n:
        p *= 2
    y = [np.asarray(x, np.float64) for x in xs[:p]]
    for j in range(n - p):
        y[j] = np_pair(xs[j], xs[p + j])
    while len(y) > 1:  # round s: worker i pairs with i XOR 2**s, lower index first
        y = [np_pair(y[i], y[i + 1]) for i in range(0, len(y), 2)]
    return y[0]


def np_adasum(stacked):
    """Per leaf: flatten each worker's leaf, combine, reshape."""
    out = {}
    for k, g in stacked.items():
        n = g.shape[0]
        out[k] = np_adasum_vectors([g[i].reshape(-1) for i in range(n)]).reshape(g.shape[1:])
    return out


def _vmapped_update(tx):
    """A jitted vmapped update from a fresh state (compiled once per input shape)."""
    return jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data"))


# ----------------------------------------------------------------------------
# Tree order and reference.


def test_tree_order_documented():
    assert adasum_tree(1) == 0
    assert adasum_tree(2) == (0, 1)
    assert adasum_tree(3) == ((0, 2), 1)
    assert adasum_tree(5) == (((0, 4), 1), (2, 3))
    assert adasum_tree(6) == (((0, 4), (1, 5)), (2, 3))
    assert adasum_tree(8) == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    with pytest.raises(ValueError, match=r"`num_workers` must be an int >= 1"):
        adasum_tree(0)


def test_tree_takes_num_workers_and_the_deprecated_n():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = adasum_tree(num_workers=6)
    assert new == adasum_tree(6)
    with pytest.warns(DeprecationWarning, match=r"`n` is deprecated .* use `num_workers` instead") as record:
        old = adasum_tree(n=6)
    assert old == new
    assert record[0].filename == __file__  # the warning points at the caller
    with pytest.raises(TypeError, match=r"Pass `num_workers` only"):
        adasum_tree(6, n=6)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", WORKERS)
def test_matches_reference(backend, method, n):
    grads = _worker_grads(n, seed=n)
    got = helpers.run_transform(adasum(method=method), grads, backend=backend)
    helpers.assert_trees_close(got, np_adasum(grads), rtol=1e-5, atol=1e-6)


def test_order_matters_and_is_the_documented_one():
    # Guard against a reference that cannot fail: another tree gives other numbers.
    g = _worker_grads(3, seed=7)
    other = {
        k: np_pair(np_pair(v[0].ravel(), v[1].ravel()), v[2].ravel()).reshape(v.shape[1:])
        for k, v in g.items()
    }
    got = helpers.run_transform(adasum(), g, backend="vmap")
    assert not np.allclose(got["w"], other["w"], rtol=1e-3)
    helpers.assert_trees_close(got, np_adasum(g), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# Identities.


def _orthogonal(n, width=3):
    """Worker i is non-zero only on its own block of coordinates."""
    rng = np.random.default_rng(n)
    x = np.zeros((n, n * width), np.float32)
    for i in range(n):
        x[i, i * width : (i + 1) * width] = rng.standard_normal(width)
    return {"v": x}


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", (3, 8))
def test_orthogonal_inputs_give_their_sum_exactly(backend, method, n):
    g = _orthogonal(n)
    got = helpers.run_transform(adasum(method=method), g, backend=backend)
    helpers.assert_trees_equal(got, {"v": g["v"].sum(axis=0)})


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", (2, 5, pytest.param(8, marks=pytest.mark.slow)))  # 8: 18 s each, traced
def test_identical_inputs_give_that_input_exactly(method, n):
    one = _worker_grads(1, seed=3)
    for dtype in (np.float32, jnp.bfloat16):
        g = {k: np.repeat(v, n, axis=0).astype(dtype) for k, v in one.items()}
        got = helpers.run_transform(adasum(method=method), g, backend="vmap")
        helpers.assert_trees_equal(got, {k: v[0] for k, v in g.items()})


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_one_worker_is_identity(backend, method):
    g = _worker_grads(1, seed=5)
    got = helpers.run_transform(adasum(method=method), g, backend=backend)
    helpers.assert_trees_equal(got, {k: v[0] for k, v in g.items()})


_VMAPPED = {m: _vmapped_update(adasum(method=m)) for m in METHODS}


@pytest.mark.parametrize("method", METHODS)
@given(
    seed=st.integers(0, 2**16),
    exponent=st.integers(-20, 20),
    scale=st.floats(-50.0, 50.0).filter(lambda c: abs(c) > 1e-2),
)
def test_scale_equivariance(method, seed, exponent, scale):
    run = _VMAPPED[method]
    g = _worker_grads(6, seed=seed)
    base_out = run(g)
    # Powers of two scale every intermediate exactly.
    c = np.float32(2.0**exponent)
    helpers.assert_trees_equal(run({k: v * c for k, v in g.items()}), {k: v * c for k, v in base_out.items()})
    c = np.float32(scale)
    helpers.assert_trees_close(
        run({k: v * c for k, v in g.items()}),
        {k: np.asarray(v) * c for k, v in base_out.items()},
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("method", METHODS)
def test_zero_and_tiny_norms_are_finite(method):
    run = _VMAPPED[method]
    zeros = {k: np.zeros_like(v) for k, v in _worker_grads(6).items()}
    helpers.assert_trees_equal({k: v[0] for k, v in run(zeros).items()}, {k: v[0] for k, v in zeros.items()})
    # One worker with zero updates: the pair sum is the other vector, exactly.
    g = _worker_grads(2, seed=1)
    g = {k: np.stack([np.zeros_like(v[0]), v[1]]) for k, v in g.items()}
    got = _vmapped_update(adasum(method=method))(g)
    helpers.assert_trees_equal({k: v[0] for k, v in got.items()}, {k: v[1] for k, v in g.items()})
    # Vanishing vectors (squares underflow float32): finite, and close to the sum.
    tiny = {k: v * np.float32(1e-25) for k, v in _worker_grads(6, seed=2).items()}
    out = run(tiny)
    for k, v in out.items():
        assert np.all(np.isfinite(np.asarray(v))), k


# ----------------------------------------------------------------------------
# Low precision.


@pytest.mark.parametrize("method", METHODS)
def test_float16_norms_do_not_overflow(method):
    # |x|^2 ~ 64 * 200^2 = 2.6e6 overflows float16 (max 65504); the float32 dots do not.
    rng = np.random.default_rng(0)
    g = {"v": (200.0 * rng.uniform(0.5, 1.0, (4, 64))).astype(np.float16)}
    got = helpers.run_transform(adasum(method=method), g, backend="vmap")
    assert got["v"].dtype == jnp.float16
    assert np.all(np.isfinite(np.asarray(got["v"], np.float32)))
    # Vectors travel in float16 between the two rounds: a few float16 roundings.
    helpers.assert_trees_close(got, np_adasum(g), rtol=3e-3, atol=0)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_mixed_dtype_tree(backend):
    g = _worker_grads(3, seed=4)
    g["b"] = g["b"].astype(jnp.bfloat16)
    got = helpers.run_transform(adasum(method="halving"), g, backend=backend)
    helpers.assert_dtypes_equal(got, {k: v[0] for k, v in g.items()})
    ref = np_adasum({k: np.asarray(v, np.float32) for k, v in g.items()})
    helpers.assert_trees_close(
        {k: got[k] for k in ("w", "s")}, {k: ref[k] for k in ("w", "s")}, rtol=1e-5, atol=1e-6
    )
    # bfloat16 has 8 bits of mantissa; two rounds of bf16 rounding.
    np.testing.assert_allclose(np.asarray(got["b"], np.float32), ref["b"], rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------
# Replicated outputs under shard_map, over many steps; chain order.


def _scan_training(tx):
    """Per-worker fn: init, one step, then ``lax.scan`` over the other steps. Returns final params and updates.

    Run with ``replicated=True``: under shard_map the params carry and the
    outputs must be typed invariant (out_specs=P()), under vmap they are
    checked bit-identical across workers. The first step runs outside the
    scan so that the state carry starts with the placement an update gives it.
    """

    def fn(g_seq, p):
        def step(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), u

        first = jax.tree.map(lambda x: x[0], g_seq)
        rest = jax.tree.map(lambda x: x[1:], g_seq)
        carry, u0 = step((p, tx.init(p)), first)
        (p, _), us = jax.lax.scan(step, carry, rest)
        return p, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), u0, us)

    return fn


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "backend,method,n",
    [
        *[
            ("shard_map", m, k)
            for m, k in (("butterfly", 8), ("halving", 8), ("halving", 6), ("butterfly", 3))
        ],
        ("vmap", "butterfly", 3),
        # The same under vmap at 6 and 8 workers: slow (the shard_map cases above run everywhere).
        *[
            pytest.param("vmap", m, k, marks=_SLOW)
            for m, k in (("butterfly", 8), ("halving", 8), ("halving", 6))
        ],
    ],
)
def test_replicas_bit_identical_after_30_steps(backend, method, n):
    T = 30
    rng = np.random.default_rng(0)
    grads = {k: rng.standard_normal((n, T, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params0 = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    # AdaSumByDeltaWeight with momentum: per-worker optimizer state, replicated updates.
    tx = optax.chain(jd.sgd(0.05, momentum=0.9), adasum(method=method))
    p, us = helpers.run_on_workers(
        _scan_training(tx), grads, backend=backend, replicated=True, shared=(params0,)
    )
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(p))
    assert np.asarray(us["w"]).shape == (T, 5, 3)


def np_chain_order(grads_seq, lr, mu, by):
    """``by="grad"``: momentum on the AdaSum of gradients; ``"delta"``: AdaSum of local momentum steps."""
    T, n = grads_seq["w"].shape[:2]
    keys = sorted(grads_seq)
    p = {k: np.zeros(grads_seq[k].shape[2:]) for k in keys}
    bufs = [{k: np.zeros_like(p[k]) for k in keys} for _ in range(n + 1)]
    for t in range(T):
        g = {k: grads_seq[k][t] for k in keys}
        if by == "grad":
            a = np_adasum(g)
            for k in keys:
                bufs[n][k] = mu * bufs[n][k] + a[k]
                p[k] = p[k] - lr * bufs[n][k]
        else:
            steps = {}
            for k in keys:
                rows = []
                for i in range(n):
                    bufs[i][k] = mu * bufs[i][k] + g[k][i]
                    rows.append(-lr * bufs[i][k])
                steps[k] = np.stack(rows)
            a = np_adasum(steps)
            for k in keys:
                p[k] = p[k] + a[k]
    return p


@pytest.mark.parametrize("method", METHODS)
def test_chain_order_by_grad_vs_by_delta_weight(method):
    T, n, lr, mu = 6, 4, 0.1, 0.9
    rng = np.random.default_rng(1)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params0 = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    stacked = {k: np.swapaxes(v, 0, 1) for k, v in grads.items()}
    by_grad = optax.chain(adasum(method=method), jd.sgd(lr, momentum=mu))
    by_delta = optax.chain(jd.sgd(lr, momentum=mu), adasum(method=method))
    got = {}
    for name, tx in (("grad", by_grad), ("delta", by_delta)):
        p, _ = helpers.run_on_workers(_scan_training(tx), stacked, backend="shard_map", shared=(params0,))
        ref = np_chain_order(grads, lr, mu, name)
        helpers.assert_trees_close(p, ref, rtol=1e-4, atol=1e-5)
        got[name] = p
    # With momentum the two orders are different algorithms.
    assert not np.allclose(got["grad"]["w"], got["delta"]["w"], rtol=1e-2)


@pytest.mark.parametrize("method", METHODS)
def test_hierarchical_on_2x4_mesh(method):
    mesh = jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    grads = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in _worker_grads(8, seed=9).items()}
    tx = optax.chain(jd.all_reduce(axis_name="local"), adasum(axis_name="node", method=method))

    def body(g):
        g = jax.tree.map(lambda x: x[0, 0], g)
        u, _ = tx.update(g, tx.init(g))
        return u

    spec = jax.P("node", "local")
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=jax.P(), check_vma=True)
    got = jax.jit(fn)(jax.device_put(grads, jax.sharding.NamedSharding(mesh, spec)))
    node_means = {k: v.astype(np.float64).mean(axis=1) for k, v in grads.items()}
    helpers.assert_trees_close(got, np_adasum(node_means), rtol=1e-5, atol=1e-6)


def test_hierarchical_data_parallel_step():
    # data_parallel_step over both axes of a (node, local) mesh: worker (a, b) gets shard 4a + b.
    mesh = jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 3)).astype(np.float32)
    y = rng.standard_normal(32).astype(np.float32)
    lr = 0.1
    tx = optax.chain(jd.all_reduce(axis_name="local"), adasum(axis_name="node"), jd.sgd(lr))
    step = jd.data_parallel_step(
        lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2), tx, mesh=mesh, axis_name=("node", "local")
    )
    params, state = step.init(jnp.ones(3, jnp.float32))
    params, state, _ = step(params, state, {"x": x, "y": y})
    w = np.ones(3)
    grads = [2 * xs.T @ (xs @ w - ys) / len(ys) for xs, ys in zip(np.split(x, 8), np.split(y, 8))]
    node_means = [np.mean(grads[4 * a : 4 * a + 4], axis=0) for a in range(2)]
    np.testing.assert_allclose(params, w - lr * np_pair(*node_means), rtol=1e-5, atol=1e-6)


def test_data_parallel_step_with_replicated_params_and_bf16():
    mesh = helpers.make_mesh(8)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    batch = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)}

    def loss(w, b):
        pred = b["x"].astype(w.dtype) @ w
        return jnp.mean((pred.astype(jnp.float32) - b["y"]) ** 2)

    for dtype in (jnp.float32, jnp.bfloat16):
        tx = optax.chain(adasum(method="halving"), jd.sgd(0.05))
        step = jd.data_parallel_step(loss, tx, mesh=mesh)  # replicated params: updates must be invariant
        params, state = step.init(jnp.zeros(4, dtype))
        losses = []
        for _ in range(5):
            params, state, metrics = step(params, state, batch)
            losses.append(float(metrics["loss"]))
        assert params.dtype == dtype
        assert losses[-1] < losses[0]
        assert not step.placement(jnp.zeros(4, dtype)).updates_per_worker


# ----------------------------------------------------------------------------
# Collectives in the compiled program.


def _compiled(tx, n, shapes):
    mesh = helpers.make_mesh(n)
    g = {k: jnp.ones((n, *s), jnp.float32) for k, s in shapes.items()}
    g = jax.device_put(g, jax.sharding.NamedSharding(mesh, jax.P("data")))

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(g))[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P(), check_vma=True)
    return helpers.compiled_text(fn, g)


def _permute_rows(text):
    return sorted(
        int(m.group(1))
        for m in re.finditer(r"= f32\[(\d+),\d+\]\{[^}]*\} collective-permute(?:-start)?\(", text)
    )


@pytest.mark.parametrize(
    "n,method,expected,calls,rows",
    [
        (8, "butterfly", {"collective-permute": 3, "all-gather": 1}, 4, [8, 8, 8]),
        (8, "halving", {"collective-permute": 3, "all-reduce": 4, "all-gather": 1}, 10, [1, 2, 4]),
        (6, "butterfly", {"collective-permute": 3, "all-gather": 1}, 4, [4, 4, 4]),
        (6, "halving", {"collective-permute": 3, "all-reduce": 3, "all-gather": 1}, 8, [1, 2, 4]),
    ],
)
def test_collectives_per_step(n, method, expected, calls, rows):
    # Leaves of one dtype share one buffer: counts do not grow with the number of leaves. The
    # levels of the tree run in one loop: each level's permute (and, halving, its pmax over the
    # group) in a branch of its own, the group's psum of the dot products once in the loop's body.
    shapes = {"w": (16, 3), "b": (5,), "s": ()}
    text = _compiled(adasum(method=method), n, shapes)
    assert helpers.count_collectives(text) == expected
    # Run per step: a permute per level, and halving's pmax and psum per level, and the gather.
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    assert jd.communication_cost(adasum(method=method), params, num_workers=n).calls == calls
    # Buffer rows sent per round: all p rows (butterfly) vs halving p/2, p/4, ... (and the fold).
    assert _permute_rows(text) == rows


# ----------------------------------------------------------------------------
# optax contract and bad inputs.


def test_optax_contract():
    tx = adasum()
    g = _worker_grads(4)
    params = {k: v[0] for k, v in g.items()}
    abstract = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    assert abstract == optax.EmptyState()
    traces = []

    @jax.jit
    def run(g):
        traces.append(1)
        return jax.vmap(lambda x: tx.update(x, tx.init(x), None, unknown_extra=1.0)[0], axis_name="data")(g)

    first = run(g)
    second = run({k: v + 1 for k, v in g.items()})
    helpers.assert_replicas_equal(first)
    first, second = ({k: v[0] for k, v in out.items()} for out in (first, second))
    assert len(traces) == 1
    helpers.assert_trees_close(first, np_adasum(g), rtol=1e-5, atol=1e-6)
    assert not np.allclose(first["w"], second["w"])
    # Inside MultiSteps: the accumulated gradient is combined every k-th step.
    multi = optax.MultiSteps(optax.chain(adasum(), jd.sgd(1.0)), every_k_schedule=2)

    def two_steps(x):
        s = multi.init(x)
        u1, s = multi.update(x, s, x)
        u2, s = multi.update(x, s, x)
        return u1, u2

    u1, u2 = jax.vmap(two_steps, axis_name="data")(g)
    helpers.assert_trees_close(u1, jax.tree.map(jnp.zeros_like, u1), rtol=0, atol=0)
    helpers.assert_trees_close(
        {k: v[0] for k, v in u2.items()}, {k: -v for k, v in np_adasum(g).items()}, rtol=1e-5, atol=1e-6
    )


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"`method` must be one of \('butterfly', 'halving'\)"):
        adasum(method="ring")
    with pytest.raises(TypeError, match=r"`axis_name` must be a hashable name or a tuple"):
        adasum(axis_name=["data"])
    tx = adasum()
    with pytest.raises(TypeError, match=r"adasum: the updates must be floating point"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(jnp.ones((2, 3), jnp.int32))


# ----------------------------------------------------------------------------
# Horovod's acceptance cases (orthogonal, parallel, stability, stability_2 of its
# Adasum tests) with its draws: one np.random.seed(2) stream, float32 then
# float16, in the order its tests draw. Worker i holds column i of an (N, n)
# matrix Q rounded to the dtype; the result must match the sum (orthogonal
# columns) or the mean (parallel columns) of the rounded columns with Horovod's
# criterion |expected - got| / |expected| / 100 < eps(dtype). The rounded
# columns are not exactly orthogonal or parallel, so the exact AdaSum of them
# misses that expectation by up to 0.64 of the allowance (8 workers, float32,
# "parallel", 147 entries); the result must also meet the criterion against
# the exact AdaSum (the float64 reference), which is the error of the
# implementation alone.


def _horovod_close(dtype, expected, got):
    got = np.asarray(got, np.float64)
    ratio = np.linalg.norm(expected - got) / np.linalg.norm(expected) / 100.0
    return ratio < np.finfo(dtype).eps, ratio


def _horovod_draws(case, n, rs, dtype):
    """Horovod's columns ``(N, n)`` of one case and dtype, unrounded, from the stream ``rs``."""
    if case == "orthogonal":
        return [
            np.linalg.qr(rs.normal(0.0, 1.0, (size, n)))[0] for size in (20 * n - 17, 2 * n + 1, n + 2, 2**19)
        ]
    if case == "parallel":
        return [
            rs.normal(0.0, 1.0, (size, 1)) @ rs.normal(0.0, 1.0, (n, 1)).T
            for size in (20 * n - 13, 2 * n + 1, n + 2, 2**19)
        ]
    info = np.finfo(dtype)
    if case == "stability":  # entries near the smallest normal, many subnormal
        return [rs.normal(0.0, float(info.tiny), (1024, 1)) @ rs.normal(0.0, 1.0, (n, 1)).T]
    # "stability_2": parallel columns from the smallest normal to sqrt(max), shuffled
    lo, hi = float(info.tiny), math.sqrt(float(info.max))
    a = rs.normal(0.0, 1.0, (1024, 1))
    r = np.array([[hi ** ((i + 1) / n) * lo ** ((n - i - 1) / n)] for i in range(n)])
    rs.shuffle(r)
    return [a @ r.T]


def _horovod_case(case, n, dtype, *, big=True):
    """Returns ``[(per-worker rounded columns (n, N), expected)]``; ``big=False`` leaves out the 2**19 rows."""
    rs = np.random.RandomState(2)
    for d in (np.float32, np.float16):  # one stream for both dtypes, as Horovod draws them
        qs = _horovod_draws(case, n, rs, d)
        if d == dtype:
            break
    out = []
    for q in qs:
        if q.shape[0] > 2**16 and not big:
            continue
        q64 = q.astype(dtype).astype(np.float64)
        out.append((q64.T.astype(dtype), q64.sum(axis=1) / (1 if case == "orthogonal" else n)))
    return out


HOROVOD_CASES = [
    (case, dtype)
    for case in ("orthogonal", "parallel", "stability", "stability_2")
    for dtype in (np.float32, np.float16)
]


def _check_horovod_case(run, case, n, dtype, *, big):
    for q, expected in _horovod_case(case, n, dtype, big=big):
        got = run({"v": q})["v"]
        assert got.dtype == dtype
        helpers.assert_replicas_equal(got)
        ok, ratio = _horovod_close(dtype, expected, got[0])
        assert ok, (case, q.shape, ratio / np.finfo(dtype).eps)
        ok, ratio = _horovod_close(dtype, np_adasum_vectors(list(q)), got[0])
        assert ok, ("against the exact AdaSum", case, q.shape, ratio / np.finfo(dtype).eps)


@pytest.mark.parametrize(("case", "dtype"), HOROVOD_CASES)
@pytest.mark.parametrize("n", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", METHODS)
def test_horovod_acceptance_cases(case, dtype, n, method):
    _check_horovod_case(_VMAPPED[method], case, n, dtype, big=False)


@pytest.mark.slow  # 8 workers: 17-24 s each, mostly tracing the butterfly's program
@pytest.mark.parametrize("method", METHODS)
def test_horovod_parallel_case_on_8_workers(method):
    # The hardest case: the 147-entry columns' mean is 1/30 of their norms; float32
    # dot products, coefficients and pair sums miss the criterion by 1.16x.
    _check_horovod_case(_VMAPPED[method], "parallel", 8, np.float32, big=False)


@pytest.mark.slow  # 2^19 entries per worker
@pytest.mark.parametrize(("case", "dtype"), [c for c in HOROVOD_CASES if c[0] in ("orthogonal", "parallel")])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("method", METHODS)
def test_horovod_acceptance_cases_big(case, dtype, n, method):
    (big,) = [(q, expected) for q, expected in _horovod_case(case, n, dtype) if q.shape[1] > 2**16]
    got = _VMAPPED[method]({"v": big[0]})["v"]
    helpers.assert_replicas_equal(got)
    ok, ratio = _horovod_close(dtype, big[1], got[0])
    assert ok, (case, ratio / np.finfo(dtype).eps)


@pytest.mark.parametrize(
    ("case", "dtype"), [("stability", np.float16), ("stability_2", np.float32), ("stability_2", np.float16)]
)
@pytest.mark.parametrize("method", METHODS)
def test_horovod_stability_cases_under_shard_map(case, dtype, method):
    ((q, expected),) = _horovod_case(case, 4, dtype)
    got = helpers.run_transform(adasum(method=method), {"v": q}, backend="shard_map")
    ok, ratio = _horovod_close(dtype, expected, got["v"])
    assert ok, (case, dtype, ratio)


# ----------------------------------------------------------------------------
# The compensated sums and the exact scalings.


def _ill_conditioned_dot(n, cond_exp, rng):
    """float32 ``x, y`` whose dot product is about ``2^-cond_exp`` of ``sum |x_i y_i|`` (Ogita, Rump, Oishi's GenDot)."""
    half = n // 2
    e = np.round(rng.uniform(0, cond_exp / 2, half))
    e[0], e[-1] = cond_exp / 2, 0
    x = np.zeros(n)
    y = np.zeros(n)
    x[:half] = rng.uniform(-1, 1, half) * 2.0**e
    y[:half] = rng.uniform(-1, 1, half) * 2.0**e
    x[:half], y[:half] = x[:half].astype(np.float32), y[:half].astype(np.float32)
    for i, ei in zip(range(half, n), np.round(np.linspace(cond_exp / 2, 0, n - half))):
        x[i] = np.float32(rng.uniform(-1, 1) * 2.0**ei)
        y[i] = np.float32((rng.uniform(-1, 1) * 2.0**ei - math.fsum(x[:i] * y[:i])) / x[i])
    perm = rng.permutation(n)
    return x[perm].astype(np.float32), y[perm].astype(np.float32)


@pytest.mark.parametrize("shape", [(1000,), (8, 125), (3, 7)])
def test_compensated_dots_against_float64(shape):
    from jaxopt_dist._src import adasum as impl

    rng = np.random.default_rng(0)
    n = math.prod(shape)
    for cond_exp in (0, 24, 48):
        x, y = _ill_conditioned_dot(n, cond_exp, rng)
        got = np.asarray(
            jax.jit(impl._three_dots)(jnp.asarray(x).reshape(shape), jnp.asarray(y).reshape(shape))
        )
        assert got.shape == (2, 3)
        x64, y64 = x.astype(np.float64), y.astype(np.float64)  # products exact in float64
        for k, (u, v) in enumerate(((x64, y64), (x64, x64), (y64, y64))):
            want = math.fsum(u * v)
            err = abs(float(got[0, k]) + float(got[1, k]) - want)
            # Dot2's bound: the float32 rounding of a sum of twice the precision.
            bound = 2.0**-46 * abs(want) + 4 * n * 2.0**-48 * math.fsum(np.abs(u * v))
            assert err <= bound, (cond_exp, k, err, bound)
            assert got[0, k] == np.float32(got[0, k] + got[1, k])  # renormalised
        if cond_exp == 24:  # a plain float32 sum loses most digits
            want = math.fsum(x64 * y64)
            err = abs(float(got[0, 0]) + float(got[1, 0]) - want)
            assert 100 * err < abs(float(np.sum(x * y, dtype=np.float32)) - want) > 1e-4 * abs(want)


def test_compensated_dots_of_equal_vectors_agree_bitwise():
    from jaxopt_dist._src import adasum as impl

    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 301)).astype(np.float32))
    got = np.asarray(jax.jit(impl._three_dots)(x, x))
    assert got[0, 0] == got[0, 1] == got[0, 2] and got[1, 0] == got[1, 1] == got[1, 2]


@pytest.mark.parametrize("e", [-160, -149, -126, -30, 0, 30, 140, 200])
def test_power_of_two_scalings_are_exact_on_subnormals(e):
    # XLA:CPU flushes subnormal float32 operands and results to zero; the
    # scalings read and build them from their bits and round once, as float64.
    from jaxopt_dist._src import adasum as impl

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x[np.isfinite(x)], np.float32([0.0, -0.0, 1e-45, -3e-39, 1.17e-38])])
    got = np.asarray(impl._normalize(jnp.asarray(x)[None], jnp.asarray(e))[0], np.float64)
    want = np.ldexp(x.astype(np.float64), e)
    normal = (np.abs(want) >= np.finfo(np.float32).tiny) & (np.abs(want) <= np.finfo(np.float32).max)
    np.testing.assert_array_equal(got[normal], want[normal])
    y = rng.uniform(-2.0, 2.0, 20000).astype(np.float32)
    got = np.asarray(impl._denormalize(jnp.asarray(y)[None], jnp.asarray(e))[0])
    with np.errstate(over="ignore"):
        want = np.ldexp(y.astype(np.float64), e).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    exps = impl._frexp_exponent(impl._magnitude_bits(jnp.asarray(x)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(exps)[x != 0], np.frexp(x[x != 0].astype(np.float64))[1])
