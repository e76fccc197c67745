"""DiLoCo through the Flax front ends: what the step sends, and resuming a run from a checkpoint.

The NNX and linen steps with ``per_worker_params=True`` must send over the data
axis exactly what :func:`jaxopt_dist.data_parallel_step` sends for the same
model and transform (the compiled programs' collectives are compared), and a
run saved with orbax and restored into fresh objects must continue as the
uninterrupted run does, leaf by leaf and bit for bit.
"""

from __future__ import annotations

import collections
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxopt_dist as jd
from jaxopt_dist import linen as jlinen
from jaxopt_dist import nnx as jnnx

P = jax.sharding.PartitionSpec
D_IN, HIDDEN, D_OUT, ROWS = 8, 16, 4, 16
KERNEL1, KERNEL2 = ("fsdp", None), (None, "fsdp")


def _tx():
    return jd.diloco(optax.adamw(1e-2), sync_every=3)


def _batch(t):
    rng = np.random.default_rng(t)
    return {
        "x": rng.standard_normal((ROWS, D_IN)).astype(np.float32),
        "y": rng.standard_normal((ROWS, D_OUT)).astype(np.float32),
    }


def _mesh():
    return jax.make_mesh((2, 4), ("data", "fsdp"))


def _loss(y, batch):
    return jnp.mean(jnp.sum((y - batch["y"]) ** 2, axis=-1))


def _data_axis_collectives(lowered, mesh):
    """(kind, bytes per device, computation kind) of each collective spanning the data axis."""
    found = jd.hlo_collectives(lowered.compile().as_text(), mesh=mesh)
    return collections.Counter((h.kind, h.payload_bytes) for h in found if h.axes is None or "data" in h.axes)


def _shard_bytes(params):
    """The bytes of one device's shards of ``params``."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------
# NNX


class _NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        w = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(D_IN, HIDDEN, kernel_init=nnx.with_partitioning(w, KERNEL1), rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, D_OUT, kernel_init=nnx.with_partitioning(w, KERNEL2), rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m(batch["x"]), batch))(model)
    optimizer.update(model, grads)
    return loss


def _nnx_objects(mesh, tx=None):
    with jax.set_mesh(mesh):
        model = _NnxMLP(nnx.Rngs(0))
        optimizer = jnnx.Optimizer(model, _tx() if tx is None else tx, wrt=nnx.Param)
    return model, optimizer


def _params_and_specs(model):
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    specs = jax.tree.map(lambda x: x.sharding.spec, params)
    return params, specs


def test_nnx_diloco_sends_what_data_parallel_step_sends():
    mesh = _mesh()
    model, optimizer = _nnx_objects(mesh)
    params0, specs = _params_and_specs(model)
    nnx_step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True, batch_axes="fsdp")
    got = _data_axis_collectives(nnx_step.lower(model, optimizer, _batch(0)), mesh)

    def loss_fn(params, batch):
        return _loss(nnx.merge(nnx.graphdef(model), params)(batch["x"]), batch)

    step = jd.data_parallel_step(
        loss_fn, _tx(), mesh=mesh, per_worker_params=True, param_specs=specs, batch_axes="fsdp"
    )
    params, opt_state = step.init(jax.device_get(params0))
    want = _data_axis_collectives(step.lower(params, opt_state, _batch(0)), mesh)
    assert got == want
    # DiLoCo's pseudo-gradient all-reduce (each device's shard of the parameters) and the loss.
    assert sorted(b for (_, b) in want) == [4, _shard_bytes(params0)]

    # The model holds the anchor: the parameters of the last synchronisation.
    for t in range(4):
        nnx_step(model, optimizer, _batch(t))
    anchor = nnx.as_pure(optimizer.opt_state)
    held = nnx.as_pure(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(anchor.anchor), jax.tree.leaves(held)):
        assert a is b
    copies = nnx_step.worker_copies()["0/l1/kernel"]
    assert copies.shape == (2, D_IN, HIDDEN)
    # After the synchronisation at step 3 (t = 2) the workers took the anchor; one more local step
    # moved them apart again.
    assert not np.array_equal(np.asarray(copies[0]), np.asarray(copies[1]))


def test_nnx_average_is_an_explicit_choice():
    mesh = _mesh()
    tx = optax.chain(optax.sgd(0.1), jd.average_params(every=2))
    model, optimizer = _nnx_objects(mesh, tx)
    step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True)
    with pytest.raises(ValueError, match="keeps no anchor.*model_params='average'"):
        step(model, optimizer, _batch(0))
    with pytest.raises(ValueError, match="`model_params` must be"):
        jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True, model_params="mean")
    step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True, model_params="average")
    step(model, optimizer, _batch(0))
    copies = step.worker_copies()["0/l2/kernel"]
    np.testing.assert_allclose(
        np.asarray(model.l2.kernel[...]), np.asarray(jnp.mean(copies, axis=0)), rtol=1e-6, atol=1e-7
    )
    # The average costs one all-reduce of the parameters (each device's shard) on every step, outside
    # average_params' own conditional one: at least the kernels' shards besides the loss.
    found = jd.hlo_collectives(step.lower(model, optimizer, _batch(1)).compile().as_text(), mesh=mesh)
    every_step = [h for h in found if h.axes == ("data",) and h.computation.startswith("main")]
    kernels = _shard_bytes([model.l1.kernel[...], model.l2.kernel[...]])
    assert sum(h.payload_bytes for h in every_step) >= 4 + kernels
    anchor_step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True)
    model, optimizer = _nnx_objects(mesh)
    found = jd.hlo_collectives(anchor_step.lower(model, optimizer, _batch(1)).compile().as_text(), mesh=mesh)
    every_step = [h for h in found if h.axes == ("data",) and h.computation.startswith("main")]
    assert sum(h.payload_bytes for h in every_step) == 4  # the loss


# ----------------------------------------------------------------------------
# linen


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = nn.initializers.lecun_normal()
        h = nn.Dense(HIDDEN, kernel_init=nn.with_partitioning(w, KERNEL1))(x)
        return nn.Dense(D_OUT, kernel_init=nn.with_partitioning(w, KERNEL2))(jnp.tanh(h))


def _linen_step(state, batch):
    def loss_fn(params):
        return _loss(state.apply_fn({"params": params}, batch["x"]), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _linen_state(tx=None):
    model = _LinenMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, D_IN)))["params"]
    return jlinen.TrainState.create(apply_fn=model.apply, params=params, tx=_tx() if tx is None else tx)


def test_linen_diloco_sends_what_data_parallel_step_sends():
    mesh = _mesh()
    state = _linen_state()
    linen_step = jlinen.data_parallel(_linen_step, mesh=mesh, per_worker_params=True, batch_axes="fsdp")
    got = _data_axis_collectives(linen_step.lower(state, _batch(0)), mesh)

    params0 = nn.meta.unbox(state.params)
    specs = jax.tree.map(
        lambda b: b.get_partition_spec() if isinstance(b, nn.Partitioned) else P(),
        state.params,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )

    def loss_fn(params, batch):
        return _loss(_LinenMLP().apply({"params": params}, batch["x"]), batch)

    step = jd.data_parallel_step(
        loss_fn, _tx(), mesh=mesh, per_worker_params=True, param_specs=specs, batch_axes="fsdp"
    )
    params, opt_state = step.init(params0)
    want = _data_axis_collectives(step.lower(params, opt_state, _batch(0)), mesh)
    assert got == want
    assert sorted(b for (_, b) in want)[0] == 4  # the loss


# ----------------------------------------------------------------------------
# Checkpoints: resume bit-identically, regroup for another number of workers.


def _data_mesh(n):
    return jax.make_mesh((n, 1), ("data", "fsdp"), devices=jax.devices()[:n])


def _save(path, tree):
    with ocp.CheckpointManager(path, item_handlers=ocp.StandardCheckpointHandler()) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()


def _restore(path, target=None, check=None):
    """Restores step 1 into ``target``; without it, as host arrays; ``check(metadata)`` first."""
    with ocp.CheckpointManager(path, item_handlers=ocp.StandardCheckpointHandler()) as mngr:
        meta = mngr.item_metadata(1)
        if check is not None:
            target = check(meta)
        if target is None:
            target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), getattr(meta, "tree", meta))
        return mngr.restore(1, args=ocp.args.StandardRestore(target))


def _assert_equal_leaves(got, want):
    got, want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _nnx_run(mesh, start, stop, step=None, objects=None):
    model, optimizer = objects or _nnx_objects(mesh)
    step = step or jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True)
    losses = [float(step(model, optimizer, _batch(t))) for t in range(start, stop)]
    return step, model, optimizer, losses


def test_nnx_diloco_resumes_bit_identically(tmp_path):
    mesh = _data_mesh(4)
    step, model, optimizer, want_losses = _nnx_run(mesh, 0, 7)
    want = step.checkpoint_state(model, optimizer)

    step, model, optimizer, losses = _nnx_run(mesh, 0, 4)
    _save(tmp_path, step.checkpoint_state(model, optimizer))
    # A fresh process: new objects (per-worker optimizer leaves not stacked yet), a new step.
    model, optimizer = _nnx_objects(mesh)
    step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True)
    ckpt = _restore(tmp_path, check=lambda meta: step.checkpoint_target(model, optimizer, saved=meta))
    step.restore_state(ckpt, model, optimizer)
    _, _, _, more = _nnx_run(mesh, 4, 7, step, (model, optimizer))
    assert losses + more == want_losses
    _assert_equal_leaves(step.checkpoint_state(model, optimizer), want)
    assert set(want["worker_copies"]["0"]) == {"l1", "l2"}


def test_nnx_checkpoint_for_other_workers_is_regrouped_not_dropped(tmp_path):
    step8, model, optimizer, _ = _nnx_run(_data_mesh(8), 0, 4)
    saved = step8.checkpoint_state(model, optimizer)
    _save(tmp_path, saved)

    mesh = _data_mesh(4)
    model, optimizer = _nnx_objects(mesh)
    step = jnnx.data_parallel(_nnx_step, mesh=mesh, per_worker_params=True)
    # Checked against the metadata before orbax sees the arrays: the library's message.
    check = lambda meta: step.checkpoint_target(model, optimizer, saved=meta)  # noqa: E731
    with pytest.raises(ValueError, match=r"per-worker values for 8 workers.*Regroup it first.*regroup_state"):
        _restore(tmp_path, check=check)
    raw = _restore(tmp_path)
    # Handed over as it is, it is refused too.
    with pytest.raises(ValueError, match="8 workers.*regroup_state"):
        step.restore_state(raw, model, optimizer)
    ckpt = step.regroup_state(raw, model, optimizer)
    step.restore_state(ckpt, model, optimizer)
    copies = step.worker_copies()
    for name, x in copies.items():
        path = name.split("/")
        old = functools.reduce(lambda d, k: d[k], path, saved["worker_copies"])
        assert x.shape[0] == 4
        np.testing.assert_allclose(np.mean(x, 0), np.mean(np.asarray(old), 0), rtol=1e-6, atol=1e-7)
    # The anchor (replicated) is copied as it was.
    _assert_equal_leaves(
        ckpt["state"]["1"]["opt_state"]["anchor"], jax.device_get(saved["state"]["1"]["opt_state"]["anchor"])
    )
    assert np.isfinite(float(step(model, optimizer, _batch(4))))


def _linen_run(mesh, start, stop, state=None, step=None):
    state = state or _linen_state()
    step = step or jlinen.data_parallel(_linen_step, mesh=mesh, per_worker_params=True)
    losses = []
    for t in range(start, stop):
        state, metrics = step(state, _batch(t))
        losses.append(float(metrics["loss"]))
    return step, state, losses


def test_linen_diloco_resumes_bit_identically(tmp_path):
    mesh = _data_mesh(4)
    _, want, want_losses = _linen_run(mesh, 0, 7)
    step, state, losses = _linen_run(mesh, 0, 4)
    _save(tmp_path, state)
    step = jlinen.data_parallel(_linen_step, mesh=mesh, per_worker_params=True)
    state = _restore(tmp_path, check=lambda meta: step.abstract_state(_linen_state(), saved=meta))
    assert isinstance(state, jlinen.TrainState)
    _, state, more = _linen_run(mesh, 4, 7, state, step)
    assert losses + more == want_losses
    _assert_equal_leaves(state, want)


def test_linen_checkpoint_for_other_workers_is_regrouped_not_dropped(tmp_path):
    _, saved, _ = _linen_run(_data_mesh(4), 0, 4)
    _save(tmp_path, saved)
    step = jlinen.data_parallel(_linen_step, mesh=_data_mesh(2), per_worker_params=True)
    check = lambda meta: step.abstract_state(_linen_state(), saved=meta)  # noqa: E731
    with pytest.raises(ValueError, match=r"per-worker values for 4 workers.*Regroup it first.*regroup_state"):
        _restore(tmp_path, check=check)
    state = step.regroup_state(_restore(tmp_path), _linen_state())
    for got, old in zip(jax.tree.leaves(state.params), jax.tree.leaves(saved.params)):
        assert got.shape[0] == 2
        np.testing.assert_allclose(np.mean(got, 0), np.mean(np.asarray(old), 0), rtol=1e-6, atol=1e-7)
    _assert_equal_leaves(state.opt_state.anchor, jax.device_get(saved.opt_state.anchor))
    state, metrics = step(state, _batch(4))
    assert np.isfinite(float(metrics["loss"]))


def test_data_parallel_step_checkpoint_for_other_workers_names_the_fix(tmp_path):
    tx = optax.chain(jd.top_k(k=2), jd.sgd(0.1, momentum=0.9))

    def loss_fn(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"][:, :1]) ** 2)

    params0 = {"w": np.ones((D_IN, 1), np.float32)}
    step8 = jd.data_parallel_step(loss_fn, tx, mesh=jax.make_mesh((8,), ("data",)))
    params, opt_state = step8.init(params0)
    params, opt_state, _ = step8(params, opt_state, _batch(0))
    _save(tmp_path, (params, opt_state))
    step4 = jd.data_parallel_step(loss_fn, tx, mesh=_data_mesh(4))
    check = lambda meta: step4.abstract_init(params0, saved=meta)  # noqa: E731
    with pytest.raises(ValueError, match=r"residual.*per-worker values for 8 workers.*reshard_opt_state"):
        _restore(tmp_path, check=check)
    # The same number of workers passes the check and restores.
    restored = _restore(tmp_path, check=lambda meta: step8.abstract_init(params0, saved=meta))
    _assert_equal_leaves(restored, (params, opt_state))
