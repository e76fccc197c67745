"""Communication graphs of decentralized methods: topologies, mixing weights, permutation plans.

Shared by :func:`jaxopt_dist.gossip` and :func:`jaxopt_dist.choco_gossip`.
Everything here is static NumPy, evaluated at trace time once the number of
workers is known; no collectives. (:meth:`MixingTerm.coefficient` picks this
worker's weight out of a constant table.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_dist._src import base, comm

_TOPOLOGIES = ("ring", "torus", "exponential", "complete")
_WEIGHTS = ("uniform", "metropolis")
_TOL = 1e-6


# ----------------------------------------------------------------------------
# Topologies and mixing matrices (NumPy, static).


def check_topology(topology: Any) -> str | tuple[tuple[tuple[int, int], ...], ...]:
    """Validates ``topology`` at factory time; permutations come back as tuples."""
    if isinstance(topology, str):
        if topology not in _TOPOLOGIES:
            raise ValueError(
                f"`topology` must be one of {_TOPOLOGIES} or a list of permutations; got {topology!r}."
            )
        return topology
    if not isinstance(topology, Sequence) or not topology:
        raise TypeError(
            "`topology` must be a name such as 'ring' or a non-empty list of permutations, each a "
            f"list of (source, destination) pairs; got {topology!r}."
        )
    perms = []
    size = None
    for perm in topology:
        try:
            pairs = tuple((int(s), int(d)) for s, d in perm)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`topology` permutations must be lists of (source, destination) int pairs; got {perm!r}."
            ) from e
        if size is None:
            size = len(pairs)
        if len(pairs) != size:
            raise ValueError(f"`topology` permutations must all cover the same workers; got {topology!r}.")
        comm.check_permutation(pairs, size)
        perms.append(pairs)
    return tuple(perms)


def check_shape(shape: Any, topology: Any = None) -> tuple[int, int] | None:
    """Validates the torus ``shape`` at factory time; given ``topology``, refuses it for any other graph."""
    if shape is None:
        return None
    if not isinstance(shape, Sequence) or len(shape) != 2:
        raise TypeError(f"`shape` must be a pair (rows, cols) of ints; got {shape!r}.")
    shape = (base.check_positive_int(shape[0], "shape[0]"), base.check_positive_int(shape[1], "shape[1]"))
    if topology is not None and topology != "torus":
        raise ValueError(f"`shape` only applies to topology='torus'; got topology={topology!r}.")
    return shape


def _torus_shape(n: int, shape: tuple[int, int] | None) -> tuple[int, int]:
    if shape is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        return rows, n // rows
    if shape[0] * shape[1] != n:
        raise ValueError(f"The torus `shape` {shape} must multiply to the number of workers, {n}.")
    return shape


def num_rounds(topology: Any, n: int) -> int:
    """Number of distinct mixing matrices a topology cycles through."""
    if topology == "exponential" and n > 1:
        return (n - 1).bit_length()  # ceil(log2 n)
    return 1


def _sources(topology: Any, n: int, shape: tuple[int, int] | None, step: int) -> list[np.ndarray]:
    """Candidate permutations as arrays ``src`` (worker ``i`` receives from ``src[i]``)."""
    i = np.arange(n)
    if topology == "ring":
        return [(i - 1) % n, (i + 1) % n]
    if topology == "complete":
        return [(i - k) % n for k in range(1, n)]
    if topology == "exponential":
        if n == 1:
            return []
        return [(i - 2 ** (step % num_rounds(topology, n))) % n]
    if topology == "torus":
        rows, cols = _torus_shape(n, shape)
        r, c = i // cols, i % cols
        return [
            ((r - 1) % rows) * cols + c,
            ((r + 1) % rows) * cols + c,
            r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols,
        ]
    out = []
    for perm in topology:
        if len(perm) != n:
            raise ValueError(f"The `topology` permutations cover {len(perm)} workers but the axis has {n}.")
        src = np.empty(n, dtype=np.int64)
        for s, d in perm:
            src[d] = s
        out.append(src)
    return out


def _check_doubly_stochastic(w: np.ndarray, what: str) -> None:
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"{what} must be a square matrix; got shape {w.shape}.")
    if not np.all(np.isfinite(w)) or np.any(w < -_TOL):
        raise ValueError(f"{what} must have finite, non-negative entries.")
    rows, cols = w.sum(axis=1), w.sum(axis=0)
    if np.max(np.abs(rows - 1)) > _TOL or np.max(np.abs(cols - 1)) > _TOL:
        raise ValueError(
            f"{what} must be doubly stochastic (rows and columns summing to 1); row sums "
            f"{np.round(rows, 6).tolist()}, column sums {np.round(cols, 6).tolist()}."
        )


def _weights_matrix(topology: Any, n: int, weights: Any, sources: list[np.ndarray]) -> np.ndarray:
    """The mixing matrix for the graph given by ``sources`` (before the coverage check)."""
    if not isinstance(weights, str):
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (n, n):
            raise ValueError(f"`weights` is a {w.shape} matrix but the axis has {n} workers.")
        return w
    if topology == "exponential" or (not isinstance(topology, str) and weights == "uniform"):
        # Permutation lists (and the one-peer exponential graph): W = (I + sum_k P_k) / (K + 1).
        w = np.eye(n)
        for src in sources:
            w[np.arange(n), src] += 1.0
        return w / (len(sources) + 1)
    adjacency = np.zeros((n, n), dtype=bool)
    for src in sources:
        adjacency[np.arange(n), src] = True
    np.fill_diagonal(adjacency, False)
    if not isinstance(topology, str):
        # Metropolis weights need an undirected graph.
        adjacency = adjacency | adjacency.T
    degree = adjacency.sum(axis=1)
    w = np.zeros((n, n))
    if weights == "uniform":
        w[adjacency] = np.broadcast_to(1.0 / (degree[:, None] + 1.0), (n, n))[adjacency]
    else:
        pair_max = np.maximum(degree[:, None], degree[None, :])
        w[adjacency] = (1.0 / (1.0 + pair_max))[adjacency]
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return w


class MixingTerm(NamedTuple):
    """One ppermute of the mixing: worker ``i`` receives ``x[src[i]]`` with weight ``coeff[i]``."""

    pairs: tuple[tuple[int, int], ...]
    coeff: tuple[float, ...]

    def coefficient(self, idx: jax.Array) -> Any:
        """This worker's weight (worker ``idx``): a Python float when all workers share it."""
        if len(set(self.coeff)) == 1:
            return self.coeff[0]
        return jnp.asarray(np.asarray(self.coeff, np.float32))[idx]


def mixing_plan(
    topology: Any, n: int, *, weights: Any, shape: tuple[int, int] | None, step: int
) -> tuple[np.ndarray, list[MixingTerm]]:
    """The mixing matrix at ``step`` and the ppermutes that apply it."""
    sources = _sources(topology, n, shape, step)
    w = _weights_matrix(topology, n, weights, sources)
    _check_doubly_stochastic(w, "The mixing matrix" if isinstance(weights, str) else "`weights`")
    left = w.copy()
    np.fill_diagonal(left, 0.0)
    terms: list[MixingTerm] = []
    seen: set[tuple[int, ...]] = set()
    rows = np.arange(n)
    for src in sources:
        key = tuple(int(s) for s in src)
        if key in seen:
            continue
        seen.add(key)
        coeff = left[rows, src].copy()
        coeff[src == rows] = 0.0
        left[rows, src] = np.where(src == rows, left[rows, src], 0.0)
        if np.any(coeff != 0):
            pairs = tuple((int(s), int(d)) for d, s in enumerate(src))
            terms.append(MixingTerm(pairs, tuple(float(c) for c in coeff)))
    if np.any(np.abs(left) > _TOL):
        bad = [(int(i), int(j)) for i, j in zip(*np.nonzero(np.abs(left) > _TOL))]
        raise ValueError(
            f"The mixing weights put weight on pairs (receiver, sender) {bad[:6]} that the topology "
            "never connects; each worker can only mix with the workers it receives from."
        )
    return w, terms


def check_weights(weights: Any, topology: Any) -> Any:
    """Validates ``weights`` at factory time; a matrix comes back as nested tuples of floats."""
    if isinstance(weights, str):
        if weights not in _WEIGHTS:
            raise ValueError(f"`weights` must be one of {_WEIGHTS} or an (n, n) matrix; got {weights!r}.")
        return weights
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`weights` must be 'uniform', 'metropolis' or an (n, n) matrix; got {weights!r}."
        ) from e
    if topology == "exponential":
        raise ValueError(
            "An explicit `weights` matrix cannot be used with the time-varying 'exponential' topology."
        )
    _check_doubly_stochastic(w, "`weights`")
    # Stored as nested tuples: closures hold no arrays.
    return tuple(tuple(float(v) for v in row) for row in w)
