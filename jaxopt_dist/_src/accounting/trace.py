"""One update of a transform, traced on an abstract mesh for the accounting.

:func:`trace_update` traces ``tx.update`` under ``jax.shard_map`` over an
abstract mesh (no devices are needed, nothing runs). Each worker gets its own
gradients; the state leaves the update keeps per worker (found by
:func:`jaxopt_dist._src.training.placement.trace_placement`) are stacked over
the axes they vary over, the others are replicated, and so are the parameters
unless the transform's updates differ between workers. :func:`mesh_sizes`
reads the mesh from ``num_workers``; :func:`outside_user_mesh` keeps the
caller's mesh (set with ``jax.set_mesh``) out of the trace.

A sharded model (``param_specs`` over the model axes) is traced as
:func:`jaxopt_dist.data_parallel_step` runs it: only the data axes manual,
every leaf that belongs to a parameter sharded like it over the model axes.
:func:`compile_update` compiles the same program on a concrete mesh, for the
collectives the compiler adds over the model axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import jax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout, model_axes, placement

P = jax.sharding.PartitionSpec
AUTO = jax.sharding.AxisType.Auto


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


def trace_update(
    tx: Any,
    params: Any,
    sizes: dict[Hashable, int],
    axis_name: base.AxisName,
    param_specs: Any = None,
) -> Traced:
    """``tx.update`` traced under ``jax.shard_map`` on an abstract mesh of ``sizes``.

    ``param_specs`` (a full tree of PartitionSpecs over the model axes, like
    ``params``): the update is traced as :func:`jaxopt_dist.data_parallel_step`
    runs it, with only the data axes manual and the model axes (every axis
    of ``sizes`` not in ``axis_name``, typed Auto) left to the compiler.
    """
    axis_names: Any = tuple(sizes.keys())
    types = {} if param_specs is None else {"axis_types": (AUTO,) * len(sizes)}
    mesh: Any = jax.sharding.AbstractMesh(tuple(sizes.values()), axis_names, **types)
    # The trace runs on its own abstract mesh, whatever mesh (explicit or auto axes) the
    # caller has set with jax.set_mesh: shard_map requires the context mesh to match.
    with jax.sharding.use_abstract_mesh(mesh):
        program = _program(tx, params, mesh, axis_name, param_specs, with_updates=False)
        closed = _with_typing(lambda fn: jax.make_jaxpr(fn)(*program.args), program)
    return Traced(closed.jaxpr, list(closed.consts), program.num_grads, program.mask)


def compile_update(
    tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: base.AxisName, param_specs: Any
) -> str:
    """The compiled HLO text of ``tx.update`` on ``mesh``, as :func:`trace_update` traces it.

    Nothing runs and nothing is allocated: the inputs are sharded
    ``ShapeDtypeStruct``s. The new state and the updates keep the shardings
    of the state and the parameters (as in :func:`jaxopt_dist.data_parallel_step`),
    so the compiler cannot drop the update or leave it on other devices.
    """
    mesh = layout.auto_axes(mesh)
    program = _program(tx, params, mesh, axis_name, param_specs, with_updates=True)
    out_shardings = jax.tree.map(lambda x: x.sharding, (program.args[1], program.args[2]))
    return _with_typing(
        lambda fn: jax.jit(fn, out_shardings=out_shardings).lower(*program.args).compile().as_text(),
        program,
    )


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


@dataclasses.dataclass(frozen=True)
class _Program:
    """One update as ``jax.shard_map`` takes it: the body, its specs and abstract (sharded) inputs."""

    body: Any
    mesh: Any
    in_specs: Any
    out_specs: Any
    manual: dict[str, Any]
    args: tuple[Any, ...]
    num_grads: int
    mask: list[bool]

    def shard_map(self, check_vma: bool) -> Any:
        return jax.shard_map(
            self.body,
            mesh=self.mesh,
            in_specs=self.in_specs,
            out_specs=self.out_specs,
            check_vma=check_vma,
            **self.manual,
        )


def _program(
    tx: Any, params: Any, mesh: Any, axis_name: base.AxisName, param_specs: Any, *, with_updates: bool
) -> _Program:
    """The update on ``mesh``: inputs (gradients stacked per worker, state, parameters), outputs
    the new state (and the updates, ``with_updates``); ``param_specs`` shards them over the model axes."""
    spec = layout.data_spec(axis_name)
    p_abs = base.abstract(params)
    state = jax.eval_shape(tx.init, p_abs)
    s_leaves, s_def = jax.tree.flatten(state)
    per_worker_params, mask, leaf_specs = _state_layout(tx, p_abs, s_def, mesh, axis_name)
    s_spec = [sp if m else P() for m, sp in zip(mask, leaf_specs)]
    p_spec = jax.tree.map(lambda _: spec if per_worker_params else P(), p_abs)
    g_spec = jax.tree.map(lambda _: spec, p_abs)
    s_model = None
    if param_specs is not None:
        s_model = s_def.flatten_up_to(model_axes.state_specs(state, p_abs, param_specs))

    def body(g, s, p):
        g = comm.to_varying(layout.first_rows(g), axis_name)
        s = jax.tree.unflatten(s_def, layout.first_rows(s, mask))
        if per_worker_params:
            p = layout.first_rows(p)
        u, s2 = tx.update(g, s, p, **placement.dummy_extras(p, axis_name))
        new_state = layout.add_rows(s_def.flatten_up_to(s2), mask)
        if not with_updates:
            return new_state
        return new_state, (layout.add_rows(u) if per_worker_params else u)

    # Inputs carry their shardings: meshes whose axes are Explicit (JAX >= 0.11's
    # default) check every shard_map input's sharding against its in_spec. Per-worker
    # leaves are stacked over the axes they vary over (P("dcn") for a residual kept
    # once per slow group on a 2-D mesh); with model axes, each leaf is sharded over
    # them too, in the order data_parallel_step places it.
    args = (
        layout.placed_abstract(p_abs, g_spec, mesh, param_specs),
        layout.placed_abstract(s_leaves, s_spec, mesh, s_model),
        layout.placed_abstract(p_abs, p_spec, mesh, param_specs),
    )
    # Only the data axes are manual; model axes (if any) are left to the compiler.
    manual = {} if param_specs is None else {"axis_names": set(base.axis_names(axis_name))}
    out_specs = (s_spec, p_spec) if with_updates else s_spec
    in_specs = (g_spec, s_spec, p_spec)
    return _Program(body, mesh, in_specs, out_specs, manual, args, len(jax.tree.leaves(p_abs)), mask)


def _with_typing(run: Any, program: _Program) -> Any:
    """``run(program.shard_map(check_vma))``, typed with ``check_vma`` where it can be."""
    try:
        return run(program.shard_map(check_vma=True))
    except Exception:
        # Some transforms trace only without varying/invariant typing (e.g. optax.MultiSteps,
        # whose cond mixes replicated and per-worker accumulators); collectives are the same.
        return run(program.shard_map(check_vma=False))
