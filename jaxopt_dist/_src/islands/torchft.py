"""The islands' transport over torchft: its lighthouse, ``Manager``, reconfigurable gloo and HTTP healing.

The only module of the library that imports torch (``pip install
"jaxopt_dist[islands]"``). One :class:`TorchftTransport` per island (one
process): a ``Manager`` of a replica group of one rank, whose quorum comes
from torchft's lighthouse and whose all-reduce runs on a
``ProcessGroupGloo`` that torchft rebuilds whenever the membership changes.
A lagging island heals in the quorum from a peer's healing state, streamed
over HTTP (pickled: islands must trust each other).

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

from jaxopt_dist._src.islands.transport import ExchangeError, IslandsError, Transport


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
    """

    lighthouse: str
    min_islands: int = 2
    timeout: float = 10.0
    quorum_timeout: float = 120.0
    connect_timeout: float = 10.0
    quorum_retries: int = 0
    requery: float = 0.5
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    _manager: Any = dataclasses.field(default=None, init=False, repr=False)
    _store: Any = dataclasses.field(default=None, init=False, repr=False)
    _received: Any = dataclasses.field(default=None, init=False, repr=False)
    _load: Any = dataclasses.field(default=None, init=False, repr=False)

    def bind(self, island_id: int, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        torch = _optional("torch")
        dist = _optional("torch.distributed")
        Manager = _optional("torchft.manager").Manager
        ProcessGroupGloo = _optional("torchft.process_group").ProcessGroupGloo

        torch.set_num_threads(1)
        self._store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)

        self._load = load

        seconds = timedelta(seconds=self.timeout)
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=seconds),
            load_state_dict=self._received_state,
            state_dict=save,
            min_replica_size=self.min_islands,
            use_async_quorum=False,
            timeout=seconds,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timedelta(seconds=self.connect_timeout),
            rank=0,
            world_size=1,
            store_addr="localhost",
            store_port=self._store.port,
            lighthouse_addr=self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}",
            replica_id=f"island_{island_id}",
            hostname=self.hostname,
            init_sync=False,
            quorum_retries=self.quorum_retries,
        )

    def _received_state(self, state: Any) -> None:
        """torchft's ``load_state_dict``: kept until :meth:`quorum` knows whether the heal is real."""
        self._received = state

    def quorum(self) -> bool:
        """Asks the lighthouse again every ``requery`` seconds until a quorum forms (see the class).

        A renewal can leave an older request of this island at the lighthouse,
        carrying the step it had then; a quorum formed with it has torchft heal
        this island although its state is already at the quorum's step. Such a
        heal (the step unchanged by it) is not passed on: the island keeps its
        own state and takes part as usual.
        """
        self._received = None
        before = self._manager.current_step()
        deadline = time.monotonic() + self.quorum_timeout
        while True:
            wait = min(self.requery, max(deadline - time.monotonic(), 0.001))
            try:
                self._manager.start_quorum(timeout=timedelta(seconds=wait))
                break
            except Exception as e:  # torchft raises its Rust client's timeout or a RuntimeError
                self._manager._quorum_future = None  # torchft would raise the same error again
                if time.monotonic() >= deadline:
                    raise IslandsError(f"no quorum of islands within {self.quorum_timeout} s: {e}") from e
        if self._manager.errored():
            raise ExchangeError(f"the quorum failed: {self._manager.errored()}")
        received, self._received = self._received, None
        healed = received is not None and self._manager.current_step() != before
        if healed:
            self._load(received)
        return healed

    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        torch = _optional("torch")
        tensor = torch.from_numpy(buf)
        self._manager.allreduce(tensor, reduce_op=_optional("torch.distributed").ReduceOp.SUM).wait()
        if self._manager.errored():
            raise ExchangeError(f"the all-reduce failed: {self._manager.errored()}")
        return buf

    def abort(self, reason: str) -> None:
        self._manager.report_error(RuntimeError(reason))

    def commit(self) -> bool:
        ok = bool(self._manager.should_commit())
        if not ok:  # rebuild the process group at the next quorum, even if its id comes back the same
            self._manager._quorum_id = -1  # (a restarted lighthouse counts quorum ids from 0 again)
        return ok

    def rounds_committed(self) -> int:
        return int(self._manager.current_step())

    def close(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)


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
