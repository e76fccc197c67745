"""DeMo (``decoupled_momentum``) against a NumPy loop over workers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import decoupled_momentum as demo_mod
from tests import helpers
from tests import test_checkpoint as ckpt

try:
    import scipy.fft as sfft
except ImportError:  # pragma: no cover - scipy is in the test extras
    sfft = None

SHAPES = {"w": (8, 12), "b": (6,), "k": (2, 3, 4), "s": (), "p": (7,)}


# ----------------------------------------------------------------------------
# NumPy reference.


def _dctn(x: np.ndarray) -> np.ndarray:
    """Orthonormal DCT-II over every axis (scipy, or the matrix written out)."""
    if sfft is not None:
        return sfft.dctn(x, norm="ortho")
    out = x
    for axis, size in enumerate(x.shape):
        out = np.moveaxis(np.tensordot(_dct_matrix(size), out, axes=(1, axis)), 0, axis)
    return out


def _idctn(y: np.ndarray) -> np.ndarray:
    if sfft is not None:
        return sfft.idctn(y, norm="ortho")
    out = y
    for axis, size in enumerate(y.shape):
        out = np.moveaxis(np.tensordot(_dct_matrix(size).T, out, axes=(1, axis)), 0, axis)
    return out


def _dct_matrix(s: int) -> np.ndarray:
    k, i = np.arange(s)[:, None], np.arange(s)[None, :]
    c = np.cos(np.pi * (2 * i + 1) * k / (2 * s)) * np.sqrt(2.0 / s)
    c[0] /= np.sqrt(2.0)
    return c


def _np_block(s: int, chunk: int) -> int:
    return max(d for d in range(1, min(s, chunk) + 1) if s % d == 0)


def _np_matrix(shape):
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return int(np.prod(shape[:-1])), shape[-1]


def _tiles(x, b1, b2):
    r, c = x.shape
    return [(i, j) for i in range(0, r, b1) for j in range(0, c, b2)]


def np_demo(grads_seq, params, *, lr, decay, chunk, topk, wd):
    """Per step: each worker's momentum, top-k per DCT tile, mean over choosers, sign."""
    T, n = next(iter(grads_seq.values())).shape[:2]
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mom = {k: np.zeros((n, *v.shape)) for k, v in params.items()}
    ups = []
    for t in range(T):
        u_t = {}
        for name, shape in ((k, v.shape) for k, v in params.items()):
            r, c = _np_matrix(shape)
            b1, b2 = _np_block(r, chunk), _np_block(c, chunk)
            k = min(topk, b1 * b2)
            total = np.zeros((r, c))
            count = np.zeros((r, c))
            for i in range(n):
                m = decay * mom[name][i] + lr * grads_seq[name][t, i]
                mm = m.reshape(r, c).copy()
                removed = np.zeros((r, c))
                for a, b in _tiles(mm, b1, b2):
                    y = _dctn(mm[a : a + b1, b : b + b2]).ravel()
                    keep = np.argsort(-np.abs(y), kind="stable")[:k]
                    sent = np.zeros_like(y)
                    sent[keep] = y[keep]
                    removed[a : a + b1, b : b + b2] = _idctn(sent.reshape(b1, b2))
                    tot = total[a : a + b1, b : b + b2].ravel()
                    cnt = count[a : a + b1, b : b + b2].ravel()
                    tot[keep] += y[keep]
                    cnt[keep] += 1
                    total[a : a + b1, b : b + b2] = tot.reshape(b1, b2)
                    count[a : a + b1, b : b + b2] = cnt.reshape(b1, b2)
                mom[name][i] = (mm - removed).reshape(shape)
            mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
            decoded = np.zeros((r, c))
            for a, b in _tiles(mean, b1, b2):
                decoded[a : a + b1, b : b + b2] = _idctn(mean[a : a + b1, b : b + b2])
            u = -lr * wd * p[name] - lr * np.sign(decoded.reshape(shape))
            u_t[name] = u
            p[name] = p[name] + u
        ups.append(u_t)
    return {k: np.stack([u[k] for u in ups]) for k in params}, p, mom


# ----------------------------------------------------------------------------
# Layout.


def test_block_size_is_largest_divisor_up_to_chunk():
    assert [demo_mod.block_size(s, 64) for s in (96, 80, 97, 64, 128, 1)] == [48, 40, 1, 64, 64, 1]
    assert demo_mod.matrix_shape(()) == (1, 1)
    assert demo_mod.matrix_shape((5,)) == (1, 5)
    assert demo_mod.matrix_shape((3, 3, 4, 8)) == (36, 8)


def test_dct_matrix_is_orthonormal_dct2():
    x = np.random.default_rng(0).standard_normal(12)
    c = demo_mod.dct_matrix(12)
    np.testing.assert_allclose(c @ c.T, np.eye(12), atol=1e-12)
    np.testing.assert_allclose(c @ x, _dctn(x), atol=1e-12)


def test_index_dtype_is_the_smallest_that_fits():
    assert demo_mod.index_dtype(256) == jnp.uint8
    assert demo_mod.index_dtype(257) == jnp.uint16
    assert demo_mod.index_dtype(4096) == jnp.uint16
    assert demo_mod.index_dtype(2**16 + 1) == jnp.uint32


def test_mean_is_over_the_workers_that_chose_a_coefficient():
    lay = demo_mod._Layout(rows=1, cols=4, b1=1, b2=4, k=2)
    idx = jnp.array([[[0, 1]], [[0, 2]], [[3, 0]]], jnp.uint8)  # 3 workers, 1 tile, k = 2
    val = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]], jnp.float32)
    got = demo_mod._mean_of_chosen(idx, val, lay)
    np.testing.assert_allclose(np.asarray(got), [[(1 + 3 + 6) / 3, 2.0, 4.0, 5.0]], rtol=1e-6)


# ----------------------------------------------------------------------------
# Against the reference.


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_numpy_reference(backend, n):
    T, kw = 3, dict(lr=0.05, decay=0.9, chunk=4, topk=3, wd=0.1)
    grads = helpers.grads_seq(n, T, n, SHAPES)
    params = helpers.random_tree(np.random.default_rng(7), SHAPES)
    tx = jd.decoupled_momentum(
        kw["lr"], decay=kw["decay"], chunk=kw["chunk"], topk=kw["topk"], weight_decay=kw["wd"]
    )
    updates, final, state = helpers.run_steps(tx, grads, params, backend=backend)  # replicas checked
    want_u, want_p, want_m = np_demo(grads, params, **kw)
    # A coefficient near zero could flip sign under float32 rounding; none does here.
    helpers.assert_trees_close(updates, want_u, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final, want_p, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.momentum, want_m, rtol=1e-4, atol=1e-5)
    assert int(state.count[0]) == T


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_eight_workers_replicas_bit_identical(backend):
    shapes = {"w": (16, 8), "b": (8,)}
    grads = helpers.grads_seq(3, 4, 8, shapes)
    tx = jd.decoupled_momentum(0.01, chunk=8, topk=4)
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros(shapes), backend=backend)
    want_u, _, want_m = np_demo(grads, helpers.zeros(shapes), lr=0.01, decay=0.999, chunk=8, topk=4, wd=0.0)
    helpers.assert_trees_close(updates, want_u)
    helpers.assert_trees_close(state.momentum, want_m, rtol=1e-4, atol=1e-6)
    # The momentum is per worker: rows differ.
    mom = np.asarray(state.momentum["w"])
    assert not np.array_equal(mom[0], mom[1])


def test_topk_equal_to_block_size_sends_everything():
    """With every coefficient kept the momentum is emptied and the update is -lr sign(mean m)."""
    shapes = {"w": (4, 6)}
    grads = helpers.grads_seq(5, 1, 3, shapes)
    tx = jd.decoupled_momentum(0.1, chunk=64, topk=24)
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros(shapes), backend="vmap")
    np.testing.assert_allclose(np.asarray(state.momentum["w"]), 0.0, atol=1e-6)
    want = -0.1 * np.sign(grads["w"][0].mean(axis=0))
    np.testing.assert_array_equal(np.asarray(updates["w"][0]), want)


# ----------------------------------------------------------------------------
# Wire bytes, contract, checkpoint, errors.


@pytest.mark.parametrize("n", [2, 8])
def test_communication_cost_counts_values_and_small_indices(n):
    params = {"w": jnp.zeros((128, 96)), "b": jnp.zeros(96), "s": jnp.zeros(())}
    cost = jd.communication_cost(jd.decoupled_momentum(0.1), params, num_workers=n)
    # w: tiles 64 x 48 (2 x 2 of them), 32 kept, uint16 indices; b: 2 runs of 48, 32 kept,
    # uint8 indices; s: 1 of 1, uint8.
    payload = 4 * 32 * (4 + 2) + 2 * 32 * (4 + 1) + 1 * (4 + 1)
    assert [c.kind for c in cost.steps[0].collectives] == ["all_gather"]
    assert cost.sent_bytes == (n - 1) * payload


def test_contract_jit_chain_and_extra_args():
    tx = optax.chain(jd.decoupled_momentum(optax.linear_schedule(0.1, 0.0, 10), topk=2, chunk=4))
    g = {"w": jnp.ones((2, 4, 4))}

    def step(g):
        s = tx.init(g)
        u, s = tx.update(g, s, g, unknown_extra=1)
        return u, s

    f = jax.jit(jax.vmap(step, axis_name="data"))
    u, s = f(g)
    u2, _ = f(g)
    assert f._cache_size() == 1
    helpers.assert_trees_equal(u, u2)
    assert u["w"].dtype == jnp.float32
    helpers.assert_dtypes_equal(jax.vmap(lambda g: tx.init(g))(g), s)


def test_abstract_init():
    tx = jd.decoupled_momentum(0.1)
    state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16)})
    assert state.momentum["w"].dtype == jnp.float32


def test_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch):
    family = ckpt.Family(lambda: jd.decoupled_momentum(0.01, chunk=4, topk=2), per_worker_state=True)
    monkeypatch.setitem(ckpt.FAMILIES, "decoupled_momentum", family)
    ckpt.test_resume_from_checkpoint_is_bit_identical("decoupled_momentum", tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(chunk=0), ValueError, "chunk"),
        (dict(topk=2.5), TypeError, "topk"),
        (dict(decay=1.5), ValueError, "decay"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay"),
        (dict(axis_name=["data"]), TypeError, "axis_name"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jd.decoupled_momentum(0.1, **kwargs)


def test_unbound_axis_and_missing_params():
    tx = jd.decoupled_momentum(0.1)
    g = jnp.ones(4)
    with pytest.raises(NameError, match="decoupled_momentum"):
        tx.update(g, tx.init(g))
    tx = jd.decoupled_momentum(0.1, weight_decay=0.1)
    with pytest.raises(
        ValueError, match=r"`decoupled_momentum` needs `params` \(with weight_decay\): call it as"
    ):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 4)))


def test_inject_hyperparams():
    tx = optax.inject_hyperparams(jd.decoupled_momentum, static_args=("chunk", "topk"))(
        learning_rate=0.1, decay=0.9, chunk=4, topk=2
    )
    ref = jd.decoupled_momentum(0.1, decay=0.9, chunk=4, topk=2)
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 8)), jnp.float32)
    # params given: weight_decay is injected as an array, so it may be non-zero.
    run = lambda tx: jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g), g)[0], axis_name="data"))(g)  # noqa: E731
    helpers.assert_trees_equal(run(tx), run(ref))
