import gc
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
    """Each test starts with Dynamo's caches empty, the last test's garbage collected and every
    object alive now frozen (``gc.freeze``): the full collection that each memory measurement
    starts with (``fxmem.profiling.step_perf``) then scans only this test's objects, not the
    whole suite's (a collection late in the suite took about a second, 20x a fresh process's)."""
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _threads_restored():
    """A test that sets torch's thread count (per-thread kernel blocks, bitwise runs) leaves the
    next one the count it found: which kernel a CPU convolution runs on depends on it (CI ran a
    convolution test after a flash-attention test that had set one thread)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(items):
    """Inductor compiles and multi-process runs are slow here: ``-m "not slow"`` leaves them out."""
    for item in items:
        if item.get_closest_marker("inductor") or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
    """Give the frozen objects back to the collector (extensions check for leaks at exit)."""
    gc.unfreeze()
    gc.collect()
