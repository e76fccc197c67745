r"""Dion: orthonormal low-rank updates with a compressed, error-fed exchange (Ahn et al. 2025).

Each matrix leaf is viewed as PyTorch's weight ``X`` (``d_out x d_in``): a
Flax kernel ``K`` of shape ``(d_in, d_out)`` is ``X^T``, and a leaf with
``ndim >= 3`` is viewed as ``(prod(shape[:-1]), shape[-1])`` (as
:func:`jaxopt_dist.powersgd` does), so ``d_in`` is the product of its leading
dimensions and ``d_out`` its last. One step, per matrix, with worker ``i``'s
momentum ``M_i`` and gradient ``G_i`` and the replicated factor ``Q``:

1. ``B_i = M_i + G_i``, oriented as ``B~_i`` (``a x b``, ``a >= b``) so that
   ``P`` lies along the longer side (a square matrix keeps PyTorch's layout);
2. ``P = orth(mean_i(B~_i Q))`` (one all-reduce for the ``P``-side products of
   every leaf, then a thin QR);
3. ``R = mean_i(B~_i^T P)`` (one all-reduce for every leaf's ``R``);
4. ``M_i <- B_i - (1 - mu) P R^T``; ``Q <- R / (colnorm(R) + eps)``;
5. output ``sqrt(d_out / d_in) P Q^T`` (new ``Q``), the same on every worker.

A matrix for which the exchange of ``P`` and ``R`` saves nothing (or every
matrix when ``rank_fraction == 1``) has its gradient averaged instead, and the
same steps run on identical data without further communication. With
``axis_name=None`` there is one worker and no collective at all: a local Dion,
e.g. as DiLoCo's inner optimizer on per-worker parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import orthonormal as ortho

__all__ = ["DionState", "dion", "dion_leaves", "scale_by_dion"]

# ----------------------------------------------------------------------------
# Static plan: how each leaf is treated, decided from its shape alone.


class _Leaf(NamedTuple):
    """How one matrix leaf goes through Dion."""

    index: int  # position in jax.tree.leaves
    d_in: int  # prod(shape[:-1])
    d_out: int  # shape[-1]
    transpose: bool  # B~ = A^T for the (d_in, d_out) view A (i.e. B~ is PyTorch's X)
    a: int  # rows of B~ (the longer side)
    b: int  # columns of B~ (the shorter side)
    rank: int
    compressed: bool  # exchange P and R; otherwise the gradient is averaged


def _rank(a: int, b: int, rank_fraction: float, rank_multiple_of: int) -> int:
    """``min(a, b, k ceil(rank_fraction min(a, b) / k))``, the reference's rounding."""
    r = rank_fraction * min(a, b)
    r = rank_multiple_of * math.ceil(r / rank_multiple_of)
    return int(min(r, a, b))


def _matrix_leaf(index: int, shape: tuple[int, ...], rank_fraction: float, rank_multiple_of: int) -> _Leaf:
    d_in, d_out = int(math.prod(shape[:-1])), int(shape[-1])
    # PyTorch's X is (d_out, d_in); the reference transposes it when d_out < d_in. Here the
    # (d_in, d_out) view A is X^T, so B~ = A^T exactly when X is not transposed.
    transpose = d_out >= d_in
    a, b = max(d_in, d_out), min(d_in, d_out)
    r = _rank(a, b, rank_fraction, rank_multiple_of)
    compressed = rank_fraction < 1 and (a + b) * r < a * b
    return _Leaf(index, d_in, d_out, transpose, a, b, r, compressed)


def _is_matrix(shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and math.prod(shape) > 0


def _mask_flags(scalar_mask: Any, tree: Any, n_leaves: int) -> list[bool]:
    """``scalar_mask`` (None, a pytree of bools or a callable on ``tree``) as one bool per leaf."""
    if scalar_mask is None:
        return [False] * n_leaves
    mask = scalar_mask(tree) if callable(scalar_mask) else scalar_mask
    treedef = jax.tree.structure(tree)
    try:
        flags = treedef.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"`scalar_mask` must be a pytree of bools with the structure of the parameters; {e}"
        ) from None
    out = []
    for f in flags:
        if not isinstance(f, (bool, np.bool_)):
            raise TypeError(f"`scalar_mask` entries must be Python bools (static); got {f!r}.")
        out.append(bool(f))
    return out


def _plan(
    leaves: list[Any], flags: list[bool], rank_fraction: float, rank_multiple_of: int
) -> list[_Leaf | None]:
    """Per leaf, its :class:`_Leaf` or None (not a matrix, or masked: it comes out as its mean)."""
    plan: list[_Leaf | None] = []
    for i, (x, masked) in enumerate(zip(leaves, flags)):
        shape = tuple(np.shape(x))
        plan.append(
            None
            if masked or not _is_matrix(shape)
            else _matrix_leaf(i, shape, rank_fraction, rank_multiple_of)
        )
    return plan


def dion_leaves(
    params: Any,
    *,
    rank_fraction: float = 1.0,
    rank_multiple_of: int = 1,
    scalar_mask: Any = None,
) -> Any:
    """How :func:`scale_by_dion` treats each leaf of ``params``: a pytree of strings.

    ``"compressed"`` (``P`` and ``R`` are exchanged), ``"dense"`` (the
    gradient is averaged, then Dion runs on identical data) or ``"mean"`` (not
    a matrix, or masked by ``scalar_mask``: the output is the mean gradient).
    """
    leaves, treedef = jax.tree.flatten(params)
    plan = _plan(leaves, _mask_flags(scalar_mask, params, len(leaves)), rank_fraction, rank_multiple_of)
    kinds = ["mean" if p is None else ("compressed" if p.compressed else "dense") for p in plan]
    return jax.tree.unflatten(treedef, kinds)


# ----------------------------------------------------------------------------
# Numerics.


def _random_q(key: jax.Array, shapes: list[tuple[int, int]], dtypes: list[Any]) -> list[jax.Array]:
    """Standard-normal ``Q``'s of the given shapes: matrix ``j`` draws from ``fold_in(key, j)``."""
    return [
        jax.random.normal(jax.random.fold_in(key, j), shape, jnp.float32).astype(dt)
        for j, (shape, dt) in enumerate(zip(shapes, dtypes))
    ]


def _oriented(x: jax.Array, leaf: _Leaf) -> jax.Array:
    """``B~`` (``a x b``) of a leaf-shaped array."""
    a = x.reshape(leaf.d_in, leaf.d_out)
    return a.T if leaf.transpose else a


def _unoriented(y: jax.Array, leaf: _Leaf, shape: tuple[int, ...]) -> jax.Array:
    """A ``B~``-shaped array back in the leaf's layout."""
    return (y.T if leaf.transpose else y).reshape(shape)


def _orth(x: jax.Array) -> jax.Array:
    """The ``Q`` of a thin QR of ``x`` (``a x r``, ``a >= r``), in at least float32."""
    return jnp.linalg.qr(x.astype(base.accumulation_dtype(x.dtype)), mode="reduced")[0].astype(x.dtype)


def _normalize_columns(r: jax.Array, eps: Any) -> jax.Array:
    """``R / (||R_col||_2 + eps)``; a zero column with ``eps == 0`` stays zero."""
    ct = base.accumulation_dtype(r.dtype)
    r32 = r.astype(ct)
    d = jnp.linalg.norm(r32, axis=0, keepdims=True) + jnp.asarray(eps, ct)
    return (r32 / jnp.where(d > 0, d, jnp.ones_like(d))).astype(r.dtype)


# ----------------------------------------------------------------------------
# One step.


class _Step(NamedTuple):
    """One step's inputs, flat in leaf order."""

    leaves: list[Any]  # the updates (gradients)
    momentum: list[Any]  # M, MaskedNode off matrices
    q: dict[int, jax.Array]  # leaf index -> Q
    mu: Any
    eps: Any


def _b(m: jax.Array, g: jax.Array) -> jax.Array:
    """``B = M + G`` in at least float32."""
    ct = base.accumulation_dtype(jnp.result_type(g))
    return m.astype(ct) + g.astype(ct)


def _finish(
    s: _Step, p: _Leaf, b: jax.Array, big_p: jax.Array, big_r: jax.Array, zero: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Guard, error feedback, new Q and output of one matrix leaf: ``(output, M, Q)``."""
    q_old = s.q[p.index]
    ct = b.dtype
    big_p = jnp.where(zero, jnp.zeros_like(big_p), big_p)
    big_r = jnp.where(zero, q_old.astype(ct), big_r)
    shape = np.shape(s.leaves[p.index])
    feedback = _unoriented(big_p @ big_r.T, p, shape)
    m = (b - (1 - jnp.asarray(s.mu, ct)) * feedback).astype(jnp.result_type(s.momentum[p.index]))
    q = _normalize_columns(big_r, s.eps)
    direction = _unoriented(big_p @ q.T, p, shape)
    out = jnp.asarray(math.sqrt(p.d_out / p.d_in), ct) * direction
    return out.astype(jnp.result_type(s.leaves[p.index])), m, q.astype(q_old.dtype)


def _dense(s: _Step, p: _Leaf, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dion on a dense leaf's mean gradient ``g``, with no more communication."""
    b = _b(s.momentum[p.index], g)
    bt = _oriented(b, p)
    x = bt @ s.q[p.index].astype(b.dtype)
    big_p = _orth(x)
    return _finish(s, p, b, big_p, bt.T @ big_p, jnp.all(x == 0))


_Exchange = Callable[[list[jax.Array]], list[jax.Array]]


def _dion_step(
    s: _Step, plan: list[_Leaf | None], share: _Exchange, reduce: _Exchange
) -> tuple[dict[int, tuple[jax.Array, jax.Array, jax.Array]], dict[int, jax.Array]]:
    """``({matrix leaf: (output, M, Q)}, {other leaf: its mean})``; ``reduce`` is the all-reduce."""
    comp = [p for p in plan if p is not None and p.compressed]
    dense = [p for p in plan if p is not None and not p.compressed]
    means = [i for i, p in enumerate(plan) if p is None]
    gs = share([s.leaves[p.index] for p in comp])
    bs = [_b(s.momentum[p.index], g) for p, g in zip(comp, gs)]
    p_local = [_oriented(b, p) @ s.q[p.index].astype(b.dtype) for p, b in zip(comp, bs)]
    # All-reduce 1: every compressed P-side product and every averaged gradient.
    reduced = reduce(p_local + [s.leaves[p.index] for p in dense] + [s.leaves[i] for i in means])
    c, d = len(comp), len(comp) + len(dense)
    p_mean, g_dense, g_means = reduced[:c], reduced[c:d], reduced[d:]
    # Compressed: orthonormalize the mean product, all-reduce 2 for every R.
    big_ps = [_orth(x) for x in p_mean]
    r_mean = reduce([_oriented(b, p).T @ bp for p, b, bp in zip(comp, bs, big_ps)]) if comp else []
    done = {
        p.index: _finish(s, p, b, bp, r, jnp.all(x == 0))
        for p, b, bp, r, x in zip(comp, bs, big_ps, r_mean, p_mean)
    }
    # Dense: the same steps on the mean gradient.
    done.update({p.index: _dense(s, p, g) for p, g in zip(dense, g_dense)})
    return done, dict(zip(means, g_means))


# ----------------------------------------------------------------------------
# The transform.


@base.reshard_rules(momentum=base.REGROUP)
class DionState(NamedTuple):
    """State for :func:`jaxopt_dist.scale_by_dion` (and the Dion part of :func:`jaxopt_dist.dion`).

    Attributes:
      count: int32[], steps taken; replicated.
      momentum: like params: ``M_i`` for every matrix leaf, in the leaf's
        dtype and shape; ``optax.MaskedNode()`` for leaves that come out as
        their mean. Per-worker for compressed leaves, replicated for dense
        ones (their gradient is averaged first). Any new grouping of the
        workers may take weighted means of the workers' momenta: the updates
        depend on them only through their mean.
      q: one ``(b, r)`` array per matrix leaf (in leaf order), ``b`` the
        shorter side of the matrix, in the leaf's dtype; replicated.

    With ``axis_name=None`` (a local Dion) ``momentum`` and ``q`` are
    per-worker.
    """

    count: jax.Array  # int32[], replicated
    momentum: optax.Updates  # like params (MaskedNode off matrices); per-worker where compressed
    q: tuple[jax.Array, ...]  # (b, r) per matrix leaf, replicated


def _check_scalar_mask(scalar_mask: Any) -> Any:
    if scalar_mask is not None and isinstance(scalar_mask, (str, bytes, int, float)):
        raise TypeError(
            "`scalar_mask` must be None, a pytree of bools like the parameters, or a callable "
            f"params -> such a pytree; got {scalar_mask!r}."
        )
    return scalar_mask


def scale_by_dion(
    rank_fraction: float = 1.0,
    *,
    rank_multiple_of: int = 1,
    mu: optax.ScalarOrSchedule = 0.95,
    eps: optax.ScalarOrSchedule = 1e-8,
    seed: int = 0,
    axis_name: base.AxisName | None = base.DEFAULT_AXIS_NAME,
    scalar_mask: Any = None,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""Dion's orthonormal low-rank direction, from each worker's local gradient.

    Takes each worker's *local* gradients. Every leaf with ``ndim >= 2`` (and
    entries) is a matrix: a Flax kernel of shape ``(d_in, d_out)``, or
    ``(prod(shape[:-1]), shape[-1])`` for ``ndim >= 3``, i.e. PyTorch's
    ``X = K^T``. With rank :math:`r = \min(a, b, k \lceil f \min(a, b) / k
    \rceil)` (``f = rank_fraction``, ``k = rank_multiple_of``, ``a >= b`` the
    sides) and :math:`\tilde B_i` worker ``i``'s :math:`B_i = M_i + G_i` oriented
    so that :math:`P` lies along the longer side (``X^T`` when ``d_out <
    d_in``, else ``X``; a square matrix is not transposed in PyTorch's layout):

    .. math::
      P = \mathrm{orth}\Big(\frac1N\sum_i \tilde B_i Q\Big), \quad
      R = \frac1N\sum_i \tilde B_i^\top P, \quad
      M_i \leftarrow B_i - (1 - \mu) P R^\top, \quad
      Q \leftarrow \frac{R}{\lVert R_{:,j} \rVert_2 + \epsilon}, \quad
      \text{out} = \sqrt{d_{out} / d_{in}}\; P Q^\top

    (the new :math:`Q`; :math:`P R^\top` and :math:`P Q^\top` transposed back to
    the leaf's layout). ``orth`` is a thin QR (``jnp.linalg.qr``); the
    reference's randomized Cholesky QR equals it up to column signs, which
    cancel in :math:`P R^\top` and :math:`P Q^\top` (``Q`` in the state is
    defined up to them too). ``Q`` starts as a standard normal draw from
    ``seed``, the same on every worker.

    The exchange of :math:`P` and :math:`R` (the *compressed* path) is used
    when ``rank_fraction < 1`` and :math:`(a + b) r < a b`. Otherwise (the
    *dense* path, and always at ``rank_fraction=1``) the gradient is first
    averaged over the workers and the same steps run on identical data with no
    further communication, so :math:`M` is replicated. On the compressed path
    the map is linear in the :math:`B_i`: the output and :math:`\frac1N\sum_i
    M_i` evolve exactly as one-worker Dion fed the mean gradient. At full rank
    :math:`P R^\top = B` and the momentum is Muon's, :math:`B_t = \mu B_{t-1} +
    G_t`.

    **Zero guard.** Where :math:`\frac1N\sum_i \tilde B_i Q` is exactly zero
    (in particular whenever every worker's :math:`B_i` is zero), the step sets
    :math:`P = 0` and :math:`R = Q_{old}`: the output is zero, :math:`M_i
    \leftarrow B_i` and :math:`Q \leftarrow Q_{old} / (\lVert Q_{old,:,j}
    \rVert + \epsilon)`, with no NaN; this is the reference's rule where it fires
    on every worker. The decision is taken on that replicated product, so
    replicas stay bit-identical: the reference tests each worker's local
    :math:`B_i` and zeroes :math:`P` on that worker alone, which lets its copy
    of the parameters drift; here a worker whose own :math:`B_i` is zero just
    adds zero to the means. Column norms divide safely (a zero column stays
    zero, even with ``eps=0``).

    **Other leaves.** Leaves with ``ndim < 2`` (biases, norms, scalars), empty
    leaves and leaves marked by ``scalar_mask`` come out as their mean over the
    workers, averaged in the first all-reduce; so ``scale_by_dion`` alone is a
    complete distributed transform, and :func:`dion` sends those leaves on to
    its scalar optimizer. Follow it with a learning rate (and weight decay),
    e.g. ``optax.chain(scale_by_dion(0.25), optax.add_decayed_weights(0.01),
    optax.scale_by_learning_rate(0.01))``, or use :func:`dion`.

    **Per-worker parameters.** The output is the same on every worker, so it
    suits replicated parameters. Under ``jax.shard_map(check_vma=True)``,
    ``params`` typed varying over ``axis_name`` (e.g.
    ``data_parallel_step(..., per_worker_params=True)``) raise a
    ``ValueError``: their differences would never be reconciled (under
    ``vmap``, or when ``params`` is not passed, this cannot be seen). With
    ``axis_name=None`` Dion is local: what a one-worker axis computes, with
    no collectives, e.g. as the inner optimizer of :func:`jaxopt_dist.diloco`
    on per-worker parameters.

    Arithmetic runs in at least float32; updates keep their dtype; ``M`` and
    ``Q`` are stored in the leaf's dtype (the reference's default). ``float0``
    gradient leaves (integer parameters) pass through untouched.

    Args:
      rank_fraction: ``r / min(a, b)`` before rounding, in ``(0, 1]``. A Python
        float (it sets shapes); under :func:`optax.inject_hyperparams` list it in
        ``static_args``, with ``rank_multiple_of`` and ``seed``.
      rank_multiple_of: round the rank up to a multiple of this (then clip).
      mu: the momentum factor :math:`\mu` (error-feedback decay), in ``[0, 1]``;
        a float or a schedule.
      eps: added to the column norms of :math:`R`; a float or a schedule.
      seed: seed of the initial ``Q``'s.
      axis_name: the mapped axis (or tuple of axes) of the workers. None:
        one worker, no communication (e.g. as DiLoCo's inner optimizer): a
        one-worker run's maths, with the output, ``momentum`` and ``q``
        per-worker.
      scalar_mask: None, a pytree of bools like the parameters, or a callable
        taking the parameters (or updates: only their structure and shapes are
        read) and returning one: True marks a matrix leaf to come out as its
        mean instead (e.g. an embedding or output head).
      invariant_updates: what an update leaf typed invariant under
        ``jax.shard_map(check_vma=True)`` stands for: ``"sum"`` (the gradient of
        replicated parameters, the default) or ``"mean"``; ``"error"``
        rejects it. Dion depends on the workers' gradients only through their
        mean, so each worker takes its share. Unused when ``axis_name`` is
        None (the updates are taken as they come).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`DionState`.

    Communication:
      With ``N`` workers, ``C`` the compressed matrices (``a x b``, rank ``r``),
      ``D`` the dense matrices, ``S`` the other leaves and ``w`` bytes per
      element: at most two all-reduces per step, each of one flat buffer per
      dtype. The first carries every compressed matrix's ``B~_i Q`` (``a r``
      floats, at least float32) and the gradients of ``D`` and ``S`` (in their
      dtypes); the second every compressed matrix's ``B~_i^T P`` (``b r``). With
      no compressed matrix there is one all-reduce. A ring all-reduce moves
      ``2 (N - 1) / N`` times its payload per worker: in total ``2 (N - 1) / N
      (4 sum_C (a + b) r + w sum_{D, S} size)`` bytes, ``2 rank_fraction`` of a
      dense all-reduce for a large square matrix. The output is replicated;
      ``count`` and ``q`` are replicated; ``momentum`` is per-worker on
      compressed matrices and replicated on dense ones. With
      ``axis_name=None``: no collectives; the output, ``momentum`` and ``q``
      are per-worker (local), ``count`` replicated.

    Sharded parameters:
      Decided by shape, so a run with parameters sharded over model axes
      computes what a replicated run does (to float rounding: the compiler
      splits the matmuls over the sharded dimensions). ``momentum`` is sharded
      like its parameter, ``q`` replicated over the model axes.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> tx = jd.scale_by_dion(0.25)
      >>> grads = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 16))  # 4 workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> out = jax.vmap(step, axis_name="data")(grads)
      >>> bool(jnp.all(out == out[:1]))  # the same on every worker
      True
      >>> # 4 orthonormal directions, scaled by sqrt(16 / 16):
      >>> round(float(jnp.linalg.matrix_rank(out[0])))
      4

    References:
      Ahn et al, `Dion: Distributed Orthonormalized Updates
      <https://arxiv.org/abs/2504.05295>`_, 2025
    """
    name = "scale_by_dion"
    axis_name = base.validate_axis_name(axis_name, allow_none=True)
    rank_fraction = base.check_fraction(rank_fraction, "rank_fraction")
    rank_multiple_of = base.check_positive_int(rank_multiple_of, "rank_multiple_of")
    base.check_hyperparameter(mu, "mu", lower=0.0, upper=1.0)
    base.check_hyperparameter(eps, "eps", lower=0.0)
    seed = base.check_seed(seed)
    scalar_mask = _check_scalar_mask(scalar_mask)
    invariant_updates = comm.check_invariant_mode(invariant_updates)

    def plan_of(tree):
        leaves = jax.tree.leaves(tree)
        flags = _mask_flags(scalar_mask, tree, len(leaves))
        return _plan(leaves, flags, rank_fraction, rank_multiple_of)

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        plan = plan_of(params)
        dtypes = [_state_dtype(x) for x in leaves]
        momentum = [
            optax.MaskedNode() if p is None else jnp.zeros(np.shape(x), dt)
            for x, p, dt in zip(leaves, plan, dtypes)
        ]
        mats = [p for p in plan if p is not None]
        q = _random_q(
            jax.random.PRNGKey(seed), [(p.b, p.rank) for p in mats], [dtypes[p.index] for p in mats]
        )
        return DionState(
            count=jnp.zeros([], jnp.int32), momentum=jax.tree.unflatten(treedef, momentum), q=tuple(q)
        )

    def reduce(arrays: list[jax.Array]) -> list[jax.Array]:
        if axis_name is None:
            return arrays
        kw: dict[str, Any] = dict(flatten=True, caller=name, invariant_updates=invariant_updates)
        if any(comm.reduced_axes(arrays, axis_name)):  # some arrived reduced: comm.reduce sorts them out
            return comm.reduce(arrays, axis_name, **kw)
        # One flat buffer per dtype, cut back at offsets hidden from the compiler (base.unpack).
        return base.by_dtype(arrays, lambda flat: comm.reduce(flat, axis_name, **kw))

    def share(arrays: list[jax.Array]) -> list[jax.Array]:
        # Compressed leaves: each worker's share of the gradient (leaves that arrived already
        # reduced are split evenly, which is exact since Dion is linear in the B_i).
        if axis_name is None:
            return arrays
        return comm.per_worker_share(arrays, axis_name, invariant_updates=invariant_updates, caller=name)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if axis_name is not None:
            comm.require_axis(axis_name, name)
        ortho.check_replicated_params(params, axis_name, name, "Dion")
        leaves, treedef = jax.tree.flatten(updates)
        plan = plan_of(updates)
        mats = [p for p in plan if p is not None]
        momentum = treedef.flatten_up_to(state.momentum)
        step = _Step(
            leaves=leaves,
            momentum=momentum,
            q={p.index: q for p, q in zip(mats, state.q)},
            mu=base.resolve(mu, state.count),
            eps=base.resolve(eps, state.count),
        )
        done, means = _dion_step(step, plan, share, reduce)
        out = [means[i] if p is None else done[i][0] for i, p in enumerate(plan)]
        new_m = [m if p is None else done[i][1] for i, (p, m) in enumerate(zip(plan, momentum))]
        new_state = DionState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            momentum=jax.tree.unflatten(treedef, new_m),
            q=tuple(done[p.index][2] for p in mats),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), name)


def _state_dtype(x: Any) -> Any:
    """The dtype of a leaf's ``M`` and ``Q``: its own if floating, else float32 (integer params)."""
    dt = jnp.result_type(x)
    return dt if jnp.issubdtype(dt, jnp.inexact) else jnp.float32


def _default_scalar_optimizer(learning_rate, weight_decay, eps) -> optax.GradientTransformation:
    """AdamW with betas (0.9, 0.95), the reference's scalar optimizer."""
    adam_eps = float(eps) if base.is_python_number(eps) else 1e-8
    return optax.adamw(learning_rate, b1=0.9, b2=0.95, eps=adam_eps, weight_decay=weight_decay)


def dion(
    learning_rate: optax.ScalarOrSchedule,
    *,
    rank_fraction: float = 1.0,
    rank_multiple_of: int = 1,
    mu: optax.ScalarOrSchedule = 0.95,
    weight_decay: optax.ScalarOrSchedule = 0.01,
    eps: optax.ScalarOrSchedule = 1e-8,
    scalar_optimizer: optax.GradientTransformation | None = None,
    scalar_mask: Any = None,
    seed: int = 0,
    axis_name: base.AxisName | None = base.DEFAULT_AXIS_NAME,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""The Dion optimizer: Dion on matrices, a scalar optimizer on the mean gradient elsewhere.

    Takes each worker's *local* gradients and returns the final updates (use
    it alone, not after an all-reduce). Matrix leaves (``ndim >= 2``, not
    marked by ``scalar_mask``) get :func:`scale_by_dion`'s direction and
    decoupled weight decay,

    .. math::
      X \leftarrow (1 - \eta \lambda) X - \eta \sqrt{d_{out} / d_{in}}\, P Q^\top,

    i.e. the update ``-lr (direction + weight_decay X)``. Every other leaf
    (biases, norms, scalars, and the leaves ``scalar_mask`` marks: by the
    paper's recommendation the embedding and the output head) is averaged over
    the workers in the same all-reduce as Dion's first exchange and goes
    through ``scalar_optimizer``: by default AdamW with ``betas=(0.9, 0.95)``,
    ``eps`` and this ``weight_decay`` and ``learning_rate``, as the reference's
    ``Dion(..., betas=(0.9, 0.95))`` scalar groups (``optax.adamw``; with a
    scheduled ``eps`` the AdamW ``eps`` is 1e-8). The updates and the
    parameters stay bit-identical on every worker.

    The parameters are meant to be replicated (the default of
    :func:`jaxopt_dist.data_parallel_step`): every worker applies the same
    update, and the weight decay reads its own copy. Per-worker parameters
    (``per_worker_params=True``) would keep their differences forever, so
    under ``jax.shard_map(check_vma=True)`` parameters typed varying over
    ``axis_name`` raise a ``ValueError`` (under ``vmap`` nothing tells them
    apart: that is left to the caller). For per-worker parameters use
    ``axis_name=None``: a local Dion on each worker, with no communication,
    e.g. as the inner optimizer of :func:`jaxopt_dist.diloco` (DiLoCo, or
    MuLoCo with ``aggregate=jaxopt_dist.statistical_quantize(2)``). Gradients
    averaged before :func:`dion` (e.g. after :func:`jaxopt_dist.all_reduce`)
    give the same updates, only with the exchange wasted.

    Defaults are the reference's (``lr=0.01, mu=0.95, weight_decay=0.01,
    eps=1e-8, rank_fraction=1.0``); its recipes use ``rank_fraction`` 0.25 to
    0.5.

    Args:
      learning_rate: :math:`\eta`, a float or a schedule (for both parts when
        ``scalar_optimizer`` is None).
      rank_fraction: see :func:`scale_by_dion` (static).
      rank_multiple_of: see :func:`scale_by_dion` (static).
      mu: the momentum factor; a float or a schedule.
      weight_decay: :math:`\lambda`, decoupled (multiplied by the learning
        rate); a float or a schedule.
      eps: added to the column norms of ``R`` (and AdamW's ``eps``).
      scalar_optimizer: an optax transformation for the other leaves, fed
        their mean gradient; it receives the parameters (masked).
      scalar_mask: None, a pytree of bools like the parameters, or a callable
        params -> such a pytree: True sends a matrix leaf to the scalar
        optimizer too.
      seed: seed of the initial ``Q``'s.
      axis_name: the mapped axis (or tuple of axes) of the workers. None:
        one worker, no communication (e.g. as DiLoCo's inner optimizer,
        ``jd.diloco(jd.dion(0.01, rank_fraction=0.25, axis_name=None),
        sync_every=H)``, on per-worker parameters).
      invariant_updates: see :func:`scale_by_dion`.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`. Its state is the
      ``optax.chain`` pair ``(DionState, partition state)``, the latter an
      :func:`optax.partition` state with labels ``"dion"`` (the weight decay
      and learning-rate scaling) and ``"scalar"`` (the scalar optimizer).

    Communication:
      That of :func:`scale_by_dion`, with the scalar leaves in its first
      all-reduce: one or two all-reduces per step (two when some matrix is
      compressed). The scalar optimizer runs on replicated inputs and
      communicates nothing. Outputs, ``count``, ``q`` and the scalar
      optimizer's state are replicated; ``momentum`` is per-worker on
      compressed matrices. With ``axis_name=None``: no collectives; the
      outputs and the states' arrays are per-worker (local), the counts
      replicated.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
      >>> tx = jd.dion(0.01, rank_fraction=0.25)
      >>> grads = jax.tree.map(lambda x: jnp.stack([x, -0.5 * x, x]), params)  # 3 workers
      >>> step = lambda g: tx.update(g, tx.init(params), params)[0]
      >>> updates = jax.vmap(step, axis_name="data")(grads)
      >>> jax.tree.map(lambda u: u.shape, updates)
      {'b': (3, 8), 'w': (3, 16, 8)}

    References:
      Ahn et al, `Dion: Distributed Orthonormalized Updates
      <https://arxiv.org/abs/2504.05295>`_, 2025
    """
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    if scalar_optimizer is not None and not isinstance(scalar_optimizer, optax.GradientTransformation):
        raise TypeError(
            f"`scalar_optimizer` must be an optax.GradientTransformation or None; got {scalar_optimizer!r}."
        )
    core = scale_by_dion(
        rank_fraction,
        rank_multiple_of=rank_multiple_of,
        mu=mu,
        eps=eps,
        seed=seed,
        axis_name=axis_name,
        scalar_mask=scalar_mask,
        invariant_updates=invariant_updates,
    )
    if scalar_optimizer is None:
        scalar_optimizer = _default_scalar_optimizer(learning_rate, weight_decay, eps)
    matrix_tx = optax.chain(
        optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate)
    )

    def labels(tree: Any) -> Any:
        kinds = dion_leaves(
            tree, rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of, scalar_mask=scalar_mask
        )
        return jax.tree.map(lambda k: "scalar" if k == "mean" else "dion", kinds)

    tx = optax.chain(core, optax.partition({"dion": matrix_tx, "scalar": scalar_optimizer}, labels))
    return comm.float_updates(tx, "dion")
