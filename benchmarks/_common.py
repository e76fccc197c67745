"""Pieces shared by the benchmark scripts (this file is not a benchmark).

Importing this module sets JAX up for the benchmarks: it calls
:func:`configure_devices` (8 simulated CPU devices, ``JAX_PLATFORMS=cpu``
unless set) *before* it imports jax, so every benchmark imports it ahead of
jax::

    import _common  # first: sets XLA_FLAGS / JAX_PLATFORMS before jax loads
    import jax

(ruff's import sorting keeps ``import _common`` first among the third-party
imports, and :func:`configure_devices` raises if jax came first.)

``benchmarks/`` is not a package: the scripts run as
``python benchmarks/bench_x.py``, and Python puts the script's own directory
first on ``sys.path``, which is where ``import _common`` finds this file.

Also here: a 1-D ``"data"`` mesh, scikit-learn's digits and the small
64-32-10 tanh MLP that several benchmarks train on it, examples/demo.py as a
module (for its Flax model and data), byte formatting, markdown table lines
and the command-line parser with ``--quick``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import shaped_link

N_WORKERS = 8


def configure_devices(n: int = N_WORKERS) -> None:
    """Simulates ``n`` CPU devices; call before importing jax.

    Sets ``JAX_PLATFORMS=cpu`` unless already set and appends
    ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS`` unless a
    device count is already there (as tests/conftest.py does).

    Raises:
      ValueError: if ``n`` is not a positive int.
      RuntimeError: if jax is already imported and ``XLA_FLAGS`` has no
        device count yet (setting it now would be too late).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"configure_devices: n must be a positive int, got {n!r}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    if "jax" in sys.modules:
        raise RuntimeError("configure_devices: call it (import _common) before importing jax")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


configure_devices(N_WORKERS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def parser(doc: str, quick_help: str = "tiny run (smoke test)") -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with the ``--quick`` flag."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def data_mesh(n: int = N_WORKERS) -> jax.sharding.Mesh:
    """A 1-D mesh with axis ``"data"`` over the first ``n`` devices."""
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


# ----------------------------------------------------------------------------
# Digits and the small MLP.


def load_digits(seed: int = 0, n_train: int = 1440):
    """scikit-learn's digits, pixels scaled to [0, 1], shuffled with ``seed``.

    Returns ``(x_train, y_train, x_test, y_test)``: float32 images of 64
    pixels and int32 labels, the first ``n_train`` (1440) shuffled images for
    training and the other 357 for testing.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    x, y = sklearn_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = x[perm], y[perm].astype(np.int32)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def mlp_init(seed: int = 0, hidden: int = 32) -> dict[str, jax.Array]:
    """Parameters of the 64-``hidden``-10 tanh MLP (2410 with ``hidden=32``)."""
    rng = np.random.default_rng(seed)
    return {
        "b1": jnp.zeros(hidden, jnp.float32),
        "b2": jnp.zeros(10, jnp.float32),
        "w1": jnp.asarray(rng.standard_normal((64, hidden)) / 8.0, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((hidden, 10)) / np.sqrt(hidden), jnp.float32),
    }


def mlp_logits(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"] + params["b2"][None, :]


def mlp_loss(params, batch):
    """Mean softmax cross-entropy on ``batch = {"x": images, "y": labels}``."""
    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, batch["x"]), batch["y"]).mean()


@jax.jit
def mlp_accuracy(params, x, y):
    return jnp.mean(jnp.argmax(mlp_logits(params, x), axis=-1) == y)


def import_demo():
    """examples/demo.py as the module ``demo`` (its Flax MLP, digits split and batches).

    The demo stays self-contained; benchmarks that measure on the demo's model
    and data import it from here.
    """
    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import demo

    return demo


# ----------------------------------------------------------------------------
# Printing.

# ``b`` bytes with 4 significant digits in GB, MB, kB or B: the harness's, one definition.
fmt_bytes = shaped_link.fmt_bytes


def markdown_row(cells) -> str:
    """One markdown table row: ``| a | b |``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_header(columns, align: str = "") -> str:
    """The header and separator lines of a markdown table.

    ``align`` has one letter per column, ``"l"`` (``---``) or ``"r"``
    (``---:``); missing letters mean ``"l"``.
    """
    seps = ["---:" if a == "r" else "---" for a in align.ljust(len(columns), "l")]
    return markdown_row(columns) + "\n|" + "".join(s + "|" for s in seps)
