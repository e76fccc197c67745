"""Tests for sign_majority_vote, scaled_sign and qsgd (jaxopt_dist/_src/quantize.py)."""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import quantize as q
from tests import helpers

P = jax.sharding.PartitionSpec
SHAPES = {"w": (4, 5), "b": (3,), "s": ()}  # jax.tree order: b, s, w
NAMES = sorted(SHAPES)
WORKERS = (1, 2, 3, 8)


def make_grads(seed, T, n, shapes=SHAPES, zeros=False):
    return helpers.grads_seq(seed, T, n, shapes, zeros=zeros)


def zero_params(shapes=SHAPES):
    return helpers.zeros(shapes)


# ----------------------------------------------------------------------------
# NumPy references (loops over workers).


def np_sign(x):
    return np.where(x < 0, np.float32(-1), np.float32(1))


def np_majority_vote(grads_seq):
    T, n = grads_seq[NAMES[0]].shape[:2]
    outs = []
    for t in range(T):
        outs.append(
            {k: np.sign(sum(np_sign(grads_seq[k][t, i]) for i in range(n))).astype(np.float32) for k in NAMES}
        )
    return outs


def np_scaled_sign_run(grads_seq, ef=True):
    T, n = grads_seq[NAMES[0]].shape[:2]
    res = {k: np.zeros(grads_seq[k].shape[1:], np.float32) for k in NAMES}
    outs = []
    for t in range(T):
        out = {}
        for k in NAMES:
            total = np.zeros(grads_seq[k].shape[2:], np.float32)
            for i in range(n):
                x = (grads_seq[k][t, i] + res[k][i]).astype(np.float32)
                c = (np.float32(np.mean(np.abs(x.astype(np.float64)))) * np_sign(x)).astype(np.float32)
                total = total + c
                if ef:
                    res[k][i] = x - c
            out[k] = total / np.float32(n)
        outs.append(out)
    return outs, res


_uniforms = jax.jit(jax.vmap(q.qsgd_uniforms, in_axes=(None, 0, None)), static_argnums=2)


def np_qsgd_run(grads_seq, levels, seed, bucket=None, ef=False, aggregate="all_reduce"):
    """QSGD in NumPy, worker by worker: ``all_gather`` scales each bucket by the
    worker's own norm and averages the decoded messages; ``all_reduce`` scales
    by the largest norm over workers, sums the integer codes and decodes the sum."""
    T, n = grads_seq[NAMES[0]].shape[:2]
    res = {k: np.zeros(grads_seq[k].shape[1:], np.float32) for k in NAMES}

    def blocks_of(d):
        if bucket is None or bucket >= d:
            return 1, max(d, 1)
        return -(-d // bucket), bucket

    layout = [blocks_of(math.prod(SHAPES[k])) for k in NAMES]
    total_padded = sum(m * b for m, b in layout)
    s = np.float32(levels)
    outs = []
    for t in range(T):
        u_all = np.asarray(_uniforms(helpers.step_key(seed, t), jnp.arange(n), total_padded))
        out = {}
        offset = 0
        for k, (m, b) in zip(NAMES, layout):
            d = math.prod(SHAPES[k])
            xs, vs, norms = [], [], []
            for i in range(n):
                x = (grads_seq[k][t, i].reshape(d) + res[k][i].reshape(d)).astype(np.float32)
                v = np.zeros(m * b, np.float32)
                v[:d] = x
                v = v.reshape(m, b)
                xs.append(x)
                vs.append(v)
                norms.append(np.sqrt(np.sum(v.astype(np.float64) ** 2, axis=1)).astype(np.float32))
            shared = np.max(norms, axis=0)  # what the pmax gives every worker
            total = np.zeros(d, np.float32)
            code_sum = np.zeros(m * b, np.int64)
            for i in range(n):
                scale = shared if aggregate == "all_reduce" else norms[i]
                safe = np.where(scale > 0, scale, np.float32(1))
                r = np.abs(vs[i]) / safe[:, None] * s
                u = u_all[i][offset : offset + m * b].reshape(m, b)
                level = np.minimum(np.floor(r + u), s)
                code = np.sign(vs[i]) * level
                assert np.all(np.abs(code) <= levels)
                code_sum += code.reshape(-1).astype(np.int64)
                c = (code * (scale / s)[:, None]).reshape(-1)[:d].astype(np.float32)
                total = total + c
                if ef:
                    res[k][i] = (xs[i] - c).reshape(SHAPES[k])
            if aggregate == "all_reduce":
                assert np.all(np.abs(code_sum) <= n * levels)
                summed = code_sum.reshape(m, b).astype(np.float32) * (shared / s)[:, None]
                out[k] = (summed.reshape(-1)[:d] / np.float32(n)).reshape(SHAPES[k])
            else:
                out[k] = (total / np.float32(n)).reshape(SHAPES[k])
            offset += m * b
        outs.append(out)
    return outs, res


CASES = {
    "majority_vote": (lambda: jd.sign_majority_vote(), lambda g: (np_majority_vote(g), None)),
    "scaled_sign": (lambda: jd.scaled_sign(), lambda g: np_scaled_sign_run(g)),
    "scaled_sign_no_ef": (
        lambda: jd.scaled_sign(error_feedback=False),
        lambda g: np_scaled_sign_run(g, ef=False),
    ),
    "qsgd": (lambda: jd.qsgd(4, seed=1), lambda g: np_qsgd_run(g, 4, 1)),
    # 20 levels: int8 sums up to 6 workers, int16 at 8.
    "qsgd_buckets_ef": (
        lambda: jd.qsgd(20, seed=2, bucket_size=3, error_feedback=True),
        lambda g: np_qsgd_run(g, 20, 2, bucket=3, ef=True),
    ),
    "qsgd_gather_buckets_ef": (
        lambda: jd.qsgd(2, seed=2, bucket_size=3, error_feedback=True, aggregate="all_gather"),
        lambda g: np_qsgd_run(g, 2, 2, bucket=3, ef=True, aggregate="all_gather"),
    ),
}


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", WORKERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference_30_steps(case, n, backend):
    """30 steps chained before jd.sgd: each update is -lr times the NumPy
    reference (looping over workers); replicas stay bit-identical."""
    make_tx, reference = CASES[case]
    T, lr = 30, 0.5
    grads = make_grads(10 * sorted(CASES).index(case) + n, T, n, zeros=True)
    us, _, state = helpers.scan_steps(
        optax.chain(make_tx(), jd.sgd(lr)), grads, zero_params(), backend=backend
    )
    ref, res = reference(grads)
    for t in range(T):
        expected = {k: -lr * v for k, v in ref[t].items()}
        helpers.assert_trees_close({k: us[k][t] for k in us}, expected, rtol=1e-5, atol=1e-6)
    if res is not None and state[0].residual != ():
        helpers.assert_trees_close(state[0].residual, res, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# Majority vote.


def test_majority_vote_ties_and_zeros():
    """Zeros vote +1; an even split gives 0."""
    g = np.array([[1.0, -1.0, 0.0, -2.0], [-1.0, -1.0, 0.0, 0.0]], np.float32)
    out = helpers.run_transform(jd.sign_majority_vote(), {"v": g}, backend="shard_map")
    np.testing.assert_array_equal(out["v"], np.float32([0.0, -1.0, 1.0, 0.0]))


def test_majority_vote_is_the_sign_not_the_magnitude():
    g = np.array([[100.0], [-1.0], [-1.0]], np.float32)
    out = helpers.run_transform(jd.sign_majority_vote(), {"v": g}, backend="vmap")
    np.testing.assert_array_equal(out["v"], np.float32([-1.0]))


def test_majority_vote_one_worker_is_sign():
    g = np.array([[0.3, -0.2, 0.0, -0.0]], np.float32)
    out = helpers.run_transform(jd.sign_majority_vote(), {"v": g}, backend="vmap")
    np.testing.assert_array_equal(out["v"], np.float32([1.0, -1.0, 1.0, 1.0]))


# ----------------------------------------------------------------------------
# Scaled sign.


def test_scaled_sign_one_worker_one_step():
    x = np.array([[1.0, -3.0, 0.5, 0.0]], np.float32)
    tx = jd.scaled_sign()

    def fn(g):
        return tx.update(g, tx.init(g))

    out, state = jax.jit(jax.vmap(fn, axis_name="data"))({"v": x})
    scale = np.float32(4.5 / 4)
    np.testing.assert_allclose(out["v"][0], scale * np.float32([1, -1, 1, 1]), rtol=1e-7)
    np.testing.assert_allclose(state.residual["v"][0], x[0] - scale * np.float32([1, -1, 1, 1]), rtol=1e-6)


def test_scaled_sign_constant_magnitudes_is_exact_mean():
    """When every entry of a worker has the same magnitude, the compression is lossless."""
    rng = np.random.default_rng(0)
    mags = np.float32([0.5, 2.0, 1.0])[:, None]
    g = (mags * np.where(rng.random((3, 8)) < 0.5, -1, 1)).astype(np.float32)
    out = helpers.run_transform(jd.scaled_sign(), {"v": g}, backend="shard_map")
    np.testing.assert_allclose(out["v"], g.mean(0), rtol=1e-6)


# ----------------------------------------------------------------------------
# QSGD.


def _qsgd_once(tx, g, keys):
    """Outputs of one qsgd step for every key in ``keys`` (outer vmap), workers as inner vmap."""

    def one(key):
        def worker(g):
            state = tx.init(g)
            state = state._replace(inner_state=state.inner_state._replace(key=key))
            return tx.update(g, state)[0]

        return jax.tree.map(lambda x: x[0], jax.vmap(worker, axis_name="data")(g))

    return jax.jit(jax.vmap(one))(keys)


@pytest.mark.parametrize("aggregate", ["all_reduce", "all_gather"])
def test_qsgd_is_unbiased(aggregate):
    """Mean over many seeds is the mean gradient; workers' norms differ by 10x, so
    under all_reduce the small ones are quantized against the shared (largest) norm."""
    rng = np.random.default_rng(3)
    g = {"v": (rng.standard_normal((3, 6)) * np.float32([[1.0], [0.3], [3.0]])).astype(np.float32)}
    N = 4000
    keys = jax.random.split(jax.random.PRNGKey(0), N)
    outs = np.asarray(_qsgd_once(jd.qsgd(1, aggregate=aggregate), g, keys)["v"], np.float64)
    est, se = outs.mean(0), outs.std(0) / np.sqrt(N)
    assert np.all(se > 0)
    np.testing.assert_array_less(np.abs(est - g["v"].mean(0)), 5 * se + 1e-6)


def test_qsgd_levels_round_to_neighbours():
    """One worker: every output is norm * l / s with l = floor or ceil of s |x| / norm."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 50)).astype(np.float32)
    s = 3
    keys = jax.random.split(jax.random.PRNGKey(1), 8)
    outs = np.asarray(_qsgd_once(jd.qsgd(s), {"v": x}, keys)["v"], np.float64)
    norm = np.linalg.norm(x[0].astype(np.float64))
    r = s * np.abs(x[0]) / norm
    levels = outs * s / norm * np.sign(x[0])
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
    assert np.all(np.round(levels) >= np.floor(r) - 1e-6) and np.all(np.round(levels) <= np.ceil(r) + 1e-6)


@pytest.mark.parametrize("aggregate", ["all_reduce", "all_gather"])
def test_qsgd_many_levels_is_the_mean(aggregate):
    g = make_grads(5, 1, 3)
    g = jax.tree.map(lambda x: x[0], g)
    out = helpers.run_transform(jd.qsgd(2**20, aggregate=aggregate), g, backend="shard_map")
    helpers.assert_trees_close(out, jax.tree.map(lambda x: x.mean(0), g), rtol=1e-4, atol=1e-5)


def test_qsgd_randomness_is_per_worker():
    """Two workers with the same gradient draw different roundings."""
    x = np.tile(np.linspace(0.1, 1.0, 40, dtype=np.float32), (2, 1))
    tx = jd.qsgd(1)
    # With one level the output of each worker is norm * {0, 1} per entry: the
    # mean over two workers takes the value norm / 2 only where they differ.
    out = np.asarray(helpers.run_transform(tx, {"v": x}, backend="vmap")["v"])
    norm = np.linalg.norm(x[0])
    assert np.any(np.isclose(out, norm / 2, rtol=1e-5))


def test_qsgd_zero_gradient_stays_zero():
    out = helpers.run_transform(jd.qsgd(4), {"v": np.zeros((3, 7), np.float32)}, backend="shard_map")
    np.testing.assert_array_equal(out["v"], np.zeros(7, np.float32))


def test_qsgd_code_dtype():
    assert q.qsgd_code_dtype(1) == jnp.int8
    assert q.qsgd_code_dtype(127) == jnp.int8
    assert q.qsgd_code_dtype(128) == jnp.int16
    assert q.qsgd_code_dtype(32767) == jnp.int16
    assert q.qsgd_code_dtype(32768) == jnp.int32


def test_qsgd_sum_dtype():
    assert q.qsgd_sum_dtype(127, 1) == jnp.int8
    assert q.qsgd_sum_dtype(15, 8) == jnp.int8
    assert q.qsgd_sum_dtype(16, 8) == jnp.int16
    assert q.qsgd_sum_dtype(64, 8) == jnp.int16
    assert q.qsgd_sum_dtype(4095, 8) == jnp.int16  # 32760
    assert q.qsgd_sum_dtype(4096, 8) == jnp.int32  # 32768
    assert q.qsgd_sum_dtype(2**31 - 1, 1) == jnp.int32
    with pytest.raises(ValueError, match=r"`levels` \* workers must be at most 2\*\*31 - 1"):
        q.qsgd_sum_dtype(2**28, 8)


@pytest.mark.parametrize(
    "levels, n, dtype", [(64, 8, jnp.int16), (15, 8, jnp.int8), (16, 8, jnp.int16), (64, 1, jnp.int8)]
)
def test_qsgd_all_reduce_sums_in_the_smallest_safe_int(levels, n, dtype):
    """A pmax of the 3 float32 norms, then one psum of the 74 codes in ``dtype``."""
    found = helpers.traced_collectives(jd.qsgd(levels), MIXED, n)
    assert found == [("pmax", 4 * 3), ("psum_invariant", 74 * jnp.dtype(dtype).itemsize)]


@pytest.mark.parametrize("n, levels, dtype", [(127, 1, jnp.int8), (43, 3, jnp.int16)])
def test_qsgd_all_reduce_largest_sums_are_exact(n, levels, dtype):
    """Every worker sends code +levels (or -levels) on an entry: the sum reaches n * levels
    (127 in int8; 129 just past it, in int16) and decodes to the exact mean."""
    assert q.qsgd_sum_dtype(levels, n) == dtype
    g = {"a": np.tile(np.float32([2.0, 0.0]), (n, 1)), "b": np.tile(np.float32([0.0, -0.5]), (n, 1))}
    out = helpers.run_transform(jd.qsgd(levels), g, backend="vmap")
    helpers.assert_trees_close(
        out, {"a": np.float32([2.0, 0.0]), "b": np.float32([0.0, -0.5])}, rtol=1e-6, atol=0
    )


def test_qsgd_all_reduce_too_many_levels_for_int32_raises_when_traced():
    tx = jd.qsgd(2**30)
    g = {"v": np.ones((3, 4), np.float32)}
    with pytest.raises(ValueError, match=r"`levels` \* workers .* got 1073741824 \* 3"):
        helpers.run_transform(tx, g, backend="vmap")
    out = helpers.run_transform(jd.qsgd(2**30, aggregate="all_gather"), g, backend="vmap")
    np.testing.assert_allclose(out["v"], np.ones(4), rtol=1e-6)


def test_qsgd_one_worker_both_modes_agree():
    """With one worker the shared scale is the worker's own norm: the modes are the same algorithm."""
    grads = make_grads(9, 4, 1, zeros=True)
    outs = [
        helpers.scan_steps(jd.qsgd(5, bucket_size=4, aggregate=a), grads, zero_params(), backend="vmap")[0]
        for a in ("all_reduce", "all_gather")
    ]
    helpers.assert_trees_close(outs[0], outs[1], rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------
# Communication: what the docstrings promise.


MIXED = {"w": jnp.zeros((6, 5)), "b": jnp.zeros((3,)), "h": jnp.zeros((41,), jnp.bfloat16)}  # D = 74, L = 3


@pytest.mark.parametrize(
    "make_tx, nbytes",
    [
        (lambda: jd.sign_majority_vote(), math.ceil(74 / 8)),
        (lambda: jd.scaled_sign(), math.ceil(74 / 8) + 4 * 3),
        (lambda: jd.qsgd(127, aggregate="all_gather"), 74 * 1 + 4 * 3),
        (lambda: jd.qsgd(128, aggregate="all_gather"), 74 * 2 + 4 * 3),
        (lambda: jd.qsgd(40000, aggregate="all_gather"), 74 * 4 + 4 * 3),
        (
            lambda: jd.qsgd(5, bucket_size=8, aggregate="all_gather"),
            74 * 1 + 4 * (math.ceil(30 / 8) + 1 + math.ceil(41 / 8)),
        ),
    ],
    ids=["majority_vote", "scaled_sign", "qsgd127", "qsgd128", "qsgd40000", "qsgd_buckets"],
)
def test_one_all_gather_of_the_documented_size(make_tx, nbytes):
    found = helpers.traced_collectives(make_tx(), MIXED, 4)
    assert found == [("all_gather_invariant", nbytes)]


def test_compiled_program_has_one_all_gather():
    f, g = helpers.update_program(jd.scaled_sign(), MIXED, 4)
    assert helpers.count_collectives(helpers.compiled_text(f, g)) == {"all-gather": 1}


# ----------------------------------------------------------------------------
# optax contract.

ALL = {
    "majority_vote": lambda: jd.sign_majority_vote(),
    "scaled_sign": lambda: jd.scaled_sign(),
    "qsgd": lambda: jd.qsgd(3, bucket_size=4),
    "qsgd_gather": lambda: jd.qsgd(3, bucket_size=4, aggregate="all_gather"),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_placement(name):
    tx = ALL[name]()
    placement = jd.opt_state_placement(tx, zero_params(), mesh=helpers.make_mesh(2))
    assert not placement.updates_per_worker
    per_worker = placement.per_worker
    assert not per_worker.count
    assert not any(jax.tree.leaves(per_worker.inner_state))  # qsgd's key is shared
    assert all(jax.tree.leaves(per_worker.residual))


@pytest.mark.parametrize("name", sorted(ALL))
def test_contract(name):
    """Abstract init, unknown extra args, stable dtypes, no recompilation."""
    tx = ALL[name]()
    params = zero_params()
    state = tx.init(params)
    helpers.assert_dtypes_equal(jax.eval_shape(tx.init, params), state)
    traces = []

    def step(g, s):
        traces.append(1)
        return tx.update(g, s, params, unknown_extra="ignored", value=jnp.float32(0))

    f = jax.jit(jax.vmap(step, in_axes=(0, None), axis_name="data"))
    g = jax.tree.map(lambda x: x[0], make_grads(0, 1, 2))
    u, s2 = f(g, state)
    helpers.assert_dtypes_equal(jax.tree.map(lambda x: x[0], s2), state)
    helpers.assert_dtypes_equal(jax.tree.map(lambda x: x[0], u), params)
    f(jax.tree.map(lambda x: 2 * x, g), state)
    assert len(traces) == 1


def test_bf16_updates_come_back_bf16():
    g = {"v": jnp.asarray(np.random.default_rng(0).standard_normal((2, 9)), jnp.bfloat16)}
    for tx in (jd.sign_majority_vote(), jd.scaled_sign(), jd.qsgd(3), jd.qsgd(3, aggregate="all_gather")):
        assert helpers.run_transform(tx, g, backend="shard_map")["v"].dtype == jnp.bfloat16


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("name", sorted(ALL))
def test_chain_before_adam_30_steps_replicas_identical(name, backend):
    grads = make_grads(31, 30, 3)
    us, p, _ = helpers.scan_steps(
        optax.chain(ALL[name](), jd.adam(1e-2)), grads, zero_params(), backend=backend
    )
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p))
    assert float(np.abs(np.asarray(us["w"])).sum()) > 0


def test_inside_multisteps():
    """MultiSteps(every 2) hands the mean of two gradients to the vote, every other step."""
    n, T = 3, 4
    grads = make_grads(17, T, n)
    tx = optax.MultiSteps(jd.sign_majority_vote(), every_k_schedule=2)
    # vmap: jd.opt_state_placement cannot type MultiSteps' per-worker accumulator
    # yet (see test_sparsify.test_inside_multisteps for shard_map with a given placement).
    us, _, _ = helpers.scan_steps(tx, grads, zero_params(), backend="vmap")
    acc = {k: (grads[k][0::2] + grads[k][1::2]) / 2 for k in grads}
    ref = np_majority_vote(acc)
    for j in range(T // 2):
        helpers.assert_trees_equal({k: us[k][2 * j + 1] for k in us}, ref[j])
        helpers.assert_trees_close({k: us[k][2 * j] for k in us}, jax.tree.map(np.zeros_like, ref[j]), atol=0)


def test_qsgd_under_inject_hyperparams_with_static_levels():
    tx = optax.inject_hyperparams(jd.qsgd, static_args=("levels", "bucket_size", "seed"))(2**20)
    g = {"v": np.random.default_rng(1).standard_normal((2, 5)).astype(np.float32)}
    out = helpers.run_transform(tx, g, backend="vmap")
    np.testing.assert_allclose(out["v"], g["v"].mean(0), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize(
    "factory, kwargs, error, match",
    [
        (jd.qsgd, {"levels": 0}, ValueError, r"`levels` must be an int >= 1"),
        (jd.qsgd, {"levels": 2.0}, TypeError, r"`levels` must be a Python int"),
        (jd.qsgd, {"levels": 2**31}, ValueError, r"`levels` must be at most 2\*\*31 - 1"),
        (jd.qsgd, {"levels": 2, "bucket_size": 0}, ValueError, r"`bucket_size` must be an int >= 1"),
        (jd.qsgd, {"levels": 2, "seed": -2}, ValueError, r"`seed` must be an int >= 0"),
        (jd.qsgd, {"levels": 2, "error_feedback": None}, TypeError, r"`error_feedback` must be a bool"),
        (jd.qsgd, {"levels": 2, "axis_name": {"data"}}, TypeError, r"`axis_name` must be a hashable name"),
        (
            jd.qsgd,
            {"levels": 2, "aggregate": "x"},
            ValueError,
            r"`aggregate` must be 'all_reduce' or 'all_gather'",
        ),
        (jd.qsgd, {"levels": 2, "aggregate": None}, ValueError, r"`aggregate` must be .*; got None"),
        (jd.scaled_sign, {"error_feedback": 1}, TypeError, r"`error_feedback` must be a bool"),
        (jd.scaled_sign, {"axis_name": None}, ValueError, r"`axis_name` must name the mapped axis"),
        (jd.sign_majority_vote, {"axis_name": ()}, ValueError, r"`axis_name` must not be an empty tuple"),
    ],
)
def test_bad_arguments(factory, kwargs, error, match):
    with pytest.raises(error, match=match):
        factory(**kwargs)


# ----------------------------------------------------------------------------
# The hashed uniforms (default) and the threefry option.


def test_hash_uniforms_are_uniform_and_key_dependent():
    u = np.asarray(q.hash_uniforms(jax.random.PRNGKey(0), 100_000))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(hist - 10_000) < 500)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02  # neighbours uncorrelated
    v = np.asarray(q.hash_uniforms(jax.random.PRNGKey(1), 100_000))
    assert np.mean(u == v) < 0.01 and abs(np.corrcoef(u, v)[0, 1]) < 0.02


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_qsgd_threefry_option_matches_reference(backend, monkeypatch):
    n, T = 3, 4
    grads = make_grads(3, T, n, zeros=True)
    us, _, _ = helpers.scan_steps(
        optax.chain(jd.qsgd(4, seed=1, rng="threefry"), jd.sgd(0.5)), grads, zero_params(), backend=backend
    )
    threefry = jax.jit(
        jax.vmap(lambda k, w, t: q.qsgd_uniforms(k, w, t, rng="threefry"), in_axes=(None, 0, None)),
        static_argnums=2,
    )
    monkeypatch.setattr(sys.modules[__name__], "_uniforms", threefry)
    ref, _ = np_qsgd_run(grads, 4, 1)
    for t in range(T):
        expected = {k: -0.5 * v for k, v in ref[t].items()}
        helpers.assert_trees_close({k: us[k][t] for k in us}, expected, rtol=1e-5, atol=1e-6)


def test_qsgd_bad_rng():
    with pytest.raises(ValueError, match="`rng` must be one of"):
        jd.qsgd(4, rng="philox")
