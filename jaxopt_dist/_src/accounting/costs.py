"""What the accounting reports: collectives, per-step costs and their per-kind prices.

The bytes each worker sends and receives in one collective follow the
standard algorithms (:func:`factors`):

================  ===========================  ===================================
collective        bytes sent (= received)      latency terms (rounds of messages)
================  ===========================  ===================================
all-reduce        ``2 (k-1)/k B`` (ring)       ``2 (k-1)``
all-gather        ``(k-1) B`` (ring)           ``k-1``
reduce-scatter    ``(k-1)/k B``                ``k-1``
all-to-all        ``(k-1)/k B``                ``k-1``
permute           ``B`` (0 for a fixed point)  ``1``
================  ===========================  ===================================

with ``B`` the bytes of this worker's operands and ``k`` the number of workers
in the collective's group.

The worker count is spelled ``num_workers`` everywhere;
``base.renamed_keyword`` serves the deprecated spellings (``axis_size``,
``workers``) for one release.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from jaxopt_dist._src import base

PRIMITIVE_KINDS: dict[str, str] = {
    "psum": "all_reduce",
    "psum_invariant": "all_reduce",
    "psum_start": "all_reduce",
    "psum_invariant_start": "all_reduce",
    "unreduced_psum": "all_reduce",
    "unreduced_psum_start": "all_reduce",
    "pmax": "all_reduce",
    "pmin": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
    "all_gather_start": "all_gather",
    "all_gather_reduced": "all_gather",
    "all_gather_reduced_start": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_start": "reduce_scatter",
    "unreduced_reduce_scatter": "reduce_scatter",
    "unreduced_reduce_scatter_start": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_start": "all_to_all",
    "ragged_all_to_all": "all_to_all",
    "ppermute": "permute",
    "ppermute_start": "permute",
    "pbroadcast": "broadcast",
    "pbroadcast_start": "broadcast",
}
"""jaxpr primitive -> collective kind."""

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "broadcast")
"""Collective kinds reported by :func:`communication_cost`."""


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (0 for a dtype without a size)."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0) or 0)


def factors(kind: str, k: int, moving: float = 1.0) -> tuple[float, int]:
    """(bytes on the wire per payload byte, per worker; latency rounds) for ``k`` workers."""
    if k <= 1:
        return 0.0, 0
    if kind == "all_reduce":
        return 2.0 * (k - 1) / k, 2 * (k - 1)
    if kind == "all_gather":
        return float(k - 1), k - 1
    if kind in ("reduce_scatter", "all_to_all", "broadcast"):
        return (k - 1) / k, k - 1
    if kind == "permute":
        return moving, 1 if moving > 0 else 0
    raise ValueError(f"unknown collective kind {kind!r}")


def axis_key(axes: tuple[Any, ...]) -> Any:
    """The key of a group of mesh axes in ``by_axis`` tables: the name of one axis, else the tuple."""
    return axes[0] if len(axes) == 1 else tuple(axes)


# ----------------------------------------------------------------------------
# Results.


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a transform's update, as traced.

    Attributes:
      kind: one of :data:`KINDS`.
      primitive: the jaxpr primitive (``psum``, ``all_gather_invariant``...).
      axes: the axis names it reduces/gathers over.
      group_size: ``k``, the number of workers taking part in each group.
      operands: ``(shape, dtype name)`` of each local operand.
      payload_bytes: ``B``, bytes of this worker's operands.
      moving: for permutes, the fraction of workers whose data leaves them
        (1 for a permutation without fixed points); 1 otherwise.
      path: where it sits in the update, e.g. ``"cond[1]/jit"``.
      multiplier: times it runs per execution of the update (``scan`` length).
    """

    kind: str
    primitive: str
    axes: tuple[Any, ...]
    group_size: int
    operands: tuple[tuple[tuple[int, ...], str], ...]
    payload_bytes: int
    moving: float
    path: str
    multiplier: int = 1

    @property
    def payload_elements(self) -> int:
        return int(sum(math.prod(s) for s, _ in self.operands)) * self.multiplier

    def sent_bytes(self, group_size: int | None = None) -> float:
        """Bytes this worker sends (= receives) per execution, standard algorithm."""
        k = self.group_size if group_size is None else group_size
        factor, _ = factors(self.kind, k, self.moving)
        return factor * self.payload_bytes * self.multiplier

    def rounds(self, group_size: int | None = None) -> int:
        """Latency terms (sequential message rounds) per execution."""
        k = self.group_size if group_size is None else group_size
        return factors(self.kind, k, self.moving)[1] * self.multiplier


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The collectives of one step.

    Attributes:
      step: the step number (0 = first update after ``init``).
      collectives: what runs on this step.
      exact: False if a branch could not be resolved (charged the most
        expensive one) or a ``while_loop`` body was charged once.
    """

    step: int
    collectives: tuple[Collective, ...]
    exact: bool = True

    @property
    def sent_bytes(self) -> float:
        return float(sum(c.sent_bytes() for c in self.collectives))

    @property
    def received_bytes(self) -> float:
        # Every algorithm in the table is symmetric: a worker receives what it sends.
        return self.sent_bytes

    @property
    def calls(self) -> int:
        """Number of collective operations issued."""
        return int(sum(c.multiplier for c in self.collectives))

    @property
    def signature(self) -> tuple[Any, ...]:
        return tuple((c.path, c.multiplier) for c in self.collectives)


@dataclasses.dataclass(frozen=True)
class KindCost:
    """Per-step averages for one collective kind."""

    calls: float
    payload_bytes: float
    sent_bytes: float
    received_bytes: float


def _kind_costs(sums: Mapping[Any, list[float]], num_steps: int) -> dict[Any, KindCost]:
    """``{key: [calls, payload, sent]}`` summed over ``num_steps`` steps, as per-step averages."""
    m = max(num_steps, 1)
    return {key: KindCost(v[0] / m, v[1] / m, v[2] / m, v[2] / m) for key, v in sums.items()}


def _compiled_sums(collectives: Any, keep: Any) -> dict[Any, KindCost]:
    """Compiled collectives (each run once per update) summed per group of mesh axes, where ``keep(axes)``."""
    sums: dict[Any, list[float]] = {}
    for h in collectives:
        if h.axes and keep(h.axes):
            acc = sums.setdefault(axis_key(h.axes), [0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += h.payload_bytes
            acc[2] += h.sent_bytes()
    return _kind_costs(sums, 1)


@dataclasses.dataclass(frozen=True)
class CommunicationCost:
    """What a transform communicates per worker and step; see :func:`communication_cost`.

    Attributes:
      num_workers: number of workers on the axis (``axis_size`` is its
        deprecated spelling).
      axis_sizes: size of each mesh axis traced.
      params_bytes: bytes of one copy of the parameters.
      dense_bytes: the dense baseline: bytes a worker sends (= receives) in
        one ring all-reduce of the parameters in their dtypes,
        ``2 (n-1)/n params_bytes``.
      steps: the evaluated steps (see ``period``).
      period: the steps over which the averages below are taken (the last
        ``len(period)`` evaluated steps; all of them unless ``steps=None``
        found a repeating steady state).
      sites: every collective in the traced update, each branch of each
        ``cond`` included, counted once (what a compiled program contains).
      step_dependent: some collective sits behind a branch chosen from the
        state (the cost may differ between steps).
      exact: every evaluated step was resolved exactly.
      notes: human-readable remarks (warm-up length, inexact steps...).
      data_axes: the data axes (``axis_name``) the workers are spread over.
      model_axes: the other axes of a sharded model's mesh (``param_specs``),
        left to the compiler inside each replica; empty otherwise.
      compiled: the collectives of the update compiled on the model's mesh
        (:class:`~jaxopt_dist.HloCollective`, each with the mesh ``axes`` it
        spans; sizes per device), or None when nothing was compiled.

    Units. Everything read off the trace (``steps``, ``sites``,
    ``sent_bytes``, the data axes of :meth:`by_axis`) is *per worker*, a
    worker being one replica: the bytes of the replica's whole leaves, as if
    its parameters were not sharded. What is read off the compiled program
    (``compiled``, :meth:`compiled_by_axis`, the model axes of
    :meth:`by_axis`, :attr:`model_sent_bytes`) is *per device*.
    """

    num_workers: int
    axis_sizes: Mapping[Hashable, int]
    params_bytes: int
    dense_bytes: float
    steps: tuple[StepCost, ...]
    period: tuple[int, ...]
    sites: tuple[Collective, ...]
    step_dependent: bool
    exact: bool
    notes: tuple[str, ...] = ()
    data_axes: tuple[Hashable, ...] = ()
    model_axes: tuple[Hashable, ...] = ()
    compiled: tuple[Any, ...] | None = None

    @property
    def axis_size(self) -> int:
        """Deprecated; the same value as :attr:`num_workers`."""
        base.warn_renamed("CommunicationCost.axis_size", "num_workers")
        return self.num_workers

    def period_steps(self) -> list[StepCost]:
        """The evaluated steps in ``period``, those the averages are taken over."""
        chosen = set(self.period)
        return [s for s in self.steps if s.step in chosen]

    def _period_mean(self, attr: str) -> float:
        steps = self.period_steps()
        return float(np.mean([getattr(s, attr) for s in steps])) if steps else 0.0

    @property
    def sent_bytes(self) -> float:
        """Bytes a worker sends per step, averaged over ``period``."""
        return self._period_mean("sent_bytes")

    @property
    def received_bytes(self) -> float:
        """Bytes a worker receives per step, averaged over ``period``."""
        return self._period_mean("received_bytes")

    @property
    def calls(self) -> float:
        """Collective operations per step, averaged over ``period``."""
        return self._period_mean("calls")

    @property
    def worst_sent_bytes(self) -> float:
        """The most bytes a worker sends on any evaluated step."""
        return max((s.sent_bytes for s in self.steps), default=0.0)

    @property
    def peak_sent_bytes(self) -> float:
        """The most bytes a worker sends on one step of ``period`` (the busiest
        step of the steady state, e.g. one fragment's synchronisation)."""
        return max((s.sent_bytes for s in self.period_steps()), default=0.0)

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / sent_bytes`` (inf if nothing is sent, nan with one worker)."""
        if self.dense_bytes == 0:
            return math.nan
        if self.sent_bytes == 0:
            return math.inf
        return self.dense_bytes / self.sent_bytes

    def _sums(self, key_of: Any) -> tuple[dict[Any, list[float]], int]:
        """``{key_of(c): [calls, payload bytes, sent bytes]}`` over ``period``, and its length."""
        steps = self.period_steps()
        sums: dict[Any, list[float]] = {}
        for s in steps:
            for c in s.collectives:
                acc = sums.setdefault(key_of(c), [0.0, 0.0, 0.0])
                acc[0] += c.multiplier
                acc[1] += c.payload_bytes * c.multiplier
                acc[2] += c.sent_bytes()
        return sums, len(steps)

    def by_kind(self) -> dict[str, KindCost]:
        """Per-step averages over ``period``, per collective kind."""
        sums, num_steps = self._sums(lambda c: c.kind)
        return _kind_costs({kind: sums[kind] for kind in KINDS if sums.get(kind, [0.0])[0]}, num_steps)

    def by_axis(self) -> dict[Any, KindCost]:
        """Per-step costs per group of mesh axes a collective spans: data axes, then model axes.

        The key is the axis name for a collective over one axis (``"ici"``,
        ``"dcn"``, ``"fsdp"``), the tuple of names for one over several at
        once (a flat all-reduce over ``("dcn", "ici")``). On a two-level
        cluster the bytes keyed by the slow axis (or by a tuple containing
        it) are the ones that cross the slow links.

        Data axes: the transform's own collectives, traced, averaged over
        ``period``, per worker (replica). Model axes (a sharded model, see
        :func:`communication_cost`'s ``param_specs``): the collectives the
        compiler inserted inside each replica, read off the compiled update
        (every collective of the program once, each branch included), per
        device; a collective spanning a data axis and a model axis at once
        is keyed by the tuple, here. Model axes appear only when the update
        was compiled (:attr:`model_sent_bytes` is None otherwise, and
        ``notes`` says so).
        """
        sums, num_steps = self._sums(lambda c: axis_key(c.axes))
        return {**_kind_costs(sums, num_steps), **self.model_by_axis()}

    def _spans_model_axis(self, axes: tuple[Any, ...]) -> bool:
        return any(a in self.model_axes for a in axes)

    def model_by_axis(self) -> dict[Any, KindCost]:
        """The model-axis part of :meth:`by_axis`: compiled, per device, per update; {} if not compiled."""
        return _compiled_sums(self.compiled or (), self._spans_model_axis)

    def compiled_by_axis(self) -> dict[Any, KindCost]:
        """Every collective of the compiled update (data axes too), per device, per update; {} if not compiled.

        Next to :meth:`by_axis`'s per-replica data-axis figures, this shows
        what one device sends on the data axis: for a leaf sharded ``k``
        ways over the model axes, ``1/k`` of its replica's bytes.
        """
        return _compiled_sums(self.compiled or (), lambda axes: True)

    @property
    def model_sent_bytes(self) -> float | None:
        """Bytes a device sends per update over the model axes (compiled); None if not counted."""
        if self.compiled is None:
            return None if self.model_axes else 0.0
        return float(sum(c.sent_bytes for c in self.model_by_axis().values()))

    def table(self) -> str:
        """A plain-text table of the per-step averages, then the bytes per group of mesh axes."""
        fmt = base.format_bytes
        lines = [
            f"communication per worker and step, {self.num_workers} workers "
            f"(averaged over {len(self.period)} step(s)):",
            f"  {'collective':<15}{'calls':>8}{'payload':>14}{'sent':>14}{'received':>14}",
        ]
        for kind, c in self.by_kind().items():
            lines.append(
                f"  {kind:<15}{c.calls:>8.3g}{fmt(c.payload_bytes):>14}"
                f"{fmt(c.sent_bytes):>14}{fmt(c.received_bytes):>14}"
            )
        lines.append(
            f"  {'total':<15}{self.calls:>8.3g}{'':>14}{fmt(self.sent_bytes):>14}{fmt(self.received_bytes):>14}"
        )
        lines.append(
            f"  dense all-reduce baseline: {fmt(self.dense_bytes)} sent; "
            f"compression ratio {self.compression_ratio:.4g}x"
        )
        lines.extend(self._axis_lines())
        if self.step_dependent:
            lines.append(f"  varies with the step: worst evaluated step sends {fmt(self.worst_sent_bytes)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _axis_lines(self) -> list[str]:
        """The per-axis lines of :meth:`table`: data axes (traced), then model axes (compiled)."""
        fmt = base.format_bytes
        sums, num_steps = self._sums(lambda c: axis_key(c.axes))
        data = _kind_costs(sums, num_steps)
        if len(data) <= 1 and not self.model_axes:
            return []
        lines = ["  data axes (traced, per worker and step):"]
        lines += [
            f"    over {key!r}: {c.calls:.3g} calls, {fmt(c.sent_bytes)} sent" for key, c in data.items()
        ]
        if not self.model_axes:
            return lines
        lines.append(f"  model axes {tuple(self.model_axes)!r} (compiled HLO, per device and update):")
        if self.compiled is None:
            return [*lines, "    not counted: the update was not compiled on a mesh (see notes)"]
        model = self.model_by_axis()
        lines += [
            f"    over {key!r}: {c.calls:.3g} calls, {fmt(c.sent_bytes)} sent" for key, c in model.items()
        ]
        return lines if model else [*lines, "    none: the compiled update sends nothing over them"]

    def __str__(self) -> str:
        return self.table()
