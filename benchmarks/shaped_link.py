"""Harness for benchmarks over a real, shaped link: worker processes joined by gloo over TCP.

The scripts that use it (``bench_network.py``: the update table;
``bench_network_e2e.py``: time to a test accuracy) launch their own workers
through it. It imports neither JAX nor torch until a worker (or a traced
projection) asks for them, so a launcher starts light.

What it offers:

* **Link shaping.** :data:`RATES`, :func:`set_rate`, :func:`shaping_problem`;
  :func:`link_entry` makes ``enter(rate)``: every worker at the same point,
  the link at ``rate`` with its token bucket emptied (:func:`jax_link_entry`
  builds it for JAX workers).
* **Launching.** :func:`add_link_options` and :func:`check_link_options` (the
  options every such script shares), :func:`launch_note` (shapes if it can
  and says how the workers run), :func:`worker_argv`, :func:`launch_group`
  (starts the workers and returns process 0's JSON; the coordinator's port
  from :func:`free_port`), :func:`run_worker` and :func:`run_cluster` (a
  script's worker and cluster modes).
* **A JAX worker.** :func:`configure_jax` (one CPU device, and a persistent
  compilation cache only where asked for, before JAX starts), :func:`start_distributed`
  (``jax.distributed`` with gloo), :func:`world_ops` (a ``psum`` over every
  worker and rows of ones to feed it).
* **Timing.** :func:`median_time`, :func:`time_rounds` (the timings of one
  method taken in alternating rounds), :func:`time_method` (linked and
  compute-only), :func:`calibrate` (the link's small- and large-message
  all-reduce times).
* **The link model of projections.** :func:`link_model` (bandwidth and
  latency from the calibration), :func:`call_floor_us`,
  :func:`bucket_speedup` (the token bucket), :func:`projected_seconds`
  (``project_step_time`` at the calibrated link).
* **Allocator and CPUs.** :func:`tcmalloc`, :func:`resolve_malloc`,
  :func:`mapped_malloc`, :func:`malloc_note`, :func:`child_env`,
  :func:`usable_cpus`, :func:`cpu_for`, :func:`pin_note`,
  :func:`cpu_model`; and :func:`fmt_bytes`, :class:`AnyModule`.

A new script, run as ``python benchmarks/new_script.py`` (Python puts
``benchmarks/`` first on ``sys.path``, where ``import shaped_link`` finds
this file)::

    import shaped_link

    SCRIPT = pathlib.Path(__file__).resolve()

    def parse_args(argv):
        p = argparse.ArgumentParser(description="...")
        p.add_argument("--rates", default="1gbit,unshaped")
        shaped_link.add_link_options(p)
        p.add_argument("--new-worker", action="store_true", help=argparse.SUPPRESS)
        args = p.parse_args(argv)
        args.rates = args.rates.split(",")
        shaped_link.check_link_options(p, args, worker=args.new_worker)
        return args

    def run_new_worker(args):  # one process of the job
        shaped_link.configure_jax(1)
        import jax, numpy as np
        distributed = shaped_link.start_distributed(jax, args)
        world = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
        enter = shaped_link.jax_link_entry(jax, *shaped_link.world_ops(jax, np, world), args.shape)
        one_step = ...  # blocks until done
        timed = shaped_link.time_rounds([(r, r, one_step) for r in args.rates], enter, 7)
        if args.shape and jax.process_index() == 0:
            shaped_link.set_rate("unshaped")
        if distributed:
            jax.distributed.shutdown()
        return {"timed": timed, "malloc": shaped_link.mapped_malloc()}

    def main(argv=None):
        args = parse_args(argv)
        if args.new_worker:
            return shaped_link.run_worker(args, run_new_worker)
        note = shaped_link.launch_note(args, 2)
        def argv_for(pid, coord, out):
            extra = ["--rates", ",".join(args.rates)]
            return shaped_link.worker_argv(SCRIPT, args, "new", 2, pid, coord, out, extra)
        res = shaped_link.launch_group(args, "new", 2, args.timeout, argv_for)
        print(note, res)

Link shaping. The processes run in a fresh network namespace
(``unshare --net``) whose loopback is brought up and shaped with a token
bucket (``tc qdisc replace dev lo root tbf rate R burst 2mb latency 2s``; a
bucket of a few milliseconds of traffic instead with :func:`set_burst_ms`),
changed between rates by process 0 while the compiled programs are kept, so
the rates of one method are timed back to back. The loopback is one device:
every process's bytes pass the same bucket, so the wire time at rate ``R`` is
``procs * bytes_per_worker / R`` (a switched network with one ``R`` link per
worker would take ``bytes_per_worker / R``). Where ``unshare`` or ``tc`` is
not permitted (not root, no CAP_NET_ADMIN, no iproute2) :func:`launch_note`
says so and the workers run unshaped.

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
reports the allocator mapped into it (:func:`mapped_malloc`, its result's
``"malloc"``), and the note names it. On a cluster (``--coordinator``) set it
yourself.

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
"""

from __future__ import annotations

import argparse
import ctypes.util
import functools
import json
import os
import pathlib
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # this checkout's jaxopt_dist (as the workers get through PYTHONPATH)
    sys.path.insert(0, str(ROOT))

RATES: dict[str, float | None] = {"100mbit": 0.1, "1gbit": 1.0, "10gbit": 10.0, "unshaped": None}
"""Rate name (tc syntax) -> Gbit/s; None is the bare loopback."""

TC_SHAPE = "tbf rate {rate} burst {burst} latency 2s"
TBF_BURST_BYTES = 2 * 2**20
"""The token bucket's default depth: tc reads ``2mb`` as 2 MiB."""
_BURST_MS: list[float | None] = [None]  # None: TBF_BURST_BYTES at every rate


def set_burst_ms(ms: float | None) -> None:
    """Sizes the token bucket to ``ms`` milliseconds of traffic at each rate (None: 2 MiB at every rate).

    The default 2 MiB lets a message of up to 2 MiB through at loopback speed after an idle spell;
    a bucket of a few milliseconds paces every message at the rate (tc needs at least one timer
    tick of traffic: 10 ms is safe for any kernel HZ >= 100).
    """
    _BURST_MS[0] = ms


def burst_bytes(rate: str) -> int:
    """The token bucket's depth at ``rate`` (bytes)."""
    gbps, ms = RATES[rate], _BURST_MS[0]
    if ms is None or gbps is None:
        return TBF_BURST_BYTES
    return max(16 * 1024, int(gbps * 1e9 / 8 * ms / 1e3))


def tc_shape(rate: str) -> str:
    """The ``tc qdisc`` arguments that shape the loopback to ``rate``."""
    return TC_SHAPE.format(rate=rate, burst=f"{burst_bytes(rate)}b")


MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"  # --malloc hugepages (module docstring)
CLUSTER_NOTE = "cluster link (not shaped)"


class AnyModule:
    """Stands in for a module (``jd``, ``jnp``, ``optax``): every attribute is itself.

    Lets a launcher list the row names of a table of factories without
    importing JAX (the factories are not called).
    """

    def __getattr__(self, name: str) -> Any:
        return self


# ----------------------------------------------------------------------------
# Link shaping (process 0 of a namespaced run).


def set_rate(rate: str) -> None:
    """Shapes (or unshapes) this namespace's loopback; raises if tc fails."""
    if RATES[rate] is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # none: fine
        return
    cmd = ["tc", "qdisc", "replace", "dev", "lo", "root", *tc_shape(rate).split()]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def shaping_problem() -> str | None:
    """Why the loopback cannot be shaped here, or None if it can (tried in a throwaway namespace)."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (needs util-linux and iproute2)"
    probe = "ip link set lo up && tc qdisc add dev lo root " + tc_shape("1gbit")
    r = subprocess.run(["unshare", "--net", "sh", "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`unshare --net` + `tc` failed (needs root or CAP_NET_ADMIN): {r.stderr.strip()}"
    return None


def link_entry(
    shape: bool, me: int, barrier: Callable[[], Any], empty_bucket: Callable[[], Any]
) -> Callable[[str], None]:
    """``enter(rate)``: every process at the same point, the link at ``rate`` with an empty token bucket.

    ``barrier()`` joins every worker; ``empty_bucket()`` has each worker
    all-reduce a bucketful (``TBF_BURST_BYTES``). ``tc qdisc replace`` starts
    a full bucket, which would carry the next few steps unpaced (block-k at
    100 Mbit/s: 24, 28, 54 ms, then 72 ms a step, its wire time). With
    ``shape`` False (not shaping) it only joins the workers.
    """

    def enter(rate: str) -> None:
        if shape and me == 0:
            set_rate(rate)
        barrier()
        if shape and RATES[rate] is not None:
            empty_bucket()

    return enter


def jax_link_entry(
    jax: Any, psum: Callable[[Any], Any], ones: Callable[[int], Any], shape: bool
) -> Callable[[str], None]:
    """:func:`link_entry` for JAX workers, from :func:`world_ops`'s ``psum`` and ``ones``."""
    one_each, bucketful = ones(1), ones(TBF_BURST_BYTES // 4)
    return link_entry(
        shape,
        jax.process_index(),
        lambda: jax.block_until_ready(psum(one_each)),
        lambda: jax.block_until_ready(psum(bucketful)),
    )


# ----------------------------------------------------------------------------
# Timing.


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """The median of ``repeats`` calls of ``fn`` (seconds), and every call's time."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


ROUNDS = 3
"""Rounds of :func:`time_rounds`: each timing (the compute-only one, each rate) gets a share per round."""


def time_rounds(
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
            times[key] += median_time(one, share)[1]
    return {key: {"median_s": statistics.median(t), "times_s": t} for key, t in times.items()}


def time_method(
    steps: dict[str, Callable[[], None]], rates: list[str], enter: Callable[[str], None], repeats: int
) -> dict[str, Any]:
    """Compiles and times one method's ``steps["linked"]`` at each rate and ``steps["alone"]`` unlinked.

    Returns ``compile_s`` (the linked step's compile and first step),
    ``compute`` (the unlinked timing; the linked one where there is no
    ``"alone"`` step) and ``rates`` (rate -> timing), from :func:`time_rounds`.
    """
    enter("unshaped")
    t0 = time.perf_counter()
    steps["linked"]()
    compile_s = time.perf_counter() - t0
    alone = steps.get("alone", steps["linked"])
    alone()
    runs = [("compute", "unshaped", alone)] + [(rate, rate, steps["linked"]) for rate in rates]
    timed = time_rounds(runs, enter, repeats)
    return {"compile_s": compile_s, "compute": timed.pop("compute"), "rates": timed}


# ----------------------------------------------------------------------------
# JAX in a worker.


def configure_jax(devices: int) -> None:
    """One CPU device per process, set before JAX starts.

    A persistent compilation cache only when ``BENCH_NETWORK_CACHE`` names its
    directory. It is off by default because JAX 0.12.1 hangs a multi-process
    CPU job (gloo collectives) at the first collective of a program loaded
    from the cache: every process waits in ``block_until_ready`` for ever,
    while the same run with an empty cache finishes (JAX 0.10.0 runs either).
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if cache := os.environ.get("BENCH_NETWORK_CACHE"):
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def start_distributed(jax: Any, args: argparse.Namespace) -> bool:
    """gloo CPU collectives, and ``jax.distributed`` where a coordinator is given; True if started."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator is None:
        return False
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )
    return True


def world_ops(jax: Any, np: Any, world: Any) -> tuple[Callable[[Any], Any], Callable[[int], Any]]:
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


def calibrate(
    jax: Any, psum: Callable[[Any], Any], ones: Callable[[int], Any], rates: list[str], enter: Any, mb: int
) -> dict[str, dict[str, float]]:
    """Per rate: the times of a 4-byte, a 4 kB and (except at slow rates) an ``mb`` MB all-reduce."""

    def timed(x: Any, repeats: int) -> float:
        jax.block_until_ready(psum(x))
        return median_time(lambda: jax.block_until_ready(psum(x)), repeats)[0]

    tiny, small, big = ones(1), ones(1024), ones(mb * 2**18)
    link: dict[str, dict[str, float]] = {}
    for rate in rates:
        enter(rate)
        entry = {"allreduce_4B_s": timed(tiny, 30), "probe_mb": mb, "allreduce_4kB_s": timed(small, 30)}
        if RATES[rate] is None or RATES[rate] >= 1.0:
            entry["allreduce_probe_s"] = timed(big, 5)
        link[rate] = entry
    return link


# ----------------------------------------------------------------------------
# The link model of the projections.


def link_model(link: dict[str, dict[str, float]], rate: str, n: int) -> tuple[float, float]:
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


def call_floor_us(link: dict[str, dict[str, float]], rate: str) -> float:
    """The least time of one gloo call at ``rate``: the 4 kB all-reduce's time (0 if not calibrated).

    Any collective of more than one element took about 4 ms between two processes on
    one machine, against 0.09 ms for one element (RESULTS.md), so the 4-byte probe alone
    prices calls far too low on fast links.
    """
    return link[rate].get("allreduce_4kB_s", 0.0) * 1e6


def bucket_speedup(
    link: dict[str, dict[str, float]], n: int, rate: str, sent_bytes: float, compute_s: float | None
) -> float:
    """How much faster than ``rate`` the shaped loopback carries a step: its token bucket.

    ``n`` workers each send ``sent_bytes`` a step after ``compute_s`` seconds
    of compute. tbf lets a full bucket (``TBF_BURST_BYTES``) through unpaced,
    and refills it at the rate. In a step of ``c`` seconds of compute with no
    bytes in flight it regains ``rate * c`` bytes, so up to
    ``min(burst, rate * c)`` of the step's bytes (every worker's: they share
    the loopback) cross at the bare loopback's speed and only the rest at
    ``rate``. Returned as the factor by which the step's bytes cross faster
    than at ``rate``: at most the bare loopback's calibrated bandwidth over
    ``rate`` (where ``link`` has it; else 1000), and 1 where the rate is not
    shaped or the compute time is not known. A real link of that rate has no
    bucket: this models the rig.
    """
    gbps = RATES[rate]
    if gbps is None or not compute_s:
        return 1.0
    total = n * sent_bytes
    if total <= 0:
        return 1.0
    rate_bytes_s = gbps * 1e9 / 8
    credit = min(TBF_BURST_BYTES, rate_bytes_s * compute_s, total)
    cap = link_model(link, "unshaped", n)[0] * n / gbps if "unshaped" in link else 1000.0
    return min(total / max(total - credit, 1e-9), max(cap, 1.0))


def projected_seconds(
    cost: Any, link: dict[str, dict[str, float]], rate: str, n: int, algorithm: str, speedup: float = 1.0
) -> float:
    """``project_step_time`` of ``cost`` over the calibrated link at ``rate`` between ``n`` workers.

    The bandwidth is :func:`link_model`'s times ``speedup`` (e.g.
    :func:`bucket_speedup`); ``algorithm="gloo"`` also charges every call at
    least :func:`call_floor_us`.
    """
    import jaxopt_dist as jd

    gbps, lat_us = link_model(link, rate, n)
    gbps *= speedup
    floor_us = call_floor_us(link, rate) if algorithm == "gloo" else 0.0
    return float(
        jd.project_step_time(
            cost, bandwidth_gbps=gbps, latency_us=lat_us, algorithm=algorithm, call_floor_us=floor_us
        )
    )


# ----------------------------------------------------------------------------
# Allocator and CPUs.


@functools.cache  # find_library runs ldconfig; the launcher asks once per group of workers
def tcmalloc() -> str | None:
    """The tcmalloc library to preload (a name the dynamic linker finds), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def resolve_malloc(malloc: str) -> str:
    """``--malloc auto`` made concrete: tcmalloc where installed, else huge pages."""
    if malloc == "auto":
        return "tcmalloc" if tcmalloc() else "hugepages"
    if malloc == "tcmalloc" and not tcmalloc():
        raise SystemExit(
            "--malloc tcmalloc: no tcmalloc library found (Debian/Ubuntu: apt-get install "
            "libtcmalloc-minimal4); --malloc hugepages needs nothing installed"
        )
    return malloc


def mapped_malloc() -> str:
    """The allocator mapped into this process: tcmalloc, jemalloc or glibc (Linux; else unknown)."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return next((name for name in ("tcmalloc", "jemalloc") if name in maps), "glibc")


def malloc_note(malloc: str) -> str:
    """What ``--malloc`` (resolved) gave the workers, with the kernel's transparent-huge-page mode."""
    if malloc == "tcmalloc":
        return f"tcmalloc preloaded ({tcmalloc()})"
    if malloc != "hugepages":
        return "default environment"
    try:
        mode = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split()
        thp = next((m.strip("[]") for m in mode if m.startswith("[")), "unknown")
    except OSError:
        thp = "unknown"
    return f"GLIBC_TUNABLES={MALLOC_TUNABLE} (transparent huge pages: {thp})"


def child_env(malloc: str) -> dict[str, str]:
    """The workers' environment: CPU JAX, this checkout on ``PYTHONPATH``, the resolved ``--malloc``."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    if malloc == "hugepages":  # the same for both libraries' workers (module docstring)
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        env["GLIBC_TUNABLES"] = ":".join([*tunables, MALLOC_TUNABLE])
    elif malloc == "tcmalloc":
        env["LD_PRELOAD"] = " ".join(p for p in (tcmalloc(), env.get("LD_PRELOAD")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on, or None where the platform cannot say."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), for the table's note: compute differs by machine."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_for(pin: str, worker: int) -> int | None:
    """The CPU that worker number ``worker`` is pinned to under ``--pin``, or None."""
    cpus = usable_cpus()
    return None if pin != "cores" or cpus is None else cpus[worker % len(cpus)]


def pin_note(pin: str, procs: int) -> str:
    """The table's note on where the ``procs`` workers ran."""
    cpus = [cpu_for(pin, i) for i in range(procs)]
    if cpus[0] is None:
        return "workers not pinned" + ("" if pin == "none" else " (no sched_setaffinity here)")
    shared = "" if len(set(cpus)) == procs else ", some sharing a CPU"
    return f"worker i pinned to CPU {cpus}[i]{shared}"


def fmt_bytes(b: float) -> str:
    """``b`` bytes with 4 significant digits in GB, MB, kB or B (the tables' byte columns)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.4g} {unit}"
    return f"{b:.4g} B"


# ----------------------------------------------------------------------------
# Command line and launching.


def add_link_options(p: argparse.ArgumentParser) -> None:
    """The options every shaped-link script takes: shaping, timeout, cluster mode, allocator, pinning, JSON."""
    p.add_argument("--no-shape", action="store_true", help="do not shape the loopback (run unshaped)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per group of processes")
    p.add_argument("--verbose", action="store_true")
    # A process of a job: launched by the script, or by hand on a cluster.
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (cluster mode; no shaping)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
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


def check_link_options(p: argparse.ArgumentParser, args: argparse.Namespace, worker: bool) -> None:
    """Rejects (``p.error``) a cluster run without its process count and id; ``worker``: a launched worker."""
    if args.coordinator is not None and not worker:
        if args.num_processes is None or args.process_id is None:
            p.error("--coordinator needs --num-processes and --process-id")
    if args.num_processes is not None and not 0 <= (args.process_id or 0) < args.num_processes:
        p.error(f"need 0 <= --process-id < --num-processes; got {args.process_id}, {args.num_processes}")


def launch_note(args: argparse.Namespace, procs: int) -> str:
    """Decides whether to shape (sets ``args.shape``), resolves ``args.malloc``; returns the tables' note.

    Warns on stderr where shaping was wanted but is not permitted.
    """
    problem = None if args.no_shape else shaping_problem()
    args.shape = not args.no_shape and problem is None
    if args.no_shape:
        note = "loopback not shaped (--no-shape)"
    elif problem:
        note = f"SHAPING NOT PERMITTED ({problem}): every row is the bare loopback"
        print(f"warning: {note}", file=sys.stderr)
    else:
        burst = "2mb" if _BURST_MS[0] is None else f"<{_BURST_MS[0]:g} ms of R>"
        note = f"loopback shaped in a fresh network namespace: tc {TC_SHAPE.format(rate='R', burst=burst)}"
    args.malloc = resolve_malloc(args.malloc)
    return note + f"; malloc: {malloc_note(args.malloc)}; {pin_note(args.pin, procs)}; CPU: {cpu_model()}"


def worker_argv(
    script: pathlib.Path,
    args: argparse.Namespace,
    kind: str,
    procs: int,
    pid: int,
    coord: str | None,
    out: str,
    extra: list[str],
    coordinator_flag: str = "--coordinator",
) -> list[str]:
    """The command line of worker ``pid`` of ``procs``: ``script --{kind}-worker``, the script's
    ``extra`` options, then the harness's (``--json out``, the coordinator unless None, ``--shape``,
    ``--cpu`` of ``--pin``, ``--verbose``)."""
    argv = [sys.executable, str(script), f"--{kind}-worker"]
    argv += ["--num-processes", str(procs), "--process-id", str(pid), *extra, "--json", out]
    if coord is not None:
        argv += [coordinator_flag, coord]
    if args.shape:
        argv.append("--shape")
    cpu = cpu_for(args.pin, pid)
    if cpu is not None:
        argv += ["--cpu", str(cpu)]
    if args.verbose:
        argv.append("--verbose")
    return argv


_WAIT_ALL = 'rc=0\nfor p in $(jobs -p); do wait "$p" || rc=$?; done\nexit "$rc"\n'


def _group_command(
    procs: int, shape: bool, argv_for: Callable[[int, str | None, str], list[str]], out: str
) -> list[str]:
    """The command that starts the ``procs`` workers: in one fresh network namespace when ``shape``."""
    if shape:  # one namespace for the whole group: a shell in it starts every worker
        cmds = [shlex.join(argv_for(i, "127.0.0.1:12355", out)) for i in range(procs)]
        script = "ip link set lo up || exit 97\n" + "".join(f"{c} &\n" for c in cmds) + _WAIT_ALL
        return ["unshare", "--net", "sh", "-c", script]
    if procs == 1:
        return argv_for(0, None, out)  # one process: no distributed runtime, no link
    coord = f"127.0.0.1:{free_port()}"
    cmds = [shlex.join(argv_for(i, coord, out)) for i in range(procs)]
    return ["sh", "-c", "".join(f"{c} &\n" for c in cmds) + _WAIT_ALL]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_group(
    args: argparse.Namespace,
    kind: str,
    procs: int,
    timeout: float,
    argv_for: Callable[[int, str | None, str], list[str]],
) -> dict[str, Any]:
    """Starts ``procs`` workers (in one fresh network namespace when shaping) and returns process 0's JSON.

    ``argv_for(pid, coordinator, out)``: worker ``pid``'s command line
    (:func:`worker_argv`), with the coordinator's ``HOST:PORT`` (None for a
    lone unshaped worker) and the JSON file process 0 writes. Raises
    ``SystemExit`` with the workers' output when they fail or time out, or
    when tcmalloc was preloaded but the result's ``"malloc"`` is another.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = str(pathlib.Path(tmp) / "result.json")
        argv = _group_command(procs, args.shape, argv_for, out)
        # A session of its own, so a timeout (or Ctrl-C) ends every worker, not just the shell.
        proc = subprocess.Popen(
            argv,
            env=child_env(args.malloc),
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
        if proc.returncode != 0 or not pathlib.Path(out).exists():
            raise SystemExit(f"{kind} workers failed (exit {proc.returncode}):\n{stdout}\n{stderr}")
        if args.verbose:
            print(stderr, file=sys.stderr)
        res = json.loads(pathlib.Path(out).read_text())
        if args.malloc == "tcmalloc" and res["malloc"] != "tcmalloc":
            raise SystemExit(f"{kind} workers: tcmalloc was preloaded but {res['malloc']} is mapped")
        return res


def run_worker(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """A launched worker: pinned to ``--cpu`` (before JAX or torch sizes its thread pools), runs
    ``run(args)``; process 0 writes the result to ``--json``."""
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    res = run(args)
    if (args.process_id or 0) == 0 and args.json:
        pathlib.Path(args.json).write_text(json.dumps(res))
    return 0


def launch_and_show(
    args: argparse.Namespace,
    key: str,
    procs: int,
    argv_for: Callable[[int, str | None, str], list[str]],
    show: Callable[[dict[str, Any], str], None],
    *,
    timed: bool = False,
) -> int:
    """:func:`launch_group`, then ``show(res, note)``; saves ``{key: res, "note": note, "argv": ...}``
    to ``--json``. ``timed``: the note ends with the whole run's seconds."""
    note = launch_note(args, procs)
    t0 = time.perf_counter()
    res = launch_group(args, key, procs, args.timeout, argv_for)
    if timed:
        note += f"; whole run {time.perf_counter() - t0:.0f} s"
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({key: res, "note": note, "argv": sys.argv[1:]}))
    show(res, note)
    return 0


def run_cluster(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    key: str,
    show: Callable[[dict[str, Any], str], None],
) -> int:
    """Cluster mode (``--coordinator`` given by hand): this process is one of the job, unshaped and
    unpinned; process 0 prints its result with ``show(res, note)`` and saves ``{key: res, "note": note}``
    to ``--json``."""
    args.shape, args.pin = False, "none"
    res = run(args)
    if args.process_id == 0:
        show(res, CLUSTER_NOTE)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({key: res, "note": CLUSTER_NOTE}))
    return 0
