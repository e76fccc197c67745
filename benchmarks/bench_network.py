"""Measured step time on a real link: every method, separate processes, gloo over TCP.

Each of ``--procs`` processes (default 2) starts ``jax.distributed`` on a
loopback coordinator with gloo CPU collectives and one CPU device, so every
collective crosses a real TCP connection. Each times one optimizer update of
the ResNet-18 (CIFAR) gradient shapes of ``bench_compression.py`` (11.2M
float32): compress, communicate, decompress and ``sgd(0.1, momentum=0.9)``,
as a jitted ``jax.shard_map`` over the processes' mesh, median of
``--repeats`` (>= 7) timed steps after a warm-up step, for every method of
:func:`methods`, dense all-reduce first.

The link, the workers and the timing come from ``shaped_link.py``, the
harness this script shares with ``bench_network_e2e.py``; its docstring
describes them in full. In short: the processes run in a fresh network
namespace (``unshare --net``) whose loopback is shaped with a token bucket
(``tc qdisc replace dev lo root tbf rate R burst 2mb latency 2s``), changed
between rates by process 0 while the compiled programs are kept, so the rates
of one method are timed back to back. The loopback is one device: every
process's bytes pass the same bucket, so the wire time at rate ``R`` is
``procs * bytes_per_worker / R``. Where shaping is not permitted (not root,
no CAP_NET_ADMIN, no iproute2) the script says so and runs unshaped. Every
worker, JAX and PyTorch alike, runs with tcmalloc preloaded where it is
installed, else with glibc's huge-page tunable (``--malloc``), and worker
``i`` is pinned to the ``i``-th usable CPU (``--pin``); the table's note says
which.

Columns, per rate:

* ``s/step``: measured seconds per update (process 0's median);
* ``x dense``: the dense row's ``s/step`` over this row's (> 1: faster);
* ``B/worker``: bytes each worker sends per step (``communication_cost``);
* ``wire s``: the time the shaped wire alone needs for every worker's bytes;
* ``compute s``: the same update with no link: every worker also times it on
  a one-device mesh of its own, the workers side by side (so each has the
  share of the cores it has in the linked run; one process alone would get
  every core, as XLA:CPU runs its kernels multi-threaded), in rounds that
  alternate with the linked timings of the same method (a drift of the
  machine's speed then moves both alike);
* ``proj ring`` / ``proj gloo``: ``compute s`` + ``project_step_time`` with
  ``algorithm="ring"`` (the textbook model) / ``"gloo"`` (XLA:CPU over gloo)
  at the link's per-worker bandwidth (``R / procs`` for the shared loopback;
  unshaped, the bandwidth a ``--calibration-mb`` all-reduce reached in the
  same run) and the per-round latency of a 4-byte all-reduce in the same run;
  ``proj gloo`` also charges every gloo call at least the time of a 4 kB
  all-reduce in the same run (``call_floor_us``: gloo over TCP took about
  4 ms for any collective of more than one element here); at a shaped rate
  both count the token bucket (``shaped_link.bucket_speedup``: up to 2 MiB of
  a step's bytes, refilled during its compute, cross unpaced, which a real
  link of that rate would not do); the projections are traced in the
  launching process when the table is printed, as the workers' program
  (:func:`traced_costs`), so ``--from-json`` reprints a saved run with the
  current model;
* ``gloo/meas``: ``proj gloo`` over ``s/step``.

The torch rows give ``s/step`` and ``x dense`` only.

With torch installed, PyTorch DDP (gloo, one bucket) runs on the same shapes,
processes and link with its communication hooks (``allreduce``,
``fp16_compress_hook``, ``powerSGD_hook`` rank 1 and 4) and ``SGD(0.1,
momentum=0.9)``; its step is backward of ``sum(p * g)`` (the hook runs
inside it) and ``optimizer.step()``.

The end-to-end runs (wall-clock time to a test accuracy, once ``--e2e`` here)
are ``bench_network_e2e.py``, with the same ``--e2e-*`` options;
``--from-json`` here still prints a saved end-to-end run.

Run::

    python benchmarks/bench_network.py                       # 2 processes, every rate
    python benchmarks/bench_network.py --rates 1gbit,100mbit --procs 4
    python benchmarks/bench_network.py --methods dense,powersgd_r1 --repeats 7
    python benchmarks/bench_network.py --from-json saved.json   # reprint a --json run

On one's own cluster (no shaping; the link is whatever connects the hosts),
once per host, with the first host's address::

    python benchmarks/bench_network.py --coordinator 10.0.0.1:12355 \\
        --num-processes 2 --process-id 0      # on host 0 (prints the table)
    python benchmarks/bench_network.py --coordinator 10.0.0.1:12355 \\
        --num-processes 2 --process-id 1      # on host 1
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import shaped_link

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = pathlib.Path(__file__).resolve()
RATES = shaped_link.RATES

LR, MOMENTUM = 0.1, 0.9
TORCH_METHODS = ("torch_allreduce", "torch_fp16", "torch_powersgd_r1", "torch_powersgd_r4")


def methods(jd: Any, jnp: Any) -> dict[str, tuple[str, Callable[[], Any]]]:
    """Name -> (label, factory of the communicating transform), in table order.

    Every gradient-aggregating transform of the library; the optimizer
    (``sgd(0.1, momentum=0.9)``) is chained after it. Transforms with
    per-worker parameters (``average_params``, ``gossip``, ``diloco``) are
    left out: their step is not one aggregation of gradients; so is
    ``threshold``, whose threshold and capacity depend on the gradients'
    scale. A new method (or option) is a new row here.
    """
    return {
        "dense": ("all_reduce() (packed across processes on CPU)", lambda: jd.all_reduce()),
        "dense_per_leaf": ("all_reduce(flatten=False)", lambda: jd.all_reduce(flatten=False)),
        "bf16": ("all_reduce(dtype=bfloat16)", lambda: jd.all_reduce(dtype=jnp.bfloat16)),
        "top_k": ("top_k(density=0.01) + EF", lambda: jd.top_k(density=0.01)),
        "random_k": ("random_k(density=0.01) + EF", lambda: jd.random_k(density=0.01)),
        "block_k": ("block_k(density=0.01) + EF", lambda: jd.block_k(density=0.01)),
        "sign_vote": ("sign_majority_vote()", lambda: jd.sign_majority_vote()),
        "ef_sign": ("scaled_sign() + EF", lambda: jd.scaled_sign()),
        "qsgd": ("qsgd(16)", lambda: jd.qsgd(16)),
        "powersgd_r1": ("powersgd(rank=1)", lambda: jd.powersgd(rank=1)),
        "powersgd_r2": ("powersgd(rank=2)", lambda: jd.powersgd(rank=2)),
        "powersgd_r4": ("powersgd(rank=4)", lambda: jd.powersgd(rank=4)),
        "powersgd_r2_1ar": (
            "powersgd(rank=2, one_allreduce=True)",
            lambda: jd.powersgd(rank=2, one_allreduce=True),
        ),
        "adasum": ("adasum()", lambda: jd.adasum()),
    }


TORCH_LABELS = {
    "torch_allreduce": "torch DDP allreduce (1 bucket)",
    "torch_fp16": "torch DDP fp16_compress_hook",
    "torch_powersgd_r1": "torch DDP powerSGD_hook rank 1",
    "torch_powersgd_r4": "torch DDP powerSGD_hook rank 4",
}


def resnet18_shapes(width: int) -> dict[str, tuple[int, ...]]:
    """ResNet-18 (CIFAR) parameter shapes in Flax layout (``bench_compression.py``)."""
    sys.path.insert(0, str(HERE))
    from bench_compression import resnet18_cifar_shapes  # imports jax: workers only

    return resnet18_cifar_shapes(width)


def _torch_shape(s: tuple[int, ...]) -> tuple[int, ...]:
    """Flax (kh, kw, in, out) / (in, out) -> PyTorch (out, in, kh, kw) / (out, in)."""
    if len(s) == 4:
        return (s[3], s[2], s[0], s[1])
    if len(s) == 2:
        return (s[1], s[0])
    return s


# ----------------------------------------------------------------------------
# Workers: one process of the job (also the --coordinator mode on a cluster).


def _update_step(jax: Any, optax: Any, jd: Any, tx: Any, params: Any, mesh: Any) -> Callable[[Any], None]:
    """One update of ``tx`` + the parameters on ``mesh``, jitted; returns ``one(grads)``, which blocks.

    The parameters and the optimizer state live in the closure and are donated
    at each call, as a training loop would.
    """
    P = jax.sharding.PartitionSpec
    mask = jd.opt_state_placement(tx, params, mesh=mesh).per_worker
    s_spec = jax.tree.map(lambda m: P("data") if m else P(), mask)
    p_spec = jax.tree.map(lambda _: P(), params)

    # Arguments and results in the same order (params, state): JAX pairs a
    # donated input with an output of its shape in order, so a swapped order
    # would alias the new params onto the old momentum and make XLA copy every
    # buffer first (measured: 60 of the dense step's 70 ms on one core).
    def body(g, p, s):
        g = jax.tree.map(lambda x: x[0], g)
        s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return p, jax.tree.map(lambda x, m: x[None] if m else x, s, mask)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("data"), p_spec, s_spec), out_specs=(p_spec, s_spec)),
        donate_argnums=(1, 2),
    )
    carry = [jd.place_params(params, mesh=mesh), jd.init_opt_state(tx, params, mesh=mesh)]

    def one(grads: Any) -> None:
        carry[0], carry[1] = step(grads, carry[0], carry[1])
        jax.block_until_ready(carry[0])

    return one


def _gradients(jax: Any, np: Any, shapes: dict[str, tuple[int, ...]], mesh: Any, first_worker: int) -> Any:
    """One distinct gradient row per worker of ``mesh`` (worker ``first_worker`` upwards), made where it lives."""
    n = mesh.shape["data"]
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def leaf(i: int, s: tuple[int, ...]) -> Any:
        def cb(idx: Any) -> Any:
            rows = range(n)[idx[0]]
            return np.stack(
                [
                    np.random.default_rng([i, first_worker + r]).standard_normal(s, np.float32) * 1e-2
                    for r in rows
                ]
            )

        return jax.make_array_from_callback((n, *s), row, cb)

    return {k: leaf(i, s) for i, (k, s) in enumerate(shapes.items())}


def run_jax_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Times every selected method at every rate, and with no link; returns process 0's results.

    Every process times the update twice over: on the mesh of every
    process's device (the linked run) and on a one-device mesh of its own
    (``compute``: the same update with no link, the processes side by side,
    so each has the share of the cores it has in the linked run), in
    alternating rounds (``shaped_link.time_method``).
    """
    shaped_link.configure_jax(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    distributed = shaped_link.start_distributed(jax, args)
    me = jax.process_index()
    world = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    alone = jax.make_mesh((1,), ("data",), devices=jax.local_devices()[:1])
    world_n = world.shape["data"]
    rates = args.rates if args.shape else ["unshaped"]
    psum, ones = shaped_link.world_ops(jax, np, world)
    enter = shaped_link.jax_link_entry(jax, psum, ones, args.shape)
    link = shaped_link.calibrate(jax, psum, ones, rates, enter, args.calibration_mb)
    if args.verbose:
        print(f"[{me}/{world_n}] link", link, file=sys.stderr, flush=True)
    shapes = resnet18_shapes(args.width)
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    grads, grads_alone = _gradients(jax, np, shapes, world, 0), _gradients(jax, np, shapes, alone, me)
    table = methods(jd, jnp)
    results: dict[str, Any] = {}
    for name in [m for m in args.methods if m in table]:
        label, make = table[name]
        tx = optax.chain(make(), jd.sgd(LR, momentum=MOMENTUM))
        steps = {"linked": functools.partial(_update_step(jax, optax, jd, tx, params, world), grads)}
        if world_n > 1:  # (with one process the linked step has no link)
            steps["alone"] = functools.partial(_update_step(jax, optax, jd, tx, params, alone), grads_alone)
        results[name] = {
            "label": label,
            "sent_bytes": jd.communication_cost(tx, params, num_workers=world_n).sent_bytes,
            **shaped_link.time_method(steps, rates, enter, args.repeats),
        }
        if args.verbose:
            ms = {k: round(v["median_s"] * 1e3, 1) for k, v in results[name]["rates"].items()}
            print(f"[{me}/{world_n}] {name} ms:", ms, file=sys.stderr, flush=True)
    if args.shape and me == 0:
        shaped_link.set_rate("unshaped")
    out = {
        "procs": world_n,
        "params": int(sum(math.prod(s) for s in shapes.values())),
        "link": link,
        "width": args.width,
        "cpus": shaped_link.usable_cpus(),
        "malloc": shaped_link.mapped_malloc(),
        "methods": results,
    }
    if distributed:
        jax.distributed.shutdown()
    return out


def run_torch_worker(args: argparse.Namespace) -> dict[str, Any]:
    """PyTorch DDP (gloo, one bucket) with its comm hooks, same shapes, rates and timing."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    torch.set_flush_denormal(False)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.torch_coordinator}",
        rank=args.process_id,
        world_size=args.num_processes,
    )
    me, n = dist.get_rank(), dist.get_world_size()
    rates = args.rates if args.shape else ["unshaped"]
    shapes = _resnet18_shapes_nojax(args.width)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(_torch_shape(s))) for s in shapes]
            )

        def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
            return sum((p * g).sum() for p, g in zip(self.ps, gs))  # d/dp = g

    gen = torch.Generator().manual_seed(me)
    gs = [torch.randn(_torch_shape(s), generator=gen) * 1e-2 for s in shapes]

    bucketful = torch.ones(shaped_link.TBF_BURST_BYTES // 4)
    enter = shaped_link.link_entry(args.shape, me, dist.barrier, lambda: dist.all_reduce(bucketful))

    results: dict[str, Any] = {}
    for name in [m for m in args.torch_methods if m in TORCH_METHODS]:
        model = torch.nn.parallel.DistributedDataParallel(Model(), bucket_cap_mb=100_000)
        if name == "torch_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name.startswith("torch_powersgd"):
            rank = int(name.rsplit("r", 1)[1])
            state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
            )
            model.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        def one() -> None:
            opt.zero_grad(set_to_none=False)
            model(gs).backward()
            opt.step()

        enter("unshaped")
        for _ in range(3):  # DDP's first step builds its buckets; PowerSGD starts at step 2
            one()
        buckets = model._get_ddp_logging_data().get("num_buckets_reduced", None)
        per_rate = shaped_link.time_rounds([(rate, rate, one) for rate in rates], enter, args.repeats)
        results[name] = {"label": TORCH_LABELS[name], "rates": per_rate, "buckets": buckets}
    if args.shape and me == 0:
        shaped_link.set_rate("unshaped")
    dist.destroy_process_group()
    return {"procs": n, "torch": torch.__version__, "malloc": shaped_link.mapped_malloc(), "methods": results}


def _resnet18_shapes_nojax(width: int) -> list[tuple[int, ...]]:
    """The same shapes without importing JAX (for the torch workers)."""
    out: list[tuple[int, ...]] = [(3, 3, 3, width), (width,), (width,)]
    cin = width
    for stage, mult in enumerate((1, 2, 4, 8)):
        cout = width * mult
        for block in range(2):
            stride = 2 if (block == 0 and stage > 0) else 1
            out += [(3, 3, cin, cout), (cout,), (cout,), (3, 3, cout, cout), (cout,), (cout,)]
            if stride != 1 or cin != cout:
                out += [(1, 1, cin, cout), (cout,), (cout,)]
            cin = cout
    return [*out, (8 * width, 10), (10,)]


# ----------------------------------------------------------------------------
# Projections, traced in the launching process.


def traced_costs(res: dict[str, Any]) -> dict[str, Any]:
    """``communication_cost`` of every method of ``res``, traced here as the workers traced it.

    Imports JAX in this (the launching) process, after the timed runs. The
    programs are traced for ``res["procs"]`` CPU processes
    (``platform=jd.Platform("cpu", multi_process=...)``), where
    ``all_reduce()`` packs its leaves (``flatten_by_default``), which this one
    process would not do.
    """
    shaped_link.configure_jax(1)
    import jax
    import jax.numpy as jnp
    import optax

    import jaxopt_dist as jd

    n, table = res["procs"], methods(jd, jnp)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in resnet18_shapes(res["width"]).items()}
    workers = jd.Platform("cpu", multi_process=n > 1)
    costs = {}
    for name in res["methods"]:
        tx = optax.chain(table[name][1](), jd.sgd(LR, momentum=MOMENTUM))
        costs[name] = jd.communication_cost(tx, params, num_workers=n, platform=workers)
    return costs


def _bucket_speedup(res: dict[str, Any], name: str, rate: str) -> float:
    """``shaped_link.bucket_speedup`` of ``name``'s step: its bytes and compute-only time in ``res``."""
    sent = res["methods"][name].get("sent_bytes", 0.0)
    return shaped_link.bucket_speedup(res["link"], res["procs"], rate, sent, _compute_s(res, name))


def projections(
    res: dict[str, Any], algorithm: str = "gloo", costs: dict[str, Any] | None = None
) -> dict[str, dict[str, float]]:
    """``project_step_time`` (communication seconds) per method and rate.

    ``costs``: :func:`traced_costs` of ``res``, traced here when not given.
    """
    costs = traced_costs(res) if costs is None else costs
    n, link = res["procs"], res["link"]
    return {
        name: {
            rate: shaped_link.projected_seconds(
                cost, link, rate, n, algorithm, speedup=_bucket_speedup(res, name, rate)
            )
            for rate in link
        }
        for name, cost in costs.items()
    }


# ----------------------------------------------------------------------------
# Tables.


def _compute_s(res: dict[str, Any], name: str, compute: dict[str, Any] | None = None) -> float | None:
    """The compute-only median of ``name``: its own entry, or (saved by older versions) a separate run's."""
    if "compute" in res["methods"].get(name, {}):
        return res["methods"][name]["compute"]["median_s"]
    old = (compute or {}).get("methods", {}).get(name, {}).get("rates", {}).get("unshaped", {})
    return old.get("median_s")


def print_tables(
    res: dict[str, Any], torch_res: dict[str, Any] | None, note: str, compute: dict[str, Any] | None = None
) -> None:
    """Markdown tables, one per rate; projections traced here with the current model.

    ``compute``: the separate compute-only run that ``--json`` files of older
    versions of this script hold; newer ones keep it in each method's entry.
    """
    n = res["procs"]
    rows = res["methods"]
    costs = traced_costs(res)  # traced once, priced under both algorithms
    ring, gloo = projections(res, "ring", costs), projections(res, "gloo", costs)
    print(f"\n{res['params']:,} float32 parameters (ResNet-18 CIFAR shapes), {n} processes, gloo; {note}")
    print(
        f"  compute s: the update with no link, timed by the {n} processes side by side, each on its own "
        "device, in rounds alternating with the linked timings"
    )
    for rate, cal in res["link"].items():
        gbps, lat_us = shaped_link.link_model(res["link"], rate, n)
        extra = (
            f", {cal['probe_mb']} MB all-reduce {cal['allreduce_probe_s'] * 1e3:.1f} ms"
            if "allreduce_probe_s" in cal
            else ""
        )
        print(
            f"  link {rate}: 4-byte all-reduce {cal['allreduce_4B_s'] * 1e6:.0f} us, "
            f"4 kB all-reduce {shaped_link.call_floor_us(res['link'], rate):.0f} us{extra}; "
            f"model: {gbps:.4g} Gbit/s per worker, {lat_us:.0f} us per round, "
            f"gloo calls at least the 4 kB all-reduce's time"
        )
    for rate in res["link"]:
        gbps = RATES[rate]
        dense = rows.get("dense", next(iter(rows.values())))["rates"][rate]["median_s"]
        print(f"\n### {rate}")
        cols = [
            "method",
            "s/step",
            "x dense",
            "B/worker",
            "wire s",
            "compute s",
            "proj ring",
            "proj gloo",
            "gloo/meas",
        ]
        print("| " + " | ".join(cols) + " |\n|---|" + "---:|" * (len(cols) - 1))
        for name, r in rows.items():
            meas = r["rates"][rate]["median_s"]
            comp = _compute_s(res, name, compute)
            p_ring = ring[name][rate] + (comp or 0.0)
            p_gloo = gloo[name][rate] + (comp or 0.0)
            wire = f"{n * r['sent_bytes'] * 8 / (gbps * 1e9):.3f}" if gbps else "-"
            print(
                f"| {name} | {meas:.3f} | {dense / meas:.2f} | {shaped_link.fmt_bytes(r['sent_bytes'])} | {wire} | "
                + (f"{comp:.3f}" if comp is not None else "-")
                + f" | {p_ring:.3f} | {p_gloo:.3f} | {p_gloo / meas:.2f} |"
            )
        if torch_res:
            for name, r in torch_res["methods"].items():
                meas = r["rates"][rate]["median_s"]
                print(f"| {name} | {meas:.3f} | {dense / meas:.2f} | | | | | | |")
    print()
    for name, r in rows.items():
        print(f"  {name}: {r['label']} (compile + first step {r['compile_s']:.1f} s)")
    if torch_res:
        for name, r in torch_res["methods"].items():
            print(f"  {name}: {r['label']} (torch {torch_res['torch']}, buckets reduced: {r['buckets']})")


# ----------------------------------------------------------------------------
# Command line and launcher.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="processes to launch on this machine (default 2)")
    p.add_argument("--rates", default=",".join(RATES), help=f"comma-separated, of {list(RATES)}")
    p.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    p.add_argument("--torch-methods", default=",".join(TORCH_METHODS), help="PyTorch rows ('' for none)")
    p.add_argument(
        "--repeats", type=int, default=7, help="timed steps per method and rate (>= 7 for the table)"
    )
    p.add_argument("--width", type=int, default=64, help="ResNet-18 base width (64: the real model)")
    p.add_argument("--calibration-mb", type=int, default=16, help="size of the bandwidth probe all-reduce")
    shaped_link.add_link_options(p)
    p.add_argument("--jax-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-coordinator", default=None, help=argparse.SUPPRESS)
    if any(a == "--e2e" or a.startswith("--e2e-") for a in (sys.argv[1:] if argv is None else argv)):
        p.error("the end-to-end runs (--e2e, --e2e-*) moved: python benchmarks/bench_network_e2e.py")
    args = p.parse_args(argv)
    args.rates = [r for r in args.rates.split(",") if r]
    bad = [r for r in args.rates if r not in RATES]
    if bad or not args.rates:
        p.error(f"--rates must be a comma-separated subset of {list(RATES)}; got {bad or args.rates}")
    args.torch_methods = [m for m in args.torch_methods.split(",") if m]
    bad = [m for m in args.torch_methods if m not in TORCH_METHODS]
    if bad:
        p.error(f"--torch-methods must be a subset of {list(TORCH_METHODS)}; got {bad}")
    if args.methods is not None:
        args.methods = [m for m in args.methods.split(",") if m]
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.procs < 1:
        p.error("--procs must be >= 1")
    shaped_link.check_link_options(p, args, worker=args.jax_worker or args.torch_worker)
    return args


def worker_argv(
    args: argparse.Namespace, kind: str, procs: int, pid: int, coord: str | None, out: str
) -> list[str]:
    """The command line of ``kind`` (jax or torch) worker ``pid`` of ``procs``."""
    extra = ["--width", str(args.width), "--repeats", str(args.repeats), "--methods", ",".join(args.methods)]
    extra += ["--torch-methods", ",".join(args.torch_methods), "--rates", ",".join(args.rates)]
    extra += ["--calibration-mb", str(args.calibration_mb)]
    flag = "--torch-coordinator" if kind == "torch" else "--coordinator"
    return shaped_link.worker_argv(SCRIPT, args, kind, procs, pid, coord, out, extra, coordinator_flag=flag)


def launch(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Runs the ``--procs`` ``kind`` workers; returns process 0's results."""
    argv_for = functools.partial(worker_argv, args, kind, args.procs)
    return shaped_link.launch_group(args, kind, args.procs, args.timeout, argv_for)


def _all_method_names() -> list[str]:
    return list(methods(shaped_link.AnyModule(), shaped_link.AnyModule()))


def print_saved(path: str) -> None:
    """Prints the tables of a ``--json`` file (an end-to-end run's with ``bench_network_e2e.py``'s)."""
    saved = json.loads(pathlib.Path(path).read_text())
    if "e2e" in saved:
        import bench_network_e2e

        bench_network_e2e.print_e2e(saved["e2e"], saved.get("note", ""))
        return
    print_tables(saved["jax"], saved.get("torch"), saved.get("note", ""), saved.get("compute"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.methods is None:
        args.methods = _all_method_names()
    unknown = [m for m in args.methods if m not in _all_method_names()]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {_all_method_names()}")
    if args.from_json:
        print_saved(args.from_json)
        return 0
    if args.jax_worker or args.torch_worker:
        return shaped_link.run_worker(args, run_jax_worker if args.jax_worker else run_torch_worker)
    if args.coordinator is not None:  # cluster mode: this process is one of the job
        return shaped_link.run_cluster(
            args, run_jax_worker, "jax", lambda res, note: print_tables(res, None, note)
        )

    note = shaped_link.launch_note(args, args.procs)
    if not args.shape:
        args.rates = ["unshaped"]
    t0 = time.perf_counter()
    res = launch(args, "jax")
    print(f"{args.procs}-process jax runs done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    torch_res = None
    if args.torch_methods and args.procs > 1:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch not installed: no PyTorch DDP rows (pip install torch, CPU wheel)", file=sys.stderr)
        else:
            torch_res = launch(args, "torch")
            print(f"torch runs done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        saved = {"jax": res, "torch": torch_res, "note": note, "argv": sys.argv[1:]}
        pathlib.Path(args.json).write_text(json.dumps(saved))
    print_tables(res, torch_res, note)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
