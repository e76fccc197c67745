"""Dion against a NumPy reference that loops over workers, plus its properties, optimizer and contract."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import dion as dion_mod
from tests import helpers

P = jax.sharding.PartitionSpec

# Flax layout (d_in, d_out). At rank_fraction 0.5: "tall" (8, 4) -> r 2, compressed; "wide" (4, 8)
# -> compressed, transposed; "square" (5, 5) -> r 3 and (5 + 5) 3 > 25: dense (the switch);
# "conv" (2, 3, 4) viewed as (6, 4) -> r 2, compressed; "b" is not a matrix (mean).
SHAPES = {"tall": (8, 4), "wide": (4, 8), "square": (5, 5), "conv": (2, 3, 4), "b": (4,)}
MU, EPS = 0.9, 1e-8
SMALL = {"tall": (8, 4), "square": (5, 5), "b": (4,)}  # one of each kind, for quicker compilations
FLAT = {k: s for k, s in SHAPES.items() if k != "conv"}  # every orientation, no reshape


def _grads_seq(T, n, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in shapes.items()}


def _zeros(shapes=SHAPES):
    return {k: np.zeros(s, np.float32) for k, s in shapes.items()}


def _as_lists(tree_seq):
    leaves = jax.tree.leaves(tree_seq)
    T, n = leaves[0].shape[:2]
    return [[[np.asarray(x[t, w], np.float64) for x in leaves] for w in range(n)] for t in range(T)]


# ----------------------------------------------------------------------------
# NumPy reference, written in PyTorch's layout X = K^T (d_out, d_in), as the reference code.


def np_plan(shapes, rf, k=1, masked=()):
    plans = []
    for i, s in enumerate(shapes):
        if len(s) < 2 or i in masked:
            plans.append(None)
            continue
        d_in, d_out = math.prod(s[:-1]), s[-1]
        m, n = d_out, d_in  # X is (m, n)
        r = min(k * math.ceil(rf * min(m, n) / k), m, n)
        plans.append(
            dict(d_in=d_in, d_out=d_out, r=r, transposed=m < n, compressed=rf < 1 and (m + n) * r < m * n)
        )
    return plans


def np_dion(grads, q0, shapes, *, rf, k=1, mu=MU, eps=EPS, masked=()):
    """Dion over T steps; ``grads[t][w][i]``; ``q0`` the initial Q of each matrix leaf (in order);
    ``mu`` a float or a schedule.

    Returns the outputs of every step (leaf layout), the final momenta ``M[w][i]`` (leaf layout, None
    off matrices) and the final Q's.
    """
    T, n = len(grads), len(grads[0])
    mus = [float(mu(t)) if callable(mu) else mu for t in range(T)]
    plans = np_plan(shapes, rf, k, masked)
    mats = [i for i, p in enumerate(plans) if p is not None]
    Q = {i: np.asarray(q, np.float64) for i, q in zip(mats, q0)}
    M = [{i: np.zeros((plans[i]["d_out"], plans[i]["d_in"])) for i in mats} for _ in range(n)]
    outputs = []
    for t in range(T):
        out = [None] * len(shapes)
        for i, pl in enumerate(plans):
            gs = [grads[t][w][i] for w in range(n)]
            if pl is None:
                out[i] = sum(gs) / n
                continue
            gx = [g.reshape(pl["d_in"], pl["d_out"]).T for g in gs]
            if not pl["compressed"]:
                gx = [sum(gx) / n] * n
            B = [M[w][i] + gx[w] for w in range(n)]
            Bt = [b.T if pl["transposed"] else b for b in B]
            p_mean = sum(bt @ Q[i] for bt in Bt) / n
            if not p_mean.any():  # the guard
                big_p, big_r = np.zeros_like(p_mean), Q[i]
            else:
                big_p = np.linalg.qr(p_mean)[0]
                big_r = sum(bt.T @ big_p for bt in Bt) / n
            fb = big_p @ big_r.T
            fb = fb.T if pl["transposed"] else fb
            for w in range(n):
                M[w][i] = B[w] - (1 - mus[t]) * fb
            Q[i] = big_r / (np.linalg.norm(big_r, axis=0, keepdims=True) + eps)
            d = big_p @ Q[i].T
            d = d.T if pl["transposed"] else d
            out[i] = (math.sqrt(pl["d_out"] / pl["d_in"]) * d).T.reshape(shapes[i])
        outputs.append(out)
    momenta = [
        [M[w][i].T.reshape(shapes[i]) if i in M[w] else None for i in range(len(shapes))] for w in range(n)
    ]
    return outputs, momenta, [Q[i] for i in mats]


def assert_q_close(got, want, **tol):
    """Q's agree up to the signs of their columns."""
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        signs = np.sign(np.sum(g * w, axis=0, keepdims=True))
        signs[signs == 0] = 1
        np.testing.assert_allclose(g * signs, w, **tol)


def _reference(kwargs, grads_seq, params, masked=()):
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    q0 = [np.asarray(q) for q in jd.scale_by_dion(**kwargs).init(params).q]
    return np_dion(
        _as_lists(grads_seq),
        q0,
        shapes,
        rf=kwargs.get("rank_fraction", 1.0),
        k=kwargs.get("rank_multiple_of", 1),
        mu=kwargs.get("mu", 0.95),
        eps=kwargs.get("eps", 1e-8),
        masked=masked,
    )


TOL = dict(rtol=2e-4, atol=2e-5)


def _assert_matches(kwargs, grads, params, updates, momentum, q):
    """One run against ``np_dion``: ``updates`` leaves ``(T, ...)``, ``momentum`` leaves stacked over
    the workers of ``grads``, ``q`` one copy."""
    want, want_m, want_q = _reference(kwargs, grads, params)
    for i, x in enumerate(jax.tree.leaves(updates)):
        for t in range(len(want)):
            np.testing.assert_allclose(np.asarray(x)[t], want[t][i], err_msg=f"step {t} leaf {i}", **TOL)
    got_m = jax.tree.leaves(momentum)
    mat_idx = [i for i, m in enumerate(want_m[0]) if m is not None]
    for w in range(len(want_m)):
        for j, i in enumerate(mat_idx):
            np.testing.assert_allclose(np.asarray(got_m[j])[w], want_m[w][i], err_msg=f"M {w} {i}", **TOL)
    assert_q_close([np.asarray(x) for x in q], want_q, **TOL)


def test_matches_numpy_reference_with_the_zero_guard_and_linear_in_the_workers():
    # Compressed (tall, wide, conv), dense by the size rule (square) and mean (b) leaves together.
    # Step 0: every worker's gradient is zero (P = 0, R = Q_old: no update, Q normalized); step 1:
    # worker 0's alone is zero (no special case). The shard_map backend (replication proven by
    # out_specs) is covered by the optimizer's reference test below.
    n, T = 3, 4
    kwargs = {"rank_fraction": 0.5, "mu": MU}
    grads = _grads_seq(T, n, seed=3)
    for g in grads.values():
        g[0] = 0.0
        g[1, 0] = 0.0
    params = _zeros()
    updates, _, state = helpers.run_steps(jd.scale_by_dion(**kwargs), grads, params, backend="vmap")
    for q in state.q:
        helpers.assert_replicas_equal(q)
    _assert_matches(kwargs, grads, params, updates, state.momentum, [q[0] for q in state.q])
    for k, u in updates.items():
        u = np.asarray(u)
        assert np.all(np.isfinite(u)) and np.all(u[0] == 0), k
        assert np.abs(u[2]).sum() > 0, k
    # The map is linear in the B_i: the outputs and mean_i M_i evolve exactly as one-worker Dion fed
    # the mean gradient ...
    mean = jax.tree.map(lambda g: g.mean(axis=1, keepdims=True), grads)
    mean_m = jax.tree.map(lambda m: np.asarray(m).mean(axis=0, keepdims=True), state.momentum)
    _assert_matches(kwargs, mean, params, updates, mean_m, [q[0] for q in state.q])
    # ... while the workers' own momenta differ.
    assert not np.allclose(np.asarray(state.momentum["tall"])[0], np.asarray(state.momentum["tall"])[1])


def test_local_mode_is_one_worker_with_no_communication():
    # axis_name=None on two workers (vmap, per-worker): worker 0 gives exactly what a bound one-worker
    # run gives, worker 1 (all-zero gradients) stays at zero with no NaN: nothing is exchanged.
    T = 3
    kwargs = {"rank_fraction": 0.5, "mu": MU}
    grads = _grads_seq(T, 2, seed=4, shapes=SMALL)
    for g in grads.values():
        g[:, 1] = 0.0
    params = _zeros(SMALL)
    local = jd.scale_by_dion(**kwargs, axis_name=None)
    u_loc, _, s_loc = helpers.run_steps(local, grads, params, backend="vmap", per_worker_params=True)
    # The bound one-worker run goes through optax.inject_hyperparams (with the shape-setting
    # arguments static), which changes nothing.
    one = jax.tree.map(lambda g: g[:, :1], grads)
    injected = optax.inject_hyperparams(
        jd.scale_by_dion, static_args=("rank_fraction", "rank_multiple_of", "seed")
    )(**kwargs)
    u_one, _, s_one = helpers.run_steps(injected, one, params, backend="vmap")
    assert isinstance(s_one.inner_state, jd.DionState)
    s_one = s_one.inner_state
    _assert_matches(kwargs, one, params, u_one, s_one.momentum, [q[0] for q in s_one.q])
    worker = lambda tree, w: jax.tree.map(lambda x: np.asarray(x)[w], tree)  # noqa: E731
    # (to rounding: the QR's of a batch of two and of one round differently)
    helpers.assert_trees_close(jax.tree.map(lambda u: u[:, 0], u_loc), u_one, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(worker(s_loc, 0), worker(s_one, 0), rtol=1e-5, atol=1e-6)
    assert all(np.all(np.asarray(u)[:, 1] == 0) for u in jax.tree.leaves(u_loc))
    assert all(np.all(np.asarray(m)[1] == 0) for m in jax.tree.leaves(s_loc.momentum))
    # The guard: Q is the initial Q with unit columns.
    for q0, q in zip(local.init(params).q, s_loc.q):
        want = np.asarray(q0) / np.linalg.norm(np.asarray(q0), axis=0)
        np.testing.assert_allclose(np.asarray(q)[1], want, rtol=1e-6)
    # No collectives: it traces with no axis bound, and the whole optimizer costs nothing.
    jax.eval_shape(lambda g: local.update(g, local.init(g)), params)
    tx = jd.dion(0.01, rank_fraction=0.5, axis_name=None)
    cost = jd.communication_cost(tx, params, num_workers=4, steps=1)
    assert cost.calls == 0 and not cost.steps[0].collectives


def test_full_rank_dense_path_with_a_mu_schedule_has_muons_momentum():
    # rank_fraction=1: every matrix is dense; at full rank P R^T = B, so M_t = mu_t B_t with
    # B_t = M_{t-1} + mean G_t (Muon's momentum), here with a scheduled mu.
    n, T = 2, 3
    sched = lambda c: jnp.where(c < 1, 0.9, 0.5)  # noqa: E731
    kwargs = {"mu": sched}
    grads = _grads_seq(T, n, seed=1, shapes=FLAT)
    params = _zeros(FLAT)
    updates, _, state = helpers.run_steps(jd.scale_by_dion(**kwargs), grads, params, backend="vmap")
    _assert_matches(kwargs, grads, params, updates, state.momentum, [q[0] for q in state.q])
    for k in ("tall", "wide", "square"):
        m = np.zeros(FLAT[k])
        for t in range(T):
            m = float(sched(t)) * (m + grads[k][t].astype(np.float64).mean(axis=0))
        helpers.assert_replicas_equal(state.momentum[k])
        np.testing.assert_allclose(np.asarray(state.momentum[k])[0], m, rtol=1e-4, atol=1e-5, err_msg=k)


# ----------------------------------------------------------------------------
# Plan: rank rounding, orientation, the switch.


def test_rank_rounding_orientation_and_switch():
    params = {
        "a": jnp.zeros((16, 8)),  # d_in 16, d_out 8: b 8
        "c": jnp.zeros((2, 4, 12)),  # viewed as (8, 12): b 8
        "s": jnp.zeros((4, 4)),  # r 2: (4 + 4) 2 == 16, no gain: dense
        "v": jnp.zeros(3),
    }
    kinds = jd.dion_leaves(params, rank_fraction=0.3)
    assert kinds == {"a": "compressed", "c": "compressed", "s": "dense", "v": "mean"}
    # ceil(0.3 * 8) = 3; multiples of 2: 4; of 16: clipped to 8 (and then dense: no gain).
    for k, want in ((1, 3), (2, 4), (16, 8)):
        state = jax.eval_shape(jd.scale_by_dion(0.3, rank_multiple_of=k).init, params)
        # Q is (shorter side, r), one per matrix leaf in leaf order (a, c, s).
        assert [q.shape for q in state.q] == [(8, want), (8, want), (4, min(4, 2 if k == 1 else k))]
    assert jd.dion_leaves(params, rank_fraction=0.3, rank_multiple_of=16)["a"] == "dense"
    assert jd.dion_leaves(params, rank_fraction=1.0)["a"] == "dense"  # full rank: always dense
    # Orientation by shape: P along the longer side, a square matrix in PyTorch's layout (B~ = K^T).
    plan = dion_mod._plan(jax.tree.leaves(params), [False] * 4, 0.3, 1)
    assert [(p.a, p.b, p.transpose) for p in plan[:3]] == [(16, 8, False), (12, 8, True), (4, 4, True)]
    # scalar_mask sends a matrix to the mean, as a tree or a callable; the state follows.
    masked = jd.dion_leaves(params, rank_fraction=0.3, scalar_mask=lambda p: {k: k == "a" for k in p})
    assert masked["a"] == "mean"
    tx = jd.scale_by_dion(0.3, scalar_mask={"a": True, "c": False, "s": False, "v": False})
    state = jax.eval_shape(tx.init, params)
    assert isinstance(state.momentum["a"], optax.MaskedNode) and len(state.q) == 2


def test_two_fused_all_reduces():
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    found = helpers.traced_collectives(jd.scale_by_dion(0.5), params, 4)
    assert len(found) == 2 and all(name.startswith("psum") for name, _ in found), found
    # The first carries the P-side products (tall 8x2, wide 8x2, conv 6x2) and the averaged
    # gradients (square 25, b 4); the second the R's (4x2 each): float32.
    assert [b for _, b in found] == [4 * (16 + 16 + 12 + 25 + 4), 4 * (8 + 8 + 8)]
    # No compressed matrix: one all-reduce of every gradient.
    found = helpers.traced_collectives(jd.scale_by_dion(1.0), params, 4)
    assert [b for _, b in found] == [4 * sum(math.prod(s) for s in SHAPES.values())]
    # The whole optimizer: the scalar leaves ride in the first all-reduce.
    cost = jd.communication_cost(jd.dion(0.01, rank_fraction=0.5), params, num_workers=4, steps=1)
    assert cost.calls == 2
    for c in cost.steps[0].collectives:
        assert c.kind == "all_reduce" and len(c.operands) == 1 and len(c.operands[0][0]) == 1


# ----------------------------------------------------------------------------
# The optimizer.


def np_dion_optimizer(grads, params0, q0, lr, *, rf, mu, wd, eps=1e-8, masked=()):
    """dion(): the NumPy Dion directions, decoupled weight decay, AdamW (0.9, 0.95) on the rest."""
    shapes = [np.shape(x) for x in params0]
    T, n = len(grads), len(grads[0])
    dirs, _, _ = np_dion(grads, q0, shapes, rf=rf, mu=mu, eps=eps, masked=masked)
    plans = np_plan(shapes, rf, masked=masked)
    x = [np.asarray(p, np.float64) for p in params0]
    m = [np.zeros(s) for s in shapes]
    v = [np.zeros(s) for s in shapes]
    for t in range(T):
        for i, pl in enumerate(plans):
            if pl is not None:
                x[i] = x[i] - lr(t) * (dirs[t][i] + wd * x[i])
                continue
            g = sum(grads[t][w][i] for w in range(n)) / n
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.95 * v[i] + 0.05 * g * g
            mh, vh = m[i] / (1 - 0.9 ** (t + 1)), v[i] / (1 - 0.95 ** (t + 1))
            x[i] = x[i] - lr(t) * (mh / (np.sqrt(vh) + eps) + wd * x[i])
    return x


def test_dion_optimizer_matches_reference():
    # Under shard_map(check_vma=True), where run_steps proves the updates and parameters replicated
    # (out_specs=P()); vmap runs the same numbers in the tests above.
    n, T = 3, 3
    rng = np.random.default_rng(5)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in FLAT.items()}
    grads = _grads_seq(T, n, seed=6, shapes=FLAT)
    lr = optax.linear_schedule(0.1, 0.02, T)
    # "tall" goes to AdamW by the mask, as an embedding would.
    tx = jd.dion(
        lr, rank_fraction=0.5, mu=MU, weight_decay=0.1, scalar_mask=lambda p: {k: k == "tall" for k in p}
    )
    _, final, _ = helpers.run_steps(tx, grads, params, backend="shard_map")
    leaves = jax.tree.leaves(params)
    masked = (jax.tree.structure(params).flatten_up_to({k: k == "tall" for k in params}).index(True),)
    q0 = [np.asarray(q) for q in tx.init(params)[0].q]
    want = np_dion_optimizer(
        _as_lists(grads), leaves, q0, lambda t: float(lr(t)), rf=0.5, mu=MU, wd=0.1, masked=masked
    )
    for got, w, k in zip(jax.tree.leaves(final), want, sorted(params)):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5, err_msg=k)


# ----------------------------------------------------------------------------
# Data-parallel training: sharded parameters, per-worker parameters, DiLoCo's inner optimizer.


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None])
    return jnp.mean(jnp.sum((h @ p["w2"] + p["b2"][None] - b["y"]) ** 2, axis=-1))


def _mlp_problem(steps):
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((8, 16)) / np.sqrt(8)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.standard_normal((16, 8)) / 4).astype(np.float32),
        "b2": np.zeros(8, np.float32),
    }
    batches = [{k: rng.standard_normal((8, 8)).astype(np.float32) for k in ("x", "y")} for _ in range(steps)]
    return params, batches


@pytest.mark.devices(4)
def test_sharded_params_match_replicated():
    params, batches = _mlp_problem(3)
    specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}
    assert set(jax.tree.leaves(jd.dion_leaves(params, rank_fraction=0.25))) == {"compressed", "mean"}

    def train(mesh, param_specs):
        tx = jd.dion(0.02, rank_fraction=0.25)
        step = jd.data_parallel_step(_mlp_loss, tx, mesh=mesh, param_specs=param_specs)
        p, s = step.init(params)
        for batch in batches:
            p, s, _ = step(p, s, batch)
        return p, s

    got, state = train(jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4]), specs)
    want, _ = train(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), None)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for k in ("w1", "w2"):  # sharded like the parameter, stacked over the data axis (per-worker momentum)
        m = state[0].momentum[k]
        spec = tuple(m.sharding.spec) + (None,) * (3 - len(m.sharding.spec))
        assert spec == ("data", *specs[k], *(None,) * (2 - len(specs[k]))), m.sharding.spec


def test_per_worker_params_need_a_local_dion():
    # Dion's updates are replicated: per-worker parameters would never be reconciled.
    params, batches = _mlp_problem(1)
    mesh = helpers.make_mesh(2)
    step = jd.data_parallel_step(
        _mlp_loss, jd.dion(0.02, rank_fraction=0.25), mesh=mesh, per_worker_params=True
    )
    with pytest.raises(
        ValueError,
        match=r"`scale_by_dion` got per-worker parameters \(varying over 'data'.*axis_name=None for a local Dion",
    ):
        p, s = step.init(params)
        step(p, s, batches[0])


@pytest.mark.parametrize("muloco", [False, True], ids=["diloco", "muloco"])
def test_local_dion_as_diloco_inner_optimizer(muloco):
    params, batches = _mlp_problem(4)
    inner = jd.dion(0.02, rank_fraction=0.25, axis_name=None)
    # MuLoCo quantizes the matrices (its skip_norm_quantization sends the biases dense).
    matrices = lambda leaves: [np.ndim(x) >= 2 for x in leaves]  # noqa: E731
    aggregate = jd.statistical_quantize(2, mask=matrices) if muloco else None
    tx = jd.diloco(inner, sync_every=2, aggregate=aggregate)
    step = jd.data_parallel_step(_mlp_loss, tx, mesh=helpers.make_mesh(2), per_worker_params=True)
    mask = step.placement(params).per_worker
    assert not any(jax.tree.leaves(mask.anchor))  # replicated
    dion_mask = mask.inner_state[0]
    assert all(jax.tree.leaves((dion_mask.momentum, dion_mask.q)))  # Dion's M and Q: per-worker
    p, s = step.init(params)
    for t, batch in enumerate(batches):
        p, s, _ = step(p, s, batch)
        local = [np.asarray(x) for x in jax.tree.leaves(p)]
        assert all(np.all(np.isfinite(x)) for x in local)
        # The workers drift apart between synchronisations and start again from the anchor (to
        # rounding: each adds the update new anchor - x_i to its own x_i).
        synced = t % 2 == 1
        assert all(np.allclose(x[0], x[1], rtol=1e-6, atol=1e-7) for x in local) == synced, t
    helpers.assert_trees_close(jax.tree.map(lambda x: np.asarray(x)[0], p), s.anchor, rtol=1e-6, atol=1e-7)
    assert not any(any(x.sharding.spec) for x in jax.tree.leaves(s.anchor))  # placed replicated


# ----------------------------------------------------------------------------
# optax contract and bad inputs.


def test_contract_bf16_one_compilation():
    # (inject_hyperparams: in the local-mode test; a scheduled mu: in the full-rank test)
    params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in SMALL.items()}
    helpers.check_bf16_contract(jd.dion(0.01, rank_fraction=0.5), params, steps=2, replicated=True)


def test_invariant_updates_are_taken_as_the_sum():
    # Under shard_map(check_vma=True), gradients that arrive already summed (typed invariant) give what
    # the per-worker gradients with that sum give (Dion depends on them only through their mean).
    n = 2
    shapes = {"tall": (8, 4), "b": (4,)}
    grads = jax.tree.map(lambda g: g[0], _grads_seq(1, n, seed=9, shapes=shapes))
    tx = jd.scale_by_dion(0.5)
    params = _zeros(shapes)

    def both(g):
        per_worker = tx.update(g, tx.init(params))[0]
        summed = tx.update(jax.lax.psum(g, "data"), tx.init(params))[0]
        return per_worker, summed

    want, got = helpers.run_on_workers(both, grads, backend="shard_map")
    helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_float0_leaves_pass_through_and_the_scalar_optimizer_sees_the_mean_gradient():
    def step(w, c, x, y):
        p = {"w": w, "b": jnp.zeros(4), "z": c}

        def loss(p):
            out = jnp.sum(jnp.tanh(p["w"] * x)) + jnp.sum(p["b"] * y)
            return out * (1 + 0 * p["z"]).astype(jnp.float32)

        g = jax.grad(loss, allow_int=True)(p)
        tx = jd.dion(0.1, rank_fraction=0.5, weight_decay=0.0, scalar_optimizer=optax.sgd(1.0))
        out, _ = tx.update(g, tx.init(p), p)
        assert out["z"].dtype == jax.dtypes.float0
        return out["w"], out["b"]

    rng = np.random.default_rng(0)
    w = np.broadcast_to(rng.standard_normal((8, 4)).astype(np.float32), (2, 8, 4))
    y = rng.standard_normal((2, 4)).astype(np.float32)
    out, b = helpers.run_on_workers(
        step, w, np.full((2,), 7, np.int32), rng.standard_normal((2, 8, 4)), y, backend="vmap"
    )
    assert np.all(np.isfinite(np.asarray(out))) and np.abs(np.asarray(out)).sum() > 0
    np.testing.assert_allclose(np.asarray(b), -y.mean(axis=0), rtol=1e-6)


def test_bad_inputs():

    with pytest.raises(ValueError, match=r"`rank_fraction` must lie in \(0, 1\]; got 0"):
        jd.scale_by_dion(0.0)
    with pytest.raises(ValueError, match=r"`rank_fraction` must lie in \(0, 1\]; got 1.5"):
        jd.dion(0.01, rank_fraction=1.5)
    with pytest.raises(TypeError, match=r"`rank_fraction` must be a Python float"):
        jd.scale_by_dion("half")
    with pytest.raises(ValueError, match=r"`rank_multiple_of` must be an int >= 1; got 0"):
        jd.scale_by_dion(rank_multiple_of=0)
    with pytest.raises(ValueError, match=r"`mu` must lie in \[0, 1\]; got 1.5"):
        jd.scale_by_dion(mu=1.5)
    with pytest.raises(ValueError, match=r"`eps` must lie in \[0, inf\)"):
        jd.scale_by_dion(eps=-1.0)
    with pytest.raises(TypeError, match=r"`seed` must be a Python int"):
        jd.scale_by_dion(seed=0.5)
    with pytest.raises(ValueError, match=r"`learning_rate` must lie in \[0, inf\)"):
        jd.dion(-0.1)
    with pytest.raises(ValueError, match=r"`weight_decay` must lie in \[0, inf\)"):
        jd.dion(0.1, weight_decay=-1.0)
    with pytest.raises(TypeError, match=r"`scalar_optimizer` must be an optax.GradientTransformation"):
        jd.dion(0.1, scalar_optimizer="adamw")
    with pytest.raises(TypeError, match=r"`scalar_mask` must be None, a pytree of bools"):
        jd.dion(0.1, scalar_mask="embed")
    with pytest.raises(ValueError, match=r"`invariant_updates` must be one of"):
        jd.scale_by_dion(invariant_updates="max")
    with pytest.raises(TypeError, match=r"`axis_name` must be a hashable name or a tuple"):
        jd.scale_by_dion(axis_name=["data"])
    with pytest.raises(ValueError, match=r"`scalar_mask` must be a pytree of bools with the structure"):
        jd.scale_by_dion(scalar_mask={"x": True}).init({"a": jnp.zeros((2, 2))})
    tx = jd.scale_by_dion(axis_name="batch")
    with pytest.raises(jd.UnboundAxisError, match=r"`scale_by_dion` communicates over the axis 'batch'"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(jnp.ones((2, 4, 4)))
