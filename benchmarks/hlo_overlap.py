"""Compiled HLO for TPU and GPU targets, compiled here without the device: are the collectives asynchronous?

Each program is compiled ahead of time for a target this machine does not
have (a TPU slice through libtpu's compile-only topology, an NVIDIA GPU
through jax's CUDA plugin with a GPU target description), and the compiled,
scheduled HLO is read: for every collective, whether it was made
asynchronous (``all-reduce-start`` ... ``all-reduce-done``, an ``async-start``
wrapping a collective, ...) and which compute the scheduler put between its
start and its done, i.e. what it can overlap. Nothing runs; nothing needs the
device.

Targets: ``tpu`` (one v5e 2x2 slice, the data axis over its 4 chips, ICI),
``tpu-2-slices`` (two such slices, the data axis over all 8 chips: ICI and
DCN), ``gpu`` (4 H100s, XLA's defaults) and ``gpu-nccl`` (the same with
XLA's one-shot all-reduce kernel off, so every all-reduce goes to NCCL).
``--libtpu-overlap-flags`` compiles the TPU targets with MaxText's overlap
flags.

Programs: four toys over the data axis (per-worker weights, three tanh
matmul layers, their gradient):

* ``toy_independent``: the step also all-reduces a buffer that does not
  depend on the gradient;
* ``toy_dependent``: the all-reduce is of the gradient itself;
* ``toy_cond`` / ``toy_switch``: the independent all-reduce inside a
  ``lax.cond`` / ``lax.switch`` branch on the step count (where DiLoCo's
  outer synchronizations sit);

and the library's ``jd.data_parallel_step`` with
``jd.diloco(optax.adamw(1e-3), sync_every=8, num_fragments=2, sync_delay=2)``
on a 64-512-10 tanh MLP (per-worker params; ``diloco_step``), and the same
with ``overlap=True`` and no runner (``diloco_overlap_inline``: the exchange
then runs inside the step that applies it), and the program
``jd.overlapped_step(step)`` (``comm_mesh=None``) runs on the inner step after
the one that sends fragment 0: that step with the fragment's exchange fused
in, outside any conditional (``diloco_overlap_fused``). "fwd/bwd" counts the
compute between start and done that belongs to the forward/backward pass.

Needs (not dependencies of the package; versions matching the installed jax)::

    pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"   # libtpu
    pip install jax-cuda12-plugin==<jax version> jax-cuda12-pjrt==<jax version>  # no nvidia-* wheels

Without either, it says so and exits 0. The CUDA plugin loads no CUDA
library for this (``JAX_PLATFORMS=cpu`` skips its version check); the GPU
target description comes from ``--gpu-target-config FILE`` (an XLA
``GpuTargetConfigProto`` in text form) or, by default, the one for
``--gpu-device`` that the plugin itself carries.

Usage::

    python benchmarks/hlo_overlap.py [--target tpu|gpu|all] [--dump DIR] [--quick]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import sys

import _common  # first: sets JAX_PLATFORMS=cpu before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxopt_dist as jd

N = 4  # GPUs on the data axis (a TPU target's data axis spans its topology's chips)
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
INSTALL = (
    "TPU: pip install 'jax[tpu]=={v}' (brings libtpu); GPU: pip install jax-cuda12-plugin=={v} "
    "jax-cuda12-pjrt=={v} (the nvidia-* CUDA wheels are not needed to compile)."
)

# The overlap flags MaxText's TPU recipes set (LIBTPU_INIT_ARGS); --libtpu-overlap-flags compiles with them.
LIBTPU_OVERLAP_FLAGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true --xla_enable_async_collective_permute=true"
)

# ----------------------------------------------------------------------------
# Targets.


def tpu_mesh(topology: str, slices: int = 1) -> Mesh:
    """The data axis over every chip of ``slices`` slices of ``topology`` (across slices: DCN)."""
    from jax.experimental import topologies

    kw = {"num_slices": slices} if slices > 1 else {}
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw).devices
    return Mesh(np.array(devices), ("data",))


def embedded_gpu_config(device: str) -> str:
    """The plugin's own GpuTargetConfigProto text for ``device`` (e.g. ``NVIDIA H100 80GB HBM3``)."""
    spec = next(_spec(m) for m in CUDA_PLUGINS if _spec(m))
    blob = (pathlib.Path(spec.origin).parent / "xla_cuda_plugin.so").read_bytes()
    found = {}
    for m in re.finditer(rb"gpu_device_info \{", blob):
        start, end = blob.rfind(b"\0", 0, m.start()) + 1, blob.find(b"\0", m.start())
        text = blob[start:end].decode("utf-8", "replace")
        name = re.search(r'device_description_str: "([^"]*)"', text)
        if name:
            found[name.group(1)] = text
    if device not in found:
        raise ValueError(f"no target config for {device!r} in the plugin; it has: {sorted(found)}")
    return found[device]


def gpu_mesh(device: str, config_file: str | None) -> Mesh:
    from jax.experimental import topologies

    config = pathlib.Path(config_file).read_text() if config_file else embedded_gpu_config(device)
    shape = f"1x1x{N}"  # partitions x hosts per partition x devices per host
    topo = topologies.get_topology_desc(
        platform="cuda", topology_name=shape, topology=shape, target_config=config
    )
    return Mesh(np.array(topo.devices), ("data",))


def _spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # its parent package is not there
        return None


def have(target: str) -> bool:
    return _spec("libtpu") is not None if target == "tpu" else any(_spec(m) for m in CUDA_PLUGINS)


# ----------------------------------------------------------------------------
# Programs: each returns (jitted function, abstract arguments with shardings).


def _abstract(mesh: Mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def toy(mesh: Mesh, kind: str, d: int, b: int):
    n = mesh.shape["data"]

    def body(w, x, other, step):
        w = w[0]

        def loss(w):
            h = jnp.tanh(x @ w)
            h = jnp.tanh(h @ w)
            return jnp.mean((h @ w) ** 2)

        g = jax.grad(loss)(w)
        reduce = lambda o: jax.lax.psum(o, "data")  # noqa: E731
        if kind == "dependent":
            g, o = reduce(g), other
        elif kind == "independent":
            o = reduce(other)
        elif kind == "cond":
            o = jax.lax.cond(step % 8 == 0, reduce, lambda o: o, other)
        else:
            o = jax.lax.switch(step % 3, [lambda o: o, reduce, lambda o: 2 * o], other)
        return (w - 0.1 * g)[None], o

    specs = (P("data"), P("data"), P("data"), P())
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("data"), P("data")), check_vma=False)
    )
    args = (
        _abstract(mesh, (n, d, d), P("data")),
        _abstract(mesh, (n * b, d), P("data")),
        _abstract(mesh, (n * d, d), P("data")),
        _abstract(mesh, (), P(), jnp.int32),
    )
    return fn, args


def _mlp_batch(mesh: Mesh, b: int):
    n = mesh.shape["data"]
    return {
        "x": _abstract(mesh, (n * b, 64), P("data")),
        "y": _abstract(mesh, (n * b,), P("data"), jnp.int32),
    }


def _diloco(mesh: Mesh, hidden: int, b: int, overlap: bool, reduce_metrics: bool = True):
    kw = {"overlap": True} if overlap else {}
    tx = jd.diloco(optax.adamw(1e-3), sync_every=8, num_fragments=2, sync_delay=2, **kw)
    step = jd.data_parallel_step(
        _common.mlp_loss, tx, mesh=mesh, per_worker_params=True, reduce_metrics=reduce_metrics
    )
    params, state = step.abstract_init(_common.mlp_init(hidden=hidden))
    return step, (params, state, _mlp_batch(mesh, b))


def library(mesh: Mesh, hidden: int, b: int, overlap: bool):
    step, (params, state, batch) = _diloco(mesh, hidden, b, overlap)
    fn, _ = step._build(params, batch)  # the step's jitted function, as step(...) compiles it
    return fn, (params, state, batch)


def library_fused(mesh: Mesh, hidden: int, b: int):
    """The program ``overlapped_step(step)`` (``comm_mesh=None``) runs on the step after fragment 0 is sent.

    That step (inner step 2 of 8: fragment 0 is sent by step 1 and applied by
    step 3) is the step's program with fragment 0's exchange (the mean
    all-reduce of its outbox) fused in, unconditionally. The step is built
    with ``reduce_metrics=False`` (no per-step loss all-reduce for XLA to
    combine the exchange with), and ``overlapped_step`` runs it with the
    diloco that leaves every exchange to the runner (``OuterExchange.trusting``:
    no collective inside the step's switch). Built as
    ``DataParallelStep.call_with`` builds it, from the private pieces
    ``step._compiled`` and ``OverlappedStep._fused``: the runner has no public
    handle on its compiled programs, and a benchmark may reach in.
    """
    step, (params, state, batch) = _diloco(mesh, hidden, b, overlap=True, reduce_metrics=False)
    run = jd.overlapped_step(step)  # runs run.step: the same step, its diloco without the fallback exchange
    sent = run.exchange.launch_phase[0]  # the inner step whose state holds fragment 0's outbox
    assert 0 in run.exchange.launches_after(sent) and 0 not in run.exchange.lands_at(sent + 1)
    step_fn, _ = run.step._compiled(params, state, batch)
    extra, extra_args = run._fused(state, [0])
    fn = jax.jit(lambda p, s, b, *e: (step_fn(p, s, b), extra(*e)))
    return fn, (params, state, batch, *extra_args)


def has_overlap() -> bool:
    """Whether this jaxopt_dist's diloco takes ``overlap=`` (its exchange then runs in the applying step)."""
    import inspect

    return "overlap" in inspect.signature(jd.diloco).parameters


def has_fused() -> bool:
    """Whether this jaxopt_dist's ``overlapped_step`` can fuse the exchange into the next step (``comm_mesh=None``)."""
    import inspect

    run = getattr(jd, "overlapped_step", None)
    return run is not None and inspect.signature(run).parameters["comm_mesh"].default is None


# ----------------------------------------------------------------------------
# Reading the scheduled HLO.

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)
COMPUTE = ("fusion", "convolution", "dot", "custom-call", "while", "conditional", "call")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s")


@dataclasses.dataclass
class Instr:
    name: str
    op: str
    shape: str
    text: str

    def calls(self, key: str) -> list[str]:
        m = re.search(key + r"=\{?(?P<c>%[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?", self.text)
        return [c.strip().lstrip("%") for c in m.group("c").split(",")] if m else []


def parse(hlo: str) -> tuple[dict[str, list[Instr]], str]:
    """Computations (name -> instructions in schedule order) and the entry's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            head = _HEADER.match(line)
            if head and line.rstrip().endswith("{"):
                current = head.group("name")
                comps[current] = []
                entry = current if line.startswith("ENTRY") else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        op = _OPCODE.search(" " + m.group("rest")) if m else None
        if m and op:
            shape = m.group("rest")[: op.start()].strip()
            comps[current].append(Instr(m.group("name"), op.group("op"), shape, m.group("rest")))
    return comps, entry


def scheduled(comps: dict[str, list[Instr]], entry: str) -> dict[str, str]:
    """The computations that run as a sequence (entry, loop bodies, branches) -> where they sit."""
    where = {entry: "entry"}
    todo = [entry]
    while todo:
        name = todo.pop()
        for ins in comps.get(name, []):
            called = []
            if ins.op == "while":
                called = [(c, f"loop body of {ins.name}") for c in ins.calls("body")]
            elif ins.op == "conditional":
                branches = ins.calls("branch_computations") or ins.calls("true_computation") + ins.calls(
                    "false_computation"
                )
                called = [(c, f"branch {i} of {ins.name}") for i, c in enumerate(branches)]
            elif ins.op == "call":
                called = [(c, f"call {ins.name}") for c in ins.calls("to_apply")]
            for c, label in called:
                if c not in where:
                    where[c] = f"{label} (in {where[name]})"
                    todo.append(c)
    return where


def _wrapped_collective(comps: dict[str, list[Instr]], ins: Instr, depth: int = 0) -> str | None:
    """The collective inside the computations ``ins`` calls (async wrappers, collective fusions)."""
    for c in ins.calls("calls") if depth < 4 else []:
        for inner in comps.get(c, []):
            if inner.op.removesuffix("-start") in COLLECTIVES:
                return inner.op.removesuffix("-start")
            found = _wrapped_collective(comps, inner, depth + 1)
            if found:
                return found
    return None


def _short(shape: str) -> str:
    shape = re.sub(r"/\*index=\d+\*/|\{[^{}]*\}", "", shape)
    return shape if len(shape) <= 60 else shape[:57] + "..."


def _uses(x: Instr, name: str) -> bool:
    return re.search(f"%{re.escape(name)}(?![\\w.\\-])", x.text) is not None


def _forward_backward(x: Instr) -> bool:
    """Whether ``x`` computes the loss or its gradient (its JAX op name is under ``jvp(...)``)."""
    return re.search(r'op_name="[^"]*jvp\(', x.text) is not None


def _async_pair(comps: dict[str, list[Instr]], ins: Instr):
    """(label, is-its-done predicate) when ``ins`` starts an asynchronous collective, else None."""
    base = ins.op.removesuffix("-start")
    if ins.op in ("send", "recv"):
        link = "host transfer (DCN) " if "is_host_transfer=true" in ins.text else ""
        return (
            f"{ins.op} {link}{_short(ins.shape)}",
            lambda x: x.op == f"{ins.op}-done" and _uses(x, ins.name),
        )
    if ins.op.endswith("-start") and (base in COLLECTIVES or _wrapped_collective(comps, ins)):
        what = base if base in COLLECTIVES else f"{ins.op} of {_wrapped_collective(comps, ins)}"
        return f"{what} {_short(ins.shape)}", lambda x: x.op == f"{base}-done" and _uses(x, ins.name)
    if ins.name.startswith("async-collective-start") and _wrapped_collective(
        comps, ins
    ):  # TPU collective fusion
        done = ins.name.replace("start", "done", 1)
        return (
            f"collective fusion of {_wrapped_collective(comps, ins)} {_short(ins.shape)}",
            lambda x: x.name == done,
        )
    return None


@dataclasses.dataclass
class Row:
    collective: str
    where: str
    is_async: bool
    between: list[str]
    grad: int = 0  # how many of ``between`` are the forward/backward pass (jvp / transpose(jvp) ops)

    def cells(self) -> list[str]:
        if not self.is_async:
            return [self.collective, self.where, "no", "-", "-", ""]
        names = ", ".join(self.between[:6]) + (
            f", ... (+{len(self.between) - 6})" if len(self.between) > 6 else ""
        )
        return [self.collective, self.where, "yes", str(len(self.between)), str(self.grad), names]


def collectives(hlo: str) -> list[Row]:
    """One row per collective of the scheduled computations, in schedule order."""
    comps, entry = parse(hlo)
    rows = []
    for comp, where in scheduled(comps, entry).items():
        seq = comps[comp]
        for i, ins in enumerate(seq):
            if ins.op in COLLECTIVES:
                rows.append(Row(f"{ins.op} {_short(ins.shape)}", where, False, []))
                continue
            pair = _async_pair(comps, ins)
            if pair is None:
                continue
            label, is_done = pair
            j = next((k for k in range(i + 1, len(seq)) if is_done(seq[k])), len(seq))
            ops = [x for x in seq[i + 1 : j] if x.op in COMPUTE]
            between = [x.name if x.op == "fusion" else f"{x.op}:{x.name}" for x in ops]
            rows.append(Row(label, where, True, between, sum(map(_forward_backward, ops))))
    return rows


# ----------------------------------------------------------------------------


def programs(args) -> dict[str, object]:
    d, b = (256, 64) if args.quick else (1024, 512)
    out = {
        "toy_independent": lambda m: toy(m, "independent", d, b),
        "toy_dependent": lambda m: toy(m, "dependent", d, b),
        "toy_cond": lambda m: toy(m, "cond", d, b),
        "toy_switch": lambda m: toy(m, "switch", d, b),
        "diloco_step": lambda m: library(m, args.hidden, b, overlap=False),
    }
    if has_overlap():
        out["diloco_overlap_inline"] = lambda m: library(m, args.hidden, b, overlap=True)
    if has_fused():
        out["diloco_overlap_fused"] = lambda m: library_fused(m, args.hidden, b)
    return out


def report(target: str, mesh: Mesh, args) -> None:
    kind = mesh.devices.flat[0].device_kind
    for name, make in programs(args).items():
        print(f"\n### {target} ({kind}, data axis of {mesh.size} devices): {name}\n")
        try:
            fn, abstract = make(mesh)
            hlo = fn.lower(*abstract).compile().as_text()
        except Exception as e:  # a target that cannot compile a program: say so, go on
            print(f"not compiled: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        if args.dump:
            path = pathlib.Path(args.dump) / f"{target}_{name}.hlo.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(hlo)
        rows = collectives(hlo)
        print(
            _common.markdown_header(
                ["collective", "where", "async?", "compute between", "of it fwd/bwd", "ops between"], "lllrrl"
            )
        )
        for row in rows:
            print(_common.markdown_row(row.cells()))
        if not rows:
            print(_common.markdown_row(["(none)", "", "", "", "", ""]))


# XLA:GPU all-reduces small buffers with a one-shot Triton kernel (a "fusion-start"); gpu-nccl turns it
# off, so the all-reduce goes through NCCL. The flag is read from XLA_FLAGS only: gpu-nccl runs in a child.
NO_ONE_SHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"


def rerun_without_one_shot(args) -> None:
    import subprocess

    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {NO_ONE_SHOT}".strip())
    argv = [
        sys.executable,
        __file__,
        "--target",
        "gpu-nccl",
        "--gpu-device",
        args.gpu_device,
        "--hidden",
        str(args.hidden),
    ]
    argv += ["--quick"] * args.quick + (
        ["--gpu-target-config", args.gpu_target_config] if args.gpu_target_config else []
    )
    argv += ["--dump", args.dump] if args.dump else []
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    print(out.split("\n", 2)[2].rstrip())  # less its two header lines


def main() -> None:
    ap = _common.parser(__doc__, "smaller matrices")
    ap.add_argument("--target", choices=("tpu", "tpu-2-slices", "gpu", "gpu-nccl", "all"), default="all")
    ap.add_argument("--tpu-topology", default="v5e:2x2", help="libtpu topology name (>= 4 chips)")
    ap.add_argument("--gpu-device", default="NVIDIA H100 80GB HBM3", help="GPU whose target config to use")
    ap.add_argument(
        "--gpu-target-config", default=None, help="GpuTargetConfigProto text file (overrides --gpu-device)"
    )
    ap.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width")
    ap.add_argument(
        "--libtpu-overlap-flags",
        action="store_true",
        help="compile for TPU with MaxText's overlap LIBTPU_INIT_ARGS",
    )
    ap.add_argument("--dump", default=None, help="folder to write each compiled HLO to")
    args = ap.parse_args()
    targets = ["tpu", "tpu-2-slices", "gpu", "gpu-nccl"] if args.target == "all" else [args.target]
    missing = [t for t in targets if not have(t.split("-")[0])]
    if missing:
        print(f"not installed for {', '.join(missing)}: " + INSTALL.format(v=jax.__version__))
    targets = [t for t in targets if t not in missing]
    if not targets:
        sys.exit(0)
    if args.libtpu_overlap_flags:
        os.environ["LIBTPU_INIT_ARGS"] = (
            os.environ.get("LIBTPU_INIT_ARGS", "") + " " + LIBTPU_OVERLAP_FLAGS
        ).strip()
    print(f"LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS', '')!r}")
    print(
        f"jax {jax.__version__}; diloco(overlap=True): {'yes' if has_overlap() else 'not in this jaxopt_dist'}"
    )
    for target in targets:
        if target == "gpu-nccl" and NO_ONE_SHOT not in os.environ.get("XLA_FLAGS", ""):
            rerun_without_one_shot(args)
            continue
        try:
            if target.startswith("gpu"):
                mesh = gpu_mesh(args.gpu_device, args.gpu_target_config)
            else:
                mesh = tpu_mesh(args.tpu_topology, 2 if target == "tpu-2-slices" else 1)
        except Exception as e:
            print(f"\n{target}: no compile-only topology: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        report(target, mesh, args)


if __name__ == "__main__":
    main()
