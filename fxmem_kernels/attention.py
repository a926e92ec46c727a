"""Attention with dropout, a few (batch, head) slices at a time: ``dropout(softmax(q k^T * scale +
mask)) v`` with no ``[batch, heads, L, S]`` float buffer in either pass.

Why: with dropout, ``F.scaled_dot_product_attention`` on CPU takes the math path, which holds the
scores, the probabilities and the dropped probabilities in forward and their gradients in backward,
each ``[batch, heads, L, S]`` in fp32 (GPT-2 small at 2 x 512: 24 MiB each, per layer). The flash
kernels (CPU without dropout, CUDA with or without) need no help; this one is for the math path.

The kernel computes what the math path computes, slice by slice and op for op (torch 2.13's
``_scaled_dot_product_attention_math``): ``q * sqrt(scale)`` times ``k^T * sqrt(scale)`` (q's
factor negated for a negative scale), the mask
added (a bool mask as 0 / -inf), ``_safe_softmax``, then ``p * keep * 1/(1-p)`` as
``native_dropout`` does, then the product with ``v``; half-precision inputs are computed in fp32
and the result cast back, as the math path does. The backward recomputes each slice's
probabilities and applies the same ops' derivatives. Matrix products over a few slices can round
differently from one product over all of them, so "equal" to the math path means within fp32
rounding (``tests/fused_kernels/test_attention.py`` measures it).

The dropout mask is an input: ``keep``, bool, ``[batch, heads, L, S]``, True where a probability
is kept. Drawn as ``torch.empty(shape, dtype=torch.bool).bernoulli_(1 - p)`` it is the mask
torch's CPU dropout draws from the same generator state (the same numbers in the same order), so
a lowered model's masks are eager's; it is a quarter of one fp32 score buffer.

Slices: ``slice_bytes`` bounds one fp32 ``[heads_in_slice, L, S]`` block (at least one head per
slice); a pass keeps three such blocks alive (:func:`scratch_bytes`).
"""
from __future__ import annotations

import math
from typing import Optional

import sympy
import torch
from torch import Tensor

from ._common import loop_vmap, once_differentiable

SLICE_BYTES = 2 * 2**20


def heads_per_slice(heads, length, keys, slice_bytes: int = SLICE_BYTES):
    """Heads computed together: as many as fit ``slice_bytes`` of fp32 ``[L, S]`` scores, at least
    one (ints or sympy expressions of them)."""
    per_head = sympy.Max(1, 4 * length * keys)
    return sympy.Min(heads, sympy.Max(1, sympy.floor(sympy.Integer(int(slice_bytes)) / per_head)))


def scratch_bytes(q_shape, k_shape, v_dim, *, low: bool, bool_mask: str, backward: bool,
                  slice_bytes: int = SLICE_BYTES):
    """Bytes a pass allocates and frees inside itself (the planner's transient at the op), for
    shapes as ints or sympy expressions; measured with the allocator by ``tests/test_scratch.py``.
    ``bool_mask``: "" (none, or a float mask), "shared" (a bool mask broadcast over heads) or
    "per_head" (one per head: its slice spans the slice's heads). Per slice, the largest of the
    moments a pass goes through (B: one fp32 block of scores; Q, K: the slice's q and k rows in
    fp32, O: its output rows):

    - the scores' product: the scaled q and k^T and the scores (B + Q + K);
    - ``_safe_softmax``: the scores, the softmax, its masked copy (3B); in backward also the
      softmax's gradient beside the probabilities and the dropped ones' gradient (3B);
    - forward, the output's product beside the dropped probabilities (B + O); backward, v's
      gradient beside both probabilities (2B + its rows), and q's and k's gradients beside the
      scores' (B + the product and its scaled copy: B + 2Q, B + 2K);

    plus, all along, a bool mask's 0 / -inf form and, for half-precision inputs, the slice's fp32
    copies of q, k, v (and of the output's gradient in backward)."""
    heads, length, dim = q_shape[-3], q_shape[-2], q_shape[-1]
    keys = k_shape[-2]
    hc = heads_per_slice(heads, length, keys, slice_bytes)
    block, q_rows, k_rows = 4 * hc * length * keys, 4 * hc * length * dim, 4 * hc * keys * dim
    if backward:
        moments = (block + q_rows + k_rows, 3 * block, 2 * block + 4 * hc * keys * v_dim,
                   block + 2 * q_rows, block + 2 * k_rows)
    else:
        moments = (block + q_rows + k_rows, 3 * block, block + 4 * hc * length * v_dim)
    total = sympy.Max(*moments) + 4 * length * keys * {"": 0, "shared": 1, "per_head": hc}[bool_mask]
    if low:
        total += q_rows + k_rows + 4 * hc * keys * v_dim + (4 * hc * length * v_dim if backward else 0)
    return total


def _check(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], keep: Optional[Tensor],
           dropout_p: float) -> None:
    where = "fxmem_kernels.attention"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: q, k, v must be [batch, heads, length, dim], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{where}: shapes do not fit: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         "(same batch and heads, k and v the same keys, q and k the same dim)")
    if isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {dropout_p!r}")
    scores = (*q.shape[:3], k.shape[2])
    if (keep is None) != (dropout_p == 0.0):
        raise ValueError(f"{where}: keep (the dropout mask) must be given exactly when dropout_p > 0")
    if keep is not None and (keep.dtype != torch.bool or tuple(keep.shape) != scores):
        raise ValueError(f"{where}: keep must be a bool tensor of shape {list(scores)}, "
                         f"got {keep.dtype} {list(keep.shape)}")
    if attn_mask is not None:
        try:
            torch.broadcast_shapes(attn_mask.shape, scores)
        except RuntimeError:
            raise ValueError(f"{where}: attn_mask of shape {list(attn_mask.shape)} does not broadcast to the "
                             f"scores' {list(scores)}") from None
        if attn_mask.dim() > 4:
            raise ValueError(f"{where}: attn_mask has more than 4 dims: {list(attn_mask.shape)}")


def _slices(q: Tensor, k: Tensor, slice_bytes: int):
    """(batch index, head slice) pairs covering the scores."""
    batch, heads, length, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    step = int(heads_per_slice(heads, length, keys, slice_bytes))
    for b in range(batch):
        for h in range(0, heads, step):
            yield b, slice(h, min(h + step, heads))


def _mask_slice(attn_mask: Optional[Tensor], b: int, h: slice, acc: torch.dtype) -> Optional[Tensor]:
    """The additive mask for one slice, as the math path forms it (bool: 0 where True, -inf else)."""
    if attn_mask is None:
        return None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    m = m[b if m.shape[0] > 1 else 0]
    m = m[h] if m.shape[0] > 1 else m
    if m.dtype == torch.bool:
        return torch.where(m, 0.0, float("-inf")).to(acc)
    return m


class _Slice:
    """One slice's operands in the compute dtype, and the math path's forward up to the probabilities."""

    def __init__(self, q, k, v, attn_mask, b, h, acc, roots):
        self.q, self.k, self.v = (t[b, h].to(acc) for t in (q, k, v))
        self.mask, (self.q_root, self.k_root) = _mask_slice(attn_mask, b, h, acc), roots

    def probabilities(self) -> Tensor:
        s = torch.matmul(self.q * self.q_root, self.k.transpose(-2, -1) * self.k_root)
        if self.mask is not None:
            s.add_(self.mask)
        return torch._safe_softmax(s, -1)


def _acc(q: Tensor) -> torch.dtype:
    return torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype


def _roots(q: Tensor, scale: Optional[float]) -> tuple[float, float]:
    """The factors of q and of k^T: ``sqrt(|scale|)`` each, q's negated for a negative scale (as
    the math path scales them)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    root = math.sqrt(abs(scale))
    return (-root if scale < 0 else root), root


# -- functional ops (what a graph pass places) ------------------------------------------------
@torch.library.custom_op("fxmem::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], keep: Optional[Tensor],
                 dropout_p: float, scale: Optional[float] = None, slice_bytes: int = SLICE_BYTES) -> Tensor:
    _check(q, k, v, attn_mask, keep, dropout_p)
    acc, roots = _acc(q), _roots(q, scale)
    drop = 1.0 / (1.0 - dropout_p)
    out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
    for b, h in _slices(q, k, slice_bytes):
        s = _Slice(q, k, v, attn_mask, b, h, acc, roots)
        p = s.probabilities()
        if keep is not None:
            p = p.mul(keep[b, h]).mul_(drop)  # native_dropout: input.mul(mask).mul_(scale)
        out[b, h] = torch.matmul(p, s.v)
        del p, s
    return out


@attention_op.register_fake
def _(q, k, v, attn_mask, keep, dropout_p, scale=None, slice_bytes=SLICE_BYTES):
    return q.new_empty((*q.shape[:3], v.shape[-1]))


@torch.library.custom_op("fxmem::attention_backward", mutates_args=())
def attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                          keep: Optional[Tensor], dropout_p: float, scale: Optional[float] = None,
                          slice_bytes: int = SLICE_BYTES) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v, each slice's probabilities recomputed."""
    _check(q, k, v, attn_mask, keep, dropout_p)
    acc, roots = _acc(q), _roots(q, scale)
    drop = 1.0 / (1.0 - dropout_p)
    gq, gk, gv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for b, h in _slices(q, k, slice_bytes):
        s = _Slice(q, k, v, attn_mask, b, h, acc, roots)
        go = grad_out[b, h].to(acc)
        p = s.probabilities()
        pd = p.mul(keep[b, h]).mul_(drop) if keep is not None else p
        gv[b, h] = torch.matmul(pd.transpose(-2, -1), go)
        del pd
        g = torch.matmul(go, s.v.transpose(-2, -1))
        if keep is not None:
            g.mul_(keep[b, h]).mul_(drop)  # native_dropout_backward: grad * mask * scale
        g = torch._softmax_backward_data(g, p, -1, acc)
        del p
        gq[b, h] = torch.matmul(g, s.k * s.k_root) * s.q_root
        # autograd's order: (q^T g)^T, not g^T q
        gk[b, h] = (torch.matmul((s.q * s.q_root).transpose(-2, -1), g) * s.k_root).transpose(-2, -1)
        del g, s
    return gq, gk, gv


@attention_backward_op.register_fake
def _(grad_out, q, k, v, attn_mask, keep, dropout_p, scale=None, slice_bytes=SLICE_BYTES):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


attention_op.register_vmap(loop_vmap(attention_op))
attention_backward_op.register_vmap(loop_vmap(attention_backward_op))


# -- eager API with autograd ------------------------------------------------------------------
class _Attention(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, attn_mask, keep, dropout_p, scale, slice_bytes):
        return attention_op(q, k, v, attn_mask, keep, dropout_p, scale, slice_bytes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, keep, ctx.dropout_p, ctx.scale, ctx.slice_bytes = inputs
        ctx.save_for_backward(q, k, v, attn_mask, keep)

    @staticmethod
    def backward(ctx, grad_out):
        once_differentiable("attention")
        q, k, v, attn_mask, keep = ctx.saved_tensors
        with torch.no_grad():
            gq, gk, gv = attention_backward_op(grad_out, q, k, v, attn_mask, keep, ctx.dropout_p, ctx.scale,
                                               ctx.slice_bytes)
        return gq, gk, gv, None, None, None, None, None


@torch.library.custom_op("fxmem::attention_dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask_op(q: Tensor, k: Tensor, dropout_p: float) -> Tensor:
    """The mask torch's CPU dropout draws for the scores of ``q`` and ``k`` (True: kept), from the
    default generator. One op, so that a graph can draw it otherwise: fxmem's Inductor path
    decomposes it into ``rand >= p`` (Inductor's seeded random numbers, as it decomposes dropout),
    unless ``fallback_random``."""
    shape = (*q.shape[:3], k.shape[2])
    return torch.empty(shape, dtype=torch.bool, device=q.device).bernoulli_(1.0 - dropout_p)


@dropout_mask_op.register_fake
def _(q, k, dropout_p):
    return q.new_empty((*q.shape[:3], k.shape[2]), dtype=torch.bool)


def dropout_mask(q: Tensor, k: Tensor, dropout_p: float, generator: Optional[torch.Generator] = None) -> Tensor:
    """The mask torch's CPU dropout would draw for the scores of ``q`` and ``k`` (True: kept)."""
    if generator is None:
        return dropout_mask_op(q, k, float(dropout_p))
    shape = (*q.shape[:3], k.shape[2])
    return torch.empty(shape, dtype=torch.bool, device=q.device).bernoulli_(1.0 - dropout_p, generator=generator)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, keep: Optional[Tensor] = None,
              dropout_p: float = 0.0, scale: Optional[float] = None, slice_bytes: int = SLICE_BYTES) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, scale=scale)`` on its math
    path, in slices of at most ``slice_bytes`` of scores. ``keep``: the dropout mask (bool, True
    where kept; :func:`dropout_mask` draws torch's), given exactly when ``dropout_p > 0``. The mask
    gets no gradient. q, k, v are ``[batch, heads, length, dim]``; portable PyTorch on any device."""
    return _Attention.apply(q, k, v, attn_mask, keep, float(dropout_p), scale, int(slice_bytes))
