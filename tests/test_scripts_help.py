"""Every script in examples/ and benchmarks/ answers ``--help``.

A script is a ``.py`` file with an ``if __name__ == "__main__":`` block (the
shared harnesses, ``_common.py`` and ``shaped_link.py``, are modules, not
scripts). All of them run in one child process, each as ``python script
--help`` would run it (``runpy`` with the script's folder first on
``sys.path``), so the test costs one interpreter start.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests import helpers

_RUNNER = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    buf = io.StringIO()
    sys.argv = [path, "--help"]
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
        code = "returned without printing help"
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    sys.path.pop(0)
    out[path] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def _scripts():
    found = []
    for folder in ("examples", "benchmarks"):
        for path in sorted((helpers.ROOT / folder).glob("*.py")):
            if 'if __name__ == "__main__"' in path.read_text():
                found.append(path)
    return found


def test_every_script_answers_help():
    scripts = _scripts()
    names = {p.name for p in scripts}
    assert {"demo.py", "lm.py", "bench_lm.py", "multihost_sum_order.py"} <= names
    r = subprocess.run(
        [sys.executable, "-c", _RUNNER, *map(str, scripts)],
        capture_output=True,
        text=True,
        env=helpers.child_env(devices=8),
        cwd=helpers.ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    failed = {p: code for p, (code, text) in results.items() if code not in (0, None) or "usage:" not in text}
    assert not failed, failed


def test_lm_quick_settings_and_overrides():
    lm = helpers.load_example("lm")
    args = lm.parse_args(["--quick", "--steps", "5"])
    assert args.steps == 5 and args.dim == lm.QUICK["dim"] and args.tx == lm.QUICK["tx"]
    assert lm.parse_args([]).steps == 300
