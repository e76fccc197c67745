"""Byte-level GPT on the standard library's source: low-communication methods against dense AdamW.

The model, data and training loop are those of ``examples/lm.py`` (imported
from its path): a GPT-style decoder in Flax NNX with every parameter sharded
over the ``"fsdp"`` axis, trained with :func:`jaxopt_dist.data_parallel_step`
on a 2 x 4 mesh (2 replicas, each sharded over 4 devices; 8 simulated CPU
devices), the batch split over all 8 devices. Every method takes the same
number of inner steps on the same batches (equal tokens), from the same
initialisation, for each seed.

Columns:

* ``val bits/byte``: validation loss (next-byte cross-entropy / ln 2) on a
  fixed set of windows from files never trained on, after the last step,
  mean over the seeds (min..max). DiLoCo is evaluated at its anchor (the
  global model; the last step is a synchronisation).
* ``vs dense``: the method's mean divided by dense AdamW's.
* ``bytes/step`` and ``peak``: bytes a worker sends over the replica axis per
  step, averaged over a repeating period (or over the run's steps when the
  period is longer than ``communication_cost`` simulates), and on the
  busiest step, from :func:`jaxopt_dist.communication_cost` (read off the
  traced update).
* ``less than dense``: dense AdamW's bytes per step divided by the method's.
* ``memory/device``: bytes of parameters + optimizer state on the fullest
  device, read off the device buffers after ``init``.

Goals: DiLoCo H=50 within 3% of dense's validation loss at >= 50x fewer
replica-axis bytes; Streaming DiLoCo (4 fragments, 4-bit) within 3% at
>= 200x fewer; Dion at rank 1/4 within 1% of distributed Muon's loss at
<= half of dense's bytes, Muon ahead of dense AdamW. The hyperparameters are
the example's defaults, fixed before the run; nothing is tuned on the
validation split.

Run: ``python benchmarks/bench_lm.py`` (every row; ``--quick`` for a smoke
run). The six rows of the first table,
``--methods dense,diloco50,diloco100,streaming,powersgd,demo``, took 28 to 53
minutes on a shared 2-core machine, depending on its load (a method's 3
seeds about 5 to 10 minutes); all 22 rows take several hours. A progress bar
per method and seed shows the step and the last loss (``--no-progress``:
none); ``--json PATH`` also writes every run's record (validation curves
every ``--eval-every`` steps, training losses; rewritten after each method,
so a run cut short keeps the methods it finished).

``--one-device`` runs the same training on a single device (one GPU): the 2
replicas under ``jax.vmap(axis_name="data")`` with unsharded parameters and
every seed batched into the same program (``examples/lm.py``'s
``VmapTrainer``, which matches the mesh's numbers to float rounding; its
memory column is one replica's parameters and optimizer state, unsharded).
``--one-device`` is meant for a GPU: with ``JAX_PLATFORMS=cuda`` on a machine
without one, the script stops before building anything, naming the platform
asked for and what JAX found. The few-million-parameter table of RESULTS.md
came from::

    JAX_PLATFORMS=cuda python benchmarks/bench_lm.py --one-device --steps 4000 \
        --dim 256 --depth 6 --context 256 --batch 64 --lr 2e-3 --eval-every 500 \
        --eval-windows 256 --methods dense,diloco50,streaming,diloco100,streaming40
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import numpy as np


def import_lm():
    """examples/lm.py as the module ``lm`` (its model, data and trainer)."""
    if "lm" in sys.modules:
        return sys.modules["lm"]
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm.py"
    spec = importlib.util.spec_from_file_location("lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lm"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


lm = import_lm()

# key -> (row label, the example's --tx, settings that differ from the example's defaults)
METHODS = {
    "dense": ("dense AdamW", "dense", {}),
    "diloco50": ("DiLoCo H=50", "diloco", {"sync_every": 50}),
    "diloco100": ("DiLoCo H=100", "diloco", {"sync_every": 100}),
    "streaming": ("Streaming DiLoCo F=4 H=100, 4-bit", "streaming_diloco", {"sync_every": 100}),
    "streaming40": ("Streaming DiLoCo F=4 H=40, 4-bit", "streaming_diloco", {"sync_every": 40}),
    "powersgd": ("PowerSGD rank 4", "powersgd", {"rank": 4}),
    "demo": ("DeMo (64x64 DCT tiles, top 32)", "demo", {}),
    # Frontier II (the example's settings; see examples/lm.py's TXS).
    "sparseloco50": ("SparseLoCo H=50, 64/4096, 2-bit", "sparseloco", {"sync_every": 50}),
    "diloco25": ("DiLoCo H=25", "diloco", {"sync_every": 25}),
    "sparseloco25": ("SparseLoCo H=25, 64/4096, 2-bit", "sparseloco", {"sync_every": 25}),
    "diloco10": ("DiLoCo H=10", "diloco", {"sync_every": 10}),
    "sparseloco10": ("SparseLoCo H=10, 64/4096, 2-bit", "sparseloco", {"sync_every": 10}),
    "muloco50": ("MuLoCo H=50, 2-bit", "muloco", {"sync_every": 50}),
    "noloco50": ("NoLoCo H=50, pairs", "noloco", {"sync_every": 50}),
    "zero_one_adam": ("0/1 Adam", "zero_one_adam", {}),
    "desloc": ("DES-LOC Adam 16/48/96", "desloc", {}),
    # Frontier III: orthonormal updates (Muon-family lr 0.02 on the blocks' matrices, AdamW elsewhere).
    "muon_optax": ("optax.contrib.muon (mean gradient)", "muon_optax", {}),
    "muon": ("Muon, distributed", "muon", {}),
    "dion1": ("Dion rank 1", "dion", {"rank_fraction": 1.0}),
    "dion4": ("Dion rank 1/4", "dion", {"rank_fraction": 0.25}),
    "dion16": ("Dion rank 1/16", "dion", {"rank_fraction": 1 / 16}),
    "dion2": ("Dion2 fraction 1/4", "dion2", {"dion2_fraction": 0.25}),
}
QUICK_H = {10: 2, 25: 2, 40: 4, 50: 4, 100: 8}  # --quick: the same methods with short periods


def settings_for(base: argparse.Namespace, overrides: dict, quick: bool) -> argparse.Namespace:
    if quick and "sync_every" in overrides:
        overrides = {**overrides, "sync_every": QUICK_H[overrides["sync_every"]]}
    return argparse.Namespace(**{**vars(base), **overrides})


def _spread(values: list[float]) -> str:
    return f"{np.mean(values):.4f} ({min(values):.4f}..{max(values):.4f})"


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    ap.add_argument(
        "--muon-lr",
        type=float,
        default=0.02,
        help="the Muon, Dion and Dion2 rows' peak learning rate (matrices)",
    )
    ap.add_argument("--batch", type=int, default=16, help="windows per step over all 8 devices")
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=100, help="steps between validation evaluations")
    ap.add_argument("--json", default=None, help="also write every run's record (curves included) here")
    ap.add_argument(
        "--one-device",
        action="store_true",
        help="the 2 replicas under jax.vmap on one device (a GPU), every seed in the same program",
    )
    ap.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}"
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in names if m not in METHODS]:
        ap.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    lm.require_platform()  # JAX_PLATFORMS=cuda without a GPU: a clear error, before anything is built
    if args.quick:
        args.steps, args.seeds, args.dim, args.depth, args.context, args.batch = 16, 1, 32, 2, 32, 8
        args.eval_windows, args.eval_every = 16, 8
    base = lm.parser().parse_args(
        [
            *("--steps", str(args.steps), "--dim", str(args.dim), "--depth", str(args.depth)),
            *("--context", str(args.context), "--batch", str(args.batch)),
            *("--heads", str(args.heads), "--lr", str(args.lr), "--muon-lr", str(args.muon_lr)),
            *(["--one-device"] if args.one_device else []),
            *("--eval-every", str(args.eval_every), "--eval-windows", str(args.eval_windows)),
            *("--warmup", str(max(1, args.steps // 20))),
        ]
    )
    cfg = lm.config(base)
    corpus = lm.load_corpus(val_fraction=base.val_fraction)
    t0 = time.time()
    rows = {}
    for name in names:
        _, tx_name, overrides = METHODS[name]
        trainer = (lm.VmapTrainer if args.one_device else lm.Trainer)(
            tx_name, cfg, settings_for(base, overrides, args.quick), label=name
        )
        runs = trainer.run_seeds(corpus, range(args.seeds), progress=not args.no_progress)
        rows[name] = runs
        bpb = [r["evals"][-1]["val_bpb"] for r in runs]
        # --one-device: one program steps every seed at once (its first, compiling step untimed)
        step_ms = 1e3 * np.mean([r["seconds"] / max(1, r.get("timed_steps", args.steps)) for r in runs])
        print(
            f"  {METHODS[name][0]}: {_spread(bpb)} bits/byte ({time.time() - t0:.0f} s; {step_ms:.1f} ms/step)",
            flush=True,
        )
        if args.json:  # after every method, so that a run cut short keeps what it finished
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    first = next(iter(rows.values()))[0]
    print(
        f"\nbyte-level GPT, {first['params']:,} parameters (dim {cfg.dim}, {cfg.depth} blocks, {cfg.heads} heads, "
        f"context {cfg.context}, tied embeddings, learned positions); {lm.layout(base)}"
        f"{'' if args.one_device else ' (8 CPU devices)'}; "
        f"{args.steps} steps of {args.batch} windows ({args.steps * args.batch * cfg.context:,} "
        f"training bytes); AdamW peak lr {base.lr}, warm-up {base.warmup}, cosine to lr/10; "
        f"{len(corpus.train_files)} training / {len(corpus.val_files)} validation files, "
        f"{args.eval_windows} validation windows; {args.seeds} seed(s); {time.time() - t0:.0f} s in all"
    )
    if args.quick:
        print(
            "(--quick: the rows' periods are shortened: "
            + ", ".join(f"H={h} -> {q}" for h, q in QUICK_H.items())
            + ")"
        )
    print()
    columns = [
        "method",
        "val bits/byte",
        "vs dense",
        "bytes/step",
        "peak",
        "less than dense",
        "memory/replica (unsharded)" if args.one_device else "memory/device",
    ]
    print(_common.markdown_header(columns, "lrrrrrr"))
    dense = rows.get("dense")
    dense_bpb = np.mean([r["evals"][-1]["val_bpb"] for r in dense]) if dense else math.nan
    summary = {}
    for name, runs in rows.items():
        r = runs[0]
        bpb = [x["evals"][-1]["val_bpb"] for x in runs]
        ratio = np.mean(bpb) / dense_bpb
        less = r["dense_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else math.inf
        summary[name] = (ratio, less)
        cells = [
            _spread(bpb),
            f"{ratio:.3f}" if dense else "- (no dense row)",
            _common.fmt_bytes(r["bytes_per_step"]),
            _common.fmt_bytes(r["peak_bytes_per_step"]),
            f"{less:.4g}x",
            _common.fmt_bytes(lm.memory_bytes(r)),
        ]
        print(_common.markdown_row([METHODS[name][0], *cells]))
    print()
    for name, need_less in {"diloco50": 50, "streaming": 200, "streaming40": 200}.items():
        if name in summary and dense:
            ratio, less = summary[name]
            met = ratio <= 1.03 and less >= need_less
            print(
                f"goal {METHODS[name][0]}: within 3% of dense ({100 * (ratio - 1):+.1f}%) at >= {need_less}x fewer bytes "
                f"({less:.4g}x): {'met' if met else 'NOT met'}"
            )
    if "dion4" in summary and "muon" in summary and dense:  # Frontier III
        (d_ratio, d_less), m_ratio = summary["dion4"], summary["muon"][0]
        met = d_ratio <= 1.01 * m_ratio and d_less >= 2
        print(
            f"goal {METHODS['dion4'][0]}: within 1% of Muon's loss ({100 * (d_ratio / m_ratio - 1):+.2f}%) at <= half "
            f"of dense's bytes ({d_less:.4g}x less): {'met' if met else 'NOT met'}"
        )
    for name in ("muon", "muon_optax"):
        if name in summary and dense:
            ratio = summary[name][0]
            print(
                f"goal {METHODS[name][0]} ahead of dense AdamW ({100 * (ratio - 1):+.2f}%): "
                f"{'met' if ratio < 1 else 'NOT met'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
