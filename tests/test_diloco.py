"""diloco: DiLoCo and Streaming DiLoCo against a NumPy loop over workers and steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxopt_dist as jd
from tests import helpers, test_checkpoint
from tests.test_lowbit import np_low_bit

SHAPES = {"a": (3,), "b": (2, 2), "c": (4,), "d": (1,)}  # leaves in order a, b, c, d
INNER_LR, INNER_MOM = 0.1, 0.5
OUTER_LR, OUTER_MOM = 0.7, 0.9


def _inner():
    return optax.sgd(INNER_LR, momentum=INNER_MOM)


def np_diloco(grads, params, *, H, F=1, tau=0, alpha=0.0, groups=None, aggregate=None):
    """Per-worker params and the anchor after T steps; a plain loop over steps, workers, fragments.

    ``grads``: {name: (T, n, ...)}. Inner: SGD with momentum (PyTorch form);
    outer: Nesterov SGD (lr 0.7, momentum 0.9), one momentum per fragment.
    ``aggregate(deltas_of_workers, f) -> mean`` (default: sum over workers / n).
    """
    names = list(SHAPES)
    T, n = grads[names[0]].shape[:2]
    groups = groups or [list(range(f, len(names), F)) for f in range(F)]
    x = [{k: params[k].copy() for k in names} for _ in range(n)]
    mom = [{k: np.zeros_like(params[k]) for k in names} for _ in range(n)]
    anchor = {k: params[k].copy() for k in names}
    buf = [{names[i]: np.zeros_like(params[names[i]]) for i in g} for g in groups]
    pending = [None] * F
    for t in range(T):
        local = []
        for i in range(n):
            new = {}
            for k in names:
                mom[i][k] = grads[k][t, i] + np.float32(INNER_MOM) * mom[i][k]
                new[k] = x[i][k] - np.float32(INNER_LR) * mom[i][k]
            local.append(new)
        phase = t % H
        for f, g in enumerate(groups):
            keys = [names[i] for i in g]
            apply_at = (f + 1) * (H // F) - 1
            if phase == apply_at - tau:
                deltas = [{k: anchor[k] - local[i][k] for k in keys} for i in range(n)]
                if aggregate is None:
                    mean = {}
                    for k in keys:
                        acc = np.zeros_like(anchor[k])
                        for i in range(n):
                            acc = acc + deltas[i][k]
                        mean[k] = acc / np.float32(n)
                else:
                    mean = aggregate(deltas, f)
                pending[f] = mean
            if phase == apply_at:
                for k in keys:
                    d = pending[f][k]
                    buf[f][k] = np.float32(OUTER_MOM) * buf[f][k] + d
                    anchor[k] = anchor[k] - np.float32(OUTER_LR) * (d + np.float32(OUTER_MOM) * buf[f][k])
                    for i in range(n):
                        local[i][k] = (1 - np.float32(alpha)) * anchor[k] + np.float32(alpha) * local[i][k]
        for i in range(n):
            for k in names:
                x[i][k] = x[i][k] + (local[i][k] - x[i][k])  # applied as an update
    return x, anchor


def _data(n, T, seed=0):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return grads, params


def _check(params_stacked, state, want_x, want_anchor, n):
    for i in range(n):
        got = {k: np.asarray(v)[i] for k, v in params_stacked.items()}
        helpers.assert_trees_close(got, want_x[i], rtol=1e-5, atol=1e-5)
    helpers.assert_replicas_equal(state.anchor)
    helpers.assert_trees_close(
        {k: np.asarray(v)[0] for k, v in state.anchor.items()}, want_anchor, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("backend,n", [("vmap", 1), ("vmap", 8), ("shard_map", 2), ("shard_map", 4)])
def test_diloco_matches_reference(backend, n):
    T, H = 9, 3
    grads, params = _data(n, T, seed=n)
    tx = jd.diloco(_inner(), sync_every=H)
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_anchor = np_diloco(grads, params, H=H)
    _check(p, state, want_x, want_anchor, n)
    if n > 1:  # T % H == 0: every worker ends on the new anchor, up to one rounding
        for k in SHAPES:
            rows = np.asarray(p[k])
            np.testing.assert_allclose(rows, np.broadcast_to(rows[0], rows.shape), rtol=0, atol=1e-6)


STREAMING = [  # (backend, n, F, tau, alpha, assignment)
    ("vmap", 2, 2, 1, 0.0, "strided"),
    ("vmap", 3, 4, 1, 0.25, "strided"),
    ("vmap", 2, 1, 2, 0.3, "strided"),
    ("shard_map", 4, 2, 1, 0.5, "strided"),
    ("shard_map", 2, 4, 0, 0.0, "contiguous"),
]


@pytest.mark.parametrize("backend,n,F,tau,alpha,assignment", STREAMING)
def test_streaming_diloco_matches_reference(backend, n, F, tau, alpha, assignment):
    H = 12 if F == 4 else 6
    T = 2 * H + 4
    grads, params = _data(n, T, seed=10 + n)
    tx = jd.diloco(
        _inner(), sync_every=H, num_fragments=F, sync_delay=tau, mixing=alpha, fragment_assignment=assignment
    )
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    groups = jd.diloco_fragments(params, F, assignment=assignment)
    want_x, want_anchor = np_diloco(grads, params, H=H, F=F, tau=tau, alpha=alpha, groups=groups)
    _check(p, state, want_x, want_anchor, n)


def test_fragments_assignment():
    params = {k: np.zeros(s) for k, s in SHAPES.items()}  # sizes 3, 4, 4, 1
    assert jd.diloco_fragments(params, 2) == [[0, 2], [1, 3]]
    assert jd.diloco_fragments(params, 2, assignment="contiguous") == [[0, 1], [2, 3]]
    assert jd.diloco_fragments(params, 4, assignment="contiguous") == [[0], [1], [2], [3]]
    big = {"a": np.zeros(100), "b": np.zeros(1), "c": np.zeros(1), "d": np.zeros(98)}
    assert jd.diloco_fragments(big, 2, assignment="contiguous") == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="num_fragments"):
        jd.diloco_fragments(params, 5)


def test_anchor_moves_only_at_its_fragment_schedule():
    """With tau = 1 the outer step of fragment f lands after step (f + 1) H / F - 1, not before."""
    n, H, F, tau = 2, 8, 2, 1
    grads, params = _data(n, H)
    tx = jd.diloco(_inner(), sync_every=H, num_fragments=F, sync_delay=tau)
    groups = jd.diloco_fragments(params, F)
    names = list(SHAPES)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    p = jax.tree.map(lambda x: jnp.stack([x] * n), params)
    state = jax.vmap(tx.init)(p)
    for t in range(H):
        state, p = run({k: v[t] for k, v in grads.items()}, state, p)
        a = {k: np.asarray(v)[0] for k, v in state.anchor.items()}
        for f, grp in enumerate(groups):
            moved = any(not np.array_equal(a[names[i]], params[names[i]]) for i in grp)
            assert moved == (t >= (f + 1) * H // F - 1), (t, f)
            pending = any(np.any(np.asarray(x) != 0) for x in state.pending[f])
            assert pending == (t >= (f + 1) * H // F - 1 - tau), (t, f)


def test_low_bit_aggregate_composes():
    n, H, F, T = 2, 4, 2, 10
    grads, params = _data(n, T, seed=3)
    tx = jd.diloco(_inner(), sync_every=H, num_fragments=F, aggregate=jd.low_bit(block_size=4))
    _, p, state = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=True)
    groups = jd.diloco_fragments(params, F)
    names = list(SHAPES)
    grid = jd.float_grid(3, 0)
    residual = {
        f: [np.zeros(sum(int(np.prod(SHAPES[names[i]])) for i in g), np.float32)] * n
        for f, g in enumerate(groups)
    }

    def aggregate(deltas, f):
        keys = [names[i] for i in groups[f]]
        xs = [np.concatenate([d[k].ravel() for k in keys]) + residual[f][i] for i, d in enumerate(deltas)]
        out, sent = np_low_bit(xs, grid, 4)
        residual[f] = [x - s for x, s in zip(xs, sent)]
        res, off = {}, 0
        for k in keys:
            size = int(np.prod(SHAPES[k]))
            res[k] = out[off : off + size].reshape(SHAPES[k])
            off += size
        return res

    want_x, want_anchor = np_diloco(grads, params, H=H, F=F, groups=groups, aggregate=aggregate)
    _check(p, state, want_x, want_anchor, n)
    assert all(np.any(np.asarray(r) != 0) for r in jax.tree.leaves(state.aggregate_states[0].residual))


def test_top_k_aggregate_runs_under_shard_map():
    n, H = 4, 2
    grads, params = _data(n, 6, seed=4)
    tx = jd.diloco(_inner(), sync_every=H, aggregate=jd.top_k(k=3))
    _, p, state = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    helpers.assert_replicas_equal(state.anchor)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(p))


def test_communication_cost_per_period_and_peak():
    params = {"w": jnp.zeros((64, 32)), "v": jnp.zeros((32, 32)), "b": jnp.zeros(32), "c": jnp.zeros(10)}
    dense = jd.communication_cost(jd.all_reduce(), params, num_workers=8)
    cost = jd.communication_cost(jd.diloco(optax.adamw(1e-3), sync_every=8), params, num_workers=8, steps=16)
    assert cost.sent_bytes == pytest.approx(dense.sent_bytes / 8)
    assert cost.peak_sent_bytes == pytest.approx(dense.sent_bytes)
    assert cost.compression_ratio == pytest.approx(8)
    tx = jd.diloco(optax.adamw(1e-3), sync_every=8, num_fragments=2, fragment_assignment="contiguous")
    frag = jd.communication_cost(tx, params, num_workers=8, steps=16)
    assert frag.sent_bytes == pytest.approx(dense.sent_bytes / 8)
    groups = jd.diloco_fragments(params, 2, assignment="contiguous")
    sizes = [x.size for x in jax.tree.leaves(params)]
    biggest = max(sum(sizes[i] for i in g) for g in groups)
    assert frag.peak_sent_bytes == pytest.approx(dense.sent_bytes * biggest / sum(sizes))
    delayed = jd.communication_cost(
        jd.diloco(optax.adamw(1e-3), sync_every=8, num_fragments=2, sync_delay=3), params, num_workers=8
    )
    assert delayed.sent_bytes == pytest.approx(dense.sent_bytes / 8)
    sends = [s.step % 8 for s in delayed.steps if s.sent_bytes > 0]
    assert sorted(set(sends)) == [0, 4]  # taken tau = 3 steps before the applications at 3 and 7
    quant = jd.communication_cost(
        jd.diloco(optax.adamw(1e-3), sync_every=8, num_fragments=2, aggregate=jd.low_bit()),
        params,
        num_workers=8,
    )
    assert 7 * 8 < quant.compression_ratio < 8 * 8


def test_data_parallel_step_and_bit_exact_resume(tmp_path):
    """Checkpoint mid-period (with a delayed fragment in flight) and resume bit for bit."""
    tc = test_checkpoint
    mesh = helpers.make_mesh(tc.N_WORKERS)

    def make():
        tx = jd.diloco(
            optax.adamw(1e-2),
            sync_every=4,
            num_fragments=2,
            sync_delay=1,
            mixing=0.25,
            aggregate=jd.low_bit(block_size=8),
        )
        return jd.data_parallel_step(tc._loss, tx, mesh=mesh, per_worker_params=True)

    step = make()
    p0 = tc._params0()
    params, opt_state = step.init(p0)
    params, opt_state, _ = tc._run(step, params, opt_state, 0, 5)  # a fragment pending at step 5
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(5, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        mngr.wait_until_finished()
    params, opt_state, losses = tc._run(step, params, opt_state, 5, 11)
    fresh = make()
    abstract = dict(zip(("params", "opt_state"), fresh.abstract_init(p0)))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(5, args=ocp.args.StandardRestore(abstract))
    params2, opt_state2, losses2 = tc._run(fresh, restored["params"], restored["opt_state"], 5, 11)
    assert losses2 == losses
    helpers.assert_trees_equal(params2, params)
    helpers.assert_trees_equal(opt_state2, opt_state)
    mask = fresh.placement(p0).per_worker
    assert mask.anchor == jax.tree.map(lambda _: False, p0)  # replicated
    assert any(jax.tree.leaves(mask.inner_state))  # the moments are per-worker
    assert all(x.sharding.spec[0] == "data" for x in jax.tree.leaves(params2))


def test_bad_arguments():
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="multiple of `num_fragments`"):
        jd.diloco(inner, sync_every=10, num_fragments=3)
    with pytest.raises(ValueError, match="sync_delay"):
        jd.diloco(inner, sync_every=8, num_fragments=2, sync_delay=4)
    with pytest.raises(ValueError, match="sync_delay"):
        jd.diloco(inner, sync_every=8, sync_delay=-1)
    with pytest.raises(ValueError, match="mixing"):
        jd.diloco(inner, sync_every=8, mixing=1.5)
    with pytest.raises(TypeError, match="sync_every"):
        jd.diloco(inner, sync_every=2.0)
    with pytest.raises(ValueError, match="sync_every"):
        jd.diloco(inner, sync_every=0)
    with pytest.raises(TypeError, match="outer"):
        jd.diloco(inner, sync_every=2, outer="sgd")
    with pytest.raises(TypeError, match="inner"):
        jd.diloco(None, sync_every=2)
    with pytest.raises(ValueError, match="fragment_assignment"):
        jd.diloco(inner, sync_every=2, fragment_assignment="random")
    tx = jd.diloco(inner, sync_every=2, num_fragments=2)
    with pytest.raises(ValueError, match="num_fragments"):
        tx.init(jnp.zeros(3))  # one leaf, two fragments
    tx = jd.diloco(inner, sync_every=2)
    with pytest.raises(
        ValueError, match=r"`diloco` needs `params`: call it as tx.update\(updates, state, params\)"
    ):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(jd.UnboundAxisError, match="diloco"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)), jnp.ones(3))


def test_mixing_schedule_and_jit_contract():
    n, H, T = 2, 2, 6
    grads, params = _data(n, T, seed=5)
    tx = jd.diloco(_inner(), sync_every=H, mixing=optax.constant_schedule(0.5))
    _, p, state = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=True)
    want_x, want_anchor = np_diloco(grads, params, H=H, alpha=0.5)
    _check(p, state, want_x, want_anchor, n)
    helpers.assert_dtypes_equal(state, jax.vmap(tx.init)(jax.tree.map(lambda x: jnp.stack([x] * n), params)))


CONTRACT = {
    "diloco": lambda: jd.diloco(optax.adamw(1e-2), sync_every=2),
    "streaming": lambda: jd.diloco(
        optax.sgd(0.1), sync_every=4, num_fragments=2, sync_delay=1, mixing=0.5, aggregate=jd.low_bit()
    ),
}


@pytest.mark.parametrize("name", list(CONTRACT))
def test_optax_contract(name):
    """No recompilation, unknown extra args, abstract init, MultiSteps on bf16 with stable dtypes."""
    params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
    tx = optax.MultiSteps(CONTRACT[name](), every_k_schedule=2)
    s, p = helpers.check_bf16_contract(tx, params, steps=8)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))
    helpers.assert_replicas_equal(s.inner_opt_state.anchor)


def test_inject_hyperparams_mixing():
    tx = optax.inject_hyperparams(jd.diloco, static_args=("sync_every", "num_fragments", "sync_delay"))(
        _inner(), sync_every=2, mixing=0.5
    )
    n = 2
    grads, params = _data(n, 4, seed=6)
    _, p, state = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=True)
    want_x, _ = np_diloco(grads, params, H=2, alpha=0.5)
    for i in range(n):
        helpers.assert_trees_close(
            {k: np.asarray(v)[i] for k, v in p.items()}, want_x[i], rtol=1e-5, atol=1e-5
        )
