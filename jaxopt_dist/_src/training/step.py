"""Data-parallel steps over a mesh, with the optimizer state placed for you.

Users write no PartitionSpec for optimizer state: :mod:`.placement` finds
which leaves are per-worker, :mod:`.layout` stacks and places them, and
:class:`DataParallelStep` runs ``jax.shard_map`` over the data axis through the
shared :class:`~.runner.StepRunner`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout, model_axes, placement, runner

P = jax.sharding.PartitionSpec


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``, keeping parameters whose update is float0 (integer leaves) as they are."""
    return jax.tree.map(lambda p, u: p if comm.is_float0(u) else optax.apply_updates(p, u), params, updates)


def place_params(
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool | None = None,
    param_specs: Any = None,
    per_worker: bool | None = None,
) -> Any:
    """Puts one copy of the parameters on ``mesh``: replicated, or one copy per worker.

    With ``per_worker_params=True`` each leaf gets a leading axis of size ``n``
    (worker ``i`` owns row ``i``), as :func:`data_parallel_step` expects for
    transforms with per-worker parameters (``average_params``, gossip,
    ``diloco``). ``param_specs`` (see :func:`data_parallel_step`) shards each
    leaf over the model axes too. ``per_worker`` is the deprecated spelling of
    ``per_worker_params`` (it still works, with a ``DeprecationWarning``).
    """
    per_worker = bool(
        base.renamed_keyword(per_worker_params, per_worker, new="per_worker_params", old="per_worker")
    )
    axis_name = base.validate_axis_name(axis_name)
    layout.mesh_axis_size(mesh, axis_name)
    specs = layout.mask_specs(jax.tree.map(lambda _: per_worker, params), axis_name)
    model = _model_param_specs(params, param_specs, mesh, axis_name)
    mesh = mesh if model is None else layout.auto_axes(mesh)
    return layout.place_by_specs(params, specs, mesh=mesh, model_specs=model)


def _model_param_specs(params: Any, param_specs: Any, mesh: Any, axis_name: base.AxisName) -> Any:
    """``param_specs`` checked (None stays None)."""
    if param_specs is None:
        return None
    return model_axes.check_param_specs(param_specs, params, mesh=mesh, axis_name=axis_name)


def _state_model_specs(tx: Any, params: Any, param_specs: Any, mesh: Any, axis_name: base.AxisName) -> Any:
    """Model-axis specs of ``tx``'s state for ``param_specs`` (None without model axes)."""
    model = _model_param_specs(params, param_specs, mesh, axis_name)
    if model is None:
        return None
    return model_axes.state_specs(jax.eval_shape(tx.init, base.abstract(params)), params, model, mesh=mesh)


def init_opt_state(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
    param_specs: Any = None,
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
      param_specs: the parameters' model-axis specs (see
        :func:`data_parallel_step`): the leaves that belong to a parameter are
        sharded like it, declared flat buffers over the model axes.

    Returns:
      The placed optimizer state.
    """
    specs = placement.opt_state_specs(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    )
    model = _state_model_specs(tx, params, param_specs, mesh, axis_name)
    mesh = mesh if model is None else layout.auto_axes(mesh)
    return layout.place_by_specs(tx.init(params), specs, mesh=mesh, model_specs=model)


def place_opt_state(
    opt_state: Any,
    tx: optax.GradientTransformation,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
    param_specs: Any = None,
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
      param_specs: the parameters' model-axis specs (see :func:`data_parallel_step`).

    Returns:
      The state, per-worker leaves placed ``P(axis_name)``, the rest ``P()``
      (each sharded over the model axes like its parameter, with ``param_specs``).
    """
    axis_name = base.validate_axis_name(axis_name)
    n = layout.mesh_axis_size(mesh, axis_name)
    found = placement.opt_state_placement(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    )
    specs = layout.mask_specs(found.per_worker, axis_name)
    model = _state_model_specs(tx, params, param_specs, mesh, axis_name)
    mesh = mesh if model is None else layout.auto_axes(mesh)
    expected = layout.placed_abstract(jax.eval_shape(tx.init, base.abstract(params)), specs, mesh, model)
    layout.check_layout(opt_state, expected, what="opt_state", n=n, axis_name=axis_name)
    return jax.device_put(opt_state, jax.tree.map(lambda x: x.sharding, expected))


def _scaled_loss(loss_fn: Callable[..., Any], scale: Any, has_aux: bool) -> Callable[..., Any]:
    """``loss_fn`` multiplied by the loss scale (in float32); itself when there is none."""

    def scaled(q, b):
        out = loss_fn(q, b)
        if scale is None:
            return out
        if has_aux:
            return out[0].astype(jnp.float32) * scale, out[1]
        return out.astype(jnp.float32) * scale

    return scaled


@dataclasses.dataclass
class DataParallelStep(runner.RunsSteps):
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
    param_specs: Any = None
    batch_axes: tuple[Any, ...] = ()
    reduce_metrics: bool = True
    _runner: runner.StepRunner = dataclasses.field(init=False, repr=False)

    def placement(self, params: Any) -> placement.Placement:
        """The state placement for one copy of ``params``."""
        return self._runner.cached(("placement", runner.shape_key(params)), lambda: self._trace(params))

    def _step_mesh(self) -> Any:
        """The step's own mesh in context, over a caller's ``jax.set_mesh`` (sharded models only)."""
        return jax.set_mesh(self.mesh) if self.param_specs is not None else contextlib.nullcontext()

    def _trace(self, params: Any) -> placement.Placement:
        found = placement.trace_placement(
            self.tx,
            params,
            mesh=self.mesh,
            axis_name=self.axis_name,
            per_worker_params=self.per_worker_params,
        )
        if found.updates_per_worker and not self.per_worker_params:
            raise ValueError(placement.DRIFT_MESSAGE)
        return found

    def _specs(self, params: Any) -> tuple[Any, Any]:
        """(params spec, state specs) on the data axes for one copy of ``params``."""
        spec = layout.data_spec(self.axis_name) if self.per_worker_params else P()
        state_specs = placement.leaf_specs(self.placement(params), self.axis_name)
        return jax.tree.map(lambda _: spec, params), state_specs

    def _model_specs(self, params: Any) -> tuple[Any, Any] | tuple[None, None]:
        """(params, state) specs on the model axes for one copy of ``params``; Nones without model axes."""
        if self.param_specs is None:
            return None, None

        def find():
            args = (params, self.param_specs, self.mesh, self.axis_name)
            return _model_param_specs(*args), _state_model_specs(self.tx, *args)

        return self._runner.cached(("model_specs", runner.shape_key(params)), find)

    def init(self, params: Any) -> tuple[Any, Any]:
        """Places one copy of ``params`` and builds the optimizer state.

        Returns:
          ``(params, opt_state)`` ready for ``step``: params replicated (over the
          data axes), or stacked per worker when ``per_worker_params``; with
          ``param_specs``, every leaf sharded over the model axes like its parameter.
        """
        self._check_one_copy(params)
        with self._step_mesh():
            (p_spec, s_spec), (p_model, s_model) = self._specs(params), self._model_specs(params)
            state = layout.place_by_specs(self.tx.init(params), s_spec, mesh=self.mesh, model_specs=s_model)
            return layout.place_by_specs(params, p_spec, mesh=self.mesh, model_specs=p_model), state

    def abstract_init(self, params: Any, *, saved: Any = None) -> tuple[Any, Any]:
        """Like :meth:`init`, as ``jax.ShapeDtypeStruct`` leaves with shardings; nothing is allocated.

        The restore target for a checkpoint of ``(params, opt_state)``, e.g.
        ``ocp.args.StandardRestore(step.abstract_init(params0))`` with
        orbax-checkpoint: per-worker leaves come back stacked and placed
        ``P(axis_name)``, the rest replicated.

        ``saved``: the checkpoint's metadata (orbax: ``mngr.item_metadata(step)``).
        Each leaf's saved shape is checked against the target first, so a
        checkpoint written by another number of workers gets an error that
        names the fix (regroup it with :func:`jaxopt_dist.reshard_opt_state`)
        before the checkpoint library sees the arrays.
        """
        self._check_one_copy(params)
        local = base.abstract(params)
        with self._step_mesh():
            (p_spec, s_spec), (p_model, s_model) = self._specs(local), self._model_specs(local)
            state = jax.eval_shape(self.tx.init, local)
        target = (
            layout.placed_abstract(local, p_spec, self.mesh, p_model),
            layout.placed_abstract(state, s_spec, self.mesh, s_model),
        )
        if saved is not None:
            n = self.num_workers
            fix = (
                "restore it without a target (host arrays), then "
                f"{layout.reshard_fix('opt_state', n)}"
                + (f" and {layout.reshard_fix('params', n)}" if self.per_worker_params else "")
                + " (see the checkpointing guide)."
            )
            layout.check_saved(saved, target, n=n, axis_name=self.axis_name, fix=fix)
        return target

    def _check_one_copy(self, params: Any) -> None:
        """Rejects parameters placed stacked per worker where one copy is expected."""
        stacked = layout.stacked_leaves(params, self.axis_name)
        if stacked:
            raise ValueError(
                f"The parameters are stacked per worker already (leaf {stacked[0]} is split over "
                f"{self.axis_name!r} along its leading axis, as step.init returns per-worker "
                "parameters): init and abstract_init take one copy and stack it themselves. Pass "
                "one copy (the parameters you started from); to continue a run, pass the stacked "
                "params to the step as they are."
            )

    def _local_params(self, params: Any) -> Any:
        if self.per_worker_params:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)), params)
        return params

    def _body(self, mask: Any) -> Callable[..., Any]:
        axis_name, tx, has_aux, per_worker = self.axis_name, self.tx, self.has_aux, self.per_worker_params
        reduce_metrics = self.reduce_metrics
        loss_fn, loss_scale = self.loss_fn, self.loss_scale

        def body(params, opt_state, batch):
            p = layout.first_rows(params) if per_worker else params
            s = layout.first_rows(opt_state, mask)
            # Differentiate with respect to a per-worker copy: for replicated
            # params, shard_map's autodiff would otherwise sum the gradients over
            # the axis on its own, before the optimizer could see them.
            p_var = comm.to_varying(p, axis_name)
            scale = None if loss_scale is None else jnp.asarray(loss_scale(s), jnp.float32)
            scaled_loss = _scaled_loss(loss_fn, scale, has_aux)

            def value_fn(q):
                out = scaled_loss(q, batch)
                return out[0] if has_aux else out

            if has_aux:
                grad_fn = jax.value_and_grad(scaled_loss, has_aux=True, allow_int=True)
                (loss, aux), grads = grad_fn(p_var, batch)
            else:
                loss, grads = jax.value_and_grad(scaled_loss, allow_int=True)(p_var, batch)
                aux = None
            updates, s2 = tx.update(grads, s, p, value=loss, value_fn=value_fn)
            new_p = apply_updates(p, updates)
            metrics = {"loss": loss if scale is None else loss / scale}
            if has_aux:
                metrics["aux"] = aux
            # One pmean each, as before the option existed (the compiled step is unchanged).
            if reduce_metrics:
                metrics = {k: comm.pmean(v, axis_name) for k, v in metrics.items()}
            else:
                metrics = layout.add_rows(metrics)
            return (layout.add_rows(new_p) if per_worker else new_p), layout.add_rows(s2, mask), metrics

        return body

    def _build(self, params: Any, batch: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        local = self._local_params(params)
        (p_spec, s_spec), (p_model, s_model) = self._specs(local), self._model_specs(local)
        b_spec = jax.tree.map(lambda _: layout.data_spec(self.axis_name), batch)
        # Only the data axes are manual; model axes (if any) are left to the compiler.
        manual = {"axis_names": set(base.axis_names(self.axis_name))} if p_model is not None else {}
        fn = jax.shard_map(
            self._body(self.placement(local).per_worker),
            mesh=self.mesh,
            in_specs=(p_spec, s_spec, b_spec),
            out_specs=(p_spec, s_spec, self._metrics_spec()),
            check_vma=True,
            **manual,
        )
        batch_spec = layout.axes_spec((*base.axis_names(self.axis_name), *self.batch_axes))
        shardings = (
            model_axes.shardings(self.mesh, p_spec, p_model),
            model_axes.shardings(self.mesh, s_spec, s_model),
            jax.tree.map(lambda _: jax.sharding.NamedSharding(self.mesh, batch_spec), batch),
        )
        # With model axes, the outputs keep the inputs' shardings (the compiler could pick others).
        out = (*shardings[:2], jax.sharding.NamedSharding(self.mesh, self._metrics_spec()))
        kw: dict[str, Any] = {"out_shardings": out} if p_model is not None else {}
        return jax.jit(fn, donate_argnums=(0, 1) if self.donate else (), **kw), shardings

    def _metrics_spec(self) -> P:
        return P() if self.reduce_metrics else layout.data_spec(self.axis_name)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        fn, shardings = self._compiled(params, opt_state, batch)
        out = self._runner.dispatch(fn, (params, opt_state, batch), shardings, batch=2)
        self._runner.throttle(out[2]["loss"])
        return out

    def lower(self, params: Any, opt_state: Any, batch: Any) -> jax.stages.Lowered:
        """The program ``step(params, opt_state, batch)`` runs, lowered and not run.

        ``step.lower(params, opt_state, batch).compile().as_text()`` is the
        compiled HLO, e.g. for :func:`jaxopt_dist.hlo_collectives` to list
        what the step sends.
        """
        fn, shardings = self._compiled(params, opt_state, batch)
        return self._runner.lower(fn, (params, opt_state, batch), shardings)

    def call_with(
        self, params: Any, opt_state: Any, batch: Any, extra: Callable[..., Any], extra_args: tuple[Any, ...]
    ) -> tuple[tuple[Any, Any, dict[str, Any]], Any]:
        """The step and ``extra(*extra_args)`` as one program: ``(step's outputs, extra's outputs)``.

        ``extra`` is a jittable function of arrays already placed on the
        step's mesh, independent of the step (e.g. an exchange of
        :func:`overlapped_step`): in one program, the compiler may run its
        collectives beside the step's compute (asynchronous collectives on
        GPU and TPU). Compiled once per ``extra`` and shapes.
        """
        fn, shardings = self._compiled(params, opt_state, batch)
        key = ("with", extra, runner.shape_key((params, opt_state, batch, extra_args)))
        fused = self._runner.cached(key, lambda: jax.jit(lambda p, s, b, *e: (fn(p, s, b), extra(*e))))
        placed = jax.tree.map(lambda x: x.sharding, extra_args)
        args, all_shardings = (params, opt_state, batch, *extra_args), (*shardings, *placed)
        out, extra_out = self._runner.dispatch(fused, args, all_shardings, batch=2)
        self._runner.throttle(out[2]["loss"])
        return out, extra_out

    def _compiled(
        self, params: Any, opt_state: Any, batch: Any
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The jitted step for these shapes and its argument shardings (built once)."""
        # The state's shapes are in the key too: a state laid out for another number of
        # workers misses the cache and is rejected below instead of being recompiled for.
        key = ("step", runner.shape_key((params, opt_state, batch)))

        def build():
            with self._step_mesh():
                return checked_build()

        def checked_build():
            self._check_layouts(params, opt_state)
            split = layout.mesh_axis_size(self.mesh, (*base.axis_names(self.axis_name), *self.batch_axes))
            layout.check_batch(batch, split)
            return self._build(params, batch)

        return self._runner.cached(key, build)

    def _check_layouts(self, params: Any, opt_state: Any) -> None:
        """Rejects params or state laid out for another number of workers."""
        p_want, s_want = self.abstract_init(self._local_params(params))
        self._runner.check_layout(params, p_want, what="params")
        self._runner.check_layout(opt_state, s_want, what="opt_state")


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
    param_specs: Any = None,
    batch_axes: base.AxisName | None = None,
    reduce_metrics: bool = True,
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
      param_specs: for a sharded model, a pytree of ``PartitionSpec``\ s like the
        parameters (or a prefix of it) that names only the *model* axes of
        ``mesh``, e.g. ``P("fsdp", None)`` or ``P(None, "tensor")``. The data
        axes are manual inside the step and the model axes are left to the
        compiler (``jax.shard_map(..., axis_names=data axes)``): ``loss_fn``
        is ordinary sharded JAX code, and each transform sees whole leaves of
        its replica, sharded. ``init`` shards the parameters and every
        optimizer-state leaf that belongs to a parameter (its path ends with
        the parameter's path and it has its shape: residuals, anchors,
        moments, momentum) like that parameter; the flat per-leaf buffers a
        state class declares in its ``FLAT_BUFFERS`` attribute (the padded
        1-D error buffers of :func:`jaxopt_dist.onebit_adam` and
        :func:`jaxopt_dist.zero_one_adam`) are split along their length over
        the parameters' model axes (as many of them, in order, as divide it;
        ``P("data", ("fsdp",))`` when per-worker), and the stacks of matrices
        it declares in ``MATRIX_STACKS`` (the momentum of
        :func:`jaxopt_dist.muon` and :func:`jaxopt_dist.dion2`) on their rows,
        else their columns; the rest (counters, keys, PowerSGD's factors) is
        replicated over the model axes. None:
        parameters replicated on every device of a worker.
      batch_axes: model axes that also split the batch, e.g. ``"fsdp"`` for
        FSDP (the batch's leading axis is then split over the data axes and
        these). None: the data axes alone.
      reduce_metrics: average ``metrics`` over the workers (one small
        all-reduce every step). False: each worker's own, stacked over the
        data axes (``metrics["loss"]`` has one entry per worker), and the step
        sends nothing beyond what ``tx`` sends: DiLoCo's inner steps then
        send nothing at all, so no per-step message queues on a slow link
        behind an exchange that :func:`overlapped_step` runs beside them.

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

      A sharded model: 2 replicas, each sharded over 4 devices (FSDP).

      >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
      >>> step = jd.data_parallel_step(
      ...     loss, tx, mesh=mesh, param_specs=jax.P("fsdp"), batch_axes="fsdp"
      ... )
      >>> params, opt_state = step.init(jnp.zeros(8))
      >>> params.sharding.spec == opt_state[1][0].momentum.sharding.spec == jax.P("fsdp")
      True
      >>> batch = {"x": jnp.ones((16, 8)), "y": jnp.ones(16)}
      >>> float(step(params, opt_state, batch)[2]["loss"])
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
    max_steps_in_flight = runner.check_max_steps_in_flight(max_steps_in_flight)
    if loss_scale is not None and not callable(loss_scale):
        raise TypeError(
            f"`loss_scale` must be a function of the optimizer state (e.g. jaxopt_dist.loss_scale); got {loss_scale!r}."
        )
    layout.check_mesh(mesh, axis_name)
    batch_axes = runner.check_batch_axes(batch_axes, mesh, axis_name)
    if param_specs is not None:
        mesh = layout.auto_axes(mesh)  # model axes are the compiler's (GSPMD/Shardy propagation)
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
        param_specs=param_specs,
        batch_axes=batch_axes,
        reduce_metrics=bool(reduce_metrics),
    )
