"""How far apart do gossiping workers drift, and what does it cost in accuracy against an all-reduce?

Protocol. A 64-32-10 tanh MLP on scikit-learn's digits (1440 train / 357
test images), 8 simulated workers with ``jd.data_parallel_step``, 16
examples per worker and step, momentum SGD (lr 0.1, momentum 0.9), the same
initialisation and batch sequence for every run:

* ``all-reduce``: ``chain(all_reduce(), sgd(...))``, replicated parameters;
* ``ring``, ``torus`` (2 x 4), ``exponential`` (one-peer, time-varying) and
  ``complete``: ``chain(sgd(...), gossip(topology, track_consensus=True))``
  with per-worker parameters.

Reported per topology: the spectral gap of its mixing matrix (for the
time-varying exponential graph, of one round's matrix), the bytes each worker
sends per step (``communication_cost``), the consensus distance
(mean squared distance of the workers' parameters to their mean, from the
transform's state) after several step counts, and the final test accuracy
of the workers (mean over workers) and of their averaged parameters.

``--non-iid`` gives each worker the images of only some classes (worker
``i`` draws from classes ``{i, i+1, i+2} mod 10``), where consensus matters
more. No timings.

Run: ``python benchmarks/bench_gossip.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import numpy as np
import optax

import jaxopt_dist as jd

N_WORKERS = _common.N_WORKERS
TOPOLOGIES = {
    "ring": {"topology": "ring"},
    "torus 2x4": {"topology": "torus", "shape": (2, 4)},
    "exponential": {"topology": "exponential"},
    "complete": {"topology": "complete"},
}


def batch_sampler(y, per_worker, non_iid, seed=1):
    """Yields index arrays of shape (N_WORKERS * per_worker,): worker i's rows are block i."""
    rng = np.random.default_rng(seed)
    if non_iid:
        pools = [np.nonzero(np.isin(y, [(i + k) % 10 for k in range(3)]))[0] for i in range(N_WORKERS)]
    else:
        pools = [np.arange(len(y))] * N_WORKERS
    while True:
        yield np.concatenate([rng.choice(pool, per_worker) for pool in pools])


def train(tx, data, *, per_worker_params, steps, log_at, per_worker, non_iid):
    x, y, x_test, y_test = data
    mesh = _common.data_mesh(N_WORKERS)
    step = jd.data_parallel_step(_common.mlp_loss, tx, mesh=mesh, per_worker_params=per_worker_params)
    params, state = step.init(_common.mlp_init())
    sampler = batch_sampler(y, per_worker, non_iid)
    distances = {}
    for t in range(1, steps + 1):
        idx = next(sampler)
        params, state, _ = step(params, state, {"x": x[idx], "y": y[idx]})
        if t in log_at and per_worker_params:
            distances[t] = float(state[1].consensus_distance)
    if per_worker_params:
        stacked = jax.device_get(params)
        workers = [
            float(_common.mlp_accuracy(jax.tree.map(lambda a, i=i: a[i], stacked), x_test, y_test))
            for i in range(N_WORKERS)
        ]
        averaged = float(
            _common.mlp_accuracy(jax.tree.map(lambda a: a.mean(axis=0), stacked), x_test, y_test)
        )
        return distances, float(np.mean(workers)), averaged
    acc = float(_common.mlp_accuracy(params, x_test, y_test))
    return distances, acc, acc


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--non-iid", action="store_true", help="each worker sees 3 of the 10 classes")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (30 if args.quick else 600)
    log_at = sorted({s for s in (1, 10, 30, 100, 300, steps) if s <= steps})
    lr, momentum, per_worker = 0.1, 0.9, 16
    data = _common.load_digits()
    params = _common.mlp_init()
    header = (
        f"{'method':<14}{'gap':>7}{'sent/step':>11}"
        + "".join(f"{'cd@' + str(s):>10}" for s in log_at)
        + f"{'acc(workers)':>14}{'acc(avg)':>10}"
    )
    kind = "non-iid (3 classes per worker)" if args.non_iid else "iid"
    print(
        f"digits MLP, {N_WORKERS} workers x {per_worker} examples, {kind}, sgd(lr={lr}, momentum={momentum}), {steps} steps"
    )
    print("cd@t: consensus distance after t steps (mean squared distance of worker params to their mean)")
    print(header)
    print("-" * len(header))
    runs = {"all-reduce": (optax.chain(jd.all_reduce(), jd.sgd(lr, momentum)), False, None)}
    for name, kwargs in TOPOLOGIES.items():
        tx = optax.chain(jd.sgd(lr, momentum), jd.gossip(**kwargs, track_consensus=True))
        runs[name] = (tx, True, kwargs)
    for name, (tx, per_worker_params, kwargs) in runs.items():
        if kwargs is None:
            gap, cost_tx = "-", jd.all_reduce()
        else:
            w = jd.mixing_matrix(kwargs["topology"], N_WORKERS, shape=kwargs.get("shape"))
            gap = f"{jd.spectral_gap(w):.3f}"
            cost_tx = jd.gossip(**kwargs)
        sent = jd.communication_cost(cost_tx, params, num_workers=N_WORKERS).sent_bytes
        distances, acc_workers, acc_avg = train(
            tx,
            data,
            per_worker_params=per_worker_params,
            steps=steps,
            log_at=log_at,
            per_worker=per_worker,
            non_iid=args.non_iid,
        )
        cells = "".join(f"{distances[s]:>10.2e}" if s in distances else f"{'0':>10}" for s in log_at)
        print(f"{name:<14}{gap:>7}{sent / 1e3:>9.2f}kB{cells}{acc_workers:>14.4f}{acc_avg:>10.4f}")


if __name__ == "__main__":
    main()
