"""Elastic resume: optimizer state from n workers regrouped for m, and the checks
that stop a state laid out for another number of workers."""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src.training import elastic
from tests import helpers

P = jax.sharding.PartitionSpec

PARAMS = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}

# Every compressor that keeps an error-feedback residual.
COMPRESSORS = {
    "top_k": lambda: jd.top_k(k=2),
    "random_k": lambda: jd.random_k(k=2),
    "block_k": lambda: jd.block_k(k=2),
    "threshold": lambda: jd.threshold(0.1, capacity=2),
    "scaled_sign": lambda: jd.scaled_sign(),
    "qsgd": lambda: jd.qsgd(4, error_feedback=True),
    "powersgd": lambda: jd.powersgd(rank=1, min_compression_rate=1.0),
}


def _placement(tx, params, per_worker_params=False):
    mesh = helpers.make_mesh(2)
    return jd.opt_state_placement(tx, params, mesh=mesh, per_worker_params=per_worker_params).per_worker


def _random_state(tx, params, n, seed=0, per_worker_params=False):
    """``tx``'s state for ``n`` workers, every float leaf random (per-worker rows differ)."""
    rng = np.random.default_rng(seed)
    mask = _placement(tx, params, per_worker_params)

    def fill(x, m):
        shape = ((n,) if m else ()) + np.shape(x)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return rng.standard_normal(shape).astype(jnp.result_type(x))
        return np.broadcast_to(np.asarray(x), shape).copy()

    return jax.tree.map(fill, tx.init(params), mask)


def _residuals(state) -> list[np.ndarray]:
    out = []

    def visit(node):
        if isinstance(node, jd.ErrorFeedbackState):
            out.extend(np.asarray(x) for x in jax.tree.leaves(node.residual))
            visit(node.inner_state)
        elif isinstance(node, (tuple, list)):
            for x in node:
                visit(x)

    visit(state)
    return out


def _replicated(state, mask) -> list[np.ndarray]:
    return [np.asarray(x) for x, m in zip(jax.tree.leaves(state), jax.tree.leaves(mask)) if not m]


# ----------------------------------------------------------------------------
# The regrouping weights.


def test_regroup_weights_are_means_that_conserve_the_mean():
    for n in (1, 2, 3, 4, 6, 7, 8):
        for m in (1, 2, 3, 4, 5, 6, 8, 16):
            w = elastic.regroup_weights(n, m)
            assert w.shape == (m, n) and np.all(w >= 0)
            np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-12)  # each new row is a weighted mean
            np.testing.assert_allclose(w.sum(axis=0), m / n, rtol=1e-12)  # so the mean over workers is kept


def test_regroup_weights_merge_split_and_uneven():
    np.testing.assert_array_equal(elastic.regroup_weights(8, 4), np.kron(np.eye(4), [[0.5, 0.5]]))
    np.testing.assert_array_equal(elastic.regroup_weights(4, 8), np.kron(np.eye(4), [[1.0], [1.0]]))
    np.testing.assert_array_equal(elastic.regroup_weights(5, 5), np.eye(5))
    w = elastic.regroup_weights(8, 6)
    np.testing.assert_array_equal(w[0, :2], [0.75, 0.25])
    np.testing.assert_array_equal(w[1, 1:3], [0.5, 0.5])


# ----------------------------------------------------------------------------
# Conservation of the owed update, for every compressor with a residual.


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_reshard_conserves_the_owed_update(name):
    tx = optax.chain(COMPRESSORS[name](), jd.sgd(0.1, 0.9))
    mask = _placement(tx, PARAMS)
    for n, m in [(8, 4), (8, 6), (4, 8)]:
        _check_conserved(tx, mask, name, n, m)


def _check_conserved(tx, mask, name, n, m):
    state = _random_state(tx, PARAMS, n)
    out = jd.reshard_opt_state(state, tx, PARAMS, num_workers=m)
    assert jax.tree.structure(out) == jax.tree.structure(tx.init(PARAMS))
    before, after = _residuals(state), _residuals(out)
    assert before and len(before) == len(after)
    for r0, r1 in zip(before, after):
        assert r0.shape[0] == n and r1.shape[0] == m and r1.dtype == r0.dtype
        # (1/n) sum of residuals == (1/m) sum of the new ones, to float32 rounding.
        np.testing.assert_allclose(r1.astype(np.float64).mean(0), r0.astype(np.float64).mean(0), atol=1e-7)
    # Replicated leaves (counters, momentum, keys, PowerSGD's warm-start q) are copied.
    for a, b in zip(_replicated(out, mask), _replicated(state, mask)):
        np.testing.assert_array_equal(a, b)
    if name == "powersgd":
        q = jax.tree.leaves(state[0].inner_state.q)
        assert q, "the warm-start q should be in the state"
        helpers.assert_trees_equal(out[0].inner_state.q, state[0].inner_state.q)


def test_round_trip_8_4_8_keeps_the_mean_and_pairs():
    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1))
    state = _random_state(tx, PARAMS, 8, seed=3)
    four = jd.reshard_opt_state(state, tx, PARAMS, num_workers=4)
    eight = jd.reshard_opt_state(four, tx, PARAMS, num_workers=8)
    r8, r4, back = _residuals(state)[0], _residuals(four)[0], _residuals(eight)[0]
    np.testing.assert_allclose(r4, 0.5 * (r8[0::2] + r8[1::2]), rtol=1e-6)  # merging: the pair's mean
    np.testing.assert_array_equal(back, np.repeat(r4, 2, axis=0))  # splitting: copies
    np.testing.assert_allclose(back.mean(0), r8.mean(0), atol=1e-7)
    one = _residuals(jd.reshard_opt_state(state, tx, PARAMS, num_workers=1))[0]
    np.testing.assert_allclose(one[0], r8.mean(0), atol=1e-7)
    # The same count is the identity.
    helpers.assert_trees_equal(jd.reshard_opt_state(state, tx, PARAMS, num_workers=8), state)


def test_uneven_8_to_6_matches_a_numpy_loop():
    tx = optax.chain(jd.scaled_sign(), jd.sgd(0.1))
    state = _random_state(tx, PARAMS, 8, seed=4)
    r8 = _residuals(state)[0].astype(np.float64)
    got = _residuals(jd.reshard_opt_state(state, tx, PARAMS, num_workers=6))[0]
    want = np.zeros((6, *r8.shape[1:]))
    for j in range(6):  # new worker j covers [j/6, (j+1)/6); old worker i covers [i/8, (i+1)/8)
        for i in range(8):
            overlap = max(0.0, min((i + 1) / 8, (j + 1) / 6) - max(i / 8, j / 6))
            want[j] += 6 * overlap * r8[i]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_raw_checkpoint_tree_is_accepted():
    """Nested dicts/lists (a checkpoint restored without a target) are matched by path."""
    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1, 0.9))
    state = _random_state(tx, PARAMS, 8, seed=5)
    raw = [
        {"count": state[0].count, "inner_state": None, "residual": dict(state[0].residual)},
        [{"count": state[1][0].count, "momentum": dict(state[1][0].momentum)}, None],
    ]
    helpers.assert_trees_equal(
        jd.reshard_opt_state(raw, tx, PARAMS, num_workers=4),
        jd.reshard_opt_state(state, tx, PARAMS, num_workers=4),
    )


# ----------------------------------------------------------------------------
# Per-worker keys, parameters and unknown per-worker leaves.


class _KeyState(NamedTuple):
    key: jax.Array  # uint32[2], per-worker
    other: jax.Array  # float32[], per-worker (no rule)


def _per_worker_key_tx(with_other: bool) -> optax.GradientTransformation:
    def init(params):
        del params
        return _KeyState(jax.random.PRNGKey(0), jnp.zeros([], jnp.float32))

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        i = jax.lax.axis_index("data")
        key = jax.random.fold_in(state.key, i)
        other = state.other + i.astype(jnp.float32) if with_other else state.other
        return jax.lax.pmean(updates, "data"), _KeyState(key, other)

    return optax.GradientTransformationExtraArgs(init, update)


def test_per_worker_keys_are_rederived_deterministically():
    tx = _per_worker_key_tx(with_other=False)
    state = _KeyState(jax.random.split(jax.random.PRNGKey(1), 8), np.float32(0))
    a = jd.reshard_opt_state(state, tx, PARAMS, num_workers=6)
    b = jd.reshard_opt_state(state, tx, PARAMS, num_workers=6)
    assert a.key.shape == (6, 2) and a.key.dtype == np.uint32
    np.testing.assert_array_equal(a.key, b.key)
    assert len({tuple(k) for k in np.asarray(a.key)}) == 6  # independent per worker
    expected = jax.random.fold_in(jax.random.fold_in(state.key[0], 6), 5)
    np.testing.assert_array_equal(a.key[5], expected)


def test_unknown_per_worker_leaf_raises():
    tx = _per_worker_key_tx(with_other=True)
    state = _KeyState(jax.random.split(jax.random.PRNGKey(1), 8), np.zeros(8, np.float32))
    with pytest.raises(ValueError, match=r"_KeyState.other.*no rule to regroup it from 8 to 4"):
        jd.reshard_opt_state(state, tx, PARAMS, num_workers=4)


def test_gossip_parameters_and_momentum_are_averaged_into_groups():
    tx = optax.chain(jd.sgd(0.1, 0.9), jd.gossip("ring"))
    state = _random_state(tx, PARAMS, 8, seed=6, per_worker_params=True)
    params = jax.tree.map(lambda x: np.random.default_rng(7).standard_normal((8, *x.shape)), PARAMS)
    new_params = jd.reshard_params(params, num_workers=4)
    new_state = jd.reshard_opt_state(state, tx, PARAMS, num_workers=4, per_worker_params=True)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
        np.testing.assert_allclose(y, 0.5 * (x[0::2] + x[1::2]), rtol=1e-12)
    mom, new_mom = state[0][0].momentum["w"], new_state[0][0].momentum["w"]
    np.testing.assert_allclose(new_mom, 0.5 * (mom[0::2] + mom[1::2]), rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_workers": 0}, r"`num_workers` must be"),
        ({"num_workers": 4, "bad_rows": True}, r"disagree on the number of workers: 6 and 8"),
        (
            {"num_workers": 4, "unstacked": True},
            r"residual\['b'\] is per-worker and should have shape \('n', 3\).*got \(3,\)",
        ),
        ({"num_workers": 4, "other_tx": True}, r"leaves but tx.init\(params\) has|no leaf at"),
    ],
)
def test_bad_inputs(kwargs, match):
    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1, 0.9))
    state = _random_state(tx, PARAMS, 8)
    if kwargs.pop("bad_rows", False):
        state = (
            state[0]._replace(residual={"b": state[0].residual["b"][:6], "w": state[0].residual["w"]}),
            state[1],
        )
    if kwargs.pop("unstacked", False):
        state = (state[0]._replace(residual=jax.tree.map(lambda x: x[0], state[0].residual)), state[1])
    if kwargs.pop("other_tx", False):
        state = {"count": np.int32(0)}
    with pytest.raises(ValueError, match=match):
        jd.reshard_opt_state(state, tx, PARAMS, **kwargs)


def test_reshard_params_rejects_unstacked():
    with pytest.raises(ValueError, match="per-worker parameters"):
        jd.reshard_params({"a": np.zeros((8, 2)), "b": np.zeros((4, 2))}, num_workers=4)


# ----------------------------------------------------------------------------
# A state for another number of workers is rejected where it enters a step.


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"][None, :])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]))


def _batch(t, size=16, dim=4):
    rng = np.random.default_rng(100 + t)
    x = rng.standard_normal((size, dim)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)}


@pytest.mark.parametrize("m", [4, 2])
def test_step_rejects_state_for_another_worker_count(m):
    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1, 0.9))
    params, state8 = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(8)).init(PARAMS)
    step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(m))
    with pytest.raises(ValueError, match=rf"for 8 workers .* the mesh has {m} workers.*reshard_opt_state"):
        step(params, state8, _batch(0))
    with pytest.raises(ValueError, match=rf"for 8 workers .* mesh has {m} workers.*reshard_opt_state"):
        jd.place_opt_state(jax.device_get(state8), tx, PARAMS, mesh=helpers.make_mesh(m))
    # The fix named in the error works.
    state = jd.reshard_opt_state(state8, tx, PARAMS, num_workers=m)
    _, state, _ = step(params, jd.place_opt_state(state, tx, PARAMS, mesh=step.mesh), _batch(0))
    assert state[0].residual["w"].shape == (m, 4, 3)


def test_step_rejects_per_worker_params_for_another_worker_count():
    tx = optax.chain(jd.sgd(0.1), jd.average_params(every=2))
    params8, state8 = jd.data_parallel_step(
        _loss, tx, mesh=helpers.make_mesh(8), per_worker_params=True
    ).init(PARAMS)
    step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(4), per_worker_params=True)
    with pytest.raises(ValueError, match=r"`params` leaf .* for 8 workers .*reshard_params"):
        step(params8, state8, _batch(0))


def test_step_rejects_unstacked_state():
    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1))
    step = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(4))
    params, _ = step.init(PARAMS)
    with pytest.raises(ValueError, match=r"residual\['b'\] has shape \(3,\); .* needs \(4, 3\)"):
        step(params, tx.init(PARAMS), _batch(0))


# ----------------------------------------------------------------------------
# Training continues after resharding.


def _mlp_params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(0.3 * rng.standard_normal((4, 3)), jnp.float32),
        "b": jnp.zeros((3,), jnp.float32),
    }


def _accuracy(params):
    batch = _batch(999, size=512)
    logits = jnp.tanh(batch["x"] @ params["w"] + params["b"][None, :])
    return float(jnp.mean(jnp.argmax(logits, -1) == batch["y"]))


def _train(step, params, state, start, stop):
    for t in range(start, stop):
        params, state, _ = step(params, state, _batch(t, size=32))
    return params, state


@pytest.mark.parametrize("name", ["top_k", "powersgd"])
def test_training_resumed_on_fewer_workers_reaches_the_same_accuracy(name):
    tx = optax.chain(COMPRESSORS[name](), jd.sgd(0.5, 0.9))
    step8 = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(8))
    step4 = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(4))
    params, state = step8.init(_mlp_params())
    params, state = _train(step8, params, state, 0, 15)
    full_params, _ = _train(step8, params, state, 15, 30)  # uninterrupted
    host = jax.device_get(state)
    resumed = jd.place_opt_state(
        jd.reshard_opt_state(host, tx, _mlp_params(), num_workers=4), tx, _mlp_params(), mesh=step4.mesh
    )
    res_params, _ = _train(step4, jax.device_get(params), resumed, 15, 30)
    acc_full, acc_res, acc0 = _accuracy(full_params), _accuracy(res_params), _accuracy(_mlp_params())
    assert acc_full > acc0 + 0.2
    assert abs(acc_res - acc_full) <= 0.03, (acc_res, acc_full)


# ----------------------------------------------------------------------------
# Orbax end to end: saved by 8 devices, resumed by a process with 4.

_CHILD = """
import sys
import numpy as np
from tests import test_elastic
test_elastic.resume_on_four(sys.argv[1], sys.argv[2])
"""


def _ef_tx():
    return optax.chain(jd.top_k(k=2), jd.sgd(0.5, 0.9))


def resume_on_four(ckpt_dir: str, out: str) -> None:
    """The README recipe, run by a child process with 4 devices."""
    import orbax.checkpoint as ocp

    tx, p0 = _ef_tx(), _mlp_params()
    step = jd.data_parallel_step(_loss, tx, mesh=jax.make_mesh((4,), ("data",)))
    with ocp.CheckpointManager(ckpt_dir, item_handlers=ocp.StandardCheckpointHandler()) as mngr:
        latest = mngr.latest_step()
        meta = mngr.item_metadata(latest)
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), getattr(meta, "tree", meta))
        raw = mngr.restore(latest, args=ocp.args.StandardRestore(target))
    opt_state = jd.reshard_opt_state(raw["opt_state"], tx, p0, num_workers=step.num_workers)
    opt_state = jd.place_opt_state(opt_state, tx, p0, mesh=step.mesh)
    params = jd.place_params(raw["params"], mesh=step.mesh)
    params, opt_state = _train(step, params, opt_state, 5, 10)
    np.savez(out, **jax.device_get(params), residual_w=np.asarray(opt_state[0].residual["w"]))


def test_orbax_checkpoint_from_8_devices_resumes_on_4(tmp_path):
    import orbax.checkpoint as ocp

    tx, p0 = _ef_tx(), _mlp_params()
    step8 = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(8))
    params, state = _train(step8, *step8.init(p0), 0, 5)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(5, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
        mngr.wait_until_finished()
    # In this process: the same resharding on 4 of the 8 devices.
    step4 = jd.data_parallel_step(_loss, tx, mesh=helpers.make_mesh(4))
    want_state = jd.reshard_opt_state(jax.device_get(state), tx, p0, num_workers=4)
    np.testing.assert_allclose(
        want_state[0].residual["w"].mean(0), np.asarray(state[0].residual["w"]).mean(0), atol=1e-7
    )
    want_params, want_state = _train(step4, jax.device_get(params), want_state, 5, 10)

    out = tmp_path / "out.npz"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), str(out)],
        env=helpers.child_env(devices=4),
        cwd=helpers.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(out)
    for k in ("w", "b"):
        np.testing.assert_allclose(got[k], np.asarray(want_params[k]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        got["residual_w"], np.asarray(want_state[0].residual["w"]), rtol=1e-6, atol=1e-7
    )
    assert got["residual_w"].shape == (4, 4, 3)
