"""Alpha-beta projection: a :class:`CommunicationCost` priced in seconds per step.

:func:`project_step_time` charges every collective of the averaged steps
``rounds * alpha + wire_bytes / beta`` under one of the
:data:`PROJECTION_ALGORITHMS` (:func:`priced`, with :func:`_calls` splitting a
collective into the calls the algorithm makes), on the links of the mesh
axes it spans, and returns a :class:`StepTime`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from jaxopt_dist._src import base
from jaxopt_dist._src.accounting import costs
from jaxopt_dist._src.accounting.costs import Collective, CommunicationCost

PROJECTION_ALGORITHMS = ("ring", "auto", "gloo")
"""Collective algorithms :func:`project_step_time` can price (its ``algorithm``)."""

_WIDENED = ("bfloat16", "float16")  # XLA:CPU runs collectives of these in float32


def _log2_rounds(k: int) -> int:
    return max(1, math.ceil(math.log2(k))) if k > 1 else 0


def _algorithm_factors(
    kind: str, k: int, moving: float, payload: float, alpha: float, beta: float, algorithm: str
) -> tuple[float, int]:
    """(wire bytes per payload byte, latency rounds) of one call under ``algorithm``."""
    factor, rounds = costs.factors(kind, k, moving)
    if k <= 1 or algorithm == "ring" or kind == "permute":
        return factor, rounds
    log_rounds = _log2_rounds(k)
    if algorithm == "gloo":
        if kind == "all_to_all":
            return factor, 1
        if kind == "reduce_scatter":
            return factor, log_rounds
        return factor, rounds
    # "auto": the faster of the ring and the logarithmic algorithm for this message.
    log_factor = {"all_reduce": float(log_rounds)}.get(kind, factor)
    if kind == "all_to_all":
        return factor, rounds
    ring_t = rounds * alpha + factor * payload / beta
    log_t = log_rounds * alpha + log_factor * payload / beta
    return (log_factor, log_rounds) if log_t < ring_t else (factor, rounds)


def _calls(c: Collective, k: int, algorithm: str, alpha: float, beta: float) -> list[tuple[float, int]]:
    """(bytes sent, latency rounds) of each call in one execution of ``c`` under ``algorithm``.

    One call for all operands, except under ``"gloo"``: one per operand, 16-bit floats widened.
    """
    if algorithm == "gloo":
        sizes = [
            math.prod(shape) * (4 if dtype in _WIDENED else costs.itemsize(dtype))
            for shape, dtype in c.operands
        ]
    else:
        sizes = [c.payload_bytes]
    out = []
    for size in sizes:
        factor, rounds = _algorithm_factors(c.kind, k, c.moving, size, alpha, beta, algorithm)
        out.append((factor * size, rounds))
    return out


def priced(c: Collective, k: int, algorithm: str, alpha: float, beta: float) -> tuple[float, float]:
    """(bytes sent, latency rounds) per step of one traced collective under ``algorithm``."""
    calls = _calls(c, k, algorithm, alpha, beta)
    return sum(w for w, _ in calls) * c.multiplier, float(sum(r for _, r in calls) * c.multiplier)


def _floor_excess(c: Collective, k: int, algorithm: str, alpha: float, beta: float, floor: float) -> float:
    """Seconds per step by which ``c``'s calls (see :func:`_calls`) fall short of ``floor`` each."""
    if floor <= 0.0 or k <= 1:  # one worker: nothing is sent, no call
        return 0.0
    short = sum(
        max(0.0, floor - (rounds * alpha + wire / beta))
        for wire, rounds in _calls(c, k, algorithm, alpha, beta)
    )
    return short * c.multiplier


# ----------------------------------------------------------------------------
# The result.


class StepTime(float):
    """Projected communication seconds per step: a float, with the breakdown attached.

    It is the number of seconds (``1e3 * t`` is milliseconds); see
    :func:`project_step_time`.

    Attributes:
      seconds: the same value as a plain float (average per step).
      latency_seconds: the ``alpha`` part.
      bandwidth_seconds: the ``bytes / beta`` part.
      dense_seconds: one ring all-reduce of the parameters.
      by_kind: seconds per step for each collective kind.
      num_workers: the worker count projected for (``workers`` is its
        deprecated spelling).
      by_axis: seconds per step for each group of mesh axes (keys as in
        :meth:`CommunicationCost.by_axis`).
    """

    latency_seconds: float
    bandwidth_seconds: float
    dense_seconds: float
    by_kind: Mapping[str, float]
    num_workers: int
    by_axis: Mapping[Any, float]

    def __new__(
        cls,
        seconds: float,
        *,
        latency_seconds: float,
        bandwidth_seconds: float,
        dense_seconds: float,
        by_kind: Mapping[str, float],
        num_workers: int | None = None,
        by_axis: Mapping[Any, float] | None = None,
        workers: int | None = None,
    ) -> StepTime:
        num_workers = base.renamed_keyword(num_workers, workers, new="num_workers", old="workers")
        if num_workers is None:
            raise TypeError("StepTime() needs `num_workers`, the worker count projected for.")
        obj = super().__new__(cls, seconds)
        obj.latency_seconds = float(latency_seconds)
        obj.bandwidth_seconds = float(bandwidth_seconds)
        obj.dense_seconds = float(dense_seconds)
        obj.by_kind = dict(by_kind)
        obj.num_workers = int(num_workers)
        obj.by_axis = dict(by_axis or {})
        return obj

    @property
    def workers(self) -> int:
        """Deprecated; the same value as :attr:`num_workers`."""
        base.warn_renamed("StepTime.workers", "num_workers")
        return self.num_workers

    @property
    def seconds(self) -> float:
        return float(self)

    @property
    def speedup(self) -> float:
        """``dense_seconds / seconds`` (communication only)."""
        return self.dense_seconds / self.seconds if self.seconds else math.inf

    def table(self) -> str:
        lines = [f"projected communication per step, {self.num_workers} workers:"]
        for kind, s in self.by_kind.items():
            lines.append(f"  {kind:<15}{s * 1e3:>12.4g} ms")
        if len(self.by_axis) > 1:
            lines.extend(f"  over {key!r}: {s * 1e3:.4g} ms" for key, s in self.by_axis.items())
        lines.append(
            f"  {'total':<15}{self.seconds * 1e3:>12.4g} ms  (latency {self.latency_seconds * 1e3:.4g} ms, "
            f"bandwidth {self.bandwidth_seconds * 1e3:.4g} ms)"
        )
        lines.append(f"  dense all-reduce: {self.dense_seconds * 1e3:.4g} ms; speedup {self.speedup:.4g}x")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"StepTime(seconds={self.seconds:.6g}, latency_seconds={self.latency_seconds:.6g}, "
            f"bandwidth_seconds={self.bandwidth_seconds:.6g}, dense_seconds={self.dense_seconds:.6g}, "
            f"num_workers={self.num_workers})"
        )

    def __str__(self) -> str:
        return self.table()


# ----------------------------------------------------------------------------
# The links and the projection.


def _per_axis(value: Any, name: str, axes: Sequence[Any], *, lower_open: bool) -> dict[Any, float]:
    """A number for every axis: ``value`` itself, or its entries if it is a mapping."""
    if isinstance(value, Mapping):
        missing = [a for a in axes if a not in value]
        if missing:
            raise ValueError(
                f"`{name}` gives no value for the mesh axes {missing!r}; it needs one for each of "
                f"{tuple(axes)!r}, e.g. {{{', '.join(f'{a!r}: ...' for a in axes)}}}."
            )
        for a in axes:
            base.check_hyperparameter(value[a], f"{name}[{a!r}]", lower=0.0, lower_open=lower_open)
        return {a: float(value[a]) for a in axes}
    base.check_hyperparameter(value, name, lower=0.0, lower_open=lower_open)
    return {a: float(value) for a in axes}


class _Links:
    """The links of each mesh axis: latency and bandwidth, checked."""

    def __init__(self, axes: Sequence[Any], bandwidth_gbps: Any, latency_us: Any):
        self.axes = list(axes)
        self.gbps = _per_axis(bandwidth_gbps, "bandwidth_gbps", self.axes, lower_open=True)
        self.us = _per_axis(latency_us, "latency_us", self.axes, lower_open=False)

    def of(self, group: Sequence[Any]) -> tuple[float, float]:
        """(alpha seconds, beta bytes per second) of a collective over ``group``: the slowest link."""
        group = list(group) or self.axes
        return max(self.us[a] for a in group) * 1e-6, min(self.gbps[a] for a in group) * 1e9 / 8.0


def project_step_time(
    cost: CommunicationCost,
    *,
    num_workers: int | None = None,
    bandwidth_gbps: float | Mapping[Hashable, float],
    latency_us: float | Mapping[Hashable, float],
    algorithm: str = "ring",
    call_floor_us: float = 0.0,
    workers: int | None = None,
) -> StepTime:
    r"""Communication time per step under the alpha-beta model.

    Each collective over ``k`` workers with ``B`` payload bytes per worker
    costs ``rounds * alpha + wire_bytes / beta``: ring all-reduce
    ``2 (k-1) alpha + 2 (k-1)/k B / beta``, ring all-gather
    ``(k-1) alpha + (k-1) B / beta``, reduce-scatter and all-to-all
    ``(k-1) alpha + (k-1)/k B / beta``, permute ``alpha + B / beta``.
    Collectives run one after another (no overlap with each other or with
    compute), averaged over ``cost.period``.

    Args:
      cost: from :func:`communication_cost`.
      num_workers: project for this many workers (default
        ``cost.num_workers``). Collectives over the whole data axis are
        re-priced with ``k = num_workers``; payloads stay those traced at
        ``cost.num_workers``, which is exact for transforms whose message
        size does not depend on the worker count (all in this library but
        ``num_partitions`` patterns).
      bandwidth_gbps: per-link bandwidth :math:`\beta` in gigabits per
        second, or a mapping from each mesh axis to its links' bandwidth,
        e.g. ``{"ici": 100, "dcn": 1}`` for a two-level cluster. A
        collective over several axes at once (a flat all-reduce over
        ``("dcn", "ici")``) runs at the slowest of them, and so does the
        dense baseline ``dense_seconds``.
      latency_us: per-message latency :math:`\alpha` in microseconds, or a
        mapping per mesh axis (a collective over several axes takes the
        largest).
      algorithm: how the collectives are run: ``"ring"``, ``"auto"`` or ``"gloo"``.
        ``"ring"`` (default): the ring algorithms above, one message round
        set per collective. ``"auto"``: per collective, the faster of the
        ring and the logarithmic algorithm (recursive doubling for
        all-reduce and all-gather, recursive halving for reduce-scatter,
        a binomial tree for broadcast: ``ceil(log2 k)`` rounds, all-reduce
        sending ``ceil(log2 k) B``), as MPI and NCCL pick between them by
        message size. ``"gloo"``: XLA:CPU's collectives over gloo (JAX's
        multi-process CPU backend), as measured by
        ``benchmarks/bench_network.py``: every operand of a collective is a
        separate gloo call (its own rounds), 16-bit floats travel as float32
        (XLA:CPU widens them in every collective), all-reduce and
        all-gather are gloo's rings, all-to-all sends to every peer at once
        (one round) and reduce-scatter is gloo's halving-doubling
        (``ceil(log2 k)`` rounds).
      call_floor_us: the least time one call takes, in microseconds: a
        collective, or under ``"gloo"`` each of its operands. A call whose
        rounds and bytes take less is charged this (the difference counts as
        latency), and so is the dense baseline. Gloo over TCP has such a
        floor: between two processes on one machine any collective of more
        than one element took about 4 ms, whereas a single-element
        all-reduce took 0.09 ms (``benchmarks/bench_network.py`` calibrates
        it with a 4 kB all-reduce). Default 0: no floor.
      workers: deprecated spelling of ``num_workers``.

    Returns:
      A :class:`StepTime`: the seconds per step as a float, with
      ``dense_seconds``, ``speedup``, the latency/bandwidth split and a
      ``table()``.
    """
    num_workers = base.renamed_keyword(num_workers, workers, new="num_workers", old="workers")
    if not isinstance(cost, CommunicationCost):
        raise TypeError(f"`cost` must be a CommunicationCost; got {type(cost).__name__}.")
    if num_workers is None:
        num_workers = cost.num_workers
    num_workers = base.check_positive_int(num_workers, "num_workers")
    if algorithm not in PROJECTION_ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {PROJECTION_ALGORITHMS}; got {algorithm!r}.")
    links = _Links(list(cost.axis_sizes), bandwidth_gbps, latency_us)
    base.check_hyperparameter(call_floor_us, "call_floor_us", lower=0.0, lower_open=False)
    return _project(cost, num_workers, links, algorithm, float(call_floor_us) * 1e-6)


def _project(
    cost: CommunicationCost, num_workers: int, links: _Links, algorithm: str, floor: float
) -> StepTime:
    """:func:`project_step_time` once its arguments are checked; ``floor`` in seconds."""
    steps = cost.period_steps()
    by_kind: dict[str, float] = {}
    by_axis: dict[Any, float] = {}
    lat = bw = 0.0
    for c in (c for s in steps for c in s.collectives):
        k = num_workers if c.group_size == cost.num_workers else c.group_size
        alpha, beta = links.of(c.axes)
        wire, rounds = priced(c, k, algorithm, alpha, beta)
        wait = rounds * alpha + _floor_excess(c, k, algorithm, alpha, beta, floor)
        lat += wait
        bw += wire / beta
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + wait + wire / beta
        key = costs.axis_key(c.axes)
        by_axis[key] = by_axis.get(key, 0.0) + wait + wire / beta
    m = max(len(steps), 1)
    return StepTime(
        (lat + bw) / m,
        latency_seconds=lat / m,
        bandwidth_seconds=bw / m,
        dense_seconds=_dense_seconds(cost, num_workers, links, algorithm, floor),
        by_kind={k: v / m for k, v in by_kind.items()},
        num_workers=num_workers,
        by_axis={k: v / m for k, v in by_axis.items()},
    )


def _dense_seconds(
    cost: CommunicationCost, num_workers: int, links: _Links, algorithm: str, floor: float
) -> float:
    """Seconds of one all-reduce of the parameters over all the axes, on their slowest link."""
    alpha, beta = links.of(links.axes)
    payload = cost.params_bytes
    factor, rounds = _algorithm_factors("all_reduce", num_workers, 1.0, payload, alpha, beta, algorithm)
    dense = rounds * alpha + factor * payload / beta
    return max(dense, floor) if num_workers > 1 else dense
