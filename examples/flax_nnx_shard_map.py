"""Flax NNX + ``jaxopt_dist.data_parallel_step``: PowerSGD data parallelism on a mesh.

A small NNX MLP learns scikit-learn's digits (bundled with scikit-learn, no
download), its batch split across the ``"data"`` axis of a device mesh. The
step is ``jaxopt_dist.data_parallel_step`` (``jax.shard_map`` underneath) and
the optimizer is ``optax.chain(powersgd(rank=2), sgd(lr, momentum=0.9))``:
each worker's gradient is compressed to rank-2 factors (with error feedback)
before it crosses the wire, and every worker applies the same update.

NNX modules are stateful Python objects; the step works on pytrees. The
functional NNX pattern bridges the two::

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # structure, weights, the rest
    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params, rest)(batch["x"])  # a fresh module per call
        ...
    ...  # train the `params` pytree
    nnx.update(model, params)  # write the trained weights back into the module

Run ``python examples/flax_nnx_shard_map.py`` (8 simulated devices on a CPU;
all devices up to ``--workers`` on a GPU/TPU host), or e.g.
``python examples/flax_nnx_shard_map.py --steps 400 --workers 4``.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxopt_dist as jd  # noqa: E402


class MLP(nnx.Module):
    """64 -> 128 -> 128 -> 10, ReLU."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(features, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.out(x)


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


def batches(x, y, batch_size: int, steps: int, seed: int):
    """``steps`` global batches drawn with replacement by a seeded NumPy RNG."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x), size=batch_size)
        yield {"x": x[idx], "y": y[idx]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the MLP, evaluates it on the held-out digits and prints a summary.

    Returns:
      A dict with ``first_loss``, ``final_loss`` (mean of the last 10 steps),
      ``test_accuracy``, ``losses`` (one per step), ``workers`` and ``platform``.
    """
    ap = argparse.ArgumentParser(description="Train a Flax NNX MLP on digits with PowerSGD across a mesh.")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8, help="data-parallel workers (devices) to use")
    ap.add_argument("--batch-size", type=int, default=16, help="examples per worker per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= jax.device_count():
        ap.error(f"--workers must be between 1 and the {jax.device_count()} available devices")
    if args.steps < 1 or args.batch_size < 1:
        ap.error("--steps and --batch-size must be positive")

    mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[: args.workers])
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    model = MLP(rngs=nnx.Rngs(args.seed))

    # The module's structure (static) and its weights (a pytree of arrays).
    # `...` collects any other state (none for this MLP; batch statistics or
    # RNG counters in other models), carried along unchanged.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params, rest)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    tx = optax.chain(jd.powersgd(rank=2, axis_name="data"), jd.sgd(args.lr, momentum=0.9))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, axis_name="data")
    params, opt_state = step.init(params)  # replicated params; per-worker EF residuals

    losses = []
    for batch in batches(x_train, y_train, args.batch_size * args.workers, args.steps, args.seed):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))

    nnx.update(model, params)  # the trained weights, back in the stateful module
    logits = model(jnp.asarray(x_test))
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    result = {
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-10:])),
        "test_accuracy": accuracy,
        "losses": losses,
        "workers": args.workers,
        "platform": jax.devices()[0].platform,
    }
    print(
        f"flax nnx + data_parallel_step, powersgd(rank=2) + sgd(momentum=0.9): {args.workers} workers "
        f"({result['platform']}), {args.steps} steps of {args.batch_size} examples per worker\n"
        f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} (mean of last 10); "
        f"test accuracy {100 * accuracy:.1f}% on {len(y_test)} examples"
    )
    return result


if __name__ == "__main__":
    main()
