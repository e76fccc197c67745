"""all_reduce and average_params against NumPy loops over workers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

SHAPES = {"w": (4, 3), "b": (5,), "s": ()}
WORKERS = (1, 2, 3, 8)


def _worker_grads(n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n, *s)).astype(dtype) for k, s in SHAPES.items()}


def np_all_reduce(grads, *, reduction="mean", wire=None, divide_before=False, denominator=None):
    """Loops over workers; float64 accumulation of values rounded to the wire dtype."""
    out = {}
    for k, g in grads.items():
        n = g.shape[0]
        d = n if denominator is None else denominator
        total = np.zeros(g.shape[1:], np.float64)
        for i in range(n):
            x = g[i]
            if wire is not None:
                x = x.astype(wire)
            if reduction == "mean" and divide_before:
                x = (x / np.asarray(d, x.dtype)).astype(x.dtype)
            total += x.astype(np.float64)
        if reduction == "mean" and not divide_before:
            total = total / d
        out[k] = total
    return out


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", WORKERS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"reduction": "sum"},
        {"flatten": True},
        {"divide_before": True},
        {"dtype": jnp.bfloat16},
        {"dtype": jnp.float16, "divide_before": True, "flatten": True},
    ],
    ids=["mean", "sum", "flatten", "divide_before", "bf16", "fp16-flat-div"],
)
def test_all_reduce_matches_reference(backend, n, kwargs):
    grads = _worker_grads(n)
    got = helpers.run_transform(jd.all_reduce(**kwargs), grads, backend=backend)
    wire = kwargs.get("dtype")
    want = np_all_reduce(
        grads,
        reduction=kwargs.get("reduction", "mean"),
        wire=None if wire is None else np.dtype(wire),
        divide_before=kwargs.get("divide_before", False),
    )
    helpers.assert_dtypes_equal(got, grads)
    # The wire rounding of a low-precision sum depends on the summation order.
    tol = 1e-5 if wire is None else 2e-2
    helpers.assert_trees_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_denominator_extra_arg(backend):
    grads = _worker_grads(4)
    got = helpers.run_transform(jd.all_reduce(), grads, backend=backend, denominator=10.0)
    helpers.assert_trees_close(got, np_all_reduce(grads, denominator=10.0))


def test_bf16_wire_rounds_each_contribution():
    # Values that bf16 cannot hold: the result shows the wire rounding, then comes back as float32.
    grads = {"x": np.full((2, 3), 1.0 + 2.0**-10, np.float32)}
    got = helpers.run_transform(jd.all_reduce(dtype=jnp.bfloat16), grads, backend="vmap")
    assert got["x"].dtype == jnp.float32
    np.testing.assert_array_equal(got["x"], np.ones(3, np.float32))
    exact = helpers.run_transform(jd.all_reduce(), grads, backend="vmap")
    np.testing.assert_array_equal(exact["x"], np.full(3, 1.0 + 2.0**-10, np.float32))


def test_fp16_divide_before_avoids_overflow():
    grads = {"x": np.full((8, 2), 20000.0, np.float32)}  # sum 160000 > fp16 max 65504
    after = helpers.run_transform(jd.all_reduce(dtype=jnp.float16), grads, backend="vmap")
    before = helpers.run_transform(
        jd.all_reduce(dtype=jnp.float16, divide_before=True), grads, backend="vmap"
    )
    assert np.all(np.isinf(after["x"]))
    np.testing.assert_allclose(before["x"], 20000.0, rtol=1e-3)


def _lowered(tx, n):
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    fn, grads = helpers.update_program(tx, params, n)
    return jax.jit(fn).lower(grads)


def _hlo_for(tx, n):
    return _lowered(tx, n).compile().as_text()


def test_flatten_issues_exactly_one_collective():
    # The native all-reduce (on CPU the default for 16-bit wires is the bitcast ring, tested below).
    text = _hlo_for(jd.all_reduce(flatten=True, dtype=jnp.bfloat16, bitcast_ring=False), 8)
    assert helpers.count_collectives(text) == {"all-reduce": 1}
    # One operand: the packed buffer of all 4*3 + 5 + 1 = 18 values. XLA:CPU widens
    # bf16 reductions to f32 internally, so read the wire dtype off the lowered program.
    (line,) = [ln for ln in text.splitlines() if " all-reduce(" in ln or " all-reduce-start(" in ln]
    assert "[18]" in line
    lowered = _lowered(jd.all_reduce(flatten=True, dtype=jnp.bfloat16, bitcast_ring=False), 8).as_text()
    assert lowered.count("stablehlo.all_reduce") == 1
    assert "(tensor<18xbf16>) -> tensor<18xbf16>" in lowered


def test_per_leaf_reduction_sends_each_leaf():
    text = _hlo_for(jd.all_reduce(flatten=False), 8)
    counts = helpers.count_collectives(text)
    assert set(counts) == {"all-reduce"}
    lines = [ln for ln in text.splitlines() if " all-reduce(" in ln or " all-reduce-start(" in ln]
    joined = " ".join(lines)
    # XLA may fuse the per-leaf reductions into one variadic op; every leaf is an operand either way.
    for shape in ("f32[4,3]", "f32[5]", "f32[]"):
        assert shape in joined


def test_default_packs_leaves_on_cpu_across_processes_only(monkeypatch):
    """flatten=None: one buffer on CPU when there are several processes, per leaf otherwise."""
    from jaxopt_dist._src import comm

    def operands():
        text = _hlo_for(jd.all_reduce(), 8)
        lines = [ln for ln in text.splitlines() if " all-reduce(" in ln or " all-reduce-start(" in ln]
        return " ".join(lines)

    assert jax.default_backend() == "cpu" and jax.process_count() == 1 and not comm.flatten_by_default()
    assert "f32[4,3]" in operands() and "f32[18]" not in operands()
    monkeypatch.setattr(jax, "process_count", lambda *a: 2)
    assert comm.flatten_by_default()
    assert "f32[18]" in operands() and "f32[4,3]" not in operands()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not comm.flatten_by_default()


def test_all_reduce_bad_inputs():
    with pytest.raises(ValueError, match=r"`reduction` must be 'mean' or 'sum'"):
        jd.all_reduce(reduction="max")
    with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype"):
        jd.all_reduce(dtype=jnp.int8)
    with pytest.raises(TypeError, match=r"`flatten` must be None or a bool"):
        jd.all_reduce(flatten=1)
    with pytest.raises(ValueError, match=r"only applies to reduction='mean'"):
        jd.all_reduce(reduction="sum", divide_before=True)
    with pytest.raises(TypeError, match=r"`axis_name` must be a hashable name or a tuple"):
        jd.all_reduce(axis_name=["data"])
    with pytest.raises(ValueError, match=r"`axis_name` must name the mapped axis"):
        jd.all_reduce(axis_name=None)
    tx = jd.all_reduce(reduction="sum")
    with pytest.raises(ValueError, match=r"`denominator` extra argument only applies"):
        jax.vmap(lambda g: tx.update(g, tx.init(g), denominator=2.0)[0], axis_name="data")(jnp.ones((2, 3)))


def test_unbound_axis_error_names_axis_and_fix():
    tx = jd.all_reduce(axis_name="batch")
    with pytest.raises(jd.UnboundAxisError, match=r"axis 'batch', which is not bound") as e:
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)))
    msg = str(e.value)
    assert "jax.shard_map" in msg and "jax.pmap(..., axis_name='batch')" in msg and "jax.vmap" in msg
    # Bound under another name: still our error, not JAX's bare one.
    with pytest.raises(jd.UnboundAxisError, match="`all_reduce`"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(jnp.ones((2, 3)))
    assert issubclass(jd.UnboundAxisError, NameError)


# ----------------------------------------------------------------------------
# average_params


def np_average_params(grads_seq, params0, lr, every, groups):
    """Local SGD steps with round-robin averaging of leaf groups; loops over workers."""
    T, n = grads_seq["w"].shape[:2]
    keys = sorted(params0)  # jax.tree.leaves order of a dict
    p = [{k: params0[k].astype(np.float64).copy() for k in keys} for _ in range(n)]
    history = []
    for t in range(T):
        for i in range(n):
            for k in keys:
                p[i][k] = p[i][k] - lr * grads_seq[k][t, i]
        if t % every == every - 1:
            group = groups[(t // every) % len(groups)]
            for j in group:
                k = keys[j]
                mean = sum(p[i][k] for i in range(n)) / n
                for i in range(n):
                    p[i][k] = mean.copy()
        history.append([{k: v.copy() for k, v in pi.items()} for pi in p])
    return history


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", WORKERS)
@pytest.mark.parametrize("every,num_partitions", [(1, 1), (3, 1), (1, 3), (2, 2)])
def test_average_params_matches_reference(backend, n, every, num_partitions):
    rng = np.random.default_rng(n)
    T = 7
    grads = {k: rng.standard_normal((T, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    tx = optax.chain(jd.sgd(0.1), jd.average_params(every=every, num_partitions=num_partitions))
    _, params, _ = helpers.run_steps(tx, grads, params0, backend=backend, per_worker_params=True)
    groups = jd.partition_leaves(params0, num_partitions)
    want = np_average_params(grads, params0, 0.1, every, groups)[-1]
    got = [{k: np.asarray(params[k])[i] for k in SHAPES} for i in range(n)]
    for i in range(n):
        helpers.assert_trees_close(got[i], want[i], rtol=1e-5, atol=1e-6)


def test_average_params_every_step_keeps_replicas_identical():
    rng = np.random.default_rng(0)
    grads = {k: rng.standard_normal((5, 8, *s)).astype(np.float32) for k, s in SHAPES.items()}
    params0 = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    tx = optax.chain(jd.sgd(0.1, 0.9), jd.average_params())
    _, params, _ = helpers.run_steps(tx, grads, params0, backend="shard_map", per_worker_params=True)
    helpers.assert_replicas_equal(params)


def test_local_sgd_averages_only_on_sync_steps():
    n = 2
    grads = {"w": np.stack([np.ones((6, 3)), -np.ones((6, 3))], axis=1).astype(np.float32)}
    tx = optax.chain(jd.sgd(1.0), jd.average_params(every=3))
    updates, params, _ = helpers.run_steps(
        tx, grads, {"w": np.zeros(3, np.float32)}, backend="vmap", per_worker_params=True
    )
    # Steps 0 and 1 are local (worker 0 moves -1, worker 1 moves +1); step 2 averages back to 0.
    np.testing.assert_array_equal(updates["w"][0, :, 0], [-1.0, 1.0])
    np.testing.assert_array_equal(updates["w"][1, :, 0], [-1.0, 1.0])
    np.testing.assert_array_equal(updates["w"][2, :, 0], [2.0, -2.0])
    np.testing.assert_array_equal(params["w"][:, 0], [0.0, 0.0])
    assert n == params["w"].shape[0]


def test_partition_leaves_balanced_and_contiguous():
    params = {"a": np.zeros(100), "b": np.zeros(10), "c": np.zeros(90), "d": np.zeros(5), "e": np.zeros(95)}
    groups = jd.partition_leaves(params, 3)
    assert [i for g in groups for i in g] == list(range(5))
    assert all(g for g in groups)
    sizes = [sum(jax.tree.leaves(params)[i].size for i in g) for g in groups]
    assert max(sizes) <= 2 * (300 / 3)
    assert jd.partition_leaves(params, 5) == [[0], [1], [2], [3], [4]]


def test_average_params_bad_inputs():
    with pytest.raises(ValueError, match=r"`every` must be an int >= 1"):
        jd.average_params(every=0)
    with pytest.raises(TypeError, match=r"`num_partitions` must be a Python int"):
        jd.average_params(num_partitions=2.0)
    with pytest.raises(ValueError, match=r"`num_partitions`=4 exceeds the number of parameter leaves \(3\)"):
        jd.partition_leaves({"a": 1.0, "b": 2.0, "c": 3.0}, 4)
    tx = jd.average_params()
    with pytest.raises(ValueError, match=r"`average_params` needs `params`: call it as"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(jnp.ones((2, 3)))
    with pytest.raises(jd.UnboundAxisError, match="average_params"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)), jnp.ones(3))


# ----------------------------------------------------------------------------
# 16-bit wire through the bitcast ring (the default on CPU).


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_bitcast_ring_equals_native_for_two_workers(backend, dtype):
    """Two workers: one float32 addition rounded once, as the native 16-bit all-reduce."""
    grads = _worker_grads(2, seed=4)
    ring = helpers.run_transform(jd.all_reduce(dtype=dtype, bitcast_ring=True), grads, backend=backend)
    native = helpers.run_transform(jd.all_reduce(dtype=dtype, bitcast_ring=False), grads, backend=backend)
    helpers.assert_trees_equal(ring, native)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", (3, 8))
def test_bitcast_ring_sums_in_ring_order(backend, n):
    """Chunk c is summed x_c + x_{c+1} + ... (mod n), rounded to bf16 after each addition."""
    grads = _worker_grads(n, seed=n)
    got = helpers.run_transform(
        jd.all_reduce(dtype=jnp.bfloat16, bitcast_ring=True, reduction="sum", flatten=True),
        grads,
        backend=backend,
    )
    leaves = [grads[k] for k in sorted(grads)]  # jax.tree.leaves order
    flat = np.concatenate([x.reshape(n, -1) for x in leaves], axis=1).astype(jnp.bfloat16)
    size = flat.shape[1]
    chunk = -(-size // n)
    want = np.zeros(chunk * n, np.float32)
    for c in range(n):
        for j in range(chunk * c, min(chunk * (c + 1), size)):
            acc = flat[c, j]
            for step in range(1, n):
                acc = (np.float32(acc) + np.float32(flat[(c + step) % n, j])).astype(jnp.bfloat16)
            want[j] = np.float32(acc)
    offsets = np.cumsum([0] + [math.prod(x.shape[1:]) for x in leaves])
    for i, k in enumerate(sorted(grads)):
        np.testing.assert_array_equal(np.asarray(got[k]).reshape(-1), want[offsets[i] : offsets[i + 1]])


def test_bitcast_ring_sends_16_bits():
    text = _hlo_for(jd.all_reduce(dtype=jnp.bfloat16), 8)  # default on CPU: the ring
    counts = helpers.count_collectives(text)
    assert "all-reduce" not in counts
    assert counts == {"collective-permute": 7, "all-gather": 1}
    shapes = [m.group("shape") for m in helpers._COLLECTIVE_RE.finditer(text)]
    assert len(shapes) == 8 and all(sh.startswith("u16[") for sh in shapes), shapes


def test_bitcast_ring_bad_argument():
    with pytest.raises(TypeError, match="`bitcast_ring` must be None or a bool"):
        jd.all_reduce(dtype=jnp.bfloat16, bitcast_ring="yes")
