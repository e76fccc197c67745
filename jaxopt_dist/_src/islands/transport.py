"""The transport between islands: what a round needs of the link to the others.

A round, as :mod:`.protocol` runs it on every island (one attempt)::

    healed = transport.quorum(timeout)    # membership; a lagging island heals here
    total = transport.allreduce(buffer)   # one SUM all-reduce (the float32 mean); raises ExchangeError
    records = transport.allgather(record) # or: every member's sealed record (encoded, authenticated merges)
    if transport.commit(ok): ...          # every member's exchange succeeded (a vote)

An attempt that does not commit is run again, after a pause, among a new
quorum. A heal that fails fails the attempt like a failed exchange; one that
is refused (:class:`HealRefused`) lets the island abstain from the attempt
where the round gathers (see :meth:`Transport.commit`). :class:`~.local.LocalHub` implements the
interface for islands that are threads of one process (no torch needed);
:mod:`.torchft` between processes and hosts.
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


class HealRefused(ExchangeError):
    """A healing state was refused on arrival (a bad tag, digest, structure or anchor): the island loads
    nothing of it. Where the round gathers, the island takes part in the attempt's exchange abstaining
    (the others commit without it) and heals in the next round; elsewhere the attempt fails as a failed
    exchange does.

    Attributes:
      source: the island that served the state, where known (None otherwise).
    """

    def __init__(self, message: str, source: int | None = None):
        super().__init__(message)
        self.source = source


class Healed(NamedTuple):
    """What a quorum healed this island to.

    Attributes:
      state: the healing state a peer served (what its ``serve`` returned).
      seconds: how long receiving it took.
    """

    state: Any
    seconds: float


class Transport(abc.ABC):
    """What an island needs of the link to the others (one object per island).

    Attributes:
      secret: the islands' shared secret (bytes), or None: it authenticates
        every contribution and healing state this island sends, and this
        island accepts only those that carry its tag.
    """

    secret: bytes | None = None

    @property
    @abc.abstractmethod
    def exchange_seconds(self) -> float:
        """The longest an all-reduce and the commit vote of one attempt may take together (seconds)."""

    @abc.abstractmethod
    def bind(self, island_id: int, serve: Callable[[], Any], expect: Any = None) -> None:
        """Joins as ``island_id``; ``serve()`` gives the healing state a lagging peer takes from this island.

        ``serve`` is called from the transport's own threads, whenever a peer heals from this island.
        ``expect`` (a ``heal_http.Expected``, or None) is what a healing state this island
        receives must be: the transport refuses any other (:class:`HealRefused`) before it is used.
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

    def allgather(self, record: np.ndarray) -> list[np.ndarray]:
        """Every member's ``record`` (uint8, of one length on every member), in the members' order
        (this island's among them); raises :class:`ExchangeError` on a failure.

        Rounds gather where the ``aggregate`` is encoded or under a shared secret; a transport
        that cannot leaves this undone, and such rounds fail with its error.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot gather the islands' records (an encoded aggregate or a shared "
            "secret needs it); use a plain mean without a secret, or a transport that gathers"
        )

    @abc.abstractmethod
    def commit(self, ok: bool) -> bool:
        """The members' vote on the attempt: True only when every member voted ``ok``.

        A member votes False when its exchange failed or its checks of what
        it received did not pass; a vote that cannot complete (a member
        died) is False. True advances the committed-round count. A member
        whose heal was refused in this attempt (its ``quorum`` raised
        :class:`HealRefused`) took part abstaining: its ``ok`` lets the
        others commit, and it returns False itself (its count stays behind,
        so its next quorum heals it again).
        """

    def sent_bytes(self) -> int:
        """Bytes this island has put on the wire so far (its exchanges, votes and the heals it served),
        as the transport counts them; 0 where it counts none."""
        return 0

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


def ring_bytes(nbytes: int, n: int, *, gather: bool) -> int:
    """Bytes one member sends in a ring all-gather (``(n - 1) * nbytes``) or all-reduce
    (``2 (n - 1) / n * nbytes``) of ``nbytes`` among ``n`` members."""
    if n <= 1:
        return 0
    return (n - 1) * nbytes if gather else (2 * (n - 1) * nbytes) // n
