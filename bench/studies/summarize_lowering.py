"""Check pattern lowering's targets (issue "[lowering]") against a benchmark run.

    FXMEM_BENCH_MODEL_KWARGS='{"vocab": 32768}' python bench/run.py --name lowering \\
        --models hf_gpt2,hf_llama --configs eager,fxmem-eager+loss_only,... (see lowering.md)
    python bench/studies/summarize_lowering.py

Writes ``bench/results/<name>-targets.{json,md}`` (table spec ``lowering-targets``): each lowered
configuration against the same configuration without lowering (same inner compiler, same level):
peak at most 0.6x, median step time at most 1.1x, loss and gradient norm as eager's. What was
lowered, and how often, is in ``<name>.md`` (the run's ``lowered`` counts).
"""

from __future__ import annotations

import sys

import summarize_planner
from summarize_planner import Results, _pair

PEAK_MAX, TIME_MAX = 0.6, 1.1
PAIRS = (  # lowered, against
    ("fxmem-eager+lowering+loss_only", "fxmem-eager+loss_only"),
    ("fxmem-eager-level1+lowering+loss_only", "fxmem-eager-level1+loss_only"),
    ("fxmem-inductor+lowering+loss_only", "fxmem-inductor+loss_only"),
    ("fxmem-eager+lowering", "fxmem-eager"),
)


def targets(res: Results, run: dict) -> list[dict]:
    """One record per (model, lowered configuration): peak and time ratios, the loss check, the verdict."""
    out = []
    for model in run["models"]:
        for lowered, base in PAIRS:
            rec = {"model": model, **_pair(res, model, lowered, base)}
            if "peak_ratio" in rec:
                rec["check"] = res.get(model, lowered)["check"]
                rec["ok"] = rec["peak_ratio"] <= PEAK_MAX and rec["time_ratio"] <= TIME_MAX and rec["check"] == "ok"
            out.append(rec)
    return out


if __name__ == "__main__":
    sys.exit(summarize_planner.main(name="lowering", spec="lowering-targets", records=targets, description=__doc__))
