"""hierarchical: dense mean over the fast axis, compression over the slow axis, on 2-D meshes.

Workers form a grid (slow group ``h``, fast rank ``l``) on a mesh
``("dcn", "ici")``. The NumPy reference loops over the grid: the mean over
``l`` inside each group, then PowerSGD (the reference of test_powersgd) over
the groups. Both backends run: nested ``vmap`` with two axis names, and
``shard_map`` (check_vma=True) on 2x2, 2x4 and 4x2 meshes, where the state
is placed by :func:`jaxopt_dist.init_opt_state` (the residual ``P("dcn")``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import hierarchical, powersgd
from jaxopt_dist._src import comm
from tests import helpers
from tests.test_powersgd import np_orthogonalize, np_powersgd

P = jax.sharding.PartitionSpec
AXES = ("dcn", "ici")
SHAPES = {"w": (12, 6), "c": (2, 4, 6), "b": (6,)}
GRIDS = [(2, 2), (2, 4), (4, 2)]


def _grads_seq(T, H, L, seed=0, shapes=SHAPES):
    """Leaves shaped (T, H, L, ...): step, slow group, fast rank."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((T, H, L, *s)).astype(np.float32) for k, s in shapes.items()}


def _zeros(shapes=SHAPES):
    return {k: np.zeros(s, np.float32) for k, s in shapes.items()}


def _lead(spec):
    """The axes of a spec's leading dimension, the others checked unsharded."""
    assert all(x is None for x in tuple(spec)[1:]), spec
    return tuple(spec)[0] if len(spec) else None


def _mesh(H, L):
    if jax.device_count() < H * L:
        pytest.skip(f"needs {H * L} devices")
    return jax.make_mesh((H, L), AXES, devices=jax.devices()[: H * L])


# ----------------------------------------------------------------------------
# NumPy reference over the 2-D worker grid.


def np_hierarchical_powersgd(grads_seq, *, rank, q0):
    """Mean over the fast axis per slow group (explicit loops), then PowerSGD over the groups.

    Returns the outputs of every step and the final residual of each slow group.
    """
    leaves = jax.tree.leaves(grads_seq)
    T, H, L = leaves[0].shape[:3]
    group_means = []  # [t][h][leaf]
    for t in range(T):
        per_step = []
        for h in range(H):
            means = []
            for x in leaves:
                total = np.zeros(x.shape[3:])
                for r in range(L):
                    total += x[t, h, r].astype(np.float64)
                means.append(total / L)
            per_step.append(means)
        group_means.append(per_step)
    return np_powersgd(group_means, rank=rank, q0=q0)


def np_powersgd_step(mats, q):
    """One warm-started PowerSGD step of one matrix over workers: (output, residuals, new Q)."""
    n = len(mats)
    q_in = np_orthogonalize(q[None])[0]
    p_hat = np_orthogonalize((sum(m @ q_in for m in mats) / n)[None])[0]
    q_new = sum(m.T @ p_hat for m in mats) / n
    out = p_hat @ q_new.T
    return out, [m - out for m in mats], q_new


# ----------------------------------------------------------------------------
# Running T steps on the grid.


def run_grid(tx, grads_seq, params, *, backend, H, L):
    """T steps of ``tx`` (updates applied) on an H x L grid of workers.

    Returns ``(updates (T, ...), final params, final state)``. Replicated
    updates and params are checked bit-identical on every worker (vmap) or
    proven so by ``out_specs=P()`` (shard_map). The state comes back as the
    backend holds it: stacked ``(H, L, ...)`` under vmap; placed by
    :func:`jaxopt_dist.init_opt_state` under shard_map.
    """
    T = jax.tree.leaves(grads_seq)[0].shape[0]
    if backend == "vmap":
        grid = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (H, L, *np.shape(x))), t)  # noqa: E731
        p = grid(params)
        state = jax.vmap(jax.vmap(tx.init))(p)

        def step(g, s, p):
            u, s = tx.update(g, s, p)
            return u, s, optax.apply_updates(p, u)

        fn = jax.jit(jax.vmap(jax.vmap(step, axis_name="ici"), axis_name="dcn"))
        ups = []
        for t in range(T):
            u, state, p = fn(jax.tree.map(lambda x: x[t], grads_seq), state, p)
            flat = jax.tree.map(lambda x: x.reshape(H * L, *x.shape[2:]), (u, p))
            helpers.assert_replicas_equal(flat)
            ups.append(jax.tree.map(lambda x: x[0, 0], u))
        return jax.tree.map(lambda *xs: jnp.stack(xs), *ups), jax.tree.map(lambda x: x[0, 0], p), state
    mesh = _mesh(H, L)
    s_spec = jd.opt_state_specs(tx, params, mesh=mesh, axis_name=AXES)
    state = jd.init_opt_state(tx, params, mesh=mesh, axis_name=AXES)
    p = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
    stacked = lambda sp: bool(sp)  # noqa: E731 - P() is empty

    def body(g, s, p):
        g = jax.tree.map(lambda x: x[0, 0], g)
        s = jax.tree.map(lambda x, sp: x[0] if stacked(sp) else x, s, s_spec)
        u, s = tx.update(g, s, p)
        s = jax.tree.map(lambda x, sp: x[None] if stacked(sp) else x, s, s_spec)
        return u, s, optax.apply_updates(p, u)

    g_spec = P("dcn", "ici")
    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(g_spec, s_spec, P()), out_specs=(P(), s_spec, P()), check_vma=True
        )
    )
    ups = []
    for t in range(T):
        g = jax.device_put(jax.tree.map(lambda x: x[t], grads_seq), jax.sharding.NamedSharding(mesh, g_spec))
        u, state, p = fn(g, state, p)
        ups.append(jax.block_until_ready(u))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *ups), p, state


def _group_residuals(state, backend):
    """The residual of each slow group, ``(H, ...)`` per leaf, checked identical within fast groups."""
    res = state[0].slow.residual
    if backend == "vmap":
        for x in jax.tree.leaves(res):
            for h in range(x.shape[0]):
                helpers.assert_replicas_equal(x[h])
        return jax.tree.map(lambda x: np.asarray(x)[:, 0], res)
    return jax.tree.map(np.asarray, res)


# ----------------------------------------------------------------------------
# Reference, replicas, residual per slow group.


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("H,L", GRIDS)
def test_matches_numpy_reference_on_the_grid(backend, H, L):
    T, rank = 3, 2
    grads = _grads_seq(T, H, L, seed=H * 10 + L)
    params = _zeros()
    tx = optax.chain(hierarchical(None, powersgd(rank, axis_name="dcn"), axis_name=AXES))
    updates, _, state = run_grid(tx, grads, params, backend=backend, H=H, L=L)
    q0 = [np.asarray(x) for x in tx.init(params)[0].slow.inner_state.q]
    want, want_res = np_hierarchical_powersgd(grads, rank=rank, q0=q0)
    for t in range(T):
        for i, x in enumerate(jax.tree.leaves(updates)):
            np.testing.assert_allclose(x[t], want[t][i], rtol=1e-5, atol=1e-5, err_msg=f"step {t} leaf {i}")
    res = _group_residuals(state, backend)
    for i, x in enumerate(jax.tree.leaves(res)):
        assert x.shape[0] == H, "one residual per slow group"
        for h in range(H):
            np.testing.assert_allclose(x[h], want_res[h][i], rtol=1e-5, atol=1e-5)
    # The residual is real: PowerSGD rank 2 does not reproduce these gradients.
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(res)) > 1e-2


def test_same_numbers_as_a_plain_chain():
    # hierarchical adds typing checks, not arithmetic: bitwise the chain of its stages.
    grads = _grads_seq(2, 2, 2, seed=3)
    params = _zeros()
    stages = (jd.all_reduce(axis_name="ici"), powersgd(2, axis_name="dcn"))
    got, _, _ = run_grid(hierarchical(*stages, axis_name=AXES), grads, params, backend="vmap", H=2, L=2)
    want, _, _ = run_grid(optax.chain(*stages), grads, params, backend="vmap", H=2, L=2)
    helpers.assert_trees_equal(got, want)


def test_unknown_extra_args_and_no_recompilation():
    tx = hierarchical(None, powersgd(2, axis_name="dcn"), axis_name=AXES)
    grads = jnp.asarray(_grads_seq(1, 2, 2, shapes={"w": (12, 6)})["w"][0])
    traces = []

    def step(g, s):
        traces.append(1)
        return tx.update(g, s, None, some_unknown_extra=1.0)

    fn = jax.jit(jax.vmap(jax.vmap(step, axis_name="ici"), axis_name="dcn"))
    state = jax.vmap(jax.vmap(tx.init))(grads)
    u1, state = fn(grads, state)
    u2, state2 = fn(grads, state)
    assert len(traces) == 1
    helpers.assert_dtypes_equal(state, state2)
    assert not np.array_equal(np.asarray(u1), np.asarray(u2))  # the residual feeds back


def test_bf16_fast_stage_and_replicas_after_many_steps():
    # bf16 on the fast links, PowerSGD on the slow ones, momentum: 25 steps on a 2x4 mesh;
    # params are bit-identical on all 8 devices (out_specs=P() and each device's copy).
    H, L = 2, 4
    grads = _grads_seq(25, H, L, seed=5)
    params = _zeros()
    tx = optax.chain(
        hierarchical(
            jd.all_reduce(axis_name="ici", dtype=jnp.bfloat16), powersgd(2, axis_name="dcn"), axis_name=AXES
        ),
        jd.sgd(0.05, momentum=0.9),
    )
    _, p, state = run_grid(tx, grads, params, backend="shard_map", H=H, L=L)
    for x in jax.tree.leaves(p):
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        assert len(shards) == H * L and all(s.tobytes() == shards[0].tobytes() for s in shards)
    for x in jax.tree.leaves(state[0].slow.residual):
        assert _lead(x.sharding.spec) == "dcn" and x.shape[0] == H
        by_device = {s.device: np.asarray(s.data) for s in x.addressable_shards}
        devs = np.asarray(x.sharding.mesh.devices)
        for h in range(H):
            rows = [by_device[d] for d in devs[h]]
            assert all(r.tobytes() == rows[0].tobytes() for r in rows), "residual differs inside a fast group"
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(p))


def test_state_placement_is_per_slow_group():
    mesh = _mesh(2, 4)
    params = _zeros()
    tx = optax.chain(hierarchical(None, powersgd(2, axis_name="dcn"), axis_name=AXES), jd.sgd(0.1, 0.9))
    placement = jd.opt_state_placement(tx, params, mesh=mesh, axis_name=AXES)
    assert not placement.updates_per_worker
    slow = placement.specs[0].slow
    assert all(sp == P("dcn") for sp in jax.tree.leaves(slow.residual))
    assert all(sp == P() for sp in jax.tree.leaves(slow.inner_state))  # Q factors, count, key
    assert all(sp == P() for sp in jax.tree.leaves(placement.specs[1]))  # momentum
    state = jd.init_opt_state(tx, params, mesh=mesh, axis_name=AXES)
    assert state[0].slow.residual["w"].shape == (2, 12, 6)
    # A flat PowerSGD over both axes keeps one residual per device instead.
    flat = optax.chain(powersgd(2, axis_name=AXES), jd.sgd(0.1))
    flat_specs = jd.opt_state_specs(flat, params, mesh=mesh, axis_name=AXES)
    assert all(sp == P(AXES) for sp in jax.tree.leaves(flat_specs[0].residual))


# ----------------------------------------------------------------------------
# data_parallel_step on a 2-D mesh.


def test_data_parallel_step_on_a_2d_mesh():
    H, L, T, lr = 2, 4, 3, 0.1
    mesh = _mesh(H, L)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, 32, 12)).astype(np.float32)
    y = rng.standard_normal((T, 32, 6)).astype(np.float32)
    tx = optax.chain(hierarchical(None, powersgd(2, axis_name="dcn"), axis_name=AXES), jd.sgd(lr))

    def loss(p, b):
        return jnp.mean(jnp.sum((b["x"] @ p["w"] + p["b"][None] - b["y"]) ** 2, axis=-1))

    params0 = {"w": np.zeros((12, 6), np.float32), "b": np.zeros(6, np.float32)}
    step = jd.data_parallel_step(loss, tx, mesh=mesh, axis_name=AXES)
    p, s = step.init(params0)
    assert _lead(s[0].slow.residual["w"].sharding.spec) == "dcn"
    # The checkpoint restore target has the same layout.
    _, abstract = step.abstract_init(params0)
    res = abstract[0].slow.residual["w"]
    assert res.shape == (H, 12, 6) and _lead(res.sharding.spec) == "dcn"
    for t in range(T):
        p, s, _ = step(p, s, {"x": x[t], "y": y[t]})
    # Reference: worker (h, l) holds rows 4 (L h + l) ..; mean over l, PowerSGD over h, sgd.
    q = np.asarray(tx.init(params0)[0].slow.inner_state.q[0], np.float64)[0]  # (6, 2)
    w, b = params0["w"].astype(np.float64), params0["b"].astype(np.float64)
    residual = [np.zeros((12, 6)) for _ in range(H)]  # the dense bias keeps none
    for t in range(T):
        means = []
        for h in range(H):
            gw, gb = np.zeros((12, 6)), np.zeros(6)
            for r in range(L):
                rows = slice(4 * (L * h + r), 4 * (L * h + r + 1))
                xs, ys = x[t, rows].astype(np.float64), y[t, rows].astype(np.float64)
                err = xs @ w + b - ys
                gw += 2 * xs.T @ err / len(xs)
                gb += 2 * err.sum(0) / len(xs)
            means.append((gw / L, gb / L))
        out_w, residual, q = np_powersgd_step([means[h][0] + residual[h] for h in range(H)], q)
        w, b = w - lr * out_w, b - lr * sum(m[1] for m in means) / H
    got = jax.tree.map(np.asarray, p)
    np.testing.assert_allclose(got["w"], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["b"], b, rtol=1e-4, atol=1e-5)
    res = np.asarray(s[0].slow.residual["w"])
    for h in range(H):
        np.testing.assert_allclose(res[h], residual[h], rtol=1e-4, atol=1e-5)
    for x_ in jax.tree.leaves(p):
        shards = [np.asarray(sh.data) for sh in x_.addressable_shards]
        assert all(sh.tobytes() == shards[0].tobytes() for sh in shards)


# ----------------------------------------------------------------------------
# FSDP: parameters and optimizer state sharded over the fast axis, compression over the slow one.


@pytest.mark.parametrize("H,L", [(2, 2), (2, 4)])
def test_fsdp_through_data_parallel_step_with_compression_over_the_slow_axis(H, L):
    """``data_parallel_step(axis_name="dcn", param_specs=P("ici"), batch_axes="ici")``.

    "ici" is a model axis the compiler shards the parameters and the state
    over (FSDP: the batch split over both axes); PowerSGD runs over "dcn" on
    whole leaves of each replica. Reference: the mean gradient of each "dcn"
    group's rows, then PowerSGD over the groups, then momentum SGD.
    """
    T, lr, rank = 3, 0.1, 2
    mesh = _mesh(H, L)
    rng = np.random.default_rng(11)
    d_in, d_out, rows = 32, 16, 4 * H * L
    x = rng.standard_normal((T, rows, d_in)).astype(np.float32)
    y = rng.standard_normal((T, rows, d_out)).astype(np.float32)
    params0 = {"w": np.zeros((d_in, d_out), np.float32), "b": np.zeros(d_in, np.float32)}

    def loss(p, b):  # "b" is an input bias, so that it is sharded along dim 0 like "w"
        return jnp.mean(jnp.sum(((b["x"] + p["b"][None]) @ p["w"] - b["y"]) ** 2, axis=-1))

    tx = optax.chain(powersgd(rank, axis_name="dcn"), jd.sgd(lr, momentum=0.9))
    specs = {"w": P("ici", None), "b": P("ici")}
    step = jd.data_parallel_step(loss, tx, mesh=mesh, axis_name="dcn", param_specs=specs, batch_axes="ici")
    p, s = step.init(params0)
    q_w = np.asarray(s[0].inner_state.q[0][0], np.float64)  # one (d_out, rank) factor: "w"
    for t in range(T):
        p, s, _ = step(p, s, {"x": x[t], "y": y[t]})

    w, bias = params0["w"].astype(np.float64), params0["b"].astype(np.float64)
    res = [np.zeros((d_in, d_out)) for _ in range(H)]
    mom_w, mom_b = np.zeros_like(w), np.zeros_like(bias)
    per = rows // H
    for t in range(T):
        gw, gb = [], []
        for h in range(H):
            xs, ys = x[t, h * per : (h + 1) * per].astype(np.float64), y[t, h * per : (h + 1) * per]
            err = (xs + bias) @ w - ys
            gw.append(2 * (xs + bias).T @ err / per)
            gb.append(2 * (err @ w.T).sum(0) / per)
        out_w, res, q_w = np_powersgd_step([gw[h] + res[h] for h in range(H)], q_w)
        mom_w, mom_b = 0.9 * mom_w + out_w, 0.9 * mom_b + np.mean(gb, axis=0)
        w, bias = w - lr * mom_w, bias - lr * mom_b
    np.testing.assert_allclose(np.asarray(p["w"]), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p["b"]), bias, rtol=1e-4, atol=1e-5)
    got_res = np.asarray(s[0].residual["w"])
    for h in range(H):
        np.testing.assert_allclose(got_res[h], res[h], rtol=1e-4, atol=1e-5)
    assert s[0].residual["w"].sharding.spec == P("dcn", "ici", None)
    assert s[1][0].momentum["w"].sharding.spec == P("ici", None)

    # Per-device memory: parameters and their state are a 1/L shard of the replicated run's.
    rep_p, rep_s = jd.data_parallel_step(loss, tx, mesh=mesh, axis_name="dcn").init(params0)
    p_bytes = 4 * (d_in * d_out + d_in)
    assert set(helpers.device_bytes(p).values()) == {p_bytes // L}
    assert set(helpers.device_bytes(rep_p).values()) == {p_bytes}
    shaped = lambda st: (st[0].residual, st[1][0].momentum)  # noqa: E731 - the param-sized leaves
    assert set(helpers.device_bytes(shaped(s)).values()) == {2 * p_bytes // L}
    assert set(helpers.device_bytes(shaped(rep_s)).values()) == {2 * p_bytes}


@pytest.mark.parametrize("H,L", [(2, 2), (2, 4)])
def test_sharded_compresses_each_shard_on_its_own(H, L):
    """``hierarchical(sharded=True)`` is per shard by design: device (h, l) holds shard l.

    Its input is the gradient of shard ``l`` already summed over the fast axis
    (what autodiff gives a shard the forward pass all-gathered); the fast
    stage divides by ``L`` and PowerSGD runs over "dcn" on each shard with its
    own residual and factor. Reference: per shard, PowerSGD over the groups.
    """
    T, rank, k, d_out = 3, 2, 8, 16
    rng = np.random.default_rng(5)
    g = rng.standard_normal((T, H, L, k, d_out)).astype(np.float32)  # step, group, shard
    tx = hierarchical(None, powersgd(rank, axis_name="dcn"), axis_name=AXES, sharded=True)
    state = tx.init(np.zeros((k, d_out), np.float32))
    update = jax.jit(jax.vmap(jax.vmap(tx.update, axis_name="ici"), axis_name="dcn"))
    grid = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (H, L, *np.shape(x))), tree)  # noqa: E731
    s = grid(state)
    q0 = np.asarray(state.slow.inner_state.q[0][0], np.float64)
    q, res = [q0] * L, [[np.zeros((k, d_out)) for _ in range(L)] for _ in range(H)]
    for t in range(T):
        out, s = update(g[t], s)
        for r in range(L):
            want, res_r, q[r] = np_powersgd_step([g[t, h, r] / L + res[h][r] for h in range(H)], q[r])
            for h in range(H):
                res[h][r] = res_r[h]
                np.testing.assert_allclose(np.asarray(out[h, r]), want, rtol=1e-4, atol=1e-5)
    for h in range(H):
        for r in range(L):
            np.testing.assert_allclose(np.asarray(s.slow.residual[h, r]), res[h][r], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# Accounting per axis.


def test_communication_cost_and_step_time_per_axis():
    params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros(256)}
    sizes = {"dcn": 2, "ici": 4}
    n_bytes = 4 * (256 * 256 + 256)
    hier = jd.communication_cost(
        hierarchical(None, powersgd(4, axis_name="dcn"), axis_name=AXES),
        params,
        num_workers=sizes,
        axis_name=AXES,
    )
    per_axis = hier.by_axis()
    assert set(per_axis) == {"ici", "dcn"}
    assert per_axis["ici"].sent_bytes == pytest.approx(2 * 3 / 4 * n_bytes)
    # Over "dcn": PowerSGD's P and Q of the 256x256 leaf at rank 4 (+ the dense bias, fused with P).
    factors = 4 * (256 * 4 + 256 * 4 + 256)
    assert per_axis["dcn"].payload_bytes == factors
    assert per_axis["dcn"].sent_bytes == pytest.approx(2 * 1 / 2 * factors)
    flat = jd.communication_cost(jd.all_reduce(axis_name=AXES), params, num_workers=sizes, axis_name=AXES)
    assert set(flat.by_axis()) == {AXES} and flat.sent_bytes == pytest.approx(2 * 7 / 8 * n_bytes)

    bw, lat = {"ici": 100.0, "dcn": 1.0}, {"ici": 1.0, "dcn": 10.0}
    t = jd.project_step_time(hier, bandwidth_gbps=bw, latency_us=lat)
    # Per call 2 (k-1) latency rounds: the all-reduces over "ici" (one buffer on CPU, else one per
    # leaf), two over "dcn" (P, Q).
    calls = 1 if comm.flatten_by_default() else 2
    ici_s = calls * (2 * 3 * 1e-6) + 2 * 3 / 4 * n_bytes / (100e9 / 8)
    dcn_s = 2 * (2 * 1 * 10e-6) + factors / (1e9 / 8)
    assert t.by_axis["ici"] == pytest.approx(ici_s) and t.by_axis["dcn"] == pytest.approx(dcn_s)
    assert float(t) == pytest.approx(ici_s + dcn_s)
    # The dense baseline is a flat all-reduce over all 8 workers, at the slow links' speed.
    t_flat = jd.project_step_time(flat, bandwidth_gbps=bw, latency_us=lat)
    assert t.dense_seconds == pytest.approx(2 * 7 * 10e-6 + 2 * 7 / 8 * n_bytes / (1e9 / 8))
    assert float(t_flat) == pytest.approx(t.dense_seconds + (calls - 1) * 2 * 7 * 10e-6)
    assert t.speedup > 10
    # A scalar bandwidth still works as before; a mapping must cover every axis.
    assert float(jd.project_step_time(hier, bandwidth_gbps=1.0, latency_us=0.0)) > 0
    with pytest.raises(ValueError, match=r"bandwidth_gbps.*'ici'"):
        jd.project_step_time(hier, bandwidth_gbps={"dcn": 1.0}, latency_us=1.0)
    with pytest.raises(ValueError, match=r"bandwidth_gbps\['dcn'\]"):
        jd.project_step_time(hier, bandwidth_gbps={"dcn": 0.0, "ici": 1.0}, latency_us=1.0)


# ----------------------------------------------------------------------------
# Bad input.


def test_bad_input():
    slow = powersgd(2, axis_name="dcn")
    with pytest.raises(ValueError, match="pair"):
        hierarchical(None, slow, axis_name="dcn")
    with pytest.raises(ValueError, match="pair"):
        hierarchical(None, slow, axis_name=("a", "b", "c"))
    with pytest.raises(ValueError, match="two different axes"):
        hierarchical(None, slow, axis_name=("dcn", "dcn"))
    with pytest.raises(TypeError, match="`slow`"):
        hierarchical(None, "powersgd", axis_name=AXES)
    with pytest.raises(TypeError, match="`fast`"):
        hierarchical(3, slow, axis_name=AXES)
    with pytest.raises(TypeError, match="`sharded`"):
        hierarchical(None, slow, axis_name=AXES, sharded=1)
    with pytest.raises(jd.UnboundAxisError, match="hierarchical"):
        tx = hierarchical(None, slow, axis_name=AXES)
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="dcn")(jnp.ones((2, 3)))


def _typing_error(tx, H=2, L=2):
    mesh = _mesh(H, L)

    def body(g):
        g = g[0, 0]
        return tx.update(g, tx.init(g))[0][None, None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("dcn", "ici"), out_specs=P("dcn", "ici"), check_vma=True)
    sharding = jax.sharding.NamedSharding(mesh, P("dcn", "ici"))
    jax.eval_shape(fn, jax.ShapeDtypeStruct((H, L, 3), jnp.float32, sharding=sharding))


def test_wrong_stages_are_caught_under_shard_map():
    # A fast stage that does not reduce over "ici" (here: over "dcn") is caught at trace time.
    with pytest.raises(ValueError, match="fast stage must leave the updates the same"):
        _typing_error(
            hierarchical(jd.all_reduce(axis_name="dcn"), jd.all_reduce(axis_name="dcn"), axis_name=AXES)
        )
    # A slow stage that does not aggregate leaves the output varying over "dcn".
    with pytest.raises(ValueError, match="the output must be the same on every worker of 'dcn'"):
        _typing_error(hierarchical(None, optax.identity(), axis_name=AXES))
