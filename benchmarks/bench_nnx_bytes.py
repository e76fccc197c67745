"""Does the Flax NNX front end send what the transform sends? Data-axis bytes of DiLoCo on the GPT.

The byte-level GPT of ``examples/lm.py`` (its default CPU size) on a 2 x 4
(``data`` x ``fsdp``) mesh, with ``jd.diloco(adamw, sync_every=H)``, compiled
three ways: ``jaxopt_dist.nnx.data_parallel(..., per_worker_params=True)``
with the model holding DiLoCo's anchor (the default), the same with
``model_params="average"`` (an all-reduce of the workers' parameters on every
step, for transforms without an anchor), and ``jd.data_parallel_step`` on the
same parameters. For each, the collectives over the data axis read off the
compiled HLO (``jd.hlo_collectives``): bytes per device on every step (outside
any conditional) and in DiLoCo's synchronising branch (once every ``H``
steps), and the average per step. Nothing is run; every figure is the
compiled program's own.

    python benchmarks/bench_nnx_bytes.py [--sync-every 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
from bench_lm import import_lm


def data_axis(lowered, mesh) -> tuple[int, int]:
    """(bytes per device on every step, bytes per device in conditional branches), over the data axis."""
    import jaxopt_dist as jd

    found = [
        h
        for h in jd.hlo_collectives(lowered.compile().as_text(), mesh=mesh)
        if h.axes is None or "data" in h.axes
    ]
    every = sum(h.payload_bytes for h in found if h.computation.startswith("main"))
    return every, sum(h.payload_bytes for h in found) - every


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    _common.configure_devices(8)
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxopt_dist as jd
    from jaxopt_dist import nnx as jnnx

    lm = import_lm()
    cfg = lm.GPTConfig()
    mesh = lm.make_mesh(2, 4)
    batch = np.random.default_rng(0).integers(0, 256, (16, cfg.context + 1)).astype(np.uint8)
    tx = lambda: jd.diloco(optax.adamw(1e-3), sync_every=a.sync_every)  # noqa: E731

    def xent(model, b):
        tokens = b.astype(np.int32)
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(np.float32), tokens[:, 1:]
        ).mean()

    def nnx_step(model, optimizer, b):
        loss, grads = nnx.value_and_grad(lambda m: xent(m, b))(model)
        optimizer.update(model, grads)
        return loss

    rows = []
    for model_params in ("anchor", "average"):
        with jax.set_mesh(mesh):
            model = lm.GPT(cfg, rngs=nnx.Rngs(0))
            optimizer = jnnx.Optimizer(model, tx(), wrt=nnx.Param)
        step = jnnx.data_parallel(
            nnx_step, mesh=mesh, per_worker_params=True, batch_axes="fsdp", model_params=model_params
        )
        rows.append(
            (
                f"jaxopt_dist.nnx, model_params={model_params!r}",
                *data_axis(step.lower(model, optimizer, batch), mesh),
            )
        )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = jax.tree.map(lambda x: x.sharding.spec, nnx.as_pure(params))
    loss = lm.make_loss(graphdef, rest)
    dps = jd.data_parallel_step(
        loss, tx(), mesh=mesh, per_worker_params=True, param_specs=specs, batch_axes="fsdp"
    )
    p0, s0 = dps.init(jax.device_get(nnx.as_pure(params)))
    rows.append(("data_parallel_step", *data_axis(dps.lower(p0, s0, batch), mesh)))
    n_params = sum(int(np.size(x)) for x in jax.tree.leaves(nnx.as_pure(params)))
    print(f"GPT {n_params:,} parameters, 2 x 4 mesh (data x fsdp), diloco(adamw, sync_every={a.sync_every})")
    print("| step | every step (B/device) | sync branch (B/device) | average per step (B/device) |")
    print("|---|---:|---:|---:|")
    out = []
    for name, every, branch in rows:
        avg = every + branch / a.sync_every
        print(f"| {name} | {every:,} | {branch:,} | {avg:,.0f} |")
        out.append({"step": name, "every_step": every, "sync_branch": branch, "per_step": avg})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": n_params, "sync_every": a.sync_every, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
