"""``python -m fxmem demo``: train a small GPT with torch's default compile and with fxmem, side by side."""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from .models import tiny_gpt
from .profiling import step_perf


def _configs(inner: str) -> dict:
    if inner == "eager":  # torch's default partition with eager graphs vs fxmem with eager graphs
        return {"eager (no compile)": None, "torch aot_eager": dict(backend="aot_eager"),
                "fxmem (eager graphs)": dict(backend="fxmem", options={"inner": "eager"})}
    return {"eager (no compile)": None, "torch.compile (inductor)": {},
            "fxmem (inductor)": dict(backend="fxmem", options={"inner": "inductor"})}


def run(steps: int = 4, inner: str = "inductor", batch: int = 8, seq: int = 256) -> list[dict]:
    w = tiny_gpt(batch=batch, seq=seq, vocab=4096, d=256, layers=4, heads=4)
    rows = []
    for label, kwargs in _configs(inner).items():
        torch._dynamo.reset()
        model = copy.deepcopy(w.model)
        step_fn = model if kwargs is None else torch.compile(model, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        losses, times, peak = [], [], 0
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            with step_perf("cpu", batch_size=batch, memory=(i == steps - 1)) as perf:
                loss = w.loss(step_fn(**w.batch))
                loss.backward()
            opt.step()
            losses.append(loss.item())
            if i == 0:
                first = time.perf_counter() - t0
            elif i < steps - 1:
                times.append(perf.result.time_s)
            else:
                peak = perf.result.peak_bytes
        rows.append(dict(config=label, peak_mb=peak / 1e6, step_ms=1e3 * statistics.median(times or [first]),
                         first_step_s=first, final_loss=losses[-1]))
        print(f"  {label:28s} done", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [f"{'config':28s} {'peak MB':>9s} {'x eager':>8s} {'step ms':>9s} {'x eager':>8s} "
             f"{'1st step s':>10s} {'loss':>8s}"]
    for r in rows:
        lines.append(f"{r['config']:28s} {r['peak_mb']:9.1f} {r['peak_mb'] / base['peak_mb']:8.2f} "
                     f"{r['step_ms']:9.1f} {r['step_ms'] / base['step_ms']:8.2f} {r['first_step_s']:10.1f} "
                     f"{r['final_loss']:8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fxmem demo", description=__doc__)
    p.add_argument("--steps", type=int, default=4, help="training steps per config (first compiles)")
    p.add_argument("--inner", choices=["inductor", "eager"], default="inductor",
                   help="inductor: compare with torch.compile's default; eager: with aot_eager (fast)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1, as the benchmarks: shared machines time more steadily); 0: torch's default")
    a = p.parse_args(argv)
    if a.steps < 3:
        p.error("--steps must be at least 3 (compile, timed steps, one profiled step)")
    if a.threads < 0:
        p.error("--threads must be 0 (torch's default) or a positive number")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"Training a 4-layer GPT (hidden 256, vocab 4096) on CPU, batch {a.batch} x seq {a.seq}, "
          f"{a.steps} steps per config:", flush=True)
    print(table(run(a.steps, a.inner, a.batch, a.seq)))
    print("peak = the training step's peak allocated bytes (forward + backward), exact, from the "
          "allocator's events; step ms = median after the compiling step.")
