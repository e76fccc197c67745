"""Communication accounting: what a transform sends, read off its traced update.

:func:`communication_cost` traces one ``tx.update`` under ``jax.shard_map``
over an abstract mesh (no devices are needed, nothing runs) and walks the
resulting jaxpr, through ``jit``, ``custom_jvp``/``custom_vjp``, ``cond``/
``switch``, ``scan`` and ``while`` bodies, collecting every collective with the
shapes and dtypes of its operands. The bytes each worker sends and receives
follow the standard algorithms:

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

Steps that differ. Some transforms communicate only on some steps
(``average_params(every=H)``, PowerSGD before ``start_step``, the alternating
``one_allreduce``, ``optax.MultiSteps``). Their collectives sit in
``lax.cond``/``lax.switch`` branches whose index is computed from counters in
the state. :func:`communication_cost` therefore *simulates the small
replicated part of the state* (counters, keys, scalars: every replicated leaf
of at most 256 elements): starting from ``tx.init``, it evaluates, for each
step, the operations of the update whose inputs are all known (gradients and
parameters never are), takes the branch whose index it could compute, and
carries the known new state to the next step. A branch index it cannot compute
(it depends on data, e.g. a finite-gradient check) is charged the most
expensive branch, and the step is marked inexact. ``while_loop`` bodies are
charged once per step (their trip count is unknown), also marked inexact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm, compat
from jaxopt_dist._src.training import layout, placement

P = jax.sharding.PartitionSpec

# jaxpr primitive -> collective kind.
_KINDS: dict[str, str] = {
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

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "broadcast")
"""Collective kinds reported by :func:`communication_cost`."""

_SMALL = 16  # non-float state leaves (and values) of at most this many elements are simulated
_AUTO_STEPS = 256  # steps simulated by steps=None when the cost depends on the step


def _itemsize(dtype: Any) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0) or 0)


def _factors(kind: str, k: int, moving: float = 1.0) -> tuple[float, int]:
    """(bytes on the wire per payload byte, per worker; latency rounds) for ``k`` workers."""
    if k <= 1:
        return 0.0, 0
    if kind == "all_reduce":
        return 2.0 * (k - 1) / k, 2 * (k - 1)
    if kind == "all_gather":
        return float(k - 1), k - 1
    if kind in ("reduce_scatter", "all_to_all"):
        return (k - 1) / k, k - 1
    if kind == "permute":
        return moving, 1 if moving > 0 else 0
    if kind == "broadcast":
        return (k - 1) / k, k - 1
    raise ValueError(f"unknown collective kind {kind!r}")


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
        factor, _ = _factors(self.kind, k, self.moving)
        return factor * self.payload_bytes * self.multiplier

    def rounds(self, group_size: int | None = None) -> int:
        """Latency terms (sequential message rounds) per execution."""
        k = self.group_size if group_size is None else group_size
        return _factors(self.kind, k, self.moving)[1] * self.multiplier


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


@dataclasses.dataclass(frozen=True)
class CommunicationCost:
    """What a transform communicates per worker and step; see :func:`communication_cost`.

    Attributes:
      axis_size: number of workers on the axis.
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
    """

    axis_size: int
    axis_sizes: Mapping[Hashable, int]
    params_bytes: int
    dense_bytes: float
    steps: tuple[StepCost, ...]
    period: tuple[int, ...]
    sites: tuple[Collective, ...]
    step_dependent: bool
    exact: bool
    notes: tuple[str, ...] = ()

    def _averaged(self) -> list[StepCost]:
        chosen = set(self.period)
        return [s for s in self.steps if s.step in chosen]

    def _period_mean(self, attr: str) -> float:
        steps = self._averaged()
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
        return max((s.sent_bytes for s in self._averaged()), default=0.0)

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / sent_bytes`` (inf if nothing is sent, nan with one worker)."""
        if self.dense_bytes == 0:
            return math.nan
        if self.sent_bytes == 0:
            return math.inf
        return self.dense_bytes / self.sent_bytes

    def by_kind(self) -> dict[str, KindCost]:
        """Per-step averages over ``period``, per collective kind."""
        steps = self._averaged()
        out: dict[str, KindCost] = {}
        for kind in KINDS:
            calls = payload = sent = 0.0
            for s in steps:
                for c in s.collectives:
                    if c.kind == kind:
                        calls += c.multiplier
                        payload += c.payload_bytes * c.multiplier
                        sent += c.sent_bytes()
            if calls:
                m = len(steps)
                out[kind] = KindCost(calls / m, payload / m, sent / m, sent / m)
        return out

    def by_axis(self) -> dict[Any, KindCost]:
        """Per-step averages over ``period``, per group of mesh axes a collective spans.

        The key is the axis name for a collective over one axis (``"ici"``,
        ``"dcn"``), the tuple of names for one over several at once (a flat
        all-reduce over ``("dcn", "ici")``). On a two-level cluster the
        bytes keyed by the slow axis (or by a tuple containing it) are the
        ones that cross the slow links.
        """
        steps = self._averaged()
        m = max(len(steps), 1)
        sums: dict[Any, list[float]] = {}
        for s in steps:
            for c in s.collectives:
                acc = sums.setdefault(_axis_key(c.axes), [0.0, 0.0, 0.0])
                acc[0] += c.multiplier
                acc[1] += c.payload_bytes * c.multiplier
                acc[2] += c.sent_bytes()
        return {k: KindCost(v[0] / m, v[1] / m, v[2] / m, v[2] / m) for k, v in sums.items()}

    def table(self) -> str:
        """A plain-text table of the per-step averages."""
        lines = [
            f"communication per worker and step, {self.axis_size} workers "
            f"(averaged over {len(self.period)} step(s)):",
            f"  {'collective':<15}{'calls':>8}{'payload':>14}{'sent':>14}{'received':>14}",
        ]
        for kind, c in self.by_kind().items():
            lines.append(
                f"  {kind:<15}{c.calls:>8.3g}{_fmt_bytes(c.payload_bytes):>14}"
                f"{_fmt_bytes(c.sent_bytes):>14}{_fmt_bytes(c.received_bytes):>14}"
            )
        lines.append(
            f"  {'total':<15}{self.calls:>8.3g}{'':>14}{_fmt_bytes(self.sent_bytes):>14}"
            f"{_fmt_bytes(self.received_bytes):>14}"
        )
        lines.append(
            f"  dense all-reduce baseline: {_fmt_bytes(self.dense_bytes)} sent; "
            f"compression ratio {self.compression_ratio:.4g}x"
        )
        per_axis = self.by_axis()
        if len(per_axis) > 1:
            lines.extend(
                f"  over {key!r}: {c.calls:.3g} calls, {_fmt_bytes(c.sent_bytes)} sent"
                for key, c in per_axis.items()
            )
        if self.step_dependent:
            lines.append(
                f"  varies with the step: worst evaluated step sends {_fmt_bytes(self.worst_sent_bytes)}"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _axis_key(axes: tuple[Any, ...]) -> Any:
    return axes[0] if len(axes) == 1 else tuple(axes)


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.4g} {unit}"
    return f"{b:.4g} B"


# ----------------------------------------------------------------------------
# The jaxpr walker.


class _Unknown:
    def __repr__(self) -> str:
        return "?"


_UNKNOWN = _Unknown()


def _simulated(aval: Any) -> bool:
    """Values simulated step by step: small non-float arrays (counters, keys, flags) and
    float scalars. Float arrays never decide a branch in practice and cost compilations."""
    shape = getattr(aval, "shape", None)
    if shape is None:
        return False
    size = int(math.prod(shape))
    if size > _SMALL:
        return False
    dtype = getattr(aval, "dtype", None)
    try:
        is_float = dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        is_float = False
    return size <= 1 or not is_float


def _host(x: Any) -> Any:
    """``x`` as a NumPy value when it is a plain (non-key) JAX array."""
    if isinstance(x, jax.Array) and not jnp.issubdtype(x.dtype, jax.dtypes.extended):
        return np.asarray(x)
    return x


def _is_closed_jaxpr(j: Any) -> bool:
    # By its fields: JAX 0.12's type stubs no longer export ``jax.extend.core.ClosedJaxpr``.
    return isinstance(getattr(j, "jaxpr", None), jcore.Jaxpr) and hasattr(j, "consts")


def _is_jaxpr(j: Any) -> bool:
    return isinstance(j, jcore.Jaxpr) or _is_closed_jaxpr(j)


def _as_jaxpr(j: Any) -> tuple[Any, list[Any]]:
    """(Jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    if _is_closed_jaxpr(j):
        return j.jaxpr, list(j.consts)
    return j, []


_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class _Walker:
    """Walks a jaxpr, collecting collectives and evaluating what is known."""

    def __init__(self, sizes: Mapping[Hashable, int], evaluate: bool, cache: dict[str, Any] | None = None):
        self.sizes = dict(sizes)
        self.evaluate = evaluate  # False: static inventory (every branch, nothing evaluated)
        cache = {} if cache is None else cache
        # id(jaxpr) -> (jaxpr, value): the jaxpr is kept alive so that ids stay unique.
        self.comm_cache: dict[int, tuple[Any, bool]] = cache.setdefault("comm", {})
        self.relevant_cache: dict[int, tuple[Any, list[int]]] = cache.setdefault(f"relevant{evaluate}", {})
        self.resolved_branches = False
        self.unresolved_branches = False
        self.while_loops = False

    # -- collectives -------------------------------------------------------

    def _collective(self, eqn: Any, path: tuple[str, ...]) -> Collective:
        name = eqn.primitive.name
        kind = _KINDS[name]
        params = eqn.params
        axes = params.get("axes", params.get("axis_name", ()))
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        named = tuple(a for a in axes if a in self.sizes)
        k = int(math.prod(self.sizes[a] for a in named))
        groups = params.get("axis_index_groups")
        if groups:
            k = len(groups[0])
        operands = tuple(
            (tuple(int(d) for d in v.aval.shape), str(v.aval.dtype))
            for v in eqn.invars
            if hasattr(getattr(v, "aval", None), "shape")
        )
        payload = int(sum(math.prod(s) * _itemsize(d) for s, d in operands))
        moving = 1.0
        if kind == "permute":
            perm = params.get("perm", ())
            moving = sum(1 for s, d in perm if s != d) / k if k else 0.0
        return Collective(
            kind=kind,
            primitive=name,
            axes=named,
            group_size=k,
            operands=operands,
            payload_bytes=payload,
            moving=moving,
            path="/".join(path) or "update",
        )

    # -- which equations matter ---------------------------------------------

    def _has_comm(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        if key not in self.comm_cache:
            self.comm_cache[key] = (jaxpr, False)  # guards recursion
            found = False
            for eqn in jaxpr.eqns:
                if eqn.primitive.name in _KINDS or any(
                    self._has_comm(_as_jaxpr(s)[0]) for s in jcore.jaxprs_in_params(eqn.params)
                ):
                    found = True
                    break
            self.comm_cache[key] = (jaxpr, found)
        return self.comm_cache[key][1]

    def _relevant(self, jaxpr: Any) -> list[int]:
        """Indices of the equations that communicate or may compute a simulated value.

        The others (float maths on gradients, parameters, factors) cannot
        affect a branch index or a communication, so their outputs are left
        unknown without visiting them."""
        key = id(jaxpr)
        if key not in self.relevant_cache:
            keep = []
            for i, eqn in enumerate(jaxpr.eqns):
                subs = list(jcore.jaxprs_in_params(eqn.params))
                if eqn.primitive.name in _KINDS or any(self._has_comm(_as_jaxpr(x)[0]) for x in subs):
                    keep.append(i)
                elif self.evaluate and any(
                    _simulated(v.aval) for v in eqn.outvars if not isinstance(v, jcore.DropVar)
                ):
                    keep.append(i)
            self.relevant_cache[key] = (jaxpr, keep)
        return self.relevant_cache[key][1]

    # -- walking -----------------------------------------------------------

    def walk(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], path: tuple[str, ...]
    ) -> tuple[list[Any], list[Collective]]:
        env: dict[Any, Any] = {}

        def read(v):
            if isinstance(v, jcore.Literal):
                return v.val
            return env.get(v, _UNKNOWN)

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        found: list[Collective] = []
        for i in self._relevant(jaxpr):
            eqn = jaxpr.eqns[i]
            name = eqn.primitive.name
            here = (*path, f"{name}#{i}")
            ins = [read(v) for v in eqn.invars]
            outs: list[Any] | None = None
            if name in _KINDS:
                found.append(self._collective(eqn, path + (f"{name}#{i}",)))
            elif name == "cond":
                outs, sub = self._cond(eqn, ins, here)
                found.extend(sub)
            elif name == "scan":
                found.extend(self._scan(eqn, ins, here))
            elif name == "while":
                found.extend(self._while(eqn, ins, here))
            elif any(_is_jaxpr(eqn.params.get(p)) for p in _CALL_PARAMS):
                key = next(p for p in _CALL_PARAMS if _is_jaxpr(eqn.params.get(p)))
                sub_jaxpr, sub_consts = _as_jaxpr(eqn.params[key])
                if len(sub_jaxpr.invars) == len(ins) and len(sub_jaxpr.outvars) == len(eqn.outvars):
                    outs, sub = self.walk(sub_jaxpr, sub_consts, ins, here)
                else:
                    _, sub = self.walk(sub_jaxpr, sub_consts, [_UNKNOWN] * len(sub_jaxpr.invars), here)
                found.extend(sub)
            else:
                subs = list(jcore.jaxprs_in_params(eqn.params))
                if subs:  # an unfamiliar higher-order primitive: inventory only
                    for j, s in enumerate(subs):
                        sj, sc = _as_jaxpr(s)
                        _, sub = self.walk(sj, sc, [_UNKNOWN] * len(sj.invars), (*here, str(j)))
                        found.extend(sub)
                elif self.evaluate:
                    outs = self._evaluate(eqn, ins)
            for j, v in enumerate(eqn.outvars):
                if isinstance(v, jcore.DropVar):
                    continue
                env[v] = outs[j] if outs is not None else _UNKNOWN
        return [read(v) for v in jaxpr.outvars], found

    def _evaluate(self, eqn: Any, ins: list[Any]) -> list[Any] | None:
        if any(x is _UNKNOWN for x in ins):
            return None
        if not all(_simulated(v.aval) for v in eqn.outvars):
            return None
        try:
            # Host copies: literals cached from other traces can carry the sharding of
            # another mesh, which eager evaluation would reject.
            ins = [_host(x) for x in ins]
            res = eqn.primitive.bind(*ins, **eqn.params)
        except Exception:  # e.g. vma casts outside shard_map: leave unknown
            return None
        return list(res) if eqn.primitive.multiple_results else [res]

    def _cond(
        self, eqn: Any, ins: list[Any], path: tuple[str, ...]
    ) -> tuple[list[Any] | None, list[Collective]]:
        branches = eqn.params["branches"]
        index, operands = ins[0], ins[1:]
        if self.evaluate and index is not _UNKNOWN:
            b = int(np.clip(int(np.asarray(index)), 0, len(branches) - 1))
            if len(branches) > 1 and not isinstance(eqn.invars[0], jcore.Literal):
                self.resolved_branches = True
            bj, bc = _as_jaxpr(branches[b])
            outs, found = self.walk(bj, bc, operands, (*path, f"branch{b}"))
            return outs, found
        results = []
        for b, br in enumerate(branches):
            bj, bc = _as_jaxpr(br)
            _, found = self.walk(
                bj, bc, operands if self.evaluate else [_UNKNOWN] * len(operands), (*path, f"branch{b}")
            )
            results.append(found)
        if not self.evaluate:
            return None, [c for found in results for c in found]
        # Unresolved at evaluation time: charge the most expensive branch.
        costs = [sum(c.sent_bytes() for c in found) for found in results]
        if len({tuple(c.path for c in f) for f in results}) > 1:
            self.unresolved_branches = True
        return None, results[int(np.argmax(costs))] if results else []

    def _scan(self, eqn: Any, ins: list[Any], path: tuple[str, ...]) -> list[Collective]:
        body, consts = _as_jaxpr(eqn.params["jaxpr"])
        length = int(eqn.params["length"])
        num_consts = compat.scan_num_consts(eqn)
        args = list(ins[:num_consts]) + [_UNKNOWN] * (len(body.invars) - num_consts)
        _, found = self.walk(body, consts, args, path)
        return [dataclasses.replace(c, multiplier=c.multiplier * length) for c in found]

    def _while(self, eqn: Any, ins: list[Any], path: tuple[str, ...]) -> list[Collective]:
        out: list[Collective] = []
        for key in ("cond_jaxpr", "body_jaxpr"):
            sj, sc = _as_jaxpr(eqn.params[key])
            _, found = self.walk(sj, sc, [_UNKNOWN] * len(sj.invars), (*path, key.split("_")[0]))
            out.extend(found)
        if out:
            self.while_loops = True
        return out


# ----------------------------------------------------------------------------
# Tracing.


def _mesh_sizes(axis_size: Any, axis_name: base.AxisName) -> dict[Hashable, int]:
    names: list[Any] = list(axis_name) if isinstance(axis_name, tuple) else [axis_name]
    if isinstance(axis_size, Mapping):
        sizes = {
            a: base.check_positive_int(axis_size[a], f"axis_size[{a!r}]") for a in names if a in axis_size
        }
        missing = [a for a in names if a not in sizes]
        if missing:
            raise ValueError(
                f"`axis_size` gives no size for the axes {missing!r} of `axis_name`={axis_name!r}."
            )
        for a, s in axis_size.items():
            if a not in sizes:
                sizes[a] = base.check_positive_int(s, f"axis_size[{a!r}]")
        return sizes
    size = base.check_positive_int(axis_size, "axis_size")
    if len(names) > 1:
        raise ValueError(
            f"`axis_name`={axis_name!r} names several axes: give `axis_size` as a mapping "
            f"from each axis name to its size, e.g. {{{names[0]!r}: 2, {names[1]!r}: 4}}."
        )
    return {names[0]: size}


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def _is_concrete(tree: Any) -> bool:
    return all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float)) for x in jax.tree.leaves(tree))


class _Traced:
    def __init__(self, jaxpr, consts, n_grads, state_def, state_mask, n_params, sizes):
        self.jaxpr = jaxpr
        self.consts = consts
        self.n_grads = n_grads
        self.state_def = state_def
        self.state_mask = state_mask  # list of bools: per-worker
        self.n_params = n_params
        self.sizes = sizes


def _trace(tx: Any, params: Any, sizes: dict[Hashable, int], axis_name: base.AxisName) -> _Traced:
    axis_names: Any = tuple(sizes.keys())
    mesh: Any = jax.sharding.AbstractMesh(tuple(sizes.values()), axis_names)
    # The trace runs on its own abstract mesh, whatever mesh (explicit or auto axes) the
    # caller has set with jax.set_mesh: shard_map requires the context mesh to match.
    with jax.sharding.use_abstract_mesh(mesh):
        return _trace_on(tx, params, mesh, sizes, axis_name)


def _trace_on(
    tx: Any, params: Any, mesh: Any, sizes: dict[Hashable, int], axis_name: base.AxisName
) -> _Traced:
    names: list[Any] = list(axis_name) if isinstance(axis_name, tuple) else [axis_name]
    n = int(math.prod(sizes[a] for a in names))
    spec = P(tuple(names) if len(names) > 1 else names[0])
    p_abs = _abstract(params)
    s_abs = jax.eval_shape(tx.init, p_abs)
    s_leaves, s_def = jax.tree.flatten(s_abs)
    try:
        found = placement.trace_placement(tx, p_abs, mesh=mesh, axis_name=axis_name, per_worker_params=False)
        per_worker_params = bool(found.updates_per_worker)
        if per_worker_params:
            found = placement.trace_placement(
                tx, p_abs, mesh=mesh, axis_name=axis_name, per_worker_params=True
            )
        mask = s_def.flatten_up_to(found.per_worker)
        leaf_specs = s_def.flatten_up_to(placement.leaf_specs(found, axis_name))
    except Exception:
        # Untypable under check_vma (see below): treat the state as replicated.
        per_worker_params = False
        mask = [False] * len(s_leaves)
        leaf_specs = [P()] * len(s_leaves)
    # Inputs carry their shardings: meshes whose axes are Explicit (JAX >= 0.11's
    # default) check every shard_map input's sharding against its in_spec.
    sharded = jax.sharding.NamedSharding(mesh, spec)
    replicated = jax.sharding.NamedSharding(mesh, P())
    stack = lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharded)  # noqa: E731
    keep = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
    g_in = jax.tree.map(stack, p_abs)
    # Per-worker leaves are stacked over the axes they vary over (P("dcn") for a
    # residual kept once per slow group on a 2-D mesh).
    s_in = [
        jax.ShapeDtypeStruct(
            (layout.spec_size(mesh, sp), *x.shape), x.dtype, sharding=jax.sharding.NamedSharding(mesh, sp)
        )
        if m
        else keep(x)
        for x, m, sp in zip(s_leaves, mask, leaf_specs)
    ]
    p_in = jax.tree.map(stack if per_worker_params else keep, p_abs)

    def body(g, s, p):
        g = comm.to_varying(jax.tree.map(lambda x: x[0], g), axis_name)
        s = jax.tree.unflatten(s_def, [x[0] if m else x for x, m in zip(s, mask)])
        if per_worker_params:
            p = jax.tree.map(lambda x: x[0], p)
        _, s2 = tx.update(g, s, p, **placement.dummy_extras(p, axis_name))
        return [x[None] if m else x for x, m in zip(s_def.flatten_up_to(s2), mask)]

    s_spec = [sp if m else P() for m, sp in zip(mask, leaf_specs)]
    p_spec = jax.tree.map(lambda _: spec if per_worker_params else P(), p_abs)

    def trace(check_vma: bool):
        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: spec, p_abs), s_spec, p_spec),
            out_specs=s_spec,
            check_vma=check_vma,
        )
        return jax.make_jaxpr(fn)(g_in, s_in, p_in)

    try:
        closed = trace(check_vma=True)
    except Exception:
        # Some transforms trace only without varying/invariant typing (e.g. optax.MultiSteps,
        # whose cond mixes replicated and per-worker accumulators); collectives are the same.
        closed = trace(check_vma=False)
    return _Traced(
        closed.jaxpr,
        list(closed.consts),
        len(jax.tree.leaves(p_abs)),
        s_def,
        mask,
        len(jax.tree.leaves(p_abs)),
        sizes,
    )


def _initial_state(tx: Any, params: Any, traced: _Traced) -> list[Any]:
    """Concrete values of the small replicated state leaves after ``init``; unknown elsewhere."""
    s_abs = jax.eval_shape(tx.init, _abstract(params))
    leaves = jax.tree.leaves(s_abs)
    small = [(not m) and _simulated(x) for x, m in zip(leaves, traced.state_mask)]
    if not any(small):
        return [_UNKNOWN] * len(leaves)
    concrete = _is_concrete(params)

    def init_small(p):
        if p is None:
            p = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), _abstract(params))
        return [x for x, keep in zip(jax.tree.leaves(tx.init(p)), small) if keep]

    values = jax.jit(init_small)(params if concrete else None)
    it = iter(values)
    return [next(it) if keep else _UNKNOWN for keep in small]


def _find_period(sigs: list[Any], max_period: int) -> tuple[int, int] | None:
    """(period, start of the periodic tail) of ``sigs``, if the second half repeats."""
    n = len(sigs)
    for p in range(1, max_period + 1):
        if all(sigs[i] == sigs[i - p] for i in range(n // 2, n)):
            start = n // 2
            while start > 0 and sigs[start - 1] == sigs[start - 1 + p]:
                start -= 1
            return p, start
    return None


def _outside_user_mesh(fn: Any) -> Any:
    """Runs ``fn`` with no context mesh, whatever the caller set with ``jax.set_mesh``.

    The accounting traces on its own abstract mesh and evaluates small state leaves
    eagerly; a caller's mesh (explicit or auto axes) must not leak into either.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return fn(*args, **kwargs)

    return wrapped


@_outside_user_mesh
def communication_cost(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    axis_size: int | Mapping[Hashable, int],
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    steps: int | None = None,
    start: int = 0,
) -> CommunicationCost:
    r"""Bytes each worker sends and receives per step, read off ``tx``'s traced update.

    Traces ``tx.update`` under ``jax.shard_map`` over an abstract mesh of
    ``axis_size`` workers (nothing is compiled or run; no devices needed),
    collects every collective with its operand shapes and dtypes, and prices
    it with the standard algorithms (module docstring): ring all-reduce
    ``2 (k-1)/k B``, all-gather ``(k-1) B``, permute ``B`` per worker.

    Which steps are counted:

    * ``steps=N``: the steps ``start, ..., start + N - 1`` after ``init``;
      the figures are averages over them.
    * ``steps=None`` (default): the step ``start`` alone when nothing depends
      on the step. Otherwise (a ``cond``/``switch`` picked from the state,
      e.g. ``average_params(every=H)``, PowerSGD's ``start_step`` or
      ``one_allreduce``) up to 256 steps are simulated and the figures are the
      average over one period of the repeating tail (the steady state; the
      warm-up before it is named in ``notes``). A schedule that changes after
      256 steps (PowerSGD with ``start_step=1000``) needs ``start=`` or
      ``steps=``.

    The state is simulated as the module docstring explains: counters and
    other small replicated leaves are computed step by step; data-dependent
    branches are charged their most expensive branch (``exact=False``).

    Args:
      tx: any optax transformation (a chain, MultiSteps...).
      params: one copy of the parameters (arrays or ShapeDtypeStructs). If they
        are arrays, ``tx.init`` sees their values; otherwise zeros.
      axis_size: number of workers, or a mapping ``{axis: size}`` for a tuple
        ``axis_name`` or for chains that use several mesh axes.
      axis_name: the data axis (or tuple of axes) the parameters are
        replicated over.
      steps: number of steps to average over, or None (see above).
      start: the first step counted.

    Returns:
      A :class:`CommunicationCost`; ``print(cost)`` shows a table.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros(256)}
      >>> cost = jd.communication_cost(jd.all_reduce(), params, axis_size=8)
      >>> cost.sent_bytes == 2 * 7 / 8 * 4 * (256 * 256 + 256)
      True
    """
    axis_name = base.validate_axis_name(axis_name)
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"`tx` must be an optax.GradientTransformation (or have init/update); got {type(tx).__name__}."
        )
    sizes = _mesh_sizes(axis_size, axis_name)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    n = int(math.prod(sizes[a] for a in names))
    if steps is not None:
        steps = base.check_positive_int(steps, "steps")
    start = base.check_positive_int(start, "start", minimum=0)

    traced = _trace(tx, params, sizes, axis_name)
    static = _Walker(sizes, evaluate=False)
    _, sites = static.walk(
        traced.jaxpr, [_UNKNOWN] * len(traced.consts), [_UNKNOWN] * len(traced.jaxpr.invars), ()
    )

    state = _initial_state(tx, params, traced)
    n_state = len(state)
    notes: list[str] = []
    evaluated: list[StepCost] = []
    step_dependent = False
    horizon = start + (steps if steps is not None else 1)
    t = 0
    cache: dict[str, Any] = {}
    while t < horizon:
        walker = _Walker(sizes, evaluate=True, cache=cache)
        args = (
            [_UNKNOWN] * traced.n_grads
            + list(state)
            + [_UNKNOWN] * (len(traced.jaxpr.invars) - traced.n_grads - n_state)
        )
        outs, found = walker.walk(traced.jaxpr, traced.consts, args, ())
        state = [o if (not m and o is not _UNKNOWN) else _UNKNOWN for o, m in zip(outs, traced.state_mask)]
        step_dependent = step_dependent or walker.resolved_branches
        if t >= start:
            exact = not (walker.unresolved_branches or walker.while_loops)
            evaluated.append(StepCost(step=t, collectives=tuple(found), exact=exact))
            if walker.unresolved_branches and not any("data-dependent" in x for x in notes):
                notes.append("data-dependent branch: charged its most expensive branch")
            if walker.while_loops and not any("while_loop" in x for x in notes):
                notes.append("while_loop bodies charged once per step (trip count unknown)")
        t += 1
        if steps is None and t == horizon and step_dependent and horizon < start + _AUTO_STEPS:
            horizon = start + _AUTO_STEPS

    period = tuple(s.step for s in evaluated)
    if steps is None and len(evaluated) > 1:
        sigs = [s.signature for s in evaluated]
        found_period = _find_period(sigs, len(sigs) // 4)
        if found_period is None:
            notes.append(f"no repeating pattern within {len(sigs)} steps: averaged over all of them")
        else:
            p, tail = found_period
            period = tuple(s.step for s in evaluated[-p:])
            notes.append(
                f"steady state repeats every {p} step(s) from step {evaluated[tail].step}; "
                f"averaged over steps {period[0]}..{period[-1]}"
            )

    params_bytes = comm.tree_bytes(_abstract(params))
    factor, _ = _factors("all_reduce", n)
    return CommunicationCost(
        axis_size=n,
        axis_sizes=dict(sizes),
        params_bytes=params_bytes,
        dense_bytes=factor * params_bytes,
        steps=tuple(evaluated),
        period=period,
        sites=tuple(sites),
        step_dependent=step_dependent,
        exact=all(s.exact for s in evaluated),
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------
# Alpha-beta projection.


PROJECTION_ALGORITHMS = ("ring", "auto", "gloo")
"""Collective algorithms :func:`project_step_time` can price (its ``algorithm``)."""

_WIDENED = ("bfloat16", "float16")  # XLA:CPU runs collectives of these in float32


def _log2_rounds(k: int) -> int:
    return max(1, math.ceil(math.log2(k))) if k > 1 else 0


def _algorithm_factors(
    kind: str, k: int, moving: float, payload: float, alpha: float, beta: float, algorithm: str
) -> tuple[float, int]:
    """(wire bytes per payload byte, latency rounds) of one call under ``algorithm``."""
    factor, rounds = _factors(kind, k, moving)
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
            math.prod(shape) * (4 if dtype in _WIDENED else _itemsize(dtype)) for shape, dtype in c.operands
        ]
    else:
        sizes = [c.payload_bytes]
    out = []
    for size in sizes:
        factor, rounds = _algorithm_factors(c.kind, k, c.moving, size, alpha, beta, algorithm)
        out.append((factor * size, rounds))
    return out


def _priced(c: Collective, k: int, algorithm: str, alpha: float, beta: float) -> tuple[float, float]:
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
      workers: the worker count projected for.
      by_axis: seconds per step for each group of mesh axes (keys as in
        :meth:`CommunicationCost.by_axis`).
    """

    latency_seconds: float
    bandwidth_seconds: float
    dense_seconds: float
    by_kind: Mapping[str, float]
    workers: int
    by_axis: Mapping[Any, float]

    def __new__(
        cls,
        seconds: float,
        *,
        latency_seconds: float,
        bandwidth_seconds: float,
        dense_seconds: float,
        by_kind: Mapping[str, float],
        workers: int,
        by_axis: Mapping[Any, float] | None = None,
    ) -> StepTime:
        obj = super().__new__(cls, seconds)
        obj.latency_seconds = float(latency_seconds)
        obj.bandwidth_seconds = float(bandwidth_seconds)
        obj.dense_seconds = float(dense_seconds)
        obj.by_kind = dict(by_kind)
        obj.workers = int(workers)
        obj.by_axis = dict(by_axis or {})
        return obj

    @property
    def seconds(self) -> float:
        return float(self)

    @property
    def speedup(self) -> float:
        """``dense_seconds / seconds`` (communication only)."""
        return self.dense_seconds / self.seconds if self.seconds else math.inf

    def table(self) -> str:
        lines = [f"projected communication per step, {self.workers} workers:"]
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
            f"workers={self.workers})"
        )

    def __str__(self) -> str:
        return self.table()


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


def project_step_time(
    cost: CommunicationCost,
    *,
    workers: int | None = None,
    bandwidth_gbps: float | Mapping[Hashable, float],
    latency_us: float | Mapping[Hashable, float],
    algorithm: str = "ring",
    call_floor_us: float = 0.0,
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
      workers: project for this many workers (default ``cost.axis_size``).
        Collectives over the whole data axis are re-priced with ``k =
        workers``; payloads stay those traced at ``cost.axis_size``, which
        is exact for transforms whose message size does not depend on the
        worker count (all in this library but ``num_partitions`` patterns).
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

    Returns:
      A :class:`StepTime`: the seconds per step as a float, with
      ``dense_seconds``, ``speedup``, the latency/bandwidth split and a
      ``table()``.
    """
    if not isinstance(cost, CommunicationCost):
        raise TypeError(f"`cost` must be a CommunicationCost; got {type(cost).__name__}.")
    workers = cost.axis_size if workers is None else base.check_positive_int(workers, "workers")
    if algorithm not in PROJECTION_ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {PROJECTION_ALGORITHMS}; got {algorithm!r}.")
    axes = list(cost.axis_sizes)
    gbps = _per_axis(bandwidth_gbps, "bandwidth_gbps", axes, lower_open=True)
    us = _per_axis(latency_us, "latency_us", axes, lower_open=False)
    base.check_hyperparameter(call_floor_us, "call_floor_us", lower=0.0, lower_open=False)
    floor = float(call_floor_us) * 1e-6

    def link(group: Sequence[Any]) -> tuple[float, float]:
        """(alpha seconds, beta bytes per second) of a collective over ``group``: the slowest link."""
        group = list(group) or axes
        return max(us[a] for a in group) * 1e-6, min(gbps[a] for a in group) * 1e9 / 8.0

    steps = cost._averaged()
    by_kind: dict[str, float] = {}
    by_axis: dict[Any, float] = {}
    lat = bw = 0.0
    for s in steps:
        for c in s.collectives:
            k = workers if c.group_size == cost.axis_size else c.group_size
            alpha, beta = link(c.axes)
            wire, rounds = _priced(c, k, algorithm, alpha, beta)
            wait = rounds * alpha + _floor_excess(c, k, algorithm, alpha, beta, floor)
            lat += wait
            bw += wire / beta
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + wait + wire / beta
            key = _axis_key(c.axes)
            by_axis[key] = by_axis.get(key, 0.0) + wait + wire / beta
    m = max(len(steps), 1)
    alpha, beta = link(axes)
    factor, rounds = _algorithm_factors("all_reduce", workers, 1.0, cost.params_bytes, alpha, beta, algorithm)
    dense = rounds * alpha + factor * cost.params_bytes / beta
    dense = max(dense, floor) if workers > 1 else dense
    return StepTime(
        (lat + bw) / m,
        latency_seconds=lat / m,
        bandwidth_seconds=bw / m,
        dense_seconds=dense,
        by_kind={k: v / m for k, v in by_kind.items()},
        workers=workers,
        by_axis={k: v / m for k, v in by_axis.items()},
    )


# ----------------------------------------------------------------------------
# Compiled HLO.


_HLO_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(?P<start>-start)?\("
)
_HLO_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_HLO_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip
_HLO_KIND = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "collective-permute": "permute",
    "all-to-all": "all_to_all",
    "reduce-scatter": "reduce_scatter",
}


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """A collective op of compiled HLO text (see :func:`hlo_collectives`).

    Attributes:
      kind: one of :data:`KINDS`.
      op: the HLO opcode.
      computation: the HLO computation it sits in (conditional branches and
        loop bodies are computations of their own).
      group_size: workers per replica group (0 if the text does not say).
      operands: ``(shape, hlo dtype)`` of each local operand.
      moving: for permutes, the fraction of workers that send.
    """

    kind: str
    op: str
    computation: str
    group_size: int
    operands: tuple[tuple[tuple[int, ...], str], ...]
    moving: float = 1.0

    @property
    def payload_elements(self) -> int:
        return int(sum(math.prod(s) for s, _ in self.operands))

    @property
    def payload_bytes(self) -> int:
        return int(sum(math.prod(s) * _HLO_ITEMSIZE.get(d, 4) for s, d in self.operands))

    def sent_bytes(self) -> float:
        return _factors(self.kind, self.group_size, self.moving)[0] * self.payload_bytes


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    # Mesh-axis groups (XLA with JAX >= 0.11): ``replica_groups=mesh['a'=2,'b'=4] {'b'}``
    # groups the devices over the named axes, so a group holds the product of their sizes.
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']*)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']*)'", m.group(2))
        if axes and all(a in sizes for a in axes):
            return math.prod(int(sizes[a]) for a in axes)
    return 0


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """The collectives of compiled HLO text, with their local operand shapes.

    Reads the result shape of each ``all-reduce``, ``all-gather``,
    ``collective-permute``, ``all-to-all`` and ``reduce-scatter`` (and their
    ``-start`` forms) and derives the operand: the same for all-reduce,
    all-to-all and permutes, the result divided by the group size for
    all-gather, multiplied for reduce-scatter. Use it on
    ``jax.jit(f).lower(...).compile().as_text()``.

    Note that XLA:CPU runs all-reduces of 16-bit floats in float32 (the
    reduction is "promoted"), so a bf16 all-reduce shows up here as f32.
    """
    out: list[HloCollective] = []
    computation = ""
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "\t") and line.rstrip().endswith("{"):
            header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)", line)
            if header:
                computation = header.group(1)
            continue
        m = _HLO_OP.match(line)
        if not m:
            continue
        op = m.group("op")
        shapes = [
            (tuple(int(d) for d in a.group("dims").split(",") if d), a.group("dtype"))
            for a in _HLO_ARRAY.finditer(m.group("shape"))
        ]
        shapes = [s for s in shapes if s[1] in _HLO_ITEMSIZE]
        if m.group("start"):
            if op == "all-reduce":
                pass
            elif op in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
                # (operands..., results..., [contexts]): keep the operand half.
                shapes = shapes[: max(1, len([s for s in shapes if s[0]]) // 2)]
        k = _group_size(line)
        if op == "all-gather" and k:
            dim_m = re.search(r"dimensions=\{(\d+)\}", line)
            dim = int(dim_m.group(1)) if dim_m else 0
            shapes = [(s[:dim] + (s[dim] // k,) + s[dim + 1 :], d) if s else (s, d) for s, d in shapes]
        elif op == "reduce-scatter" and k:
            dim_m = re.search(r"dimensions=\{(\d+)\}", line)
            dim = int(dim_m.group(1)) if dim_m else 0
            shapes = [(s[:dim] + (s[dim] * k,) + s[dim + 1 :], d) if s else (s, d) for s, d in shapes]
        moving = 1.0
        if op == "collective-permute":
            pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[-1])
            k = k or len(pairs)
            moving = sum(1 for a, b in pairs if a != b) / k if k else 0.0
        out.append(
            HloCollective(
                kind=_HLO_KIND[op],
                op=op + (m.group("start") or ""),
                computation=computation,
                group_size=k,
                operands=tuple(shapes),
                moving=moving,
            )
        )
    return out
