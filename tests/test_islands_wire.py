"""The islands' wire: aggregates' encoded messages, sealed records and the gathered merge (no torch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxopt_dist as jd
from jaxopt_dist import islands
from jaxopt_dist._src import base
from jaxopt_dist._src.islands import gather, landing, merge, wire

N = 3
_LIKE = [jnp.zeros((8, 16)), jnp.zeros((40,)), jnp.zeros((8, 16))]


def _aggregates():
    return {
        "low_bit": lambda: jd.low_bit(),
        "statistical_quantize": lambda: base.two_stage_of(jd.statistical_quantize(2)).first,
        "chunked_top_k_2bit": lambda: jd.chunked_top_k(4, chunk=8, bits=2),
        "top_k": lambda: jd.top_k(k=5),
        "top_k_flat": lambda: jd.top_k(k=7, per_leaf=False),
        "top_k_flat_dense": lambda: jd.top_k(k=sum(x.size for x in _LIKE), per_leaf=False),
        "random_k": lambda: jd.random_k(k=5),
    }


def _updates(seed: int, n: int) -> list[jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), len(_LIKE))
    return [jax.random.normal(k, (n, *x.shape)) for k, x in zip(keys, _LIKE)]


def _coded(w):
    """The wire's encoding and decoding, jitted (one program each, not an op at a time)."""
    return jax.jit(w.encode), jax.jit(lambda m, s: w.decode(m, _LIKE, s))


def _decoded(coded, xi, si, island: int, weight: float = 1.0) -> gather.Decoded:
    encode, decode = coded
    message = [np.asarray(m) for m in encode(xi, si)]
    values, support = decode(message, si)
    support = None if support is None else [np.asarray(s) for s in support]
    return gather.Decoded(island, weight, [np.asarray(v) for v in values], support)


@pytest.mark.parametrize("name", sorted(_aggregates()))
def test_a_decoded_message_is_the_update_on_one_worker_bit_for_bit(name):
    tx = _aggregates()[name]()
    w = base.wire_of(tx)
    assert w is not None
    state = tx.init(_LIKE)
    encode, decode = _coded(w)
    update = jax.jit(jax.vmap(tx.update, axis_name="data", axis_size=1, in_axes=None))
    for step in range(2):  # the second step reads the residual the first left
        x = [u[0] for u in _updates(step, 1)]
        ref, new_state = update(x, state)
        values, _ = decode([np.asarray(m) for m in encode(x, state)], state)
        for v, r in zip(values, ref):
            np.testing.assert_array_equal(np.asarray(v), np.asarray(r[0]))
        state = jax.tree.map(lambda a: a[0], new_state)


@pytest.mark.parametrize(
    "name", ["statistical_quantize", "chunked_top_k_2bit", "top_k", "top_k_flat", "random_k"]
)
def test_gathered_messages_combined_in_island_order_are_the_in_process_mean(name):
    tx = _aggregates()[name]()
    w = base.wire_of(tx)
    state = jax.tree.map(lambda a: jnp.stack([a] * N), tx.init(_LIKE))
    x = _updates(7, N)
    ref, _ = jax.jit(jax.vmap(tx.update, axis_name="data"))(x, state)
    row = lambda t, i: jax.tree.map(lambda a: a[i], t)  # noqa: E731
    coded = _coded(w)
    decoded = [_decoded(coded, row(x, i), row(state, i), i) for i in range(N)]
    merged = gather.weighted_mean(decoded, _LIKE)
    for m, r in zip(merged, ref):
        np.testing.assert_allclose(m, np.asarray(r[0]), rtol=0, atol=3e-7)
    again = gather.weighted_mean(decoded, _LIKE)  # the same inputs, the same bits
    assert all(np.array_equal(a, b) for a, b in zip(merged, again))


def test_encoded_messages_are_smaller_than_float32():
    sizes = {}
    for name, make in _aggregates().items():
        tx = make()
        message = jax.jit(base.wire_of(tx).encode)([u[0] for u in _updates(0, 1)], tx.init(_LIKE))
        sizes[name] = sum(np.asarray(m).nbytes for m in message)
    dense = 4 * sum(x.size for x in _LIKE)
    assert sizes.pop("top_k_flat_dense") == dense  # k = every entry: the flat vector itself
    assert all(v < dense for v in sizes.values()), (sizes, dense)
    assert sizes["low_bit"] <= dense / 5


def test_a_median_clipped_chunked_top_k_names_a_merge_islands_do_not_make():
    assert base.wire_of(jd.chunked_top_k(4, chunk=8, clip_to_median_norm=True)).merge != "chosen_mean"


@pytest.mark.parametrize(
    "make",
    [
        lambda: jd.diloco(
            jd.sgd(0.1), sync_every=2, aggregate=jd.chunked_top_k(4, chunk=8, clip_to_median_norm=True)
        ),
        lambda: jd.sparseloco(jd.sgd(0.1), sync_every=2, topk=4, chunk=8, clip_to_median_norm=True),
    ],
)
def test_an_island_refuses_an_aggregate_whose_merge_it_does_not_make(make):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    loss = lambda p, b: jnp.sum(p["w"] * b)  # noqa: E731
    step = jd.data_parallel_step(loss, make(), mesh=mesh, per_worker_params=True)
    with pytest.raises(ValueError, match="median_clipped_chosen_mean.*clip_to_median_norm=False"):
        islands.island(step, islands.LocalHub().transport(), island_id=0)


# ------------------------------------------------------------------ records

SECRET = b"0123456789abcdef-shared"
_LAYOUT = wire.Layout.of([np.zeros(5, np.uint8), np.zeros((2, 3), np.float32)])
_LAYOUTS = {-1: wire.Layout(()), 0: _LAYOUT}


def _header(island=1, weight=1.0, **kw):
    return wire.Header(
        island=island, round=4, fragment=0, weight=weight, anchor=77, joined=0, nonce=5, settings=(1, 2),
        layout=_LAYOUT.tag, **kw,
    )  # fmt: skip


def _message(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, 5).astype(np.uint8), rng.normal(size=(2, 3)).astype(np.float32)]


def _seal(secret=SECRET, **kw):
    return wire.seal(_header(**kw), _message(), size=wire.record_size(list(_LAYOUTS.values())), secret=secret)


def test_a_sealed_record_opens_to_its_header_and_arrays():
    got = wire.open_record(_seal(), layouts=_LAYOUTS, secret=SECRET)
    assert isinstance(got, wire.Opened)
    assert (got.header.island, got.header.round, got.header.settings[:2]) == (1, 4, (1, 2))
    for a, b in zip(got.message, _message()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("no tag", "carries no tag"),
        ("other secret", "tag is wrong"),
        ("flipped payload", "tag is wrong"),
        ("lying length", "header gives a payload of"),
        ("truncated", "a record of"),
        ("not a record", "not a contribution"),
    ],
)
def test_a_bad_record_is_refused_with_its_reason(case, reason):
    rec = _seal(secret={"no tag": None, "other secret": b"another-secret-of-16+"}.get(case, SECRET))
    head = wire.HEADER.size
    if case == "flipped payload":
        rec[head + 2] ^= 1
    if case == "lying length":  # the header says more bytes than the fragment's encoding has
        rec[head - 8 : head] = np.frombuffer(np.uint64(_LAYOUT.nbytes + 4).tobytes(), np.uint8)
        rec[-wire.TAG_BYTES :] = np.frombuffer(
            wire.tag(
                SECRET, b"contribution", rec[:head].tobytes(), rec[head : head + _LAYOUT.nbytes + 4].tobytes()
            ),
            np.uint8,
        )
    if case == "truncated":
        rec = rec[:-3]
    if case == "not a record":
        rec[:8] = np.frombuffer(b"\x80\x04\x95junk!", np.uint8)
    got = wire.open_record(rec, layouts=_LAYOUTS, secret=SECRET)
    assert isinstance(got, wire.Rejected), case
    assert reason in got.reason, got.reason


def test_without_a_secret_records_carry_zeros_and_open():
    got = wire.open_record(_seal(secret=None), layouts=_LAYOUTS, secret=None)
    assert isinstance(got, wire.Opened)


def test_secret_checks():
    assert wire.check_secret(None) is None
    with pytest.raises(ValueError, match="at least 16 bytes"):
        wire.check_secret(b"short")


def test_combine_drops_a_bad_record_and_merges_the_rest_in_island_order():
    like = [np.zeros((2, 3), np.float32)]

    def decode(fragment, message, state):
        del fragment, state
        return [message[1]], None

    ex = gather.Exchange(SECRET, dict(_LAYOUTS), decode, {0: like})
    records = [ex.seal(_header(island=i), _message(i)) for i in (2, 0)]
    forged = wire.seal(_header(island=1), _message(9), size=ex.size, secret=b"not-the-islands-secret")
    got = gather.combine([records[0], forged, records[1]], ex, 0, num_slots=4)
    assert [r.island for r in got.rejected] == [1]
    assert got.merged.participants == [0, 2]
    want = (_message(0)[1] + _message(2)[1]) / np.float32(2)
    np.testing.assert_array_equal(got.merged.delta[0], want)
    assert isinstance(merge.Merged, type)


# ------------------------------------------------------------------ robust rules and non-finite contributions

ROBUST = {
    "trimmed_mean": lambda: jd.trimmed_mean(1),
    "coordinate_median": lambda: jd.coordinate_median(),
    "centered_clip": lambda: jd.centered_clip(2.0, iterations=3),
    "norm_clipped_mean": lambda: jd.norm_clipped_mean(),
}


def _jax_before(*version: int) -> bool:
    return tuple(int(v) for v in jax.__version__.split(".")[:2]) < version


def _plain_exchange(like, rows=None):
    """Records of the plain leaves (no encoding), as an island under a robust rule sends them."""
    layouts = {-1: wire.Layout(()), 0: wire.Layout.of(like)}
    return gather.Exchange(None, layouts, lambda f, message, state: (message, None), {0: like}, rows=rows)


def _records(ex, contributions, weights=None):
    weights = weights or [1.0] * len(contributions)
    return [
        ex.seal(_header(island=i, weight=w)._replace(layout=ex.layouts[0].tag), c)
        for i, (c, w) in enumerate(zip(contributions, weights))
    ]


@pytest.mark.parametrize("name", sorted(ROBUST))
@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_a_robust_rule_over_gathered_rows_is_the_in_process_rule_bit_for_bit(name, bad):
    """Four islands' contributions (one NaN or inf, or none), gathered as records and combined over one row
    per slot (NaN rows for the 60 empty slots), give the in-process rule's values on four workers bit for
    bit, and its new state (centered clipping's center); the non-finite island is named in ``rejected``."""
    tx, n = ROBUST[name](), 4
    like = [np.zeros(x.shape, np.float32) for x in _LIKE]
    x = [np.array(u) for u in _updates(3, n)]
    if bad is not None:
        x[0][2, 1, 3] = np.nan if bad == "nan" else np.inf
    state = tx.init(like)
    if name == "centered_clip":  # a center other than zeros: the previous round's output
        state = state._replace(center=[np.full(v.shape, 0.1, np.float32) for v in like])
    ref, ref_state = jax.jit(jax.vmap(tx.update, axis_name="data", in_axes=(0, None)))(x, state)
    rule = base.gathered_of(tx)
    ex = _plain_exchange(like, rows=landing.rows_program(rule.combine))
    rows = [[leaf[i] for leaf in x] for i in range(n)]
    got = gather.combine(_records(ex, rows), ex, 0, num_slots=64, state=jax.device_get(state))
    for m, r in zip(got.merged.delta, ref):
        if name == "centered_clip" and _jax_before(0, 12):
            # JAX 0.10's CPU compiler rounds the iterations over 64 rows and over 4 apart: 6e-8 at values
            # below 1, measured (every island still runs one program on the same rows: the same bits).
            np.testing.assert_allclose(m, np.asarray(r[0]), rtol=0, atol=3e-7)
        else:
            np.testing.assert_array_equal(m, np.asarray(r[0]))
    assert np.all([np.all(np.isfinite(m)) for m in got.merged.delta])
    if name == "centered_clip":
        for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(ref_state)):  # ref: one row per worker
            atol = 3e-7 if _jax_before(0, 12) else 0
            np.testing.assert_allclose(np.asarray(a), np.asarray(b)[0], rtol=0, atol=atol)
    else:
        assert got.state == ref_state
    assert got.merged.participants == [0, 1, 2, 3]
    assert got.rejected == ([] if bad is None else [wire.Rejected(2, gather.NON_FINITE)])
    assert got.merged.weights == [1.0, 1.0, 0.0 if bad else 1.0, 1.0]


@pytest.mark.parametrize("encoded", [False, True])
def test_a_non_finite_contribution_is_left_out_of_the_mean_and_named(encoded):
    """The weighted mean over gathered records (plain, or top_k's decoded messages) leaves out a
    contribution with a NaN or an infinity: the mean of the others, its weight 0, its reason given."""
    like = [np.zeros(x.shape, np.float32) for x in _LIKE]
    x = [[np.array(leaf[i]) for leaf in _updates(5, 3)] for i in range(3)]
    x[1][0][0, 0] = np.inf
    if encoded:
        w = base.wire_of(jd.top_k(k=20))
        coded = _coded(w)
        state = jd.top_k(k=20).init(_LIKE)
        messages = [[np.asarray(m) for m in coded[0](xi, state)] for xi in x]
        layouts = {-1: wire.Layout(()), 0: wire.Layout.of(messages[0])}

        def decode(f, message, s):
            del f
            return coded[1](message, s)

        ex = gather.Exchange(None, layouts, decode, {0: like})
        want = [
            (np.asarray(a) + np.asarray(b)) / np.float32(2)
            for a, b in zip(decode(0, messages[0], state)[0], decode(0, messages[2], state)[0])
        ]
    else:
        ex, messages, state = _plain_exchange(like), x, None
        want = [(a + b) / np.float32(2) for a, b in zip(x[0], x[2])]
    got = gather.combine(_records(ex, messages, [1.0, 1.0, 1.0]), ex, 0, num_slots=4, state=state)
    assert got.rejected == [wire.Rejected(1, "non-finite")]
    assert got.merged.participants == [0, 1, 2] and got.merged.weights == [1.0, 0.0, 1.0]
    for m, w_ in zip(got.merged.delta, want):
        np.testing.assert_allclose(m, w_, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ healing


def _heal_state():
    rng = np.random.default_rng(1)
    return {"params": [rng.normal(size=(3, 4)).astype(np.float32)], "step": 3}


def _served(payload: bytes):
    """A server answering every request with ``payload`` (a hostile healing source)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload) + 64))  # promises more than it sends
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            del args

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/heal/3"


def _stream(secret=SECRET, tree=None) -> bytes:
    from jaxopt_dist._src.islands import heal_http

    staged = heal_http.stage(_heal_state() if tree is None else tree, step=3, source=2, secret=secret)
    return b"".join(bytes(c) for c in staged.chunks())


def _expected():
    from jaxopt_dist._src.islands import heal_http

    return heal_http.Expected([("params/0", "float32", (3, 4))])


@pytest.mark.parametrize(
    "case, reason",
    [
        ("pickle", "a pickle"),
        ("truncated", "the stream ended"),
        ("corrupted", "does not match its SHA-256"),
        ("other model", "does not fit this island's state"),
        ("no tag", "carries no tag"),
        ("wrong secret", "tag is wrong"),
    ],
)
def test_a_bad_healing_state_is_refused_naming_source_and_reason(case, reason, tmp_path):
    import pickle
    import time

    from jaxopt_dist._src.islands import heal_http

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    body = {
        "pickle": lambda: pickle.dumps(Payload()),
        "truncated": lambda: _stream()[:-5],
        "corrupted": lambda: _stream()[:-1] + b"\x00",
        "other model": lambda: _stream(tree={"params": [np.zeros((4, 4), np.float32)], "step": 3}),
        "no tag": lambda: _stream(secret=None),
        "wrong secret": lambda: _stream(secret=b"not-the-islands-secret"),
    }[case]()
    server, url = _served(body)
    try:
        with pytest.raises(islands.HealRefused, match=reason) as e:
            heal_http.fetch(url, deadline=time.monotonic() + 10, secret=SECRET, expect=_expected())
        assert url in str(e.value)
    finally:
        server.shutdown()
    assert not marker.exists()


def test_a_good_healing_state_with_the_secret_arrives_whole():
    import time

    from jaxopt_dist._src.islands import heal_http

    server = heal_http.HealServer("127.0.0.1", source=2, secret=SECRET)
    try:
        server.stage(3, _heal_state())
        got = heal_http.fetch(
            server.url + "3", deadline=time.monotonic() + 10, secret=SECRET, expect=_expected()
        )
        np.testing.assert_array_equal(got["params"][0], _heal_state()["params"][0])
        assert server.sent > 0
    finally:
        server.close()
