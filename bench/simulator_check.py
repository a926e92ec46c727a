"""The simulator's numbers on the zoo, to compare two versions of fxmem byte for byte.

For every zoo model (tiny profile) at levels 0, 1 and 2, it compiles one step with the eager inner
compiler, then re-plans each of its joint graphs under both memory models (eager buffer reuse,
Inductor) with no budget, ``memory_budget`` 0.3 and 0.0, and a ``peak_budget`` (85% of the
level's predicted peak), and records per plan: the saved bytes, the saved set, ``StepPeak``'s peak
(the planner's simulator), ``step_peak`` of the split graphs, the report's ``predict_peak`` and
a digest of the report's schedules (the report's simulator). Run it on the old and the new code and diff the two files:

    PYTHONPATH=<old checkout> python bench/simulator_check.py old.json
    PYTHONPATH=$PWD python bench/simulator_check.py new.json
    python bench/simulator_check.py --compare old.json new.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from dataclasses import replace

import torch

import fxmem
from fxmem.graph.liveness import step_peak
from fxmem.remat.plan import plan
from fxmem.remat.split import split
from fxmem.remat.steppeak import StepPeak
from fxmem.report.model import build as build_report
from fxmem.testing.zoo import ZOO, zoo_build

try:  # where the eager inner compiler's buffer reuse lives
    from fxmem.graph.reuse import reuse_dead_buffers
except ImportError:
    from fxmem.inner import reuse_dead_buffers


def _graphs(name: str, level: int):
    torch._dynamo.reset()
    w = zoo_build(name)
    fn = torch.compile(w.model, backend="fxmem", options={"inner": "eager", "level": level})
    w.loss(fn(**w.batch)).backward()
    return [(g, c.options) for c in fxmem.compilations(fn) for g in c.graphs]


def _numbers(joint, sizes, primal_names, opts) -> dict:
    p = plan(joint, sizes, opts)
    s = split(joint, p.saved)
    if opts.inner == "eager":
        reuse_dead_buffers(s.fw)
        reuse_dead_buffers(s.bw)
    return {"saved_bytes": p.saved_bytes, "saved": sorted(n.name for n in p.saved),
            "steppeak": StepPeak(joint, sizes, opts)(p.saved),
            "step_peak": step_peak(s.fw, s.bw, sizes, joint.input_names()),
            **_report_numbers(build_report(0, opts.key(), p, s, sizes, primal_names))}


def _report_numbers(rep) -> dict:
    """The report's predicted peak and a digest of its schedules (every event, bytes as text)."""
    text = json.dumps([rep.forward, rep.backward]).encode()
    return {"predict_peak": rep.predict_peak(), "schedules": hashlib.sha256(text).hexdigest()}


def record() -> dict:
    out = {}
    for name in ZOO:
        for level in (0, 1, 2):
            for i, (g, opts) in enumerate(_graphs(name, level)):
                key = f"{name}/L{level}/g{i}"
                compiled = g.peak()
                out[f"{key}/compiled"] = {"saved_bytes": g.plan.saved_bytes, "graph_peak": compiled,
                                          **_report_numbers(g.report)}
                joint = g.plan.problem.joint
                for inner in ("eager", "inductor"):
                    for budget in ({}, {"memory_budget": 0.3}, {"memory_budget": 0.0},
                                   {"peak_budget": int(0.85 * compiled)}):
                        o = replace(opts, **{"inner": inner, "memory_budget": None, "peak_budget": None, **budget})
                        tag = ",".join(f"{k}={v}" for k, v in budget.items()) or "none"
                        out[f"{key}/{inner}/{tag}"] = _numbers(joint, g.sizes, g.primal_names, o)
            print(name, level, flush=True)
    return out


def compare(old: dict, new: dict) -> int:
    """How many numbers differ (printed); every key must be in both."""
    bad, count = 0, 0
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            print("missing:", key, "old" if a is None else "new")
            bad += 1
            continue
        for field in sorted(set(a) | set(b)):
            count += 1
            if a.get(field) != b.get(field):
                print("differs:", key, field, a.get(field), b.get(field))
                bad += 1
    print(f"{count} values compared over {len(old)} plans, {bad} differ")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        with open(sys.argv[2]) as f, open(sys.argv[3]) as g:
            sys.exit(1 if compare(json.load(f), json.load(g)) else 0)
    warnings.simplefilter("ignore")
    with open(sys.argv[1], "w") as f:
        json.dump(record(), f, indent=1, sort_keys=True)
