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

# (id, factory, per_worker_params). Local and aggregation transforms are tested
# inside a typical chain (see _chain); compressors and combiners as given.
_BASIS = np.linalg.qr(np.random.default_rng(0).standard_normal((15, 3)))[0].T.astype(np.float32)
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
    ("top_k", lambda: jd.top_k(k=2), False),
    ("top_k_flat_no_ef", lambda: jd.top_k(density=0.2, per_leaf=False, error_feedback=False), False),
    ("random_k", lambda: jd.random_k(k=2), False),
    ("block_k", lambda: jd.block_k(density=0.5), False),
    ("threshold", lambda: jd.threshold(0.5, capacity=2), False),
    ("sign_majority_vote", lambda: jd.sign_majority_vote(), False),
    ("scaled_sign", lambda: jd.scaled_sign(), False),
    ("qsgd", lambda: jd.qsgd(4), False),
    ("powersgd", lambda: jd.powersgd(rank=1, min_compression_rate=1.0), False),
    (
        "powersgd_one_allreduce",
        lambda: jd.powersgd(rank=2, one_allreduce=True, min_compression_rate=1.0),
        False,
    ),
    ("adasum", lambda: jd.adasum(), False),
    # Robust rules: trim 0 on these 2 workers (a trim needs more than 2 trim workers).
    ("trimmed_mean", lambda: jd.trimmed_mean(0), False),
    ("coordinate_median", lambda: jd.coordinate_median(), False),
    ("centered_clip", lambda: jd.centered_clip(10.0), False),
    ("norm_clipped_mean", lambda: jd.norm_clipped_mean(), False),
    ("adasum_halving", lambda: jd.adasum(method="halving"), False),
    ("gossip_ring", lambda: jd.gossip("ring", track_consensus=True), True),
    ("iterate_average", lambda: jd.iterate_average(), False),
    ("dynamic_loss_scale", lambda: jd.dynamic_loss_scale(jd.sgd(0.1), axis_name="data"), False),
    ("apply_if_finite_everywhere", lambda: jd.apply_if_finite_everywhere(jd.sgd(0.1)), False),
    ("dim_reduce", lambda: jd.dim_reduce(_BASIS), False),
    ("accumulate", lambda: jd.accumulate(optax.chain(jd.top_k(k=2), jd.sgd(0.1, 0.9)), every_k=2), False),
    ("mean_value", lambda: jd.mean_value(optax.contrib.reduce_on_plateau(patience=1)), False),
    ("low_bit", lambda: jd.low_bit(block_size=4), False),
    ("diloco", lambda: jd.diloco(jd.sgd(0.1), sync_every=2, aggregate=jd.low_bit(block_size=4)), True),
    ("diloco_streaming", lambda: jd.diloco(jd.sgd(0.1), sync_every=4, num_fragments=2, sync_delay=1), True),
    ("decoupled_momentum", lambda: jd.decoupled_momentum(0.01, chunk=2, topk=1), False),
    ("onebit_adam", lambda: jd.onebit_adam(0.01, freeze_step=1, num_workers=N), False),
    ("choco_gossip", lambda: jd.choco_gossip(jd.top_k(k=2), consensus_step=0.5), True),
    # hierarchical needs two mesh axes: its contract checks are in test_hierarchical.py.
]
# Transforms whose output is not their input's dtype by design: master_weights emits
# float32 updates for bf16 params (tested in test_precision.py).
_AGGREGATORS = {"all_reduce", "all_reduce_bf16_flat"}
_CENTRALIZED = {
    "top_k",
    "top_k_flat_no_ef",
    "random_k",
    "block_k",
    "threshold",
    "sign_majority_vote",
    "scaled_sign",
    "qsgd",
    "powersgd",
    "powersgd_one_allreduce",
    "adasum",
    "adasum_halving",
    "low_bit",
    "trimmed_mean",
    "coordinate_median",
    "centered_clip",
    "norm_clipped_mean",
}
# Aggregate and step on their own (diloco: local steps and the outer step).
_SELF_CONTAINED = {
    "dim_reduce",
    "accumulate",
    "decoupled_momentum",
    "onebit_adam",
    "diloco",
    "diloco_streaming",
}
IDS = [t[0] for t in TRANSFORMS]
N = 2
PARAMS = {"w": jnp.ones((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}


def _grads(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal((N, *p.shape)), dtype), PARAMS)


def _stack(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), tree)


def _chain(name, factory, per_worker):
    """The transform in a typical chain."""
    tx = factory()
    if name in _SELF_CONTAINED:
        return tx
    if per_worker:
        return optax.chain(jd.sgd(0.1), tx)  # local step, then combine parameters
    if name in _CENTRALIZED:
        return optax.chain(tx, jd.sgd(0.1, 0.9))  # combine gradients, then step
    return optax.chain(jd.all_reduce(), tx)  # aggregate, then the local transform


def _extras(p):
    """optax's line-search extra args (dim_reduce needs them; the others ignore them)."""

    def value_fn(q):
        return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(q))

    return {"value": value_fn(p), "value_fn": value_fn}


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_no_recompilation_and_unknown_extra_args(name, factory, per_worker):
    tx = _chain(name, factory, per_worker)
    traces = []

    def step(g, s, p):
        traces.append(1)
        u, s = tx.update(g, s, p, unknown_extra=jnp.ones(()), another=None, **_extras(p))
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
    tx = optax.MultiSteps(_chain(name, factory, per_worker), every_k_schedule=2)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    p = _stack(params)
    s = jax.vmap(tx.init)(p)
    dtypes = jax.tree.map(lambda x: x.dtype, s)

    def step(g, s, p):
        u, s = tx.update(g, s, p, **_extras(p))
        return u, s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    start = p
    for seed in range(4):
        u, s, p = run(_grads(seed, jnp.bfloat16), s, p)
        helpers.assert_dtypes_equal(u, p)
        assert jax.tree.map(lambda x: x.dtype, s) == dtypes
    assert any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(start)))


_ONE_WORKER = {
    # On one worker every aggregation is the identity and every lossless combiner too.
    "all_reduce": lambda: optax.identity(),
    "all_reduce_bf16_flat": lambda: optax.identity(),
    "average_params": lambda: jd.sgd(0.1),
    "gossip_ring": lambda: jd.sgd(0.1),
    "adasum": lambda: jd.sgd(0.1, 0.9),
    "adasum_halving": lambda: jd.sgd(0.1, 0.9),
    "choco_gossip": lambda: jd.sgd(0.1),
    # The robust rules keep one worker's update as it is (centered_clip: within its radius of 0).
    "trimmed_mean": lambda: jd.sgd(0.1, 0.9),
    "coordinate_median": lambda: jd.sgd(0.1, 0.9),
    "centered_clip": lambda: jd.sgd(0.1, 0.9),
    "norm_clipped_mean": lambda: jd.sgd(0.1, 0.9),
}
# Lossy compressors (lossy on one worker too), dim_reduce and iterate_average have
# their own one-worker tests in their modules' test files.
# mean_value needs the loss as an extra arg: test_wrappers.py checks it on one and more workers.
_ONE_WORKER_CASES = [
    t
    for t in TRANSFORMS
    if t[0] in _ONE_WORKER or not (t[0] in _CENTRALIZED or t[0] in _SELF_CONTAINED or t[0] == "mean_value")
]


@pytest.mark.parametrize("name,factory,per_worker", _ONE_WORKER_CASES, ids=[t[0] for t in _ONE_WORKER_CASES])
def test_one_worker_equals_local_computation(name, factory, per_worker):
    tx = _chain(name, factory, per_worker)
    # chain(all_reduce, X) on one worker is X, unless listed in _ONE_WORKER.
    local = _ONE_WORKER[name]() if name in _ONE_WORKER else factory()
    g1 = jax.tree.map(lambda x: x[:1], _grads(7))
    got = helpers.run_transform(tx, g1, backend="vmap", params=PARAMS, replicated=not per_worker)
    if per_worker:
        got = jax.tree.map(lambda x: x[0], got)
    want = helpers.run_transform(local, g1, backend="vmap", params=PARAMS, replicated=not per_worker)
    if per_worker:
        want = jax.tree.map(lambda x: x[0], want)
    tol = 4e-3 if "bf16" in name else 1e-6  # a bf16 wire rounds even a single worker's values
    helpers.assert_trees_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_data_parallel_step_places_state(name, factory, per_worker):
    """Every transform trains under data_parallel_step on 4 devices (shard_map, check_vma)."""
    mesh = helpers.make_mesh(4)
    if name == "onebit_adam":  # sized for its worker count
        factory = lambda: jd.onebit_adam(0.01, freeze_step=1, num_workers=4)  # noqa: E731
    tx = _chain(name, factory, per_worker)

    def loss_fn(p, b):
        pred = b["x"] @ p["w"] + p["b"][None, :]
        return jnp.mean((pred - b["y"]) ** 2)

    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=per_worker)
    params, opt_state = step.init(PARAMS)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((16, 4)).astype(np.float32),
        "y": rng.standard_normal((16, 3)).astype(np.float32),
    }
    losses = []
    for _ in range(3):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses))
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding.is_fully_replicated != per_worker


_LOCAL = {"sgd", "sign_sgd", "rmsprop", "adagrad", "adam", "scale_by_momentum", "iterate_average"}


@pytest.mark.parametrize("name,factory,per_worker", TRANSFORMS, ids=IDS)
def test_outside_a_mapped_axis(name, factory, per_worker):
    """Local transforms run anywhere; communicating ones name themselves and the axis."""
    tx = factory()
    g = jax.tree.map(lambda x: x[0], _grads(3))

    def call():
        return tx.update(g, tx.init(PARAMS), PARAMS, **_extras(PARAMS))

    if name in _LOCAL:
        updates, _ = call()
        helpers.assert_dtypes_equal(updates, g)
        return
    inner = {"accumulate": "top_k"}  # accumulate's inner transform is the one that communicates
    caller = inner.get(name) or next(
        c
        for c in (
            "all_reduce",
            "average_params",
            "top_k",
            "random_k",
            "block_k",
            "threshold",
            "sign_majority_vote",
            "scaled_sign",
            "qsgd",
            "powersgd",
            "adasum",
            "trimmed_mean",
            "coordinate_median",
            "centered_clip",
            "norm_clipped_mean",
            "gossip",
            "dynamic_loss_scale",
            "apply_if_finite_everywhere",
            "dim_reduce",
            "accumulate",
            "mean_value",
            "low_bit",
            "diloco",
            "decoupled_momentum",
            "onebit_adam",
            "choco_gossip",
        )
        if name.startswith(c)
    )
    with pytest.raises(jd.UnboundAxisError, match=rf"`{caller}` communicates over the axis 'data'"):
        call()
