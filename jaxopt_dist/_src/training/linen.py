"""Flax linen ``TrainState`` steps with BatchNorm statistics and dropout keys under data parallelism.

:func:`data_parallel` replaces ``@jax.jit`` on a linen training step
``train_step(state, batch) -> (state, metrics)`` written for one device, with
:class:`TrainState` (``flax.training.train_state.TrainState`` plus
``batch_stats``) as its state. The step runs under ``jax.shard_map`` with the
batch split along the data axis:

* ``state.params``: replicated; gradients are per worker, ``tx`` aggregates
  them, and :meth:`TrainState.apply_gradients` keeps the parameters replicated.
  With ``per_worker_params=True`` (``diloco``, ``average_params``, gossip),
  one copy per worker, stacked along a leading worker axis.
* Sharded models: on a mesh with *model axes* besides the data axes (e.g.
  ``jax.make_mesh((2, 4), ("data", "fsdp"))``), parameters boxed with
  sharding metadata (``nn.with_partitioning``, or
  ``nn.with_logical_partitioning`` and logical axis rules) are sharded over
  the model axes inside each replica; the data axes stay manual and the model
  axes are left to the compiler, as with ``param_specs`` of
  :func:`jaxopt_dist.data_parallel_step`.
* ``state.opt_state``: placed as :func:`jaxopt_dist.data_parallel_step` places
  it (error-feedback residuals stacked along a leading worker axis; every leaf
  that belongs to a parameter sharded over the model axes like it).
* ``state.batch_stats``: ``"sync"`` keeps them replicated. A BatchNorm built
  with ``axis_name`` equal to the data axis normalizes with the global batch's
  statistics (SyncBN); one built without it normalizes with each worker's
  shard, and its new running statistics are averaged over the workers.
  ``"per_worker"`` keeps one set per worker (stacked) and never communicates.
* PRNG keys in the state (typed, ``jax.random.key``): each worker sees
  ``fold_in(key, worker_index)``; the state keeps the original key.
* ``metrics``: floats averaged over workers, replicated.

This module imports flax; ``import jaxopt_dist`` does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.core import meta
from flax.linen import spmd
from flax.training import train_state

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout, model_axes, replicas, runner
from jaxopt_dist._src.training.elastic import reshard_opt_state, reshard_params

P = jax.sharding.PartitionSpec


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` with ``batch_stats``, for :func:`data_parallel`.

    Attributes:
      batch_stats: the model's ``"batch_stats"`` collection (or None).
      key: an optional typed PRNG key (``jax.random.key``) for dropout; inside
        :func:`data_parallel` each worker sees its own ``fold_in(key, worker)``.

    Outside :func:`data_parallel` it behaves as the flax class.
    """

    batch_stats: Any = None
    key: Any = None

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Steps ``tx``; inside :func:`data_parallel`, on the replicated parameters."""
        copies = replicas.active()
        if copies is None:
            return super().apply_gradients(grads=grads, **kwargs)
        params = replicas.replicated(self.params, copies)
        updates, new_opt_state = self.tx.update(grads, self.opt_state, params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(params, updates),
            opt_state=new_opt_state,
            **kwargs,
        )


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def box_spec(box: Any, rules: Any) -> P:
    """The PartitionSpec over the mesh axes of a boxed parameter (``nn.Partitioned``, or
    ``nn.LogicallyPartitioned`` mapped by its own rules, else ``rules``); ``P()`` unboxed."""
    if not _is_box(box):
        return P()
    spec = box.get_partition_spec()
    if not isinstance(box, nn.LogicallyPartitioned):
        return spec
    rules = box.rules if box.rules is not None else rules
    if not rules and model_axes.spec_names(spec):
        raise ValueError(
            f"A parameter is annotated with the logical axes {spec} (nn.with_logical_partitioning) but "
            "no logical axis rules are given: pass logical_axis_rules=(('embed', 'fsdp'), ...) to "
            "data_parallel, or call the step inside `with nn.logical_axis_rules(...)`."
        )
    mapped = spmd.logical_to_mesh_axes(tuple(spec), rules)
    return P() if mapped is None else mapped


@dataclasses.dataclass
class DataParallelTrainState(runner.RunsSteps):
    """A linen training step over a mesh; see :func:`data_parallel`."""

    fn: Callable[..., Any]
    mesh: jax.sharding.Mesh
    axis_name: base.AxisName
    batch_stats: str
    max_steps_in_flight: int | None = None
    per_worker_params: bool = False
    batch_axes: tuple[Any, ...] = ()
    logical_axis_rules: Any = None
    # Per-worker leaves this step returned (stacked): id -> array.
    _returned: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False)
    _runner: runner.StepRunner = dataclasses.field(init=False, repr=False)

    def _placement(self, state: TrainState) -> Any:
        """A TrainState of bools: True for per-worker (stacked) leaves."""
        found = runner.opt_placement(
            state.tx,
            base.abstract(state.params),
            mesh=self.mesh,
            axis_name=self.axis_name,
            per_worker_params=self.per_worker_params,
        )
        per_worker_stats = self.batch_stats == "per_worker"
        return state.replace(
            step=False,
            params=jax.tree.map(lambda _: self.per_worker_params, state.params),
            opt_state=found.per_worker,
            batch_stats=jax.tree.map(lambda _: per_worker_stats, state.batch_stats),
            key=jax.tree.map(lambda _: False, state.key),
        )

    def _model_specs(self, state: TrainState, local: Any) -> Any:
        """A TrainState of PartitionSpecs over the model axes: the parameters' (read off their
        boxes), the optimizer-state leaves that belong to them like them, ``P()`` elsewhere."""
        rules = (
            self.logical_axis_rules if self.logical_axis_rules is not None else nn.get_logical_axis_rules()
        )
        params = base.abstract(state.params)
        specs = jax.tree.map(lambda b: box_spec(b, rules), state.params, is_leaf=_is_box)
        p_model = model_axes.check_param_specs(specs, params, mesh=self.mesh, axis_name=self.axis_name)
        # Like the parameters, boxes included (their specs are a tree prefix of them).
        p_model = jax.tree.unflatten(
            jax.tree.structure(params), jax.tree.leaves(p_model, is_leaf=model_axes.is_spec)
        )
        return jax.tree.map(lambda _: P(), state).replace(
            params=p_model, opt_state=model_axes.state_specs(local, params, p_model, mesh=self.mesh)
        )

    def _body(self, mask: Any):
        axis_name, fn = self.axis_name, self.fn

        def body(state, batch):
            trace = replicas.ReplicaCopies()
            state = layout.first_rows(state, mask)
            params = jax.tree.map(
                lambda x, m: x if m else trace.copy(x, comm.to_varying(x, axis_name)),
                state.params,
                mask.params,
            )
            key = jax.tree.map(
                lambda k: trace.copy(k, jax.random.fold_in(k, comm.axis_index(axis_name))), state.key
            )
            inside = state.replace(params=params, key=key)
            with replicas.tracing(trace):
                out = fn(inside, *batch)
            new_state, metrics = (out, None) if isinstance(out, TrainState) else (out[0], out[1])
            if not isinstance(new_state, TrainState):
                raise TypeError(
                    "A data-parallel linen step returns (state, metrics) or state, with state a "
                    f"jaxopt_dist.linen.TrainState; got {type(new_state).__name__}."
                )
            new_state = new_state.replace(key=state.key)  # the keys every worker started from
            new_stats = jax.tree.map(
                lambda x, m: x if m or not comm.is_varying(x, axis_name) else comm.pmean(x, axis_name),
                new_state.batch_stats,
                mask.batch_stats,
            )
            new_state = new_state.replace(batch_stats=new_stats)
            for (path, x), m in zip(
                jax.tree_util.tree_flatten_with_path(new_state.params)[0], jax.tree.leaves(mask.params)
            ):
                if comm.is_varying(x, axis_name) and not m:
                    raise ValueError(
                        f"The parameter {jax.tree_util.keystr(path)} comes out of the step different on "
                        "each worker. Update it with state.apply_gradients of jaxopt_dist.linen.TrainState, "
                        "whose tx aggregates gradients (e.g. jaxopt_dist.all_reduce)."
                    )
            new_state = jax.tree.map(
                lambda x, m: comm.to_varying(x, axis_name)[None] if m else x, new_state, mask
            )
            out_metrics = jax.tree.map(lambda x: replicas.replicated_output(x, axis_name=axis_name), metrics)
            return new_state, out_metrics

        return body

    def _build(self, state: TrainState, batch: Any, local: Any) -> Any:
        mask, model = self._placement(state), self._model_specs(state, local)
        s_spec = layout.mask_specs(mask, self.axis_name)
        b_spec = jax.tree.map(lambda _: layout.data_spec(self.axis_name), batch)
        sharded = bool(self.batch_axes) or bool(model_axes.model_axes(model))
        fn = jax.shard_map(
            self._body(mask),
            mesh=self.mesh,
            in_specs=(s_spec, b_spec),
            out_specs=(s_spec, P()),
            check_vma=True,
            **runner.manual_axes(self.axis_name, sharded),
        )
        s_shard = model_axes.shardings(self.mesh, s_spec, model)
        b_sharding = jax.sharding.NamedSharding(
            self.mesh, layout.axes_spec((*base.axis_names(self.axis_name), *self.batch_axes))
        )
        shardings = (s_shard, jax.tree.map(lambda _: b_sharding, batch))
        # With model axes, the outputs keep the inputs' shardings (the compiler could pick others).
        kw: dict[str, Any] = (
            {"out_shardings": (s_shard, jax.sharding.NamedSharding(self.mesh, P()))} if sharded else {}
        )
        return jax.jit(fn, **kw), shardings, mask, model

    def _local_params(self, state: TrainState) -> Any:
        """One worker's copy of ``state.params``, abstract (boxes kept). With ``per_worker_params``
        the parameters come either as one copy (``TrainState.create``) or stacked per worker
        (the step's output, a restored checkpoint): the optimizer state tells which."""
        if not self.per_worker_params:
            return base.abstract(state.params)
        key = ("local params", runner.shape_key((state.params, state.opt_state)))
        return self._runner.cached(key, lambda: self._find_local_params(state))

    def _find_local_params(self, state: TrainState) -> Any:
        n, one = self.num_workers, base.abstract(state.params)
        got = [tuple(np.shape(x)) for x in jax.tree.leaves(state.opt_state)]
        leaves = jax.tree.leaves(one)
        as_one = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(state.tx.init, one))]
        rows = None
        if leaves and all(x.shape[:1] == (n,) for x in leaves):
            rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), one)
        as_rows = None
        if rows is not None:
            placed = runner.opt_placement(
                state.tx, rows, mesh=self.mesh, axis_name=self.axis_name, per_worker_params=True
            )
            local = jax.eval_shape(state.tx.init, rows)
            as_rows = [
                (n, *x.shape) if m else tuple(x.shape)
                for x, m in zip(jax.tree.leaves(local), jax.tree.leaves(placed.per_worker))
            ]
        if got == as_one and got != as_rows:
            return one
        if got == as_rows and got != as_one:
            return rows
        if got == as_one:  # both fit (no state shaped like the parameters): the step count decides
            return one if int(jax.device_get(state.step)) == 0 else rows
        raise ValueError(
            "With per_worker_params=True, state.params must be one copy of the parameters (as "
            "TrainState.create makes it) or stacked for the mesh's "
            f"{n} workers along a leading axis (as the step returns it), with state.opt_state laid "
            "out to match; these fit neither. A state saved by another number of workers is "
            f"regrouped with step.regroup_state(raw, fresh_state) ({n} workers)."
        )

    def _checked_build(self, state: TrainState, batch: Any) -> Any:
        """The jitted step, its shardings, the per-worker mask, the model-axis specs and one
        worker's parameters and optimizer state (abstract), built once per layout."""
        self._runner.check_batch(batch)
        local = state.replace(params=self._local_params(state))
        local = local.replace(opt_state=jax.eval_shape(state.tx.init, local.params))
        return (*self._build(local, batch, local.opt_state), local)

    def _stack(self, state: TrainState, mask: Any, model: Any, local: TrainState) -> TrainState:
        """Stacks the per-worker leaves of a state that holds one copy of them."""

        def stack(what):
            def one(x, m, spec, loc):
                return self._runner.stacked_leaf(x, loc.shape, what=what, model=spec) if m else x

            args = (getattr(state, what), getattr(mask, what), getattr(model, what), getattr(local, what))
            return jax.tree.map(one, *args)

        stats = jax.tree.map(
            lambda x, m: self._runner.stacked(x) if m and self._returned.get(id(x)) is not x else x,
            state.batch_stats,
            mask.batch_stats,
        )
        return state.replace(params=stack("params"), opt_state=stack("opt_state"), batch_stats=stats)

    def __call__(self, state: TrainState, *batch: Any) -> Any:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"The first argument must be a jaxopt_dist.linen.TrainState; got {type(state).__name__}."
            )
        with self._context():
            jitted, shardings, placed = self._prepare(state, batch)
            out = self._runner.dispatch(jitted, (placed, batch), shardings, batch=1)
        self._returned = {id(x): x for x in jax.tree.leaves(out[0].batch_stats)}
        self._runner.throttle(out)
        return out if out[1] is not None else out[0]

    def _context(self) -> Any:
        """The step's (Auto) mesh in context, also where the caller set an Explicit one; the
        logical axis rules given (if any) for the parameters' constraints inside the step."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        if self.logical_axis_rules is not None:
            stack.enter_context(nn.logical_axis_rules(self.logical_axis_rules))
        return stack

    def _prepare(self, state: TrainState, batch: tuple[Any, ...]) -> tuple[Any, Any, TrainState]:
        """The compiled step for these shapes, its shardings and the state with its per-worker
        leaves stacked."""
        jitted, shardings, mask, model, local = self._runner.cached(
            runner.shape_key((state, batch)), lambda: self._checked_build(state, batch)
        )
        return jitted, shardings, self._stack(state, mask, model, local)

    # -- checkpoints --------------------------------------------------------

    def _local(self, state: TrainState) -> TrainState:
        """``state`` (one copy, as ``TrainState.create`` returns it) as abstract leaves."""
        if self.per_worker_params and self._local_params(state) is not None:
            one = base.abstract(state.params)
            if jax.tree.leaves(self._local_params(state)) != jax.tree.leaves(one):
                raise ValueError(
                    "Pass a fresh state (one copy of the parameters, as TrainState.create makes "
                    "it); this one is stacked per worker already."
                )
        local = state.replace(params=base.abstract(state.params))
        return base.abstract(local.replace(opt_state=jax.eval_shape(state.tx.init, local.params)))

    def abstract_state(self, state: TrainState, *, saved: Any = None) -> TrainState:
        """The layout the step gives ``state`` on this mesh, as ``jax.ShapeDtypeStruct`` leaves
        with shardings, nothing allocated: the restore target of a checkpointed state, e.g.
        ``ocp.args.StandardRestore(step.abstract_state(fresh_state))``.

        ``state`` holds one copy of everything, as ``TrainState.create``
        returns it. Per-worker leaves (``per_worker_params``' parameters,
        residuals, ``"per_worker"`` statistics) come stacked along a leading
        worker axis, placed over the data axes. ``saved``: the checkpoint's
        metadata (orbax: ``mngr.item_metadata(step)``); each leaf's saved
        shape is checked against the target first, so a checkpoint written by
        another number of workers gets an error that names the fix
        (:meth:`regroup_state`) rather than a restore that drops or splits
        workers' rows.
        """
        with self._context():
            local = self._local(state)
            mask, model = self._placement(local), self._model_specs(local, local.opt_state)
            target = layout.placed_abstract(local, layout.mask_specs(mask, self.axis_name), self.mesh, model)
        if saved is not None:
            fix = f"state = step.regroup_state(raw, fresh_state) for {self.num_workers} workers."
            layout.check_saved(saved, target, n=self.num_workers, axis_name=self.axis_name, fix=fix)
        return target

    def regroup_state(self, raw: Any, state: TrainState) -> TrainState:
        """A checkpointed state of any number of workers, regrouped for this step's (host-side).

        ``raw`` is the state as restored without a target (host arrays in nested
        dicts, e.g. from zeros like ``mngr.item_metadata(step)``); ``state`` a
        fresh one (one copy, as ``TrainState.create`` returns it) that gives
        the structure. The optimizer state is regrouped with
        :func:`jaxopt_dist.reshard_opt_state`, per-worker parameters and
        statistics with :func:`jaxopt_dist.reshard_params` (their mean over
        workers is kept); the rest is copied. The step places the result.
        """
        local, n = self._local(state), self.num_workers
        flat = {layout.path_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(raw)[0]}

        def part(name: str) -> Any:
            tree = getattr(local, name)
            leaves = []
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
                key = (name, *layout.path_names(p))
                if key not in flat:
                    raise ValueError(
                        f"The checkpoint holds no leaf {'/'.join(key)}; pass the state it was saved from."
                    )
                leaves.append(flat[key])
            return jax.tree.unflatten(jax.tree.structure(tree), leaves)

        params = part("params")
        opt_state = reshard_opt_state(
            part("opt_state"),
            state.tx,
            local.params,
            num_workers=n,
            axis_name=self.axis_name,
            per_worker_params=self.per_worker_params,
        )
        stats = part("batch_stats")
        if self.per_worker_params:
            params = reshard_params(params, num_workers=n)
        if self.batch_stats == "per_worker" and stats is not None:
            stats = reshard_params(stats, num_workers=n)
        return state.replace(
            step=part("step"), params=params, opt_state=opt_state, batch_stats=stats, key=part("key")
        )

    def lower(self, state: TrainState, *batch: Any) -> jax.stages.Lowered:
        """The program ``step(state, *batch)`` runs, lowered and not run.

        ``step.lower(state, batch).compile().as_text()`` is the compiled HLO,
        e.g. for :func:`jaxopt_dist.hlo_collectives` to list what the step sends.
        """
        if not isinstance(state, TrainState):
            raise TypeError(
                f"The first argument must be a jaxopt_dist.linen.TrainState; got {type(state).__name__}."
            )
        with self._context():
            jitted, shardings, placed = self._prepare(state, batch)
            return self._runner.lower(jitted, (placed, batch), shardings)


def data_parallel(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    batch_stats: Literal["sync", "per_worker"] = "sync",
    max_steps_in_flight: int | None = None,
    per_worker_params: bool = False,
    batch_axes: base.AxisName | None = None,
    logical_axis_rules: Any = None,
) -> Any:
    r"""Runs a linen ``TrainState`` step written for one device as a data-parallel step.

    Use it in place of ``@jax.jit`` on ``train_step(state, batch) -> (state,
    metrics)``, with :class:`TrainState` as the state and ``tx`` aggregating
    over ``axis_name``. The first call places the state on the mesh.

    Sharded models need no other code: keep the parameters boxed as
    ``model.init`` returns them with ``nn.with_partitioning(init, ("fsdp",
    None))`` (mesh axes) or ``nn.with_logical_partitioning(init, ("embed",
    "mlp"))`` (logical axes, mapped by ``logical_axis_rules``), create the
    :class:`TrainState` from them, and pass the mesh with its model axes. The
    specs are read off the boxes; inside the step only the data axes are manual
    (``jax.shard_map(..., axis_names=data axes)``), so ``fn`` is ordinary
    sharded JAX code. ``state.params`` and every leaf of ``state.opt_state``
    that belongs to a parameter stay sharded over the model axes: each device
    holds ``1 / (model-axis size)`` of them.

    Args:
      fn: the step. Without it, returns a decorator.
      mesh: a mesh with the axis ``axis_name``, and any model axes the
        parameters' boxes name, e.g. ``jax.make_mesh((2, 4), ("data", "fsdp"))``.
        A box naming the data axis, an axis ``mesh`` lacks, or a dimension
        that does not divide evenly is rejected.
      axis_name: the data axis (or tuple of axes).
      batch_stats: ``"sync"``: running statistics replicated (averaged over the
        workers when the BatchNorm layers do not already do it through their
        ``axis_name``). ``"per_worker"``: one set per worker, stacked along a
        leading worker axis; average them (``jnp.mean(x, 0)``) for evaluation.
      max_steps_in_flight: bound on queued steps; None: 4 on CPU meshes
        (XLA:CPU collectives can deadlock), unbounded on accelerators.
      per_worker_params: keep one copy of the parameters per worker, for
        transforms whose updates differ between workers
        (:func:`jaxopt_dist.diloco`, ``average_params``, gossip): the first
        call takes one copy and stacks it; the step returns them stacked along
        a leading worker axis (average them, ``jnp.mean(x, 0)``, for
        evaluation). Otherwise the parameters are replicated and such a
        transform is rejected.
      batch_axes: model axes that also split the batch, e.g. ``"fsdp"`` for
        FSDP (the batch's leading axis is split over the data axes and these).
        None: the data axes alone.
      logical_axis_rules: the rules mapping the logical axis names of
        ``nn.LogicallyPartitioned`` parameters to mesh axes, e.g.
        ``(("embed", None), ("mlp", "fsdp"))``; also in force while ``fn`` is
        traced (the parameters' sharding constraints). None: the rules of the
        enclosing ``nn.logical_axis_rules`` context at the first call.

    Returns:
      A :class:`DataParallelTrainState` (or a decorator making one).

    Communication:
      Whatever ``tx`` communicates, plus one ``pmean`` of the new running
      statistics (``"sync"`` without BatchNorm ``axis_name``), the BatchNorm
      layers' own ``pmean`` (with ``axis_name``), and one ``pmean`` per float
      metric. Parameters, replicated optimizer state, keys and metrics come out
      replicated; residuals and ``"per_worker"`` statistics are per-worker.
      Over the model axes the compiler adds the collectives of sharded compute
      (all-gathers of the parameters, reduce-scatters of their gradients).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jaxopt_dist as jd
      >>> from jaxopt_dist import linen as jlinen
      >>> model = nn.Dense(2)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> tx = optax.chain(jd.all_reduce(), optax.sgd(0.1))
      >>> state = jlinen.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> @jlinen.data_parallel(mesh=mesh)
      ... def train_step(state, x):
      ...     loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2)
      ...     loss, grads = jax.value_and_grad(loss_fn)(state.params)
      ...     return state.apply_gradients(grads=grads), {"loss": loss}
      >>> state, metrics = train_step(state, jnp.ones((2 * jax.device_count(), 3)))
      >>> int(state.step)
      1

      A sharded model: the kernel's logical axis ``"mlp"`` split over ``"fsdp"``
      inside each of the replicas on ``"data"``; the step is the same.

      >>> init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
      >>> model = nn.Dense(4, kernel_init=init)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> state = jlinen.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      >>> mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "fsdp"))
      >>> rules = (("embed", None), ("mlp", "fsdp"))
      >>> step = jlinen.data_parallel(train_step.fn, mesh=mesh, logical_axis_rules=rules)
      >>> state, metrics = step(state, jnp.ones((8, 3)))
      >>> state.params["kernel"].value.sharding.spec
      P(None, 'fsdp')
    """
    return runner.front_end(
        fn,
        DataParallelTrainState,
        mesh=mesh,
        axis_name=axis_name,
        batch_stats=batch_stats,
        logical_axis_rules=_check_rules(logical_axis_rules),
        max_steps_in_flight=max_steps_in_flight,
        per_worker_params=per_worker_params,
        batch_axes=batch_axes,
    )


def _check_rules(rules: Any) -> Any:
    """``logical_axis_rules`` as a tuple of (logical name, mesh axes) pairs, or None."""
    if rules is None:
        return None
    try:
        return tuple((str(name), mesh_axes) for name, mesh_axes in rules)
    except (TypeError, ValueError):
        raise TypeError(
            f"`logical_axis_rules` must be a sequence of (logical axis, mesh axes) pairs, e.g. "
            f"(('embed', 'fsdp'), ('mlp', None)); got {rules!r}."
        ) from None
