"""A compared lowering is decided in one AOTAutograd trace (fxmem.lowering.splice): the partitioner
plans the joint graph with the compared matches fused and with the ops they replaced spliced
back. The spliced candidate must be the graph a compile without those matches traces: the same
ops in the same order, so the same plan and simulated peak. (Logits returned beside a fused loss
are no differentiable output of the lowered graph, in either candidate, fxmem.lowering.returned:
the comparison with a compile without the matches is made on models returning their loss only.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fxmem
import fxmem.inner as inner
import fxmem.remat.partition as partition
from fxmem.lowering.splice import MARK
from fxmem.models import build

OFF = {"bias_gelu": False, "fused_linear_cross_entropy": False, "dropout": False, "swiglu": False}


def _planned(monkeypatch) -> list[tuple[list[str], int]]:
    """(the op sequence, the simulated peak) of every joint graph the partitioner plans."""
    seen, planned = [], partition._planned

    def recording(gm, num_fwd_outputs, settings):
        result = planned(gm, num_fwd_outputs, settings)
        ops = [f"{n.target}" for n in gm.graph.nodes if n.op == "call_function"]
        seen.append((ops, partition.candidate_peak(result)))
        return result

    monkeypatch.setattr(partition, "_planned", recording)
    return seen


class _LossOnly(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, **batch):
        return self.m(**batch).loss


def _step(name: str, options: dict, autocast: bool, loss_only: bool = False, **sizes):
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = build(name, **{"batch": 2, "seq": 16, "vocab": 128, "d": 32, "layers": 2, "heads": 2, **sizes})
    model, loss = (_LossOnly(w.model), lambda out: out) if loss_only else (w.model, w.loss)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
        loss(compiled(**w.batch)).backward()
    return w, compiled


CASES = {
    # SwiGLU named: compared (and declined: the fused plan peaks higher at these sizes)
    "llama-swiglu": ("hf_llama", {"level": 1, "lowering": {"swiglu": True}}, False, {}),
    # bf16 autocast, every pattern: the fused loss with HF's label shift between its ops,
    # bias-GELU on GPT-2's written-out tanh GELU, their casts
    "gpt2-bf16-all": ("hf_gpt2", {"level": 1, "lowering": True}, True, {"loss_only": True}),
    # the fused loss compared at a logits-to-gradients ratio of 1.6, and applied: its plan peaks lower
    "llama-loss": ("hf_llama", {"level": 0}, False, {"vocab": 256, "seq": 32, "loss_only": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_unlowered_candidate_is_what_a_compile_without_the_matches_traces(monkeypatch, case):
    name, options, autocast, sizes = CASES[case]
    seen = _planned(monkeypatch)
    _step(name, options, autocast, **sizes)
    assert len(seen) == 2, "one joint graph, planned with and without the compared matches"
    (fused_ops, _), (unfused_ops, unfused_peak) = seen
    assert any(op.startswith("fxmem.") and "norm" not in op for op in fused_ops)
    seen.clear()
    lowering = options["lowering"] if isinstance(options.get("lowering"), dict) else {}
    # the loss a case does not compare stays on: declined as futile there too, its returned logits
    # leave both graphs without a gradient (fxmem.lowering.returned.alias)
    off = {k: v for k, v in OFF.items() if not (k == "fused_linear_cross_entropy" and case == "llama-swiglu")}
    _step(name, {**options, "lowering": {**lowering, **off}}, autocast, **sizes)
    [(direct_ops, direct_peak)] = seen
    assert unfused_ops == direct_ops
    assert unfused_peak == direct_peak


def test_a_compared_pattern_is_traced_once_and_keeps_the_gradients(monkeypatch):
    """One AOTAutograd trace (one ``compile_joint``) for both candidates; the compile's gradients
    equal eager's, and the graphs that run hold no marks."""
    calls, compile_joint, ran, eager = [], inner.compile_joint, [], inner.eager

    def counted(*args, **kwargs):
        calls.append(args)
        return compile_joint(*args, **kwargs)

    def running(gm, example_inputs):
        ran.append(gm)
        return eager(gm, example_inputs)

    monkeypatch.setattr(inner, "compile_joint", counted)
    monkeypatch.setattr(inner, "eager", running)
    w, compiled = _step("hf_llama", {"level": 1, "lowering": {"swiglu": True}}, False, vocab=256, seq=32)
    assert len(calls) == 1
    grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
    w.model.zero_grad()
    w.loss(w.model(**w.batch)).backward()
    for n, p in w.model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    report = fxmem.report(compiled)
    notes = [n for n in report.graphs[0].lowering_notes if n.startswith("left alone: swiglu")]
    assert len(notes) == 2 and all("not applied: the plan with it peaks at" in n for n in notes), notes
    assert len(ran) == 2 and not any(n.target is MARK for g in ran for n in g.graph.nodes)


def test_a_graph_nobody_differentiates_is_lowered_without_marks():
    """No joint graph, no partitioner: the compared matches are applied as they are, unmarked."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = build("hf_llama", batch=2, seq=16, vocab=128, d=32, layers=2, heads=2)
    import fxmem.lowering.decide as decide
    from fxmem.options import resolve

    opts = resolve({"inner": "eager", "lowering": {"swiglu": True}})
    with torch.no_grad():
        captured = []
        torch.compile(w.model, backend=lambda gm, ins: captured.append((gm, ins)) or gm.forward)(**w.batch)
        gm, ins = captured[0]
        decision = decide.decide(gm, ins, opts)
        expected = w.model(**w.batch).logits
        got = torch.compile(w.model, backend="fxmem", options={"inner": "eager", "lowering": {"swiglu": True}})(
            **w.batch).logits
    assert decision.compared is None
    assert not any(n.target is MARK for n in decision.gm.graph.nodes)
    assert sum(x.pattern == "swiglu" for x in decision.lowering.lowered) == 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
