import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "brf", deadline=None, max_examples=int(os.environ.get("BRF_HYPOTHESIS_EXAMPLES", 40)),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True, print_blob=True)
settings.load_profile("brf")
