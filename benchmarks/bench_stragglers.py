"""Stragglers: how much a slow island costs the others (islands over torchft, one process each).

Three islands of ``examples/islands.py`` on loopback (``examples/islands_chaos.py``'s
``Cluster``), each with ``--step-sleep`` of stand-in compute per inner step and
``--timings``; one island at ``--slow FACTOR`` per row. For each island: its inner steps per
second over the run (after its first round: start-up left out), its *goodput* (that rate over
the rate of the same island alone, run beside no other: compute and sleep only, no round),
and the median of its rounds' ``waited`` (seconds waiting for a round to form). Every round
today waits for every live island, so a fast island's goodput falls to about ``1 / FACTOR``.

    python benchmarks/bench_stragglers.py --slow 1,2,4 --steps 200

Needs torch and torchft (``pip install '.[islands]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import islands_chaos as chaos  # noqa: E402


def run(workdir: str, slow: float, args: argparse.Namespace) -> list[dict]:
    """3 islands, island 2 at ``--slow slow``; each island's row."""
    common = ["--sync-every", str(args.sync_every), "--steps", str(args.steps), "--timings"]
    common += ["--step-sleep", str(args.step_sleep), "--min-islands", "3", "--eval-every", "1000"]
    c = chaos.Cluster(workdir, island_args=common, min_islands=3, join_timeout_ms=args.join_timeout_ms)
    c.start_lighthouse()
    for i in range(3):
        c.start(i, ["--slow", str(slow)] if i == 2 and slow != 1.0 else [])
    hung = c.wait(args.timeout)
    c.stop_lighthouse()
    if hung:
        raise SystemExit(f"islands {hung} did not finish within {args.timeout} s (logs in {workdir})")
    rows = c.rows()
    out = []
    for i in range(3):
        mine = [r for r in rows if r.get("island") == str(i)]
        rounds = sorted((r for r in mine if r.get("round")), key=lambda r: r["round"])
        done = next(r for r in mine if r.get("done"))
        first, last = rounds[0], rounds[-1]
        rate = (last["step"] - first["step"]) / (last["time"] - first["time"])
        out.append({
            "island": i, "slow": slow if i == 2 else 1.0, "steps_per_s": rate,
            "waited_median": statistics.median(r["waited"] for r in rounds[1:]),
            "rounds": len(rounds), "val_loss": done["val_loss"],
            "solo_steps_per_s": done["steps_timed"] / done["compute_seconds"],
        })  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow", default="1,2,4", help="comma-separated factors for island 2, one run each")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--join-timeout-ms", type=int, default=1000, help="the lighthouse's join timeout")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench_stragglers_")
    print(f"# bench_stragglers (logs in {workdir}; load average {os.getloadavg()[0]:.1f})\n")
    print(
        "| island 2 at --slow | island | steps/s | its compute alone, steps/s | goodput | median waited, s | final val loss |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    results = []
    for slow in [float(x) for x in args.slow.split(",")]:
        rows = run(os.path.join(workdir, f"slow{slow:g}"), slow, args)
        results.append(rows)
        for r in rows:
            goodput = r["steps_per_s"] / r["solo_steps_per_s"]
            print(
                f"| {slow:g} | {r['island']}{' (slow)' if r['slow'] != 1.0 else ''} | {r['steps_per_s']:.2f} | "
                f"{r['solo_steps_per_s']:.2f} | {goodput:.2f} | {r['waited_median']:.2f} | {r['val_loss']:.4f} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
