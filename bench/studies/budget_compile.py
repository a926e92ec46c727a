"""Compile time with a memory budget against level 0's (issue [budget]): a Llama config at 2, 8
and 32 layers (eager inner compiler, lowering off so both plan once), fresh compiles in interleaved
rounds after a warm-up compile; the median first step's time (tracing, planning, the step) and the ratio.

    python bench/studies/budget_compile.py [LAYERS ...]   # writes bench/results/budget-compile-time.{json,md}
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

import fxmem  # noqa: E402,F401  (registers the backend)
from fxmem.models import build  # noqa: E402

CONFIGS = {"level 0": {}, "memory_budget 0.5": {"memory_budget": 0.5}, "peak_budget": {"peak_budget": "1MB"}}


def first_step(layers: int, options: dict) -> float:
    torch._dynamo.reset()
    w = build("hf_llama", batch=2, seq=64, vocab=1024, d=64, layers=layers, heads=2)
    compiled = torch.compile(w.model, backend="fxmem", options={"inner": "eager", "lowering": False, **options})
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unmet peak cap warns
        w.loss(compiled(**w.batch)).backward()
    return time.perf_counter() - t


ROUNDS = 3


def main(layer_counts: list[int]) -> None:
    torch.set_num_threads(1)
    first_step(2, {})  # warm-up: the process's first compile pays for imports and caches
    rows = []
    for layers in layer_counts:
        runs = {name: [] for name in CONFIGS}
        for _ in range(ROUNDS):  # interleaved rounds: the machine's noise hits every config alike
            for name, opts in CONFIGS.items():
                runs[name].append(first_step(layers, opts))
        times = {name: statistics.median(ts) for name, ts in runs.items()}
        print(layers, {k: [round(v, 1) for v in ts] for k, ts in runs.items()}, flush=True)
        rows += [dict(layers=layers, config=k, seconds=v, ratio=v / times["level 0"]) for k, v in times.items()]
    command = "python bench/studies/budget_compile.py " + " ".join(map(str, layer_counts))
    harness.write("budget-compile-time", rows, meta=common.metadata(command))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2, 8, 32])
