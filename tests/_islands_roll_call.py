"""An island counted in a quorum but absent (run as a script by test_islands_torchft).

Three islands (threads of this process, each with its own torchft ``Manager``, process group and
healing server on 127.0.0.1) make attempts as the round protocol does: quorum (with its roll call),
all-reduce, vote. Island 2 asks for a quorum and abandons the request (its client times out while the
others wait), then comes back 3 s later; islands 0 and 1 ask in between, and the lighthouse forms
their quorum with island 2's abandoned request. ``argv[1]``: ``first`` where that is the first round
(a new quorum, whose process group must connect), ``later`` where a round of all three came first
(the same quorum again: the roll call finds island 2 missing), ``older-step`` as ``later`` but the
abandoned request carries the step island 2 had before that round (as a renewal sent before a round
committed can), so that the quorum looks as if island 2 heals in it. One JSON line: each island's
attempts.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

import numpy as np

from jaxopt_dist import islands
from jaxopt_dist._src.islands.torchft import TorchftTransport

TIMEOUT, ROLL_CALL = 20.0, 1.0  # an exchange would wait 20 s for the absent island; the roll call 1 s


def attempt(t: TorchftTransport) -> dict:
    start, error = time.monotonic(), None
    try:
        t.quorum(60.0)
        t.allreduce(np.ones(4, np.float32))
        ok = True
    except islands.ExchangeError as e:
        ok, error = False, str(e)[:300]
    committed = t.commit(ok)
    return {
        "committed": committed,
        "round": t.rounds_committed(),
        "seconds": time.monotonic() - start,
        "error": error,
    }


def abandon(t: TorchftTransport) -> str:
    """Asks the lighthouse for a quorum and gives up after 0.3 s, leaving the request there."""
    try:
        t._manager.start_quorum(timeout=timedelta(seconds=0.3))
        return "got a quorum"
    except Exception as e:  # its client's timeout
        t._manager._quorum_future = None
        return type(e).__name__


def main(mode: str) -> None:
    first = mode == "first"
    lighthouse = islands.start_lighthouse("127.0.0.1:0", min_islands=2, join_timeout_ms=1000)
    address = lighthouse.address().split("//")[-1]
    state = {"params": [np.ones(8, np.float32)], "opt_state": [np.zeros(3, np.float32)]}
    ts = [TorchftTransport(address, timeout=TIMEOUT, roll_call=ROLL_CALL, host="127.0.0.1") for _ in range(3)]
    for i, t in enumerate(ts):
        t.bind(i, lambda: state)
    asked, out = threading.Event(), {str(i): [] for i in range(3)}

    def island(i: int) -> None:
        rows = out[str(i)]
        if not first:
            rows.append(attempt(ts[i]))  # a round of all three
        if i == 2:
            if mode == "older-step":
                ts[2].fall_behind()  # its request carries the step before the round: 0
            rows.append({"abandoned": abandon(ts[2])})
            if mode == "older-step":
                ts[2]._step_to(1)  # and the island is back at its own step
            asked.set()
            time.sleep(3.0)
        else:
            asked.wait()
        while (
            not (rows and rows[-1].get("committed"))
            or sum(bool(r.get("committed")) for r in rows) < 2 - first
        ):
            rows.append(attempt(ts[i]))
            if not rows[-1]["committed"]:
                time.sleep(0.2)

    threads = [threading.Thread(target=island, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for t in ts:
        t.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
