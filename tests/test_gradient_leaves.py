"""Gradient leaves that are not floats: float0 (integer parameters) and integer arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

TRANSFORMS = {
    "all_reduce": lambda: jd.all_reduce(),
    "all_reduce_flat": lambda: jd.all_reduce(flatten=True),
    "average_params": lambda: jd.average_params(),
    "gossip": lambda: jd.gossip("ring"),
    "adasum": lambda: jd.adasum(),
    "top_k": lambda: jd.top_k(k=2),
    "random_k": lambda: jd.random_k(k=2),
    "block_k": lambda: jd.block_k(k=2),
    "threshold": lambda: jd.threshold(0.5, capacity=2),
    "sign_majority_vote": lambda: jd.sign_majority_vote(),
    "scaled_sign": lambda: jd.scaled_sign(),
    "qsgd": lambda: jd.qsgd(4),
    "powersgd": lambda: jd.powersgd(rank=1, min_compression_rate=1.0),
    "sgd": lambda: jd.sgd(0.1, 0.9),
    "sign_sgd": lambda: jd.sign_sgd(0.1, 0.9),
    "rmsprop": lambda: jd.rmsprop(0.1),
    "adagrad": lambda: jd.adagrad(0.1),
    "adam": lambda: jd.adam(0.1),
}


def _loss(p, x):
    # The integer counter takes part in the forward pass but has no gradient.
    return jnp.sum(jnp.tanh(p["w"] * x)) * (1 + 0 * p["z_count"]).astype(jnp.float32)


def _worker_inputs(n):
    rng = np.random.default_rng(0)
    w = np.broadcast_to(rng.standard_normal((3, 4)).astype(np.float32), (n, 3, 4)).copy()
    x = rng.standard_normal((n, 3, 4)).astype(np.float32)
    return w, np.full((n,), 7, np.int32), x


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_float0_leaves_pass_through_untouched(name, backend):
    n = 2
    tx = TRANSFORMS[name]()

    def with_counter(w, c, x):
        p = {"w": w, "z_count": c}
        g = jax.grad(_loss, allow_int=True)(p, x)
        assert g["z_count"].dtype == jax.dtypes.float0
        out, _ = tx.update(g, tx.init(p), p)
        assert out["z_count"].dtype == jax.dtypes.float0  # handed back as it came
        return out["w"]

    def without_counter(w, x):
        p = {"w": w}
        g = jax.grad(lambda q, x: _loss({**q, "z_count": jnp.int32(7)}, x))(p, x)
        out, _ = tx.update(g, tx.init(p), p)
        return out["w"]

    def both(w, c, x):
        return with_counter(w, c, x), without_counter(w, x)

    got, want = helpers.run_on_workers(both, *_worker_inputs(n), backend=backend, replicated=False)
    # Equal up to float32 rounding: with the extra (zero) leaf in its buffers, a
    # transform may sum the other leaves in a different order.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_integer_updates_are_rejected(name):
    """Integer gradients would be averaged with a different rounding by each method."""
    tx = TRANSFORMS[name]()
    p = {"w": jnp.ones((3, 4), jnp.float32)}

    def fn(g):
        return tx.update(g, tx.init(p), p)[0]

    g = {"w": np.ones((2, 3, 4), np.int32)}
    with pytest.raises(TypeError, match=r"updates must be floating point; leaf \['w'\] is int32"):
        jax.vmap(fn, axis_name="data")(g)


def test_data_parallel_step_keeps_integer_params():
    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2) * (1 + 0 * p["z_count"]).astype(jnp.float32)

    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1, 0.9))
    mesh = helpers.make_mesh(4)
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((16, 3)).astype(np.float32), "y": np.ones(16, np.float32)}
    w0 = jnp.asarray(rng.standard_normal(3), jnp.float32)

    step = jd.data_parallel_step(loss, tx, mesh=mesh)
    params, state = step.init({"w": w0, "z_count": jnp.int32(5)})
    plain = jd.data_parallel_step(lambda p, b: loss({**p, "z_count": jnp.int32(5)}, b), tx, mesh=mesh)
    pw, ps = plain.init({"w": w0})
    for _ in range(2):
        params, state, _ = step(params, state, batch)
        pw, ps, _ = plain(pw, ps, batch)
    assert int(params["z_count"]) == 5 and params["z_count"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(pw["w"]))
