"""Iterate averaging: a weighted running average of the parameters ("estimated weights").

Sparsified SGD with memory converges for the *weighted average* of the
iterates, with weights growing as :math:`(a + t)^2` (Stich et al. 2018), which
mlbench's ``SparsifiedSGD.get_estimated_weights`` keeps alongside the model.
:func:`iterate_average` keeps that average in the optimizer state and
:func:`averaged_params` reads it out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base

_WEIGHTINGS = ("quadratic", "uniform")


@base.reshard_rules(average=base.REGROUP)
class IterateAverageState(NamedTuple):
    """State for :func:`jaxopt_dist.iterate_average`.

    Attributes:
      count: int32[], steps taken; replicated.
      weight_sum: float32[], the total weight of the iterates averaged so far;
        replicated.
      average: the weighted average of the post-update parameters, like
        params in their dtype (float32 for lower-precision floats); placed
        like the params (replicated, or per-worker for per-worker params).
    """

    count: jax.Array  # int32[], replicated
    weight_sum: jax.Array  # float32[], replicated
    average: optax.Params  # like params (>= float32), placement of the params


def _average_dtype(dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return base.accumulation_dtype(dtype)
    return dtype


def _quadratic_sum(t: jax.Array, a: Any) -> jax.Array:
    r""":math:`\sum_{s=0}^{t} (a + s)^2 = (t + 1)(6a^2 + 6at + 2t^2 + t) / 6`, in float32."""
    t = t.astype(jnp.float32)
    a = jnp.asarray(a, jnp.float32)
    return (t + 1) * (6 * a * a + 6 * a * t + 2 * t * t + t) / 6


def iterate_average(
    *,
    weighting: str = "quadratic",
    shift: optax.ScalarOrSchedule = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Keeps a weighted average of the parameters after each update.

    Let :math:`x_{t+1} = x_t + u_t` be the parameters produced by step
    :math:`t = 0, 1, \dots` (``optax.apply_updates(params, updates)`` with the
    final updates of the chain). The state holds

    .. math::
      \bar x_{T} = \frac{\sum_{t=0}^{T-1} w_t\, x_{t+1}}{\sum_{t=0}^{T-1} w_t},
      \qquad w_t = (a + t)^2 \ \text{(``"quadratic"``)} \ \text{or} \ 1 \
      \text{(``"uniform"``)},

    updated online as :math:`\bar x \leftarrow (1 - \rho_t)\bar x + \rho_t
    x_{t+1}`, :math:`\rho_t = w_t / \sum_{s \le t} w_s`: the same rule as
    mlbench's ``SparsifiedSGD.update_estimated_weights`` (its ``tau`` is
    ``shift``; Stich et al. use :math:`a = d/k`). When all weights so far are
    zero (``shift=0`` at step 0) :math:`\rho = 1`, i.e. the average is the
    latest iterate. Before the first step it is the initial parameters.

    Where it goes: **last in the chain**, after the learning rate, so that
    ``params + updates`` are the new parameters:
    ``optax.chain(top_k(k), jd.sgd(lr), iterate_average())``. It passes the
    updates through unchanged and only reads them; training continues from
    the raw iterate, and :func:`averaged_params` gives the average for
    evaluation. It averages whatever parameters ``update`` is given: the
    replicated model in data-parallel training (then the average is
    replicated), or each worker's copy with per-worker parameters.

    Args:
      weighting: ``"quadratic"`` (weights :math:`(a + t)^2`) or
        ``"uniform"`` (plain running mean; Polyak averaging).
      shift: :math:`a \ge 0`, a float or an optax schedule of the step (used
        by ``"quadratic"`` only). For a constant the weight total is computed
        in closed form; a schedule's weights are summed in float32.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`IterateAverageState`; ``update`` needs ``params``.

    Communication:
      None. The average has the placement of the parameters; ``count`` and
      ``weight_sum`` are replicated.

    Sharded parameters:
      Elementwise: the average is sharded like the parameters and each device
      updates its own shard; nothing crosses any axis.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxopt_dist._src.averaging import iterate_average, averaged_params
      >>> tx = optax.chain(optax.sgd(1.0), iterate_average(weighting="uniform"))
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> for g in (jnp.array([-1.0, 0.0]), jnp.array([-1.0, -2.0])):
      ...     updates, state = tx.update(g, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> averaged_params(state)  # mean of [1, 0] and [2, 2]
      Array([1.5, 1. ], dtype=float32)

    References:
      Stich, Cordonnier and Jaggi, `Sparsified SGD with Memory
      <https://arxiv.org/abs/1809.07599>`_, 2018; Polyak and Juditsky,
      Acceleration of stochastic approximation by averaging, 1992
    """
    if weighting not in _WEIGHTINGS:
        raise ValueError(f"`weighting` must be one of {_WEIGHTINGS}; got {weighting!r}.")
    base.check_hyperparameter(shift, "shift", lower=0.0)
    closed_form = weighting == "uniform" or not callable(shift)

    def init_fn(params):
        return IterateAverageState(
            count=jnp.zeros([], jnp.int32),
            weight_sum=jnp.zeros([], jnp.float32),
            average=jax.tree.map(lambda p: jnp.asarray(p, _average_dtype(jnp.result_type(p))), params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                base.no_params_message(
                    "iterate_average", "it averages params + updates, so put it last in the chain"
                )
            )
        t = state.count
        if weighting == "uniform":
            w = jnp.float32(1)
            total = t.astype(jnp.float32) + 1
        else:
            a = jnp.asarray(base.resolve(shift, t), jnp.float32)
            w = jnp.square(a + t.astype(jnp.float32))
            total = _quadratic_sum(t, a) if closed_form else state.weight_sum + w
        rho = jnp.where(total > 0, w / jnp.where(total > 0, total, 1), jnp.float32(1))
        new_params = optax.apply_updates(params, updates)

        def mix(avg, x):
            r = rho.astype(avg.dtype)
            return ((1 - r) * avg + r * x.astype(avg.dtype)).astype(avg.dtype)

        average = jax.tree.map(mix, state.average, new_params)
        return updates, IterateAverageState(
            count=jnp.asarray(optax.safe_increment(t)), weight_sum=total.astype(jnp.float32), average=average
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def averaged_params(state: Any) -> optax.Params:
    """The averaged parameters held by :func:`iterate_average`'s state.

    Args:
      state: an :class:`IterateAverageState`, or any optimizer state (e.g. of a
        chain) containing exactly one.

    Returns:
      The weighted average of the post-update parameters (the initial
      parameters before the first step), in at least float32.

    Raises:
      ValueError: ``state`` holds no :class:`IterateAverageState`, or several.
    """
    found = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, IterateAverageState))
        if isinstance(s, IterateAverageState)
    ]
    if len(found) != 1:
        raise ValueError(
            "`averaged_params` needs an optimizer state holding exactly one IterateAverageState "
            f"(from jaxopt_dist.iterate_average); found {len(found)}."
        )
    return found[0].average
