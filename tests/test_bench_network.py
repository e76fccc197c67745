"""benchmarks/bench_network.py, bench_network_e2e.py and their harness shaped_link.py, run small.

Two processes on a loopback coordinator (``jax.distributed``, gloo), tiny
ResNet-18 shapes (base width 2), unshaped, two methods, two timed steps: the
harness starts, times every method in both processes, linked and each on its
own device (the compute-only time), and prints a table whose bytes agree with
``communication_cost``. ``bench_network_e2e.py --e2e-set lowcomm`` (dense
AdamW, DiLoCo, Streaming DiLoCo) runs unshaped on a 64-16-16-10 MLP for 60
steps, past every row's first synchronisation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

SCRIPT = helpers.ROOT / "benchmarks" / "bench_network.py"
E2E_SCRIPT = helpers.ROOT / "benchmarks" / "bench_network_e2e.py"
METHODS = ("dense", "powersgd_r1")
TIMEOUT_S = 900  # about 25 s on an idle machine; generous for a loaded one


def _bench_module():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_network

    return bench_network


def _harness():
    sys.path.insert(0, str(SCRIPT.parent))
    import shaped_link

    return shaped_link


def _e2e_module():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_network_e2e

    return bench_network_e2e


def _run_bench(out, *args, script=SCRIPT):
    """Runs the benchmark ``script`` with ``args`` and ``--json out``; returns the saved JSON."""
    argv = [sys.executable, str(script), *args, "--json", str(out)]
    r = subprocess.run(argv, env=helpers.child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return json.loads(out.read_text()), r


def test_two_process_smoke(tmp_path):
    saved, r = _run_bench(
        tmp_path / "result.json",
        *("--procs", "2", "--no-shape", "--width", "2", "--repeats", "2", "--calibration-mb", "1"),
        *("--methods", ",".join(METHODS), "--torch-methods", ""),
    )
    res = saved["jax"]
    assert res["procs"] == 2
    assert list(res["methods"]) == list(METHODS)  # the dense row first
    shapes = _bench_module().resnet18_shapes(2)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    for name in METHODS:
        row = res["methods"][name]
        for timing in (row["rates"]["unshaped"], row["compute"]):
            times = timing["times_s"]
            assert len(times) == 2 and all(0 < t < 60 for t in times), (name, times)
            assert timing["median_s"] == pytest.approx(float(np.median(times)))
        make = {"dense": jd.all_reduce, "powersgd_r1": lambda: jd.powersgd(rank=1)}[name]
        cost = jd.communication_cost(optax.chain(make(), jd.sgd(0.1, momentum=0.9)), params, num_workers=2)
        assert res["methods"][name]["sent_bytes"] == pytest.approx(cost.sent_bytes)
    # --malloc auto (the default): tcmalloc where installed, else glibc with huge pages.
    expected = "tcmalloc" if _harness().tcmalloc() else "glibc"
    if os.path.exists("/proc/self/maps"):
        assert res["malloc"] == expected
    assert ("tcmalloc preloaded" in saved["note"]) == (expected == "tcmalloc")
    if hasattr(os, "sched_getaffinity"):  # --pin cores (the default): worker 0 on the first usable CPU
        assert res["cpus"] == [min(os.sched_getaffinity(0))]
        assert "pinned to CPU" in saved["note"]
    assert f"CPU: {_harness().cpu_model()}" in saved["note"]
    cal = res["link"]["unshaped"]
    assert cal["allreduce_4B_s"] > 0 and cal["allreduce_probe_s"] > 0
    # The table: one row per method under the unshaped heading, dense first.
    table = r.stdout[r.stdout.index("### unshaped") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(METHODS), table
    assert rows[0].split(" | ")[2] == "1.00"  # dense over itself
    for row, name in zip(rows, METHODS):  # the compute column: the method's own compute-only median
        assert row.split(" | ")[5] == f"{res['methods'][name]['compute']['median_s']:.3f}"


def test_time_rounds_alternates_and_splits_the_repeats():
    """Every run gets its share in each of the rounds, after entering its rate and a warm-up step."""
    bench, log = _harness(), []
    runs = [
        (key, rate, lambda key=key: log.append(key))
        for key, rate in [("compute", "unshaped"), ("1gbit", "1gbit")]
    ]
    out = bench.time_rounds(runs, lambda rate: log.append(f"enter {rate}"), repeats=7)
    assert bench.ROUNDS == 3
    per_round = [
        ["enter unshaped"] + ["compute"] * (1 + k) + ["enter 1gbit"] + ["1gbit"] * (1 + k) for k in (3, 2, 2)
    ]
    assert log == [e for r in per_round for e in r]
    assert {k: len(v["times_s"]) for k, v in out.items()} == {"compute": 7, "1gbit": 7}
    assert len(bench.time_rounds(runs, lambda rate: None, repeats=1)["compute"]["times_s"]) == 1


def test_tables_read_the_compute_column_of_older_json_files():
    """Files saved before the compute-only time moved into each method's entry still print."""
    bench = _bench_module()
    res = {"methods": {"dense": {"rates": {}}, "new": {"rates": {}, "compute": {"median_s": 0.5}}}}
    old = {"methods": {"dense": {"rates": {"unshaped": {"median_s": 0.25}}}}}
    assert bench._compute_s(res, "dense", old) == 0.25
    assert bench._compute_s(res, "new", old) == 0.5
    assert bench._compute_s(res, "dense") is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rates", "2gbit"], "--rates"),
        (["--torch-methods", "torch_nope"], "--torch-methods"),
        (["--coordinator", "h:1"], "needs --num-processes"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id"),
        (["--repeats", "0"], "--repeats"),
        (["--e2e", "--e2e-set", "lowcomm"], "bench_network_e2e.py"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        _bench_module().parse_args(argv)
    assert message in capsys.readouterr().err


def test_unknown_method_is_rejected():
    with pytest.raises(SystemExit, match="unknown"):
        _bench_module().main(["--methods", "dense,nope"])


def test_every_method_builds_a_transform():
    table = _bench_module().methods(jd, jnp)
    assert next(iter(table)) == "dense"
    params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    for name, (_, make) in table.items():
        tx = make()
        assert isinstance(tx, optax.GradientTransformation), name
        assert jd.communication_cost(tx, params, num_workers=2).sent_bytes > 0, name


LOWCOMM_ROWS = ("dense", "diloco", "streaming", "streaming_tau5")


@pytest.mark.slow
def test_e2e_lowcomm_smoke(tmp_path):
    """The DiLoCo set of the end-to-end runs, unshaped and tiny: every row trains past its first synchronisation."""
    saved, r = _run_bench(
        tmp_path / "e2e.json",
        *("--e2e-set", "lowcomm", "--no-shape", "--e2e-hidden", "16", "--e2e-batch", "32"),
        *("--e2e-max-steps", "60", "--e2e-eval-every", "20", "--e2e-target", "0.999"),
        script=E2E_SCRIPT,
    )
    res = saved["e2e"]
    assert res["procs"] == 2 and res["set"] == "lowcomm" and res["rate"] == "unshaped"
    assert list(res["methods"]) == list(LOWCOMM_ROWS)
    rows = _e2e_module().e2e_lowcomm_methods(jd, optax)
    params = {
        "b1": jnp.zeros(16),
        "b2": jnp.zeros(16),
        "b3": jnp.zeros(10),
        "w1": jnp.zeros((64, 16)),
        "w2": jnp.zeros((16, 16)),
        "w3": jnp.zeros((16, 10)),
    }
    for name, row in res["methods"].items():
        assert not row["reached"] and row["steps"] == 60, (name, row["steps"])
        assert len(row["times_s"]) == 60 and all(0 < t < 60 for t in row["times_s"]), name
        assert row["per_worker_params"] == (name != "dense")
        # Above chance (10%): the DiLoCo rows are read on the anchor, which moved at the synchronisations.
        assert 0.2 < row["accuracy"] < 0.999, (name, row["accuracy"])
        cost = jd.communication_cost(rows[name][1](), params, num_workers=2)
        assert row["sent_bytes"] == pytest.approx(cost.sent_bytes)
        assert row["peak_sent_bytes"] == pytest.approx(cost.peak_sent_bytes)
    sent = [res["methods"][n]["sent_bytes"] for n in LOWCOMM_ROWS[:3]]
    assert sent[0] > sent[1] > sent[2] > 0  # dense > DiLoCo (1/50) > 4-bit streaming
    table = r.stdout[r.stdout.index("| method") :]
    names = [line.split(":")[0][2:] for line in table.splitlines()[2:] if line.startswith("| ")]
    assert names == list(LOWCOMM_ROWS), table


def test_e2e_unknown_row_is_rejected():
    with pytest.raises(SystemExit, match="--e2e-methods"):
        _e2e_module().main(["--e2e-set", "lowcomm", "--e2e-methods", "dense,nope"])


def test_e2e_lowcomm_rows_build():
    rows = _e2e_module().e2e_lowcomm_methods(jd, optax)
    assert next(iter(rows)) == "dense" and not rows["dense"][2]
    params = {"w1": jnp.zeros((8, 4)), "b1": jnp.zeros(4), "w2": jnp.zeros((4, 2)), "b2": jnp.zeros(2)}
    for name, (_, make, per_worker) in rows.items():
        assert per_worker == (name != "dense"), name
        assert jd.communication_cost(make(), params, num_workers=2).sent_bytes > 0, name


def test_workers_get_the_malloc_asked_for(monkeypatch):
    """``--malloc auto`` (the default) is tcmalloc where installed, else huge pages;
    ``tcmalloc`` preloads it (and fails clearly where it is missing); ``hugepages``
    adds glibc's tunable, keeping tunables already set; ``default`` adds nothing."""
    bn = _harness()
    assert _bench_module().parse_args([]).malloc == "auto"
    assert _e2e_module().parse_args([]).malloc == "auto"
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert bn.child_env("hugepages")["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in bn.child_env("default")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert bn.child_env("hugepages")["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert bn.child_env("default")["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    assert (
        "GLIBC_TUNABLES" in bn.malloc_note("hugepages") and bn.malloc_note("default") == "default environment"
    )
    monkeypatch.setattr(bn, "tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert bn.resolve_malloc("auto") == "tcmalloc"
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    env = bn.child_env("tcmalloc")
    assert (
        env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libother.so" and "hugetlb" not in env["GLIBC_TUNABLES"]
    )
    assert bn.child_env("hugepages")["LD_PRELOAD"] == "libother.so"  # the environment's own, untouched
    assert "tcmalloc preloaded" in bn.malloc_note("tcmalloc")
    monkeypatch.setattr(bn, "tcmalloc", lambda: None)
    assert bn.resolve_malloc("auto") == "hugepages"
    assert bn.resolve_malloc("default") == "default"
    with pytest.raises(SystemExit, match="libtcmalloc-minimal4"):
        bn.resolve_malloc("tcmalloc")


def test_workers_are_pinned_one_per_cpu():
    """``--pin cores`` (the default) gives worker ``i`` the ``i``-th usable CPU
    (modulo their number); ``--pin none`` pins nothing."""
    bn, harness = _bench_module(), _harness()
    assert bn.parse_args([]).pin == "cores"
    if not hasattr(os, "sched_getaffinity"):
        assert harness.cpu_for("cores", 0) is None
        return
    cpus = sorted(os.sched_getaffinity(0))

    def cpu_arg(argv):
        return int(argv[argv.index("--cpu") + 1]) if "--cpu" in argv else None

    args = bn.parse_args(["--procs", "3"])
    args.methods = ["dense"]
    got = [cpu_arg(bn.worker_argv(args, "jax", 3, i, "h:1", "out")) for i in range(3)]
    assert got == [cpus[i % len(cpus)] for i in range(3)]
    args.pin = "none"
    assert cpu_arg(bn.worker_argv(args, "jax", 3, 0, "h:1", "out")) is None
    assert harness.pin_note("none", 2) == "workers not pinned"
    assert "pinned to CPU" in harness.pin_note("cores", 2)
    assert "some sharing a CPU" in harness.pin_note("cores", len(cpus) + 1)


def test_projections_trace_the_workers_program(monkeypatch):
    """The launcher (one process) projects the program the workers ran: with several
    processes the default all_reduce() sends one buffer on CPU, so it pays one call's
    latency where the per-leaf form pays one per leaf."""
    import jax

    bn = _bench_module()
    monkeypatch.setattr(_harness(), "configure_jax", lambda devices: None)  # JAX already runs here
    link = {"unshaped": {"allreduce_4B_s": 1e-4, "probe_mb": 1, "allreduce_probe_s": 0.01}}
    res = {"procs": 2, "width": 8, "link": link, "methods": {"dense": {}, "dense_per_leaf": {}}}
    proj = bn.projections(res, "gloo")
    leaves = len(bn.resnet18_shapes(8))
    per_round = _harness().link_model(link, "unshaped", 2)[1] * 1e-6
    extra = (leaves - 1) * 2 * per_round  # 2 (n - 1) rounds per call
    assert proj["dense_per_leaf"]["unshaped"] - proj["dense"]["unshaped"] == pytest.approx(extra, rel=1e-6)
    assert jax.process_count() == 1  # the launcher's own platform is untouched


def test_traced_costs_trace_the_workers_platform(monkeypatch):
    """``traced_costs`` traces for ``res["procs"]`` CPU processes (``platform=``, no patching):
    all_reduce() is one packed all-reduce for 2 processes and one per leaf for 1."""
    import jax

    bn = _bench_module()
    monkeypatch.setattr(_harness(), "configure_jax", lambda devices: None)  # JAX already runs here
    leaves = len(bn.resnet18_shapes(2))
    for procs, expected in [(2, 1), (1, leaves)]:
        costs = bn.traced_costs({"procs": procs, "width": 2, "methods": {"dense": {}}})
        collectives = costs["dense"].steps[0].collectives
        assert [c.kind for c in collectives] == ["all_reduce"] * expected, procs
        assert sum(c.multiplier for c in collectives) == expected, procs
    assert jax.process_count() == 1
    for script in ("bench_network.py", "bench_network_e2e.py", "shaped_link.py"):
        assert "unittest" not in (SCRIPT.parent / script).read_text(), script


def test_harness_imports_without_torch_or_jax():
    """A launcher imports the harness light: no torch needed, JAX not imported."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch fails\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "import shaped_link\n"
        "assert shaped_link.RATES['unshaped'] is None\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=helpers.child_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_bucket_speedup_models_the_token_bucket():
    """Up to min(burst, rate * compute) of a step's bytes cross unpaced; the rest at the rate."""
    bench = _bench_module()
    burst = _harness().TBF_BURST_BYTES
    link = {"1gbit": {"allreduce_4B_s": 1e-4}}
    res = {"procs": 2, "link": link, "methods": {}}

    def speedup(sent_bytes, compute_s, rate="1gbit"):
        res["methods"]["m"] = {"sent_bytes": sent_bytes, "rates": {}, "compute": {"median_s": compute_s}}
        return bench._bucket_speedup(res, "m", rate)

    rate_bytes_s = 1e9 / 8
    # 8 MB a step from each of 2 workers, 1 s of compute: the whole bucket refills; 2 MiB of 16 MB ride it.
    assert speedup(8e6, 1.0) == pytest.approx(16e6 / (16e6 - burst))
    # 10 ms of compute refill 1.25 MB only.
    assert speedup(8e6, 0.01) == pytest.approx(16e6 / (16e6 - 0.01 * rate_bytes_s))
    # Everything fits in the bucket: as fast as the bare loopback allows (1000x when not calibrated) ...
    assert speedup(1e5, 1.0) == pytest.approx(1000.0)
    # ... or its calibrated bandwidth: 16 MB all-reduced in 10 ms between 2 workers, 13.4 Gbit/s each.
    link["unshaped"] = {"allreduce_4B_s": 1e-4, "probe_mb": 16, "allreduce_probe_s": 0.01}
    bare_gbps = _harness().link_model(link, "unshaped", 2)[0]
    assert speedup(1e5, 1.0) == pytest.approx(bare_gbps * 2 / 1.0)
    # No bucket on the bare loopback; no credit without a compute time.
    assert speedup(8e6, 1.0, "unshaped") == 1.0
    assert speedup(8e6, 0.0) == 1.0
