"""The transport between islands: what a round needs of the link to the others.

A round, as :mod:`.protocol` runs it on every island (one attempt)::

    healed = transport.quorum(timeout)   # membership; a lagging island heals here
    total = transport.allreduce(buffer)  # one SUM all-reduce; raises ExchangeError
    if transport.commit(ok): ...         # every member's exchange succeeded (a vote)

An attempt that does not commit is run again, after a pause, among a new
quorum. :class:`~.local.LocalHub` implements the interface for islands that
are threads of one process (no torch needed); :mod:`.torchft` between
processes and hosts.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class IslandsError(RuntimeError):
    """An island cannot go on: no quorum formed within the bound, or a round did not commit in time."""


class IslandRefused(IslandsError):
    """An island may not take part: its id is in use by another live island, or its settings differ."""


class ExchangeError(RuntimeError):
    """An all-reduce among the round's members failed (a member died or stalled); the round is run again."""


class Healed(NamedTuple):
    """What a quorum healed this island to.

    Attributes:
      state: the healing state a peer served (what its ``serve`` returned).
      seconds: how long receiving it took.
    """

    state: Any
    seconds: float


class Transport(abc.ABC):
    """What an island needs of the link to the others (one object per island)."""

    @property
    @abc.abstractmethod
    def exchange_seconds(self) -> float:
        """The longest an all-reduce and the commit vote of one attempt may take together (seconds)."""

    @abc.abstractmethod
    def bind(self, island_id: int, serve: Callable[[], Any]) -> None:
        """Joins as ``island_id``; ``serve()`` gives the healing state a lagging peer takes from this island.

        ``serve`` is called from the transport's own threads, whenever a peer heals from this island.
        """

    @abc.abstractmethod
    def quorum(self, timeout: float) -> Healed | None:
        """Waits for the next round's quorum; heals if this island is behind the others.

        Returns what it healed to (None when it did not heal), within
        ``timeout`` seconds (the wait and the heal together). Raises
        :class:`IslandsError` when no quorum formed in time, and
        :class:`ExchangeError` when the quorum or the heal failed.
        """

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        """The SUM of ``buf`` over the quorum's members; raises :class:`ExchangeError` on a failure."""

    @abc.abstractmethod
    def commit(self, ok: bool) -> bool:
        """The members' vote on the attempt: True only when every member voted ``ok``.

        A member votes False when its exchange failed or its checks of the
        summed buffer did not pass; a vote that cannot complete (a member
        died) is False. True advances the committed-round count.
        """

    def close(self) -> None:  # noqa: B027 (optional to override)
        """Leaves; the others' next quorum goes on without this island."""

    def fall_behind(self) -> None:
        """Makes this island's next quorum heal it from a member ahead of it (its state is in the minority).

        A transport that cannot leaves this undone: the island then leaves the round with an error.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot make an island heal from the others")

    @abc.abstractmethod
    def rounds_committed(self) -> int:
        """Rounds this island has committed (after healing: its source's count)."""
