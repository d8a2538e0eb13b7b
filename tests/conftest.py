"""Shared set-up of the test suite.

* Without CUDA the Triton kernels run under Triton's interpreter, which must be chosen before any
  ``@triton.jit`` function is defined, i.e. before saria.kernels is imported by a test module.
* Tests marked ``long`` (long hunts, soaks, engine scenarios beyond one of each kind) run only with
  ``SARIA_LONG_TESTS=1`` (``SARIA_LONG_TESTS=1 make test``); ``make test`` reports them skipped.
* The dense engine tests share one small model and one reference engine of plain vLLM
  (``dense_session``), instead of building and starting their own.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

LONG = os.environ.get("SARIA_LONG_TESTS", "") not in ("", "0")

# pytest-xdist workers (make test runs two): each binds the engines it starts to cores of its own
# (saria.harness.engine.engine_env), so two engines never share one core while the other idles.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "SARIA_ENGINE_FIRST_CORE" not in os.environ:
    os.environ["SARIA_ENGINE_FIRST_CORE"] = str(int(_WORKER[2:]) % (os.cpu_count() or 1))
DENSE_CHUNK = 64  # the dense engine tests' chunk: two 32-token vLLM blocks


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a long hunt or an extra engine scenario; runs with SARIA_LONG_TESTS=1")


# The slowest modules, in seconds of one `make test` worker (--durations on the 2-core VM, under load), run
# first: pytest-xdist's loadfile hands modules out in collection order, and a slow module handed out last
# leaves the other worker idle while it runs. The order changes only when a module runs, never what runs;
# a module not listed (or renamed) keeps its place after these. Refresh with `pytest --durations=0`.
SLOW_MODULES = {
    "test_vllm_connector.py": 254, "test_vllm_connector_tp.py": 185, "test_vllm_connector_sealed.py": 175,
    "test_control_differential.py": 75, "test_serve.py": 130, "test_emulated_cpus.py": 129,
    "test_serve_hints.py": 110, "test_vllm_connector_cluster_engines.py": 85, "test_control_soak.py": 71,
    "test_doctor.py": 70, "test_vllm_features.py": 58, "test_vllm_connector_stores.py": 54,
    "test_cli_fuzz.py": 52, "test_vllm_connector_prewarm.py": 42, "test_vllm_connector_resets.py": 31,
}


def slowest_modules_first(items: list) -> None:
    """Reorder ``items`` in place, module by module (each module's tests keep their order): the modules of
    :data:`SLOW_MODULES` first, slowest first, then the others as collected."""
    def cost(item) -> int:
        return -SLOW_MODULES.get(os.path.basename(str(item.path)), 0)
    items.sort(key=cost)  # stable: a module's tests stay together and in order


def pytest_collection_modifyitems(config, items):
    slowest_modules_first(items)
    if LONG:
        return
    skip = pytest.mark.skip(reason="long test: run with SARIA_LONG_TESTS=1 make test")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory):
    """One vLLM cache for every engine the tests start (``saria.harness.engine.engine_env``): each
    start without one inspects the model in a child process again (about 10 s here). It lives in
    the session's temporary directory: nothing is kept between runs."""
    from saria.harness.engine import shared_cache

    with shared_cache(tmp_path_factory.mktemp("vllm-cache")):
        yield


@pytest.fixture(scope="session")
def dense_session(tmp_path_factory):
    """The dense engine tests' model (a small Qwen3 with random weights), their 4-turn agent
    session, and the ``reference`` their outputs are held against: one engine of plain vLLM with
    the reference connector (``saria.harness.reference_runs.ReferenceEngine``, started at the first
    replay), which replays each saria run's history (``assert_same_outputs``)."""
    from saria.harness import build_model, synthetic_session
    from saria.harness.reference_runs import ReferenceEngine

    root = tmp_path_factory.mktemp("dense-session")
    model = str(build_model(root / "model", "dense"))
    prompts = synthetic_session(4, system_tokens=250, step_tokens=150, seed=1)
    spec = {"model": model, "prompts": prompts, "max_tokens": 6, "enforce_eager": True}  # eager: starts faster
    with ReferenceEngine(spec) as reference:
        yield {"model": model, "prompts": prompts, "spec": spec, "reference": reference}
