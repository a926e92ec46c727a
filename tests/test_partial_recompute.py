"""The backward's order on a graph that is one part of a step (issue #56): a block's RMSNorm and
SiLU-gated MLP, compiled alone and backpropagated with a gradient (no loss: ``PlanContext.partial``).

In graph order the backward's first op is ``tangent @ down_weight`` (one ``[tokens, 2d]``
buffer), which reads only the backward's inputs and stays alive while the forward is rebuilt
for the down projection's weight gradient: the norm and both projections where the plan
recomputes them. Run just before its first reader (``split.deferred``), that buffer is not
alive then. The step simulator picks, per saved set, the order that peaks lower
(``StepPeak.defers``), and the split builds that order: the measured peaks fall with it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
import fxmem.remat.budget as budget
from fxmem.graph.liveness import step_peak, storage_roots
from fxmem.graph.reuse import reuse_dead_buffers
from fxmem.profiling import step_perf
from fxmem.remat.settings import PlanSettings
from fxmem.remat.split import split
from fxmem.remat.steppeak import StepPeak

TOKENS, D = 256, 32


class GatedMLP(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _step(model, x, gy, options=None):
    """(output, gradients of x and the parameters, the second step's measured peak, the report's
    last graph); ``options=None``: eager."""
    model = copy.deepcopy(model)
    torch._dynamo.reset()  # each compile plans anew (Dynamo would reuse the last one's code)
    fn = model if options is None else torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    for _ in range(2):  # the second step is measured: no compile, same allocations
        # The last step's tensors die here, not inside the measured step: its input was made outside
        # the profiler and freeing it under the profiler can count a stale size (fxmem.profiling).
        model.zero_grad(set_to_none=True)
        y = None
        xi = x.detach().clone().requires_grad_()
        with step_perf("cpu") as perf:
            y = fn(xi)
            y.backward(gy)
    grads = {"x": xi.grad, **{n: p.grad for n, p in model.named_parameters()}}
    graph = fxmem.report(fn).graphs[-1] if options is not None else None
    return y.detach(), grads, perf.result.peak_bytes, graph


def _inputs():
    torch.manual_seed(0)
    model = GatedMLP()
    return model, torch.randn(TOKENS, D), torch.randn(TOKENS, D)


def _in_graph_order(monkeypatch):
    """The backward in graph order as it was before ``split.deferred``: no deferred ops, and no
    second copies (``split.run_twice``) that the simulator might pick for the plan instead."""
    monkeypatch.setattr(StepPeak, "defers", lambda self, saved, offloaded=frozenset(): False)
    monkeypatch.setattr(StepPeak, "_twice", lambda self, body, late: None)


def _keeps_nothing(monkeypatch):
    """Level 1 under ``memory_budget=0.0`` choosing among the plans that keep nothing (it keeps
    level 0's: no other is as low in the backward's peak, ``budget.in_a_step``)."""
    monkeypatch.setattr(budget, "in_a_step", lambda ctx, scored: [c for c in scored if c.nbytes == 0] or scored)


def _check_grads(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_level0s_backward_defers_the_tangents_matmul(monkeypatch):
    model, x, gy = _inputs()
    y_e, g_e, _, _ = _step(model, x, gy)
    y, g, peak, graph = _step(model, x, gy, {"level": 1})
    assert torch.equal(y, y_e)
    _check_grads(g, g_e)
    with monkeypatch.context() as m:
        _in_graph_order(m)
        _, g_before, peak_before, graph_before = _step(model, x, gy, {"level": 1})
    _check_grads(g_before, g_e)
    assert graph.saved_bytes == graph_before.saved_bytes > 0  # the same plan: level 0's
    assert peak < peak_before, (peak, peak_before)  # 345,472 bytes, was 368,640


def test_the_plan_that_keeps_nothing_peaks_about_as_level0_did(monkeypatch):
    """Recomputing the norm and both projections: the backward's peak falls by about one
    ``[tokens, 2d]`` buffer with the deferred matmul, to within a scalar per token of what level
    0 peaked in graph order (its norm's statistics and a bias gradient)."""
    model, x, gy = _inputs()
    _, g_e, _, _ = _step(model, x, gy)
    _keeps_nothing(monkeypatch)
    _, g, peak, graph = _step(model, x, gy, {"level": 1, "memory_budget": 0.0})
    assert graph.saved_bytes == 0
    _check_grads(g, g_e)
    with monkeypatch.context() as m:
        _in_graph_order(m)
        _, g_before, peak_before, _ = _step(model, x, gy, {"level": 1, "memory_budget": 0.0})
        _, _, peak0_before, _ = _step(model, x, gy, {"level": 0})
    _check_grads(g_before, g_e)
    assert peak < peak_before - TOKENS * 2 * D * 4 * 9 // 10, (peak, peak_before)  # 369,792 bytes, was 435,200
    assert peak <= peak0_before + TOKENS * 4 * 2, (peak, peak0_before)


def test_the_simulator_peaks_as_the_split_it_chose_runs():
    """``StepPeak`` of a saved set is the peak of the split's graphs built in the order it chose
    (``defers``): here the deferred one, for level 0's plan and for the plan keeping nothing."""
    model, x, gy = _inputs()
    torch._dynamo.reset()
    fn = torch.compile(copy.deepcopy(model), backend="fxmem", options={"inner": "eager", "level": 1})
    fn(x.clone().requires_grad_()).backward(gy)
    (graph,) = [g for c in fxmem.compilations(fn) for g in c.graphs]
    joint = graph.plan.problem.joint
    fast = StepPeak(joint, graph.sizes, PlanSettings.of(fxmem.compilations(fn)[0].options).target)
    roots = storage_roots(joint.gm)  # keeping nothing: level 0's inputs and their views (weights' transposes)
    nothing = [n for n in graph.plan.saved if roots[n].op == "placeholder"]
    assert len(nothing) < len(graph.plan.saved)
    for saved in (list(graph.plan.saved), nothing):
        assert fast.defers(saved), [n.name for n in saved if n.op != "placeholder"]
        s = split(joint, saved, defer=True)
        reuse_dead_buffers(s.fw)
        reuse_dead_buffers(s.bw)
        assert fast(saved) == step_peak(s.fw, s.bw, graph.sizes, joint.input_names())
        plain = split(joint, saved)
        reuse_dead_buffers(plain.fw)
        reuse_dead_buffers(plain.bw)
        assert fast(saved) < step_peak(plain.fw, plain.bw, graph.sizes, joint.input_names())
