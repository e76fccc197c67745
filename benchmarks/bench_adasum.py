"""What does AdaSum cost on the wire, and does it train better than the mean at large steps?

Part 1, communication (no devices needed). For a model of ``N`` bytes and
``n`` workers, the bytes each worker sends per step, the collectives issued
and the latency terms (sequential message rounds under the standard
algorithms: ring all-reduce and all-gather, one round per ppermute), read off
the traced update by ``communication_cost``, for

* ``mean``: ``optax.chain(all_reduce(flatten=True), ...)``, one ring all-reduce;
* ``butterfly``: ``adasum()``, recursive doubling, whole vectors each round;
* ``halving``: ``adasum(method="halving")``, MindSpore's recursive halving.

Part 2, convergence. A 64-32-10 tanh MLP on scikit-learn's digits (1440
training images), 8 simulated workers with ``jd.data_parallel_step``, 8
examples per worker and step, plain SGD. For a sweep of learning rates:
the steps until the full training loss first drops below a target, for
``chain(all_reduce(), sgd(lr))`` (mean), ``chain(adasum(), sgd(lr))``
(AdaSumByGrad) and the sum of gradients (``all_reduce(reduction="sum")``,
i.e. the mean at ``8 lr``, the linear scaling rule). Same initialisation and
batches for every run. No timings: this is about progress per step.

Run: ``python benchmarks/bench_adasum.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import math

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd

N_WORKERS = _common.N_WORKERS


# ----------------------------------------------------------------------------
# Part 1: communication.


def communication_table(worker_counts, models) -> str:
    rows = []
    header = (
        f"{'model':<12}{'n':>4}  {'method':<10}{'sent / worker':>15}{'x params':>10}{'collectives':>13}"
        f"{'latency terms':>15}"
    )
    methods = {
        "mean": lambda: jd.all_reduce(flatten=True),
        "butterfly": lambda: jd.adasum(),
        "halving": lambda: jd.adasum(method="halving"),
    }
    for model_name, params in models.items():
        params_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
        for n in worker_counts:
            for name, make in methods.items():
                cost = jd.communication_cost(make(), params, num_workers=n)
                (step,) = [s for s in cost.steps if s.step in set(cost.period)][:1] or cost.steps[:1]
                latency = sum(c.rounds() for c in step.collectives)
                rows.append(
                    f"{model_name:<12}{n:>4}  {name:<10}{_common.fmt_bytes(cost.sent_bytes):>15}"
                    f"{cost.sent_bytes / params_bytes:>10.3f}{cost.calls:>13.0f}{latency:>15d}"
                )
            rows.append("")
    return "\n".join([header, "-" * len(header), *rows])


# ----------------------------------------------------------------------------
# Part 2: convergence on digits.


def steps_to_target(tx, data, *, steps, per_worker_batch, target, eval_every, seed=1):
    """Steps until the full training loss is below ``target`` (None if never); also the final loss."""
    x, y = data
    step = jd.data_parallel_step(_common.mlp_loss, tx, mesh=_common.data_mesh(N_WORKERS))
    params, state = step.init(_common.mlp_init())
    full = jax.jit(lambda p: _common.mlp_loss(p, {"x": x, "y": y}))
    rng = np.random.default_rng(seed)
    hit, loss = None, float("nan")
    for t in range(1, steps + 1):
        idx = rng.integers(0, len(y), N_WORKERS * per_worker_batch)
        params, state, _ = step(params, state, {"x": x[idx], "y": y[idx]})
        if t % eval_every == 0:
            loss = float(full(params))
            if hit is None and loss < target:
                hit = t
            if not np.isfinite(loss) or loss > 1e3:
                break
    return hit, loss


def convergence_table(learning_rates, *, steps, per_worker_batch, target, eval_every) -> str:
    x, y, _, _ = _common.load_digits()
    data = x, y
    variants = {
        "mean": lambda lr: optax.chain(jd.all_reduce(), jd.sgd(lr)),
        "adasum": lambda lr: optax.chain(jd.adasum(), jd.sgd(lr)),
        "sum (= mean at 8 lr)": lambda lr: optax.chain(jd.all_reduce(reduction="sum"), jd.sgd(lr)),
    }
    header = f"{'lr':>6}" + "".join(f"{name:>26}" for name in variants)
    lines = [
        f"steps to full-train loss < {target} (max {steps}; evaluated every {eval_every}); final loss in ()",
        header,
        "-" * len(header),
    ]
    best: dict[str, tuple[int, float] | None] = dict.fromkeys(variants)
    for lr in learning_rates:
        cells = []
        for name, make in variants.items():
            hit, loss = steps_to_target(
                make(lr),
                data,
                steps=steps,
                per_worker_batch=per_worker_batch,
                target=target,
                eval_every=eval_every,
            )
            shown = "-" if hit is None else str(hit)
            final = "diverged" if not np.isfinite(loss) or loss > 1e3 else f"{loss:.3f}"
            cells.append(f"{shown + ' (' + final + ')':>26}")
            if hit is not None and (best[name] is None or hit < best[name][0]):
                best[name] = (hit, lr)
        lines.append(f"{lr:>6g}" + "".join(cells))
    lines.append("")
    for name, b in best.items():
        lines.append(f"best {name}: " + ("never reached" if b is None else f"{b[0]} steps at lr={b[1]:g}"))
    return "\n".join(lines)


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument(
        "--only",
        choices=("comm", "convergence"),
        default=None,
        help="run one part (comm only traces; seconds)",
    )
    args = parser.parse_args()
    if args.quick:
        worker_counts = (3, 8)
        models = {"digits-mlp": _common.mlp_init()}
        lrs, steps, eval_every = (0.3, 1.0), 40, 5
    else:
        worker_counts = (2, 3, 4, 6, 8, 16, 64)
        models = {
            "digits-mlp": _common.mlp_init(),
            "4M-f32": {
                "w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
                "b": jax.ShapeDtypeStruct((1024,), jnp.float32),
            },
        }
        lrs, steps, eval_every = (0.1, 0.3, 1.0, 3.0), 300, 5
    if args.only in (None, "comm"):
        print("== Part 1: communication per worker and step ==")
        print(communication_table(worker_counts, models))
        print()
    if args.only in (None, "convergence"):
        print(f"== Part 2: convergence, digits MLP, {N_WORKERS} workers x 8 examples, plain SGD ==")
        print(convergence_table(lrs, steps=steps, per_worker_batch=8, target=0.3, eval_every=eval_every))


if __name__ == "__main__":
    main()
