"""Flax linen + ``jax.pmap`` + ``TrainState``: PowerSGD data parallelism without a mesh.

The same digits MLP as ``examples/flax_nnx_shard_map.py``, written the classic
way: a ``flax.training.train_state.TrainState`` replicated on every device and
a ``jax.pmap``-ed step with ``axis_name="batch"``. The state's ``tx`` is
``optax.chain(powersgd(rank=2, axis_name="batch"), sgd(lr, momentum=0.9))``.
Nothing else changes in a standard Flax loop: each device computes the
gradient of its own shard, and ``state.apply_gradients`` runs the jaxopt_dist
transforms, which do the communication (two small all-reduces of PowerSGD
factors instead of the full gradient) inside the pmap.

Every device holds its own copy of the state. The parameters and PowerSGD's
factors stay bit-identical across devices, because the update that reaches
them is the same everywhere; only the error-feedback residuals (what each
device's compression left out) differ. The script checks the parameter
replicas at the end.

Run ``python examples/flax_linen_pmap.py`` (8 simulated devices on a CPU;
all devices up to ``--workers`` on a GPU/TPU host), or e.g.
``python examples/flax_linen_pmap.py --steps 400 --workers 4``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulate 8 devices on a CPU-only machine (ignored when real accelerators are used).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import jax_utils  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxopt_dist as jd  # noqa: E402


class MLP(nn.Module):
    """64 -> 128 -> 128 -> 10, ReLU."""

    hidden: int = 128
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


def load_data(seed: int):
    """Digits scaled to [0, 1], shuffled with ``seed``, split 80/20."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def batches(x, y, workers: int, batch_size: int, steps: int, seed: int):
    """``steps`` batches of shape ``(workers, batch_size, ...)`` from a seeded NumPy RNG."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x), size=(workers, batch_size))
        yield {"x": x[idx], "y": y[idx]}


def train_step(state: train_state.TrainState, batch: dict[str, jax.Array]):
    """One step on one device's shard; run under ``jax.pmap(axis_name="batch")``."""

    def loss_fn(params):
        logits = state.apply_fn(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)  # this device's gradient
    state = state.apply_gradients(grads=grads)  # powersgd averages (compressed) inside tx
    return state, jax.lax.pmean(loss, "batch")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the MLP, evaluates it on the held-out digits and prints a summary.

    Returns:
      A dict with ``first_loss``, ``final_loss`` (mean of the last 10 steps),
      ``test_accuracy``, ``losses`` (one per step), ``workers`` and ``platform``,
      plus ``params_per_device`` and ``opt_state_per_device`` (NumPy arrays with
      a leading device axis) and ``replicas_identical`` (the parameter copies
      agree bit for bit).
    """
    ap = argparse.ArgumentParser(description="Train a Flax linen MLP on digits with PowerSGD under jax.pmap.")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8, help="data-parallel workers (devices) to use")
    ap.add_argument("--batch-size", type=int, default=16, help="examples per worker per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= jax.local_device_count():
        ap.error(f"--workers must be between 1 and the {jax.local_device_count()} local devices")
    if args.steps < 1 or args.batch_size < 1:
        ap.error("--steps and --batch-size must be positive")

    devices = jax.local_devices()[: args.workers]
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    model = MLP()
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, x_train.shape[1])))
    tx = optax.chain(jd.powersgd(rank=2, axis_name="batch"), jd.sgd(args.lr, momentum=0.9))
    # tx.init never communicates, so it runs once, outside pmap; then one copy per device.
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = jax_utils.replicate(state, devices=devices)
    step = jax.pmap(train_step, axis_name="batch", devices=devices)

    losses = []
    for batch in batches(x_train, y_train, args.workers, args.batch_size, args.steps, args.seed):
        state, loss = step(state, batch)
        # float() waits for the step: on simulated CPU devices, dozens of queued
        # programs with collectives can deadlock XLA:CPU (cheap on accelerators too).
        losses.append(float(loss[0]))

    # One row per device: the replicas must agree to the bit.
    params_per_device = jax.tree.map(np.asarray, jax.device_get(state.params))
    identical = all(
        np.array_equal(leaf[i], leaf[0])
        for leaf in jax.tree.leaves(params_per_device)
        for i in range(args.workers)
    )
    final_params = jax.tree.map(lambda leaf: leaf[0], params_per_device)
    logits = model.apply(final_params, x_test)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    result = {
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-10:])),
        "test_accuracy": accuracy,
        "losses": losses,
        "workers": args.workers,
        "platform": devices[0].platform,
        "params_per_device": params_per_device,
        "opt_state_per_device": jax.tree.map(np.asarray, jax.device_get(state.opt_state)),
        "replicas_identical": identical,
    }
    print(
        f"flax linen + jax.pmap + TrainState, powersgd(rank=2) + sgd(momentum=0.9): {args.workers} workers "
        f"({result['platform']}), {args.steps} steps of {args.batch_size} examples per worker\n"
        f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} (mean of last 10); "
        f"test accuracy {100 * accuracy:.1f}% on {len(y_test)} examples; "
        f"parameter replicas bit-identical: {identical}"
    )
    return result


if __name__ == "__main__":
    main()
