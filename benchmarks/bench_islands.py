"""Islands: DiLoCo across jobs that die and rejoin: detection, healing, utilization, a chaos soak, torchft's DiLoCo.

Every island is a process of its own (examples/islands.py: the digits MLP, one JAX job each),
started with torchft's lighthouse on loopback by examples/islands_chaos.py's ``Cluster``; faults
are real signals. Five measurements, each printing a table:

1. **Detection**: from a fault of island 2 to the survivors' (islands 0 and 1) next committed
   round that leaves it out, for a SIGKILL during inner steps, a SIGKILL as it enters a round's
   all-reduce (``--die-in-exchange-after``), a SIGSTOP (4 s) during inner steps and one inside the
   all-reduce (``--stop-in-exchange-after``); and whether the survivors lost a round.
2. **Healing** the 4.9M-parameter byte-level GPT's island state (``benchmarks/_islands_heal.py``):
   seconds of the quorum in which a lagging island heals from a peer, and the bytes.
3. **Utilization**: the islands' inner-step compute time over wall time (``--timings``), without
   an exchange, with one (``sync_delay`` 0 and 1), and through a fault inside the exchange.
4. **Chaos soak**: ``--soak`` random kills, stops and restarts (islands_chaos.random_faults)
   against a fault-free run of the same length and seed.
5. **torchft's own DiLoCo** (``benchmarks/_islands_torchft_diloco.py``) under the same fault
   (a replica SIGKILLs itself entering a round's all-reduce): rounds the survivors lose.
6. **Separate hosts** (``--only hosts``; root): three islands on three hosts and the lighthouse on
   a fourth, network namespaces on a bridge (``examples/islands_netns.py``), fault-free and through
   ``--hosts-repeats`` times (a SIGKILL, a restart 2 s later, a 4 s SIGSTOP of another island):
   hangs, divergent anchors, heals of the restarted and resumed islands, and the longest wait of
   each kind the islands logged against its bound.

    python benchmarks/bench_islands.py [--quick] [--json PATH]
    python benchmarks/bench_islands.py --only soak --aggregate sparseloco --secret  # the soak over the encoded, authenticated wire

Timings are wall-clock on whatever machine runs this, with the islands, the lighthouse and this
driver sharing its cores; ``--step-sleep`` (0.05 s) stands in for each inner step's accelerator
work (the MLP's own step takes about 1 ms), so that a round's cost is seen against a step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import islands_chaos as chaos  # noqa: E402
import islands_netns as netns  # noqa: E402

SYNC_EVERY = 10
STEP_SLEEP = 0.05
TIMEOUT = 2.0  # seconds an all-reduce or heal may take (examples/islands.py's default)
HEARTBEAT_S = 2.0  # the lighthouse's heartbeat timeout (islands_chaos's default)
STOP_S = 4.0  # a SIGSTOP lasts longer than the heartbeat timeout
COMMON = [
    "--sync-every",
    str(SYNC_EVERY),
    "--step-sleep",
    str(STEP_SLEEP),
    "--timeout",
    str(TIMEOUT),
    "--quorum-timeout",
    "60",
]
FOREVER = "1000000"
JOIN_TIMEOUT_MS = (
    1000  # the lighthouse's wait for live islands that have not asked (set by --join-timeout-ms)
)
# The healing measurement needs the sources to commit rounds while the healer, alive, sits out: with the
# transport renewing its quorum request every 0.5 s, only a join timeout shorter than that lets them.
HEAL_JOIN_TIMEOUT_MS = 200  # --steps for a cluster that runs until torn down


# ----------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def wait_for(pred: Any, timeout: float, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    return None


def teardown(c: chaos.Cluster) -> None:
    for p in c.procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    c.stop_lighthouse()


def load() -> float:
    return round(os.getloadavg()[0], 2)


def med_max(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.2f} / {max(xs):.2f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- 1. detection


def _rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "round" in r]


def _steady(c: chaos.Cluster, since: float, timeout: float = 90.0) -> bool:
    """A round of all three islands committed after ``since`` (island 0's log)."""

    def ok() -> bool:
        full = {
            r["round"]
            for r in _rounds(read_rows(c.log_path(0)))
            if r["time"] > since and len(r["participants"]) == 3
        }
        return len(full) >= 1

    return bool(wait_for(ok, timeout))


def _after_next_round(c: chaos.Cluster, rng: random.Random) -> None:
    """Returns a random moment into the inner steps after the next round island 0 commits."""
    last = max((r["round"] for r in _rounds(read_rows(c.log_path(0)))), default=-1)
    wait_for(
        lambda: max((r["round"] for r in _rounds(read_rows(c.log_path(0)))), default=-1) > last, 30, 0.01
    )
    time.sleep(rng.uniform(0.1, 0.35))


def _fault_line(c: chaos.Cluster, since: float, timeout: float = 60.0) -> dict[str, Any] | None:
    def got():
        return next((r for r in read_rows(c.log_path(2)) if "fault" in r and r["time"] > since), None)

    return wait_for(got, timeout)


def _detected(c: chaos.Cluster, t_fault: float, timeout: float = 60.0) -> dict[str, Any] | None:
    """The survivors' first round committed after ``t_fault`` without island 2, with what they lost."""

    def got():
        every = [r for s in (0, 1, 2) for r in _rounds(read_rows(c.log_path(s)))]
        before = [r for r in every if r["time"] <= t_fault]
        last = max((r["round"] for r in before), default=-1)  # the last round committed before the fault
        members = next((r["participants"] for r in before if r["round"] == last), [])
        per = {}
        for s in (0, 1):
            rows = _rounds(read_rows(c.log_path(s)))
            hit = next((r for r in rows if r["time"] > t_fault and "2" not in r["participants"]), None)
            if hit is None:
                return None
            between = {r["round"]: r for r in rows if last < r["round"] <= hit["round"]}
            if str(s) in members:  # a survivor in step at the fault: rounds it missed, or healed in
                lost = (hit["round"] - last) - len(between) + sum(1 for r in between.values() if r["healed"])
            else:
                lost = None  # already behind (left out of the last round before the fault)
            per[s] = (hit, lost)
        if per[0][0]["round"] != per[1][0]["round"]:
            return None
        hits = [h for h, _ in per.values()]
        lost = [n for _, n in per.values() if n is not None]
        return {
            "round": hits[0]["round"],
            "t_commit": max(h["time"] for h in hits),
            "round_seconds": max(h["seconds"] for h in hits),
            "redone": max(h["redone"] for h in hits),
            "lost": max(lost, default=0),
            "behind_at_fault": sum(1 for _, n in per.values() if n is None),
        }

    return wait_for(got, timeout)


def detection(repeats: int, workdir: str, kinds: list[str]) -> dict[str, Any]:
    """Faults of island 2 in turn (``kinds`` x ``repeats``); island 2 is restarted or resumes after each."""
    rng = random.Random(0)
    c = chaos.Cluster(workdir, island_args=[*COMMON, "--steps", FOREVER], join_timeout_ms=JOIN_TIMEOUT_MS)
    plan = kinds * repeats
    flags = {
        "exchange-kill": ["--die-in-exchange-after", "3"],
        "exchange-stop": ["--stop-in-exchange-after", "3"],
    }
    flags["exchange-stop"] += ["--stop-seconds", str(STOP_S)]
    c.start_lighthouse()
    for i in range(3):
        c.start(i, flags.get(plan[0], []) if i == 2 else [])
    events, started = [], time.monotonic()
    load0 = load()
    try:
        if not _steady(c, 0.0):
            raise RuntimeError("the islands never formed a round of three")
        for k, kind in enumerate(plan):
            nxt = plan[k + 1] if k + 1 < len(plan) else None
            fault_round = None
            if kind in ("kill", "stop"):
                _after_next_round(c, rng)
                t_fault = time.time()
                c.signal(2, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            else:
                line = _fault_line(c, events[-1]["t_fault"] if events else 0.0)
                if line is None:
                    events.append({"kind": kind, "missed": True, "t_fault": time.time()})
                    continue
                t_fault, fault_round = line["time"], line["fault_round"]
            got = _detected(c, t_fault)
            ev = {"kind": kind, "t_fault": t_fault, "fault_round": fault_round, **(got or {"missed": True})}
            if got:
                ev["detect_s"] = got["t_commit"] - t_fault
                ev["in_flight_redone"] = fault_round is None or (
                    got["round"] == fault_round and got["redone"] >= 1
                )
            events.append(ev)
            if kind == "stop":
                time.sleep(max(0.0, t_fault + STOP_S - time.time()))
                c.signal(2, signal.SIGCONT)
            if kind in ("kill", "exchange-kill") and nxt is not None:
                wait_for(lambda: 2 not in c.running(), 10)
                c.start(2, flags.get(nxt, []))
            if nxt is not None and not _steady(c, time.time()):
                raise RuntimeError(f"island 2 did not rejoin after {kind}")
    finally:
        teardown(c)
    summary = {}
    for kind in kinds:
        evs = [e for e in events if e["kind"] == kind and not e.get("missed")]
        summary[kind] = {
            "n": len(evs),
            "missed": sum(1 for e in events if e["kind"] == kind and e.get("missed")),
            "detect_s": [round(e["detect_s"], 3) for e in evs],
            "round_seconds": [e["round_seconds"] for e in evs],
            "redone": [e["redone"] for e in evs],
            "lost": [e["lost"] for e in evs],
            "behind_at_fault": sum(e["behind_at_fault"] for e in evs),
            "in_flight_redone": [e["in_flight_redone"] for e in evs],
        }
    return {
        "events": events,
        "summary": summary,
        "seconds": time.monotonic() - started,
        "load": [load0, load()],
    }


GOALS = {"kill": 3.0, "exchange-kill": 3.0, "stop": HEARTBEAT_S + 1.0, "exchange-stop": HEARTBEAT_S + 1.0}
LABELS = {
    "kill": "SIGKILL during inner steps",
    "exchange-kill": "SIGKILL entering the all-reduce",
    "stop": f"SIGSTOP {STOP_S:g} s during inner steps",
    "exchange-stop": f"SIGSTOP {STOP_S:g} s inside the all-reduce",
}


def detection_table(res: dict[str, Any]) -> str:
    rows = []
    for kind, s in res["summary"].items():
        rows.append(
            [
                LABELS[kind],
                f"{s['n']}" + (f" (+{s['missed']} missed)" if s["missed"] else ""),
                med_max(s["detect_s"]),
                med_max(s["round_seconds"]),
                f"<= {GOALS[kind]:g}",
                sum(s["lost"]),
                f"{sum(1 for r in s['redone'] if r >= 1)}/{s['n']}",
                "yes" if all(s["in_flight_redone"]) and not sum(s["lost"]) else "no",
                s["behind_at_fault"],
            ]
        )
    return table(
        [
            "fault of island 2",
            "repeats",
            "fault -> survivors' commit, s (median / max)",
            "that round's quorum -> commit, s",
            "goal, s",
            "survivor rounds lost",
            "rounds redone",
            "in-flight round kept",
            "survivors already behind (left out before the fault)",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- 2. healing


def healing(repeats: int, workdir: str) -> dict[str, Any]:
    """Two source islands and one that falls behind and heals ``repeats`` times (benchmarks/_islands_heal.py)."""
    os.makedirs(workdir, exist_ok=True)
    py, script = sys.executable, os.path.join(HERE, "_islands_heal.py")
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RUST_LOG": "error", "PYTHONUNBUFFERED": "1"}
    out = lambda name: open(os.path.join(workdir, name), "w")  # noqa: E731, SIM115
    island = os.path.join(ROOT, "examples", "islands.py")
    lh = subprocess.Popen(
        [py, island, "--serve-lighthouse", addr, "--join-timeout-ms", str(HEAL_JOIN_TIMEOUT_MS)],
        env=env,
        stdout=out("lh.out"),
        stderr=subprocess.STDOUT,
    )
    seconds = 40 + 8 * repeats
    srcs = [
        subprocess.Popen(
            [py, script, "--role", "source", "--id", str(i), "--lighthouse", addr, "--seconds", str(seconds)],
            env=env,
            stdout=out(f"source{i}.out"),
            stderr=subprocess.STDOUT,
        )
        for i in (0, 1)
    ]
    load0 = load()
    try:
        time.sleep(1.0)
        healer = subprocess.run(
            [py, script, "--role", "healer", "--id", "2", "--lighthouse", addr, "--repeats", str(repeats)],
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds,
        )
        with open(os.path.join(workdir, "healer.err"), "w") as f:
            f.write(healer.stderr)
    finally:
        for p in [*srcs, lh]:
            p.kill()
            p.wait()
    lines = [json.loads(x) for x in healer.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise RuntimeError(f"the healer printed nothing; see {workdir}/healer.err")
    return {"size": lines[0], "repeats": lines[1:], "load": [load0, load()]}


def healing_table(res: dict[str, Any]) -> str:
    size, reps = res["size"], [r for r in res["repeats"] if r["healed"]]
    mb = size["state_bytes"] / 1e6
    heal = [r["heal_quorum_s"] for r in reps]
    plain = [r["plain_quorum_s"] for r in res["repeats"]]
    place = [r["place_s"] for r in reps]
    rows = [
        [
            f"{size['params']:,}",
            f"{size['state_bytes']:,} ({mb:.1f} MB, {size['leaves']} arrays)",
            f"{len(reps)}/{len(res['repeats'])}",
            med_max(heal),
            med_max(plain),
            med_max(place),
            f"{mb / statistics.median(heal):.0f}" if heal else "n/a",
        ]
    ]
    return table(
        [
            "GPT parameters",
            "healing state (params + opt_state), bytes",
            "heals",
            "quorum with heal, s (median / max)",
            "quorum without, s",
            "placing it (device_put), s",
            "MB/s (state / heal quorum)",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- 3. utilization


def one_run(
    workdir: str, steps: int, extra: list[str] = (), faulty: list[str] = (), timeout: float = 300.0
) -> dict[str, Any]:
    """3 islands for ``steps`` with ``--timings``; island 2 gets ``faulty`` flags too."""
    c = chaos.Cluster(
        workdir,
        island_args=[*COMMON, "--steps", str(steps), "--timings", "--quorum-timeout", "20", *extra],
        join_timeout_ms=JOIN_TIMEOUT_MS,
    )
    c.start_lighthouse()
    for i in range(3):
        c.start(i, list(faulty) if i == 2 else [])
    hung = c.wait(timeout)
    rows = c.rows()
    done = {r["island"]: r for r in rows if r.get("done")}
    return {"rows": rows, "done": done, "hung": hung, "summary": chaos.summarize(rows, hung)}


UTIL_CONFIGS = [
    ("no exchange (--sync-every 1000000)", ["--sync-every", "1000000"], []),
    ("exchange every 10 steps, sync_delay=0", [], []),
    ("exchange every 10 steps, sync_delay=1 (overlapped)", ["--sync-delay", "1"], []),
    ("sync_delay=0, island 2 SIGKILLed entering round ~5's all-reduce", [], ["--die-in-exchange-after", "5"]),
    (
        "sync_delay=1, island 2 SIGKILLed entering round ~5's all-reduce",
        ["--sync-delay", "1"],
        ["--die-in-exchange-after", "5"],
    ),
    (
        "sync_delay=0, island 2 SIGSTOPped 4 s inside round ~5's all-reduce",
        [],
        ["--stop-in-exchange-after", "5"],
    ),
    (
        "sync_delay=1, island 2 SIGSTOPped 4 s inside round ~5's all-reduce",
        ["--sync-delay", "1"],
        ["--stop-in-exchange-after", "5"],
    ),
    ("exchange every 10 steps, eager (overlapped a period)", ["--eager"], []),
    (
        "eager, island 2 SIGKILLed entering round ~5's all-reduce",
        ["--eager"],
        ["--die-in-exchange-after", "5"],
    ),
]


def _partial(rows: list[dict[str, Any]], n: int) -> int:
    """Rounds (after the first) with fewer than ``n`` members."""
    by_round = {r["round"]: len(r["participants"]) for r in rows if "round" in r and r["round"] > 1}
    return sum(1 for m in by_round.values() if m < n)


def utilization(
    steps: int, workdir: str, configs: list[tuple[str, list[str], list[str]]]
) -> list[dict[str, Any]]:
    out = []
    for k, (name, extra, faulty) in enumerate(configs):
        load0 = load()
        res = one_run(os.path.join(workdir, f"u{k}"), steps, extra, faulty)
        islands = ("0", "1") if faulty else ("0", "1", "2")
        d = [res["done"][i] for i in islands if i in res["done"]]
        out.append(
            {
                "config": name,
                "islands": [i for i in islands if i in res["done"]],
                "errors": res["summary"]["errors"],
                "utilization": [r["compute_seconds"] / r["wall_seconds"] for r in d],
                "utilization_without_logging": [
                    r["compute_seconds"] / (r["wall_seconds"] - r.get("logging_seconds", 0.0)) for r in d
                ],
                "logging_per_step": [r.get("logging_seconds", 0.0) / r["steps_timed"] for r in d],
                "wall_per_step": [r["wall_seconds"] / r["steps_timed"] for r in d],
                "compute_per_step": [r["compute_seconds"] / r["steps_timed"] for r in d],
                "steps_timed": [r["steps_timed"] for r in d],
                "rounds": res["summary"]["rounds_committed"],
                "redone": res["summary"]["rounds_redone"],
                "heals": res["summary"]["heals"],
                "partial_rounds": None if faulty else _partial(res["rows"], 3),
                "hangs": len(res["hung"]),
                "load": [load0, load()],
            }
        )
    return out


def utilization_table(res: list[dict[str, Any]]) -> str:
    base = res[0]["wall_per_step"] if res else []
    base_step = statistics.mean(base) if base else float("nan")
    rows = []
    for r in res:
        wps = statistics.mean(r["wall_per_step"]) if r["wall_per_step"] else float("nan")
        lps = statistics.mean(r["logging_per_step"]) if r["logging_per_step"] else 0.0
        rows.append(
            [
                r["config"],
                ", ".join(r["islands"]),
                " / ".join(f"{u:.1%}" for u in r["utilization"]),
                " / ".join(f"{u:.1%}" for u in r["utilization_without_logging"]),
                f"{wps * 1e3:.1f}",
                f"{statistics.mean(r['compute_per_step']) * 1e3:.1f}" if r["compute_per_step"] else "n/a",
                f"{wps / base_step - 1:+.1%}",
                f"{(wps - lps) / base_step - 1:+.1%}",
                r["rounds"],
                r["redone"],
                r["heals"],
                "-" if r["partial_rounds"] is None else r["partial_rounds"],
            ]
        )
    return table(
        [
            "run (3 islands)",
            "islands measured",
            "utilization (compute / wall), each",
            "same, wall less the example's per-round logging",
            "wall ms / step",
            "compute ms / step",
            "wall / step vs no exchange",
            "same, less logging",
            "rounds",
            "redone",
            "heals",
            "rounds short of the live islands",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- 4. soak


def _random_faults(
    c: chaos.Cluster, n: int, rounds: int, rng: random.Random, deadline: float
) -> list[dict[str, Any]]:
    """Fires ``n`` random faults, time-triggered, so that some island always keeps the state.

    Every 3-6 s, a coin picks a SIGKILL (restarted 0.5-3 s later; half of the restarts are armed
    with ``--die-in-exchange-after`` 2-6, a SIGKILL entering a later round's all-reduce) or a
    SIGSTOP of 1-4 s, of a random island that is up (running, and has committed a round since its
    own (re)start): a kill only while all three are up, a stop while at least two are; one island
    armed at a time. islands_chaos's ``--soak`` keys restarts to rounds, which never come when two
    islands are down at once (fewer than ``--min-islands``), hence this driver.
    """
    fired: list[dict[str, Any]] = []
    down: dict[int, tuple[str, float]] = {}
    started = {i: 0.0 for i in range(3)}
    armed: set[int] = set()
    t_next = time.monotonic() + rng.uniform(3.0, 6.0)

    def healthy(i: int) -> bool:
        rows = _rounds(read_rows(c.log_path(i)))
        return i not in down and i in c.running() and any(r["time"] > started[i] for r in rows)

    while time.monotonic() < deadline and c.running():
        now = time.monotonic()
        for i in [i for i in armed if i not in down and i not in c.running()]:  # died in an exchange
            armed.discard(i)
            fired.append({"fault": "exchange-kill", "island": i, "time": time.time()})
            down[i] = ("kill", now + rng.uniform(0.5, 3.0))
        for i, (kind, until) in list(down.items()):
            if now >= until:
                del down[i]
                if kind == "stop":
                    c.signal(i, signal.SIGCONT)
                else:
                    extra = (
                        ["--die-in-exchange-after", str(rng.randint(2, 6))]
                        if rng.random() < 0.5 and not armed - {i}
                        else []
                    )
                    armed.discard(i)
                    armed.update([i] if extra else [])
                    started[i] = time.time()
                    c.start(i, extra)
        top = max((r["round"] for s in range(3) for r in _rounds(read_rows(c.log_path(s)))), default=0)
        if len(fired) < n and now >= t_next and top < 0.75 * rounds:
            t_next = now + rng.uniform(3.0, 6.0)
            up = [i for i in range(3) if healthy(i)]
            kind = rng.choice(["kill", "stop"])
            # a kill only while every island is up (some island always keeps the state); a stop while
            # at most one other island is down (a stopped island keeps its state)
            if (kind == "kill" and len(up) == 3) or (kind == "stop" and len(up) >= 2):
                i = rng.choice(up)
                if kind == "kill":
                    c.signal(i, signal.SIGKILL)
                    down[i] = ("kill", now + rng.uniform(0.5, 3.0))
                else:
                    c.signal(i, signal.SIGSTOP)
                    down[i] = ("stop", now + rng.uniform(1.0, 4.0))
                fired.append({"fault": kind, "island": i, "time": time.time()})
        if len(fired) >= n and not down and not armed:
            break
        time.sleep(0.05)
    for i, (kind, _) in down.items():  # deadline: bring everyone back
        c.signal(i, signal.SIGCONT) if kind == "stop" else c.start(i)
    return fired


def soak(n_faults: int, steps: int, workdir: str, seed: int = 0) -> dict[str, Any]:
    out = {}
    for name in ("fault-free", "soak"):
        load0 = load()
        started = time.monotonic()
        c = chaos.Cluster(
            os.path.join(workdir, name),
            island_args=[*COMMON, "--steps", str(steps)],
            join_timeout_ms=JOIN_TIMEOUT_MS,
        )
        c.start_lighthouse()
        for i in range(3):
            c.start(i)
        fired: list[dict[str, Any]] = []
        if name == "soak":
            _steady(c, 0.0)
            fired = _random_faults(
                c, n_faults, steps // SYNC_EVERY, random.Random(seed), time.monotonic() + 600
            )
        hung = c.wait(300.0)
        summary = chaos.summarize(c.rows(), hung)
        counts: dict[str, int] = {}
        for f in fired:
            counts[f["fault"]] = counts.get(f["fault"], 0) + 1
        counts["restarts"] = sum(1 for e in c.events if e["event"] == "start") - 3
        out[name] = {
            "summary": summary,
            "faults": fired,
            "fired": counts,
            "seconds": time.monotonic() - started,
            "load": [load0, load()],
        }
    return out


def soak_table(res: dict[str, Any]) -> str:
    ref = res["fault-free"]["summary"]["final_val_loss"]
    ref_loss = statistics.mean(ref.values()) if ref else float("nan")
    rows = []
    for name, r in res.items():
        s = r["summary"]
        losses = list(s["final_val_loss"].values())
        worst = max((abs(v / ref_loss - 1) for v in losses), default=float("nan"))
        fired = r["fired"]
        rows.append(
            [
                name,
                f"{fired.get('kill', 0)} / {fired.get('exchange-kill', 0)} / {fired.get('stop', 0)} / "
                f"{fired.get('restarts', 0)}",
                s["rounds_committed"],
                s["rounds_redone"],
                s["heals"],
                s["hangs"],
                s["divergent_anchors"],
                len(s["errors"]),
                " / ".join(f"{v:.4f}" for v in losses) or "none finished",
                f"{worst:+.2%}" if name != "fault-free" else "",
                f"{r['seconds']:.0f}",
            ]
        )
    return table(
        [
            "run",
            "kills / exchange kills / stops / restarts",
            "rounds committed",
            "redone",
            "heals",
            "hangs",
            "divergent anchors",
            "errors",
            "final val loss (islands that finished)",
            "worst vs fault-free",
            "wall s",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- 5. torchft's DiLoCo


def torchft_diloco(die_rounds: list[int], steps: int, workdir: str) -> list[dict[str, Any]]:
    """torchft's DiLoCo, 3 replicas; replica 2 SIGKILLs itself entering round R's all-reduce."""
    py, script = sys.executable, os.path.join(HERE, "_islands_torchft_diloco.py")
    env = {**os.environ, "RUST_LOG": "error", "PYTHONUNBUFFERED": "1"}
    out = []
    for k, r_die in enumerate(die_rounds):
        wd = os.path.join(workdir, f"torchft{k}")
        os.makedirs(wd, exist_ok=True)
        addr = f"127.0.0.1:{free_port()}"
        lh = subprocess.Popen(
            [py, script, "--serve-lighthouse", addr, "--join-timeout-ms", str(JOIN_TIMEOUT_MS)],
            env=env,
            stdout=open(os.path.join(wd, "lh.out"), "w"),
            stderr=subprocess.STDOUT,  # noqa: SIM115
        )
        time.sleep(1.0)
        procs = []
        for i in range(3):
            cmd = [
                py,
                script,
                "--replica-id",
                str(i),
                "--lighthouse",
                addr,
                "--steps",
                str(steps),
                "--sync-every",
                str(SYNC_EVERY),
                "--step-sleep",
                str(STEP_SLEEP),
                "--timeout",
                str(TIMEOUT),
                "--quorum-timeout",
                "20",
                "--log",
                os.path.join(wd, f"replica{i}.jsonl"),
            ]
            if i == 2:
                cmd += ["--die-in-exchange-at", str(r_die)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=open(os.path.join(wd, f"replica{i}.out"), "w"),
                    stderr=subprocess.STDOUT,
                )
            )  # noqa: SIM115
        hung: list[int] = []
        try:
            for p in procs:
                p.wait(timeout=60 + steps * STEP_SLEEP * 3)
        except subprocess.TimeoutExpired:  # a replica left waiting for a quorum
            hung = [i for i, p in enumerate(procs) if p.poll() is None]
        finally:
            for p in [*procs, lh]:
                if p.poll() is None:
                    p.kill()
                p.wait()
        fault = next((r for r in read_rows(os.path.join(wd, "replica2.jsonl")) if "fault" in r), None)
        per = {}
        for s in (0, 1):
            rows = read_rows(os.path.join(wd, f"replica{s}.jsonl"))
            votes = [r for r in rows if "committed" in r]
            lost = [r for r in votes if not r["committed"]]
            after = [r for r in votes if fault and r["time"] > fault["time"] and r["committed"]]
            done = next((r for r in rows if r.get("done")), {})
            per[s] = {
                "lost": len(lost),
                "wasted_steps": SYNC_EVERY * len(lost),
                "detect_s": (after[0]["time"] - fault["time"]) if after and fault else None,
                "val_loss": done.get("val_loss"),
                "rounds_committed": done.get("rounds_committed"),
            }
        out.append({"die_round": r_die, "fault": bool(fault), "survivors": per, "hung": hung})
    return out


def comparison_table(tf: list[dict[str, Any]], ours: dict[str, Any] | None) -> str:
    rows = []
    lost = [s["lost"] for r in tf for s in r["survivors"].values()]
    wasted = [s["wasted_steps"] for r in tf for s in r["survivors"].values()]
    det = [s["detect_s"] for r in tf for s in r["survivors"].values() if s["detect_s"] is not None]
    rows.append(
        [
            "torchft 0.2.0 DiLoCo (torch)",
            sum(1 for r in tf if r["fault"]),
            f"{statistics.mean(lost):.2f}" if lost else "n/a",
            f"{statistics.mean(wasted):.1f}" if wasted else "n/a",
            med_max(det),
        ]
    )
    if ours is not None:
        s = ours["summary"].get("exchange-kill")
        if s and s["n"]:
            rows.append(
                [
                    "jaxopt_dist islands (JAX)",
                    s["n"],
                    f"{statistics.mean(s['lost']):.2f}",
                    f"{SYNC_EVERY * statistics.mean(s['lost']):.1f}",
                    med_max(s["detect_s"]),
                ]
            )
    return table(
        [
            "engine (3 replicas, H=10, same self-kill)",
            "kills",
            "rounds lost per survivor per kill",
            "inner steps wasted per survivor per kill",
            "kill -> survivors' next commit, s (median / max)",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- 6. separate hosts

HOSTS_ROUND_S, HOSTS_HEAL_S = 60.0, 20.0  # --round-timeout, --heal-timeout of the hosts' islands
HOSTS_BOUNDS = {  # each logged wait's bound (the islands guide's table), seconds
    "seconds": HOSTS_ROUND_S,
    "quorum_seconds": 60.0,  # --quorum-timeout (COMMON)
    "exchange_seconds": TIMEOUT,
    "vote_seconds": TIMEOUT,
    "heal_seconds": HOSTS_HEAL_S,
}
# the guide's bound on a round that a fault of another island hits: the all-reduce and the vote time
# out, the next quorum waits out the heartbeat and a renewal and a tick, and the longest backoff
FAULT_ROUND_S = 2 * TIMEOUT + HEARTBEAT_S + 0.5 + 0.1 + 1.0


def _host_faults(c: chaos.Cluster, repeats: int, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Up to ``repeats`` times, while the islands run: SIGKILL island k % 3, restart it 2 s later, wait
    for its heal; SIGSTOP island (k + 1) % 3 for 4 s, wait for a round of all three (the resumed island
    heals if the others left it out meanwhile, which a stop that ends inside a quorum may not cause).
    Whether each fault's island healed is read off the logs at the end (:func:`_healed`)."""
    fired: list[dict[str, Any]] = []

    def healed_after(i: int, t: float) -> bool:
        return any(r["healed"] and r["time"] > t for r in _rounds(read_rows(c.log_path(i))))

    for k in range(repeats):
        if not _steady(c, time.time(), timeout=300.0 if k == 0 else 90.0):  # (start-up on a loaded machine)
            break  # the islands have finished
        victim, frozen = k % 3, (k + 1) % 3
        fired.append({"fault": "kill", "island": victim, "time": time.time()})
        c.signal(victim, signal.SIGKILL)
        time.sleep(2.0)
        c.start(victim)
        t_start = time.time()
        if not wait_for(lambda v=victim, t=t_start: healed_after(v, t), timeout) or not _steady(
            c, time.time()
        ):
            break
        fired.append({"fault": "stop", "island": frozen, "time": time.time()})
        c.signal(frozen, signal.SIGSTOP)
        time.sleep(STOP_S)
        c.signal(frozen, signal.SIGCONT)
        if not _steady(c, time.time()):
            break
    return fired


def _healed(rows: list[dict[str, Any]], fired: list[dict[str, Any]]) -> list[bool]:
    """For each fault, whether its island logged a round it healed or caught up in after it and before the
    next (or the end)."""
    times = [f["time"] for f in fired] + [float("inf")]
    back = [r for r in _rounds(rows) if r["healed"] or r.get("caught_up")]
    return [
        any(r["island"] == str(f["island"]) and t < r["time"] < end for r in back)
        for f, t, end in zip(fired, times, times[1:])
    ]


def _first_without(rows: list[dict[str, Any]], t: float, island: int) -> float | None:
    """Seconds from ``t`` to the first round committed without ``island`` after it (by any island)."""
    later = [r["time"] for r in _rounds(rows) if r["time"] > t and str(island) not in r["participants"]]
    return min(later) - t if later else None


def hosts(repeats: int, steps: int, workdir: str) -> dict[str, Any]:
    """Fault-free, then with faults (:func:`_host_faults`), on four hosts (see the module)."""
    why = netns.problem()
    if why is not None:
        return {"skipped": why}
    out: dict[str, Any] = {}
    for name in ("fault-free", "faults"):
        load0, started = load(), time.monotonic()
        args = ["--round-timeout", str(HOSTS_ROUND_S), "--heal-timeout", str(HOSTS_HEAL_S)]
        with netns.Hosts(4) as h:
            c = h.cluster(
                os.path.join(workdir, name),
                island_args=[*COMMON, "--steps", str(steps), *args],
                join_timeout_ms=JOIN_TIMEOUT_MS,
            )
            with netns.running(c):
                c.start_lighthouse()
                for i in range(3):
                    c.start(i)
                fired = _host_faults(c, repeats) if name == "faults" else []
                hung = c.wait(600.0)
        rows = c.rows()
        for f, healed in zip(fired, _healed(rows, fired)):
            f["healed"] = healed
        survivors = [
            r
            for f in fired
            for r in _rounds(rows)
            if f["fault"] == "kill"
            and r["island"] != str(f["island"])
            and f["time"] < r["time"] < f["time"] + 30
        ]
        out[name] = {
            "summary": chaos.summarize(rows, hung),
            "faults": fired,
            "longest": {k: max((r[k] for r in _rounds(rows)), default=0.0) for k in HOSTS_BOUNDS},
            "over_bound": sum(1 for r in _rounds(rows) for k, b in HOSTS_BOUNDS.items() if r[k] > b + 1.0),
            "fault_rounds_s": max((r["seconds"] for r in survivors), default=0.0),
            "excluded_after_s": [_first_without(rows, f["time"], f["island"]) for f in fired],
            "seconds": time.monotonic() - started,
            "load": [load0, load()],
        }
    return out


def hosts_table(res: dict[str, Any]) -> str:
    if "skipped" in res:
        return f"skipped: {res['skipped']}"
    ref = res["fault-free"]["summary"]["final_val_loss"]
    ref_loss = statistics.mean(ref.values()) if ref else float("nan")
    rows = []
    for name, r in res.items():
        s, longest = r["summary"], r["longest"]
        kills = [f for f in r["faults"] if f["fault"] == "kill"]
        stops = [f for f in r["faults"] if f["fault"] == "stop"]
        worst = max((v / ref_loss - 1 for v in s["final_val_loss"].values()), key=abs, default=float("nan"))
        excluded = [x for x in r["excluded_after_s"] if x is not None]
        rows.append(
            [
                name,
                f"{len(kills)} / {len(stops)}",
                s["rounds_committed"],
                s["rounds_redone"],
                f"{sum(f['healed'] for f in kills)}/{len(kills)} restarted, {sum(f['healed'] for f in stops)}/"
                f"{len(stops)} resumed (left out)",
                s["hangs"],
                s["divergent_anchors"],
                len(s["errors"]),
                " / ".join(f"{longest[k]:.2f}" for k in HOSTS_BOUNDS),
                r["over_bound"],
                f"{r['fault_rounds_s']:.2f} (<= {FAULT_ROUND_S:g})" if kills else "",
                med_max(excluded),
                f"{worst:+.2%}" if name != "fault-free" else "",
                f"{r['seconds']:.0f}",
            ]
        )
    return table(
        [
            "run (3 islands on 3 hosts, lighthouse on a 4th)",
            "kills + restarts / 4 s stops",
            "rounds committed",
            "redone",
            "healed",
            "hangs",
            "divergent anchors",
            "errors",
            "longest round / quorum / all-reduce / vote / heal, s",
            "waits over their bound + 1 s",
            "longest survivor round after a kill, s",
            "fault -> a round without the island, s (median / max)",
            "final val loss, farthest from fault-free",
            "wall s",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one exchange kill, one heal, two short runs, one torchft kill (~3 min)",
    )
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument(
        "--workdir", default=None, help="keep the islands' logs here (default: a temporary folder)"
    )
    ap.add_argument(
        "--only",
        default="detection,healing,utilization,soak,torchft,hosts",
        help="comma-separated sections (hosts needs root)",
    )
    ap.add_argument("--soak", type=int, default=12, help="random faults in the soak")
    ap.add_argument("--hosts-repeats", type=int, default=3, help="kill-restart-stop cycles on separate hosts")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="every island runs diloco(eager=True) (examples/islands.py --eager): for the soak",
    )
    ap.add_argument(
        "--outer-lr",
        type=float,
        default=None,
        help="the islands' outer learning rate (examples/islands.py's)",
    )
    ap.add_argument(
        "--aggregate",
        default=None,
        help="every island's --aggregate (examples/islands.py's: mean, low_bit, sparseloco, ...)",
    )
    ap.add_argument(
        "--secret",
        action="store_true",
        help="every island holds one shared secret (examples/islands.py --secret-file)",
    )
    ap.add_argument(
        "--utilization-runs",
        default=None,
        metavar="WORDS",
        help="comma-separated words: only the utilization runs whose name holds one (the first, the "
        "baseline, always runs)",
    )
    ap.add_argument(
        "--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS, help="the lighthouses' join timeout"
    )
    a = ap.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench_islands_")
    only = set(a.only.split(","))
    globals()["JOIN_TIMEOUT_MS"] = a.join_timeout_ms
    if a.eager:
        COMMON.append("--eager")
    if a.outer_lr is not None:
        COMMON.extend(["--outer-lr", str(a.outer_lr)])
    if a.aggregate is not None:
        COMMON.extend(["--aggregate", a.aggregate])
    if a.secret:
        secret = os.path.join(workdir, "secret")
        with open(secret, "wb") as f:
            f.write(os.urandom(32))
        COMMON.extend(["--secret-file", secret])
    q = a.quick
    results: dict[str, Any] = {
        "quick": q,
        "machine": f"{os.cpu_count()} CPUs",
        "workdir": workdir,
        "join_timeout_ms": a.join_timeout_ms,
        "eager": a.eager,
        "outer_lr": a.outer_lr,
        "aggregate": a.aggregate,
        "secret": a.secret,
    }
    print(
        f"# bench_islands ({'quick' if q else 'full'}; logs in {workdir}; load average {load()})\n",
        flush=True,
    )
    t0 = time.monotonic()

    def section(name: str, fn: Any, render: Any) -> Any:
        start = time.monotonic()
        res = fn()
        results[name] = res
        if a.json:  # after every section, so that a failure later keeps what was measured
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
        print(f"## {name} ({time.monotonic() - start:.0f} s)\n\n{render(res)}\n", flush=True)
        return res

    det = None
    if "detection" in only:
        kinds = ["exchange-kill"] if q else ["kill", "exchange-kill", "exchange-stop", "stop"]
        det = section(
            "detection",
            lambda: detection(1 if q else 5, os.path.join(workdir, "detection"), kinds),
            detection_table,
        )
    if "healing" in only:
        section("healing", lambda: healing(1 if q else 4, os.path.join(workdir, "healing")), healing_table)
    if "utilization" in only:
        configs = [UTIL_CONFIGS[0], UTIL_CONFIGS[2]] if q else UTIL_CONFIGS
        if a.utilization_runs:
            words = a.utilization_runs.split(",")
            configs = configs[:1] + [c for c in configs[1:] if any(w in c[0] for w in words)]
        section(
            "utilization",
            lambda: utilization(100 if q else 300, os.path.join(workdir, "utilization"), configs),
            utilization_table,
        )
    if "soak" in only and not q:
        section("soak", lambda: soak(a.soak, 2400, os.path.join(workdir, "soak")), soak_table)
    if "torchft" in only:
        section(
            "torchft",
            lambda: torchft_diloco(
                [5] if q else [5, 8, 11], 120 if q else 200, os.path.join(workdir, "torchft")
            ),
            lambda r: comparison_table(r, det),
        )
    if "hosts" in only:
        section(
            "hosts",
            lambda: hosts(r := 1 if q else a.hosts_repeats, 1500 * (r + 1), os.path.join(workdir, "hosts")),
            hosts_table,
        )
    results["seconds"] = time.monotonic() - t0
    print(f"total {results['seconds']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
