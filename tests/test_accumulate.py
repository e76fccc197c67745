"""accumulate(tx, every_k): local sums, one communication per every_k micro-steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

SHAPES = {"w": (3, 4), "b": (4,)}
LR = 0.1


def _np_accumulate(grads, k, inner_step, mean=True):
    """NumPy loop over steps and workers: ``inner_step(list of per-worker x) -> update``
    runs on the k-th micro-step with x_i = (sum of worker i's micro-steps) / k."""
    T, n = grads.shape[:2]
    acc = np.zeros(grads.shape[1:], np.float64)
    out = []
    for t in range(T):
        acc += grads[t]
        if t % k == k - 1:
            out.append(inner_step([acc[i] / (k if mean else 1) for i in range(n)]))
            acc[:] = 0
        else:
            out.append(np.zeros(grads.shape[2:]))
    return np.stack(out)


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_accumulate_all_reduce_matches_reference(backend, n):
    k, T = 2, 4
    grads = helpers.grads_seq(0, T, n, {"w": (3, 4)})
    tx = jd.accumulate(optax.chain(jd.all_reduce(), jd.sgd(LR)), every_k=k)
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros({"w": (3, 4)}), backend=backend)
    ref = _np_accumulate(np.asarray(grads["w"], np.float64), k, lambda xs: -LR * np.mean(xs, 0))
    np.testing.assert_allclose(updates["w"], ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(state.count, np.full((n,), T))
    np.testing.assert_array_equal(state.acc["w"], 0.0)  # reset after the last communication


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_use_grad_mean_false_sums(backend):
    n, k, T = 2, 3, 3
    grads = helpers.grads_seq(1, T, n, {"w": (5,)})
    tx = jd.accumulate(jd.all_reduce(reduction="sum"), every_k=k, use_grad_mean=False)
    updates, _, _ = helpers.run_steps(tx, grads, helpers.zeros({"w": (5,)}), backend=backend)
    ref = _np_accumulate(np.asarray(grads["w"], np.float64), k, lambda xs: np.sum(xs, 0), mean=False)
    np.testing.assert_allclose(updates["w"], ref, rtol=1e-5, atol=1e-6)


def _np_top1(x):
    out = np.zeros_like(x)
    i = int(np.argmax(np.abs(x)))
    out[i] = x[i]
    return out


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("n", [2, 8])
def test_accumulate_top_k_residual_applied_once_per_communication(backend, n):
    k, T = 3, 6
    grads = helpers.grads_seq(2, T, n, {"w": (6,)})
    tx = jd.accumulate(jd.top_k(1), every_k=k)
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros({"w": (6,)}), backend=backend)

    residual = np.zeros((n, 6))

    def top_k_ef(xs):
        sent = []
        for i, x in enumerate(xs):
            corrected = x + residual[i]
            s = _np_top1(corrected)
            residual[i] = corrected - s
            sent.append(s)
        return np.mean(sent, 0)

    ref = _np_accumulate(np.asarray(grads["w"], np.float64), k, top_k_ef)
    np.testing.assert_allclose(updates["w"], ref, rtol=1e-5, atol=1e-6)
    ef_state = state.inner_state
    np.testing.assert_allclose(ef_state.residual["w"], residual, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ef_state.count, np.full((n,), T // k))  # one compression per k


def _collective_sites(jaxpr, inside=None, out=None):
    """Collectives of a jaxpr, each with the chain of enclosing (primitive, branch) pairs."""
    out = [] if out is None else out
    inside = () if inside is None else inside
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name.startswith(("psum", "all_gather", "pmax", "pmin", "ppermute", "all_to_all")):
            out.append((name, inside))
        if name == "cond":
            for b, branch in enumerate(e.params["branches"]):
                _collective_sites(branch.jaxpr, inside + (("cond", b),), out)
            continue
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _collective_sites(inner, inside, out)
    return out


@pytest.mark.parametrize(
    "make",
    [lambda: jd.all_reduce(), lambda: jd.top_k(2), lambda: jd.powersgd(1, min_compression_rate=0.0)],
    ids=["all_reduce", "top_k", "powersgd"],
)
def test_collectives_run_only_in_the_communicating_branch(make):
    params = {"w": jnp.zeros((4, 3))}
    inner = optax.chain(make(), jd.sgd(LR))
    f, g = helpers.update_program(jd.accumulate(inner, every_k=4), params, 2)
    sites = _collective_sites(jax.make_jaxpr(f)(g).jaxpr)
    f0, g0 = helpers.update_program(inner, params, 2)
    plain = _collective_sites(jax.make_jaxpr(f0)(g0).jaxpr)
    assert sites, "no collective traced"
    # Every collective sits in one branch of the outermost cond (the k-th step's), as
    # many as one plain update issues, and the other branch sends nothing.
    outer = {s[1][0] for s in sites}
    assert len(outer) == 1 and all(s[1] and s[1][0][0] == "cond" for s in sites)
    assert sorted(s[0] for s in sites) == sorted(s[0] for s in plain)


def test_accumulate_equals_k_times_larger_batch_sgd():
    n, k, micro = 4, 2, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(k * micro, 8, 3)).astype(np.float32)  # micro-batches of 8 rows
    y = rng.normal(size=(k * micro, 8, 2)).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)).astype(np.float32)), "b": jnp.zeros((2,))}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] + p["b"][None] - b["y"]) ** 2)

    mesh = helpers.make_mesh(n)
    tx = jd.accumulate(optax.chain(jd.all_reduce(), jd.sgd(LR)), every_k=k)
    step = jd.data_parallel_step(loss, tx, mesh=mesh)
    p, s = step.init(params)
    for t in range(k * micro):
        p, s, _ = step(p, s, {"x": x[t], "y": y[t]})

    ref = params
    for j in range(micro):  # one step on the k micro-batches together
        big = {
            "x": np.concatenate(list(x[j * k : (j + 1) * k])),
            "y": np.concatenate(list(y[j * k : (j + 1) * k])),
        }
        ref = jax.tree.map(lambda w, g: w - LR * g, ref, jax.grad(loss)(ref, big))
    helpers.assert_trees_close(p, ref, rtol=1e-5, atol=1e-6)


def test_accumulate_bad_inputs():
    with pytest.raises(ValueError, match="every_k"):
        jd.accumulate(jd.all_reduce(), every_k=0)
    with pytest.raises(TypeError, match="every_k"):
        jd.accumulate(jd.all_reduce(), every_k=1.5)
    with pytest.raises(TypeError, match="`tx`"):
        jd.accumulate("sgd", every_k=2)
    with pytest.raises(TypeError, match="use_grad_mean"):
        jd.accumulate(jd.all_reduce(), every_k=2, use_grad_mean="yes")


def test_accumulate_every_k_1_is_the_inner_transform():
    grads = helpers.grads_seq(3, 2, 2, {"w": (4,)})
    inner = optax.chain(jd.top_k(2), jd.sgd(LR))
    a, _, _ = helpers.run_steps(
        jd.accumulate(inner, every_k=1), grads, helpers.zeros({"w": (4,)}), backend="vmap"
    )
    b, _, _ = helpers.run_steps(inner, grads, helpers.zeros({"w": (4,)}), backend="vmap")
    helpers.assert_trees_equal(a, b)


@pytest.mark.parametrize(
    "make", [lambda: jd.all_reduce(), lambda: jd.top_k(2), lambda: jd.powersgd(1, min_compression_rate=0.0)]
)
def test_communication_cost_is_the_inner_cost_spread_over_every_k(make):
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros((8,))}
    inner = optax.chain(make(), jd.sgd(LR))
    plain = jd.communication_cost(inner, params, num_workers=4)
    acc = jd.communication_cost(jd.accumulate(inner, every_k=4), params, num_workers=4)
    assert plain.sent_bytes > 0
    assert acc.sent_bytes == pytest.approx(plain.sent_bytes / 4, rel=1e-12)
    assert acc.peak_sent_bytes == pytest.approx(plain.sent_bytes, rel=1e-12)  # the k-th step sends it all


def test_injected_learning_rate_changes_without_recompiling():
    # The inner optimizer's hyperparameters live in accumulate's state and can
    # be changed between calls (a traced value: one compilation).
    n, k = 2, 2
    inner = optax.chain(jd.all_reduce(), optax.inject_hyperparams(jd.sgd)(learning_rate=LR))
    tx = jd.accumulate(inner, every_k=k)
    traces = []

    def step(g, s, p):
        traces.append(1)
        return tx.update(g, s, p)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    g = {"w": jnp.ones((n, 3))}
    p = helpers.zeros({"w": (n, 3)})
    s = jax.vmap(tx.init)(p)
    updates = []
    for t in range(2 * k):
        if t == k:  # halve the learning rate before the second communication
            hp = s.inner_state[1].hyperparams
            hp["learning_rate"] = hp["learning_rate"] * 0.5
        u, s = run(g, s, p)
        updates.append(np.asarray(u["w"]))
    assert len(traces) == 1
    np.testing.assert_allclose(updates[k - 1], -LR)
    np.testing.assert_allclose(updates[2 * k - 1], -LR / 2)
    assert all(np.all(updates[t] == 0) for t in range(2 * k) if t % k != k - 1)
