"""Tests for iterate_average and averaged_params (jaxopt_dist/_src/averaging.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import IterateAverageState, averaged_params, iterate_average, top_k
from tests import helpers


def run_local(tx, grads, params):
    """Applies ``tx`` (no collectives) for every gradient in ``grads`` (leaves ``(T, ...)``).

    Returns the parameters after each step (leaves ``(T, ...)``) and the state after each step.
    """
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state = tx.init(params)
    ps, states = [], []
    for t in range(jax.tree.leaves(grads)[0].shape[0]):
        u, state = step(jax.tree.map(lambda x: x[t], grads), state, params)
        params = optax.apply_updates(params, u)
        ps.append(params)
        states.append(state)
    return jax.tree.map(lambda *xs: np.stack(xs), *ps), states


def np_weighted_average(iterates, weights):
    """Average of ``iterates[t]`` (the params after step t) with ``weights[t]``, after each step.

    Where all weights so far are zero the average is the latest iterate.
    """
    out = []
    for T in range(1, len(weights) + 1):
        w = np.asarray(weights[:T], np.float64)
        if w.sum() == 0:
            out.append(iterates[T - 1])
        else:
            out.append(np.tensordot(w, iterates[:T].astype(np.float64), axes=1) / w.sum())
    return np.stack(out)


def np_mlbench(iterates, tau):
    """mlbench SparsifiedSGD.update_estimated_weights, as an online rule."""
    est = None
    out = []
    for t, x in enumerate(iterates.astype(np.float64)):
        denom = (1 + t) * (6 * tau**2 + t + 6 * tau * t + 2 * t**2)
        rho = 6 * (t + tau) ** 2 / denom if denom else 1.0
        est = x if est is None else est * (1 - rho) + x * rho
        out.append(est)
    return np.stack(out)


def _grads(T=40, shape=(5,), seed=0):
    return {"v": np.random.default_rng(seed).standard_normal((T, *shape)).astype(np.float32)}


@pytest.mark.parametrize("shift", [0.0, 1.0, 7.5])
def test_quadratic_matches_weighted_average_and_mlbench(shift):
    T = 40
    grads = _grads(T)
    params = {"v": jnp.zeros(5)}
    tx = optax.chain(optax.sgd(0.1), iterate_average(shift=shift))
    ps, states = run_local(tx, grads, params)
    got = np.stack([np.asarray(averaged_params(s)["v"]) for s in states])
    weights = (shift + np.arange(T)) ** 2
    np.testing.assert_allclose(got, np_weighted_average(ps["v"], weights), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, np_mlbench(ps["v"], shift), rtol=1e-5, atol=1e-6)


def test_uniform_is_the_running_mean():
    T = 25
    grads = _grads(T, seed=1)
    ps, states = run_local(
        optax.chain(optax.sgd(0.3), iterate_average(weighting="uniform")), grads, {"v": jnp.ones(5)}
    )
    got = np.stack([np.asarray(averaged_params(s)["v"]) for s in states])
    expected = np.cumsum(ps["v"].astype(np.float64), axis=0) / np.arange(1, T + 1)[:, None]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_scheduled_shift_sums_weights_like_the_closed_form():
    T = 30
    grads = _grads(T, seed=2)
    params = {"v": jnp.zeros(5)}
    _, closed = run_local(optax.chain(optax.sgd(0.1), iterate_average(shift=3.0)), grads, params)
    _, summed = run_local(
        optax.chain(optax.sgd(0.1), iterate_average(shift=optax.constant_schedule(3.0))), grads, params
    )
    for a, b in zip(closed, summed):
        helpers.assert_trees_close(averaged_params(a), averaged_params(b), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a[1].weight_sum, b[1].weight_sum, rtol=1e-6)


def test_varying_schedule_weights():
    """A shift that changes with the step: weights (a_t + t)^2 with a_t read at step t."""
    T = 12
    grads = _grads(T, seed=3)
    sched = lambda t: 2.0 * (t % 3)  # noqa: E731
    ps, states = run_local(
        optax.chain(optax.sgd(0.1), iterate_average(shift=sched)), grads, {"v": jnp.zeros(5)}
    )
    weights = [(2.0 * (t % 3) + t) ** 2 for t in range(T)]
    got = np.stack([np.asarray(averaged_params(s)["v"]) for s in states])
    np.testing.assert_allclose(got, np_weighted_average(ps["v"], weights), rtol=1e-5, atol=1e-6)


def test_before_any_step_the_average_is_the_initial_params():
    params = {"v": jnp.arange(3.0), "m": jnp.ones((2, 2))}
    state = iterate_average().init(params)
    helpers.assert_trees_equal(averaged_params(state), params)


def test_updates_pass_through_unchanged():
    tx = iterate_average()
    params = {"v": jnp.arange(3.0)}
    u = {"v": jnp.array([0.5, -1.0, 2.0])}
    out, _ = tx.update(u, tx.init(params), params)
    helpers.assert_trees_equal(out, u)


def test_low_precision_params_are_averaged_in_float32():
    params = {"v": jnp.zeros(4, jnp.bfloat16)}
    tx = optax.chain(optax.sgd(1.0), iterate_average(weighting="uniform"))
    state = tx.init(params)
    assert averaged_params(state)["v"].dtype == jnp.float32
    g = {"v": jnp.full(4, -1.0, jnp.bfloat16)}
    for _ in range(3):
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    assert params["v"].dtype == jnp.bfloat16
    np.testing.assert_allclose(averaged_params(state)["v"], np.full(4, 2.0))  # mean of 1, 2, 3


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_data_parallel_average_is_replicated(backend):
    """Last in a chain after a compressor: a replicated average of the replicated params."""
    n, T, lr = 3, 6, 0.1
    rng = np.random.default_rng(5)
    grads = {"v": rng.standard_normal((T, n, 8)).astype(np.float32)}
    tx = optax.chain(top_k(3), jd.sgd(lr), iterate_average(shift=2.0))
    params = {"v": jnp.zeros(8)}
    placement = jd.opt_state_placement(tx, params, mesh=helpers.make_mesh(n))
    assert not any(jax.tree.leaves(placement.per_worker[2]))
    updates, final, state = helpers.run_steps(tx, grads, params, backend=backend)
    iterates = np.cumsum(np.asarray(updates["v"]), axis=0)  # params start at zero
    expected = np_weighted_average(iterates, (2.0 + np.arange(T)) ** 2)[-1]
    avg = np.asarray(averaged_params(state)["v"])  # stacked per worker by run_steps
    helpers.assert_replicas_equal(avg)
    np.testing.assert_allclose(avg[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(iterates[-1], final["v"], rtol=1e-5, atol=1e-6)


def test_per_worker_params_average_per_worker():
    n, T = 2, 5
    rng = np.random.default_rng(6)
    grads = {"v": rng.standard_normal((T, n, 4)).astype(np.float32)}
    tx = optax.chain(jd.sgd(0.5), iterate_average(weighting="uniform"))
    params = {"v": jnp.zeros(4)}
    assert (
        jd.opt_state_placement(tx, params, mesh=helpers.make_mesh(n), per_worker_params=True)
        .per_worker[1]
        .average["v"]
    )
    updates, _, state = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    iterates = np.cumsum(np.asarray(updates["v"]), axis=0)  # (T, n, 4)
    np.testing.assert_allclose(averaged_params(state)["v"], iterates.mean(0), rtol=1e-5, atol=1e-6)


def test_inside_multisteps_averages_only_real_steps():
    T = 6
    grads = _grads(T, seed=7)
    params = {"v": jnp.zeros(5)}
    tx = optax.MultiSteps(
        optax.chain(optax.sgd(1.0), iterate_average(weighting="uniform")), every_k_schedule=2
    )
    ps, states = run_local(tx, grads, params)
    real = ps["v"][1::2]  # params after each emitted update
    got = np.asarray(averaged_params(states[-1])["v"])
    np.testing.assert_allclose(got, real.mean(0), rtol=1e-5, atol=1e-6)


def test_contract():
    tx = optax.chain(optax.sgd(0.1), iterate_average(shift=1.5))
    params = {"v": jnp.zeros(5), "m": jnp.zeros((2, 3))}
    state = tx.init(params)
    helpers.assert_dtypes_equal(jax.eval_shape(tx.init, params), state)
    traces = []

    @jax.jit
    def step(g, s, p):
        traces.append(1)
        return tx.update(g, s, p, unknown_extra=3, value=jnp.float32(1))

    g = jax.tree.map(jnp.ones_like, params)
    _, s2 = step(g, state, params)
    helpers.assert_dtypes_equal(s2, state)
    step(jax.tree.map(lambda x: 2 * x, g), s2, params)
    assert len(traces) == 1


def test_inject_hyperparams_shift():
    T = 10
    grads = _grads(T, seed=8)
    params = {"v": jnp.zeros(5)}
    a = optax.chain(
        optax.sgd(0.1), optax.inject_hyperparams(iterate_average, static_args=("weighting",))(shift=4.0)
    )
    b = optax.chain(optax.sgd(0.1), iterate_average(shift=4.0))
    _, sa = run_local(a, grads, params)
    _, sb = run_local(b, grads, params)
    helpers.assert_trees_close(averaged_params(sa[-1]), averaged_params(sb[-1]), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# Bad inputs.


def test_bad_weighting():
    with pytest.raises(
        ValueError, match=r"`weighting` must be one of \('quadratic', 'uniform'\); got 'cubic'"
    ):
        iterate_average(weighting="cubic")


def test_negative_shift():
    with pytest.raises(ValueError, match=r"`shift` must lie in \[0, inf\)"):
        iterate_average(shift=-1.0)


def test_update_needs_params():
    tx = iterate_average()
    with pytest.raises(
        ValueError, match=r"`iterate_average` needs `params` \(it averages params \+ updates, so put it last"
    ):
        tx.update({"v": jnp.ones(2)}, tx.init({"v": jnp.zeros(2)}))


def test_averaged_params_needs_exactly_one_state():
    with pytest.raises(ValueError, match=r"found 0"):
        averaged_params(optax.sgd(0.1).init({"v": jnp.zeros(2)}))
    one = iterate_average().init({"v": jnp.zeros(2)})
    assert isinstance(one, IterateAverageState)
    with pytest.raises(ValueError, match=r"found 2"):
        averaged_params((one, one))


def test_reshard_rules_regroup_the_average():
    from jaxopt_dist._src import base

    assert base.reshard_rule(IterateAverageState, "average") == base.REGROUP
    assert base.reshard_rule(IterateAverageState, "weight_sum") is None
