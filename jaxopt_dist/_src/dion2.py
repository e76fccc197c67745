"""Dion2: orthonormal updates of a selected fraction of each matrix's rows, work split over workers.

Dion2 (Ahn et al., ``microsoft/dion``'s ``dion2.py``) keeps an undecayed
momentum per matrix, picks the ``k = ceil(fraction * s)`` slices along the
matrix's shorter side ``s`` with the largest L1 norm, decays only those
(error feedback) and orthogonalises only them. Distributed as
:func:`jaxopt_dist.muon` is: matrices of one shape are stacked and the first
``W floor(c / W)`` of a stack of ``c`` are split into ``W`` shares (nothing
is padded); one reduce-scatter brings each owner the mean gradient of its
share; the owner updates the momentum it alone keeps, selects, decays and
orthogonalises; one all-gather returns the orthogonalised slices and their
indices (``fraction`` of the matrices' entries) to every worker. The
``c mod W`` matrices left over travel whole with the non-matrix leaves
(a ``1 / W`` chunk each way), and every worker updates them itself. With
``axis_name=None``: one worker, no communication (the numbers of ``W = 1``),
e.g. as :func:`jaxopt_dist.diloco`'s inner optimizer.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import orthonormal as ortho

ADJUST_LR = ("spectral_norm", "rms_norm", None)


def selected_count(fan_in: int, fan_out: int, fraction: float) -> int:
    """``k = ceil(fraction * s)`` (at least 1) for the shorter side ``s`` of a ``(fan_in, fan_out)`` matrix."""
    return max(1, math.ceil(fraction * min(fan_in, fan_out)))


def selects_outputs(fan_in: int, fan_out: int) -> bool:
    """Whether the slices are the output features (the reference's rows of ``(d_out, d_in)``).

    They are when ``fan_out <= fan_in`` (a square matrix included), else the
    input features: the shorter side, as the reference on unsharded matrices.
    """
    return fan_out <= fan_in


def _contract(spec: str, pick: jax.Array, x: jax.Array) -> jax.Array:
    """``einsum`` with a 0/1 selection matrix, at full precision: exact (each output is one input).

    Used instead of a gather and a scatter, which XLA's SPMD partitioner cannot
    always split when the matrices are sharded over model axes.
    """
    return jnp.einsum(spec, pick, x, precision=jax.lax.Precision.HIGHEST)


def _lr_scale(fan_in: int, fan_out: int, adjust_lr: str | None) -> float:
    if adjust_lr == "spectral_norm":
        return math.sqrt(fan_out / fan_in)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return 1.0


def _oriented(g: ortho.Group) -> tuple[int, int]:
    """The shape of a group's matrices with the selectable slices first."""
    return (g.fan_out, g.fan_in) if selects_outputs(g.fan_in, g.fan_out) else (g.fan_in, g.fan_out)


def _orient(x: jax.Array, g: ortho.Group) -> jax.Array:
    """``(b, fan_in, fan_out)`` -> ``(b, s_side, other)``: the selectable slices along axis 1."""
    return jnp.swapaxes(x, 1, 2) if selects_outputs(g.fan_in, g.fan_out) else x


@base.reshard_rules()
class Dion2State(NamedTuple):
    """State for :func:`jaxopt_dist.dion2` (its first element; the second is the scalar optimizer's).

    Matrices are grouped by ``(fan_in, fan_out, dtype)`` in order of first
    appearance in ``jax.tree.leaves``; worker ``j`` owns the slots
    ``[j s_g, (j + 1) s_g)`` of group ``g``'s stack, ``s_g = c_g // W``
    (possibly 0), and the last ``r_g = c_g mod W`` matrices are updated by
    every worker.

    Attributes:
      count: int32[], steps taken; replicated.
      momentum: per group with ``s_g > 0``, ``(s_g, a, b)``: the momentum of the matrices this
        worker owns, oriented with the selectable side first (``a = fan_out,
        b = fan_in`` when ``fan_out <= fan_in``, i.e. the reference's
        ``(d_out, d_in)`` layout; else ``(fan_in, fan_out)``); per-worker,
        ``1 / W`` of the momentum (all of it with ``axis_name=None``). Not
        regroupable for another number of workers:
        :func:`jaxopt_dist.reshard_opt_state` refuses it (no reshard rule),
        since the workers' rows are the momenta of *different matrices*,
        not copies to average, and the shard sizes ``c_g // W`` change with
        ``W``. To resume on another number of workers, build
        :func:`jaxopt_dist.dion2` with the new ``num_workers`` and start the
        momentum afresh (``tx.init``); ``momentum.reshape(W * s_g, a, b)``
        followed by ``momentum_rest`` is group ``g``'s whole momentum, to
        redistribute by hand if it matters.
      momentum_rest: per group with ``r_g > 0``, ``(r_g, a, b)``: the
        momentum of the group's last ``r_g = c_g mod W`` matrices, oriented
        as ``momentum``, which every worker updates from their mean
        gradient; replicated (an empty tuple with ``axis_name=None``).
        Groups with no matrix in a field are left out of it (orbax cannot
        checkpoint zero-size arrays).

    ``RESHARD_NOTE`` (a class attribute, not a field) says so, for
    :func:`jaxopt_dist.reshard_opt_state`'s refusal. ``MATRIX_STACKS`` (a
    class attribute too) names the stacked fields, which a sharded model's
    front ends split over its model axes (on the rows, else the columns).
    """

    RESHARD_NOTE = ortho.RESHARD_NOTE
    MATRIX_STACKS = ("momentum", "momentum_rest")

    count: jax.Array  # int32[], replicated
    momentum: tuple[jax.Array, ...]  # (c_g // W, a, b) per group where > 0, per-worker
    momentum_rest: tuple[jax.Array, ...]  # (c_g % W, a, b) per group where > 0, replicated


def _scale_by_dion2(
    learning_rate: optax.ScalarOrSchedule,
    fraction: float,
    ef_decay: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule,
    eps: optax.ScalarOrSchedule,
    coeffs: tuple[tuple[float, float, float], ...],
    preconditioning: str,
    adjust_lr: str | None,
    weight_dimension_numbers: Any,
    num_workers: int,
    axis_name: base.AxisName | None,
    invariant_updates: str,
) -> optax.GradientTransformationExtraArgs:
    """Dion2's matrix updates (final, with the learning rate), the mean gradient for other leaves."""
    caller = "dion2"
    use_wd = not base.is_constant(weight_decay, 0.0)

    arg = "weight_dimension_numbers"

    def init_fn(params):
        plan = ortho.make_plan(params, weight_dimension_numbers, num_workers, caller=caller, arg=arg)
        momentum = tuple(jnp.zeros((g.share, *_oriented(g)), g.dtype) for g in plan.groups if g.share)
        rest = tuple(jnp.zeros((g.rest, *_oriented(g)), g.dtype) for g in plan.groups if g.rest)
        return Dion2State(count=jnp.zeros([], jnp.int32), momentum=momentum, momentum_rest=rest)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n = ortho.workers(num_workers, axis_name, caller)
        ortho.check_replicated_params(params, axis_name, caller, "Dion2")
        if use_wd and params is None:
            raise ValueError(base.no_params_message(caller, "with weight_decay"))
        if not jax.tree.leaves(updates):
            return updates, state
        owned = ortho.owned_means(
            updates, weight_dimension_numbers, n, axis_name, invariant_updates, caller, arg
        )
        groups = owned.plan.groups
        count = state.count
        decay = base.resolve(ef_decay, count)
        eps_t = base.resolve(eps, count)

        def update_stack(
            g: ortho.Group, mean: jax.Array, m_old: jax.Array
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            grad = _orient(mean, g)  # the mean gradient of a stack of the group's matrices
            m = m_old + grad.astype(m_old.dtype)
            k = selected_count(g.fan_in, g.fan_out, fraction)
            norms = jnp.sum(jnp.abs(m), axis=2)  # L1 norm of each slice
            _, idx = jax.lax.top_k(norms, k)  # (s, k)
            pick = jax.nn.one_hot(idx, m.shape[1], dtype=m.dtype)  # (s, k, a): exact 0/1 selection
            sel = _contract("ska,sab->skb", pick, m)  # the selected slices, (s, k, b)
            chosen = jnp.sum(pick, axis=1)[:, :, None] > 0  # (s, a, 1)
            m = jnp.where(chosen, m * jnp.asarray(decay, m.dtype), m)
            o = ortho.newton_schulz(sel, coeffs, eps=eps_t, preconditioning=preconditioning)
            return o, idx.astype(jnp.int32), m

        shares, rests = [g.share for g in groups], [g.rest for g in groups]
        empty = lambda k: jnp.zeros((0, *_oriented(groups[k])), groups[k].dtype)  # noqa: E731
        m_olds = ortho.per_group(state.momentum, shares, empty)
        rest_olds = ortho.per_group(state.momentum_rest, rests, empty)
        new_m, slices, indices = [], [], []
        for g, share, m_old in zip(groups, owned.shares, m_olds):  # this worker's share
            o, idx, m = update_stack(g, share, m_old)
            slices.append(o)
            indices.append(idx)
            new_m.append(m)
        gathered, out, rest_grads = ortho.gather_results(owned, slices + indices, axis_name, caller=caller)

        lr = base.resolve(learning_rate, count)
        wd = base.resolve(weight_decay, count) if use_wd else None
        p_leaves = owned.treedef.flatten_up_to(params) if use_wd else []
        ng = len(groups)
        new_rest = []
        for j, g in enumerate(groups):
            # The remainder: every worker updates it from the mean it received (replicated).
            o_rest, idx_rest, m_rest = update_stack(g, rest_grads[j], rest_olds[j])
            new_rest.append(m_rest)
            k = selected_count(g.fan_in, g.fan_out, fraction)
            o = jnp.concatenate([gathered[j].reshape(n * g.share, k, o_rest.shape[2]), o_rest])
            idx = jnp.concatenate([gathered[ng + j].reshape(n * g.share, k), idx_rest])
            step = -lr * _lr_scale(g.fan_in, g.fan_out, adjust_lr)
            pick = jax.nn.one_hot(idx, _oriented(g)[0], dtype=o.dtype)  # (count, k, a)
            full = _contract("ska,skb->sab", pick, step * o)  # the slices back in place, zeros elsewhere
            if selects_outputs(g.fan_in, g.fan_out):
                full = jnp.swapaxes(full, 1, 2)
            for i, x in ortho.unstack_group(full, owned.plan.views, g).items():
                if use_wd:
                    x = x - lr * wd * p_leaves[i].astype(x.dtype)
                out[i] = x.astype(owned.leaves[i].dtype)
        new_state = Dion2State(
            count=optax.safe_increment(count),
            momentum=ortho.kept(new_m, shares),
            momentum_rest=ortho.kept(new_rest, rests),
        )
        return jax.tree.unflatten(owned.treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dion2(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    fraction: float = 0.25,
    ef_decay: optax.ScalarOrSchedule = 0.95,
    weight_decay: optax.ScalarOrSchedule = 0.01,
    eps: optax.ScalarOrSchedule = 1e-8,
    num_workers: int | None = None,
    ns_coeffs: Any = ortho.STANDARD_NS_COEFFS,
    ns_steps: int = 5,
    preconditioning: str = "frobenius",
    adjust_lr: str | None = "spectral_norm",
    scalar_optimizer: optax.GradientTransformation | None = None,
    weight_dimension_numbers: Any = None,
    axis_name: base.AxisName | None = base.DEFAULT_AXIS_NAME,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""Dion2 on the mean gradient: orthonormal updates of the top ``fraction`` of slices, split over workers.

    Takes each worker's own gradients and returns the final updates,
    bit-identical on every worker. Per matrix (2-D leaves, Flax layout
    ``(fan_in, fan_out)``, the transpose of the reference's ``(d_out,
    d_in)``), with :math:`\bar G` the mean gradient over ``axis_name``:

    .. math::
      M \leftarrow M + \bar G, \quad
      S = \text{the } k \text{ slices of } M \text{ with the largest } \ell_1 \text{ norm}, \quad
      M_S \leftarrow \mu M_S, \\
      X \leftarrow (1 - \eta \lambda) X, \quad
      X_S \leftarrow X_S - \eta \sqrt{d_{out} / d_{in}}\, \mathrm{NS}(M_S^{\text{before decay}}),

    where the slices are the output features (the reference's rows) when
    ``fan_out <= fan_in`` and the input features otherwise (the shorter
    side), ``k = ceil(fraction * min(fan_in, fan_out))``, ``\mu =
    ef_decay``, ``\lambda = weight_decay`` and ``NS`` the Newton-Schulz
    orthogonalisation (:func:`jaxopt_dist._src.orthonormal.newton_schulz`,
    in the gradient's dtype; the reference runs Polar Express in bfloat16,
    here optax's quintic coefficients by default). The mean gradient reaches
    the owner of each matrix, so the selection is the exact whole-matrix
    top-k (the reference's ``selection_scope="global"``), whatever the
    number of workers. With ``fraction=1`` every slice is selected and the
    momentum is Muon's: :math:`B_t = \mu B_{t-1} + \bar G_t`, the update
    ``NS(B_t)``.

    Every other leaf (biases, norms, scalars) goes to ``scalar_optimizer``
    on the mean gradient: by default
    ``optax.adamw(learning_rate, b1=0.9, b2=0.95, eps=eps,
    weight_decay=weight_decay)``, the reference's AdamW.

    The outputs are replicated, so the parameters must be too (the default
    of :func:`jaxopt_dist.data_parallel_step`): ``update`` raises
    ``ValueError`` when ``params`` are typed per-worker over ``axis_name``
    under ``shard_map(check_vma=True)`` (``per_worker_params=True``), where
    the workers' differences would never be reconciled; under ``vmap``
    nothing is typed and this cannot be checked. For per-worker parameters,
    e.g. as :func:`jaxopt_dist.diloco`'s inner optimizer, use
    ``axis_name=None``: one worker's Dion2, no communication.

    Args:
      learning_rate: :math:`\eta`, a float or a schedule (reference default 0.01).
      fraction: the fraction of slices orthogonalised, in ``(0, 1]`` (a
        Python float: it sets ``k``).
      ef_decay: :math:`\mu`, the decay of the selected slices; float or schedule.
      weight_decay: :math:`\lambda` (decoupled, times the learning rate);
        needs ``params`` when nonzero.
      eps: Newton-Schulz's normalisation epsilon (and the default AdamW's).
      num_workers: ``W``, the size of ``axis_name`` (required with an axis:
        the state keeps ``1 / W`` of the momentum; None or 1 with
        ``axis_name=None``). Under :func:`optax.inject_hyperparams` list
        ``num_workers``, ``fraction`` and ``ns_steps`` in ``static_args``.
      ns_coeffs: Newton-Schulz coefficients or a preset (``"standard"``,
        ``"dion"``), as ``optax.contrib.muon``.
      ns_steps: Newton-Schulz steps.
      preconditioning: as ``optax.contrib.muon``.
      adjust_lr: ``"spectral_norm"`` (``sqrt(fan_out / fan_in)``),
        ``"rms_norm"`` (``0.2 sqrt(max(fan_in, fan_out))``) or None.
      scalar_optimizer: the optimizer of the non-matrix leaves (applied to
        their mean gradient); None for the AdamW above.
      weight_dimension_numbers: which leaves are matrices and how they are
        viewed, as ``optax.contrib.muon``'s ``muon_weight_dimension_numbers``
        (None: the 2-D leaves).
      axis_name: the data axis. None: one worker, no communication (e.g. as
        DiLoCo's inner optimizer); the numbers of ``W = 1``.
      invariant_updates: what an update typed invariant under
        ``shard_map(check_vma=True)`` stands for (``"sum"``, ``"mean"``,
        ``"error"``); Dion2 depends on the mean only.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`; its state is
      ``(Dion2State, optax.PartitionState)``.

    Communication:
      Per dtype ONE reduce-scatter of the gradients: row ``j`` holds the
      matrices worker ``j`` owns (``s_g = c_g // W`` per group, no
      padding) and a ``1 / W`` chunk of the non-matrix leaves and of each
      group's ``r_g = c_g mod W`` remainder matrices. Then ONE all-gather
      (all dtypes together, bitcast) of each owner's orthogonalised slices
      (``s_g k_g b_g`` entries per group, about ``fraction`` of the owned
      matrices), their int32 indices (``s_g k_g``) and the chunk of the
      non-matrix leaves' and remainders' mean. Per worker that is
      ``(W - 1) / W`` of the gradient's bytes for the reduce-scatter and,
      for the all-gather, about ``fraction`` of the owned matrices' share
      plus all of the rest; every worker then updates the remainder
      matrices itself. Outputs are replicated; ``count``,
      ``momentum_rest`` and the scalar optimizer's state are replicated;
      ``momentum`` is per-worker, ``1 / W`` of the owned matrices'
      momentum. None with ``axis_name=None`` (no remainder; outputs and
      state as the inputs: per-worker for per-worker parameters).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> tx = jd.dion2(0.01, num_workers=2)
      >>> grads = {"w": jnp.ones((2, 8, 4)), "b": jnp.ones((2, 4))}  # 2 workers
      >>> step = lambda g: tx.update(g, tx.init(g), g)[0]
      >>> out = jax.vmap(step, axis_name="data")(grads)
      >>> out["w"].shape
      (2, 8, 4)

      Local, inside DiLoCo with MuLoCo's quantized outer exchange (per-worker
      parameters, ``jd.data_parallel_step(..., per_worker_params=True)``):

      >>> tx = jd.diloco(
      ...     jd.dion2(0.01, axis_name=None), sync_every=4, aggregate=jd.statistical_quantize(2)
      ... )

    References:
      Ahn et al, `Dion2 <https://arxiv.org/abs/2512.16928>`_, 2025;
      ``microsoft/dion``, ``dion/dion2.py``
    """
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)
    fraction = base.check_fraction(fraction, "fraction")
    base.check_hyperparameter(ef_decay, "ef_decay", lower=0.0, upper=1.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    base.check_hyperparameter(eps, "eps", lower=0.0)
    axis_name = base.validate_axis_name(axis_name, allow_none=True)
    num_workers = ortho.resolve_num_workers(num_workers, axis_name, "dion2")
    ns_steps = base.check_positive_int(ns_steps, "ns_steps")
    coeffs = ortho.resolve_ns_coeffs(ns_coeffs, ns_steps, caller="dion2")
    if preconditioning not in ortho.PRECONDITIONINGS:
        raise ValueError(
            f"`preconditioning` must be one of {ortho.PRECONDITIONINGS}; got {preconditioning!r}."
        )
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"`adjust_lr` must be one of {ADJUST_LR}; got {adjust_lr!r}.")
    if scalar_optimizer is not None and not isinstance(scalar_optimizer, optax.GradientTransformation):
        raise TypeError(
            f"`scalar_optimizer` must be an optax.GradientTransformation or None; got {scalar_optimizer!r}."
        )
    invariant_updates = comm.check_invariant_mode(invariant_updates)
    if scalar_optimizer is None:
        scalar_optimizer = optax.adamw(
            learning_rate, b1=0.9, b2=0.95, eps=1e-8 if callable(eps) else eps, weight_decay=weight_decay
        )
    core = _scale_by_dion2(
        learning_rate,
        fraction,
        ef_decay,
        weight_decay,
        eps,
        coeffs,
        preconditioning,
        adjust_lr,
        weight_dimension_numbers,
        num_workers,
        axis_name,
        invariant_updates,
    )

    def labels(params):
        return ortho.labels(
            weight_dimension_numbers, params, "matrix", "scalar", arg="weight_dimension_numbers"
        )

    tail = optax.partition({"matrix": optax.identity(), "scalar": scalar_optimizer}, labels)
    return optax.chain(core, optax.with_extra_args_support(tail))
