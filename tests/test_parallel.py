"""data_parallel_step, state placement, and the pmap route."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

P = jax.sharding.PartitionSpec


def _data(n_examples=64, dim=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_examples, dim)).astype(np.float32)
    w_true = rng.standard_normal((dim, 2)).astype(np.float32)
    y = x @ w_true + 0.1 * rng.standard_normal((n_examples, 2)).astype(np.float32)
    return {"x": x, "y": y}


def _params(dim=5):
    return {"w": jnp.zeros((dim, 2), jnp.float32), "b": jnp.zeros(2, jnp.float32)}


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"][None, :]
    return jnp.mean((pred - batch["y"]) ** 2)


def _shards_identical(x):
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    return all(s.tobytes() == shards[0].tobytes() for s in shards)


def test_replicas_bit_identical_after_30_steps():
    mesh = helpers.make_mesh(8)
    tx = optax.chain(jd.all_reduce(), jd.sgd(0.05, momentum=0.9))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
    params, opt_state = step.init(_params())
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(30):
        idx = rng.integers(0, 64, size=32)
        data = _data()
        batch = {k: v[idx] for k, v in data.items()}
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    for leaf in jax.tree.leaves((params, opt_state)):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.addressable_shards) == 8
        assert _shards_identical(leaf)


def np_dp_sgd_momentum(data, n, steps, lr, mu):
    """Reference: per-worker gradients of the MSE on each shard, averaged, torch SGD momentum."""
    x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
    w, b = np.zeros((x.shape[1], 2)), np.zeros(2)
    bw, bb = None, None
    xs, ys = np.split(x, n), np.split(y, n)
    for _ in range(steps):
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for i in range(n):
            r = xs[i] @ w + b - ys[i]
            gw += 2 * xs[i].T @ r / r.size
            gb += 2 * r.sum(0) / r.size
        gw, gb = gw / n, gb / n
        bw = gw if bw is None else mu * bw + gw
        bb = gb if bb is None else mu * bb + gb
        w, b = w - lr * bw, b - lr * bb
    return {"w": w, "b": b}


@pytest.mark.parametrize("n", [1, 2, 8])
def test_step_matches_numpy_reference(n):
    mesh = helpers.make_mesh(n)
    data = _data()
    tx = optax.chain(jd.all_reduce(), jd.sgd(0.05, momentum=0.9))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
    params, opt_state = step.init(_params())
    for _ in range(5):
        params, opt_state, _ = step(params, opt_state, data)
    helpers.assert_trees_close(params, np_dp_sgd_momentum(data, n, 5, 0.05, 0.9), rtol=1e-5, atol=1e-6)


def test_gradients_are_per_worker_before_the_optimizer():
    # Without aggregation in tx, each worker's update must use its own gradient; a
    # silent reduction by shard_map's autodiff would make the workers agree.
    mesh = helpers.make_mesh(2)
    data = {"x": np.array([[1.0], [-1.0]], np.float32), "y": np.zeros((2, 2), np.float32)}
    step = jd.data_parallel_step(
        lambda p, b: jnp.sum(b["x"][:, 0] * p["w"][0]), jd.sgd(1.0), mesh=mesh, per_worker_params=True
    )
    params, state = step.init({"w": jnp.zeros((1,))})
    params, state, _ = step(params, state, data)
    np.testing.assert_array_equal(np.asarray(params["w"]), [[-1.0], [1.0]])


def test_local_sgd_per_worker_params():
    mesh = helpers.make_mesh(4)
    tx = optax.chain(jd.sgd(0.05), jd.average_params(every=3))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=True)
    params, opt_state = step.init(_params())
    assert params["w"].shape == (4, 5, 2) and params["w"].sharding.spec == P("data")
    data = _data()
    for t in range(6):
        params, opt_state, _ = step(params, opt_state, data)
        rows = np.asarray(params["w"])
        spread = max(int(np.max(_ulp_distance(r, rows[0]))) for r in rows)
        if t % 3 == 2:
            # Averaged: each copy is within one ulp of the mean (the rounding of
            # p_i + (mean - p_i)), so two copies are at most two ulps apart.
            assert spread <= 2, (t, spread)
        else:
            assert spread > 1000, (t, spread)


def _ulp_distance(a, b):
    """Distance in units in the last place between float32 arrays."""
    ia = a.astype(np.float32).view(np.int32).astype(np.int64)
    ib = b.astype(np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, np.int64(-(2**31)) - ia, ia)
    ib = np.where(ib < 0, np.int64(-(2**31)) - ib, ib)
    return np.abs(ia - ib)


def test_per_worker_updates_with_replicated_params_rejected():
    mesh = helpers.make_mesh(2)
    step = jd.data_parallel_step(loss_fn, jd.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"updates differ between workers.*per_worker_params=True"):
        step.init(_params())


def test_state_placement_follows_the_data():
    mesh = helpers.make_mesh(4)
    params = _params()
    # Momentum after the all-reduce: the same on every worker -> stored once.
    specs = jd.opt_state_specs(optax.chain(jd.all_reduce(), jd.sgd(0.1, 0.9)), params, mesh=mesh)
    assert [s for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))] == [P(), P(), P()]
    # Momentum before the all-reduce: each worker's own buffer -> stacked per worker.
    tx = optax.chain(jd.scale_by_momentum(0.9), jd.all_reduce())
    state = jd.init_opt_state(tx, params, mesh=mesh)
    mom = state[0]
    assert mom.count.sharding.is_fully_replicated and mom.count.shape == ()
    assert mom.momentum["w"].shape == (4, 5, 2) and mom.momentum["w"].sharding.spec == P("data")
    placement = jd.opt_state_placement(tx, params, mesh=mesh)
    assert placement.updates_per_worker is False


def test_has_aux_and_metrics():
    mesh = helpers.make_mesh(4)

    def loss_with_aux(p, b):
        loss = loss_fn(p, b)
        return loss, {"mae": jnp.mean(jnp.abs(b["x"] @ p["w"] - b["y"]))}

    step = jd.data_parallel_step(
        loss_with_aux, optax.chain(jd.all_reduce(), jd.sgd(0.01)), mesh=mesh, has_aux=True
    )
    params, st = step.init(_params())
    data = _data()
    _, _, metrics = step(params, st, data)
    np.testing.assert_allclose(metrics["loss"], loss_fn(_params(), data), rtol=1e-5)
    np.testing.assert_allclose(metrics["aux"]["mae"], np.mean(np.abs(data["y"])), rtol=1e-5)


def test_no_recompilation_on_second_call():
    mesh = helpers.make_mesh(2)
    traces = []

    def counting_loss(p, b):
        traces.append(1)
        return loss_fn(p, b)

    step = jd.data_parallel_step(counting_loss, optax.chain(jd.all_reduce(), jd.adam(1e-2)), mesh=mesh)
    params, st = step.init(_params())
    data = _data()
    params, st, _ = step(params, st, data)
    n_traces = len(traces)
    for _ in range(3):
        params, st, _ = step(params, st, data)
    assert len(traces) == n_traces


def test_tuple_axis_on_2d_mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    axes = ("node", "local")
    tx = optax.chain(jd.all_reduce(axis_name=axes), jd.sgd(0.05, 0.9))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, axis_name=axes)
    params, st = step.init(_params())
    data = _data()
    for _ in range(3):
        params, st, _ = step(params, st, data)
    helpers.assert_trees_close(params, np_dp_sgd_momentum(data, 8, 3, 0.05, 0.9), rtol=1e-5, atol=1e-6)


def test_pmap_route_matches_shard_map():
    n = 4
    if jax.device_count() < n:
        pytest.skip("needs 4 devices")
    data = _data()
    tx = optax.chain(jd.all_reduce(), jd.sgd(0.05, momentum=0.9))

    def pmap_step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # The pmap route: every leaf carries a leading device axis.
    devices = jax.devices()[:n]
    replicate = lambda t: jax.tree.map(lambda x: jnp.stack([x] * n), t)  # noqa: E731
    params_r = replicate(_params())
    state_r = replicate(tx.init(_params()))
    shard = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), data)
    run = jax.pmap(pmap_step, axis_name="data", devices=devices)
    for _ in range(4):
        params_r, state_r = run(params_r, state_r, shard)
    helpers.assert_replicas_equal(params_r)

    step = jd.data_parallel_step(loss_fn, tx, mesh=helpers.make_mesh(n))
    params, st = step.init(_params())
    for _ in range(4):
        params, st, _ = step(params, st, data)
    helpers.assert_trees_close(jax.tree.map(lambda x: x[0], params_r), params, rtol=1e-6, atol=1e-7)


def test_bad_arguments():
    mesh = helpers.make_mesh(2)
    tx = optax.chain(jd.all_reduce(), jd.sgd(0.1))
    with pytest.raises(ValueError, match=r"names \['batch'\].*jax.make_mesh"):
        jd.data_parallel_step(loss_fn, tx, mesh=mesh, axis_name="batch")
    with pytest.raises(TypeError, match=r"`tx` must be an optax.GradientTransformation"):
        jd.data_parallel_step(loss_fn, "sgd", mesh=mesh)
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh"):
        jd.data_parallel_step(loss_fn, tx, mesh=None)
    with pytest.raises(TypeError, match=r"`loss_fn` must be callable"):
        jd.data_parallel_step(None, tx, mesh=mesh)
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
    params, st = step.init(_params())
    bad = {"x": np.ones((3, 5), np.float32), "y": np.ones((3, 2), np.float32)}
    with pytest.raises(ValueError, match=r"divisible by the 2 workers; got shape \(3, 5\)"):
        step(params, st, bad)


def test_multisteps_with_compressor_places_state():
    # optax.MultiSteps updates its accumulator under lax.cond: the placement search
    # must find the per-worker leaves (accumulator, residual) and the replicated ones.
    mesh = helpers.make_mesh(4)
    tx = optax.MultiSteps(optax.chain(jd.top_k(k=2), jd.sgd(0.05, 0.9)), every_k_schedule=2)
    placement = jd.opt_state_placement(tx, _params(), mesh=mesh)
    assert placement.per_worker.acc_grads == {"w": True, "b": True}
    assert placement.per_worker.inner_opt_state[0].residual == {"w": True, "b": True}
    assert placement.per_worker.inner_opt_state[1][0].momentum == {"w": False, "b": False}
    assert placement.per_worker.mini_step is False
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh)
    params, st = step.init(_params())
    data = _data()
    losses = []
    for _ in range(8):
        params, st, m = step(params, st, data)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    for leaf in jax.tree.leaves(params):
        assert _shards_identical(leaf)


def test_loss_scale_option():
    mesh = helpers.make_mesh(4)
    data = _data()
    inner = optax.chain(jd.all_reduce(), jd.sgd(0.05, momentum=0.9))
    scaled = jd.dynamic_loss_scale(inner, init_scale=2.0**8, axis_name="data")
    plain_step = jd.data_parallel_step(loss_fn, inner, mesh=mesh)
    step = jd.data_parallel_step(loss_fn, scaled, mesh=mesh, loss_scale=jd.loss_scale)
    p1, s1 = plain_step.init(_params())
    p2, s2 = step.init(_params())
    for _ in range(3):
        p1, s1, m1 = plain_step(p1, s1, data)
        p2, s2, m2 = step(p2, s2, data)
        # The reported loss is unscaled; scaling by a power of two is exact in float32.
        np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    helpers.assert_trees_close(p2, p1, rtol=1e-6, atol=1e-7)
    assert float(jd.loss_scale(s2)) == 2.0**8
    with pytest.raises(TypeError, match="`loss_scale` must be a function of the optimizer state"):
        jd.data_parallel_step(loss_fn, scaled, mesh=mesh, loss_scale=2.0)


def test_cpu_meshes_bound_the_steps_in_flight():
    # Dozens of queued steps with collectives deadlock XLA:CPU's in-process
    # communicator (the process aborts); data_parallel_step bounds the queue there.
    mesh = helpers.make_mesh(8)
    tx = optax.chain(jd.sgd(0.05, 0.9), jd.gossip("ring", track_consensus=True))
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=True)
    assert step.in_flight_limit() == 4
    params, st = step.init(_params())
    data = _data()
    for _ in range(300):  # never read back inside the loop
        params, st, metrics = step(params, st, data)
    assert np.isfinite(float(metrics["loss"]))
    explicit = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=True, max_steps_in_flight=2)
    assert explicit.in_flight_limit() == 2
    with pytest.raises(ValueError, match=r"`max_steps_in_flight` must be an int >= 1"):
        jd.data_parallel_step(loss_fn, tx, mesh=mesh, max_steps_in_flight=0)
