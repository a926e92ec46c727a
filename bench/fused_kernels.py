"""Kernel benchmark: every fused kernel against its unfused PyTorch expression, side by side.
(Not ``kernels.py``: a script's folder is on sys.path, and transformers imports the Hugging Face
``kernels`` distribution, which the file would shadow.)

    python bench/fused_kernels.py                       # all families, bench shapes (CPU: ~10 min)
    python bench/fused_kernels.py --quick               # small shapes: writes kernels-quick.*
    python bench/fused_kernels.py --families linear_cross_entropy --steps 9

For each case (bench/kernel_cases/) and each variant: loss and gradients are checked against the
first variant (the unfused reference); peak memory of one forward + backward is measured exactly
(CPU: allocator events; CUDA: max_memory_allocated) above what was live before the step; time is
the median of ``--steps`` steps after one warm-up, the variants interleaved step by step so
machine drift hits them alike. Writes <out-dir>/<name>.json and .md (bench/common.py's writer;
--out-dir defaults to bench/results) after every case.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import harness  # noqa: E402
from kernel_cases import all_cases  # noqa: E402

from fxmem.profiling import step_perf  # noqa: E402

MIB = 2**20


def _step(case, fn, inputs):
    """Forward + backward of one variant: (loss, grads)."""
    if case.grad_of is not None:
        return case.grad_of(fn, inputs)
    diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    loss = fn(*inputs)
    return loss.detach(), torch.autograd.grad(loss, diff)


def _close(a, b, case) -> tuple[bool, float]:
    worst = 0.0
    for x, y in zip(a, b):
        err = ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return worst <= case.rtol, worst


def run_case(case, steps: int, device: str) -> list[dict]:
    inputs = [t.to(device).detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
              else t for t in case.make_inputs()]
    names = list(case.variants)
    ref_loss, ref_grads = _step(case, case.variants[names[0]], inputs)
    rows = {}
    for name in names:
        fn = case.variants[name]
        loss, grads = _step(case, fn, inputs)  # warm-up, and the correctness check
        ok, err = _close([loss, *grads], [ref_loss, *ref_grads], case)
        del loss, grads
        with step_perf(device) as perf:
            out = _step(case, fn, inputs)
        del out
        rows[name] = dict(family=case.family, case=case.name, variant=name, ok=ok, rel_err=err,
                          peak_bytes=perf.result.peak_bytes, times=[])
    for _ in range(steps):
        for name in names:
            with step_perf(device, memory=False) as perf:
                out = _step(case, case.variants[name], inputs)
            del out
            rows[name]["times"].append(perf.result.time_s)
    ref = rows[names[0]]
    for r in rows.values():
        r["time_s"] = statistics.median(r["times"])
        r["peak_ratio"] = r["peak_bytes"] / ref["peak_bytes"] if ref["peak_bytes"] else None
        r["time_ratio"] = r["time_s"] / ref["time_s"]
        r["targets"] = case.targets if r is not ref else {}
        r["notes"] = case.notes
    return list(rows.values())


def main(argv=None) -> int:
    ap = common.parser(__doc__, name="kernels", device="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--families", default="", help="comma-separated kernel_cases modules (default all)")
    ap.add_argument("--steps", type=int, default=5)
    args = common.parse(ap, argv)
    common.set_threads(args.threads)
    cases = all_cases(args.quick, common.split(args.families) or None)
    meta = common.metadata(args.command)
    run_info = dict(name=args.name, steps=args.steps, threads=args.threads or torch.get_num_threads(),
                    device=args.device, families=common.split(args.families) or None, quick=args.quick)
    rows = []
    for i, case in enumerate(cases, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(cases)}] {case.family}: {case.name} ...", flush=True)
        rows += run_case(case, args.steps, args.device)
        for r in rows[-len(case.variants):]:
            print(f"    {r['variant']:>24}: peak {r['peak_bytes'] / MIB:8.1f} MiB "
                  f"({r['peak_ratio']:.3f}x)  {r['time_s'] * 1e3:8.1f} ms ({r['time_ratio']:.2f}x)  "
                  f"{'ok' if r['ok'] else 'MISMATCH'}  [{time.perf_counter() - t0:.0f} s]", flush=True)
        harness.write(args.name, rows, args.out_dir, meta=meta, run=run_info, spec="kernels")
    bad = [r for r in rows if not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
