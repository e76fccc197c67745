"""The examples run end to end on small settings."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_demo_runs_every_method(tmp_path, capsys):
    demo = _load("demo")
    assert demo.main(["--steps", "6", "--workers", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in rows] == list(demo.methods())
    for r in rows:
        assert 0.0 <= r["test_accuracy"] <= 1.0
        assert r["bytes_per_step"] > 0 and r["ms_per_step"] > 0
        assert f"| {r['method']} |" in out
    by = {r["method"]: r for r in rows}
    assert by["powersgd_r1"]["bytes_per_step"] < by["dense"]["bytes_per_step"] / 10
    assert by["bf16"]["compression_ratio"] == pytest.approx(2.0)
    assert (tmp_path / "loss_vs_step.png").stat().st_size > 10_000
    assert (tmp_path / "loss_vs_bytes.png").stat().st_size > 10_000


def test_demo_rejects_unknown_method(tmp_path):
    demo = _load("demo")
    with pytest.raises(SystemExit):
        demo.main(["--methods", "dense,nope", "--out", str(tmp_path)])
