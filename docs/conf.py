"""Sphinx configuration of the jaxopt_dist documentation.

Build (from the repository root): ``pip install -e ".[docs]"`` then
``sphinx-build -W --keep-going -b html docs docs/_build/html``.

The notebooks live in ``notebooks/`` at the repository root; the build copies
them into ``docs/notebooks/`` (git-ignored) and myst-nb executes them, so the
site shows their outputs. Pages link them where they are in a checkout
(``../notebooks/X.ipynb``); the build points those links at the rendered
copies. The API pages of ``docs/api/generated/`` (git-ignored) are written by
autosummary from the lists in ``docs/api/*.rst``.

``JAXOPT_DIST_DOCS_EXECUTE`` sets myst-nb's execution mode: ``cache`` by default (outputs kept
in ``docs/_build/.jupyter_cache`` until a notebook's code changes), ``force``, or ``off`` for a
quick build without outputs.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, installed or not
# ... in the notebooks' kernels too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import jaxopt_dist  # noqa: E402

project = "jaxopt_dist"
author = "jaxopt_dist contributors"
copyright = "jaxopt_dist contributors"
version = release = jaxopt_dist.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax served from the site itself (the PyPI package bundles MathJax 3 and copies it into
    # _static/mathjax), so formulas render offline: on a cluster's login node, from a saved copy.
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]
mathjax_path = "mathjax/tex-chtml.js"  # relative to _static: the bundled copy, never a CDN

root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints", "notebooks/.jupyter_cache"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# -- Cross-references -------------------------------------------------------------------------------
# Every reference to jaxopt_dist's own names must resolve. No intersphinx (the build runs offline),
# so names of other packages that appear in signatures and docstrings are left unlinked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|numpy|np|flax|orbax|chex|typing|collections|enum|types)(\..*)?"),
    (r"py:.*", r"jnp\..*"),
    # Builtins and annotations that only name a Python type.
    (r"py:.*", r"(int|float|bool|str|bytes|object|tuple|list|dict|set|frozenset|type|callable|None)"),
    (r"py:.*", r"(Any|Callable|Hashable|Iterable|Iterator|Mapping|Sequence|Literal|Self|TypeVar|NamedTuple)"),
    (r"py:.*", r"(ValueError|TypeError|NameError|RuntimeError|KeyError|NotImplementedError|Exception)"),
    (r"py:.*", r"(Array|ArrayLike|ArrayTree|Params|PyTree|OptState|Updates|ScalarOrSchedule|Schedule)"),
    (r"py:.*", r"(PartitionSpec|NamedSharding|Mesh|Sharding|Device|DTypeLike|PRNGKeyArray)"),
    (r"py:.*", r"(GradientTransformation|GradientTransformationExtraArgs|EmptyState|ApplyIfFiniteState)"),
]

# -- autodoc / autosummary / napoleon ---------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autosummary_ignore_module_all = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_class_signature = "mixed"  # a NamedTuple's fields on the class line, no separate __new__
# Signatures name these aliases instead of spelling out the unions they stand for (and
# _alias_in_union prints an alias inside a union).
autodoc_type_aliases = {
    name: target
    for target, spellings in {
        "jaxopt_dist.AxisName": ("AxisName", "base.AxisName"),
        "optax.ScalarOrSchedule": ("optax.ScalarOrSchedule",),
        "optax.Schedule": ("optax.Schedule",),
        "optax.Params": ("optax.Params",),
        "optax.Updates": ("optax.Updates",),
        "optax.OptState": ("optax.OptState",),
        "jax.typing.ArrayLike": ("jax.typing.ArrayLike", "ArrayLike"),
    }.items()
    for name in spellings
}
autodoc_inherit_docstrings = False
add_module_names = False
python_use_unqualified_type_names = True

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False  # Attributes: one target per field (NamedTuple fields are skipped as members)
napoleon_use_rtype = False
napoleon_custom_sections = [
    "Communication",
    "Sharded parameters",
    "Memory",
    "Which steps are counted",
]


def _internal_target(target: str):
    """The object an unresolved reference names inside ``jaxopt_dist._src``, or None.

    Docstrings and annotations name helpers of the implementation (``base.AxisName``,
    ``jaxopt_dist._src.accounting.costs.StepCost``, ``block_k_start``...). A public one is
    linked to its page; a private one is shown as code without a link; any other target stays
    a broken reference (an error with ``-W``).
    """
    import importlib

    name = target.lstrip("~.").removeprefix("jaxopt_dist.")
    if "." in name:
        owner, _, attr = name.rpartition(".")
        for prefix in ("", "jaxopt_dist._src.", "jaxopt_dist."):
            try:
                module = importlib.import_module(prefix + owner)
            except ImportError:
                continue
            if hasattr(module, attr):
                return attr, getattr(module, attr)
        return None
    for info in _src_modules():
        module = importlib.import_module(info)
        if name in vars(module):
            return name, vars(module)[name]
    return None


def _resolve_internal(app, env, node, contnode):
    """missing-reference: internal names link to their public page or render as plain code."""
    if node.get("refdomain") != "py":
        return None
    found = _internal_target(node["reftarget"])
    if found is None:
        return None
    name, obj = found
    if name in jaxopt_dist.__all__ and getattr(jaxopt_dist, name) is obj:
        domain = env.get_domain("py")
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], f"jaxopt_dist.{name}", node, contnode
        )
    return contnode


def _data_docstring(app, what, name, obj, options, lines):
    """A constant re-exported by ``jaxopt_dist`` gets the docstring written under it in ``_src``.

    (autodoc would show the docstring of its type, ``str`` or ``types.UnionType``.)
    """
    from sphinx.pycode import ModuleAnalyzer

    module, _, attr = name.rpartition(".")
    if what != "data" or module != "jaxopt_dist":
        return
    for info in _src_modules():
        docs = ModuleAnalyzer.for_module(info).find_attr_docs()
        if ("", attr) in docs:
            lines[:] = list(docs[("", attr)])
            return


def _src_modules() -> list[str]:
    import pkgutil

    import jaxopt_dist._src as src

    return [info.name for info in pkgutil.walk_packages(src.__path__, "jaxopt_dist._src.")]


def _alias_in_union(app, what, name, obj, options, signature, return_annotation):
    """``TypeAliasForwardRef('optax.X') | None`` (how Sphinx prints an alias in a union) as ``optax.X | None``."""
    import re

    def unwrap(text):
        return text and re.sub(r"TypeAliasForwardRef\('([\w.]+)'\)", r"\1", text)

    return unwrap(signature), unwrap(return_annotation)


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are described by the class's Attributes section, not one by one."""
    if type(obj).__name__ == "_tuplegetter":
        return True
    return None


# -- MyST and notebooks -----------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath", "deflist", "attrs_inline"]
myst_heading_anchors = 3
# benchmarks/RESULTS.md (included by benchmarks.md) has sections whose levels skip one.
suppress_warnings = ["myst.header"]

NOTEBOOKS = ROOT / "notebooks"
nb_execution_mode = os.environ.get("JAXOPT_DIST_DOCS_EXECUTE", "cache")
nb_execution_raise_on_error = True
nb_execution_timeout = 900
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_show_tb = True
nb_merge_streams = True


def _copy_notebooks(app, config=None):
    """Copies notebooks/*.ipynb into docs/notebooks/ (only when changed, so rebuilds stay incremental)."""
    target = DOCS / "notebooks"
    target.mkdir(exist_ok=True)
    for stale in target.glob("*.ipynb"):
        if not (NOTEBOOKS / stale.name).exists():
            stale.unlink()
    for src in sorted(NOTEBOOKS.glob("*.ipynb")):
        dst = target / src.name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dst)


def _notebook_links(app, docname, source):
    """Links written for the checkout (``../notebooks/X.ipynb`` from docs/) lead to the site's rendered copy.

    The Markdown pages link the notebooks where they are in a checkout (``notebooks/`` at the
    repository root), so the links work when the pages are read there; in the site, the same link
    names the copy in ``docs/notebooks/``, which myst-nb renders.
    """
    here = (DOCS / docname).parent
    checkout, site = os.path.relpath(NOTEBOOKS, here), os.path.relpath(DOCS / "notebooks", here)
    source[0] = source[0].replace(f"]({checkout}/", f"]({site}/")


# -- HTML -------------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"jaxopt_dist {release}"
html_favicon = "_static/favicon.svg"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": True,
}
# The theme's colour mode on a first visit (left empty, its script logs an error and falls back to auto).
html_context = {"default_mode": "auto"}
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True


def setup(app):
    app.connect("config-inited", _copy_notebooks)
    app.connect("source-read", _notebook_links)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("missing-reference", _resolve_internal)
    app.connect("autodoc-process-docstring", _data_docstring)
    app.connect("autodoc-process-signature", _alias_in_union)
