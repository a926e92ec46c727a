"""How well ``predict_peak`` predicts the measured step peak on every zoo model (issue [zoo]):
levels 0, 1 and 2, with and without lowering, eager inner compiler, the zoo's tiny configs.

The measured peak is the third step's, exact on CPU (fxmem.profiling): HF's classification heads
set ``config.problem_type`` on the first call, so the second step compiles again. The
prediction is the report's at the compiled shape; with several graphs (a graph break) the
largest graph's, and the row says how many graphs there were.

    python bench/studies/zoo_predict.py [MODEL ...]   # writes bench/results/zoo-predict.{json,md}
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402

import fxmem  # noqa: E402
from fxmem.testing.zoo import FAMILY, ZOO, zoo_build  # noqa: E402

CONFIGS = {f"L{level}{'' if lower else ' no-lower'}": {"level": level, "lowering": lower}
           for lower in (True, False) for level in (0, 1, 2)}
BAR = 0.05


def row(name: str, config: str, options: dict) -> dict:
    fn, _, measured, _ = common.zoo_steps(zoo_build(name), options)
    graphs = fxmem.report(fn).graphs
    predicted = max((g.predict_peak() for g in graphs), default=0)
    r = dict(model=name, family=FAMILY[name], config=config, measured=measured, predicted=predicted,
             graphs=len(graphs), error=(predicted - measured) / measured if measured else 0.0)
    print(r, flush=True)
    return r


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    rows = [row(n, c, o) for n in names for c, o in CONFIGS.items()]
    within = sum(abs(r["error"]) <= BAR for r in rows)
    lines = ["# predict_peak against the measured peak on the zoo", "",
             "Zoo models (tiny configs, dropout as shipped), eager inner compiler; KiB; error = predicted / "
             f"measured - 1. Bar: within {BAR:.0%}. {within} of {len(rows)} cells within it.", "",
             "| model | family | " + " | ".join(CONFIGS) + " |", "|---|---|" + "---:|" * len(CONFIGS)]
    for name in names:
        cells = {r["config"]: r for r in rows if r["model"] == name}
        lines.append(f"| {name} | {FAMILY[name]} | " + " | ".join(
            f"{cells[c]['measured'] / 1024:.0f} / {cells[c]['predicted'] / 1024:.0f} ({100 * cells[c]['error']:+.1f}%)"
            + ("" if cells[c]["graphs"] == 1 else f" [{cells[c]['graphs']} graphs]") for c in CONFIGS) + " |")
    lines += ["", "Each cell: measured / predicted KiB (error)."]
    common.write_results("zoo-predict", rows, "\n".join(lines) + "\n",
                         command="python bench/studies/zoo_predict.py " + " ".join(names))


if __name__ == "__main__":
    main(sys.argv[1:] or list(ZOO))
