"""torchft's own DiLoCo (torch), for bench_islands.py's side-by-side (this file is not a benchmark).

One replica per process, as examples/islands.py runs one island: ``torchft.local_sgd.DiLoCo``
(torchft 0.2.0) around a torch MLP (64-64-10, tanh) on scikit-learn's digits, inner AdamW
(lr 3e-3, weight decay 1e-4: optax.adamw's defaults), outer Nesterov SGD (0.7, momentum 0.9),
``sync_every`` inner steps per round, one ``Manager`` per replica (``use_async_quorum=False``,
``min_replica_size=2``, gloo with the same timeout as the islands'), its own TCPStore, and
torchft's lighthouse (``torchft.coordination.LighthouseServer``) in another process
(``--serve-lighthouse``). Batches are drawn as examples/islands.py draws them.

``--die-in-exchange-at R``: the replica SIGKILLs itself as it enters round R's all-reduce (the
first ``Manager.allreduce`` it issues while ``Manager.current_step() == R``), as the islands'
``--die-in-exchange-at`` does. ``--log`` gets one JSON line per round, from ``should_commit``:
``{"replica", "round" (Manager.current_step() before the vote), "committed", "participants",
"local_step", "time"}``, a ``{"fault": ...}`` line before a self-kill, and a final ``{"done": true,
"val_loss", "inner_steps"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta


def serve_lighthouse(bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    print(f"lighthouse at {server.address()}", flush=True)
    while True:
        time.sleep(3600)


def run_replica(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch import nn
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    x_train, y_train = torch.from_numpy(x[:1500]), torch.from_numpy(y[:1500])
    x_val, y_val = torch.from_numpy(x[1500:]), torch.from_numpy(y[1500:])

    torch.manual_seed(a.seed)  # the same initialization on every replica
    model = nn.Sequential(nn.Linear(64, a.hidden), nn.Tanh(), nn.Linear(a.hidden, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    loss_fn = nn.CrossEntropyLoss()

    log_file = open(a.log, "a") if a.log else None  # noqa: SIM115

    def log(**record) -> None:
        line = json.dumps({"replica": str(a.replica_id), **record, "time": time.time()})
        if log_file is not None:
            log_file.write(line + "\n")
            log_file.flush()

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    seconds = timedelta(seconds=a.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=seconds),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=seconds,
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=f"http://{a.lighthouse}",
        replica_id=f"replica_{a.replica_id}",
        init_sync=False,
    )
    local = {"step": 0}

    allreduce, should_commit = manager.allreduce, manager.should_commit

    def dying_allreduce(*args, **kw):
        if a.die_in_exchange_at is not None and manager.current_step() == a.die_in_exchange_at:
            log(fault="exchange-kill", fault_round=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
        return allreduce(*args, **kw)

    def logged_should_commit(*args, **kw):
        r = manager.current_step()
        ok = should_commit(*args, **kw)
        log(round=r, committed=bool(ok), participants=manager.num_participants(), local_step=local["step"])
        return ok

    manager.allreduce = dying_allreduce
    manager.should_commit = logged_should_commit

    with DiLoCo(manager, [model], inner, outer, sync_every=a.sync_every, pin_memory=False):
        for t in range(a.steps):
            idx = np.random.default_rng([a.seed, a.replica_id, t]).integers(0, len(x_train), a.batch_size)
            inner.zero_grad()
            loss_fn(model(x_train[idx]), y_train[idx]).backward()
            local["step"] = t + 1
            inner.step()  # DiLoCo's post-step hook runs the round every sync_every steps
            if a.step_sleep:
                time.sleep(a.step_sleep)
    with torch.no_grad():
        val = float(loss_fn(model(x_val), y_val))
    log(done=True, val_loss=val, inner_steps=a.steps, rounds_committed=manager.current_step())
    manager.shutdown(wait=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-lighthouse", default=None, metavar="HOST:PORT")
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--join-timeout-ms", type=int, default=200)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    ap.add_argument("--replica-id", type=int, default=0)
    ap.add_argument("--lighthouse", default=None)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--quorum-timeout", type=float, default=60.0)
    ap.add_argument("--die-in-exchange-at", type=int, default=None)
    ap.add_argument("--log", default=None)
    a = ap.parse_args()
    if a.serve_lighthouse:
        serve_lighthouse(a.serve_lighthouse, a.min_replicas, a.join_timeout_ms, a.heartbeat_timeout_ms)
    else:
        run_replica(a)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # torchft's threads and servers would otherwise keep a finished replica alive
