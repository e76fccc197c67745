"""Flax NNX models with state (BatchNorm statistics, RNG streams, metrics) under data parallelism.

:func:`data_parallel` replaces ``@nnx.jit`` on an NNX training step written for
one device; :class:`Optimizer` replaces ``nnx.Optimizer``. The step then runs
under ``jax.shard_map`` with the batch split along the data axis, and every
kind of NNX state is given one consistent meaning:

* ``nnx.Param``: replicated. Gradients are taken per worker (the step
  differentiates a per-worker copy), ``tx`` aggregates them (``all_reduce``,
  ``powersgd``, ...), and :meth:`Optimizer.update` applies the replicated update
  to the replicated parameters. With ``per_worker_params=True`` (``diloco``,
  ``average_params``, gossip) each worker keeps its own copy: the step keeps
  the copies stacked (:meth:`DataParallel.worker_copies`), and the model holds
  the parameters to evaluate, chosen by ``model_params``: DiLoCo's anchor (the
  global model, replicated in ``tx``'s state, so no communication) or the
  workers' average (one all-reduce of the parameters per step).
* Sharded models: a mesh may have *model axes* besides the data axes, e.g.
  ``jax.make_mesh((2, 4), ("data", "fsdp"))``. Variables whose sharding
  metadata (``nnx.with_partitioning(init, ("fsdp", None))``) names model axes
  are sharded over them inside each replica, the data axes stay manual and the
  model axes are left to the compiler, as with ``param_specs`` of
  :func:`jaxopt_dist.data_parallel_step`.
* Optimizer state: placed as :func:`jaxopt_dist.data_parallel_step` places it:
  replicated leaves once, per-worker leaves (error-feedback residuals) stacked
  along a leading worker axis inside the optimizer; every leaf that belongs to a
  parameter (moments, residuals, anchors) sharded over the model axes like it.
* ``nnx.BatchStat`` (BatchNorm): ``batch_stats="sync"`` normalizes with the
  statistics of the *global* batch (SyncBN: the BatchNorm layers average their
  per-worker moments over the axis) and keeps replicated running statistics;
  ``batch_stats="per_worker"`` normalizes with each worker's own batch and
  keeps one set of running statistics per worker, and the model holds their
  average for evaluation.
* RNG streams (``nnx.Rngs``, ``nnx.Dropout(rngs=...)``): each worker draws from
  ``fold_in(key, worker_index)``, and the stream's counter advances every step,
  so dropout masks differ across workers and steps.
* Metrics (``nnx.metrics.Average``, ``Accuracy``, ``MultiMetric`` of them): the
  per-worker increments are summed, so the metrics are those of the global
  batch and replicated.

This module imports flax; ``import jaxopt_dist`` does not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import spmd

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout, model_axes, replicas, runner
from jaxopt_dist._src.training.elastic import reshard_opt_state, reshard_params

P = jax.sharding.PartitionSpec
BatchStats = Literal["sync", "per_worker"]
ModelParams = Literal["anchor", "average"]
MODEL_PARAMS = ("anchor", "average")
"""The ``model_params`` modes of :func:`data_parallel`."""

# Metrics whose state is a sum over examples: the global value is the old one
# plus the sum of every worker's increment.
_ADDITIVE_METRICS = (nnx.metrics.Average, nnx.metrics.MultiMetric)


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` for steps wrapped in :func:`data_parallel`.

    Same constructor and ``update(model, grads, **kwargs)`` as
    ``nnx.Optimizer``. Inside a :func:`data_parallel` step, ``update`` gives
    ``tx`` the per-worker gradients and the *replicated* parameters, so the
    parameters stay replicated when ``tx`` aggregates (e.g.
    ``optax.chain(jaxopt_dist.powersgd(rank=2), optax.adamw(1e-3))``).
    Elsewhere it behaves exactly like ``nnx.Optimizer``.

    Per-worker leaves of the optimizer state (error-feedback residuals) are
    stored stacked along a leading worker axis after the first step.
    """

    def __init__(self, model: Any, tx: optax.GradientTransformation, *, wrt: Any = nnx.Param, **kwargs: Any):
        super().__init__(model, tx, wrt=wrt, **kwargs)
        state = nnx.state(model, wrt)
        leaves, treedef = jax.tree.flatten(nnx.as_pure(state))
        variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        # Static (hashable) description of one copy of the parameters, for the placement:
        # their structure, shapes and dtypes, and their specs over the model axes (metadata).
        self.param_struct = (
            treedef,
            tuple(jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves),
            tuple(variable_spec(v) for v in variables),
        )

    def abstract_params(self) -> Any:
        treedef, leaves, _ = self.param_struct
        return jax.tree.unflatten(treedef, list(leaves))

    def param_specs(self) -> Any:
        """The parameters' PartitionSpecs over the model axes, read off their sharding metadata."""
        treedef, _, specs = self.param_struct
        return jax.tree.unflatten(treedef, list(specs))

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Steps ``tx`` with ``grads`` and writes the new parameters into ``model``."""
        copies = replicas.active()
        if copies is None:
            return super().update(model, grads, **kwargs)
        params = replicas.replicated(nnx.as_pure(nnx.state(model, self.wrt)), copies)
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt))
        updates, new_opt_state = self.tx.update(
            grad_arrays, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
        )
        nnx.update(model, optax.apply_updates(params, updates))
        nnx.update(self.opt_state, nnx.state(new_opt_state))
        self.step[...] += 1
        return updates


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """How one state leaf travels through the step."""

    path: tuple[Any, ...]
    kind: str  # "param", "key", "batch_stat", "metric", "opt", "other"
    per_worker: bool = False
    local_shape: tuple[int, ...] | None = None  # optimizer state: the shape of one worker's copy
    model: P = P()  # the spec over the model axes
    anchor: int | None = None  # per-worker parameters: the position of the anchor the model holds

    @property
    def kept_stacked(self) -> bool:
        """Per-worker copies the step keeps (stacked) while the NNX object holds their mean."""
        return self.per_worker and self.local_shape is None


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


def variable_spec(var: nnx.Variable) -> P:
    """A Variable's PartitionSpec over the model axes, from its sharding metadata
    (``nnx.with_partitioning``; logical names mapped by the rules in force, as
    ``nnx.get_partition_spec`` does); ``P()`` without."""
    spec = spmd.get_var_pspec(var)
    return P() if spec is None else spec


def _key_name(key: Any) -> Any:
    """A ``jax.tree_util`` path entry as NNX spells it in a state path."""
    for attr in ("idx", "name", "key"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def _classify(var: nnx.Variable) -> str:
    if isinstance(var, nnx.Param):
        return "param"
    if isinstance(var, nnx.RngKey):
        return "key"
    if isinstance(var, nnx.BatchStat):
        return "batch_stat"
    if isinstance(var, nnx.metrics.MetricState):
        return "metric"
    if isinstance(var, nnx.OptState):
        return "opt"
    return "other"


def _check_metrics(nodes: Any) -> None:
    for path, node in nnx.iter_graph(nodes):
        if isinstance(node, nnx.metrics.Metric) and not isinstance(node, _ADDITIVE_METRICS):
            raise TypeError(
                f"The metric at {_path_str(tuple(path))} is a {type(node).__name__}; inside a "
                "data-parallel step only metrics that sum over examples (nnx.metrics.Average, "
                "Accuracy and MultiMetric of them) can be combined across workers. Update other "
                "metrics outside the step."
            )


@dataclasses.dataclass
class DataParallel(runner.RunsSteps):
    """A training step over a mesh; see :func:`data_parallel`."""

    fn: Callable[..., Any]
    mesh: jax.sharding.Mesh
    axis_name: base.AxisName
    batch_stats: BatchStats
    max_steps_in_flight: int | None = None
    per_worker_params: bool = False
    batch_axes: tuple[Any, ...] = ()
    model_params: ModelParams | None = None
    # Per-worker running statistics and parameters: path -> (average written into the model,
    # stacked copies).
    _worker_stats: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict, repr=False)
    _runner: runner.StepRunner = dataclasses.field(init=False, repr=False)

    # -- layout -------------------------------------------------------------

    def _optimizer_leaves(self, nodes: Any) -> dict[tuple[Any, ...], tuple[bool, tuple[int, ...], P]]:
        """Path -> (per-worker, one worker's shape, model spec) of each Optimizer's state leaf."""
        out = {}
        for path, node in nnx.iter_graph(nodes):
            if not isinstance(node, Optimizer):
                continue
            params = node.abstract_params()
            found = runner.opt_placement(
                node.tx,
                params,
                mesh=self.mesh,
                axis_name=self.axis_name,
                per_worker_params=self.per_worker_params,
            )
            local = jax.eval_shape(node.tx.init, params)
            p_model = self._checked_specs(node.param_specs(), params, what="the optimizer's parameter")
            s_model = jax.tree.leaves(
                model_axes.state_specs(local, params, p_model, mesh=self.mesh), is_leaf=model_axes.is_spec
            )
            masks = jax.tree_util.tree_flatten_with_path(found.per_worker)[0]
            prefix = (*tuple(path), "opt_state")
            for (keypath, mask), x, spec in zip(masks, jax.tree.leaves(local), s_model):
                out[(*prefix, *map(_key_name, keypath))] = (mask, tuple(x.shape), spec)
        return out

    def _anchors(self, nodes: Any) -> dict[tuple[Any, ...], list[tuple[Any, ...]]]:
        """Path of a parameter relative to its module -> the paths of the anchor leaves that
        the Optimizers' states (:class:`jaxopt_dist.DiLoCoState`) keep for it."""
        out: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}

        def is_diloco(x: Any) -> bool:  # a state that declares where its global model is (DiLoCo's)
            return isinstance(x, tuple) and getattr(type(x), "GLOBAL_MODEL", None) == "anchor"

        for path, node in nnx.iter_graph(nodes):
            if not isinstance(node, Optimizer):
                continue
            params = node.abstract_params()
            rel = [tuple(map(_key_name, kp)) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
            local = jax.eval_shape(node.tx.init, params)
            prefix = (*tuple(path), "opt_state")
            for kp, state in jax.tree_util.tree_flatten_with_path(local, is_leaf=is_diloco)[0]:
                if not is_diloco(state):
                    continue
                anchor = jax.tree_util.tree_flatten_with_path(state.anchor)[0]
                if len(anchor) != len(rel):  # pragma: no cover - an anchor is shaped like params
                    continue
                for r, (akp, _) in zip(rel, anchor):
                    where = (*prefix, *map(_key_name, kp), "anchor", *map(_key_name, akp))
                    out.setdefault(r, []).append(where)
        return out

    def _with_anchors(
        self, nodes: Any, leaves: list[_Leaf], shapes: dict[tuple[Any, ...], tuple[int, ...]]
    ) -> list[_Leaf]:
        """``leaves`` with each per-worker parameter pointed at the anchor the model holds
        (``model_params="anchor"``, or its default where ``tx`` keeps anchors)."""
        kept = [leaf for leaf in leaves if leaf.kept_stacked and leaf.kind == "param"]
        if not kept or self.model_params == "average":
            return leaves
        anchors, index = self._anchors(nodes), {leaf.path: i for i, leaf in enumerate(leaves)}
        out = list(leaves)
        for leaf in kept:
            found = [index[a] for a in anchors.get(leaf.path[1:], []) if a in index]
            found = [i for i in found if leaves[i].local_shape == shapes[leaf.path]]
            if len(found) != 1:
                why = "keeps no anchor for it" if not found else f"keeps {len(found)} anchors for it"
                raise ValueError(
                    f"With per_worker_params=True the model holds the parameters to evaluate, and "
                    f"the parameter {_path_str(leaf.path)} has no single one: its Optimizer's tx "
                    f"{why} (jaxopt_dist.diloco and sparseloco keep one, the global model; gossip, "
                    "average_params and noloco do not). Pass model_params='average' to write the "
                    "workers' average into the model after every step (one all-reduce of the "
                    "parameters per step, on top of what tx sends)."
                )
            out[index[leaf.path]] = dataclasses.replace(leaf, anchor=found[0])
        return out

    def _checked_specs(self, specs: Any, values: Any, *, what: str) -> Any:
        """``specs`` checked against the mesh (model axes only, dimensions divisible)."""
        try:
            return model_axes.check_param_specs(specs, values, mesh=self.mesh, axis_name=self.axis_name)
        except ValueError as e:
            raise ValueError(f"The sharding metadata of {what}: {e}") from None

    def _layout(self, nodes: Any, variables: list[nnx.Variable], paths: list[tuple[Any, ...]]) -> list[_Leaf]:
        """Kind, placement and model spec of every state leaf of ``nodes`` (in flattening order)."""
        opt_leaves = self._optimizer_leaves(nodes)
        missing = [p for p in opt_leaves if p not in paths]
        if missing:  # pragma: no cover - guards flax internals
            raise ValueError(f"Unexpected optimizer state layout at {_path_str(missing[0])}.")
        names = {p: _path_str(p) for p in paths if p not in opt_leaves}
        specs = self._checked_specs(
            {names[p]: variable_spec(v) for v, p in zip(variables, paths) if p in names},
            {names[p]: base.abstract(v.get_value()) for v, p in zip(variables, paths) if p in names},
            what="a variable",
        )
        leaves = []
        for var, path in zip(variables, paths):
            kind = _classify(var)
            if path in opt_leaves:
                leaves.append(_Leaf(path, kind, *opt_leaves[path]))
                continue
            per_worker = kind == "batch_stat" and self.batch_stats == "per_worker"
            per_worker = per_worker or (kind == "param" and self.per_worker_params)
            leaves.append(_Leaf(path, kind, per_worker, model=specs[names[path]]))
        shapes = {p: tuple(np.shape(v.get_value())) for v, p in zip(variables, paths)}
        return self._with_anchors(nodes, leaves, shapes)

    def _stack_inputs(self, values: list[Any], leaves: list[_Leaf]) -> list[Any]:
        """Per-worker leaves as stacked arrays (worker ``i`` owns row ``i``)."""
        out = []
        for x, leaf in zip(values, leaves):
            if leaf.kept_stacked:
                kept = self._worker_stats.get(leaf.path)
                x = kept[1] if kept is not None and kept[0] is x else self._runner.stacked(x, leaf.model)
            elif leaf.per_worker and leaf.local_shape is not None:
                x = self._runner.stacked_leaf(
                    x, leaf.local_shape, what=_path_str(leaf.path), model=leaf.model
                )
            out.append(x)
        return out

    # -- the step -----------------------------------------------------------

    def _body(self, graphdef: Any, treedef: Any, leaves: list[_Leaf], batch_pos: list[int], nargs: int):
        axis_name, fn, sync = self.axis_name, self.fn, self.batch_stats == "sync"

        def body(values, batch):
            trace = replicas.ReplicaCopies()
            inside = []
            for x, leaf in zip(values, leaves):
                if leaf.per_worker:
                    x = x[0]
                elif leaf.kind == "param":
                    x = trace.copy(x, comm.to_varying(x, axis_name))
                elif leaf.kind == "key":
                    x = trace.copy(x, jax.random.fold_in(x, comm.axis_index(axis_name)))
                inside.append(x)
            nodes = nnx.merge(graphdef, jax.tree.unflatten(treedef, inside))
            if sync:
                for _, module in nnx.iter_graph(nodes):
                    if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
                        # flax annotates a str; jax.lax.pmean also takes a tuple of axes.
                        module.axis_name = cast(Any, axis_name)
            args, node_iter, batch_iter = [], iter(nodes), iter(batch)
            for i in range(nargs):
                args.append(next(batch_iter) if i in batch_pos else next(node_iter))
            with replicas.tracing(trace):
                out = fn(*args)
            new_values, new_treedef = jax.tree.flatten(nnx.as_pure(nnx.state(nodes)))
            if new_treedef != treedef:
                raise ValueError(
                    "The step changed the structure of its NNX arguments (Variables added or "
                    "removed); a data-parallel step may only change their values."
                )
            outs = [
                _finish(old, mine, new, leaf, trace, axis_name)
                for old, mine, new, leaf in zip(values, inside, new_values, leaves)
            ]
            return outs, jax.tree.map(functools.partial(replicas.replicated_output, axis_name=axis_name), out)

        return body

    def _build(self, graphdef: Any, treedef: Any, leaves: list[_Leaf], batch: Any, batch_pos, nargs):
        spec = layout.data_spec(self.axis_name)
        v_spec = [spec if leaf.per_worker else P() for leaf in leaves]
        b_spec = jax.tree.map(lambda _: spec, batch)
        model = [leaf.model for leaf in leaves]
        sharded = bool(self.batch_axes) or any(model_axes.spec_names(m) for m in model)
        fn = jax.shard_map(
            self._body(graphdef, treedef, leaves, batch_pos, nargs),
            mesh=self.mesh,
            in_specs=(v_spec, b_spec),
            out_specs=(v_spec, P()),
            check_vma=True,
            **runner.manual_axes(self.axis_name, sharded),
        )

        def step(values, batch):
            new_values, out = fn(values, batch)
            # Per-worker copies kept by the step: the NNX objects hold their mean, unless they
            # hold an anchor of the optimizer state (taken from the outputs, on the host).
            means = [
                jnp.mean(x, axis=0).astype(x.dtype) if leaf.kept_stacked and leaf.anchor is None else None
                for x, leaf in zip(new_values, leaves)
            ]
            return new_values, means, out

        shard = lambda s: jax.sharding.NamedSharding(self.mesh, s)  # noqa: E731
        v_shard = model_axes.shardings(self.mesh, v_spec, model)
        b_shard = jax.tree.map(
            lambda _: shard(layout.axes_spec((*base.axis_names(self.axis_name), *self.batch_axes))), batch
        )
        if not sharded:
            return jax.jit(step), (v_shard, b_shard)
        # The outputs keep the inputs' shardings (the compiler could pick others).
        m_shard = [
            shard(leaf.model) if leaf.kept_stacked and leaf.anchor is None else None for leaf in leaves
        ]
        return jax.jit(step, out_shardings=(v_shard, m_shard, shard(P()))), (v_shard, b_shard)

    def __call__(self, *args: Any) -> Any:
        # The step's (Auto) mesh in context, also where the caller set the Explicit mesh
        # that sharded NNX models are built under (`with jax.set_mesh(mesh)`).
        with jax.set_mesh(self.mesh):
            return self._call(*args)

    def _split(
        self, nodes: tuple[Any, ...]
    ) -> tuple[Any, Any, list[tuple[Any, ...]], list[Any], list[_Leaf]]:
        """``nodes``' graphdef, state treedef, leaf paths, leaf values and layout."""
        graphdef, state = nnx.split(nodes)
        # Entries without arrays (optax.MaskedNode in a partitioned optimizer's state) are structure.
        flat = [(p, v) for p, v in nnx.to_flat_state(state) if jax.tree.leaves(v)]
        paths = [tuple(p) for p, _ in flat]
        variables = [v for _, v in flat]
        values, treedef = jax.tree.flatten(nnx.as_pure(state))
        if len(values) != len(variables):  # pragma: no cover - guards flax internals
            raise ValueError("Unexpected NNX state layout.")
        leaves = self._runner.cached(
            ("layout", graphdef, treedef), lambda: self._layout(nodes, variables, paths)
        )
        return graphdef, treedef, paths, values, leaves

    def _prepare(self, *args: Any) -> tuple[Any, ...]:
        """The compiled step for ``args`` and its placed inputs (built once per layout)."""
        nargs = len(args)
        node_pos = [i for i, a in enumerate(args) if nnx.graph.is_graph_node(a)]
        batch_pos = [i for i in range(nargs) if i not in node_pos]
        nodes = tuple(args[i] for i in node_pos)
        batch = [args[i] for i in batch_pos]
        self._runner.check_batch(
            batch,
            hint=" Every array argument is split across workers: pass models, optimizers, metrics "
            "and nnx.Rngs as NNX objects.",
        )
        _check_metrics(nodes)
        graphdef, treedef, paths, values, leaves = self._split(nodes)
        values = self._stack_inputs(values, leaves)
        key = (graphdef, treedef, tuple(batch_pos), runner.shape_key((values, batch)))
        jitted, shardings = self._runner.cached(
            key, lambda: self._build(graphdef, treedef, leaves, batch, batch_pos, nargs)
        )
        return nodes, treedef, leaves, jitted, shardings, values, batch

    def _call(self, *args: Any) -> Any:
        nodes, treedef, leaves, jitted, shardings, values, batch = self._prepare(*args)
        new_values, means, out = self._runner.dispatch(jitted, (values, batch), shardings, batch=1)
        self._write_back(nodes, treedef, new_values, means, leaves)
        self._runner.throttle((out, new_values))
        return out

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The program a call with ``args`` runs, lowered and not run (nothing is updated).

        ``step.lower(model, optimizer, batch).compile().as_text()`` is the
        compiled HLO, e.g. for :func:`jaxopt_dist.hlo_collectives` to list
        what the step sends.
        """
        with jax.set_mesh(self.mesh):
            _, _, _, jitted, shardings, values, batch = self._prepare(*args)
            return self._runner.lower(jitted, (values, batch), shardings)

    def worker_copies(self) -> dict[str, jax.Array]:
        """The per-worker values the step keeps while the NNX objects hold their average.

        Parameters with ``per_worker_params`` and running statistics with
        ``batch_stats="per_worker"``, each stacked along a leading worker axis
        (placed over the data axes, and over the model axes like the variable),
        keyed by the variable's path among the step's NNX arguments
        (``"0/linear/kernel"``: argument 0's ``linear.kernel``).
        """
        return {_path_str(path): kept for path, (_, kept) in self._worker_stats.items()}

    # -- checkpoints --------------------------------------------------------

    def checkpoint_state(self, *nodes: Any) -> dict[str, Any]:
        """Everything a resumed run needs from the step's NNX arguments, as one tree of arrays.

        Save it with orbax (``ocp.args.StandardSave(step.checkpoint_state(model,
        optimizer))``); restore it into :meth:`checkpoint_target` and hand it to
        :meth:`restore_state`. Pass the NNX arguments of a call, in its order.

        Returns:
          ``{"state": ..., "worker_copies": ...}``: ``"state"`` holds every
          Variable of ``nodes`` as nested dicts keyed by strings (argument
          ``"0"``, ``"1"``, ...; NNX's ``to_pure_dict`` layout), what the model
          holds included and the optimizers' per-worker leaves stacked along a
          leading worker axis; ``"worker_copies"`` holds the per-worker copies
          the step keeps (:meth:`worker_copies`: parameters with
          ``per_worker_params``, running statistics with
          ``batch_stats="per_worker"``), stacked, in the same layout.
        """
        _, _, paths, values, leaves = self._split(nodes)
        stacked = self._stack_inputs(values, leaves)
        state = {p: (x if leaf.kept_stacked else s) for p, x, s, leaf in zip(paths, values, stacked, leaves)}
        copies = {p: s for p, s, leaf in zip(paths, stacked, leaves) if leaf.kept_stacked}
        return {"state": _nest(state), "worker_copies": _nest(copies)}

    def checkpoint_target(self, *nodes: Any, saved: Any = None) -> dict[str, Any]:
        """:meth:`checkpoint_state`'s layout for this mesh as ``jax.ShapeDtypeStruct`` leaves with
        shardings, nothing allocated: the restore target, e.g.
        ``ocp.args.StandardRestore(step.checkpoint_target(model, optimizer))``.

        ``nodes`` may be freshly built (the optimizer's per-worker leaves not yet
        stacked). ``saved``: the checkpoint's metadata (orbax:
        ``mngr.item_metadata(step)``); each leaf's saved shape is checked
        against the target first, so a checkpoint written by another number of
        workers gets an error that names the fix (:meth:`regroup_state`)
        rather than a restore that drops or splits workers' rows.
        """
        _, _, paths, values, leaves = self._split(nodes)
        n, state, copies = self.num_workers, {}, {}
        for path, x, leaf in zip(paths, values, leaves):
            one = jax.ShapeDtypeStruct(
                np.shape(x), jnp.result_type(x), sharding=self._model_sharding(leaf.model)
            )
            if leaf.per_worker and leaf.local_shape is not None:
                shape = (n, *leaf.local_shape)
                one = jax.ShapeDtypeStruct(
                    shape, one.dtype, sharding=self._runner.stacked_sharding(leaf.model)
                )
            state[path] = one
            if leaf.kept_stacked:
                stacked = self._runner.stacked_sharding(leaf.model)
                copies[path] = jax.ShapeDtypeStruct((n, *np.shape(x)), one.dtype, sharding=stacked)
        target = {"state": _nest(state), "worker_copies": _nest(copies)}
        if saved is not None:
            layout.check_saved(saved, target, n=n, axis_name=self.axis_name, fix=self._regroup_fix())
        return target

    def _model_sharding(self, spec: P) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, spec)

    def _regroup_fix(self) -> str:
        return (
            "restore it without a target (host arrays) and write "
            f"ckpt = step.regroup_state(raw, model, optimizer, ...) for {self.num_workers} workers "
            "(jaxopt_dist.reshard_opt_state and reshard_params on each part)."
        )

    def restore_state(self, checkpoint: dict[str, Any], *nodes: Any) -> None:
        """Writes a :meth:`checkpoint_state` tree into ``nodes`` and gives the step its per-worker
        copies back, so the run continues as if it had not stopped (bit for bit, same number of
        workers). A tree laid out for another number of workers is rejected with the fix."""
        _, treedef, paths, _, leaves = self._split(nodes)
        state, copies = _flat(checkpoint["state"]), _flat(checkpoint.get("worker_copies", {}))
        n, new, kept = self.num_workers, [], {}
        for path, leaf in zip(paths, leaves):
            key = tuple(map(str, path))
            if key not in state:
                raise ValueError(
                    f"The checkpoint holds no value for {_path_str(path)}: pass the NNX arguments "
                    "it was saved from, in the same order."
                )
            x = state[key]
            if leaf.per_worker and leaf.local_shape is not None:
                want = jax.ShapeDtypeStruct((n, *leaf.local_shape), jnp.result_type(x))
                self._check_stacked(x, want, leaf)
            if leaf.kept_stacked:
                if key not in copies:
                    raise ValueError(
                        f"The checkpoint holds no per-worker copies of {_path_str(path)}; save "
                        "step.checkpoint_state(...), which includes them."
                    )
                c = copies[key]
                self._check_stacked(c, jax.ShapeDtypeStruct((n, *np.shape(x)), jnp.result_type(x)), leaf)
                kept[path] = c
            new.append(x)
        nnx.update(nodes, jax.tree.unflatten(treedef, new))
        # The model's new values, by identity: the step continues from the copies while they stand.
        _, _, paths, values, _ = self._split(nodes)
        for path, x in zip(paths, values):
            if path in kept:
                self._worker_stats[path] = (x, kept[path])

    def _check_stacked(self, x: Any, want: jax.ShapeDtypeStruct, leaf: _Leaf) -> None:
        want = jax.ShapeDtypeStruct(
            want.shape, want.dtype, sharding=self._runner.stacked_sharding(leaf.model)
        )
        layout.check_layout(
            x,
            want,
            what=_path_str(leaf.path),
            n=self.num_workers,
            axis_name=self.axis_name,
            fix=self._regroup_fix(),
        )

    def regroup_state(self, raw: dict[str, Any], *nodes: Any) -> dict[str, Any]:
        """A :meth:`checkpoint_state` tree saved by any number of workers, regrouped for this
        step's (host-side; for :meth:`restore_state`).

        ``raw`` is the tree as restored without a target (host arrays, e.g.
        ``mngr.restore(step, args=ocp.args.StandardRestore(zeros like
        mngr.item_metadata(step)))``). Each :class:`Optimizer`'s state is
        regrouped with :func:`jaxopt_dist.reshard_opt_state` and the per-worker
        copies with :func:`jaxopt_dist.reshard_params` (their mean over workers
        is kept); the rest is copied.
        """
        n = self.num_workers
        state = {k: v for k, v in _flat(raw["state"]).items()}
        for path, node in nnx.iter_graph(nodes):
            if not isinstance(node, Optimizer):
                continue
            prefix = (*map(str, path), "opt_state")
            sub = _nest({k[len(prefix) :]: v for k, v in state.items() if k[: len(prefix)] == prefix})
            regrouped = reshard_opt_state(
                sub,
                node.tx,
                node.abstract_params(),
                num_workers=n,
                axis_name=self.axis_name,
                per_worker_params=self.per_worker_params,
            )
            for kp, x in jax.tree_util.tree_flatten_with_path(regrouped)[0]:
                state[(*prefix, *layout.path_names(kp))] = x
        copies = raw.get("worker_copies") or {}
        return {
            "state": _nest(state),
            "worker_copies": reshard_params(copies, num_workers=n) if copies else {},
        }

    def _write_back(self, nodes: Any, treedef: Any, new_values: list[Any], means: list[Any], leaves) -> None:
        """Writes the step's new state into the NNX objects; per-worker statistics as their mean."""
        written = []
        for x, mean, leaf in zip(new_values, means, leaves):
            if leaf.anchor is not None:
                mean = new_values[leaf.anchor]
            if mean is not None:
                self._worker_stats[leaf.path] = (mean, x)
                x = mean
            written.append(x)
        nnx.update(nodes, jax.tree.unflatten(treedef, written))


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """``{path: leaf}`` as nested dicts keyed by strings."""
    out: dict[str, Any] = {}
    for path, x in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(str(k), {})
        node[str(path[-1])] = x
    return out


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
    """Nested dicts (or any tree) as ``{path of strings: leaf}``."""
    return {layout.path_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _finish(
    old: Any, mine: Any, new: Any, leaf: _Leaf, trace: replicas.ReplicaCopies, axis_name: base.AxisName
) -> Any:
    """One state leaf after the step, typed as its placement requires."""
    if leaf.per_worker:
        return comm.to_varying(new, axis_name)[None]
    if new is mine and trace.original(mine) is not None:
        return old  # an untouched per-worker copy of a replicated value (unused params, RNG keys)
    if leaf.kind == "metric":
        if new is mine:
            return old
        # Every worker's increment counts, also one typed invariant (a count of examples).
        return old + comm.psum(comm.to_varying(new - old, axis_name), axis_name)
    if not comm.is_varying(new, axis_name):
        return new
    if leaf.kind == "param":
        raise ValueError(
            f"The parameter {_path_str(leaf.path)} comes out of the step different on each worker. "
            "Update parameters with jaxopt_dist.nnx.Optimizer (not nnx.Optimizer), whose tx "
            "aggregates gradients, e.g. optax.chain(jaxopt_dist.all_reduce(), optax.adamw(...))."
        )
    if leaf.kind == "batch_stat":
        raise ValueError(
            f"The BatchNorm statistic {_path_str(leaf.path)} differs between workers but "
            "batch_stats='sync': the BatchNorm layer already averages over another axis "
            f"({axis_name!r} expected). Use batch_stats='per_worker' or the same axis_name."
        )
    raise ValueError(
        f"The state {_path_str(leaf.path)} ({leaf.kind}) comes out of the step different on each "
        "worker, and a data-parallel step keeps it replicated. Compute it from replicated values."
    )


def data_parallel(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    batch_stats: BatchStats = "sync",
    max_steps_in_flight: int | None = None,
    per_worker_params: bool = False,
    batch_axes: base.AxisName | None = None,
    model_params: ModelParams | None = None,
) -> Any:
    r"""Runs an NNX step written for one device as a data-parallel step over ``mesh``.

    Use it in place of ``@nnx.jit``, with :class:`Optimizer` in place of
    ``nnx.Optimizer``. NNX arguments (modules, optimizers, metrics,
    ``nnx.Rngs``) are updated in place as under ``nnx.jit``; every other
    argument is a pytree of arrays split along its leading axis across the
    workers (the global batch). Each worker runs ``fn`` on its shard; the state
    is kept consistent as described in :mod:`jaxopt_dist.nnx`. What ``fn``
    returns comes back replicated: floats averaged over workers.

    Sharded models need no other code: build the model (and its
    :class:`Optimizer`) with sharding metadata, e.g.
    ``nnx.Linear(..., kernel_init=nnx.with_partitioning(init, ("fsdp", None)))``
    under ``with jax.set_mesh(mesh)``, and pass the same mesh with its model
    axes. The specs are read off the variables' metadata (logical names are
    mapped by the rules in force, as ``nnx.get_partition_spec`` maps them);
    inside the step only the data axes are manual (``jax.shard_map(...,
    axis_names=data axes)``), so ``fn`` is ordinary sharded JAX code. The
    variables, and every optimizer-state leaf that belongs to a parameter,
    stay sharded over the model axes: each device holds ``1 / (model-axis
    size)`` of them.

    Args:
      fn: the step, e.g. ``train_step(model, optimizer, metrics, batch)``.
        Without it, returns a decorator.
      mesh: a mesh with the axis ``axis_name``, e.g. ``jax.make_mesh((8,), ("data",))``,
        and any model axes the variables' sharding metadata names, e.g.
        ``jax.make_mesh((2, 4), ("data", "fsdp"))``. A variable whose metadata
        names the data axis, an axis ``mesh`` lacks, or a dimension that does
        not divide evenly is rejected.
      axis_name: the data axis (or tuple of axes).
      batch_stats: ``"sync"`` (default): BatchNorm layers normalize with the
        global batch's statistics (SyncBN; two small all-reduces per layer and
        step, replicated running statistics). ``"per_worker"``: each worker
        normalizes with its own shard's statistics and keeps its own running
        statistics; the model holds their average (for evaluation).
      max_steps_in_flight: bound on queued steps; None: 4 on CPU meshes
        (XLA:CPU collectives can deadlock), unbounded on accelerators.
      per_worker_params: each worker keeps its own copy of the parameters,
        for transforms whose updates differ between workers
        (:func:`jaxopt_dist.diloco`, ``average_params``, gossip). The step
        keeps the copies stacked along a leading worker axis (sharded over the
        model axes like the parameter; see :meth:`DataParallel.worker_copies`)
        and the model holds the parameters to evaluate (``model_params``).
        Otherwise the parameters are replicated and such a transform is
        rejected.
      model_params: what the model's parameters hold after each step with
        ``per_worker_params=True``. ``"anchor"``: the anchor of ``tx``'s
        :class:`jaxopt_dist.DiLoCoState` (``diloco``, ``sparseloco``), the
        global model of the last synchronisation, which DiLoCo evaluates; it
        is replicated in the optimizer state, so the step communicates
        exactly what ``tx`` communicates. ``"average"``: the workers'
        average, one all-reduce of the parameters over the data axis per
        step on top of ``tx``'s (gossip, ``average_params``, ``noloco``, which
        keep no replicated anchor). None (default): ``"anchor"``; a ``tx``
        without an anchor is rejected with a message naming both choices,
        so the extra all-reduce is never hidden.
      batch_axes: model axes that also split the batch, e.g. ``"fsdp"`` for
        FSDP (the batch's leading axis is split over the data axes and these).
        None: the data axes alone.

    Returns:
      A :class:`DataParallel` step (or a decorator making one).

    Communication:
      Whatever ``tx`` communicates, plus: with ``per_worker_params=True``
      and ``model_params="average"``, one all-reduce of the parameters per
      step (none with ``"anchor"``); with ``batch_stats="per_worker"``, one
      all-reduce of the running statistics per step (their average, written
      into the model); SyncBN, one ``pmean`` of
      ``2 x features`` floats per BatchNorm layer in the forward pass and its
      transpose in the backward pass; one ``psum`` per metric state leaf; one
      ``pmean`` per floating-point output. Parameters, replicated optimizer
      state, running statistics (sync), RNG keys/counters and metrics come out
      replicated; error-feedback residuals and per-worker statistics are
      per-worker, stacked along a leading worker axis. Over the model axes the
      compiler adds the collectives of sharded compute (all-gathers of the
      parameters, reduce-scatters of their gradients).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> from flax import nnx
      >>> from jaxopt_dist import nnx as jnnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
      >>> tx = optax.chain(jd.all_reduce(), optax.sgd(0.1))
      >>> optimizer = jnnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> @jnnx.data_parallel(mesh=mesh)
      ... def train_step(model, optimizer, x):
      ...     loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = train_step(model, optimizer, jnp.ones((2 * jax.device_count(), 3)))
      >>> loss.shape
      ()

      A sharded model: the kernel split over ``"fsdp"`` inside each of the
      replicas on ``"data"``; the step is the same.

      >>> mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "fsdp"))
      >>> with jax.set_mesh(mesh):
      ...     init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
      ...     model = nnx.Linear(4, 2, kernel_init=init, rngs=nnx.Rngs(0))
      ...     optimizer = jnnx.Optimizer(model, optax.chain(jd.all_reduce(), optax.adamw(1e-3)), wrt=nnx.Param)
      >>> loss = jnnx.data_parallel(train_step.fn, mesh=mesh)(model, optimizer, jnp.ones((8, 4)))
      >>> model.kernel[...].sharding.spec
      P('fsdp', None)
    """
    return runner.front_end(
        fn,
        DataParallel,
        mesh=mesh,
        axis_name=axis_name,
        batch_stats=batch_stats,
        max_steps_in_flight=max_steps_in_flight,
        per_worker_params=per_worker_params,
        batch_axes=batch_axes,
        model_params=_check_model_params(model_params),
    )


def _check_model_params(value: Any) -> ModelParams | None:
    if value is not None and value not in MODEL_PARAMS:
        raise ValueError(f"`model_params` must be None or one of {MODEL_PARAMS}; got {value!r}.")
    return value
