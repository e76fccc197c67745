"""Alpha-beta projection: a :class:`CommunicationCost` priced in seconds per step.

:func:`project_step_time` charges every collective of the averaged steps
``rounds * alpha + wire_bytes / beta`` under one of the
:data:`PROJECTION_ALGORITHMS` (:func:`priced`, with :func:`_calls` splitting a
collective into the calls the algorithm makes), on the links of the mesh
axes it spans, and returns a :class:`StepTime`. Given the compute time of a
step, :func:`_period_map` runs the period's steps against one link
(transfers queued in order, each awaited ``overlap_steps`` steps later) as a
max-plus linear map, whose cycle time (:func:`_overlapped_wall`) is the wall
time of a schedule that overlaps its exchanges with compute.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

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
      compute_seconds: the compute of one step given to
        :func:`project_step_time` (``None`` if none was).
      overlap_steps: the steps each exchange overlaps with (0: it blocks).
      wall_seconds: projected wall seconds per step, compute and the
        communication it does not hide (``None`` without ``compute_seconds``).
    """

    latency_seconds: float
    bandwidth_seconds: float
    dense_seconds: float
    by_kind: Mapping[str, float]
    num_workers: int
    by_axis: Mapping[Any, float]
    compute_seconds: float | None
    overlap_steps: int
    wall_seconds: float | None

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
        compute_seconds: float | None = None,
        overlap_steps: int = 0,
        wall_seconds: float | None = None,
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
        obj.compute_seconds = None if compute_seconds is None else float(compute_seconds)
        obj.overlap_steps = int(overlap_steps)
        obj.wall_seconds = None if wall_seconds is None else float(wall_seconds)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        # A float subclass with keyword-only fields: rebuilt from the value and the attributes.
        return (_restore_step_time, (type(self), float(self), dict(self.__dict__)))

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

    @property
    def utilization(self) -> float | None:
        """``compute_seconds / wall_seconds``: the fraction of the wall time spent computing
        (``None`` without ``compute_seconds``; 1 when both are 0)."""
        if self.wall_seconds is None or self.compute_seconds is None:
            return None
        return self.compute_seconds / self.wall_seconds if self.wall_seconds else 1.0

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
        if self.wall_seconds is not None and self.compute_seconds is not None:
            how = f"overlapped with {self.overlap_steps} step(s)" if self.overlap_steps else "blocking"
            lines.append(
                f"  wall time: {self.wall_seconds * 1e3:.4g} ms per step with {self.compute_seconds * 1e3:.4g} ms "
                f"of compute, {how}; utilization {self.utilization:.1%}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"StepTime(seconds={self.seconds:.6g}, latency_seconds={self.latency_seconds:.6g}, "
            f"bandwidth_seconds={self.bandwidth_seconds:.6g}, dense_seconds={self.dense_seconds:.6g}, "
            f"num_workers={self.num_workers}{self._wall_repr()})"
        )

    def _wall_repr(self) -> str:
        if self.wall_seconds is None or self.compute_seconds is None:
            return ""
        return (
            f", compute_seconds={self.compute_seconds:.6g}, overlap_steps={self.overlap_steps}, "
            f"wall_seconds={self.wall_seconds:.6g}, utilization={self.utilization:.6g}"
        )

    def __str__(self) -> str:
        return self.table()


def _restore_step_time(cls: type[StepTime], seconds: float, attributes: dict[str, Any]) -> StepTime:
    """Unpickles a :class:`StepTime` (see ``StepTime.__reduce__``)."""
    obj = float.__new__(cls, seconds)
    obj.__dict__.update(attributes)
    return obj


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
    compute_seconds: float | None = None,
    overlap_steps: int = 0,
) -> StepTime:
    r"""Communication time per step under the alpha-beta model.

    Each collective over ``k`` workers with ``B`` payload bytes per worker
    costs ``rounds * alpha + wire_bytes / beta``: ring all-reduce
    ``2 (k-1) alpha + 2 (k-1)/k B / beta``, ring all-gather
    ``(k-1) alpha + (k-1) B / beta``, reduce-scatter and all-to-all
    ``(k-1) alpha + (k-1)/k B / beta``, permute ``alpha + B / beta``.
    Collectives run one after another (no overlap with each other or with
    compute), averaged over ``cost.period``.

    Wall time (``compute_seconds=c``, ``overlap_steps=w``). The period's
    steps repeat, step ``n`` computing for ``c`` seconds and then issuing its
    collectives, ``T_n`` seconds of them as priced above, onto the link.
    The link carries one transfer at a time, in the order issued; the step
    ``w`` steps later needs the result and waits for it at its end; compute
    waits for nothing else. With ``C_n`` the end of step ``n``'s compute,
    ``D_n`` its transfer done and ``E_n`` the end of the step:

    .. math::

       C_n = E_{n-1} + c, \qquad
       D_n = \max(C_n, D_{n^-}) + T_n, \qquad
       E_n = \max(C_n, D_{n-w}),

    ``n^-`` being the last earlier step with a transfer. ``wall_seconds`` is
    the steady state ``lim (E_{n+kP} - E_n) / (kP)`` over periods of ``P``
    steps: one period of the recurrence, run on the times of its state (the
    end of the last step, the link's, the transfers in flight) as max-plus
    linear forms, is a max-plus matrix whose maximum cycle mean (Karp's
    algorithm) is that limit, exact however long the schedule takes to
    settle. ``utilization`` is ``c / wall_seconds``.

    ``w = 0`` is the blocking schedule: ``c + seconds``. One transfer ``T``
    per period gives ``max(P c, T, P c + T - w c) / P``: hidden while
    ``T <= w c``, the link the bottleneck once ``T > P c``. Several
    fragments queue behind each other when a transfer outlasts the steps to
    the next one. ``w`` counts from the step :func:`communication_cost`
    charges the collective to, taken as the step that issues it: Streaming
    DiLoCo with overlap is ``w = sync_delay`` on the cost of
    ``diloco(..., sync_delay=tau)``, whose exchange sits on the step the
    pseudo-gradient is taken; eager DiLoCo is ``w = sync_every``. ``w`` may
    exceed the period (exchanges in flight over several periods, or a
    gradient all-reduced every step and applied ``w`` steps late).

    Limits: every collective of the period overlaps in the same way; the
    link and compute do not slow each other, and transfers do not share the
    link with other traffic. On XLA:CPU, gloo needs the CPU too: a
    collective run on a second CPU device of each process, each process
    pinned to one core, hid a slow link (100 Mbit/s) completely but a
    1 Gbit/s all-reduce only about half, so there ``utilization`` is an
    upper bound.

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
      compute_seconds: seconds of one inner step's compute alone (no
        link), ``>= 0``; when given, the result carries ``wall_seconds``
        and ``utilization`` (see above).
      overlap_steps: ``w``, an int ``>= 0``: each step's collectives run
        during the next ``w`` steps' compute; 0 (default): they block.
        Needs ``compute_seconds`` when not 0.

    Returns:
      A :class:`StepTime`: the seconds per step as a float, with
      ``dense_seconds``, ``speedup``, the latency/bandwidth split and a
      ``table()``; with ``compute_seconds``, also ``wall_seconds`` and
      ``utilization``.

    Examples:
      Two fragments, one exchange a step after each pseudo-gradient, on a
      link that moves a kilobyte a second; steps of 0.5 s hide the smaller
      fragment's exchange and half of the larger one's:

      >>> import optax, jax.numpy as jnp
      >>> tx = jd.diloco(optax.sgd(0.1), sync_every=4, num_fragments=2, sync_delay=1)
      >>> params = {"a": jnp.zeros(256), "b": jnp.zeros(128)}  # 1024 and 512 bytes
      >>> cost = jd.communication_cost(tx, params, num_workers=2)
      >>> t = jd.project_step_time(cost, bandwidth_gbps=8 * 1024e-9, latency_us=0.0,
      ...                          compute_seconds=0.5, overlap_steps=1)
      >>> print(f"{t.seconds:.3f} {t.wall_seconds:.3f} {t.utilization:.2f}")
      0.375 0.625 0.80
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
    overlap = _check_overlap(compute_seconds, overlap_steps)
    return _project(cost, num_workers, links, algorithm, float(call_floor_us) * 1e-6, overlap)


def _check_overlap(compute_seconds: Any, overlap_steps: Any) -> tuple[float, int] | None:
    """``(compute_seconds, overlap_steps)`` checked, or None when no compute time is given."""
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, numbers.Integral):
        raise TypeError(f"`overlap_steps` must be an int (a number of inner steps); got {overlap_steps!r}.")
    if overlap_steps < 0:
        raise ValueError(f"`overlap_steps` must be >= 0 (0: the collectives block); got {overlap_steps!r}.")
    if compute_seconds is None:
        if overlap_steps:
            raise ValueError(
                "`overlap_steps` needs `compute_seconds`, the seconds of one step's compute it overlaps with."
            )
        return None
    if not base.is_python_number(compute_seconds):
        raise TypeError(f"`compute_seconds` must be a number of seconds; got {compute_seconds!r}.")
    if not (math.isfinite(float(compute_seconds)) and compute_seconds >= 0):
        raise ValueError(f"`compute_seconds` must be finite and >= 0; got {compute_seconds!r}.")
    return float(compute_seconds), int(overlap_steps)


def _project(
    cost: CommunicationCost,
    num_workers: int,
    links: _Links,
    algorithm: str,
    floor: float,
    overlap: tuple[float, int] | None = None,
) -> StepTime:
    """:func:`project_step_time` once its arguments are checked; ``floor`` in seconds."""
    steps = cost.period_steps()
    by_kind: dict[str, float] = {}
    by_axis: dict[Any, float] = {}
    lat = bw = 0.0
    per_step = []  # seconds of each step's collectives
    for step in steps:
        per_step.append(0.0)
        for c in step.collectives:
            k = num_workers if c.group_size == cost.num_workers else c.group_size
            alpha, beta = links.of(c.axes)
            wire, rounds = priced(c, k, algorithm, alpha, beta)
            wait = rounds * alpha + _floor_excess(c, k, algorithm, alpha, beta, floor)
            lat += wait
            bw += wire / beta
            per_step[-1] += wait + wire / beta
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + wait + wire / beta
            key = costs.axis_key(c.axes)
            by_axis[key] = by_axis.get(key, 0.0) + wait + wire / beta
    m = max(len(steps), 1)
    compute, window = overlap if overlap is not None else (None, 0)
    return StepTime(
        (lat + bw) / m,
        latency_seconds=lat / m,
        bandwidth_seconds=bw / m,
        dense_seconds=_dense_seconds(cost, num_workers, links, algorithm, floor),
        by_kind={k: v / m for k, v in by_kind.items()},
        num_workers=num_workers,
        by_axis={k: v / m for k, v in by_axis.items()},
        compute_seconds=compute,
        overlap_steps=window,
        wall_seconds=None if compute is None else _overlapped_wall(per_step, compute, window),
    )


def _period_map(comm: Sequence[float], compute: float, window: int) -> np.ndarray:
    """The period as a max-plus linear map ``A`` of its state: ``x'_i = max_j (A[i, j] + x_j)``.

    The state at a period's start is the time its previous step ended, the
    time the link finishes what it holds, and when each transfer in flight
    (issued in the last ``window`` steps) is done. The recurrence of
    :func:`project_step_time` runs over the period's steps on these times as
    max-plus vectors (entry ``j``: the weight of state time ``j``, ``-inf``
    where it plays no part).
    """
    period = len(comm)
    keys = [n + window for n in range(-window, 0) if comm[n % period] > 0.0]  # steps awaiting them
    size = 2 + len(keys)
    unit = np.full((size, size), -np.inf)
    np.fill_diagonal(unit, 0.0)
    clock, link = unit[0], unit[1]
    due = {k: unit[2 + i] for i, k in enumerate(keys)}  # step at whose end it is awaited -> done
    for n, seconds in enumerate(comm):
        clock = clock + compute
        if seconds > 0.0:  # issued once the step's compute is done, behind what the link holds
            link = np.maximum(link, clock) + seconds
            due[n + window] = link
        if n in due:
            clock = np.maximum(clock, due.pop(n))
    return np.stack([clock, link] + [due[k + period] for k in keys])


def _overlapped_wall(comm: Sequence[float], compute: float, window: int) -> float:
    """Steady-state wall seconds per step of :func:`project_step_time`'s overlap model.

    The period's map (:func:`_period_map`) is irreducible when something is
    sent: every time of the state, from any start, grows by its cycle time
    ``lambda`` per period, the maximum cycle mean of the map's graph, which
    Karp's algorithm gives exactly (however long the transient before the
    schedule settles, e.g. a backlog on the link building up slowly).
    """
    if not any(t > 0.0 for t in comm):
        return compute
    a = _period_map(comm, compute, window)
    size = a.shape[0]
    walks = np.zeros((size + 1, size))  # walks[k, i]: the heaviest walk of k edges into i, from anywhere
    for k in range(size):
        walks[k + 1] = np.max(a + walks[k][None, :], axis=1)
    means = (walks[size][None, :] - walks[:size]) / (size - np.arange(size))[:, None]
    return float(np.max(np.min(means, axis=0))) / len(comm)


def _dense_seconds(
    cost: CommunicationCost, num_workers: int, links: _Links, algorithm: str, floor: float
) -> float:
    """Seconds of one all-reduce of the parameters over all the axes, on their slowest link."""
    alpha, beta = links.of(links.axes)
    payload = cost.params_bytes
    factor, rounds = _algorithm_factors("all_reduce", num_workers, 1.0, payload, alpha, beta, algorithm)
    dense = rounds * alpha + factor * payload / beta
    return max(dense, floor) if num_workers > 1 else dense
