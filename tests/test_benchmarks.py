"""Each benchmark script runs to the end in its smallest setting (``--quick``).

Benchmarks are not timed here: this only keeps them working on every tested JAX,
where nothing else would notice a script broken by a change of API. The heavy
ones (``bench_compression``'s ResNet-18 timings, the multi-process link
benchmarks) are covered by their own smoke tests or run by hand.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests import helpers

pytestmark = pytest.mark.slow

QUICK = {
    "bench_adasum": ["--quick"],
    "bench_checkpoint": ["--quick"],
    "bench_convergence": ["--quick"],
    "bench_dimreduce": ["--quick"],
    "bench_gossip": ["--quick"],
    "bench_hierarchical": ["--memory-only", "--quick"],
    "bench_lm": ["--quick", "--methods", "dense,powersgd,muloco50"],
    # Rows for each path of the script: dense, a per-worker row with its own `eval`, one with
    # `cost_steps`, a per-worker one without `eval`; every other row is traced below.
    "bench_lowcomm": [
        "--quick",
        "--models",
        "digits MLP",
        "--methods",
        "dense AdamW,DiLoCo H=50,0/1 Adam,choco_top10%",
    ],
    "bench_overhead": ["--quick"],
    "bench_robust": ["--quick"],
    "multihost_sum_order": [],
}


@pytest.mark.parametrize("name", sorted(QUICK))
def test_benchmark_runs(name):
    script = helpers.ROOT / "benchmarks" / f"{name}.py"
    done = subprocess.run(
        [sys.executable, str(script), *QUICK[name]],
        env=helpers.child_env(),
        cwd=helpers.ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the benchmark printed nothing"


def test_every_lowcomm_row_builds_and_traces():
    """Every row of ``bench_lowcomm`` builds its optimizer and traces its training and evaluation.

    Tracing compiles nothing, so this keeps the rows that the run above leaves out working.
    """
    sys.path.insert(0, str(helpers.ROOT / "benchmarks"))
    import bench_lowcomm as bench

    model, steps = "digits MLP", 4
    init, _ = bench.MODELS[model]
    p0 = init(0)
    xs = jax.ShapeDtypeStruct((steps, bench.N, bench.BATCH, 64), jnp.float32)
    ys = jax.ShapeDtypeStruct((steps, bench.N, bench.BATCH), jnp.int32)
    for name in bench.METHODS:
        run, evaluate, _, _ = bench._trainer(name, model, steps)
        p, s = jax.eval_shape(run, p0, xs, ys)
        final = jax.eval_shape(evaluate, p, s)
        assert jax.tree.structure(final) == jax.tree.structure(p0), name
        assert [x.shape for x in jax.tree.leaves(final)] == [x.shape for x in jax.tree.leaves(p0)], name


def test_bench_compile_has_every_demo_row_and_times_one():
    """``bench_compile`` knows every row of the demo plus the orthonormal ones, and times one row."""
    sys.path.insert(0, str(helpers.ROOT / "benchmarks"))
    sys.path.insert(0, str(helpers.ROOT / "examples"))
    import bench_compile as bench
    import demo

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    names = list(bench.rows(2, bench.gpt_params(1)))
    assert names == [*demo.methods(), "muon", "dion", "dion2"]
    with jax.numpy_rank_promotion("allow"):  # the benchmark's model broadcasts as scripts may
        out = bench.measure(1, ["dense"], mesh)
    timing, baseline = out["dense"]
    assert timing.lower > 0 and timing.compile > 0 and timing.cpu > 0 and timing.hlo_lines > 100
    assert out["(hand-written adam)"] == (baseline, baseline)
