"""DeMo, 1-bit Adam and CHOCO-SGD settings for the low-communication benchmark (not a benchmark).

``METHODS_B`` maps a method name to ``dict(make=make, per_worker_params=bool)``
where ``make(total_steps)`` returns the optax transform to train with for that
many steps (schedules are laid out over them). The settings were tuned on
the digits MLP of ``_common.py`` (8 workers, 16 examples per worker and
step) against dense data-parallel AdamW at the same number of steps.

Run ``python benchmarks/_lowcomm_methods.py`` for that check: it trains dense
AdamW and each method with the same batches and prints the test accuracy
gaps (``--steps``, ``--seeds``; the machine's load changes only the time).
With ``--steps 400 --seeds 2`` it gave: dense AdamW 97.9%, DeMo 98.7%
(+0.8), 1-bit Adam 98.9% (+1.0), CHOCO top-10% on a ring 97.9% (+0.0).
"""

from __future__ import annotations

import sys
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd

N = _common.N_WORKERS


def _cosine(peak: float, total_steps: int, warmup: int = 0) -> optax.Schedule:
    if warmup:
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1))
    return optax.cosine_decay_schedule(peak, max(total_steps, 1))


def make_dense_adamw(total_steps: int) -> optax.GradientTransformation:
    """The baseline: mean gradient (one all-reduce), then AdamW."""
    return optax.chain(
        jd.all_reduce(flatten=True), optax.adamw(_cosine(1e-2, total_steps), weight_decay=1e-4)
    )


def make_demo(total_steps: int) -> optax.GradientTransformation:
    # 8x8 DCT tiles, 4 of 64 coefficients kept per tile: 1/16 of the entries, 5 bytes each.
    return jd.decoupled_momentum(_cosine(3e-2, total_steps), decay=0.999, chunk=8, topk=4)


def make_onebit_adam(total_steps: int) -> optax.GradientTransformation:
    # 15% dense warm-up (DeepSpeed's guidance: until the variance settles), then 1-bit.
    return jd.onebit_adam(
        _cosine(1e-2, total_steps), freeze_step=max(1, total_steps * 15 // 100), num_workers=N
    )


def make_choco(total_steps: int) -> optax.GradientTransformation:
    # Local SGD with momentum, then CHOCO gossip on a ring sending the top 10% of x - x_hat.
    return optax.chain(
        jd.sgd(_cosine(0.2, total_steps), 0.9),
        jd.choco_gossip(jd.top_k(density=0.1), topology="ring", consensus_step=0.5),
    )


METHODS_B = {
    "demo": dict(make=make_demo, per_worker_params=False),
    "onebit_adam": dict(make=make_onebit_adam, per_worker_params=False),
    "choco_top10%": dict(make=make_choco, per_worker_params=True),
}


# ----------------------------------------------------------------------------
# The check.


def train(make, per_worker_params: bool, *, steps: int, seed: int, batch_size: int = 16) -> float:
    """Test accuracy (of the workers' mean parameters) after ``steps`` steps.

    The workers are simulated with ``jax.vmap(axis_name="data")`` and the whole
    run is one ``lax.scan`` (one compilation; the same maths as
    ``data_parallel_step`` on a mesh, which the tests check). Each worker gets
    its own ``batch_size`` examples per step, drawn with replacement.
    """
    x_train, y_train, x_test, y_test = _common.load_digits(0)
    tx = make(steps)
    params0 = _common.mlp_init(seed)
    rng = np.random.default_rng(1000 + seed)
    idx = rng.integers(0, len(y_train), size=(N, steps, batch_size))
    xs, ys = jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])

    def worker(xs, ys):
        def body(carry, batch):
            p, s = carry
            g = jax.grad(_common.mlp_loss)(p, batch)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(body, (params0, tx.init(params0)), {"x": xs, "y": ys})
        return p

    params = jax.jit(jax.vmap(worker, axis_name="data"))(xs, ys)
    if not per_worker_params:
        for leaf in jax.tree.leaves(params):  # replicas must agree bit for bit
            assert np.all(np.asarray(leaf) == np.asarray(leaf)[0]), "replicas differ"
    params = jax.tree.map(lambda p: jnp.mean(p, axis=0), params)
    return float(_common.mlp_accuracy(params, jnp.asarray(x_test), jnp.asarray(y_test)))


def steady_bytes(make, steps: int, start: int = 0) -> tuple[float, float]:
    """(bytes sent per worker at step ``start``, dense all-reduce bytes), from ``communication_cost``."""
    cost = jd.communication_cost(make(steps), _common.mlp_init(0), num_workers=N, steps=1, start=start)
    return cost.sent_bytes, cost.dense_bytes


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args(argv)
    steps, seeds = (20, 1) if args.quick else (args.steps, args.seeds)
    runs = {"dense_adamw": dict(make=make_dense_adamw, per_worker_params=False), **METHODS_B}
    t0 = time.time()
    results = {}
    for name, spec in runs.items():
        accs = [train(spec["make"], spec["per_worker_params"], steps=steps, seed=s) for s in range(seeds)]
        # 1-bit Adam: the bytes of the compressed phase (its warm-up steps are dense).
        start = steps * 15 // 100 if name == "onebit_adam" else 0
        results[name] = (100 * np.mean(accs), *steady_bytes(spec["make"], steps, start))
        print(f"  {name}: {results[name][0]:.1f}% ({time.time() - t0:.0f} s)", flush=True)
    dense = results["dense_adamw"][0]
    print(f"\ndigits MLP, {N} workers, {steps} steps of 16 examples per worker, {seeds} seed(s)\n")
    columns = ["method", "test acc", "vs dense AdamW", "sent / step (steady)", "vs dense"]
    print(_common.markdown_header(columns, "lrrrr"))
    for name, (acc, sent, dense_bytes) in results.items():
        cells = [
            f"{acc:.1f}%",
            f"{acc - dense:+.1f}",
            _common.fmt_bytes(sent),
            f"{dense_bytes / sent:.1f}x less",
        ]
        print(_common.markdown_row([name, *cells]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
