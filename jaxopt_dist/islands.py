"""Islands: DiLoCo across separately launched JAX jobs that die and rejoin.

``from jaxopt_dist import islands``. An island is one JAX job (a host, a
cluster) that takes DiLoCo's inner steps alone; the outer exchange between
islands goes over a transport with per-round membership: an island that dies
is left out of the next round, the survivors redo an interrupted exchange
among themselves, and a restarted island heals from a live peer and weighs 0
in the round it heals in. See :func:`island`, :func:`torchft_transport` and
the Islands guide.
"""

from __future__ import annotations

from typing import Any

from jaxopt_dist._src.islands.island import Island, SyncRecord, anchor_sha256
from jaxopt_dist._src.islands.local import IslandKilled, LocalHub, LocalTransport
from jaxopt_dist._src.islands.merge import (
    Merged,
    WeightedMeanState,
    island_share,
    island_weight,
    pack,
    unpack,
    weighted_mean,
)
from jaxopt_dist._src.islands.transport import (
    ExchangeError,
    Healed,
    HealRefused,
    IslandRefused,
    IslandsError,
    Transport,
)
from jaxopt_dist._src.islands.wire import read_secret


def torchft_transport(lighthouse: str, **options: Any) -> Transport:
    """The transport over torchft 0.2 (``pip install "jaxopt_dist[islands]"``; imports torch).

    Args:
      lighthouse: ``HOST:PORT`` of torchft's lighthouse (``torchft_lighthouse
        --min_replicas 2 --join_timeout_ms 1000 --heartbeat_timeout_ms 2000``,
        or :func:`start_lighthouse`).
      **options: ``host`` (the address this island listens on and advertises
        to the others: its replica group's TCPStore, its gloo device and its
        healing server listen on it alone; torchft's ``ManagerServer``
        advertises it but listens on every interface. Default: this host's
        address on the route to the lighthouse), ``min_islands`` (fewest
        islands in a round, default 2), ``timeout`` (seconds an all-reduce,
        and then the round's commit vote, may take; default 10),
        ``heal_timeout`` (seconds a heal may take, whatever ``timeout``:
        size it from the state's bytes and the link; default 60),
        ``quorum_timeout`` (seconds to wait for a quorum, default 120; then
        :class:`IslandsError`), ``connect_timeout`` (default 10),
        ``quorum_retries`` (times a failed quorum request is retried, e.g.
        while the lighthouse restarts; default 0), ``requery`` (seconds
        between renewals of a waiting quorum request, below the lighthouse's
        join timeout; default 0.5), ``roll_call`` (seconds within which every
        member of a quorum answers the one-number roll call that closes it (a
        healing member before its download), and a new quorum's process group
        connects: an island counted in but absent fails the attempt in
        seconds, not after ``timeout`` or ``heal_timeout``; default 5, or
        ``timeout`` where shorter), ``secret`` (the islands' shared secret,
        bytes of at least 16, e.g. :func:`read_secret`: every contribution
        and healing response carries its HMAC-SHA256 tag, those without it
        are dropped or refused, and the float32 mean goes over the gather
        path; default None).

    Returns:
      A :class:`Transport` for one :class:`Island`.
    """
    from jaxopt_dist._src.islands.torchft import TorchftTransport

    return TorchftTransport(lighthouse, **options)


def start_lighthouse(bind: str = "[::]:0", **options: Any) -> Any:
    """torchft's lighthouse in this process (``.address()``, ``.shutdown()``); imports torch.

    Args:
      bind: the address to listen on (``"[::]:0"``: any free port).
      **options: ``min_islands`` (2), ``join_timeout_ms`` (1000: how long a
        quorum waits for live islands that have not asked; keep it above the
        transport's ``requery``, 0.5 s, so that the lighthouse waits for every
        live island and leaves out only those whose heartbeats stopped),
        ``heartbeat_timeout_ms`` (2000: silence after which an island is left
        out), ``quorum_tick_ms`` (100).
    """
    from jaxopt_dist._src.islands.torchft import start_lighthouse as start

    return start(bind, **options)


def island(step: Any, transport: Transport, *, island_id: int, **options: Any) -> Island:
    r"""Runs ``step`` (a DiLoCo :func:`jaxopt_dist.data_parallel_step`) as one island over ``transport``.

    ``step``'s ``tx`` must be a :func:`jaxopt_dist.diloco` (any fragments,
    ``sync_delay``, ``eager``, ``mixing``, ``aggregate``), with
    ``per_worker_params=True`` and a data axis of size 1: the island is one
    DiLoCo worker, and splits its batch over its own devices with the step's
    ``batch_axes`` as usual, its parameters replicated over them
    (``param_specs=jax.P()``) or sharded over its model axes (FSDP inside the
    island), in one process or several under the island's own
    ``jax.distributed``. The island runs the diloco's
    ``external`` twin: after the step that sends a fragment, it runs the
    ``aggregate`` on its own devices and merges the result with the other
    islands' in one SUM all-reduce of ``[w * d, w]`` (``w``: 1, or the tokens
    since it last synchronised with ``rule="tokens"``; 0 in a round it heals
    in). With ``sync_delay=0`` the round runs right after that step; with
    ``sync_delay >= 1`` in a thread beside the next ``sync_delay - 1`` inner
    steps, landing before the step that applies it. Under ``eager`` the round runs beside the
    steps up to the next fragment's synchronisation, and lands with the
    island's share of it (its weight over the sum; 0 after a heal), which
    scales the island's own fresh pseudo-gradient in its next outer step
    of that fragment.

    Encoded aggregates (``low_bit``, ``chunked_top_k``...), robust rules
    (:func:`jaxopt_dist.trimmed_mean`, :func:`jaxopt_dist.coordinate_median`,
    :func:`jaxopt_dist.centered_clip`, :func:`jaxopt_dist.norm_clipped_mean`)
    and any merge under a shared secret gather every island's contribution
    instead (one all-gather of sealed records) and combine them in island
    order on every island. A robust rule gets each island's own
    pseudo-gradient, one row per slot (NaN rows for the slots without one),
    and counts each island once (it takes ``rule="mean"`` only). Whatever
    the aggregate, a contribution with a NaN or an infinity weighs 0 in its
    round and is named in the record's ``rejected`` (``"non-finite"``); the
    SUM all-reduce, whose total then is not finite, is followed at once by
    the gather that finds it.

    A round is attempts of: quorum (an island that is behind heals from a
    peer here), the all-reduce, the members' checks of what they summed, and
    a vote among them: the attempt commits only when every member's exchange
    succeeded and its checks passed. When it does not (a member died or
    stalled past the transport's timeout), the survivors pause (a backoff
    with jitter), form a new quorum and redo it, each with the pseudo-gradient
    it sent before (an island that healed in the round sends nothing, weight
    0), until it commits; the whole round, quorums and heals included, ends
    within ``round_timeout`` or raises :class:`IslandsError`. An island whose
    anchor differs from the majority's heals from it; one with another
    island's live id, or with settings that differ from the others'
    (``sync_every``, fragments, ``sync_delay``, ``eager``, ``rule``, the
    model's shapes, the optimizer state), is refused
    (:class:`IslandRefused`). Every participant of a round ends it with the
    same anchor, bit for bit (under ``eager``, the same merged mean; each
    island's anchor is its own, :meth:`Island.model`).

    Late islands: where a round forms without an island (the lighthouse's
    ``min_islands`` and join timeout let the others go on without one that is
    slower, or stopped), that island keeps its inner steps and catches up in
    the next round it joins: it takes the round's state from a peer, as a
    heal does (anchor, outer and inner optimizer states, step count), and its
    own pseudo-gradient :math:`\Delta_i = \theta^{\text{anchor}}_{i} - \theta_i`,
    taken against the anchor it last synchronised to, enters the merge with
    its weight (1, or its tokens since it last synchronised). The members
    then apply the merged :math:`\sum_i w_i \Delta_i / \sum_i w_i` to the
    current anchor with the outer optimizer, as in any round: a stale
    pseudo-gradient applied to the newer anchor, as asynchronous Local-SGD
    does (Liu et al., "Asynchronous Local-SGD Training for Language
    Modeling", arXiv 2401.09135), without a discount for its age. Its record
    says ``caught_up`` (not ``healed``). An island heals with weight 0 only
    where its work cannot count: in its join round (a fresh or restarted
    process), after its anchor was found to differ from the majority's, or
    where the round does not merge plain pseudo-gradients at once (``eager``,
    ``sync_delay >= 1``, encoded aggregates, robust rules).

    Call :meth:`Island.init` once (it joins the others and heals if they are
    ahead), then the island like the step; :meth:`Island.finish` at the end.

    Args:
      step: the island's :func:`jaxopt_dist.data_parallel_step`.
      transport: :func:`torchft_transport`, or a :class:`LocalHub`'s.
      island_id: this island's slot, in ``[0, num_slots)``; unique among
        live islands. A restarted island may take its old id once the
        process that held it is gone (or a new id); while another live
        island holds it (a stopped process that resumes, a restart started
        too early), the newer claim is refused with :class:`IslandRefused`
        in its first round with the other.
      **options: ``rule`` (``"mean"``: weight 1; or ``"tokens"``: the steps
        since the island's previous launch times ``tokens_per_step``, fixed
        when the round launches), ``tokens_per_step`` (for ``"tokens"``),
        ``num_slots`` (64; the same on every island), ``round_timeout``
        (seconds a whole round may take, 600; more than the transport's
        bound on one exchange and vote), ``on_sync`` (``(SyncRecord, params,
        opt_state) -> None``, called after each round lands).

    Returns:
      An :class:`Island`: ``params, opt_state = island.init(params)``, then
      ``params, opt_state, metrics = island(params, opt_state, batch)``.

    Communication:
      Nothing inside the step. Per round: the ``aggregate`` on the island's
      own devices, then one float32 all-reduce over the transport of the
      fragment's elements plus ``1 + 16 * num_slots`` floats (the weight,
      then per slot its presence, weight, round, anchor tag, heal flag, join
      round, nonce, fragment and 8 settings), and a one-float all-reduce for the commit
      vote (a gathered round: one all-gather of a record per island in place
      of the all-reduce; a sum that is not finite: that all-gather after it);
      a healing island receives a whole copy of the parameters and optimizer
      state.
    """
    return Island(step, transport, island_id=island_id, **options)


__all__ = (
    "ExchangeError",
    "HealRefused",
    "Healed",
    "Island",
    "IslandKilled",
    "IslandRefused",
    "IslandsError",
    "LocalHub",
    "LocalTransport",
    "Merged",
    "SyncRecord",
    "Transport",
    "WeightedMeanState",
    "anchor_sha256",
    "island",
    "island_share",
    "island_weight",
    "pack",
    "read_secret",
    "start_lighthouse",
    "torchft_transport",
    "unpack",
    "weighted_mean",
)
