"""Data-parallel step builders: shard_map over a mesh, with state placement done for you.

Placement rule. Inside ``jax.shard_map(check_vma=True)`` JAX types every value
as *invariant* (the same on every worker) or *varying* over an axis. The
functions here trace one optimizer update abstractly and read that type off
each state leaf: invariant leaves (counters, momentum after an all-reduce,
PowerSGD's ``q``) are stored once and placed replicated, ``P()``; varying leaves
(error-feedback residuals, per-worker keys, per-worker parameters) are stacked
along a new leading axis of size ``n`` and placed ``P(axis_name)``, so worker
``i`` holds row ``i``. Users write no PartitionSpec for optimizer state.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

P = jax.sharding.PartitionSpec

_CPU_STEPS_IN_FLIGHT = 4


def _names(axis_name: base.AxisName) -> tuple[Any, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _mesh_axis_size(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, axis_name: base.AxisName) -> int:
    names = _names(axis_name)
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.shape)} but `axis_name`={axis_name!r} names "
            f"{missing!r}. Build the mesh with that axis, e.g. jax.make_mesh((n,), ({names[0]!r},))."
        )
    return math.prod(mesh.shape[a] for a in names)


def check_batch(batch: Any, n: int, *, hint: str = "") -> None:
    """Every leaf of ``batch`` must split into ``n`` equal parts along its leading axis."""
    for x in jax.tree.leaves(batch):
        if np.ndim(x) == 0 or np.shape(x)[0] % n:
            raise ValueError(
                f"Every batch leaf needs a leading (batch) dimension divisible by the {n} workers; "
                f"got shape {np.shape(x)}.{hint}"
            )


def check_mesh(mesh: Any, axis_name: base.AxisName) -> int:
    """Checks that ``mesh`` is a Mesh with ``axis_name``; returns the number of workers."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)); got {type(mesh).__name__}."
        )
    return _mesh_axis_size(mesh, axis_name)


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with every axis typed Auto.

    Arrays placed on a mesh with Explicit axes (``jax.make_mesh``'s default on recent
    JAX) carry that mesh in their type, and eager code (Flax metrics, evaluation on
    one device) can no longer mix them with ordinary arrays.
    """
    return jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    )


def _spec(axis_name: base.AxisName) -> P:
    names = _names(axis_name)
    return P(names[0] if len(names) == 1 else names)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def _stack_abstract(tree: Any, n: int, sharding: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding), tree)


def _unstack(tree: Any, mask: Any) -> Any:
    return jax.tree.map(lambda x, m: x[0] if m else x, tree, mask)


def _restack(tree: Any, mask: Any) -> Any:
    return jax.tree.map(lambda x, m: x[None] if m else x, tree, mask)


def _float0_for_ints(grads: Any) -> Any:
    """Integer leaves as the float0 gradients ``jax.grad(..., allow_int=True)`` gives them."""
    return jax.tree.map(
        lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else np.zeros(x.shape, jax.dtypes.float0), grads
    )


def _apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``, keeping parameters whose update is float0 (integer leaves) as they are."""
    return jax.tree.map(lambda p, u: p if comm.is_float0(u) else optax.apply_updates(p, u), params, updates)


def _dummy_extras(params: Any, axis_name: base.AxisName) -> dict[str, Any]:
    """Line-search extra args with the types a real step gives (a varying loss)."""

    def value_fn(p):
        z = sum((jnp.sum(x) * 0).astype(jnp.float32) for x in jax.tree.leaves(p))
        return comm.to_varying(jnp.asarray(z, jnp.float32), axis_name)

    return {"value": value_fn(params), "value_fn": value_fn}


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


def _axes_spec(axes: tuple[Any, ...]) -> P:
    """The PartitionSpec of a leaf stacked over ``axes`` (``P()`` when empty)."""
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else axes)


def _spec_axes(spec: P) -> tuple[Any, ...]:
    """The axes of a leading-axis spec made by :func:`_axes_spec`."""
    if len(spec) == 0 or spec[0] is None:
        return ()
    return _names(spec[0])


def _spec_size(mesh: Any, spec: P) -> int:
    return math.prod(mesh.shape[a] for a in _spec_axes(spec))


def _leaf_specs(placement: Placement, axis_name: base.AxisName) -> Any:
    """``placement.specs``, or the specs its bools imply (all of ``axis_name``)."""
    if placement.specs is not None:
        return placement.specs
    spec = _spec(axis_name)
    return jax.tree.map(lambda m: spec if m else P(), placement.per_worker)


def _trace_placement(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    axis_name: base.AxisName,
    per_worker_params: bool,
) -> Placement:
    """A consistent invariant/varying typing of the state through one update.

    Each state leaf is typed by the set of data axes it varies over (for one
    axis: varying or not). First the least fixed point from "everything
    replicated": trace, add the axes each state leaf comes out varying over,
    repeat. That fails when a ``lax.cond`` returns a state leaf assumed
    replicated in one branch and a per-worker value in the other
    (``optax.MultiSteps`` accumulating gradients, finite-checks that skip a
    compressor's step): JAX rejects the mismatched branches before telling
    which leaf it was. Then the search goes the other way: from "everything
    per-worker over every axis" (or everything but the integer scalars when
    that does not type-check, as with optax.MultiSteps), groups of leaves are
    flipped to replicated, bisecting on failure, keeping every flip after
    which the trace still type-checks and the flipped leaves come out
    replicated.
    """
    n = _mesh_axis_size(mesh, axis_name)
    names = _names(axis_name)
    spec = _spec(axis_name)
    sharded = jax.sharding.NamedSharding(mesh, spec)
    replicated = jax.sharding.NamedSharding(mesh, P())
    p_local = _abstract(params)
    s_local = jax.eval_shape(tx.init, p_local)
    s_leaves, s_def = jax.tree.flatten(s_local)
    num = len(s_leaves)
    every: tuple[Any, ...] = tuple(names)

    def trace(varying: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], bool]:
        record: dict[str, Any] = {}
        mask = jax.tree.unflatten(s_def, [bool(v) for v in varying])

        def body(p, s, g):
            if per_worker_params:
                p = jax.tree.map(lambda x: x[0], p)
            s = _unstack(s, mask)
            g = _float0_for_ints(comm.to_varying(jax.tree.map(lambda x: x[0], g), axis_name))
            extras = _dummy_extras(p, axis_name)
            u, s2 = tx.update(g, s, p, **extras)
            record["u"] = any(comm.is_varying(x, axis_name) for x in jax.tree.leaves(u))
            record["s"] = [tuple(a for a in names if comm.is_varying(x, a)) for x in jax.tree.leaves(s2)]
            return jnp.zeros((1,), jnp.float32)

        in_p = (
            _stack_abstract(p_local, n, sharded) if per_worker_params else _with_sharding(p_local, replicated)
        )
        specs = [_axes_spec(v) for v in varying]
        in_s = jax.tree.unflatten(
            s_def,
            [
                jax.ShapeDtypeStruct(
                    (_spec_size(mesh, sp), *x.shape) if v else x.shape,
                    x.dtype,
                    sharding=jax.sharding.NamedSharding(mesh, sp),
                )
                for x, v, sp in zip(s_leaves, varying, specs)
            ],
        )
        in_g = _stack_abstract(p_local, n, sharded)
        p_spec = jax.tree.map(lambda _: spec if per_worker_params else P(), p_local)
        s_spec = jax.tree.unflatten(s_def, specs)
        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(p_spec, s_spec, jax.tree.map(lambda _: spec, p_local)),
            out_specs=spec,
            check_vma=True,
        )
        jax.eval_shape(fn, in_p, in_s, in_g)
        return record["s"], record["u"]

    def done(varying, updates_varying):
        return Placement(
            per_worker=jax.tree.unflatten(s_def, [bool(v) for v in varying]),
            updates_per_worker=updates_varying,
            specs=jax.tree.unflatten(s_def, [_axes_spec(v) for v in varying]),
        )

    def union(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(x for x in names if x in a or x in b)

    # 1. Least fixed point from "all replicated".
    varying: list[tuple[Any, ...]] = [()] * num
    try:
        for _ in range(num * len(names) + 2):
            out, updates_varying = trace(varying)
            new = [union(a, b) for a, b in zip(varying, out)]
            if new == varying:
                return done(varying, updates_varying)
            varying = new
    except Exception as e:  # noqa: BLE001 - JAX's cond/scan type errors have no common class
        first_error = e
    else:  # pragma: no cover - the loop above always converges
        return done(varying, updates_varying)

    def consistent(cand: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], bool] | None:
        try:
            out, upd = trace(cand)
        except Exception:  # noqa: BLE001
            return None
        if any(set(o) - set(c) for o, c in zip(out, cand)):
            return None  # a leaf came out varying over an axis assumed replicated
        return out, upd

    # 2. Refine down from "all per-worker" or, where a per-worker step counter
    # makes a cond's branches disagree (optax.MultiSteps: a per-worker counter
    # makes its updates per-worker, its skip branch returns replicated zeros),
    # from "all per-worker but the integer scalars".
    counters = [np.ndim(x) == 0 and not jnp.issubdtype(x.dtype, jnp.inexact) for x in s_leaves]
    for varying in ([every] * num, [() if c else every for c in counters]):
        res = consistent(varying)
        if res is not None:
            updates_varying = res[1]
            break
    else:
        raise _explain_wrapper_error(first_error) from None

    def refine(varying: list[tuple[Any, ...]], idxs: list[int]) -> list[tuple[Any, ...]]:
        nonlocal updates_varying
        idxs = [i for i in idxs if varying[i]]
        if not idxs:
            return varying
        cand = [() if i in idxs else v for i, v in enumerate(varying)]
        res = consistent(cand)
        if res is not None:
            updates_varying = res[1]
            return cand
        if len(idxs) == 1:
            return varying
        mid = len(idxs) // 2
        varying = refine(varying, idxs[:mid])
        return refine(varying, idxs[mid:])

    for _ in range(3):
        new = refine(varying, list(range(num)))
        if new == varying:
            break
        varying = new
    return done(varying, updates_varying)


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


def _with_sharding(tree: Any, sharding: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


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
    return _trace_placement(tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params)


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
    return _leaf_specs(placement, axis_name)


def _is_global(x: Any) -> bool:
    """Whether ``x`` is an array spanning devices of other processes (multi-host)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _stacked(x: Any, n: int, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """``n`` copies of ``x`` along a new leading axis, placed one row per worker.

    Each process puts one row on each of its own devices: the ``n`` copies are
    never materialized on one device, and nothing crosses the network.
    """
    if _is_global(x):
        return jax.device_put(jnp.broadcast_to(x, (n, *np.shape(x))), sharding)
    row = jnp.asarray(x)[None]
    shape = (n, *row.shape[1:])
    shards = [jax.device_put(row, d) for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _place(tree: Any, mask: Any, *, mesh: jax.sharding.Mesh, axis_name: base.AxisName) -> Any:
    n = _mesh_axis_size(mesh, axis_name)
    sharded = jax.sharding.NamedSharding(mesh, _spec(axis_name))
    replicated = jax.sharding.NamedSharding(mesh, P())

    def put(x, m):
        if m:
            return _stacked(x, n, sharded)
        # In a multi-process run, JAX checks that every process passes the same value.
        return jax.device_put(x, replicated)

    return jax.tree.map(put, tree, mask)


def _place_specs(tree: Any, specs: Any, *, mesh: jax.sharding.Mesh) -> Any:
    """Places each leaf by its spec: ``P()`` replicated, else stacked over the spec's axes."""

    def put(x, sp):
        if not _spec_axes(sp):
            return jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))
        return _stacked(x, _spec_size(mesh, sp), jax.sharding.NamedSharding(mesh, sp))

    return jax.tree.map(put, tree, specs)


def _global_batch(batch: Any, shardings: Any) -> Any:
    """Host batch leaves as global arrays, for meshes spanning several processes.

    Each leaf is read as the *global* batch: every process transfers only the
    rows of its own devices (the other rows are never read). ``jax.device_put``
    would instead all-gather the whole batch to check it is equal everywhere.
    """

    def make(x, s):
        if _is_global(x):
            return x
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        return jax.make_array_from_callback(np.shape(x), s, lambda idx: x[idx])

    return jax.tree.map(make, batch, shardings)


def place_params(
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker: bool = False,
) -> Any:
    """Puts one copy of the parameters on ``mesh``: replicated, or one copy per worker.

    With ``per_worker=True`` each leaf gets a leading axis of size ``n`` (worker
    ``i`` owns row ``i``), as :func:`data_parallel_step` expects for transforms
    with per-worker parameters (``average_params``, gossip).
    """
    axis_name = base.validate_axis_name(axis_name)
    mask = jax.tree.map(lambda _: per_worker, params)
    return _place(params, mask, mesh=mesh, axis_name=axis_name)


def init_opt_state(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
) -> Any:
    """Builds ``tx``'s state for data-parallel training on ``mesh``, placed.

    Replicated leaves are placed ``P()``; per-worker leaves are stacked along a
    leading axis of size ``n`` and placed ``P(axis_name)`` (see
    :func:`opt_state_placement`). ``init`` never communicates, so every worker
    starts from the same state.

    Args:
      tx: the optimizer.
      params: one copy of the parameters (not stacked).
      mesh: the device mesh.
      axis_name: the data axis (or tuple of axes) of ``mesh``.
      per_worker_params: whether parameters differ between workers.

    Returns:
      The placed optimizer state.
    """
    placement = opt_state_placement(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    )
    state = tx.init(params)
    return _place_specs(state, _leaf_specs(placement, axis_name), mesh=mesh)


def _check_layout(tree: Any, expected: Any, *, what: str, n: int, axis_name: base.AxisName, fix: str) -> None:
    """Raises unless ``tree``'s leaves have the shapes of ``expected`` (a layout on ``n`` workers).

    A per-worker leaf stacked for another number of workers would otherwise be
    resharded silently (rows dropped or split), losing per-worker state.
    """
    got, got_def = jax.tree_util.tree_flatten_with_path(tree)
    want, want_def = jax.tree.flatten(expected)
    if got_def != want_def:
        return  # a structural mismatch fails loudly in device_put
    for (path, x), w in zip(got, want):
        shape = tuple(np.shape(x))
        if shape == tuple(w.shape):
            continue
        where = f"`{what}` leaf {jax.tree_util.keystr(path) or '(root)'}"
        per_worker = getattr(w.sharding, "spec", P()) != P()
        if per_worker and len(shape) == len(w.shape) and shape[1:] == tuple(w.shape[1:]):
            raise ValueError(
                f"{where} holds per-worker values for {shape[0]} workers (leading dimension "
                f"{shape[0]}), but the mesh has {n} workers on axis {axis_name!r}. Passing it on "
                f"would drop or split workers' rows silently. Regroup it first: {fix}"
            )
        raise ValueError(
            f"{where} has shape {shape}; the layout for {n} workers on axis {axis_name!r} "
            f"needs {tuple(w.shape)} (per-worker leaves stacked along a leading axis of size "
            f"{n}, replicated leaves as one copy). Build it with step.init / init_opt_state."
        )


def _reshard_fix(what: str, n: int) -> str:
    if what == "params":
        return f"params = jaxopt_dist.reshard_params(params, num_workers={n})."
    return f"opt_state = jaxopt_dist.reshard_opt_state(opt_state, tx, params, num_workers={n})."


def place_opt_state(
    opt_state: Any,
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
) -> Any:
    """Places a host copy of ``tx``'s state (e.g. restored from a checkpoint) on ``mesh``.

    ``opt_state`` has the layout of :func:`init_opt_state`: per-worker leaves
    stacked along a leading axis of size ``n`` (the mesh's workers),
    replicated leaves as one copy. A state stacked for another number of
    workers is rejected; regroup it with :func:`jaxopt_dist.reshard_opt_state`.

    Args:
      opt_state: the state, as NumPy or JAX arrays.
      tx: the optimizer.
      params: one copy of the parameters (arrays or ShapeDtypeStructs).
      mesh: the device mesh.
      axis_name: the data axis (or tuple of axes) of ``mesh``.
      per_worker_params: whether parameters differ between workers.

    Returns:
      The state, per-worker leaves placed ``P(axis_name)``, the rest ``P()``.
    """
    axis_name = base.validate_axis_name(axis_name)
    n = _mesh_axis_size(mesh, axis_name)
    placement = opt_state_placement(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    )
    sharded = jax.sharding.NamedSharding(mesh, _spec(axis_name))
    replicated = jax.sharding.NamedSharding(mesh, P())
    local = jax.eval_shape(tx.init, _abstract(params))
    expected = jax.tree.map(
        lambda x, m: _stack_abstract(x, n, sharded) if m else _with_sharding(x, replicated),
        local,
        placement.per_worker,
    )
    _check_layout(
        opt_state, expected, what="opt_state", n=n, axis_name=axis_name, fix=_reshard_fix("opt_state", n)
    )
    return jax.device_put(opt_state, jax.tree.map(lambda x: x.sharding, expected))


@dataclasses.dataclass
class DataParallelStep:
    """A jitted data-parallel training step; see :func:`data_parallel_step`.

    Call it as ``params, opt_state, metrics = step(params, opt_state, batch)``.
    ``step.init(params)`` returns ``(params, opt_state)`` placed on the mesh.
    """

    loss_fn: Callable[..., Any]
    tx: Any  # an optax transformation, or anything with init/update (optax.MultiSteps)
    mesh: jax.sharding.Mesh
    axis_name: base.AxisName
    per_worker_params: bool
    has_aux: bool
    donate: bool
    loss_scale: Callable[[Any], Any] | None = None
    max_steps_in_flight: int | None = None
    _compiled: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_workers(self) -> int:
        return _mesh_axis_size(self.mesh, self.axis_name)

    def placement(self, params: Any) -> Placement:
        """The state placement for one copy of ``params``."""
        key = (
            jax.tree.structure(params),
            tuple((np.shape(x), str(jnp.result_type(x))) for x in jax.tree.leaves(params)),
        )
        if key not in self._compiled:
            placement = _trace_placement(
                self.tx,
                params,
                mesh=self.mesh,
                axis_name=self.axis_name,
                per_worker_params=self.per_worker_params,
            )
            if placement.updates_per_worker and not self.per_worker_params:
                raise ValueError(
                    "The optimizer's updates differ between workers, so replicated parameters "
                    "would drift apart. Either aggregate in the chain (e.g. optax.chain("
                    "jaxopt_dist.all_reduce(), jaxopt_dist.sgd(...))), or, for transforms that "
                    "keep per-worker parameters (average_params, gossip), pass "
                    "per_worker_params=True."
                )
            self._compiled[key] = placement
        return self._compiled[key]

    def init(self, params: Any) -> tuple[Any, Any]:
        """Places one copy of ``params`` and builds the optimizer state.

        Returns:
          ``(params, opt_state)`` ready for ``step``: params replicated, or
          stacked per worker when ``per_worker_params``.
        """
        placement = self.placement(params)
        state = _place_specs(self.tx.init(params), _leaf_specs(placement, self.axis_name), mesh=self.mesh)
        placed = place_params(
            params, mesh=self.mesh, axis_name=self.axis_name, per_worker=self.per_worker_params
        )
        return placed, state

    def abstract_init(self, params: Any) -> tuple[Any, Any]:
        """Like :meth:`init`, as ``jax.ShapeDtypeStruct`` leaves with shardings; nothing is allocated.

        The restore target for a checkpoint of ``(params, opt_state)``, e.g.
        ``ocp.args.StandardRestore(step.abstract_init(params0))`` with
        orbax-checkpoint: per-worker leaves come back stacked and placed
        ``P(axis_name)``, the rest replicated.
        """
        local = _abstract(params)
        n = self.num_workers
        sharded = jax.sharding.NamedSharding(self.mesh, _spec(self.axis_name))
        replicated = jax.sharding.NamedSharding(self.mesh, P())

        def placed(x, per_worker):
            return _stack_abstract(x, n, sharded) if per_worker else _with_sharding(x, replicated)

        def placed_spec(x, sp):
            if not _spec_axes(sp):
                return _with_sharding(x, replicated)
            return _stack_abstract(x, _spec_size(self.mesh, sp), jax.sharding.NamedSharding(self.mesh, sp))

        state = jax.eval_shape(self.tx.init, local)
        specs = _leaf_specs(self.placement(local), self.axis_name)
        return placed(local, self.per_worker_params), jax.tree.map(placed_spec, state, specs)

    def _local_params(self, params: Any) -> Any:
        if self.per_worker_params:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)), params)
        return params

    def _build(self, params: Any, batch: Any) -> Callable[..., Any]:
        placement = self.placement(self._local_params(params))
        mask = placement.per_worker
        axis_name = self.axis_name
        spec = _spec(axis_name)
        p_spec = jax.tree.map(lambda _: spec if self.per_worker_params else P(), params)
        s_spec = _leaf_specs(placement, axis_name)
        b_spec = jax.tree.map(lambda _: spec, batch)
        loss_fn, tx, has_aux, per_worker = self.loss_fn, self.tx, self.has_aux, self.per_worker_params
        loss_scale = self.loss_scale

        def body(params, opt_state, batch):
            p = jax.tree.map(lambda x: x[0], params) if per_worker else params
            s = _unstack(opt_state, mask)
            # Differentiate with respect to a per-worker copy: for replicated
            # params, shard_map's autodiff would otherwise sum the gradients over
            # the axis on its own, before the optimizer could see them.
            p_var = comm.to_varying(p, axis_name)

            scale = None if loss_scale is None else jnp.asarray(loss_scale(s), jnp.float32)

            def scaled_loss(q, b):
                out = loss_fn(q, b)
                if scale is None:
                    return out
                if has_aux:
                    return out[0].astype(jnp.float32) * scale, out[1]
                return out.astype(jnp.float32) * scale

            def value_fn(q):
                out = scaled_loss(q, batch)
                return out[0] if has_aux else out

            if has_aux:
                (loss, aux), grads = jax.value_and_grad(scaled_loss, has_aux=True, allow_int=True)(
                    p_var, batch
                )
            else:
                loss, grads = jax.value_and_grad(scaled_loss, allow_int=True)(p_var, batch)
                aux = None
            updates, s2 = tx.update(grads, s, p, value=loss, value_fn=value_fn)
            new_p = _apply_updates(p, updates)
            metrics = {"loss": comm.pmean(loss if scale is None else loss / scale, axis_name)}
            if has_aux:
                metrics["aux"] = comm.pmean(aux, axis_name)
            new_p = jax.tree.map(lambda x: x[None], new_p) if per_worker else new_p
            return new_p, _restack(s2, mask), metrics

        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(p_spec, s_spec, b_spec),
            out_specs=(p_spec, s_spec, P()),
            check_vma=True,
        )
        shard = lambda s: jax.sharding.NamedSharding(self.mesh, s)  # noqa: E731
        in_shardings = (
            jax.tree.map(shard, p_spec),
            jax.tree.map(shard, s_spec),
            jax.tree.map(shard, b_spec),
        )
        jitted = jax.jit(fn, donate_argnums=(0, 1) if self.donate else ())

        def run(params, opt_state, batch):
            # One device_put for the whole call: a no-op for arrays already in
            # place, a transfer for host batches, a reshard otherwise. (jit's own
            # in_shardings would not retype arrays for meshes with Explicit axes.)
            if multi_process:
                batch = _global_batch(batch, in_shardings[2])
            params, opt_state, batch = jax.device_put((params, opt_state, batch), in_shardings)
            out = jitted(params, opt_state, batch)
            if limit is not None:
                in_flight.append(out[2]["loss"])
                if len(in_flight) > limit:
                    in_flight.popleft().block_until_ready()
            return out

        multi_process = self.mesh.is_multi_process
        limit = self._in_flight_limit()
        in_flight: collections.deque[Any] = collections.deque()
        return run

    def _in_flight_limit(self) -> int | None:
        if self.max_steps_in_flight is not None:
            return self.max_steps_in_flight
        # XLA:CPU can deadlock (a collective's rendezvous times out and aborts the
        # process) when a few dozen steps with collectives are queued on simulated
        # devices; bound the queue there. Accelerators keep unbounded async dispatch.
        if all(d.platform == "cpu" for d in self.mesh.devices.flat):
            return _CPU_STEPS_IN_FLIGHT
        return None

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        # The state's shapes are in the key too: a state laid out for another number of
        # workers misses the cache and is rejected below instead of being recompiled for.
        key = (
            jax.tree.structure((params, opt_state, batch)),
            tuple((np.shape(x), str(jnp.result_type(x))) for x in jax.tree.leaves((params, batch))),
            tuple(np.shape(x) for x in jax.tree.leaves(opt_state)),
        )
        fn = self._compiled.get(("step", key))
        if fn is None:
            self._check_layouts(params, opt_state)
            check_batch(batch, self.num_workers)
            fn = self._build(params, batch)
            self._compiled[("step", key)] = fn
        return fn(params, opt_state, batch)

    def _check_layouts(self, params: Any, opt_state: Any) -> None:
        """Rejects params or state laid out for another number of workers."""
        n = self.num_workers
        key = ("layout", jax.tree.structure(params), tuple(np.shape(x) for x in jax.tree.leaves(params)))
        if key not in self._compiled:
            self._compiled[key] = self.abstract_init(self._local_params(params))
        p_want, s_want = self._compiled[key]
        for what, tree, want in (("params", params, p_want), ("opt_state", opt_state, s_want)):
            _check_layout(tree, want, what=what, n=n, axis_name=self.axis_name, fix=_reshard_fix(what, n))


def data_parallel_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
    has_aux: bool = False,
    donate: bool = False,
    loss_scale: Callable[[Any], Any] | None = None,
    max_steps_in_flight: int | None = None,
) -> DataParallelStep:
    r"""Builds a jitted data-parallel training step over ``mesh``.

    The step runs ``jax.shard_map`` with the batch split along ``axis_name``:
    each worker computes the gradient of ``loss_fn`` on its shard, ``tx``
    aggregates/compresses and steps (all communication happens inside ``tx``),
    and the parameters are updated with :func:`optax.apply_updates`.

    ``tx.update`` receives the line-search extra args ``value`` (this worker's
    loss) and ``value_fn`` (params -> this worker's loss on the same shard).

    Multi-host (``jax.distributed``, a mesh over the devices of every
    process): every process calls the step with the same arguments. A batch
    leaf that is already a global ``jax.Array`` (e.g. from
    :func:`jax.make_array_from_process_local_data`) is used as is; a NumPy
    leaf (or an array on this process's devices only) is read as the *global*
    batch, and each process transfers only the rows of its own devices.
    ``init`` expects the same parameters on every process (JAX checks the
    replicated ones).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
        ``has_aux``), for one worker's shard of the batch.
      tx: the optimizer, e.g. ``optax.chain(all_reduce(), sgd(0.1, momentum=0.9))``.
      mesh: a mesh with the axis ``axis_name``, e.g. ``jax.make_mesh((8,), ("data",))``.
      axis_name: the data axis (or tuple of axes).
      per_worker_params: keep one copy of the parameters per worker (stacked
        along a leading axis), for transforms whose updates differ between
        workers (``average_params``, gossip). Otherwise parameters are
        replicated, and a transform whose updates would differ is rejected.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (floats) is averaged
        over workers into ``metrics["aux"]``.
      donate: donate params and state buffers to the step.
      loss_scale: ``loss_scale(opt_state) -> scale`` for mixed precision with
        :func:`jaxopt_dist.dynamic_loss_scale`: pass ``jaxopt_dist.loss_scale``.
        The loss is multiplied by the scale (in float32) before
        differentiation; ``dynamic_loss_scale`` unscales the gradients and the
        line-search extra args. ``metrics["loss"]`` stays unscaled.
      max_steps_in_flight: how many dispatched steps may run ahead of the
        host before a call waits for the oldest. None: unbounded on
        accelerators, 4 on CPU meshes, where XLA:CPU's in-process collectives
        can deadlock when a few dozen steps with collectives are queued.

    Returns:
      A :class:`DataParallelStep`: ``step(params, opt_state, batch) ->
      (params, opt_state, metrics)`` with ``metrics["loss"]`` the loss averaged
      over workers, and ``step.init(params) -> (params, opt_state)``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> tx = optax.chain(jd.all_reduce(), jd.sgd(0.1, momentum=0.9))
      >>> step = jd.data_parallel_step(loss, tx, mesh=mesh)
      >>> params, opt_state = step.init(jnp.zeros(3))
      >>> batch = {"x": jnp.ones((8 * jax.device_count(), 3)), "y": jnp.ones(8 * jax.device_count())}
      >>> params, opt_state, metrics = step(params, opt_state, batch)
      >>> float(metrics["loss"])
      1.0
    """
    axis_name = base.validate_axis_name(axis_name)
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable; got {loss_fn!r}.")
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"`tx` must be an optax.GradientTransformation (or have init/update, like optax.MultiSteps); "
            f"got {type(tx).__name__}."
        )
    if max_steps_in_flight is not None:
        max_steps_in_flight = base.check_positive_int(max_steps_in_flight, "max_steps_in_flight")
    if loss_scale is not None and not callable(loss_scale):
        raise TypeError(
            f"`loss_scale` must be a function of the optimizer state (e.g. jaxopt_dist.loss_scale); got {loss_scale!r}."
        )
    check_mesh(mesh, axis_name)
    return DataParallelStep(
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        per_worker_params=bool(per_worker_params),
        has_aux=bool(has_aux),
        donate=bool(donate),
        loss_scale=loss_scale,
        max_steps_in_flight=max_steps_in_flight,
    )
