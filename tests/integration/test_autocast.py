"""fxmem under bf16 autocast: the step equals eager's under autocast, the planner's savings are
counted (and realised) at the narrower dtype, and pattern lowering follows autocast's casts (the
fused loss and the norms lowered, results within bf16 rounding of the unfused graph's)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
import fxmem.remat.partition
from fxmem.testing import ModelSpec, build

# bf16 has an 8-bit significand: one rounding is up to 2**-9 relative. The eager inner compiler runs
# the same aten kernels as eager, but AOTAutograd decomposes some ops (softmax/norm backward,
# attention) into primitives that may round their bf16 intermediates at other points than eager's
# fused kernels, and recomputed values feed the backward through such decompositions. A few bf16
# ulps is the honest bound: torch.testing's own bf16 default, rtol 1.6e-2 (4 ulps of 2**-8), with
# atol 1e-5 for gradient entries near zero. (fp32 tests use 1e-5.)
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-5}

SPEC = ModelSpec(vocab=64, d=32, blocks=("attention", "swiglu", "mlp"), norm="rmsnorm", hidden=64, heads=2,
                 batch=4, seq=16)


def _step(model, inputs, autocast):
    """One training step as users write it: forward under autocast, backward outside it.
    Returns (loss, grads, bytes autograd held between forward and backward): the storages of every
    saved tensor that is not a parameter, buffer or input, as fxmem.testing's check measures them."""
    keep = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    keep |= {t.untyped_storage().data_ptr() for t in inputs.values() if isinstance(t, torch.Tensor)}
    held = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in keep:
            held[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    loss = getattr(out, "loss", out)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), grads, sum(held.values())


def _fxmem_step(model, inputs, autocast, **options):
    """A fresh copy compiled with fxmem: (loss, grads, held bytes, the plan's saved bytes, the
    planned graph: its ``plan`` and simulated ``peak()``)."""
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="fxmem", options={"inner": "eager", **options})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a stage falling back to a safe plan fails the test
        loss, grads, held = _step(compiled, inputs, autocast)
    records = [g for c in fxmem.compilations(compiled) for g in c.graphs]
    assert len(records) == 1, f"expected one training graph, fxmem planned {len(records)}"
    return loss, grads, held, records[0].plan.saved_bytes, records[0]


def _assert_close(got, want, **tol):
    loss, grads = got
    ref_loss, ref_grads = want
    torch.testing.assert_close(loss, ref_loss, **tol)
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        torch.testing.assert_close(g, r, **tol, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("level", [0, 1])
def test_bf16_step_equals_eager_and_keeps_narrower_bytes(level):
    model, inputs = build(SPEC)
    ref_loss, ref_grads, _ = _step(copy.deepcopy(model), inputs, autocast=True)
    fp32_loss, _, _ = _step(copy.deepcopy(model), inputs, autocast=False)
    assert ref_loss != fp32_loss, "autocast had no effect on the eager reference"

    loss, grads, held, planned, graph = _fxmem_step(model, inputs, True, level=level)
    _assert_close((loss, grads), (ref_loss, ref_grads), **BF16_TOL)
    _, _, held32, planned32, graph32 = _fxmem_step(model, inputs, False, level=level)

    assert held == planned, f"autocast: plan says {planned} bytes are kept, autograd held {held}"
    assert held32 == planned32, f"fp32: plan says {planned32} bytes are kept, autograd held {held32}"
    # level 1 chooses its plan by the simulated peak (the two dtypes may choose differently): the
    # peak is what autocast lowers; at level 0 (one plan structure) the saved bytes too
    assert graph.peak() < graph32.peak(), f"peak under bf16 autocast ({graph.peak()}) not below fp32's"
    assert level or planned < planned32, f"saved bytes under bf16 autocast ({planned}) not below fp32's ({planned32})"


def test_level2_saves_no_more_than_level1_under_autocast():
    model, inputs = build(SPEC)
    ref = _step(copy.deepcopy(model), inputs, autocast=True)[:2]
    by_level = {}
    for level in (1, 2):
        loss, grads, held, planned, _ = _fxmem_step(model, inputs, True, level=level)
        _assert_close((loss, grads), ref, **BF16_TOL)
        assert held == planned, f"level {level}: plan says {planned} bytes are kept, autograd held {held}"
        by_level[level] = planned
    assert by_level[2] <= by_level[1], f"level 2 keeps {by_level[2]} bytes, level 1 {by_level[1]}"


class WideningCast(nn.Module):
    """Under autocast ``up`` runs in bf16; ``.float()`` widens it and the square's backward reads the
    fp32 value. Keeping the bf16 input of the cast (and recomputing the cast) halves what is kept."""

    def __init__(self, d=16, hidden=64):
        super().__init__()
        self.up = nn.Linear(d, hidden)

    def forward(self, x):
        z = self.up(x).float()
        return (z * z).mean()


def test_level2_keeps_the_bf16_input_of_a_widening_cast():
    torch.manual_seed(0)
    model, inputs = WideningCast(), {"x": torch.randn(8, 16)}
    ref = _step(copy.deepcopy(model), inputs, autocast=True)[:2]
    loss, grads, held, planned, graph = _fxmem_step(model, inputs, True, level=2)
    plan = graph.plan
    _assert_close((loss, grads), ref, **BF16_TOL)
    bf16_bytes = 8 * 64 * 2  # the linear's bf16 output; its fp32 cast would be twice that
    assert planned == held == bf16_bytes, f"planned {planned}, held {held}, expected {bf16_bytes}"
    # graph inputs (x) are alive anyway and cost nothing; the one activation kept is the bf16 one
    assert [n.meta["val"].dtype for n in plan.saved if n.op != "placeholder"] == [torch.bfloat16]


# Hugging Face GPT-2 (from a config, no download) under autocast: one eager reference and one fxmem
# compile per dtype, shared by the tests below.
@pytest.fixture(scope="module")
def gpt2_runs():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.loss_type = "ForCausalLM"  # else HF's "unrecognized loss_type" warning breaks the graph
    # batch 8 x seq 64: activations, not the fp32 loss and the gradients, make the peak. At 4 x 32 level
    # 1's plan does not lower the simulated peak under bf16 (the recomputed layers cast their weights
    # to bf16 again), so level 1 rightly keeps level 0's plan there (its notes say so).
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    return {"ref": _step(copy.deepcopy(model), inputs, autocast=True),
            # lowering off in both: the comparison is of the plans (lowering under autocast: below)
            "bf16": _fxmem_step(model, inputs, True, level=1, lowering=False),
            "fp32": _fxmem_step(model, inputs, False, level=1, lowering=False)}


@pytest.mark.slow
def test_hf_gpt2_bf16_step_equals_eager_and_saves_less(gpt2_runs):
    loss, grads, _, planned, _ = gpt2_runs["bf16"]
    _assert_close((loss, grads), gpt2_runs["ref"][:2], **BF16_TOL)
    assert planned < gpt2_runs["fp32"][3]


def test_hf_gpt2_bf16_saved_bytes_equal_held_bytes(gpt2_runs):
    for dtype in ("bf16", "fp32"):
        _, _, held, planned, _ = gpt2_runs[dtype]
        assert held == planned, f"{dtype}: plan says {planned} bytes are kept, autograd held {held}"


# -- lowering under autocast ---------------------------------------------------------------------
# Small HF causal LMs from configs. Measured (4 seeds, GPT-2 and Llama, autocast around the call):
# the lowered step's loss within 1.1e-7 relative of the unfused step's with the default lowering (the
# fused loss computes in fp32 from the same bf16 logits), 5.6e-6 with bias-GELU fused too (its GELU
# runs in fp32 and rounds once, eager's in bf16); every gradient entry within 6.3e-3 x the largest
# gradient (the fused loss accumulates the weight gradient from fp32 logit gradients where the
# unfused matmul reads them rounded to bf16: 1-2 bf16 ulps). Bounds: 1e-4 and 2**-6 (4 ulps of 2**-8).
LM = dict(batch=4, seq=32, vocab=512, d=32, layers=2, heads=2)
LOWERED_LOSS_RTOL, LOWERED_GRAD_TOL = 1e-4, 2 ** -6
NORM = {"hf_gpt2": ("layer_norm", 5), "hf_llama": ("rms_norm", 5)}


class _Loss(nn.Module):
    """An HF model's loss alone; ``inside``: its forward enters bf16 autocast itself (Dynamo's graph
    then holds the _enter_autocast/_exit_autocast nodes)."""

    def __init__(self, model, inside):
        super().__init__()
        self.model, self.inside = model, inside

    def forward(self, **batch):
        if not self.inside:
            return self.model(**batch).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(**batch).loss


def _lm_step(model, batch, around):
    """(loss, {name: grad}) of one step; ``around``: autocast around the call (else inside it)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=around):
        out = model(**batch)
    loss = getattr(out, "loss", out)
    loss.backward()
    return loss.detach(), {k.removeprefix("_orig_mod."): p.grad for k, p in model.named_parameters()}


def _assert_within_bf16(got, want, what):
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=LOWERED_LOSS_RTOL, atol=0, msg=f"{what}: loss")
    largest = max(g.abs().max().item() for g in ref_grads.values())
    worst = max(grads[k].sub(g).abs().max().item() for k, g in ref_grads.items())
    assert worst <= LOWERED_GRAD_TOL * largest, f"{what}: a gradient entry off by {worst / largest:.3g} x the largest"


def _lm_compiled(model, batch, around, **options):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    step = _lm_step(compiled, batch, around)
    return step, fxmem.report(compiled).graphs[-1]


@pytest.mark.parametrize("around", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["around", "inside"])
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_bf16_autocast_lowers_the_fused_loss_and_norms(name, around):
    """Default options, the loss under bf16 autocast around the compiled call or entered in forward:
    the fused loss (compared under autocast: its plan peaks lower) and the norms are lowered, and
    loss and gradients equal the unfused compile's and eager's within bf16 rounding."""
    from fxmem.models import build

    w = build(name, **LM)
    ref = _lm_step(_Loss(copy.deepcopy(w.model), not around), w.batch, around)
    lowered, report = _lm_compiled(_Loss(copy.deepcopy(w.model), not around), w.batch, around)
    unlowered, plain = _lm_compiled(_Loss(copy.deepcopy(w.model), not around), w.batch, around, lowering=False)
    counts = {r.pattern: r.count for r in report.lowerings}
    norm, n = NORM[name]
    assert counts.get("fused_linear_cross_entropy") == 1 and counts.get(norm) == n, (counts, report.lowering_notes)
    assert not any("autocast" in note for note in report.lowering_notes), report.lowering_notes
    assert report.predict_peak() < plain.predict_peak()
    torch.testing.assert_close(unlowered[0], ref[0])  # the unfused compile is eager's step
    _assert_within_bf16(lowered, unlowered, "lowered vs unlowered")
    _assert_within_bf16(lowered, ref, "lowered vs eager")


def test_bf16_autocast_declines_the_fused_loss_where_its_plan_peaks_higher():
    """HF GPT-2 returning its logits too, at the test size: the fused loss's fp32 chunk (the whole
    batch here) outweighs the bf16 logits it replaces, so the backend's comparison declines it and
    says so; the norms are still lowered."""
    from fxmem.models import build

    w = build("hf_gpt2", **LM)
    _, report = _lm_compiled(copy.deepcopy(w.model), w.batch, True)
    counts = {r.pattern: r.count for r in report.lowerings}
    assert "fused_linear_cross_entropy" not in counts and counts.get("layer_norm") == 5, counts
    assert any(note.startswith("left alone: fused_linear_cross_entropy") and "peaks at" in note
               for note in report.lowering_notes), report.lowering_notes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_bf16_autocast_every_pattern_when_applied(name, monkeypatch):
    """Every pattern under autocast, applied without the backend's peak comparison (which declines
    most at this size), the HF model returning its logits too: they equal eager's under autocast
    (computed from the same bf16 casts), SwiGLU / bias-GELU are lowered (GPT-2's bias cast as
    autocast casts it), and loss and gradients are within bf16 rounding of eager's."""
    import fxmem.backend
    from fxmem.models import build

    monkeypatch.setattr(fxmem.remat.partition, "choose", lambda fused, without, cap=None: (fused, None))
    w = build(name, **LM)
    model, compiled_model = copy.deepcopy(w.model), copy.deepcopy(w.model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = model(**w.batch).logits
    ref = _lm_step(model, w.batch, True)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="fxmem", options={"inner": "eager", "lowering": True})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(**w.batch)
    out.loss.backward()
    grads = {k.removeprefix("_orig_mod."): p.grad for k, p in compiled.named_parameters()}
    counts = {r.pattern: r.count for r in fxmem.report(compiled).graphs[-1].lowerings}
    norm, n = NORM[name]
    want = {"fused_linear_cross_entropy": 1, norm: n, "bias_gelu" if name == "hf_gpt2" else "swiglu": 2}
    assert counts == want, counts
    assert out.logits.dtype == torch.bfloat16
    # bias-GELU / SwiGLU round once where eager rounds each op: off by bf16 ulps of the largest logit
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=LOWERED_GRAD_TOL * ref_logits.abs().max().item())
    _assert_within_bf16((out.loss.detach(), grads), ref, "every pattern vs eager")


def test_bf16_autocast_dropout_is_seeded_and_keeps_its_dtype(monkeypatch):
    """Dropout after an autocast linear (applied without the peak comparison, which declines it at
    this size): bf16 in, bf16 out, one mask for forward and backward."""
    import fxmem.backend

    monkeypatch.setattr(fxmem.remat.partition, "choose", lambda fused, without, cap=None: (fused, None))
    lin = nn.Linear(32, 32)
    x = torch.randn(16, 32)
    compiled = torch.compile(lambda x: F.dropout(lin(x), 0.5, training=True), backend="fxmem",
                             options={"inner": "eager", "lowering": True})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    kept = y != 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x).detach()
    torch.testing.assert_close(y.detach(), torch.where(kept, h * 2, 0).to(y.dtype))
    torch.testing.assert_close(lin.bias.grad, kept.float().mul(2).sum(0), rtol=2 ** -8, atol=0)
    assert {r.pattern: r.count for r in fxmem.report(compiled).graphs[-1].lowerings} == {"dropout": 1}


def test_autocast_state_per_node_and_cpu_op_lists():
    """fxmem.lowering.amp: the state at each node (around the call, entered, disabled inside, left),
    and its CPU op lists agree with what CPU autocast does."""
    from fxmem.lowering import amp

    def f(x, w):
        a = F.linear(x, w)
        with torch.autocast("cpu", enabled=False):
            b = F.linear(x, w)
        return a, b

    graphs = []
    backend = lambda gm, ins: graphs.append(gm) or gm.forward  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(f, backend=backend)(x, w)
        states = amp.states(graphs[0].graph)
    by_name = {n.name: states.get(n, {}) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert by_name["a"] == {"cpu": torch.bfloat16} and by_name["b"] == {}, by_name
    assert amp.states(graphs[0].graph) == {}, "outside autocast, nothing entered in the graph"

    ln, t = F.layer_norm, torch.randint(0, 8, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for op, fn in (("matmul", lambda x: F.linear(x, w)), ("cross_entropy", lambda x: F.cross_entropy(x, t)),
                       ("layer_norm", lambda x: ln(x, (8,)))):
            for dtype in (torch.float32, torch.bfloat16):
                want = amp.compute_dtype(op, "cpu", torch.bfloat16) or dtype
                assert fn(x.to(dtype)).dtype == want, (op, dtype)


@pytest.mark.inductor
def test_bf16_autocast_lowering_with_inductor():
    """The same with the Inductor inner compiler (one layer): the fused loss and the norms are
    lowered (bias-GELU too, here: the comparison finds it lowers the peak of one layer) and the
    step is within bf16 rounding of eager's under autocast."""
    from fxmem.models import build

    w = build("hf_gpt2", **{**LM, "layers": 1})
    ref = _lm_step(_Loss(copy.deepcopy(w.model), False), w.batch, True)
    torch._dynamo.reset()
    compiled = torch.compile(_Loss(copy.deepcopy(w.model), False), backend="fxmem",
                             options={"inner": "inductor", "strict": True})
    got = _lm_step(compiled, w.batch, True)
    counts = {r.pattern: r.count for r in fxmem.report(compiled).graphs[-1].lowerings}
    assert counts.get("fused_linear_cross_entropy") == 1 and counts.get("layer_norm") == 3, counts
    _assert_within_bf16(got, ref, "Inductor, lowered, vs eager")
