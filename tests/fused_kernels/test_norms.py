import pytest
import torch
import torch.nn.functional as F

import fxmem_kernels.norms as norms
from fxmem.profiling import saved_tensor_bytes
from fxmem_kernels.norms import (
    layer_norm,
    layer_norm_backward_op,
    layer_norm_op,
    rms_norm,
    rms_norm_backward_op,
    rms_norm_op,
)

from .util import TOL, assert_same, assert_triton_matches_portable, cuda_test

SHAPES = [(7,), (3, 5), (2, 3, 17)]
PARAMS = ["weight+bias", "weight", "bias", "none"]


def _ln_ref(x, w, b, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def _rms_ref(x, w, eps=1e-6, offset=0.0):
    """The written-out RMSNorm (computed in x's dtype)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (offset + w) if w is not None else y


def _llama_ref(x, w, eps=1e-6):
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype) if w is not None else h.to(x.dtype)


def _gemma_ref(x, w, eps=1e-6):
    """transformers' GemmaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def _ln_inputs(shape, params, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()
    return x, w if "weight" in params else None, b if "bias" in params else None


# -- values and gradients ---------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("params", PARAMS)
def test_layer_norm_matches_fp32(impl, shape, params):
    assert_same(lambda x, w, b: layer_norm(x, w, b, impl=impl), _ln_ref,
                list(_ln_inputs(shape, params)))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_fp32(impl, shape, with_weight, offset):
    x, w, _ = _ln_inputs(shape, "weight" if with_weight else "none")
    assert_same(lambda x, w: rms_norm(x, w, offset=offset, impl=impl),
                lambda x, w: _rms_ref(x, w, offset=offset), [x, w])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_triton_and_torch_multi_program_shapes(impl):
    # 40 rows of 300: several forward programs, several backward programs with partial
    # dweight/dbias sums, masked columns; eps away from the default.
    x, w, b = _ln_inputs((40, 300), "weight+bias")
    assert_same(lambda x, w, b: layer_norm(x, w, b, 1e-3, impl),
                lambda x, w, b: _ln_ref(x, w, b, 1e-3), [x, w, b])
    assert_same(lambda x, w: rms_norm(x, w, 1e-3, 0.5, impl),
                lambda x, w: _rms_ref(x, w, 1e-3, 0.5), [x, w])


def test_portable_rms_norm_row_chunks(monkeypatch):
    # Tiny chunks: many of them, the last one partial.
    monkeypatch.setattr(norms, "_CHUNK_ELEMS", 64)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, _ = _ln_inputs((37, 17), "weight", dtype)
        assert_same(lambda x, w: rms_norm(x, w, impl="torch"), _llama_ref, [x, w], dtype=dtype)
        x, w, _ = _ln_inputs((37, 17), "none", dtype)
        assert_same(lambda x: rms_norm(x, impl="torch"), lambda x: _llama_ref(x, None), [x],
                    dtype=dtype)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_non_contiguous_input(impl):
    x = torch.randn(9, 4, 3).transpose(0, 2).requires_grad_()  # [3, 4, 9], strided
    w, b = torch.randn(9, requires_grad=True), torch.randn(9, requires_grad=True)
    assert_same(lambda x, w, b: layer_norm(x, w, b, impl=impl), _ln_ref, [x, w, b])
    assert_same(lambda x, w: rms_norm(x, w, impl=impl), _rms_ref, [x, w])


def test_statistics_of_the_forward_ops():
    x = torch.randn(2, 5, 11)
    for impl in ("torch", "triton"):
        y, mean, rstd = layer_norm_op(x, None, None, 1e-5, impl)
        var, mu = torch.var_mean(x, -1, unbiased=False)
        assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (2, 5)
        torch.testing.assert_close(mean, mu)
        torch.testing.assert_close(rstd, torch.rsqrt(var + 1e-5))
        y, rstd = rms_norm_op(x, None, 1e-6, 0.0, impl)
        torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + 1e-6))
    # 16-bit inputs: the statistics stay fp32 (aten's CPU kernel alone would round them).
    xb = x.bfloat16()
    _, mean, rstd = layer_norm_op(xb, torch.ones(11, dtype=torch.bfloat16), None, 1e-5, "torch")
    assert mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(mean, xb.float().mean(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params", ["weight+bias", "none"])
def test_layer_norm_low_precision(dtype, params):
    x, w, b = _ln_inputs((4, 3, 33), params, dtype)
    assert_same(lambda x, w, b: layer_norm(x, w, b, impl="torch"), _ln_ref, [x, w, b], dtype=dtype)
    # Against fp32 math too (the reference's 16-bit gradients are the rounder ones).
    assert_same(lambda x, w, b: layer_norm(x, w, b, impl="torch").float(),
                lambda x, w, b: _ln_ref(x.float(), *(p.float() if p is not None else None
                                                      for p in (w, b))), [x, w, b], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_low_precision_matches_hf(dtype):
    x, w, _ = _ln_inputs((4, 3, 33), "weight", dtype)
    # Llama's forward exactly (same rounding steps), gradients within 16-bit tolerance.
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, impl="torch"), _llama_ref(x, w), rtol=0, atol=0)
        torch.testing.assert_close(rms_norm(x, w, offset=1.0, impl="torch"), _gemma_ref(x, w),
                                   rtol=0, atol=0)
    assert_same(lambda x, w: rms_norm(x, w, impl="torch"), _llama_ref, [x, w], dtype=dtype)
    assert_same(lambda x, w: rms_norm(x, w, offset=1.0, impl="torch"), _gemma_ref, [x, w],
                dtype=dtype)
    assert_same(lambda x, w: rms_norm(x, w, impl="torch"), _rms_ref, [x, w], dtype=dtype)
    # An fp32 weight on a 16-bit input: HF promotes the output to fp32.
    wf = w.detach().float().requires_grad_()
    out = rms_norm(x, wf, impl="torch")
    assert out.dtype == torch.float32
    assert_same(lambda x, w: rms_norm(x, w, impl="torch"), _llama_ref, [x, wf], dtype=dtype)
    # No weight: one rounding of the fp32 result.
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, impl="torch"), _llama_ref(x, None), rtol=0, atol=0)


def test_gradcheck_fp64():
    x, w, b = (t.double().detach().requires_grad_() for t in _ln_inputs((3, 6), "weight+bias"))
    torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b, impl="torch"), (x, w, b))
    torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, offset=0.3, impl="torch"), (x, w))


def test_empty_rows():
    for impl in ("torch", "triton"):
        x, w, b = _ln_inputs((0, 8), "weight+bias")
        y = layer_norm(x, w, b, impl=impl)
        dx, dw, db = torch.autograd.grad(y.sum(), [x, w, b])
        assert y.shape == dx.shape == (0, 8) and dw.abs().sum() == db.abs().sum() == 0
        y = rms_norm(x, w, impl=impl)
        dx, dw = torch.autograd.grad(y.sum(), [x, w])
        assert y.shape == dx.shape == (0, 8) and dw.abs().sum() == 0


# -- transforms ------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vmap_grad_gives_per_example_gradients(impl):
    x = torch.randn(3, 4, 9)
    w, b = torch.randn(9), torch.randn(9)

    def per_example(fn, argnums):
        loss = lambda w, b, x: fn(x, w, b).pow(2).sum()
        return torch.func.vmap(torch.func.grad(loss, argnums=argnums), (None, None, 0))(w, b, x)

    got = per_example(lambda x, w, b: layer_norm(x, w, b, impl=impl), (0, 1, 2))
    want = per_example(_ln_ref, (0, 1, 2))
    assert got[0].shape == got[1].shape == (3, 9) and got[2].shape == x.shape
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **TOL[torch.float32])
    got = per_example(lambda x, w, b: rms_norm(x, w, offset=1.0, impl=impl), (0, 2))
    want = per_example(lambda x, w, b: _rms_ref(x, w, offset=1.0), (0, 2))
    assert got[0].shape == (3, 9)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **TOL[torch.float32])


def test_vmap_forward_rowwise_and_batched_weight():
    x, w, b = torch.randn(4, 5, 8), torch.randn(4, 8), torch.randn(8)
    # Only x batched: one call with the batch as more rows.
    torch.testing.assert_close(torch.func.vmap(lambda x: layer_norm(x, w[0], b))(x),
                               _ln_ref(x, w[0], b))
    torch.testing.assert_close(torch.func.vmap(lambda x: rms_norm(x, w[0]))(x), _rms_ref(x, w[0]))
    # Batched weight: the per-example path.
    got = torch.func.vmap(lambda x, w: layer_norm(x, w, b))(x, w)
    torch.testing.assert_close(got, torch.stack([_ln_ref(x[i], w[i], b) for i in range(4)]))
    got = torch.func.vmap(lambda x, w: rms_norm(x, w))(x, w)
    torch.testing.assert_close(got, torch.stack([_rms_ref(x[i], w[i]) for i in range(4)]))


def test_double_backward_raises():
    x, w, b = _ln_inputs((3, 4), "weight+bias")
    for fn in (lambda x, w: layer_norm(x, w, b), lambda x, w: rms_norm(x, w)):
        with pytest.raises(RuntimeError, match="double backward is not supported"):
            torch.autograd.grad(fn(x, w).pow(2).sum(), x, create_graph=True)
        f = lambda w: fn(x.detach(), w).pow(2).sum()
        with pytest.raises(RuntimeError, match="double backward is not supported"):
            torch.func.grad(lambda w: torch.func.grad(f)(w).sum())(w.detach())


def test_opcheck():
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    xb, wb = x.bfloat16(), w.bfloat16()
    for impl in ("torch", "triton"):
        y, mean, rstd = layer_norm_op(x, w, b, 1e-5, "torch")
        torch.library.opcheck(layer_norm_op, (x, w, b, 1e-5, impl))
        g = torch.randn(3, 8)
        torch.library.opcheck(layer_norm_backward_op, (g, x, w, b, mean, rstd, impl))
        torch.library.opcheck(layer_norm_backward_op, (g, x, None, b, mean, rstd, impl))
        y, rstd = rms_norm_op(x, w, 1e-6, 1.0, "torch")
        torch.library.opcheck(rms_norm_op, (x, w, 1e-6, 1.0, impl))
        torch.library.opcheck(rms_norm_backward_op, (g, x, w, rstd, 1.0, impl))
        torch.library.opcheck(rms_norm_backward_op, (g, x, None, rstd, 0.0, impl))
    # 16-bit inputs through the portable path (upcast buffers, promoted output dtype).
    _, mean, rstd = layer_norm_op(xb, wb, None, 1e-5, "torch")
    torch.library.opcheck(layer_norm_op, (xb, wb, None, 1e-5, "torch"))
    torch.library.opcheck(layer_norm_backward_op, (xb, xb, wb, None, mean, rstd, "torch"))
    _, rstd = rms_norm_op(xb, w, 1e-6, 0.0, "torch")
    torch.library.opcheck(rms_norm_op, (xb, w, 1e-6, 0.0, "torch"))
    torch.library.opcheck(rms_norm_backward_op, (x, xb, w, rstd, 0.0, "torch"))


# -- memory -----------------------------------------------------------------------------------
def test_keeps_no_more_than_unfused():
    n, h = 64, 256
    x, w, b = _ln_inputs((n, h), "weight+bias")
    fused = saved_tensor_bytes(lambda x, w, b: layer_norm(x, w, b), x, w, b)
    plain = saved_tensor_bytes(_ln_ref, x, w, b)
    assert fused == 2 * n * 4 <= plain  # mean and rstd only (x and the parameters are given)
    fused = saved_tensor_bytes(lambda x, w: rms_norm(x, w), x, w)
    plain = saved_tensor_bytes(_rms_ref, x, w)
    assert fused == n * 4  # rstd only
    assert plain > n * h * 4  # the written-out form keeps x * rstd (N x H) and N-sized pieces
    # 16-bit: still only fp32 statistics, while HF's form keeps fp32 copies of x.
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    assert saved_tensor_bytes(lambda x, w: rms_norm(x, w), xb, wb) == n * 4
    assert saved_tensor_bytes(_llama_ref, xb, wb) >= n * h * 4


# -- arguments, compile, CUDA ------------------------------------------------------------------
def test_bad_arguments_name_what_is_allowed():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"weight must have shape \[3\]"):
        layer_norm(x, torch.randn(4))
    with pytest.raises(ValueError, match=r"bias must have shape \[3\]"):
        layer_norm(x, None, torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"weight must have shape \[3\]"):
        rms_norm(x, torch.randn(2, 3))
    with pytest.raises(ValueError, match="eps must be > 0"):
        layer_norm(x, eps=0.0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm(x, eps=-1e-6)
    with pytest.raises(ValueError, match="impl must be one of"):
        layer_norm(x, impl="cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        rms_norm(x, impl="fast")
    with pytest.raises(ValueError, match="non-empty last dim"):
        rms_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match="weight must have shape"):  # the ops check too
        rms_norm_op(x, torch.randn(4), 1e-6, 0.0, "torch")


def test_compiles_into_a_graph():
    x, w, b = _ln_inputs((3, 8), "weight+bias")
    compiled = torch.compile(lambda x, w, b: layer_norm(x, w, b), backend="aot_eager",
                             fullgraph=True)
    assert_same(compiled, _ln_ref, [x, w, b])
    compiled = torch.compile(lambda x, w: rms_norm(x, w, offset=1.0), backend="aot_eager",
                             fullgraph=True)
    assert_same(compiled, lambda x, w: _rms_ref(x, w, offset=1.0), [x, w])


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1000, device="cuda", generator=g).to(dtype).requires_grad_()
    w = torch.randn(1000, device="cuda", generator=g).to(dtype).requires_grad_()
    b = torch.randn(1000, device="cuda", generator=g).to(dtype).requires_grad_()
    assert_triton_matches_portable(lambda x, w, b, impl: layer_norm(x, w, b, impl=impl), _ln_ref, [x, w, b],
                                   dtype=dtype)
    assert_triton_matches_portable(lambda x, w, impl: rms_norm(x, w, impl=impl), _llama_ref, [x, w], dtype=dtype)
    assert_triton_matches_portable(lambda x, w, impl: rms_norm(x, w, offset=1.0, impl=impl), _gemma_ref, [x, w],
                                   dtype=dtype)
