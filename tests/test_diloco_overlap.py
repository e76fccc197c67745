"""diloco(overlap=True), diloco(eager=True) and overlapped_step.

``overlap=True`` only moves where the exchange runs: the numbers are those of
``overlap=False`` bit for bit, run by the step alone or by
:func:`jaxopt_dist.overlapped_step` on a second mesh. ``eager=True`` is
checked against a NumPy loop over workers (the rule of Kale, Douillard and
Donchev 2025: the previous synchronisation's mean plus the worker's own fresh
correction).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxopt_dist as jd
from jaxopt_dist import islands
from tests import helpers
from tests.test_diloco import INNER_LR, INNER_MOM, OUTER_LR, OUTER_MOM, SHAPES, _data, _inner


def np_eager(grads, params, *, H, F=1, groups=None, weights=None):
    """Per-worker params and anchors after T steps of eager DiLoCo: a loop over steps, workers, fragments.

    Inner SGD with momentum, outer Nesterov SGD (0.7, 0.9) per worker and fragment. At fragment
    ``f``'s synchronisation worker ``i`` steps its own outer optimizer with
    ``mean_j(own_j(previous sync)) + (own_i - own_i(previous sync)) / n``; zero before the first.
    With ``weights`` (``[rounds, n]``, each fragment counting its own rounds) the mean is weighted
    and ``1 / n`` is worker ``i``'s weight over the sum in the previous round (``1 / n`` before any).
    """
    names = list(SHAPES)
    T, n = grads[names[0]].shape[:2]
    groups = groups or [list(range(f, len(names), F)) for f in range(F)]
    x = [{k: params[k].copy() for k in names} for _ in range(n)]
    mom = [{k: np.zeros_like(params[k]) for k in names} for _ in range(n)]
    anchor = [{k: params[k].copy() for k in names} for _ in range(n)]
    buf = [{k: np.zeros_like(params[k]) for k in names} for _ in range(n)]
    own_prev = [{k: np.zeros_like(params[k]) for k in names} for _ in range(n)]
    mean_prev = {k: np.zeros_like(params[k]) for k in names}
    share = [[None] * n for _ in groups]  # None: 1 / n, divided as the default mean does
    rounds = [0] * len(groups)
    for t in range(T):
        for i in range(n):
            for k in names:
                mom[i][k] = grads[k][t, i] + np.float32(INNER_MOM) * mom[i][k]
                x[i][k] = x[i][k] - np.float32(INNER_LR) * mom[i][k]
        for f, g in enumerate(groups):
            if t % H != (f + 1) * (H // F) - 1:
                continue
            keys = [names[j] for j in g]
            own = [{k: anchor[i][k] - x[i][k] for k in keys} for i in range(n)]
            for i in range(n):
                for k in keys:
                    fresh = own[i][k] - own_prev[i][k]
                    s = share[f][i]
                    d = mean_prev[k] + (fresh / np.float32(n) if s is None else s * fresh)
                    buf[i][k] = np.float32(OUTER_MOM) * buf[i][k] + d
                    anchor[i][k] = anchor[i][k] - np.float32(OUTER_LR) * (
                        d + np.float32(OUTER_MOM) * buf[i][k]
                    )
                    x[i][k] = anchor[i][k]
                    own_prev[i][k] = own[i][k]
            w = np.ones(n, np.float32) if weights is None else np.asarray(weights[rounds[f]], np.float32)
            rounds[f] += 1
            for k in keys:
                acc = np.zeros_like(mean_prev[k])
                for i in range(n):
                    acc = acc + w[i] * own[i][k]
                mean_prev[k] = acc / np.sum(w)
            if weights is not None:
                share[f] = [w[i] / np.sum(w) for i in range(n)]
    return x, anchor


@pytest.mark.parametrize(
    "backend,n,F", [("vmap", 3, 1), ("vmap", 2, 2), ("shard_map", 2, 4), ("shard_map", 4, 2)]
)
@pytest.mark.parametrize("overlap", [False, True])
def test_eager_matches_reference(backend, n, F, overlap):
    H = 4 * F if F > 1 else 3
    T = 3 * H + 1
    grads, params = _data(n, T, seed=20 + n + F)
    tx = jd.diloco(_inner(), sync_every=H, num_fragments=F, eager=True, overlap=overlap)
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_anchor = np_eager(grads, params, H=H, F=F)
    for i in range(n):
        helpers.assert_trees_close(
            {k: np.asarray(v)[i] for k, v in p.items()}, want_x[i], rtol=1e-5, atol=1e-5
        )
        got_anchor = {k: np.asarray(v)[i] for k, v in state.anchor.items()}
        helpers.assert_trees_close(got_anchor, want_anchor[i], rtol=1e-5, atol=1e-5)
    # The replicas drift apart (each applies its own fresh pseudo-gradient), as the method says.
    assert not np.array_equal(np.asarray(state.anchor["a"])[0], np.asarray(state.anchor["a"])[1])


@pytest.mark.parametrize(
    "backend,n,F,overlap", [("vmap", 3, 1, False), ("vmap", 3, 1, True), ("shard_map", 2, 2, False)]
)
def test_eager_with_weighted_workers_matches_reference(backend, n, F, overlap):
    """With a weighted mean (islands' in-process reference) a worker's fresh pseudo-gradient enters
    with its weight over the sum in the previous round, 0 when it was absent."""
    H = 2 * F
    T = 4 * H + 1
    grads, params = _data(n, T, seed=40 + n)
    table = np.ones((4, n), np.float32)
    table[1, n - 1] = 0.0  # absent in each fragment's second round
    table[2, 0] = 3.0  # a token-weighted round
    tx = jd.diloco(
        _inner(),
        sync_every=H,
        num_fragments=F,
        eager=True,
        overlap=overlap,
        aggregate=islands.weighted_mean(table),
    )
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_anchor = np_eager(grads, params, H=H, F=F, weights=table)
    for i in range(n):
        got_anchor = {k: np.asarray(v)[i] for k, v in state.anchor.items()}
        helpers.assert_trees_close(got_anchor, want_anchor[i], rtol=1e-5, atol=1e-5)
    # Unweighted (1 / n everywhere) is a different run: the check above can tell them apart.
    _, plain_anchor = np_eager(grads, params, H=H, F=F)
    assert not np.allclose(plain_anchor[0]["a"], want_anchor[0]["a"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "backend,n,F,tau,aggregate",
    [
        ("vmap", 2, 2, 1, None),
        ("vmap", 3, 1, 2, "low_bit"),
        ("shard_map", 4, 2, 2, None),
        ("shard_map", 2, 4, 1, None),
    ],
)
def test_overlap_changes_no_number(backend, n, F, tau, aggregate):
    """Exchanged inline in the applying step (nobody ran it before), the numbers are overlap=False's.

    To float32 rounding: the two settings are two XLA programs, and XLA:CPU contracts multiplies and
    adds into fused multiply-adds per program and per instruction set (an AVX2 host differs from an
    AVX-512 one in the last bit). Within each run the replicas' anchors are bit-identical (checked
    under shard_map, where each worker is a program of its own).
    """
    H = 12 if F == 4 else 6
    grads, params = _data(n, 2 * H + 3, seed=30 + n)

    def make(overlap):
        agg = jd.low_bit(block_size=4) if aggregate else None
        return jd.diloco(
            _inner(),
            sync_every=H,
            num_fragments=F,
            sync_delay=tau,
            mixing=0.25,
            aggregate=agg,
            overlap=overlap,
        )

    _, p0, s0 = helpers.run_steps(make(False), grads, params, backend=backend, per_worker_params=True)
    _, p1, s1 = helpers.run_steps(make(True), grads, params, backend=backend, per_worker_params=True)
    for got, want in [(p1, p0), (s1.anchor, s0.anchor), (s1.outer_states, s0.outer_states)]:
        helpers.assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
    helpers.assert_trees_close(s1.aggregate_states, s0.aggregate_states, rtol=1e-6, atol=1e-7)
    if backend == "shard_map":  # one program per device; under vmap the workers are rows of one
        # array, and a vectorized loop may contract a row's multiply-adds unlike its neighbour's.
        helpers.assert_replicas_equal(s1.anchor)
        helpers.assert_replicas_equal(s0.anchor)
    # It did move: three synchronisations' outer steps are in the anchors.
    assert not np.allclose(np.asarray(s0.anchor["a"])[0], params["a"])


# ----------------------------------------------------------------------------
# overlapped_step: the exchanges on a second mesh.

_W = np.random.default_rng(0)


def _mlp_params():
    rng = np.random.default_rng(1)
    return {
        "w1": jnp.asarray(rng.normal(size=(4, 8)) * 0.3, jnp.float32),
        "b": jnp.zeros(8, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)) * 0.3, jnp.float32),
    }


def _loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b"][None]) @ p["w2"] - y) ** 2)


def _batches(T, n):
    rng = np.random.default_rng(2)
    return [
        (rng.normal(size=(2 * n, 4)).astype(np.float32), rng.normal(size=(2 * n, 1)).astype(np.float32))
        for _ in range(T)
    ]


def _meshes(n):
    devs = jax.devices()
    return jax.make_mesh((n,), ("data",), devices=devs[:n]), jax.make_mesh(
        (n,), ("data",), devices=devs[n : 2 * n]
    )


def _run(run, params, opt_state, batches):
    losses = []
    for b in batches:
        params, opt_state, metrics = run(params, opt_state, b)
        losses.append(float(metrics["loss"]))
    return params, opt_state, losses


OVERLAPPED = [  # (n, diloco kwargs)
    (2, dict(sync_every=6, num_fragments=3, sync_delay=1)),
    (2, dict(sync_every=8, num_fragments=2, sync_delay=3, mixing=0.5, aggregate="low_bit")),
    (4, dict(sync_every=4, num_fragments=2, eager=True)),
    (2, dict(sync_every=3, eager=True, aggregate="low_bit")),
]


@pytest.mark.parametrize("n,kw", OVERLAPPED)
@pytest.mark.parametrize("where", ["comm_mesh", "fused"])
def test_overlapped_step_equals_the_step_alone(n, kw, where):
    mesh, comm_mesh = _meshes(n)
    comm_mesh = comm_mesh if where == "comm_mesh" else None

    def make(overlap):
        args = dict(kw, aggregate=jd.low_bit(block_size=8)) if kw.get("aggregate") else kw
        tx = jd.diloco(optax.adam(1e-2), overlap=overlap, **args)
        return jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True)

    batches = _batches(2 * kw["sync_every"] - 2, n)
    plain = make(False)
    p0, s0, l0 = _run(plain, *plain.init(_mlp_params()), batches)
    run = jd.overlapped_step(make(True), comm_mesh=comm_mesh)
    p1, s1, l1 = _run(run, *run.init(_mlp_params()), batches)
    assert l1 == l0
    helpers.assert_trees_equal(p1, p0)
    helpers.assert_trees_equal(s1.anchor, s0.anchor)
    helpers.assert_trees_equal(s1.inner_state, s0.inner_state)
    if not kw.get("eager"):
        shapes = jax.tree.map(jnp.shape, _mlp_params())
        assert jax.tree.map(jnp.shape, s1.anchor) == shapes  # replicated, not stacked per worker
    if not kw.get("eager") and not kw.get("mixing"):  # the replicas agree on a fragment that just landed
        more = _batches(2 * kw["sync_every"], n)[len(batches) :]  # up to the last fragment's landing
        p1, s1, _ = _run(run, p1, s1, more)
        for i in jd.diloco_fragments(_mlp_params(), kw["num_fragments"])[-1]:
            rows = np.asarray(jax.tree.leaves(p1)[i])  # each within a rounding of the new anchor
            np.testing.assert_allclose(rows, np.broadcast_to(rows[0], rows.shape), rtol=0, atol=1e-6)
            assert not np.allclose(rows[0], np.asarray(jax.tree.leaves(p0)[i])[0])  # it did move


@pytest.mark.parametrize("where", ["comm_mesh", "fused"])
def test_overlapped_step_resumes_bit_exact_mid_flight(tmp_path, where):
    """A checkpoint taken while an exchange is in flight holds its result; the resumed run is the same."""
    n = 2
    mesh, comm_mesh = _meshes(n)
    comm_mesh = comm_mesh if where == "comm_mesh" else None

    def make():
        tx = jd.diloco(optax.adam(1e-2), sync_every=8, num_fragments=2, sync_delay=3, overlap=True)
        return jd.overlapped_step(
            jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True), comm_mesh=comm_mesh
        )

    batches = _batches(20, n)
    run = make()
    params, opt_state = run.init(_mlp_params())
    params, opt_state, _ = _run(
        run, params, opt_state, batches[:2]
    )  # fragment 0 sent after step 0, lands at 3
    assert run._in_flight  # an exchange is in flight
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        mngr.wait_until_finished()
    params, opt_state, losses = _run(run, params, opt_state, batches[2:])
    fresh = make()
    abstract = dict(zip(("params", "opt_state"), fresh.step.abstract_init(_mlp_params())))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(2, args=ocp.args.StandardRestore(abstract))
    params2, opt_state2, losses2 = _run(fresh, restored["params"], restored["opt_state"], batches[2:])
    assert losses2 == losses
    helpers.assert_trees_equal(params2, params)
    helpers.assert_trees_equal(opt_state2, opt_state)


def test_overlap_bytes_and_schedule():
    """The same bytes per period as overlap=False; the runner's launch and landing phases."""
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    kw = dict(sync_every=8, num_fragments=2, sync_delay=2)
    plain = jd.communication_cost(jd.diloco(_inner(), **kw), params, num_workers=4)
    tx = jd.diloco(_inner(), overlap=True, **kw)
    over = jd.communication_cost(tx, params, num_workers=4)
    assert over.sent_bytes == pytest.approx(plain.sent_bytes)
    assert tx.exchange.launch_phase == (1, 5) and tx.exchange.land_phase == (3, 7)
    assert tx.exchange.launches_after(9) == [0] and tx.exchange.lands_at(15) == [1]
    eager = jd.diloco(_inner(), sync_every=8, num_fragments=2, eager=True, overlap=True).exchange
    assert eager.launch_phase == eager.land_phase == (3, 7)
    assert jd.diloco(_inner(), sync_every=4).exchange is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="overlap=True` needs"):
        jd.diloco(_inner(), sync_every=4, overlap=True)
    with pytest.raises(ValueError, match="eager=True` takes `sync_delay=0"):
        jd.diloco(_inner(), sync_every=4, sync_delay=1, eager=True)
    mesh, comm_mesh = _meshes(2)
    plain = jd.data_parallel_step(_loss, jd.diloco(_inner(), sync_every=4), mesh=mesh, per_worker_params=True)
    with pytest.raises(ValueError, match="overlap=True"):
        jd.overlapped_step(plain, comm_mesh=comm_mesh)
    tx = jd.diloco(_inner(), sync_every=4, sync_delay=1, overlap=True)
    chained = jd.data_parallel_step(
        _loss, optax.chain(optax.clip(1.0), tx), mesh=mesh, per_worker_params=True
    )
    with pytest.raises(ValueError, match="diloco="):
        jd.overlapped_step(chained, comm_mesh=comm_mesh)
    jd.overlapped_step(chained, comm_mesh=comm_mesh, diloco=tx)  # found inside the chain
    step = jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True)
    with pytest.raises(ValueError, match="other devices"):
        jd.overlapped_step(step, comm_mesh=mesh)
    with pytest.raises(ValueError, match="axes and shape"):
        jd.overlapped_step(step, comm_mesh=_meshes(4)[1])
    with pytest.raises(TypeError, match="comm_mesh"):
        jd.overlapped_step(step, comm_mesh="cpu:1")
    replicated = jd.data_parallel_step(_loss, optax.adam(1e-2), mesh=mesh)
    with pytest.raises(ValueError, match="per_worker_params=True"):
        jd.overlapped_step(replicated, comm_mesh=comm_mesh, diloco=tx)


@pytest.mark.parametrize("kw", [dict(eager=True), dict(sync_delay=1, overlap=True)])
def test_reshard_is_a_clear_error(kw):
    """Per-worker anchors (eager) and outboxes (overlap) have no regrouping rule: resharding raises."""
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    tx = jd.diloco(_inner(), sync_every=4, **kw)
    state = jd.init_opt_state(tx, params, mesh=_meshes(2)[0], per_worker_params=True)
    with pytest.raises(ValueError, match="DiLoCoState"):
        jd.reshard_opt_state(state, tx, params, num_workers=4, per_worker_params=True)


@pytest.mark.parametrize("reduce_metrics", [True, False])
def test_reduce_metrics_false_sends_nothing_more(reduce_metrics):
    """data_parallel_step(reduce_metrics=False): each worker's own loss, and no all-reduce of it."""
    mesh, _ = _meshes(2)
    step = jd.data_parallel_step(
        _loss, optax.sgd(0.1), mesh=mesh, per_worker_params=True, reduce_metrics=reduce_metrics
    )
    params, opt_state = step.init(_mlp_params())
    batch = _batches(1, 2)[0]
    _, _, metrics = step(params, opt_state, batch)
    fn, shardings = step._compiled(params, opt_state, batch)
    counts = helpers.count_collectives(
        helpers.compiled_text(fn, *jax.device_put((params, opt_state, batch), shardings))
    )
    per_worker = [
        float(_loss(_mlp_params(), (batch[0][2 * i : 2 * i + 2], batch[1][2 * i : 2 * i + 2])))
        for i in range(2)
    ]
    if reduce_metrics:
        assert sum(counts.values()) == 1 and metrics["loss"].shape == ()
        np.testing.assert_allclose(float(metrics["loss"]), np.mean(per_worker), rtol=1e-6)
    else:
        assert sum(counts.values()) == 0 and metrics["loss"].shape == (2,)
        np.testing.assert_allclose(np.asarray(metrics["loss"]), per_worker, rtol=1e-6)


def test_fused_mode_leaves_no_collective_in_the_step():
    """overlapped_step(step) runs its own exchange first, so the step it runs has no collective of its own
    (none inside DiLoCo's switch, where GPU compilers could not overlap the fused exchange with compute)."""
    mesh, _ = _meshes(2)
    tx = jd.diloco(optax.adam(1e-2), sync_every=8, num_fragments=2, sync_delay=2, overlap=True)
    step = jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True, reduce_metrics=False)
    run = jd.overlapped_step(step)
    params, opt_state = run.init(_mlp_params())
    batch = _batches(1, 2)[0]

    def collectives(s):
        fn, shardings = s._compiled(params, opt_state, batch)
        text = helpers.compiled_text(fn, *jax.device_put((params, opt_state, batch), shardings))
        return sum(helpers.count_collectives(text).values())

    assert collectives(step) > 0  # the applying steps' own exchange, inside the switch
    assert collectives(run.step) == 0 and run.trusting
    assert not jd.overlapped_step(step, comm_mesh=_meshes(2)[1]).trusting
