"""A sharded Flax NNX model trained data-parallel: ``jaxopt_dist.nnx`` on a 2 x 4 mesh.

The mesh has two axes: ``"data"`` (2 replicas, the workers the optimizer
communicates between) and ``"fsdp"`` (4 devices inside each replica that hold
a quarter of every sharded parameter). The MLP's layers carry sharding
metadata, ``nnx.with_partitioning(init, (None, "fsdp"))``; the training step
is the same as for a replicated model: the decorator reads the specs from the
variables, shards the parameters and every optimizer-state leaf that belongs
to one (AdamW's moments) over ``"fsdp"``, splits the batch over ``"data"`` and
``"fsdp"`` (``batch_axes="fsdp"``) and leaves the sharded compute to the
compiler. Each worker's gradient is averaged over ``"data"`` by
``jaxopt_dist.all_reduce``.

It prints the loss and the bytes of parameters plus optimizer state that one
device holds, next to what a replicated model would hold (about 4x).

Run ``python examples/flax_nnx_fsdp.py`` (8 simulated devices on a CPU), or
e.g. ``python examples/flax_nnx_fsdp.py --steps 400 --hidden 512``.
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
from jaxopt_dist import nnx as jnnx  # noqa: E402


def sharded(init: Any, *names: str | None) -> Any:
    """``init`` with sharding metadata: dimension ``i`` split over mesh axis ``names[i]``."""
    return nnx.with_partitioning(init, names)


class MLP(nnx.Module):
    """64 -> hidden -> hidden -> 10, ReLU; every weight split over "fsdp" along its hidden dimension."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs, features: int = 64, classes: int = 10):
        w, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.hidden1 = nnx.Linear(
            features,
            hidden,
            kernel_init=sharded(w, None, "fsdp"),
            bias_init=sharded(zeros, "fsdp"),
            rngs=rngs,
        )
        self.hidden2 = nnx.Linear(
            hidden, hidden, kernel_init=sharded(w, "fsdp", None), bias_init=sharded(zeros, None), rngs=rngs
        )
        self.out = nnx.Linear(hidden, classes, kernel_init=sharded(w, "fsdp", None), rngs=rngs)

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


def train_step(model: MLP, optimizer: jnnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
    """One step, written as for one device."""

    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def device_bytes(tree: Any, device: Any) -> int:
    """Bytes of ``tree``'s arrays that ``device`` holds."""
    return sum(
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the sharded MLP, evaluates it and prints the loss and per-device memory.

    Returns:
      A dict with ``losses`` (one per step), ``first_loss``, ``final_loss`` (mean
      of the last 10 steps), ``test_accuracy``, ``device_bytes`` (parameters and
      optimizer state on one device), ``replicated_bytes`` (the same, unsharded)
      and ``kernel_spec`` (the first kernel's PartitionSpec after training).
    """
    ap = argparse.ArgumentParser(
        description="Train a sharded Flax NNX MLP on digits over a data x fsdp mesh."
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=256, help="hidden width (a multiple of --fsdp)")
    ap.add_argument("--data", type=int, default=2, help="data-parallel replicas")
    ap.add_argument("--fsdp", type=int, default=4, help="devices that shard each replica's parameters")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch (a multiple of data x fsdp)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.data * args.fsdp > jax.device_count():
        ap.error(f"--data x --fsdp must be at most the {jax.device_count()} available devices")

    devices = jax.devices()[: args.data * args.fsdp]
    mesh = jax.make_mesh((args.data, args.fsdp), ("data", "fsdp"), devices=devices)
    with jax.set_mesh(mesh):  # sharded variables are created sharded
        model = MLP(args.hidden, rngs=nnx.Rngs(args.seed))
        optimizer = jnnx.Optimizer(model, optax.chain(jd.all_reduce(), optax.adamw(args.lr)), wrt=nnx.Param)
    step = jnnx.data_parallel(train_step, mesh=mesh, batch_axes="fsdp")

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    rng = np.random.default_rng(args.seed)
    losses = []
    for _ in range(args.steps):
        idx = rng.integers(0, len(x_train), size=args.batch_size)
        losses.append(float(step(model, optimizer, {"x": x_train[idx], "y": y_train[idx]})))

    state = nnx.as_pure(nnx.state((model, optimizer)))
    held = device_bytes(state, devices[0])
    unsharded = sum(x.nbytes for x in jax.tree.leaves(state))
    logits = jax.jit(lambda m, x: m(x))(model, jnp.asarray(x_test))
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    result = {
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-10:])),
        "test_accuracy": accuracy,
        "device_bytes": held,
        "replicated_bytes": unsharded,
        "kernel_spec": model.hidden1.kernel[...].sharding.spec,
    }
    print(
        f"flax nnx, {args.data} data x {args.fsdp} fsdp mesh, all_reduce + adamw: {args.steps} steps of "
        f"{args.batch_size} examples\nloss {losses[0]:.3f} -> {result['final_loss']:.3f} (mean of last 10); "
        f"test accuracy {100 * accuracy:.1f}%\nparameters + optimizer state per device: {held / 1024:.1f} KiB "
        f"(replicated: {unsharded / 1024:.1f} KiB, {unsharded / held:.2f}x)"
    )
    return result


if __name__ == "__main__":
    main()
