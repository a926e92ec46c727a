"""Per-example clipping and accumulation for DP-SGD, without clipped copies.

Given per-example gradients ``grads = [g_1 [m, *shape_1], g_2 [m, *shape_2], ...]`` of several
parameters, :func:`clip_and_accumulate`

- computes each example's global L2 norm over all parameters,
  ``norm_i = sqrt(sum_k ||g_k[i]||^2)``, the squares summed in float32 (float64 for float64
  gradients) over blocks of elements and in float64 across blocks and parameters, whatever the
  gradients' dtype;
- derives the clip factor ``factor_i = min(1, C / (norm_i + eps))``: Opacus's convention
  (``(max_grad_norm / (per_sample_norms + 1e-6)).clamp(max=1.0)``, eps = 1e-6 by default).
  ``eps = 0`` gives opake's ``min(1, C / norm)`` (opake additionally shrinks the factor by its
  rounding margin and zeroes non-finite gradients; this kernel does neither: with ``eps > 0``
  the clipped norm ``C * norm / (norm + eps)`` is below ``C`` in exact arithmetic, and the
  float32 norm's rounding error may eat that margin for large norms). ``C = None`` or ``inf``
  means no clipping (factor 1: the plain sum);
- adds ``sum_i factor_i * g_k[i]`` into the float32 (or float64) accumulator of every parameter
  in place, and returns the norms ``[m]`` (float32).

It reads every gradient twice (once for the norms, once for the sum) and never writes a clipped
copy: the unfused ``(g * factor.view(-1, 1, ...)).sum(0)`` makes one of the size of ``g`` per
parameter.

Implementations (``impl``: "auto" = PyTorch, Triton on CUDA with ``FXMEM_KERNELS_TRITON=1``;
"triton" on CPU tensors runs the Triton interpreter, which the tests use):

- PyTorch. Norms: ``torch.linalg.vector_norm`` over runs of 1024 elements of the ``[m, n]``
  view, combined in float64, read in place at any strides for float32/float64 gradients (one
  float32 reduction over a million-element row is off by ~1e-5 relative, 2e-4 at a large
  stride; the runs by ~1e-7). Gradients whose trailing dims do not flatten are reduced over
  dims 2.. in place. Sums: one ``addmv_`` per parameter into the accumulator's flat view,
  ``acc.view(-1).addmv_(g.view(m, -1).t(), factor)``, which BLAS reads in place when the
  gradient has the accumulator's dtype and a row- or column-major ``[m, n]`` view. Everything
  else (bf16/fp16 gradients, float32 gradients into float64 accumulators, other layouts) is
  converted in blocks of at most ``2**20`` elements (4 MiB in float32): blocks of columns when
  the gradient flattens, else blocks of examples, one block alive at a time, so no full-size
  converted copy exists. Non-contiguous accumulators get a contiguous temporary of their size.
- Triton: a norm kernel per parameter (programs over [example block, column span] tiles, summing
  squares in float32 (float64 for float64 gradients) into per-program partials that PyTorch adds
  up in float64: deterministic, no atomics) and an accumulate kernel per parameter (each program
  a block of elements ``j``, looping over the examples: ``acc[j] += sum_i factor_i * g[i, j]``
  in the accumulator's dtype). Any strides of the ``[m, n]`` view are read in place; gradients
  that do not flatten are copied in blocks of examples as above.

Not differentiable: :func:`clip_and_accumulate` raises ``RuntimeError`` when grad mode is on
and any gradient or accumulator requires grad (detach them, or call it under
``torch.no_grad()``, where the values are used as data).

Custom ops for a compiler pass: ``fxmem::per_example_norms(Tensor[] grads, str impl) -> Tensor``
(functional) and ``fxmem::clip_accumulate_(Tensor[] grads, Tensor(a!)[] accumulators,
Tensor norms, float clipping_norm, float eps, str impl) -> ()`` (mutates the accumulators), both
with fake implementations.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ._common import HAS_TRITON, IMPLS, launcher, use_triton

_NAME = "fxmem_kernels.clip_accumulate"
_CHUNK = 1 << 20       # elements per converted block in the PyTorch path (4 MiB in float32)
_NORM_RUN = 1024       # PyTorch path: elements per float32 partial norm
_NORM_BLOCK_N = 256    # norm kernel: columns per tile (tile = BLOCK_M x BLOCK_N)
_NORM_PROGRAMS = 1024  # norm kernel: aim for about this many programs per parameter
_ACC_BLOCK = 1024      # accumulate kernel: elements per program
_ACC_DTYPES = (torch.float32, torch.float64)

if HAS_TRITON:
    import triton
    import triton.language as tl

    # tl.sum / tl.zeros are @triton.jit functions in triton 3.9, which the per-kernel
    # interpreter cannot follow; tl.full and tl.reduce with the standard sum combiner can be
    # (the interpreter maps that combiner to numpy's sum; compiled, it is exactly tl.sum).
    @triton.jit
    def _sq_norm_kernel(g_ptr, part_ptr, k, n, stride_m, stride_n, span,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """part[pid_n, i] = sum of g[i, j]^2 over this program's column span (part's dtype)."""
        pid_n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < k
        row_offs = rows.to(tl.int64) * stride_m
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, part_ptr.dtype.element_ty)
        start = pid_n * span
        for c0 in range(start, start + span, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n)[None, :]
            offs = row_offs[:, None] + (cols.to(tl.int64) * stride_n)[None, :]
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(part_ptr.dtype.element_ty)
            acc += g * g
        total = tl.reduce(acc, 1, tl.standard._sum_combine)
        tl.store(part_ptr + pid_n * k + rows, total, mask=row_mask)

    @triton.jit
    def _accumulate_kernel(g_ptr, f_ptr, acc_ptr, k, n, stride_m, stride_n,
                           BLOCK: tl.constexpr):
        """acc[j] += sum_i f[i] * g[i, j] for this program's block of j (acc's dtype)."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g_row = g_ptr + cols.to(tl.int64) * stride_n
        f_i = f_ptr
        s = tl.full([BLOCK], 0.0, acc_ptr.dtype.element_ty)
        for _ in range(0, k):
            f = tl.load(f_i).to(acc_ptr.dtype.element_ty)
            g = tl.load(g_row, mask=mask, other=0.0).to(acc_ptr.dtype.element_ty)
            s += f * g
            g_row += stride_m  # pointer arithmetic: no int32 overflow of i * stride_m
            f_i += 1
        a = tl.load(acc_ptr + cols, mask=mask)
        tl.store(acc_ptr + cols, a + s, mask=mask)


# -- argument checks --------------------------------------------------------------------------
def _check_grads(grads) -> int:
    """The number of examples ``m`` shared by all ``grads``."""
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise ValueError(f"{_NAME}: grads must be a list of per-example gradient tensors "
                         f"[m, *param_shape], got {type(grads).__name__}")
    if len(grads) == 0:
        raise ValueError(f"{_NAME}: grads is empty (need at least one per-example gradient)")
    for k, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise ValueError(f"{_NAME}: grads[{k}] is a {type(g).__name__}, not a tensor")
        if g.dim() == 0:
            raise ValueError(f"{_NAME}: grads[{k}] is a scalar; per-example gradients have a "
                             "leading example dim [m, *param_shape]")
        if not g.is_floating_point():
            raise ValueError(f"{_NAME}: grads[{k}] has dtype {g.dtype}; need a float dtype")
        if g.device != grads[0].device:
            raise ValueError(f"{_NAME}: grads[{k}] is on {g.device}, grads[0] on "
                             f"{grads[0].device}")
    m = grads[0].shape[0]
    for k, g in enumerate(grads):
        if g.shape[0] != m:
            raise ValueError(f"{_NAME}: grads[{k}] has {g.shape[0]} examples (leading dim), "
                             f"grads[0] has {m}")
    return m


def _check_accumulators(grads, accumulators) -> None:
    if isinstance(accumulators, Tensor) or not isinstance(accumulators, (list, tuple)):
        raise ValueError(f"{_NAME}: accumulators must be a list of tensors, one per gradient, "
                         f"got {type(accumulators).__name__}")
    if len(accumulators) != len(grads):
        raise ValueError(f"{_NAME}: {len(accumulators)} accumulators for {len(grads)} grads "
                         "(need one per parameter)")
    for k, (g, acc) in enumerate(zip(grads, accumulators)):
        if not isinstance(acc, Tensor):
            raise ValueError(f"{_NAME}: accumulators[{k}] is a {type(acc).__name__}, "
                             "not a tensor")
        if acc.shape != g.shape[1:]:
            raise ValueError(f"{_NAME}: accumulators[{k}] has shape {list(acc.shape)}, "
                             f"expected {list(g.shape[1:])} (grads[{k}]'s shape without the "
                             "example dim)")
        if acc.dtype not in _ACC_DTYPES:
            raise ValueError(f"{_NAME}: accumulators[{k}] has dtype {acc.dtype}; need "
                             "torch.float32 or torch.float64")
        if acc.device != g.device:
            raise ValueError(f"{_NAME}: accumulators[{k}] is on {acc.device}, grads[{k}] on "
                             f"{g.device}")


def _check_norms(norms, m: int) -> None:
    if not isinstance(norms, Tensor) or norms.shape != (m,) or norms.dtype != torch.float32:
        got = (f"{list(norms.shape)} {norms.dtype}" if isinstance(norms, Tensor)
               else type(norms).__name__)
        raise ValueError(f"{_NAME}: norms must be a float32 tensor of shape [{m}], got {got}")


def _clip_value(clipping_norm: Optional[float], eps: float) -> float:
    """``clipping_norm`` as a float (``inf`` for None); checks both."""
    c = math.inf if clipping_norm is None else float(clipping_norm)
    if not c > 0:  # also NaN
        raise ValueError(f"{_NAME}: clipping_norm must be > 0 (or None/inf for no clipping), "
                         f"got {clipping_norm!r}")
    eps = float(eps)
    if not eps >= 0 or math.isinf(eps):
        raise ValueError(f"{_NAME}: eps must be finite and >= 0, got {eps!r}")
    return c


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"fxmem_kernels: impl must be one of {IMPLS}, got {impl!r}")


# -- helpers ----------------------------------------------------------------------------------
def _numel(g: Tensor) -> int:
    return math.prod(g.shape[1:])


def _flat(g: Tensor, m: int) -> Optional[Tensor]:
    """``g`` as an ``[m, n]`` view (any strides), or None where its trailing dims do not
    flatten without a copy."""
    try:
        return g.view(m, _numel(g))
    except RuntimeError:
        return None


def _blas_ready(flat: Tensor) -> bool:
    """BLAS reads ``flat.t()`` in place (addmv makes no hidden copy): row- or column-major."""
    m, n = flat.shape
    s0 = flat.stride(0) if m > 1 else n  # the stride of a size-1 dim does not matter
    s1 = flat.stride(1) if n > 1 else m
    return (s1 == 1 and s0 >= n) or (s0 == 1 and s1 >= m)


def _blocks(g: Tensor, m: int, dtype: Optional[torch.dtype], blas: bool):
    """Yield ``(rows, cols, block)`` covering ``g`` viewed as ``[m, n]``: ``block`` is
    ``g[rows, cols]`` as a 2-D tensor of ``dtype`` (None: keep g's). One block, a view, when g
    flattens (``blas``: into a BLAS-ready view) and has the dtype already; otherwise converted
    copies of at most ``_CHUNK`` elements (columns when g flattens, else examples)."""
    n = _numel(g)
    flat = _flat(g, m)
    if flat is not None and blas and not _blas_ready(flat):
        flat = None
    if flat is not None:
        if dtype is None or flat.dtype == dtype:
            yield slice(None), slice(None), flat
            return
        step = max(1, _CHUNK // m)
        for j in range(0, n, step):
            yield slice(None), slice(j, j + step), flat[:, j:j + step].to(dtype)
        return
    step = max(1, _CHUNK // n)
    for i in range(0, m, step):
        part = g[i:i + step]
        buf = torch.empty(part.shape, dtype=dtype or g.dtype, device=g.device)
        buf.copy_(part)
        yield slice(i, i + step), slice(None), buf.view(buf.shape[0], n)
        del buf  # before the next one


def _norm_dtype(g: Tensor) -> torch.dtype:
    return torch.float64 if g.dtype == torch.float64 else torch.float32


def _factor(norms: Tensor, clipping_norm: float, eps: float) -> Tensor:
    """``min(1, C / (norm + eps))`` (all ones for ``C = inf``), float32."""
    if math.isinf(clipping_norm):
        return torch.ones_like(norms)
    return (clipping_norm / (norms + eps)).clamp_(max=1.0)


# -- PyTorch implementation -------------------------------------------------------------------
def _sq_rows(flat: Tensor) -> Tensor:
    """Squared L2 norms of the rows of a 2-D tensor, float64 ``[k]``: float32 (or float64)
    reductions over runs of ``_NORM_RUN`` elements, combined in float64 (one float32 reduction
    over a row of a million elements is off by ~1e-5 relative; runs of 1024 by ~1e-7).
    """
    k, n = flat.shape
    runs = n // _NORM_RUN
    if runs > 1:
        head = flat[:, :runs * _NORM_RUN].view(k, runs, _NORM_RUN)  # a view at any strides
        sq = torch.linalg.vector_norm(head, dim=2).double().square_().sum(1)
        if n > runs * _NORM_RUN:
            sq += torch.linalg.vector_norm(flat[:, runs * _NORM_RUN:], dim=1).double().square_()
        return sq
    return torch.linalg.vector_norm(flat, dim=1).double().square_()


def _torch_sq_norms(grads, m: int, sq: Tensor) -> None:
    for g in grads:
        dt = _norm_dtype(g)
        flat = _flat(g, m)
        if g.dtype == dt and flat is not None:  # a view, any strides
            sq += _sq_rows(flat)
        elif g.dtype == dt:  # (3-D or more) reductions over dims 2.. read any strides in place
            part = torch.linalg.vector_norm(g, dim=tuple(range(2, g.dim())))
            sq += part.double().square_().sum(1)
        else:
            for rows, _, block in _blocks(g, m, dt, blas=False):
                sq[rows] += _sq_rows(block)
                del block  # before the generator makes the next one


def _torch_accumulate(grads, accumulators, factor: Tensor, m: int) -> None:
    for g, acc in zip(grads, accumulators):
        n = _numel(g)
        if n == 0:
            continue
        f = factor.to(acc.dtype)
        target = (acc.view(n) if acc.is_contiguous()
                  else torch.zeros(n, dtype=acc.dtype, device=acc.device))
        for rows, cols, block in _blocks(g, m, acc.dtype, blas=True):
            target[cols].addmv_(block.t(), f[rows])
            del block
        if not acc.is_contiguous():
            acc.add_(target.view(acc.shape))


# -- Triton implementation --------------------------------------------------------------------
def _triton_sq_norms(grads, m: int, sq: Tensor) -> None:
    for g in grads:
        n = _numel(g)
        if n == 0:
            continue
        for rows, _, block in _blocks(g, m, None, blas=False):
            k = block.shape[0]
            block_m = min(16, triton.next_power_of_2(k))
            row_blocks = triton.cdiv(k, block_m)
            chunks = triton.cdiv(n, _NORM_BLOCK_N)
            col_programs = max(1, min(chunks, _NORM_PROGRAMS // row_blocks))
            span = triton.cdiv(chunks, col_programs) * _NORM_BLOCK_N
            programs = triton.cdiv(n, span)
            part = torch.empty(programs, k, dtype=_norm_dtype(g), device=g.device)
            launcher(_sq_norm_kernel, block)[(programs, row_blocks)](
                block, part, k, n, block.stride(0), block.stride(1), span,
                BLOCK_M=block_m, BLOCK_N=_NORM_BLOCK_N)
            sq[rows] += part.sum(0, dtype=torch.float64)
            del block


def _triton_accumulate(grads, accumulators, factor: Tensor, m: int) -> None:
    for g, acc in zip(grads, accumulators):
        n = _numel(g)
        if n == 0:
            continue
        f = factor.to(acc.dtype)
        target = acc if acc.is_contiguous() else torch.zeros(acc.shape, dtype=acc.dtype,
                                                             device=acc.device)
        for rows, _, block in _blocks(g, m, None, blas=False):
            launcher(_accumulate_kernel, block)[(triton.cdiv(n, _ACC_BLOCK),)](
                block, f[rows], target, block.shape[0], n, block.stride(0), block.stride(1),
                BLOCK=_ACC_BLOCK)
            del block
        if target is not acc:
            acc.add_(target)


# -- custom ops (what a graph pass places) ----------------------------------------------------
@torch.library.custom_op("fxmem::per_example_norms", mutates_args=())
def per_example_norms_op(grads: list[Tensor], impl: str = "auto") -> Tensor:
    """Global L2 norm ``[m]`` (float32) of each example's gradients over all parameters."""
    m = _check_grads(grads)
    sq = torch.zeros(m, dtype=torch.float64, device=grads[0].device)
    if m:
        (_triton_sq_norms if use_triton(impl, grads[0]) else _torch_sq_norms)(grads, m, sq)
    return sq.sqrt_().to(torch.float32)


@per_example_norms_op.register_fake
def _(grads, impl="auto"):
    m = _check_grads(grads)
    return grads[0].new_empty((m,), dtype=torch.float32)


@torch.library.custom_op("fxmem::clip_accumulate_", mutates_args=("accumulators",))
def clip_accumulate_op(grads: list[Tensor], accumulators: list[Tensor], norms: Tensor,
                       clipping_norm: float, eps: float, impl: str = "auto") -> None:
    """``accumulators[k] += sum_i min(1, C / (norms[i] + eps)) * grads[k][i]`` in place
    (``clipping_norm = inf``: the plain sum)."""
    m = _check_grads(grads)
    _check_accumulators(grads, accumulators)
    _check_norms(norms, m)
    c = _clip_value(clipping_norm, eps)
    if m == 0:
        return
    factor = _factor(norms, c, eps)
    (_triton_accumulate if use_triton(impl, grads[0]) else _torch_accumulate)(
        grads, accumulators, factor, m)


@clip_accumulate_op.register_fake
def _(grads, accumulators, norms, clipping_norm, eps, impl="auto"):
    m = _check_grads(grads)
    _check_accumulators(grads, accumulators)
    _check_norms(norms, m)
    _clip_value(clipping_norm, eps)
    return None


# -- eager API --------------------------------------------------------------------------------
def _no_grad_needed(grads, accumulators=()) -> None:
    if not torch.is_grad_enabled():
        return
    for what, ts in (("grads", grads), ("accumulators", accumulators)):
        for k, t in enumerate(ts):
            if t.requires_grad:
                raise RuntimeError(
                    f"{_NAME}: not differentiable, but {what}[{k}] requires grad; detach the "
                    "per-example gradients (or call it under torch.no_grad(), where they are "
                    "used as data)")


def per_example_norms(grads: Sequence[Tensor], impl: str = "auto") -> Tensor:
    """Each example's global L2 norm ``[m]`` (float32) over all per-example gradients
    ``grads[k] [m, *shape_k]``, the squares summed in float32 or better."""
    _check_grads(grads)
    _check_impl(impl)
    _no_grad_needed(grads)
    return per_example_norms_op(list(grads), impl)


def clip_and_accumulate(grads: Sequence[Tensor], accumulators: Sequence[Tensor],
                        clipping_norm: Optional[float], eps: float = 1e-6,
                        impl: str = "auto") -> Tensor:
    """DP-SGD's clip-and-sum in one pass over the per-example gradients, no clipped copies.

    ``grads[k]`` is ``[m, *shape_k]`` (any float dtype, any strides); ``accumulators[k]`` is a
    float32 or float64 tensor of ``shape_k``, to which ``sum_i factor_i * grads[k][i]`` is
    added in place, with ``factor_i = min(1, clipping_norm / (norm_i + eps))`` (Opacus's
    convention; ``norm_i`` = example ``i``'s L2 norm over all parameters). ``clipping_norm``
    None or inf: no clipping, the plain sum. Returns the norms ``[m]`` (float32). Not
    differentiable (raises if grad mode is on and an input requires grad). ``impl``: "auto"
    (see FXMEM_KERNELS_TRITON), "torch" or "triton" (the interpreter on CPU)."""
    _check_grads(grads)
    _check_accumulators(grads, accumulators)
    c = _clip_value(clipping_norm, eps)
    _check_impl(impl)
    _no_grad_needed(grads, accumulators)
    grads, accumulators = list(grads), list(accumulators)
    norms = per_example_norms_op(grads, impl)
    clip_accumulate_op(grads, accumulators, norms, c, float(eps), impl)
    return norms


def clipped_sum(grads: Sequence[Tensor], clipping_norm: Optional[float], eps: float = 1e-6,
                impl: str = "auto", dtype: torch.dtype = torch.float32
                ) -> tuple[list[Tensor], Tensor]:
    """``(sums, norms)``: :func:`clip_and_accumulate` into fresh zeroed accumulators of
    ``dtype`` (float32 by default), one per gradient, of shape ``grads[k].shape[1:]``."""
    _check_grads(grads)
    sums = [torch.zeros(g.shape[1:], dtype=dtype, device=g.device) for g in grads]
    norms = clip_and_accumulate(grads, sums, clipping_norm, eps, impl)
    return sums, norms
