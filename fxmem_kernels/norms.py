"""LayerNorm and RMSNorm over the last dim that keep only ``x`` and per-row statistics.

    layer_norm(x, weight=None, bias=None, eps=1e-5) = (x - mean) * rstd * weight + bias
    rms_norm(x, weight=None, eps=1e-6, offset=0.0)   = x * rsqrt(mean(x^2) + eps) * (offset + w)

The forward ops return the output and fp32 per-row statistics (``mean``/``rstd`` for LayerNorm,
``rstd`` for RMSNorm, shaped ``x.shape[:-1]``); the backward ops compute ``dx`` and the parameter
gradients from ``x``, the weight and those statistics only, so no normalized activation is kept.

Numerics follow Hugging Face's modules for low-precision inputs:
- ``offset == 0`` (Llama): ``weight * (x.float() * rstd).to(x.dtype)``, the multiplication in
  the promoted dtype of ``x`` and ``weight`` (an fp32 weight gives an fp32 output, as in HF).
- ``offset != 0`` (Gemma, ``offset=1.0``): ``(x.float() * rstd * (offset + weight.float()))``
  cast once to ``x.dtype``.
Without a weight ``offset`` has nothing to shift: the output is ``x * rstd`` in ``x.dtype``.

Triton: row-block programs (``BLOCK_M`` rows of ``next_power_of_2(H)`` columns each); the
backward kernels run a fixed number of programs over contiguous row ranges and write per-program
partial sums of ``dweight``/``dbias`` that PyTorch reduces (Liger's scheme). The portable path:
LayerNorm calls aten's ``native_layer_norm``/``native_layer_norm_backward`` (fused, keeping only
mean/rstd; fp32 parameters are handed in for 16-bit inputs so that the statistics stay fp32);
RMSNorm runs in row chunks with fp32 scratch buffers of bounded size, so 16-bit inputs are never
upcast whole.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._common import HAS_TRITON, launcher, loop_vmap, once_differentiable, rowwise_vmap, use_triton

_MAX_BLOCK_N = 65536     # widest row a Triton program holds (Liger's limit)
_CHUNK_ELEMS = 1 << 16   # portable RMSNorm: elements per row chunk on CPU (fp32 scratch ~256 KiB)
_CHUNK_ELEMS_GPU = 1 << 24

if HAS_TRITON:
    import triton
    import triton.language as tl

    # The kernels reduce with ``tl.reduce(v, axis, tl.standard._sum_combine)``, which is what
    # ``tl.sum`` does for fp32 values: ``tl.sum`` is itself a @triton.jit function, which the
    # per-kernel interpreter (``_common.launcher``) cannot call, while the interpreter maps a
    # reduction with ``_sum_combine`` straight onto ``numpy.sum``. For the same reason the
    # kernels use ``tl.full`` (a builtin), not ``tl.zeros`` (a @triton.jit function).

    @triton.jit
    def _ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, h, eps,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < n_rows
        cmask = cols < h
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * h + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.reduce(x, 1, tl.standard._sum_combine) / h
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.reduce(xc * xc, 1, tl.standard._sum_combine) / h
        rstd = 1.0 / tl.sqrt(var + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + rows, mean.to(mean_ptr.dtype.element_ty), mask=rmask)
        tl.store(rstd_ptr + rows, rstd.to(rstd_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _ln_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows,
                       h, rows_per_prog, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < h
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            w = tl.full((BLOCK_N,), 1.0, tl.float32)
        dw_acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        db_acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, n_rows)
        for start in range(row_start, row_end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < row_end
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * h + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = dy * w[None, :]
            c1 = tl.reduce(xhat * wdy, 1, tl.standard._sum_combine) / h
            c2 = tl.reduce(wdy, 1, tl.standard._sum_combine) / h
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                dw_acc += tl.reduce(dy * xhat, 0, tl.standard._sum_combine)
            if HAS_B:
                db_acc += tl.reduce(dy, 0, tl.standard._sum_combine)
        if HAS_W:
            tl.store(dw_ptr + pid * h + cols, dw_acc, mask=cmask)
        if HAS_B:
            tl.store(db_ptr + pid * h + cols, db_acc, mask=cmask)

    @triton.jit
    def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, h, eps, offset,
                        HAS_W: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < n_rows
        cmask = cols < h
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * h + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, tl.standard._sum_combine) / h + eps)
        y = x * rstd[:, None]
        if CAST:  # Llama: round the normalized row to the input dtype before the weight
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y * (offset + w)[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd.to(rstd_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _rms_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, h, rows_per_prog,
                        offset, HAS_W: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < h
        if HAS_W:
            w = offset + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            w = tl.full((BLOCK_N,), 1.0, tl.float32)
        dw_acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, n_rows)
        for start in range(row_start, row_end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < row_end
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * h + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            xhat = x * rstd[:, None]
            wdy = dy * w[None, :]
            c = tl.reduce(wdy * xhat, 1, tl.standard._sum_combine) / h
            dx = (wdy - xhat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                if CAST:  # the weight multiplied the rounded normalized row
                    xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
                dw_acc += tl.reduce(dy * xhat, 0, tl.standard._sum_combine)
        if HAS_W:
            tl.store(dw_ptr + pid * h + cols, dw_acc, mask=cmask)


# -- shared helpers ---------------------------------------------------------------------------
def _own(t: Tensor, shape) -> Tensor:
    """``t.view(shape)`` as a tensor autograd does not take for a view (``aten._unsafe_view``): an
    op's output that is a view of its own temporary would be a view "created inside a custom
    Function" once a compiled graph returns it, and a later graph that updates it in place
    (SwitchTransformers' router jitter, ``hidden_states *= noise``) would fail."""
    return torch.ops.aten._unsafe_view(t, shape)


def _check(name: str, x: Tensor, eps: float, **params: Optional[Tensor]) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"fxmem_kernels.{name}: x must have a non-empty last dim, "
                         f"got shape {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"fxmem_kernels.{name}: x must be a floating-point tensor, got {x.dtype}")
    for pname, p in params.items():
        if p is not None and (p.dim() != 1 or p.shape[0] != x.shape[-1]):
            raise ValueError(f"fxmem_kernels.{name}: {pname} must have shape [{x.shape[-1]}] "
                             f"(x's last dim), got {list(p.shape)}")
    if not eps > 0:  # also rejects NaN
        raise ValueError(f"fxmem_kernels.{name}: eps must be > 0, got {eps!r}")


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype of the per-row statistics and of the portable path's arithmetic."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rms_out_dtype(x: Tensor, weight: Optional[Tensor], offset: float) -> torch.dtype:
    if weight is not None and offset == 0.0:  # Llama: weight * normalized.to(x.dtype)
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _blocks(h: int, name: str) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of ``h`` elements."""
    block_n = triton.next_power_of_2(h)
    if block_n > _MAX_BLOCK_N:
        raise ValueError(f"fxmem_kernels.{name}: the Triton kernels take rows of at most "
                         f"{_MAX_BLOCK_N} elements, got {h}; use impl='torch'")
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = 4 if block_n < 2048 else 8 if block_n < 8192 else 16 if block_n < 32768 else 32
    return block_m, block_n, num_warps


def _bwd_programs(n_rows: int, block_m: int, x: Tensor) -> tuple[int, int]:
    """(programs, rows per program) for the backward kernels: a fixed number of programs (a few
    per SM on CUDA, a few in the interpreter) so that the partial sums stay small."""
    tiles = triton.cdiv(n_rows, block_m)
    cap = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    rows_per_prog = triton.cdiv(tiles, min(tiles, cap)) * block_m
    return triton.cdiv(n_rows, rows_per_prog), rows_per_prog


def _use_triton(impl: str, x: Tensor) -> bool:
    # "auto" falls back to PyTorch for rows wider than a Triton program holds.
    return use_triton(impl, x) and (impl == "triton" or x.shape[-1] <= _MAX_BLOCK_N)


def _grad_or_none(p: Optional[Tensor], x: Tensor, n_programs: int) -> Tensor:
    if p is None:
        return x.new_empty(0)
    return torch.empty(n_programs, p.shape[0], dtype=torch.float32, device=x.device)


# -- LayerNorm: functional ops ----------------------------------------------------------------
def _ln_fwd_triton(x, weight, bias, eps):
    h = x.shape[-1]
    x2 = x.contiguous().view(-1, h)
    n = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(n, dtype=_stat_dtype(x), device=x.device)
    rstd = torch.empty_like(mean)
    if n:
        bm, bn, nw = _blocks(h, "layer_norm")
        launcher(_ln_fwd_kernel, x)[(triton.cdiv(n, bm),)](
            x2, weight.contiguous() if weight is not None else x2,
            bias.contiguous() if bias is not None else x2, y, mean, rstd, n, h, eps,
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=nw)
    return _own(y, x.shape), _own(mean, x.shape[:-1]), _own(rstd, x.shape[:-1])


def _ln_params(x, weight, bias):
    """Parameters in the dtype aten's kernels want: fp32 for 16-bit ``x`` (aten's "mixed type"
    path, whose statistics are fp32; with 16-bit parameters the CPU kernel rounds its saved
    statistics to 16 bits), else ``x``'s dtype."""
    comp = _stat_dtype(x)
    if x.dtype in (torch.float16, torch.bfloat16):
        w = weight.to(comp) if weight is not None else torch.ones(x.shape[-1], dtype=comp,
                                                                  device=x.device)
        return w, bias.to(comp) if bias is not None else None
    return (weight.to(x.dtype) if weight is not None else None,
            bias.to(x.dtype) if bias is not None else None)


@torch.library.custom_op("fxmem::layer_norm", mutates_args=())
def layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5,
                  impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim: ``(y, mean, rstd)``, the statistics fp32 (fp64 for fp64
    ``x``) and shaped ``x.shape[:-1]``."""
    _check("layer_norm", x, eps, weight=weight, bias=bias)
    if _use_triton(impl, x):
        return _ln_fwd_triton(x, weight, bias, eps)
    w, b = _ln_params(x, weight, bias)
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)
    stat = _stat_dtype(x)
    return y, _own(mean.to(stat), x.shape[:-1]), _own(rstd.to(stat), x.shape[:-1])


@layer_norm_op.register_fake
def _(x, weight, bias, eps=1e-5, impl="auto"):
    stat = x.new_empty(x.shape[:-1], dtype=_stat_dtype(x))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stat, torch.empty_like(stat)


@torch.library.custom_op("fxmem::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(grad_y: Tensor, x: Tensor, weight: Optional[Tensor],
                           bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
                           impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` from ``x``, the weight and the saved ``mean``/``rstd``; a
    parameter that is None gets an empty gradient (shape [0]). ``bias`` is only read for its
    presence and dtype."""
    _check("layer_norm", x, 1.0, weight=weight, bias=bias)
    h = x.shape[-1]
    if _use_triton(impl, x):
        x2 = x.contiguous().view(-1, h)
        n = x2.shape[0]
        dx = torch.empty_like(x2)
        bm, bn, nw = _blocks(h, "layer_norm")
        progs, rows_per_prog = _bwd_programs(n, bm, x) if n else (0, 0)
        dw, db = _grad_or_none(weight, x, progs), _grad_or_none(bias, x, progs)
        if n:
            launcher(_ln_bwd_kernel, x)[(progs,)](
                grad_y.to(x.dtype).contiguous().view(-1, h), x2,
                weight.contiguous() if weight is not None else x2, mean.contiguous(),
                rstd.contiguous(), dx, dw, db, n, h, rows_per_prog, HAS_W=weight is not None,
                HAS_B=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
        dw = dw.sum(0).to(weight.dtype) if weight is not None else dw
        db = db.sum(0).to(bias.dtype) if bias is not None else db
        return _own(dx, x.shape), dw, db
    w, b = _ln_params(x, weight, bias)
    stats = (*x.shape[:-1], 1)
    stat = _stat_dtype(x)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad_y.to(x.dtype), x, [h], mean.to(stat).reshape(stats), rstd.to(stat).reshape(stats), w,
        b, [True, weight is not None, bias is not None])
    dw = dw.to(weight.dtype) if weight is not None else x.new_empty(0)
    db = db.to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx, dw, db


@layer_norm_backward_op.register_fake
def _(grad_y, x, weight, bias, mean, rstd, impl="auto"):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight) if weight is not None else x.new_empty(0),
            torch.empty_like(bias) if bias is not None else x.new_empty(0))


layer_norm_op.register_vmap(rowwise_vmap(layer_norm_op, row_args=(0,)))
# The loop keeps dweight/dbias per example under vmap(grad(...)).
layer_norm_backward_op.register_vmap(loop_vmap(layer_norm_backward_op))


# -- RMSNorm: functional ops ------------------------------------------------------------------
def _chunk_rows(x2: Tensor) -> int:
    return max(1, (_CHUNK_ELEMS_GPU if x2.is_cuda else _CHUNK_ELEMS) // x2.shape[1])


def _rms_fwd_torch(x, weight, eps, offset):
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    n = x2.shape[0]
    comp = _stat_dtype(x)
    cast = offset == 0.0 and x.dtype != comp  # Llama's rounding before the weight
    y2 = torch.empty(n, h, dtype=_rms_out_dtype(x, weight, offset), device=x.device)
    rstd = torch.empty(n, dtype=comp, device=x.device)
    scale = None
    if weight is not None:
        scale = weight if cast else weight.to(comp) + offset  # offset == 0 under cast
    step = min(_chunk_rows(x2), max(n, 1))
    scratch = torch.empty(step, h, dtype=comp, device=x.device)
    upcast = torch.empty(step, h, dtype=comp, device=x.device) if x.dtype != comp else None
    for r0 in range(0, n, step):
        m = min(step, n - r0)
        xf = x2[r0:r0 + m] if upcast is None else upcast[:m].copy_(x2[r0:r0 + m])
        direct = y2.dtype == comp and not cast  # write straight into the output
        t = y2[r0:r0 + m] if direct else scratch[:m]
        r = rstd[r0:r0 + m]
        torch.mean(torch.mul(xf, xf, out=t), -1, out=r)
        r.add_(eps).rsqrt_()
        torch.mul(xf, r[:, None], out=t)
        if cast and scale is not None:
            torch.mul(t.to(x.dtype), scale, out=y2[r0:r0 + m])
        elif scale is not None:
            if direct:
                t.mul_(scale)
            else:
                torch.mul(t, scale, out=y2[r0:r0 + m])
        elif not direct:
            y2[r0:r0 + m].copy_(t)
    return _own(y2, x.shape), _own(rstd, x.shape[:-1])


def _rms_bwd_torch(grad_y, x, weight, rstd, offset):
    h = x.shape[-1]
    x2, g2 = x.reshape(-1, h), grad_y.reshape(-1, h)
    n = x2.shape[0]
    comp = _stat_dtype(x)
    cast = offset == 0.0 and x.dtype != comp
    rstd = rstd.reshape(-1).to(comp)
    dx2 = torch.empty(n, h, dtype=x.dtype, device=x.device)
    dw = torch.zeros(h, dtype=comp, device=x.device) if weight is not None else None
    scale = weight.to(comp) + offset if weight is not None else None
    step = min(_chunk_rows(x2), max(n, 1))
    t_buf = torch.empty(step, h, dtype=comp, device=x.device) if x.dtype != comp else None
    u_buf = torch.empty(step, h, dtype=comp, device=x.device)
    x_up = torch.empty(step, h, dtype=comp, device=x.device) if x.dtype != comp else None
    g_up = torch.empty(step, h, dtype=comp, device=x.device) if g2.dtype != comp else None
    for r0 in range(0, n, step):
        m = min(step, n - r0)
        xf = x2[r0:r0 + m] if x_up is None else x_up[:m].copy_(x2[r0:r0 + m])
        gf = g2[r0:r0 + m] if g_up is None else g_up[:m].copy_(g2[r0:r0 + m])
        r = rstd[r0:r0 + m, None]
        u = u_buf[:m]
        if dw is not None:  # dweight += sum over rows of g * normalized x
            torch.mul(xf, r, out=u)
            if cast:
                u.copy_(u.to(x.dtype))
            dw.add_(u.mul_(gf).sum(0))
        t = dx2[r0:r0 + m] if t_buf is None else t_buf[:m]  # dh = g * (offset + weight)
        if scale is not None:
            torch.mul(gf, scale, out=t)
        else:
            t.copy_(gf)
        # dx = rstd * (dh - x * rstd^2 * mean(dh * x))
        c = torch.mul(t, xf, out=u).mean(-1, keepdim=True).mul_(r * r)
        t.addcmul_(xf, c, value=-1).mul_(r)
        if t_buf is not None:
            dx2[r0:r0 + m].copy_(t)
    dw = dw.to(weight.dtype) if weight is not None else x.new_empty(0)
    return _own(dx2, x.shape), dw


@torch.library.custom_op("fxmem::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6, offset: float = 0.0,
                impl: str = "auto") -> tuple[Tensor, Tensor]:
    """RMSNorm over the last dim: ``(y, rstd)``, ``rstd`` fp32 (fp64 for fp64 ``x``) and shaped
    ``x.shape[:-1]``. See the module docstring for the output dtype."""
    _check("rms_norm", x, eps, weight=weight)
    if not _use_triton(impl, x):
        return _rms_fwd_torch(x, weight, eps, offset)
    h = x.shape[-1]
    x2 = x.contiguous().view(-1, h)
    n = x2.shape[0]
    y = torch.empty(n, h, dtype=_rms_out_dtype(x, weight, offset), device=x.device)
    rstd = torch.empty(n, dtype=_stat_dtype(x), device=x.device)
    if n:
        bm, bn, nw = _blocks(h, "rms_norm")
        launcher(_rms_fwd_kernel, x)[(triton.cdiv(n, bm),)](
            x2, weight.contiguous() if weight is not None else x2, y, rstd, n, h, eps, offset,
            HAS_W=weight is not None, CAST=offset == 0.0 and weight is not None,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    return _own(y, x.shape), _own(rstd, x.shape[:-1])


@rms_norm_op.register_fake
def _(x, weight, eps=1e-6, offset=0.0, impl="auto"):
    return (x.new_empty(x.shape, dtype=_rms_out_dtype(x, weight, offset)),
            x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)))


@torch.library.custom_op("fxmem::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                         offset: float = 0.0, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` from ``x``, the weight and the saved ``rstd``; ``dweight`` is empty
    (shape [0]) without a weight."""
    _check("rms_norm", x, 1.0, weight=weight)
    if not _use_triton(impl, x):
        return _rms_bwd_torch(grad_y, x, weight, rstd, offset)
    h = x.shape[-1]
    x2 = x.contiguous().view(-1, h)
    n = x2.shape[0]
    dx = torch.empty_like(x2)
    bm, bn, nw = _blocks(h, "rms_norm")
    progs, rows_per_prog = _bwd_programs(n, bm, x) if n else (0, 0)
    dw = _grad_or_none(weight, x, progs)
    if n:
        launcher(_rms_bwd_kernel, x)[(progs,)](
            grad_y.contiguous().view(-1, h), x2, weight.contiguous() if weight is not None else x2,
            rstd.contiguous(), dx, dw, n, h, rows_per_prog, offset, HAS_W=weight is not None,
            CAST=offset == 0.0 and weight is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    dw = dw.sum(0).to(weight.dtype) if weight is not None else dw
    return _own(dx, x.shape), dw


@rms_norm_backward_op.register_fake
def _(grad_y, x, weight, rstd, offset=0.0, impl="auto"):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight) if weight is not None else x.new_empty(0))


rms_norm_op.register_vmap(rowwise_vmap(rms_norm_op, row_args=(0,)))
rms_norm_backward_op.register_vmap(loop_vmap(rms_norm_backward_op))


# -- eager API with autograd ------------------------------------------------------------------
class _LayerNorm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps, impl):
        return layer_norm_op(x, weight, bias, eps, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, _, ctx.impl = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)  # no zero gradients for the statistics
        ctx.save_for_backward(x, weight, bias, mean, rstd)

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_rstd):
        once_differentiable("layer_norm")
        if grad_y is None:
            return None, None, None, None, None
        x, weight, bias, mean, rstd = ctx.saved_tensors
        with torch.no_grad():
            dx, dw, db = layer_norm_backward_op(grad_y, x, weight, bias, mean, rstd, ctx.impl)
        return (dx, dw if weight is not None else None, db if bias is not None else None,
                None, None)


class _RMSNorm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, eps, offset, impl):
        return rms_norm_op(x, weight, eps, offset, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, ctx.offset, ctx.impl = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, output[1])

    @staticmethod
    def backward(ctx, grad_y, _grad_rstd):
        once_differentiable("rms_norm")
        if grad_y is None:
            return None, None, None, None, None
        x, weight, rstd = ctx.saved_tensors
        with torch.no_grad():
            dx, dw = rms_norm_backward_op(grad_y, x, weight, rstd, ctx.offset, ctx.impl)
        return dx, dw if weight is not None else None, None, None, None


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5, impl: str = "auto") -> Tensor:
    """``F.layer_norm(x, x.shape[-1:], weight, bias, eps)`` that keeps ``x`` and fp32 per-row
    mean/rstd for backward. Works under ``torch.func.vmap`` and ``vmap(grad(...))``; ``impl``
    picks "triton", "torch" or "auto" (see FXMEM_KERNELS_TRITON)."""
    _check("layer_norm", x, eps, weight=weight, bias=bias)
    use_triton(impl, x)  # validates impl
    return _LayerNorm.apply(x, weight, bias, float(eps), impl)[0]


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, offset: float = 0.0,
             impl: str = "auto") -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim (``offset=1.0`` is
    Gemma's form; ``offset=0`` matches HF ``LlamaRMSNorm`` bit for bit in 16-bit dtypes) that
    keeps ``x`` and fp32 per-row rstd for backward. Works under ``torch.func.vmap`` and
    ``vmap(grad(...))``; ``impl`` picks "triton", "torch" or "auto" (see FXMEM_KERNELS_TRITON)."""
    _check("rms_norm", x, eps, weight=weight)
    use_triton(impl, x)
    return _RMSNorm.apply(x, weight, float(eps), float(offset), impl)[0]
