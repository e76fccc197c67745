"""Each benchmark script runs to the end in its smallest setting (``--quick``).

Benchmarks are not timed here: this only keeps them working on every tested JAX,
where nothing else would notice a script broken by a change of API. The heavy
ones (``bench_compression``'s ResNet-18 timings, the multi-process link
benchmarks) are covered by their own smoke tests or run by hand.
"""

from __future__ import annotations

import subprocess
import sys

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
    "bench_lm": ["--quick", "--methods", "dense,diloco50,powersgd,muloco50"],
    "bench_lowcomm": ["--quick", "--models", "digits MLP"],
    "bench_overhead": ["--quick"],
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
