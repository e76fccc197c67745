"""Two-level aggregation: reduce over the fast axis first, compress only over the slow one.

Clusters are two-level: fast links inside a host or slice (NVLink, ICI),
slow links between them (Ethernet, DCN). On a mesh
``jax.make_mesh((hosts, local), ("dcn", "ici"))`` the cheap thing is to
average the gradients densely over ``"ici"`` and to send only a compressed
message over ``"dcn"``. :func:`hierarchical` is that composition with its
typing checked: after the fast stage every worker of a fast group holds the
same updates (invariant over the fast axis), so the slow compressor's
error-feedback residual is one per slow-axis group, identical on the devices
of a fast group, and the output is the same on every device of the mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm

_CALLER = "hierarchical"


@base.reshard_rules()
class HierarchicalState(NamedTuple):
    """State for :func:`jaxopt_dist.hierarchical`.

    Attributes:
      fast: the fast stage's state (``optax.EmptyState`` for the default
        dense mean).
      slow: the slow stage's state, e.g. PowerSGD's residual: varying over
        the slow axis only (one per slow-axis group), its factors replicated.
    """

    fast: optax.OptState  # state of the fast-axis stage
    slow: optax.OptState  # state of the slow-axis stage; residuals vary over the slow axis only


def _check_pair(axis_name: Any) -> tuple[Any, Any]:
    axis_name = base.validate_axis_name(axis_name)
    if not (isinstance(axis_name, tuple) and len(axis_name) == 2):
        raise ValueError(
            "`axis_name` must be a pair (slow_axis, fast_axis) naming two mesh axes, "
            f"e.g. ('dcn', 'ici') for jax.make_mesh((hosts, local), ('dcn', 'ici')); got {axis_name!r}."
        )
    slow_axis, fast_axis = axis_name
    if slow_axis == fast_axis:
        raise ValueError(f"`axis_name` must name two different axes; got {axis_name!r}.")
    return slow_axis, fast_axis


def _check_tx(tx: Any, arg: str) -> optax.GradientTransformationExtraArgs:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"`{arg}` must be an optax.GradientTransformation; got {type(tx).__name__}.")
    return optax.with_extra_args_support(tx)


def _varying_leaves(tree: Any, axis: Any) -> list[str]:
    return [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if comm.is_varying(x, axis)
    ]


def _require_invariant(tree: Any, axis: Any, message: str) -> None:
    """Under ``shard_map(check_vma=True)``: every leaf must be invariant over ``axis``."""
    bad = _varying_leaves(tree, axis)
    if bad:
        raise ValueError(f"{message} Leaves still varying over {axis!r}: {', '.join(bad[:4]) or '<root>'}.")


def hierarchical(
    fast: optax.GradientTransformation | None,
    slow: optax.GradientTransformation,
    *,
    axis_name: base.AxisName = ("dcn", "ici"),
    sharded: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Two-level aggregation: ``fast`` over the fast axis, then ``slow`` over the slow axis.

    With workers indexed by (slow group :math:`a`, fast rank :math:`b`), the
    default (``fast`` a dense mean) computes

    .. math::
      \bar g_a = \frac{1}{L}\sum_{b} g_{a,b}, \qquad
      \text{output} = \mathcal{C}_{\text{slow}}\big(\bar g_1, \dots, \bar g_H\big),

    so the slow links carry only what ``slow`` sends, e.g. PowerSGD's factors
    with ``slow=powersgd(rank=4, axis_name="dcn")``. ``fast`` may be any
    transform that leaves the updates the same on every worker of a fast
    group: ``all_reduce(axis_name="ici")``, or ``all_reduce(axis_name="ici",
    dtype=jnp.bfloat16)`` to halve the fast traffic too. ``slow`` is any
    aggregator over the slow axis (``powersgd``, ``top_k``, ``adasum``,
    ``all_reduce``...). It is ``optax.chain(fast, slow)`` with the typing
    checked under ``jax.shard_map(check_vma=True)``: the fast stage's output
    must be invariant over the fast axis and the final output invariant over
    both (a clear error otherwise, at trace time).

    FSDP/ZeRO (``sharded=True``): parameters and optimizer state are sharded
    over the fast axis (``P("ici")``), each device holds a different shard,
    and the gradient of a shard that the forward pass all-gathered over the
    fast axis already arrives *summed* over it (autodiff turns the all-gather
    into a reduce-scatter). ``fast`` then defaults to dividing by the fast
    axis size (no communication), the slow compressor runs on each shard
    separately, its residual varies over both axes but is one shard in size,
    and the output is invariant over the slow axis only (it is a shard).

    Args:
      fast: the fast-axis stage, or None for a dense mean over the fast axis
        (with ``sharded=True``: division by the fast axis size).
      slow: the slow-axis stage; it must communicate over the slow axis only.
      axis_name: the pair ``(slow_axis, fast_axis)``, in the mesh's order,
        e.g. ``("dcn", "ici")`` for ``jax.make_mesh((hosts, local), ("dcn",
        "ici"))``. Pass the same pair as ``axis_name`` to
        :func:`jaxopt_dist.data_parallel_step` and
        :func:`jaxopt_dist.communication_cost`.
      sharded: the updates are shards over the fast axis (see above).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`HierarchicalState`.

    Communication:
      What ``fast`` sends over the fast axis (the default: one all-reduce
      per leaf of the full updates over the fast axis, ``2 (L-1)/L`` times
      their size per worker; none with ``sharded=True``), then what ``slow``
      sends over the slow axis (for PowerSGD its factors only). Outputs are
      replicated over both axes (over the slow axis only with
      ``sharded=True``). State: ``fast`` as its transform documents;
      ``slow``'s per-worker leaves (error-feedback residuals) vary over the
      slow axis only, one per slow group, bit-identical within a fast group
      (with ``sharded=True`` one per device, each the size of a shard).
      :func:`jaxopt_dist.data_parallel_step` places them ``P(slow_axis)``.

    Sharded parameters:
      With model axes (``data_parallel_step(param_specs=...)``) each stage
      behaves as its own docstring says: it sees whole leaves, the compiler
      handles the model axes, and the output is that of replicated
      parameters. ``sharded=True`` is another layout: the leaves are shards
      over the fast *data* axis, which is manual, so ``slow`` compresses each
      shard on its own (PowerSGD one factorization per shard, top-k its ``k``
      entries per shard). That is per-shard by design, so that nothing is
      gathered over the fast axis; its numbers differ from compressing whole
      leaves.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> tx = jd.hierarchical(
      ...     jd.all_reduce(axis_name="ici"), jd.all_reduce(axis_name="dcn"), axis_name=("dcn", "ici")
      ... )
      >>> grads = jnp.arange(6.0).reshape(2, 3, 1)  # 2 hosts x 3 local workers
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> out = jax.vmap(jax.vmap(step, axis_name="ici"), axis_name="dcn")(grads)
      >>> out[:, :, 0]
      Array([[2.5, 2.5, 2.5],
             [2.5, 2.5, 2.5]], dtype=float32)
    """
    slow_axis, fast_axis = _check_pair(axis_name)
    base.check_bool(sharded, "sharded")
    slow_tx = _check_tx(slow, "slow")
    fast_tx = None if fast is None else _check_tx(fast, "fast")

    def init_fn(params):
        fast_state = optax.EmptyState() if fast_tx is None else fast_tx.init(params)
        return HierarchicalState(fast=fast_state, slow=slow_tx.init(params))

    def fast_stage(updates, state, params, extra_args):
        if fast_tx is not None:
            return fast_tx.update(updates, state.fast, params, **extra_args)
        if sharded:
            n = comm.require_axis(fast_axis, _CALLER)
            return jax.tree.map(lambda g: g / jnp.asarray(n, g.dtype), updates), state.fast
        return comm.reduce(updates, fast_axis, reduction="mean", caller=_CALLER), state.fast

    def update_fn(updates, state, params=None, **extra_args):
        comm.require_axis(slow_axis, _CALLER)
        comm.require_axis(fast_axis, _CALLER)
        reduced, fast_state = fast_stage(updates, state, params, extra_args)
        if not sharded:
            _require_invariant(
                reduced,
                fast_axis,
                f"`hierarchical`: the fast stage must leave the updates the same on every worker of "
                f"the {fast_axis!r} axis (e.g. all_reduce(axis_name={fast_axis!r})), or pass sharded=True "
                "for parameters sharded over it.",
            )
        out, slow_state = slow_tx.update(reduced, state.slow, params, **extra_args)
        for axis in (slow_axis,) if sharded else (slow_axis, fast_axis):
            _require_invariant(
                out,
                axis,
                f"`hierarchical`: the output must be the same on every worker of {axis!r}; the slow "
                f"stage must aggregate over {slow_axis!r} (e.g. powersgd(axis_name={slow_axis!r})).",
            )
        return out, HierarchicalState(fast=fast_state, slow=slow_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
