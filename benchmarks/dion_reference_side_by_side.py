"""Side by side: microsoft/dion (torch, gloo, 2 and 4 processes) against jaxopt_dist's Dion, Muon, Dion2.

What runs:

* **Reference.** ``dion/dion_reference.py`` (``DionReference``), ``dion/dion.py`` (the batched
  async ``Dion``), ``dion/muon.py`` and ``dion/dion2.py`` of `microsoft/dion
  <https://github.com/microsoft/dion>`_ at commit ``0a059a4`` (MIT), imported at run time from
  ``--reference`` (a checkout; by default the local mirror is extracted to a temporary directory)
  and never copied into this repository. Torch on CPU, eager (``TORCHDYNAMO_DISABLE=1``, so their
  ``@torch.compile`` is a no-op), gloo on loopback, ``W`` = 2 and 4 subprocesses
  (``benchmarks/_dion_reference_worker.py``). Per-rank parameters, ``Q`` and momentum of every
  step are saved to ``<workdir>/W<W>/rank<r>.npz``.
* **Dion layouts.** ``replicated`` (DDP: parameters replicated, every process feeds its own
  gradient, ``replicate_mesh=WORLD``; Dion all-reduces the gradient or, when compressed, ``P`` and
  ``R``); ``fsdp`` (parameter, gradient, momentum and ``Q`` are DTensors sharded ``Shard(d)`` over
  the ``W`` processes, ``outer_shard_mesh``; the gradient is the mean over processes, as FSDP2's
  reduce-scatter leaves it); ``hsdp`` (``W=4`` as a 2 x 2 mesh: ``Shard(d)`` inside each pair,
  Dion's replicate mesh across pairs, compressed).
* **Dion matrices** (torch layout ``(d_out, d_in)``): tall ``64x32``, wide ``32x64``, square
  ``48x48``, at ``rank_fraction`` 1 (gradient all-reduce) and 0.25 (compressed exchange of ``P``
  and ``R``), 6 steps, ``lr=0.01, mu=0.95, weight_decay=0.01, eps=1e-8``, float32; the gradients
  are a shared rank-2 signal plus per-process noise, from a seeded generator.
* **NumPy loop** written from the rule in FRONTIER.md (float64, plain QR), run in the
  reference's orientation: validates the harness and the rule.
* **Ours.** ``jaxopt_dist``'s ``dion`` under ``jax.vmap(axis_name="data")`` (or
  ``--backend shard_map``) with ``W`` workers on the Flax layout ``K = X^T``, the same initial
  parameters, per-worker gradients and initial ``Q`` (written into ``DionState.q``). Under
  FSDP/HSDP the reference sees the mean gradient (one logical worker per replica group); ours
  gets the per-process gradients, so ``X`` must agree by the linearity of the compressed
  exchange and ``mean_i M_i`` must equal the reference's momentum.
* **Muon and Dion2** (second table): six matrices (three ``64x32``, two ``32x64``, one
  ``48x48``) so that the reference spreads the Newton-Schulz work over the ranks, gradients
  averaged (DDP) or ``Shard(0)`` DTensors (FSDP2, all-to-all). Muon is checked against
  ``optax.contrib.muon`` on the mean gradient and against ours; Dion2 against a NumPy loop of
  FRONTIER.md's Dion2 rule (and ours once ``jaxopt_dist._src.dion2`` exists).

Orientation. The reference transposes when ``d_out < d_in`` except under sharding, where the
sharded dimension decides (``Shard(0)`` -> transposed, ``Shard(1)`` -> not). Ours decides by
shape only. The ``fsdp`` rows are therefore run with both shard dims: the one in which both
orientations coincide (tall/square ``Shard(1)``, wide ``Shard(0)``) and the other (FSDP2's
default ``Shard(0)`` on tall/square matrices), where a difference is expected and reported, not
a failure; ours gives the same numbers in every layout. Dion2 likewise selects rows under
``Shard(0)`` whatever the shape, and by default (``selection_scope="local"``) takes the top-k
rows of each shard rather than of the whole matrix.

Patches to the reference at run time (nothing on disk is changed):

* ``torch.distributed.tensor.randn`` fails on a CPU mesh (DTensor's RNG tracker wants a CUDA-like
  device). The name ``dtensor_randn`` in the imported Dion modules is replaced by a seeded
  full-tensor draw plus ``distribute_tensor``. It feeds only the initial ``Q`` of sharded
  parameters (overwritten, next point) and the random sketch of the randomised Cholesky QR, whose
  output is the QR factor with a positive diagonal whatever the sketch.
* ``Dion._init_opt_state_dion`` is wrapped: after the original builds the state, ``Q`` is
  replaced by the harness's ``Q0`` (same shape and placements), so all runs start from one ``Q``.
* Muon/Dion2 ``f32`` rows only: the module's ``torch`` is a proxy on which ``torch.bfloat16``
  reads as ``float32`` (their casts of the exchanged momentum to bf16 become no-ops) and a
  float32 Newton-Schulz with the reference's "dion" coefficient table is passed as
  ``newton_schulz_func``. ``bf16`` rows run as shipped with ``use_polar_express=False`` (the same
  table in bf16); ``polar-express`` rows use the shipped default.

``Q`` is compared up to column signs (a QR's signs are a convention; the update does not
depend on them). A quirk found on the way: ``dion_reference.py`` decides whether to all-reduce
the gradient before the state (and with it the ``compressed_all_reduce`` flag) exists, so its
first step averages the gradient even when the exchange is compressed; ``X`` and the mean
momentum are unaffected, the per-worker momenta are not (``dion.py`` does not do this).

Run (about 4 minutes on 2 cores; ``--workers 2``, ``--algos dion`` make it shorter)::

    /tmp/v311/bin/python benchmarks/dion_reference_side_by_side.py
    /tmp/v311/bin/python benchmarks/dion_reference_side_by_side.py --reference ~/src/dion --per-step

Getting the reference: ``git clone https://github.com/microsoft/dion && git -C dion checkout
0a059a4``. It needs only ``torch`` (>= 2.7.1) and ``numpy``.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

REFERENCE_COMMIT = "0a059a4"
DEFAULT_MIRROR = "/work/.mirror/microsoft+dion/repo"
HOW_TO_GET = (
    "git clone https://github.com/microsoft/dion && git -C dion checkout "
    f"{REFERENCE_COMMIT}, then pass --reference dion"
)
HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {"tall": (64, 32), "wide": (32, 64), "square": (48, 48)}
RANK_FRACTIONS = (1.0, 0.25)
IMPLS = ("dion_reference", "dion")


@dataclass
class Case:
    key: str  # unique: name + impl + world
    name: str  # inputs key: shape + rank fraction + layout + world
    impl: str
    world: int
    shape: tuple[int, int]
    rank_fraction: float
    layout: str  # replicated | fsdp | hsdp
    shard_dim: int | None
    agree: bool  # whether the reference's orientation equals the shape rule
    steps: int
    lr: float = 0.01
    mu: float = 0.95
    weight_decay: float = 0.01
    eps: float = 1e-8


# ----------------------------------------------------------------------------- reference


def _locate_reference(path: str | None, mirror: str) -> str:
    """Returns a directory holding the ``dion`` package of microsoft/dion."""
    if path is not None:
        if not os.path.isfile(os.path.join(path, "dion", "dion_reference.py")):
            sys.exit(f"--reference {path!r} holds no dion/dion_reference.py. Get it with: {HOW_TO_GET}")
        try:
            head = subprocess.run(
                ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            if not head.startswith(REFERENCE_COMMIT):
                print(
                    f"warning: {path} is at {head[:12]}, the harness was written against {REFERENCE_COMMIT}"
                )
        except (subprocess.CalledProcessError, FileNotFoundError):
            print(f"warning: cannot check the commit of {path}; expected {REFERENCE_COMMIT}")
        return path
    if os.path.isdir(mirror):
        dest = tempfile.mkdtemp(prefix="msdion_")
        atexit.register(shutil.rmtree, dest, True)
        archive = subprocess.run(
            ["git", "-C", mirror, "archive", REFERENCE_COMMIT], capture_output=True, check=False
        )
        if archive.returncode != 0:
            archive = subprocess.run(
                ["git", "-C", mirror, "archive", "HEAD"], capture_output=True, check=True
            )
            print(f"warning: {REFERENCE_COMMIT} not in {mirror}; used its HEAD")
        tar_path = os.path.join(dest, "ref.tar")
        with open(tar_path, "wb") as f:
            f.write(archive.stdout)
        with tarfile.open(tar_path) as tf:
            tf.extractall(dest, filter="data")
        os.remove(tar_path)
        return dest
    sys.exit(
        f"microsoft/dion not found (no --reference and no mirror at {mirror}). Get it with: {HOW_TO_GET}"
    )


# ----------------------------------------------------------------------------- plan


def _rank(shape: tuple[int, int], rank_fraction: float) -> int:
    m, n = shape
    return min(m, n, math.ceil(rank_fraction * min(m, n)))


def _compressed(shape: tuple[int, int], rank_fraction: float) -> bool:
    m, n = shape
    r = _rank(shape, rank_fraction)
    return rank_fraction < 1 and (m + n) * r < m * n


def _shape_transposed(shape: tuple[int, int]) -> bool:
    return shape[0] < shape[1]


def _ref_transposed(case: Case) -> bool:
    if case.layout == "replicated":
        return _shape_transposed(case.shape)
    return case.shard_dim == 0


def build_plan(worlds: tuple[int, ...], steps: int, impls: tuple[str, ...]) -> list[Case]:
    cases = []
    for world in worlds:
        for sname, shape in SHAPES.items():
            agree_dim = 0 if _shape_transposed(shape) else 1
            for rf in RANK_FRACTIONS:
                layouts: list[tuple[str, int | None]] = [
                    ("replicated", None),
                    ("fsdp", agree_dim),
                    ("fsdp", 1 - agree_dim),
                ]
                if world == 4 and rf < 1:
                    layouts.append(("hsdp", agree_dim))
                for layout, sd in layouts:
                    tag = layout if sd is None else f"{layout}-S{sd}"
                    name = f"{sname}{shape[0]}x{shape[1]}_rf{rf:g}_{tag}_W{world}"
                    for impl in impls:
                        c = Case(
                            key=f"{name}_{impl}",
                            name=name,
                            impl=impl,
                            world=world,
                            shape=shape,
                            rank_fraction=rf,
                            layout=layout,
                            shard_dim=sd,
                            agree=True,
                            steps=steps,
                        )
                        c.agree = _ref_transposed(c) == _shape_transposed(shape)
                        cases.append(c)
    return cases


def build_inputs(cases: list[Case], seed: int) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for c in cases:
        if f"{c.name}/X0" in inputs:
            continue
        # Same X0/Q0 for every layout and world of one shape and rank fraction; gradients per world.
        m, n = c.shape
        r = _rank(c.shape, c.rank_fraction)
        base = np.random.default_rng([seed, m, n, int(1000 * c.rank_fraction)])
        inputs[f"{c.name}/X0"] = (base.standard_normal((m, n)) / math.sqrt(n)).astype(np.float32)
        inputs[f"{c.name}/Q0_T"] = base.standard_normal((m, r)).astype(np.float32)
        inputs[f"{c.name}/Q0_N"] = base.standard_normal((n, r)).astype(np.float32)
        grng = np.random.default_rng([seed, m, n, int(1000 * c.rank_fraction), c.world])
        g = grng.standard_normal((c.steps, c.world, m, n)).astype(np.float32)
        # A shared low-rank signal plus per-process noise, so the compressed exchange matters.
        u = grng.standard_normal((c.steps, 1, m, 2)).astype(np.float32)
        v = grng.standard_normal((c.steps, 1, 2, n)).astype(np.float32)
        inputs[f"{c.name}/G"] = (0.3 * g + u @ v).astype(np.float32)
    return inputs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_reference(
    cases: list[dict], inputs: dict, reference: str, workdir: str, timeout: float, reuse: bool = False
) -> dict:
    """Runs every case of each world size in one gloo group; returns ``{world: [rank npz]}``."""
    plan_path = os.path.join(workdir, "plan.json")
    inputs_path = os.path.join(workdir, "inputs.npz")
    with open(plan_path, "w") as f:
        json.dump(cases, f)
    np.savez(inputs_path, **inputs)
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out: dict[int, Any] = {}
    for world in sorted({c["world"] for c in cases}):
        wdir = os.path.join(workdir, f"W{world}")
        os.makedirs(wdir, exist_ok=True)
        done = all(os.path.exists(os.path.join(wdir, f"errors{r}.json")) for r in range(world))
        if reuse and done:
            print(f"reference: W={world} reused from {wdir}")
            out[world] = _load_rank_outputs(wdir, world)
            continue
        port = _free_port()
        t0 = time.time()
        procs = []
        for rank in range(world):
            cmd = [
                sys.executable,
                os.path.join(HERE, "_dion_reference_worker.py"),
                f"--rank={rank}",
                f"--world={world}",
                f"--port={port}",
                f"--plan={plan_path}",
                f"--inputs={inputs_path}",
                f"--reference={reference}",
                f"--out={wdir}",
            ]
            log = open(os.path.join(wdir, f"log{rank}.txt"), "w")  # noqa: SIM115
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        failed = False
        for p, log in procs:
            try:
                rc = p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = -9
            log.close()
            failed |= rc != 0
        if failed:
            logs = "".join(open(os.path.join(wdir, f"log{r}.txt")).read()[-2000:] for r in range(world))
            sys.exit(f"reference workers failed for W={world}:\n{logs}")
        print(f"reference: W={world} done in {time.time() - t0:.1f}s")
        out[world] = _load_rank_outputs(wdir, world)
    return out


def _load_rank_outputs(wdir: str, world: int):
    ranks = [dict(np.load(os.path.join(wdir, f"rank{r}.npz"))) for r in range(world)]
    errors: dict[str, str] = {}
    for r in range(world):
        with open(os.path.join(wdir, f"errors{r}.json")) as f:
            errors.update(json.load(f))
    return ranks, errors


# ----------------------------------------------------------------------------- NumPy rule


def _orth(p: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(p)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def numpy_dion(x0, grads, q0, *, transposed, compressed, lr, mu, weight_decay, eps, first_step_mean=False):
    """FRONTIER.md's rule, float64. ``grads``: (steps, W, d_out, d_in). Returns X, Q, M per step.

    ``first_step_mean`` mirrors a quirk of ``dion_reference.py``: it decides whether to all-reduce
    the gradient before the state (and the ``compressed_all_reduce`` flag) exists, so its first
    step averages the gradient even when the exchange is compressed. ``X`` and ``mean_i M_i``
    are unaffected (linearity); the per-worker momenta are."""
    x = x0.astype(np.float64)
    q = q0.astype(np.float64)
    steps, w = grads.shape[:2]
    m_buf = np.zeros((w, *x.shape))
    xs, qs, ms = [x.copy()], [], []
    d_out, d_in = x.shape
    for s in range(steps):
        g = grads[s].astype(np.float64)
        if not compressed or (first_step_mean and s == 0):
            g = np.broadcast_to(g.mean(0), g.shape)
        b = m_buf + g
        bt = np.swapaxes(b, 1, 2) if transposed else b
        p = _orth(np.mean(bt @ q, axis=0))
        r = np.mean(np.swapaxes(bt, 1, 2) @ p, axis=0)
        pr = p @ r.T
        m_buf = b - (1 - mu) * (pr.T if transposed else pr)
        q = r / (np.linalg.norm(r, axis=0, keepdims=True) + eps)
        upd = p @ q.T
        x = (1 - lr * weight_decay) * x - lr * math.sqrt(d_out / d_in) * (upd.T if transposed else upd)
        xs.append(x.copy())
        qs.append(q.copy())
        ms.append(m_buf.copy())
    return np.stack(xs), np.stack(qs), np.stack(ms)


def _effective_worker_grads(case: Case, g: np.ndarray) -> np.ndarray:
    """Gradients of the reference's data-parallel workers: per process (replicated), the mean
    (fsdp: one logical worker) or the per-pair mean (hsdp, 2 x 2)."""
    if case.layout == "replicated":
        return g
    if case.layout == "fsdp":
        return g.mean(axis=1, keepdims=True)
    return g.reshape(g.shape[0], 2, 2, *g.shape[2:]).mean(axis=2)


# ----------------------------------------------------------------------------- ours


def _load_ours():
    """Returns our ``dion`` factory (the public export if there is one) or None."""
    try:
        import jaxopt_dist

        if hasattr(jaxopt_dist, "dion"):
            return jaxopt_dist.dion
        from jaxopt_dist._src import dion as dion_lib

        return dion_lib.dion
    except Exception as e:  # noqa: BLE001
        print(f"ours: jaxopt_dist's dion not importable ({type(e).__name__}: {e})")
        return None


def run_ours(dion_factory, case: Case, x0, worker_grads, q0, backend: str):
    """Our ``dion`` with ``W = worker_grads.shape[1]`` workers on the Flax layout ``K = X^T``.

    The state's ``q`` is overwritten with ``q0`` (ours is ``(b, r)``, ``b`` the shorter side, as
    the reference's ``Q`` when both orient alike). Returns, in torch layout, X (steps + 1, d_out,
    d_in), Q (steps, b, r) and M (steps, W, d_out, d_in)."""
    import jax
    import jax.numpy as jnp
    import optax

    w = worker_grads.shape[1]
    tx = dion_factory(
        case.lr,
        rank_fraction=case.rank_fraction,
        mu=case.mu,
        weight_decay=case.weight_decay,
        eps=case.eps,
    )
    params = {"w": jnp.asarray(x0.T)}
    state = tx.init(params)
    dion_state = state[0]
    assert len(dion_state.q) == 1 and dion_state.q[0].shape == q0.shape, (dion_state.q[0].shape, q0.shape)
    state = (dion_state._replace(q=(jnp.asarray(q0),)), *state[1:])

    def step(p, s, g):
        u, s = tx.update({"w": g}, s, p)
        return optax.apply_updates(p, u), s

    stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (w, *jnp.shape(x))), t)  # noqa: E731
    params_w, state_w = stack(params), stack(state)
    if backend == "vmap":
        fn = jax.jit(jax.vmap(step, axis_name="data"))
    else:
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((w,), ("data",))
        squeeze = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        expand = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731

        def step_sm(p, s, g):
            return expand(step(squeeze(p), squeeze(s), squeeze(g)))

        fn = jax.jit(jax.shard_map(step_sm, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        sharding = jax.sharding.NamedSharding(mesh, P("data"))
        params_w, state_w = jax.device_put((params_w, state_w), sharding)
    xs, qs, ms = [x0], [], []
    for t in range(worker_grads.shape[0]):
        g = jnp.asarray(np.swapaxes(worker_grads[t], 1, 2))
        if backend == "shard_map":
            g = jax.device_put(g, sharding)
        params_w, state_w = fn(params_w, state_w, g)
        pw = np.asarray(params_w["w"])
        assert np.array_equal(pw, np.broadcast_to(pw[0], pw.shape)), "replicas drifted"
        xs.append(pw[0].T)
        qs.append(np.asarray(state_w[0].q[0])[0])
        ms.append(np.swapaxes(np.asarray(state_w[0].momentum["w"]), 1, 2))
    return np.stack(xs), np.stack(qs), np.stack(ms)


# ----------------------------------------------------------------------------- Muon / Dion2

ORTHO_SHAPES = ((64, 32), (64, 32), (64, 32), (32, 64), (32, 64), (48, 48))
DION_NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def build_ortho_plan(worlds, steps, algos) -> list[dict]:
    """(layout, variant, nesterov, dion2 selection scope) per optimizer and world size."""
    variants = {
        "muon": [
            ("replicated", "bf16", False, None),
            ("replicated", "f32", False, None),
            ("replicated", "polar-express", False, None),
            ("replicated", "f32", True, None),
            ("fsdp", "bf16", False, None),
            ("fsdp", "f32", False, None),
        ],
        "dion2": [
            ("replicated", "bf16", False, "local"),
            ("replicated", "f32", False, "local"),
            ("fsdp", "f32", False, "global"),
            ("fsdp", "f32", False, "local"),
            ("fsdp", "bf16", False, "local"),
        ],
    }
    out = []
    for algo in algos:
        for world in worlds:
            for layout, variant, nesterov, scope in variants[algo]:
                tag = f"{algo}_{layout}_{variant}{'_nesterov' if nesterov else ''}{'_' + scope if scope else ''}"
                out.append(
                    dict(
                        algo=algo,
                        impl=algo,
                        key=f"{tag}_W{world}",
                        world=world,
                        layout=layout,
                        variant=variant,
                        nesterov=nesterov,
                        scope=scope,
                        shapes=[list(sh) for sh in ORTHO_SHAPES],
                        steps=steps,
                        lr=0.01,
                        mu=0.95,
                        weight_decay=0.01,
                        eps=1e-8,
                        fraction=0.25,
                    )
                )
    return out


def build_ortho_inputs(cases: list[dict], seed: int) -> dict[str, np.ndarray]:
    inputs = {}
    for c in cases:
        rng = np.random.default_rng([seed, 7, c["world"]])
        for i, (m, n) in enumerate(c["shapes"]):
            inputs[f"{c['key']}/X0_{i}"] = (rng.standard_normal((m, n)) / math.sqrt(n)).astype(np.float32)
            inputs[f"{c['key']}/G_{i}"] = rng.standard_normal((c["steps"], c["world"], m, n)).astype(
                np.float32
            )
    return inputs


def _run_ours_on_workers(tx, params: dict, grads: dict, w: int, steps: int) -> list:
    """Steps ``tx`` under ``jax.vmap(axis_name="data")`` with W workers; X of worker 0 per step."""
    import jax
    import jax.numpy as jnp
    import optax

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p_w = jax.tree.map(lambda x: jnp.broadcast_to(x, (w, *x.shape)), params)
    s_w = jax.vmap(tx.init, axis_size=w)(p_w)
    fn = jax.jit(jax.vmap(step, axis_name="data"))
    xs = [params]
    for t in range(steps):
        p_w, s_w = fn(p_w, s_w, {k: jnp.asarray(v[t]) for k, v in grads.items()})
        pw = jax.tree.map(np.asarray, p_w)
        assert all(np.array_equal(x, np.broadcast_to(x[0], x.shape)) for x in pw.values()), "replicas drifted"
        xs.append({k: x[0] for k, x in pw.items()})
    return xs


def _flax_inputs(case: dict, inputs: dict):
    """Parameters (Flax layout ``X^T``) and per-worker gradients (steps, W, d_in, d_out)."""
    import jax.numpy as jnp

    n = len(case["shapes"])
    params = {f"p{i}": jnp.asarray(inputs[f"{case['key']}/X0_{i}"].T) for i in range(n)}
    grads = {f"p{i}": np.swapaxes(inputs[f"{case['key']}/G_{i}"], 2, 3) for i in range(n)}
    return params, grads


def _torch_layout(seq: list, keys) -> dict:
    return {k: np.stack([np.asarray(x[k]).T for x in seq]) for k in keys}


def run_ours_muon(case: dict, inputs: dict):
    """Ours (``jaxopt_dist`` muon, W workers under vmap) and ``optax.contrib.muon`` on the mean
    gradient, options made to coincide with the reference's: the "dion" NS table, no Nesterov,
    ``mu`` as ``beta``. Returns ({name: X per step} ours or None, same for optax)."""
    import jax
    import jax.numpy as jnp
    import optax

    w, steps = case["world"], case["steps"]
    params, grads = _flax_inputs(case, inputs)
    hp = dict(beta=case["mu"], eps=case["eps"], weight_decay=case["weight_decay"], nesterov=case["nesterov"])

    tx_optax = optax.contrib.muon(case["lr"], ns_coeffs=DION_NS_COEFFS, **hp)
    p, s = params, tx_optax.init(params)
    upd = jax.jit(tx_optax.update)
    xs_optax = [p]
    for t in range(steps):
        g = {k: jnp.asarray(v[t].mean(0)) for k, v in grads.items()}
        u, s = upd(g, s, p)
        p = optax.apply_updates(p, u)
        xs_optax.append(p)

    muon_lib = _import_ours("muon")
    ours = None
    if muon_lib is not None:
        tx = muon_lib.muon(case["lr"], ns_coeffs="dion", num_workers=w, **hp)
        xs = _guarded(_run_ours_on_workers, tx, params, grads, w, steps)
        ours = None if xs is None else _torch_layout(xs, params)
    return ours, _torch_layout(xs_optax, params)


def _np_newton_schulz(g: np.ndarray, eps: float) -> np.ndarray:
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in DION_NS_COEFFS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def numpy_dion2(x0, grads, *, select_rows, shards, fraction, lr, ef_decay, weight_decay, eps):
    """FRONTIER.md's Dion2 rule on the mean gradient (float64), for one matrix (torch layout).

    ``select_rows``: select rows (else columns); ``shards``: None for a top-k over the whole
    matrix, or the number of row shards whose per-shard top-k are united (the reference's
    "local" scope under FSDP2)."""
    x = x0.astype(np.float64)
    m_buf = np.zeros_like(x)
    xs = [x.copy()]
    d_out, d_in = x.shape
    for g in grads.astype(np.float64).mean(axis=1):
        m_buf += g
        mt = m_buf if select_rows else m_buf.T
        norms = np.abs(mt).sum(axis=1)
        if shards is None:
            k = max(1, math.ceil(fraction * mt.shape[0]))
            sel = np.sort(np.argsort(-norms, kind="stable")[:k])
        else:
            size = mt.shape[0] // shards
            k = max(1, math.ceil(fraction * size))
            sel = np.concatenate(
                [
                    j * size + np.argsort(-norms[j * size : (j + 1) * size], kind="stable")[:k]
                    for j in range(shards)
                ]
            )
        u = _np_newton_schulz(mt[sel], eps)
        mt[sel] *= ef_decay
        x *= 1 - lr * weight_decay
        xt = x if select_rows else x.T
        xt[sel] -= lr * math.sqrt(d_out / d_in) * u
        xs.append(x.copy())
    return np.stack(xs)


_MISSING: set[str] = set()


def _import_ours(name: str):
    try:
        return importlib.import_module(f"jaxopt_dist._src.{name}")
    except Exception as e:  # noqa: BLE001
        if name not in _MISSING:
            print(f"ours: jaxopt_dist._src.{name} unavailable ({type(e).__name__}: {e})")
            _MISSING.add(name)
        return None


def run_ours_dion2(case: dict, inputs: dict):
    """Ours (``jaxopt_dist``'s dion2, W workers under vmap) or None if it is not there yet."""
    dion2_lib = _import_ours("dion2")
    if dion2_lib is None:
        return None
    params, grads = _flax_inputs(case, inputs)
    tx = dion2_lib.dion2(
        case["lr"],
        fraction=case["fraction"],
        ef_decay=case["mu"],
        weight_decay=case["weight_decay"],
        eps=case["eps"],
        num_workers=case["world"],
        ns_coeffs="dion",
        adjust_lr="spectral_norm",
    )
    return _torch_layout(_run_ours_on_workers(tx, params, grads, case["world"], case["steps"]), params)


def _guarded(fn, *args):
    """Ours may be mid-edit by its authors: report a failure and go on without it."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        print(f"ours failed in {fn.__name__}: {type(e).__name__}: {e}")
        return None


def ortho_rows(cases: list[dict], ref_out: dict, inputs: dict) -> list[list[str]]:
    rows = []
    for c in cases:
        ranks, errors = ref_out[c["world"]]
        if c["key"] in errors:
            rows.append(
                [c["algo"], c["layout"], c["variant"], str(c["world"]), str(c["steps"]), errors[c["key"]]]
            )  # noqa: E501
            continue
        n = len(c["shapes"])
        x_ref = {f"p{i}": ranks[0][f"{c['key']}/X_{i}"] for i in range(n)}
        spread = max(_maxdiff(x_ref[f"p{i}"], r[f"{c['key']}/X_{i}"]).max() for r in ranks for i in range(n))
        if c["algo"] == "muon":
            ours, ox = run_ours_muon(c, inputs)
        else:
            ox = {}
            for i, (d_out, d_in) in enumerate(c["shapes"]):
                select_rows = d_out <= d_in if c["layout"] == "replicated" else True
                shards = c["world"] if c["layout"] == "fsdp" and c["scope"] == "local" else None
                ox[f"p{i}"] = numpy_dion2(
                    inputs[f"{c['key']}/X0_{i}"],
                    inputs[f"{c['key']}/G_{i}"],
                    select_rows=select_rows,
                    shards=shards,
                    fraction=c["fraction"],
                    lr=c["lr"],
                    ef_decay=c["mu"],
                    weight_decay=c["weight_decay"],
                    eps=c["eps"],
                )
            ours = _guarded(run_ours_dion2, c, inputs)
        # Matrices on which ours selects as the reference does (Dion2 under FSDP2 selects rows of
        # each shard; ours the shorter side of the whole matrix); Muon: all.
        agree = [
            f"p{i}"
            for i, (d_out, d_in) in enumerate(c["shapes"])
            if c["algo"] == "muon"
            or c["layout"] == "replicated"
            or (c["scope"] == "global" and d_out <= d_in)
        ]
        other = [f"p{i}" for i in range(n) if f"p{i}" not in agree]

        def d(a, b, keys=None):
            keys = list(a) if keys is None else keys
            return max((_maxdiff(a[k][1:], b[k][1:]).max() for k in keys), default=float("nan"))

        def rel(a, b, keys):
            return max(np.abs(a[k][1:] - b[k][1:]).max() / np.abs(np.diff(b[k], axis=0)).max() for k in keys)

        rows.append(
            [
                c["algo"],
                c["layout"] + (f" ({c['scope']})" if c["scope"] and c["layout"] != "replicated" else ""),
                c["variant"] + (" nesterov" if c["nesterov"] else ""),
                str(c["world"]),
                str(c["steps"]),
                f"{spread:.0e}",
                "-" if ox is None else f"{d(ox, x_ref):.1e}",
                "-" if ours is None or not agree else f"{d(ours, x_ref, agree):.1e}",
                "-" if ours is None or not agree else f"{rel(ours, x_ref, agree):.1e}",
                "-" if ours is None or ox is None or not agree else f"{d(ours, ox, agree):.1e}",
                "-" if ours is None or not other else f"{d(ours, x_ref, other):.1e} ({len(other)})",
            ]
        )
    return rows


# ----------------------------------------------------------------------------- compare


def _maxdiff(a, b) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.abs(a - b).reshape(a.shape[0], -1).max(axis=1)


def _maxdiff_q(a, b) -> np.ndarray:
    """Per step, up to column signs."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    sign = np.sign(np.sum(a * b, axis=-2, keepdims=True))
    sign[sign == 0] = 1
    return np.abs(a - sign * b).reshape(a.shape[0], -1).max(axis=1)


def _fmt(v: np.ndarray | None) -> str:
    if v is None:
        return "-"
    return f"{v.max():.1e}"


def _fmt_steps(v: np.ndarray | None) -> str:
    if v is None:
        return "-"
    return " ".join(f"{x:.0e}" for x in v)


def _print_dion_table(rows: list, per_step: bool) -> None:
    cols = [
        "matrix", "rank_fraction", "layout", "impl", "W", "T", "orient", "exch", "X spread",
        "X ref-np", "Q ref-np", "M_i ref-np", "X ours", "Q ours", "mean M ours", "M_i ours",
    ]  # fmt: skip
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for c, res, err in rows:
        layout = c.layout if c.shard_dim is None else f"{c.layout} Shard({c.shard_dim})"
        head = [
            f"{c.shape[0]}x{c.shape[1]}",
            f"{c.rank_fraction:g}",
            layout,
            c.impl,
            str(c.world),
            str(c.steps),
        ]
        if err is not None:
            print("| " + " | ".join(head + [err] + [""] * (len(cols) - len(head) - 1)) + " |")
            continue
        orient = ("T" if res["transposed"] else "N") + (
            "" if c.agree else " (ours " + ("N" if res["transposed"] else "T") + ")"
        )
        cells = head + [
            orient,
            "P,R" if res["compressed"] else "G",
            f"{res['x_spread']:.0e}",
            _fmt(res["np_x"]),
            _fmt(res["np_q"]),
            _fmt(res["np_m"]),
            _fmt(res.get("ours_x")),
            _fmt(res.get("ours_q")),
            _fmt(res.get("ours_mbar")),
            _fmt(res.get("ours_mi")),
        ]
        print("| " + " | ".join(cells) + " |")
        if per_step:
            print(
                f"    per step: X ref-np {_fmt_steps(res['np_x'])} | X ours {_fmt_steps(res.get('ours_x'))}"
                f" | Q ours {_fmt_steps(res.get('ours_q'))}"
            )
    print(
        "\nEach difference is the largest absolute one over all steps and entries (per step: --per-step)."
        "\norient: the reference's (T: transposed, P along d_in; N: P along d_out); where ours differs, it"
        " is shown and the Q column is left out.  exch: P,R = compressed exchange, G = gradient mean."
        "\nX spread: largest difference of X between the reference's ranks.  ref-np: reference vs the"
        " NumPy rule (float64).  ours: jaxopt_dist.dion (float32) vs the reference.  Q up to column"
        " signs.  mean M: mean over data-parallel workers of the momentum; M_i: per worker (replicated,"
        " hsdp).  dion_reference all-reduces the first step's gradient even when compressed (its"
        " flag is set after that decision), so its M_i differ from ours by design of that quirk; the"
        " NumPy rule mirrors it for that column."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", help="checkout of microsoft/dion at 0a059a4")
    ap.add_argument("--mirror", default=DEFAULT_MIRROR, help="git dir to extract when --reference is absent")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="keep plan, inputs, logs and per-rank .npz here")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    ap.add_argument("--per-step", action="store_true", help="print the per-step differences")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="reuse the reference outputs in --workdir (written with the same options)",
    )
    ap.add_argument(
        "--algos", nargs="+", default=["dion", "muon", "dion2"], choices=["dion", "muon", "dion2"]
    )
    ap.add_argument(
        "--backend", default="vmap", choices=["vmap", "shard_map"], help="how ours maps the workers"
    )
    args = ap.parse_args()

    if args.backend == "shard_map" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        # W CPU devices for jax.shard_map; must be set before jax is imported.
        flag = f"--xla_force_host_platform_device_count={max(args.workers)}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    reference = _locate_reference(args.reference, args.mirror)
    cases = build_plan(tuple(args.workers), args.steps, tuple(args.impls)) if "dion" in args.algos else []
    inputs = build_inputs(cases, args.seed)
    ortho = [a for a in args.algos if a != "dion"]
    ortho_cases = build_ortho_plan(tuple(args.workers), args.steps, ortho)
    inputs.update(build_ortho_inputs(ortho_cases, args.seed))
    workdir = args.workdir or tempfile.mkdtemp(prefix="dion_sbs_")
    os.makedirs(workdir, exist_ok=True)
    print(f"reference: {reference}  workdir: {workdir}")
    ref_out = run_reference(
        [asdict(c) for c in cases] + ortho_cases, inputs, reference, workdir, args.timeout, args.reuse
    )
    ours = _load_ours()
    ours_cache: dict[tuple, Any] = {}
    saved: dict[str, np.ndarray] = {}

    rows = []
    for c in cases:
        ranks, errors = ref_out[c.world]
        if c.key in errors:
            rows.append((c, None, f"reference error: {errors[c.key]}"))
            continue
        x_ref = ranks[0][f"{c.key}/X"]
        q_ref = ranks[0][f"{c.key}/Q"]
        x_spread = max(_maxdiff(x_ref, r[f"{c.key}/X"]).max() for r in ranks)
        transposed = bool(ranks[0][f"{c.key}/transposed"])
        assert transposed == _ref_transposed(c), c.key
        g = inputs[f"{c.name}/G"]
        wg = _effective_worker_grads(c, g)
        q0 = inputs[f"{c.name}/Q0_T" if transposed else f"{c.name}/Q0_N"]
        compressed = _compressed(c.shape, c.rank_fraction) and wg.shape[1] > 1
        hp = dict(lr=c.lr, mu=c.mu, weight_decay=c.weight_decay, eps=c.eps)
        quirk = c.impl == "dion_reference" and compressed
        x_np, q_np, m_np = numpy_dion(
            inputs[f"{c.name}/X0"],
            wg,
            q0,
            transposed=transposed,
            compressed=compressed,
            first_step_mean=quirk,
            **hp,
        )
        # Reference momentum per data-parallel worker: replicated: rank r; hsdp: pair p (rank 2p).
        if c.layout == "replicated":
            m_ref = np.stack([r[f"{c.key}/M"] for r in ranks], axis=1)
        elif c.layout == "fsdp":
            m_ref = ranks[0][f"{c.key}/M"][:, None]
        else:
            m_ref = np.stack([ranks[0][f"{c.key}/M"], ranks[2][f"{c.key}/M"]], axis=1)
        res: dict[str, Any] = {
            "x_spread": x_spread,
            "np_x": _maxdiff(x_ref[1:], x_np[1:]),
            "np_q": _maxdiff_q(q_ref, q_np),
            "np_m": _maxdiff(m_ref, m_np),
            "compressed": compressed,
            "transposed": transposed,
        }
        if ours is not None:
            ours_wg = g if c.layout != "hsdp" else wg
            ours_key = (c.shape, c.rank_fraction, c.world, c.layout == "hsdp")
            if ours_key not in ours_cache:
                ours_q0 = inputs[f"{c.name}/Q0_T" if _shape_transposed(c.shape) else f"{c.name}/Q0_N"]
                ours_cache[ours_key] = _guarded(
                    run_ours, ours, c, inputs[f"{c.name}/X0"], ours_wg, ours_q0, args.backend
                )
        if ours is not None and ours_cache[ours_key] is not None:
            x_o, q_o, m_o = ours_cache[ours_key]
            res["ours_x"] = _maxdiff(x_ref[1:], x_o[1:])
            res["ours_q"] = _maxdiff_q(q_ref, q_o) if c.agree else None
            res["ours_mbar"] = _maxdiff(m_ref.mean(1), m_o.mean(1))
            if m_ref.shape[1] == m_o.shape[1]:
                res["ours_mi"] = _maxdiff(m_ref, m_o)
            saved.update({f"{c.key}/X_ours": x_o, f"{c.key}/Q_ours": q_o, f"{c.key}/M_ours": m_o})
        saved.update({f"{c.key}/X_np": x_np, f"{c.key}/Q_np": q_np, f"{c.key}/M_np": m_np})
        rows.append((c, res, None))

    if cases:
        np.savez(os.path.join(workdir, "dion_ours_and_numpy.npz"), **saved)
        _print_dion_table(rows, args.per_step)

    if ortho_cases:
        cols = ["optimizer", "layout", "reference NS", "W", "T", "X spread", "X check", "X ours"]
        cols += ["ours/step", "ours-check", "X ours, selection differs (matrices)"]
        print()
        print("| " + " | ".join(cols) + " |")
        print("|" + "|".join("---" for _ in cols) + "|")
        for row in ortho_rows(ortho_cases, ref_out, inputs):
            print("| " + " | ".join(row + [""] * (len(cols) - len(row))) + " |")
        print(
            "\nSix matrices (3 of 64x32, 2 of 32x64, one 48x48, torch layout), gradients averaged first"
            " (DDP) or sharded Shard(0) (FSDP2). Reference options made to coincide with optax's:"
            " nesterov=False (both Nesterov in the 'nesterov' row), the 'dion' Newton-Schulz table (use_polar_express=False), adjust_lr"
            " 'spectral_norm' where d_out >= d_in and None where d_out < d_in (optax scales by"
            " sqrt(max(1, d_out/d_in))). bf16: as shipped (the exchanged momentum and Newton-Schulz in"
            " bf16). f32: its bf16 casts made float32 and a float32 Newton-Schulz with the same table"
            " passed as newton_schulz_func. polar-express: the shipped default Newton-Schulz."
            " Dion2: fraction 0.25, ef_decay 0.95, adjust_lr 'spectral_norm' (its default) on every"
            " matrix; (local)/(global) is its selection_scope. X check: Muon vs optax.contrib.muon"
            " on the mean gradient, Dion2 vs the NumPy Dion2 rule (float64, with the reference's"
            " choice of rows/columns and of per-shard top-k). X ours: jaxopt_dist (W workers,"
            " vmap) vs the reference, over the matrices where both select the same slices (all but"
            " Dion2 under FSDP2: 'local' takes the top-k rows of each shard, and Shard(0) makes it"
            " select rows of the tall matrices, where ours selects columns, the shorter side);"
            " ours/step: that difference over the largest single-step change of X; ours-check:"
            " ours vs the check; last column: ours vs the reference on the other matrices."
        )


if __name__ == "__main__":
    main()
