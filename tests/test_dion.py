"""Dion against a NumPy reference that loops over workers, plus its properties, optimizer and contract."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

P = jax.sharding.PartitionSpec

# Flax layout (d_in, d_out). At rank_fraction 0.5: "tall" (8, 4) -> r 2, compressed; "wide" (4, 8)
# -> compressed, transposed; "square" (5, 5) -> r 3 and (5 + 5) 3 > 25: dense (the switch);
# "conv" (2, 3, 4) viewed as (6, 4) -> r 2, compressed; "b" is not a matrix (mean).
SHAPES = {"tall": (8, 4), "wide": (4, 8), "square": (5, 5), "conv": (2, 3, 4), "b": (4,)}
MU, EPS = 0.9, 1e-8
SMALL = {"tall": (8, 4), "square": (5, 5), "b": (4,)}  # one of each kind, for quicker compilations


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
    """Dion over T steps; ``grads[t][w][i]``; ``q0`` the initial Q of each matrix leaf (in order).

    Returns the outputs of every step (leaf layout), the final momenta ``M[w][i]`` (leaf layout, None
    off matrices) and the final Q's.
    """
    T, n = len(grads), len(grads[0])
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
                M[w][i] = B[w] - (1 - mu) * fb
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


def _check(kwargs, backend, n, T=4, seed=0, grads=None):
    grads = _grads_seq(T, n, seed) if grads is None else grads
    params = _zeros()
    updates, _, state = helpers.run_steps(jd.scale_by_dion(**kwargs), grads, params, backend=backend)
    want, want_m, want_q = _reference(kwargs, grads, params)
    leaves = [np.asarray(x) for x in jax.tree.leaves(updates)]
    for t in range(T):
        for i, x in enumerate(leaves):
            np.testing.assert_allclose(x[t], want[t][i], err_msg=f"step {t} leaf {i}", **TOL)
    got_m = jax.tree.leaves(state.momentum)
    mat_idx = [i for i, m in enumerate(want_m[0]) if m is not None]
    for w in range(n):
        for j, i in enumerate(mat_idx):
            np.testing.assert_allclose(np.asarray(got_m[j])[w], want_m[w][i], err_msg=f"M {w} {i}", **TOL)
    assert_q_close([np.asarray(q)[0] for q in state.q], want_q, **TOL)
    for q in state.q:
        helpers.assert_replicas_equal(q)
    return updates, state


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_numpy_reference(backend, n):
    # Compressed (tall, wide, conv), dense by the size rule (square) and mean (b) leaves together.
    _check({"rank_fraction": 0.5, "mu": MU}, backend, n)


def test_full_rank_dense_path_matches_reference_and_momentum_is_muons():
    # rank_fraction=1: every matrix is dense; at full rank P R^T = B, so M_t = mu B_t with
    # B_t = mu B_{t-1} + mean G_t (Muon's momentum).
    n, T = 2, 4
    grads = _grads_seq(T, n, seed=1)
    _, state = _check({"mu": MU}, "vmap", n, T=T, grads=grads)
    for k in ("tall", "wide", "square", "conv"):
        b = np.zeros(SHAPES[k])
        for t in range(T):
            b = MU * b + grads[k][t].astype(np.float64).mean(axis=0)
        m = np.asarray(state.momentum[k])
        helpers.assert_replicas_equal(m)
        np.testing.assert_allclose(m[0], MU * b, rtol=1e-4, atol=1e-5, err_msg=k)


def test_compressed_map_is_linear_in_the_workers_momenta():
    # With the compressed exchange, the outputs and mean_i M_i evolve exactly as one-worker Dion
    # fed the mean gradient.
    n, T = 3, 4
    shapes = {"tall": (8, 4), "wide": (4, 8)}
    kwargs = {"rank_fraction": 0.5, "mu": MU}
    grads = _grads_seq(T, n, seed=2, shapes=shapes)
    mean = jax.tree.map(lambda g: g.mean(axis=1, keepdims=True), grads)
    params = _zeros(shapes)
    assert set(jax.tree.leaves(jd.dion_leaves(params, rank_fraction=0.5))) == {"compressed"}
    u_many, _, s_many = helpers.run_steps(jd.scale_by_dion(**kwargs), grads, params, backend="vmap")
    u_one, _, s_one = helpers.run_steps(jd.scale_by_dion(**kwargs), mean, params, backend="vmap")
    helpers.assert_trees_close(u_many, u_one, rtol=1e-4, atol=1e-5)
    m_many = jax.tree.map(lambda m: np.asarray(m).mean(axis=0), s_many.momentum)
    helpers.assert_trees_close(m_many, jax.tree.map(lambda m: m[0], s_one.momentum), rtol=1e-4, atol=1e-5)
    # ... while the workers' own momenta differ.
    assert not np.allclose(np.asarray(s_many.momentum["tall"])[0], np.asarray(s_many.momentum["tall"])[1])


def test_zero_gradients_no_nan_and_the_documented_guard():
    # Step 0: every worker's gradient is zero (P = 0, R = Q_old: no update, Q normalized);
    # step 1: worker 0's alone is zero (no special case); step 2: all nonzero.
    n, T = 3, 3
    grads = _grads_seq(T, n, seed=3)
    for g in grads.values():
        g[0] = 0.0
        g[1, 0] = 0.0
    kwargs = {"rank_fraction": 0.5, "mu": MU}
    updates, _ = _check(kwargs, "vmap", n, T=T, grads=grads)
    for k, u in updates.items():
        u = np.asarray(u)
        assert np.all(np.isfinite(u)) and np.all(u[0] == 0), k
        assert np.abs(u[2]).sum() > 0, k
    # One step from a fresh state on zeros: M stays zero, Q is the initial Q with unit columns.
    tx = jd.scale_by_dion(**kwargs)
    params = _zeros(SMALL)
    out, state = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(params)), axis_name="data"))(
        jax.tree.map(lambda x: np.zeros((2, *x.shape), np.float32), params)
    )
    assert all(np.all(np.asarray(m) == 0) for m in jax.tree.leaves(state.momentum))
    for q0, q in zip(tx.init(params).q, state.q):
        want = np.asarray(q0) / (np.linalg.norm(np.asarray(q0), axis=0) + EPS)
        np.testing.assert_allclose(np.asarray(q)[0], want, rtol=1e-6)


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
        state = jd.scale_by_dion(0.3, rank_multiple_of=k).init(params)
        # Q is (shorter side, r), one per matrix leaf in leaf order (a, c, s).
        assert [q.shape for q in state.q] == [(8, want), (8, want), (4, min(4, 2 if k == 1 else k))]
    assert jd.dion_leaves(params, rank_fraction=0.3, rank_multiple_of=16)["a"] == "dense"
    assert jd.dion_leaves(params, rank_fraction=1.0)["a"] == "dense"  # full rank: always dense
    # Orientation by shape: P along the longer side, a square matrix in PyTorch's layout (B~ = K^T).
    plan = jd._plan(jax.tree.leaves(params), [False] * 4, 0.3, 1)
    assert [(p.a, p.b, p.transpose) for p in plan[:3]] == [(16, 8, False), (12, 8, True), (4, 4, True)]
    # scalar_mask sends a matrix to the mean, as a tree or a callable; the state follows.
    masked = jd.dion_leaves(params, rank_fraction=0.3, scalar_mask=lambda p: {k: k == "a" for k in p})
    assert masked["a"] == "mean"
    state = jd.scale_by_dion(0.3, scalar_mask={"a": True, "c": False, "s": False, "v": False}).init(params)
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


@pytest.mark.parametrize("backend,n", [("vmap", 2), ("shard_map", 3)])
def test_dion_optimizer_matches_reference(backend, n):
    T = 4
    rng = np.random.default_rng(5)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = _grads_seq(T, n, seed=6)
    lr = optax.linear_schedule(0.1, 0.02, T)
    # "tall" goes to AdamW by the mask, as an embedding would.
    tx = jd.dion(
        lr, rank_fraction=0.5, mu=MU, weight_decay=0.1, scalar_mask=lambda p: {k: k == "tall" for k in p}
    )
    # run_steps checks the updates and params bit-identical on every worker (vmap: at every step;
    # shard_map: proven by out_specs=P()).
    _, final, _ = helpers.run_steps(tx, grads, params, backend=backend)
    leaves = jax.tree.leaves(params)
    masked = (jax.tree.structure(params).flatten_up_to({k: k == "tall" for k in params}).index(True),)
    q0 = [np.asarray(q) for q in tx.init(params)[0].q]
    want = np_dion_optimizer(
        _as_lists(grads), leaves, q0, lambda t: float(lr(t)), rf=0.5, mu=MU, wd=0.1, masked=masked
    )
    for got, w, k in zip(jax.tree.leaves(final), want, sorted(params)):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5, err_msg=k)


def test_custom_scalar_optimizer_sees_the_mean_gradient():
    n = 2
    grads = _grads_seq(1, n, seed=7, shapes=SMALL)
    params = _zeros(SMALL)
    tx = jd.dion(0.1, rank_fraction=0.5, weight_decay=0.0, scalar_optimizer=optax.sgd(1.0))
    updates, _, _ = helpers.run_steps(tx, grads, params, backend="vmap")
    np.testing.assert_allclose(np.asarray(updates["b"])[0], -grads["b"][0].mean(axis=0), rtol=1e-6)


# ----------------------------------------------------------------------------
# Sharded parameters.


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None])
    return jnp.mean(jnp.sum((h @ p["w2"] + p["b2"][None] - b["y"]) ** 2, axis=-1))


@pytest.mark.devices(4)
def test_sharded_params_match_replicated():
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((8, 16)) / np.sqrt(8)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.standard_normal((16, 8)) / 4).astype(np.float32),
        "b2": np.zeros(8, np.float32),
    }
    batches = [
        {
            "x": rng.standard_normal((8, 8)).astype(np.float32),
            "y": rng.standard_normal((8, 8)).astype(np.float32),
        }
        for _ in range(3)
    ]
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


# ----------------------------------------------------------------------------
# optax contract and bad inputs.


def test_contract_bf16_one_compilation_and_inject_hyperparams():
    params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in SMALL.items()}
    helpers.check_bf16_contract(jd.dion(0.01, rank_fraction=0.5), params, steps=2, replicated=True)
    grads = _grads_seq(2, 2, seed=8, shapes=SMALL)
    injected = optax.inject_hyperparams(
        jd.scale_by_dion, static_args=("rank_fraction", "rank_multiple_of", "seed")
    )(0.5, mu=0.9)
    got, _, state = helpers.run_steps(injected, grads, _zeros(SMALL), backend="vmap")
    want, _, _ = helpers.run_steps(jd.scale_by_dion(0.5, mu=0.9), grads, _zeros(SMALL), backend="vmap")
    helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    # A schedule for mu, at full rank where M_t = mu_t B_t: M_1 = 0.5 (0.9 G_0 + G_1) (mean gradients).
    sched = lambda c: jnp.where(c < 1, 0.9, 0.5)  # noqa: E731
    _, _, s = helpers.run_steps(jd.scale_by_dion(1.0, mu=sched), grads, _zeros(SMALL), backend="vmap")
    for k in ("tall", "square"):
        g = grads[k].astype(np.float64).mean(axis=1)
        np.testing.assert_allclose(
            np.asarray(s.momentum[k])[0], 0.5 * (0.9 * g[0] + g[1]), rtol=1e-4, atol=1e-5
        )
    assert isinstance(state.inner_state, jd.DionState)


def test_invariant_updates_are_taken_as_the_sum():
    # Under shard_map(check_vma=True), gradients that arrive already summed (typed invariant) give what
    # the per-worker gradients with that sum give (Dion depends on them only through their mean).
    n = 2
    shapes = {"tall": (8, 4), "b": (4,)}
    grads = jax.tree.map(lambda g: g[0], _grads_seq(1, n, seed=9, shapes=shapes))
    tx = jd.scale_by_dion(0.5)
    params = _zeros(shapes)

    def per_worker(g):
        return tx.update(g, tx.init(params))[0]

    def summed(g):
        return tx.update(jax.lax.psum(g, "data"), tx.init(params))[0]

    want = helpers.run_on_workers(per_worker, grads, backend="shard_map")
    got = helpers.run_on_workers(summed, grads, backend="shard_map")
    helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_float0_leaves_pass_through():
    def step(w, c, x):
        p = {"w": w, "z": c}
        loss = lambda p: jnp.sum(jnp.tanh(p["w"] * x)) * (1 + 0 * p["z"]).astype(jnp.float32)  # noqa: E731
        g = jax.grad(loss, allow_int=True)(p)
        tx = jd.dion(0.1, rank_fraction=0.5)
        out, _ = tx.update(g, tx.init(p), p)
        assert out["z"].dtype == jax.dtypes.float0
        return out["w"]

    rng = np.random.default_rng(0)
    w = np.broadcast_to(rng.standard_normal((8, 4)).astype(np.float32), (2, 8, 4))
    out = helpers.run_on_workers(
        step, w, np.full((2,), 7, np.int32), rng.standard_normal((2, 8, 4)), backend="vmap"
    )
    assert np.all(np.isfinite(np.asarray(out))) and np.abs(np.asarray(out)).sum() > 0


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
