"""A tied LM's loss phase against its floor (issue #55): HF GPT-2 small shape (vocab 50257, tied
head, dropout 0.1 as shipped), batch 2 x 512 tokens, fp32, fxmem level 1 with its default
lowering, under each inner compiler. The figure is the step's peak minus every parameter
gradient (G): what the step holds beyond the gradients it must produce. The target is at most a
quarter of one [tokens, vocab] fp32 logits buffer above G.

    python bench/studies/loss_floor.py --layers 6,12 --inner eager,inductor
    # writes bench/results/loss-floor.{json,md}

Peaks are exact allocator events (``fxmem.profiling.step_perf``) of the third step (the first
compiles); gradients are set to None before each step, so G is allocated inside the step.
``--explain`` prints, for each case, the ops that allocated the blocks alive at the peak.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

import fxmem  # noqa: E402  (registers the backend)
from fxmem.models import hf_gpt2  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402

MiB = 2**20
BATCH, SEQ, VOCAB = 2, 512, 50257
LOGITS = BATCH * SEQ * VOCAB * 4  # one fp32 [tokens, vocab] buffer
TARGET = 0.25  # at most this many logits buffers above the gradients (issue #55)


def measure(layers: int, inner: str, dropout: float = 0.1, steps: int = 3, explain: bool = False) -> dict:
    torch.manual_seed(0)
    w = hf_gpt2(batch=BATCH, seq=SEQ, vocab=VOCAB, d=768, layers=layers, heads=12, dropout=dropout)
    model = torch.compile(w.model, backend="fxmem", options={"inner": inner, "level": 1})
    grads = sum(p.numel() * p.element_size() for p in w.model.parameters() if p.requires_grad)
    peak = forward_peak = None
    for i in range(steps):
        for p in w.model.parameters():
            p.grad = None
        gc.collect()
        last = i == steps - 1
        with step_perf("cpu", memory=last and not explain) as perf:  # (--explain: its own profiler)
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) \
                if last and explain else contextlib.nullcontext()
            with prof:
                loss = w.loss(model(**w.batch))  # (the output, logits included, dropped here)
                perf.mark("forward")
                loss.backward()
                del loss
        if last and explain:
            peak, forward_peak = _explain(prof), None
        elif last:
            peak, forward_peak = perf.result.peak_bytes, perf.result.marks[0].peak_bytes
    return dict(layers=layers, inner=inner, dropout=dropout, peak=peak, grads=grads, above_grads=peak - grads,
                above_grads_per_logits=(peak - grads) / LOGITS, met=peak - grads <= TARGET * LOGITS,
                phase="?" if forward_peak is None else "backward" if peak > forward_peak else "forward",
                fused_loss=_fused_loss(model))


def _fused_loss(compiled) -> str:
    """Whether the fused cross-entropy ran ("applied"), else why the backend left it alone."""
    graphs = fxmem.report(compiled).graphs
    if any(r.pattern == "fused_linear_cross_entropy" for g in graphs for r in g.lowerings):
        return "applied"
    notes = [n for g in graphs for n in g.lowering_notes if "fused_linear_cross_entropy" in n]
    return notes[0] if notes else "not matched"


def _explain(prof) -> int:
    """Print the blocks alive at the peak of ``prof``'s allocator events (>= 1 MiB) with the ops
    that allocated each (frees matched to allocations by size, last in first out); returns the peak."""
    events = prof.profiler.kineto_results.events()
    cpu = torch._C._autograd.DeviceType.CPU
    ops = sorted((e for e in events if e.name() != "[memory]" and e.device_type() == cpu and e.duration_ns() > 0),
                 key=lambda e: e.start_ns())
    mem = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == cpu), key=lambda e: e.start_ns())

    def owner(t):  # the enclosing ops, outermost first, without the aten helpers below the first aten op
        around = [o for o in ops if o.start_ns() <= t <= o.end_ns()]
        around.sort(key=lambda o: -o.duration_ns())
        names = [o.name() for o in around]
        first = next((i for i, x in enumerate(names) if x.startswith(("aten::", "fxmem::"))), len(names) - 1)
        return " > ".join(names[max(0, first - 2):first + 2])

    live, open_, peak, at = 0, {}, 0, {}
    for e in mem:
        n = e.nbytes()
        live += n
        if n > 0:
            open_.setdefault(n, []).append(e)
        elif open_.get(-n):
            open_[-n].pop()
        if live > peak:
            peak, at = live, {k: list(v) for k, v in open_.items() if v}
    rows = sorted(((n, owner(e.start_ns())) for n, es in at.items() for e in es if n >= MiB), reverse=True)
    print(f"peak {peak / MiB:.1f} MiB; blocks >= 1 MiB alive there:")
    for n, name in rows:
        print(f"  {n / MiB:8.1f}  {name}")
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="6,12")
    ap.add_argument("--inner", default="eager,inductor")
    ap.add_argument("--dropout", default="0.1", help="comma-separated: GPT-2 ships 0.1 (attention then runs "
                    "the math path on CPU); 0 lets it take the flash kernel")
    ap.add_argument("--explain", action="store_true")
    ap.add_argument("--name", default="loss-floor")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for layers, inner, dropout in ((int(n), i, float(d)) for n in args.layers.split(",")
                                    for i in args.inner.split(",") for d in args.dropout.split(",")):
        if True:
            r = measure(layers, inner, dropout, explain=args.explain)
            print(f"{layers} layers, {inner}, dropout {dropout}: peak {r['peak'] / MiB:.1f} MiB ({r['phase']}), "
                  f"G {r['grads'] / MiB:.1f} MiB, above G {r['above_grads'] / MiB:.1f} MiB = "
                  f"{r['above_grads_per_logits']:.3f} x logits", flush=True)
            rows.append(r)
    if not args.explain:
        harness.write(args.name, rows, meta=common.metadata(), spec="loss-floor")


if __name__ == "__main__":
    main()
