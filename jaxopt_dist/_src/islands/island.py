"""One island: a JAX job taking DiLoCo's inner steps, whose outer exchange goes over a transport.

:class:`Island` wraps a :func:`jaxopt_dist.data_parallel_step` of a
:func:`jaxopt_dist.diloco` and runs it with the diloco's ``external`` twin
(:class:`jaxopt_dist.DiLoCoTransformation`): the step never exchanges by
itself; after the step that takes a fragment's pseudo-gradient the island
reads its outbox, runs the ``aggregate`` on its own devices, and merges the
result with the other islands' in one SUM all-reduce of ``[w * d, w]``
(:mod:`.merge`) over the transport. The merged aggregate lands where the
step would have put it (``pending``, read by the applying step; or, with
``sync_delay=0``, the diloco's ``land``), so every DiLoCo variant runs
across islands with the numbers of one in-process ``diloco``. Under
``eager`` the island also writes its share of the round (its weight over
the sum) into the state, where the eager step reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxopt_dist._src import base
from jaxopt_dist._src.islands import merge
from jaxopt_dist._src.islands.transport import ExchangeError, IslandsError, Transport
from jaxopt_dist._src.training import layout


@dataclasses.dataclass(frozen=True)
class SyncRecord:
    """What one island saw of one synchronisation (a committed round that landed).

    Attributes:
      round: the round's number (rounds committed before it; the join is round 0).
      step: the island's inner-step count after the round landed.
      fragment: the fragment exchanged.
      participants: the islands in the round, by id.
      weights: their weights, in the same order.
      healed: whether this island healed from a peer in this round (weight 0).
      redone: how many times the exchange was run again among survivors.
      anchor_sha256: SHA-256 of the anchor's float32 bytes after the round
        (leaves in tree order): equal on every participant, except under
        ``eager``, where each island's anchor takes its own fresh
        pseudo-gradient.
      seconds: from the round's first quorum to its commit.
      agreed_sha256: SHA-256 of what every participant holds bit-identical
        after the round, which the members of the next round check: the
        anchor (``anchor_sha256``), or under ``eager`` the merged aggregates
        every fragment waits with (the state's ``pending``).
    """

    round: int
    step: int
    fragment: int
    participants: tuple[int, ...]
    weights: tuple[float, ...]
    healed: bool
    redone: int
    anchor_sha256: str
    seconds: float
    agreed_sha256: str = ""


@dataclasses.dataclass
class _Outcome:
    """A committed round, before it lands: host values only (a round runs beside the steps)."""

    fragment: int  # -1: the join round
    merged: merge.Merged
    healed: Any  # the healing (params, opt_state) as host trees (residuals zeroed), or None
    round: int
    redone: int
    seconds: float


def anchor_sha256(opt_state: Any) -> str:
    """SHA-256 of a :class:`jaxopt_dist.DiLoCoState`'s anchor as float32 bytes, leaves in tree order."""
    return _sha256(opt_state.anchor)


def _sha256(tree: Any) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(_host(x), np.float32).tobytes())
    return h.hexdigest()


def _host(x: Any) -> np.ndarray:
    """A leaf's whole value on the host.

    On an island of several processes a leaf that is not replicated over its
    devices (sharded over a model axis) is gathered from them: a collective
    over the island's processes, which each of them must call in the same order.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))  # this process's copy
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _gathers(tree: Any) -> bool:
    """Whether :func:`_host` must gather some leaf of ``tree`` from the island's other processes."""
    return any(
        isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
        for x in jax.tree.leaves(tree)
    )


def _host_count(opt_state: Any) -> int:
    return int(_host(opt_state.count).reshape(-1)[0])


class Island:
    """Runs a DiLoCo :func:`jaxopt_dist.data_parallel_step` as one island; see :func:`island`."""

    def __init__(
        self,
        step: Any,
        transport: Transport,
        *,
        island_id: int,
        rule: str = "mean",
        tokens_per_step: float = 1.0,
        num_slots: int = 64,
        round_timeout: float = 600.0,
        on_sync: Callable[[SyncRecord, Any, Any], None] | None = None,
    ):
        _check_step(step)
        if not 0 <= island_id < num_slots:
            raise ValueError(f"`island_id` must be in [0, num_slots={num_slots}); got {island_id}.")
        if not tokens_per_step > 0:
            raise ValueError(f"`tokens_per_step` must be > 0; got {tokens_per_step}.")
        if not round_timeout > 0:
            raise ValueError(f"`round_timeout` must be > 0 seconds; got {round_timeout}.")
        self.rule = merge.check_rule(rule)
        self.exchange = step.tx.external
        self.step = dataclasses.replace(step, tx=self.exchange.trusting)
        self.transport = transport
        self.island_id, self.num_slots = int(island_id), int(num_slots)
        self.tokens_per_step, self.round_timeout = float(tokens_per_step), float(round_timeout)
        self.on_sync = on_sync
        self.records: list[SyncRecord] = []
        self._snapshot: Any = None
        self._snapshot_host: Any = None  # its host copy, where taking one needs every process
        self._digest = ""
        self._healing: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="island-round")
        self._flight: concurrent.futures.Future | None = None
        self._unrecorded: list[_Outcome] = []  # landed rounds whose applying step has not run
        self._steps_since_sync = 0
        self._t: int | None = None
        self._last: Any = None
        self._programs: dict[Any, Any] = {}
        self._own_agg: Any = None  # the aggregate state this island's last send left
        self._lead = jax.process_index() == 0  # an island of several processes talks through its first

    # ---------------------------------------------------------------- public
    def init(self, params: Any, *, warmup_batch: Any = None) -> tuple[Any, Any]:
        """Places ``params`` and the state, joins the others (round 0), and heals if they are ahead.

        With ``warmup_batch`` (a batch of the shapes to come), the step and the
        island's own programs are compiled first, on copies, so that the first
        rounds do not wait for a compiler (and peers do not leave this island
        out for being slow).
        """
        params, opt_state = self.step.init(params)
        if warmup_batch is not None:
            self._warm_up(params, opt_state, warmup_batch)
        self._take_snapshot(params, opt_state)
        self._digest = self._agreed(opt_state)
        if self._lead:
            self.transport.bind(self.island_id, self._save, self._load)
        params, opt_state = self._land(self._round_now(None, [], params, opt_state), params, opt_state)
        return params, self._remember(opt_state)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """One inner step, then the outer exchange of the fragment it sent (if any) over the transport."""
        t = self._count(opt_state)
        if self._flight is not None and t % self.exchange.sync_every in self.exchange.land_phase:
            outcome = self._share(self._flight.result(), params, opt_state)
            params, opt_state = self._land(outcome, params, opt_state)
            self._flight = None
            t = self._count(opt_state)
        params, opt_state, metrics = self.step(params, opt_state, batch)
        self._steps_since_sync += 1
        applied = self.exchange.lands_at(t)
        due = [o for o in self._unrecorded if o.fragment in applied]
        self._unrecorded = [o for o in self._unrecorded if o.fragment not in applied]
        for o in due:
            self._record(o, params, opt_state)
        self._t = t + 1
        for f in self.exchange.launches_after(t):
            params, opt_state = self._launch(f, params, opt_state)
        return params, self._remember(opt_state), metrics

    def _warm_up(self, params: Any, opt_state: Any, batch: Any) -> None:
        """Compiles the step, and the exchange and landing of every fragment, on throwaway copies."""
        copy = jax.tree.map(lambda x: x.copy(), (params, opt_state))
        p, s, _ = self.step(*copy, batch)
        for f in range(len(opt_state.outer_states)):
            delta = self._finished(f, self._contribution(f, p, s), p, s)
            if self.exchange.land is not None:
                jax.block_until_ready(self._land_now(f, delta, p, s))
        self._own_agg = None

    def model(self, opt_state: Any) -> Any:
        """The island's global model: the anchor (under ``eager``, per worker, the island's own row)."""
        if self.exchange.eager:
            return jax.tree.map(lambda a: a[0], opt_state.anchor)
        return opt_state.anchor

    def step_count(self, opt_state: Any) -> int:
        """The inner steps ``opt_state`` has taken (after healing: its source's count)."""
        return self._count(opt_state)

    def finish(self) -> None:
        """Waits for a round still in flight (so that its peers are not left waiting) and leaves."""
        if self._flight is not None:
            self._flight.result()
            self._flight = None
        if self._lead:
            self.transport.close()
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------- the round
    def _remember(self, opt_state: Any) -> Any:
        self._last = opt_state
        return opt_state

    def _count(self, opt_state: Any) -> int:
        """The state's inner-step count (kept on the host for the state this island last returned)."""
        if opt_state is not self._last or self._t is None:
            self._t = _host_count(opt_state)
        return self._t

    def _launch(self, f: int, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """After the step that sent fragment ``f``: its round, now (``sync_delay=0``) or beside the next steps."""
        self._take_snapshot(params, opt_state)
        own = self._contribution(f, params, opt_state)
        if self.exchange.land is not None:
            return self._land(self._round_now(f, own, params, opt_state), params, opt_state)
        if self._lead:
            self._flight = self._pool.submit(self._run_round, f, own, opt_state, self._digest)
        else:  # the island's first process runs the round; the others learn it from _share
            self._flight = concurrent.futures.Future()
            self._flight.set_result(None)
        return params, opt_state

    def _round_now(self, f: int | None, own: list[np.ndarray], params: Any, opt_state: Any) -> _Outcome:
        """A round run here and now (by the island's first process), its outcome on every process."""
        outcome = self._run_round(f, own, opt_state, self._digest) if self._lead else None
        return self._share(outcome, params, opt_state)

    def _run_round(self, f: int | None, own: list[np.ndarray], opt_state: Any, digest: str) -> _Outcome:
        """Quorum, all-reduce and commit, run again among survivors until it commits (within the bound).

        ``own``: this island's aggregate of fragment ``f`` (host leaves); ``digest``: the anchor's
        SHA-256 before the round (the members check that theirs agree). Touches no device.
        """
        start, redone, healed = time.monotonic(), 0, None
        while True:
            merged = None
            try:
                if self.transport.quorum():
                    healed = self._adopt(opt_state)
                    f = self._fragment_of(healed[1])
                    own = self._nothing(f, healed[1])
                    digest = self._agreed(healed[1])
                merged = self._exchange(own, self._weight(f, healed is not None), digest)
            except ExchangeError:
                pass
            if self.transport.commit() and merged is not None:  # after a failure too: the transport counts it
                break
            redone += 1
            if time.monotonic() - start > self.round_timeout:
                self.transport.close()  # leave: the others' next quorum goes on without this island
                raise IslandsError(
                    f"island {self.island_id}: the round did not commit within {self.round_timeout} s "
                    f"({redone} tries)"
                )
        rounds = self.transport.rounds_committed() - 1
        frag = -1 if f is None else f
        return _Outcome(frag, merged, healed, rounds, redone, time.monotonic() - start)

    def _exchange(self, own: list[np.ndarray], weight: float, digest: str) -> merge.Merged:
        """One all-reduce of the packed round; the members' rounds and anchors must agree."""
        buf = merge.pack(
            own,
            weight,
            slot=self.island_id,
            num_slots=self.num_slots,
            round=self.transport.rounds_committed(),
            anchor=merge.anchor_tag(digest),
        )
        merged = merge.unpack(self.transport.allreduce(buf), own, num_slots=self.num_slots)
        if not merged.agree():
            reason = f"members of one round disagree: rounds {merged.rounds}, anchor tags {merged.anchors}"
            self.transport.abort(reason)
            raise ExchangeError(reason)
        return merged

    def _weight(self, f: int | None, healed: bool) -> float:
        if f is None:  # the join round carries no pseudo-gradient
            return 0.0
        tokens = self._steps_since_sync * self.tokens_per_step
        return merge.island_weight(self.rule, healed=healed, tokens=tokens)

    def _fragment_of(self, opt_state: Any) -> int | None:
        """The fragment a state (just after a send) waits to exchange; None for one that never stepped."""
        t = _host_count(opt_state)
        if t == 0:
            return None
        sent = self.exchange.launches_after(t - 1)
        if len(sent) != 1:
            raise IslandsError(
                f"island {self.island_id}: healed from a state at step {t}, which sent no fragment."
            )
        return sent[0]

    def _contribution(self, f: int, params: Any, opt_state: Any) -> list[np.ndarray]:
        """This island's aggregate of fragment ``f`` on its own devices (host leaves); keeps the new
        aggregate state (a compressor's residual) for the landing."""
        s = opt_state
        d, new_agg = self._program("exchange", f, params)(s.outbox[f], s.aggregate_states[f], s.anchor)
        self._own_agg = jax.tree.map(
            lambda n, o: jax.device_put(n, o.sharding), new_agg, s.aggregate_states[f]
        )
        return [_host(x) for x in d]

    def _nothing(self, f: int | None, opt_state: Any) -> list[np.ndarray]:
        """A healed island's share: zeros (it weighs 0)."""
        if f is None:
            return []
        return [np.zeros(x.shape, x.dtype) for x in _fragment_leaves(opt_state, f, self.exchange)]

    # --------------------------------------------------------------- healing
    def _take_snapshot(self, params: Any, opt_state: Any) -> None:
        """Keeps the state a peer may heal from this round. On an island of several processes whose
        state is sharded over its devices, its host copy is gathered now, by every process: the
        transport asks for it in the first process's round thread, where no collective can run."""
        self._snapshot = (params, opt_state)
        self._snapshot_host = None
        if _gathers(self._snapshot):
            self._snapshot_host = self._host_state()

    def _host_state(self) -> Any:
        params, opt_state = self._snapshot
        return {
            "params": [_host(x) for x in jax.tree.leaves(params)],
            "opt_state": [_host(x) for x in jax.tree.leaves(opt_state)],
        }

    def _save(self) -> Any:
        """The healing state a lagging peer takes: this island's state at the start of the round."""
        return self._snapshot_host if self._snapshot_host is not None else self._host_state()

    def _load(self, payload: Any) -> None:
        self._healing = payload

    def _adopt(self, opt_state: Any) -> tuple[Any, Any]:
        """The healing state received in the quorum, as host trees shaped like this island's; the
        per-worker leaves of its aggregate states (residuals: owed by the source, not by us) zeroed."""
        payload, self._healing = self._healing, None
        if payload is None:
            raise IslandsError(f"island {self.island_id}: the transport said it healed but sent no state.")
        params, state = self._snapshot
        new_params = _host_like(params, payload["params"])
        new_state = _host_like(state, payload["opt_state"])
        mask = self._mask(params).aggregate_states
        agg = jax.tree.map(lambda x, m: np.zeros_like(x) if m else x, new_state.aggregate_states, mask)
        return new_params, new_state._replace(aggregate_states=agg)

    def _share(self, o: _Outcome | None, params: Any, opt_state: Any) -> _Outcome:
        """The round's outcome on every process of the island (its first process ran the round)."""
        if jax.process_count() == 1:
            assert o is not None
            return o
        return _broadcast_outcome(o, params, opt_state, self.exchange, self.num_slots)

    # --------------------------------------------------------------- landing
    def _land(self, o: _Outcome, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Writes a committed round into the state (after taking the healing state, if it healed)."""
        if o.healed is not None:
            # The healing trees were checked against this island's shapes when they arrived (_adopt).
            params, opt_state = jax.tree.map(
                lambda h, t: jax.device_put(h, t.sharding), o.healed, (params, opt_state)
            )
            self._t, self._own_agg, self._steps_since_sync = None, None, 0
            self._unrecorded = []  # rounds of the life it left
        f = o.fragment
        opt_state = self._with_shares(o, opt_state)
        if f < 0:  # a join round: nothing to land
            self._digest = self._agreed(opt_state)
            return params, opt_state
        delta = self._finished(f, o.merged.delta, params, opt_state)
        aggs = list(opt_state.aggregate_states)
        if o.healed is None:  # the residual this island's own send left (a healed one owes nothing)
            aggs[f] = self._own_agg
        s = opt_state._replace(aggregate_states=tuple(aggs))
        self._steps_since_sync = 0
        if self.exchange.land is None:  # the applying step reads it
            pend, exch = list(s.pending), list(s.exchanged)
            pend[f] = [jax.device_put(d, p.sharding) for d, p in zip(delta, s.pending[f])]
            exch[f] = jax.device_put(np.ones((), bool), exch[f].sharding)
            self._unrecorded.append(o)
            s = s._replace(pending=tuple(pend), exchanged=tuple(exch))
            if self.exchange.eager:  # what the next round's members check changes here, not at the record
                self._digest = self._agreed(s)
            return params, s
        params, s = self._land_now(f, delta, params, s)
        self._record(o, params, s)
        return params, s

    def _with_shares(self, o: _Outcome, opt_state: Any) -> Any:
        """Under ``eager``: the state with this island's share of what each fragment's ``pending`` will
        hold after round ``o`` (its weight over the sum; after a join, ``1 / islands``, as the in-process
        rule before any exchange; 0 for every fragment after a heal: it merged none of them)."""
        if not self.exchange.eager:
            return opt_state
        shares = list(opt_state.shares)
        if o.healed is not None or o.fragment < 0:
            every = 0.0 if o.healed is not None else 1.0 / max(len(o.merged.participants), 1)
            shares = [_placed(every, x) for x in shares]
        else:
            shares[o.fragment] = _placed(merge.island_share(o.merged, self.island_id), shares[o.fragment])
        return opt_state._replace(shares=tuple(shares))

    def _agreed(self, opt_state: Any) -> str:
        """The digest the members of a round must agree on: the anchor, or under ``eager`` ``pending``."""
        return _sha256(opt_state.pending) if self.exchange.eager else anchor_sha256(opt_state)

    def _finished(self, f: int, merged: list[Any], params: Any, opt_state: Any) -> list[Any]:
        """The merged first stages of fragment ``f`` (host), placed like its anchor leaves, after the
        aggregate's second stage if it has one (``opt_state``: its aggregate state before the round)."""
        leaves = _fragment_leaves(opt_state, f, self.exchange)
        delta = [jax.device_put(d, x.sharding) for d, x in zip(merged, leaves)]
        if self.exchange.finish is None:  # no second stage
            return delta
        out = self._program("finish", f, params)(delta, opt_state.aggregate_states[f])
        return [jax.device_put(d, x.sharding) for d, x in zip(out, leaves)]

    def _land_now(self, f: int, delta: list[Any], params: Any, s: Any) -> tuple[Any, Any]:
        """The diloco's ``land`` of fragment ``f`` with the merged aggregate (``sync_delay=0``)."""
        new = self._program("land", f, params)(params, s, delta)
        return jax.tree.map(lambda n, x: jax.device_put(n, x.sharding), new, (params, s))

    def _record(self, o: _Outcome, params: Any, opt_state: Any) -> None:
        anchor = anchor_sha256(opt_state)
        rec = SyncRecord(
            round=o.round,
            step=_host_count(opt_state),
            fragment=o.fragment,
            participants=tuple(o.merged.participants),
            weights=tuple(o.merged.weights),
            healed=o.healed is not None,
            redone=o.redone,
            anchor_sha256=anchor,
            seconds=o.seconds,
            agreed_sha256=self._digest if self.exchange.eager else anchor,  # eager: kept at each landing
        )
        self.records.append(rec)
        self._digest = rec.agreed_sha256
        if self.on_sync is not None:
            self.on_sync(rec, params, opt_state)

    # -------------------------------------------------------------- programs
    def _mask(self, params: Any) -> Any:
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), params)
        return self.step.placement(local).per_worker

    def _program(self, kind: str, f: int, params: Any) -> Any:
        key = (kind, f)
        if key not in self._programs:
            build = {"exchange": _exchange_program, "land": _land_program, "finish": _finish_program}[kind]
            self._programs[key] = build(self.exchange, f, self._mask(params), self.step.axis_name)
        return self._programs[key]


def _check_step(step: Any) -> None:
    external = getattr(getattr(step, "tx", None), "external", None)
    if external is None:
        raise ValueError(
            "an Island needs a data_parallel_step whose `tx` is a jaxopt_dist.diloco(...) itself "
            f"(got {type(getattr(step, 'tx', None)).__name__})."
        )
    if not getattr(step, "per_worker_params", False):
        raise ValueError("an Island needs a data_parallel_step with per_worker_params=True (DiLoCo's).")
    n = layout.mesh_axis_size(step.mesh, step.axis_name)
    if n != 1:
        raise ValueError(
            f"an island is one DiLoCo worker: its mesh's data axis {step.axis_name!r} must have size 1 "
            f"(got {n}); split the batch over its other devices with `batch_axes` (and `param_specs`), "
            "as for a sharded model."
        )


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


def _land_program(exchange: Any, f: int, mask: Any, axis_name: base.AxisName) -> Any:
    """``(params, state, aggregate_f) -> (params, state)``: fragment ``f``'s outer step (``sync_delay=0``)."""

    def body(params, state, delta):
        return exchange.land(f, params, state, delta)

    return _on_island(body, axis_name, (True, mask, False), (True, mask))


def _fragment_leaves(state: Any, f: int, exchange: Any) -> list[Any]:
    """Leaves placed as fragment ``f``'s merged aggregate is: its ``pending`` where the state keeps one,
    else its anchor leaves (both replicated then; under ``eager`` the anchor is per-worker)."""
    if state.pending[f]:
        return list(state.pending[f])
    leaves = jax.tree.leaves(state.anchor)
    return [leaves[i] for i in exchange.fragments(state.anchor)[f]]


def _placed(value: float, like: jax.Array) -> jax.Array:
    """A float32 scalar placed as ``like``."""
    return jax.device_put(np.float32(value), like.sharding)


def _host_like(template: Any, leaves: list[np.ndarray]) -> Any:
    """Host ``leaves`` in ``template``'s tree, checked against its shapes."""
    targets, treedef = jax.tree.flatten(template)
    if len(leaves) != len(targets) or any(np.shape(a) != t.shape for a, t in zip(leaves, targets)):
        raise IslandsError(
            "the healing state does not fit this island's model: "
            f"{[np.shape(a) for a in leaves][:4]}... against {[t.shape for t in targets][:4]}..."
        )
    return jax.tree.unflatten(treedef, [np.asarray(a, t.dtype) for a, t in zip(leaves, targets)])


def _broadcast_outcome(
    o: _Outcome | None, params: Any, opt_state: Any, exchange: Any, num_slots: int
) -> _Outcome:
    """``o`` (given on the island's first process) on every process, through the island's own devices."""
    from jax.experimental import multihost_utils

    meta = np.zeros(6 + 2 * num_slots, np.float32)
    if o is not None:
        present = np.zeros(num_slots, np.float32)
        weights = np.zeros(num_slots, np.float32)
        present[o.merged.participants] = 1.0
        weights[o.merged.participants] = o.merged.weights
        head = [o.fragment, o.healed is not None, o.round, o.redone, o.seconds, 0.0]
        meta = np.concatenate([np.asarray(head, np.float32), present, weights])
    meta = np.asarray(multihost_utils.broadcast_one_to_all(meta))
    f, healed = int(meta[0]), bool(meta[1])
    templates = (params, opt_state)
    if healed:
        host = (
            o.healed
            if o is not None
            else tuple(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), templates))
        )
        host = tuple(multihost_utils.broadcast_one_to_all(host))
        state_for_shapes = host[1]
    else:
        host, state_for_shapes = None, opt_state
    like = _fragment_leaves(state_for_shapes, f, exchange) if f >= 0 else []
    delta = o.merged.delta if o is not None else [np.zeros(x.shape, x.dtype) for x in like]
    delta = [np.asarray(x) for x in multihost_utils.broadcast_one_to_all(delta)] if like else []
    slots = [int(i) for i in np.flatnonzero(meta[6 : 6 + num_slots] > 0.5)]
    merged = merge.Merged(delta, slots, [float(meta[6 + num_slots + i]) for i in slots])
    return _Outcome(f, merged, host, int(meta[2]), int(meta[3]), float(meta[4]))
