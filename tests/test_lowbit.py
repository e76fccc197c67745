"""low_bit: the 4-bit (E3M0) two-stage quantized all-reduce, against a NumPy loop over workers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

SHAPES = {"a": (5, 3), "b": (7,)}


def np_quantize(x: np.ndarray, grid: np.ndarray, block: int) -> np.ndarray:
    """Round each entry of a 1-D chunk to the nearest grid point times its block's max magnitude."""
    out = np.zeros_like(x)
    for s in range(0, x.size, block):
        seg = x[s : s + block]
        scale = np.float32(np.max(np.abs(seg)))
        if scale == 0:
            continue
        y = np.abs(seg) / scale
        # Ties go down (the transform uses searchsorted on the midpoints, side="left").
        mids = (grid[1:] + grid[:-1]) / 2
        idx = np.searchsorted(mids, y, side="left")
        out[s : s + block] = np.where(seg < 0, -1, 1) * grid[idx] * scale
    return out.astype(np.float32)


def np_low_bit(xs: list[np.ndarray], grid: np.ndarray, block: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(output, per-worker first-stage messages) for flat float32 vectors, one per worker."""
    n, total = len(xs), xs[0].size
    chunk = max(8, math.ceil(math.ceil(total / n) / 8) * 8)
    padded = [np.pad(x, (0, n * chunk - total)) for x in xs]
    sent = [
        np.concatenate([np_quantize(p[j * chunk : (j + 1) * chunk], grid, block) for j in range(n)])
        for p in padded
    ]
    out = np.zeros(n * chunk, np.float32)
    for j in range(n):
        acc = np.zeros(chunk, np.float32)
        for i in range(n):  # worker order
            acc = acc + sent[i][j * chunk : (j + 1) * chunk]
        out[j * chunk : (j + 1) * chunk] = np_quantize(acc / np.float32(n), grid, block)
    return out[:total], [s[:total] for s in sent]


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


CASES = [  # (backend, workers, (exponent bits, mantissa bits, block size))
    ("vmap", 1, (2, 1, 8)),
    ("vmap", 3, (3, 0, 4)),
    ("shard_map", 2, (3, 0, 4)),
    ("shard_map", 4, (3, 0, 4)),
    ("vmap", 2, (4, 3, 16)),
]


@pytest.mark.parametrize("backend,n,fmt", CASES)
def test_matches_numpy_reference_with_residual(backend, n, fmt):
    e_bits, m_bits, block = fmt
    rng = np.random.default_rng(n)
    steps = 3
    grads = {k: rng.standard_normal((steps, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    tx = jd.low_bit(e_bits, m_bits, block_size=block)
    updates, _, state = helpers.run_steps(tx, grads, params, backend=backend)
    grid = jd.float_grid(e_bits, m_bits)
    residual = [np.zeros(_flat(params).size, np.float32) for _ in range(n)]
    for t in range(steps):
        xs = [_flat({k: grads[k][t, i] for k in SHAPES}) + residual[i] for i in range(n)]
        want, sent = np_low_bit(xs, grid, block)
        residual = [x - s for x, s in zip(xs, sent)]
        np.testing.assert_allclose(_flat({k: updates[k][t] for k in SHAPES}), want, rtol=1e-5, atol=1e-6)
    for i in range(n):
        got = _flat({k: np.asarray(state.residual[k])[i] for k in SHAPES})
        np.testing.assert_allclose(got, residual[i], rtol=1e-5, atol=1e-5)


def test_e3m0_grid_and_exact_values():
    np.testing.assert_array_equal(jd.float_grid(3, 0), [0] + [2.0**-k for k in range(6, -1, -1)])
    # Powers of two times the block scale travel exactly; one worker gives them back.
    x = jnp.asarray([[4.0, -2.0, 1.0, 0.5, 0.0, -0.25, 0.125, 0.0625]])
    out = helpers.run_transform(jd.low_bit(), x, backend="vmap")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x[0]))


@pytest.mark.parametrize("n", [2, 8])
def test_wire_bytes_are_bit_packed(n):
    d = 1000
    cost = jd.communication_cost(jd.low_bit(block_size=64), {"w": jnp.zeros(d)}, num_workers=n)
    chunk = math.ceil(math.ceil(d / n) / 8) * 8
    message = chunk // 2 + 4 * math.ceil(chunk / 64)  # 4-bit codes + float32 scales
    kinds = cost.by_kind()
    assert set(kinds) == {"all_to_all", "all_gather"}
    assert kinds["all_to_all"].payload_bytes == n * message
    assert kinds["all_gather"].payload_bytes == message
    assert cost.sent_bytes == pytest.approx(2 * (n - 1) * message)
    eight_bit = jd.communication_cost(jd.low_bit(4, 3, block_size=64), {"w": jnp.zeros(d)}, num_workers=n)
    assert eight_bit.sent_bytes == pytest.approx(2 * (n - 1) * (chunk + 4 * math.ceil(chunk / 64)))


def test_replicated_after_many_steps_under_shard_map():
    rng = np.random.default_rng(0)
    grads = {"w": rng.standard_normal((6, 4, 33)).astype(np.float32)}
    # out_specs=P() in run_steps proves the updates and params replicated.
    _, params, _ = helpers.run_steps(
        jd.low_bit(), grads, {"w": np.zeros(33, np.float32)}, backend="shard_map"
    )
    assert np.all(np.isfinite(np.asarray(params["w"])))


def test_bad_arguments():
    with pytest.raises(ValueError, match="2, 4 or 8 bits"):
        jd.low_bit(3, 1)
    with pytest.raises(ValueError, match="exponent_bits"):
        jd.low_bit(0, 3)
    with pytest.raises(TypeError, match="block_size"):
        jd.low_bit(block_size=2.5)
    with pytest.raises(TypeError, match="error_feedback"):
        jd.low_bit(error_feedback=1)
    with pytest.raises(jd.UnboundAxisError, match="low_bit"):
        tx = jd.low_bit()
        tx.update(jnp.ones(4), tx.init(jnp.ones(4)))


def test_chain_and_no_residual():
    tx = optax.chain(jd.low_bit(error_feedback=False), optax.sgd(0.1))
    g = jnp.asarray(np.random.default_rng(1).standard_normal((2, 16)), jnp.float32)
    out = helpers.run_transform(tx, g, backend="vmap")
    assert out.shape == (16,) and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_all_to_all_exchanges_row_i_of_worker_j(backend):
    from jaxopt_dist._src import comm

    n = 4
    x = jnp.asarray(
        10 * np.arange(n)[:, None, None] + np.arange(n)[None, :, None] + np.zeros((n, n, 3)), jnp.float32
    )
    got = helpers.run_on_workers(lambda v: comm.all_to_all(v, "data"), x, backend=backend, replicated=False)
    np.testing.assert_array_equal(np.asarray(got), np.swapaxes(np.asarray(x), 0, 1))
