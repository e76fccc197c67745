"""The byte-level GPT end to end over a shaped link: 2 processes over gloo, the DiLoCo family against dense.

Two processes (``jax.distributed`` on a loopback coordinator, gloo CPU
collectives), one replica each, train the GPT of ``examples/lm.py`` (its
model, loss, corpus, windows, AdamW and outer optimizer, imported from its
path) on the standard library's source, one row (optimizer) after another:

* ``dense``: ``chain(all_reduce(), AdamW)``, parameters replicated;
* ``diloco``: ``diloco(AdamW, sync_every=H)`` (Nesterov outer step);
* ``streaming``: ``diloco(AdamW, sync_every=H, num_fragments=F,
  sync_delay=tau, mixing=alpha)``, run by the plain step (the exchange is
  inside the step that takes the pseudo-gradient);
* ``streaming_overlap``: the same transform with ``overlap=True``, run by
  :func:`jaxopt_dist.overlapped_step` with a communication mesh;
* ``eager``: ``diloco(AdamW, sync_every=H, num_fragments=F_e, eager=True,
  overlap=True)`` (``F_e`` = 1 by default: the whole model's exchange has a
  whole period to cross), run by ``overlapped_step``;
* ``sparseloco``: ``sparseloco(AdamW, sync_every=H)``.

Every row starts from the same initialisation, sees the same batches (step
``t``'s global batch is drawn from a generator seeded with ``t``; each
process takes its half) and takes the same number of inner steps.

Devices: each process has 2 CPU devices
(``--xla_force_host_platform_device_count=2``): device 0 of each process
forms the compute mesh ``("data",)`` of 2 devices (one replica per process,
no model axis); device 1 of each forms the communication mesh of the
overlapped rows, whose exchanges run there while device 0 computes the next
inner steps. Each process is pinned to a core of its own (``--pin``).

Each row is trained once per rate, from the same initialisation, the
compiled programs kept between rates. First on the bare loopback (the
no-link baseline of the compute utilization), stopping every
``--eval-every`` steps for the validation loss (of the global parameters:
the anchor for the per-worker rows, the mean of the per-worker anchors for
``eager``), with the clock stopped after every output is waited for on it
(an exchange still in flight too). Then at each shaped rate (``--rates``)
all its steps as one timed stretch, so that an exchange in flight keeps
overlapping the next inner steps as in training (the clock waits for the
last one at the end); its validation losses are the bare run's at the same
steps (the numbers do not depend on the link: the final loss is measured at
every rate and must be equal), at the clock the rate's run had reached
there. The clock runs only around the inner steps (a warm-up of ``H`` steps
compiles every program first and is not counted); each run starts with
both processes joined and the token bucket emptied. The steps are built
with ``reduce_metrics=False``: no per-step all-reduce of the loss, so an
inner step of the DiLoCo family sends nothing and nothing queues on the
link behind an exchange.

Columns (one table per rate): seconds per inner step (median, mean);
compute utilization (the row's bare-loopback wall time over its linked wall
time, the same steps); bytes a worker sends over the run, from
:func:`jaxopt_dist.communication_cost` and (shaped runs) the bytes the
namespace's loopback transmitted during the timed steps
(``/proc/self/net/dev``; both workers' traffic, halved, with headers and
the coordinator's); final validation bits per
byte and its ratio to dense's; wall time (and step) to the target
validation loss (``--target``; by default dense's final loss on the bare
loopback times ``1 + --target-slack``) and dense's wall time to it over the
row's; and, at equal quality, dense's wall time to the row's own final loss
over the row's.

The bytes from ``communication_cost`` count the exchanges applied within
the run: ``eager``'s exchanges of the last period, sent but applied after
it, are in the loopback's count only.

The token bucket of the shaped loopback holds ``--burst-ms`` milliseconds
of traffic at the rate (10 ms: 125 kB at 100 Mbit/s; ``--burst-ms 0`` for the
harness's 2 MiB, which would let a Streaming fragment of about 1 MB per
worker cross at loopback speed after an idle spell); the table's note lists
the rows whose busiest step still fits in it.

The ``projected s/step`` column is :func:`jaxopt_dist.project_step_time`'s
``wall_seconds``: the bytes of the row's ``overlap=False`` twin, the nominal
rate shared by the two processes (each gets half: one shaped loopback), no
latency, the row's bare-loopback mean step as ``compute_seconds``, and its
overlap window (``tau``, ``H`` for eager, else 0).

Goals reported against: Streaming DiLoCo with overlap at >= 0.9 compute
utilization at 100 Mbit/s; every DiLoCo-family row >= 10x less wall time to
the target than dense at 100 Mbit/s, with a final loss within 3% of dense's.

The link, the workers' launch, ``--malloc`` and ``--pin`` are those of
``shaped_link.py``. Run::

    python benchmarks/bench_network_lm.py                      # the full table (about 15 to 25 minutes)
    python benchmarks/bench_network_lm.py --quick --no-shape   # a smoke run
    python benchmarks/bench_network_lm.py --from-json saved.json --target 2.9   # reprint a --json run

On one's own cluster (no shaping), once per host: ``--coordinator
HOST:PORT --num-processes 2 --process-id I``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import shaped_link

SCRIPT = pathlib.Path(__file__).resolve()
PROCS = 2
NET_DEV = pathlib.Path("/proc/self/net/dev")  # this network namespace's (sysfs shows the host's)
DILOCO_FAMILY = ("diloco", "streaming", "streaming_overlap", "eager", "sparseloco")

# name -> (type, full-run default, --quick value, help)
CONFIG: dict[str, tuple[type, Any, Any, str]] = {
    "steps": (int, 480, 16, "inner steps per run"),
    "batch": (int, 4, 2, "windows per worker per step"),
    "context": (int, 64, 16, "bytes of context"),
    "dim": (int, 128, 32, "model width"),
    "depth": (int, 4, 1, "transformer blocks"),
    "heads": (int, 4, 2, "attention heads"),
    "lr": (float, 3e-3, 3e-3, "AdamW's peak learning rate (linear warm-up, cosine decay)"),
    "warmup": (int, 30, 2, "warm-up steps of the learning rate"),
    "weight_decay": (float, 0.1, 0.1, "AdamW's weight decay"),
    "sync_every": (int, 60, 8, "H of every DiLoCo-family row"),
    "fragments": (int, 4, 4, "F of the streaming rows"),
    "sync_delay": (int, 5, 1, "tau of the streaming rows (< H / F)"),
    "mixing": (float, 0.5, 0.5, "alpha of the streaming rows"),
    "eager_fragments": (int, 1, 1, "F of the eager row"),
    "outer_lr": (float, 0.7, 0.7, "the outer Nesterov learning rate"),
    "outer_momentum": (float, 0.9, 0.9, "the outer Nesterov momentum"),
    "eval_every": (
        int,
        30,
        4,
        "steps between validation losses (a multiple of H / F keeps no exchange in flight)",
    ),
    "eval_windows": (int, 64, 8, "validation windows"),
    "seed": (int, 0, 0, "initialisation"),
}


def import_lm() -> Any:
    """examples/lm.py as the module ``lm`` (after :func:`shaped_link.configure_jax`: it imports JAX)."""
    if "lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lm", SCRIPT.parents[1] / "examples" / "lm.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lm"] = module  # its dataclasses look the module up
        spec.loader.exec_module(module)
    return sys.modules["lm"]


class Row:
    """One row: its label, ``make()`` (the optimizer), per-worker parameters, run by ``overlapped_step``."""

    def __init__(
        self,
        label: str,
        make: Callable[[], Any],
        per_worker: bool,
        overlapped: bool = False,
        priced: Callable[[], Any] | None = None,
        window: int = 0,
    ):
        self.label, self.make, self.per_worker, self.overlapped = label, make, per_worker, overlapped
        # The projection prices ``priced()`` (the overlap=False twin: the bytes on the step that sends
        # them), its exchanges awaited ``window`` steps later (project_step_time's overlap_steps).
        self.priced, self.window = priced or make, window


def rows(jd: Any, optax: Any, lm: Any, s: Any) -> dict[str, Row]:
    """The rows, dense first: every one with ``lm.adamw(s)`` as the (inner) optimizer."""
    h, f, tau, alpha, fe = s.sync_every, s.fragments, s.sync_delay, s.mixing, s.eager_fragments

    def streaming(**flags: Any) -> Any:
        return jd.diloco(
            lm.adamw(s),
            sync_every=h,
            outer=lm.outer(s),
            num_fragments=f,
            sync_delay=tau,
            mixing=alpha,
            **flags,
        )

    def eager(**flags: Any) -> Any:
        return jd.diloco(lm.adamw(s), sync_every=h, outer=lm.outer(s), num_fragments=fe, eager=True, **flags)

    stream = f"diloco(AdamW, H={h}, F={f}, tau={tau}, mixing={alpha})"
    return {
        "dense": Row("all_reduce() + AdamW", lambda: optax.chain(jd.all_reduce(), lm.adamw(s)), False),
        "diloco": Row(
            f"diloco(AdamW, H={h})", lambda: jd.diloco(lm.adamw(s), sync_every=h, outer=lm.outer(s)), True
        ),
        "streaming": Row(stream, streaming, True),
        "streaming_overlap": Row(
            stream[:-1] + ", overlap=True), comm mesh",
            lambda: streaming(overlap=True),
            True,
            True,
            priced=streaming,
            window=tau,
        ),
        "eager": Row(
            f"diloco(AdamW, H={h}, F={fe}, eager=True, overlap=True), comm mesh",
            lambda: eager(overlap=True),
            True,
            True,
            priced=eager,
            window=h,
        ),
        "sparseloco": Row(
            f"sparseloco(AdamW, H={h})", lambda: jd.sparseloco(lm.adamw(s), sync_every=h), True
        ),
    }


# ----------------------------------------------------------------------------
# Worker: one process of the job (also the --coordinator mode on a cluster).


def meshes(jax: Any, np: Any) -> tuple[Any, Any]:
    """(compute mesh, communication mesh): device 0, and device 1, of every process, axis ``"data"``."""
    by_process: dict[int, list[Any]] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(d.process_index, []).append(d)
    procs = sorted(by_process)
    compute = jax.sharding.Mesh(np.array([by_process[p][0] for p in procs]), ("data",))
    comm = jax.sharding.Mesh(np.array([by_process[p][1] for p in procs]), ("data",))
    return compute, comm


def global_model(jax: Any, jnp: Any, optax: Any, lm: Any, params: Any, state: Any, per_worker: bool) -> Any:
    """The model to evaluate: ``lm.global_params``, except per-worker anchors (eager), which are averaged."""
    anchor = optax.tree_utils.tree_get(state, "anchor") if per_worker else None
    if anchor is not None and jax.tree.leaves(anchor)[0].ndim == jax.tree.leaves(params)[0].ndim:
        return jax.tree.map(lambda x: jnp.mean(x, axis=0), anchor)
    return lm.global_params(params, state, per_worker)


def lo_tx_bytes(shaped: bool) -> int | None:
    """The namespace loopback's transmitted bytes (``/proc/self/net/dev``); None unless shaping."""
    if not shaped or not NET_DEV.exists():
        return None
    for line in NET_DEV.read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])  # receive: 8 columns, then transmit bytes
    return None


def link_entry(jax: Any, np: Any, mesh: Any, shape: bool) -> Callable[[str | None], None]:
    """``enter(rate)``: :func:`shaped_link.jax_link_entry`'s, then a join of both processes; ``enter(None)``:
    the join only. After a join every byte either process sent before it has arrived (a process's
    all-reduce can return with its own last bytes still queued at the token bucket), so the loopback
    counter read then counts no other segment's traffic."""
    psum, ones = shaped_link.world_ops(jax, np, mesh)
    entry, one_each = shaped_link.jax_link_entry(jax, psum, ones, shape), ones(1)

    def enter(rate: str | None) -> None:
        if rate is not None:
            entry(rate)
        jax.block_until_ready(psum(one_each))

    return enter


class Task:
    """What every row shares: the model's initial parameters, loss, batches and the validation loss."""

    def __init__(self, args: argparse.Namespace, jax: Any, np: Any, lm: Any, mesh: Any):
        from flax import nnx

        self.cfg = lm.GPTConfig(context=args.context, dim=args.dim, depth=args.depth, heads=args.heads)
        graphdef, self.params, rest = nnx.split(lm.build_model(self.cfg, args.seed), nnx.Param, ...)
        self.loss = lm.make_loss(graphdef, rest)
        self.num_params = sum(int(np.size(x)) for x in jax.tree.leaves(self.params))
        self.corpus = lm.load_corpus()
        self.args, self.np, self.lm = args, np, lm
        val = lm.val_batch(self.corpus, self.cfg, args.eval_windows)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.val = jax.make_array_from_callback(val.shape, replicated, lambda idx: val[idx])

    def batch(self, t: int) -> Any:
        """Step ``t``'s global batch (every process draws it; each transfers its own half)."""
        rng = self.np.random.default_rng([self.args.seed, t])
        return self.lm.sample_windows(self.corpus.train, rng, PROCS * self.args.batch, self.cfg.context)


class Timed:
    """One row at one rate: parameters and state, the clock, step times, evaluations, loopback bytes."""

    def __init__(self, rate: str, params: Any, state: Any, first_bpb: float):
        self.rate, self.params, self.state = rate, params, state
        self.clock, self.times, self.evals, self.lo_bytes = 0.0, [], [[0, 0.0, first_bpb]], 0

    def record(self, shaped: bool) -> dict[str, Any]:
        lo = self.lo_bytes / PROCS if shaped else None
        return {
            "times_s": self.times,
            "seconds": self.clock,
            "evals": self.evals,
            "lo_tx_bytes_per_worker": lo,
        }


def train_segment(
    args: argparse.Namespace,
    jax: Any,
    run: Any,
    bpb: Any,
    enter: Any,
    r: Timed,
    batches: list[Any],
    start: int,
) -> None:
    """Steps ``start, start + 1, ...`` of ``r`` (one per batch) on the clock, then the validation loss."""
    enter(r.rate)  # both processes at the same point, the link at the rate, the token bucket emptied
    tx0 = lo_tx_bytes(args.shape)
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        out = run(r.params, r.state, batch)
        r.params, r.state, metrics = out
        jax.block_until_ready((r.params, metrics))
        if i + 1 == len(batches):  # every output: an exchange still in flight is waited for on the clock
            jax.block_until_ready(out)
        r.times.append(time.perf_counter() - t0)
        r.clock += r.times[-1]
    enter(None)
    tx1 = lo_tx_bytes(args.shape)
    r.lo_bytes += 0 if tx0 is None or tx1 is None else tx1 - tx0
    r.evals.append([start + len(batches), r.clock, bpb(r.params, r.state)])


def train_rates(
    args: argparse.Namespace,
    jax: Any,
    task: Task,
    run: Any,
    init: Any,
    bpb: Any,
    enter: Any,
    rates: list[str],
) -> dict[str, dict[str, Any]]:
    """One row at every rate from the same initialisation: the bare loopback, then each rate.

    The bare-loopback run stops every ``--eval-every`` steps for the validation loss (clock
    stopped, after waiting on the clock for any exchange in flight). Each shaped rate runs all
    its steps as one timed stretch (an exchange in flight keeps overlapping the next steps, as in
    training; the clock waits for the last one at the end) and its validation losses are the
    bare run's: the numbers do not depend on the link (the final loss is measured at every rate
    and checked equal). Its clock at an evaluation step is the sum of its step times up to there.
    """
    timed = [Timed(rate, *init(task.params), 0.0) for rate in rates]
    first = bpb(timed[0].params, timed[0].state)
    bare, linked = timed[0], timed[1:]
    bare.evals[0][2] = first
    for start in range(0, args.steps, args.eval_every):
        batches = [task.batch(t) for t in range(start, min(start + args.eval_every, args.steps))]
        train_segment(args, jax, run, bpb, enter, bare, batches, start)
    for r in linked:
        train_segment(args, jax, run, bpb, enter, r, [task.batch(t) for t in range(args.steps)], 0)
        final = r.evals[-1][2]
        if final != bare.evals[-1][2]:
            raise RuntimeError(
                f"{r.rate}: final loss {final} differs from the bare run's {bare.evals[-1][2]}"
            )
        clock = [0.0, *itertools.accumulate(r.times)]
        r.evals = [[step, clock[step], loss] for step, _, loss in bare.evals]
    return {r.rate: r.record(args.shape) for r in timed}


def run_row(
    args: argparse.Namespace, jax: Any, jd: Any, task: Task, row: Row, meshes_: tuple[Any, Any], enter: Any
) -> dict[str, Any]:
    """Builds and warms up one row, then trains it on the bare loopback and at each rate."""
    import jax.numpy as jnp
    import optax

    compute, comm = meshes_
    tx = row.make()
    step = jd.data_parallel_step(
        task.loss, tx, mesh=compute, per_worker_params=row.per_worker, reduce_metrics=False
    )
    run = jd.overlapped_step(step, comm_mesh=comm) if row.overlapped else step
    evaluate = jax.jit(
        lambda p, s, b: task.loss(global_model(jax, jnp, optax, task.lm, p, s, row.per_worker), b)
    )

    def bpb(params: Any, state: Any) -> float:  # validation bits per byte of the global model
        return float(evaluate(params, state, task.val)) / math.log(2)

    enter("unshaped")
    t0 = time.perf_counter()
    params, state = step.init(task.params)
    for t in range(min(args.sync_every, args.steps)):  # compiles every program, the exchanges' too
        params, state, _ = run(params, state, task.batch(t))
    jax.block_until_ready((params, state))
    warmup_s = time.perf_counter() - t0
    rates = ["unshaped"] + (args.rates if args.shape else [])
    runs = train_rates(args, jax, task, run, step.init, bpb, enter, rates)
    settings = argparse.Namespace(replicas=PROCS, steps=args.steps)
    cost = task.lm.replica_axis_cost(tx, task.params, settings)
    per_step, period = task.lm.data_axis_bytes(cost)
    return {
        "label": row.label,
        "per_worker": row.per_worker,
        "overlapped": row.overlapped,
        "warmup_s": warmup_s,
        "sent_bytes_per_step": float(statistics.mean(period)) if period else 0.0,
        "peak_sent_bytes": float(max(period, default=0.0)),
        "sent_bytes": task.lm.cumulative_bytes(per_step, period, args.steps),
        "runs": runs,
    }


def run_lm_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Trains every row of ``--methods`` at every rate (:func:`run_row`); process 0's result."""
    shaped_link.configure_jax(2)
    import jax
    import numpy as np
    import optax

    import jaxopt_dist as jd

    lm = import_lm()
    distributed = shaped_link.start_distributed(jax, args)
    compute, comm = meshes(jax, np)
    enter = link_entry(jax, np, compute, args.shape)
    task = Task(args, jax, np, lm, compute)
    table = rows(jd, optax, lm, args)
    results, skipped = {}, {}
    for name in args.methods:
        if table[name].overlapped and not hasattr(jd, "overlapped_step"):
            skipped[name] = "jaxopt_dist.overlapped_step not available"
            continue
        results[name] = run_row(args, jax, jd, task, table[name], (compute, comm), enter)
    if args.shape and jax.process_index() == 0:
        shaped_link.set_rate("unshaped")
    if distributed:
        jax.distributed.shutdown()
    return {
        "procs": compute.shape["data"],
        "rates": args.rates if args.shape else [],
        "params": task.num_params,
        "config": {name: getattr(args, name) for name in CONFIG},
        "train_bytes": len(task.corpus.train),
        "val_bytes": len(task.corpus.val),
        "malloc": shaped_link.mapped_malloc(),
        "cpus": sorted(shaped_link.usable_cpus() or []),
        "methods": results,
        "skipped": skipped,
    }


# ----------------------------------------------------------------------------
# Tables.


def target_of(res: dict[str, Any], target: float | None, slack: float) -> tuple[float | None, str]:
    """The target validation loss (bits/byte) and how it was chosen."""
    if target is not None:
        return target, f"{target:.4f} bits/byte (--target)"
    dense = res["methods"].get("dense")
    if dense is None:
        return None, "none (no dense row and no --target)"
    final = dense["runs"]["unshaped"]["evals"][-1][2]
    return final * (
        1 + slack
    ), f"{final * (1 + slack):.4f} bits/byte (dense's final {final:.4f} x {1 + slack:g})"


def wall_to(run: dict[str, Any], target: float | None) -> tuple[float | None, int | None]:
    """(clock seconds, step) of the first evaluation at or below ``target``; (None, None) if never."""
    for step, clock, bpb in run["evals"]:
        if target is not None and bpb <= target:
            return clock, step
    return None, None


def projections(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per shaped rate, per row: ``project_step_time``'s wall seconds per step (mean over the period).

    Inputs: the row's bytes from ``communication_cost`` of its overlap=False twin, the link at the
    nominal rate shared by the two processes (both send through one shaped loopback: each gets
    rate / 2), no latency, the compute of one step measured on the bare loopback (its mean), and
    the row's overlap window (``sync_delay`` for streaming_overlap, ``H`` for eager, 0 for the rest).
    Computed here, in the launcher, from the saved configuration (``--from-json`` too).
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import optax
    from flax import nnx

    import jaxopt_dist as jd

    lm = import_lm()
    s = argparse.Namespace(**res["config"])
    cfg = lm.GPTConfig(context=s.context, dim=s.dim, depth=s.depth, heads=s.heads)
    params = jax.eval_shape(lambda: nnx.split(lm.build_model(cfg, s.seed), nnx.Param, ...)[1])
    table = rows(jd, optax, lm, s)
    out: dict[str, dict[str, float]] = {rate: {} for rate in res["rates"]}
    for name, r in res["methods"].items():
        row = table[name]
        cost = lm.replica_axis_cost(row.priced(), params, argparse.Namespace(replicas=PROCS, steps=s.steps))
        compute = statistics.mean(r["runs"]["unshaped"]["times_s"])
        for rate in res["rates"]:
            t = jd.project_step_time(
                cost,
                bandwidth_gbps=shaped_link.RATES[rate] / PROCS,
                latency_us=0.0,
                compute_seconds=compute,
                overlap_steps=row.window,
            )
            out[rate][name] = t.wall_seconds
    return out


def summarize(res: dict[str, Any], target: float | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per rate, per row: the table's numbers."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    dense = res["methods"].get("dense")
    for rate in ["unshaped", *res["rates"]]:
        out[rate] = {}
        for name, r in res["methods"].items():
            run, alone = r["runs"][rate], r["runs"]["unshaped"]
            wall, step = wall_to(run, target)
            dense_wall = wall_to(dense["runs"][rate], target)[0] if dense else None
            own = run["evals"][-1][2]  # at equal quality: the time to the row's own final loss
            dense_own, row_own = wall_to(dense["runs"][rate], own)[0] if dense else None, wall_to(run, own)[0]
            out[rate][name] = {
                "median_s": statistics.median(run["times_s"]),
                "mean_s": statistics.mean(run["times_s"]),
                "utilization": alone["seconds"] / run["seconds"],
                "final_bpb": run["evals"][-1][2],
                "wall_to_target": wall,
                "step_to_target": step,
                "x_dense": dense_wall / wall if wall and dense_wall else None,
                "x_dense_own": dense_own / row_own if dense_own and row_own else None,
                "vs_dense_loss": run["evals"][-1][2] / dense["runs"][rate]["evals"][-1][2] if dense else None,
            }
    return out


def print_tables(res: dict[str, Any], note: str, target: float | None = None, slack: float = 0.03) -> None:
    cfg = res["config"]
    goal, how = target_of(res, target, slack)
    print(
        f"\nbyte-level GPT (examples/lm.py): dim {cfg['dim']}, depth {cfg['depth']}, heads {cfg['heads']}, context "
        f"{cfg['context']}, {res['params']:,} parameters; {res['procs']} processes (one replica each, gloo), "
        f"{cfg['batch']} windows per worker per step, {cfg['steps']} inner steps, AdamW lr {cfg['lr']:g} "
        f"(warm-up {cfg['warmup']}, cosine), weight decay {cfg['weight_decay']:g}; H={cfg['sync_every']}; "
        f"validation every {cfg['eval_every']} steps on {cfg['eval_windows']} windows; corpus "
        f"{res['train_bytes'] / 1e6:.2f} MB train, {res['val_bytes'] / 1e6:.2f} MB validation.\n{note}\n"
        f"target validation loss: {how}"
    )
    for rate in res.get("rates", []):
        burst = shaped_link.burst_bytes(rate)
        fits = [n for n, r in res["methods"].items() if PROCS * r.get("peak_sent_bytes", math.inf) <= burst]
        print(
            f"token bucket at {rate}: {shaped_link.fmt_bytes(burst)}; the busiest step's bytes (both workers) "
            f"fit in it, crossing unpaced when it has refilled: {', '.join(fits) or 'no row'}"
        )
    for name, why in res.get("skipped", {}).items():
        print(f"skipped {name}: {why}")
    numbers = summarize(res, goal)
    projected = projections(res) if res["rates"] else {}
    for rate, table in projected.items():
        for name, wall in table.items():
            numbers[rate][name]["projected_s"] = wall
    for rate, table in numbers.items():
        title = "bare loopback (the no-link baseline)" if rate == "unshaped" else f"link {rate}"
        print(f"\n### {title}\n")
        print(
            "| method | s/step median | s/step mean | utilization | B/worker (cost) | B/worker (lo) | "
            "final bits/byte | vs dense | wall to target s | step | dense / row | dense / row at own loss | "
            "projected s/step | projected / mean |\n|---|" + "---:|" * 13
        )
        for name, n in table.items():
            r = res["methods"][name]
            lo = r["runs"][rate]["lo_tx_bytes_per_worker"]
            wall = "not reached" if n["wall_to_target"] is None else f"{n['wall_to_target']:.2f}"
            print(
                f"| {name}: {r['label']} | {n['median_s']:.4f} | {n['mean_s']:.4f} | {n['utilization']:.3f} | "
                f"{shaped_link.fmt_bytes(r['sent_bytes'])} | {'-' if lo is None else shaped_link.fmt_bytes(lo)} | "
                f"{n['final_bpb']:.4f} | {_opt(n['vs_dense_loss'], '{:.3f}')} | {wall} | "
                f"{n['step_to_target'] or '-'} | {_opt(n['x_dense'], '{:.1f}x')} | "
                f"{_opt(n['x_dense_own'], '{:.1f}x')} | {_opt(n.get('projected_s'), '{:.4f}')} | "
                f"{_opt(n.get('projected_s') and n['projected_s'] / n['mean_s'], '{:.2f}')} |"
            )
    print_goals(numbers)


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def print_goals(numbers: dict[str, dict[str, dict[str, Any]]]) -> None:
    """The goals at 100 Mbit/s, each met or not, with the measured value."""
    at = numbers.get("100mbit")
    print("\ngoals at 100 Mbit/s:")
    if at is None:
        print("- not measured (no shaped 100mbit run)")
        return
    for rate, table in numbers.items():
        off = {k: n["projected_s"] / n["mean_s"] - 1 for k, n in table.items() if n.get("projected_s")}
        if off:
            worst = max(off, key=lambda k: abs(off[k]))
            ok = "met" if abs(off[worst]) <= 0.25 else "NOT met"
            print(
                f"- {rate}: project_step_time within 25% of the measured mean s/step: worst {worst} {off[worst]:+.0%} ({ok})"
            )
    if "streaming_overlap" in at:
        u = at["streaming_overlap"]["utilization"]
        print(f"- streaming_overlap utilization >= 0.9: {u:.3f} ({'met' if u >= 0.9 else 'NOT met'})")
    for name in DILOCO_FAMILY:
        if name not in at:
            continue
        n = at[name]
        fast = n["x_dense"] is not None and n["x_dense"] >= 10
        close = n["vs_dense_loss"] is not None and n["vs_dense_loss"] <= 1.03
        print(
            f"- {name}: {_opt(n['x_dense'], '{:.1f}x')} less wall time to target than dense "
            f"({'met' if fast else 'NOT met'}: >= 10x); final loss {_opt(n['vs_dense_loss'], '{:.3f}')} of dense's "
            f"({'met' if close else 'NOT met'}: <= 1.03); at the row's own final loss dense takes "
            f"{_opt(n['x_dense_own'], '{:.1f}x')} the row's wall time"
        )


# ----------------------------------------------------------------------------
# Command line and launcher.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="", help="comma-separated rows (default: all)")
    p.add_argument("--rates", default="100mbit,1gbit", help="shaped rates (after the bare-loopback run)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (every unset CONFIG value small)")
    for name, (kind, default, _, text) in CONFIG.items():
        p.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=None, help=f"{text} (default {default})"
        )
    p.add_argument(
        "--target", type=float, default=None, help="target validation bits/byte (default: dense's)"
    )
    p.add_argument(
        "--target-slack", type=float, default=0.03, help="default target: dense's final x (1 + this)"
    )
    p.add_argument(
        "--burst-ms",
        type=float,
        default=10.0,
        help="token bucket of this many ms of traffic at each rate (0: the harness's 2 MiB; default 10)",
    )
    shaped_link.add_link_options(p)
    p.add_argument("--lm-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shaped_link.set_burst_ms(args.burst_ms or None)
    for name, (_, default, quick, _) in CONFIG.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    known = list(rows(*[shaped_link.AnyModule()] * 3, args))
    args.methods = [m for m in args.methods.split(",") if m] or known
    args.rates = [r for r in args.rates.split(",") if r]
    if [m for m in args.methods if m not in known]:
        p.error(f"--methods: unknown {[m for m in args.methods if m not in known]}; known: {known}")
    if [r for r in args.rates if r not in shaped_link.RATES or r == "unshaped"]:
        p.error(f"--rates: each one of {[r for r in shaped_link.RATES if r != 'unshaped']}")
    if args.sync_every % args.fragments or not 0 <= args.sync_delay < args.sync_every // args.fragments:
        p.error("--sync-every must be a multiple of --fragments, and 0 <= --sync-delay < H / F")
    if min(args.steps, args.eval_every, args.batch, args.eval_windows) < 1:
        p.error("--steps, --eval-every, --batch and --eval-windows must be positive")
    shaped_link.check_link_options(p, args, worker=args.lm_worker)
    return args


def worker_argv(args: argparse.Namespace, pid: int, coord: str | None, out: str) -> list[str]:
    """The command line of worker ``pid``: every CONFIG value explicit."""
    extra = [
        "--methods",
        ",".join(args.methods),
        "--rates",
        ",".join(args.rates),
        "--burst-ms",
        str(args.burst_ms),
    ]
    for name in CONFIG:
        extra += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return shaped_link.worker_argv(SCRIPT, args, "lm", PROCS, pid, coord, out, extra)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show = functools.partial(print_tables, target=args.target, slack=args.target_slack)
    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        show(saved["lm"], saved.get("note", ""))
        return 0
    if args.lm_worker:
        return shaped_link.run_worker(args, run_lm_worker)
    if args.coordinator is not None:  # cluster mode: this process is one of the job
        return shaped_link.run_cluster(args, run_lm_worker, "lm", show)
    return shaped_link.launch_and_show(
        args, "lm", PROCS, functools.partial(worker_argv, args), show, timed=True
    )


if __name__ == "__main__":
    sys.exit(main())
