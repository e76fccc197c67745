"""The same results whichever JAX release and mesh axis types (Explicit or Auto) are in use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import compat
from tests import helpers

AxisType = jax.sharding.AxisType
P = jax.sharding.PartitionSpec
PARAMS = {"w": jnp.arange(96.0).reshape(12, 8) / 96.0, "b": jnp.zeros(8)}
TRANSFORMS = {
    "all_reduce": lambda: jd.all_reduce(),
    "powersgd": lambda: jd.powersgd(rank=2),
    "top_k": lambda: jd.top_k(density=0.25),
    "local_sgd": lambda: optax.chain(jd.sgd(0.1), jd.average_params(every=3)),
}


def _mesh(axis_type, shape=(8,), names=("data",)):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_communication_cost_ignores_the_callers_mesh(name, axis_type):
    """Under a user's jax.set_mesh (explicit or auto axes, 1-D or 2-D), with concrete or
    abstract params (with or without a sharding), the figures are those computed with no mesh."""
    tx = TRANSFORMS[name]()
    # Six steps: enough for local SGD's period of 3, whose counter is evaluated step by step.
    expected = jd.communication_cost(tx, PARAMS, num_workers=8, steps=6)
    for mesh in (_mesh(axis_type), _mesh(axis_type, (2, 4), ("x", "data"))):
        replicated = jax.sharding.NamedSharding(mesh, P())
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
        placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), PARAMS)
        with jax.set_mesh(mesh):
            for params in (PARAMS, abstract, placed):
                got = jd.communication_cost(tx, params, num_workers=8, steps=6)
                assert got.sent_bytes == expected.sent_bytes > 0
                assert [s.path for s in got.sites] == [s.path for s in expected.sites]
                assert got.exact and [s.sent_bytes for s in got.steps] == [
                    s.sent_bytes for s in expected.steps
                ]


def _loss(params, batch):
    return jnp.mean((batch @ params["w"] + params["b"][None, :]) ** 2)


@pytest.mark.parametrize("name", ["all_reduce", "powersgd", "top_k"])
def test_data_parallel_step_is_the_same_on_explicit_and_auto_meshes(name):
    """Bit-identical params and state after a few steps on either axis type."""
    chain = optax.chain(TRANSFORMS[name](), jd.sgd(0.1, momentum=0.9))
    batches = [jax.random.normal(jax.random.key(i), (16, 12)) for i in range(3)]
    results = []
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        step = jd.data_parallel_step(_loss, chain, mesh=_mesh(axis_type))
        params, state = step.init(PARAMS)
        for batch in batches:
            params, state, _ = step(params, state, batch)
        results.append(jax.device_get((params, state)))
    helpers.assert_trees_equal(results[0], results[1])
    assert not np.allclose(results[0][0]["w"], PARAMS["w"])  # it trained


def test_scan_num_consts_reads_this_jax():
    """The constants and carries of a scan are found on every supported release's parameters."""

    def f(c, xs, k, k2):
        body = lambda c, x: ((c[0] + x * k, c[1] * k2[0].sum()), c[0])  # noqa: E731
        return jax.lax.scan(body, c, xs)

    jaxpr = jax.make_jaxpr(f)((1.0, 2.0), jnp.ones(3), 3.0, (jnp.ones(2), jnp.ones(2)))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    # Two constants (k and k2[0]; k2[1] is unused and dropped), then two carries and one xs.
    assert compat.scan_num_consts(eqn) == len(eqn.invars) - 3 == 2
    assert compat.scan_operand_counts(eqn) == (2, 2)
