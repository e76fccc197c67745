"""An island of several processes: values taken to the host, and a round's outcome on every process.

Only the island's first process talks to the other islands; the others learn
each round's outcome from it over the island's own devices
(:func:`outcome_everywhere`). Both helpers here may run collectives over the
island's processes, which each of them must call in the same order.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from jaxopt_dist._src.islands import merge, wire
from jaxopt_dist._src.islands.protocol import Outcome, Waits


def host(x: Any) -> np.ndarray:
    """A leaf's whole value on the host.

    On an island of several processes a leaf that is not replicated over its
    devices (sharded over a model axis) is gathered from them: a collective
    over the island's processes.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))  # this process's copy
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def gathers(tree: Any) -> bool:
    """Whether :func:`host` must gather some leaf of ``tree`` from the island's other processes."""
    return any(
        isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
        for x in jax.tree.leaves(tree)
    )


def host_count(opt_state: Any) -> int:
    """A DiLoCo state's inner-step count on the host."""
    return int(host(opt_state.count).reshape(-1)[0])


def outcome_everywhere(o: Outcome | None, templates: tuple[Any, Any], like: Any, num_slots: int) -> Outcome:
    """``o`` (given on the island's first process, None on the others) on every process.

    ``templates``: this process's ``(params, opt_state)``, for the shapes of a
    healing state; ``like(state, f)``: fragment ``f``'s merged leaves' shapes in a state.
    """
    from jax.experimental import multihost_utils

    meta = np.zeros(_HEAD + 2 * num_slots, np.float32)
    encoded = _rejected_bytes(o.rejected) if o is not None else b""
    if o is not None:
        present = np.zeros(num_slots, np.float32)
        weights = np.zeros(num_slots, np.float32)
        present[o.merged.participants] = 1.0
        weights[o.merged.participants] = o.merged.weights
        head = [o.fragment, o.healed is not None, o.round, o.redone, o.seconds, o.agg_state is not None]
        meta = np.concatenate([np.asarray([*head, len(encoded)], np.float32), present, weights])
    meta = np.asarray(multihost_utils.broadcast_one_to_all(meta))
    f, healed = int(meta[0]), bool(meta[1])
    if healed:
        zeros = tuple(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), templates))
        trees = tuple(multihost_utils.broadcast_one_to_all(o.healed if o is not None else zeros))
        state_for_shapes = trees[1]
    else:
        trees, state_for_shapes = None, templates[1]
    shapes = like(state_for_shapes, f) if f >= 0 else []
    delta = o.merged.delta if o is not None else [np.zeros(x.shape, x.dtype) for x in shapes]
    delta = [np.asarray(x) for x in multihost_utils.broadcast_one_to_all(delta)] if shapes else []
    slots = [int(i) for i in np.flatnonzero(meta[_HEAD : _HEAD + num_slots] > 0.5)]
    merged = merge.Merged(delta, slots, [float(meta[_HEAD + num_slots + i]) for i in slots])
    waits = o.waits if o is not None else Waits()
    agg = None
    if meta[5] > 0.5:  # a robust rule's new aggregate state
        zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state_for_shapes.aggregate_states[f])
        agg = multihost_utils.broadcast_one_to_all(o.agg_state if o is not None else zeros)
    if n := int(meta[6]):  # the rejected list, as JSON bytes
        buf = np.frombuffer(encoded, np.uint8) if o is not None else np.zeros(n, np.uint8)
        encoded = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8))
    rejected = o.rejected if o is not None else _rejected_list(encoded)
    return Outcome(f, merged, trees, int(meta[2]), int(meta[3]), float(meta[4]), waits, rejected, agg)


_HEAD = 7  # fragment, healed, round, redone, seconds, aggregate state, the rejected list's byte length


def _rejected_bytes(rejected: list[wire.Rejected]) -> bytes:
    return json.dumps([[r.island, r.reason] for r in rejected]).encode()


def _rejected_list(data: bytes) -> list[wire.Rejected]:
    return [wire.Rejected(island, reason) for island, reason in json.loads(data)] if data else []
