"""Sparsification with error feedback: top-k, threshold, random-k and block-k.

Each worker sends a few entries of its (residual-corrected) updates; every
worker rebuilds the mean of what was sent, bit-identical on all of them, and
keeps the entries it did not send in its error-feedback residual
(:func:`jaxopt_dist.error_feedback`).

* :func:`top_k` and :func:`threshold` choose entries per worker, so values and
  their int32 indices travel together in one all-gather (SINGA's ``topK`` and
  absolute-threshold sparsification).
* :func:`random_k` and :func:`block_k` choose the same entries on every worker
  from a key held in the state, so only the values travel, through a plain
  all-reduce (mlbench's random and blockwise sparsified SGD).

Sizes. ``k`` (or ``density``, the fraction of entries) is applied per leaf: a
leaf of ``d`` entries sends ``k_l = k``, or ``k_l = max(1, ceil(density * d))``,
of them. A leaf with ``d <= k_l`` is *sent dense*: all its entries go through
one fused all-reduce (mean), which is cheaper than values plus indices.

Learning rates. Error feedback delays an entry until it is sent, up to about
``d / k`` steps for random choices; a momentum applied *after* the compressor
(``chain(top_k(...), sgd(lr, momentum=0.9))``) integrates these delayed bursts
and can diverge at a learning rate dense training tolerates. Use a smaller
learning rate, no momentum (as mlbench's sparsified SGD), or a per-worker
momentum *before* the compressor
(``chain(scale_by_momentum(0.9), top_k(...), sgd(lr))``, the momentum
correction of Deep Gradient Compression, Lin et al. 2018).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm, selection
from jaxopt_dist._src import error_feedback as ef

# ----------------------------------------------------------------------------
# Sizes and validation.


def _check_k_density(k: Any, density: Any, caller: str) -> None:
    if (k is None) == (density is None):
        raise ValueError(
            f"`{caller}` needs exactly one of `k` and `density`; got k={k!r}, density={density!r}."
        )
    if k is not None:
        base.check_positive_int(k, "k")
        return
    if callable(density) or not base.is_python_number(density):
        raise TypeError(
            "`density` must be a Python float in (0, 1]: it sets array shapes, so it cannot be "
            "scheduled or traced (with optax.inject_hyperparams, list it in static_args); "
            f"got {density!r}."
        )
    if not (math.isfinite(float(density)) and 0.0 < float(density) <= 1.0):
        raise ValueError(f"`density` must lie in (0, 1]; got {density!r}.")


def _count(d: int, k: int | None, density: float | None) -> int:
    """Entries a ``d``-entry block sends: ``k`` or ``max(1, ceil(density * d))``."""
    if k is not None:
        return k
    assert density is not None
    return min(d, max(1, math.ceil(density * d - 1e-6)))


def _leaf_plan(sizes: Sequence[int], k: int | None, density: float | None, caller: str) -> list[int | None]:
    """Per leaf: the number of entries sent, or None where the leaf goes dense."""
    if k is not None and sizes and k > max(sizes):
        raise ValueError(
            f"`{caller}`: `k`={k} exceeds the size of the largest leaf ({max(sizes)} entries). "
            "Leaves with at most k entries are sent dense, so nothing would be compressed; "
            f"use k <= {max(sizes)} or `density`."
        )
    plan: list[int | None] = []
    for d in sizes:
        kl = _count(d, k, density)
        plan.append(kl if kl < d else None)
    return plan


def _flat_plan(total: int, k: int | None, density: float | None, caller: str) -> int | None:
    if k is not None and k > total:
        raise ValueError(
            f"`{caller}`: `k`={k} exceeds the total number of entries of the updates ({total}); "
            f"use k <= {total} or `density`."
        )
    kk = _count(total, k, density)
    return kk if kk < total else None


# ----------------------------------------------------------------------------
# Leaves of one shape, stacked: every per-leaf step (selection, scatter, drop)
# runs once per shape on a ``(leaves, d)`` array, so the compiled update grows
# with the number of distinct leaf shapes, not with the number of leaves.


class _Layout(NamedTuple):
    """A tree's leaves grouped by shape, dtype and replication (see :func:`_layout`)."""

    groups: base.LeafGroups
    leaves: list[Any]
    treedef: Any

    def sizes(self) -> list[int]:
        """Per group, the entries of each of its leaves."""
        return [math.prod(np.shape(self.leaves[ids[0]])) for ids in self.groups.groups]

    def stack(self) -> list[jax.Array]:
        """Per group, its leaves flattened and stacked in leaf order: ``(leaves in the group, d)``."""
        return [jnp.stack([jnp.ravel(self.leaves[i]) for i in ids]) for ids in self.groups.groups]

    def tree(self, per_group: Sequence[jax.Array]) -> Any:
        """Per group a ``(leaves, d)`` array -> a tree like the leaves (their shapes and dtypes)."""
        return _unflatten(self.treedef, self.leaves, self.groups.unstack(per_group))


def _layout(tree: Any, axis_name: base.AxisName | None = None) -> _Layout:
    """``tree``'s leaves grouped by shape, dtype and (with ``axis_name``) the axes they
    arrived reduced over (arrays or ``jax.ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree.flatten(tree)
    reduced = comm.reduced_axes(leaves, axis_name) if axis_name is not None else [()] * len(leaves)
    groups = base.LeafGroups(
        list(zip(leaves, reduced)), key=lambda lr: (np.shape(lr[0]), jnp.result_type(lr[0]), lr[1])
    )
    return _Layout(groups, leaves, treedef)


def _group_plan(lay: _Layout, k: int | None, density: float | None, caller: str) -> list[int | None]:
    """Per group: entries each of its leaves sends, or None where they go dense."""
    plan = _leaf_plan(base.leaf_sizes(lay.leaves), k, density, caller)
    return [plan[ids[0]] for ids in lay.groups.groups]


def _rows_of(indices: jax.Array) -> jax.Array:
    """Row numbers to pair with per-row ``indices`` ``(..., G, k)`` in a scatter."""
    return jnp.arange(indices.shape[-2], dtype=jnp.int32)[:, None]


def _scatter(size: int, indices: jax.Array, values: jax.Array) -> jax.Array:
    """Rows of zeros ``(G, size)`` holding ``values`` ``(G, k)`` at their (distinct) ``indices``."""
    zeros = jnp.zeros((values.shape[0], size), values.dtype)
    return zeros.at[_rows_of(indices), indices].set(values, unique_indices=True)


def _drop(x: jax.Array, indices: jax.Array) -> jax.Array:
    """Rows ``x`` ``(G, d)`` with the entries at (distinct) ``indices`` zeroed: the residual of a sparse message.

    A scatter that XLA runs in place where ``x`` is written out anyway (top-k
    reads it several times to select), instead of ``x - contribution``
    reading ``x`` again with a dense contribution or mask.
    """
    return x.at[_rows_of(indices), indices].set(jnp.zeros([], x.dtype), unique_indices=True)


def _drop_masked(x: jax.Array, indices: jax.Array) -> jax.Array:
    """The same as :func:`_drop`, as a select on a boolean mask: XLA fuses it
    with the computation of ``x`` (``g + e``) where nothing else needs ``x``
    whole (random-k reads only the k sent entries)."""
    mask = jnp.zeros(x.shape, jnp.bool_).at[_rows_of(indices), indices].set(True, unique_indices=True)
    return jnp.where(mask, jnp.zeros_like(x), x)


def _take(x: jax.Array, indices: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, indices, axis=1)


def _scatter_means(
    sizes: Sequence[int],
    indices: Sequence[jax.Array],
    values: Sequence[jax.Array],
    n: int,
    dtypes: Sequence[Any],
) -> list[jax.Array]:
    """Means over workers of sparse rows: per group, ``indices``/``values`` are ``(n, G, k)``.

    Worker rows are added in worker order, one scatter per worker and group
    whose indices are unique in each row, so the sum has one fixed rounding
    order on every worker (no atomics on accelerators) and replicas stay
    bit-identical. One loop over the workers for every group.
    """
    accs = [base.accumulation_dtype(dt) for dt in dtypes]
    values = [v.astype(a) for v, a in zip(values, accs)]

    def body(w, totals):
        return tuple(
            t.at[_rows_of(i[w]), i[w]].add(v[w], unique_indices=True)
            for t, i, v in zip(totals, indices, values)
        )

    zeros = tuple(jnp.zeros((i.shape[1], d), a) for i, d, a in zip(indices, sizes, accs))
    totals = jax.lax.fori_loop(0, n, body, zeros)
    return [(t / jnp.asarray(n, a)).astype(dt) for t, a, dt in zip(totals, accs, dtypes)]


def _gather_exchange(
    rows: Sequence[jax.Array],
    selections: Sequence[tuple[jax.Array, jax.Array] | None],
    axis_name: base.AxisName,
    caller: str,
) -> list[jax.Array]:
    """Per-worker selections -> the mean over workers of what was sent.

    ``rows`` are stacked flat leaves ``(G, d)``; ``selections[i]`` is
    ``(values, int32 indices)``, each ``(G, k)``, for sparse rows (values
    already masked as wanted) or None for dense ones. All sparse payloads
    travel in one all-gather, all dense rows in one fused all-reduce per dtype.
    """
    n = comm.axis_size(axis_name, caller=caller)
    out: list[Any] = [None] * len(rows)
    dense = [i for i, s in enumerate(selections) if s is None]
    sparse = [i for i, s in enumerate(selections) if s is not None]
    if dense:
        means = comm.reduce(
            [rows[i] for i in dense], axis_name, reduction="mean", flatten=True, caller=caller
        )
        for i, m in zip(dense, means):
            out[i] = m
    if sparse:
        payload: list[jax.Array] = []
        for i in sparse:
            values, indices = selections[i]  # type: ignore[misc]
            payload += [values, indices]
        gathered = comm.all_gather_packed(payload, axis_name, caller=caller)
        means = _scatter_means(
            [rows[i].shape[1] for i in sparse],
            gathered[1::2],
            gathered[0::2],
            n,
            [rows[i].dtype for i in sparse],
        )
        for i, m in zip(sparse, means):
            out[i] = m
    return out


def _largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per row of ``x`` ``(G, d)``, the ``k`` largest-magnitude entries (ties: lower index first)
    and their int32 indices, in increasing index order: two ``(G, k)`` arrays."""
    idx = selection.top_indices_rows(x, k)
    return _take(x, idx), idx


def _unflatten(treedef: Any, like: Sequence[jax.Array], flats: Sequence[jax.Array]) -> Any:
    return jax.tree.unflatten(treedef, [f.reshape(x.shape).astype(x.dtype) for f, x in zip(flats, like)])


# ----------------------------------------------------------------------------
# top_k.


def _top_k_compressor(
    k: int | None, density: float | None, per_leaf: bool, axis_name: base.AxisName
) -> ef.Compressor:
    def check(tree):
        if per_leaf:
            _leaf_plan(base.leaf_sizes(tree), k, density, "top_k")
        else:
            _flat_plan(sum(base.leaf_sizes(tree)), k, density, "top_k")

    def init(params):
        check(params)
        return optax.EmptyState()

    def compress(updates, state, params=None, **extra_args):
        del params, extra_args
        comm.require_axis(axis_name, "top_k")
        leaves, treedef = jax.tree.flatten(updates)
        check(updates)
        if not leaves:
            return updates, updates, state
        if per_leaf:
            lay = _layout(updates)
            rows = lay.stack()
            selections = [pick(x, kl) for x, kl in zip(rows, _group_plan(lay, k, density, "top_k"))]
            out = _gather_exchange(rows, selections, axis_name, "top_k")
            residual = [
                jnp.zeros_like(x) if sel is None else _drop(x, sel[1]) for x, sel in zip(rows, selections)
            ]
            return lay.tree(out), lay.tree(residual), state
        p = _flat_plan(sum(base.leaf_sizes(updates)), k, density, "top_k")
        if p is None:  # k == every entry: all dense
            lay = _layout(updates)
            rows = lay.stack()
            out = _gather_exchange(rows, [None] * len(rows), axis_name, "top_k")
            return lay.tree(out), jax.tree.map(jnp.zeros_like, updates), state
        dtype = jnp.result_type(*leaves)
        flat = jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])[None]
        chosen = _largest(flat, p)
        (out,) = _gather_exchange([flat], [chosen], axis_name, "top_k")
        residual = _drop(flat, chosen[1])
        return (
            base.split_flat(out[0], leaves, treedef),
            base.split_flat(residual[0], leaves, treedef),
            state,
        )

    def pick(x, kl):
        return None if kl is None else _largest(x, kl)

    codec = _sparse_codec(lambda lay: _group_plan(lay, k, density, "top_k"), pick) if per_leaf else None
    return ef.Compressor(init, compress, codec, axis_name=axis_name, name="top_k", returns_residual=True)


def _flat_codec(plan_of: Callable[[int], int | None]) -> ef.Codec:
    """Codec of top-k over the flattened tree (``per_leaf=False``): the message is the chosen entries'
    values and int32 indices in the tree's common dtype, ``(1, k)`` each, or the whole flat vector
    ``(1, total)`` where ``plan_of(total)`` is None (every entry sent)."""

    def flat(leaves):
        dtype = jnp.result_type(*leaves)
        return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])[None]

    def encode(updates, state):
        leaves, treedef = jax.tree.flatten(updates)
        if not leaves:
            return [], updates, state
        x = flat(leaves)
        p = plan_of(x.shape[1])
        if p is None:
            return [x], updates, state
        chosen = _largest(x, p)
        return (
            list(chosen),
            base.split_flat(_scatter(x.shape[1], chosen[1], chosen[0])[0], leaves, treedef),
            state,
        )

    def decode(message, like, state):
        del state
        leaves, treedef = jax.tree.flatten(like)
        if not leaves:
            return like
        total = sum(base.leaf_sizes(like))
        if plan_of(total) is None:
            (x,) = message
        else:
            values, indices = message
            x = _scatter(total, jnp.asarray(indices), jnp.asarray(values))
        return base.split_flat(jnp.asarray(x)[0], leaves, treedef)

    return ef.Codec(encode, decode)


def _sparse_codec(plan_of: Callable[[_Layout], list[int | None]], pick: Callable[..., Any]) -> ef.Codec:
    """Codec of a per-leaf sparsifier: ``pick(rows, k_l)`` gives ``(values, int32 indices)`` of
    stacked leaves, or None for leaves sent dense; the message holds, per group of leaves of
    one shape, their values then indices (or their entries)."""

    def encode(updates, state):
        lay = _layout(updates)
        message, decoded = [], []
        for x, kl in zip(lay.stack(), plan_of(lay)):
            sel = pick(x, kl)
            if sel is None:
                message.append(x)
                decoded.append(x)
            else:
                message += list(sel)
                decoded.append(_scatter(x.shape[1], sel[1], sel[0]))
        return message, lay.tree(decoded), state

    def decode(message, like, state):
        del state
        lay = _layout(like)
        out, pos = [], 0
        for d, kl in zip(lay.sizes(), plan_of(lay)):
            if kl is None:
                out.append(message[pos])
                pos += 1
            else:
                out.append(_scatter(d, message[pos + 1], message[pos]))
                pos += 2
        return lay.tree(out)

    return ef.Codec(encode, decode)


def top_k(
    k: int | None = None,
    *,
    density: float | None = None,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    error_feedback: bool = True,
    per_leaf: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Top-k sparsification: each worker sends its k largest-magnitude entries.

    Each worker :math:`i` adds its residual, keeps the :math:`k` entries of
    largest magnitude of :math:`x_i = g_i + e_i` (ties: lower index first),
    and all-gathers their values and int32 indices; every worker scatter-adds
    the :math:`n` sparse vectors in worker order and divides by :math:`n`:

    .. math::
      u = \frac{1}{n} \sum_{i=1}^{n} \operatorname{top}_k(x_i), \qquad
      e_i \leftarrow x_i - \operatorname{top}_k(x_i).

    The output is the same bit for bit on every worker. This is SINGA's
    ``DistOpt`` sparsification with ``topK=True`` (``spars`` = ``density``)
    and ``corr=True`` (error feedback); the memory analysis is Stich et al.

    Selection is per leaf by default; ``per_leaf=False`` selects the ``k``
    largest entries over all leaves together (values travel in the promoted
    dtype of the leaves).

    Args:
      k: entries sent per leaf (or in total with ``per_leaf=False``); a Python
        int >= 1, at most the size of the largest leaf (of the whole tree with
        ``per_leaf=False``). Leaves with at most ``k`` entries are sent dense.
      density: instead of ``k``, the fraction of each leaf's entries to send,
        in (0, 1]: ``k_l = max(1, ceil(density * d_l))``.
      axis_name: the mapped axis (or tuple of axes) of the workers.
      error_feedback: keep the unsent part in a per-worker residual. Without
        it the unsent entries are dropped.
      per_leaf: select per leaf (True) or over the flattened tree (False).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`jaxopt_dist.ErrorFeedbackState` (inner state empty). ``k`` and
      ``density`` fix shapes: under :func:`optax.inject_hyperparams` list them
      in ``static_args``.

    Communication:
      Per step and worker, with ``S`` the sparse leaves (``d_l > k_l``),
      ``D`` the dense ones, ``b_l`` a leaf's itemsize:

      * one all-gather of a uint8 buffer of ``B = sum_{l in S} k_l (b_l + 4)``
        bytes (values, then int32 indices, of every sparse leaf): each worker
        sends ``B`` bytes and receives ``(n - 1) B``; skipped if ``S`` is empty;
      * one all-reduce (mean) per dtype of the dense leaves, of
        ``sum_{l in D} d_l b_l`` bytes; skipped if ``D`` is empty.

      With ``per_leaf=False`` the tree is one vector of ``sum_l d_l`` entries
      in the promoted dtype (itemsize ``b``): ``B = k (b + 4)``, no all-reduce
      (or, when ``k`` equals the total size, only the dense all-reduces).
      Outputs are replicated; the residual is per-worker; ``count`` replicated.

      Every worker receives every message, so the traffic grows with ``n``:
      for float32 leaves a ring all-gather moves ``(n - 1) 8 k`` bytes per
      worker against ``2 (n - 1) / n * 4 d`` for a dense ring all-reduce, a
      saving of about ``d / (n k)`` (``1 / (n * density)``).

    Sharded parameters:
      Needs whole leaves: the selection ranks every entry of a flattened leaf
      (of the whole tree with ``per_leaf=False``), so on parameters sharded
      over model axes the compiler gathers what it needs over those axes. The
      entries chosen, and the output, are those of replicated parameters; the
      message crosses the data axis as above, per replica, and the residual
      is sharded like its parameter.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxopt_dist._src.sparsify import top_k
      >>> tx = top_k(1)
      >>> g = jnp.array([[3.0, 1.0], [0.5, -2.0]])  # two workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(g)[0]
      Array([ 1.5, -1. ], dtype=float32)

    References:
      Stich, Cordonnier and Jaggi, `Sparsified SGD with Memory
      <https://arxiv.org/abs/1809.07599>`_, 2018;
      Aji and Heafield, `Sparse Communication for Distributed Gradient Descent
      <https://arxiv.org/abs/1704.05021>`_, 2017
    """
    _check_k_density(k, density, "top_k")
    axis_name = base.validate_axis_name(axis_name)
    base.check_bool(error_feedback, "error_feedback")
    base.check_bool(per_leaf, "per_leaf")
    tx = ef.error_feedback(_top_k_compressor(k, density, per_leaf, axis_name), enabled=error_feedback)
    if not per_leaf:  # its message, for merges made elsewhere (islands); not a codec peers gossip
        codec = _flat_codec(lambda total: _flat_plan(total, k, density, "top_k"))
        base.declare_wire(tx, ef.codec_wire(codec, enabled=error_feedback))
    return tx


# ----------------------------------------------------------------------------
# threshold.


@base.reshard_rules()
class ThresholdState(NamedTuple):
    """Inner state of :func:`jaxopt_dist.threshold` (inside an ``ErrorFeedbackState``).

    Attributes:
      count: int32[], steps taken (for a scheduled threshold); replicated.
    """

    count: jax.Array  # int32[], replicated


def _threshold_compressor(
    thr: optax.ScalarOrSchedule, capacity: int, axis_name: base.AxisName
) -> ef.Compressor:
    def init(params):
        del params
        return ThresholdState(count=jnp.zeros([], jnp.int32))

    def compress(updates, state, params=None, **extra_args):
        del params, extra_args
        comm.require_axis(axis_name, "threshold")
        lay = _layout(updates)
        t = base.resolve(thr, state.count)
        rows, selections = [], []
        for x in lay.stack():
            big = jnp.abs(x) >= jnp.asarray(t, x.dtype)
            if x.shape[1] <= capacity:
                rows.append(jnp.where(big, x, jnp.zeros_like(x)))
                selections.append(None)
            else:
                values, idx = _largest(x, capacity)
                values = jnp.where(_take(big, idx), values, jnp.zeros_like(values))
                rows.append(x)
                selections.append((values, idx))
        out = _gather_exchange(rows, selections, axis_name, "threshold")
        contrib = [
            x if sel is None else _scatter(x.shape[1], sel[1], sel[0]) for x, sel in zip(rows, selections)
        ]
        new_state = ThresholdState(count=jnp.asarray(optax.safe_increment(state.count)))
        return lay.tree(out), lay.tree(contrib), new_state

    return ef.Compressor(init, compress, axis_name=axis_name, name="threshold")


def threshold(
    threshold: optax.ScalarOrSchedule,
    *,
    capacity: int,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    error_feedback: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Threshold sparsification: each worker sends its entries with :math:`|x| \ge \tau`.

    SINGA's ``DistOpt`` sparsification with ``topK=False``: an entry of
    :math:`x_i = g_i + e_i` is sent when its magnitude is at least the
    threshold :math:`\tau`. XLA needs static shapes, so at most ``capacity``
    entries per leaf are sent: the ``capacity`` largest-magnitude ones among
    those over the threshold (ties: lower index first). Entries over the
    threshold beyond the capacity, like those under it, stay in the residual.
    A leaf with at most ``capacity`` entries is sent dense (its entries under
    the threshold as zeros), which keeps the same semantics.

    .. math::
      u = \frac{1}{n} \sum_i s_i, \quad
      s_i = x_i \odot [\,|x_i| \ge \tau\,] \text{ restricted to its } \le
      \text{capacity largest entries}, \quad e_i \leftarrow x_i - s_i.

    With ``threshold=0`` this is :func:`top_k` with ``k=capacity``.

    Args:
      threshold: :math:`\tau \ge 0`, a float or an optax schedule of the step.
      capacity: maximum entries sent per leaf (Python int >= 1).
      axis_name: the mapped axis (or tuple of axes) of the workers.
      error_feedback: keep the unsent part in a per-worker residual.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`jaxopt_dist.ErrorFeedbackState` with a :class:`ThresholdState`
      inside. With :func:`optax.inject_hyperparams`, list ``capacity`` in
      ``static_args``.

    Communication:
      As :func:`top_k` with ``k_l = capacity``: one all-gather of a uint8
      buffer of ``B = sum_{l: d_l > capacity} capacity (b_l + 4)`` bytes per
      worker (sent; ``(n - 1) B`` received), and one all-reduce (mean) per
      dtype of the leaves with ``d_l <= capacity``, of ``sum d_l b_l`` bytes.
      The message size is fixed whatever the threshold; unsent slots carry
      zeros. Outputs are replicated; the residual per-worker; counts replicated.

    Sharded parameters:
      Needs whole leaves, as :func:`top_k`: the ``capacity`` largest entries
      over the threshold are chosen per flattened leaf, the compiler gathering
      what it needs over the model axes; the output is that of replicated
      parameters, the message crosses the data axis as above, per replica.

    References:
      Aji and Heafield, `Sparse Communication for Distributed Gradient Descent
      <https://arxiv.org/abs/1704.05021>`_, 2017 (the threshold rule);
      Apache SINGA ``opt.DistOpt.backward_and_sparse_update``.
    """
    base.check_hyperparameter(threshold, "threshold", lower=0.0)
    capacity = base.check_positive_int(capacity, "capacity")
    axis_name = base.validate_axis_name(axis_name)
    base.check_bool(error_feedback, "error_feedback")
    return ef.error_feedback(_threshold_compressor(threshold, capacity, axis_name), enabled=error_feedback)


# ----------------------------------------------------------------------------
# random_k and block_k: shared choice, values through a plain mean.


@base.reshard_rules()
class RandomKState(NamedTuple):
    """Inner state of :func:`jaxopt_dist.random_k` (inside an ``ErrorFeedbackState``).

    Attributes:
      key: uint32[2], the PRNG key of the next step, the same on every worker; replicated.
    """

    key: jax.Array  # uint32[2], replicated


@base.reshard_rules()
class BlockKState(NamedTuple):
    """Inner state of :func:`jaxopt_dist.block_k` (inside an ``ErrorFeedbackState``).

    Attributes:
      key: uint32[2], the PRNG key of the next step, the same on every worker; replicated.
    """

    key: jax.Array  # uint32[2], replicated


_PATTERNS = ("strided", "subset")


def random_k_indices(key: jax.Array, leaf: int, size: int, k: int, *, pattern: str = "strided") -> jax.Array:
    """The int32 indices :func:`random_k` sends for leaf number ``leaf`` at a step with key ``key``.

    ``key`` is the step's key: ``jax.random.split(state_key)[1]``; the leaf's
    key is ``fold_in(key, leaf)``.

    * ``pattern="strided"`` (default): a random arithmetic progression,
      ``(start + j * stride) mod size`` for ``j < k``, with ``start`` uniform
      in ``[0, size)`` and ``stride`` uniform in ``[max(1, q // 2), q]``,
      ``q = size // k`` (both drawn from the leaf's key, split in two). Since
      ``(k - 1) * stride < size`` the ``k`` positions are distinct, and every
      entry is chosen with probability exactly ``k / size``. It costs ``O(k)``.
    * ``pattern="subset"``: a uniformly random ``k``-subset, the positions of
      the ``k`` largest of ``size`` float32 uniforms (one ``top_k``); it costs
      one random number per entry.
    """
    if pattern == "subset":
        u = jax.random.uniform(jax.random.fold_in(key, leaf), (size,), jnp.float32)
        return jax.lax.top_k(u, k)[1].astype(jnp.int32)
    if pattern != "strided":
        raise ValueError(f"`pattern` must be one of {_PATTERNS}; got {pattern!r}.")
    start, stride = _progressions(key, [(leaf, size, k)])
    return _progression(start[0], stride[0], size, k)


def _progressions(key: jax.Array, plan: Sequence[tuple[int, int, int]]) -> tuple[jax.Array, jax.Array]:
    """Start and stride of the strided pattern of every ``(leaf, size, k)`` in ``plan``.

    One batched draw for all leaves (the values of a draw per leaf: leaf
    ``l``'s key is ``fold_in(key, l)``, split in two), so the compiled update
    holds a handful of random-number ops instead of a few dozen per leaf.
    """
    leaves, sizes, ks = (jnp.asarray(c, jnp.int32) for c in zip(*plan))
    q = sizes // ks

    def draw(leaf, size, lo, hi):
        k_start, k_stride = jax.random.split(jax.random.fold_in(key, leaf))
        start = jax.random.randint(k_start, (), 0, size, dtype=jnp.int32)
        return start, jax.random.randint(k_stride, (), lo, hi, dtype=jnp.int32)

    return jax.vmap(draw)(leaves, sizes, jnp.maximum(1, q // 2), q + 1)


def _progression(start: jax.Array, stride: jax.Array, size: int, k: int) -> jax.Array:
    """``(start + j * stride) mod size`` for ``j < k``, with ``(k - 1) * stride < size``."""
    offsets = stride * jnp.arange(k, dtype=jnp.int32)  # < size: no overflow
    room = size - start  # offsets >= room wrap around
    return jnp.where(offsets >= room, offsets - room, offsets + start)


def block_k_start(key: jax.Array, leaf: int, size: int) -> jax.Array:
    """The first index of the block :func:`block_k` sends for leaf number ``leaf`` (see there)."""
    return _block_starts(key, [(leaf, size, 1)])[0]


def _block_starts(key: jax.Array, plan: Sequence[tuple[int, int, int]]) -> jax.Array:
    """The block start of every ``(leaf, size, k)`` in ``plan``, in one batched draw."""
    leaves, sizes, _ = (jnp.asarray(c, jnp.int32) for c in zip(*plan))

    def draw(leaf, size):
        return jax.random.randint(jax.random.fold_in(key, leaf), (), 0, size, dtype=jnp.int32)

    return jax.vmap(draw)(leaves, sizes)


def _shared_compressor(
    k: int | None,
    density: float | None,
    seed: int,
    axis_name: base.AxisName,
    caller: str,
    state_cls: Callable[..., Any],
    pick: Callable[..., list[tuple[Callable[[jax.Array], jax.Array], ...]]],
    invariant_updates: str = "sum",
) -> ef.Compressor:
    """``pick(step_key, plan) -> [(take, put, drop), ...]``, one triple per
    ``(leaf numbers, size, k)`` of ``plan`` (the groups of sparse leaves of one
    shape): ``take`` reads the k sent entries of each of the group's stacked
    flat leaves ``(G, size)``, ``put`` writes ``(G, k)`` values back into zero
    leaves, ``drop`` zeroes the sent entries (``x - put(take(x))``: the residual)."""

    def init(params):
        _leaf_plan(base.leaf_sizes(params), k, density, caller)
        return state_cls(key=jax.random.PRNGKey(seed))

    def compress(updates, state, params=None, **extra_args):
        del params, extra_args
        comm.require_axis(axis_name, caller)
        # Leaves typed invariant (updates that arrived reduced, with a replicated residual)
        # are grouped apart: each is the same on every worker, its own mean, and what
        # follows from it stays invariant.
        lay = _layout(updates, axis_name)
        rows = lay.stack()
        triples = plan_triples(lay, state)
        sent = [x if tp is None else tp[0](x) for x, tp in zip(rows, triples)]
        means = comm.reduce(
            sent, axis_name, reduction="mean", flatten=True, caller=caller, invariant_updates="mean"
        )
        out = [m if tp is None else tp[1](m) for m, tp in zip(means, triples)]
        residual = [jnp.zeros_like(x) if tp is None else tp[2](x) for x, tp in zip(rows, triples)]
        key, _ = jax.random.split(state.key)
        return lay.tree(out), lay.tree(residual), state_cls(key=key)

    def plan_triples(lay, state):
        plan = _group_plan(lay, k, density, caller)
        _, step_key = jax.random.split(state.key)
        sparse = [(ids, d, kl) for ids, d, kl in zip(lay.groups.groups, lay.sizes(), plan) if kl is not None]
        picked = iter(pick(step_key, sparse) if sparse else [])
        return [None if kl is None else next(picked) for kl in plan]

    def encode(updates, state):
        lay = _layout(updates)
        message, decoded = [], []
        for x, tp in zip(lay.stack(), plan_triples(lay, state)):
            message.append(x if tp is None else tp[0](x))
            decoded.append(x if tp is None else tp[1](message[-1]))
        key, _ = jax.random.split(state.key)
        return message, lay.tree(decoded), state_cls(key=key)

    def decode(message, like, state):
        lay = _layout(like)
        return lay.tree([m if tp is None else tp[1](m) for m, tp in zip(message, plan_triples(lay, state))])

    return ef.Compressor(
        init,
        compress,
        ef.Codec(encode, decode),
        axis_name=axis_name,
        name=caller,
        invariant_updates=invariant_updates,
        linear=True,
        returns_residual=True,
    )


def _pick_random(pattern: str):
    def pick(step_key, plan):
        if pattern == "subset":
            indices = []
            for ids, size, k in plan:
                leaves = jnp.asarray(ids, jnp.int32)
                indices.append(
                    jax.vmap(lambda li: random_k_indices(step_key, li, size, k, pattern=pattern))(leaves)
                )
        else:
            starts, strides = (_per_group(x, plan) for x in _progressions(step_key, _by_leaf(plan)))
            indices = [
                jax.vmap(lambda a, b, size=size, k=k: _progression(a, b, size, k))(a, b)
                for a, b, (_, size, k) in zip(starts, strides, plan)
            ]
        return [_index_triple(idx, size) for idx, (_, size, _) in zip(indices, plan)]

    return pick


def _by_leaf(plan: Sequence[tuple[list[int], int, int]]) -> list[tuple[int, int, int]]:
    """``(leaf, size, k)`` of every leaf of the groups ``(leaves, size, k)`` of ``plan``, group after group."""
    return [(li, size, k) for ids, size, k in plan for li in ids]


def _per_group(values: jax.Array, plan: Sequence[tuple[list[int], int, int]]) -> list[jax.Array]:
    """One value per leaf of :func:`_by_leaf` -> per group of ``plan``, its leaves' values."""
    return base.cut(values, [len(ids) for ids, _, _ in plan])


def _index_triple(idx: jax.Array, size: int):
    """``(take, put, drop)`` of stacked leaves ``(G, size)`` sending those at ``idx`` ``(G, k)``."""
    return (
        (lambda x: _take(x, idx)),
        (lambda vals: _scatter(size, idx, vals)),
        (lambda x: _drop_masked(x, idx)),
    )


def _pick_block(step_key, plan):
    starts = _per_group(_block_starts(step_key, _by_leaf(plan)), plan)
    return [_block_triple(a, size, k) for a, (_, size, k) in zip(starts, plan)]


def _block_triple(starts: jax.Array, size: int, k: int):
    """``(take, put, drop)`` of stacked leaves ``(G, size)``, row ``g`` sending ``k`` entries
    from ``starts[g]`` on, wrapping."""

    def take(x):
        return jax.vmap(lambda v, start: jnp.roll(v, -start)[:k])(x, starts)

    def put(vals):
        return jax.vmap(lambda v, start: jnp.roll(jnp.pad(v, (0, size - k)), start))(vals, starts)

    def drop(x):
        inside = (jnp.arange(size, dtype=jnp.int32)[None, :] - starts[:, None]) % size < k
        return jnp.where(inside, jnp.zeros_like(x), x)

    return take, put, drop


def _shared_sparsifier(
    caller: str,
    k: int | None,
    density: float | None,
    axis_name: base.AxisName,
    error_feedback: bool,
    seed: int,
    invariant_updates: str,
    state_cls: Callable[..., Any],
    pick: Callable[..., list[tuple[Callable[[jax.Array], jax.Array], ...]]],
) -> optax.GradientTransformationExtraArgs:
    """:func:`random_k` or :func:`block_k` (``caller``) from their arguments, checked."""
    _check_k_density(k, density, caller)
    axis_name = base.validate_axis_name(axis_name)
    base.check_bool(error_feedback, "error_feedback")
    seed = base.check_positive_int(seed, "seed", minimum=0)
    invariant_updates = comm.check_invariant_mode(invariant_updates)
    comp = _shared_compressor(k, density, seed, axis_name, caller, state_cls, pick, invariant_updates)
    return ef.error_feedback(comp, enabled=error_feedback)


def random_k(
    k: int | None = None,
    *,
    density: float | None = None,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    error_feedback: bool = True,
    seed: int = 0,
    invariant_updates: str = "sum",
    pattern: str = "strided",
) -> optax.GradientTransformationExtraArgs:
    r"""Random-k sparsification with indices shared by all workers.

    At every step the same :math:`k` random positions of each leaf (drawn
    without replacement) are chosen on every worker from a key held in the
    state, so only the :math:`k` values travel, through a plain mean:

    .. math::
      u = \frac{1}{n} \sum_i x_i \odot m_t, \qquad e_i \leftarrow x_i - x_i \odot m_t,

    with :math:`m_t` the step's 0/1 mask, :math:`x_i = g_i + e_i`. The values
    are not rescaled by :math:`d/k` (the memory makes up for what is left out,
    as in mlbench's random sparsified SGD and Stich et al.).

    Randomness: the state key :math:`\kappa` is split at each step into
    ``(next_key, step_key)``; leaf number ``l`` (in ``jax.tree.leaves``
    order) draws its positions from ``fold_in(step_key, l)``
    (:func:`random_k_indices`). By default (``pattern="strided"``) they are a
    random arithmetic progression ``(start + j * stride) mod d_l``, ``j <
    k_l``, with a random start and a random stride near ``d_l / k_l``: every
    entry is sent with probability ``k_l / d_l``, and choosing them costs
    ``O(k_l)``. ``pattern="subset"`` draws a uniformly random subset instead
    (the positions of the ``k_l`` largest of ``d_l`` uniforms), which costs one
    random number and a ``top_k`` over every entry: on ResNet-18's 11.2M
    gradients it is several times slower than the rest of the update.

    Args:
      k: entries sent per leaf (Python int >= 1, at most the largest leaf's
        size); leaves with at most ``k`` entries are sent dense.
      density: instead of ``k``, the fraction of each leaf's entries to send,
        in (0, 1]: ``k_l = max(1, ceil(density * d_l))``.
      axis_name: the mapped axis (or tuple of axes) of the workers.
      error_feedback: keep the unsent part in a per-worker residual.
      seed: seeds the shared key (Python int >= 0).
      invariant_updates: what an update leaf typed invariant under
        ``jax.shard_map(check_vma=True)`` stands for: ``"sum"`` over the
        workers (the gradient of replicated parameters; the default), or
        ``"mean"`` (gradients you pmean-ed yourself); either way the output
        depends only on the mean, so it is exact. ``"error"`` rejects them.
      pattern: ``"strided"`` (default) or ``"subset"``: how the positions are
        drawn (see above and :func:`random_k_indices`).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`jaxopt_dist.ErrorFeedbackState` with a :class:`RandomKState`
      inside.

    Communication:
      One all-reduce (mean) per dtype of the leaves, of
      ``sum_l min(k_l, d_l) b_l`` bytes per worker (``b_l`` the itemsize):
      the chosen values of the sparse leaves and every entry of the dense
      ones, fused into one buffer. No indices travel. Outputs and ``key`` are
      replicated; the residual is per-worker. A leaf that arrives already
      reduced (typed invariant, see ``invariant_updates``) while its residual
      is replicated is the same on every worker: it does not travel, and its
      residual stays replicated, so a ``shard_map`` step can keep the whole
      state with ``out_specs=P()``.

    Sharded parameters:
      Needs whole leaves: the positions index the flattened leaf, so on
      parameters sharded over model axes the compiler fetches the chosen
      entries over those axes and scatters the mean back into the shards. The
      positions (from the shared key), the values all-reduced over the data
      axis (per replica) and the output are those of replicated parameters.

    References:
      Stich, Cordonnier and Jaggi, `Sparsified SGD with Memory
      <https://arxiv.org/abs/1809.07599>`_, 2018; mlbench
      ``CentralizedSparsifiedSGD(random_sparse=True)``.
    """
    if not isinstance(pattern, str) or pattern not in _PATTERNS:
        raise ValueError(f"`pattern` must be one of {_PATTERNS}; got {pattern!r}.")
    return _shared_sparsifier(
        "random_k",
        k,
        density,
        axis_name,
        error_feedback,
        seed,
        invariant_updates,
        RandomKState,
        _pick_random(pattern),
    )


def block_k(
    k: int | None = None,
    *,
    density: float | None = None,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    error_feedback: bool = True,
    seed: int = 0,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""Block sparsification: a random contiguous block of k entries, shared by all workers.

    As :func:`random_k`, but the positions of a leaf (flattened in row-major
    order) are one block of :math:`k` consecutive entries starting at a random
    offset, wrapping around the end, so every entry is chosen with the same
    probability :math:`k/d`. Reading and writing a block is a cheap rotation
    instead of a gather.

    Randomness: the state key is split at each step into ``(next_key,
    step_key)``; leaf ``l`` starts at ``jax.random.randint(fold_in(step_key,
    l), (), 0, d_l)`` (:func:`block_k_start`) and sends entries
    ``(start + j) mod d_l`` for ``j < k_l``.

    Args:
      k: block length per leaf (Python int >= 1, at most the largest leaf's
        size); leaves with at most ``k`` entries are sent dense.
      density: instead of ``k``, the block length as a fraction of each
        leaf's entries, as in :func:`random_k`.
      axis_name: as in :func:`random_k`.
      error_feedback: as in :func:`random_k`.
      seed: seeds the shared key, as in :func:`random_k`.
      invariant_updates: ``"sum"`` (default), ``"mean"`` or ``"error"``: what
        an update leaf typed invariant stands for, as in :func:`random_k`.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`jaxopt_dist.ErrorFeedbackState` with a :class:`BlockKState`
      inside.

    Communication:
      As :func:`random_k`: one all-reduce (mean) per dtype, of
      ``sum_l min(k_l, d_l) b_l`` bytes per worker. Outputs and ``key`` are
      replicated; the residual is per-worker, or replicated for updates that
      arrive already reduced, as there.

    Sharded parameters:
      Needs whole leaves, as :func:`random_k`: the block of the flattened
      leaf (with its wrap-around) is assembled by the compiler over the model
      axes; the values all-reduced over the data axis (per replica) and the
      output are those of replicated parameters.

    References:
      mlbench ``CentralizedSparsifiedSGD(random_sparse=False)`` (blockwise).
    """
    return _shared_sparsifier(
        "block_k", k, density, axis_name, error_feedback, seed, invariant_updates, BlockKState, _pick_block
    )
