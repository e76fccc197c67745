"""Shared types, defaults and argument checks for every transform."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from typing import Any

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
    """Cuts a flat vector back into a tree shaped like ``leaves`` (in their dtypes)."""
    out, offset = [], 0
    for x in leaves:
        size = math.prod(x.shape)
        out.append(flat[offset : offset + size].reshape(x.shape).astype(x.dtype))
        offset += size
    return jax.tree.unflatten(treedef, out)
