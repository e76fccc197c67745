"""Flax NNX with a hand-written ``nnx.shard_map`` step: gradients that arrive already summed.

Inside ``jax.shard_map(check_vma=True)``, which ``nnx.shard_map`` uses by
default, the gradient of a *replicated* parameter comes back typed invariant
and already **summed** over the data axis: autodiff turns the implicit
broadcast of the parameter into a ``psum``. The aggregators of jaxopt_dist
read that type:

* ``all_reduce`` takes such a gradient as the sum over the workers and divides
  by ``n`` (no second all-reduce); ``random_k``/``block_k`` (shared indices)
  and ``powersgd`` depend only on the mean, so they run on ``sum / n``. All
  give the same parameters as ``check_vma=False`` (per-worker gradients,
  all-reduced by the transform), as ``jaxopt_dist.data_parallel_step``, and as
  one device on the global batch.
* Nonlinear compressors (``top_k``, ``threshold``, signs, ``qsgd``, ``adasum``)
  cannot recover the workers' gradients from their sum; they raise
  :class:`jaxopt_dist.AlreadyReducedError` showing the fix: differentiate
  with respect to a per-worker copy,
  ``jax.lax.pcast(params, "data", to="varying")`` (``per_worker_grads=True``
  below), or pass ``check_vma=False``, or use ``data_parallel_step``.

Run ``python examples/flax_nnx_plain_shard_map.py`` (4 simulated CPU devices,
a few seconds). It prints, per aggregator, the largest difference from
single-device training after 3 steps.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxopt_dist as jd  # noqa: E402

P = jax.sharding.PartitionSpec
LR = 0.1

# The aggregators, each chained with sgd(LR). Exact ones must match one device.
AGGREGATORS: dict[str, Any] = {
    "all_reduce": lambda: jd.all_reduce(),
    "all_reduce(sum)": lambda: jd.all_reduce(reduction="sum"),
    "random_k(density=1)": lambda: jd.random_k(density=1.0),
    "block_k(density=1)": lambda: jd.block_k(density=1.0),
    "powersgd(full rank)": lambda: jd.powersgd(rank=4, min_compression_rate=0.0),
    "top_k(density=1)": lambda: jd.top_k(density=1.0),
    "threshold": lambda: jd.threshold(0.0, capacity=4),
    "sign_majority_vote": lambda: jd.sign_majority_vote(),
    "scaled_sign": lambda: jd.scaled_sign(),
    "qsgd": lambda: jd.qsgd(256),
    "adasum": lambda: jd.adasum(),
}
LINEAR = ("all_reduce", "all_reduce(sum)", "random_k(density=1)", "block_k(density=1)", "powersgd(full rank)")


class MLP(nnx.Module):
    """4 -> 8 -> 3, tanh."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


def make_data(seed: int = 0, batch: int = 16, steps: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch, 4)).astype(np.float32),
            "y": rng.normal(size=(batch, 3)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def loss_of(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error over the (local) batch."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_single_device(tx: optax.GradientTransformation, data, seed: int = 0) -> Any:
    """Plain single-device training on the global batches; returns the params State."""
    model = MLP(rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    opt_state = tx.init(params)
    for batch in data:
        grads = nnx.grad(loss_of)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        nnx.update(model, params)
    return params


def train_plain_shard_map(
    tx: optax.GradientTransformation,
    data,
    *,
    workers: int = 4,
    check_vma: bool = True,
    per_worker_grads: bool = False,
    seed: int = 0,
) -> Any:
    """The hand-written loop: ``nnx.shard_map`` over a replicated model, ``nnx.grad`` inside.

    ``per_worker_grads=True`` differentiates with respect to a per-worker copy
    of the parameters (``jax.lax.pcast(..., to="varying")``), so that every
    aggregator sees this worker's own gradient even with ``check_vma=True``.
    """
    mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
    model = MLP(rngs=nnx.Rngs(seed))
    # The optimizer works on a plain dict of the weights.
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # Optimizer state laid out for the mesh: per-worker leaves (error-feedback
    # residuals) stacked on a leading axis, replicated ones once.
    state_specs = jd.opt_state_specs(tx, params, mesh=mesh)
    opt_state = jd.init_opt_state(tx, params, mesh=mesh)
    per_worker = lambda spec: spec != P()  # noqa: E731

    @nnx.shard_map(
        mesh=mesh,
        in_specs=(P(), state_specs, P("data")),
        out_specs=(state_specs, P()),
        check_vma=check_vma,
    )
    def train_step(model, opt_state, batch):
        opt_state = jax.tree.map(lambda x, s: x[0] if per_worker(s) else x, opt_state, state_specs)
        if per_worker_grads:  # a per-worker copy of the model: grads stay per-worker
            graphdef, state = nnx.split(model)
            local = nnx.merge(graphdef, jax.lax.pcast(state, "data", to="varying"))
            loss, grads = nnx.value_and_grad(loss_of)(local, batch)
        else:  # the replicated model: grads arrive summed over "data" when check_vma=True
            loss, grads = nnx.value_and_grad(loss_of)(model, batch)
        param_state = nnx.state(model, nnx.Param)
        params = nnx.to_pure_dict(param_state)
        updates, opt_state = tx.update(nnx.to_pure_dict(grads), opt_state, params)
        nnx.replace_by_pure_dict(param_state, optax.apply_updates(params, updates))
        nnx.update(model, param_state)
        opt_state = jax.tree.map(lambda x, s: x[None] if per_worker(s) else x, opt_state, state_specs)
        return opt_state, jax.lax.pmean(loss, "data")

    step = nnx.jit(train_step)
    for batch in data:
        opt_state, _ = step(
            model, opt_state, jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
        )
    return nnx.state(model, nnx.Param)


def train_data_parallel(tx: optax.GradientTransformation, data, *, workers: int = 4, seed: int = 0) -> Any:
    """The same training with :func:`jaxopt_dist.data_parallel_step`."""
    mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
    graphdef, params = nnx.split(MLP(rngs=nnx.Rngs(seed)), nnx.Param)
    step = jd.data_parallel_step(lambda p, b: loss_of(nnx.merge(graphdef, p), b), tx, mesh=mesh)
    params, opt_state = step.init(params)
    for batch in data:
        params, opt_state, _ = step(params, opt_state, batch)
    return params


def max_diff(a: Any, b: Any) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(name: str, *, workers: int = 4, data=None) -> dict[str, Any]:
    """Trains with aggregator ``name`` on every path; differences from one device (or errors)."""
    data = make_data() if data is None else data
    make = AGGREGATORS[name]
    # reduction="sum" adds the workers' gradients of their mean losses: n times
    # the gradient of the global mean loss, so one device uses n * LR.
    ref_lr = LR * workers if "sum" in name else LR
    ref = train_single_device(jd.sgd(ref_lr), data)
    out: dict[str, Any] = {}
    for path in ("check_vma=True", "check_vma=False", "data_parallel_step"):
        tx = optax.chain(make(), jd.sgd(LR))
        try:
            if path == "data_parallel_step":
                params = train_data_parallel(tx, data, workers=workers)
            else:
                params = train_plain_shard_map(tx, data, workers=workers, check_vma=path == "check_vma=True")
            out[path] = max_diff(params, ref)
        except jd.AlreadyReducedError as e:
            out[path] = e
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args(argv)
    results = {}
    print(f"{'aggregator':22s} {'check_vma=True':>18s} {'check_vma=False':>16s} {'data_parallel_step':>19s}")
    for name in AGGREGATORS:
        res = compare(name, workers=args.workers)
        results[name] = res
        cells = [
            "AlreadyReducedError" if isinstance(v, Exception) else f"{v:.1e}"
            for v in (res["check_vma=True"], res["check_vma=False"], res["data_parallel_step"])
        ]
        print(f"{name:22s} {cells[0]:>18s} {cells[1]:>16s} {cells[2]:>19s}")
    print(
        "(max |params - single device| after 3 steps; nonlinear compressors differ from one device by design)"
    )
    return results


if __name__ == "__main__":
    main()
