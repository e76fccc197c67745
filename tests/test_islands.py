"""Islands over the in-process hub (threads, no torch): the merge rules, the round logic, faults.

Each island is a thread running its own jitted step on a device of its own;
:class:`jaxopt_dist.islands.LocalHub` stands in for the lighthouse and the
wire. The reference is the in-process ``diloco`` on as many workers, with
:func:`jaxopt_dist.islands.weighted_mean` carrying the same participation.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist import islands
from jaxopt_dist._src.islands import protocol
from tests import helpers

N, H = 3, 4
EXAMPLE = helpers.load_example("islands")


# ------------------------------------------------------------------ merge rules
def test_pack_unpack_is_the_weighted_mean():
    rng = np.random.default_rng(0)
    shapes = [(3, 2), (5,)]
    deltas = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(3)]
    weights, slots = [2.0, 0.0, 5.0], [4, 0, 9]
    total = sum(
        islands.pack(d, w, slot=s, num_slots=16, round=7, anchor=123)
        for d, w, s in zip(deltas, weights, slots)
    )
    merged = islands.unpack(total, deltas[0], num_slots=16)
    for k in range(len(shapes)):
        want = sum(w * d[k] for w, d in zip(weights, deltas)) / sum(weights)
        np.testing.assert_allclose(merged.delta[k], want, rtol=1e-6)
    assert merged.participants == [0, 4, 9]
    assert merged.weights == [0.0, 2.0, 5.0]
    assert merged.rounds == [7, 7, 7] and merged.anchors == [123, 123, 123] and merged.agree()
    # An island's share of the merged mean (eager's coefficient of its own fresh pseudo-gradient).
    assert [islands.island_share(merged, i) for i in (0, 4, 9, 3)] == pytest.approx([0.0, 2 / 7, 5 / 7, 0.0])


def test_unpack_all_weights_zero_gives_zeros_and_disagreement_is_seen():
    a = islands.pack([np.ones(3, np.float32)], 0.0, slot=0, num_slots=4, round=1, anchor=5)
    b = islands.pack([np.ones(3, np.float32)], 0.0, slot=1, num_slots=4, round=2, anchor=5)
    merged = islands.unpack(a + b, [np.ones(3, np.float32)], num_slots=4)
    np.testing.assert_array_equal(merged.delta[0], np.zeros(3))
    assert merged.rounds == [1, 2] and not merged.agree()
    assert islands.island_share(merged, 0) == 0.0  # no weight in the round: no share


def test_pack_and_unpack_errors():
    with pytest.raises(ValueError, match="slot 4 is outside"):
        islands.pack([np.ones(2)], 1.0, slot=4, num_slots=4)
    with pytest.raises(ValueError, match="different fragments"):
        islands.unpack(np.zeros(10, np.float32), [np.ones(3)], num_slots=4)
    with pytest.raises(ValueError, match="`rule` must be one of"):
        islands.island_weight("median", healed=False, tokens=1.0)
    assert islands.island_weight("tokens", healed=True, tokens=9.0) == 0.0
    assert islands.island_weight("tokens", healed=False, tokens=9.0) == 9.0


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_weighted_mean_matches_a_loop_over_workers(backend, n):
    rng = np.random.default_rng(n)
    table = rng.integers(0, 3, size=(3, n)).astype(np.float32)
    table[:, 0] += 1.0  # every round has some weight
    tx = islands.weighted_mean(table)
    grads = [{"a": rng.normal(size=(n, 4, 2)).astype(np.float32)} for _ in range(4)]
    state = tx.init(None)
    for r, g in enumerate(grads):

        def step(g_i, s):
            return tx.update(g_i, s)

        out, state = helpers.run_on_workers(step, g, backend=backend, shared=(state,))
        w = table[min(r, 2)]
        want = np.einsum("i,i...->...", w, g["a"]) / w.sum()
        np.testing.assert_allclose(out["a"], want, rtol=1e-5, atol=1e-6)
    assert int(state.rounds) == 4


def test_weighted_mean_of_ones_is_diloco_mean():
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    grads = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(5, N, 2, 3)), jnp.float32)}
    plain = jd.diloco(optax.sgd(0.1), sync_every=2)
    merged = jd.diloco(optax.sgd(0.1), sync_every=2, aggregate=islands.weighted_mean())
    a = helpers.run_steps(plain, grads, params, backend="vmap", per_worker_params=True)
    b = helpers.run_steps(merged, grads, params, backend="vmap", per_worker_params=True)
    # Equal to rounding: psum over the packed [w d, w] buffer may add the workers in another
    # order than psum over the leaf alone (seen on JAX 0.10's CPU reduction: one ulp).
    helpers.assert_trees_close(a[:2], b[:2], rtol=1e-6, atol=1e-7)
    helpers.assert_trees_close(a[2].anchor, b[2].anchor, rtol=1e-6, atol=1e-7)
    helpers.assert_replicas_equal(b[2].anchor)


# ----------------------------------------------------------------- the islands
def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(5, 8)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 2)) * 0.3, jnp.float32),
    }


def _batch(i: int, t: int) -> dict:
    rng = np.random.default_rng([i, t])
    return {"x": rng.normal(size=(4, 5)).astype(np.float32), "y": rng.normal(size=(4, 2)).astype(np.float32)}


def _reference(make_tx, steps: int, n: int = N) -> list:
    """The in-process run: the anchor after every step, on ``n`` workers (one device each)."""
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    step = jd.data_parallel_step(_loss, make_tx(), mesh=mesh, per_worker_params=True)
    p, s = step.init(_params())
    anchors = []
    for t in range(steps):
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *[_batch(i, t) for i in range(n)])
        p, s, _ = step(p, s, batch)
        anchors.append(jax.device_get(s.anchor))
    return anchors


def _island_thread(
    i, make_tx, transport, steps, out, on_sync_too=None, errors=None, pause=0.0, byzantine=None, **options
):
    """Island ``i``'s thread: ``steps`` inner steps (``pause`` seconds after each), its records in ``out[i]``,
    an IslandsError it ends with in ``errors[i]`` (raised when ``errors`` is None); with ``byzantine`` (a
    mode of ``examples/islands.py --byzantine``) it sends that instead of its pseudo-gradient."""
    mesh = jax.make_mesh((1,), ("data",), devices=[jax.devices()[i % 8]])
    step = jd.data_parallel_step(_loss, make_tx(), mesh=mesh, per_worker_params=True)
    seen = []

    def on_sync(rec, p, s):
        seen.append((rec, jax.device_get(s.anchor)))
        if on_sync_too is not None:
            on_sync_too(rec, p, s)

    isl = islands.island(step, transport, island_id=i, on_sync=on_sync, **options)
    if byzantine is not None:
        isl.step = EXAMPLE.ByzantineStep(isl.step, isl.exchange, byzantine, i)
    out[i] = seen
    try:
        p, s = isl.init(_params())
        t = isl.step_count(s)
        while t < steps:
            p, s, _ = isl(p, s, _batch(i, t))
            t = isl.step_count(s)
            time.sleep(pause)
        isl.finish()
    except islands.IslandKilled:
        pass
    except islands.IslandsError as e:
        if errors is None:
            raise
        errors[i] = e


def _run_threads(targets) -> None:
    threads = [threading.Thread(target=f, args=a, kwargs=k) for f, a, k in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "an island thread hung"


def _row(tree, i):
    return {k: np.asarray(v)[i] for k, v in tree.items()}


def _assert_close_to(anchor, ref, tol=1e-6):
    for k in ref:
        scale = float(np.max(np.abs(ref[k])))
        assert float(np.max(np.abs(anchor[k] - ref[k]))) <= tol * scale, k


VARIANTS = {
    "diloco": dict(),
    "streaming_delay": dict(num_fragments=2, sync_delay=1),
    "streaming_mixing": dict(num_fragments=2, mixing=0.5),
    "quantized": dict(aggregate="statistical_quantize"),
    # Two-stage aggregates: each island sends its first stage; the merged mean is re-quantized.
    "quantized_mean_requantized": dict(aggregate="statistical_quantize_requantized"),
    # low_bit's blocks are cut over each island's whole vector, and per worker chunk in process:
    # the same blocks when block_size divides the chunk (56 entries on 3 workers: chunks of 24).
    "low_bit": dict(aggregate="low_bit"),
    # Encoded on the wire (gathered, decoded and combined in island order).
    "sparseloco": dict(aggregate="chunked_top_k"),
    "top_k_flat": dict(aggregate="top_k_flat"),
    # Robust rules over the gathered pseudo-gradients, one row per slot (NaN for the slots with none).
    "trimmed_mean": dict(aggregate="trimmed_mean"),
    "median_streaming_delay": dict(aggregate="coordinate_median", num_fragments=2, sync_delay=1),
    "centered_clip": dict(aggregate="centered_clip"),  # its center: the same state on every island
    "norm_clipped_mean": dict(aggregate="norm_clipped_mean"),
    # Per-island anchors: each takes its own fresh pseudo-gradient with its share of the last round.
    "eager": dict(eager=True),
    "eager_streaming": dict(eager=True, num_fragments=2),
}


def _maker(opts):
    opts = dict(opts)
    aggregates = {  # MuLoCo's 2-bit outer gradients, with error feedback; Streaming DiLoCo's 4-bit
        "statistical_quantize": lambda: jd.statistical_quantize(2, requantize_mean=False),
        "statistical_quantize_requantized": lambda: jd.statistical_quantize(2),
        "low_bit": lambda: jd.low_bit(3, 0, block_size=8),
        "chunked_top_k": lambda: jd.chunked_top_k(4, chunk=4, bits=2),
        "top_k_flat": lambda: jd.top_k(k=10, per_leaf=False),
        "trimmed_mean": lambda: jd.trimmed_mean(1),
        "coordinate_median": lambda: jd.coordinate_median(),
        # A radius below the pseudo-gradients' spread (norms near 1 here), so that it clips.
        "centered_clip": lambda: jd.centered_clip(0.3, iterations=2),
        "norm_clipped_mean": lambda: jd.norm_clipped_mean(),
    }
    if "aggregate" in opts:
        make = aggregates[opts["aggregate"]]
        return lambda: jd.diloco(optax.adam(0.05), sync_every=H, **{**opts, "aggregate": make()})
    return lambda: jd.diloco(optax.adam(0.05), sync_every=H, **opts)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_islands_match_in_process_diloco(variant):
    """Fault-free: every round's anchor is the in-process run's (to float rounding), the same on every island."""
    eager = VARIANTS[variant].get("eager", False)
    make_tx, steps = _maker(VARIANTS[variant]), (4 if eager else 3) * H + 1  # eager lands a period late
    ref = _reference(make_tx, steps)
    hub, out = islands.LocalHub(min_islands=N, join_timeout=10.0), {}
    _run_threads([(_island_thread, (i, make_tx, hub.transport(), steps, out), {}) for i in range(N)])
    for i in range(N):
        assert len(out[i]) == 3 * len(make_tx().external.launch_phase), i
        for rec, anchor in out[i]:
            assert rec.participants == (0, 1, 2) and rec.weights == (1.0, 1.0, 1.0) and not rec.healed
            want = ref[rec.step - 1]
            if eager:  # island i's anchor is in-process worker i's
                anchor, want = _row(anchor, 0), _row(want, i)
            _assert_close_to(anchor, want)
    # Bit-identical on every island, every round: the anchors (under eager: the merged aggregates).
    assert len({tuple(r.agreed_sha256 for r, _ in out[i]) for i in range(N)}) == 1
    anchors = {tuple(r.anchor_sha256 for r, _ in out[i]) for i in range(N)}
    assert len(anchors) == (N if eager else 1)


@pytest.mark.parametrize("aggregate", ["mean", "chunked_top_k", "trimmed_mean"])
def test_a_nan_island_never_reaches_the_others(aggregate):
    """Island 2 sends NaN in place of its pseudo-gradient in every round. Whatever the aggregate (the
    float32 mean's SUM, found not finite, is redone over the gather path at once; SparseLoCo's encoded
    messages; a robust rule's rows) every member leaves it out (weight 0, named in ``rejected`` as
    "non-finite") and merges the others alone: the in-process run of islands 0 and 1 (a trimmed mean of two
    finite rows is their mean). Island 2 applies the same merge: every anchor is the same, bit for bit."""
    opts = {} if aggregate == "mean" else {"aggregate": aggregate}
    make_tx, steps = _maker(opts), 2 * H + 1
    ref = _reference(_maker({} if aggregate == "trimmed_mean" else opts), steps, n=2)
    hub, out = islands.LocalHub(min_islands=N, join_timeout=10.0), {}
    bad = {2: "nan"}
    _run_threads(
        [
            (_island_thread, (i, make_tx, hub.transport(), steps, out), {"byzantine": bad.get(i)})
            for i in range(N)
        ]
    )
    for i in range(N):
        assert len(out[i]) == 2, i
        for rec, anchor in out[i]:
            assert rec.participants == (0, 1, 2) and rec.weights == (1.0, 1.0, 0.0) and rec.redone == 0
            assert rec.rejected == ((2, "non-finite"),)
            assert all(np.all(np.isfinite(v)) for v in anchor.values())
            _assert_close_to(anchor, ref[rec.step - 1])
    assert len({tuple(r.anchor_sha256 for r, _ in out[i]) for i in range(N)}) == 1


def test_tokens_rule_with_equal_steps_is_the_mean():
    make_tx, steps = _maker({}), 2 * H + 1
    ref = _reference(make_tx, steps)
    hub, out = islands.LocalHub(min_islands=N, join_timeout=10.0), {}
    tokens = dict(rule="tokens", tokens_per_step=16)
    _run_threads([(_island_thread, (i, make_tx, hub.transport(), steps, out), tokens) for i in range(N)])
    for rec, anchor in out[0]:
        assert rec.weights == (64.0, 64.0, 64.0)  # H steps of 16 tokens since the last sync
        _assert_close_to(anchor, ref[rec.step - 1])


class _DyingTransport(islands.LocalTransport):
    """Dies inside the all-reduce of round ``die_at``, its contribution sent: the others have their sum,
    but not its vote (LocalHub.kill_in_exchange)."""

    def __init__(self, hub, die_at):
        super().__init__(hub)
        self.die_at = die_at

    def allreduce(self, buf):
        if self.committed == self.die_at:
            self.hub.kill_in_exchange(self.island_id)
        return super().allreduce(buf)


def test_a_death_in_the_exchange_is_redone_and_a_restart_heals_with_weight_zero():
    """Island 2 dies inside round 3's all-reduce; the survivors commit round 3 among themselves; island 2
    restarts, heals from a peer with weight 0, then takes part. The in-process run with the same
    weights (weighted_mean) is the reference for every round (plain SGD inside: healing is exact)."""
    make_tx = lambda: jd.diloco(  # noqa: E731
        optax.sgd(0.1), sync_every=H, outer=optax.sgd(0.7, momentum=0.9), aggregate=islands.weighted_mean()
    )
    steps = 10 * H
    hub, out = islands.LocalHub(min_islands=2, join_timeout=10.0), {}
    first, rejoin = {}, {}
    bound = threading.Event()  # the restarted island has joined the hub

    class Announcing(islands.LocalTransport):
        def bind(self, *args):
            super().bind(*args)
            bound.set()

    def survivors_then_restart():
        while not any(r.round >= 5 for r, _ in out.get(0, [])):
            time.sleep(0.01)
        _island_thread(2, make_tx, Announcing(hub), steps, rejoin)

    def waits_for_the_restart(rec, p, s):  # the survivors do not finish before it is up (a loaded machine)
        del p, s
        if rec.round == 6:
            assert bound.wait(60)

    _run_threads(
        [
            (_island_thread, (i, make_tx, hub.transport(), steps, out, waits_for_the_restart), {})
            for i in (0, 1)
        ]
        + [(_island_thread, (2, make_tx, _DyingTransport(hub, die_at=3), steps, first), {})]
        + [(survivors_then_restart, (), {})]
    )
    by_round = {r.round: (r, a) for r, a in out[0]}
    assert [r.round for r, _ in first[2]] == [1, 2]  # it died inside round 3
    r3 = by_round[3][0]
    assert r3.participants == (0, 1) and r3.redone >= 1  # the survivors kept round 3
    healed = [(r, a) for r, a in rejoin[2] if r.healed]
    assert len(healed) == 1
    h = healed[0][0]
    assert h.weights[h.participants.index(2)] == 0.0
    assert h.anchor_sha256 == by_round[h.round][0].anchor_sha256  # bit-identical from its first round
    later = [r for r, _ in rejoin[2] if r.round == h.round + 1][0]
    assert later.weights == (1.0, 1.0, 1.0) and later.anchor_sha256 == by_round[h.round + 1][0].anchor_sha256
    for r, _ in out[1]:
        assert r.anchor_sha256 == by_round[r.round][0].anchor_sha256
    # The reference: weighted_mean with the rounds' weights (round k of the islands is sync k - 1).
    table = np.ones((steps // H, N), np.float32)
    for r, _ in out[0]:
        table[r.round - 1] = [
            r.weights[r.participants.index(j)] if j in r.participants else 0.0 for j in range(N)
        ]
    ref = _reference(
        lambda: jd.diloco(
            optax.sgd(0.1),
            sync_every=H,
            outer=optax.sgd(0.7, momentum=0.9),
            aggregate=islands.weighted_mean(table),
        ),
        steps,
    )
    for r, anchor in out[0]:
        _assert_close_to(anchor, ref[r.step - 1])


@pytest.mark.parametrize("F", [1, 2])
def test_eager_islands_keep_a_round_through_a_death_and_heal_with_share_zero(F):
    """Eager: island 2 dies inside round 3's all-reduce, the survivors commit it, island 2 restarts and
    heals. A healed island merged none of the aggregates it holds, so its share of each is 0 (it
    applies the merged mean alone), the survivors' are their weights over the sum, and the merged
    aggregates agree bit for bit on every participant (anchors are per island under eager).
    With one fragment, the survivors' anchors are the in-process eager run's with the same weights
    (weighted_mean) through the healing round (later ones depend on the healed island's new path)."""

    def make_tx(weights=None):
        outer = optax.sgd(0.7, momentum=0.9)
        agg = islands.weighted_mean(weights)
        return jd.diloco(
            optax.sgd(0.1), sync_every=2 * F, num_fragments=F, eager=True, outer=outer, aggregate=agg
        )

    steps, out, first, rejoin, shares = 12 * F * 2, {}, {}, {}, {}
    # All three join (before any exchange the in-process share is 1 / 3; an island's is 1 / the
    # islands that joined with it); two are enough once island 0 has seen round 1.
    hub = islands.LocalHub(min_islands=N, join_timeout=10.0)

    bound = threading.Event()  # the restarted island has joined the hub

    class Announcing(islands.LocalTransport):
        def bind(self, *args):
            super().bind(*args)
            bound.set()

    def thread(i, transport, sink):
        def seen(rec, p, s):
            shares.setdefault(i, []).append((rec.round, [float(np.asarray(x)) for x in s.shares]))
            if rec.round >= 6 and sink is out:  # the survivors wait for the restart (a loaded machine)
                assert bound.wait(60)

        _island_thread(i, make_tx, transport, steps, sink, on_sync_too=seen)

    def survivors_then_restart():
        while not any(r.round >= 1 for r, _ in out.get(0, [])):
            time.sleep(0.01)
        hub.min_islands = 2
        while not any(r.round >= 5 for r, _ in out.get(0, [])):
            time.sleep(0.01)
        shares.pop(2, None)
        thread(2, Announcing(hub), rejoin)

    _run_threads(
        [(thread, (i, hub.transport(), out), {}) for i in (0, 1)]
        + [(thread, (2, _DyingTransport(hub, die_at=3), first), {}), (survivors_then_restart, (), {})]
    )
    by_round = {r.round: r for r, _ in out[0]}
    assert by_round[3].participants == (0, 1) and by_round[3].redone >= 1  # the survivors kept round 3
    healed = [r for r, _ in rejoin[2] if r.healed]
    assert len(healed) == 1 and healed[0].weights[healed[0].participants.index(2)] == 0.0
    h = healed[0].round
    assert dict(shares[2])[h][healed[0].fragment] == 0.0  # it merged none of what it holds
    later = [r for r, _ in rejoin[2] if r.round > h]
    assert later and later[0].weights == (1.0, 1.0, 1.0)  # then it takes part
    for r, _ in out[1] + rejoin[2]:  # every participant holds the same merged aggregates
        assert r.agreed_sha256 == by_round[r.round].agreed_sha256, r.round
    for rnd, sh in shares[0]:
        rec = by_round[rnd]
        assert sh[rec.fragment] == pytest.approx(1.0 / sum(1 for w in rec.weights if w > 0)), rnd
    if F == 1:  # the in-process reference: weighted_mean with the rounds' weights (round k is sync k - 1)
        table = np.ones((steps // 2, N), np.float32)
        for r in by_round.values():
            table[r.round - 1] = [
                r.weights[r.participants.index(j)] if j in r.participants else 0.0 for j in range(N)
            ]
        ref = _reference(lambda: make_tx(table), steps)
        for r, anchor in out[0]:
            if r.round <= h:
                _assert_close_to(_row(anchor, 0), _row(ref[r.step - 1], 0))


# ------------------------------------------------ failures a review reproduced
def _wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the islands did not get there in time"
        time.sleep(0.01)


def _agreed_by_round(out):
    """{round: {agreed_sha256 of every island that recorded it}}."""
    seen = {}
    for recs in out.values():
        for r, _ in recs:
            seen.setdefault(r.round, set()).add(r.agreed_sha256)
    return seen


def test_a_healed_island_serves_the_state_it_healed_to():
    """Island 1 heals from island 2 in an attempt that fails (island 2 dies in its all-reduce); in the
    retry island 1 is the healing source of island 0, which joins then: island 0 must get the state
    island 1 healed to (the others'), not the one island 1 started with."""
    make_tx, steps = _maker({}), 10 * H
    hub = islands.LocalHub(min_islands=2, join_timeout=10.0, timeout=30.0)  # island 0 may start slowly
    out, errors, late = {}, {}, threading.Event()

    class DiesWhenThree(islands.LocalTransport):
        def allreduce(self, buf):
            if len(self.members()) == 3 and not late.is_set():  # island 1 has just healed from this one
                self.hub.min_islands = 3  # the retry waits for a third island: island 0, started now
                late.set()
                self.hub.kill(self.island_id)
            return super().allreduce(buf)

    def run(i, transport, after=None):
        if after is not None:
            after()
        _island_thread(i, make_tx, transport, steps, out, errors=errors)

    _run_threads(
        [
            (run, (2, DiesWhenThree(hub)), {}),
            (run, (3, hub.transport()), {}),
            (run, (1, hub.transport(), lambda: _wait_until(lambda: len(out.get(3, [])) >= 3)), {}),
            (run, (0, hub.transport(), lambda: _wait_until(late.is_set)), {}),
        ]
    )
    assert errors == {}, errors
    first0, first1 = out[0][0][0], out[1][0][0]
    assert first1.healed and first0.healed and first0.round == first1.round
    assert first0.participants == (0, 1, 3) and first0.redone == 0
    for rnd, agreed in _agreed_by_round(out).items():
        assert len(agreed) == 1, rnd
    assert [r.round for r, _ in out[0]] == list(range(first0.round, steps // H + 1))


def test_a_second_live_island_with_an_id_in_use_is_refused():
    """A second live island 1 (a restart while the first still runs) is refused in its first round with
    a clear error; islands 0, 1 and 2 go on, every round of the three committed and agreed."""
    make_tx, steps = _maker({}), 8 * H
    hub = islands.LocalHub(min_islands=3, join_timeout=10.0, timeout=10.0)
    out, errors, twin_out, twin_errors = {}, {}, {}, {}

    def twin():
        _wait_until(lambda: len(out.get(0, [])) >= 2)
        _island_thread(1, make_tx, hub.transport(), steps, twin_out, errors=twin_errors)

    _run_threads(
        [(_island_thread, (i, make_tx, hub.transport(), steps, out), dict(errors=errors)) for i in range(3)]
        + [(twin, (), {})]
    )
    assert errors == {}, errors
    assert isinstance(twin_errors.get(1), islands.IslandRefused), twin_errors
    assert "island 1 is refused: its id is in use" in str(twin_errors[1])
    assert twin_out[1] == []  # refused in its first round: it recorded none
    for i in range(3):
        assert [r.round for r, _ in out[i]] == list(range(1, steps // H + 1)), i
        assert all(r.participants == (0, 1, 2) and not r.healed for r, _ in out[i]), i
    assert all(len(agreed) == 1 for agreed in _agreed_by_round(out).values())


@pytest.mark.parametrize("variant", ["sync_delay", "eager"])
def test_tokens_weights_are_fixed_when_the_round_launches(variant):
    """rule="tokens" with rounds beside the steps: an island's weight is the steps it trained since its
    previous launch, fixed at the launch, however far its steps run on while the round waits (island 1
    is slower). Equal islands weigh the same, and the anchors are the in-process mean's."""
    opts = {"sync_delay": 2} if variant == "sync_delay" else VARIANTS[variant]  # one step beside the round
    make_tx = _maker(opts)
    steps = (5 if opts.get("eager") else 4) * H + 1
    launch = make_tx().external.launch_phase
    hub, out = islands.LocalHub(min_islands=2, join_timeout=10.0), {}
    kw = dict(rule="tokens", tokens_per_step=1.0)
    _run_threads(
        [(_island_thread, (0, make_tx, hub.transport(), steps, out), kw)]
        + [(_island_thread, (1, make_tx, hub.transport(), steps, out), dict(kw, pause=0.02))]
    )
    ref = _reference(make_tx, steps, n=2)
    for i in (0, 1):
        for k, (rec, anchor) in enumerate(out[i]):
            f_launch = launch[rec.fragment]
            want = f_launch + 1 if rec.round <= len(launch) else H // len(launch)
            assert rec.weights == (want, want), (i, k, rec.weights)
            want_anchor = ref[rec.step - 1]
            if opts.get("eager"):
                anchor, want_anchor = _row(anchor, 0), _row(want_anchor, i)
            _assert_close_to(anchor, want_anchor)
        assert len(out[i]) >= 3


# ------------------------------------------------------------- late islands
LR, OUTER_LR, MU = 0.1, 0.7, 0.9


def _late_reference(rounds, steps_of, n=N):
    """Islands with SGD inside and Nesterov SGD outside, one explicit loop over rounds and islands.

    ``rounds``: per committed round (the join excluded), its members. An island trains from the anchor of
    the last round it was a member of (or the start), on its batches at the step counts it holds
    (``steps_of(i, r)``: those of its contribution to round ``r``); a round merges its members' pseudo-
    gradients, each against the anchor it started from, with weight H, and applies the mean to the
    current anchor. Returns the anchor after each round (NumPy)."""
    grad = jax.jit(jax.grad(_loss))
    anchor = {k: np.asarray(v, np.float64) for k, v in _params().items()}
    base = dict.fromkeys(range(n), 0)  # the round whose anchor each island trains from
    anchors, momentum = [anchor], {k: np.zeros_like(v) for k, v in anchor.items()}
    for r, members in enumerate(rounds, start=1):
        deltas = []
        for i in members:
            start = anchors[base[i]]
            p = {k: np.asarray(v, np.float32) for k, v in start.items()}
            for t in steps_of(i, r):
                g = grad(p, _batch(i, t))
                p = {k: np.asarray(p[k] - np.float32(LR) * np.asarray(g[k]), np.float32) for k in p}
            deltas.append({k: start[k] - p[k] for k in p})
        mean = {k: sum(d[k] for d in deltas) / len(deltas) for k in anchor}
        momentum = {k: mean[k] + MU * momentum[k] for k in anchor}
        anchor = {k: anchor[k] - OUTER_LR * (mean[k] + MU * momentum[k]) for k in anchor}
        anchors.append(anchor)
        for i in members:
            base[i] = r
    return anchors


def test_a_late_island_is_merged_not_healed():
    """Island 2 is held before its second launch until islands 0 and 1 have committed round 2 without
    it (they form it after the join timeout). Released, it asks first, and round 3 forms with all three:
    island 2 catches up (``caught_up``, not ``healed``): it takes the round's state from a peer and its
    own pseudo-gradient, taken from round 1's anchor, is merged with its weight (H tokens), as the explicit
    loop over islands computes. Every anchor after every round is the loop's; all three end identical."""
    make_tx = lambda: jd.diloco(  # noqa: E731
        optax.sgd(LR), sync_every=H, outer=optax.sgd(OUTER_LR, momentum=MU, nesterov=True)
    )
    steps = 4 * H
    hub, out = islands.LocalHub(min_islands=N, join_timeout=60.0), {}
    go = threading.Event()

    def release(rec, p, s):  # island 0's rounds: only round 2 forms without waiting for every live island
        if rec.round == 1:
            hub.min_islands, hub.join_timeout = 2, 0.3
        if rec.round == 2:
            hub.join_timeout = 60.0
            go.set()

    class Held(islands.LocalTransport):
        def quorum(self, timeout):
            if self.committed == 2 and not go.is_set():  # its second launch: round 2 forms without it
                assert go.wait(60)
            return super().quorum(timeout)

    kw = dict(rule="tokens", tokens_per_step=1.0)
    _run_threads(
        [
            (_island_thread, (0, make_tx, hub.transport(), steps, out, release), kw),
            (_island_thread, (1, make_tx, hub.transport(), steps, out), kw),
            (_island_thread, (2, make_tx, Held(hub), steps, out), kw),
        ]
    )
    members = {rec.round: rec.participants for rec, _ in out[0]}
    assert members == {1: (0, 1, 2), 2: (0, 1), 3: (0, 1, 2), 4: (0, 1, 2)}, members
    late = {rec.round: rec for rec, _ in out[2]}
    assert sorted(late) == [1, 3, 4]
    assert late[3].caught_up and not late[3].healed and late[3].weights == (H, H, H)
    assert not any(rec.healed for i in range(N) for rec, _ in out[i]), [
        (i, r.round, r.weights) for i in range(N) for r, _ in out[i] if r.healed
    ]
    assert [rec.round for i in (0, 1) for rec, _ in out[i] if rec.caught_up] == []

    def steps_of(i, r):  # island 2's contribution to round 3 is its steps of round 2's count
        return range((2 if (i, r) == (2, 3) else r) * H - H, (2 if (i, r) == (2, 3) else r) * H)

    ref = _late_reference([members[r] for r in (1, 2, 3, 4)], steps_of)
    for i in range(N):
        for rec, anchor in out[i]:
            _assert_close_to(anchor, ref[rec.round], tol=2e-6)
    assert len({out[i][-1][0].anchor_sha256 for i in range(N)}) == 1


def test_an_island_rejects_a_donating_step():
    """A donating step would consume the state a peer heals from while the next steps run."""
    tx = jd.diloco(optax.sgd(0.1), sync_every=2)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True, donate=True)
    with pytest.raises(ValueError, match="donate=True"):
        islands.island(step, islands.LocalHub().transport(), island_id=0)


class _Stubborn(islands.Transport):
    """A link on which no attempt commits: every all-reduce fails at once; a quorum takes
    ``quorum_seconds`` (past its ``timeout``: IslandsError, as a real one). Fits the transport
    interface before and after the round protocol's rewrite."""

    exchange_seconds = 0.2

    def __init__(self, quorum_seconds=0.0):
        self.quorum_seconds, self.attempts, self.first = quorum_seconds, [], None

    def bind(self, island_id, serve, load=None):
        del island_id, serve, load

    def quorum(self, timeout=None):
        self.first = self.first or time.monotonic()
        if timeout is not None and self.quorum_seconds > timeout:
            time.sleep(timeout)
            raise islands.IslandsError(f"no quorum within {timeout} s")
        time.sleep(self.quorum_seconds)
        return None

    def allreduce(self, buf):
        self.attempts.append(time.monotonic())
        raise islands.ExchangeError("a member died")

    def commit(self, ok=False):
        return False

    def abort(self, reason):
        del reason

    def fall_behind(self):
        pass

    def rounds_committed(self):
        return 0


@pytest.mark.parametrize("quorum_seconds", [0.0, 5.0])
def test_retries_back_off_and_the_round_timeout_bounds_the_whole_round(quorum_seconds):
    """A round that cannot commit ends within round_timeout (1 s; + 0.3 s of slack), its quorum included
    (a quorum that would take 5 s is cut short), after a few attempts spaced by a growing, jittered pause."""
    transport = _Stubborn(quorum_seconds)
    step = _step(jd.diloco(optax.sgd(0.1), sync_every=2))
    isl = islands.island(step, transport, island_id=0, round_timeout=1.0)
    with pytest.raises(islands.IslandsError, match="did not commit within|no quorum within"):
        isl.init(_params())
    ended = time.monotonic()
    assert ended - transport.first <= 1.0 + 0.3
    if quorum_seconds == 0.0:
        gaps = np.diff(transport.attempts)
        assert 3 <= len(transport.attempts) <= 12, len(transport.attempts)
        assert gaps[-1] > gaps[0] and len({round(g, 4) for g in gaps}) == len(gaps), gaps


class _Garbling(islands.LocalTransport):
    """Reads a wrong sum once, in round ``at`` (a corrupted receive, a faulty host): its anchor leaves the others'."""

    def __init__(self, hub, at):
        super().__init__(hub)
        self.at = at

    def allreduce(self, buf):
        total = super().allreduce(buf)
        if self.committed == self.at:
            self.at = -1
            total[0] += 1.0
        return total


def test_an_island_whose_anchor_left_the_majority_heals_from_it():
    """Island 2's anchor differs from islands 0 and 1's after round 2: in round 3 it falls behind and heals
    from them (weight 0), and from then on all three agree; nobody gives up."""
    make_tx, steps = _maker({}), 6 * H
    hub, out, errors = islands.LocalHub(min_islands=3, join_timeout=10.0, timeout=10.0), {}, {}
    transports = [hub.transport(), hub.transport(), _Garbling(hub, at=2)]
    _run_threads(
        [(_island_thread, (i, make_tx, transports[i], steps, out), dict(errors=errors)) for i in range(3)]
    )
    assert errors == {}, errors
    r2 = {i: [r for r, _ in out[i] if r.round == 2][0] for i in range(3)}
    assert r2[0].anchor_sha256 == r2[1].anchor_sha256 != r2[2].anchor_sha256  # the fault
    r3 = [r for r, _ in out[2] if r.round == 3][0]
    assert r3.healed and r3.weights == (1.0, 1.0, 0.0) and r3.redone >= 1
    for rnd, agreed in _agreed_by_round(out).items():
        assert rnd == 2 or len(agreed) == 1, rnd
    assert [r.round for r, _ in out[2]] == list(range(1, steps // H + 1))


def test_islands_with_other_settings_are_refused_naming_the_difference():
    """At the join, island 2 (sync_every 2H) is outside the majority: refused, naming sync_every. Later,
    island 3 (a wider model) heals from the others and is refused, naming the model. Islands 0 and 1
    go on unchanged."""
    steps = 6 * H
    hub, out, errors = islands.LocalHub(min_islands=3, join_timeout=10.0, timeout=10.0), {}, {}
    other_h = lambda: jd.diloco(optax.adam(0.05), sync_every=2 * H)  # noqa: E731
    bound = threading.Event()

    class Announcing(islands.LocalTransport):
        def bind(self, *args):
            super().bind(*args)
            bound.set()

    def wider(i, transport):
        _wait_until(lambda: 2 in errors)
        hub.min_islands = 2  # islands 0 and 1 go on alone
        mesh = jax.make_mesh((1,), ("data",), devices=[jax.devices()[i]])
        step = jd.data_parallel_step(_loss, _maker({})(), mesh=mesh, per_worker_params=True)
        params = {"w1": jnp.zeros((5, 9)), "w2": jnp.zeros((9, 2))}
        try:
            islands.island(step, transport, island_id=i).init(params)
        except islands.IslandsError as e:
            errors[i] = e

    def waits_for_3(rec, p, s):  # islands 0 and 1 ask for round 3 once island 3 is up
        del p, s
        if rec.round == 2:
            assert bound.wait(60)

    kw = dict(errors=errors, on_sync_too=waits_for_3)
    _run_threads(
        [(_island_thread, (i, _maker({}), hub.transport(), steps, out), kw) for i in (0, 1)]
        + [(_island_thread, (2, other_h, hub.transport(), steps, out), dict(errors=errors))]
        + [(wider, (3, Announcing(hub)), {})]
    )
    assert sorted(errors) == [2, 3], errors
    assert isinstance(errors[2], islands.IslandRefused)
    assert "from the majority's: sync_every is 8 here and 4 on island 0" in str(errors[2]), errors[2]
    assert isinstance(errors[3], islands.IslandRefused)
    assert "the model's parameter shapes or dtypes differ from its healing source's" in str(errors[3]), (
        errors[3]
    )
    for i in (0, 1):
        assert [r.round for r, _ in out[i]] == list(range(1, steps // H + 1)), i
        assert all(r.participants == (0, 1) for r, _ in out[i]), i


def test_a_round_commits_only_when_every_member_exchange_succeeded():
    """Island 2's all-reduce of round 3 fails after islands 0 and 1 have their sum: none of the three
    commits that attempt (their vote fails), all three redo it, and nobody heals or is left behind."""
    make_tx, steps = _maker({}), 5 * H
    hub, out, errors = islands.LocalHub(min_islands=3, join_timeout=10.0, timeout=10.0), {}, {}

    class FailsOnce(islands.LocalTransport):
        def allreduce(self, buf):
            if self.committed == 3 and not getattr(self, "failed", False):
                self.failed = True
                self.hub.fail_exchange(self.island_id)
            return super().allreduce(buf)

    transports = [hub.transport(), hub.transport(), FailsOnce(hub)]
    _run_threads(
        [(_island_thread, (i, make_tx, transports[i], steps, out), dict(errors=errors)) for i in range(3)]
    )
    assert errors == {}, errors
    for i in range(3):
        assert [r.round for r, _ in out[i]] == list(range(1, steps // H + 1)), i
        assert not any(r.healed for r, _ in out[i]), i
        r3 = [r for r, _ in out[i] if r.round == 3][0]
        assert r3.participants == (0, 1, 2) and r3.redone >= 1, (i, r3)
    assert all(len(agreed) == 1 for agreed in _agreed_by_round(out).values())


# ------------------------------------------------------------------------ errors
def _step(tx, n=1, per_worker=True):
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    return jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=per_worker)


def test_island_rejects_what_it_cannot_run():
    hub = islands.LocalHub()
    with pytest.raises(ValueError, match="whose `tx` is a jaxopt_dist.diloco"):
        islands.island(
            _step(optax.chain(jd.all_reduce(), optax.sgd(0.1)), per_worker=False),
            hub.transport(),
            island_id=0,
        )
    with pytest.raises(ValueError, match="must have size 1"):
        islands.island(_step(jd.diloco(optax.sgd(0.1), sync_every=2), n=2), hub.transport(), island_id=0)
    with pytest.raises(ValueError, match="per_worker_params=True"):
        islands.island(
            _step(jd.diloco(optax.sgd(0.1), sync_every=2), per_worker=False), hub.transport(), island_id=0
        )
    tx = jd.diloco(optax.sgd(0.1), sync_every=2)
    with pytest.raises(ValueError, match="`island_id` must be in"):
        islands.island(_step(tx), hub.transport(), island_id=64)
    with pytest.raises(ValueError, match="`rule` must be one of"):
        islands.island(_step(tx), hub.transport(), island_id=0, rule="rda")
    robust = jd.diloco(optax.sgd(0.1), sync_every=2, aggregate=jd.trimmed_mean(1))
    with pytest.raises(ValueError, match=r"counts every island's contribution once.*use rule='mean'"):
        islands.island(_step(robust), hub.transport(), island_id=0, rule="tokens")


def test_islands_with_different_models_fail_clearly():
    """Two islands whose first anchors differ (no majority, nothing trained yet): each leaves at once,
    saying that the islands did not start from the same parameters."""
    hub, errors = islands.LocalHub(min_islands=2, join_timeout=1.0, timeout=3.0), {}

    def run(i):
        mesh = jax.make_mesh((1,), ("data",), devices=[jax.devices()[i]])
        step = jd.data_parallel_step(
            _loss, jd.diloco(optax.sgd(0.1), sync_every=H), mesh=mesh, per_worker_params=True
        )
        isl = islands.island(step, hub.transport(), island_id=i, round_timeout=10.0)
        params = jax.tree.map(lambda x: x + i, _params())  # islands that do not share an initialization
        try:
            isl.init(params)
        except islands.IslandsError as e:
            errors[i] = str(e)

    _run_threads([(run, (i,), {}) for i in range(2)])
    assert sorted(errors) == [0, 1], errors
    for i, e in errors.items():
        assert f"island {i} leaves: the members' anchors differ" in e, e
        assert "did every island start from the same ones?" in e, e


def test_an_island_over_two_devices_is_the_one_device_island():
    """Inside an island the step is unchanged: dense data parallelism over its own two devices
    (``batch_axes``) gives the anchors of the one-device island, to float rounding."""
    out = {}

    def run(i, hub, two):
        tx = jd.diloco(optax.adam(0.05), sync_every=H)
        if two:
            mesh = jax.make_mesh((1, 2), ("data", "replica"), devices=jax.devices()[2 * i : 2 * i + 2])
            kw = dict(param_specs=jax.P(), batch_axes="replica")
        else:
            mesh, kw = jax.make_mesh((1,), ("data",), devices=[jax.devices()[i]]), {}
        step = jd.data_parallel_step(_loss, tx, mesh=mesh, per_worker_params=True, **kw)
        isl = islands.island(step, hub.transport(), island_id=i)
        p, s = isl.init(_params())
        for t in range(2 * H + 1):
            p, s, _ = isl(p, s, _batch(i, t))
        isl.finish()
        out[(i, two)] = jax.device_get(s.anchor)

    for two in (False, True):
        hub = islands.LocalHub(min_islands=2, join_timeout=10.0)
        _run_threads([(run, (i, hub, two), {}) for i in range(2)])
    _assert_close_to(out[(0, True)], out[(0, False)])
    helpers.assert_trees_equal(out[(0, True)], out[(1, True)])


FSDP = {"w1": jax.P(None, "fsdp"), "w2": jax.P("fsdp", None)}


# quantized (a per-worker residual in the aggregate state, sharded too) compiles slowly: its islands
# with replicated parameters are the ones test_islands_match_in_process_diloco checks against the reference.
@pytest.mark.parametrize(
    "variant, replicated_too", [("diloco", True), ("streaming_delay", True), ("quantized", False)]
)
def test_islands_with_fsdp_sharded_parameters_match_replicated_ones(variant, replicated_too):
    """Each island shards its parameters (and their state) over its own two devices ("fsdp", the batch
    split over them too): the anchors are those of replicated parameters and of the in-process run
    (to float rounding: the sharded step sums in another order), and every leaf keeps the step's
    sharding through the rounds (the island's exchange and landing programs leave the model axes to
    the compiler)."""
    make_tx, steps = _maker(VARIANTS[variant]), 2 * H + 1
    out, placed = {}, {}

    def run(i, hub, specs):
        mesh = jax.make_mesh((1, 2), ("data", "fsdp"), devices=jax.devices()[2 * i : 2 * i + 2])
        step = jd.data_parallel_step(
            _loss, make_tx(), mesh=mesh, per_worker_params=True, param_specs=specs, batch_axes="fsdp"
        )
        seen = []
        isl = islands.island(
            step, hub.transport(), island_id=i, on_sync=lambda rec, p, s: seen.append(rec.step)
        )
        p, s = isl.init(_params())
        before = jax.tree.map(lambda x: x.sharding, (p, s))
        for t in range(steps):
            p, s, _ = isl(p, s, _batch(i, t))
        isl.finish()
        out[(i, specs is FSDP)] = (seen, jax.device_get(s.anchor))
        placed[(i, specs is FSDP)] = (before, jax.tree.map(lambda x: x.sharding, (p, s)), s.anchor)

    for specs in (FSDP, jax.P()) if replicated_too else (FSDP,):
        hub = islands.LocalHub(min_islands=2, join_timeout=10.0)
        _run_threads([(run, (i, hub, specs), {}) for i in range(2)])
    ref = _reference(make_tx, steps, n=2)
    seen, anchor = out[(0, True)]
    assert len(seen) == 2 * len(make_tx().external.launch_phase)
    if replicated_too:
        _assert_close_to(anchor, out[(0, False)][1])
    _assert_close_to(anchor, ref[steps - 1])
    helpers.assert_trees_equal(anchor, out[(1, True)][1])
    for i in range(2):
        before, after, final_anchor = placed[(i, True)]
        assert after == before  # params, anchor, inner, outer and aggregate states: as the step placed them
        assert final_anchor["w1"].sharding.spec == jax.P(None, "fsdp")
        assert final_anchor["w2"].sharding.spec == jax.P("fsdp", None)


class _StandInManager:
    """Just what TorchftTransport.quorum reads of torchft's Manager: a quorum that may heal
    this island (calling its load with the source's state) and move its step to ``to_step``."""

    def __init__(self, step, heal_to=None):
        self.step, self.heal_to, self.load = step, heal_to, None
        self._quorum_future = None

    def start_quorum(self, timeout=None):
        if self.heal_to is not None:
            self.load({"from": "peer"})
            self.step = self.heal_to

    def errored(self):
        return None

    def current_step(self):
        return self.step


@pytest.mark.parametrize("heal_to, healed", [(None, False), (7, False), (9, True)])
def test_torchft_transport_passes_on_only_a_heal_that_moves_the_step(heal_to, healed):
    """torchft heals an island whose quorum request carried an older step than it has now (a stale
    renewal): at step 7 with the quorum's step 7, the island keeps its own state."""
    transport = islands.torchft_transport("127.0.0.1:1", requery=0.01, quorum_timeout=1.0)
    manager = _StandInManager(7, heal_to)
    transport._manager = manager  # no torch: the manager's part is played by the stand-in
    manager.load = transport._received_state
    transport._answer_roll_call = lambda before, able: None  # needs a process group (test_islands_torchft)
    got = transport.quorum(1.0)
    assert (got is not None) is healed
    if healed:
        assert got.state == {"from": "peer"}


def test_torchft_transport_roll_call_defaults_to_5_s_or_the_timeout_and_refuses_nonpositive():
    assert islands.torchft_transport("127.0.0.1:1").roll_call_seconds == 5.0
    assert islands.torchft_transport("127.0.0.1:1", timeout=2.0).roll_call_seconds == 2.0
    assert islands.torchft_transport("127.0.0.1:1", timeout=2.0, roll_call=7.0).roll_call_seconds == 7.0
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="`roll_call` must be > 0 seconds"):
            islands.torchft_transport("127.0.0.1:1", roll_call=bad)


def test_a_healing_state_crosses_http_raw_without_pickle():
    """The healing wire: nested dicts and lists of arrays (0-d, bfloat16, bool) and plain values, served on
    one address under a step, fetched within a deadline and a size limit; anything else is refused."""
    from jaxopt_dist._src.islands import heal_http

    rng = np.random.default_rng(0)
    state = {
        "user": {
            "params": [
                rng.normal(size=(3, 4)).astype(np.float32),
                np.full((), 2.5, np.float32),
                np.float64(3.0),
            ]
        },
        "torchft": {"step": 7, "batches_committed": 21},
        "more": [jnp.arange(5, dtype=jnp.bfloat16), np.array([True, False]), "text", None, 1.5],
    }
    server = heal_http.HealServer("127.0.0.1")
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/heal/")
        server.stage(7, state)
        got = heal_http.fetch(server.url + "7", deadline=time.monotonic() + 10)
        helpers.assert_trees_equal(got["user"], state["user"])
        assert got["user"]["params"][1].shape == () and got["torchft"] == state["torchft"]
        assert got["more"][0].dtype == jnp.bfloat16 and got["more"][2:] == ["text", None, 1.5]
        np.testing.assert_array_equal(got["more"][0], state["more"][0])
        with pytest.raises(islands.ExchangeError, match="404"):  # another step than the one staged
            heal_http.fetch(server.url + "6", deadline=time.monotonic() + 10)
        with pytest.raises(islands.ExchangeError, match="at most 10 are expected"):
            heal_http.fetch(server.url + "7", deadline=time.monotonic() + 10, limit=10)
        with pytest.raises(islands.ExchangeError, match="no time was left"):
            heal_http.fetch(server.url + "7", deadline=time.monotonic() - 1)
        # A peer may ask before this island's quorum has staged the step: it waits for it.
        threading.Timer(0.3, server.stage, (8, {"late": np.arange(3)})).start()
        got = heal_http.fetch(server.url + "8", deadline=time.monotonic() + 10)
        np.testing.assert_array_equal(got["late"], np.arange(3))
        with pytest.raises(TypeError, match="numbers only"):
            server.stage(8, {"x": np.array([object()])})
    finally:
        server.close()


def test_the_documented_buffer_size_is_the_packed_one():
    """islands.island's docstring gives the floats a round adds to the fragment: 1 + 16 * num_slots."""
    assert "``1 + 16 * num_slots`` floats" in islands.island.__doc__
    for n in (4, 64):
        assert islands.pack([np.ones(3)], 1.0, slot=0, num_slots=n).size == 3 + 1 + 16 * n


@pytest.mark.parametrize("variant", ["mean_wrong_secret", "sparseloco_no_secret"])
def test_a_secret_drops_an_untagged_island_and_the_others_keep_their_rounds(variant):
    """Under a shared secret the mean goes over the gather path too: an island with another secret (or,
    where the aggregate is encoded anyway, none) takes part in the quorum, but its contributions are
    dropped (named in every record's ``rejected``) and the others' rounds are the in-process run of the
    others alone, losing none."""
    make_tx = _maker({} if variant.startswith("mean") else {"aggregate": "chunked_top_k"})
    steps = 2 * H + 1
    ref = _reference(make_tx, steps, n=2)
    hub, out = islands.LocalHub(min_islands=N, join_timeout=10.0), {}
    secret = b"islands-shared-secret"
    other = b"another-secret-entirely" if variant.startswith("mean") else None
    transports = [hub.transport(secret=secret), hub.transport(secret=secret), hub.transport(secret=other)]
    _run_threads(
        [(_island_thread, (i, make_tx, transports[i], steps, out), {"round_timeout": 90}) for i in range(N)]
    )
    why = "tag is wrong" if other else "carries no tag"
    for i in (0, 1):
        assert len(out[i]) == 2
        for rec, anchor in out[i]:
            # An island without the secret merges the others' contributions with its own, so its anchor
            # leaves the majority's: its vote to heal costs one attempt, not the round.
            assert rec.participants == (0, 1) and rec.redone <= (0 if other else 1)
            assert {r[0] for r in rec.rejected} == {2} and why in rec.rejected[0][1]
            _assert_close_to(anchor, ref[rec.step - 1])
    assert [r.anchor_sha256 for r, _ in out[0]] == [r.anchor_sha256 for r, _ in out[1]]


class _Announcing(islands.LocalTransport):
    """Sets ``bound`` once its island has joined the hub."""

    def __init__(self, hub, bound, secret=None):
        super().__init__(hub, secret=secret)
        self.bound = bound

    def bind(self, *args):
        super().bind(*args)
        self.bound.set()


class _TamperingOnce(islands.LocalTransport):
    """Serves, the first time a peer heals from it, a state whose anchor is not the one its round's
    members agreed on (every float of its optimizer state moved by 1: a corrupted source)."""

    def __init__(self, hub, secret, served):
        super().__init__(hub, secret=secret)
        self.served = served

    def bind(self, island_id, serve, expect=None):
        def tampered():
            state = serve()
            if not self.served.is_set():
                self.served.set()
                moved = [x + 1 if np.issubdtype(x.dtype, np.floating) else x for x in state["opt_state"]]
                state = {**state, "opt_state": moved}
            return state

        super().bind(island_id, tampered, expect)


def test_a_healing_state_whose_anchor_is_not_the_agreed_one_is_refused_and_the_others_go_on():
    """Island 2 starts late and heals from island 0, whose first served state does not match the digest
    its round's members agreed on: island 2 refuses it (naming island 0 and the anchor), abstains from
    that attempt, so islands 0 and 1 commit their round at once (not redone, no timeout waited), and
    heals in the next round; from then on the three agree bit for bit."""
    make_tx, steps = _maker({}), 10 * H
    secret = b"islands-shared-secret"  # under a secret rounds gather, so a refused heal can abstain
    hub = islands.LocalHub(min_islands=2, join_timeout=2.0, timeout=20.0)  # a quorum waits for all three
    out, errors, served, bound = {}, {}, threading.Event(), threading.Event()

    def late(i, transport):
        _wait_until(lambda: len(out.get(0, [])) >= 2)
        _island_thread(i, make_tx, transport, steps, out, errors=errors)

    def waits_for_it(rec, p, s):  # the first two go on once island 2 is up (a loaded machine)
        del p, s
        if rec.round == 3:
            assert bound.wait(60)

    transports = [_TamperingOnce(hub, secret, served), hub.transport(secret=secret)]
    _run_threads(
        [(_island_thread, (i, make_tx, transports[i], steps, out, waits_for_it), {}) for i in (0, 1)]
        + [(late, (2, _Announcing(hub, bound, secret=secret)), {})]
    )
    assert errors == {} and served.is_set(), errors
    first = out[2][0][0]
    assert first.healed, first
    refusals = [r for r in first.rejected if r[0] == 0]
    assert refusals and "anchor's SHA-256" in refusals[0][1] and "agreed on" in refusals[0][1], first
    assert "is refused" in refusals[0][1]
    before = [r for r, _ in out[0] if r.round < first.round]
    assert all(r.redone == 0 and r.seconds < hub.timeout for r in before), before
    for rnd, agreed in _agreed_by_round(out).items():
        assert len(agreed) == 1, rnd
    assert out[2][-1][0].round == out[0][-1][0].round == steps // H


def test_an_island_without_the_secret_cannot_heal_nor_hold_the_others_back():
    """An island started late with another secret refuses every healing state (its tag is wrong) and
    abstains from every attempt until it leaves; the others commit every round without redoing one."""
    make_tx, steps = _maker({}), 6 * H
    secret = b"islands-shared-secret"
    hub = islands.LocalHub(min_islands=2, join_timeout=0.5, timeout=5.0)
    out, errors, refusals, bound = {}, {}, [], threading.Event()

    class Noting(_Announcing):
        def quorum(self, timeout):
            try:
                return super().quorum(timeout)
            except islands.HealRefused as e:
                refusals.append(str(e))
                raise

    def late(i, transport):
        _wait_until(lambda: len(out.get(0, [])) >= 1)
        _island_thread(i, make_tx, transport, steps, out, errors=errors, round_timeout=12.0)

    def waits_for_it(rec, p, s):
        del p, s
        if rec.round == 2:
            assert bound.wait(60)

    _run_threads(
        [(_island_thread, (i, make_tx, hub.transport(secret=secret), steps, out, waits_for_it), {})
         for i in (0, 1)]
        + [(late, (2, Noting(hub, bound, secret=b"another-secret-entirely")), {})]
    )  # fmt: skip
    assert isinstance(errors.get(2), islands.IslandsError) and out[2] == [], errors
    assert refusals and all("tag is wrong" in r and "is refused" in r for r in refusals), refusals
    for i in (0, 1):
        assert [r.round for r, _ in out[i]] == list(range(1, steps // H + 1))
        assert all(r.redone == 0 and r.participants == (0, 1) for r, _ in out[i])
    assert [r.anchor_sha256 for r, _ in out[0]] == [r.anchor_sha256 for r, _ in out[1]]


def test_a_round_logs_how_long_its_island_waited_for_it_to_form():
    """Island 1 pauses 0.1 s after each inner step, island 0 not at all: each round after the first,
    island 0 waits for island 1 about H x 0.1 s (``waited_seconds``, at least its longest quorum wait),
    and island 1, the last to ask, hardly waits."""
    make_tx, steps = _maker({}), 4 * H
    hub, out = islands.LocalHub(min_islands=2, join_timeout=10.0, timeout=10.0), {}
    pauses = [0.0, 0.1]
    _run_threads(
        [(_island_thread, (i, make_tx, hub.transport(), steps, out), dict(pause=pauses[i])) for i in range(2)]
    )
    for i in range(2):
        for rec, _ in out[i]:
            assert rec.waited_seconds >= rec.quorum_seconds >= 0.0, rec
    later = [[rec for rec, _ in out[i] if rec.round >= 2] for i in range(2)]
    assert len(later[0]) == len(later[1]) == steps // H - 1
    assert all(r.waited_seconds >= 0.5 * H * pauses[1] for r in later[0]), [
        r.waited_seconds for r in later[0]
    ]
    assert max(r.waited_seconds for r in later[1]) < min(r.waited_seconds for r in later[0])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--slow", "0.5", "--step-sleep", "0.1"], "--slow must be >= 1"),
        (["--slow", "2"], "--step-sleep > 0"),
    ],
)
def test_the_example_refuses_a_slow_factor_it_cannot_apply(flags, message, capsys):
    with pytest.raises(SystemExit):
        EXAMPLE.parse_args(["--island-id", "0", "--lighthouse", "127.0.0.1:1", *flags])
    assert message in capsys.readouterr().err
    args = EXAMPLE.parse_args(
        ["--island-id", "0", "--lighthouse", "127.0.0.1:1", "--slow", "2", "--step-sleep", "0.1"]
    )
    assert args.slow == 2.0


def test_waited_adds_every_quorum_wait_of_a_round_where_quorum_seconds_keeps_the_longest():
    waits = protocol.Waits()
    for seconds in (0.5, 2.0, 0.25):
        waits.note("quorum", seconds)
    waits.note("heal", 3.0)
    assert (waits.quorum, waits.waited, waits.heal) == (2.0, 2.75, 3.0)
