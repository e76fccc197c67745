"""The transport between islands: what a round needs, and an in-process implementation for tests.

A round, as :class:`~.island.Island` runs it on every island::

    healed = transport.quorum()          # membership; a lagging island heals here
    total = transport.allreduce(buffer)  # one SUM all-reduce; raises ExchangeError
    if transport.commit(): ...           # every member's all-reduce succeeded

An exchange that fails (a member died) is run again with the same buffer
among a new quorum of the survivors. :class:`LocalHub` implements this for
islands that are threads of one process (no torch needed); the torchft
transport (:mod:`.torchft`) between processes.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


class IslandsError(RuntimeError):
    """An island cannot go on: no quorum formed within the bound, or a transport failed for good."""


class ExchangeError(RuntimeError):
    """An all-reduce among the round's members failed (a member died or stalled); the round is run again."""


class Transport(abc.ABC):
    """What an island needs of the link to the others (one object per island)."""

    @abc.abstractmethod
    def bind(self, island_id: int, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Joins as ``island_id``; ``save()`` gives this island's healing state, ``load(state)`` takes one."""

    @abc.abstractmethod
    def quorum(self) -> bool:
        """Waits for the next round's quorum; heals (calls ``load``) if this island is behind.

        Returns whether it healed. Raises :class:`IslandsError` when no quorum formed in time.
        """

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        """The SUM of ``buf`` over the quorum's members; raises :class:`ExchangeError` on a failure."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Marks this attempt failed (the next :meth:`commit` returns False), e.g. members disagreed."""

    @abc.abstractmethod
    def commit(self) -> bool:
        """Whether the round's exchange succeeded; True advances the committed-round count."""

    @abc.abstractmethod
    def rounds_committed(self) -> int:
        """Rounds this island has committed (after healing: its source's count)."""

    def close(self) -> None:  # noqa: B027 (optional to override)
        """Leaves; the others' next quorum goes on without this island."""


@dataclasses.dataclass
class _Round:
    members: tuple[int, ...]
    max_step: int
    source: int
    contributions: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    total: np.ndarray | None = None
    failed: bool = False


class LocalHub:
    """The lighthouse and the wire for islands that are threads of one process.

    Quorum as torchft's lighthouse forms it: once every live island has asked
    (or ``join_timeout`` after the first asked, with at least ``min_islands``),
    the islands that asked form the round; one behind the others' committed
    count heals from one that is not. :meth:`kill` makes an island dead: a
    round it belongs to fails for every member (as a closed socket fails a
    gloo all-reduce), and its next call to the hub raises
    :class:`IslandKilled`.

    Args:
      min_islands: fewest islands in a round.
      join_timeout: seconds a quorum waits for live islands that have not asked.
      timeout: seconds any wait may last (quorum included) before
        :class:`IslandsError`.
    """

    def __init__(self, *, min_islands: int = 2, join_timeout: float = 0.05, timeout: float = 30.0):
        self.min_islands, self.join_timeout, self.timeout = min_islands, join_timeout, timeout
        self._cv = threading.Condition()
        self._live: dict[int, LocalTransport] = {}
        self._asking: dict[int, float] = {}
        self._rounds: dict[int, _Round] = {}
        self._dead: set[int] = set()

    def transport(self) -> LocalTransport:
        """A new island's transport on this hub."""
        return LocalTransport(self)

    def kill(self, island_id: int) -> None:
        """Island ``island_id`` dies: it leaves every quorum, and a round it is in fails."""
        with self._cv:
            self._dead.add(island_id)
            self._live.pop(island_id, None)
            self._asking.pop(island_id, None)
            r = self._rounds.get(island_id)
            if r is not None and r.total is None:
                r.failed = True
            self._cv.notify_all()

    def _check_alive(self, island_id: int) -> None:
        if island_id in self._dead:
            raise IslandKilled(f"island {island_id} was killed")

    def _wait(self, island_id: int, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            self._check_alive(island_id)
            left = deadline - time.monotonic()
            if left <= 0:
                raise IslandsError(f"island {island_id}: nothing happened within {self.timeout} s")
            self._cv.wait(min(left, 0.01))
        self._check_alive(island_id)

    def join(self, t: LocalTransport) -> None:
        with self._cv:
            self._dead.discard(t.island_id)
            self._live[t.island_id] = t
            self._cv.notify_all()

    def leave(self, island_id: int) -> None:
        with self._cv:
            self._live.pop(island_id, None)
            self._asking.pop(island_id, None)
            self._cv.notify_all()

    def quorum(self, island_id: int) -> _Round:
        with self._cv:
            self._rounds.pop(island_id, None)
            self._asking[island_id] = time.monotonic()
            self._cv.notify_all()
            self._wait(island_id, lambda: self._try_form(island_id))
            return self._rounds[island_id]

    def _try_form(self, island_id: int) -> bool:
        if island_id in self._rounds:
            return True
        asking = sorted(self._asking)
        if len(asking) < self.min_islands:
            return False
        everyone = set(asking) >= set(self._live)
        if not everyone and time.monotonic() - min(self._asking.values()) < self.join_timeout:
            return False
        steps = {i: self._live[i].committed for i in asking}
        top = max(steps.values())
        r = _Round(tuple(asking), top, min(i for i in asking if steps[i] == top))
        for i in asking:
            self._rounds[i] = r
        self._asking.clear()
        self._cv.notify_all()
        return True

    def allreduce(self, island_id: int, r: _Round, buf: np.ndarray) -> np.ndarray:
        with self._cv:
            self._check_alive(island_id)
            if r.failed:
                raise ExchangeError(f"island {island_id}: a member of the round died")
            r.contributions[island_id] = buf
            self._cv.notify_all()
            self._wait(island_id, lambda: r.failed or len(r.contributions) == len(r.members))
            if r.failed:
                raise ExchangeError(f"island {island_id}: a member of the round died")
            if r.total is None:
                shapes = {c.shape for c in r.contributions.values()}
                if len(shapes) > 1:
                    r.failed = True
                    raise ExchangeError(f"the round's buffers differ in shape: {sorted(shapes)}")
                r.total = np.sum([r.contributions[i] for i in r.members], axis=0, dtype=np.float32)
            return r.total.copy()


class IslandKilled(BaseException):
    """Raised in an island's thread after :meth:`LocalHub.kill` (a test's way to make it die)."""


class LocalTransport(Transport):
    """One island's side of a :class:`LocalHub` (islands as threads of one process)."""

    def __init__(self, hub: LocalHub):
        self.hub = hub
        self.island_id = -1
        self.committed = 0
        self._save: Callable[[], Any] | None = None
        self._load: Callable[[Any], None] | None = None
        self._round: _Round | None = None
        self._ok = False

    def bind(self, island_id: int, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        self.island_id, self._save, self._load = island_id, save, load
        self.hub.join(self)

    def quorum(self) -> bool:
        r = self.hub.quorum(self.island_id)
        self._round, self._ok = r, False
        if self.committed >= r.max_step:
            return False
        source = self.hub._live[r.source]
        assert source._save is not None and self._load is not None
        self._load(source._save())
        self.committed = r.max_step
        return True

    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        assert self._round is not None, "allreduce before quorum"
        total = self.hub.allreduce(self.island_id, self._round, buf)
        self._ok = True
        return total

    def abort(self, reason: str) -> None:
        del reason
        self._ok = False

    def commit(self) -> bool:
        ok, self._ok = self._ok, False
        if ok:
            self.committed += 1
        return ok

    def rounds_committed(self) -> int:
        return self.committed

    def close(self) -> None:
        self.hub.leave(self.island_id)
