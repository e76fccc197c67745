"""Overhead of jaxopt_dist's transforms against hand-written optax + lax.pmean.

Question: does building a data-parallel step from jaxopt_dist pieces cost
anything over the equivalent hand-written code? On a ~5M-parameter MLP over 8
(simulated CPU) devices, one full training step (forward, backward,
aggregation, optimizer) is timed for

* ``optax.chain(jd.all_reduce(), jd.sgd(lr, momentum=0.9))`` vs
  ``lax.pmean`` of the gradients + ``optax.sgd(lr, momentum=0.9)``;
* ``optax.chain(jd.all_reduce(), jd.adam(lr))`` vs ``lax.pmean`` + ``optax.adam(lr)``.

Both sides run in the same process, inside the same ``jax.shard_map`` step
(only the optimizer differs), interleaved round by round so that drift in
machine load hits both equally. Reported: median step time of each and
their ratio (target <= 1.02).

Run: ``python benchmarks/bench_overhead.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import sys
import time

import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd

P = jax.sharding.PartitionSpec


def mlp_params(sizes, seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def loss_fn(params, batch):
    h = batch["x"]
    n = len(params) // 2
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"][None, :]
        if i < n - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def hand_pmean(axis_name="data"):
    """The baseline aggregation, written directly with lax.pmean."""

    def update_fn(updates, state, params=None):
        del params
        return jax.lax.pmean(updates, axis_name), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def build_step(tx, mesh, params):
    """A plain shard_map training step with replicated params and state."""

    def body(p, s, batch):
        p_var = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), p)
        loss, grads = jax.value_and_grad(loss_fn)(p_var, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "data")

    rep = jax.sharding.NamedSharding(mesh, P())
    state = jax.device_put(tx.init(params), rep)
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())),
        donate_argnums=(0, 1),
    )
    return fn, state


def time_pair(pair, mesh, params, batch, rounds, steps_per_round):
    """Interleaved timing of two optimizers; returns per-step times (s) of each."""
    runs = []
    for tx in pair:
        fn, state = build_step(tx, mesh, params)
        p = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
        p = jax.tree.map(jnp.copy, p)
        for _ in range(3):  # compile and warm up
            p, state, loss = fn(p, state, batch)
        jax.block_until_ready(loss)
        runs.append([fn, p, state])
    times = [[], []]
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            fn, p, state = runs[i]
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                p, state, loss = fn(p, state, batch)
            jax.block_until_ready((p, state, loss))
            times[i].append((time.perf_counter() - t0) / steps_per_round)
            runs[i][1], runs[i][2] = p, state
    return times


def main(argv=None):
    ap = _common.parser(__doc__, quick_help="tiny model, few steps (smoke test)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps-per-round", type=int, default=4)
    args = ap.parse_args(argv)

    n = jax.device_count()
    mesh = _common.data_mesh(n)
    sizes = [64, 128, 10] if args.quick else [1024, 2048, 1536, 10]
    rounds, spr = (3, 2) if args.quick else (args.rounds, args.steps_per_round)
    params = mlp_params(sizes)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(1)
    batch_size = 32 * n
    batch = {
        "x": jnp.asarray(rng.standard_normal((batch_size, sizes[0])), jnp.float32),
        "y": jnp.asarray(rng.integers(0, sizes[-1], batch_size), jnp.int32),
    }
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))

    pairs = {
        "sgd momentum 0.9": (
            optax.chain(jd.all_reduce(), jd.sgd(0.01, momentum=0.9)),
            optax.chain(hand_pmean(), optax.sgd(0.01, momentum=0.9)),
        ),
        "adam": (
            optax.chain(jd.all_reduce(), jd.adam(1e-3)),
            optax.chain(hand_pmean(), optax.adam(1e-3)),
        ),
    }
    print(
        f"MLP {sizes}: {n_params / 1e6:.2f}M parameters, {n} devices ({jax.devices()[0].platform}), "
        f"global batch {batch_size}, {rounds} rounds x {spr} steps, medians"
    )
    print(
        _common.markdown_header(
            ["optimizer", "jaxopt_dist ms/step", "optax + pmean ms/step", "ratio"], "lrrr"
        )
    )
    worst = 0.0
    for name, pair in pairs.items():
        ours, theirs = time_pair(pair, mesh, params, batch, rounds, spr)
        a, b = np.median(ours) * 1e3, np.median(theirs) * 1e3
        worst = max(worst, a / b)
        print(_common.markdown_row([name, f"{a:.2f}", f"{b:.2f}", f"{a / b:.3f}"]))
    print(f"worst ratio {worst:.3f} (target <= 1.02): {'PASS' if worst <= 1.02 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
