"""Healing, on the island's side: what it serves a lagging peer, and how it takes a state it healed to.

An island serves the state it had when its current round launched (its
parameters and optimizer state, with its :class:`~.protocol.Settings`); a
peer behind it takes that, weighs 0 in the round, and lands the round's
merged result on it, ending the round with the same anchor. When this island
itself heals in a round, it serves from then on the state it healed to: a
retry of the round may choose it as the source for another island, which
must get what the others hold, not what this island held before.

What an island serves carries the digest its round's members agree on (the
anchor's SHA-256, or under ``eager`` the pending aggregates'); an island that
heals takes a state only when it fits its own arrays (paths, dtypes, shapes)
and its anchor matches that digest (:meth:`Healing.expected`, checked by the
transport before the state is used).

Threads: :meth:`Healing.keep` runs in the island's main thread (at each
launch), :meth:`Healing.adopt` in its round thread, :meth:`Healing.serve` in
the transport's threads; a lock guards the one state they share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxopt_dist._src.islands import broadcast, heal_http
from jaxopt_dist._src.islands.protocol import Settings
from jaxopt_dist._src.islands.transport import HealRefused, IslandRefused


class Healing:
    """One island's healing state (see the module).

    Args:
      island_id: the island's slot (for messages).
      settings: the island's settings, served with its state and checked on a state it takes.
      residuals: a tree like the optimizer state's ``aggregate_states``, True
        where a leaf is per worker (an aggregate's residual: owed by the
        source, not by a healed island, so zeroed on adoption).
      digest: ``digest(opt_state) -> str``, the SHA-256 (hex) the members of a
        round agree on (the island's own), of a placed or a host state.
    """

    def __init__(self, island_id: int, settings: Settings, residuals: Any, digest: Callable[[Any], str]):
        self.island_id, self.settings, self.residuals = island_id, settings, residuals
        self.digest = digest
        self._lock = threading.Lock()
        self._trees: Any = None  # (params, opt_state): placed arrays, or host trees after a heal
        self._host: Any = None  # its host leaves, when taken
        self._agreed = ""  # the digest of the state served

    def keep(self, params: Any, opt_state: Any, agreed: str) -> None:
        """The state a peer heals from in the round that launches now, and ``agreed``, its digest (what
        the round's members check). On an island of several processes whose state is sharded over its
        devices, its host copy is gathered here, by every process: the transport asks for it in the
        first process's threads, where no collective runs."""
        host = _leaves(params, opt_state) if broadcast.gathers((params, opt_state)) else None
        with self._lock:
            self._trees, self._host, self._agreed = (params, opt_state), host, agreed

    def serve(self) -> dict[str, Any]:
        """The healing state a lagging peer takes (called from the transport's threads)."""
        with self._lock:
            trees, host, agreed = self._trees, self._host, self._agreed
        if host is None:
            host = _leaves(*trees)
        return {**host, "settings": self.settings._asdict(), "agreed": agreed}

    def expected(self) -> heal_http.Expected:
        """What a healing state must be for this island to take it: its own arrays (paths, dtypes,
        shapes, in the order :meth:`serve` gives them), then :meth:`verify`."""
        with self._lock:
            params, opt_state = self._trees
        arrays = [
            (f"{part}/{i}", np.dtype(x.dtype).name, tuple(int(n) for n in np.shape(x)))
            for part, tree in (("params", params), ("opt_state", opt_state))
            for i, x in enumerate(jax.tree.leaves(tree))
        ]
        return heal_http.Expected(arrays, verify=self.verify, first=self.check_settings)

    def verify(self, state: Any) -> None:
        """Raises ``ValueError`` unless a received state's digest (its anchor's, recomputed here) is the
        one it says its round's members agreed on; its arrays have already matched :meth:`expected`."""
        agreed = state.get("agreed") if isinstance(state, dict) else None
        if not isinstance(agreed, str) or not agreed:
            raise ValueError("it names no digest that its round's members agreed on")
        with self._lock:
            template = self._trees[1]
        got = self.digest(_host_like(template, state["opt_state"]))
        if got != agreed:
            raise ValueError(
                f"its anchor's SHA-256 is {got[:16]}..., not {agreed[:16]}..., the digest its round's "
                "members agreed on (the state is not the one they hold)"
            )

    def adopt(self, state: Any) -> tuple[Any, Any]:
        """A served state as host ``(params, opt_state)`` shaped like this island's, its residuals zeroed;
        served from now on. Raises :class:`IslandRefused` when the source's settings differ."""
        self.check_settings(state)
        with self._lock:
            params, opt_state = self._trees
        new_params = _host_like(params, state["params"])
        new_state = _host_like(opt_state, state["opt_state"])
        agg = jax.tree.map(
            lambda x, m: np.zeros_like(x) if m else x, new_state.aggregate_states, self.residuals
        )
        trees = (new_params, new_state._replace(aggregate_states=agg))
        agreed = self.digest(trees[1])
        with self._lock:
            self._trees, self._host, self._agreed = trees, _leaves(*trees), agreed
        return trees

    def check_settings(self, state: Any) -> None:
        """Raises :class:`IslandRefused` (this island may not take part) when a served state's settings
        are missing or differ from this island's (checked before any of its arrays is read)."""
        theirs = state.get("settings") if isinstance(state, dict) else None
        if not isinstance(theirs, dict) or set(theirs) != set(self.settings._asdict()):
            raise IslandRefused(f"island {self.island_id} is refused: its healing source sent no settings.")
        words = self.settings.differences(
            Settings(**{k: int(v) for k, v in theirs.items()}), "its healing source"
        )
        if words:
            raise IslandRefused(
                f"island {self.island_id} is refused: its settings differ from the others': "
                + "; ".join(words)
            )


def _leaves(params: Any, opt_state: Any) -> dict[str, list[np.ndarray]]:
    return {
        "params": [broadcast.host(x) for x in jax.tree.leaves(params)],
        "opt_state": [broadcast.host(x) for x in jax.tree.leaves(opt_state)],
    }


def _host_like(template: Any, leaves: Any) -> Any:
    """Host ``leaves`` in ``template``'s tree, checked against its shapes."""
    targets, treedef = jax.tree.flatten(template)
    if (
        not isinstance(leaves, list)
        or len(leaves) != len(targets)
        or any(np.shape(a) != t.shape for a, t in zip(leaves, targets))
    ):
        shapes = [np.shape(a) for a in leaves] if isinstance(leaves, list) else type(leaves).__name__
        raise HealRefused(
            "the healing state is refused: it does not fit this island's model: "
            f"{shapes[:4]}... against {[t.shape for t in targets][:4]}..."
        )
    return jax.tree.unflatten(treedef, [np.asarray(a, t.dtype) for a, t in zip(leaves, targets)])
