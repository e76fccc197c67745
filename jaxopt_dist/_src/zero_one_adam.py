r"""0/1 Adam: a variance refreshed ever more rarely, then frozen; local steps between 1-bit syncs.

DeepSpeed's ``ZeroOneAdam`` (``runtime/fp16/onebit/zoadam.py``), step for step,
without bias correction. Below :math:`t` is the 1-based number of the update,
:math:`F` is ``var_freeze_step``, :math:`d = \sqrt v + \epsilon` and
:math:`\mathcal C` the two-sided 1-bit all-reduce with worker and server error
feedback of 1-bit Adam (:func:`~jaxopt_dist._src.error_feedback.onebit_allreduce`).

* **Phase A** (:math:`t \le F`). On the steps with ``(t + 1) % var_interval
  == 0`` the gradient is averaged over the workers at full precision and both
  moments take it: :math:`m \leftarrow \beta_1 m + (1 - \beta_1) \bar g`,
  :math:`v \leftarrow \beta_2 v + (1 - \beta_2) \bar g^2`. On the other steps
  every worker's local gradient goes through :math:`\mathcal C` and only
  :math:`m` takes the result. The step is :math:`p \leftarrow p - \eta (m / d
  + \lambda p)`. ``var_interval`` starts at 1 and doubles after every
  ``var_update_scaler`` variance updates.
* **Phase B** (:math:`t > F`). :math:`v` is frozen, both error buffers are
  zeroed once, and gradients are not communicated. Each worker :math:`i`:
  :math:`m_i \leftarrow \beta_1 m_i + (1 - \beta_1) g_i`, :math:`u_i = m_i / d
  + \lambda p_i`, :math:`p_i \leftarrow p_i - \eta u_i`, :math:`a_i
  \leftarrow a_i - \eta u_i`, :math:`s \leftarrow s + \eta`. On the steps with
  ``(t + 1) % local_step_interval == 0`` the workers synchronise: the local
  steps are taken back (:math:`p_i \leftarrow p_i - a_i`), the accumulated
  step is exchanged in momentum units, :math:`\bar a = \mathcal C(a_i d)`, the
  momentum re-estimated, :math:`m \leftarrow -\bar a / s`, and the common step
  applied, :math:`p_i \leftarrow p_i + \bar a / d`; then :math:`a_i = 0`,
  :math:`s = 0`. ``local_step_interval`` starts at 1 and doubles after every
  ``local_step_scaler`` phase-B steps, up to ``local_step_clipper``.

DeepSpeed's first call to ``step`` only initialises; its step counter, one
ahead of :math:`t`, shows only as the ``+ 1`` in both conditions. Where this
module differs from DeepSpeed, on purpose:

* Resuming is exact: the state holds the error buffers, the accumulator, the
  learning-rate sum and both schedules. DeepSpeed's ``load_state_dict`` drops
  the error buffers and the accumulator and restarts both schedules.
* DeepSpeed's initialising call counts as one variance update for every
  parameter but the last one it visits, whose counters it resets; with many
  parameters their ``var_interval`` then doubles at different steps. Here one
  schedule serves every leaf: the last parameter's, which is also that of a
  model with one parameter.
* With one worker, DeepSpeed leaves :math:`m` unchanged on the phase-A steps
  without a variance update (it skips the compressed all-reduce and the
  momentum update with it); here the all-reduce of one worker is the identity
  and :math:`m` takes the gradient.
* A sync whose learning-rate sum :math:`s` is zero (a schedule at 0 through a
  whole interval) keeps each worker's own momentum instead of DeepSpeed's
  :math:`-\bar a / 0`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm, error_feedback

_NAME = "zero_one_adam"


@base.reshard_rules(mu=base.REGROUP, acc=base.REGROUP)
class ZeroOneAdamState(NamedTuple):
    """State for :func:`jaxopt_dist.zero_one_adam`.

    Attributes:
      count: int32[], updates taken; replicated.
      mu: the momentum :math:`m`, like params in float32; per-worker (the same
        on every worker in phase A and right after each sync).
      nu: the second moment :math:`v` (frozen in phase B), like params in
        float32; replicated.
      acc: the accumulator :math:`a` of this worker's local steps since the
        last sync (zero in phase A), like params in float32; per-worker.
      lrs: float32[], the sum :math:`s` of the learning rates applied since
        the last sync (zero in phase A); replicated.
      var_interval: int32[], the period of the variance updates; replicated.
      var_counter: int32[], variance updates since ``var_interval`` last
        doubled; replicated.
      local_step_interval: int32[], the period of the phase-B syncs; replicated.
      local_step_counter: int32[], phase-B steps since ``local_step_interval``
        last doubled; replicated.
      worker_error: per leaf, float32[P] (the leaf's size padded to a multiple
        of ``n * lcm(n, 8)``); per-worker.
      server_error: per leaf, float32[P / n], the error of the chunk this
        worker reduces; per-worker.

    ``FLAT_BUFFERS`` (a class attribute, not a field) names the two error
    fields: one flat buffer per parameter leaf, whose shape no parameter
    has, which :func:`jaxopt_dist.data_parallel_step` splits over the model
    axes.
    """

    count: jax.Array  # int32[], replicated
    mu: optax.Updates  # like params, float32, per-worker (equal in phase A and after syncs)
    nu: optax.Updates  # like params, float32, replicated
    acc: optax.Updates  # like params, float32, per-worker
    lrs: jax.Array  # float32[], replicated
    var_interval: jax.Array  # int32[], replicated
    var_counter: jax.Array  # int32[], replicated
    local_step_interval: jax.Array  # int32[], replicated
    local_step_counter: jax.Array  # int32[], replicated
    worker_error: tuple[jax.Array, ...]  # float32[P_l] per leaf, per-worker
    server_error: tuple[jax.Array, ...]  # float32[P_l / n] per leaf, per-worker

    FLAT_BUFFERS = ("worker_error", "server_error")


class _Moments(NamedTuple):
    """What a step reads and writes (one branch of the switch): every leaf in one flat float32
    buffer per quantity (see :meth:`~jaxopt_dist._src.base.LeafGroups.concat`)."""

    updates: jax.Array
    mu: jax.Array
    nu: jax.Array
    acc: jax.Array
    lrs: jax.Array
    worker_error: jax.Array
    server_error: jax.Array


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    var_freeze_step: int,
    num_workers: int | None = None,
    b1: optax.ScalarOrSchedule = 0.9,
    b2: optax.ScalarOrSchedule = 0.999,
    eps: optax.ScalarOrSchedule = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""0/1 Adam (DeepSpeed): a thinning variance schedule, then 1-bit syncs after local steps.

    Takes each worker's *local* gradients and returns the final updates (use
    it alone, not after an all-reduce nor before another optimizer). The
    module docstring gives the rule step by step:

    .. math::
      u_i = -\eta \Big(\frac{m_i}{\sqrt{v} + \epsilon} + \lambda p_i\Big)

    on every step but the phase-B syncs, whose update takes the worker's
    local steps since the last sync back and applies the 1-bit average of
    them instead: :math:`u_i = \bar a / (\sqrt v + \epsilon) - a_i^{\text{old}}`.

    Per-worker parameters: between syncs each worker steps with its own
    momentum and gradient, so the parameters differ between workers; run it
    with ``jd.data_parallel_step(..., per_worker_params=True)`` (without it
    the step raises, the updates being typed per-worker). The updates are
    bit-identical on every worker in phase A and while
    ``local_step_interval`` is 1; a later sync brings the workers'
    parameters together again up to float32 rounding (each takes its own
    float32 sum of its local steps back), as in DeepSpeed.

    Args:
      learning_rate: :math:`\eta`, a float or an optax schedule (evaluated at
        the update count; the phase-B sum :math:`s` adds the values applied).
      var_freeze_step: :math:`F`, the number of phase-A updates (Python int
        >= 1; the last variance update happens at or before update ``F``).
      num_workers: the number of workers on ``axis_name`` (Python int >= 1),
        needed by ``init``: the error buffers are padded to a multiple of
        ``n * lcm(n, 8)`` entries, as DeepSpeed's. ``update`` checks it
        against the axis size.
      b1: :math:`\beta_1` in [0, 1); float or schedule.
      b2: :math:`\beta_2` in [0, 1); float or schedule.
      eps: :math:`\epsilon > 0`, added to :math:`\sqrt v`; float or schedule.
        Take it larger than Adam's usual ``1e-8`` (``1e-4`` in the
        benchmarks): a coordinate whose gradient is always zero (blank input
        pixels, dead ReLUs, unused embedding rows) keeps :math:`v = 0`,
        while the 1-bit sync gives it a nonzero momentum, so its step is of
        the order of scale / ``eps``: with ``1e-8`` it diverges.
      weight_decay: :math:`\lambda \ge 0` (L2 added to the Adam direction, as
        DeepSpeed); float or schedule. Needs ``params`` when not zero.
      var_update_scaler: variance updates between doublings of
        ``var_interval`` (Python int >= 1; the paper's :math:`\kappa`).
      local_step_scaler: phase-B steps between doublings of
        ``local_step_interval`` (Python int >= 1).
      local_step_clipper: the largest ``local_step_interval`` (Python int >=
        1; the paper's :math:`H`).
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ZeroOneAdamState`.

    Communication:
      A ``lax.switch`` on the replicated counters picks one of three steps
      (a variance step, a 1-bit exchange, a phase-B local step); the phase-A
      steps without a variance update and the phase-B syncs share the one
      1-bit exchange, their inputs and outputs chosen by the phase.
      Variance steps: one all-reduce (mean) of all the gradients in one
      float32 buffer, ``4 d`` bytes (``d`` entries in all). Phase-A steps
      without a variance update and phase-B syncs (``n > 1``), with ``P_l``
      the padded size of leaf ``l``: 1-bit Adam's exchange, one all-to-all of
      a uint8 buffer of ``n * sum_l (P_l / (8 n) + 4)`` bytes (a worker sends
      the ``n - 1`` rows that are not its own) and one all-gather of
      ``sum_l (P_l / (8 n) + 4)`` bytes: about ``2 (n - 1) / n * P / 8``
      bytes sent per worker (``P = sum_l P_l``), against ``2 (n - 1) / n * 4
      d`` for a dense float32 ring all-reduce. Phase-B local steps: nothing.
      With one worker nothing is sent. In the steady state of phase B one
      step in ``local_step_clipper`` syncs. Updates, ``mu``, ``acc`` and
      both errors are per-worker; ``count``, ``nu``, ``lrs`` and the four
      schedule counters are replicated.

    Sharded parameters:
      Needs whole leaves on the 1-bit steps: each leaf is flattened, padded
      and cut into one chunk per worker, with a scale from its whole norm, so
      the compiler moves entries over the model axes into that layout and
      back. The moments and the accumulator are kept sharded like the
      parameters, but a step works on every leaf packed into one flat buffer
      per quantity (one kernel per operation, a small program to compile), so
      the compiler moves their entries over the model axes into those buffers
      and back; the flat error buffers (the state's
      ``FLAT_BUFFERS``) are split along their length over the model axes. The
      exchanges run over the data axis, per replica.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxopt_dist as jd
      >>> tx = jd.zero_one_adam(0.1, var_freeze_step=1, num_workers=2)
      >>> g = jnp.array([[1.0, -2.0], [3.0, -2.0]])  # two workers' gradients
      >>> def three_steps(p, g):
      ...     s = tx.init(p)
      ...     out = []
      ...     for _ in range(3):  # a variance step, then two phase-B syncs
      ...         u, s = tx.update(g, s, p)
      ...         p = optax.apply_updates(p, u)
      ...         out.append(u)
      ...     return out
      >>> u1, u2, u3 = jax.vmap(three_steps, axis_name="data")(jnp.zeros((2, 2)), g)
      >>> u1[0]  # Adam on the mean gradient
      Array([-0.31622773,  0.31622773], dtype=float32)
      >>> [round(float(x), 6) for x in u3[0]]  # (its last float32 bit varies across JAX versions)
      [-0.379004, 0.379004]

    References:
      Lu et al., `Maximizing Communication Efficiency for Large-scale
      Training via 0/1 Adam <https://arxiv.org/abs/2202.06009>`_, 2022
    """
    freeze = base.check_positive_int(var_freeze_step, "var_freeze_step")
    var_scaler = base.check_positive_int(var_update_scaler, "var_update_scaler")
    local_scaler = base.check_positive_int(local_step_scaler, "local_step_scaler")
    clipper = base.check_positive_int(local_step_clipper, "local_step_clipper")
    if num_workers is None:
        raise ValueError(
            "`zero_one_adam` needs `num_workers`, the size of the axis it runs over (an int >= 1): "
            "its error buffers are padded to a multiple of n * lcm(n, 8) entries when the state is built."
        )
    n_cfg = base.check_positive_int(num_workers, "num_workers")
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)
    for beta, beta_name in ((b1, "b1"), (b2, "b2")):
        base.check_hyperparameter(beta, beta_name, lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(eps, "eps", lower=0.0, lower_open=True)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    axis_name = base.validate_axis_name(axis_name)
    decays = not base.is_constant(weight_decay, 0.0)

    def init_fn(params):
        shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]
        padded = [error_feedback.onebit_padded_size(math.prod(s), n_cfg) for s in shapes]
        zeros = lambda p: jnp.zeros(jnp.shape(p), jnp.float32)  # noqa: E731
        one, zero = jnp.ones([], jnp.int32), jnp.zeros([], jnp.int32)
        return ZeroOneAdamState(
            count=zero,
            mu=jax.tree.map(zeros, params),
            nu=jax.tree.map(zeros, params),
            acc=jax.tree.map(zeros, params),
            lrs=jnp.zeros([], jnp.float32),
            var_interval=one,
            var_counter=zero,
            local_step_interval=one,
            local_step_counter=zero,
            worker_error=tuple(jnp.zeros((size,), jnp.float32) for size in padded),
            server_error=tuple(jnp.zeros((size // n_cfg,), jnp.float32) for size in padded),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n = comm.require_axis(axis_name, _NAME)
        if n != n_cfg:
            raise ValueError(
                f"`{_NAME}` was built with num_workers={n_cfg} but runs on {n} workers: its 1-bit error "
                f"buffers are padded for {n_cfg} workers (a state for one number of workers cannot be "
                "regrouped for another)."
            )
        if decays and params is None:
            raise ValueError(base.no_params_message(_NAME, "with weight_decay"))
        grads, treedef = jax.tree.flatten(updates)
        count = state.count
        f32 = lambda h: jnp.asarray(h, jnp.float32)  # noqa: E731
        lr = f32(base.resolve(learning_rate, count))
        beta1, beta2 = base.resolve(b1, count), base.resolve(b2, count)
        # 1 - beta in the hyperparameter's own precision (Python double for floats), as DeepSpeed.
        k1, k2, one_minus_k1, one_minus_k2 = (f32(h) for h in (beta1, beta2, 1 - beta1, 1 - beta2))
        epsilon = f32(base.resolve(eps, count))
        decay = f32(base.resolve(weight_decay, count))
        # Every leaf in one flat float32 buffer per quantity: the switch carries seven buffers, not
        # seven per leaf.
        layout = error_feedback.OnebitLayout(grads, n)
        flat = layout.flat
        p32 = flat(treedef.flatten_up_to(params)) if decays else None

        def momentum(mu, g):
            return k1 * mu + one_minus_k1 * g

        def denominator(nu):
            return jnp.sqrt(nu) + epsilon

        def adam_step(mu, nu):
            direction = mu / denominator(nu)
            if p32 is not None:
                direction = direction + decay * p32
            return -lr * direction

        def variance(s: _Moments, g):
            mean = comm.reduce(
                g, axis_name, reduction="mean", flatten=True, invariant_updates="mean", caller=_NAME
            )
            mu = momentum(s.mu, mean)
            nu = k2 * s.nu + one_minus_k2 * mean * mean
            return s._replace(updates=adam_step(mu, nu), mu=mu, nu=nu)

        def local(s: _Moments, g):
            mu = momentum(s.mu, g)
            step = adam_step(mu, s.nu)
            return s._replace(updates=step, mu=mu, acc=s.acc + step, lrs=s.lrs + lr)

        def onebit(s: _Moments, g):
            """A phase-A step without a variance update or a phase-B sync: one 1-bit all-reduce serves both."""
            syncs = count >= freeze  # phase B; replicated, so every worker takes the same side
            stepped = local(s, g)
            d = denominator(s.nu)
            sent = jnp.where(syncs, stepped.acc * d, g)
            first = count == freeze  # the first phase-B step (always a sync): fresh error buffers
            we = jnp.where(first, jnp.zeros_like(s.worker_error), s.worker_error)
            se = jnp.where(first, jnp.zeros_like(s.server_error), s.server_error)
            mean, we, se = layout.allreduce(sent, we, se, axis_name, _NAME) if n > 1 else (sent, we, se)
            # Phase A: the momentum takes the 1-bit mean gradient.
            mu_a = momentum(s.mu, mean)
            step_a = adam_step(mu_a, s.nu)
            # Phase B: the momentum re-estimated from the mean of the accumulated steps; p - a_old
            # (the parameters at the last sync, to rounding) + mean / d, as one update.
            total = stepped.lrs
            mu_b = jnp.where(total > 0, -(mean / total), stepped.mu)
            step_b = mean / d - s.acc
            acc = jnp.where(syncs, jnp.zeros_like(s.acc), s.acc)
            lrs = jnp.where(syncs, jnp.zeros_like(s.lrs), s.lrs)
            pick = lambda b, a: jnp.where(syncs, b, a)  # noqa: E731
            return _Moments(pick(step_b, step_a), pick(mu_b, mu_a), s.nu, acc, lrs, we, se)

        def typed(step):
            def branch(s: _Moments, g):
                s = step(s, g)
                vary = lambda x: comm.to_varying(x, axis_name)  # noqa: E731
                return s._replace(
                    updates=vary(s.updates),
                    mu=vary(s.mu),
                    acc=vary(s.acc),
                    worker_error=vary(s.worker_error),
                    server_error=vary(s.server_error),
                )

            return branch

        t = count + 1  # the 1-based update number; DeepSpeed's step counter is t + 1
        phase_b = t > freeze
        variance_step = (t + 1) % state.var_interval == 0
        sync_step = (t + 1) % state.local_step_interval == 0
        # 0: variance step; 1: a 1-bit exchange (phase A without a variance update, or a phase-B
        # sync); 2: a phase-B local step.
        index = jnp.where(phase_b, jnp.where(sync_step, 1, 2), jnp.where(variance_step, 0, 1))
        schedules = _schedules(state, phase_b, variance_step, var_scaler, local_scaler, clipper)
        if not grads:  # nothing to optimise
            return updates, state._replace(count=jnp.asarray(optax.safe_increment(count)), **schedules)
        before = _Moments(
            updates=jnp.zeros((sum(layout.sizes),), jnp.float32),
            mu=flat(treedef.flatten_up_to(state.mu)),
            nu=flat(treedef.flatten_up_to(state.nu)),
            acc=flat(treedef.flatten_up_to(state.acc)),
            lrs=state.lrs,
            worker_error=flat(state.worker_error),
            server_error=flat(state.server_error),
        )
        after = jax.lax.switch(index, [typed(variance), typed(onebit), typed(local)], before, flat(grads))
        leaves = lambda x: jax.tree.unflatten(treedef, layout.leaves(x))  # noqa: E731
        worker_error, server_error = layout.errors(after.worker_error, after.server_error)
        return jax.tree.map(lambda u, x: u.astype(x.dtype), leaves(after.updates), updates), ZeroOneAdamState(
            count=jnp.asarray(optax.safe_increment(count)),
            mu=leaves(after.mu),
            nu=leaves(after.nu),
            acc=leaves(after.acc),
            lrs=after.lrs,
            worker_error=worker_error,
            server_error=server_error,
            **schedules,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _schedules(
    state: ZeroOneAdamState,
    phase_b: jax.Array,
    variance_step: jax.Array,
    var_scaler: int,
    local_scaler: int,
    clipper: int,
) -> dict[str, Any]:
    """The four schedule counters after a step (DeepSpeed's bookkeeping at the end of ``step``)."""
    var_counter = state.var_counter + jnp.logical_and(~phase_b, variance_step).astype(jnp.int32)
    var_double = var_counter == var_scaler
    local_counter = state.local_step_counter + phase_b.astype(jnp.int32)
    local_double = local_counter == local_scaler
    interval = state.local_step_interval
    return dict(
        var_interval=jnp.where(var_double, 2 * state.var_interval, state.var_interval),
        var_counter=jnp.where(var_double, jnp.zeros_like(var_counter), var_counter),
        local_step_interval=jnp.where(local_double, jnp.minimum(2 * interval, clipper), interval),
        local_step_counter=jnp.where(local_double, jnp.zeros_like(local_counter), local_counter),
    )
