"""The house rules of the package, checked on its source (see docs/development.md, "Layout").

* No module imports another module's private (underscored) name.
* The import graph runs downwards only: the ground floor (``base``, ``compat``,
  ``comm``) imports nothing of the package but itself; the transforms import the
  ground floor and the shared transform helpers; the training tools and the
  accounting sit above the transforms and import no transform; ``__init__``,
  ``nnx`` and ``linen`` are the public faces on top.
* Every function of the tools layer (``training``, ``accounting``) is short
  enough to read at once.
* No run of six identical lines of code is written twice inside the package.
* Every exported state class says how its per-worker fields reshard.
* No public class reuses an optax class's name for a different class.
* Nothing outside the tests patches JAX with ``unittest.mock``.
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src import base

ROOT = pathlib.Path(jd.__file__).parent
REPO = ROOT.parent
SRC = ROOT / "_src"

GROUND = {"base", "compat", "comm"}
# Transform modules that others of the same floor may import: shared pieces, not algorithms.
# Modules other transforms may build on: the compressor machinery, selection and
# topology helpers, and DiLoCo's outer loop (SparseLoCo and MuLoCo are DiLoCo with
# another outer step and aggregate: composed, not copied).
SHARED_TRANSFORM_PIECES = {"error_feedback", "selection", "topology", "diloco", "orthonormal"}
MAX_TOOL_FUNCTION_LINES = 80


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name (relative to jaxopt_dist) -> path, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: pathlib.Path) -> list[tuple[str, str | None, str, int]]:
    """(imported module relative to jaxopt_dist, imported name or None, local name, line)
    of each import from the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxopt_dist"):
            module = node.module.removeprefix("jaxopt_dist").removeprefix(".")
            for alias in node.names:
                sub = f"{module}.{alias.name}".lstrip(".")
                local = alias.asname or alias.name
                if sub in MODULES:
                    found.append((sub, None, local, node.lineno))
                else:
                    found.append((module, alias.name, local, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxopt_dist."):
                    module = alias.name.removeprefix("jaxopt_dist.")
                    found.append((module, None, alias.asname or alias.name, node.lineno))
    return found


def _floor(module: str) -> int:
    """0 ground, 1 transforms, 2 tools (training, accounting, islands), 3 public faces."""
    parts = module.split(".")
    if parts[0] != "_src":
        return 3
    if len(parts) == 1:
        return 3  # the _src package itself (empty)
    if parts[1] in ("training", "accounting", "islands"):
        return 2
    return 0 if parts[1] in GROUND else 1


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for module, imported, local, line in _imports(path):
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                bad.append(f"{name}:{line} imports {module}.{imported}")
            if imported is None:
                aliases[local] = module
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_imports_run_downwards_only():
    bad = []
    for name, path in MODULES.items():
        here = _floor(name)
        for module, _, _, line in _imports(path):
            there = _floor(module)
            same_family = module.split(".")[:2] == name.split(".")[:2]
            if there > here:
                bad.append(f"{name}:{line} (floor {here}) imports {module} (floor {there})")
            elif here == there == 1 and module.split(".")[1] not in SHARED_TRANSFORM_PIECES:
                bad.append(f"{name}:{line}: a transform imports the transform {module}")
            elif here == there == 2 and not same_family and not module.startswith("_src.training"):
                bad.append(f"{name}:{line}: the training tools import {module}")
            elif here == 2 and there == 1:
                bad.append(f"{name}:{line}: a tool imports the transform {module}")
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def _docstring_lines(root: ast.AST) -> set[int]:
    """The line numbers of every docstring inside ``root``."""
    lines: set[int] = set()
    for node in ast.walk(root):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, source: str) -> int:
    """Lines of code of a function: no blank lines, comments or docstrings (nested functions included)."""
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    docstrings = _docstring_lines(node)
    count = 0
    for offset, text in enumerate(lines):
        stripped = text.strip()
        if stripped and not stripped.startswith("#") and node.lineno + offset not in docstrings:
            count += 1
    return count


def test_tool_functions_are_short():
    long = []
    for name, path in MODULES.items():
        if _floor(name) != 2:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, source)
                if n > MAX_TOOL_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, "tool functions over 80 lines of code:\n" + "\n".join(long)


def _normalized_code(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of the code lines that count for repetition: no docstrings, comments,
    imports, def headers or lone punctuation; white space folded."""
    source = path.read_text()
    tree = ast.parse(source)
    skip = _docstring_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0].lineno
            skip.update(range(node.lineno, first))
    comments = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")
    }
    out = []
    for i, text in enumerate(source.splitlines(), start=1):
        folded = " ".join(text.split())
        if i in skip or i in comments or len(folded.strip("()[]{},:")) == 0:
            continue
        out.append((i, folded))
    return out


def test_no_six_identical_code_lines_written_twice():
    runs: dict[tuple[str, ...], list[str]] = {}
    for name, path in MODULES.items():
        code = _normalized_code(path)
        for k in range(len(code) - 5):
            window = tuple(text for _, text in code[k : k + 6])
            runs.setdefault(window, []).append(f"{name}:{code[k][0]}")
    repeated = {w: where for w, where in runs.items() if len(where) > 1}
    shown = [" ~ ".join(where) + "\n    " + "\n    ".join(w) for w, where in list(repeated.items())[:5]]
    assert not repeated, f"{len(repeated)} runs of six code lines written twice, e.g.:\n" + "\n".join(shown)


def _exported_state_classes() -> list[type]:
    return [
        getattr(jd, name)
        for name in jd.__all__
        if name.endswith("State") and isinstance(getattr(jd, name), type)
    ]


@pytest.mark.parametrize("cls", _exported_state_classes(), ids=lambda c: c.__name__)
def test_every_state_class_says_how_it_reshards(cls):
    assert base.has_reshard_rules(cls), (
        f"{cls.__name__} registers no reshard rules: decorate it with @base.reshard_rules(...) "
        "(no arguments when no field is per-worker)."
    )


def test_no_public_class_shadows_an_optax_class():
    # Functions share optax's names on purpose (jd.sgd, jd.adam: PyTorch's conventions);
    # a class of the same name as optax's but another meaning would mislead isinstance checks.
    clashes = [
        name
        for name in jd.__all__
        if isinstance(getattr(jd, name), type) and getattr(optax, name, None) not in (None, getattr(jd, name))
    ]
    assert not clashes, f"public classes that reuse optax's names for other classes: {clashes}"


def test_no_mock_patching_outside_the_tests():
    users = [
        str(path.relative_to(REPO))
        for folder in ("jaxopt_dist", "benchmarks", "examples")
        for path in (REPO / folder).rglob("*.py")
        if "unittest.mock" in path.read_text() or "from unittest import mock" in path.read_text()
    ]
    assert not users, f"unittest.mock used outside tests: {users}"
