"""A chaos driver for ``examples/islands.py``: start a lighthouse and islands, kill, stop and restart them.

Every island is a process of its own (``examples/islands.py``); faults are
real signals: SIGKILL (the process dies, its sockets close), SIGSTOP for a
while then SIGCONT (it hangs, silent, sockets open), and restarts (a new
process with the same island id, which heals from a live peer). Each fault
fires when the islands' logs reach a round. At the end the driver reads
every island's JSON lines and checks what the islands guarantee: after every
round, all its participants logged the same anchor (``agreed_sha256``: the
anchor, or under ``--eager`` the merged mean each island's anchor takes); no
island waited past its bound (an island still running at the end is a hang).

    python examples/islands_chaos.py --islands 3 --steps 300 \\
        --fault kill:2@3 --fault restart:2@6 --fault stop:1@9:3

A fault is ``ACTION:ISLAND@ROUND[:SECONDS]`` (``kill``, ``stop`` for SECONDS,
``restart``, ``exchange-kill``: the island kills itself 10 ms into that
round's all-reduce; ``lighthouse``: the lighthouse is killed and started
again SECONDS later). ``--soak N`` adds N random faults instead.
Island flags after ``--`` go to every island.
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
            *self.island_args,
            *extra,
        ]
        self.procs[i] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self._event("start", island=i)

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


def run_faults(cluster: Cluster, faults: list[Fault], timeout: float) -> list[int]:
    """Fires each fault when the logs reach its round (a restart earlier, when fewer than two islands
    run and no round can commit); returns the islands that hung."""
    pending = sorted(faults, key=lambda f: f.round)
    stopped: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (cluster.running() or pending):
        now, top = time.monotonic(), cluster.max_round()
        for when, i in [s for s in stopped if s[0] <= now]:
            cluster.signal(i, signal.SIGCONT)
            stopped.remove((when, i))
        while pending and pending[0].round <= top:
            fire(cluster, pending.pop(0), stopped)
        if 0 < len(cluster.running()) < 2:  # no round can commit: bring a killed island back now
            early = [f for f in pending if f.action == "restart" and f.island not in cluster.running()]
            for f in early[:1]:
                pending.remove(f)
                fire(cluster, f, stopped)
        if not cluster.running() and not stopped:
            break
        time.sleep(0.05)
    for _, i in stopped:
        cluster.signal(i, signal.SIGCONT)
    return cluster.wait(max(5.0, deadline - time.monotonic()))


def fire(cluster: Cluster, f: Fault, stopped: list[tuple[float, int]]) -> None:
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


def summarize(rows: list[dict[str, Any]], hung: list[int]) -> dict[str, Any]:
    """Rounds committed, rounds redone, divergent anchors, hangs, final validation losses."""
    by_round: dict[int, set[tuple[Any, ...]]] = {}
    for r in rows:  # every island that logged a round must have logged the same members and anchor
        if "round" in r:
            agreed = r.get("agreed_sha256", r["anchor_sha256"])
            by_round.setdefault(r["round"], set()).add((tuple(r["participants"]), agreed))
    done = {r["island"]: r["val_loss"] for r in rows if r.get("done")}
    return {
        "rounds_committed": len(by_round),
        "rounds_redone": sum(r.get("redone", 0) for r in rows if "round" in r),
        "heals": sum(1 for r in rows if r.get("healed")),
        "divergent_anchors": sum(1 for seen in by_round.values() if len(seen) > 1),
        "hangs": len(hung),
        "errors": [r["error"] for r in rows if "error" in r],
        "final_val_loss": done,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, island_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds of extra work per inner step")
    p.add_argument("--fault", type=Fault.parse, action="append", default=[])
    p.add_argument("--soak", type=int, default=0, help="N random faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a running island is a hang")
    p.add_argument("--workdir", default="islands_chaos")
    a = p.parse_args(ours)
    faults = a.fault + random_faults(a.soak, a.islands, a.steps // a.sync_every, a.seed)
    cluster = Cluster(
        a.workdir,
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
    cluster.start_lighthouse()
    for i in range(a.islands):
        extra = [
            f"--die-in-exchange-at={f.round}" for f in faults if f.action == "exchange-kill" and f.island == i
        ]
        cluster.start(i, extra[:1])
    hung = run_faults(cluster, faults, a.timeout)
    print(json.dumps(summarize(cluster.rows(), hung), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
