"""Islands over torchft, as processes: real SIGKILL, SIGSTOP, restarts and a lighthouse restart.

Each island is a process of ``examples/islands.py``; the lighthouse is one
too; ``examples/islands_chaos.py`` starts them and fires the faults. These
tests need torch and torchft (``pip install ".[islands]"``): they skip where
those are missing, except under ``JAXOPT_DIST_REQUIRE_TORCHFT=1`` (the CI
leg that installs them), where a missing torchft is a failure.
"""

from __future__ import annotations

import glob
import os
import sys

import jax
import numpy as np
import pytest

import jaxopt_dist as jd
from tests import helpers

if os.environ.get("JAXOPT_DIST_REQUIRE_TORCHFT") != "1":
    pytest.importorskip("torchft")
else:
    import torchft  # noqa: F401

chaos = helpers.load_example("islands_chaos")
example = helpers.load_example("islands")
H = 10


def _cluster(tmp_path, *, min_islands=2, extra=()):
    return chaos.Cluster(
        str(tmp_path),
        island_args=[
            "--sync-every",
            str(H),
            "--min-islands",
            str(min_islands),
            "--quorum-timeout",
            "30",
            *extra,
        ],
        min_islands=min_islands,
        join_timeout_ms=2000,
        heartbeat_timeout_ms=2000,
        python=sys.executable,
    )


def _rounds(rows, island=None):
    return [r for r in rows if "round" in r and (island is None or r["island"] == str(island))]


def _first_after(rows, t, island, without):
    later = [r for r in _rounds(rows, island) if r["time"] > t and str(without) not in r["participants"]]
    return min(later, key=lambda r: r["time"])


def _exclusion_bound(rows, before):
    """Seconds the survivors may take to leave a dead or stopped island out of a committed round.

    The round in flight finishes its inner steps, its all-reduce times out (``--timeout`` 2 s), the
    next quorum waits out the heartbeat (2 s) and the join window (2 s), and the redone exchange
    runs: the configured timeouts plus three rounds at the pace island 0 kept before the fault (so
    a loaded machine widens the bound with its own slowness) and a margin, never more than 25 s,
    short of the quorum timeout (30 s).
    """
    times = [r["time"] for r in _rounds(rows, 0) if r["time"] < before]
    pace = float(np.median(np.diff(times))) if len(times) > 2 else 2.0
    return min(2.0 + 2.0 + 2.0 + 3 * pace + 4.0, 25.0)


def _event_time(cluster, name, island):
    return next(e["time"] for e in cluster.events if e["event"] == name and e.get("island") == island)


def _reference_anchors(n, steps, extra=()):
    """The in-process diloco of examples/islands.py on ``n`` workers: the anchor after every step."""
    args = example.parse_args(
        ["--island-id", "0", "--lighthouse", "-", "--steps", str(steps), "--sync-every", str(H), *extra]
    )
    setup = example.build(args)
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    step = jd.data_parallel_step(setup.loss_fn, setup.tx, mesh=mesh, per_worker_params=True)
    p, s = step.init(setup.params)
    out = []
    for t in range(steps):
        p, s, _ = step(
            p, s, jax.tree.map(lambda *xs: np.concatenate(xs), *[setup.batch_for(i, t) for i in range(n)])
        )
        out.append(jax.device_get(s.anchor))
    return out


@pytest.mark.parametrize("eager", [False, True], ids=["diloco", "eager"])
def test_fault_free_islands_match_in_process_diloco(tmp_path, eager):
    """Three islands over torchft: every round's anchor is the in-process diloco's on three workers
    (under eager, island i's is worker i's; the islands agree on the merged mean)."""
    steps, extra = 4 * H, ["--eager"] if eager else []
    cluster = _cluster(
        tmp_path, min_islands=3, extra=["--steps", str(steps), "--anchors-dir", str(tmp_path), *extra]
    )
    cluster.start_lighthouse()
    for i in range(3):
        cluster.start(i)
    hung = chaos.run_faults(cluster, [], timeout=240)
    rows = cluster.rows()
    assert not hung and chaos.summarize(rows, hung)["errors"] == []
    ref = _reference_anchors(3, steps, extra)
    for r in _rounds(rows):
        assert r["participants"] == ["0", "1", "2"] and r["weights"] == [1.0, 1.0, 1.0], r
    last = steps // H - eager  # eager lands each round a period late
    assert len({r["agreed_sha256"] for r in _rounds(rows) if r["round"] == last}) == 1
    assert len({r["anchor_sha256"] for r in _rounds(rows) if r["round"] == last}) == (3 if eager else 1)
    files = sorted(glob.glob(str(tmp_path / "island*_round*.npz")))
    assert len(files) == 3 * last
    for path in files:
        saved = np.load(path)
        want = ref[int(saved["step"]) - 1]
        if eager:  # worker i's row
            i = int(os.path.basename(path)[len("island") :].split("_")[0])
            want = {k: v[i] for k, v in want.items()}
        for k, v in want.items():
            assert np.max(np.abs(saved[k] - v)) <= 1e-6 * np.max(np.abs(v)), (path, k)


def _wait(cluster, condition, timeout=240.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition(cluster.rows()):
        assert time.monotonic() < deadline, "the islands did not get there in time"
        time.sleep(0.05)


def test_kills_stops_and_restarts(tmp_path):
    """SIGKILL in inner steps and inside the exchange, restarts that heal, a SIGSTOP past the heartbeat."""
    cluster = _cluster(tmp_path, extra=["--steps", "800", "--step-sleep", "0.03"])
    cluster.start_lighthouse()
    cluster.start(0)
    cluster.start(1, ["--die-in-exchange-at=12"])  # dies as it enters round 12's all-reduce
    cluster.start(2)
    top = lambda rows: max((r["round"] for r in _rounds(rows)), default=-1)  # noqa: E731

    def healed_since_restart(rows, i):  # (an earlier life of the island may have healed too)
        restart = max(e["time"] for e in cluster.events if e["event"] == "start" and e.get("island") == i)
        return any(r.get("healed") and r["time"] > restart for r in _rounds(rows, i))

    stopped = []
    try:
        _wait(cluster, lambda rows: top(rows) >= 4)
        cluster.signal(2, chaos.signal.SIGKILL)
        _wait(cluster, lambda rows: top(rows) >= 6)
        cluster.start(2)
        _wait(cluster, lambda rows: top(rows) >= 14 and healed_since_restart(rows, 2))
        cluster.start(1)
        _wait(cluster, lambda rows: healed_since_restart(rows, 1))
        cluster.signal(2, chaos.signal.SIGSTOP)
        stopped.append(True)
        _wait(cluster, lambda rows: any(r["participants"] == ["0", "1"] for r in _rounds(rows, 0)[-1:]))
        import time

        time.sleep(2.0)
    except BaseException:
        cluster.wait(0)  # kills the islands still running and the lighthouse: nothing outlives a failure
        raise
    finally:
        if stopped:
            cluster.signal(2, chaos.signal.SIGCONT)
    hung = cluster.wait(300)
    rows = cluster.rows()
    summary = chaos.summarize(rows, hung)
    assert summary["hangs"] == 0 and summary["divergent_anchors"] == 0 and summary["errors"] == [], summary
    # The survivors leave a killed island out of their next committed round, soon.
    killed = _event_time(cluster, "SIGKILL", 2)
    assert _first_after(rows, killed, 0, without=2)["time"] - killed < _exclusion_bound(rows, killed)
    # The round in flight when island 1 died inside its all-reduce is kept: redone among the survivors.
    r12 = [r for r in _rounds(rows, 0) if r["round"] == 12]
    assert len(r12) == 1 and "1" not in r12[0]["participants"] and r12[0]["redone"] >= 1
    assert sorted(r["round"] for r in _rounds(rows, 0)) == list(range(1, 81))  # no round lost
    # Restarted islands heal with weight 0, with the survivors' anchor, then take part.
    for i in (1, 2):
        h = [r for r in _rounds(rows, i) if r["healed"]][0]
        assert h["weights"][h["participants"].index(str(i))] == 0.0
        nxt = [r for r in _rounds(rows, i) if r["round"] == h["round"] + 1][0]
        assert nxt["weights"][nxt["participants"].index(str(i))] == 1.0
    # A stopped island is left out within the same bound (its heartbeats stop too), then heals.
    stop = _event_time(cluster, "SIGSTOP", 2)
    assert _first_after(rows, stop, 0, without=2)["time"] - stop < _exclusion_bound(rows, stop)
    assert any(r["healed"] and r["time"] > stop for r in _rounds(rows, 2))
    done = [r for r in rows if r.get("done")]
    assert len(done) == 3 and done[0]["val_loss"] < _rounds(rows, 0)[0]["val_loss"]


def test_a_lighthouse_restart_is_ridden_through(tmp_path):
    """The lighthouse dies for 3 s mid-run and comes back on its address: the islands keep training;
    every round still ends with one anchor among its members, and nobody waits past its bound."""
    cluster = _cluster(tmp_path, extra=["--steps", "300", "--step-sleep", "0.03"])
    cluster.start_lighthouse()
    for i in range(3):
        cluster.start(i)
    hung = chaos.run_faults(cluster, [chaos.Fault("lighthouse", -1, 5, 3.0)], timeout=300)
    rows = cluster.rows()
    summary = chaos.summarize(rows, hung)
    assert summary["hangs"] == 0 and summary["divergent_anchors"] == 0, summary
    restarted = max(e["time"] for e in cluster.events if e["event"] == "lighthouse-start")
    assert len({r["round"] for r in _rounds(rows) if r["time"] > restarted}) >= 10
    assert any(r.get("done") for r in rows)


@pytest.mark.parametrize("inside", ["replicated", "fsdp"])
def test_an_island_of_two_processes(tmp_path, inside):
    """Island 0 is a jax.distributed job of two processes (dense data parallelism over their two
    devices, or its matrices sharded over them), island 1 a single process: their rounds match the
    in-process run on two workers."""
    steps = 3 * H
    # No fault here: a generous all-reduce timeout, so that a slow round on a loaded machine is not one.
    extra = ["--steps", str(steps), "--min-islands", "2", "--anchors-dir", str(tmp_path), "--timeout", "10"]
    cluster = _cluster(tmp_path, extra=extra)
    cluster.start_lighthouse()
    coordinator = f"127.0.0.1:{chaos.free_port()}"
    for k in range(2):  # island 0's two processes
        extra = ["--num-processes", "2", "--process-id", str(k), "--coordinator", coordinator]
        extra += ["--fsdp"] if inside == "fsdp" else []
        cluster.start(0, extra)
        cluster.procs[10 + k] = cluster.procs.pop(0)
    cluster.procs[0] = cluster.procs[10]
    cluster.start(1)
    hung = cluster.wait(240)
    rows = cluster.rows()
    summary = chaos.summarize(rows, hung)
    assert summary["hangs"] == 0 and summary["divergent_anchors"] == 0 and summary["errors"] == [], summary
    assert len(_rounds(rows, 0)) == len(_rounds(rows, 1)) == steps // H
    for r in _rounds(rows):
        assert r["participants"] == ["0", "1"] and r["weights"] == [1.0, 1.0], r
    sharded = {r["island"]: r["sharded_leaves"] for r in rows if r.get("done")}
    assert sharded == {"0": 2 if inside == "fsdp" else 0, "1": 0}, sharded  # w1 and w2 split over 2 devices
    anchors = _reference_anchors(2, steps)[-1]
    final = np.load(tmp_path / f"island0_round{steps // H}.npz")
    for k, v in anchors.items():
        assert np.max(np.abs(final[k] - v)) <= 1e-5 * np.max(np.abs(v)), k
