"""noloco: NoLoCo against a NumPy loop over workers, steps and groups (the reference's float32 form)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src.noloco import NoLoCoState, noloco, noloco_groups
from tests import helpers, test_checkpoint

P = jax.sharding.PartitionSpec

SHAPES = {"a": (3,), "b": (2, 2)}
INNER_LR, INNER_MOM = 0.1, 0.5  # 0.5 * trace is exact: optax's own inner step cannot round differently
ALPHA, BETA = 0.7, 0.5


def _inner():
    return optax.sgd(INNER_LR, momentum=INNER_MOM)


def _batched(ranks, size):
    """The reference's grouping of a permutation: position i goes to group i mod (W / G)."""
    n = len(ranks) // size
    out = [[] for _ in range(n)]
    for i, x in enumerate(ranks):
        out[i % n].append(int(x))
    return out


def np_noloco(grads, params, *, H, G, alpha=ALPHA, beta=BETA, K=64, t0=0, payload="params", start=None):
    """Per-worker params, anchors and momenta after T steps: the reference's loops in float32.

    ``grads``: {name: (T, n, ...)}. Inner: SGD with momentum (optax's form). At a sync each
    group's first member sums the group in group order (own value first), times 1/G; the
    momentum is ``m += (beta - 1) m + alpha d + alpha (a - phi)`` (``alpha (mean - phi)`` for
    ``payload="params"``). ``start``: (x, phi, m, trace) per worker, else all from ``params``.
    Updates are applied by addition, as optax does.
    """
    names = list(params)
    T, n = grads[names[0]].shape[:2]
    copy = lambda: [{k: np.array(params[k]) for k in names} for _ in range(n)]  # noqa: E731
    zeros = lambda: [{k: np.zeros_like(params[k]) for k in names} for _ in range(n)]  # noqa: E731
    x, phi, m, tr = start if start is not None else (copy(), copy(), zeros(), zeros())
    c1, lr, inv = np.float32(beta - 1.0), np.float32(alpha), np.float32(1.0 / G)
    for step in range(T):
        t = t0 + step + 1
        local = []
        for i in range(n):
            new = {}
            for k in names:
                tr[i][k] = grads[k][step, i] + np.float32(INNER_MOM) * tr[i][k]
                new[k] = x[i][k] + np.float32(-INNER_LR) * tr[i][k]
            local.append(new)
        if t % H == 0:
            s = (t // H - 1) % K + 1
            for group in _batched(np.random.default_rng(s * H + 1).permutation(n), G):
                for k in names:
                    root = group[0]
                    if payload == "params":
                        total = local[root][k]
                        for j in group[1:]:
                            total = total + local[j][k]
                        mean = total * inv
                    else:
                        a, d = phi[root][k], local[root][k] - phi[root][k]
                        for j in group[1:]:
                            a = a + phi[j][k]
                            d = d + (local[j][k] - phi[j][k])
                        a, d = a * inv, d * inv
                    for i in group:
                        if payload == "params":
                            delta = c1 * m[i][k] + lr * (mean - phi[i][k])
                        else:
                            delta = c1 * m[i][k] + lr * d + lr * (a - phi[i][k])
                        m[i][k] = m[i][k] + delta
                        phi[i][k] = phi[i][k] + m[i][k]
                        local[i][k] = x[i][k] + (phi[i][k] - x[i][k])
        x = local
    return x, phi, m


def _data(n, T, seed=0):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return grads, params


def _rows(stacked, n):
    return [{k: np.asarray(v)[i] for k, v in stacked.items()} for i in range(n)]


def _starting_at(tx, count):
    """``tx`` whose state starts at step ``count`` (to reach late syncs quickly)."""
    return optax.GradientTransformationExtraArgs(
        lambda p: tx.init(p)._replace(count=jnp.asarray(count, jnp.int32)), tx.update
    )


CASES = [  # (backend, n, G)
    ("vmap", 1, 1),
    ("vmap", 2, 2),
    ("vmap", 4, 2),
    ("vmap", 4, 4),
    ("vmap", 8, 2),
    ("vmap", 8, 4),
    ("shard_map", 2, 2),
    ("shard_map", 4, 2),
    ("shard_map", 4, 4),
    ("shard_map", 8, 2),
    ("shard_map", 8, 4),
]


@pytest.mark.parametrize("backend,n,G", CASES)
def test_noloco_matches_reference(backend, n, G):
    H, T, K = 2, 7, 3  # syncs after steps 2, 4, 6 (the first K draws); step 7 is local
    grads, params = _data(n, T, seed=n + G)
    tx = noloco(_inner(), sync_every=H, group_size=G, num_permutations=K)
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_phi, want_m = np_noloco(grads, params, H=H, G=G, K=K)
    for got, want in ((p, want_x), (state.anchor, want_phi), (state.momentum, want_m)):
        for i in range(n):
            helpers.assert_trees_close(_rows(got, n)[i], want[i], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state.count) == T)


@pytest.mark.parametrize(
    "backend,n,G", [("vmap", 4, 2), ("vmap", 8, 4), ("shard_map", 8, 2), ("shard_map", 8, 4)]
)
def test_reference_payload_is_bit_exact(backend, n, G):
    """``payload="anchor_and_delta"`` sends what the reference sends and gets its bits."""
    H, T, K = 2, 7, 3
    grads, params = _data(n, T, seed=20 + n + G)
    tx = noloco(_inner(), sync_every=H, group_size=G, num_permutations=K, payload="anchor_and_delta")
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_phi, want_m = np_noloco(grads, params, H=H, G=G, K=K, payload="anchor_and_delta")
    for got, want in ((p, want_x), (state.anchor, want_phi), (state.momentum, want_m)):
        for i in range(n):
            helpers.assert_trees_equal(_rows(got, n)[i], want[i])


def test_flatten_sends_the_same_bits_in_one_message():
    n, G, H, T = 8, 4, 2, 3
    grads, params = _data(n, T, seed=12)
    params["c"] = np.arange(3).astype(jnp.bfloat16)  # a leaf of another dtype in the same buffer
    grads["c"] = np.ones((T, n, 3), jnp.bfloat16)

    def make(payload, flatten):
        return noloco(
            _inner(), sync_every=H, group_size=G, num_permutations=2, payload=payload, flatten=flatten
        )

    runs = [
        helpers.run_steps(
            make("anchor_and_delta", f), grads, params, backend="shard_map", per_worker_params=True
        )
        for f in (False, True)
    ]
    helpers.assert_trees_equal(runs[1][1:], runs[0][1:])
    for payload, copies in (("params", 1), ("anchor_and_delta", 2)):
        per_leaf, packed = (
            jd.communication_cost(make(payload, f), params, num_workers=n, steps=H) for f in (False, True)
        )
        assert packed.sent_bytes == per_leaf.sent_bytes
        assert (per_leaf.calls * H, packed.calls * H) == ((G - 1) * copies * len(params), G - 1)


def test_group_members_get_the_same_bits():
    """After the first sync (equal anchors, zero momenta) each group's anchors and momenta are
    bit-identical (every member sums in the group's order); groups differ."""
    n, G, H = 8, 4, 3
    grads, params = _data(n, H, seed=3)
    tx = noloco(_inner(), sync_every=H, group_size=G, num_permutations=1)
    _, p, state = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    groups = noloco_groups(n, group_size=G, step=H)
    for tree in (state.anchor, state.momentum):
        for group in groups:
            helpers.assert_replicas_equal(jax.tree.map(lambda x, g=group: np.asarray(x)[g], tree))
        a = np.asarray(tree["b"])
        assert not np.array_equal(a[groups[0][0]], a[groups[1][0]])
    for i in range(n):  # the parameters land on the anchor within a rounding (applied by addition)
        helpers.assert_trees_close(_rows(p, n)[i], _rows(state.anchor, n)[i], rtol=1e-6, atol=1e-6)


def test_groups_are_the_reference_draws():
    for n, G, t in [(2, 2, 50), (8, 2, 100), (8, 4, 7), (6, 3, 12), (4, 1, 3)]:
        want = _batched(np.random.default_rng(t + 1).permutation(n), G)
        assert noloco_groups(n, group_size=G, step=t) == want
        assert sorted(i for g in want for i in g) == list(range(n))
    with pytest.raises(ValueError, match="multiple of `group_size`"):
        noloco_groups(6, group_size=4, step=1)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_permutations_cycle_after_num_permutations(backend):
    """Sync s > K uses the draw of sync ((s - 1) mod K) + 1; K = 40 (> 32) nests the switch."""
    n, G, H, K = 8, 2, 2, 40
    t0 = (K - 1) * H  # the next syncs are 40 (the last draw), 41 and 42 (draws 1 and 2)
    grads, params = _data(n, 3 * H, seed=4)
    tx = _starting_at(noloco(_inner(), sync_every=H, num_permutations=K), t0)
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_phi, _ = np_noloco(grads, params, H=H, G=G, K=K, t0=t0)
    for i in range(n):
        helpers.assert_trees_close(_rows(p, n)[i], want_x[i], rtol=1e-5, atol=1e-6)
        helpers.assert_trees_close(_rows(state.anchor, n)[i], want_phi[i], rtol=1e-5, atol=1e-6)
    # Without the cycle sync 41 would draw default_rng(83): another grouping, other numbers.
    other_x, _, _ = np_noloco(grads, params, H=H, G=G, K=10**6, t0=t0)
    assert not np.allclose(np.asarray(p["b"])[0], other_x[0]["b"], rtol=1e-5)


@pytest.mark.parametrize("G", [2, 4])
def test_compiled_update_has_no_all_reduce(G):
    n = 8
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    tx = noloco(_inner(), sync_every=1, group_size=G)
    mesh = helpers.make_mesh(n)
    stacked = jax.device_put(
        jax.tree.map(lambda x: jnp.ones((n, *x.shape)), params), jax.sharding.NamedSharding(mesh, P("data"))
    )

    def body(g, p):
        g, p = jax.tree.map(lambda x: x[0], (g, p))
        u, _ = tx.update(g, tx.init(p), p)
        return jax.tree.map(lambda x: x[None], u)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data"), check_vma=True)
    counts = helpers.count_collectives(helpers.compiled_text(f, stacked, stacked))
    assert set(counts) == {"collective-permute"}, counts
    assert counts["collective-permute"] >= (G - 1) * len(SHAPES)


@pytest.mark.parametrize("n,G,payload", [(8, 2, "params"), (8, 4, "params"), (4, 2, "anchor_and_delta")])
def test_communication_cost_is_the_permutes(n, G, payload):
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8, jnp.bfloat16)}
    nbytes = 16 * 8 * 4 + 8 * 2  # bytes of the parameters
    copies = (G - 1) * (2 if payload == "anchor_and_delta" else 1)
    H = 4
    cost = jd.communication_cost(
        noloco(optax.adam(1e-3), sync_every=H, group_size=G, payload=payload),
        params,
        num_workers=n,
        steps=2 * H,
    )
    assert cost.peak_sent_bytes == pytest.approx(copies * nbytes)
    assert cost.sent_bytes == pytest.approx(copies * nbytes / H)
    assert set(cost.by_kind()) == {"permute"}
    assert [s.step % H for s in cost.steps if s.sent_bytes] == [H - 1, H - 1]
    dense = jd.communication_cost(jd.all_reduce(), params, num_workers=n)
    assert cost.compression_ratio == pytest.approx(dense.sent_bytes / (copies * nbytes / H))


def test_data_parallel_step_and_bit_exact_resume(tmp_path):
    """Checkpoint between syncs, resume across two syncs: bit for bit."""
    tc = test_checkpoint
    mesh = helpers.make_mesh(tc.N_WORKERS)

    def make():
        tx = noloco(optax.adamw(1e-2), sync_every=3, outer_lr=optax.linear_schedule(0.7, 0.5, 12))
        return jd.data_parallel_step(tc._loss, tx, mesh=mesh, per_worker_params=True)

    step = make()
    p0 = tc._params0()
    params, opt_state = step.init(p0)
    params, opt_state, _ = tc._run(step, params, opt_state, 0, 5)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(5, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        mngr.wait_until_finished()
    params, opt_state, losses = tc._run(step, params, opt_state, 5, 11)  # syncs after steps 6 and 9
    fresh = make()
    abstract = dict(zip(("params", "opt_state"), fresh.abstract_init(p0)))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(5, args=ocp.args.StandardRestore(abstract))
    params2, opt_state2, losses2 = tc._run(fresh, restored["params"], restored["opt_state"], 5, 11)
    assert losses2 == losses
    helpers.assert_trees_equal(params2, params)
    helpers.assert_trees_equal(opt_state2, opt_state)
    mask = fresh.placement(p0).per_worker
    assert mask.count is False
    assert all(jax.tree.leaves(mask.anchor)) and all(jax.tree.leaves(mask.momentum))
    anchors = np.asarray(params2["w1"])
    assert not np.array_equal(anchors[0], anchors[1])  # no all-reduce: the workers still differ


def test_reshard_regroups_anchors_and_momenta():
    """n -> m keeps the mean of anchors and momenta (the DiLoCo-like part) and the run goes on."""
    n, G, H = 4, 2, 2
    grads, params = _data(n, 3, seed=7)
    tx = noloco(_inner(), sync_every=H, group_size=G, num_permutations=4)
    _, p, state = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    state = state._replace(count=state.count[0])  # replicated
    for m in (2, 8):
        new_state = jd.reshard_opt_state(state, tx, params, num_workers=m, per_worker_params=True)
        new_p = jd.reshard_params(p, num_workers=m)
        assert isinstance(new_state, NoLoCoState) and int(new_state.count) == 3
        for field in ("anchor", "momentum"):
            old, new = getattr(state, field), getattr(new_state, field)
            for k in SHAPES:
                assert new[k].shape == (m, *SHAPES[k])
                np.testing.assert_allclose(new[k].mean(0), np.asarray(old[k]).mean(0), rtol=1e-6, atol=1e-7)
        # Continue 3 steps on m workers (a sync after step 4 and step 6) against the reference.
        more, _ = _data(m, 3, seed=8)
        s = new_state._replace(count=np.full(m, 3, np.int32))

        def step(g, s, p):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        run = jax.jit(jax.vmap(step, axis_name="data"))
        x = new_p
        for t in range(3):
            x, s = run(jax.tree.map(lambda a, t=t: a[t], more), s, x)
        start = (
            _rows(new_p, m),
            _rows(new_state.anchor, m),
            _rows(new_state.momentum, m),
            _rows(new_state.inner_state[0].trace, m),
        )
        want_x, want_phi, _ = np_noloco(more, params, H=H, G=G, t0=3, start=start)
        for i in range(m):
            helpers.assert_trees_close(_rows(x, m)[i], want_x[i], rtol=1e-5, atol=1e-6)
            helpers.assert_trees_close(_rows(s.anchor, m)[i], want_phi[i], rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    inner = _inner()
    for kwargs, err, match in [
        (dict(sync_every=0), ValueError, "sync_every"),
        (dict(sync_every=2.0), TypeError, "sync_every"),
        (dict(group_size=0), ValueError, "group_size"),
        (dict(group_size=True), TypeError, "group_size"),
        (dict(num_permutations=0), ValueError, "num_permutations"),
        (dict(outer_lr=-0.1), ValueError, "outer_lr"),
        (dict(outer_lr="fast"), TypeError, "outer_lr"),
        (dict(outer_momentum=1.5), ValueError, "outer_momentum"),
        (dict(payload="both"), ValueError, "payload"),
        (dict(flatten=1), TypeError, "flatten"),
        (dict(axis_name=["data"]), TypeError, "axis_name"),
    ]:
        with pytest.raises(err, match=match):
            noloco(inner, **kwargs)
    with pytest.raises(TypeError, match="inner"):
        noloco(None)
    tx = noloco(inner, sync_every=2, group_size=3)
    with pytest.raises(ValueError, match=r"number of workers \(4\) must be a multiple of `group_size` \(3\)"):
        jax.vmap(lambda g: tx.update(g, tx.init(g), g), axis_name="data")(jnp.ones((4, 3)))
    tx = noloco(inner)
    with pytest.raises(ValueError, match=r"`noloco` needs `params`"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(jd.UnboundAxisError, match="noloco"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)), jnp.ones(3))


def test_optax_contract():
    """No recompilation, unknown extra args, abstract init, MultiSteps on bf16 with stable dtypes."""
    params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
    tx = optax.MultiSteps(noloco(optax.adamw(1e-2), sync_every=2, num_permutations=2), every_k_schedule=2)
    s, p = helpers.check_bf16_contract(tx, params, steps=8, workers=4)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))
    assert int(s.inner_opt_state.count[0]) == 4


def test_inject_hyperparams_and_schedules():
    n, G, H, T = 4, 2, 2, 5
    grads, params = _data(n, T, seed=9)
    want_x, want_phi, _ = np_noloco(grads, params, H=H, G=G, alpha=0.6, beta=0.25)
    injected = optax.inject_hyperparams(noloco, static_args=("sync_every", "group_size", "num_permutations"))(
        _inner(), sync_every=H, group_size=G, num_permutations=2, outer_lr=0.6, outer_momentum=0.25
    )
    scheduled = noloco(
        _inner(),
        sync_every=H,
        group_size=G,
        num_permutations=2,
        outer_lr=optax.constant_schedule(0.6),
        outer_momentum=optax.constant_schedule(0.25),
    )
    for tx in (injected, scheduled):
        _, p, _ = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=True)
        for i in range(n):
            helpers.assert_trees_close(_rows(p, n)[i], want_x[i], rtol=1e-5, atol=1e-6)
    assert float(injected.init(params).hyperparams["outer_lr"]) == pytest.approx(0.6)


def test_one_group_of_one_is_local():
    """G = 1: nothing crosses the wire; each worker steps towards its own parameters."""
    params = {"w": jnp.zeros((5,))}
    cost = jd.communication_cost(noloco(_inner(), sync_every=2, group_size=1), params, num_workers=4, steps=4)
    assert cost.sent_bytes == 0
    grads, params = _data(4, 4, seed=11)
    tx = noloco(_inner(), sync_every=2, group_size=1)
    _, p, _ = helpers.run_steps(tx, grads, params, backend="shard_map", per_worker_params=True)
    want_x, _, _ = np_noloco(grads, params, H=2, G=1)
    for i in range(4):
        helpers.assert_trees_close(_rows(p, 4)[i], want_x[i], rtol=1e-5, atol=1e-6)


def test_sharded_params_and_tuple_axes_match_replicated():
    """On a 4 data x 2 fsdp mesh (leaves sharded over "fsdp") and over the axes ("dcn", "ici")
    (workers numbered row-major), the 4-worker replicated run's parameters, to float32 rounding."""
    from tests import test_sharded_transforms as ts

    def make():
        return noloco(ts._sgd(), sync_every=2, num_permutations=3)

    want, _ = ts._train(make(), jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]), None, True)
    got, state = ts._train(make(), jax.make_mesh((4, 2), ("data", "fsdp")), ts.SPECS, True)
    axes = ("dcn", "ici")
    tupled, _ = ts._train(
        noloco(ts._sgd(), sync_every=2, num_permutations=3, axis_name=axes),
        jax.make_mesh((2, 2), axes, devices=jax.devices()[:4]),
        None,
        True,
        axis_name=axes,
    )
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(
            np.asarray(tupled[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k
        )
    for k, sp in ts.SPECS.items():
        assert ts._dims(state.anchor[k].sharding.spec, got[k].ndim) == ts._dims(P("data", *sp), got[k].ndim)
        assert state.momentum[k].sharding.spec == state.anchor[k].sharding.spec
    assert not np.allclose(np.asarray(want["w1"])[0], np.asarray(want["w1"])[1])
