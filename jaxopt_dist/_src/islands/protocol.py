"""The round protocol: quorum, one SUM all-reduce, the members' checks and vote, redone until it commits.

torchft's ``Manager`` plays this part for torch: here one round is, on every
island, attempts of::

    healed = transport.quorum(timeout)   # a lagging island heals here (weight 0), or catches up (its own weight)
    merged = unpack(transport.allreduce(pack(...)))
    # where the sum is not finite, at once, to find and drop the island that sent a NaN or an infinity:
    merged = combine(transport.allgather(seal(...)))
    # or, for an encoded aggregate, a robust rule or under a shared secret (:mod:`.gather`):
    merged = combine(transport.allgather(seal(...)))   # records refused on a bad tag are dropped
    verdict = checks of merged           # ids, settings, rounds, anchors
    transport.commit(verdict.ok)         # every member's vote; False for all if one fails

until an attempt commits. A healing state the transport refuses
(:class:`HealRefused`) is never loaded: where the round gathers, the island
then sends an abstaining record (weight 0, no payload) and votes with the
others, who commit the attempt without it, and it heals again in its next
quorum; where it all-reduces, the attempt fails. Between attempts an island pauses (backoff with
jitter); the whole round, quorum and heal included, ends within
``round_timeout``. The checks, every member reading the same summed buffer:

* two live islands with one id: the one that healed in the round (it is the
  one catching up), else the one whose process joined later, else the larger
  nonce, is refused (:class:`IslandRefused`); the others redo the round;
* settings that must match (:class:`Settings`): members outside the majority
  are refused, naming the difference (all of them when no majority);
* rounds differ (a member of another quorum): redone;
* anchors differ: members outside the majority fall behind and heal from it
  in the next attempt; with no majority (or in the join round, where nothing
  has trained yet) they leave with an error.

Nothing here touches the island's arrays on its devices (a robust rule's program runs on host copies of
the rows, on one device of this process, with no collective): a round runs beside the island's steps.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxopt_dist._src.islands import gather, merge, wire
from jaxopt_dist._src.islands.transport import (
    ExchangeError,
    Healed,
    HealRefused,
    IslandRefused,
    IslandsError,
    Transport,
)

_log = logging.getLogger("jaxopt_dist.islands")

BACKOFF_FIRST = 0.05
"""Seconds of the pause after a round's first failed attempt; it doubles after each."""
BACKOFF_MAX = 1.0
"""The longest pause between two attempts; each pause is also scaled by a random factor in [0.5, 1)."""

RULE_CODES = {"mean": 0, "tokens": 1}


class Settings(NamedTuple):
    """What every island of a run must share, as integers (tags: 24 bits of a SHA-256).

    Attributes:
      sync_every: ``H``.
      num_fragments: the fragments.
      sync_delay: steps between a fragment's send and the step that applies it
        (``sync_delay + 1`` with overlap; 0 when the exchange lands at once).
      eager: 1 under ``eager``.
      rule: the merge rule (0 ``"mean"``, 1 ``"tokens"``).
      model: tag of the parameters' shapes and dtypes.
      state: tag of the optimizer state's structure, shapes and dtypes (the
        inner and outer optimizers and the aggregate).
      fragments: tag of the leaves each fragment holds.
    """

    sync_every: int
    num_fragments: int
    sync_delay: int
    eager: int
    rule: int
    model: int
    state: int
    fragments: int

    @classmethod
    def of(cls, exchange: Any, rule: str, params: Any, opt_state: Any) -> Settings:
        """The settings of an island running ``exchange`` (a diloco's ``external``) on this state."""
        gap = (exchange.land_phase[0] - exchange.launch_phase[0]) % exchange.sync_every
        return cls(
            sync_every=int(exchange.sync_every),
            num_fragments=len(exchange.launch_phase),
            sync_delay=int(gap),
            eager=int(bool(exchange.eager)),
            rule=RULE_CODES[rule],
            model=_tag([(np.shape(x), str(x.dtype)) for x in jax.tree.leaves(params)]),
            state=_tag(
                (
                    str(jax.tree.structure(opt_state)),
                    [(np.shape(x), str(x.dtype)) for x in jax.tree.leaves(opt_state)],
                    # a robust rule's name (islands with the mean and with a rule would not meet on the wire)
                    *([] if exchange.gathered is None else [exchange.gathered.name]),
                )
            ),
            fragments=_tag(exchange.fragments(opt_state.anchor)),
        )

    def vector(self) -> tuple[float, ...]:
        return tuple(float(v) for v in self)

    @classmethod
    def from_values(cls, values: Any) -> Settings:
        return cls(*(int(round(float(v))) for v in values))

    def differences(self, other: Settings, who: str) -> list[str]:
        """What differs between these settings (this island's) and ``other`` (``who``'s), in words."""
        out = []
        for name in ("sync_every", "num_fragments", "sync_delay", "eager"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name} is {a} here and {b} on {who}")
        if self.rule != other.rule:
            names = {v: k for k, v in RULE_CODES.items()}
            out.append(f"rule is {names.get(self.rule)!r} here and {names.get(other.rule)!r} on {who}")
        words = {
            "model": "the model's parameter shapes or dtypes",
            "state": "the optimizer state (inner or outer optimizer, or aggregate)",
            "fragments": "the leaves of each fragment",
        }
        out += [f"{words[k]} differ from {who}'s" for k in words if getattr(self, k) != getattr(other, k)]
        return out


def _tag(value: Any) -> int:
    return int(hashlib.sha256(repr(value).encode()).hexdigest()[: merge.TAG_BITS // 4], 16)


class Contribution(NamedTuple):
    """What an island brings to a round, fixed when the round launches.

    Attributes:
      fragment: the fragment exchanged (None: the join round, nothing to merge).
      leaves: the island's aggregate of the fragment (host arrays).
      tokens: tokens trained on since the island's previous launch (its weight under ``"tokens"``).
      digest: SHA-256 of what the members must agree on before the round.
      message: what the island sends where the round gathers (:mod:`.gather`):
        its aggregate's encoded message (None: ``leaves`` themselves).
      agg_state: the aggregate's state of the fragment before the round (decodes the messages).
    """

    fragment: int | None
    leaves: list[np.ndarray]
    tokens: float
    digest: str
    message: list[np.ndarray] | None = None
    agg_state: Any = None


class Adopted(NamedTuple):
    """A healing state made this island's: host ``(params, opt_state)`` and the round's new contribution.

    ``late``: the island was only late (it missed rounds, its anchor one the others held): the
    contribution is its own pseudo-gradient, merged with its weight; else it weighs 0."""

    trees: Any
    contribution: Contribution
    late: bool = False


@dataclasses.dataclass
class Waits:
    """The longest wait of each kind in one round (seconds), failed ones included; ``backoff``: all
    pauses together; ``waited``: every quorum wait together (how long the round took to form)."""

    quorum: float = 0.0
    heal: float = 0.0
    exchange: float = 0.0
    vote: float = 0.0
    backoff: float = 0.0
    waited: float = 0.0

    def note(self, kind: str, seconds: float) -> None:
        if kind == "backoff":
            self.backoff += seconds
        else:
            setattr(self, kind, max(getattr(self, kind), seconds))
        if kind == "quorum":
            self.waited += seconds

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Notes how long the block took, also when it raises."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.note(kind, time.monotonic() - start)


@dataclasses.dataclass
class Outcome:
    """A committed round, before it lands: host values only (a round runs beside the steps)."""

    fragment: int  # -1: the join round
    merged: merge.Merged
    healed: Any  # the healing (params, opt_state) as host trees, or None
    round: int
    redone: int
    seconds: float
    waits: Waits = dataclasses.field(default_factory=Waits)
    rejected: list[wire.Rejected] = dataclasses.field(default_factory=list)
    agg_state: Any = None  # a robust rule's aggregate state after the round (host), None: the island's own


class Verdict(NamedTuple):
    """What one attempt's checks decided: commit (``ok``), heal in the next attempt, leave, or redo."""

    ok: bool
    reason: str = ""
    heal: bool = False
    leave: IslandsError | None = None


class RoundProtocol:
    """Runs rounds for one island over ``transport`` (see the module).

    Args:
      transport: the island's :class:`Transport` (bound).
      island_id: the island's slot.
      num_slots: the buffer's slots.
      rule: ``"mean"`` or ``"tokens"``.
      round_timeout: seconds a whole round may take.
      settings: this island's :class:`Settings`.
      gather: a :class:`~.gather.Exchange`: the round gathers every member's
        sealed record and combines them (encoded aggregates, a robust rule,
        a shared secret); None: one SUM all-reduce.
      fallback: with ``gather`` None, the :class:`~.gather.Exchange` of the
        island's plain leaves: an attempt whose sum is not finite gathers
        them at once, and the members leave out (weight 0) every
        contribution with a NaN or an infinity.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        island_id: int,
        num_slots: int,
        rule: str,
        round_timeout: float,
        settings: Settings,
        gather: gather.Exchange | None = None,
        fallback: gather.Exchange | None = None,
    ):
        self.gather, self.fallback = gather, fallback
        self.transport, self.island_id, self.num_slots = transport, island_id, num_slots
        self.rule, self.round_timeout, self.settings = rule, round_timeout, settings
        self.nonce = secrets.randbelow(2**merge.NONCE_BITS)
        self.joined: int | None = None  # the round this process joined the others in

    def run(self, c: Contribution, adopt: Callable[[Healed, Contribution | None], Adopted]) -> Outcome:
        """One round: attempts until one commits. ``adopt(healed, own)`` makes a healing state this
        island's (and may refuse it); ``own`` is the island's contribution, which it may keep where it
        was only late (None once its anchor was found to differ from the others': its work is void).
        Raises :class:`IslandsError` (having left) when the round cannot commit in time."""
        start = time.monotonic()
        deadline = start + self.round_timeout
        healed, late, void, waits, refusals = None, False, False, Waits(), []
        for attempt in range(2**31):
            verdict, done, abstained = Verdict(False), None, False
            try:
                try:
                    got = self._quorum(deadline, waits)
                except HealRefused as e:  # refused by the transport: nothing of it was loaded
                    refusals.append(self._refusal(e))
                    abstained = self._abstain(waits)
                    raise
                if got is not None:
                    adopted = adopt(got, None if void else c)
                    healed, c, late = adopted.trees, adopted.contribution, adopted.late
                done = self._exchange(c, healed is not None, waits, weighs=healed is None or late)
                verdict = self._check(done.merged, healed is not None)
            except ExchangeError as e:
                verdict = Verdict(False, str(e))
            except IslandsError:
                self.transport.close()
                raise
            with waits.timed("vote"):
                committed = self.transport.commit(verdict.ok or abstained)
            if committed and done is not None:
                rounds = self.transport.rounds_committed() - 1
                frag = -1 if c.fragment is None else c.fragment
                seconds = time.monotonic() - start
                rejected = refusals + done.rejected
                return Outcome(
                    frag, done.merged, healed, rounds, attempt, seconds, waits, rejected, done.state
                )
            if verdict.leave is not None:
                self.transport.close()
                raise verdict.leave
            if verdict.heal:
                void = True
                self._fall_behind(verdict.reason)
            self._pause(attempt, deadline, waits, verdict.reason)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- attempts
    def _quorum(self, deadline: float, waits: Waits) -> Healed | None:
        left = deadline - time.monotonic() - self.transport.exchange_seconds
        if left <= 0:
            raise self._late("no time was left for a quorum and an exchange")
        start, got = time.monotonic(), None
        try:
            got = self.transport.quorum(left)
        finally:
            heal = got.seconds if got is not None else 0.0
            waits.note("quorum", time.monotonic() - start - heal)
            waits.note("heal", heal)
        if self.joined is None:
            self.joined = self.transport.rounds_committed()
        return got

    def _exchange(self, c: Contribution, healed: bool, waits: Waits, *, weighs: bool) -> gather.Gathered:
        """The attempt's exchange; ``healed``: this island took a peer's state in the round; ``weighs``:
        its contribution counts (it did not heal, or it was only late)."""
        weight = (
            0.0 if c.fragment is None else merge.island_weight(self.rule, healed=not weighs, tokens=c.tokens)
        )
        if self.gather is not None:
            return self._gathered(c, weight, healed, waits, self.gather)
        buf = merge.pack(
            c.leaves,
            weight,
            slot=self.island_id,
            num_slots=self.num_slots,
            round=self.transport.rounds_committed(),
            anchor=merge.anchor_tag(c.digest),
            behind=healed,
            joined=self.joined or 0,
            nonce=self.nonce,
            settings=self.settings.vector(),
        )
        with waits.timed("exchange"):
            total = self.transport.allreduce(buf)
        merged = merge.unpack(total, c.leaves, num_slots=self.num_slots)
        if self.fallback is None or all(np.all(np.isfinite(d)) for d in merged.delta):
            return gather.Gathered(merged, [])
        # Every member sums the same NaN or infinity, so every member gathers now.
        _log.warning("island %d: the round's sum is not finite; gathering the contributions", self.island_id)
        return self._gathered(c._replace(message=None), weight, healed, waits, self.fallback)

    def _gathered(
        self, c: Contribution, weight: float, healed: bool, waits: Waits, ex: gather.Exchange
    ) -> gather.Gathered:
        """The round over the gather path: this island's sealed record out, every member's in, combined."""
        fragment = -1 if c.fragment is None else c.fragment
        header = self._header(fragment, weight, merge.anchor_tag(c.digest), healed=healed)
        record = ex.seal(header, c.leaves if c.message is None else c.message)
        with waits.timed("exchange"):
            records = self.transport.allgather(record)
        got = gather.combine(records, ex, fragment, num_slots=self.num_slots, state=c.agg_state)
        for r in got.rejected:
            _log.warning(
                "island %d dropped a contribution from island %s: %s", self.island_id, r.island, r.reason
            )
        return got

    def _header(self, fragment: int, weight: float, anchor: int, **flags: bool) -> wire.Header:
        """This island's record header in this attempt (``flags``: ``healed``, ``abstains``)."""
        return wire.Header(
            island=self.island_id,
            round=self.transport.rounds_committed(),
            fragment=fragment,
            weight=weight,
            anchor=anchor,
            joined=self.joined or 0,
            nonce=self.nonce,
            settings=tuple(int(v) for v in self.settings),
            **flags,
        )

    def _refusal(self, e: HealRefused) -> wire.Rejected:
        """A refused healing state, as the round's record lists it (its source, if known, and why)."""
        _log.warning("island %d refused a healing state: %s", self.island_id, e)
        return wire.Rejected(e.source, str(e))

    def _abstain(self, waits: Waits) -> bool:
        """After a refused heal, where the round gathers: an abstaining record in the attempt's exchange
        (weight 0, no payload), so that the others' exchange and vote go on at once without this
        island, which heals again in its next quorum. False where the round all-reduces (an island
        that cannot say which fragment the round holds cannot size its buffer: the attempt fails)."""
        if self.gather is None:
            return False
        header = self._header(-1, 0.0, 0, abstains=True)
        try:
            with waits.timed("exchange"):
                self.transport.allgather(self.gather.seal(header, []))
        except ExchangeError:
            return False
        return True

    def _fall_behind(self, reason: str) -> None:
        try:
            self.transport.fall_behind()
        except NotImplementedError as e:
            self.transport.close()
            raise IslandsError(f"island {self.island_id} leaves: {reason}; {e}") from e

    def _pause(self, attempt: int, deadline: float, waits: Waits, reason: str) -> None:
        """Backoff with jitter before the next attempt; gives up (leaving) once the deadline has passed."""
        left = deadline - time.monotonic()
        if left <= self.transport.exchange_seconds:
            self.transport.close()
            raise self._late(f"{attempt + 1} attempts; the last: {reason or 'not committed'}")
        pause = min(BACKOFF_MAX, BACKOFF_FIRST * 2**attempt) * (0.5 + 0.5 * secrets.randbelow(1000) / 1000)
        pause = min(pause, left - self.transport.exchange_seconds)
        with waits.timed("backoff"):
            time.sleep(pause)

    def _late(self, what: str) -> IslandsError:
        return IslandsError(
            f"island {self.island_id}: the round did not commit within round_timeout={self.round_timeout:g} s ({what})"
        )

    # ---------------------------------------------------------------- checks
    def _check(self, m: merge.Merged, healed: bool) -> Verdict:
        """What this island makes of the summed buffer (every member reads the same one)."""
        if self.island_id not in m.participants:
            return Verdict(False, "this island's own slot is missing from the sum")
        verdict = self._ids(m, healed)
        for check in (self._settings, self._rounds, self._anchors):
            verdict = verdict or check(m)
        return verdict or Verdict(True)

    def _ids(self, m: merge.Merged, healed: bool) -> Verdict | None:
        """Two live islands with one id: the newer claim is refused (see the module)."""
        clashes = [s for s, n in zip(m.participants, m.counts) if n > 1]
        if not clashes:
            return None
        reason = f"island ids {clashes} are claimed by more than one live island"
        if self.island_id not in clashes:
            return Verdict(False, reason)
        k = m.participants.index(self.island_id)
        if m.counts[k] > 2:
            return Verdict(False, reason, leave=self._refused(f"{m.counts[k]} live islands claim it"))
        mine = (int(healed), self.joined or 0, self.nonce)
        other = (round(m.behind[k]) - mine[0], m.joined[k] - mine[1], m.nonces[k] - mine[2])
        if mine <= other:  # the other claim is the newer one: it is refused
            return Verdict(False, reason)
        if mine[0] > other[0]:
            why = "the other one is up to date and this one healed in this round"
        elif mine[1] > other[1]:
            why = f"the other one's process joined in round {other[1]}, this one's in round {mine[1]}"
        else:
            why = "both joined in the same round; this one drew the larger nonce"
        return Verdict(False, reason, leave=self._refused(f"another live island holds it ({why})"))

    def _refused(self, why: str) -> IslandRefused:
        return IslandRefused(
            f"island {self.island_id} is refused: its id is in use: {why}. "
            "Start it with a free island id, or stop the other one first."
        )

    def _settings(self, m: merge.Merged) -> Verdict | None:
        groups = collections.Counter(m.settings)
        if len(groups) <= 1:
            return None
        mine = self.settings.vector()
        top, n_top = groups.most_common(1)[0]
        majority = n_top * 2 > len(m.participants) and list(groups.values()).count(n_top) == 1
        reason = f"the members' settings differ ({len(groups)} kinds)"
        if majority and mine == top:
            return Verdict(False, reason)
        others = [(s, v) for s, v in zip(m.participants, m.settings) if v != mine]
        slot, theirs = (m.participants[m.settings.index(top)], top) if majority else others[0]
        words = self.settings.differences(Settings.from_values(theirs), f"island {slot}")
        side = "the majority's" if majority else "another member's (no settings are held by a majority)"
        return Verdict(
            False,
            reason,
            leave=IslandRefused(
                f"island {self.island_id} is refused: its settings differ from {side}: " + "; ".join(words)
            ),
        )

    def _rounds(self, m: merge.Merged) -> Verdict | None:
        if len(set(m.rounds)) <= 1:
            return None
        return Verdict(False, f"members of one round are in different rounds: {m.rounds}")

    def _anchors(self, m: merge.Merged) -> Verdict | None:
        if len(set(m.anchors)) <= 1:
            return None
        score: dict[int, tuple[int, int]] = {}
        for tag, behind in zip(m.anchors, m.behind):
            n, fresh = score.get(tag, (0, 0))
            score[tag] = (n + 1, fresh + (behind < 0.5))
        best = max(score.values())
        winners = [t for t, s in score.items() if s == best]
        mine = m.anchors[m.participants.index(self.island_id)]
        reason = f"the members' anchors differ: tags {m.anchors} of islands {m.participants}"
        if len(winners) == 1 and mine == winners[0]:
            return Verdict(False, reason)
        if len(winners) == 1 and self.transport.rounds_committed() > 0:
            return Verdict(False, reason, heal=True)  # heal from the majority in the next attempt
        what = (
            "this island's parameters differ from the others' (did every island start from the same ones?)"
            if self.transport.rounds_committed() == 0
            else "no anchor is held by a majority of the round's members"
        )
        return Verdict(False, reason, leave=IslandsError(f"island {self.island_id} leaves: {reason}; {what}"))
