"""Example counts per hypothesis profile: the model-level properties compile a model per example
(seconds each), so their ``thorough`` counts are lower than the profile's default of 2000."""
import os

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def examples(ci: int, thorough: int) -> int:
    return thorough if THOROUGH else ci
