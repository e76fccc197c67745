"""Model axes: parameters sharded inside each replica, and the state that follows them.

A mesh may have axes besides the data axis: ``("data", "fsdp")``,
``("data", "tensor")``. The data axes are manual inside a step (the
transforms' collectives run on them); the *model axes* are left to the
compiler (``jax.shard_map(..., axis_names=data axes)``), so the model code is
ordinary sharded JAX code. ``param_specs`` says how each parameter is sharded
over the model axes; :func:`state_specs` places each optimizer-state leaf:

* A leaf that belongs to a parameter (error-feedback residuals, anchors,
  moments, momentum) is sharded like the parameter.
* A *flat per-leaf buffer*, a leaf of a state field that the state's class
  names in its ``FLAT_BUFFERS`` attribute (1-bit Adam's and 0/1 Adam's
  ``worker_error`` and ``server_error``: one padded 1-D buffer per parameter
  leaf, whose shape no parameter has), is split along its one dimension over
  the model axes that the parameters use, ``P(("fsdp",))``, or over as many
  of them, in their order, as divide its length evenly.
* Everything else (counters, keys, PowerSGD's factors) is replicated over the
  model axes.

Only a declared field is taken for a flat buffer: a 1-D leaf is never
guessed to be one from its length. A per-worker leaf is stacked over the data
axes in front of its model-axis spec: ``P("data", "fsdp", None)``,
``P("data", ("fsdp",))``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxopt_dist._src import base
from jaxopt_dist._src.training import layout

P = jax.sharding.PartitionSpec


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def spec_names(spec: P) -> tuple[Any, ...]:
    """Every mesh axis ``spec`` names, in order."""
    out: list[Any] = []
    for entry in spec:
        if entry is not None:
            out.extend(entry if isinstance(entry, tuple) else (entry,))
    return tuple(out)


def replicated_like(tree: Any) -> Any:
    """``P()`` for every leaf of ``tree`` (no model axes)."""
    return jax.tree.map(lambda _: P(), tree)


def check_param_specs(param_specs: Any, params: Any, *, mesh: Any, axis_name: base.AxisName) -> Any:
    """``param_specs`` as a full tree of PartitionSpecs like ``params``, checked against ``mesh``.

    ``param_specs`` may be a tree prefix of ``params`` (one spec for a whole
    subtree); ``None`` stands for ``P()``. Every spec names only model axes of ``mesh`` (never the data
    axes), at most once, and each sharded dimension divides evenly.
    """
    if param_specs is None:
        return replicated_like(params)
    # None (a common spelling of "not sharded") is P().
    param_specs = jax.tree.map(
        lambda sp: P() if sp is None else sp, param_specs, is_leaf=lambda x: x is None or is_spec(x)
    )
    prefix = jax.tree.structure(param_specs, is_leaf=is_spec)
    try:
        subtrees = prefix.flatten_up_to(params)
        full = prefix.unflatten(
            [
                jax.tree.map(lambda _, sp=sp: sp, sub)
                for sp, sub in zip(prefix.flatten_up_to(param_specs), subtrees)
            ]
        )
    except ValueError as e:
        raise ValueError(
            "`param_specs` must be a pytree of PartitionSpecs matching the parameters (or a prefix of "
            f"their tree); {e}"
        ) from None
    data = set(base.axis_names(axis_name))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    for (path, x), sp in zip(flat, jax.tree.leaves(full, is_leaf=is_spec)):
        _check_one(sp, np.shape(x), jax.tree_util.keystr(path) or "(root)", mesh, data)
    return full


def _check_one(sp: Any, shape: tuple[int, ...], where: str, mesh: Any, data: set[Any]) -> None:
    if not is_spec(sp):
        raise TypeError(f"`param_specs` at {where} must be a jax.sharding.PartitionSpec; got {sp!r}.")
    names = spec_names(sp)
    bad = [a for a in names if a in data]
    if bad:
        raise ValueError(
            f"`param_specs` at {where} is {sp}, which names the data axis {bad[0]!r}. Name only the "
            f"model axes: the data axes are where the workers (replicas) are, and the step handles them."
        )
    missing = [a for a in names if a not in mesh.shape]
    if missing or len(set(names)) != len(names):
        raise ValueError(
            f"`param_specs` at {where} is {sp}; the mesh has axes {tuple(mesh.shape)} and each may "
            f"appear at most once."
        )
    if len(sp) > len(shape):
        raise ValueError(f"`param_specs` at {where} is {sp}, longer than the parameter's shape {shape}.")
    for axis, (dim, entry) in enumerate(zip(shape, sp)):
        size = int(np.prod([mesh.shape[a] for a in spec_names(P(entry))])) if entry is not None else 1
        if dim % size:
            raise ValueError(
                f"`param_specs` at {where} is {sp}: axis {axis} of shape {shape}, of size {dim}, "
                f"does not divide evenly over {entry!r} ({size} devices)."
            )


def model_axes(param_specs: Any) -> tuple[Any, ...]:
    """The model axes that some parameter is sharded over, in order of first use."""
    seen: list[Any] = []
    for sp in jax.tree.leaves(param_specs, is_leaf=is_spec):
        seen.extend(a for a in spec_names(sp) if a not in seen)
    return tuple(seen)


def declared_paths(state: Any, attr: str) -> set[tuple[Any, ...]]:
    """Paths of the leaves of ``state`` in the fields that their state's class lists in ``attr``.

    A state class (a NamedTuple) lists such fields in a class attribute:
    ``FLAT_BUFFERS``, e.g. ``FLAT_BUFFERS = ("worker_error", "server_error")``,
    for fields holding one 1-D buffer per parameter leaf, of a length no
    parameter has (the leaf flattened and padded); ``MATRIX_STACKS``, e.g.
    ``MATRIX_STACKS = ("mu", "mu_rest")``, for fields holding stacks of
    matrices ``(count, rows, cols)`` gathered from several parameters.
    """

    def declares(x: Any) -> bool:
        return isinstance(x, tuple) and bool(getattr(type(x), attr, ()))

    found: set[tuple[Any, ...]] = set()
    for path, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=declares)[0]:
        if declares(node):
            for field in getattr(type(node), attr):
                head = (*path, jax.tree_util.GetAttrKey(field))
                found.update(
                    (*head, *sub) for sub, _ in jax.tree_util.tree_leaves_with_path(getattr(node, field))
                )
    return found


def _leading_run(length: int, axes: tuple[Any, ...], mesh: Any) -> list[Any]:
    """The longest leading run of ``axes`` whose devices divide ``length``."""
    use: list[Any] = []
    for a in axes:
        if length % int(np.prod([mesh.shape[b] for b in (*use, a)])):
            break
        use.append(a)
    return use


def flat_buffer_spec(length: int, axes: tuple[Any, ...], mesh: Any) -> P:
    """A 1-D buffer of ``length`` split over ``axes``, or over the longest leading run that divides it."""
    use = _leading_run(length, axes, mesh)
    return P(tuple(use)) if use else P()


def matrix_stack_spec(shape: tuple[int, ...], axes: tuple[Any, ...], mesh: Any) -> P:
    """A stack of matrices ``(count, rows, cols)`` split over ``axes`` on one dimension.

    The rows, else the columns, else the count: the first that the most of
    ``axes`` (a leading run of them) divide. Nothing divisible: replicated.
    """
    best, dim = [], None
    for d in (1, 2, 0):
        use = _leading_run(shape[d], axes, mesh)
        if len(use) > len(best):
            best, dim = use, d
    if dim is None:
        return P()
    return P(*[tuple(best) if d == dim else None for d in range(len(shape))])


def state_specs(state: Any, params: Any, param_specs: Any, *, mesh: Any = None) -> Any:
    """Model-axis specs for each leaf of one worker's optimizer ``state``.

    A state leaf belongs to a parameter when its path ends with that
    parameter's path and it has the parameter's shape: optax's and this
    library's states hold parameter-shaped trees (``mu``, ``nu``, residuals,
    anchors, momentum) under their own field names. A leaf no path matches
    (a list of one fragment's leaves, as DiLoCo's outer state keeps) takes
    the spec of the parameters of its shape when they all share one. Such a
    leaf is sharded like its parameter. With ``mesh`` (its axis sizes), a 1-D
    leaf of a field its state declares a flat buffer (:func:`declared_paths`)
    is split over the model axes of ``param_specs`` (:func:`flat_buffer_spec`),
    and a 3-D leaf of a field it declares a matrix stack on one of its
    dimensions (:func:`matrix_stack_spec`): Muon's and Dion2's momentum,
    stacked by shape, is then held once over the model axes, as the
    parameters are. Every other leaf is ``P()`` over the model axes.
    """
    flat_paths = declared_paths(state, "FLAT_BUFFERS") if mesh is not None else set()
    stack_paths = declared_paths(state, "MATRIX_STACKS") if mesh is not None else set()
    axes = model_axes(param_specs)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
    owner = {(tuple(path), np.shape(x)): sp for (path, x), sp in zip(flat, specs)}
    lengths = sorted({len(path) for path, _ in owner}, reverse=True)
    by_shape: dict[tuple[int, ...], set[P]] = {}
    for (_, shape), sp in owner.items():
        by_shape.setdefault(shape, set()).add(sp)

    def one(path: tuple[Any, ...], leaf: Any) -> P:
        shape = np.shape(leaf)
        if len(shape) == 1 and tuple(path) in flat_paths:
            return flat_buffer_spec(shape[0], axes, mesh)
        if len(shape) == 3 and tuple(path) in stack_paths:
            return matrix_stack_spec(shape, axes, mesh)
        for n in lengths:
            sp = owner.get((tuple(path[len(path) - n :]) if n else (), shape))
            if n <= len(path) and sp is not None:
                return sp
        same = by_shape.get(shape, set())
        return next(iter(same)) if len(same) == 1 else P()

    return jax.tree_util.tree_map_with_path(one, state)


def shardings(mesh: Any, stack_specs: Any, model_specs: Any | None = None) -> Any:
    """``NamedSharding``s on ``mesh`` for the joined specs."""
    joined = layout.full_specs(stack_specs, model_specs)
    return jax.tree.map(lambda sp: jax.sharding.NamedSharding(mesh, sp), joined, is_leaf=is_spec)
