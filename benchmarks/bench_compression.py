"""What do the compressors send, and what do they cost to run, on ResNet-18's gradients?

For the gradient shapes of a CIFAR ResNet-18 (11,173,962 parameters, Flax/JAX
layout: conv kernels ``(kh, kw, in, out)``, dense ``(in, out)``, BatchNorm
scale and bias; listed in :func:`resnet18_cifar_shapes`) and 8 workers, a
first table gives each method's bytes per worker and step on the full model
(``communication_cost`` only, nothing runs), then each row of the second
table, on the compiled update, gives

* ``B/step``: bytes each worker sends per step, from ``communication_cost``
  (steady state, averaged over a period for alternating schemes);
* ``program B``: bytes sent by all the collectives of the compiled update,
  every branch of a ``lax.cond`` counted once, read two ways: from the traced
  jaxpr (``cost.sites``) and from the compiled HLO text
  (``jax.jit(...).lower(...).compile().as_text()`` under ``jax.shard_map`` on
  8 CPU devices); ``match`` says whether they agree element for element per
  collective kind (XLA:CPU runs 16-bit all-reduces in f32, so the bf16 row's
  HLO bytes are the f32 ones; elements are compared);
* ``ratio``: dense all-reduce bytes / ``B/step``;
* ``ms``: compress + aggregate time of one update on 8 CPU devices (median
  of repeated runs after compilation, same process), and ``x dense``: that
  time over plain ``all_reduce``'s.

Then PowerSGD's ratios are checked against the paper's accounting (Vogels et
al. 2019, ResNet-18 on CIFAR-10: 243x / 136x / 72x at rank 1 / 2 / 4,
+-2%), always on the full-size shapes. If ``torch`` is importable, the
per-step maths of PyTorch's ``powerSGD_hook`` (error feedback, batching by
shape, Gram-Schmidt, the three matmuls; no process group, so no
communication) is re-implemented in torch on CPU and timed on the same shapes
against our update on one device; the ratio ours / theirs has a target of
<= 0.5.

Run: ``python benchmarks/bench_compression.py`` (``--quick``: channel widths
divided by 8 for the compiled/timed parts and 3 repeats; the first table and
the paper check stay full size; at that tiny size per-op overheads dominate,
so the torch comparison is meaningful only in the full run). Timings are only
meaningful on a quiet machine.
"""

from __future__ import annotations

import math
import statistics
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np

import jaxopt_dist as jd

P = jax.sharding.PartitionSpec
N_WORKERS = _common.N_WORKERS
PAPER_RATIOS = {1: 243.0, 2: 136.0, 4: 72.0}


def resnet18_cifar_shapes(width: int = 64) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the CIFAR ResNet-18 (3x3 stem, no max-pool), Flax layout.

    With ``width=64`` (the standard model) there are 11,173,962 parameters:
    a 3x3x3x64 stem, four stages of two BasicBlocks (64, 128, 256, 512
    channels; stride 2 and a 1x1 projection shortcut at the start of stages
    2-4), BatchNorm scale/bias after every conv, and a 512x10 classifier.
    """
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name, k, cin, cout):
        shapes[f"{name}/kernel"] = (k, k, cin, cout)

    def bn(name, c):
        shapes[f"{name}/scale"] = (c,)
        shapes[f"{name}/bias"] = (c,)

    conv("stem/conv", 3, 3, width)
    bn("stem/bn", width)
    cin = width
    for stage, mult in enumerate((1, 2, 4, 8)):
        cout = width * mult
        for block in range(2):
            name = f"stage{stage + 1}/block{block + 1}"
            stride = 2 if (block == 0 and stage > 0) else 1
            conv(f"{name}/conv1", 3, cin, cout)
            bn(f"{name}/bn1", cout)
            conv(f"{name}/conv2", 3, cout, cout)
            bn(f"{name}/bn2", cout)
            if stride != 1 or cin != cout:
                conv(f"{name}/shortcut", 1, cin, cout)
                bn(f"{name}/shortcut_bn", cout)
            cin = cout
    shapes["head/kernel"] = (8 * width, 10)
    shapes["head/bias"] = (10,)
    return shapes


def methods() -> dict[str, object]:
    """Label -> factory."""
    out: dict[str, object] = {
        "dense (all_reduce)": lambda: jd.all_reduce(),
        "bf16 all_reduce": lambda: jd.all_reduce(dtype=jnp.bfloat16),
        "top-k 1%": lambda: jd.top_k(density=0.01),
        "random-k 1%": lambda: jd.random_k(density=0.01),
        "sign (majority vote)": lambda: jd.sign_majority_vote(),
        "EF-sign (scaled)": lambda: jd.scaled_sign(),
        "QSGD 16 levels": lambda: jd.qsgd(16),
    }
    for rank in (1, 2, 4):
        out[f"PowerSGD r{rank}"] = lambda rank=rank: jd.powersgd(rank)
        out[f"PowerSGD r{rank} 1-allreduce"] = lambda rank=rank: jd.powersgd(rank, one_allreduce=True)
    return out


# ----------------------------------------------------------------------------
# Compiled update on the mesh.


def build_step(tx, params, mesh):
    """A jitted shard_map of one ``tx.update`` with placed inputs: (fn, args)."""
    n = mesh.shape["data"]
    placement = jd.opt_state_placement(tx, params, mesh=mesh)
    mask = placement.per_worker
    state = jd.init_opt_state(tx, params, mesh=mesh)
    p = jd.place_params(params, mesh=mesh)
    key = jax.random.PRNGKey(0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    grads = jax.tree.unflatten(
        treedef, [jax.random.normal(k, (n, *x.shape), x.dtype) * 1e-2 for k, x in zip(keys, leaves)]
    )
    grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("data")))
    s_spec = jax.tree.map(lambda m: P("data") if m else P(), mask)
    p_spec = jax.tree.map(lambda _: P(), params)

    def body(g, s, p):
        g = jax.tree.map(lambda x: x[0], g)
        s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
        u, s = tx.update(g, s, p)
        return u, jax.tree.map(lambda x, m: x[None] if m else x, s, mask)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("data"), s_spec, p_spec), out_specs=(p_spec, s_spec))
    )
    return fn, (grads, state, p)


def time_call(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hlo_program_bytes(fn, args) -> tuple[float, dict]:
    hlo = jd.hlo_collectives(fn.lower(*args).compile().as_text())
    elements: dict = {}
    for h in hlo:
        elements[h.kind] = elements.get(h.kind, 0) + h.payload_elements
    return sum(h.sent_bytes() for h in hlo), elements


def site_elements(cost) -> dict:
    out: dict = {}
    for c in cost.sites:
        out[c.kind] = out.get(c.kind, 0) + c.payload_elements
    return out


# ----------------------------------------------------------------------------
# PyTorch's powerSGD_hook maths (one worker, no communication).


def torch_powersgd_step_fn(
    shapes: dict[str, tuple[int, ...]],
    rank: int,
    *,
    batch_same_shape: bool,
    min_compression_rate: float = 2.0,
):
    """A faithful re-implementation of one step of ``powerSGD_hook``'s local maths.

    Works in place on one flat bucket holding every gradient (as DDP's hook
    sees it), in PyTorch's layout (``weight.view(out, -1)``): add the error,
    keep a copy, split into compressed/uncompressed tensors with the hook's
    ``_should_compress`` rule, group matrices by shape (stacked when
    ``batch_same_shape``, PyTorch's ``batch_tensors_with_same_shape``),
    orthogonalize the warm-started Q's with the hook's own ``_orthogonalize``
    (Gram-Schmidt for rank <= 2, QR above), P = M Q, orthogonalize P,
    Q = M^T P, M ~ P Q^T written back, error = copy - result. The all-reduces
    of P, Q and the uncompressed tensors are the identity for one process and
    are skipped.
    """
    import torch

    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
    except ImportError:  # pragma: no cover
        _orthogonalize = None

    def torch_shape(s):  # Flax (kh, kw, in, out) / (in, out) -> PyTorch (out, in, kh, kw) / (out, in)
        if len(s) == 4:
            return (s[3], s[2], s[0], s[1])
        if len(s) == 2:
            return (s[1], s[0])
        return s

    tshapes = [torch_shape(s) for s in shapes.values()]
    sizes = [math.prod(s) for s in tshapes]
    gen = torch.Generator().manual_seed(0)
    bucket = torch.randn(sum(sizes), generator=gen) * 1e-2
    error = torch.zeros_like(bucket)
    offsets = np.cumsum([0, *sizes])
    by_shape: dict = {}
    for s, a, b in zip(tshapes, offsets[:-1], offsets[1:]):
        if len(s) < 2:
            continue
        n, m = s[0], math.prod(s[1:])
        r = min(n, m, rank)
        if r * (n + m) * min_compression_rate < n * m:  # the hook's rule (strict)
            by_shape.setdefault((n, m, r), []).append((int(a), int(b)))
    batches = []
    for (n, m, r), spans in by_shape.items():
        chunks = [spans] if batch_same_shape else [[span] for span in spans]
        for chunk in chunks:
            batches.append((n, m, chunk, torch.randn(len(chunk), m, r, generator=gen)))

    def step():
        inp = bucket
        inp.add_(error)
        inp_cp = torch.clone(inp).detach()
        work = []
        for n, m, spans, q in batches:
            if len(spans) == 1:
                a, b = spans[0]
                mats = inp[a:b].view(1, n, m)
            else:
                mats = torch.stack([inp[a:b].view(n, m) for a, b in spans])
            _orthogonalize(q, 0)
            work.append((mats, q, torch.bmm(mats, q), spans))
        # all_reduce(uncompressed), all_reduce(P's) would run here
        for mats, q, p, _ in work:
            _orthogonalize(p, 0)
            torch.bmm(mats.transpose(1, 2), p, out=q)
        # all_reduce(Q's) / world_size would run here
        for mats, q, p, spans in work:
            if len(spans) == 1:
                torch.bmm(p, q.transpose(1, 2), out=mats)
            else:
                approx = torch.bmm(p, q.transpose(1, 2))
                for j, (a, b) in enumerate(spans):
                    inp[a:b].copy_(approx[j].reshape(-1))
        error.copy_(inp_cp - inp)
        return inp

    return step


def time_torch(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------


def time_torch_hook(shapes, repeats: int) -> dict[int, tuple[float, float]] | None:
    """Median seconds of the hook's maths per rank: (per tensor, batched by shape), or None.

    Run before any JAX computation: once XLA:CPU has run in this process the
    main thread computes with flushed denormals, which makes PyTorch's CPU
    kernels here many times slower and the comparison meaningless.
    """
    try:
        import torch
    except ImportError:
        return None
    torch.set_flush_denormal(False)
    out = {}
    for rank in (1, 2, 4):
        per_tensor = time_torch(torch_powersgd_step_fn(shapes, rank, batch_same_shape=False), repeats)
        batched = time_torch(torch_powersgd_step_fn(shapes, rank, batch_same_shape=True), repeats)
        out[rank] = (per_tensor, batched)
    return out


def main() -> None:
    parser = _common.parser(__doc__, quick_help="1/8 channel widths for the timed parts, 3 repeats")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per method (default 10, quick 3)"
    )
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 10)
    width = 8 if args.quick else 64

    full = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in resnet18_cifar_shapes(64).items()}
    n_full = sum(math.prod(x.shape) for x in full.values())
    shapes = resnet18_cifar_shapes(width)
    torch_times = time_torch_hook(shapes, repeats)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    n_params = sum(math.prod(s) for s in shapes.values())
    print(f"ResNet-18 (CIFAR) gradient shapes, Flax layout: {len(full)} leaves, {n_full:,} parameters")
    for name, s in resnet18_cifar_shapes(64).items():
        print(f"  {name:<32}{s!s:>20}")
    print()

    print(f"bytes per worker and step on the full model ({n_full:,} parameters), {N_WORKERS} workers:")
    head = f"{'method':<26}{'B/step':>12}{'collectives':>13}{'ratio':>10}"
    print(head)
    print("-" * len(head))
    for label, make in methods().items():
        cost = jd.communication_cost(make(), full, num_workers=N_WORKERS)
        kinds = "+".join(sorted(cost.by_kind()))
        print(
            f"{label:<26}{_common.fmt_bytes(cost.sent_bytes):>12}{kinds:>13}{cost.compression_ratio:>9.1f}x"
        )
    print()

    mesh = _common.data_mesh(N_WORKERS)
    print(
        f"compiled update on {'the width-8 model (' if args.quick else 'the full model ('}"
        f"{n_params:,} parameters), {N_WORKERS} workers, {jax.device_count()} CPU devices, "
        f"median of {repeats} runs:"
    )
    header = (
        f"{'method':<26}{'B/step':>12}{'program B':>12}{'HLO B':>12}{'match':>7}{'ratio':>9}"
        f"{'ms':>9}{'x dense':>9}"
    )
    print(header)
    print("-" * len(header))
    dense_ms = None
    for label, make in methods().items():
        tx = make()
        cost = jd.communication_cost(tx, params, num_workers=N_WORKERS)
        fn, fargs = build_step(tx, params, mesh)
        hlo_bytes, hlo_elems = hlo_program_bytes(fn, fargs)
        program = sum(c.sent_bytes() for c in cost.sites)
        match = "yes" if hlo_elems == site_elements(cost) else "NO"
        ms = 1e3 * time_call(fn, fargs, repeats)
        if dense_ms is None:
            dense_ms = ms
        print(
            f"{label:<26}{_common.fmt_bytes(cost.sent_bytes):>12}{_common.fmt_bytes(program):>12}{_common.fmt_bytes(hlo_bytes):>12}"
            f"{match:>7}{cost.compression_ratio:>8.1f}x{ms:>9.2f}{ms / dense_ms:>9.2f}"
        )
        del fn, fargs
    print(
        "\nB/step: steady state per step; program/HLO B: every collective in the compiled update once "
        "(both half steps of 1-allreduce)."
    )

    print("\nPowerSGD compression ratio on the full ResNet-18 vs the paper (Vogels et al. 2019, Table 6):")
    all_ok = True
    for rank, paper in PAPER_RATIOS.items():
        ratio = jd.communication_cost(jd.powersgd(rank), full, num_workers=N_WORKERS).compression_ratio
        one = jd.communication_cost(
            jd.powersgd(rank, one_allreduce=True), full, num_workers=N_WORKERS
        ).compression_ratio
        ok = abs(ratio / paper - 1) <= 0.02
        all_ok &= ok
        print(
            f"  rank {rank}: {ratio:7.2f}x  paper {paper:.0f}x  {'PASS' if ok else 'FAIL'} (+-2%)"
            f"   [one_allreduce: {one:.2f}x per step on average]"
        )
    print(f"  overall: {'PASS' if all_ok else 'FAIL'}")

    if torch_times is None:
        print("\ntorch not importable: skipping the comparison with PyTorch's powerSGD_hook maths.")
        return
    import torch

    print(
        f"\nPowerSGD compression maths, one worker, {n_params:,} parameters: ours (jit, 1 CPU device) vs "
        f"PyTorch {torch.__version__} powerSGD_hook maths ({torch.get_num_threads()} threads, timed first, "
        f"before any XLA computation); target ours/theirs <= 0.5"
    )
    mesh1 = _common.data_mesh(1)
    for rank, (per_tensor, batched) in torch_times.items():
        fn, fargs = build_step(jd.powersgd(rank), params, mesh1)
        ours = time_call(fn, fargs, repeats)
        theirs = min(per_tensor, batched)  # the hook's faster setting
        verdict = "met" if ours / theirs <= 0.5 else "not met"
        print(
            f"  rank {rank}: ours {1e3 * ours:8.2f} ms   torch {1e3 * per_tensor:8.2f} ms per tensor, "
            f"{1e3 * batched:8.2f} ms batched   ours/theirs {ours / theirs:5.2f} ({verdict})"
        )


if __name__ == "__main__":
    main()
