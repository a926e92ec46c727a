"""When the fused cross-entropy lowers the planned step peak: its logits (tokens x vocab) against
the gradients it computes in the forward and keeps for the backward ((tokens + vocab) x hidden).

For zoo models at several vocabularies, hidden sizes and token counts, the planned peak (eager
inner compiler, levels 0 and 1) with the fused loss over the peak without it (norms lowered in both),
next to the decision the backend takes without comparing plans
(``fxmem.lowering.patterns.CE_FUTILE_BELOW`` / ``CE_PROVEN_FROM``: declined below the first ratio,
applied from the second, compared in between).

    python bench/studies/ce_ratio.py   # writes bench/results/lowering-ce-ratio.{json,md}
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

from fxmem.lowering.patterns import CE_FUTILE_BELOW, CE_PROVEN_FROM  # noqa: E402
from fxmem.testing import zoo  # noqa: E402
from fxmem.testing.lowering import dynamo_graph, planned_peaks  # noqa: E402

MODELS = ("llama_tied", "gpt2", "bart", "t5", "roberta", "whisper")
# (vocab, hidden, seq) at batch 2; tokens = 2 x seq
SIZES = ((512, 32, 16), (4096, 128, 64), (2048, 32, 16), (512, 32, 24), (2048, 64, 48), (512, 32, 32),
         (1024, 64, 64), (4096, 128, 128), (32000, 64, 64), (1024, 64, 96), (512, 32, 64), (32000, 64, 256))
LEVELS = (0, 1)  # level 2 planned as level 1 on every one of these
PATTERN = "fused_linear_cross_entropy"


def decision(ratio: float) -> str:
    return "declined" if ratio < CE_FUTILE_BELOW else "applied" if ratio >= CE_PROVEN_FROM else "compared"


def main() -> None:
    rows = []
    for name in MODELS:
        build = getattr(zoo, name)
        known = inspect.signature(build).parameters
        for vocab, hidden, seq in SIZES:
            w = build(**{k: v for k, v in dict(vocab=vocab, d=hidden, seq=seq).items() if k in known})
            gm, inputs = dynamo_graph(w)
            tokens = 2 * seq
            ratio = tokens * vocab / ((tokens + vocab) * hidden)
            row = dict(model=name, vocab=vocab, hidden=hidden, tokens=tokens, ratio=ratio, decision=decision(ratio))
            for level in LEVELS:
                with_, without = planned_peaks(gm, inputs, PATTERN, level)
                row[f"level{level}"] = with_ / without
            rows.append(row)
            print(row, flush=True)
    harness.write("lowering-ce-ratio", rows, meta=common.metadata("python bench/studies/ce_ratio.py"),
                  run={"futile_below": CE_FUTILE_BELOW, "proven_from": CE_PROVEN_FROM})


if __name__ == "__main__":
    main()
