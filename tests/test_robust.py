"""Robust aggregation against NumPy loops over workers: each rule, the non-finite exclusion, the
trim edge cases, under vmap, pmap and shard_map (check_vma on and off), inside diloco, on sharded
parameters, and a NaN from one worker kept from every parameter."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import robust
from tests import helpers
from tests.test_diloco import INNER_LR, INNER_MOM, SHAPES, np_diloco

P = jax.sharding.PartitionSpec
TREE = {"w": (3, 4), "b": (5,)}


# ----------------------------------------------------------------------------
# NumPy references: a worker is a dict of float64 arrays; loops over workers.


def _finite(worker):
    return all(np.all(np.isfinite(x)) for x in worker.values())


def _kept(workers):
    kept = []
    for w in workers:
        if _finite(w):
            kept.append({k: np.asarray(x, np.float64) for k, x in w.items()})
    return kept


def np_trimmed_mean(workers, trim):
    kept = _kept(workers)
    m = len(kept)
    b = max(0, min(trim, (m - 1) // 2))
    out = {}
    for k, x0 in workers[0].items():
        if not m:
            out[k] = np.zeros(np.shape(x0))
            continue
        values = np.sort(np.stack([w[k] for w in kept]), axis=0)
        total = np.zeros(np.shape(x0))
        for j in range(b, m - b):
            total = total + values[j]
        out[k] = total / (m - 2 * b)
    return out


def np_median(workers):
    kept = _kept(workers)
    return {
        k: np.median(np.stack([w[k] for w in kept]), axis=0) if kept else np.zeros(np.shape(x0))
        for k, x0 in workers[0].items()
    }


def np_centered_clip(workers, center, radius, iterations):
    kept = _kept(workers)
    v = {k: np.asarray(x, np.float64) for k, x in center.items()}
    for _ in range(iterations):
        step = {k: np.zeros_like(x) for k, x in v.items()}
        for w in kept:
            diff = {k: w[k] - v[k] for k in v}
            norm = np.sqrt(sum(np.sum(d**2) for d in diff.values()))
            factor = 1.0 if norm == 0 else min(1.0, radius / norm)
            for k in v:
                step[k] = step[k] + diff[k] * factor
        if kept:
            v = {k: v[k] + step[k] / len(kept) for k in v}
    return v


def np_norm_clipped_mean(workers):
    kept = _kept(workers)
    out = {}
    for k, x0 in workers[0].items():
        if not kept:
            out[k] = np.zeros(np.shape(x0))
            continue
        norms = [np.linalg.norm(w[k]) for w in kept]
        limit = np.median(norms)
        total = np.zeros(np.shape(x0))
        for w, norm in zip(kept, norms):
            total = total + w[k] * (1.0 if norm == 0 else min(1.0, limit / norm))
        out[k] = total / len(kept)
    return out


def _workers(stacked):
    n = helpers.num_workers(stacked)
    return [{k: np.asarray(x[i]) for k, x in stacked.items()} for i in range(n)]


def _stacked(n, seed, *, faults=(), outlier=None, shapes=TREE):
    """Per-worker gradients ``{name: (n, *shape)}``; ``faults``: (worker, leaf, value) entries set to
    NaN or an infinity; ``outlier``: a worker whose update is scaled by -30 (finite, wrong)."""
    rng = np.random.default_rng(seed)
    g = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in shapes.items()}
    if outlier is not None:
        for x in g.values():
            x[outlier] *= -30.0
    for worker, leaf, value in faults:
        g[leaf][(worker,) + (0,) * (g[leaf].ndim - 1)] = value
    return g


def _trim(n):
    return min(2, (n - 1) // 2)


RADIUS, ITERATIONS = 1.5, 2


def _rules(n):
    return {
        "trimmed_mean": jd.trimmed_mean(_trim(n)),
        "coordinate_median": jd.coordinate_median(),
        "centered_clip": jd.centered_clip(RADIUS, ITERATIONS),
        "norm_clipped_mean": jd.norm_clipped_mean(),
    }


NP_RULES = {
    "trimmed_mean": lambda workers, n: np_trimmed_mean(workers, _trim(n)),
    "coordinate_median": lambda workers, n: np_median(workers),
    "centered_clip": lambda workers, n: np_centered_clip(
        workers, {k: np.zeros(np.shape(x)) for k, x in workers[0].items()}, RADIUS, ITERATIONS
    ),
    "norm_clipped_mean": lambda workers, n: np_norm_clipped_mean(workers),
}


def _all_rules(n):
    """One program: every rule on a clean and a faulty input (one compilation per n and backend)."""
    rules = _rules(n)

    def fn(clean, faulty):
        return {
            (name, which): tx.update(g, tx.init(g))[0]
            for name, tx in rules.items()
            for which, g in (("clean", clean), ("faulty", faulty))
        }

    return fn


FAULTS = {  # per n: entries made non-finite (the whole worker is then left out), a finite outlier
    1: ([(0, "w", np.nan)], None),  # no finite worker: m = 0
    2: ([(1, "b", np.inf)], None),
    3: ([(0, "w", np.nan)], 2),
    8: ([(2, "w", np.nan), (5, "b", -np.inf)], 7),
}


def _inputs(n):
    faults, outlier = FAULTS[n]
    clean = _stacked(n, seed=n, outlier=outlier)
    faulty = _stacked(n, seed=n, faults=faults, outlier=outlier)
    return clean, faulty


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", sorted(FAULTS))
def test_rules_match_numpy_loops_with_and_without_non_finite_workers(backend, n):
    clean, faulty = _inputs(n)
    got = helpers.run_on_workers(_all_rules(n), clean, faulty, backend=backend)  # replicas checked
    for which, g in (("clean", clean), ("faulty", faulty)):
        for name, reference in NP_RULES.items():
            out = got[(name, which)]
            assert all(np.all(np.isfinite(np.asarray(x))) for x in out.values()), (name, which)
            helpers.assert_trees_close(out, reference(_workers(g), n), rtol=1e-5, atol=1e-6)


def test_pmap_and_shard_map_without_check_vma_match_vmap():
    n = 4
    clean = _stacked(n, seed=11, outlier=1)
    faulty = _stacked(n, seed=11, faults=[(3, "b", np.nan)], outlier=1)
    fn = _all_rules(n)
    want = helpers.run_on_workers(fn, clean, faulty, backend="vmap")
    pmapped = jax.pmap(fn, axis_name="data", devices=jax.devices()[:n])(clean, faulty)
    helpers.assert_replicas_equal(pmapped)
    helpers.assert_trees_close(jax.tree.map(lambda x: x[0], pmapped), want, rtol=1e-6, atol=1e-7)
    mesh = helpers.make_mesh(n)

    def body(c, f):
        out = fn(*jax.tree.map(lambda x: x[0], (c, f)))
        return jax.tree.map(lambda x: x[None], out)

    placed = jax.device_put((clean, faulty), jax.sharding.NamedSharding(mesh, P("data")))
    unchecked = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False)
    )(*placed)
    helpers.assert_replicas_equal(unchecked)
    helpers.assert_trees_close(
        jax.tree.map(lambda x: np.asarray(x)[0], unchecked), want, rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_centered_clip_keeps_its_output_as_state_and_follows_a_radius_schedule(backend):
    n, T = 4, 4
    radius = optax.linear_schedule(2.0, 0.5, T)
    rng = np.random.default_rng(5)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in TREE.items()}
    grads["w"][1, 3] *= 50.0  # a far worker at step 1
    grads["b"][2, 0, 1] = np.nan  # a non-finite worker at step 2
    params = {k: np.zeros(s, np.float32) for k, s in TREE.items()}
    tx = jd.centered_clip(radius, iterations=2)
    updates, _, state = helpers.scan_steps(tx, grads, params, backend=backend)
    center = {k: np.zeros(s) for k, s in TREE.items()}
    for t in range(T):
        workers = [{k: grads[k][t, i] for k in TREE} for i in range(n)]
        center = np_centered_clip(workers, center, float(radius(t)), 2)
        helpers.assert_trees_close(jax.tree.map(lambda x: x[t], updates), center, rtol=1e-5, atol=1e-6)
    helpers.assert_replicas_equal(state.center)
    helpers.assert_trees_close(jax.tree.map(lambda x: x[0], state.center), center, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state.count) == T)


def test_the_sorting_network_sorts():
    """By the 0-1 principle (every 0-1 input sorted) up to 12 inputs, and on random inputs up to its limit."""
    rng = np.random.default_rng(0)
    for n in range(1, robust.NETWORK_MAX_WORKERS + 1):
        pairs = robust.sorting_network(n)
        inputs = itertools.product((0, 1), repeat=n) if n <= 12 else rng.standard_normal((50, n))
        for v in inputs:
            v = list(v)
            for i, j in pairs:
                v[i], v[j] = min(v[i], v[j]), max(v[i], v[j])
            assert v == sorted(v), n
    assert len(robust.sorting_network(8)) == 19


def test_beyond_the_network_jnp_sort_gives_the_same():
    n = robust.NETWORK_MAX_WORKERS + 3
    g = _stacked(n, seed=4, faults=[(5, "w", np.nan)], outlier=9)
    got = helpers.run_on_workers(
        lambda g: jd.trimmed_mean(3).update(g, optax.EmptyState())[0], g, backend="vmap"
    )
    helpers.assert_trees_close(got, np_trimmed_mean(_workers(g), 3), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# Edge cases of the trim and of m.


def _vmap_update(tx, g):
    return helpers.run_on_workers(lambda g: tx.update(g, tx.init(g))[0], g, backend="vmap")


def test_trim_edge_cases():
    nan = np.nan
    g = np.array([[1.0, -2.0], [4.0, 0.5], [2.0, 3.0], [nan, 1.0]], np.float32)
    # trim=0 is the mean over the finite workers.
    np.testing.assert_allclose(_vmap_update(jd.trimmed_mean(0), g), g[:3].mean(0), rtol=1e-6)
    # trim = (n - 1) / 2 on an odd n is the median.
    odd = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    helpers.assert_trees_equal(
        _vmap_update(jd.trimmed_mean(2), odd), _vmap_update(jd.coordinate_median(), odd)
    )
    # Exclusions shrink b: 5 workers, trim=2, two non-finite: b = (3 - 1) // 2 = 1, the median of 3.
    odd[1, 0], odd[4, 3] = nan, -np.inf
    np.testing.assert_allclose(_vmap_update(jd.trimmed_mean(2), odd), np.median(odd[[0, 2, 3]], 0), rtol=1e-6)
    # Two finite workers with trim=1: b = 0, their mean.
    odd[0, 6] = np.inf
    np.testing.assert_allclose(_vmap_update(jd.trimmed_mean(2), odd), odd[[2, 3]].mean(0), rtol=1e-6)


def test_no_finite_worker_gives_zeros_and_centered_clip_keeps_its_center():
    g = np.full((3, 4), np.nan, np.float32)
    g[1, 2] = np.inf
    for tx in (jd.trimmed_mean(1), jd.coordinate_median(), jd.norm_clipped_mean()):
        helpers.assert_trees_equal(_vmap_update(tx, g), np.zeros(4, np.float32))
    tx = jd.centered_clip(1.0)
    first = np.array([[0.5, 0, 0, 0], [0.3, 0, 0, 0], [0.1, 0, 0, 0]], np.float32)

    def two_steps(a, b):
        u1, s = tx.update(a, tx.init(a))
        u2, s = tx.update(b, s)
        return u1, u2

    u1, u2 = helpers.run_on_workers(two_steps, first, g, backend="vmap")
    np.testing.assert_allclose(u1, [0.3, 0, 0, 0], rtol=1e-6)
    helpers.assert_trees_equal(u2, u1)


def test_trim_needs_more_than_twice_as_many_workers():
    tx = jd.trimmed_mean(1)
    with pytest.raises(ValueError, match=r"`trim`=1 needs more than 2 \* trim = 2 workers; the axis has 2"):
        _vmap_update(tx, np.ones((2, 3), np.float32))


def test_bad_arguments():
    with pytest.raises(ValueError, match="`trim` must be an int >= 0"):
        jd.trimmed_mean(-1)
    with pytest.raises(TypeError, match="`trim` must be a Python int"):
        jd.trimmed_mean(1.0)
    with pytest.raises(TypeError, match="`trim` must be a Python int"):
        jd.trimmed_mean(True)
    with pytest.raises(ValueError, match=r"`radius` must lie in \(0, inf\)"):
        jd.centered_clip(0.0)
    with pytest.raises(ValueError, match="`radius` must be finite"):
        jd.centered_clip(float("inf"))
    with pytest.raises(TypeError, match="`radius` must be a float or an optax schedule"):
        jd.centered_clip("1")
    with pytest.raises(ValueError, match="`iterations` must be an int >= 1"):
        jd.centered_clip(1.0, iterations=0)
    with pytest.raises(TypeError, match="`axis_name` must be a hashable name or a tuple"):
        jd.coordinate_median(axis_name=["data"])
    with pytest.raises(TypeError, match=r"norm_clipped_mean: the updates must be real.*\['z'\] is complex64"):
        _vmap_update(jd.norm_clipped_mean(), {"z": jnp.ones((2, 3), jnp.complex64)})
    with pytest.raises(TypeError, match="trimmed_mean: the updates must be floating point"):
        _vmap_update(jd.trimmed_mean(0), jnp.ones((2, 3), jnp.int32))
    with pytest.raises(jd.UnboundAxisError, match="`centered_clip` communicates over the axis 'data'"):
        tx = jd.centered_clip(1.0)
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)))


def test_already_summed_updates_are_refused_with_where_to_place_the_rule():
    """Under shard_map(check_vma=True) an invariant update is a sum: the rule cannot see the workers."""
    mesh = helpers.make_mesh(4)
    tx = jd.trimmed_mean(1)

    def body(g):
        summed = jax.lax.psum(g, "data")  # typed invariant, as jax.grad of replicated params
        return tx.update(summed, tx.init(summed))[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=True)
    with pytest.raises(jd.AlreadyReducedError, match="place it before any aggregate or compressor"):
        jax.jit(f)(jax.device_put(jnp.ones((4, 3)), jax.sharding.NamedSharding(mesh, P("data"))))


def test_inject_hyperparams():
    g = np.array([[0.5], [0.5], [10.0]], np.float32)
    cc = optax.inject_hyperparams(jd.centered_clip, static_args=("iterations",))(radius=1.0)
    tm = optax.inject_hyperparams(jd.trimmed_mean, static_args=("trim",))(trim=1)

    def fn(g):
        s = cc.init(g)
        s.hyperparams["radius"] = jnp.asarray(0.1)
        return cc.update(g, cc.init(g))[0], cc.update(g, s)[0], tm.update(g, tm.init(g))[0]

    wide, narrow, trimmed = helpers.run_on_workers(fn, g, backend="vmap")
    np.testing.assert_allclose(wide, [(0.5 + 0.5 + 1.0) / 3], rtol=1e-6)
    np.testing.assert_allclose(narrow, [0.1], rtol=1e-6)
    np.testing.assert_allclose(trimmed, [0.5], rtol=1e-6)


# ----------------------------------------------------------------------------
# A NaN from one worker never reaches a parameter.


def _chain(rule):
    return optax.chain(jd.scale_by_momentum(0.9), rule, jd.sgd(0.05))


CHAINS = {
    "trimmed_mean": lambda: jd.trimmed_mean(1),
    "coordinate_median": jd.coordinate_median,
    "centered_clip": lambda: jd.centered_clip(3.0),
    "norm_clipped_mean": jd.norm_clipped_mean,
}


NAN_CASES = [(name, "vmap") for name in CHAINS] + [
    ("trimmed_mean", "shard_map"),
    ("centered_clip", "shard_map"),
]


@pytest.mark.parametrize("name,backend", NAN_CASES)
def test_a_nan_worker_is_as_if_absent_and_never_reaches_a_parameter(name, backend):
    """Worker 2's gradient holds a NaN at every step (its momentum too): every parameter stays finite,
    and the run equals the run of the other three workers alone."""
    n, T = 4, 5
    rng = np.random.default_rng(7)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in TREE.items()}
    grads["w"][:, 2, 0, 0] = np.nan
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in TREE.items()}
    _, got, _ = helpers.scan_steps(_chain(CHAINS[name]()), grads, params, backend=backend)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(got))
    others = jax.tree.map(lambda x: x[:, [0, 1, 3]], grads)
    _, alone, _ = helpers.scan_steps(_chain(CHAINS[name]()), others, params, backend="vmap")
    helpers.assert_trees_close(got, alone, rtol=1e-5, atol=1e-6)


def test_the_plain_mean_spreads_the_nan():
    """The contrast: all_reduce() stays the plain mean, and one NaN worker makes NaN everywhere."""
    g = np.ones((4, 3), np.float32)
    g[2, 0] = np.nan
    out = _vmap_update(jd.all_reduce(), g)
    assert np.all(np.isnan(np.asarray(out)[0]))


# ----------------------------------------------------------------------------
# Inside diloco: the pseudo-gradients of a fragment's leaves.


def _inner():
    return optax.sgd(INNER_LR, momentum=INNER_MOM)  # np_diloco's inner optimizer


def _data(n, T, seed):
    """Gradients ``{name: (T, n, *shape)}`` and parameters of np_diloco's model."""
    rng = np.random.default_rng(seed)
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    return grads, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _np_rule(name, n):
    """A NumPy aggregate for ``np_diloco``: ``(deltas of the workers, fragment) -> aggregate``."""
    centers = {}

    def aggregate(deltas, f):
        if name != "centered_clip":
            return NP_RULES[name](deltas, n)
        center = centers.get(f, {k: np.zeros(np.shape(x)) for k, x in deltas[0].items()})
        centers[f] = np_centered_clip(deltas, center, RADIUS, ITERATIONS)  # its state, per fragment
        return centers[f]

    return aggregate


DILOCO_CASES = [
    ("vmap", 4, "trimmed_mean"),
    ("vmap", 4, "coordinate_median"),
    ("vmap", 4, "centered_clip"),
    ("vmap", 4, "norm_clipped_mean"),
    ("shard_map", 3, "trimmed_mean"),
    ("shard_map", 4, "centered_clip"),
]


@pytest.mark.parametrize("backend,n,name", DILOCO_CASES)
def test_diloco_with_each_rule_matches_reference(backend, n, name):
    """Worker 1's gradient turns NaN at step 1 (its inner momentum stays NaN), worker 0 sends 30 times
    its own, negated: the anchor and the other workers follow the NumPy loop, the anchor finite."""
    T, H = 6, 3
    grads, params = _data(n, T, seed=20 + n)
    for k in grads:
        grads[k][:, 0] *= -30.0
    grads["b"][1, 1, 0, 0] = np.nan
    tx = jd.diloco(_inner(), sync_every=H, aggregate=_rules(n)[name])
    _, p, state = helpers.run_steps(tx, grads, params, backend=backend, per_worker_params=True)
    want_x, want_anchor = np_diloco(grads, params, H=H, aggregate=_np_rule(name, n))
    helpers.assert_replicas_equal(state.anchor)
    anchor = {k: np.asarray(v)[0] for k, v in state.anchor.items()}
    assert all(np.all(np.isfinite(x)) for x in anchor.values())
    helpers.assert_trees_close(anchor, want_anchor, rtol=1e-5, atol=1e-5)
    for i in [0] + list(range(2, n)):
        helpers.assert_trees_close(
            {k: np.asarray(v)[i] for k, v in p.items()}, want_x[i], rtol=1e-5, atol=1e-5
        )


def test_streaming_diloco_with_a_delay_and_overlap():
    """Two fragments, each with its own centered-clip state, taken one step before they land; the
    overlapped variant (the applying step exchanges what no runner did) gives the same numbers."""
    n, H, F, tau, T = 3, 4, 2, 1, 10
    grads, params = _data(n, T, seed=30)
    grads["a"][:, 2] *= 40.0
    groups = jd.diloco_fragments(params, F)
    runs = {}
    for overlap in (False, True):
        tx = jd.diloco(
            _inner(),
            sync_every=H,
            num_fragments=F,
            sync_delay=tau,
            overlap=overlap,
            aggregate=jd.centered_clip(RADIUS, ITERATIONS),
        )
        runs[overlap] = helpers.run_steps(tx, grads, params, backend="vmap", per_worker_params=True)
    want_x, want_anchor = np_diloco(
        grads, params, H=H, F=F, tau=tau, groups=groups, aggregate=_np_rule("centered_clip", n)
    )
    for _, p, state in runs.values():
        helpers.assert_trees_close(
            {k: np.asarray(v)[0] for k, v in state.anchor.items()}, want_anchor, rtol=1e-5, atol=1e-5
        )
        for i in range(n):
            helpers.assert_trees_close(
                {k: np.asarray(v)[i] for k, v in p.items()}, want_x[i], rtol=1e-5, atol=1e-5
            )
    centers = [s.center for s in runs[False][2].aggregate_states]
    assert [len(c) for c in centers] == [len(g) for g in groups]  # one center per fragment, its leaves


def test_diloco_refuses_a_robust_rule_under_eager():
    with pytest.raises(ValueError, match=r"`eager=True` does not take `aggregate=trimmed_mean\(\.\.\.\)`"):
        jd.diloco(_inner(), sync_every=4, eager=True, aggregate=jd.trimmed_mean(1))
    jd.diloco(_inner(), sync_every=4, sync_delay=1, overlap=True, aggregate=jd.trimmed_mean(1))


def test_communication_cost_counts_the_all_gather():
    params = {k: jnp.zeros(s) for k, s in TREE.items()}
    d = 4 * sum(int(np.prod(s)) for s in TREE.values())
    for n in (3, 8):
        for tx in _rules(n).values():
            cost = jd.communication_cost(tx, params, num_workers=n)
            assert cost.sent_bytes == pytest.approx((n - 1) * d)
            assert {c.kind for c in cost.sites} == {"all_gather"}
    cost = jd.communication_cost(
        jd.diloco(_inner(), sync_every=4, aggregate=jd.coordinate_median()), params, num_workers=8
    )
    assert cost.sent_bytes == pytest.approx(7 * d / 4)


# ----------------------------------------------------------------------------
# With data_parallel_step: sharded parameters, and a state resharded for fewer workers.

MODEL_SPECS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}


def _model():
    rng = np.random.default_rng(3)
    return {
        "w1": (rng.standard_normal((8, 16)) / np.sqrt(8)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.standard_normal((16, 4)) / 4).astype(np.float32),
    }


def _model_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None])
    return jnp.mean(jnp.sum((h @ p["w2"] - batch["y"]) ** 2, axis=-1))


def _batch(t):
    rng = np.random.default_rng(50 + t)
    return {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "y": rng.standard_normal((16, 4)).astype(np.float32),
    }


def _signflip(worker, factor=10.0):
    """Worker ``worker`` sends ``-factor`` times its update (a test's Byzantine worker)."""

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        bad = jax.lax.axis_index("data") == worker
        return jax.tree.map(lambda u: jnp.where(bad, -factor * u, u), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _nan_in_one_shard(worker):
    """Worker ``worker`` sends a NaN at ``w1[0, 15]``, which lives on the second "fsdp" shard only."""

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        bad = jax.lax.axis_index("data") == worker
        w1 = updates["w1"].at[0, 15].set(jnp.where(bad, jnp.nan, updates["w1"][0, 15]))
        return {**updates, "w1": w1}, state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


SHARDED = {
    "trimmed_mean": lambda: jd.trimmed_mean(1),
    "coordinate_median": jd.coordinate_median,
    "centered_clip": lambda: jd.centered_clip(1.0),
    "norm_clipped_mean": jd.norm_clipped_mean,
}


def _train(tx, mesh, specs, steps, start=0, params=None, state=None):
    step = jd.data_parallel_step(_model_loss, tx, mesh=mesh, param_specs=specs)
    if params is None:
        params, state = step.init(_model())
    for t in range(start, start + steps):
        params, state, _ = step(params, state, _batch(t))
    return params, state


@pytest.mark.devices(8)
@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_parameters_match_replicated_with_a_byzantine_worker(name):
    """4 replicas x 2 "fsdp" against 4 replicas, worker 1 sending -10 times its gradient's momentum."""

    def make():
        return optax.chain(jd.scale_by_momentum(0.9), _signflip(1), SHARDED[name](), jd.sgd(0.05))

    sharded = jax.make_mesh((4, 2), ("data", "fsdp"))
    got, state = _train(make(), sharded, MODEL_SPECS, 4)
    want, _ = _train(make(), helpers.make_mesh(4), None, 4)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
        assert tuple(got[k].sharding.spec) == tuple(MODEL_SPECS[k]), (k, got[k].sharding.spec)
    if name == "centered_clip":  # the center is stored sharded like its parameter
        center = state[2].center
        for k, spec in MODEL_SPECS.items():
            assert tuple(center[k].sharding.spec) == tuple(spec), (k, center[k].sharding.spec)


@pytest.mark.devices(8)
@pytest.mark.parametrize("name", ["trimmed_mean", "centered_clip"])
def test_sharded_parameters_leave_out_a_worker_whose_nan_is_on_one_shard(name):
    """Worker 2's NaN lies on one "fsdp" shard of one leaf: every shard of every leaf leaves worker 2
    out (the replicated run's numbers, all finite), not only the shard that holds the NaN."""

    def make():
        return optax.chain(jd.scale_by_momentum(0.9), _nan_in_one_shard(2), SHARDED[name](), jd.sgd(0.05))

    got, _ = _train(make(), jax.make_mesh((4, 2), ("data", "fsdp")), MODEL_SPECS, 3)
    want, _ = _train(make(), helpers.make_mesh(4), None, 3)
    for k in want:
        assert np.all(np.isfinite(np.asarray(got[k]))), k
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def test_centered_clip_state_reshards_to_fewer_workers():
    """The center and the count are replicated: resharding for 2 workers copies them."""
    tx = optax.chain(jd.scale_by_momentum(0.9), jd.centered_clip(1.0), jd.sgd(0.05))
    params, state = _train(tx, helpers.make_mesh(4), None, 3)
    host = jax.device_get(state)
    moved = jd.reshard_opt_state(host, tx, _model(), num_workers=2)
    helpers.assert_trees_equal(moved[1], host[1])
    assert np.asarray(moved[0].momentum["w1"]).shape[0] == 2  # the per-worker momentum is regrouped
    mesh2 = helpers.make_mesh(2)
    placed = jd.place_opt_state(moved, tx, _model(), mesh=mesh2)
    params, state = _train(tx, mesh2, None, 2, start=3, params=jax.device_get(params), state=placed)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((params, state)))
