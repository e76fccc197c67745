"""Tests for jaxopt_dist._src.precision: loss scaling, master weights, finite checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import (
    ApplyIfFiniteEverywhereState,
    DynamicLossScaleState,
    MasterWeightsState,
    apply_if_finite_everywhere,
    dynamic_loss_scale,
    loss_scale,
    master_weights,
)
from jaxopt_dist._src import comm
from tests import helpers

P = jax.sharding.PartitionSpec
SHAPES = {"b": (3,), "w": (4, 3)}


# ----------------------------------------------------------------------------
# A shard_map training step that multiplies the loss by the state's loss scale
# (jd.data_parallel_step's loss_fn cannot see the optimizer state).


def _unstack(tree, mask):
    return jax.tree.map(lambda x, m: x[0] if m else x, tree, mask)


def _restack(tree, mask):
    return jax.tree.map(lambda x, m: x[None] if m else x, tree, mask)


def _plant_inf(grads, poison):
    """Worker with ``poison`` set puts an inf in the first entry of every leaf."""
    return jax.tree.map(
        lambda g: (
            g.reshape(-1)
            .at[0]
            .set(jnp.where(poison, jnp.asarray(jnp.inf, g.dtype), g.reshape(-1)[0]))
            .reshape(g.shape)
        ),
        grads,
    )


class ScaledStep:
    """``params, state, metrics = step(params, state, batch, poison)`` under shard_map."""

    def __init__(self, loss_fn, tx, params, n, *, scaled=True):
        self.mesh = helpers.make_mesh(n)
        self.tx = tx
        self.mask = jd.opt_state_placement(tx, params, mesh=self.mesh).per_worker
        mask = self.mask
        s_spec = jax.tree.map(lambda m: P("data") if m else P(), mask)

        def body(params, opt_state, batch, poison):
            s = _unstack(opt_state, mask)
            scale = loss_scale(s) if scaled else jnp.ones([], jnp.float32)
            batch = jax.tree.map(lambda x: x[0], batch)

            def scaled_loss(q):
                return loss_fn(q, batch).astype(jnp.float32) * scale

            p_var = comm.to_varying(params, "data")
            loss, grads = jax.value_and_grad(scaled_loss)(p_var)
            grads = _plant_inf(grads, poison[0])
            updates, s2 = tx.update(grads, s, params, value=loss, value_fn=scaled_loss)
            new_params = optax.apply_updates(params, updates)
            return new_params, _restack(s2, mask), comm.pmean(loss / scale, "data")

        self._fn = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(P(), s_spec, P("data"), P("data")),
                out_specs=(P(), s_spec, P()),
                check_vma=True,
            )
        )
        self._s_spec = s_spec

    def init(self, params):
        rep = jax.sharding.NamedSharding(self.mesh, P())
        return jax.device_put(params, rep), jd.init_opt_state(self.tx, params, mesh=self.mesh)

    def __call__(self, params, state, batch, poison):
        batch = jax.device_put(batch, jax.sharding.NamedSharding(self.mesh, P("data")))
        poison = jax.device_put(np.asarray(poison), jax.sharding.NamedSharding(self.mesh, P("data")))
        # Wait for each step: XLA:CPU can deadlock with dozens of collective programs queued.
        return jax.block_until_ready(self._fn(params, state, batch, poison))


def _linreg_loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"][None, :]
    return jnp.mean((pred - batch["y"]) ** 2)


def _linreg_batch(rng, n, m=4):
    """Per-worker batches stacked on a leading worker axis: x (n, m, 4), y (n, m, 3)."""
    return {
        "x": rng.standard_normal((n, m, 4)).astype(np.float32),
        "y": rng.standard_normal((n, m, 3)).astype(np.float32),
    }


def _device_rows_equal(tree):
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(s.tobytes() == shards[0].tobytes() for s in shards)


def _scaled_sign_compressor():
    """EF-signSGD-like: each worker sends mean|x| sign(x); output is the mean."""

    def compress(updates, state, params=None, **extra_args):
        del params, extra_args
        contribution = jax.tree.map(lambda x: jnp.mean(jnp.abs(x)) * jnp.sign(x), updates)
        return comm.pmean(contribution, "data"), contribution, state

    return jd.Compressor(init=lambda params: optax.EmptyState(), compress=compress)


# ----------------------------------------------------------------------------
# An inf on one of 8 workers: everyone skips.


_INNERS = {
    "all_reduce+sgd": lambda: optax.chain(jd.all_reduce(), jd.sgd(0.05, momentum=0.9)),
    "error_feedback+sgd": lambda: optax.chain(jd.error_feedback(_scaled_sign_compressor()), jd.sgd(0.05)),
}
# The library's compressors and AdaSum (Horovod issue 3429: AdaSum + mixed precision went NaN).
_INNERS["top_k+sgd"] = lambda: optax.chain(jd.top_k(density=0.25), jd.sgd(0.05))
_INNERS["powersgd+sgd"] = lambda: optax.chain(jd.powersgd(rank=1), jd.sgd(0.05))
_INNERS["adasum+sgd"] = lambda: optax.chain(jd.adasum(), jd.sgd(0.05))


@pytest.mark.parametrize("inner", sorted(_INNERS))
@pytest.mark.parametrize("master", [False, True])
def test_inf_on_one_of_8_workers_skips_everywhere_and_halves_the_scale(inner, master):
    n = 8
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if master else jnp.float32
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), helpers.random_tree(rng, SHAPES))
    tx = dynamic_loss_scale(_INNERS[inner](), init_scale=2.0**8, growth_interval=100, axis_name="data")
    if master:
        tx = master_weights(tx)
    step = ScaledStep(_linreg_loss, tx, params, n)
    p, s = step.init(params)
    clean = np.zeros(n, bool)
    for _ in range(3):
        p, s, _ = step(p, s, _linreg_batch(rng, n), clean)
    before_p, before_s = p, s
    poison = clean.copy()
    poison[5] = True
    p, s, _ = step(p, s, _linreg_batch(rng, n), poison)
    # Every worker skipped: params bit-identical to before (on every device),
    # inner state (momentum, per-worker residuals, master copy) untouched.
    helpers.assert_trees_equal(p, before_p)
    _device_rows_equal(p)
    dls_before = _find_dls(before_s)
    dls_after = _find_dls(s)
    helpers.assert_trees_equal(dls_after.inner_state, dls_before.inner_state)
    if master:
        helpers.assert_trees_equal(s.master, before_s.master)
        helpers.assert_trees_equal(p, jax.tree.map(lambda w: w.astype(dtype), s.master))
    assert float(loss_scale(s)) == float(loss_scale(before_s)) / 2 == 2.0**7
    assert int(dls_after.num_skipped) == 1 and not bool(dls_after.last_finite)
    assert int(dls_after.good_steps) == 0
    # Training resumes on the next clean step.
    p2, s2, _ = step(p, s, _linreg_batch(rng, n), clean)
    assert bool(_find_dls(s2).last_finite)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p)))


def test_master_weights_and_loss_scale_around_dim_reduce():
    """The scaled value/value_fn are unscaled for dim_reduce's line search; bf16 params."""
    dim_reduce = jd.dim_reduce

    n = 4
    rng = np.random.default_rng(7)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), helpers.random_tree(rng, SHAPES))
    basis = np.linalg.qr(rng.standard_normal((15, 3)))[0].T.astype(np.float32)
    tx = master_weights(
        dynamic_loss_scale(dim_reduce(basis, alpha=0.05), init_scale=2.0**6, axis_name="data")
    )
    step = ScaledStep(_linreg_loss, tx, params, n)
    p, s = step.init(params)
    batch = _linreg_batch(rng, n, m=8)
    losses = []
    for _ in range(5):
        p, s, loss = step(p, s, batch, np.zeros(n, bool))
        losses.append(float(loss))
    dr = _find_dls(s).inner_state
    assert int(_find_dls(s).num_skipped) == 0
    # The line search compared unscaled losses: info.loss is the true mean loss.
    np.testing.assert_allclose(float(dr.info.loss), losses[-1], rtol=1e-2)
    assert losses[-1] < losses[0]
    helpers.assert_trees_equal(p, jax.tree.map(lambda w: w.astype(jnp.bfloat16), s.master))


def _find_dls(state) -> DynamicLossScaleState:
    is_dls = lambda x: isinstance(x, DynamicLossScaleState)  # noqa: E731
    return [x for x in jax.tree.leaves(state, is_leaf=is_dls) if is_dls(x)][0]


def test_a_skipped_step_leaves_no_trace():
    """With power-of-two scales the run with a skipped step equals the run without it."""
    n = 4
    rng = np.random.default_rng(1)
    params = helpers.random_tree(rng, SHAPES)
    inner = lambda: optax.chain(jd.error_feedback(_scaled_sign_compressor()), jd.sgd(0.05, momentum=0.5))  # noqa: E731
    tx = dynamic_loss_scale(inner(), init_scale=2.0**4, growth_interval=100, axis_name="data")
    step = ScaledStep(_linreg_loss, tx, params, n)
    batches = [_linreg_batch(rng, n) for _ in range(4)]
    clean, poison = np.zeros(n, bool), np.eye(n, dtype=bool)[2]
    p_a, s_a = step.init(params)
    p_b, s_b = step.init(params)
    for t, b in enumerate(batches):
        p_a, s_a, _ = step(p_a, s_a, b, clean)
        if t == 1:
            p_a, s_a, _ = step(p_a, s_a, b, poison)
        p_b, s_b, _ = step(p_b, s_b, b, clean)
    helpers.assert_trees_equal(p_a, p_b)
    helpers.assert_trees_equal(s_a.inner_state, s_b.inner_state)
    assert float(s_a.scale) == float(s_b.scale) / 2


def test_optax_apply_if_finite_lets_replicas_diverge_ours_does_not():
    """optax decides per device: the poisoned worker skips, the others apply an inf mean."""
    n = 4
    params = {"w": jnp.zeros(3)}
    grads = np.ones((n, 3), np.float32)
    grads[1, 0] = np.inf
    inner = lambda: optax.chain(jd.all_reduce(), jd.sgd(0.1))  # noqa: E731

    def run(tx):
        def fn(g):
            u, _ = tx.update({"w": g}, tx.init(params), params)
            return optax.apply_updates(params, u)["w"]

        return np.asarray(jax.vmap(fn, axis_name="data")(grads))

    theirs = run(optax.apply_if_finite(inner(), max_consecutive_errors=10))
    assert np.all(np.isfinite(theirs[1])) and not np.all(np.isfinite(theirs[0]))
    ours = run(apply_if_finite_everywhere(inner()))
    np.testing.assert_array_equal(ours, 0.0)
    ours = run(dynamic_loss_scale(inner(), axis_name="data"))
    np.testing.assert_array_equal(ours, 0.0)


def test_per_worker_inner_skips_together_only_with_axis_name():
    """Local (non-communicating) inner: the flag reduction is what keeps workers together."""
    n = 3
    params = jnp.zeros((n, 2))
    grads = np.ones((n, 2), np.float32)
    grads[2, 1] = np.nan

    def run(tx):
        def fn(p, g):
            u, s = tx.update(g, tx.init(p), p)
            return optax.apply_updates(p, u), loss_scale(s)

        return jax.vmap(fn, axis_name="data")(params, grads)

    p_local, s_local = run(dynamic_loss_scale(jd.sgd(1.0), init_scale=1.0))
    np.testing.assert_array_equal(np.asarray(s_local), [1.0, 1.0, 0.5])
    np.testing.assert_array_equal(np.asarray(p_local)[:2], -1.0)
    p_all, s_all = run(dynamic_loss_scale(jd.sgd(1.0), init_scale=1.0, axis_name="data"))
    np.testing.assert_array_equal(np.asarray(s_all), [0.5, 0.5, 0.5])
    np.testing.assert_array_equal(np.asarray(p_all), 0.0)


# ----------------------------------------------------------------------------
# The scale schedule: NumPy reference over many steps, both backends, 1-8 workers.


def _np_dls_reference(grads_seq, *, init_scale, growth_interval, growth_factor, min_scale, max_scale, lr):
    """grads_seq (T, n, d) of *scaled-by-1* grads; the transform sees g * 1 (we feed raw grads)."""
    scale, good = init_scale, 0
    scales, updates = [], []
    for g in grads_seq:
        unscaled = g.astype(np.float64) / scale
        mean = unscaled.mean(axis=0)
        finite = np.all(np.isfinite(unscaled))
        if finite:
            updates.append(-lr * mean)
            if good + 1 >= growth_interval:
                scale = min(scale * growth_factor, max_scale)
                good = 0
            else:
                good += 1
        else:
            updates.append(np.zeros_like(mean))
            scale = max(scale / growth_factor, min_scale)
            good = 0
        scales.append(scale)
    return np.stack(updates), np.asarray(scales)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_scale_schedule_matches_reference_growth_cap_and_floor(n, backend):
    rng = np.random.default_rng(n)
    t_steps, d = 12, 3
    grads = rng.standard_normal((t_steps, n, d)).astype(np.float32)
    # Overflows at steps 4, 5 (two workers) and 6: three halvings down to the floor.
    grads[4, n - 1, 0] = np.inf
    grads[5, 0, 2] = np.nan
    grads[6, n // 2, 1] = -np.inf
    kw = dict(init_scale=4.0, growth_interval=2, growth_factor=2.0, min_scale=1.0, max_scale=8.0)
    tx = dynamic_loss_scale(optax.chain(jd.all_reduce(), jd.sgd(0.1)), axis_name="data", **kw)
    updates, _, state = helpers.run_steps(tx, {"w": grads}, {"w": np.zeros(d, np.float32)}, backend=backend)
    expect_u, expect_scales = _np_dls_reference(grads, lr=0.1, **kw)
    helpers.assert_trees_close(updates["w"], expect_u, rtol=1e-6, atol=1e-7)
    # Scales: 4 -> 8 after 2 finite steps, capped at 8, then 4, 2, 1 (floor).
    assert expect_scales.tolist() == [4, 8, 8, 8, 4, 2, 1, 1, 2, 2, 4, 4]
    np.testing.assert_array_equal(np.asarray(state.scale)[0], expect_scales[-1])
    assert int(np.asarray(state.num_skipped)[0]) == 3


def test_growth_after_interval_with_default_factor_and_schedule():
    tx = dynamic_loss_scale(
        jd.sgd(0.1), init_scale=1.0, growth_interval=3, growth_factor=lambda c: 2.0 + c * 0
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    scales = []
    for _ in range(7):
        _, state = tx.update(jnp.ones(2), state, params)
        scales.append(float(loss_scale(state)))
    assert scales == [1, 1, 2, 2, 2, 4, 4]


def test_unscaled_value_and_value_fn_reach_the_inner():
    seen = {}

    def spy_update(updates, state, params=None, *, value=None, value_fn=None, **extra):
        seen["value"], seen["value_fn"] = value, value_fn(params)
        seen["grads"] = updates
        return updates, state

    spy = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), spy_update)
    tx = master_weights(dynamic_loss_scale(spy, init_scale=8.0))
    params = jnp.full(2, 3.0, jnp.bfloat16)
    state = tx.init(params)
    value_fn = lambda q: jnp.sum(q.astype(jnp.float32)) * 8.0 + (q.dtype == jnp.bfloat16)  # noqa: E731
    tx.update(jnp.full(2, 16.0, jnp.bfloat16), state, params, value=jnp.float32(48.0), value_fn=value_fn)
    assert float(seen["value"]) == 6.0
    # value_fn is evaluated at the bf16 cast of the master trial point, then unscaled.
    assert float(seen["value_fn"]) == (48.0 + 1.0) / 8.0
    assert seen["grads"].dtype == jnp.float32 and float(seen["grads"][0]) == 2.0


def test_skip_keeps_prng_key_state_unchanged():
    """Inner states with typed PRNG keys (shared randomness of compressors) are restored too."""

    def init(params):
        return {"key": jax.random.key(0)}

    def update(updates, state, params=None, **extra):
        key, sub = jax.random.split(state["key"])
        noise = jax.random.normal(sub, updates.shape, updates.dtype)
        return comm.pmean(updates + noise, "data"), {"key": key}

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = dynamic_loss_scale(inner, axis_name="data")
    grads = jnp.ones((2, 3)).at[1, 1].set(jnp.nan)

    def fn(g):
        s = tx.init(g)
        u, s2 = tx.update(g, s, g)
        return u, jax.random.key_data(s.inner_state["key"]), jax.random.key_data(s2.inner_state["key"])

    u, before, after = jax.vmap(fn, axis_name="data")(grads)
    np.testing.assert_array_equal(np.asarray(u), 0.0)
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    _, before, after = jax.vmap(fn, axis_name="data")(jnp.ones((2, 3)))
    assert not np.array_equal(np.asarray(after), np.asarray(before))


# ----------------------------------------------------------------------------
# Master weights.


def test_emitted_updates_make_params_equal_the_cast_master_bitwise():
    rng = np.random.default_rng(2)
    for dtype in (jnp.bfloat16, jnp.float16):
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), helpers.random_tree(rng, SHAPES))
        tx = master_weights(jd.adam(3e-3))
        state = tx.init(params)
        moved_only_in_master = 0
        step = jax.jit(tx.update)
        for _ in range(40):
            g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), dtype), params)
            u, new_state = step(g, state, params)
            assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))
            new_params = optax.apply_updates(params, u)
            helpers.assert_trees_equal(new_params, jax.tree.map(lambda w: w.astype(dtype), new_state.master))
            moved_only_in_master += sum(
                int(np.sum((np.asarray(a) == np.asarray(b)) & (np.asarray(m0) != np.asarray(m1))))
                for a, b, m0, m1 in zip(
                    jax.tree.leaves(new_params),
                    jax.tree.leaves(params),
                    jax.tree.leaves(state.master),
                    jax.tree.leaves(new_state.master),
                )
            )
            params, state = new_params, new_state
        # Steps below half a low-precision ulp are kept in the master copy.
        assert moved_only_in_master > 0


@pytest.mark.parametrize("dtype, max_log2_ratio", [(jnp.bfloat16, 16), (jnp.float16, 13)])
def test_emit_rule_is_exact_unless_a_value_collapses(dtype, max_log2_ratio):
    """p + fl32(t - p) rounds back to t for all pairs with |p| / |t| <= 2^16 (bf16), 2^13 (fp16)."""
    rng = np.random.default_rng(3)
    size = 200_000
    lo = -14 if dtype == jnp.float16 else -40
    mags = lambda: 2.0 ** rng.uniform(lo, 15, size) * rng.choice([-1.0, 1.0], size)  # noqa: E731
    p = jnp.asarray(mags(), jnp.float32).astype(dtype)
    t = jnp.asarray(mags(), jnp.float32).astype(dtype)
    p = p.at[:4].set(jnp.asarray([0.0, 1.0, -0.0, 3.0], dtype))
    t = t.at[:4].set(jnp.asarray([1.0, 0.0, 2.0, -3.0], dtype))
    u = t.astype(jnp.float32) - p.astype(jnp.float32)
    ok = np.asarray(optax.apply_updates(p, u) == t)
    ratio = np.abs(np.asarray(p, np.float64)) / np.maximum(np.abs(np.asarray(t, np.float64)), 1e-300)
    assert ok[:4].all()
    assert ok[ratio <= 2.0**max_log2_ratio].all()
    assert not ok.all()  # beyond the bound it can fail: the bound is not vacuous
    # A low-precision update would not do: it fails for many ordinary pairs.
    near = (ratio > 0.25) & (ratio < 4)
    low = np.asarray(optax.apply_updates(p, u.astype(dtype)) == t)
    assert low[near].mean() < 0.9


def test_master_weights_on_float32_params_is_the_inner_optimizer():
    rng = np.random.default_rng(4)
    params = helpers.random_tree(rng, SHAPES)
    tx, ref = master_weights(jd.sgd(0.1, momentum=0.9)), jd.sgd(0.1, momentum=0.9)
    s, r = tx.init(params), ref.init(params)
    p_ref = params
    for _ in range(3):
        g = helpers.random_tree(rng, SHAPES)
        u, s = tx.update(g, s, params)
        v, r = ref.update(g, r, p_ref)
        params, p_ref = optax.apply_updates(params, u), optax.apply_updates(p_ref, v)
    helpers.assert_trees_equal(params, p_ref)
    helpers.assert_trees_equal(s.master, params)


# ----------------------------------------------------------------------------
# bf16 training of a digits MLP reaches the fp32 accuracy.


@functools.lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(y))
    x, y = x[perm], y[perm].astype(np.int32)
    return x[:1432], y[:1432], x[1432:], y[1432:]


def _mlp(params, x):
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"] + params["b2"][None, :]


def _mlp_loss(params, batch):
    logits = _mlp(params, batch["x"]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def _mlp_params(rng, hidden=32):
    return {
        "b1": np.zeros(hidden, np.float32),
        "b2": np.zeros(10, np.float32),
        "w1": (rng.standard_normal((64, hidden)) / 8).astype(np.float32),
        "w2": (rng.standard_normal((hidden, 10)) / np.sqrt(hidden)).astype(np.float32),
    }


def _train_digits(dtype, steps, n=8):
    x, y, x_test, y_test = _digits()
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), _mlp_params(np.random.default_rng(0)))
    inner = optax.chain(jd.all_reduce(), jd.sgd(0.3, momentum=0.9))
    if dtype == jnp.float32:
        tx, scaled = inner, False
    else:
        tx, scaled = master_weights(dynamic_loss_scale(inner, growth_interval=64, axis_name="data")), True
    step = ScaledStep(_mlp_loss, tx, params, n, scaled=scaled)
    p, s = step.init(params)
    batch = {"x": x.reshape(n, -1, 64).astype(dtype), "y": y.reshape(n, -1)}
    clean = np.zeros(n, bool)
    for _ in range(steps):
        p, s, loss = step(p, s, batch, clean)
    pred = np.asarray(jnp.argmax(_mlp(p, jnp.asarray(x_test, dtype)).astype(jnp.float32), axis=-1))
    return float(np.mean(pred == y_test)), float(loss), p, s


def test_bf16_digits_mlp_reaches_fp32_accuracy_within_one_point():
    steps = 100
    acc32, loss32, _, _ = _train_digits(jnp.float32, steps)
    acc16, loss16, p16, s16 = _train_digits(jnp.bfloat16, steps)
    print(
        f"digits MLP, {steps} full-batch steps on 8 workers: fp32 acc {acc32:.4f} loss {loss32:.4f}; "
        f"bf16+master+loss scale acc {acc16:.4f} loss {loss16:.4f}; scale {float(loss_scale(s16))}"
    )
    assert acc32 > 0.9
    assert acc16 >= acc32 - 0.01
    helpers.assert_trees_equal(p16, jax.tree.map(lambda w: w.astype(jnp.bfloat16), s16.master))
    # 100 finite steps with an interval of 64: the scale grew once.
    assert float(loss_scale(s16)) == 2.0**11


# ----------------------------------------------------------------------------
# apply_if_finite_everywhere.


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_apply_if_finite_everywhere_with_per_worker_params(backend):
    n, t_steps = 3, 4
    rng = np.random.default_rng(5)
    grads = rng.standard_normal((t_steps, n, 2)).astype(np.float32)
    grads[1, 2, 0] = np.nan
    tx = apply_if_finite_everywhere(jd.sgd(0.5, momentum=0.5))
    updates, params, state = helpers.run_steps(
        tx, {"w": grads}, {"w": np.zeros(2, np.float32)}, backend=backend, per_worker_params=True
    )
    np.testing.assert_array_equal(np.asarray(updates["w"][1]), 0.0)  # every worker skipped step 1
    ref = jd.sgd(0.5, momentum=0.5)
    for i in range(n):
        s, p = ref.init(jnp.zeros(2)), jnp.zeros(2)
        for t in (0, 2, 3):
            u, s = ref.update(grads[t, i], s, p)
            p = optax.apply_updates(p, u)
        np.testing.assert_allclose(np.asarray(params["w"])[i], np.asarray(p), rtol=1e-6)
    assert np.asarray(state.total_notfinite).tolist() == [1] * n
    assert np.asarray(state.notfinite_count).tolist() == [0] * n


def test_apply_if_finite_everywhere_matches_optax_on_one_worker():
    """One worker: the same decisions and states as optax.apply_if_finite (max errors 2)."""
    finite_pattern = [True, False, True, False, False, False]
    tx = apply_if_finite_everywhere(jd.sgd(0.1, momentum=0.9), 2)
    ref = optax.apply_if_finite(jd.sgd(0.1, momentum=0.9), 2)
    params = jnp.zeros(2)

    def run(tx):
        def fn(_):
            s = tx.init(params)
            outs = []
            for ok in finite_pattern:
                g = jnp.array([1.0, 2.0]) if ok else jnp.array([jnp.inf, 1.0])
                u, s = tx.update(g, s, params)
                outs.append(u)
            return outs, s

        return jax.vmap(fn, axis_name="data")(jnp.zeros(1))

    outs, s = run(tx)
    ref_outs, r = run(ref)
    for a, b in zip(outs, ref_outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(s, ApplyIfFiniteEverywhereState)
    for field in ("notfinite_count", "last_finite", "total_notfinite"):
        np.testing.assert_array_equal(np.asarray(getattr(s, field)), np.asarray(getattr(r, field)))
    np.testing.assert_array_equal(np.asarray(outs[1]), 0.0)
    assert np.all(np.isfinite(np.asarray(outs[2]))) and np.any(np.asarray(outs[2]) != 0)
    # The last step (third non-finite in a row > 2) was applied anyway.
    assert not np.all(np.isfinite(np.asarray(outs[5])))


# ----------------------------------------------------------------------------
# loss_scale finds the scale; optax contract; bad inputs.


def test_loss_scale_finds_the_scale_in_nested_states():
    params = {"w": jnp.zeros(2)}
    dls = dynamic_loss_scale(jd.sgd(0.1), init_scale=32.0)
    for tx in (
        dls,
        optax.chain(optax.clip_by_global_norm(1.0), dls),
        master_weights(dls),
        optax.MultiSteps(dls, every_k_schedule=2),
        optax.inject_hyperparams(dynamic_loss_scale, static_args=("inner", "growth_interval"))(
            inner=jd.sgd(0.1), init_scale=32.0
        ),
    ):
        assert float(loss_scale(tx.init(params))) == 32.0
    with pytest.raises(ValueError, match=r"exactly one DynamicLossScaleState .* found 0"):
        loss_scale(jd.sgd(0.1).init(params))
    with pytest.raises(ValueError, match=r"found 2"):
        loss_scale((dls.init(params), dls.init(params)))


def test_contract_abstract_init_dtypes_no_recompilation_extra_args():
    rng = np.random.default_rng(6)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), helpers.random_tree(rng, SHAPES))
    tx = master_weights(
        dynamic_loss_scale(
            optax.chain(jd.all_reduce(), jd.adam(1e-3)),
            growth_interval=2,
            min_scale=lambda c: 1e-4,
            axis_name="data",
        )
    )
    tx = apply_if_finite_everywhere(tx)
    state = tx.init(params)
    helpers.assert_dtypes_equal(jax.eval_shape(tx.init, params), state)
    traces = []

    def fn(g, s, p):
        traces.append(1)
        return tx.update(g, s, p, unknown_extra=1.0)

    mapped = jax.jit(jax.vmap(fn, in_axes=(0, None, None), axis_name="data", out_axes=(0, None)))
    g = jax.tree.map(lambda x: jnp.stack([x, x]), params)
    _, s1 = mapped(g, state, params)
    bad = jax.tree.map(lambda x: x.at[0].set(jnp.inf), g)
    _, s2 = mapped(bad, s1, params)
    assert len(traces) == 1
    helpers.assert_dtypes_equal(s1, state)
    helpers.assert_dtypes_equal(s2, state)
    assert isinstance(s2.inner_state, MasterWeightsState)
    assert int(s2.total_notfinite) == 1


def test_in_multisteps_and_chain():
    params = jnp.zeros(2)
    tx = optax.MultiSteps(dynamic_loss_scale(jd.sgd(1.0), init_scale=2.0), every_k_schedule=2)
    s = tx.init(params)
    u1, s = tx.update(jnp.full(2, 2.0), s, params)
    u2, s = tx.update(jnp.full(2, 6.0), s, params)
    np.testing.assert_array_equal(np.asarray(u1), 0.0)
    np.testing.assert_array_equal(np.asarray(u2), -2.0)  # mean of (2, 6) unscaled by 2
    chained = optax.chain(optax.scale(1.0), dynamic_loss_scale(jd.sgd(1.0), init_scale=2.0))
    u, _ = chained.update(jnp.full(2, 2.0), chained.init(params), params)
    np.testing.assert_array_equal(np.asarray(u), -1.0)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"init_scale": 0.0}, ValueError, r"`init_scale` must lie in \(0, inf\)"),
        ({"growth_factor": 1.0}, ValueError, r"`growth_factor` must lie in \(1, inf\)"),
        ({"growth_interval": 0}, ValueError, r"`growth_interval` must be an int >= 1"),
        ({"growth_interval": 1.5}, TypeError, r"`growth_interval` must be a Python int"),
        ({"min_scale": 0.0}, ValueError, r"`min_scale` must lie in \(0, inf\)"),
        ({"max_scale": 1e-5}, ValueError, r"`max_scale`=1e-05 must be >= `min_scale`"),
        ({"init_scale": 64.0, "max_scale": 8.0}, ValueError, r"`init_scale`=64.0 exceeds `max_scale`=8.0"),
        ({"backoff_factor": 1.0}, ValueError, r"`backoff_factor` must lie in \(0, 1\)"),
        ({"axis_name": ["data"]}, TypeError, r"`axis_name` must be a hashable name or a tuple"),
    ],
)
def test_dynamic_loss_scale_bad_inputs(kwargs, err, match):
    with pytest.raises(err, match=match):
        dynamic_loss_scale(jd.sgd(0.1), **kwargs)


def test_other_bad_inputs_and_unbound_axis():
    with pytest.raises(TypeError, match=r"`inner` must be an optax.GradientTransformation"):
        dynamic_loss_scale(lambda g: g)
    with pytest.raises(ValueError, match=r"`dtype` must be a floating dtype"):
        master_weights(jd.sgd(0.1), dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"`max_consecutive_errors` must be an int >= 0"):
        apply_if_finite_everywhere(jd.sgd(0.1), -1)
    tx = master_weights(jd.sgd(0.1))
    with pytest.raises(ValueError, match=r"`master_weights` needs `params`: call it as"):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))


def test_reshard_rules_regroup_the_master_copy_only():
    from jaxopt_dist._src import base

    classes = (jd.MasterWeightsState, jd.DynamicLossScaleState, jd.ApplyIfFiniteEverywhereState)
    assert all(base.has_reshard_rules(cls) for cls in classes)
    rules = {(cls.__name__, f): base.reshard_rule(cls, f) for cls in classes for f in cls._fields}
    assert {k: v for k, v in rules.items() if v} == {("MasterWeightsState", "master"): base.REGROUP}
