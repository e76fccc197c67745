"""Per-worker copies of replicated values, made inside a traced step.

The Flax front ends run a step written for one device under ``shard_map``.
They differentiate a per-worker copy of the replicated parameters (so that
``shard_map``'s autodiff does not sum the gradients before the optimizer sees
them) and give each worker its own copy of the PRNG keys. The optimizer must
still step the *replicated* parameters: :class:`ReplicaCopies` remembers which
per-worker value copies which replicated one, and :func:`replicated` maps the
copies back while a step is being traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxopt_dist._src import base, comm


class ReplicaCopies:
    """Per-worker copies of replicated values made by the step being traced."""

    def __init__(self) -> None:
        self.originals: dict[int, tuple[Any, Any]] = {}

    def copy(self, replicated: Any, per_worker: Any) -> Any:
        """Records ``per_worker`` as this worker's copy of ``replicated``; returns it."""
        self.originals[id(per_worker)] = (per_worker, replicated)
        return per_worker

    def original(self, x: Any) -> Any | None:
        """The replicated value ``x`` copies, or None."""
        hit = self.originals.get(id(x))
        return None if hit is None or hit[0] is not x else hit[1]


_ACTIVE: list[ReplicaCopies] = []


@contextlib.contextmanager
def tracing(copies: ReplicaCopies) -> Iterator[ReplicaCopies]:
    """Makes ``copies`` the active record while the step's function is traced."""
    _ACTIVE.append(copies)
    try:
        yield copies
    finally:
        _ACTIVE.pop()


def active() -> ReplicaCopies | None:
    """The record of the step being traced, or None outside a data-parallel step."""
    return _ACTIVE[-1] if _ACTIVE else None


def replicated(tree: Any, copies: ReplicaCopies) -> Any:
    """``tree`` with every per-worker copy replaced by the replicated value it copies."""

    def one(x):
        original = copies.original(x)
        return x if original is None else original

    return jax.tree.map(one, tree)


def replicated_output(x: Any, *, axis_name: base.AxisName) -> Any:
    """A step output made replicated: floats averaged over the workers; else an error."""
    if not comm.is_varying(x, axis_name):
        return x
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return comm.pmean(x, axis_name)
    raise ValueError(
        f"The step returns a per-worker {jnp.result_type(x)} value; only floating-point outputs "
        "are averaged over workers. Return floats or replicated values."
    )
