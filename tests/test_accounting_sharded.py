"""communication_cost on sharded models: data-axis bytes traced, model-axis bytes read off compiled HLO.

A 2 x 4 mesh ("data", "fsdp") of the 8 simulated CPU devices: two replicas, each
holding its parameters sharded four ways. The data-axis bytes per worker (one
replica) must equal those of the same transform on unsharded parameters; the
model-axis bytes are the collectives the compiler inserts inside a replica.
The last tests read replica groups off literal HLO lines in each form XLA prints.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import communication_cost, hlo_collectives
from jaxopt_dist._src.accounting import hlo

P = jax.sharding.PartitionSpec
PARAMS = {"w": jnp.zeros((16, 8), jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
SPECS = {"w": P("fsdp", None), "b": P(None)}
SIZES = {"data": 2, "fsdp": 4}
RING2 = 2 * (2 - 1) / 2  # all-reduce bytes on the wire per payload byte, 2 workers

# (id, transform factory): the transform's data-axis bytes must not change when the model is sharded.
CASES = [
    ("all_reduce", lambda: optax.chain(jd.all_reduce(), jd.sgd(0.1))),
    ("powersgd", lambda: optax.chain(jd.powersgd(2), jd.sgd(0.1))),
    ("top_k", lambda: optax.chain(jd.top_k(10), jd.sgd(0.1))),
    ("diloco", lambda: jd.diloco(optax.adam(1e-3), sync_every=3)),  # per-worker parameters
]


def _sharded_cost(tx, **kw):
    kw.setdefault("num_workers", SIZES)
    return communication_cost(tx, PARAMS, param_specs=SPECS, **kw)


@pytest.mark.devices(8)
@pytest.mark.parametrize("factory", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_data_axis_bytes_per_worker_equal_those_of_unsharded_parameters(factory):
    tx = factory()
    sharded = _sharded_cost(tx)
    replicated = communication_cost(tx, PARAMS, num_workers=2)
    assert sharded.data_axes == ("data",) and sharded.model_axes == ("fsdp",)
    assert sharded.num_workers == 2 and sharded.compiled is not None  # 8 devices: compiled on a 2 x 4 mesh
    assert sharded.by_axis()["data"] == replicated.by_axis()["data"]
    assert sharded.sent_bytes == replicated.sent_bytes > 0
    assert sharded.period == replicated.period
    assert [s.sent_bytes for s in sharded.steps] == [s.sent_bytes for s in replicated.steps]
    assert [c.operands for c in sharded.sites] == [c.operands for c in replicated.sites]
    assert sharded.compression_ratio == replicated.compression_ratio
    assert any("data axes: traced, per worker" in n for n in sharded.notes)


@pytest.mark.devices(8)
def test_elementwise_update_sends_nothing_over_the_model_axis():
    cost = _sharded_cost(optax.chain(jd.all_reduce(), jd.sgd(0.1)))
    assert cost.model_by_axis() == {} and cost.model_sent_bytes == 0.0
    assert set(cost.by_axis()) == {"data"}
    # Per replica (traced): the whole leaves; per device (compiled): w's shard and all of b.
    assert cost.by_axis()["data"].payload_bytes == 4 * (16 * 8 + 8)
    per_device = cost.compiled_by_axis()["data"]
    assert per_device.payload_bytes == 4 * (16 * 8 // 4 + 8)
    assert per_device.sent_bytes == pytest.approx(RING2 * 4 * (16 * 8 // 4 + 8))
    assert "none: the compiled update sends nothing over them" in cost.table()


@pytest.mark.devices(8)
def test_top_k_on_a_sharded_matrix_moves_bytes_over_the_model_axis():
    tx = optax.chain(jd.top_k(10), jd.sgd(0.1))
    cost = _sharded_cost(tx)
    model = cost.by_axis()["fsdp"]
    assert model.sent_bytes > 0 and model.calls >= 1
    assert cost.model_sent_bytes == pytest.approx(model.sent_bytes)
    assert cost.model_by_axis() == {"fsdp": model}
    # Every model-axis collective has groups of the 4 devices of one replica.
    compiled = cost.compiled or ()
    fsdp = [h for h in compiled if h.axes == ("fsdp",)]
    assert fsdp and all(h.group_size == 4 for h in fsdp)
    assert all(h.group_size == 2 for h in compiled if h.axes == ("data",))
    # The data-axis bytes are those of unsharded parameters.
    assert cost.by_axis()["data"] == communication_cost(tx, PARAMS, num_workers=2).by_axis()["data"]
    text = cost.table()
    assert "data axes (traced, per worker and step):" in text
    assert "model axes ('fsdp',) (compiled HLO, per device and update):" in text
    assert "over 'fsdp':" in text and "over 'data':" in text


@pytest.mark.devices(8)
def test_axes_found_from_mesh_positions_whatever_the_device_order():
    tx = optax.chain(jd.top_k(10), jd.sgd(0.1))
    auto = _sharded_cost(tx)
    # Device ids that are not the positions, and the axes in the other order.
    shuffled = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2).T, ("data", "fsdp"))
    swapped = jax.make_mesh((4, 2), ("fsdp", "data"), devices=jax.devices()[:8])
    for mesh in (shuffled, swapped):
        cost = _sharded_cost(tx, num_workers=None, mesh=mesh)
        assert cost.by_axis() == auto.by_axis()
        assert {h.axes for h in cost.compiled or ()} == {("data",), ("fsdp",)}


def test_without_a_mesh_model_axis_bytes_are_not_counted_and_a_note_says_so():
    # 2 x 2 = 4 devices: no mesh over this process's 8 devices, none given.
    tx = optax.chain(jd.top_k(10), jd.sgd(0.1))
    cost = _sharded_cost(tx, num_workers={"data": 2, "fsdp": 2})
    assert cost.compiled is None and cost.model_sent_bytes is None
    assert set(cost.by_axis()) == {"data"}
    assert cost.by_axis()["data"] == communication_cost(tx, PARAMS, num_workers=2).by_axis()["data"]
    assert any("model axes ('fsdp',): not counted" in n and "pass `mesh=`" in n for n in cost.notes)
    assert "not counted: the update was not compiled on a mesh" in cost.table()
    # One spec for the whole tree (a prefix), as data_parallel_step takes it.
    prefix = communication_cost(tx, PARAMS, num_workers={"data": 2, "fsdp": 2}, param_specs=P("fsdp"))
    assert prefix.by_axis() == cost.by_axis() and prefix.model_axes == ("fsdp",)


def test_bad_sharded_inputs():
    tx = jd.all_reduce()
    with pytest.raises(ValueError, match=r"model axes \['fsdp'\], but `num_workers` gives sizes only for"):
        communication_cost(tx, PARAMS, num_workers=2, param_specs=SPECS)
    with pytest.raises(ValueError, match=r"gives sizes only for \('data', 'tensor'\)"):
        communication_cost(tx, PARAMS, num_workers={"data": 2, "tensor": 2}, param_specs=SPECS)
    with pytest.raises(ValueError, match=r"names the data axis 'data'"):
        communication_cost(tx, PARAMS, num_workers=SIZES, param_specs={"w": P("data", None), "b": P()})
    with pytest.raises(ValueError, match=r"does not divide evenly"):
        communication_cost(tx, PARAMS, num_workers={"data": 2, "fsdp": 3}, param_specs=SPECS)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8])
    with pytest.raises(ValueError, match=r"`mesh` is used with `param_specs`"):
        communication_cost(tx, PARAMS, num_workers=SIZES, mesh=mesh)
    with pytest.raises(ValueError, match=r"`mesh` has the axes \{'data': 2, 'fsdp': 4\} but `num_workers`"):
        communication_cost(tx, PARAMS, num_workers={"data": 4, "fsdp": 2}, param_specs=SPECS, mesh=mesh)
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh"):
        communication_cost(tx, PARAMS, num_workers=SIZES, param_specs=SPECS, mesh=mesh.abstract_mesh)


# ----------------------------------------------------------------------------
# Replica groups in each form XLA prints (all seen on this machine).

_LINES = {
    "explicit": "replica_groups={{0,4},{1,5},{2,6},{3,7}}",
    "iota": "replica_groups=[2,4]<=[8]",
    "iota_transposed": "replica_groups=[4,2]<=[2,4]T(1,0)",
    "mesh_data": "replica_groups=mesh['data'=2,'fsdp'=4] {'data'}",
    "mesh_fsdp": "replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}",
    "mesh_both": "replica_groups=mesh['data'=2,'fsdp'=4] {'data','fsdp'}",
    "mesh_sub_axis": "replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp':(1)2}",
    # XLA's own mesh (axes named by position) with a device order of its own.
    "mesh_device_ids": "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
    "mesh_device_list": "replica_groups=mesh['data'=2,'fsdp'=4], device_ids=([[0,2,4,6],[1,3,5,7]]) {'data'}",
}
_GROUPS = {
    "explicit": ((0, 4), (1, 5), (2, 6), (3, 7)),
    "iota": ((0, 1, 2, 3), (4, 5, 6, 7)),
    "iota_transposed": ((0, 4), (1, 5), (2, 6), (3, 7)),
    "mesh_data": ((0, 4), (1, 5), (2, 6), (3, 7)),
    "mesh_fsdp": ((0, 1, 2, 3), (4, 5, 6, 7)),
    "mesh_both": (tuple(range(8)),),
    "mesh_sub_axis": ((0, 2), (1, 3), (4, 6), (5, 7)),
    "mesh_device_ids": ((0, 1, 2, 3), (4, 5, 6, 7)),
    "mesh_device_list": ((0, 1), (2, 3), (4, 5), (6, 7)),
}
_AXES = {
    "explicit": ("data",),
    "iota": ("fsdp",),
    "iota_transposed": ("data",),
    "mesh_data": ("data",),
    "mesh_fsdp": ("fsdp",),
    "mesh_both": ("data", "fsdp"),
    "mesh_sub_axis": ("fsdp",),
    "mesh_device_ids": ("fsdp",),
    "mesh_device_list": ("fsdp",),
}


def _line(groups: str) -> str:
    return f"  %ar.1 = f32[8]{{0}} all-reduce(%x), channel_id=1, {groups}, use_global_device_ids=true, to_apply=%add"


@pytest.mark.devices(8)
@pytest.mark.parametrize("form", list(_LINES))
def test_replica_groups_in_each_form(form):
    line = _line(_LINES[form])
    assert hlo.replica_groups(line) == _GROUPS[form]
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8])
    (found,) = hlo_collectives("ENTRY %main (x: f32[8]) -> f32[8] {\n" + line + "\n}\n", mesh=mesh)
    assert found.groups == _GROUPS[form] and found.axes == _AXES[form]
    assert found.group_size == len(_GROUPS[form][0])
    assert found.sent_bytes() == pytest.approx(2 * (found.group_size - 1) / found.group_size * 32)


def test_replica_groups_of_permutes_all_devices_and_unknown_forms():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8])
    permute = "  %cp = f32[2]{0} collective-permute(%x), channel_id=2, source_target_pairs={{3,2},{7,6}}"
    assert hlo.replica_groups(permute) == ((3, 2), (7, 6))
    assert hlo.mesh_axes_of(hlo.replica_groups(permute), mesh) == ("fsdp",)
    assert hlo.replica_groups(_line("replica_groups={}")) == ()
    assert hlo.mesh_axes_of((), mesh) == ("data", "fsdp")  # one group of every device
    assert hlo.mesh_axes_of(((0, 8),), mesh) is None  # not a program of this mesh
    strange = _line("replica_groups=ring<8>")
    assert hlo.replica_groups(strange) is None and hlo.mesh_axes_of(None, mesh) is None
    (found,) = hlo_collectives(strange, mesh=mesh)
    assert found.axes is None and found.group_size == 0
    # Without a mesh, no axes are named.
    (plain,) = hlo_collectives(_line(_LINES["iota"]))
    assert plain.axes == () and plain.group_size == 4 and math.isclose(plain.sent_bytes(), 1.5 * 32)
