import os

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


def pytest_collection_modifyitems(config, items):
    """`extended` tests (a second route to checks made elsewhere, minutes each)
    run only with BRF_EXTENDED_TESTS=1, to keep CI within its time budget."""
    if os.environ.get("BRF_EXTENDED_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="extended test; set BRF_EXTENDED_TESTS=1 to run it")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory():
    """After each test module, hands the memory its tests freed back to the system.

    glibc keeps freed heap memory for reuse, so a process that once held a real
    model in float64 (several GB) keeps that much resident for the rest of the
    run; two test workers side by side then hold the high-water marks of every
    module each has run (``brf.runtime.release_memory`` returns it).
    """
    yield
    release_memory()
