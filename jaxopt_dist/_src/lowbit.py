r"""Low-bit floating-point all-reduce: 4-bit (E3M0 by default) codes with block scales.

Streaming DiLoCo sends its outer gradients as 4-bit floats with three
exponent bits and no mantissa (E3M0). :func:`low_bit` is that compressor for
any transform of this library: every entry travels as ``1 + E + M`` bits (a
sign, ``E`` exponent and ``M`` mantissa bits), bit-packed, with one float32
scale per block of entries.

The reduction is a quantized all-reduce in two stages, the structure of
torchft's quantized all-reduce (which, unlike this one, falls back to an
exact all-reduce where its kernels are unavailable):

1. each worker quantizes its (flattened, zero-padded) vector, cut into ``n``
   chunks, and sends chunk ``j`` to worker ``j`` (one all-to-all);
2. worker ``j`` decodes the ``n`` messages for its chunk, averages them in
   worker order, quantizes the mean again and all-gathers it; every worker
   decodes the same bytes, so the output is bit-identical everywhere.

The magnitude grid of an ``E``-exponent, ``M``-mantissa format is, with
``b = 2^E - 1``: zero and the subnormals ``2^{1-b} m / 2^M`` (exponent field
0), and ``2^{e-b} (1 + m / 2^M)`` for the exponent fields ``e = 1..b``;
there is no infinity or NaN. The grid is divided by its largest value, so
that a block's scale (its largest magnitude) maps to 1. E3M0 is
``{0} U {2^-6, ..., 2^-1, 1}``. Values round to the nearest grid point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import error_feedback as ef

_BITS = (2, 4, 8)


def float_grid(exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """The magnitudes of a sign + ``E`` exponent + ``M`` mantissa format, scaled to max 1.

    Returns a float32 array of ``2^(E + M)`` increasing values starting at 0;
    a magnitude code is an index into it.
    """
    e_bits, m_bits = int(exponent_bits), int(mantissa_bits)
    bias = 2**e_bits - 1
    values = []
    for e in range(2**e_bits):
        for m in range(2**m_bits):
            frac = m / 2**m_bits
            values.append(2.0 ** (1 - bias) * frac if e == 0 else 2.0 ** (e - bias) * (1 + frac))
    grid = np.asarray(values, np.float64)
    return (grid / grid.max()).astype(np.float32)


def _layout(total: int, n: int, block_size: int) -> tuple[int, int]:
    """(chunk length, blocks per chunk): ``n`` chunks, each a multiple of 8 entries."""
    per_worker = -(-total // n)
    chunk = max(8, -(-per_worker // 8) * 8)
    return chunk, -(-chunk // block_size)


def _block_scales(x: jax.Array, block_size: int, blocks: int) -> jax.Array:
    """Largest magnitude of each block of ``x`` (``(rows, chunk)`` -> ``(rows, blocks)``)."""
    rows, chunk = x.shape
    pad = blocks * block_size - chunk
    mag = jnp.pad(jnp.abs(x), ((0, 0), (0, pad))).reshape(rows, blocks, block_size)
    return jnp.max(mag, axis=-1)


def _per_entry(scales: jax.Array, chunk: int, block_size: int) -> jax.Array:
    """Block scales ``(rows, blocks)`` repeated over their entries: ``(rows, chunk)``."""
    rows, blocks = scales.shape
    full = jnp.broadcast_to(scales[:, :, None], (rows, blocks, block_size)).reshape(rows, -1)
    return full[:, :chunk]


def _encode(x: jax.Array, grid: np.ndarray, bits: int, block_size: int, blocks: int) -> jax.Array:
    """Rows of float32 ``x`` -> uint8 messages: packed codes, then float32 scales as bytes."""
    rows, chunk = x.shape
    scales = _block_scales(x, block_size, blocks)
    safe = jnp.where(scales > 0, scales, jnp.float32(1))
    y = jnp.abs(x) / _per_entry(safe, chunk, block_size)
    mids = jnp.asarray((grid[1:] + grid[:-1]) / 2)
    # How many midpoints lie below each entry (searchsorted, side="left"), as a sum of
    # comparisons: the grid is small, and jnp.searchsorted fails inside a shard_map that
    # leaves model axes to the compiler.
    mag = jnp.sum(mids.reshape((1,) * y.ndim + (-1,)) < y[..., None], axis=-1, dtype=jnp.uint8)
    codes = mag | ((x < 0).astype(jnp.uint8) << (bits - 1))
    per_byte = 8 // bits
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)[None, None, :]
    packed = jnp.sum(codes.reshape(rows, chunk // per_byte, per_byte) << shifts, axis=-1, dtype=jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8).reshape(rows, -1)
    return jnp.concatenate([packed, scale_bytes], axis=1)


def _decode(
    msg: jax.Array, grid: np.ndarray, bits: int, chunk: int, block_size: int, blocks: int
) -> jax.Array:
    """Inverse of :func:`_encode`: uint8 messages ``(rows, bytes)`` -> float32 ``(rows, chunk)``."""
    rows = msg.shape[0]
    per_byte = 8 // bits
    n_packed = chunk // per_byte
    packed, scale_bytes = msg[:, :n_packed], msg[:, n_packed:]
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)[None, None, :]
    codes = ((packed[:, :, None] >> shifts) & jnp.uint8(2**bits - 1)).reshape(rows, chunk)
    mag = jnp.asarray(grid)[(codes & jnp.uint8(2 ** (bits - 1) - 1)).astype(jnp.int32)]
    sign = jnp.where((codes >> (bits - 1)) == 1, jnp.float32(-1), jnp.float32(1))
    scales = jax.lax.bitcast_convert_type(scale_bytes.reshape(rows, blocks, 4), jnp.float32)
    return sign * mag * _per_entry(scales, chunk, block_size)


def _low_bit_compressor(
    grid: np.ndarray, bits: int, block_size: int, axis_name: base.AxisName
) -> ef.Compressor:
    def compress(leaves, treedef, n):
        x, total, chunk, blocks = _chunks(leaves, n, block_size)
        mine = _encode(x, grid, bits, block_size, blocks)
        received = comm.all_to_all(mine, axis_name, caller="low_bit")
        decoded = _decode(received, grid, bits, chunk, block_size, blocks)
        mean = jax.lax.fori_loop(1, n, lambda w, acc: acc + decoded[w], decoded[0]) / jnp.float32(n)
        (gathered,) = comm.all_gather_packed(
            [_encode(mean[None], grid, bits, block_size, blocks)[0]], axis_name, caller="low_bit"
        )
        out = _decode(gathered, grid, bits, chunk, block_size, blocks).reshape(-1)[:total]
        sent = _decode(mine, grid, bits, chunk, block_size, blocks).reshape(-1)[:total]
        return base.split_flat(out, leaves, treedef), base.split_flat(sent, leaves, treedef)

    return ef.stateless_compressor(compress, axis_name=axis_name, name="low_bit")


def low_bit(
    exponent_bits: int = 3,
    mantissa_bits: int = 0,
    *,
    block_size: int = 4096,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    error_feedback: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Mean over workers in a low-bit float format (4-bit E3M0 by default), bit-packed.

    Each entry is sent as ``1 + exponent_bits + mantissa_bits`` bits (2, 4 or
    8 in all), with a float32 scale (the largest magnitude) per block of
    ``block_size`` entries; see the module documentation for the grid and the
    two-stage reduction. With ``error_feedback`` each worker keeps what its
    own first-stage message left out and adds it to its next input; the
    re-quantization of the mean (second stage) is not fed back.

    .. math::
      u = Q\Big(\frac{1}{n} \sum_{i=1}^n Q(x_i)\Big), \qquad
      x_i = g_i + e_i, \quad e_i \leftarrow x_i - Q(x_i).

    Args:
      exponent_bits: ``E`` (>= 1).
      mantissa_bits: ``M`` (>= 0); ``1 + E + M`` must be 2, 4 or 8
        (E3M0 and E2M1 are 4-bit, E4M3 and E5M2 8-bit).
      block_size: entries per scale (>= 1). Blocks are cut within each
        worker's chunk of ``ceil(D / n)`` entries (rounded up to a multiple of 8).
      axis_name: the mapped axis (or tuple of axes) of the workers.
      error_feedback: keep the first-stage compression error in a per-worker
        residual.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`jaxopt_dist.ErrorFeedbackState`.

    Communication:
      With ``D`` entries over all leaves, ``c = ceil(D / n)`` rounded up to a
      multiple of 8 and ``s = ceil(c / block_size)`` scales per chunk, a
      message for one chunk is ``m = c bits / 8 + 4 s`` bytes. One
      all-to-all of ``n m`` bytes (each worker sends ``(n - 1) m``) and one
      all-gather of ``m`` bytes (each worker sends ``(n - 1) m``): in all
      ``2 (n - 1) m`` bytes, about ``32 / bits`` times less than a float32 ring
      all-reduce (``2 (n - 1) / n * 4 D``). Outputs are replicated; the
      residual is per-worker; ``count`` is replicated. Nothing ever falls
      back to an exact reduction.

    Sharded parameters:
      Needs whole leaves: all leaves are flattened into one vector, cut into
      one chunk per worker and into blocks that share a scale, so the compiler
      moves entries over the model axes into that layout and back. The
      all-to-all and all-gather above run over the data axis, per replica; the
      output is that of replicated parameters.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.low_bit()                                # 4-bit E3M0
      >>> g = jnp.array([[1.0, -0.5, 0.25, 0.1]] * 2)      # two workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(g)[0]
      Array([ 1.   , -0.5  ,  0.25 ,  0.125], dtype=float32)

    References:
      Douillard et al, `Streaming DiLoCo with overlapping communication
      <https://arxiv.org/abs/2501.18512>`_, 2025
    """
    axis_name = base.validate_axis_name(axis_name)
    e_bits = base.check_positive_int(exponent_bits, "exponent_bits")
    m_bits = base.check_positive_int(mantissa_bits, "mantissa_bits", minimum=0)
    bits = 1 + e_bits + m_bits
    if bits not in _BITS:
        raise ValueError(
            f"`exponent_bits` + `mantissa_bits` + 1 (the sign) must be 2, 4 or 8 bits; got "
            f"exponent_bits={exponent_bits}, mantissa_bits={mantissa_bits} ({bits} bits)."
        )
    block_size = base.check_positive_int(block_size, "block_size")
    base.check_bool(error_feedback, "error_feedback")
    grid = float_grid(e_bits, m_bits)
    tx = ef.error_feedback(_low_bit_compressor(grid, bits, block_size, axis_name), enabled=error_feedback)
    base.declare_wire(tx, ef.codec_wire(_one_worker_codec(grid, bits, block_size), enabled=error_feedback))
    # For a mean taken elsewhere (islands): on one worker the second stage re-quantizes the worker's
    # own decoded message, which gives it back unchanged (each block's largest magnitude is its
    # scale), so the first stage is the transform itself; the second re-quantizes the mean in one
    # worker's layout (blocks cut over the whole vector).
    return base.declare_two_stage(
        tx, tx, lambda leaves, state: _requantize_whole(leaves, grid, bits, block_size)
    )


def _one_worker_codec(grid: np.ndarray, bits: int, block_size: int) -> ef.Codec:
    """The message of one worker alone (its vector as one chunk): packed codes, then block scales.

    What a worker sends where the mean is taken elsewhere (islands): decoded, it is the
    transform's output on a workers' axis of size 1.
    """

    def encode(updates, state):
        leaves, treedef = jax.tree.flatten(updates)
        if not leaves:
            return [], updates, state
        x, total, chunk, blocks = _chunks(leaves, 1, block_size)
        message = _encode(x, grid, bits, block_size, blocks)
        sent = _decode(message, grid, bits, chunk, block_size, blocks).reshape(-1)[:total]
        return [message[0]], base.split_flat(sent, leaves, treedef), state

    def decode(message, like, state):
        del state
        leaves, treedef = jax.tree.flatten(like)
        if not leaves:
            return like
        total = sum(base.leaf_sizes(leaves))
        chunk, blocks = _layout(total, 1, block_size)
        out = _decode(message[0][None], grid, bits, chunk, block_size, blocks).reshape(-1)[:total]
        return base.split_flat(out, leaves, treedef)

    return ef.Codec(encode, decode)


def _requantize_whole(
    leaves: list[jax.Array], grid: np.ndarray, bits: int, block_size: int
) -> list[jax.Array]:
    """The second stage on a mean every worker holds, in one worker's layout (one chunk)."""
    if not leaves:
        return leaves
    row, total, chunk, blocks = _chunks(leaves, 1, block_size)
    out = _decode(_encode(row, grid, bits, block_size, blocks), grid, bits, chunk, block_size, blocks)
    return base.split_flat(out.reshape(-1)[:total], leaves, jax.tree.structure(leaves))


def _chunks(leaves: list[jax.Array], n: int, block_size: int) -> tuple[jax.Array, int, int, int]:
    """The leaves as one float32 vector cut into ``n`` zero-padded chunks: ``(x (n, chunk), total,
    chunk, blocks per chunk)``."""
    total = sum(base.leaf_sizes(leaves))
    chunk, blocks = _layout(total, n, block_size)
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
    return jnp.pad(flat, (0, n * chunk - total)).reshape(n, chunk), total, chunk, blocks
