"""One member of bench_islands.py's healing measurement (this file is not a benchmark).

Every member builds the healing state an island of the 4.9M-parameter byte-level GPT hands to a
lagging peer: ``(params, opt_state)`` of ``jd.diloco(optax.adamw(...), sync_every=...)`` under
``jd.data_parallel_step(..., per_worker_params=True)`` on a 1-device mesh, built by the library
(``step.init`` on examples/lm.py's GPT), as the list of host arrays ``Island`` serves. It joins
torchft's lighthouse through the library's ``TorchftTransport`` and runs rounds (quorum, one SUM
all-reduce of a small buffer, commit), as an island's round does:

* ``--role source``: rounds back to back (a short pause between them) until ``--seconds`` pass;
* ``--role healer``: ``--repeats`` times: sit out ``--skip`` seconds (the sources commit rounds
  without it, so it falls behind), then one quorum, in which it heals from a source over the
  islands' healing transport (HTTP, raw arrays), timed; places the state received on its device as ``Island`` does;
  then one round it does not heal in, timed too (the quorum's cost without healing).

The healer prints one JSON line per repeat, and first one with the state's size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxopt_dist as jd  # noqa: E402
from jaxopt_dist._src.islands import merge  # noqa: E402
from jaxopt_dist._src.islands.torchft import TorchftTransport  # noqa: E402
from jaxopt_dist.islands import ExchangeError  # noqa: E402


def healing_state(dim: int, depth: int, context: int) -> tuple[int, list, list]:
    """The GPT's parameter count and an island's placed ``(params, opt_state)`` leaves."""
    import lm

    cfg = lm.GPTConfig(context=context, dim=dim, depth=depth)
    graphdef, params, rest = nnx.split(lm.build_model(cfg, 0), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tx = jd.diloco(optax.adamw(3e-4), sync_every=50)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = jd.data_parallel_step(lambda p, b: 0.0, tx, mesh=mesh, per_worker_params=True)
    placed_params, opt_state = step.init(params)
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    return n, jax.tree.leaves(placed_params), jax.tree.leaves(opt_state)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("source", "healer"), required=True)
    ap.add_argument("--id", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", type=float, default=1.5)
    ap.add_argument("--pause", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=30.0, help="the exchange's and the heal's timeout")
    ap.add_argument(
        "--host", default=None, help="the address this member listens on (default: route to the lighthouse)"
    )
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    a = ap.parse_args()

    n, p_leaves, s_leaves = healing_state(a.dim, a.depth, a.context)
    nbytes = sum(int(x.nbytes) for x in p_leaves + s_leaves)
    received: list = []

    def save():  # what Island._save hands out: host copies of the leaves
        return {
            "params": [np.asarray(x) for x in jax.device_get(p_leaves)],
            "opt_state": [np.asarray(x) for x in jax.device_get(s_leaves)],
        }

    t = TorchftTransport(
        a.lighthouse,
        min_islands=2,
        timeout=a.timeout,
        heal_timeout=a.timeout,
        quorum_timeout=120.0,
        host=a.host,
    )
    t.bind(a.id, save)
    small = np.zeros(merge.tail_size(64), np.float32)

    def round_() -> tuple[bool, float, float]:
        start = time.perf_counter()
        healed = t.quorum(120.0)
        if healed is not None:
            received.append(healed.state)
        quorum_s = time.perf_counter() - start
        try:
            t.allreduce(small.copy())
            ok = True
        except ExchangeError:
            ok = False
        t.commit(ok)
        return healed is not None, quorum_s, time.perf_counter() - start

    if a.role == "source":
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            round_()
            time.sleep(a.pause)
        t.close()
        return

    print(json.dumps({"params": n, "state_bytes": nbytes, "leaves": len(p_leaves + s_leaves)}), flush=True)
    round_()  # the join round (heals too: the sources are ahead), not timed
    for _ in range(a.repeats):
        time.sleep(a.skip)
        received.clear()
        healed, quorum_s, round_s = round_()
        start = time.perf_counter()
        if received:  # placed like the island's own arrays (Island._adopt's device_put)
            got = received[0]["params"] + received[0]["opt_state"]
            jax.block_until_ready([jax.device_put(g, x.sharding) for g, x in zip(got, p_leaves + s_leaves)])
        place_s = time.perf_counter() - start
        _, plain_quorum_s, plain_round_s = round_()
        print(
            json.dumps(
                {
                    "healed": healed,
                    "heal_quorum_s": quorum_s,
                    "heal_round_s": round_s,
                    "place_s": place_s,
                    "plain_quorum_s": plain_quorum_s,
                    "plain_round_s": plain_round_s,
                }
            ),
            flush=True,
        )
    t.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # torchft's threads would keep the process alive
