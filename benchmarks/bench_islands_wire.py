"""The islands' wire: bytes per round between 3 islands, as the kernel counts them, per ``--aggregate``.

Each run is a lighthouse and 3 islands of ``examples/islands.py`` (one process
each) inside a network namespace of their own (``unshare --net``, loopback
up, optionally shaped with ``tc``). The namespace's loopback ``tx_bytes``
(``/proc/net/dev``) is read whenever a round's log line appears; bytes per
round are the counter's growth from the first round to the last, over the
rounds between (the start-up and the join are left out, the lighthouse's
heartbeats and quorums are in). With ``--separate-hosts`` the lighthouse and
each island run on a host of their own (``examples/islands_netns.py``: a
network namespace each, on a bridge, ``--rate`` shaping each host's link);
the bytes between the islands are what the islands' hosts sent less what the
lighthouse's host received (its ``eth0`` counters: Ethernet, IP and TCP
headers included), and the lighthouse's traffic is a column of its own. Beside them: the formula (a ring all-reduce of
the float32 buffer, ``2 (n - 1) / n`` of it per island, or a ring all-gather of
the records, ``(n - 1)`` records per island, plus the 4-byte vote), and the
islands' own ``sent_bytes`` (summed over the islands). With ``--rate`` the
loopback is shaped (``tbf``) and the table gives seconds per round and the
compute utilisation (inner-step seconds, stand-in ``--step-sleep`` included,
over wall seconds, from the first step to the last: start-up stalls included),
and the steady one: a period's compute (``H`` times the island's median step,
blocked on, plus its mean ``--step-sleep``: a step slowed by the round's host
work beside it counts as the step alone) over the median wall time between
its consecutive round lines, from the first round on (start-up stalls left
out).

    sudo python benchmarks/bench_islands_wire.py --hidden 16384 --aggregates mean,low_bit,sparseloco,muloco
    sudo python benchmarks/bench_islands_wire.py --hidden 16384 --separate-hosts --aggregates mean,sparseloco
    sudo python benchmarks/bench_islands_wire.py --hidden 16384 --rate 100mbit --step-sleep 0.1 \
        --aggregates mean,sparseloco
    python benchmarks/bench_islands_wire.py --secret-cost   # the secret's CPU cost per round alone

Needs root, ``unshare``, ``ip`` (and ``tc`` for ``--rate``), torch and torchft.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "islands.py"


def lo_tx() -> int:
    for line in pathlib.Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback in /proc/net/dev")


def _island_flags(args: argparse.Namespace, lighthouse: str, work: str) -> list[str]:
    """``examples/islands.py``'s flags shared by the 3 islands of one configuration."""
    flags = ["--lighthouse", lighthouse, "--min-islands", "3", "--hidden", str(args.hidden)]
    flags += ["--sync-every", str(args.sync_every), "--aggregate", args.aggregate]
    flags += [
        "--steps",
        str(args.sync_every * (args.rounds + 1)),
        "--timeout",
        "60",
        "--round-timeout",
        "300",
    ]
    flags += ["--step-sleep", str(args.step_sleep), "--timings", "--quorum-timeout", "300"]
    flags += ["--sync-delay", str(args.sync_delay), "--eval-every", str(args.eval_every)]
    if args.secret:
        secret = pathlib.Path(work, "secret")
        secret.write_bytes(os.urandom(32))
        flags += ["--secret-file", str(secret)]
    return flags


def _start(argv: list[str], err: pathlib.Path) -> subprocess.Popen:
    """``argv`` started, its standard error to ``err`` (kept with the islands' logs)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RUST_LOG": "error", "XLA_FLAGS": ""}
    with open(err, "w") as f:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=f)


def inside(args: argparse.Namespace) -> None:
    """Runs in the namespace: one configuration, one JSON line out."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if args.rate:
        subprocess.run(
            f"tc qdisc add dev lo root tbf rate {args.rate} burst 256kb latency 2s".split(), check=True
        )
    row = _run(args, "127.0.0.1:29700", lambda k, argv: argv, lambda i: "127.0.0.1", lambda: (lo_tx(), 0))
    print(json.dumps(row))


def on_hosts(args: argparse.Namespace) -> dict:
    """One configuration with the lighthouse and each island on a host of its own
    (``examples/islands_netns.py``: network namespaces on a bridge, ``--rate`` shaping each host's
    link). Bytes between the islands: what the islands' hosts sent (``eth0``'s ``tx_bytes``) less
    what the lighthouse's host received; the lighthouse's own traffic beside it."""
    sys.path.insert(0, str(ROOT / "examples"))
    import islands_netns

    if problem := islands_netns.problem():
        raise SystemExit(f"--separate-hosts: {problem}")
    with islands_netns.Hosts(4, rate=args.rate) as hosts:

        def counters() -> tuple[int, int]:
            stats = [_eth0(name) for name in hosts.names]
            lh_rx, lh_tx = stats[0]
            return sum(tx for _, tx in stats[1:]) - lh_rx, lh_rx + lh_tx

        lighthouse = f"{hosts.address(0)}:{islands_netns.LIGHTHOUSE_PORT}"
        return _run(args, lighthouse, hosts.command, lambda i: hosts.address(i + 1), counters)


def _run(args: argparse.Namespace, lighthouse: str, on_host, address, counters) -> dict:
    """The lighthouse on host 0 and island ``i`` on host ``i + 1`` (``on_host(k, argv)``: ``argv`` run
    on host ``k``; ``address(i)``: island ``i``'s ``--host``), watched until the islands end (see
    :func:`_watch`); the configuration's row."""
    work, py = tempfile.mkdtemp(), sys.executable
    serve = [py, str(EXAMPLE), "--serve-lighthouse", lighthouse, "--min-islands", "3"]
    lh = _start(on_host(0, serve), pathlib.Path(work, "lighthouse.err"))
    time.sleep(2.0)
    flags = _island_flags(args, lighthouse, work)
    logs = [pathlib.Path(work, f"island{i}.jsonl") for i in range(3)]
    procs = [
        _start(
            on_host(i + 1, [py, str(EXAMPLE), "--island-id", str(i), "--log", str(logs[i]), *flags,
                            "--host", address(i)]),
            logs[i].with_suffix(".err"),
        )
        for i in range(3)
    ]  # fmt: skip
    try:
        return _watch(args, procs, logs, counters)
    finally:
        for proc in [*procs, lh]:
            proc.kill()


def _eth0(namespace: str) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``eth0`` in ``namespace``."""
    out = subprocess.run(
        ["ip", "-n", namespace, "-s", "-j", "link", "show", "eth0"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def _watch(args: argparse.Namespace, procs: list, logs: list[pathlib.Path], counters) -> dict:
    """Reads ``counters()`` (the islands' bytes, the lighthouse's bytes) when the last island logs each
    round, until the islands end; the configuration's row."""
    seen: dict[int, tuple[int, int]] = {}  # round -> counters when its last island logged it
    while any(p.poll() is None for p in procs):
        rows = [json.loads(x) for f in logs if f.exists() for x in f.read_text().splitlines() if x]
        for r in range(1, args.rounds + 2):
            if r not in seen and sum(row.get("round") == r for row in rows) == 3:
                seen[r] = counters()
        time.sleep(0.005)
    rows = [json.loads(x) for f in logs for x in f.read_text().splitlines() if x]
    rounds = sorted(seen)
    if len(rounds) < 2:
        raise SystemExit(f"fewer than two rounds formed ({rounds}); the islands' logs: {logs}")
    first, last = rounds[0], rounds[-1]
    per_round = (seen[last][0] - seen[first][0]) / (last - first)
    lighthouse = (seen[last][1] - seen[first][1]) / (last - first)
    sent = [sum(r["sent_bytes"] for r in rows if r.get("round") == k) for k in range(first + 1, last + 1)]
    done = [r for r in rows if r.get("done")]
    steady = []  # per island: a period's compute over the median wall time between its round lines
    for d in done:
        times = sorted(
            r["time"] for r in rows if r.get("island") == d["island"] and r.get("round", 0) >= first
        )
        gaps = [b - a for a, b in zip(times, times[1:])]
        if gaps and d.get("steps_timed"):
            # the median step, blocked on (a step slowed by the round's host work beside it is not
            # compute), and --step-sleep
            per_step = d["step_median_seconds"] + d["sleep_seconds"] / d["steps_timed"]
            steady.append(args.sync_every * per_step / statistics.median(gaps))
    secs = [r["seconds"] for r in rows if r.get("round", 0) > first]
    return {
        "aggregate": args.aggregate, "secret": args.secret, "rate": args.rate, "rounds": last - first,
        "kernel_bytes_per_round": per_round, "lighthouse_bytes_per_round": lighthouse,
        "logs": str(logs[0].parent),
        "sent_bytes_per_round": sum(sent) / len(sent),
        "rejected": sum(len(r.get("rejected", [])) for r in rows),
        "round_seconds": sum(secs) / max(len(secs), 1),
        "utilisation": [d["compute_seconds"] / d["wall_seconds"] for d in done], "steady": steady,
    }  # fmt: skip


def secret_cost(aggregate: str, hidden: int, repeats: int = 20) -> dict[str, float]:
    """The secret's CPU cost per round at one island: sealing its record and opening the 3 records of a
    round (its own included) with the secret's HMAC-SHA256, against the same without a secret; the
    records of ``aggregate``'s message (the float32 mean's: its leaves) for ``--hidden``."""
    import statistics as st

    import numpy as np

    from jaxopt_dist._src.islands import wire

    layout = wire.Layout.of(_message(aggregate, hidden))
    size = wire.record_size([layout])
    rng = np.random.default_rng(0)
    message = [rng.integers(0, 255, int(np.prod(s)) * np.dtype(d).itemsize, np.uint8).view(d).reshape(s)
               for d, s in layout.specs]  # fmt: skip
    header = wire.Header(0, 1, 0, 1.0, 7, 0, 3, (1,) * 8, layout=layout.tag)
    secret = os.urandom(32)

    def one_round(key: bytes | None) -> float:
        start = time.perf_counter()
        record = wire.seal(header, message, size=size, secret=key)
        for _ in range(3):
            assert isinstance(wire.open_record(record, layouts={0: layout}, secret=key), wire.Opened)
        return time.perf_counter() - start

    with_secret = st.median(one_round(secret) for _ in range(repeats))
    without = st.median(one_round(None) for _ in range(repeats))
    return {"record": size, "with": with_secret, "without": without}


def _message(aggregate: str, hidden: int) -> list:
    """The shapes and dtypes of one island's message for ``aggregate`` (the float32 leaves for ``mean``)."""
    import jax
    import numpy as np

    from jaxopt_dist._src import base

    sys.path.insert(0, str(ROOT / "examples"))
    import islands as example

    argv = [
        "--island-id",
        "0",
        "--lighthouse",
        "127.0.0.1:1",
        "--hidden",
        str(hidden),
        "--aggregate",
        aggregate,
    ]
    setup = example.build(example.parse_args(argv))
    like = [np.zeros(x.shape, np.float32) for x in jax.tree.leaves(setup.params)]
    agg = setup.tx.external.wire
    if agg is None:
        return like
    first = {"low_bit": lambda: __import__("jaxopt_dist").low_bit(),
             "sparseloco": lambda: __import__("jaxopt_dist").chunked_top_k(64, chunk=64, bits=2),
             "muloco": lambda: base.two_stage_of(__import__("jaxopt_dist").statistical_quantize(2)).first}[aggregate]()  # fmt: skip
    return list(jax.eval_shape(agg.encode, like, first.init(like)))


def formula(aggregate: str, hidden: int, secret: bool) -> float:
    """Bytes per round over the 3 islands' links: the ring all-reduce or all-gather, and the vote."""
    from jaxopt_dist._src.islands import merge, wire
    from jaxopt_dist._src.islands.transport import ring_bytes

    n, vote = 3, ring_bytes(4, 3, gather=False)
    message = _message(aggregate, hidden)
    if aggregate == "mean" and not secret:
        size = sum(int(x.size) for x in message)
        return n * (ring_bytes(4 * (size + merge.tail_size(64)), n, gather=False) + vote)
    record = wire.record_size([wire.Layout.of(message)])
    return n * (ring_bytes(record, n, gather=True) + vote)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aggregates", default="mean,low_bit,sparseloco,muloco")
    p.add_argument("--aggregate", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=16384)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", default=None, help="shape the loopback, e.g. 100mbit")
    p.add_argument("--step-sleep", type=float, default=0.0, help="stand-in compute per inner step (s)")
    p.add_argument("--secret", action="store_true", help="run with a shared secret")
    p.add_argument(
        "--separate-hosts",
        action="store_true",
        help="the lighthouse and each island on a host of its own (examples/islands_netns.py); "
        "--rate then shapes each host's link",
    )
    p.add_argument(
        "--sync-delay", type=int, default=0, help="inner steps a round may overlap (the example's)"
    )
    p.add_argument("--eval-every", type=int, default=1, help="the example's evaluation, every R rounds")
    p.add_argument(
        "--secret-cost",
        action="store_true",
        help="only the secret's CPU cost per round (no islands, no root)",
    )
    args = p.parse_args()
    if args.aggregate is not None:
        inside(args)
        return
    if args.secret_cost:
        print(
            "| aggregate | record, bytes | seal 1 + open 3, with the secret, ms | without, ms | the secret's cost, ms/round |"
        )
        print("|---|---|---|---|---|")
        for agg in args.aggregates.split(","):
            c = secret_cost(agg, args.hidden)
            print(
                f"| {agg} | {c['record']} | {1e3 * c['with']:.2f} | {1e3 * c['without']:.2f} | "
                f"{1e3 * (c['with'] - c['without']):.2f} |",
                flush=True,
            )
        return
    print(
        "| aggregate | secret | kernel bytes/round | formula | kernel / formula | sent_bytes | lighthouse "
        "bytes/round | x fewer than mean | s/round | utilisation | steady utilisation |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mean = None
    for agg in args.aggregates.split(","):
        if args.separate_hosts:
            row = on_hosts(argparse.Namespace(**{**vars(args), "aggregate": agg}))
        else:
            cmd = ["unshare", "--net", sys.executable, __file__, *_rest(args), "--aggregate", agg]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if r.returncode:
                print(f"| {agg} | failed: {r.stderr[-300:]!r} |")
                continue
            row = json.loads(r.stdout.strip().splitlines()[-1])
        f = formula(agg, args.hidden, args.secret)
        mean = row["kernel_bytes_per_round"] if agg == "mean" else mean
        ratio = "" if mean is None or agg == "mean" else f"{mean / row['kernel_bytes_per_round']:.1f}"
        util = ", ".join(f"{u:.2f}" for u in row["utilisation"])
        lh = f"{row['lighthouse_bytes_per_round']:.0f}" if args.separate_hosts else "(in the count)"
        print(
            f"| {agg} | {args.secret} | {row['kernel_bytes_per_round']:.0f} | {f:.0f} | "
            f"{row['kernel_bytes_per_round'] / f:.3f} | {row['sent_bytes_per_round']:.0f} | "
            f"{lh} | {ratio} | {row['round_seconds']:.2f} | {util} | "
            f"{', '.join(f'{u:.2f}' for u in row['steady'])} |",
            flush=True,
        )
        print(f"{agg}: the islands' logs in {row['logs']}", file=sys.stderr, flush=True)


def _rest(args: argparse.Namespace) -> list[str]:
    out = ["--hidden", str(args.hidden), "--sync-every", str(args.sync_every), "--rounds", str(args.rounds)]
    out += ["--step-sleep", str(args.step_sleep), "--sync-delay", str(args.sync_delay)]
    out += ["--eval-every", str(args.eval_every)]
    if args.rate:
        out += ["--rate", args.rate]
    if args.secret:
        out += ["--secret"]
    return out


if __name__ == "__main__":
    main()
