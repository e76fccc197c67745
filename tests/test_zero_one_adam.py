"""0/1 Adam (``zero_one_adam``) against a NumPy loop over workers, with both 1-bit error buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import error_feedback
from jaxopt_dist._src.zero_one_adam import ZeroOneAdamState, zero_one_adam
from tests import helpers
from tests import test_checkpoint as ckpt

SHAPES = {"w": (5, 7), "b": (3,), "s": ()}
# Small schedules: phase A has variance steps at intervals 1, 2 and 4 and 1-bit steps; phase B
# syncs every 1, 2, then 4 steps (the clip) within 20 steps.
SMALL = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
# What each of the first 20 updates does with SMALL: Variance, 1-bit (C), Local, Sync.
KINDS_SMALL = "VVVCVC" + "SSS" + "LS" + "LLLS" + "LLLS" + "L"


# ----------------------------------------------------------------------------
# NumPy reference (float32), following DeepSpeed's in-place steps literally.


def _pm(x):
    return np.where(x >= 0, np.float32(1), np.float32(-1))


def _scale(x):
    return np.float32(np.linalg.norm(x.astype(np.float64)) / np.sqrt(x.size))


def np_onebit_allreduce(xs, we, se):
    """The two-sided 1-bit all-reduce of one leaf; ``xs`` is ``(n, ...)``; updates ``we``/``se`` in place."""
    n, padded = we.shape
    chunk, size = padded // n, xs[0].size
    signs = np.zeros((n, padded), np.float32)
    scales = np.zeros(n, np.float32)
    for i in range(n):  # each worker compresses its value plus its worker error
        x = np.concatenate([xs[i].ravel(), np.zeros(padded - size, np.float32)]) + we[i]
        scales[i], signs[i] = _scale(x), _pm(x)
        we[i] = x - scales[i] * signs[i]
    out = np.zeros(padded, np.float32)
    for j in range(n):  # worker j averages chunk j, adds its server error, compresses again
        part = slice(j * chunk, (j + 1) * chunk)
        c = np.zeros(chunk, np.float32)
        for i in range(n):
            c = c + signs[i, part] * (scales[i] * np.float32(1 / n))
        c = c + se[j]
        s = _scale(c)
        se[j] = c - s * _pm(c)
        out[part] = s * _pm(c)
    return out[:size].reshape(xs.shape[1:])


def np_zero_one_adam(grads_seq, params, *, n, lr, b1, b2, eps, wd, F, K, LS, clip):
    """Per step: the kind of step, every worker's parameters; and the final state, per worker."""
    names = sorted(params)  # dict leaves in key order, as the state's tuples
    T = grads_seq[names[0]].shape[0]
    f32 = np.float32
    c1, c2 = f32(1 - b1), f32(1 - b2)  # in double, then float32 (DeepSpeed's Python scalars)
    b1, b2, eps, wd = f32(b1), f32(b2), f32(eps), f32(wd)
    p = {k: np.stack([np.asarray(params[k], np.float32)] * n) for k in names}
    m = {k: np.zeros_like(p[k]) for k in names}
    acc = {k: np.zeros_like(p[k]) for k in names}
    v = {k: np.zeros_like(p[k][0]) for k in names}
    padded = {k: error_feedback.onebit_padded_size(max(1, p[k][0].size), n) for k in names}
    we = {k: np.zeros((n, padded[k]), np.float32) for k in names}
    se = {k: np.zeros((n, padded[k] // n), np.float32) for k in names}
    lrs, var_interval, var_counter, local_interval, local_counter = f32(0), 1, 0, 1, 0
    kinds, ps = [], []
    for count in range(T):
        t, eta = count + 1, f32(lr(count) if callable(lr) else lr)
        if t <= F:
            var_step = (t + 1) % var_interval == 0
            kinds.append("V" if var_step else "C")
            for k in names:
                g = grads_seq[k][count].astype(np.float32)
                if var_step:
                    gm = g.mean(axis=0, dtype=np.float32)
                    v[k] = b2 * v[k] + c2 * gm * gm
                elif n > 1:
                    gm = np_onebit_allreduce(g, we[k], se[k])
                else:
                    gm = g[0]
                m[k][:] = b1 * m[k][0] + c1 * gm  # the same on every worker
                for i in range(n):
                    update = m[k][i] / (np.sqrt(v[k]) + eps) + wd * p[k][i]
                    p[k][i] = p[k][i] + (-eta * update)
            if var_step:
                var_counter += 1
                if var_counter == K:
                    var_counter, var_interval = 0, 2 * var_interval
        else:
            if t == F + 1:
                for k in names:
                    we[k][:], se[k][:] = 0, 0
            sync = (t + 1) % local_interval == 0
            kinds.append("S" if sync else "L")
            lrs = f32(lrs + eta)
            for k in names:
                g = grads_seq[k][count].astype(np.float32)
                d = np.sqrt(v[k]) + eps
                for i in range(n):
                    m[k][i] = b1 * m[k][i] + c1 * g[i]
                    update = m[k][i] / d + wd * p[k][i]
                    p[k][i] = p[k][i] + (-eta * update)
                    acc[k][i] = acc[k][i] + (-eta * update)
                if sync:
                    for i in range(n):
                        p[k][i] = p[k][i] - acc[k][i]
                        acc[k][i] = acc[k][i] * d
                    mean = np_onebit_allreduce(acc[k], we[k], se[k]) if n > 1 else acc[k][0]
                    for i in range(n):
                        m[k][i] = -(mean / lrs)
                        p[k][i] = p[k][i] + mean / d
                        acc[k][i] = 0
            if sync:
                lrs = f32(0)
            local_counter += 1
            if local_counter == LS:
                local_counter, local_interval = 0, min(clip, 2 * local_interval)
        ps.append({k: p[k].copy() for k in names})
    state = dict(
        mu=m,
        nu=v,
        acc=acc,
        lrs=lrs,
        var_interval=var_interval,
        var_counter=var_counter,
        local_step_interval=local_interval,
        local_step_counter=local_counter,
        worker_error=[we[k] for k in names],
        server_error=[se[k] for k in names],
    )
    return "".join(kinds), ps, state


def _ref(grads, params, n, **kw):
    hyper = dict(lr=0.01, b1=0.9, b2=0.999, eps=1e-8, wd=0.0)
    hyper.update(kw)
    s = SMALL
    return np_zero_one_adam(
        grads,
        params,
        n=n,
        F=s["var_freeze_step"],
        K=s["var_update_scaler"],
        LS=s["local_step_scaler"],
        clip=s["local_step_clipper"],
        **hyper,
    )


def _tx(n, lr=0.01, **kw):
    return zero_one_adam(lr, num_workers=n, **SMALL, **kw)


# ----------------------------------------------------------------------------
# Numerics.


def test_reference_walks_every_phase_and_doubling():
    kinds, _, state = _ref(helpers.grads_seq(0, 20, 2, {"w": (3,)}), {"w": np.zeros(3)}, 2)
    assert kinds == KINDS_SMALL
    assert state["var_interval"] == 4 and state["local_step_interval"] == 4  # doubled twice, clipped


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_matches_numpy_reference(backend, n):
    T, wd = 20, 0.01
    grads = helpers.grads_seq(20 + n, T, n, SHAPES)
    params = helpers.random_tree(np.random.default_rng(3), SHAPES)
    tx = _tx(n, weight_decay=wd)
    updates, final, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    kinds, want_p, want = _ref(grads, params, n, wd=wd)
    assert kinds == KINDS_SMALL
    # Every worker's parameters after every step: p0 + u_1 + ... + u_t, added in float32.
    got_p = jax.tree.map(lambda p0: np.stack([p0] * n), params)
    for t in range(T):
        got_p = jax.tree.map(lambda p, u: p + np.asarray(u[t]), got_p, updates)
        helpers.assert_trees_close(got_p, want_p[t], rtol=1e-5, atol=1e-6)
    helpers.assert_trees_equal(final, got_p)
    for field in ("mu", "nu", "acc"):
        got = getattr(state, field)
        if field == "nu":
            got = jax.tree.map(lambda x: np.asarray(x)[0], got)
        helpers.assert_trees_close(got, want[field], rtol=1e-5, atol=1e-6)
    for field in ("worker_error", "server_error"):
        for got, ref in zip(getattr(state, field), want[field]):
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
    for field in ("lrs", "var_interval", "var_counter", "local_step_interval", "local_step_counter"):
        np.testing.assert_allclose(np.asarray(getattr(state, field)), want[field], rtol=1e-6)
    # Bit-identical on every worker: phase A, and phase B while every step syncs.
    updates = jax.tree.map(np.asarray, updates)
    for t, kind in enumerate(kinds):
        step = jax.tree.map(lambda u: u[t], updates)
        if t < 9:  # VVVCVC SSS
            helpers.assert_replicas_equal(step)
        elif n > 1 and kind == "L":  # the workers' own local steps
            assert not np.array_equal(step["w"][0], step["w"][1])
    if n > 1:  # the accumulator, the momentum and both errors are really per worker
        acc = np.asarray(state.acc["w"])
        assert not np.array_equal(acc[0], acc[1])
        we = np.asarray(state.worker_error[0])
        assert not np.array_equal(we[0], we[1])
        assert np.any(np.asarray(state.server_error[0]) != 0)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_eight_workers(backend):
    shapes = {"w": (9, 4)}
    grads = helpers.grads_seq(8, 20, 8, shapes)
    params = helpers.zeros(shapes)
    _, final, state = helpers.run_steps(_tx(8), grads, params, backend=backend, per_worker_params=True)
    _, want_p, want = _ref(grads, params, 8)
    helpers.assert_trees_close(final, want_p[-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(state.worker_error[0]), want["worker_error"][0], rtol=1e-5, atol=1e-6
    )


def test_learning_rate_schedule_and_its_sum():
    """A scheduled learning rate: each step applies lr(count) and the sync divides by their sum."""
    n, T = 2, 14
    lr = optax.linear_schedule(0.02, 0.002, 20)
    grads = helpers.grads_seq(5, T, n, SHAPES)
    params = helpers.random_tree(np.random.default_rng(4), SHAPES)
    _, final, state = helpers.run_steps(_tx(n, lr=lr), grads, params, backend="vmap", per_worker_params=True)
    _, want_p, want = _ref(grads, params, n, lr=lambda c: float(lr(c)))
    helpers.assert_trees_close(final, want_p[-1], rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.mu, want["mu"], rtol=1e-5, atol=1e-6)
    # Updates 12, 13 and 14 are local steps after the sync at update 11: the sum holds their rates.
    applied = float(lr(11)) + float(lr(12)) + float(lr(13))
    np.testing.assert_allclose(np.asarray(state.lrs)[0], applied, rtol=1e-6)
    np.testing.assert_allclose(want["lrs"], applied, rtol=1e-6)


def test_variance_frozen_and_error_buffers_zeroed_at_phase_b():
    n, F = 2, 6
    grads = helpers.grads_seq(1, 8, n, {"w": (6,)})
    tx = _tx(n)
    p = jax.tree.map(lambda x: jnp.stack([x] * n), helpers.zeros({"w": (6,)}))
    state = jax.vmap(tx.init)(p)
    run = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="data"))
    seen = []
    for t in range(8):
        _, state = run(jax.tree.map(lambda x: x[t], grads), state, p)
        seen.append(state)
    nu = [np.asarray(s.nu["w"][0]) for s in seen]
    assert not np.array_equal(nu[3], nu[4])  # update 5 is a variance step
    np.testing.assert_array_equal(nu[4], nu[5])  # update 6 (1-bit) leaves v alone
    np.testing.assert_array_equal(nu[F - 1], nu[7])  # frozen in phase B
    assert np.any(np.asarray(seen[F - 1].worker_error[0]) != 0)  # phase A's 1-bit steps used them
    # At the first phase-B sync the buffers start from zero: one compression of a_i d.
    _, _, ref = _ref(jax.tree.map(lambda x: x[: F + 1], grads), {"w": np.zeros(6)}, n)
    np.testing.assert_allclose(
        np.asarray(seen[F].worker_error[0]), ref["worker_error"][0], rtol=1e-5, atol=1e-7
    )


def test_one_worker_is_adam_then_frozen_variance_and_a_mean_momentum():
    """One worker: phase A is Adam without bias correction (the mean and the 1-bit all-reduce are
    the identity), phase B the same Adam with v frozen, local steps or not; a sync after local
    steps re-estimates m as the learning-rate weighted mean of the interval's momenta."""
    T = 11  # update 11 syncs the interval of updates 10 and 11
    grads = helpers.grads_seq(2, T, 1, {"w": (4,)})
    params = helpers.zeros({"w": (4,)})
    updates, _, state = helpers.run_steps(_tx(1), grads, params, backend="vmap", per_worker_params=True)
    m = v = np.zeros(4, np.float32)
    momenta = []
    for t in range(T):
        g = grads["w"][t, 0]
        m = np.float32(0.9) * m + np.float32(0.1) * g
        momenta.append(m)
        if KINDS_SMALL[t] == "V":
            v = np.float32(0.999) * v + np.float32(1 - 0.999) * g * g
        want = -0.01 * m / (np.sqrt(v) + 1e-8)
        np.testing.assert_allclose(np.asarray(updates["w"][t, 0]), want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.mu["w"][0]), (momenta[9] + momenta[10]) / 2, rtol=2e-5)


# ----------------------------------------------------------------------------
# Training, checkpoints, resharding.


def _ckpt_tx():
    return zero_one_adam(
        1e-2,
        num_workers=ckpt.N_WORKERS,
        var_freeze_step=5,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        weight_decay=1e-3,
    )


def test_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch):
    """Saved after update 10 (a local step: the accumulator and the lr sum are in flight)."""
    family = ckpt.Family(_ckpt_tx, per_worker_state=True, per_worker_params=True)
    monkeypatch.setitem(ckpt.FAMILIES, "zero_one_adam", family)
    ckpt.test_resume_from_checkpoint_is_bit_identical("zero_one_adam", tmp_path)


def test_data_parallel_step_needs_per_worker_params():
    mesh = helpers.make_mesh(ckpt.N_WORKERS)
    with pytest.raises(ValueError, match="per_worker_params=True"):
        jd.data_parallel_step(ckpt._loss, _ckpt_tx(), mesh=mesh).init(ckpt._params0())
    step = jd.data_parallel_step(ckpt._loss, _ckpt_tx(), mesh=mesh, per_worker_params=True)
    params, opt_state = step.init(ckpt._params0())
    mask = step.placement(ckpt._params0()).per_worker
    assert isinstance(mask, ZeroOneAdamState)
    assert all(jax.tree.leaves(mask.mu)) and all(jax.tree.leaves(mask.acc))
    assert not any(jax.tree.leaves(mask.nu)) and not mask.lrs and not mask.count
    assert all(mask.worker_error) and all(mask.server_error)
    losses = []
    for t in range(12):
        params, opt_state, metrics = step(params, opt_state, ckpt._batch(t))
        losses.append(float(metrics["loss"]))
        rows = [np.asarray(x) for x in jax.tree.leaves(params)]
        if t < 7:  # phase A and the syncs every step: the same bits on every worker
            assert all(np.array_equal(x[0], x[i]) for x in rows for i in range(1, len(x)))
        elif t == 10:  # the sync at update 11 takes every worker's local step back: equal to rounding
            assert all(np.allclose(x[0], x[i], rtol=1e-6, atol=1e-6) for x in rows for i in range(1, len(x)))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    w = np.asarray(params["w1"])
    assert not np.allclose(w[0], w[1], atol=1e-4)  # update 12 is a local step: the workers differ


@pytest.mark.parametrize("n", [2, 4])
def test_reshard_opt_state_raises(n):
    """The 1-bit error buffers are padded for the number of workers: no regrouping for another."""
    tx = zero_one_adam(1e-2, var_freeze_step=2, num_workers=n)
    params = ckpt._params0()
    step = jd.data_parallel_step(ckpt._loss, tx, mesh=helpers.make_mesh(n), per_worker_params=True)
    _, opt_state = step.init(params)
    for m in (1, 2, 8):
        with pytest.raises(ValueError, match="ZeroOneAdamState.worker_error|num_workers=4 but runs on 2"):
            jd.reshard_opt_state(opt_state, tx, params, num_workers=m, per_worker_params=True)


# ----------------------------------------------------------------------------
# Wire bytes.


@pytest.mark.parametrize("n", [2, 4])
def test_communication_cost_of_each_kind_of_step(n):
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(10)}
    tx = _tx(n)
    d = 64 * 32 + 10
    sizes = [error_feedback.onebit_padded_size(10, n), error_feedback.onebit_padded_size(2048, n)]
    row = sum(s // (8 * n) + 4 for s in sizes)  # leaves in key order: b, w
    onebit = (n - 1) / n * (n * row) + (n - 1) * row  # the all-to-all's rows, then the all-gather
    cost = jd.communication_cost(tx, params, num_workers=n, steps=16, start=0)
    assert cost.exact
    for step, kind in zip(cost.steps, KINDS_SMALL, strict=False):
        kinds = sorted(c.kind for c in step.collectives)
        if kind == "V":  # the dense mean gradient
            assert kinds == ["all_reduce"]
            assert step.sent_bytes == pytest.approx(2 * (n - 1) / n * 4 * d)
        elif kind in "CS":  # phase A's 1-bit gradient, phase B's 1-bit sync
            assert kinds == ["all_gather", "all_to_all"]
            assert step.sent_bytes == pytest.approx(onebit)
        else:  # a local step
            assert kinds == [] and step.sent_bytes == 0
    assert onebit < cost.dense_bytes / 10


def test_one_onebit_exchange_in_the_program():
    # Phase A's 1-bit gradient and phase B's sync share one exchange: the traced update holds one
    # all-reduce (variance steps), one all-to-all and one all-gather, whatever the step.
    tx = _tx(4)
    cost = jd.communication_cost(
        tx, {"w": jnp.zeros((16, 8)), "b": jnp.zeros(3)}, num_workers=4, steps=16, start=0
    )
    assert sorted(c.kind for c in cost.sites) == ["all_gather", "all_reduce", "all_to_all"]


def test_steady_state_sends_one_sync_in_local_step_clipper():
    params = {"w": jnp.zeros((256, 256))}
    tx = zero_one_adam(1e-3, num_workers=8, var_freeze_step=1, local_step_scaler=1, local_step_clipper=16)
    cost = jd.communication_cost(tx, params, num_workers=8, steps=64, start=64)
    sync = 7 / 8 * (256 * 256 / 8 + 8 * 4) + 7 * (256 * 256 / 64 + 4)
    assert cost.sent_bytes == pytest.approx(sync / 16)
    assert cost.dense_bytes / cost.sent_bytes > 16 * 25


# ----------------------------------------------------------------------------
# The optax contract and bad input.


def test_contract_jit_extra_args_and_dtypes():
    tx = _tx(2, lr=optax.linear_schedule(1e-2, 0.0, 30), weight_decay=1e-3)
    g = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    traces = []

    def step(g, s, p):
        traces.append(1)
        u, s = tx.update(g, s, p, unknown=3)
        return u, s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    p = g
    s = jax.vmap(tx.init)(p)
    first = s
    for _ in range(12):  # every kind of step, one compilation
        u, s, p = run(g, s, p)
        assert u["w"].dtype == jnp.bfloat16
        helpers.assert_dtypes_equal(s, first)
    assert len(traces) == 1
    state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)})
    assert state.worker_error[0].shape == (16,) and state.server_error[0].shape == (8,)
    assert state.mu["w"].dtype == jnp.float32
    inside = jax.vmap(tx.init, axis_name="data")({"w": jnp.ones((2, 3))})
    helpers.assert_trees_equal(jax.tree.map(lambda x: x[0], inside), tx.init({"w": jnp.ones(3)}))


def test_inject_hyperparams():
    static = (
        "var_freeze_step",
        "num_workers",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
    )
    kw = dict(num_workers=2, **SMALL)
    tx = optax.inject_hyperparams(zero_one_adam, static_args=static)(
        learning_rate=1e-2, b1=0.8, weight_decay=1e-3, **kw
    )
    ref = zero_one_adam(1e-2, b1=0.8, weight_decay=1e-3, **kw)
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 3)), jnp.float32)

    def run(tx):
        def steps(g):
            def body(carry, _):
                s, p = carry
                u, s = tx.update(g, s, p)
                return (s, p + u), u

            return jax.lax.scan(body, (tx.init(g), g), None, length=10)[1]

        return jax.jit(jax.vmap(steps, axis_name="data"))(g)

    # 1 - b1 is rounded in float32 for an injected b1, in double for a Python float.
    helpers.assert_trees_close(run(tx), run(ref), rtol=1e-4, atol=1e-7)


def test_multisteps():
    tx = optax.MultiSteps(_tx(2), every_k_schedule=2)
    p = {"w": jnp.zeros((2, 3))}
    s = jax.vmap(tx.init)(p)
    run = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="data"))
    for t in range(4):
        u, s = run({"w": jnp.full((2, 3), t + 1.0)}, s, p)
    assert int(s.inner_opt_state.count[0]) == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(var_freeze_step=0, num_workers=2), ValueError, "var_freeze_step"),
        (dict(var_freeze_step=2.0, num_workers=2), TypeError, "var_freeze_step"),
        (dict(var_freeze_step=2), ValueError, "num_workers"),
        (dict(var_freeze_step=2, num_workers=0), ValueError, "num_workers"),
        (dict(var_freeze_step=2, num_workers=2, var_update_scaler=0), ValueError, "var_update_scaler"),
        (dict(var_freeze_step=2, num_workers=2, local_step_scaler=0), ValueError, "local_step_scaler"),
        (dict(var_freeze_step=2, num_workers=2, local_step_clipper=1.5), TypeError, "local_step_clipper"),
        (dict(var_freeze_step=2, num_workers=2, b1=1.0), ValueError, "b1"),
        (dict(var_freeze_step=2, num_workers=2, b2=-0.1), ValueError, "b2"),
        (dict(var_freeze_step=2, num_workers=2, eps=0.0), ValueError, "eps"),
        (dict(var_freeze_step=2, num_workers=2, weight_decay=-1.0), ValueError, "weight_decay"),
        (dict(var_freeze_step=2, num_workers=2, axis_name=["data"]), TypeError, "axis_name"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        zero_one_adam(1e-3, **kwargs)
    with pytest.raises(ValueError, match="learning_rate"):
        zero_one_adam(-1.0, var_freeze_step=2, num_workers=2)


def test_worker_count_mismatch_unbound_axis_and_missing_params():
    tx = zero_one_adam(1e-3, var_freeze_step=1, num_workers=4)
    with pytest.raises(ValueError, match="num_workers=4"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(jd.UnboundAxisError, match="`zero_one_adam` communicates over the axis 'data'"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)))
    tx = zero_one_adam(1e-3, var_freeze_step=1, num_workers=2, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"`zero_one_adam` needs `params` \(with weight_decay\)"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
