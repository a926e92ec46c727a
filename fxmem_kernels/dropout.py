"""Seeded dropout: ``x * mask / (1 - p)`` where the mask is a function of a seed and each element's
flat index, regenerated in backward instead of kept (nothing mask-sized lives between forward and
backward; only the seed, an 8-byte scalar, is saved, plus a zero-byte tag used under vmap).
``p`` must be in [0, 1): ``p == 1`` raises rather than returning zeros.

Two mask generators, each self-consistent between forward and backward but different from each
other (so ``impl="triton"`` and ``impl="torch"`` give different masks for the same seed):

- Triton: Philox ``tl.rand(seed, offsets)`` over the flat index, keep where ``u >= p``. The
  kernel spells out ``tl.rand``'s Philox (10 rounds, bit-identical to ``tl.rand``) because the
  per-kernel CPU interpreter cannot follow a call into another ``@triton.jit`` function.
- PyTorch (portable): ``torch.rand(x.shape, generator=torch.Generator(x.device).manual_seed(seed))
  >= p``, fp32 uniforms whatever x's dtype. Backward draws the same numbers again into a
  temporary that becomes its output.

Under ``torch.func.vmap`` the batch dim is folded into the flat index (the op runs once on the
stacked tensor), so every example gets a different mask, deterministic for a given seed; when the
seed itself is batched each example uses its own seed with offsets from 0. With ``seed=None`` a
seed is drawn from torch's default generator (so ``torch.manual_seed`` makes it reproducible);
inside ``vmap`` that draw needs ``randomness="same"`` or ``"different"`` (or pass a seed). The
backward op folds only when the forward's ``x`` was batched (its ``fold_like`` argument), so an
unbatched ``x`` with per-example cotangents gets its one mask in every example.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ._common import HAS_TRITON, launcher, loop_vmap, once_differentiable, use_triton

_BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dropout_kernel(x_ptr, seed_ptr, y_ptr, n, p, scale, F64: tl.constexpr,
                        BLOCK: tl.constexpr):
        # One kernel for forward (x) and backward (grad_y): y = x * [u >= p] * scale.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        # u = tl.rand(seed, offs), written out: Philox-4x32 with 10 rounds, counter
        # (offs_lo, offs_hi, 0, 0), key (seed_lo, seed_hi); then int32 -> [0, 1) as in tl.rand.
        seed = tl.load(seed_ptr).to(tl.uint64)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c0 = offs.to(tl.uint32)
        c1 = (offs >> 32).to(tl.uint32)
        c2 = c0 * 0
        c3 = c0 * 0
        for _ in tl.static_range(10):
            _c0 = c0
            _c2 = c2
            c0 = tl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
            c2 = tl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
            c1 = _c2 * 0xCD9E8D57
            c3 = _c0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        r = c0.to(tl.int32, bitcast=True)
        r = tl.where(r < 0, ~r, r)
        u = r.to(tl.float32) * 4.6566127342e-10
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if not F64:  # float64 stays float64 (scale is an fp32 scalar argument)
            x = x.to(tl.float32)
        y = tl.where(u >= p, x * scale, 0.0)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _check_p(p) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"fxmem_kernels.seeded_dropout: p must be a number in [0, 1), got {p!r}")


def _check(x: Tensor, p: float, seed: Tensor) -> None:
    _check_p(p)
    if not x.is_floating_point():
        raise ValueError(f"fxmem_kernels.seeded_dropout: x must be floating point, got {x.dtype}")
    if seed.dim() != 0 or seed.dtype != torch.int64:
        raise ValueError("fxmem_kernels.seeded_dropout: seed must be an int or a 0-dim int64 "
                         f"tensor, got a {seed.dtype} tensor of shape {list(seed.shape)}")


def _dropout(x: Tensor, p: float, seed: Tensor, impl: str) -> Tensor:
    """``x * mask(seed, flat index) / (1 - p)`` in a fresh contiguous buffer (forward and
    backward alike: the backward is this applied to ``grad_y``)."""
    scale = 1.0 / (1.0 - p)
    if use_triton(impl, x):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        n = x.numel()
        if n:
            launcher(_dropout_kernel, x)[(triton.cdiv(n, _BLOCK),)](
                x.contiguous(), seed.to(x.device), y, n, float(p), scale,
                F64=x.dtype == torch.float64, BLOCK=_BLOCK)
        return y
    g = torch.Generator(device=x.device)
    g.manual_seed(int(seed.item()))
    # fp32 uniforms whatever x's dtype (the mask does not depend on it); they become the output
    # (keep = (u >= p) as 1.0 / 0.0, then * x * scale) except for float64 x.
    keep = torch.rand(x.shape, generator=g, device=x.device, dtype=torch.float32).ge_(p)
    if x.dtype == torch.float64:
        return torch.mul(keep, x, out=torch.empty(x.shape, dtype=x.dtype, device=x.device)
                         ).mul_(scale)
    y = keep.mul_(x).mul_(scale)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# -- functional ops (what a graph pass places) ------------------------------------------------
@torch.library.custom_op("fxmem::seeded_dropout", mutates_args=())
def seeded_dropout_op(x: Tensor, p: float, seed: Tensor, impl: str = "auto") -> Tensor:
    """``x * mask / (1 - p)``; ``seed`` a 0-dim int64 tensor; mask = f(seed, flat index)."""
    _check(x, p, seed)
    return _dropout(x, p, seed, impl)


@seeded_dropout_op.register_fake
def _(x, p, seed, impl="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxmem::seeded_dropout_backward", mutates_args=())
def seeded_dropout_backward_op(grad_y: Tensor, p: float, seed: Tensor, impl: str = "auto",
                               fold_like: Optional[Tensor] = None) -> Tensor:
    """``grad_y * mask / (1 - p)`` with the forward's mask, regenerated from ``seed``.

    ``fold_like`` matters only under vmap: a zero-size tensor that is batched exactly when the
    forward's ``x`` was, so the mask folds the batch dim into the flat index only then (a batched
    ``grad_y`` for an unbatched ``x`` gets the one unbatched mask per example)."""
    _check(grad_y, p, seed)
    return _dropout(grad_y, p, seed, impl)


@seeded_dropout_backward_op.register_fake
def _(grad_y, p, seed, impl="auto", fold_like=None):
    return torch.empty_like(grad_y, memory_format=torch.contiguous_format)


def _folded(op, params: tuple[tuple[str, object], ...]):
    """vmap rule: the batch dim joins the flat index (one call on the stacked tensor) when the
    seed is not batched (and, for the backward, when ``fold_like`` says the forward's x was
    batched); otherwise one call per example. ``params``: (name, default) in schema order."""
    loop = loop_vmap(op)

    def rule(info, in_dims, *args, **kwargs):
        # Arguments in schema order, defaults filled in (the dispatcher drops trailing defaults).
        n = len(args)
        args = [*args, *(kwargs.pop(k, d) for k, d in params[n:])]
        in_dims = [*in_dims, *(None,) * (len(args) - n)]
        x, x_dim, seed_dim = args[0], in_dims[0], in_dims[2]
        fold_like = args[4] if len(args) > 4 else None
        if seed_dim is not None or (fold_like is not None and in_dims[4] is None):
            return loop(info, in_dims, *args, **kwargs)
        args[0] = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
        if fold_like is not None:
            args[4] = fold_like.movedim(in_dims[4], 0)
        return op(*args, **kwargs), 0

    return rule


seeded_dropout_op.register_vmap(
    _folded(seeded_dropout_op, (("x", None), ("p", None), ("seed", None), ("impl", "auto"))))
seeded_dropout_backward_op.register_vmap(
    _folded(seeded_dropout_backward_op, (("grad_y", None), ("p", None), ("seed", None),
                                         ("impl", "auto"), ("fold_like", None))))


# -- eager API with autograd ------------------------------------------------------------------
class _SeededDropout(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, p, seed, impl):
        return seeded_dropout_op(x, p, seed, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.p, seed, ctx.impl = inputs
        # x.new_empty(0): no bytes, but batched under vmap exactly when x is (see fold_like).
        ctx.save_for_backward(seed, x.new_empty(0))

    @staticmethod
    def backward(ctx, grad_y):
        once_differentiable("seeded_dropout")
        seed, fold_like = ctx.saved_tensors
        with torch.no_grad():
            dx = seeded_dropout_backward_op(grad_y, ctx.p, seed, ctx.impl, fold_like)
        return dx, None, None, None


def _seed_tensor(seed, x: Tensor) -> Tensor:
    if seed is None:
        return torch.randint(2**31, (), dtype=torch.int64).to(x.device)
    if isinstance(seed, Tensor):
        if seed.dim() != 0 or seed.dtype.is_floating_point or seed.dtype.is_complex \
                or seed.dtype == torch.bool:
            raise ValueError("fxmem_kernels.seeded_dropout: seed must be None, an int in "
                             "[0, 2**63) or a 0-dim integer tensor, got a "
                             f"{seed.dtype} tensor of shape {list(seed.shape)}")
        return seed.to(device=x.device, dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError("fxmem_kernels.seeded_dropout: seed must be None, an int in [0, 2**63) "
                         f"or a 0-dim integer tensor, got {seed!r}")
    return torch.tensor(seed, dtype=torch.int64, device=x.device)


def seeded_dropout(x: Tensor, p: float, seed: Union[int, Tensor, None] = None,
                   training: bool = True, impl: str = "auto") -> Tensor:
    """Dropout whose mask is regenerated from ``seed`` in backward (nothing mask-sized is kept):
    ``x * mask / (1 - p)``, the same values on every call with the same seed and ``impl``.

    ``p`` in [0, 1); ``seed`` an int, a 0-dim integer tensor, or None to draw one from torch's
    default generator; ``training=False`` returns ``x``. ``impl`` picks "triton", "torch" or
    "auto" (see FXMEM_KERNELS_TRITON); the two draw different masks (see the module docstring). Works under
    ``torch.func.vmap`` (each example its own mask) and ``vmap(grad(...))``."""
    _check_p(p)
    if not training:
        return x
    use_triton(impl, x)  # validates impl
    if not x.is_floating_point():
        raise ValueError(f"fxmem_kernels.seeded_dropout: x must be floating point, got {x.dtype}")
    return _SeededDropout.apply(x, p, _seed_tensor(seed, x), impl)
