"""A multi-process training run that survives a dead process: asynchronous checkpoints and resume.

Every process runs this same script (as ``examples/multihost.py``). The run
saves ``(params, opt_state)`` with orbax every ``--checkpoint-every`` steps
(and, with ``--checkpoint-at-sync``, at every DiLoCo outer synchronisation),
asynchronously: the arrays are copied off the devices and the step loop goes
on while a background thread writes them. A checkpoint becomes visible only
when orbax renames its temporary directory after every process has written
its part, so a run killed in the middle of a write leaves the previous
checkpoint as the newest one.

On start the script looks for the newest complete checkpoint and resumes:

* on the same number of workers, into the layout of a freshly placed state
  (``step.abstract_init``): the rest of the run is bit-identical to a run
  that was never interrupted;
* on another number of workers, from the raw arrays: the error-feedback
  residuals are regrouped with :func:`jaxopt_dist.reshard_opt_state`, which
  keeps the update still owed, the mean of the residuals over workers,
  exactly; DiLoCo's per-worker parameters with
  :func:`jaxopt_dist.reshard_params` (exact at an outer synchronisation,
  where every worker holds the same parameters).

A survivor must not wait for a dead peer forever. Three things end it:

* a killed peer's sockets close, so the survivor's next gloo collective
  fails (``jax.errors.JaxRuntimeError``, "Connection closed by peer"); the
  driver exits at once with status 3 (measured: within 0.4 s of the kill);
* a peer that is alive but silent (hung, stopped, its host unreachable)
  misses the coordination service's heartbeats: within
  ``--heartbeat-timeout`` seconds (given to ``jax.distributed.initialize``;
  JAX's default is 100) JAX aborts the survivor (SIGABRT) with "Terminating
  process because the JAX distributed service detected fatal errors";
* a watchdog thread exits (status 3) when no step has finished for
  ``--step-timeout`` seconds, counted from the first step (which compiles).

The driver leaves with ``os._exit``: a normal exit would run
``jax.distributed.shutdown``, whose barrier waits for the dead peer.

Two processes with one CPU device each, on one machine::

    python examples/resilient.py --num-processes 2 --process-id 0 \
        --coordinator 127.0.0.1:12356 --checkpoint-dir ckpt --log p0.jsonl &
    python examples/resilient.py --num-processes 2 --process-id 1 \
        --coordinator 127.0.0.1:12356 --checkpoint-dir ckpt --log p1.jsonl

Kill either one; the other exits within the bound. Run the same commands
again, or one process alone (``--num-processes 1``, no ``--coordinator``), and
training resumes from the newest complete checkpoint. Every step's loss goes
to the ``--log`` file as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

EXIT_PEER_LOST = 3
METHODS = ("top_k", "diloco", "powersgd")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordinator service")
    p.add_argument("--local-devices", type=int, default=1, help="simulated CPU devices (workers) per process")
    p.add_argument("--tx", choices=METHODS, default="top_k", help="the optimizer")
    p.add_argument("--sync-every", type=int, default=5, help="DiLoCo's inner steps per outer step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over the workers")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="save here and resume from here")
    p.add_argument("--checkpoint-every", type=int, default=10, help="save every N steps (0: never)")
    p.add_argument("--checkpoint-at-sync", action="store_true", help="save at every DiLoCo outer sync")
    p.add_argument("--max-to-keep", type=int, default=3)
    p.add_argument("--log", default=None, help="append one JSON line per step (and per event) here")
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=10,
        help="seconds without a heartbeat before the coordination service declares a process dead",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=30.0,
        help="exit when a step (after the first, which compiles) takes longer than this many seconds",
    )
    p.add_argument(
        "--fault-at",
        type=int,
        default=None,
        help="fault injection: send --fault to this process after this step (after starting its "
        "checkpoint, if one is due: the fault lands during the asynchronous write)",
    )
    p.add_argument(
        "--fault",
        choices=("SIGKILL", "SIGSTOP"),
        default="SIGKILL",
        help="SIGKILL: the process dies and its sockets close; SIGSTOP: it hangs, silent, sockets open",
    )
    args = p.parse_args(argv)
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        p.error(f"need 0 <= --process-id < --num-processes; got {args.process_id}, {args.num_processes}")
    if args.num_processes > 1 and args.coordinator is None:
        p.error("--num-processes > 1 needs --coordinator HOST:PORT")
    for name in ("local_devices", "steps", "sync_every", "batch_size", "heartbeat_timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.checkpoint_every < 0 or args.step_timeout <= 0:
        p.error("--checkpoint-every must be >= 0 and --step-timeout > 0")
    if args.checkpoint_at_sync and args.tx != "diloco":
        p.error("--checkpoint-at-sync needs --tx diloco")
    return args


class Log:
    """JSON lines, flushed line by line (a killed process loses nothing it wrote)."""

    def __init__(self, path: str | None, process: int):
        self.file = open(path, "a") if path else None  # noqa: SIM115
        self.process = process

    def __call__(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def say(self, message: str) -> None:
        print(f"[process {self.process}] {message}", flush=True)


class Watchdog:
    """Ends the process when the step loop makes no progress for ``timeout`` seconds.

    A peer that died leaves the survivors blocked inside a collective (gloo
    waits for bytes that never come); no Python exception reaches the loop.
    This thread sees the missing progress and exits with a message instead.
    """

    def __init__(self, timeout: float, log: Log):
        self.timeout, self.log = timeout, log
        self.step, self.since, self.armed = 0, time.monotonic(), False
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def progress(self, step: int) -> None:
        self.step, self.since, self.armed = step, time.monotonic(), True

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            waited = time.monotonic() - self.since
            if self.armed and waited > self.timeout:
                exit_peer_lost(
                    self.log,
                    self.step,
                    "watchdog",
                    f"no progress for {waited:.1f} s after step {self.step} (--step-timeout {self.timeout:g})",
                )


def exit_peer_lost(log: Log, step: int, by: str, what: str) -> None:
    """Ends the process at once with ``EXIT_PEER_LOST`` and a message (no atexit hooks:
    ``jax.distributed``'s shutdown barrier would wait for the dead peer)."""
    log(event="peer_lost", step=step, by=by, time=time.time())
    message = f"{what}: a peer process is most likely dead; exiting after step {step}"
    print(f"[process {log.process}] ERROR: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={args.local_devices}"]
    )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator is not None:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    log = Log(args.log, jax.process_index())
    try:
        train(args, log)
    finally:
        if log.file is not None:
            log.file.close()
    if args.coordinator is not None:
        jax.distributed.shutdown()
    return 0


def train(args: argparse.Namespace, log: Log) -> None:
    import jax
    import orbax.checkpoint as ocp

    import jaxopt_dist as jd

    n = jax.device_count()
    if args.batch_size % n:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {n} workers")
    mesh = jax.make_mesh((n,), ("data",))
    x_all, y_all = digits(args.seed)
    p0 = init_params(args.seed, x_all.shape[1], args.hidden, int(y_all.max()) + 1)
    tx, per_worker = make_tx(args)
    step = jd.data_parallel_step(loss_fn, tx, mesh=mesh, per_worker_params=per_worker)
    options = ocp.CheckpointManagerOptions(max_to_keep=args.max_to_keep, enable_async_checkpointing=True)
    mngr = None
    if args.checkpoint_dir is not None:
        path = os.path.abspath(args.checkpoint_dir)
        mngr = ocp.CheckpointManager(path, item_handlers=ocp.StandardCheckpointHandler(), options=options)
    start, params, opt_state = restore(mngr, step, tx, p0, per_worker, log)
    log(event="start", step=start, workers=n, processes=jax.process_count(), tx=args.tx)
    log.say(f"{n} workers over {jax.process_count()} processes; training steps {start + 1}..{args.steps}")
    watchdog = Watchdog(args.step_timeout, log)
    pending = None
    for t in range(start, args.steps):
        try:
            params, opt_state, metrics = step(params, opt_state, batch(x_all, y_all, args, t))
            loss = float(metrics["loss"])  # waits for the step's collectives
        except jax.errors.JaxRuntimeError as e:  # gloo saw the peer's connection close
            exit_peer_lost(log, t, "collective", f"step {t + 1} failed ({str(e).splitlines()[0]})")
        log(step=t + 1, loss=loss)
        watchdog.progress(t + 1)
        if mngr is not None and due(args, t + 1):
            # save() first waits for the previous write, which is then complete.
            mngr.save(t + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            if pending:
                log(event="committed", step=pending)
            log(event="save", step=t + 1)
            pending = t + 1
        if pending and not mngr.is_saving_in_progress():  # renamed into place: complete
            log(event="committed", step=pending)
            pending = None
        if args.fault_at == t + 1:
            log(event="fault", step=t + 1, signal=args.fault, time=time.time())
            os.kill(os.getpid(), getattr(signal, args.fault))
    if mngr is not None:
        mngr.wait_until_finished()  # the last asynchronous write
        if pending:
            log(event="committed", step=pending)
        mngr.close()
    digest = fingerprint(params)  # a collective too: still watched
    watchdog.armed = False
    log(event="done", step=args.steps, loss=loss if args.steps > start else None, params=digest)
    log.say(f"done: step {args.steps}, params {digest}")


def due(args: argparse.Namespace, step: int) -> bool:
    """Whether ``step`` (1-based) is saved: every N steps, and at DiLoCo's outer syncs when asked."""
    every = args.checkpoint_every and step % args.checkpoint_every == 0
    # DiLoCo syncs after the step whose 0-based count c has c % H == H - 1.
    return bool(every or (args.checkpoint_at_sync and step % args.sync_every == 0))


def restore(mngr, step, tx, p0, per_worker: bool, log: Log):
    """``(start, params, opt_state)``: from the newest complete checkpoint, or fresh."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import jaxopt_dist as jd

    latest = None if mngr is None else mngr.latest_step()
    if latest is None:
        return 0, *step.init(p0)
    meta = mngr.item_metadata(latest)
    meta = dict(getattr(meta, "tree", meta))
    n_old = saved_workers(meta, per_worker, step.num_workers)
    if n_old == step.num_workers:  # same workers: restored placed, bit-exact
        target = dict(zip(("params", "opt_state"), step.abstract_init(p0)))
        got = mngr.restore(latest, args=ocp.args.StandardRestore(target))
        log(event="resume", step=latest, resharded=False, workers=n_old, saved_workers=n_old)
        return latest, got["params"], got["opt_state"]
    # Another worker count: the raw arrays on the host, regrouped, then placed.
    host = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
    raw = mngr.restore(latest, args=ocp.args.StandardRestore(host))
    m = step.num_workers
    opt_state = jd.reshard_opt_state(raw["opt_state"], tx, p0, num_workers=m, per_worker_params=per_worker)
    params = jd.reshard_params(raw["params"], num_workers=m) if per_worker else raw["params"]
    before, after = owed(raw["opt_state"]), owed(opt_state)
    diff = max((float(np.max(np.abs(a - b))) for a, b in zip(before, after)), default=0.0)
    log(
        event="resume",
        step=latest,
        resharded=True,
        workers=m,
        saved_workers=n_old,
        owed=sum(float(np.abs(a).sum()) for a in before),
        owed_max_diff=diff,
    )
    opt_state = jd.place_opt_state(opt_state, tx, p0, mesh=step.mesh, per_worker_params=per_worker)
    return latest, jd.place_params(params, mesh=step.mesh) if not per_worker else params, opt_state


def residual_leaves(state) -> list:
    """The error-feedback residuals of a state, or of the raw nested dicts orbax restores."""
    import jax

    import jaxopt_dist as jd

    found = []
    if isinstance(state, jd.ErrorFeedbackState):
        return jax.tree.leaves(state.residual) + residual_leaves(state.inner_state)
    if isinstance(state, dict) and {"count", "residual", "inner_state"} <= set(state):
        return jax.tree.leaves(state["residual"]) + residual_leaves(state["inner_state"])
    children = (
        state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else ()
    )
    for child in children:
        found += residual_leaves(child)
    return found


def owed(state) -> list:
    """The update the residuals still owe, ``(1/n) sum_i e_i`` per leaf, in float64."""
    import numpy as np

    return [np.asarray(r, np.float64).mean(axis=0) for r in residual_leaves(state)]


def saved_workers(meta: dict, per_worker: bool, default: int) -> int:
    """The number of workers that wrote a checkpoint, read from its metadata (leading dimensions)."""
    import jax

    leaves = jax.tree.leaves(meta["params"]) if per_worker else residual_leaves(meta["opt_state"])
    return int(leaves[0].shape[0]) if leaves else default


def fingerprint(tree) -> str:
    """A hash of every byte of ``tree`` (gathered from all processes)."""
    import hashlib

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    whole = multihost_utils.process_allgather(tree, tiled=True) if jax.process_count() > 1 else tree
    h = hashlib.sha256()
    for x in jax.tree.leaves(whole):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()[:16]


def make_tx(args: argparse.Namespace):
    """``(tx, per_worker_params)`` for ``--tx``."""
    import optax

    import jaxopt_dist as jd

    if args.tx == "top_k":
        return optax.chain(jd.top_k(density=0.1), jd.sgd(args.lr, momentum=0.9)), False
    if args.tx == "powersgd":
        return optax.chain(jd.powersgd(rank=2), jd.sgd(args.lr, momentum=0.9)), False
    return jd.diloco(optax.adam(args.lr / 10), sync_every=args.sync_every), True


def loss_fn(params, batch):
    import jax.numpy as jnp
    import optax

    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batch(x_all, y_all, args: argparse.Namespace, t: int) -> dict:
    """The global batch of step ``t`` (0-based), a function of the seed and ``t`` alone."""
    import numpy as np

    idx = np.random.default_rng([args.seed, t]).choice(len(x_all), size=args.batch_size, replace=False)
    return {"x": x_all[idx], "y": y_all[idx]}


def digits(seed: int):
    """Scikit-learn's 8x8 digits, standardized (a seeded stand-in without scikit-learn)."""
    import numpy as np

    try:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
    except ImportError:  # pragma: no cover - scikit-learn is a test dependency
        gen = np.random.default_rng(seed)
        y = gen.integers(0, 10, size=1797)
        x = gen.standard_normal((10, 64))[y] + gen.standard_normal((1797, 64))
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    return x.astype(np.float32), y.astype(np.int32)


def init_params(seed: int, d_in: int, hidden: int, classes: int) -> dict:
    import numpy as np

    gen = np.random.default_rng(seed)
    return {
        "w1": (gen.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (gen.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }


if __name__ == "__main__":
    sys.exit(main())
