r"""DimReduce: quasi-Newton steps in a PCA subspace with an Armijo line search.

MindSpore's DimReduce accelerates late training by taking second-order steps
inside a low-dimensional subspace of the parameter space, the span of the top
principal components of the parameter trajectory seen so far, while plain
momentum SGD keeps moving the part of the gradient that lies outside it:

1. project the gradient onto the ``k`` orthonormal rows of the basis ``B``:
   :math:`g_k = B g`;
2. update a ``k x k`` BFGS estimate :math:`H` of the inverse Hessian from the
   last accepted subspace step :math:`s` and :math:`y = g_k - g_k^{last}`
   (skipped unless :math:`y \cdot s > \epsilon`);
3. take the direction :math:`d_k = -H g_k`, back-projected :math:`d_n = B^T d_k`;
4. backtrack: accept the first :math:`\rho^i`, :math:`i < ` ``max_search_steps``,
   with :math:`L(p + \rho^i d_n) < L(p) + \sigma \rho^i g_k \cdot d_k`;
5. move the residual momentum :math:`m = \gamma m + g - B^T g_k` with step
   size :math:`\alpha`.

:func:`fit_subspace` builds the basis from parameter snapshots.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

_BASIS_DTYPE = np.float32
_ORTHONORMAL_ATOL = 1e-4


class DimReduceInfo(NamedTuple):
    r"""Diagnostics of the last :func:`jaxopt_dist.dim_reduce` step (all replicated).

    Attributes:
      loss: float32[], the loss at the parameters, averaged over workers.
      trial_loss: float32[], the worker-averaged loss at the last trial point
        (the accepted one when ``accepted``).
      decrease: float32[], :math:`g_k \cdot d_k`, the predicted directional
        derivative (negative when ``H`` is positive definite).
      step_size: float32[], the accepted :math:`\rho^i`, 0 when no trial passed.
      num_trials: int32[], loss evaluations spent by the line search.
      accepted: bool[], whether a trial passed the Armijo test.
      curvature_updated: bool[], whether a BFGS update was made and kept.
    """

    loss: jax.Array  # float32[], replicated
    trial_loss: jax.Array  # float32[], replicated
    decrease: jax.Array  # float32[], replicated
    step_size: jax.Array  # float32[], replicated
    num_trials: jax.Array  # int32[], replicated
    accepted: jax.Array  # bool[], replicated
    curvature_updated: jax.Array  # bool[], replicated


@base.reshard_rules()
class DimReduceState(NamedTuple):
    r"""State for :func:`jaxopt_dist.dim_reduce`.

    Attributes:
      count: int32[], steps taken; replicated.
      basis: float32[k, n_params], the orthonormal subspace basis (rows);
        replicated. It lives in the state, not in a closure, so it is data:
        placed, checkpointed and swappable like any other leaf.
      inv_hessian: float32[k, k], the BFGS inverse-Hessian estimate; replicated.
      grad_last: float32[k], the projected gradient of the last accepted step;
        replicated.
      step: float32[k], the last accepted subspace step :math:`\rho d_k`;
        replicated.
      momentum: the residual momentum outside the subspace, like params in
        their dtypes; replicated.
      info: a :class:`DimReduceInfo` about the last step.
    """

    count: jax.Array  # int32[], replicated
    basis: jax.Array  # float32[k, n_params], replicated
    inv_hessian: jax.Array  # float32[k, k], replicated
    grad_last: jax.Array  # float32[k], replicated
    step: jax.Array  # float32[k], replicated
    momentum: optax.Updates  # like params, replicated
    info: DimReduceInfo  # replicated diagnostics


def _flat_size(tree: Any) -> int:
    return sum(base.leaf_sizes(tree))


def _flatten(tree: Any, dtype: Any = jnp.float32) -> jax.Array:
    """Concatenates the raveled leaves (``jax.tree.leaves`` order, C order)."""
    leaves = jax.tree.leaves(tree)
    return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])


def _unflatten(vec: jax.Array, like: Any) -> Any:
    """Splits a flat vector into leaves shaped like ``like`` (:func:`base.unpack`: one kernel per size)."""
    leaves, treedef = jax.tree.flatten(like)
    return jax.tree.unflatten(treedef, base.unpack(vec, [np.shape(x) for x in leaves]))


def flatten_params(params: Any) -> np.ndarray:
    """The flat float32 vector of ``params`` in the layout :func:`dim_reduce` uses.

    Leaves are taken in ``jax.tree.leaves`` order, each raveled in C order.
    Column ``j`` of a basis refers to entry ``j`` of this vector.
    """
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("`params` has no leaves.")
    return np.concatenate([np.ravel(np.asarray(x, dtype=np.float64)) for x in leaves]).astype(_BASIS_DTYPE)


def _check_basis(basis: Any) -> np.ndarray:
    try:
        b = np.asarray(basis)
    except jax.errors.TracerArrayConversionError as e:
        raise TypeError(
            "`basis` must be a concrete array (it is copied to host memory when the "
            "transform is built); got a traced value. Build the transform outside jit."
        ) from e
    except Exception as e:  # pragma: no cover - exotic inputs
        raise TypeError(
            f"`basis` must be an array of shape (k, n_params); got {type(basis).__name__}."
        ) from e
    if b.ndim != 2:
        raise ValueError(
            f"`basis` must be a 2-D array of shape (k, n_params) with orthonormal rows; got shape {b.shape}."
        )
    if not np.issubdtype(b.dtype, np.floating):
        raise TypeError(f"`basis` must be a floating-point array; got dtype {b.dtype}.")
    k, n = b.shape
    if k < 1 or n < 1:
        raise ValueError(f"`basis` must have at least one row and one column; got shape {b.shape}.")
    if k > n:
        raise ValueError(
            f"`basis` has more rows ({k}) than columns ({n}); rows must be orthonormal, so k <= n_params."
        )
    if not np.all(np.isfinite(b)):
        raise ValueError("`basis` contains inf or nan.")
    b64 = b.astype(np.float64)
    gram = b64 @ b64.T
    err = float(np.max(np.abs(gram - np.eye(k))))
    if err > _ORTHONORMAL_ATOL:
        raise ValueError(
            f"`basis` rows must be orthonormal (B @ B.T == I); the largest deviation is "
            f"{err:.3g} > {_ORTHONORMAL_ATOL:g}. Build it with jaxopt_dist.fit_subspace, or "
            f"orthonormalise it (e.g. np.linalg.qr(B.T)[0].T)."
        )
    return np.array(b, dtype=_BASIS_DTYPE, copy=True)


def dim_reduce(
    basis: Any,
    *,
    rho: optax.ScalarOrSchedule = 0.55,
    gamma: optax.ScalarOrSchedule = 0.9,
    alpha: optax.ScalarOrSchedule = 0.001,
    sigma: optax.ScalarOrSchedule = 0.4,
    max_search_steps: int = 2,
    eps: optax.ScalarOrSchedule = 1e-20,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    shard_basis: bool = False,
    aggregate: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""MindSpore's DimReduce: BFGS in a PCA subspace with Armijo backtracking.

    A complete optimizer (its output is the step to add to the parameters):

    .. math::
      \bar g = \tfrac{1}{n}\textstyle\sum_i g_i, \quad g_k = B \bar g, \quad
      y = g_k - g_k^{last}, \quad
      H \leftarrow (I - \tfrac{y s^T}{y^T s})^T H (I - \tfrac{y s^T}{y^T s})
        + \tfrac{s s^T}{y^T s} \ \text{if } y^T s > \epsilon,

    .. math::
      d_k = -H g_k, \quad d_n = B^T d_k, \quad
      t = \rho^{i^*}, \ i^* = \min\{i < I : \bar L(p + \rho^i d_n)
        < \bar L(p) + \sigma \rho^i g_k^T d_k\}

    (:math:`t = 0` and :math:`H, g_k^{last}` restored when no trial passes;
    otherwise :math:`s \leftarrow t d_k`, :math:`g_k^{last} \leftarrow g_k`),

    .. math::
      m \leftarrow \gamma m + \bar g - B^T g_k, \qquad
      u = t\, d_n - \alpha m.

    :math:`\bar L` is the loss averaged over workers, so every worker takes
    the same step. Needs the extra args ``value`` (this worker's loss at
    ``params``) and ``value_fn`` (params -> this worker's loss on the same
    batch); :func:`jaxopt_dist.data_parallel_step` passes both. A trial costs
    one forward pass per worker; at most ``max_search_steps`` per step.

    The parameters are flattened in :func:`flatten_params` order (leaves in
    ``jax.tree.leaves`` order, each raveled), and ``basis`` has one row per
    subspace direction over that vector, as :func:`fit_subspace` returns.

    **Where the basis lives.** The factory copies ``basis`` to a host NumPy
    array (no device array is held by the closure) and ``init`` puts it in
    the state as a float32 ``(k, n_params)`` leaf, so it is placed,
    checkpointed and replaced like any other state (``state._replace(basis=...)``
    with the same shape swaps the subspace without recompiling). That is
    ``4 k n_params`` bytes per worker (e.g. 160 MB for k=40 and 1M parameters),
    plus the residual momentum (one copy of the parameters), on every worker
    in both modes below: ``init`` cannot know which worker it runs for, and the
    state placement of :func:`jaxopt_dist.init_opt_state` has no "split along
    an existing axis" kind. Do not ``jit`` ``init``: the basis would become a
    compile-time constant.

    * ``shard_basis=False`` (default): every worker projects with all ``k``
      rows; no communication beyond the means below.
    * ``shard_basis=True``: MindSpore's layout. Worker ``i`` projects onto its
      ``ceil(k/n)`` rows only (``k n_params / n`` multiply-adds instead of
      ``k n_params``); the projected pieces are gathered with one all-gather
      and the back-projections :math:`B^T g_k, B^T d_k` summed with one
      all-reduce of ``2 n_params`` floats. Results equal the replicated mode up
      to float32 summation order.

    Args:
      basis: float array ``(k, n_params)`` with orthonormal rows.
      rho: backtracking factor in ``(0, 1]``; trial steps are ``rho**i``.
      gamma: residual momentum in ``[0, 1)``.
      alpha: step size of the residual momentum, ``>= 0``.
      sigma: Armijo sufficient-decrease constant in ``(0, 1)``.
        All four, and ``eps``, are floats or optax schedules of the step count.
      max_search_steps: number of trial step sizes (Python int >= 1;
        MindSpore uses 2).
      eps: the BFGS update is skipped unless :math:`y^T s >` ``eps``.
      axis_name: the data axis (or tuple of axes).
      shard_basis: split the projection work by rows across workers (see above).
      aggregate: average the incoming gradients over ``axis_name`` first.
        Pass ``False`` only when the chain already produced the (replicated)
        mean, e.g. after a compressor.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`DimReduceState`; ``update`` needs ``params``, ``value`` and
      ``value_fn``.

    Communication:
      Per step: one all-reduce of the gradient (``n_params`` floats, omitted
      with ``aggregate=False``) together with this worker's loss, then one
      scalar all-reduce per line-search trial (1 to ``max_search_steps``).
      With ``shard_basis=True`` also one all-gather of ``ceil(k/n)`` floats per
      worker and one all-reduce of ``2 n_params`` floats. The output updates
      and every state field are replicated.

    Sharded parameters:
      Needs whole leaves: the gradient is flattened into one vector and
      projected on the ``(k, n_params)`` basis, which stays replicated over the
      model axes (every device keeps all of it; the residual momentum is
      sharded like the parameters); the compiler gathers and sums over the
      model axes, and the line search runs the sharded model. The collectives
      above run over the data axis, per replica; the output is that of
      replicated parameters, to float rounding.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxopt_dist as jd
      >>> basis = np.eye(3, dtype=np.float32)[:2]   # subspace: first two coords
      >>> tx = jd.dim_reduce(basis, alpha=0.1)
      >>> loss = lambda w: 0.5 * jnp.sum(w ** 2)
      >>> def step(w):
      ...     g = jax.grad(loss)(w)
      ...     u, _ = tx.update(g, tx.init(w), w, value=loss(w), value_fn=loss)
      ...     return w + u
      >>> w = jnp.ones((2, 3))                       # two workers, same params
      >>> jax.vmap(step, axis_name="data")(w)[0]
      Array([0. , 0. , 0.9], dtype=float32)

    .. warning::
      :math:`H` starts at the identity (as in MindSpore), so the first trials
      are :math:`-\rho^i g_k`. If the curvature of the loss along :math:`g_k`
      exceeds about :math:`2 (1 - \sigma) / \rho^{I-1}` (:math:`I` =
      ``max_search_steps``) every trial fails; then
      no step is accepted, :math:`s` stays zero and :math:`H` never learns, so
      only the residual momentum moves. Raise ``max_search_steps`` (or lower
      ``rho``) for sharply curved losses; ``info.accepted`` shows it.

    .. note::
      Departures from MindSpore's code, where it is visibly unintended: the
      trial losses are compared with the true worker mean of the loss
      (MindSpore floor-divides the summed loss by the number of workers), and
      the rows per worker are ``ceil(k / n)`` with zero padding (MindSpore's
      ``ceil(k // n)`` drops rows when ``n`` does not divide ``k``). The
      state's ``step`` starts at zero, which makes the first BFGS update a
      no-op exactly as MindSpore's "first step" flag does.

    References:
      MindSpore, `DimReduce <https://www.mindspore.cn/docs/en/master/api_python/mindspore.boost.html>`_
      (``mindspore.boost.DimReduce``), 2021; Li et al., `Low Dimensional
      Trajectory Hypothesis is True: DNNs can be Trained in Tiny Subspaces
      <https://arxiv.org/abs/2103.11154>`_, 2022
    """
    b = _check_basis(basis)
    k, n_params = b.shape
    base.check_hyperparameter(rho, "rho", lower=0.0, upper=1.0, lower_open=True)
    base.check_hyperparameter(gamma, "gamma", lower=0.0, upper=1.0, upper_open=True)
    base.check_hyperparameter(alpha, "alpha", lower=0.0)
    base.check_hyperparameter(sigma, "sigma", lower=0.0, upper=1.0, lower_open=True, upper_open=True)
    max_search_steps = base.check_positive_int(max_search_steps, "max_search_steps")
    base.check_hyperparameter(eps, "eps", lower=0.0)
    axis_name = base.validate_axis_name(axis_name)
    base.check_bool(shard_basis, "shard_basis")
    base.check_bool(aggregate, "aggregate")

    def _check_params(tree: Any, what: str) -> None:
        size = _flat_size(tree)
        if size != n_params:
            raise ValueError(
                f"`basis` has {n_params} columns but the {what} have {size} entries in total; "
                f"the basis must span the flattened parameters (see jaxopt_dist.flatten_params)."
            )

    def init_fn(params):
        _check_params(params, "params")
        zero = jnp.zeros([], jnp.float32)
        return DimReduceState(
            count=jnp.zeros([], jnp.int32),
            basis=jnp.asarray(b),
            inv_hessian=jnp.eye(k, dtype=jnp.float32),
            grad_last=jnp.zeros([k], jnp.float32),
            step=jnp.zeros([k], jnp.float32),
            momentum=jax.tree.map(jnp.zeros_like, params),
            info=DimReduceInfo(
                loss=zero,
                trial_loss=zero,
                decrease=zero,
                step_size=zero,
                num_trials=jnp.zeros([], jnp.int32),
                accepted=jnp.zeros([], bool),
                curvature_updated=jnp.zeros([], bool),
            ),
        )

    def update_fn(updates, state, params=None, *, value=None, value_fn=None, **extra_args):
        del extra_args
        n = comm.require_axis(axis_name, "dim_reduce")
        if params is None:
            raise ValueError(base.no_params_message("dim_reduce"))
        if value is None or value_fn is None:
            raise ValueError(
                "`dim_reduce` needs the line-search extra args `value` (this worker's loss at "
                "params) and `value_fn` (params -> this worker's loss on the same batch): "
                "tx.update(grads, state, params, value=loss, value_fn=loss_fn). "
                "jaxopt_dist.data_parallel_step passes both."
            )
        _check_params(updates, "updates")
        f32 = jnp.float32
        count = state.count
        rho_ = jnp.asarray(base.resolve(rho, count), f32)
        gamma_ = jnp.asarray(base.resolve(gamma, count), f32)
        alpha_ = jnp.asarray(base.resolve(alpha, count), f32)
        sigma_ = jnp.asarray(base.resolve(sigma, count), f32)
        eps_ = jnp.asarray(base.resolve(eps, count), f32)

        # 1. The worker-mean gradient and loss (one all-reduce of both).
        g = _flatten(updates)
        loss = jnp.asarray(value, f32).reshape(())
        if aggregate:
            g, loss = comm.pmean((g, loss), axis_name, caller="dim_reduce")
        else:
            if comm.is_varying(g, axis_name):
                raise ValueError(
                    "`dim_reduce(..., aggregate=False)` needs gradients that are already the same on "
                    "every worker (e.g. after jaxopt_dist.all_reduce() in the chain); these vary "
                    "across workers. Use aggregate=True to average them here."
                )
            loss = comm.pmean(loss, axis_name, caller="dim_reduce")
        basis_ = state.basis

        # 2. Projection g_k = B g.
        if shard_basis:
            rows_per = -(-k // n)
            rows = comm.axis_index(axis_name) * rows_per + jnp.arange(rows_per)
            valid = rows < k
            local_basis = jnp.take(basis_, jnp.minimum(rows, k - 1), axis=0)
            local_gk = jnp.where(valid, local_basis @ g, 0.0)
            g_k = comm.all_gather(local_gk, axis_name, tiled=True, caller="dim_reduce")[:k]
        else:
            g_k = basis_ @ g

        # 3. BFGS update of the inverse Hessian from the last accepted step.
        h_old, s = state.inv_hessian, state.step
        y = g_k - state.grad_last
        ys = jnp.dot(y, s)
        do_bfgs = ys > eps_
        inv_ys = 1.0 / jnp.where(do_bfgs, ys, 1.0)
        t1 = jnp.eye(k, dtype=f32) - inv_ys * jnp.outer(y, s)
        h_bfgs = t1.T @ h_old @ t1 + inv_ys * jnp.outer(s, s)
        h_new = jnp.where(do_bfgs, h_bfgs, h_old)

        # 4. Direction and back-projections B^T d_k, B^T g_k.
        d_k = -(h_new @ g_k)
        if shard_basis:
            coeffs = jnp.stack([d_k, g_k])[:, jnp.minimum(rows, k - 1)]
            coeffs = jnp.where(valid[None, :], coeffs, 0.0)
            d_n, g_proj = comm.psum(coeffs @ local_basis, axis_name, caller="dim_reduce")
        else:
            d_n = d_k @ basis_
            g_proj = g_k @ basis_
        decrease = jnp.dot(g_k, d_k)

        # 5. Armijo backtracking over rho**i, i < max_search_steps, on the mean loss.
        d_tree = _unflatten(d_n, params)

        def trial_loss(t):
            trial = jax.tree.map(lambda p, d: (p.astype(f32) + t * d).astype(p.dtype), params, d_tree)
            out = jnp.asarray(value_fn(trial), f32).reshape(())
            return comm.pmean(out, axis_name, caller="dim_reduce")

        def cond(carry):
            i, found, _, _, _ = carry
            return jnp.logical_and(i < max_search_steps, jnp.logical_not(found))

        def body(carry):
            i, _, t, _, _ = carry
            new_loss = trial_loss(t)
            found = new_loss < loss + sigma_ * t * decrease
            return i + 1, found, t * rho_, t, new_loss

        carry = (jnp.zeros([], jnp.int32), jnp.zeros([], bool), jnp.ones([], f32), jnp.zeros([], f32), loss)
        num_trials, accepted, _, last_t, last_loss = jax.lax.while_loop(cond, body, carry)
        step_size = jnp.where(accepted, last_t, 0.0)

        # On failure: restore H and g_k_last, keep the old step, move no subspace step.
        inv_hessian = jnp.where(accepted, h_new, h_old)
        grad_last = jnp.where(accepted, g_k, state.grad_last)
        new_step = jnp.where(accepted, step_size * d_k, s)

        # 6. Residual momentum outside the subspace; the emitted update.
        residual = _unflatten(g - g_proj, params)
        momentum = jax.tree.map(
            lambda m, r: (gamma_ * m.astype(f32) + r).astype(m.dtype), state.momentum, residual
        )
        out = jax.tree.map(
            lambda d, m, u: (step_size * d - alpha_ * m.astype(f32)).astype(u.dtype),
            d_tree,
            momentum,
            updates,
        )
        info = DimReduceInfo(
            loss=loss,
            trial_loss=last_loss,
            decrease=decrease,
            step_size=step_size,
            num_trials=num_trials,
            accepted=accepted,
            curvature_updated=jnp.logical_and(accepted, do_bfgs),
        )
        return out, DimReduceState(
            count=jnp.asarray(optax.safe_increment(count)),
            basis=basis_,
            inv_hessian=inv_hessian,
            grad_last=grad_last,
            step=new_step,
            momentum=momentum,
            info=info,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fit_subspace(snapshots: Any, n_components: int) -> np.ndarray:
    r"""PCA basis of a parameter trajectory, in the layout :func:`dim_reduce` takes.

    Centres the snapshots :math:`X \in \mathbb{R}^{T \times n}` (one
    flattened parameter vector per row) and returns the top
    ``n_components`` right singular vectors of :math:`X - \bar X` as the rows
    of a float32 ``(n_components, n_params)`` array with orthonormal rows.
    Signs are fixed so that each row's largest-magnitude entry is positive.

    Args:
      snapshots: a ``(T, n_params)`` array, or a sequence of ``T`` parameter
        pytrees (flattened with :func:`flatten_params`).
      n_components: number of directions ``k``; ``1 <= k <= T - 1`` (centring
        ``T`` snapshots leaves at most ``T - 1`` directions) and
        ``k <= n_params``.

    Returns:
      ``np.ndarray`` of shape ``(n_components, n_params)``, float32.

    Raises:
      ValueError: too few snapshots or directions for ``n_components``, or
        inconsistent snapshot shapes.

    .. note::
      Memory. Computed on the host through the ``T x T`` Gram matrix, in
      float64 column blocks: besides the float32 stack (``4 T n_params``
      bytes) it needs about ``8 (T + k) n_params / blocks + 8 k n_params``
      bytes, i.e. roughly the size of the basis in float64. For a 25M
      parameter model with ``T = 40`` snapshots the stack is 4 GB; keep ``T``
      modest (MindSpore uses a few dozen epochs' weights), or fit the basis on
      a subset of the parameters and pad it with zero columns (still
      orthonormal).
    """
    k = base.check_positive_int(n_components, "n_components")
    if isinstance(snapshots, (list, tuple)):
        if not snapshots:
            raise ValueError("`snapshots` is empty.")
        if all(isinstance(s, (np.ndarray, jax.Array)) and np.ndim(s) == 1 for s in snapshots):
            x = np.stack([np.asarray(s, np.float32) for s in snapshots])
        else:
            flat = [flatten_params(s) for s in snapshots]
            sizes = {f.size for f in flat}
            if len(sizes) != 1:
                raise ValueError(f"`snapshots` pytrees flatten to different sizes: {sorted(sizes)}.")
            x = np.stack(flat)
    else:
        x = np.asarray(snapshots, np.float32)
        if x.ndim != 2:
            raise ValueError(
                f"`snapshots` must be a (T, n_params) array or a sequence of parameter pytrees; "
                f"got an array of shape {x.shape}."
            )
    t, n = x.shape
    if k > t - 1:
        raise ValueError(
            f"`n_components`={k} needs at least {k + 1} snapshots (centring {t} snapshots "
            f"leaves at most {max(t - 1, 0)} directions); got {t}."
        )
    if k > n:
        raise ValueError(f"`n_components`={k} exceeds the number of parameters ({n}).")
    if not np.all(np.isfinite(x)):
        raise ValueError("`snapshots` contain inf or nan.")
    mean = x.mean(axis=0, dtype=np.float64)
    block = max(1, min(n, (1 << 22) // max(t, 1)))
    gram = np.zeros((t, t), np.float64)
    for j in range(0, n, block):
        xc = x[:, j : j + block].astype(np.float64) - mean[j : j + block]
        gram += xc @ xc.T
    evals, evecs = np.linalg.eigh(gram)
    order = np.argsort(evals)[::-1][:k]
    evals, evecs = evals[order], evecs[:, order]
    top = max(float(evals[0]), 0.0)
    if top <= 0.0 or evals[-1] <= top * 1e-12:
        rank = int(np.sum(evals > top * 1e-12)) if top > 0 else 0
        raise ValueError(
            f"The centred snapshots span only {rank} direction(s); cannot fit "
            f"`n_components`={k}. Take more (distinct) snapshots or fewer components."
        )
    comps = np.empty((k, n), np.float64)
    scale = 1.0 / np.sqrt(evals)
    for j in range(0, n, block):
        xc = x[:, j : j + block].astype(np.float64) - mean[j : j + block]
        comps[:, j : j + block] = (evecs.T @ xc) * scale[:, None]
    # Re-orthonormalise (Gram-based components lose orthogonality for small
    # eigenvalues), keeping the order and orientation of the directions.
    q, r = np.linalg.qr(comps.T)
    q = q * np.sign(np.where(np.diag(r) == 0, 1.0, np.diag(r)))[None, :]
    comps = q.T
    idx = np.argmax(np.abs(comps), axis=1)
    signs = np.sign(comps[np.arange(k), idx])
    comps *= np.where(signs == 0, 1.0, signs)[:, None]
    return comps.astype(_BASIS_DTYPE)
