"""Local optimizers with schedulable hyperparameters.

The optimizers here are purely local: they never communicate. Chain them after
an aggregation transform (``optax.chain(all_reduce(), sgd(0.1))``) for
synchronous data parallelism, or before ``average_params`` for model averaging.

Every continuous hyperparameter is a float or an optax schedule evaluated at
the step count kept in the state (SINGA's ``DecayScheduler``). Where optax's
maths is the same, its pieces are reused (``add_decayed_weights``,
``scale_by_sign``, ``scale_by_learning_rate``); the rest is written here:
PyTorch-style momentum with dampening, SINGA's RMSProp and AdaGrad (``eps``
inside the square root), and PyTorch-style Adam/AMSGrad, all with schedules.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm


def _cast_tree_like(tree: Any, like: Any) -> Any:
    return jax.tree.map(lambda a, b: a.astype(b.dtype), tree, like)


# ----------------------------------------------------------------------------
# Momentum (PyTorch semantics).


@base.reshard_rules(momentum=base.REGROUP)
class ScaleByMomentumState(NamedTuple):
    """State for :func:`jaxopt_dist.scale_by_momentum`.

    Attributes:
      count: int32[], steps taken; replicated.
      momentum: the momentum buffer, like params, in the updates' dtype;
        placement follows the incoming updates (replicated after an all-reduce).
    """

    count: jax.Array  # int32[], replicated
    momentum: optax.Updates  # like params, same placement as the updates


def scale_by_momentum(
    momentum: optax.ScalarOrSchedule = 0.9,
    *,
    dampening: optax.ScalarOrSchedule = 0.0,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Heavy-ball momentum with dampening, as in ``torch.optim.SGD``.

    .. math::
      b_1 = g_1, \qquad b_t = \mu_t b_{t-1} + (1 - \tau_t) g_t, \qquad
      u_t = g_t + \mu_t b_t \ \text{(nesterov)} \ \text{or} \ b_t.

    The first buffer is the gradient itself (no dampening), as PyTorch does.
    With ``dampening=0`` this is :func:`optax.trace`; unlike it, ``momentum``
    and ``dampening`` may be schedules.

    Args:
      momentum: momentum factor :math:`\mu \in [0, 1)`, float or schedule
        (a constant >= 1 is rejected; a schedule's values are not checked).
      dampening: dampening :math:`\tau \in [0, 1]`, float or schedule.
      nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`.

    Communication:
      None. The buffer has the placement of the incoming updates.

    Sharded parameters:
      Elementwise: on parameters sharded over model axes the state is sharded
      like them and each device updates its own shard; nothing crosses the
      model axes.
    """
    _check_momentum(momentum)
    base.check_hyperparameter(dampening, "dampening", lower=0.0, upper=1.0)
    _check_nesterov(nesterov, momentum, dampening)
    first_step_special = not base.is_constant(dampening, 0.0)

    def init_fn(params):
        return ScaleByMomentumState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(jnp.zeros_like, params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        mu = base.resolve(momentum, state.count)
        tau = base.resolve(dampening, state.count)

        def buf(g, b):
            ct = base.accumulation_dtype(g.dtype)
            g32, b32 = g.astype(ct), b.astype(ct)
            new = jnp.asarray(mu, ct) * b32 + (1 - jnp.asarray(tau, ct)) * g32
            if first_step_special:
                new = jnp.where(state.count == 0, g32, new)
            return new

        new_buf = jax.tree.map(buf, updates, state.momentum)
        if nesterov:
            out = jax.tree.map(
                lambda g, b: g.astype(b.dtype) + jnp.asarray(mu, b.dtype) * b, updates, new_buf
            )
        else:
            out = new_buf
        return _cast_tree_like(out, updates), ScaleByMomentumState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            momentum=_cast_tree_like(new_buf, state.momentum),
        )

    return comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), "scale_by_momentum")


def _check_momentum(momentum: Any) -> None:
    """Momentum must lie in [0, 1): at 1 or above the buffer sums or amplifies
    every past gradient and the iterates diverge. Schedules and traced values
    are only known at update time and are not checked."""
    base.check_hyperparameter(momentum, "momentum", lower=0.0, upper=1.0, upper_open=True)


def _check_nesterov(nesterov: bool, momentum: Any, dampening: Any) -> None:
    base.check_bool(nesterov, "nesterov")
    if not nesterov:
        return
    if base.is_python_number(momentum) and float(momentum) <= 0:
        raise ValueError(f"Nesterov momentum requires `momentum` > 0; got momentum={momentum!r}.")
    if base.is_python_number(dampening) and float(dampening) != 0:
        raise ValueError(f"Nesterov momentum requires `dampening` == 0; got dampening={dampening!r}.")


def _momentum_and_decay(
    momentum: optax.ScalarOrSchedule,
    dampening: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule,
    nesterov: bool,
) -> list[optax.GradientTransformation]:
    _check_momentum(momentum)
    base.check_hyperparameter(dampening, "dampening", lower=0.0, upper=1.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    _check_nesterov(nesterov, momentum, dampening)
    parts: list[optax.GradientTransformation] = []
    if not base.is_constant(weight_decay, 0.0):
        parts.append(optax.add_decayed_weights(weight_decay))
    if not base.is_constant(momentum, 0.0):
        parts.append(scale_by_momentum(momentum, dampening=dampening, nesterov=nesterov))
    return parts


def _check_lr(learning_rate: Any) -> None:
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)


def _chain(*parts: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    return comm.float_updates(optax.chain(*parts), "the optimizer")


# ----------------------------------------------------------------------------
# SGD and signum.


def sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: optax.ScalarOrSchedule = 0.0,
    *,
    dampening: optax.ScalarOrSchedule = 0.0,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Stochastic gradient descent with momentum, as ``torch.optim.SGD``.

    .. math::
      g_t \leftarrow g_t + \lambda_t p_t, \quad
      b_t = \mu_t b_{t-1} + (1 - \tau_t) g_t \ (b_1 = g_1), \quad
      u_t = -\eta_t \, (g_t + \mu_t b_t \ \text{if nesterov else} \ b_t).

    Note the learning rate multiplies the buffer (PyTorch/SINGA convention),
    not the gradient inside it (Sutskever et al.).

    Args:
      learning_rate: :math:`\eta \ge 0`, float or schedule.
      momentum: :math:`\mu \in [0, 1)`, float or schedule; 0 disables the
        buffer. A constant >= 1 (which diverges) is rejected; a schedule's
        values are not checked.
      dampening: :math:`\tau \in [0, 1]`, float or schedule.
      weight_decay: L2 penalty :math:`\lambda \ge 0` added to the gradient.
      nesterov: Nesterov momentum; rejected with ``momentum <= 0`` or
        ``dampening != 0`` (checked for constants).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`; its state is an
      ``optax.chain`` state of the pieces in use.

    Communication:
      None (local). Chain after :func:`jaxopt_dist.all_reduce` for
      synchronous SGD; state then stays replicated.

    Sharded parameters:
      Elementwise: on parameters sharded over model axes the state is sharded
      like them and each device updates its own shard; nothing crosses the
      model axes.

    Examples:
      >>> import jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.sgd(0.1, momentum=0.9)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)
      >>> updates["w"]
      Array([-0.1, -0.1, -0.1], dtype=float32)
    """
    _check_lr(learning_rate)
    parts = _momentum_and_decay(momentum, dampening, weight_decay, nesterov)
    return _chain(*parts, optax.scale_by_learning_rate(learning_rate))


def sign_sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: optax.ScalarOrSchedule = 0.0,
    *,
    dampening: optax.ScalarOrSchedule = 0.0,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""signSGD / signum: the step is the sign of the (momentum) direction.

    .. math::
      u_t = -\eta_t \operatorname{sign}(d_t),

    where :math:`d_t` is what :func:`sgd` would scale by the learning rate
    (the momentum buffer, its Nesterov variant, or the decayed gradient),
    as in mlbench's ``SignSGD``. This is a local optimizer: for signSGD with
    majority vote across workers, see ``sign_majority_vote``.

    Args:
      learning_rate: :math:`\eta \ge 0`, float or schedule.
      momentum: momentum factor in [0, 1); 0 gives plain signSGD, > 0 signum.
      dampening: dampening of the buffer, float or schedule.
      weight_decay: L2 penalty added to the gradient before the buffer.
      nesterov: Nesterov momentum (same rules as :func:`sgd`).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`.

    Communication:
      None (local).

    Sharded parameters:
      Elementwise: on parameters sharded over model axes the state is sharded
      like them and each device updates its own shard; nothing crosses the
      model axes.

    References:
      Bernstein et al, `signSGD: Compressed Optimisation for Non-Convex Problems
      <https://arxiv.org/abs/1802.04434>`_, 2018
    """
    _check_lr(learning_rate)
    parts = _momentum_and_decay(momentum, dampening, weight_decay, nesterov)
    return _chain(*parts, optax.scale_by_sign(), optax.scale_by_learning_rate(learning_rate))


# ----------------------------------------------------------------------------
# RMSProp and AdaGrad (SINGA: eps inside the square root).


@base.reshard_rules(nu=base.REGROUP)
class RmspropState(NamedTuple):
    """State for the scaling inside :func:`jaxopt_dist.rmsprop`.

    Attributes:
      count: int32[], steps taken; replicated.
      nu: running mean of squared updates, like params, their dtype and placement.
    """

    count: jax.Array  # int32[], replicated
    nu: optax.Updates  # like params


def _scale_by_root_of_accumulator(
    state_cls: Any,
    initial: float,
    accumulate: Any,
    eps: optax.ScalarOrSchedule,
) -> optax.GradientTransformation:
    """``g / sqrt(a + eps)`` with ``a = accumulate(a, g * g, count)``, eps inside the root (SINGA).

    Shared by RMSProp (a running mean) and AdaGrad (a running sum); the
    accumulator is the second field of ``state_cls``.
    """

    def init_fn(params):
        return state_cls(jnp.zeros([], jnp.int32), jax.tree.map(lambda p: jnp.full_like(p, initial), params))

    def update_fn(updates, state, params=None):
        del params
        e = base.resolve(eps, state.count)

        def one(g, a):
            ct = base.accumulation_dtype(g.dtype)
            g32 = g.astype(ct)
            new_a = accumulate(a.astype(ct), g32 * g32, state.count)
            return g32 / jnp.sqrt(new_a + jnp.asarray(e, ct)), new_a

        pairs = jax.tree.map(one, updates, state[1])
        out = jax.tree.map(lambda _, p: p[0], updates, pairs)
        acc = jax.tree.map(lambda _, p: p[1], updates, pairs)
        return _cast_tree_like(out, updates), state_cls(
            jnp.asarray(optax.safe_increment(state.count)), _cast_tree_like(acc, state[1])
        )

    return optax.GradientTransformation(init_fn, update_fn)


def _scale_by_rms(decay: optax.ScalarOrSchedule, eps: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    def running_mean(nu, g2, count):
        r = jnp.asarray(base.resolve(decay, count), nu.dtype)
        return r * nu + (1 - r) * g2

    return _scale_by_root_of_accumulator(RmspropState, 0.0, running_mean, eps)


def rmsprop(
    learning_rate: optax.ScalarOrSchedule,
    decay: optax.ScalarOrSchedule = 0.9,
    eps: optax.ScalarOrSchedule = 1e-8,
    *,
    weight_decay: optax.ScalarOrSchedule = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""RMSProp as in SINGA: ``eps`` sits inside the square root.

    .. math::
      g_t \leftarrow g_t + \lambda_t p_t, \quad
      \nu_t = \rho_t \nu_{t-1} + (1 - \rho_t) g_t^2, \quad
      u_t = -\eta_t \, g_t / \sqrt{\nu_t + \epsilon_t}.

    Args:
      learning_rate: :math:`\eta \ge 0`, float or schedule.
      decay: :math:`\rho \in [0, 1]`, float or schedule.
      eps: :math:`\epsilon \ge 0` inside the root, float or schedule.
      weight_decay: L2 penalty added to the gradient.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`.

    Communication:
      None (local).

    Sharded parameters:
      Elementwise: on parameters sharded over model axes the state is sharded
      like them and each device updates its own shard; nothing crosses the
      model axes.
    """
    _check_lr(learning_rate)
    base.check_hyperparameter(decay, "decay", lower=0.0, upper=1.0)
    base.check_hyperparameter(eps, "eps", lower=0.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    parts = [] if base.is_constant(weight_decay, 0.0) else [optax.add_decayed_weights(weight_decay)]
    return _chain(*parts, _scale_by_rms(decay, eps), optax.scale_by_learning_rate(learning_rate))


@base.reshard_rules(sum_of_squares=base.REGROUP)
class ScaleByAdagradState(NamedTuple):
    """State for the scaling inside :func:`jaxopt_dist.adagrad`.

    Attributes:
      count: int32[], steps taken; replicated.
      sum_of_squares: accumulated squared updates, like params.
    """

    count: jax.Array  # int32[], replicated
    sum_of_squares: optax.Updates  # like params


def _scale_by_adagrad(
    eps: optax.ScalarOrSchedule, initial_accumulator_value: float
) -> optax.GradientTransformation:
    return _scale_by_root_of_accumulator(
        ScaleByAdagradState, initial_accumulator_value, lambda h, g2, count: h + g2, eps
    )


def adagrad(
    learning_rate: optax.ScalarOrSchedule,
    eps: optax.ScalarOrSchedule = 1e-8,
    *,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    initial_accumulator_value: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""AdaGrad as in SINGA: ``eps`` sits inside the square root.

    .. math::
      g_t \leftarrow g_t + \lambda_t p_t, \quad
      h_t = h_{t-1} + g_t^2 \ (h_0 = \text{initial\_accumulator\_value}), \quad
      u_t = -\eta_t \, g_t / \sqrt{h_t + \epsilon_t}.

    Args:
      learning_rate: :math:`\eta \ge 0`, float or schedule.
      eps: :math:`\epsilon \ge 0` inside the root, float or schedule.
      weight_decay: L2 penalty added to the gradient.
      initial_accumulator_value: starting value of :math:`h` (>= 0).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`.

    Communication:
      None (local).

    Sharded parameters:
      Elementwise: on parameters sharded over model axes the state is sharded
      like them and each device updates its own shard; nothing crosses the
      model axes.
    """
    _check_lr(learning_rate)
    base.check_hyperparameter(eps, "eps", lower=0.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    if callable(initial_accumulator_value):
        raise TypeError("`initial_accumulator_value` sets the initial state and cannot be a schedule.")
    base.check_hyperparameter(initial_accumulator_value, "initial_accumulator_value", lower=0.0)
    parts = [] if base.is_constant(weight_decay, 0.0) else [optax.add_decayed_weights(weight_decay)]
    return _chain(
        *parts,
        _scale_by_adagrad(eps, initial_accumulator_value),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------
# Adam / AMSGrad (PyTorch semantics, schedulable betas).


@base.reshard_rules(mu=base.REGROUP, nu=base.REGROUP, nu_max=base.REGROUP)
class AdamState(NamedTuple):
    """State for the scaling inside :func:`jaxopt_dist.adam`.

    Attributes:
      count: int32[], steps taken; replicated.
      mu: first moment, like params.
      nu: second moment, like params.
      nu_max: running maximum of ``nu`` (AMSGrad), like params; empty tuple otherwise.
      b1_prod: float32[], product of the b1 values so far (scheduled betas only), else empty.
      b2_prod: float32[], product of the b2 values so far (scheduled betas only), else empty.
    """

    count: jax.Array  # int32[], replicated
    mu: optax.Updates  # like params
    nu: optax.Updates  # like params
    nu_max: optax.Updates  # like params (amsgrad) or ()
    b1_prod: Any  # float32[] (scheduled b1) or ()
    b2_prod: Any  # float32[] (scheduled b2) or ()


def _bias_correction(tracked: bool, prod: Any, beta: Any, t: jax.Array) -> tuple[Any, jax.Array]:
    """``(running product, 1 - product)`` of a beta, ``t`` steps in (``t`` >= 1).

    A tracked (scheduled) beta multiplies the running product in the state;
    a constant one has no product (``()``) and uses ``1 - beta**t``.
    """
    if tracked:
        p = prod * jnp.asarray(beta, jnp.float32)
        return p, 1 - p
    return (), 1 - jnp.asarray(beta, jnp.float32) ** t.astype(jnp.float32)


def _scale_by_adam(
    b1: optax.ScalarOrSchedule,
    b2: optax.ScalarOrSchedule,
    eps: optax.ScalarOrSchedule,
    amsgrad: bool,
) -> optax.GradientTransformation:
    # Constant betas use the closed form 1 - b**t for the bias correction, as
    # PyTorch does; scheduled (or injected) betas keep the running product, which
    # is the exact normaliser of an exponential average with varying decay.
    track1 = not base.is_python_number(b1)
    track2 = not base.is_python_number(b2)

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamState(
            count=jnp.zeros([], jnp.int32),
            mu=zeros,
            nu=jax.tree.map(jnp.zeros_like, params),
            nu_max=jax.tree.map(jnp.zeros_like, params) if amsgrad else (),
            b1_prod=jnp.ones([], jnp.float32) if track1 else (),
            b2_prod=jnp.ones([], jnp.float32) if track2 else (),
        )

    def update_fn(updates, state, params=None):
        del params
        beta1 = base.resolve(b1, state.count)
        beta2 = base.resolve(b2, state.count)
        e = base.resolve(eps, state.count)
        t = jnp.asarray(optax.safe_increment(state.count))
        p1, bc1 = _bias_correction(track1, state.b1_prod, beta1, t)
        p2, bc2 = _bias_correction(track2, state.b2_prod, beta2, t)

        def moments(g, m, v):
            ct = base.accumulation_dtype(g.dtype)
            g32 = g.astype(ct)
            bb1, bb2 = jnp.asarray(beta1, ct), jnp.asarray(beta2, ct)
            return bb1 * m.astype(ct) + (1 - bb1) * g32, bb2 * v.astype(ct) + (1 - bb2) * g32 * g32

        mv = jax.tree.map(moments, updates, state.mu, state.nu)
        mu = jax.tree.map(lambda _, x: x[0], updates, mv)
        nu = jax.tree.map(lambda _, x: x[1], updates, mv)
        if amsgrad:
            nu_max = jax.tree.map(lambda a, b: jnp.maximum(a.astype(b.dtype), b), state.nu_max, nu)
            second = nu_max
        else:
            nu_max = ()
            second = nu

        def step(m, v):
            ct = m.dtype
            denom = jnp.sqrt(v) / jnp.sqrt(bc2.astype(ct)) + jnp.asarray(e, ct)
            return (m / bc1.astype(ct)) / denom

        out = jax.tree.map(step, mu, second)
        new_state = AdamState(
            count=t,
            mu=_cast_tree_like(mu, state.mu),
            nu=_cast_tree_like(nu, state.nu),
            nu_max=_cast_tree_like(nu_max, state.nu_max) if amsgrad else (),
            b1_prod=p1,
            b2_prod=p2,
        )
        return _cast_tree_like(out, updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: optax.ScalarOrSchedule = 0.9,
    b2: optax.ScalarOrSchedule = 0.999,
    eps: optax.ScalarOrSchedule = 1e-8,
    *,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    amsgrad: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adam and AMSGrad as ``torch.optim.Adam`` (L2 weight decay on the gradient).

    .. math::
      g_t \leftarrow g_t + \lambda_t p_t, \quad
      m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
      v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
      \hat v_t = \max(\hat v_{t-1}, v_t) \ \text{(amsgrad) or } v_t, \quad
      u_t = -\eta_t \frac{m_t / c_{1,t}}{\sqrt{\hat v_t / c_{2,t}} + \epsilon_t},

    with bias corrections :math:`c_{i,t} = 1 - \beta_i^t` for constant betas and
    :math:`1 - \prod_{s \le t} \beta_{i,s}` for scheduled ones (the exact
    normaliser of an average with varying decay). For decoupled weight decay
    (AdamW), chain :func:`optax.add_decayed_weights` after instead.

    Args:
      learning_rate: :math:`\eta \ge 0`, float or schedule.
      b1: :math:`\beta_1 \in [0, 1)`, float or schedule.
      b2: :math:`\beta_2 \in [0, 1)`, float or schedule.
      eps: :math:`\epsilon \ge 0`, added outside the root; float or schedule.
      weight_decay: L2 penalty added to the gradient, float or schedule.
      amsgrad: keep the running maximum of the second moment (PyTorch's AMSGrad:
        the maximum of the uncorrected moments).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`.

    Communication:
      None (local).

    Sharded parameters:
      Elementwise: on parameters sharded over model axes the state is sharded
      like them and each device updates its own shard; nothing crosses the
      model axes.

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014;
      Reddi et al, `On the Convergence of Adam and Beyond
      <https://openreview.net/forum?id=ryQu7f-RZ>`_, 2018
    """
    _check_lr(learning_rate)
    base.check_hyperparameter(b1, "b1", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(b2, "b2", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(eps, "eps", lower=0.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    base.check_bool(amsgrad, "amsgrad")
    parts = [] if base.is_constant(weight_decay, 0.0) else [optax.add_decayed_weights(weight_decay)]
    return _chain(*parts, _scale_by_adam(b1, b2, eps, amsgrad), optax.scale_by_learning_rate(learning_rate))
