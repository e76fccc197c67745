"""Robust aggregation against Byzantine workers: digits in process, DiLoCo on the byte-level GPT, the cost.

Four measurements, each a table (``--part`` picks some):

* ``digits``: the demo's Flax MLP (64-128-128-10, 26,122 parameters) on
  scikit-learn's digits, 8 workers of 16 examples each, 300 steps; each
  worker keeps a momentum (0.9) of its gradient and sends it, the aggregate
  combines what the workers sent, SGD steps with it (learning rate 0.2, the
  dense row's tuned value in the convergence benchmark). With no fault and
  the mean aggregate this is dense SGD with momentum. The last 0, 1 or 2
  workers are Byzantine from the first step on, sending, in place of their
  momentum ``m``: ``nan`` (NaN everywhere), ``signflip:K`` (``-K m``),
  ``scale:K`` (``K m``) or ``random:S`` (Gaussian noise of standard
  deviation ``S``, a fresh draw each step). Test accuracy, mean over the
  seeds (min..max), for each aggregate against the fault-free mean.
  ``centered_clip``'s radius (``--radius``, 10 by default) lies above the
  honest workers' distance from the previous output in a fault-free run
  (``spread``: up to 12 in the first 30 steps, 90% of them below 6; below
  4 after step 120).
* ``gpt``: DiLoCo on the byte-level GPT of ``examples/lm.py`` (AdamW inner
  steps, Nesterov outer step), 4 replicas on one CPU device under
  ``jax.vmap``; one replica sends ``signflip:10`` of its pseudo-gradient at
  every synchronisation. Validation bits per byte at the anchor, mean over
  the seeds, for the mean, ``trimmed_mean(1)`` and ``centered_clip``
  (``--gpt-radius``, 1 by default), against the fault-free mean.
* ``cost``: what each rule costs with no fault, on the digits MLP with 8
  workers: bytes a worker sends per step (:func:`jaxopt_dist.communication_cost`)
  and the median step time of :func:`jaxopt_dist.data_parallel_step` on 8
  simulated CPU devices, as a ratio to the mean's in the same process.
* ``spread`` (not run by default): in the fault-free digits run with the
  mean, each worker's distance from the previous step's mean (the center
  ``centered_clip`` clips around), by windows of steps.
* ``islands`` (not run by default; needs torch and torchft, so Python 3.11
  here): 4 islands of ``examples/islands.py`` over torchft on loopback (one
  process each and a lighthouse), the digits MLP, ``H = 10``,
  ``--islands-steps`` inner steps. Fault-free, then with island 3 started
  with ``--byzantine signflip:10``, then with ``--byzantine nan``, for each
  ``--islands-aggregates`` (default: ``mean``, ``trimmed_mean:1`` and
  ``centered_clip``, the example's radius). The final validation loss of
  island 0's anchor (every island holds the same one), its ratio to the
  fault-free islands' with the same aggregate and with the mean; the mean
  of its last 5 rounds' validation losses (the final one moves by several
  percent from round to round at these settings) against the fault-free
  mean's; the hangs, the rounds whose members logged different anchors, the
  errors and the contributions left out as non-finite.

Run: ``python benchmarks/bench_robust.py`` (digits, cost and gpt; ``--quick`` for a
smoke run; ``--seeds``, ``--steps``, ``--gpt-steps`` to change the sizes;
``--only centered_clip,trimmed`` for some rows, the mean's always).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd

demo = _common.import_demo()

N_WORKERS = 8
LR, MOMENTUM = 0.2, 0.9
RADIUS = 10.0  # centered_clip's radius on the digits workers' momenta (see RESULTS.md for the sweep)
MODES = ("nan", "signflip:10", "scale:100", "random:1")


# ----------------------------------------------------------------------------
# Byzantine workers.


class ByzantineState(NamedTuple):
    count: jax.Array  # int32[]: the calls so far (a fresh noise draw each call)


def byzantine(
    mode: str, bad: int, *, seed: int = 0, axis_name: str = "data"
) -> optax.GradientTransformationExtraArgs:
    """The last ``bad`` workers of ``axis_name`` send, in place of their update ``u``, what ``mode`` says.

    ``mode``: ``"nan"``, ``"signflip:K"`` (``-K u``), ``"scale:K"`` (``K u``) or ``"random:S"``
    (Gaussian noise of standard deviation ``S``). The others pass ``u`` on unchanged.
    """
    kind, _, arg = mode.partition(":")
    if kind not in ("nan", "signflip", "scale", "random") or (kind == "nan") == bool(arg):
        raise ValueError(f"mode must be nan, signflip:K, scale:K or random:S; got {mode!r}")
    value = float(arg) if arg else 0.0

    def replace(u, key):
        if kind == "nan":
            return jnp.full_like(u, jnp.nan)
        if kind == "signflip":
            return -value * u
        if kind == "scale":
            return value * u
        return value * jax.random.normal(key, u.shape, u.dtype)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        me = jax.lax.axis_index(axis_name)
        is_bad = me >= jax.lax.axis_size(axis_name) - bad
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state.count), me)
        leaves, treedef = jax.tree.flatten(updates)
        keys = jax.random.split(key, len(leaves))
        out = [jnp.where(is_bad, replace(u, k), u) for u, k in zip(leaves, keys)]
        return jax.tree.unflatten(treedef, out), ByzantineState(count=state.count + 1)

    return optax.GradientTransformationExtraArgs(
        lambda p: ByzantineState(jnp.zeros([], jnp.int32)), update_fn
    )


# ----------------------------------------------------------------------------
# Digits: 8 workers under vmap, the seeds under an outer vmap, the steps in a scan.


def aggregates(radius: float, iterations: int = 1) -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The digits rows: label -> aggregate factory, the mean first."""
    clip = f"centered_clip({radius:g})" if iterations == 1 else f"centered_clip({radius:g}, {iterations})"
    return {
        "mean (all_reduce)": lambda: jd.all_reduce(),
        "trimmed_mean(1)": lambda: jd.trimmed_mean(1),
        "trimmed_mean(2)": lambda: jd.trimmed_mean(2),
        "coordinate_median": lambda: jd.coordinate_median(),
        clip: lambda: jd.centered_clip(radius, iterations),
        "norm_clipped_mean": lambda: jd.norm_clipped_mean(),
    }


def selected(labels, args) -> list[str]:
    """The labels that ``--only`` picks (by prefix; the first label, the mean, always), or the first two with ``--quick``."""
    labels = list(labels)
    if args.quick:
        return labels[:2]
    if not args.only:
        return labels
    prefixes = [p.strip() for p in args.only.split(",")]
    return [labels[0]] + [x for x in labels[1:] if any(x.startswith(p) for p in prefixes)]


def digits_tx(aggregate: optax.GradientTransformation, mode: str, bad: int) -> optax.GradientTransformation:
    """Worker momentum, the Byzantine workers' substitution, the aggregate, then the SGD step."""
    parts = [jd.scale_by_momentum(MOMENTUM)]
    if bad:
        parts.append(byzantine(mode, bad))
    return optax.chain(*parts, aggregate, jd.sgd(LR))


class Digits:
    """The data, the model and a compiled trainer per optimizer: every seed in one program."""

    def __init__(self, steps: int, seeds: int, batch: int = 16):
        (self.x, self.y), (self.x_test, self.y_test) = demo.load_data(0)
        self.model = demo.MLP()
        self.steps, self.seeds, self.batch = steps, seeds, batch
        self.params0 = jax.vmap(lambda k: self.model.init(k, jnp.zeros((1, 64))))(
            jax.random.split(jax.random.key(0), seeds)
        )
        rng = np.random.default_rng(1)
        self.index = rng.integers(0, len(self.x), (seeds, steps, N_WORKERS, batch)).astype(np.int32)

    def loss(self, params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(self.model.apply(params, x), y).mean()

    def accuracy(self, tx: optax.GradientTransformation) -> np.ndarray:
        """Test accuracy (percent) after training with ``tx``, one per seed; NaN where a parameter is not finite."""
        params, _ = self._train(tx)(self.params0, self.index)
        logits = jax.vmap(self.model.apply, in_axes=(0, None))(params, self.x_test)
        accuracy = 100 * np.mean(np.argmax(np.asarray(logits), -1) == self.y_test, axis=-1)
        finite = jax.vmap(
            lambda p: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(p)]))
        )
        return np.where(np.asarray(finite(params)), accuracy, np.nan)

    def _train(self, tx, read=lambda s: ()):
        """``(params0, index) -> (params, read(state) at each step)``, every seed at once."""
        x, y = jnp.asarray(self.x), jnp.asarray(self.y)

        def worker(p, s, idx):
            g = jax.grad(self.loss)(p, x[idx], y[idx])
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.vmap(worker, axis_name="data")

        def run(params0, index):  # one seed
            p = jax.tree.map(lambda v: jnp.stack([v] * N_WORKERS), params0)
            s = jax.vmap(tx.init)(p)

            def body(c, idx):
                p, s = step(*c, idx)
                return (p, s), read(s)

            (p, _), trace = jax.lax.scan(body, (p, s), index)
            return jax.tree.map(lambda v: v[0], p), trace  # the aggregate is replicated: worker 0's copy

        return jax.jit(jax.vmap(run))


class SpreadState(NamedTuple):
    previous: optax.Updates  # the previous step's mean over the workers
    distance: jax.Array  # float32[]: this worker's distance from it
    norm: jax.Array  # float32[]: the norm of this step's mean


def spread_probe(axis_name: str = "data") -> optax.GradientTransformationExtraArgs:
    """Passes the updates on; records each worker's L2 distance from the previous step's mean, and the mean's norm."""

    def norm(tree):
        return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))

    def init_fn(params):
        zero = jnp.zeros([], jnp.float32)
        return SpreadState(jax.tree.map(jnp.zeros_like, params), zero, zero)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        mean = jax.lax.pmean(updates, axis_name)
        return updates, SpreadState(
            mean, norm(jax.tree.map(jnp.subtract, updates, state.previous)), norm(mean)
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def run_spread(args) -> None:
    """The honest workers' distance from the previous output, in a fault-free run with the mean."""
    digits = Digits(args.steps, args.seeds)
    tx = optax.chain(jd.scale_by_momentum(MOMENTUM), spread_probe(), jd.all_reduce(), jd.sgd(LR))
    read = lambda s: (s[1].distance, s[1].norm)  # noqa: E731
    _, (distance, norm) = digits._train(tx, read=read)(digits.params0, digits.index)
    distance, norm = np.asarray(distance), np.asarray(norm)  # (seeds, steps, workers)
    print(
        f"\nfault-free mean on digits: each worker's momentum, its L2 distance from the previous step's mean "
        f"(centered_clip's center), over {args.seeds} seed(s) and {N_WORKERS} workers; the mean's norm"
    )
    columns = ["steps", "distance: median", "90th percentile", "max", "the mean's norm: median"]
    print(_common.markdown_header(columns, "lrrrr"))
    width = max(1, args.steps // 10)
    for start in range(0, args.steps, width):
        window = distance[:, start : start + width]
        cells = [f"{np.percentile(window, q):.2f}" for q in (50, 90, 100)]
        cells.append(f"{np.median(norm[:, start : start + width]):.2f}")
        print(_common.markdown_row([f"{start}..{start + window.shape[1] - 1}", *cells]))


def _cell(accs: np.ndarray) -> str:
    """``mean (min..max)`` over the seeds; ``NaN params (k/n seeds)`` where some parameter is not finite."""
    broken = int(np.sum(~np.isfinite(accs)))
    if broken:
        return f"NaN params ({broken}/{accs.size} seeds)"
    return f"{np.mean(accs):.1f} ({np.min(accs):.1f}..{np.max(accs):.1f})"


def run_digits(args) -> dict:
    digits = Digits(args.steps, args.seeds)
    modes = MODES if not args.quick else MODES[:1]
    rows = aggregates(args.radius, args.iterations)
    names = selected(rows, args)
    print(
        f"digits MLP, {N_WORKERS} workers x 16 examples, {args.steps} steps, momentum {MOMENTUM} per worker, "
        f"SGD lr {LR}; {args.seeds} seed(s); test accuracy % (mean (min..max) over the seeds)",
        flush=True,
    )
    table: dict[tuple[str, str, int], np.ndarray] = {}
    t0 = time.time()
    for name in names:
        table[(name, "-", 0)] = digits.accuracy(digits_tx(rows[name](), "nan", 0))
        for mode in modes:
            for bad in (1, 2):
                table[(name, mode, bad)] = digits.accuracy(digits_tx(rows[name](), mode, bad))
        print(f"  {name}: no fault {_cell(table[(name, '-', 0)])} ({time.time() - t0:.0f} s)", flush=True)
    columns = ["aggregate", "no fault"] + [f"{m}, {b} bad" for m in modes for b in (1, 2)]
    print()
    print(_common.markdown_header(columns, "l" + "r" * (len(columns) - 1)))
    for name in names:
        cells = [_cell(table[(name, "-", 0)])] + [_cell(table[(name, m, b)]) for m in modes for b in (1, 2)]
        print(_common.markdown_row([name, *cells]))
    _digits_goals(table, names, modes)
    return table


def _score(accs: np.ndarray) -> float:
    """The mean over the seeds; -inf where some seed's parameters are not finite."""
    return float(np.mean(accs)) if np.all(np.isfinite(accs)) else -math.inf


def _digits_goals(table, names, modes) -> None:
    reference = float(np.mean(table[(names[0], "-", 0)]))
    print(f"\nfault-free mean: {reference:.2f}%")
    for name in names[1:]:
        clean = _score(table[(name, "-", 0)])
        print(
            f"goal {name}, no fault, within 0.5 point: {clean - reference:+.2f} {'met' if clean >= reference - 0.5 else 'NOT met'}"
        )
        allowed = 2.0 if name == "coordinate_median" else 1.0
        counts = (1, 2) if name.startswith("trimmed_mean(2)") else (1,)
        worst = min(_score(table[(name, m, b)]) for m in modes for b in counts)
        met = worst >= reference - allowed
        print(
            f"goal {name}, {' and '.join(map(str, counts))} Byzantine in every mode, within {allowed:g} point(s): "
            f"worst {worst - reference:+.2f} {'met' if met else 'NOT met'}"
        )


# ----------------------------------------------------------------------------
# Cost with no fault: bytes and step time on 8 simulated devices.


def run_cost(args, digits_table: dict | None) -> None:
    model = demo.MLP()
    params0 = model.init(jax.random.key(0), jnp.zeros((1, 64)))
    (x, y), _ = demo.load_data(0)
    mesh = _common.data_mesh(N_WORKERS)

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, batch["x"]), batch["y"]).mean()

    steps = 12 if args.quick else args.time_steps
    makers, rows = aggregates(args.radius, args.iterations), []
    for name in selected(makers, args):
        tx = digits_tx(makers[name](), "nan", 0)
        cost = jd.communication_cost(tx, params0, num_workers=N_WORKERS)
        step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
        params, state = step.init(params0)
        times = []
        for t in range(steps):
            batch = demo.batch_at(x, y, 16 * N_WORKERS, t, 0)
            start = time.perf_counter()
            params, state, metrics = step(params, state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        rows.append((name, cost.sent_bytes, float(np.median(times[steps // 4 :]))))
    print(
        f"\ncost with no fault: digits MLP ({sum(v.size for v in jax.tree.leaves(params0)):,} parameters), "
        f"{N_WORKERS} workers, data_parallel_step on 8 simulated CPU devices, median of {steps - steps // 4} steps"
    )
    columns = [
        "aggregate",
        "test acc (no fault)",
        "bytes sent / worker / step",
        "vs mean",
        "step time vs mean",
    ]
    print(_common.markdown_header(columns, "lrrrr"))
    for name, sent, seconds in rows:
        acc = _cell(digits_table[(name, "-", 0)]) if digits_table and (name, "-", 0) in digits_table else "-"
        cells = [acc, _common.fmt_bytes(sent), f"{sent / rows[0][1]:.2f}x", f"{seconds / rows[0][2]:.2f}"]
        print(_common.markdown_row([name, *cells]))
    print(f"(the mean's step: {1e3 * rows[0][2]:.2f} ms)")


# ----------------------------------------------------------------------------
# DiLoCo on the byte-level GPT, 4 replicas under vmap on one device.


def run_gpt(args) -> None:
    import bench_lm

    lm = bench_lm.lm
    replicas, sync_every = 4, args.sync_every
    methods = {  # row label -> (aggregate factory, Byzantine mode or None)
        "mean, no fault": (None, None),
        "trimmed_mean(1), 1 signflip:10": (lambda: jd.trimmed_mean(1), "signflip:10"),
        "mean, 1 signflip:10": (jd.all_reduce, "signflip:10"),
        f"centered_clip({args.gpt_radius:g}), 1 signflip:10": (
            lambda: jd.centered_clip(args.gpt_radius),
            "signflip:10",
        ),
        "trimmed_mean(1), no fault": (lambda: jd.trimmed_mean(1), None),
        f"centered_clip({args.gpt_radius:g}), no fault": (lambda: jd.centered_clip(args.gpt_radius), None),
    }
    methods = {k: methods[k] for k in selected(methods, args)}
    settings = lm.parser().parse_args(
        [
            *("--steps", str(args.gpt_steps), "--dim", str(args.gpt_dim), "--depth", "2", "--heads", "2"),
            *("--context", "64", "--batch", "16", "--replicas", str(replicas), "--one-device"),
            *("--sync-every", str(sync_every), "--eval-every", str(args.gpt_steps), "--eval-windows", "128"),
            *("--warmup", str(max(1, args.gpt_steps // 20))),
        ]
    )
    cfg = lm.config(settings)
    corpus = lm.load_corpus(val_fraction=settings.val_fraction)
    results = {}
    t0 = time.time()
    for label, (make, mode) in methods.items():

        def make_tx(s, make=make, mode=mode):
            aggregate = None if make is None else make()
            if mode is not None:
                aggregate = optax.chain(byzantine(mode, 1), aggregate)
            return jd.diloco(lm.adamw(s), sync_every=s.sync_every, outer=lm.outer(s), aggregate=aggregate)

        key = f"robust: {label}"
        lm.TXS[key] = lm.Method(make_tx, True, label)
        runs = lm.VmapTrainer(key, cfg, settings, label=label).run_seeds(
            corpus, range(args.seeds), progress=False
        )
        results[label] = [r["evals"][-1]["val_bpb"] for r in runs]
        print(f"  {label}: {_spread(results[label])} bits/byte ({time.time() - t0:.0f} s)", flush=True)
    reference = np.mean(results["mean, no fault"])
    print(
        f"\nDiLoCo on the byte-level GPT (dim {cfg.dim}, {cfg.depth} blocks, context {cfg.context}), {replicas} replicas "
        f"under vmap on one CPU device, {args.gpt_steps} steps of 16 windows, H={sync_every}, AdamW {settings.lr} inner, "
        f"Nesterov {settings.outer_lr}/{settings.outer_momentum} outer; replica 3 Byzantine; {args.seeds} seed(s)"
    )
    print(_common.markdown_header(["run", "val bits/byte", "vs fault-free mean"], "lrr"))
    for label, bpb in results.items():
        ratio = np.mean(bpb) / reference
        print(_common.markdown_row([label, _spread(bpb), f"{ratio:.3f}" if math.isfinite(ratio) else "nan"]))


# ----------------------------------------------------------------------------
# Islands: 4 processes of examples/islands.py over torchft, one of them Byzantine.

ISLAND_FAULTS = ("none", "signflip:10", "nan")


def island_run(aggregate: str, fault: str, args) -> dict:
    """One run of 4 islands (island 3 ``--byzantine fault`` unless ``none``): chaos.summarize's summary,
    with island 0's final validation loss and the contributions left out as non-finite."""
    import tempfile

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import islands_chaos as chaos

    work = tempfile.mkdtemp(prefix="bench_robust_islands_")
    island_args = ["--sync-every", "10", "--steps", str(args.islands_steps), "--min-islands", "4"]
    island_args += ["--aggregate", aggregate, "--quorum-timeout", "60", "--round-timeout", "60"]
    cluster = chaos.Cluster(work, island_args=island_args, min_islands=4, join_timeout_ms=2000)
    cluster.start_lighthouse()
    for i in range(4):
        cluster.start(i, ["--byzantine", fault] if i == 3 and fault != "none" else [])
    hung = chaos.run_faults(cluster, [], timeout=args.islands_timeout)
    rows = cluster.rows()
    summary = chaos.summarize(rows, hung)
    summary["val_loss"] = summary["final_val_loss"].get("0", math.nan)
    last = [r["val_loss"] for r in rows if "round" in r and r["island"] == "0"][-5:]
    summary["last5"] = float(np.mean(last)) if last else math.nan
    summary["non_finite"] = sum(
        1 for r in rows if "round" in r for x in r.get("rejected", []) if x["reason"] == "non-finite"
    )
    return summary


def run_islands(args) -> None:
    aggregates = [a.strip() for a in args.islands_aggregates.split(",")]
    print(
        f"\n## Islands: 4 over torchft, digits MLP, H = 10, {args.islands_steps} steps; island 3 Byzantine\n"
    )
    columns = ["aggregate", "island 3 sends", "final val loss", "vs fault-free (same aggregate)"]
    columns += ["vs fault-free mean", "last 5 rounds' mean", "vs fault-free mean"]
    columns += ["hangs", "divergent anchors", "errors", "left out as non-finite"]
    print(_common.markdown_header(columns, "ll" + "r" * 9))
    clean: dict[str, float] = {}
    clean5: dict[str, float] = {}
    for aggregate in aggregates:
        for fault in ISLAND_FAULTS:
            t = time.time()
            s = island_run(aggregate, fault, args)
            loss = s["val_loss"]
            clean.setdefault(aggregate, loss)
            clean5.setdefault(aggregate, s["last5"])
            cells = [aggregate, "its pseudo-gradient" if fault == "none" else fault, f"{loss:.4f}"]
            cells += [_pct(loss, clean[aggregate]), _pct(loss, clean.get("mean", math.nan))]
            cells += [f"{s['last5']:.4f}", _pct(s["last5"], clean5.get("mean", math.nan))]
            cells += [s["hangs"], s["divergent_anchors"]]
            print(
                _common.markdown_row([*cells, len(s["errors"]), s["non_finite"]]),
                f"  ({time.time() - t:.0f} s)",
                flush=True,
            )


def _pct(x: float, ref: float) -> str:
    if not (math.isfinite(x) and math.isfinite(ref)):
        return "n/a" if math.isfinite(x) else "diverged"
    return f"{100 * (x / ref - 1):+.1f}%"


def _spread(values) -> str:
    if not np.all(np.isfinite(values)):
        return "nan"
    return f"{np.mean(values):.4f} ({min(values):.4f}..{max(values):.4f})"


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument(
        "--part",
        default="digits,cost,gpt",
        help="comma-separated subset of digits, cost, gpt, spread, islands",
    )
    ap.add_argument("--steps", type=int, default=300, help="digits: steps")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--time-steps", type=int, default=60, help="cost: steps timed per aggregate")
    ap.add_argument("--gpt-steps", type=int, default=400)
    ap.add_argument("--gpt-dim", type=int, default=64)
    ap.add_argument("--sync-every", type=int, default=25, help="gpt: DiLoCo's H")
    ap.add_argument("--radius", type=float, default=RADIUS, help="digits and cost: centered_clip's radius")
    ap.add_argument(
        "--iterations", type=int, default=1, help="digits and cost: centered_clip's iterations per step"
    )
    ap.add_argument("--gpt-radius", type=float, default=1.0, help="gpt: centered_clip's radius")
    ap.add_argument(
        "--only", default="", help="comma-separated prefixes of the rows to run (the mean's always runs)"
    )
    ap.add_argument("--islands-steps", type=int, default=300, help="islands: inner steps")
    ap.add_argument(
        "--islands-aggregates",
        default="mean,trimmed_mean:1,centered_clip",
        help="islands: examples/islands.py --aggregate values, comma-separated (the mean first)",
    )
    ap.add_argument("--islands-timeout", type=float, default=900, help="islands: seconds a run may take")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.part.split(",")}
    if unknown := parts - {"digits", "cost", "gpt", "spread", "islands"}:
        ap.error(f"--part: unknown {sorted(unknown)}")
    if args.quick:
        args.steps, args.seeds, args.gpt_steps, args.gpt_dim, args.sync_every = 20, 1, 12, 32, 4
    t0 = time.time()
    table = run_digits(args) if "digits" in parts else None
    if "cost" in parts:
        run_cost(args, table)
    if "gpt" in parts:
        run_gpt(args)
    if "spread" in parts:
        run_spread(args)
    if "islands" in parts:
        run_islands(args)
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
