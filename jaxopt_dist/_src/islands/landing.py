"""Landing: an island's own programs for a round, and a committed round written into its state.

Around the diloco's ``external`` step the island runs three programs of its
own on its devices (:class:`Programs`): the ``aggregate``'s first stage on its
outbox before a round (what it sends), the aggregate's second stage on the
merged mean (where it has one), and, with ``sync_delay=0``, the diloco's
``land`` (the outer step the step left undone); under a robust ``aggregate``,
its rule over the gathered rows (:func:`rows_program`). The functions here write a
committed round into the state where the step would have put it: a healing
state placed like the island's own, each fragment's ``pending`` for the
applying step (or the outer step at once), and under ``eager`` the island's
share of the merged mean. They run in the island's main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxopt_dist._src import base
from jaxopt_dist._src.islands import broadcast, merge
from jaxopt_dist._src.islands.protocol import Outcome


class Programs:
    """The island's jitted programs around its step, built once per kind and fragment.

    Args:
      exchange: the diloco's ``external`` :class:`jaxopt_dist.OuterExchange`.
      mask: the step's per-worker mask of ``(params, opt_state)``'s state (``placement(...).per_worker``).
      axis_name: the step's data axis.
    """

    def __init__(self, exchange: Any, mask: Any, axis_name: base.AxisName):
        self.exchange, self.mask, self.axis_name = exchange, mask, axis_name
        self._built: dict[tuple[str, int], Any] = {}

    def get(self, kind: str, f: int) -> Any:
        key = (kind, f)
        if key not in self._built:
            build = {
                "exchange": _exchange_program,
                "land": _land_program,
                "finish": _finish_program,
                "encode": _encode_program,
            }[kind]
            self._built[key] = build(self.exchange, f, self.mask, self.axis_name)
        return self._built[key]

    def contribution(self, f: int, opt_state: Any) -> tuple[list[np.ndarray], Any]:
        """This island's aggregate of fragment ``f`` (host leaves) and the aggregate state its send
        leaves (a compressor's residual), placed as the state's."""
        s = opt_state
        d, new_agg = self.get("exchange", f)(s.outbox[f], s.aggregate_states[f], s.anchor)
        placed_agg = jax.tree.map(lambda n, o: jax.device_put(n, o.sharding), new_agg, s.aggregate_states[f])
        return [broadcast.host(x) for x in d], placed_agg

    def message(self, f: int, opt_state: Any) -> list[np.ndarray]:
        """This island's encoded message of fragment ``f`` (host arrays): what its aggregate sends."""
        s = opt_state
        return [broadcast.host(x) for x in self.get("encode", f)(s.outbox[f], s.aggregate_states[f])]

    def shapes(self, f: int, opt_state: Any) -> tuple[list[Any], list[Any] | None]:
        """The shapes and dtypes of fragment ``f``'s aggregate and of its encoded message (None: no wire)."""
        s = opt_state
        leaves, _ = jax.eval_shape(self.get("exchange", f), s.outbox[f], s.aggregate_states[f], s.anchor)
        if self.exchange.wire is None:
            return list(leaves), None
        return list(leaves), list(jax.eval_shape(self.get("encode", f), s.outbox[f], s.aggregate_states[f]))

    def decode(
        self, f: int, message: list[np.ndarray], agg_state: Any, like: list[Any]
    ) -> tuple[list[Any], list[Any] | None]:
        """One island's message of fragment ``f`` decoded as leaves ``like`` (shapes and dtypes), given this
        island's aggregate state of the fragment (host arrays)."""
        key = ("decode", f)
        if key not in self._built:
            self._built[key] = _decode_program(self.exchange, f, self.mask, self.axis_name, like)
        return self._built[key](list(message), agg_state)

    def finished(self, f: int, merged: list[Any], opt_state: Any) -> list[Any]:
        """The merged first stages of fragment ``f`` (host), placed like its anchor leaves, after the
        aggregate's second stage if it has one (``opt_state``: its aggregate state before the round)."""
        leaves = fragment_leaves(opt_state, f, self.exchange)
        delta = [jax.device_put(d, x.sharding) for d, x in zip(merged, leaves)]
        if self.exchange.finish is None:  # no second stage
            return delta
        out = self.get("finish", f)(delta, opt_state.aggregate_states[f])
        return [jax.device_put(d, x.sharding) for d, x in zip(out, leaves)]

    def land_now(self, f: int, delta: list[Any], params: Any, s: Any) -> tuple[Any, Any]:
        """The diloco's ``land`` of fragment ``f`` with the merged aggregate (``sync_delay=0``)."""
        new = self.get("land", f)(params, s, delta)
        return jax.tree.map(lambda n, x: jax.device_put(n, x.sharding), new, (params, s))


def rows_program(combine: Callable[..., Any]) -> Callable[..., tuple[list[np.ndarray], Any]]:
    """A robust rule's ``combine(stacked, state)`` (:class:`jaxopt_dist._src.base.GatheredRule`) as one
    jitted program over host rows (:func:`.gather.stacked_rows`), its results on the host: the merged
    leaves and the aggregate's new state. The same program on the same rows gives every member the same
    bits."""
    program = jax.jit(combine)

    def rows(stacked: list[np.ndarray], state: Any) -> tuple[list[np.ndarray], Any]:
        out, new_state = program(stacked, state)
        return [np.asarray(x) for x in jax.device_get(out)], jax.device_get(new_state)

    return rows


def place_healed(healed: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
    """A healing state's host trees, placed as this island's ``(params, opt_state)``."""
    return jax.tree.map(lambda h, t: jax.device_put(h, t.sharding), healed, (params, opt_state))


def with_pending(s: Any, f: int, delta: list[Any]) -> Any:
    """The state with fragment ``f``'s merged aggregate in ``pending``, for the step that applies it."""
    pend, exch = list(s.pending), list(s.exchanged)
    pend[f] = [jax.device_put(d, p.sharding) for d, p in zip(delta, s.pending[f])]
    exch[f] = jax.device_put(np.ones((), bool), exch[f].sharding)
    return s._replace(pending=tuple(pend), exchanged=tuple(exch))


def with_shares(o: Outcome, opt_state: Any, island_id: int) -> Any:
    """Under ``eager``: the state with this island's share of what each fragment's ``pending`` will
    hold after round ``o`` (its weight over the sum; after a join, ``1 / islands``, as the in-process
    rule before any exchange; 0 for every fragment after a heal: it merged none of them)."""
    shares = list(opt_state.shares)
    if o.healed is not None or o.fragment < 0:
        every = 0.0 if o.healed is not None else 1.0 / max(len(o.merged.participants), 1)
        shares = [placed(every, x) for x in shares]
    else:
        shares[o.fragment] = placed(merge.island_share(o.merged, island_id), shares[o.fragment])
    return opt_state._replace(shares=tuple(shares))


def fragment_leaves(state: Any, f: int, exchange: Any) -> list[Any]:
    """Leaves placed as fragment ``f``'s merged aggregate is: its ``pending`` where the state keeps one,
    else its anchor leaves (both replicated then; under ``eager`` the anchor is per-worker)."""
    if state.pending[f]:
        return list(state.pending[f])
    leaves = jax.tree.leaves(state.anchor)
    return [leaves[i] for i in exchange.fragments(state.anchor)[f]]


def placed(value: float, like: jax.Array) -> jax.Array:
    """A float32 scalar placed as ``like``."""
    return jax.device_put(np.float32(value), like.sharding)


def _on_island(body: Any, axis_name: base.AxisName, in_masks: tuple[Any, ...], out_masks: Any) -> Any:
    """``body`` per worker on the island's devices: ``jax.vmap`` over its one worker, under ``jax.jit``.

    The island's data axis has one worker, so the stacked leaves (where a mask is
    True; the others are replicated) give the body their one row, and ``vmap``
    binds ``axis_name`` with size one around it: the body's collectives reduce
    over that one worker without a cross-device reduction. Under ``jax.jit`` the
    island's model axes are the compiler's: a leaf sharded over them (FSDP) stays
    so. (A ``shard_map`` manual over the data axis only would be the step's way,
    but XLA's partitioner refuses any collective over a manual axis of size one
    beside automatic ones.) The outputs come back stacked where ``out_masks`` is
    True, else as the one row; the callers place them as the step does.
    """
    names = base.axis_names(axis_name)
    fn = body
    for name in reversed(names):
        fn = jax.vmap(fn, in_axes=None, axis_size=1, axis_name=name)

    def run(*args):
        rows = tuple(_rows(a, m, lambda x: x[0]) for a, m in zip(args, in_masks))
        out = jax.tree.map(lambda x: x[(0,) * len(names)], fn(*rows))
        return _rows(out, out_masks, lambda x: x[None])

    return jax.jit(run)


def _rows(tree: Any, mask: Any, op: Callable[[Any], Any]) -> Any:
    """``op`` on the leaves of ``tree`` under a True of ``mask`` (a tree prefix of ``tree``)."""
    return jax.tree.map(lambda m, x: jax.tree.map(op, x) if m else x, mask, tree)


def _exchange_program(exchange: Any, f: int, mask: Any, axis_name: base.AxisName) -> Any:
    """``(outbox_f, aggregate_state_f, anchor) -> (aggregate_f, aggregate_state_f)`` on the island's devices."""
    agg_mask = mask.aggregate_states[f]

    def body(outbox_f, agg_f, anchor):
        anchor_f = [jax.tree.leaves(anchor)[i] for i in exchange.fragments(anchor)[f]]
        return exchange.run_first(f, list(outbox_f), agg_f, anchor_f)

    return _on_island(body, axis_name, (True, agg_mask, mask.anchor), (False, agg_mask))


def _finish_program(exchange: Any, f: int, mask: Any, axis_name: base.AxisName) -> Any:
    """``(merged_f, aggregate_state_f) -> aggregate_f``: the aggregate's second stage, if any."""

    def body(merged_f, agg_f):
        return exchange.finish(f, list(merged_f), agg_f)

    return _on_island(body, axis_name, (False, mask.aggregate_states[f]), False)


def _encode_program(exchange: Any, f: int, mask: Any, axis_name: base.AxisName) -> Any:
    """``(outbox_f, aggregate_state_f) -> message``: the aggregate's encoded message, no communication."""

    def body(outbox_f, agg_f):
        return list(exchange.wire.encode(list(outbox_f), agg_f))

    return _on_island(body, axis_name, (True, mask.aggregate_states[f]), False)


def _decode_program(exchange: Any, f: int, mask: Any, axis_name: base.AxisName, like: list[Any]) -> Any:
    """``(message, aggregate_state_f) -> (values, support)``: one island's message decoded as ``like``."""
    like = [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in like]

    def body(message, agg_f):
        return exchange.wire.decode(list(message), like, agg_f)

    return _on_island(body, axis_name, (False, mask.aggregate_states[f]), False)


def _land_program(exchange: Any, f: int, mask: Any, axis_name: base.AxisName) -> Any:
    """``(params, state, aggregate_f) -> (params, state)``: fragment ``f``'s outer step (``sync_delay=0``)."""

    def body(params, state, delta):
        return exchange.land(f, params, state, delta)

    return _on_island(body, axis_name, (True, mask, False), (True, mask))
