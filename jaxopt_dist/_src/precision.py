"""Mixed precision: dynamic loss scaling, fp32 master weights, replica-consistent finite checks.

mlbench's ``FP16Optimizer`` (after NVIDIA's recipe) in three composable pieces:

* :func:`dynamic_loss_scale` keeps the loss scale in its state, unscales the
  gradients, skips a step whose gradients or updates are not finite (and
  shrinks the scale), and grows the scale after a run of finite steps.
* :func:`master_weights` runs the wrapped optimizer on a float32 copy of
  low-precision (bf16/fp16) parameters kept in its state, and emits updates
  that make the parameters equal to the cast of that copy.
* :func:`apply_if_finite_everywhere` is :func:`optax.apply_if_finite` made
  replica-consistent: the finiteness flag is reduced over the data axis, so
  either every worker applies the step or none does.

Recommended order (outermost first)::

    tx = master_weights(dynamic_loss_scale(optax.chain(all_reduce(), sgd(0.1)), axis_name="data"))

``master_weights`` outside, so that the gradients are unscaled in float32
(fp16 gradients divided by the scale in fp16 would underflow); the
communication inside ``dynamic_loss_scale``, so that it sees each worker's
raw gradients and a single flag decides for everyone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm

# ----------------------------------------------------------------------------
# Shared: finiteness, selection.


def _all_finite(tree: Any) -> jax.Array:
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not flags:
        return jnp.ones([], bool)
    return jnp.all(jnp.stack(flags))


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``pred`` else ``old``, leafwise, keeping ``old``'s dtypes (PRNG keys too)."""

    def pick(a, b):
        if jnp.issubdtype(jnp.result_type(b), jax.dtypes.prng_key):
            return jnp.where(pred, a, b)
        return jnp.where(pred, a, b).astype(jnp.result_type(b))

    return jax.tree.map(pick, new, old)


def _zeros_where_not(pred: jax.Array, tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.where(pred, x, jnp.zeros_like(x)), tree)


def _guarded(
    inner: optax.GradientTransformationExtraArgs,
    updates: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    axis_name: base.AxisName | None,
    caller: str,
) -> tuple[Any, Any, jax.Array]:
    """Runs ``inner`` and keeps its result only if everything is finite everywhere.

    The flag covers the inner's input *and* output (a compressor or AdaSum can
    turn finite inputs into non-finite outputs), and is AND-reduced over
    ``axis_name`` with one tiny all-reduce, so all workers decide alike.
    """
    out, new_inner = inner.update(updates, inner_state, params, **extra_args)
    finite = jnp.logical_and(_all_finite(updates), _all_finite(out))
    if axis_name is not None:
        finite = comm.all_true(finite, axis_name, caller=caller)
    return _zeros_where_not(finite, out), _select(finite, new_inner, inner_state), finite


# ----------------------------------------------------------------------------
# Dynamic loss scaling.


@base.reshard_rules()
class DynamicLossScaleState(NamedTuple):
    """State for :func:`jaxopt_dist.dynamic_loss_scale`.

    Placement: replicated when ``axis_name`` is given (the flag is reduced over
    workers); otherwise it follows the gradients (per-worker under shard_map).

    Attributes:
      scale: float32[], the current loss scale.
      good_steps: int32[], finite steps since the scale last changed.
      count: int32[], steps taken, skipped ones included.
      num_skipped: int32[], steps skipped for non-finite values so far.
      last_finite: bool[], whether the last step was applied.
      inner_state: the wrapped transformation's state (unchanged by a skip).
    """

    scale: jax.Array  # float32[], replicated with axis_name
    good_steps: jax.Array  # int32[], replicated with axis_name
    count: jax.Array  # int32[], replicated
    num_skipped: jax.Array  # int32[], replicated with axis_name
    last_finite: jax.Array  # bool[], replicated with axis_name
    inner_state: optax.OptState  # the wrapped transformation's state


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**10,
    growth_factor: optax.ScalarOrSchedule = 2.0,
    growth_interval: int = 128,
    min_scale: optax.ScalarOrSchedule = 1e-4,
    max_scale: optax.ScalarOrSchedule | None = None,
    backoff_factor: optax.ScalarOrSchedule | None = None,
    axis_name: base.AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Dynamic loss scaling with overflow skipping, as mlbench's ``FP16Optimizer``.

    The loss function multiplies the loss by :func:`loss_scale` of the state;
    this wrapper divides the gradients by it and runs ``inner``:

    .. math::
      \hat g = g / S, \qquad (u, s') = \text{inner}(\hat g, s), \qquad
      \text{ok} = \textstyle\bigwedge_{\text{workers}}
        \text{finite}(\hat g) \wedge \text{finite}(u).

    If ``ok``: the update :math:`u` is emitted, ``inner`` keeps :math:`s'`,
    and after ``growth_interval`` finite steps in a row
    :math:`S \leftarrow \min(S \cdot \text{growth\_factor}, \text{max\_scale})`.
    Otherwise the step is skipped (zero update, inner state unchanged, so the
    parameters stay bit-identical) and
    :math:`S \leftarrow \max(S \cdot \text{backoff\_factor}, \text{min\_scale})`.

    The extra args ``value`` and ``value_fn`` (the loss, scaled like the
    gradients) are unscaled too before they reach ``inner``.

    Args:
      inner: the optimizer to protect, typically ``optax.chain(all_reduce(),
        sgd(...))`` or any compressor chain.
      init_scale: initial scale (> 0, a float, not a schedule; a power of two
        keeps the unscaling exact).
      growth_factor: factor (> 1) applied after ``growth_interval`` finite steps.
      growth_interval: finite steps in a row before growing (Python int >= 1).
      min_scale: lower bound (> 0) for the scale.
      max_scale: upper bound, or None for none.
      backoff_factor: factor in (0, 1) applied on overflow; default
        ``1 / growth_factor`` (mlbench uses one factor for both).
      axis_name: the data axis to AND-reduce the finiteness flag over, so that
        all workers skip together. None checks each worker on its own (as
        :func:`optax.apply_if_finite`), which is only safe when the check sees
        already-replicated values.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`DynamicLossScaleState`. Hyperparameters other than
      ``init_scale`` and ``growth_interval`` may be optax schedules of the
      step count.

    Communication:
      Whatever ``inner`` sends, plus, with ``axis_name``, one all-reduce (a
      ``pmin``) of one int32 per step. Outputs and state follow ``inner``;
      the scale, counters and flag are replicated when ``axis_name`` is given.

    Sharded parameters:
      Elementwise, but for the finiteness check: the flag of each leaf is a
      reduction over its shards, AND-ed over the model axes before the
      data-axis ``pmin``. ``inner`` behaves as its own docstring says.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = jd.dynamic_loss_scale(optax.chain(jd.all_reduce(), jd.sgd(0.1)),
      ...                            init_scale=4.0, axis_name="data")
      >>> params = jnp.zeros(2)
      >>> grads = jnp.array([[4.0, 4.0], [jnp.inf, 0.0]])   # worker 1 overflowed
      >>> def step(g):
      ...     state = tx.init(params)
      ...     u, state = tx.update(g, state, params)
      ...     return u, jd.loss_scale(state)
      >>> jax.vmap(step, axis_name="data")(grads)
      (Array([[0., 0.],
             [0., 0.]], dtype=float32), Array([2., 2.], dtype=float32))

    References:
      Micikevicius et al, `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018
    """
    inner = _check_inner(inner)
    if callable(init_scale):
        raise TypeError("`init_scale` must be a float (it is used once, by init); got a callable.")
    base.check_hyperparameter(init_scale, "init_scale", lower=0.0, lower_open=True)
    base.check_hyperparameter(growth_factor, "growth_factor", lower=1.0, lower_open=True)
    growth_interval = base.check_positive_int(growth_interval, "growth_interval")
    base.check_hyperparameter(min_scale, "min_scale", lower=0.0, lower_open=True)
    if max_scale is not None:
        base.check_hyperparameter(max_scale, "max_scale", lower=0.0, lower_open=True)
        hi, lo, init = _number(max_scale), _number(min_scale), _number(init_scale)
        if hi is not None and lo is not None and hi < lo:
            raise ValueError(f"`max_scale`={max_scale!r} must be >= `min_scale`={min_scale!r}.")
        if hi is not None and init is not None and init > hi:
            raise ValueError(f"`init_scale`={init_scale!r} exceeds `max_scale`={max_scale!r}.")
    if backoff_factor is not None:
        base.check_hyperparameter(
            backoff_factor, "backoff_factor", lower=0.0, upper=1.0, lower_open=True, upper_open=True
        )
    axis_name = base.validate_axis_name(axis_name, allow_none=True)

    def init_fn(params):
        return DynamicLossScaleState(
            scale=jnp.asarray(init_scale, jnp.float32),
            good_steps=jnp.zeros([], jnp.int32),
            count=jnp.zeros([], jnp.int32),
            num_skipped=jnp.zeros([], jnp.int32),
            last_finite=jnp.ones([], bool),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if axis_name is not None:
            comm.require_axis(axis_name, "dynamic_loss_scale")
        f32 = jnp.float32
        count = state.count
        scale = state.scale

        def unscale(x):
            ct = jnp.promote_types(jnp.result_type(x), f32)
            return (jnp.asarray(x, ct) / scale.astype(ct)).astype(jnp.result_type(x))

        grads = jax.tree.map(unscale, updates)
        extra = dict(extra_args)
        if extra.get("value") is not None:
            extra["value"] = unscale(extra["value"])
        if extra.get("value_fn") is not None:
            value_fn = extra["value_fn"]
            extra["value_fn"] = lambda q: unscale(value_fn(q))
        out, inner_state, finite = _guarded(
            inner, grads, state.inner_state, params, extra, axis_name, "dynamic_loss_scale"
        )

        gf = jnp.asarray(base.resolve(growth_factor, count), f32)
        bf = 1.0 / gf if backoff_factor is None else jnp.asarray(base.resolve(backoff_factor, count), f32)
        lo = jnp.asarray(base.resolve(min_scale, count), f32)
        grown = scale * gf
        if max_scale is not None:
            grown = jnp.minimum(grown, jnp.asarray(base.resolve(max_scale, count), f32))
        grow = jnp.logical_and(finite, state.good_steps + 1 >= growth_interval)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), jnp.maximum(scale * bf, lo))
        good = jnp.where(jnp.logical_and(finite, jnp.logical_not(grow)), state.good_steps + 1, 0)
        return out, DynamicLossScaleState(
            scale=new_scale.astype(f32),
            good_steps=good.astype(jnp.int32),
            count=jnp.asarray(optax.safe_increment(count)),
            num_skipped=jnp.where(finite, state.num_skipped, optax.safe_increment(state.num_skipped)),
            last_finite=finite,
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def loss_scale(state: Any) -> jax.Array:
    """The current loss scale held in an optimizer state.

    Accepts a :class:`DynamicLossScaleState` or any state that contains
    exactly one (an ``optax.chain`` state, :func:`master_weights`,
    ``optax.MultiSteps``, ``optax.inject_hyperparams``...). Multiply the loss by
    it before differentiating.

    Raises:
      ValueError: no, or more than one, :class:`DynamicLossScaleState` in ``state``.
    """
    is_dls = lambda x: isinstance(x, DynamicLossScaleState)  # noqa: E731
    found = [x for x in jax.tree.leaves(state, is_leaf=is_dls) if is_dls(x)]
    if len(found) != 1:
        raise ValueError(
            f"`loss_scale` needs a state holding exactly one DynamicLossScaleState (from "
            f"jaxopt_dist.dynamic_loss_scale); found {len(found)}."
        )
    return found[0].scale


# ----------------------------------------------------------------------------
# Replica-consistent apply_if_finite.


@base.reshard_rules()
class ApplyIfFiniteEverywhereState(NamedTuple):
    """State for :func:`jaxopt_dist.apply_if_finite_everywhere` (fields as :class:`optax.ApplyIfFiniteState`).

    Attributes:
      notfinite_count: int32[], non-finite steps in a row; replicated.
      last_finite: bool[], whether the last step was applied; replicated.
      total_notfinite: int32[], non-finite steps so far; replicated.
      inner_state: the wrapped transformation's state.
    """

    notfinite_count: jax.Array  # int32[], replicated
    last_finite: jax.Array  # bool[], replicated
    total_notfinite: jax.Array  # int32[], replicated
    inner_state: optax.OptState  # the wrapped transformation's state


def apply_if_finite_everywhere(
    inner: optax.GradientTransformation,
    max_consecutive_errors: int | None = None,
    *,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""Skips a step on every worker when any worker sees a non-finite value.

    :func:`optax.apply_if_finite` decides on each device from that device's
    gradients: one worker with an overflow skips while the others step, and
    per-worker state (error-feedback residuals, local-SGD parameters) drifts
    apart for good. Here the flag (finite input *and* finite output of
    ``inner`` on this worker) is AND-reduced over ``axis_name`` first, so all
    workers skip together: zero updates and ``inner``'s state unchanged.

    Args:
      inner: any transformation or chain.
      max_consecutive_errors: after more than this many non-finite steps in a
        row the update is applied anyway (optax's semantics); None never does.
      axis_name: the data axis (or tuple of axes).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`ApplyIfFiniteEverywhereState`.

    Communication:
      Whatever ``inner`` sends, plus one all-reduce (a ``pmin``) of one int32
      per step. The counters and flag are replicated; outputs and inner
      state follow ``inner``.

    Sharded parameters:
      As :func:`dynamic_loss_scale`: the flag of each leaf is reduced over
      its shards (over the model axes) before the data-axis ``pmin``; the rest
      is ``inner``'s.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = jd.apply_if_finite_everywhere(jd.sgd(1.0))    # local steps
      >>> grads = jnp.array([[1.0], [jnp.nan]])
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(grads)       # both workers skip
      Array([[0.],
             [0.]], dtype=float32)
    """
    inner = _check_inner(inner)
    if max_consecutive_errors is not None:
        max_consecutive_errors = base.check_positive_int(
            max_consecutive_errors, "max_consecutive_errors", minimum=0
        )
    axis_name = base.validate_axis_name(axis_name)

    def init_fn(params):
        return ApplyIfFiniteEverywhereState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.ones([], bool),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        comm.require_axis(axis_name, "apply_if_finite_everywhere")
        if max_consecutive_errors is None:
            out, inner_state, finite = _guarded(
                inner, updates, state.inner_state, params, extra_args, axis_name, "apply_if_finite_everywhere"
            )
        else:
            raw, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
            finite = jnp.logical_and(_all_finite(updates), _all_finite(raw))
            finite = comm.all_true(finite, axis_name, caller="apply_if_finite_everywhere")
            give_up = state.notfinite_count + 1 > max_consecutive_errors
            apply = jnp.logical_or(finite, give_up)
            out = _zeros_where_not(apply, raw)
            inner_state = _select(apply, new_inner, state.inner_state)
        notfinite = jnp.where(finite, 0, optax.safe_increment(state.notfinite_count))
        return out, ApplyIfFiniteEverywhereState(
            notfinite_count=notfinite.astype(jnp.int32),
            last_finite=finite,
            total_notfinite=jnp.where(
                finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)
            ),
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------
# fp32 master weights.


@base.reshard_rules(master=base.REGROUP)
class MasterWeightsState(NamedTuple):
    """State for :func:`jaxopt_dist.master_weights`.

    Attributes:
      master: the parameters in at least the master dtype (float32 by
        default); placed like the parameters (replicated for replicated
        parameters).
      inner_state: the wrapped optimizer's state, built on ``master``.
    """

    master: optax.Params  # like params in >= float32; placement of params
    inner_state: optax.OptState  # the wrapped optimizer's state


def _master_dtype(x: Any, dtype: Any) -> Any:
    dt = jnp.result_type(x)
    if jnp.issubdtype(dt, jnp.floating):
        return jnp.promote_types(dt, dtype)
    return dt


def master_weights(
    inner: optax.GradientTransformation,
    *,
    dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    r"""Runs ``inner`` on a float32 master copy of low-precision parameters.

    For bf16/fp16 parameters :math:`p` the state keeps :math:`w`, the
    parameters in float32. Each step casts the gradients up (exactly), lets
    ``inner`` step the master copy, and emits

    .. math::
      w' = w + \text{inner}(g), \qquad u = \text{fl}_{32}(\text{cast}(w') - p)

    so that ``optax.apply_updates(p, u) == cast(w')`` bit for bit: the
    difference of two bf16 (fp16) numbers is exact in float32 whenever their
    binary exponents differ by at most 16 (13), and ``p + u`` then equals
    ``cast(w')`` exactly before the final cast. Only a parameter whose
    magnitude collapses by more than ~2^16 (bf16) or ~2^13 (fp16) in one step
    can land one low-precision ulp off; since ``u`` is taken relative to the
    actual ``p``, the next step puts it back. Small steps are never lost to
    low-precision rounding: they accumulate in :math:`w`.

    The emitted updates are in the master dtype (float32), deliberately: a
    bf16 update cannot carry the difference. Put ``master_weights`` last
    (outermost) and apply its output with :func:`optax.apply_updates` (as
    :func:`jaxopt_dist.data_parallel_step` does). Leaves already in (at least)
    ``dtype`` pass ``inner``'s update through unchanged; integer leaves are
    left alone. The ``value_fn`` extra arg is wrapped so that ``inner``'s line
    searches evaluate the loss at the low-precision cast of their trial point.

    Args:
      inner: the optimizer run on the master copy (it sees float32 gradients,
        params and state).
      dtype: the master dtype (a floating dtype; float32 by default).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`MasterWeightsState`; ``update`` needs ``params``.

    Communication:
      Whatever ``inner`` sends (in float32 if ``inner`` communicates
      gradients; put a low-precision ``all_reduce(dtype=...)`` inside to keep
      the wire narrow). ``master`` has the placement of the parameters.

    Sharded parameters:
      Elementwise: ``master`` is sharded like the parameters and each device
      casts and steps its own shard; nothing crosses the model axes but what
      ``inner`` needs.

    Memory:
      ``4 n_params`` bytes for the master copy plus ``inner``'s float32 state.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = jd.master_weights(jd.sgd(1e-3))
      >>> params = jnp.ones(2, jnp.bfloat16)
      >>> state = tx.init(params)
      >>> for _ in range(4):   # each step is below half a bf16 ulp: plain bf16 SGD stays at 1
      ...     u, state = tx.update(jnp.ones(2, jnp.bfloat16), state, params)
      ...     params = optax.apply_updates(params, u)
      >>> params, state.master
      (Array([0.996094, 0.996094], dtype=bfloat16), Array([0.99600005, 0.99600005], dtype=float32))
    """
    inner = _check_inner(inner)
    try:
        master_dt = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"`dtype` must be a floating dtype; got {dtype!r}.") from e
    if not jnp.issubdtype(master_dt, jnp.floating):
        raise ValueError(f"`dtype` must be a floating dtype; got {master_dt}.")

    def to_master(tree):
        return jax.tree.map(lambda x: jnp.asarray(x).astype(_master_dtype(x, master_dt)), tree)

    def init_fn(params):
        master = to_master(params)
        return MasterWeightsState(master=master, inner_state=inner.init(master))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(base.no_params_message("master_weights"))
        grads = jax.tree.map(lambda g, w: jnp.asarray(g).astype(w.dtype), updates, state.master)
        extra = dict(extra_args)
        if extra.get("value_fn") is not None:
            value_fn = extra["value_fn"]
            extra["value_fn"] = lambda q: value_fn(
                jax.tree.map(lambda x, p: x.astype(jnp.result_type(p)), q, params)
            )
        u, inner_state = inner.update(grads, state.inner_state, state.master, **extra)
        new_master = optax.apply_updates(state.master, u)

        def emit(w_new, p, du):
            p_dt = jnp.result_type(p)
            if not jnp.issubdtype(p_dt, jnp.floating):
                return jnp.zeros_like(du)
            if p_dt == w_new.dtype:
                return du.astype(w_new.dtype)
            target = w_new.astype(p_dt)
            return target.astype(w_new.dtype) - jnp.asarray(p).astype(w_new.dtype)

        out = jax.tree.map(emit, new_master, params, u)
        new_master = optax.tree.cast_like(new_master, state.master)
        return out, MasterWeightsState(master=new_master, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _number(x: Any) -> float | None:
    """``x`` as a float when it is a Python/NumPy number, else None (schedules, arrays)."""
    return float(x) if base.is_python_number(x) else None


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"`inner` must be an optax.GradientTransformation (e.g. optax.chain(...)); got {type(inner).__name__}."
        )
    return optax.with_extra_args_support(inner)
