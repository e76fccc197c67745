"""Bad input to islands over torchft, one case at a time (run as a script by test_islands_torchft).

Each case starts its own lighthouse and islands (threads of this process, each with its own torchft
``Manager``, process group and healing server on 127.0.0.1) and runs the library's round protocol
(:class:`RoundProtocol`) over them; one JSON line per case is printed as it ends. Every unpickling in
the process (``pickle.Unpickler.load``, ``pickle.loads``, ``torch.load``) is counted, per case.

Contribution cases: islands 0 and 1 run a round while island 2 sends a record under another secret,
one without a tag, or one whose header lies about its length. Healing cases: island 1 falls behind
and heals from island 0, whose healing server answers the first request with a pickle (one that
would create a file), a truncated stream, a corrupted array, another model's state, a state whose
anchor is not the digest its round agreed on, or a state under another secret or none; then serves
the good state.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import threading
import time

import numpy as np

unpicklings: list[str] = []


class _Counting(pickle.Unpickler):
    def load(self):
        unpicklings.append("Unpickler.load")
        return super().load()


_real_loads = pickle.loads


def _loads(*a, **k):
    unpicklings.append("pickle.loads")
    return _real_loads(*a, **k)


pickle.Unpickler, pickle.loads = _Counting, _loads  # type: ignore[misc]
import torch  # noqa: E402

_real_load = torch.load


def _load(*a, **k):
    unpicklings.append("torch.load")
    return _real_load(*a, **k)


torch.load = _load

from jaxopt_dist import islands  # noqa: E402
from jaxopt_dist._src.islands import gather, heal_http, healing, merge, protocol, wire  # noqa: E402
from jaxopt_dist._src.islands.torchft import TorchftTransport  # noqa: E402

SECRET, OTHER = b"the-islands-secret-0123", b"another-secret-entirely"
LAYOUTS = {-1: wire.Layout(()), 0: wire.Layout.of([np.zeros(4, np.float32)])}
LIKE = {0: [np.zeros(4, np.float32)]}
SETTINGS = protocol.Settings(1, 1, 0, 0, 0, 0, 0, 0)
ANCHOR = np.ones(4, np.float32)
TIMEOUT = 5.0
CONTRIBUTIONS = ["contribution: wrong secret", "contribution: no tag", "contribution: lying length"]
HEALS = ["pickle", "truncated", "corrupted", "other model", "anchor", "heal: wrong secret", "heal: no tag"]


def digest(opt_state) -> str:
    return hashlib.sha256(np.asarray(opt_state["anchor"], np.float32).tobytes()).hexdigest()


AGREED = digest({"anchor": ANCHOR})


def exchange() -> gather.Exchange:
    return gather.Exchange(SECRET, LAYOUTS, lambda f, m, s: (m, None), LIKE)


def transport(address: str, secret: bytes = SECRET) -> TorchftTransport:
    return TorchftTransport(address, timeout=TIMEOUT, heal_timeout=10.0, host="127.0.0.1", secret=secret)


def bound(t, i: int, serve, expect=None) -> protocol.RoundProtocol:
    """Island ``i`` on ``t``, and its round protocol (the library's)."""
    t.bind(i, serve, expect)
    return protocol.RoundProtocol(
        t, island_id=i, num_slots=4, rule="mean", round_timeout=60.0, settings=SETTINGS, gather=exchange()
    )


def rounds(p: protocol.RoundProtocol, fragments: list) -> list:
    """Rounds of ``p``'s island, one per fragment (None: a join), each as a JSON-able dict."""

    def adopt(got, own):  # a healed island weighs 0 in the round; it now holds its source's anchor
        return protocol.Adopted(got.state, protocol.Contribution(0, [np.zeros(4, np.float32)], 0.0, AGREED))

    out = []
    for f in fragments:
        leaves = [] if f is None else [np.full(4, p.island_id + 1.0, np.float32)]
        o = p.run(protocol.Contribution(f, leaves, 1.0, AGREED), adopt)
        out.append(
            {
                "participants": o.merged.participants,
                "delta": [float(v) for v in o.merged.delta[0]] if o.merged.delta else [],
                "healed": o.healed is not None,
                "redone": o.redone,
                "seconds": o.seconds,
                "rejected": [[r.island, r.reason] for r in o.rejected],
            }
        )
    return out


def threads(targets) -> None:
    ts = [threading.Thread(target=f, args=a) for f, a in targets]
    for th in ts:
        th.start()
    for th in ts:
        th.join(120)


def bad_record(i: int, r: int, case: str) -> np.ndarray:
    h = wire.Header(i, r, 0, 1.0, 7, 0, i, (1,) * 8, layout=LAYOUTS[0].tag)
    msg = [np.full(4, float(i + 1), np.float32)]
    size = exchange().size
    rec = wire.seal(h, msg, size=size, secret={"contribution: wrong secret": OTHER}.get(case, None))
    if case == "contribution: lying length":  # 8 bytes more than the encoding, the tag made over them
        rec = wire.seal(h, msg, size=size, secret=SECRET)
        n, head = LAYOUTS[0].nbytes + 8, wire.HEADER.size
        rec[head - 8 : head] = np.frombuffer(np.uint64(n).tobytes(), np.uint8)
        body = rec[: head + n].tobytes()
        rec[-32:] = np.frombuffer(wire.tag(SECRET, b"contribution", body[:head], body[head:]), np.uint8)
    return rec


def contribution_case(case: str) -> dict:
    """Islands 0 and 1 run a join and a round; island 2 joins, then sends a bad record and votes."""
    lighthouse = islands.start_lighthouse("127.0.0.1:0", min_islands=3, join_timeout_ms=1000)
    address = lighthouse.address().split("//")[-1]
    out: dict = {}

    def honest(i):
        t = transport(address)
        try:
            out[i] = rounds(bound(t, i, lambda: {}), [None, 0])
        finally:
            t.close()

    def liar():
        t = transport(address)
        t.bind(2, lambda: {})
        try:
            for r in range(2):
                t.quorum(60.0)
                tag = merge.anchor_tag(AGREED)
                header = wire.Header(2, r, -1, 0.0, tag, 0, 2, tuple(SETTINGS), layout=LAYOUTS[-1].tag)
                record = exchange().seal(header, []) if r == 0 else bad_record(2, r, case)
                t.allgather(record)
                t.commit(True)
        finally:
            t.close()

    threads([(honest, (0,)), (honest, (1,)), (liar, ())])
    lighthouse.shutdown()
    return {"rounds": {str(k): v for k, v in out.items()}}


def body_for(case: str, marker: str) -> tuple[bytes, int]:
    """What the hostile source answers first, and the length it announces."""

    class Payload:
        def __reduce__(self):
            return (open, (marker, "w"))

    def stream(tree=None, secret=SECRET, agreed=AGREED) -> bytes:
        state = tree or {"params": [ANCHOR.copy()], "opt_state": [ANCHOR.copy()]}
        served = {"user": {"default": {**state, "settings": SETTINGS._asdict(), "agreed": agreed}}}
        return b"".join(bytes(c) for c in heal_http.stage(served, step=1, source=0, secret=secret).chunks())

    good = stream()
    body = {
        "pickle": lambda: pickle.dumps(Payload()),
        "truncated": lambda: good[:-6],
        "corrupted": lambda: good[:-1] + bytes([good[-1] ^ 1]),
        "other model": lambda: stream({"params": [np.ones(5, np.float32)], "opt_state": [ANCHOR.copy()]}),
        "anchor": lambda: stream({"params": [ANCHOR.copy()], "opt_state": [ANCHOR + 1]}),
        "heal: wrong secret": lambda: stream(secret=OTHER),
        "heal: no tag": lambda: stream(secret=None),
    }[case]()
    return body, len(body) + (64 if case == "truncated" else 0)


def heal_case(case: str, marker: str) -> dict:
    """Islands 0 and 1 join; island 1 falls behind and heals from island 0, whose first answer is bad."""
    lighthouse = islands.start_lighthouse("127.0.0.1:0", min_islands=2, join_timeout_ms=1000)
    address = lighthouse.address().split("//")[-1]
    out: dict = {}
    joined = threading.Barrier(2)

    def island(i):
        t = transport(address)
        h = healing.Healing(i, SETTINGS, None, digest)
        h.keep([ANCHOR.copy()], {"anchor": ANCHOR.copy()}, AGREED)
        try:
            p = bound(t, i, h.serve, h.expected())
            out[i] = rounds(p, [None])
            joined.wait(60)
            if i == 0:
                answer_once(t._healing.server, *body_for(case, marker))
            else:
                t.fall_behind()
            joined.wait(60)
            out[i] += rounds(p, [0, 0] if i == 0 else [0])  # island 0 needs one more for island 1
        finally:
            t.close()

    threads([(island, (0,)), (island, (1,))])
    lighthouse.shutdown()
    return {"rounds": {str(k): v for k, v in out.items()}}


def answer_once(server: heal_http.HealServer, body: bytes, length: int) -> None:
    """The server's next answer is ``body`` (announced as ``length`` bytes); then its own again."""
    real = server.response

    def once(step: int):
        server.response = real  # type: ignore[method-assign]
        return length, iter([body])

    server.response = once  # type: ignore[method-assign]


def main() -> None:
    directory = sys.argv[1]
    cases = sys.argv[2:] or CONTRIBUTIONS + HEALS
    for case in cases:
        del unpicklings[:]
        marker = os.path.join(directory, "pwned-" + case.replace(" ", "_").replace(":", ""))
        start = time.monotonic()
        try:
            got = contribution_case(case) if case in CONTRIBUTIONS else heal_case(case, marker)
        except Exception as e:  # reported as the case's result; the other cases go on
            got = {"error": repr(e)}
        got.update(
            case=case,
            unpicklings=list(unpicklings),
            marker=os.path.exists(marker),
            seconds=time.monotonic() - start,
        )
        print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
