r"""Elastic resume: optimizer state regrouped for a different number of workers.

A checkpoint written by ``n`` workers holds per-worker state stacked along a
leading axis of size ``n`` (see :mod:`jaxopt_dist._src.training.layout`). To resume on
``m`` workers, :func:`reshard_opt_state` regroups it on the host.

Which leaves are per-worker is not guessed from shapes: it is read off one
abstract update under ``jax.shard_map`` (the placement machinery of
:func:`jaxopt_dist.opt_state_placement`). What each per-worker leaf *means* is
read from the state class and field holding it: each state class registers
the rules of its per-worker fields next to its definition
(``@base.reshard_rules(residual=base.REGROUP)``), and each kind has its rule:

* replicated leaves (counters, momentum after an all-reduce, PowerSGD's
  warm-start ``q``, shared PRNG keys) are copied;
* error-feedback residuals (:class:`jaxopt_dist.ErrorFeedbackState` ``residual``),
  the gradients ``optax.MultiSteps`` has accumulated, and per-worker copies of
  parameters and of local-optimizer statistics (gossip, local SGD, iterate
  averages, master weights) are **regrouped**: new worker :math:`j` takes the
  weighted mean :math:`x'_j = \sum_i W_{ji} x_i` below;
* per-worker PRNG keys are re-derived deterministically from worker 0's key:
  ``key'_j = fold_in(fold_in(key_0, m), j)``;
* any other per-worker leaf raises: nothing is dropped silently.

The regrouping weights. Lay the old workers on ``[0, 1)`` as ``n`` intervals
of length ``1/n`` and the new ones as ``m`` intervals of length ``1/m``;
:math:`W_{ji} = m \cdot |I_i \cap J_j|`. Each row sums to 1 (a weighted mean)
and each column to ``m / n``, so

.. math::
  \frac{1}{m} \sum_j x'_j = \frac{1}{m} \sum_i \frac{m}{n} x_i = \frac{1}{n} \sum_i x_i :

the update the residuals still owe, their mean, is conserved exactly (up to
one rounding to the leaf's dtype). Merging (``n = k m``) takes the plain mean
of each group of ``k`` workers; splitting (``m = k n``) copies each worker's
row to ``k`` new workers; ``n = m`` is the identity. Uneven counts mix
neighbouring workers, e.g. 8 -> 6: new worker 0 takes ``3/4 x_0 + 1/4 x_1``,
new worker 1 ``1/2 x_1 + 1/2 x_2``, and each old worker's weights sum to 3/4.
The weights are exact rationals ``c_ji / n`` with integer ``c_ji``; the sums are
taken in float64.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base
from jaxopt_dist._src.training import placement

# optax's own states: their rules are recorded here, the library's next to each class.
base.register_reshard_rules(optax.MultiStepsState, acc_grads=base.REGROUP)
base.register_reshard_rules(optax.TraceState, trace=base.REGROUP)
base.register_reshard_rules(optax.ScaleByAdamState, mu=base.REGROUP, nu=base.REGROUP)

_KEY_FIELDS = ("key", "keys", "rng")


def regroup_weights(n: int, m: int) -> np.ndarray:
    """The ``(m, n)`` matrix taking ``n`` workers' rows to ``m`` (see module doc).

    Entry ``[j, i]`` is the share of old worker ``i`` in new worker ``j``: rows
    sum to 1, columns to ``m / n``, so the mean over workers is conserved.
    """
    n = base.check_positive_int(n, "n")
    m = base.check_positive_int(m, "m")
    return _counts(n, m) / n


def _counts(n: int, m: int) -> np.ndarray:
    """Integer overlaps ``c[j, i]`` of old interval ``i`` and new interval ``j`` in units of 1/(n m)."""
    i = np.arange(n)[None, :]
    j = np.arange(m)[:, None]
    lo = np.maximum(i * m, j * n)
    hi = np.minimum((i + 1) * m, (j + 1) * n)
    return np.maximum(hi - lo, 0).astype(np.float64)


def _regroup(x: np.ndarray, m: int) -> np.ndarray:
    n = x.shape[0]
    if n == m:
        return np.array(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError(f"cannot average per-worker {x.dtype} values into new workers")
    flat = np.asarray(x, np.float64).reshape(n, -1)
    out = (_counts(n, m) @ flat) / n
    return out.reshape((m, *x.shape[1:])).astype(x.dtype)


def _rederive_keys(x: Any, m: int) -> Any:
    n = x.shape[0]
    if n == m:
        return x
    typed = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    keys = x if typed else jax.random.wrap_key_data(jnp.asarray(x))
    base_key = jax.random.fold_in(keys[0], m)
    new = jax.vmap(lambda j: jax.random.fold_in(base_key, j))(jnp.arange(m))
    return new if typed else np.asarray(jax.random.key_data(new)).astype(x.dtype)


def _is_named_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


class _Label(NamedTuple):
    owner: str
    field: str
    rule: str | None
    note: str = ""  # the state class's RESHARD_NOTE: why it has no rule, and what to do instead


def _labels(state: Any) -> Any:
    """``state`` with each leaf replaced by a :class:`_Label`: the class and field holding it."""

    def walk(node: Any, ctx: _Label) -> Any:
        if not _is_named_tuple(node):
            return jax.tree.map(
                lambda x: walk(x, ctx) if _is_named_tuple(x) else ctx, node, is_leaf=_is_named_tuple
            )
        cls = type(node)
        out = []
        for field in node._fields:
            rule = base.reshard_rule(cls, field) or (base.REDERIVE_KEY if field in _KEY_FIELDS else None)
            note = getattr(cls, "RESHARD_NOTE", "")
            inner = ctx if rule is None and ctx.rule is not None else _Label(cls.__name__, field, rule, note)
            out.append(walk(getattr(node, field), inner))
        return cls(*out)

    return walk(state, _Label("", "", None))


def _as_structure(raw: Any, template: Any) -> list[Any]:
    """The leaves of ``raw`` in ``template``'s order, found by path.

    ``raw`` may be the state itself or the nested dicts/lists a checkpoint
    library restores without a target (NamedTuple fields become dict keys).
    """
    if jax.tree.structure(raw) == jax.tree.structure(template):
        return jax.tree.leaves(raw)
    leaves = []
    for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]:
        node = raw
        for k in path:
            name = getattr(k, "name", getattr(k, "key", getattr(k, "idx", None)))
            try:
                if isinstance(node, dict):
                    node = node[name] if name in node else node[str(name)]
                elif isinstance(node, (list, tuple)) and isinstance(name, int):
                    node = node[name]
                else:
                    node = getattr(node, str(name))
            except (KeyError, IndexError, AttributeError, TypeError):
                raise ValueError(
                    f"`opt_state` has no leaf at {jax.tree_util.keystr(path)}, which tx.init(params) "
                    "has: pass the state of this `tx` for these `params`."
                ) from None
        leaves.append(node)
    num = len([x for x in jax.tree.leaves(raw) if x is not None])
    if num != len(leaves):
        raise ValueError(
            f"`opt_state` has {num} leaves but tx.init(params) has {len(leaves)}: pass the state of "
            "this `tx` for these `params`."
        )
    return leaves


def _placement(tx: Any, params: Any, axis_name: base.AxisName, per_worker_params: bool) -> Any:
    names = base.axis_names(axis_name)
    sizes = (2,) + (1,) * (len(names) - 1)
    mesh = jax.sharding.AbstractMesh(sizes, names)
    return placement.opt_state_placement(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    ).per_worker


def reshard_opt_state(
    opt_state: optax.OptState,
    tx: optax.GradientTransformation,
    params: optax.Params,
    *,
    num_workers: int,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    per_worker_params: bool = False,
) -> optax.OptState:
    r"""Regroups a data-parallel optimizer state for ``num_workers`` workers (host-side).

    ``opt_state`` is laid out as :func:`jaxopt_dist.init_opt_state` lays it
    out for ``n`` workers (per-worker leaves stacked along a leading axis of
    size ``n``), e.g. restored from a checkpoint, either as the state itself
    or as the raw nested dicts/lists a checkpoint library returns without a
    target. The result has the same layout for ``num_workers`` workers, as
    NumPy arrays, ready for :func:`jaxopt_dist.place_opt_state` or a step.

    Rules (see the module doc for the weights): replicated leaves are copied;
    error-feedback residuals, accumulated gradients and per-worker copies of
    parameters and local-optimizer statistics are regrouped so that their mean
    over workers, for residuals the update still owed
    :math:`\frac{1}{n}\sum_i e_i`, is conserved exactly (merging takes the
    mean, splitting copies, uneven counts take overlap weights); per-worker
    PRNG keys are re-derived deterministically; any other per-worker leaf
    raises ``ValueError``. Per-worker *parameters* (gossip, local SGD) live
    outside the state: regroup them with :func:`reshard_params`.

    Args:
      opt_state: the state for ``n`` workers.
      tx: the optimizer that built it.
      params: one copy of the parameters (arrays or ShapeDtypeStructs).
      num_workers: the new number of workers ``m``.
      axis_name: the data axis ``tx`` communicates on.
      per_worker_params: whether parameters differ between workers.

    Returns:
      The state for ``num_workers`` workers, with ``tx.init(params)``'s structure.

    Communication:
      None: it runs on the host, outside any mapped axis.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxopt_dist as jd
      >>> tx = optax.chain(jd.top_k(k=1), jd.sgd(0.1))
      >>> params = jnp.zeros(3)
      >>> ef, sgd_state = tx.init(params)
      >>> residuals = np.arange(24, dtype=np.float32).reshape(8, 3)  # 8 workers' rows
      >>> state8 = (ef._replace(residual=residuals), sgd_state)
      >>> state4 = jd.reshard_opt_state(state8, tx, params, num_workers=4)
      >>> state4[0].residual[0]  # the mean of workers 0 and 1
      array([1.5, 2.5, 3.5], dtype=float32)
      >>> bool(np.allclose(state4[0].residual.mean(0), residuals.mean(0)))
      True
    """
    m = base.check_positive_int(num_workers, "num_workers")
    axis_name = base.validate_axis_name(axis_name)
    local = jax.eval_shape(tx.init, base.abstract(params))
    mask = jax.tree.leaves(_placement(tx, params, axis_name, bool(per_worker_params)))
    labels = jax.tree.leaves(_labels(local), is_leaf=lambda x: isinstance(x, _Label))
    leaves = _as_structure(opt_state, local)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(local)[0]]
    want = jax.tree.leaves(local)
    n = _old_workers(leaves, want, mask, paths)
    out = [
        _reshard_leaf(x, w, per_worker, label, path, n, m)
        for x, w, per_worker, label, path in zip(leaves, want, mask, labels, paths)
    ]
    return jax.tree.unflatten(jax.tree.structure(local), out)


def _host(x: Any) -> Any:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_get(x)
    return np.asarray(jax.device_get(x))


def _old_workers(leaves: list[Any], want: list[Any], mask: list[bool], paths: list[str]) -> int | None:
    n = None
    for x, w, per_worker, path in zip(leaves, want, mask, paths):
        shape, local = tuple(np.shape(x)), tuple(w.shape)
        if not per_worker:
            if shape != local:
                raise ValueError(
                    f"`opt_state` leaf {path} is replicated and should have shape {local}; got {shape}."
                )
            continue
        if len(shape) != len(local) + 1 or shape[1:] != local:
            raise ValueError(
                f"`opt_state` leaf {path} is per-worker and should have shape {('n', *local)} "
                f"(stacked over the old workers); got {shape}."
            )
        if n is not None and shape[0] != n:
            raise ValueError(
                f"`opt_state` per-worker leaves disagree on the number of workers: {n} and "
                f"{shape[0]} (leaf {path})."
            )
        n = shape[0]
    return n


def _reshard_leaf(x: Any, want: Any, per_worker: bool, label: _Label, path: str, n: Any, m: int) -> Any:
    x = _host(x)
    if not per_worker:
        return x
    if label.rule == base.REGROUP:
        try:
            return _regroup(x, m)
        except ValueError as e:
            raise ValueError(f"`opt_state` leaf {path} ({label.owner}.{label.field}): {e}.") from None
    if label.rule == base.REDERIVE_KEY and (
        jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or (x.dtype == np.uint32 and x.shape[-1:] == (2,))
    ):
        return _rederive_keys(x, m)
    where = f"{label.owner}.{label.field}" if label.owner else "outside any state class"
    raise ValueError(
        f"`opt_state` leaf {path} ({where}) is per-worker, and there is no rule to regroup it from "
        f"{n} to {m} workers without changing what it means."
        + (f" {label.note}" if label.note else "")
        + " Supported per-worker fields: "
        + ", ".join(base.reshard_rule_names())
        + " and per-worker PRNG keys."
    )


def reshard_params(params: optax.Params, *, num_workers: int) -> optax.Params:
    """Regroups per-worker parameters (stacked, leading axis = worker) for ``num_workers`` workers.

    For transforms with per-worker parameters (gossip, local SGD /
    ``average_params``): new worker ``j`` takes the weighted mean of the old
    workers' parameters with the weights of :func:`reshard_opt_state`
    (merging averages, splitting copies), so the mean model is conserved.

    Args:
      params: per-worker parameters, each leaf of shape ``(n, ...)``.
      num_workers: the new number of workers ``m``.

    Returns:
      NumPy parameters of shape ``(m, ...)``.

    Communication:
      None: it runs on the host.
    """
    m = base.check_positive_int(num_workers, "num_workers")
    leaves = [_host(x) for x in jax.tree.leaves(params)]
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "`params` must be per-worker parameters, every leaf stacked along a leading axis of the "
            f"same size (the old number of workers); got leading sizes {sorted(map(str, sizes))}."
        )
    out = [_regroup(x, m) for x in leaves]
    return jax.tree.unflatten(jax.tree.structure(params), out)
