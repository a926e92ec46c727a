"""python -m fxmem demo: each configuration in its own process, MiB, progress."""

import subprocess
import sys

import pytest


@pytest.mark.slow  # three fresh processes: about 30 s of CPU
def test_demo_runs_each_config_in_a_fresh_process_and_prints_mib():
    run = subprocess.run([sys.executable, "-m", "fxmem", "demo", "--inner", "eager", "--steps", "3", "--batch", "2",
                          "--seq", "16"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    for i, label in enumerate(["eager (no compile)", "torch aot_eager", "fxmem (eager graphs)"], 1):
        what = "running" if i == 1 else "compiling and running"
        assert f"[{i}/3] {label}: {what} 3 steps in a fresh process" in out
        assert f"[{i}/3] {label}: done in" in out
    header = next(line for line in out.splitlines() if line.startswith("config"))
    assert "peak MiB" in header and " MB" not in header
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()
            if line.startswith(("eager", "torch", "fxmem"))}
    assert float(rows["fxmem (eager graphs)"][0]) < float(rows["eager (no compile)"][0])  # fxmem keeps less
    assert rows["fxmem (eager graphs)"][-1] == rows["eager (no compile)"][-1]  # same loss
