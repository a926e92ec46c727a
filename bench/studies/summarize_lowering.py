"""Check pattern lowering's targets (issue "[lowering]") against a benchmark run.

    FXMEM_BENCH_MODEL_KWARGS='{"vocab": 32768}' python bench/run.py --name lowering \\
        --models hf_gpt2,hf_llama --configs eager,fxmem-eager+loss_only,... (see lowering.md)
    python bench/studies/summarize_lowering.py

Appends a "Targets" section to ``bench/results/<name>.md`` (replacing any earlier one): each
lowered configuration against the same configuration without lowering (same inner compiler,
same level): peak at most 0.6x, median step time at most 1.1x, loss and gradient norm as eager's.
"""

from __future__ import annotations

import sys

import summarize_planner
from summarize_planner import Results, _pf, _time_ratio

HEADING = '## Targets (issue "[lowering]")'
PEAK_MAX, TIME_MAX = 0.6, 1.1
PAIRS = (  # lowered, against
    ("fxmem-eager+lowering+loss_only", "fxmem-eager+loss_only"),
    ("fxmem-eager-level1+lowering+loss_only", "fxmem-eager-level1+loss_only"),
    ("fxmem-inductor+lowering+loss_only", "fxmem-inductor+loss_only"),
    ("fxmem-eager+lowering", "fxmem-eager"),
)
PATTERNS = """Patterns lowered, from fxmem's report of the `+lowering+loss_only` compile at these \
shapes (count; saved-for-backward bytes
saved = what autograd keeps for the unfused pattern minus the fused one):

| model | pattern | count | bytes saved |
|---|---|---:|---:|
| hf_gpt2 | `fused_linear_cross_entropy` | 1 | 232,775,684 |
| hf_gpt2 | `bias_gelu` (GPT-2's tanh formula written out; bias from Conv1D's addmm) | 4 | 100,663,296 |
| hf_gpt2 | `layer_norm` | 9 | 0 |
| hf_llama | `fused_linear_cross_entropy` | 1 | 232,775,684 |
| hf_llama | `swiglu` | 4 | 33,554,432 |
| hf_llama | `rms_norm` | 9 | 18,874,368 |

Dropout does not occur (p = 0 in these configurations; AOTAutograd removes it), GeGLU neither. \
tests/test_lowering.py checks
the counts and the numbers at small shapes. The fused norm, activation and dropout ops are recomputable like the \
ops they
replace (fxmem/remat/allowlist.py), so the planner keeps no more of them than of the unfused ones."""


def targets(doc: dict, notes: list[str]) -> str:
    res = Results(doc)
    rows = ["| model | lowered | against | peak ratio | time ratio (median; min) | loss & grads | target |",
            "|---|---|---|---:|---:|---|---|"]
    for model in doc["run"]["models"]:
        for lowered, base in PAIRS:
            a, b = res.get(model, lowered), res.get(model, base)
            if a is None or b is None:
                rows.append(f"| {model} | `{lowered}` | `{base}` | not run | | | |")
                continue
            peak = a["peak_bytes"] / b["peak_bytes"]
            med, text = _time_ratio(a, b)
            ok = peak <= PEAK_MAX and med <= TIME_MAX and a["check"] == "ok"
            rows.append(f"| {model} | `{lowered}` | `{base}` | {peak:.2f} | {text} | {a['check']} | {_pf(ok)} |")
    head = [HEADING, "",
            f"Written by `python bench/studies/summarize_lowering.py` from the JSON of this run. Each lowered "
            f"configuration against the same configuration without lowering (same inner compiler, same level): "
            f"peak at most "
            f"{PEAK_MAX}x, median step time at most {TIME_MAX}x; loss within 1e-5 and gradient norm within 1e-4 of "
            "eager. `+loss_only` compiles the model returning only its loss; the last row of each model is the HF "
            "model as is, which also returns its logits: they are computed once, for the output and the fused loss, "
            "and their backward skips its matmuls when their gradient is zero.", "",
            *[f"Note: {n}\n" for n in notes]]
    return "\n".join(head + rows + ["", PATTERNS, ""])


if __name__ == "__main__":
    sys.exit(summarize_planner.main(name="lowering", heading=HEADING, section=targets, description=__doc__))
