"""The memory budget on every zoo model (issue [budget]): fractions 0.9 .. 0.0 and ``peak_budget``
at 0.6x level 0's measured peak. Per model: gradients against eager, the measured peak of each
fraction (the third step: HF's classification heads set ``config.problem_type`` on the first call,
so the second compiles again), whether it ever rises as the fraction falls, fraction 0
against level 1, and the peak cap met (+3%) or warned about.

    python bench/studies/budget_zoo.py [MODEL ...]   # writes bench/results/budget-zoo.{json,md}
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

import fxmem  # noqa: E402,F401  (registers the backend)
from fxmem.testing.zoo import FAMILY, ZOO, zoo_build  # noqa: E402

FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1, 0.0)
BASE = {"inner": "eager", "lowering": False}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(w, options):
    """(measured peak of the third step, gradients, budget warnings) of a fresh compile."""
    _, model, peak, caught = common.zoo_steps(w, {**BASE, **options})
    return peak, _grads(model), [m for m in caught if "budget" in m or "falling back" in m]


def close(a, b):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def model_row(name):
    w = zoo_build(name)
    ref = copy.deepcopy(w.model)
    torch.manual_seed(1)
    w.loss(ref(**w.batch)).backward()
    ref = _grads(ref)
    t = time.perf_counter()
    level0, g0, _ = run(w, {})
    level1, g1, _ = run(w, {"level": 1})
    peaks, ok, warned = [], close(g0, ref) and close(g1, ref), []
    for f in FRACTIONS:
        peak, g, msgs = run(w, {"memory_budget": f})
        peaks.append(peak)
        ok &= close(g, ref)
        warned += [f] if msgs else []
    cap = int(0.6 * level0)
    pb, g, msgs = run(w, {"peak_budget": cap})
    ok &= close(g, ref)
    rises = [f"{a}->{b}" for (a, p), (b, q) in zip(zip(FRACTIONS, peaks), zip(FRACTIONS[1:], peaks[1:])) if q > p]
    row = dict(model=name, family=FAMILY[name], level0=level0, level1=level1, peaks=peaks, grads_ok=ok,
               monotone=not rises, rises=rises, zero_le_level1=peaks[-1] <= level1, warned=warned, peak_cap=cap,
               peak_budget=pb, cap_met=pb <= cap * 1.03, cap_warned=bool(msgs), seconds=time.perf_counter() - t)
    print(name, {k: v for k, v in row.items() if k not in ("peaks",)}, flush=True)
    return row


def main(names):
    torch.set_num_threads(1)
    rows = [model_row(n) for n in names]
    harness.write("budget-zoo", rows, meta=common.metadata("python bench/studies/budget_zoo.py " + " ".join(names)))


if __name__ == "__main__":
    main(sys.argv[1:] or list(ZOO))
