"""optax wrappers that branch with lax.cond: MultiSteps, apply_if_finite, reduce_on_plateau."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

LR = 0.1
SHAPES = {"w": (4, 3), "b": (3,)}

AGGREGATORS = {
    "all_reduce": lambda: jd.all_reduce(),
    "top_k": lambda: jd.top_k(2),
    "sign_majority_vote": jd.sign_majority_vote,
    "qsgd": lambda: jd.qsgd(4),
    "adasum": jd.adasum,
    "powersgd": lambda: jd.powersgd(1, min_compression_rate=0.0),
}


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_multisteps_runs_under_shard_map_and_equals_accumulate(name):
    """MultiSteps types (its accumulator per-worker, its counters replicated) and gives
    the same updates as accumulate, which communicates only on the k-th step."""
    n, k, T = 2, 2, 4
    grads = helpers.grads_seq(5, T, n, SHAPES)
    params = helpers.zeros(SHAPES)
    inner = lambda: optax.chain(AGGREGATORS[name](), jd.sgd(LR))  # noqa: E731
    ms, _, _ = helpers.run_steps(optax.MultiSteps(inner(), k), grads, params, backend="shard_map")
    acc, _, _ = helpers.run_steps(jd.accumulate(inner(), k), grads, params, backend="shard_map")
    helpers.assert_trees_close(ms, acc, rtol=1e-5, atol=1e-6)
    assert all(np.all(np.asarray(x)[0] == 0) for x in jax.tree.leaves(ms))  # step 1 only accumulates


def test_multisteps_placement_keeps_counters_replicated():
    mesh = helpers.make_mesh(2)
    tx = optax.MultiSteps(optax.chain(jd.top_k(2), jd.sgd(LR)), 2)
    placement = jd.opt_state_placement(tx, helpers.zeros(SHAPES), mesh=mesh)
    mask = placement.per_worker
    assert not mask.mini_step and not mask.gradient_step
    assert all(jax.tree.leaves(mask.acc_grads))
    assert all(jax.tree.leaves(mask.inner_opt_state[0].residual))
    assert not placement.updates_per_worker


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"][None] - b["y"]) ** 2)


def _batch(seed, rows=8):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 4)).astype(np.float32),
        "y": rng.normal(size=(rows, 3)).astype(np.float32),
    }


def test_multisteps_all_reduce_equals_k_times_batch_sgd():
    n, k = 2, 2
    params = {"w": jnp.ones((4, 3)) * 0.1, "b": jnp.zeros((3,))}
    step = jd.data_parallel_step(
        _loss, optax.MultiSteps(optax.chain(jd.all_reduce(), jd.sgd(LR)), k), mesh=helpers.make_mesh(n)
    )
    p, s = step.init(params)
    batches = [_batch(i) for i in range(2 * k)]
    for b in batches:
        p, s, _ = step(p, s, b)
    ref = params
    for j in range(2):
        big = jax.tree.map(lambda *xs: np.concatenate(xs), *batches[j * k : (j + 1) * k])
        ref = jax.tree.map(lambda w, g: w - LR * g, ref, jax.grad(_loss)(ref, big))
    helpers.assert_trees_close(p, ref, rtol=1e-5, atol=1e-6)


def test_apply_if_finite_names_the_replacement():
    tx = optax.apply_if_finite(optax.chain(jd.powersgd(1, min_compression_rate=0.0), jd.sgd(LR)), 3)
    step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(2))
    with pytest.raises(TypeError, match="apply_if_finite_everywhere"):
        step.init({"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))})


def test_apply_if_finite_everywhere_runs_the_same_chain():
    params = {"w": jnp.ones((4, 3)) * 0.1, "b": jnp.zeros((3,))}
    inner = lambda: optax.chain(jd.powersgd(1, min_compression_rate=0.0), jd.sgd(LR))  # noqa: E731
    out = []
    for tx in (jd.apply_if_finite_everywhere(inner(), 3), inner()):
        step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(2))
        p, s = step.init(params)
        for i in range(2):
            p, s, _ = step(p, s, _batch(i))
        out.append(p)
    helpers.assert_trees_close(out[0], out[1], rtol=1e-6, atol=1e-7)


def test_reduce_on_plateau_with_per_worker_loss_names_mean_value():
    tx = optax.chain(jd.all_reduce(), jd.sgd(LR), optax.contrib.reduce_on_plateau())
    step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(2))
    with pytest.raises(TypeError, match="mean_value"):
        step.init({"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))})


def _plateau():
    return optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_mean_value_gives_every_worker_the_plateau_of_the_mean_loss(backend):
    n, T = 2, 5
    rng = np.random.default_rng(0)
    losses = rng.uniform(1.0, 2.0, size=(T, n)).astype(np.float32)  # per-worker, no trend
    tx = jd.mean_value(_plateau())

    def per_worker(vals):
        s = tx.init(jnp.ones(3))
        out = []
        for t in range(T):
            _, s = tx.update(jnp.ones(3), s, value=vals[t])
            out.append(s.scale)
        return jnp.stack(out)

    got = helpers.run_on_workers(per_worker, jnp.asarray(losses.T), backend=backend)  # replicated
    ref_tx = _plateau()  # one worker fed the mean loss
    s = ref_tx.init(jnp.ones(3))
    ref = []
    for t in range(T):
        _, s = ref_tx.update(jnp.ones(3), s, value=jnp.float32(losses[t].mean()))
        ref.append(float(s.scale))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert np.min(ref) < 1.0  # the schedule did act


def test_reduce_on_plateau_in_data_parallel_step_with_mean_value():
    params = {"w": jnp.ones((4, 3)) * 0.1, "b": jnp.zeros((3,))}
    tx = optax.chain(jd.top_k(2), jd.sgd(LR), jd.mean_value(_plateau()))
    step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(2))
    p, s = step.init(params)
    for i in range(3):
        p, s, m = step(p, s, _batch(i))
    assert np.isfinite(float(m["loss"]))
    placement = step.placement(params).per_worker
    assert not any(jax.tree.leaves(placement[2]))  # the plateau state is replicated


def test_mean_value_needs_value():
    tx = jd.mean_value(_plateau())
    with pytest.raises(ValueError, match="value"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))


def test_mean_value_sends_one_scalar_per_step():
    params = {"w": jnp.zeros((32, 8))}
    cost = jd.communication_cost(jd.mean_value(_plateau()), params, num_workers=4)
    ((site,),) = [cost.sites]
    assert (site.kind, site.payload_bytes, site.multiplier) == ("all_reduce", 4, 1)  # the float32 loss
    assert cost.calls == 1 and cost.sent_bytes == pytest.approx(2 * 3 / 4 * 4)  # ring all-reduce of 4 B
