"""Test harness: run transforms on simulated workers, compare trees, read compiled HLO.

Two backends run the same per-worker code:

* ``"vmap"``: ``jax.vmap(..., axis_name=axis)`` on one device. Fast. Outputs
  that should be replicated are checked bit-identical across workers at run
  time.
* ``"shard_map"``: inputs are placed on a ``jax.make_mesh((n,), (axis,))``
  mesh and the function runs under ``jax.shard_map(check_vma=True)``.
  Replicated outputs use ``out_specs=P()``, so JAX proves statically that
  they are the same on every worker; per-worker outputs use ``P(axis)``.

Inputs and per-worker outputs are stacked: leading axis = worker.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import socket
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxopt_dist as jd
from jaxopt_dist._src import comm

P = jax.sharding.PartitionSpec
BACKENDS = ("vmap", "shard_map")
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------
# Tree assertions.


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


def assert_trees_close(actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Leafwise ``np.testing.assert_allclose`` with the leaf path in the message."""
    a_leaves, b_leaves = _leaves_with_paths(actual), _leaves_with_paths(expected)
    assert len(a_leaves) == len(b_leaves), f"different number of leaves: {len(a_leaves)} vs {len(b_leaves)}"
    for (path, a), (_, b) in zip(a_leaves, b_leaves):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol, err_msg=f"leaf {path}"
        )


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Bitwise equality (same dtype, shape and bits) of every leaf."""
    a_leaves, b_leaves = _leaves_with_paths(actual), _leaves_with_paths(expected)
    assert len(a_leaves) == len(b_leaves), f"different number of leaves: {len(a_leaves)} vs {len(b_leaves)}"
    for (path, a), (_, b) in zip(a_leaves, b_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"leaf {path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"leaf {path}: shape {a.shape} != {b.shape}"
        assert a.tobytes() == b.tobytes(), f"leaf {path}: values differ\n{a}\n{b}"


def assert_replicas_equal(stacked: Any) -> None:
    """Every worker's row is bit-identical to worker 0's."""
    for path, x in _leaves_with_paths(stacked):
        x = np.asarray(x)
        for i in range(1, x.shape[0]):
            assert x[i].tobytes() == x[0].tobytes(), f"leaf {path}: worker {i} differs from worker 0"


def assert_dtypes_equal(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), (_, y) in zip(_leaves_with_paths(a), _leaves_with_paths(b)):
        assert jnp.result_type(x) == jnp.result_type(y), (
            f"leaf {path}: {jnp.result_type(x)} != {jnp.result_type(y)}"
        )


# ----------------------------------------------------------------------------
# Running on workers.


def make_mesh(n: int, axis_name: str = "data") -> jax.sharding.Mesh:
    if jax.device_count() < n:
        import pytest

        pytest.skip(f"needs {n} devices, have {jax.device_count()}")
    return jax.make_mesh((n,), (axis_name,), devices=jax.devices()[:n])


def num_workers(stacked: Any) -> int:
    return int(np.shape(jax.tree.leaves(stacked)[0])[0])


def run_on_workers(
    fn: Callable[..., Any],
    *stacked_args: Any,
    backend: str,
    axis_name: str = "data",
    replicated: Any = True,
    shared: tuple[Any, ...] = (),
) -> Any:
    """Runs ``fn(*args_of_worker_i, *shared)`` on every worker ``i`` and returns its outputs.

    Args:
      fn: per-worker function; may use collectives on ``axis_name``.
      *stacked_args: pytrees whose leaves have a leading worker axis.
      backend: ``"vmap"`` or ``"shard_map"``.
      axis_name: the axis name bound for ``fn``.
      replicated: a bool, or a pytree prefix of the outputs with bools: True
        for outputs that must be the same on every worker. They are returned
        once (no worker axis); False outputs are returned stacked.
      shared: extra arguments given whole to every worker (replicated inputs:
        ``in_axes=None`` under vmap, ``P()`` under shard_map).

    Returns:
      The outputs, as described.
    """
    n = num_workers(stacked_args)
    k = len(stacked_args)
    if backend == "vmap":
        in_axes = (0,) * k + (None,) * len(shared)
        out = jax.jit(jax.vmap(fn, in_axes=in_axes, axis_name=axis_name))(*stacked_args, *shared)
        rep = _broadcast_prefix(replicated, out)

        def pick(r, x):
            if r:
                assert_replicas_equal(x)
                return x[0]
            return x

        return jax.tree.map(pick, rep, out)
    if backend == "shard_map":
        mesh = make_mesh(n, axis_name)
        sharded = jax.sharding.NamedSharding(mesh, P(axis_name))
        args = jax.device_put(stacked_args, sharded)
        shared_args = jax.device_put(shared, jax.sharding.NamedSharding(mesh, P()))
        in_axes = (0,) * k + (None,) * len(shared)
        out_shape = jax.eval_shape(jax.vmap(fn, in_axes=in_axes, axis_name=axis_name), *stacked_args, *shared)
        rep = _broadcast_prefix(replicated, out_shape)
        out_specs = jax.tree.map(lambda r: P() if r else P(axis_name), rep)

        def body(*args):
            local = jax.tree.map(lambda x: x[0], args[:k])
            out = fn(*local, *args[k:])
            return jax.tree.map(lambda r, x: x if r else x[None], _broadcast_prefix(replicated, out), out)

        in_specs = (P(axis_name),) * k + (P(),) * len(shared)
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
        return jax.block_until_ready(jax.jit(mapped)(*args, *shared_args))
    raise ValueError(f"unknown backend {backend!r}")


def _broadcast_prefix(prefix: Any, tree: Any) -> Any:
    """Expands a pytree prefix of bools to the full structure of ``tree``."""
    if isinstance(prefix, bool):
        return jax.tree.map(lambda _: prefix, tree)
    return jax.tree.map(
        lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, tree, is_leaf=lambda x: isinstance(x, bool)
    )


def run_transform(
    tx: optax.GradientTransformation,
    grads: Any,
    *,
    backend: str,
    params: Any = None,
    axis_name: str = "data",
    replicated: bool = True,
    **extra_args: Any,
) -> Any:
    """One ``tx.update`` on stacked per-worker ``grads`` from a fresh state; returns the updates.

    ``params`` (one copy, default zeros like a worker's grads) is the same on
    every worker. ``replicated`` says whether the updates must be identical
    on every worker.
    """
    if params is None:
        params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)

    def fn(g, p):
        updates, _ = tx.update(g, tx.init(p), p, **extra_args)
        return updates

    return run_on_workers(
        fn, grads, backend=backend, axis_name=axis_name, replicated=replicated, shared=(params,)
    )


def run_steps(
    tx: optax.GradientTransformation,
    grads_seq: Any,
    params: Any,
    *,
    backend: str,
    axis_name: str = "data",
    per_worker_params: bool = False,
    extra_args_fn: Callable[[int, Any], dict[str, Any]] | None = None,
) -> tuple[Any, Any, Any]:
    """Runs ``T`` steps of ``tx`` on per-worker gradients, applying the updates.

    Args:
      tx: the transformation.
      grads_seq: leaves shaped ``(T, n, ...)``: step, worker, then the param shape.
      params: one copy of the parameters (every worker starts from it).
      backend: ``"vmap"`` or ``"shard_map"``.
      axis_name: the data axis.
      per_worker_params: parameters differ between workers (``average_params``).
        Otherwise the updates must be replicated: checked bitwise (vmap) or
        proven by ``out_specs=P()`` (shard_map).
      extra_args_fn: ``(t, local_params) -> extra args`` for step ``t``.

    Returns:
      ``(updates, params, state)``: updates of every step (leaves ``(T, ...)``,
      or ``(T, n, ...)`` when ``per_worker_params``), the final params (one copy,
      or stacked), and the final state stacked per worker (every leaf ``(n, ...)``).
    """
    leaves = jax.tree.leaves(grads_seq)
    T, n = int(leaves[0].shape[0]), int(leaves[0].shape[1])
    per_step = extra_args_fn is not None  # step-dependent extras: one compilation per step
    extra_args_fn = extra_args_fn or (lambda t, p: {})
    if backend == "vmap":
        return _run_steps_vmap(
            tx, grads_seq, params, T, n, axis_name, per_worker_params, extra_args_fn, per_step
        )
    if backend == "shard_map":
        return _run_steps_shard_map(
            tx, grads_seq, params, T, n, axis_name, per_worker_params, extra_args_fn, per_step
        )
    raise ValueError(f"unknown backend {backend!r}")


def _run_steps_vmap(tx, grads_seq, params, T, n, axis_name, per_worker_params, extra_args_fn, per_step):
    stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), t)  # noqa: E731
    p = stack(params)
    state = jax.vmap(tx.init)(p)
    all_updates = []
    cache: dict = {}
    for t in range(T):
        g = jax.tree.map(lambda x: x[t], grads_seq)

        def step(g, s, p, t=t):
            u, s = tx.update(g, s, p, **extra_args_fn(t, p))
            return u, s, optax.apply_updates(p, u)

        key = t if per_step else 0
        if key not in cache:
            cache[key] = jax.jit(jax.vmap(step, axis_name=axis_name))
        u, state, p = cache[key](g, state, p)
        if not per_worker_params:
            assert_replicas_equal(u)
            assert_replicas_equal(p)
            u = jax.tree.map(lambda x: x[0], u)
        all_updates.append(u)
    updates = jax.tree.map(lambda *xs: jnp.stack(xs), *all_updates)
    final_p = p if per_worker_params else jax.tree.map(lambda x: x[0], p)
    return updates, final_p, state


def _run_steps_shard_map(tx, grads_seq, params, T, n, axis_name, per_worker_params, extra_args_fn, per_step):
    mesh = make_mesh(n, axis_name)
    placement = jd.opt_state_placement(
        tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params
    )
    mask = placement.per_worker
    if placement.updates_per_worker and not per_worker_params:
        raise AssertionError("the transform's updates are typed per-worker; expected replicated updates")
    state = jd.init_opt_state(tx, params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params)
    p = jd.place_params(params, mesh=mesh, axis_name=axis_name, per_worker_params=per_worker_params)
    spec = P(axis_name)
    s_spec = jax.tree.map(lambda m: spec if m else P(), mask)
    p_spec = jax.tree.map(lambda _: spec if per_worker_params else P(), params)
    u_spec = p_spec
    all_updates = []
    cache: dict = {}
    for t in range(T):
        g = jax.device_put(jax.tree.map(lambda x: x[t], grads_seq), jax.sharding.NamedSharding(mesh, spec))

        def body(g, s, p, t=t):
            g = jax.tree.map(lambda x: x[0], g)
            s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
            p = jax.tree.map(lambda x: x[0], p) if per_worker_params else p
            u, s = tx.update(g, s, p, **extra_args_fn(t, p))
            new_p = optax.apply_updates(p, u)
            restack = (lambda x: x[None]) if per_worker_params else (lambda x: x)
            return (
                jax.tree.map(restack, u),
                jax.tree.map(lambda x, m: x[None] if m else x, s, mask),
                jax.tree.map(restack, new_p),
            )

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: spec, g), s_spec, p_spec),
            out_specs=(u_spec, s_spec, p_spec),
            check_vma=True,
        )
        key = t if per_step else 0
        if key not in cache:
            cache[key] = jax.jit(mapped)
        u, state, p = cache[key](g, state, p)
        # XLA:CPU can deadlock with dozens of collective programs queued: wait for each step.
        jax.block_until_ready(u)
        all_updates.append(u)
    updates = jax.tree.map(lambda *xs: jnp.stack(xs), *all_updates)
    full_state = jax.tree.map(lambda x, m: x if m else jnp.broadcast_to(x, (n, *x.shape)), state, mask)
    return updates, p, full_state


def scan_steps(tx, grads_seq, params, *, backend, axis_name="data", mask=None):
    """``T`` steps of ``tx`` (updates applied) inside one jit, via ``lax.scan``.

    ``grads_seq`` leaves are ``(T, n, ...)``. Returns ``(updates (T, ...),
    final params, final state stacked (n, ...))``. The updates and params are
    checked bit-identical on every worker (vmap) or proven replicated by
    ``out_specs=P()`` (shard_map), as in ``helpers.run_steps``, but with one
    compilation instead of one per step. ``mask`` (per-worker state leaves)
    defaults to ``jd.opt_state_placement``'s.
    """
    n = int(jax.tree.leaves(grads_seq)[0].shape[1])

    def steps(gs, s, p):
        def body(carry, g):
            s, p = carry
            u, s = tx.update(g, s, p)
            return (s, optax.apply_updates(p, u)), u

        (s, p), us = jax.lax.scan(body, (s, p), gs)
        return us, p, s

    if backend == "vmap":
        p = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), params)
        s = jax.vmap(tx.init)(p)
        us, p, s = jax.jit(jax.vmap(steps, in_axes=(1, 0, 0), axis_name=axis_name))(grads_seq, s, p)
        assert_replicas_equal(us)
        assert_replicas_equal(p)
        return jax.tree.map(lambda x: x[0], us), jax.tree.map(lambda x: x[0], p), s
    mesh = make_mesh(n, axis_name)
    if mask is None:
        mask = jd.opt_state_placement(tx, params, mesh=mesh, axis_name=axis_name).per_worker
    spec = P(axis_name)
    state = jax.tree.map(
        lambda x, m: jax.device_put(
            jnp.broadcast_to(x, (n, *x.shape)) if m else x,
            jax.sharding.NamedSharding(mesh, spec if m else P()),
        ),
        tx.init(params),
        mask,
    )
    p = jd.place_params(params, mesh=mesh, axis_name=axis_name)
    s_spec = jax.tree.map(lambda m: spec if m else P(), mask)

    def body(gs, s, p):
        gs = jax.tree.map(lambda x: x[:, 0], gs)
        s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
        us, p, s = steps(gs, s, p)
        return us, p, jax.tree.map(lambda x, m: x[None] if m else x, s, mask)

    g_spec = jax.tree.map(lambda _: P(None, axis_name), grads_seq)
    gs = jax.device_put(grads_seq, jax.tree.map(lambda sp_: jax.sharding.NamedSharding(mesh, sp_), g_spec))
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(g_spec, s_spec, jax.tree.map(lambda _: P(), params)),
        out_specs=(jax.tree.map(lambda _: P(), params), jax.tree.map(lambda _: P(), params), s_spec),
        check_vma=True,
    )
    us, p, state = jax.jit(mapped)(gs, state, p)
    state = jax.tree.map(lambda x, m: x if m else jnp.broadcast_to(x, (n, *x.shape)), state, mask)
    return us, p, state


# ----------------------------------------------------------------------------
# Compiled HLO.


def update_program(tx, params, n, *, with_params=False):
    """``(f, grads)``: one ``tx.update`` from a fresh state on ``n`` workers under shard_map
    (replicated output), and stacked per-worker gradients (ones) placed for it.

    ``with_params=True``: ``f(grads, params)`` passes the (replicated) ``params`` to ``init`` and
    ``update``, and stacks the outputs per worker.
    """
    mesh = make_mesh(n)
    g = jax.device_put(
        jax.tree.map(lambda x: jnp.ones((n, *x.shape), x.dtype), params),
        jax.sharding.NamedSharding(mesh, P("data")),
    )
    if with_params:

        def body_p(g, p):
            g = jax.tree.map(lambda x: x[0], g)
            return jax.tree.map(lambda x: x[None], tx.update(g, tx.init(p), p)[0])

        specs = {"in_specs": (P("data"), P()), "out_specs": P("data")}
        return jax.shard_map(body_p, mesh=mesh, check_vma=True, **specs), g

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(g))[0]

    return jax.shard_map(body, mesh=mesh, in_specs=(P("data"),), out_specs=P(), check_vma=True), g


def traced_collectives(tx, params, n, *, with_params=False):
    """(primitive name, bytes of the local operand) of every collective in one update under shard_map."""
    f, g = update_program(tx, params, n, with_params=with_params)
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name.startswith(("psum", "all_gather", "pmax", "pmin", "ppermute", "reduce_scatter")):
                found.append((name, sum(comm.tree_bytes(v.aval) for v in e.invars)))
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(f)(g, params).jaxpr if with_params else jax.make_jaxpr(f)(g).jaxpr)
    return found


_COLLECTIVE_RE = re.compile(
    r"=\s*(?P<shape>\S.*?)\s(?P<op>all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(?:-start)?\("
)


def compiled_text(fn: Callable[..., Any], *args: Any) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Number of collective ops of each kind in compiled HLO text."""
    counts: dict[str, int] = {}
    for m in _COLLECTIVE_RE.finditer(hlo_text):
        counts[m.group("op")] = counts.get(m.group("op"), 0) + 1
    return counts


def check_bf16_contract(tx: Any, params: Any, *, steps: int, workers: int = 2, replicated: bool = False):
    """The optax contract on bf16 params under ``vmap``: ``eval_shape`` init, unknown extra args,
    one compilation over ``steps`` steps, updates in the params' dtypes, state dtypes stable.

    Returns the final ``(state, params)`` (stacked); ``replicated``: updates bit-identical on workers.
    """
    abstract = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    assert jax.tree.structure(abstract) == jax.tree.structure(tx.init(params))
    traces = []

    def step(g, s, p):
        traces.append(1)
        u, s = tx.update(g, s, p, unknown_extra=jnp.ones(()), another=None)
        return u, s, optax.apply_updates(p, u)

    run = jax.jit(jax.vmap(step, axis_name="data"))
    p = jax.tree.map(lambda x: jnp.stack([x] * workers), params)
    s = jax.vmap(tx.init)(p)
    dtypes = jax.tree.map(lambda x: x.dtype, s)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16), p)
        u, s, p = run(g, s, p)
        assert_dtypes_equal(u, p)
        if replicated:
            assert_replicas_equal(u)
        assert jax.tree.map(lambda x: x.dtype, s) == dtypes
    assert len(traces) == 1
    return s, p


def grads_seq(seed: int, T: int, n: int, shapes: dict[str, tuple[int, ...]], *, zeros: bool = False) -> dict:
    """Random float32 gradients shaped ``(T, n, *shape)``; ``zeros`` blanks about 20% of entries."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        x = rng.standard_normal((T, n, *shape)).astype(np.float32)
        if zeros:
            x[rng.random(x.shape) < 0.2] = 0.0
        out[name] = x
    return out


def zeros(shapes: dict[str, tuple[int, ...]]) -> dict:
    return {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}


def random_tree(
    rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], dtype=np.float32
) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


# ----------------------------------------------------------------------------
# Shared randomness schedule.

_STEP_KEYS: dict[int, list] = {}


def step_key(seed: int, t: int) -> jax.Array:
    """The key a transform with a seeded state key uses at step ``t``.

    The documented schedule: the state key starts as ``PRNGKey(seed)`` and is
    split into ``(next_key, step_key)`` at every step.
    """
    keys = _STEP_KEYS.setdefault(seed, [])
    key = keys[-1][0] if keys else jax.random.PRNGKey(seed)
    while len(keys) <= t:
        key, sub = jax.random.split(key)
        keys.append((key, sub))
    return keys[t][1]


# ----------------------------------------------------------------------------
# Examples and child processes.


def load_example(name: str) -> Any:
    """Imports ``examples/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def child_env(devices: int | None = None) -> dict[str, str]:
    """The environment for a child Python process: CPU only, this checkout importable.

    This process's simulated device count is dropped (conftest sets 8); with
    ``devices`` the child gets that many, otherwise it chooses itself.
    """
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a child job's coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_bytes(tree):
    """Bytes of the shards of ``tree``'s arrays that each device holds, by device."""
    out: dict = {}
    for x in jax.tree.leaves(tree):
        for sh in x.addressable_shards:
            out[sh.device] = out.get(sh.device, 0) + sh.data.nbytes
    return out


def device_shards(x):
    """The per-device pieces of a placed array, as NumPy arrays."""
    return [np.asarray(s.data) for s in x.addressable_shards]


def assert_replicated_shards(x):
    """Every device holds the same bits of ``x``."""
    shards = device_shards(x)
    for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])
