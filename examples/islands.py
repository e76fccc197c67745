"""Islands: DiLoCo across separately launched JAX jobs that die, heal and rejoin (over torchft).

Each island is its own process (its own JAX job) training a small MLP on
scikit-learn's digits; every ``--sync-every`` steps the islands merge their
pseudo-gradients over torchft. Kill one (SIGKILL), stop it (SIGSTOP), start it
again: the others go on, and the restarted island heals from a live peer.

Start torchft's lighthouse first, then at least ``--min-islands`` islands (2 by
default: a round needs that many, and a lone island only waits), each in its
own shell::

    python examples/islands.py --serve-lighthouse 127.0.0.1:29510 --min-islands 2
    python examples/islands.py --island-id 0 --lighthouse 127.0.0.1:29510 --log island0.jsonl
    python examples/islands.py --island-id 1 --lighthouse 127.0.0.1:29510 --log island1.jsonl
    python examples/islands.py --island-id 2 --lighthouse 127.0.0.1:29510 --log island2.jsonl

On separate machines, the lighthouse listens on an address of a private
network and each island gives its own address on it with ``--host``::

    python examples/islands.py --serve-lighthouse 10.0.0.1:29510                       # machine A
    python examples/islands.py --island-id 0 --lighthouse 10.0.0.1:29510 --host 10.0.0.2  # machine B
    python examples/islands.py --island-id 1 --lighthouse 10.0.0.1:29510 --host 10.0.0.3  # machine C

``--host`` is the address the island listens on and advertises, for its
TCPStore, its gloo device and its healing server (torchft's ManagerServer
advertises it too, but torchft has it listen on every interface); without it,
the island takes its own address on the route to the lighthouse.

``--serve-lighthouse`` runs torchft's ``LighthouseServer`` in this process
until it is killed; torchft's own console script does the same:
``torchft_lighthouse --bind [::]:29510 --min_replicas 2 --join_timeout_ms 1000
--heartbeat_timeout_ms 2000``. The islands renew their quorum request every
0.5 s; with a join timeout above that, a round waits for every live island
and leaves out one whose heartbeats stopped (after ``--heartbeat-timeout-ms``).
Below it, an island that asks a little late (it just healed) keeps being left
out.

An island waiting for a quorum prints one line every 5 s on stderr
(``waiting for islands: have 1 of 2 needed since 12:00:00``, the counts as the
lighthouse gives them); torchft's own log lines (one per quorum retry, twice a
second) are shown only with ``--verbose`` (they are torchft's Rust logging,
``RUST_LOG``; without ``--verbose`` it is set to ``warn`` unless already set).

``--log`` gets one JSON line per synchronisation, and nothing else (the same lines go
to stdout): ``island`` (the id, a
string), ``round``, ``step``, ``fragment``, ``participants`` (ids, strings),
``weights``, ``healed`` (took a peer's state, weight 0), ``caught_up`` (was
late: took a peer's state and its own work was merged), ``redone``, ``seconds`` (the round, from its first
quorum to its commit), ``quorum_seconds``, ``heal_seconds``,
``exchange_seconds`` and ``vote_seconds`` (the longest wait of each kind in the
round), ``backoff_seconds`` (the pauses between its attempts), ``waited``
(the seconds the island waited for the round to form: its quorum waits in
every attempt together),
``anchor_sha256``, ``agreed_sha256`` (what every member holds bit-identical:
the anchor, or under ``--eager``, where each island's anchor is its own row,
the merged mean), ``sent_bytes`` (what the island put on the wire in the
round), ``rejected`` (the contributions it dropped: ``{"island", "reason"}``),
``val_loss`` (of the island's anchor) and ``time`` (Unix seconds); with ``--die-in-exchange-*`` or ``--stop-in-exchange-after``, a
``{"island", "fault", "fault_round", "time"}`` line just before the fault. At
the end a ``{"island", "done": true, "val_loss", "steps", "sharded_leaves",
"time"}`` line (``sharded_leaves``: the anchor's leaves split over the
island's devices; with ``--timings`` also ``compute_seconds``,
``wall_seconds``, ``steps_timed``, ``step_median_seconds`` (the median inner
step, blocked on, ``--step-sleep`` not included), ``sleep_seconds`` and
``logging_seconds``). An island that
cannot go on (no quorum within ``--quorum-timeout``, a round not committed
within ``--round-timeout``) writes ``{"island", "error", "time"}`` and exits
with status 3; one that is refused (its id in use by another live island, or
settings that differ from the others') with status 4.

``--aggregate trimmed_mean:K``, ``median``, ``centered_clip:R`` or ``norm_clip``
screen the islands' pseudo-gradients with a robust rule
(:func:`jaxopt_dist.trimmed_mean` and the others): each island sends its own,
every island gathers them all and applies the rule in island order, so every
island holds the same anchor. ``--byzantine MODE`` makes this island send, from
its first round on, ``nan``, ``signflip:K`` (minus K times its pseudo-gradient),
``scale:K`` or ``random:S`` (Gaussian noise of standard deviation S) instead of
its pseudo-gradient, to see the rules at work::

    python examples/islands.py --island-id 3 --lighthouse 127.0.0.1:29510 --aggregate trimmed_mean:1 \
        --byzantine signflip:10

Whatever the aggregate, a contribution with a NaN or an infinity is left out of
its round (weight 0; under the plain mean the round's sum is found not finite
and the contributions are gathered at once to find it) and listed in the
round's ``rejected`` with the reason ``"non-finite"``.

``--steps-file PATH`` lets a driver (``examples/islands_chaos.py``) lengthen
the run: the island trains until the larger of ``--steps`` and the count
written in PATH, re-read at every step, so that islands can be kept going
until a restarted one has joined.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, NamedTuple

EXIT_NO_QUORUM = 3
EXIT_REFUSED = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve-lighthouse", metavar="HOST:PORT", default=None, help="run the lighthouse here")
    p.add_argument(
        "--min-islands", type=int, default=2, help="fewest islands in a round (lighthouse and island)"
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=1000,
        help="lighthouse: wait for live islands that have not asked (above the islands' 0.5 s requery)",
    )
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, default=2000, help="lighthouse: silence before exclusion"
    )
    p.add_argument("--island-id", type=int, default=None, help="this island's slot (0-63)")
    p.add_argument("--lighthouse", metavar="HOST:PORT", default=None, help="the lighthouse's address")
    p.add_argument(
        "--host",
        metavar="ADDR",
        default=None,
        help="the address this island listens on and advertises to the others (its store, gloo device "
        "and healing server); default: its address on the route to the lighthouse",
    )
    p.add_argument("--steps", type=int, default=300, help="inner steps in all")
    p.add_argument("--sync-every", type=int, default=10, help="H: inner steps per outer step")
    p.add_argument("--num-fragments", type=int, default=1, help="Streaming DiLoCo's fragments")
    p.add_argument("--sync-delay", type=int, default=0, help="steps a fragment's exchange may overlap")
    p.add_argument(
        "--eager",
        action="store_true",
        help="eager outer steps (each island's own fresh pseudo-gradient with the last round's mean; "
        "each exchange runs beside the inner steps up to its fragment's next synchronisation: "
        "H / F - 1 of them)",
    )
    p.add_argument(
        "--aggregate",
        type=aggregate_name,
        default="mean",
        metavar="{mean,low_bit,sparseloco,muloco,trimmed_mean:K,median,centered_clip:R,norm_clip}",
        help="what each island sends: the float32 mean (one all-reduce), or encoded and gathered: "
        "low_bit() at 4 bits, sparseloco's chunked top-k (its defaults), or MuLoCo's "
        "statistical_quantize(2) with its re-quantized mean; or each island's float32 pseudo-gradient, "
        "gathered and combined by a robust rule: trimmed_mean(K), coordinate_median(), "
        f"centered_clip(R) (centered_clip alone: R = {CENTERED_CLIP_RADIUS:g}) or norm_clipped_mean()",
    )
    p.add_argument(
        "--byzantine",
        type=byzantine_mode,
        default=None,
        metavar="MODE",
        help="fault injection: from its first round on, this island sends in place of its pseudo-gradient "
        "d: nan (NaN everywhere), signflip:K (-K d), scale:K (K d) or random:S (Gaussian noise of "
        "standard deviation S, a fresh draw each round); it applies the merged rounds as any island",
    )
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        default=None,
        help="the islands' shared secret (at least 16 bytes, the same file on every island): every "
        "contribution and healing state carries its HMAC-SHA256 tag, and those without it are dropped",
    )
    p.add_argument(
        "--rule",
        choices=("mean", "tokens"),
        default="mean",
        help="how rounds weigh islands: 1 each, or the tokens (--batch-size per step) trained since the last launch",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="the model's initialization (the same on every island)"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's learning rate")
    p.add_argument(
        "--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's learning rate (momentum 0.9)"
    )
    p.add_argument(
        "--timeout", type=float, default=2.0, help="seconds an all-reduce, or a round's commit vote, may take"
    )
    p.add_argument("--heal-timeout", type=float, default=30.0, help="seconds a heal may take")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds to wait for a quorum")
    p.add_argument(
        "--round-timeout",
        type=float,
        default=120.0,
        help="seconds a whole round may take (its quorums, heal, exchanges, votes and pauses)",
    )
    p.add_argument("--quorum-retries", type=int, default=3, help="retries of a failed quorum request")
    p.add_argument(
        "--num-processes", type=int, default=1, help="processes of this island (its own jax.distributed job)"
    )
    p.add_argument("--process-id", type=int, default=0, help="this process's index within the island")
    p.add_argument(
        "--coordinator", default=None, help="HOST:PORT of the island's jax.distributed coordinator"
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="an island of several processes shards the MLP's matrices (and their state) over its "
        "devices instead of replicating them",
    )
    p.add_argument("--log", default=None, help="append one JSON line per synchronisation here (only those)")
    p.add_argument(
        "--steps-file",
        default=None,
        metavar="PATH",
        help="train until the larger of --steps and the step count written in PATH (re-read every step)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show torchft's own log lines (one per quorum retry) instead of a waiting line every 5 s",
    )
    p.add_argument("--anchors-dir", default=None, help="save the anchor after each round here (round<R>.npz)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per inner step")
    p.add_argument(
        "--slow",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="this island's extra work per inner step is FACTOR times --step-sleep (a slower island; "
        "needs --step-sleep > 0)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=1,
        metavar="R",
        help="evaluate the anchor (the log's val_loss) every R rounds (null in the others' lines)",
    )
    p.add_argument(
        "--die-in-exchange-at",
        type=int,
        default=None,
        help="fault injection: SIGKILL this island as it enters the all-reduce of this round",
    )
    p.add_argument(
        "--die-in-exchange-after",
        type=int,
        default=None,
        metavar="K",
        help="fault injection: SIGKILL this island as it enters the all-reduce of the K-th round after "
        "the first one this process takes part in (its join or heal), or of the first round it reaches later",
    )
    p.add_argument(
        "--stop-in-exchange-after",
        type=int,
        default=None,
        metavar="K",
        help="fault injection: as --die-in-exchange-after, but SIGSTOP this island there for "
        "--stop-seconds (a helper process sends SIGCONT), once",
    )
    p.add_argument("--stop-seconds", type=float, default=4.0, help="how long --stop-in-exchange-after stops")
    p.add_argument(
        "--timings",
        action="store_true",
        help="time each inner step (blocked on, plus --step-sleep) and add compute_seconds, "
        "wall_seconds and logging_seconds (the per-round log's own time; all after init) to the final line",
    )
    args = p.parse_args(argv)
    if args.num_processes > 1 and (args.coordinator is None or not 0 <= args.process_id < args.num_processes):
        p.error(
            "an island of several processes needs --coordinator HOST:PORT and 0 <= --process-id < --num-processes"
        )
    if args.fsdp and args.num_processes < 2:
        p.error("--fsdp shards over the devices of an island of several processes (--num-processes >= 2)")
    if args.eager and args.sync_delay:
        p.error("--eager takes --sync-delay 0: its exchange already overlaps a whole period")
    if args.eager and args.aggregate.partition(":")[0] in ROBUST:
        p.error("--eager takes no robust --aggregate: its own fresh pseudo-gradient would pass unscreened")
    if not args.slow >= 1.0:
        p.error(f"--slow must be >= 1 (a factor on --step-sleep); got {args.slow:g}")
    if args.slow != 1.0 and not args.step_sleep > 0:
        p.error("--slow multiplies --step-sleep: give --step-sleep > 0 too")
    if args.byzantine is not None and args.num_processes > 1:
        p.error("--byzantine runs on an island of one process")
    if args.serve_lighthouse is None and (args.island_id is None or args.lighthouse is None):
        p.error("give --serve-lighthouse HOST:PORT, or --island-id ID and --lighthouse HOST:PORT")
    for name in ("steps", "sync_every", "num_fragments", "batch_size", "hidden", "min_islands", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


ROBUST = ("trimmed_mean", "median", "centered_clip", "norm_clip")
CENTERED_CLIP_RADIUS = 1.0
"""``--aggregate centered_clip``'s radius, in the units of a pseudo-gradient's norm (the whole model's)."""


def aggregate_name(text: str) -> str:
    """``--aggregate``: a plain name, ``trimmed_mean:K`` (an int K >= 0) or ``centered_clip[:R]`` (R > 0)."""
    kind, colon, arg = text.partition(":")
    plain = ("mean", "low_bit", "sparseloco", "muloco", "median", "norm_clip", "centered_clip")
    if not colon and kind in plain:
        return text
    try:
        if kind == "trimmed_mean" and colon and int(arg) >= 0:
            return text
        if kind == "centered_clip" and colon and float(arg) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"{text!r}: one of mean, low_bit, sparseloco, muloco, trimmed_mean:K (K an int >= 0), median, "
        "centered_clip:R (R > 0; centered_clip alone: R = 1), norm_clip"
    )


def byzantine_mode(text: str) -> str:
    """``--byzantine``: ``nan``, ``signflip:K``, ``scale:K`` or ``random:S`` (S > 0)."""
    kind, colon, arg = text.partition(":")
    try:
        if kind == "nan" and not colon:
            return text
        if kind in ("signflip", "scale") and colon and math.isfinite(float(arg)):
            return text
        if kind == "random" and colon and math.isfinite(float(arg)) and float(arg) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"{text!r}: one of nan, signflip:K (-K times the pseudo-gradient), scale:K (K times it), "
        "random:S (Gaussian noise of standard deviation S > 0)"
    )


def serve_lighthouse(args: argparse.Namespace) -> None:
    """torchft's lighthouse, until this process is killed."""
    from jaxopt_dist import islands

    server = islands.start_lighthouse(
        args.serve_lighthouse,
        min_islands=args.min_islands,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"lighthouse at {server.address()}", flush=True)
    while True:  # until killed
        time.sleep(3600)


class Setup(NamedTuple):
    """The model, its data and the optimizer (shared by every island and by the in-process reference)."""

    loss_fn: Any
    params: Any
    tx: Any
    batch_for: Any  # (island, step) -> batch
    val_loss: Any  # params -> float


def build(args: argparse.Namespace) -> Setup:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    import jaxopt_dist as jd

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_train, y_train, x_val, y_val = x[:1500], y[:1500], x[1500:], y[1500:]

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"][None])
        logits = h @ p["w2"] + p["b2"][None]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    k1, k2 = jax.random.split(jax.random.key(args.seed))
    params = {
        "w1": jax.random.normal(k1, (64, args.hidden)) * 64**-0.5,
        "b1": jnp.zeros(args.hidden),
        "w2": jax.random.normal(k2, (args.hidden, 10)) * args.hidden**-0.5,
        "b2": jnp.zeros(10),
    }

    def batch_for(island: int, step: int) -> dict[str, Any]:
        idx = np.random.default_rng([args.seed, island, step]).integers(0, len(x_train), args.batch_size)
        return {"x": x_train[idx], "y": y_train[idx]}

    val = jax.jit(lambda p: loss_fn(p, {"x": x_val, "y": y_val}))
    kind, _, arg = args.aggregate.partition(":")
    aggregates = {
        "mean": lambda: None,
        "low_bit": lambda: jd.low_bit(),
        "sparseloco": lambda: jd.chunked_top_k(64, chunk=64, bits=2, error_decay=0.95),
        "muloco": lambda: jd.statistical_quantize(2),
        "trimmed_mean": lambda: jd.trimmed_mean(int(arg)),
        "median": lambda: jd.coordinate_median(),
        "centered_clip": lambda: jd.centered_clip(float(arg) if arg else CENTERED_CLIP_RADIUS),
        "norm_clip": lambda: jd.norm_clipped_mean(),
    }
    aggregate = aggregates[kind]()
    tx = jd.diloco(
        optax.adamw(args.lr),
        outer=optax.sgd(args.outer_lr, momentum=0.9, nesterov=True),
        sync_every=args.sync_every,
        num_fragments=args.num_fragments,
        sync_delay=args.sync_delay,
        eager=args.eager,
        **({} if aggregate is None else {"aggregate": aggregate}),
    )
    # addressable_data(0): this process's copy of the loss (replicated over an island's devices)
    return Setup(loss_fn, params, tx, batch_for, lambda p: float(np.asarray(val(p).addressable_data(0))))


class DyingTransport:
    """A transport whose process SIGKILLs itself as it enters the all-reduce of one round (after its
    quorum: the others are in, or entering, the same all-reduce): round ``round_``, or the first it
    reaches ``after`` rounds after its first all-reduce; or SIGSTOPs itself there (``stop_after``
    rounds after its first) for ``stop_seconds``, once. ``on_fault(kind, round)`` is called just before."""

    def __init__(
        self,
        inner: Any,
        round_: int | None,
        *,
        after: int | None = None,
        stop_after: int | None = None,
        stop_seconds: float = 0.0,
        on_fault: Any = None,
    ):
        self.inner, self.round, self.after = inner, round_, after
        self.stop_after, self.stop_seconds = stop_after, stop_seconds
        self.on_fault = on_fault or (lambda kind, round_: None)
        self.first: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allreduce(self, buf: Any) -> Any:
        self._fault()
        return self.inner.allreduce(buf)

    def allgather(self, record: Any) -> Any:
        self._fault()
        return self.inner.allgather(record)

    def _fault(self) -> None:
        r = self.inner.rounds_committed()
        self.first = r if self.first is None else self.first
        if r == self.round or (self.after is not None and r >= self.first + self.after):
            self.on_fault("exchange-kill", r)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop_after is not None and r >= self.first + self.stop_after:
            self.stop_after = None
            self.on_fault("exchange-stop", r)
            wake = f"sleep {self.stop_seconds}; kill -CONT {os.getpid()}"
            subprocess.Popen(["sh", "-c", wake], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)


class ByzantineStep:
    """An island's step that, after each step that sends a fragment, puts in the state's outbox (what the
    island's round sends) what ``mode`` says in place of the island's pseudo-gradient ``d``: ``nan``,
    ``signflip:K`` (``-K d``), ``scale:K`` (``K d``) or ``random:S`` (Gaussian noise of standard deviation
    ``S``, drawn from the island's id and the step). The island applies the merged rounds as any island.
    """

    def __init__(self, inner: Any, exchange: Any, mode: str, island_id: int):
        self.inner, self.exchange, self.island_id = inner, exchange, island_id
        self.kind, _, arg = mode.partition(":")
        self.value = float(arg) if arg else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> Any:
        import numpy as np

        params, opt_state, metrics = self.inner(params, opt_state, batch)
        t = int(np.asarray(opt_state.count.addressable_data(0)).reshape(-1)[0]) - 1  # the step just taken
        sent = self.exchange.launches_after(t)
        if sent:
            outbox = list(opt_state.outbox)
            for f in sent:
                outbox[f] = [self.replace(x, t, k) for k, x in enumerate(outbox[f])]
            opt_state = opt_state._replace(outbox=tuple(outbox))
        return params, opt_state, metrics

    def replace(self, d: Any, step: int, leaf: int) -> Any:
        """What the island sends in place of ``d`` (one leaf of its pseudo-gradient), placed as ``d``."""
        import jax
        import numpy as np

        x = np.asarray(d.addressable_data(0))
        if self.kind == "nan":
            bad = np.full_like(x, np.nan)
        elif self.kind in ("signflip", "scale"):
            bad = (-self.value if self.kind == "signflip" else self.value) * x
        else:
            rng = np.random.default_rng([self.island_id, step, leaf])
            bad = (self.value * rng.standard_normal(x.shape)).astype(x.dtype)
        return jax.device_put(bad.astype(x.dtype), d.sharding)


class TimedStep:
    """An island's step whose calls are timed (each blocked on until its results are ready)."""

    def __init__(self, inner: Any):
        self.inner, self.each = inner, []  # each call's seconds

    @property
    def seconds(self) -> float:
        return sum(self.each)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any) -> Any:
        import jax

        start = time.perf_counter()
        out = jax.block_until_ready(self.inner(*args))
        self.each.append(time.perf_counter() - start)
        return out


# torchft's lighthouse says why no quorum formed yet on its /status page, e.g. "New quorum not ready,
# only have 1 participants, need min_replicas 2 [...]", or "... need at least half of 3 healthy workers".
_NOT_READY = re.compile(
    r"only have (\d+) participants, need (?:min_replicas (\d+)|at least half of (\d+) healthy workers)"
)


def quorum_counts(status: str) -> tuple[int, int] | None:
    """``(have, need)`` from the text of the lighthouse's status page, or None if it does not say."""
    m = _NOT_READY.search(status)
    if m is None:
        return None
    have, min_replicas, healthy = m.groups()
    return int(have), int(min_replicas) if min_replicas else int(healthy) // 2 + 1


def waiting_line(lighthouse: str, min_islands: int, since: float) -> str:
    """One plain line on an island waiting for a quorum: how many islands it has, how many it needs, since when."""
    url = (lighthouse if "://" in lighthouse else f"http://{lighthouse}") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=1.0) as page:
            counts = quorum_counts(page.read().decode(errors="replace"))
    except OSError:
        counts = None
    when = time.strftime("%H:%M:%S", time.localtime(since))
    if counts is None:
        return f"waiting for islands: need {min_islands} (--min-islands) since {when}"
    return f"waiting for islands: have {counts[0]} of {counts[1]} needed since {when}"


class QuorumWatch:
    """A transport whose waits for a quorum print :func:`waiting_line` every ``every`` seconds to ``out``
    (default: stderr)."""

    def __init__(self, inner: Any, lighthouse: str, min_islands: int, every: float = 5.0, out: Any = None):
        self.inner, self.lighthouse, self.min_islands, self.every = inner, lighthouse, min_islands, every
        self.out = out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def quorum(self, timeout: float) -> Any:
        done, since = threading.Event(), time.time()

        def report() -> None:
            while not done.wait(self.every):
                line = waiting_line(self.lighthouse, self.min_islands, since)
                if not done.is_set():  # (the quorum may have formed while the lighthouse was asked)
                    print(line, file=self.out or sys.stderr, flush=True)

        threading.Thread(target=report, daemon=True).start()
        try:
            return self.inner.quorum(timeout)
        finally:
            done.set()


def target_steps(args: argparse.Namespace) -> int:
    """``--steps``, or the larger count a driver wrote into ``--steps-file`` (unreadable: ``--steps``)."""
    if args.steps_file is None:
        return args.steps
    try:
        with open(args.steps_file) as f:
            return max(args.steps, int(f.read()))
    except (OSError, ValueError):
        return args.steps


def run_island(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    import jaxopt_dist as jd
    from jaxopt_dist import islands

    if args.num_processes > 1:  # one island of several processes: its own jax.distributed job
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    setup = build(args)
    lead = jax.process_index() == 0  # the island's first process talks to the others and logs
    log_file = open(args.log, "a") if args.log and lead else None  # noqa: SIM115

    def log(**record: Any) -> None:
        line = json.dumps({"island": str(args.island_id), **record, "time": time.time()})
        if log_file is not None:
            log_file.write(line + "\n")
            log_file.flush()
        if lead:
            print(line, flush=True)

    def whole(x: Any) -> Any:
        """A leaf's whole value: this process's copy, or (--fsdp) gathered from the island's processes."""
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    sent_before = [0]  # the transport's count at the previous round's record (it counts from the start)
    logging_seconds = [0.0]  # --timings: time spent here (the example's own per-round evaluation and log)

    def on_sync(rec: Any, params: Any, opt_state: Any) -> None:
        started = time.perf_counter()
        anchor = island.model(opt_state)
        if args.anchors_dir:
            os.makedirs(args.anchors_dir, exist_ok=True)
            path = os.path.join(args.anchors_dir, f"island{args.island_id}_round{rec.round}.npz")
            np.savez(path, step=rec.step, **{k: whole(v) for k, v in anchor.items()})
        log(
            round=rec.round,
            step=rec.step,
            fragment=rec.fragment,
            participants=[str(i) for i in rec.participants],
            weights=list(rec.weights),
            healed=rec.healed,
            caught_up=rec.caught_up,
            redone=rec.redone,
            seconds=round(rec.seconds, 4),
            quorum_seconds=round(rec.quorum_seconds, 4),
            heal_seconds=round(rec.heal_seconds, 4),
            exchange_seconds=round(rec.exchange_seconds, 4),
            vote_seconds=round(rec.vote_seconds, 4),
            backoff_seconds=round(rec.backoff_seconds, 4),
            waited=round(rec.waited_seconds, 4),
            sent_bytes=int(rec.sent_bytes) - sent_before[0],
            rejected=[{"island": r[0], "reason": r[1]} for r in rec.rejected],
            anchor_sha256=rec.anchor_sha256,
            agreed_sha256=rec.agreed_sha256,
            val_loss=setup.val_loss(anchor) if rec.round % args.eval_every == 0 else None,
        )
        sent_before[0] = int(rec.sent_bytes)
        logging_seconds[0] += time.perf_counter() - started

    if jax.process_count() > 1 and args.fsdp:  # the matrices split over the island's devices
        mesh = jax.make_mesh((1, jax.device_count()), ("data", "fsdp"))
        specs = {"w1": jax.P(None, "fsdp"), "b1": jax.P(), "w2": jax.P("fsdp", None), "b2": jax.P()}
        inside = dict(param_specs=specs, batch_axes="fsdp")
    elif jax.process_count() > 1:  # dense data parallelism over the island's devices, one DiLoCo worker
        mesh = jax.make_mesh((1, jax.device_count()), ("data", "replica"))
        inside = dict(param_specs=jax.P(), batch_axes="replica")
    else:
        mesh, inside = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), {}
    step = jd.data_parallel_step(setup.loss_fn, setup.tx, mesh=mesh, per_worker_params=True, **inside)
    transport = islands.torchft_transport(
        args.lighthouse,
        min_islands=args.min_islands,
        timeout=args.timeout,
        heal_timeout=args.heal_timeout,
        quorum_timeout=args.quorum_timeout,
        quorum_retries=args.quorum_retries,
        host=args.host,
        secret=None if args.secret_file is None else islands.read_secret(args.secret_file),
    )
    faults = (args.die_in_exchange_at, args.die_in_exchange_after, args.stop_in_exchange_after)
    if any(f is not None for f in faults):
        transport = DyingTransport(
            transport,
            args.die_in_exchange_at,
            after=args.die_in_exchange_after,
            stop_after=args.stop_in_exchange_after,
            stop_seconds=args.stop_seconds,
            on_fault=lambda kind, round_: log(fault=kind, fault_round=round_),
        )
    if not args.verbose:
        transport = QuorumWatch(transport, args.lighthouse, args.min_islands)
    island = islands.island(
        step,
        transport,
        island_id=args.island_id,
        rule=args.rule,
        tokens_per_step=args.batch_size,
        round_timeout=args.round_timeout,
        on_sync=on_sync,
    )
    if args.byzantine is not None:
        island.step = ByzantineStep(island.step, island.exchange, args.byzantine, args.island_id)
    if args.timings:
        island.step = TimedStep(island.step)
    timings: dict[str, Any] = {}
    try:
        params, opt_state = island.init(
            jax.tree.map(np.asarray, setup.params), warmup_batch=setup.batch_for(args.island_id, 0)
        )
        t = island.step_count(opt_state)
        start, slept, taken = time.perf_counter(), 0.0, 0
        if args.timings:
            island.step.each = []  # the warm-up's compile is not an inner step
        while t < target_steps(args):
            batch = setup.batch_for(args.island_id, t)
            params, opt_state, _ = island(params, opt_state, batch)
            taken += 1
            if args.step_sleep:
                nap = time.perf_counter()
                time.sleep(args.step_sleep * args.slow)
                slept += time.perf_counter() - nap
            t = island.step_count(opt_state)
        if args.timings:
            timings = {
                "compute_seconds": island.step.seconds + slept,
                "wall_seconds": time.perf_counter() - start,
                "steps_timed": taken,
                "step_median_seconds": statistics.median(island.step.each) if island.step.each else 0.0,
                "sleep_seconds": slept,
                "logging_seconds": logging_seconds[0],
            }
        island.finish()
    except islands.IslandsError as e:
        log(error=str(e))
        return EXIT_REFUSED if isinstance(e, islands.IslandRefused) else EXIT_NO_QUORUM
    model = island.model(opt_state)
    sharded = sum(not x.is_fully_replicated for x in jax.tree.leaves(model))
    log(done=True, val_loss=setup.val_loss(model), steps=t, sharded_leaves=sharded, **timings)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not args.verbose:  # torchft's Rust logging: one INFO line per quorum retry otherwise
        os.environ.setdefault("RUST_LOG", "warn")
    if args.serve_lighthouse is not None:
        serve_lighthouse(args)
        return 0
    return run_island(args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # torchft's threads and servers would otherwise keep a finished island alive
