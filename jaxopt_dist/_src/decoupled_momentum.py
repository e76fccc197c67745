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


def _encode(x: jax.Array, lay: _Layout) -> jax.Array:
    """Leaf -> DCT coefficients per tile, ``(tiles, b1 * b2)``."""
    c1 = jnp.asarray(dct_matrix(lay.b1), x.dtype)
    c2 = jnp.asarray(dct_matrix(lay.b2), x.dtype)
    t = x.reshape(lay.rows // lay.b1, lay.b1, lay.cols // lay.b2, lay.b2)
    y = jnp.einsum("ij,ajbk,lk->abil", c1, t, c2, precision=_HIGHEST)
    return y.reshape(lay.tiles, lay.b1 * lay.b2)


def _decode(y: jax.Array, lay: _Layout, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`_encode`: ``C1^T Y C2`` per tile, back to the leaf's shape."""
    c1 = jnp.asarray(dct_matrix(lay.b1), y.dtype)
    c2 = jnp.asarray(dct_matrix(lay.b2), y.dtype)
    t = y.reshape(lay.rows // lay.b1, lay.cols // lay.b2, lay.b1, lay.b2)
    x = jnp.einsum("ji,abjl,lk->aibk", c1, t, c2, precision=_HIGHEST)
    return x.reshape(shape)


def _select(y: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest-magnitude coefficients of each tile (ties: lower index first)."""
    _, idx = jax.lax.top_k(jnp.abs(y), k)
    return jnp.take_along_axis(y, idx, axis=1), idx


def _scatter(tiles: int, width: int, idx: jax.Array, values: jax.Array) -> jax.Array:
    rows = jnp.arange(tiles)[:, None]
    return jnp.zeros((tiles, width), values.dtype).at[rows, idx].set(values, unique_indices=True)


def _mean_of_chosen(gathered_idx: jax.Array, gathered_val: jax.Array, lay: _Layout) -> jax.Array:
    """Per coefficient, the mean of the values of the workers that chose it (0 where none did).

    Workers are added in worker order, so every worker gets the same bits.
    """
    n = gathered_idx.shape[0]
    width = lay.b1 * lay.b2
    rows = jnp.arange(lay.tiles)[:, None]

    def body(w, carry):
        total, count = carry
        idx = gathered_idx[w].astype(jnp.int32)
        total = total.at[rows, idx].add(gathered_val[w], unique_indices=True)
        count = count.at[rows, idx].add(1, unique_indices=True)
        return total, count

    zeros = (jnp.zeros((lay.tiles, width), gathered_val.dtype), jnp.zeros((lay.tiles, width), jnp.int32))
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
        lays = [_layout(tuple(g.shape), chunk, topk) for g in g_leaves]
        new_m, payload = [], []
        for g, m, lay in zip(g_leaves, m_leaves, lays):
            d = m.dtype
            m = jnp.asarray(beta, d) * m + jnp.asarray(lr, d) * g.astype(d)
            values, idx = _select(_encode(m, lay), lay.k)
            kept = _scatter(lay.tiles, lay.b1 * lay.b2, idx, values)
            new_m.append(m - _decode(kept, lay, m.shape))
            payload += [values, idx.astype(index_dtype(lay.b1 * lay.b2))]
        gathered = comm.all_gather_packed(payload, axis_name, caller="decoupled_momentum")
        out = []
        p_leaves: list[Any] = treedef.flatten_up_to(params) if use_wd else [None] * len(g_leaves)
        wd = base.resolve(weight_decay, state.count) if use_wd else 0.0
        for j, (g, m, lay, p) in enumerate(zip(g_leaves, new_m, lays, p_leaves)):
            mean = _mean_of_chosen(gathered[2 * j + 1], gathered[2 * j], lay)
            step = -jnp.asarray(lr, m.dtype) * jnp.sign(_decode(mean, lay, m.shape))
            if use_wd:
                step = step - jnp.asarray(lr, m.dtype) * jnp.asarray(wd, m.dtype) * p.astype(m.dtype)
            out.append(step.astype(g.dtype))
        return jax.tree.unflatten(treedef, out), DecoupledMomentumState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            momentum=jax.tree.unflatten(treedef, new_m),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
