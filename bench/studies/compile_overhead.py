"""fxmem's share of compile time: a 32-layer Llama config (eager inner compiler) against
``aot_eager`` (Dynamo + AOTAutograd, min-cut partitioner, no inner compiler) in the same run.

Each configuration compiles the model afresh (``torch._dynamo.reset()``) ``REPEATS`` times,
interleaved; the table gives the median time of the first step (tracing, planning, the step)
and its ratio to aot_eager's. A second table profiles one level-1 compile: where fxmem's time goes.

    python bench/studies/compile_overhead.py   # writes bench/results/realistic-compile-time.{json,md}
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

import fxmem  # noqa: E402,F401  (registers the backend)
from fxmem.models import build  # noqa: E402

LAYERS, REPEATS = 32, 5
NORMS_ONLY = {"fused_linear_cross_entropy": False, "swiglu": False}  # Llama's matches but the norms
COMPARED = {"swiglu": True}  # named: compared with the plan without it (one trace, a second plan)
CONFIGS = {"aot_eager": ("aot_eager", None),
           "fxmem level 0": ("fxmem", {"inner": "eager"}),
           "fxmem level 1": ("fxmem", {"inner": "eager", "level": 1}),
           "fxmem level 0, lowering off": ("fxmem", {"inner": "eager", "lowering": False}),
           "fxmem level 1, lowering off": ("fxmem", {"inner": "eager", "level": 1, "lowering": False}),
           # the proven patterns alone (the norms here): lowered without comparing plans
           "fxmem level 0, norms only": ("fxmem", {"inner": "eager", "lowering": NORMS_ONLY}),
           "fxmem level 1, norms only": ("fxmem", {"inner": "eager", "level": 1, "lowering": NORMS_ONLY}),
           # a pattern the backend compares (named SwiGLU): what the comparison costs where it runs
           "fxmem level 1, SwiGLU compared": ("fxmem", {"inner": "eager", "level": 1, "lowering": COMPARED})}


def first_step(backend: str, options: dict | None) -> float:
    torch._dynamo.reset()
    # Llama's vocabulary; 256 tokens: the fused loss is proven by its sizes (logits 4x its gradients)
    w = build("hf_llama", batch=2, seq=128, vocab=32000, d=64, layers=LAYERS, heads=2)
    compiled = torch.compile(w.model, backend=backend, options=options)
    t = time.perf_counter()
    w.loss(compiled(**w.batch)).backward()
    return time.perf_counter() - t


def fxmem_share() -> list[tuple[str, float]]:
    """Cumulative seconds of fxmem's own stages in one level-1 compile (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    first_step(*CONFIGS["fxmem level 1"])
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = {}
    for (path, _, fn), (_, _, _, cum, _) in stats.items():
        if "/fxmem/" in path and fn in {"plan", "split", "publish", "decide", "make_replayable", "reuse_dead_buffers",
                                        "__call__", "fxmem_backend", "compile_joint"}:
            key = f"{Path(path).parent.name}/{Path(path).name}:{fn}"
            rows[key] = max(rows.get(key, 0.0), cum)
    return sorted(rows.items(), key=lambda kv: -kv[1])


def main() -> None:
    times = {name: [] for name in CONFIGS}
    for _ in range(REPEATS):
        for name, (backend, options) in CONFIGS.items():
            times[name].append(first_step(backend, options))
            print(name, round(times[name][-1], 1), flush=True)
    base = statistics.median(times["aot_eager"])
    rows = [dict(config=n, seconds=statistics.median(t), all=t, ratio=statistics.median(t) / base)
            for n, t in times.items()]
    records = rows + [{"config": "fxmem_stages", "stages": fxmem_share()}]  # [(function, cumulative s)]
    harness.write("realistic-compile-time", records, meta=common.metadata("python bench/studies/compile_overhead.py"))


if __name__ == "__main__":
    main()
