r"""CHOCO-SGD: decentralized averaging with compressed messages and public copies.

Every worker :math:`i` keeps a *public copy* :math:`\hat x_i` of its
parameters, known bit for bit to its neighbours, and sends only the
compressed change :math:`q_i = C(x_i - \hat x_i)`. Everyone who knows
:math:`\hat x_i` adds :math:`q_i` to it, and each worker moves towards the
public copies of its neighbours:

.. math::
  \hat x_j \leftarrow \hat x_j + q_j \;\; (j = i \text{ and its neighbours}),
  \qquad x_i \leftarrow x_i + \gamma \sum_j W_{ij} (\hat x_j - \hat x_i).

What compression leaves out stays in :math:`x_i - \hat x_i` and is sent
later, so the compressor needs no residual of its own (Koloskova, Stich and
Jaggi 2019, Algorithm 2, with the local step of CHOCO-SGD before it).

Storage: the neighbours' public copies enter the update only through the
weighted sum :math:`s_i = \sum_{j \ne i} W_{ij} \hat x_j`, so that is what a
worker keeps (updated with :math:`\sum_{j \ne i} W_{ij} q_j`), together with
its own :math:`\hat x_i`: two copies of the parameters whatever the degree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import error_feedback as ef
from jaxopt_dist._src.topology import MixingTerm, check_shape, check_topology, check_weights, mixing_plan


@base.reshard_rules()
class ChocoGossipState(NamedTuple):
    """State for :func:`jaxopt_dist.choco_gossip`.

    Attributes:
      count: int32[], steps taken (evaluates schedules); replicated.
      public: this worker's public copy :math:`\\hat x_i`, like params in at
        least float32; per-worker.
      neighbours: :math:`\\sum_{j \\ne i} W_{ij} \\hat x_j`, the weighted sum of
        the neighbours' public copies, like ``public``; per-worker.
      compressor_state: the compressor's own state (e.g. its key).
    """

    count: jax.Array  # int32[], replicated
    public: optax.Updates  # like params (>= float32), per-worker
    neighbours: optax.Updates  # like params (>= float32), per-worker
    compressor_state: optax.OptState


def _codec_of(compressor: Any) -> ef.Compressor:
    comp = compressor if isinstance(compressor, ef.Compressor) else ef.compressor_of(compressor)
    if comp is None:
        raise TypeError(
            "`compressor` must be a compressor of jaxopt_dist (e.g. jd.top_k(k), jd.random_k(k), "
            f"jd.block_k(k), jd.scaled_sign(), jd.qsgd(levels)) or a jd.Compressor; got {compressor!r}."
        )
    if comp.codec is None:
        raise ValueError(
            "`compressor` cannot build its message without its own collectives (powersgd, "
            "sign_majority_vote, threshold and top_k(per_leaf=False) cannot); use top_k, random_k, "
            "block_k, scaled_sign or qsgd."
        )
    return comp


def _off_diagonal(terms: list[MixingTerm], n: int, idx: jax.Array) -> Any:
    """``sum_{j != i} W_ij`` for this worker."""
    total = np.zeros(n)
    for term in terms:
        total += np.asarray(term.coeff)
    if np.all(total == total[0]):
        return float(total[0])
    return jnp.asarray(total.astype(np.float32))[idx]


def choco_gossip(
    compressor: Any,
    *,
    topology: Any = "ring",
    consensus_step: optax.ScalarOrSchedule,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    weights: Any = "uniform",
    shape: tuple[int, int] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""CHOCO-SGD's compressed gossip: send :math:`C(x - \hat x)`, mix public copies.

    Placed at the end of a chain, ``optax.chain(jd.sgd(lr), choco_gossip(
    jd.top_k(k=...), consensus_step=0.5))``, it turns each worker's local
    update :math:`u_i` (so :math:`x_i = p_i + u_i`) into

    .. math::
      u_i + \gamma \sum_{j \ne i} W_{ij} (\hat x_j - \hat x_i)

    after every public copy has received its :math:`q_j = C(x_j - \hat
    x_j)` (module docstring). Parameters are per-worker
    (``data_parallel_step(..., per_worker_params=True)``), as for
    :func:`gossip`. :math:`\hat x` starts at zero, as in the paper, so the
    first messages carry the parameters themselves.

    ``compressor`` is any compressor of the library whose message can be
    built locally: :func:`top_k` (per leaf), :func:`random_k`,
    :func:`block_k`, :func:`scaled_sign` or :func:`qsgd` (the paper's
    scheme, each worker with its own norms), as the transform its factory
    returns (its settings are used; its own error feedback and aggregation
    are not: the message goes only to the neighbours, and :math:`x -
    \hat x` already carries what it left out). A :class:`Compressor` with a
    ``codec`` works too.

    Topologies and weights are those of :func:`gossip` (``"ring"``,
    ``"torus"``, ``"complete"`` or a list of permutations; uniform,
    Metropolis or explicit weights). The time-varying ``"exponential"``
    graph is refused: a worker would have to follow the public copy of every
    peer it ever mixes with, which takes every peer's message at every step.

    Args:
      compressor: the compression operator :math:`C` (see above).
      topology: as for :func:`gossip`, except ``"exponential"``.
      consensus_step: :math:`\gamma \in (0, 1]`, float or schedule; the
        paper tunes it (small for aggressive compression).
      axis_name: the mapped axis the workers sit on (tuples under shard_map).
      weights: ``"uniform"``, ``"metropolis"`` or an ``(n, n)`` matrix.
      shape: ``(rows, cols)`` of the ``"torus"``.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ChocoGossipState`; ``update`` needs ``params``.

    Communication:
      Per step, one ppermute of the compressed message (one uint8 buffer) per distinct
      neighbour permutation (ring 2, 1 for ``n = 2``; torus up to 4;
      complete ``n - 1``; one per listed permutation). The message is what
      the compressor would all-gather: for :func:`top_k` ``k_l`` values and
      int32 indices per leaf (leaves of at most ``k_l`` entries whole), for
      :func:`random_k`/:func:`block_k` the ``k_l`` values only (the indices
      come from the shared key), for :func:`scaled_sign` the bit-packed signs
      plus one float32 per leaf, for :func:`qsgd` the integer codes and
      float32 bucket norms. No all-reduce. Outputs, ``public`` and
      ``neighbours`` are per-worker; ``count`` and the compressor's key are
      replicated.

    Sharded parameters:
      The public copy and the neighbours' sum are sharded like the parameters
      and updated elementwise. Building and decoding a message needs whole
      leaves for every compressor of the library (flattened leaves, packed
      buffers): the compiler gathers what it needs over the model axes. The
      message crosses the data axis as above, per worker.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxopt_dist as jd
      >>> tx = optax.chain(jd.sgd(1.0), jd.choco_gossip(jd.top_k(k=1), consensus_step=1.0))
      >>> params = jnp.zeros((2, 3))                  # two workers' copies
      >>> grads = jnp.array([[-4.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
      >>> def step(p, g):
      ...     u, _ = tx.update(g, tx.init(p), p)
      ...     return optax.apply_updates(p, u)
      >>> jax.vmap(step, axis_name="data")(params, grads)
      Array([[ 2., -1., -1.],
             [ 2., -1.,  0.]], dtype=float32)

    References:
      Koloskova, Stich and Jaggi, `Decentralized Stochastic Optimization and
      Gossip Algorithms with Compressed Communication
      <https://arxiv.org/abs/1902.00340>`_, 2019
    """
    comp = _codec_of(compressor)
    codec = comp.codec
    assert codec is not None
    topology = check_topology(topology)
    if topology == "exponential":
        raise ValueError(
            "`choco_gossip` needs a fixed graph: `topology='exponential'` changes neighbours every "
            "step, and the public copies of a peer must see each of its messages. Use 'ring', "
            "'torus', 'complete' or a list of permutations."
        )
    weights = check_weights(weights, topology)
    shape = check_shape(shape, topology)
    base.check_hyperparameter(consensus_step, "consensus_step", lower=0.0, upper=1.0, lower_open=True)
    axis_name = base.validate_axis_name(axis_name)

    def init_fn(params):
        zeros = lambda p: jnp.zeros(jnp.shape(p), base.accumulation_dtype(p.dtype))  # noqa: E731
        return ChocoGossipState(
            count=jnp.zeros([], jnp.int32),
            public=jax.tree.map(zeros, params),
            neighbours=jax.tree.map(zeros, params),
            compressor_state=comp.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n = comm.require_axis(axis_name, "choco_gossip")
        if params is None:
            raise ValueError(base.no_params_message("choco_gossip"))
        _, terms = mixing_plan(topology, n, weights=weights, shape=shape, step=0)
        idx = comm.axis_index(axis_name, caller="choco_gossip")
        x = jax.tree.map(lambda p, u, h: p.astype(h.dtype) + u.astype(h.dtype), params, updates, state.public)
        delta = jax.tree.map(jnp.subtract, x, state.public)
        message, q, comp_state = codec.encode(delta, state.compressor_state)
        public = jax.tree.map(lambda h, d: h + d.astype(h.dtype), state.public, q)
        neighbours = state.neighbours
        for term in terms:
            received = comm.ppermute_packed(message, axis_name, term.pairs, caller="choco_gossip")
            q_j = codec.decode(received, delta, state.compressor_state)
            c = term.coefficient(idx)
            neighbours = jax.tree.map(
                lambda s, d: s + jnp.asarray(c, s.dtype) * d.astype(s.dtype), neighbours, q_j
            )
        gamma = base.resolve(consensus_step, state.count)
        off = _off_diagonal(terms, n, idx)
        new_updates = jax.tree.map(
            lambda u, s, h: (
                u.astype(h.dtype) + jnp.asarray(gamma, h.dtype) * (s - jnp.asarray(off, h.dtype) * h)
            ).astype(u.dtype),
            updates,
            neighbours,
            public,
        )
        return comm.to_varying(new_updates, axis_name), ChocoGossipState(
            count=jnp.asarray(optax.safe_increment(state.count)),
            public=comm.to_varying(public, axis_name),
            neighbours=comm.to_varying(neighbours, axis_name),
            compressor_state=comp_state,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
