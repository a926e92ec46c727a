"""StepPeak (the budget's fast simulation) gives exactly the peak of the graphs the split builds, as
the eager inner compiler runs them: on several architectures, with dropout (replayed random ops),
with the fused loss (its workspace), at many saved sets each (frontier cuts and random supersets)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import fxmem
from fxmem.graph.liveness import step_peak
from fxmem.graph.reuse import reuse_dead_buffers
from fxmem.models import build
from fxmem.remat.allowlist import HEAVY, kind
from fxmem.remat.mincut import CutProblem, frontier
from fxmem.remat.settings import PlanSettings
from fxmem.remat.split import InvalidSavedSet, split
from fxmem.remat.steppeak import StepPeak
from fxmem.testing.zoo import zoo_build


def _reference(joint, saved, sizes, options, defer: bool = False, twice: bool = False) -> int:
    s = split(joint, saved, defer=defer, twice=twice)
    if options.inner == "eager":
        reuse_dead_buffers(s.fw)
        reuse_dead_buffers(s.bw)
    return step_peak(s.fw, s.bw, sizes, joint.input_names())


def _graphs(w, **options):
    torch._dynamo.reset()
    fn = torch.compile(w.model, backend="fxmem", options={"inner": "eager", **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.loss(fn(**w.batch)).backward()
    return [(g, c.options) for c in fxmem.compilations(fn) for g in c.graphs]


def _saved_sets(p: CutProblem, rng: random.Random) -> list[list]:
    """Frontier cuts with heavy ops recomputable, and random supersets of them (always valid)."""
    joint = p.joint
    heavy = {n for n in joint.forward if kind(n) == HEAVY}
    broad = CutProblem(joint, p.nbytes, p.cost, frozenset(p.recomputable | heavy), p.no_save)
    cuts = [c for c, _ in frontier(broad, 1e-9, 1e4)]
    extra = [n for n in joint.forward if n.op == "call_function" and n in p.nbytes and not isinstance(
        n.meta.get("val"), (tuple, list))]
    sets = list(cuts)
    for c in cuts:
        for _ in range(3):
            sets.append(sorted(set(c) | set(rng.sample(extra, min(len(extra), rng.randint(1, 12)))),
                               key=list(joint.gm.graph.nodes).index))
    return sets


CASES = {
    "hf_gpt2 dropout": (lambda: build("hf_gpt2", batch=2, seq=32, vocab=256, d=32, layers=2, heads=2, dropout=0.1),
                        {"lowering": False}),
    "hf_llama lowered": (lambda: build("hf_llama", batch=2, seq=32, vocab=256, d=32, layers=2, heads=2), {}),
    "t5": (lambda: zoo_build("t5"), {"lowering": False}),
    "convnet": (lambda: zoo_build("convnet"), {"lowering": False}),
    "mixtral": (lambda: zoo_build("mixtral"), {"lowering": False}),
    "unet": (lambda: zoo_build("unet"), {"lowering": False}),
}


QUICK = {"hf_gpt2 dropout", "convnet"}  # the others take 8-15 s each: the full suite runs them


@pytest.mark.parametrize("case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_step_peak_equals_the_split_graphs_peak(case):
    make, options = CASES[case]
    rng, checked = random.Random(0), 0
    for graph, opts in _graphs(make(), **options):
        p = graph.plan.problem
        fast = StepPeak(p.joint, graph.sizes, PlanSettings.of(opts).target)
        for saved in [list(graph.plan.saved), *_saved_sets(p, rng)]:
            try:
                want = _reference(p.joint, saved, graph.sizes, opts, fast.defers(saved), fast.twice(saved))
            except InvalidSavedSet:  # would recompute a random op that does not replay
                continue
            assert fast(saved) == want, f"{case}: {len(saved)} saved"
            checked += 1
    assert checked >= 10
