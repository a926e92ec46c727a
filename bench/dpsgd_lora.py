"""DP-SGD with LoRA (peft) on a tiny Llama: the private step's peak against the non-private one.

    python bench/dpsgd_lora.py                 # Llama 2 layers, hidden 128, vocab 4096, batch 32 x 64
    python bench/dpsgd_lora.py --quick         # tiny shapes: writes dpsgd-lora-quick.*

Variants on one batch, side by side in one process: the non-private LoRA step (eager forward,
loss, backward: the adapters' batch gradient), and ``fxmem.dpsgd.clipped_grad`` over the adapters
(``make_functional``: only ``requires_grad`` tensors get per-example gradients) at microbatch m
= the batch and m = 8. Clipped sums are checked against an explicit per-example loop (relative
error per adapter tensor); peak = exact peak of one step above what was live before it.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.func import grad

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from fxmem.dpsgd import clipped_grad, make_functional  # noqa: E402
from fxmem.models import build  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402

MIB = 2**20
FULL = dict(vocab=4096, d=128, layers=2, heads=4, seq=64, batch=32, rank=8, microbatch=8)
QUICK = dict(vocab=64, d=32, layers=1, heads=2, seq=8, batch=8, rank=2, microbatch=2)


SPEC = "dpsgd-lora"  # its table spec in bench/tables.py, whatever --name says

def loop(loss, C, trainable, frozen, ids) -> dict:
    total = {k: torch.zeros_like(v) for k, v in trainable.items()}
    for i in range(ids.shape[0]):
        g = grad(loss)(trainable, frozen, ids[i])
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values())).item()
        for k in total:
            total[k] += g[k] * min(1.0, C / norm)
    return total


def peak(fn) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn()
    step = time.perf_counter() - t0
    with step_perf("cpu") as perf:
        out = fn()
    del out
    return perf.result.peak_bytes, first, step


def run(args) -> tuple[list[dict], dict]:
    s = QUICK if args.quick else FULL
    w = build("hf_llama_lora", batch=s["batch"], seq=s["seq"], vocab=s["vocab"], d=s["d"], layers=s["layers"],
              heads=s["heads"], rank=s["rank"])
    model, ids = w.model, w.batch["input_ids"]
    fn, trainable, frozen = make_functional(model)

    def loss(tr, fr, ids):  # ONE example
        return fn(tr, fr, input_ids=ids[None], labels=ids[None]).loss

    C = 1.0
    want = loop(loss, C, trainable, frozen, ids)

    def nonprivate():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    rows = []
    p, first, step = peak(nonprivate)
    rows.append(dict(variant="non-private LoRA step (eager)", microbatch=None, peak_bytes=p, first_call_s=first,
                     step_s=step, rel_err=None))
    for m in (s["batch"], s["microbatch"]):
        cg = clipped_grad(loss, C, batch_argnums=(2,), microbatch_size=m, options={"inner": args.inner})
        p, first, step = peak(lambda cg=cg: cg(trainable, frozen, ids))
        got = cg(trainable, frozen, ids)
        err = max(((got[k] - v).abs().max() / v.abs().max()).item() for k, v in want.items())
        rows.append(dict(variant=f"fxmem private, m={m}", microbatch=m, peak_bytes=p, first_call_s=first,
                         step_s=step, rel_err=err, adapters_only=set(got) == set(trainable)))
        print(f"m={m}: peak {p / MIB:.2f} MiB, error {err:.1e}", flush=True)
    base = rows[0]["peak_bytes"]
    for r in rows:
        r["peak_vs_nonprivate"] = r["peak_bytes"] / base
    info = dict(shape=s, inner=args.inner, trainable=sum(v.numel() for v in trainable.values()),
                frozen=sum(v.numel() for v in frozen.values()))
    info["targets"] = [dict(target=f"{r['variant']}: peak <= 1.2x non-private", value=r["peak_vs_nonprivate"],
                            limit=1.2, met=r["peak_vs_nonprivate"] <= 1.2) for r in rows[1:]] + \
        [dict(target=f"{r['variant']}: clipped sum within 1e-5 of the loop", value=r["rel_err"], limit=1e-5,
              met=r["rel_err"] <= 1e-5) for r in rows[1:]]
    return rows, info


def main(argv=None) -> int:
    ap = common.parser(__doc__, name="dpsgd-lora")
    ap.add_argument("--inner", default="eager", choices=("inductor", "eager"), help="fxmem's inner compiler")
    return common.run_with_targets(ap, run, argv, spec=SPEC)


if __name__ == "__main__":
    sys.exit(main())
