"""The jaxpr walker and the step simulation behind :func:`communication_cost`.

:func:`communication_cost` traces one update (:mod:`.trace`) and walks the
resulting jaxpr with a :class:`_Walker`, through ``jit``, ``custom_jvp``/
``custom_vjp``, ``cond``/``switch``, ``scan`` and ``while`` bodies, collecting
every collective with the shapes and dtypes of its operands (priced by
:mod:`.costs`).

Steps that differ. Some transforms communicate only on some steps
(``average_params(every=H)``, PowerSGD before ``start_step``, the alternating
``one_allreduce``, ``optax.MultiSteps``). Their collectives sit in
``lax.cond``/``lax.switch`` branches whose index is computed from counters in
the state. :func:`communication_cost` therefore *simulates the small
replicated part of the state* (counters, keys, flags: small non-float leaves
and float scalars): starting from ``tx.init``, it evaluates, for each step,
the operations of the update whose inputs are all known (gradients and
parameters never are), takes the branch whose index it could compute, and
carries the known new state to the next step. A branch index it cannot compute
(it depends on data, e.g. a finite-gradient check) is charged the most
expensive branch, and the step is marked inexact. ``while_loop`` bodies are
charged once per step (their trip count is unknown), also marked inexact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm, compat
from jaxopt_dist._src.accounting import costs, sharded, trace
from jaxopt_dist._src.accounting.costs import Collective, CommunicationCost, StepCost
from jaxopt_dist._src.training import layout

_SMALL = 16  # non-float state leaves (and values) of at most this many elements are simulated
_AUTO_STEPS = 256  # steps simulated by steps=None when the cost depends on the step
_MAX_AUTO_STEPS = 2048  # ... doubled up to this while no period shows
_MAX_UNROLLED_SCAN = 64  # scans this short with a known carry are walked iteration by iteration
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


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


def _value_key(eqn: Any, host: list[Any]) -> tuple[Any, ...] | None:
    """What decides ``eqn``'s outputs: the equation and its inputs' types and bytes (None: not hashed).

    Inputs that are not plain arrays or numbers (PRNG keys) are not hashed, and such an
    equation is evaluated at every step.
    """
    key: list[Any] = [id(eqn)]
    for x in host:
        if isinstance(x, jax.Array):  # a PRNG key (see _host)
            return None
        a = np.asarray(x)
        if a.dtype.kind not in "biuf":
            return None
        key.append((type(x), a.dtype.str, a.shape, a.tobytes()))
    return tuple(key)


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


def _called_jaxpr(eqn: Any) -> Any:
    """The jaxpr a call-like equation (``jit``, ``custom_jvp_call``...) runs, else None."""
    return next((eqn.params[p] for p in _CALL_PARAMS if _is_jaxpr(eqn.params.get(p))), None)


# ----------------------------------------------------------------------------
# The jaxpr walker.

Found = tuple[list[Any] | None, list[Collective]]  # (output values or None if unknown, collectives)


class _Walker:
    """Walks a jaxpr, collecting collectives and evaluating what is known."""

    def __init__(self, sizes: Mapping[Hashable, int], evaluate: bool, cache: dict[str, Any] | None = None):
        self.sizes = dict(sizes)
        self.evaluate = evaluate  # False: static inventory (every branch, nothing evaluated)
        cache = {} if cache is None else cache
        # id(jaxpr) -> (jaxpr, value): the jaxpr is kept alive so that ids stay unique.
        self.comm_cache: dict[int, tuple[Any, bool]] = cache.setdefault("comm", {})
        self.relevant_cache: dict[int, tuple[Any, list[int]]] = cache.setdefault(f"relevant{evaluate}", {})
        # (id(eqn), its inputs' bytes) -> (eqn, outputs): the steps of a simulation recompute
        # mostly the same small values (flags, counters modulo a period).
        self.value_cache: dict[tuple[Any, ...], tuple[Any, list[Any]]] = cache.setdefault("values", {})
        self.resolved_branches = False
        self.unresolved_branches = False
        self.while_loops = False

    # -- collectives -------------------------------------------------------

    def _collective(self, eqn: Any, path: tuple[str, ...]) -> Collective:
        name = eqn.primitive.name
        kind = costs.PRIMITIVE_KINDS[name]
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
        payload = int(sum(math.prod(s) * costs.itemsize(d) for s, d in operands))
        moving = 1.0
        if kind == "permute":
            perm = params.get("perm", ())
            moving = sum(1 for s, d in perm if s != d) / k if k else 0.0
        return Collective(kind, name, named, k, operands, payload, moving, path="/".join(path) or "update")

    # -- which equations matter ---------------------------------------------

    def _has_comm(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        if key not in self.comm_cache:
            self.comm_cache[key] = (jaxpr, False)  # guards recursion
            found = any(self._communicates(eqn) for eqn in jaxpr.eqns)
            self.comm_cache[key] = (jaxpr, found)
        return self.comm_cache[key][1]

    def _communicates(self, eqn: Any) -> bool:
        """Whether ``eqn`` is a collective or runs a jaxpr that contains one."""
        return eqn.primitive.name in costs.PRIMITIVE_KINDS or any(
            self._has_comm(_as_jaxpr(s)[0]) for s in jcore.jaxprs_in_params(eqn.params)
        )

    def _relevant(self, jaxpr: Any) -> list[int]:
        """Indices of the equations that communicate or may compute a simulated value.

        The others (float maths on gradients, parameters, factors) cannot
        affect a branch index or a communication, so their outputs are left
        unknown without visiting them."""
        key = id(jaxpr)
        if key not in self.relevant_cache:
            keep = [
                i
                for i, eqn in enumerate(jaxpr.eqns)
                if self._communicates(eqn)
                or (
                    self.evaluate
                    and any(_simulated(v.aval) for v in eqn.outvars if not isinstance(v, jcore.DropVar))
                )
            ]
            self.relevant_cache[key] = (jaxpr, keep)
        return self.relevant_cache[key][1]

    # -- walking -----------------------------------------------------------

    def walk(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        path: tuple[str, ...],
        taint: Sequence[bool] = (),
    ) -> tuple[list[Any], list[Collective]]:
        """(output values, collectives) of ``jaxpr`` run on ``consts`` and ``args``.

        ``taint`` marks the arguments computed from the state (all others are
        constants of the step): a branch picked by a value computed from a
        tainted one may differ from step to step (see ``resolved_branches``).
        """
        outs, found, _ = self._walk(jaxpr, consts, args, path, taint)
        return outs, found

    def _walk(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        path: tuple[str, ...],
        taint: Sequence[bool],
    ) -> tuple[list[Any], list[Collective], list[bool]]:
        """:meth:`walk`, and per output whether it is computed from a tainted argument."""
        env: dict[Any, Any] = {**dict(zip(jaxpr.constvars, consts)), **dict(zip(jaxpr.invars, args))}
        tainted = {v for v, t in zip(jaxpr.invars, taint) if t}

        def read(v):
            if isinstance(v, jcore.Literal):
                return v.val
            return env.get(v, _UNKNOWN)

        def is_tainted(v):
            return not isinstance(v, jcore.Literal) and v in tainted

        found: list[Collective] = []
        for i in self._relevant(jaxpr):
            eqn = jaxpr.eqns[i]
            tin = [is_tainted(v) for v in eqn.invars]
            here = (*path, f"{eqn.primitive.name}#{i}")
            outs, sub = self._visit(eqn, [read(v) for v in eqn.invars], here, tin)
            found.extend(sub)
            for j, v in enumerate(eqn.outvars):
                if not isinstance(v, jcore.DropVar):
                    env[v] = outs[j] if outs is not None else _UNKNOWN
                    if any(tin):
                        tainted.add(v)
        return [read(v) for v in jaxpr.outvars], found, [is_tainted(v) for v in jaxpr.outvars]

    def collect(self, jaxpr: Any, consts: Sequence[Any], path: tuple[str, ...] = ()) -> list[Collective]:
        """The collectives of ``jaxpr`` run on unknown arguments."""
        return self.walk(jaxpr, consts, [_UNKNOWN] * len(jaxpr.invars), path)[1]

    def _visit(self, eqn: Any, ins: list[Any], here: tuple[str, ...], tin: list[bool]) -> Found:
        """One equation: its outputs where known, and the collectives it runs."""
        name = eqn.primitive.name
        if name in costs.PRIMITIVE_KINDS:
            return None, [self._collective(eqn, here)]
        if name == "cond":
            return self._cond(eqn, ins, here, tin)
        if name == "scan":
            return None, self._scan(eqn, ins, here, tin)
        if name == "while":
            return None, self._while(eqn, here)
        called = _called_jaxpr(eqn)
        if called is not None:
            return self._call(eqn, called, ins, here, tin)
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if subs:  # an unfamiliar higher-order primitive: inventory only
            return None, [c for j, s in enumerate(subs) for c in self.collect(*_as_jaxpr(s), (*here, str(j)))]
        return (self._evaluate(eqn, ins) if self.evaluate else None), []

    def _call(self, eqn: Any, called: Any, ins: list[Any], path: tuple[str, ...], tin: list[bool]) -> Found:
        sub_jaxpr, sub_consts = _as_jaxpr(called)
        if len(sub_jaxpr.invars) == len(ins) and len(sub_jaxpr.outvars) == len(eqn.outvars):
            return self.walk(sub_jaxpr, sub_consts, ins, path, tin)
        return None, self.collect(sub_jaxpr, sub_consts, path)

    def _evaluate(self, eqn: Any, ins: list[Any]) -> list[Any] | None:
        if any(x is _UNKNOWN for x in ins):
            return None
        if not all(_simulated(v.aval) for v in eqn.outvars):
            return None
        # Host copies: literals cached from other traces can carry the sharding of
        # another mesh, which eager evaluation would reject.
        host = [_host(x) for x in ins]
        key = _value_key(eqn, host)
        if key is not None and key in self.value_cache:
            return self.value_cache[key][1]
        try:
            res = eqn.primitive.bind(*host, **eqn.params)
        except Exception:  # e.g. vma casts outside shard_map: leave unknown
            return None
        outs = list(res) if eqn.primitive.multiple_results else [res]
        if key is not None:
            self.value_cache[key] = (eqn, outs)  # the equation kept alive, so that its id stays its own
        return outs

    def _cond(self, eqn: Any, ins: list[Any], path: tuple[str, ...], tin: list[bool]) -> Found:
        branches = eqn.params["branches"]
        index, operands = ins[0], ins[1:]
        if self.evaluate and index is not _UNKNOWN:
            b = int(np.clip(int(np.asarray(index)), 0, len(branches) - 1))
            if len(branches) > 1 and tin[0]:  # picked by the state: may differ from step to step
                self.resolved_branches = True
            return self.walk(*_as_jaxpr(branches[b]), operands, (*path, f"branch{b}"), tin[1:])
        if not self.evaluate:
            return None, [
                c
                for b, br in enumerate(branches)
                for c in self.collect(*_as_jaxpr(br), (*path, f"branch{b}"))
            ]
        results = [
            self.walk(*_as_jaxpr(br), operands, (*path, f"branch{b}"), tin[1:])[1]
            for b, br in enumerate(branches)
        ]
        # Unresolved at evaluation time: charge the most expensive branch.
        if len({tuple(c.path for c in f) for f in results}) > 1:
            self.unresolved_branches = True
        costs_per_branch = [sum(c.sent_bytes() for c in found) for found in results]
        return None, results[int(np.argmax(costs_per_branch))] if results else []

    def _scan(self, eqn: Any, ins: list[Any], path: tuple[str, ...], tin: list[bool]) -> list[Collective]:
        body, consts = _as_jaxpr(eqn.params["jaxpr"])
        length = int(eqn.params["length"])
        num_consts, num_carry = compat.scan_operand_counts(eqn)
        carry = list(ins[num_consts : num_consts + num_carry])
        rest = [_UNKNOWN] * (len(body.invars) - num_consts - num_carry)
        if self.evaluate and length <= _MAX_UNROLLED_SCAN and any(x is not _UNKNOWN for x in carry):
            # A short loop whose carry is partly known (a ``fori_loop``'s counter): walked
            # iteration by iteration, so that a branch picked by the counter is resolved.
            found: list[Collective] = []
            carry_taint = list(tin[num_consts : num_consts + num_carry])
            for i in range(length):
                args = [*ins[:num_consts], *carry, *rest]
                taint = [*tin[:num_consts], *carry_taint, *tin[num_consts + num_carry :]]
                outs, sub, out_taint = self._walk(body, consts, args, (*path, f"iteration{i}"), taint)
                found.extend(sub)
                carry = outs[:num_carry]
                carry_taint = [a or b for a, b in zip(carry_taint, out_taint[:num_carry])]
            return found
        args = list(ins[:num_consts]) + [_UNKNOWN] * (num_carry + len(rest))
        _, found = self.walk(body, consts, args, path, tin)
        return [dataclasses.replace(c, multiplier=c.multiplier * length) for c in found]

    def _while(self, eqn: Any, path: tuple[str, ...]) -> list[Collective]:
        out: list[Collective] = []
        for key in ("cond_jaxpr", "body_jaxpr"):
            out.extend(self.collect(*_as_jaxpr(eqn.params[key]), (*path, key.split("_")[0])))
        if out:
            self.while_loops = True
        return out


# ----------------------------------------------------------------------------
# Simulating the steps.


def _initial_state(tx: Any, params: Any, traced: trace.Traced) -> list[Any]:
    """Concrete values of the small replicated state leaves after ``init``; unknown elsewhere."""
    leaves = jax.tree.leaves(jax.eval_shape(tx.init, base.abstract(params)))
    small = [(not m) and _simulated(x) for x, m in zip(leaves, traced.state_mask)]
    if not any(small):
        return [_UNKNOWN] * len(leaves)
    concrete = all(
        isinstance(x, (jax.Array, np.ndarray, np.generic, int, float)) for x in jax.tree.leaves(params)
    )

    def init_small(p):
        if p is None:
            p = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), base.abstract(params))
        return [x for x, keep in zip(jax.tree.leaves(tx.init(p)), small) if keep]

    values = iter(jax.jit(init_small)(params if concrete else None))
    return [next(values) if keep else _UNKNOWN for keep in small]


@dataclasses.dataclass
class _Simulation:
    """The evaluated steps of a simulation, and what was noticed on the way."""

    evaluated: list[StepCost] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    step_dependent: bool = False

    def record(self, t: int, found: list[Collective], walker: _Walker) -> None:
        exact = not (walker.unresolved_branches or walker.while_loops)
        self.evaluated.append(StepCost(step=t, collectives=tuple(found), exact=exact))
        if walker.unresolved_branches:
            self._note("data-dependent branch: charged its most expensive branch")
        if walker.while_loops:
            self._note("while_loop bodies charged once per step (trip count unknown)")

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)


def _step(walker: _Walker, traced: trace.Traced, state: list[Any]) -> tuple[list[Any], list[Collective]]:
    """One update from the known ``state``: (the known new state, the collectives it ran)."""
    num_params = len(traced.jaxpr.invars) - traced.num_grads - len(state)
    args = [_UNKNOWN] * traced.num_grads + list(state) + [_UNKNOWN] * num_params
    taint = [False] * traced.num_grads + [True] * len(state) + [False] * num_params
    outs, found = walker.walk(traced.jaxpr, traced.consts, args, (), taint)
    known = [o if (not m and o is not _UNKNOWN) else _UNKNOWN for o, m in zip(outs, traced.state_mask)]
    return known, found


def _simulate(
    tx: Any, params: Any, traced: trace.Traced, sizes: dict[Hashable, int], *, steps: int | None, start: int
) -> _Simulation:
    """Runs the steps from ``init`` and records those from ``start`` on (see :func:`communication_cost`)."""
    sim = _Simulation()
    state = _initial_state(tx, params, traced)
    horizon = start + (steps if steps is not None else 1)
    cache: dict[str, Any] = {}
    t = 0
    while t < horizon:
        walker = _Walker(sizes, evaluate=True, cache=cache)
        state, found = _step(walker, traced, state)
        sim.step_dependent = sim.step_dependent or walker.resolved_branches
        if t >= start:
            sim.record(t, found, walker)
        t += 1
        if steps is None and t == horizon and sim.step_dependent:
            horizon = _next_horizon(sim, start, horizon)
    return sim


def _next_horizon(sim: _Simulation, start: int, horizon: int) -> int:
    """How far a ``steps=None`` simulation of a step-dependent cost goes: 256 steps, doubled
    (up to 2048) while no repeating pattern shows, or while no simulated step communicated
    (a sync period longer than the window would otherwise read as zero bytes)."""
    if horizon < start + _AUTO_STEPS:
        return start + _AUTO_STEPS
    sigs = [s.signature for s in sim.evaluated]
    silent = not any(s.collectives for s in sim.evaluated)
    if horizon - start < _MAX_AUTO_STEPS and (silent or _find_period(sigs, len(sigs) // 4) is None):
        return start + 2 * (horizon - start)
    return horizon


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


def _averaging_period(sim: _Simulation, steps: int | None) -> tuple[int, ...]:
    """The steps the averages are taken over: one period of the steady state, else all."""
    evaluated = sim.evaluated
    period = tuple(s.step for s in evaluated)
    if steps is not None or len(evaluated) <= 1:
        return period
    sigs = [s.signature for s in evaluated]
    if sim.step_dependent and not any(s.collectives for s in evaluated):
        raise ValueError(
            f"The communication depends on the step, but none of the {len(sigs)} steps simulated from "
            f"step {evaluated[0].step} communicates (a sync period longer than that?). Pass `steps=` "
            "(a whole number of periods, e.g. steps=sync_every) to count them."
        )
    found_period = _find_period(sigs, len(sigs) // 4)
    if found_period is None:
        sim.notes.append(f"no repeating pattern within {len(sigs)} steps: averaged over all of them")
        return period
    p, tail = found_period
    period = tuple(s.step for s in evaluated[-p:])
    sim.notes.append(
        f"steady state repeats every {p} step(s) from step {evaluated[tail].step}; "
        f"averaged over steps {period[0]}..{period[-1]}"
    )
    return period


# ----------------------------------------------------------------------------
# The entry point.


def communication_cost(
    tx: optax.GradientTransformation,
    params: Any,
    *,
    num_workers: int | Mapping[Hashable, int] | None = None,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    steps: int | None = None,
    start: int = 0,
    platform: comm.Platform | None = None,
    axis_size: int | Mapping[Hashable, int] | None = None,
    param_specs: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> CommunicationCost:
    r"""Bytes each worker sends and receives per step, read off ``tx``'s traced update.

    Traces ``tx.update`` under ``jax.shard_map`` over an abstract mesh of
    ``num_workers`` workers (nothing is compiled or run; no devices needed),
    collects every collective with its operand shapes and dtypes, and prices
    it with the standard algorithms (the table in
    ``jaxopt_dist/_src/accounting/costs.py``): ring all-reduce
    ``2 (k-1)/k B``, all-gather ``(k-1) B``, permute ``B`` per worker.

    Which steps are counted:

    * ``steps=N``: the steps ``start, ..., start + N - 1`` after ``init``;
      the figures are averages over them.
    * ``steps=None`` (default): the step ``start`` alone when nothing depends
      on the step. Otherwise (a ``cond``/``switch`` picked from the state,
      e.g. ``average_params(every=H)``, PowerSGD's ``start_step`` or
      ``one_allreduce``) 256 steps are simulated, doubled up to 2048 while
      no period shows or nothing was sent (DiLoCo with ``sync_every=500``),
      and the figures are the average over one period of the repeating tail
      (the steady state; the warm-up before it is named in ``notes``). A
      period longer than that is an error asking for ``steps=``; a schedule
      that changes after the simulated steps (PowerSGD with
      ``start_step=1000``) needs ``start=`` or ``steps=``.

    The state is simulated as ``jaxopt_dist/_src/accounting/walk.py``
    explains: counters and other small replicated leaves are computed step
    by step; data-dependent branches are charged their most expensive branch
    (``exact=False``).

    What a training step sends besides ``tx``: :func:`jaxopt_dist.data_parallel_step`
    and the Flax front ends (:func:`jaxopt_dist.nnx.data_parallel`,
    :func:`jaxopt_dist.linen.data_parallel`) add one ``pmean`` per
    floating-point metric they return (4 bytes for a float32 loss). With
    ``per_worker_params=True`` the NNX model holds DiLoCo's anchor by default,
    which costs nothing; ``model_params="average"`` adds one all-reduce of the
    parameters per step, which this count does not include. SyncBN and
    ``batch_stats="per_worker"`` add their statistics' all-reduces.

    Sharded models (``param_specs``). The update is traced as
    :func:`jaxopt_dist.data_parallel_step` runs it on a mesh with model axes:
    ``jax.shard_map(..., axis_names=<data axes>)``, the parameters and the
    state leaves that belong to them sharded over the model axes, and the
    model axes left to the compiler. Two kinds of bytes come out, in
    different units, both in :meth:`CommunicationCost.by_axis`:

    * *data axes*, traced: the transform's own collectives, per worker (one
      replica) and step, on the replica's whole leaves. They equal the bytes
      of the same transform on unsharded parameters (``sent_bytes``,
      ``compression_ratio`` and :func:`project_step_time` are these).
      One device of the replica sends its shard's part of them
      (:meth:`CommunicationCost.compiled_by_axis`).
    * *model axes*, compiled: the collectives the compiler inserts inside
      a replica, e.g. to gather a sharded leaf that top-k must see whole
      (an elementwise transform such as ``all_reduce`` + ``sgd`` needs
      none). They exist only in the compiled program: the update is
      compiled on ``mesh`` (or on a mesh over this process's devices, when
      their number is that of the mesh) and its HLO read
      (:func:`jaxopt_dist.hlo_collectives`), each collective classified by
      the mesh axes its replica groups span. Per device, every collective of
      the program once per step (each branch of a conditional included).
      Without a mesh they are not counted: ``by_axis()`` has no model-axis
      key, :attr:`CommunicationCost.model_sent_bytes` is None, and
      ``notes`` says so.

    Args:
      tx: any optax transformation (a chain, MultiSteps...).
      params: one copy of the parameters (arrays or ShapeDtypeStructs). If they
        are arrays, ``tx.init`` sees their values; otherwise zeros. Parameters
        placed stacked per worker (split over ``axis_name`` along their leading
        axis, as ``data_parallel_step(..., per_worker_params=True).init``
        returns them) are rejected: they would be counted once per worker.
      num_workers: number of workers, or a mapping ``{axis: size}`` for a
        tuple ``axis_name`` or for chains that use several mesh axes.
        Required.
      axis_name: the data axis (or tuple of axes) the parameters are
        replicated over.
      steps: number of steps to average over, or None (see above).
      start: the first step counted.
      platform: the platform whose program is counted, as a
        :class:`jaxopt_dist.Platform`; the update is traced under
        :func:`jaxopt_dist.use_platform`. None (default): the facts in
        force (an enclosing ``use_platform``, else this process's). Some transforms send other bytes on other platforms, e.g.
        ``all_reduce()`` packs its leaves into one buffer per dtype on CPU
        across processes: ``platform=jd.Platform("cpu", multi_process=True)``
        counts what the workers of such a job send, from one process.
      axis_size: deprecated spelling of ``num_workers``.
      param_specs: for a sharded model, the PartitionSpecs over the model
        axes that :func:`jaxopt_dist.data_parallel_step` takes (a tree like
        ``params``, or a prefix), e.g. ``{"w": P("fsdp", None), "b": P()}``.
        ``num_workers`` must then give every mesh axis's size, data and
        model: ``{"data": 2, "fsdp": 4}``.
      mesh: with ``param_specs``, the ``jax.sharding.Mesh`` to compile the
        update on, to count the model-axis bytes; its axes and sizes are
        ``num_workers``'s (which may be left out). None: a mesh over this
        process's devices when their number matches, else model-axis bytes
        are not counted.

    Returns:
      A :class:`CommunicationCost`; ``print(cost)`` shows a table.

    Raises:
      TypeError: ``num_workers`` is missing, or given twice (also as
        ``axis_size``); ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: ``param_specs`` names an axis ``num_workers`` gives no
        size for, or a data axis; ``mesh`` without ``param_specs``, or
        with other axes than ``num_workers``; ``params`` stacked per worker.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros(256)}
      >>> cost = jd.communication_cost(jd.all_reduce(), params, num_workers=8)
      >>> cost.sent_bytes == 2 * 7 / 8 * 4 * (256 * 256 + 256)
      True
    """
    num_workers = base.renamed_keyword(num_workers, axis_size, new="num_workers", old="axis_size")
    axis_name = base.validate_axis_name(axis_name)
    if mesh is not None and param_specs is None:
        raise ValueError(
            "`mesh` is used with `param_specs` (a sharded model: the update is compiled on the mesh to "
            "count the model-axis bytes); without `param_specs`, give `num_workers` alone."
        )
    if num_workers is None and mesh is not None:
        num_workers = sharded.sizes_from_mesh(mesh, axis_name)
    if num_workers is None:
        raise TypeError(
            "communication_cost() needs `num_workers`: the number of workers, or a mapping "
            "{axis: size} for several mesh axes."
        )
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"`tx` must be an optax.GradientTransformation (or have init/update); got {type(tx).__name__}."
        )
    sizes = trace.mesh_sizes(num_workers, axis_name)
    stacked = layout.stacked_leaves(params, axis_name)
    if stacked:
        raise ValueError(
            f"`params` are stacked per worker (leaf {stacked[0]} is split over {axis_name!r} along "
            "its leading axis, as data_parallel_step's init returns per-worker parameters): "
            "communication_cost takes one copy of the parameters, and would count every worker's "
            "row as parameters. Pass one copy: the parameters given to init, or "
            "jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)."
        )
    if steps is not None:
        steps = base.check_positive_int(steps, "steps")
    start = base.check_positive_int(start, "start", minimum=0)
    model = None
    if param_specs is not None:
        model = sharded.resolve(param_specs, params, sizes=sizes, axis_name=axis_name, mesh=mesh)
    with trace.outside_user_mesh(), comm.use_platform(platform or comm.platform()):
        return _count(tx, params, sizes, axis_name, steps=steps, start=start, model=model)


def _count(
    tx: Any,
    params: Any,
    sizes: dict[Hashable, int],
    axis_name: base.AxisName,
    *,
    steps: int | None,
    start: int,
    model: sharded.ShardedModel | None = None,
) -> CommunicationCost:
    """:func:`communication_cost` once its arguments are checked."""
    specs = None if model is None else model.param_specs
    traced = trace.trace_update(tx, params, sizes, axis_name, specs)
    sites = _Walker(sizes, evaluate=False).collect(traced.jaxpr, [_UNKNOWN] * len(traced.consts))
    sim = _simulate(tx, params, traced, sizes, steps=steps, start=start)
    period = _averaging_period(sim, steps)
    n = int(math.prod(sizes[a] for a in base.axis_names(axis_name)))
    params_bytes = comm.tree_bytes(base.abstract(params))
    compiled, model_notes = (
        (None, []) if model is None else sharded.compiled_collectives(model, tx, params, axis_name)
    )
    return CommunicationCost(
        num_workers=n,
        axis_sizes=dict(sizes),
        params_bytes=params_bytes,
        dense_bytes=costs.factors("all_reduce", n)[0] * params_bytes,
        steps=tuple(sim.evaluated),
        period=period,
        sites=tuple(sites),
        step_dependent=sim.step_dependent,
        exact=all(s.exact for s in sim.evaluated),
        notes=(*sim.notes, *model_notes),
        data_axes=base.axis_names(axis_name),
        model_axes=() if model is None else model.axes,
        compiled=compiled,
    )
