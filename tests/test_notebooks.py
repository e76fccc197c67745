"""The notebooks run top to bottom, with tiny settings, in a fresh Jupyter kernel."""

from __future__ import annotations

import json
import re

import pytest

from tests import helpers

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = helpers.ROOT / "notebooks"


def _kernel_env(steps: int, workers: int) -> dict[str, str]:
    """The kernel's environment: CPU devices, this checkout importable, small settings."""
    # The checkout first on the path: the setup cell then finds jaxopt_dist and installs nothing.
    env = helpers.child_env(devices=8)
    env["JAXOPT_DIST_NOTEBOOK_STEPS"] = str(steps)
    env["JAXOPT_DIST_NOTEBOOK_WORKERS"] = str(workers)
    env.pop("MPLBACKEND", None)  # the kernel's inline backend draws the figures as PNG outputs
    return env


def _run(name: str, *, steps: int, workers: int) -> tuple[nbformat.NotebookNode, dict]:
    """Executes notebooks/<name> from the notebooks folder; returns it and its summary line."""
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute(env=_kernel_env(steps, workers))  # raises CellExecutionError on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream" and o.get("name") == "stdout"
    )
    summaries = [line for line in text.splitlines() if line.startswith("summary: ")]
    assert len(summaries) == 1, text[-2000:]
    return nb, json.loads(summaries[0][len("summary: ") :])


def _images(nb) -> int:
    return sum(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "display_data"
    )


@pytest.mark.parametrize("name", ["quickstart.ipynb", "compression_tour.ipynb"])
def test_notebooks_are_stored_clean(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4 and nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    # The first code cell sets the device flag before anything imports jax.
    assert "xla_force_host_platform_device_count" in code[0].source
    assert not re.search(r"^\s*(import|from) jax\b", code[0].source, flags=re.MULTILINE)


@pytest.mark.slow
def test_quickstart_trains_with_powersgd():
    nb, s = _run("quickstart.ipynb", steps=40, workers=4)
    assert s["workers"] == 4 and s["steps"] == 40 and s["cost_workers"] == 4
    assert s["final_loss"] < 0.7 * s["first_loss"]
    assert s["test_accuracy"] > 0.5  # chance is 0.1
    assert 0 < s["powersgd_bytes_per_step"] < s["dense_bytes_per_step"] / 5
    assert _images(nb) == 1  # the loss curve


@pytest.mark.slow
def test_compression_tour_runs_every_compressor():
    nb, s = _run("compression_tour.ipynb", steps=6, workers=4)
    methods = s["methods"]
    assert s["workers"] == 4
    assert set(methods) == {
        "dense",
        "bf16",
        "top_k",
        "random_k",
        "sign_vote",
        "ef_sign",
        "qsgd",
        "powersgd_r1",
        "powersgd_r2",
        "powersgd_r4",
        "adasum",
    }
    for name, m in methods.items():
        assert 0.0 <= m["accuracy"] <= 1.0, name
        assert m["bytes_per_step"] > 0, name
    dense = methods["dense"]["bytes_per_step"]
    assert methods["dense"]["compression_ratio"] == pytest.approx(1.0)
    assert methods["bf16"]["compression_ratio"] == pytest.approx(2.0, rel=1e-3)  # ring padding
    ranks = [methods[f"powersgd_r{r}"]["bytes_per_step"] for r in (1, 2, 4)]
    assert ranks == sorted(ranks) and ranks[-1] < dense
    for name in ("top_k", "random_k", "sign_vote", "ef_sign", "qsgd"):
        assert methods[name]["bytes_per_step"] < dense / 2, name
    assert methods["adasum"]["bytes_per_step"] > dense  # AdaSum is not a compressor
    assert _images(nb) == 1  # loss vs bytes
    table = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "| powersgd_r2 |" in table and "| ratio vs dense |" in table


def test_slow_network_is_stored_clean():
    test_notebooks_are_stored_clean("slow_network.ipynb")


@pytest.mark.slow
def test_slow_network_compares_dense_and_diloco():
    nb, s = _run("slow_network.ipynb", steps=24, workers=4)
    methods = s["methods"]
    assert s["workers"] == 4 and s["steps"] == 24 and s["sync_every"] == 12
    assert set(methods) == {"dense", "diloco", "streaming_4bit"}
    for name, m in methods.items():
        assert m["accuracy"] > 0.2, name  # chance is 0.1
    assert methods["dense"]["compression_ratio"] == pytest.approx(1.0)
    assert methods["diloco"]["compression_ratio"] == pytest.approx(12.0)
    # Four fragments, 4-bit codes plus scales and padding: well above H, below 8 H.
    assert 12.0 * 4 < methods["streaming_4bit"]["compression_ratio"] < 12.0 * 8
    assert methods["streaming_4bit"]["peak_bytes_per_step"] < methods["diloco"]["peak_bytes_per_step"] / 4
    outer = s["compressed_outer"]
    assert set(outer) == {"diloco", "sparseloco", "muloco"}
    for name in ("sparseloco", "muloco"):
        assert outer[name]["accuracy"] > 0.2, name
        assert outer[name]["bytes_per_sync"] < outer["diloco"]["bytes_per_sync"] / 2, name
    assert _images(nb) == 1
