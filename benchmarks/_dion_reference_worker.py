"""Torch worker for ``dion_reference_side_by_side.py`` (one process of a gloo group).

Runs microsoft/dion's optimizers (imported from ``--reference``, never copied here) on the
cases of a plan written by the driver, and saves per-step parameters, ``Q`` and momentum to
``<out>/rank<r>.npz``. Launched once per world size as ``W`` subprocesses on loopback.

Two monkeypatches, both documented in the driver's docstring:

* ``dtensor_randn`` in the imported modules is replaced by a seeded full-tensor draw followed
  by ``distribute_tensor``: DTensor's RNG tracker needs a CUDA-like device, and on a CPU mesh
  ``torch.distributed.tensor.randn`` fails. It feeds the initial ``Q`` of sharded parameters
  (immediately overwritten, below) and the random sketch of the randomised Cholesky QR, whose
  result does not depend on the sketch up to rounding.
* ``Dion._init_opt_state_dion`` is wrapped so that, after the original has built the state, its
  ``Q`` is replaced by the driver's ``Q0`` (same shape and placements), so every run starts
  from the same ``Q`` as our JAX run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The driver's arguments (parsed before torch loads, so ``--help`` needs no torch)."""
    ap = argparse.ArgumentParser(description="One torch process of the Dion side-by-side run.")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import (  # noqa: E402
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
)


def _seeded_dtensor_randn_factory() -> Callable[..., DTensor]:
    counter = [0]

    def seeded_dtensor_randn(
        *size: Any, device_mesh: Any = None, dtype: Any = None, placements: Any = None, **kw: Any
    ):
        del kw
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        gen = torch.Generator().manual_seed(10_000 + counter[0])
        counter[0] += 1
        full = torch.randn(size, generator=gen, dtype=dtype or torch.float32)
        return distribute_tensor(full, device_mesh, placements)

    return seeded_dtensor_randn


def _patch_module(module: Any, q0_for: Callable[[bool], np.ndarray]) -> None:
    module.dtensor_randn = _seeded_dtensor_randn_factory()
    cls = module.Dion
    if getattr(cls, "_side_by_side_patched", False):
        cls._side_by_side_q0_for = q0_for
        return
    orig = cls._init_opt_state_dion

    def patched(self: Any, param: Any, state: dict, *args: Any, **kwargs: Any) -> None:
        orig(self, param, state, *args, **kwargs)
        cfg = self._param_config[param]
        q_full = torch.tensor(cls._side_by_side_q0_for(cfg.is_transposed), dtype=state["Q"].dtype)
        old = state["Q"]
        if tuple(old.shape) != tuple(q_full.shape):
            raise RuntimeError(f"Q shape {tuple(old.shape)} != planned {tuple(q_full.shape)}")
        if isinstance(old, DTensor):
            state["Q"] = distribute_tensor(q_full, old.device_mesh, old.placements)
        else:
            state["Q"] = q_full

    cls._init_opt_state_dion = patched
    cls._side_by_side_patched = True
    cls._side_by_side_q0_for = q0_for


def _full(t: torch.Tensor) -> np.ndarray:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(torch.float32).numpy().copy()


def _run_dion_case(case: dict, inputs: Any, rank: int, meshes: dict, modules: dict) -> dict:
    module = modules[case["impl"]]
    x0 = inputs[f"{case['name']}/X0"]
    grads = inputs[f"{case['name']}/G"]  # (steps, world, d_out, d_in), one per process
    q0 = {True: inputs[f"{case['name']}/Q0_T"], False: inputs[f"{case['name']}/Q0_N"]}
    _patch_module(module, lambda transposed: q0[transposed])
    layout = case["layout"]
    kw = dict(
        rank_fraction=case["rank_fraction"],
        lr=case["lr"],
        mu=case["mu"],
        weight_decay=case["weight_decay"],
        epsilon=case["eps"],
    )
    torch.manual_seed(0)
    if layout == "replicated":
        param = torch.nn.Parameter(torch.tensor(x0))
        opt = module.Dion([param], replicate_mesh=dist.group.WORLD, **kw)
    elif layout == "fsdp":
        mesh = meshes["flat"]
        param = torch.nn.Parameter(distribute_tensor(torch.tensor(x0), mesh, [Shard(case["shard_dim"])]))
        opt = module.Dion([param], outer_shard_mesh=mesh, **kw)
    elif layout == "hsdp":
        mesh = meshes["hsdp"]
        placements = [Replicate(), Shard(case["shard_dim"])]
        param = torch.nn.Parameter(distribute_tensor(torch.tensor(x0), mesh, placements))
        opt = module.Dion([param], replicate_mesh=mesh["rep"], outer_shard_mesh=mesh["shard"], **kw)
    else:
        raise ValueError(layout)

    xs, qs, ms = [_full(param)], [], []
    q_init = None
    transposed = None
    for step in range(case["steps"]):
        g = torch.tensor(grads[step, rank])
        if layout == "replicated":
            param.grad = g
        else:
            # Emulates FSDP2's reduce-scatter: mean over the shard group, keep this rank's shard.
            shard_mesh = mesh if layout == "fsdp" else mesh["shard"]
            g_mean = funcol.all_reduce(g, "avg", group=shard_mesh.get_group()).wait()
            d = case["shard_dim"]
            n_shards = shard_mesh.size()
            local = g_mean.chunk(n_shards, dim=d)[shard_mesh.get_local_rank()].contiguous()
            param.grad = DTensor.from_local(local, mesh, param.placements, run_check=False)
        opt.step()  # the state (and the patched Q0) is created inside the first step
        state = opt.state[param]
        if q_init is None:
            transposed = bool(opt._param_config[param].is_transposed)
            q_init = q0[transposed]
        xs.append(_full(param))
        qs.append(_full(state["Q"]))
        ms.append(_full(state["momentum"]))
    cfg = opt._param_config[param]
    return {
        "X": np.stack(xs),
        "Q": np.stack(qs),
        "M": np.stack(ms),
        "Q0": q_init,
        "transposed": np.array(transposed),
        "compressed": np.array(bool(cfg.compressed_all_reduce)),
    }


DION_NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def _ns_float32(g: torch.Tensor, epsilon: Any = 1e-8) -> torch.Tensor:
    """The reference's ``zeropower_via_newtonschulz5`` ("dion" table) in float32 instead of bf16."""
    x = g.to(torch.float32)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + epsilon)
    for a, b, c in DION_NS_COEFFS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


class _TorchWithoutBf16:
    """``torch`` as seen by a patched module: ``torch.bfloat16`` reads as ``torch.float32``.

    The reference's Muon and Dion2 cast what they exchange and orthogonalise to bf16 with
    ``.to(dtype=torch.bfloat16)``; swapping the module's ``torch`` for this proxy keeps every
    other line as shipped and runs those casts as float32 no-ops."""

    def __getattr__(self, name: str) -> Any:
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


def _set_grad(param: Any, g: torch.Tensor, layout: str, mesh: Any, shard_dim: int) -> None:
    if layout == "replicated":
        # DDP: the gradient arrives averaged (Muon/Dion2 expect synchronised gradients).
        param.grad = funcol.all_reduce(g, "avg", group=dist.group.WORLD).wait()
        return
    g_mean = funcol.all_reduce(g, "avg", group=mesh.get_group()).wait()
    local = g_mean.chunk(mesh.size(), dim=shard_dim)[mesh.get_local_rank()].contiguous()
    param.grad = DTensor.from_local(local, mesh, param.placements, run_check=False)


def _run_ortho_case(case: dict, inputs: Any, rank: int, meshes: dict, modules: dict) -> dict:
    """Muon or Dion2 of the reference on several matrices; gradients synchronised first."""
    algo = case["algo"]
    module = modules[algo]
    f32 = case["variant"].startswith("f32")
    module.torch = _TorchWithoutBf16() if f32 else torch
    layout = case["layout"]
    mesh = meshes["flat"]
    params = []
    groups: dict[Any, list] = {}
    for i, shape in enumerate(case["shapes"]):
        x0 = torch.tensor(inputs[f"{case['key']}/X0_{i}"])
        if layout == "replicated":
            p = torch.nn.Parameter(x0)
        else:
            p = torch.nn.Parameter(distribute_tensor(x0, mesh, [Shard(0)]))
        params.append(p)
        # Muon: optax scales by sqrt(max(1, d_out / d_in)); Dion2: keep its default everywhere.
        adjust = "spectral_norm" if algo == "dion2" or shape[0] >= shape[1] else None
        groups.setdefault(adjust, []).append(p)
    pg = [{"params": ps, "adjust_lr": adjust} for adjust, ps in groups.items()]
    dmesh = dist.group.WORLD if layout == "replicated" else mesh
    kw: dict[str, Any] = dict(lr=case["lr"], weight_decay=case["weight_decay"], epsilon=case["eps"])
    if f32:
        kw["newton_schulz_func"] = _ns_float32
    elif case["variant"] == "bf16":
        kw["use_polar_express"] = False  # the "dion" coefficient table, in bf16
    # else "polar-express": the shipped default (Polar Express coefficients, bf16)
    if algo == "muon":
        opt = module.Muon(pg, distributed_mesh=dmesh, mu=case["mu"], nesterov=case["nesterov"], **kw)
    else:
        opt = module.Dion2(
            pg,
            distributed_mesh=dmesh,
            fraction=case["fraction"],
            ef_decay=case["mu"],
            selection_scope=case["scope"],
            **kw,
        )
    xs = [[_full(p)] for p in params]
    for step in range(case["steps"]):
        for i, p in enumerate(params):
            g = torch.tensor(inputs[f"{case['key']}/G_{i}"][step, rank])
            _set_grad(p, g, layout, mesh, 0)
        opt.step()
        for i, p in enumerate(params):
            xs[i].append(_full(p))
    return {f"X_{i}": np.stack(x) for i, x in enumerate(xs)}


def main() -> None:
    args = parse_args()

    torch.set_num_threads(1)
    sys.path.insert(0, args.reference)
    modules: dict[str, Any] = {}
    import dion.dion_reference as dion_reference  # type: ignore[import-not-found]

    modules["dion_reference"] = dion_reference
    try:
        import dion.dion as dion_async  # type: ignore[import-not-found]

        modules["dion"] = dion_async
    except Exception as e:  # noqa: BLE001
        print(f"[rank {args.rank}] dion.dion import failed: {e!r}", file=sys.stderr)
    for name in ("muon", "dion2"):
        try:
            modules[name] = importlib.import_module(f"dion.{name}")
        except Exception as e:  # noqa: BLE001
            print(f"[rank {args.rank}] dion.{name} import failed: {e!r}", file=sys.stderr)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=300),
    )
    meshes = {"flat": init_device_mesh("cpu", (args.world,))}
    if args.world == 4:
        meshes["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))

    with open(args.plan) as f:
        plan = json.load(f)
    inputs = np.load(args.inputs)
    results: dict[str, np.ndarray] = {}
    errors: dict[str, str] = {}
    for case in plan:
        if case["world"] != args.world:
            continue
        key = case["key"]
        algo = case.get("algo", "dion")
        if (case["impl"] if algo == "dion" else algo) not in modules:
            errors[key] = "module not importable"
            continue
        try:
            if algo == "dion":
                res = _run_dion_case(case, inputs, args.rank, meshes, modules)
            else:
                res = _run_ortho_case(case, inputs, args.rank, meshes, modules)
        except Exception as e:  # noqa: BLE001
            errors[key] = f"{type(e).__name__}: {e}"
            print(f"[rank {args.rank}] {key}: {errors[key]}", file=sys.stderr)
            dist.barrier()
            continue
        for k, v in res.items():
            results[f"{key}/{k}"] = v
    np.savez(os.path.join(args.out, f"rank{args.rank}.npz"), **results)
    with open(os.path.join(args.out, f"errors{args.rank}.json"), "w") as f:
        json.dump(errors, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
