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

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_dist._src.base import AxisName, axis_names, by_dtype, cut

Reduction = Literal["mean", "sum"]


class UnboundAxisError(NameError):
    """A communicating transform ran where its ``axis_name`` is not bound."""


def _unbound_message(axis_name: AxisName, caller: str | None) -> str:
    who = f"`{caller}`" if caller else "This transform"
    name = repr(axis_name)
    first = repr(axis_names(axis_name)[0])
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
    return bool(axes and axes.intersection(axis_names(axis_name)))


def to_varying(tree: Any, axis_name: AxisName) -> Any:
    """Marks every leaf of ``tree`` as varying over ``axis_name`` (``jax.lax.pcast``).

    Needed where a loop carry or a ``lax.cond`` branch mixes a replicated value
    with per-worker ones. A no-op for leaves that already vary, and outside
    shard_map/pmap (e.g. under ``vmap``), where there is nothing to track.
    """
    manual = _manual_axes()
    names = [n for n in axis_names(axis_name) if n in manual]
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
    flatten: bool | None = None,
    caller: str | None = None,
    invariant_updates: str = "sum",
    bitcast_ring: bool | None = None,
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
        issues a single all-reduce. None (default) does so on CPU across
        processes (see :func:`flatten_by_default`); elsewhere one all-reduce
        per leaf, which XLA's GPU and TPU compilers combine.
      invariant_updates: what a leaf already reduced over the whole axis
        (typed invariant under ``shard_map(check_vma=True)``) stands for:
        ``"sum"`` or ``"mean"`` over the workers; it is not communicated again.
        ``"error"`` rejects such leaves. Partly reduced leaves (a tuple axis)
        go through :func:`per_worker_share`.
      bitcast_ring: with a 16-bit float ``dtype``, sum with
        :func:`ring_sum_16bit` (16 bits on the wire whatever the backend)
        instead of ``psum``. None (default) does so when the default backend
        is CPU, whose collectives widen 16-bit floats to float32; GPU and TPU
        keep their native narrow all-reduce.

    Returns:
      A pytree like ``tree``, replicated on every worker.
    """
    n = axis_size(axis_name, caller=caller)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum'; got {reduction!r}.")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    reduced = reduced_axes(leaves, axis_name)
    if any(reduced):
        kw = dict(
            dtype=dtype,
            divide_before=divide_before,
            denominator=denominator,
            flatten=flatten,
            bitcast_ring=bitcast_ring,
        )
        out = _reduce_with_reduced(leaves, reduced, axis_name, reduction, invariant_updates, n, caller, kw)
        return jax.tree.unflatten(treedef, out)
    denom = n if denominator is None else denominator
    out_dtypes = [jnp.result_type(x) for x in leaves]
    wire = [x.astype(dtype) if dtype is not None else x for x in leaves]
    if reduction == "mean" and divide_before:
        wire = [x / jnp.asarray(denom, x.dtype) for x in wire]
    if dtype is not None and _use_ring(jnp.dtype(dtype), bitcast_ring):
        summed = _ring_sum_leaves(wire, axis_name)
    elif flatten or (flatten is None and flatten_by_default()):
        summed = _flat_psum(wire, axis_name)
    else:
        summed = jax.lax.psum(wire, axis_name)
    out = [s.astype(d) for s, d in zip(summed, out_dtypes)]
    if reduction == "mean" and not divide_before:
        out = [x / jnp.asarray(denom, x.dtype) for x in out]
    return jax.tree.unflatten(treedef, out)


def _reduce_with_reduced(
    leaves: list[Any],
    reduced: list[tuple[Any, ...]],
    axis_name: AxisName,
    reduction: Reduction,
    invariant_updates: str,
    n: int,
    caller: str | None,
    kw: dict[str, Any],
) -> list[Any]:
    """:func:`reduce` of a list some of whose leaves are already reduced.

    Leaves reduced over every axis of ``axis_name`` are final here (no
    collective): the sum is ``x`` (``invariant_updates="sum"``) or ``n x``
    (``"mean"``), the mean that divided by the denominator. The others are
    reduced as usual, partly reduced ones as their :func:`per_worker_share`.
    """
    shares = per_worker_share(leaves, axis_name, invariant_updates=invariant_updates, caller=caller)
    names = axis_names(axis_name)
    full = [len(r) == len(names) for r in reduced]
    rest = [i for i, f in enumerate(full) if not f]
    out: list[Any] = list(leaves)
    if rest:
        done = reduce([shares[i] for i in rest], axis_name, reduction=reduction, caller=caller, **kw)
        for i, x in zip(rest, done):
            out[i] = x
    denom = kw["denominator"]
    for i in (i for i, f in enumerate(full) if f):
        x = leaves[i]
        if invariant_updates == "mean" and (reduction == "mean" and denom is None):
            continue  # already the mean
        total = x if invariant_updates == "sum" else x * jnp.asarray(n, x.dtype)
        if reduction == "mean":
            total = total / jnp.asarray(n if denom is None else denom, x.dtype)
        out[i] = total.astype(x.dtype)
    return out


# ----------------------------------------------------------------------------
# Platform facts: where the traced program will run.


_BACKENDS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where a traced program will run: the facts that choose how bytes are sent.

    The collective layer reads them while tracing to pick an algorithm: the
    16-bit ring on CPU (:func:`ring_sum_16bit`), and one packed buffer per
    dtype for ``all_reduce()`` on CPU across processes
    (:func:`flatten_by_default`). By default they describe this process
    (``jax.default_backend()``, ``jax.process_count() > 1``); set them with
    :func:`use_platform` (or ``communication_cost(..., platform=...)``) to
    trace the program that another setup would run, e.g. the workers of a
    multi-process CPU job from one launching process.

    Attributes:
      backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
      multi_process: whether the program spans several processes.
    """

    backend: str
    multi_process: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"`backend` must be one of {_BACKENDS}; got {self.backend!r}.")
        if not isinstance(self.multi_process, bool):
            raise TypeError(f"`multi_process` must be a bool; got {self.multi_process!r}.")


_PLATFORM: contextvars.ContextVar[Platform | None] = contextvars.ContextVar(
    "jaxopt_dist_platform", default=None
)


def platform() -> Platform:
    """The platform facts in force: those set by :func:`use_platform`, else this process's."""
    chosen = _PLATFORM.get()
    if chosen is not None:
        return chosen
    backend = jax.default_backend()
    return Platform(backend if backend in _BACKENDS else "gpu", jax.process_count() > 1)


@contextlib.contextmanager
def use_platform(chosen: Platform | None) -> Iterator[Platform]:
    """Traces inside the block as for ``chosen`` (None: this process's own facts).

    Examples:
      >>> import jaxopt_dist as jd
      >>> with jd.use_platform(jd.Platform("cpu", multi_process=True)) as p:
      ...     p.multi_process
      True
    """
    if chosen is not None and not isinstance(chosen, Platform):
        raise TypeError(f"`platform` must be a jaxopt_dist.Platform or None; got {chosen!r}.")
    token = _PLATFORM.set(chosen)
    try:
        yield platform()
    finally:
        _PLATFORM.reset(token)


def flatten_by_default() -> bool:
    """Whether :func:`reduce` packs the leaves into one buffer when not told.

    True on CPU across processes (:func:`platform`: backend ``"cpu"`` and
    ``multi_process``). XLA's GPU and TPU compilers combine a
    step's all-reduces into large buffers by themselves. XLA:CPU merges them
    into one all-reduce of many operands but sends each operand over gloo as
    a call of its own, and the calls cost more than their bytes: ResNet-18's
    62 leaves took 0.83 s per update between two processes at 1 Gbit/s,
    against 0.72 s as one buffer (``benchmarks/bench_network.py``). Devices
    of one process (simulated ones included) sum in memory, where packing
    gains nothing and XLA:CPU's multi-threaded concatenation can cost more
    than the reduction (a 5.3M-entry MLP: 0.87 s per step against 0.13 s).
    """
    facts = platform()
    return facts.backend == "cpu" and facts.multi_process


def _flat_psum(leaves: Sequence[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """psum of a list of arrays as one flat buffer per dtype."""
    return by_dtype(leaves, lambda flat: jax.lax.psum(flat, axis_name))


# ----------------------------------------------------------------------------
# 16-bit sums that stay 16-bit on the wire.


def _use_ring(dtype: Any, bitcast_ring: bool | None) -> bool:
    if not (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2):
        return False
    if bitcast_ring is None:
        return platform().backend == "cpu"
    return bitcast_ring


def _ring_sum_leaves(leaves: Sequence[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """:func:`ring_sum_16bit` of a list of 16-bit float arrays, packed into one buffer per dtype."""
    return by_dtype(leaves, lambda flat: ring_sum_16bit(flat, axis_name))


def ring_sum_16bit(flat: jax.Array, axis_name: AxisName, *, caller: str | None = None) -> jax.Array:
    """Sum over workers of a flat bfloat16/float16 vector, with 16 bits per entry on the wire.

    XLA:CPU's collectives (all-reduce, all-gather, all-to-all) widen 16-bit
    floats to float32, so a bfloat16 ``psum`` there sends as many bytes as a
    float32 one. Here the payload travels as its bits (bitcast to uint16),
    which no backend widens: a ring reduce-scatter of ``n - 1`` ``ppermute``
    steps, each adding the received partial sum to the local chunk in
    float32 and rounding it back to 16 bits, then one all-gather of the
    reduced chunks (typed invariant). Chunk ``c`` (of ``ceil(D / n)``
    entries, the vector zero-padded) is summed as ``x_c + x_{c+1} + ... +
    x_{c-1}`` (worker indices mod ``n``), rounding to 16 bits after each
    addition, on one worker, and every worker receives the same bits, so the
    result is bit-identical on all of them. With two workers that is one
    float32 addition rounded once, like a native 16-bit all-reduce; with more
    the ``n - 2`` extra roundings are those of any ring all-reduce in 16 bits
    (NCCL's). Where the result need not be typed replicated (under ``vmap``,
    or ``shard_map`` without ``check_vma``) the reduced chunks travel by
    ``n - 1`` ``ppermute`` shifts instead of the all-gather, same bytes:
    gloo (XLA:CPU across processes) runs those faster.

    Communication: each worker sends ``(n - 1) * ceil(D / n) * 2`` bytes in
    ``n - 1`` ``ppermute`` steps and the same in one all-gather, the bytes of
    a 16-bit ring all-reduce.

    Returns:
      The sum, shaped and typed like ``flat``, replicated.
    """
    n = axis_size(axis_name, caller=caller)
    if n == 1:  # nothing travels; psum types the result replicated
        return jax.lax.psum(flat, axis_name)
    dtype = flat.dtype
    size = flat.shape[0]
    chunk = -(-size // n)
    chunks = jnp.pad(flat, (0, chunk * n - size)).reshape(n, chunk)
    me = jax.lax.axis_index(axis_name)
    send = chunks[me]  # step 0: worker i sends its own entries of chunk i
    for step in range(1, n):
        bits = jax.lax.ppermute(
            jax.lax.bitcast_convert_type(send, jnp.uint16), axis_name, ring_permutation(n, 1)
        )
        partial = jax.lax.bitcast_convert_type(bits, dtype)  # chunk (i - step) mod n so far
        own = chunks[(me - step) % n]
        send = (partial.astype(jnp.float32) + own.astype(jnp.float32)).astype(dtype)
    # Worker i now holds the sum of chunk (i + 1) mod n.
    bits = jax.lax.bitcast_convert_type(send, jnp.uint16)
    if is_varying(bits, axis_name):  # shard_map(check_vma=True): the all-gather types it replicated
        ordered = jnp.roll(all_gather(bits, axis_name), 1, axis=0)
    else:  # vmap, or untyped: n - 1 independent shifts (gloo runs them faster than an all-gather)
        ordered = jnp.zeros((n, chunk), jnp.uint16).at[(me + 1) % n].set(bits)
        for offset in range(1, n):  # worker i receives the sum of chunk (i - offset + 1) mod n
            got = jax.lax.ppermute(bits, axis_name, ring_permutation(n, offset))
            ordered = ordered.at[(me - offset + 1) % n].set(got)
    return jax.lax.bitcast_convert_type(ordered, dtype).reshape(-1)[:size]


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
    invariant = any(n in manual for n in axis_names(axis_name))
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


def _unpack(rows: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    """Rows of packed bytes ``(n, B)`` -> per array of ``like``, its ``(n, *shape)`` values."""
    nbytes = [math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in like]
    return [_from_bytes(b, tuple(x.shape), x.dtype) for b, x in zip(cut(rows, nbytes, axis=1), like)]


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
    assert gathered.shape[0] == n
    return _unpack(gathered, arrays)


# ----------------------------------------------------------------------------
# All-to-all (chunk j of every worker goes to worker j).


def all_to_all(x: jax.Array, axis_name: AxisName, *, caller: str | None = None) -> jax.Array:
    """Sends row ``j`` of ``x`` to worker ``j``: ``out[i]`` is worker ``i``'s row for this worker.

    ``x`` has a leading axis of length ``n`` (the number of workers). Each
    worker keeps its own row and sends the other ``n - 1``: ``(n - 1) / n``
    of its bytes travel. The output is per-worker (varying under shard_map).
    """
    n = axis_size(axis_name, caller=caller)
    if x.ndim < 1 or x.shape[0] != n:
        raise ValueError(
            f"all_to_all needs a leading axis of length {n} (one row per worker); got {x.shape}."
        )
    if n == 1:
        return x
    return jax.lax.all_to_all(to_varying(x, axis_name), axis_name, 0, 0)


def ppermute_packed(
    arrays: Sequence[jax.Array],
    axis_name: AxisName,
    perm: Sequence[tuple[int, int]],
    *,
    caller: str | None = None,
) -> list[jax.Array]:
    """Sends several arrays of any shapes and numeric dtypes along ``perm`` with ONE ppermute.

    As :func:`all_gather_packed`: the arrays travel bitcast into a single uint8
    buffer of ``sum(size * itemsize)`` bytes, exactly, and come back in their
    shapes and dtypes (per-worker output).
    """
    arrays = list(arrays)
    if not arrays:
        return []
    buffer = jnp.concatenate([_to_bytes(x) for x in arrays])
    received = ppermute(buffer, axis_name, perm, caller=caller)[None]
    return [x[0] for x in _unpack(received, arrays)]


# Updates that arrive already reduced.
#
# Inside ``jax.shard_map(check_vma=True)`` (and Flax's ``nnx.shard_map``), the
# gradient of a replicated (invariant) parameter comes back typed invariant and
# already SUMMED over the axis: autodiff transposes the implicit broadcast of
# the parameter into a ``psum``. Summing it again would count every worker n
# times, so the aggregators read the type of each leaf and treat an invariant
# leaf as the sum over the workers it is invariant over.

INVARIANT_MODES = ("sum", "mean", "error")


class AlreadyReducedError(ValueError):
    """Updates arrived already reduced over the axis where per-worker values are needed."""


def check_invariant_mode(invariant_updates: Any) -> str:
    """Validates an ``invariant_updates`` option (``"sum"``, ``"mean"`` or ``"error"``)."""
    if invariant_updates not in INVARIANT_MODES:
        raise ValueError(
            f"`invariant_updates` must be one of {INVARIANT_MODES}; got {invariant_updates!r}. "
            "It says what an update typed invariant (the same on every worker) under "
            "jax.shard_map(check_vma=True) stands for: 'sum' (what jax.grad returns for "
            "replicated parameters), 'mean' (you pmean-ed the gradients yourself) or "
            "'error' (reject such updates)."
        )
    return invariant_updates


def _vma_tracked(names: tuple[Any, ...]) -> bool:
    """Whether values are typed varying/invariant over ``names`` here (check_vma=True).

    With ``check_vma=False`` every value reads as invariant, so the type says
    nothing; a cast of a constant tells the two apart (and is dead code).
    """
    probe = jax.lax.pcast(jnp.zeros((), jnp.float32), names, to="varying")
    return bool(_varying_axes(probe))


def reduced_axes(tree: Any, axis_name: AxisName) -> list[tuple[Any, ...]]:
    """Per leaf of ``tree``: the axes of ``axis_name`` it is already reduced over.

    Those are the manual axes of an enclosing ``jax.shard_map(check_vma=True)``
    over which the leaf is typed invariant. Empty for every leaf under ``vmap``,
    ``pmap``, ``check_vma=False`` or outside any map: there values carry no
    type and are taken as per-worker.
    """
    leaves = jax.tree.leaves(tree)
    manual = _manual_axes()
    names = tuple(n for n in axis_names(axis_name) if n in manual)
    if not names or not leaves or not _vma_tracked(names):
        return [() for _ in leaves]
    out = []
    for x in leaves:
        axes = _varying_axes(x) or frozenset()
        out.append(tuple(n for n in names if n not in axes))
    return out


def _already_reduced_message(
    tree: Any, reduced: list[tuple[Any, ...]], axis_name: AxisName, caller: str | None, linear: bool
) -> str:
    who = f"`{caller}`" if caller else "This transform"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    bad = [p for p, r in zip(paths, reduced) if r]
    first = repr(axis_names(axis_name)[0])
    shown = ", ".join(p or "<root>" for p in bad[:3]) + (", ..." if len(bad) > 3 else "")
    head = (
        f"{who} received updates that arrived already summed over the axis {axis_name!r}: "
        f"{len(bad)} of {len(paths)} leaves ({shown}) are typed invariant (the same on every "
        "worker). That is what jax.grad returns for replicated parameters inside "
        "jax.shard_map(check_vma=True) (and Flax's nnx.shard_map): JAX has already summed the "
        "per-worker gradients. "
    )
    if linear:
        return head + (
            "It was built with invariant_updates='error'; pass invariant_updates='sum' (the "
            "gradient of replicated parameters) or 'mean' (you pmean-ed them yourself) to accept "
            "them, or make them per-worker as below."
        )
    return head + (
        f"{who} is nonlinear and cannot recover each worker's gradient from their sum. "
        "Differentiate with respect to a per-worker copy of the parameters: "
        f"grads = jax.grad(loss_fn)(jax.lax.pcast(params, {first}, to='varying'), batch); "
        "or run the shard_map with check_vma=False; or use jaxopt_dist.data_parallel_step, "
        "which does this for you."
    )


def per_worker_share(
    tree: Any,
    axis_name: AxisName,
    *,
    invariant_updates: str = "sum",
    linear: bool = True,
    caller: str | None = None,
    cast: bool = True,
) -> Any:
    """Turns already-reduced leaves into per-worker shares with the same total.

    A leaf typed invariant over axes ``R`` of ``axis_name`` (see
    :func:`reduced_axes`) stands for the sum over the workers of ``R``
    (``invariant_updates="sum"``) or their mean (``"mean"``). It is replaced by
    ``x / |R|`` (resp. ``x``), cast to varying, so that a later sum or mean over
    ``axis_name`` gives exactly the total or mean it stands for. Transforms whose
    output depends only on the mean of their inputs (all-reduce, random-k and
    block-k with shared indices, PowerSGD) are then exact.

    With ``cast=False`` a share keeps its type, invariant over ``R``: it is the
    same on every worker there, so what follows from it alone (an
    error-feedback residual) stays typed invariant, and a mean over ``R`` of
    it is itself (``reduce(..., invariant_updates="mean")`` takes it so).

    Raises:
      AlreadyReducedError: some leaf is already reduced and ``linear`` is False
        (the caller is nonlinear) or ``invariant_updates == "error"``.
    """
    check_invariant_mode(invariant_updates)
    reduced = reduced_axes(tree, axis_name)
    if not any(reduced):
        return tree
    if not linear or invariant_updates == "error":
        raise AlreadyReducedError(_already_reduced_message(tree, reduced, axis_name, caller, linear))
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x, axes in zip(leaves, reduced):
        if axes:
            if invariant_updates == "sum":
                size = math.prod(axis_size(a, caller=caller) for a in axes)
                x = (x / jnp.asarray(size, x.dtype)).astype(x.dtype)
            if cast:
                x = jax.lax.pcast(x, axes, to="varying")
        out.append(x)
    return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------
# Branches that disagree on varying/invariant.


def _type_varying(x: Any) -> frozenset[Any]:
    """Varying axes of an array or of a ``jax.eval_shape`` result (empty if untracked)."""
    mat = getattr(x, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    vma = getattr(x, "vma", None)
    if vma is not None:
        return frozenset(vma)
    if isinstance(x, jax.ShapeDtypeStruct):
        return frozenset()
    return _varying_axes(x) or frozenset()


def _cast_to_union(tree: Any, *others: Any) -> Any:
    """Casts each leaf of ``tree`` to varying over the axes any of ``others`` varies over."""

    def cast(x, *likes):
        want = frozenset().union(*(_type_varying(y) for y in likes))
        missing = tuple(sorted(want - _type_varying(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree, *others)


def cond(pred: Any, true_fn: Any, false_fn: Any, *operands: Any) -> Any:
    """``jax.lax.cond`` whose branches may differ in varying/invariant typing.

    Under ``jax.shard_map(check_vma=True)`` both branches of a ``cond`` must
    return the same types, invariant or varying alike; a branch that returns a
    constant (zero updates, an unchanged replicated state) where the other
    returns a per-worker value fails to trace. Each output leaf here is cast to
    varying over every axis it varies over in either branch. A no-op cast
    outside shard_map. ``pred`` should be the same on every worker (e.g. from
    a replicated counter): the branches may communicate.
    """
    t_shape = jax.eval_shape(true_fn, *operands)
    f_shape = jax.eval_shape(false_fn, *operands)
    return jax.lax.cond(
        pred,
        lambda *ops: _cast_to_union(true_fn(*ops), f_shape),
        lambda *ops: _cast_to_union(false_fn(*ops), t_shape),
        *operands,
    )


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


# ----------------------------------------------------------------------------
# Reduce-scatter (row j of the sum goes to worker j).


def reduce_scatter(x: jax.Array, axis_name: AxisName, *, caller: str | None = None) -> jax.Array:
    """Sums ``x`` over the workers and gives worker ``j`` row ``j`` of the sum.

    ``x`` has a leading axis of length ``n`` (the number of workers); the
    result drops it: ``out = sum_i x_i[j]`` on worker ``j``. It is half of a
    ring all-reduce: each worker sends and receives ``(n - 1) / n`` of its
    bytes. The output is per-worker (varying under shard_map); an
    :func:`all_gather` of it completes the all-reduce.
    """
    n = axis_size(axis_name, caller=caller)
    if x.ndim < 1 or x.shape[0] != n:
        raise ValueError(
            f"reduce_scatter needs a leading axis of length {n} (one row per worker); got {x.shape}."
        )
    return jax.lax.psum_scatter(to_varying(x, axis_name), axis_name, scatter_dimension=0, tiled=False)
