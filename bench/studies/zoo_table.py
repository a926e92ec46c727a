"""The zoo table (issue [zoo]): every zoo model under every option set, side by side with eager and
torch's min-cut partitioner. Per cell: the step equals eager's (loss and every gradient, no
fallback: ``fxmem.testing.zoo.conform``), the measured peak (the third step, exact on CPU), and
``predict_peak``'s error against it. Eager inner compiler throughout; lowering as fxmem's default
(every pattern but dropout) unless the column says "no lowering".

    python bench/studies/zoo_table.py [--profile tiny|thorough] [MODEL ...]
        # writes bench/results/zoo-<profile>.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, configs

import common  # noqa: E402
import configs  # noqa: E402
import harness  # noqa: E402

import fxmem  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402
from fxmem.testing.zoo import FAMILY, PROFILES, ZOO, conform, eager_step, zoo_build  # noqa: E402

OPTIONS = {
    "L0": {"level": 0},
    "L1": {"level": 1, "strict": True},
    "L2": {"level": 2},
    "L2 budget 0.3": {"level": 2, "memory_budget": 0.3},
    "L0 no lowering": {"level": 0, "lowering": False},
    "L1 no lowering": {"level": 1, "lowering": False},
    "L2 no lowering": {"level": 2, "lowering": False},
}
BAR = 0.05  # predict_peak's error


def _peak(fn, w) -> int:
    """The measured peak of the third step of ``fn`` (a callable over ``w.batch``)."""
    with torch._dynamo.config.patch(allow_rnn=True):
        for _ in range(3):
            with step_perf("cpu") as perf:
                eager_step(fn, w)
    return perf.result.peak_bytes


def model_row(name: str, profile: str) -> dict:
    t = time.perf_counter()
    w = zoo_build(name, profile)
    ref = copy.deepcopy(w.model)
    reference = ref, eager_step(ref, w)
    torch._dynamo.reset()
    row = dict(model=name, family=FAMILY[name], eager=_peak(copy.deepcopy(w.model), w),
               mincut=_peak(configs.build(copy.deepcopy(w.model), configs.parse("mincut_eager")), w), cells={})
    for label, options in OPTIONS.items():
        try:
            c = conform(w, options, reference)
            predicted = max((g.predict_peak() for g in fxmem.report(c.compiled).graphs), default=0)
            cell = dict(ok=c.ok, peak=c.peak_bytes, predicted=predicted, error=predicted / c.peak_bytes - 1,
                        problems=c.fallbacks + c.mismatches,
                        lowered=sorted({r.pattern for g in fxmem.report(c.compiled).graphs for r in g.lowerings}))
        except Exception as e:  # noqa: BLE001 - a cell that fails is a result, not the end of the run
            cell = dict(ok=False, peak=0, predicted=0, error=0.0, problems=[f"{type(e).__name__}: {e}"], lowered=[])
        row["cells"][label] = cell
        print(name, label, {k: v for k, v in cell.items() if k != "problems"}, cell["problems"][:2], flush=True)
    cells = row["cells"]
    row.update(
        ok=all(c["ok"] for c in cells.values()),
        levels_le_l0=all(cells[k]["peak"] <= cells["L0"]["peak"] for k in ("L1", "L2", "L2 budget 0.3")),
        lowering_no_raise=all(cells[f"L{k}"]["peak"] <= cells[f"L{k} no lowering"]["peak"] for k in range(3)),
        predicted_within=all(abs(c["error"]) <= BAR for c in cells.values()),
        seconds=time.perf_counter() - t)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=list(PROFILES), default="tiny")
    ap.add_argument("models", nargs="*", choices=[[], *ZOO], default=[])
    args = ap.parse_args(argv)
    names = args.models or list(ZOO)
    torch.set_num_threads(1)
    meta = common.metadata(f"python bench/studies/zoo_table.py --profile {args.profile} " + " ".join(args.models))
    rows = []
    for name in names:  # rewritten after every model: a long run keeps what it measured
        rows.append(model_row(name, args.profile))
        harness.write(f"zoo-{args.profile}", rows, meta=meta, spec="zoo", run={"profile": args.profile, "bar": BAR})


if __name__ == "__main__":
    main()
