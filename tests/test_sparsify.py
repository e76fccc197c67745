"""Tests for top_k, threshold, random_k and block_k (jaxopt_dist/_src/sparsify.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import sparsify as sp
from tests import helpers

P = jax.sharding.PartitionSpec
SHAPES = {"w": (4, 5), "b": (3,), "s": ()}  # 20, 3 and 1 entries
WORKERS = (1, 2, 3, 8)


# ----------------------------------------------------------------------------
# Running T steps in one compiled program.


def make_grads(seed, T, n, shapes=SHAPES, zeros=False):
    return helpers.grads_seq(seed, T, n, shapes, zeros=zeros)


def zero_params(shapes=SHAPES):
    return helpers.zeros(shapes)


# ----------------------------------------------------------------------------
# NumPy references (loops over workers).


def np_sparse_run(grads_seq, select, *, ef=True, shared=None):
    """Runs a sparsifier over T steps in NumPy.

    ``select(t, leaf_name, leaf_index, x_flat) -> indices sent or None
    (dense) or (indices, values)`` for one worker. The mean is the sum over
    workers in worker order divided by n. Returns (outputs per step, residuals).
    """
    names = list(grads_seq)  # dict order == jax.tree order for these sorted keys
    names = sorted(names)
    T, n = grads_seq[names[0]].shape[:2]
    res = {k: np.zeros(grads_seq[k].shape[1:], np.float32) for k in names}
    outs = []
    for t in range(T):
        out = {}
        for li, name in enumerate(names):
            shape = grads_seq[name].shape[2:]
            d = math.prod(shape)
            total = np.zeros(d, np.float32)
            dense_sum = None
            for i in range(n):
                x = (grads_seq[name][t, i].reshape(d) + res[name][i].reshape(d)).astype(np.float32)
                sel = select(t, name, li, x)
                if sel is None:  # dense
                    c = x.copy()
                    dense_sum = c.astype(np.float64) if dense_sum is None else dense_sum + c
                else:
                    idx, vals = sel if isinstance(sel, tuple) else (sel, x[sel])
                    c = np.zeros(d, np.float32)
                    c[idx] = vals
                    total[idx] += vals
                if ef:
                    res[name][i] = (x - c).reshape(shape)
            if dense_sum is not None:
                out[name] = (dense_sum / n).astype(np.float32).reshape(shape)
            else:
                out[name] = (total / np.float32(n)).reshape(shape)
        outs.append(out)
    return outs, res


def np_top_indices(x, k):
    return np.argsort(-np.abs(x), kind="stable")[:k]


def top_k_select(k=None, density=None):
    def select(t, name, li, x):
        d = x.shape[0]
        kl = k if k is not None else min(d, max(1, math.ceil(density * d - 1e-6)))
        return None if kl >= d else np_top_indices(x, kl)

    return select


def threshold_select(thr, capacity):
    def select(t, name, li, x):
        d = x.shape[0]
        keep = np.abs(x) >= thr
        if d <= capacity:
            return np.arange(d), np.where(keep, x, 0).astype(np.float32)
        idx = np_top_indices(x, capacity)
        return idx, np.where(keep[idx], x[idx], 0).astype(np.float32)

    return select


def _shared_select(k, seed, positions):
    """Per (step, leaf) positions of a shared-choice sparsifier; ``positions(key, li, d)``."""
    cache = {}

    def select(t, name, li, x):
        d = x.shape[0]
        if k >= d:
            return None
        if (t, li) not in cache:
            cache[(t, li)] = positions(helpers.step_key(seed, t), li, d)
        return cache[(t, li)]

    return select


def random_k_select(k, seed):
    return _shared_select(k, seed, lambda key, li, d: np.asarray(sp.random_k_indices(key, li, d, k)))


def block_k_select(k, seed):
    return _shared_select(k, seed, lambda key, li, d: (int(sp.block_k_start(key, li, d)) + np.arange(k)) % d)


CASES = {
    "top_k": (lambda: jd.top_k(3), lambda: top_k_select(k=3), True),
    "top_k_density": (lambda: jd.top_k(density=0.25), lambda: top_k_select(density=0.25), True),
    "top_k_no_ef": (lambda: jd.top_k(4, error_feedback=False), lambda: top_k_select(k=4), False),
    "threshold": (lambda: jd.threshold(0.9, capacity=2), lambda: threshold_select(0.9, 2), True),
    "random_k": (lambda: jd.random_k(4, seed=3), lambda: random_k_select(4, 3), True),
    "block_k": (lambda: jd.block_k(4, seed=5), lambda: block_k_select(4, 5), True),
}


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", WORKERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference_30_steps(case, n, backend):
    """30 steps chained before jd.sgd: every step's update equals -lr times the
    NumPy reference (which loops over workers), and replicas stay bit-identical."""
    make_tx, make_select, ef = CASES[case]
    T, lr = 30, 0.5
    grads = make_grads(10 * sorted(CASES).index(case) + n, T, n, zeros=True)
    tx = optax.chain(make_tx(), jd.sgd(lr))
    us, _, state = helpers.scan_steps(tx, grads, zero_params(), backend=backend)
    ref, res = np_sparse_run(grads, make_select(), ef=ef)
    for t in range(T):
        expected = {k: -lr * v for k, v in ref[t].items()}
        helpers.assert_trees_close({k: us[k][t] for k in us}, expected, rtol=1e-5, atol=1e-6)
    if ef:
        helpers.assert_trees_close(state[0].residual, res, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["top_k", "top_k_density", "random_k", "block_k"])
def test_residuals_are_bit_exact(case):
    """The sent entries are zeroed in place; the rest is ``g + e`` bit for bit, as ``x - contribution``."""
    make_tx, make_select, _ = CASES[case]
    grads = make_grads(77, 5, 3)
    _, _, state = helpers.scan_steps(make_tx(), grads, zero_params(), backend="vmap")
    _, res = np_sparse_run(grads, make_select())
    helpers.assert_trees_equal(state.residual, res)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", (1, 3, 8))
def test_top_k_flattened_matches_reference(n, backend):
    T = 10
    grads = make_grads(7 + n, T, n)
    tx = jd.top_k(6, per_leaf=False)
    us, _, state = helpers.scan_steps(tx, grads, zero_params(), backend=backend)
    # NumPy: the tree as one vector in jax.tree.leaves order (b, s, w).
    names = sorted(SHAPES)
    sizes = [math.prod(SHAPES[k]) for k in names]
    flat = np.concatenate([grads[k].reshape(T, n, -1) for k in names], axis=2)
    ref, res = np_sparse_run({"v": flat}, lambda t, name, li, x: np_top_indices(x, 6))
    offsets = np.cumsum([0] + sizes)
    for t in range(T):
        expected = {
            k: ref[t]["v"][offsets[i] : offsets[i + 1]].reshape(SHAPES[k]) for i, k in enumerate(names)
        }
        helpers.assert_trees_close({k: us[k][t] for k in us}, expected, rtol=1e-5, atol=1e-6)
    got_res = np.concatenate([np.asarray(state.residual[k]).reshape(n, -1) for k in names], axis=1)
    np.testing.assert_allclose(got_res, res["v"], rtol=1e-5, atol=1e-6)


def test_top_k_sum_is_bitwise_worker_ordered():
    """The scatter-add adds worker rows in order: bit-identical to a float32 NumPy loop."""
    n, T = 8, 5
    grads = make_grads(11, T, n, shapes={"w": (64,)})
    us, _, _ = helpers.scan_steps(jd.top_k(9), grads, {"w": jnp.zeros(64)}, backend="vmap")
    ref, _ = np_sparse_run(grads, top_k_select(k=9))
    np.testing.assert_array_equal(np.asarray(us["w"]), np.stack([r["w"] for r in ref]))


# ----------------------------------------------------------------------------
# Identities.


def _mean(g):
    return jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), axis=0), g)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: jd.top_k(20),  # k == size of the largest leaf: every leaf dense
        lambda: jd.top_k(density=1.0),
        lambda: jd.top_k(24, per_leaf=False),  # k == total size
        lambda: jd.random_k(20),
        lambda: jd.block_k(density=1.0),
        lambda: jd.threshold(0.0, capacity=20),
    ],
    ids=["top_k", "top_k_density", "top_k_flat", "random_k", "block_k", "threshold"],
)
def test_full_size_equals_mean(make_tx, backend):
    g = jax.tree.map(lambda x: x[0], make_grads(1, 1, 3))
    out = helpers.run_transform(make_tx(), g, backend=backend)
    helpers.assert_trees_close(out, _mean(g), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_sparse_path_with_all_nonzeros_sent_equals_mean(backend):
    """k = d - 1 on the sparse path, each worker holding one exact zero: the mean."""
    rng = np.random.default_rng(2)
    g = rng.standard_normal((3, 10)).astype(np.float32)
    g[np.arange(3), [1, 4, 9]] = 0.0
    for tx in (jd.top_k(9), jd.threshold(0.0, capacity=9)):
        out = helpers.run_transform(tx, {"v": g}, backend=backend)
        np.testing.assert_allclose(out["v"], g.mean(0), rtol=1e-6, atol=1e-7)


def test_threshold_zero_equals_top_k_bitwise():
    grads = make_grads(4, 6, 3, zeros=True)
    a, _, sa = helpers.scan_steps(jd.threshold(0.0, capacity=3), grads, zero_params(), backend="vmap")
    b, _, sb = helpers.scan_steps(jd.top_k(3), grads, zero_params(), backend="vmap")
    helpers.assert_trees_equal(a, b)
    helpers.assert_trees_equal(sa.residual, sb.residual)


def test_huge_threshold_sends_nothing_and_keeps_everything():
    g = make_grads(5, 1, 2)
    g1 = jax.tree.map(lambda x: x[0], g)
    tx = jd.threshold(1e9, capacity=2)

    def fn(g):
        return tx.update(g, tx.init(g))

    out, state = jax.jit(jax.vmap(fn, axis_name="data"))(g1)
    for k in out:
        np.testing.assert_array_equal(out[k], np.zeros_like(g1[k]))
        np.testing.assert_array_equal(state.residual[k], g1[k])


def test_one_worker_top_k_is_local_top_k():
    x = np.array([[0.5, -3.0, 2.0, 0.1, -2.5]], np.float32)
    out = helpers.run_transform(jd.top_k(2), {"v": x}, backend="vmap")
    np.testing.assert_array_equal(out["v"], [0.0, -3.0, 0.0, 0.0, -2.5])


def test_random_k_indices_shared_and_fresh_each_step():
    """The same positions on every worker, different positions from step to step."""
    n, T, d, k = 4, 6, 50, 5
    g = np.ones((T, n, d), np.float32)  # every entry nonzero
    us, _, _ = helpers.scan_steps(
        jd.random_k(k, error_feedback=False), {"v": g}, {"v": jnp.zeros(d)}, backend="vmap"
    )
    supports = [frozenset(np.flatnonzero(np.asarray(us["v"][t]))) for t in range(T)]
    assert all(len(s) == k for s in supports)
    assert len(set(supports)) > 1


def test_block_k_is_a_contiguous_wrapping_block():
    n, T, d, k = 2, 20, 12, 5
    g = np.ones((T, n, d), np.float32)
    us, _, _ = helpers.scan_steps(
        jd.block_k(k, error_feedback=False), {"v": g}, {"v": jnp.zeros(d)}, backend="vmap"
    )
    starts = set()
    for t in range(T):
        support = np.flatnonzero(np.asarray(us["v"][t]))
        assert len(support) == k
        start = [s for s in support if (s - 1) % d not in support]
        assert len(start) == 1
        assert sorted((start[0] + np.arange(k)) % d) == sorted(support)
        starts.add(start[0])
    assert len(starts) > 1


def test_error_feedback_flag_off_has_no_residual():
    tx = jd.top_k(2, error_feedback=False)
    state = tx.init({"v": jnp.zeros(5)})
    assert state.residual == ()


def test_bf16_leaves_keep_dtype_and_match_float32_reference():
    rng = np.random.default_rng(9)
    g32 = rng.standard_normal((3, 16)).astype(np.float32)
    g = {"v": jnp.asarray(g32, jnp.bfloat16)}
    out = helpers.run_transform(jd.top_k(4), g, backend="shard_map")
    assert out["v"].dtype == jnp.bfloat16
    x = np.asarray(g["v"], np.float32)
    ref = np.zeros(16, np.float32)
    for i in range(3):
        idx = np_top_indices(x[i], 4)
        ref[idx] += x[i, idx]
    np.testing.assert_allclose(np.asarray(out["v"], np.float32), ref / 3, rtol=1e-2)


# ----------------------------------------------------------------------------
# Communication: what the docstrings promise.


MIXED = {"w": jnp.zeros((6, 5)), "b": jnp.zeros((3,)), "h": jnp.zeros((40,), jnp.bfloat16)}


def test_top_k_sends_one_all_gather_of_values_and_indices():
    found = helpers.traced_collectives(jd.top_k(4), MIXED, 4)
    gathers = [b for name, b in found if name.startswith("all_gather")]
    reduces = [b for name, b in found if name.startswith("psum")]
    assert gathers == [4 * (4 + 4) + 4 * (2 + 4)]  # w (f32) and h (bf16) sparse
    assert sum(reduces) == 3 * 4 and len(reduces) == 1  # b dense


def test_top_k_flattened_and_threshold_bytes():
    found = helpers.traced_collectives(jd.top_k(5, per_leaf=False), MIXED, 2)
    assert found == [("all_gather_invariant", 5 * (4 + 4))]
    found = helpers.traced_collectives(jd.threshold(0.1, capacity=3), MIXED, 2)
    gathers = [b for name, b in found if name.startswith("all_gather")]
    assert gathers == [3 * (4 + 4) + 3 * (2 + 4)]  # b has 3 <= capacity entries: dense


@pytest.mark.parametrize(
    "make_tx", [lambda: jd.random_k(4), lambda: jd.block_k(4)], ids=["random_k", "block_k"]
)
def test_shared_choice_sends_only_values_in_one_all_reduce_per_dtype(make_tx):
    found = helpers.traced_collectives(make_tx(), MIXED, 4)
    assert all(name.startswith("psum") for name, _ in found)
    assert sorted(b for _, b in found) == sorted([4 * 2, 4 * 4 + 3 * 4])  # bf16 buffer, f32 buffer


def test_compiled_program_has_one_all_gather():
    params = {"a": jnp.zeros((5, 4)), "b": jnp.zeros((7,))}
    f, g = helpers.update_program(jd.top_k(3, per_leaf=False), params, 4)
    counts = helpers.count_collectives(helpers.compiled_text(f, g))
    assert counts == {"all-gather": 1}


# ----------------------------------------------------------------------------
# optax contract.

ALL = {
    "top_k": lambda: jd.top_k(3),
    "top_k_flat": lambda: jd.top_k(density=0.2, per_leaf=False),
    "threshold": lambda: jd.threshold(0.5, capacity=3),
    "random_k": lambda: jd.random_k(3),
    "block_k": lambda: jd.block_k(3),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_placement_residual_per_worker_rest_replicated(name):
    tx = ALL[name]()
    placement = jd.opt_state_placement(tx, zero_params(), mesh=helpers.make_mesh(2))
    per_worker = placement.per_worker
    assert not placement.updates_per_worker
    assert all(jax.tree.leaves(per_worker.residual))
    assert not per_worker.count
    assert not any(jax.tree.leaves(per_worker.inner_state))


@pytest.mark.parametrize("name", sorted(ALL))
def test_contract(name):
    """Abstract init, unknown extra args, stable dtypes, no recompilation."""
    tx = ALL[name]()
    params = zero_params()
    abstract = jax.eval_shape(tx.init, params)
    state = tx.init(params)
    helpers.assert_dtypes_equal(abstract, state)
    traces = []

    def step(g, s):
        traces.append(1)
        return tx.update(g, s, params, unknown_extra=1.0, value=jnp.float32(0))

    f = jax.jit(jax.vmap(step, in_axes=(0, None), out_axes=(0, 0), axis_name="data"))
    g = jax.tree.map(lambda x: x[0], make_grads(0, 1, 2))
    u, s2 = f(g, state)
    s2 = jax.tree.map(lambda x: x[0], s2)
    helpers.assert_dtypes_equal(s2, state)
    helpers.assert_dtypes_equal(jax.tree.map(lambda x: x[0], u), params)
    f(jax.tree.map(lambda x: x + 1, g), state)
    assert len(traces) == 1


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("name", ["top_k", "random_k"])
def test_chain_before_adam_30_steps_replicas_identical(name, backend):
    grads = make_grads(21, 30, 3)
    tx = optax.chain(ALL[name](), jd.adam(1e-2))
    us, p, _ = helpers.scan_steps(tx, grads, zero_params(), backend=backend)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p))
    assert float(np.abs(np.asarray(us["w"])).sum()) > 0


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_inside_multisteps(backend):
    """MultiSteps(every 2): the compressor sees the mean of two mini-batches' gradients."""
    n, T = 2, 6
    grads = make_grads(13, T, n)
    tx = optax.MultiSteps(jd.top_k(3), every_k_schedule=2)
    # jd.opt_state_placement cannot type MultiSteps over a per-worker state yet
    # (its first pass, all replicated, trips MultiSteps' lax.cond), so say it here:
    # the accumulated gradients and the residual are per-worker.
    state = tx.init(zero_params())
    mask = state._replace(
        mini_step=False,
        gradient_step=False,
        inner_opt_state=jax.tree.map(lambda _: False, state.inner_opt_state)._replace(
            residual=jax.tree.map(lambda _: True, state.inner_opt_state.residual)
        ),
        acc_grads=jax.tree.map(lambda _: True, state.acc_grads),
        skip_state=jax.tree.map(lambda _: False, state.skip_state),
    )
    us, _, _ = helpers.scan_steps(tx, grads, zero_params(), backend=backend, mask=mask)
    acc = {k: (grads[k][0::2] + grads[k][1::2]) / 2 for k in grads}
    ref, _ = np_sparse_run(acc, top_k_select(k=3))
    for j in range(T // 2):
        helpers.assert_trees_close({k: us[k][2 * j + 1] for k in us}, ref[j], rtol=1e-5, atol=1e-6)
        helpers.assert_trees_close({k: us[k][2 * j] for k in us}, jax.tree.map(np.zeros_like, ref[j]))


def test_inject_hyperparams_threshold():
    tx = optax.inject_hyperparams(jd.threshold, static_args=("capacity",))(0.5, capacity=2)
    g = {"v": np.array([[0.4, -0.6, 0.1, 2.0]], np.float32)}

    def run(tx, g):
        return helpers.run_transform(tx, g, backend="vmap")

    np.testing.assert_array_equal(run(tx, g)["v"], np.float32([0.0, -0.6, 0.0, 2.0]))
    tx = optax.inject_hyperparams(jd.threshold, static_args=("capacity",))(0.3, capacity=3)
    np.testing.assert_array_equal(run(tx, g)["v"], np.float32([0.4, -0.6, 0.0, 2.0]))


def test_scheduled_threshold_follows_the_step_count():
    sched = optax.piecewise_constant_schedule(10.0, {2: 0.0})  # 10 for steps 0-1, 0 after
    g = np.ones((4, 1, 6), np.float32)
    us, _, _ = helpers.scan_steps(
        jd.threshold(sched, capacity=6, error_feedback=False), {"v": g}, {"v": jnp.zeros(6)}, backend="vmap"
    )
    np.testing.assert_array_equal(np.asarray(us["v"][:, 0]), [0.0, 0.0, 1.0, 1.0])


# ----------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize(
    "factory, kwargs, error, match",
    [
        (jd.top_k, {}, ValueError, r"needs exactly one of `k` and `density`"),
        (jd.top_k, {"k": 2, "density": 0.1}, ValueError, r"needs exactly one of `k` and `density`"),
        (jd.top_k, {"k": 0}, ValueError, r"`k` must be an int >= 1"),
        (jd.top_k, {"k": 2.5}, TypeError, r"`k` must be a Python int"),
        (jd.top_k, {"density": 0.0}, ValueError, r"`density` must lie in \(0, 1\]"),
        (jd.top_k, {"density": 1.5}, ValueError, r"`density` must lie in \(0, 1\]"),
        (
            jd.random_k,
            {"density": optax.constant_schedule(0.1)},
            TypeError,
            r"`density` must be a Python float",
        ),
        (jd.top_k, {"k": 2, "per_leaf": 1}, TypeError, r"`per_leaf` must be a bool"),
        (jd.top_k, {"k": 2, "error_feedback": "yes"}, TypeError, r"`error_feedback` must be a bool"),
        (jd.top_k, {"k": 2, "axis_name": ["data"]}, TypeError, r"`axis_name` must be a hashable name"),
        (jd.random_k, {"k": 2, "seed": -1}, ValueError, r"`seed` must be an int >= 0"),
        (jd.block_k, {"k": 2, "seed": 1.0}, TypeError, r"`seed` must be a Python int"),
        (jd.block_k, {"k": -3}, ValueError, r"`k` must be an int >= 1"),
        (jd.threshold, {"threshold": 0.1, "capacity": 0}, ValueError, r"`capacity` must be an int >= 1"),
        (jd.threshold, {"threshold": 0.1, "capacity": 2.0}, TypeError, r"`capacity` must be a Python int"),
        (jd.threshold, {"threshold": -0.1, "capacity": 2}, ValueError, r"`threshold` must lie in \[0, inf\)"),
        (
            jd.threshold,
            {"threshold": "big", "capacity": 2},
            TypeError,
            r"`threshold` must be a float or an optax",
        ),
    ],
)
def test_bad_arguments(factory, kwargs, error, match):
    with pytest.raises(error, match=match):
        factory(**kwargs)


@pytest.mark.parametrize("factory", [jd.top_k, jd.random_k, jd.block_k])
def test_k_larger_than_every_leaf_is_rejected(factory):
    tx = factory(21)
    with pytest.raises(ValueError, match=r"`k`=21 exceeds the size of the largest leaf \(20 entries\)"):
        tx.init(zero_params())
    with pytest.raises(ValueError, match=r"exceeds the size of the largest leaf"):
        jax.eval_shape(tx.init, zero_params())


def test_k_larger_than_the_tree_is_rejected_when_flattened():
    with pytest.raises(ValueError, match=r"`k`=25 exceeds the total number of entries of the updates \(24\)"):
        jd.top_k(25, per_leaf=False).init(zero_params())


def test_leaves_smaller_than_k_go_dense():
    """k=4: the 3-entry and scalar leaves are averaged exactly; the 20-entry one is sparse."""
    g = jax.tree.map(lambda x: x[0], make_grads(8, 1, 3))
    out = helpers.run_transform(jd.top_k(4), g, backend="shard_map")
    mean = _mean(g)
    helpers.assert_trees_close({"b": out["b"], "s": out["s"]}, {"b": mean["b"], "s": mean["s"]})
    assert np.count_nonzero(np.asarray(out["w"])) <= 3 * 4


def test_inject_hyperparams_with_static_shape_arguments():
    g = jax.tree.map(lambda x: x[0], make_grads(12, 1, 2))
    for factory, kwargs, static in [
        (jd.top_k, {"k": 3}, ("k",)),
        (jd.top_k, {"density": 0.25}, ("density",)),
        (jd.random_k, {"k": 3, "seed": 4}, ("k", "seed")),
    ]:
        injected = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
        helpers.assert_trees_equal(
            helpers.run_transform(injected, g, backend="vmap"),
            helpers.run_transform(factory(**kwargs), g, backend="vmap"),
        )


@pytest.mark.devices(4)
def test_tuple_axis_name_on_a_2d_mesh():
    """Workers on a 2x2 mesh reduced over ("a", "b") jointly."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    g = np.random.default_rng(3).standard_normal((4, 10)).astype(np.float32)
    spec = P(("a", "b"))
    for tx, select in [
        (jd.top_k(3, axis_name=("a", "b")), top_k_select(k=3)),
        (jd.threshold(0.5, capacity=3, axis_name=("a", "b")), threshold_select(0.5, 3)),
    ]:

        def body(g, tx=tx):
            return tx.update(g[0], tx.init(g[0]))[0]

        f = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=P(), check_vma=True)
        out = jax.jit(f)(jax.device_put(g, jax.sharding.NamedSharding(mesh, spec)))
        ref, _ = np_sparse_run({"v": g[None]}, select)
        np.testing.assert_allclose(out, ref[0]["v"], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# Fast paths: the sampled top-k selection and the strided random-k positions.


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_top_k_on_a_large_leaf_matches_reference(backend):
    """A leaf large enough for the two-level selection, with ties, against the NumPy reference."""
    shapes = {"w": (50, 40)}
    n, T = 3, 4
    grads = make_grads(11, T, n, shapes, zeros=True)
    grads = {"w": np.round(grads["w"] * 4) / 4}  # many ties
    us, _, state = helpers.scan_steps(jd.top_k(9), grads, zero_params(shapes), backend=backend)
    ref, res = np_sparse_run(grads, top_k_select(k=9))
    for t in range(T):
        helpers.assert_trees_close({"w": us["w"][t]}, ref[t], rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.residual, res, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_top_k_on_a_leaf_selected_from_a_sample_matches_reference(backend):
    """A leaf large enough for the sampled selection (its lax.cond under vmap and shard_map)."""
    shapes = {"w": (70, 1000)}
    grads = make_grads(12, 2, 2, shapes)
    us, _, state = helpers.scan_steps(jd.top_k(density=0.01), grads, zero_params(shapes), backend=backend)
    ref, res = np_sparse_run(grads, top_k_select(density=0.01))
    for t in range(2):
        helpers.assert_trees_close({"w": us["w"][t]}, ref[t], rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.residual, res, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size, k", [(50, 5), (1000, 10), (97, 96), (10, 1)])
def test_strided_random_k_indices_distinct_in_range_and_uniform(size, k):
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    idx = np.asarray(jax.vmap(lambda key: sp.random_k_indices(key, 0, size, k))(keys))
    assert idx.dtype == np.int32 and idx.min() >= 0 and idx.max() < size
    assert all(len(set(row)) == k for row in idx)
    # Every entry is chosen with probability k / size: counts over 400 draws near 400 k / size.
    counts = np.bincount(idx.ravel(), minlength=size)
    expected = 400 * k / size
    assert np.all(np.abs(counts - expected) < 6 * np.sqrt(expected) + 1)


def test_batched_draws_equal_the_documented_per_leaf_draws():
    """All leaves' starts and strides come from one batched draw; each equals
    the documented draw from its own key ``fold_in(step_key, l)``."""
    key = jax.random.PRNGKey(11)
    plan = [(0, 50, 5), (3, 1000, 10), (7, 97, 96), (9, 10, 1), (12, 2359296, 23593)]
    for leaf, size, k in plan:
        k_start, k_stride = jax.random.split(jax.random.fold_in(key, leaf))
        start = int(jax.random.randint(k_start, (), 0, size, dtype=jnp.int32))
        q = size // k
        stride = int(jax.random.randint(k_stride, (), max(1, q // 2), q + 1, dtype=jnp.int32))
        expected = (start + stride * np.arange(k)) % size
        np.testing.assert_array_equal(sp.random_k_indices(key, leaf, size, k), expected)
        block = int(jax.random.randint(jax.random.fold_in(key, leaf), (), 0, size, dtype=jnp.int32))
        assert int(sp.block_k_start(key, leaf, size)) == block
    starts, strides = sp._progressions(key, plan)
    for i, (leaf, size, k) in enumerate(plan):
        idx = np.asarray(sp.random_k_indices(key, leaf, size, k))
        assert idx[0] == int(starts[i]) and (k == 1 or (idx[1] - idx[0]) % size == int(strides[i]))
    np.testing.assert_array_equal(
        sp._block_starts(key, plan), [int(sp.block_k_start(key, leaf, size)) for leaf, size, _ in plan]
    )


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_random_k_subset_pattern_matches_reference(backend):
    n, T, k = 3, 5, 4
    grads = make_grads(5, T, n)
    select = _shared_select(
        k, 3, lambda key, li, d: np.asarray(sp.random_k_indices(key, li, d, k, pattern="subset"))
    )
    us, _, state = helpers.scan_steps(
        jd.random_k(k, seed=3, pattern="subset"), grads, zero_params(), backend=backend
    )
    ref, res = np_sparse_run(grads, select)
    for t in range(T):
        helpers.assert_trees_close({kk: us[kk][t] for kk in us}, ref[t], rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.residual, res, rtol=1e-5, atol=1e-5)


def test_random_k_bad_pattern():
    with pytest.raises(ValueError, match="`pattern` must be one of"):
        jd.random_k(3, pattern="blocks")
