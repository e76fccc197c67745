"""A chaos driver for ``examples/islands.py``: start a lighthouse and islands, kill, stop and restart them.

It starts its own lighthouse and islands, every island a process of its own
(``examples/islands.py``, on loopback; nothing else needs to run); faults are
real signals: SIGKILL (the process dies, its sockets close), SIGSTOP for a
while then SIGCONT (it hangs, silent, sockets open), and restarts (a new
process with the same island id, which heals from a live peer). Each fault
fires when the islands' logs reach its round, and each is then looked for in
the logs: a kill is seen when the survivors commit a round without the
island, a stop when the island takes part again after SIGCONT, a restart when
the restarted process heals, a kill inside the exchange when the survivors
redo that round without it, a lighthouse restart when a round commits after
it. Until every fault is seen (or ``--patience`` seconds after it fired), the
islands are kept training past ``--steps`` (``islands.py --steps-file``), so
that a restarted island joins before the others finish.

At the end the driver reads every island's JSON lines, prints a summary and
checks what the islands guarantee: after every round, all its participants
logged the same anchor (``agreed_sha256``: the anchor, or under ``--eager``
the merged mean each island's anchor takes); no island waited past its bound
(an island still running at the end is a hang); no island logged an error;
every fault was seen. It exits with status 0 when every check passes, 1
otherwise::

    python examples/islands_chaos.py --islands 3 --fault kill:2@5 --fault restart:2@8

A fault is ``ACTION:ISLAND@ROUND[:SECONDS]`` (``kill``, ``stop`` for SECONDS,
``restart``, ``exchange-kill``: the island kills itself as it enters that
round's all-reduce, its peers already in it or entering it; ``lighthouse``: the lighthouse is killed and started
again SECONDS later). ``--soak N`` adds N random faults instead.
Island flags after ``--`` go to every island. The logs go to ``--workdir``
(a new temporary directory by default, printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ISLAND = os.path.join(HERE, "islands.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Fault:
    action: str  # kill | stop | restart | exchange-kill | lighthouse
    island: int
    round: int
    seconds: float = 0.0
    fired_at: float | None = None
    seen: str | None = None  # how the logs show it took effect (None: not seen)

    def __str__(self) -> str:
        island = "" if self.action == "lighthouse" else f":{self.island}"
        return f"{self.action}{island}@{self.round}" + (f":{self.seconds:g}" if self.seconds else "")

    @classmethod
    def parse(cls, text: str) -> Fault:
        try:
            head, rest = text.split("@")
            action, island = head.split(":") if ":" in head else (head, "-1")
            parts = rest.split(":")
            return cls(action, int(island), int(parts[0]), float(parts[1]) if len(parts) > 1 else 0.0)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"a fault is ACTION:ISLAND@ROUND[:SECONDS]; got {text!r}") from e


class Cluster:
    """A lighthouse and islands on loopback, each a process, with their logs in ``workdir``."""

    def __init__(
        self,
        workdir: str,
        *,
        island_args: list[str] = (),
        min_islands: int = 2,
        heartbeat_timeout_ms: int = 2000,
        join_timeout_ms: int = 1000,
        python: str = sys.executable,
    ):
        self.workdir, self.python = workdir, python
        self.island_args = list(island_args)
        self.lighthouse_args = [
            "--min-islands",
            str(min_islands),
            "--heartbeat-timeout-ms",
            str(heartbeat_timeout_ms),
            "--join-timeout-ms",
            str(join_timeout_ms),
        ]
        self.address = f"127.0.0.1:{free_port()}"
        self.procs: dict[int, subprocess.Popen] = {}
        self.lighthouse: subprocess.Popen | None = None
        self.events: list[dict[str, Any]] = []
        os.makedirs(workdir, exist_ok=True)
        self.steps_file = os.path.join(workdir, "steps")  # islands.py --steps-file: see hold()
        if os.path.exists(self.steps_file):
            os.remove(self.steps_file)
        self.env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "RUST_LOG": "error",
            "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        }
        self.env.pop("PYTEST_CURRENT_TEST", None)

    def log_path(self, i: int) -> str:
        return os.path.join(self.workdir, f"island{i}.jsonl")

    def _event(self, what: str, **kw: Any) -> None:
        self.events.append({"event": what, "time": time.time(), **kw})

    def start_lighthouse(self) -> None:
        out = open(os.path.join(self.workdir, "lighthouse.out"), "a")  # noqa: SIM115
        self.lighthouse = subprocess.Popen(
            [self.python, ISLAND, "--serve-lighthouse", self.address, *self.lighthouse_args],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        self._event("lighthouse-start")

    def stop_lighthouse(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()
            self._event("lighthouse-kill")

    def start(self, i: int, extra: list[str] = ()) -> None:
        out = open(os.path.join(self.workdir, f"island{i}.out"), "a")  # noqa: SIM115
        cmd = [
            self.python,
            ISLAND,
            "--island-id",
            str(i),
            "--lighthouse",
            self.address,
            "--log",
            self.log_path(i),
            "--steps-file",
            self.steps_file,
            *self.island_args,
            *extra,
        ]
        self.procs[i] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self._event("start", island=i)

    def hold(self, steps: int) -> None:
        """Every island trains at least ``steps`` steps (more than its ``--steps``; only ever raised)."""
        tmp = self.steps_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(steps))
        os.replace(tmp, self.steps_file)  # an island never reads a half-written count

    def signal(self, i: int, sig: int) -> None:
        self.procs[i].send_signal(sig)
        self._event(signal.Signals(sig).name, island=i)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for i in self.procs:
            if os.path.exists(self.log_path(i)):
                with open(self.log_path(i)) as f:
                    out += [json.loads(line) for line in f if line.strip().endswith("}")]
        return out

    def max_round(self) -> int:
        return max((r["round"] for r in self.rows() if "round" in r), default=-1)

    def running(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() is None]

    def wait(self, timeout: float) -> list[int]:
        """Waits for every island to exit; returns the ones still running (hangs), which it then kills."""
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = self.running()
        for i in hung:
            self.procs[i].kill()
        self.stop_lighthouse()
        return hung


def run_faults(
    cluster: Cluster,
    faults: list[Fault],
    timeout: float,
    *,
    patience: float = 120.0,
    progress: Any = None,
) -> list[int]:
    """Fires each fault when the logs reach its round (a restart earlier, when fewer than two islands
    run and no round can commit), looks for it in the logs (:func:`seen`), and returns the islands
    that hung.

    While a fault has not fired or has not been seen (for up to ``patience`` seconds after it fired),
    the islands are held (:meth:`Cluster.hold`) three rounds ahead of the furthest one logged, so
    that they do not finish first. ``progress`` (a tqdm bar, or None) shows the rounds and faults.
    """
    pending = sorted(faults, key=lambda f: f.round)
    stopped: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    held = 0
    while time.monotonic() < deadline and (cluster.running() or pending):
        now, rows = time.monotonic(), cluster.rows()
        top = max((r["round"] for r in rows if "round" in r), default=-1)
        for when, i in [s for s in stopped if s[0] <= now]:
            cluster.signal(i, signal.SIGCONT)
            stopped.remove((when, i))
        for f in [f for f in faults if f.action == "exchange-kill" and f.fired_at is None]:
            f.fired_at = next(
                (r["time"] for r in rows if r.get("fault") and r["island"] == str(f.island)), None
            )
        while pending and pending[0].round <= top:
            fire(cluster, pending.pop(0), stopped)
        if 0 < len(cluster.running()) < 2:  # no round can commit: bring a killed island back now
            early = [f for f in pending if f.action == "restart" and f.island not in cluster.running()]
            for f in early[:1]:
                pending.remove(f)
                fire(cluster, f, stopped)
        for f in faults:
            f.seen = f.seen or seen(f, rows, cluster.events)
        waiting = [
            f
            for f in faults
            if f.seen is None and (f.fired_at is None or time.time() - f.fired_at < patience)
        ]
        if waiting and top > 0:
            held = max(held, hold_steps(rows))
            cluster.hold(held)
        if progress is not None:
            show(progress, rows, faults, held)
        if not cluster.running() and not stopped:
            break
        time.sleep(0.05)
    for _, i in stopped:
        cluster.signal(i, signal.SIGCONT)
    return cluster.wait(max(5.0, deadline - time.monotonic()))


def hold_steps(rows: list[dict[str, Any]]) -> int:
    """Three rounds past the furthest round logged, in steps (a round's steps read off its record)."""
    last = max((r for r in rows if "round" in r), key=lambda r: (r["round"], r["step"]))
    return last["step"] + 3 * max(1, last["step"] // max(1, last["round"]))


def show(progress: Any, rows: list[dict[str, Any]], faults: list[Fault], held: int) -> None:
    """The progress bar: rounds (of ``--steps``, or of the held count), faults fired and seen, the last loss."""
    rounds = [r for r in rows if "round" in r]
    if not rounds:
        return
    last = max(rounds, key=lambda r: r["time"])
    per_round = max(1, last["step"] // max(1, last["round"]))
    progress.total = max(progress.total or 0, held // per_round, last["round"])
    progress.n = max(r["round"] for r in rounds)
    fired = sum(f.fired_at is not None for f in faults)
    progress.set_postfix_str(
        f"faults fired {fired}/{len(faults)}, seen {sum(f.seen is not None for f in faults)}; "
        f"island {last['island']} val loss {last['val_loss']:.3f}"
    )


def fire(cluster: Cluster, f: Fault, stopped: list[tuple[float, int]]) -> None:
    """Fires ``f`` now (an ``exchange-kill`` fires inside the island: its time is read off its log)."""
    if f.action == "exchange-kill":
        return
    f.fired_at = time.time()
    alive = f.island in cluster.running()
    if f.action == "kill" and alive:
        cluster.signal(f.island, signal.SIGKILL)
    elif f.action == "stop" and alive:
        cluster.signal(f.island, signal.SIGSTOP)
        stopped.append((time.monotonic() + f.seconds, f.island))
    elif f.action == "restart" and not alive:
        cluster.start(f.island)
    elif f.action == "lighthouse":
        cluster.stop_lighthouse()
        time.sleep(f.seconds)
        cluster.start_lighthouse()
    else:  # a kill or stop of an island not running, a restart of one running
        f.fired_at = None
        cluster.events.append({"event": "not-fired", "fault": str(f), "time": time.time()})


def seen(f: Fault, rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> str | None:
    """How the logs show that fault ``f`` took effect, or None (not fired, or not seen yet)."""
    if f.fired_at is None:
        return None
    island = str(f.island)
    later = sorted((r for r in rows if "round" in r and r["time"] > f.fired_at), key=lambda r: r["time"])
    if f.action == "kill":
        hit = [r for r in later if r["island"] != island and island not in r["participants"]]
        what = "committed round {round} without island " + island
    elif f.action == "stop":
        hit = [r for r in later if r["island"] == island and r["time"] > f.fired_at + f.seconds]
        what = "took part again in round {round} after SIGCONT"
    elif f.action == "restart":
        hit = [r for r in later if r["island"] == island and r["healed"]]
        what = "healed in round {round} after its restart"
    elif f.action == "exchange-kill":
        died = next(r["fault_round"] for r in rows if r.get("fault") and r["island"] == island)
        hit = [r for r in rows if r.get("round") == died and r["redone"] and island not in r["participants"]]
        what = "redid round {round} without island " + island
    else:  # lighthouse: a round committed after it came back
        back = max(e["time"] for e in events if e["event"] == "lighthouse-start")
        hit = [r for r in later if r["time"] > back]
        what = "committed round {round} after the lighthouse restart"
    if not hit:
        return None
    r = hit[0]
    return (
        f"island {r['island']} "
        + what.format(round=r["round"])
        + f", {r['time'] - f.fired_at:.1f} s after it"
    )


def random_faults(n: int, islands: int, rounds: int, seed: int) -> list[Fault]:
    """``n`` faults at random rounds: kills (each followed by a restart) and stops of 1-4 s.

    (A kill inside the exchange is a flag of the island's own, ``--die-in-exchange-at``: give it
    with ``--fault exchange-kill:I@R``.)"""
    rng = random.Random(seed)
    out: list[Fault] = []
    for _ in range(n):
        i, r = rng.randrange(islands), rng.randrange(2, max(3, rounds - 4))
        kind = rng.choice(["kill", "stop"])
        if kind == "stop":
            out.append(Fault("stop", i, r, rng.uniform(1.0, 4.0)))
        else:
            out += [Fault("kill", i, r), Fault("restart", i, r + rng.randint(1, 3))]
    return out


def summarize(rows: list[dict[str, Any]], hung: list[int], faults: list[Fault] = ()) -> dict[str, Any]:
    """Rounds committed, rounds redone, divergent anchors, hangs, errors, final validation losses, what
    each fault did, and the checks (``ok`` when all pass)."""
    by_round: dict[int, set[tuple[Any, ...]]] = {}
    for r in rows:  # every island that logged a round must have logged the same members and anchor
        if "round" in r:
            agreed = r.get("agreed_sha256", r["anchor_sha256"])
            by_round.setdefault(r["round"], set()).add((tuple(r["participants"]), agreed))
    done = {r["island"]: r["val_loss"] for r in rows if r.get("done")}
    summary = {
        "rounds_committed": len(by_round),
        "rounds_redone": sum(r.get("redone", 0) for r in rows if "round" in r),
        "heals": sum(1 for r in rows if r.get("healed")),
        "divergent_anchors": sum(1 for seen in by_round.values() if len(seen) > 1),
        "hangs": len(hung),
        "errors": [r["error"] for r in rows if "error" in r],
        "final_val_loss": done,
        "faults": {str(f): f.seen or ("not seen" if f.fired_at is not None else "not fired") for f in faults},
    }
    summary["checks"] = {
        "no island hung": not hung,
        "one anchor per round": summary["divergent_anchors"] == 0,
        "no island logged an error": not summary["errors"],
        "every fault seen": all(f.seen is not None for f in faults),
        "an island finished": bool(done),
    }
    summary["ok"] = all(summary["checks"].values())
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, island_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="inner steps (more while a fault is not yet seen)")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds of extra work per inner step")
    p.add_argument("--fault", type=Fault.parse, action="append", default=[])
    p.add_argument("--soak", type=int, default=0, help="N random faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a running island is a hang")
    p.add_argument(
        "--patience", type=float, default=120.0, help="seconds after a fault fired to keep looking for it"
    )
    p.add_argument("--workdir", default=None, help="the logs' folder (default: a new temporary directory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = p.parse_args(ours)
    faults = a.fault + random_faults(a.soak, a.islands, a.steps // a.sync_every, a.seed)
    workdir = a.workdir or tempfile.mkdtemp(prefix="islands_chaos-")
    print(
        f"islands_chaos: a lighthouse and {a.islands} islands on loopback; logs in {workdir}", file=sys.stderr
    )
    cluster = Cluster(
        workdir,
        island_args=[
            "--steps",
            str(a.steps),
            "--sync-every",
            str(a.sync_every),
            "--step-sleep",
            str(a.step_sleep),
            *island_args,
        ],
    )
    from tqdm import tqdm

    with tqdm(total=a.steps // a.sync_every, unit="round", disable=a.no_progress, file=sys.stderr) as bar:
        bar.set_postfix_str("starting the lighthouse and the islands")
        try:
            cluster.start_lighthouse()
            for i in range(a.islands):
                extra = [
                    f"--die-in-exchange-at={f.round}"
                    for f in faults
                    if f.action == "exchange-kill" and f.island == i
                ]
                cluster.start(i, extra[:1])
            hung = run_faults(cluster, faults, a.timeout, patience=a.patience, progress=bar)
        except BaseException:
            cluster.wait(0)  # nothing outlives the driver
            raise
    summary = summarize(cluster.rows(), hung, faults)
    print(json.dumps({"workdir": workdir, **summary}, indent=1))
    if not summary["ok"]:
        failed = [name for name, ok in summary["checks"].items() if not ok]
        print(f"islands_chaos: FAILED: {', '.join(failed)} (logs in {workdir})", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
