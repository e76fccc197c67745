"""A Flax linen ``TrainState`` loop with BatchNorm statistics and dropout, data-parallel.

The NNX tutorial's CNN (``examples/flax_nnx_batchnorm.py``) written in linen,
trained the classic linen way: a ``TrainState`` with ``batch_stats`` and a
dropout key, one jitted ``train_step(state, batch) -> (state, metrics)``,
AdamW, scikit-learn's 8x8 digits. Data parallelism over 8 workers changes
five lines::

    import jaxopt_dist as jd                                        # + (1)
    from jaxopt_dist import linen as jlinen                         # + (2)
    class TrainState(jlinen.TrainState): ...                        # ~ (3) was train_state.TrainState
    tx = optax.chain(jd.all_reduce(), optax.adamw(learning_rate, momentum))   # ~ (4) was optax.adamw(...)
    @jlinen.data_parallel(mesh=jax.make_mesh((8,), ("data",)))      # ~ (5) was @jax.jit
    def train_step(state, batch): ...                               # unchanged body

The step then runs under ``jax.shard_map``: each worker takes the gradient of
its 16 examples, ``tx`` averages them (``jd.powersgd(rank=2)`` compresses
them instead), the parameters stay replicated; each worker draws its own
dropout mask (``fold_in(key, worker)``); BatchNorm normalizes with the
worker's own examples and the running statistics are averaged over the
workers every step (replicated). A sixth line, ``CNN(axis_name="data")``,
makes BatchNorm normalize with the global batch's statistics (SyncBN);
``--sync-bn`` does that.

In ``main`` the variants are chosen by ``--method``; the lines marked
``# [data-parallel]`` are the changed ones.
"""

from __future__ import annotations

import argparse
import os
import sys
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
from flax.training import train_state  # noqa: E402

import jaxopt_dist as jd  # noqa: E402  [data-parallel] (1)
from jaxopt_dist import linen as jlinen  # noqa: E402  [data-parallel] (2)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flax_nnx_batchnorm import batches, load_data  # noqa: E402


class CNN(nn.Module):
    """The NNX tutorial's CNN in linen, for 8x8x1 digits."""

    axis_name: str | None = None  # SyncBN over this mesh axis when set

    @nn.compact
    def __call__(self, x, train: bool):
        bn = lambda: nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)  # noqa: E731
        x = nn.Dropout(rate=0.025, deterministic=not train)(nn.Conv(32, kernel_size=(3, 3))(x))
        x = nn.avg_pool(nn.relu(bn()(x)), window_shape=(2, 2), strides=(2, 2))
        x = nn.avg_pool(
            nn.relu(bn()(nn.Conv(64, kernel_size=(3, 3))(x))), window_shape=(2, 2), strides=(2, 2)
        )
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nn.relu(nn.Dropout(rate=0.025, deterministic=not train)(nn.Dense(256)(x)))
        return nn.Dense(10)(x)


class SingleDeviceTrainState(train_state.TrainState):
    batch_stats: Any
    key: jax.Array


class TrainState(jlinen.TrainState):  # [data-parallel] (3), was: class TrainState(train_state.TrainState):
    batch_stats: Any
    key: jax.Array


def train_step(state, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            train=True,
            rngs={"dropout": dropout_key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (logits, updates)

    (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return state, {"loss": loss, "accuracy": accuracy}


METHODS = ("single", "dense", "powersgd")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the CNN, evaluates it on the held-out digits and prints a summary.

    Returns:
      A dict with ``test_accuracy``, ``train_loss`` (mean of the last epoch),
      ``losses``, ``steps``, ``method``, ``workers`` and the final ``state``.
    """
    ap = argparse.ArgumentParser(
        description="A linen TrainState loop with BatchNorm on digits, data-parallel."
    )
    ap.add_argument("--method", choices=METHODS, default="dense")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (axis_name)")
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=128, help="global batch size")
    ap.add_argument("--learning-rate", type=float, default=0.005)
    ap.add_argument("--momentum", type=float, default=0.9, help="AdamW's b1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= jax.device_count():
        ap.error(f"--workers must be between 1 and the {jax.device_count()} available devices")
    if args.batch_size % args.workers or args.epochs < 1:
        ap.error("--batch-size must be divisible by --workers, and --epochs positive")
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    learning_rate, momentum = args.learning_rate, args.momentum

    single = args.method == "single"
    model = CNN(axis_name="data" if args.sync_bn and not single else None)
    variables = model.init(jax.random.key(args.seed), x_train[:1], train=False)
    if single:
        tx = optax.adamw(learning_rate, momentum)
        state_cls, step = SingleDeviceTrainState, jax.jit(train_step)
    else:
        aggregate = jd.all_reduce() if args.method == "dense" else jd.powersgd(rank=args.rank)
        tx = optax.chain(aggregate, optax.adamw(learning_rate, momentum))  # [data-parallel] (4)
        mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[: args.workers])
        state_cls, step = TrainState, jlinen.data_parallel(train_step, mesh=mesh)  # [data-parallel] (5)
    state = state_cls.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
        key=jax.random.key(args.seed + 1),
    )

    losses = []
    for batch in batches(x_train, y_train, args.batch_size, args.epochs, args.seed):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    logits = model.apply({"params": state.params, "batch_stats": state.batch_stats}, x_test, train=False)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    steps_per_epoch = len(x_train) // args.batch_size
    result = {
        "test_accuracy": accuracy,
        "train_loss": float(np.mean(losses[-steps_per_epoch:])),
        "losses": losses,
        "steps": len(losses),
        "method": args.method,
        "workers": 1 if single else args.workers,
        "state": state,
    }
    print(
        f"flax linen TrainState CNN on digits, {args.method}"
        + (
            ""
            if single
            else f" ({args.workers} workers, {'SyncBN' if args.sync_bn else 'averaged running stats'})"
        )
        + f": {len(losses)} steps of {args.batch_size}; last epoch train loss {result['train_loss']:.3f}, "
        f"test accuracy {100 * accuracy:.1f}% on {len(y_test)} examples"
    )
    return result


if __name__ == "__main__":
    main()
