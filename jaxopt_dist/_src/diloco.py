r"""DiLoCo and Streaming DiLoCo: local inner steps, a periodic outer step on an anchor.

Every worker trains its own copy of the parameters with an ``inner``
optimizer; the state keeps the global *anchor* (the parameters of the last
synchronisation, the same on every worker). Every ``sync_every = H`` steps
the workers average their pseudo-gradients ``anchor - local``, an ``outer``
optimizer moves the anchor with that average, and every worker continues
from the new anchor. Streaming DiLoCo splits the parameters into fragments
that synchronise at staggered steps, optionally ``sync_delay`` steps after
their pseudo-gradient was taken (so the communication can overlap with
inner steps), and blends the new anchor with the local parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

_ASSIGNMENTS = ("strided", "contiguous")


@base.reshard_rules()
class DiLoCoState(NamedTuple):
    """State for :func:`jaxopt_dist.diloco`.

    Attributes:
      count: int32[], inner steps taken; replicated.
      anchor: the global parameters of the last synchronisation of each
        fragment, like params; replicated (per-worker under ``eager``).
      inner_state: the inner optimizer's state; per-worker (never reset).
      outer_states: one outer-optimizer state per fragment, over that
        fragment's leaves (a list); replicated (per-worker under ``eager``).
      aggregate_states: one ``aggregate`` state per fragment (compressor
        residuals are per-worker).
      pending: one list per fragment of the aggregated pseudo-gradient
        waiting ``sync_delay`` steps to be applied; replicated. Empty tuples
        when ``sync_delay=0`` without ``eager``. With ``eager=True``: the
        aggregate of the fragment's previous synchronisation.
      exchanged: one bool[] per fragment with ``overlap=True`` (else
        ``()``): whether ``pending`` holds the aggregate of ``outbox``
        (``False`` from a send until :func:`jaxopt_dist.overlapped_step`'s
        exchange, or the applying step itself, has run); replicated.
      outbox: one list per fragment with ``overlap`` or ``eager`` (else
        ``()``): the worker's own pseudo-gradient as last sent; per-worker.
      shares: one float32[] per fragment in the ``external`` state of an
        ``eager`` diloco (else ``()``): the island's weight over the sum of
        weights in the round that merged ``pending``, written by the island
        (:class:`jaxopt_dist.islands.Island`); the eager step scales the
        island's own fresh pseudo-gradient by it.

    ``GLOBAL_MODEL`` (a class attribute, not a field) names the field that
    holds the global model, replicated: what the Flax front ends evaluate.
    """

    GLOBAL_MODEL = "anchor"

    count: jax.Array  # int32[], replicated
    anchor: optax.Params  # like params, replicated
    inner_state: optax.OptState  # per-worker
    outer_states: tuple[optax.OptState, ...]  # one per fragment, replicated
    aggregate_states: tuple[optax.OptState, ...]  # one per fragment
    pending: tuple[Any, ...]  # one list of leaves per fragment, replicated; () entries if sync_delay=0
    exchanged: tuple[Any, ...] = ()  # bool[] per fragment with overlap, replicated
    outbox: tuple[Any, ...] = ()  # one list of leaves per fragment with overlap or eager, per-worker
    shares: tuple[Any, ...] = ()  # float32[] per fragment in an eager external state


def diloco_fragments(params: Any, num_fragments: int, *, assignment: str = "strided") -> list[list[int]]:
    """The fragments of :func:`diloco`: lists of leaf indices in ``jax.tree.leaves`` order.

    * ``"strided"`` (the default, as the Streaming DiLoCo paper, which found
      it slightly better than sequential fragments): leaf ``i`` belongs to
      fragment ``i mod F``, so each fragment spans the whole depth of the
      network and every synchronisation refreshes layers from input to
      output.
    * ``"contiguous"``: ``F`` runs of consecutive leaves of about equal
      element counts, which keeps the peak bytes of a synchronisation close
      to ``1 / F`` of the model's when leaf sizes differ a lot.

    Fragments are made of whole leaves (at least one each), so
    ``num_fragments`` is at most the number of leaves.
    """
    num_fragments = base.check_positive_int(num_fragments, "num_fragments")
    if assignment not in _ASSIGNMENTS:
        raise ValueError(f"`fragment_assignment` must be one of {_ASSIGNMENTS}; got {assignment!r}.")
    sizes = base.leaf_sizes(params)
    n = len(sizes)
    if num_fragments > n:
        raise ValueError(
            f"`num_fragments`={num_fragments} exceeds the number of parameter leaves ({n}); "
            "fragments are made of whole leaves."
        )
    if assignment == "strided":
        return [list(range(f, n, num_fragments)) for f in range(num_fragments)]
    cum = np.cumsum(sizes) / max(float(sum(sizes)), 1.0)
    groups, start = [], 0
    for f in range(num_fragments):
        end = n if f == num_fragments - 1 else int(np.searchsorted(cum, (f + 1) / num_fragments - 1e-12) + 1)
        end = min(max(end, start + 1), n - (num_fragments - 1 - f))
        groups.append(list(range(start, end)))
        start = end
    return groups


def _mean_aggregate(axis_name: base.AxisName) -> optax.GradientTransformationExtraArgs:
    """The default ``aggregate``: sum over workers, divided by their number."""

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return comm.reduce(updates, axis_name, reduction="mean", caller="diloco"), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _check_transform(tx: Any, name: str) -> optax.GradientTransformationExtraArgs:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"`{name}` must be an optax.GradientTransformation; got {type(tx).__name__}.")
    return optax.with_extra_args_support(tx)


def _schedule(sync_every: int, num_fragments: int, sync_delay: int) -> tuple[list[int], list[int]]:
    """(send phase, apply phase) of each fragment within a period of ``sync_every`` steps."""
    stride = sync_every // num_fragments
    apply = [(f + 1) * stride - 1 for f in range(num_fragments)]
    return [a - sync_delay for a in apply], apply


def _vma_matched_switch(index: jax.Array, branches: list[Any], operands: tuple, axis_name: Any) -> Any:
    """``lax.switch`` whose branches are cast to the same varying/invariant typing.

    A leaf that comes out per-worker from any branch (a compressor's
    residual, the local parameters) is marked per-worker in every branch, as
    ``shard_map(check_vma=True)`` requires of a switch.
    """
    varying = _branches_varying(branches, operands, axis_name)
    return jax.lax.switch(index, [_cast_varying(b, varying, axis_name) for b in branches], *operands)


def _branches_varying(branches: list[Any], operands: tuple, axis_name: Any) -> list[bool]:
    """Per output leaf: whether any of ``branches`` returns it per-worker (traced aside, not staged)."""
    record: list[list[bool]] = []
    for branch in branches:

        def probe(*ops, branch=branch):
            out = branch(*ops)
            record.append([comm.is_varying(x, axis_name) for x in jax.tree.leaves(out)])
            return out

        jax.make_jaxpr(probe)(*operands)
    return [any(col) for col in zip(*record)]


def _cast_varying(branch: Any, varying: list[bool], axis_name: Any) -> Any:
    def run(*ops):
        leaves, treedef = jax.tree.flatten(branch(*ops))
        leaves = [comm.to_varying(x, axis_name) if v else x for x, v in zip(leaves, varying)]
        return jax.tree.unflatten(treedef, leaves)

    return run


def _take(leaves: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    return [leaves[i] for i in idx]


def _put(items: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    return items[:index] + (value,) + items[index + 1 :]


class _Carry(NamedTuple):
    """What a synchronisation branch reads and writes: leaves in ``jax.tree.leaves`` order, per-fragment tuples."""

    x: list[Any]  # the local parameters
    a: list[Any]  # the anchor
    outer_s: tuple[Any, ...]
    agg_s: tuple[Any, ...]
    pend: tuple[Any, ...]
    exch: tuple[Any, ...]
    out: tuple[Any, ...]


def _local_only(c: _Carry) -> _Carry:
    return c


def _check_schedule(
    sync_every: int, num_fragments: int, sync_delay: int, *, overlap: bool, eager: bool
) -> None:
    if sync_every % num_fragments:
        raise ValueError(
            f"`sync_every` ({sync_every}) must be a multiple of `num_fragments` ({num_fragments})."
        )
    if sync_delay >= sync_every // num_fragments:
        raise ValueError(
            f"`sync_delay` must be < sync_every / num_fragments = {sync_every // num_fragments}; "
            f"got {sync_delay}."
        )
    if eager and sync_delay:
        raise ValueError(
            f"`eager=True` takes `sync_delay=0` (got {sync_delay}): its exchange already has a whole "
            "period, landing at the fragment's next synchronisation."
        )
    if overlap and not (sync_delay or eager):
        raise ValueError(
            "`overlap=True` needs something to overlap with: `sync_delay` >= 1 (the exchange runs during "
            "those inner steps) or `eager=True` (during the whole next period)."
        )


def _check_eager_aggregate(aggregate: Any, eager: bool) -> None:
    """``eager`` replaces a worker's share of the aggregate by its fresh pseudo-gradient: not for a robust rule."""
    rule = base.gathered_of(aggregate)
    if eager and rule is not None:
        raise ValueError(
            f"`eager=True` does not take `aggregate={rule.name}(...)`: the eager step adds each worker's own "
            "fresh pseudo-gradient to its anchor in place of its share of a mean, and a robust rule over the "
            "workers' whole contributions has no share to replace (the worker's own values would pass "
            "unscreened). To overlap the exchange with inner steps use `sync_delay` >= 1 with `overlap=True`."
        )


def _own_contribution(mean: Callable[..., Any]) -> Callable[..., tuple[list[Any], Any]]:
    """``OuterExchange.run_first`` for a robust rule: the worker's own pseudo-gradient (the mean over its
    one worker, replicated like the rule's result), the aggregate state unchanged (the rule's runner
    updates it)."""

    def run(f, pseudo, agg_state_f, anchor_f):
        values, _ = mean(f, pseudo, optax.EmptyState(), anchor_f)  # the mean keeps no state
        return values, agg_state_f

    return run


def _finishing(second: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """``OuterExchange.finish`` for an aggregate's second stage ``second(leaves, state)``."""

    def finish(f, mean, agg_state_f):
        del f
        return [m.astype(x.dtype) for m, x in zip(second(list(mean), agg_state_f), mean)]

    return finish


@dataclasses.dataclass(frozen=True)
class OuterExchange:
    """The exchanges of a ``diloco(..., overlap=True)``, for :func:`jaxopt_dist.overlapped_step`.

    Attributes:
      sync_every: ``H``.
      launch_phase: per fragment, the phase ``t % H`` of the step after which
        its exchange can start (its pseudo-gradient is in ``pending``).
      land_phase: per fragment, the phase of the step that reads the result.
      fragments: ``params -> list of leaf-index lists`` (:func:`diloco_fragments`).
      run: ``(f, pending_f, aggregate_state_f, anchor_f) -> (aggregate_f,
        aggregate_state_f)``, per worker, inside a mapping of ``axis_name``:
        the same ``aggregate`` call the step would make itself.
      axis_name: the workers' axis.
      trusting: the same transformation without the applying step's own
        exchange of a fragment nobody exchanged (it reads ``pending`` as
        it is): for a runner that always exchanges first, so that no
        collective sits inside the step's ``lax.switch`` (which would keep
        GPU compilers from overlapping the runner's fused exchange with
        the step's compute).
      land: for ``sync_delay=0`` in a :class:`DiLoCoTransformation`'s
        ``external`` exchange only (else None): ``(f, params, state, aggregate_f) -> (params,
        state)``, per worker, the outer step of fragment ``f`` that the
        ``trusting`` step leaves undone (its synchronising step only sends),
        for a runner that exchanges between that step and the next.
      run_first: as ``run``, with the ``aggregate``'s first stage only when it
        has a second (a re-quantization of the mean, e.g.
        :func:`jaxopt_dist.low_bit`): for a runner that takes the mean itself
        (islands, over a transport) and then applies ``finish``.
      finish: ``(f, mean_f, aggregate_state_f) -> aggregate_f``: the
        ``aggregate``'s second stage on such a mean (``aggregate_state_f``
        before the step), without communication; None when it has none.
      eager: whether the diloco is ``eager`` (per-worker anchors; in the
        ``external`` state the runner writes each fragment's ``shares``).
      wire: the :class:`jaxopt_dist._src.base.Wire` of ``run_first``'s
        aggregate (its message encoded and decoded without communication),
        or None: for a runner that sends each worker's message itself.
      gathered: the :class:`jaxopt_dist._src.base.GatheredRule` of the
        ``aggregate`` (a robust rule over every worker's whole contribution),
        or None. Then ``run_first`` gives the worker's own pseudo-gradient
        (its mean over a workers' axis of size 1) and the aggregate state
        unchanged, and a runner that gathers the workers' contributions
        applies the rule's ``combine`` to them itself.
    """

    sync_every: int
    launch_phase: tuple[int, ...]
    land_phase: tuple[int, ...]
    fragments: Callable[[Any], list[list[int]]]
    run: Callable[..., tuple[list[Any], Any]]
    axis_name: base.AxisName
    trusting: Any = None
    land: Callable[..., tuple[Any, Any]] | None = None
    run_first: Callable[..., tuple[list[Any], Any]] | None = None
    finish: Callable[..., list[Any]] | None = None
    eager: bool = False
    wire: base.Wire | None = None
    gathered: base.GatheredRule | None = None

    def launches_after(self, step: int) -> list[int]:
        """The fragments whose exchange can start once inner step ``step`` (0-based) is done."""
        return [f for f, p in enumerate(self.launch_phase) if step % self.sync_every == p]

    def lands_at(self, step: int) -> list[int]:
        """The fragments whose exchanged aggregate inner step ``step`` reads."""
        return [f for f, p in enumerate(self.land_phase) if step % self.sync_every == p]

    def find(self, opt_state: Any) -> DiLoCoState:
        """The one :class:`DiLoCoState` in ``opt_state`` (a chain's state may hold it anywhere)."""
        found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_diloco_state) if _is_diloco_state(x)]
        if len(found) != 1 or not found[0].exchanged:
            raise ValueError(
                "overlapped_step needs exactly one DiLoCoState made with `overlap=True` in the optimizer "
                f"state; found {len(found)} DiLoCo state(s)"
                + ("" if len(found) != 1 else " without `overlap=True`")
                + "."
            )
        return found[0]

    @staticmethod
    def replace(opt_state: Any, new: DiLoCoState) -> Any:
        """``opt_state`` with its :class:`DiLoCoState` replaced by ``new``."""
        return jax.tree.map(lambda x: new if _is_diloco_state(x) else x, opt_state, is_leaf=_is_diloco_state)


def _is_diloco_state(x: Any) -> bool:
    return isinstance(x, DiLoCoState)


class DiLoCoTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`diloco` returns: an optax transformation, with ``exchange`` (an
    :class:`OuterExchange` under ``overlap=True``, else None) and ``external``.

    ``external`` is an :class:`OuterExchange` for every configuration: its
    ``trusting`` transformation never exchanges by itself (every fragment's
    pseudo-gradient goes to the state's outbox, and the applying step reads
    ``pending`` as a runner left it; with ``sync_delay=0`` the synchronising
    step only sends and the runner lands the fragment with ``land``). It is
    what carries the outer exchange between separately launched jobs
    (:class:`jaxopt_dist.islands.Island`); its state is that of
    ``overlap=True``, with ``shares`` under ``eager``.
    """

    exchange: OuterExchange | None = None
    external: OuterExchange | None = None


def diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    outer: optax.GradientTransformation | None = None,
    aggregate: optax.GradientTransformation | None = None,
    num_fragments: int = 1,
    sync_delay: int = 0,
    mixing: optax.ScalarOrSchedule = 0.0,
    fragment_assignment: str = "strided",
    overlap: bool = False,
    eager: bool = False,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> DiLoCoTransformation:
    r"""DiLoCo (and Streaming DiLoCo): local ``inner`` steps, an ``outer`` step every ``sync_every``.

    Parameters are per-worker (``data_parallel_step(...,
    per_worker_params=True)``). On every step each worker applies ``inner``
    (any optax chain, typically AdamW; its state is never reset) to its own
    parameters :math:`x_i`. With one fragment, after the steps ``t`` with
    ``t % H == H - 1`` (``H = sync_every``):

    .. math::
      \Delta = \operatorname{aggregate}_i(a - x_i), \qquad
      a \leftarrow a + \operatorname{outer}(\Delta), \qquad
      x_i \leftarrow (1 - \alpha)\, a + \alpha\, x_i,

    with :math:`a` the anchor held in the state (initially the parameters
    given to ``init``) and :math:`\alpha` = ``mixing`` (0: every worker takes
    the new anchor). ``aggregate`` defaults to the mean over workers (sum,
    then division by their number); any compressor of this library may
    stand there (:func:`low_bit`, :func:`top_k`, :func:`powersgd`...), with
    its residual kept per fragment in the state, and so may a robust rule
    (:func:`trimmed_mean`, :func:`coordinate_median`, :func:`centered_clip`,
    :func:`norm_clipped_mean`: a worker whose pseudo-gradient is not finite
    is left out of that synchronisation; not with ``eager``). ``outer`` defaults to
    Nesterov SGD with learning rate 0.7 and momentum 0.9 (the paper's).

    Streaming DiLoCo (``num_fragments = F``, ``H % F == 0``): the leaves are
    split into ``F`` fragments (:func:`diloco_fragments`; strided by
    default). Fragment ``f`` is applied after the steps with
    ``t % H == (f + 1) H / F - 1``, each fragment with its own outer state
    (its momentum advances only at its own synchronisation) and its own
    ``aggregate`` state. With ``sync_delay = tau`` (``< H / F``) the
    pseudo-gradient is taken (and communicated) after step
    ``t_apply - tau``, the workers keep taking inner steps, and the outer
    step lands at ``t_apply``; :math:`x_i` in the blend then includes those
    ``tau`` steps (dropped at :math:`\alpha = 0`). The anchor is never
    blended.

    ``overlap=True`` (with ``sync_delay >= 1`` or ``eager``) keeps the
    numbers (to float32 rounding: see the low-communication guide) and moves
    the bytes off the step that takes the pseudo-gradient:
    that step only stores the worker's own value in the state's ``outbox``,
    and the exchange (``aggregate``) runs later, either beside the next
    inner steps, run by :func:`overlapped_step` (on a mesh of its own, or
    inside the next step's program), or, where nothing ran it, inside the
    step that applies it. The sum on the clock is then the slower of the
    wire and those steps' compute instead of both.

    ``eager=True`` (Kale, Douillard and Donchev 2025, one outer step of
    overlap): the exchange of a synchronisation's pseudo-gradients has until
    the fragment's next synchronisation, a whole period; meanwhile each
    worker steps its outer optimizer with its own fresh pseudo-gradient in
    place of its stale share,

    .. math::
      D_i(t) = \Delta(t-1) + \tfrac{1}{M}\big(\Delta_i(t) - \Delta_i(t-1)\big),

    with :math:`\Delta(t-1)` the aggregate of the previous
    synchronisation's :math:`\Delta_i(t-1)` (zero before the first) and
    ``M`` the number of workers. :math:`1/M` is worker ``i``'s share of that
    aggregate: an aggregate that weighs its workers
    (:func:`jaxopt_dist.islands.weighted_mean`) gives it as
    :math:`w_i / \sum_j w_j` of the previous round, and across islands it is
    the island's weight in the round that merged :math:`\Delta(t-1)` (0
    for an island that healed in it). The replicas then differ slightly: anchors
    and outer states are per-worker. The paper's algorithm box could not be
    read; this is the rule its text and tables state (its "eager" row),
    not the naive delayed variant that applies :math:`\Delta(t-1)` alone.
    Works with fragments; ``sync_delay`` must be 0.

    ``sync_every``, ``num_fragments`` and ``sync_delay`` set the control
    flow: under :func:`optax.inject_hyperparams` pass them in
    ``static_args``; ``mixing`` may be injected.

    The update returned moves each worker's parameters to the new values;
    it is applied by addition (optax's contract), so after a
    synchronisation a worker's parameters are within a rounding of the new
    anchor (exact where ``x_i`` is within a factor of two of it).

    Args:
      inner: the local optimizer, applied on every step.
      sync_every: ``H``, steps per period (>= 1).
      outer: the outer optimizer, applied to the aggregated pseudo-gradient
        of a fragment's leaves (a list); default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      aggregate: how pseudo-gradients are combined over workers; it must
        return the same value on every worker. Default: the mean (one worker's
        NaN makes the anchor NaN; a robust rule leaves that worker out).
      num_fragments: ``F`` (>= 1, divides ``H``, at most the number of leaves).
      sync_delay: ``tau`` (0 <= tau < H / F).
      mixing: ``alpha`` in [0, 1], a float or a schedule of the step count.
      fragment_assignment: ``"strided"`` or ``"contiguous"``
        (see :func:`diloco_fragments`).
      overlap: leave each exchange to :func:`overlapped_step` (or to the
        applying step); needs ``sync_delay >= 1`` or ``eager``. The returned
        transformation's ``exchange`` (an :class:`OuterExchange`) tells the
        runner when.
      eager: eager updates (above): per-worker outer steps, each exchange
        landing one period late.
      axis_name: the mapped axis (or tuple of axes) of the workers.

    Returns:
      A :class:`DiLoCoTransformation` (an
      :class:`optax.GradientTransformationExtraArgs`) whose state is a
      :class:`DiLoCoState`; ``update`` needs ``params``.

    Communication:
      Only on the steps a fragment's pseudo-gradient is taken
      (``t % H == (f + 1) H / F - 1 - tau``): what ``aggregate`` sends for
      that fragment's leaves (the mean: one all-reduce). Nothing on other
      steps (a ``lax.switch`` on the step count). Averaged over a period, a
      worker sends ``1 / H`` of what ``aggregate`` sends for the whole model
      per step; the peak step sends one fragment's share (see
      :attr:`CommunicationCost.peak_sent_bytes`). Output updates and
      ``inner_state`` are per-worker; ``count``, ``anchor``,
      ``outer_states`` and ``pending`` are replicated (``anchor`` and
      ``outer_states`` per-worker under ``eager``). Under ``overlap`` the
      step itself sends a fragment's bytes only where no runner exchanged
      it, on its applying step (which is where :func:`communication_cost`
      counts them; price an overlapped schedule from the ``overlap=False``
      cost with :func:`project_step_time`'s ``overlap_steps``: ``tau``, or
      ``H`` under ``eager``). ``eager`` sends what DiLoCo sends, at the same
      steps.

    Sharded parameters:
      Elementwise in its own arithmetic: the anchor, the pending
      pseudo-gradients and the optimizers' moments are sharded like the
      parameters, fragments are whole leaves, and the default mean all-reduces
      each device's shard over the data axis (per worker). An ``aggregate``
      that needs whole leaves (:func:`low_bit`, :func:`powersgd`,
      :func:`top_k`) behaves as its own docstring says.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = jd.diloco(optax.sgd(1.0), sync_every=2, outer=optax.sgd(1.0))
      >>> params = jnp.zeros((2, 1))                  # two workers' copies
      >>> def step(p, s, g):
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s
      >>> run = jax.vmap(step, axis_name="data")
      >>> s = jax.vmap(tx.init)(params)
      >>> params, s = run(params, s, jnp.array([[1.0], [3.0]]))   # local step
      >>> params, s = run(params, s, jnp.array([[1.0], [3.0]]))   # local step, then sync
      >>> params
      Array([[-4.],
             [-4.]], dtype=float32)

    References:
      Douillard et al, `DiLoCo: Distributed Low-Communication Training of
      Language Models <https://arxiv.org/abs/2311.08455>`_, 2023;
      Douillard et al, `Streaming DiLoCo with overlapping communication
      <https://arxiv.org/abs/2501.18512>`_, 2025
    """
    axis_name = base.validate_axis_name(axis_name)
    inner = _check_transform(inner, "inner")
    outer = _check_transform(optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer, "outer")
    aggregate = _mean_aggregate(axis_name) if aggregate is None else _check_transform(aggregate, "aggregate")
    sync_every = base.check_positive_int(sync_every, "sync_every")
    num_fragments = base.check_positive_int(num_fragments, "num_fragments")
    sync_delay = base.check_positive_int(sync_delay, "sync_delay", minimum=0)
    _check_schedule(sync_every, num_fragments, sync_delay, overlap=overlap, eager=eager)
    _check_eager_aggregate(aggregate, eager)
    base.check_hyperparameter(mixing, "mixing", lower=0.0, upper=1.0)
    if fragment_assignment not in _ASSIGNMENTS:
        raise ValueError(f"`fragment_assignment` must be one of {_ASSIGNMENTS}; got {fragment_assignment!r}.")
    no_mixing = base.is_constant(mixing, 0.0)
    send_at, apply_at = _schedule(sync_every, num_fragments, sync_delay)
    keeps_pending = bool(sync_delay) or eager

    def fragments(params):
        return diloco_fragments(params, num_fragments, assignment=fragment_assignment)

    def make_init(with_outbox: bool, with_shares: bool = False):
        def init_fn(params):
            leaves = jax.tree.leaves(params)
            pieces = [_take(leaves, g) for g in fragments(params)]

            def zeros(flag):
                return tuple([jnp.zeros_like(x) for x in p] if flag else () for p in pieces)

            return DiLoCoState(
                count=jnp.zeros([], jnp.int32),
                anchor=jax.tree.map(jnp.asarray, params),
                inner_state=inner.init(params),
                outer_states=tuple(outer.init(p) for p in pieces),
                aggregate_states=tuple(aggregate.init(p) for p in pieces),
                pending=zeros(keeps_pending),
                exchanged=tuple(jnp.ones([], bool) for _ in pieces) if with_outbox else (),
                outbox=zeros(True) if with_outbox or eager else (),
                shares=tuple(jnp.zeros([], jnp.float32) for _ in pieces) if with_shares else (),
            )

        return init_fn

    def exchange_with(agg):
        def run(f, pseudo, agg_state_f, anchor_f):
            """The aggregate of one fragment's pseudo-gradients: (leaves, new aggregate state)."""
            mean, new_agg = agg.update(list(pseudo), agg_state_f, list(anchor_f))
            return [m.astype(p.dtype) for m, p in zip(jax.tree.leaves(mean), pseudo)], new_agg

        return run

    exchange = exchange_with(aggregate)
    stages = base.two_stage_of(aggregate)
    gathered = base.gathered_of(aggregate)
    own = _own_contribution(exchange_with(_mean_aggregate(axis_name)))

    finish = None if stages is None else _finishing(stages.second)
    share_fn = base.share_of(aggregate)

    def land(f, delta, c, groups, alpha, outer_states):
        """``c`` after fragment ``f``'s outer step with the aggregate ``delta`` (the blend with ``alpha``)."""
        anchor_f = _take(c.a, groups[f])
        step, new_outer = outer.update(delta, c.outer_s[f], anchor_f)
        step = jax.tree.leaves(step)
        x, a = list(c.x), list(c.a)
        for j, i in enumerate(groups[f]):
            a[i] = (anchor_f[j] + step[j]).astype(anchor_f[j].dtype)
            x[i] = a[i] if alpha is None else ((1 - alpha) * a[i] + alpha * x[i]).astype(a[i].dtype)
        new_outer = optax.tree.cast_like(new_outer, outer_states[f])
        return c._replace(x=x, a=a, outer_s=_put(c.outer_s, f, new_outer))

    def carry(local, state, treedef):
        return _Carry(
            x=treedef.flatten_up_to(local),
            a=treedef.flatten_up_to(state.anchor),
            outer_s=state.outer_states,
            agg_s=state.aggregate_states,
            pend=state.pending,
            exch=state.exchanged,
            out=state.outbox,
        )

    def make_update(
        with_outbox: bool, fallback: bool, split: bool = False, with_shares: bool = False, run: Any = None
    ):
        """``update``. ``with_outbox``: the state of ``overlap=True`` (sends go to the outbox);
        ``fallback=False``: the applying step trusts that the exchange has run (``overlapped_step``'s
        fused mode, which then sees no collective inside the switch, and external runners);
        ``split``: with ``sync_delay=0``, the synchronising step only sends (a runner lands);
        ``with_shares``: the eager step reads the worker's share from the state (islands);
        ``run``: the exchange the step would make (default: the ``aggregate``'s)."""
        run = exchange if run is None else run

        def update_fn(updates, state, params=None, **extra_args):
            num_workers = comm.require_axis(axis_name, "diloco")
            if params is None:
                raise ValueError(base.no_params_message("diloco"))
            count = state.count
            inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
            local = optax.apply_updates(params, inner_updates)
            p_leaves, treedef = jax.tree.flatten(params)
            groups = fragments(params)
            alpha = None if no_mixing else base.resolve(mixing, count)
            operands = carry(local, state, treedef)

            def communicate(f, pseudo, c):
                delta, new_agg = run(f, pseudo, c.agg_s[f], _take(c.a, groups[f]))
                new_agg = optax.tree.cast_like(new_agg, state.aggregate_states[f])
                return delta, c._replace(agg_s=_put(c.agg_s, f, new_agg))

            def resolve(f, c):
                """The aggregate waiting in ``pend[f]``, exchanging it here if nobody has."""
                if not with_outbox:
                    return list(c.pend[f]), c

                def done(c):
                    return list(c.pend[f]), c

                def here(c):
                    return communicate(f, c.out[f], c)

                if not fallback:  # typed as the fallback would type it, without staging its exchange
                    return _cast_varying(done, _branches_varying([done, here], (c,), axis_name), axis_name)(c)
                return _vma_matched_switch(jnp.where(c.exch[f], 0, 1), [done, here], (c,), axis_name)

            def landed(f, delta, c):
                return land(f, delta, c, groups, alpha, state.outer_states)

            def send_or_keep(f, pseudo, c):
                """Stores the fragment's outgoing pseudo-gradient; exchanges it here unless ``with_outbox``."""
                if with_outbox or eager:
                    c = c._replace(out=_put(c.out, f, comm.to_varying(list(pseudo), axis_name)))
                if with_outbox:
                    return c._replace(exch=_put(c.exch, f, jnp.zeros([], bool)))
                delta, c = communicate(f, pseudo, c)
                return c._replace(pend=_put(c.pend, f, delta))

            def pseudo_of(f, c):
                return [(c.a[i] - c.x[i]).astype(c.a[i].dtype) for i in groups[f]]

            def sync(f):
                def branch(c):
                    delta, c = communicate(f, pseudo_of(f, c), c)
                    return landed(f, delta, c)

                return branch

            def send(f):
                return lambda c: send_or_keep(f, pseudo_of(f, c), c)

            def apply(f):
                def branch(c):
                    delta, c = resolve(f, c)
                    return landed(f, delta, c)

                return branch

            def eager_delta(f, previous_mean, own, c):
                """``Delta(t-1) + s_i (Delta_i(t) - Delta_i(t-1))``; ``s_i = 1 / workers`` for the mean."""
                if with_shares:  # across islands: the island's own, kept in its state
                    share = state.shares[f]
                elif share_fn is not None:  # an aggregate that declares its workers' shares
                    share = share_fn(c.agg_s[f])
                else:
                    share = None

                def fresh(o, p):  # the mean's own division, so that its numbers stay bit for bit
                    return (o - p) / num_workers if share is None else share * (o - p)

                return [(m + fresh(o, p)).astype(o.dtype) for m, o, p in zip(previous_mean, own, c.out[f])]

            def eager_sync(f):
                def branch(c):
                    own = pseudo_of(f, c)
                    previous_mean, c = resolve(f, c)
                    delta = eager_delta(f, previous_mean, own, c)
                    return send_or_keep(f, own, landed(f, delta, c))

                return branch

            phase = count % sync_every
            index = jnp.zeros([], jnp.int32)
            if eager or sync_delay == 0:
                make = eager_sync if eager else (send if split else sync)
                branches = [_local_only] + [make(f) for f in range(num_fragments)]
                for f in range(num_fragments):
                    index = jnp.where(phase == apply_at[f], f + 1, index)
            else:
                branches = (
                    [_local_only]
                    + [send(f) for f in range(num_fragments)]
                    + [apply(f) for f in range(num_fragments)]
                )
                for f in range(num_fragments):
                    index = jnp.where(phase == send_at[f], 1 + f, index)
                    index = jnp.where(phase == apply_at[f], 1 + num_fragments + f, index)
            c = _vma_matched_switch(index, branches, (operands,), axis_name)
            new_params = comm.to_varying(c.x, axis_name)
            u_leaves = treedef.flatten_up_to(updates)
            out = [(n - p).astype(u.dtype) for n, p, u in zip(new_params, p_leaves, u_leaves)]
            new_state = DiLoCoState(
                count=jnp.asarray(optax.safe_increment(count)),
                anchor=jax.tree.unflatten(treedef, c.a),
                inner_state=inner_state,
                outer_states=c.outer_s,
                aggregate_states=c.agg_s,
                pending=c.pend,
                exchanged=c.exch,
                outbox=c.out,
                shares=state.shares,
            )
            return jax.tree.unflatten(treedef, out), new_state

        return update_fn

    def land_after_send(f, params, state, delta):
        """The outer step of fragment ``f`` that a ``split`` step left undone (``sync_delay=0``)."""
        treedef = jax.tree.structure(params)
        alpha = None if no_mixing else base.resolve(mixing, state.count - 1)
        c = land(f, list(delta), carry(params, state, treedef), fragments(params), alpha, state.outer_states)
        new_state = state._replace(
            anchor=jax.tree.unflatten(treedef, c.a),
            outer_states=c.outer_s,
            exchanged=_put(c.exch, f, jnp.ones([], bool)),
        )
        return jax.tree.unflatten(treedef, c.x), new_state

    # What a runner that merges the workers itself runs per worker: a robust rule's worker sends its own
    # pseudo-gradient; a two-stage aggregate's, the first stage.
    first = own if gathered is not None else exchange if stages is None else exchange_with(stages.first)

    def outer_exchange(trusting, with_land):
        launch = apply_at if eager else send_at
        return OuterExchange(
            sync_every=sync_every,
            launch_phase=tuple(launch),
            land_phase=tuple(apply_at),
            fragments=fragments,
            run=exchange,
            axis_name=axis_name,
            trusting=trusting,
            land=land_after_send if with_land else None,
            run_first=first,
            finish=finish,
            eager=eager,
            wire=base.wire_of(aggregate if stages is None else stages.first),
            gathered=gathered,
        )

    tx = DiLoCoTransformation(make_init(overlap), make_update(overlap, fallback=True))
    if overlap:
        tx.exchange = outer_exchange(DiLoCoTransformation(make_init(True), make_update(True, False)), False)
    split = sync_delay == 0 and not eager
    # A robust rule across islands runs over the gathered contributions, not inside an island's step
    # (whose workers' axis has one worker): that step, never exchanging, is typed with the island's own.
    external_run = own if gathered is not None else None
    external = DiLoCoTransformation(
        make_init(True, with_shares=eager),
        make_update(True, fallback=False, split=split, with_shares=eager, run=external_run),
    )
    tx.external = outer_exchange(external, split)
    return tx
