"""One update of a transform, traced on an abstract mesh for the accounting.

:func:`trace_update` traces ``tx.update`` under ``jax.shard_map`` over an
abstract mesh (no devices are needed, nothing runs). Each worker gets its own
gradients; the state leaves the update keeps per worker (found by
:func:`jaxopt_dist._src.training.placement.trace_placement`) are stacked over
the axes they vary over, the others are replicated, and so are the parameters
unless the transform's updates differ between workers. :func:`mesh_sizes`
reads the mesh from ``num_workers``; :func:`outside_user_mesh` keeps the
caller's mesh (set with ``jax.set_mesh``) out of the trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import jax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout, placement

P = jax.sharding.PartitionSpec


def mesh_sizes(num_workers: int | Mapping[Hashable, int], axis_name: base.AxisName) -> dict[Hashable, int]:
    """The size of every mesh axis traced: ``axis_name``'s axes first, then any others named."""
    names: list[Any] = list(base.axis_names(axis_name))
    if isinstance(num_workers, Mapping):
        sizes = {
            a: base.check_positive_int(num_workers[a], f"num_workers[{a!r}]")
            for a in names
            if a in num_workers
        }
        missing = [a for a in names if a not in sizes]
        if missing:
            raise ValueError(
                f"`num_workers` gives no size for the axes {missing!r} of `axis_name`={axis_name!r}."
            )
        for a, s in num_workers.items():
            if a not in sizes:
                sizes[a] = base.check_positive_int(s, f"num_workers[{a!r}]")
        return sizes
    size = base.check_positive_int(num_workers, "num_workers")
    if len(names) > 1:
        raise ValueError(
            f"`axis_name`={axis_name!r} names several axes: give `num_workers` as a mapping "
            f"from each axis name to its size, e.g. {{{names[0]!r}: 2, {names[1]!r}: 4}}."
        )
    return {names[0]: size}


@contextlib.contextmanager
def outside_user_mesh() -> Iterator[None]:
    """Runs the block with no context mesh, whatever the caller set with ``jax.set_mesh``.

    The accounting traces on its own abstract mesh and evaluates small state leaves
    eagerly; a caller's mesh (explicit or auto axes) must not leak into either.
    """
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        yield


@dataclasses.dataclass(frozen=True)
class Traced:
    """One traced update.

    Attributes:
      jaxpr: the update's jaxpr. Its inputs are the gradient leaves, the
        state leaves, then the parameter leaves; its outputs the new state
        leaves.
      consts: the jaxpr's constants.
      num_grads: the number of gradient leaves.
      state_mask: for each state leaf, whether it is per-worker.
    """

    jaxpr: Any
    consts: list[Any]
    num_grads: int
    state_mask: list[bool]


def trace_update(tx: Any, params: Any, sizes: dict[Hashable, int], axis_name: base.AxisName) -> Traced:
    """``tx.update`` traced under ``jax.shard_map`` on an abstract mesh of ``sizes``."""
    axis_names: Any = tuple(sizes.keys())
    mesh: Any = jax.sharding.AbstractMesh(tuple(sizes.values()), axis_names)
    # The trace runs on its own abstract mesh, whatever mesh (explicit or auto axes) the
    # caller has set with jax.set_mesh: shard_map requires the context mesh to match.
    with jax.sharding.use_abstract_mesh(mesh):
        return _trace_on(tx, params, mesh, axis_name)


def _state_layout(
    tx: Any, p_abs: Any, state_def: Any, mesh: Any, axis_name: base.AxisName
) -> tuple[bool, list[bool], list[Any]]:
    """(whether parameters are per-worker, per state leaf: per-worker?, its spec), from the placement."""
    try:
        found = placement.trace_placement(tx, p_abs, mesh=mesh, axis_name=axis_name, per_worker_params=False)
        per_worker_params = bool(found.updates_per_worker)
        if per_worker_params:
            found = placement.trace_placement(
                tx, p_abs, mesh=mesh, axis_name=axis_name, per_worker_params=True
            )
        mask = state_def.flatten_up_to(found.per_worker)
        return per_worker_params, mask, state_def.flatten_up_to(placement.leaf_specs(found, axis_name))
    except Exception:
        # Untypable under check_vma (see _make_jaxpr): treat the state as replicated.
        return False, [False] * state_def.num_leaves, [P()] * state_def.num_leaves


def _trace_on(tx: Any, params: Any, mesh: Any, axis_name: base.AxisName) -> Traced:
    spec = layout.data_spec(axis_name)
    p_abs = base.abstract(params)
    s_leaves, s_def = jax.tree.flatten(jax.eval_shape(tx.init, p_abs))
    per_worker_params, mask, leaf_specs = _state_layout(tx, p_abs, s_def, mesh, axis_name)
    s_spec = [sp if m else P() for m, sp in zip(mask, leaf_specs)]
    p_spec = jax.tree.map(lambda _: spec if per_worker_params else P(), p_abs)

    def body(g, s, p):
        g = comm.to_varying(layout.first_rows(g), axis_name)
        s = jax.tree.unflatten(s_def, layout.first_rows(s, mask))
        if per_worker_params:
            p = layout.first_rows(p)
        _, s2 = tx.update(g, s, p, **placement.dummy_extras(p, axis_name))
        return layout.add_rows(s_def.flatten_up_to(s2), mask)

    # Inputs carry their shardings: meshes whose axes are Explicit (JAX >= 0.11's
    # default) check every shard_map input's sharding against its in_spec. Per-worker
    # leaves are stacked over the axes they vary over (P("dcn") for a residual kept
    # once per slow group on a 2-D mesh).
    sharded = jax.sharding.NamedSharding(mesh, spec)
    n = layout.spec_size(mesh, spec)
    g_in = layout.stack_abstract(p_abs, n, sharded)
    s_in = layout.placed_abstract(s_leaves, s_spec, mesh)
    p_in = layout.placed_abstract(p_abs, p_spec, mesh)
    in_specs = (jax.tree.map(lambda _: spec, p_abs), s_spec, p_spec)
    closed = _make_jaxpr(body, mesh, in_specs, s_spec, (g_in, s_in, p_in))
    return Traced(closed.jaxpr, list(closed.consts), len(jax.tree.leaves(p_abs)), mask)


def _make_jaxpr(body: Any, mesh: Any, in_specs: Any, out_specs: Any, args: tuple[Any, ...]) -> Any:
    """The closed jaxpr of ``body`` under ``jax.shard_map``, typed with ``check_vma`` where it can be."""

    def make(check_vma: bool) -> Any:
        fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
        return jax.make_jaxpr(fn)(*args)

    try:
        return make(check_vma=True)
    except Exception:
        # Some transforms trace only without varying/invariant typing (e.g. optax.MultiSteps,
        # whose cond mixes replicated and per-worker accumulators); collectives are the same.
        return make(check_vma=False)
