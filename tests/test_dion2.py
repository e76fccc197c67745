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
from tests.test_muon import check_local_inner_in_diloco, collective_names, run_sharded_model

P = jax.sharding.PartitionSpec

# (4, 6): fan_out > fan_in, the input features are selected; (6, 3): the outputs; (5, 5): square.
SHAPES = {"a": (4, 6), "b": (4, 6), "c": (4, 6), "d": (6, 3), "sq": (5, 5), "bias": (5,), "scale": ()}
MATRICES = ("a", "b", "c", "d", "sq")
STEPS = 2
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


def _full_momentum(state, counts, n):
    """The per-worker momentum shards put back together, then the (replicated) remainder: one
    array per group of ``counts`` matrices, ``(count, a, b)`` (a field skips the groups it has
    no matrix of)."""
    owned, rest = iter(state[0].momentum), iter(state[0].momentum_rest)
    full = []
    for c in counts:
        parts = []
        if c // n:
            x = np.asarray(next(owned))
            parts.append(x.reshape(-1, *x.shape[2:]))
        if c % n:
            r = np.asarray(next(rest))
            parts.append(r[0] if r.ndim == 4 else r)  # stacked by vmap, or placed replicated
        full.append(np.concatenate(parts))
    return full


def _local_steps(tx, grads_seq, params):
    """``tx`` for ``T`` steps of one worker's gradients ``(T, ...)``, outside any mapped axis."""

    def steps(grads_seq, p):
        def body(carry, g):
            state, p = carry
            u, state = tx.update(g, state, p)
            return (state, optax.apply_updates(p, u)), u

        (state, p), updates = jax.lax.scan(body, (tx.init(p), p), grads_seq)
        return updates, p, state

    return jax.jit(steps)(grads_seq, params)


SPECS = {
    "a": P(None, "fsdp"),
    "b": P("fsdp", None),
    "c": P(),
    "d": P("fsdp", None),
    "sq": P(),
    "bias": P(),
    "scale": P(),
}


@pytest.mark.parametrize("backend,n", [("vmap", 1), ("sharded_model", 3)])
def test_matches_numpy_reference(backend, n):
    """The NumPy reference under vmap, and under shard_map through data_parallel_step with the
    matrices sharded over a model axis ("fsdp"); with n=1 also axis_name=None: the W=1 numbers.
    (Three workers: the (4, 6) group fills one slot each, the others are remainders.)"""
    params = _params()
    grads = helpers.grads_seq(1, STEPS, n, SHAPES)
    kw = dict(fraction=0.5, ef_decay=0.9, wd=0.05)
    opts = dict(fraction=0.5, ef_decay=0.9, weight_decay=0.05)
    tx = jd.dion2(0.02, num_workers=n, **opts)
    ref_updates, ref_final, ref_mom = _np_dion2(grads, params, lr=0.02, **kw)
    if backend == "sharded_model":
        final, state = run_sharded_model(tx, grads, params, SPECS)
        updates = ref_updates
    else:
        updates, final, state = helpers.run_steps(tx, grads, params, backend=backend)
    if n == 1:
        local = _local_steps(
            jd.dion2(0.02, axis_name=None, **opts), jax.tree.map(lambda x: x[:, 0], grads), params
        )
        helpers.assert_trees_close(local[:2], (updates, final), rtol=1e-6, atol=1e-7)
        helpers.assert_trees_close(
            local[2][0].momentum, tuple(x[0] for x in state[0].momentum), rtol=1e-6, atol=1e-7
        )
        assert state[0].momentum_rest == () == local[2][0].momentum_rest  # W = 1: no remainder
    helpers.assert_trees_close(updates, ref_updates, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final, ref_final, rtol=1e-5, atol=1e-6)
    # Groups: (4, 6) x3, (6, 3), (5, 5). Each worker keeps count // n matrices of each; the
    # count % n others are replicated; a field skips the groups it has no matrix of.
    owned = [(n, c // n, *s) for c, s in zip((3, 1, 1), ((4, 6), (3, 6), (5, 5))) if c // n]
    assert [x.shape for x in state[0].momentum] == owned
    if n == 3:  # placed replicated by data_parallel_step (P()): not stacked over the workers
        assert [x.shape for x in state[0].momentum_rest] == [(1, 3, 6), (1, 5, 5)]
    full = _full_momentum(state, (3, 1, 1), n)
    np.testing.assert_allclose(full[0][:3], np.stack([ref_mom[k] for k in "abc"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full[1][0], ref_mom["d"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full[2][0], ref_mom["sq"], rtol=1e-5, atol=1e-6)


def test_fraction_one_is_muon_momentum_scalar_optimizer_schedule():
    """fraction=1: every slice selected, B_t = mu B_{t-1} + G_t, update -lr_t sqrt(out/in) NS(B_t);
    the other leaves go to ``scalar_optimizer``; the learning rate follows its schedule."""
    n, mu = 2, 0.9
    lr = optax.linear_schedule(0.1, 0.02, STEPS)
    shapes = {"w": (6, 4), "bias": (5,), "scale": ()}
    params = _params(shapes)
    grads = helpers.grads_seq(2, STEPS, n, shapes)
    tx = jd.dion2(
        lr, fraction=1.0, ef_decay=mu, weight_decay=0.0, scalar_optimizer=optax.sgd(0.1), num_workers=n
    )
    updates, _, state = helpers.run_steps(tx, grads, params, backend="vmap")
    for k in ("bias", "scale"):
        np.testing.assert_allclose(updates[k], -0.1 * grads[k].mean(axis=1), rtol=1e-5, atol=1e-7)
    b = np.zeros((6, 4))
    for t in range(STEPS):
        b = mu * b + grads["w"][t].astype(np.float64).mean(axis=0)
        want = -float(lr(t)) * math.sqrt(4 / 6) * _np_ns(b)
        np.testing.assert_allclose(updates["w"][t], want, rtol=1e-5, atol=1e-6)
    # The state keeps mu * B_t (the selected slices decayed), in the (fan_out, fan_in) layout.
    # One matrix on two workers: the remainder, replicated (stacked over the workers by vmap).
    assert state[0].momentum == ()
    np.testing.assert_allclose(state[0].momentum_rest[0][0, 0], mu * b.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state[0].momentum_rest[0][1, 0], mu * b.T, rtol=1e-5, atol=1e-6)


def test_one_reduce_scatter_one_all_gather_none_when_local():
    n = 3
    params = {k: jnp.asarray(v) for k, v in _params().items()}
    f, g = helpers.update_program(jd.dion2(0.02, num_workers=n), params, n, with_params=True)
    compiled = helpers.count_collectives(helpers.compiled_text(f, g, params))
    assert compiled == {"reduce-scatter": 1, "all-gather": 1}
    assert collective_names(jd.dion2(0.02, axis_name=None), params) == []


def test_all_gather_carries_the_fraction():
    """The all-gather returns k slices (and k indices) per owned matrix, not whole matrices; the
    count % n remainder matrices travel whole in the dense chunk, so the reduce-scatter carries
    exactly the gradient (no padding)."""
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
    # (4, 6) x3: one owned per worker, k = ceil(0.25 * 4) = 1 slice of 6; (6, 3) and (5, 5): one
    # matrix each, the remainder (no owned slots). Dense chunk: (5 + 1 + 24 + 18 + 25) / 2 -> 37.
    assert sizes["gathered"] == [(1, 1, 6), (0, 1, 6), (0, 2, 5), (1, 1), (0, 1), (0, 2), (37,)]
    # Priced from the traced update: the reduce-scatter is the gradient's bytes, no padding.
    size = 3 * 24 + 18 + 25 + 6  # 121 entries: 1 of padding in the dense chunk on 2 workers
    cost = jd.communication_cost(tx, params, num_workers=n)
    scattered = (n * (24 + 37)) * 4  # the reduce-scatter's buffer
    gathered = n * (6 + 1 + 37) * 4
    assert size + 1 == n * (24 + 37)
    assert cost.sent_bytes == (n - 1) / n * scattered + (n - 1) / n * gathered


def test_bad_inputs():
    with pytest.raises(ValueError, match="needs `num_workers`"):
        jd.dion2(0.01)
    with pytest.raises(ValueError, match="axis_name=None runs on one worker"):
        jd.dion2(0.01, axis_name=None, num_workers=2)
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


def test_local_dion2_as_diloco_inner_optimizer_with_muloco_aggregate():
    inner = jd.dion2(0.01, ns_steps=2, axis_name=None)  # 2 Newton-Schulz steps: a smaller program
    check_local_inner_in_diloco(inner, aggregate=jd.statistical_quantize(2))


def test_per_worker_params_with_a_bound_axis_are_rejected():
    mesh = helpers.make_mesh(2)
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)  # noqa: E731
    step = jd.data_parallel_step(loss, jd.dion2(0.01, num_workers=2), mesh=mesh, per_worker_params=True)
    with pytest.raises(ValueError, match="per-worker parameters.*axis_name=None for a local Dion2"):
        p, s = step.init({"w": jnp.ones((4, 3))})
        step(p, s, {"x": np.ones((4, 4), np.float32)})


def test_state_cannot_be_regrouped_for_another_worker_count():
    params = {k: jnp.asarray(v) for k, v in _params().items()}
    tx = jd.dion2(0.01, num_workers=2)
    inner, tail = tx.init(params)
    state = (inner._replace(momentum=tuple(jnp.stack([x, x]) for x in inner.momentum)), tail)
    with pytest.raises(ValueError, match=r"Dion2State\.momentum"):
        jd.reshard_opt_state(state, tx, params, num_workers=3)
    assert "num_workers" in jd.Dion2State.RESHARD_NOTE  # why, and what to do instead


def test_inject_hyperparams_and_bf16_contract():
    params = {"w": jnp.ones((4, 6)), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x]) * jnp.arange(x.size).reshape(x.shape)[None], params)
    make = optax.inject_hyperparams(jd.dion2, static_args=("num_workers", "fraction", "ns_steps"))
    tx = make(learning_rate=0.1, num_workers=2)
    want = jd.dion2(0.1, num_workers=2)
    run = lambda t, g: jax.vmap(lambda g: t.update(g, t.init(params), params)[0], axis_name="data")(g)  # noqa: E731
    got, expected = jax.jit(lambda g: (run(tx, g), run(want, g)))(grads)
    helpers.assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)  # eps as an array rounds apart
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _params({"a": (4, 6), "bias": (5,)}).items()}
    helpers.check_bf16_contract(jd.dion2(0.01, num_workers=2), bf16, steps=2, workers=2, replicated=True)
