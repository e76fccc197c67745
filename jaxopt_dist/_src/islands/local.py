"""Islands as threads of one process: a lighthouse and a wire in memory, which fail as the real ones do.

:class:`LocalHub` forms quorums as torchft's lighthouse does and sums the
members' buffers; it keeps every island's transport under a key of its own
(as torchft adds a uuid to each replica id), so two live islands may claim
the same id, as they can over torchft. Its faults are those of processes and
sockets: an island killed before the sum fails the round for every member
(a closed socket); one killed after contributing, or one whose exchange fails
after the others have their sum (gloo can finish on some members and fail on
others), leaves the others with a sum and no agreement, which the commit
vote catches.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxopt_dist._src.islands import heal_http, wire
from jaxopt_dist._src.islands.transport import (
    ExchangeError,
    Healed,
    HealRefused,
    IslandsError,
    Transport,
    ring_bytes,
)


class IslandKilled(BaseException):
    """Raised in an island's thread after :meth:`LocalHub.kill` (a test's way to make it die)."""


@dataclasses.dataclass
class _Round:
    members: tuple[int, ...]  # transport keys
    max_step: int
    source: int
    ids: tuple[int, ...] = ()  # the members' island ids
    # the members' buffers of each collective of the round in turn (an all-reduce, then an all-gather
    # where its sum is not finite), and how many each member has entered
    stages: list[dict[int, np.ndarray]] = dataclasses.field(default_factory=list)
    calls: dict[int, int] = dataclasses.field(default_factory=dict)
    totals: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    failed: bool = False
    votes: dict[int, bool] = dataclasses.field(default_factory=dict)


class LocalHub:
    """The lighthouse and the wire for islands that are threads of one process.

    Quorum as torchft's lighthouse forms it: once every live island has asked
    (or ``join_timeout`` after the first asked, with at least ``min_islands``),
    the islands that asked form the round; one behind the others' committed
    count heals from one that is not. Faults (for tests): :meth:`kill` (an
    island dies; a round it is in fails for every member if their sum is not
    made yet), :meth:`kill_in_exchange` (an island dies in its next all-reduce
    after its contribution is in: the others get their sum) and
    :meth:`fail_exchange` (an island's next all-reduce fails for it alone,
    after the others have their sum).

    Args:
      min_islands: fewest islands in a round.
      join_timeout: seconds a quorum waits for live islands that have not asked.
      timeout: seconds an all-reduce or a vote may wait for the other members
        (then it fails), and the longest any quorum waits.
    """

    def __init__(self, *, min_islands: int = 2, join_timeout: float = 0.05, timeout: float = 30.0):
        self.min_islands, self.join_timeout, self.timeout = min_islands, join_timeout, timeout
        self._cv = threading.Condition()
        self._keys = itertools.count()
        self._live: dict[int, LocalTransport] = {}
        self._asking: dict[int, float] = {}
        self._rounds: dict[int, _Round] = {}
        self._gone: set[int] = set()  # killed or left
        self._faults: dict[int, str] = {}  # island id -> "kill" | "fail", in its next all-reduce

    def transport(self, *, secret: bytes | str | None = None) -> LocalTransport:
        """A new island's transport on this hub (``secret``: its shared secret, as the torchft transport's)."""
        return LocalTransport(self, secret=secret)

    # ---------------------------------------------------------------- faults
    def kill(self, island_id: int) -> None:
        """Island ``island_id`` dies: it leaves every quorum, and a round it is in fails if its
        contribution is not in yet (the others' sum cannot be made)."""
        with self._cv:
            for key, t in [(k, t) for k, t in self._live.items() if t.island_id == island_id]:
                t.killed = True
                self._gone_now(key)
            self._cv.notify_all()

    def kill_in_exchange(self, island_id: int) -> None:
        """Island ``island_id`` dies in its next all-reduce, once its contribution is in."""
        with self._cv:
            self._faults[island_id] = "kill"

    def fail_exchange(self, island_id: int) -> None:
        """Island ``island_id``'s next all-reduce fails for it alone, after the others have their sum."""
        with self._cv:
            self._faults[island_id] = "fail"

    # ------------------------------------------------------------ membership
    def _gone_now(self, key: int) -> None:
        """``key`` is dead or has left: out of every quorum; its round fails if its contribution is missing."""
        self._live.pop(key, None)
        self._asking.pop(key, None)
        self._gone.add(key)
        r = self._rounds.get(key)
        if r is not None and (not r.stages or key not in r.stages[-1]):
            r.failed = True

    def join(self, t: LocalTransport) -> int:
        with self._cv:
            key = next(self._keys)
            self._live[key] = t
            self._cv.notify_all()
            return key

    def leave(self, key: int) -> None:
        with self._cv:
            if key in self._live:
                self._gone_now(key)
            self._cv.notify_all()

    def _check_alive(self, t: LocalTransport) -> None:
        if t.killed:
            raise IslandKilled(f"island {t.island_id} was killed")

    def _wait(self, t: LocalTransport, ready: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not ready():
            self._check_alive(t)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cv.wait(min(left, 0.01))
        self._check_alive(t)
        return True

    def quorum(self, t: LocalTransport, timeout: float) -> _Round:
        with self._cv:
            self._rounds.pop(t.key, None)
            self._asking[t.key] = time.monotonic()
            self._cv.notify_all()
            wait = min(timeout, self.timeout)
            if not self._wait(t, lambda: self._try_form(t.key), wait):
                self._asking.pop(t.key, None)
                raise IslandsError(f"island {t.island_id}: no quorum of islands within {wait:g} s")
            return self._rounds[t.key]

    def _try_form(self, key: int) -> bool:
        if key in self._rounds:
            return True
        asking = sorted(self._asking)
        if len(asking) < self.min_islands:
            return False
        everyone = set(asking) >= set(self._live)
        if not everyone and time.monotonic() - min(self._asking.values()) < self.join_timeout:
            return False
        steps = {k: self._live[k].committed for k in asking}
        top = max(steps.values())
        source = min((k for k in asking if steps[k] == top), key=lambda k: self._live[k].island_id)
        r = _Round(tuple(asking), top, source, tuple(self._live[k].island_id for k in asking))
        for k in asking:
            self._rounds[k] = r
        self._asking.clear()
        self._cv.notify_all()
        return True

    def source_of(self, r: _Round) -> LocalTransport:
        with self._cv:
            if r.source not in self._live:
                raise ExchangeError("the healing source left")
            return self._live[r.source]

    # -------------------------------------------------------------- exchange
    def allreduce(self, t: LocalTransport, r: _Round, buf: np.ndarray) -> np.ndarray:
        return self._collect(t, r, buf, lambda stage, n: self._sum(r, stage, n))

    def allgather(self, t: LocalTransport, r: _Round, record: np.ndarray) -> list[np.ndarray]:
        """Every member's ``record``, in the members' order (as ``allreduce``, without the sum)."""
        return self._collect(t, r, record, lambda stage, n: [stage[k].copy() for k in r.members])

    def _collect(self, t: LocalTransport, r: _Round, buf: np.ndarray, result: Callable[..., Any]) -> Any:
        with self._cv:
            self._check_alive(t)
            fault = self._faults.pop(t.island_id, None)
            if r.failed:
                raise ExchangeError(f"island {t.island_id}: a member of the round died")
            n = r.calls.get(t.key, 0)  # this member's n-th collective of the round meets the others' n-th
            r.calls[t.key] = n + 1
            while len(r.stages) <= n:
                r.stages.append({})
            stage = r.stages[n]
            stage[t.key] = buf
            self._cv.notify_all()
            if fault == "kill":  # its contribution is in: the others can make their sum
                t.killed = True
                self._gone_now(t.key)
                raise IslandKilled(f"island {t.island_id} was killed in its all-reduce")
            done = lambda: r.failed or len(stage) == len(r.members)  # noqa: E731
            if not self._wait(t, done, self.timeout):
                r.failed = True
                raise ExchangeError(f"island {t.island_id}: the all-reduce timed out after {self.timeout} s")
            if r.failed:
                raise ExchangeError(f"island {t.island_id}: a member of the round died")
            total = result(stage, n)
            if fault == "fail":
                raise ExchangeError(f"island {t.island_id}: its all-reduce failed after the others finished")
            return total

    def _sum(self, r: _Round, stage: dict[int, np.ndarray], n: int) -> np.ndarray:
        if n not in r.totals:
            shapes = {c.shape for c in stage.values()}
            if len(shapes) > 1:
                r.failed = True
                raise ExchangeError(f"the round's buffers differ in shape: {sorted(shapes)}")
            r.totals[n] = np.sum([stage[k] for k in r.members], axis=0, dtype=np.float32)
        return r.totals[n].copy()

    def vote(self, t: LocalTransport, r: _Round, ok: bool) -> bool:
        with self._cv:
            r.votes[t.key] = bool(ok)
            self._cv.notify_all()
            missing = lambda: [k for k in r.members if k not in r.votes]  # noqa: E731
            done = lambda: not missing() or any(k in self._gone for k in missing())  # noqa: E731
            if not self._wait(t, done, self.timeout) or missing():
                return False
            return all(r.votes[k] for k in r.members)


class LocalTransport(Transport):
    """One island's side of a :class:`LocalHub` (islands as threads of one process)."""

    def __init__(self, hub: LocalHub, *, secret: bytes | str | None = None):
        self.hub = hub
        self.secret = wire.check_secret(secret)
        self._sent = 0
        self.island_id, self.key = -1, -1
        self.committed = 0
        self.killed = False
        self._serve: Callable[[], Any] | None = None
        self._expect: heal_http.Expected | None = None
        self._round: _Round | None = None
        self._refused = False  # this attempt's heal was refused

    @property
    def exchange_seconds(self) -> float:
        return 2 * self.hub.timeout

    def bind(self, island_id: int, serve: Callable[[], Any], expect: Any = None) -> None:
        self.island_id, self._serve, self._expect = island_id, serve, expect
        self.key = self.hub.join(self)

    def quorum(self, timeout: float) -> Healed | None:
        """The next quorum; a heal crosses as the healing stream (:mod:`.heal_http`, in memory), tagged
        under the source's secret and checked as over HTTP (raises :class:`HealRefused`)."""
        self._refused = False
        r = self.hub.quorum(self, timeout)
        self._round = r
        if self.committed >= r.max_step:
            return None
        start = time.monotonic()
        source = self.hub.source_of(r)
        assert source._serve is not None
        staged = heal_http.stage(
            source._serve(), step=r.max_step, source=source.island_id, secret=source.secret
        )
        try:
            state = heal_http.read(
                io.BytesIO(b"".join(bytes(c) for c in staged.chunks())),
                where="the in-process hub",
                secret=self.secret,
                expect=self._expect,
            )
        except HealRefused:
            self._refused = True
            raise
        self.committed = r.max_step
        return Healed(state, time.monotonic() - start)

    def members(self) -> tuple[int, ...]:
        """The island ids of the members of this island's last quorum."""
        return () if self._round is None else self._round.ids

    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        assert self._round is not None, "allreduce before quorum"
        self._sent += ring_bytes(buf.nbytes, len(self._round.members), gather=False)
        return self.hub.allreduce(self, self._round, buf)

    def allgather(self, record: np.ndarray) -> list[np.ndarray]:
        assert self._round is not None, "allgather before quorum"
        self._sent += ring_bytes(record.nbytes, len(self._round.members), gather=True)
        return self.hub.allgather(self, self._round, record)

    def commit(self, ok: bool) -> bool:
        assert self._round is not None, "commit before quorum"
        agreed = self.hub.vote(self, self._round, ok) and not self._refused  # refused: it abstained
        if agreed:
            self.committed += 1
        return agreed

    def sent_bytes(self) -> int:
        """The bytes a ring would send for this island's exchanges (no wire: counted, not sent)."""
        return self._sent

    def fall_behind(self) -> None:
        self.committed = max(self.committed - 1, 0)

    def rounds_committed(self) -> int:
        return self.committed

    def close(self) -> None:
        self.hub.leave(self.key)
