r"""How islands merge their pseudo-gradients: one SUM all-reduce of a packed ``[w * delta, w]``.

Each island ``i`` of a round sends ``w_i * d_i`` (``d_i`` its fragment's
pseudo-gradient, as its ``aggregate`` left it) and its weight ``w_i``; after
the sum every island divides, so every rule below is one all-reduce:

* ``"mean"``: ``w_i = 1`` for every island that took part in the round with
  its own inner steps (as torchft and PCCL), 0 for an island that healed in
  this round (its pseudo-gradient would repeat its healing source's).
* ``"tokens"``: ``w_i`` = the tokens the island trained on since it last
  synchronised (Decoupled DiLoCo's token weighting), 0 when it healed.

The same packing runs inside a jitted step as a ``diloco(aggregate=...)``
(:func:`weighted_mean`), so an in-process run with a participation mask is
the reference for islands that join and leave.

The host buffer also carries, per island slot, whether the island took part,
its weight, its round, a tag of its anchor, whether it healed in the round,
when its process joined, a random nonce, the fragment and its settings, so every
participant learns from the same all-reduce who was in the round, that they
all merged the same round of the same fragment from the same anchor with the
same settings, and whether two live islands claimed one slot. Every buffer of
a run has one length (the body padded to the largest fragment's), so that an
island that does not know the round's fragment (its heal was refused) can still
take part, contributing nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

RULES = ("mean", "tokens")


def check_rule(rule: Any) -> str:
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {RULES}; got {rule!r}.")
    return rule


def island_weight(rule: str, *, healed: bool, tokens: float) -> float:
    """An island's weight in a round: 0 when it healed in it, else 1 (``"mean"``) or ``tokens``."""
    check_rule(rule)
    if healed:
        return 0.0
    if rule == "mean":
        return 1.0
    if not tokens > 0:
        raise ValueError(f"an island that took part in a round must have trained on tokens; got {tokens}.")
    return float(tokens)


class Merged(NamedTuple):
    """A round's result, read off the summed buffer.

    Every list but ``delta`` is per participant, in the order of ``participants``.
    Each island writes only its own slot, so each value is that island's, except
    where two live islands claimed one slot (``counts`` above 1): there the
    values are their sums.

    Attributes:
      delta: the merged pseudo-gradient's leaves, ``sum_i w_i d_i / sum_i w_i``
        (zeros when every weight is 0).
      participants: the slots that took part, in increasing order.
      weights: their weights.
      rounds: the round each participant said it was in.
      anchors: each participant's tag of its anchor before the round (see :func:`pack`).
      counts: how many islands sent from each slot (1, unless ids clash).
      behind: whether each participant healed in this round (1.0) or not (0.0).
      joined: the round each participant's process joined the others in.
      nonces: each participant's random number, drawn when its process started.
      settings: each participant's settings vector (:data:`SETTINGS_SIZE` values).
      fragments: the fragment each participant exchanged (-1: a join).
    """

    delta: list[np.ndarray]
    participants: list[int]
    weights: list[float]
    rounds: list[int] = []
    anchors: list[int] = []
    counts: list[int] = []
    behind: list[float] = []
    joined: list[int] = []
    nonces: list[int] = []
    settings: list[tuple[float, ...]] = []
    fragments: list[int] = []

    def agree(self) -> bool:
        """Whether every participant was in the same round from the same anchor."""
        return len(set(self.rounds)) <= 1 and len(set(self.anchors)) <= 1


def island_share(merged: Merged, slot: int) -> float:
    """Island ``slot``'s weight over the sum of weights in a round (0 when absent or every weight is 0)."""
    total = float(np.sum(np.asarray(merged.weights, np.float32)))
    if slot not in merged.participants or not total > 0:
        return 0.0
    return float(np.float32(merged.weights[merged.participants.index(slot)]) / np.float32(total))


TAG_BITS = 24  # a float32 holds every integer below 2**24 exactly
NONCE_BITS = 22  # the sum of a few nonces stays below 2**24
SETTINGS_SIZE = 8
"""Values per island slot describing the settings every island of a run must share."""
_FIELDS = 8  # present, weight, round, anchor, behind, joined, nonce, fragment + 1


def anchor_tag(sha256_hex: str) -> int:
    """The first 24 bits of an anchor's SHA-256: what an island puts in the buffer to say which anchor it has."""
    return int(sha256_hex[: TAG_BITS // 4], 16)


def tail_size(num_slots: int) -> int:
    """Floats a round's buffer carries after the pseudo-gradient: the weight, then per island slot
    its presence, weight, round, anchor tag, heal flag, join round, nonce, fragment and settings."""
    return 1 + (_FIELDS + SETTINGS_SIZE) * num_slots


def pack(
    leaves: Sequence[Any],
    weight: float,
    *,
    slot: int,
    num_slots: int,
    round: int = 0,
    anchor: int = 0,
    behind: bool = False,
    joined: int = 0,
    nonce: int = 0,
    settings: Sequence[float] = (),
    fragment: int = -1,
    body: int | None = None,
    present: bool = True,
) -> np.ndarray:
    """The float32 buffer an island all-reduces.

    ``[w * d (flat, zero-padded to body), w, then per slot: present, w, round,
    anchor, behind, joined, nonce, fragment + 1, settings]`` (:func:`tail_size`
    floats after the body): after the sum, the slot values say who took part
    with which weight, in which round (``round < 2**24``), from which anchor
    (``anchor``: :func:`anchor_tag`), whether it healed in the round, in which
    round its process joined, with which nonce (below ``2**22``), fragment (-1: a
    join) and settings (at most :data:`SETTINGS_SIZE` integers below ``2**24``),
    so that every participant can check that they all merged the same round.
    ``body`` (default: ``d``'s size) is the run's longest fragment; ``present``
    False leaves the slot empty (an island that abstains). A fresh, writable
    array (an all-reduce may write into it in place).
    """
    if not 0 <= slot < num_slots:
        raise ValueError(f"island slot {slot} is outside [0, {num_slots}).")
    limit = 2**TAG_BITS
    if not (0 <= round < limit and 0 <= anchor < limit and 0 <= joined < limit):
        raise ValueError(
            f"`round`, `anchor` and `joined` must be in [0, 2**24); got {round}, {anchor}, {joined}."
        )
    if not 0 <= nonce < 2**NONCE_BITS:
        raise ValueError(f"`nonce` must be in [0, 2**{NONCE_BITS}); got {nonce}.")
    if len(settings) > SETTINGS_SIZE:
        raise ValueError(f"`settings` has {len(settings)} values; at most {SETTINGS_SIZE}.")
    sizes = [int(np.size(x)) for x in leaves]
    body = _body(sizes, body)
    buf = np.zeros(body + tail_size(num_slots), np.float32)
    start = 0
    w = np.float32(weight)
    for x, n in zip(leaves, sizes):
        buf[start : start + n] = np.asarray(x, np.float32).reshape(-1) * w
        start += n
    buf[body] = w
    if not present:
        return buf
    values = (1.0, w, round, anchor, float(behind), joined, nonce, fragment + 1, *settings)
    for k, value in enumerate(values):
        buf[body + 1 + k * num_slots + slot] = value
    return buf


def _body(sizes: list[int], body: int | None) -> int:
    if body is None:
        return sum(sizes)
    if body < sum(sizes):
        raise ValueError(f"`body` ({body}) is shorter than the leaves ({sum(sizes)} entries).")
    return body


def unpack(buf: np.ndarray, like: Sequence[Any], *, num_slots: int, body: int | None = None) -> Merged:
    """The merged round from the summed buffer; ``like``: the leaves' shapes and dtypes; ``body``: as
    :func:`pack`'s."""
    sizes = [int(np.size(x)) for x in like]
    body = _body(sizes, body)
    if buf.shape != (body + tail_size(num_slots),):
        raise ValueError(
            f"the summed buffer has {buf.shape[0]} entries; this fragment needs {body + tail_size(num_slots)}: "
            "the islands of one round exchanged different fragments or models."
        )
    total = np.float32(buf[body])
    table = buf[body + 1 :].reshape(_FIELDS + SETTINGS_SIZE, num_slots)
    present, slot_w, rounds, anchors, behind, joined, nonces, fragments = table[:_FIELDS]
    out, start = [], 0
    for x, n in zip(like, sizes):
        piece = buf[start : start + n] / total if total > 0 else np.zeros(n, np.float32)
        out.append(piece.astype(np.float32).reshape(np.shape(x)).astype(x.dtype))
        start += n
    slots = [int(i) for i in np.flatnonzero(present > 0.5)]
    return Merged(
        out,
        slots,
        [float(slot_w[i]) for i in slots],
        [int(rounds[i]) for i in slots],
        [int(anchors[i]) for i in slots],
        [int(round(float(present[i]))) for i in slots],
        [float(behind[i]) for i in slots],
        [int(joined[i]) for i in slots],
        [int(nonces[i]) for i in slots],
        [tuple(float(v) for v in table[_FIELDS:, i]) for i in slots],
        [int(fragments[i]) - 1 for i in slots],
    )


class WeightedMeanState(NamedTuple):
    """State for :func:`jaxopt_dist.islands.weighted_mean`.

    Attributes:
      rounds: int32[], rounds merged so far (of this fragment); replicated.
    """

    rounds: jax.Array  # int32[], replicated


def weighted_mean(
    weights: Any = None, *, axis_name: base.AxisName = base.DEFAULT_AXIS_NAME
) -> optax.GradientTransformationExtraArgs:
    r"""The islands' merge inside a step: ``sum_i w_i d_i / sum_i w_i`` as one ``psum`` of ``[w d, w]``.

    Use it as ``diloco(aggregate=weighted_mean(weights))`` for the in-process
    reference of islands that join, leave or heal: worker ``i`` stands for
    island ``i`` and ``weights[r, i]`` is its weight in round ``r`` (0: absent,
    or healed in that round). Under ``diloco(eager=True)`` a worker's own
    fresh pseudo-gradient then replaces its share ``w_i / sum_j w_j`` of the
    previous round (``1 / workers`` before the first), as an island's does.

    Args:
      weights: None (every weight 1: the mean); an array ``[rounds, workers]``
        (round ``r`` uses row ``min(r, rounds - 1)``); or a function of the
        round (int32[]) returning the ``[workers]`` weights. With Streaming
        DiLoCo each fragment counts its own rounds.
      axis_name: the workers' axis.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`WeightedMeanState`.

    Communication:
      One ``psum`` of the leaves and one float32 (the weight), fused into
      one buffer; the output is replicated.
    """
    axis_name = base.validate_axis_name(axis_name)
    table = None if weights is None or callable(weights) else np.asarray(weights, np.float32)
    if table is not None and table.ndim != 2:
        raise ValueError(f"`weights` must be [rounds, workers]; got shape {table.shape}.")

    def row(r: jax.Array) -> jax.Array:
        """The ``[workers]`` weights of round ``r``."""
        if table is not None:
            return jnp.asarray(table)[jnp.minimum(r, table.shape[0] - 1)]
        assert callable(weights)
        return jnp.asarray(weights(r), jnp.float32)

    def weight_of(r: jax.Array, i: jax.Array) -> jax.Array:
        if weights is None:
            return jnp.ones([], jnp.float32)
        return row(r)[i]

    def share(state):
        """This worker's weight over the sum in the round the last update merged (``1 / n`` before any)."""
        n = comm.require_axis(axis_name, "weighted_mean")
        w = row(jnp.maximum(state.rounds - 1, 0))
        mine = _divide(w[comm.axis_index(axis_name)], jnp.sum(w))
        return jnp.where(state.rounds > 0, mine, jnp.float32(1.0 / n))

    def init_fn(params):
        del params
        return WeightedMeanState(rounds=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        n = comm.require_axis(axis_name, "weighted_mean")
        if table is not None and table.shape[1] != n:
            raise ValueError(f"`weights` has {table.shape[1]} columns for {n} workers.")
        w = weight_of(state.rounds, comm.axis_index(axis_name))
        leaves, treedef = jax.tree.flatten(updates)
        flat = jnp.concatenate([(x.astype(jnp.float32) * w).reshape(-1) for x in leaves] + [w[None]])
        total = comm.psum(flat, axis_name, caller="weighted_mean")
        merged = _divide(total[:-1], total[-1])
        out = base.split_flat(merged, leaves, treedef)
        out = jax.tree.map(lambda m, x: m.astype(x.dtype), out, updates)
        return out, WeightedMeanState(rounds=jnp.asarray(optax.safe_increment(state.rounds)))

    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return tx if weights is None else base.declare_share(tx, share)


def _divide(body: jax.Array, total: jax.Array) -> jax.Array:
    return jnp.where(total > 0, body / jnp.where(total > 0, total, 1.0), 0.0)
