"""Sharded models in the accounting: the model axes, and what the compiler sends over them.

With ``param_specs`` (:func:`jaxopt_dist.data_parallel_step`'s argument: how
each parameter is sharded over the *model axes* of the mesh),
:func:`jaxopt_dist.communication_cost` traces the update as the step runs
it: ``jax.shard_map`` manual over the data axes only, the model axes left to
the compiler. The transform's own collectives are on the data axes and are
read off the trace, per worker (one replica): the bytes of the replica's
whole leaves, the same as for unsharded parameters. The collectives over the
model axes are the compiler's (an all-gather of a sharded leaf that top-k
must see whole), so they exist only in the compiled program: :func:`resolve`
finds a mesh to compile on (the one given, or one over the local devices
when their number matches), and :func:`compiled_collectives` compiles the
update there and reads its HLO (:mod:`.hlo`), each collective with the mesh
axes its replica groups span, per device.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np

from jaxopt_dist._src import base
from jaxopt_dist._src.accounting import hlo, trace
from jaxopt_dist._src.training import model_axes


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """A sharded model's layout for the accounting.

    Attributes:
      param_specs: a PartitionSpec over the model axes for every parameter.
      axes: the model axes: every mesh axis that is not a data axis.
      mesh: the concrete mesh to compile the update on, or None.
      no_mesh: why there is no mesh (empty when there is one).
    """

    param_specs: Any
    axes: tuple[Hashable, ...]
    mesh: jax.sharding.Mesh | None
    no_mesh: str = ""


def sizes_from_mesh(mesh: Any, axis_name: base.AxisName) -> dict[Hashable, int]:
    """``num_workers`` read off ``mesh``: the size of each of its axes."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. jax.make_mesh((2, 4), ('data', 'fsdp'))); "
            f"got {type(mesh).__name__}."
        )
    return trace.mesh_sizes(dict(mesh.shape), axis_name)


def _check_named_axes(param_specs: Any, sizes: Mapping[Hashable, int], axis_name: base.AxisName) -> None:
    """Every axis a spec names has a size in ``sizes`` (data axes are left to ``check_param_specs``)."""
    data = base.axis_names(axis_name)
    named = [
        a
        for sp in jax.tree.leaves(param_specs, is_leaf=model_axes.is_spec)
        if model_axes.is_spec(sp)
        for a in model_axes.spec_names(sp)
    ]
    missing = list(dict.fromkeys(a for a in named if a not in sizes and a not in data))
    if missing:
        example = {**dict(sizes), **{a: "<size>" for a in missing}}
        raise ValueError(
            f"`param_specs` shards parameters over the model axes {missing!r}, but `num_workers` gives "
            f"sizes only for {tuple(sizes)!r}. Give the size of every mesh axis, data and model: "
            f"num_workers={example!r} (or pass the mesh itself as `mesh=`)."
        )


def _local_mesh(sizes: Mapping[Hashable, int]) -> tuple[jax.sharding.Mesh | None, str]:
    """A mesh of ``sizes`` over this process's devices when there are exactly that many, else why not."""
    devices = jax.local_devices()
    n = math.prod(sizes.values())
    if len(devices) != n:
        return None, (
            f"the update was not compiled: no `mesh` was given and this process sees {len(devices)} "
            f"device(s), not the {n} of a mesh {dict(sizes)!r}"
        )
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
    return jax.sharding.Mesh(grid, tuple(sizes)), ""


def _check_mesh(mesh: Any, sizes: Mapping[Hashable, int], axis_name: base.AxisName) -> None:
    """``mesh`` is a Mesh with the data axes and exactly the axes and sizes of ``sizes``."""
    given = sizes_from_mesh(mesh, axis_name)
    if given != dict(sizes):
        raise ValueError(
            f"`mesh` has the axes {given!r} but `num_workers` says {dict(sizes)!r}: they must name the "
            f"same axes with the same sizes (or leave out `num_workers`: the mesh gives it)."
        )


def resolve(
    param_specs: Any,
    params: Any,
    *,
    sizes: Mapping[Hashable, int],
    axis_name: base.AxisName,
    mesh: jax.sharding.Mesh | None,
) -> ShardedModel:
    """Checks ``param_specs`` against the mesh ``sizes`` and finds a mesh to compile on.

    Raises:
      ValueError: a spec names an axis ``sizes`` lacks, or a data axis; a
        dimension does not divide over its axes; ``mesh`` disagrees with ``sizes``.
    """
    _check_named_axes(param_specs, sizes, axis_name)
    names: Any = tuple(sizes)
    abstract_mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), names)
    full = model_axes.check_param_specs(param_specs, params, mesh=abstract_mesh, axis_name=axis_name)
    data = base.axis_names(axis_name)
    axes = tuple(a for a in sizes if a not in data)
    if mesh is not None:
        _check_mesh(mesh, sizes, axis_name)
        return ShardedModel(full, axes, mesh)
    found, why = _local_mesh(sizes)
    return ShardedModel(full, axes, found, why)


def compiled_collectives(
    model: ShardedModel, tx: Any, params: Any, axis_name: base.AxisName
) -> tuple[tuple[hlo.HloCollective, ...] | None, list[str]]:
    """The collectives of the update compiled on ``model.mesh`` (None without one), and notes."""
    axes = tuple(model.axes)
    if model.mesh is None:
        return None, [
            f"model axes {axes!r}: not counted. Their collectives are inserted by the compiler and "
            f"exist only in the compiled program, and {model.no_mesh}; pass `mesh=` (a "
            f"jax.sharding.Mesh with these axes) to count them."
        ]
    try:
        text = trace.compile_update(tx, params, model.mesh, axis_name, model.param_specs)
    except Exception as e:  # the traced data-axis figures stand; say why the rest is missing
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, [f"model axes {axes!r}: not counted: compiling the update failed ({first})"]
    found = tuple(hlo.hlo_collectives(text, mesh=model.mesh))
    platform = model.mesh.devices.flat[0].platform
    notes = [
        f"data axes: traced, per worker (one replica, its whole leaves); model axes {axes!r}: read "
        f"off the update compiled for {platform} on the mesh {dict(model.mesh.shape)!r}, per device, "
        f"every collective of the program once per step"
    ]
    unread = [h for h in found if h.axes is None]
    if unread:
        notes.append(
            f"{len(unread)} collective(s) of the compiled program have replica groups in a form not "
            f"read ({', '.join(sorted({h.op for h in unread}))}): their bytes are not counted"
        )
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, flags=re.MULTILINE)
    inner = [h for h in found if entry and h.computation != entry.group(1) and set(h.axes or ()) & set(axes)]
    if inner:
        notes.append(
            f"{len(inner)} model-axis collective(s) sit in called computations (conditional "
            f"branches, loop bodies): each counted once per step"
        )
    return found, notes
