"""The collective layer and the shared argument checks."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import base, comm
from tests import helpers

WORKERS = (1, 2, 3, 8)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", WORKERS)
def test_all_gather_is_replicated_and_ordered(backend, n):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    got = helpers.run_on_workers(lambda v: comm.all_gather(v, "data"), x, backend=backend, replicated=True)
    np.testing.assert_array_equal(got, x)
    tiled = helpers.run_on_workers(lambda v: comm.all_gather(v, "data", tiled=True), x, backend=backend)
    np.testing.assert_array_equal(tiled, x.reshape(-1))


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", WORKERS)
def test_shift_and_axis_index(backend, n):
    x = np.arange(n, dtype=np.float32)[:, None]

    def fn(v):
        return comm.shift(v, "data", 1), comm.axis_index("data"), comm.axis_size("data")

    shifted, idx, size = helpers.run_on_workers(fn, x, backend=backend, replicated=(False, False, True))
    np.testing.assert_array_equal(shifted[:, 0], np.roll(np.arange(n), 1))
    np.testing.assert_array_equal(idx, np.arange(n))
    assert int(size) == n


@pytest.mark.parametrize("backend", helpers.BACKENDS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_exchange_xor_is_a_butterfly(backend, n):
    x = np.arange(n, dtype=np.float32)
    for mask in [1 << s for s in range(int(np.log2(n)))]:
        got = helpers.run_on_workers(
            lambda v: comm.exchange_xor(v, "data", mask), x, backend=backend, replicated=False
        )
        np.testing.assert_array_equal(got, np.arange(n) ^ mask)


def test_permutations_must_be_full():
    with pytest.raises(ValueError, match="every worker once as a source and once as a destination"):
        comm.check_permutation([(0, 1), (1, 2)], 3)
    with pytest.raises(ValueError, match="power-of-two n"):
        comm.xor_permutation(6, 1)
    assert comm.ring_permutation(3, 1) == [(0, 1), (1, 2), (2, 0)]

    def fn(v):
        return comm.ppermute(v, "data", [(0, 1), (1, 0), (2, 2), (3, 0)])

    with pytest.raises(ValueError, match="every worker once"):
        jax.vmap(fn, axis_name="data")(jnp.zeros(4))


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_to_varying_lets_mixed_branches_compile(backend):
    # A cond whose branches return a replicated value and a per-worker one.
    def fn(v):
        mean = comm.pmean(v, "data")
        out = jax.lax.cond(
            jnp.sum(mean) > 0,
            lambda: comm.to_varying(mean, "data"),
            lambda: comm.to_varying(v, "data"),
        )
        return comm.to_varying(out, "data")  # idempotent on varying values

    x = np.array([[1.0], [3.0]], np.float32)
    got = helpers.run_on_workers(fn, x, backend=backend, replicated=False)
    np.testing.assert_array_equal(got, [[2.0], [2.0]])


def test_is_varying_tracks_shard_map_types():
    mesh = helpers.make_mesh(2)
    seen = {}

    def body(v):
        seen["input"] = comm.is_varying(v, "data")
        seen["mean"] = comm.is_varying(comm.pmean(v, "data"), "data")
        seen["gather"] = comm.is_varying(comm.all_gather(v, "data"), "data")
        return v

    x = jax.device_put(jnp.zeros(2), jax.sharding.NamedSharding(mesh, jax.P("data")))
    jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))(x)
    assert seen == {"input": True, "mean": False, "gather": False}


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_flat_reduce_groups_by_dtype(backend):
    tree = {
        "a": np.ones((2, 3), np.float32),
        "b": np.full((2, 2), 2.0, np.float32).astype(jnp.bfloat16),
        "c": np.full((2,), 3.0, np.float32),
    }
    got = helpers.run_on_workers(
        lambda t: comm.reduce(t, "data", reduction="sum", flatten=True), tree, backend=backend
    )
    helpers.assert_dtypes_equal(got, jax.tree.map(lambda x: x[0], tree))
    np.testing.assert_array_equal(np.asarray(got["b"], np.float32), np.full(2, 4.0))
    np.testing.assert_array_equal(got["c"], 6.0)


@pytest.mark.parametrize("backend", helpers.BACKENDS)
def test_all_true(backend):
    flags = np.array([True, True, False])
    got = helpers.run_on_workers(lambda f: comm.all_true(f, "data"), flags, backend=backend)
    assert not bool(got)
    got = helpers.run_on_workers(lambda f: comm.all_true(f, "data"), np.array([True, True]), backend=backend)
    assert bool(got)


def test_tuple_axis_reduces_over_both():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    fn = jax.vmap(
        jax.vmap(lambda v: (comm.psum(v, ("a", "b")), comm.axis_size(("a", "b"))), axis_name="b"),
        axis_name="a",
    )
    total, size = fn(x)
    np.testing.assert_array_equal(total, np.full((2, 3), 15.0))
    assert int(size[0, 0]) == 6


def test_unbound_axis_message():
    with pytest.raises(jd.UnboundAxisError) as e:
        comm.psum(jnp.ones(2), ("node", "local"), caller="adasum")
    msg = str(e.value)
    assert "`adasum` communicates over the axis ('node', 'local')" in msg
    assert "jax.make_mesh((n,), ('node',))" in msg


# ----------------------------------------------------------------------------
# base


def test_validate_axis_name():
    assert base.validate_axis_name("data") == "data"
    assert base.validate_axis_name(("a", "b")) == ("a", "b")
    assert base.validate_axis_name(None, allow_none=True) is None
    with pytest.raises(TypeError, match="got a list"):
        base.validate_axis_name(["a"])
    with pytest.raises(TypeError, match="got a set"):
        base.validate_axis_name({"a"})
    with pytest.raises(ValueError, match="empty tuple"):
        base.validate_axis_name(())
    with pytest.raises(TypeError, match="entries must be hashable names"):
        base.validate_axis_name(("a", ["b"]))


def test_check_hyperparameter_accepts_schedules_and_arrays():
    base.check_hyperparameter(optax.constant_schedule(-1.0), "lr")  # checked at update time only
    base.check_hyperparameter(jnp.asarray(-1.0), "lr")  # inject_hyperparams passes arrays
    with pytest.raises(ValueError, match=r"`lr` must lie in \(0, 1\]"):
        base.check_hyperparameter(0.0, "lr", lower=0.0, upper=1.0, lower_open=True)
    with pytest.raises(TypeError, match="`lr` must be a float or an optax schedule"):
        base.check_hyperparameter(True, "lr")


def test_check_positive_int():
    assert base.check_positive_int(3, "k") == 3
    assert base.check_positive_int(np.int64(3), "k") == 3
    with pytest.raises(TypeError, match="cannot be scheduled or traced"):
        base.check_positive_int(3.0, "k")
    with pytest.raises(ValueError, match=r"`k` must be an int >= 1; got 0"):
        base.check_positive_int(0, "k")


def test_resolve():
    assert base.resolve(0.5, None) == 0.5
    np.testing.assert_allclose(base.resolve(optax.linear_schedule(0.0, 1.0, 10), jnp.asarray(5)), 0.5)
    with pytest.raises(ValueError, match="needs a step count"):
        base.resolve(optax.constant_schedule(1.0), None)


# ----------------------------------------------------------------------------
# Pieces cut at offsets hidden from the compiler (base.pieces and its users).


def _fused_kernels(compiled_text: str) -> tuple[int, int]:
    """(fused computations, distinct ones once their names are set aside) of a compiled HLO text."""
    blocks = re.findall(r"^(%?fused\S*) [^\n]*\{\n(.*?)\n\}", compiled_text, re.M | re.S)
    bodies = {re.sub(r"%[\w.\-]+|\.\d+|metadata=\{[^}]*\}", "", body) for _, body in blocks}
    return len(blocks), len(bodies)


def test_pieces_are_the_slices_and_pieces_of_one_size_share_one_kernel():
    sizes = [12] * 10 + [7] * 10
    x = jnp.arange(sum(sizes), dtype=jnp.float32)
    offsets = np.cumsum([0, *sizes]).tolist()

    def static(x):
        return [jnp.sin(x[a:b]) * 2 for a, b in zip(offsets, offsets[1:])]

    def hidden(x):
        return [jnp.sin(p) * 2 for p in base.cut(x, sizes)]

    for a, b in zip(jax.jit(hidden)(x), jax.jit(static)(x)):
        np.testing.assert_array_equal(a, b)
    if jax.__version_info__ < (0, 12):
        pytest.skip("XLA before jaxlib 0.12 folds constants through an optimization barrier (0.10.0 does)")
    count, distinct = _fused_kernels(jax.jit(hidden).lower(x).compile().as_text())
    assert count == 20 and distinct <= 3, (count, distinct)
    # The check can fail: static offsets give every piece a kernel of its own.
    assert _fused_kernels(jax.jit(static).lower(x).compile().as_text()) == (20, 20)


def test_rows_unpack_and_by_dtype_give_the_plain_values():
    stack = jnp.arange(24.0).reshape(4, 2, 3)
    for r, want in zip(base.rows(stack), stack):
        np.testing.assert_array_equal(r, want)
    wide = jnp.arange(30.0).reshape(3, 10)
    for p, (a, b) in zip(base.cut(wide, [4, 6], axis=1), [(0, 4), (4, 10)]):
        np.testing.assert_array_equal(p, wide[:, a:b])
    flat = jnp.arange(13.0)
    got = base.unpack(flat, [(2, 3), (4,), ()])
    for g, want in zip(got, [flat[:6].reshape(2, 3), flat[6:10], flat[10]]):
        np.testing.assert_array_equal(g, want)
    arrays = [jnp.ones((2, 2)), jnp.arange(3, dtype=jnp.int32), jnp.full((3,), 2.0)]
    doubled = base.by_dtype(arrays, lambda v: v * 2)
    for d, a in zip(doubled, arrays):
        assert d.dtype == a.dtype and d.shape == a.shape
        np.testing.assert_array_equal(d, a * 2)
