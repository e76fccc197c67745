"""The README's commands, run as a newcomer runs them.

* The install command of the ``islands`` extra (torch's CPU build) is one line, the same in the
  README, Getting started, the islands guide and CI's torchft leg.
* The islands: the README's lighthouse and island commands, as written (the lighthouse's
  address moved to a free port, the run shortened with ``--steps``, the records also sent to
  ``--log``), train, print only their records and plain lines, and ``--log`` gets only the records.
* The chaos driver: the README's command, as written (shortened with ``--steps``, its logs in
  ``--workdir``), exits with the status its summary gives, and its faults happen and show.
* The README's GPU command fails at once, naming CUDA, on a machine without one.

The islands tests need torch and torchft (``pip install ".[islands]"``, see the README): they
skip where those are missing, except under ``JAXOPT_DIST_REQUIRE_TORCHFT=1`` (CI's torchft leg).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests import helpers

README = helpers.ROOT / "README.md"
ADDRESS = "127.0.0.1:29510"  # the lighthouse's address in the README
ISLANDS_INSTALL = re.compile(r'^python3 -m pip install -e "\.\[islands\]" .*$', re.M)


def _shell_lines(path) -> list[str]:
    """The lines of the bash blocks of a Markdown file, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _readme_commands(prefix: str) -> list[list[str]]:
    """The README's commands that start with ``prefix``, comments dropped, split as the shell would."""
    return [shlex.split(line, comments=True) for line in _shell_lines(README) if line.startswith(prefix)]


def _as_run_here(argv: list[str], address: str) -> list[str]:
    """A README command for this interpreter, with the lighthouse at ``address``."""
    assert argv[0] == "python", argv
    return [sys.executable, *(a.replace(ADDRESS, address) for a in argv[1:])]


def _needs_torchft() -> None:
    if os.environ.get("JAXOPT_DIST_REQUIRE_TORCHFT") != "1" and importlib.util.find_spec("torchft") is None:
        pytest.skip("needs torch and torchft (pip install '.[islands]')")


def test_the_islands_install_command_is_one_line_in_the_docs_and_in_ci():
    (command,) = {line for line in _shell_lines(README) if ISLANDS_INSTALL.match(line)}
    assert re.search(
        r'"torch==[\d.]+\+cpu" --extra-index-url https://download\.pytorch\.org/whl/cpu$', command
    )
    for page in ("getting_started.md", "guides/islands.md"):
        assert command in _shell_lines(helpers.ROOT / "docs" / page), page
    ci = (helpers.ROOT / ".ci" / "run").read_text()
    assert f"ISLANDS_INSTALL='{command}'" in ci
    assert 'SUITE_PRE="PIP_RETRIES=0 $ISLANDS_INSTALL" JAXOPT_DIST_REQUIRE_TORCHFT=1' in ci


def test_the_readme_islands_train(tmp_path):
    """The README's lighthouse and islands (as many as a round needs) train together."""
    _needs_torchft()
    example = helpers.load_example("islands")
    commands = _readme_commands("python examples/islands.py")
    (lighthouse,) = [c for c in commands if "--serve-lighthouse" in c]
    islands = [c for c in commands if "--island-id" in c]
    need = example.parse_args(lighthouse[2:]).min_islands
    assert len(islands) >= need == example.parse_args(islands[0][2:]).min_islands
    address = f"127.0.0.1:{helpers.load_example('islands_chaos').free_port()}"
    env = {**helpers.child_env(devices=1), "PYTHONUNBUFFERED": "1"}
    env.pop("RUST_LOG", None)
    procs = []
    try:
        procs.append(subprocess.Popen(_as_run_here(lighthouse, address), env=env, stdout=subprocess.DEVNULL))
        for i, argv in enumerate(islands):
            log = str(tmp_path / f"island{i}.jsonl")
            cmd = [*_as_run_here(argv, address), "--steps", "30", "--log", log]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        outs = [p.communicate(timeout=240) for p in procs[1:]]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    ids = sorted(example.parse_args(argv[2:]).island_id for argv in islands)
    for i, (p, (out, err)) in enumerate(zip(procs[1:], outs)):
        assert p.returncode == 0, err[-3000:]
        records = [json.loads(line) for line in out.splitlines()]  # stdout: the records, nothing else
        logged = [json.loads(line) for line in (tmp_path / f"island{i}.jsonl").read_text().splitlines()]
        assert logged == records  # the log file: the records, nothing else
        rounds = [r for r in records if "round" in r]
        assert [r["round"] for r in rounds] == [1, 2, 3]
        assert rounds[-1]["participants"] == [str(j) for j in ids]
        assert records[-1]["done"] and records[-1]["val_loss"] < rounds[0]["val_loss"]  # it trains
        assert "quorum failed" not in err and "[INFO]" not in err, err[-3000:]  # no torchft flood


def test_the_readme_chaos_command_exits_as_its_summary_says(tmp_path):
    """The README's chaos command: each fault happens and shows (the restart heals), the checks pass,
    and the exit status is the summary's."""
    _needs_torchft()
    (argv,) = _readme_commands("python examples/islands_chaos.py")
    cmd = [*_as_run_here(argv, ADDRESS), "--steps", "30", "--workdir", str(tmp_path)]
    env = helpers.child_env(devices=1)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    summary = json.loads(r.stdout)
    assert r.returncode == (0 if summary["ok"] else 1), (r.returncode, summary)
    assert summary["ok"], (summary, r.stderr[-3000:])
    faults = {fault: seen for fault, seen in summary["faults"].items()}
    assert set(faults) == {"kill:2@5", "restart:2@8"}
    assert "without island 2" in faults["kill:2@5"] and "island 2 healed" in faults["restart:2@8"]


def test_the_readme_gpu_command_fails_at_once_without_a_gpu():
    """``JAX_PLATFORMS=cuda python benchmarks/bench_lm.py ...`` on a machine without CUDA: a clear error
    naming CUDA and what JAX found, before anything is built."""
    (argv,) = _readme_commands("JAX_PLATFORMS=cuda python benchmarks/bench_lm.py")
    env = {**helpers.child_env(devices=8), "JAX_PLATFORMS": "cuda"}
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, *argv[2:]], env=env, capture_output=True, text=True, timeout=120, cwd=helpers.ROOT
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "JAX_PLATFORMS=cuda asks for cuda devices, but JAX could not start it" in r.stderr, r.stderr
    assert time.monotonic() - start < 60
