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


def run_config(label: str, steps: int, inner: str, batch: int, seq: int) -> dict:
    """One configuration's steps, in this process: peak (exact, allocator events), median step time, loss."""
    w = tiny_gpt(batch=batch, seq=seq, vocab=4096, d=256, layers=4, heads=4)
    kwargs = _configs(inner)[label]
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
    return dict(config=label, peak_bytes=peak, step_ms=1e3 * statistics.median(times or [first]),
                first_step_s=first, final_loss=losses[-1])


def run(steps: int = 4, inner: str = "inductor", batch: int = 8, seq: int = 256, threads: int = 1) -> list[dict]:
    """Each configuration in a fresh Python process with an empty Inductor cache, so none starts
    with caches another one warmed (the first step's time is each one's own compile)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    rows = []
    labels = list(_configs(inner))
    for i, label in enumerate(labels, 1):
        what = "running" if _configs(inner)[label] is None else "compiling and running"
        print(f"  [{i}/{len(labels)}] {label}: {what} {steps} steps in a fresh process ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="fxmem-demo-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            cmd = [sys.executable, "-m", "fxmem.demo", "--one", label, "--steps", str(steps), "--inner", inner,
                   "--batch", str(batch), "--seq", str(seq), "--threads", str(threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"demo: {label} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  [{i}/{len(labels)}] {label}: done in {rows[-1]['first_step_s']:.1f} s for the first step", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [f"{'config':28s} {'peak MiB':>9s} {'x eager':>8s} {'step ms':>9s} {'x eager':>8s} "
             f"{'1st step s':>10s} {'loss':>8s}"]
    for r in rows:
        lines.append(f"{r['config']:28s} {r['peak_bytes'] / 2**20:9.1f} {r['peak_bytes'] / base['peak_bytes']:8.2f} "
                     f"{r['step_ms']:9.1f} {r['step_ms'] / base['step_ms']:8.2f} {r['first_step_s']:10.1f} "
                     f"{r['final_loss']:8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fxmem demo", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="training steps per config (first compiles)")
    p.add_argument("--inner", choices=["inductor", "eager"], default="inductor",
                   help="inductor: compare with torch.compile's default; eager: with aot_eager (fast)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1, as the benchmarks: shared machines time more steadily); 0: torch's default")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: run this config, print JSON
    a = p.parse_args(argv)
    if a.steps < 3:
        p.error("--steps must be at least 3 (compile, timed steps, one profiled step)")
    if a.threads < 0:
        p.error("--threads must be 0 (torch's default) or a positive number")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.one is not None:
        import json

        print(json.dumps(run_config(a.one, a.steps, a.inner, a.batch, a.seq)))
        return
    print(f"Training a 4-layer GPT (hidden 256, vocab 4096) on CPU, batch {a.batch} x seq {a.seq}, "
          f"{a.steps} steps per config:", flush=True)
    print(table(run(a.steps, a.inner, a.batch, a.seq, a.threads)))
    print("peak = the training step's peak allocated bytes (forward + backward, MiB = 2**20 bytes), exact, from "
          "the allocator's events; step ms = median after the compiling step; 1st step s = compile + one step, "
          "each config in a fresh process with an empty Inductor cache.")


if __name__ == "__main__":
    main()
