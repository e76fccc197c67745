"""Shared types, defaults and argument checks for every transform."""

from __future__ import annotations

import math
import numbers
import warnings
import weakref
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

AxisName = Hashable | tuple[Hashable, ...]
"""A mesh/mapped axis name, or a tuple of them (reduced over jointly)."""

DEFAULT_AXIS_NAME: str = "data"
"""The axis every transform communicates over unless told otherwise."""


def validate_axis_name(axis_name: Any, *, arg: str = "axis_name", allow_none: bool = False) -> AxisName:
    """Checks an ``axis_name`` argument at factory time and returns it.

    Accepts a hashable name or a non-empty tuple of hashable names. Lists and
    sets are rejected because JAX would treat them inconsistently (a list is
    not hashable and a set has no order).
    """
    if axis_name is None:
        if allow_none:
            return None
        raise ValueError(
            f"`{arg}` must name the mapped axis to communicate over (for example "
            f"{DEFAULT_AXIS_NAME!r}); got None."
        )
    if isinstance(axis_name, (list, set, frozenset, dict)):
        raise TypeError(
            f"`{arg}` must be a hashable name or a tuple of names; got a "
            f"{type(axis_name).__name__}: {axis_name!r}. Use a tuple for several axes."
        )
    if isinstance(axis_name, tuple):
        if not axis_name:
            raise ValueError(f"`{arg}` must not be an empty tuple.")
        for name in axis_name:
            if isinstance(name, (list, set, tuple, frozenset, dict)) or not isinstance(name, Hashable):
                raise TypeError(f"`{arg}` entries must be hashable names; got {name!r} in {axis_name!r}.")
        return axis_name
    if not isinstance(axis_name, Hashable):
        raise TypeError(f"`{arg}` must be hashable; got {axis_name!r}.")
    return axis_name


def is_python_number(x: Any) -> bool:
    """True for Python and NumPy scalars (not bools, not JAX arrays or tracers)."""
    return isinstance(x, (numbers.Real, np.number)) and not isinstance(x, (bool, np.bool_))


def check_hyperparameter(
    value: Any,
    name: str,
    *,
    lower: float | None = 0.0,
    upper: float | None = None,
    lower_open: bool = False,
    upper_open: bool = False,
) -> None:
    """Validates a float-or-schedule hyperparameter at factory time.

    Python numbers are range-checked; callables (optax schedules) and arrays
    (as passed by :func:`optax.inject_hyperparams`) are accepted unchecked,
    since their values are only known at update time.

    Raises:
      TypeError: ``value`` is neither a number, an array nor a callable.
      ValueError: a number outside the accepted range.
    """
    if callable(value):
        return
    if isinstance(value, (bool, np.bool_)) or not (
        is_python_number(value) or isinstance(value, (jax.Array, np.ndarray))
    ):
        raise TypeError(f"`{name}` must be a float or an optax schedule; got {value!r}.")
    if not is_python_number(value):
        return
    v = float(value)
    if not np.isfinite(v):
        raise ValueError(f"`{name}` must be finite; got {value!r}.")
    lo_bad = lower is not None and (v <= lower if lower_open else v < lower)
    hi_bad = upper is not None and (v >= upper if upper_open else v > upper)
    if lo_bad or hi_bad:
        lo = "-inf" if lower is None else f"{lower:g}"
        hi = "inf" if upper is None else f"{upper:g}"
        lb = "(" if lower_open or lower is None else "["
        rb = ")" if upper_open or upper is None else "]"
        raise ValueError(f"`{name}` must lie in {lb}{lo}, {hi}{rb}; got {value!r}.")


def check_positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """Validates a shape-setting integer (``k``, ``rank``, ``every``...)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(
            f"`{name}` must be a Python int (it fixes array shapes or control flow, so it "
            f"cannot be scheduled or traced); got {value!r}."
        )
    if int(value) < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}.")
    return int(value)


def check_fraction(value: Any, name: str) -> float:
    """Validates a shape-setting fraction in ``(0, 1]`` (``rank_fraction``, ``fraction``)."""
    if not is_python_number(value):
        raise TypeError(
            f"`{name}` must be a Python float in (0, 1] (it decides array shapes); got {value!r}."
        )
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"`{name}` must lie in (0, 1]; got {value!r}.")
    return float(value)


def check_seed(seed: Any) -> int:
    """Validates a ``seed`` argument: a Python (or NumPy) int, not a bool."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"`seed` must be a Python int; got {seed!r}.")
    return int(seed)


def is_constant(value: Any, constant: float) -> bool:
    """True when ``value`` is a Python number equal to ``constant``.

    Used to drop a piece of maths statically (``momentum=0.``); schedules and
    arrays never count as constant.
    """
    return is_python_number(value) and float(value) == constant


def resolve(value: optax.ScalarOrSchedule, count: jax.Array | None) -> Any:
    """Evaluates a float-or-schedule hyperparameter at the step ``count``."""
    if callable(value):
        if count is None:
            raise ValueError("A scheduled hyperparameter needs a step count in the state.")
        return value(count)
    return value


def repeat_segments(values: jax.Array, sizes: Any) -> jax.Array:
    """``values[i]`` repeated ``sizes[i]`` times (static ints), concatenated.

    The same as ``jnp.repeat(values, sizes, total_repeat_length=sum(sizes))``,
    but built from broadcasts: ``jnp.repeat`` with per-entry counts creates
    index constants as long as the output, which XLA then constant-folds for
    minutes on models with millions of parameters.
    """
    sizes = [int(s) for s in sizes]
    return jnp.concatenate([jnp.broadcast_to(values[i], (s,)) for i, s in enumerate(sizes)])


def split_flat(flat: jax.Array, leaves: Any, treedef: Any) -> Any:
    """Cuts a flat vector back into a tree shaped like ``leaves`` (in their dtypes), with :func:`unpack`."""
    cut = unpack(flat, [np.shape(x) for x in leaves])
    return jax.tree.unflatten(treedef, [y.astype(x.dtype) for y, x in zip(cut, leaves)])


class LeafGroups:
    """Leaves that share a key (by default their shape and dtype), to work on stacked.

    Per-leaf work that a transform would otherwise write once per leaf (a DCT,
    a top-k per tile, a Newton-Schulz iteration) runs once per group on the
    group's leaves stacked along a new leading axis: the compiled program
    grows with the number of distinct keys, not with the number of leaves.

    Attributes:
      groups: per group, the indices of its leaves, in leaf order (groups in
        the order of their first leaf).
    """

    def __init__(self, leaves: Any, key: Any = None):
        key = key or (lambda x: (tuple(np.shape(x)), jnp.result_type(x)))
        groups: dict[Any, list[int]] = {}
        for i, x in enumerate(leaves):
            groups.setdefault(key(x), []).append(i)
        self.groups = list(groups.values())
        self.count = len(leaves)

    def stack(self, leaves: Any) -> list[jax.Array]:
        """Per group, its leaves stacked: ``(leaves in the group, *shape)``."""
        return [jnp.stack([leaves[i] for i in ids]) for ids in self.groups]

    def unstack(self, stacked: Any) -> list[Any]:
        """Inverse of :meth:`stack`: the leaves in leaf order (cut with :func:`rows`, one kernel per group)."""
        out: list[Any] = [None] * self.count
        for ids, x in zip(self.groups, stacked):
            for i, row in zip(ids, rows(x, len(ids))):
                out[i] = row
        return out

    # One flat buffer in group order: elementwise work on all the leaves is one kernel, and each
    # group's leaves are one contiguous run of it (their stack, raveled).

    def concat(self, leaves: Any) -> jax.Array:
        """The leaves raveled and concatenated group after group (1-D, empty if there are none)."""
        parts = [jnp.ravel(leaves[i]) for ids in self.groups for i in ids]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)

    def runs(self, flat: jax.Array, sizes: Any) -> list[jax.Array]:
        """Per group, its run of ``flat`` (:meth:`concat` of leaves of ``sizes[i]`` entries) as
        ``(leaves in the group, size)``; cut with :func:`cut`."""
        rows_of = [(len(ids), int(sizes[ids[0]])) for ids in self.groups]
        return [x.reshape(r) for x, r in zip(cut(flat, [g * s for g, s in rows_of]), rows_of)]

    def join(self, runs: Any) -> jax.Array:
        """Inverse of :meth:`runs`: per group its run ``(leaves in the group, size)``, back in one buffer."""
        return jnp.concatenate([jnp.ravel(x) for x in runs]) if runs else jnp.zeros((0,), jnp.float32)

    def split(self, flat: jax.Array, shapes: Any) -> list[jax.Array]:
        """Inverse of :meth:`concat`: the leaves in leaf order, in ``shapes``, cut with :func:`unpack`."""
        order = [i for ids in self.groups for i in ids]
        out: list[Any] = [None] * self.count
        for i, x in zip(order, unpack(flat, [shapes[i] for i in order])):
            out[i] = x
        return out


# ----------------------------------------------------------------------------
# Shared helpers with plain names (one definition each, used across modules).


def axis_names(axis_name: AxisName) -> tuple[Any, ...]:
    """``axis_name`` as a tuple of names (a single name becomes a 1-tuple)."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def abstract(tree: Any) -> Any:
    """``tree`` with every leaf as a ``jax.ShapeDtypeStruct`` (shape and dtype only)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def check_bool(flag: Any, name: str) -> bool:
    """``flag`` if it is a Python bool; else a ``TypeError`` naming the argument."""
    if not isinstance(flag, bool):
        raise TypeError(f"`{name}` must be a bool; got {flag!r}.")
    return flag


def accumulation_dtype(dtype: Any) -> Any:
    """The dtype sums are accumulated in: ``dtype`` promoted to at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def leaf_sizes(leaves: Any) -> list[int]:
    """The number of entries of each leaf of ``leaves`` (a list or any pytree)."""
    return [math.prod(np.shape(x)) for x in jax.tree.leaves(leaves)]


def format_bytes(b: float) -> str:
    """``b`` bytes in decimal units with four significant digits (``"1.5 MB"``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.4g} {unit}"
    return f"{b:.4g} B"


def no_params_message(name: str, why: str = "") -> str:
    """The one error message for a transform called without the ``params`` it needs."""
    reason = f" ({why})" if why else ""
    return (
        f"`{name}` needs `params`{reason}: call it as tx.update(updates, state, params), "
        "e.g. as jaxopt_dist.data_parallel_step and optax.MultiSteps do."
    )


# ----------------------------------------------------------------------------
# How per-worker state is regrouped for another number of workers (elastic resume).
# Each state class says it next to its definition, with the decorator below;
# :func:`jaxopt_dist.reshard_opt_state` reads the rules.

REGROUP = "regroup"
"""Rule: new worker ``j`` takes a weighted mean of the old workers' rows (the mean is conserved)."""

REDERIVE_KEY = "rederive_key"
"""Rule: per-worker PRNG keys are re-derived deterministically from worker 0's key."""

RESHARD_RULES = (REGROUP, REDERIVE_KEY)

_RESHARD: dict[type, dict[str, str]] = {}


def register_reshard_rules(state_class: type, **fields: str) -> None:
    """Records how the per-worker ``fields`` of ``state_class`` are regrouped.

    Fields not named have no rule: where such a field comes out per-worker,
    :func:`jaxopt_dist.reshard_opt_state` raises instead of guessing. A field
    named ``key``, ``keys`` or ``rng`` holding PRNG keys is re-derived without
    being named.
    """
    fields_of = getattr(state_class, "_fields", None)
    if fields_of is None:
        raise TypeError(f"{state_class!r} is not a NamedTuple state class.")
    for field, rule in fields.items():
        if field not in fields_of:
            raise ValueError(f"{state_class.__name__} has no field {field!r} (fields: {fields_of}).")
        if rule not in RESHARD_RULES:
            raise ValueError(f"Unknown reshard rule {rule!r} for {field!r}; use one of {RESHARD_RULES}.")
    _RESHARD[state_class] = dict(fields)


def reshard_rules(**fields: str) -> Any:
    """Class decorator: :func:`register_reshard_rules` next to the state's definition.

    Every state class of the library carries it, with no arguments when none
    of its fields is per-worker, so that a new state cannot leave the question
    unanswered (a test checks every exported state class).

    Examples:
      >>> from typing import NamedTuple
      >>> @reshard_rules(residual=REGROUP)
      ... class MyState(NamedTuple):
      ...     count: jax.Array
      ...     residual: jax.Array
      >>> reshard_rule(MyState, "residual")
      'regroup'
    """

    def register(cls: Any) -> Any:
        register_reshard_rules(cls, **fields)
        return cls

    return register


def reshard_rule(state_class: type, field: str) -> str | None:
    """The rule registered for ``state_class.field``, or None."""
    return _RESHARD.get(state_class, {}).get(field)


def has_reshard_rules(state_class: type) -> bool:
    """Whether ``state_class`` has said how its per-worker fields reshard (even 'none')."""
    return state_class in _RESHARD


def reshard_rule_names() -> list[str]:
    """``Class.field`` of every registered rule, for error messages."""
    return sorted(f"{cls.__name__}.{field}" for cls, rules in _RESHARD.items() for field in rules)


# ----------------------------------------------------------------------------
# Deprecated spellings, one message.


def warn_renamed(old: str, new: str, *, note: str = "", stacklevel: int = 3) -> None:
    """Warns that ``old`` is deprecated in favour of ``new`` (a ``DeprecationWarning``).

    The default ``stacklevel`` points at the caller of the public function
    that calls this one.
    """
    warnings.warn(
        f"`{old}` is deprecated and will be removed in the next release; use `{new}` instead.{note}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keyword(value: Any, old_value: Any, *, new: str, old: str) -> Any:
    """The value of keyword ``new``, given as ``new`` or as its deprecated spelling ``old``.

    Warns (at the public function's caller) when ``old`` was used.

    Raises:
      TypeError: both spellings were given.
    """
    if old_value is None:
        return value
    if value is not None:
        raise TypeError(f"Pass `{new}` only: `{old}` is its deprecated spelling, not a second setting.")
    warn_renamed(old, new, stacklevel=4)
    return old_value


# ----------------------------------------------------------------------------
# Aggregates whose mean has a second stage (a re-quantization of the mean), or
# that weigh their workers unequally.


class TwoStage(NamedTuple):
    """An aggregate whose result is a deterministic second stage applied to a mean.

    For merges that compute the mean elsewhere (islands: over a transport):
    ``first`` is the same aggregate without its second stage (each worker's
    decoded message, averaged as usual, with the same state and error
    feedback), and ``second(leaves, state)`` maps the mean of those to the
    aggregate's result, given the aggregate's state before the step (the
    same on every worker), with no communication.
    """

    first: optax.GradientTransformation
    second: Any


_TWO_STAGE: weakref.WeakKeyDictionary[Any, TwoStage] = weakref.WeakKeyDictionary()


def declare_two_stage(tx: Any, first: optax.GradientTransformation, second: Any) -> Any:
    """Records that ``tx`` (an aggregate) is ``second`` after the mean of ``first``; returns ``tx``."""
    _TWO_STAGE[tx.update] = TwoStage(first, second)
    return tx


def two_stage_of(tx: Any) -> TwoStage | None:
    """The :class:`TwoStage` declared for ``tx``, or None (its result is the mean itself)."""
    return registered(_TWO_STAGE, tx)


class Wire(NamedTuple):
    """An aggregate's message, built and read without communication, for merges that gather it elsewhere.

    Islands (:mod:`jaxopt_dist.islands`) send each island's message over their
    own link and decode and combine the messages of every island themselves:

    * ``encode(updates, state) -> message``: the list of arrays this worker's
      ``update(updates, state)`` sends (the same codes, indices and scales),
      computed without a collective; ``state`` is the aggregate's state before
      the update.
    * ``decode(message, like, state) -> (values, support)``: what a worker's
      message stands for, as leaves like ``like`` (a list of leaves):
      ``values``, what the aggregate's mean averages; ``support``, None, or
      (for ``merge="chosen_mean"``) leaves of 0 and 1 marking the entries the
      message carries. ``state`` is this worker's aggregate state before the
      update; only its fields that are the same on every worker (keys,
      counts) may be read.
    * ``merge``: how the aggregate combines the workers' values:
      ``"mean"`` (every entry over every worker) or ``"chosen_mean"`` (each
      entry over the workers whose support holds it, 0 where none does);
      another word names a merge the islands do not make (they refuse it).

    For every message, ``decode(encode(x, s), x, s)[0]`` is the aggregate's
    update on one worker, ``update(x, s)`` with a workers' axis of size 1.
    """

    encode: Any
    decode: Any
    merge: str = "mean"


_WIRE: weakref.WeakKeyDictionary[Any, Wire] = weakref.WeakKeyDictionary()


def declare_wire(tx: Any, wire: Wire) -> Any:
    """Records the :class:`Wire` of ``tx`` (an aggregate); returns ``tx``."""
    _WIRE[tx.update] = wire
    return tx


def wire_of(tx: Any) -> Wire | None:
    """The :class:`Wire` declared for ``tx``, or None (its messages are not encoded apart from its update)."""
    return registered(_WIRE, tx)


_SHARE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def declare_share(tx: Any, share: Any) -> Any:
    """Records ``share(state) -> float32[]`` for ``tx`` (an aggregate that weighs its workers); returns ``tx``.

    ``share`` gives, inside the mapping of the workers' axis and from the
    aggregate's state after an update, this worker's weight in the mean that
    update returned over the sum of the weights (``1 / workers`` before any).
    An aggregate that declares none is the plain mean, where it is ``1 / workers``.
    """
    _SHARE[tx.update] = share
    return tx


def share_of(tx: Any) -> Any:
    """The ``share`` declared for ``tx`` (see :func:`declare_share`), or None."""
    return registered(_SHARE, tx)


def registered(table: weakref.WeakKeyDictionary, tx: Any) -> Any:
    """What ``table`` records for the transformation ``tx`` (keyed by its ``update``), or None."""
    update = getattr(tx, "update", None)
    try:
        return table.get(update) if update is not None else None
    except TypeError:  # not weak-referenceable
        return None


# ----------------------------------------------------------------------------
# Pieces of one array, cut at offsets the compiler does not see.
#
# XLA:CPU compiles each distinct fused kernel on its own (tens of milliseconds
# each) and reuses one kernel for identical ones. A static slice writes its
# start into its kernel and into every consumer it fuses into, so cutting a
# stack or a flat buffer back into ``L`` leaves compiles ``L`` kernels per
# consumer. Here each start is an int32 scalar passed through an optimization
# barrier, which the compiler cannot fold: pieces of one shape, and their
# consumers, share one kernel. The values are a plain copy (bit for bit).
# (Measured with jaxlib 0.12; jaxlib 0.10 folds the constants through the
# barrier and compiles a kernel per piece, as static slices do.)


def _opaque_starts(starts: Any) -> list[jax.Array]:
    """Each start as an int32 scalar that the compiler cannot constant-fold."""
    starts = list(starts)
    if not starts:
        return []
    return list(jax.lax.optimization_barrier([jnp.asarray(int(s), jnp.int32) for s in starts]))


def pieces(x: jax.Array, spans: Any, *, axis: int = 0) -> list[jax.Array]:
    """``[x[start : start + size] for start, size in spans]`` (along ``axis``), one kernel per size.

    See the comment above: the starts are hidden from the compiler, so equal
    sizes compile once whatever their offsets. ``x`` passes the same barrier,
    so it is computed once, as a whole, rather than fused into the kernel of
    every piece (which grows the program by its computation per piece).
    """
    spans = [(int(s), int(n)) for s, n in spans]
    if len(spans) <= 1 or x.shape[axis] >= 2**31:  # nothing to share, or offsets past int32
        return [jax.lax.slice_in_dim(x, s, s + n, axis=axis) for s, n in spans]
    x, *starts = jax.lax.optimization_barrier([x, *(jnp.asarray(s, jnp.int32) for s, _ in spans)])
    return [jax.lax.dynamic_slice_in_dim(x, s, n, axis=axis) for s, (_, n) in zip(starts, spans)]


def cut(x: jax.Array, sizes: Any, *, axis: int = 0) -> list[jax.Array]:
    """``x`` cut along ``axis`` into consecutive pieces of ``sizes`` entries, with :func:`pieces`."""
    sizes = [int(n) for n in sizes]
    return pieces(x, zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes), axis=axis)


def rows(x: jax.Array, count: int | None = None) -> list[jax.Array]:
    """``[x[0], ..., x[count - 1]]`` (all rows by default), one kernel for all of them."""
    count = x.shape[0] if count is None else int(count)
    starts = _opaque_starts(range(count))
    return [jax.lax.dynamic_index_in_dim(x, s, axis=0, keepdims=False) for s in starts]


def unpack(flat: jax.Array, shapes: Any) -> list[jax.Array]:
    """Consecutive pieces of the 1-D ``flat``, reshaped to ``shapes`` (entries past them ignored)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    return [p.reshape(s) for p, s in zip(cut(flat, sizes), shapes)]


def by_dtype(arrays: Any, op: Any) -> list[jax.Array]:
    """``op`` of the arrays packed into one flat buffer per dtype, cut back with :func:`unpack`.

    ``op`` maps a 1-D array to one of the same length (e.g. a sum over the
    workers); buffers are in order of each dtype's first array.
    """
    arrays = list(arrays)
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(jnp.result_type(x), []).append(i)
    out: list[Any] = [None] * len(arrays)
    for idx in groups.values():
        flat = op(jnp.concatenate([jnp.ravel(arrays[i]) for i in idx]))
        for i, x in zip(idx, unpack(flat, [np.shape(arrays[i]) for i in idx])):
            out[i] = x
    return out


# ----------------------------------------------------------------------------
# Aggregates that combine every worker's whole contribution (robust rules).


class GatheredRule(NamedTuple):
    """An aggregate whose result is a rule applied to every worker's contribution, gathered in worker order.

    For merges that gather the contributions elsewhere (islands: over a
    transport): ``combine(stacked, state)`` maps the contributions' leaves,
    each stacked along a leading worker axis (``(n, *shape)``, row ``i`` from
    worker ``i``), and the aggregate's state before the step (the same on
    every worker) to ``(leaves, new state)``, with no communication. Rows with
    a NaN or an infinity in any leaf are left out by the rule itself. The same
    program on the same rows gives the same bits on every member.
    """

    combine: Any
    name: str


_GATHERED: weakref.WeakKeyDictionary[Any, GatheredRule] = weakref.WeakKeyDictionary()


def declare_gathered(tx: Any, combine: Any, name: str) -> Any:
    """Records that ``tx`` (an aggregate) is ``combine`` applied to the gathered contributions; returns ``tx``."""
    _GATHERED[tx.update] = GatheredRule(combine, name)
    return tx


def gathered_of(tx: Any) -> GatheredRule | None:
    """The :class:`GatheredRule` declared for ``tx``, or None (not a rule over gathered contributions)."""
    return registered(_GATHERED, tx)
