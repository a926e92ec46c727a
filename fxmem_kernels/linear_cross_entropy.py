"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` against integer
targets, and its gradients, without ever holding the ``(tokens, vocab)`` logits.

Tokens are processed in chunks whose logits fit in ``workspace_bytes``. Per chunk: the logits
(``h_c @ W^T + b``, times ``logit_scale``, optionally soft-capped), their log-sum-exp, the loss
terms, then the logits' gradient in place, ``dh_c = dlogits @ W`` and ``dW += dlogits^T @ h_c``.

- reduction "mean"/"sum": the upstream gradient is a scalar, so the forward op computes the loss
  *and* the gradients in one pass over the chunks (as Liger-Kernel does); backward only scales
  them (in place). Time stays near the three matmuls of the unfused expression.
- reduction "none": the forward op returns per-token losses and the per-row log-sum-exp; the
  backward op recomputes each chunk's logits from ``h``, ``W`` and the per-row upstream gradient.

The row-wise part (softmax statistics, loss terms, logits gradient) is a Triton kernel on CUDA
(in place on the chunk, vocab tiled with an online log-sum-exp; the matmuls stay with cuBLAS)
and lean in-place PyTorch elsewhere. Semantics are those of ``F.cross_entropy`` (``ignore_index``,
``label_smoothing``, "mean" divides by the number of non-ignored targets), plus ``logit_scale``
(Cohere/Granite), ``softcap`` (Gemma-2: ``softcap * tanh(logits / softcap)``) and ``z_loss``
(``z_loss * lse**2`` added per non-ignored token).
"""
from __future__ import annotations

import inspect
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._common import HAS_TRITON, launcher, loop_vmap, once_differentiable, take_example, use_triton

REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_WORKSPACE_BYTES = 64 * 2**20
_MAX_BLOCK_V = 4096  # vocab tile of the Triton kernel (tests lower it to exercise the loop)
_NAME = "fxmem_kernels.linear_cross_entropy"

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.standard import _elementwise_max, _sum_combine

    @triton.jit
    def _lce_rows_kernel(x_ptr, stride, t_ptr, g_ptr, loss_ptr, lse_ptr, V, ignore_index,
                         scale, softcap, eps, zc, HAS_SOFTCAP: tl.constexpr,
                         HAS_LSE: tl.constexpr, GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
        """One row of a logits chunk: raw logits in, (loss, lse) out, and with GRAD the logits'
        gradient written over the row. ``g`` is the row's upstream gradient; ``HAS_LSE`` reads
        the log-sum-exp instead of computing it (the backward recomputation)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        t = tl.load(t_ptr + row).to(tl.int32)
        valid = t != ignore_index
        if HAS_LSE:
            lse = tl.load(lse_ptr + row)
        else:
            m = float("-inf")
            s = 0.0
            sum_c = 0.0
            c_t = 0.0
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                mask = offs < V
                c = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) * scale
                if HAS_SOFTCAP:
                    # tanh(u) = 1 - 2 / (exp(2u) + 1): libdevice.tanh is not in the interpreter.
                    c = softcap * (1.0 - 2.0 / (tl.exp(2.0 * c / softcap) + 1.0))
                # tl.reduce with the standard combine functions, not tl.sum / tl.max: those
                # are @triton.jit functions the per-kernel interpreter cannot call.
                sum_c += tl.reduce(tl.where(mask, c, 0.0), 0, _sum_combine)
                c_t += tl.reduce(tl.where(offs == t, c, 0.0), 0, _sum_combine)
                c = tl.where(mask, c, float("-inf"))
                new_m = tl.maximum(m, tl.reduce(c, 0, _elementwise_max))
                s = s * tl.exp(m - new_m) + tl.reduce(tl.exp(c - new_m), 0, _sum_combine)
                m = new_m
            lse = m + tl.log(s)
            loss = lse - (1.0 - eps) * c_t - eps / V * sum_c + zc * lse * lse
            tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
            tl.store(lse_ptr + row, lse)
        if GRAD:
            gs = tl.where(valid, tl.load(g_ptr + row), 0.0) * scale
            coef = gs * (1.0 + 2.0 * zc * lse)
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                mask = offs < V
                c = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) * scale
                if HAS_SOFTCAP:
                    th = 1.0 - 2.0 / (tl.exp(2.0 * c / softcap) + 1.0)
                    c = softcap * th
                d = coef * tl.exp(c - lse) - gs * eps / V
                d -= tl.where(offs == t, gs * (1.0 - eps), 0.0)
                if HAS_SOFTCAP:
                    d = d * (1.0 - th * th)
                tl.store(base + offs, d.to(x_ptr.dtype.element_ty), mask=mask)


class _Opts(NamedTuple):
    ignore_index: int
    label_smoothing: float
    logit_scale: float
    softcap: Optional[float]
    z_loss: float
    workspace_bytes: int
    impl: str


# -- checks and sizes --------------------------------------------------------------------------
def row_bytes(v: int, dtype: torch.dtype, softcap, triton_path: bool) -> int:
    """Workspace one token row needs: the Triton path keeps the chunk's logits in the input
    dtype; the PyTorch path keeps them in fp32 (a second fp32 buffer with softcap, for the tanh
    derivative) plus, for bf16/fp16, the input-dtype matmul result / cast of the gradient."""
    size = torch.empty((), dtype=dtype).element_size()
    if triton_path:
        return v * size
    return v * 4 * (2 if softcap is not None else 1) + (v * size if dtype != torch.float32 else 0)


def _check(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, reduction: str,
           o: _Opts, logits: Optional[Tensor] = None, loss_dtype: Optional[torch.dtype] = None) -> bool:
    """Raise ValueError naming the bad argument; return whether the Triton path runs."""
    def bad(msg):
        raise ValueError(f"{_NAME}: {msg}")

    if reduction not in REDUCTIONS:
        bad(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if h.dtype not in DTYPES:
        bad(f"hidden must have a floating dtype in {DTYPES}, got {h.dtype}")
    if loss_dtype is not None and loss_dtype not in DTYPES + (torch.float64,):
        bad(f"loss_dtype must be None (hidden's dtype) or a floating dtype, got {loss_dtype}")
    if h.dim() < 1:
        bad("hidden must have shape [..., H], got a scalar")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1]:
        bad(f"weight must have shape [V, {h.shape[-1]}] (hidden's last dim), got "
            f"{list(weight.shape)}")
    if weight.dtype != h.dtype:
        bad(f"weight must have hidden's dtype {h.dtype}, got {weight.dtype}")
    v = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != v or bias.dtype != h.dtype):
        bad(f"bias must have shape [{v}] (weight's first dim) and dtype {h.dtype}, got "
            f"{list(bias.shape)} {bias.dtype}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        bad(f"target must have an integer dtype (class indices, e.g. torch.int64), got "
            f"{target.dtype}")
    if tuple(target.shape) != tuple(h.shape[:-1]):
        bad(f"target must have shape {list(h.shape[:-1])} (hidden's leading dims), got "
            f"{list(target.shape)}")
    if not 0.0 <= o.label_smoothing <= 1.0:
        bad(f"label_smoothing must be in [0, 1], got {o.label_smoothing}")
    if o.softcap is not None and not o.softcap > 0:
        bad(f"softcap must be None (off) or > 0, got {o.softcap}")
    if not math.isfinite(o.logit_scale):
        bad(f"logit_scale must be a finite float, got {o.logit_scale}")
    if not (math.isfinite(o.z_loss) and o.z_loss >= 0):
        bad(f"z_loss must be a finite float >= 0, got {o.z_loss}")
    rows = math.prod(h.shape[:-1])
    if logits is not None and (tuple(logits.shape) != (rows, v) or logits.dtype != h.dtype):
        bad(f"logits must have shape [{rows}, {v}] (hidden's rows, vocab) and dtype {h.dtype}, got "
            f"{list(logits.shape)} {logits.dtype}")
    triton_path = use_triton(o.impl, h)
    need = row_bytes(v, h.dtype, o.softcap, triton_path)
    if not isinstance(o.workspace_bytes, int) or o.workspace_bytes < need:
        bad(f"workspace_bytes={o.workspace_bytes!r} is too small for one row of {v} logits "
            f"({h.dtype}, {'triton' if triton_path else 'torch'} path): needs at least {need}")
    return triton_path


def _check_targets(t: Tensor, v: int, ignore_index: int) -> None:
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # no host sync while capturing a CUDA graph
    if (((t < 0) | (t >= v)) & (t != ignore_index)).any():
        raise ValueError(f"{_NAME}: target values must be in [0, {v}) or ignore_index="
                         f"{ignore_index}")


def _empty(like: Tensor, device=None) -> Tensor:
    return torch.empty(0, dtype=like.dtype, device=device or like.device)


def _forward_outputs(h, weight, bias, target, reduction, grads, device=None, loss_dtype=None):
    """The forward op's outputs, uninitialized: (loss, lse, dh, dW, db); a gradient not
    computed is an empty tensor; the loss in ``loss_dtype`` (None: hidden's dtype).
    ``device="meta"`` gives just their shapes and dtypes."""
    dev = device or h.device
    loss = torch.empty(target.shape if reduction == "none" else (), dtype=loss_dtype or h.dtype, device=dev)
    lse = torch.empty(target.shape, dtype=torch.float32, device=dev)
    return (loss, lse, *_grad_outputs(h, weight, bias, grads, device))


def _grad_outputs(h, weight, bias, grads, device=None):
    dev = device or h.device
    dh = torch.empty(h.shape, dtype=h.dtype, device=dev) if grads[0] else _empty(h, dev)
    dw = (torch.empty(weight.shape, dtype=weight.dtype, device=dev) if grads[1]
          else _empty(weight, dev))
    db = (torch.empty(bias.shape, dtype=bias.dtype, device=dev) if grads[2] and bias is not None
          else _empty(h, dev))
    return dh, dw, db


# -- the chunked computation ------------------------------------------------------------------
def _rows_torch(x: Tensor, y: Optional[Tensor], t: Tensor, valid: Tensor, g: Optional[Tensor],
                lse: Optional[Tensor], o: _Opts):
    """Row-wise part on an fp32 chunk ``x`` of logits, already times ``logit_scale`` (divided by
    ``softcap`` when set; ``y`` is then a second buffer). Returns (loss, lse, dlogits buffer);
    the logits' gradient (times ``g``) is written in place when ``g`` is given."""
    v, eps, zc = x.shape[1], o.label_smoothing, o.z_loss
    ts = torch.where(valid, t, 0).unsqueeze(1)
    if o.softcap is not None:
        x.tanh_()                                 # x = tanh(scale * z / softcap)
        c = torch.mul(x, o.softcap, out=y)        # capped logits
    else:
        c = x
    loss = None
    if lse is None:
        c_t = c.gather(1, ts).squeeze(1)
        sum_c = c.sum(1) if eps else None
        m = c.amax(1)  # (amax, not max: the indices would cost 5x)
    torch.ops.aten._softmax.out(c, 1, False, out=c)  # in place: probabilities, row by row
    if lse is None:
        lse = m - c.amax(1).log()  # the largest probability is exp(m - lse)
        loss = lse - (1 - eps) * c_t
        if eps:
            loss -= eps / v * sum_c
        if zc:
            loss += zc * lse * lse
        loss = torch.where(valid, loss, 0.0)
    if g is not None:
        gs = torch.where(valid, g, 0.0) * o.logit_scale
        coef = (gs * (1 + 2 * zc * lse) if zc else gs).unsqueeze(1)
        c.mul_(coef)
        if eps:
            c.sub_((gs * (eps / v)).unsqueeze(1))
        c.scatter_add_(1, ts, (gs * (eps - 1)).unsqueeze(1))
        if o.softcap is not None:
            c.mul_(x.square_().neg_().add_(1))  # d softcap(u) / du = 1 - tanh^2
    return loss, lse, c


def _rows_triton(x: Tensor, t: Tensor, g: Optional[Tensor], lse: Optional[Tensor], o: _Opts):
    """The Triton kernel on a chunk ``x`` of raw logits (input dtype), one program a row."""
    r, v = x.shape
    loss = torch.empty(r, dtype=torch.float32, device=x.device)
    has_lse = lse is not None
    lse = lse.contiguous() if has_lse else torch.empty(r, dtype=torch.float32, device=x.device)
    grad = g is not None
    gg = g.contiguous() if grad else loss  # placeholder pointer, never read
    extra = dict(num_warps=8) if x.is_cuda else {}
    launcher(_lce_rows_kernel, x)[(r,)](
        x, x.stride(0), t, gg, loss, lse, v, o.ignore_index, float(o.logit_scale),
        float(o.softcap or 1.0), float(o.label_smoothing), float(o.z_loss),
        HAS_SOFTCAP=o.softcap is not None, HAS_LSE=has_lse, GRAD=grad,
        BLOCK_V=min(_MAX_BLOCK_V, triton.next_power_of_2(v)), **extra)
    return (None if has_lse else loss), lse, x


def _addmm_fp32(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """``acc (fp32) += a @ b`` (``=`` when ``first``) with fp32 accumulation for any input dtype."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=acc) if first else acc.addmm_(a, b)
    elif a.is_cuda:
        try:  # cuBLAS: low-precision inputs, fp32 output and accumulation, no temporary
            torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, beta=0 if first else 1,
                                           out=acc)
            return
        except RuntimeError:  # builds whose out_dtype addmm wants `self` in the input dtype
            p = torch.mm(a, b)
            acc.copy_(p) if first else acc.add_(p)
    else:
        torch.mm(a.float(), b.float(), out=acc) if first else acc.addmm_(a.float(), b.float())


def _run(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, g: Optional[Tensor],
         lse_in: Optional[Tensor], o: _Opts, grads, triton_path: bool, dh, dw, db,
         logits: Optional[Tensor] = None):
    """Chunk loop shared by both ops. ``g``: per-row upstream gradient (None: loss only);
    ``lse_in``: per-row log-sum-exp (backward recomputation; no loss then); ``logits``: the
    ``[rows, V]`` logits ``h @ W^T + b`` if the caller has them (copied, not recomputed). Writes the gradients
    asked for by ``grads`` into ``dh``/``dw``/``db``; returns per-row (loss, lse) in fp32."""
    hh = h.reshape(-1, h.shape[-1])
    t = target.reshape(-1)
    n, v, dtype = hh.shape[0], weight.shape[0], h.dtype
    need_h, need_w, need_b = grads if g is not None else (False, False, False)
    if lse_in is None:
        _check_targets(t, v, o.ignore_index)
    rows = max(1, min(n, o.workspace_bytes // row_bytes(v, dtype, o.softcap, triton_path)))
    dev = h.device
    loss = torch.empty(n, dtype=torch.float32, device=dev) if lse_in is None else None
    lse = torch.empty(n, dtype=torch.float32, device=dev) if lse_in is None else None
    # fp32 accumulators (the outputs themselves when they are fp32)
    dh2 = dh.view(-1, hh.shape[1]) if need_h else None
    dw32 = None
    if need_w:
        dw32 = dw if dw.dtype == torch.float32 else torch.empty(dw.shape, device=dev)
    db32 = torch.zeros(v, device=dev) if need_b else None
    if n == 0 and need_w:
        dw32.zero_()
    buf_dtype = dtype if triton_path else torch.float32
    buf = torch.empty(rows * v, dtype=buf_dtype, device=dev)
    buf2 = (torch.empty(rows * v, device=dev)
            if o.softcap is not None and not triton_path else None)
    if triton_path:
        t = t.contiguous()
    else:
        t = t.long()
    alpha = 1.0 if triton_path else o.logit_scale / (o.softcap or 1.0)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        hc, tc = hh[s:e], t[s:e]
        x = buf[: (e - s) * v].view(e - s, v)
        # logits of the chunk: (h_c @ W^T + b) * alpha, straight into the buffer when possible
        if logits is not None:
            x.copy_(logits[s:e])
            if alpha != 1.0:
                x.mul_(alpha)
        elif x.dtype == dtype:
            if bias is not None:
                torch.addmm(bias, hc, weight.t(), beta=alpha, alpha=alpha, out=x)
            else:
                torch.addmm(x, hc, weight.t(), beta=0, alpha=alpha, out=x)
        else:  # bf16/fp16 on the PyTorch path: input-dtype matmul, fp32 row-wise math
            x.copy_(torch.addmm(bias, hc, weight.t(), beta=alpha, alpha=alpha)
                    if bias is not None else torch.mm(hc, weight.t()).mul_(alpha))
        gc = g[s:e] if g is not None else None
        lc = lse_in.reshape(-1)[s:e] if lse_in is not None else None
        if triton_path:
            loss_c, lse_c, dl = _rows_triton(x, tc, gc, lc, o)
        else:
            y = buf2[: (e - s) * v].view(e - s, v) if buf2 is not None else None
            loss_c, lse_c, dl = _rows_torch(x, y, tc, tc != o.ignore_index, gc, lc, o)
        if lse_in is None:
            loss[s:e] = loss_c
            lse[s:e] = lse_c
        if g is None:
            continue
        # dlogits (dl) is in the buffer: dh_c = dl @ W, dW += dl^T @ h_c, db += sum(dl)
        if need_h:
            torch.mm(dl if dl.dtype == dtype else dl.to(dtype), weight, out=dh2[s:e])
        if need_w:
            _addmm_fp32(dw32, dl.t(), hc if hc.dtype == dl.dtype else hc.float(), first=s == 0)
        if need_b:
            db32 += dl.sum(0, dtype=torch.float32)
    if need_w and dw32 is not dw:
        dw.copy_(dw32)
    if need_b:
        db.copy_(db32)
    return loss, lse


def _forward_grads(reduction, bias, grad_hidden, grad_weight, grad_bias) -> tuple:
    """The gradients the forward op computes: those asked for, and only for a reduced loss."""
    if reduction == "none":
        return (False, False, False)
    return (bool(grad_hidden), bool(grad_weight), bool(grad_bias) and bias is not None)


def _forward_impl(h, weight, bias, target, ignore_index=-100, label_smoothing=0.0,
                  reduction="mean", logit_scale=1.0, softcap=None, z_loss=0.0,
                  workspace_bytes=DEFAULT_WORKSPACE_BYTES, impl="auto", grad_hidden=False,
                  grad_weight=False, grad_bias=False, logits=None, loss_dtype=None, out=None):
    o = _Opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss, workspace_bytes, impl)
    triton_path = _check(h, weight, bias, target, reduction, o, logits, loss_dtype)
    grads = _forward_grads(reduction, bias, grad_hidden, grad_weight, grad_bias)
    loss_o, lse_o, dh, dw, db = out if out is not None else _forward_outputs(
        h, weight, bias, target, reduction, grads, loss_dtype=loss_dtype)
    g = None  # per-row weight of the loss in the gradients: 1/#valid for "mean", 0 if ignored
    valid = target.reshape(-1) != ignore_index
    if any(grads):
        g = valid.float()
        if reduction == "mean":
            g /= valid.sum().clamp_min(1)
    loss, lse = _run(h, weight, bias, target, g, None, o, grads, triton_path, dh, dw, db, logits)
    if reduction == "none":
        loss_o.copy_(loss.view(target.shape))
    else:
        total = loss.sum()
        loss_o.copy_(total / valid.sum() if reduction == "mean" else total)
    lse_o.copy_(lse.view(target.shape))
    return loss_o, lse_o, dh, dw, db


def _backward_impl(grad_rows, h, weight, bias, target, lse, ignore_index=-100,
                   label_smoothing=0.0, logit_scale=1.0, softcap=None, z_loss=0.0,
                   workspace_bytes=DEFAULT_WORKSPACE_BYTES, impl="auto", grad_hidden=True,
                   grad_weight=True, grad_bias=True, out=None):
    o = _Opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss, workspace_bytes, impl)
    triton_path = _check(h, weight, bias, target, "none", o)
    if tuple(grad_rows.shape) != tuple(target.shape) or tuple(lse.shape) != tuple(target.shape):
        raise ValueError(f"{_NAME}: grad_rows and lse must have target's shape "
                         f"{list(target.shape)}, got {list(grad_rows.shape)}, {list(lse.shape)}")
    grads = (grad_hidden, grad_weight, grad_bias and bias is not None)
    dh, dw, db = out if out is not None else _grad_outputs(h, weight, bias, grads)
    if any(grads):
        _run(h, weight, bias, target, grad_rows.reshape(-1).float(), lse.float(), o, grads,
             triton_path, dh, dw, db)
    return dh, dw, db


# -- functional ops (what a graph pass places) ------------------------------------------------
@torch.library.custom_op("fxmem::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
        hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
        ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
        logit_scale: float = 1.0, softcap: Optional[float] = None, z_loss: float = 0.0,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, impl: str = "auto",
        grad_hidden: bool = False, grad_weight: bool = False, grad_bias: bool = False,
        logits: Optional[Tensor] = None, loss_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dhidden, dweight, dbias). ``loss`` is reduced as ``reduction`` says, in
    ``loss_dtype`` (None: hidden's dtype; the loss is computed in fp32 either way); ``lse``
    is the per-token log-sum-exp (fp32). For "mean"/"sum" the gradients of ``loss`` flagged by
    ``grad_*`` are computed in the same pass (others, and all for "none", are empty tensors).
    ``logits``: ``hidden @ weight.T + bias`` as ``[tokens, V]``, when the caller computed them
    anyway (read chunk by chunk instead of recomputed)."""
    return _forward_impl(hidden, weight, bias, target, ignore_index, label_smoothing, reduction,
                         logit_scale, softcap, z_loss, workspace_bytes, impl, grad_hidden,
                         grad_weight, grad_bias, logits, loss_dtype)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, target, ignore_index=-100, label_smoothing=0.0, reduction="mean",
      logit_scale=1.0, softcap=None, z_loss=0.0, workspace_bytes=DEFAULT_WORKSPACE_BYTES,
      impl="auto", grad_hidden=False, grad_weight=False, grad_bias=False, logits=None, loss_dtype=None):
    o = _Opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss, workspace_bytes, impl)
    _check(hidden, weight, bias, target, reduction, o, logits, loss_dtype)
    grads = _forward_grads(reduction, bias, grad_hidden, grad_weight, grad_bias)
    return _forward_outputs(hidden, weight, bias, target, reduction, grads, loss_dtype=loss_dtype)


@torch.library.custom_op("fxmem::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
        grad_rows: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
        lse: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
        logit_scale: float = 1.0, softcap: Optional[float] = None, z_loss: float = 0.0,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, impl: str = "auto",
        grad_hidden: bool = True, grad_weight: bool = True, grad_bias: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dhidden, dweight, dbias) of ``sum(grad_rows * per_token_loss)``, recomputing
    the logits chunk by chunk from ``hidden``, ``weight`` and the forward's ``lse``. Ignored
    targets get no gradient whatever ``grad_rows`` holds. Unflagged gradients are empty."""
    return _backward_impl(grad_rows, hidden, weight, bias, target, lse, ignore_index,
                          label_smoothing, logit_scale, softcap, z_loss, workspace_bytes, impl,
                          grad_hidden, grad_weight, grad_bias)


@linear_cross_entropy_backward_op.register_fake
def _(grad_rows, hidden, weight, bias, target, lse, ignore_index=-100, label_smoothing=0.0,
      logit_scale=1.0, softcap=None, z_loss=0.0, workspace_bytes=DEFAULT_WORKSPACE_BYTES,
      impl="auto", grad_hidden=True, grad_weight=True, grad_bias=True):
    o = _Opts(ignore_index, label_smoothing, logit_scale, softcap, z_loss, workspace_bytes, impl)
    _check(hidden, weight, bias, target, "none", o)
    return _grad_outputs(hidden, weight, bias, (grad_hidden, grad_weight, grad_bias))


# -- vmap rules -----------------------------------------------------------------------------
def _plain(args) -> bool:
    return not any(isinstance(a, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(a)
                   for a in args)


def _full_args(impl, in_dims, args):
    """The vmap rule gets the op's arguments without trailing defaults: fill them in from the
    implementation's signature (the op's)."""
    params = [p for p in inspect.signature(impl).parameters.values() if p.name != "out"]
    args = tuple(args) + tuple(p.default for p in params[len(args):])
    return tuple(in_dims) + (None,) * (len(args) - len(in_dims)), args


def _loop_into(op, impl, outputs):
    """Per-example loop (as :func:`loop_vmap`) that writes each example's results straight into
    preallocated ``[B, ...]`` outputs: a per-example weight gradient is computed in place, never
    held twice. Falls back to :func:`loop_vmap` when arguments are still wrapped by other
    transforms (nested vmap, grad outside vmap)."""
    fallback = loop_vmap(op)

    def rule(info, in_dims, *args):
        in_dims, args = _full_args(impl, in_dims, args)
        if not _plain(args) or info.batch_size == 0:
            return fallback(info, in_dims, *args)
        first = outputs(*take_example(args, in_dims, 0))  # meta tensors: shapes and dtypes
        dev = next(a.device for a in args if isinstance(a, Tensor))
        outs = tuple(torch.empty((info.batch_size, *x.shape), dtype=x.dtype, device=dev)
                     if x.numel() else torch.empty(0, dtype=x.dtype, device=dev) for x in first)
        dims = tuple(0 if x.numel() else None for x in first)
        for i in range(info.batch_size):
            impl(*take_example(args, in_dims, i), out=tuple(x[i] if d == 0 else x
                                                     for x, d in zip(outs, dims)))
        return outs, dims

    return rule


def _forward_outputs_of(h, weight, bias, target, ignore_index, label_smoothing, reduction,
                        logit_scale, softcap, z_loss, workspace_bytes, impl, gh, gw, gb, logits=None,
                        loss_dtype=None):
    grads = _forward_grads(reduction, bias, gh, gw, gb)
    return _forward_outputs(h, weight, bias, target, reduction, grads, device="meta", loss_dtype=loss_dtype)


def _backward_outputs_of(grad_rows, h, weight, bias, target, lse, ignore_index,
                         label_smoothing, logit_scale, softcap, z_loss, workspace_bytes, impl,
                         gh, gw, gb):
    return _grad_outputs(h, weight, bias, (gh, gw, gb and bias is not None), device="meta")


_fwd_loop = _loop_into(linear_cross_entropy_op, _forward_impl, _forward_outputs_of)


def _forward_vmap(info, in_dims, *args):
    in_dims, args = _full_args(_forward_impl, in_dims, args)
    # Per-token losses with only the rows batched: the batch is one more row dim, one call.
    if args[6] == "none" and in_dims[1] is None and in_dims[2] is None and args[15] is None:
        args = list(args)
        for i in (0, 3):
            a, d = args[i], in_dims[i]
            args[i] = a.movedim(d, 0) if d is not None else a.expand(info.batch_size, *a.shape)
        out = linear_cross_entropy_op(*args)
        return out, (0, 0, None, None, None)
    return _fwd_loop(info, in_dims, *args)


linear_cross_entropy_op.register_vmap(_forward_vmap)
linear_cross_entropy_backward_op.register_vmap(
    _loop_into(linear_cross_entropy_backward_op, _backward_impl, _backward_outputs_of))


# -- eager API with autograd ------------------------------------------------------------------
def _scaled(t: Tensor, g: Tensor) -> Tensor:
    """``t * g``, in place where possible: ``t`` is a gradient the forward computed for this
    backward only, and a copy of a weight gradient can be as large as the weight (per example
    under vmap). A second backward through a retained graph then raises (the version check on
    the saved tensors) instead of scaling twice."""
    if torch.compiler.is_compiling():
        return t * g.to(t.dtype)
    try:
        return t.mul_(g.to(t.dtype))
    except RuntimeError:  # e.g. vmap: unbatched saved gradient times a batched upstream grad
        return t * g.to(t.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(hidden, weight, bias, target, opts, reduction, grads, logits, loss_dtype):
        return linear_cross_entropy_op(hidden, weight, bias, target, *opts[:2], reduction,
                                       *opts[2:], *grads, logits, loss_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, bias, target, ctx.opts, ctx.reduction, ctx.grads, _, _ = inputs
        loss, lse, dh, dw, db = output
        ctx.mark_non_differentiable(lse, dh, dw, db)
        ctx.save_for_backward(hidden, weight, bias, target, lse, dh, dw, db)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        once_differentiable("linear_cross_entropy")
        try:
            hidden, weight, bias, target, lse, dh, dw, db = ctx.saved_tensors
        except RuntimeError as e:
            if "inplace" not in str(e):
                raise
            raise RuntimeError(
                f"{_NAME}: a second backward through the same graph (retain_graph=True) is not "
                "supported with reduction 'mean'/'sum': the forward's gradients were scaled in "
                "place by the first; run the loss again") from None
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                ctx.needs_input_grad[2] and bias is not None)
        if ctx.reduction != "none" and all(c or not n for c, n in zip(ctx.grads, need)):
            # The forward computed the gradients of the loss: scale by the upstream scalar.
            return (_scaled(dh, grad_loss) if need[0] else None,
                    _scaled(dw, grad_loss) if need[1] else None,
                    _scaled(db, grad_loss) if need[2] else None, None, None, None, None, None, None)
        with torch.no_grad():
            g = grad_loss.float()
            if ctx.reduction == "mean":
                g = g / (target != ctx.opts[0]).sum()
            g = g.expand(target.shape)
            gh, gw, gb = linear_cross_entropy_backward_op(g, hidden, weight, bias, target, lse,
                                                          *ctx.opts, *need)
        return (gh if need[0] else None, gw if need[1] else None, gb if need[2] else None,
                None, None, None, None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                         bias: Optional[Tensor] = None, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         logit_scale: float = 1.0, softcap: Optional[float] = None,
                         z_loss: float = 0.0, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                         impl: str = "auto", logits: Optional[Tensor] = None,
                         loss_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.cross_entropy(logits, target, ...)`` with ``logits = softcap(logit_scale *
    (hidden @ weight.T + bias))`` (plus ``z_loss * logsumexp(logits)**2`` per non-ignored
    token), computed chunk by chunk without the ``[tokens, vocab]`` logits.

    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]``; ``bias``: ``[V]`` or None; ``target``:
    integer ``[...]``. ``ignore_index``, ``label_smoothing`` and ``reduction`` ("mean": over
    non-ignored targets, "sum", "none": per token, shaped like ``target``) are as in
    ``F.cross_entropy``; ``softcap=None`` is off. ``workspace_bytes`` bounds the chunk of
    logits in flight; ``impl`` picks "triton", "torch" or "auto" (see FXMEM_KERNELS_TRITON). ``logits``:
    ``hidden @ weight.T + bias`` as ``[tokens, V]`` if the caller has them anyway (e.g. to return
    them): read instead of recomputed; no gradient flows into them. ``loss_dtype``: the loss's
    dtype (None: hidden's; it is computed in fp32 either way: ``torch.float32`` keeps bf16
    inputs' loss unrounded, as ``F.cross_entropy(logits.float(), ...)`` or autocast give it). Works under
    ``torch.func.vmap``, ``grad`` and ``vmap(grad(...))``; double backward raises."""
    opts = (int(ignore_index), float(label_smoothing), float(logit_scale),
            None if softcap is None else float(softcap), float(z_loss), workspace_bytes, impl)
    _check(hidden, weight, bias, target, reduction, _Opts(*opts), logits, loss_dtype)
    on = torch.is_grad_enabled()
    grads = (on and hidden.requires_grad, on and weight.requires_grad,
             on and bias is not None and bias.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, bias, target, opts, reduction, grads,
                                     None if logits is None else logits.detach(), loss_dtype)[0]


def reference(h, w, t, b=None, *, ignore_index=-100, label_smoothing=0.0, reduction="mean",
         logit_scale=1.0, softcap=None, z_loss=0.0, **_):
    """The unfused expression the fused op computes, in fp32, written out: F.linear +
    scale/softcap + F.cross_entropy (+ z-loss on the non-ignored tokens); what the kernel's
    tests and the GPU bench compare against."""
    import torch.nn.functional as F

    z = F.linear(h.float(), w.float(), None if b is None else b.float()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z, tt = z.reshape(-1, z.shape[-1]), t.reshape(-1)
    loss = F.cross_entropy(z, tt, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="none")
    valid = tt != ignore_index
    if z_loss:
        loss = loss + torch.where(valid, z_loss * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        out = loss.view(t.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = loss.sum() / valid.sum()
    return out.to(h.dtype)
