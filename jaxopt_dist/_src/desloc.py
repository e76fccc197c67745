r"""DES-LOC: local Adam whose parameters and two moments synchronise on periods of their own.

Every worker runs Adam on its own gradients and its own copy of the
parameters. Three all-reduces keep the copies together, each on its own
period: the parameters every :math:`K_x` steps, the first moment every
:math:`K_u` steps and the second moment every :math:`K_v` steps. The moments
change slowly (their half-lives grow with :math:`\beta`), so the paper
averages them less often than the parameters, e.g. :math:`K_u = 3 K_x`,
:math:`K_v = 6 K_x`. With :math:`K_x = K_u = K_v = K` it is Local Adam; with
all three equal to 1 every worker holds the same state after each average.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm


@base.reshard_rules(mu=base.REGROUP, nu=base.REGROUP)
class DesLocAdamState(NamedTuple):
    """State for :func:`jaxopt_dist.desloc_adam`.

    Attributes:
      count: int32[], the step :math:`t` of the next update (updates taken);
        replicated.
      mu: the first moment :math:`u_{t-1}`, like params in at least float32;
        per-worker (the same on every worker only right after its average).
      nu: the second moment :math:`v_{t-1}`, like params in at least float32;
        per-worker.
    """

    count: jax.Array  # int32[], replicated
    mu: optax.Updates  # like params, >= float32, per-worker
    nu: optax.Updates  # like params, >= float32, per-worker


def _moment(p: Any) -> jax.Array:
    return jnp.zeros(jnp.shape(p), base.accumulation_dtype(jnp.result_type(p)))


def _average_if(tree: list[jax.Array], sync: jax.Array, axis_name: base.AxisName) -> list[jax.Array]:
    """``pmean(tree)`` when ``sync`` (one all-reduce, in a ``cond``), else ``tree`` itself."""

    def average(xs):
        return comm.pmean(xs, axis_name, caller="desloc_adam")

    def keep(xs):
        return xs

    return comm.cond(sync, average, keep, list(tree))


def _param_shift(p_leaves: list[jax.Array], sync: jax.Array, axis_name: base.AxisName) -> list[jax.Array]:
    """``mean(x) - x`` in float32 or wider when ``sync`` (one all-reduce), else zeros."""

    def shift(ps):
        mean = comm.pmean(ps, axis_name, caller="desloc_adam")
        return [m.astype(_moment(p).dtype) - p.astype(_moment(p).dtype) for m, p in zip(mean, ps)]

    def stay(ps):
        return [_moment(p) for p in ps]

    return comm.cond(sync, shift, stay, list(p_leaves))


def desloc_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    sync_every: int,
    momentum_sync_every: int,
    variance_sync_every: int,
    b1: optax.ScalarOrSchedule = 0.9,
    b2: optax.ScalarOrSchedule = 0.999,
    eps: optax.ScalarOrSchedule = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    bias_correction: bool = False,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""DES-LOC Adam: local Adam; parameters, first and second moments averaged on periods of their own.

    Takes each worker's *local* gradients (clip them first if you want the
    paper's clipping: ``optax.chain(optax.clip_by_global_norm(1.0),
    desloc_adam(...))``, the per-worker norm) and returns the final updates.
    Parameters are per-worker: run it with
    ``jaxopt_dist.data_parallel_step(..., per_worker_params=True)``. Per
    worker, at step :math:`t = 0, 1, \dots` (the state's ``count``), with
    :math:`K_x` = ``sync_every``, :math:`K_u` = ``momentum_sync_every``,
    :math:`K_v` = ``variance_sync_every``, :math:`\bar{\cdot}` the mean over
    workers and :math:`u_{-1} = v_{-1} = 0`:

    .. math::
      u_t &= \beta_1 \,[t \bmod K_u = 0 \;?\; \overline{u_{t-1}} : u_{t-1}] + (1 - \beta_1)\, g_t \\
      v_t &= \beta_2 \,[t \bmod K_v = 0 \;?\; \overline{v_{t-1}} : v_{t-1}] + (1 - \beta_2)\, g_t^2 \\
      \hat x_t &= [t \bmod K_x = 0 \;?\; \overline{x_t} : x_t] \\
      x_{t+1} &= \hat x_t - \eta_t \Big(\frac{u_t}{\sqrt{v_t + \epsilon^2}} + \lambda \hat x_t\Big)

    Each state is averaged first (its pre-update value), then the local
    update lands on top, as in the paper's algorithm box. Every period
    divides step 0, so step 0 averages all three (the initial parameters,
    and zero moments). The parameter average is part of the update: the
    update returned is :math:`x_{t+1} - x_t` (``optax.apply_updates``
    lands within a rounding of :math:`x_{t+1}`; exactly on steps without a
    parameter average, where it is the Adam step alone).

    Bias correction. The paper's box calls the moments bias-corrected but
    shows no factors, and its proofs leave them out; by default none is
    applied (the formula above). ``bias_correction=True`` divides
    :math:`u_t` by :math:`1 - \beta_1^{t+1}` and :math:`v_t` by
    :math:`1 - \beta_2^{t+1}` (Adam's factors, the same on every worker)
    before the step. :math:`\epsilon` sits inside the square root, as in the
    box. Weight decay :math:`\lambda` is decoupled (AdamW's), applied to the
    averaged parameters.

    ``sync_every``, ``momentum_sync_every`` and ``variance_sync_every`` set
    the control flow (Python ints): under :func:`optax.inject_hyperparams`
    pass them in ``static_args``; ``learning_rate``, ``b1``, ``b2``, ``eps``
    and ``weight_decay`` may be injected or scheduled.

    Args:
      learning_rate: :math:`\eta \ge 0`, a float or an optax schedule of the
        step count.
      sync_every: :math:`K_x \ge 1`, the parameters' period (the paper: 16
        to 256).
      momentum_sync_every: :math:`K_u \ge 1`, the first moment's period
        (the paper: :math:`3 K_x`).
      variance_sync_every: :math:`K_v \ge 1`, the second moment's period
        (the paper: :math:`6 K_x`).
      b1: :math:`\beta_1` in [0, 1); float or schedule (the paper: 0.95).
      b2: :math:`\beta_2` in [0, 1); float or schedule (the paper: 0.95).
      eps: :math:`\epsilon > 0` (inside the square root as
        :math:`\epsilon^2`); float or schedule. Take it larger than Adam's
        usual ``1e-8`` (``1e-4`` in the benchmarks) when some coordinates
        see gradients on some workers only (dead ReLUs, unused embedding
        rows): a synced first moment then reaches a worker whose own second
        moment is still zero until the next variance sync, and its step is
        of the order of :math:`u / \epsilon`.
      weight_decay: :math:`\lambda \ge 0`, decoupled; float or schedule.
      bias_correction: apply Adam's bias-correction factors (see above).
        Off by default.
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`DesLocAdamState`; ``update`` needs ``params``.

    Communication:
      Up to three all-reduces (``pmean``) per step, each only on its own
      synchronising steps (a ``lax.cond`` on the step count; nothing on
      other steps): the parameters when ``t % K_x == 0`` (in their dtype),
      ``mu`` when ``t % K_u == 0`` and ``nu`` when ``t % K_v == 0`` (in
      float32 for float32 and lower-precision parameters). For float32
      parameters of ``B`` bytes a worker sends, averaged over
      ``lcm(K_x, K_u, K_v)`` steps, ``B (1/K_x + 1/K_u + 1/K_v)`` times the
      all-reduce factor (``2 (n - 1) / n`` for a ring): at the paper's
      ``K_u = 3 K_x``, ``K_v = 6 K_x`` that is ``1.5 / K_x`` of a dense
      gradient all-reduce every step (170x less at ``K_x = 256``), half of
      Local Adam's ``3 / K``. Output updates, the parameters, ``mu`` and
      ``nu`` are per-worker; ``count`` is replicated.

    Sharded parameters:
      Elementwise: the moments are sharded like the parameters, and each
      device averages its own shard of the parameters and moments with the
      same shard of the other workers (the bytes above, per worker); nothing
      crosses the model axes.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxopt_dist as jd
      >>> tx = jd.desloc_adam(0.1, sync_every=2, momentum_sync_every=2, variance_sync_every=4)
      >>> params = jnp.zeros((2, 1))                  # two workers' copies
      >>> def step(p, s, g):
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s
      >>> run = jax.vmap(step, axis_name="data")
      >>> s = jax.vmap(tx.init)(params)
      >>> g = jnp.array([[1.0], [-1.0]])
      >>> params, s = run(params, s, g)               # t = 0: average, then local Adam steps
      >>> params
      Array([[-0.3162...],
             [ 0.3162...]], dtype=float32)
      >>> params, s = run(params, s, g)               # t = 1: local steps only
      >>> params, s = run(params, s, g)               # t = 2: x and u averaged (to 0) first
      >>> params
      Array([[-0.1826...],
             [ 0.1826...]], dtype=float32)

    References:
      Iacob et al, `DES-LOC: Desynced Low Communication Adaptive Optimizers
      for Training Foundation Models <https://arxiv.org/abs/2505.22549>`_,
      2025
    """
    axis_name = base.validate_axis_name(axis_name)
    k_x = base.check_positive_int(sync_every, "sync_every")
    k_u = base.check_positive_int(momentum_sync_every, "momentum_sync_every")
    k_v = base.check_positive_int(variance_sync_every, "variance_sync_every")
    base.check_bool(bias_correction, "bias_correction")
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)
    base.check_hyperparameter(b1, "b1", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(b2, "b2", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(eps, "eps", lower=0.0, lower_open=True)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    use_wd = not base.is_constant(weight_decay, 0.0)

    def init_fn(params):
        return DesLocAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(_moment, params),
            nu=jax.tree.map(_moment, params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        comm.require_axis(axis_name, "desloc_adam")
        if params is None:
            raise ValueError(base.no_params_message("desloc_adam", "it averages the parameters"))
        t = state.count
        g_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        mu = _average_if(treedef.flatten_up_to(state.mu), t % k_u == 0, axis_name)
        nu = _average_if(treedef.flatten_up_to(state.nu), t % k_v == 0, axis_name)
        shift = _param_shift(p_leaves, t % k_x == 0, axis_name)
        hyper = [base.resolve(h, t) for h in (b1, b2, eps, learning_rate, weight_decay)]
        # 1 - beta in the hyperparameter's own precision (Python double for floats).
        b1v, b2v, epsv, lr, wd, c1v, c2v = (
            jnp.asarray(h, jnp.float32) for h in (*hyper, 1 - hyper[0], 1 - hyper[1])
        )
        mu = [(b1v * m + c1v * g.astype(m.dtype)).astype(m.dtype) for m, g in zip(mu, g_leaves)]
        nu = [(b2v * v + c2v * jnp.square(g.astype(v.dtype))).astype(v.dtype) for v, g in zip(nu, g_leaves)]
        c1 = c2 = jnp.float32(1)
        if bias_correction:
            power = (t + 1).astype(jnp.float32)
            c1, c2 = 1 - b1v**power, 1 - b2v**power
        out = []
        for m, v, d, p, g in zip(mu, nu, shift, p_leaves, g_leaves):
            step = (m / c1) / jnp.sqrt(v / c2 + epsv * epsv)
            if use_wd:
                step = step + wd * (p.astype(d.dtype) + d)
            out.append((d - lr * step).astype(g.dtype))
        new_state = DesLocAdamState(
            count=jnp.asarray(optax.safe_increment(t)),
            mu=jax.tree.unflatten(treedef, mu),
            nu=jax.tree.unflatten(treedef, nu),
        )
        return jax.tree.unflatten(treedef, out), new_state

    return comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), "desloc_adam")
