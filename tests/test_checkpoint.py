"""Checkpoint and resume with orbax-checkpoint, for every transform family.

Each family trains a small MLP on a 4-worker mesh with ``data_parallel_step``:
10 steps, a checkpoint of params and optimizer state, 10 more steps (the
uninterrupted run). A fresh step object then restores the step-10 checkpoint
into the layout of a freshly placed state (per-worker leaves stacked and
sharded ``P("data")``, replicated leaves ``P()``) and runs the same 10 steps:
params, every state leaf and the losses must be bit-identical to the
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxopt_dist as jd
from tests import helpers

P = jax.sharding.PartitionSpec

N_WORKERS = 4
STEPS = 10  # before the checkpoint, and again after it
PER_WORKER_BATCH = 4
DIM_IN, HIDDEN, DIM_OUT = 6, 16, 3
LR, MOM = 0.05, 0.9


# ----------------------------------------------------------------------------
# The model and its data: the batch is a function of the step index, so any run
# (uninterrupted or resumed) regenerates the same batches.


def _params0(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    params = {
        "w1": 0.4 * rng.standard_normal((DIM_IN, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": 0.4 * rng.standard_normal((HIDDEN, DIM_OUT)),
    }
    return {k: jnp.asarray(v, dtype) for k, v in params.items()}


_TEACHER = np.random.default_rng(1).standard_normal((DIM_IN, DIM_OUT)).astype(np.float32)


def _batch(t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + t)
    x = rng.standard_normal((N_WORKERS * PER_WORKER_BATCH, DIM_IN)).astype(np.float32)
    return {"x": x, "y": np.sin(x @ _TEACHER)}


def _loss(params, batch):
    x = batch["x"].astype(params["w1"].dtype)
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    pred = (h @ params["w2"]).astype(jnp.float32)
    return jnp.mean((pred - batch["y"]) ** 2)


def _basis() -> np.ndarray:
    """A DimReduce basis fitted on a made-up parameter trajectory."""
    p0 = np.asarray(jd.flatten_params(_params0()))
    walk = np.cumsum(0.1 * np.random.default_rng(2).standard_normal((6, p0.size)), axis=0)
    return jd.fit_subspace((p0 + walk).astype(np.float32), 4)


# ----------------------------------------------------------------------------
# The families.


@dataclasses.dataclass(frozen=True)
class Family:
    make: Callable[[], optax.GradientTransformation]
    per_worker_state: bool  # some state leaf differs between workers (stacked, P("data"))
    per_worker_params: bool = False
    bf16: bool = False


def _sgd():
    return jd.sgd(LR, MOM)


FAMILIES = {
    "dense": Family(lambda: optax.chain(jd.all_reduce(), _sgd()), per_worker_state=False),
    "adam": Family(lambda: optax.chain(jd.all_reduce(), jd.adam(1e-2)), per_worker_state=False),
    "local_sgd": Family(
        lambda: optax.chain(_sgd(), jd.average_params(every=3)),
        per_worker_state=True,  # the momentum runs before the averaging
        per_worker_params=True,
    ),
    "top_k": Family(lambda: optax.chain(jd.top_k(k=5), _sgd()), per_worker_state=True),
    "random_k": Family(lambda: optax.chain(jd.random_k(k=5), jd.sgd(0.1)), per_worker_state=True),
    "block_k": Family(lambda: optax.chain(jd.block_k(k=5), jd.sgd(0.1)), per_worker_state=True),
    "threshold": Family(lambda: optax.chain(jd.threshold(1e-2, capacity=8), _sgd()), per_worker_state=True),
    "sign_majority_vote": Family(
        lambda: optax.chain(jd.scale_by_momentum(MOM), jd.sign_majority_vote(), jd.sgd(1e-3)),
        per_worker_state=True,  # the momentum runs before the vote
    ),
    "scaled_sign": Family(lambda: optax.chain(jd.scaled_sign(), _sgd()), per_worker_state=True),
    "qsgd": Family(lambda: optax.chain(jd.qsgd(4), _sgd()), per_worker_state=False),
    "powersgd": Family(lambda: optax.chain(jd.powersgd(rank=1), _sgd()), per_worker_state=True),
    "powersgd_one_allreduce": Family(
        lambda: optax.chain(jd.powersgd(rank=2, one_allreduce=True), _sgd()), per_worker_state=True
    ),
    "adasum": Family(lambda: optax.chain(jd.adasum(), _sgd()), per_worker_state=False),
    "centered_clip": Family(
        lambda: optax.chain(jd.scale_by_momentum(MOM), jd.centered_clip(0.5), jd.sgd(LR)),
        per_worker_state=True,  # the momentum runs before the clipping; the center is replicated
    ),
    "gossip": Family(
        lambda: optax.chain(_sgd(), jd.gossip("exponential", track_consensus=True)),
        per_worker_state=True,
        per_worker_params=True,
    ),
    "dim_reduce": Family(lambda: jd.dim_reduce(_basis(), alpha=LR), per_worker_state=False),
    "loss_scale": Family(
        lambda: jd.master_weights(
            jd.dynamic_loss_scale(
                optax.chain(jd.all_reduce(dtype=jnp.bfloat16), _sgd()),
                growth_interval=4,  # the scale changes on both sides of the checkpoint
                axis_name="data",
            )
        ),
        per_worker_state=False,
        bf16=True,
    ),
    "iterate_average": Family(
        lambda: optax.chain(jd.all_reduce(), jd.sgd(LR), jd.iterate_average()), per_worker_state=False
    ),
    # The orthonormal optimizers: Dion's per-worker momentum (compressed exchange). Muon and Dion2
    # split a shape's matrices over the workers only by whole multiples of the worker count: this
    # model's two matrices (one per shape) are both every worker's own, their momentum replicated.
    "dion": Family(lambda: jd.dion(0.02, rank_fraction=0.5), per_worker_state=True),
    "muon": Family(lambda: jd.muon(0.02, num_workers=N_WORKERS), per_worker_state=False),
    "dion2": Family(lambda: jd.dion2(0.02, fraction=0.5, num_workers=N_WORKERS), per_worker_state=False),
}


def _make_step(family: Family, mesh: jax.sharding.Mesh) -> jd.DataParallelStep:
    return jd.data_parallel_step(
        _loss,
        family.make(),
        mesh=mesh,
        per_worker_params=family.per_worker_params,
        loss_scale=jd.loss_scale if family.bf16 else None,
    )


def _run(step, params, opt_state, start: int, stop: int):
    losses = []
    for t in range(start, stop):
        params, opt_state, metrics = step(params, opt_state, _batch(t))
        losses.append(float(metrics["loss"]))  # waits for the step
    return params, opt_state, losses


def _abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings of a placed tree: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# ----------------------------------------------------------------------------
# Tests.


@pytest.mark.parametrize("name", list(FAMILIES))
def test_resume_from_checkpoint_is_bit_identical(name, tmp_path):
    family = FAMILIES[name]
    mesh = helpers.make_mesh(N_WORKERS)
    p0 = _params0(jnp.bfloat16 if family.bf16 else jnp.float32)

    # Uninterrupted: 10 steps, checkpoint, 10 more.
    step = _make_step(family, mesh)
    params, opt_state = step.init(p0)
    params, opt_state, _ = _run(step, params, opt_state, 0, STEPS)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(STEPS, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        mngr.wait_until_finished()
    saved = jax.device_get({"params": params, "opt_state": opt_state})
    params, opt_state, losses = _run(step, params, opt_state, STEPS, 2 * STEPS)

    # Resumed: a new step object; the target layout from abstract_init, which
    # must match a freshly placed state.
    fresh = _make_step(family, mesh)
    target = dict(zip(("params", "opt_state"), fresh.init(p0)))
    abstract = dict(zip(("params", "opt_state"), fresh.abstract_init(p0)))
    assert abstract == _abstract(target)
    with ocp.CheckpointManager(tmp_path) as mngr:
        assert mngr.latest_step() == STEPS
        restored = mngr.restore(STEPS, args=ocp.args.StandardRestore(abstract))
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(target)):
        assert isinstance(got, jax.Array), jax.tree_util.keystr(path)
        assert got.sharding == want.sharding, (jax.tree_util.keystr(path), got.sharding, want.sharding)
    helpers.assert_trees_equal(restored, saved)
    params2, opt_state2, losses2 = _run(fresh, restored["params"], restored["opt_state"], STEPS, 2 * STEPS)

    assert losses2 == losses
    helpers.assert_trees_equal(params2, params)
    helpers.assert_trees_equal(opt_state2, opt_state)

    # The state really holds per-worker leaves on the mesh where the family has them.
    mask = fresh.placement(p0).per_worker
    per_worker = [x for x, m in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(mask)) if m]
    assert bool(per_worker) == family.per_worker_state
    for x in per_worker:
        assert x.sharding.spec == P("data") and x.shape[0] == N_WORKERS
    if family.per_worker_state:
        rows = [
            np.asarray(x)
            for x, m in zip(jax.tree.leaves(opt_state2), jax.tree.leaves(mask))
            if m and np.asarray(x).size
        ]
        assert any(np.any(r[0] != r[1]) for r in rows), "per-worker state is the same on every worker"
    want_params_spec = P("data") if family.per_worker_params else P()
    assert all(x.sharding.spec == want_params_spec for x in jax.tree.leaves(restored["params"]))


def test_typed_prng_keys_round_trip_with_their_sharding(tmp_path):
    """New-style keys (``jax.random.key``) save and restore as keys, per-worker or shared."""
    mesh = helpers.make_mesh(N_WORKERS)
    tree = {
        "per_worker": jax.device_put(
            jax.random.split(jax.random.key(3), N_WORKERS), jax.sharding.NamedSharding(mesh, P("data"))
        ),
        "shared": jax.device_put(jax.random.key(4), jax.sharding.NamedSharding(mesh, P())),
    }
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
        restored = mngr.restore(0, args=ocp.args.StandardRestore(_abstract(tree)))
    for name, x in tree.items():
        got = restored[name]
        assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key), name
        assert jax.random.key_impl(got) == jax.random.key_impl(x)
        assert got.sharding == x.sharding
        helpers.assert_trees_equal(jax.random.key_data(got), jax.random.key_data(x))
