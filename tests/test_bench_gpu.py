"""bench/gpu.py (``python -m bench.gpu``): the GPU run's script, tested without a GPU.

The dry run runs every step at tiny sizes on the CPU (kernels in Triton's interpreter) so that a
GPU run, whose time is scarce, never meets a typo; without CUDA and without --dry-run every step
says ``skipped: no CUDA``."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import load_bench_module

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import results_format  # noqa: E402

STEPS = ("kernels", "replay", "peaks", "loss", "dpsgd")


def _run(tmp_path: Path, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """Run bench.gpu; its results file (the one format) as {name, meta, run, results: the records}."""
    run = subprocess.run([sys.executable, "-m", "bench.gpu", "--out-dir", str(tmp_path), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (res,) = [results_format.read(p) for p in tmp_path.glob("*.json")]
    assert (tmp_path / f"{res.study}.md").exists()
    records = [results_format.unflatten(r) for r in res.records().values()]
    return run, {"name": res.study, "meta": res.meta, "run": res.meta["run"], "results": records}


@pytest.mark.slow
def test_the_dry_run_covers_every_step_and_writes_its_results(tmp_path):
    t0 = time.monotonic()
    run, doc = _run(tmp_path, "--dry-run", "--threads", "1", timeout=600)
    wall = time.monotonic() - t0
    assert doc["name"] == "gpu-dry-run" and doc["run"]["dry_run"] and "python -m bench.gpu" in doc["meta"]["command"]
    rows = doc["results"]
    for step in STEPS:
        mine = [r for r in rows if r["step"] == step]
        assert mine, f"step {step} recorded nothing"
        measured = [r for r in mine if r["status"] == "ok"]
        assert measured or all(r["status"] == "skipped: no CUDA" for r in mine), (step, mine)
    allowed = ("ok", "not installed", "skipped: no CUDA")
    assert all(r["status"] in allowed for r in rows), [r for r in rows if r["status"] not in allowed]
    kernels = {r["item"] for r in rows if r["step"] == "kernels" and r["status"] == "ok"}
    assert {"bias_gelu none", "swiglu", "layer_norm", "rms_norm (Llama)", "linear_cross_entropy mean",
            "seeded_dropout", "clipped_sum"} <= kernels
    # the Triton path ran (in the interpreter) for fp32, vmap(grad) where the kernel claims it
    lce = next(r for r in rows if r["item"] == "linear_cross_entropy mean" and r["dtype"] == "float32")
    assert lce["paths"] == "triton (interpreter)+torch" and lce["vmap"] <= 1
    peaks = [r for r in rows if r["step"] == "peaks" and r["status"] == "ok"]
    assert {r["model"] for r in peaks} == {"gpt2_small", "llama_1b"} and len(peaks) == 18
    for model in ("gpt2_small",):  # offload's rows (the dry run's first model): 0.8 x recompute's least peak
        least = next(r for r in peaks if r["model"] == model and r["item"] == "fxmem recompute-only")
        offload = next(r for r in peaks if r["model"] == model and r["item"] == "fxmem offload@0.8")
        assert offload["options"]["peak_budget"] == int(0.8 * least["peak_bytes"]) and offload["options"]["offload"]
    assert all(r["predicted_bytes"] > 0 for r in peaks if r["item"].startswith("fxmem"))
    assert "## 5. DP-SGD" in run.stdout  # the table, printed at the end
    assert wall < 180, f"the dry run took {wall:.0f} s (CI's limit for it: 3 minutes)"


def test_without_cuda_every_step_says_so(tmp_path):
    _, doc = _run(tmp_path, timeout=300)
    if doc["run"]["device"] == "cuda":
        pytest.skip("a CUDA device is here: this would be the real run")
    assert doc["name"] == "gpu" and [r["step"] for r in doc["results"]] == list(STEPS)
    assert {r["status"] for r in doc["results"]} == {"skipped: no CUDA"}


def test_a_step_out_of_time_is_recorded_and_the_run_goes_on():
    gpu = load_bench_module("gpu")
    limits = gpu.Limits()

    def slow():
        while True:
            time.sleep(0.01)

    with limits.limit(30, "outer"):
        status, value = limits.guarded(0.05, "inner", slow)
        assert status.startswith("skipped: time limit") and value is None
        assert limits.guarded(5, "fine", lambda: 42) == ("ok", 42)
        status, why = limits.guarded(5, "broken", lambda: 1 / 0)
        assert (status, why) == ("error", "ZeroDivisionError: division by zero")
    with pytest.raises(gpu.TimeLimit):  # an outer limit is not swallowed by an inner guard
        with limits.limit(0.05, "outer"):
            limits.guarded(30, "inner", slow)
    assert not limits.active


def test_a_time_limit_wrapped_or_swallowed_by_the_code_it_interrupts_still_ends_it():
    gpu = load_bench_module("gpu")
    limits = gpu.Limits()

    def wraps():  # as Dynamo wraps a backend's exception
        try:
            while True:
                time.sleep(0.01)
        except BaseException as e:
            raise RuntimeError("backend compiler failed") from e

    def swallows():  # as a fallback that catches everything once
        try:
            while True:
                time.sleep(0.01)
        except BaseException:
            pass
        while True:
            time.sleep(0.01)

    assert limits.guarded(0.05, "wrapped", wraps)[0].startswith("skipped: time limit")
    t0 = time.monotonic()
    assert limits.guarded(0.05, "swallowed", swallows)[0].startswith("skipped: time limit")
    assert time.monotonic() - t0 < 3  # raised again a second later
