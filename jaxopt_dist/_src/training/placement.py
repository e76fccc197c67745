"""Which optimizer-state leaves are per-worker, read off one abstract update.

Inside ``jax.shard_map(check_vma=True)`` JAX types every value as *invariant*
(the same on every worker) or *varying* over an axis. :func:`trace_placement`
traces one optimizer update abstractly and reads that type off each state
leaf: invariant leaves (counters, momentum after an all-reduce, PowerSGD's
``q``) are stored once and placed replicated, ``P()``; varying leaves
(error-feedback residuals, per-worker keys) are stacked along a new leading
axis and placed ``P(axis_name)`` (see :mod:`.layout`). Nothing is computed or
communicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout

P = jax.sharding.PartitionSpec
Axes = tuple[Any, ...]  # the data axes a state leaf varies over (empty: replicated)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each leaf of an optimizer state lives on the data axis.

    Attributes:
      per_worker: pytree of bools like the (local) state: True for leaves that
        differ between workers (stored stacked, leading axis = worker).
      updates_per_worker: whether the transform's output updates differ
        between workers (then parameters must be per-worker).
      specs: pytree of PartitionSpecs like the state: ``P()`` for replicated
        leaves, else the data axes the leaf varies over. On a 2-D mesh with
        ``axis_name=("dcn", "ici")`` a residual kept once per ``"dcn"`` group
        (the same on every ``"ici"`` worker) is ``P("dcn")``, stacked over
        the ``"dcn"`` axis only; a leaf that differs on every device is
        ``P(("dcn", "ici"))``. None: every per-worker leaf spans all of
        ``axis_name``.
    """

    per_worker: Any
    updates_per_worker: bool
    specs: Any = None


def leaf_specs(placement: Placement, axis_name: base.AxisName) -> Any:
    """``placement.specs``, or the specs its bools imply (all of ``axis_name``)."""
    if placement.specs is not None:
        return placement.specs
    return layout.mask_specs(placement.per_worker, axis_name)


def float0_for_ints(grads: Any) -> Any:
    """Integer leaves as the float0 gradients ``jax.grad(..., allow_int=True)`` gives them."""
    return jax.tree.map(
        lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else np.zeros(x.shape, jax.dtypes.float0), grads
    )


def dummy_extras(params: Any, axis_name: base.AxisName) -> dict[str, Any]:
    """Line-search extra args with the types a real step gives (a varying loss)."""

    def value_fn(p):
        z = sum((jnp.sum(x) * 0).astype(jnp.float32) for x in jax.tree.leaves(p))
        return comm.to_varying(jnp.asarray(z, jnp.float32), axis_name)

    return {"value": value_fn(params), "value_fn": value_fn}


# optax wrappers whose lax.cond cannot type-check (or be right) with per-worker
# inputs, found by the file of the branch functions in JAX's error message.
_WRAPPER_FIXES = (
    (
        "_conditionality.py",
        "optax.apply_if_finite decides on each worker from that worker's gradients, so one "
        "worker could skip a step (and its collectives) while the others take it. Use "
        "jaxopt_dist.apply_if_finite_everywhere(inner, max_consecutive_errors, axis_name=...), "
        "which skips on every worker together.",
    ),
    (
        "_reduce_on_plateau.py",
        "optax.contrib.reduce_on_plateau received this worker's own loss as `value`, so every "
        "worker would keep its own learning-rate scale. Give it the mean loss: wrap it as "
        "jaxopt_dist.mean_value(optax.contrib.reduce_on_plateau(...), axis_name=...), or pass "
        "value=jax.lax.pmean(loss, axis_name) in your own loop.",
    ),
)


def _explain_wrapper_error(e: Exception) -> Exception:
    """A clearer error for the optax wrappers that cannot run per-worker; else ``e``."""
    text = str(e)
    if "cond branches must have equal output types" not in text:
        return e
    for marker, fix in _WRAPPER_FIXES:
        if marker in text:
            return TypeError(f"{fix} (JAX reported: {text.splitlines()[0]})")
    return e


class _Typing:
    """One abstract update of ``tx`` under ``shard_map``, for a guess of each state leaf's axes."""

    def __init__(self, tx: Any, params: Any, mesh: Any, axis_name: base.AxisName, per_worker_params: bool):
        self.tx, self.mesh, self.axis_name = tx, mesh, axis_name
        self.per_worker_params = per_worker_params
        self.names: Axes = base.axis_names(axis_name)
        self.params = base.abstract(params)
        self.leaves, self.treedef = jax.tree.flatten(jax.eval_shape(tx.init, self.params))

    def trace(self, varying: list[Axes]) -> tuple[list[Axes], bool]:
        """The axes each state leaf comes out varying over, and whether the updates vary."""
        record: dict[str, Any] = {}
        mask = jax.tree.unflatten(self.treedef, [bool(v) for v in varying])
        tx, axis_name, names, per_worker_params = self.tx, self.axis_name, self.names, self.per_worker_params

        def body(p, s, g):
            p = layout.first_rows(p) if per_worker_params else p
            s = layout.first_rows(s, mask)
            g = float0_for_ints(comm.to_varying(layout.first_rows(g), axis_name))
            u, s2 = tx.update(g, s, p, **dummy_extras(p, axis_name))
            record["u"] = any(comm.is_varying(x, axis_name) for x in jax.tree.leaves(u))
            record["s"] = [tuple(a for a in names if comm.is_varying(x, a)) for x in jax.tree.leaves(s2)]
            return jnp.zeros((1,), jnp.float32)

        spec = layout.data_spec(axis_name)
        p_spec = jax.tree.map(lambda _: spec if per_worker_params else P(), self.params)
        s_spec = jax.tree.unflatten(self.treedef, [layout.axes_spec(v) for v in varying])
        g_spec = jax.tree.map(lambda _: spec, self.params)
        fn = jax.shard_map(
            body, mesh=self.mesh, in_specs=(p_spec, s_spec, g_spec), out_specs=spec, check_vma=True
        )
        local_state = jax.tree.unflatten(self.treedef, self.leaves)
        args = (
            layout.placed_abstract(self.params, p_spec, self.mesh),
            layout.placed_abstract(local_state, s_spec, self.mesh),
            layout.placed_abstract(self.params, g_spec, self.mesh),
        )
        jax.eval_shape(fn, *args)
        return record["s"], record["u"]

    def consistent(self, cand: list[Axes]) -> tuple[list[Axes], bool] | None:
        """The trace of ``cand`` if it type-checks and no leaf varies beyond its guess."""
        try:
            out, upd = self.trace(cand)
        except Exception:  # noqa: BLE001 - JAX's cond/scan type errors have no common class
            return None
        if any(set(o) - set(c) for o, c in zip(out, cand)):
            return None  # a leaf came out varying over an axis assumed replicated
        return out, upd

    def placement(self, varying: list[Axes], updates_varying: bool) -> Placement:
        return Placement(
            per_worker=jax.tree.unflatten(self.treedef, [bool(v) for v in varying]),
            updates_per_worker=updates_varying,
            specs=jax.tree.unflatten(self.treedef, [layout.axes_spec(v) for v in varying]),
        )


def _from_below(typing: _Typing) -> tuple[list[Axes], bool]:
    """The least fixed point from "everything replicated": trace, add the axes leaves vary over."""
    names = typing.names
    varying: list[Axes] = [()] * len(typing.leaves)
    for _ in range(len(varying) * len(names) + 2):
        out, updates_varying = typing.trace(varying)
        new = [tuple(x for x in names if x in a or x in b) for a, b in zip(varying, out)]
        if new == varying:
            return varying, updates_varying
        varying = new
    return varying, updates_varying  # pragma: no cover - the loop above always converges


def _from_above(typing: _Typing, first_error: Exception) -> tuple[list[Axes], bool]:
    """From "every leaf per-worker over every axis", flip groups of leaves to replicated.

    The start is "all per-worker" or, where a per-worker step counter makes a
    cond's branches disagree (optax.MultiSteps: a per-worker counter makes its
    updates per-worker, its skip branch returns replicated zeros), "all
    per-worker but the integer scalars". Flips are kept while the trace still
    type-checks and the flipped leaves come out replicated, bisecting on failure.
    """
    every, num = typing.names, len(typing.leaves)
    counters = [np.ndim(x) == 0 and not jnp.issubdtype(x.dtype, jnp.inexact) for x in typing.leaves]
    for start in ([every] * num, [() if c else every for c in counters]):
        res = typing.consistent(start)
        if res is not None:
            break
    else:
        raise _explain_wrapper_error(first_error) from None
    best = {"varying": start, "updates": res[1]}

    def refine(varying: list[Axes], idxs: list[int]) -> list[Axes]:
        idxs = [i for i in idxs if varying[i]]
        if not idxs:
            return varying
        cand = [() if i in idxs else v for i, v in enumerate(varying)]
        found = typing.consistent(cand)
        if found is not None:
            best["updates"] = found[1]
            return cand
        if len(idxs) == 1:
            return varying
        mid = len(idxs) // 2
        return refine(refine(varying, idxs[:mid]), idxs[mid:])

    varying = start
    for _ in range(3):
        new = refine(varying, list(range(num)))
        if new == varying:
            break
        varying = new
    return varying, best["updates"]


def trace_placement(
    tx: Any,
    params: Any,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    axis_name: base.AxisName,
    per_worker_params: bool,
) -> Placement:
    """A consistent invariant/varying typing of the state through one update.

    Each state leaf is typed by the set of data axes it varies over (for one
    axis: varying or not). First the least fixed point from "everything
    replicated" (:func:`_from_below`). That fails when a ``lax.cond`` returns a
    state leaf assumed replicated in one branch and a per-worker value in the
    other (``optax.MultiSteps`` accumulating gradients, finite-checks that skip
    a compressor's step): JAX rejects the mismatched branches before telling
    which leaf it was. Then the search goes the other way (:func:`_from_above`).
    """
    layout.mesh_axis_size(mesh, axis_name)
    typing = _Typing(tx, params, mesh, axis_name, per_worker_params)
    try:
        try:
            varying, updates_varying = _from_below(typing)
        except Exception as e:  # noqa: BLE001 - JAX's cond/scan type errors have no common class
            varying, updates_varying = _from_above(typing, e)
    except Exception as e:
        not_float = non_float_paths(params)
        if not not_float:
            raise
        raise ValueError(non_float_message(not_float, e)) from e
    return typing.placement(varying, updates_varying)


def non_float_paths(params: Any) -> list[tuple[str, Any]]:
    """``(path, dtype)`` of each leaf of ``params`` that is not floating point."""
    return [
        (jax.tree_util.keystr(path), jnp.result_type(x))
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


def non_float_message(not_float: list[tuple[str, Any]], error: Exception) -> str:
    """The error for an optimizer that cannot take the gradients of integer parameters."""
    names = ", ".join(f"{path} ({dtype})" for path, dtype in not_float)
    return (
        f"The parameters hold non-floating-point leaves: {names}. Their gradients are float0 "
        "(jax.grad(..., allow_int=True)), and the optimizer fails on them: "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. Keep such "
        "values out of the parameters (in the batch or a closure; NNX: an nnx.Variable, not "
        "nnx.Param; linen: a collection other than 'params'), or use transforms that pass integer "
        "leaves through unchanged: jaxopt_dist's aggregation and compression transforms and its "
        "optimizers do (e.g. jaxopt_dist.adam or jaxopt_dist.sgd in place of optax.adam), optax's "
        "adam and adamw do not."
    )


def opt_state_placement(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
) -> Placement:
    """Which leaves of ``tx``'s state are per-worker on ``mesh`` (see module doc).

    Found by tracing one update abstractly under ``jax.shard_map(check_vma=True)``
    with per-worker gradients; nothing is computed or communicated.

    Args:
      tx: the optimizer (any optax transformation, possibly a chain).
      params: one copy of the parameters (arrays or ShapeDtypeStructs).
      mesh: the device mesh.
      axis_name: the data axis (or tuple of axes) of ``mesh``.
      per_worker_params: whether parameters differ between workers.

    Returns:
      A :class:`Placement`.
    """
    axis_name = base.validate_axis_name(axis_name)
    return trace_placement(tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params)


def opt_state_specs(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
) -> Any:
    """PartitionSpecs for ``tx``'s state as laid out by :func:`init_opt_state`.

    Use them as ``in_specs``/``out_specs`` of your own ``jax.shard_map``:
    per-worker leaves are ``P(axis_name)`` with a leading worker axis (take
    ``x[0]`` inside the map), replicated ones ``P()``. With a tuple
    ``axis_name``, a leaf that varies over some of its axes only is stacked
    over those (e.g. ``P("dcn")`` for a residual kept once per ``"dcn"``
    group by :func:`jaxopt_dist.hierarchical`).
    """
    placement = opt_state_placement(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    )
    return leaf_specs(placement, axis_name)


def replicated_params_placement(tx: Any, params: Any, *, mesh: Any, axis_name: base.AxisName) -> Placement:
    """:func:`opt_state_placement` for replicated parameters, rejecting updates that differ by worker."""
    placement = opt_state_placement(tx, params, mesh=mesh, axis_name=axis_name)
    if placement.updates_per_worker:
        raise ValueError(DRIFT_MESSAGE)
    return placement


DRIFT_MESSAGE = (
    "The optimizer's updates differ between workers, so replicated parameters would drift apart. "
    "Either aggregate in the chain (e.g. optax.chain(jaxopt_dist.all_reduce(), optax.adamw(...)) or "
    "optax.chain(jaxopt_dist.powersgd(rank=2), optax.adamw(...))), or, with data_parallel_step and "
    "transforms that keep per-worker parameters (average_params, gossip, diloco, desloc_adam), pass "
    "per_worker_params=True."
)
"""The one error for a transform whose updates would make replicated parameters drift."""
