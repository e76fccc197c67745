"""Flax linen ``TrainState`` steps with BatchNorm statistics and dropout keys under data parallelism.

:func:`data_parallel` replaces ``@jax.jit`` on a linen training step
``train_step(state, batch) -> (state, metrics)`` written for one device, with
:class:`TrainState` (``flax.training.train_state.TrainState`` plus
``batch_stats``) as its state. The step runs under ``jax.shard_map`` with the
batch split along the data axis:

* ``state.params``: replicated; gradients are per worker, ``tx`` aggregates
  them, and :meth:`TrainState.apply_gradients` keeps the parameters replicated.
* ``state.opt_state``: placed as :func:`jaxopt_dist.data_parallel_step` places
  it (error-feedback residuals stacked along a leading worker axis).
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

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.training import layout, placement, replicas, runner

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


@dataclasses.dataclass
class DataParallelTrainState(runner.RunsSteps):
    """A linen training step over a mesh; see :func:`data_parallel`."""

    fn: Callable[..., Any]
    mesh: jax.sharding.Mesh
    axis_name: base.AxisName
    batch_stats: str
    max_steps_in_flight: int | None = None
    # Per-worker leaves this step returned (stacked): id -> array.
    _returned: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False)
    _runner: runner.StepRunner = dataclasses.field(init=False, repr=False)

    def _placement(self, state: TrainState) -> Any:
        """A TrainState of bools: True for per-worker (stacked) leaves."""
        found = placement.replicated_params_placement(
            state.tx, base.abstract(state.params), mesh=self.mesh, axis_name=self.axis_name
        )
        per_worker_stats = self.batch_stats == "per_worker"
        return state.replace(
            step=False,
            params=jax.tree.map(lambda _: False, state.params),
            opt_state=found.per_worker,
            batch_stats=jax.tree.map(lambda _: per_worker_stats, state.batch_stats),
            key=jax.tree.map(lambda _: False, state.key),
        )

    def _body(self, mask: Any):
        axis_name, fn = self.axis_name, self.fn

        def body(state, batch):
            trace = replicas.ReplicaCopies()
            state = layout.first_rows(state, mask)
            params = jax.tree.map(lambda x: trace.copy(x, comm.to_varying(x, axis_name)), state.params)
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
            for path, x in jax.tree_util.tree_flatten_with_path(new_state.params)[0]:
                if comm.is_varying(x, axis_name):
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

    def _build(self, state: TrainState, batch: Any) -> Any:
        mask = self._placement(state)
        s_spec = layout.mask_specs(mask, self.axis_name)
        b_spec = jax.tree.map(lambda _: layout.data_spec(self.axis_name), batch)
        fn = jax.shard_map(
            self._body(mask),
            mesh=self.mesh,
            in_specs=(s_spec, b_spec),
            out_specs=(s_spec, P()),
            check_vma=True,
        )
        shard = lambda s: jax.sharding.NamedSharding(self.mesh, s)  # noqa: E731
        return jax.jit(fn), (jax.tree.map(shard, s_spec), jax.tree.map(shard, b_spec)), mask

    def _checked_build(self, state: TrainState, batch: Any) -> Any:
        """The jitted step, its shardings, the per-worker mask and one worker's optimizer state
        (abstract), built once per layout."""
        self._runner.check_batch(batch)
        local = jax.eval_shape(state.tx.init, base.abstract(state.params))
        return (*self._build(state, batch), local)

    def _stack(self, state: TrainState, mask: Any, local: Any) -> TrainState:
        """Stacks the per-worker leaves of a state that holds one copy of them."""
        n = self.num_workers
        sharded = jax.sharding.NamedSharding(self.mesh, layout.data_spec(self.axis_name))
        opt = jax.tree.map(
            lambda x, m, loc: self._runner.stacked_leaf(x, loc.shape, what="opt_state") if m else x,
            state.opt_state,
            mask.opt_state,
            local,
        )
        stats = jax.tree.map(
            lambda x, m: layout.stacked(x, n, sharded) if m and self._returned.get(id(x)) is not x else x,
            state.batch_stats,
            mask.batch_stats,
        )
        return state.replace(opt_state=opt, batch_stats=stats)

    def __call__(self, state: TrainState, *batch: Any) -> Any:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"The first argument must be a jaxopt_dist.linen.TrainState; got {type(state).__name__}."
            )
        jitted, shardings, mask, local = self._runner.cached(
            runner.shape_key((state, batch)), lambda: self._checked_build(state, batch)
        )
        out = self._runner.dispatch(jitted, (self._stack(state, mask, local), batch), shardings, batch=1)
        self._returned = {id(x): x for x in jax.tree.leaves(out[0].batch_stats)}
        self._runner.throttle(out)
        return out if out[1] is not None else out[0]


def data_parallel(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    batch_stats: Literal["sync", "per_worker"] = "sync",
    max_steps_in_flight: int | None = None,
) -> Any:
    r"""Runs a linen ``TrainState`` step written for one device as a data-parallel step.

    Use it in place of ``@jax.jit`` on ``train_step(state, batch) -> (state,
    metrics)``, with :class:`TrainState` as the state and ``tx`` aggregating
    over ``axis_name``. The first call places the state on the mesh.

    Args:
      fn: the step. Without it, returns a decorator.
      mesh: a mesh with the axis ``axis_name``.
      axis_name: the data axis (or tuple of axes).
      batch_stats: ``"sync"``: running statistics replicated (averaged over the
        workers when the BatchNorm layers do not already do it through their
        ``axis_name``). ``"per_worker"``: one set per worker, stacked along a
        leading worker axis; average them (``jnp.mean(x, 0)``) for evaluation.
      max_steps_in_flight: bound on queued steps; None: 4 on CPU meshes
        (XLA:CPU collectives can deadlock), unbounded on accelerators.

    Returns:
      A :class:`DataParallelTrainState` (or a decorator making one).

    Communication:
      Whatever ``tx`` communicates, plus one ``pmean`` of the new running
      statistics (``"sync"`` without BatchNorm ``axis_name``), the BatchNorm
      layers' own ``pmean`` (with ``axis_name``), and one ``pmean`` per float
      metric. Parameters, replicated optimizer state, keys and metrics come out
      replicated; residuals and ``"per_worker"`` statistics are per-worker.

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
    """
    return runner.front_end(
        fn,
        DataParallelTrainState,
        mesh=mesh,
        axis_name=axis_name,
        batch_stats=batch_stats,
        max_steps_in_flight=max_steps_in_flight,
    )
