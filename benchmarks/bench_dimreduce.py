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

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import numpy as np
import optax

import jaxopt_dist as jd

N_WORKERS = _common.N_WORKERS


@jax.jit
def evaluate(params, x, y, x_test, y_test):
    """Full training loss and test accuracy."""
    return _common.mlp_loss(params, {"x": x, "y": y}), _common.mlp_accuracy(params, x_test, y_test)


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
    ap = _common.parser(__doc__)
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

    x, y, x_test, y_test = _common.load_digits(args.seed)
    mesh = _common.data_mesh(N_WORKERS)
    sgd = optax.chain(jd.all_reduce(), jd.sgd(args.lr, momentum=0.9))
    data = batches(x, y, args.batch_size, args.warmup + args.steps, args.seed + 1)

    # 1. Warm-up with SGD, taking snapshots.
    step = jd.data_parallel_step(_common.mlp_loss, sgd, mesh=mesh)
    params, opt_state = step.init(_common.mlp_init(args.seed))
    snapshots = []
    for t in range(args.warmup):
        params, opt_state, _ = step(params, opt_state, data[t])
        if (t + 1) % args.snapshot_every == 0:
            snapshots.append(unplaced(params))
    start_params, start_sgd_state = unplaced(params), unplaced(opt_state)
    basis = jd.fit_subspace(snapshots, args.components)
    n_params = basis.shape[1]

    # 2. N more steps of each method from the same point and batches.
    checkpoints = sorted({max(1, args.steps // 4), max(1, args.steps // 2), args.steps})
    methods = {
        "SGD (continued)": (sgd, start_sgd_state),
        f"DimReduce k={args.components}, alpha=0.001": (jd.dim_reduce(basis), None),
        f"DimReduce k={args.components}, alpha={args.lr:g}": (jd.dim_reduce(basis, alpha=args.lr), None),
    }
    l0, a0 = evaluate(start_params, x, y, x_test, y_test)
    rows = []
    for name, (tx, state0) in methods.items():
        run = jd.data_parallel_step(_common.mlp_loss, tx, mesh=mesh)
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
    metrics = [f"{m} @{c}" for c in checkpoints for m in ("loss", "acc")]
    print(_common.markdown_header(["method", *metrics, "accepted", "forward passes"]))
    for name, results, acc_frac, forwards in rows:
        cells = [f"{v:.4f}" for c in checkpoints for v in results[c]]
        frac = "-" if acc_frac is None else f"{acc_frac:.0%}"
        print(_common.markdown_row([name, *cells, frac, forwards]))


if __name__ == "__main__":
    main()
