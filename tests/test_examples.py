"""The examples run end to end on small settings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers

# A row of each kind the demo trains: fused dense, a bf16 wire, per-worker parameters, a compressor,
# a warm-up (DimReduce), bf16 parameters with a loss scale, sized for the worker count (two).
DEMO_ROWS = (
    "dense",
    "bf16",
    "local_sgd",
    "powersgd_r1",
    "dimreduce",
    "bf16_loss_scale",
    "onebit_adam",
    "zero_one_adam",
)


@pytest.mark.slow
def test_demo_trains_a_row_of_each_kind(tmp_path, capsys):
    demo = helpers.load_example("demo")
    assert set(DEMO_ROWS) <= set(demo.methods())
    argv = ["--steps", "6", "--workers", "4", "--out", str(tmp_path), "--methods", ",".join(DEMO_ROWS)]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in rows] == list(DEMO_ROWS)
    for r in rows:
        assert 0.0 <= r["test_accuracy"] <= 1.0
        assert r["bytes_per_step"] > 0 and r["ms_per_step"] > 0
        assert f"| {r['method']} |" in out
    by = {r["method"]: r for r in rows}
    assert by["dense"]["step_time_vs_dense"] == 1.0
    assert all(r["step_time_vs_dense"] > 0 for r in rows)
    assert by["powersgd_r1"]["bytes_per_step"] < by["dense"]["bytes_per_step"] / 10
    # Half the bytes; the 16-bit ring pads the buffer to a multiple of the worker count.
    assert by["bf16"]["compression_ratio"] == pytest.approx(2.0, rel=1e-3)
    # bf16 parameters too: still compared with a float32 all-reduce of the same parameters.
    assert by["bf16_loss_scale"]["compression_ratio"] == pytest.approx(2.0, rel=1e-2)
    assert (tmp_path / "loss_vs_step.png").stat().st_size > 10_000
    assert (tmp_path / "loss_vs_bytes.png").stat().st_size > 10_000


@pytest.mark.slow
def test_every_demo_method_builds_its_step_and_lowers_it():
    """Every row of the demo, as ``train`` builds it, lowered on 4 workers (traced, not compiled)."""
    demo = helpers.load_example("demo")
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    model = demo.MLP()
    params0 = model.init(jax.random.key(0), jnp.zeros((1, 64)))
    (x, y), _ = demo.load_data(0)
    batch = demo.batch_at(x, y, 16 * 4, 0, 0)
    loss_fn = demo.loss_function(model)
    # DimReduce fits its subspace on the warm-up's snapshots: distinct ones.
    warmed = [model.init(jax.random.key(k), jnp.zeros((1, 64))) for k in range(4)]
    for name, method in demo.methods().items():
        start = demo.start_params(method, params0)
        _, step = demo.make_step(method, loss_fn, mesh, warmed if method.warmup else [])
        params, opt_state = step.abstract_init(start)
        assert step.lower(params, opt_state, batch).as_text(), name


def test_demo_rejects_unknown_method(tmp_path):
    demo = helpers.load_example("demo")
    with pytest.raises(SystemExit):
        demo.main(["--methods", "dense,nope", "--out", str(tmp_path)])


def test_demo_checkpoint_keeps_the_curve_as_of_the_save(tmp_path):
    """The save finishes in the background; appending to the curve afterwards must not leak in."""
    demo = helpers.load_example("demo")
    ckpt = demo.Checkpoints(str(tmp_path), every=1)
    losses = [1.0, 0.5]
    ckpt.save("main", 2, {"w": np.zeros(3, np.float32)}, {"losses": losses})
    losses.extend([0.25] * 1000)
    ckpt.manager("main").wait_until_finished()
    _, meta = ckpt.restore("main", 2, {"w": np.zeros(3, np.float32)})
    assert meta["losses"] == [1.0, 0.5]
    ckpt.check_curve(meta["losses"], 2)
    with pytest.raises(RuntimeError, match="holds 2 losses"):
        ckpt.check_curve(meta["losses"], 3)


def _demo_cmd(out, ckpt, steps):
    return [
        sys.executable,
        str(helpers.ROOT / "examples" / "demo.py"),
        "--methods",
        "dense,powersgd_r2",
        "--workers",
        "4",
        "--steps",
        str(steps),
        "--checkpoint-every",
        "20",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(ckpt),
    ]


@pytest.mark.slow
def test_demo_killed_mid_run_resumes_to_the_same_result(tmp_path):
    steps = 400
    env = helpers.child_env(devices=4)
    # The uninterrupted run.
    done = subprocess.run(
        _demo_cmd(tmp_path / "a", tmp_path / "ck_a", steps),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    # A run killed (SIGKILL) once PowerSGD has saved a checkpoint part-way.
    ck = tmp_path / "ck_b"
    proc = subprocess.Popen(
        _demo_cmd(tmp_path / "b", ck, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    saved = ck / "powersgd_r2" / "main"
    deadline = time.monotonic() + 300
    while not (saved.is_dir() and any(p.name.isdigit() and int(p.name) >= 40 for p in saved.iterdir())):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    assert not (ck / "powersgd_r2" / "row.json").exists(), "the run finished before it was killed"
    dense_row = (ck / "dense" / "row.json").stat().st_mtime_ns

    resumed = subprocess.run(
        _demo_cmd(tmp_path / "b", ck, steps), env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (ck / "dense" / "row.json").stat().st_mtime_ns == dense_row  # finished methods are not rerun
    for name in ("dense", "powersgd_r2"):
        a = json.loads((tmp_path / "ck_a" / name / "row.json").read_text())
        b = json.loads((ck / name / "row.json").read_text())
        assert len(b["losses"]) == steps
        assert b["losses"] == a["losses"]  # every loss, before and after the kill, bit for bit
        assert b["test_accuracy"] == a["test_accuracy"]
    rows_a = json.loads((tmp_path / "a" / "results.json").read_text())
    rows_b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [r["test_accuracy"] for r in rows_a] == [r["test_accuracy"] for r in rows_b]


def test_demo_rejects_bad_checkpoint_interval(tmp_path):
    demo = helpers.load_example("demo")
    with pytest.raises(SystemExit):
        demo.main(["--checkpoint-every", "0", "--out", str(tmp_path)])


@pytest.mark.parametrize("tx,workers", [("top_k", 8), ("diloco", 4)])
def test_own_shard_map_equals_data_parallel_step(tx, workers, capsys):
    own = helpers.load_example("own_shard_map")
    assert own.main(["--tx", tx, "--workers", str(workers), "--steps", "4"]) == 0
    assert "bit-identical to data_parallel_step: True" in capsys.readouterr().out


def test_place_params_old_keyword_still_works():

    import jax.numpy as jnp

    import jaxopt_dist as jd

    mesh = helpers.make_mesh(2)
    new = jd.place_params({"w": jnp.ones(3)}, mesh=mesh, per_worker_params=True)
    with pytest.warns(DeprecationWarning, match="`per_worker` is deprecated.*`per_worker_params`"):
        old = jd.place_params({"w": jnp.ones(3)}, mesh=mesh, per_worker=True)
    assert old["w"].shape == new["w"].shape == (2, 3)
    assert old["w"].sharding == new["w"].sharding
    with pytest.raises(TypeError, match="Pass `per_worker_params` only"):
        jd.place_params({"w": jnp.ones(3)}, mesh=mesh, per_worker_params=True, per_worker=True)


def _round(island, round_, t, participants, healed=False, redone=0):
    return {
        "island": island,
        "round": round_,
        "step": 10 * round_,
        "participants": participants,
        "healed": healed,
        "redone": redone,
        "anchor_sha256": f"a{round_}",
        "val_loss": 1.0 / round_,
        "time": t,
    }


def test_chaos_checks_fail_on_a_fault_not_seen_or_an_error():
    """A restart counts as seen only when the restarted process heals (not an earlier heal of the
    island); an island's error record fails the run too."""
    chaos = helpers.load_example("islands_chaos")
    kill, restart = chaos.Fault("kill", 2, 1, fired_at=10.0), chaos.Fault("restart", 2, 2, fired_at=20.0)
    rows = [
        _round("2", 1, 5.0, ["0", "1", "2"], healed=True),  # island 2 healed at start-up, before its restart
        *[_round(i, 1, 5.0, ["0", "1", "2"]) for i in ("0", "1")],
        *[_round(i, 2, 12.0, ["0", "1"]) for i in ("0", "1")],
        {"island": "0", "done": True, "val_loss": 0.5, "time": 30.0},
    ]
    for f in (kill, restart):
        f.seen = chaos.seen(f, rows, [])
    assert kill.seen == "island 0 committed round 2 without island 2, 2.0 s after it"
    assert restart.seen is None
    summary = chaos.summarize(rows, [], [kill, restart])
    assert not summary["ok"] and not summary["checks"]["every fault seen"]
    assert summary["faults"] == {"kill:2@1": kill.seen, "restart:2@2": "not seen"}

    rows.append(_round("2", 3, 25.0, ["0", "1", "2"], healed=True))  # the restarted process heals
    restart.seen = chaos.seen(restart, rows, [])
    assert restart.seen == "island 2 healed in round 3 after its restart, 5.0 s after it"
    assert chaos.summarize(rows, [], [kill, restart])["ok"]
    failed = chaos.summarize(
        [*rows, {"island": "1", "error": "no quorum of islands within 60 s"}], [], [kill, restart]
    )
    assert not failed["ok"] and failed["errors"] and not failed["checks"]["no island logged an error"]
    assert not chaos.summarize(rows, [1], [kill, restart])["ok"]  # a hang


def test_a_waiting_island_says_how_many_islands_it_has_and_needs():
    """While a quorum does not form, one line every few seconds with the lighthouse's counts."""
    import http.server
    import io
    import threading

    islands = helpers.load_example("islands")
    status = b"Next quorum status: New quorum not ready, only have 1 participants, need min_replicas 2 [1/1]"
    assert islands.quorum_counts(status.decode()) == (1, 2)
    assert islands.quorum_counts("only have 2 participants, need at least half of 5 healthy workers") == (
        2,
        3,
    )
    assert islands.quorum_counts("Fast quorum found!") is None

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/status" else 404)
            self.end_headers()
            self.wfile.write(status)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = io.StringIO()

    class Slow:  # a transport whose quorum forms once two lines with the lighthouse's counts are out
        def quorum(self, timeout):
            deadline = time.monotonic() + min(timeout, 60)
            while out.getvalue().count("have 1 of 2") < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            return None

    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert islands.QuorumWatch(Slow(), address, 2, every=0.05, out=out).quorum(60.0) is None
    finally:
        server.shutdown()
    lines = out.getvalue().splitlines()
    assert sum("have 1 of 2" in line for line in lines) >= 2, lines
    for line in lines:  # (a lighthouse slower than 1 s to answer: the island's own count)
        assert re.fullmatch(
            r"waiting for islands: (have 1 of 2 needed|need 2 \(--min-islands\)) since [\d:]{8}", line
        )
    # No lighthouse to ask: what the island itself needs.
    line = islands.waiting_line("127.0.0.1:1", 2, 0.0)
    assert re.fullmatch(r"waiting for islands: need 2 \(--min-islands\) since \d\d:\d\d:\d\d", line), line


def test_the_islands_example_takes_the_robust_aggregates_and_byzantine_modes(capsys):
    """examples/islands.py's --aggregate robust names and --byzantine modes, exactly as documented; each
    name builds its rule as the diloco's aggregate, and a Byzantine island's outbox holds what its mode
    says in place of its pseudo-gradient."""
    islands = helpers.load_example("islands")
    common = ["--island-id", "0", "--lighthouse", "127.0.0.1:1"]
    rules = {
        "trimmed_mean:2": "trimmed_mean",
        "median": "coordinate_median",
        "centered_clip:0.5": "centered_clip",
        "centered_clip": "centered_clip",
        "norm_clip": "norm_clipped_mean",
    }
    for name, rule in rules.items():
        args = islands.parse_args([*common, "--aggregate", name])
        assert islands.build(args).tx.external.gathered.name == rule
    for mode in ("nan", "signflip:10", "scale:100", "random:1"):
        assert islands.parse_args([*common, "--byzantine", mode]).byzantine == mode
    bad = [
        ["--aggregate", "trimmed_mean"],
        ["--aggregate", "trimmed_mean:-1"],
        ["--aggregate", "centered_clip:0"],
        ["--aggregate", "median:3"],
        ["--byzantine", "signflip"],
        ["--byzantine", "random:0"],
        ["--byzantine", "nan:1"],
        ["--aggregate", "median", "--eager"],
    ]
    for argv in bad:
        with pytest.raises(SystemExit):
            islands.parse_args([*common, *argv])
    capsys.readouterr()

    class Exchange:
        def launches_after(self, t):
            return [0] if t == 3 else []

    d = jnp.asarray(np.arange(1.0, 7.0, dtype=np.float32).reshape(1, 6))
    for mode, want in {"nan": np.full((1, 6), np.nan), "signflip:10": -10 * d, "scale:3": 3 * d}.items():
        step = islands.ByzantineStep(None, Exchange(), mode, island_id=1)
        np.testing.assert_array_equal(np.asarray(step.replace(d, 3, 0)), np.asarray(want, np.float32))
    noise = np.asarray(islands.ByzantineStep(None, Exchange(), "random:2", island_id=1).replace(d, 3, 0))
    assert noise.shape == (1, 6) and 0.5 < np.std(noise) < 5 and not np.allclose(noise, d)
