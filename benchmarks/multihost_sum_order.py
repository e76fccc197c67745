"""Which order does a 4-way all-reduce sum in? In-process XLA:CPU vs gloo (1 and 2 processes).

Explains why ``examples/multihost.py`` run through ``jax.distributed`` (gloo) matches
a single-process run with XLA's in-process collectives only to the last bits, while
gloo runs agree bit for bit however the 4 devices are spread over processes.

Run: ``python benchmarks/multihost_sum_order.py`` (launches the configurations and compares).
"""

import argparse
import itertools
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 4096)) * np.exp(rng.standard_normal((4, 4096)) * 3)).astype(np.float32)


def child(nproc, pid, port, mode, out):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // nproc}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if mode == "gloo":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid
        )
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    mesh = jax.make_mesh((4,), ("data",))
    x = data()
    k = 4 // nproc
    xa = jax.make_array_from_process_local_data(NS(mesh, P("data")), x[pid * k : (pid + 1) * k], x.shape)
    f = jax.jit(
        jax.shard_map(lambda a: jax.lax.psum(a[0], "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    )
    np.save(out, np.asarray(f(xa)))


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A launched child gets: number of processes, process id, port, mode, output file.
    ap.add_argument("child", nargs="*", help=argparse.SUPPRESS)
    child_args = ap.parse_args().child
    if child_args:
        child(int(child_args[0]), int(child_args[1]), *child_args[2:5])
        sys.exit(0)
    run = lambda *a: subprocess.Popen([sys.executable, __file__, *map(str, a)], stderr=subprocess.DEVNULL)
    tmp = tempfile.mkdtemp()
    path = lambda name: os.path.join(tmp, f"{name}.npy")
    p1, p2 = port(), port()
    procs = [run(1, 0, 0, "local", path("local")), run(1, 0, p1, "gloo", path("gloo1"))]
    procs += [run(2, i, p2, "gloo", path(f"gloo2_{i}")) for i in range(2)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    x = data()
    local, g1, g20, g21 = (np.load(path(n)) for n in ("local", "gloo1", "gloo2_0", "gloo2_1"))
    seq = ((x[0] + x[1]) + x[2]) + x[3]
    print("in-process == x0+x1+x2+x3 (fraction of elements):", (local == seq).mean())
    print("gloo 1 process == x0+x1+x2+x3:", (g1 == seq).mean())
    print("gloo 1 process == gloo 2 processes (both ranks):", (g1 == g20).all() and (g1 == g21).all())
    L = x.shape[1] // 4
    for c in range(4):
        sl = slice(c * L, (c + 1) * L)
        match = []
        for o in itertools.permutations(range(4)):
            s = x[o[0], sl]
            for i in o[1:]:
                s = s + x[i, sl]
            if (s == g1[sl]).all():
                match.append(o)
        print(f"gloo chunk {c}: sequential orders that match bit for bit: {match}")
