"""Pattern lowering (fxmem.lowering): real models' patterns become fxmem_kernels ops in the joint
graph and in vmap(grad) flat graphs; losses and gradients equal eager / the unlowered graph; the
report lists each lowering with the bytes it saves; options turn patterns off; partial matches
are left alone."""
import copy
import gc
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import fxmem
from fxmem import inner
from fxmem.lowering import PATTERNS
from fxmem.models import build
from fxmem.options import LOWERING_PATTERNS, OptionError
from fxmem.profiling import step_perf
from fxmem.testing import assert_same_training_step

HF = dict(batch=2, seq=16, vocab=96, d=32, layers=2, heads=2)
ON = {"inner": "eager", "lowering": True}
COUNTS = {
    "hf_gpt2": {"fused_linear_cross_entropy": 1, "bias_gelu": 2, "layer_norm": 5},
    "hf_llama": {"fused_linear_cross_entropy": 1, "swiglu": 2, "rms_norm": 5},
}
FUSED = {  # forward ops in the forward graph, backward ops in the backward graph
    "hf_gpt2": ({"linear_cross_entropy", "bias_gelu", "layer_norm"}, {"bias_gelu_backward", "layer_norm_backward"}),
    "hf_llama": ({"linear_cross_entropy", "glu", "rms_norm"}, {"glu_backward", "rms_norm_backward"}),
}


@pytest.fixture(autouse=True)
def _lowering_always_applies(monkeypatch):
    """This module tests what lowering does once applied, on models so small that the fused
    kernels' fixed costs can make a plan peak higher: skip the backend's peak comparison and its
    futile-match rule (the no-worse rules have their own tests in tests/test_defaults.py and
    tests/test_lowering_proven.py)."""
    from fxmem.lowering import patterns
    from fxmem.remat import partition

    monkeypatch.setattr(partition, "choose", lambda fused, without, cap=None: (fused, None))
    monkeypatch.setattr(patterns, "CE_FUTILE_BELOW", 0.0)
    monkeypatch.setattr(patterns, "GLU_FUTILE", "")


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _fused_ops(gm) -> set[str]:
    return {str(n.target).split(".")[1] for n in gm.graph.nodes if str(n.target).startswith("fxmem.")}


def _logit_tangents(bw, vocab: int) -> list:
    """The backward's tangent inputs shaped like logits (last dim ``vocab``): the zero gradient
    AOTAutograd would give returned logits the caller does not differentiate."""
    return [n for n in bw.graph.find_nodes(op="placeholder")
            if "tangents" in n.name and isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim()
            and v.shape[-1] == vocab]


def _counts(graph_report) -> dict[str, int]:
    return {r.pattern: r.count for r in graph_report.lowerings}


def _step(model, batch, loss=lambda out: out.loss):
    out = model(**batch)
    value = loss(out)
    value.backward()
    return out, value


class LossOnly(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, **batch):
        return self.m(**batch).loss


def test_table_and_options_agree():
    assert sorted(p.name for p in PATTERNS) == sorted(LOWERING_PATTERNS)
    assert all(p.matches and p.replacement for p in PATTERNS)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hf_training_step_lowers_every_pattern_and_equals_eager(name):
    w = build(name, **HF)
    ref_model, model = w.model, copy.deepcopy(w.model)
    ref_out, ref = _step(ref_model, w.batch)
    compiled = torch.compile(model, backend="fxmem", options=ON)
    out, loss = _step(compiled, w.batch)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for (k, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-4, k
    torch.testing.assert_close(out.logits, ref_out.logits)  # still returned, still the same
    g = fxmem.report(compiled).graphs[-1]
    assert _counts(g) == COUNTS[name]
    lce = next(r for r in g.lowerings if r.pattern == "fused_linear_cross_entropy")
    assert any("graph output" in n for n in lce.notes)  # the logits are kept for the output
    split = fxmem.compilations(compiled)[-1].graphs[-1].split
    fw_ops, bw_ops = FUSED[name]
    assert fw_ops <= _fused_ops(split.fw) and bw_ops <= _fused_ops(split.bw)
    assert not _logit_tangents(split.bw, HF["vocab"])  # the returned logits get their gradient outside
    assert not any("log_softmax" in str(n.target) for n in [*split.fw.graph.nodes, *split.bw.graph.nodes])
    text = str(fxmem.report(compiled))
    assert "lowered pattern" in text and "fused_linear_cross_entropy" in text


class _Head(torch.nn.Module):
    """Returns its logits beside the loss, as an HF causal LM does."""

    def __init__(self, bias):
        super().__init__()
        self.norm, self.head = torch.nn.LayerNorm(16), torch.nn.Linear(16, 40, bias=bias)

    def forward(self, x, labels):
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, 40), labels.view(-1)), logits


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_logits", [False, True])
def test_returned_logits_get_their_gradient_whether_used_or_not(bias, use_logits):
    """The returned logits are no differentiable output of the compiled graph (its backward gets
    no [tokens, vocab] zero gradient for them), and a loss that also reads them gets the same
    gradients as eager (their linear's backward runs outside the graph)."""
    torch.manual_seed(0)
    ref_model = _Head(bias)
    model = copy.deepcopy(ref_model)
    x, labels = torch.randn(3, 5, 16), torch.randint(0, 40, (3, 5))

    def step(m):
        loss, logits = m(x, labels)
        (loss + logits.square().mean() if use_logits else loss).backward()
        return loss, logits

    ref = step(ref_model)
    compiled = torch.compile(model, backend="fxmem", options=ON)
    out = step(compiled)
    torch.testing.assert_close(out, ref)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert not _logit_tangents(fxmem.compilations(compiled)[-1].graphs[-1].split.bw, 40)
    assert out[1].requires_grad


class _BiasedHead(torch.nn.Module):
    """BART's head: ``lm_head(h) + final_logits_bias`` ([1, vocab]), here a parameter."""

    def __init__(self, bias, returned):
        super().__init__()
        self.head, self.returned = torch.nn.Linear(16, 40, bias=bias), returned
        self.logit_bias = torch.nn.Parameter(torch.randn(1, 40))

    def forward(self, x, labels):
        logits = self.head(x) + self.logit_bias
        loss = F.cross_entropy(logits.view(-1, 40), labels.view(-1))
        return (loss, logits) if self.returned else loss


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("returned", [False, True])
def test_a_bias_added_to_the_logits_is_fused_into_the_loss(bias, returned):
    torch.manual_seed(0)
    ref_model = _BiasedHead(bias, returned)
    model = copy.deepcopy(ref_model)
    x, labels = torch.randn(3, 5, 16), torch.randint(0, 40, (3, 5))

    def step(m):
        out = m(x, labels)
        (out[0] if returned else out).backward()
        return out

    ref = step(ref_model)
    compiled = torch.compile(model, backend="fxmem", options=ON)
    torch.testing.assert_close(step(compiled), ref)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert _counts(fxmem.report(compiled).graphs[-1]) == {"fused_linear_cross_entropy": 1}
    fw = fxmem.compilations(compiled)[-1].graphs[-1].split.fw
    assert not any("log_softmax" in str(n.target) for n in fw.graph.nodes)


# T5's norm is w * (x * rsqrt(...)); its SDPA with dropout is lowered where its position bias needs no gradient.
ZOO_COUNTS = {"t5": {"fused_linear_cross_entropy": 1, "rms_norm": 12, "attention_dropout": 2},
              "bart": {"fused_linear_cross_entropy": 1, "bias_gelu": 4, "layer_norm": 12}}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO_COUNTS))
def test_t5_norms_and_bart_biased_logits_are_lowered_and_equal_eager(name):
    from fxmem.testing.zoo import zoo_build

    w = zoo_build(name)
    if name == "bart":  # zeros as shipped: make the bias visible in the loss and logits
        w.model.final_logits_bias.normal_()
    ref_model, model = w.model, copy.deepcopy(w.model)

    def step(m):
        torch.manual_seed(1)  # the same dropout masks in both
        return _step(m, w.batch)

    ref_out, ref = step(ref_model)
    out, loss = step(torch.compile(model, backend="fxmem", options={"inner": "eager"}))  # dropout not seeded
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    for (k, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=k)
    assert _counts(fxmem.report().graphs[-1]) == ZOO_COUNTS[name]


@pytest.mark.slow
def test_loss_only_never_materializes_logits_and_lowers_the_peak(monkeypatch):
    """The model compiled to return its loss only: no [tokens, vocab] tensor exists in either
    graph, the measured step peak falls by more than the logits' size, and the report predicts
    it (within 1%)."""
    from fxmem.lowering import functions

    monkeypatch.setattr(functions, "workspace_bytes", lambda vocab: 16 * 4 * vocab)  # 16-row chunks
    kw = dict(batch=2, seq=32, vocab=4096, d=32, layers=1, heads=2)
    w = build("hf_llama", **kw)
    tokens, vocab = kw["batch"] * kw["seq"], kw["vocab"]
    peaks, losses = {}, {}
    # Lowered first: blocks an earlier profiled step allocated can show up as frees in a later
    # one (the CPU profiler's events), which here under-reported the lowered step by 250 KB.
    for lowering in (True, False):
        torch._dynamo.reset()
        model = copy.deepcopy(w.model)
        compiled = torch.compile(LossOnly(model), backend="fxmem", options={"inner": "eager", "lowering": lowering})
        compiled(**w.batch).backward()  # compile + warm-up
        model.zero_grad(set_to_none=True)
        gc.collect()  # nothing from the warm-up step may be freed during the measured one
        with step_perf("cpu") as perf:
            loss = compiled(**w.batch)
            loss.backward()
        peaks[lowering], losses[lowering] = perf.result.peak_bytes, loss.item()
        # the report's prediction counts the fused cross-entropy's chunk of logits (its scratch)
        last = fxmem.compilations(compiled)[-1].graphs[-1]
        predicted = last.report.predict_peak()
        assert abs(predicted - peaks[lowering]) <= 0.01 * peaks[lowering], (lowering, predicted, peaks[lowering])
        split = last.split
        logits_sized = [n.name for n in [*split.fw.graph.nodes, *split.bw.graph.nodes]
                        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() == tokens * vocab]
        assert bool(logits_sized) != lowering, logits_sized
    assert abs(losses[True] - losses[False]) <= 1e-5 * abs(losses[False])
    # unlowered: logits, then log-probabilities and their gradient live at once (4 B x tokens x
    # vocab each); lowered: one 16-row chunk of logits at a time, and the backward scales the
    # weight gradient the forward computed out of place (4 B x vocab x d: a saved tensor may not
    # be overwritten, a retained graph would read it again)
    assert peaks[True] <= peaks[False] - 4 * tokens * vocab + 4 * vocab * kw["d"], peaks


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_per_example_gradients_get_fused_cross_entropy_and_norms(name, monkeypatch):
    """vmap(grad(...)) over per-example HF losses (batch 8): the flat graph holds the fused
    cross-entropy (forward op once, backward op per example) and the fused norms; per-example
    gradients equal the unlowered graph's."""
    w = build(name, batch=8, seq=8, vocab=64, d=16, layers=1, heads=2)
    params = {k: v.detach() for k, v in w.model.named_parameters()}
    ids, labels = w.batch["input_ids"], w.batch["labels"]

    def loss(p, i, t):
        return functional_call(w.model, p, (), {"input_ids": i[None], "labels": t[None]}).loss

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    graphs, real = [], inner.eager
    monkeypatch.setattr(inner, "eager", lambda gm, ins: (graphs.append(gm), real(gm, ins))[1])
    # ghost_clipping off: the region compiles as a whole graph (with ghost clipping on, vmap
    # regions go through the backend's chunk compiler, which lowers them too)
    opts = {"inner": "eager", "ghost_clipping": False}
    ref = torch.compile(per_example, backend="fxmem", options={**opts, "lowering": False})(params, ids, labels)
    assert not _fused_ops(graphs[-1])
    torch._dynamo.reset()
    fn = torch.compile(per_example, backend="fxmem", options={**opts, "lowering": True})
    out = fn(params, ids, labels)
    for k in ref:
        assert out[k].shape == (8, *params[k].shape)
        assert _rel(out[k], ref[k]) <= 1e-4, k
    ops = _fused_ops(graphs[-1])
    norm = "layer_norm" if name == "hf_gpt2" else "rms_norm"
    assert {"linear_cross_entropy", "linear_cross_entropy_backward", norm, f"{norm}_backward"} <= ops
    n_bwd = sum(str(n.target).startswith("fxmem.linear_cross_entropy_backward") for n in graphs[-1].graph.nodes)
    assert n_bwd == 8  # one per example: per-example weight gradients
    rows = fxmem.report(fn).unplanned_lowerings[-1]["rows"]  # no outer backward: nothing planned
    counts = {r["pattern"]: r["count"] for r in rows}
    assert counts["fused_linear_cross_entropy"] == 1 and counts[norm] == 3
    assert all(any("vmap" in n for n in r["notes"]) for r in rows)


class Mixed(nn.Module):
    """Patterns in other spellings: RMSNorm without casts, GeGLU (tanh), GELU written out with
    erf after a bias add, sliced logits, cross-entropy with ignore_index/label smoothing/reduction."""

    def __init__(self, d=16, vocab=40, reduction="mean", smoothing=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down, self.b = nn.Linear(2 * d, d, bias=False), nn.Parameter(0.1 * torch.randn(d))
        self.w, self.head = nn.Parameter(1 + 0.1 * torch.randn(d)), nn.Linear(d, vocab)
        self.reduction, self.smoothing = reduction, smoothing

    def forward(self, ids, labels):
        x = self.emb(ids)
        x = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-5) * self.w
        y = F.gelu(self.gate(x), approximate="tanh") * self.up(x)
        z = self.down(y) + self.b
        z = z * 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
        logits = self.head(z)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=3, reduction=self.reduction, label_smoothing=self.smoothing)


@pytest.mark.parametrize("reduction, smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.0)])
def test_other_spellings_lowered_and_equal_eager(reduction, smoothing):
    torch.manual_seed(0)
    model, ids = Mixed(reduction=reduction, smoothing=smoothing), torch.randint(0, 40, (3, 9))
    ref_model = copy.deepcopy(model)
    ref = ref_model(ids, ids)
    ref.sum().backward()
    compiled = torch.compile(model, backend="fxmem", options=ON)
    out = compiled(ids, ids)
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-4
    assert _counts(fxmem.report(compiled).graphs[-1]) == {
        "fused_linear_cross_entropy": 1, "geglu": 1, "bias_gelu": 1, "rms_norm": 1}


def test_saved_bytes_in_the_report_are_exact_and_the_plan_matches_autograd():
    """bytes saved per pattern = what autograd keeps for the unfused pattern minus the fused one:
    RMSNorm keeps its normalized output (tokens x hidden fp32) unfused, SwiGLU silu(gate)
    (tokens x intermediate); the fused cross-entropy drops the log-probabilities (tokens x
    vocab) and keeps the per-row log-sum-exp and the gradients of hidden and weight."""
    w = build("hf_llama", **HF)
    check = assert_same_training_step(LossOnly(w.model), w.batch, ON)
    assert check.held_bytes == check.planned_saved_bytes[0]  # the planner knows the fused ops' bytes
    g = fxmem.report().graphs[-1]
    rows = {r.pattern: r for r in g.lowerings}
    n, d, v = HF["batch"] * HF["seq"], HF["d"], HF["vocab"]
    assert rows["rms_norm"].bytes_saved == 5 * n * d * 4
    assert rows["swiglu"].bytes_saved == 2 * n * 4 * d * 4
    lce = rows["fused_linear_cross_entropy"].bytes_saved
    assert abs(lce - (n * v * 4 - n * 4 - n * d * 4 - v * d * 4)) <= 8, lce  # (+ nll's 4-byte total weight)
    back = fxmem.MemoryReport.from_json(fxmem.report().to_json())
    assert back.graphs[-1].lowerings == g.lowerings


@pytest.mark.slow
def test_options_turn_patterns_off():
    w = build("hf_llama", **HF)
    ref = w.loss(copy.deepcopy(w.model)(**w.batch)).item()
    cases = [({}, {"fused_linear_cross_entropy": 1, "rms_norm": 5, "swiglu": 2}), ({"lowering": False}, {}),
             ({"lowering": {"rms_norm": False}}, {"fused_linear_cross_entropy": 1, "swiglu": 2}),
             ({"lowering": {"fused_linear_cross_entropy": False, "swiglu": False}}, {"rms_norm": 5})]
    for extra, expect in cases:
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(w.model), backend="fxmem", options={"inner": "eager", **extra})
        _, loss = _step(compiled, w.batch)
        assert abs(loss.item() - ref) <= 1e-5 * abs(ref)
        assert _counts(fxmem.compilations(compiled)[0].graphs[-1].report) == expect, extra
    torch._dynamo.reset()
    with pytest.raises(OptionError, match="lowering.fused_ce"):
        torch.compile(w.model, backend="fxmem", options={"lowering": {"fused_ce": True}})(**w.batch)


class Partial(nn.Module):
    """Each pattern present but not whole: the logits feed a second loss term, a GELU output is
    used twice, an RMSNorm's rsqrt is returned, cross-entropy has class weights, logits are
    sliced after a reshape."""

    def __init__(self, d=16, vocab=24):
        super().__init__()
        self.emb, self.fc, self.up = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, d)
        self.head, self.head2 = nn.Linear(d, vocab, bias=False), nn.Linear(d, vocab, bias=False)
        self.head3 = nn.Linear(d, vocab)
        self.register_buffer("cw", torch.linspace(0.5, 1.5, vocab))

    def forward(self, ids, labels):
        x = self.emb(ids)
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = x * r
        a = F.gelu(self.fc(x), approximate="tanh")
        x = a * self.up(x) + a
        logits = self.head(x).view(-1, self.head.out_features)
        loss = F.cross_entropy(logits, labels.view(-1)) + 1e-2 * logits.logsumexp(-1).pow(2).mean()
        loss = loss + F.cross_entropy(self.head2(x).view(-1, self.head.out_features), labels.view(-1), weight=self.cw)
        loss = loss + F.cross_entropy(self.head3(x).view(-1, self.head.out_features)[:-3], labels.view(-1)[:-3])
        return loss + r.mean()


def test_partial_matches_are_left_alone_with_reasons():
    torch.manual_seed(0)
    model, ids = Partial(), torch.randint(0, 24, (2, 8))
    ref_model = copy.deepcopy(model)
    ref = ref_model(ids, ids)
    ref.backward()
    compiled = torch.compile(model, backend="fxmem", options=ON)
    out = compiled(ids, ids)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-4
    g = fxmem.report(compiled).graphs[-1]
    assert _counts(g) == {"bias_gelu": 1}  # gelu(fc(x)) is whole; its output may be used twice
    notes = "\n".join(g.lowering_notes)
    assert "fused_linear_cross_entropy" in notes and "class weights" in notes and "used by other ops" in notes
    assert "sliced after a reshape" in notes
    assert "rms_norm" in notes and "geglu" in notes


def test_dropout_becomes_seeded_with_one_mask_for_forward_and_backward():
    """Seeded dropout draws its own mask (not eager's), so check its law: y = x * m / (1 - p)
    with the same m in backward, a fraction p of zeros; the rest of the model equals eager."""
    p = 0.4

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, c):
            y = F.dropout(self.lin(x), p, training=True)
            return y, (y * c).sum()

    torch.manual_seed(0)
    model, x, c = Drop(), torch.randn(32, 64, requires_grad=True), torch.randn(32, 64)
    compiled = torch.compile(model, backend="fxmem", options=ON)
    y, loss = compiled(x, c)
    loss.backward()
    h = model.lin(x).detach()
    mask = y.detach() != 0
    assert abs(mask.float().mean().item() - (1 - p)) < 0.05
    torch.testing.assert_close(y.detach(), torch.where(mask, h / (1 - p), 0.0))
    dh = torch.where(mask, c / (1 - p), 0.0)  # d loss / d lin(x), through the same mask
    torch.testing.assert_close(model.lin.bias.grad, dh.sum(0))
    torch.testing.assert_close(x.grad, dh @ model.lin.weight.detach())
    assert _counts(fxmem.report(compiled).graphs[-1]) == {"dropout": 1}


@pytest.mark.slow
def test_dynamic_shapes_one_compile_two_shapes():
    """tiny_gpt (sliced logits, F.gelu after a biased linear, LayerNorm) compiled with dynamic
    shapes: one compile serves two batch shapes, each equal to eager."""
    torch._dynamo.reset()
    kw = dict(layers=2, d=32, heads=2, vocab=64)
    w = build("tiny_gpt", batch=2, seq=16, **kw)
    model = copy.deepcopy(w.model)
    compiled = torch.compile(model, backend="fxmem", options=ON, dynamic=True)
    for batch, seq in ((2, 16), (3, 12)):
        inputs = build("tiny_gpt", batch=batch, seq=seq, **kw).batch
        ref_model = copy.deepcopy(w.model)
        ref = ref_model(**inputs)
        ref.backward()
        model.zero_grad(set_to_none=True)
        loss = compiled(**inputs)
        loss.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-4
    comps = fxmem.compilations(compiled)
    assert len(comps) == 1
    assert _counts(comps[-1].graphs[-1].report) == {"fused_linear_cross_entropy": 1, "bias_gelu": 2, "layer_norm": 5}


def test_inductor_inner_runs_the_fused_ops():
    torch.manual_seed(0)
    model, ids = Mixed(), torch.randint(0, 40, (2, 9))
    ref_model = copy.deepcopy(model)
    ref = ref_model(ids, ids)
    ref.backward()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "inductor", "lowering": True, "strict": True})
    out = compiled(ids, ids)
    out.backward()
    assert abs(out.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-4
    assert _counts(fxmem.compilations(compiled)[-1].graphs[-1].report) == {
        "fused_linear_cross_entropy": 1, "geglu": 1, "bias_gelu": 1, "rms_norm": 1}


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_attention_with_dropout_is_lowered_and_equals_eager(name):
    """HF GPT-2 (a bool causal mask) and BERT (no mask) as shipped, dropout 0.1: SDPA on CPU takes
    the math path. Lowered, the step draws eager's dropout masks and gives eager's loss and gradients
    (the other fused ops round within rtol 1e-5)."""
    w = build(name, **dict(HF, vocab=1100, dropout=0.1))
    assert_same_training_step(w.model, w.batch, {"inner": "eager", "level": 1})
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(w.model), backend="fxmem", options={"inner": "eager", "level": 1})
    _step(compiled, w.batch)
    assert _counts(fxmem.report(compiled).graphs[-1])["attention_dropout"] == HF["layers"]
    split = fxmem.compilations(compiled)[-1].graphs[-1].split
    assert "attention" in _fused_ops(split.fw) and "attention_backward" in _fused_ops(split.bw)


class Attend(nn.Module):
    """Plain PyTorch self-attention with ``is_causal`` and dropout, and one whose mask is learned
    (the pattern leaves that one alone: the mask would need a gradient)."""

    def __init__(self, d=16, heads=2, learned_mask=False):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, 12)) if learned_mask else None

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2)
        elif self.bias is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[..., :s], dropout_p=0.2)
        return self.out(y.transpose(1, 2).reshape(b, s, d)).pow(2).mean()


def _padding(b: int, s: int) -> torch.Tensor:
    """HF's float mask: fp32's minimum where masked, here the last key and every key of query 0."""
    mask = torch.zeros(b, 1, s, s)
    mask[..., -1] = mask[:, :, 0, :] = torch.finfo(torch.float32).min
    return mask


@pytest.mark.parametrize("mask", ["causal", "padding"])
@pytest.mark.parametrize("autocast", [False, True])
def test_attention_with_dropout_under_autocast_and_changing_shapes(autocast, mask):
    """``is_causal``, or a float mask with fully masked rows, and bf16 autocast (CPU autocast runs
    SDPA in bf16, the mask cast too: fp32's minimum becomes -inf and a fully masked row gives
    zeros; the kernel then computes in fp32 as the math path does), one dynamic compile over two
    shapes: eager's numbers."""
    torch.manual_seed(0)
    model = Attend()
    ref_model, test_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(test_model, backend="fxmem", options={"inner": "eager", "level": 1}, dynamic=True)
    for b, s in ((2, 12), (3, 9)):
        x = torch.randn(b, s, 16)
        losses = []
        for m in (ref_model, compiled):
            torch.manual_seed(b)
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = m(x, _padding(b, s) if mask == "padding" else None)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])
    for p, q in zip(test_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    comps = fxmem.compilations(compiled)
    assert len(comps) == 1 and _counts(comps[-1].graphs[-1].report) == {"attention_dropout": 1}


def test_attention_with_a_learned_mask_is_left_alone_with_the_reason():
    torch.manual_seed(0)
    model, x = Attend(learned_mask=True), torch.randn(2, 12, 16)
    compiled = torch.compile(copy.deepcopy(model), backend="fxmem", options={"inner": "eager"})
    torch.manual_seed(1)
    loss = compiled(x)
    loss.backward()
    torch.manual_seed(1)
    ref = model(x)
    ref.backward()
    assert torch.equal(loss, ref)
    g = fxmem.report(compiled).graphs[-1]
    assert "attention_dropout" not in _counts(g)
    assert any("attention_dropout" in n and "needs a gradient" in n for n in g.lowering_notes)
