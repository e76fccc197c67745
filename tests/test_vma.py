"""Updates that arrive already summed (typed invariant under shard_map with check_vma=True).

The gradient of a replicated parameter inside ``jax.shard_map(check_vma=True)``
comes back summed over the axis. all_reduce takes it as the sum; random_k,
block_k and PowerSGD (mean-only) run on ``sum / n``; nonlinear compressors
raise ``AlreadyReducedError`` naming the fix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

P = jax.sharding.PartitionSpec


def _run_mixed(fn, replicated_in, per_worker_in, n):
    """``fn(inv, var)`` under shard_map(check_vma=True): ``inv`` enters replicated
    (typed invariant), ``var`` stacked per worker; outputs replicated."""
    mesh = helpers.make_mesh(n)
    inv = jax.device_put(replicated_in, jax.sharding.NamedSharding(mesh, P()))
    var = jax.device_put(per_worker_in, jax.sharding.NamedSharding(mesh, P("data")))

    def body(inv, var):
        return fn(inv, jax.tree.map(lambda x: x[0], var))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=True)
    return jax.jit(mapped)(inv, var)


def _np_mean(stacked):
    return jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), axis=0), stacked)


# ----------------------------------------------------------------------------
# all_reduce, leaf by leaf.


@pytest.mark.parametrize("n", [1, 2, 8])
def test_all_reduce_mixed_tree_leafwise(n):
    rng = np.random.default_rng(n)
    summed = {"a": rng.normal(size=(3, 2)).astype(np.float32)}  # already the sum over workers
    per_worker = {"b": rng.normal(size=(n, 4)).astype(np.float32)}

    def fn(reduction, inv, var):
        tx = jd.all_reduce(reduction=reduction)
        return tx.update({**inv, **var}, tx.init({**inv, **var}))[0]

    mean = _run_mixed(functools.partial(fn, "mean"), summed, per_worker, n)
    total = _run_mixed(functools.partial(fn, "sum"), summed, per_worker, n)
    ref_b = _np_mean(per_worker)["b"]
    np.testing.assert_allclose(mean["a"], summed["a"] / n, rtol=1e-6)
    np.testing.assert_allclose(mean["b"], ref_b, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(total["a"], summed["a"])  # not communicated again
    np.testing.assert_allclose(total["b"], ref_b * n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 8])
def test_all_reduce_invariant_modes(n):
    x = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    var = {"unused": np.zeros((n, 1), np.float32)}

    def fn(invariant_updates, inv, _, **extra):
        tx = jd.all_reduce(invariant_updates=invariant_updates)
        return tx.update(inv, tx.init(inv), **extra)[0]

    as_mean = _run_mixed(functools.partial(fn, "mean"), x, var, n)
    np.testing.assert_array_equal(as_mean["a"], x["a"])  # already the mean
    custom = _run_mixed(functools.partial(fn, "sum", denominator=jnp.float32(4.0)), x, var, n)
    np.testing.assert_allclose(custom["a"], x["a"] / 4.0, rtol=1e-6)
    with pytest.raises(jd.AlreadyReducedError, match="invariant_updates='sum'"):
        _run_mixed(functools.partial(fn, "error"), x, var, n)


def test_all_reduce_jaxpr_has_no_collective_for_summed_leaves():
    n = 4
    mesh = helpers.make_mesh(n)
    tx = jd.all_reduce()

    def body(g):
        return tx.update(g, tx.init(g))[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True)
    text = str(jax.make_jaxpr(f)(jnp.ones((3,))))
    assert "psum" not in text


def test_bad_invariant_updates_option():
    for factory in (jd.all_reduce, jd.random_k, jd.powersgd):
        kwargs = {"density": 0.5} if factory is jd.random_k else {}
        with pytest.raises(ValueError, match="invariant_updates"):
            factory(invariant_updates="avg", **kwargs)


def test_vmap_and_check_vma_false_are_per_worker():
    """Without vma tracking every leaf is taken as this worker's own value."""
    g = jnp.arange(8.0).reshape(4, 2)
    tx = jd.all_reduce()
    out = jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="data")(g)
    np.testing.assert_allclose(out[0], np.mean(np.asarray(g), 0))
    mesh = helpers.make_mesh(4)

    def body(x):
        return tx.update(x[0], tx.init(x[0]))[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    out = f(jax.device_put(g, jax.sharding.NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(out, np.mean(np.asarray(g), 0))


# ----------------------------------------------------------------------------
# Mean-only compressors: an already-summed input gives what per-worker inputs with that sum give.


MEAN_ONLY = {
    "random_k": lambda: jd.random_k(density=0.5, seed=3),
    "block_k": lambda: jd.block_k(density=0.5, seed=3),
    "powersgd": lambda: jd.powersgd(rank=1, min_compression_rate=0.0),
}


@pytest.mark.parametrize("name", sorted(MEAN_ONLY))
@pytest.mark.parametrize("n", [1, 2, 8])
def test_mean_only_compressor_on_summed_input(name, n):
    rng = np.random.default_rng(7)
    per_worker = {"w": rng.normal(size=(n, 4, 3)).astype(np.float32)}
    summed = {"w": per_worker["w"].sum(0)}
    tx = MEAN_ONLY[name]()

    def two_steps(g):  # residual carried into the second step
        s = tx.init(g)
        u1, s = tx.update(g, s)
        u2, s = tx.update(g, s)
        return u1, u2

    from_sum = _run_mixed(lambda inv, _: two_steps(inv), summed, {"_": np.zeros((n, 1), np.float32)}, n)
    from_workers = helpers.run_on_workers(two_steps, per_worker, backend="shard_map")
    helpers.assert_trees_close(from_sum, from_workers, rtol=1e-5, atol=1e-6)


def test_mean_only_compressor_error_mode_names_the_option():
    tx = jd.random_k(density=0.5, invariant_updates="error")
    with pytest.raises(jd.AlreadyReducedError, match="invariant_updates='error'"):
        _run_mixed(
            lambda inv, _: tx.update(inv, tx.init(inv))[0],
            {"w": np.ones(4, np.float32)},
            {"_": np.zeros((2, 1))},
            2,
        )


# ----------------------------------------------------------------------------
# Nonlinear compressors: a clear error with the fix.


NONLINEAR = {
    "top_k": lambda: jd.top_k(density=0.5),
    "threshold": lambda: jd.threshold(0.1, capacity=2),
    "sign_majority_vote": jd.sign_majority_vote,
    "scaled_sign": jd.scaled_sign,
    "qsgd": lambda: jd.qsgd(4),
    "adasum": jd.adasum,
    "low_bit": lambda: jd.low_bit(block_size=64),
}


@pytest.mark.parametrize("name", sorted(NONLINEAR))
def test_nonlinear_rejects_summed_input_with_the_fix(name):
    tx = NONLINEAR[name]()
    fn = lambda inv, var: tx.update({**inv, **var}, tx.init({**inv, **var}))[0]  # noqa: E731
    with pytest.raises(jd.AlreadyReducedError) as info:
        # a mixed tree: one leaf summed, one per-worker
        _run_mixed(fn, {"a": np.ones((4,), np.float32)}, {"b": np.ones((2, 4), np.float32)}, 2)
    msg = str(info.value)
    assert f"`{name}`" in msg and "already summed" in msg and "1 of 2 leaves (['a'])" in msg
    assert "jax.lax.pcast(params, 'data', to='varying')" in msg
    assert "check_vma=False" in msg and "data_parallel_step" in msg


# ----------------------------------------------------------------------------
# The Flax NNX plain nnx.shard_map loop: every path against one device.


@pytest.fixture(scope="module")
def example():
    return helpers.load_example("flax_nnx_plain_shard_map")


@pytest.mark.parametrize(
    "name", ["all_reduce", "all_reduce(sum)", "random_k(density=1)", "powersgd(full rank)"]
)
def test_nnx_loop_exact_methods_match_single_device(example, name):
    assert name in example.LINEAR
    res = example.compare(name, workers=4)
    for path, diff in res.items():
        assert not isinstance(diff, Exception), (path, diff)
        assert diff < 1e-6, (path, diff)


@pytest.mark.parametrize("name", ["top_k(density=1)", "adasum"])
def test_nnx_loop_nonlinear_raises_and_pcast_fixes_it(example, name):
    data = example.make_data()
    make = lambda: optax.chain(example.AGGREGATORS[name](), jd.sgd(example.LR))  # noqa: E731
    with pytest.raises(jd.AlreadyReducedError, match="already summed"):
        example.train_plain_shard_map(make(), data, workers=4, check_vma=True)
    fixed = example.train_plain_shard_map(make(), data, workers=4, check_vma=True, per_worker_grads=True)
    unchecked = example.train_plain_shard_map(make(), data, workers=4, check_vma=False)
    assert example.max_diff(fixed, unchecked) < 1e-6


def test_nnx_example_main_prints_table(example, capsys, monkeypatch):
    monkeypatch.setattr(example, "AGGREGATORS", {"qsgd": example.AGGREGATORS["qsgd"]})
    results = example.main(["--workers", "2"])
    assert "AlreadyReducedError" in capsys.readouterr().out
    assert isinstance(results["qsgd"]["check_vma=True"], jd.AlreadyReducedError)
    # qsgd is unbiased but lossy: close to, not equal to, one device
    assert 0 < results["qsgd"]["check_vma=False"] < 0.1
    assert abs(results["qsgd"]["check_vma=False"] - results["qsgd"]["data_parallel_step"]) < 1e-6


def test_all_reduce_tuple_axis_partly_summed():
    """Varying over "a", already summed over "b": the total is the sum over "a" alone."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)  # row i: the sum over "b" on a == i
    x = jax.device_put(rows, jax.sharding.NamedSharding(mesh, P("a")))

    def body(reduction, x):
        tx = jd.all_reduce(axis_name=("a", "b"), reduction=reduction)
        return tx.update(x[0], tx.init(x[0]))[0]

    for reduction, ref in (("mean", rows.sum(0) / 4), ("sum", rows.sum(0))):
        f = jax.shard_map(
            functools.partial(body, reduction), mesh=mesh, in_specs=P("a"), out_specs=P(), check_vma=True
        )
        np.testing.assert_allclose(jax.jit(f)(x), ref, rtol=1e-6)


# ----------------------------------------------------------------------------
# A user's own step with the state replicated (out_specs=P()): updates that arrive
# already reduced keep the residual replicated, and the numbers are those of
# per-worker gradients with that sum (or mean).


LINEAR_STATEFUL = {
    "random_k": lambda **kw: jd.random_k(density=0.4, seed=3, **kw),
    "block_k": lambda **kw: jd.block_k(density=0.4, seed=3, **kw),
    "powersgd": lambda **kw: jd.powersgd(rank=2, **kw),
    "powersgd(one_allreduce)": lambda **kw: jd.powersgd(rank=1, one_allreduce=True, start_step=1, **kw),
    "powersgd(cold)": lambda **kw: jd.powersgd(rank=1, warm_start=False, min_compression_rate=0.0, **kw),
}
STEP_SHAPES = {"w": (12, 6), "c": (2, 3, 4, 5), "b": (6,)}


def _loss(params, batch):
    """Linear in the parameters: a worker's gradient is its batch."""
    return sum(jnp.vdot(params[k], batch[k]) for k in params)


def _replicated_state_steps(tx, grads_seq, params, reduce_grads):
    """``T`` steps of a user's own ``jax.shard_map(check_vma=True)`` step on
    ``jax.make_mesh((n,), ("data",))``: params, state and updates replicated (``P()``),
    the batch split over the workers. The gradients reach ``tx`` typed invariant: summed
    by autodiff (``"grad"``: the replicated params differentiated directly) or
    ``pmean``-ed by the user (``"pmean"``). Returns the stacked updates and the final state."""
    T, n = np.shape(jax.tree.leaves(grads_seq)[0])[:2]
    mesh = helpers.make_mesh(n)

    def step(params, state, batch):
        batch = jax.tree.map(lambda x: x[0], batch)
        if reduce_grads == "grad":
            grads = jax.grad(_loss)(params, batch)
        else:
            own = jax.grad(_loss)(jax.lax.pcast(params, "data", to="varying"), batch)
            grads = jax.lax.pmean(own, "data")
        return tx.update(grads, state, params)

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=True)
    )
    replicated = jax.sharding.NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    state = jax.device_put(tx.init(params), replicated)
    updates = []
    for t in range(T):
        batch = jax.tree.map(lambda x: x[t], grads_seq)
        u, state = f(params, state, jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data"))))
        updates.append(u)
    return jax.tree.map(lambda *xs: jnp.stack(xs), *updates), state


@pytest.mark.parametrize("reduce_grads", ["grad", "pmean"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", sorted(LINEAR_STATEFUL))
def test_replicated_state_from_reduced_updates(name, n, reduce_grads):
    T = 3
    mode = "sum" if reduce_grads == "grad" else "mean"
    tx = LINEAR_STATEFUL[name](invariant_updates=mode)
    grads_seq = helpers.grads_seq(11, T, n, STEP_SHAPES)  # (T, n, ...): worker i's gradient
    params = helpers.zeros(STEP_SHAPES)
    got, state = _replicated_state_steps(tx, grads_seq, params, reduce_grads)
    # Documented: the output depends only on the mean, so it is that of per-worker gradients.
    ref_updates, _, ref_state = helpers.run_steps(tx, grads_seq, params, backend="shard_map")
    tol = dict(rtol=1e-4, atol=1e-5) if name.startswith("powersgd") else dict(rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(got, ref_updates, **tol)
    # The replicated residual is the workers' mean residual; the rest of the state is equal.
    helpers.assert_trees_close(state.residual, _np_mean(ref_state.residual), **tol)
    helpers.assert_trees_close(state.inner_state, jax.tree.map(lambda x: x[0], ref_state.inner_state), **tol)
    assert int(state.count) == T


@pytest.mark.parametrize("name", ["random_k", "powersgd"])
def test_replicated_state_without_error_feedback(name):
    tx = LINEAR_STATEFUL[name](error_feedback=False)
    grads_seq = helpers.grads_seq(2, 2, 4, STEP_SHAPES)
    params = helpers.zeros(STEP_SHAPES)
    got, state = _replicated_state_steps(tx, grads_seq, params, "grad")
    ref, _, _ = helpers.run_steps(tx, grads_seq, params, backend="shard_map")
    helpers.assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    assert state.residual == ()


@pytest.mark.parametrize("name", ["top_k", "threshold", "scaled_sign", "qsgd", "sign_majority_vote"])
@pytest.mark.parametrize("reduce_grads", ["grad", "pmean"])
def test_replicated_state_nonlinear_raises_with_the_fix(name, reduce_grads):
    """Nonlinear compressors cannot run on the sum or the mean: an error, not a vma failure."""
    tx = NONLINEAR[name]()
    grads_seq = helpers.grads_seq(0, 1, 2, STEP_SHAPES)
    with pytest.raises(jd.AlreadyReducedError, match="pcast"):
        _replicated_state_steps(tx, grads_seq, helpers.zeros(STEP_SHAPES), reduce_grads)


@pytest.mark.devices(4)
@pytest.mark.parametrize("name", ["random_k", "powersgd"])
def test_residual_stays_invariant_over_the_reduced_axis_of_a_tuple(name):
    """Gradients varying over "a" and already summed over "b": the residual is per-"a", replicated over "b"."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    tx = LINEAR_STATEFUL[name](axis_name=("a", "b"))
    rng = np.random.default_rng(4)
    per_worker = {k: rng.normal(size=(2, 2, *s)).astype(np.float32) for k, s in STEP_SHAPES.items()}
    state0 = tx.init(helpers.zeros(STEP_SHAPES))
    mask = jax.tree.map(lambda _: False, state0)._replace(
        residual=jax.tree.map(lambda _: True, state0.residual)
    )

    def body(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
        for _ in range(2):
            u, s = tx.update(g, s)
        return u, jax.tree.map(lambda x, m: x[None] if m else x, s, mask)

    def run(grads, axes):
        specs = jax.tree.map(lambda m: P(axes) if m else P(), mask)
        reps = np.shape(jax.tree.leaves(grads)[0])[0]
        state = jax.tree.map(lambda x, m: np.broadcast_to(x, (reps, *np.shape(x))) if m else x, state0, mask)
        put = lambda tree, spec: jax.tree.map(  # noqa: E731
            lambda x, sp: jax.device_put(x, jax.sharding.NamedSharding(mesh, sp)), tree, spec
        )
        g_specs = jax.tree.map(lambda _: P(axes), grads)
        f = jax.shard_map(body, mesh=mesh, in_specs=(g_specs, specs), out_specs=(P(), specs), check_vma=True)
        return jax.jit(f)(put(grads, g_specs), put(state, specs))

    u, s = run(jax.tree.map(lambda x: x.sum(1), per_worker), "a")
    u_ref, s_ref = run(jax.tree.map(lambda x: x.reshape(4, *x.shape[2:]), per_worker), ("a", "b"))
    helpers.assert_trees_close(u, u_ref, rtol=1e-4, atol=1e-5)
    mean_over_b = jax.tree.map(lambda x: np.asarray(x).reshape(2, 2, *x.shape[1:]).mean(1), s_ref.residual)
    helpers.assert_trees_close(s.residual, mean_over_b, rtol=1e-4, atol=1e-5)
