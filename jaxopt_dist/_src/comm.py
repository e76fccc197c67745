"""The collective layer: the only module of jaxopt_dist that calls ``jax.lax`` collectives.

Every transform reaches other workers through the functions here, so that

* an unbound axis gives one clear error that says how to bind it,
* the varying/invariant bookkeeping of ``jax.shard_map(check_vma=True)`` is kept
  right (``all_gather`` outputs are invariant, ``to_varying`` is a no-op where
  it does not apply, e.g. under ``vmap``),
* ``ppermute`` permutations are always full (every worker sends and receives),
* low-precision and flattened reductions have one implementation.

The same code runs under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_dist._src.base import AxisName

Reduction = Literal["mean", "sum"]


class UnboundAxisError(NameError):
    """A communicating transform ran where its ``axis_name`` is not bound."""


def _names(axis_name: AxisName) -> tuple[Any, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _unbound_message(axis_name: AxisName, caller: str | None) -> str:
    who = f"`{caller}`" if caller else "This transform"
    name = repr(axis_name)
    first = repr(_names(axis_name)[0])
    return (
        f"{who} communicates over the axis {name}, which is not bound here. Call its "
        f"update inside a mapped context that binds {name}: jax.shard_map over a mesh "
        f"with that axis (e.g. mesh = jax.make_mesh((n,), ({first},))), "
        f"jax.pmap(..., axis_name={first}), or jax.vmap(..., axis_name={first}); "
        f"jaxopt_dist.data_parallel_step does this for you. If your mesh names its "
        f"data axis differently, pass axis_name=... to the transform."
    )


def axis_size(axis_name: AxisName, *, caller: str | None = None) -> int:
    """The number of workers on ``axis_name`` (a static Python int).

    Raises:
      UnboundAxisError: ``axis_name`` is not bound by an enclosing
        shard_map/pmap/vmap. ``caller`` names the transform in the message.
    """
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise UnboundAxisError(_unbound_message(axis_name, caller)) from e


def require_axis(axis_name: AxisName, caller: str) -> int:
    """Checks that ``axis_name`` is bound and returns its size; call first in ``update``."""
    return axis_size(axis_name, caller=caller)


def axis_index(axis_name: AxisName, *, caller: str | None = None) -> jax.Array:
    """This worker's index on ``axis_name`` (row-major over a tuple of axes)."""
    axis_size(axis_name, caller=caller)
    return jax.lax.axis_index(axis_name)


# ----------------------------------------------------------------------------
# Varying / invariant bookkeeping (shard_map with check_vma=True).


def _manual_axes() -> frozenset[Any]:
    """Mesh axes that are manual here (inside shard_map, or pmap in recent JAX)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover - very old JAX
        return frozenset()
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


def _varying_axes(x: Any) -> frozenset[Any] | None:
    """The axes over which ``x`` is known to vary, or None if JAX does not track it."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    vma = getattr(aval, "vma", None)
    return None if vma is None else frozenset(vma)


def is_varying(x: Any, axis_name: AxisName) -> bool:
    """True if ``x`` is typed as varying over any axis of ``axis_name``.

    Outside shard_map (vmap, eager) nothing is tracked and this is False.
    """
    axes = _varying_axes(x)
    return bool(axes and axes.intersection(_names(axis_name)))


def to_varying(tree: Any, axis_name: AxisName) -> Any:
    """Marks every leaf of ``tree`` as varying over ``axis_name`` (``jax.lax.pcast``).

    Needed where a loop carry or a ``lax.cond`` branch mixes a replicated value
    with per-worker ones. A no-op for leaves that already vary, and outside
    shard_map/pmap (e.g. under ``vmap``), where there is nothing to track.
    """
    manual = _manual_axes()
    names = [n for n in _names(axis_name) if n in manual]
    if not names:
        return tree

    def cast(x):
        axes = _varying_axes(x) or frozenset()
        missing = tuple(n for n in names if n not in axes)
        if not missing:
            return x
        return jax.lax.pcast(x, missing[0] if len(missing) == 1 else missing, to="varying")

    return jax.tree.map(cast, tree)


# ----------------------------------------------------------------------------
# Reductions.


def psum(tree: Any, axis_name: AxisName, *, caller: str | None = None) -> Any:
    """Sum over workers; replicated output."""
    axis_size(axis_name, caller=caller)
    return jax.lax.psum(tree, axis_name)


def pmean(tree: Any, axis_name: AxisName, *, caller: str | None = None) -> Any:
    """Mean over workers; replicated output."""
    axis_size(axis_name, caller=caller)
    return jax.lax.pmean(tree, axis_name)


def pmax(tree: Any, axis_name: AxisName, *, caller: str | None = None) -> Any:
    """Elementwise maximum over workers; replicated output."""
    axis_size(axis_name, caller=caller)
    return jax.lax.pmax(tree, axis_name)


def all_true(flag: jax.Array, axis_name: AxisName, *, caller: str | None = None) -> jax.Array:
    """Logical AND of a boolean over workers (one tiny ``pmin``); replicated output."""
    axis_size(axis_name, caller=caller)
    return jax.lax.pmin(flag.astype(jnp.int32), axis_name).astype(bool)


def reduce(
    tree: Any,
    axis_name: AxisName,
    *,
    reduction: Reduction = "mean",
    dtype: Any = None,
    divide_before: bool = False,
    denominator: Any = None,
    flatten: bool = False,
    caller: str | None = None,
) -> Any:
    """Sums or averages a pytree over ``axis_name``; outputs keep the input dtypes.

    Args:
      tree: per-worker pytree of arrays.
      axis_name: axis (or tuple of axes) to reduce over.
      reduction: ``"mean"`` or ``"sum"``.
      dtype: dtype on the wire (e.g. ``jnp.bfloat16``); None keeps each leaf's dtype.
      divide_before: for ``"mean"``, divide by the denominator before the sum
        (in the wire dtype), as PyTorch's fp16 hook does to avoid overflow;
        otherwise the division happens after, in the leaf's own dtype.
      denominator: divides by this instead of the number of workers
        (``"mean"`` only). A scalar, possibly traced.
      flatten: pack all leaves into one buffer per wire dtype, so the step
        issues a single all-reduce.

    Returns:
      A pytree like ``tree``, replicated on every worker.
    """
    n = axis_size(axis_name, caller=caller)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum'; got {reduction!r}.")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    denom = n if denominator is None else denominator
    out_dtypes = [jnp.result_type(x) for x in leaves]
    wire = [x.astype(dtype) if dtype is not None else x for x in leaves]
    if reduction == "mean" and divide_before:
        wire = [x / jnp.asarray(denom, x.dtype) for x in wire]
    if flatten:
        summed = _flat_psum(wire, axis_name)
    else:
        summed = jax.lax.psum(wire, axis_name)
    out = [s.astype(d) for s, d in zip(summed, out_dtypes)]
    if reduction == "mean" and not divide_before:
        out = [x / jnp.asarray(denom, x.dtype) for x in out]
    return jax.tree.unflatten(treedef, out)


def _flat_psum(leaves: Sequence[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """psum of a list of arrays as one flat buffer per dtype."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(jnp.result_type(x), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for idx in groups.values():
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
        flat = jax.lax.psum(flat, axis_name)
        offsets = np.cumsum([0] + [int(np.prod(leaves[i].shape)) for i in idx])
        for j, i in enumerate(idx):
            out[i] = flat[offsets[j] : offsets[j + 1]].reshape(leaves[i].shape)
    return out


# ----------------------------------------------------------------------------
# Gathers and permutations.


def all_gather(
    tree: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False, caller: str | None = None
) -> Any:
    """Gathers every worker's leaves (stacked along a new ``axis``, or concatenated if ``tiled``).

    The result is the same on every worker and is typed invariant under shard_map,
    so it can feed replicated outputs.
    """
    axis_size(axis_name, caller=caller)
    manual = _manual_axes()
    invariant = any(n in manual for n in _names(axis_name))
    if invariant:
        return jax.tree.map(
            lambda x: jax.lax.all_gather(
                to_varying(x, axis_name), axis_name, axis=axis, tiled=tiled, to="invarying"
            ),
            tree,
        )
    return jax.lax.all_gather(tree, axis_name, axis=axis, tiled=tiled)


def check_permutation(perm: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Validates that ``perm`` is a full permutation of ``range(n)`` as (source, dest) pairs."""
    perm = [(int(s), int(d)) for s, d in perm]
    srcs = sorted(s for s, _ in perm)
    dsts = sorted(d for _, d in perm)
    if srcs != list(range(n)) or dsts != list(range(n)):
        raise ValueError(
            f"A permutation over {n} workers must list every worker once as a source and "
            f"once as a destination; got {perm}."
        )
    return perm


def ppermute(
    tree: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]], *, caller: str | None = None
) -> Any:
    """Sends each worker's leaves along a full permutation; per-worker output.

    ``perm`` lists ``(source, destination)`` pairs covering every worker.
    Tuple axis names are supported under shard_map (indices row-major).
    """
    n = axis_size(axis_name, caller=caller)
    perm = check_permutation(perm, n)
    return jax.lax.ppermute(tree, axis_name, perm)


def ring_permutation(n: int, offset: int) -> list[tuple[int, int]]:
    """Worker ``i`` sends to ``(i + offset) mod n``."""
    return [(i, (i + offset) % n) for i in range(n)]


def xor_permutation(n: int, mask: int) -> list[tuple[int, int]]:
    """Worker ``i`` exchanges with ``i XOR mask`` (a butterfly stage; ``n`` a power of two)."""
    if n & (n - 1) or mask >= n or mask < 1:
        raise ValueError(f"xor_permutation needs a power-of-two n and 0 < mask < n; got n={n}, mask={mask}.")
    return [(i, i ^ mask) for i in range(n)]


def shift(tree: Any, axis_name: AxisName, offset: int, *, caller: str | None = None) -> Any:
    """Ring shift: worker ``i`` receives the leaves of worker ``(i - offset) mod n``."""
    n = axis_size(axis_name, caller=caller)
    if offset % n == 0:
        return tree
    return jax.lax.ppermute(tree, axis_name, ring_permutation(n, offset))


def exchange_xor(tree: Any, axis_name: AxisName, mask: int, *, caller: str | None = None) -> Any:
    """Butterfly exchange: worker ``i`` receives the leaves of worker ``i XOR mask``."""
    n = axis_size(axis_name, caller=caller)
    return jax.lax.ppermute(tree, axis_name, xor_permutation(n, mask))


def tree_bytes(tree: Any) -> int:
    """Bytes held by the leaves of ``tree`` (arrays or ShapeDtypeStructs)."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------
# compress_a (sparsifiers and quantizers): one all-gather for arrays of mixed dtypes.


def _to_bytes(x: jax.Array) -> jax.Array:
    """The bytes of ``x`` (any numeric dtype) as a flat uint8 vector, in memory order."""
    x = jnp.ravel(x)
    if jnp.dtype(x.dtype) == jnp.bool_:
        raise TypeError("all_gather_packed does not carry bool arrays; pack them with jnp.packbits first.")
    if jnp.dtype(x.dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    return jnp.ravel(jax.lax.bitcast_convert_type(x, jnp.uint8))


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Inverse of :func:`_to_bytes` on a batch: ``b`` is uint8 ``(n, size * itemsize)``."""
    dtype = jnp.dtype(dtype)
    n = b.shape[0]
    size = math.prod(shape)
    if dtype.itemsize == 1:
        x = jax.lax.bitcast_convert_type(b, dtype)
    else:
        x = jax.lax.bitcast_convert_type(b.reshape(n, size, dtype.itemsize), dtype)
    return x.reshape((n, *shape))


def all_gather_packed(
    arrays: Sequence[jax.Array], axis_name: AxisName, *, caller: str | None = None
) -> list[jax.Array]:
    """Gathers several arrays of any shapes and numeric dtypes with ONE all-gather.

    The arrays are bitcast to bytes and concatenated into a single uint8 buffer
    of ``B = sum(size * itemsize)`` bytes; that buffer
    is all-gathered (each worker sends ``B`` bytes and receives the other
    workers' ``(n - 1) B``) and split back. Bitcasts are exact, so values
    arrive bit for bit.

    Args:
      arrays: this worker's arrays (not bool: pack bits with ``jnp.packbits``).
      axis_name: axis (or tuple of axes) to gather over.
      caller: names the transform in the unbound-axis error.

    Returns:
      One array per input, shaped ``(n, *shape)`` in worker order (row ``i``
      is worker ``i``'s array), in the input dtype, the same on every worker
      (typed invariant under shard_map).
    """
    n = axis_size(axis_name, caller=caller)
    arrays = list(arrays)
    if not arrays:
        return []
    buffer = jnp.concatenate([_to_bytes(x) for x in arrays])
    gathered = all_gather(buffer, axis_name, caller=caller)  # uint8[n, B]
    out = []
    offset = 0
    for x in arrays:
        nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        out.append(_from_bytes(gathered[:, offset : offset + nbytes], tuple(x.shape), x.dtype))
        offset += nbytes
    assert gathered.shape[0] == n
    return out


# ----------------------------------------------------------------------------
# Gradient leaves a transform can communicate.


def is_float0(x: Any) -> bool:
    """True for ``jax.dtypes.float0`` leaves: gradients of integer inputs (``allow_int=True``)."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def float_updates(tx: Any, caller: str) -> Any:
    """``tx`` with its ``update`` guarded against non-floating gradient leaves.

    ``float0`` leaves (the gradients of integer parameters, e.g. a step counter
    differentiated with ``jax.grad(..., allow_int=True)``) pass through
    untouched: the wrapped update sees float32 zeros in their place, which
    add nothing to any sum, norm or selection, and the output holds the
    ``float0`` leaf again. Other integer or boolean leaves are rejected:
    averaging them has no single right rounding, and different transforms
    would round differently.

    Args:
      tx: an ``optax.GradientTransformationExtraArgs``.
      caller: the factory name, for error messages.

    Returns:
      A transformation of the same type with the guarded ``update``.
    """

    def update_fn(updates, state, params=None, **extra_args):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
        zero = [is_float0(x) for _, x in leaves]
        for (path, x), z in zip(leaves, zero):
            if not z and not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
                raise TypeError(
                    f"{caller}: the updates must be floating point; leaf "
                    f"{jax.tree_util.keystr(path) or '(root)'} is {jnp.result_type(x)}. Cast them "
                    "first (e.g. jax.tree.map(lambda g: g.astype(jnp.float32), grads)); gradients of "
                    "integer parameters (float0, from jax.grad(..., allow_int=True)) pass through."
                )
        if not any(zero):
            return tx.update(updates, state, params, **extra_args)
        axes = frozenset().union(
            *(_varying_axes(x) or frozenset() for (_, x), z in zip(leaves, zero) if not z)
        )

        def zeros(x):
            z = jnp.zeros(np.shape(x), jnp.float32)
            return to_varying(z, tuple(axes)) if axes else z

        inner = [zeros(x) if z else x for (_, x), z in zip(leaves, zero)]
        out, new_state = tx.update(treedef.unflatten(inner), state, params, **extra_args)
        out_leaves = treedef.flatten_up_to(out)
        restored = [x if z else o for (_, x), o, z in zip(leaves, out_leaves, zero)]
        return treedef.unflatten(restored), new_state

    return tx._replace(update=update_fn)
