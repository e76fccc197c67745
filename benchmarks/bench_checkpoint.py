"""What asynchronous orbax checkpoints cost a training step: every N steps against never.

The model, data and optimizer are those of ``examples/resilient.py`` (the
digits MLP; top-k with error feedback by default, so the checkpoint holds
the per-worker residuals too) on ``--devices`` simulated CPU workers in one
process. One step object (compiled once) runs the same steps with no
checkpoint and with an asynchronous ``ocp.CheckpointManager.save`` every
N = 1, 10, 100 steps; the configurations are interleaved over ``--rounds``
rounds and each keeps its fastest round, so a busy machine slows all alike.
Every step waits for its loss, as the driver does.

Columns: milliseconds per step over the loop; the ratio to no checkpoint in
the same run; the time ``save`` blocks the loop (it copies the arrays off
the devices and, when the previous write is still going, waits for it);
the final ``wait_until_finished``. A progress bar on stderr moves after each
timed loop (the configuration, the round, the last loss).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", default="1,10,100", help="checkpoint intervals, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tx", default="top_k", choices=("top_k", "diloco", "powersgd"))
    p.add_argument("--quick", action="store_true", help="30 steps, one round")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 30, 1
    return args


def driver():
    """``examples/resilient.py`` as a module (the model, data and optimizers)."""
    spec = importlib.util.spec_from_file_location("resilient", ROOT / "examples" / "resilient.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(step, state, data, every: int, steps: int, directory: str | None) -> dict[str, float]:
    """Times ``steps`` steps from ``state``, saving every ``every`` steps (0: never)."""
    import orbax.checkpoint as ocp

    params, opt_state = state
    mngr = ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler()) if every else None
    blocked = 0.0
    start = time.perf_counter()
    for t in range(steps):
        params, opt_state, metrics = step(params, opt_state, data(t))
        loss = float(metrics["loss"])
        if mngr is not None and (t + 1) % every == 0:
            t0 = time.perf_counter()
            mngr.save(t + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            blocked += time.perf_counter() - t0
    loop = time.perf_counter() - start
    t0 = time.perf_counter()
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    final = 1e3 * (time.perf_counter() - t0)
    return {"ms": 1e3 * loop / steps, "blocked": 1e3 * blocked, "final": final, "loss": loss}


def main(argv=None) -> int:
    args = parse_args(argv)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={args.devices}"])
    import jax

    import jaxopt_dist as jd

    ex = driver()
    opts = ex.parse_args(
        ["--tx", args.tx, "--hidden", str(args.hidden), "--batch-size", str(8 * args.devices)]
    )
    x_all, y_all = ex.digits(0)
    p0 = ex.init_params(0, x_all.shape[1], args.hidden, 10)
    tx, per_worker = ex.make_tx(opts)
    mesh = jax.make_mesh((args.devices,), ("data",))
    step = jd.data_parallel_step(ex.loss_fn, tx, mesh=mesh, per_worker_params=per_worker)
    state = step.init(p0)
    data = lambda t: ex.batch(x_all, y_all, opts, t)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:  # compiles, and starts orbax's threads
        run(step, state, data, 5, 20, os.path.join(tmp, "ckpt"))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    configs = [0] + [int(n) for n in args.every.split(",")]
    best: dict[int, dict[str, float]] = {}
    from tqdm import tqdm

    # The bar moves after each timed loop (never inside one): the configuration, round and last loss.
    bar = tqdm(total=args.rounds * len(configs) * args.steps, unit="step", disable=args.no_progress)
    for r in range(args.rounds):
        for every in configs:
            what = f"{args.tx}, checkpoint {'every ' + str(every) if every else 'never'}, round {r + 1}"
            bar.set_postfix_str(what)
            with tempfile.TemporaryDirectory() as tmp:
                got = run(step, state, data, every, args.steps, os.path.join(tmp, "ckpt") if every else None)
            if every not in best or got["ms"] < best[every]["ms"]:
                best[every] = got
            bar.set_postfix_str(f"{what}, loss {got['loss']:.4f}", refresh=False)
            bar.update(args.steps)
    bar.close()
    base = best[0]["ms"]
    print(
        f"{args.tx}, {args.devices} workers, {nbytes / 1e6:.2f} MB of params + state per checkpoint, "
        f"{args.steps} steps, best of {args.rounds} rounds, JAX {jax.__version__}\n"
    )
    print("| checkpoint | ms / step | vs none | saves | save() blocks, ms / save | final wait, ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for every in configs:
        b = best[every]
        saves = args.steps // every if every else 0
        label = f"every {every} steps" if every else "none"
        per_save = f"{b['blocked'] / saves:.1f}" if saves else "-"
        print(
            f"| {label} | {b['ms']:.2f} | {b['ms'] / base:.2f}x | {saves} | {per_save} | {b['final']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
