"""Distributed Muon: ``optax.contrib.muon`` on the mean gradient, its work split over the workers.

Muon (Jordan 2024) orthogonalises the momentum of each matrix parameter by
Newton-Schulz. Run data-parallel as usual, every worker would average the
gradients (an all-reduce), keep the whole momentum and orthogonalise every
matrix: the same work ``W`` times over. Here (as in the Dion reference's
distributed Muon) matrices of the same shape are stacked, the first
``W floor(c / W)`` of a stack of ``c`` are split into ``W`` equal shares,
and each worker owns one share; the remaining ``c mod W`` matrices are
owned by no one (nothing is padded):

1. one **reduce-scatter** sums the gradients, each worker receiving only the
   sum of its own share (and a ``1 / W`` chunk of the non-matrix leaves and
   of the remainder matrices);
2. the owner updates the momentum of its share (it keeps no other) and
   orthogonalises it;
3. one **all-gather** returns the orthogonalised matrices (and the mean of
   the non-matrix leaves and of the remainder matrices) to every worker;
4. every worker updates the momentum of the remainder matrices (replicated:
   the same on every worker) and orthogonalises them itself.

A reduce-scatter plus an all-gather is how a ring all-reduce moves its bytes,
so the step costs the bytes of the all-reduce it replaces, while the momentum
memory and the Newton-Schulz work per worker fall by about ``W`` (exactly
``W`` when each shape's count is a multiple of ``W``).

With ``axis_name=None`` there is one worker and no communication: the
numbers of ``W = 1``, ``optax.contrib.muon`` itself, e.g. as the inner
optimizer of :func:`jaxopt_dist.diloco` (MuLoCo) on per-worker parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxopt_dist._src import base, comm
from jaxopt_dist._src import orthonormal as ortho


def _shape_scale(fan_in: int, fan_out: int, consistent_rms: Any) -> Any:
    """``optax.contrib.muon``'s width scaling of an update."""
    if consistent_rms is not None:
        return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms
    return jnp.sqrt(jnp.maximum(1, fan_out / fan_in))


@base.reshard_rules()
class ScaleByMuonState(NamedTuple):
    """State for :func:`jaxopt_dist.scale_by_muon`.

    Matrices are grouped by ``(fan_in, fan_out, dtype)`` in order of first
    appearance in ``jax.tree.leaves``; group ``g`` holds ``c_g`` matrices,
    worker ``j`` owns the slots ``[j s_g, (j + 1) s_g)`` of its stack,
    ``s_g = c_g // W`` (possibly 0), and the last ``r_g = c_g mod W``
    matrices are updated by every worker.

    Attributes:
      count: int32[], steps taken; replicated.
      mu: per group with ``s_g > 0``, ``(s_g, fan_in, fan_out)``: the momentum of the matrices
        this worker owns, and only those; per-worker (``W = 1`` with
        ``axis_name=None``: all of them). A state of ``W`` workers cannot be
        regrouped for another number of workers:
        :func:`jaxopt_dist.reshard_opt_state` refuses ``mu`` (no reshard
        rule), since worker ``j``'s rows are the momentum of *other
        matrices* than worker ``i``'s, not a copy to average, and the shard
        sizes ``c_g // W`` change with ``W``. To resume on another number
        of workers, build the optimizer with the new ``num_workers`` and
        start its momentum afresh (``tx.init``); the rows stacked over the
        old workers, ``mu.reshape(W * s_g, fan_in, fan_out)``, followed by
        ``mu_rest``, are the whole momentum of group ``g``, to redistribute
        by hand if it matters.
      mu_rest: per group with ``r_g > 0``, ``(r_g, fan_in, fan_out)``: the
        momentum of the group's last ``r_g = c_g mod W`` matrices, which
        every worker updates from their mean gradient; replicated (an empty
        tuple with ``axis_name=None``). Groups with no matrix in a field are
        left out of it (orbax cannot checkpoint zero-size arrays).

    ``RESHARD_NOTE`` (a class attribute, not a field) says so, for
    :func:`jaxopt_dist.reshard_opt_state`'s refusal. ``MATRIX_STACKS`` (a
    class attribute too) names the stacked fields, which a sharded model's
    front ends split over its model axes (on the rows, else the columns).
    """

    RESHARD_NOTE = ortho.RESHARD_NOTE
    MATRIX_STACKS = ("mu", "mu_rest")

    count: jax.Array  # int32[], replicated
    mu: tuple[jax.Array, ...]  # (c_g // W, fan_in, fan_out) per group where > 0, per-worker
    mu_rest: tuple[jax.Array, ...]  # (c_g % W, fan_in, fan_out) per group where > 0, replicated


def scale_by_muon(
    ns_coeffs: Any = ortho.STANDARD_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    *,
    num_workers: int | None = None,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
    axis_name: base.AxisName | None = base.DEFAULT_AXIS_NAME,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""Muon's orthogonalised momentum of the mean gradient, the work split over the workers.

    For each matrix leaf (see ``weight_dimension_numbers``) the output is
    what ``optax.contrib.scale_by_muon`` followed by its width scaling
    (``optax.contrib.muon``'s ``scale_by_shape``) gives on the mean gradient
    :math:`\bar g`:

    .. math::
      m \leftarrow \beta m + (1 - \beta) \bar g, \quad
      \hat m = \beta \frac{m}{1 - \beta^{t+1}} + (1 - \beta) \frac{\bar g}{1 - \beta^t}
      \ (\text{Nesterov; else } m / (1 - \beta^t)), \quad
      u = s \cdot \mathrm{NS}(\hat m),

    with ``NS`` the Newton-Schulz iteration (:func:`newton_schulz`, in
    :math:`\hat m`'s dtype), ``s = sqrt(max(1, fan_out / fan_in))`` (or
    ``sqrt(max(fan_in, fan_out)) * consistent_rms``) and, with
    ``adaptive=True``, ``NS`` scaled by :math:`\langle \hat m, NS \rangle`
    over the leaf. Every other leaf comes out as the mean gradient (to feed
    the Adam branch of :func:`muon`).

    The outputs are replicated, so the parameters must be too: ``update``
    raises ``ValueError`` when ``params`` are typed per-worker over
    ``axis_name`` under ``shard_map(check_vma=True)`` (e.g.
    ``data_parallel_step(..., per_worker_params=True)``), where the workers'
    differences would never be reconciled. Under ``vmap`` nothing is typed
    and this cannot be checked. For per-worker parameters (DiLoCo's inner
    optimizer) use ``axis_name=None``: one worker, no communication.

    Args:
      ns_coeffs: Newton-Schulz coefficients: a triple used every step, a
        table of triples (one row per step), or a preset (``"standard"``,
        ``"dion"``), as ``optax.contrib.muon``. Python numbers.
      ns_steps: Newton-Schulz steps (Python int).
      beta: the momentum decay (a float, as optax's).
      eps: added to the norm before Newton-Schulz.
      mu_dtype: the momentum's dtype (None: the parameters').
      num_workers: ``W``, the size of ``axis_name`` (required with an axis:
        ``init`` sizes the per-worker shards); ``update`` checks it. None or
        1 with ``axis_name=None``.
      nesterov: Nesterov momentum (optax's default).
      adaptive: scale by the dual norm (optax's ``adaptive``).
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or
        ``"schatten"``, as optax.
      weight_dimension_numbers: as ``optax.contrib.muon``'s
        ``muon_weight_dimension_numbers``: None (2-D leaves are matrices
        ``(fan_in, fan_out)``), or a tree (prefix) of
        ``optax.contrib.MuonDimensionNumbers``/None, or a callable giving
        one from the updates. Batch axes make matrices of their own.
      consistent_rms: optax's consistent-RMS scaling (None: width scaling).
      axis_name: the data axis. None: one worker, no communication (e.g. as
        DiLoCo's inner optimizer on per-worker parameters); the numbers of
        ``W = 1``.
      invariant_updates: what an update typed invariant under
        ``shard_map(check_vma=True)`` stands for (``"sum"``, ``"mean"``,
        ``"error"``); the output depends on the mean only.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`.

    Communication:
      With ``W`` workers, per dtype: ONE reduce-scatter of a buffer of
      ``W x L`` elements, row ``j`` holding the matrices worker ``j`` owns
      (``sum_g s_g fan_in fan_out``, ``s_g = c_g // W``) and a ``1 / W``
      chunk of the non-matrix leaves and of each group's ``r_g = c_g mod
      W`` remainder matrices (that chunk zero-padded to a multiple of
      ``W``); then ONE all-gather (of all dtypes at once, bitcast) of each
      worker's ``L`` results (plus ``s_g`` dot products per group with
      ``adaptive``). Each worker sends ``(W - 1) L w`` bytes in each: the
      bytes of a ring all-reduce of the gradients, no matrix padding.
      Every worker then updates and orthogonalises the remainder matrices
      itself. Outputs are replicated; ``count`` is replicated; ``mu`` is
      per-worker, ``1 / W`` of the owned matrices' momentum (``s_g``
      matrices per group); ``mu_rest`` is replicated (``r_g`` matrices per
      group). None with ``axis_name=None`` (no remainder).
    """
    caller = "scale_by_muon"
    axis_name = base.validate_axis_name(axis_name, allow_none=True)
    num_workers = ortho.resolve_num_workers(num_workers, axis_name, caller)
    ns_steps = base.check_positive_int(ns_steps, "ns_steps")
    coeffs = ortho.resolve_ns_coeffs(ns_coeffs, ns_steps, caller=caller)
    if not base.is_python_number(beta) or not 0.0 <= float(beta) < 1.0:
        raise ValueError(f"`beta` must be a Python float in [0, 1); got {beta!r}.")
    base.check_hyperparameter(eps, "eps", lower=0.0)
    base.check_bool(nesterov, "nesterov")
    base.check_bool(adaptive, "adaptive")
    if preconditioning not in ortho.PRECONDITIONINGS:
        raise ValueError(
            f"`preconditioning` must be one of {ortho.PRECONDITIONINGS}; got {preconditioning!r}."
        )
    if consistent_rms is not None:
        base.check_hyperparameter(consistent_rms, "consistent_rms", lower=0.0)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    invariant_updates = comm.check_invariant_mode(invariant_updates)
    n_cfg = num_workers
    arg = "weight_dimension_numbers"

    def init_fn(params):
        plan = ortho.make_plan(params, weight_dimension_numbers, n_cfg, caller=caller, arg=arg)
        return ScaleByMuonState(
            count=jnp.zeros([], jnp.int32),
            mu=ortho.shard_init(plan.groups, lambda g: mu_dtype or g.dtype),
            mu_rest=ortho.rest_init(plan.groups, lambda g: mu_dtype or g.dtype),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n = ortho.workers(n_cfg, axis_name, caller)
        ortho.check_replicated_params(params, axis_name, caller, "Muon")
        if not jax.tree.leaves(updates):
            return updates, state
        owned = ortho.owned_means(
            updates, weight_dimension_numbers, n, axis_name, invariant_updates, caller, arg
        )
        count_inc = optax.safe_increment(state.count)

        def update_stack(grad: jax.Array, mu_old: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            # optax's own momentum maths (scale_by_muon), on a stack of matrices.
            mu: jax.Array = cast(jax.Array, optax.tree.update_moment(grad, mu_old, beta, 1))
            if nesterov:
                ahead = optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc))
                now = optax.tree.bias_correction(grad, beta, count_inc)
                mu_hat = beta * cast(jax.Array, ahead) + (1 - beta) * cast(jax.Array, now)
            else:
                mu_hat = cast(jax.Array, optax.tree.bias_correction(mu, beta, count_inc))
            o = ortho.newton_schulz(mu_hat, coeffs, eps=eps, preconditioning=preconditioning)
            mu = mu.astype(mu_dtype) if mu_dtype is not None else mu
            return o, jnp.sum(mu_hat * o, axis=(1, 2)), mu.astype(mu_old.dtype)

        groups = owned.plan.groups
        shares, rests = [g.share for g in groups], [g.rest for g in groups]
        dtype = lambda k: mu_dtype or groups[k].dtype  # noqa: E731
        empty = lambda k: jnp.zeros((0, groups[k].fan_in, groups[k].fan_out), dtype(k))  # noqa: E731
        mu_olds = ortho.per_group(state.mu, shares, empty)
        rest_olds = ortho.per_group(state.mu_rest, rests, empty)
        new_mu, outs, dots = [], [], []
        for grad, mu_old in zip(owned.shares, mu_olds):  # this worker's share of the matrices
            o, d, mu = update_stack(grad, mu_old)
            outs.append(o)
            if adaptive:
                dots.append(d)
            new_mu.append(mu)
        gathered, out, rest_grads = ortho.gather_results(owned, outs + dots, axis_name, caller=caller)

        new_rest = []
        for k, g in enumerate(groups):
            # The remainder: every worker updates it from the mean it received (replicated).
            o_rest, d_rest, mu_rest = update_stack(rest_grads[k], rest_olds[k])
            new_rest.append(mu_rest)
            full = jnp.concatenate([gathered[k].reshape(n * g.share, g.fan_in, g.fan_out), o_rest])
            if adaptive:
                d = jnp.concatenate([gathered[len(groups) + k].reshape(n * g.share), d_rest])
                offset = 0
                for _, b in g.members:
                    # optax sums the dual pairing over the whole leaf (its batch axes too).
                    total = jnp.sum(d[offset : offset + b])
                    full = full.at[offset : offset + b].set(total * full[offset : offset + b])
                    offset += b
            scale = _shape_scale(g.fan_in, g.fan_out, consistent_rms)
            for i, x in ortho.unstack_group(full, owned.plan.views, g).items():
                out[i] = scale * x
        new_state = ScaleByMuonState(
            count=count_inc, mu=ortho.kept(new_mu, shares), mu_rest=ortho.kept(new_rest, rests)
        )
        return jax.tree.unflatten(owned.treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = ortho.STANDARD_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    num_workers: int | None = None,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: optax.ScalarOrSchedule = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
    axis_name: base.AxisName | None = base.DEFAULT_AXIS_NAME,
    invariant_updates: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    r"""Distributed Muon: ``optax.contrib.muon`` on the mean gradient, each worker owning ``1 / W``.

    Takes each worker's own gradients and returns the final updates, the
    numbers of ``optax.contrib.muon`` (same arguments, same defaults) applied
    to the mean gradient over ``axis_name``, bit-identical on every worker:

    * matrix leaves (2-D by default, or as ``muon_weight_dimension_numbers``
      says): :func:`scale_by_muon` (momentum, Newton-Schulz, width
      scaling), then ``+ weight_decay * params`` (with
      ``weight_decay_mask``) and ``* -learning_rate``;
    * every other leaf: ``optax.adamw`` on the mean gradient with
      ``adam_learning_rate`` (default ``learning_rate``), ``adam_b1``,
      ``adam_b2``, ``eps``, ``adam_eps_root``, ``adam_weight_decay``,
      ``mu_dtype`` and ``nesterov``, as optax's.

    The matrices of one shape are stacked and split into ``W`` shares; a
    worker keeps the momentum of its share only and orthogonalises only it,
    plus the ``c mod W`` matrices left over, which every worker updates
    (see :func:`scale_by_muon` and the module docstring).

    The parameters must be replicated (the default of
    :func:`jaxopt_dist.data_parallel_step`). For per-worker parameters,
    e.g. as :func:`jaxopt_dist.diloco`'s inner optimizer (MuLoCo), use
    ``axis_name=None``: one worker's ``optax.contrib.muon``, no
    communication. A bound axis with parameters typed per-worker under
    ``shard_map(check_vma=True)`` raises ``ValueError`` (under ``vmap``
    it cannot be seen).

    Args:
      learning_rate: a float or an optax schedule.
      ns_coeffs: Newton-Schulz coefficients or a preset (``"standard"``,
        ``"dion"``).
      ns_steps: Newton-Schulz steps.
      beta: momentum decay (a float).
      eps: Newton-Schulz's normalisation epsilon and Adam's epsilon.
      weight_decay: decoupled weight decay of the matrices (times the
        learning rate); needs ``params``.
      weight_decay_mask: which matrix leaves decay (as optax's).
      mu_dtype: momentum dtype (Muon's and Adam's).
      num_workers: ``W``, the size of ``axis_name`` (required with an axis:
        the state keeps ``1 / W`` of the momentum; None or 1 with
        ``axis_name=None``). Under :func:`optax.inject_hyperparams` list
        ``num_workers``, ``beta`` and ``ns_steps`` in ``static_args``.
      nesterov: Nesterov momentum (Muon's and Adam's).
      adaptive: scale by the dual norm (optax's ``adaptive``).
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or
        ``"schatten"``.
      adam_b1: Adam's first-moment decay for the non-matrix leaves.
      adam_b2: Adam's second-moment decay.
      adam_eps_root: Adam's ``eps_root``.
      adam_weight_decay: AdamW's weight decay.
      adam_learning_rate: Adam's learning rate (None: ``learning_rate``).
      muon_weight_dimension_numbers: which leaves are matrices and how they
        are viewed (see :func:`scale_by_muon`); None marks an Adam leaf.
      consistent_rms: optax's consistent-RMS scaling (None: width scaling).
      axis_name: the data axis. None: one worker, no communication (e.g. as
        DiLoCo's inner optimizer): ``optax.contrib.muon``'s numbers.
      invariant_updates: see :func:`scale_by_muon`.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`; its state is
      ``(ScaleByMuonState, optax.PartitionState)``.

    Communication:
      One reduce-scatter and one all-gather per step (per dtype for the
      reduce-scatter), the bytes of one all-reduce of the gradients (no
      matrix padding: each shape's ``c_g mod W`` remainder matrices travel
      with the non-matrix leaves); see :func:`scale_by_muon`. The Adam
      branch runs on the replicated mean gradient without communicating.
      Outputs are replicated; the Muon momentum of the owned matrices
      (``ScaleByMuonState.mu``) is per-worker, ``c_g // W`` matrices of
      each group per worker; that of the remainders
      (``ScaleByMuonState.mu_rest``), the count and the Adam state are
      replicated. Newton-Schulz work per worker: ``c_g // W + c_g mod W``
      matrices of each group instead of ``c_g``. None with
      ``axis_name=None`` (outputs and state as the inputs: per-worker for
      per-worker parameters).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> tx = jd.muon(0.02, num_workers=2)
      >>> grads = {"w": jnp.ones((2, 4, 4)), "b": jnp.ones((2, 4))}  # 2 workers
      >>> step = lambda g: tx.update(g, tx.init(g), g)[0]
      >>> out = jax.vmap(step, axis_name="data")(grads)
      >>> out["w"].shape
      (2, 4, 4)

      Local, as MuLoCo's inner optimizer (per-worker parameters under
      ``jd.data_parallel_step(..., per_worker_params=True)``):

      >>> muloco = jd.diloco(
      ...     jd.muon(0.02, axis_name=None), sync_every=4, aggregate=jd.statistical_quantize(2)
      ... )

    References:
      Jordan, `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024

      Ahn et al, `Dion: Distributed Orthonormalized Updates
      <https://arxiv.org/abs/2504.05295>`_, 2025 (distributed Muon)
    """
    base.check_hyperparameter(learning_rate, "learning_rate", lower=0.0)
    base.check_hyperparameter(weight_decay, "weight_decay", lower=0.0)
    base.check_hyperparameter(adam_weight_decay, "adam_weight_decay", lower=0.0)
    base.check_hyperparameter(adam_b1, "adam_b1", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(adam_b2, "adam_b2", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(adam_eps_root, "adam_eps_root", lower=0.0)
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    base.check_hyperparameter(adam_learning_rate, "adam_learning_rate", lower=0.0)
    inner = scale_by_muon(
        ns_coeffs,
        ns_steps,
        beta,
        eps,
        mu_dtype,
        num_workers=num_workers,
        nesterov=nesterov,
        adaptive=adaptive,
        preconditioning=preconditioning,
        weight_dimension_numbers=muon_weight_dimension_numbers,
        consistent_rms=consistent_rms,
        axis_name=axis_name,
        invariant_updates=invariant_updates,
    )

    def labels(params):
        return ortho.labels(
            muon_weight_dimension_numbers, params, "muon", "adam", arg="muon_weight_dimension_numbers"
        )

    tail = optax.partition(
        {
            "muon": optax.chain(
                *(
                    ()
                    if base.is_constant(weight_decay, 0.0)
                    else (optax.add_decayed_weights(weight_decay, weight_decay_mask),)
                ),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(
                learning_rate=adam_learning_rate,
                b1=adam_b1,
                b2=adam_b2,
                eps=eps,
                eps_root=adam_eps_root,
                weight_decay=adam_weight_decay,
                mu_dtype=mu_dtype,
                nesterov=nesterov,
            ),
        },
        labels,
    )
    return optax.chain(inner, optax.with_extra_args_support(tail))
