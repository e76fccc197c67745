"""DeMo, 1-bit Adam, CHOCO-SGD and Frontier II settings for the low-communication benchmark.

Not a benchmark. ``METHODS_B`` maps a method name to ``dict(make=make,
per_worker_params=bool)`` (and optionally ``eval(params, state) -> params``,
the model to test, and ``cost_steps(total_steps)``, the steps
``communication_cost`` averages over when the default period is not the
run's) where ``make(total_steps)`` returns the optax transform to train
with for that many steps (schedules are laid out over them). The DeMo,
1-bit Adam and CHOCO settings were tuned on the digits MLP of
``_common.py`` (8 workers, 16 examples per worker and step) against dense
data-parallel AdamW at the same number of steps.

The Frontier II rows (SparseLoCo, MuLoCo, NoLoCo, 0/1 Adam, DES-LOC) were
not tuned: they take bench_lowcomm's AdamW (peak 3e-3, 5% warm-up, cosine
to a tenth, weight decay 1e-4) and DiLoCo row's ``H = 50`` where they have
an inner optimizer or a period, and the papers' settings otherwise
(SparseLoCo: 64 of every 64x64 tile, 2 bits, error decay 0.95, outer SGD
at 1.0; MuLoCo: Muon inside at 0.02, 2-bit statistical quantization with
error decay 0.9, outer Nesterov SGD 0.8/0.9; NoLoCo: groups of 2, outer
0.7/0.5; 0/1 Adam: variance frozen after 15% of the steps, DeepSpeed's
``var_update_scaler=16``, local-step interval doubling every 32 steps up
to 16; DES-LOC: ``K_x = 16``, ``K_u = 48``, ``K_v = 96``, no bias
correction). Both Adams take ``eps = 1e-4`` (see ``EPS_1BIT``).

SparseLoCo and DiLoCo at the same shorter periods (``H = 10`` and ``25``,
rows built by ``same_period_rows``) take the same makers with
``sync_every=H``, nothing else changed: 1200 steps at ``H = 50`` give only
24 synchronisations.

Run ``python benchmarks/_lowcomm_methods.py`` for that check: it trains dense
AdamW and each method with the same batches and prints the test accuracy
gaps (``--steps``, ``--seeds``; the machine's load changes only the time).
With ``--steps 400 --seeds 2`` it gave: dense AdamW 97.9%, DeMo 98.7%
(+0.8), 1-bit Adam 98.9% (+1.0), CHOCO top-10% on a ring 97.9% (+0.0).
"""

from __future__ import annotations

import functools
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


# ----------------------------------------------------------------------------
# Frontier II: the same inner AdamW and period as bench_lowcomm's DiLoCo row.

H = 50


def _adamw(total_steps: int, peak: float = 3e-3) -> optax.GradientTransformation:
    return optax.adamw(_cosine_to_tenth(peak, total_steps), weight_decay=1e-4)


def _cosine_to_tenth(peak: float, total_steps: int) -> optax.Schedule:
    warmup = max(1, total_steps // 20)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), peak / 10)


def make_diloco(total_steps: int, sync_every: int = H) -> optax.GradientTransformation:
    # bench_lowcomm's DiLoCo row: the same AdamW inside, the default outer Nesterov SGD.
    return jd.diloco(_adamw(total_steps), sync_every=sync_every)


def make_sparseloco(total_steps: int, sync_every: int = H) -> optax.GradientTransformation:
    # 64 of every 64x64 tile (1.56%), 2-bit codes, error decay 0.95, outer SGD at 1.0.
    return jd.sparseloco(
        _adamw(total_steps), sync_every=sync_every, topk=64, chunk=64, bits=2, error_decay=0.95
    )


def make_muloco(total_steps: int) -> optax.GradientTransformation:
    # Muon on the matrices (Adam at AdamW's rate on the rest), 2-bit whole-leaf codebooks outside.
    muon = optax.contrib.muon(
        _cosine_to_tenth(0.02, total_steps),
        beta=0.9,
        adam_learning_rate=_cosine_to_tenth(3e-3, total_steps),
    )
    return jd.diloco(
        muon,
        sync_every=H,
        outer=optax.sgd(0.8, momentum=0.9, nesterov=True),
        aggregate=jd.statistical_quantize(2, error_decay=0.9),
    )


def make_noloco(total_steps: int) -> optax.GradientTransformation:
    # Under vmap every step runs every compiled exchange: a few draws, then they cycle.
    return jd.noloco(_adamw(total_steps), sync_every=H, num_permutations=4)


# Coordinates whose gradient is always 0 (the digits' blank pixels, dead ReLUs) keep v = 0,
# while a 1-bit message (or a momentum averaged on another period) gives them a step: divided
# by eps = 1e-8 it blew the CNN up. eps = 1e-4 bounds it.
EPS_1BIT = 1e-4


def make_zero_one_adam(total_steps: int) -> optax.GradientTransformation:
    return jd.zero_one_adam(
        _cosine_to_tenth(3e-3, total_steps),
        var_freeze_step=max(1, total_steps * 15 // 100),
        num_workers=N,
        eps=EPS_1BIT,
        var_update_scaler=16,
        local_step_scaler=32,
        local_step_clipper=16,
    )


def make_desloc(total_steps: int) -> optax.GradientTransformation:
    # The paper's rule: no bias correction (its box shows none).
    return jd.desloc_adam(
        _cosine_to_tenth(3e-3, total_steps),
        sync_every=16,
        momentum_sync_every=48,
        variance_sync_every=96,
        weight_decay=1e-4,
        eps=EPS_1BIT,
        bias_correction=False,
    )


def _anchor(params, state):
    """The DiLoCo anchor (the model every worker agrees on) of worker 0."""
    del params
    return jax.tree.map(lambda x: x[0], state.anchor)


def _whole_run(total_steps: int) -> int:
    return total_steps


def same_period_rows(periods) -> dict[str, dict]:
    """DiLoCo and SparseLoCo rows at each sync period in ``periods``, otherwise the H=50 settings."""
    rows = {}
    for h in periods:
        for name, make in (
            (f"DiLoCo H={h}", make_diloco),
            (f"SparseLoCo H={h} 64/4096 2-bit", make_sparseloco),
        ):
            rows[name] = dict(
                make=functools.partial(make, sync_every=h), per_worker_params=True, eval=_anchor
            )
    return rows


METHODS_B = {
    "demo": dict(make=make_demo, per_worker_params=False),
    "onebit_adam": dict(make=make_onebit_adam, per_worker_params=False),
    "choco_top10%": dict(make=make_choco, per_worker_params=True),
    "SparseLoCo H=50 64/4096 2-bit": dict(make=make_sparseloco, per_worker_params=True, eval=_anchor),
    "MuLoCo H=50 2-bit": dict(make=make_muloco, per_worker_params=True, eval=_anchor),
    "NoLoCo H=50 pairs": dict(make=make_noloco, per_worker_params=True),
    "0/1 Adam": dict(make=make_zero_one_adam, per_worker_params=True, cost_steps=_whole_run),
    "DES-LOC Adam 16/48/96": dict(make=make_desloc, per_worker_params=True),
    **same_period_rows((10, 25)),
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
            f"{dense_bytes / sent:.1f}x less" if sent else "sends nothing at step 0",
        ]
        print(_common.markdown_row([name, *cells]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
