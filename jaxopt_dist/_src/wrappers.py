"""Wrappers that make optax's value-driven transforms agree across workers."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm


def mean_value(
    inner: optax.GradientTransformation,
    *,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""Gives ``inner`` the mean over workers of the ``value`` extra arg.

    Transforms driven by the loss, such as
    :func:`optax.contrib.reduce_on_plateau`, must see the same value on every
    worker: a per-worker loss gives each worker its own learning-rate scale
    (under ``vmap`` the replicas drift apart; under
    ``jax.shard_map(check_vma=True)`` the trace fails with "cond branches must
    have equal output types"). Wrap them:
    ``optax.chain(all_reduce(), sgd(lr), mean_value(reduce_on_plateau()))``.
    :func:`jaxopt_dist.data_parallel_step` passes each worker's own loss as
    ``value``; in your own loop you may instead pass
    ``value=jax.lax.pmean(loss, "data")`` and skip this wrapper.

    Args:
      inner: the transformation that reads ``value``.
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` with ``inner``'s state.

    Communication:
      One all-reduce (mean) of one scalar per step, plus whatever ``inner``
      sends (a value that is already the same everywhere stays unchanged).
      State and outputs follow ``inner``.

    Sharded parameters:
      Nothing parameter-shaped: the value is a scalar; ``inner`` behaves as
      its own docstring says.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = jd.mean_value(optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
      >>> def step(g, loss):
      ...     return tx.update(g, tx.init(g), value=loss)[1].best_value
      >>> jax.vmap(step, axis_name="data")(jnp.ones((2, 1)), jnp.array([1.0, 3.0]))
      Array([2., 2.], dtype=float32)
    """
    axis_name = base.validate_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        if value is None:
            raise ValueError(
                "`mean_value` needs the extra arg `value` (the loss): "
                "tx.update(grads, state, params, value=loss)."
            )
        value = comm.pmean(jnp.asarray(value), axis_name, caller="mean_value")
        return inner.update(updates, state, params, value=value, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
