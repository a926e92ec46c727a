"""One cell of the zoo table, quickly (issue #56 [whole-step]): a zoo or outside-zoo family under
one option set, the step checked against eager's, its measured peak (third step) against the whole
step's ``predict_peak``, and the graph runs of the step:

    PYTHONPATH=<checkout> python bench/studies/whole_step.py switch_transformers '{"level": 1}'
    ... --no-mask     # SwitchTransformers without its attention mask (Dynamo skips its stacks' frames)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # outside_zoo

import outside_zoo  # noqa: E402
import torch  # noqa: E402

import fxmem  # noqa: E402
from fxmem.testing import zoo  # noqa: E402
from fxmem.testing.zoo import conform, eager_step  # noqa: E402


def main(argv: list[str]) -> None:
    name, options = argv[0], json.loads(argv[1]) if len(argv) > 1 and not argv[1].startswith("--") else {"level": 1}
    zoo.ZOO.update(outside_zoo.OUTSIDE)
    zoo.PROFILES["tiny"].update({n: {} for n in outside_zoo.OUTSIDE})
    torch.set_num_threads(1)
    w = zoo.zoo_build(name)
    if "--no-mask" in argv:
        w.batch.pop("attention_mask", None)
    ref = copy.deepcopy(w.model)
    c = conform(w, options, (ref, eager_step(ref, w)))
    rep = fxmem.report(c.compiled)
    predicted = rep.predict_peak()
    error = predicted / c.peak_bytes - 1
    print(f"{name} {options}: measured {c.peak_bytes} B, predicted {predicted} B ({error:+.1%}), "
          f"{len(rep.step_graphs())} graph runs, fxmem {Path(fxmem.__file__).parents[1]}, "
          f"{'ok' if c.ok else 'NOT ok: ' + '; '.join(c.fallbacks + c.mismatches)[:300]}")


if __name__ == "__main__":
    main(sys.argv[1:])
