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
STEPS = 3


def _params(shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


_REFERENCES: dict = {}


def _reference(make_tx, grads_seq, params, key=None):
    """``make_tx()`` (an optax transform) run on one device on the mean gradient; returns (updates, params)."""
    if key is not None and key in _REFERENCES:
        return _REFERENCES[key]
    tx = make_tx()

    def steps(grads_seq, p):
        def body(carry, g):
            state, p = carry
            u, state = tx.update(jax.tree.map(lambda x: jnp.mean(x, axis=0), g), state, p)
            return (state, optax.apply_updates(p, u)), u

        (_, p), updates = jax.lax.scan(body, (tx.init(p), p), grads_seq)
        return updates, p

    out = jax.jit(steps)(grads_seq, params)
    if key is not None:
        _REFERENCES[key] = out
    return out


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_equals_optax_muon_on_mean_gradient(backend, n):
    params = _params()
    grads = helpers.grads_seq(1, STEPS, n, SHAPES)
    kw = dict(weight_decay=0.1, adam_weight_decay=0.01)
    tx = jd.muon(0.02, num_workers=n, **kw)
    updates, final, state = helpers.run_steps(tx, grads, params, backend=backend)
    ref_updates, ref_final = _reference(lambda: optax.contrib.muon(0.02, **kw), grads, params, key=n)
    helpers.assert_trees_close(updates, ref_updates, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final, ref_final, rtol=1e-5, atol=1e-6)
    # Each worker keeps the momentum of ceil(count / n) matrices per group, no more.
    mu = state[0].mu
    assert [x.shape for x in mu] == [(n, -(-3 // n), 4, 6), (n, 1, 6, 3)]


OPTIONS = [
    dict(
        nesterov=False,
        ns_coeffs="dion",
        consistent_rms=0.2,
        learning_rate=optax.linear_schedule(0.05, 0.01, 3),
        weight_decay=0.1,
        weight_decay_mask={"a": True, "b": False, "c": True, "d": False, "bias": False, "scale": False},
    ),
    dict(
        ns_steps=3,
        beta=0.9,
        eps=1e-6,
        adaptive=True,
        preconditioning="aol",
        adam_learning_rate=0.005,
        adam_b1=0.8,
        adam_b2=0.99,
        adam_eps_root=1e-8,
    ),
    dict(preconditioning="schatten", mu_dtype=jnp.bfloat16),
    pytest.param(dict(preconditioning="spectral"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=["plain_dion_rms_schedule_mask", "adaptive_aol_adam", "schatten_bf16", "spectral"]
)
def test_options_pass_through(options):
    n = 3
    params = _params()
    grads = helpers.grads_seq(2, STEPS, n, SHAPES)
    options = dict(options)
    lr = options.pop("learning_rate", 0.02)
    updates, _, _ = helpers.run_steps(jd.muon(lr, num_workers=n, **options), grads, params, backend="vmap")
    ref, _ = _reference(lambda: optax.contrib.muon(lr, **options), grads, params)
    tol = 2e-2 if "mu_dtype" in options else 1e-5
    helpers.assert_trees_close(updates, ref, rtol=tol, atol=5e-6)


def test_dimension_numbers_batch_axes_and_adam_leaves():
    """A 3-D leaf with a batch axis is several matrices (stacked with 2-D ones of their shape)."""
    n = 2
    shapes = {"heads": (3, 4, 6), "w": (4, 6), "conv": (2, 3, 5), "bias": (5,)}
    dims = {
        "heads": optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2),
        "w": optax.contrib.MuonDimensionNumbers(),
        "conv": optax.contrib.MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2),
        "bias": None,
    }
    params = _params(shapes)
    grads = helpers.grads_seq(3, STEPS, n, shapes)
    kw = dict(muon_weight_dimension_numbers=dims, adaptive=True)
    updates, _, state = helpers.run_steps(jd.muon(0.02, num_workers=n, **kw), grads, params, backend="vmap")
    ref, _ = _reference(lambda: optax.contrib.muon(0.02, **kw), grads, params)
    helpers.assert_trees_close(updates, ref, rtol=1e-5, atol=1e-6)
    # conv (6, 5): 1 matrix -> 1 slot; (4, 6): 3 heads + w = 4 matrices -> 2 per worker.
    assert [x.shape for x in state[0].mu] == [(n, 1, 6, 5), (n, 2, 4, 6)]  # conv comes first


def _collectives(tx, params, n):
    mesh = helpers.make_mesh(n)
    g = jax.device_put(
        jax.tree.map(lambda x: jnp.ones((n, *x.shape), x.dtype), params),
        jax.sharding.NamedSharding(mesh, P("data")),
    )

    def body(g, p):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(p), p)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=True)
    names: list[str] = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            names.append(e.primitive.name)
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(f)(g, params).jaxpr)
    traced = [
        x for x in names if x.startswith(("psum", "reduce_scatter", "all_gather", "all_to_all", "ppermute"))
    ]
    return traced, helpers.count_collectives(helpers.compiled_text(f, g, params))


def test_one_reduce_scatter_and_one_all_gather_per_step():
    n = 3
    params = _params()
    traced, compiled = _collectives(jd.muon(0.02, num_workers=n, adaptive=True), params, n)
    assert sorted(traced) == ["all_gather_invariant", "reduce_scatter"] or sorted(traced) == [
        "all_gather",
        "reduce_scatter",
    ]
    assert compiled == {"reduce-scatter": 1, "all-gather": 1}


def test_bytes_of_one_all_reduce():
    """The reduce-scatter carries every worker's padded stacks and the dense leaves; the all-gather
    the same count of elements (the orthogonalised shares and the dense chunk)."""
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
    padded = 4 * (4 * 6) + 2 * (6 * 3) + 6  # 3 matrices padded to 4, 1 padded to 2, 5 + 1 dense entries
    assert rows["reduce_scatter"] == (n, padded // n)


def test_sharded_model_equals_replicated():
    """Parameters sharded over a model axis ("fsdp"): the same numbers as replicated ones."""
    d_in, hidden, d_out, rows = 8, 16, 8, 16
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, d_out)) / np.sqrt(hidden)).astype(np.float32),
        "w3": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
    }
    specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "w3": P()}
    batches = [
        {
            "x": rng.standard_normal((rows, d_in)).astype(np.float32),
            "y": rng.standard_normal((rows, d_out)).astype(np.float32),
        }
        for _ in range(2)
    ]

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None]) + jnp.tanh(b["x"] @ p["w3"])
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    def train(mesh, param_specs):
        tx = jd.muon(0.05, num_workers=2, weight_decay=0.01)
        step = jd.data_parallel_step(loss, tx, mesh=mesh, param_specs=param_specs)
        p, s = step.init(params)
        for b in batches:
            p, s, _ = step(p, s, b)
        return p

    sharded = train(jax.make_mesh((2, 4), ("data", "fsdp")), specs)
    replicated = train(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), None)
    helpers.assert_trees_close(jax.device_get(sharded), jax.device_get(replicated), rtol=1e-5, atol=1e-6)


def test_contract_bf16_one_compilation_extra_args():
    params = {k: v.astype(jnp.bfloat16) for k, v in _params().items()}
    helpers.check_bf16_contract(jd.muon(0.02, num_workers=2), params, steps=2, workers=2, replicated=True)


def test_newton_schulz_matches_optax():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 4)), jnp.float32)
    coeffs = orthonormal.resolve_ns_coeffs("dion", 5, caller="t")
    got = orthonormal.newton_schulz(x, coeffs)
    table = jnp.asarray(orthonormal.DION_NS_COEFFS)
    dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    from optax.contrib import _muon

    want = _muon.orthogonalize_via_newton_schulz(x, table, 5, "frobenius", 1e-8, dims)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert jnp.all(orthonormal.newton_schulz(jnp.zeros((1, 3, 3)), coeffs) == 0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="needs `num_workers`"):
        jd.muon(0.02)
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
    params = _params()
    tx = jd.muon(0.02, num_workers=3)
    grads = jax.tree.map(lambda x: jnp.ones((2, *x.shape)), params)
    with pytest.raises(ValueError, match="built with num_workers=3 but runs on 2"):
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

    def per_worker(g, p):
        return tx.update(g, tx.init(p), p)[0]

    def summed(g, p):
        return tx.update(jax.lax.psum(g, "data"), tx.init(p), p)[0]

    a = helpers.run_on_workers(per_worker, grads, backend="shard_map", shared=(params,))
    b = helpers.run_on_workers(summed, grads, backend="shard_map", shared=(params,))
    helpers.assert_trees_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_cannot_be_regrouped_for_another_worker_count():
    params = _params()
    tx = jd.muon(0.02, num_workers=2)
    inner, tail = tx.init(params)
    state = (inner._replace(mu=tuple(jnp.stack([x, x]) for x in inner.mu)), tail)  # stacked per worker
    with pytest.raises(Exception, match="ScaleByMuonState|mu|rule"):
        jd.reshard_opt_state(state, tx, params, num_workers=3)


def test_inject_hyperparams_with_static_shape_args():
    params = {"w": jnp.ones((4, 6)), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
    make = optax.inject_hyperparams(jd.muon, static_args=("num_workers", "beta", "ns_steps"))
    tx = make(learning_rate=0.1, num_workers=2)
    want = jd.muon(0.1, num_workers=2)
    run = lambda t: jax.vmap(lambda g: t.update(g, t.init(params), params)[0], axis_name="data")(grads)  # noqa: E731
    helpers.assert_trees_close(run(tx), run(want), rtol=1e-5, atol=1e-6)  # eps as an array rounds apart
