r"""NoLoCo: local inner steps, then each worker averages with one small random group.

No all-reduce at all. Every worker keeps its own parameters :math:`\theta_i`,
its own anchor :math:`\phi_i` (the parameters after its last
synchronisation; never shared) and its own outer momentum :math:`m_i`. Every
``sync_every`` inner steps the workers are split into groups of
``group_size`` by a random permutation that every worker draws alike (the
step count seeds it: no data decides it); each worker then exchanges
parameters with its group only, through ``ppermute``, and takes a heavy-ball
outer step towards the group's mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

_PAYLOADS = ("params", "anchor_and_delta")
_FANOUT = 32  # branches per lax.switch level: XLA compiles very wide conditionals slowly


@base.reshard_rules(anchor=base.REGROUP, momentum=base.REGROUP)
class NoLoCoState(NamedTuple):
    """State for :func:`jaxopt_dist.noloco`.

    Attributes:
      count: int32[], inner steps taken (it decides when the workers
        synchronise and which groups they form); replicated.
      anchor: :math:`\\phi_i`, this worker's parameters after its last
        synchronisation (initially the parameters given to ``init``), like
        params; per-worker.
      momentum: :math:`m_i`, this worker's outer momentum, like params
        (initially zeros); per-worker.
      inner_state: the inner optimizer's state; per-worker (never reset).
    """

    count: jax.Array  # int32[], replicated
    anchor: optax.Params  # like params, per-worker
    momentum: optax.Updates  # like params, per-worker
    inner_state: optax.OptState  # per-worker


def noloco_groups(num_workers: int, *, group_size: int = 2, step: int) -> list[list[int]]:
    """The groups of :func:`noloco`'s synchronisation after inner step ``step``.

    As the reference draws them: ``perm =
    numpy.random.default_rng(step + 1).permutation(num_workers)``, and group
    ``g`` lists ``perm[j]`` for the positions ``j`` with ``j % (num_workers //
    group_size) == g``, in that order (the order the group's sums run in).
    ``step`` counts inner steps from 1; :func:`noloco` synchronises after the
    steps that are multiples of ``sync_every`` (see its ``num_permutations``
    for the steps whose draws it uses).

    Args:
      num_workers: ``W``, a multiple of ``group_size``.
      group_size: ``G`` (>= 1).
      step: the inner step count, from 1.

    Returns:
      ``W / G`` lists of ``G`` worker indices.

    Examples:
      >>> import jaxopt_dist as jd
      >>> jd.noloco_groups(4, group_size=2, step=50)
      [[1, 3], [2, 0]]
    """
    num_workers = base.check_positive_int(num_workers, "num_workers")
    group_size = base.check_positive_int(group_size, "group_size")
    step = base.check_positive_int(step, "step")
    _check_divides(num_workers, group_size)
    perm = np.random.default_rng(step + 1).permutation(num_workers)
    n = num_workers // group_size
    return [[int(perm[j]) for j in range(num_workers) if j % n == g] for g in range(n)]


def _check_divides(num_workers: int, group_size: int) -> None:
    if num_workers % group_size:
        raise ValueError(
            f"noloco: the number of workers ({num_workers}) must be a multiple of `group_size` "
            f"({group_size}); choose a group_size that divides it."
        )


class _Route(NamedTuple):
    """One compiled exchange: the permutes and each worker's rank in its group."""

    perms: tuple[tuple[tuple[int, int], ...], ...]  # permute k: rank r receives from rank (r + k) % G
    ranks: tuple[int, ...]  # worker i's position in its group (all 0 where the order cannot matter)


def _route(groups: list[list[int]], num_workers: int, group_size: int) -> _Route:
    ranks = [0] * num_workers
    perms = []
    for k in range(1, group_size):
        perms.append(
            tuple(sorted((g[(r + k) % group_size], g[r]) for g in groups for r in range(group_size)))
        )
    if group_size > 2:  # with two members the sum is the same either way round
        for g in groups:
            for r, i in enumerate(g):
                ranks[i] = r
    return _Route(tuple(perms), tuple(ranks))


@functools.lru_cache(maxsize=32)
def _plan(
    num_workers: int, group_size: int, sync_every: int, num_permutations: int
) -> tuple[tuple[_Route, ...], tuple[int, ...]]:
    """The distinct exchanges of syncs ``1..K`` and, for each sync, the index of its exchange."""
    routes: dict[_Route, int] = {}
    table = []
    for s in range(1, num_permutations + 1):
        groups = noloco_groups(num_workers, group_size=group_size, step=s * sync_every)
        table.append(routes.setdefault(_route(groups, num_workers, group_size), len(routes)))
    return tuple(routes), tuple(table)


def _switch(index: jax.Array, branches: Sequence[Callable[..., Any]], *operands: Any) -> Any:
    """``lax.switch`` nested ``_FANOUT`` branches wide (``index`` in range)."""
    if len(branches) == 1:
        return branches[0](*operands)
    if len(branches) <= _FANOUT:
        return jax.lax.switch(index, list(branches), *operands)
    size = _FANOUT
    while size * _FANOUT < len(branches):
        size *= _FANOUT
    outer = [
        functools.partial(
            lambda start, chunk, *ops: _switch(index - start, chunk, *ops), i, branches[i : i + size]
        )
        for i in range(0, len(branches), size)
    ]
    return jax.lax.switch(index // size, outer, *operands)


def _check_inner(tx: Any) -> optax.GradientTransformationExtraArgs:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"`inner` must be an optax.GradientTransformation; got {type(tx).__name__}.")
    return optax.with_extra_args_support(tx)


def _group_mean(values: list[Any], rank: jax.Array, group_size: int) -> Any:
    """``(1/G) sum`` over the group in its order: ``values[k]`` is from rank ``(rank + k) % G``."""
    own = values[0]
    if group_size <= 2:
        total = own if group_size == 1 else own + values[1]
    else:

        def member(q):  # the value of rank q
            k = (q - rank) % group_size
            out = own
            for j in range(1, group_size):
                out = jnp.where(k == j, values[j], out)
            return out

        total = member(0)
        for q in range(1, group_size):
            total = total + member(q)
    return total * jnp.asarray(np.float32(1.0 / group_size), own.dtype)


def _rounded(tree: Any, *, zero: jax.Array) -> Any:
    """``tree`` unchanged, but rounded to its dtype before any later use.

    A compiler may fuse a product and the sum that uses it into one FMA,
    which rounds once where the reference rounds twice (XLA's CPU backend
    does, and JAX 0.10 drops an ``optimization_barrier`` before that). Each
    leaf goes through its bits XOR ``zero``, a run-time zero the compiler
    cannot fold (from the step count), so no product reaches a sum unrounded.
    """

    def one(x):
        bits = jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}")
        raw = jax.lax.bitcast_convert_type(x, bits) ^ zero.astype(bits)
        return jax.lax.bitcast_convert_type(raw, x.dtype)

    return jax.tree.map(one, tree)


def noloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int = 50,
    outer_lr: optax.ScalarOrSchedule = 0.7,
    outer_momentum: optax.ScalarOrSchedule = 0.5,
    group_size: int = 2,
    num_permutations: int = 64,
    payload: str = "params",
    flatten: bool | None = None,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
) -> optax.GradientTransformationExtraArgs:
    r"""NoLoCo: local ``inner`` steps; every ``sync_every``, an outer step within a random group.

    Parameters are per-worker (``data_parallel_step(...,
    per_worker_params=True)``, as :func:`diloco`). On every step each worker
    applies ``inner`` (any optax chain; its state is never reset) to its own
    parameters :math:`\theta_i`. After the inner steps ``t`` (counted from 1)
    that are multiples of ``H = sync_every``, the workers form groups of
    ``G = group_size`` (:func:`noloco_groups`: ``numpy.random.default_rng(t +
    1).permutation(W)``, position ``j`` in group ``j mod (W / G)``, exactly as
    the reference code) and each worker :math:`i` of group :math:`g` steps

    .. math::
      a_g = \tfrac{1}{G} \sum_{j \in g} \phi_j, \quad
      d_g = \tfrac{1}{G} \sum_{j \in g} (\theta_j - \phi_j), \quad
      m_i \leftarrow \beta m_i + \alpha d_g + \alpha (a_g - \phi_i), \quad
      \phi_i \leftarrow \phi_i + m_i, \quad \theta_i \leftarrow \phi_i,

    with :math:`\phi_i` its anchor (initially the parameters given to
    ``init``, the same on every worker, then never shared), :math:`m_i` its
    outer momentum (initially 0), :math:`\alpha` = ``outer_lr`` and
    :math:`\beta` = ``outer_momentum`` (heavy ball, no look-ahead; the
    defaults 0.7 and 0.5 are those of the configurations users ran). The momentum is computed in
    the reference's float32 form, ``m += (beta - 1) m + alpha d + alpha (a -
    phi)``, and each group sum runs in the group's order (its first member's
    value first), times ``1/G``, so every member gets the same bits. Since
    :math:`a_g + d_g` is the group mean of :math:`\theta`, the default
    ``payload="params"`` sends only :math:`\theta` and steps with
    ``alpha * (mean(theta) - phi)`` (the same maths, other float32
    roundings); ``payload="anchor_and_delta"`` sends :math:`\phi` and
    :math:`\theta - \phi` as the reference does (twice the bytes) and
    reproduces its float32 numbers bit for bit (each product is rounded on
    its own, as PyTorch's separate kernels do: no fused multiply-add). Over
    all workers, the means of :math:`\phi` and :math:`m` move exactly as
    DiLoCo's anchor and heavy-ball momentum would; each worker only ever
    hears from its group.

    The groups: a permutation does not depend on data, but a ``ppermute``
    needs its pairs when the update is compiled. The permutations of syncs
    ``1 .. K`` (``K = num_permutations``) are drawn on the host when the
    update is traced; each distinct exchange becomes one branch of a
    ``lax.switch`` on the sync number (there are at most ``(W - 1)!!`` for
    pairs: 1, 3 and 105 for 2, 4 and 8 workers). Sync ``s > K`` reuses the
    groups of sync ``((s - 1) mod K) + 1``: runs of up to ``K H`` steps form
    exactly the reference's groups, and longer ones cycle through the same
    ``K`` draws (set ``K = total_steps // sync_every`` to follow the
    reference throughout; compile time grows with the number of distinct
    exchanges). The state holds only the step count, so a resumed run forms
    the same groups.

    ``sync_every``, ``group_size``, ``num_permutations`` and ``payload`` are
    static: under :func:`optax.inject_hyperparams` pass the first three in
    ``static_args``; ``outer_lr`` and ``outer_momentum`` may be injected
    (then ``beta - 1`` is taken in float32, not in Python's float64).

    Elastic resume (:func:`reshard_opt_state` with ``per_worker_params=True``,
    and :func:`reshard_params` for the parameters): anchors and momenta are
    regrouped like the parameters, new worker ``j`` taking the weighted mean
    of the old workers' rows. Their means over the workers, the part that
    moves as DiLoCo's anchor and momentum, are kept exactly; merging workers
    averages them as a synchronisation of that group would, splitting copies
    them. The groups of later syncs are drawn for the new number of workers.

    Under ``jax.vmap`` (one device simulating the workers) the step count is
    batched, so every step evaluates the synchronisation with every compiled
    exchange (vmap runs both sides of a data-dependent branch): keep
    ``num_permutations`` small there. ``shard_map`` and ``pmap`` run one.

    After a synchronisation a worker's parameters are within a rounding of
    its new anchor (the update is applied by addition, optax's contract;
    exact where :math:`\theta_i` is within a factor of two of it).

    Args:
      inner: the local optimizer, applied on every step.
      sync_every: ``H``, inner steps between synchronisations (>= 1).
      outer_lr: :math:`\alpha` (>= 0), a float or a schedule of the step count.
      outer_momentum: :math:`\beta` in [0, 1], a float or a schedule.
      group_size: ``G`` (>= 1); the number of workers must be a multiple of
        it (checked when the update is traced). ``G = 1``: no communication.
      num_permutations: ``K`` (>= 1), the reference's draws compiled in (see
        above).
      payload: ``"params"`` (one copy of the parameters per exchange) or
        ``"anchor_and_delta"`` (the reference's two, bit for bit).
      flatten: send all leaves of an exchange as one buffer (one message,
        bit-exact; what a latency-bound link wants) instead of one
        ``ppermute`` per leaf. None (default): as :func:`all_reduce`, packed
        on CPU across processes, per leaf elsewhere. With parameters sharded
        over model axes the buffer gathers each replica's leaves first: leave
        it off there.
      axis_name: the mapped axis (or tuple of axes, the workers numbered
        row-major over them) of the workers.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`NoLoCoState`; ``update`` needs ``params``.

    Communication:
      Only on the synchronisation steps (a ``lax.cond`` on the step count):
      ``G - 1`` ``ppermute``\ s, each moving every worker's parameters
      (:math:`\theta_i`, in their dtype) to one member of its group, so each
      worker sends and receives ``(G - 1)`` copies of the parameters (``2 (G -
      1)`` with ``payload="anchor_and_delta"``: :math:`\phi_i` and
      :math:`\theta_i - \phi_i`); one ``ppermute`` per leaf, or one per
      exchange with ``flatten``. No all-reduce, no all-gather, nothing
      crosses outside a group. Averaged over a period: ``(G - 1) / H`` of
      the parameter bytes per step. Output updates, ``anchor``, ``momentum``
      and ``inner_state`` are per-worker; ``count`` is replicated.

    Sharded parameters:
      Elementwise: anchors and momenta are sharded like the parameters, and
      each ``ppermute`` moves each device's shard to the device holding the
      same shard in the group member's replica; nothing crosses the model
      axes. With ``flatten=True`` the compiler first gathers each replica's
      leaves into the one buffer (whole leaves).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxopt_dist as jd
      >>> tx = jd.noloco(optax.sgd(1.0), sync_every=2)  # outer_lr 0.7, momentum 0.5
      >>> params = jnp.zeros((2, 1))                  # two workers' copies
      >>> def step(p, s, g):
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s
      >>> run = jax.vmap(step, axis_name="data")
      >>> s = jax.vmap(tx.init)(params)
      >>> params, s = run(params, s, jnp.array([[1.0], [3.0]]))   # local step
      >>> params, s = run(params, s, jnp.array([[1.0], [3.0]]))   # local step, then sync
      >>> params                                      # 0.7 * mean(theta - phi)
      Array([[-2.8],
             [-2.8]], dtype=float32)

    References:
      Kolehmainen et al, `NoLoCo: No-all-reduce Low Communication Training
      Method for Large Models <https://arxiv.org/abs/2506.10911>`_, 2025
    """
    axis_name = base.validate_axis_name(axis_name)
    inner = _check_inner(inner)
    sync_every = base.check_positive_int(sync_every, "sync_every")
    group_size = base.check_positive_int(group_size, "group_size")
    num_permutations = base.check_positive_int(num_permutations, "num_permutations")
    base.check_hyperparameter(outer_lr, "outer_lr", lower=0.0)
    base.check_hyperparameter(outer_momentum, "outer_momentum", lower=0.0, upper=1.0)
    if payload not in _PAYLOADS:
        raise ValueError(f"`payload` must be one of {_PAYLOADS}; got {payload!r}.")
    if flatten is not None:
        base.check_bool(flatten, "flatten")
    G = group_size

    def init_fn(params):
        return NoLoCoState(
            count=jnp.zeros([], jnp.int32),
            anchor=jax.tree.map(jnp.asarray, params),
            momentum=jax.tree.map(jnp.zeros_like, params),
            inner_state=inner.init(params),
        )

    def exchange(sync: jax.Array, sent: list[Any], num_workers: int) -> tuple[list[list[Any]], jax.Array]:
        """What this worker receives from each member of its group, and its rank there."""
        routes, table = _plan(num_workers, G, sync_every, num_permutations)
        slot = (sync - 1) % num_permutations

        packed = comm.flatten_by_default() if flatten is None else flatten

        def send(tree, perm):
            if not packed:
                return comm.ppermute(tree, axis_name, perm, caller="noloco")
            leaves, treedef = jax.tree.flatten(tree)
            return jax.tree.unflatten(treedef, comm.ppermute_packed(leaves, axis_name, perm, caller="noloco"))

        def branch(route):
            def run(tree):
                got = [send(tree, perm) for perm in route.perms]
                rank = jnp.asarray(np.asarray(route.ranks, np.int32))[comm.axis_index(axis_name)]
                return got, rank

            return run

        index = jnp.asarray(np.asarray(table, np.int32))[slot] if len(routes) > 1 else slot
        return _switch(index, [branch(r) for r in routes], comm.to_varying(sent, axis_name))

    def update_fn(updates, state, params=None, **extra_args):
        num_workers = comm.require_axis(axis_name, "noloco")
        _check_divides(num_workers, G)
        if params is None:
            raise ValueError(base.no_params_message("noloco"))
        count = state.count
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        p_leaves, treedef = jax.tree.flatten(params)
        alpha = base.resolve(outer_lr, count)
        beta = base.resolve(outer_momentum, count)
        beta_minus_one = beta - 1.0 if base.is_python_number(beta) else jnp.asarray(beta) - 1
        t = count + 1
        if payload == "anchor_and_delta":  # the reference's bits: every product rounded on its own
            fenced = functools.partial(_rounded, zero=count < 0)
        else:
            fenced = lambda tree: tree  # noqa: E731

        def keep(u, phi, m):
            return comm.to_varying((u, phi, m), axis_name)

        def sync(u, phi, m):
            x = [(p + v).astype(p.dtype) for p, v in zip(p_leaves, fenced(u))]  # theta after the inner step
            if payload == "params":
                got, rank = exchange(t // sync_every, x, num_workers)
                means = [_group_mean([x[i]] + [r[i] for r in got], rank, G) for i in range(len(x))]
            else:
                delta = [xi - ai for xi, ai in zip(x, phi)]
                got, rank = exchange(t // sync_every, [phi, delta], num_workers)
                means = [
                    fenced(
                        (
                            _group_mean([phi[i]] + [r[0][i] for r in got], rank, G),
                            _group_mean([delta[i]] + [r[1][i] for r in got], rank, G),
                        )
                    )
                    for i in range(len(x))
                ]
            new_u, new_phi, new_m = [], [], []
            for p, v, a, mi, mean in zip(p_leaves, u, phi, m, means):
                c1 = jnp.asarray(beta_minus_one, a.dtype)
                lr = jnp.asarray(alpha, a.dtype)
                if payload == "params":
                    step = c1 * mi + lr * (mean - a)
                else:
                    terms = fenced((c1 * mi, lr * mean[1], lr * (mean[0] - a)))
                    step = terms[0] + terms[1] + terms[2]
                mi = mi + step
                a = a + mi
                new_m.append(mi)
                new_phi.append(a)
                new_u.append((a - p).astype(v.dtype))
            return comm.to_varying((new_u, new_phi, new_m), axis_name)

        operands = (
            treedef.flatten_up_to(inner_updates),
            treedef.flatten_up_to(state.anchor),
            treedef.flatten_up_to(state.momentum),
        )
        u, phi, m = jax.lax.cond(t % sync_every == 0, sync, keep, *operands)
        new_state = NoLoCoState(
            count=jnp.asarray(optax.safe_increment(count)),
            anchor=jax.tree.unflatten(treedef, phi),
            momentum=jax.tree.unflatten(treedef, m),
            inner_state=inner_state,
        )
        return jax.tree.unflatten(treedef, u), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
