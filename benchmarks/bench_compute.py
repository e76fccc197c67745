"""How close is each compressor's computation to the memory-bandwidth floor?

One process, one CPU device, ResNet-18 (CIFAR) gradient shapes (11.2M
float32, :func:`bench_compression.resnet18_cifar_shapes`): the compiled
``tx.update`` of every method runs under ``jax.shard_map`` on a 1-device
mesh, so collectives cost nothing and what is timed is the compute alone
(compress, decompress, error feedback). Each row gives

* ``ms``: median time of one update (after compilation);
* ``floor ms``: the bytes the method must at least read and write
  (``floor B``, counted in units of ``D`` float32 entries: the gradient in
  and the update out, plus the residual read and written with error
  feedback, plus PowerSGD's two extra reads of the matrices) divided by the
  measured copy bandwidth (``x = x + 1`` in place on a donated 45 MB buffer:
  a fresh output buffer per call would time the page faults of its first
  touch, not the memory bandwidth);
* ``x floor``: ``ms / floor ms``;
* ``x prev``: ``ms`` over the time of the previous implementation, where it
  is kept as an option (rows marked ``(previous)``).

Methods are timed round-robin (each repeat runs every method once), so a
load change on the machine affects all rows alike.

Run: ``python benchmarks/bench_compute.py`` (``--quick``: widths / 8, 3 repeats;
``--only SUBSTR``: the methods whose label contains it). XLA:CPU allocates an
update's temporaries afresh at each call; to time them without glibc
returning them to the kernel (and faulting them in again at every step), run
it as ``bench_network.py`` runs its workers:
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_compute.py``.
"""

from __future__ import annotations

import math
import statistics
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import bench_compression as bc
import jax
import jax.numpy as jnp

import jaxopt_dist as jd

# label -> (factory, floor in units of 4 D bytes, label of the previous implementation or None)
_EF = 4.0  # gradient in, residual in, residual out, update out
_PLAIN = 2.0  # gradient in, update out


def methods() -> dict[str, tuple[object, float, str | None]]:
    return {
        "dense (all_reduce)": (lambda: jd.all_reduce(), _PLAIN, None),
        "bf16 all_reduce": (lambda: jd.all_reduce(dtype=jnp.bfloat16), _PLAIN, None),
        "QSGD 16 levels": (lambda: jd.qsgd(16), _PLAIN, None),
        "top-k 1%": (lambda: jd.top_k(density=0.01), _EF, None),
        "random-k 1%": (lambda: jd.random_k(density=0.01), _EF, None),
        "sign (majority vote)": (lambda: jd.sign_majority_vote(), _PLAIN, None),
        "EF-sign (scaled)": (lambda: jd.scaled_sign(), _EF, None),
        "PowerSGD r1": (lambda: jd.powersgd(1), _EF + 2, None),
        "PowerSGD r4": (lambda: jd.powersgd(4), _EF + 2, None),
    }


def copy_step(n: int):
    """A compiled ``x = x + 1`` on ``n`` float32 in place (reads and writes ``4 n`` bytes): a callable."""
    f = jax.jit(lambda x: x + 1, donate_argnums=0)
    buf = [jax.block_until_ready(f(jnp.zeros((n,), jnp.float32)))]

    def run() -> None:
        buf[0] = jax.block_until_ready(f(buf[0]))

    run()
    return run


def main() -> None:
    parser = _common.parser(__doc__, quick_help="1/8 channel widths, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default 9)")
    parser.add_argument("--only", default=None, help="only methods whose label contains this")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 9)
    shapes = bc.resnet18_cifar_shapes(8 if args.quick else 64)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    d = sum(math.prod(s) for s in shapes.values())
    mesh = _common.data_mesh(1)
    table = {k: v for k, v in methods().items() if args.only is None or args.only in k}
    steps = {}
    for label, (make, _, _) in table.items():
        fn, fargs = bc.build_step(make(), params, mesh)
        jax.block_until_ready(fn(*fargs))  # compile and warm up
        steps[label] = (fn, fargs)
    copy = copy_step(d)
    copy_runs = []
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):  # round-robin
        t0 = time.perf_counter()
        copy()
        copy_runs.append(time.perf_counter() - t0)
        for label, (fn, fargs) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fargs))
            times[label].append(time.perf_counter() - t0)
    bw = 8 * d / statistics.median(copy_runs)
    print(
        f"compute only: 1 process, 1 CPU device, {d:,} float32 entries ({len(shapes)} leaves), "
        f"median of {repeats} round-robin runs; copy bandwidth {bw / 1e9:.2f} GB/s"
    )
    head = f"{'method':<34}{'ms':>9}{'floor B':>10}{'floor ms':>10}{'x floor':>9}{'x prev':>8}"
    print(head)
    print("-" * len(head))
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    for label, (_, units, prev) in table.items():
        floor_b = units * 4 * d
        floor_ms = 1e3 * floor_b / bw
        ratio = f"{med[label] / med[prev]:>8.2f}" if prev in med else f"{'':>8}"
        print(
            f"{label:<34}{med[label]:>9.2f}{_common.fmt_bytes(floor_b):>10}{floor_ms:>10.2f}"
            f"{med[label] / floor_ms:>9.1f}{ratio}"
        )


if __name__ == "__main__":
    main()
