"""gossip against NumPy mixing with explicit matrices; topologies, consensus, typing."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import GossipState, gossip, mixing_matrix, spectral_gap
from tests import helpers

SHAPES = {"w": (3, 2), "b": (4,), "s": ()}
WORKERS = (1, 2, 3, 8)
# An explicit topology for 8 workers: a ring shift plus a butterfly exchange.
EXPLICIT_8 = [[(i, (i + 1) % 8) for i in range(8)], [(i, i ^ 4) for i in range(8)]]


# ----------------------------------------------------------------------------
# Hand-built mixing matrices (independent of the module's construction).


def np_graph_matrix(neighbours, weights="uniform"):
    """W from a list of neighbour sets (undirected graph)."""
    n = len(neighbours)
    deg = [len(s) for s in neighbours]
    w = np.zeros((n, n))
    for i in range(n):
        for j in neighbours[i]:
            w[i, j] = 1.0 / (deg[i] + 1) if weights == "uniform" else 1.0 / (1 + max(deg[i], deg[j]))
        w[i, i] = 1.0 - w[i].sum()
    return w


def np_ring(n):
    return np_graph_matrix([{(i - 1) % n, (i + 1) % n} - {i} for i in range(n)])


def np_torus(rows, cols):
    nb = []
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        s = {
            ((r - 1) % rows) * cols + c,
            ((r + 1) % rows) * cols + c,
            r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols,
        }
        nb.append(s - {i})
    return np_graph_matrix(nb)


def np_exponential(n, t):
    if n == 1:
        return np.eye(1)
    tau = int(np.ceil(np.log2(n)))
    w = 0.5 * np.eye(n)
    for i in range(n):
        w[i, (i - 2 ** (t % tau)) % n] += 0.5
    return w


def np_permutations(perms, n):
    w = np.eye(n)
    for perm in perms:
        for s, d in perm:
            w[d, s] += 1.0
    return w / (len(perms) + 1)


def np_matrix(topology, n, t):
    if topology == "ring":
        return np_ring(n)
    if topology == "torus":
        rows = max(d for d in range(1, int(np.sqrt(n)) + 1) if n % d == 0)
        return np_torus(rows, n // rows)
    if topology == "exponential":
        return np_exponential(n, t)
    if topology == "complete":
        return np.full((n, n), 1.0 / n)
    return np_permutations(topology, n)


def np_gossip(grads_seq, params0, lr, topology, *, gamma=1.0, weights=None):
    """Local SGD step then x <- W x, looping over workers; returns params after each step."""
    T, n = grads_seq["w"].shape[:2]
    x = {k: np.repeat(params0[k][None].astype(np.float64), n, axis=0) for k in grads_seq}
    history = []
    for t in range(T):
        w = np_matrix(topology, n, t) if weights is None else weights
        w = (1 - gamma) * np.eye(n) + gamma * w
        new = {}
        for k in x:
            local = [x[k][j] - lr * grads_seq[k][t, j] for j in range(n)]
            new[k] = np.stack([sum(w[i, j] * local[j] for j in range(n)) for i in range(n)])
        x = new
        history.append(x)
    return history


def np_consensus(x):
    n = x["w"].shape[0]
    total = 0.0
    for v in x.values():
        mean = v.mean(axis=0)
        total += sum(np.sum((v[i] - mean) ** 2) for i in range(n))
    return total / n


def _scan_run(tx, pick=lambda s: s[1]):
    """Per-worker fn: T steps in a ``lax.scan`` on per-worker params.

    Returns the params and ``pick(state)`` (by default the gossip state of a
    two-element chain, which is replicated).
    """

    def fn(g_seq, p):
        def step(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, s), _ = jax.lax.scan(step, (p, tx.init(p)), g_seq)
        return p, pick(s)

    return fn


def _run(tx, grads_seq, params0, backend, **kwargs):
    """Runs ``tx`` over steps; grads ``(T, n, ...)``, every worker starting at ``params0``."""
    n = grads_seq["w"].shape[1]
    g = {k: np.swapaxes(v, 0, 1) for k, v in grads_seq.items()}
    p = {k: np.repeat(v[None], n, axis=0) for k, v in params0.items()}
    return helpers.run_on_workers(_scan_run(tx, **kwargs), g, p, backend=backend, replicated=(False, True))


def _data(T, n, seed=0):
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return grads, params0


# ----------------------------------------------------------------------------
# Mixing matrices.


def test_ring_spectral_gap_at_8_workers():
    w = mixing_matrix("ring", 8)
    np.testing.assert_allclose(w, np_ring(8), atol=1e-12)
    np.testing.assert_allclose(np.diag(w), 1 / 3)
    assert abs(spectral_gap(w) - 0.195) < 1e-3
    assert spectral_gap(mixing_matrix("complete", 8)) == pytest.approx(1.0)


@pytest.mark.parametrize("n", (1, 2, 3, 5, 8, 12))
def test_matrices_match_hand_built_and_are_doubly_stochastic(n):
    for topology in ("ring", "torus", "complete"):
        for weights in ("uniform", "metropolis"):
            w = mixing_matrix(topology, n, weights=weights)
            np.testing.assert_allclose(w, np_matrix(topology, n, 0), atol=1e-12, err_msg=topology)
            np.testing.assert_allclose(w, w.T, atol=1e-12)
    for t in range(4):
        w = mixing_matrix("exponential", n, step=t)
        np.testing.assert_allclose(w, np_exponential(n, t), atol=1e-12)
        np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    np.testing.assert_allclose(mixing_matrix("torus", n, shape=(1, n)), np_ring(n), atol=1e-12)


def test_mixing_matrix_without_num_workers_is_deprecated():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = mixing_matrix("torus", num_workers=8)
    with pytest.warns(
        DeprecationWarning, match=r"without num_workers` is deprecated.*num_workers=n.*default of 8"
    ) as record:
        old = mixing_matrix("torus")
    assert record[0].filename == __file__  # the warning points at the caller
    np.testing.assert_array_equal(old, new)
    np.testing.assert_array_equal(new, mixing_matrix("torus", 8))


def test_torus_and_metropolis_on_irregular_graph():
    np.testing.assert_allclose(mixing_matrix("torus", 8, shape=(2, 4)), np_torus(2, 4), atol=1e-12)
    assert np.allclose(np.diag(mixing_matrix("torus", 16)), 1 / 5)  # 4x4: four neighbours
    # A path 0-1-2 and an isolated 3, given as two swaps: degrees 1, 2, 1, 0.
    perms = [[(0, 1), (1, 0), (2, 2), (3, 3)], [(0, 0), (1, 2), (2, 1), (3, 3)]]
    expected = np.array([[2, 1, 0, 0], [1, 1, 1, 0], [0, 1, 2, 0], [0, 0, 0, 3]]) / 3
    np.testing.assert_allclose(mixing_matrix(perms, 4, weights="metropolis"), expected, atol=1e-12)
    np.testing.assert_allclose(mixing_matrix(perms, 4), np_permutations(perms, 4), atol=1e-12)


@pytest.mark.parametrize("n", (2, 4, 8))
def test_exponential_reaches_exact_average_in_log2_n_rounds(n):
    tau = int(np.log2(n))
    product = np.eye(n)
    for t in range(tau):
        product = mixing_matrix("exponential", n, step=t) @ product
    np.testing.assert_allclose(product, np.full((n, n), 1.0 / n), atol=1e-12)
    if tau > 1:
        partial = np.eye(n)
        for t in range(tau - 1):
            partial = mixing_matrix("exponential", n, step=t) @ partial
        assert not np.allclose(partial, 1.0 / n)
    # The transform: parameters only, no gradient step.
    rng = np.random.default_rng(n)
    x0 = rng.standard_normal((n, 5)).astype(np.float32)
    tx = optax.chain(optax.set_to_zero(), gossip("exponential"))
    g = np.zeros((n, tau, 5), np.float32)
    fn = _scan_run(tx)
    for backend in helpers.BACKENDS:
        p, _ = helpers.run_on_workers(fn, g, x0, backend=backend, replicated=(False, True))
        np.testing.assert_allclose(p, np.broadcast_to(x0.mean(0), (n, 5)), rtol=1e-6, atol=1e-6)
    if tau > 1:
        p, _ = helpers.run_on_workers(fn, g[:, : tau - 1], x0, backend="vmap", replicated=(False, True))
        assert np.max(np.abs(np.asarray(p) - x0.mean(0))) > 1e-2


# ----------------------------------------------------------------------------
# The transform against the reference.

TOPOLOGIES = ("ring", "torus", "exponential", "complete")


@pytest.mark.parametrize("n", WORKERS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_matches_reference_vmap(topology, n):
    T, lr = 4, 0.1
    grads, params0 = _data(T, n, seed=n)
    tx = optax.chain(jd.sgd(lr), gossip(topology, track_consensus=True))
    p, state = _run(tx, grads, params0, "vmap")
    ref = np_gossip(grads, params0, lr, topology)
    helpers.assert_trees_close(p, ref[-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.consensus_distance, np_consensus(ref[-1]), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("topology", (*TOPOLOGIES, "explicit"))
def test_matches_reference_shard_map_8(topology):
    topology = EXPLICIT_8 if topology == "explicit" else topology
    T, lr = 4, 0.1
    grads, params0 = _data(T, 8, seed=1)
    tx = optax.chain(jd.sgd(lr), gossip(topology, track_consensus=True))
    p, state = _run(tx, grads, params0, "shard_map")
    ref = np_gossip(grads, params0, lr, topology)
    helpers.assert_trees_close(p, ref[-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.consensus_distance, np_consensus(ref[-1]), rtol=1e-4, atol=1e-6)
    assert int(state.count) == T


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_run_steps_harness_places_state(backend):
    # The library's own placement machinery: count and consensus replicated, params per worker.
    T, n, lr = 3, 3, 0.1
    grads, params0 = _data(T, n, seed=3)
    tx = optax.chain(jd.sgd(lr), gossip("ring", track_consensus=True))
    _, p, state = helpers.run_steps(tx, grads, params0, backend=backend, per_worker_params=True)
    ref = np_gossip(grads, params0, lr, "ring")
    helpers.assert_trees_close(p, ref[-1], rtol=1e-5, atol=1e-5)
    gstate = state[1]
    helpers.assert_replicas_equal(gstate)
    np.testing.assert_allclose(gstate.consensus_distance[0], np_consensus(ref[-1]), rtol=1e-4, atol=1e-6)
    if backend == "shard_map":
        placement = jd.opt_state_placement(tx, params0, mesh=helpers.make_mesh(n), per_worker_params=True)
        assert placement.updates_per_worker
        assert placement.per_worker[1] == GossipState(count=False, consensus_distance=False)


def test_metropolis_explicit_weights_and_gamma_schedule():
    n, T, lr = 8, 3, 0.05
    grads, params0 = _data(T, n, seed=4)
    # Lazy ring weights given as a matrix, and a consensus step size schedule.
    w = 0.5 * np.eye(n) + 0.25 * (np.roll(np.eye(n), 1, axis=1) + np.roll(np.eye(n), -1, axis=1))
    gamma = optax.constant_schedule(0.7)
    tx = optax.chain(jd.sgd(lr), gossip("ring", weights=w, gamma=gamma))
    p, _ = _run(tx, grads, params0, "vmap")
    ref = np_gossip(grads, params0, lr, "ring", gamma=0.7, weights=w)
    helpers.assert_trees_close(p, ref[-1], rtol=1e-5, atol=1e-5)
    # Metropolis weights on an irregular explicit graph (a path plus a fixed point).
    perms = [[(0, 1), (1, 0), (2, 2)], [(0, 0), (1, 2), (2, 1)]]
    g3, p3 = _data(T, 3, seed=5)
    tx = optax.chain(jd.sgd(lr), gossip(perms, weights="metropolis"))
    p, _ = _run(tx, g3, p3, "shard_map")
    ref = np_gossip(g3, p3, lr, perms, weights=mixing_matrix(perms, 3, weights="metropolis"))
    helpers.assert_trees_close(p, ref[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topology", (*TOPOLOGIES, "explicit"))
def test_mixing_preserves_global_mean(topology):
    topology = EXPLICIT_8 if topology == "explicit" else topology
    n = 8
    rng = np.random.default_rng(0)
    p = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    u = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    tx = gossip(topology)

    def fn(u, p):
        out, _ = tx.update(u, tx.init(p), p)
        return optax.apply_updates(p, out)

    new = helpers.run_on_workers(fn, u, p, backend="vmap", replicated=False)
    for k in p:
        before = (p[k].astype(np.float64) + u[k]).mean(axis=0)
        np.testing.assert_allclose(np.asarray(new[k], np.float64).mean(axis=0), before, rtol=0, atol=2e-6)
        assert not np.allclose(new[k], p[k] + u[k], atol=1e-3)  # it did mix


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_one_worker_is_the_local_optimizer(backend):
    T = 3
    grads, params0 = _data(T, 1, seed=6)
    local = optax.chain(jd.sgd(0.1, momentum=0.9))
    p_local, _ = _run(local, grads, params0, backend, pick=lambda s: ())
    for topology in (*TOPOLOGIES, [[(0, 0)]]):
        tx = optax.chain(jd.sgd(0.1, momentum=0.9), gossip(topology, track_consensus=True))
        p, state = _run(tx, grads, params0, backend)
        helpers.assert_trees_equal(p, p_local)
        assert float(state.consensus_distance) == 0.0


def test_data_parallel_step_per_worker_params():
    mesh = helpers.make_mesh(8)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    batch = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)}

    def loss(w, b):
        return jnp.mean((b["x"] @ w - b["y"]) ** 2)

    tx = optax.chain(jd.sgd(0.05), gossip("ring", track_consensus=True))
    with pytest.raises(ValueError, match=r"per_worker_params=True"):
        jd.data_parallel_step(loss, tx, mesh=mesh).init(jnp.zeros(4))
    step = jd.data_parallel_step(loss, tx, mesh=mesh, per_worker_params=True)
    params, state = step.init(jnp.zeros(4))
    losses, distances = [], []
    for _ in range(6):
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics["loss"]))
        distances.append(float(state[1].consensus_distance))
    assert params.shape == (8, 4)
    assert state[1].consensus_distance.shape == ()  # stored once: replicated
    assert losses[-1] < losses[0]
    assert distances[0] > 0  # workers see different shards, so they disagree


@pytest.mark.parametrize(
    "n,kwargs,expected",
    [
        (8, {}, {"collective-permute": 2}),
        (2, {}, {"collective-permute": 1}),  # i - 1 and i + 1 are the same worker
        (8, {"topology": "torus", "shape": (2, 4)}, {"collective-permute": 3}),
        (8, {"topology": "complete"}, {"collective-permute": 7}),
        (8, {"topology": "exponential"}, {"collective-permute": 3}),  # one per round, in a switch
        (8, {"track_consensus": True}, {"collective-permute": 2, "all-reduce": 2}),
    ],
)
def test_collectives_per_step(n, kwargs, expected):
    tx = gossip(**kwargs)
    mesh = helpers.make_mesh(n)
    sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    u = jax.device_put(jnp.ones((n, 6)), sharding)

    def body(u, p):
        out, s = tx.update(u, tx.init(p), p)
        return out, s

    fn = jax.shard_map(
        body, mesh=mesh, in_specs=jax.P("data"), out_specs=(jax.P("data"), jax.P()), check_vma=True
    )
    counts = helpers.count_collectives(helpers.compiled_text(fn, u, u))
    assert counts == expected


# ----------------------------------------------------------------------------
# optax contract and bad inputs.


def test_optax_contract_and_low_precision():
    n = 4
    tx = gossip("exponential", track_consensus=True)
    params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in SHAPES.items()}
    abstract = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    assert abstract.count.dtype == jnp.int32 and abstract.consensus_distance.dtype == jnp.float32
    assert gossip().init(params).consensus_distance == ()
    traces = []

    @jax.jit
    def run(u, p, s):
        traces.append(1)
        return jax.vmap(lambda u, p, s: tx.update(u, s, p, unknown_extra=1.0), axis_name="data")(u, p, s)

    rng = np.random.default_rng(0)
    u = {k: jnp.asarray(rng.standard_normal((n, *s)), jnp.bfloat16) for k, s in SHAPES.items()}
    p = {k: jnp.asarray(rng.standard_normal((n, *s)), jnp.bfloat16) for k, s in SHAPES.items()}
    s = jax.vmap(tx.init)(p)
    out1, s1 = run(u, p, s)
    out2, s2 = run(u, p, s1)
    assert len(traces) == 1
    helpers.assert_dtypes_equal(out1, u)
    helpers.assert_dtypes_equal(s2, s)
    assert [int(c) for c in s2.count] == [2] * n
    # Rounds 0 and 1 of the exponential graph mix with different peers.
    assert not np.allclose(np.asarray(out1["w"], np.float32), np.asarray(out2["w"], np.float32))
    # inject_hyperparams (gamma is a float hyperparameter) and MultiSteps.
    injected = optax.inject_hyperparams(gossip)(gamma=0.5)
    multi = optax.MultiSteps(optax.chain(jd.sgd(1.0), gossip("ring")), every_k_schedule=2)
    p32 = {k: np.asarray(v, np.float32) for k, v in p.items()}
    u32 = {k: np.asarray(v, np.float32) for k, v in u.items()}

    def fn(u, p):
        a, _ = injected.update(u, injected.init(p), p)
        ms = multi.init(p)
        b1, ms = multi.update(u, ms, p)
        b2, ms = multi.update(u, ms, p)
        return a, b1, b2

    a, b1, b2 = helpers.run_on_workers(fn, u32, p32, backend="vmap", replicated=False)
    w = 0.5 * np.eye(n) + 0.5 * np_ring(n)
    for k in SHAPES:
        x = p32[k] + u32[k]
        expected = np.tensordot(w, x, axes=1) - p32[k]
        np.testing.assert_allclose(a[k], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b1[k], 0.0, atol=0)
        expected = np.tensordot(np_ring(n), p32[k] - u32[k], axes=1) - p32[k]
        np.testing.assert_allclose(b2[k], expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"`topology` must be one of"):
        gossip("star")
    with pytest.raises(TypeError, match=r"`topology` must be a name such as 'ring'"):
        gossip(3)
    with pytest.raises(ValueError, match=r"must list every worker once"):
        gossip([[(0, 1), (1, 1)]])
    with pytest.raises(ValueError, match=r"`weights` must be one of"):
        gossip(weights="max_degree")
    with pytest.raises(ValueError, match=r"`weights` must be doubly stochastic"):
        gossip(weights=np.array([[0.5, 0.5], [0.2, 0.8]]))
    with pytest.raises(ValueError, match=r"`weights` must have finite, non-negative entries"):
        gossip(weights=np.array([[1.5, -0.5], [-0.5, 1.5]]))
    with pytest.raises(ValueError, match=r"time-varying 'exponential'"):
        gossip("exponential", weights=np.eye(2))
    with pytest.raises(ValueError, match=r"`shape` only applies to topology='torus'"):
        gossip("ring", shape=(2, 4))
    with pytest.raises(ValueError, match=r"`gamma` must lie in \(0, 1\]"):
        gossip(gamma=0.0)
    with pytest.raises(TypeError, match=r"`track_consensus` must be a bool"):
        gossip(track_consensus=1)
    with pytest.raises(TypeError, match=r"`axis_name` must be a hashable name or a tuple"):
        gossip(axis_name=["data"])
    # Checks that need the number of workers happen at trace time.
    with pytest.raises(ValueError, match=r"torus `shape` \(3, 3\) must multiply to the number of workers, 8"):
        mixing_matrix("torus", 8, shape=(3, 3))
    with pytest.raises(ValueError, match=r"never connects"):
        mixing_matrix("ring", 4, weights=np.full((4, 4), 0.25))
    with pytest.raises(ValueError, match=r"never connects"):
        mixing_matrix([[(0, 1), (1, 2), (2, 0)]], 3, weights="metropolis")  # one-directional
    with pytest.raises(ValueError, match=r"permutations cover 2 workers but the axis has 3"):
        mixing_matrix([[(0, 1), (1, 0)]], 3)
    x = jnp.ones((8, 3))
    with pytest.raises(ValueError, match=r"must multiply to the number of workers"):
        tx = gossip("torus", shape=(3, 3))
        jax.vmap(lambda u: tx.update(u, tx.init(u), u)[0], axis_name="data")(x)
    tx = gossip()
    with pytest.raises(ValueError, match=r"`gossip` needs `params`: call it as"):
        jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="data")(x)
