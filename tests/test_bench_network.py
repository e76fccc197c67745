"""benchmarks/bench_network.py: the multi-process harness, run small.

Two processes on a loopback coordinator (``jax.distributed``, gloo), tiny
ResNet-18 shapes (base width 2), unshaped, two methods, two timed steps: the
harness starts, times every method in both processes and in the one-process
compute-only run, and prints a table whose bytes agree with
``communication_cost``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

SCRIPT = helpers.ROOT / "benchmarks" / "bench_network.py"
METHODS = ("dense", "powersgd_r1")
TIMEOUT_S = 900  # about 25 s on an idle machine; generous for a loaded one


def _bench_module():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_network

    return bench_network


def test_two_process_smoke(tmp_path):
    out = tmp_path / "result.json"
    argv = [
        sys.executable,
        str(SCRIPT),
        *("--procs", "2", "--no-shape", "--width", "2", "--repeats", "2", "--calibration-mb", "1"),
        *("--methods", ",".join(METHODS), "--torch-methods", "", "--json", str(out)),
    ]
    r = subprocess.run(argv, env=helpers.child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    saved = json.loads(out.read_text())
    res, compute = saved["jax"], saved["compute"]
    assert res["procs"] == 2 and compute["procs"] == 1
    assert list(res["methods"]) == list(METHODS)  # the dense row first
    shapes = _bench_module().resnet18_shapes(2)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    for name in METHODS:
        for run in (res, compute):
            times = run["methods"][name]["rates"]["unshaped"]["times_s"]
            assert len(times) == 2 and all(0 < t < 60 for t in times), (name, times)
        make = {"dense": jd.all_reduce, "powersgd_r1": lambda: jd.powersgd(rank=1)}[name]
        cost = jd.communication_cost(optax.chain(make(), jd.sgd(0.1, momentum=0.9)), params, axis_size=2)
        assert res["methods"][name]["sent_bytes"] == pytest.approx(cost.sent_bytes)
        assert compute["methods"][name]["sent_bytes"] == 0  # one worker sends nothing
    cal = res["link"]["unshaped"]
    assert cal["allreduce_4B_s"] > 0 and cal["allreduce_probe_s"] > 0
    # The table: one row per method under the unshaped heading, dense first.
    table = r.stdout[r.stdout.index("### unshaped") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(METHODS), table
    assert rows[0].split(" | ")[2] == "1.00"  # dense over itself


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rates", "2gbit"], "--rates"),
        (["--torch-methods", "torch_nope"], "--torch-methods"),
        (["--coordinator", "h:1"], "needs --num-processes"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id"),
        (["--repeats", "0"], "--repeats"),
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
        assert jd.communication_cost(tx, params, axis_size=2).sent_bytes > 0, name
