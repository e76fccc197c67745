r"""SparseLoCo and MuLoCo's quantized outer step: codebook quantization, chunked top-k.

Three pieces, for the outer step of :func:`jaxopt_dist.diloco` (its
``aggregate=``) or for plain data-parallel gradients (``optax.chain(...,
optax.sgd(...))``):

* :func:`statistical_quantize`: MuLoCo's compressor. Every leaf (or every
  row) is quantized to 1, 2, 4 or 8 bits with a *statistical codebook*,
  error feedback with decay keeps what was not sent, the packed codes and
  codebooks are all-gathered and every worker takes the plain mean.
* :func:`chunked_top_k`: SparseLoCo's compressor. Each leaf is cut into
  tiles as DeMo cuts it (without the DCT); each worker keeps the largest
  magnitudes of every tile of its error-feedback buffer, optionally
  quantized to 2 bits with the same codebook; indices and codes travel
  bit-packed; each coordinate is the mean over the workers that chose it.
* :func:`sparseloco`: :func:`jaxopt_dist.diloco` with plain outer SGD and
  :func:`chunked_top_k` as its aggregate.

The statistical quantizer, for a vector :math:`v` of :math:`m` values and
``B = 2^bits`` bins (a *row*: a whole leaf, a leaf's row, or the values a
worker selected from a leaf):

.. math::
  s = \operatorname{mean}(v), \quad c = v - s, \quad
  \sigma = \lVert c \rVert_2 / \sqrt{\max(m - 1, 1)}, \quad
  h = r \sigma / B, \quad
  q = \operatorname{clip}(\operatorname{round}(c / h + B / 2), 0, B - 1),

with ``r`` = ``quantization_range`` (6: :math:`h = 1.5 \sigma` at 2 bits) and
:math:`h` replaced by 1 where it is zero, NaN or infinite. Rounding is half to
even. The codebook entry of bin :math:`b` is the mean of :math:`c` over the
values coded :math:`b` (0 for an empty bin) plus :math:`s`; a value decodes
to its bin's entry. The codebook travels as ``B`` floats (the shift folded
in, which decodes to the same bits as adding it after the lookup).

Tiles (:func:`chunked_top_k`), decided at trace time from static shapes:

* A leaf is seen as a matrix ``(R, C)``: a 2-D leaf as is; a 1-D leaf of
  ``d`` entries as ``(1, d)`` (runs of entries); a scalar as ``(1, 1)``; a
  leaf of rank ``>= 3`` (a convolution kernel) as
  ``(prod(shape[:-1]), shape[-1])``, the row-major reshape that keeps the last
  axis (the reference code takes only 1-D and 2-D leaves).
* The block along an axis of size ``s`` is the largest divisor of ``s`` that
  is at most ``chunk`` (no padding: ``96 -> 48``, a prime ``97 -> 1``); the
  tiles are ``b1 x b2`` blocks, flattened row-major within the tile.
* A tile of ``w = b1 b2`` entries keeps ``k = max(1, round(w topk / chunk^2))``
  entries (at most ``w``): ``topk`` in a full ``chunk x chunk`` tile, fewer in
  smaller ones (a run of 64 entries of a 1-D leaf keeps 1 at the defaults).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import diloco as diloco_lib

_BITS = (1, 2, 4, 8)


# ----------------------------------------------------------------------------
# The statistical quantizer.


def _bin_sums(c: jax.Array, q: jax.Array, bins: int, replicated: bool) -> tuple[jax.Array, jax.Array]:
    """Per row and bin, the sum of ``c`` over the entries coded ``b`` and their count.

    ``replicated``: the result must come out bit-identical on every worker that
    computes it from the same inputs, so the sums are plain reductions, one
    pass per bin (a scatter-add may add in any order on GPUs). Otherwise
    one scatter-add: the codebook then travels and every receiver decodes the
    sender's bits.
    """
    rows = c.shape[0]
    if not replicated:
        ids = (jnp.arange(rows, dtype=jnp.int32)[:, None] * bins + q).reshape(-1)
        sums = jax.ops.segment_sum(c.reshape(-1), ids, num_segments=rows * bins)
        counts = jax.ops.segment_sum(jnp.ones_like(ids), ids, num_segments=rows * bins)
        return sums.reshape(rows, bins), counts.reshape(rows, bins)

    def one_bin(b, acc):
        sums, counts = acc
        hit = q == b
        sums = sums.at[:, b].set(jnp.sum(jnp.where(hit, c, jnp.zeros_like(c)), axis=1))
        counts = counts.at[:, b].set(jnp.sum(hit, axis=1, dtype=jnp.int32))
        return sums, counts

    zeros = (jnp.zeros((rows, bins), c.dtype), jnp.zeros((rows, bins), jnp.int32))
    return jax.lax.fori_loop(0, bins, one_bin, zeros)


def statistical_codes(
    x: jax.Array, bits: int, quantization_range: Any = 6.0, *, replicated: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantizes each row of ``x`` (``(rows, m)``, float) with the statistical codebook.

    See the module documentation for the quantizer. ``replicated`` computes
    the codebook with reductions only (bit-identical wherever the same ``x``
    is quantized); otherwise with a scatter-add.

    Returns:
      ``(codes, codebook)``: int32 codes ``(rows, m)`` in ``[0, 2^bits)`` and the
      codebook ``(rows, 2^bits)`` in ``x``'s dtype; the decoded rows are
      ``jnp.take_along_axis(codebook, codes, axis=1)``.
    """
    bins = 1 << bits
    m = x.shape[1]
    shift = jnp.mean(x, axis=1, keepdims=True)
    c = x - shift
    sigma = jnp.sqrt(jnp.sum(c * c, axis=1, keepdims=True)) / jnp.asarray(math.sqrt(max(m - 1, 1)), x.dtype)
    scale = jnp.asarray(quantization_range, x.dtype) * sigma / jnp.asarray(bins, x.dtype)
    scale = jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.ones_like(scale), scale)
    codes = jnp.clip(jnp.round(c / scale + jnp.asarray(bins // 2, x.dtype)), 0, bins - 1).astype(jnp.int32)
    sums, counts = _bin_sums(c, codes, bins, replicated)
    lookup = jnp.where(counts > 0, sums / jnp.maximum(counts, 1).astype(x.dtype), jnp.zeros_like(sums))
    return codes, lookup + shift


def _decode(codebook: jax.Array, codes: jax.Array) -> jax.Array:
    return jnp.take_along_axis(codebook, codes, axis=-1)


# ----------------------------------------------------------------------------
# Bit packing: ``width`` bits per value, values back to back.


def packed_bytes(count: int, width: int) -> int:
    """Bytes of ``count`` values packed at ``width`` bits each (rounded up to a byte)."""
    return -(-count * width // 8)


def _pack_bits(values: jax.Array, width: int) -> jax.Array:
    """Flat non-negative ints below ``2^width`` -> uint8 bytes, least significant bit first."""
    count = math.prod(values.shape)
    bits = (values.reshape(count, 1).astype(jnp.uint32) >> jnp.arange(width, dtype=jnp.uint32)[None, :]) & 1
    bits = jnp.pad(bits.reshape(-1), (0, 8 * packed_bytes(count, width) - count * width))
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(8, dtype=jnp.uint32))[None, :]
    return jnp.sum(bits.reshape(-1, 8) * weights, axis=1, dtype=jnp.uint32).astype(jnp.uint8)


def _pack_rows(values: jax.Array, width: int) -> jax.Array:
    """:func:`_pack_bits` of each row of ``values`` ``(rows, count)``: uint8 ``(rows, bytes)``."""
    return jax.vmap(lambda v: _pack_bits(v, width))(values)


def _unpack_rows(packed: jax.Array, count: int, width: int) -> jax.Array:
    """Inverse of :func:`_pack_rows` on a batch: uint8 ``(n, rows, bytes)`` -> int32 ``(n, rows, count)``."""
    n, rows = packed.shape[:2]
    return _unpack_bits(packed.reshape(n * rows, -1), count, width).reshape(n, rows, count)


def _unpack_bits(packed: jax.Array, count: int, width: int) -> jax.Array:
    """Inverse of :func:`_pack_bits` on a batch: uint8 ``(n, bytes)`` -> int32 ``(n, count)``."""
    n = packed.shape[0]
    bits = (packed.astype(jnp.int32)[:, :, None] >> jnp.arange(8, dtype=jnp.int32)[None, None, :]) & 1
    bits = bits.reshape(n, -1)[:, : count * width].reshape(n, count, width)
    return jnp.sum(bits << jnp.arange(width, dtype=jnp.int32)[None, None, :], axis=-1)


# ----------------------------------------------------------------------------
# Shared checks and pieces of the two compressors.


def _check_bits(bits: Any, name: str = "bits") -> int:
    if isinstance(bits, bool) or bits not in _BITS:
        raise ValueError(f"`{name}` must be one of {_BITS}; got {bits!r}.")
    return int(bits)


def _init_error(params: Any, compressed: list[bool]) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    errors = [
        jnp.zeros(jnp.shape(p), base.accumulation_dtype(p.dtype)) if keep else optax.MaskedNode()
        for p, keep in zip(leaves, compressed)
    ]
    return jax.tree.unflatten(treedef, errors)


def _decayed(beta: Any, e: jax.Array, g: jax.Array) -> jax.Array:
    """``beta * e + g`` in the error's dtype."""
    return jnp.asarray(beta, e.dtype) * e + g.astype(e.dtype)


def _worker_leaves(
    updates: Any, error: Any, axis_name: base.AxisName, name: str
) -> tuple[int, list[jax.Array], Any, list[Any]]:
    """``(n, leaves, treedef, error leaves)`` of updates checked to be per-worker (not already
    summed over the axis), ``n`` the axis size."""
    n = comm.require_axis(axis_name, name)
    updates = comm.per_worker_share(
        updates, axis_name, invariant_updates="error", linear=False, caller=name, cast=False
    )
    leaves, treedef = jax.tree.flatten(updates)
    return n, leaves, treedef, treedef.flatten_up_to(error)


# ----------------------------------------------------------------------------
# statistical_quantize (MuLoCo).


@base.reshard_rules(error=base.REGROUP)
class StatisticalQuantizeState(NamedTuple):
    """State for :func:`jaxopt_dist.statistical_quantize`.

    Attributes:
      count: int32[], steps taken (evaluates schedules); replicated.
      error: the error-feedback buffer, what was not sent yet, like params in
        at least float32; ``optax.MaskedNode()`` for the leaves ``mask``
        sends dense; per-worker.
    """

    count: jax.Array  # int32[], replicated
    error: optax.Updates  # like params (>= float32), MaskedNode where dense; per-worker


def _mask_flags(mask: Any, tree: Any, name: str) -> list[bool]:
    """One bool per leaf of ``tree``: compressed (True) or sent dense (False)."""
    leaves = jax.tree.leaves(tree)
    if mask is None:
        return [True] * len(leaves)
    chosen = mask(tree) if callable(mask) else mask
    try:
        full = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), chosen, tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"`mask` of `{name}` must be a tree prefix of the updates: {e}") from None
    flags = jax.tree.leaves(full)
    if len(flags) != len(leaves) or not all(isinstance(f, bool) for f in flags):
        raise TypeError(
            f"`mask` of `{name}` must hold Python bools, one per leaf (or subtree); got {chosen!r}."
        )
    return flags


def _rows(shape: tuple[int, ...], row_wise: bool) -> tuple[int, int]:
    """The ``(rows, m)`` view a leaf is quantized in: one row, or ``reshape(shape[0], -1)``."""
    size = math.prod(shape)
    if row_wise and len(shape) >= 2:
        return int(shape[0]), size // int(shape[0])
    return 1, size


def statistical_quantize(
    bits: int = 2,
    *,
    row_wise: bool = False,
    error_decay: optax.ScalarOrSchedule = 1.0,
    requantize_mean: bool = True,
    quantization_range: optax.ScalarOrSchedule = 6.0,
    mask: Any = None,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""MuLoCo's compressor: statistical codebook quantization with decaying error feedback.

    Takes each worker's *local* updates (a DiLoCo pseudo-gradient, or a
    gradient) and returns the mean over workers of their quantized values,
    the same bits on every worker. Per worker :math:`i` and compressed leaf,
    with :math:`\beta` = ``error_decay`` and :math:`Q` the statistical
    quantizer of the module documentation at ``bits`` bits, over the whole
    leaf (``row_wise``: one codebook per row of ``reshape(shape[0], -1)``, a
    1-D leaf one row):

    .. math::
      e_i \leftarrow \beta e_i + g_i, \qquad
      \hat e_i = Q(e_i), \qquad e_i \leftarrow e_i - \hat e_i, \qquad
      u = \frac1n \sum_{j=1}^n \hat e_j,

    then, with ``requantize_mean``, :math:`u \leftarrow Q(u)` (MuLoCo's
    ``simulate_quantization_after_reduce``, on by default there: the
    re-quantization a reduce-scatter / all-gather implementation makes). The
    re-quantization is not fed back. Every worker re-quantizes the same mean,
    so its codebook is summed with one reduction per bin (``2^bits`` passes
    over the leaf, where the sender's codebook takes one scatter-add): the
    same bits on every worker whatever order a device's scatter-add adds in. :math:`\beta = 0` turns error feedback
    off (:math:`e_i = g_i` at every step).

    Leaves where ``mask`` is False are sent dense and averaged (no
    quantization, no error feedback), as MuLoCo's
    ``skip_norm_quantization`` / ``skip_embedding_quantization`` send norm
    and embedding leaves. ``mask`` works as optax's: a tree of bools (or a
    prefix of the updates' tree), or a callable that returns one from the
    updates (and from ``params`` at ``init``). Inside
    :func:`jaxopt_dist.diloco` the aggregate sees each fragment's leaves as a
    list (in ``jax.tree.leaves`` order), so a mask there is best a callable on
    the leaves, e.g. ``lambda leaves: [x.ndim >= 2 for x in leaves]`` (matrices
    quantized, norms and biases dense).

    MuLoCo (DiLoCo with Muon inside and this compressor outside) is::

      jd.diloco(optax.contrib.muon(0.02236, beta=0.9), sync_every=H,
                outer=optax.sgd(0.8, momentum=0.9, nesterov=True),
                aggregate=statistical_quantize(2, error_decay=0.9))

    The reference adds ``lr * d`` to its error buffer and steps by ``lr``
    again, so its outer step scales the pseudo-gradient by ``lr^2``; here
    the outer learning rate is applied once, by ``outer`` (the reference's
    runs at lr 0.8 are ``outer=optax.sgd(0.64, momentum=0.9, nesterov=True)``
    here; the quantizer commutes with the scaling, up to rounding).

    Args:
      bits: bits per code, 1, 2, 4 or 8 (``2^bits`` bins).
      row_wise: one codebook per row of ``reshape(shape[0], -1)`` (MuLoCo's
        ``row_wise_statistical``); False: one per leaf.
      error_decay: :math:`\beta` in [0, 1], a float or a schedule of the step
        count (0.95 in MuLoCo's code, 0.9 in its example configuration).
      requantize_mean: quantize the mean again before returning it.
      quantization_range: ``r``, the codes span ``r`` standard deviations
        (6, as the reference); a float > 0 or a schedule.
      mask: which leaves to quantize (True) or send dense (False); None
        quantizes every leaf.
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`StatisticalQuantizeState`. ``bits`` fixes shapes: under
      :func:`optax.inject_hyperparams` list it in ``static_args``.

    Communication:
      One all-gather per step of ``B = sum_l (ceil(size_l bits / 8) + 4 R_l
      2^bits)`` bytes for the quantized leaves (bit-packed codes, then ``R_l``
      codebooks in the error buffer's dtype, float32 for float32 and narrower
      parameters, ``R_l`` = 1 or the leaf's rows): each worker sends
      ``B`` and receives ``(n - 1) B``, so ``(n - 1) B`` in the cost table. At
      2 bits that is ``(n - 1) D / 4`` bytes for ``D`` entries, against ``2
      (n - 1) / n * 4 D`` for a float32 ring all-reduce: 16x fewer on 2
      workers, ``32 / n`` times in general (the all-gather is MuLoCo's; the
      reduce-scatter it simulates with ``requantize_mean`` is not built).
      Leaves sent dense: one all-reduce (mean) of their bytes. Outputs and
      ``count`` are replicated; ``error`` is per-worker.

    Sharded parameters:
      Needs whole leaves: the mean, spread and codebook are statistics of a
      whole leaf (or row), so the compiler assembles each leaf over the model
      axes for the quantizer and the packed payload. The all-gather above runs
      over the data axis, per replica; the error buffer stays sharded like its
      parameter.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxopt_dist as jd
      >>> tx = jd.statistical_quantize(2, requantize_mean=False)
      >>> g = jnp.array([[1.0, 2.0, 3.0, 10.0], [1.0, 2.0, 3.0, 10.0]])  # two workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(g)[0]
      Array([ 2.,  2.,  2., 10.], dtype=float32)

    References:
      Thérien et al, `MuLoCo: Muon is a practical inner optimizer for DiLoCo
      <https://arxiv.org/abs/2505.23725>`_, 2025 (reference code
      facebookresearch/MuLoCo, ``quantized_outer_sgd.py``)
    """
    bits = _check_bits(bits)
    base.check_bool(row_wise, "row_wise")
    base.check_bool(requantize_mean, "requantize_mean")
    base.check_hyperparameter(error_decay, "error_decay", lower=0.0, upper=1.0)
    base.check_hyperparameter(quantization_range, "quantization_range", lower=0.0, lower_open=True)
    if mask is not None and not callable(mask):
        flags = jax.tree.leaves(mask)
        if not flags or not all(isinstance(f, bool) for f in flags):
            raise TypeError(f"`mask` must be None, a callable or a tree of Python bools; got {mask!r}.")
    axis_name = base.validate_axis_name(axis_name)
    name = "statistical_quantize"

    def init_fn(params):
        flags = _mask_flags(mask, params, name)
        return StatisticalQuantizeState(count=jnp.zeros([], jnp.int32), error=_init_error(params, flags))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        n, leaves, treedef, errors = _worker_leaves(updates, state.error, axis_name, name)
        flags = [f and math.prod(g.shape) > 0 for f, g in zip(_mask_flags(mask, updates, name), leaves)]
        beta = base.resolve(error_decay, state.count)
        spread = base.resolve(quantization_range, state.count)
        # Leaves of one shape and dtype are quantized together, stacked (one codebook per row).
        quantized = [i for i, keep in enumerate(flags) if keep]
        groups = base.LeafGroups([errors[i] for i in quantized])
        decayed = [
            _decayed(beta, e, g)
            for e, g in zip(
                groups.stack([errors[i] for i in quantized]), groups.stack([leaves[i] for i in quantized])
            )
        ]
        payload, sent = _quantized_rows(decayed, bits, spread, row_wise)
        gathered = comm.all_gather_packed(payload, axis_name, caller=name)
        dense = iter(comm.reduce([g for g, keep in zip(leaves, flags) if not keep], axis_name, caller=name))
        new_errors = list(errors)
        means: list[Any] = [None if keep else next(dense) for keep in flags]
        decoded = _mean_of_rows(gathered, decayed, n, bits, row_wise)
        for i, e, mean in zip(quantized, groups.unstack(sent), groups.unstack(decoded)):
            new_errors[i], means[i] = e, mean
        if requantize_mean:
            means = _requantized_leaves(means, flags, bits, spread, row_wise)
        out = [x.astype(g.dtype) for x, g in zip(means, leaves)]
        return jax.tree.unflatten(treedef, out), StatisticalQuantizeState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            error=jax.tree.unflatten(treedef, new_errors),
        )

    def second_stage(leaves, state):
        """The re-quantization of a mean computed elsewhere (``state``: before the step)."""
        spread = base.resolve(quantization_range, state.count)
        flags = [f and math.prod(x.shape) > 0 for f, x in zip(_mask_flags(mask, leaves, name), leaves)]
        out = _requantized_leaves(leaves, flags, bits, spread, row_wise)
        return [x.astype(g.dtype) for x, g in zip(out, leaves)]

    def wire_encode(updates, state):
        """The message ``update_fn`` all-gathers (and the dense leaves it averages), without a collective."""
        leaves, treedef = jax.tree.flatten(updates)
        errors = treedef.flatten_up_to(state.error)
        flags = [f and math.prod(g.shape) > 0 for f, g in zip(_mask_flags(mask, updates, name), leaves)]
        beta = base.resolve(error_decay, state.count)
        quantized = [i for i, keep in enumerate(flags) if keep]
        groups = base.LeafGroups([errors[i] for i in quantized])
        stacks = zip(
            groups.stack([errors[i] for i in quantized]), groups.stack([leaves[i] for i in quantized])
        )
        spread = base.resolve(quantization_range, state.count)
        payload, _ = _quantized_rows([_decayed(beta, e, g) for e, g in stacks], bits, spread, row_wise)
        return payload + [g for g, keep in zip(leaves, flags) if not keep]

    def wire_decode(message, like, state):
        """One worker's message as ``update_fn`` reads it on a workers' axis of size 1."""
        del state
        leaves = list(like)
        flags = [f and math.prod(g.shape) > 0 for f, g in zip(_mask_flags(mask, leaves, name), leaves)]
        quantized = [i for i, keep in enumerate(flags) if keep]
        errors = [
            jax.ShapeDtypeStruct(leaves[i].shape, base.accumulation_dtype(leaves[i].dtype)) for i in quantized
        ]
        groups = base.LeafGroups(errors)
        stacks: list[Any] = [
            jax.ShapeDtypeStruct((len(ids), *errors[ids[0]].shape), errors[ids[0]].dtype)
            for ids in groups.groups
        ]
        payload, dense = [m[None] for m in message[: 2 * len(stacks)]], iter(message[2 * len(stacks) :])
        means = iter(groups.unstack(_mean_of_rows(payload, stacks, 1, bits, row_wise)))
        out = [next(means) if keep else next(dense) for keep in flags]
        return [x.astype(g.dtype) for x, g in zip(out, leaves)], None

    tx = comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), name)
    if not requantize_mean:
        return base.declare_wire(tx, base.Wire(wire_encode, wire_decode))
    first = statistical_quantize(
        bits,
        row_wise=row_wise,
        error_decay=error_decay,
        requantize_mean=False,
        quantization_range=quantization_range,
        mask=mask,
        axis_name=axis_name,
    )
    return base.declare_two_stage(tx, first, second_stage)


def _quantized_rows(
    stacks: list[jax.Array], bits: int, spread: Any, row_wise: bool
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per stack of leaves ``(L, *shape)``: the message (packed codes ``(L, bytes)`` and codebooks
    ``(L, rows, 2^bits)``) and what remains of the stack once its quantization is taken out."""
    payload, rest = [], []
    for e in stacks:
        rows, m = _rows(e.shape[1:], row_wise)
        codes, book = statistical_codes(e.reshape(-1, m), bits, spread)
        rest.append(e - _decode(book, codes).reshape(e.shape))
        payload += [_pack_rows(codes.reshape(e.shape[0], -1), bits), book.reshape(e.shape[0], rows, -1)]
    return payload, rest


def _mean_of_rows(
    gathered: list[jax.Array], stacks: list[jax.Array], n: int, bits: int, row_wise: bool
) -> list[jax.Array]:
    """Per stack, the mean over the ``n`` workers of their decoded messages (:func:`_quantized_rows`)."""
    out = []
    for j, e in enumerate(stacks):
        rows, m = _rows(e.shape[1:], row_wise)
        codes = _unpack_rows(gathered[2 * j], rows * m, bits).reshape(n, e.shape[0], rows, m)
        book = gathered[2 * j + 1]
        out.append((jnp.sum(_decode(book, codes), axis=0) / jnp.asarray(n, book.dtype)).reshape(e.shape))
    return out


def _requantized_leaves(
    means: list[jax.Array], flags: list[bool], bits: int, spread: Any, row_wise: bool
) -> list[jax.Array]:
    """``Q(mean)`` of each flagged leaf, a value every worker holds (its codebook summed in a fixed
    order), in the leaf's shape; the other leaves as they are. Leaves of one shape and dtype are
    quantized together, stacked."""
    quantized = [i for i, keep in enumerate(flags) if keep]
    groups = base.LeafGroups([means[i] for i in quantized])
    out = list(means)
    stacked = []
    for x in groups.stack([means[i] for i in quantized]):
        m = _rows(x.shape[1:], row_wise)[1]
        codes, book = statistical_codes(x.reshape(-1, m), bits, spread, replicated=True)
        stacked.append(_decode(book, codes).reshape(x.shape))
    for i, x in zip(quantized, groups.unstack(stacked)):
        out[i] = x
    return out


# ----------------------------------------------------------------------------
# chunked_top_k (SparseLoCo's compressor).


class _Tiling(NamedTuple):
    """How a leaf is cut: an ``(R, C)`` matrix in ``b1 x b2`` tiles, ``k`` kept per tile."""

    matrix: tuple[int, int]
    block: tuple[int, int]
    k: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.matrix[0] // self.block[0], self.matrix[1] // self.block[1]

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def size(self) -> int:
        return self.block[0] * self.block[1]

    @property
    def index_bits(self) -> int:
        """Bits of a tile-local index: 12 for 4096 entries, 0 for a tile of one."""
        return (self.size - 1).bit_length()


def tile_shape(shape: tuple[int, ...], chunk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((R, C), (b1, b2))``: the matrix a leaf of ``shape`` is seen as, and its tile.

    See the module documentation: scalars ``(1, 1)``, 1-D ``(1, d)``, rank
    ``>= 3`` ``(prod(shape[:-1]), shape[-1])``; each block the largest divisor
    of its axis that is at most ``chunk``.
    """
    if len(shape) == 0:
        matrix = (1, 1)
    elif len(shape) == 1:
        matrix = (1, int(shape[0]))
    else:
        matrix = (math.prod(shape[:-1]), int(shape[-1]))
    block = tuple(max(d for d in range(1, min(s, chunk) + 1) if s % d == 0) for s in matrix)
    return matrix, (block[0], block[1])


def kept_per_tile(tile_size: int, topk: int, chunk: int) -> int:
    """``max(1, round(tile_size * topk / chunk^2))``, at most ``tile_size`` (Python's round)."""
    return min(tile_size, max(1, round(tile_size * topk / chunk**2)))


def _tiling(shape: tuple[int, ...], chunk: int, topk: int) -> _Tiling:
    matrix, block = tile_shape(shape, chunk)
    return _Tiling(matrix, block, kept_per_tile(block[0] * block[1], topk, chunk))


def _to_tiles(x: jax.Array, lay: _Tiling) -> jax.Array:
    """Leaves of one shape stacked ``(L, *shape)`` -> ``(L * tiles, b1 * b2)``, tiles in row-major
    order leaf after leaf, entries row-major in a tile."""
    (g1, g2), (b1, b2) = lay.grid, lay.block
    return x.reshape(-1, g1, b1, g2, b2).transpose(0, 1, 3, 2, 4).reshape(-1, lay.size)


def _from_tiles(t: jax.Array, lay: _Tiling, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`_to_tiles`, to ``shape`` (the stacked leaves' shape)."""
    (g1, g2), (b1, b2) = lay.grid, lay.block
    return t.reshape(-1, g1, g2, b1, b2).transpose(0, 1, 3, 2, 4).reshape(shape)


def _chosen_mean(idx: jax.Array, values: jax.Array, lay: _Tiling) -> jax.Array:
    """``(tiles, b1 b2)``: per entry the mean of the values of the workers that chose it, else 0.

    ``idx`` and ``values`` are ``(n, tiles, k)`` (the tiles of one leaf or of
    several stacked); workers are added one after the other in worker order,
    so every worker gets the same bits.
    """
    n, tiles = idx.shape[:2]
    tile = jnp.arange(tiles)[:, None]
    dense = jnp.zeros((tiles, lay.size), values.dtype)

    def add(w, sums):
        at = (tile, idx[w])
        return sums[0].at[at].add(values[w], unique_indices=True), sums[1].at[at].add(1, unique_indices=True)

    total, chosen = jax.lax.fori_loop(0, n, add, (dense, jnp.zeros(dense.shape, jnp.int32)))
    return jnp.where(chosen > 0, total / jnp.maximum(chosen, 1).astype(total.dtype), jnp.zeros_like(total))


def _chosen_entries(packed: jax.Array | None, e: Any, lay: _Tiling) -> jax.Array:
    """``(tiles, b1 b2)`` of a stack of leaves like ``e``: 1 at the entries one worker's packed indices
    ``(1, L, bytes)`` choose (every entry of tiles of one), 0 elsewhere."""
    shape = (1, e.shape[0] * lay.tiles, lay.k)
    idx = (
        jnp.zeros(shape, jnp.int32)
        if packed is None
        else _unpack_rows(packed, lay.tiles * lay.k, lay.index_bits)
    )
    return _chosen_mean(idx.reshape(shape), jnp.ones(shape, e.dtype), lay)


def _median_clip(values: jax.Array) -> jax.Array:
    """Each worker's values ``(n, ...)`` scaled by ``min(1, median_j |v_j| / |v_i|)``.

    The median of an even count is the lower middle value (``torch.median``).
    """
    return _median_clip_stacked(values[:, None])[:, 0]


def _median_clip_stacked(values: jax.Array) -> jax.Array:
    """:func:`_median_clip` of each leaf of ``values`` ``(n, L, ...)``, a median per leaf."""
    n, count = values.shape[:2]
    norms = jnp.sqrt(jnp.sum(values.reshape(n, count, -1) ** 2, axis=2))
    median = jnp.sort(norms, axis=0)[(n - 1) // 2][None]
    factor = jnp.where(norms > median, median / jnp.where(norms > 0, norms, 1), jnp.ones_like(norms))
    return values * factor.reshape((n, count) + (1,) * (values.ndim - 2))


def _whole_on_model_axes(tree: Any) -> Any:
    """``tree`` pinned replicated over the model axes the compiler partitions, if any.

    Inside :func:`jaxopt_dist.data_parallel_step` with ``param_specs`` (data
    axes manual, model axes Auto) the tiles, and the indices and values
    selected from them, would otherwise inherit sub-axis shardings of the leaf
    (a tile spanning two shards), which XLA's SPMD partitioner aborts on in
    the gathers, scatters and the bit packing. A no-op elsewhere (vmap, a
    data-only mesh).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.auto_axes:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.sharding.PartitionSpec())


@base.reshard_rules(error=base.REGROUP)
class ChunkedTopKState(NamedTuple):
    """State for :func:`jaxopt_dist.chunked_top_k`.

    Attributes:
      count: int32[], steps taken (evaluates schedules); replicated.
      error: the error-feedback buffer, what was not sent yet, like params in
        at least float32; per-worker.
    """

    count: jax.Array  # int32[], replicated
    error: optax.Updates  # like params (>= float32), per-worker


def chunked_top_k(
    topk: int = 64,
    *,
    chunk: int = 64,
    bits: int | None = None,
    error_decay: optax.ScalarOrSchedule = 1.0,
    clip_to_median_norm: bool = False,
    quantization_range: optax.ScalarOrSchedule = 6.0,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""SparseLoCo's compressor: top-k per tile of an error-feedback buffer, bit-packed.

    Takes each worker's *local* updates (a DiLoCo pseudo-gradient, or a
    gradient) and returns one combined update, the same bits on every
    worker. Per worker :math:`i` and leaf, with :math:`\beta` = ``error_decay``:

    .. math::
      e_i \leftarrow \beta e_i + g_i, \qquad
      (S_i, v_i) = \operatorname{top}_k(e_i) \text{ per tile}, \qquad
      \hat v_i = Q(v_i), \qquad e_i \leftarrow e_i - \operatorname{scatter}(S_i, \hat v_i),

    where the tiles and ``k`` are the module documentation's (DeMo's tiling
    without the DCT; ties go to the lower index) and :math:`Q` is, with
    ``bits``, the statistical quantizer over all the values the worker
    selected from the leaf (one codebook per leaf and worker), else the
    values in the updates' dtype. The buffer keeps what was not delivered:
    the reconstruction, not the exact values. Every worker receives every
    :math:`(S_j, \hat v_j)`; **each coordinate is the mean over the workers
    that selected it** (0 where none did).

    With ``clip_to_median_norm`` (SparseLoCo's robust combination) worker
    :math:`j`'s values are first scaled by :math:`\min(1, \operatorname{med}_l
    \lVert \hat v_l \rVert / \lVert \hat v_j \rVert)`, per leaf (the lower
    middle value for an even worker count, as ``torch.median``); the error
    buffers are unaffected.

    Usable as :func:`jaxopt_dist.diloco`'s ``aggregate`` (as
    :func:`sparseloco` does) and as a data-parallel gradient compressor:
    ``optax.chain(chunked_top_k(64, bits=2), optax.sgd(0.1))``.

    Args:
      topk: entries kept in a full ``chunk x chunk`` tile (Python int >= 1);
        smaller tiles keep proportionally fewer, at least one.
      chunk: the largest block along each axis (Python int >= 1).
      bits: None (values sent in the updates' dtype) or 1, 2, 4, 8: the
        statistical quantization of the kept values.
      error_decay: :math:`\beta` in [0, 1], a float or a schedule of the step
        count (SparseLoCo: 0.95). 0 turns error feedback off.
      clip_to_median_norm: scale down workers whose values have more than the
        median norm before combining.
      quantization_range: the quantizer's span in standard deviations (6).
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ChunkedTopKState`. ``topk``, ``chunk`` and ``bits`` fix shapes:
      under :func:`optax.inject_hyperparams` list them in ``static_args``.

    Communication:
      One all-gather per step of a uint8 buffer of ``B = sum_l (ceil(T_l k_l
      x_l / 8) + ceil(T_l k_l bits / 8) + 4 * 2^bits)`` bytes per worker: for
      each leaf its ``T_l`` tiles' ``k_l`` tile-local indices at ``x_l`` bits
      (the bits a tile index needs: 12 for a 64x64 tile), the codes at
      ``bits`` bits and a float32 codebook of ``2^bits`` entries; without
      ``bits``, ``T_l k_l`` values in the updates' dtype instead of codes and
      codebook. Each worker sends ``B`` and receives ``(n - 1) B``. At the
      defaults with ``bits=2`` a 64x64 tile costs 64 12-bit indices and 64
      2-bit codes, 112 bytes, against 16 384 in float32 (146x; 128x with the
      16-byte codebook of a one-tile leaf). Outputs and ``count`` are
      replicated; ``error`` is per-worker.

    Sharded parameters:
      Needs whole leaves: top-k runs on the tiles of a leaf's matrix view and
      the codebook is a statistic of all the values a worker selected from the
      leaf, so the compiler assembles tiles and payload over the model axes
      (the error buffer is stored sharded like its parameter; during the
      update its tiles, and the indices and values selected from them, are
      held whole on every device of the replica). The all-gather above runs
      over the data axis, per replica; the output is that of replicated
      parameters.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxopt_dist as jd
      >>> tx = jd.chunked_top_k(1, chunk=2)       # one of every run of 2 entries
      >>> g = jnp.array([[1.0, 3.0, -4.0, 0.5], [2.0, 5.0, 0.0, -2.0]])  # two workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(g)[0]   # entry 1: both chose it; entry 0: none
      Array([ 0.,  4., -4., -2.], dtype=float32)

    References:
      Sarfi et al, `Communication Efficient LLM Pre-training with SparseLoCo
      <https://arxiv.org/abs/2508.15706>`_, 2025
    """
    topk = base.check_positive_int(topk, "topk")
    chunk = base.check_positive_int(chunk, "chunk")
    bits = None if bits is None else _check_bits(bits)
    base.check_hyperparameter(error_decay, "error_decay", lower=0.0, upper=1.0)
    base.check_bool(clip_to_median_norm, "clip_to_median_norm")
    base.check_hyperparameter(quantization_range, "quantization_range", lower=0.0, lower_open=True)
    axis_name = base.validate_axis_name(axis_name)
    name = "chunked_top_k"

    def init_fn(params):
        return ChunkedTopKState(
            count=jnp.zeros([], jnp.int32), error=_init_error(params, [True] * len(jax.tree.leaves(params)))
        )

    def select(e, g_dtype, lay, spread):
        """(new error, message arrays) of a stack of leaves' corrected buffers ``e`` ``(L, *shape)``."""
        count = e.shape[0]
        t = _whole_on_model_axes(_to_tiles(e, lay))
        _, idx = jax.lax.top_k(jnp.abs(t), lay.k)
        values = jnp.take_along_axis(t, idx, axis=1)
        idx, values = _whole_on_model_axes((idx, values))
        message = [_pack_rows(idx.reshape(count, -1), lay.index_bits)] if lay.index_bits else []
        if bits is None:
            message.append(values.astype(g_dtype).reshape(count, -1))
            sent = values.astype(g_dtype).astype(e.dtype)
        else:
            codes, book = statistical_codes(values.reshape(count, -1), bits, spread)
            message += [_pack_rows(codes, bits), book]
            sent = _decode(book, codes).reshape(values.shape)
        t = _whole_on_model_axes(t.at[jnp.arange(t.shape[0])[:, None], idx].add(-sent, unique_indices=True))
        return _from_tiles(t, lay, e.shape), message

    def receive(gathered, e, lay, n):
        """The combined update of a stack of leaves ``e`` ``(L, *shape)`` from every worker's message."""
        count, per_leaf = e.shape[0], lay.tiles * lay.k
        if lay.index_bits:
            idx = _unpack_rows(next(gathered), per_leaf, lay.index_bits)
        else:
            idx = jnp.zeros((n, count, per_leaf), jnp.int32)
        if bits is None:
            values = next(gathered).astype(e.dtype)
        else:
            codes = _unpack_rows(next(gathered), per_leaf, bits)
            values = _decode(next(gathered), codes)
        values = values.reshape(n, count, lay.tiles, lay.k)
        if clip_to_median_norm:
            values = _median_clip_stacked(values)
        shape = (n, count * lay.tiles, lay.k)
        return _from_tiles(_chosen_mean(idx.reshape(shape), values.reshape(shape), lay), lay, e.shape)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        n, leaves, treedef, errors = _worker_leaves(updates, state.error, axis_name, name)
        beta = base.resolve(error_decay, state.count)
        spread = base.resolve(quantization_range, state.count)
        # Leaves of one shape and dtypes are compressed together, stacked.
        sent = [i for i, g in enumerate(leaves) if g.size]
        groups = base.LeafGroups(sent, key=lambda i: (leaves[i].shape, leaves[i].dtype, errors[i].dtype))
        stacks = groups.stack([_decayed(beta, errors[i], leaves[i]) for i in sent])
        lays = [_tiling(tuple(e.shape[1:]), chunk, topk) for e in stacks]
        payload, rest = [], []
        for e, lay, ids in zip(stacks, lays, groups.groups):
            e, message = select(e, leaves[sent[ids[0]]].dtype, lay, spread)
            rest.append(e)
            payload += message
        gathered = iter(comm.all_gather_packed(payload, axis_name, caller=name))
        means = [receive(gathered, e, lay, n) for e, lay in zip(stacks, lays)]
        new_errors, out = list(errors), [jnp.zeros_like(g) for g in leaves]
        for i, e, mean in zip(sent, groups.unstack(rest), groups.unstack(means)):
            new_errors[i], out[i] = e, mean.astype(leaves[i].dtype)
        return jax.tree.unflatten(treedef, out), ChunkedTopKState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            error=jax.tree.unflatten(treedef, new_errors),
        )

    def stacked(leaves, errors):
        """``update_fn``'s leaves sent, their groups and each group's tiling."""
        sent = [i for i, g in enumerate(leaves) if math.prod(g.shape)]
        groups = base.LeafGroups(sent, key=lambda i: (leaves[i].shape, leaves[i].dtype, errors[i].dtype))
        return (
            sent,
            groups,
            [_tiling(tuple(leaves[sent[ids[0]]].shape), chunk, topk) for ids in groups.groups],
        )

    def wire_encode(updates, state):
        """The message ``update_fn`` all-gathers, without the all-gather."""
        leaves, treedef = jax.tree.flatten(updates)
        errors = treedef.flatten_up_to(state.error)
        beta = base.resolve(error_decay, state.count)
        spread = base.resolve(quantization_range, state.count)
        sent, groups, lays = stacked(leaves, errors)
        stacks = groups.stack([_decayed(beta, errors[i], leaves[i]) for i in sent])
        message = []
        for e, lay, ids in zip(stacks, lays, groups.groups):
            message += select(e, leaves[sent[ids[0]]].dtype, lay, spread)[1]
        return message

    def wire_decode(message, like, state):
        """One worker's message: its values as ``update_fn`` reads them on a workers' axis of size 1,
        and 1 at the entries it chose (0 elsewhere)."""
        del state
        leaves = list(like)
        errors = [jax.ShapeDtypeStruct(x.shape, base.accumulation_dtype(x.dtype)) for x in leaves]
        sent, groups, lays = stacked(leaves, errors)
        received, values, chosen = iter(message), [], []
        for lay, ids in zip(lays, groups.groups):
            first = sent[ids[0]]
            e = jax.ShapeDtypeStruct((len(ids), *leaves[first].shape), errors[first].dtype)
            part = [
                jnp.asarray(next(received))[None]
                for _ in range(int(lay.index_bits > 0) + (1 if bits is None else 2))
            ]
            values.append(receive(iter(part), e, lay, 1))
            chosen.append(
                _from_tiles(_chosen_entries(part[0] if lay.index_bits else None, e, lay), lay, e.shape)
            )
        out = [jnp.zeros(x.shape, x.dtype) for x in leaves]
        support = [jnp.zeros(x.shape, x.dtype) for x in leaves]
        for i, v, c in zip(sent, groups.unstack(values), groups.unstack(chosen)):
            out[i], support[i] = v.astype(leaves[i].dtype), c.astype(leaves[i].dtype)
        return out, support

    tx = comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), name)
    merge = "median_clipped_chosen_mean" if clip_to_median_norm else "chosen_mean"
    return base.declare_wire(tx, base.Wire(wire_encode, wire_decode, merge))


# ----------------------------------------------------------------------------
# sparseloco: diloco + outer SGD + chunked_top_k.


def sparseloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    topk: int = 64,
    chunk: int = 64,
    bits: int | None = 2,
    error_decay: optax.ScalarOrSchedule = 0.95,
    outer_lr: optax.ScalarOrSchedule = 1.0,
    num_fragments: int = 1,
    sync_delay: int = 0,
    mixing: optax.ScalarOrSchedule = 0.0,
    clip_to_median_norm: bool = False,
    fragment_assignment: str = "strided",
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""SparseLoCo: DiLoCo whose outer step is plain SGD on a sparse, 2-bit, error-fed aggregate.

    Exactly :func:`jaxopt_dist.diloco` with ``outer=optax.sgd(outer_lr)``
    (no momentum) and ``aggregate=chunked_top_k(topk, chunk=chunk,
    bits=bits, error_decay=error_decay,
    clip_to_median_norm=clip_to_median_norm)``: every ``sync_every`` steps
    (per fragment, as DiLoCo's schedule), per worker :math:`i` and leaf,

    .. math::
      e_i \leftarrow \beta e_i + (a - x_i), \quad
      \text{send the top-}k \text{ of every tile of } e_i \text{ at 2 bits}, \quad
      a \leftarrow a - \eta\, \bar\Delta, \quad x_i \leftarrow a,

    with :math:`\bar\Delta` the per-coordinate mean over the workers that
    selected each coordinate (see :func:`chunked_top_k`) and :math:`\eta` =
    ``outer_lr``. The outer learning rate is applied **once**, in the outer
    step; the reference code also multiplies the pseudo-gradient by it
    before the error buffer, so its effective outer step is ``lr^2``: the
    two agree at ``lr = 1``, the paper's and the production value.

    Args:
      inner: the local optimizer (AdamW in the paper), applied every step.
      sync_every: ``H``, inner steps per synchronisation (>= 1).
      topk: entries kept per full ``chunk x chunk`` tile (64 of 4096 in
        production, 128 in the paper).
      chunk: the largest tile side (64).
      bits: bits of the quantized values (2), or None to send them in the
        parameters' dtype.
      error_decay: :math:`\beta` (0.95), a float or a schedule of the sync
        count of each fragment (the aggregate's own step count).
      outer_lr: :math:`\eta` (1.0), a float or a schedule of the sync count.
      num_fragments, sync_delay, mixing, fragment_assignment: Streaming
        DiLoCo's options, as :func:`jaxopt_dist.diloco`.
      clip_to_median_norm: SparseLoCo's robust combination (off by default).
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :func:`jaxopt_dist.diloco` transformation (state
      :class:`jaxopt_dist.DiLoCoState`, its ``aggregate_states`` holding one
      :class:`ChunkedTopKState` per fragment); ``update`` needs ``params`` and
      the parameters are per-worker (``data_parallel_step(...,
      per_worker_params=True)``).

    Communication:
      Only on synchronisation steps: one all-gather of :func:`chunked_top_k`'s
      packed payload for the fragment's leaves (at the defaults 112 bytes per
      64x64 tile plus a 16-byte codebook per leaf, against 16 384 bytes of
      float32). Nothing on other steps. Output updates, ``inner_state`` and
      the error buffers are per-worker; ``count``, ``anchor`` and the outer
      states are replicated.

    Sharded parameters:
      As :func:`jaxopt_dist.diloco` (elementwise) around
      :func:`chunked_top_k` (whole leaves).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxopt_dist as jd
      >>> tx = jd.sparseloco(optax.sgd(1.0), sync_every=1, topk=1, chunk=2, bits=None)
      >>> params = jnp.zeros((2, 2))                    # two workers' copies
      >>> def step(p, s, g):
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s
      >>> s = jax.vmap(tx.init)(params)
      >>> g = jnp.array([[1.0, 3.0], [2.0, 5.0]])       # pseudo-gradients [1, 3], [2, 5]
      >>> params, s = jax.vmap(step, axis_name="data")(params, s, g)
      >>> params                                        # both kept entry 1: mean 4
      Array([[ 0., -4.],
             [ 0., -4.]], dtype=float32)

    References:
      Sarfi et al, `Communication Efficient LLM Pre-training with SparseLoCo
      <https://arxiv.org/abs/2508.15706>`_, 2025
    """
    base.check_hyperparameter(outer_lr, "outer_lr", lower=0.0)
    aggregate = chunked_top_k(
        topk,
        chunk=chunk,
        bits=bits,
        error_decay=error_decay,
        clip_to_median_norm=clip_to_median_norm,
        axis_name=axis_name,
    )
    return diloco_lib.diloco(
        inner,
        sync_every=sync_every,
        outer=optax.sgd(outer_lr),
        aggregate=aggregate,
        num_fragments=num_fragments,
        sync_delay=sync_delay,
        mixing=mixing,
        fragment_assignment=fragment_assignment,
        axis_name=axis_name,
    )
