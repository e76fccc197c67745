"""Two-level clusters: bytes on the slow link, step time against flat dense, FSDP memory per device.

Network part (needs root, ``ip`` and ``tc``): two "hosts" are two network
namespaces joined by a veth pair, each end shaped to each of ``--rate``
(default 1 Gbit/s, 100 Mbit/s and unshaped, switched round by round) with a token bucket (``tc qdisc ... tbf``). One process runs in
each namespace with ``--local-devices`` CPU devices (default 2), on the mesh
``("dcn", "ici") = (2 processes, local devices)``: ``"dcn"`` is the process
axis, whose traffic crosses the veth pair; ``"ici"`` stays inside a process.
(XLA:CPU runs every cross-device collective of a ``jax.distributed`` job
through gloo over TCP, also between two devices of one process: with one
shaped loopback, as in ``unshare --net`` alone, the fast-axis traffic would
cross the shaped link too. Each process's own address resolves to its
namespace, so its gloo pairs between local devices go over that namespace's
unshaped loopback.) For each method the processes train the same MLP with
``data_parallel_step(axis_name=("dcn", "ici"))``, interleaved round by round,
and read the veth and loopback byte counters (``/proc/net/dev`` of their
namespace) around the timed steps.

Memory part (8 simulated CPU devices in one process, mesh 2 x 4): per-device
bytes of parameters and optimizer state with the parameters replicated
against sharded over ``"ici"`` (FSDP: ``data_parallel_step(..., axis_name="dcn",
param_specs=..., batch_axes="ici")``; the compiler all-gathers the parameters
for the forward pass and reduce-scatters the gradients over ``"ici"``, and
PowerSGD compresses over ``"dcn"``).

    sudo python benchmarks/bench_hierarchical.py [--quick] [--rate 1gbit,100mbit,none]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXES = ("dcn", "ici")
NAMESPACES = ("jdh_a", "jdh_b")
VETHS = ("jdva", "jdvb")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
METHODS = ("flat_dense", "hier_dense", "flat_powersgd", "hier_powersgd")
LABELS = {
    "flat_dense": "flat dense all-reduce over (dcn, ici)",
    "hier_dense": "hierarchical: dense ici, dense dcn",
    "flat_powersgd": "flat PowerSGD r4 over (dcn, ici)",
    "hier_powersgd": "hierarchical: dense ici, PowerSGD r4 dcn",
}


def build_tx(name: str, rank: int, lr: float):
    import optax

    import jaxopt_dist as jd

    stages = {
        "flat_dense": lambda: jd.all_reduce(axis_name=AXES),
        "hier_dense": lambda: jd.hierarchical(None, jd.all_reduce(axis_name="dcn"), axis_name=AXES),
        "flat_powersgd": lambda: jd.powersgd(rank, axis_name=AXES),
        "hier_powersgd": lambda: jd.hierarchical(None, jd.powersgd(rank, axis_name="dcn"), axis_name=AXES),
    }
    return optax.chain(stages[name](), jd.sgd(lr, momentum=0.9))


def counters(*devs: str) -> dict[str, tuple[int, int]]:
    """(rx, tx) bytes of network devices in this process's namespace."""
    out = {}
    for line in pathlib.Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, rest = line.split(":", 1)
        fields = rest.split()
        if name.strip() in devs:
            out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


# ----------------------------------------------------------------------------
# Worker: one process of the two-host job.


def worker(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=2, process_id=args.process_id
    )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, args.local_devices), AXES)
    veth = VETHS[args.process_id]

    rng = np.random.default_rng(0)  # the same on both processes
    d_in, hidden, classes, batch = args.d_in, args.hidden, 10, 16 * 2 * args.local_devices
    params0 = {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }
    centers = rng.standard_normal((classes, d_in)).astype(np.float32)

    def batch_at(t: int):
        r = np.random.default_rng(1000 + t)
        y = r.integers(0, classes, batch).astype(np.int32)
        return {"x": centers[y] + r.standard_normal((batch, d_in)).astype(np.float32), "y": y}

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None])
        logits = h @ p["w2"] + p["b2"][None]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    sizes = {"dcn": 2, "ici": args.local_devices}
    rates = args.rate.split(",")
    runs: dict = {}
    results: dict = {rate: {} for rate in rates}
    for name in METHODS:
        tx = build_tx(name, args.rank, 0.05)
        step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, axis_name=AXES)
        p, s = step.init(params0)
        for t in range(args.warmup):
            p, s, m = step(p, s, batch_at(t))
        jax.block_until_ready(p)
        runs[name] = [step, p, s]
        cost = jd.communication_cost(tx, params0, num_workers=sizes, axis_name=AXES)
        per_axis = {repr(k): v.sent_bytes for k, v in cost.by_axis().items()}
        for rate in rates:
            results[rate][name] = {"seconds": [], "veth": [], "lo": [], "per_axis": per_axis, "steps": 0}
    t = args.warmup
    for _ in range(args.rounds):
        for rate, name in [(rate, name) for rate in rates for name in METHODS]:
            if name == METHODS[0]:
                set_rate(veth, rate)  # each process shapes its own end (egress)
            step, p, s = runs[name]
            before, t0 = counters(veth, "lo"), time.perf_counter()
            for _ in range(args.steps):
                p, s, m = step(p, s, batch_at(t))
                t += 1
            jax.block_until_ready((p, s, m))
            elapsed, after = time.perf_counter() - t0, counters(veth, "lo")
            runs[name][1:] = [p, s]
            r = results[rate][name]
            r["seconds"].append(elapsed / args.steps)
            r["veth"].append(sum(after[veth]) - sum(before[veth]))  # this end's rx + tx
            r["lo"].append(after["lo"][1] - before["lo"][1])
            r["steps"] += args.steps
            r["loss"] = float(m["loss"])
    for name in METHODS:
        p = runs[name][1]
        shards = [np.asarray(sh.data).tobytes() for x in jax.tree.leaves(p) for sh in x.addressable_shards]
        per_leaf = len(shards) // len(jax.tree.leaves(p))
        for rate in rates:
            results[rate][name]["replicas_identical"] = all(
                shards[i] == shards[i - i % per_leaf] for i in range(len(shards))
            )
            results[rate][name]["param_digest"] = hashlib.sha256(b"".join(shards[::per_leaf])).hexdigest()
    print("RESULT " + json.dumps({"process": args.process_id, "results": results}), flush=True)
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------
# Parent: namespaces, shaping, launch, table.


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def set_rate(dev: str, rate: str) -> None:
    """Shapes this namespace's end of the link (``"none"``: no qdisc)."""
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate != "none":
        _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "2mb", "latency", "2s")


def setup_network(rate: str) -> None:
    teardown_network()
    a, b = NAMESPACES
    _sh("ip", "netns", "add", a)
    _sh("ip", "netns", "add", b)
    _sh("ip", "link", "add", VETHS[0], "netns", a, "type", "veth", "peer", "name", VETHS[1], "netns", b)
    for ns, dev, addr in zip(NAMESPACES, VETHS, ADDRESSES):
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate != "none":
            tbf = ("root", "tbf", "rate", rate, "burst", "2mb", "latency", "2s")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *tbf)


def teardown_network() -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_network(args: argparse.Namespace) -> dict | None:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc") and shutil.which("unshare")):
        print("network part skipped: needs root, ip, tc and unshare (network namespaces)")
        return None
    setup_network(args.rate.split(",")[0])
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        host = socket.gethostname()
        port = 12000 + os.getpid() % 1000
        procs = []
        for i, (ns, addr) in enumerate(zip(NAMESPACES, ADDRESSES)):
            hosts = tmp / f"hosts{i}"
            hosts.write_text(f"127.0.0.1 localhost\n{addr} {host}\n")
            cmd = [
                sys.executable, __file__, "--worker", "--process-id", str(i),
                "--coordinator", f"{ADDRESSES[0]}:{port}", "--local-devices", str(args.local_devices),
                "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                "--rank", str(args.rank), "--d-in", str(args.d_in), "--hidden", str(args.hidden),
            ]  # fmt: skip
            inner = f"mount --bind {hosts} /etc/hosts && exec " + " ".join(cmd)
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, "unshare", "--mount", "sh", "-c", inner],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    finally:
        teardown_network()
        shutil.rmtree(tmp, ignore_errors=True)
    results = []
    for (out, err), p in zip(outs, procs):
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not lines:
            raise SystemExit(f"worker failed (rc {p.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :])["results"])
    return {"a": results[0], "b": results[1]}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def print_network(res: dict, args: argparse.Namespace) -> None:
    for rate in args.rate.split(","):
        print_rate(res["a"][rate], res["b"][rate], rate, args)


def print_rate(a: dict, b: dict, rate: str, args: argparse.Namespace) -> None:
    L = args.local_devices
    print(
        f"\n2 processes x {L} CPU devices, mesh (dcn=2, ici={L}), veth "
        + ("unshaped" if rate == "none" else f"shaped to {rate} (tbf)")
        + f", MLP {args.d_in}-{args.hidden}-10, {args.rounds} rounds x {args.steps} steps, interleaved\n"
    )
    print("| method | bytes on the slow link per step | accounting: per worker over dcn | "
          "loopback (ici) per step | step time | vs flat dense |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for name in METHODS:
        # Each end counts rx + tx; every byte crossing the link is counted at both ends.
        link = sum(_median([x / args.steps for x in r[name]["veth"]]) for r in (a, b)) / 2
        lo = sum(_median([x / args.steps for x in r[name]["lo"]]) for r in (a, b))
        sec = max(_median(r[name]["seconds"]) for r in (a, b))
        base = sec if base is None else base
        pa = a[name]["per_axis"]
        dcn = sum(v for k, v in pa.items() if "dcn" in k)
        ok = a[name]["replicas_identical"] and b[name]["replicas_identical"]
        same = a[name]["param_digest"] == b[name]["param_digest"]
        print(
            f"| {LABELS[name]} | {link / 1e3:,.1f} kB | {dcn / 1e3:,.1f} kB | {lo / 1e3:,.1f} kB | "
            f"{sec * 1e3:.1f} ms | {base / sec:.2f}x |" + ("" if ok and same else " replicas differ!")
        )


# ----------------------------------------------------------------------------
# FSDP memory per device.


def run_memory(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    P = jax.sharding.PartitionSpec
    H, L = 2, 4
    mesh = jax.make_mesh((H, L), AXES, devices=jax.devices()[:8])
    rng = np.random.default_rng(0)
    d_in, hidden = args.d_in, args.hidden
    params0 = {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "w2": (rng.standard_normal((hidden, 16)) / np.sqrt(hidden)).astype(np.float32),
    }
    x = rng.standard_normal((64, d_in)).astype(np.float32)
    y = (x @ rng.standard_normal((d_in, 16)) / np.sqrt(d_in)).astype(np.float32)
    batch = {"x": x, "y": y}

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    tx = optax.chain(jd.powersgd(args.rank, axis_name="dcn"), jd.sgd(0.05, 0.9))

    def device_bytes(tree) -> dict:
        out: dict = {}
        for leaf in jax.tree.leaves(tree):
            for sh in leaf.addressable_shards:
                out[sh.device] = out.get(sh.device, 0) + sh.data.nbytes
        return out

    def train(step):
        p, s = step.init(params0)
        losses = []
        for _ in range(args.fsdp_steps):
            p, s, m = step(p, s, batch)
            losses.append(float(m["loss"]))
        return p, s, losses

    # Replicated parameters over the 8 devices (PowerSGD over "dcn", each "ici" device a copy) ...
    rep = train(jd.data_parallel_step(loss_fn, tx, mesh=mesh, axis_name="dcn"))
    # ... and FSDP: "ici" a model axis the parameters, their state and the batch are split over.
    specs = {"w1": P(None, "ici"), "w2": P("ici", None)}
    fsdp_step = jd.data_parallel_step(
        loss_fn, tx, mesh=mesh, axis_name="dcn", param_specs=specs, batch_axes="ici"
    )
    fsdp = train(fsdp_step)

    n_params = sum(v.size for v in params0.values())
    print(
        f"\nFSDP on a (dcn=2, ici=4) mesh of 8 CPU devices: MLP {d_in}-{hidden}-16 "
        f"({n_params:,} parameters), PowerSGD r{args.rank} over dcn + SGD momentum, "
        '`data_parallel_step(..., axis_name="dcn")` without and with `param_specs`\n'
    )
    print("| layout | params per device | optimizer state per device | loss step 1 -> "
          f"{args.fsdp_steps} |")  # fmt: skip
    print("|---|---:|---:|---|")
    for label, (p, s, losses) in (
        ("replicated", rep),
        ('sharded over "ici" (`param_specs`, `batch_axes="ici"`)', fsdp),
    ):
        pb, sb = device_bytes(p), device_bytes(s)
        pvals, svals = sorted(set(pb.values())), sorted(set(sb.values()))
        fmt = lambda vals: " / ".join(f"{v / 1e3:,.1f} kB" for v in vals)  # noqa: E731
        print(f"| {label} | {fmt(pvals)} | {fmt(svals)} | {losses[0]:.4f} -> {losses[-1]:.4f} |")
    state_specs = jax.tree.map(lambda x: str(x.sharding.spec), fsdp_step.abstract_init(params0)[1])
    print("\nstate layout (sharded):", state_specs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-only", action="store_true", help="only the FSDP memory part")
    ap.add_argument("--network-only", action="store_true", help="only the network part")
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local-devices", type=int, default=2)
    ap.add_argument(
        "--rate",
        default="1gbit,100mbit,none",
        help="tc tbf rates of the slow link, comma-separated, interleaved round by round ('none': unshaped)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--d-in", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--fsdp-steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup, args.d_in, args.hidden, args.fsdp_steps = 2, 1, 1, 64, 128, 2
    if args.worker:
        worker(args)
        return 0
    if args.memory_only:
        run_memory(args)
        return 0
    res = run_network(args)
    if res is not None:
        print_network(res, args)
    if args.network_only:
        return 0
    # The memory part in a process of its own (8 simulated devices).
    subprocess.run(
        [sys.executable, __file__, "--memory-only", "--rank", str(args.rank), "--d-in", str(args.d_in),
         "--hidden", str(args.hidden), "--fsdp-steps", str(args.fsdp_steps)],
        check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
