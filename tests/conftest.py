import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Scripts the tests run in subprocesses (README blocks, the CLI, distributed workers) import this
# checkout's fxmem, not whichever one is pip-installed (an editable install of another checkout
# would otherwise win: a script's sys.path has its own folder, not the working directory).
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

# ci: the same examples on every run (derandomized), so CI is reproducible; thorough: random.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield


def pytest_collection_modifyitems(items):
    """Inductor compiles and multi-process runs are slow here: ``-m "not slow"`` leaves them out."""
    for item in items:
        if item.get_closest_marker("inductor") or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
