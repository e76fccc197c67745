"""The islands' transport over torchft: its lighthouse, ``Manager`` and reconfigurable gloo, on one address.

The only module of the library that imports torch (``pip install
"jaxopt_dist[islands]"``). One :class:`TorchftTransport` per island (one
process): a ``Manager`` of a replica group of one rank, whose quorum comes
from torchft's lighthouse and whose all-reduce runs on a gloo process group
that torchft rebuilds whenever the membership changes. A lagging island heals
in the quorum from a peer, over :mod:`.heal_http` (torchft's checkpoint
transport interface, without pickle).

Every server the island opens listens on its ``host`` and advertises it:
the replica group's ``TCPStore`` (on which peers meet to build the process
group), the gloo device and the healing server; torchft's ``ManagerServer``
advertises it too, but listens on every interface (torchft binds it to
``[::]`` itself).

JAX buffers cross as NumPy: the packed round buffer is a fresh writable
float32 array, wrapped by ``torch.from_numpy`` (no copy) and all-reduced in
place.
"""

from __future__ import annotations

import dataclasses
import importlib
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from jaxopt_dist._src.islands import heal_http, wire
from jaxopt_dist._src.islands.transport import (
    ExchangeError,
    Healed,
    HealRefused,
    IslandRefused,
    IslandsError,
    Transport,
    ring_bytes,
)


@dataclasses.dataclass
class TorchftTransport(Transport):
    """An island's link to the others over torchft 0.2 (see :func:`jaxopt_dist.islands.torchft_transport`).

    The quorum request is renewed every ``requery`` seconds (shorter than the
    lighthouse's ``join_timeout_ms``). torchft's lighthouse forms a quorum at
    once when the oldest waiting request is older than its join timeout: an
    island left out of one round (late by a few milliseconds, or back from a
    restart) would otherwise wait with an old request, pair with the first
    island to ask for the next round and leave out the one asking a moment
    later, round after round (each left-out island then heals, weighing 0).
    A renewed request is never old, so the lighthouse waits its join timeout
    for the others, who then all come in.

    A renewal can leave a request it replaced at the lighthouse, and a quorum
    formed with it counts the island in (with the step it had then) while the
    island asks for the next one. So every attempt opens with a roll call: a
    one-number all-reduce among the quorum's members, each saying whether it
    can go on, answered within ``roll_call`` seconds (a healing member answers
    before it downloads), and a new quorum's process group must connect
    within ``roll_call`` seconds too. A member counted in but absent fails the
    attempt in seconds, where the exchange would wait its whole ``timeout``,
    and the attempt is redone in a new quorum. Where a member heals, a second
    call waits for its heal to end (``heal_timeout`` more).
    """

    lighthouse: str
    min_islands: int = 2
    timeout: float = 10.0
    heal_timeout: float = 60.0
    quorum_timeout: float = 120.0
    connect_timeout: float = 10.0
    quorum_retries: int = 0
    requery: float = 0.5
    roll_call: float | None = None
    host: str | None = None
    secret: bytes | None = None
    _sent: int = dataclasses.field(default=0, init=False, repr=False)
    _manager: Any = dataclasses.field(default=None, init=False, repr=False)
    _pg: Any = dataclasses.field(default=None, init=False, repr=False)
    _store: Any = dataclasses.field(default=None, init=False, repr=False)
    _listener: Any = dataclasses.field(default=None, init=False, repr=False)
    _healing: Any = dataclasses.field(default=None, init=False, repr=False)
    _received: Any = dataclasses.field(default=None, init=False, repr=False)
    _issued: bool = dataclasses.field(default=False, init=False, repr=False)
    _answered: bool = dataclasses.field(default=False, init=False, repr=False)
    _absent: str | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        for name in ("timeout", "heal_timeout", "quorum_timeout", "connect_timeout", "requery", "roll_call"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:  # (roll_call may be None)
                raise ValueError(f"`{name}` must be > 0 seconds; got {getattr(self, name)}.")
        self.secret = wire.check_secret(self.secret)

    @property
    def roll_call_seconds(self) -> float:
        """``roll_call``, or its default: 5 s, or ``timeout`` where shorter."""
        return min(5.0, self.timeout) if self.roll_call is None else self.roll_call

    @property
    def exchange_seconds(self) -> float:
        return 2 * self.timeout  # the all-reduce, then the vote, each within the process group's timeout

    def bind(self, island_id: int, serve: Callable[[], Any], expect: Any = None) -> None:
        torch = _optional("torch")
        dist = _optional("torch.distributed")
        Manager = _optional("torchft.manager").Manager

        torch.set_num_threads(1)
        host = self.host or route_address(self.lighthouse)
        self.host = host
        self._listener = _listen(host)  # the store listens on this socket alone (kept open with it)
        port = self._listener.getsockname()[1]
        self._store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, master_listen_fd=self._listener.fileno()
        )
        seconds = timedelta(seconds=self.timeout)
        self._pg = _bound_gloo(host, seconds, connect=timedelta(seconds=self.roll_call_seconds))
        if expect is not None:  # torchft's Manager serves the island's state under "user/default"
            expect = expect._replace(prefix="user/default/")
        self._healing = _healing_transport(host, self.heal_timeout, island_id, self.secret, expect)
        self._healing.present = self._present
        self._manager = Manager(
            pg=self._pg,
            load_state_dict=self._received_state,
            state_dict=serve,
            min_replica_size=self.min_islands,
            use_async_quorum=False,
            timeout=seconds,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timedelta(seconds=self.connect_timeout),
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=port,
            lighthouse_addr=self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}",
            replica_id=f"island_{island_id}",
            hostname=f"[{host}]" if ":" in host else host,
            checkpoint_transport=self._healing,
            init_sync=False,
            quorum_retries=self.quorum_retries,
        )
        self._manager._client = _Recording(self._manager._client)

    def _received_state(self, state: Any) -> None:
        """torchft's ``load_state_dict``: kept until :meth:`quorum` knows whether the heal is real."""
        self._received = state

    def quorum(self, timeout: float) -> Healed | None:
        """Asks the lighthouse again every ``requery`` seconds until a quorum forms (see the class).

        A renewal can leave an older request of this island at the lighthouse,
        carrying the step it had then; a quorum formed with it has torchft heal
        this island although its state is already at the quorum's step. Such a
        heal (the step unchanged by it) is not passed on: the island keeps its
        own state and takes part as usual.
        """
        self._received, self._issued, self._answered, self._absent = None, False, False, None
        start = time.monotonic()
        before = self._manager.current_step()
        deadline = start + min(self.quorum_timeout, timeout)
        if self._healing is not None:
            self._healing.deadline = start + min(self.heal_timeout, timeout)
            self._healing.refused = None
        while True:
            wait = min(self.requery, max(deadline - time.monotonic(), 0.001))
            try:
                self._manager.start_quorum(timeout=timedelta(seconds=wait))
                break
            except Exception as e:  # torchft raises its Rust client's timeout or a RuntimeError
                self._manager._quorum_future = None  # torchft would raise the same error again
                if time.monotonic() >= deadline:
                    raise IslandsError(
                        f"no quorum of islands within {min(self.quorum_timeout, timeout):g} s: {e}"
                    ) from e
        self._answer_roll_call(before, able=not self._manager.errored() or self._refused() is not None)
        if self._manager.errored():
            if self._refused() is not None:  # the heal was refused: the island may still abstain
                raise self._refused()
            raise ExchangeError(f"the quorum failed: {self._manager.errored()}")
        received, self._received = self._received, None
        if received is None or self._manager.current_step() == before:
            return None
        seconds = self._healing.seconds if self._healing is not None else 0.0
        return Healed(received, seconds)

    def _answer_roll_call(self, before: int, able: bool) -> None:
        """The attempt's roll call (see the class), once this island's quorum (and any heal) is through:
        ``able`` where it can go on (or its heal was refused: it abstains). Where a member is absent or
        cannot go on, an ``able`` member raises :class:`ExchangeError`, having reported the failure so
        that the attempt does not commit, and leaves a heal of this attempt unadopted: the island is
        put back at its step ``before`` it, to heal again."""
        if not self._answered:  # (a healing member answered before its download: _present)
            self._absent = self._roll(self.roll_call_seconds, able)
        if self._absent is None and self._manager._client.heals:  # all here: wait for the heals to end
            self._absent = self._roll(self.roll_call_seconds + self.heal_timeout, able)
        if able and self._absent is not None:
            self._manager.report_error(RuntimeError(self._absent))
            self._step_to(before)
            raise ExchangeError(self._absent)

    def _present(self) -> None:
        """A healing member's answer to the roll call, before it downloads (in torchft's quorum thread)."""
        self._answered = True
        self._absent = self._roll(self.roll_call_seconds, True)
        if self._absent is not None:
            raise ExchangeError(self._absent)

    def _roll(self, seconds: float, able: bool) -> str | None:
        """One all-reduce of each member's inability (0 or 1) within ``seconds``: None where every member
        answered able, else why not."""
        torch = _optional("torch")
        dist = _optional("torch.distributed")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = timedelta(seconds=seconds)
        unable = torch.tensor([0.0 if able else 1.0])
        try:  # (the group's size: the Manager's count of participants waits for the quorum thread)
            self._sent += ring_bytes(4, int(self._pg.size()), gather=False)
            self._pg.allreduce([unable], opts).wait()
        except Exception as e:  # a member died, stalled, or was never there
            return f"a member of the quorum did not answer within {seconds:g} s: {e!r}"
        return f"{float(unable[0]):g} member(s) of the quorum cannot go on" if float(unable[0]) else None

    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        torch = _optional("torch")
        tensor = torch.from_numpy(buf)
        self._issued = True
        self._sent += ring_bytes(buf.nbytes, int(self._manager.num_participants()), gather=False)
        self._manager.allreduce(tensor, reduce_op=_optional("torch.distributed").ReduceOp.SUM).wait()
        if self._manager.errored():
            raise ExchangeError(f"the all-reduce failed: {self._manager.errored()}")
        return buf

    def allgather(self, record: np.ndarray) -> list[np.ndarray]:
        """Every member's record over the round's process group (one all-gather); a failure is reported
        to the ``Manager`` as an all-reduce's is, so that the round does not commit."""
        torch = _optional("torch")
        self._issued = True
        if self._manager.errored() and self._refused() is None:  # (a refused heal: it abstains)
            raise ExchangeError(f"the quorum failed: {self._manager.errored()}")
        n = int(self._manager.num_participants())
        mine = torch.from_numpy(np.ascontiguousarray(record, np.uint8))
        out = [torch.empty_like(mine) for _ in range(n)]
        try:
            self._pg.allgather(
                [out], [mine], _optional("torch._C._distributed_c10d").AllgatherOptions()
            ).wait()
        except Exception as e:  # a member died or stalled past the timeout
            self._manager.report_error(e)
            raise ExchangeError(f"the all-gather failed: {e!r}") from e
        self._sent += ring_bytes(record.nbytes, n, gather=True)
        return [t.numpy() for t in out]

    def commit(self, ok: bool) -> bool:
        """The vote: an all-reduce of each member's failure (0 or 1) on the round's process group; the
        round commits when its sum is 0. A member that issued no all-reduce this attempt (its quorum
        failed) does not vote, so that no member pairs its vote with another's exchange; the others'
        vote then fails within the timeout. A member whose heal was refused, having exchanged an
        abstaining record, votes ``ok`` for the others and does not commit itself (torchft's
        ``Manager`` holds the refusal as its error)."""
        abstains = isinstance(self._refused(), HealRefused)  # its only error: the refused heal
        agreed = self._issued and self._vote(ok and (abstains or not self._manager.errored()))
        if not agreed:
            self._manager.report_error(RuntimeError("not every member of the round voted to commit"))
        committed = bool(self._manager.should_commit())
        if not committed:  # rebuild the process group at the next quorum, even if its id comes back the same
            self._manager._quorum_id = -1  # (a restarted lighthouse counts quorum ids from 0 again)
        return committed

    def _refused(self) -> Any:
        """Why this attempt's heal was refused (:class:`HealRefused`, or :class:`IslandRefused`: settings), or None."""
        return None if self._healing is None else self._healing.refused

    def sent_bytes(self) -> int:
        """The exchanges' and votes' bytes this island sent (a ring's: ``(n - 1) * record`` for an
        all-gather, ``2 (n - 1) / n * buffer`` for an all-reduce), and the healing states it served."""
        served = self._healing.server.sent if self._healing is not None else 0
        return int(self._sent + served)

    def _vote(self, ok: bool) -> bool:
        return self._roll(self.timeout, ok) is None

    def fall_behind(self) -> None:
        self._step_to(max(self._manager.current_step() - 1, 0))

    def _step_to(self, step: int) -> None:
        """Sets torchft's count of committed rounds (the step its quorum requests carry)."""
        state = self._manager.state_dict()
        if state["step"] != step:
            self._manager.load_state_dict({**state, "step": step})

    def rounds_committed(self) -> int:
        return int(self._manager.current_step())

    def close(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)


def route_address(lighthouse: str) -> str:
    """This host's address on the route to ``lighthouse`` (``HOST:PORT``): what peers on the same
    network reach it at, found without sending anything."""
    target = lighthouse.split("://")[-1]
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    family, kind, _, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(address)
        return str(s.getsockname()[0])


def _listen(host: str) -> socket.socket:
    family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind)
    s.bind(address)
    s.listen(128)
    return s


class _Recording:
    """The ``Manager``'s client to its server, keeping whether a member heals in the last quorum."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.heals = False

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.heals = False
        quorum = self._client._quorum(*args, **kwargs)
        self.heals = quorum.max_world_size < quorum.replica_world_size  # not every member at its step
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _bound_gloo(host: str, timeout: timedelta, connect: timedelta) -> Any:
    """torchft's reconfigurable ``ProcessGroupGloo``, its gloo device bound to ``host``.

    torchft builds each new group with gloo's default device, which binds the
    address the machine's host name resolves to (often 127.0.0.1), and
    advertises it to the peers through the store. A new group's members must
    connect within ``connect``; its collectives have ``timeout`` unless
    they set their own.
    """
    dist = _optional("torch.distributed")
    torch = _optional("torch")
    ProcessGroupGloo = _optional("torchft.process_group").ProcessGroupGloo

    class BoundGloo(ProcessGroupGloo):
        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = connect  # the collectives' default, overridden in _opts_hook
            opts._threads = 2
            backend = dist.ProcessGroupGloo(store, rank, world_size, opts)
            backend._set_sequence_number_for_group()
            pg = dist.ProcessGroup(store, rank, world_size)
            pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
            return pg

        def _opts_hook(self, opts: Any) -> Any:
            if isinstance(getattr(opts, "timeout", None), timedelta) and opts.timeout < timedelta(0):
                opts.timeout = self._timeout  # unset: the exchange's timeout, not the connect's
            return opts

    return BoundGloo(timeout=timeout)


def _healing_transport(
    host: str, heal_timeout: float, island_id: int, secret: bytes | None, expect: Any
) -> Any:
    """torchft's ``CheckpointTransport`` over :class:`~.heal_http.HealServer` on ``host``: no pickle, and
    a heal bounded by ``heal_timeout`` (and the round's deadline), not by the exchange's timeout; its
    responses carry the tag of ``secret`` and it accepts only those that do and that fit ``expect``
    (a :class:`~.heal_http.Expected`, or None). A refusal is kept in ``refused`` (torchft's
    ``Manager`` reports the error it raises as a failed quorum)."""
    CheckpointTransport = _optional("torchft.checkpointing.transport").CheckpointTransport

    class Healing(CheckpointTransport):
        def __init__(self) -> None:
            self.server = heal_http.HealServer(
                host, source=island_id, secret=secret, send_timeout=heal_timeout
            )
            self.deadline = time.monotonic() + heal_timeout
            self.seconds = 0.0
            self.refused: HealRefused | IslandRefused | None = None
            self.present: Callable[[], None] | None = None

        def metadata(self) -> str:
            return self.server.url

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: Any) -> None:
            del dst_ranks, timeout
            self.server.stage(step, state_dict)

        def disallow_checkpoint(self) -> None:
            """Kept served: torchft calls this when the source's attempt ends, which may be before a
            peer healing in it (slower than the exchange's timeout) has asked; the state is immutable
            and served only under its step, so a late request still gets what its quorum named."""

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
            del src_rank, timeout
            if self.present is not None:  # the roll call, before the download
                self.present()
            start = time.monotonic()
            try:
                state = heal_http.fetch(
                    f"{metadata}{step}", deadline=self.deadline, secret=secret, expect=expect
                )
            except (HealRefused, IslandRefused) as e:  # torchft reports it as a failed quorum
                self.refused = e
                raise
            self.seconds = time.monotonic() - start
            return state

        def shutdown(self, wait: bool = True) -> None:
            del wait
            self.server.close()

    return Healing()


def start_lighthouse(
    bind: str = "[::]:0",
    *,
    min_islands: int = 2,
    join_timeout_ms: int = 1000,
    heartbeat_timeout_ms: int = 2000,
    quorum_tick_ms: int = 100,
) -> Any:
    """torchft's lighthouse in this process: a ``LighthouseServer`` (``.address()``, ``.shutdown()``)."""
    return _optional("torchft.coordination").LighthouseServer(
        bind=bind,
        min_replicas=min_islands,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def _optional(module: str) -> Any:
    """An optional dependency (torch, torchft), imported when an island first needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the islands' torchft transport needs torch and torchft: pip install 'jaxopt_dist[islands]' ({e})"
        ) from e
