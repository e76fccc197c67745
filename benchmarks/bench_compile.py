"""Compile time of every transform's step against a hand-written optax step, by model depth.

Question: does a transform's program, and with it the time the compiler
takes before the first step, grow with the number of parameter leaves
faster than a hand-written optax step's does? A GPT-shaped parameter tree
(per layer two LayerNorms and four biased dense layers: 12 leaves; plus the
token and position embeddings and the final LayerNorm), trained on 8
simulated CPU devices with ``jaxopt_dist.data_parallel_step`` and a
byte-level GPT loss, is lowered and compiled for every row of
``examples/demo.py`` and for ``muon``, ``dion`` and ``dion2``. The baseline
is a hand-written ``jax.shard_map`` step with the same loss, compiled in the
same process: ``lax.pmean`` of the gradients and ``optax.adam`` (for the
orthonormal rows ``optax.contrib.muon``, the matrices of the blocks under
Muon, everything else under Adam). It is compiled before the first row and
after the last, and each row is divided by the mean of the two.

Reported per depth and row: seconds to lower (trace to StableHLO) and to
compile (XLA), the lines of the compiled HLO, and (lower + compile) as a
multiple of the baseline's, in wall seconds and in CPU seconds of the
process (all its threads: the figure that load from other processes
disturbs least); per row, the growth of that multiple from the first depth
to the last (the row's growth over the baseline's). Goals: every row
within 2x of its baseline at 12 layers, and a growth of at most 1.3 from
12 to 24 layers.

Run: ``python benchmarks/bench_compile.py`` (both depths, every row; long),
``--layers 12 --methods dense,adasum`` for some rows, ``--quick`` for a
smoke run (2 layers, a few rows).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd

P = jax.sharding.PartitionSpec

DIM, CONTEXT, VOCAB, HEADS = 64, 32, 256, 4
MUON_ROWS = ("muon", "dion", "dion2")
QUICK_ROWS = ("dense", "top_k", "diloco", "adasum", "muon")


# ----------------------------------------------------------------------------
# The model: a GPT-shaped tree of 12 leaves a layer, and its loss.


def gpt_params(layers: int, seed: int = 0) -> dict[str, Any]:
    """A GPT's parameters: ``12 * layers + 4`` leaves (148 at 12 layers, 0.63M entries)."""
    rng = np.random.default_rng(seed)

    def dense(a: int, b: int) -> dict[str, jax.Array]:
        w = rng.standard_normal((a, b)) * 0.02
        return {"kernel": jnp.asarray(w, jnp.float32), "bias": jnp.zeros((b,), jnp.float32)}

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((DIM,), jnp.float32), "bias": jnp.zeros((DIM,), jnp.float32)}

    params: dict[str, Any] = {
        "embed": jnp.asarray(rng.standard_normal((VOCAB, DIM)) * 0.02, jnp.float32),
        "pos": jnp.asarray(rng.standard_normal((CONTEXT, DIM)) * 0.01, jnp.float32),
        "norm": norm(),
    }
    for i in range(layers):
        params[f"layer_{i:02d}"] = {
            "norm1": norm(),
            "qkv": dense(DIM, 3 * DIM),
            "out": dense(DIM, DIM),
            "norm2": norm(),
            "fc": dense(DIM, 4 * DIM),
            "proj": dense(4 * DIM, DIM),
        }
    return params


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def gpt_loss(params: dict[str, Any], batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy of a pre-norm GPT on ``batch`` int32 ``(n, CONTEXT + 1)``."""
    tokens, targets = batch[:, :-1], batch[:, 1:]
    b, t = tokens.shape
    x = params["embed"][tokens] + params["pos"][None, :t]
    layers = sorted(k for k in params if k.startswith("layer_"))
    for name in layers:
        p = params[name]
        qkv = _dense(_layer_norm(x, p["norm1"]), p["qkv"]).reshape(b, t, 3, HEADS, DIM // HEADS)
        att = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        x = x + _dense(att.reshape(b, t, DIM), p["out"])
        x = x + _dense(jax.nn.gelu(_dense(_layer_norm(x, p["norm2"]), p["fc"])), p["proj"])
    logits = _layer_norm(x, params["norm"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def is_block_matrix(path: tuple, x: Any) -> bool:
    names = {getattr(k, "key", None) for k in path}
    return x.ndim == 2 and not names & {"embed", "pos"}


def muon_dims(params: Any) -> Any:
    """Muon's dimension numbers: the blocks' matrices; None (Adam) for embeddings and vectors."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: optax.contrib.MuonDimensionNumbers() if is_block_matrix(path, x) else None, params
    )


def not_block_matrix(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, x: not is_block_matrix(path, x), params)


# ----------------------------------------------------------------------------
# The rows.


@dataclasses.dataclass(frozen=True)
class Row:
    make: Callable[[], optax.GradientTransformation]
    per_worker_params: bool = False
    bf16: bool = False
    baseline: str = "adam"  # "adam" or "muon"


def rows(n: int, params: Any) -> dict[str, Row]:
    """Every row of examples/demo.py, then muon, dion and dion2."""
    demo = _common.import_demo()
    out: dict[str, Row] = {}
    for name, m in demo.methods().items():
        if m.sized:
            make = lambda m=m: m.make(num_workers=n)  # noqa: E731
        elif m.warmup:
            rng = np.random.default_rng(0)
            snapshots = [
                jax.tree.map(lambda x: x + 0.01 * rng.standard_normal(x.shape), params) for _ in range(4)
            ]
            make = lambda m=m, s=snapshots: m.make(s)  # noqa: E731
        else:
            make = m.make
        # MuLoCo's inner optimizer is optax.contrib.muon: its baseline is the Muon step.
        out[name] = Row(make, m.per_worker_params, m.bf16, baseline="muon" if name == "muloco" else "adam")
    adam = lambda: optax.adamw(1e-3, b2=0.95)  # noqa: E731
    out["muon"] = Row(
        lambda: jd.muon(0.02, num_workers=n, muon_weight_dimension_numbers=muon_dims), baseline="muon"
    )
    out["dion"] = Row(
        lambda: jd.dion(0.02, rank_fraction=0.25, scalar_optimizer=adam(), scalar_mask=not_block_matrix),
        baseline="muon",
    )
    out["dion2"] = Row(
        lambda: jd.dion2(0.02, num_workers=n, scalar_optimizer=adam(), weight_dimension_numbers=muon_dims),
        baseline="muon",
    )
    return out


# ----------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass
class Timing:
    lower: float  # seconds, wall clock
    compile: float
    hlo_lines: int
    cpu: float  # lower + compile, CPU seconds of this process (all its threads)

    @property
    def total(self) -> float:
        return self.lower + self.compile


def _time(lower: Callable[[], Any]) -> Timing:
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    lines = compiled.as_text().count("\n")
    return Timing(t1 - t0, t2 - t1, lines, c2 - c0)


def hand_written(kind: str, mesh: Any, params: Any, batch: Any) -> Timing:
    """The baseline: a shard_map step of ``lax.pmean`` and ``optax.adam`` (or ``optax.contrib.muon``)."""
    if kind == "muon":
        tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=muon_dims)
    else:
        tx = optax.adam(1e-3)

    def body(p, s, b):
        p_var = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), p)
        loss, grads = jax.value_and_grad(gpt_loss)(p_var, b)
        grads = jax.lax.pmean(grads, "data")
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "data")

    replicated = jax.sharding.NamedSharding(mesh, P())
    params, state = jax.device_put((params, tx.init(params)), replicated)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())))
    return _time(lambda: fn.lower(params, state, batch))


def ours(row: Row, mesh: Any, params: Any, batch: Any) -> Timing:
    tx = row.make()
    p0 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params) if row.bf16 else params
    loss_fn = (
        (lambda p, b: gpt_loss(jax.tree.map(lambda x: x.astype(jnp.float32), p), b)) if row.bf16 else gpt_loss
    )
    step = jd.data_parallel_step(
        loss_fn,
        tx,
        mesh=mesh,
        per_worker_params=row.per_worker_params,
        loss_scale=jd.loss_scale if row.bf16 else None,
    )
    p, s = step.abstract_init(p0)
    return _time(lambda: step.lower(p, s, batch))


def _mean(a: Timing, b: Timing) -> Timing:
    return Timing((a.lower + b.lower) / 2, (a.compile + b.compile) / 2, a.hlo_lines, (a.cpu + b.cpu) / 2)


def measure(layers: int, names: list[str], mesh: Any) -> dict[str, tuple[Timing, Timing]]:
    """Per row: its timing and its baseline's (the mean of one before the rows and one after)."""
    n = mesh.shape["data"]
    params = gpt_params(layers)
    data = jax.sharding.NamedSharding(mesh, P("data"))
    batch = jax.ShapeDtypeStruct((2 * n, CONTEXT + 1), jnp.int32, sharding=data)
    table = rows(n, params)
    kinds = sorted({table[m].baseline for m in names})
    before = {k: hand_written(k, mesh, params, batch) for k in kinds}
    results: dict[str, Timing] = {}
    for name in names:
        results[name] = t = ours(table[name], mesh, params, batch)
        print(
            f"  [{layers} layers] {name}: lower {t.lower:.1f} s, compile {t.compile:.1f} s, "
            f"{t.hlo_lines} HLO lines, {t.cpu:.1f} CPU s",
            file=sys.stderr,
            flush=True,
        )
        jax.clear_caches()
        gc.collect()
    after = {k: hand_written(k, mesh, params, batch) for k in kinds}
    base = {k: _mean(before[k], after[k]) for k in kinds}
    for k in kinds:
        print(
            f"  [{layers} layers] hand-written {k}: {before[k].total:.1f} s before, {after[k].total:.1f} s after "
            f"({before[k].cpu:.1f} and {after[k].cpu:.1f} CPU s), {before[k].hlo_lines} HLO lines",
            file=sys.stderr,
            flush=True,
        )
    out = {name: (results[name], base[table[name].baseline]) for name in names}
    out.update({f"(hand-written {k})": (base[k], base[k]) for k in kinds})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick_help="2 and 4 layers, a few rows (smoke test)")
    ap.add_argument("--layers", default="12,24", help="comma-separated depths (default 12,24)")
    ap.add_argument("--methods", default=None, help="comma-separated rows (default: every row)")
    args = ap.parse_args(argv)

    mesh = _common.data_mesh()
    known = list(rows(mesh.shape["data"], gpt_params(1)))
    depths = [2, 4] if args.quick else [int(d) for d in args.layers.split(",")]
    names = list(QUICK_ROWS) if args.quick and args.methods is None else known
    if args.methods is not None:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown:
        ap.error(f"unknown --methods {unknown}; known: {', '.join(known)}")

    by_depth = {d: measure(d, names, mesh) for d in depths}
    print(_caption(depths, mesh))
    print(_table(by_depth, names, depths))
    return 0


def _caption(depths: list[int], mesh: Any) -> str:
    trees = []
    for d in depths:
        leaves = jax.tree.leaves(gpt_params(d))
        trees.append(
            f"{d} layers: {len(leaves)} leaves, {sum(math.prod(x.shape) for x in leaves) / 1e6:.2f}M"
        )
    return (
        f"GPT-shaped trees ({', '.join(trees)}), {mesh.shape['data']} CPU devices, JAX {jax.__version__}. "
        "x = (lower + compile) / the hand-written step's, in wall seconds and in CPU seconds of the "
        "process; growth = a row's x at the last depth over its x at the first."
    )


def _table(by_depth: dict[int, dict[str, tuple[Timing, Timing]]], names: list[str], depths: list[int]) -> str:
    first, last = depths[0], depths[-1]
    head = ["row"]
    for d in depths:
        head += [f"{d}L lower s", f"{d}L compile s", f"{d}L HLO lines", f"{d}L x", f"{d}L x CPU"]
    if len(depths) > 1:
        head += [f"growth {first}->{last}L", f"growth {first}->{last}L CPU"]
    lines = [_common.markdown_header(head, "l" + "r" * (len(head) - 1))]
    for name in [*names, *(k for k in by_depth[first] if k.startswith("("))]:
        cells = [name]
        for d in depths:
            t, b = by_depth[d][name]
            cells += [f"{t.lower:.1f}", f"{t.compile:.1f}", str(t.hlo_lines), f"{t.total / b.total:.2f}"]
            cells.append(f"{t.cpu / b.cpu:.2f}")
        if len(depths) > 1:
            (t0, b0), (t1, b1) = by_depth[first][name], by_depth[last][name]
            cells.append(f"{(t1.total / b1.total) / (t0.total / b0.total):.2f}")
            cells.append(f"{(t1.cpu / b1.cpu) / (t0.cpu / b0.cpu):.2f}")
        lines.append(_common.markdown_row(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
