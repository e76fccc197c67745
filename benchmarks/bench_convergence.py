"""Does compression cost accuracy? Digits MLP, 8 workers, same step budget.

Every method trains the demo's Flax MLP on scikit-learn's digits across 8
(simulated) devices for the same number of steps on the same batches. The
learning rate and momentum are tuned once per method: a grid search picks
the setting with the best accuracy on a validation split (the last 20% of
the training images); then that setting is run with several seeds and the
test accuracy (mean, min, max) is reported.

Methods: dense all-reduce, PowerSGD rank 2, top-k 1% with and without error
feedback, random-k 1%, majority-vote signum, EF-signSGD, QSGD.

Run: ``python benchmarks/bench_convergence.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import functools
import itertools
import sys
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd

demo = _common.import_demo()  # the model and the data of the demo

LRS = (0.02, 0.05, 0.1, 0.2, 0.5)
SIGN_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
MOMENTA = (0.0, 0.9)


def make(name, lr, mom):
    """The method's optimizer for a learning rate and momentum."""
    step = jd.sgd(lr, mom)
    return {
        "dense": lambda: optax.chain(jd.all_reduce(flatten=True), step),
        "powersgd_r2": lambda: optax.chain(jd.powersgd(rank=2), step),
        "top_k_1%": lambda: optax.chain(jd.top_k(density=0.01), step),
        "top_k_1%_no_ef": lambda: optax.chain(jd.top_k(density=0.01, error_feedback=False), step),
        "random_k_1%": lambda: optax.chain(jd.random_k(density=0.01), step),
        # signum: local momentum, vote on its sign, step of size lr.
        "sign_vote": lambda: optax.chain(
            *([jd.scale_by_momentum(mom)] if mom else []), jd.sign_majority_vote(), jd.sgd(lr)
        ),
        "ef_sign": lambda: optax.chain(jd.scaled_sign(), step),
        "qsgd_4": lambda: optax.chain(jd.qsgd(4, bucket_size=512), step),
        # The previous implementations, kept as options (not in METHODS; pick them with --methods).
        "random_k_1%_subset": lambda: optax.chain(jd.random_k(density=0.01, pattern="subset"), step),
        "qsgd_4_threefry": lambda: optax.chain(jd.qsgd(4, bucket_size=512, rng="threefry"), step),
    }[name]()


METHODS = (
    "dense",
    "powersgd_r2",
    "top_k_1%",
    "top_k_1%_no_ef",
    "random_k_1%",
    "sign_vote",
    "ef_sign",
    "qsgd_4",
)


def train(tx, *, model, params0, x, y, mesh, steps, batch_size, seed):
    def loss_fn(params, batch):
        logits = model.apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
    params, opt_state = step.init(params0)
    loss = float("nan")
    for t in range(steps):
        batch = demo.batch_at(x, y, batch_size, t, seed)
        params, opt_state, metrics = step(params, opt_state, batch)
        # Wait for each step: with 8 devices simulated on few cores, hundreds of queued
        # steps can starve a device thread at a collective's rendezvous.
        loss = float(metrics["loss"])
    return jax.device_get(params), loss


def accuracy(model, params, x, y):
    return float(np.mean(np.argmax(model.apply(params, x), -1) == y))


def main(argv=None):
    ap = _common.parser(__doc__, quick_help="two methods, tiny grid, few steps")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16, help="examples per worker per step")
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated method names (default: all of METHODS; also random_k_1%%_subset, qsgd_4_threefry)",
    )
    ap.add_argument(
        "--lr", type=float, default=None, help="skip the grid: this learning rate for every method"
    )
    ap.add_argument("--momentum", type=float, default=None, help="with --lr: this momentum (default 0)")
    args = ap.parse_args(argv)
    methods, lrs, momenta, steps, seeds = METHODS, LRS, MOMENTA, args.steps, args.seeds
    if args.methods:
        methods = tuple(args.methods.split(","))
    if args.quick:
        methods, lrs, momenta, steps, seeds = ("dense", "top_k_1%"), (0.05,), (0.9,), 20, 1

    n = _common.N_WORKERS
    mesh = _common.data_mesh(n)
    (x_train, y_train), (x_test, y_test) = demo.load_data(0)
    split = int(0.8 * len(x_train))
    x_fit, y_fit, x_val, y_val = x_train[:split], y_train[:split], x_train[split:], y_train[split:]
    model = demo.MLP()
    params0 = model.init(jax.random.key(0), jnp.zeros((1, 64)))
    print(
        f"digits MLP ({sum(p.size for p in jax.tree.leaves(params0))} params), {n} workers, {steps} steps of "
        f"{args.batch_size} examples per worker; grid lr x momentum on a validation split, then {seeds} seed(s)"
    )
    run = functools.partial(
        train, model=model, params0=params0, mesh=mesh, steps=steps, batch_size=args.batch_size * n
    )
    t0 = time.time()
    results = []
    for name in methods:
        grid = SIGN_LRS if name == "sign_vote" and not args.quick else lrs
        if args.lr is not None:
            grid, momenta = (args.lr,), (args.momentum or 0.0,)
        best = (None, grid[0], momenta[0])  # a single setting needs no validation run
        if len(grid) * len(momenta) > 1:
            best = None
            for lr, mom in itertools.product(grid, momenta):
                params, _ = run(make(name, lr, mom), x=x_fit, y=y_fit, seed=100)
                val = accuracy(model, params, x_val, y_val)
                if best is None or val > best[0]:
                    best = (val, lr, mom)
        assert best is not None
        _, lr, mom = best
        accs, losses = [], []
        for seed in range(seeds):
            params, loss = run(make(name, lr, mom), x=x_train, y=y_train, seed=seed)
            accs.append(accuracy(model, params, x_test, y_test))
            losses.append(loss)
        cost = jd.communication_cost(make(name, lr, mom), params0, num_workers=n)
        results.append((name, lr, mom, accs, losses, cost.compression_ratio))
        print(f"  {name}: lr={lr:g} momentum={mom:g} test acc {100 * np.mean(accs):.1f}%", flush=True)

    dense_acc = 100 * np.mean(results[0][3]) if results[0][0] == "dense" else None
    print()
    columns = ["method", "lr", "momentum", "test acc (mean of seeds)", "min / max", "vs dense (points)"]
    print(_common.markdown_header([*columns, "final loss", "compression"], "l" + "r" * 7))
    for name, lr, mom, accs, losses, ratio in results:
        acc = 100 * np.mean(accs)
        delta = "" if dense_acc is None else f"{acc - dense_acc:+.1f}"
        spread = f"{100 * min(accs):.1f} / {100 * max(accs):.1f}"
        cells = [
            f"{lr:g}",
            f"{mom:g}",
            f"{acc:.1f}%",
            spread,
            delta,
            f"{np.mean(losses):.3f}",
            f"{ratio:.1f}x",
        ]
        print(_common.markdown_row([name, *cells]))
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
