"""A conv + BatchNorm segmentation step gives eager's bits (issue #56).

MobileViT's gradients differed from eager in the last bits under fxmem (and torch's ``aot_eager``)
at every level: not the conv or the BatchNorm, but the bilinear upsampling of the logits before the
loss, which AOTAutograd's trace swaps for a Python decomposition (gathers and blends in another
order, a scatter-add backward). With the eager inner compiler fxmem keeps eager's kernels
(``fxmem.inner.eager_kernels``), so the step is bitwise eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxmem.inner import EAGER_KERNELS, eager_kernels

aten = torch.ops.aten


class ConvSegmenter(nn.Module):
    """MobileViT's pattern at a tiny size: conv-BN-SiLU, a 1x1 classifier, the logits upsampled
    bilinearly to the label map, cross-entropy."""

    def __init__(self, channels: int = 8, classes: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.mix = nn.Conv2d(channels, channels, 3, stride=2, padding=1, bias=False)
        self.mix_norm = nn.BatchNorm2d(channels)
        self.classifier = nn.Conv2d(channels, classes, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm(self.conv(x)))
        h = F.silu(self.mix_norm(self.mix(h)))
        logits = F.interpolate(self.classifier(h), size=labels.shape[-2:], mode="bilinear", align_corners=False)
        return F.cross_entropy(logits, labels)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 4, (2, 32, 32), generator=g)


def _assert_bitwise(ref: nn.Module, test: nn.Module, ref_loss: torch.Tensor, loss: torch.Tensor) -> None:
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    differ = [n for (n, p), q in zip(ref.named_parameters(), test.parameters()) if not torch.equal(p.grad, q.grad)]
    assert not differ, f"gradients not bitwise eager's: {differ}"
    for (n, b), c in zip(ref.named_buffers(), test.buffers()):
        assert torch.equal(b, c), n  # BatchNorm's running statistics


def _step(level: int, dynamic: bool) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ConvSegmenter()
    x, labels = _inputs()
    ref = copy.deepcopy(model)
    ref_loss = ref(x, labels)
    ref_loss.backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", dynamic=dynamic,
                             options={"inner": "eager", "level": level, "lowering": False, "strict": True})
    loss = compiled(x, labels)
    loss.backward()
    return ref, model, ref_loss.detach(), loss.detach()


@pytest.mark.parametrize("level", [0, 2])
def test_conv_bn_segmentation_step_is_bitwise_eager(level):
    _assert_bitwise(*_step(level, dynamic=False))


def test_the_unoptimized_reference_traces_the_same_kernels():
    """``fxmem.testing``'s reference (fxmem without its planner) traces as fxmem does: its step is
    eager's bits too, so bit-identity checks against it hold on interpolating models."""
    from fxmem.testing.checks import _unoptimized

    ref, model, ref_loss, _ = _step(0, dynamic=False)
    torch.manual_seed(0)
    unoptimized = ConvSegmenter()
    torch._dynamo.reset()
    loss = torch.compile(unoptimized, backend=_unoptimized({"level": 0, "lowering": False}))(*_inputs())
    loss.backward()
    _assert_bitwise(ref, unoptimized, ref_loss, loss.detach())


def test_symbolic_sizes_keep_torchs_decomposition():
    """Under ``dynamic=True`` the interpolation's sizes are symbolic, and its kernel's backward has
    no symbolic meta function: torch's decomposition stays, the step compiles (strict: no
    fallback) and its gradients are eager's to rounding, not bitwise."""
    ref, model, ref_loss, loss = _step(1, dynamic=True)
    torch.testing.assert_close(loss, ref_loss)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


_MODES = {
    "linear": ((2, 3, 13), dict(size=40, mode="linear")),
    "bilinear": ((2, 3, 13, 11), dict(size=(40, 37), mode="bilinear")),
    "bilinear_corners": ((2, 3, 13, 11), dict(scale_factor=3, mode="bilinear", align_corners=True)),
    "bilinear_channels_last": ((2, 5, 13, 11), dict(size=(40, 37), mode="bilinear")),
    "bicubic": ((2, 3, 13, 11), dict(size=(40, 37), mode="bicubic")),
    "trilinear": ((2, 3, 5, 6, 7), dict(size=(11, 13, 15), mode="trilinear")),
    # decomposed, and bitwise eager's all the same: not in EAGER_KERNELS
    "nearest": ((2, 3, 13, 11), dict(size=(40, 37), mode="nearest")),
    "nearest_exact": ((2, 3, 13, 11), dict(size=(40, 37), mode="nearest-exact")),
    "nearest_3d": ((2, 3, 5, 6, 7), dict(size=(11, 13, 15), mode="nearest")),
}


@pytest.mark.parametrize("mode", list(_MODES))
def test_interpolation_is_bitwise_eager(mode):
    shape, kw = _MODES[mode]
    x0 = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    if mode.endswith("channels_last"):
        x0 = x0.to(memory_format=torch.channels_last)
    weight = torch.randn(F.interpolate(x0, **kw).shape, generator=torch.Generator().manual_seed(1))

    def f(x):
        return (F.interpolate(x, **kw) * weight).sum()

    x = x0.clone().requires_grad_()
    ref_loss = f(x)
    ref_loss.backward()
    ref_grad = x.grad
    torch._dynamo.reset()
    x = x0.clone().requires_grad_()
    loss = torch.compile(f, backend="fxmem", options={"inner": "eager", "level": 0, "lowering": False})(x)
    loss.backward()
    assert torch.equal(loss, ref_loss) and torch.equal(x.grad, ref_grad)


def test_per_example_interpolation_is_bitwise_eager():
    """A ``vmap(grad(...))`` region (a per-example chunk, traced by ``trace_flat``) keeps eager's
    kernels too: the summed per-example gradients are eager's bits."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    params = {k: v.detach() for k, v in conv.named_parameters()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4, 16, 16), generator=g)

    def loss(p, xi, yi):
        out = functional_call(conv, p, (xi[None],))
        return F.cross_entropy(F.interpolate(out, size=(16, 16), mode="bilinear"), yi[None])

    def step(p, x, y):
        return {k: v.sum(0) for k, v in vmap(grad(loss), in_dims=(None, 0, 0))(p, x, y).items()}

    ref = step(params, x, y)
    torch._dynamo.reset()
    got = torch.compile(step, backend="fxmem",
                        options={"inner": "eager", "level": 0, "lowering": False, "strict": True})(params, x, y)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_eager_kernels_restores_torchs_decompositions():
    """The swap lasts for fxmem's trace only: torch's own tracing still decomposes afterwards."""
    from torch._C import DispatchKey

    ops = [getattr(getattr(aten, name), overload) for name in EAGER_KERNELS for overload in ("vec", "default")]
    before = [dict(op.py_kernels) for op in ops]
    assert DispatchKey.Autograd in aten.upsample_bilinear2d.default.py_kernels
    with eager_kernels():
        assert all(DispatchKey.Autograd not in getattr(aten, name).default.py_kernels for name in EAGER_KERNELS)
        assert all(op.py_kernels != kernels for op, kernels in zip(ops, before) if op._overloadname == "vec")
    assert [dict(op.py_kernels) for op in ops] == before
    with pytest.raises(RuntimeError), eager_kernels():
        raise RuntimeError("a failed trace")
    assert [dict(op.py_kernels) for op in ops] == before

    seen = []

    def targets(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    torch.compile(lambda t: F.interpolate(t, size=(8, 8), mode="bilinear").sum(),
                  backend=aot_autograd(fw_compiler=targets, bw_compiler=targets))(x).backward()
    assert "aten._unsafe_index.Tensor" in seen and "aten.upsample_bilinear2d.default" not in seen


def test_cpu_softmax_copies_a_channels_last_input():
    """CPU (log-)softmax makes its input contiguous first: a channels-last logits map (an
    interpolation's kernel keeps its input's layout) costs one copy, none where it is contiguous."""
    from fxmem.graph.scratch import op_scratch

    x = torch.randn(2, 4, 8, 8)
    for op in (aten._log_softmax.default, aten._softmax.default):
        assert op_scratch(op, (x, 1, False), {}, None) == 0
        assert op_scratch(op, (x.to(memory_format=torch.channels_last), 1, False), {}, None) == x.nbytes


def test_a_channels_last_segmenter_is_predicted_exactly():
    """The logits of a channels-last conv net come out of the bilinear kernel channels-last; the
    loss's log-softmax copies them (SegFormer's decode head: predicted 11% low before it was
    counted). Third step, eager inner compiler, level 0: predicted to the byte."""
    import fxmem
    from fxmem.profiling import step_perf

    torch.manual_seed(0)
    model = ConvSegmenter()
    x, labels = _inputs()
    x = x.to(memory_format=torch.channels_last)
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager"})
    for _ in range(2):
        compiled(x, labels).backward()
        model.zero_grad(set_to_none=True)
    with step_perf("cpu") as perf:
        compiled(x, labels).backward()
    predicted = fxmem.report(compiled).predict_peak()
    assert abs(predicted - perf.result.peak_bytes) <= 16, (predicted, perf.result.peak_bytes)
