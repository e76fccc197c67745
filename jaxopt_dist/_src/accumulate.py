"""Gradient accumulation that communicates once per ``every_k`` micro-steps."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm


@base.reshard_rules()
class AccumulateState(NamedTuple):
    """State for :func:`jaxopt_dist.accumulate`.

    Attributes:
      count: int32[], micro-steps taken; replicated.
      acc: the sum of this worker's updates since the last communication, like
        params; per-worker (replicated if the updates are).
      inner_state: the wrapped transformation's state, updated once per
        ``every_k`` micro-steps.
    """

    count: jax.Array  # int32[], replicated
    acc: optax.Updates  # like params, per-worker
    inner_state: optax.OptState  # the wrapped transformation's state


def accumulate(
    tx: optax.GradientTransformation,
    every_k: int,
    *,
    use_grad_mean: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Accumulates ``every_k`` micro-batch updates locally, then runs ``tx`` once.

    Each worker adds its incoming updates (gradients) to a local sum. On every
    ``every_k``-th call (``count % every_k == every_k - 1``) the sum, divided by
    ``every_k`` with ``use_grad_mean``, goes through ``tx``, which communicates
    and steps; the sum is then reset. On the other calls the updates are zeros
    and nothing is sent:

    .. math::
      a_i \leftarrow a_i + g_i^{(t)}, \qquad
      u^{(t)} = \begin{cases} \mathrm{tx}(a_i / k), \; a_i \leftarrow 0
      & t \equiv k - 1 \pmod k \\ 0 & \text{otherwise.} \end{cases}

    With ``tx = chain(all_reduce(), sgd(lr))`` and a loss averaged over the
    batch this is exactly SGD on a ``k`` times larger batch. A compressor in
    ``tx`` compresses the accumulated gradient once per communication, so its
    error-feedback residual is applied once per ``k`` micro-steps.
    :class:`optax.MultiSteps` around a compressor differs: it runs the
    wrapped transformation, and so its collectives, on every micro-step and
    masks the result.

    Args:
      tx: the transformation to run on the accumulated updates (typically an
        aggregator or compressor chained with an optimizer).
      every_k: micro-steps per communication (Python int >= 1).
      use_grad_mean: pass the mean of the ``every_k`` micro-batch updates
        (True, as :class:`optax.MultiSteps`) or their sum (False).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`AccumulateState`. Extra args reach ``tx`` on communicating
      steps only.

    Communication:
      Whatever ``tx`` sends, once per ``every_k`` calls: its update runs
      inside a ``lax.cond`` on the replicated ``count``, so every worker takes
      the same branch and the other ``every_k - 1`` calls send nothing. Outputs
      follow ``tx`` on communicating steps (replicated for the aggregators)
      and are zeros otherwise; ``acc`` is per-worker; ``count`` replicated.

    Sharded parameters:
      Elementwise: ``acc`` is sharded like the parameters and each device
      sums its own shard; ``tx`` behaves as its own docstring says.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = jd.accumulate(optax.chain(jd.all_reduce(), jd.sgd(1.0)), every_k=2)
      >>> def two_steps(g1, g2):
      ...     s = tx.init(g1)
      ...     u1, s = tx.update(g1, s)
      ...     u2, s = tx.update(g2, s)
      ...     return u1, u2
      >>> g1 = jnp.array([[1.0], [3.0]]); g2 = jnp.array([[5.0], [7.0]])  # 2 workers
      >>> u1, u2 = jax.vmap(two_steps, axis_name="data")(g1, g2)
      >>> u1[0], u2[0]
      (Array([0.], dtype=float32), Array([-4.], dtype=float32))
    """
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise TypeError(f"`tx` must be an optax transformation; got {type(tx).__name__}.")
    every_k = base.check_positive_int(every_k, "every_k")
    base.check_bool(use_grad_mean, "use_grad_mean")
    inner = optax.with_extra_args_support(tx)

    def init_fn(params):
        return AccumulateState(
            count=jnp.zeros([], jnp.int32),
            acc=jax.tree.map(jnp.zeros_like, params),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        acc = jax.tree.map(lambda a, g: (a + g.astype(a.dtype)).astype(a.dtype), state.acc, updates)

        def communicate(acc, inner_state, params):
            total = acc
            if use_grad_mean:
                total = jax.tree.map(lambda a: a / jnp.asarray(every_k, a.dtype), acc)
            total = optax.tree.cast_like(total, updates)
            out, new_inner = inner.update(total, inner_state, params, **extra_args)
            return out, jax.tree.map(jnp.zeros_like, acc), optax.tree.cast_like(new_inner, inner_state)

        def hold(acc, inner_state, params):
            out_shape = jax.eval_shape(communicate, acc, inner_state, params)[0]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
            return zeros, acc, inner_state

        last = state.count % every_k == every_k - 1
        out, acc, inner_state = comm.cond(last, communicate, hold, acc, state.inner_state, params)
        new_state = AccumulateState(
            count=jnp.asarray(optax.safe_increment(state.count)), acc=acc, inner_state=inner_state
        )
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
