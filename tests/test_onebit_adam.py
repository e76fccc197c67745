"""1-bit Adam (``onebit_adam``) against a NumPy loop over workers with both residuals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import onebit_adam as ob
from tests import helpers
from tests import test_checkpoint as ckpt

SHAPES = {"w": (5, 7), "b": (3,), "s": ()}


# ----------------------------------------------------------------------------
# NumPy reference (float32, as DeepSpeed computes it).


def _pm(x):
    return np.where(x >= 0, np.float32(1), np.float32(-1))


def _scale(x):
    return np.float32(np.linalg.norm(x.astype(np.float64)) / np.sqrt(x.size))


def np_onebit_adam(grads_seq, params, *, lr, freeze, b1, b2, eps, wd, n):
    """Dense warm-up for ``freeze`` updates, then the two-sided 1-bit all-reduce of the momentum."""
    T = next(iter(grads_seq.values())).shape[0]
    names = list(params)
    p = {k: np.asarray(v, np.float32).copy() for k, v in params.items()}
    m = {k: np.zeros(v.shape, np.float32) for k, v in params.items()}
    v = {k: np.zeros(v.shape, np.float32) for k, v in params.items()}
    size = {k: ob.padded_size(max(1, int(np.prod(params[k].shape))), n) for k in names}
    we = {k: np.zeros((n, size[k]), np.float32) for k in names}
    se = {k: np.zeros((n, size[k] // n), np.float32) for k in names}
    ups = []
    for t in range(T):
        u_t = {}
        for k in names:
            g = grads_seq[k][t].astype(np.float32)  # (n, ...)
            if t < freeze:
                gm = g.mean(axis=0)
                m[k] = b1 * m[k] + (1 - b1) * gm
                v[k] = b2 * v[k] + (1 - b2) * gm * gm
            elif n == 1:
                m[k] = b1 * m[k] + (1 - b1) * g[0]
            else:
                P, d = size[k], m[k].size
                chunk = P // n
                sent_sign = np.zeros((n, P), np.float32)
                sent_scale = np.zeros(n, np.float32)
                for i in range(n):  # worker side
                    mi = b1 * m[k] + (1 - b1) * g[i]
                    x = np.concatenate([mi.ravel(), np.zeros(P - d, np.float32)]) + we[k][i]
                    s = _scale(x)
                    sent_sign[i], sent_scale[i] = _pm(x), s
                    we[k][i] = x - s * _pm(x)
                decoded = np.zeros(P, np.float32)
                for j in range(n):  # server side: worker j owns chunk j
                    c = np.zeros(chunk, np.float32)
                    for i in range(n):
                        c = c + sent_sign[i, j * chunk : (j + 1) * chunk] * (
                            sent_scale[i] * np.float32(1 / n)
                        )
                    c = c + se[k][j]
                    s = _scale(c)
                    se[k][j] = c - s * _pm(c)
                    decoded[j * chunk : (j + 1) * chunk] = s * _pm(c)
                m[k] = decoded[:d].reshape(m[k].shape)
            u = -lr * (m[k] / (np.sqrt(v[k]) + eps) + wd * p[k])
            u_t[k] = u
            p[k] = p[k] + u
        ups.append(u_t)
    return {k: np.stack([u[k] for u in ups]) for k in names}, p, m, we, se


# ----------------------------------------------------------------------------


def test_padding_matches_deepspeed():
    assert ob.padded_size(35, 2) == 48  # unit 2 * 8 = 16
    assert ob.padded_size(35, 3) == 72  # unit 3 * 24
    assert ob.padded_size(64, 8) == 64
    assert ob.padded_size(1, 1) == 8


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_numpy_reference(backend, n):
    T, kw = 5, dict(lr=0.01, freeze=2, b1=0.9, b2=0.999, eps=1e-8, wd=0.01)
    grads = helpers.grads_seq(10 + n, T, n, SHAPES)
    params = helpers.random_tree(np.random.default_rng(3), SHAPES)
    tx = jd.onebit_adam(
        kw["lr"], freeze_step=kw["freeze"], num_workers=n, weight_decay=kw["wd"], eps=kw["eps"]
    )
    updates, final, state = helpers.run_steps(tx, grads, params, backend=backend)  # replicas checked
    want_u, want_p, want_m, want_we, want_se = np_onebit_adam(grads, params, n=n, **kw)
    helpers.assert_trees_close(updates, want_u, rtol=1e-5, atol=1e-7)
    helpers.assert_trees_close(final, want_p, rtol=1e-5, atol=1e-7)
    helpers.assert_trees_close(
        jax.tree.map(lambda x: np.asarray(x)[0], state.mu), want_m, rtol=1e-5, atol=1e-7
    )
    leaves = sorted(SHAPES)  # dict leaves are in key order
    for j, k in enumerate(leaves):
        np.testing.assert_allclose(np.asarray(state.worker_error[j]), want_we[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.server_error[j]), want_se[k], rtol=1e-5, atol=1e-6)
    if n > 1:  # both residuals are really per worker and really used
        we = np.asarray(state.worker_error[0])
        assert not np.array_equal(we[0], we[1])
        assert np.any(np.asarray(state.server_error[0]) != 0)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_eight_workers(backend):
    shapes = {"w": (9, 4)}
    grads = helpers.grads_seq(4, 4, 8, shapes)
    tx = jd.onebit_adam(1e-2, freeze_step=1, num_workers=8)
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros(shapes), backend=backend)
    want_u, _, _, want_we, want_se = np_onebit_adam(
        grads, helpers.zeros(shapes), n=8, lr=1e-2, freeze=1, b1=0.9, b2=0.999, eps=1e-8, wd=0.0
    )
    helpers.assert_trees_close(updates, want_u, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.worker_error[0]), want_we["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.server_error[0]), want_se["w"], rtol=1e-5, atol=1e-6)


def test_variance_frozen_after_exactly_freeze_step_updates():
    shapes = {"w": (4,)}
    grads = helpers.grads_seq(1, 5, 2, shapes)
    tx = jd.onebit_adam(1e-3, freeze_step=3, num_workers=2)
    nus = []
    p = helpers.zeros(shapes)
    state = jax.vmap(tx.init)(jax.tree.map(lambda x: jnp.stack([x, x]), p))
    f = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="data"))
    for t in range(5):
        _, state = f(jax.tree.map(lambda x: x[t], grads), state)
        nus.append(np.asarray(state.nu["w"][0]))
    assert not np.array_equal(nus[1], nus[2])  # third update still dense
    np.testing.assert_array_equal(nus[2], nus[3])
    np.testing.assert_array_equal(nus[2], nus[4])


def test_bias_correction_option():
    """With bias correction the first (dense) update is -lr * g / (|g| + eps'), Adam's."""
    g = jnp.array([[0.5, -2.0], [1.5, -2.0]])
    tx = jd.onebit_adam(0.1, freeze_step=2, num_workers=2, bias_correction=True)
    u = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(g)
    np.testing.assert_allclose(np.asarray(u[0]), [-0.1, 0.1], rtol=1e-5)


@pytest.mark.parametrize("n", [2, 8])
def test_communication_cost_is_bit_packed(n):
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(10)}
    tx = jd.onebit_adam(1e-3, freeze_step=2, num_workers=n)
    cost = jd.communication_cost(tx, params, num_workers=n, steps=3, start=0)
    dense = [c.kind for c in cost.steps[0].collectives]
    assert dense == ["all_reduce"]
    comp = cost.steps[2]
    assert sorted(c.kind for c in comp.collectives) == ["all_gather", "all_to_all"]
    sizes = [ob.padded_size(10, n), ob.padded_size(2048, n)]  # leaves in key order: b, w
    row = sum(s // (8 * n) + 4 for s in sizes)
    want = (n - 1) / n * (n * row) + (n - 1) * row
    assert comp.sent_bytes == pytest.approx(want)
    assert comp.sent_bytes < cost.dense_bytes / 10


def test_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch):
    family = ckpt.Family(
        lambda: jd.onebit_adam(1e-2, freeze_step=5, num_workers=ckpt.N_WORKERS), per_worker_state=True
    )
    monkeypatch.setitem(ckpt.FAMILIES, "onebit_adam", family)
    ckpt.test_resume_from_checkpoint_is_bit_identical("onebit_adam", tmp_path)


def test_contract_jit_and_dtypes():
    tx = jd.onebit_adam(optax.linear_schedule(1e-2, 0.0, 10), freeze_step=1, num_workers=2)
    g = {"w": jnp.ones((2, 3), jnp.bfloat16)}

    def two(g):
        s = tx.init(g)
        u, s = tx.update(g, s, unknown=3)
        u, s2 = tx.update(g, s)
        return u, s, s2

    u, s, s2 = jax.jit(jax.vmap(two, axis_name="data"))(g)
    assert u["w"].dtype == jnp.bfloat16
    helpers.assert_dtypes_equal(s, s2)
    state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)})
    assert state.worker_error[0].shape == (16,) and state.server_error[0].shape == (8,)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(freeze_step=0, num_workers=2), ValueError, "freeze_step"),
        (dict(freeze_step=2), ValueError, "num_workers"),
        (dict(freeze_step=2, num_workers=2, b1=1.0), ValueError, "b1"),
        (dict(freeze_step=2, num_workers=2, eps=0.0), ValueError, "eps"),
        (dict(freeze_step=2, num_workers=2, bias_correction=1), TypeError, "bias_correction"),
        (dict(freeze_step=2, num_workers=2, axis_name=["data"]), TypeError, "axis_name"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jd.onebit_adam(1e-3, **kwargs)


def test_worker_count_mismatch_and_unbound_axis():
    tx = jd.onebit_adam(1e-3, freeze_step=1, num_workers=4)
    with pytest.raises(ValueError, match="num_workers=4"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(NameError, match="onebit_adam"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)))
    tx = jd.onebit_adam(1e-3, freeze_step=1, num_workers=2, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"`onebit_adam` needs `params` \(with weight_decay\): call it as"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))


def test_wire_is_about_32x_smaller_than_dense():
    params = {"w": jnp.zeros((256, 256))}
    cost = jd.communication_cost(
        jd.onebit_adam(1e-3, freeze_step=1, num_workers=8), params, num_workers=8, steps=1, start=1
    )
    assert 25 < cost.dense_bytes / cost.sent_bytes < 40
    assert math.isclose(cost.sent_bytes, 7 / 8 * (256 * 256 / 8 + 8 * 4) + 7 * (256 * 256 / 64 + 4))


def test_inject_hyperparams():
    tx = optax.inject_hyperparams(jd.onebit_adam, static_args=("freeze_step", "num_workers"))(
        learning_rate=1e-2, freeze_step=1, num_workers=2, b1=0.8
    )
    ref = jd.onebit_adam(1e-2, freeze_step=1, num_workers=2, b1=0.8)
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 3)), jnp.float32)

    def run(tx):
        def two(g):
            s = tx.init(g)
            u1, s = tx.update(g, s, g)  # params: weight_decay is injected as an array
            u2, _ = tx.update(g, s, g)
            return u1, u2

        return jax.jit(jax.vmap(two, axis_name="data"))(g)

    # 1 - b1 is rounded in float32 for an injected b1, in double for a Python float.
    helpers.assert_trees_close(run(tx), run(ref), rtol=1e-5, atol=1e-8)
