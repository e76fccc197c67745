"""Flax NNX tutorial CNN (BatchNorm + Dropout) on digits: one device vs data-parallel.

Two questions, one table each (test accuracy on the 360 held-out digits,
mean and range over seeds):

1. ``--study acceptance``: the tutorial loop of ``examples/flax_nnx_batchnorm.py``
   (AdamW 0.005, b1 0.9, global batch 128) on one device, and converted with
   ``jaxopt_dist.nnx`` on 8 workers with a dense all-reduce and with PowerSGD
   (SyncBN and per-worker statistics).
2. ``--study drop``: the reported drop (SGD 0.1, momentum 0.9, 8 workers,
   global batch 128, 5 epochs). Rows: one device; ``jaxopt_dist.nnx`` with
   SyncBN and with per-worker statistics (16 examples per worker); the same
   SyncBN run evaluated with the BatchNorm running statistics left at their
   initial values (mean 0, variance 1); and the recipe the README used to
   give (``nnx.split(model, nnx.Param, ...)`` with ``data_parallel_step``, the
   non-parameter state carried unchanged: running statistics never updated,
   one dropout key for every worker and step).

3. ``--study linen``: the same for the linen ``TrainState`` loop of
   ``examples/flax_linen_batchnorm.py``.

Run ``python benchmarks/bench_flax_batchnorm.py --study drop --seeds 0,1,2``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import flax_linen_batchnorm as ex_linen  # noqa: E402
import flax_nnx_batchnorm as ex  # noqa: E402

import jaxopt_dist as jd  # noqa: E402


def _eval(model) -> float:
    (_, _), (x_test, y_test) = ex.load_data(_eval.seed)  # type: ignore[attr-defined]
    model.eval()
    logits = model(x_test)
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))


def _reset_running_stats(model) -> None:
    for _, m in nnx.iter_graph(model):
        if isinstance(m, nnx.BatchNorm):
            m.mean[...] = np.zeros(m.mean.shape, np.float32)
            m.var[...] = np.ones(m.var.shape, np.float32)


def readme_recipe(seed: int, epochs: int, lr: float, momentum: float, workers: int, batch_size: int) -> float:
    """The former README recipe: only Params trained; the rest (BatchStat, RNG) carried unchanged."""
    (x_train, y_train), _ = ex.load_data(seed)
    model = ex.CNN(rngs=nnx.Rngs(seed))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params, rest)(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
    tx = optax.chain(jd.all_reduce(), optax.sgd(lr, momentum))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
    params, opt_state = step.init(params)
    for batch in ex.batches(x_train, y_train, batch_size, epochs, seed):
        params, opt_state, _ = step(params, opt_state, batch)
    nnx.update(model, jax.device_get(params))
    return _eval(model)


def run(study: str, seeds: list[int], epochs: int) -> None:
    main = ex.main
    if study == "linen":
        main = ex_linen.main
        common = ["--epochs", str(epochs)]
        rows = {
            "linen, one device (jax.jit)": ["--method", "single"],
            "linen, 8 workers, all_reduce, averaged running stats": ["--method", "dense"],
            "linen, 8 workers, all_reduce, SyncBN (axis_name)": ["--method", "dense", "--sync-bn"],
            "linen, 8 workers, powersgd(rank=2)": ["--method", "powersgd"],
        }
    elif study == "acceptance":
        common = ["--epochs", str(epochs)]
        rows = {
            "one device (nnx.Optimizer, nnx.jit)": ["--method", "single"],
            "8 workers, all_reduce, SyncBN": ["--method", "dense"],
            "8 workers, powersgd(rank=2), SyncBN": ["--method", "powersgd"],
            "8 workers, powersgd(rank=4), SyncBN": ["--method", "powersgd", "--rank", "4"],
        }
    else:
        common = ["--epochs", str(epochs), "--learning-rate", "0.1", "--momentum", "0.9", "--sgd"]
        rows = {
            "one device": ["--method", "single"],
            "jaxopt_dist.nnx, SyncBN": ["--method", "dense"],
            "jaxopt_dist.nnx, per-worker BN stats (16 examples)": [
                "--method",
                "dense",
                "--batch-stats",
                "per_worker",
            ],
            "jaxopt_dist.nnx, SyncBN, eval with initial running stats": ["--method", "dense", "RESET"],
            "former README recipe (stats and RNG state dropped)": ["README"],
        }
    print(
        f"study={study} epochs={epochs} seeds={seeds} devices={jax.device_count()} ({jax.devices()[0].platform})"
    )
    print("| run | test accuracy, mean | min - max | seconds per run |")
    print("|---|---:|---:|---:|")
    for name, extra in rows.items():
        accs, t0 = [], time.perf_counter()
        for seed in seeds:
            _eval.seed = seed  # type: ignore[attr-defined]
            if extra == ["README"]:
                try:
                    accs.append(readme_recipe(seed, epochs, 0.1, 0.9, 8, 128))
                except (
                    flax.errors.TraceContextError
                ) as e:  # flax 0.12: Dropout(rngs=...) inside the traced loss
                    print(
                        f"| {name} | does not run: {type(e).__name__} ({str(e).splitlines()[0][:60]}) | | |"
                    )
                    break
                continue
            reset = "RESET" in extra
            argv = [a for a in extra if a != "RESET"] + common + ["--seed", str(seed)]
            result = main(argv)
            if reset:
                _reset_running_stats(result["model"])
                accs.append(_eval(result["model"]))
            else:
                accs.append(result["test_accuracy"])
        if not accs:
            continue
        secs = (time.perf_counter() - t0) / len(seeds)
        print(
            f"| {name} | {100 * np.mean(accs):.1f}% | {100 * min(accs):.1f} - {100 * max(accs):.1f}% | {secs:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", choices=("acceptance", "drop", "linen"), default="acceptance")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=None, help="default: 10 (acceptance, linen), 5 (drop)")
    a = ap.parse_args()
    run(a.study, [int(s) for s in a.seeds.split(",")], a.epochs or (5 if a.study == "drop" else 10))
