"""Shared pieces of the orthonormal-update optimizers (distributed Muon, Dion2).

* :func:`newton_schulz`: the quintic Newton-Schulz orthogonalisation of a
  batch of matrices, with the coefficient tables and preconditionings of
  ``optax.contrib.muon`` (same numbers, batched).
* Matrix views: a leaf seen as a batch of ``(fan_in, fan_out)`` matrices
  through ``optax.contrib.MuonDimensionNumbers`` (:func:`matrix_view`).
* Owners: matrices of one shape and dtype are stacked into a *group*; its
  first ``n * share`` matrices (``share = count // n``, possibly 0) are
  split evenly, worker ``j`` owning the slots ``[j share, (j + 1) share)``,
  and the ``rest = count % n`` last ones are owned by nobody: they travel
  with the dense leaves and every worker updates them itself
  (:class:`Group`). Nothing is padded. :func:`reduce_to_owners` sums every
  worker's stacks with ONE reduce-scatter per dtype, so each worker
  receives the sum of its own share only (and a ``1 / n`` chunk of the
  dense leaves and the remainder matrices sent along);
  :func:`gather_from_owners` returns what the owners computed (and the
  dense chunks) to every worker with ONE all-gather. Together they move
  the bytes of one all-reduce of the gradient (plus fewer than ``n``
  padding elements per dtype). With ``axis_name=None`` (one worker, no
  communication) both only drop or add the leading axis of length 1, and
  there is no remainder.

Transform modules import this module, never each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

# ----------------------------------------------------------------------------
# Newton-Schulz.

STANDARD_NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients, repeated every step (optax's default)."""

DION_NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""The five per-step coefficients of the Dion reference (optax's ``"dion"`` preset)."""

NS_COEFFS_PRESETS = {"standard": STANDARD_NS_COEFFS, "dion": DION_NS_COEFFS}
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")


def resolve_ns_coeffs(
    ns_coeffs: Any, ns_steps: int, *, caller: str
) -> tuple[tuple[float, float, float], ...]:
    """The coefficients of every Newton-Schulz step, as Python floats.

    As ``optax.contrib.muon``: a preset name (``"standard"``, ``"dion"``), one
    triple used for each of ``ns_steps`` steps, or a table of triples (at most
    ``ns_steps`` rows; its last ``ns_steps`` rows are used, one per step).
    """
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in NS_COEFFS_PRESETS:
            raise ValueError(
                f"`{caller}`: unknown `ns_coeffs` preset {ns_coeffs!r}; use one of "
                f"{tuple(NS_COEFFS_PRESETS)} or give the coefficients."
            )
        ns_coeffs = NS_COEFFS_PRESETS[ns_coeffs]
    table = np.asarray(ns_coeffs, np.float64)
    if table.ndim not in (1, 2) or table.shape[-1] != 3:
        raise ValueError(f"`{caller}`: `ns_coeffs` must have shape (3,) or (k, 3); got {table.shape}.")
    if not np.all(np.isfinite(table)):
        raise ValueError(f"`{caller}`: `ns_coeffs` must be finite; got {ns_coeffs!r}.")
    rows = [table] * ns_steps if table.ndim == 1 else list(table[-ns_steps:])
    if table.ndim == 2 and table.shape[0] > ns_steps:
        raise ValueError(
            f"`{caller}`: `ns_coeffs` has {table.shape[0]} rows, more than `ns_steps`={ns_steps} "
            "(optax's rule: a table gives one row per step)."
        )
    return tuple((float(r[0]), float(r[1]), float(r[2])) for r in rows)


def _ns_step(x: jax.Array, c: Sequence[Any]) -> jax.Array:
    a = x @ x.T
    b = c[1] * a + c[2] * (a @ a)
    return c[0] * x + b @ x


def _ns_one(
    x: jax.Array, coeffs: Sequence[tuple[float, float, float]], preconditioning: str, eps: Any
) -> jax.Array:
    """Newton-Schulz of one matrix, as ``optax.contrib``'s ``orthogonalize_via_newton_schulz``."""
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    eps = jnp.asarray(eps, x.dtype)
    if preconditioning == "frobenius":
        x = x / (jnp.linalg.norm(x, ord="fro") + eps)
    elif preconditioning == "spectral":
        x = x / (jnp.linalg.norm(x, ord=2) + eps)
    cs = [tuple(jnp.asarray(v, x.dtype) for v in c) for c in coeffs]
    for i, c in enumerate(cs):
        if i == 0 and preconditioning == "aol":
            a = x @ x.T
            s = jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-1), min=jnp.asarray(1e-8, x.dtype)))[:, None]
            x, a = x * s, a * s * s.T
            x = c[0] * x + (c[1] * a + c[2] * (a @ a)) @ x
        elif i == 0 and preconditioning == "schatten":
            a = x @ x.T
            s = jax.lax.rsqrt(jnp.clip(jnp.linalg.norm(a, ord="fro"), min=jnp.asarray(1e-8, x.dtype)))
            x, a = x * s, a * s**2
            x = c[0] * x + (c[1] * a + c[2] * (a @ a)) @ x
        else:
            x = _ns_step(x, c)
    return x.T if transposed else x


def newton_schulz(
    x: jax.Array,
    coeffs: Sequence[tuple[float, float, float]],
    *,
    eps: Any = 1e-8,
    preconditioning: str = "frobenius",
) -> jax.Array:
    r"""Orthogonalises each matrix of a batch ``(b, m, n)`` by quintic Newton-Schulz.

    Per matrix ``X`` (transposed first when ``m > n``, so ``X X^T`` is the
    small Gram matrix): ``X <- X / (||X||_F + eps)`` (``"frobenius"``; or the
    spectral norm, or optax's AOL / Schatten-4 rescaling inside the first
    step), then for each coefficient triple ``(a, b, c)``:
    ``A = X X^T``, ``X <- a X + (b A + c A^2) X``. Arithmetic in ``x``'s
    dtype, as ``optax.contrib.muon``. A zero matrix stays zero.
    """
    return jax.vmap(lambda m: _ns_one(m, coeffs, preconditioning, eps))(x)


# ----------------------------------------------------------------------------
# Matrix views of leaves.


class _Dims(NamedTuple):
    """A leaf's dimension numbers, boxed (``None`` would vanish from a pytree)."""

    dims: Any


def leaf_dimension_numbers(spec: Any, tree: Any, *, arg: str = "muon_weight_dimension_numbers") -> list[Any]:
    """Per leaf of ``tree``: its ``MuonDimensionNumbers``, or None for a non-matrix (Adam) leaf.

    ``spec`` as ``optax.contrib.muon``'s ``muon_weight_dimension_numbers``:
    None (every 2-D leaf is a matrix ``(fan_in, fan_out)``, every other leaf
    goes to Adam), or a tree of ``MuonDimensionNumbers``/None that is a
    prefix of ``tree``, or a callable returning one from ``tree``.
    """
    leaves = jax.tree.leaves(tree)
    if spec is None:
        return [optax.contrib.MuonDimensionNumbers() if np.ndim(x) == 2 else None for x in leaves]
    dims = spec(tree) if callable(spec) else spec
    is_leaf = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)  # noqa: E731
    try:
        boxed = jax.tree.map(
            lambda d, sub: jax.tree.map(lambda _: _Dims(d), sub), dims, tree, is_leaf=is_leaf
        )
    except ValueError as e:
        raise ValueError(
            f"`{arg}` must be a tree of optax.contrib.MuonDimensionNumbers or "
            f"None matching the parameters (or a prefix of their tree); {e}"
        ) from None
    return [b.dims for b in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, _Dims))]


def _axes(dim: Sequence[int] | int, ndim: int) -> tuple[int, ...]:
    return tuple(a % ndim for a in ((dim,) if isinstance(dim, int) else tuple(dim)))


class MatrixView(NamedTuple):
    """How a leaf is seen as a batch of ``(fan_in, fan_out)`` matrices."""

    shape: tuple[int, ...]  # the leaf's shape
    transpose: tuple[int, ...]  # batch axes, then reduction axes, then output axes
    batch: int
    fan_in: int
    fan_out: int

    def to_matrices(self, x: jax.Array) -> jax.Array:
        return jnp.transpose(x, self.transpose).reshape(self.batch, self.fan_in, self.fan_out)

    def from_matrices(self, m: jax.Array) -> jax.Array:
        moved = tuple(self.shape[a] for a in self.transpose)
        inverse = tuple(int(i) for i in np.argsort(self.transpose))
        return jnp.transpose(m.reshape(moved), inverse)


def matrix_view(shape: tuple[int, ...], dims: Any, *, caller: str) -> MatrixView:
    """The view of a leaf of ``shape`` under ``optax.contrib.MuonDimensionNumbers`` ``dims``.

    As ``optax.contrib.muon``: axes that are neither reduction nor output
    axes are batch axes (matrices of their own).
    """
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"`{caller}`: matrix leaves must have ndim >= 2; got shape {shape}.")
    red, out = _axes(dims.reduction_axis, ndim), _axes(dims.output_axis, ndim)
    if set(red) & set(out) or not red or not out:
        raise ValueError(
            f"`{caller}`: the reduction axes {red} and output axes {out} of a leaf of shape {shape} "
            "must be non-empty and disjoint."
        )
    batch = tuple(a for a in range(ndim) if a not in red and a not in out)
    size = lambda axes: math.prod(shape[a] for a in axes)  # noqa: E731
    return MatrixView(tuple(shape), batch + red + out, size(batch), size(red), size(out))


# ----------------------------------------------------------------------------
# Owners.


class Group(NamedTuple):
    """Matrices of one shape and dtype, stacked; worker ``j`` owns slots ``[j share, (j+1) share)``.

    The last ``rest`` matrices (slots ``[n share, count)``) are owned by no
    one: every worker receives their mean and updates them itself.
    """

    fan_in: int
    fan_out: int
    dtype: Any
    members: tuple[tuple[int, int], ...]  # (leaf index, matrices of that leaf), in stack order
    count: int  # matrices in the stack
    share: int  # count // n: the slots each worker owns (possibly 0)
    rest: int  # count % n: the remainder, replicated on every worker


def make_groups(views: dict[int, MatrixView], dtypes: Sequence[Any], n: int) -> tuple[Group, ...]:
    """Groups the matrix leaves ``views`` (leaf index -> view) by ``(fan_in, fan_out, dtype)``."""
    found: dict[tuple[int, int, Any], list[tuple[int, int]]] = {}
    for i, v in views.items():
        found.setdefault((v.fan_in, v.fan_out, jnp.dtype(dtypes[i])), []).append((i, v.batch))
    groups = []
    for (fi, fo, dt), members in found.items():
        count = sum(b for _, b in members)
        groups.append(Group(fi, fo, dt, tuple(members), count, count // n, count % n))
    return tuple(groups)


def stack_group(
    leaves: Sequence[jax.Array], views: dict[int, MatrixView], g: Group, n: int
) -> tuple[jax.Array, jax.Array]:
    """The group's matrices of ``leaves`` stacked: ``(owned (n, share, fan_in, fan_out), rest (rest, fan_in, fan_out))``."""
    mats = [views[i].to_matrices(leaves[i]).astype(g.dtype) for i, _ in g.members]
    stacked = jnp.concatenate(mats) if len(mats) > 1 else mats[0]
    split = n * g.share
    return stacked[:split].reshape(n, g.share, g.fan_in, g.fan_out), stacked[split:]


def unstack_group(stacked: jax.Array, views: dict[int, MatrixView], g: Group) -> dict[int, jax.Array]:
    """Inverse of :func:`stack_group` on ``(count, ...)`` rows (owned, then rest): leaf index -> leaf-shaped array."""
    starts = np.cumsum([0] + [b for _, b in g.members[:-1]])
    cut = base.pieces(stacked, [(s, b) for s, (_, b) in zip(starts, g.members)])
    return {i: views[i].from_matrices(x) for (i, _), x in zip(g.members, cut)}


def reduce_to_owners(
    rows: Sequence[jax.Array],
    dense: Sequence[jax.Array],
    n: int,
    axis_name: base.AxisName | None,
    *,
    caller: str,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Sums over the workers, each worker receiving only the part it owns.

    Args:
      rows: arrays shaped ``(n, ...)``: row ``j`` goes to worker ``j``.
      dense: arrays sent whole; each worker receives a ``1 / n`` chunk of
        their flattened concatenation (per dtype, zero-padded to a multiple
        of ``n``).
      n: the number of workers.
      axis_name: the workers' axis; None: one worker (``n == 1``), no
        communication.
      caller: names the transform in errors.

    Returns:
      ``(sums of this worker's rows, shaped like a row; the summed dense
      chunk per dtype, in order of first appearance)``. ONE reduce-scatter per
      dtype (none with ``axis_name=None``).
    """
    items: list[tuple[Any, jax.Array]] = []  # (dtype, (n, size) row block)
    for x in rows:
        items.append((jnp.result_type(x), x.reshape(n, -1)))
    dense_dtypes: list[Any] = []
    for x in dense:
        dt = jnp.result_type(x)
        if dt not in dense_dtypes:
            dense_dtypes.append(dt)
    for dt in dense_dtypes:
        flat = jnp.concatenate([jnp.ravel(x) for x in dense if jnp.result_type(x) == dt])
        chunk = -(-flat.shape[0] // n)
        items.append((dt, jnp.pad(flat, (0, n * chunk - flat.shape[0])).reshape(n, chunk)))
    by_dtype: dict[Any, list[int]] = {}
    for k, (dt, _) in enumerate(items):
        by_dtype.setdefault(dt, []).append(k)
    summed: list[Any] = [None] * len(items)
    for idx in by_dtype.values():
        buffer = jnp.concatenate([items[k][1] for k in idx], axis=1)
        if axis_name is None:  # one worker: its row is the sum
            mine = buffer[0]
        else:
            mine = comm.reduce_scatter(buffer, axis_name, caller=caller)
        offset = 0
        for k in idx:
            size = items[k][1].shape[1]
            summed[k] = mine[offset : offset + size]
            offset += size
    own = [s.reshape(x.shape[1:]) for s, x in zip(summed[: len(rows)], rows)]
    return own, summed[len(rows) :]


def split_dense(chunks: Sequence[jax.Array], dense: Sequence[Any]) -> list[jax.Array]:
    """The dense leaves back from their gathered chunks ``(n, chunk)`` per dtype (see :func:`reduce_to_owners`)."""
    dtypes: list[Any] = []
    for x in dense:
        dt = jnp.result_type(x)
        if dt not in dtypes:
            dtypes.append(dt)
    out: list[Any] = [None] * len(dense)
    for dt, gathered in zip(dtypes, chunks):
        members = [i for i, x in enumerate(dense) if jnp.result_type(x) == dt]
        for i, x in zip(members, base.unpack(gathered.reshape(-1), [np.shape(dense[i]) for i in members])):
            out[i] = x
    return out


def gather_from_owners(
    arrays: Sequence[jax.Array], axis_name: base.AxisName | None, *, caller: str
) -> list[jax.Array]:
    """Every worker's ``arrays`` to every worker with ONE all-gather (any dtypes, bit-exact).

    Returns one ``(n, *shape)`` array per input (row ``j`` from worker
    ``j``), the same on every worker (typed replicated under shard_map).
    With ``axis_name=None`` (one worker): ``(1, *shape)``, no communication.
    """
    if axis_name is None:
        return [x[None] for x in arrays]
    return comm.all_gather_packed(list(arrays), axis_name, caller=caller)


def shard_init(groups: Sequence[Group], dtype_of: Any) -> tuple[jax.Array, ...]:
    """Zero per-worker shards ``(share, fan_in, fan_out)``, one per group with ``share > 0`` (``dtype_of(group)``).

    Groups without a slot are left out of the state: orbax cannot checkpoint
    zero-size arrays. :func:`per_group` puts them back.
    """
    return tuple(jnp.zeros((g.share, g.fan_in, g.fan_out), dtype_of(g)) for g in groups if g.share)


def rest_init(groups: Sequence[Group], dtype_of: Any) -> tuple[jax.Array, ...]:
    """Zero replicated remainders ``(rest, fan_in, fan_out)``, one per group with ``rest > 0`` (``dtype_of(group)``)."""
    return tuple(jnp.zeros((g.rest, g.fan_in, g.fan_out), dtype_of(g)) for g in groups if g.rest)


def per_group(stored: Sequence[jax.Array], sizes: Sequence[int], empty: Any) -> list[jax.Array]:
    """State arrays kept only where ``sizes[k] > 0``, back to one per group (``empty(k)`` elsewhere)."""
    it = iter(stored)
    return [next(it) if size else empty(k) for k, size in enumerate(sizes)]


def kept(arrays: Sequence[jax.Array], sizes: Sequence[int]) -> tuple[jax.Array, ...]:
    """Inverse of :func:`per_group`: the arrays of the groups with ``sizes[k] > 0``, for the state."""
    return tuple(x for x, size in zip(arrays, sizes) if size)


RESHARD_NOTE = (
    "Each worker's rows hold the momentum of its own 1/W of the matrices (different matrices, not "
    "copies to average), and their shapes depend on W. To resume on another number of workers, "
    "build the optimizer with the new num_workers and start its momentum afresh (tx.init); the rows "
    "stacked over the old workers, reshaped to (W * share, ...), followed by the replicated "
    "remainder (count % W matrices, the same on every worker), are each group's whole momentum, "
    "to redistribute by hand if it matters."
)
"""Why the sharded momentum cannot be regrouped, and what to do: the state classes' ``RESHARD_NOTE``."""


def workers(built: int, axis_name: base.AxisName | None, caller: str) -> int:
    """The number of workers ``update`` runs on: 1 with ``axis_name=None``, else the axis size.

    Raises when the axis has another size than the ``num_workers`` the state
    was built for (or is unbound).
    """
    if axis_name is None:
        return 1
    n = comm.require_axis(axis_name, caller)
    if n != built:
        raise ValueError(
            f"`{caller}` was built with num_workers={built} but runs on {n} workers: each worker's "
            f"state keeps the momentum of its own 1/{built} of each group of matrices, so it runs on "
            f"exactly {built}. Build it with num_workers={n} (a state cannot be regrouped for another "
            "number of workers: start the momentum afresh from the new optimizer's init)."
        )
    return n


def resolve_num_workers(num_workers: Any, axis_name: base.AxisName | None, caller: str) -> int:
    """``num_workers`` checked: needed by ``init`` to size the per-worker shards (1 when local)."""
    if axis_name is None:
        if num_workers is None or (base.check_positive_int(num_workers, "num_workers") == 1):
            return 1
        raise ValueError(
            f"`{caller}` with axis_name=None runs on one worker without communicating, so "
            f"`num_workers` must be None or 1; got {num_workers!r}. Give the data axis "
            "(axis_name='data') to split the momentum over the workers."
        )
    if num_workers is None:
        raise ValueError(
            f"`{caller}` needs `num_workers`, the size of the axis it runs over: each worker keeps "
            "the momentum of 1/num_workers of the matrices, and `init` sizes those shards "
            "(or axis_name=None: one worker, no communication)."
        )
    return base.check_positive_int(num_workers, "num_workers")


def check_replicated_params(params: Any, axis_name: base.AxisName | None, caller: str, name: str) -> None:
    """Rejects parameters typed per-worker (varying over ``axis_name`` under ``shard_map(check_vma=True)``).

    The updates are the same on every worker, so per-worker parameters would
    keep their differences forever. Nothing is tracked under ``vmap``: there
    the mistake cannot be seen. ``name`` names the algorithm in the message.
    """
    if axis_name is None or params is None:
        return
    bad = [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if comm.is_varying(x, axis_name)
    ]
    if bad:
        raise ValueError(
            f"`{caller}` got per-worker parameters (varying over {axis_name!r}: "
            f"{', '.join(bad[:4])}), e.g. from data_parallel_step(..., per_worker_params=True). Its "
            "updates are the same on every worker, so the workers' differences would never be "
            f"reconciled. Use axis_name=None for a local {name}, e.g. as DiLoCo's inner "
            "optimizer, or replicated parameters."
        )


# ----------------------------------------------------------------------------
# One step's plan and the exchange around the owners' work.


class Plan(NamedTuple):
    """Which leaves are matrices (and how they are viewed and grouped), which are dense."""

    views: dict[int, MatrixView]  # leaf index -> matrix view
    groups: tuple[Group, ...]
    dense: tuple[int, ...]  # leaf indices of the non-matrix leaves


def make_plan(tree: Any, spec: Any, n: int, *, caller: str, arg: str) -> Plan:
    """The :class:`Plan` of ``tree`` (params or updates) for ``n`` workers; ``spec`` as
    :func:`leaf_dimension_numbers` (``arg`` names it in errors)."""
    leaves = jax.tree.leaves(tree)
    dims = leaf_dimension_numbers(spec, tree, arg=arg)
    views = {
        i: matrix_view(tuple(np.shape(x)), d, caller=caller)
        for i, (x, d) in enumerate(zip(leaves, dims))
        if d is not None
    }
    groups = make_groups(views, [jnp.result_type(x) for x in leaves], n)
    return Plan(views, groups, tuple(i for i, d in enumerate(dims) if d is None))


def labels(spec: Any, tree: Any, matrix: str, other: str, *, arg: str) -> Any:
    """A tree like ``tree`` of ``matrix``/``other`` labels (for ``optax.partition``)."""
    dims = leaf_dimension_numbers(spec, tree, arg=arg)
    return jax.tree.unflatten(jax.tree.structure(tree), [matrix if d is not None else other for d in dims])


class Owned(NamedTuple):
    """What a worker receives from :func:`owned_means`."""

    leaves: list[Any]  # the updates' leaves (per-worker shares of already-reduced ones)
    treedef: Any
    plan: Plan
    shares: list[jax.Array]  # per group, the mean gradient of the slots this worker owns
    rests: list[jax.Array]  # per group, this worker's own gradient of the remainder matrices
    dense_chunks: list[jax.Array]  # per dtype, this worker's chunk of the dense leaves' and remainders' mean


def owned_means(
    updates: Any,
    spec: Any,
    n: int,
    axis_name: base.AxisName | None,
    invariant_updates: str,
    caller: str,
    arg: str,
) -> Owned:
    """The mean over the workers of the shares this worker owns, by ONE reduce-scatter per dtype.

    The remainder matrices of each group travel with the dense leaves (a
    ``1 / n`` chunk of their mean reaches each worker; :func:`gather_results`
    returns their whole mean to every worker). Leaves that arrive already reduced (typed invariant under shard_map) are
    first turned into per-worker shares (``invariant_updates``). With
    ``axis_name=None`` (``n == 1``) the updates are this worker's own and
    nothing is exchanged.
    """
    if axis_name is not None:
        updates = comm.per_worker_share(
            updates, axis_name, invariant_updates=invariant_updates, caller=caller
        )
    leaves, treedef = jax.tree.flatten(updates)
    plan = make_plan(updates, spec, n, caller=caller, arg=arg)
    stacks = [stack_group(leaves, plan.views, g, n) for g in plan.groups]
    rows, rests = [r for r, _ in stacks], [x for _, x in stacks]
    sent = [leaves[i] for i in plan.dense] + [x for x in rests if x.shape[0]]
    sums, dense_sums = reduce_to_owners(rows, sent, n, axis_name, caller=caller)
    mean = lambda x: x / jnp.asarray(n, x.dtype)  # noqa: E731
    return Owned(leaves, treedef, plan, [mean(x) for x in sums], rests, [mean(x) for x in dense_sums])


def gather_results(
    owned: Owned, per_group: Sequence[jax.Array], axis_name: base.AxisName | None, *, caller: str
) -> tuple[list[jax.Array], list[Any], list[jax.Array]]:
    """ONE all-gather of the owners' ``per_group`` results and the dense chunks.

    Returns ``(gathered per_group arrays, each (n, *shape); the output leaf
    list with the dense leaves' means filled in and None at the matrices;
    per group, the mean gradient of its remainder matrices, (rest, fan_in,
    fan_out), the same on every worker (typed replicated under shard_map))``.
    """
    gathered = gather_from_owners(list(per_group) + owned.dense_chunks, axis_name, caller=caller)
    out: list[Any] = [None] * len(owned.leaves)
    dense_leaves = [owned.leaves[i] for i in owned.plan.dense]
    sent_rests = [x for x in owned.rests if x.shape[0]]
    means = split_dense(gathered[len(per_group) :], dense_leaves + sent_rests)
    for i, x in zip(owned.plan.dense, means):
        out[i] = x
    rest_means, k = [], len(dense_leaves)
    for x in owned.rests:
        if x.shape[0]:
            rest_means.append(means[k])
            k += 1
        else:
            rest_means.append(jnp.zeros(x.shape, x.dtype))  # empty (and typed replicated)
    return gathered[: len(per_group)], out, rest_means
