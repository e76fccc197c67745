r"""Decentralized (gossip) SGD: mixing parameters with neighbours over a topology.

After the local step every worker averages its parameters with its
neighbours' through a doubly stochastic mixing matrix :math:`W`,

.. math::
  x_i \leftarrow \sum_j W_{ij} (p_j + u_j),

using only ``ppermute``\ s (no all-reduce), as mlbench's ``DecentralizedSGD``
does with explicit neighbour lists. :func:`mixing_matrix` returns the
:math:`W` of a topology, so its spectral gap can be inspected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

_TOPOLOGIES = ("ring", "torus", "exponential", "complete")
_WEIGHTS = ("uniform", "metropolis")
_TOL = 1e-6


# ----------------------------------------------------------------------------
# Topologies and mixing matrices (NumPy, static).


def _check_topology(topology: Any) -> str | tuple[tuple[tuple[int, int], ...], ...]:
    """Validates ``topology`` at factory time; permutations come back as tuples."""
    if isinstance(topology, str):
        if topology not in _TOPOLOGIES:
            raise ValueError(
                f"`topology` must be one of {_TOPOLOGIES} or a list of permutations; got {topology!r}."
            )
        return topology
    if not isinstance(topology, Sequence) or not topology:
        raise TypeError(
            "`topology` must be a name such as 'ring' or a non-empty list of permutations, each a "
            f"list of (source, destination) pairs; got {topology!r}."
        )
    perms = []
    size = None
    for perm in topology:
        try:
            pairs = tuple((int(s), int(d)) for s, d in perm)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`topology` permutations must be lists of (source, destination) int pairs; got {perm!r}."
            ) from e
        if size is None:
            size = len(pairs)
        if len(pairs) != size:
            raise ValueError(f"`topology` permutations must all cover the same workers; got {topology!r}.")
        comm.check_permutation(pairs, size)
        perms.append(pairs)
    return tuple(perms)


def _check_shape(shape: Any) -> tuple[int, int] | None:
    if shape is None:
        return None
    if not isinstance(shape, Sequence) or len(shape) != 2:
        raise TypeError(f"`shape` must be a pair (rows, cols) of ints; got {shape!r}.")
    return (base.check_positive_int(shape[0], "shape[0]"), base.check_positive_int(shape[1], "shape[1]"))


def _torus_shape(n: int, shape: tuple[int, int] | None) -> tuple[int, int]:
    if shape is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        return rows, n // rows
    if shape[0] * shape[1] != n:
        raise ValueError(f"The torus `shape` {shape} must multiply to the number of workers, {n}.")
    return shape


def _num_rounds(topology: Any, n: int) -> int:
    """Number of distinct mixing matrices a topology cycles through."""
    if topology == "exponential" and n > 1:
        return (n - 1).bit_length()  # ceil(log2 n)
    return 1


def _sources(topology: Any, n: int, shape: tuple[int, int] | None, step: int) -> list[np.ndarray]:
    """Candidate permutations as arrays ``src`` (worker ``i`` receives from ``src[i]``)."""
    i = np.arange(n)
    if topology == "ring":
        return [(i - 1) % n, (i + 1) % n]
    if topology == "complete":
        return [(i - k) % n for k in range(1, n)]
    if topology == "exponential":
        if n == 1:
            return []
        return [(i - 2 ** (step % _num_rounds(topology, n))) % n]
    if topology == "torus":
        rows, cols = _torus_shape(n, shape)
        r, c = i // cols, i % cols
        return [
            ((r - 1) % rows) * cols + c,
            ((r + 1) % rows) * cols + c,
            r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols,
        ]
    out = []
    for perm in topology:
        if len(perm) != n:
            raise ValueError(f"The `topology` permutations cover {len(perm)} workers but the axis has {n}.")
        src = np.empty(n, dtype=np.int64)
        for s, d in perm:
            src[d] = s
        out.append(src)
    return out


def _check_doubly_stochastic(w: np.ndarray, what: str) -> None:
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"{what} must be a square matrix; got shape {w.shape}.")
    if not np.all(np.isfinite(w)) or np.any(w < -_TOL):
        raise ValueError(f"{what} must have finite, non-negative entries.")
    rows, cols = w.sum(axis=1), w.sum(axis=0)
    if np.max(np.abs(rows - 1)) > _TOL or np.max(np.abs(cols - 1)) > _TOL:
        raise ValueError(
            f"{what} must be doubly stochastic (rows and columns summing to 1); row sums "
            f"{np.round(rows, 6).tolist()}, column sums {np.round(cols, 6).tolist()}."
        )


def _weights_matrix(topology: Any, n: int, weights: Any, sources: list[np.ndarray]) -> np.ndarray:
    """The mixing matrix for the graph given by ``sources`` (before the coverage check)."""
    if not isinstance(weights, str):
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (n, n):
            raise ValueError(f"`weights` is a {w.shape} matrix but the axis has {n} workers.")
        return w
    if topology == "exponential" or (not isinstance(topology, str) and weights == "uniform"):
        # Permutation lists (and the one-peer exponential graph): W = (I + sum_k P_k) / (K + 1).
        w = np.eye(n)
        for src in sources:
            w[np.arange(n), src] += 1.0
        return w / (len(sources) + 1)
    adjacency = np.zeros((n, n), dtype=bool)
    for src in sources:
        adjacency[np.arange(n), src] = True
    np.fill_diagonal(adjacency, False)
    if not isinstance(topology, str):
        # Metropolis weights need an undirected graph.
        adjacency = adjacency | adjacency.T
    degree = adjacency.sum(axis=1)
    w = np.zeros((n, n))
    if weights == "uniform":
        w[adjacency] = np.broadcast_to(1.0 / (degree[:, None] + 1.0), (n, n))[adjacency]
    else:
        pair_max = np.maximum(degree[:, None], degree[None, :])
        w[adjacency] = (1.0 / (1.0 + pair_max))[adjacency]
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return w


class _Term(NamedTuple):
    """One ppermute of the mixing: worker ``i`` receives ``x[src[i]]`` with weight ``coeff[i]``."""

    pairs: tuple[tuple[int, int], ...]
    coeff: tuple[float, ...]


def _plan(
    topology: Any, n: int, *, weights: Any, shape: tuple[int, int] | None, step: int
) -> tuple[np.ndarray, list[_Term]]:
    """The mixing matrix at ``step`` and the ppermutes that apply it."""
    sources = _sources(topology, n, shape, step)
    w = _weights_matrix(topology, n, weights, sources)
    _check_doubly_stochastic(w, "The mixing matrix" if isinstance(weights, str) else "`weights`")
    left = w.copy()
    np.fill_diagonal(left, 0.0)
    terms: list[_Term] = []
    seen: set[tuple[int, ...]] = set()
    rows = np.arange(n)
    for src in sources:
        key = tuple(int(s) for s in src)
        if key in seen:
            continue
        seen.add(key)
        coeff = left[rows, src].copy()
        coeff[src == rows] = 0.0
        left[rows, src] = np.where(src == rows, left[rows, src], 0.0)
        if np.any(coeff != 0):
            pairs = tuple((int(s), int(d)) for d, s in enumerate(src))
            terms.append(_Term(pairs, tuple(float(c) for c in coeff)))
    if np.any(np.abs(left) > _TOL):
        bad = [(int(i), int(j)) for i, j in zip(*np.nonzero(np.abs(left) > _TOL))]
        raise ValueError(
            f"The mixing weights put weight on pairs (receiver, sender) {bad[:6]} that the topology "
            "never connects; each worker can only mix with the workers it receives from."
        )
    return w, terms


def mixing_matrix(
    topology: Any = "ring",
    num_workers: int = 8,
    *,
    weights: Any = "uniform",
    shape: tuple[int, int] | None = None,
    step: int = 0,
) -> np.ndarray:
    r"""The mixing matrix :math:`W` that :func:`gossip` applies, as a NumPy array.

    ``W[i, j]`` is the weight worker ``i`` gives to worker ``j``'s parameters.
    It is checked doubly stochastic.

    Args:
      topology: as for :func:`gossip`.
      num_workers: the number of workers ``n``.
      weights: as for :func:`gossip`.
      shape: the torus shape, as for :func:`gossip`.
      step: the step, for the time-varying ``"exponential"`` topology.

    Returns:
      A float64 array of shape ``(n, n)``.

    Examples:
      >>> from jaxopt_dist._src.gossip import mixing_matrix, spectral_gap
      >>> round(spectral_gap(mixing_matrix("ring", 8)), 3)
      0.195
    """
    topology = _check_topology(topology)
    n = base.check_positive_int(num_workers, "num_workers")
    weights = _check_weights(weights, topology)
    if isinstance(step, bool) or not isinstance(step, (numbers.Integral, np.integer)) or step < 0:
        raise TypeError(f"`step` must be a non-negative int; got {step!r}.")
    w, _ = _plan(topology, n, weights=weights, shape=_check_shape(shape), step=int(step))
    return w


def spectral_gap(w: Any) -> float:
    r"""``1 - |lambda_2(W)|``: one minus the second largest eigenvalue modulus of ``W``.

    The consensus distance of gossip without local steps contracts at least
    by :math:`(1 - \text{gap})^2` per step for a symmetric :math:`W`; a gap of
    1 is exact averaging.
    """
    w = np.asarray(w, dtype=np.float64)
    moduli = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    return float(1.0 - moduli[1]) if len(moduli) > 1 else 1.0


def _check_weights(weights: Any, topology: Any) -> Any:
    if isinstance(weights, str):
        if weights not in _WEIGHTS:
            raise ValueError(f"`weights` must be one of {_WEIGHTS} or an (n, n) matrix; got {weights!r}.")
        return weights
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`weights` must be 'uniform', 'metropolis' or an (n, n) matrix; got {weights!r}."
        ) from e
    if topology == "exponential":
        raise ValueError(
            "An explicit `weights` matrix cannot be used with the time-varying 'exponential' topology."
        )
    _check_doubly_stochastic(w, "`weights`")
    # Stored as nested tuples: closures hold no arrays.
    return tuple(tuple(float(v) for v in row) for row in w)


# ----------------------------------------------------------------------------
# The transform.


class GossipState(NamedTuple):
    """State for :func:`jaxopt_dist.gossip`.

    Attributes:
      count: int32[], steps taken (selects the round of a time-varying
        topology and evaluates schedules); replicated.
      consensus_distance: float32[], mean squared distance of the workers'
        parameters after the last step to their mean,
        ``mean_i |x_i - mean_j x_j|^2`` summed over leaves; replicated. An
        empty tuple when ``track_consensus=False``.
    """

    count: jax.Array  # int32[], replicated
    consensus_distance: jax.Array | tuple[()]  # float32[], replicated; () when not tracked


def _mix(
    updates: list[jax.Array],
    params: list[jax.Array],
    terms: list[_Term],
    gamma: Any,
    axis_name: base.AxisName,
    idx: jax.Array,
) -> list[jax.Array]:
    """Per leaf, ``u_i + gamma * sum_j W_ij (x_j - x_i)`` with ``x = p + u``."""
    if not terms:
        return [comm.to_varying(u, axis_name) for u in updates]
    local = [(p + u).astype(p.dtype) for p, u in zip(params, updates)]
    cdt = [jnp.promote_types(u.dtype, jnp.float32) for u in updates]
    acc = [jnp.zeros(u.shape, d) for u, d in zip(updates, cdt)]
    for term in terms:
        recv = comm.ppermute(local, axis_name, term.pairs, caller="gossip")
        if len(set(term.coeff)) == 1:
            c = term.coeff[0]
        else:
            c = jnp.asarray(np.asarray(term.coeff, np.float32))[idx]
        acc = [a + c * (r.astype(d) - x.astype(d)) for a, r, x, d in zip(acc, recv, local, cdt)]
    out = [(u.astype(d) + jnp.asarray(gamma, d) * a).astype(u.dtype) for u, a, d in zip(updates, acc, cdt)]
    return comm.to_varying(out, axis_name)


def gossip(
    topology: Any = "ring",
    *,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    weights: Any = "uniform",
    shape: tuple[int, int] | None = None,
    gamma: optax.ScalarOrSchedule = 1.0,
    track_consensus: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Decentralized (gossip) SGD: mix the locally updated parameters with neighbours'.

    Placed at the end of a chain, ``optax.chain(sgd(0.1), gossip("ring"))``,
    it turns each worker's local update :math:`u_i` into

    .. math::
      u_i \leftarrow \sum_j W^{(\gamma)}_{ij} (p_j + u_j) - p_i
          = u_i + \gamma \sum_{j \ne i} W_{ij} \big((p_j + u_j) - (p_i + u_i)\big),

    with :math:`W^{(\gamma)} = (1 - \gamma) I + \gamma W` and :math:`W` the
    doubly stochastic mixing matrix of the topology (:func:`mixing_matrix`).
    The right-hand form is what is computed (exact for one worker, no
    cancellation of large parameters). Column sums of 1 keep the global mean
    of the parameters where the local step put it.

    Parameters are per-worker (``data_parallel_step(..., per_worker_params=True)``);
    this is mlbench's ``DecentralizedSGD`` with real mixing matrices.

    Topologies (``n`` workers, indices ``0..n-1``):

    * ``"ring"``: neighbours ``i +- 1 (mod n)``.
    * ``"torus"``: a 2-D wrap-around grid of ``shape = (rows, cols)``
      (row-major worker indices); ``shape=None`` picks the most square one.
    * ``"exponential"``: the one-peer exponential graph, time-varying: at
      step ``t`` worker ``i`` receives from ``i - 2**(t mod ceil(log2 n))``
      and mixes half and half. For ``n`` a power of two, ``log2 n``
      consecutive rounds average exactly.
    * ``"complete"``: every worker (``n - 1`` ppermutes; :func:`average_params`
      does the same with one all-reduce).
    * A list of permutations, each a list of ``(source, destination)`` pairs
      covering every worker once; worker ``i`` receives from the source that
      each permutation maps to ``i``.

    Weights: ``"uniform"``, :math:`W_{ij} = 1/(\deg i + 1)` on the graph
    (for a list of :math:`K` permutations, :math:`W = (I + \sum_k P_k)/(K+1)`,
    counting repeats); ``"metropolis"``, :math:`W_{ij} = 1/(1 + \max(\deg i,
    \deg j))` on edges, the rest on the diagonal (for a permutation list the
    graph is made undirected, so it must deliver both directions); or an
    explicit ``(n, n)`` matrix. Every :math:`W` is checked doubly stochastic
    and supported on the pairs the topology connects (at trace time, when
    ``n`` is known). For the regular ring, torus and complete graphs
    uniform and Metropolis weights coincide; for ``"exponential"`` both are
    the half-and-half one-peer matrix.

    Args:
      topology: ``"ring"``, ``"torus"``, ``"exponential"``, ``"complete"`` or
        a list of permutations.
      axis_name: the mapped axis the workers sit on. Tuples work under
        shard_map (row-major indices).
      weights: ``"uniform"``, ``"metropolis"`` or an ``(n, n)`` doubly
        stochastic matrix.
      shape: ``(rows, cols)`` of the ``"torus"``.
      gamma: consensus step size :math:`\gamma \in (0, 1]`, float or
        schedule; 1 applies :math:`W` as is.
      track_consensus: keep the consensus distance (mean squared distance of
        the workers' new parameters to their mean) in the state, at the cost
        of one all-reduce of the parameters per step.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`; ``update`` needs ``params``.

    Communication:
      One ppermute of the parameters (in their dtype) per distinct neighbour
      permutation per step: ring 2 (1 for ``n = 2``), torus up to 4,
      exponential 1 (the round's one is chosen in a ``lax.switch``), complete
      ``n - 1``, or one per listed permutation. No all-reduce, unless
      ``track_consensus``: then one all-reduce of the parameters and one of a
      scalar. Output updates are per-worker; ``count`` and
      ``consensus_distance`` are replicated.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> from jaxopt_dist._src.gossip import gossip
      >>> tx = optax.chain(jd.sgd(1.0), gossip("ring"))
      >>> params = jnp.zeros((3, 1))          # three workers' copies
      >>> grads = jnp.array([[3.0], [0.0], [0.0]])
      >>> def step(p, g):
      ...     u, _ = tx.update(g, tx.init(p), p)
      ...     return optax.apply_updates(p, u)
      >>> jax.vmap(step, axis_name="data")(params, grads)
      Array([[-1.],
             [-1.],
             [-1.]], dtype=float32)

    References:
      Lian et al., `Can Decentralized Algorithms Outperform Centralized
      Algorithms? <https://arxiv.org/abs/1705.09056>`_, 2017;
      Ying et al., `Exponential Graph is Provably Efficient for Decentralized
      Deep Training <https://arxiv.org/abs/2110.13363>`_, 2021
    """
    topology = _check_topology(topology)
    axis_name = base.validate_axis_name(axis_name)
    weights = _check_weights(weights, topology)
    shape = _check_shape(shape)
    if shape is not None and topology != "torus":
        raise ValueError(f"`shape` only applies to topology='torus'; got topology={topology!r}.")
    base.check_hyperparameter(gamma, "gamma", lower=0.0, upper=1.0, lower_open=True)
    if not isinstance(track_consensus, bool):
        raise TypeError(f"`track_consensus` must be a bool; got {track_consensus!r}.")

    def init_fn(params):
        del params
        return GossipState(
            count=jnp.zeros([], jnp.int32),
            consensus_distance=jnp.zeros([], jnp.float32) if track_consensus else (),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n = comm.require_axis(axis_name, "gossip")
        if params is None:
            raise ValueError("`gossip` needs `params` in update(updates, state, params).")
        u_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        g = base.resolve(gamma, state.count)
        idx = comm.axis_index(axis_name, caller="gossip")
        rounds = _num_rounds(topology, n)
        plans = [_plan(topology, n, weights=weights, shape=shape, step=t)[1] for t in range(rounds)]
        if rounds == 1:
            out = _mix(u_leaves, p_leaves, plans[0], g, axis_name, idx)
        else:
            branches = [lambda u, p, g, terms=terms: _mix(u, p, terms, g, axis_name, idx) for terms in plans]
            out = jax.lax.switch(state.count % rounds, branches, u_leaves, p_leaves, g)
        new_updates = jax.tree.unflatten(treedef, out)
        distance: Any = ()
        if track_consensus:
            distance = _consensus_distance(p_leaves, out, axis_name)
        return new_updates, GossipState(
            count=jnp.asarray(optax.safe_increment(state.count)), consensus_distance=distance
        )

    return comm.float_updates(optax.GradientTransformationExtraArgs(init_fn, update_fn), "gossip")


def _consensus_distance(
    params: list[jax.Array], updates: list[jax.Array], axis_name: base.AxisName
) -> jax.Array:
    """``mean_i |x_i - mean_j x_j|^2`` over all leaves, ``x = p + u``, in float32 or wider."""
    if not params:
        return jnp.zeros([], jnp.float32)
    new = [(p + u).astype(jnp.promote_types(p.dtype, jnp.float32)) for p, u in zip(params, updates)]
    mean = comm.pmean(new, axis_name, caller="gossip")
    local = sum(jnp.sum(jnp.square(x - m)).astype(jnp.float32) for x, m in zip(new, mean))
    return comm.pmean(local, axis_name, caller="gossip")
