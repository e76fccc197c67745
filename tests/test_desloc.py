"""desloc_adam: DES-LOC against a NumPy loop over steps and workers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src.desloc import DesLocAdamState, desloc_adam
from tests import helpers, test_checkpoint, test_sharded_transforms

P = jax.sharding.PartitionSpec
SHAPES = {"a": (3,), "b": (2, 2), "c": (1,)}
LR, B1, B2, EPS = 0.05, 0.9, 0.95, 1e-8
T = 9


# ----------------------------------------------------------------------------
# The reference.


def _mean(trees, k):
    acc = np.zeros_like(trees[0][k])
    for tree in trees:
        acc = acc + tree[k]
    return (acc / np.float32(len(trees))).astype(np.float32)


def np_desloc_step(x, u, v, g, t, K, *, lr=LR, b1=B1, b2=B2, eps=EPS, wd=0.0, bias_correction=False):
    """One step of every worker: ``x``, ``u``, ``v``, ``g`` are lists (one per worker) of dicts.

    Averages first (the pre-update values, each on its own period), then the local update.
    """
    kx, ku, kv = K
    n = len(x)
    lr_t = np.float32(lr(t) if callable(lr) else lr)
    f32 = np.float32
    c1 = f32(1 - b1 ** (t + 1)) if bias_correction else f32(1)
    c2 = f32(1 - b2 ** (t + 1)) if bias_correction else f32(1)
    new_x, new_u, new_v = [], [], []
    for i in range(n):
        xi, ui, vi = {}, {}, {}
        for k in x[i]:
            u_prev = _mean(u, k) if t % ku == 0 else u[i][k]
            v_prev = _mean(v, k) if t % kv == 0 else v[i][k]
            x_hat = _mean(x, k) if t % kx == 0 else x[i][k]
            ui[k] = f32(b1) * u_prev + f32(1 - b1) * g[i][k]
            vi[k] = f32(b2) * v_prev + f32(1 - b2) * g[i][k] * g[i][k]
            step = (ui[k] / c1) / np.sqrt(vi[k] / c2 + f32(eps) * f32(eps))
            xi[k] = x_hat - lr_t * (step + f32(wd) * x_hat)
        new_x.append(xi)
        new_u.append(ui)
        new_v.append(vi)
    return new_x, new_u, new_v


def np_init(params, n):
    """Every worker's copy of the parameters, and zero moments: ``(x, u, v)``, lists of dicts."""
    x = [{k: np.asarray(p, np.float32).copy() for k, p in params.items()} for _ in range(n)]
    u = [{k: np.zeros_like(p) for k, p in x[0].items()} for _ in range(n)]
    v = [{k: np.zeros_like(p) for k, p in x[0].items()} for _ in range(n)]
    return x, u, v


def np_desloc(grads, params, K, **hp):
    """Per-worker parameters and moments after ``T`` steps; ``grads`` leaves are ``(T, n, ...)``."""
    names = list(params)
    steps, n = grads[names[0]].shape[:2]
    x, u, v = np_init(params, n)
    for t in range(steps):
        g = [{k: grads[k][t, i] for k in names} for i in range(n)]
        x, u, v = np_desloc_step(x, u, v, g, t, K, **hp)
    return x, u, v


def _data(n, steps=T, seed=0):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((steps, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return grads, params


def _rows(stacked, i):
    return {k: np.asarray(x)[i] for k, x in stacked.items()}


def _make(K, **kw):
    kw.setdefault("learning_rate", LR)
    kw.setdefault("b1", B1)
    kw.setdefault("b2", B2)
    kw.setdefault("eps", EPS)
    lr = kw.pop("learning_rate")
    return desloc_adam(lr, sync_every=K[0], momentum_sync_every=K[1], variance_sync_every=K[2], **kw)


def _hp(kw):
    """The reference's keywords for the transform's."""
    names = {"learning_rate": "lr", "weight_decay": "wd", "bias_correction": "bias_correction"}
    return {names[k]: v for k, v in kw.items()}


SCHEDULE = optax.linear_schedule(LR, 0.01, 8)
REFERENCE = [  # (backend, n, (K_x, K_u, K_v), options)
    ("vmap", 1, (1, 1, 1), {}),
    ("vmap", 2, (2, 3, 6), {}),
    ("vmap", 3, (1, 2, 5), {"learning_rate": SCHEDULE}),
    ("vmap", 4, (3, 3, 3), {"bias_correction": True}),
    ("vmap", 2, (4, 1, 2), {"weight_decay": 0.1}),
    ("shard_map", 1, (2, 3, 6), {}),
    ("shard_map", 2, (1, 1, 1), {"bias_correction": True}),
    ("shard_map", 2, (3, 6, 2), {"learning_rate": SCHEDULE, "weight_decay": 0.1}),
    ("shard_map", 4, (2, 3, 6), {}),
    ("shard_map", 4, (2, 2, 4), {"learning_rate": SCHEDULE}),
]


@pytest.mark.parametrize("backend,n,K,kw", REFERENCE)
def test_matches_numpy_reference(backend, n, K, kw):
    grads, params = _data(n, seed=n + sum(K))
    tx = _make(K, **kw)
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_u, want_v = np_desloc(grads, params, K, **_hp(kw))
    for i in range(n):
        helpers.assert_trees_close(_rows(p, i), want_x[i], rtol=1e-5, atol=1e-6)
        helpers.assert_trees_close(_rows(state.mu, i), want_u[i], rtol=1e-5, atol=1e-7)
        helpers.assert_trees_close(_rows(state.nu, i), want_v[i], rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(state.count) == T)


def test_every_step_matches_and_averages_are_shared():
    """Periods (2, 3, 6), step by step against the reference; at t = 6 (all three average) the
    moments entering the step, ``(mu - (1 - b1) g) / b1``, are the same on both workers."""
    n, K = 2, (2, 3, 6)
    grads, params = _data(n, steps=7, seed=1)
    tx = _make(K)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    p = jax.tree.map(lambda x: jnp.stack([x] * n), params)
    s = jax.vmap(tx.init)(p)
    x, u, v = np_init(params, n)
    for t in range(7):
        g = {k: grads[k][t] for k in SHAPES}
        s, p = run(g, s, p)
        x, u, v = np_desloc_step(x, u, v, [_rows(g, i) for i in range(n)], t, K)
        for i in range(n):
            helpers.assert_trees_close(_rows(p, i), x[i], rtol=1e-5, atol=1e-6)
    # t = 6 averaged all three: (mu - (1 - b1) g) / b1 is the same on both workers.
    g = {k: grads[k][6] for k in SHAPES}
    before = {k: (np.asarray(s.mu[k]) - np.float32(1 - B1) * g[k]) / np.float32(B1) for k in SHAPES}
    for k in SHAPES:
        np.testing.assert_allclose(before[k][0], before[k][1], rtol=1e-5, atol=1e-6)


def test_one_worker_and_no_syncs_are_local_adam():
    """n = 1, or periods longer than the run (only step 0 averages: equal copies, zero moments):
    every worker runs optax's AdamW with eps inside the root on its own gradients."""
    n, steps = 2, 6
    grads, params = _data(n, steps=steps, seed=7)
    ref = optax.adamw(LR, b1=B1, b2=B2, eps=0.0, eps_root=EPS**2, weight_decay=0.1)
    for K, workers in (((1, 1, 1), 1), ((100, 100, 100), 2)):
        g = {k: x[:, :workers] for k, x in grads.items()}
        tx = _make(K, bias_correction=True, weight_decay=0.1)
        _, p, _ = helpers.run_steps(tx, g, params, backend="vmap", per_worker_params=True)
        for i in range(workers):
            want = {k: jnp.asarray(x) for k, x in params.items()}
            s = ref.init(want)
            for t in range(steps):
                u, s = ref.update({k: jnp.asarray(g[k][t, i]) for k in SHAPES}, s, want)
                want = optax.apply_updates(want, u)
            helpers.assert_trees_close(_rows(p, i), want, rtol=2e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# Communication.


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("K", [(1, 1, 1), (2, 3, 6), (4, 4, 4), (3, 1, 2)])
def test_communication_cost_is_the_sum_of_three_periodic_all_reduces(n, K):
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
    size = 4 * (16 * 8 + 8)  # float32 params, and float32 moments
    period = math.lcm(*K)
    cost = jd.communication_cost(_make(K), params, num_workers=n, steps=period, start=0)
    factor = 2 * (n - 1) / n  # ring all-reduce
    assert cost.sent_bytes == pytest.approx(size * sum(1 / k for k in K) * factor)
    assert cost.compression_ratio == pytest.approx(1 / sum(1 / k for k in K))
    for s in cost.steps:  # nothing on the steps where no state is averaged
        syncs = sum(s.step % k == 0 for k in K)
        assert s.sent_bytes == pytest.approx(size * syncs * factor), s.step
        assert {c.kind for c in s.collectives} <= {"all_reduce"}


def test_communication_cost_auto_period_and_paper_ratio():
    """steps=None finds the period; at the paper's K_u = 3 K_x, K_v = 6 K_x a worker sends
    1.5 / K_x of a dense all-reduce per step (half of Local Adam's 3 / K_x)."""
    params = {"w": jnp.zeros((16, 8))}
    dense = jd.communication_cost(jd.all_reduce(), params, num_workers=4)
    cost = jd.communication_cost(_make((4, 12, 24)), params, num_workers=4)
    assert "repeats every 24 step" in " ".join(cost.notes)
    assert cost.sent_bytes == pytest.approx(dense.sent_bytes * 1.5 / 4)
    local_adam = jd.communication_cost(_make((4, 4, 4)), params, num_workers=4)
    assert local_adam.sent_bytes == pytest.approx(2 * cost.sent_bytes)


def test_no_collective_outside_the_sync_branches():
    """Under shard_map each average sits in a conditional of its own: three, and no collective
    at the top level of the program."""
    mesh = helpers.make_mesh(2)
    tx = _make((2, 3, 6))

    def body(g, p):
        g, p = jax.tree.map(lambda x: x[0], (g, p))
        u, _ = tx.update(g, tx.init(p), p)
        return jax.tree.map(lambda x: x[None], u)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=True)
    stacked = jax.device_put({"w": jnp.ones((2, 4, 3))}, jax.sharding.NamedSharding(mesh, P("data")))
    jaxpr = jax.make_jaxpr(f)(stacked, stacked).jaxpr
    inner = jaxpr.eqns[0].params["jaxpr"]
    top = [e.primitive.name for e in inner.eqns]
    assert top.count("cond") == 3
    assert not [name for name in top if name.startswith(("psum", "pmean", "all_gather"))]


# ----------------------------------------------------------------------------
# Through data_parallel_step: per-worker parameters, resume, reshard, sharded leaves.


def _desloc_step(mesh, K=(3, 4, 6), **kw):
    tx = _make(K, **kw)
    return jd.data_parallel_step(test_checkpoint._loss, tx, mesh=mesh, per_worker_params=True)


def test_data_parallel_step_matches_reference():
    """Each worker's gradient, taken by jax.grad on its own rows of the batch, fed to the reference."""
    tc = test_checkpoint
    n, K, steps = 2, (2, 3, 6), 5
    step = _desloc_step(helpers.make_mesh(n), K)
    p0 = tc._params0()
    params, state = step.init(p0)
    assert all(x.sharding.spec == P("data") and x.shape[0] == n for x in jax.tree.leaves(params))
    x, u, v = np_init(p0, n)
    grad = jax.jit(jax.grad(tc._loss))
    for t in range(steps):
        batch = tc._batch(t)
        rows = len(batch["x"]) // n
        g = []
        for i in range(n):
            local = {k: b[i * rows : (i + 1) * rows] for k, b in batch.items()}
            g.append(
                {
                    k: np.asarray(a)
                    for k, a in grad({k: jnp.asarray(a) for k, a in x[i].items()}, local).items()
                }
            )
        x, u, v = np_desloc_step(x, u, v, g, t, K)
        params, state, _ = step(params, state, batch)
    for i in range(n):
        helpers.assert_trees_close(_rows(params, i), x[i], rtol=1e-5, atol=1e-6)


def test_replicated_params_are_refused():
    tx = _make((2, 2, 2))
    step = jd.data_parallel_step(test_checkpoint._loss, tx, mesh=helpers.make_mesh(2))
    with pytest.raises(ValueError, match="per_worker_params=True"):
        step.init(test_checkpoint._params0())


def test_resume_from_checkpoint_is_bit_identical(tmp_path, monkeypatch):
    """Through test_checkpoint's harness: 10 steps, save, 10 more; restore and continue (periods
    (3, 4, 6) are mid-period at step 10)."""
    family = test_checkpoint.Family(
        lambda: _make((3, 4, 6), weight_decay=0.01), per_worker_state=True, per_worker_params=True
    )
    monkeypatch.setitem(test_checkpoint.FAMILIES, "desloc_adam", family)
    test_checkpoint.test_resume_from_checkpoint_is_bit_identical("desloc_adam", tmp_path)


def test_resume_mid_period_with_schedule(tmp_path):
    """A scheduled learning rate and bias correction carry over an orbax checkpoint bit for bit."""
    tc = test_checkpoint
    mesh = helpers.make_mesh(2)

    def make():
        return _desloc_step(mesh, (2, 3, 5), learning_rate=SCHEDULE, bias_correction=True)

    step = make()
    p0 = tc._params0()
    params, state = step.init(p0)
    params, state, _ = tc._run(step, params, state, 0, 4)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(4, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
        mngr.wait_until_finished()
    params, state, losses = tc._run(step, params, state, 4, 9)
    fresh = make()
    abstract = dict(zip(("params", "opt_state"), fresh.abstract_init(p0)))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(4, args=ocp.args.StandardRestore(abstract))
    params2, state2, losses2 = tc._run(fresh, restored["params"], restored["opt_state"], 4, 9)
    assert losses2 == losses
    helpers.assert_trees_equal(params2, params)
    helpers.assert_trees_equal(state2, state)
    mask = fresh.placement(p0).per_worker
    assert isinstance(mask, DesLocAdamState)
    assert not mask.count and all(jax.tree.leaves(mask.mu)) and all(jax.tree.leaves(mask.nu))


@pytest.mark.parametrize("m", [2, 3])
def test_reshard_regroups_params_and_moments(m):
    """4 -> m workers: parameters (reshard_params) and both moments (reshard_opt_state) are
    regrouped so that their mean over workers is kept; the new state trains on m workers."""
    tc = test_checkpoint
    p0 = tc._params0()
    step4 = _desloc_step(helpers.make_mesh(4))
    params, state = step4.init(p0)
    params, state, _ = tc._run(step4, params, state, 0, 5)
    tx = _make((3, 4, 6))
    new_state = jd.reshard_opt_state(state, tx, p0, num_workers=m, per_worker_params=True)
    new_params = jd.reshard_params(params, num_workers=m)
    assert int(new_state.count) == 5
    for old, new in [(params, new_params), (state.mu, new_state.mu), (state.nu, new_state.nu)]:
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
            assert b.shape == (m, *a.shape[1:])
            np.testing.assert_allclose(np.mean(b, 0), np.mean(np.asarray(a), 0), rtol=1e-6, atol=1e-7)
    mesh = helpers.make_mesh(m)
    step = _desloc_step(mesh)
    placed_state = jd.place_opt_state(new_state, tx, p0, mesh=mesh, per_worker_params=True)
    placed_params = jax.device_put(new_params, jax.sharding.NamedSharding(mesh, P("data")))
    params, state = placed_params, placed_state
    for t in range(5, 8):
        rows = len(tc._batch(t)["x"]) // m * m  # 15 rows for 3 workers
        params, state, metrics = step(params, state, {k: b[:rows] for k, b in tc._batch(t).items()})
        assert np.isfinite(float(metrics["loss"]))
    assert int(state.count) == 8


def test_sharded_params_match_replicated():
    """A 2 data x 4 fsdp mesh gives the 2-worker replicated-mesh run's parameters; moments sharded
    like their parameters."""
    test_sharded_transforms.test_sharded_params_match_replicated(
        lambda: _make((1, 2, 3), learning_rate=1e-2), True, {}, atol=1e-6
    )


# ----------------------------------------------------------------------------
# Arguments and the optax contract.


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(sync_every=0), ValueError, "`sync_every` must be an int >= 1"),
        (dict(momentum_sync_every=2.0), TypeError, "momentum_sync_every"),
        (dict(variance_sync_every=-3), ValueError, "variance_sync_every"),
        (dict(learning_rate=-0.1), ValueError, "learning_rate"),
        (dict(b1=1.0), ValueError, r"`b1` must lie in \[0, 1\)"),
        (dict(b2=-0.5), ValueError, "b2"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay"),
        (dict(bias_correction=1), TypeError, "bias_correction"),
        (dict(axis_name=["data"]), TypeError, "axis_name"),
        (dict(b1="0.9"), TypeError, "b1"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    full = dict(learning_rate=0.1, sync_every=2, momentum_sync_every=4, variance_sync_every=8)
    full.update(kwargs)
    lr = full.pop("learning_rate")
    with pytest.raises(exc, match=match):
        desloc_adam(lr, **full)


def test_needs_params_and_a_bound_axis():
    tx = _make((1, 1, 1))
    with pytest.raises(ValueError, match=r"`desloc_adam` needs `params` \(it averages the parameters\)"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(jd.UnboundAxisError, match="desloc_adam"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)), jnp.ones(3))


def test_optax_contract():
    """No recompilation, unknown extra args, abstract init, bf16 parameters with float32 moments,
    stable dtypes over steps with and without averages, in a chain after gradient clipping."""
    params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), _make((2, 3, 4), learning_rate=SCHEDULE))
    abstract = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    assert abstract[1].mu["w"].dtype == jnp.float32 and abstract[1].nu["b"].dtype == jnp.float32
    s, p = helpers.check_bf16_contract(tx, params, steps=7)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))


def test_inject_hyperparams():
    """Periods static; learning rate, betas, eps and weight decay injected: the plain transform's numbers."""
    K = (2, 3, 6)
    inject = optax.inject_hyperparams(
        desloc_adam, static_args=("sync_every", "momentum_sync_every", "variance_sync_every")
    )
    tx = inject(
        LR, sync_every=2, momentum_sync_every=3, variance_sync_every=6, b1=B1, b2=B2, weight_decay=0.1
    )
    n = 2
    grads, params = _data(n, steps=7, seed=3)
    _, p, state = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=True)
    want_x, _, _ = np_desloc(grads, params, K, wd=0.1)
    for i in range(n):
        # 1 - b is rounded in float32 for an injected b, in double for a Python float.
        helpers.assert_trees_close(_rows(p, i), want_x[i], rtol=1e-5, atol=1e-5)
    assert float(state.hyperparams["learning_rate"][0]) == pytest.approx(LR)
