"""Orthonormal updates (Dion, distributed Muon, Dion2): bytes, link time, optimizer memory and work per device.

Five parts, each a table (``--parts`` a, c, d, e; default all four; b runs with ``--network``):

* ``a``, bytes: bytes per step each worker sends over the data axis for the
  ResNet-18 (CIFAR) parameter shapes of ``bench_compression.py`` (11.2M
  float32), read with :func:`jaxopt_dist.communication_cost` for
  ``--workers`` (2 and 8) workers: dense all-reduce, ``optax.contrib.muon`` on the
  mean gradient, our distributed Muon, Dion at rank fractions 1, 1/4 and
  1/16, and Dion2 at fraction 1/4 (and, for Muon and Dion2, the matrix
  entries their owner stacks carry over the real ones: shapes with fewer
  matrices than workers are zero-padded to one per worker). The conv kernels are the matrices
  (``(kh kw c_in, c_out)``); BatchNorm vectors and the 512 x 10 classifier go
  to the scalar AdamW (by the Dion paper's advice for the output head).
  A second table *projects* (``jd.project_step_time``, ring model, 1 Gbit/s
  per worker, 50 us per round) the communication seconds of each update:
  a projection, not a measurement, and without compute.
* ``b``, link time (a *measurement*): one update of those shapes at
  1 Gbit/s, 2 processes, gloo over TCP, on the shaped loopback of
  ``shaped_link.py`` (``unshare --net`` + ``tc``; needs root) -- the harness
  and the tables of ``bench_network.py``, run with this file's methods
  (``--network``; every option after it goes to that harness, e.g.
  ``--rates 1gbit --repeats 7``). Every update is followed by
  ``sgd(0.1, momentum=0.9)``, as ``bench_network.py``'s rows are.
* ``c``, optimizer-state memory: bytes of optimizer state on the fullest
  device of the 2 x 4 (``"data"``, ``"fsdp"``) mesh of 8 simulated CPU devices
  for ``examples/lm.py``'s byte-level GPT (``--lm-dim``, ``--lm-depth``), its
  parameters sharded over ``"fsdp"`` by their partition specs (the example's
  :class:`Trainer`, i.e. :func:`jaxopt_dist.data_parallel_step` with
  ``param_specs``), read off the device buffers after ``init``.
* ``d``, work split: our Muon against ``optax.contrib.muon`` after an
  all-reduce, on ``--stack`` (16) matrices of 256 x 256, with ``W`` = 2, 4, 8
  workers on a 1-D ``"data"`` mesh: momentum bytes per device (device
  buffers after ``init``), and the per-device FLOPs of the compiled update
  (XLA's ``cost_analysis`` of the SPMD-partitioned program). The simulated
  devices share the machine's cores, so a device's wall time cannot show the
  ``1 / W`` split; the FLOPs do. The wall-time columns (median of 3) are of the
  whole program, every simulated device's work on the same cores: they show
  the total work, which optax's replicated Newton-Schulz multiplies by ``W``.
* ``e``, DiLoCo / MuLoCo: ``jd.diloco`` with each of our Muon, Dion (1/4)
  and Dion2 as the inner optimizer (Nesterov outer step), dense and with the
  2-bit ``statistical_quantize`` outer exchange (MuLoCo's), 6 steps of the
  small MLP on digits on 2 workers: the loss is finite and falls. The inner
  optimizer's own collectives run over the same data axis at every inner
  step (the bytes column shows them): accepted, but not low-communication.

Run::

    python benchmarks/bench_orthonormal.py                  # parts a, c, d, e (a few minutes)
    python benchmarks/bench_orthonormal.py --parts a
    sudo python benchmarks/bench_orthonormal.py --network --rates 1gbit --repeats 7 --torch-methods ''

``muon`` and ``dion2`` are imported from ``jaxopt_dist._src`` until they are
exported.
"""

from __future__ import annotations

import math
import pathlib
import sys
import time
from typing import Any

if not {"--network", "--jax-worker"} & set(sys.argv[1:]):  # the network harness configures jax itself
    import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads

RESNET_WIDTH = 64
LINK_GBPS, LINK_LATENCY_US = 1.0, 50.0  # the projection of part a's second table
NETWORK_METHODS = ("dense", "muon", "dion1", "dion4", "dion16", "dion2")
MUON_LR, DION_LR = 0.02, 0.02


# ----------------------------------------------------------------------------
# The methods (imports of jax inside: the network launcher must not load it).


def _orth_libs() -> tuple[Any, Any]:
    """Where ``muon`` and ``dion2`` come from: the package (``jd.muon``, ``jd.dion2``)."""
    import jaxopt_dist as jd

    return jd, jd


def _leaf_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def resnet_dims(params: Any) -> Any:
    """Muon's dimension numbers for the ResNet-18 tree: conv kernels ``(kh kw c_in, c_out)``, else None."""
    import jax
    import optax

    def dims(path: tuple, x: Any) -> Any:
        if len(x.shape) == 4:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3)
        return None

    return jax.tree_util.tree_map_with_path(dims, params)


def resnet_scalar_mask(params: Any) -> Any:
    """Dion's ``scalar_mask``: the classifier goes to the scalar optimizer (vectors go there anyway)."""
    import jax

    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path).startswith("head/"), params)


def orthonormal_methods(n: int) -> dict[str, tuple[str, Any]]:
    """Name -> (label, factory of the full optimizer) for ``n`` workers, ResNet-18's matrices."""
    import optax

    import jaxopt_dist as jd

    muon_lib, dion2_lib = _orth_libs()

    def dion(f: float) -> Any:
        return lambda: jd.dion(DION_LR, rank_fraction=f, scalar_mask=resnet_scalar_mask)

    return {
        "dense": ("all_reduce() + AdamW", lambda: optax.chain(jd.all_reduce(), optax.adamw(1e-3))),
        "muon_optax": (
            "all_reduce() + optax.contrib.muon",
            lambda: optax.chain(
                jd.all_reduce(), optax.contrib.muon(MUON_LR, muon_weight_dimension_numbers=resnet_dims)
            ),
        ),
        "muon": (
            "Muon, distributed (ours)",
            lambda: muon_lib.muon(MUON_LR, num_workers=n, muon_weight_dimension_numbers=resnet_dims),
        ),
        "dion1": ("Dion rank 1", dion(1.0)),
        "dion4": ("Dion rank 1/4", dion(0.25)),
        "dion16": ("Dion rank 1/16", dion(1 / 16)),
        "dion2": (
            "Dion2 fraction 1/4",
            lambda: dion2_lib.dion2(
                DION_LR, fraction=0.25, num_workers=n, weight_dimension_numbers=resnet_dims
            ),
        ),
    }


# ----------------------------------------------------------------------------
# (a) bytes per step.


def _split_share(params: Any, n: int) -> float:
    """The share of the matrices' entries our Muon / Dion2 split over ``n`` workers (the rest: every worker's)."""
    from jaxopt_dist._src import orthonormal as ortho

    plan = ortho.make_plan(params, resnet_dims, n, caller="bench", arg="muon_weight_dimension_numbers")
    real = sum(g.count * g.fan_in * g.fan_out for g in plan.groups)
    return sum(n * g.share * g.fan_in * g.fan_out for g in plan.groups) / real


def bytes_table(widths: tuple[int, ...]) -> None:
    import jax
    import jax.numpy as jnp
    from bench_compression import resnet18_cifar_shapes

    import jaxopt_dist as jd

    shapes = resnet18_cifar_shapes(RESNET_WIDTH)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    n_params = sum(math.prod(s) for s in shapes.values())
    print(
        f"\n## (a) bytes per step each worker sends over the data axis: ResNet-18 (CIFAR) shapes, "
        f"{n_params:,} float32 (communication_cost, traced; ring model)\n"
    )
    cols = ["method"]
    for w in widths:
        cols += [f"W={w} bytes/step", "x dense"]
    cols += ["collectives", *(f"split entries W={w}" for w in widths)]
    print(_common.markdown_header(cols, "l" + "rr" * len(widths) + "l" + "r" * len(widths)))
    rows: dict[str, list[Any]] = {}
    dense: dict[int, float] = {}
    for w in widths:
        for name, (label, make) in orthonormal_methods(w).items():
            cost = jd.communication_cost(make(), params, num_workers=w)
            dense.setdefault(w, cost.sent_bytes)
            kinds: dict[str, int] = {}
            for c in cost.steps[0].collectives:
                kinds[c.kind] = kinds.get(c.kind, 0) + 1
            row = rows.setdefault(name, [label, {}, ", ".join(f"{v} {k}" for k, v in kinds.items()), {}, {}])
            row[1][w] = cost.sent_bytes
            row[4][w] = float(
                jd.project_step_time(
                    cost, num_workers=w, bandwidth_gbps=LINK_GBPS, latency_us=LINK_LATENCY_US
                )
            )
            row[3][w] = f"{_split_share(params, w):.2f}" if name in ("muon", "dion2") else "-"
    for label, sent, kinds, pads, _ in rows.values():
        cells = [label]
        for w in widths:
            cells += [_common.fmt_bytes(sent[w]), f"{sent[w] / dense[w]:.3f}"]
        print(_common.markdown_row([*cells, kinds, *(pads[w] for w in widths)]))
    print(
        f"\n## (b, projected) communication seconds per update at {LINK_GBPS:g} Gbit/s per worker, "
        f"{LINK_LATENCY_US:g} us per round (project_step_time, ring; a PROJECTION, not a measurement; "
        "compute not included)\n"
    )
    cols = ["method"]
    for w in widths:
        cols += [f"W={w} comm s", "dense / this"]
    print(_common.markdown_header(cols, "l" + "rr" * len(widths)))
    dense_s = {w: next(iter(rows.values()))[4][w] for w in widths}
    for label, _, _, _, secs in rows.values():
        cells = [label]
        for w in widths:
            cells += [f"{secs[w]:.3f}", f"{dense_s[w] / secs[w]:.2f}"]
        print(_common.markdown_row(cells))


# ----------------------------------------------------------------------------
# (c) optimizer-state memory per device on the 2 x 4 mesh.


def memory_table(dim: int, depth: int) -> None:
    import jax
    from bench_lm import lm

    names = {
        "dense": "AdamW (all-reduce)",
        "muon_optax": "optax.contrib.muon (all-reduce)",
        "muon": "Muon, distributed (ours)",
        "dion": "Dion rank 1/4",
        "dion2": "Dion2 fraction 1/4",
    }
    args = lm.parser().parse_args(
        ["--dim", str(dim), "--depth", str(depth), "--heads", "4", "--context", "128", "--steps", "10"]
    )
    cfg = lm.config(args)
    rows = []
    for name, label in names.items():
        trainer = lm.Trainer(name, cfg, args)
        params, state = trainer.init(0)
        p_dev, s_dev = lm.per_device_bytes(params), lm.per_device_bytes(state)
        s_total = sum(x.nbytes for x in jax.tree.leaves(state))
        rows.append((label, trainer.num_params, p_dev, s_dev, s_total))
    print(
        f"\n## (c) optimizer state per device: byte-level GPT (dim {dim}, {depth} blocks, {rows[0][1]:,} "
        f"float32 parameters), mesh 2 ('data') x 4 ('fsdp'), parameters sharded over 'fsdp' "
        f"(examples/lm.py's Trainer, data_parallel_step(param_specs=...)), read off the device buffers\n"
    )
    print(
        _common.markdown_header(
            [
                "optimizer",
                "params/device",
                "opt state/device (fullest)",
                "x AdamW",
                "opt state, logical size",
            ],
            "lrrrr",
        )
    )
    adamw = rows[0][3]
    for label, _, p_dev, s_dev, s_total in rows:
        print(
            _common.markdown_row(
                [
                    label,
                    _common.fmt_bytes(p_dev),
                    _common.fmt_bytes(s_dev),
                    f"{s_dev / adamw:.2f}",
                    _common.fmt_bytes(s_total),
                ]
            )
        )


# ----------------------------------------------------------------------------
# (d) momentum bytes and Newton-Schulz FLOPs per device, W = 2, 4, 8.


def _compiled_flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", math.nan))


def owner_table(stack: int, size: int, widths: tuple[int, ...]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    muon_lib, _ = _orth_libs()
    P = jax.sharding.PartitionSpec
    params = {f"w{i:02d}": jnp.zeros((size, size), jnp.float32) for i in range(stack)}
    print(
        f"\n## (d) Muon's work split: {stack} matrices of {size} x {size} float32, 1-D 'data' mesh of W "
        "simulated CPU devices; momentum bytes per device off the device buffers, FLOPs per device from "
        "XLA's cost_analysis of the compiled (SPMD-partitioned) update\n"
    )
    print(
        _common.markdown_header(
            [
                "W",
                "momentum/device optax",
                "ours",
                "ratio",
                "update FLOPs/device optax",
                "ours",
                "ratio",
                "wall ms optax",
                "ours",
            ],
            "rrrrrrrrr",
        )
    )
    for w in widths:
        mesh = _common.data_mesh(w)
        rng = np.random.default_rng(0)
        grads = {k: jnp.asarray(rng.standard_normal((w, size, size)), jnp.float32) for k in params}
        grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("data")))
        out = []
        for tx in (
            optax.chain(jd.all_reduce(), optax.contrib.muon(MUON_LR)),
            muon_lib.muon(MUON_LR, num_workers=w),
        ):
            state = jd.init_opt_state(tx, params, mesh=mesh)
            mask = jd.opt_state_placement(tx, params, mesh=mesh).per_worker
            s_spec = jax.tree.map(lambda m: P("data") if m else P(), mask)
            momentum = _momentum_bytes(state)

            def body(g, p, s, tx=tx, mask=mask):
                g = jax.tree.map(lambda x: x[0], g)
                s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), jax.tree.map(lambda x, m: x[None] if m else x, s, mask)

            p_spec = jax.tree.map(lambda _: P(), params)
            step = jax.jit(
                jax.shard_map(
                    body, mesh=mesh, in_specs=(P("data"), p_spec, s_spec), out_specs=(p_spec, s_spec)
                )
            )
            placed = jd.place_params(params, mesh=mesh)
            compiled = step.lower(grads, placed, state).compile()
            flops = _compiled_flops(compiled)
            jax.block_until_ready(compiled(grads, placed, state))
            t = []
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(grads, placed, state))
                t.append(time.perf_counter() - t0)
            out.append((momentum, flops, 1e3 * float(np.median(t))))
        (m_o, f_o, t_o), (m_u, f_u, t_u) = out
        print(
            _common.markdown_row(
                [
                    w,
                    _common.fmt_bytes(m_o),
                    _common.fmt_bytes(m_u),
                    f"{m_u / m_o:.3f}",
                    f"{f_o / 1e9:.3f} G",
                    f"{f_u / 1e9:.3f} G",
                    f"{f_u / f_o:.3f}",
                    f"{t_o:.0f}",
                    f"{t_u:.0f}",
                ]
            )
        )


def _momentum_bytes(state: Any) -> int:
    """Bytes on the fullest device of the state's matrix-shaped leaves (the momentum; Adam's vectors excluded)."""
    import jax

    totals: dict[Any, int] = {}
    for x in jax.tree.leaves(state):
        if x.ndim < 2:
            continue
        for sh in x.addressable_shards:
            totals[sh.device] = totals.get(sh.device, 0) + sh.data.nbytes
    return max(totals.values(), default=0)


# ----------------------------------------------------------------------------
# (e) DiLoCo / MuLoCo with an orthonormal inner optimizer.


def diloco_check(steps: int = 6, sync_every: int = 3) -> None:
    import numpy as np
    import optax

    import jaxopt_dist as jd

    n = 2
    mesh = _common.data_mesh(n)
    x, y, _, _ = _common.load_digits()
    params = _common.mlp_init()
    # axis_name=None: each worker's own optimizer, no communication in the inner steps (with the data
    # axis bound they would reject the per-worker parameters).
    inners = {
        "Muon, local": lambda: jd.muon(MUON_LR, adam_learning_rate=1e-2, axis_name=None),
        "Dion rank 1/4, local": lambda: jd.dion(DION_LR, rank_fraction=0.25, axis_name=None),
        "Dion2 fraction 1/4, local": lambda: jd.dion2(DION_LR, axis_name=None),
    }
    outers = {
        "DiLoCo": {},
        "MuLoCo (2-bit outer)": {"aggregate": jd.statistical_quantize(2)},
    }
    print(
        f"\n## (e) jd.diloco with an orthonormal inner optimizer: digits MLP (2,410 params), {n} workers, "
        f"{steps} steps, sync every {sync_every}, Nesterov outer SGD 0.7\n"
    )
    print(
        _common.markdown_header(
            ["inner", "outer", "loss step 1", f"loss step {steps}", "finite", "bytes/step"], "llrrlr"
        )
    )
    batch = 64 * n
    for iname, inner in inners.items():
        for oname, kw in outers.items():
            tx = jd.diloco(
                inner(), sync_every=sync_every, outer=optax.sgd(0.7, momentum=0.9, nesterov=True), **kw
            )
            step = jd.data_parallel_step(_common.mlp_loss, tx, mesh=mesh, per_worker_params=True)
            p, s = step.init(params)
            losses = []
            try:
                for t in range(steps):
                    i = (t * batch) % (len(y) - batch)
                    p, s, metrics = step(p, s, {"x": x[i : i + batch], "y": y[i : i + batch]})
                    losses.append(float(metrics["loss"]))
                cost = jd.communication_cost(tx, params, num_workers=n, steps=2 * sync_every)
                finite = all(np.isfinite(losses))
                cells = [
                    f"{losses[0]:.4f}",
                    f"{losses[-1]:.4f}",
                    "yes" if finite else "NO",
                    _common.fmt_bytes(cost.sent_bytes),
                ]
            except Exception as e:  # noqa: BLE001 -- reported in the table
                cells = ["-", "-", f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}", "-"]
            print(_common.markdown_row([iname, oname, *cells]))


# ----------------------------------------------------------------------------
# (b) link time: bench_network.py's harness with this file's methods.


def _network_workers(argv: list[str]) -> int:
    """The number of workers of a network run: ``--num-processes`` (a worker) or ``--procs`` (the launcher)."""
    for flag in ("--num-processes", "--procs"):
        if flag in argv:
            return int(argv[argv.index(flag) + 1])
    return 2


def network_main(argv: list[str]) -> int:
    import bench_network as bn

    argv = [a for a in argv if a != "--network"]
    n = _network_workers(argv)

    current: list[str] = []

    def methods(jd: Any, jnp: Any) -> dict[str, Any]:
        del jd, jnp  # (factories built here; they import jax, after the harness has configured it)

        def remembered(name: str, make: Any) -> Any:
            return lambda: (current.append(name), make())[1]

        table = orthonormal_methods(n)
        return {k: (table[k][0], remembered(k, table[k][1])) for k in NETWORK_METHODS}

    update_step = bn._update_step

    def _update_step(jax: Any, optax: Any, jd: Any, tx: Any, params: Any, mesh: Any) -> Any:
        # The harness's compute-only step runs the update on a one-device mesh of each worker's own:
        # Muon and Dion2 are built for a number of workers, so that step gets the one-worker build
        # (which orthogonalises every matrix itself: an upper bound on a linked worker's compute).
        if mesh.shape["data"] != n and current:
            make = orthonormal_methods(mesh.shape["data"])[current[-1]][1]
            tx = optax.chain(make(), jd.sgd(bn.LR, momentum=bn.MOMENTUM))
        return update_step(jax, optax, jd, tx, params, mesh)

    def names(jd: Any, jnp: Any) -> dict[str, Any]:
        del jd, jnp  # the launcher lists the names before any jax import: factories unused
        return {k: (k, None) for k in NETWORK_METHODS}

    bn.SCRIPT = pathlib.Path(__file__).resolve()
    bn.methods = methods if "--jax-worker" in argv else names
    bn._update_step = _update_step
    if "--jax-worker" not in argv:
        # traced_costs (the projections of the table) runs in the launcher after the workers: real factories.
        original = bn.traced_costs

        def traced_costs(res: dict[str, Any]) -> dict[str, Any]:
            bn.methods = methods
            return original(res)

        bn.traced_costs = traced_costs
    return bn.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--network" in argv or "--jax-worker" in argv:
        return network_main(argv)
    ap = _common.parser(__doc__, "small sizes (smoke test)")
    ap.add_argument("--parts", default="a,c,d,e", help="comma-separated subset of a,c,d,e (b: --network)")
    ap.add_argument("--workers", default="2,8", help="comma-separated worker counts of part a")
    ap.add_argument("--lm-dim", type=int, default=256, help="the GPT's width in part c")
    ap.add_argument("--lm-depth", type=int, default=4, help="the GPT's blocks in part c")
    ap.add_argument("--stack", type=int, default=16, help="matrices in part d")
    ap.add_argument("--size", type=int, default=256, help="matrix side in part d")
    ap.add_argument("--network", action="store_true", help="part b: bench_network.py's harness (see above)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if bad := [p for p in parts if p not in "acde"]:
        ap.error(f"--parts: unknown {bad}")
    if args.quick:
        args.lm_dim, args.lm_depth, args.stack, args.size = 64, 2, 8, 64
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    t0 = time.time()
    if "a" in parts:
        bytes_table(tuple(int(w) for w in args.workers.split(",")))
    if "c" in parts:
        memory_table(args.lm_dim, args.lm_depth)
    if "d" in parts:
        owner_table(args.stack, args.size, (2, 4, 8))
    if "e" in parts:
        diloco_check()
    print(f"\n{time.time() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
