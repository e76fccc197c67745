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

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src.topology import (
    MixingTerm,
    check_shape,
    check_topology,
    check_weights,
    mixing_plan,
    num_rounds,
)

# ----------------------------------------------------------------------------
# Mixing matrices (the topology machinery lives in topology.py).


def mixing_matrix(
    topology: Any = "ring",
    num_workers: int | None = None,
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
      num_workers: the number of workers ``n``. Leaving it out still gives
        the matrix for 8 workers, with a ``DeprecationWarning``: that default
        goes away in the next release.
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
    topology = check_topology(topology)
    if num_workers is None:
        base.warn_renamed(
            "mixing_matrix() without num_workers",
            "mixing_matrix(..., num_workers=n)",
            note=" Its default of 8 workers goes away.",
        )
        num_workers = 8
    n = base.check_positive_int(num_workers, "num_workers")
    weights = check_weights(weights, topology)
    if isinstance(step, bool) or not isinstance(step, (numbers.Integral, np.integer)) or step < 0:
        raise TypeError(f"`step` must be a non-negative int; got {step!r}.")
    w, _ = mixing_plan(topology, n, weights=weights, shape=check_shape(shape), step=int(step))
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


# ----------------------------------------------------------------------------
# The transform.


@base.reshard_rules()
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
    terms: list[MixingTerm],
    gamma: Any,
    axis_name: base.AxisName,
    idx: jax.Array,
) -> list[jax.Array]:
    """Per leaf, ``u_i + gamma * sum_j W_ij (x_j - x_i)`` with ``x = p + u``."""
    if not terms:
        return [comm.to_varying(u, axis_name) for u in updates]
    local = [(p + u).astype(p.dtype) for p, u in zip(params, updates)]
    cdt = [base.accumulation_dtype(u.dtype) for u in updates]
    acc = [jnp.zeros(u.shape, d) for u, d in zip(updates, cdt)]
    for term in terms:
        recv = comm.ppermute(local, axis_name, term.pairs, caller="gossip")
        c = term.coefficient(idx)
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

    Sharded parameters:
      Elementwise: each device mixes its own shard with the same shard of the
      neighbours (the permutes above, per worker); nothing crosses the model
      axes except, with ``track_consensus``, one scalar per sharded leaf (its
      sum of squares over the shards).

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
    topology = check_topology(topology)
    axis_name = base.validate_axis_name(axis_name)
    weights = check_weights(weights, topology)
    shape = check_shape(shape, topology)
    base.check_hyperparameter(gamma, "gamma", lower=0.0, upper=1.0, lower_open=True)
    base.check_bool(track_consensus, "track_consensus")

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
            raise ValueError(base.no_params_message("gossip"))
        u_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        g = base.resolve(gamma, state.count)
        idx = comm.axis_index(axis_name, caller="gossip")
        rounds = num_rounds(topology, n)
        plans = [mixing_plan(topology, n, weights=weights, shape=shape, step=t)[1] for t in range(rounds)]
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
    new = [(p + u).astype(base.accumulation_dtype(p.dtype)) for p, u in zip(params, updates)]
    mean = comm.pmean(new, axis_name, caller="gossip")
    local = sum(jnp.sum(jnp.square(x - m)).astype(jnp.float32) for x, m in zip(new, mean))
    return comm.pmean(local, axis_name, caller="gossip")
