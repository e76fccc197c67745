"""jaxopt_dist demo: data-parallel training of a Flax MLP on scikit-learn's digits.

Every method trains the same model from the same initialisation on the same
batches, across 8 (simulated) devices, with ``jaxopt_dist.data_parallel_step``.
The table reports test accuracy, the bytes each worker sends per step (read
off the traced update by ``jaxopt_dist.communication_cost``; averaged over a
synchronisation period for the methods that communicate only on some steps:
DiLoCo, SparseLoCo, NoLoCo, DES-LOC...), the compression
ratio against a dense float32 all-reduce, the measured time per step (and its
ratio to the dense row's), and the alpha-beta projection of the communication
time per step at 64 workers on a 10 Gbit/s network. The loss curves are
written as PNGs, with ``results.json``, to ``--out`` (a new temporary
directory by default, printed). A progress bar shows the method, its step and
its last loss. All 32 methods at the defaults take about 8 minutes on 2 CPU
cores, ``--methods dense,powersgd_r2`` about half a minute.

Run ``python examples/demo.py`` (all methods, defaults) or, for example,
``python examples/demo.py --methods dense,powersgd_r2 --steps 200``. With
``--checkpoint-dir DIR`` every method saves orbax checkpoints of its
parameters and optimizer state; run the same command again after an
interruption and finished methods are read back, the interrupted one resumes
from its last checkpoint and ends with the same result as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulate 8 devices on a CPU-only machine (ignored when real accelerators are used).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxopt_dist as jd  # noqa: E402


class MLP(nn.Module):
    hidden: int = 128
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


@dataclasses.dataclass(frozen=True)
class Method:
    """A row of the demo: how to build the optimizer.

    Attributes:
      label: what the row does.
      make: builds the transform.
      per_worker_params: the transform keeps one parameter copy per worker
        (model averaging, gossip, DiLoCo and the other local-step methods); the
        average of the copies is evaluated.
      bf16: train bfloat16 parameters (the loss is scaled by the state's loss scale).
      warmup: fraction of the steps run with dense SGD before ``make`` takes over;
        ``make`` then gets the parameter snapshots of the warm-up (DimReduce fits
        its subspace on them).
      sized: ``make`` takes ``num_workers=`` (the transform pads its buffers for
        that many workers), and is built again for the 64-worker projection.
    """

    label: str
    make: Callable[..., optax.GradientTransformation]
    per_worker_params: bool = False
    bf16: bool = False
    warmup: float = 0.0
    sized: bool = False


LR, MOM = 0.05, 0.9


def dense_sgd() -> optax.GradientTransformation:
    # One fused all-reduce, as XLA's combiner or SINGA's fused all-reduce would make it.
    return optax.chain(jd.all_reduce(flatten=True), jd.sgd(LR, MOM))


def methods() -> dict[str, Method]:
    """Every method the demo knows, in table order."""
    lr, mom = LR, MOM
    sgd = lambda: jd.sgd(lr, mom)  # noqa: E731
    return {
        "dense": Method("all_reduce (fused) + sgd(momentum)", dense_sgd),
        "bf16": Method(
            "bf16 wire all_reduce + sgd(momentum)",
            lambda: optax.chain(jd.all_reduce(dtype=jnp.bfloat16, flatten=True), sgd()),
        ),
        "local_sgd": Method(
            "local SGD, average params every 4 steps",
            lambda: optax.chain(sgd(), jd.average_params(every=4)),
            per_worker_params=True,
        ),
        "partial_sync": Method(
            "partial sync, 1 of 3 leaf groups per step",
            lambda: optax.chain(sgd(), jd.average_params(num_partitions=3)),
            per_worker_params=True,
        ),
        "top_k": Method("top-k 1% + error feedback", lambda: optax.chain(jd.top_k(density=0.01), sgd())),
        "top_k_no_ef": Method(
            "top-k 1%, no error feedback",
            lambda: optax.chain(jd.top_k(density=0.01, error_feedback=False), sgd()),
        ),
        "random_k": Method(
            "random-k 1% (shared indices) + EF, sgd(0.2) no momentum",
            lambda: optax.chain(jd.random_k(density=0.01), jd.sgd(0.2)),
        ),
        "block_k": Method(
            "random block 1% + EF, sgd(0.2) no momentum",
            lambda: optax.chain(jd.block_k(density=0.01), jd.sgd(0.2)),
        ),
        "threshold": Method(
            "|g| >= 1e-3, capacity 128 per leaf + EF",
            lambda: optax.chain(jd.threshold(1e-3, capacity=128), sgd()),
        ),
        "sign_vote": Method(
            "signum, majority vote of bit-packed signs (lr 1e-3)",
            lambda: optax.chain(jd.scale_by_momentum(mom), jd.sign_majority_vote(), jd.sgd(1e-3)),
        ),
        "ef_sign": Method(
            "EF-signSGD: scaled sign + error feedback", lambda: optax.chain(jd.scaled_sign(), sgd())
        ),
        "qsgd": Method(
            "QSGD 4 levels, buckets of 512", lambda: optax.chain(jd.qsgd(4, bucket_size=512), sgd())
        ),
        "powersgd_r1": Method("PowerSGD rank 1 + EF", lambda: optax.chain(jd.powersgd(rank=1), sgd())),
        "powersgd_r2": Method("PowerSGD rank 2 + EF", lambda: optax.chain(jd.powersgd(rank=2), sgd())),
        "powersgd_r4": Method("PowerSGD rank 4 + EF", lambda: optax.chain(jd.powersgd(rank=4), sgd())),
        "powersgd_r2_1ar": Method(
            "PowerSGD rank 2, one all-reduce per step",
            lambda: optax.chain(jd.powersgd(rank=2, one_allreduce=True), sgd()),
        ),
        "adasum": Method("AdaSum of gradients + sgd(momentum)", lambda: optax.chain(jd.adasum(), sgd())),
        "adasum_delta": Method(
            "AdaSum (halving) of the sgd(momentum) steps",
            lambda: optax.chain(sgd(), jd.adasum(method="halving")),
        ),
        "gossip_ring": Method(
            "gossip on a ring after sgd(momentum)",
            lambda: optax.chain(sgd(), jd.gossip("ring")),
            per_worker_params=True,
        ),
        "gossip_exp": Method(
            "gossip, one-peer exponential graph",
            lambda: optax.chain(sgd(), jd.gossip("exponential")),
            per_worker_params=True,
        ),
        "dimreduce": Method(
            "DimReduce (k=20) after dense SGD for half the steps",
            lambda snapshots: jd.dim_reduce(
                jd.fit_subspace(snapshots, min(20, len(snapshots) - 1)), alpha=LR
            ),
            warmup=0.5,
        ),
        "bf16_loss_scale": Method(
            "bf16 params and wire, fp32 master weights, dynamic loss scale",
            lambda: jd.master_weights(
                jd.dynamic_loss_scale(
                    optax.chain(jd.all_reduce(dtype=jnp.bfloat16, flatten=True), sgd()), axis_name="data"
                )
            ),
            bf16=True,
        ),
        **low_communication_methods(sgd),
    }


def low_communication_methods(sgd: Callable[[], optax.GradientTransformation]) -> dict[str, Method]:
    """The low-communication rows: local steps between syncs, or compressed Adam and momentum."""
    H = 12  # steps between synchronisations; a multiple of the 3 fragments of Streaming DiLoCo
    # Coordinates whose gradient is always 0 (blank pixels, dead ReLUs) keep Adam's v at 0, and a
    # 1-bit message (or a momentum averaged apart from v) still gives them a step: eps bounds it.
    eps = 1e-4
    return {
        "diloco": Method(
            f"DiLoCo: sgd(momentum) inside, Nesterov outer step every {H} steps",
            lambda: jd.diloco(sgd(), sync_every=H),
            per_worker_params=True,
        ),
        "streaming_diloco": Method(
            f"Streaming DiLoCo: 3 fragments, one every {H // 3} steps, 4-bit E3M0 outer gradients",
            lambda: jd.diloco(sgd(), sync_every=H, num_fragments=3, aggregate=jd.low_bit()),
            per_worker_params=True,
        ),
        "sparseloco": Method(
            f"SparseLoCo: 64 of every 64x64 tile, 2 bits, error feedback, every {H} steps",
            lambda: jd.sparseloco(sgd(), sync_every=H, topk=64, chunk=64, bits=2),
            per_worker_params=True,
        ),
        "muloco": Method(
            f"MuLoCo: Muon inside, 2-bit statistical quantization, every {H} steps",
            lambda: jd.diloco(
                optax.contrib.muon(0.02, beta=0.9, adam_learning_rate=1e-3),
                sync_every=H,
                outer=optax.sgd(0.8, momentum=0.9, nesterov=True),
                aggregate=jd.statistical_quantize(2, error_decay=0.9),
            ),
            per_worker_params=True,
        ),
        "noloco": Method(
            f"NoLoCo: outer step within random pairs every {H} steps, no all-reduce",
            lambda: jd.noloco(sgd(), sync_every=H),
            per_worker_params=True,
        ),
        "choco": Method(
            "CHOCO-SGD: gossip of the top 10% of x - x_hat on a ring",
            lambda: optax.chain(
                sgd(), jd.choco_gossip(jd.top_k(density=0.1), topology="ring", consensus_step=0.5)
            ),
            per_worker_params=True,
        ),
        "decoupled_momentum": Method(
            "DeMo: DCT top-4 of 8x8 tiles of the momentum, sign step (lr 0.01)",
            lambda: jd.decoupled_momentum(0.01, chunk=8, topk=4),
        ),
        "onebit_adam": Method(
            "1-bit Adam (lr 1e-3), dense for 30 steps",
            lambda num_workers: jd.onebit_adam(1e-3, freeze_step=30, num_workers=num_workers, eps=eps),
            sized=True,
        ),
        "zero_one_adam": Method(
            "0/1 Adam (lr 1e-3): variance frozen at step 30, 1-bit syncs up to 16 steps apart",
            lambda num_workers: jd.zero_one_adam(
                1e-3, var_freeze_step=30, num_workers=num_workers, eps=eps, local_step_scaler=16
            ),
            per_worker_params=True,
            sized=True,
        ),
        "desloc": Method(
            "DES-LOC Adam (lr 1e-3): params every 8, moments every 24 and 48 steps",
            lambda: jd.desloc_adam(
                1e-3, sync_every=8, momentum_sync_every=24, variance_sync_every=48, eps=eps
            ),
            per_worker_params=True,
        ),
    }


def load_data(seed: int):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def batch_at(x, y, batch_size: int, step: int, seed: int) -> dict[str, np.ndarray]:
    """The batch of step ``step``: a function of (seed, step), so a resumed run sees the same data."""
    idx = np.random.default_rng([seed, step]).integers(0, len(x), size=batch_size)
    return {"x": x[idx], "y": y[idx]}


class Checkpoints:
    """Orbax checkpoints of one method's run: params, optimizer state and the curves so far.

    Saves every ``every`` steps (asynchronously, atomically: a run killed mid-save
    leaves the previous checkpoint usable) and a ``row.json`` once the method is done.
    """

    def __init__(self, directory: str, every: int):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.directory = os.path.abspath(directory)
        self.every = every
        self.row_path = os.path.join(self.directory, "row.json")
        self._managers: dict[str, Any] = {}

    def manager(self, phase: str):
        if phase not in self._managers:
            options = self.ocp.CheckpointManagerOptions(max_to_keep=2)
            self._managers[phase] = self.ocp.CheckpointManager(
                os.path.join(self.directory, phase), options=options
            )
        return self._managers[phase]

    def save(self, phase: str, step: int, tree: Any, meta: dict[str, Any]) -> None:
        """Starts saving ``tree`` and ``meta`` as of now (the write finishes in the background)."""
        ocp = self.ocp
        # Orbax serializes the JSON item in its background commit, so a list the caller goes
        # on appending to would be written with entries from later steps: save a snapshot.
        meta = json.loads(json.dumps(meta))
        self.manager(phase).save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta))
        )

    def latest(self, phase: str) -> int | None:
        return self.manager(phase).latest_step()

    def restore(self, phase: str, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restores ``step`` like ``like``: ShapeDtypeStructs (with shardings) or NumPy arrays."""
        ocp = self.ocp
        out = self.manager(phase).restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore())
        )
        return out.state, out.meta

    def check_curve(self, losses: list[float], step: int) -> None:
        """Refuses a checkpoint whose loss curve does not end at its step."""
        if len(losses) != step:
            raise RuntimeError(
                f"checkpoint {self.directory} at step {step} holds {len(losses)} losses; "
                "delete the directory and run again"
            )

    def finished(self) -> dict[str, Any] | None:
        if not os.path.exists(self.row_path):
            return None
        with open(self.row_path) as f:
            return json.load(f)

    def finish(self, row: dict[str, Any]) -> None:
        for m in self._managers.values():
            m.wait_until_finished()
            m.close()
        tmp = self.row_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(row, f)
        os.replace(tmp, self.row_path)


def loss_function(model) -> Callable[[Any, dict[str, Any]], jax.Array]:
    """``loss(params, batch)``: the model's mean cross-entropy on ``batch``."""

    def loss_fn(params, batch):
        logits = model.apply(params, batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


def start_params(method: Method, params0: Any) -> Any:
    """The parameters the method starts from: ``params0``, in bfloat16 for the ``bf16`` rows."""
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params0) if method.bf16 else params0


def make_step(
    method: Method, loss_fn: Callable[..., jax.Array], mesh, snapshots: list[Any]
) -> tuple[optax.GradientTransformation, Any]:
    """The method's optimizer and its data-parallel step on ``mesh`` (``snapshots``: of the warm-up, if any)."""
    if method.sized:
        tx = method.make(num_workers=mesh.shape["data"])
    else:
        tx = method.make(snapshots) if snapshots else method.make()
    step = jd.data_parallel_step(
        loss_fn,
        tx,
        mesh=mesh,
        per_worker_params=method.per_worker_params,
        loss_scale=jd.loss_scale if method.bf16 else None,
    )
    return tx, step


def train(name: str, method: Method, *, model, params0, data, args, mesh, progress) -> dict[str, Any]:
    ckpt = (
        Checkpoints(os.path.join(args.checkpoint_dir, name), args.checkpoint_every)
        if args.checkpoint_dir
        else None
    )
    if ckpt is not None and (row := ckpt.finished()) is not None:
        progress.update(args.steps)
        return row
    (x_train, y_train), (x_test, y_test) = data
    n = mesh.shape["data"]
    loss_fn = loss_function(model)
    losses, times = [], []

    def run(step, params, opt_state, start, stop, phase=None):
        for t in range(start, stop):
            batch = batch_at(x_train, y_train, args.batch_size * n, t, args.seed)
            t0 = time.perf_counter()
            params, opt_state, metrics = step(params, opt_state, batch)
            loss = float(metrics["loss"])  # blocks: the time covers the whole step
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            progress.set_postfix_str(f"{name} step {t + 1}/{args.steps} loss {loss:.4f}", refresh=False)
            progress.update(1)
            if phase is not None and (t + 1) % ckpt.every == 0 and t + 1 < stop:
                ckpt.save(phase, t + 1, (params, opt_state), {"losses": losses, "times": times})
        return params, opt_state

    start = start_params(method, params0)
    snapshots = []
    warmup = int(method.warmup * args.steps)
    if warmup:  # dense SGD first, keeping parameter snapshots every `every` steps
        every = max(1, warmup // 30)
        done = ckpt.latest("warmup") if ckpt is not None else None
        if done is not None:  # the warm-up finished in an earlier run
            like = {"start": start, "snapshots": [start] * len(range(0, warmup, every))}
            tree, meta = ckpt.restore("warmup", done, jax.device_get(like))
            start, snapshots, losses[:] = tree["start"], tree["snapshots"], meta["losses"]
            ckpt.check_curve(losses, warmup)
            progress.update(warmup)
        else:
            warm = jd.data_parallel_step(loss_fn, dense_sgd(), mesh=mesh)
            params, opt_state = warm.init(start)
            for t in range(0, warmup, every):
                params, opt_state = run(warm, params, opt_state, t, min(t + every, warmup))
                snapshots.append(jax.device_get(params))
            start = jax.device_get(params)
            if ckpt is not None:
                ckpt.save("warmup", warmup, {"start": start, "snapshots": snapshots}, {"losses": losses})
        times.clear()  # report the time per step of the method itself
    tx, step = make_step(method, loss_fn, mesh, snapshots)
    first = warmup
    if ckpt is not None and (saved := ckpt.latest("main")) is not None:
        (params, opt_state), meta = ckpt.restore("main", saved, step.abstract_init(start))
        losses[:], times[:] = meta["losses"], meta["times"]
        ckpt.check_curve(losses, saved)
        progress.update(saved - warmup)
        first = saved
    else:
        params, opt_state = step.init(start)
    params, opt_state = run(step, params, opt_state, first, args.steps, "main" if ckpt is not None else None)

    if method.per_worker_params:  # evaluate the average of the workers' models
        params = jax.tree.map(lambda p: np.mean(np.asarray(p, np.float32), axis=0), params)
    params = jax.tree.map(lambda p: np.asarray(p, np.float32), jax.device_get(params))
    logits = model.apply(params, x_test)
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    cost = jd.communication_cost(tx, start, num_workers=n)
    # The ratio is against a float32 all-reduce of the same parameters, whatever their dtype
    # (cost.compression_ratio compares with a dense all-reduce in the parameters' own dtype).
    dense32 = jd.communication_cost(jd.all_reduce(), jax.tree.map(_as_float32, start), num_workers=n)
    # Trace again at 64 workers: message sizes and rounds of some schemes depend on the count.
    cost64 = jd.communication_cost(method.make(num_workers=64) if method.sized else tx, start, num_workers=64)
    # "auto": ring or recursive doubling per message size, as NCCL and MPI choose (small messages
    # would otherwise pay 2 (n-1) latencies each).
    projected = jd.project_step_time(cost64, bandwidth_gbps=10.0, latency_us=5.0, algorithm="auto")
    row = {
        "method": name,
        "label": method.label,
        "test_accuracy": accuracy,
        "final_loss": float(np.mean(losses[-10:])),
        "bytes_per_step": cost.sent_bytes,
        "compression_ratio": dense32.sent_bytes / cost.sent_bytes if cost.sent_bytes else float("inf"),
        "ms_per_step": 1e3 * float(np.median(times[3:] if len(times) > 3 else times)),
        "projected_ms_64w_10gbps": 1e3 * float(projected),
        "losses": losses,
    }
    if ckpt is not None:
        ckpt.finish(row)
    return row


def _as_float32(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), np.float32)


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} GiB"


def add_time_ratios(rows: list[dict[str, Any]]) -> None:
    """Time per step relative to the dense row of the same run (None without one)."""
    dense = next((r["ms_per_step"] for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["step_time_vs_dense"] = r["ms_per_step"] / dense if dense else None


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| method | what | test acc | bytes sent / worker / step | ratio vs dense | ms / step "
        "| step time vs dense | projected comm ms / step (64 workers, 10 Gbit/s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = "-" if r.get("step_time_vs_dense") is None else f"{r['step_time_vs_dense']:.2f}"
        print(
            f"| {r['method']} | {r['label']} | {100 * r['test_accuracy']:.1f}% | {fmt_bytes(r['bytes_per_step'])} "
            f"| {r['compression_ratio']:.1f}x | {r['ms_per_step']:.2f} | {ratio} "
            f"| {r['projected_ms_64w_10gbps']:.3f} |"
        )


FAMILIES = {
    "dense and precision": ("dense", "bf16", "bf16_loss_scale", "dimreduce"),
    "sparsification and quantization": (
        "top_k",
        "top_k_no_ef",
        "random_k",
        "block_k",
        "threshold",
        "sign_vote",
        "ef_sign",
        "qsgd",
    ),
    "low rank (PowerSGD)": ("powersgd_r1", "powersgd_r2", "powersgd_r4", "powersgd_r2_1ar"),
    "model averaging, gossip, AdaSum": (
        "local_sgd",
        "partial_sync",
        "gossip_ring",
        "gossip_exp",
        "adasum",
        "adasum_delta",
    ),
    "low communication: outer steps": (
        "diloco",
        "streaming_diloco",
        "sparseloco",
        "muloco",
        "noloco",
        "desloc",
    ),
    "low communication: every step": ("choco", "decoupled_momentum", "onebit_adam", "zero_one_adam"),
}
# Curves of one panel differ in line style as well as colour, and the first are drawn widest, so that
# a curve that lies on another (bf16 on bf16_loss_scale, both on dense) still shows.
LINE_STYLES = ("-", "--", "-.", ":")


def plot(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    """Two PNGs (loss vs step, loss vs bytes), one panel per family, dense as reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(v, k=10):
        v = np.asarray(v)
        return np.convolve(v, np.ones(k) / k, mode="valid") if len(v) > k else v

    by_name = {r["method"]: r for r in rows}
    families = {f: [m for m in ms if m in by_name] for f, ms in FAMILIES.items()}
    families = {f: ms for f, ms in families.items() if ms}
    others = [r["method"] for r in rows if not any(r["method"] in ms for ms in FAMILIES.values())]
    if others:
        families["other"] = others
    paths = []
    for kind in ("step", "bytes"):
        cols = 2 if len(families) > 1 else 1
        nrows = (len(families) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(8 * cols, 4 * nrows), squeeze=False)
        for ax, (family, names) in zip(axes.flat, families.items()):
            for k, name in enumerate(
                (["dense"] if "dense" in by_name and "dense" not in names else []) + names
            ):
                r = by_name[name]
                y = smooth(r["losses"])
                x = np.arange(len(r["losses"]))[len(r["losses"]) - len(y) :]
                if kind == "bytes":
                    x = (x + 1) * r["bytes_per_step"] / 2**20
                style = {"ls": LINE_STYLES[k % len(LINE_STYLES)], "lw": max(0.8, 2.8 - 0.4 * k)}
                if name == "dense":  # the reference: thin, black, on top
                    style = {"color": "k", "ls": "--", "lw": 1, "zorder": 5}
                ax.plot(x, y, label=name, **style)
            ax.set(title=family, yscale="log", ylabel="training loss (moving avg)")
            ax.set(xlabel="step" if kind == "step" else "MiB sent per worker")
            if kind == "bytes":
                ax.set_xscale("log")
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        for ax in list(axes.flat)[len(families) :]:
            ax.axis("off")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"loss_vs_{kind}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    known = methods()
    ap = argparse.ArgumentParser(description="Train a digits MLP with every jaxopt_dist method.")
    ap.add_argument(
        "--methods", default="all", help=f"comma-separated subset of: {', '.join(known)} (default all)"
    )
    ap.add_argument("--workers", type=int, default=8, help="data-parallel workers (devices) to use")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16, help="examples per worker per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        default=None,
        help="folder for the PNGs and results.json (default: a new temporary directory)",
    )
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save orbax checkpoints here and resume from them: finished methods are not rerun, "
        "an interrupted one continues from its last checkpoint",
    )
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    args = ap.parse_args(argv)

    names = (
        list(known) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    )
    unknown = [m for m in names if m not in known]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(known)}")
    if args.checkpoint_every < 1:
        ap.error("--checkpoint-every must be at least 1")
    if args.workers > jax.device_count():
        ap.error(f"--workers {args.workers} > {jax.device_count()} available devices")

    from tqdm import tqdm

    mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[: args.workers])
    data = load_data(args.seed)
    model = MLP()
    params0 = model.init(jax.random.key(args.seed), jnp.zeros((1, 64)))
    print(
        f"digits: {len(data[0][0])} train / {len(data[1][0])} test examples; {args.workers} workers "
        f"({jax.devices()[0].platform}); {args.steps} steps of {args.batch_size} examples per worker"
    )
    rows = []
    with tqdm(total=args.steps * len(names), desc="training", unit="step") as progress:
        for name in names:
            progress.set_postfix_str(f"{name} (compiling)")
            rows.append(
                train(
                    name,
                    known[name],
                    model=model,
                    params0=params0,
                    data=data,
                    args=args,
                    mesh=mesh,
                    progress=progress,
                )
            )
    add_time_ratios(rows)
    print_table(rows)
    args.out = args.out or tempfile.mkdtemp(prefix="jaxopt_dist-demo-")
    os.makedirs(args.out, exist_ok=True)
    for path in plot(rows, args.out):
        print(f"wrote {path}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "losses"} for r in rows], f, indent=2)
    print(f"wrote {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
