"""communication_cost against each transform's documented formula and against compiled HLO.

What is compared with the HLO: the collectives that ``jax.jit(...).lower(...).compile()``
of one update under ``jax.shard_map`` on 8 CPU devices contains, summed per collective
kind (payload elements, and bytes where the dtype is unchanged), against
``cost.sites`` (every collective of the traced update, every branch counted once).
XLA may merge several collectives into one variadic op or split one, so totals
are compared, not op counts. XLA:CPU runs 16-bit all-reduces in float32, which
the bf16 case checks explicitly.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import communication_cost, hlo_collectives, powersgd, project_step_time
from jaxopt_dist._src import comm
from jaxopt_dist._src.accounting import costs, projection, walk
from tests import helpers

P = jax.sharding.PartitionSpec
N = 8
SHAPES = {"w": (16, 8), "b": (8,), "c": (2, 3, 8)}  # leaves order: b, c, w
PARAMS = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
SIZES = {k: math.prod(s) for k, s in SHAPES.items()}
D = sum(SIZES.values())  # 184
RING = 2 * (N - 1) / N  # all-reduce bytes on the wire per payload byte
GATHER = N - 1


top_k = jd.top_k
random_k = jd.random_k
block_k = jd.block_k
threshold = jd.threshold
sign_majority_vote = jd.sign_majority_vote
scaled_sign = jd.scaled_sign
qsgd = jd.qsgd


def _powersgd_payloads(rank, mcr=2.0):
    """(P elements, Q elements, dense elements) per step, from the docstring's rule."""
    p = q = dense = 0
    for s in SHAPES.values():
        if len(s) >= 2:
            n, m = math.prod(s[:-1]), s[-1]
            r = min(rank, n, m)
            if r * (n + m) * mcr <= n * m:
                p, q = p + n * r, q + m * r
                continue
        dense += math.prod(s)
    return p, q, dense


def _expected_powersgd(rank, one_allreduce=False):
    p, q, dense = _powersgd_payloads(rank)
    if one_allreduce:  # alternating steps: [Q's + dense], [P's + dense]
        return RING * 4 * ((p + q) / 2 + dense)
    return RING * 4 * (p + q + dense)


# (id, transform factory, per-worker params, expected bytes sent per worker per step)
CASES = [
    ("all_reduce", lambda: jd.all_reduce(), False, RING * 4 * D),
    (
        "all_reduce_bf16_flat",
        lambda: jd.all_reduce(dtype=jnp.bfloat16, flatten=True, bitcast_ring=False),
        False,
        RING * 2 * D,
    ),
    # The 16-bit ring on the bits: n - 1 ppermutes and one all-gather of ceil(D / n) entries.
    (
        "all_reduce_bf16_ring",
        lambda: jd.all_reduce(dtype=jnp.bfloat16, bitcast_ring=True),
        False,
        2 * (N - 1) * -(-D // N) * 2,
    ),
    (
        "average_params",
        lambda: optax.chain(jd.sgd(0.1), jd.average_params(every=2, num_partitions=2)),
        True,
        RING * 4 * D / 4,  # bytes(params) / (every * num_partitions), on average
    ),
    ("powersgd", lambda: powersgd(2), False, _expected_powersgd(2)),
    ("powersgd_cold", lambda: powersgd(1, warm_start=False), False, _expected_powersgd(1)),
    (
        "powersgd_one_allreduce",
        lambda: powersgd(2, one_allreduce=True, start_step=3),
        False,
        _expected_powersgd(2, one_allreduce=True),
    ),
]
K = 4
# One all-gather of k values + k int32 indices for each leaf larger than k.
CASES.append(("top_k", lambda: top_k(K), False, GATHER * sum(K * (4 + 4) for d in SIZES.values() if d > K)))
CASES.append(
    (
        "threshold",
        lambda: threshold(0.5, capacity=K),
        False,
        GATHER * sum(K * 8 for d in SIZES.values() if d > K),
    )
)
# One all-reduce of the chosen values (no indices).
CASES.append(("random_k", lambda: random_k(K), False, RING * 4 * sum(min(K, d) for d in SIZES.values())))
CASES.append(("block_k", lambda: block_k(K), False, RING * 4 * sum(min(K, d) for d in SIZES.values())))
CASES.append(("sign_majority_vote", lambda: sign_majority_vote(), False, GATHER * math.ceil(D / 8)))
CASES.append(("scaled_sign", lambda: scaled_sign(), False, GATHER * (math.ceil(D / 8) + 4 * len(SIZES))))
# QSGD all-reduce (default): a pmax of the M float32 bucket norms + a psum of the D codes, summed in
# int8 while N * levels <= 127, int16 while <= 32767. All-gather: one buffer of the codes + M norms.
CASES.append(("qsgd", lambda: qsgd(4), False, RING * (1 * D + 4 * len(SIZES))))
CASES.append(
    (
        "qsgd_int16_buckets",
        lambda: qsgd(16, bucket_size=64),
        False,
        RING * (2 * D + 4 * sum(math.ceil(d / 64) for d in SIZES.values())),
    )
)
CASES.append(
    ("qsgd_all_gather", lambda: qsgd(4, aggregate="all_gather"), False, GATHER * (1 * D + 4 * len(SIZES)))
)
# Robust rules: one all-gather of the float32 updates, (n - 1) D floats sent per worker.
CASES.append(("trimmed_mean", lambda: jd.trimmed_mean(2), False, GATHER * 4 * D))
CASES.append(("coordinate_median", lambda: jd.coordinate_median(), False, GATHER * 4 * D))
CASES.append(("centered_clip", lambda: jd.centered_clip(1.0, iterations=3), False, GATHER * 4 * D))
CASES.append(("norm_clipped_mean", lambda: jd.norm_clipped_mean(), False, GATHER * 4 * D))
IDS = [c[0] for c in CASES]


def _compiled_hlo(tx, per_worker):
    mesh = helpers.make_mesh(N)
    placement = jd.opt_state_placement(tx, PARAMS, mesh=mesh, per_worker_params=per_worker)
    mask = placement.per_worker
    state = jd.init_opt_state(tx, PARAMS, mesh=mesh, per_worker_params=per_worker)
    params = jd.place_params(PARAMS, mesh=mesh, per_worker_params=per_worker)
    grads = jax.device_put(
        jax.tree.map(lambda x: jnp.ones((N, *x.shape), x.dtype), PARAMS),
        jax.sharding.NamedSharding(mesh, P("data")),
    )
    s_spec = jax.tree.map(lambda m: P("data") if m else P(), mask)
    p_spec = jax.tree.map(lambda _: P("data") if per_worker else P(), PARAMS)

    def body(g, s, p):
        g = jax.tree.map(lambda x: x[0], g)
        s = jax.tree.map(lambda x, m: x[0] if m else x, s, mask)
        p = jax.tree.map(lambda x: x[0], p) if per_worker else p
        u, s = tx.update(g, s, p)
        restack = (lambda x: x[None]) if per_worker else (lambda x: x)
        return jax.tree.map(restack, u), jax.tree.map(lambda x, m: x[None] if m else x, s, mask)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), s_spec, p_spec), out_specs=(p_spec, s_spec))
    return jax.jit(fn).lower(grads, state, params).compile().as_text()


_HLO_DTYPE = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "uint8": "u8",
    "int8": "s8",
    "int32": "s32",
}
_HLO_DTYPE.update({"uint32": "u32", "float64": "f64", "bool": "pred", "int16": "s16"})
_HLO_DTYPE.update({"uint16": "u16"})


def _totals(collectives, dtype_of):
    out = {}
    for c in collectives:
        for shape, dt in c.operands:
            key = (c.kind, dtype_of(dt))
            out[key] = out.get(key, 0) + math.prod(shape) * getattr(c, "multiplier", 1)
    return out


@pytest.mark.parametrize("name,factory,per_worker,expected", CASES, ids=IDS)
def test_bytes_match_docstring_formula_and_compiled_hlo(name, factory, per_worker, expected):
    tx = factory()
    cost = communication_cost(tx, PARAMS, num_workers=N)
    # (a) the formula in the transform's docstring (steady state, averaged over a period).
    assert cost.sent_bytes == pytest.approx(expected, rel=1e-9), cost.table()
    assert cost.received_bytes == cost.sent_bytes
    assert cost.dense_bytes == pytest.approx(RING * 4 * D)
    assert cost.compression_ratio == pytest.approx(RING * 4 * D / expected)
    assert cost.exact
    # (b) what the compiled program moves: the same elements per collective kind and dtype.
    hlo = hlo_collectives(_compiled_hlo(tx, per_worker))
    assert hlo, "no collective in the compiled HLO"
    assert all(h.group_size == N for h in hlo)
    traced = _totals(cost.sites, lambda d: _HLO_DTYPE[d])
    compiled = _totals(hlo, lambda d: d)
    if name == "all_reduce_bf16_flat":
        # XLA:CPU promotes 16-bit all-reduces to f32 (its reduction runs in f32); on GPU/TPU
        # the wire stays bf16. Same elements, the dtype widened.
        assert traced == {("all_reduce", "bf16"): D} and compiled == {("all_reduce", "f32"): D}
    else:
        assert traced == compiled
    # Wire bytes per kind agree too (same group sizes, same algorithm factors).
    if name != "all_reduce_bf16_flat":
        site_bytes = sum(c.sent_bytes() for c in cost.sites)
        hlo_bytes = sum(h.sent_bytes() for h in hlo)
        assert site_bytes == pytest.approx(hlo_bytes)


def test_average_params_steps_and_periods():
    tx = optax.chain(jd.sgd(0.1), jd.average_params(every=3))
    auto = communication_cost(tx, PARAMS, num_workers=N)
    assert auto.step_dependent and auto.exact and len(auto.period) == 3
    assert auto.sent_bytes == pytest.approx(RING * 4 * D / 3)
    assert auto.worst_sent_bytes == pytest.approx(RING * 4 * D)
    assert any("repeats every 3 step(s) from step 0" in n for n in auto.notes)
    first = communication_cost(tx, PARAMS, num_workers=N, steps=2)
    assert [s.sent_bytes for s in first.steps] == [0.0, 0.0] and first.compression_ratio == math.inf
    sync = communication_cost(tx, PARAMS, num_workers=N, steps=1, start=5)
    assert sync.steps[0].step == 5 and sync.sent_bytes == pytest.approx(RING * 4 * D)
    assert len(auto.sites) == len(SHAPES)  # one all-reduce per leaf in the program, run every third step


def test_powersgd_start_step_warm_up_then_steady_state():
    tx = powersgd(2, start_step=4)
    cost = communication_cost(tx, PARAMS, num_workers=N)
    per_step = [s.sent_bytes for s in cost.steps]
    assert per_step[:4] == [pytest.approx(RING * 4 * D)] * 4
    assert per_step[4:] == [pytest.approx(_expected_powersgd(2))] * (len(per_step) - 4)
    assert cost.sent_bytes == pytest.approx(_expected_powersgd(2))
    assert any("from step 4" in n for n in cost.notes)
    assert [s.calls for s in cost.steps[3:5]] == [1, 2]


def _resnet18_cifar_shapes():
    shapes = [(3, 3, 3, 64), (64,), (64,)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            shapes += [(3, 3, cin, cout), (cout,), (cout,), (3, 3, cout, cout), (cout,), (cout,)]
            if s != 1 or cin != cout:
                shapes += [(1, 1, cin, cout), (cout,), (cout,)]
            cin = cout
    return shapes + [(512, 10), (10,)]


def test_powersgd_ratios_on_resnet18_match_the_paper():
    params = {
        f"p{i:02d}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(_resnet18_cifar_shapes())
    }
    assert sum(math.prod(x.shape) for x in params.values()) == 11_173_962
    for rank, paper in ((1, 243), (2, 136), (4, 72)):
        ratio = communication_cost(powersgd(rank), params, num_workers=N).compression_ratio
        assert abs(ratio / paper - 1) <= 0.02, (rank, ratio)


def _psum_if_positive():
    """A transform whose communication depends on the data (not on a counter)."""

    def update(g, s, p=None, **kw):
        return jax.lax.cond(
            jnp.sum(jax.tree.leaves(g)[0]) > 0,
            lambda g: jax.tree.map(lambda x: jd.all_reduce().update(x, ())[0], g),
            lambda g: jax.tree.map(jnp.zeros_like, jd.all_reduce().update(g, ())[0]),
            g,
        ), s

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def test_data_dependent_branch_charged_worst_case_and_flagged():
    cost = communication_cost(_psum_if_positive(), PARAMS, num_workers=N)
    assert not cost.exact and not cost.step_dependent
    assert cost.sent_bytes == pytest.approx(RING * 4 * D)
    assert any("data-dependent" in n for n in cost.notes)


def test_scan_multiplies_and_while_is_flagged():
    def scan_update(g, s, p=None, **kw):
        def body(c, _):
            return jax.tree.map(lambda x: x + jd.all_reduce().update(x, ())[0], c), None

        return jax.lax.scan(body, g, None, length=3)[0], s

    cost = communication_cost(
        optax.GradientTransformationExtraArgs(optax.init_empty_state, scan_update), PARAMS, num_workers=N
    )
    assert cost.exact and cost.calls == 3 * len(SHAPES)
    assert cost.sent_bytes == pytest.approx(3 * RING * 4 * D)

    def while_update(g, s, p=None, **kw):
        def body(c):
            i, x = c
            return i + 1, jd.all_reduce().update(x, ())[0]

        return jax.lax.while_loop(lambda c: c[0] < jnp.sum(c[1]["w"]), body, (0, g))[1], s

    cost = communication_cost(
        optax.GradientTransformationExtraArgs(optax.init_empty_state, while_update), PARAMS, num_workers=N
    )
    assert not cost.exact and any("while_loop" in n for n in cost.notes)
    assert cost.sent_bytes == pytest.approx(RING * 4 * D)


def _levels_in_a_loop(from_state: bool):
    """A ``fori_loop`` over the leaves whose iteration ``i`` psums the first ``i + 1`` of them (a
    switch on the counter); with ``from_state``, the first ``i + 1 + count % 2`` (at most all)."""

    def init(params):
        return jnp.zeros([], jnp.int32)

    def update(g, count, p=None, **kw):
        leaves, treedef = jax.tree.flatten(g)

        def send(k):
            return lambda xs: [comm.psum(x, "data") if j <= k else x for j, x in enumerate(xs)]

        def body(i, xs):
            k = jnp.minimum(i + count % 2, len(leaves) - 1) if from_state else i
            return jax.lax.switch(k, [send(k) for k in range(len(leaves))], xs)

        return treedef.unflatten(jax.lax.fori_loop(0, len(leaves), body, leaves)), count + 1

    return optax.GradientTransformationExtraArgs(init, update)


def test_a_loop_counter_resolves_its_branches_at_every_iteration():
    sizes = [SIZES[k] for k in sorted(SHAPES)]  # leaves order: b, c, w
    cost = communication_cost(_levels_in_a_loop(False), PARAMS, num_workers=N)
    # Iteration i sends leaves 0..i: b three times, c twice, w once.
    even = sum((len(sizes) - j) * s for j, s in enumerate(sizes))
    assert cost.exact and not cost.step_dependent and not cost.notes
    assert cost.sent_bytes == pytest.approx(RING * 4 * even)
    # Shifted by the state's counter on odd steps: b and c three times, w twice.
    cost = communication_cost(_levels_in_a_loop(True), PARAMS, num_workers=N)
    odd = 3 * sizes[0] + 3 * sizes[1] + 2 * sizes[2]
    assert cost.exact and cost.step_dependent
    assert cost.sent_bytes == pytest.approx(RING * 4 * (even + odd) / 2)


def test_several_axes_and_permutes():
    # Hierarchical: reduce over "local" (4 workers) then over "node" (2 workers).
    tx = optax.chain(jd.all_reduce(axis_name="local"), jd.all_reduce(axis_name="node"))
    cost = communication_cost(tx, PARAMS, num_workers={"node": 2, "local": 4}, axis_name=("node", "local"))
    assert cost.num_workers == 8
    assert sorted(c.group_size for c in cost.steps[0].collectives) == [2] * 3 + [4] * 3
    # Packed (flatten=True, the default on CPU across processes): one call per axis, same bytes.
    packed = optax.chain(
        jd.all_reduce(axis_name="local", flatten=True), jd.all_reduce(axis_name="node", flatten=True)
    )
    cost_p = communication_cost(
        packed, PARAMS, num_workers={"node": 2, "local": 4}, axis_name=("node", "local")
    )
    assert sorted(c.group_size for c in cost_p.steps[0].collectives) == [2, 4]
    assert cost_p.sent_bytes == pytest.approx(cost.sent_bytes)
    assert cost.sent_bytes == pytest.approx((2 * 3 / 4 + 2 * 1 / 2) * 4 * D)

    # A ring shift: every worker sends and receives its payload once.
    def shift_update(g, s, p=None, **kw):
        return comm.shift(g, "data", 1), s

    shift = optax.GradientTransformationExtraArgs(optax.init_empty_state, shift_update)
    cost = communication_cost(shift, PARAMS, num_workers=N)
    assert set(cost.by_kind()) == {"permute"} and cost.sent_bytes == 4 * D
    assert cost.by_kind()["permute"].calls == len(SHAPES)  # ppermute binds once per leaf


def test_project_step_time_alpha_beta():
    cost = communication_cost(jd.all_reduce(flatten=True), PARAMS, num_workers=N)
    t = project_step_time(cost, bandwidth_gbps=8.0, latency_us=10.0)
    beta, alpha = 1e9, 1e-5  # bytes/s, s
    want = 2 * (N - 1) * alpha + RING * 4 * D / beta
    assert t.seconds == pytest.approx(want) and t.dense_seconds == pytest.approx(want)
    assert t.latency_seconds == pytest.approx(2 * (N - 1) * alpha) and t.speedup == pytest.approx(1.0)
    # Projected to 64 workers: same payload, new ring factors.
    t64 = project_step_time(cost, num_workers=64, bandwidth_gbps=8.0, latency_us=10.0)
    assert t64.seconds == pytest.approx(2 * 63 * alpha + 2 * 63 / 64 * 4 * D / beta)
    # All-gather: (k - 1) rounds, (k - 1) B bytes.
    c = communication_cost(sign_majority_vote(), PARAMS, num_workers=N)
    t = project_step_time(c, bandwidth_gbps=8.0, latency_us=10.0)
    assert t.seconds == pytest.approx((N - 1) * alpha + (N - 1) * math.ceil(D / 8) / beta)
    assert "speedup" in t.table() and "ms" in str(t)


def test_table_and_structure():
    cost = communication_cost(powersgd(2, one_allreduce=True), PARAMS, num_workers=N)
    text = cost.table()
    assert "all_reduce" in text and "compression ratio" in text and "dense all-reduce baseline" in text
    assert str(cost) == text
    kinds = cost.by_kind()
    assert set(kinds) == {"all_reduce"} and kinds["all_reduce"].calls == 1
    assert kinds["all_reduce"].sent_bytes == pytest.approx(cost.sent_bytes)
    assert all(isinstance(s, costs.StepCost) for s in cost.steps)
    # One worker: nothing on the wire, no ratio.
    one = communication_cost(jd.all_reduce(), PARAMS, num_workers=1)
    assert one.sent_bytes == 0 and math.isnan(one.compression_ratio)


def test_hlo_parser_reads_operands_groups_and_computations():
    text = """HloModule m

%region_1.4_spmd (param: (f32[8], f32[2,3,8])) -> (f32[8]) {
  %all-reduce = (f32[8]{0}, f32[2,3,8]{2,1,0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
}

ENTRY %main.0_spmd (p: u8[23]) -> u8[8,23] {
  %ag = u8[8,23]{1,0} all-gather(%p), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %cp = s32[7]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0},{2,2},{3,3}}
}
"""
    ar, ag, cp = hlo_collectives(text)
    assert (ar.kind, ar.computation, ar.group_size, ar.payload_elements) == (
        "all_reduce",
        "region_1.4_spmd",
        4,
        56,
    )
    assert (ag.kind, ag.computation, ag.group_size, ag.operands) == (
        "all_gather",
        "main.0_spmd",
        8,
        (((1, 23), "u8"),),
    )
    assert ag.sent_bytes() == 7 * 23
    assert cp.kind == "permute" and cp.moving == 0.5 and cp.sent_bytes() == 0.5 * 28


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"`num_workers` must be an int >= 1"):
        communication_cost(jd.all_reduce(), PARAMS, num_workers=0)
    with pytest.raises(ValueError, match=r"give `num_workers` as a mapping"):
        communication_cost(jd.all_reduce(), PARAMS, num_workers=8, axis_name=("a", "b"))
    with pytest.raises(ValueError, match=r"gives no size for the axes \['b'\]"):
        communication_cost(jd.all_reduce(), PARAMS, num_workers={"a": 2}, axis_name=("a", "b"))
    with pytest.raises(TypeError, match=r"`tx` must be an optax.GradientTransformation"):
        communication_cost(lambda g: g, PARAMS, num_workers=8)
    with pytest.raises(ValueError, match=r"`steps` must be an int >= 1"):
        communication_cost(jd.all_reduce(), PARAMS, num_workers=8, steps=0)
    cost = communication_cost(jd.all_reduce(), PARAMS, num_workers=8)
    with pytest.raises(ValueError, match=r"`bandwidth_gbps` must lie in \(0, inf\)"):
        project_step_time(cost, bandwidth_gbps=0.0, latency_us=1.0)
    with pytest.raises(TypeError, match=r"`cost` must be a CommunicationCost"):
        project_step_time(None, bandwidth_gbps=1.0, latency_us=1.0)


def test_step_time_is_a_float_in_seconds():
    cost = communication_cost(jd.all_reduce(), PARAMS, num_workers=N)
    t = project_step_time(cost, num_workers=64, bandwidth_gbps=10.0, latency_us=5.0)
    assert isinstance(t, float) and 1e3 * t == pytest.approx(1e3 * t.seconds)
    assert t.num_workers == 64 and "StepTime(seconds=" in repr(t)


def test_project_step_time_algorithms():
    beta, alpha = 1e9, 1e-5  # bytes/s, s (8 Gbit/s, 10 us)
    link = dict(bandwidth_gbps=8.0, latency_us=10.0)
    per_leaf = communication_cost(
        jd.all_reduce(flatten=False), PARAMS, num_workers=N
    )  # 3 psums, one per leaf
    ring = project_step_time(per_leaf, **link)
    assert project_step_time(per_leaf, algorithm="ring", **link) == ring  # the default
    assert ring.seconds == pytest.approx(3 * 2 * (N - 1) * alpha + RING * 4 * D / beta)
    assert project_step_time(per_leaf, algorithm="gloo", **link) == pytest.approx(ring)
    # gloo (XLA:CPU): one ring call per operand of a collective; the ring model charges one.
    ops = tuple(((s,), "float32") for s in (64, 8, 2))
    psum3 = costs.Collective("all_reduce", "psum", ("data",), N, ops, 4 * 74, 1.0, "")
    assert projection.priced(psum3, N, "ring", alpha, beta) == pytest.approx((RING * 4 * 74, 2 * (N - 1)))
    assert projection.priced(psum3, N, "gloo", alpha, beta) == pytest.approx((RING * 4 * 74, 3 * 2 * (N - 1)))
    # ... and 16-bit floats travel as float32 (XLA:CPU widens them in every collective).
    native = jd.all_reduce(dtype=jnp.bfloat16, bitcast_ring=False, flatten=False)  # no 16-bit ring: widened
    bf16 = communication_cost(native, PARAMS, num_workers=N)
    assert bf16.sent_bytes == pytest.approx(RING * 2 * D)
    assert project_step_time(bf16, algorithm="gloo", **link).seconds == pytest.approx(ring.seconds)
    assert project_step_time(bf16, **link).bandwidth_seconds == pytest.approx(RING * 2 * D / beta)
    # auto: a small message takes recursive doubling (log2 8 = 3 rounds, 3 B bytes) ...
    flat = communication_cost(jd.all_reduce(flatten=True), PARAMS, num_workers=N)
    auto = project_step_time(flat, algorithm="auto", **link)
    assert auto.seconds == pytest.approx(3 * alpha + 3 * 4 * D / beta)
    assert auto.dense_seconds == pytest.approx(auto.seconds)
    # ... a large one the ring, whichever is faster.
    big = {"w": jax.ShapeDtypeStruct((1 << 22,), jnp.float32)}
    cost = communication_cost(jd.all_reduce(), big, num_workers=N)
    want_ring = 2 * (N - 1) * alpha + RING * 4 * (1 << 22) / beta
    assert project_step_time(cost, algorithm="auto", **link).seconds == pytest.approx(want_ring)
    assert project_step_time(cost, algorithm="auto", **link).seconds <= project_step_time(cost, **link)
    # All-to-all under gloo: every peer at once, one round; bytes of the ring table.
    a2a = costs.Collective("all_to_all", "all_to_all", ("data",), N, (((64,), "float32"),), 256, 1.0, "")
    assert projection.priced(a2a, N, "gloo", alpha, beta) == pytest.approx(((N - 1) / N * 256, 1))
    rs = dataclasses.replace(a2a, kind="reduce_scatter")
    assert projection.priced(rs, N, "gloo", alpha, beta) == pytest.approx(((N - 1) / N * 256, 3))
    with pytest.raises(ValueError, match=r"`algorithm` must be one of \('ring', 'auto', 'gloo'\)"):
        project_step_time(per_leaf, algorithm="tree", **link)


def test_project_step_time_call_floor():
    """call_floor_us: every call (each operand under "gloo") takes at least the floor."""
    link = dict(bandwidth_gbps=8.0, latency_us=10.0)
    per_leaf = communication_cost(jd.all_reduce(flatten=False), PARAMS, num_workers=N)  # 3 calls
    flat = communication_cost(jd.all_reduce(flatten=True), PARAMS, num_workers=N)  # 1 call
    floor_us = 4000.0  # above every call's rounds and bytes here
    for algorithm in ("ring", "gloo", "auto"):
        plain = project_step_time(per_leaf, algorithm=algorithm, **link)
        floored = project_step_time(per_leaf, algorithm=algorithm, call_floor_us=floor_us, **link)
        assert floored.seconds == pytest.approx(3 * floor_us * 1e-6), algorithm
        assert floored.bandwidth_seconds == pytest.approx(plain.bandwidth_seconds)
        assert floored.latency_seconds == pytest.approx(floored.seconds - plain.bandwidth_seconds)
        assert floored.dense_seconds == pytest.approx(floor_us * 1e-6)
        one = project_step_time(flat, algorithm=algorithm, call_floor_us=floor_us, **link)
        assert one.seconds == pytest.approx(floor_us * 1e-6) and one.speedup == pytest.approx(1.0)
    # A floor below every call changes nothing; 0 is the default.
    tiny = project_step_time(per_leaf, algorithm="gloo", call_floor_us=1e-3, **link)
    assert tiny.seconds == pytest.approx(project_step_time(per_leaf, algorithm="gloo", **link).seconds)
    # One worker sends nothing: no call, no floor.
    alone = communication_cost(jd.all_reduce(flatten=False), PARAMS, num_workers=1)
    assert project_step_time(alone, algorithm="gloo", call_floor_us=floor_us, **link).seconds == 0.0
    with pytest.raises(ValueError, match="call_floor_us"):
        project_step_time(flat, call_floor_us=-1.0, **link)


# ----------------------------------------------------------------------------
# One spelling for the worker count: num_workers (axis_size= and workers= deprecated).


def test_axis_size_is_a_deprecated_spelling_of_num_workers():
    tx = optax.chain(jd.sgd(0.1), jd.average_params(every=3))
    new = communication_cost(tx, PARAMS, num_workers=N)
    with pytest.warns(DeprecationWarning, match="`axis_size` is deprecated.*use `num_workers`") as record:
        old = communication_cost(tx, PARAMS, axis_size=N)
    assert record[0].filename == __file__  # the warning points at the caller
    assert old == new and old.sent_bytes == new.sent_bytes and old.table() == new.table()
    sizes = {"node": 2, "local": 4}
    hier = optax.chain(jd.all_reduce(axis_name="local"), jd.all_reduce(axis_name="node"))
    with pytest.warns(DeprecationWarning, match="num_workers"):
        old = communication_cost(hier, PARAMS, axis_size=sizes, axis_name=("node", "local"))
    assert old == communication_cost(hier, PARAMS, num_workers=sizes, axis_name=("node", "local"))
    with pytest.raises(TypeError, match="`num_workers` only"):
        communication_cost(tx, PARAMS, num_workers=N, axis_size=N)
    with pytest.raises(TypeError, match="needs `num_workers`"):
        communication_cost(tx, PARAMS)


def test_workers_is_a_deprecated_spelling_of_num_workers():
    cost = communication_cost(jd.all_reduce(), PARAMS, num_workers=N)
    link = dict(bandwidth_gbps=10.0, latency_us=5.0)
    new = project_step_time(cost, num_workers=64, **link)
    with pytest.warns(DeprecationWarning, match="`workers` is deprecated.*use `num_workers`") as record:
        old = project_step_time(cost, workers=64, **link)
    assert record[0].filename == __file__
    assert float(old) == float(new) and repr(old) == repr(new) and old.table() == new.table()
    assert (old.by_kind, old.by_axis, old.num_workers) == (new.by_kind, new.by_axis, new.num_workers)
    with pytest.raises(TypeError, match="`num_workers` only"):
        project_step_time(cost, num_workers=64, workers=64, **link)
    fields = dict(latency_seconds=0.0, bandwidth_seconds=1.0, dense_seconds=1.0, by_kind={})
    with pytest.warns(DeprecationWarning, match="num_workers"):
        assert projection.StepTime(1.0, workers=4, **fields).num_workers == 4
    with pytest.raises(TypeError, match="needs `num_workers`"):
        projection.StepTime(1.0, **fields)


def test_old_attribute_names_warn_and_return_the_same_value():
    cost = communication_cost(jd.all_reduce(), PARAMS, num_workers=N)
    with pytest.warns(DeprecationWarning, match="CommunicationCost.axis_size") as record:
        assert cost.axis_size == cost.num_workers == N
    assert record[0].filename == __file__
    t = project_step_time(cost, num_workers=64, bandwidth_gbps=10.0, latency_us=5.0)
    with pytest.warns(DeprecationWarning, match="StepTime.workers") as record:
        assert t.workers == t.num_workers == 64
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings do not warn
        assert cost.num_workers == N and t.num_workers == 64 and "64 workers" in t.table()


# ----------------------------------------------------------------------------
# Platform facts.


def test_platform_counts_the_program_another_setup_would_run():
    params = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(6)}  # two float32 leaves, 18 entries
    tx = jd.all_reduce()
    per_leaf = communication_cost(tx, params, num_workers=N, platform=jd.Platform("cpu"))
    packed = communication_cost(tx, params, num_workers=N, platform=jd.Platform("cpu", multi_process=True))
    # CPU across processes: one all-reduce of one buffer holding both leaves.
    assert [(c.kind, c.operands) for c in packed.sites] == [("all_reduce", (((18,), "float32"),))]
    assert packed.calls == 1
    # One process: one operand per leaf.
    assert {c.kind for c in per_leaf.sites} == {"all_reduce"}
    assert sorted(op for c in per_leaf.sites for op in c.operands) == [((4, 3), "float32"), ((6,), "float32")]
    assert packed.sent_bytes == pytest.approx(per_leaf.sent_bytes) == RING * 4 * 18
    # The platform holds only for the trace; the same transform traces per leaf again.
    assert not comm.flatten_by_default()
    assert communication_cost(tx, params, num_workers=N, platform=jd.Platform("cpu")) == per_leaf
    with pytest.raises(TypeError, match="`platform` must be a jaxopt_dist.Platform"):
        communication_cost(tx, params, num_workers=N, platform="cpu")


def test_platform_none_keeps_the_facts_in_force():
    # platform=None counts the program of the facts in force: an enclosing use_platform included.
    params = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(6)}
    with jd.use_platform(jd.Platform("cpu", multi_process=True)):
        packed = communication_cost(jd.all_reduce(), params, num_workers=N)
    assert [op for c in packed.sites for op in c.operands] == [((18,), "float32")]


@pytest.mark.parametrize("every", [100, 500])
def test_periods_longer_than_the_first_window_are_found(every):
    """A sync period past the first 256 steps: simulated further, not misread (as 128x or 0 bytes)."""
    cost = jd.communication_cost(jd.average_params(every=every), PARAMS, num_workers=4)
    dense = jd.communication_cost(jd.all_reduce(), PARAMS, num_workers=4)
    assert cost.sent_bytes == pytest.approx(dense.sent_bytes / every)
    assert any(f"repeats every {every} step(s)" in n for n in cost.notes)


def test_a_period_beyond_the_simulation_is_an_error(monkeypatch):
    # The simulation's reach lowered from 2048 steps to 512, so that the test walks fewer steps.
    monkeypatch.setattr(walk, "_MAX_AUTO_STEPS", 512)
    with pytest.raises(ValueError, match="none of the 512 steps simulated from step 0 communicates"):
        jd.communication_cost(jd.average_params(every=600), PARAMS, num_workers=4)
    cost = jd.communication_cost(jd.average_params(every=600), PARAMS, num_workers=4, steps=600)
    dense = jd.communication_cost(jd.all_reduce(), PARAMS, num_workers=4)
    assert cost.sent_bytes == pytest.approx(dense.sent_bytes / 600)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jd.diloco(optax.adam(1e-3), sync_every=6, num_fragments=3, sync_delay=1),
        lambda: jd.noloco(optax.adam(1e-3), sync_every=5, num_permutations=4),
        lambda: jd.desloc_adam(1e-3, sync_every=2, momentum_sync_every=4, variance_sync_every=8),
    ],
    ids=["streaming_diloco", "noloco", "desloc"],
)
def test_the_simulation_remembers_values_without_changing_a_number(make, monkeypatch):
    """Steps that recompute a value from the same inputs reuse it; the cost is the one computed afresh."""
    remembered = communication_cost(make(), PARAMS, num_workers=4)
    monkeypatch.setattr(walk, "_value_key", lambda eqn, host: None)  # every value evaluated again
    afresh = communication_cost(make(), PARAMS, num_workers=4)
    assert remembered.sent_bytes > 0
    assert remembered == afresh
