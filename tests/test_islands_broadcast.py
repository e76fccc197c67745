"""A round's outcome on every process of a two-process island (``broadcast.outcome_everywhere``)."""

import json
import subprocess
import sys

from tests import helpers

SCRIPT = helpers.ROOT / "tests" / "_outcome_two_processes.py"


def test_every_process_of_an_island_gets_the_whole_outcome():
    """The second process gets what the first was given: the merged values, the participants and
    their weights, and the contributions the round dropped, with their reasons."""
    coordinator = f"127.0.0.1:{helpers.free_port()}"
    argv = [[sys.executable, str(SCRIPT), coordinator, str(k)] for k in range(2)]
    procs = [subprocess.Popen(a, env=helpers.child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argv]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert got[0] == got[1]
    assert got[1] == {
        "fragment": 0,
        "delta": [[0.0, 1.0, 2.0]],
        "participants": [0, 2],
        "weights": [1.0, 0.0],
        "round": 5,
        "redone": 1,
        "rejected": [[2, "non-finite"], [None, "no tag (a secret is required)"]],
    }
