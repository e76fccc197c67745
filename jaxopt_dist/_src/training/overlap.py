"""Outer exchanges that run while inner steps compute: :func:`jaxopt_dist.overlapped_step`.

A ``diloco(..., overlap=True)`` step never communicates on the step that
takes a fragment's pseudo-gradient: it leaves the worker's own value in the
state's outbox. :class:`OverlappedStep` runs that fragment's exchange (the
``aggregate``: the mean all-reduce, or a compressor) while the next inner
steps compute, and hands the result to the step that applies it:

* ``comm_mesh`` given: as a program of its own on a second set of devices.
  On XLA:CPU a collective only runs beside compute when it is on a device of
  its own (each process then has two CPU devices).
* ``comm_mesh=None``: inside the next inner step's program, with no data
  dependence on it, outside any conditional: GPU and TPU compilers may then
  schedule the collective asynchronously around the step's compute.

The numbers are those of the step alone, which exchanges a fragment itself
in its applying step where nobody did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout


def _stacked(x: Any, data_axes: tuple[Any, ...]) -> bool:
    """Whether ``x`` is a per-worker leaf (stacked over the data axes in front)."""
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    return bool(len(spec)) and bool(set(base.axis_names(spec[0]) if spec[0] else ()) & set(data_axes))


def _move(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """``tree``'s arrays on ``mesh`` (same axes and shape, other devices): each process copies its own
    shards, all in one asynchronous ``device_put``."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    to_device = dict(zip(leaves[0].sharding.mesh.devices.flat, mesh.devices.flat))
    shards = [list(x.addressable_shards) for x in leaves]
    moved = iter(
        jax.device_put(
            [s.data for ss in shards for s in ss], [to_device[s.device] for ss in shards for s in ss]
        )
    )
    out = [
        jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(mesh, x.sharding.spec), [next(moved) for _ in ss]
        )
        for x, ss in zip(leaves, shards)
    ]
    return jax.tree.unflatten(treedef, out)


def _host_scalar(x: jax.Array) -> Any:
    """A replicated scalar leaf's value, read on the host (one row of it when stacked per worker)."""
    return np.asarray(jax.device_get(x)).reshape(-1)[0]


def _check_meshes(mesh: jax.sharding.Mesh, comm_mesh: jax.sharding.Mesh) -> None:
    if not isinstance(comm_mesh, jax.sharding.Mesh):
        raise TypeError(f"`comm_mesh` must be a jax.sharding.Mesh; got {type(comm_mesh).__name__}.")
    if dict(comm_mesh.shape) != dict(mesh.shape):
        raise ValueError(
            f"`comm_mesh` must have the step mesh's axes and shape {dict(mesh.shape)}; got {dict(comm_mesh.shape)}."
        )
    shared = set(mesh.devices.flat) & set(comm_mesh.devices.flat)
    if shared:
        raise ValueError(
            f"`comm_mesh` must be on other devices than the step's mesh ({len(shared)} shared); on XLA:CPU "
            "start each process with --xla_force_host_platform_device_count=2 and build it from each "
            "process's second device."
        )


@dataclasses.dataclass
class OverlappedStep:
    """A :func:`jaxopt_dist.data_parallel_step` whose DiLoCo exchanges run beside the inner steps.

    Call it as the step: ``params, opt_state, metrics = run(params,
    opt_state, batch)``; ``run.init(params)`` is the step's. See
    :func:`overlapped_step`.
    """

    step: Any
    exchange: Any  # diloco's OuterExchange
    comm_mesh: jax.sharding.Mesh | None
    trusting: bool = False  # the step's diloco does not exchange by itself: this runner always does first
    _in_flight: dict[int, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _due: list[int] = dataclasses.field(default_factory=list, init=False, repr=False)
    _count: int | None = dataclasses.field(default=None, init=False, repr=False)
    _last: Any = dataclasses.field(default=None, init=False, repr=False)
    _programs: dict[Any, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.comm_mesh is not None:
            _check_meshes(self.step.mesh, self.comm_mesh)

    def init(self, params: Any) -> tuple[Any, Any]:
        """``step.init(params)``."""
        return self.step.init(params)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        t = self._step_number(opt_state)
        landing = self.exchange.lands_at(t)
        if self.trusting:  # what the step would exchange by itself, first, as a program of its own
            late = (
                [f for f in landing if f in self._due]
                if opt_state is self._last
                else self._unexchanged(opt_state)
            )
            opt_state = self._exchange_now(opt_state, late)
        # Fragments still in flight that this step does not read get the values the step
        # passed through last time (ready), so that the step does not wait for the exchange.
        held = {f: v for f, v in self._in_flight.items() if f not in landing}
        state = self._with(opt_state, {f: v[1] for f, v in held.items()}) if held else opt_state
        due = [f for f in self._due if f not in landing]  # else the applying step exchanges it itself
        if due:
            (params, new_state, metrics), results = self.step.call_with(
                params, state, batch, *self._fused(state, due)
            )
        else:
            (params, new_state, metrics), results = self.step(params, state, batch), ()
        flight = {f: (held[f][0], self._pieces(new_state, f)) for f in held}
        flight.update({f: (self._landed(r), self._pieces(new_state, f)) for f, r in zip(due, results)})
        launches = self.exchange.launches_after(t)
        if self.comm_mesh is None:
            self._due = launches
        else:
            flight.update({f: (self._launch(new_state, f), self._pieces(new_state, f)) for f in launches})
        self._in_flight = flight
        new_state = self._with(new_state, {f: v[0] for f, v in flight.items()})
        self._count, self._last = t + 1, new_state
        return params, new_state, metrics

    def _unexchanged(self, opt_state: Any) -> list[int]:
        """The fragments of a state from elsewhere whose outbox waits for its exchange (read on the host)."""
        flags = self.exchange.find(opt_state).exchanged
        return [f for f, done in enumerate(flags) if not _host_scalar(done)]

    def _exchange_now(self, opt_state: Any, fragments: list[int]) -> Any:
        """``opt_state`` with the exchanges of ``fragments`` run now, on the step's mesh."""
        for f in fragments:
            args = self._args(opt_state, f)
            program = self._program(f, args, self._pieces(opt_state, f)[0], self.step.mesh)
            opt_state = self._with(opt_state, {f: self._landed(program(*args))})
        return opt_state

    def _step_number(self, opt_state: Any) -> int:
        """The 0-based number of the step about to run (read from the state when it is not ours)."""
        if opt_state is self._last and self._count is not None:
            return self._count
        self._in_flight, self._due = {}, []  # a state from elsewhere (a restore): its exchanges are done
        return int(_host_scalar(self.exchange.find(opt_state).count))

    def _pieces(self, opt_state: Any, f: int) -> tuple[Any, Any, Any]:
        """(pending, aggregate state, exchanged flag) of fragment ``f``."""
        s = self.exchange.find(opt_state)
        return s.pending[f], s.aggregate_states[f], s.exchanged[f]

    def _with(self, opt_state: Any, pieces: dict[int, tuple[Any, Any, Any]]) -> Any:
        if not pieces:
            return opt_state
        s = self.exchange.find(opt_state)
        pend, agg, exch = list(s.pending), list(s.aggregate_states), list(s.exchanged)
        for f, (p, a, e) in pieces.items():
            pend[f], agg[f], exch[f] = p, a, e
        new = s._replace(pending=tuple(pend), aggregate_states=tuple(agg), exchanged=tuple(exch))
        return self.exchange.replace(opt_state, new)

    def _landed(self, result: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        """An exchange's (pending, aggregate state) with the flag saying it is done.

        A fresh array each time: a step built with ``donate=True`` consumes its state's leaves.
        """
        return result[0], result[1], jax.device_put(np.ones((), bool), NamedSharding(self.step.mesh, P()))

    def _args(self, opt_state: Any, f: int) -> tuple[Any, Any, Any]:
        """The exchange's inputs: (outbox, aggregate state, anchor) of fragment ``f``."""
        s = self.exchange.find(opt_state)
        leaves = jax.tree.leaves(s.anchor)
        anchor_f = [leaves[i] for i in self.exchange.fragments(s.anchor)[f]]
        return s.outbox[f], s.aggregate_states[f], anchor_f

    def _launch(self, opt_state: Any, f: int) -> tuple[Any, Any, Any]:
        """Dispatches fragment ``f``'s exchange on ``comm_mesh``; its results, back on the step's mesh."""
        assert self.comm_mesh is not None
        args = self._args(opt_state, f)
        program = self._program(f, args, self._pieces(opt_state, f)[0], self.comm_mesh)
        result = program(*_move(args, self.comm_mesh))
        return self._landed(_move(result, self.step.mesh))

    def _fused(self, opt_state: Any, due: list[int]) -> tuple[Any, tuple[Any, ...]]:
        """(function, arguments) of the exchanges of ``due``, to run inside the next step's program."""
        args = tuple(self._args(opt_state, f) for f in due)
        mesh = self.step.mesh
        programs = [self._program(f, a, self._pieces(opt_state, f)[0], mesh) for f, a in zip(due, args)]
        key = ("fused", tuple(due), tuple(map(id, programs)))
        if key not in self._programs:
            self._programs[key] = lambda *a: tuple(prog(*x) for prog, x in zip(programs, a))
        return self._programs[key], args

    def _program(self, f: int, args: Any, pending: Any, mesh: jax.sharding.Mesh) -> Any:
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args))
        key = (f, id(mesh), jax.tree.structure(args), shapes)
        if key not in self._programs:
            self._programs[key] = self._build(f, args, pending, mesh)
        return self._programs[key]

    def _build(self, f: int, args: Any, pending: Any, mesh: jax.sharding.Mesh) -> Any:
        """The exchange program on ``mesh``: ``(outbox_f, aggregate_state_f, anchor_f) -> (pending_f, aggregate_state_f)``."""
        data = base.axis_names(self.exchange.axis_name)
        mask = jax.tree.map(lambda x: _stacked(x, data), args)
        out_mask = (jax.tree.map(lambda x: _stacked(x, data), pending), mask[1])
        specs, out_specs = (
            jax.tree.map(lambda m: layout.data_spec(data) if m else P(), m) for m in (mask, out_mask)
        )
        run = self.exchange.run

        def body(*args):
            out, new_agg = run(f, *layout.first_rows(args, mask))
            out = [comm.to_varying(x, data) if m else x for x, m in zip(out, out_mask[0])]
            return layout.add_rows((out, new_agg), out_mask)

        manual = {"axis_names": set(data)} if set(mesh.axis_names) - set(data) else {}
        fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=True, **manual)
        out_shardings = jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), (list(pending), args[1]))
        return jax.jit(fn, out_shardings=out_shardings)


def overlapped_step(
    step: Any, *, comm_mesh: jax.sharding.Mesh | None = None, diloco: Any = None
) -> OverlappedStep:
    r"""Runs ``step``'s DiLoCo exchanges while the next inner steps compute.

    ``step`` is a :func:`jaxopt_dist.data_parallel_step` (``per_worker_params=True``)
    whose transformation is, or contains, a
    :func:`jaxopt_dist.diloco` made with ``overlap=True`` (Streaming DiLoCo
    with ``sync_delay >= 1``, or ``eager=True``). After the step that takes a
    fragment's pseudo-gradient, its exchange (the transform's ``aggregate``)
    runs beside the following inner steps, and the step that applies the
    fragment (``sync_delay`` steps later; a whole period later under
    ``eager``) reads the result. Dispatch is asynchronous throughout: the
    host never waits for the link, only the applying step does, if the
    exchange has not finished by then. Two ways to run the exchange:

    * ``comm_mesh`` (a mesh with the step mesh's axis names and shape, on
      other devices): as a program of its own there. This is what hides the
      link on XLA:CPU, where a collective runs beside compute only on a
      device of its own: start each process with
      ``--xla_force_host_platform_device_count=2``, build the step's mesh
      from each process's first device and ``comm_mesh`` from its second.
    * ``comm_mesh=None``: fused into the program of the next inner step (the
      exchange needs nothing that step computes, and sits outside any
      conditional), where GPU and TPU compilers may schedule its collectives
      asynchronously around the forward and backward passes
      (``benchmarks/hlo_overlap.py``: on an H100 target the fragment's
      all-reduce spans the whole forward/backward). The runner then runs
      ``step`` with the diloco's ``trusting`` twin (no exchange of its own
      inside its switch: a collective inside a conditional keeps XLA's
      scheduler from overlapping), exchanging first whatever would
      otherwise be missing (``sync_delay=1``, a restored state); build the
      step with ``reduce_metrics=False`` too, or the exchange is combined
      with the loss all-reduce. On one CPU device it runs serially, as
      inside the step. With ``sync_delay=1`` the applying step is the next
      one, so nothing is overlapped.

    The parameters, the numbers and the state are those of ``step`` alone
    (which exchanges a fragment inside its applying step where nobody did),
    to float32 rounding: the two are separate XLA programs, which the
    compiler may contract into fused multiply-adds differently (see the
    low-communication guide). Replicas stay bit-identical, and the state this returns is the true
    state (a leaf still being exchanged is an array not yet ready; saving it
    waits for it), so checkpoints and resumes are exact. A state that did not
    come from this runner's last call (a restored one) is taken as it is,
    with no exchange in flight.

    Args:
      step: a :func:`jaxopt_dist.data_parallel_step` with per-worker params.
      comm_mesh: the devices the exchanges run on; None: inside the next
        step's program.
      diloco: the ``diloco(..., overlap=True)`` transformation, when ``step``'s
        transformation is a chain containing it (default: ``step.tx``).

    Returns:
      An :class:`OverlappedStep`, called as the step.

    Examples:
      >>> import jax, optax, jaxopt_dist as jd                      # doctest: +SKIP
      >>> devs = jax.devices()                                        # doctest: +SKIP
      >>> mesh = jax.make_mesh((2,), ("data",), devices=devs[:2])    # doctest: +SKIP
      >>> comm_mesh = jax.make_mesh((2,), ("data",), devices=devs[2:4])  # doctest: +SKIP
      >>> tx = jd.diloco(optax.adamw(1e-3), sync_every=40, num_fragments=4,
      ...                sync_delay=5, overlap=True)                 # doctest: +SKIP
      >>> step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=True)  # doctest: +SKIP
      >>> run = jd.overlapped_step(step, comm_mesh=comm_mesh)        # doctest: +SKIP
      >>> params, opt_state = run.init(params)                       # doctest: +SKIP
      >>> params, opt_state, metrics = run(params, opt_state, batch) # doctest: +SKIP
    """
    tx = step.tx if diloco is None else diloco
    exchange = getattr(tx, "exchange", None)
    if exchange is None:
        raise ValueError(
            "overlapped_step needs a jaxopt_dist.diloco(..., overlap=True): "
            + (
                "pass it as `diloco=` when the step's transformation is a chain."
                if diloco is None
                else "`diloco` has no exchanges to overlap (made without overlap=True)."
            )
        )
    if not getattr(step, "per_worker_params", False):
        raise ValueError("overlapped_step needs a data_parallel_step with per_worker_params=True (DiLoCo's).")
    trusting = comm_mesh is None and diloco is None and exchange.trusting is not None
    if trusting:  # the same step, its diloco without the fallback exchange inside its switch
        step = dataclasses.replace(step, tx=exchange.trusting)
    return OverlappedStep(step, exchange, comm_mesh, trusting)
