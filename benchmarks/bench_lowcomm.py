"""Low-communication training: DiLoCo and Streaming DiLoCo against dense data-parallel AdamW.

Each method trains two small models on scikit-learn's digits with 8 workers
(16 examples per worker and step, the workers' batches drawn independently):
the 64-32-10 tanh MLP of ``_common`` and a small CNN on the 8x8 images (two
3x3 convolutions, the second with stride 2, and a linear read-out). The
workers run under ``jax.vmap(axis_name="data")`` in one ``lax.scan`` per run:
the transforms run the same code as under ``shard_map``, and the training
takes seconds on a CPU.

Columns:

* ``test acc``: test accuracy (357 held-out images) after ``--steps`` steps,
  mean over ``--seeds`` seeds (min..max), of the global model: the DiLoCo
  anchor, the workers' mean for other per-worker methods, the replicated
  parameters otherwise.
* ``bytes/step``: bytes a worker sends per step averaged over a period, from
  :func:`jaxopt_dist.communication_cost` (exact, read off the traced update);
  ``peak`` the busiest step.
* ``ratio``: dense AdamW's bytes per step divided by the method's.
* ``dense @ equal bytes``: dense AdamW given the method's total byte budget,
  i.e. ``steps / ratio`` steps (its schedule rescaled to that length).

Every method's optimizer comes from the ``METHODS`` table below: a name maps
to ``dict(make=callable(total_steps) -> tx, per_worker_params=bool)`` (and an
optional ``eval(params, state) -> params`` picking the model to test, and
``cost_steps(total_steps)``: the steps the bytes are averaged over, where
the default period of ``communication_cost`` is not the run's). DeMo, 1-bit
Adam, CHOCO and the Frontier II rows (SparseLoCo, MuLoCo, NoLoCo, 0/1 Adam,
DES-LOC) come from ``_lowcomm_methods.METHODS_B``.

Run: ``python benchmarks/bench_lowcomm.py`` (``--quick`` for a smoke run: 120 steps, one seed, no
``dense @ equal bytes`` column).
"""

from __future__ import annotations

import functools
import math
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _lowcomm_methods import METHODS_B

import jaxopt_dist as jd

N = _common.N_WORKERS
BATCH = 16  # per worker
LR = 3e-3
WD = 1e-4


def _adamw(total_steps: int, lr: float = LR) -> optax.GradientTransformation:
    warmup = max(1, total_steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), lr / 10)
    return optax.adamw(schedule, weight_decay=WD)


def _anchor(params, state):
    del params
    return jax.tree.map(lambda x: x[0], state.anchor)


METHODS = {
    "dense AdamW": dict(
        make=lambda total: optax.chain(jd.all_reduce(), _adamw(total)), per_worker_params=False
    ),
    "DiLoCo H=50": dict(
        make=lambda total: jd.diloco(_adamw(total), sync_every=50), per_worker_params=True, eval=_anchor
    ),
    "DiLoCo H=50, E3M0": dict(
        make=lambda total: jd.diloco(_adamw(total), sync_every=50, aggregate=jd.low_bit()),
        per_worker_params=True,
        eval=_anchor,
    ),
    "Streaming F=4 H=60": dict(
        make=lambda total: jd.diloco(_adamw(total), sync_every=60, num_fragments=4),
        per_worker_params=True,
        eval=_anchor,
    ),
    "Streaming F=4 H=60, E3M0": dict(
        make=lambda total: jd.diloco(_adamw(total), sync_every=60, num_fragments=4, aggregate=jd.low_bit()),
        per_worker_params=True,
        eval=_anchor,
    ),
    "Streaming F=4 H=60, E3M0, tau=5, alpha=0.5": dict(
        make=lambda total: jd.diloco(
            _adamw(total), sync_every=60, num_fragments=4, sync_delay=5, mixing=0.5, aggregate=jd.low_bit()
        ),
        per_worker_params=True,
        eval=_anchor,
    ),
    **METHODS_B,
}


# ----------------------------------------------------------------------------
# Models.


def cnn_init(seed: int = 0) -> dict[str, jax.Array]:
    """A 3x3 conv (8 channels), a 3x3 stride-2 conv (16), a linear read-out: 3,818 parameters."""
    rng = np.random.default_rng(seed)

    def he(shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape) * np.sqrt(2.0 / fan_in), jnp.float32)

    return {
        "conv1": he((3, 3, 1, 8), 9),
        "bias1": jnp.zeros(8, jnp.float32),
        "conv2": he((3, 3, 8, 16), 72),
        "bias2": jnp.zeros(16, jnp.float32),
        "dense": he((256, 10), 256) / 2,
        "bias3": jnp.zeros(10, jnp.float32),
    }


def cnn_logits(params, x):
    h = x.reshape(-1, 8, 8, 1)
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(h, params["conv1"], (1, 1), "SAME", dimension_numbers=dims)
    h = jax.nn.relu(h + params["bias1"][None, None, None, :])
    h = jax.lax.conv_general_dilated(h, params["conv2"], (2, 2), "SAME", dimension_numbers=dims)
    h = jax.nn.relu(h + params["bias2"][None, None, None, :])
    return h.reshape(h.shape[0], -1) @ params["dense"] + params["bias3"][None, :]


MODELS = {
    "digits MLP": (_common.mlp_init, _common.mlp_logits),
    "digits CNN": (cnn_init, cnn_logits),
}


# ----------------------------------------------------------------------------
# Training: the workers under vmap, the steps in one scan.


def _batches(x, y, steps: int, seed: int):
    """Per-step, per-worker batches drawn from the training set: (steps, N, BATCH, ...)."""
    idx = np.random.default_rng(seed).integers(0, len(y), size=(steps, N, BATCH))
    return jnp.asarray(x[idx]), jnp.asarray(y[idx])


@functools.cache
def _trainer(name: str, model: str, steps: int):
    method = {**METHODS}[name]
    init, logits = MODELS[model]
    tx = method["make"](steps)
    per_worker = method["per_worker_params"]

    def loss_fn(p, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, xb), yb).mean()

    def worker_step(p, s, xb, yb):
        g = jax.grad(loss_fn)(p, xb, yb)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    vstep = jax.vmap(worker_step, axis_name="data")

    @jax.jit
    def run(p0, xs, ys):
        p = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *v.shape)), p0)
        s = jax.vmap(tx.init)(p)
        (p, s), _ = jax.lax.scan(lambda c, b: (vstep(*c, *b), None), (p, s), (xs, ys))
        return p, s

    def evaluate(p, s):
        if "eval" in method:
            return method["eval"](p, s)
        if per_worker:
            return jax.tree.map(lambda v: jnp.mean(v, axis=0), p)
        return jax.tree.map(lambda v: v[0], p)

    return run, evaluate, logits, tx


def train(name: str, model: str, steps: int, seed: int, data) -> float:
    """Test accuracy of ``name`` on ``model`` after ``steps`` steps."""
    x_tr, y_tr, x_te, y_te = data
    run, evaluate, logits, _ = _trainer(name, model, steps)
    xs, ys = _batches(x_tr, y_tr, steps, seed)
    p, s = run(MODELS[model][0](seed), xs, ys)
    final = evaluate(p, s)
    return float(jnp.mean(jnp.argmax(logits(final, jnp.asarray(x_te)), -1) == jnp.asarray(y_te)))


def cost(name: str, model: str, steps: int) -> jd.CommunicationCost:
    method = METHODS[name]
    cost_steps = method["cost_steps"](steps) if "cost_steps" in method else None
    return jd.communication_cost(method["make"](steps), MODELS[model][0](0), num_workers=N, steps=cost_steps)


def _acc(values: list[float]) -> str:
    return f"{100 * np.mean(values):.1f}% ({100 * min(values):.1f}..{100 * max(values):.1f})"


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default="", help="comma-separated subset of METHODS (default: all)")
    args = ap.parse_args()
    steps, seeds = (120, 1) if args.quick else (args.steps, args.seeds)
    data = _common.load_digits()
    names = [m for m in args.methods.split(",") if m] or list(METHODS)
    dense = "dense AdamW"
    start = time.time()
    print(f"{N} workers, {BATCH} examples per worker and step, {steps} steps, {seeds} seed(s)\n")
    for model in args.models.split(","):
        n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(MODELS[model][0](0)))
        print(f"### {model} ({n_params:,} parameters)\n")
        print(
            _common.markdown_header(
                [
                    "method",
                    "test acc",
                    "bytes/step",
                    "peak bytes/step",
                    "ratio",
                    "dense @ equal bytes",
                    "gap",
                ],
                "lrrrrrr",
            )
        )
        dense_bytes = cost(dense, model, steps).sent_bytes
        dense_acc = np.mean([train(dense, model, steps, s, data) for s in range(seeds)])
        for name in names:
            c = cost(name, model, steps)
            accs = [train(name, model, steps, s, data) for s in range(seeds)]
            ratio = dense_bytes / c.sent_bytes if c.sent_bytes else math.inf
            if name == dense or args.quick:  # --quick: a smoke run, without the third training per row
                at_bytes = "-"
            else:
                budget = max(1, int(round(steps / ratio)))
                at_bytes = f"{100 * np.mean([train(dense, model, budget, s, data) for s in range(seeds)]):.1f}% ({budget} steps)"
            print(
                _common.markdown_row(
                    [
                        name,
                        _acc(accs),
                        _common.fmt_bytes(c.sent_bytes),
                        _common.fmt_bytes(c.peak_sent_bytes),
                        f"{ratio:.0f}x",
                        at_bytes,
                        f"{100 * (np.mean(accs) - dense_acc):+.1f} pt",
                    ]
                ),
                flush=True,
            )
        print()
    print(f"total time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
