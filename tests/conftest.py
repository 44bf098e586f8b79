import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "brf", deadline=None, max_examples=int(os.environ.get("BRF_HYPOTHESIS_EXAMPLES", 40)),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True, print_blob=True)
settings.load_profile("brf")


# Files whose tests load the real models (or their converted tokenizers). With
# pytest-xdist (`-n 2 --dist loadgroup`) they run one after another on one
# worker, and one worker converts each checkpoint once. CI runs serially: two
# workers grew to 10.4 and 8.7 GB and the first was killed for memory on this
# 24 GB machine (a study was paused beside them, holding 4.8 GB).
REAL_MODEL_FILES = frozenset({
    "test_validate_real.py", "test_real_parity.py", "test_modules_real.py",
    "test_models_real.py", "test_logit_csv.py", "test_notebooks.py",
    "test_checkpoint_store.py", "test_gguf.py", "test_tokenizer_gguf.py"})


def pytest_collection_modifyitems(config, items):
    """Real-model tests share one xdist group; `extended` tests (a second route to
    checks made elsewhere, minutes each) run only with BRF_EXTENDED_TESTS=1, to
    keep CI within its time budget."""
    import pytest
    real = pytest.mark.xdist_group("real_models")
    for item in items:
        if "slow" in item.keywords or item.path.name in REAL_MODEL_FILES:
            item.add_marker(real)
    if os.environ.get("BRF_EXTENDED_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="extended test; set BRF_EXTENDED_TESTS=1 to run it")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)
