"""Runs the examples in every public docstring."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jaxopt_dist
import jaxopt_dist._src

# Every module, those inside the training and accounting packages included.
MODULES = sorted(m.name for m in pkgutil.walk_packages(jaxopt_dist._src.__path__, "jaxopt_dist._src."))


def test_every_module_is_listed():
    assert "jaxopt_dist._src.comm" in MODULES and len(MODULES) >= 10
    assert "jaxopt_dist._src.training.step" in MODULES
    assert "jaxopt_dist._src.accounting.walk" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        extraglobs={"jd": jaxopt_dist},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False,
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
