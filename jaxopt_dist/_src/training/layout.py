"""The stacked layout of per-worker values and its placement on a mesh.

Inside ``jax.shard_map(check_vma=True)`` a value is *invariant* (the same on
every worker) or *varying* over the data axes. Outside, a varying value is
stored stacked: a new leading axis of size ``n`` (the workers it varies over),
placed ``P(axis_name)``, so worker ``i`` holds row ``i``; an invariant value is
stored once and placed ``P()``. Everything here works on that layout.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_dist._src import base

P = jax.sharding.PartitionSpec

CPU_STEPS_IN_FLIGHT = 4
"""Dispatched steps allowed ahead of the host on CPU meshes (XLA:CPU collectives can deadlock)."""


def mesh_axis_size(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, axis_name: base.AxisName) -> int:
    """The number of workers on ``axis_name`` of ``mesh``; a clear error if an axis is missing."""
    names = base.axis_names(axis_name)
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.shape)} but `axis_name`={axis_name!r} names "
            f"{missing!r}. Build the mesh with that axis, e.g. jax.make_mesh((n,), ({names[0]!r},))."
        )
    return math.prod(mesh.shape[a] for a in names)


def check_mesh(mesh: Any, axis_name: base.AxisName) -> int:
    """Checks that ``mesh`` is a Mesh with ``axis_name``; returns the number of workers."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)); got {type(mesh).__name__}."
        )
    return mesh_axis_size(mesh, axis_name)


def check_batch(batch: Any, n: int, *, hint: str = "") -> None:
    """Every leaf of ``batch`` must split into ``n`` equal parts along its leading axis."""
    for x in jax.tree.leaves(batch):
        if np.ndim(x) == 0 or np.shape(x)[0] % n:
            raise ValueError(
                f"Every batch leaf needs a leading (batch) dimension divisible by the {n} workers; "
                f"got shape {np.shape(x)}.{hint}"
            )


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with every axis typed Auto.

    Arrays placed on a mesh with Explicit axes (``jax.make_mesh``'s default on recent
    JAX) carry that mesh in their type, and eager code (Flax metrics, evaluation on
    one device) can no longer mix them with ordinary arrays.
    """
    return jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    )


def on_cpu(mesh: jax.sharding.Mesh) -> bool:
    """Whether every device of ``mesh`` is a CPU."""
    return all(d.platform == "cpu" for d in mesh.devices.flat)


# ----------------------------------------------------------------------------
# Specs of stacked leaves.


def data_spec(axis_name: base.AxisName) -> P:
    """The spec of a leaf stacked over all of ``axis_name``."""
    return axes_spec(base.axis_names(axis_name))


def axes_spec(axes: tuple[Any, ...]) -> P:
    """The PartitionSpec of a leaf stacked over ``axes`` (``P()`` when empty)."""
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else tuple(axes))


def spec_axes(spec: P) -> tuple[Any, ...]:
    """The axes of a leading-axis spec made by :func:`axes_spec`."""
    if len(spec) == 0 or spec[0] is None:
        return ()
    return base.axis_names(spec[0])


def full_spec(stack: P, model: P) -> P:
    """A leaf's spec: the data axes it is stacked over (leading axis), then its model-axis spec."""
    if not spec_axes(stack):
        return model
    return P(stack[0], *model)


def full_specs(stack_specs: Any, model_specs: Any | None) -> Any:
    """:func:`full_spec` over two trees of specs (``model_specs`` None: the stack specs alone)."""
    if model_specs is None:
        return stack_specs
    return jax.tree.map(full_spec, stack_specs, model_specs, is_leaf=lambda x: isinstance(x, P))


def spec_size(mesh: Any, spec: P) -> int:
    """The length of the leading axis of a leaf stacked by ``spec`` on ``mesh``."""
    return math.prod(mesh.shape[a] for a in spec_axes(spec))


# ----------------------------------------------------------------------------
# Stacking and unstacking (inside a step) and abstract layouts.


def first_rows(tree: Any, mask: Any = None) -> Any:
    """Inside a step: this worker's row of each stacked leaf (where ``mask`` is True, or every leaf)."""
    if mask is None:
        return jax.tree.map(lambda x: x[0], tree)
    return jax.tree.map(lambda x, m: x[0] if m else x, tree, mask)


def add_rows(tree: Any, mask: Any = None) -> Any:
    """Inside a step: each leaf (where ``mask`` is True, or every leaf) as a stacked row of one."""
    if mask is None:
        return jax.tree.map(lambda x: x[None], tree)
    return jax.tree.map(lambda x, m: x[None] if m else x, tree, mask)


def with_sharding(tree: Any, sharding: Any) -> Any:
    """``tree``'s leaves as ``ShapeDtypeStruct``s carrying ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def stack_abstract(tree: Any, n: int, sharding: Any) -> Any:
    """``tree``'s leaves as ``ShapeDtypeStruct``s stacked ``n`` times, carrying ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding), tree)


def placed_abstract(tree: Any, specs: Any, mesh: Any, model_specs: Any | None = None) -> Any:
    """``tree`` (one worker's copy) laid out by ``specs``, as sharded ``ShapeDtypeStruct``s.

    ``model_specs`` (like ``tree``) shards each leaf over the model axes too.
    """
    model_specs = jax.tree.map(lambda _: P(), tree) if model_specs is None else model_specs

    def one(x, sp, model):
        sharding = jax.sharding.NamedSharding(mesh, full_spec(sp, model))
        if not spec_axes(sp):
            return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)
        return jax.ShapeDtypeStruct(
            (spec_size(mesh, sp), *np.shape(x)), jnp.result_type(x), sharding=sharding
        )

    return jax.tree.map(one, tree, specs, model_specs)


def mask_specs(mask: Any, axis_name: base.AxisName) -> Any:
    """Specs from a tree of bools: stacked over all of ``axis_name`` where True, else ``P()``."""
    spec = data_spec(axis_name)
    return jax.tree.map(lambda m: spec if m else P(), mask)


# ----------------------------------------------------------------------------
# Placing arrays.


def is_global(x: Any) -> bool:
    """Whether ``x`` is an array spanning devices of other processes (multi-host)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def stacked(x: Any, n: int, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """``n`` copies of ``x`` along a new leading axis, placed one row per worker.

    Each process puts one row on each of its own devices: the ``n`` copies are
    never materialized on one device, and nothing crosses the network.
    """
    if is_global(x):
        return jax.device_put(jnp.broadcast_to(x, (n, *np.shape(x))), sharding)
    # On the host: under a multi-process mesh context (sharded models), jnp would place the row
    # over every process's devices, and a per-device slice of it could not be put on one device.
    row = np.asarray(jax.device_get(x))[None]
    shape = (n, *row.shape[1:])
    # Each device gets its own block of the row (all of it unless the spec shards model axes too).
    shards = [
        jax.device_put(row[(slice(None), *(idx or (slice(None),))[1:])], d)
        for d, idx in sharding.addressable_devices_indices_map(shape).items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def place_by_specs(tree: Any, specs: Any, *, mesh: jax.sharding.Mesh, model_specs: Any | None = None) -> Any:
    """Places each leaf (one copy) by its spec: ``P()`` replicated, else stacked over the spec's axes.

    ``model_specs`` (like ``tree``) shards each leaf over the model axes too. In a
    multi-process run, JAX checks that every process passes the same replicated value.
    """
    model_specs = jax.tree.map(lambda _: P(), tree) if model_specs is None else model_specs

    def put(x, sp, model):
        sharding = jax.sharding.NamedSharding(mesh, full_spec(sp, model))
        if not spec_axes(sp):
            return jax.device_put(x, sharding)
        return stacked(x, spec_size(mesh, sp), sharding)

    return jax.tree.map(put, tree, specs, model_specs)


def global_batch(batch: Any, shardings: Any) -> Any:
    """Host batch leaves as global arrays, for meshes spanning several processes.

    Each leaf is read as the *global* batch: every process transfers only the
    rows of its own devices (the other rows are never read). ``jax.device_put``
    would instead all-gather the whole batch to check it is equal everywhere.
    """

    def make(x, s):
        if is_global(x):
            return x
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        return jax.make_array_from_callback(np.shape(x), s, lambda idx: x[idx])

    return jax.tree.map(make, batch, shardings)


# ----------------------------------------------------------------------------
# Checking a layout.


def reshard_fix(what: str, n: int) -> str:
    """What to write to regroup ``what`` (``"params"`` or ``"opt_state"``) for ``n`` workers."""
    if what == "params":
        return f"params = jaxopt_dist.reshard_params(params, num_workers={n})."
    return f"opt_state = jaxopt_dist.reshard_opt_state(opt_state, tx, params, num_workers={n})."


def check_layout(
    tree: Any, expected: Any, *, what: str, n: int, axis_name: base.AxisName, fix: str | None = None
) -> None:
    """Raises unless ``tree``'s leaves have the shapes of ``expected`` (a layout on ``n`` workers).

    A per-worker leaf stacked for another number of workers would otherwise be
    resharded silently (rows dropped or split), losing per-worker state.
    ``fix``: what to write to regroup it (default: :func:`reshard_fix`).
    """
    got, got_def = jax.tree_util.tree_flatten_with_path(tree)
    want, want_def = jax.tree.flatten(expected)
    if got_def != want_def:
        return  # a structural mismatch fails loudly in device_put
    for (path, x), w in zip(got, want):
        where = f"`{what}` leaf {jax.tree_util.keystr(path) or '(root)'}"
        _check_leaf(tuple(np.shape(x)), w, where, n=n, axis_name=axis_name, fix=fix or reshard_fix(what, n))


def _check_leaf(
    shape: tuple[int, ...], w: Any, where: str, *, n: int, axis_name: base.AxisName, fix: str
) -> None:
    if shape == tuple(w.shape):
        return
    spec = getattr(getattr(w, "sharding", None), "spec", P())
    per_worker = bool(set(spec_axes(spec)) & set(base.axis_names(axis_name)))
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


def stacked_leaves(tree: Any, axis_name: base.AxisName) -> list[str]:
    """The paths of ``tree``'s leaves that are placed stacked over the data axes (an array or
    ``ShapeDtypeStruct`` whose sharding splits its leading dimension over ``axis_name``), as a
    step's per-worker leaves are."""
    names = set(base.axis_names(axis_name))
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if isinstance(spec, P) and set(spec_axes(spec)) & names:
            out.append(jax.tree_util.keystr(path) or "(root)")
    return out


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A ``jax.tree_util`` key path as strings, the same for a NamedTuple field, a dict key and
    a sequence index of that name (as a checkpoint library's metadata spells them)."""
    out = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                k = getattr(k, attr)
                break
        out.append(str(k))
    return tuple(out)


def check_saved(saved: Any, target: Any, *, n: int, axis_name: base.AxisName, fix: str) -> None:
    """Raises unless the shapes a checkpoint holds (``saved``: its metadata, any tree whose
    leaves have a ``shape``, e.g. orbax's ``mngr.item_metadata(step)``) are those of ``target``
    (the restore target for ``n`` workers), leaf by leaf, found by path. Leaves of one and not
    the other are left for the checkpoint library to report."""
    saved = getattr(saved, "tree", saved)
    shapes = {
        path_names(p): tuple(x.shape)
        for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]
        if getattr(x, "shape", None) is not None
    }
    for path, w in jax.tree_util.tree_flatten_with_path(target)[0]:
        shape = shapes.get(path_names(path))
        if shape is not None:
            where = f"The checkpoint's leaf {jax.tree_util.keystr(path) or '(root)'}"
            _check_leaf(shape, w, where, n=n, axis_name=axis_name, fix=fix)
