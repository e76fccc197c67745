"""Sharded models: ``data_parallel_step(param_specs=...)`` on meshes with model axes.

The data axis is manual inside the step and the model axes are the
compiler's, so each transform computes on whole leaves of its replica: the
same model, data and optimizer on a 2 data x 4 fsdp mesh and on a 2-device
data mesh with replicated parameters give the same parameters to float32
rounding, while every device holds a quarter of the parameters and of the
state that belongs to them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src.training import model_axes
from tests import helpers

P = jax.sharding.PartitionSpec
STEPS = 20
D_IN, HIDDEN, D_OUT, ROWS = 16, 64, 6, 16


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((D_IN, HIDDEN)) * 0.3).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, D_OUT)) * 0.3).astype(np.float32),
        "b2": np.zeros(D_OUT, np.float32),
    }


FSDP = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}
TENSOR = {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None), "b2": P()}


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None])
    return jnp.mean((h @ p["w2"] + p["b2"][None] - b["y"]) ** 2)


def _batches(steps=STEPS):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps, ROWS, D_IN)).astype(np.float32)
    y = rng.standard_normal((steps, ROWS, D_OUT)).astype(np.float32)
    return [{"x": x[t], "y": y[t]} for t in range(steps)]


def _mesh(model_axis: str | None):
    if model_axis is None:
        return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    return jax.make_mesh((2, 4), ("data", model_axis))


# PowerSGD orthogonalizes a near-degenerate gradient each step: last-bit differences of
# the sharded matmuls grow to ~4e-6 of entries ~0.03 after 20 steps (the other
# transforms stay within 2e-6).
ATOL = {"powersgd+sgd": 1e-5}

TXS = {
    "all_reduce+adamw": (lambda: optax.chain(jd.all_reduce(), optax.adamw(1e-2)), False),
    "diloco(adamw)": (lambda: jd.diloco(optax.adamw(1e-2), sync_every=5), True),
    "powersgd+sgd": (lambda: optax.chain(jd.powersgd(rank=2), jd.sgd(0.1, momentum=0.9)), False),
    "top_k+sgd": (lambda: optax.chain(jd.top_k(k=40), jd.sgd(0.1)), False),
    "decoupled_momentum": (lambda: jd.decoupled_momentum(0.01, chunk=8, topk=4), False),
    "low_bit+sgd": (lambda: optax.chain(jd.low_bit(), jd.sgd(0.1)), False),
}


def _train(make_tx, per_worker, mesh, **kw):
    step = jd.data_parallel_step(_loss, make_tx(), mesh=mesh, per_worker_params=per_worker, **kw)
    params, state = step.init(_params())
    for b in _batches():
        params, state, metrics = step(params, state, b)
    return params, state, float(metrics["loss"])


@pytest.mark.parametrize("name", list(TXS))
def test_sharded_model_gives_the_replicated_models_numbers(name):
    make_tx, per_worker = TXS[name]
    rep_p, rep_s, rep_loss = _train(make_tx, per_worker, _mesh(None))
    p, s, loss = _train(make_tx, per_worker, _mesh("fsdp"), param_specs=FSDP, batch_axes="fsdp")
    for k in rep_p:
        assert (
            p[k].sharding.spec
            == jd.data_parallel_step(
                _loss, make_tx(), mesh=_mesh("fsdp"), per_worker_params=per_worker, param_specs=FSDP
            )
            .abstract_init(_params())[0][k]
            .sharding.spec
        )
        np.testing.assert_allclose(
            np.asarray(p[k]), np.asarray(rep_p[k]), rtol=2e-5, atol=ATOL.get(name, 2e-6), err_msg=k
        )
    assert loss == pytest.approx(rep_loss, rel=1e-5)
    # The state that belongs to the parameters is sharded over "fsdp" too: a quarter per device.
    rep_total, total = helpers.device_bytes((rep_p, rep_s)), helpers.device_bytes((p, s))
    assert max(total.values()) < max(rep_total.values()) / 2.5


@pytest.mark.parametrize("per_worker", [False, True])
def test_per_device_bytes_are_a_quarter_of_the_replicated_run(per_worker):
    """Parameters plus state per device: 1/4 of the replicated run within 5% (only counters are whole)."""
    make_tx = TXS["diloco(adamw)" if per_worker else "all_reduce+adamw"][0]
    rep = jd.data_parallel_step(_loss, make_tx(), mesh=_mesh(None), per_worker_params=per_worker)
    fsdp = jd.data_parallel_step(
        _loss, make_tx(), mesh=_mesh("fsdp"), per_worker_params=per_worker, param_specs=FSDP
    )
    rep_bytes = max(helpers.device_bytes(rep.init(_params())).values())
    got = helpers.device_bytes(fsdp.init(_params()))
    # b2 (6 floats and its moments) is replicated on purpose; every other leaf is split in 4.
    assert max(got.values()) == pytest.approx(rep_bytes / 4, rel=0.05)
    assert len(got) == 8


def test_state_leaves_follow_their_parameters():
    tx = optax.chain(jd.top_k(k=40), optax.adam(1e-2))
    step = jd.data_parallel_step(_loss, tx, mesh=_mesh("fsdp"), param_specs=FSDP)
    params, state = step.init(_params())
    ef, (adam, _) = state
    assert ef.residual["w1"].sharding.spec == P("data", None, "fsdp")  # per-worker: stacked, then sharded
    assert ef.residual["b2"].sharding.spec == P("data")
    assert adam.mu["w2"].sharding.spec == P("fsdp", None)  # replicated over "data", sharded like w2
    assert adam.nu["b1"].sharding.spec == P("fsdp")
    assert adam.count.sharding.spec == P()
    assert [sh.data.shape for sh in ef.residual["w1"].addressable_shards] == [(1, D_IN, HIDDEN // 4)] * 8
    want_p, want_s = step.abstract_init(_params())
    for got, want in zip(jax.tree.leaves((params, state)), jax.tree.leaves((want_p, want_s))):
        assert got.sharding.spec == want.sharding.spec and got.shape == want.shape


def test_tensor_parallel_axis_and_replicas_stay_identical():
    make_tx, _ = TXS["powersgd+sgd"]
    rep_p, _, _ = _train(make_tx, False, _mesh(None))
    p, s, _ = _train(
        make_tx, False, _mesh("tensor"), param_specs=TENSOR
    )  # the batch is split over "data" only
    for k in rep_p:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(rep_p[k]), rtol=2e-5, atol=1e-5, err_msg=k)
        # Both replicas (data rows) hold bit-identical shards.
        shards = {}
        for sh in p[k].addressable_shards:
            shards.setdefault(tuple((i.start, i.stop) for i in sh.index), []).append(np.asarray(sh.data))
        for copies in shards.values():
            assert all(c.tobytes() == copies[0].tobytes() for c in copies)


def test_state_model_specs_match_by_path_then_by_unanimous_shape():
    params = {"a": jnp.zeros((8, 4)), "b": jnp.zeros((8, 4)), "c": jnp.zeros((4, 8))}
    specs = {"a": P("m", None), "b": P(None, "m"), "c": P("m", None)}
    state = {"mu": params, "fragment": [jnp.zeros((8, 4)), jnp.zeros((4, 8))], "q": jnp.zeros((3,))}
    got = model_axes.state_specs(state, params, specs)
    assert got["mu"] == specs
    # (8, 4) belongs to two parameters with different specs: left whole; (4, 8) only to "c".
    assert got["fragment"] == [P(), P("m", None)]
    assert got["q"] == P()


class _FlatState(NamedTuple):
    count: jax.Array
    error: tuple[jax.Array, ...]
    other: tuple[jax.Array, ...]

    FLAT_BUFFERS = ("error",)


def test_declared_flat_buffers_are_split_over_the_model_axes_that_divide_them():
    params = {"a": jnp.zeros((8, 4)), "b": jnp.zeros((2,))}
    specs = {"a": P("fsdp", "tensor"), "b": P()}
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    flat = tuple(jnp.zeros((size,)) for size in (48, 12, 6))
    state = (_FlatState(jnp.zeros([], jnp.int32), flat, flat), {"nested": _FlatState(0, flat[:1], ())})
    got, nested = model_axes.state_specs(state, params, specs, mesh=mesh)
    # Over ("fsdp", "tensor") where 8 divides the length, over "fsdp" alone where only 4 does, else whole.
    assert got.error == (P(("fsdp", "tensor")), P(("fsdp",)), P())
    assert got.other == (P(), P(), P()) and got.count == P()  # undeclared: never guessed from a length
    assert nested["nested"].error == (P(("fsdp", "tensor")),)
    # Without the mesh's sizes, nothing is split.
    assert model_axes.state_specs(state, params, specs)[0].error == (P(), P(), P())


class _StackState(NamedTuple):
    stacks: tuple[jax.Array, ...]
    other: tuple[jax.Array, ...]

    MATRIX_STACKS = ("stacks",)


def test_declared_matrix_stacks_are_split_on_rows_else_columns_else_count():
    params = {"a": jnp.zeros((8, 4))}
    specs = {"a": P("fsdp", "tensor")}
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    stacks = tuple(
        jnp.zeros(s) for s in ((3, 16, 6), (3, 6, 16), (3, 4, 6), (8, 3, 5), (3, 3, 5), (1, 6, 12))
    )
    got = model_axes.state_specs(_StackState(stacks, stacks), params, specs, mesh=mesh)
    fs = ("fsdp", "tensor")
    assert got.stacks == (
        P(None, fs, None),  # the rows take both axes (8 divides 16)
        P(None, None, fs),  # rows 6 take "fsdp" neither; the columns take both
        P(None, ("fsdp",), None),  # 4 rows: "fsdp" alone; columns 6 no better
        P(fs, None, None),  # neither side divides: the count
        P(),  # nothing divides: whole
        P(None, None, ("fsdp",)),  # 6 rows: none; 12 columns: "fsdp" (8 does not divide 12)
    )
    assert got.other == (P(),) * 6  # undeclared: never guessed from a shape


def test_place_opt_state_round_trip_with_param_specs():
    tx = optax.chain(jd.top_k(k=40), optax.adam(1e-2))
    mesh = _mesh("fsdp")
    state = jd.init_opt_state(tx, _params(), mesh=mesh, param_specs=FSDP)
    placed = jd.place_opt_state(jax.device_get(state), tx, _params(), mesh=mesh, param_specs=FSDP)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(placed)):
        assert a.sharding.spec == b.sharding.spec
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params = jd.place_params(_params(), mesh=mesh, param_specs=FSDP, per_worker_params=True)
    assert params["w2"].sharding.spec == P("data", "fsdp", None) and params["w2"].shape == (2, HIDDEN, D_OUT)


def test_vmap_over_the_data_axis_on_sharded_leaves():
    """A transform under ``vmap(axis_name)`` on stacked leaves sharded over a model axis."""
    tx = optax.chain(jd.powersgd(rank=2), jd.sgd(0.1))
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    grads = jax.tree.map(
        lambda x: np.random.default_rng(2).standard_normal((2, *x.shape)).astype(np.float32), _params()
    )
    state = jax.vmap(tx.init)(jax.tree.map(lambda g: np.zeros_like(g), grads))

    def run(g, s):
        return jax.vmap(tx.update, axis_name="data")(g, s)

    want, _ = jax.jit(run)(grads, state)
    specs = jax.tree.map(lambda sp: jax.sharding.NamedSharding(mesh, P(None, *sp)), FSDP)
    got, _ = jax.jit(run)(jax.device_put(grads, specs), state)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "specs, kw, error, match",
    [
        ({**FSDP, "w1": P("data", None)}, {}, ValueError, "names the data axis 'data'"),
        ({**FSDP, "w1": P("model", None)}, {}, ValueError, "the mesh has axes"),
        ({**FSDP, "w1": P("fsdp", "fsdp")}, {}, ValueError, "at most once"),
        ({**FSDP, "b2": P("fsdp")}, {}, ValueError, "does not divide evenly"),
        ({**FSDP, "b2": P(None, "fsdp")}, {}, ValueError, "longer than the parameter's shape"),
        ({**FSDP, "b2": "fsdp"}, {}, TypeError, "must be a jax.sharding.PartitionSpec"),
        ({"w1": P()}, {}, ValueError, "pytree of PartitionSpecs matching the parameters"),
        (FSDP, {"batch_axes": "data"}, ValueError, "`batch_axes` names the data axis"),
        (FSDP, {"batch_axes": "model"}, ValueError, "names"),
    ],
)
def test_bad_param_specs_are_rejected(specs, kw, error, match):
    with pytest.raises(error, match=match):
        step = jd.data_parallel_step(_loss, jd.all_reduce(), mesh=_mesh("fsdp"), param_specs=specs, **kw)
        step.init(_params())


def test_batch_must_split_over_the_batch_axes():
    step = jd.data_parallel_step(
        _loss,
        optax.chain(jd.all_reduce(), jd.sgd(0.1)),
        mesh=_mesh("fsdp"),
        param_specs=FSDP,
        batch_axes="fsdp",
    )
    params, state = step.init(_params())
    bad = {"x": np.zeros((4, D_IN), np.float32), "y": np.zeros((4, D_OUT), np.float32)}
    with pytest.raises(ValueError, match="divisible by the 8 workers"):
        step(params, state, bad)


def test_checkpoint_resume_of_a_sharded_run_is_bit_identical(tmp_path):
    """orbax restores into ``abstract_init``'s sharded layout; the resumed run is the uninterrupted one."""
    import orbax.checkpoint as ocp

    make = lambda: jd.data_parallel_step(  # noqa: E731
        _loss,
        optax.chain(jd.top_k(k=40), optax.adamw(1e-2)),
        mesh=_mesh("fsdp"),
        param_specs=FSDP,
        batch_axes="fsdp",
    )
    batches = _batches(6)
    step = make()
    params, state = step.init(_params())
    for b in batches[:3]:
        params, state, _ = step(params, state, b)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(3, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
        mngr.wait_until_finished()
    for b in batches[3:]:
        params, state, _ = step(params, state, b)

    fresh = make()
    abstract = dict(zip(("params", "opt_state"), fresh.abstract_init(_params())))
    with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(3, args=ocp.args.StandardRestore(abstract))
    assert restored["opt_state"][0].residual["w1"].sharding.spec == P("data", None, "fsdp")
    p2, s2 = restored["params"], restored["opt_state"]
    for b in batches[3:]:
        p2, s2, _ = fresh(p2, s2, b)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_regroup_a_sharded_state_for_another_number_of_replicas():
    """``reshard_opt_state`` on the host copy, then ``place_opt_state(param_specs=)`` on the new mesh."""
    tx = optax.chain(jd.top_k(k=40), jd.sgd(0.1))
    step = jd.data_parallel_step(_loss, tx, mesh=_mesh("fsdp"), param_specs=FSDP)
    params, state = step.init(_params())
    for b in _batches(3):
        params, state, _ = step(params, state, b)
    host = jax.device_get(state)
    regrouped = jd.reshard_opt_state(host, tx, _params(), num_workers=4)
    mesh4 = jax.make_mesh((4, 2), ("data", "fsdp"))
    placed = jd.place_opt_state(regrouped, tx, _params(), mesh=mesh4, param_specs=FSDP)
    res = placed[0].residual["w1"]
    assert res.shape == (4, D_IN, HIDDEN) and res.sharding.spec == P("data", None, "fsdp")
    # The update still owed, (1/n) sum of the residuals, is conserved.
    np.testing.assert_allclose(np.asarray(res).mean(0), host[0].residual["w1"].mean(0), rtol=1e-6, atol=1e-7)


def test_param_specs_may_be_a_tree_prefix_with_none_for_unsharded():
    params = {
        "a": np.zeros((8, 4), np.float32),
        "b": {"c": np.zeros(8, np.float32), "d": np.zeros(3, np.float32)},
    }
    got = model_axes.check_param_specs(
        {"a": P("fsdp"), "b": {"c": P("fsdp"), "d": None}}, params, mesh=_mesh("fsdp"), axis_name="data"
    )
    assert got == {"a": P("fsdp"), "b": {"c": P("fsdp"), "d": P()}}
    whole = model_axes.check_param_specs(P(), params, mesh=_mesh("fsdp"), axis_name="data")
    assert jax.tree.leaves(whole, is_leaf=model_axes.is_spec) == [P()] * 3


def test_step_works_under_the_callers_explicit_mesh():
    """Models are often built under ``jax.set_mesh`` with the usual (Explicit) mesh in context."""
    mesh = _mesh("fsdp")
    step = jd.data_parallel_step(
        _loss, optax.chain(jd.all_reduce(), jd.sgd(0.1)), mesh=mesh, param_specs=FSDP, batch_axes="fsdp"
    )
    with jax.set_mesh(mesh):
        params, state = step.init(_params())
        params, state, metrics = step(params, state, _batches(1)[0])
    assert np.isfinite(float(metrics["loss"])) and params["w1"].sharding.spec == P(None, "fsdp")
