"""Dion2: a NumPy loop over workers as reference; the momentum split over the workers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import comm, orthonormal
from tests import helpers

P = jax.sharding.PartitionSpec

# (4, 6): fan_out > fan_in, the input features are selected; (6, 3): the outputs; (5, 5): square.
SHAPES = {"a": (4, 6), "b": (4, 6), "c": (4, 6), "d": (6, 3), "sq": (5, 5), "bias": (5,), "scale": ()}
MATRICES = ("a", "b", "c", "d", "sq")
STEPS = 3
COEFFS = orthonormal.resolve_ns_coeffs("standard", 5, caller="test")


def _params(shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _np_ns(x, eps=1e-8):
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in COEFFS:
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if transposed else x


def _np_dion2(grads_seq, params, *, lr, fraction, ef_decay, wd, b1=0.9, b2=0.95, eps=1e-8):
    """NumPy Dion2 (float64): mean over the workers, then the reference's rule per matrix, AdamW otherwise.

    Momentum kept in the reference's orientation: rows are the selectable slices."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mom = {}
    adam = {k: (np.zeros_like(p[k]), np.zeros_like(p[k])) for k in p if k not in MATRICES}
    T = grads_seq["a"].shape[0]
    updates = []
    for t in range(T):
        u_t = {}
        for k in p:
            g = np.mean(np.asarray(grads_seq[k][t], np.float64), axis=0)  # loop over workers: the mean
            if k in MATRICES:
                fan_in, fan_out = g.shape
                outputs = fan_out <= fan_in
                g = g.T if outputs else g
                m = mom.get(k, np.zeros_like(g)) + g
                kk = max(1, math.ceil(fraction * min(fan_in, fan_out)))
                sel = np.argsort(-np.abs(m).sum(axis=1), kind="stable")[:kk]
                o = _np_ns(m[sel].copy())
                m[sel] *= ef_decay
                mom[k] = m
                full = np.zeros_like(m)
                full[sel] = o
                full = full.T if outputs else full
                u = -lr * wd * p[k] - lr * math.sqrt(fan_out / fan_in) * full
            else:
                m1, v1 = adam[k]
                m1 = b1 * m1 + (1 - b1) * g
                v1 = b2 * v1 + (1 - b2) * g * g
                adam[k] = (m1, v1)
                mh, vh = m1 / (1 - b1 ** (t + 1)), v1 / (1 - b2 ** (t + 1))
                u = -lr * (mh / (np.sqrt(vh) + eps) + wd * p[k])
            u_t[k] = u
            p[k] = p[k] + u
        updates.append(u_t)
    return {k: np.stack([u[k] for u in updates]) for k in p}, p, mom


def _full_momentum(state, groups_keys, n):
    """The per-worker momentum shards put back together: one array per group, ``(count, a, b)``."""
    return [np.asarray(x).reshape(-1, *x.shape[2:]) for x in state[0].momentum]


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_numpy_reference(backend, n):
    params = _params()
    grads = helpers.grads_seq(1, STEPS, n, SHAPES)
    kw = dict(fraction=0.5, ef_decay=0.9, wd=0.05)
    tx = jd.dion2(0.02, fraction=0.5, ef_decay=0.9, weight_decay=0.05, num_workers=n)
    updates, final, state = helpers.run_steps(tx, grads, params, backend=backend)
    ref_updates, ref_final, ref_mom = _np_dion2(grads, params, lr=0.02, **kw)
    helpers.assert_trees_close(updates, ref_updates, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final, ref_final, rtol=1e-5, atol=1e-6)
    # Groups: (4, 6) x3, (6, 3), (5, 5). Each worker keeps ceil(count / n) matrices of each.
    mom = state[0].momentum
    assert [x.shape for x in mom] == [(n, -(-3 // n), 4, 6), (n, 1, 3, 6), (n, 1, 5, 5)]
    full = _full_momentum(state, None, n)
    np.testing.assert_allclose(full[0][:3], np.stack([ref_mom[k] for k in "abc"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full[1][0], ref_mom["d"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full[2][0], ref_mom["sq"], rtol=1e-5, atol=1e-6)


def test_fraction_one_is_muon_momentum():
    """fraction=1: every slice selected, B_t = mu B_{t-1} + G_t, update -lr sqrt(out/in) NS(B_t)."""
    n, mu, lr = 2, 0.9, 0.1
    shapes = {"w": (6, 4)}
    params = _params(shapes)
    grads = helpers.grads_seq(2, STEPS, n, shapes)
    tx = jd.dion2(lr, fraction=1.0, ef_decay=mu, weight_decay=0.0, num_workers=n)
    updates, _, state = helpers.run_steps(tx, grads, params, backend="vmap")
    b = np.zeros((6, 4))
    for t in range(STEPS):
        b = mu * b + grads["w"][t].astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(updates["w"][t], -lr * math.sqrt(4 / 6) * _np_ns(b), rtol=1e-5, atol=1e-6)
    # The state keeps mu * B_t (the selected slices decayed), in the (fan_out, fan_in) layout.
    np.testing.assert_allclose(state[0].momentum[0][0, 0], mu * b.T, rtol=1e-5, atol=1e-6)


def test_one_reduce_scatter_one_all_gather():
    n = 3
    params = {k: jnp.asarray(v) for k, v in _params().items()}
    tx = jd.dion2(0.02, num_workers=n)
    mesh = helpers.make_mesh(n)
    g = jax.device_put(
        jax.tree.map(lambda x: jnp.ones((n, *x.shape)), params), jax.sharding.NamedSharding(mesh, P("data"))
    )

    def body(g, p):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(p), p)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=True)
    assert helpers.count_collectives(helpers.compiled_text(f, g, params)) == {
        "reduce-scatter": 1,
        "all-gather": 1,
    }


def test_all_gather_carries_the_fraction():
    """The all-gather returns k slices (and k indices) per owned matrix, not whole matrices."""
    n = 2
    params = {k: jnp.asarray(v) for k, v in _params().items()}
    sizes = {}
    real = comm.all_gather_packed

    def spy(arrays, axis_name, *, caller=None):
        sizes["gathered"] = [tuple(x.shape) for x in arrays]
        return real(arrays, axis_name, caller=caller)

    tx = jd.dion2(0.02, fraction=0.25, num_workers=n)
    grads = jax.tree.map(lambda x: jnp.ones((n, *x.shape)), params)
    try:
        comm.all_gather_packed = spy
        step = jax.vmap(lambda g, p: tx.update(g, tx.init(p), p)[0], in_axes=(0, None), axis_name="data")
        jax.eval_shape(step, grads, params)
    finally:
        comm.all_gather_packed = real
    # (4, 6): k = ceil(0.25 * 4) = 1 slice of 6; (6, 3) oriented (3, 6): k = 1; (5, 5): k = 2.
    assert sizes["gathered"] == [(2, 1, 6), (1, 1, 6), (1, 2, 5), (2, 1), (1, 1), (1, 2), (3,)]


def test_scalar_optimizer_and_schedules():
    n = 2
    params = _params()
    grads = helpers.grads_seq(3, 2, n, SHAPES)
    sched = optax.linear_schedule(0.05, 0.01, 2)
    tx = jd.dion2(
        sched, fraction=0.5, ef_decay=0.9, weight_decay=0.0, scalar_optimizer=optax.sgd(0.1), num_workers=n
    )
    updates, _, _ = helpers.run_steps(tx, grads, params, backend="vmap")
    for k in ("bias", "scale"):
        np.testing.assert_allclose(updates[k], -0.1 * grads[k].mean(axis=1), rtol=1e-5, atol=1e-7)
    ref, _, _ = _np_dion2(grads, params, lr=0.05, fraction=0.5, ef_decay=0.9, wd=0.0)
    np.testing.assert_allclose(updates["a"][0], ref["a"][0], rtol=1e-5, atol=1e-6)  # step 0: lr 0.05
    assert not np.allclose(updates["a"][1], 0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="needs `num_workers`"):
        jd.dion2(0.01)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            jd.dion2(0.01, fraction=bad, num_workers=2)
    with pytest.raises(ValueError, match="ef_decay"):
        jd.dion2(0.01, ef_decay=1.5, num_workers=2)
    with pytest.raises(ValueError, match="adjust_lr"):
        jd.dion2(0.01, adjust_lr="spectral", num_workers=2)
    with pytest.raises(ValueError, match="preconditioning"):
        jd.dion2(0.01, preconditioning="x", num_workers=2)
    with pytest.raises(TypeError, match="scalar_optimizer"):
        jd.dion2(0.01, scalar_optimizer="adamw", num_workers=2)
    with pytest.raises(ValueError, match="unknown `ns_coeffs` preset"):
        jd.dion2(0.01, ns_coeffs="polar", num_workers=2)
    params = {k: jnp.asarray(v) for k, v in _params().items()}
    tx = jd.dion2(0.01, num_workers=3)
    grads = jax.tree.map(lambda x: jnp.ones((2, *x.shape)), params)
    with pytest.raises(ValueError, match="built with num_workers=3 but runs on 2"):
        jax.vmap(lambda g, p: tx.update(g, tx.init(p), p), in_axes=(0, None), axis_name="data")(grads, params)
    tx2 = jd.dion2(0.01, num_workers=2)
    with pytest.raises(ValueError, match="params"):
        jax.vmap(lambda g: tx2.update(g, tx2.init(g)), axis_name="data")(grads)
    with pytest.raises(comm.UnboundAxisError):
        tx2.update(params, tx2.init(params), params)


def test_sharded_model_equals_replicated():
    """Parameters sharded over a model axis ("fsdp"): the same numbers as replicated ones."""
    import jaxopt_dist as jd

    d_in, hidden, d_out, rows = 8, 16, 8, 16
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, d_out)) / np.sqrt(hidden)).astype(np.float32),
    }
    specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}
    batches = [
        {
            "x": rng.standard_normal((rows, d_in)).astype(np.float32),
            "y": rng.standard_normal((rows, d_out)).astype(np.float32),
        }
        for _ in range(2)
    ]

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"][None]) @ p["w2"] - b["y"]) ** 2)

    def train(mesh, param_specs):
        step = jd.data_parallel_step(loss, jd.dion2(0.05, num_workers=2), mesh=mesh, param_specs=param_specs)
        p, s = step.init(params)
        for b in batches:
            p, s, _ = step(p, s, b)
        return p

    sharded = train(jax.make_mesh((2, 4), ("data", "fsdp")), specs)
    replicated = train(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), None)
    helpers.assert_trees_close(jax.device_get(sharded), jax.device_get(replicated), rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_and_bf16_contract():
    params = {"w": jnp.ones((4, 6)), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x]) * jnp.arange(x.size).reshape(x.shape)[None], params)
    make = optax.inject_hyperparams(jd.dion2, static_args=("num_workers", "fraction", "ns_steps"))
    tx = make(learning_rate=0.1, num_workers=2)
    want = jd.dion2(0.1, num_workers=2)
    run = lambda t: jax.vmap(lambda g: t.update(g, t.init(params), params)[0], axis_name="data")(grads)  # noqa: E731
    helpers.assert_trees_close(run(tx), run(want), rtol=1e-5, atol=1e-6)  # eps as an array rounds apart
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _params().items()}
    helpers.check_bf16_contract(jd.dion2(0.01, num_workers=2), bf16, steps=2, workers=2, replicated=True)
