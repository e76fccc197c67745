"""The Flax NNX MNIST tutorial loop (CNN with BatchNorm and Dropout, AdamW), data-parallel.

The model, loss, train and eval steps and the loop below are those of the
official Flax NNX MNIST tutorial, with the CNN adapted to scikit-learn's 8x8
digits (bundled with scikit-learn, no download). One device runs them as
written; data parallelism over a mesh changes five lines (three added, two edited)::

    import jaxopt_dist as jd                                   # + (1)
    from jaxopt_dist import nnx as jnnx                        # + (2)
    mesh = jax.make_mesh((8,), ("data",))                      # + (3)
    # single device:
    #   optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, momentum), wrt=nnx.Param)
    optimizer = jnnx.Optimizer(model, optax.chain(jd.all_reduce(), optax.adamw(learning_rate, momentum)), wrt=nnx.Param)  # ~ (4)
    # single device: @nnx.jit
    @jnnx.data_parallel(mesh=mesh)                             # ~ (5)
    def train_step(model, optimizer, metrics, batch): ...      # unchanged body

(``jd.powersgd(rank=2)`` in place of ``jd.all_reduce()`` compresses the
gradients.) ``train_step`` then runs under ``jax.shard_map`` with the batch
split across the workers. BatchNorm normalizes with the statistics of the
whole global batch (SyncBN; ``batch_stats="per_worker"`` keeps per-worker
statistics instead, averaged in the model for evaluation); each worker
draws its own dropout masks, new every step; the metrics count every worker's
examples and come back replicated. ``eval_step`` stays ``@nnx.jit``.

In ``main`` the two variants are chosen by ``--method`` (``tx`` is
``optax.adamw(learning_rate, momentum)``, or SGD with ``--sgd``); the lines
marked ``# [data-parallel]`` are the changed ones.

Run ``python examples/flax_nnx_batchnorm.py --method dense`` (8 simulated
devices on a CPU), ``--method single`` for the one-device loop, or
``--method powersgd``.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulate 8 devices on a CPU-only machine (ignored when real accelerators are used).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxopt_dist as jd  # noqa: E402  [data-parallel] (1)
from jaxopt_dist import nnx as jnnx  # noqa: E402  [data-parallel] (2)


class CNN(nnx.Module):
    """The tutorial's CNN for 8x8x1 digits (28x28 in the tutorial: 3136 -> 256 inputs to linear1)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(256, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x)))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.


def load_data(seed: int):
    """Digits as 8x8x1 images in [0, 1], shuffled with ``seed``, split 80/20."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def batches(x, y, batch_size: int, epochs: int, seed: int):
    """Shuffled epochs of full global batches (the remainder of each epoch is dropped)."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(len(x) // batch_size):
            idx = order[i * batch_size : (i + 1) * batch_size]
            yield {"image": x[idx], "label": y[idx]}


METHODS = ("single", "dense", "powersgd")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the CNN, evaluates it on the held-out digits and prints a summary.

    Returns:
      A dict with ``test_accuracy``, ``test_loss``, ``train_accuracy`` and
      ``train_loss`` (metrics of the last epoch), ``steps``, ``method`` and
      ``workers``.
    """
    ap = argparse.ArgumentParser(description="The Flax NNX MNIST tutorial loop on digits, data-parallel.")
    ap.add_argument("--method", choices=METHODS, default="dense")
    ap.add_argument("--workers", type=int, default=8, help="data-parallel workers (devices)")
    ap.add_argument("--batch-stats", choices=("sync", "per_worker"), default="sync")
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=128, help="global batch size")
    ap.add_argument("--learning-rate", type=float, default=0.005)
    ap.add_argument("--momentum", type=float, default=0.9, help="AdamW's b1, or SGD's momentum")
    ap.add_argument("--sgd", action="store_true", help="SGD with momentum instead of AdamW")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= jax.device_count():
        ap.error(f"--workers must be between 1 and the {jax.device_count()} available devices")
    if args.batch_size % args.workers or args.epochs < 1:
        ap.error("--batch-size must be divisible by --workers, and --epochs positive")
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    learning_rate, momentum = args.learning_rate, args.momentum
    tx = optax.sgd(learning_rate, momentum) if args.sgd else optax.adamw(learning_rate, momentum)

    model = CNN(rngs=nnx.Rngs(args.seed))
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    if args.method == "single":
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = nnx.jit(train_step)
    else:
        mesh = jax.make_mesh(
            (args.workers,), ("data",), devices=jax.devices()[: args.workers]
        )  # [data-parallel] (3)
        aggregate = jd.all_reduce() if args.method == "dense" else jd.powersgd(rank=args.rank)
        optimizer = jnnx.Optimizer(model, optax.chain(aggregate, tx), wrt=nnx.Param)  # [data-parallel] (4)
        step = jnnx.data_parallel(train_step, mesh=mesh, batch_stats=args.batch_stats)  # [data-parallel] (5)

    history: dict[str, list[float]] = {"train_loss": [], "train_accuracy": []}
    steps_per_epoch = len(x_train) // args.batch_size
    num_steps = 0
    for batch in batches(x_train, y_train, args.batch_size, args.epochs, args.seed):
        model.train()  # Switch to train mode (BatchNorm batch statistics, dropout on).
        step(model, optimizer, metrics, batch)
        num_steps += 1
        if num_steps % steps_per_epoch == 0:
            for metric, value in metrics.compute().items():
                history[f"train_{metric}"].append(float(value))
            metrics.reset()
    model.eval()  # Switch to eval mode (running statistics, no dropout).
    eval_step(model, metrics, {"image": x_test, "label": y_test})
    test = {k: float(v) for k, v in metrics.compute().items()}
    result = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "train_accuracy": history["train_accuracy"][-1],
        "train_loss": history["train_loss"][-1],
        "history": history,
        "steps": num_steps,
        "method": args.method,
        "workers": 1 if args.method == "single" else args.workers,
        "model": model,
    }
    print(
        f"flax nnx MNIST-tutorial CNN on digits, {args.method}"
        + ("" if args.method == "single" else f" ({args.workers} workers, batch_stats={args.batch_stats})")
        + f": {num_steps} steps of {args.batch_size}; last epoch train loss {result['train_loss']:.3f}, "
        f"test accuracy {100 * result['test_accuracy']:.1f}% on {len(y_test)} examples"
    )
    return result


if __name__ == "__main__":
    main()
