r"""DeMo: decoupled momentum optimization with DCT compression of the momentum.

Each worker accumulates its own momentum of the learning-rate-scaled
gradients; at every step it extracts the fast components of that momentum
with a blockwise DCT-II, keeps the ``topk`` largest coefficients of each
block, removes them from its momentum, and sends them (values and indices)
to every worker with one all-gather. Every worker averages the coefficients
each worker chose, decodes them with the inverse DCT and steps by the sign of
the result. This is bloc97/DeMo's ``DeMo`` optimizer (SGD variant).

Leaf layout (shapes are static, so all of this is decided at trace time):

* A leaf is seen as a matrix ``(R, C)``: a 2-D leaf as is; a 1-D leaf of
  ``d`` entries as ``(1, d)``; a scalar as ``(1, 1)``; a leaf of rank ``>= 3``
  (a convolution kernel ``(H, W, I, O)``) as ``(prod(shape[:-1]), shape[-1])``,
  the row-major reshape that keeps the last (output-feature) axis.
* The block size along an axis of size ``s`` is the largest divisor of ``s``
  that is at most ``chunk``: no padding, so ``96 -> 48``, ``80 -> 40`` and a
  prime ``97 -> 1``. A ``(1, d)`` leaf is therefore cut into runs with a 1-D
  DCT per run (the reference's 1-D case), a matrix into tiles ``b1 x b2`` with
  the 2-D DCT :math:`C_1 B C_2^\top`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------
# Layout and the DCT.


def block_size(size: int, chunk: int) -> int:
    """The largest divisor of ``size`` that is at most ``chunk`` (DeMo's block size)."""
    return max(d for d in range(1, min(size, chunk) + 1) if size % d == 0)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(R, C)`` matrix a leaf of ``shape`` is compressed as (see the module docstring)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return math.prod(shape[:-1]), int(shape[-1])


def dct_matrix(size: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``C`` (float64): ``C @ x`` is ``scipy.fft.dct(x, norm="ortho")``."""
    k = np.arange(size)[:, None]
    i = np.arange(size)[None, :]
    c = np.cos(np.pi * (2 * i + 1) * k / (2 * size)) * np.sqrt(2.0 / size)
    c[0] /= np.sqrt(2.0)
    return c


def index_dtype(tile: int) -> Any:
    """The smallest unsigned integer type that holds an index into a tile of ``tile`` entries."""
    if tile <= 2**8:
        return jnp.uint8
    if tile <= 2**16:
        return jnp.uint16
    return jnp.uint32


class _Layout(NamedTuple):
    rows: int  # R
    cols: int  # C
    b1: int  # block rows
    b2: int  # block cols
    k: int  # coefficients kept per tile

    @property
    def tiles(self) -> int:
        return (self.rows // self.b1) * (self.cols // self.b2)


def _layout(shape: tuple[int, ...], chunk: int, topk: int) -> _Layout:
    rows, cols = matrix_shape(shape)
    b1, b2 = block_size(rows, chunk), block_size(cols, chunk)
    return _Layout(rows, cols, b1, b2, min(topk, b1 * b2))


def _to_tiles(x: jax.Array, lay: _Layout) -> jax.Array:
    """Leaves of one shape, stacked along a leading axis, -> their tiles ``(tiles, b1, b2)``, leaf after leaf."""
    t = x.reshape(-1, lay.rows // lay.b1, lay.b1, lay.cols // lay.b2, lay.b2)
    return t.transpose(0, 1, 3, 2, 4).reshape(-1, lay.b1, lay.b2)


def _from_tiles(t: jax.Array, lay: _Layout, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`_to_tiles`, back to ``shape`` (the stacked leaves' shape)."""
    x = t.reshape(-1, lay.rows // lay.b1, lay.cols // lay.b2, lay.b1, lay.b2)
    return x.transpose(0, 1, 3, 2, 4).reshape(shape)


def _encode(t: jax.Array) -> jax.Array:
    """Tiles ``(T, b1, b2)`` -> their DCT coefficients ``C_1 B C_2^T``, ``(T, b1 * b2)``."""
    b1, b2 = t.shape[1:]
    c1, c2 = jnp.asarray(dct_matrix(b1), t.dtype), jnp.asarray(dct_matrix(b2), t.dtype)
    return jnp.einsum("ij,tjk,lk->til", c1, t, c2, precision=_HIGHEST).reshape(-1, b1 * b2)


def _decode(y: jax.Array, b1: int, b2: int) -> jax.Array:
    """Inverse of :func:`_encode`: ``C_1^T Y C_2`` per tile, ``(T, b1, b2)``."""
    c1, c2 = jnp.asarray(dct_matrix(b1), y.dtype), jnp.asarray(dct_matrix(b2), y.dtype)
    return jnp.einsum("ji,tjl,lk->tik", c1, y.reshape(-1, b1, b2), c2, precision=_HIGHEST)


def _select(y: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest-magnitude coefficients of each tile (ties: lower index first)."""
    _, idx = jax.lax.top_k(jnp.abs(y), k)
    return jnp.take_along_axis(y, idx, axis=1), idx


def _scatter(tiles: int, width: int, idx: jax.Array, values: jax.Array) -> jax.Array:
    rows = jnp.arange(tiles)[:, None]
    return jnp.zeros((tiles, width), values.dtype).at[rows, idx].set(values, unique_indices=True)


class _Stack(NamedTuple):
    """Leaves of one shape and dtype stacked (their momentum), and how they are tiled."""

    m: jax.Array  # (leaves, *shape)
    lay: _Layout


def _cut(per_tile_group: list[jax.Array], tiles: base.LeafGroups, stacks: list[_Stack]) -> list[jax.Array]:
    """Per stack, its tiles' rows of the arrays computed per tile shape (``tiles``' groups)."""
    out: list[Any] = [None] * tiles.count
    for ids, x in zip(tiles.groups, per_tile_group):
        start = 0
        for i in ids:
            count = stacks[i].lay.tiles * stacks[i].m.shape[0]
            out[i] = x[start : start + count]
            start += count
    return out


def _choose(tiles: base.LeafGroups, stacks: list[_Stack]) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per tile shape, the chosen coefficients (values, indices) to send; per stack, the tiles they decode to."""
    payload, kept = [], []
    for ids in tiles.groups:
        lay = stacks[ids[0]].lay
        values, idx = _select(
            _encode(jnp.concatenate([_to_tiles(stacks[i].m, stacks[i].lay) for i in ids])), lay.k
        )
        kept.append(_decode(_scatter(values.shape[0], lay.b1 * lay.b2, idx, values), lay.b1, lay.b2))
        payload += [values, idx.astype(index_dtype(lay.b1 * lay.b2))]
    return payload, _cut(kept, tiles, stacks)


def _means(tiles: base.LeafGroups, stacks: list[_Stack], gathered: list[jax.Array]) -> list[jax.Array]:
    """Per stack, the decoded tiles of the mean of the chosen coefficients (see :func:`_mean_of_chosen`)."""
    out = []
    for j, ids in enumerate(tiles.groups):
        lay = stacks[ids[0]].lay
        out.append(_decode(_mean_of_chosen(gathered[2 * j + 1], gathered[2 * j], lay), lay.b1, lay.b2))
    return _cut(out, tiles, stacks)


def _mean_of_chosen(gathered_idx: jax.Array, gathered_val: jax.Array, lay: _Layout) -> jax.Array:
    """Per coefficient, the mean of the values of the workers that chose it (0 where none did).

    ``gathered_idx`` and ``gathered_val`` are ``(n, tiles, k)``, tiles of one
    leaf or of several stacked. Workers are added in worker order, so every
    worker gets the same bits.
    """
    n, tiles = gathered_idx.shape[:2]
    width = lay.b1 * lay.b2
    rows = jnp.arange(tiles)[:, None]

    def body(w, carry):
        total, count = carry
        idx = gathered_idx[w].astype(jnp.int32)
        total = total.at[rows, idx].add(gathered_val[w], unique_indices=True)
        count = count.at[rows, idx].add(1, unique_indices=True)
        return total, count

    zeros = (jnp.zeros((tiles, width), gathered_val.dtype), jnp.zeros((tiles, width), jnp.int32))
    total, count = jax.lax.fori_loop(0, n, body, zeros)
    safe = jnp.maximum(count, 1).astype(total.dtype)
    return jnp.where(count > 0, total / safe, jnp.zeros_like(total))


# ----------------------------------------------------------------------------
# The transform.


@base.reshard_rules()
class DecoupledMomentumState(NamedTuple):
    """State for :func:`jaxopt_dist.decoupled_momentum`.

    Attributes:
      count: int32[], steps taken (evaluates schedules); replicated.
      momentum: this worker's momentum, what it has not sent yet, like params
        in at least float32; per-worker.
    """

    count: jax.Array  # int32[], replicated
    momentum: optax.Updates  # like params (>= float32), per-worker


def decoupled_momentum(
    learning_rate: optax.ScalarOrSchedule,
    *,
    decay: optax.ScalarOrSchedule = 0.999,
    chunk: int = 64,
    topk: int = 32,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""DeMo (decoupled momentum): DCT top-k of each worker's momentum, sign of the decoded mean.

    Takes each worker's *local* gradients :math:`g_i` (no all-reduce before
    it) and returns the final updates; use it alone, not followed by an
    optimizer. With :math:`\eta` the learning rate, :math:`\beta` ``decay``,
    :math:`\lambda` ``weight_decay``, per leaf and per worker :math:`i`:

    .. math::
      m_i \leftarrow \beta m_i + \eta g_i, \quad
      (s_i, c_i) = \operatorname{top}_k(\operatorname{DCT}(m_i)), \quad
      m_i \leftarrow m_i - \operatorname{DCT}^{-1}(c_i),

    where :math:`\operatorname{top}_k` keeps the ``min(topk, b1 * b2)``
    largest-magnitude coefficients of every DCT tile (index set :math:`s_i`,
    values :math:`c_i`). Every worker receives every :math:`(s_i, c_i)`;
    each coefficient is the **mean over the workers that chose it** (zero
    where none did), :math:`\bar c`, and

    .. math::
      u = -\eta \lambda p - \eta \operatorname{sign}(\operatorname{DCT}^{-1}(\bar c)),

    the same bits on every worker (weight decay first, as
    ``p *= 1 - lr * wd`` in the reference). Leaves of any rank are handled as
    matrices and cut into blocks as the module docstring explains
    (:func:`block_size`, :func:`matrix_shape`); the DCT is the orthonormal
    DCT-II (:func:`dct_matrix`). The momentum is kept in at least float32 and
    the coefficients travel in that dtype.

    Args:
      learning_rate: :math:`\eta`, a float or an optax schedule.
      decay: :math:`\beta`, the momentum decay, in [0, 1]; float or schedule.
      chunk: the largest block size along each axis (Python int >= 1).
      topk: coefficients kept per block (Python int >= 1; at most the block's
        size are kept).
      weight_decay: :math:`\lambda \ge 0`, decoupled weight decay; float or
        schedule. Needs ``params`` in ``update`` when not zero.
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`DecoupledMomentumState`. ``chunk`` and ``topk`` fix shapes:
      under :func:`optax.inject_hyperparams` list them in ``static_args``.

    Communication:
      One all-gather per step of a uint8 buffer of
      ``B = sum_l T_l k_l (v_l + c_l)`` bytes per worker: for each leaf its
      ``T_l`` tiles, ``k_l = min(topk, b1 b2)`` values each in the momentum's
      dtype (``v_l = 4`` for float32) and as many tile-local indices in the
      smallest unsigned type that holds ``b1 b2`` (:func:`index_dtype`:
      ``c_l = 1`` up to 256 entries per tile, 2 up to 65536, else 4). Each
      worker sends ``B`` bytes and receives ``(n - 1) B``. With the defaults
      a 64x64 tile sends 32 of 4096 coefficients, 6 bytes each. Outputs and
      ``count`` are replicated; the momentum is per-worker.

    Sharded parameters:
      Needs whole leaves: the DCT and the top-k run on the tiles of a leaf's
      matrix view, and the chosen coefficients travel in one buffer, so the
      compiler assembles tiles and payload over the model axes (the momentum
      stays sharded like its parameter). The all-gather above runs over the
      data axis, per replica; the output is that of replicated parameters, to
      float rounding of the DCT.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.decoupled_momentum(0.1, chunk=2, topk=1)
      >>> g = jnp.array([[1.0, 1.0, 4.0, 0.0], [1.0, 1.0, 0.0, -2.0]])  # two workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(g)[0]
      Array([-0.1, -0.1, -0.1, -0.1], dtype=float32)

    References:
      Peng, Quesnelle and Kingma, `DeMo: Decoupled Momentum Optimization
      <https://arxiv.org/abs/2411.19870>`_, 2024 (reference code bloc97/DeMo)
    """
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)
    base.check_hyperparameter(decay, "decay", lower=0.0, upper=1.0)
    chunk = base.check_positive_int(chunk, "chunk")
    topk = base.check_positive_int(topk, "topk")
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    axis_name = base.validate_axis_name(axis_name)
    use_wd = not base.is_constant(weight_decay, 0.0)

    def init_fn(params):
        return DecoupledMomentumState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), base.accumulation_dtype(p.dtype)), params
            ),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        comm.require_axis(axis_name, "decoupled_momentum")
        if use_wd and params is None:
            raise ValueError(base.no_params_message("decoupled_momentum", "with weight_decay"))
        lr = base.resolve(learning_rate, state.count)
        beta = base.resolve(decay, state.count)
        g_leaves, treedef = jax.tree.flatten(updates)
        m_leaves = treedef.flatten_up_to(state.momentum)
        # Leaves of one shape and dtype are stacked, and the tiles of one shape and dtype
        # concatenated over those stacks: the DCT, the top-k and the mean run once per tile shape.
        leaves = base.LeafGroups(m_leaves)
        stacks = []
        for g, m in zip(leaves.stack(g_leaves), leaves.stack(m_leaves)):
            m = jnp.asarray(beta, m.dtype) * m + jnp.asarray(lr, m.dtype) * g.astype(m.dtype)
            stacks.append(_Stack(m, _layout(tuple(m.shape[1:]), chunk, topk)))
        tiles = base.LeafGroups(stacks, key=lambda st: (st.lay.b1, st.lay.b2, st.lay.k, st.m.dtype))
        payload, kept = _choose(tiles, stacks)
        gathered = comm.all_gather_packed(payload, axis_name, caller="decoupled_momentum")
        means = _means(tiles, stacks, gathered)
        new_m = [st.m - _from_tiles(k, st.lay, st.m.shape) for st, k in zip(stacks, kept)]
        lr_step = [
            -jnp.asarray(lr, st.m.dtype) * _from_tiles(jnp.sign(x), st.lay, st.m.shape)
            for st, x in zip(stacks, means)
        ]
        out = []
        wd = base.resolve(weight_decay, state.count) if use_wd else 0.0
        p_leaves: list[Any] = treedef.flatten_up_to(params) if use_wd else [None] * len(g_leaves)
        for g, step, p in zip(g_leaves, leaves.unstack(lr_step), p_leaves):
            if use_wd:
                step = step - jnp.asarray(lr, step.dtype) * jnp.asarray(wd, step.dtype) * p.astype(step.dtype)
            out.append(step.astype(g.dtype))
        return jax.tree.unflatten(treedef, out), DecoupledMomentumState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            momentum=jax.tree.unflatten(treedef, leaves.unstack(new_m)),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
