"""One island: a JAX job taking DiLoCo's inner steps, whose outer exchange goes over a transport.

:class:`Island` wraps a :func:`jaxopt_dist.data_parallel_step` of a
:func:`jaxopt_dist.diloco` and runs it with the diloco's ``external`` twin
(:class:`jaxopt_dist.DiLoCoTransformation`): the step never exchanges by
itself; after the step that takes a fragment's pseudo-gradient the island
runs the ``aggregate`` on its own devices (:mod:`.landing`) and hands the
result to a round (:mod:`.protocol`), which merges it with the other islands'
in one SUM all-reduce of ``[w * d, w]`` (:mod:`.merge`) over the transport.
The merged aggregate lands where the step would have put it (:mod:`.landing`),
so every DiLoCo variant runs across islands with the numbers of one
in-process ``diloco``. What a lagging peer heals from is :mod:`.healing`'s;
an island of several processes shares each round's outcome through
:mod:`.broadcast`. This module orchestrates them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxopt_dist._src.islands import broadcast, gather, healing, landing, merge, protocol, wire
from jaxopt_dist._src.islands.transport import Healed, IslandsError, Transport
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
      healed: whether this island healed from a peer in this round (weight 0):
        it had just joined, or its anchor differed from the others'.
      redone: how many times the exchange was run again (attempts after the first).
      anchor_sha256: SHA-256 of the anchor's float32 bytes after the round
        (leaves in tree order): equal on every participant, except under
        ``eager``, where each island's anchor takes its own fresh
        pseudo-gradient.
      seconds: the round, from its first quorum to its commit (bound: ``round_timeout``).
      agreed_sha256: SHA-256 of what every participant holds bit-identical
        after the round, which the members of the next round check: the
        anchor (``anchor_sha256``), or under ``eager`` the merged aggregates
        every fragment waits with (the state's ``pending``).
      quorum_seconds: the longest wait for a quorum in the round (heal excluded).
      heal_seconds: the longest heal in the round (0 when it did not heal).
      exchange_seconds: the longest all-reduce in the round.
      vote_seconds: the longest commit vote in the round.
      backoff_seconds: the pauses between the round's attempts, together.
      waited_seconds: how long this island waited for the round to form: its
        quorum waits in every attempt of the round together (heals excluded).
      rejected: the contributions this island dropped in the round, and the
        healing states it refused in it, as ``(island id or None, reason)``
        (a tag missing or wrong under the shared secret, a header that lies
        about its length; a healing state that fails a check of
        :mod:`.heal_http`, its source's claimed id where it gives one).
      sent_bytes: the bytes this island has put on the wire so far, as its
        transport counts them (0 where it counts none).
      caught_up: whether this island was late to the round (the others had
        committed rounds without it) and caught up: it took the round's state
        from a peer, as a heal does, and its own pseudo-gradient, taken from
        the anchor it last synchronised to, was merged with its weight (see
        :func:`jaxopt_dist.islands.island`, "Late islands").
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
    quorum_seconds: float = 0.0
    heal_seconds: float = 0.0
    exchange_seconds: float = 0.0
    vote_seconds: float = 0.0
    backoff_seconds: float = 0.0
    waited_seconds: float = 0.0
    rejected: tuple[tuple[int | None, str], ...] = ()
    sent_bytes: int = 0
    caught_up: bool = False


def anchor_sha256(opt_state: Any) -> str:
    """SHA-256 of a :class:`jaxopt_dist.DiLoCoState`'s anchor as float32 bytes, leaves in tree order."""
    return _sha256(opt_state.anchor)


def _sha256(tree: Any) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(broadcast.host(x), np.float32).tobytes())
    return h.hexdigest()


class Island:
    """Runs a DiLoCo :func:`jaxopt_dist.data_parallel_step` as one island; see :func:`island`.

    Threads. The caller's thread (the main one) owns the parameters and the
    optimizer state, the step count, the steps since the last launch (the
    ``"tokens"`` weight), the aggregate state the last send left, the rounds
    landed but not yet recorded, the records and the digest the next round's
    members check; at each launch it fixes a round's contribution (values,
    not references to those fields), and takes the round's outcome back
    through a future, before the step that applies it. The round thread runs
    the round protocol and reads none of the main thread's fields; when it
    heals, it returns the healing state in the outcome. The transport's
    threads call the healing state's ``serve``, which shares only the state
    this island serves, under a lock.
    """

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
        if not round_timeout > transport.exchange_seconds:
            raise ValueError(
                f"`round_timeout` must exceed the transport's bound on one exchange and its vote "
                f"({transport.exchange_seconds:g} s); got {round_timeout}."
            )
        self.rule = merge.check_rule(rule)
        self.exchange = step.tx.external
        _check_rule_with(self.exchange, self.rule)
        self.step = dataclasses.replace(step, tx=self.exchange.trusting)
        self.transport = transport
        self.island_id, self.num_slots = int(island_id), int(num_slots)
        self.tokens_per_step, self.round_timeout = float(tokens_per_step), float(round_timeout)
        self.on_sync = on_sync
        self.records: list[SyncRecord] = []
        self._digest = ""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="island-round")
        self._flight: concurrent.futures.Future | None = None
        self._unrecorded: list[protocol.Outcome] = []  # landed rounds whose applying step has not run
        self._steps = 0  # inner steps since the last launch (or the join, or a heal)
        self._t: int | None = None
        self._last: Any = None
        self._own_agg: Any = None  # the aggregate state this island's last send left
        self._lead = jax.process_index() == 0  # an island of several processes talks through its first
        self._programs: landing.Programs | None = None
        self._healing: healing.Healing | None = None
        self._protocol: protocol.RoundProtocol | None = None
        self._encoded = False  # rounds send the aggregate's encoded messages (see _gather)
        self._rows: Any = None  # a robust rule's program over the gathered rows (see _gather)

    # ---------------------------------------------------------------- public
    def init(self, params: Any, *, warmup_batch: Any = None) -> tuple[Any, Any]:
        """Places ``params`` and the state, joins the others (round 0), and heals if they are ahead.

        With ``warmup_batch`` (a batch of the shapes to come), the step and the
        island's own programs are compiled first, on copies, so that the first
        rounds do not wait for a compiler (and peers do not leave this island
        out for being slow).
        """
        params, opt_state = self.step.init(params)
        mask = self._mask(params)
        self._programs = landing.Programs(self.exchange, mask, self.step.axis_name)
        if warmup_batch is not None:
            self._warm_up(params, opt_state, warmup_batch)
        settings = protocol.Settings.of(self.exchange, self.rule, params, opt_state)
        self._healing = healing.Healing(self.island_id, settings, mask.aggregate_states, self._agreed)
        ex, gathers = self._gather(opt_state)
        if warmup_batch is not None and self._rows is not None:
            self._warm_up_rows(ex, opt_state)
        self._protocol = protocol.RoundProtocol(
            self.transport,
            island_id=self.island_id,
            num_slots=self.num_slots,
            rule=self.rule,
            round_timeout=self.round_timeout,
            settings=settings,
            gather=ex if gathers else None,
            fallback=None if gathers else ex,
        )
        self._digest = self._agreed(opt_state)
        self._healing.keep(params, opt_state, self._digest)
        if self._lead:
            self.transport.bind(self.island_id, self._healing.serve, self._healing.expected())
        join = protocol.Contribution(None, [], 0.0, self._digest)
        params, opt_state = self._land(self._round_now(join, params, opt_state), params, opt_state)
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
        self._steps += 1
        applied = self.exchange.lands_at(t)
        due = [o for o in self._unrecorded if o.fragment in applied]
        self._unrecorded = [o for o in self._unrecorded if o.fragment not in applied]
        for o in due:
            self._record(o, params, opt_state)
        self._t = t + 1
        for f in self.exchange.launches_after(t):
            params, opt_state = self._launch(f, params, opt_state)
        return params, self._remember(opt_state), metrics

    def _gather(self, opt_state: Any) -> tuple[gather.Exchange, bool]:
        """How rounds gather (see :mod:`.gather`), and whether every round does: the aggregate's encoded
        messages where it declares a wire whose merge the islands make, the island's own pseudo-gradient
        under a robust rule (combined over rows), its values where the transport holds a secret; else
        rounds make one SUM all-reduce, and gather the values only when that sum is not finite."""
        assert self._programs is not None
        w, secret, rule = self.exchange.wire, self.transport.secret, self.exchange.gathered
        encoded = w is not None and w.merge in ("mean", "chosen_mean")
        self._encoded = encoded
        layouts, like = {-1: wire.Layout(())}, {}
        for f in range(len(opt_state.outer_states)):
            leaves, message = self._programs.shapes(f, opt_state)
            like[f] = leaves
            layouts[f] = wire.Layout.of(message if encoded and message is not None else leaves)
        programs = self._programs

        def decode(f: int, message: list[np.ndarray], agg_state: Any) -> tuple[list[Any], Any]:
            return programs.decode(f, message, agg_state, like[f]) if encoded else (message, None)

        ex = gather.Exchange(secret, layouts, decode, like)
        if rule is not None:
            self._rows = landing.rows_program(rule.combine)
            ex.rows = self._rows
        return ex, encoded or rule is not None or secret is not None

    def _warm_up_rows(self, ex: gather.Exchange, opt_state: Any) -> None:
        """Compiles a robust rule's program over the rows (NaN rows: no contribution), for every fragment."""
        for f, like in ex.like.items():
            agg = jax.tree.map(broadcast.host, opt_state.aggregate_states[f])
            assert ex.rows is not None
            ex.rows(gather.stacked_rows([], like, self.num_slots), agg)

    def _warm_up(self, params: Any, opt_state: Any, batch: Any) -> None:
        """Compiles the step, and the exchange and landing of every fragment, on throwaway copies."""
        assert self._programs is not None
        copy = jax.tree.map(lambda x: x.copy(), (params, opt_state))
        p, s, _ = self.step(*copy, batch)
        for f in range(len(opt_state.outer_states)):
            leaves, _ = self._programs.contribution(f, s)
            delta = self._programs.finished(f, leaves, s)
            if self.exchange.land is not None:
                jax.block_until_ready(self._programs.land_now(f, delta, p, s))

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
            self._t = broadcast.host_count(opt_state)
        return self._t

    def _launch(self, f: int, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """After the step that sent fragment ``f``: its round, now (``sync_delay=0``) or beside the next steps.

        The round's contribution (the aggregate, the tokens since the last launch, the digest) is fixed
        here, in the main thread."""
        assert self._programs is not None and self._healing is not None and self._protocol is not None
        self._healing.keep(params, opt_state, self._digest)
        leaves, self._own_agg = self._programs.contribution(f, opt_state)
        c = protocol.Contribution(f, leaves, self._steps * self.tokens_per_step, self._digest)
        if self._encoded or self._rows is not None:  # the state that reads the others' messages or rows
            c = c._replace(agg_state=jax.tree.map(broadcast.host, opt_state.aggregate_states[f]))
        if self._encoded:  # what the aggregate sends
            c = c._replace(message=self._programs.message(f, opt_state))
        self._steps = 0
        if self.exchange.land is not None:
            return self._land(self._round_now(c, params, opt_state), params, opt_state)
        if self._lead:
            self._flight = self._pool.submit(self._protocol.run, c, self._adopt)
        else:  # the island's first process runs the round; the others learn it from _share
            self._flight = concurrent.futures.Future()
            self._flight.set_result(None)
        return params, opt_state

    def _round_now(self, c: protocol.Contribution, params: Any, opt_state: Any) -> protocol.Outcome:
        """A round run here and now (by the island's first process), its outcome on every process."""
        assert self._protocol is not None
        outcome = self._protocol.run(c, self._adopt) if self._lead else None
        return self._share(outcome, params, opt_state)

    def _adopt(self, got: Healed, own: protocol.Contribution | None) -> protocol.Adopted:
        """A healing state received in a round, made this island's (round thread): the trees, and the
        round's contribution: ``own`` where the island was only late (:meth:`_merges_late`), else zeros
        (a healed island weighs 0)."""
        assert self._healing is not None
        params, state = self._healing.adopt(got.state)
        f = self._fragment_of(state)
        if own is not None and self._merges_late(own, f):
            return protocol.Adopted((params, state), own._replace(digest=self._agreed(state)), late=True)
        zeros = [] if f is None else [np.zeros(x.shape, x.dtype) for x in self._fragment_leaves(state, f)]
        c = protocol.Contribution(f, zeros, 0.0, self._agreed(state))
        if (self._encoded or self._rows is not None) and f is not None:  # weight 0: no message; the
            c = c._replace(agg_state=state.aggregate_states[f])  # state reads the others' (or rows)
        return protocol.Adopted((params, state), c)

    def _merges_late(self, own: protocol.Contribution, f: int | None) -> bool:
        """Whether a late island's own contribution enters the round it catches up in: it trained since
        it last synchronised, on the fragment the round exchanges, and the round lands at once and
        merges plain pseudo-gradients (no per-island anchors, encoded messages or robust rows)."""
        plain = not (self.exchange.eager or self._encoded or self._rows is not None)
        return (
            plain
            and self.exchange.land is not None
            and f is not None
            and own.fragment == f
            and own.tokens > 0
        )

    def _fragment_of(self, opt_state: Any) -> int | None:
        """The fragment a state (just after a send) waits to exchange; None for one that never stepped."""
        t = broadcast.host_count(opt_state)
        if t == 0:
            return None
        sent = self.exchange.launches_after(t - 1)
        if len(sent) != 1:
            raise IslandsError(
                f"island {self.island_id}: healed from a state at step {t}, which sent no fragment."
            )
        return sent[0]

    def _fragment_leaves(self, state: Any, f: int) -> list[Any]:
        return landing.fragment_leaves(state, f, self.exchange)

    def _share(self, o: protocol.Outcome | None, params: Any, opt_state: Any) -> protocol.Outcome:
        """The round's outcome on every process of the island (its first process ran the round)."""
        if jax.process_count() == 1:
            assert o is not None
            return o
        return broadcast.outcome_everywhere(o, (params, opt_state), self._fragment_leaves, self.num_slots)

    # --------------------------------------------------------------- landing
    def _land(self, o: protocol.Outcome, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Writes a committed round into the state (after taking the healing state, if it healed)."""
        assert self._programs is not None
        own_agg = self._own_agg if o.healed is None or self._caught_up(o) else None
        if o.healed is not None:  # checked against this island's shapes when it arrived
            params, opt_state = landing.place_healed(o.healed, params, opt_state)
            self._t, self._own_agg, self._steps = None, None, 0
            self._unrecorded = []  # rounds of the life it left
        if self.exchange.eager:
            opt_state = landing.with_shares(o, opt_state, self.island_id)
        f = o.fragment
        if f < 0:  # a join round: nothing to land
            self._digest = self._agreed(opt_state)
            return params, opt_state
        delta = self._programs.finished(f, o.merged.delta, opt_state)
        aggs = list(opt_state.aggregate_states)
        if o.agg_state is not None:  # a robust rule's state after the round, the same on every member
            aggs[f] = jax.tree.map(lambda n, x: jax.device_put(n, x.sharding), o.agg_state, aggs[f])
        elif own_agg is not None:  # the residual this island's own send left (a healed one owes nothing)
            aggs[f] = own_agg
        s = opt_state._replace(aggregate_states=tuple(aggs))
        if self.exchange.land is None:  # the applying step reads it
            s = landing.with_pending(s, f, delta)
            self._unrecorded.append(o)
            if self.exchange.eager:  # what the next round's members check changes here, not at the record
                self._digest = self._agreed(s)
            return params, s
        params, s = self._programs.land_now(f, delta, params, s)
        self._record(o, params, s)
        return params, s

    def _caught_up(self, o: protocol.Outcome) -> bool:
        """Whether this island caught up in round ``o``: it took a peer's state and its weight is not 0."""
        m = o.merged
        return (
            o.healed is not None
            and self.island_id in m.participants
            and m.weights[m.participants.index(self.island_id)] > 0
        )

    def _agreed(self, opt_state: Any) -> str:
        """The digest the members of a round must agree on: the anchor, or under ``eager`` ``pending``."""
        return _sha256(opt_state.pending) if self.exchange.eager else anchor_sha256(opt_state)

    def _record(self, o: protocol.Outcome, params: Any, opt_state: Any) -> None:
        anchor = anchor_sha256(opt_state)
        caught_up = self._caught_up(o)
        w = o.waits
        rec = SyncRecord(
            round=o.round,
            step=broadcast.host_count(opt_state),
            fragment=o.fragment,
            participants=tuple(o.merged.participants),
            weights=tuple(o.merged.weights),
            healed=o.healed is not None and not caught_up,
            redone=o.redone,
            anchor_sha256=anchor,
            seconds=o.seconds,
            agreed_sha256=self._digest if self.exchange.eager else anchor,  # eager: kept at each landing
            quorum_seconds=w.quorum,
            heal_seconds=w.heal,
            exchange_seconds=w.exchange,
            vote_seconds=w.vote,
            backoff_seconds=w.backoff,
            waited_seconds=w.waited,
            rejected=tuple((r.island, r.reason) for r in o.rejected),
            sent_bytes=self.transport.sent_bytes() if self._lead else 0,
            caught_up=caught_up,
        )
        self.records.append(rec)
        self._digest = rec.agreed_sha256
        if self.on_sync is not None:
            self.on_sync(rec, params, opt_state)

    def _mask(self, params: Any) -> Any:
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), params)
        return self.step.placement(local).per_worker


def _check_rule_with(exchange: Any, rule: str) -> None:
    """A robust ``aggregate`` counts each island once: it takes no ``"tokens"`` weights."""
    if exchange.gathered is not None and rule != "mean":
        raise ValueError(
            f"`rule={rule!r}` weighs islands, and the diloco's aggregate {exchange.gathered.name}(...) counts "
            "every island's contribution once (an island in a round weighs 1, one that healed in it 0): "
            "use rule='mean'."
        )


def _check_step(step: Any) -> None:
    external = getattr(getattr(step, "tx", None), "external", None)
    if external is None:
        raise ValueError(
            "an Island needs a data_parallel_step whose `tx` is a jaxopt_dist.diloco(...) itself "
            f"(got {type(getattr(step, 'tx', None)).__name__})."
        )
    if not getattr(step, "per_worker_params", False):
        raise ValueError("an Island needs a data_parallel_step with per_worker_params=True (DiLoCo's).")
    if getattr(step, "donate", False):
        raise ValueError(
            "an Island cannot run a data_parallel_step built with donate=True: a peer may heal from the "
            "state a round launched with while the next steps run, and a donating step consumes it. "
            "Build the step with donate=False."
        )
    wire_merge = getattr(external.wire, "merge", "mean")
    if wire_merge not in ("mean", "chosen_mean"):
        raise ValueError(
            f"an Island cannot run this diloco's aggregate: it combines the workers' messages by "
            f"{wire_merge!r}, which islands do not make (chunked_top_k or sparseloco with "
            "clip_to_median_norm=True clips each worker by the median norm of all of them); a mean of "
            "each island's result would be another number. Use clip_to_median_norm=False across islands."
        )
    n = layout.mesh_axis_size(step.mesh, step.axis_name)
    if n != 1:
        raise ValueError(
            f"an island is one DiLoCo worker: its mesh's data axis {step.axis_name!r} must have size 1 "
            f"(got {n}); split the batch over its other devices with `batch_axes` (and `param_specs`), "
            "as for a sharded model."
        )
