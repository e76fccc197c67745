"""Measured step time on a real link: every method, separate processes, gloo over TCP.

Each of ``--procs`` processes (default 2) starts ``jax.distributed`` on a
loopback coordinator with gloo CPU collectives and one CPU device, so every
collective crosses a real TCP connection. Each times one optimizer update of
the ResNet-18 (CIFAR) gradient shapes of ``bench_compression.py`` (11.2M
float32): compress, communicate, decompress and ``sgd(0.1, momentum=0.9)``,
as a jitted ``jax.shard_map`` over the processes' mesh, median of
``--repeats`` (>= 7) timed steps after a warm-up step, for every method of
:func:`methods`, dense all-reduce first.

Link shaping. The processes run in a fresh network namespace
(``unshare --net``) whose loopback is brought up and shaped with a token
bucket (``tc qdisc replace dev lo root tbf rate R burst 2mb latency 2s``),
changed between rates by process 0 while the compiled programs are kept, so
the rates of one method are timed back to back. The loopback is one device:
every process's bytes pass the same bucket, so the wire time at rate ``R`` is
``procs * bytes_per_worker / R`` (a switched network with one ``R`` link per
worker would take ``bytes_per_worker / R``). Where ``unshare`` or ``tc`` is
not permitted (not root, no CAP_NET_ADMIN, no iproute2) the script says so
and runs unshaped.

Memory allocator (``--malloc``). XLA:CPU allocates a step's temporaries
afresh at each call, and glibc returns large blocks to the kernel on free, so
every step pays a page fault per 4 kB of its temporaries (on this machine's
VM about 2.7 us each: 25 ms for one 38 MB buffer). By default (``auto``)
every worker, JAX and PyTorch alike, runs with tcmalloc preloaded
(``LD_PRELOAD``, where ``ctypes.util.find_library`` finds
``tcmalloc_minimal`` or ``tcmalloc``: Debian's ``libtcmalloc-minimal4``),
which keeps freed blocks for the next step, so a step faults nothing in;
where there is no tcmalloc, with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(glibc >= 2.35: transparent huge pages for large allocations, a fault per
2 MB, where the kernel's THP mode is ``madvise`` or ``always``). ``--malloc
tcmalloc`` / ``hugepages`` ask for one of them (tcmalloc missing is an
error), ``--malloc default`` keeps the environment as it is. Each worker
reports the allocator mapped into it, and the table's note names it. On a
cluster (``--coordinator``) set it yourself.

CPU pinning (``--pin``). On one machine the workers share its cores. By
default (``--pin cores``) worker ``i`` is pinned to the ``i``-th CPU it may run
on (modulo their number), before JAX or torch starts, so each worker computes
on a core of its own, as it would on a host of its own, and every thread
pool sizes itself to that core. Unpinned (``--pin none``) the kernel moves
every worker's threads over every core: a worker's multi-threaded kernels
then run on the core the other worker is computing on, and a small-message
step took 1.5x as long as pinned with no link at all (PowerSGD rank 1, 2
processes, unshaped loopback: 71 ms against 46 ms). Cluster runs
(``--coordinator``) are not pinned.

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
  both count the token bucket (:func:`_bucket_speedup`: up to 2 MiB of a
  step's bytes, refilled during its compute, cross unpaced, which a real link
  of that rate would not do); the projections are traced in the launching
  process when the table is printed, so ``--from-json`` reprints a saved run
  with the current model;
* ``gloo/meas``: ``proj gloo`` over ``s/step``.

The torch rows give ``s/step`` and ``x dense`` only.

With torch installed, PyTorch DDP (gloo, one bucket) runs on the same shapes,
processes and link with its communication hooks (``allreduce``,
``fp16_compress_hook``, ``powerSGD_hook`` rank 1 and 4) and ``SGD(0.1,
momentum=0.9)``; its step is backward of ``sum(p * g)`` (the hook runs
inside it) and ``optimizer.step()``.

``--e2e``: wall-clock time to a fixed test accuracy on digits at 100 Mbit/s,
2 processes, for dense, PowerSGD, top-k and the bf16 wire (see
:func:`run_e2e_worker`). ``--e2e --e2e-set lowcomm``: the same for dense
data-parallel AdamW, DiLoCo and Streaming DiLoCo (:func:`e2e_lowcomm_methods`;
target 97%).

Run::

    python benchmarks/bench_network.py                       # 2 processes, every rate
    python benchmarks/bench_network.py --rates 1gbit,100mbit --procs 4
    python benchmarks/bench_network.py --methods dense,powersgd_r1 --repeats 7
    python benchmarks/bench_network.py --e2e
    python benchmarks/bench_network.py --e2e --e2e-set lowcomm
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
import ctypes.util
import functools
import json
import math
import os
import pathlib
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import unittest.mock
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = pathlib.Path(__file__).resolve()
if str(ROOT) not in sys.path:  # this checkout's jaxopt_dist (as the workers get through PYTHONPATH)
    sys.path.insert(0, str(ROOT))

RATES: dict[str, float | None] = {"100mbit": 0.1, "1gbit": 1.0, "10gbit": 10.0, "unshaped": None}
"""Rate name (tc syntax) -> Gbit/s; None is the bare loopback."""

LR, MOMENTUM = 0.1, 0.9
TC_SHAPE = "tbf rate {rate} burst 2mb latency 2s"
TBF_BURST_BYTES = 2 * 2**20
"""The token bucket's depth: tc reads ``2mb`` as 2 MiB."""
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
# Link shaping (process 0 of a namespaced run).


def set_rate(rate: str) -> None:
    """Shapes (or unshapes) this namespace's loopback; raises if tc fails."""
    if RATES[rate] is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # none: fine
        return
    cmd = ["tc", "qdisc", "replace", "dev", "lo", "root", *TC_SHAPE.format(rate=rate).split()]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def shaping_problem() -> str | None:
    """Why the loopback cannot be shaped here, or None if it can (tried in a throwaway namespace)."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (needs util-linux and iproute2)"
    probe = "ip link set lo up && tc qdisc add dev lo root " + TC_SHAPE.format(rate="1gbit")
    r = subprocess.run(["unshare", "--net", "sh", "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`unshare --net` + `tc` failed (needs root or CAP_NET_ADMIN): {r.stderr.strip()}"
    return None


# ----------------------------------------------------------------------------
# Worker: one process of the job (also the --coordinator mode on a cluster).


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


ROUNDS = 3
"""Rounds of :func:`_time_rounds`: each timing (the compute-only one, each rate) gets a share per round."""


def _time_rounds(
    runs: list[tuple[str, str, Callable[[], Any]]], enter: Callable[[str], None], repeats: int
) -> dict[str, dict[str, Any]]:
    """Times each ``(key, rate, one_step)`` in turn, ``ROUNDS`` times over: median of ``repeats`` each.

    A round enters each run's rate, takes a warm-up step and then its share of
    ``repeats``, so the compute-only time and the linked times of a method are
    taken within the same minute or so, alternating: a drift of the machine's
    speed (this VM's compute varied 2x between runs of the same code) then
    moves them together instead of skewing their difference.
    """
    rounds = min(ROUNDS, repeats)
    shares = [repeats // rounds + (i < repeats % rounds) for i in range(rounds)]
    times: dict[str, list[float]] = {key: [] for key, _, _ in runs}
    for share in shares:
        for key, rate, one in runs:
            enter(rate)
            one()  # warm-up at this rate
            times[key] += _median_time(one, share)[1]
    return {key: {"median_s": statistics.median(t), "times_s": t} for key, t in times.items()}


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


def _world_ops(jax: Any, np: Any, world: Any) -> tuple[Callable[[Any], Any], Callable[[int], Any]]:
    """``psum(x)`` over ``world`` (jitted) and ``ones(k)``: a row of ``k`` float32 ones per worker."""
    P = jax.sharding.PartitionSpec
    world_n = world.shape["data"]
    world_row = jax.sharding.NamedSharding(world, P("data"))
    psum = jax.jit(
        jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=world, in_specs=P("data"), out_specs=P())
    )

    def ones(per_worker: int) -> Any:
        size = world_n * per_worker
        return jax.make_array_from_callback((size,), world_row, lambda idx: np.ones(size, np.float32)[idx])

    return psum, ones


def _calibrate(
    jax: Any, psum: Callable[[Any], Any], ones: Callable[[int], Any], rates: list[str], enter: Any, mb: int
) -> dict[str, dict[str, float]]:
    """Per rate: the times of a 4-byte, a 4 kB and (except at slow rates) an ``mb`` MB all-reduce."""

    def timed(x: Any, repeats: int) -> float:
        jax.block_until_ready(psum(x))
        return _median_time(lambda: jax.block_until_ready(psum(x)), repeats)[0]

    tiny, small, big = ones(1), ones(1024), ones(mb * 2**18)
    link: dict[str, dict[str, float]] = {}
    for rate in rates:
        enter(rate)
        entry = {"allreduce_4B_s": timed(tiny, 30), "probe_mb": mb, "allreduce_4kB_s": timed(small, 30)}
        if RATES[rate] is None or RATES[rate] >= 1.0:
            entry["allreduce_probe_s"] = timed(big, 5)
        link[rate] = entry
    return link


def _start_distributed(jax: Any, args: argparse.Namespace) -> bool:
    """gloo CPU collectives, and ``jax.distributed`` where a coordinator is given; True if started."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator is None:
        return False
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )
    return True


def _time_method(
    steps: dict[str, Callable[[], None]], rates: list[str], enter: Callable[[str], None], repeats: int
) -> dict[str, Any]:
    """Compiles and times one method's ``steps["linked"]`` at each rate and ``steps["alone"]`` unlinked.

    Returns ``compile_s`` (the linked step's compile and first step),
    ``compute`` (the unlinked timing; the linked one where there is no
    ``"alone"`` step) and ``rates`` (rate -> timing).
    """
    enter("unshaped")
    t0 = time.perf_counter()
    steps["linked"]()
    compile_s = time.perf_counter() - t0
    alone = steps.get("alone", steps["linked"])
    alone()
    runs = [("compute", "unshaped", alone)] + [(rate, rate, steps["linked"]) for rate in rates]
    timed = _time_rounds(runs, enter, repeats)
    return {"compile_s": compile_s, "compute": timed.pop("compute"), "rates": timed}


def run_jax_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Times every selected method at every rate, and with no link; returns process 0's results.

    Every process times the update twice over: on the mesh of every
    process's device (the linked run) and on a one-device mesh of its own
    (``compute``: the same update with no link, the processes side by side,
    so each has the share of the cores it has in the linked run), in
    alternating rounds (:func:`_time_rounds`).
    """
    _configure_jax(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    distributed = _start_distributed(jax, args)
    me = jax.process_index()
    world = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    alone = jax.make_mesh((1,), ("data",), devices=jax.local_devices()[:1])
    world_n = world.shape["data"]
    rates = args.rates if args.shape else ["unshaped"]
    psum, ones = _world_ops(jax, np, world)
    one_each, bucketful = ones(1), ones(TBF_BURST_BYTES // 4)

    def enter(rate: str) -> None:
        """Every process at the same point, the link at ``rate`` with an empty token bucket.

        ``tc qdisc replace`` starts a full bucket, which would carry the next
        few steps unpaced (block-k at 100 Mbit/s: 24, 28, 54 ms, then 72 ms a
        step, its wire time); each worker all-reducing a bucketful empties it.
        """
        if args.shape and me == 0:
            set_rate(rate)
        jax.block_until_ready(psum(one_each))
        if args.shape and RATES[rate] is not None:
            jax.block_until_ready(psum(bucketful))

    link = _calibrate(jax, psum, ones, rates, enter, args.calibration_mb)
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
            "sent_bytes": jd.communication_cost(tx, params, axis_size=world_n).sent_bytes,
            **_time_method(steps, rates, enter, args.repeats),
        }
        if args.verbose:
            ms = {k: round(v["median_s"] * 1e3, 1) for k, v in results[name]["rates"].items()}
            print(f"[{me}/{world_n}] {name} ms:", ms, file=sys.stderr, flush=True)
    if args.shape and me == 0:
        set_rate("unshaped")
    out = {
        "procs": world_n,
        "params": int(sum(math.prod(s) for s in shapes.values())),
        "link": link,
        "width": args.width,
        "cpus": _usable_cpus(),
        "malloc": _mapped_malloc(),
        "methods": results,
    }
    if distributed:
        jax.distributed.shutdown()
    return out


def _link_model(link: dict[str, dict[str, float]], rate: str, n: int) -> tuple[float, float]:
    """(per-worker bandwidth Gbit/s, latency us) of the link at ``rate``, from the calibration.

    Latency: the 4-byte all-reduce's time over its ``2 (n - 1)`` ring rounds.
    Bandwidth: the shaped rate shared by ``n`` senders on the one loopback;
    unshaped, what the probe all-reduce (``--calibration-mb``) achieved (its ring bytes per worker
    over its time, less the latency part).
    """
    rounds = 2 * (n - 1)
    lat_s = link[rate]["allreduce_4B_s"] / max(rounds, 1)
    gbps = RATES[rate]
    if gbps is not None:
        return gbps / n, lat_s * 1e6
    wire = 2 * (n - 1) / n * link[rate]["probe_mb"] * 2**20
    probe = link[rate]["allreduce_probe_s"]
    t = max(probe - rounds * lat_s, probe / 2)  # a noisy latency must not leave ~0 s for the bytes
    return wire * 8 / t / 1e9, lat_s * 1e6


def _call_floor_us(link: dict[str, dict[str, float]], rate: str) -> float:
    """The least time of one gloo call at ``rate``: the 4 kB all-reduce's time (0 if not calibrated).

    Any collective of more than one element took about 4 ms between two processes on
    one machine, against 0.09 ms for one element (RESULTS.md), so the 4-byte probe alone
    prices calls far too low on fast links.
    """
    return link[rate].get("allreduce_4kB_s", 0.0) * 1e6


def _bucket_speedup(res: dict[str, Any], name: str, rate: str) -> float:
    """How much faster than ``rate`` the shaped loopback carries ``name``'s step: its token bucket.

    tbf lets a full bucket (``TBF_BURST_BYTES``) through unpaced, and refills it
    at the rate. In a step of ``c`` seconds of compute with no bytes in flight
    it regains ``rate * c`` bytes, so up to ``min(burst, rate * c)`` of the
    step's bytes (every worker's: they share the loopback) cross at the bare
    loopback's speed and only the rest at ``rate``. Returned as the factor by
    which the step's bytes cross faster than at ``rate``: at most the bare
    loopback's calibrated bandwidth over ``rate`` (where this run calibrated it;
    else 1000), and 1 where the rate is not shaped or the compute time is not
    known. A real link of that rate has no bucket: this models the rig.
    """
    gbps, n = RATES[rate], res["procs"]
    compute = _compute_s(res, name)
    if gbps is None or not compute:
        return 1.0
    total = n * res["methods"][name]["sent_bytes"]
    if total <= 0:
        return 1.0
    rate_bytes_s = gbps * 1e9 / 8
    credit = min(TBF_BURST_BYTES, rate_bytes_s * compute, total)
    cap = _link_model(res["link"], "unshaped", n)[0] * n / gbps if "unshaped" in res["link"] else 1000.0
    return min(total / max(total - credit, 1e-9), max(cap, 1.0))


def traced_costs(res: dict[str, Any]) -> dict[str, Any]:
    """``communication_cost`` of every method of ``res``, traced here as the workers traced it.

    Imports JAX in this (the launching) process, after the timed runs. The
    programs are traced with ``res["procs"]`` processes, where
    ``all_reduce()`` packs its leaves on CPU (``flatten_by_default``), which
    this one process would not do.
    """
    _configure_jax(1)
    import jax
    import jax.numpy as jnp
    import optax

    import jaxopt_dist as jd

    n, table = res["procs"], methods(jd, jnp)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in resnet18_shapes(res["width"]).items()}
    costs = {}
    with unittest.mock.patch.object(jax, "process_count", lambda *a: n):
        for name in res["methods"]:
            tx = optax.chain(table[name][1](), jd.sgd(LR, momentum=MOMENTUM))
            costs[name] = jd.communication_cost(tx, params, axis_size=n)
    return costs


def projections(
    res: dict[str, Any], algorithm: str = "gloo", costs: dict[str, Any] | None = None
) -> dict[str, dict[str, float]]:
    """``project_step_time`` (communication seconds) per method and rate.

    ``costs``: :func:`traced_costs` of ``res``, traced here when not given.
    """
    import jaxopt_dist as jd

    costs = traced_costs(res) if costs is None else costs
    n = res["procs"]
    out: dict[str, dict[str, float]] = {}
    for name, cost in costs.items():
        out[name] = {}
        for rate in res["link"]:
            gbps, lat_us = _link_model(res["link"], rate, n)
            gbps *= _bucket_speedup(res, name, rate)
            floor_us = _call_floor_us(res["link"], rate) if algorithm == "gloo" else 0.0
            out[name][rate] = float(
                jd.project_step_time(
                    cost, bandwidth_gbps=gbps, latency_us=lat_us, algorithm=algorithm, call_floor_us=floor_us
                )
            )
    return out


def _configure_jax(devices: int) -> None:
    """One CPU device per process (set before JAX starts) and a persistent compilation cache."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    cache = os.environ.get(
        "BENCH_NETWORK_CACHE", str(pathlib.Path(tempfile.gettempdir()) / "bench_network_jax_cache")
    )
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


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

    bucketful = torch.ones(TBF_BURST_BYTES // 4)

    def enter(rate: str) -> None:  # as run_jax_worker's: the bucket emptied
        if args.shape and me == 0:
            set_rate(rate)
        dist.barrier()
        if args.shape and RATES[rate] is not None:
            dist.all_reduce(bucketful)

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
        per_rate = _time_rounds([(rate, rate, one) for rate in rates], enter, args.repeats)
        results[name] = {"label": TORCH_LABELS[name], "rates": per_rate, "buckets": buckets}
    if args.shape and me == 0:
        set_rate("unshaped")
    dist.destroy_process_group()
    return {"procs": n, "torch": torch.__version__, "malloc": _mapped_malloc(), "methods": results}


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
# Launcher.


MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"  # --malloc hugepages (module docstring)


@functools.cache  # find_library runs ldconfig; the launcher asks once per group of workers
def _tcmalloc() -> str | None:
    """The tcmalloc library to preload (a name the dynamic linker finds), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def _resolve_malloc(malloc: str) -> str:
    """``--malloc auto`` made concrete: tcmalloc where installed, else huge pages."""
    if malloc == "auto":
        return "tcmalloc" if _tcmalloc() else "hugepages"
    if malloc == "tcmalloc" and not _tcmalloc():
        raise SystemExit(
            "--malloc tcmalloc: no tcmalloc library found (Debian/Ubuntu: apt-get install "
            "libtcmalloc-minimal4); --malloc hugepages needs nothing installed"
        )
    return malloc


def _mapped_malloc() -> str:
    """The allocator mapped into this process: tcmalloc, jemalloc or glibc (Linux; else unknown)."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return next((name for name in ("tcmalloc", "jemalloc") if name in maps), "glibc")


def _malloc_note(malloc: str) -> str:
    """What ``--malloc`` (resolved) gave the workers, with the kernel's transparent-huge-page mode."""
    if malloc == "tcmalloc":
        return f"tcmalloc preloaded ({_tcmalloc()})"
    if malloc != "hugepages":
        return "default environment"
    try:
        mode = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split()
        thp = next((m.strip("[]") for m in mode if m.startswith("[")), "unknown")
    except OSError:
        thp = "unknown"
    return f"GLIBC_TUNABLES={MALLOC_TUNABLE} (transparent huge pages: {thp})"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _usable_cpus() -> list[int] | None:
    """The CPUs this process may run on, or None where the platform cannot say."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), for the table's note: compute differs by machine."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_for(pin: str, worker: int) -> int | None:
    """The CPU that worker number ``worker`` is pinned to under ``--pin``, or None."""
    cpus = _usable_cpus()
    return None if pin != "cores" or cpus is None else cpus[worker % len(cpus)]


def _pin_note(pin: str, procs: int) -> str:
    """The table's note on where the ``procs`` workers ran."""
    cpus = [_cpu_for(pin, i) for i in range(procs)]
    if cpus[0] is None:
        return "workers not pinned" + ("" if pin == "none" else " (no sched_setaffinity here)")
    shared = "" if len(set(cpus)) == procs else ", some sharing a CPU"
    return f"worker i pinned to CPU {cpus}[i]{shared}"


def _child_env(malloc: str) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    if malloc == "hugepages":  # the same for both libraries' workers (module docstring)
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        env["GLIBC_TUNABLES"] = ":".join([*tunables, MALLOC_TUNABLE])
    elif malloc == "tcmalloc":
        env["LD_PRELOAD"] = " ".join(p for p in (_tcmalloc(), env.get("LD_PRELOAD")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _worker_argv(
    args: argparse.Namespace, kind: str, procs: int, pid: int, coord: str, out: str
) -> list[str]:
    argv = [
        sys.executable,
        str(SCRIPT),
        f"--{kind}-worker",
        "--num-processes",
        str(procs),
        "--process-id",
        str(pid),
        "--width",
        str(args.width),
        "--repeats",
        str(args.repeats),
        "--methods",
        ",".join(args.methods),
        "--torch-methods",
        ",".join(args.torch_methods),
        "--rates",
        ",".join(args.rates),
        "--calibration-mb",
        str(args.calibration_mb),
        "--json",
        out,
    ]
    argv += ["--torch-coordinator", coord] if kind == "torch" else ["--coordinator", coord]
    if kind == "e2e":
        argv += ["--e2e-target", str(args.e2e_target), "--e2e-hidden", str(args.e2e_hidden)]
        argv += ["--e2e-batch", str(args.e2e_batch), "--e2e-max-steps", str(args.e2e_max_steps)]
        argv += ["--e2e-eval-every", str(args.e2e_eval_every), "--e2e-set", args.e2e_set]
        argv += ["--e2e-methods", ",".join(args.e2e_methods)]
    if args.shape:
        argv.append("--shape")
    cpu = _cpu_for(args.pin, pid)
    if cpu is not None:
        argv += ["--cpu", str(cpu)]
    if args.verbose:
        argv.append("--verbose")
    return argv


def launch_group(args: argparse.Namespace, kind: str, procs: int, timeout: float) -> dict[str, Any]:
    """Starts ``procs`` workers (in one fresh network namespace when shaping) and returns process 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(pathlib.Path(tmp) / "result.json")
        if args.shape:
            # One namespace for the whole group: a shell in it starts every worker.
            port = 12355
            cmds = [
                " ".join(_quote(a) for a in _worker_argv(args, kind, procs, i, f"127.0.0.1:{port}", out))
                for i in range(procs)
            ]
            script = "ip link set lo up || exit 97\n" + "".join(f"{c} &\n" for c in cmds) + _WAIT_ALL
            argv = ["unshare", "--net", "sh", "-c", script]
        else:
            port = _free_port()
            coord = f"127.0.0.1:{port}"
            if procs == 1:
                argv = _worker_argv(args, kind, 1, 0, coord, out)
                if kind == "jax":
                    i = argv.index("--coordinator")
                    del argv[i : i + 2]  # one process: no distributed runtime, no link
            else:
                cmds = [
                    " ".join(_quote(a) for a in _worker_argv(args, kind, procs, i, coord, out))
                    for i in range(procs)
                ]
                argv = ["sh", "-c", "".join(f"{c} &\n" for c in cmds) + _WAIT_ALL]
        # A session of its own, so a timeout (or Ctrl-C) ends every worker, not just the shell.
        proc = subprocess.Popen(
            argv,
            env=_child_env(args.malloc),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise SystemExit(
                f"{kind} workers stopped (timeout {timeout:.0f} s or interrupt):\n{stderr}"
            ) from None
        r = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
        if r.returncode != 0 or not pathlib.Path(out).exists():
            raise SystemExit(f"{kind} workers failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
        if args.verbose:
            print(r.stderr, file=sys.stderr)
        res = json.loads(pathlib.Path(out).read_text())
        if args.malloc == "tcmalloc" and res["malloc"] != "tcmalloc":
            raise SystemExit(f"{kind} workers: tcmalloc was preloaded but {res['malloc']} is mapped")
        return res


_WAIT_ALL = 'rc=0\nfor p in $(jobs -p); do wait "$p" || rc=$?; done\nexit "$rc"\n'


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


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
        gbps, lat_us = _link_model(res["link"], rate, n)
        extra = (
            f", {cal['probe_mb']} MB all-reduce {cal['allreduce_probe_s'] * 1e3:.1f} ms"
            if "allreduce_probe_s" in cal
            else ""
        )
        print(
            f"  link {rate}: 4-byte all-reduce {cal['allreduce_4B_s'] * 1e6:.0f} us, "
            f"4 kB all-reduce {_call_floor_us(res['link'], rate):.0f} us{extra}; "
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
                f"| {name} | {meas:.3f} | {dense / meas:.2f} | {_fmt_bytes(r['sent_bytes'])} | {wire} | "
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


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.4g} {unit}"
    return f"{b:.4g} B"


# ----------------------------------------------------------------------------


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
    p.add_argument("--no-shape", action="store_true", help="do not shape the loopback (run unshaped)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per group of processes")
    p.add_argument("--e2e", action="store_true", help="time to a test accuracy on digits at 100 Mbit/s")
    p.add_argument("--verbose", action="store_true")
    # A process of a job: launched by this script, or by hand on a cluster.
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (cluster mode; no shaping)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--jax-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--e2e-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--e2e-target", type=float, default=None, help="test accuracy to reach (--e2e; 0.9, lowcomm set 0.97)"
    )
    p.add_argument("--e2e-hidden", type=int, default=512, help="hidden width of the --e2e MLP")
    p.add_argument("--e2e-batch", type=int, default=128, help="global batch of the --e2e run")
    p.add_argument("--e2e-max-steps", type=int, default=600)
    p.add_argument("--e2e-eval-every", type=int, default=10)
    p.add_argument(
        "--e2e-set",
        choices=("default", "lowcomm"),
        default="default",
        help="--e2e rows: default (dense, PowerSGD, top-k, bf16 with SGD) or lowcomm (dense AdamW, DiLoCo)",
    )
    p.add_argument("--e2e-methods", default="", help="comma-separated rows of the --e2e set (default: all)")
    p.add_argument("--torch-coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--malloc",
        choices=("auto", "tcmalloc", "hugepages", "default"),
        default="auto",
        help="auto (default): tcmalloc where installed, else hugepages; tcmalloc: every worker (JAX and "
        f"torch) runs with tcmalloc preloaded; hugepages: with GLIBC_TUNABLES={MALLOC_TUNABLE}, "
        "transparent huge pages for large allocations; default: the environment as is",
    )
    p.add_argument(
        "--pin",
        choices=("cores", "none"),
        default="cores",
        help="cores (default): worker i runs on the i-th usable CPU only (one core per worker, as on "
        "hosts of their own); none: the kernel schedules every worker on every core",
    )
    p.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write process 0's results to this JSON file")
    p.add_argument("--from-json", default=None, help="print the tables of a saved --json file and exit")
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
    args.e2e_methods = [m for m in args.e2e_methods.split(",") if m]
    if args.e2e_target is None:
        args.e2e_target = 0.97 if args.e2e_set == "lowcomm" else 0.9
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.procs < 1:
        p.error("--procs must be >= 1")
    worker = args.jax_worker or args.torch_worker or args.e2e_worker
    if args.coordinator is not None and not worker:
        if args.num_processes is None or args.process_id is None:
            p.error("--coordinator needs --num-processes and --process-id")
    if args.num_processes is not None and not 0 <= (args.process_id or 0) < args.num_processes:
        p.error(f"need 0 <= --process-id < --num-processes; got {args.process_id}, {args.num_processes}")
    return args


def _all_method_names() -> list[str]:
    class _Any:
        def __getattr__(self, name: str) -> Any:
            return self

    return list(methods(_Any(), _Any()))


def _e2e_names(args: argparse.Namespace) -> list[str]:
    class _Any:
        def __getattr__(self, name: str) -> Any:
            return self

    return list(e2e_rows(args, _Any(), _Any(), _Any()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.methods is None:
        args.methods = _all_method_names()
    unknown = [m for m in args.methods if m not in _all_method_names()]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {_all_method_names()}")
    known = _e2e_names(args)
    unknown = [m for m in args.e2e_methods if m not in known]
    if unknown:
        raise SystemExit(f"--e2e-methods: unknown {unknown}; known in --e2e-set {args.e2e_set}: {known}")

    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        if "e2e" in saved:
            print_e2e(saved["e2e"], saved.get("note", ""))
            return 0
        print_tables(saved["jax"], saved.get("torch"), saved.get("note", ""), saved.get("compute"))
        return 0
    if args.jax_worker or args.torch_worker or args.e2e_worker:
        if args.cpu is not None:  # before JAX or torch sizes its thread pools
            os.sched_setaffinity(0, {args.cpu})
        run = run_jax_worker if args.jax_worker else run_torch_worker if args.torch_worker else run_e2e_worker
        res = run(args)
        if (args.process_id or 0) == 0 and args.json:
            pathlib.Path(args.json).write_text(json.dumps(res))
        return 0

    if args.coordinator is not None:  # cluster mode: this process is one of the job
        args.shape, args.pin = False, "none"
        res = run_jax_worker(args)
        if args.process_id == 0:
            print_tables(res, None, "cluster link (not shaped)")
            if args.json:
                saved = {"jax": res, "note": "cluster link (not shaped)"}
                pathlib.Path(args.json).write_text(json.dumps(saved))
        return 0

    problem = None if args.no_shape else shaping_problem()
    args.shape = not args.no_shape and problem is None
    if args.no_shape:
        note = "loopback not shaped (--no-shape)"
    elif problem:
        note = f"SHAPING NOT PERMITTED ({problem}): every row is the bare loopback"
        print(f"warning: {note}", file=sys.stderr)
    else:
        note = f"loopback shaped in a fresh network namespace: tc {TC_SHAPE.format(rate='R')}"
    args.malloc = _resolve_malloc(args.malloc)
    note += f"; malloc: {_malloc_note(args.malloc)}; {_pin_note(args.pin, args.procs)}; CPU: {_cpu_model()}"
    if not args.shape:
        args.rates = ["unshaped"]
    if args.e2e:
        return run_e2e(args, note)
    t0 = time.perf_counter()
    res = launch_group(args, "jax", args.procs, args.timeout)
    print(f"{args.procs}-process jax runs done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    torch_res = None
    if args.torch_methods and args.procs > 1:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch not installed: no PyTorch DDP rows (pip install torch, CPU wheel)", file=sys.stderr)
        else:
            torch_res = launch_group(args, "torch", args.procs, args.timeout)
            print(f"torch runs done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        saved = {"jax": res, "torch": torch_res, "note": note, "argv": sys.argv[1:]}
        pathlib.Path(args.json).write_text(json.dumps(saved))
    print_tables(res, torch_res, note)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    return 0


# ----------------------------------------------------------------------------
# End to end: wall-clock time to a test accuracy.


E2E_RATE = "100mbit"


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


def run_e2e_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Trains a 64-H-H-10 tanh MLP on digits until the test accuracy reaches the target, per method.

    The clock runs only around the training steps (the first step, which
    compiles, runs unshaped and is not counted; the test accuracy is read
    every ``--e2e-eval-every`` steps with the clock stopped).
    """
    _configure_jax(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    _start_distributed(jax, args)
    me = jax.process_index()
    mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    n = mesh.shape["data"]
    sys.path.insert(0, str(HERE))
    import _common  # after _configure_jax: keeps this process's one device

    x_train, y_train, x_test, y_test = _common.load_digits(0)
    h = args.e2e_hidden
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
        idx = np.random.default_rng([1, t]).integers(0, len(x_train), size=args.e2e_batch)
        return {"x": x_train[idx], "y": y_train[idx]}

    shaped = args.shape
    rate = E2E_RATE if shaped else "unshaped"
    results: dict[str, Any] = {}
    rows = e2e_rows(args, jd, jnp, optax)
    for name, (label, make, per_worker) in rows.items():
        if args.e2e_methods and name not in args.e2e_methods:
            continue
        tx = make()
        step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=per_worker)
        if shaped and me == 0:
            set_rate("unshaped")
        params, state = step.init(params0)
        jax.block_until_ready(step(params, state, batch_at(0)))  # compile; result dropped
        if shaped and me == 0:
            set_rate(rate)
        jax.block_until_ready(step(params, state, batch_at(0))[2])  # both processes pass here
        clock, t, acc, times = 0.0, 0, 0.0, []
        while t < args.e2e_max_steps:
            t0 = time.perf_counter()
            params, state, metrics = step(params, state, batch_at(t))
            jax.block_until_ready(metrics)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - t0)
            clock += times[-1]
            t += 1
            if t % args.e2e_eval_every == 0:
                model = state.anchor if per_worker else params  # per-worker rows: the global parameters
                p_host = {k: np.asarray(v) for k, v in model.items()}
                acc = float(accuracy(p_host, x_test, y_test))
                if acc >= args.e2e_target:
                    break
        cost = jd.communication_cost(tx, params0, axis_size=n)
        results[name] = {
            "label": label,
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
    if shaped and me == 0:
        set_rate("unshaped")
    if args.coordinator is not None:
        jax.distributed.shutdown()
    n_params = sum(v.size for v in params0.values())
    return {
        "procs": n,
        "rate": rate,
        "params": int(n_params),
        "hidden": h,
        "target": args.e2e_target,
        "set": args.e2e_set,
        "batch": args.e2e_batch,
        "eval_every": args.e2e_eval_every,
        "malloc": _mapped_malloc(),
        "methods": results,
    }


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
            f"{r['s_per_step']:.4f} | {_fmt_bytes(r['sent_bytes'])} |"
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
            f"{_fmt_bytes(r['sent_bytes'])} | {_fmt_bytes(r['peak_sent_bytes'])} |"
        )


def run_e2e(args: argparse.Namespace, note: str) -> int:
    res = launch_group(args, "e2e", 2, args.timeout)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"e2e": res, "note": note, "argv": sys.argv[1:]}))
    print_e2e(res, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
