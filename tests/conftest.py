import gc
import json
import os
import tempfile

import jax
import pytest
from hypothesis import HealthCheck, settings

from brf.runtime import release_memory

# One persistent JAX compilation cache for the test process and every process it
# starts (mains run as subprocesses, notebook kernels, multi-process checks: they
# read it from the environment). It lives under $BRF_CACHE beside the converted
# checkpoints; .ci/run points that inside the clean clone, so the cache is shared
# within a CI run, never across runs. BRF_TEST_COMPILATION_CACHE=0 turns it off.
if os.environ.get("BRF_TEST_COMPILATION_CACHE", "1") != "0":
    from brf.runtime import enable_compilation_cache
    os.environ.update(JAX_COMPILATION_CACHE_DIR=enable_compilation_cache(),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")

settings.register_profile(
    "brf", deadline=None, max_examples=int(os.environ.get("BRF_HYPOTHESIS_EXAMPLES", 40)),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True, print_blob=True)
settings.load_profile("brf")


EXTENDED = os.environ.get("BRF_EXTENDED_TESTS") == "1"


# Test files whose tests run the real models in processes of their own (a fresh
# virtual environment's mains, notebook kernels): as heavy as the `slow` tests.
REAL_MODEL_FILES = {"test_runtime_install.py", "test_notebooks.py"}


def _work_unit(item) -> str:
    """The xdist work unit of a test: its file, but one unit for every test that
    holds a real model (``slow``, or in REAL_MODEL_FILES)."""
    heavy = "slow" in item.keywords or item.path.name in REAL_MODEL_FILES
    return "real models" if heavy else item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """`extended` tests (a second route to checks made elsewhere, minutes each)
    run only with BRF_EXTENDED_TESTS=1, to keep CI within its time budget.

    A test worker also writes each test's work unit where the scheduler below reads it."""
    units = os.environ.get("BRF_TEST_UNITS")
    if units and hasattr(config, "workerinput"):
        tmp = f"{units}.{config.workerinput['workerid']}"
        with open(tmp, "w") as f:
            json.dump({item.nodeid: _work_unit(item) for item in items}, f)
        os.replace(tmp, units)  # every worker collects the same tests
    if EXTENDED:
        return
    skip = pytest.mark.skip(reason="extended test; set BRF_EXTENDED_TESTS=1 to run it")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


def extended_only(what: str) -> None:
    """Skips the running test (one case of it) unless BRF_EXTENDED_TESTS=1: for a
    parametrized case that is a second route where the mark cannot go on the case."""
    if not EXTENDED:
        pytest.skip(f"extended case ({what}); set BRF_EXTENDED_TESTS=1 to run it")


# Tiny random members (tests/tiny_lm.py) that several test modules share, built once
# per module that asks for them (imported when asked: most modules never do).
@pytest.fixture(scope="module")
def tok():
    """A tiny byte-level BPE tokenizer."""
    from tiny_lm import tiny_tokenizer
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def pair(tok):
    """Two different random models sharing one tokenizer."""
    from tiny_lm import tiny_pair
    return tiny_pair(tok)


@pytest.fixture(scope="module")
def cross_pair(tok):
    """Two random models with different byte-level BPE vocabularies."""
    from tiny_lm import tiny_cross_pair
    return tiny_cross_pair(tok)


@pytest.fixture(scope="module")
def prompt_pair(pair):
    """One model under two conditioning prefixes (a prompt ensemble: one group)."""
    from tiny_lm import prompt_ensemble
    return prompt_ensemble(pair[0])


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory():
    """After each test module, hands the memory its tests freed back to the system.

    glibc keeps freed heap memory for reuse, so a process that once held a real
    model in float64 (several GB) keeps that much resident for the rest of the
    run; two test workers side by side then hold the high-water marks of every
    module each has run (``brf.runtime.release_memory`` returns it).

    It first drops JAX's compiled programs (``jax.clear_caches``): each holds a few
    memory mappings of its machine code, and a worker that kept every program of
    half the suite passed Linux's limit of 65,530 mappings per process
    (``vm.max_map_count``; 17,000 after test_fusion and test_controls alone), so
    XLA's next compilation or cache write failed and the worker aborted. A later
    module that needs a dropped program again reads it from the persistent
    compilation cache.
    """
    yield
    jax.clear_caches()
    gc.collect()
    release_memory()


# With ``--dist loadfile`` (README's test command), tests run file by file as xdist
# does (module fixtures are built once), but every test that holds a real model goes
# to one and the same worker, one at a time: two of them side by side (up to 8 GB
# each in float64, a main's process beside them) could exhaust this machine's
# 24 GB, which ends a worker (no clean failure) when an allocation fails.
# (xdist's own loadgroup cannot be used: it renames node ids, which pytest 9 no
# longer allows.) The workers write each test's unit (_work_unit) to a file the
# scheduler reads once every worker has collected.
try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # no xdist: tests run in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class _UnitScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._units = None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:
                with open(os.environ["BRF_TEST_UNITS"]) as f:
                    self._units = json.load(f)
            return self._units.get(nodeid) or nodeid.split("::", 1)[0]

    def pytest_configure(config):
        if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "loadfile":
            fd, path = tempfile.mkstemp(prefix="brf-test-units-", suffix=".json")
            os.close(fd)
            os.environ["BRF_TEST_UNITS"] = path  # the workers start after this

    def pytest_unconfigure(config):
        path = os.environ.get("BRF_TEST_UNITS")
        if path and not hasattr(config, "workerinput"):
            os.environ.pop("BRF_TEST_UNITS")
            if os.path.exists(path):
                os.remove(path)

    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "loadfile" and os.environ.get("BRF_TEST_UNITS"):
            return _UnitScheduling(config, log)
        return None
