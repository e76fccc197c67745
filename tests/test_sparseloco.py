"""statistical_quantize, chunked_top_k and sparseloco against NumPy loops over workers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import sparseloco as sl
from jaxopt_dist._src.sparseloco import (
    ChunkedTopKState,
    StatisticalQuantizeState,
    chunked_top_k,
    sparseloco,
    statistical_quantize,
)
from tests import helpers
from tests import test_checkpoint as ckpt

F32 = np.float32
SHAPES = {"w": (8, 12), "b": (10,), "k": (2, 3, 4), "s": ()}


# ----------------------------------------------------------------------------
# NumPy references (float32, one worker at a time).


def np_codes(v, bits, spread=6.0):
    """The statistical quantizer of a 1-D float32 row: (codes, codebook with the shift folded in)."""
    v = np.asarray(v, F32)
    bins, m = 2**bits, v.size
    shift = F32(v.mean(dtype=F32))
    c = (v - shift).astype(F32)
    sigma = F32(np.sqrt(np.sum(c * c, dtype=F32))) / F32(math.sqrt(max(m - 1, 1)))
    scale = F32(spread) * sigma / F32(bins)
    if scale == 0 or not np.isfinite(scale):
        scale = F32(1)
    q = np.clip(np.round(c / scale + F32(bins // 2)), 0, bins - 1).astype(np.int64)
    book = np.zeros(bins, F32)
    for b in range(bins):
        if np.any(q == b):
            book[b] = c[q == b].mean(dtype=F32)
    return q, (book + shift).astype(F32)


def np_quantize_rows(x, bits, row_wise):
    """Decoded statistical quantization of a leaf, one codebook per leaf or per row."""
    shape = x.shape
    rows = shape[0] if row_wise and len(shape) >= 2 else 1
    flat = x.reshape(rows, -1)
    out = np.zeros_like(flat)
    for r in range(rows):
        q, book = np_codes(flat[r], bits)
        out[r] = book[q]
    return out.reshape(shape)


def np_mean(rows):
    acc = np.zeros_like(rows[0])
    for x in rows:
        acc = acc + x
    return (acc / F32(len(rows))).astype(F32)


def np_statistical(grads, *, bits, beta, row_wise=False, requantize=True, dense=()):
    """Per step the output every worker gets; and each worker's final error buffers."""
    names = list(grads)
    T, n = grads[names[0]].shape[:2]
    err = [{k: np.zeros(grads[k].shape[2:], F32) for k in names if k not in dense} for _ in range(n)]
    outs = []
    for t in range(T):
        out = {}
        for k in names:
            if k in dense:
                out[k] = np_mean([grads[k][t, i] for i in range(n)])
                continue
            sent = []
            for i in range(n):
                e = (F32(beta) * err[i][k] + grads[k][t, i]).astype(F32)
                deq = np_quantize_rows(e, bits, row_wise)
                err[i][k] = (e - deq).astype(F32)
                sent.append(deq)
            mean = np_mean(sent)
            out[k] = np_quantize_rows(mean, bits, row_wise) if requantize else mean
        outs.append(out)
    return {k: np.stack([o[k] for o in outs]) for k in names}, err


def _np_matrix(shape):
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return int(np.prod(shape[:-1])), shape[-1]


def _np_block(s, chunk):
    return max(d for d in range(1, min(s, chunk) + 1) if s % d == 0)


def np_chunked(grads, *, topk, chunk, bits, beta, clip=False):
    """SparseLoCo's compressor step by step: per worker the top-k of each tile of its buffer,
    quantized over the leaf; per coordinate the mean over the workers that chose it."""
    names = list(grads)
    T, n = grads[names[0]].shape[:2]
    err = [{k: np.zeros(grads[k].shape[2:], F32) for k in names} for _ in range(n)]
    outs = []
    for t in range(T):
        out = {}
        for k in names:
            shape = grads[k].shape[2:]
            r, c = _np_matrix(shape)
            b1, b2 = _np_block(r, chunk), _np_block(c, chunk)
            keep = min(b1 * b2, max(1, round(b1 * b2 * topk / chunk**2)))
            chosen = []  # per worker: (flat positions in the (r, c) matrix, delivered values)
            for i in range(n):
                e = (F32(beta) * err[i][k] + grads[k][t, i]).astype(F32).reshape(r, c)
                pos, vals = [], []
                for a in range(0, r, b1):
                    for b in range(0, c, b2):
                        tile = e[a : a + b1, b : b + b2].ravel()
                        for j in np.argsort(-np.abs(tile), kind="stable")[:keep]:
                            pos.append((a + j // b2) * c + b + j % b2)
                            vals.append(tile[j])
                vals = np.asarray(vals, F32)
                if bits is not None:
                    q, book = np_codes(vals, bits)
                    vals = book[q]
                flat = e.ravel().copy()
                flat[pos] -= vals
                err[i][k] = flat.reshape(shape)
                chosen.append((pos, vals))
            if clip:
                norms = [F32(np.sqrt(np.sum(v * v, dtype=F32))) for _, v in chosen]
                med = sorted(norms)[(n - 1) // 2]
                chosen = [
                    (p, v * (F32(min(1.0, med / nv)) if nv > 0 else F32(1)))
                    for (p, v), nv in zip(chosen, norms)
                ]
            total, count = np.zeros(r * c, F32), np.zeros(r * c)
            for pos, vals in chosen:
                total[pos] += vals
                count[pos] += 1
            out[k] = np.where(count > 0, total / np.maximum(count, 1), 0).astype(F32).reshape(shape)
        outs.append(out)
    return {k: np.stack([o[k] for o in outs]) for k in names}, err


INNER_LR, INNER_MOM = 0.1, 0.5


def np_loco(grads, params, *, H, aggregate, outer, F=1, groups=None):
    """DiLoCo with SGD-momentum inner steps: per-worker params and the anchor after T steps.

    ``aggregate(deltas_of_workers, keys) -> combined``; ``outer(anchor, combined, keys, f)``
    moves the anchor of fragment ``f`` in place.
    """
    names = list(params)
    T, n = grads[names[0]].shape[:2]
    groups = groups or [list(range(f, len(names), F)) for f in range(F)]
    x = [{k: params[k].copy() for k in names} for _ in range(n)]
    mom = [{k: np.zeros_like(params[k]) for k in names} for _ in range(n)]
    anchor = {k: params[k].copy() for k in names}
    for t in range(T):
        for i in range(n):
            for k in names:
                mom[i][k] = grads[k][t, i] + F32(INNER_MOM) * mom[i][k]
                x[i][k] = x[i][k] - F32(INNER_LR) * mom[i][k]
        for f, g in enumerate(groups):
            if t % H != (f + 1) * (H // F) - 1:
                continue
            keys = [names[j] for j in g]
            combined = aggregate([{k: anchor[k] - x[i][k] for k in keys} for i in range(n)], keys)
            outer(anchor, combined, keys, f)
            for i in range(n):
                for k in keys:
                    x[i][k] = anchor[k].copy()
    return x, anchor


def _loco_data(n, T, shapes, seed):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((T, n, *s)).astype(F32) for k, s in shapes.items()}
    params = {k: rng.standard_normal(s).astype(F32) for k, s in shapes.items()}
    return grads, params


def _check_loco(p, state, want_x, want_anchor, n):
    for i in range(n):
        helpers.assert_trees_close({k: np.asarray(v)[i] for k, v in p.items()}, want_x[i], atol=1e-5)
    helpers.assert_replicas_equal(state.anchor)
    helpers.assert_trees_close({k: np.asarray(v)[0] for k, v in state.anchor.items()}, want_anchor, atol=1e-5)


# ----------------------------------------------------------------------------
# Pieces.


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_statistical_codes_match_numpy(bits):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((3, 50)).astype(F32) * np.array([[1.0], [5.0], [0.01]], F32)
    x[0, :5] = 40.0  # outliers are clipped to the end bins
    codes, book = jax.jit(lambda x: sl.statistical_codes(x, bits))(x)
    rep_codes, rep_book = jax.jit(lambda x: sl.statistical_codes(x, bits, replicated=True))(x)
    helpers.assert_trees_equal(rep_codes, codes)
    np.testing.assert_allclose(rep_book, book, rtol=1e-5, atol=1e-6)
    for r in range(3):
        q, b = np_codes(x[r], bits)
        np.testing.assert_array_equal(np.asarray(codes[r]), q)
        np.testing.assert_allclose(np.asarray(book[r]), b, rtol=1e-5, atol=1e-6)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2**bits


def test_statistical_codes_degenerate_rows():
    x = jnp.array([[3.0, 3.0, 3.0], [1.0, 1.0, 1.0]])  # zero spread: scale 1, every value in the middle bin
    quantize = jax.jit(lambda x: sl.statistical_codes(x, 2))
    codes, book = quantize(x)
    np.testing.assert_array_equal(np.asarray(codes), 2)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(book), np.asarray(codes), axis=1), x)
    codes, book = quantize(jnp.array([[5.0]]))  # one value: exact
    assert float(book[0, codes[0, 0]]) == 5.0


@pytest.mark.parametrize("width", [1, 2, 3, 8, 12, 17])
def test_bit_packing_round_trip(width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, 2**width, size=37)

    def round_trip(v):
        packed = sl._pack_bits(v, width)
        return packed, sl._unpack_bits(jnp.stack([packed, packed]), 37, width)

    packed, back = jax.jit(round_trip)(jnp.asarray(values, jnp.int32))
    assert packed.dtype == jnp.uint8 and packed.shape == (sl.packed_bytes(37, width),)
    np.testing.assert_array_equal(np.asarray(back), np.stack([values, values]))


def test_tiles_and_kept_entries():
    assert sl.tile_shape((4096, 4096), 64) == ((4096, 4096), (64, 64))
    assert sl.tile_shape((96, 97), 64) == ((96, 97), (48, 1))
    assert sl.tile_shape((4096,), 64) == ((1, 4096), (1, 64))
    assert sl.tile_shape((3, 3, 4, 8), 64) == ((36, 8), (36, 8))
    assert sl.tile_shape((), 64) == ((1, 1), (1, 1))
    assert sl.kept_per_tile(4096, 64, 64) == 64
    assert sl.kept_per_tile(48 * 48, 64, 64) == 36
    assert sl.kept_per_tile(64, 64, 64) == 1  # a run of a 1-D leaf
    assert sl.kept_per_tile(1, 64, 64) == 1
    assert sl.kept_per_tile(16, 64, 4) == 16  # never more than the tile
    lay = sl._tiling((128, 64), 64, 64)
    assert (lay.tiles, lay.size, lay.k, lay.index_bits) == (2, 4096, 64, 12)
    assert sl._tiling((), 64, 64).index_bits == 0


def test_mean_over_the_workers_that_chose_an_entry():
    lay = sl._tiling((4,), 4, 16)  # one tile of 4, k = 4
    lay = lay._replace(k=2)
    idx = jnp.array([[[0, 1]], [[0, 2]], [[3, 0]]], jnp.int32)  # 3 workers, 1 tile, 2 each
    val = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]], jnp.float32)
    got = jax.jit(lambda i, v: sl._chosen_mean(i, v, lay))(idx, val)
    np.testing.assert_allclose(np.asarray(got), [[(1 + 3 + 6) / 3, 2.0, 4.0, 5.0]], rtol=1e-6)


def test_median_clip_scales_down_only_large_workers():
    v = jnp.array([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [0.0, 0.0]])  # norms 5, 1, 10, 0
    got = np.asarray(jax.jit(sl._median_clip)(v))  # lower median of (0, 1, 5, 10) is 1
    np.testing.assert_allclose(got, [[0.6, 0.8], [0.0, 1.0], [0.6, 0.8], [0.0, 0.0]], rtol=1e-6)


# ----------------------------------------------------------------------------
# statistical_quantize.

SLOW = pytest.mark.slow
STAT_SHAPES = {"w": (6, 10), "k": (2, 3, 4), "s": ()}
STATISTICAL = [  # (backend, n, kwargs)
    pytest.param("vmap", 1, dict(bits=2), marks=SLOW),
    ("vmap", 2, dict(bits=1, requantize_mean=False, row_wise=True)),
    pytest.param("vmap", 8, dict(bits=4, row_wise=True), marks=SLOW),
    pytest.param("shard_map", 2, dict(bits=2, error_decay=0.9), marks=SLOW),
    pytest.param("shard_map", 4, dict(bits=8, row_wise=True, error_decay=0.5), marks=SLOW),
    ("shard_map", 8, dict(bits=2, error_decay=0.9, mask={"w": True, "k": True, "s": False})),
]


@pytest.mark.parametrize("backend,n,kwargs", STATISTICAL)
def test_statistical_quantize_matches_reference(backend, n, kwargs):
    T = 3
    grads = helpers.grads_seq(n, T, n, STAT_SHAPES)
    tx = statistical_quantize(**kwargs)
    updates, _, state = helpers.run_steps(
        tx, grads, helpers.zeros(STAT_SHAPES), backend=backend
    )  # replicated
    mask = kwargs.get("mask", {})
    want, err = np_statistical(
        grads,
        bits=kwargs["bits"],
        beta=kwargs.get("error_decay", 1.0),
        row_wise=kwargs.get("row_wise", False),
        requantize=kwargs.get("requantize_mean", True),
        dense=[k for k, v in mask.items() if not v],
    )
    helpers.assert_trees_close(updates, want, rtol=1e-5, atol=1e-5)
    for k in err[0]:
        np.testing.assert_allclose(
            np.asarray(state.error[k]), np.stack([e[k] for e in err]), rtol=1e-5, atol=1e-5, err_msg=k
        )
    assert all(isinstance(state.error[k], optax.MaskedNode) for k in mask if not mask[k])
    assert int(state.count[0]) == T


def test_statistical_quantize_callable_mask_and_dtypes():
    params = {"w": jnp.ones((4, 6), jnp.bfloat16), "norm": jnp.ones((6,), jnp.bfloat16)}
    tx = statistical_quantize(2, mask=lambda t: jax.tree.map(lambda x: x.ndim >= 2, t))
    state = tx.init(params)
    assert state.error["w"].dtype == jnp.float32 and isinstance(state.error["norm"], optax.MaskedNode)
    g = jax.tree.map(lambda x: jnp.stack([x, 2 * x, 3 * x]), params)
    out = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data"))(g)
    helpers.assert_dtypes_equal(out, g)
    np.testing.assert_array_equal(np.asarray(out["norm"][0], np.float32), 2.0)  # sent dense: the mean


# ----------------------------------------------------------------------------
# chunked_top_k.

CHUNKED = [  # (backend, n, kwargs)
    pytest.param("vmap", 1, dict(bits=2), marks=SLOW),
    pytest.param("vmap", 3, dict(bits=None, error_decay=0.9), marks=SLOW),
    ("vmap", 8, dict(bits=2, clip_to_median_norm=True)),
    ("shard_map", 2, dict(bits=2, error_decay=0.95)),
    pytest.param("shard_map", 4, dict(bits=None, clip_to_median_norm=True), marks=SLOW),
    pytest.param("shard_map", 8, dict(bits=4), marks=SLOW),
]


@pytest.mark.parametrize("backend,n,kwargs", CHUNKED)
def test_chunked_top_k_matches_reference(backend, n, kwargs):
    T, topk, chunk = 3, 6, 4
    grads = helpers.grads_seq(10 + n, T, n, SHAPES)
    tx = chunked_top_k(topk, chunk=chunk, **kwargs)
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros(SHAPES), backend=backend)  # replicated
    want, err = np_chunked(
        grads,
        topk=topk,
        chunk=chunk,
        bits=kwargs.get("bits"),
        beta=kwargs.get("error_decay", 1.0),
        clip=kwargs.get("clip_to_median_norm", False),
    )
    helpers.assert_trees_close(updates, want, rtol=1e-5, atol=1e-5)
    helpers.assert_trees_close(state.error, {k: np.stack([e[k] for e in err]) for k in SHAPES}, atol=1e-5)


def test_chunked_top_k_keeping_everything_is_the_mean():
    shapes = {"w": (4, 6), "b": (5,)}
    grads = helpers.grads_seq(5, 2, 3, shapes)
    tx = chunked_top_k(64, chunk=8)  # k = tile size everywhere
    updates, _, state = helpers.run_steps(tx, grads, helpers.zeros(shapes), backend="vmap")
    for k in shapes:
        np.testing.assert_allclose(np.asarray(updates[k]), grads[k].mean(axis=1), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(state.error[k]), 0.0)


def test_chunked_top_k_in_a_chain_keeps_replicas_bit_identical():
    """A data-parallel compressor before SGD: 12 steps under shard_map, parameters replicated."""
    shapes = {"w": (16, 8), "b": (8,)}
    grads = helpers.grads_seq(7, 12, 4, shapes)
    tx = optax.chain(chunked_top_k(4, chunk=8, bits=2, error_decay=0.95), optax.sgd(0.1, momentum=0.9))
    _, p, state = helpers.scan_steps(tx, grads, helpers.zeros(shapes), backend="shard_map")
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(p))
    err = np.asarray(state[0].error["w"])
    assert not np.array_equal(err[0], err[1])  # the error buffers are per worker


# ----------------------------------------------------------------------------
# sparseloco and MuLoCo through diloco.


def _inner():
    return optax.sgd(INNER_LR, momentum=INNER_MOM)


def _sgd_outer(lr):
    def outer(anchor, combined, keys, f):
        for k in keys:
            anchor[k] = (anchor[k] - F32(lr) * combined[k]).astype(F32)

    return outer


def _chunked_aggregate(topk, chunk, bits, beta, n, names):
    """The reference compressor as a diloco aggregate, with its error buffers kept across syncs."""
    err = [{k: None for k in names} for _ in range(n)]

    def aggregate(deltas, keys):
        out = {}
        for k in keys:
            g = np.stack([d[k] for d in deltas])[None]  # (1, n, ...)
            state = [e[k] if e[k] is not None else np.zeros(g.shape[2:], F32) for e in err]
            # one step of np_chunked from the saved buffers: feed g + beta * e as a fresh buffer
            fed = np.stack([F32(beta) * s for s in state])[None] + g
            want, new_err = np_chunked({k: fed}, topk=topk, chunk=chunk, bits=bits, beta=0.0)
            out[k] = want[k][0]
            for i in range(n):
                err[i][k] = new_err[i][k]
        return out

    return aggregate


LOCO_SHAPES = {"a": (8, 8), "b": (6,), "c": (4, 6), "d": ()}


@pytest.mark.parametrize(
    "backend,n,F,bits",
    [
        pytest.param("vmap", 1, 1, 2, marks=SLOW),
        ("vmap", 3, 2, None),
        ("shard_map", 2, 1, 2),
        pytest.param("shard_map", 4, 2, 2, marks=SLOW),
    ],
)
def test_sparseloco_matches_reference(backend, n, F, bits):
    H, T, topk, chunk, beta, lr = 4, 10, 8, 4, 0.95, 0.8
    grads, params = _loco_data(n, T, LOCO_SHAPES, seed=20 + n)
    tx = sparseloco(
        _inner(),
        sync_every=H,
        topk=topk,
        chunk=chunk,
        bits=bits,
        error_decay=beta,
        outer_lr=lr,
        num_fragments=F,
    )
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    aggregate = _chunked_aggregate(topk, chunk, bits, beta, n, list(LOCO_SHAPES))
    want_x, want_anchor = np_loco(grads, params, H=H, F=F, aggregate=aggregate, outer=_sgd_outer(lr))
    _check_loco(p, state, want_x, want_anchor, n)
    assert all(isinstance(s, ChunkedTopKState) for s in state.aggregate_states)


def _statistical_aggregate(bits, beta, n, names):
    err = [{} for _ in range(n)]

    def aggregate(deltas, keys):
        out = {}
        for k in keys:
            sent = []
            for i in range(n):
                old = err[i].get(k, np.zeros_like(deltas[i][k]))
                e = (F32(beta) * old + deltas[i][k]).astype(F32)
                deq = np_quantize_rows(e, bits, False)
                err[i][k] = (e - deq).astype(F32)
                sent.append(deq)
            out[k] = np_quantize_rows(np_mean(sent), bits, False)
        return out

    return aggregate


def _nesterov_outer(lr, momentum, names):
    buf = {k: None for k in names}

    def outer(anchor, combined, keys, f):
        for k in keys:
            d = combined[k]
            buf[k] = d if buf[k] is None else (F32(momentum) * buf[k] + d).astype(F32)
            anchor[k] = (anchor[k] - F32(lr) * (d + F32(momentum) * buf[k])).astype(F32)

    return outer


@pytest.mark.parametrize("backend,n", [("vmap", 2), pytest.param("shard_map", 4, marks=SLOW)])
def test_muloco_outer_step_matches_reference(backend, n):
    """MuLoCo's outer step: 2-bit statistical quantization (decay 0.9), Nesterov SGD 0.8 / 0.9."""
    H, T = 3, 9
    grads, params = _loco_data(n, T, LOCO_SHAPES, seed=30 + n)
    tx = jd.diloco(
        _inner(),
        sync_every=H,
        outer=optax.sgd(0.8, momentum=0.9, nesterov=True),
        aggregate=statistical_quantize(2, error_decay=0.9),
    )
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    names = list(LOCO_SHAPES)
    want_x, want_anchor = np_loco(
        grads,
        params,
        H=H,
        aggregate=_statistical_aggregate(2, 0.9, n, names),
        outer=_nesterov_outer(0.8, 0.9, names),
    )
    _check_loco(p, state, want_x, want_anchor, n)


def test_muloco_with_muon_inside_runs():
    """optax.contrib.muon as the inner optimizer on a 2-D leaf (and Adam on the vector), norms sent dense."""
    n, H, T = 2, 2, 6
    shapes = {"w": (8, 4), "norm": (4,)}
    grads, params = _loco_data(n, T, shapes, seed=40)
    tx = jd.diloco(
        optax.contrib.muon(0.02236, beta=0.9),
        sync_every=H,
        outer=optax.sgd(0.8, momentum=0.9, nesterov=True),
        aggregate=statistical_quantize(2, error_decay=0.9, mask=lambda leaves: [x.ndim >= 2 for x in leaves]),
    )
    _, p, state = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    helpers.assert_replicas_equal(state.anchor)
    anchor = {k: np.asarray(v)[0] for k, v in state.anchor.items()}
    assert not np.allclose(anchor["w"], params["w"])
    for k in shapes:  # T % H == 0: every worker sits on the new anchor
        np.testing.assert_allclose(np.asarray(p[k]), np.broadcast_to(anchor[k], p[k].shape), atol=1e-6)
    agg = state.aggregate_states[0]
    assert isinstance(agg, StatisticalQuantizeState) and isinstance(
        agg.error[0], optax.MaskedNode
    )  # leaves: norm, w


# ----------------------------------------------------------------------------
# Wire bytes.


@pytest.mark.parametrize("n", [2, 8])
def test_communication_cost_counts_packed_bytes(n):
    params = {"w": jnp.zeros((128, 64)), "b": jnp.zeros(4096), "s": jnp.zeros(())}
    cost = jd.communication_cost(chunked_top_k(64, bits=2), params, num_workers=n)
    # w: two 64x64 tiles, 64 each: 12-bit indices and 2-bit codes, 112 bytes a tile;
    # b: 64 runs of 64, 1 each, 6-bit indices; s: one entry, no index. A 16-byte codebook per leaf.
    tile = 64 * 12 // 8 + 64 * 2 // 8
    assert tile == 112 and 64 * 64 * 4 / tile == pytest.approx(146.3, abs=0.05)
    payload = (2 * tile + 16) + (64 * 6 // 8 + 64 * 2 // 8 + 16) + (1 + 16)
    assert [c.kind for c in cost.steps[0].collectives] == ["all_gather"]
    assert cost.sent_bytes == (n - 1) * payload
    dense = jd.communication_cost(chunked_top_k(64), params, num_workers=n)  # float32 values
    assert dense.sent_bytes == (n - 1) * ((2 * 96 + 2 * 64 * 4) + (48 + 64 * 4) + 4)


@pytest.mark.parametrize("n", [2, 4])
def test_statistical_quantize_cost(n):
    params = {"w": jnp.zeros((64, 32)), "norm": jnp.zeros(32)}
    cost = jd.communication_cost(statistical_quantize(2), params, num_workers=n)
    assert cost.sent_bytes == (n - 1) * ((64 * 32 + 32) * 2 // 8 + 2 * 16)
    rows = jd.communication_cost(statistical_quantize(4, row_wise=True), params, num_workers=n)
    assert rows.sent_bytes == (n - 1) * (64 * 32 // 2 + 64 * 64 + 16 + 64)
    masked = statistical_quantize(2, mask={"w": True, "norm": False})
    cost = jd.communication_cost(masked, params, num_workers=n)
    assert sorted(c.kind for c in cost.steps[0].collectives) == ["all_gather", "all_reduce"]
    assert cost.sent_bytes == pytest.approx((n - 1) * (64 * 32 // 4 + 16) + 2 * (n - 1) / n * 32 * 4)


def test_sparseloco_cost_per_period():
    params = {"w": jnp.zeros((128, 128)), "b": jnp.zeros(128)}
    H, n = 8, 4
    cost = jd.communication_cost(sparseloco(optax.adamw(1e-3), sync_every=H), params, num_workers=n)
    payload = 4 * 112 + 16 + (2 + 1 + 16)  # b: 2 runs of 64 keep 1 each: 12 index bits, 4 code bits
    assert cost.peak_sent_bytes == (n - 1) * payload
    assert cost.sent_bytes == pytest.approx((n - 1) * payload / H)


# ----------------------------------------------------------------------------
# Checkpoints and elastic resume.


@pytest.mark.parametrize(
    "family",
    [
        ckpt.Family(
            lambda: optax.chain(chunked_top_k(4, chunk=4, bits=2, error_decay=0.95), ckpt._sgd()), True
        ),
        pytest.param(
            ckpt.Family(
                lambda: optax.chain(
                    statistical_quantize(2, mask={"w1": True, "b1": False, "w2": True}), ckpt._sgd()
                ),
                True,
            ),
            marks=SLOW,
        ),
    ],
    ids=["chunked_top_k", "statistical_quantize"],
)
def test_checkpoint_resume_is_bit_identical(family, tmp_path, monkeypatch):
    monkeypatch.setitem(ckpt.FAMILIES, "frontier", family)
    ckpt.test_resume_from_checkpoint_is_bit_identical("frontier", tmp_path)


@pytest.mark.slow
def test_sparseloco_data_parallel_step_and_bit_exact_resume(tmp_path):
    mesh = helpers.make_mesh(ckpt.N_WORKERS)

    def make():
        tx = sparseloco(optax.adamw(1e-2), sync_every=4, topk=4, chunk=4, num_fragments=2, sync_delay=1)
        return jd.data_parallel_step(ckpt._loss, tx, mesh=mesh, per_worker_params=True)

    step = make()
    p0 = ckpt._params0()
    params, opt_state = step.init(p0)
    params, opt_state, _ = ckpt._run(step, params, opt_state, 0, 5)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(5, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        mngr.wait_until_finished()
    params, opt_state, losses = ckpt._run(step, params, opt_state, 5, 11)
    fresh = make()
    abstract = dict(zip(("params", "opt_state"), fresh.abstract_init(p0)))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(5, args=ocp.args.StandardRestore(abstract))
    params2, opt_state2, losses2 = ckpt._run(fresh, restored["params"], restored["opt_state"], 5, 11)
    assert losses2 == losses
    helpers.assert_trees_equal(params2, params)
    helpers.assert_trees_equal(opt_state2, opt_state)
    errors = [s.error for s in opt_state.aggregate_states]
    assert all(x.sharding.spec[0] == "data" for x in jax.tree.leaves(errors))


def _stacked_state(tx, params, n, per_worker_params=False):
    """``tx``'s state after two steps on ``n`` workers: per-worker leaves stacked, the rest once."""
    grads = helpers.grads_seq(3, 2, n, {k: np.shape(v) for k, v in params.items()})
    _, _, state = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=per_worker_params)
    mesh = helpers.make_mesh(2)
    mask = jd.opt_state_placement(tx, params, mesh=mesh, per_worker_params=per_worker_params).per_worker
    return jax.tree.map(lambda x, m: np.asarray(x) if m else np.asarray(x)[0], state, mask), mask


RESHARD = {
    "chunked_top_k": (
        lambda: optax.chain(chunked_top_k(2, chunk=2, bits=2), optax.sgd(0.1, momentum=0.9)),
        False,
    ),
    "statistical_quantize": (
        lambda: optax.chain(statistical_quantize(2, mask={"w": True, "b": False}), optax.sgd(0.1)),
        False,
    ),
    "sparseloco": (lambda: sparseloco(_inner(), sync_every=2, topk=2, chunk=2), True),
}


@pytest.mark.parametrize("name", [pytest.param(k, marks=SLOW) if k == "sparseloco" else k for k in RESHARD])
def test_reshard_keeps_the_mean_error(name):
    make, per_worker_params = RESHARD[name]
    tx = make()
    params = {"w": np.zeros((4, 3), F32), "b": np.zeros((3,), F32)}
    state, mask = _stacked_state(tx, params, 8, per_worker_params)
    for m in (4, 6):
        out = jd.reshard_opt_state(state, tx, params, num_workers=m, per_worker_params=per_worker_params)
        assert jax.tree.structure(out) == jax.tree.structure(state)
        for before, after, per in zip(jax.tree.leaves(state), jax.tree.leaves(out), jax.tree.leaves(mask)):
            if per:
                assert after.shape == (m, *before.shape[1:])
                np.testing.assert_allclose(after.mean(0), before.mean(0), atol=1e-6)
            else:
                np.testing.assert_array_equal(after, before)


# ----------------------------------------------------------------------------
# Errors and the optax contract.


@pytest.mark.parametrize(
    ("factory", "kwargs", "exc", "match"),
    [
        (statistical_quantize, dict(bits=3), ValueError, "bits"),
        (statistical_quantize, dict(bits=True), ValueError, "bits"),
        (statistical_quantize, dict(error_decay=1.5), ValueError, "error_decay"),
        (statistical_quantize, dict(row_wise=1), TypeError, "row_wise"),
        (statistical_quantize, dict(requantize_mean="yes"), TypeError, "requantize_mean"),
        (statistical_quantize, dict(quantization_range=0.0), ValueError, "quantization_range"),
        (statistical_quantize, dict(mask="w"), TypeError, "mask"),
        (statistical_quantize, dict(axis_name=["data"]), TypeError, "axis_name"),
        (chunked_top_k, dict(topk=0), ValueError, "topk"),
        (chunked_top_k, dict(topk=2.5), TypeError, "topk"),
        (chunked_top_k, dict(chunk=0), ValueError, "chunk"),
        (chunked_top_k, dict(bits=3), ValueError, "bits"),
        (chunked_top_k, dict(error_decay=-0.1), ValueError, "error_decay"),
        (chunked_top_k, dict(clip_to_median_norm=None), TypeError, "clip_to_median_norm"),
        (chunked_top_k, dict(axis_name=None), ValueError, "axis_name"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


def test_sparseloco_bad_arguments():
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="outer_lr"):
        sparseloco(inner, sync_every=2, outer_lr=-1.0)
    with pytest.raises(ValueError, match="bits"):
        sparseloco(inner, sync_every=2, bits=3)
    with pytest.raises(ValueError, match="sync_delay"):
        sparseloco(inner, sync_every=4, num_fragments=2, sync_delay=2)
    with pytest.raises(TypeError, match="sync_every"):
        sparseloco(inner, sync_every=2.0)


def test_mask_that_does_not_fit_and_unbound_axis():
    tx = statistical_quantize(2, mask={"a": True})
    with pytest.raises(ValueError, match="mask"):
        tx.init({"w": jnp.zeros(3)})
    with pytest.raises(TypeError, match="mask"):
        statistical_quantize(2, mask={"w": 1})
    tx = statistical_quantize(2, mask=lambda t: {"w": 1})
    with pytest.raises(TypeError, match="mask"):
        tx.init({"w": jnp.zeros(3)})
    for tx, name in ((statistical_quantize(), "statistical_quantize"), (chunked_top_k(), "chunked_top_k")):
        g = jnp.ones(4)
        with pytest.raises(jd.UnboundAxisError, match=name):
            tx.update(g, tx.init(g))


def test_already_summed_updates_are_rejected():
    mesh = helpers.make_mesh(2)
    tx = chunked_top_k(2, chunk=2)
    f = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0],
        mesh=mesh,
        in_specs=helpers.P(),
        out_specs=helpers.P(),
        check_vma=True,
    )
    with pytest.raises(jd.AlreadyReducedError, match="chunked_top_k"):
        f(jnp.ones(4))


CONTRACT = {
    "statistical_quantize": lambda: statistical_quantize(
        2, row_wise=True, error_decay=optax.linear_schedule(1.0, 0.5, 4)
    ),
    "chunked_top_k": lambda: chunked_top_k(3, chunk=4, bits=2, error_decay=0.9, clip_to_median_norm=True),
}


@pytest.mark.parametrize("name", list(CONTRACT))
def test_optax_contract(name):
    """No recompilation, unknown extra args, abstract init, bf16 dtypes stable through a chain."""
    params = {"w": jnp.ones((4, 8), jnp.bfloat16), "b": jnp.zeros((8,), jnp.bfloat16)}
    tx = optax.chain(CONTRACT[name](), optax.sgd(0.1))
    s, p = helpers.check_bf16_contract(tx, params, steps=4, replicated=True)


def test_inject_hyperparams():
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 8)), jnp.float32)

    def run(tx):
        def steps(g):
            s = tx.init(g)
            u, s = tx.update(g, s)
            u, s = tx.update(g, s)
            return u

        return jax.jit(jax.vmap(steps, axis_name="data"))(g)

    injected = optax.inject_hyperparams(chunked_top_k, static_args=("topk", "chunk", "bits"))(
        topk=3, chunk=4, bits=2, error_decay=0.9
    )
    helpers.assert_trees_equal(run(injected), run(chunked_top_k(3, chunk=4, bits=2, error_decay=0.9)))
    injected = optax.inject_hyperparams(statistical_quantize, static_args=("bits",))(bits=2, error_decay=0.9)
    helpers.assert_trees_equal(run(injected), run(statistical_quantize(2, error_decay=0.9)))
    static = ("sync_every", "topk", "chunk", "bits", "num_fragments", "sync_delay")
    injected = optax.inject_hyperparams(sparseloco, static_args=static)(
        _inner(), sync_every=1, topk=3, chunk=4, outer_lr=0.5
    )
    want = sparseloco(_inner(), sync_every=1, topk=3, chunk=4, outer_lr=0.5)
    p = jnp.zeros((2, 4, 8))
    one = lambda tx: jax.jit(jax.vmap(lambda g, p: tx.update(g, tx.init(p), p)[0], axis_name="data"))(g, p)  # noqa: E731
    helpers.assert_trees_equal(one(injected), one(want))


# ----------------------------------------------------------------------------
# Sharded parameters.


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chunked_top_k", "statistical_quantize", "sparseloco"])
def test_sharded_model_matches_the_replicated_run(name):
    """A 2 data x 4 fsdp mesh (parameters sharded over 'fsdp') gives the 2-worker run's parameters.

    The (16, 3) leaf sharded by rows is a case where XLA's SPMD partitioner aborts on the
    packed 2-bit codes unless the selection is held whole on the model axes.
    """
    make, per_worker = {
        "chunked_top_k": (lambda: optax.chain(chunked_top_k(4, chunk=4, bits=2), optax.sgd(0.05)), False),
        "statistical_quantize": (
            lambda: optax.chain(statistical_quantize(2, row_wise=True), optax.sgd(0.05)),
            False,
        ),
        "sparseloco": (lambda: sparseloco(optax.adamw(1e-2), sync_every=2, topk=4, chunk=4), True),
    }[name]
    p0 = ckpt._params0()
    batches = [{k: v[:8] for k, v in ckpt._batch(t).items()} for t in range(4)]
    runs = []
    for mesh, specs in (
        (helpers.make_mesh(2), None),
        (
            jax.make_mesh((2, 4), ("data", "fsdp")),
            {"w1": helpers.P(None, "fsdp"), "b1": helpers.P("fsdp"), "w2": helpers.P("fsdp", None)},
        ),
    ):
        step = jd.data_parallel_step(
            ckpt._loss, make(), mesh=mesh, per_worker_params=per_worker, param_specs=specs
        )
        params, opt_state = step.init(p0)
        for b in batches:
            params, opt_state, _ = step(params, opt_state, b)
        runs.append(params)
    helpers.assert_trees_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)
