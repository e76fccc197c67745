"""Local optimizers against NumPy references of PyTorch / SINGA update rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from tests import helpers

STEPS = 25
SHAPES = {"w": (4, 3), "b": (5,)}


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = helpers.random_tree(rng, SHAPES)
    grads = [helpers.random_tree(rng, SHAPES) for _ in range(STEPS)]
    return params, grads


def _run(tx, params, grads):
    """Applies tx for every step of grads; returns the parameter trajectory."""
    state = tx.init(params)
    update = jax.jit(tx.update)
    traj = []
    p = jax.tree.map(jnp.asarray, params)
    for g in grads:
        u, state = update(g, state, p)
        p = optax.apply_updates(p, u)
        traj.append(p)
    return traj


def _np_run(step_fn, params, grads):
    """step_fn(t, p, g, slots) -> (p, slots); t counts from 0."""
    out = []
    slots: dict = {}
    p = {k: v.astype(np.float64) for k, v in params.items()}
    for t, g in enumerate(grads):
        new_p = {}
        for k in p:
            new_p[k], slots[k] = step_fn(t, p[k], g[k].astype(np.float64), slots.get(k))
        p = new_p
        out.append(p)
    return out


# Schedules: float32 arithmetic in JAX, float64 in NumPy; values stay well inside tolerance.
lr_sched = optax.exponential_decay(0.1, transition_steps=5, decay_rate=0.5, staircase=True)
mom_sched = optax.linear_schedule(0.5, 0.9, transition_steps=20)
damp_sched = optax.linear_schedule(0.0, 0.3, transition_steps=20)
wd_sched = optax.linear_schedule(1e-2, 1e-3, transition_steps=20)
decay_sched = optax.linear_schedule(0.8, 0.95, transition_steps=20)
eps_sched = optax.linear_schedule(1e-3, 1e-6, transition_steps=20)
b1_sched = optax.linear_schedule(0.8, 0.9, transition_steps=20)
b2_sched = optax.linear_schedule(0.99, 0.999, transition_steps=20)


def v(x, t):
    return float(x(t)) if callable(x) else float(x)


def np_sgd(lr, momentum, dampening, wd, nesterov, sign=False):
    def step(t, p, g, buf):
        g = g + v(wd, t) * p
        mu, tau = v(momentum, t), v(dampening, t)
        if momentum != 0.0:
            buf = g.copy() if buf is None else mu * buf + (1 - tau) * g
            d = g + mu * buf if nesterov else buf
        else:
            d = g
        if sign:
            d = np.sign(d)
        return p - v(lr, t) * d, buf

    return step


def np_rmsprop(lr, decay, eps, wd):
    def step(t, p, g, nu):
        g = g + v(wd, t) * p
        nu = np.zeros_like(p) if nu is None else nu
        rho = v(decay, t)
        nu = rho * nu + (1 - rho) * g * g
        return p - v(lr, t) * g / np.sqrt(nu + v(eps, t)), nu

    return step


def np_adagrad(lr, eps, wd, init):
    def step(t, p, g, h):
        g = g + v(wd, t) * p
        h = np.full_like(p, init) if h is None else h
        h = h + g * g
        return p - v(lr, t) * g / np.sqrt(h + v(eps, t)), h

    return step


def np_adam(lr, b1, b2, eps, wd, amsgrad):
    def step(t, p, g, slots):
        g = g + v(wd, t) * p
        if slots is None:
            slots = dict(m=np.zeros_like(p), v=np.zeros_like(p), vmax=np.zeros_like(p), p1=1.0, p2=1.0)
        beta1, beta2 = v(b1, t), v(b2, t)
        m = beta1 * slots["m"] + (1 - beta1) * g
        vv = beta2 * slots["v"] + (1 - beta2) * g * g
        p1 = slots["p1"] * beta1
        p2 = slots["p2"] * beta2
        # Constant betas: PyTorch's 1 - b**t; scheduled: 1 - prod(b_s). Equal for constants.
        bc1, bc2 = 1 - p1, 1 - p2
        vmax = np.maximum(slots["vmax"], vv)
        second = vmax if amsgrad else vv
        upd = (m / bc1) / (np.sqrt(second) / np.sqrt(bc2) + v(eps, t))
        return p - v(lr, t) * upd, dict(m=m, v=vv, vmax=vmax, p1=p1, p2=p2)

    return step


CASES = [
    ("sgd plain", jd.sgd(0.1), np_sgd(0.1, 0.0, 0.0, 0.0, False)),
    ("sgd momentum", jd.sgd(0.05, 0.9), np_sgd(0.05, 0.9, 0.0, 0.0, False)),
    (
        "sgd dampening+wd",
        jd.sgd(0.05, 0.8, dampening=0.2, weight_decay=1e-2),
        np_sgd(0.05, 0.8, 0.2, 1e-2, False),
    ),
    ("sgd nesterov", jd.sgd(0.05, 0.9, nesterov=True), np_sgd(0.05, 0.9, 0.0, 0.0, True)),
    (
        "sgd all scheduled",
        jd.sgd(lr_sched, mom_sched, dampening=damp_sched, weight_decay=wd_sched),
        np_sgd(lr_sched, mom_sched, damp_sched, wd_sched, False),
    ),
    (
        "sgd nesterov scheduled",
        jd.sgd(lr_sched, mom_sched, weight_decay=wd_sched, nesterov=True),
        np_sgd(lr_sched, mom_sched, 0.0, wd_sched, True),
    ),
    ("sign_sgd", jd.sign_sgd(0.01), np_sgd(0.01, 0.0, 0.0, 0.0, False, sign=True)),
    (
        "signum scheduled",
        jd.sign_sgd(lr_sched, mom_sched, dampening=damp_sched, weight_decay=wd_sched),
        np_sgd(lr_sched, mom_sched, damp_sched, wd_sched, False, sign=True),
    ),
    ("rmsprop", jd.rmsprop(0.01), np_rmsprop(0.01, 0.9, 1e-8, 0.0)),
    (
        "rmsprop scheduled",
        jd.rmsprop(lr_sched, decay_sched, eps_sched, weight_decay=wd_sched),
        np_rmsprop(lr_sched, decay_sched, eps_sched, wd_sched),
    ),
    ("adagrad", jd.adagrad(0.1), np_adagrad(0.1, 1e-8, 0.0, 0.0)),
    (
        "adagrad scheduled",
        jd.adagrad(lr_sched, eps_sched, weight_decay=wd_sched, initial_accumulator_value=0.1),
        np_adagrad(lr_sched, eps_sched, wd_sched, 0.1),
    ),
    ("adam", jd.adam(1e-2), np_adam(1e-2, 0.9, 0.999, 1e-8, 0.0, False)),
    (
        "amsgrad+wd",
        jd.adam(1e-2, weight_decay=1e-2, amsgrad=True),
        np_adam(1e-2, 0.9, 0.999, 1e-8, 1e-2, True),
    ),
    (
        "adam scheduled",
        jd.adam(lr_sched, b1_sched, b2_sched, eps_sched, weight_decay=wd_sched, amsgrad=True),
        np_adam(lr_sched, b1_sched, b2_sched, eps_sched, wd_sched, True),
    ),
]


@pytest.mark.parametrize("name,tx,ref", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_reference(name, tx, ref):
    params, grads = _problem()
    got = _run(tx, params, grads)
    want = _np_run(ref, params, grads)
    assert len(got) == STEPS >= 20
    # The sign of a tiny momentum entry can flip under float32 rounding; the
    # trajectories used here stay far from zero, so exact agreement is expected.
    for t in range(STEPS):
        helpers.assert_trees_close(got[t], want[t], rtol=2e-5, atol=2e-6)


def test_sgd_first_step_uses_undamped_gradient():
    # PyTorch initialises the buffer with the gradient itself (no dampening).
    tx = jd.sgd(1.0, 0.9, dampening=0.5)
    p = jnp.zeros(2)
    u, s = tx.update(jnp.ones(2), tx.init(p), p)
    np.testing.assert_array_equal(u, -jnp.ones(2))
    u, s = tx.update(jnp.ones(2), s, p)
    np.testing.assert_allclose(u, -(0.9 + 0.5) * jnp.ones(2))


def test_sgd_matches_optax_sgd_without_dampening():
    params, grads = _problem(1)
    a = _run(jd.sgd(0.05, 0.9, nesterov=True), params, grads)
    b = _run(optax.sgd(0.05, 0.9, nesterov=True), params, grads)
    helpers.assert_trees_close(a[-1], b[-1], rtol=1e-6)


def test_adam_matches_optax_adam():
    params, grads = _problem(2)
    a = _run(jd.adam(1e-2), params, grads)
    b = _run(optax.adam(1e-2), params, grads)
    helpers.assert_trees_close(a[-1], b[-1], rtol=1e-5)


def test_constant_zero_pieces_are_dropped():
    # momentum=0 and weight_decay=0 add no state: plain SGD is stateless apart from the chain.
    state = jd.sgd(0.1).init({"w": jnp.zeros(3)})
    assert all(not isinstance(s, jd.ScaleByMomentumState) for s in state)
    state = jd.sgd(0.1, 0.9).init({"w": jnp.zeros(3)})
    assert any(isinstance(s, jd.ScaleByMomentumState) for s in state)


BAD = [
    (lambda: jd.sgd(-0.1), ValueError, r"`learning_rate` must lie in \[0, inf\)"),
    (lambda: jd.sgd(0.1, -0.5), ValueError, r"`momentum` must lie in \[0, 1\)"),
    (lambda: jd.sgd(0.1, momentum=1.5), ValueError, r"`momentum` must lie in \[0, 1\); got 1.5"),
    (lambda: jd.sgd(0.1, momentum=1.0, dampening=0.5), ValueError, r"`momentum` must lie in \[0, 1\)"),
    (lambda: jd.sign_sgd(0.1, momentum=1.0), ValueError, r"`momentum` must lie in \[0, 1\)"),
    (lambda: jd.scale_by_momentum(2.0), ValueError, r"`momentum` must lie in \[0, 1\)"),
    (lambda: jd.sgd(0.1, 0.9, dampening=1.5), ValueError, r"`dampening` must lie in \[0, 1\]"),
    (lambda: jd.sgd(0.1, 0.9, weight_decay=-1.0), ValueError, r"`weight_decay` must lie"),
    (lambda: jd.sgd(0.1, 0.0, nesterov=True), ValueError, r"Nesterov momentum requires `momentum` > 0"),
    (lambda: jd.sgd(0.1, 0.9, dampening=0.1, nesterov=True), ValueError, r"requires `dampening` == 0"),
    (lambda: jd.sgd("fast"), TypeError, r"`learning_rate` must be a float or an optax schedule"),
    (lambda: jd.sgd(float("nan")), ValueError, r"`learning_rate` must be finite"),
    (lambda: jd.sgd(0.1, nesterov=1), TypeError, r"`nesterov` must be a bool"),
    (lambda: jd.sign_sgd(-1.0), ValueError, r"`learning_rate` must lie"),
    (lambda: jd.rmsprop(0.1, decay=1.5), ValueError, r"`decay` must lie in \[0, 1\]"),
    (lambda: jd.rmsprop(0.1, eps=-1e-8), ValueError, r"`eps` must lie"),
    (
        lambda: jd.adagrad(0.1, initial_accumulator_value=-1.0),
        ValueError,
        r"`initial_accumulator_value` must lie",
    ),
    (lambda: jd.adagrad(0.1, initial_accumulator_value=lambda t: 0.1), TypeError, r"cannot be a schedule"),
    (lambda: jd.adam(0.1, b1=1.0), ValueError, r"`b1` must lie in \[0, 1\)"),
    (lambda: jd.adam(0.1, b2=-0.1), ValueError, r"`b2` must lie in \[0, 1\)"),
    (lambda: jd.adam(0.1, amsgrad="yes"), TypeError, r"`amsgrad` must be a bool"),
]


@pytest.mark.parametrize("make,exc,match", BAD)
def test_bad_inputs(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


FACTORIES = {
    "sgd": lambda: jd.sgd(0.1, 0.9),
    "sign_sgd": lambda: jd.sign_sgd(0.1, 0.9),
    "rmsprop": lambda: jd.rmsprop(0.01),
    "adagrad": lambda: jd.adagrad(0.1),
    "adam": lambda: jd.adam(0.01, amsgrad=True),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_inject_hyperparams(name):
    inner = {
        "sgd": jd.sgd,
        "sign_sgd": jd.sign_sgd,
        "rmsprop": jd.rmsprop,
        "adagrad": jd.adagrad,
        "adam": jd.adam,
    }[name]
    tx = optax.inject_hyperparams(inner)(learning_rate=lr_sched)
    params, grads = _problem(3)
    got = _run(tx, params, grads[:6])
    want = _run(inner(lr_sched), params, grads[:6])
    helpers.assert_trees_close(got[-1], want[-1], rtol=1e-6)
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)
    np.testing.assert_allclose(state.hyperparams["learning_rate"], lr_sched(1), rtol=1e-6)


@pytest.mark.parametrize("name", FACTORIES)
def test_bf16_dtype_stability(name):
    tx = FACTORIES[name]()
    params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(2, jnp.bfloat16)}
    state = tx.init(params)
    dtypes0 = jax.tree.map(lambda x: x.dtype, state)
    for i in range(3):
        grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 + i), params)
        u, state = jax.jit(tx.update)(grads, state, params)
        helpers.assert_dtypes_equal(u, params)
        assert jax.tree.map(lambda x: x.dtype, state) == dtypes0
        params = optax.apply_updates(params, u)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------
# Renamed state classes.


def _states_of(tx, cls):
    state = tx.init({"w": jnp.ones(3)})
    return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls)) if isinstance(s, cls)]


@pytest.mark.parametrize(
    "old, new, factory",
    [
        ("ScaleByAdamState", "AdamState", lambda: jd.adam(0.1, amsgrad=True)),
        ("ScaleByRmsState", "RmspropState", lambda: jd.rmsprop(0.1)),
    ],
)
def test_old_state_class_names_are_deprecated_aliases(old, new, factory):
    new_cls = getattr(jd, new)
    assert new in jd.__all__ and old not in jd.__all__
    assert getattr(optax, new, None) is None  # the new name shadows nothing of optax
    assert len(_states_of(factory(), new_cls)) == 1
    with pytest.warns(
        DeprecationWarning, match=rf"`jaxopt_dist.{old}` is deprecated .* `jaxopt_dist.{new}`"
    ) as rec:
        old_cls = getattr(jd, old)
    assert old_cls is new_cls
    assert rec[0].filename == __file__  # the warning points at the caller
    with pytest.warns(DeprecationWarning, match=old):
        exec(f"from jaxopt_dist import {old}", {})
    with pytest.raises(AttributeError, match="NoSuchState"):
        jd.NoSuchState  # noqa: B018


def test_reshard_rules_of_the_optimizer_states():
    from jaxopt_dist._src import base

    regrouped = {
        jd.ScaleByMomentumState: {"momentum"},
        jd.RmspropState: {"nu"},
        jd.ScaleByAdagradState: {"sum_of_squares"},
        jd.AdamState: {"mu", "nu", "nu_max"},
    }
    for cls, fields in regrouped.items():
        assert base.has_reshard_rules(cls)
        for field in cls._fields:
            assert base.reshard_rule(cls, field) == (base.REGROUP if field in fields else None), field
