"""Bias + GELU (erf and tanh forms): ``gelu(x + bias)``.

The forward is fused; the backward recomputes the activation's derivative from ``x`` and
``bias`` instead of keeping the pre-activation ``x + bias`` (the portable backward forms it a block
of rows at a time, so nothing input-sized is alive beside its output). The bias gradient is the row sum of
``dx``, left to PyTorch (a reduction across rows is not what an elementwise kernel is for).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._common import HAS_TRITON, launcher, once_differentiable, rowwise_vmap, use_triton

APPROXIMATIONS = ("none", "tanh")
_BLOCK = 1024
# The portable backward's block: rows of at most this many elements (1 MiB of fp32), at least one row.
BACKWARD_BLOCK_ELEMENTS = 2**18


def backward_block_rows(row_elements) -> int:
    """Rows per block of the portable backward (ints; ``graph.scratch`` counts the same)."""
    return max(1, BACKWARD_BLOCK_ELEMENTS // max(1, int(row_elements)))

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, n, h, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                         BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + offs % h, mask=mask, other=0.0).to(tl.float32)
        if TANH:
            # tanh(u) = 1 - 2 / (exp(2u) + 1): libdevice.tanh is not in the interpreter.
            t = 1.0 - 2.0 / (tl.exp(1.5957691216057308 * (z + 0.044715 * z * z * z)) + 1.0)
            y = 0.5 * z * (1.0 + t)
        else:
            y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_bwd_kernel(g_ptr, x_ptr, b_ptr, dx_ptr, n, h, HAS_BIAS: tl.constexpr,
                         TANH: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + offs % h, mask=mask, other=0.0).to(tl.float32)
        if TANH:
            t = 1.0 - 2.0 / (tl.exp(1.5957691216057308 * (z + 0.044715 * z * z * z)) + 1.0)
            d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 3.0 * 0.044715 * z * z)
        else:
            d = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
        tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=mask)


def _check(x: Tensor, bias: Optional[Tensor], approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"fxmem_kernels.bias_gelu: approximate must be one of {APPROXIMATIONS}, "
                         f"got {approximate!r}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != x.shape[-1]):
        raise ValueError(f"fxmem_kernels.bias_gelu: bias must have shape [{x.shape[-1]}] "
                         f"(x's last dim), got {list(bias.shape)}")


def _launch(kernel, out, *tensors, x, bias, approximate):
    n = x.numel()
    xc = x.contiguous()
    b = bias.contiguous() if bias is not None else xc  # placeholder pointer, never read
    grid = (triton.cdiv(n, _BLOCK),)
    launcher(kernel, x)[grid](*[t.contiguous() for t in tensors], xc, b, out, n, x.shape[-1],
                              HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=_BLOCK)
    return out


# -- functional ops (what a graph pass places) ------------------------------------------------
@torch.library.custom_op("fxmem::bias_gelu", mutates_args=())
def bias_gelu_op(x: Tensor, bias: Optional[Tensor], approximate: str = "none",
                 impl: str = "auto") -> Tensor:
    _check(x, bias, approximate)
    if use_triton(impl, x):
        return _launch(_gelu_fwd_kernel, torch.empty(x.shape, dtype=x.dtype, device=x.device),
                       x=x, bias=bias, approximate=approximate)
    z = x.float() + bias if bias is not None else x.float().clone()
    return torch.ops.aten.gelu_(z, approximate=approximate).to(x.dtype)  # one fresh buffer


@bias_gelu_op.register_fake
def _(x, bias, approximate="none", impl="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxmem::bias_gelu_backward", mutates_args=())
def bias_gelu_backward_op(grad_y: Tensor, x: Tensor, bias: Optional[Tensor],
                          approximate: str = "none", impl: str = "auto") -> Tensor:
    """``d gelu(x + bias) / dx`` times ``grad_y`` (= the gradient of ``x + bias``)."""
    _check(x, bias, approximate)
    if use_triton(impl, x):
        return _launch(_gelu_bwd_kernel, torch.empty(x.shape, dtype=x.dtype, device=x.device),
                       grad_y, x=x, bias=bias, approximate=approximate)
    # aten's fused gelu_backward recomputes the derivative from the pre-activation, formed (and
    # cast to fp32) a block of rows at a time: no input-sized temporary beside the output.
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not out.numel():
        return out
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)  # a copy if x is not contiguous
    grads, outs = grad_y.reshape(rows.shape), out.view(rows.shape)
    step = backward_block_rows(rows.shape[-1])
    for i in range(0, rows.shape[0], step):
        z = rows[i:i + step].float() + bias if bias is not None else rows[i:i + step].float()
        g = grads[i:i + step].float()
        if outs.dtype == torch.float32:
            torch.ops.aten.gelu_backward.grad_input(g, z, approximate=approximate, grad_input=outs[i:i + step])
        else:
            outs[i:i + step] = torch.ops.aten.gelu_backward(g, z, approximate=approximate)
        del z, g
    return out


@bias_gelu_backward_op.register_fake
def _(grad_y, x, bias, approximate="none", impl="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


bias_gelu_op.register_vmap(rowwise_vmap(bias_gelu_op, row_args=(0,)))
bias_gelu_backward_op.register_vmap(rowwise_vmap(bias_gelu_backward_op, row_args=(0, 1)))


# -- eager API with autograd ------------------------------------------------------------------
class _BiasGelu(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, bias, approximate, impl):
        return bias_gelu_op(x, bias, approximate, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, ctx.approximate, ctx.impl = inputs
        ctx.save_for_backward(x, bias)

    @staticmethod
    def backward(ctx, grad_y):
        once_differentiable("bias_gelu")
        x, bias = ctx.saved_tensors
        with torch.no_grad():
            dx = bias_gelu_backward_op(grad_y, x, bias, ctx.approximate, ctx.impl)
            dbias = None
            if bias is not None and ctx.needs_input_grad[1]:
                dbias = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias, None, None


def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none",
              impl: str = "auto") -> Tensor:
    """``gelu(x + bias)`` (``approximate`` "none" for erf, "tanh" for GPT-2's form) that keeps
    ``x`` rather than the pre-activation for backward. Works under ``torch.func.vmap`` and
    ``vmap(grad(...))``; ``impl`` picks "triton", "torch" or "auto" (see FXMEM_KERNELS_TRITON)."""
    return _BiasGelu.apply(x, bias, approximate, impl)
