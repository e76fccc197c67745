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
