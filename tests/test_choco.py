"""CHOCO-SGD (``choco_gossip``) against a NumPy loop over workers with explicit public copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers
from tests import test_checkpoint as ckpt

SHAPES = {"w": (4, 5), "b": (3,)}


# ----------------------------------------------------------------------------
# NumPy reference: every worker keeps copies of its own and its neighbours' public x_hat.


def np_top_k(x: np.ndarray, k: int) -> np.ndarray:
    v = x.ravel()
    if v.size <= k:
        return x.copy()
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    out = np.zeros_like(v)
    out[keep] = v[keep]
    return out.reshape(x.shape)


def np_scaled_sign(x: np.ndarray) -> np.ndarray:
    return np.mean(np.abs(x)) * np.where(x < 0, -1.0, 1.0)


def np_choco(grads_seq, params, *, lr, gamma, w, compress):
    """``T`` steps of SGD then CHOCO gossip; returns (per-worker params, copies held by each worker)."""
    n = w.shape[0]
    T = next(iter(grads_seq.values())).shape[0]
    x = {k: np.stack([np.asarray(v, np.float64)] * n) for k, v in params.items()}
    nbrs = [[j for j in range(n) if j != i and w[i, j] != 0] for i in range(n)]
    copies = [{j: {k: np.zeros(v.shape) for k, v in params.items()} for j in [i, *nbrs[i]]} for i in range(n)]
    for t in range(T):
        half = {k: x[k] - lr * grads_seq[k][t] for k in x}
        q = [{k: compress(half[k][j] - copies[j][j][k]) for k in x} for j in range(n)]
        for i in range(n):
            for j in copies[i]:
                for k in x:
                    copies[i][j][k] = copies[i][j][k] + q[j][k]
        for i in range(n):
            for k in x:
                mix = sum(w[i, j] * (copies[i][j][k] - copies[i][i][k]) for j in nbrs[i])
                x[k][i] = half[k][i] + gamma * mix
    return x, copies


def _check_against_reference(tx, np_compress, n, backend, *, topology="ring", weights="uniform", T=3):
    grads = helpers.grads_seq(20 + n, T, n, SHAPES)
    params = helpers.random_tree(np.random.default_rng(5), SHAPES)
    _, final, (_, state) = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    w = jd.mixing_matrix(topology, n, weights=weights)
    want_x, copies = np_choco(grads, params, lr=0.1, gamma=0.5, w=w, compress=np_compress)
    helpers.assert_trees_close(final, want_x, rtol=1e-5, atol=1e-6)
    # Public copies: each worker's own, and every neighbour's copy of it, agree.
    public = {k: np.asarray(v) for k, v in state.public.items()}
    for i in range(n):
        for k in SHAPES:
            np.testing.assert_allclose(public[k][i], copies[i][i][k], rtol=1e-5, atol=1e-6)
            for j in copies[i]:
                np.testing.assert_allclose(copies[i][j][k], copies[j][j][k], rtol=1e-12)
    # The stored neighbour sum is sum_j W_ij x_hat_j.
    neigh = {k: np.asarray(v) for k, v in state.neighbours.items()}
    for k in SHAPES:
        want = np.einsum("ij,j...->i...", w - np.diag(np.diag(w)), public[k])
        np.testing.assert_allclose(neigh[k], want, rtol=1e-5, atol=1e-6)
    return final, state


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_top_k_matches_numpy_reference(backend, n):
    tx = optax.chain(jd.sgd(0.1), jd.choco_gossip(jd.top_k(k=3), consensus_step=0.5))
    _check_against_reference(tx, lambda x: np_top_k(x, 3), n, backend)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_scaled_sign_on_a_torus_of_four(backend):
    tx = optax.chain(jd.sgd(0.1), jd.choco_gossip(jd.scaled_sign(), topology="torus", consensus_step=0.5))
    _check_against_reference(tx, np_scaled_sign, 4, backend, topology="torus")


def test_complete_graph_metropolis_eight_workers():
    tx = optax.chain(
        jd.sgd(0.1),
        jd.choco_gossip(jd.top_k(k=2), topology="complete", weights="metropolis", consensus_step=0.5),
    )
    _check_against_reference(
        tx, lambda x: np_top_k(x, 2), 8, "vmap", topology="complete", weights="metropolis"
    )


@pytest.mark.parametrize("compressor", ["random_k", "block_k", "qsgd"])
def test_random_compressors_keep_copies_consistent_and_mean(compressor):
    """Any codec: the stored neighbour sum equals sum_j W_ij x_hat_j, and W keeps the mean."""
    n, T = 4, 3
    comp = {"random_k": jd.random_k(k=3), "block_k": jd.block_k(k=3), "qsgd": jd.qsgd(4)}[compressor]
    tx = optax.chain(jd.sgd(0.1), jd.choco_gossip(comp, consensus_step=0.5))
    grads = helpers.grads_seq(9, T, n, SHAPES)
    params = helpers.random_tree(np.random.default_rng(5), SHAPES)
    _, final, (_, state) = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    w = jd.mixing_matrix("ring", n)
    for k in SHAPES:
        public, neigh = np.asarray(state.public[k]), np.asarray(state.neighbours[k])
        want = np.einsum("ij,j...->i...", w - np.diag(np.diag(w)), public)
        np.testing.assert_allclose(neigh, want, rtol=1e-5, atol=1e-6)
        mean_sgd = params[k] - 0.1 * grads[k].sum(axis=0).mean(axis=0)
        np.testing.assert_allclose(np.asarray(final[k]).mean(axis=0), mean_sgd, rtol=1e-5, atol=1e-5)
        assert np.any(public != 0)


def test_consensus_with_no_gradients():
    """Without local steps, CHOCO with top-k drives the workers to their average."""
    n = 4
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((n, 6)).astype(np.float32)
    tx = jd.choco_gossip(jd.top_k(k=2), consensus_step=0.3)

    def run(x):
        def body(carry, _):
            x, s = carry
            u, s = tx.update(jnp.zeros_like(x), s, x)
            return (x + u, s), None

        (x, _), _ = jax.lax.scan(body, (x, tx.init(x)), None, length=300)
        return x

    x = np.asarray(jax.jit(jax.vmap(run, axis_name="data"))(jnp.asarray(x0)))
    np.testing.assert_allclose(x, np.broadcast_to(x0.mean(axis=0), x.shape), atol=1e-3)


# ----------------------------------------------------------------------------
# Wire bytes, training, checkpoint, errors.


@pytest.mark.parametrize(
    ("compressor", "per_neighbour"),
    [
        (lambda: jd.top_k(k=8), 8 * 8 + 8 * 8),  # w: 8 values + 8 int32 indices; b: 8 of 10, same
        (lambda: jd.random_k(k=8), 8 * 4 + 8 * 4),  # values only
        (lambda: jd.scaled_sign(), (64 * 32 + 10 + 7) // 8 + 2 * 4),  # packed signs + 2 scales
        (lambda: jd.qsgd(4), 64 * 32 + 10 + 2 * 4),  # int8 codes + 2 norms
    ],
)
def test_communication_cost_is_the_compressed_message(compressor, per_neighbour):
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(10)}
    tx = optax.chain(jd.sgd(0.1), jd.choco_gossip(compressor(), consensus_step=0.5))
    for n, neighbours in ((2, 1), (4, 2)):
        cost = jd.communication_cost(tx, params, num_workers=n)
        kinds = [c.kind for c in cost.steps[0].collectives]
        assert kinds == ["permute"] * neighbours
        assert cost.sent_bytes == neighbours * per_neighbour


def test_data_parallel_step_trains_and_resumes(tmp_path, monkeypatch):
    family = ckpt.Family(
        lambda: optax.chain(jd.sgd(ckpt.LR), jd.choco_gossip(jd.top_k(k=4), consensus_step=0.5)),
        per_worker_state=True,
        per_worker_params=True,
    )
    monkeypatch.setitem(ckpt.FAMILIES, "choco_gossip", family)
    ckpt.test_resume_from_checkpoint_is_bit_identical("choco_gossip", tmp_path)


def test_bad_arguments():
    with pytest.raises(TypeError, match="compressor"):
        jd.choco_gossip(jd.sgd(0.1), consensus_step=0.5)
    with pytest.raises(ValueError, match="compressor"):
        jd.choco_gossip(jd.powersgd(rank=1), consensus_step=0.5)
    with pytest.raises(ValueError, match="compressor"):
        jd.choco_gossip(jd.top_k(k=1, per_leaf=False), consensus_step=0.5)
    with pytest.raises(ValueError, match="exponential"):
        jd.choco_gossip(jd.top_k(k=1), topology="exponential", consensus_step=0.5)
    with pytest.raises(ValueError, match="consensus_step"):
        jd.choco_gossip(jd.top_k(k=1), consensus_step=0.0)
    with pytest.raises(TypeError, match="consensus_step"):
        jd.choco_gossip(jd.top_k(k=1))  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="shape"):
        jd.choco_gossip(jd.top_k(k=1), consensus_step=0.5, shape=(2, 2))
    tx = jd.choco_gossip(jd.top_k(k=1), consensus_step=0.5)
    with pytest.raises(ValueError, match=r"`choco_gossip` needs `params`: call it as"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(NameError, match="choco_gossip"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)), jnp.ones(3))
