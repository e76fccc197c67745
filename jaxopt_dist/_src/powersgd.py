"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al. 2019).

Every leaf with ``ndim >= 2`` is viewed as a matrix ``M`` of shape
``(n, m) = (prod(shape[:-1]), shape[-1])``: all leading dimensions are
flattened against the last one. In the JAX/Flax layout the last dimension of a
kernel is its output features (``Dense``: ``(in, out)``; ``Conv``:
``(kh, kw, in, out)``), so ``M`` is PyTorch's ``weight.view(out, -1)``
transposed (for convolutions, with the rows in ``(kh, kw, in)`` rather than
``(in, kh, kw)`` order); ``n + m`` and ``n * m``, hence the compression
figures, are the same.

One step, per compressed matrix (rank ``r = min(rank, n, m)``):

1. ``P = M Q`` with ``Q`` (``m x r``) orthonormalized first; ``Q`` is last
   step's aggregated ``Q`` (warm start) or drawn fresh from a key shared by
   every worker;
2. mean of ``P`` over the workers (ONE all-reduce for all ``P``'s of the step
   and, fused into the same buffer, every leaf sent dense);
3. ``P <- orthogonalize(P)`` (Gram-Schmidt, applied twice, with ``eps``);
4. ``Q = M^T P``, mean over the workers (ONE all-reduce for all ``Q``'s);
5. the output is ``P Q^T``, the same on every worker.

Leaves whose matrices have the same ``(n, m)`` share one group: their factors
are stacked (state, orthogonalization, all-reduce), while each matrix goes
through its own matmuls, so the gradient is never copied into a batch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import error_feedback as ef

# ----------------------------------------------------------------------------
# Static plan: which leaves are compressed, grouped by matrix shape.


class _Group(NamedTuple):
    """Compressed leaves sharing one matrix shape, processed as one batch."""

    n: int  # rows: product of the leading dims
    m: int  # columns: the last dim
    rank: int  # min(rank, n, m)
    leaves: tuple[int, ...]  # leaf indices (jax.tree.leaves order)


class _Plan(NamedTuple):
    groups: tuple[_Group, ...]
    dense: tuple[int, ...]  # leaf indices sent uncompressed


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix view of a leaf of ``shape`` (``ndim >= 2``): leading dims x last dim."""
    return int(math.prod(shape[:-1])), int(shape[-1])


def _should_compress(shape: tuple[int, ...], rank: int, min_compression_rate: float) -> int:
    """The rank used for a leaf of ``shape``, or 0 if it is sent dense."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return 0
    n, m = matrix_shape(shape)
    r = min(rank, n, m)
    return r if r * (n + m) * min_compression_rate <= n * m else 0


def _make_plan(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float) -> _Plan:
    groups: dict[tuple[int, int, int], list[int]] = {}
    dense: list[int] = []
    for i, shape in enumerate(shapes):
        r = _should_compress(tuple(shape), rank, min_compression_rate)
        if r:
            groups.setdefault((*matrix_shape(tuple(shape)), r), []).append(i)
        else:
            dense.append(i)
    return _Plan(
        groups=tuple(_Group(n, m, r, tuple(idx)) for (n, m, r), idx in groups.items()),
        dense=tuple(dense),
    )


def compressed_leaves(params: Any, *, rank: int = 1, min_compression_rate: float = 2.0) -> Any:
    """Which leaves :func:`powersgd` compresses: a pytree of bools like ``params``.

    A leaf is compressed when ``ndim >= 2`` and ``r (n + m) min_compression_rate
    <= n m`` for its matrix view ``(n, m)`` (see :func:`matrix_shape`) and
    ``r = min(rank, n, m)``.
    """
    leaves, treedef = jax.tree.flatten(params)
    plan = _make_plan([tuple(np.shape(x)) for x in leaves], rank, min_compression_rate)
    flags = [False] * len(leaves)
    for g in plan.groups:
        for i in g.leaves:
            flags[i] = True
    return jax.tree.unflatten(treedef, flags)


# ----------------------------------------------------------------------------
# Numerics.


def orthogonalize(x: jax.Array, eps: jax.typing.ArrayLike = 0.0) -> jax.Array:
    r"""Orthonormalizes the columns of each matrix of a batch ``(b, n, r)``.

    Classical Gram-Schmidt applied twice per column ("twice is enough",
    Giraud et al. 2005), so the columns stay orthonormal to rounding even when
    they are nearly dependent, as warm-started PowerSGD factors become; it is
    stable for ranks 1 to 32 and beyond. Each column is divided by
    ``norm + eps`` (PyTorch's ``orthogonalization_epsilon``); a column whose
    norm is exactly zero stays zero instead of becoming NaN, so the default
    ``eps=0`` is safe and normalizes exactly. A positive ``eps`` shrinks
    columns whose norm is not large against it. Arithmetic runs in at least
    float32; the result has ``x``'s dtype.
    """
    dtype = x.dtype
    ct = base.accumulation_dtype(dtype)
    # Work on rows: the columns of x, each contiguous in memory.
    xt = jnp.swapaxes(x.astype(ct), -1, -2)  # (b, r, n)
    eps_ = jnp.asarray(eps, ct)
    r = xt.shape[-2]

    def normalize(v):
        d = jnp.linalg.norm(v, axis=-1, keepdims=True) + eps_
        return v / jnp.where(d > 0, d, jnp.ones_like(d))

    rows = [normalize(xt[:, 0])]
    for i in range(1, r):
        v = xt[:, i]
        basis = jnp.stack(rows, axis=1)  # (b, i, n)
        for _ in range(2):
            v = v - jnp.einsum("bi,bin->bn", jnp.einsum("bin,bn->bi", basis, v), basis)
        rows.append(normalize(v))
    return jnp.swapaxes(jnp.stack(rows, axis=1), -1, -2).astype(dtype)


def orthogonalize_all(factors: list[jax.Array], eps: jax.typing.ArrayLike = 0.0) -> list[jax.Array]:
    """:func:`orthogonalize` of several batches ``(b_g, n_g, r_g)`` in one call.

    The batches are zero-padded to the largest ``n`` and ``r`` and stacked:
    zero rows change no norm or inner product and zero columns stay zero, so
    each matrix comes out as if orthogonalized alone, while the step compiles
    and runs one small kernel sequence instead of one per group.
    """
    if len(factors) <= 1:
        return [orthogonalize(x, eps) for x in factors]
    dtype = jnp.result_type(*factors)
    n = max(x.shape[1] for x in factors)
    r = max(x.shape[2] for x in factors)
    padded = [jnp.pad(x.astype(dtype), ((0, 0), (0, n - x.shape[1]), (0, r - x.shape[2]))) for x in factors]
    out = orthogonalize(jnp.concatenate(padded), eps)
    result, offset = [], 0
    for x in factors:
        b = x.shape[0]
        result.append(out[offset : offset + b, : x.shape[1], : x.shape[2]].astype(x.dtype))
        offset += b
    return result


def random_factors(key: jax.Array, shapes: list[tuple[int, ...]], dtypes: list[Any]) -> list[jax.Array]:
    """Standard-normal arrays of the given shapes, drawn with ONE call from ``key``."""
    sizes = [math.prod(s) for s in shapes]
    flat = jax.random.normal(key, (max(sum(sizes), 1),), jnp.float32)
    out, offset = [], 0
    for shape, size, dt in zip(shapes, sizes, dtypes):
        out.append(flat[offset : offset + size].reshape(shape).astype(dt))
        offset += size
    return out


def _transpose_product(mats: list[jax.Array], p: jax.Array) -> jax.Array:
    """``M^T P`` for a group's matrices ``(n, m)`` and their factors ``(b, n, r)``, as ``(b, m, r)``.

    Computed as ``(P^T M)^T``: contracting ``M`` over its leading (row)
    dimension as the right operand is a plain GEMM, whereas asking XLA:CPU for
    ``M^T P`` directly makes it transpose ``M`` in memory first (about 8x
    slower on ResNet-18's largest matrices).
    """
    qt = jnp.stack([jnp.einsum("nr,nm->rm", pj, a) for pj, a in zip(base.rows(p), mats)])
    # The barrier stops XLA from folding the transpose into the dot's output
    # layout, which makes the dot itself several times slower on CPU.
    return jnp.swapaxes(jax.lax.optimization_barrier(qt), 1, 2)


def _product(mats: list[jax.Array], q: jax.Array) -> jax.Array:
    """``M Q`` for a group's matrices ``(n, m)`` and their factors ``(b, m, r)``, as ``(b, n, r)``.

    One matmul per matrix: stacking the matrices into one batch would copy
    them all once more (the bulk of the gradient) for no faster product.
    """
    return jnp.stack([a @ qj for qj, a in zip(base.rows(q), mats)])


_OUTER_RANKS = 2  # up to this rank, P Q^T is a sum of outer products (see _outer_product)


def _outer_product(p: jax.Array, q: jax.Array) -> jax.Array:
    """``P Q^T`` for factors ``(n, r)`` and ``(m, r)``.

    Up to rank ``_OUTER_RANKS`` it is written as the sum of the ``r`` outer
    products of the columns, in column order: an elementwise expression that
    XLA fuses into its consumers (the residual, the optimizer after the
    transform), where a matmul writes an ``(n, m)`` temporary that every
    consumer reads again. Measured on ResNet-18's gradients, one core, with
    ``sgd(momentum=0.9)``: rank 2 53 -> 40 ms per update; at rank 4 the four
    products recomputed in each consumer cost what they save (about 50 ms
    either way), so higher ranks keep the matmul. (Rank 1 is the same
    program either way: XLA turns a one-term matmul into this product.)
    """
    r = p.shape[-1]
    if r > _OUTER_RANKS:
        return p @ q.T
    out = p[:, 0, None] * q[None, :, 0]
    for t in range(1, r):
        out = out + p[:, t, None] * q[None, :, t]
    return out


def _revive(factors: list[jax.Array], count: jax.Array, which: int) -> list[jax.Array]:
    """Replaces exactly-zero columns of warm-started factors by pseudo-random ones.

    A factor column that is exactly zero (its leaf's aggregated gradient was
    exactly zero on some step) would otherwise stay zero forever under warm
    start. The refill is a cheap deterministic hash of (step, position), the
    same on every worker (a threefry draw here would double the compile
    time of the update for a corner case); it only has to be generic, as a
    random start of the power iteration is. It sits in a ``lax.cond`` that
    runs only when such a column exists.
    """
    if not factors:
        return factors
    dead = [jnp.linalg.norm(x.astype(jnp.float32), axis=-2, keepdims=True) == 0 for x in factors]
    any_dead = jnp.any(jnp.stack([jnp.any(d) for d in dead]))

    def refill(x, d, g):
        b, n, r = x.shape
        i = jax.lax.broadcasted_iota(jnp.float32, (b, n, r), 1)
        j = (
            jax.lax.broadcasted_iota(jnp.float32, (b, n, r), 2)
            + jax.lax.broadcasted_iota(jnp.float32, (b, n, r), 0) * r
        )
        phase = (count % 4096).astype(jnp.float32) * 0.7548777 + (g + 1) * 0.5698403 + which * 0.3141593
        h = jnp.sin((i + 1.0) * 12.9898 + (j + 1.0) * 78.233 + phase) * 43758.5453
        fresh = (h - jnp.floor(h) - 0.5).astype(x.dtype)
        return jnp.where(d, fresh, x)

    def fill(factors):
        return [refill(x, d, g) for g, (x, d) in enumerate(zip(factors, dead))]

    return jax.lax.cond(any_dead, fill, lambda f: list(f), list(factors))


def fresh_q(key: jax.Array, count: jax.Array, plan_shapes: list[tuple[int, int, int, int]], dtype: Any):
    """The fresh ``Q``'s of step ``count`` when ``warm_start=False`` (shared by all workers).

    ``plan_shapes`` lists ``(batch, n, m, r)`` per group.
    """
    shapes = [(b, m, r) for b, _, m, r in plan_shapes]
    return random_factors(jax.random.fold_in(key, count), shapes, [dtype] * len(shapes))


# ----------------------------------------------------------------------------
# The transform.


@base.reshard_rules()
class PowerSGDState(NamedTuple):
    """State for :func:`jaxopt_dist.powersgd` (inside an :class:`ErrorFeedbackState`).

    Factors are kept per group of compressed leaves with the same matrix
    shape ``(n, m)`` (in order of first appearance in ``jax.tree.leaves``),
    stacked along a leading batch axis ``b``.

    Attributes:
      count: int32[], steps taken (dense or compressed); replicated.
      key: uint32[2], the PRNG key shared by every worker; replicated.
      p: one ``(b, n, r)`` array per group: the last aggregated ``P``;
        replicated. Kept only with ``one_allreduce=True``, else ``()``.
      q: one ``(b, m, r)`` array per group: the last aggregated ``Q`` (warm
        start); replicated. ``()`` when ``warm_start=False``.
    """

    count: jax.Array  # int32[], replicated
    key: jax.Array  # uint32[2], replicated
    p: tuple[jax.Array, ...]  # (b, n, r) per group, replicated; () unless one_allreduce
    q: tuple[jax.Array, ...]  # (b, m, r) per group, replicated; () unless warm_start


def powersgd(
    rank: int = 1,
    *,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    one_allreduce: bool = False,
    seed: int = 0,
    eps: optax.ScalarOrSchedule = 0.0,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""PowerSGD: rank-``r`` compression of the mean gradient, with error feedback.

    Each leaf with ``ndim >= 2`` is viewed as a matrix :math:`M` of shape
    ``(n, m) = (prod(shape[:-1]), shape[-1])`` (all leading dimensions
    flattened against the last; for Flax kernels the last dimension is the
    output features) and compressed when
    ``r (n + m) min_compression_rate <= n m`` with ``r = min(rank, n, m)``.
    Every other leaf (biases, norms, small matrices) is averaged exactly, fused
    into the same all-reduce as the ``P`` factors. With :math:`M_i` worker
    :math:`i`'s matrix (gradient plus residual) and :math:`Q` the warm-started
    (or fresh, shared) factor:

    .. math::
      P = \frac{1}{N}\sum_i M_i\, \mathrm{orth}(Q), \quad
      \hat P = \mathrm{orth}(P), \quad
      Q \leftarrow \frac{1}{N}\sum_i M_i^\top \hat P, \quad
      \text{output } \hat P Q^\top, \quad e_i \leftarrow M_i - \hat P Q^\top.

    The residual :math:`e_i` is taken against the aggregated approximation, as
    in the paper's code and PyTorch's ``powerSGD_hook``; dense leaves keep a
    zero residual (the paper's code; PyTorch's hook instead stores
    ``local - mean`` for them, which sums to zero over workers). ``orth`` is
    Gram-Schmidt applied twice per column with ``eps`` added to each norm
    (:func:`orthogonalize`); orthonormalizing :math:`Q` first (as the hook
    does) keeps the scale of :math:`P` in check and does not change
    :math:`\hat P` in exact arithmetic. A warm-started factor column that is
    exactly zero (its leaf's mean gradient was exactly zero) is refilled
    with a pseudo-random one, the same on every worker, instead of staying
    zero forever. Before ``start_step``
    every leaf is averaged dense (the hook's ``start_powerSGD_iter``), and
    the residual stays zero.

    When ``rank`` is at least the rank of the mean matrix (e.g.
    ``rank = min(n, m)``, with ``min_compression_rate=0`` so that such a leaf
    is compressed at all), the output is the exact mean.

    ``one_allreduce=True`` is the variant of the authors' ``powersgd`` package
    (``num_iters_per_step=1``), their answer to PyTorch issue 74148: each step
    does half a power iteration and one all-reduce. Counting compressed steps
    from 0, an even step orthonormalizes the stored ``P``, computes
    ``Q = M^T P``, averages ``Q`` (with the dense leaves) and outputs
    ``P Q^T``; an odd step orthonormalizes the stored ``Q``, computes
    ``P = M Q``, averages ``P`` (with the dense leaves) and outputs ``P Q^T``.
    The factor that was not communicated comes from the previous step, so
    this variant needs ``warm_start=True``. The approximation is one
    half-step staler than the standard one; on average a step sends half the
    factors.

    Args:
      rank: target rank ``r`` (per leaf ``min(rank, n, m)``). A Python int;
        under :func:`optax.inject_hyperparams` list it in ``static_args``.
      axis_name: the mapped axis (or tuple of axes) to average over.
      start_step: steps of plain dense averaging before compression starts.
      min_compression_rate: compress a leaf only if the factors are at least
        this many times smaller than it (PyTorch's ``min_compression_rate``);
        0 compresses every leaf with ``ndim >= 2``.
      error_feedback: keep the per-worker residual (strongly recommended).
      warm_start: reuse last step's ``Q`` (PyTorch's ``warm_start``, the
        paper's ``reuse_query``); otherwise ``Q`` is drawn each step from the
        shared key.
      one_allreduce: one all-reduce per step, alternating ``P`` and ``Q``.
      seed: seed of the shared key (initial factors, fresh ``Q``'s).
      eps: added to column norms in the orthogonalization (PyTorch's
        ``orthogonalization_epsilon``); 0 normalizes exactly and still maps
        zero columns to zero.
      invariant_updates: what an update leaf typed invariant under
        ``jax.shard_map(check_vma=True)`` stands for: ``"sum"`` over the
        workers (the gradient of replicated parameters; the default) or
        ``"mean"`` (gradients you pmean-ed yourself). PowerSGD depends only on
        the mean of its inputs, so it runs on ``sum / n`` (resp. the mean) as
        every worker's share. ``"error"`` rejects such updates.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`ErrorFeedbackState` holding a :class:`PowerSGDState`.

    Communication:
      With ``N`` workers, ``C`` the compressed leaves (matrix ``(n, m)``, rank
      ``r``), ``D`` the dense leaves and ``w`` bytes per element:

      * standard: two all-reduces per step (one per dtype if leaves mix
        dtypes): ``[P's + dense leaves]`` of ``w (sum_C n r + sum_D size)``
        bytes, then ``[Q's]`` of ``w sum_C m r`` bytes. A ring all-reduce
        sends and receives ``2 (N-1)/N`` times that per worker, in total
        ``2 (N-1)/N w (sum_C r (n + m) + sum_D size)``.
      * ``one_allreduce=True``: one all-reduce per step, ``[Q's + dense]`` on
        even compressed steps, ``[P's + dense]`` on odd ones (the choice
        sits in a ``lax.cond``).
      * before ``start_step``: one all-reduce of every leaf (``lax.cond``).

      Outputs are replicated; ``count``, ``key``, ``p`` and ``q`` are
      replicated; the residual is per-worker. A leaf that arrives already
      reduced (typed invariant, see ``invariant_updates``) while its residual
      is replicated is the same on every worker: its factors are averaged
      without communication, and its residual stays replicated, so a
      ``shard_map`` step can keep the whole state with ``out_specs=P()``.

    Sharded parameters:
      Needs whole leaves: ``M Q`` and ``M^T P`` contract over the dimensions of
      a leaf's matrix and the orthogonalization over every row of ``P``, so on
      parameters sharded over model axes the compiler splits the matmuls and
      sums partial products over those axes. ``p`` and ``q`` are replicated
      over the model axes, the residual is sharded like its parameter, and the
      all-reduces above run over the data axis, per replica. The output is that
      of replicated parameters, to float rounding (partial sums add in another
      order).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.powersgd(rank=1)
      >>> grads = jnp.ones((4, 8, 8))  # 4 workers, one 8 x 8 matrix each
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> out = jax.vmap(step, axis_name="data")(grads)
      >>> bool(jnp.allclose(out[0], 1.0, atol=1e-5))  # a rank-1 mean is exact
      True

    References:
      Vogels et al, `PowerSGD: Practical Low-Rank Gradient Compression for
      Distributed Optimization <https://arxiv.org/abs/1905.13727>`_, 2019
    """
    axis_name = base.validate_axis_name(axis_name)
    rank = base.check_positive_int(rank, "rank")
    start_step = base.check_positive_int(start_step, "start_step", minimum=0)
    base.check_seed(seed)
    if not base.is_python_number(min_compression_rate):
        raise TypeError(
            f"`min_compression_rate` must be a Python float (it decides array shapes); "
            f"got {min_compression_rate!r}."
        )
    if not (math.isfinite(float(min_compression_rate)) and float(min_compression_rate) >= 0):
        raise ValueError(f"`min_compression_rate` must be a finite float >= 0; got {min_compression_rate!r}.")
    base.check_hyperparameter(eps, "eps", lower=0.0)
    eps_schedule = eps
    base.check_bool(error_feedback, "error_feedback")
    base.check_bool(warm_start, "warm_start")
    base.check_bool(one_allreduce, "one_allreduce")
    if one_allreduce and not warm_start:
        raise ValueError(
            "`one_allreduce=True` needs `warm_start=True`: each step reuses the factor "
            "aggregated on the previous step."
        )
    mcr = float(min_compression_rate)
    invariant_updates = comm.check_invariant_mode(invariant_updates)
    seed = int(seed)

    def plan_of(leaves) -> _Plan:
        return _make_plan([tuple(np.shape(x)) for x in leaves], rank, mcr)

    def group_dtype(leaves, g: _Group):
        return jnp.result_type(*[leaves[i] for i in g.leaves])

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        plan = plan_of(leaves)
        key = jax.random.PRNGKey(seed)
        dts = [group_dtype(leaves, g) for g in plan.groups]
        p: list[jax.Array] = []
        q: list[jax.Array] = []
        if one_allreduce:
            shapes = [(len(g.leaves), g.n, g.rank) for g in plan.groups]
            p = random_factors(jax.random.fold_in(key, 0), shapes, dts)
        if warm_start:
            shapes = [(len(g.leaves), g.m, g.rank) for g in plan.groups]
            q = random_factors(jax.random.fold_in(key, 1), shapes, dts)
        return PowerSGDState(count=jnp.zeros([], jnp.int32), key=key, p=tuple(p), q=tuple(q))

    def compress(updates, state, params=None, **extra_args):
        del params, extra_args
        comm.require_axis(axis_name, "powersgd")
        leaves, treedef = jax.tree.flatten(updates)
        plan = plan_of(leaves)
        groups = plan.groups
        dtypes = [group_dtype(leaves, g) for g in groups]
        count = state.count
        eps_t = base.resolve(eps_schedule, count)

        def matrices(leaves):
            """Per group, the list of its leaves as ``(n, m)`` matrices (views, not copies)."""
            return [
                [leaves[i].astype(dt).reshape(g.n, g.m) for i in g.leaves] for g, dt in zip(groups, dtypes)
            ]

        def finish(leaves, p, q, dense_mean):
            """Output and contribution leaves: ``P Q^T`` per compressed leaf, one matmul each."""
            out = list(leaves)
            contribution = list(leaves)
            for g, a, b in zip(groups, p, q):
                for i, aj, bj in zip(g.leaves, base.rows(a), base.rows(b)):
                    x = _outer_product(aj, bj).reshape(leaves[i].shape).astype(leaves[i].dtype)
                    out[i] = x
                    contribution[i] = x
            for i, x in zip(plan.dense, dense_mean):
                out[i] = x
            return out, like_inputs(contribution, leaves)

        def like_inputs(contribution, leaves):
            """``contribution`` typed varying over the axes its input leaf varies over (all of
            them but where the updates arrived reduced), so that every branch types it alike."""
            names = base.axis_names(axis_name)
            return [
                comm.to_varying(c, tuple(a for a in names if a not in r))
                for c, r in zip(contribution, comm.reduced_axes(leaves, axis_name))
            ]

        def mean(arrays):
            # A leaf typed invariant (updates that arrived reduced, with a replicated residual)
            # is the same on every worker: its own mean, and what follows from it stays invariant.
            kw: dict[str, Any] = dict(flatten=True, caller="powersgd", invariant_updates="mean")
            if any(comm.reduced_axes(list(arrays), axis_name)):
                return comm.reduce(list(arrays), axis_name, **kw)
            # One flat buffer per dtype, cut back at offsets hidden from the compiler (base.unpack).
            return base.by_dtype(arrays, lambda flat: comm.reduce(flat, axis_name, **kw))

        def cast_like(new, old):
            return tuple(x.astype(o.dtype) for x, o in zip(new, old))

        dense_leaves = lambda leaves: [leaves[i] for i in plan.dense]  # noqa: E731

        def dense_step(leaves, p_state, q_state, count):
            del count
            out = mean(leaves)
            return out, list(leaves), p_state, q_state

        def two_sided_step(leaves, p_state, q_state, count):
            mats = matrices(leaves)
            if warm_start:
                q_in = _revive([q.astype(dt) for q, dt in zip(q_state, dtypes)], count, 1)
            else:
                shapes = [(len(g.leaves), g.n, g.m, g.rank) for g in groups]
                q_in = [q.astype(dt) for q, dt in zip(fresh_q(state.key, count, shapes, jnp.float32), dtypes)]
            q_in = orthogonalize_all(q_in, eps_t)
            p = [_product(a, q) for a, q in zip(mats, q_in)]
            reduced = mean(p + dense_leaves(leaves))
            p_hat = orthogonalize_all(reduced[: len(groups)], eps_t)
            q = mean([_transpose_product(a, x) for a, x in zip(mats, p_hat)])
            out, contribution = finish(leaves, p_hat, q, reduced[len(groups) :])
            return out, contribution, p_state, cast_like(q, q_state) if warm_start else q_state

        def half_step(leaves, stored, count, which, product):
            """The stored factor (revived, orthonormalized) and the mean over the workers of
            ``product(M, factor)``, with the dense leaves' means fused into the same all-reduce."""
            mats = matrices(leaves)
            factor = _revive([x.astype(dt) for x, dt in zip(stored, dtypes)], count, which)
            factor = orthogonalize_all(factor, eps_t)
            reduced = mean([product(a, x) for a, x in zip(mats, factor)] + dense_leaves(leaves))
            return factor, reduced[: len(groups)], reduced[len(groups) :]

        def q_step(leaves, p_state, q_state, count):
            """Even half step: P from the state, Q = M^T P communicated."""
            p_in, q, dense_mean = half_step(leaves, p_state, count, 0, _transpose_product)
            out, contribution = finish(leaves, p_in, q, dense_mean)
            return out, contribution, cast_like(p_in, p_state), cast_like(q, q_state)

        def p_step(leaves, p_state, q_state, count):
            """Odd half step: Q from the state, P = M Q communicated."""
            q_in, p, dense_mean = half_step(leaves, q_state, count, 1, _product)
            out, contribution = finish(leaves, p, q_in, dense_mean)
            return out, contribution, cast_like(p, p_state), cast_like(q_in, q_state)

        operands = (leaves, state.p, state.q, count)
        if not groups:
            branches, index = [dense_step], None
        elif one_allreduce:
            branches = [q_step, p_step]
            phase = ((count - start_step) % 2).astype(jnp.int32)
            if start_step > 0:
                branches = [dense_step, *branches]
                index = jnp.where(count < start_step, 0, 1 + phase)
            else:
                index = phase
        elif start_step > 0:
            branches = [dense_step, two_sided_step]
            index = (count >= start_step).astype(jnp.int32)
        else:
            branches, index = [two_sided_step], None

        if index is None:
            out, contribution, p_new, q_new = branches[0](*operands)
        else:
            out, contribution, p_new, q_new = jax.lax.switch(index, branches, *operands)
        new_state = PowerSGDState(
            count=jnp.asarray(optax.safe_increment(count)), key=state.key, p=tuple(p_new), q=tuple(q_new)
        )
        return (
            jax.tree.unflatten(treedef, out),
            jax.tree.unflatten(treedef, contribution),
            new_state,
        )

    compressor = ef.Compressor(
        init=init_fn,
        compress=compress,
        axis_name=axis_name,
        name="powersgd",
        invariant_updates=invariant_updates,
        linear=True,
    )
    return ef.error_feedback(compressor, enabled=error_feedback)
