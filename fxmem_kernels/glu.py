"""Gated linear units: SwiGLU ``silu(gate) * up`` and GeGLU ``gelu(gate) * up`` (erf or tanh).

The forward is fused; the backward recomputes the activation (and its derivative) from ``gate``,
so only ``gate`` and ``up`` are kept (the unfused expression keeps them too, plus
``silu(gate)`` / ``gelu(gate)``). One pair of functional ops serves both, selected by an
``activation`` string: "silu", "gelu" (erf) or "gelu_tanh".
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import HAS_TRITON, launcher, once_differentiable, rowwise_vmap, use_triton

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
APPROXIMATIONS = ("none", "tanh")
_ACT_ID = {a: i for i, a in enumerate(ACTIVATIONS)}
_BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _glu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        z = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            a = z / (1.0 + tl.exp(-z))
        elif ACT == 1:
            a = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
        else:
            # tanh(v) = 1 - 2 / (exp(2v) + 1): libdevice.tanh is not in the interpreter.
            t = 1.0 - 2.0 / (tl.exp(1.5957691216057308 * (z + 0.044715 * z * z * z)) + 1.0)
            a = 0.5 * z * (1.0 + t)
        tl.store(y_ptr + offs, (a * u).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr,
                        BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            s = 1.0 / (1.0 + tl.exp(-z))
            a = z * s
            d = s * (1.0 + z * (1.0 - s))
        elif ACT == 1:
            c = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
            a = z * c
            d = c + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
        else:
            t = 1.0 - 2.0 / (tl.exp(1.5957691216057308 * (z + 0.044715 * z * z * z)) + 1.0)
            a = 0.5 * z * (1.0 + t)
            d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 3.0 * 0.044715 * z * z)
        tl.store(dg_ptr + offs, (dy * u * d).to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + offs, (dy * a).to(du_ptr.dtype.element_ty), mask=mask)


def _check(gate: Tensor, up: Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"fxmem_kernels.glu: activation must be one of {ACTIVATIONS}, "
                         f"got {activation!r}")
    if gate.shape != up.shape:
        raise ValueError("fxmem_kernels.glu: gate and up must have the same shape (no "
                         f"broadcasting), got {list(gate.shape)} and {list(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError("fxmem_kernels.glu: gate and up must have the same dtype, got "
                         f"{gate.dtype} and {up.dtype}")


def _empty(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _activation_out(gate: Tensor, activation: str, out: Tensor) -> Tensor:
    """``act(gate)`` written into ``out`` (aten's own kernels, so values match the unfused ops)."""
    if activation == "silu":
        return torch.ops.aten.silu.out(gate, out=out)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return torch.ops.aten.gelu.out(gate, approximate=approximate, out=out)


# -- functional ops (what a graph pass places) ------------------------------------------------
@torch.library.custom_op("fxmem::glu", mutates_args=())
def glu_op(gate: Tensor, up: Tensor, activation: str = "silu", impl: str = "auto") -> Tensor:
    """``act(gate) * up`` with ``activation`` "silu", "gelu" or "gelu_tanh"."""
    _check(gate, up, activation)
    y = _empty(gate)
    if use_triton(impl, gate):
        n = gate.numel()
        if n:
            launcher(_glu_fwd_kernel, gate)[(triton.cdiv(n, _BLOCK),)](
                gate.contiguous(), up.contiguous(), y, n, ACT=_ACT_ID[activation], BLOCK=_BLOCK)
        return y
    return _activation_out(gate, activation, y).mul_(up)  # one fresh buffer


@glu_op.register_fake
def _(gate, up, activation="silu", impl="auto"):
    _check(gate, up, activation)
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxmem::glu_backward", mutates_args=())
def glu_backward_op(grad_y: Tensor, gate: Tensor, up: Tensor, activation: str = "silu",
                    impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(grad_gate, grad_up)`` of ``act(gate) * up``, recomputing ``act(gate)`` from ``gate``."""
    _check(gate, up, activation)
    grad_gate, grad_up = _empty(gate), _empty(up)
    if use_triton(impl, gate):
        n = gate.numel()
        if n:
            launcher(_glu_bwd_kernel, gate)[(triton.cdiv(n, _BLOCK),)](
                grad_y.contiguous(), gate.contiguous(), up.contiguous(), grad_gate, grad_up, n,
                ACT=_ACT_ID[activation], BLOCK=_BLOCK)
        return grad_gate, grad_up
    # The same aten ops autograd runs for the unfused expression, each into its output buffer.
    _activation_out(gate, activation, grad_up).mul_(grad_y)
    torch.mul(grad_y, up, out=grad_gate)  # d loss / d act(gate), then through the activation:
    if activation == "silu":
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
    else:
        torch.ops.aten.gelu_backward.grad_input(
            grad_gate, gate, approximate="tanh" if activation == "gelu_tanh" else "none",
            grad_input=grad_gate)
    return grad_gate, grad_up


@glu_backward_op.register_fake
def _(grad_y, gate, up, activation="silu", impl="auto"):
    _check(gate, up, activation)
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


glu_op.register_vmap(rowwise_vmap(glu_op, row_args=(0, 1)))
glu_backward_op.register_vmap(rowwise_vmap(glu_backward_op, row_args=(0, 1, 2)))


# -- eager API with autograd ------------------------------------------------------------------
class _Glu(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate, up, activation, impl):
        return glu_op(gate, up, activation, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate, up, ctx.activation, ctx.impl = inputs
        ctx.save_for_backward(gate, up)

    @staticmethod
    def backward(ctx, grad_y):
        once_differentiable("glu")
        gate, up = ctx.saved_tensors
        with torch.no_grad():
            dgate, dup = glu_backward_op(grad_y, gate, up, ctx.activation, ctx.impl)
        return (dgate if ctx.needs_input_grad[0] else None,
                dup if ctx.needs_input_grad[1] else None, None, None)


def _apply(gate: Tensor, up: Tensor, activation: str, impl: str) -> Tensor:
    _check(gate, up, activation)
    use_triton(impl, gate)  # validates impl
    return _Glu.apply(gate, up, activation, impl)


def swiglu(gate: Tensor, up: Tensor, impl: str = "auto") -> Tensor:
    """``silu(gate) * up`` keeping only ``gate`` and ``up`` for backward. ``gate`` and ``up``
    have the same shape and dtype. Works under ``torch.func.vmap`` and ``vmap(grad(...))``;
    ``impl`` picks "triton", "torch" or "auto" (see FXMEM_KERNELS_TRITON)."""
    return _apply(gate, up, "silu", impl)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none", impl: str = "auto") -> Tensor:
    """``gelu(gate, approximate) * up`` (``approximate`` "none" for erf, "tanh") keeping only
    ``gate`` and ``up`` for backward; otherwise as :func:`swiglu`."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"fxmem_kernels.geglu: approximate must be one of {APPROXIMATIONS}, "
                         f"got {approximate!r}")
    return _apply(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu", impl)
