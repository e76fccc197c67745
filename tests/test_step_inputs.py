"""Inputs a step rejects at ``init`` with a message that names the leaf and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxopt_dist as jd
from jaxopt_dist import linen as jlinen
from jaxopt_dist import nnx as jnnx
from tests import helpers

INT_LEAF = r"non-floating-point leaves: \['z_count'\] \(int32\).*ufunc 'power'.*Keep such values out"


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2) * (1 + 0 * p["z_count"]).astype(jnp.float32)


def _adamw_tx():
    return optax.chain(jd.powersgd(rank=1), optax.adamw(1e-3))


def test_integer_param_with_an_optimizer_that_cannot_take_it_is_named():
    step = jd.data_parallel_step(_loss, _adamw_tx(), mesh=helpers.make_mesh(2))
    params = {"w": jnp.ones((3, 2)), "z_count": jnp.int32(5)}
    with pytest.raises(ValueError, match=INT_LEAF):
        step.init(params)
    # The library's own optimizer passes the counter through.
    step = jd.data_parallel_step(
        _loss, optax.chain(jd.powersgd(rank=1), jd.adam(1e-3)), mesh=helpers.make_mesh(2)
    )
    params, _ = step.init(params)
    assert params["z_count"].dtype == jnp.int32


def test_integer_param_through_the_flax_front_ends_is_named():
    class Counted(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3, 2)))
            self.z_count = nnx.Param(jnp.int32(5))

    def nnx_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((x @ m.w[...]) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    model = Counted()
    optimizer = jnnx.Optimizer(model, _adamw_tx(), wrt=nnx.Param)
    with pytest.raises(ValueError, match=INT_LEAF):
        jnnx.data_parallel(nnx_step, mesh=helpers.make_mesh(2))(model, optimizer, np.ones((4, 3), np.float32))

    params = {"w": jnp.ones((3, 2)), "z_count": jnp.int32(5)}
    state = jlinen.TrainState.create(
        apply_fn=lambda v, x: x @ v["params"]["w"], params=params, tx=_adamw_tx()
    )

    def linen_step(state, x):
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2), allow_int=True)(
            state.params
        )
        return state.apply_gradients(grads=grads)

    with pytest.raises(ValueError, match=INT_LEAF):
        jlinen.data_parallel(linen_step, mesh=helpers.make_mesh(2))(state, np.ones((4, 3), np.float32))


def test_stacked_params_are_not_stacked_again_nor_counted_per_worker():
    mesh = helpers.make_mesh(4)
    tx = jd.diloco(optax.sgd(0.1), sync_every=2)
    step = jd.data_parallel_step(lambda p, b: jnp.sum(p["w"] * b), tx, mesh=mesh, per_worker_params=True)
    params0 = {"w": jnp.ones((4, 3))}  # leading dimension 4 = workers: one copy all the same
    params, _ = step.init(params0)
    assert params["w"].shape == (4, 4, 3)
    with pytest.raises(ValueError, match=r"stacked per worker already \(leaf \['w'\].*Pass one copy"):
        step.init(params)
    with pytest.raises(ValueError, match=r"stacked per worker already"):
        step.abstract_init(params)
    with pytest.raises(ValueError, match=r"`params` are stacked per worker \(leaf \['w'\].*Pass one copy"):
        jd.communication_cost(tx, params, num_workers=4)
    one = jd.communication_cost(tx, params0, num_workers=4, steps=2)
    assert one.sent_bytes == pytest.approx(2 * 3 / 4 * 4 * 12 / 2)
