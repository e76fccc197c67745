"""Healing the 4.9M-parameter GPT's state: the islands' healing transport against torchft's HTTP one, side by side.

One server process stages the healing state an island of examples/lm.py's
byte-level GPT (``jd.diloco(optax.adamw(...))``, 97 MB of parameters and
optimizer state) hands a lagging peer, on both transports at once: the
islands' tensor-only stream (:mod:`jaxopt_dist._src.islands.heal_http`: a
JSON header, a SHA-256 per array, the secret's HMAC) and torchft's
``HTTPTransport`` (``torch.save``'s stream, unpickled with
``weights_only=False``), its leaves given as torch tensors (its fast path)
and as NumPy arrays (pickled whole: what an island of JAX hands it). A
client process fetches it ``--repeats`` times from each, alternating, over
loopback, and times each fetch, the checks included: on the islands' side the
tag, each array's digest, the arrays' paths, dtypes and shapes against the
island's own, the settings and the anchor's digest (:class:`Healing`'s
checks); on torchft's, none (it unpickles what it gets).

    python benchmarks/bench_heal_transports.py --repeats 5

Needs torch and torchft (Python 3.11 here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = b"bench-heal-transports-secret"


def state(dim: int, depth: int, context: int) -> tuple[int, Any, Any]:
    """The GPT's parameter count, an island's healing ``Healing`` and the state it serves."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxopt_dist as jd
    from jaxopt_dist._src.islands import healing, island, protocol

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import lm

    cfg = lm.GPTConfig(context=context, dim=dim, depth=depth)
    _, params, _ = nnx.split(lm.build_model(cfg, 0), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tx = jd.diloco(optax.adamw(3e-4), sync_every=50)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = jd.data_parallel_step(lambda p, b: 0.0, tx, mesh=mesh, per_worker_params=True)
    placed, opt_state = step.init(params)
    settings = protocol.Settings.of(step.tx.external, "mean", placed, opt_state)
    mask = jax.tree.map(lambda x: False, opt_state.aggregate_states)
    h = healing.Healing(0, settings, mask, island.anchor_sha256)
    h.keep(placed, opt_state, island.anchor_sha256(opt_state))
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    return n, h, h.serve()


def serve(a: argparse.Namespace) -> None:
    """The server: both transports staged at step 1, their addresses printed, until stdin closes."""
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport

    from jaxopt_dist._src.islands import heal_http

    n, _, served = state(a.dim, a.depth, a.context)
    ours = heal_http.HealServer("127.0.0.1", source=0, secret=SECRET, send_timeout=120.0)
    ours.stage(1, {"user": {"default": served}, "torchft": {"step": 1, "batches_committed": 3}})
    tensors = {k: [torch.from_numpy(x) for x in served[k]] for k in ("params", "opt_state")}
    as_torch = {"user": {"default": tensors}, "torchft": {"step": 1, "batches_committed": 3}}
    as_numpy = {"user": {"default": {k: served[k] for k in ("params", "opt_state")}}, "torchft": {"step": 1}}
    urls = {"ours": ours.url + "1", "params": n}
    theirs = []
    for name, tree in (("torchft", as_torch), ("torchft_numpy", as_numpy)):
        t = HTTPTransport(timeout=timedelta(seconds=120), num_chunks=a.num_chunks)
        t.send_checkpoint(dst_ranks=[1], step=1, state_dict=tree, timeout=timedelta(seconds=120))
        urls[name] = t.metadata().replace(t.metadata().split("//")[1].split(":")[0], "127.0.0.1", 1)
        theirs.append(t)
    print(json.dumps(urls), flush=True)
    sys.stdin.read()
    ours.close()
    for t in theirs:
        t.shutdown()


def fetch(a: argparse.Namespace, urls: dict[str, Any]) -> dict[str, list[float]]:
    """The client: each transport's fetch timed ``a.repeats`` times, alternating."""
    from torchft.checkpointing.http_transport import HTTPTransport

    from jaxopt_dist._src.islands import heal_http

    _, h, served = state(a.dim, a.depth, a.context)
    expect = h.expected()._replace(prefix="user/default/")
    nbytes = sum(int(x.nbytes) for x in served["params"] + served["opt_state"])
    theirs = HTTPTransport(timeout=timedelta(seconds=120), num_chunks=a.num_chunks)
    times: dict[str, list[float]] = {"ours": [], "torchft": [], "torchft_numpy": [], "bytes": [float(nbytes)]}
    for _ in range(a.repeats):
        start = time.perf_counter()
        got = heal_http.fetch(urls["ours"], deadline=time.monotonic() + 120, secret=SECRET, expect=expect)
        times["ours"].append(time.perf_counter() - start)
        assert len(got["user"]["default"]["params"]) == len(served["params"])
        del got
        for name in ("torchft", "torchft_numpy"):
            start = time.perf_counter()
            got = theirs.recv_checkpoint(
                src_rank=0, metadata=urls[name], step=1, timeout=timedelta(seconds=120)
            )
            times[name].append(time.perf_counter() - start)
            del got
    theirs.shutdown()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--num-chunks", type=int, default=0, help="torchft's parallel GETs (0: one stream)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a)
        return
    args = [sys.executable, __file__, "--serve", "--dim", str(a.dim), "--depth", str(a.depth)]
    args += ["--context", str(a.context), "--num-chunks", str(a.num_chunks)]
    server = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        urls = json.loads(server.stdout.readline())
        times = fetch(a, urls)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(60)
    mb = times["bytes"][0] / 1e6
    print(
        f"GPT of {urls['params']:,} parameters; healing state {mb:.1f} MB; {a.repeats} fetches each, loopback\n"
    )
    print("| transport | checks | seconds (median) | min | max | MB/s |")
    print("|---|---|---|---|---|---|")
    for key, name, checks in (
        (
            "ours",
            "islands' heal_http",
            "HMAC tag, SHA-256 per array, paths/dtypes/shapes, settings, anchor digest",
        ),
        ("torchft", "torchft HTTPTransport, torch tensors", "none (unpickled, weights_only=False)"),
        ("torchft_numpy", "torchft HTTPTransport, NumPy leaves", "none (pickled arrays, unpickled)"),
    ):
        t = times[key]
        med = statistics.median(t)
        print(f"| {name} | {checks} | {med:.3f} | {min(t):.3f} | {max(t):.3f} | {mb / med:.0f} |")


if __name__ == "__main__":
    main()
