"""The step runner that every step builder shares.

:func:`jaxopt_dist.data_parallel_step`, :func:`jaxopt_dist.nnx.data_parallel`
and :func:`jaxopt_dist.linen.data_parallel` each build a ``shard_map`` program
of their own; a :class:`StepRunner` does the rest the same way for all three:
it keeps the compiled programs by key, places the arguments and dispatches a
call, bounds how many calls run ahead of the host, and checks arguments
against the mesh (batch leaves divisible by the workers, per-worker leaves
stacked for this mesh's number of workers).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_dist._src import base
from jaxopt_dist._src.training import layout, placement

P = jax.sharding.PartitionSpec
T = TypeVar("T")
REPLICATED = P()
"""The model-axis spec of a leaf that is not sharded over model axes."""


def shape_key(tree: Any) -> tuple[Any, ...]:
    """A hashable key of ``tree``'s structure, shapes and dtypes (for compile caches)."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves))


def check_max_steps_in_flight(value: int | None) -> int | None:
    """``max_steps_in_flight`` checked: None or an int >= 1."""
    return None if value is None else base.check_positive_int(value, "max_steps_in_flight")


@dataclasses.dataclass
class StepRunner:
    """Compile cache, dispatch, in-flight throttle and argument checks of one step.

    Attributes:
      mesh: the device mesh.
      axis_name: the data axis (or tuple of axes) of ``mesh``.
      max_steps_in_flight: how many dispatched calls may run ahead of the
        host before a call waits for the oldest. None: unbounded on
        accelerators, :data:`layout.CPU_STEPS_IN_FLIGHT` on CPU meshes, where
        XLA:CPU's in-process collectives can deadlock when a few dozen steps
        with collectives are queued.
    """

    mesh: jax.sharding.Mesh
    axis_name: base.AxisName
    max_steps_in_flight: int | None = None
    _cache: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)
    _in_flight: collections.deque[Any] = dataclasses.field(default_factory=collections.deque, repr=False)
    _limit: int | None = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Once, not per call: the devices of the mesh do not change.
        cpu = layout.CPU_STEPS_IN_FLIGHT if layout.on_cpu(self.mesh) else None
        self._limit = cpu if self.max_steps_in_flight is None else self.max_steps_in_flight

    @property
    def num_workers(self) -> int:
        return layout.mesh_axis_size(self.mesh, self.axis_name)

    def cached(self, key: Any, build: Callable[[], T]) -> T:
        """``build()``'s result, computed once per ``key``."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def check_batch(self, batch: Any, *, hint: str = "") -> None:
        """Every batch leaf must split evenly over the workers."""
        layout.check_batch(batch, self.num_workers, hint=hint)

    def check_layout(self, tree: Any, expected: Any, *, what: str) -> None:
        """Rejects ``tree`` unless it has ``expected``'s layout for this mesh's workers."""
        layout.check_layout(tree, expected, what=what, n=self.num_workers, axis_name=self.axis_name)

    def stacked_sharding(self, model: P = REPLICATED) -> jax.sharding.NamedSharding:
        """The sharding of a leaf stacked over the data axes, sharded by ``model`` over the model axes."""
        return jax.sharding.NamedSharding(
            self.mesh, layout.full_spec(layout.data_spec(self.axis_name), model)
        )

    def stacked(self, x: Any, model: P = REPLICATED) -> jax.Array:
        """One worker's copy ``x`` stacked for every worker (worker ``i`` owns row ``i``), sharded
        by ``model`` over the model axes; nothing is gathered on one device."""
        on = getattr(x, "sharding", None)
        if isinstance(on, jax.sharding.NamedSharding) and on.mesh != self.mesh and not layout.is_global(x):
            # Onto this mesh first: an array on another mesh (the caller's Explicit one, that
            # sharded Flax models are built on) cannot be sliced with this one in context.
            x = jax.device_put(x, jax.sharding.NamedSharding(self.mesh, model))
        return layout.stacked(x, self.num_workers, self.stacked_sharding(model))

    def stacked_leaf(self, x: Any, local_shape: tuple[int, ...], *, what: str, model: P = REPLICATED) -> Any:
        """A per-worker leaf ready for the step: one worker's copy (``local_shape``) is
        stacked for every worker; an already stacked one must have a row per worker.
        ``model``: the leaf's spec over the model axes."""
        sharding = self.stacked_sharding(model)
        if tuple(np.shape(x)) == tuple(local_shape):
            return self.stacked(x, model)
        want = jax.ShapeDtypeStruct((self.num_workers, *local_shape), jnp.result_type(x), sharding=sharding)
        self.check_layout(x, want, what=what)
        return x

    def in_flight_limit(self) -> int | None:
        return self._limit

    def dispatch(
        self, fn: Callable[..., Any], args: tuple[Any, ...], shardings: tuple[Any, ...], *, batch: int
    ):
        """Places ``args`` by ``shardings`` and calls ``fn``; ``args[batch]`` is the global batch.

        One ``device_put`` for the whole call: a no-op for arrays already in
        place, a transfer for host batches, a reshard otherwise (jit's own
        in_shardings would not retype arrays for meshes with Explicit axes).
        On a mesh spanning several processes, each process transfers only the
        batch rows of its own devices.
        """
        if self.mesh.is_multi_process:
            args = (*args[:batch], layout.global_batch(args[batch], shardings[batch]), *args[batch + 1 :])
        # The step's mesh in context: a caller's `with jax.set_mesh(...)` (an Explicit mesh, as
        # sharded Flax models are built under) would otherwise clash with the step's shard_map.
        with jax.set_mesh(self.mesh):
            return fn(*jax.device_put(args, shardings))

    def lower(self, fn: Any, args: tuple[Any, ...], shardings: tuple[Any, ...]) -> jax.stages.Lowered:
        """``fn`` (a jitted step) lowered for ``args`` placed by ``shardings``, without running it."""
        with jax.set_mesh(self.mesh):
            return fn.lower(*jax.tree.map(_abstract_on, args, shardings))

    def throttle(self, token: Any) -> None:
        """Records a dispatched call by ``token`` (arrays it returns that are never donated);
        waits for the oldest call once more than the in-flight limit are queued."""
        if self._limit is None:
            return
        self._in_flight.append(token)
        if len(self._in_flight) > self._limit:
            jax.block_until_ready(self._in_flight.popleft())


def _abstract_on(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)


class RunsSteps:
    """What the three step classes share: a :class:`StepRunner` on their mesh and axis.

    A dataclass that inherits it declares ``mesh``, ``axis_name`` and
    ``max_steps_in_flight`` fields and ``_runner: StepRunner =
    dataclasses.field(init=False, repr=False)``.
    """

    mesh: jax.sharding.Mesh
    axis_name: base.AxisName
    max_steps_in_flight: int | None
    _runner: StepRunner

    def __post_init__(self) -> None:
        self._runner = StepRunner(self.mesh, self.axis_name, self.max_steps_in_flight)

    @property
    def num_workers(self) -> int:
        return self._runner.num_workers

    def in_flight_limit(self) -> int | None:
        """How many dispatched steps may run ahead of the host (None: unbounded)."""
        return self._runner.in_flight_limit()


def check_batch_axes(batch_axes: Any, mesh: jax.sharding.Mesh, axis_name: base.AxisName) -> tuple[Any, ...]:
    """``batch_axes`` (None, a model axis of ``mesh`` or a tuple of them) as a tuple."""
    names = () if batch_axes is None else base.axis_names(base.validate_axis_name(batch_axes))
    layout.mesh_axis_size(mesh, names)
    for a in names:
        if a in base.axis_names(axis_name):
            raise ValueError(
                f"`batch_axes` names the data axis {a!r}, which always splits the batch. Name the "
                "model axes that split it too (e.g. batch_axes='fsdp')."
            )
    return names


def opt_placement(
    tx: Any, params: Any, *, mesh: Any, axis_name: base.AxisName, per_worker_params: bool
) -> Any:
    """The placement of ``tx``'s state for one copy of ``params``; updates that differ between
    workers are rejected unless the parameters are per-worker."""
    if not per_worker_params:
        return placement.replicated_params_placement(tx, params, mesh=mesh, axis_name=axis_name)
    return placement.opt_state_placement(tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=True)


def manual_axes(axis_name: base.AxisName, sharded: bool) -> dict[str, Any]:
    """``jax.shard_map`` keywords: only the data axes manual when the model is ``sharded`` over
    model axes (those are left to the compiler); every axis manual otherwise."""
    return {"axis_names": set(base.axis_names(axis_name))} if sharded else {}


BATCH_STATS = ("sync", "per_worker")
"""The ``batch_stats`` modes of the Flax front ends."""


def front_end(
    fn: Callable[..., Any] | None,
    make: Callable[..., T],
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName,
    batch_stats: str,
    max_steps_in_flight: int | None,
    per_worker_params: bool = False,
    batch_axes: Any = None,
    **options: Any,
) -> Any:
    """The decorator of both Flax front ends: checks the options, then ``make(fn, mesh, ...)``.

    ``options`` (e.g. linen's ``logical_axis_rules``) are passed on to ``make`` as keywords.
    Returns the step made for ``fn``, or a decorator making one when ``fn`` is None.
    """
    axis_name = base.validate_axis_name(axis_name)
    if batch_stats not in BATCH_STATS:
        raise ValueError(f"`batch_stats` must be one of {BATCH_STATS}; got {batch_stats!r}.")
    layout.check_mesh(mesh, axis_name)
    max_steps_in_flight = check_max_steps_in_flight(max_steps_in_flight)
    options.update(
        per_worker_params=base.check_bool(per_worker_params, "per_worker_params"),
        batch_axes=check_batch_axes(batch_axes, mesh, axis_name),
    )
    auto = layout.auto_axes(mesh)

    def wrap(f: Callable[..., Any]) -> T:
        if not callable(f):
            raise TypeError(f"`fn` must be callable; got {f!r}.")
        return make(f, auto, axis_name, batch_stats, max_steps_in_flight, **options)

    return wrap if fn is None else wrap(fn)
