"""Loops of small ops (issue [whole-step] #56): a selective scan written in plain PyTorch, a
recurrence with a per-step MLP, and transformers' hybrid state-space Jamba built from its config
(no CUDA kernels: its scan is a Python loop over the sequence). A compiled step never peaks above
eager's, level 1 peaks below level 0, ``predict_peak`` is within 5% of the measured peak, and the
step equals eager's without a fallback. Peaks are measured as ``bench/studies/zoo_table.py``
measures them (the third step; eager's with its gradients accumulated into, compiled ones from
``None``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxmem
from fxmem import graph_breaks
from fxmem.graph.inplace import INTO_FIRST
from fxmem.graph.reuse import reuse_dead_buffers
from fxmem.models import Workload, _tokens
from fxmem.profiling import step_perf
from fxmem.remat.scan_grads import accumulate_slice_gradients
from fxmem.testing.zoo import _causal, conform, eager_step

aten = torch.ops.aten
BAR = 0.05  # predict_peak's error


class SelectiveScanLM(nn.Module):
    """Mamba's selective scan in plain PyTorch: per layer, ``h_t = exp(A dt_t) * h_{t-1} + dt_t B_t u_t``
    over the sequence in a Python loop, ``y_t = h_t C_t``, the per-step outputs stacked."""

    def __init__(self, vocab=512, d=32, n=8, layers=2):
        super().__init__()
        self.n = n
        self.embed = nn.Embedding(vocab, d)
        self.inp = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(layers))
        self.bc = nn.ModuleList(nn.Linear(d, 2 * n + 1) for _ in range(layers))
        self.A = nn.ParameterList(nn.Parameter(-torch.rand(d, n)) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def scan(self, i: int, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp[i](x).chunk(2, -1)
        B, C, dt = self.bc[i](u).split([self.n, self.n, 1], -1)
        dt = F.softplus(dt)
        dA = torch.exp(self.A[i][None, None] * dt[..., None])    # (batch, seq, d, n)
        dBu = dt[..., None] * B[:, :, None, :] * u[..., None]   # (batch, seq, d, n)
        h = torch.zeros_like(dA[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            ys.append((h @ C[:, t, :, None])[..., 0])
        return x + self.out[i](torch.stack(ys, 1) * F.silu(z))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i in range(len(self.inp)):
            x = self.scan(i, x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class LoopMLP(nn.Module):
    """``h_t = h_{t-1} + W2 gelu(W1 h_{t-1} + x_t)`` in a Python loop: each step's values (the
    4x-wide hidden layer) outweigh the state it hands on."""

    def __init__(self, vocab=512, d=32, ratio=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, ratio * d)
        self.w1, self.w2 = nn.Linear(d, ratio * d), nn.Linear(ratio * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        h = x.new_zeros(x.shape[0], self.w2.out_features)
        hs = []
        for t in range(x.shape[1]):
            h = h + self.w2(F.gelu(self.w1(h) + x[:, t]))
            hs.append(h)
        logits = self.head(torch.stack(hs, 1))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _plain(model: nn.Module, batch: int, seq: int) -> Workload:
    torch.manual_seed(0)
    return Workload("scan", model, _tokens(batch, seq, 512, 0), lambda out: out)


def _jamba(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """bench/studies/outside_zoo.py's Jamba: a Mamba layer, then an attention layer with experts."""
    return _causal("jamba", "JambaForCausalLM", batch, seq, vocab, seed, hidden_size=d, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=2, intermediate_size=2 * d, num_experts=4,
                   num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   max_position_embeddings=64)


def _eager_peak(w: Workload) -> int:
    """The eager step's measured peak (the third step, as zoo_table.py measures eager)."""
    model = copy.deepcopy(w.model)
    for _ in range(3):
        with step_perf("cpu") as perf:
            eager_step(model, w)
    return perf.result.peak_bytes


def _levels(w: Workload, levels=(0, 1)) -> dict[int, int]:
    """Each level's measured peak; each step equals eager's, without a fallback, predicted within BAR."""
    ref = copy.deepcopy(w.model)
    reference = ref, eager_step(ref, w)
    peaks = {}
    for level in levels:
        c = conform(w, {"level": level}, reference)
        assert not c.fallbacks and not c.mismatches, (level, c.fallbacks, c.mismatches)
        predicted = fxmem.report(c.compiled).predict_peak()
        assert abs(predicted / c.peak_bytes - 1) <= BAR, (level, predicted, c.peak_bytes)
        peaks[level] = c.peak_bytes
    return peaks


def test_slice_gradients_of_a_loop_fill_one_buffer():
    """``add(acc, select_backward(g, sizes, dim, t))`` over distinct slots -> ``select_scatter``:
    the same values, written in place by the eager inner compiler; a slot summed twice stays a sum."""
    def grads(g0, g1, g2, g3):
        a = aten.select_backward(g0, [4, 3, 2], 1, 0)
        a = a + aten.select_backward(g1, [4, 3, 2], 1, 2)
        a = aten.select_backward(g2, [4, 3, 2], 1, -2) + a   # either order; slot 1 given as -2
        return a + aten.select_backward(g3, [4, 3, 2], 1, 2)  # slot 2 again: an add

    gs = [torch.randn(4, 2) for _ in range(4)]
    gm = make_fx(grads)(*gs)
    assert accumulate_slice_gradients(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.select_scatter.default) == 2 and targets.count(aten.add.Tensor) == 1
    torch.testing.assert_close(gm(*gs), grads(*gs), rtol=0, atol=0)
    reuse_dead_buffers(gm)  # both scatters write into the buffer that dies at them
    assert [n.target for n in gm.graph.nodes].count(INTO_FIRST[aten.select_scatter.default]) == 2
    torch.testing.assert_close(gm(*gs), grads(*gs), rtol=0, atol=0)


def test_chunks_gradients_of_a_loop_fill_one_buffer_where_they_do_not_overlap():
    def grads(g0, g1, g2, g3):
        a = aten.slice_backward(g0, [4, 7, 2], 1, 0, 2, 1)
        a = a + aten.slice_backward(g1, [4, 7, 2], 1, 2, 4, 1)
        a = a + aten.slice_backward(g2, [4, 7, 2], 1, -3, 9, 1)  # slots 4:7
        return a + aten.slice_backward(g3, [4, 7, 2], 1, 3, 5, 1)  # overlaps 2:4 and 4:7: an add

    gs = [torch.randn(4, 2, 2), torch.randn(4, 2, 2), torch.randn(4, 3, 2), torch.randn(4, 2, 2)]
    gm = make_fx(grads)(*gs)
    assert accumulate_slice_gradients(gm) == 2
    assert [n.target for n in gm.graph.nodes].count(aten.slice_scatter.default) == 2
    reuse_dead_buffers(gm)
    assert [n.target for n in gm.graph.nodes].count(INTO_FIRST[aten.slice_scatter.default]) == 2
    torch.testing.assert_close(gm(*gs), grads(*gs), rtol=0, atol=0)


@pytest.mark.slow
def test_selective_scan_in_plain_pytorch_peaks_below_eager_and_level1_below_level0():
    """Measured: level 0 694.9 KiB, level 1 681.3, eager 1,037.0 (before ``remat.scan_grads``, whose
    backward held each iteration's full-size slice gradient beside the sums: 814.9 and 801.3)."""
    w = _plain(SelectiveScanLM(d=32, n=16), batch=4, seq=16)
    eager = _eager_peak(w)
    peak = _levels(w)
    assert peak[1] <= eager, (peak, eager)
    assert peak[1] < peak[0], peak
    assert peak[0] < 0.75 * eager, (peak, eager)


@pytest.mark.slow
def test_a_loop_whose_steps_outweigh_its_state_is_recomputed_per_step_at_level_1():
    """Level 1's least-peak plan keeps each step's state and recomputes its MLP in the backward,
    step by step (just in time: ``split.late_order``)."""
    w = _plain(LoopMLP(), batch=16, seq=16)
    eager = _eager_peak(w)
    peak = _levels(w)
    assert peak[1] <= eager, (peak, eager)
    assert peak[1] < 0.85 * peak[0], peak  # 623.6 KiB against 781.6 measured


@pytest.mark.slow
def test_jamba_from_its_config_peaks_at_most_eager():
    """transformers' Jamba as its config ships (``use_associative_scan=True``): Dynamo traced
    torch's associative scan instead of eager's loop (level 0 868.3 KiB, level 1 865.5, aot_eager
    845.8, against eager's 668.5); fxmem has it trace the loop up to ``SCAN_LOOP_MAX`` steps
    (graph_breaks._eager_scan)."""
    w = _jamba()
    assert w.model.config.use_associative_scan
    assert w.batch["input_ids"].shape[1] <= graph_breaks.scan_loop_max()
    eager = _eager_peak(w)
    peak = _levels(w)
    assert peak[1] <= eager, (peak, eager)
    assert peak[1] < peak[0], peak


def test_the_scans_are_wrapped_and_their_mixers_reach_them_in_eager_and_compiled(monkeypatch):
    """transformers' state-space modules' ``mamba_selective_scan`` is fxmem's wrapper of theirs,
    which the mixers call through the module global (with ``kernels`` installed, the original is
    the ``nn.Module`` that ``use_kernelized_func`` routes to the model's own copy): eager asks for
    the associative scan as the config says (and runs the loop), Dynamo is handed the loop.
    ``is_torchdynamo_compiling`` is left alone."""
    import transformers.models.jamba.modeling_jamba as jamba
    import transformers.utils as utils

    graph_breaks.ignore_once_warnings()
    wrapper = jamba.mamba_selective_scan
    original = wrapper.__wrapped__
    assert getattr(wrapper, graph_breaks._MARK) and not getattr(original, graph_breaks._MARK, False)
    graph_breaks._eager_scan(jamba)  # wrapped once
    assert jamba.mamba_selective_scan is wrapper
    assert jamba.is_torchdynamo_compiling is utils.is_torchdynamo_compiling

    asked = []

    def recorder(*args, **kwargs):
        asked.append(kwargs["use_associative_scan"])
        return original(*args, **kwargs)

    monkeypatch.setattr(jamba, "mamba_selective_scan", graph_breaks._loop_up_to_the_limit(recorder))
    w = _jamba(seq=4)
    ref = copy.deepcopy(w.model)
    want = eager_step(ref, w)
    assert asked == [True]
    torch._dynamo.reset()
    got = eager_step(torch.compile(w.model, backend="eager"), w)
    assert asked == [True, False]
    torch.testing.assert_close(got, want)


def _scanned(n: int) -> list[bool]:
    """What a wrapped ``mamba_selective_scan`` hands on as ``use_associative_scan`` when Dynamo
    traces a call asking for it over ``n`` steps (and in eager)."""
    asked = []

    def original(hidden_states, dt, use_associative_scan=False):
        asked.append(use_associative_scan)
        return hidden_states * dt

    scan = graph_breaks._loop_up_to_the_limit(original)
    x = torch.ones(2, 3, n)
    torch._dynamo.reset()
    out = torch.compile(lambda x: scan(x, 2.0, use_associative_scan=True), backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, 2 * x)
    scan(x, 2.0, use_associative_scan=True)
    scan(x, 2.0)
    return asked


def test_the_loop_up_to_the_limit_the_associative_scan_above(monkeypatch):
    assert graph_breaks.SCAN_LOOP_MAX == 256
    monkeypatch.delenv("FXMEM_SCAN_LOOP_MAX", raising=False)
    assert graph_breaks.scan_loop_max() == 256
    assert _scanned(256) == [False, True, False]  # traced: the loop; eager and unasked: as called
    assert _scanned(257) == [True, True, False]
    monkeypatch.setenv("FXMEM_SCAN_LOOP_MAX", " 4 ")
    assert _scanned(4) == [False, True, False]
    assert _scanned(5) == [True, True, False]
    monkeypatch.setenv("FXMEM_SCAN_LOOP_MAX", "0")
    assert _scanned(1) == [True, True, False]


@pytest.mark.parametrize("value", ["-1", "1.5", "1e3", "many"])
def test_a_bad_scan_loop_max_names_the_variable(monkeypatch, value):
    """Raised where it is read (Dynamo tracing a scan: as it is, not wrapped) and when options resolve."""
    message = rf"environment variable FXMEM_SCAN_LOOP_MAX: got '{value}'; allowed: a whole number >= 0"
    with pytest.raises(ValueError, match=message):
        fxmem.resolve({}, env={"FXMEM_SCAN_LOOP_MAX": value})
    monkeypatch.setenv("FXMEM_SCAN_LOOP_MAX", value)
    with pytest.raises(ValueError, match=message):
        _scanned(4)
