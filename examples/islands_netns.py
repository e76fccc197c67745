"""Islands on separate hosts, on one machine: each island and the lighthouse in a network namespace of its own.

Every host is a Linux network namespace with its own loopback and one
address on a private bridge (``10.77.0.0/24``; the lighthouse at
``10.77.0.1``, island ``i`` at ``10.77.0.(i + 2)``), as machines on a switch
are: an island reaches the others only at the addresses they advertise, and
nothing of a host's loopback is visible to the others. The bridge itself
lives in a namespace of its own, so the machine's own network is not
touched. ``examples/islands_chaos.py`` drives the islands and their faults
(each island gets ``--host`` with its address)::

    sudo python examples/islands_netns.py --islands 3 --steps 300 \\
        --fault kill:2@3 --fault restart:2@6 --fault stop:1@9:4 [--rate 100mbit] [-- island flags]

Needs root (``CAP_NET_ADMIN``) and iproute2's ``ip`` (and ``tc`` for
``--rate``, which shapes every host's link). The namespaces, and every
process left in them, are removed at the end, also after a failure;
namespaces that an earlier run of a process no longer alive left behind are
removed when a new run starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import islands_chaos as chaos  # noqa: E402

PREFIX = "jdi"
SUBNET = "10.77.0"
LIGHTHOUSE_PORT = 29510


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def problem() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """``n`` hosts as network namespaces on one bridge (see the module); a context manager.

    Host 0 is the lighthouse's; island ``i`` runs on host ``i + 1``.

    Args:
      n: the hosts.
      rate: a ``tc`` rate (``"100mbit"``) that shapes every host's link, or None.
    """

    def __init__(self, n: int, *, rate: str | None = None):
        self.n, self.rate = n, rate
        self.tag = f"{PREFIX}-{os.getpid()}-{id(self) % 10000}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-{k}" for k in range(n)]

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def __enter__(self) -> Hosts:
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _create(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for k, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", f"p{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{k}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if self.rate is not None:
                shape = ["qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate]
                subprocess.run(["tc", "-n", ns, *shape, "burst", "256kb", "latency", "1s"], check=True)

    def command(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``k``."""
        return ["ip", "netns", "exec", self.names[k], *argv]

    def remove(self) -> None:
        """Ends every process left in the hosts and removes them (and the bridge)."""
        for ns in [*self.names, self.switch]:
            _remove(ns)

    def cluster(self, workdir: str, *, python: str = sys.executable, **options: Any) -> chaos.Cluster:
        """An :class:`islands_chaos.Cluster` whose lighthouse runs on host 0 and island ``i`` on host ``i + 1``
        with ``--host`` its address (``options``: the Cluster's)."""
        os.makedirs(workdir, exist_ok=True)
        hosts = {str(i): (self.names[i + 1], self.address(i + 1)) for i in range(self.n - 1)}
        launcher = os.path.join(workdir, "on_host.py")
        with open(launcher, "w") as f:
            f.write(_LAUNCHER.format(python=python, lighthouse=self.names[0], hosts=json.dumps(hosts)))
        os.chmod(launcher, 0o755)
        cluster = chaos.Cluster(workdir, python=launcher, **options)
        cluster.address = f"{self.address(0)}:{LIGHTHOUSE_PORT}"
        return cluster


_LAUNCHER = '''#!{python}
"""examples/islands.py on its host's namespace: the lighthouse's, or island --island-id's (with --host)."""
import os, sys
args = sys.argv[1:]
if "--serve-lighthouse" in args:
    ns, extra = "{lighthouse}", []
else:
    ns, host = {hosts}[args[args.index("--island-id") + 1]]
    extra = ["--host", host]
os.execvp("ip", ["ip", "netns", "exec", ns, "{python}", *args, *extra])
'''


def _remove(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_stale() -> None:
    """Removes the namespaces of runs whose process is gone (a run killed before it cleaned up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in listed:
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _alive(int(parts[1])):
            _remove(ns)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def running(cluster: chaos.Cluster) -> Iterator[chaos.Cluster]:
    """``cluster``, whose processes all end when the block does (before its hosts are removed)."""
    try:
        yield cluster
    finally:
        for p in cluster.procs.values():
            if p.poll() is None:
                p.kill()
        cluster.stop_lighthouse()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--islands", type=int, default=3, help="islands, each on a host of its own")
    p.add_argument("--steps", type=int, default=300, help="inner steps of each island")
    p.add_argument("--sync-every", type=int, default=10, help="H")
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds of extra work per inner step")
    p.add_argument(
        "--fault", type=chaos.Fault.parse, action="append", default=[], help="as islands_chaos.py's"
    )
    p.add_argument("--rate", default=None, help="shape every host's link to this tc rate, e.g. 100mbit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a running island is a hang")
    p.add_argument("--workdir", default="islands_netns", help="the islands' logs")
    p.add_argument("island_args", nargs=argparse.REMAINDER, help="-- then flags for every island")
    a = p.parse_args(argv)
    island_args = a.island_args[1:] if a.island_args[:1] == ["--"] else a.island_args
    why = problem()
    if why is not None:
        p.error(f"cannot make network namespaces here: {why}")
    with Hosts(a.islands + 1, rate=a.rate) as hosts:
        args = ["--steps", str(a.steps), "--sync-every", str(a.sync_every), "--step-sleep", str(a.step_sleep)]
        cluster = hosts.cluster(a.workdir, island_args=[*args, *island_args])
        with running(cluster):
            cluster.start_lighthouse()
            for i in range(a.islands):
                cluster.start(i)
            hung = chaos.run_faults(cluster, a.fault, a.timeout)
            print(json.dumps(chaos.summarize(cluster.rows(), hung), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
