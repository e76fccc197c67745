"""Test configuration: 8 simulated CPU devices, set before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The suite compiles some 2,300 small programs and runs each for a few steps, so XLA:CPU's backend
# optimisation (LLVM's) costs it more time than it saves: without it the suite runs about a third
# faster. XLA's own (HLO) passes still run. JAXOPT_DIST_TEST_XLA_OPT=default keeps XLA's defaults,
# as do flags that set either option already. Child processes (examples, benchmarks) inherit them.
if os.environ.get("JAXOPT_DIST_TEST_XLA_OPT", "fast") != "default":
    for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
        if _flag.split("=")[0] not in _flags:
            _flags = f"{_flags} {_flag}"
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _needs_devices(request):
    marker = request.node.get_closest_marker("devices")
    if marker is not None and jax.device_count() < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} devices, have {jax.device_count()}")


def pytest_addoption(parser):
    parser.addoption(
        "--backends",
        default=None,
        help="comma-separated subset of vmap,shard_map: tests parametrized by `backend` run under "
        "these only (CI's oldest-JAX leg: shard_map, the stricter with check_vma on)",
    )


def pytest_collection_modifyitems(config, items):
    # The heavier tests first (a stable sort keeps each group's order): pytest-xdist hands tests out
    # in this order, so its workers end together rather than one of them waiting on a long test
    # drawn last.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    keep = config.getoption("--backends")
    if not keep:
        return
    keep = {b.strip() for b in keep.split(",")}
    if unknown := keep - {"vmap", "shard_map"}:
        raise pytest.UsageError(f"--backends: unknown {sorted(unknown)}; choose from vmap, shard_map")

    def dropped(item):
        backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
        return backend in ("vmap", "shard_map") and backend not in keep

    kept, gone = [], []
    for item in items:
        (gone if dropped(item) else kept).append(item)
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = kept
