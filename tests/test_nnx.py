"""jaxopt_dist.nnx: NNX steps with BatchNorm statistics, RNG streams and metrics over a mesh.

The layer runs only under ``jax.shard_map`` (NNX objects are not vmapped), so
every test runs on real meshes of 2 and 8 simulated devices.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxopt_dist as jd
from jaxopt_dist import nnx as jnnx
from tests import helpers

WORKERS = [2, 8]


class _BN(nnx.Module):
    def __init__(self, features: int, *, momentum: float = 0.0):
        self.bn = nnx.BatchNorm(features, momentum=momentum, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(x)


def _forward(model, x):
    return jnp.mean(model(x) ** 2)


@pytest.mark.parametrize("n", WORKERS)
def test_sync_batch_stats_equal_global_batch_stats(n):
    per_worker, features = 3, 5
    x = np.random.default_rng(n).normal(2.0, 3.0, size=(n * per_worker, features)).astype(np.float32)
    model = _BN(features)  # momentum 0: running statistics = the last batch's statistics
    step = jnnx.data_parallel(_forward, mesh=helpers.make_mesh(n))
    out = step(model, x)

    # NumPy reference, looping over workers: the global batch's moments from the shards' sums.
    shards = np.split(x.astype(np.float64), n)
    count = sum(len(s) for s in shards)
    mean = sum(s.sum(0) for s in shards) / count
    var = sum((s**2).sum(0) for s in shards) / count - mean**2
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bn.var[...]), var, rtol=1e-5, atol=1e-6)
    # Every worker normalized with the global statistics: the output is that of one device.
    normalized = (x - mean) / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(float(out), np.mean(normalized**2), rtol=1e-5)
    for leaf in (model.bn.mean[...], model.bn.var[...], out):
        helpers.assert_replicated_shards(leaf)


@pytest.mark.parametrize("n", WORKERS)
def test_per_worker_batch_stats_are_averaged_into_the_model(n):
    per_worker, features, momentum = 4, 3, 0.5
    rng = np.random.default_rng(10 + n)
    xs = [rng.normal(1.0, 2.0, size=(n * per_worker, features)).astype(np.float32) for _ in range(2)]
    model = _BN(features, momentum=momentum)
    step = jnnx.data_parallel(_forward, mesh=helpers.make_mesh(n), batch_stats="per_worker")
    outs = [step(model, x) for x in xs]

    # NumPy reference: each worker keeps its own running statistics; the model holds their mean.
    run_mean = [np.zeros(features) for _ in range(n)]
    run_var = [np.ones(features) for _ in range(n)]
    losses = []
    for x in xs:
        loss = 0.0
        for i, s in enumerate(np.split(x.astype(np.float64), n)):
            m, v = s.mean(0), s.var(0)
            run_mean[i] = momentum * run_mean[i] + (1 - momentum) * m
            run_var[i] = momentum * run_var[i] + (1 - momentum) * v
            loss += np.mean(((s - m) / np.sqrt(v + 1e-5)) ** 2) / n
        losses.append(loss)
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.mean(run_mean, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bn.var[...]), np.mean(run_var, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([float(o) for o in outs], losses, rtol=1e-5)
    # The per-worker copies differ (they are not re-synchronized each step).
    (stacked,) = [kept for _, kept in step._worker_stats.values() if kept.shape == (n, features)][:1]
    assert not np.allclose(np.asarray(stacked)[0], np.asarray(stacked)[1])


class _Drop(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(x)


@pytest.mark.parametrize("n", WORKERS)
def test_dropout_masks_differ_across_workers_and_steps(n):
    per_worker, features = 2, 64
    model = _Drop(rngs=nnx.Rngs(dropout=7))
    model.train()

    def masks(model, x):
        keep = (model(x) != 0).astype(jnp.float32)
        return jax.lax.all_gather(keep, "data")  # (workers, per_worker, features), replicated

    step = jnnx.data_parallel(masks, mesh=helpers.make_mesh(n))
    key = model.drop.rngs.key[...]  # the stream's key (nnx.Dropout forks it from the Rngs)
    x = np.ones((n * per_worker, features), np.float32)
    got = [np.asarray(step(model, x)) for _ in range(3)]
    assert int(model.drop.rngs.count[...]) == 3  # the stream advanced once per step

    # Reference: worker i at step t draws from fold_in(fold_in(key, i), t).
    np.testing.assert_array_equal(jax.random.key_data(model.drop.rngs.key[...]), jax.random.key_data(key))
    for t, m in enumerate(got):
        for i in range(n):
            k = jax.random.fold_in(jax.random.fold_in(key, i), t)
            expected = jax.random.bernoulli(k, 0.5, (per_worker, features))
            np.testing.assert_array_equal(m[i], np.asarray(expected, np.float32))
    rows = [m[i].tobytes() for m in got for i in range(n)]
    assert len(set(rows)) == len(rows)  # all different across workers and steps


class _MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def _loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


def _train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = nnx.value_and_grad(_loss, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)
    return loss


def _batch(seed, size):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(size, 4)).astype(np.float32),
        "y": rng.integers(0, 3, size).astype(np.int32),
    }


def _metrics():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


@pytest.mark.parametrize("n", WORKERS)
def test_dense_steps_equal_one_device_steps_and_metrics_are_replicated(n):
    batches = [_batch(s, 4 * n) for s in range(3)]
    tx = optax.sgd(0.1, momentum=0.9)
    ref_model, model = _MLP(rngs=nnx.Rngs(0)), _MLP(rngs=nnx.Rngs(0))
    ref_opt, ref_metrics = nnx.Optimizer(ref_model, tx, wrt=nnx.Param), _metrics()
    opt = jnnx.Optimizer(model, optax.chain(jd.all_reduce(), tx), wrt=nnx.Param)
    metrics = _metrics()
    ref_step = nnx.jit(_train_step)
    step = jnnx.data_parallel(_train_step, mesh=helpers.make_mesh(n))
    for b in batches:
        ref_loss = ref_step(ref_model, ref_opt, ref_metrics, b)
        loss = step(model, opt, metrics, b)
        # SyncBN: the mean of the workers' losses is the global batch's loss.
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        helpers.assert_replicated_shards(loss)
    helpers.assert_trees_close(nnx.state(model), nnx.state(ref_model), rtol=1e-4, atol=1e-6)
    for leaf in jax.tree.leaves(nnx.state(model)) + jax.tree.leaves(nnx.state(metrics)):
        helpers.assert_replicated_shards(leaf)
    got, want = metrics.compute(), ref_metrics.compute()
    assert int(metrics.accuracy.count[...]) == 3 * 4 * n  # every worker's examples counted
    np.testing.assert_allclose(float(got["accuracy"]), float(want["accuracy"]), rtol=1e-6)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)


@pytest.mark.parametrize("n", WORKERS)
def test_powersgd_keeps_residuals_per_worker_and_params_replicated(n):
    model = _MLP(rngs=nnx.Rngs(1))
    opt = jnnx.Optimizer(model, optax.chain(jd.powersgd(rank=1), optax.adamw(1e-2)), wrt=nnx.Param)
    step = jnnx.data_parallel(_train_step, mesh=helpers.make_mesh(n))
    metrics = _metrics()
    losses = [float(step(model, opt, metrics, _batch(s, 4 * n))) for s in range(6)]
    assert np.all(np.isfinite(losses))
    for leaf in jax.tree.leaves(nnx.state(model)):
        helpers.assert_replicated_shards(leaf)
    (ef,) = [
        s
        for s in jax.tree.leaves(
            nnx.as_pure(opt.opt_state), is_leaf=lambda s: isinstance(s, jd.ErrorFeedbackState)
        )
        if isinstance(s, jd.ErrorFeedbackState)
    ]
    kernel = ef.residual["l1"]["kernel"]
    assert kernel.shape == (n, 4, 8)  # one residual per worker, stacked
    assert not np.array_equal(np.asarray(kernel[0]), np.asarray(kernel[1]))
    assert int(opt.step[...]) == 6


def test_bad_inputs_raise_clear_errors():
    mesh = helpers.make_mesh(2)
    with pytest.raises(ValueError, match="batch_stats"):
        jnnx.data_parallel(_train_step, mesh=mesh, batch_stats="mean")
    with pytest.raises(TypeError, match="mesh"):
        jnnx.data_parallel(_train_step, mesh="data")
    with pytest.raises(ValueError, match="axis_name"):
        jnnx.data_parallel(_train_step, mesh=mesh, axis_name="batch")

    model = _MLP(rngs=nnx.Rngs(0))
    step = jnnx.data_parallel(_train_step, mesh=mesh)
    plain = nnx.Optimizer(model, optax.chain(jd.all_reduce(), optax.sgd(0.1)), wrt=nnx.Param)
    with pytest.raises(ValueError, match="jaxopt_dist.nnx.Optimizer"):
        step(model, plain, _metrics(), _batch(0, 4))
    local = jnnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="(?i)aggregate in the chain"):
        step(model, local, _metrics(), _batch(0, 4))
    opt = jnnx.Optimizer(model, optax.chain(jd.all_reduce(), optax.sgd(0.1)), wrt=nnx.Param)
    with pytest.raises(ValueError, match="divisible by the 2 workers"):
        step(model, opt, _metrics(), _batch(0, 3))
    with pytest.raises(TypeError, match="Welford"):
        step(model, opt, nnx.metrics.Welford("loss"), _batch(0, 4))


def test_importing_jaxopt_dist_does_not_import_flax():
    code = "import sys, jaxopt_dist; assert 'flax' not in sys.modules, 'flax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=helpers.child_env(devices=1))


@pytest.mark.slow
@pytest.mark.devices(4)
def test_tutorial_example_trains(capsys):
    example = helpers.load_example("flax_nnx_batchnorm")
    small = ["--workers", "4", "--epochs", "2", "--batch-size", "64", "--seed", "0"]
    results = {m: example.main(["--method", m, *small]) for m in ("single", "dense", "powersgd")}
    for m, r in results.items():
        assert r["steps"] == 2 * (1437 // 64)
        assert np.isfinite(r["test_loss"])
        assert r["test_accuracy"] > 0.5, (m, r["test_accuracy"])  # chance is 0.1
        assert r["train_loss"] < r["history"]["train_loss"][0]
    # The same loop on 4 workers with a dense all-reduce and SyncBN follows one device closely.
    assert abs(results["dense"]["test_accuracy"] - results["single"]["test_accuracy"]) < 0.08
    assert "test accuracy" in capsys.readouterr().out


def test_state_stacked_for_other_workers_is_rejected_and_the_throttle_is_shared():
    # The three step builders share one runner: the same layout check and in-flight bound.
    model = _MLP(rngs=nnx.Rngs(1))
    opt = jnnx.Optimizer(model, optax.chain(jd.powersgd(rank=1), optax.adamw(1e-2)), wrt=nnx.Param)
    step4 = jnnx.data_parallel(_train_step, mesh=helpers.make_mesh(4), max_steps_in_flight=3)
    assert step4.in_flight_limit() == 3
    assert jnnx.data_parallel(_train_step, mesh=helpers.make_mesh(2)).in_flight_limit() == 4
    step4(model, opt, _metrics(), _batch(0, 16))  # residuals now stacked for 4 workers
    step2 = jnnx.data_parallel(_train_step, mesh=helpers.make_mesh(2))
    with pytest.raises(ValueError, match=r"per-worker values for 4 workers.*mesh has 2 workers"):
        step2(model, opt, _metrics(), _batch(1, 8))
