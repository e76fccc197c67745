r"""Robust aggregation: rules over every worker's update that a few bad workers cannot steer.

Four aggregators used like :func:`jaxopt_dist.all_reduce`: each worker passes
its update :math:`u_i` (a pytree), every worker gets the same result. Each
gathers the :math:`n` updates with one all-gather, and leaves out of the step
every worker whose update holds a NaN or an infinity in any entry of any
leaf: the rule runs over the :math:`m` finite workers (:math:`m` is data,
found anew at each step; the shapes stay static).

* :func:`trimmed_mean`: per coordinate, the mean of the values left after the
  ``trim`` smallest and ``trim`` largest are dropped (Yin et al. 2018).
* :func:`coordinate_median`: per coordinate, the median (Yin et al. 2018).
* :func:`centered_clip`: every update clipped to a ball around the previous
  aggregate, then averaged (Karimireddy, He and Jaggi 2021).
* :func:`norm_clipped_mean`: per leaf, every update's norm clipped to the
  median norm, then averaged (Templar's Gauntlet).

:func:`jaxopt_dist.all_reduce` stays the plain mean: one worker with a NaN
makes NaN parameters on every worker through it, and one worker sending
:math:`-10` times its update moves the mean wherever it likes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm

_FIRST_IN_A_CHAIN = (
    "A robust rule must see each worker's own update: place it before any aggregate or "
    "compressor of a chain (all_reduce, top_k, low_bit... have already averaged the workers)."
)


@base.reshard_rules()
class CenteredClipState(NamedTuple):
    """State for :func:`jaxopt_dist.centered_clip`.

    Attributes:
      count: int32[], steps taken (the ``radius`` schedule's argument); replicated.
      center: the previous step's output :math:`v`, like the updates (zeros
        at ``init``); replicated.
    """

    count: jax.Array  # int32[], replicated
    center: optax.Updates  # like the updates, replicated


# ----------------------------------------------------------------------------
# Rows: each gathered leaf is (n, *shape), row i from worker i.


def finite_rows(stacked: Sequence[jax.Array]) -> jax.Array:
    """``bool[n]``: whether worker ``i``'s row is finite in every entry of every leaf of ``stacked``."""
    n = stacked[0].shape[0]
    ok = jnp.ones((n,), bool)
    for x in stacked:
        ok = ok & jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
    return ok


def _rows(mask: jax.Array, x: jax.Array) -> jax.Array:
    """``mask`` (one entry per worker) shaped to broadcast against the rows ``x``."""
    return mask.reshape((-1,) + (1,) * (x.ndim - 1))


NETWORK_MAX_WORKERS = 32
"""Up to this many workers the rows are sorted by a sorting network (elementwise minima and maxima,
which XLA fuses into one pass: 18x faster than ``jnp.sort`` along the worker axis for 8 workers on
CPU); beyond, by ``jnp.sort``. The two give the same values."""


@functools.cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort on ``n`` inputs: compare-exchange pairs ``(i, j)``, ``i < j``, in order.

    After every pair has put the smaller value at ``i`` and the larger at ``j``, the inputs are in
    ascending order (for any ``n``: the network for the next power of two, its pairs that reach past
    ``n`` dropped, as though those inputs were ``+inf``). ``19`` pairs for 8 inputs.
    """
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def _ascending(x: jax.Array, finite: jax.Array) -> jax.Array:
    """Per coordinate, the finite workers' values in ascending order, the others (+inf) after them."""
    x = jnp.where(_rows(finite, x), x, jnp.inf)
    n = x.shape[0]
    if n > NETWORK_MAX_WORKERS:
        return jnp.sort(x, axis=0)
    rows = [x[i] for i in range(n)]
    for i, j in sorting_network(n):
        rows[i], rows[j] = jnp.minimum(rows[i], rows[j]), jnp.maximum(rows[i], rows[j])
    return jnp.stack(rows)


def _row_squares(x: jax.Array) -> jax.Array:
    """The sum of squares of each row of ``x``, in ``x``'s dtype: one reduction per row, whose order of
    additions does not depend on the number of rows (one reduction over every row may add in another
    order for another row count; see :func:`_sum_rows`)."""
    return jnp.stack([jnp.sum(jnp.square(x[i])) for i in range(x.shape[0])])


def _sum_rows(x: jax.Array) -> jax.Array:
    """The rows of ``x`` added one after another in worker order.

    Not ``jnp.sum(x, axis=0)``, whose order of additions depends on the number of rows: adding the rows in
    order, rows of zeros anywhere among them change no bit, so the islands' merge over one row per slot
    (zeros for the slots with no contribution) gives the in-process rule's bits on the same contributions.
    """
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return total


def _median(x: jax.Array, finite: jax.Array, m: jax.Array) -> jax.Array:
    """Per coordinate, the median of the finite rows (even ``m``: the mean of the middle two); 0 if none."""
    s = _ascending(x, finite)
    lo, hi = jnp.maximum((m - 1) // 2, 0), jnp.maximum(m // 2, 0)
    a = jax.lax.dynamic_index_in_dim(s, lo, keepdims=False)
    b = jax.lax.dynamic_index_in_dim(s, hi, keepdims=False)
    middle = jnp.where(lo == hi, a, (a + b) / 2)
    return jnp.where(m > 0, middle, jnp.zeros_like(middle))


def _weighted_mean(x: jax.Array, weights: jax.Array, m: jax.Array) -> jax.Array:
    """``sum_i w_i x_i / max(m, 1)`` over the rows with ``w_i > 0`` (the others, NaN ones too, add nothing)."""
    w = _rows(weights, x)
    return _sum_rows(jnp.where(w > 0, x * w, 0)) / jnp.maximum(m, 1).astype(x.dtype)


def _clip_factors(norms: jax.Array, limit: Any) -> jax.Array:
    """``min(1, limit / norm)`` per worker; 1 for a zero norm."""
    return jnp.where(norms > limit, limit / jnp.where(norms > 0, norms, 1), jnp.ones_like(norms))


def _promoted(stacked: Sequence[jax.Array]) -> list[jax.Array]:
    return [x.astype(base.accumulation_dtype(x.dtype)) for x in stacked]


# ----------------------------------------------------------------------------
# The four rules, on gathered rows: (stacked leaves, state) -> (leaves, state).


def _check_trim(trim: int, n: int) -> None:
    if n <= 2 * trim:
        raise ValueError(
            f"`trim`={trim} needs more than 2 * trim = {2 * trim} workers; the axis has {n}. "
            f"Use trim <= {(n - 1) // 2} on {n} workers."
        )


def _trimmed_mean_rows(trim: int) -> Callable[..., tuple[list[jax.Array], Any]]:
    def combine(stacked, state):
        _check_trim(trim, stacked[0].shape[0])
        finite = finite_rows(stacked)
        m = jnp.sum(finite, dtype=jnp.int32)
        b = jnp.maximum(jnp.minimum(trim, (m - 1) // 2), 0)
        out = []
        for x in _promoted(stacked):
            s = _ascending(x, finite)
            pos = _rows(jnp.arange(x.shape[0]), x)
            kept = jnp.where((pos >= b) & (pos < m - b), s, 0)
            out.append(_sum_rows(kept) / jnp.maximum(m - 2 * b, 1).astype(x.dtype))
        return out, state

    return combine


def _median_rows(stacked, state):
    finite = finite_rows(stacked)
    m = jnp.sum(finite, dtype=jnp.int32)
    return [_median(x, finite, m) for x in _promoted(stacked)], state


def _centered_clip_rows(radius: optax.ScalarOrSchedule, iterations: int) -> Callable[..., Any]:
    def combine(stacked, state):
        finite = finite_rows(stacked)
        m = jnp.sum(finite, dtype=jnp.int32)
        r = base.resolve(radius, state.count)
        rows = _promoted(stacked)
        center = jax.tree.leaves(state.center)
        v = [c.astype(x.dtype) for c, x in zip(center, rows)]
        for _ in range(iterations):
            diffs = [x - c[None] for x, c in zip(rows, v)]
            squares = sum(_row_squares(d) for d in diffs)  # (n,): over the whole tree
            norms = jnp.sqrt(jnp.where(finite, squares, 0))
            weights = jnp.where(finite, _clip_factors(norms, r), 0)
            v = [c + _weighted_mean(d, weights.astype(d.dtype), m) for c, d in zip(v, diffs)]
        new_center = jax.tree.unflatten(jax.tree.structure(state.center), v)
        return v, CenteredClipState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            center=optax.tree.cast_like(new_center, state.center),
        )

    return combine


def _norm_clipped_mean_rows(stacked, state):
    finite = finite_rows(stacked)
    m = jnp.sum(finite, dtype=jnp.int32)
    out = []
    for x in _promoted(stacked):
        norms = jnp.sqrt(jnp.where(finite, _row_squares(x), 0))
        limit = _median(norms, finite, m)
        weights = jnp.where(finite, _clip_factors(norms, limit), 0)
        out.append(_weighted_mean(x, weights, m))
    return out, state


# ----------------------------------------------------------------------------
# The transform around a rule.


def _worker_leaves(updates: Any, axis_name: base.AxisName, name: str) -> tuple[list[jax.Array], Any]:
    """The updates' leaves, checked to be each worker's own (not already summed over the axis) and real."""
    comm.require_axis(axis_name, name)
    try:
        updates = comm.per_worker_share(updates, axis_name, linear=False, caller=name)
    except comm.AlreadyReducedError as e:
        raise comm.AlreadyReducedError(f"{e} {_FIRST_IN_A_CHAIN}") from None
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
    for path, x in with_paths:
        if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
            raise TypeError(
                f"{name}: the updates must be real (the rule orders and compares values); leaf "
                f"{jax.tree_util.keystr(path) or '(root)'} is {jnp.result_type(x)}."
            )
    return [x for _, x in with_paths], treedef


def _gathered(
    name: str, axis_name: base.AxisName, init_fn: Callable[..., Any], combine: Callable[..., Any]
) -> optax.GradientTransformationExtraArgs:
    """The aggregate that all-gathers the updates and applies ``combine`` to the rows."""

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = _worker_leaves(updates, axis_name, name)
        if not leaves:
            return updates, state
        stacked = comm.all_gather(leaves, axis_name, caller=name)
        out, new_state = combine(stacked, state)
        return jax.tree.unflatten(treedef, [o.astype(x.dtype) for o, x in zip(out, leaves)]), new_state

    tx = comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), name)
    return base.declare_gathered(tx, combine, name)


def trimmed_mean(
    trim: int, *, axis_name: base.AxisName = base.DEFAULT_AXIS_NAME
) -> optax.GradientTransformationExtraArgs:
    r"""Coordinate-wise trimmed mean over the workers: drop the ``trim`` smallest and largest, average the rest.

    For each coordinate, with :math:`s_{(1)} \le \dots \le s_{(m)}` the values
    of the :math:`m` finite workers (see below),

    .. math::
      u = \frac{1}{m - 2b} \sum_{k=b+1}^{m-b} s_{(k)}, \qquad
      b = \min\big(\mathrm{trim}, \lfloor (m - 1) / 2 \rfloor\big),

    the same on every worker; zeros when :math:`m = 0`. A worker whose update
    holds a NaN or an infinity in any entry of any leaf is left out of the
    step (:math:`m` counts the others), so ``trim`` stands for workers that
    send finite but wrong values: up to ``trim`` of them, whatever they send,
    cannot move a coordinate outside the range of the honest workers' values.
    When exclusions leave fewer than ``2 trim + 1`` workers, :math:`b`
    shrinks so that at least one value (two for an even :math:`m`) is kept.
    ``trim=0`` is the mean over the finite workers.

    Chain it before a local optimizer to aggregate gradients,
    ``optax.chain(trimmed_mean(1), sgd(0.1, momentum=0.9))``, or use it as
    :func:`jaxopt_dist.diloco`'s ``aggregate`` (the pseudo-gradients).

    Args:
      trim: values dropped at each end, a Python int >= 0; the axis must
        have more than ``2 trim`` workers (checked when the update is
        traced). It is not a schedule: under :func:`optax.inject_hyperparams`
        pass it in ``static_args``.
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` with an empty state.

    Communication:
      One all-gather of the updates in their own dtypes (one per leaf, which
      the compiler may merge): for ``D`` bytes of updates each worker
      receives the other ``n - 1`` workers' ``(n - 1) D`` bytes and, in a
      ring, sends as many: ``n / 2`` times a ring all-reduce's ``2 (n - 1) /
      n * D``. The rule runs on every worker on the gathered values. Outputs
      are replicated. No state.

    Sharded parameters:
      Elementwise: on parameters sharded over model axes
      (``data_parallel_step(param_specs=...)``) each device gathers its own
      shard of a leaf from the other replicas (the bytes above, per replica);
      nothing crosses the model axes but the finiteness check (one boolean
      per worker and leaf).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.trimmed_mean(1)
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> grads = jnp.array([[1.0], [2.0], [3.0], [100.0]])  # 4 workers, one far off
      >>> jax.vmap(step, axis_name="data")(grads)[0]
      Array([2.5], dtype=float32)
      >>> grads = jnp.array([[1.0], [2.0], [jnp.nan], [100.0]])  # a NaN worker is left out
      >>> jax.vmap(step, axis_name="data")(grads)[0]
      Array([2.], dtype=float32)

    References:
      Yin, Chen, Ramchandran and Bartlett, `Byzantine-Robust Distributed
      Learning: Towards Optimal Statistical Rates
      <https://arxiv.org/abs/1803.01498>`_, 2018
    """
    trim = base.check_positive_int(trim, "trim", minimum=0)
    axis_name = base.validate_axis_name(axis_name)
    return _gathered("trimmed_mean", axis_name, optax.init_empty_state, _trimmed_mean_rows(trim))


def coordinate_median(
    *, axis_name: base.AxisName = base.DEFAULT_AXIS_NAME
) -> optax.GradientTransformationExtraArgs:
    r"""Coordinate-wise median over the workers.

    For each coordinate, the median of the values of the :math:`m` finite
    workers (an even :math:`m`: the mean of the two middle values, as
    :func:`numpy.median`), the same on every worker; zeros when :math:`m = 0`.
    A worker whose update holds a NaN or an infinity in any entry of any leaf
    is left out of the step. Fewer than half of the finite workers, whatever
    they send, cannot move a coordinate outside the range of the honest
    workers' values. The median is noisier than the mean (it uses the middle
    values only): expect a slower start than :func:`trimmed_mean` with the
    same workers, and more so when the workers' data differ.

    Args:
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` with an empty state.

    Communication:
      As :func:`trimmed_mean`: one all-gather of the updates, ``(n - 1) D``
      bytes per worker for ``D`` bytes of updates. Outputs are replicated.
      No state.

    Sharded parameters:
      Elementwise, as :func:`trimmed_mean`.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.coordinate_median()
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> grads = jnp.array([[1.0, 5.0], [2.0, -1.0], [100.0, 0.0]])  # 3 workers
      >>> jax.vmap(step, axis_name="data")(grads)[0]
      Array([2., 0.], dtype=float32)

    References:
      Yin, Chen, Ramchandran and Bartlett, `Byzantine-Robust Distributed
      Learning: Towards Optimal Statistical Rates
      <https://arxiv.org/abs/1803.01498>`_, 2018
    """
    axis_name = base.validate_axis_name(axis_name)
    return _gathered("coordinate_median", axis_name, optax.init_empty_state, _median_rows)


def centered_clip(
    radius: optax.ScalarOrSchedule,
    iterations: int = 1,
    *,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""Centered clipping: every update clipped to a ball around the previous aggregate, then averaged.

    The state holds :math:`v`, the previous step's output (zeros at ``init``).
    Each step starts from :math:`v_0 = v` and takes ``iterations`` = :math:`L`
    steps of

    .. math::
      v_{l+1} = v_l + \frac{1}{m} \sum_{i \text{ finite}} (u_i - v_l)
      \min\Big(1, \frac{\tau}{\lVert u_i - v_l \rVert}\Big),

    with :math:`\tau` = ``radius`` and :math:`\lVert \cdot \rVert` the L2 norm
    over the whole tree of worker :math:`i` (every leaf together; a zero norm
    gives the factor 1). The output is :math:`v_L`, which becomes the state,
    the same on every worker. A worker whose update holds a NaN or an
    infinity in any entry of any leaf is left out of the step (:math:`m`
    counts the others); with no finite worker the sum is empty and the
    output is the previous one, :math:`v`.

    A worker moves the output by at most :math:`\tau / m` per iteration
    whatever it sends, so a minority of bad workers is bounded by the radius;
    honest updates farther than :math:`\tau` from :math:`v` are shortened too.
    The paper applies it to worker momenta, whose spread shrinks with the
    momentum's averaging: chain it after a momentum,
    ``optax.chain(jd.scale_by_momentum(0.9), jd.centered_clip(1.0), jd.sgd(lr))``.
    As :func:`jaxopt_dist.diloco`'s ``aggregate`` it clips pseudo-gradients
    around the previous outer step's.

    Args:
      radius: :math:`\tau > 0`, a float or a schedule of the step count, in
        the units of the updates' norm.
      iterations: :math:`L`, a Python int >= 1 (the paper: 1 with momentum).
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`CenteredClipState`.

    Communication:
      As :func:`trimmed_mean`: one all-gather of the updates, ``(n - 1) D``
      bytes per worker for ``D`` bytes of updates, whatever ``iterations``.
      Outputs, ``count`` and ``center`` are replicated.

    Sharded parameters:
      The updates and the center are gathered and kept shard by shard, as
      :func:`trimmed_mean`; the norm of a worker's whole update sums its
      squares over the model axes (one float per worker and leaf crosses them).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.centered_clip(1.0)
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> grads = jnp.array([[0.5], [0.5], [10.0]])  # 3 workers; the third is cut to 1.0
      >>> jax.vmap(step, axis_name="data")(grads)[0]
      Array([0.6666667], dtype=float32)

    References:
      Karimireddy, He and Jaggi, `Learning from History for Byzantine Robust
      Optimization <https://arxiv.org/abs/2012.10333>`_, ICML 2021
    """
    base.check_hyperparameter(radius, "radius", lower=0.0, lower_open=True)
    iterations = base.check_positive_int(iterations, "iterations")
    axis_name = base.validate_axis_name(axis_name)

    def init_fn(params):
        # jnp.zeros, not zeros_like: the center is replicated even when init sees per-worker values.
        center = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params)
        return CenteredClipState(count=jnp.zeros([], jnp.int32), center=center)

    return _gathered("centered_clip", axis_name, init_fn, _centered_clip_rows(radius, iterations))


def norm_clipped_mean(
    *, axis_name: base.AxisName = base.DEFAULT_AXIS_NAME
) -> optax.GradientTransformationExtraArgs:
    r"""Mean of the workers' updates, each leaf's norm clipped to the median norm (Templar's Gauntlet).

    Per leaf, with :math:`c` the median over the :math:`m` finite workers of
    :math:`\lVert u_i \rVert` (the leaf's L2 norm; an even :math:`m`: the mean
    of the two middle norms),

    .. math::
      u = \frac{1}{m} \sum_{i \text{ finite}} u_i \min\Big(1, \frac{c}{\lVert u_i \rVert}\Big)

    (a zero norm: unchanged), the same on every worker; zeros when
    :math:`m = 0`. A worker whose update holds a NaN or an infinity in any
    entry of any leaf is left out of the step. A worker that scales its
    update up gains nothing past the median norm, so fewer than half of the
    finite workers cannot make a leaf longer than :math:`c`; unlike the
    trimmed mean and the median it does not discard a wrong direction: a
    bad worker still adds up to :math:`c / m` per leaf to the mean.

    Args:
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` with an empty state.

    Communication:
      As :func:`trimmed_mean`: one all-gather of the updates, ``(n - 1) D``
      bytes per worker for ``D`` bytes of updates. Outputs are replicated.
      No state.

    Sharded parameters:
      The updates are gathered shard by shard, as :func:`trimmed_mean`; a
      leaf's norm sums its squares over the model axes (one float per worker
      and leaf crosses them).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.norm_clipped_mean()
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> grads = jnp.array([[3.0, 4.0], [0.0, 1.0], [30.0, 40.0]])  # norms 5, 1, 50
      >>> jax.vmap(step, axis_name="data")(grads)[0]  # the third cut to norm 5
      Array([2., 3.], dtype=float32)

    References:
      Lidin et al, `Incentivizing Permissionless Distributed Learning of
      LLMs <https://arxiv.org/abs/2505.21684>`_, 2025
    """
    axis_name = base.validate_axis_name(axis_name)
    return _gathered("norm_clipped_mean", axis_name, optax.init_empty_state, _norm_clipped_mean_rows)
