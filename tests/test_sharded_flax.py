"""Sharded Flax models through ``jaxopt_dist.nnx`` and ``jaxopt_dist.linen``.

Each front end trains one small MLP whose variables carry sharding metadata
(NNX: ``nnx.with_partitioning``; linen: ``nn.with_logical_partitioning`` and
logical axis rules, or ``nn.with_partitioning``) on a 2 data x 4 fsdp mesh, and
the same MLP without metadata on a 2-device data mesh. The training code is the
same for both. The parameters and optimizer states must agree to float32
rounding, every leaf shaped like a sharded parameter must be sharded like it,
and one device must hold about a quarter of the bytes.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxopt_dist as jd
from jaxopt_dist import linen as jlinen
from jaxopt_dist import nnx as jnnx
from tests import helpers

P = jax.sharding.PartitionSpec

D_IN, HIDDEN, D_OUT, ROWS, STEPS = 16, 64, 8, 16, 10
# Mesh-axis specs of the sharded parameters; the output bias stays replicated.
KERNEL1, BIAS1, KERNEL2 = P(None, "fsdp"), P("fsdp"), P("fsdp", None)
RULES = (("embed", None), ("mlp", "fsdp"), ("out", None))

# (id, the optimizer, per_worker_params)
CASES = [
    ("all_reduce+adamw", lambda: optax.chain(jd.all_reduce(), optax.adamw(1e-2, weight_decay=0.1)), False),
    ("diloco", lambda: jd.diloco(optax.adamw(1e-2), sync_every=3), True),
    # Flat, padded error buffers (no parameter's shape): split over "fsdp" all the same.
    ("zero_one_adam", lambda: jd.zero_one_adam(1e-2, var_freeze_step=3, num_workers=2, eps=1e-4), True),
    # Dion's momentum is sharded like its parameter; its Q (r x the shorter side) is replicated.
    ("dion", lambda: jd.dion(1e-2, rank_fraction=0.25), False),
    ("muon", lambda: jd.muon(1e-2, num_workers=2), False),
]
IDS = [c[0] for c in CASES]
# Optimizer-state leaves sharded like a parameter, besides the parameters (default: Adam's two moments
# of each); and whether each device holds a quarter of the replicated run's bytes. Dion: its momentum
# of the two kernels and AdamW's moments of the sharded bias (its Q, r x the shorter side, is
# replicated: 27% here). Muon's momentum, stacked by shape (its state's MATRIX_STACKS), is split over
# "fsdp" on the stacks' rows: a quarter per device, as the parameters.
SHARDED_STATE = {"dion": (4, False), "muon": (2, True)}


def _meshes():
    sharded = jax.make_mesh((2, 4), ("data", "fsdp"))
    replicated = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    return sharded, replicated


def _batches():
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.standard_normal((ROWS, D_IN)).astype(np.float32),
            "y": rng.standard_normal((ROWS, D_OUT)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def _device_bytes(tree):
    """The bytes of ``tree`` on the first device."""
    return helpers.device_bytes(tree).get(jax.devices()[0], 0)


def _dims(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _check_sharded_like_params(tree):
    """Every leaf shaped like a sharded parameter (after a leading worker axis, if stacked) is
    sharded like it; returns how many there are."""
    sharded = {(D_IN, HIDDEN): KERNEL1, (HIDDEN,): BIAS1, (HIDDEN, D_OUT): KERNEL2}
    found = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        spec, shape = _dims(x.sharding.spec, x.ndim), x.shape
        if spec and spec[0] == "data":  # stacked per worker
            spec, shape = spec[1:], shape[1:]
        if shape in sharded:
            assert spec == _dims(sharded[shape], len(shape)), (
                f"{jax.tree_util.keystr(path)}: {x.sharding.spec}"
            )
            found += 1
    return found


def _assert_close(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=f"leaf {i}")


def _check_quarter(sharded_bytes, replicated_bytes):
    ratio = sharded_bytes / replicated_bytes
    assert 0.25 <= ratio <= 0.25 * 1.05, ratio


# ----------------------------------------------------------------------------
# NNX


class _NnxMLP(nnx.Module):
    def __init__(self, *, sharded: bool, rngs: nnx.Rngs):
        def part(init, spec):
            return nnx.with_partitioning(init, tuple(spec)) if sharded else init

        w, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.l1 = nnx.Linear(
            D_IN, HIDDEN, kernel_init=part(w, KERNEL1), bias_init=part(zeros, BIAS1), rngs=rngs
        )
        self.l2 = nnx.Linear(HIDDEN, D_OUT, kernel_init=part(w, KERNEL2), rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _nnx_train(mesh, tx, per_worker, *, eager=True, **kw):
    """Trains on ``mesh``; the model is sharded when the mesh has "fsdp". Returns the model,
    the optimizer and the step."""
    sharded = "fsdp" in mesh.shape
    if eager:  # built sharded, as flax does under a mesh
        with jax.set_mesh(mesh):
            model = _NnxMLP(sharded=sharded, rngs=nnx.Rngs(0))
            optimizer = jnnx.Optimizer(model, tx, wrt=nnx.Param)
    else:  # built on one device, metadata only: the step places it
        with nnx.use_eager_sharding(False):
            model = _NnxMLP(sharded=sharded, rngs=nnx.Rngs(0))
            optimizer = jnnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=per_worker, **kw)
    for batch in _batches():
        loss = step(model, optimizer, batch)
    assert np.isfinite(float(loss))
    return model, optimizer, step


def _nnx_arrays(model, optimizer, step):
    return nnx.as_pure(nnx.state(model)), nnx.as_pure(nnx.state(optimizer)), step.worker_copies()


@pytest.mark.parametrize("name,make_tx,per_worker", CASES, ids=IDS)
def test_nnx_sharded_model_matches_replicated(name, make_tx, per_worker):
    sharded_mesh, replicated_mesh = _meshes()
    # DiLoCo's model holds its anchor; 0/1 Adam keeps none, so the model holds the workers' average.
    kw = {"model_params": "average"} if name == "zero_one_adam" else {}
    got = _nnx_arrays(*_nnx_train(sharded_mesh, make_tx(), per_worker, **kw))
    want = _nnx_arrays(*_nnx_train(replicated_mesh, make_tx(), per_worker, **kw))
    _assert_close(got, want)
    # Parameters, moments (and with diloco: anchor, outer momentum, per-worker copies).
    state_leaves, quarter = SHARDED_STATE.get(name, (6, True))
    assert _check_sharded_like_params(got) >= (12 if per_worker else 3 + state_leaves)
    if per_worker:
        assert {k: v.shape[0] for k, v in got[2].items()} == {
            "0/l1/bias": 2,
            "0/l1/kernel": 2,
            "0/l2/bias": 2,
            "0/l2/kernel": 2,
        }
    if quarter:
        _check_quarter(_device_bytes(got), _device_bytes(want))


def test_nnx_model_built_unsharded_is_placed_by_its_metadata():
    # Built on one device (metadata only) and stepped outside any mesh context, with the batch
    # split over "fsdp" too (FSDP): the same numbers, sharded.
    sharded_mesh, replicated_mesh = _meshes()
    tx = lambda: optax.chain(jd.all_reduce(), optax.adamw(1e-2))  # noqa: E731
    model, optimizer, step = _nnx_train(sharded_mesh, tx(), False, eager=False, batch_axes="fsdp")
    want = _nnx_arrays(*_nnx_train(replicated_mesh, tx(), False, eager=False))
    _assert_close(_nnx_arrays(model, optimizer, step), want)
    assert model.l1.kernel[...].sharding.spec == KERNEL1
    assert _dims(optimizer.opt_state[1][0].mu["l2"]["kernel"][...].sharding.spec, 2) == _dims(KERNEL2, 2)
    helpers.assert_replicated_shards(model.l2.bias[...])


def _bad_nnx_model(init_spec, features=HIDDEN):
    with nnx.use_eager_sharding(False):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), init_spec)
        model = nnx.Linear(D_IN, features, kernel_init=init, rngs=nnx.Rngs(0))
        return model, jnnx.Optimizer(model, optax.chain(jd.all_reduce(), optax.sgd(0.1)), wrt=nnx.Param)


def _linear_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize(
    "spec,features,match",
    [
        ((None, "data"), HIDDEN, "names the data axis 'data'"),
        ((None, "tensor"), HIDDEN, r"the mesh has axes \('data', 'fsdp'\)"),
        ((None, "fsdp"), 6, r"axis 1 of shape \(16, 6\), of size 6, does not divide evenly"),
    ],
)
def test_nnx_bad_sharding_metadata_raises_clear_errors(spec, features, match):
    mesh, _ = _meshes()
    model, optimizer = _bad_nnx_model(spec, features)
    step = jnnx.data_parallel(_linear_step, mesh=mesh)
    with pytest.raises(ValueError, match=f"sharding metadata of .*{match}"):
        step(model, optimizer, np.ones((8, D_IN), np.float32))


def test_nnx_bad_options_raise_clear_errors():
    mesh, _ = _meshes()
    with pytest.raises(ValueError, match="`batch_axes` names the data axis 'data'"):
        jnnx.data_parallel(_linear_step, mesh=mesh, batch_axes="data")
    with pytest.raises(ValueError, match="axis_name"):
        jnnx.data_parallel(_linear_step, mesh=mesh, batch_axes="tensor")
    with pytest.raises(TypeError, match="per_worker_params"):
        jnnx.data_parallel(_linear_step, mesh=mesh, per_worker_params=1)
    # A transform with per-worker updates needs per_worker_params=True.
    model, _ = _bad_nnx_model((None, "fsdp"))
    optimizer = jnnx.Optimizer(model, jd.diloco(optax.sgd(0.1), sync_every=2), wrt=nnx.Param)
    with pytest.raises(ValueError, match="per_worker_params=True"):
        jnnx.data_parallel(_linear_step, mesh=mesh)(model, optimizer, np.ones((8, D_IN), np.float32))


# ----------------------------------------------------------------------------
# linen


class _LinenMLP(nn.Module):
    sharding: str  # "logical", "mesh" or "none"

    @nn.compact
    def __call__(self, x):
        def part(init, logical, mesh_axes):
            if self.sharding == "logical":
                return nn.with_logical_partitioning(init, logical)
            if self.sharding == "mesh":
                return nn.with_partitioning(init, tuple(mesh_axes))
            return init

        w, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros_init()
        h = nn.Dense(
            HIDDEN, kernel_init=part(w, ("embed", "mlp"), KERNEL1), bias_init=part(zeros, ("mlp",), BIAS1)
        )
        out = nn.Dense(D_OUT, kernel_init=part(w, ("mlp", "out"), KERNEL2))
        return out(jnp.tanh(h(x)))


def _linen_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _linen_train(mesh, tx, per_worker, sharding, *, context=contextlib.nullcontext, **kw):
    """Trains on ``mesh`` (the steps inside ``context()``); returns params and optimizer state."""
    model = _LinenMLP(sharding)
    params = model.init(jax.random.key(0), jnp.ones((1, D_IN)))["params"]
    state = jlinen.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    step = jlinen.data_parallel(_linen_step, mesh=mesh, per_worker_params=per_worker, **kw)
    with context():
        for batch in _batches():
            state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    return state.params, state.opt_state


@pytest.mark.parametrize("name,make_tx,per_worker", CASES, ids=IDS)
def test_linen_logically_partitioned_model_matches_replicated(name, make_tx, per_worker):
    sharded_mesh, replicated_mesh = _meshes()
    got = _linen_train(sharded_mesh, make_tx(), per_worker, "logical", logical_axis_rules=RULES)
    want = _linen_train(replicated_mesh, make_tx(), per_worker, "none")
    _assert_close(got, want)
    state_leaves, quarter = SHARDED_STATE.get(name, (6, True))
    assert _check_sharded_like_params(got) >= (12 if per_worker else 3 + state_leaves)
    kernel = got[0]["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned)  # the boxes stay
    assert kernel.value.shape == ((2, D_IN, HIDDEN) if per_worker else (D_IN, HIDDEN))
    if quarter:
        _check_quarter(_device_bytes(got), _device_bytes(want))


def test_linen_rules_from_context_and_mesh_axis_boxes():
    sharded_mesh, replicated_mesh = _meshes()
    tx = lambda: optax.chain(jd.all_reduce(), optax.adamw(1e-2))  # noqa: E731
    want = _linen_train(replicated_mesh, tx(), False, "none")
    from_context = _linen_train(
        sharded_mesh, tx(), False, "logical", context=lambda: nn.logical_axis_rules(RULES)
    )
    _assert_close(from_context, want)
    assert _check_sharded_like_params(from_context) == 9
    # Stepped with the Explicit mesh in context (jax.set_mesh), the batch split over "fsdp" too.
    explicit = lambda: jax.set_mesh(sharded_mesh)  # noqa: E731
    mesh_axes = _linen_train(sharded_mesh, tx(), False, "mesh", context=explicit, batch_axes="fsdp")
    _assert_close(mesh_axes, want)
    assert _check_sharded_like_params(mesh_axes) == 9


def test_linen_bad_input_raises_clear_errors():
    mesh, _ = _meshes()
    tx = optax.chain(jd.all_reduce(), optax.sgd(0.1))
    with pytest.raises(ValueError, match="no logical axis rules"):
        _linen_train(mesh, tx, False, "logical")
    with pytest.raises(ValueError, match="names the data axis 'data'"):
        _linen_train(mesh, tx, False, "logical", logical_axis_rules=(("mlp", "data"),))
    odd = jax.make_mesh((2, 3), ("data", "fsdp"), devices=jax.devices()[:6])
    with pytest.raises(
        ValueError, match=f"axis \\d of shape .*, of size {HIDDEN}, does not divide evenly over 'fsdp'"
    ):
        _linen_train(odd, tx, False, "logical", logical_axis_rules=RULES)
    with pytest.raises(TypeError, match="logical_axis_rules"):
        jlinen.data_parallel(_linen_step, mesh=mesh, logical_axis_rules=("mlp",))
    with pytest.raises(ValueError, match="`batch_axes` names the data axis"):
        jlinen.data_parallel(_linen_step, mesh=mesh, batch_axes=("fsdp", "data"))


# ----------------------------------------------------------------------------
# The example


@pytest.mark.devices(8)
def test_fsdp_example_trains_and_holds_a_quarter_per_device(capsys):
    result = helpers.load_example("flax_nnx_fsdp").main(["--steps", "40", "--hidden", "128", "--seed", "0"])
    losses = result["losses"]
    assert len(losses) == 40 and np.all(np.isfinite(losses))
    assert result["final_loss"] < 0.5 * result["first_loss"]
    assert result["test_accuracy"] > 0.6  # chance is 0.1
    assert result["kernel_spec"] == P(None, "fsdp")
    assert result["device_bytes"] / result["replicated_bytes"] < 0.26
    assert "per device" in capsys.readouterr().out
