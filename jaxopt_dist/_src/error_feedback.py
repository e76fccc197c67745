"""Error feedback: the residual ("memory") mechanism every lossy compressor shares.

A compressor is described by a :class:`Compressor`: an ``init`` for its own
state and a ``compress`` function that, given this worker's (residual-corrected)
updates, communicates and returns

* ``output``: the aggregated result every worker applies (replicated), and
* ``contribution``: the part of the input this worker's message accounts for.
  For sparsifiers and quantizers that is what the worker sent (its decoded
  message); for PowerSGD it is the aggregated low-rank approximation, as in
  the paper's code and PyTorch's hook.

:func:`error_feedback` wraps it: the worker adds its residual to the incoming
updates, compresses, and keeps ``residual = input - contribution`` so that
nothing is lost, only delayed (Seide et al. 2014; Karimireddy et al. 2019).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm


class CompressFn(Protocol):
    def __call__(
        self, updates: optax.Updates, state: optax.OptState, params: optax.Params | None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.Updates, optax.OptState]:
        """Returns ``(output, contribution, new_state)``; see :class:`Compressor`."""
        ...


class Codec(NamedTuple):
    """A compressor's message, built and read locally: no communication.

    Methods that send compressed messages to chosen peers instead of
    aggregating them (:func:`jaxopt_dist.choco_gossip`) use it.

    Attributes:
      encode: ``encode(updates, state) -> (message, decoded, new_state)``:
        ``message`` is the list of arrays that travel; ``decoded`` is what a
        receiver reconstructs from them (like ``updates``); ``new_state`` the
        compressor's state after the step.
      decode: ``decode(message, like, state) -> decoded``: a peer's message
        at the same step back into a tree like ``like``, with ``state`` this
        worker's compressor state *before* the step (shared keys only).
    """

    encode: Callable[[optax.Updates, optax.OptState], tuple[list[jax.Array], optax.Updates, optax.OptState]]
    decode: Callable[[Sequence[jax.Array], optax.Updates, optax.OptState], optax.Updates]


class Compressor(NamedTuple):
    """A lossy communication scheme, in the form :func:`error_feedback` wraps.

    Attributes:
      init: ``init(params) -> state``; no communication.
      compress: ``compress(updates, state, params, **extra_args) -> (output,
        contribution, new_state)``. ``output`` is what every worker applies
        (the aggregate, replicated); ``contribution`` is the part of
        ``updates`` accounted for by this worker's message, in ``updates``'
        dtypes and shapes. The residual kept is ``updates - contribution``.
      codec: the same message encoded and decoded locally (a :class:`Codec`),
        or None where the scheme cannot work without its collectives.
      axis_name: the axis ``compress`` communicates over. When set,
        :func:`error_feedback` checks the incoming updates for leaves that
        arrived already summed over it (typed invariant under
        ``jax.shard_map(check_vma=True)``, see :func:`jaxopt_dist.all_reduce`)
        before adding the residual. None skips the check.
      name: the compressor's name, for error messages.
      invariant_updates: what an already-summed leaf stands for: ``"sum"`` or
        ``"mean"`` over the workers, for compressors whose output depends
        only on the mean of their inputs (the leaf becomes the per-worker
        share ``x / n``, resp. ``x``); ``"error"`` (the default, and the only
        choice for nonlinear compressors) raises an error that shows the fix.
      linear: whether the output depends only on the mean of the inputs over
        the workers (random-k, block-k, PowerSGD). Nonlinear compressors
        always reject already-summed updates. A linear compressor receives
        the share of such a leaf still typed invariant (the same on every
        worker, its own mean), so that the residual and everything else
        computed from it alone stay invariant.
      returns_residual: ``compress`` returns the residual (``updates`` minus
        the contribution) in place of the contribution. A sparsifier then
        zeroes the sent entries of the corrected updates in place, where the
        subtraction would read the updates and a dense contribution again
        (equal for finite values: ``x - x`` is ``+0.0``, ``x - 0`` is ``x``).
    """

    init: Callable[[optax.Params], optax.OptState]
    compress: CompressFn
    codec: Codec | None = None
    axis_name: Any = None
    name: str | None = None
    invariant_updates: str = "error"
    linear: bool = False
    returns_residual: bool = False


def stateless_compressor(
    body: Callable[[list[jax.Array], Any, int], tuple[optax.Updates, optax.Updates]],
    *,
    axis_name: Any,
    name: str,
    codec: Codec | None = None,
) -> Compressor:
    """A :class:`Compressor` without state of its own, from ``body(leaves, treedef, n) -> (output, contribution)``.

    Its state is ``optax.EmptyState()`` and passes through unchanged; ``n`` is
    the number of workers on ``axis_name`` (an unbound axis raises, naming
    ``name``); an empty tree comes back as it is without calling ``body``.
    The compressor is nonlinear: :func:`error_feedback` rejects updates that
    arrive already reduced over ``axis_name``.
    """

    def compress(updates, state, params=None, **extra_args):
        del params, extra_args
        n = comm.require_axis(axis_name, name)
        leaves, treedef = jax.tree.flatten(updates)
        if not leaves:
            return updates, updates, state
        output, contribution = body(leaves, treedef, n)
        return output, contribution, state

    return Compressor(lambda params: optax.EmptyState(), compress, codec, axis_name=axis_name, name=name)


_WRAPPED: weakref.WeakKeyDictionary[Callable[..., Any], Compressor] = weakref.WeakKeyDictionary()


def compressor_of(tx: Any) -> Compressor | None:
    """The :class:`Compressor` inside a transform built by :func:`error_feedback`, or None."""
    return base.registered(_WRAPPED, tx)


@base.reshard_rules(residual=base.REGROUP)
class ErrorFeedbackState(NamedTuple):
    """State for :func:`jaxopt_dist.error_feedback`.

    Attributes:
      count: int32[], steps taken; replicated.
      residual: what compression left out so far, like params in the updates'
        dtype; per-worker. An empty tuple when error feedback is off.
      inner_state: the compressor's own state.
    """

    count: jax.Array  # int32[], replicated
    residual: optax.Updates  # like params, per-worker; () when disabled
    inner_state: optax.OptState  # the compressor's state


def error_feedback(
    compressor: Compressor,
    *,
    enabled: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Wraps a :class:`Compressor` with a per-worker residual.

    .. math::
      x_i = g_i + e_i, \quad (o, c_i) = \mathcal{C}(x_i), \quad
      e_i \leftarrow x_i - c_i, \quad \text{output } o.

    By construction :math:`c_i + e_i^{new} = g_i + e_i^{old}` up to one
    rounding: nothing a worker computes is dropped, only delayed.

    Args:
      compressor: the scheme to wrap.
      enabled: keep a residual. With ``False`` the compressor runs on the raw
        updates and the state holds no residual.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`ErrorFeedbackState`.

    Communication:
      Whatever the compressor sends. The residual is per-worker; ``count`` is
      replicated.

    Sharded parameters:
      Elementwise: the residual is sharded like its parameter and corrected
      shard by shard; whatever crosses the model axes is the compressor's (see
      its docstring).
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"`compressor` must be a jaxopt_dist.Compressor; got {type(compressor).__name__}.")
    base.check_bool(enabled, "enabled")
    comm.check_invariant_mode(compressor.invariant_updates)

    def init_fn(params):
        residual = jax.tree.map(jnp.zeros_like, params) if enabled else ()
        return ErrorFeedbackState(
            count=jnp.zeros([], jnp.int32), residual=residual, inner_state=compressor.init(params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        if compressor.axis_name is not None:
            updates = comm.per_worker_share(
                updates,
                compressor.axis_name,
                invariant_updates=compressor.invariant_updates,
                linear=compressor.linear,
                caller=compressor.name,
                cast=False,
            )
        corrected = _corrected(updates, state.residual) if enabled else updates
        # `contribution` is the residual itself where the compressor returns that.
        output, contribution, inner_state = compressor.compress(
            corrected, state.inner_state, params, **extra_args
        )
        if enabled and compressor.returns_residual:
            residual = jax.tree.map(lambda r, e: r.astype(e.dtype), contribution, state.residual)
        elif enabled:
            residual = jax.tree.map(
                lambda x, c, e: (x - c.astype(x.dtype)).astype(e.dtype),
                corrected,
                contribution,
                state.residual,
            )
        else:
            residual = ()
        output = jax.tree.map(lambda o, g: o.astype(g.dtype), output, updates)
        return output, ErrorFeedbackState(
            count=jnp.asarray(optax.safe_increment(state.count)), residual=residual, inner_state=inner_state
        )

    tx = comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), "the compressor")
    _WRAPPED[tx.update] = compressor
    if compressor.codec is not None:
        base.declare_wire(tx, codec_wire(compressor.codec, enabled=enabled))
    return tx


def _corrected(updates: optax.Updates, residual: optax.Updates) -> optax.Updates:
    """``updates`` plus the residual, in the updates' dtypes."""
    return jax.tree.map(lambda g, e: (g + e.astype(g.dtype)).astype(g.dtype), updates, residual)


def codec_wire(codec: Codec, *, enabled: bool = True) -> base.Wire:
    """The :class:`jaxopt_dist._src.base.Wire` of an :func:`error_feedback` transform whose compressor's
    message is ``codec``'s: the message of the residual-corrected updates (``enabled``: a residual is kept),
    and its decoding. Both take the transform's :class:`ErrorFeedbackState`."""

    def encode(updates, state):
        corrected = _corrected(updates, state.residual) if enabled else updates
        return list(codec.encode(corrected, state.inner_state)[0])

    def decode(message, like, state):
        return jax.tree.leaves(codec.decode(list(message), like, state.inner_state)), None

    return base.Wire(encode, decode)


def residual(state: ErrorFeedbackState) -> optax.Updates:
    """The residual held in an :class:`ErrorFeedbackState` (``()`` if disabled)."""
    return state.residual


# ----------------------------------------------------------------------------
# The two-sided 1-bit all-reduce (DeepSpeed's ``compressed_allreduce``), shared by
# 1-bit Adam and 0/1 Adam: error feedback on the worker and on the server side.


def onebit_padded_size(size: int, num_workers: int) -> int:
    """``size`` rounded up to a multiple of ``n * lcm(n, 8)`` (DeepSpeed's padding).

    The length of the worker error of a leaf of ``size`` entries in
    :func:`onebit_allreduce`; its server error holds ``1 / n`` of it.
    """
    unit = num_workers * math.lcm(num_workers, 8)
    return -(-size // unit) * unit


def _sign_bits(x: jax.Array) -> jax.Array:
    """True where the 1-bit sign is -1 (``x < 0``); ``x >= 0`` (and NaN) is +1."""
    return x < 0


def _pm(neg: jax.Array) -> jax.Array:
    return jnp.where(neg, jnp.float32(-1), jnp.float32(1))


def _scale(x: jax.Array) -> jax.Array:
    return jnp.linalg.norm(x) / jnp.float32(np.sqrt(x.shape[-1]))


def _f32_bytes(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint8)


def _worker_side(m: jax.Array, error: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """(message rows ``(n, P / (8 n) + 4)`` uint8: packed signs of chunk j, then the scale; new error)."""
    size = error.shape[0]
    x = jnp.pad(jnp.ravel(m), (0, size - m.size)) + error
    scale = _scale(x)
    neg = _sign_bits(x)
    new_error = x - scale * _pm(neg)
    packed = jnp.packbits(neg.reshape(n, size // n), axis=1)
    rows = jnp.concatenate([packed, jnp.broadcast_to(_f32_bytes(scale), (n, 4))], axis=1)
    return rows, new_error


def _server_side(
    rows: jax.Array, error: jax.Array, n: int, axis_name: base.AxisName
) -> tuple[list[jax.Array], jax.Array]:
    """Received rows ``(n, chunk / 8 + 4)`` -> (server message [packed signs, scale], new server error)."""
    chunk = error.shape[0]
    signs = jnp.unpackbits(rows[:, : chunk // 8], axis=1, count=chunk)
    scales = jax.lax.bitcast_convert_type(rows[:, chunk // 8 :], jnp.float32)  # (n,)
    inv_n = jnp.float32(1.0 / n)

    def add(w, acc):
        return acc + _pm(signs[w].astype(bool)) * (scales[w] * inv_n)

    zero = comm.to_varying(jnp.zeros((chunk,), jnp.float32), axis_name)  # the rows are per-worker
    c = jax.lax.fori_loop(0, n, add, zero) + error
    scale = _scale(c)
    neg = _sign_bits(c)
    return [jnp.packbits(neg), scale], c - scale * _pm(neg)


def onebit_allreduce(
    stacks: Sequence[jax.Array],
    worker_errors: Sequence[jax.Array],
    server_errors: Sequence[jax.Array],
    num_workers: int,
    axis_name: base.AxisName,
    *,
    caller: str | None = None,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    r"""The mean of leaves over the workers through DeepSpeed's two-sided 1-bit all-reduce.

    Per leaf, each worker flattens its float32 value, pads it with zeros to
    :math:`P` entries (:func:`onebit_padded_size`), adds its worker error
    :math:`e_i` and sends :math:`x_i = \text{leaf}_i + e_i` as
    :math:`s_i \operatorname{sign}(x_i)`, :math:`s_i = \lVert x_i \rVert_2 /
    \sqrt P` (``sign(0) = +1``), keeping :math:`e_i \leftarrow x_i - s_i
    \operatorname{sign}(x_i)`. Chunk :math:`j` (:math:`P / n` entries) of every
    worker's signs goes to worker :math:`j` (one all-to-all of every leaf), which
    averages :math:`c_j = \frac1n \sum_i s_i \operatorname{sign}(x_i)_j`, adds its
    server error :math:`\epsilon_j`, compresses again with the scale
    :math:`\lVert c_j + \epsilon_j \rVert / \sqrt{P / n}` and keeps the new
    server error. The compressed chunks are all-gathered (one all-gather of
    every leaf); their concatenation, cut to the leaf's size, is the result.

    The leaves come stacked by size (see :class:`~jaxopt_dist._src.base.LeafGroups`),
    so that the work runs once per leaf size: stack ``j`` holds ``G_j`` leaves
    of ``size_j`` entries each, raveled.

    Args:
      stacks: per group, this worker's float32 leaves ``(G_j, size_j)``.
      worker_errors: per group, float32 ``(G_j, P_j)``; per-worker.
      server_errors: per group, float32 ``(G_j, P_j / n)``, the errors of the
        chunks this worker reduces; per-worker.
      num_workers: ``n``, the size of ``axis_name`` (at least 2: with one
        worker there is nothing to exchange).
      axis_name: the workers' axis.
      caller: names the transform in the unbound-axis error.

    Returns:
      ``(means, new_worker_errors, new_server_errors)``, stacked as the inputs:
      the results bit-identical on every worker (typed replicated under
      ``shard_map``), and the new errors (per-worker).
    """
    n = num_workers
    sent = [jax.vmap(lambda m, e: _worker_side(m, e, n))(m, e) for m, e in zip(stacks, worker_errors)]
    widths = [r.shape[0] * r.shape[2] for r, _ in sent]  # rows (G, n, w)
    rows = jnp.concatenate([jnp.moveaxis(r, 0, 1).reshape(n, -1) for r, _ in sent], axis=1)
    received = comm.all_to_all(rows, axis_name, caller=caller)
    payload, new_se = [], []
    for r, e in zip(base.cut(received, widths, axis=1), server_errors):
        g = e.shape[0]
        (bits, scale), e = jax.vmap(lambda x, y: _server_side(x, y, n, axis_name))(
            jnp.moveaxis(r.reshape(n, g, -1), 1, 0), e
        )
        payload += [bits, scale]
        new_se.append(e)
    gathered = comm.all_gather_packed(payload, axis_name, caller=caller)
    out = []
    for j, m in enumerate(stacks):
        bits, scales = gathered[2 * j], gathered[2 * j + 1]  # (n, G, chunk / 8), (n, G)
        signs = _pm(jnp.unpackbits(bits, axis=2, count=bits.shape[2] * 8).astype(bool))
        whole = jnp.moveaxis(signs * scales[:, :, None], 1, 0).reshape(m.shape[0], -1)
        out.append(whole[:, : m.shape[1]])
    return out, [e for _, e in sent], new_se


class OnebitLayout:
    """The flat float32 layout the 1-bit Adams step on: every leaf raveled into one buffer per
    quantity, the leaves of one size side by side (:meth:`base.LeafGroups.concat`), so that their
    elementwise maths is one kernel per operation and :func:`onebit_allreduce` runs once per leaf
    size on a run of the buffer.

    Args:
      leaves: the gradient's leaves (their shapes set the layout).
      num_workers: ``n``; the worker errors are padded to :func:`onebit_padded_size`.
    """

    def __init__(self, leaves: Sequence[Any], num_workers: int):
        self.n = num_workers
        self.shapes = [jnp.shape(x) for x in leaves]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.padded = [onebit_padded_size(s, num_workers) for s in self.sizes]
        self.groups = base.LeafGroups(list(leaves), key=jnp.size)

    def flat(self, leaves: Sequence[Any]) -> jax.Array:
        """Leaves in the layout's order, as one float32 buffer."""
        return self.groups.concat([jnp.asarray(x).astype(jnp.float32) for x in leaves])

    def leaves(self, flat: jax.Array) -> list[jax.Array]:
        """Inverse of :meth:`flat`: the leaves in leaf order and shape (float32)."""
        return self.groups.split(flat, self.shapes)

    def errors(self, worker: jax.Array, server: jax.Array) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Flat worker and server errors, back to the state's per-leaf tuples."""
        return (
            tuple(self.groups.split(worker, [(p,) for p in self.padded])),
            tuple(self.groups.split(server, [(p // self.n,) for p in self.padded])),
        )

    def allreduce(
        self, flat: jax.Array, worker: jax.Array, server: jax.Array, axis_name: base.AxisName, caller: str
    ) -> tuple[jax.Array, ...]:
        """:func:`onebit_allreduce` of a flat buffer with its flat errors: ``(mean, worker, server)``."""
        runs = onebit_allreduce(
            self.groups.runs(flat, self.sizes),
            self.groups.runs(worker, self.padded),
            self.groups.runs(server, [p // self.n for p in self.padded]),
            self.n,
            axis_name,
            caller=caller,
        )
        return tuple(self.groups.join(r) for r in runs)
