"""Every transform on sharded parameters: the same numbers as on replicated ones.

Each case trains one small MLP for a few steps twice with
:func:`jaxopt_dist.data_parallel_step`: on a 2 data x 4 fsdp mesh with the
parameters sharded over "fsdp" (``param_specs``: one leaf ``P(None, "fsdp")``,
two ``P("fsdp", ...)``, one replicated), and on a 2-device data mesh with
replicated parameters. The parameters must agree to float32 rounding (the
model's matmuls sum over sharded dimensions in another order), replicas must
stay bit-identical over the data axis, and every state leaf shaped like a
sharded parameter must still be sharded like it after the steps. The flat
error buffers of 1-bit Adam and 0/1 Adam (no parameter's shape) are split
over "fsdp" too.

Quantizers and selections are discontinuous: a last-bit difference in the
gradients can move an entry across a rounding midpoint or a tie in the
ranking. The model, data and step count here cross none (an 8-bit
``low_bit(4, 3)`` does, in one entry at step 6, which is why it is not a case).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

P = jax.sharding.PartitionSpec
pytestmark = pytest.mark.devices(8)

SPECS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}
D_IN, HIDDEN, D_OUT, ROWS = 8, 32, 16, 16
STEPS = 6


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN)).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "w2": (rng.standard_normal((HIDDEN, D_OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(D_OUT)).astype(np.float32),
    }


def _batches(steps=STEPS):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.standard_normal((ROWS, D_IN)).astype(np.float32),
            "y": rng.standard_normal((ROWS, D_OUT)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None])
    return jnp.mean(jnp.sum((h @ p["w2"] + p["b2"][None] - b["y"]) ** 2, axis=-1))


def _train(tx, mesh, param_specs, per_worker, axis_name="data", **kw):
    step = jd.data_parallel_step(
        _loss, tx, mesh=mesh, axis_name=axis_name, param_specs=param_specs, per_worker_params=per_worker, **kw
    )
    params, state = step.init(_params())
    for batch in _batches():
        params, state, metrics = step(params, state, batch)
    assert np.isfinite(float(metrics["loss"]))
    return params, state


def _dims(spec, ndim):
    """A PartitionSpec as a tuple of ``ndim`` entries (trailing Nones made explicit)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def _check_replicas(params):
    """Shards holding the same slice of a leaf (over the data axis, and "fsdp" for a replicated leaf)
    are bit-identical."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        by_index: dict = {}
        for sh in x.addressable_shards:
            by_index.setdefault(str(sh.index), []).append(np.asarray(sh.data).tobytes())
        for index, copies in by_index.items():
            assert len(copies) > 1, (path, index)
            assert all(c == copies[0] for c in copies), f"replicas differ at {jax.tree_util.keystr(path)}"


def _check_state_sharding(state, per_worker):
    """Every state leaf shaped like a sharded parameter is sharded like it; returns how many there are."""
    params = _params()
    sharded = {np.shape(params[k]): _dims(sp, np.ndim(params[k])) for k, sp in SPECS.items() if len(sp)}
    found = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        spec = _dims(x.sharding.spec, x.ndim)
        shape = x.shape
        if spec and spec[0] == "data":  # a per-worker leaf, stacked over the data axis
            spec, shape = spec[1:], shape[1:]
        if shape in sharded:
            assert spec == sharded[shape], f"{jax.tree_util.keystr(path)}: {x.sharding.spec}"
            found += 1
    return found


def _meshes():
    sharded = jax.make_mesh((2, 4), ("data", "fsdp"))
    replicated = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    return sharded, replicated


def _dim_reduce():
    n_params = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
    q, _ = np.linalg.qr(np.random.default_rng(2).standard_normal((n_params, 4)))
    return jd.dim_reduce(q.T.astype(np.float32), alpha=0.01)


def _sgd(lr=0.05):
    return jd.sgd(lr, momentum=0.9)


def _case(name, make_tx, per_worker=False, slow=False, atol=1e-6, **kw):
    """One row of :data:`CASES`: ``make_tx()`` builds the transform; ``kw`` goes to data_parallel_step;
    ``atol`` is the parameters' absolute tolerance (with rtol 1e-5)."""
    return pytest.param(make_tx, per_worker, kw, atol, id=name, marks=[pytest.mark.slow] if slow else [])


def _choco(compressor):
    return optax.chain(_sgd(), jd.choco_gossip(compressor, consensus_step=0.5))


CASES = [
    # Aggregation, followed by local optimizers.
    _case("all_reduce+sgd", lambda: optax.chain(jd.all_reduce(), _sgd())),
    _case("all_reduce_flatten+adam", lambda: optax.chain(jd.all_reduce(flatten=True), jd.adam(1e-2))),
    _case("all_reduce_bf16_ring", lambda: optax.chain(jd.all_reduce(dtype=jnp.bfloat16), _sgd())),
    _case("all_reduce_sum", lambda: optax.chain(jd.all_reduce(reduction="sum"), _sgd(0.025))),
    _case("all_reduce+adamw", lambda: optax.chain(jd.all_reduce(), optax.adamw(1e-2, weight_decay=0.1))),
    _case("all_reduce+rmsprop", lambda: optax.chain(jd.all_reduce(), jd.rmsprop(1e-2, weight_decay=0.01))),
    _case("all_reduce+adagrad", lambda: optax.chain(jd.all_reduce(), jd.adagrad(0.05))),
    _case("all_reduce+amsgrad", lambda: optax.chain(jd.all_reduce(), jd.adam(1e-2, amsgrad=True))),
    _case("all_reduce+sign_sgd", lambda: optax.chain(jd.all_reduce(), jd.sign_sgd(1e-3, momentum=0.9))),
    _case(
        "all_reduce+scale_by_momentum",
        lambda: optax.chain(jd.all_reduce(), jd.scale_by_momentum(0.9, nesterov=True), jd.sgd(0.05)),
    ),
    _case("adasum", lambda: optax.chain(jd.adasum(), _sgd()), slow=True),
    _case("adasum_halving", lambda: optax.chain(jd.adasum(method="halving"), _sgd()), slow=True),
    _case("sgd+adasum_deltas", lambda: optax.chain(_sgd(), jd.adasum()), slow=True),
    # Compressors.
    _case("top_k", lambda: optax.chain(jd.top_k(density=0.25), _sgd())),
    _case("top_k_flat", lambda: optax.chain(jd.top_k(100, per_leaf=False), _sgd()), slow=True),
    _case(
        "momentum+top_k",
        lambda: optax.chain(jd.scale_by_momentum(0.9), jd.top_k(density=0.25), jd.sgd(0.05)),
        slow=True,
    ),
    _case("random_k", lambda: optax.chain(jd.random_k(density=0.25), _sgd()), slow=True),
    _case(
        "random_k_subset", lambda: optax.chain(jd.random_k(density=0.25, pattern="subset"), _sgd()), slow=True
    ),
    _case("block_k", lambda: optax.chain(jd.block_k(density=0.25), _sgd())),
    _case("threshold", lambda: optax.chain(jd.threshold(0.01, capacity=24), _sgd()), slow=True),
    _case("sign_majority_vote", lambda: optax.chain(jd.sign_majority_vote(), _sgd(1e-3))),
    _case("scaled_sign", lambda: optax.chain(jd.scaled_sign(), _sgd()), slow=True),
    _case("qsgd", lambda: optax.chain(jd.qsgd(4, bucket_size=64), _sgd())),
    _case(
        "qsgd_all_gather_ef",
        lambda: optax.chain(jd.qsgd(8, aggregate="all_gather", error_feedback=True), _sgd()),
        slow=True,
    ),
    _case("low_bit", lambda: optax.chain(jd.low_bit(block_size=64), _sgd())),
    _case("powersgd", lambda: optax.chain(jd.powersgd(2), _sgd())),
    _case(
        "powersgd_one_allreduce", lambda: optax.chain(jd.powersgd(2, one_allreduce=True), _sgd()), slow=True
    ),
    _case(
        "powersgd_fresh_start_step",
        lambda: optax.chain(jd.powersgd(1, warm_start=False, start_step=2), _sgd()),
        slow=True,
    ),
    # Low-communication optimizers, used alone.
    _case(
        "decoupled_momentum",
        lambda: jd.decoupled_momentum(1e-3, chunk=8, topk=4, weight_decay=0.1),
        slow=True,
    ),
    _case(
        "onebit_adam",
        lambda: jd.onebit_adam(1e-2, freeze_step=2, num_workers=2, weight_decay=0.01),
        slow=True,
    ),
    _case("dim_reduce", _dim_reduce, slow=True),
    # Wrappers.
    _case("accumulate", lambda: jd.accumulate(optax.chain(jd.all_reduce(), _sgd()), every_k=2)),
    _case(
        "dynamic_loss_scale",
        lambda: jd.dynamic_loss_scale(optax.chain(jd.all_reduce(), _sgd()), axis_name="data"),
        loss_scale=jd.loss_scale,
    ),
    _case(
        "apply_if_finite_everywhere",
        lambda: jd.apply_if_finite_everywhere(optax.chain(jd.all_reduce(), _sgd())),
    ),
    _case("master_weights", lambda: jd.master_weights(optax.chain(jd.all_reduce(), jd.adam(1e-2)))),
    _case("iterate_average", lambda: optax.chain(jd.all_reduce(), _sgd(), jd.iterate_average(shift=1.0))),
    _case(
        "mean_value",
        lambda: optax.chain(
            jd.all_reduce(), _sgd(), jd.mean_value(optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
        ),
    ),
    # Per-worker parameters.
    _case("average_params", lambda: optax.chain(_sgd(), jd.average_params()), per_worker=True),
    _case(
        "average_params_local_partial",
        lambda: optax.chain(_sgd(), jd.average_params(every=2, num_partitions=2)),
        per_worker=True,
        slow=True,
    ),
    _case(
        "gossip",
        lambda: optax.chain(_sgd(), jd.gossip("ring", gamma=0.5, track_consensus=True)),
        per_worker=True,
    ),
    _case("choco_block_k", lambda: _choco(jd.block_k(density=0.25)), per_worker=True),
    _case("choco_top_k", lambda: _choco(jd.top_k(density=0.25)), per_worker=True, slow=True),
    _case("choco_qsgd", lambda: _choco(jd.qsgd(8)), per_worker=True, slow=True),
    _case("choco_scaled_sign", lambda: _choco(jd.scaled_sign()), per_worker=True, slow=True),
    _case("diloco", lambda: jd.diloco(optax.adamw(1e-2), sync_every=2), per_worker=True),
    _case(
        "diloco_streaming",
        lambda: jd.diloco(optax.adamw(1e-2), sync_every=4, num_fragments=2, sync_delay=1, mixing=0.5),
        per_worker=True,
        slow=True,
    ),
    _case(
        "diloco_low_bit",
        lambda: jd.diloco(_sgd(), sync_every=2, aggregate=jd.low_bit(block_size=64)),
        per_worker=True,
        slow=True,
    ),
    _case(
        "diloco_powersgd",
        lambda: jd.diloco(_sgd(), sync_every=2, aggregate=jd.powersgd(2)),
        per_worker=True,
        slow=True,
    ),
    # The DiLoCo family and 0/1 Adam (NoLoCo's and DES-LOC's own tests run this check).
    _case("chunked_top_k", lambda: optax.chain(jd.chunked_top_k(4, chunk=8, bits=2), _sgd()), slow=True),
    _case(
        "sparseloco",
        lambda: jd.sparseloco(_sgd(), sync_every=2, topk=4, chunk=8, bits=2),
        per_worker=True,
    ),
    _case(  # 16-row tiles across the 8-row shards of w2
        "sparseloco_tiles_across_shards",
        lambda: jd.sparseloco(_sgd(), sync_every=2, topk=16, chunk=16, bits=2),
        per_worker=True,
        slow=True,
    ),
    _case(
        "muloco",
        lambda: jd.diloco(
            optax.contrib.muon(1e-2, adam_learning_rate=1e-2),
            sync_every=2,
            outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
            aggregate=jd.statistical_quantize(2, error_decay=0.9),
        ),
        per_worker=True,
        slow=True,
    ),
    _case(
        "zero_one_adam",
        lambda: jd.zero_one_adam(1e-2, var_freeze_step=2, num_workers=2, eps=1e-4),
        per_worker=True,
        slow=True,
        # Local Adam steps divide by sqrt(v) + 1e-4 with some v near 0, which magnifies the last-bit
        # differences of the sums over "fsdp" (the 1-bit scales are norms of whole leaves): up to
        # 1.2e-6 beyond rtol after 6 steps, as much without the sharded error buffers after 12.
        atol=2e-6,
    ),
]


@pytest.mark.parametrize("make_tx,per_worker,kw,atol", CASES)
def test_sharded_params_match_replicated(make_tx, per_worker, kw, atol):
    sharded_mesh, replicated_mesh = _meshes()
    got, state = _train(make_tx(), sharded_mesh, SPECS, per_worker, **kw)
    want, _ = _train(make_tx(), replicated_mesh, None, per_worker, **kw)
    rtol = 1e-5
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=rtol, atol=atol, err_msg=k)
    for k, sp in SPECS.items():
        assert _dims(got[k].sharding.spec, got[k].ndim) == _dims(
            P("data", *sp) if per_worker else sp, got[k].ndim
        )
    if not per_worker:
        _check_replicas(got)
    assert _check_state_sharding(state, per_worker) > 0


@pytest.mark.parametrize(
    "make_slow",
    [
        pytest.param(lambda: jd.powersgd(2, axis_name="dcn"), id="powersgd"),
        pytest.param(lambda: jd.top_k(density=0.25, axis_name="dcn"), id="top_k", marks=pytest.mark.slow),
    ],
)
def test_hierarchical_sharded_params_match_replicated(make_slow):
    """Two data axes ("dcn", "ici") and a model axis: a 2 x 2 x 2 mesh against a 2 x 2 data mesh."""
    axes = ("dcn", "ici")

    def make_tx():
        return optax.chain(
            jd.hierarchical(jd.all_reduce(axis_name="ici"), make_slow(), axis_name=axes), _sgd()
        )

    sharded_mesh = jax.make_mesh((2, 2, 2), ("dcn", "ici", "fsdp"))
    replicated_mesh = jax.make_mesh((2, 2), axes, devices=jax.devices()[:4])
    got, state = _train(make_tx(), sharded_mesh, SPECS, False, axis_name=axes)
    want, _ = _train(make_tx(), replicated_mesh, None, False, axis_name=axes)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    _check_replicas(got)
    assert _check_state_sharding(state, False) > 0


@pytest.mark.parametrize(
    "make_tx,per_worker",
    [
        pytest.param(lambda: jd.onebit_adam(1e-2, freeze_step=2, num_workers=2), False, id="onebit_adam"),
        pytest.param(
            lambda: jd.zero_one_adam(1e-2, var_freeze_step=2, num_workers=2), True, id="zero_one_adam"
        ),
    ],
)
def test_flat_error_buffers_are_split_over_the_model_axis(make_tx, per_worker):
    """The per-leaf flat error buffers (padded, no parameter's shape) are split over "fsdp" too:
    params + state per device are a quarter of the replicated run's (only b2's few floats and the
    counters are whole)."""
    sharded_mesh, replicated_mesh = _meshes()
    tx = make_tx()
    step = jd.data_parallel_step(
        _loss, tx, mesh=sharded_mesh, param_specs=SPECS, per_worker_params=per_worker
    )
    params, state = step.init(_params())
    assert type(state).FLAT_BUFFERS == ("worker_error", "server_error")
    buffers = [*state.worker_error, *state.server_error]
    assert len(buffers) == 2 * len(SPECS)
    for x in buffers:
        # Per-worker: stacked over "data", then split along the buffer's one dimension.
        assert x.ndim == 2 and x.sharding.spec == P("data", ("fsdp",)), (x.shape, x.sharding.spec)
        assert {sh.data.shape for sh in x.addressable_shards} == {(1, x.shape[1] // 4)}
    want_p, want_s = step.abstract_init(_params())
    for got, want in zip(jax.tree.leaves((params, state)), jax.tree.leaves((want_p, want_s))):
        assert got.sharding.spec == want.sharding.spec
    replicated = jd.data_parallel_step(_loss, make_tx(), mesh=replicated_mesh, per_worker_params=per_worker)
    quarter = max(helpers.device_bytes(replicated.init(_params())).values()) / 4
    assert quarter <= max(helpers.device_bytes((params, state)).values()) < 1.05 * quarter
