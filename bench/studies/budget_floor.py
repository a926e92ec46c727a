"""Why fxmem refuses memory budgets below its floor: the peak of the plans that would meet them.

    python bench/studies/budget_floor.py --name budget-floor --models hf_gpt2,hf_llama --fractions 0.3,0.1

A budget is the cap on saved bytes, and a lower budget must not raise the step's peak. On a
language model the cross-entropy's log-softmax (batch x seq x vocab) is kept by every plan fxmem
accepts: the backward reads it first, at its peak, so recomputing it saves nothing there. A cap
below it (the floor) can only be met by rerunning the vocabulary projection in the backward.

This script measures that claim (eager inner compiler, whose simulated peak is exact): the floor
plan (the smallest budget fxmem accepts), and, for each fraction below the floor, the plan fxmem
would make if it were allowed to recompute the head (``read_before_backward_peak`` emptied and
every matmul recomputable: an experiment, not an fxmem option), each with its measured peak and
the largest tensors alive at it. Writes ``bench/results/<name>.{json,md}``.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: configs, worker, common

import configs  # noqa: E402
import study  # noqa: E402  (bench/studies/, this script's directory)
from worker import workload  # noqa: E402

MiB = 2**20


@contextlib.contextmanager
def head_recomputable():
    """Let a budget recompute every matmul, the vocabulary projection included."""
    import fxmem.remat.budget as budget
    import fxmem.remat.plan as plan
    from fxmem.remat.allowlist import HEAVY, kind

    before, within = budget.read_before_backward_peak, plan.within_budget

    def everything(joint, options, sizes, saved, recomp, keep, problem, notes):
        heavy = {n for n in joint.gm.graph.nodes if n not in joint.backward and kind(n) == HEAVY}
        return within(joint, options, sizes, saved, recomp | heavy, keep, problem, notes)

    budget.read_before_backward_peak = lambda *a: set()
    plan.within_budget = everything
    try:
        yield
    finally:
        budget.read_before_backward_peak, plan.within_budget = before, within


def measure(model_name: str, quick: bool, budget) -> dict:
    """Compile with fxmem (eager inner) at ``budget``; its plan, measured peak and breakdown."""
    import torch

    import fxmem
    from fxmem.profiling import step_perf

    torch._dynamo.reset()
    wl, batch = workload(model_name, configs.model_kwargs(model_name, quick), 0, "cpu")
    fn = torch.compile(wl.model, backend="fxmem", options={"inner": "eager", "memory_budget": budget})
    try:
        for _ in range(2):  # the second step is measured
            wl.model.zero_grad(set_to_none=True)
            with step_perf("cpu") as perf:
                wl.loss(fn(**batch)).backward()
    except Exception as e:  # BudgetError, wrapped by Dynamo
        return {"budget": budget, "error": str(e).splitlines()[0]}
    rep = fxmem.report(fn)
    g, b = rep.graphs[-1], rep.peak_breakdown()
    return {"budget": budget, "saved_bytes": g.saved_bytes, "measured_peak": perf.result.peak_bytes,
            "predicted_peak": b["peak"], "phase": b["phase"], "at": b["at"], "live": b["live"][:6],
            "live_count": len(b["live"])}


def run(model_name: str, fractions: list[float], quick: bool) -> dict:
    refused = measure(model_name, quick, 0.01)
    found = re.search(r"smallest feasible budget is (\d+) bytes \(([0-9.]+) of level 0's (\d+)\)",
                      refused.get("error", ""))
    if not found:
        raise RuntimeError(f"{model_name}: expected a BudgetError naming the floor, got {refused}")
    floor_bytes, level0 = int(found.group(1)), int(found.group(3))
    rows = [dict(measure(model_name, quick, floor_bytes), label=f"floor ({found.group(2)})", head="kept")]
    for f in fractions:
        rows.append(dict(measure(model_name, quick, f), label=f"{f} (fxmem)", head="kept"))
        with head_recomputable():
            rows.append(dict(measure(model_name, quick, f), label=f"{f}, head recomputable", head="recomputable"))
    return {"model": model_name, "model_kwargs": configs.model_kwargs(model_name, quick), "level0_bytes": level0,
            "floor_bytes": floor_bytes, "rows": rows}


if __name__ == "__main__":
    study.main(__doc__, __file__, "budget-floor", "0.3,0.1", run)
