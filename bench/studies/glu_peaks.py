"""What the fused SwiGLU/GeGLU do to the planned step peak: zoo models with gated MLPs at their
tiny default sizes and at vocab 32000, seq 256, hidden 64 (batch 2), levels 0-2, eager inner
compiler; planned peak with the pattern lowered over the peak without it (norms lowered in both).
Why whole graphs leave them alone unless asked for (``fxmem.lowering.patterns.GLU_FUTILE``).

    python bench/studies/glu_peaks.py   # writes bench/results/lowering-glu.{json,md}
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

from fxmem.testing import zoo  # noqa: E402
from fxmem.testing.lowering import dynamo_graph, planned_peaks  # noqa: E402

MODELS = (("llama", "swiglu"), ("mistral", "swiglu"), ("mixtral", "swiglu"), ("gemma2", "geglu"))
SIZES = {"tiny (zoo default)": {}, "vocab 32000, seq 256, hidden 64": dict(vocab=32000, seq=256, d=64)}
LEVELS = (0, 1, 2)


def main() -> None:
    rows = []
    for name, pattern in MODELS:
        build = getattr(zoo, name)
        known = inspect.signature(build).parameters
        for size, kw in SIZES.items():
            gm, inputs = dynamo_graph(build(**{k: v for k, v in kw.items() if k in known}))
            row = dict(model=name, pattern=pattern, size=size)
            for level in LEVELS:
                with_, without = planned_peaks(gm, inputs, pattern, level)
                row[f"level{level}"] = with_ / without
            rows.append(row)
            print(row, flush=True)
    harness.write("lowering-glu", rows, meta=common.metadata("python bench/studies/glu_peaks.py"))


if __name__ == "__main__":
    main()
