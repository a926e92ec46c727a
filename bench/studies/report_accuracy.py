"""How well fxmem.report predicts the measured step peak, and whether max_batch's answers fit.

For each model and plan (level 0, level 1, one budget): compile once with ``dynamic=True`` (eager
inner compiler), then at five shapes spread 4x in batch and 4x in sequence measure the step's
peak (fxmem.profiling, exact on CPU) and compare it with ``predict_peak``. Then for three caps:
the measured peak at ``max_batch(cap)`` must fit, and the prediction at the next batch must not.

    python bench/studies/report_accuracy.py            # writes bench/results/report.{json,md}
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

import fxmem  # noqa: E402
from fxmem.models import build  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402

SHAPES = [(2, 128), (8, 128), (4, 256), (2, 512), (8, 512)]  # 4x in batch, 4x in sequence
PLAN_OPTIONS = {"level 0": {}, "level 1": {"level": 1}, "budget 0.9": {"memory_budget": 0.9}}
CAPS_MB = (150, 300, 600)
SEQ_FOR_CAPS = 256


def measure(workload, compiled, model, batch) -> int:
    for _ in range(2):  # the second step is measured: no compiling, steady allocations
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            workload.loss(compiled(**batch)).backward()
    return perf.result.peak_bytes


def run_one(name: str, plan: str, options: dict) -> dict:
    torch._dynamo.reset()
    w = build(name, batch=SHAPES[0][0], seq=SHAPES[0][1])
    model = copy.deepcopy(w.model)
    compiled = torch.compile(model, backend="fxmem", dynamic=True, options={"inner": "eager", **options})
    rows = []
    for b, s in SHAPES:
        measured = measure(w, compiled, model, build(name, batch=b, seq=s).batch)
        rep = fxmem.report(compiled)
        predicted = rep.predict_peak(input_ids=(b, s))
        rows.append(dict(batch=b, seq=s, measured=measured, predicted=predicted,
                         error=(predicted - measured) / measured, graphs=len(rep.graphs)))
        print(f"  {name} {plan} {b}x{s}: measured {measured / 2**20:.1f} MiB, predicted "
              f"{predicted / 2**20:.1f} MiB ({rows[-1]['error']:+.2%})", flush=True)
    caps = []
    rep = fxmem.report(compiled)
    for mb in CAPS_MB:
        cap = mb * 2**20
        b = rep.max_batch(cap, seq=SEQ_FOR_CAPS)
        measured = measure(w, compiled, model, build(name, batch=b, seq=SEQ_FOR_CAPS).batch) if b >= 2 else None
        caps.append(dict(cap_mib=mb, max_batch=b, measured_at_max=measured,
                         predicted_next=rep.predict_peak(input_ids=(b + 1, SEQ_FOR_CAPS)),
                         fits=measured is not None and measured <= cap,
                         next_exceeds=rep.predict_peak(input_ids=(b + 1, SEQ_FOR_CAPS)) > cap))
        print(f"  {name} {plan} cap {mb} MiB: max_batch {b}, measured there "
              f"{(measured or 0) / 2**20:.1f} MiB", flush=True)
    return dict(model=name, plan=plan, options=options, shapes=rows, caps=caps)


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__, name="report", models="hf_gpt2,hf_llama", known_models=("hf_gpt2", "hf_llama"),
                      quick=False)
    a = common.parse(p, argv)
    common.set_threads(a.threads)
    meta = common.metadata(a.command)
    results = [run_one(m, plan, opts) for m in a.models for plan, opts in PLAN_OPTIONS.items()]
    _, mp = harness.write(a.name, results, a.out_dir, meta=meta, spec="report",
                          run={"shapes": SHAPES, "caps_mib": CAPS_MB, "seq_for_caps": SEQ_FOR_CAPS})
    print(mp.read_text())


if __name__ == "__main__":
    main()
