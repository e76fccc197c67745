"""Multi-host data-parallel training with PowerSGD on JAX's multi-controller runtime.

Every process runs this same script. ``jax.distributed.initialize`` connects
the processes through a coordinator; afterwards ``jax.devices()`` lists the
devices of *all* processes, and one mesh over them is the data axis. Each
process computes the same global batch from a seeded generator and transfers
only the rows of its own devices; gradients never leave a device except
through the collectives inside the optimizer (PowerSGD's two all-reduces of
low-rank factors per step), which XLA runs over gloo on CPU, NCCL on GPU and
ICI/DCN on TPU.

Two processes with two simulated CPU devices each, on one machine::

    python examples/multihost.py --num-processes 2 --process-id 0 \
        --coordinator 127.0.0.1:12355 --local-devices 2 &
    python examples/multihost.py --num-processes 2 --process-id 1 \
        --coordinator 127.0.0.1:12355 --local-devices 2

With ``--fsdp 4`` (and ``--local-devices 4``) each process is one replica of a
sharded model: the parameters and the optimizer state are sharded over its
four devices (a ``"fsdp"`` model axis, ``param_specs`` of
:func:`jaxopt_dist.data_parallel_step`), and only PowerSGD's factors cross
between the processes.

On a cluster, run the same command once per host with its own
``--process-id`` and the first host's address as ``--coordinator``, or pass
``--auto`` where ``jax.distributed.initialize()`` detects the cluster itself
(SLURM, Open MPI, TPU pods, Kubernetes JobSets).

With ``--num-processes 1`` and no ``--coordinator`` the script runs in one
process without the distributed runtime (XLA's in-process collectives). With
a ``--coordinator`` it initializes a one-process "cluster", so the CPU
collectives go through gloo exactly as in a multi-process run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-processes", type=int, default=1, help="processes in the job (one per host)")
    p.add_argument("--process-id", type=int, default=0, help="this process's rank, 0 .. num-processes - 1")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordinator service")
    p.add_argument(
        "--auto",
        action="store_true",
        help="let jax.distributed.initialize() detect the cluster (SLURM, Open MPI, TPU pods, ...)",
    )
    p.add_argument(
        "--local-devices",
        type=int,
        default=None,
        help="simulated CPU devices in this process (sets XLA_FLAGS before JAX starts; CPU only)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over all devices")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    p.add_argument(
        "--fsdp",
        type=int,
        default=1,
        help="shard the parameters over a model axis of this many devices inside each replica (FSDP); "
        "with one process per host, give it the host's device count",
    )
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the final parameters to this .npz file")
    args = p.parse_args(argv)
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        p.error(f"need 0 <= --process-id < --num-processes; got {args.process_id}, {args.num_processes}")
    if args.num_processes > 1 and args.coordinator is None and not args.auto:
        p.error("--num-processes > 1 needs --coordinator HOST:PORT (or --auto)")
    if args.local_devices is not None and args.local_devices < 1:
        p.error("--local-devices must be >= 1")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.fsdp < 1 or args.hidden % args.fsdp:
        p.error(f"--fsdp must be >= 1 and divide --hidden ({args.hidden}); got {args.fsdp}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_devices is not None:
        # Must happen before JAX creates its CPU backend; ignored by GPU/TPU backends.
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in f
        ]
        flags.append(f"--xla_force_host_platform_device_count={args.local_devices}")
        os.environ["XLA_FLAGS"] = " ".join(flags)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxopt_dist as jd

    # Cross-process collectives of the CPU backend (the default in recent JAX;
    # it has no effect on GPU/TPU, where XLA uses NCCL or the TPU interconnect).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.auto:
        jax.distributed.initialize()
    elif args.coordinator is not None:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )

    # A data axis over the replicas and, with --fsdp, a model axis inside each replica.
    # jax.devices() lists each process's devices together, so with --fsdp equal to the
    # local device count every replica is one process: only the optimizer's
    # collectives cross the network, the FSDP all-gathers stay inside the host.
    devices = jax.devices()
    if len(devices) % args.fsdp:
        raise SystemExit(f"--fsdp {args.fsdp} must divide the {len(devices)} devices")
    mesh = jax.make_mesh((len(devices) // args.fsdp, args.fsdp), ("data", "fsdp"), devices=devices)
    n = mesh.shape["data"]
    if args.batch_size % len(devices):
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {len(devices)} devices")
    me = jax.process_index()
    log = lambda *a: print(f"[process {me}/{jax.process_count()}]", *a, flush=True)  # noqa: E731
    log(f"{jax.local_device_count()} local of {n} devices ({devices[0].platform}), mesh {dict(mesh.shape)}")

    x_all, y_all = load_data(args.seed)
    num_classes = int(y_all.max()) + 1
    params = init_params(np.random.default_rng(args.seed), x_all.shape[1], args.hidden, num_classes)

    def loss_fn(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    tx = optax.chain(jd.powersgd(rank=args.rank, axis_name="data"), jd.sgd(args.lr, momentum=0.9))
    # Hidden units sharded over "fsdp" (the optimizer state follows); the batch is split
    # over both axes. With --fsdp 1 the "fsdp" axis has one device: plain data parallelism.
    P = jax.sharding.PartitionSpec
    specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, param_specs=specs, batch_axes="fsdp")
    # Every process passes the same host params; init places them (replicated over "data").
    params, opt_state = step.init(params)

    rng = np.random.default_rng(args.seed + 1)  # the same stream on every process
    start = time.perf_counter()
    for t in range(args.steps):
        idx = rng.choice(len(x_all), size=args.batch_size, replace=False)
        # The global batch, identical on every process. The step transfers only
        # the rows of this process's devices; a loader that reads just this
        # process's examples would pass jax.make_array_from_process_local_data(...).
        batch = {"x": x_all[idx], "y": y_all[idx]}
        params, opt_state, metrics = step(params, opt_state, batch)
        loss = float(metrics["loss"])  # replicated: readable on every process
        if t == 0 or (t + 1) % 10 == 0 or t + 1 == args.steps:
            log(f"step {t + 1:4d}  loss {loss:.6f}")
    elapsed = time.perf_counter() - start

    # Every process holds a whole replica (all of its "fsdp" shards): read them locally.
    final = {k: local_copy(v) for k, v in params.items()}
    log(f"final loss {loss:.6f}  ({elapsed / max(args.steps, 1) * 1e3:.1f} ms/step)")
    if args.out:
        np.savez(args.out, **final, loss=np.float32(loss))
        log(f"wrote {args.out}")
    if args.coordinator is not None or args.auto:
        jax.distributed.shutdown()
    return 0


def local_copy(x):
    """A parameter replicated over "data" as one NumPy array, from this process's shards."""
    import numpy as np

    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def load_data(seed: int):
    """Scikit-learn's digits (standardized), or a seeded synthetic stand-in without scikit-learn."""
    import numpy as np

    try:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
    except ImportError:  # pragma: no cover - scikit-learn is a test dependency
        rng = np.random.default_rng(seed)
        centers = rng.standard_normal((10, 64))
        y = rng.integers(0, 10, size=1797)
        x = centers[y] + rng.standard_normal((1797, 64))
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x.astype(np.float32), y.astype(np.int32)


def init_params(rng, d_in: int, hidden: int, classes: int) -> dict:
    import numpy as np

    return {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }


if __name__ == "__main__":
    sys.exit(main())
