"""Distributed Muon: ``optax.contrib.muon`` on the mean gradient, the momentum split over workers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import comm, orthonormal
from tests import helpers

P = jax.sharding.PartitionSpec

# Three (4, 6) matrices (3 is not a multiple of 2: the stack is padded), one (6, 3), and Adam leaves.
SHAPES = {"a": (4, 6), "b": (4, 6), "c": (4, 6), "d": (6, 3), "bias": (5,), "scale": ()}
STEPS = 2
MAIN = dict(weight_decay=0.1, adam_weight_decay=0.01)


def _params(shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def _grads(n, shapes=SHAPES, seed=1):
    """Per-worker gradients ``(STEPS, n, ...)`` whose mean over the workers is the same for every ``n``."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, s in shapes.items():
        mean = rng.standard_normal((STEPS, 1, *s))
        noise = np.random.default_rng(seed + n).standard_normal((STEPS, n, *s))
        out[k] = (mean + noise - noise.mean(axis=1, keepdims=True)).astype(np.float32)
    return out


def _scan(tx, mean_grads, params):
    """``tx`` for ``STEPS`` steps on one device, outside any mapped axis; returns (updates, params)."""

    def steps(grads_seq, p):
        def body(carry, g):
            state, p = carry
            u, state = tx.update(g, state, p)
            return (state, optax.apply_updates(p, u)), u

        (_, p), updates = jax.lax.scan(body, (tx.init(p), p), grads_seq)
        return updates, p

    return jax.jit(steps)(mean_grads, params)


_REFERENCES: dict = {}


def _reference(key, make_tx, shapes=SHAPES):
    """``optax.contrib.muon`` (``make_tx()``) on the mean gradient of :func:`_grads`, computed once per key."""
    if key not in _REFERENCES:
        mean = jax.tree.map(lambda x: x.mean(axis=1), _grads(1, shapes))
        _REFERENCES[key] = _scan(make_tx(), mean, _params(shapes))
    return _REFERENCES[key]


def run_sharded_model(tx, grads, params, specs):
    """``tx`` in :func:`jaxopt_dist.data_parallel_step` on a ``(n, 2)`` ``("data", "fsdp")`` mesh, the
    parameters sharded over ``"fsdp"`` as ``specs`` say; worker ``i``'s gradient at step ``t`` is
    ``grads[k][t, i]`` (the loss is linear in the parameters). Returns (final params, state)."""
    n = int(jax.tree.leaves(grads)[0].shape[1])
    if jax.device_count() < 2 * n:
        pytest.skip(f"needs {2 * n} devices")
    mesh = jax.make_mesh((n, 2), ("data", "fsdp"), devices=jax.devices()[: 2 * n])
    loss = lambda p, b: sum(jnp.sum(p[k] * b[k][0]) for k in p)  # noqa: E731
    step = jd.data_parallel_step(loss, tx, mesh=mesh, param_specs=specs)
    p, s = step.init(params)
    for t in range(STEPS):
        p, s, _ = step(p, s, {k: g[t] for k, g in grads.items()})
    return jax.device_get(p), s


SPECS = {
    "a": P(None, "fsdp"),
    "b": P("fsdp", None),
    "c": P(),
    "d": P("fsdp", None),
    "bias": P(),
    "scale": P(),
}


def test_equals_optax_muon_on_mean_gradient():
    """Three workers under shard_map (data_parallel_step), the matrices of one group sharded over a
    model axis ("fsdp") in different ways: optax.contrib.muon's numbers on the mean gradient. One
    worker is test_local_axis_none_is_optax_muon_without_collectives (and W=1 with a bound axis,
    the same shared code, test_dion2's); vmap with two, test_options_pass_through."""
    n = 3
    final, state = run_sharded_model(jd.muon(0.02, num_workers=n, **MAIN), _grads(n), _params(), SPECS)
    _, ref_final = _reference("main", lambda: optax.contrib.muon(0.02, **MAIN))
    helpers.assert_trees_close(final, ref_final, rtol=1e-5, atol=1e-6)
    # Each worker keeps the momentum of count // n matrices per group, no more: the (4, 6)
    # group fills one slot each; the lone (6, 3) matrix is the remainder, replicated. Groups with
    # no matrix in a field are left out of it (no zero-size arrays: orbax cannot save them).
    assert [x.shape for x in state[0].mu] == [(n, 1, 4, 6)]
    assert [x.shape for x in state[0].mu_rest] == [(1, 6, 3)]  # placed replicated (P())


def collective_names(tx, params, n=2):
    """The collectives of one update traced under shard_map (``params`` passed to the update)."""
    return sorted(name for name, _ in helpers.traced_collectives(tx, params, n, with_params=True))


def test_local_axis_none_is_optax_muon_without_collectives():
    """axis_name=None: one worker's optax.contrib.muon, outside any mapped axis, communicating nothing."""
    mean = jax.tree.map(lambda x: x.mean(axis=1), _grads(1))
    tx = jd.muon(0.02, axis_name=None, num_workers=1, **MAIN)
    updates, final = _scan(tx, mean, _params())
    ref_updates, ref_final = _reference("main", lambda: optax.contrib.muon(0.02, **MAIN))
    helpers.assert_trees_close(updates, ref_updates, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final, ref_final, rtol=1e-5, atol=1e-6)
    assert collective_names(jd.muon(0.02, axis_name=None, adaptive=True), _params()) == []
    assert collective_names(jd.muon(0.02, num_workers=2, adaptive=True), _params()) in (
        ["all_gather_invariant", "reduce_scatter"],
        ["all_gather", "reduce_scatter"],
    )


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["a"]) + p["bias"][None] - b["y"]) ** 2)


def _batch(rows=8):
    rng = np.random.default_rng(3)
    return {
        "x": rng.standard_normal((rows, 4)).astype(np.float32),
        "y": rng.standard_normal((rows, 3)).astype(np.float32),
    }


def check_local_inner_in_diloco(inner, aggregate=None):
    """``diloco(inner)`` on a 2-worker mesh with per-worker parameters: the inner steps differ per
    worker, the synchronisation (after step 2) brings every worker to the replicated anchor."""
    params = _params({"a": (4, 3), "bias": (3,)})
    mesh = helpers.make_mesh(2)
    tx = jd.diloco(inner, sync_every=2, aggregate=aggregate)
    step = jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True)
    p, s = step.init(params)
    p, s, _ = step(p, s, _batch())
    a = np.asarray(p["a"])
    assert not np.allclose(a[0], a[1])  # local steps on different shards
    p, s, m = step(p, s, _batch())
    assert np.isfinite(float(m["loss"]))
    placement = jd.opt_state_placement(tx, params, mesh=mesh, per_worker_params=True).per_worker
    assert not any(jax.tree.leaves(placement.anchor))
    for k, x in p.items():
        x = np.asarray(x)
        assert np.all(np.isfinite(x))
        np.testing.assert_allclose(x[0], x[1], rtol=1e-6, atol=1e-7)  # synchronised (x + (a - x) rounds)
        helpers.assert_replicated_shards(s.anchor[k])
        np.testing.assert_allclose(x[0], np.asarray(s.anchor[k]), rtol=1e-6, atol=1e-6)


def test_local_muon_as_diloco_inner_optimizer():
    check_local_inner_in_diloco(jd.muon(0.02, ns_steps=2, axis_name=None))  # a smaller program


def test_per_worker_params_with_a_bound_axis_are_rejected():
    mesh = helpers.make_mesh(2)
    step = jd.data_parallel_step(_loss, jd.muon(0.02, num_workers=2), mesh=mesh, per_worker_params=True)
    with pytest.raises(ValueError, match="per-worker parameters.*axis_name=None for a local Muon"):
        p, s = step.init(_params())
        step(p, s, _batch())


# Every option at once, checked against optax.contrib.muon in one run (the preconditionings other
# than frobenius and aol are checked on newton_schulz itself: test_newton_schulz_matches_optax).
# A 3-D leaf with a batch axis is several matrices (stacked with 2-D ones of their shape).
SHAPES_DIMS = {"heads": (3, 4, 6), "w": (4, 6), "conv": (2, 3, 5), "bias": (5,)}
OPTIONS = dict(
    muon_weight_dimension_numbers={
        "heads": optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2),
        "w": optax.contrib.MuonDimensionNumbers(),
        "conv": optax.contrib.MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2),
        "bias": None,
    },
    ns_coeffs=orthonormal.DION_NS_COEFFS[:3],  # a table, one row per step
    ns_steps=3,
    beta=0.9,
    eps=1e-6,
    nesterov=False,
    adaptive=True,
    preconditioning="aol",
    consistent_rms=0.2,
    weight_decay=0.1,
    weight_decay_mask={"heads": True, "w": False, "conv": True, "bias": False},
    adam_learning_rate=0.005,
    adam_b1=0.8,
    adam_b2=0.99,
    adam_eps_root=1e-8,
)


def test_options_pass_through():
    lr = optax.linear_schedule(0.05, 0.01, 2)
    n = 2
    tx = jd.muon(lr, num_workers=n, **OPTIONS)
    updates, _, state = helpers.run_steps(tx, _grads(n, SHAPES_DIMS), _params(SHAPES_DIMS), backend="vmap")
    ref, _ = _reference("options", lambda: optax.contrib.muon(lr, **OPTIONS), SHAPES_DIMS)
    helpers.assert_trees_close(updates, ref, rtol=1e-5, atol=5e-6)
    # conv (6, 5): 1 matrix -> the remainder; (4, 6): 3 heads + w = 4 matrices -> 2 per worker.
    assert [x.shape for x in state[0].mu] == [(n, 2, 4, 6)]
    assert [x.shape for x in state[0].mu_rest] == [(n, 1, 6, 5)]  # stacked by vmap


def test_one_reduce_scatter_and_one_all_gather_per_step():
    n = 3
    params = _params()
    f, g = helpers.update_program(jd.muon(0.02, num_workers=n, adaptive=True), params, n, with_params=True)
    compiled = helpers.count_collectives(helpers.compiled_text(f, g, params))
    assert compiled == {"reduce-scatter": 1, "all-gather": 1}


def test_bytes_of_one_all_reduce():
    """The reduce-scatter carries every worker's stacks and the dense leaves, no padding (the
    count % n remainder matrices travel with the dense leaves); the all-gather the same count of
    elements (the orthogonalised shares and the dense chunk): one all-reduce of the gradient."""
    n = 2
    params = _params()
    rows = {}
    real = comm.reduce_scatter

    def spy(x, axis_name, *, caller=None):
        rows["reduce_scatter"] = x.shape
        return real(x, axis_name, caller=caller)

    tx = jd.muon(0.02, num_workers=n)
    grads = jax.tree.map(lambda x: jnp.ones((n, *x.shape)), params)
    try:
        comm.reduce_scatter = spy
        step = jax.vmap(lambda g, p: tx.update(g, tx.init(p), p)[0], in_axes=(0, None), axis_name="data")
        jax.eval_shape(step, grads, params)
    finally:
        comm.reduce_scatter = real
    # 2 of the 3 (4, 6) matrices owned, 1 + the (6, 3) one + 5 + 1 dense entries in the dense chunk.
    size = 3 * (4 * 6) + 6 * 3 + 6
    assert rows["reduce_scatter"] == (n, size // n)
    # Priced from the traced update, with counts (3 and 1) that are not multiples of n: exactly the
    # bytes of one all-reduce of the gradient (96 entries, which n divides: no chunk padding).
    for n in (2, 3, 8):
        cost = jd.communication_cost(jd.muon(0.02, num_workers=n), params, num_workers=n)
        dense = jd.communication_cost(jd.all_reduce(), params, num_workers=n)
        assert cost.sent_bytes == dense.sent_bytes == 2 * (n - 1) * (size // n) * 4


def test_contract_bf16_one_compilation_extra_args_mu_dtype():
    params = {k: v.astype(jnp.bfloat16) for k, v in _params({"a": (4, 6), "bias": (5,)}).items()}
    helpers.check_bf16_contract(jd.muon(0.02, num_workers=2), params, steps=2, workers=2, replicated=True)
    # mu_dtype reaches Muon's momentum and Adam's, and stays through a step (traced, not compiled).
    tx = jd.muon(0.02, num_workers=2, mu_dtype=jnp.float32)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), params)
    step = jax.vmap(lambda g: tx.update(g, tx.init(g), g)[1], axis_name="data")
    for state in (jax.eval_shape(tx.init, params), jax.eval_shape(step, stacked)):
        adam = state[1].inner_states["adam"].inner_state[0]
        assert {x.dtype for x in (*state[0].mu, *jax.tree.leaves(adam.mu))} == {jnp.dtype(jnp.float32)}


def test_newton_schulz_matches_optax():
    from optax.contrib import _muon

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 4)), jnp.float32)
    dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    cases = [("standard", "spectral"), ("dion", "schatten")]  # frobenius and aol: in the full runs

    def both(x):  # every case in one compilation
        out = []
        for preset, pre in cases:
            coeffs = orthonormal.resolve_ns_coeffs(preset, 5, caller="t")
            table = jnp.asarray(orthonormal.NS_COEFFS_PRESETS[preset])
            table = table if table.ndim == 2 else jnp.tile(table[None], (5, 1))
            want = _muon.orthogonalize_via_newton_schulz(x, table, 5, pre, 1e-8, dims)
            out.append((orthonormal.newton_schulz(x, coeffs, preconditioning=pre), want))
        return out

    for (got, want), case in zip(jax.jit(both)(x), cases):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(case))
    coeffs = orthonormal.resolve_ns_coeffs("standard", 5, caller="t")
    assert jnp.all(orthonormal.newton_schulz(jnp.zeros((1, 3, 3)), coeffs) == 0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="needs `num_workers`"):
        jd.muon(0.02)
    with pytest.raises(ValueError, match="axis_name=None runs on one worker"):
        jd.muon(0.02, axis_name=None, num_workers=2)
    with pytest.raises(ValueError, match="axis_name=None runs on one worker"):
        jd.scale_by_muon(axis_name=None, num_workers=4)
    with pytest.raises(ValueError, match="unknown `ns_coeffs` preset"):
        jd.muon(0.02, "polar", num_workers=2)
    with pytest.raises(ValueError, match="more than `ns_steps`"):
        jd.muon(0.02, "dion", ns_steps=3, num_workers=2)
    with pytest.raises(ValueError, match="shape"):
        jd.muon(0.02, (1.0, 2.0), num_workers=2)
    with pytest.raises(ValueError, match="preconditioning"):
        jd.muon(0.02, num_workers=2, preconditioning="newton")
    with pytest.raises(ValueError, match="beta"):
        jd.muon(0.02, beta=1.0, num_workers=2)
    with pytest.raises(ValueError, match="learning_rate"):
        jd.muon(-1.0, num_workers=2)
    with pytest.raises(TypeError, match="num_workers"):
        jd.muon(0.02, num_workers=2.0)
    with pytest.raises(TypeError, match="axis_name"):
        jd.muon(0.02, num_workers=2, axis_name=["data"])
    params = _params()
    tx = jd.muon(0.02, num_workers=3)
    grads = jax.tree.map(lambda x: jnp.ones((2, *x.shape)), params)
    with pytest.raises(ValueError, match="built with num_workers=3 but runs on 2.*afresh"):
        jax.vmap(lambda g, p: tx.update(g, tx.init(p), p), in_axes=(0, None), axis_name="data")(grads, params)
    with pytest.raises(comm.UnboundAxisError):
        tx.update(params, tx.init(params), params)
    bad = jd.muon(
        0.02,
        num_workers=1,
        muon_weight_dimension_numbers={k: optax.contrib.MuonDimensionNumbers(0, 0) for k in ("a",)},
    )
    with pytest.raises(ValueError, match="disjoint"):
        bad.init({"a": jnp.zeros((3, 3))})


def test_already_reduced_updates_stand_for_their_sum():
    """Under shard_map(check_vma=True), an update typed invariant is the sum over the workers."""
    n = 2
    params = _params({"w": (4, 6), "bias": (3,)})
    grads = jax.tree.map(
        jnp.asarray, helpers.random_tree(np.random.default_rng(5), {"w": (n, 4, 6), "bias": (n, 3)})
    )
    tx = jd.muon(0.02, num_workers=n)

    def both(g, p):
        return tx.update(g, tx.init(p), p)[0], tx.update(jax.lax.psum(g, "data"), tx.init(p), p)[0]

    a, b = helpers.run_on_workers(both, grads, backend="shard_map", shared=(params,))
    helpers.assert_trees_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_cannot_be_regrouped_for_another_worker_count():
    params = _params()
    tx = jd.muon(0.02, num_workers=2)
    inner, tail = tx.init(params)
    state = (inner._replace(mu=tuple(jnp.stack([x, x]) for x in inner.mu)), tail)  # stacked per worker
    with pytest.raises(ValueError, match=r"ScaleByMuonState\.mu") as err:
        jd.reshard_opt_state(state, tx, params, num_workers=3)
    assert jd.ScaleByMuonState.RESHARD_NOTE in str(err.value)  # why, and what to do instead
    assert "num_workers" in jd.ScaleByMuonState.RESHARD_NOTE


def test_inject_hyperparams_with_static_shape_args():
    params = {"w": jnp.ones((4, 6)), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x]) * jnp.arange(x.size).reshape(1, *x.shape), params)
    make = optax.inject_hyperparams(jd.muon, static_args=("num_workers", "beta", "ns_steps"))
    tx = make(learning_rate=0.1, num_workers=2)
    want = jd.muon(0.1, num_workers=2)
    run = lambda t, g: jax.vmap(lambda g: t.update(g, t.init(params), params)[0], axis_name="data")(g)  # noqa: E731
    got, expected = jax.jit(lambda g: (run(tx, g), run(want, g)))(grads)
    helpers.assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)  # eps as an array rounds apart
