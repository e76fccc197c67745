"""End to end on a real link: wall-clock time to a test accuracy, 2 processes over gloo.

Two processes (``jax.distributed`` on a loopback coordinator, gloo CPU
collectives, one CPU device each) train a 64-H-H-10 tanh MLP on digits with
``jd.data_parallel_step`` until the test accuracy reaches ``--e2e-target``,
one row (optimizer) after another, over a loopback shaped to 100 Mbit/s
(:data:`E2E_RATE`). The clock runs only around the training steps (the first
step, which compiles, runs unshaped and is not counted; the test accuracy is
read every ``--e2e-eval-every`` steps with the clock stopped).

Two sets of rows (``--e2e-set``):

* ``default``: dense, PowerSGD, top-k and the bf16 wire, each chained with
  ``sgd(0.05, momentum=0.9)`` (:func:`e2e_methods`; target 90%);
* ``lowcomm``: dense data-parallel AdamW, DiLoCo and Streaming DiLoCo
  (:func:`e2e_lowcomm_methods`; target 97%). The per-worker DiLoCo rows are
  evaluated on the anchor (the global parameters).

The link, the workers' launch, ``--malloc`` and ``--pin`` are those of
``shaped_link.py`` (the harness this script shares with ``bench_network.py``;
its docstring describes them). These runs were ``bench_network.py --e2e``
before: the ``--e2e-*`` options are the same, and ``--e2e`` itself is gone
(this script runs nothing else).

Run::

    python benchmarks/bench_network_e2e.py
    python benchmarks/bench_network_e2e.py --e2e-set lowcomm
    python benchmarks/bench_network_e2e.py --from-json saved.json   # reprint a --json run

On one's own cluster (no shaping), once per host, with the first host's
address (``--coordinator 10.0.0.1:12355 --num-processes 2 --process-id 0``
on host 0, which prints the table; ``--process-id 1`` on host 1).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import shaped_link

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = pathlib.Path(__file__).resolve()

E2E_RATE = "100mbit"
E2E_PROCS = 2


def e2e_methods(jd: Any, jnp: Any) -> dict[str, tuple[str, Callable[[], Any]]]:
    """The end-to-end rows: name -> (label, factory), chained with sgd(0.05, momentum=0.9)."""
    return {
        "dense": ("all_reduce()", lambda: jd.all_reduce()),
        "powersgd_r2": ("powersgd(rank=2)", lambda: jd.powersgd(rank=2)),
        "top_k": ("top_k(density=0.01) + EF", lambda: jd.top_k(density=0.01)),
        "bf16": ("all_reduce(dtype=bfloat16)", lambda: jd.all_reduce(dtype=jnp.bfloat16)),
    }


E2E_LR, E2E_WD = 1e-3, 1e-4
"""AdamW of the ``lowcomm`` set: constant learning rate, weight decay (dense and DiLoCo's inner)."""


def e2e_lowcomm_methods(jd: Any, optax: Any) -> dict[str, tuple[str, Callable[[], Any], bool]]:
    """The ``--e2e-set lowcomm`` rows: name -> (label, factory of the whole optimizer, per-worker params).

    Dense data-parallel AdamW (the baseline) and the DiLoCo family with the
    same AdamW as inner optimizer and the default outer optimizer (Nesterov
    SGD, 0.7, momentum 0.9). The per-worker rows are evaluated on the anchor
    (the global parameters), which changes only when a fragment lands.
    """

    def adamw() -> Any:
        return optax.adamw(E2E_LR, weight_decay=E2E_WD)

    return {
        "dense": ("all_reduce() + AdamW", lambda: optax.chain(jd.all_reduce(), adamw()), False),
        "diloco": ("diloco(AdamW, sync_every=50)", lambda: jd.diloco(adamw(), sync_every=50), True),
        "streaming": (
            "diloco(AdamW, sync_every=60, num_fragments=4, aggregate=low_bit())",
            lambda: jd.diloco(adamw(), sync_every=60, num_fragments=4, aggregate=jd.low_bit()),
            True,
        ),
        "streaming_tau5": (
            "the same, sync_delay=5, mixing=0.5",
            lambda: jd.diloco(
                adamw(), sync_every=60, num_fragments=4, aggregate=jd.low_bit(), sync_delay=5, mixing=0.5
            ),
            True,
        ),
    }


def e2e_rows(
    args: argparse.Namespace, jd: Any, jnp: Any, optax: Any
) -> dict[str, tuple[str, Callable[[], Any], bool]]:
    """The rows of ``--e2e-set``: name -> (label, factory of the whole optimizer, per-worker params)."""
    if args.e2e_set == "lowcomm":
        return e2e_lowcomm_methods(jd, optax)
    return {
        name: (label, lambda make=make: optax.chain(make(), jd.sgd(0.05, momentum=0.9)), False)
        for name, (label, make) in e2e_methods(jd, jnp).items()
    }


# ----------------------------------------------------------------------------
# Worker: one process of the job (also the --coordinator mode on a cluster).


class Digits(NamedTuple):
    """The task: the MLP's initial parameters, its loss, its test accuracy and the training batches."""

    params: dict[str, Any]
    loss: Callable[[Any, dict[str, Any]], Any]
    accuracy: Callable[[Any], float]
    batch: Callable[[int], dict[str, Any]]


def digits_mlp(jax: Any, jnp: Any, np: Any, optax: Any, hidden: int, batch: int) -> Digits:
    """The 64-``hidden``-``hidden``-10 tanh MLP on digits; batch ``t`` is the same in every process."""
    sys.path.insert(0, str(HERE))
    import _common  # after shaped_link.configure_jax: keeps this process's one device

    x_train, y_train, x_test, y_test = _common.load_digits(0)
    h = hidden
    rng = np.random.default_rng(0)
    params0 = {
        "w1": (rng.standard_normal((64, h)) / 8.0).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32),
        "b2": np.zeros(h, np.float32),
        "w3": (rng.standard_normal((h, 10)) / np.sqrt(h)).astype(np.float32),
        "b3": np.zeros(10, np.float32),
    }

    def logits(p, x):
        z = jnp.tanh(x @ p["w1"] + p["b1"])
        z = jnp.tanh(z @ p["w2"] + p["b2"])
        return z @ p["w3"] + p["b3"]

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, batch["x"]), batch["y"]).mean()

    accuracy = jax.jit(lambda p, x, y: jnp.mean(jnp.argmax(logits(p, x), -1) == y))

    def batch_at(t: int) -> dict[str, np.ndarray]:
        idx = np.random.default_rng([1, t]).integers(0, len(x_train), size=batch)
        return {"x": x_train[idx], "y": y_train[idx]}

    def test_accuracy(model: Any) -> float:
        p_host = {k: np.asarray(v) for k, v in model.items()}
        return float(accuracy(p_host, x_test, y_test))

    return Digits(params0, loss_fn, test_accuracy, batch_at)


def train_to_target(
    args: argparse.Namespace, jax: Any, jd: Any, task: Digits, tx: Any, per_worker: bool, mesh: Any, rate: str
) -> dict[str, Any]:
    """Trains one row until the test accuracy reaches ``--e2e-target`` (or ``--e2e-max-steps``)."""
    shaping = args.shape and jax.process_index() == 0
    step = jd.data_parallel_step(task.loss, tx, mesh=mesh, per_worker_params=per_worker)
    if shaping:
        shaped_link.set_rate("unshaped")
    params, state = step.init(task.params)
    jax.block_until_ready(step(params, state, task.batch(0)))  # compile; result dropped
    if shaping:
        shaped_link.set_rate(rate)
    jax.block_until_ready(step(params, state, task.batch(0))[2])  # both processes pass here
    clock, t, acc, times = 0.0, 0, 0.0, []
    while t < args.e2e_max_steps:
        t0 = time.perf_counter()
        params, state, metrics = step(params, state, task.batch(t))
        jax.block_until_ready(metrics)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
        clock += times[-1]
        t += 1
        if t % args.e2e_eval_every == 0:
            acc = task.accuracy(state.anchor if per_worker else params)  # per-worker rows: the global params
            if acc >= args.e2e_target:
                break
    cost = jd.communication_cost(tx, task.params, num_workers=mesh.shape["data"])
    return {
        "steps": t,
        "reached": acc >= args.e2e_target,
        "accuracy": acc,
        "seconds": clock,
        "s_per_step": clock / max(t, 1),
        "sent_bytes": cost.sent_bytes,
        "peak_sent_bytes": cost.peak_sent_bytes,
        "per_worker_params": per_worker,
        "times_s": times,
    }


def run_e2e_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the digits MLP until the test accuracy reaches the target, per row (:func:`train_to_target`)."""
    shaped_link.configure_jax(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    distributed = shaped_link.start_distributed(jax, args)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    task = digits_mlp(jax, jnp, np, optax, args.e2e_hidden, args.e2e_batch)
    rate = E2E_RATE if args.shape else "unshaped"
    results: dict[str, Any] = {}
    for name, (label, make, per_worker) in e2e_rows(args, jd, jnp, optax).items():
        if args.e2e_methods and name not in args.e2e_methods:
            continue
        trained = train_to_target(args, jax, jd, task, make(), per_worker, mesh, rate)
        results[name] = {"label": label, **trained}
    if args.shape and jax.process_index() == 0:
        shaped_link.set_rate("unshaped")
    if distributed:
        jax.distributed.shutdown()
    return {
        "procs": mesh.shape["data"],
        "rate": rate,
        "params": int(sum(v.size for v in task.params.values())),
        "hidden": args.e2e_hidden,
        "target": args.e2e_target,
        "set": args.e2e_set,
        "batch": args.e2e_batch,
        "eval_every": args.e2e_eval_every,
        "malloc": shaped_link.mapped_malloc(),
        "methods": results,
    }


# ----------------------------------------------------------------------------
# Tables.


def print_e2e(res: dict[str, Any], note: str) -> None:
    if res.get("set") == "lowcomm":
        print_e2e_lowcomm(res, note)
        return
    print(
        f"\ndigits, tanh MLP 64-{res.get('hidden', 'H')}-{res.get('hidden', 'H')}-10 ({res['params']:,} parameters), {res['procs']} processes, "
        f"link {res['rate']}; {note}\n"
        f"time to test accuracy >= {res['target']:.0%} (training steps only):\n"
    )
    dense = res["methods"].get("dense", {}).get("seconds")
    print(
        "| method | steps | accuracy | wall s | x dense | s/step | B/worker/step |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, r in res["methods"].items():
        ok = "" if r["reached"] else " (not reached)"
        speed = f"{dense / r['seconds']:.2f}" if dense and r["reached"] else "-"
        print(
            f"| {name}: {r['label']} | {r['steps']} | {r['accuracy']:.3f}{ok} | {r['seconds']:.2f} | {speed} | "
            f"{r['s_per_step']:.4f} | {shaped_link.fmt_bytes(r['sent_bytes'])} |"
        )


def print_e2e_lowcomm(res: dict[str, Any], note: str) -> None:
    """The ``--e2e-set lowcomm`` table: also the step-time spread and the peak bytes of a step."""
    h = res["hidden"]
    print(
        f"\ndigits, tanh MLP 64-{h}-{h}-10 ({res['params']:,} parameters), {res['procs']} processes, "
        f"global batch {res['batch']}, link {res['rate']}; {note}\n"
        f"time to test accuracy >= {res['target']:.0%} (training steps only; the test accuracy is read every "
        f"{res['eval_every']} steps with the clock stopped, of the anchor (global parameters) for the "
        "per-worker DiLoCo rows):\n"
    )
    dense = res["methods"].get("dense", {})
    cols = "| method | steps | accuracy | wall s | x dense | s/step | median step s | slowest step s |"
    print(cols + " B/worker/step | peak B/step |\n|---|" + "---:|" * 9)
    for name, r in res["methods"].items():
        ok = "" if r["reached"] else " (not reached)"
        reached = dense.get("reached") and r["reached"]
        speed = f"{dense['seconds'] / r['seconds']:.1f}" if reached else "-"
        times = r["times_s"] or [0.0]
        print(
            f"| {name}: {r['label']} | {r['steps']} | {r['accuracy']:.3f}{ok} | {r['seconds']:.2f} | {speed} | "
            f"{r['s_per_step']:.4f} | {statistics.median(times):.4f} | {max(times):.3f} | "
            f"{shaped_link.fmt_bytes(r['sent_bytes'])} | {shaped_link.fmt_bytes(r['peak_sent_bytes'])} |"
        )


# ----------------------------------------------------------------------------
# Command line and launcher.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--e2e-target", type=float, default=None, help="test accuracy to reach (0.9, lowcomm set 0.97)"
    )
    p.add_argument("--e2e-hidden", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--e2e-batch", type=int, default=128, help="global batch")
    p.add_argument("--e2e-max-steps", type=int, default=600)
    p.add_argument("--e2e-eval-every", type=int, default=10)
    p.add_argument(
        "--e2e-set",
        choices=("default", "lowcomm"),
        default="default",
        help="rows: default (dense, PowerSGD, top-k, bf16 with SGD) or lowcomm (dense AdamW, DiLoCo)",
    )
    p.add_argument("--e2e-methods", default="", help="comma-separated rows of the --e2e-set (default: all)")
    shaped_link.add_link_options(p)
    p.add_argument("--e2e-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.e2e_methods = [m for m in args.e2e_methods.split(",") if m]
    if args.e2e_target is None:
        args.e2e_target = 0.97 if args.e2e_set == "lowcomm" else 0.9
    shaped_link.check_link_options(p, args, worker=args.e2e_worker)
    return args


def worker_argv(args: argparse.Namespace, pid: int, coord: str | None, out: str) -> list[str]:
    """The command line of worker ``pid`` of the :data:`E2E_PROCS`."""
    extra = ["--e2e-target", str(args.e2e_target), "--e2e-hidden", str(args.e2e_hidden)]
    extra += ["--e2e-batch", str(args.e2e_batch), "--e2e-max-steps", str(args.e2e_max_steps)]
    extra += ["--e2e-eval-every", str(args.e2e_eval_every), "--e2e-set", args.e2e_set]
    extra += ["--e2e-methods", ",".join(args.e2e_methods)]
    return shaped_link.worker_argv(SCRIPT, args, "e2e", E2E_PROCS, pid, coord, out, extra)


def _row_names(args: argparse.Namespace) -> list[str]:
    any_module = shaped_link.AnyModule()
    return list(e2e_rows(args, any_module, any_module, any_module))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    known = _row_names(args)
    unknown = [m for m in args.e2e_methods if m not in known]
    if unknown:
        raise SystemExit(f"--e2e-methods: unknown {unknown}; known in --e2e-set {args.e2e_set}: {known}")
    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        if "e2e" not in saved:
            raise SystemExit(f"{args.from_json}: not an end-to-end run (print it with bench_network.py)")
        print_e2e(saved["e2e"], saved.get("note", ""))
        return 0
    if args.e2e_worker:
        return shaped_link.run_worker(args, run_e2e_worker)
    if args.coordinator is not None:  # cluster mode: this process is one of the job
        return shaped_link.run_cluster(args, run_e2e_worker, "e2e", print_e2e)
    return shaped_link.launch_and_show(
        args, "e2e", E2E_PROCS, functools.partial(worker_argv, args), print_e2e
    )


if __name__ == "__main__":
    sys.exit(main())
