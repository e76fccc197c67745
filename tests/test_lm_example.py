"""examples/lm.py: the byte-level GPT trains, its data split is clean and its parameters are sharded."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers

TINY = [
    "--dim",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "16",
    "--batch",
    "16",
    "--eval-windows",
    "8",
]


@pytest.fixture(scope="module")
def lm():
    return helpers.load_example("lm")


@pytest.fixture(scope="module")
def corpus(lm):
    return lm.load_corpus()


def test_validation_files_are_unseen(lm, corpus):
    assert corpus.train_files and corpus.val_files
    assert set(corpus.train_files).isdisjoint(corpus.val_files)
    assert all(lm.is_validation(f, 0.05) for f in corpus.val_files)
    assert not any(lm.is_validation(f, 0.05) for f in corpus.train_files)
    assert not any(part in lm.SKIP_DIRS for f in corpus.train_files for part in f.split("/")[:-1])
    assert corpus.train.dtype == np.uint8 and len(corpus.train) > 5 * len(corpus.val) > 0
    again = lm.load_corpus()  # deterministic
    assert again.val_files == corpus.val_files and np.array_equal(again.val, corpus.val)
    windows = lm.sample_windows(corpus.val, np.random.default_rng(0), 4, 16)
    assert windows.shape == (4, 17) and windows.dtype == np.uint8


def test_cumulative_bytes_repeats_the_period(lm):
    per_step, period = [5.0, 0.0, 1.0, 0.0, 1.0], [0.0, 1.0]  # one warm-up step, then a period of two
    got = [lm.cumulative_bytes(per_step, period, t) for t in range(8)]
    assert got == [0.0, 5.0, 5.0, 6.0, 6.0, 7.0, 7.0, 8.0]


def test_parameters_and_state_are_sharded_over_fsdp(lm):
    args = lm.parser().parse_args([*TINY, "--steps", "2"])
    trainer = lm.Trainer("dense", lm.config(args), args)
    specs = jax.tree.leaves(trainer.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert specs and all("fsdp" in tuple(sp) for sp in specs)
    params, opt_state = trainer.init(0)
    for leaf in jax.tree.leaves(params):
        assert "fsdp" in tuple(leaf.sharding.spec)
    total = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    per_device = lm.per_device_bytes((params, opt_state))
    # Parameters and AdamW's moments split four ways; only counters are replicated.
    assert total / 4 <= per_device < 1.01 * total / 4
    assert trainer.num_params == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.slow  # about 30 s: two methods compiled
def test_trains_dense_and_diloco_and_writes_results(lm, tmp_path, capsys):
    argv = [*TINY, "--tx", "dense,diloco", "--steps", "12", "--eval-every", "4", "--sync-every", "4"]
    assert lm.main([*argv, "--lr", "1e-2", "--warmup", "2", "--no-progress", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    runs = {r["tx"]: r for r in record["runs"]}
    assert list(runs) == ["dense", "diloco"]
    for r in runs.values():
        assert [e["step"] for e in r["evals"]] == [0, 4, 8, 12]
        bpb = [e["val_bpb"] for e in r["evals"]]
        assert all(math.isfinite(b) for b in bpb) and bpb[-1] < bpb[0] - 0.5
        assert bpb[0] == pytest.approx(8.0, abs=0.3)  # a fresh model is near uniform over 256 bytes
        train = r["train_bpb"]
        assert len(train) == 12 and all(math.isfinite(x) for x in train)
        assert np.mean(train[-3:]) < np.mean(train[:3]) - 0.5
        sent = [e["data_axis_bytes"] for e in r["evals"]]
        assert sent[0] == 0 and all(b > a for a, b in zip(sent, sent[1:]))
        assert 0 < r["per_device_bytes"] < r["total_bytes"]
    dense, diloco = runs["dense"], runs["diloco"]
    # Dense: one all-reduce of the parameters every step; DiLoCo: the same once every 4 steps.
    assert dense["bytes_per_step"] == pytest.approx(dense["dense_bytes_per_step"])
    assert diloco["bytes_per_step"] == pytest.approx(dense["bytes_per_step"] / 4)
    assert diloco["peak_bytes_per_step"] == pytest.approx(dense["bytes_per_step"])
    assert dense["evals"][-1]["data_axis_bytes"] == pytest.approx(12 * dense["bytes_per_step"])
    assert (tmp_path / "lm_val_loss.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "| dense |" in out and "| diloco |" in out


def test_rejects_unknown_tx(lm, tmp_path):
    with pytest.raises(SystemExit):
        lm.main(["--tx", "dense,nope", "--out", str(tmp_path)])


@pytest.mark.slow  # about 20 s: two methods, each compiled for the mesh and for vmap
@pytest.mark.parametrize("tx", ["dense", "diloco"])
def test_one_device_trainer_matches_the_mesh(lm, corpus, tx):
    """VmapTrainer (replicas under vmap, seeds batched, one device) trains as Trainer does on the 2 x 4 mesh."""
    args = lm.parser().parse_args(
        [*TINY, "--steps", "8", "--eval-every", "4", "--sync-every", "4", "--lr", "1e-2"]
    )
    on_mesh = lm.Trainer(tx, lm.config(args), args).run_seeds(corpus, [0, 1], progress=False)
    on_one = lm.VmapTrainer(tx, lm.config(args), args).run_seeds(corpus, [0, 1], progress=False)
    for m, v in zip(on_mesh, on_one):
        assert m["seed"] == v["seed"]
        assert [e["step"] for e in v["evals"]] == [0, 4, 8]
        np.testing.assert_allclose(
            [e["val_bpb"] for e in v["evals"]], [e["val_bpb"] for e in m["evals"]], rtol=1e-5
        )
        np.testing.assert_allclose(v["train_bpb"], m["train_bpb"], rtol=1e-5)
        assert [e["data_axis_bytes"] for e in v["evals"]] == [e["data_axis_bytes"] for e in m["evals"]]
        assert v["replica_bytes"] * args.replicas == v["total_bytes"] and "per_device_bytes" not in v
    assert (
        on_one[0]["evals"][-1]["val_bpb"] != on_one[1]["evals"][-1]["val_bpb"]
    )  # the seeds are separate runs


def test_one_model_picks_the_global_model(lm):
    """Stacked replicas: replica 0 of replicated params; an anchor the replicas agree on; else their mean."""
    params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}  # 2 replicas
    assert lm.one_model(params, (), per_worker=False)["w"].tolist() == [1.0, 2.0]
    assert lm.one_model(params, (), per_worker=True)["w"].tolist() == [2.0, 3.0]
    agreed = {"anchor": {"w": jnp.array([[5.0, 6.0], [5.0, 6.0]])}}
    assert lm.one_model(params, agreed, per_worker=True)["w"].tolist() == [5.0, 6.0]
    differ = {"anchor": {"w": jnp.array([[5.0, 6.0], [5.0, 7.0]])}}  # per-worker anchors (NoLoCo)
    assert lm.one_model(params, differ, per_worker=True)["w"].tolist() == [2.0, 3.0]


@pytest.mark.slow  # about 30 s: three optimizers compiled for the 2 x 4 mesh
@pytest.mark.parametrize("tx", ["muon", "dion", "dion2"])
def test_orthonormal_optimizers_train_on_the_sharded_mesh(lm, corpus, tx):
    """The example's Muon, Dion and Dion2 rows train on the 2 x 4 mesh (parameters over "fsdp")."""
    args = lm.parser().parse_args([*TINY, "--steps", "4", "--eval-every", "4"])
    (run,) = lm.Trainer(tx, lm.config(args), args).run_seeds(corpus, [0], progress=False)
    first, last = run["evals"][0]["val_bpb"], run["evals"][-1]["val_bpb"]
    assert np.isfinite(last) and last < first
    assert run["evals"][-1]["data_axis_bytes"] > 0


def test_summary_says_how_many_times_fewer_bytes_than_dense(lm):
    """The table's last-but-one column: "50x less" for DiLoCo H=50, "the same" for dense itself."""

    def run(tx, per_step):
        last = {"step": 10, "val_bpb": 3.0, "data_axis_bytes": 10 * per_step}
        return {
            "tx": tx,
            "evals": [last],
            "bytes_per_step": per_step,
            "peak_bytes_per_step": 1000.0,
            "dense_bytes_per_step": 1000.0,
            "per_device_bytes": 4000.0,
        }

    table = lm.summary([run("dense", 1000.0), run("diloco", 20.0), run("adasum", 2000.0)])
    cells = [line.split(" | ")[4] for line in table.splitlines()[2:]]
    assert cells == ["the same", "50x less", "2x more"]


def test_a_missing_accelerator_is_named_before_anything_is_built(lm):
    """JAX_PLATFORMS asking for CUDA or TPU where JAX runs on CPU: an error naming both."""
    lm.require_platform("cpu")  # nothing to check
    lm.require_platform("")
    for wanted in ("cuda", "tpu,cpu"):
        with pytest.raises(
            SystemExit,
            match=rf"JAX_PLATFORMS={wanted} asks for {wanted.split(',')[0]} devices, "
            r"but JAX runs on \d+ cpu device\(s\)",
        ):
            lm.require_platform(wanted)


def test_every_method_is_checked_before_the_first_trains(lm, tmp_path, capsys):
    """Streaming DiLoCo's 4 fragments and the default --sync-every 50: an error at once, not after dense
    and diloco have trained."""
    with pytest.raises(SystemExit):
        lm.main(["--tx", "dense,diloco,streaming_diloco", "--out", str(tmp_path)])
    assert (
        "--tx streaming_diloco: `sync_every` (50) must be a multiple of `num_fragments` (4)"
        in capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())
