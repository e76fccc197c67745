"""jaxopt_dist.linen: TrainState steps with batch_stats and dropout keys over a mesh (2 and 8 devices)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import linen as jlinen
from tests import helpers

WORKERS = [2, 8]


class _Net(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.0, axis_name=self.axis_name)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(3)(x)


def _step(state, batch):
    key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["x"],
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (logits, updates)

    (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def _setup(n, *, axis_name=None, tx=None, seed=0):
    model = _Net(axis_name=axis_name)
    rng = np.random.default_rng(seed)
    batch = {
        "x": rng.normal(1.0, 2.0, size=(4 * n, 16)).astype(np.float32),
        "y": rng.integers(0, 3, 4 * n).astype(np.int32),
    }
    variables = model.init(jax.random.key(0), batch["x"][:1], train=False)
    state = jlinen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx or optax.chain(jd.all_reduce(), optax.sgd(0.1)),
        batch_stats=variables["batch_stats"],
        key=jax.random.key(1),
    )
    return state, batch


@pytest.mark.parametrize("n", WORKERS)
@pytest.mark.parametrize("mode", ["sync_bn", "averaged", "per_worker"])
def test_batch_stats_against_numpy(n, mode):
    state, batch = _setup(n, axis_name="data" if mode == "sync_bn" else None)
    step = jlinen.data_parallel(
        _step, mesh=helpers.make_mesh(n), batch_stats="per_worker" if mode == "per_worker" else "sync"
    )
    state, metrics = step(state, batch)
    stats = state.batch_stats["BatchNorm_0"]
    shards = np.split(batch["x"].astype(np.float64), n)  # NumPy reference, one worker at a time
    means = [s.mean(0) for s in shards]
    variances = [s.var(0) for s in shards]
    if mode == "sync_bn":  # global batch moments, from the workers' sums
        mean = sum(s.sum(0) for s in shards) / len(batch["x"])
        var = sum((s**2).sum(0) for s in shards) / len(batch["x"]) - mean**2
        want_mean, want_var = mean, var
    elif mode == "averaged":  # each worker's moments, averaged
        want_mean, want_var = np.mean(means, 0), np.mean(variances, 0)
    else:  # one row per worker
        want_mean, want_var = np.stack(means), np.stack(variances)
    np.testing.assert_allclose(np.asarray(stats["mean"]), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["var"]), want_var, rtol=1e-5, atol=1e-5)
    for leaf in jax.tree.leaves((state.params, metrics)):
        helpers.assert_replicated_shards(leaf)
    if mode != "per_worker":
        for leaf in jax.tree.leaves(state.batch_stats):
            helpers.assert_replicated_shards(leaf)


@pytest.mark.parametrize("n", WORKERS)
def test_powersgd_state_params_replicated_residuals_per_worker(n):
    state, batch = _setup(n, tx=optax.chain(jd.powersgd(rank=1), optax.adamw(1e-2)))
    step = jlinen.data_parallel(_step, mesh=helpers.make_mesh(n))
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses))
    assert int(state.step) == 4
    for leaf in jax.tree.leaves(state.params):
        helpers.assert_replicated_shards(leaf)
    np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(jax.random.key(1)))
    (ef,) = [
        s
        for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, jd.ErrorFeedbackState))
        if isinstance(s, jd.ErrorFeedbackState)
    ]
    kernel = ef.residual["Dense_0"]["kernel"]
    assert kernel.shape == (n, 16, 3)  # compressed: rank 1 sends 19 of 48 values
    assert not np.array_equal(np.asarray(kernel[0]), np.asarray(kernel[1]))


def test_bad_inputs_raise_clear_errors():
    mesh = helpers.make_mesh(2)
    with pytest.raises(ValueError, match="batch_stats"):
        jlinen.data_parallel(_step, mesh=mesh, batch_stats="mean")
    state, batch = _setup(2, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match="(?i)aggregate in the chain"):
        jlinen.data_parallel(_step, mesh=mesh)(state, batch)
    state, batch = _setup(2)
    with pytest.raises(ValueError, match="divisible by the 2 workers"):
        jlinen.data_parallel(_step, mesh=mesh)(state, {k: v[:3] for k, v in batch.items()})


@pytest.mark.slow
@pytest.mark.devices(4)
def test_linen_example_trains(capsys):
    example = helpers.load_example("flax_linen_batchnorm")
    small = ["--workers", "4", "--epochs", "2", "--batch-size", "64", "--seed", "0"]
    for method in ("single", "dense", "powersgd"):
        r = example.main(["--method", method, *small])
        assert r["steps"] == 2 * (1437 // 64)
        assert np.all(np.isfinite(r["losses"]))
        assert r["train_loss"] < 0.5 * r["losses"][0], method
        if method != "single":
            for leaf in jax.tree.leaves(r["state"].params):
                helpers.assert_replicated_shards(leaf)
    assert "test accuracy" in capsys.readouterr().out


def test_state_stacked_for_other_workers_is_rejected_and_the_throttle_is_shared():
    tx = optax.chain(jd.powersgd(rank=1), optax.sgd(0.1))
    state, batch = _setup(4, tx=tx)
    step4 = jlinen.data_parallel(_step, mesh=helpers.make_mesh(4), max_steps_in_flight=2)
    assert step4.in_flight_limit() == 2
    state, _ = step4(state, batch)  # residuals now stacked for 4 workers
    step2 = jlinen.data_parallel(_step, mesh=helpers.make_mesh(2))
    _, batch2 = _setup(2, tx=tx)
    with pytest.raises(ValueError, match=r"per-worker values for 4 workers.*mesh has 2 workers"):
        step2(state, batch2)
    with pytest.raises(ValueError, match=r"`max_steps_in_flight` must be an int >= 1"):
        jlinen.data_parallel(_step, mesh=helpers.make_mesh(2), max_steps_in_flight=0)
