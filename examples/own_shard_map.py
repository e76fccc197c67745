"""Your own ``jax.shard_map`` step with jaxopt_dist transforms, equal bit for bit to ``data_parallel_step``.

The whole loop, written by hand: the parameters and the optimizer state are
placed on the mesh, each with its PartitionSpecs; inside the map every worker
sees its own row of the per-worker leaves (``x[0]``) and hands back a row of
one (``x[None]``); the batch is placed split over ``"data"`` before the call.
Two optimizers show the two kinds of per-worker state:

* ``--tx top_k``: replicated parameters; top-k keeps an error-feedback
  residual per worker (``P("data")`` in the state's specs).
* ``--tx diloco``: per-worker parameters (each worker trains its own copy),
  DiLoCo's anchor and outer momentum replicated.

The same steps through :func:`jaxopt_dist.data_parallel_step` give the same
parameters and state bit for bit; the script checks it.

Run ``python examples/own_shard_map.py`` (8 simulated devices on a CPU), or
``python examples/own_shard_map.py --tx diloco --workers 4``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulate 8 devices on a CPU-only machine (ignored when real accelerators are used).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxopt_dist as jd  # noqa: E402

P = jax.sharding.PartitionSpec
TXS = {
    "top_k": (lambda: optax.chain(jd.top_k(density=0.25), jd.sgd(0.1, momentum=0.9)), False),
    "diloco": (lambda: jd.diloco(optax.adamw(1e-2), sync_every=3), True),
}


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (8, 16)) / 8**0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 2)) / 4,
    }


def batches(steps: int, rows: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        out.append({"x": x, "y": np.stack([np.sin(x[:, 0]), np.cos(x[:, 1])], axis=1).astype(np.float32)})
    return out


# -- Per-worker leaves: stacked along a leading worker axis outside, one row inside. ---------------


def own_row(tree: Any, specs: Any) -> Any:
    """Inside the map: this worker's row of each leaf placed ``P("data", ...)``; others as they are."""
    return jax.tree.map(lambda x, s: x[0] if s != P() else x, tree, specs)


def as_row(tree: Any, specs: Any) -> Any:
    """Inside the map: each per-worker leaf as a row of one, for ``out_specs`` ``P("data", ...)``."""
    return jax.tree.map(lambda x, s: x[None] if s != P() else x, tree, specs)


def make_step(tx: Any, mesh: jax.sharding.Mesh, p_specs: Any, s_specs: Any, per_worker_params: bool):
    """The jitted step ``(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def body(params, opt_state, batch):
        p, s = own_row(params, p_specs), own_row(opt_state, s_specs)
        # Differentiate a per-worker (varying) copy: for replicated parameters, shard_map's
        # autodiff would otherwise sum the gradients over "data" before tx sees them.
        p_var = p if per_worker_params else jax.lax.pcast(p, "data", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(p_var, batch)
        updates, s = tx.update(grads, s, p)
        p = optax.apply_updates(p, updates)
        return as_row(p, p_specs), as_row(s, s_specs), jax.lax.pmean(loss, "data")

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(p_specs, s_specs, P("data")),
        out_specs=(p_specs, s_specs, P()),
        check_vma=True,
    )
    return jax.jit(mapped)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tx", choices=sorted(TXS), default="top_k")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8, help="devices on the 'data' axis")
    args = ap.parse_args(argv)
    make_tx, per_worker_params = TXS[args.tx]
    tx = make_tx()
    mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[: args.workers])
    params0 = init_params(jax.random.key(0))

    # [placement]
    # The specs: parameters replicated (P()) or one copy per worker (P("data")); the state's
    # per-worker leaves P("data"), the rest P().
    p_specs = jax.tree.map(lambda _: P("data") if per_worker_params else P(), params0)
    s_specs = jd.opt_state_specs(tx, params0, mesh=mesh, per_worker_params=per_worker_params)
    params = jd.place_params(params0, mesh=mesh, per_worker_params=per_worker_params)
    opt_state = jd.init_opt_state(tx, params0, mesh=mesh, per_worker_params=per_worker_params)
    step = make_step(tx, mesh, p_specs, s_specs, per_worker_params)
    batch_sharding = jax.sharding.NamedSharding(mesh, P("data"))  # rows split over the workers
    # [/placement]

    reference = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=per_worker_params)
    ref_params, ref_state = reference.init(params0)
    for t, batch in enumerate(batches(args.steps, 4 * args.workers)):
        placed = jax.device_put(batch, batch_sharding)
        params, opt_state, loss = step(params, opt_state, placed)
        ref_params, ref_state, metrics = reference(ref_params, ref_state, batch)
        print(f"step {t}: loss {float(loss):.6f} (data_parallel_step: {float(metrics['loss']):.6f})")

    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
        (params, opt_state),
        (ref_params, ref_state),
    )
    identical = all(jax.tree.leaves(same))
    print(f"{args.tx}: parameters and state bit-identical to data_parallel_step: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
