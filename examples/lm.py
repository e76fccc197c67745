"""A byte-level GPT trained on the Python standard library's source, data parallel with a sharded model.

The model is a small GPT-style decoder in Flax NNX (pre-norm blocks, causal
multi-head attention, an MLP; learned or rotary positions; tied or separate
input and output embeddings; 256 byte values as the vocabulary). Every
parameter carries sharding metadata (``nnx.with_partitioning``), so
``nnx.get_partition_spec`` gives the ``param_specs`` of
:func:`jaxopt_dist.data_parallel_step`: on the default mesh of 2 replicas x 4
``"fsdp"`` devices (8 simulated CPU devices), each replica's parameters and
optimizer state are sharded four ways (FSDP), the batch is split over all 8
devices, and the optimizer communicates over the replica axis ``"data"``
only. ``--tx`` picks the optimizer from :data:`TXS`: dense AdamW, DiLoCo,
Streaming DiLoCo with a 4-bit outer all-reduce, PowerSGD, DeMo, top-k, local SGD,
Muon (optax's and ours, distributed), Dion, Dion2.

The text is the standard library's own ``*.py`` files (nothing is
downloaded), split into training and validation *by file* (a hash of each
file's path), so the validation text is unseen. Training draws random
windows of ``context + 1`` bytes; the validation loss is reported in bits
per byte (the cross-entropy divided by ln 2).

Run ``python examples/lm.py --quick`` (a tiny model, dense AdamW and DiLoCo,
under a minute on 2 CPU cores; it shows that the pipeline runs, not how the
methods compare: see :data:`QUICK_NOTE`), ``python examples/lm.py`` (dense
AdamW, 300 steps: about 6 minutes on 2 CPU cores), or e.g.
``python examples/lm.py --tx diloco --sync-every 40`` or
``python examples/lm.py --tx dense,diloco,streaming_diloco --steps 600 --sync-every 40``
(about half an hour; Streaming DiLoCo's 4 fragments need a multiple of 4, and
every method's settings are checked before the first one trains). A progress
bar on stderr shows the method, the step and the last loss.
On a machine with a single accelerator, ``--one-device`` runs the replicas
under ``jax.vmap(axis_name="data")`` on that device instead (parameters
unsharded; :class:`VmapTrainer`); with ``JAX_PLATFORMS=cuda`` (or ``tpu``) the
script first checks that JAX runs there (:func:`require_platform`). Written to
``--out`` (a new temporary directory by default, printed): ``results.json`` (per
evaluation: step, validation bits per byte, cumulative bytes sent over the
replica axis) and ``lm_val_loss.png`` (validation loss against steps and
against those bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import pathlib
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulate 8 devices on a CPU-only machine (ignored when real accelerators are used).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxopt_dist as jd  # noqa: E402

P = jax.sharding.PartitionSpec
FSDP = "fsdp"  # the model axis parameters are sharded over
DATA = "data"  # the replica axis the optimizers communicate over

# ----------------------------------------------------------------------------
# Data: the standard library's own source, split by file.

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8) and the files each came from (paths relative to ``root``)."""

    root: str
    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Whether a file goes to validation: a CRC-32 of its relative path (stable across runs and Pythons)."""
    return zlib.crc32(relpath.encode()) % 10_000 < val_fraction * 10_000


def load_corpus(root: str | None = None, *, val_fraction: float = 0.05) -> Corpus:
    """Every ``*.py`` under ``root`` (default: the standard library), split into train and validation by file.

    Files under ``site-packages`` and test directories are skipped. Each
    split is the concatenation of its files' bytes, in path order.
    """
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(
        p.relative_to(base).as_posix()
        for p in base.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(base).parts[:-1])
    )
    val_files = tuple(f for f in files if is_validation(f, val_fraction))
    train_files = tuple(f for f in files if not is_validation(f, val_fraction))
    if not val_files or not train_files:
        raise ValueError(
            f"{base}: {len(files)} Python files give an empty split at val_fraction={val_fraction}."
        )

    def read(names):
        return np.frombuffer(b"".join((base / n).read_bytes() for n in names), np.uint8)

    return Corpus(str(base), read(train_files), read(val_files), train_files, val_files)


def sample_windows(data: np.ndarray, rng: np.random.Generator, n: int, context: int) -> np.ndarray:
    """``n`` random windows of ``context + 1`` bytes: uint8 ``(n, context + 1)``."""
    starts = rng.integers(0, len(data) - context - 1, size=n)
    return data[starts[:, None] + np.arange(context + 1)[None, :]]


# ----------------------------------------------------------------------------
# The model.


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder. ``dim`` and ``4 * dim`` must divide over the ``"fsdp"`` axis."""

    context: int = 128
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm)
    positions: str = "learned"  # "learned" or "rope"
    tied: bool = True  # output projection = input embedding transposed
    vocab: int = 256


def sharded(init: Callable[..., Any], *names: str | None) -> Callable[..., Any]:
    """``init`` with sharding metadata: one mesh axis name (or None) per dimension."""
    return nnx.with_partitioning(init, names)


def _normal(std: float) -> Callable[..., Any]:
    return nnx.initializers.normal(std)


def _norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
    scale = sharded(nnx.initializers.ones_init(), FSDP)
    if cfg.norm == "rms":
        return nnx.RMSNorm(cfg.dim, scale_init=scale, rngs=rngs)
    return nnx.LayerNorm(
        cfg.dim, scale_init=scale, bias_init=sharded(nnx.initializers.zeros_init(), FSDP), rngs=rngs
    )


def _linear(d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=sharded(_normal(std), FSDP, None), rngs=rngs)


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x`` ``(batch, time, heads, head_dim)`` (rotating half-dimension pairs)."""
    t, h = x.shape[1], x.shape[-1]
    freq = 1.0 / (10_000.0 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.heads, self.rope = cfg.heads, cfg.positions == "rope"
        self.qkv = _linear(cfg.dim, 3 * cfg.dim, 0.02, rngs)
        self.out = _linear(cfg.dim, cfg.dim, 0.02 / math.sqrt(2 * cfg.depth), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.rope:
            q, k = rotary(q), rotary(k)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        hidden = cfg.mlp_ratio * cfg.dim
        self.norm1, self.attn = _norm(cfg, rngs), Attention(cfg, rngs=rngs)
        self.norm2 = _norm(cfg, rngs)
        self.fc = _linear(cfg.dim, hidden, 0.02, rngs)
        self.proj = _linear(hidden, cfg.dim, 0.02 / math.sqrt(2 * cfg.depth), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.proj(nnx.gelu(self.fc(self.norm2(x))))


class GPT(nnx.Module):
    """Byte-level GPT decoder: ``(batch, time)`` ints in [0, 256) -> ``(batch, time, 256)`` logits."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        if cfg.norm not in ("layer", "rms") or cfg.positions not in ("learned", "rope"):
            raise ValueError(f"norm must be 'layer' or 'rms', positions 'learned' or 'rope'; got {cfg}.")
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim ({cfg.dim}) must be a multiple of heads ({cfg.heads}).")
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab, cfg.dim, embedding_init=sharded(_normal(0.02), FSDP, None), rngs=rngs
        )
        if cfg.positions == "learned":
            self.pos = nnx.Param(sharded(_normal(0.01), FSDP, None)(rngs.params(), (cfg.context, cfg.dim)))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.norm = _norm(cfg, rngs)
        if not cfg.tied:
            self.head = _linear(cfg.dim, cfg.vocab, 0.02, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.cfg.positions == "learned":
            x = x + self.pos[: tokens.shape[-1]][None]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.embed.attend(x) if self.cfg.tied else self.head(x)


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The model on the host, unplaced (the step places it by its partition specs)."""
    eager = getattr(nnx, "use_eager_sharding", None)  # Flax >= 0.12 shards variables on creation
    with eager(False) if eager is not None else contextlib.nullcontext():
        return GPT(cfg, rngs=nnx.Rngs(seed))


def make_loss(graphdef: Any, rest: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """``loss(params, batch)``: mean next-byte cross-entropy (nats) on ``batch`` uint8 ``(n, context + 1)``."""

    def loss(params, batch):
        tokens = batch.astype(jnp.int32)
        logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]
        ).mean()

    return loss


# ----------------------------------------------------------------------------
# Optimizers.


@dataclasses.dataclass(frozen=True)
class Method:
    """An entry of :data:`TXS`: ``make(settings) -> tx`` and whether parameters are per worker."""

    make: Callable[[Any], optax.GradientTransformation]
    per_worker: bool
    help: str


def schedule(peak: float, settings: Any) -> optax.Schedule:
    """Linear warm-up over ``settings.warmup`` steps to ``peak``, cosine decay to ``peak / 10``."""
    warmup = max(1, min(settings.warmup, settings.steps - 1))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(settings.steps, warmup + 1), peak / 10)


def clipped(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` after clipping each worker's gradient at global norm 1.0 (every Adam-based row)."""
    return optax.chain(optax.clip_by_global_norm(1.0), tx)


def adamw(settings: Any) -> optax.GradientTransformation:
    """The local optimizer of every AdamW-based method: clipping, then AdamW (b2 = 0.95)."""
    return clipped(
        optax.adamw(schedule(settings.lr, settings), b1=0.9, b2=0.95, weight_decay=settings.weight_decay)
    )


def outer(settings: Any) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: Nesterov SGD (0.7, momentum 0.9 by default, the paper's)."""
    return optax.sgd(settings.outer_lr, momentum=settings.outer_momentum, nesterov=True)


def _streaming(settings: Any) -> optax.GradientTransformation:
    return jd.diloco(
        adamw(settings),
        sync_every=settings.sync_every,
        outer=outer(settings),
        num_fragments=4,
        aggregate=jd.low_bit(3, 0),  # 4-bit E3M0 with error feedback, bit-packed
    )


def _muon_matrices(params: Any) -> Any:
    """Muon's dimension numbers for the blocks' matrices; ``None`` (Adam) for embeddings and vectors."""

    def spec(path: tuple, x: Any) -> Any:
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        hidden = x.ndim == 2 and not names & {"embed", "pos", "head"}
        return optax.contrib.MuonDimensionNumbers() if hidden else None

    return jax.tree_util.tree_map_with_path(spec, params)


def _muloco(settings: Any) -> optax.GradientTransformation:
    muon = optax.contrib.muon(
        schedule(settings.muon_lr, settings),
        beta=0.9,
        weight_decay=settings.weight_decay,
        adam_b2=0.95,
        adam_weight_decay=settings.weight_decay,
        adam_learning_rate=schedule(settings.lr, settings),
        muon_weight_dimension_numbers=_muon_matrices,
    )
    return jd.diloco(
        muon,
        sync_every=settings.sync_every,
        outer=outer(settings),
        aggregate=jd.statistical_quantize(2, error_decay=0.9),
    )


# Orthonormal updates (Frontier III): the matrices of the blocks get Muon, Dion or Dion2 at
# --muon-lr; every other leaf, and the embedding, positions and output head (by the Dion paper's
# recommendation), gets AdamW at --lr (b2 = 0.95, --weight-decay) on the mean gradient. Not clipped:
# our distributed rows take each worker's own gradient, so a clip could not act on the mean as the
# AdamW rows' does; the optax row is left unclipped too, so that the two compute the same update.
def _scalar_adamw(settings: Any) -> optax.GradientTransformation:
    return optax.adamw(schedule(settings.lr, settings), b1=0.9, b2=0.95, weight_decay=settings.weight_decay)


def _muon_kwargs(settings: Any) -> dict[str, Any]:
    """The arguments ``optax.contrib.muon`` and our distributed Muon share (optax's defaults otherwise)."""
    return dict(
        learning_rate=schedule(settings.muon_lr, settings),
        weight_decay=settings.weight_decay,
        adam_b2=0.95,
        adam_weight_decay=settings.weight_decay,
        adam_learning_rate=schedule(settings.lr, settings),
        muon_weight_dimension_numbers=_muon_matrices,
    )


def _muon_optax(settings: Any) -> optax.GradientTransformation:
    return optax.chain(jd.all_reduce(), optax.contrib.muon(**_muon_kwargs(settings)))


def _muon(settings: Any) -> optax.GradientTransformation:
    return jd.muon(**_muon_kwargs(settings), num_workers=settings.replicas)


def _embeddings(params: Any) -> Any:
    """True at the leaves :func:`_muon_matrices` leaves to Adam (Dion's ``scalar_mask``)."""
    dims = _muon_matrices(params)
    leaves = jax.tree.leaves(
        dims, is_leaf=lambda d: d is None or isinstance(d, optax.contrib.MuonDimensionNumbers)
    )
    return jax.tree.unflatten(jax.tree.structure(params), [d is None for d in leaves])


def _dion(settings: Any) -> optax.GradientTransformation:
    return jd.dion(
        schedule(settings.muon_lr, settings),
        rank_fraction=settings.rank_fraction,
        weight_decay=settings.weight_decay,
        scalar_optimizer=_scalar_adamw(settings),
        scalar_mask=_embeddings,
    )


def _dion2(settings: Any) -> optax.GradientTransformation:
    return jd.dion2(
        schedule(settings.muon_lr, settings),
        fraction=settings.dion2_fraction,
        weight_decay=settings.weight_decay,
        num_workers=settings.replicas,
        scalar_optimizer=_scalar_adamw(settings),
        weight_dimension_numbers=_muon_matrices,
    )


# Adam variants that compress their own messages: eps 1e-4, as their docstrings advise (coordinates
# whose gradient is always zero, such as the embedding rows of bytes that never occur, would divide by it).
_EPS_COMPRESSED_ADAM = 1e-4


# Both are clipped as the AdamW rows are (DES-LOC's experiments clip so; DeepSpeed's engine clips
# before 0/1 Adam's step).
def _zero_one_adam(settings: Any) -> optax.GradientTransformation:
    return clipped(
        jd.zero_one_adam(
            schedule(settings.lr, settings),
            var_freeze_step=max(1, settings.steps * 15 // 100),
            num_workers=settings.replicas,
            b2=0.95,
            eps=_EPS_COMPRESSED_ADAM,
            var_update_scaler=16,
            local_step_scaler=32,
            local_step_clipper=16,
        ),
    )


def _desloc(settings: Any) -> optax.GradientTransformation:
    return clipped(
        jd.desloc_adam(
            schedule(settings.lr, settings),
            sync_every=16,
            momentum_sync_every=48,
            variance_sync_every=96,
            b2=0.95,
            eps=_EPS_COMPRESSED_ADAM,
            weight_decay=settings.weight_decay,
        ),
    )


TXS: dict[str, Method] = {
    "dense": Method(
        lambda s: optax.chain(jd.all_reduce(), adamw(s)), False, "all-reduce of the gradient, then AdamW"
    ),
    "diloco": Method(
        lambda s: jd.diloco(adamw(s), sync_every=s.sync_every, outer=outer(s)),
        True,
        "DiLoCo: AdamW inner steps, a Nesterov outer step every --sync-every",
    ),
    "streaming_diloco": Method(
        _streaming, True, "Streaming DiLoCo: 4 fragments, 4-bit (E3M0) outer all-reduce with error feedback"
    ),
    "powersgd": Method(
        lambda s: optax.chain(jd.powersgd(s.rank), adamw(s)), False, "PowerSGD (rank --rank), then AdamW"
    ),
    "demo": Method(
        lambda s: jd.decoupled_momentum(schedule(s.demo_lr, s), decay=0.999, chunk=64, topk=32),
        False,
        "DeMo: DCT top-32 of 64x64 tiles of the momentum, sign update",
    ),
    "top_k": Method(
        lambda s: optax.chain(jd.top_k(density=s.density), adamw(s)),
        False,
        "top-k (--density) with error feedback, then AdamW",
    ),
    "sparseloco": Method(
        lambda s: jd.sparseloco(adamw(s), sync_every=s.sync_every, topk=64, chunk=64, bits=2),
        True,
        "SparseLoCo: AdamW inner steps; top-64 of 64x64 tiles, 2-bit, error feedback, outer SGD 1.0",
    ),
    "muloco": Method(
        _muloco,
        True,
        "MuLoCo: Muon inner steps (Adam on embeddings and vectors); 2-bit outer step, Nesterov",
    ),
    "noloco": Method(
        lambda s: jd.noloco(adamw(s), sync_every=s.sync_every),
        True,
        "NoLoCo: AdamW inner steps; every --sync-every, average with one random peer (no all-reduce)",
    ),
    "zero_one_adam": Method(
        _zero_one_adam,
        True,
        "0/1 Adam (gradients clipped): variance frozen after 15% of the steps, then 1-bit syncs",
    ),
    "desloc": Method(
        _desloc,
        True,
        "DES-LOC Adam (gradients clipped): parameters every 16, first moment every 48, second every 96",
    ),
    "muon_optax": Method(
        _muon_optax,
        False,
        "all-reduce, then optax.contrib.muon at --muon-lr (AdamW at --lr on embeddings and vectors)",
    ),
    "muon": Method(
        _muon, False, "distributed Muon: each replica orthogonalises 1/W of the matrices (optax's numbers)"
    ),
    "dion": Method(
        _dion, False, "Dion at --rank-fraction, --muon-lr (AdamW at --lr on embeddings and vectors)"
    ),
    "dion2": Method(
        _dion2, False, "Dion2: orthogonalise the top --dion2-fraction of each matrix's rows, --muon-lr"
    ),
    "local_sgd": Method(
        lambda s: optax.chain(adamw(s), jd.average_params(every=s.sync_every)),
        True,
        "local AdamW, parameters averaged every --sync-every",
    ),
}


# ----------------------------------------------------------------------------
# Measurements.


def per_device_bytes(tree: Any) -> int:
    """The most bytes any one device holds of ``tree``'s arrays (read off the device buffers)."""
    totals: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        for sh in x.addressable_shards:
            totals[sh.device] = totals.get(sh.device, 0) + sh.data.nbytes
    return max(totals.values())


def data_axis_bytes(cost: jd.CommunicationCost) -> tuple[list[float], list[float]]:
    """(bytes sent on each evaluated step, on each step of the repeating period) over the replica axis."""

    def on_data(step) -> float:
        return float(sum(c.sent_bytes() for c in step.collectives if DATA in _axes(c.axes)))

    return [on_data(s) for s in cost.steps], [on_data(s) for s in cost.period_steps()]


def replica_axis_cost(tx: optax.GradientTransformation, params: Any, settings: Any) -> jd.CommunicationCost:
    """``tx``'s communication per step over the replica axis, for a run of ``settings.steps`` steps.

    ``communication_cost`` simulates up to 256 steps to find a repeating
    pattern; a longer period (DiLoCo with ``sync_every`` >= 100) is not found
    there, and the average over those 256 steps would be off (two syncs in
    256 steps for H = 100). Then the run's own steps are counted.
    """
    cost = jd.communication_cost(tx, params, num_workers=settings.replicas)
    if cost.step_dependent and len(cost.period) == len(cost.steps) < settings.steps:
        cost = jd.communication_cost(tx, params, num_workers=settings.replicas, steps=settings.steps)
    return cost


def _axes(axes: Any) -> tuple[Any, ...]:
    return axes if isinstance(axes, tuple) else (axes,)


def cumulative_bytes(per_step: list[float], period: list[float], steps: int) -> float:
    """Bytes a worker sent over the first ``steps`` steps: the evaluated ones, then the period repeated."""
    head = per_step[: len(per_step) - len(period)]
    if steps <= len(head):
        return float(sum(head[:steps]))
    full, part = divmod(steps - len(head), len(period))
    return float(sum(head) + full * sum(period) + sum(period[:part]))


def global_params(params: Any, opt_state: Any, per_worker: bool) -> Any:
    """The model to evaluate: DiLoCo's global anchor, the workers' mean for other per-worker methods
    (NoLoCo's anchors are per worker: there is no global model), else params."""
    if not per_worker:
        return params
    anchor = optax.tree_utils.tree_get(opt_state, "anchor")
    stacked = jax.tree.leaves(params)[0].ndim
    if anchor is not None and jax.tree.leaves(anchor)[0].ndim < stacked:
        return anchor
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), params)


# ----------------------------------------------------------------------------
# Training.


def progress_bar(total: int, desc: str, disable: bool) -> Any:
    """A tqdm bar on stderr: the method (and seed) in ``desc``, the step, the last loss in the postfix."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, unit="step")


def loss_note(last: Any, val: float | None) -> str:
    """The bar's postfix: the last finished step's training loss and the last validation loss, in bits/byte.

    ``last`` is a step's loss (an array, still being computed or done): reading the one before the
    step just dispatched keeps a step in flight while the bar shows a loss.
    """
    note = f"loss {float(jnp.mean(last)) / math.log(2):.3f}"
    return note + (f", val {val:.3f} bits/byte" if val is not None else " bits/byte")


# JAX_PLATFORMS names -> the platform of their devices (jax.Device.platform).
_ACCELERATORS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}


def require_platform(requested: str | None = None) -> None:
    """Checks, before anything is built, that the accelerator ``JAX_PLATFORMS`` asks for is what JAX runs on.

    ``requested`` defaults to ``$JAX_PLATFORMS``; its first entry counts (``cuda,cpu``: CUDA
    first). Without an accelerator there (``cpu``, or unset) nothing is checked.

    Raises:
      SystemExit: naming the platform asked for and what JAX found instead (its devices, or the
        error it raised when it could not start the platform).
    """
    requested = os.environ.get("JAX_PLATFORMS", "") if requested is None else requested
    first = requested.split(",")[0].strip().lower()
    if first not in _ACCELERATORS:
        return
    try:
        devices = jax.devices()
    except Exception as e:  # JAX raises RuntimeError, or (no plugin at all) a bare AssertionError
        found = f"JAX could not start it ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
    else:
        if devices[0].platform == _ACCELERATORS[first]:
            return
        found = f"JAX runs on {len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind})"
    plugins = sorted(
        d.metadata["Name"]
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm", "libtpu"))
    )
    raise SystemExit(
        f"JAX_PLATFORMS={requested} asks for {first} devices, but {found}; JAX plugins installed: "
        f"{', '.join(plugins) or 'none'}. This command is meant for a machine with that accelerator and its "
        "JAX (jax[cuda12] or jax[cuda13] for CUDA, jax[tpu] for TPU); on a CPU, leave JAX_PLATFORMS unset."
    )


def make_mesh(replicas: int, fsdp: int) -> jax.sharding.Mesh:
    """A ``(replicas, fsdp)`` mesh with axes ``("data", "fsdp")`` over the first devices."""
    n = replicas * fsdp
    if n > jax.device_count():
        raise ValueError(f"a {replicas} x {fsdp} mesh needs {n} devices; {jax.device_count()} available.")
    return jax.make_mesh((replicas, fsdp), (DATA, FSDP), devices=jax.devices()[:n])


def val_batch(corpus: Corpus, cfg: GPTConfig, windows: int) -> np.ndarray:
    """The fixed validation windows (the same for every method and seed)."""
    return sample_windows(corpus.val, np.random.default_rng(12345), windows, cfg.context)


class Trainer:
    """One method of :data:`TXS` on one model shape, compiled once and run for any number of seeds.

    ``settings`` holds the command-line settings (steps, batch, lr, ...; see
    :func:`parser`). Building the model, the step and the evaluation happens
    here; :meth:`run` trains from a seed's initialisation and data order.
    """

    def __init__(self, name: str, cfg: GPTConfig, settings: Any, *, label: str | None = None):
        self.name, self.cfg, self.settings, self.method = name, cfg, settings, TXS[name]
        self.label = label or name  # the progress bar's name for the run
        graphdef, params, rest = nnx.split(build_model(cfg, 0), nnx.Param, ...)
        self.tx = self.method.make(settings)
        self.loss = make_loss(graphdef, rest)
        self.cost = replica_axis_cost(self.tx, params, settings)
        self.per_step, self.period = data_axis_bytes(self.cost)
        self.num_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
        self.build(params)

    def build(self, params: Any) -> None:
        """The step and the evaluation, on the ``(replicas, fsdp)`` mesh."""
        self.param_specs = nnx.get_partition_spec(params)  # P("fsdp", None)-style, from the metadata
        self.step = jd.data_parallel_step(
            self.loss,
            self.tx,
            mesh=make_mesh(self.settings.replicas, self.settings.fsdp),
            param_specs=self.param_specs,
            batch_axes=FSDP,
            per_worker_params=self.method.per_worker,
        )
        per_worker = self.method.per_worker
        self.evaluate = jax.jit(lambda p, s, b: self.loss(global_params(p, s, per_worker), b))

    def result(self, seed: int, seconds: float, losses: list, evals: list, **memory: Any) -> dict:
        """A run's record: the bytes over the replica axis, the curves, and ``memory``'s entries."""
        return {
            "tx": self.name,
            "seed": seed,
            "params": self.num_params,
            **memory,
            "bytes_per_step": float(np.mean(self.period)) if self.period else 0.0,
            "peak_bytes_per_step": float(max(self.period, default=0.0)),
            "dense_bytes_per_step": self.cost.dense_bytes,
            "seconds": seconds,
            "train_bpb": losses,
            "evals": evals,
        }

    def init(self, seed: int) -> tuple[Any, Any]:
        """Placed ``(params, opt_state)`` for the model initialised from ``seed``."""
        _, params, _ = nnx.split(build_model(self.cfg, seed), nnx.Param, ...)
        return self.step.init(params)

    def run(self, corpus: Corpus, *, seed: int, progress: bool = True) -> dict:
        """Trains from ``seed`` (initialisation and data order); returns the run's record.

        The record has the parameter count, the per-device bytes of
        parameters + optimizer state, the replica-axis bytes per step (mean
        and peak) and per evaluation ``{"step", "val_bpb", "data_axis_bytes"}``.
        """
        st = self.settings
        p, s = self.init(seed)
        memory, total_memory = per_device_bytes((p, s)), sum(x.nbytes for x in jax.tree.leaves((p, s)))
        sharding = jax.sharding.NamedSharding(self.step.mesh, P())
        held_out = jax.device_put(val_batch(corpus, self.cfg, st.eval_windows), sharding)
        rng = np.random.default_rng(1000 + seed)
        evals, losses, pending = [], [], []

        def record(t: int) -> float:
            bpb = float(self.evaluate(p, s, held_out)) / math.log(2)
            sent = cumulative_bytes(self.per_step, self.period, t)
            evals.append({"step": t, "val_bpb": bpb, "data_axis_bytes": sent})
            return bpb

        val = record(0)
        bar = progress_bar(st.steps, f"{self.label} seed {seed}", disable=not progress)
        start = time.perf_counter()
        for t in range(1, st.steps + 1):
            p, s, metrics = self.step(p, s, sample_windows(corpus.train, rng, st.batch, self.cfg.context))
            pending.append(metrics["loss"])
            if progress and len(pending) > 1:
                bar.set_postfix_str(loss_note(pending[-2], val), refresh=False)
            bar.update(1)
            if t % st.eval_every == 0 or t == st.steps:
                losses.extend(float(x) / math.log(2) for x in pending)
                val = record(t)
                bar.set_postfix_str(loss_note(pending[-1], val))
                pending = []
        bar.close()
        return self.result(
            seed,
            time.perf_counter() - start,
            losses,
            evals,
            per_device_bytes=memory,
            total_bytes=total_memory,
        )

    def run_seeds(self, corpus: Corpus, seeds: Any, *, progress: bool = True) -> list[dict]:
        """:meth:`run` for each seed in turn."""
        return [self.run(corpus, seed=seed, progress=progress) for seed in seeds]


def one_model(params: Any, opt_state: Any, per_worker: bool) -> Any:
    """:func:`global_params` of one run whose replicas are stacked on a leading axis (under ``vmap``).

    A replicated anchor (DiLoCo's global model) is the anchor every replica
    holds; per-worker anchors (NoLoCo, eager DiLoCo) or none give the mean of
    the replicas' parameters; with replicated parameters, replica 0's.
    """
    if not per_worker:
        return jax.tree.map(lambda x: x[0], params)
    mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), params)
    anchor = optax.tree_utils.tree_get(opt_state, "anchor")
    if anchor is None:
        return mean
    agreed = jnp.all(jnp.stack([jnp.all(a == a[:1]) for a in jax.tree.leaves(anchor)]))
    return jax.tree.map(lambda a, m: jnp.where(agreed, a[0], m), anchor, mean)


class VmapTrainer(Trainer):
    """:class:`Trainer` on one device: the replicas under ``jax.vmap(axis_name="data")``, the seeds batched too.

    For a machine with a single accelerator. Each replica holds the whole
    model (nothing is sharded over ``"fsdp"``; ``settings.fsdp`` is unused),
    the optimizer's collectives run over the vmapped replica axis, and every
    seed of :meth:`run_seeds` trains in the same program (an outer ``vmap``
    with no axis name: the seeds never communicate). Batches, initialisation
    and evaluation are those of :class:`Trainer`, so the numbers agree with
    the mesh's to float rounding. Records give ``replica_bytes`` (one
    replica's parameters and optimizer state, unsharded) in place of
    ``per_device_bytes``.
    """

    def build(self, params: Any) -> None:
        """The step (the replicas under an inner ``vmap`` with the axis name, the seeds under an outer one) and
        the evaluation."""

        def worker(p, s, batch):
            loss, grads = jax.value_and_grad(self.loss)(p, batch)
            updates, s = self.tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        self.step = jax.jit(jax.vmap(jax.vmap(worker, axis_name=DATA)), donate_argnums=(0, 1))
        self.init_state = jax.jit(jax.vmap(self.tx.init))
        per_worker = self.method.per_worker
        evaluate = lambda p, s, b: self.loss(one_model(p, s, per_worker), b)  # noqa: E731
        self.evaluate = jax.jit(jax.vmap(evaluate, in_axes=(0, 0, None)))

    def init(self, seed: int) -> tuple[Any, Any]:
        """``(params, opt_state)`` of one seed, stacked over the replicas."""
        _, params, _ = nnx.split(build_model(self.cfg, seed), nnx.Param, ...)
        stacked = jax.tree.map(lambda x: jnp.stack([x] * self.settings.replicas), params)
        return stacked, self.init_state(stacked)

    def run(self, corpus: Corpus, *, seed: int, progress: bool = True) -> dict:
        return self.run_seeds(corpus, [seed], progress=progress)[0]

    def run_seeds(self, corpus: Corpus, seeds: Any, *, progress: bool = True) -> list[dict]:
        """Trains every seed at once; returns one record per seed (see :meth:`Trainer.run`)."""
        st, seeds, n = self.settings, list(seeds), self.settings.replicas
        p, s = jax.tree.map(lambda *xs: jnp.stack(xs), *[self.init(seed) for seed in seeds])
        one = jax.tree.map(lambda x: x[0, 0], (p, s))
        replica = sum(x.nbytes for x in jax.tree.leaves(one))
        held_out = jnp.asarray(val_batch(corpus, self.cfg, st.eval_windows))
        rngs = [np.random.default_rng(1000 + seed) for seed in seeds]
        evals, losses, pending = [[] for _ in seeds], [[] for _ in seeds], []

        def batches() -> np.ndarray:
            windows = [sample_windows(corpus.train, r, st.batch, self.cfg.context) for r in rngs]
            return np.stack([w.reshape(n, st.batch // n, -1) for w in windows])

        def record(t: int) -> float:
            bpb = np.asarray(self.evaluate(p, s, held_out)) / math.log(2)
            sent = cumulative_bytes(self.per_step, self.period, t)
            for i, b in enumerate(bpb):
                evals[i].append({"step": t, "val_bpb": float(b), "data_axis_bytes": sent})
            return float(bpb.mean())

        val = record(0)
        bar = progress_bar(st.steps, f"{self.label} {len(seeds)} seed(s)", disable=not progress)
        start = compiled = time.perf_counter()
        for t in range(1, st.steps + 1):
            p, s, loss = self.step(p, s, batches())
            pending.append(loss)
            if t == 1:  # the first step compiles: time the rest
                jax.block_until_ready(loss)
                compiled = time.perf_counter()
            if progress and len(pending) > 1:  # the seeds' and replicas' mean
                bar.set_postfix_str(loss_note(pending[-2], val), refresh=False)
            bar.update(1)
            if t % st.eval_every == 0 or t == st.steps:
                per_seed = np.asarray(jnp.stack(pending)).mean(axis=-1).T / math.log(2)  # replicas' mean
                for i, curve in enumerate(per_seed):
                    losses[i].extend(float(v) for v in curve)
                val = record(t)
                bar.set_postfix_str(loss_note(pending[-1], val))
                pending = []
        bar.close()
        seconds = time.perf_counter() - compiled
        first = compiled - start
        device = str(jax.devices()[0].device_kind)
        return [
            self.result(
                seed,
                seconds,
                losses[i],
                evals[i],
                replica_bytes=replica,
                total_bytes=replica * n,
                timed_steps=st.steps - 1,  # seconds: after the first step, evaluations included
                first_step_seconds=first,
                seeds_together=len(seeds),
                device=device,
            )
            for i, seed in enumerate(seeds)
        ]


def train(
    name: str, cfg: GPTConfig, settings: Any, corpus: Corpus, *, seed: int, progress: bool = True
) -> dict:
    """One run of one method: on the mesh (:class:`Trainer`), or on one device with ``settings.one_device``."""
    trainer = VmapTrainer if getattr(settings, "one_device", False) else Trainer
    return trainer(name, cfg, settings).run(corpus, seed=seed, progress=progress)


# ----------------------------------------------------------------------------
# Output.


def plot(runs: list[dict], path: pathlib.Path) -> bool:
    """Validation bits per byte against steps and against replica-axis bytes; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        ev = run["evals"]
        by_step.plot([e["step"] for e in ev], [e["val_bpb"] for e in ev], marker=".", label=run["tx"])
        sent = [(e["data_axis_bytes"], e["val_bpb"]) for e in ev if e["data_axis_bytes"] > 0]
        if sent:
            by_bytes.plot(*zip(*sent), marker=".", label=run["tx"])
    by_step.set(xlabel="step", ylabel="validation bits per byte", title="validation loss")
    by_bytes.set(
        xlabel="bytes sent per worker over the replica axis", xscale="log", title="against communication"
    )
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def fmt_bytes(b: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.4g} {unit}"
    return f"{b:.4g} B"


def memory_bytes(run: dict) -> float:
    """A record's parameters + optimizer state on the fullest device (one replica, unsharded, on one device)."""
    return run["per_device_bytes"] if "per_device_bytes" in run else run["replica_bytes"]


def summary(runs: list[dict]) -> str:
    """A markdown table of the runs."""
    lines = [
        "| tx | val bits/byte | data-axis bytes/step (mean) | peak | vs dense all-reduce | params+opt state per device |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ratio = r["dense_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else math.inf
        lines.append(
            f"| {r['tx']} | {r['evals'][-1]['val_bpb']:.4f} | {fmt_bytes(r['bytes_per_step'])} | "
            f"{fmt_bytes(r['peak_bytes_per_step'])} | {vs_dense(ratio)} | {fmt_bytes(memory_bytes(r))} |"
        )
    return "\n".join(lines)


def vs_dense(ratio: float) -> str:
    """A method's bytes against a dense all-reduce's, ``ratio`` = dense / method: "50x less", "the same", "2x more"."""
    if math.isclose(ratio, 1.0, rel_tol=1e-3):
        return "the same"
    return f"{ratio:.4g}x less" if ratio > 1 else f"{1 / ratio:.4g}x more"


QUICK = {
    "tx": "dense,diloco",
    "steps": 30,
    "dim": 32,
    "depth": 1,
    "heads": 2,
    "context": 32,
    "batch": 16,
    "eval_every": 15,
    "eval_windows": 16,
    "sync_every": 10,
    "warmup": 5,
    "lr": 1e-2,
}
"""The settings of ``--quick`` (a run of well under a minute on a CPU); flags given override them."""

QUICK_NOTE = (
    "--quick shows that the pipeline runs (the sharded model, each method's step, its bytes over the replica "
    "axis), not how the methods compare: in 30 steps DiLoCo takes 3 outer steps (it is evaluated at its anchor, "
    "which moves every 10 steps), and the validation loss is taken on 16 windows of 32 bytes, over which one "
    "model's loss varies by 0.2-0.3 bits/byte from one draw of windows to another. A loss that rises between "
    "two evaluations, or a gap between the methods, means nothing at this size; the comparison takes hundreds "
    "of steps (docs/guides/sharded_models.md)."
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # argparse formats help strings with %: a literal one is written %%.
    choices = "; ".join(f"{name}: {m.help}" for name, m in TXS.items()).replace("%", "%%")
    ap.add_argument("--tx", default="dense", help=f"one or more, comma-separated. {choices}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="windows per step over all devices (multiple of 8)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--norm", choices=("layer", "rms"), default="layer")
    ap.add_argument("--positions", choices=("learned", "rope"), default="learned")
    ap.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True, help="tied embeddings")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    ap.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--sync-every", type=int, default=50, help="H of diloco, streaming_diloco, local_sgd")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument(
        "--muon-lr",
        type=float,
        default=0.02,
        help="the Muon, Dion and Dion2 (and MuLoCo's) peak learning rate",
    )
    ap.add_argument("--demo-lr", type=float, default=1e-3, help="DeMo's peak learning rate (sign updates)")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    ap.add_argument("--rank-fraction", type=float, default=0.25, help="Dion's rank / min(d_in, d_out)")
    ap.add_argument("--dion2-fraction", type=float, default=0.25, help="Dion2's fraction of rows updated")
    ap.add_argument("--density", type=float, default=0.01, help="top_k's fraction of entries sent")
    ap.add_argument("--replicas", type=int, default=2, help="size of the replica axis 'data'")
    ap.add_argument("--fsdp", type=int, default=4, help="size of the model axis 'fsdp'")
    ap.add_argument(
        "--one-device",
        action="store_true",
        help="the replicas under jax.vmap on one device (one GPU), parameters unsharded; --fsdp is unused",
    )
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=64, help="validation windows (multiple of 8)")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="fraction of files held out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        default=None,
        help="folder for results.json and the plot (default: a new temporary directory)",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a small model and a short run (dense and diloco, 30 steps; under a minute on a CPU); "
        "other flags given override its settings",
    )
    return ap


def layout(settings: Any) -> str:
    """Where the replicas run, in words."""
    if getattr(settings, "one_device", False):
        return f"{settings.replicas} replicas under vmap on one {jax.devices()[0].device_kind}"
    return f"mesh {settings.replicas} replicas x {settings.fsdp} fsdp"


def config(settings: Any) -> GPTConfig:
    return GPTConfig(
        context=settings.context,
        dim=settings.dim,
        depth=settings.depth,
        heads=settings.heads,
        norm=settings.norm,
        positions=settings.positions,
        tied=settings.tied,
    )


def parse_args(argv: list[str] | None, ap: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line's settings; with ``--quick``, :data:`QUICK` where no flag is given."""
    ap = ap or parser()
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(**QUICK)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = parse_args(argv, ap)
    names = [n.strip() for n in args.tx.split(",") if n.strip()]
    unknown = [n for n in names if n not in TXS]
    if unknown or not names:
        ap.error(f"--tx: unknown {unknown}; choose from {', '.join(TXS)}")
    if args.steps < 1 or args.eval_every < 1:
        ap.error("--steps and --eval-every must be positive")
    devices = args.replicas * (1 if args.one_device else args.fsdp)
    for flag, value in (("--batch", args.batch), ("--eval-windows", args.eval_windows)):
        if value < 1 or value % devices:
            ap.error(
                f"{flag} must be a positive multiple of {devices} (replicas{'' if args.one_device else ' x fsdp'})"
            )
    for name in names:  # every method's settings, checked before the first one trains
        try:
            TXS[name].make(args)
        except ValueError as e:
            ap.error(f"--tx {name}: {e}")
    require_platform()
    cfg = config(args)
    corpus = load_corpus(val_fraction=args.val_fraction)
    print(
        f"corpus {corpus.root}: {len(corpus.train_files)} training files ({len(corpus.train) / 1e6:.2f} MB), "
        f"{len(corpus.val_files)} validation files ({len(corpus.val) / 1e6:.2f} MB)",
        flush=True,
    )
    runs = []
    for name in names:
        runs.append(train(name, cfg, args, corpus, seed=args.seed, progress=not args.no_progress))
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="jaxopt_dist-lm-"))
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": dataclasses.asdict(cfg), "settings": vars(args), "runs": runs}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    plotted = plot(runs, out / "lm_val_loss.png")
    r0 = runs[0]
    print(
        f"\nbyte-level GPT, {r0['params']:,} parameters, context {cfg.context}; {layout(args)}; "
        f"{args.steps} steps of {args.batch} windows; params+opt state "
        f"{fmt_bytes(r0['total_bytes'])} in all\n"
    )
    print(summary(runs))
    if args.quick:
        print(f"\n{QUICK_NOTE}")
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'lm_val_loss.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
