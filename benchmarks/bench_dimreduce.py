"""Does DimReduce gain more than continuing SGD? (digits MLP, 8 simulated workers)

Question (MindSpore's claim for DimReduce): after a warm-up with SGD, do
quasi-Newton steps in the PCA subspace of the warm-up trajectory improve loss
and accuracy faster than more SGD steps?

Protocol. A 64-32-10 tanh MLP on scikit-learn's digits (1440 train / 357
test images), data-parallel over 8 workers with ``jd.data_parallel_step``:

1. warm-up: ``W`` steps of momentum SGD on minibatches, taking a parameter
   snapshot every ``snapshot_every`` steps;
2. ``jd.fit_subspace`` of the snapshots gives a ``k``-dimensional basis;
3. from the same point and on the same minibatch sequence, ``N`` more steps
   of (a) the same SGD and (b) ``jd.dim_reduce(basis, ...)`` (with MindSpore's
   defaults, and with ``alpha`` equal to the SGD learning rate).

Reported: full training loss and test accuracy after N/4, N/2 and N steps,
the fraction of DimReduce steps whose line search accepted a step, and the
forward passes spent (each line-search trial is one extra forward pass per
worker; SGD spends one per step). No timings: this is about progress per step.

Run: ``python benchmarks/bench_dimreduce.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxopt_dist as jd  # noqa: E402

try:  # the public names once the lead exports them
    dim_reduce, fit_subspace = jd.dim_reduce, jd.fit_subspace  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - before integration
    from jaxopt_dist._src.dimreduce import dim_reduce, fit_subspace

N_WORKERS = 8


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = x[perm], y[perm].astype(np.int32)
    return x[:1440], y[:1440], x[1440:], y[1440:]


def init_params(seed: int = 0, hidden: int = 32):
    rng = np.random.default_rng(seed)
    return {
        "b1": jnp.zeros(hidden, jnp.float32),
        "b2": jnp.zeros(10, jnp.float32),
        "w1": jnp.asarray(rng.standard_normal((64, hidden)) / 8.0, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((hidden, 10)) / np.sqrt(hidden), jnp.float32),
    }


def logits_fn(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"] + params["b2"][None, :]


def loss_fn(params, batch):
    logits = logits_fn(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@jax.jit
def evaluate(params, x, y, x_test, y_test):
    train_loss = loss_fn(params, {"x": x, "y": y})
    acc = jnp.mean(jnp.argmax(logits_fn(params, x_test), axis=-1) == y_test)
    return train_loss, acc


def unplaced(tree):
    """A host copy (the step's outputs live on the mesh)."""
    return jax.tree.map(lambda a: np.asarray(a), tree)


def batches(x, y, batch_size: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    out, order, pos = [], rng.permutation(len(y)), 0
    for _ in range(steps):
        if pos + batch_size > len(y):
            order, pos = rng.permutation(len(y)), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        out.append({"x": x[idx], "y": y[idx]})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    ap.add_argument("--warmup", type=int, default=300, help="SGD warm-up steps")
    ap.add_argument("--steps", type=int, default=200, help="steps compared after the warm-up")
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--components", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.snapshot_every, args.components = 40, 12, 4, 6

    x, y, x_test, y_test = load_data(args.seed)
    mesh = jax.make_mesh((N_WORKERS,), ("data",), devices=jax.devices()[:N_WORKERS])
    sgd = optax.chain(jd.all_reduce(), jd.sgd(args.lr, momentum=0.9))
    data = batches(x, y, args.batch_size, args.warmup + args.steps, args.seed + 1)

    # 1. Warm-up with SGD, taking snapshots.
    step = jd.data_parallel_step(loss_fn, sgd, mesh=mesh)
    params, opt_state = step.init(init_params(args.seed))
    snapshots = []
    for t in range(args.warmup):
        params, opt_state, _ = step(params, opt_state, data[t])
        if (t + 1) % args.snapshot_every == 0:
            snapshots.append(unplaced(params))
    start_params, start_sgd_state = unplaced(params), unplaced(opt_state)
    basis = fit_subspace(snapshots, args.components)
    n_params = basis.shape[1]

    # 2. N more steps of each method from the same point and batches.
    checkpoints = sorted({max(1, args.steps // 4), max(1, args.steps // 2), args.steps})
    methods = {
        "SGD (continued)": (sgd, start_sgd_state),
        f"DimReduce k={args.components}, alpha=0.001": (dim_reduce(basis), None),
        f"DimReduce k={args.components}, alpha={args.lr:g}": (dim_reduce(basis, alpha=args.lr), None),
    }
    l0, a0 = evaluate(start_params, x, y, x_test, y_test)
    rows = []
    for name, (tx, state0) in methods.items():
        run = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
        p, s = run.init(start_params)
        if state0 is not None:
            s = jax.device_put(state0, jax.tree.map(lambda a: a.sharding, s))
        accepted = forwards = 0
        results = {}
        for t in range(args.steps):
            p, s, _ = run(p, s, data[args.warmup + t])
            if name.startswith("DimReduce"):
                accepted += int(s.info.accepted)
                forwards += 1 + int(s.info.num_trials)
            else:
                forwards += 1
            if t + 1 in checkpoints:
                loss, acc = evaluate(unplaced(p), x, y, x_test, y_test)
                results[t + 1] = (float(loss), float(acc))
        rows.append(
            (name, results, accepted / args.steps if name.startswith("DimReduce") else None, forwards)
        )

    print(
        f"digits MLP ({n_params} params), {N_WORKERS} workers, batch {args.batch_size}, "
        f"SGD lr {args.lr} momentum 0.9; warm-up {args.warmup} steps, {len(snapshots)} snapshots, "
        f"k={args.components}"
    )
    print(f"start (after warm-up): train loss {float(l0):.4f}, test acc {float(a0):.4f}")
    head = "| method | " + " | ".join(f"loss @{c} | acc @{c}" for c in checkpoints)
    head += " | accepted | forward passes |"
    print(head)
    print("|" + "---|" * (2 + 2 * len(checkpoints) + 1))
    for name, results, acc_frac, forwards in rows:
        cells = " | ".join(f"{results[c][0]:.4f} | {results[c][1]:.4f}" for c in checkpoints)
        frac = "-" if acc_frac is None else f"{acc_frac:.0%}"
        print(f"| {name} | {cells} | {frac} | {forwards} |")


if __name__ == "__main__":
    main()
