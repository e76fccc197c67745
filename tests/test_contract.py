"""The optax contract, checked for every public transform of the library.

Each entry builds a transform; the checks run it on 2 workers under
``vmap(axis_name="data")`` (communicating transforms need a bound axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

# (id, factory, per_worker_params)
TRANSFORMS = [
    ("sgd", lambda: jd.sgd(0.1, 0.9, dampening=0.1, weight_decay=1e-3), False),
    ("sign_sgd", lambda: jd.sign_sgd(0.1, 0.9), False),
    ("rmsprop", lambda: jd.rmsprop(0.01, weight_decay=1e-3), False),
    ("adagrad", lambda: jd.adagrad(0.1), False),
    ("adam", lambda: jd.adam(1e-3, amsgrad=True), False),
    ("scale_by_momentum", lambda: jd.scale_by_momentum(0.9, nesterov=True), False),
    ("all_reduce", lambda: jd.all_reduce(), False),
    ("all_reduce_bf16_flat", lambda: jd.all_reduce(dtype=jnp.bfloat16, flatten=True), False),
    ("average_params", lambda: jd.average_params(every=2, num_partitions=2), True),
]
IDS = [t[0] for t in TRANSFORMS]
N = 2
PARAMS = {"w": jnp.ones((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}


def _grads(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal((N, *p.shape)), dtype), PARAMS)


def _stack(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), tree)


def _chain(factory, per_worker):
    """The transform in a typical chain: aggregation first unless it keeps per-worker params."""
    tx = factory()
    if per_worker:
        return optax.chain(jd.sgd(0.1), tx)
    return optax.chain(jd.all_reduce(), tx)


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_no_recompilation_and_unknown_extra_args(name, factory, per_worker):
    tx = _chain(factory, per_worker)
    traces = []

    def step(g, s, p):
        traces.append(1)
        u, s = tx.update(g, s, p, unknown_extra=jnp.ones(()), another=None)
        return u, s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    p = _stack(PARAMS)
    s = jax.vmap(tx.init)(p)
    for seed in range(3):
        u, s, p = run(_grads(seed), s, p)
    assert len(traces) == 1
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_abstract_init_and_init_needs_no_axis(name, factory, per_worker):
    tx = factory()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
    shapes = jax.eval_shape(tx.init, abstract)
    concrete = tx.init(PARAMS)  # outside any mapped axis: init never communicates
    assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(shapes), jax.tree.leaves(concrete)):
        assert a.shape == c.shape and a.dtype == c.dtype
    inside = jax.vmap(lambda p: tx.init(p), axis_name="data")(_stack(PARAMS))
    helpers.assert_trees_equal(jax.tree.map(lambda x: x[0], inside), concrete)


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_multisteps_and_dtype_stability_bf16(name, factory, per_worker):
    tx = optax.MultiSteps(_chain(factory, per_worker), every_k_schedule=2)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    p = _stack(params)
    s = jax.vmap(tx.init)(p)
    dtypes = jax.tree.map(lambda x: x.dtype, s)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return u, s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    start = p
    for seed in range(4):
        u, s, p = run(_grads(seed, jnp.bfloat16), s, p)
        helpers.assert_dtypes_equal(u, p)
        assert jax.tree.map(lambda x: x.dtype, s) == dtypes
    assert any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(start)))


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_one_worker_equals_local_computation(name, factory, per_worker):
    # On a single worker every aggregation is the identity: the chain equals its local part.
    tx = _chain(factory, per_worker)
    if per_worker:
        local = jd.sgd(0.1)  # chain(sgd, averaging) on one worker is sgd
    elif name.startswith("all_reduce"):
        local = optax.identity()  # chain(all_reduce, all_reduce) on one worker
    else:
        local = factory()
    g1 = jax.tree.map(lambda x: x[:1], _grads(7))
    got = helpers.run_transform(tx, g1, backend="vmap", params=PARAMS, replicated=not per_worker)
    if per_worker:
        got = jax.tree.map(lambda x: x[0], got)
    g = jax.tree.map(lambda x: x[0], g1)
    want, _ = local.update(g, local.init(PARAMS), PARAMS)
    tol = 4e-3 if "bf16" in name else 1e-6  # a bf16 wire rounds even a single worker's values
    helpers.assert_trees_close(got, want, rtol=tol, atol=tol)
