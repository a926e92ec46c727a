"""The clipping epilogue that ``fxmem.dpsgd.clipped_grad`` runs after its ``vmap(grad(...))``:
per-example norms, clip factors and the clip-weighted batch sums, as one function call.

    *sums, norms = clip_and_sum(C, weighted, *leaves[, weights])   # C: a float, or one per leaf

Dynamo does not trace into it (``allow_in_graph``): the step's Dynamo graph holds one
``clip_and_sum`` node where it would otherwise hold ~10 nodes per parameter, each a few
milliseconds of bytecode tracing at the first call. The tracers after Dynamo (``trace_flat``,
AOTAutograd's) run it as the plain PyTorch it is, so the chunk graph gets the same aten ops as
before: the two-stage norms that ``ghost.py`` matches, and each sum as the matrix-vector product
``g.reshape(B, -1).t() @ factor`` (no clipped copy of ``g``) that ``chunk.py`` makes of a
user's ``(g * factor.view(-1, 1, ...)).sum(0)``. ``epilogue.py`` knows the call: every input
is per example along dim 0, the first ``len(leaves)`` outputs are batch sums (accumulated
chunk by chunk) and the last is the per-example norms.

Clipping convention (opake's ``clip_pytree``): factor ``min(1, C / norm)`` with no additive
epsilon; the ratio gives up a few float ULPs (the storage rounding of the product and the
rounding of the norm's reduction) so that every stored clipped gradient has norm <= C, and a
gradient of norm 0 is kept as it is. Non-finite gradient elements count as 0 (as in opake), so
the clipped sum stays finite and its sensitivity C whatever one example does.
"""
from __future__ import annotations

import math

import torch

__all__ = ["clip_and_sum", "clip_factor", "example_norms", "guard"]


def guard(dtype: torch.dtype, numel: int) -> float:
    """1 minus the relative error that storing ``g * factor`` and reducing the norm in ``dtype``
    can make (opake's ``_guard_scale``): the product rounds once (eps), the norm's cascade
    reduction over ``numel`` squares rounds ~log2(numel) times (eps/2 each), halved by the sqrt."""
    eps = torch.finfo(dtype).eps
    return 1.0 - eps - (math.log2(max(numel, 2)) + 1) * eps / 2


def clip_factor(norms: torch.Tensor, clipping_norm: float, guard: float = 1.0) -> torch.Tensor:
    """``min(1, guard * C / norm)`` per example; 1 where the norm is 0 (nothing to clip)."""
    return ((clipping_norm * guard) / norms).clamp(max=1.0)


def example_norms(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """L2 norm of each example's slice of ``g`` (batch first), in two stages along the leaf's
    own dims (rows of ``[B, d1, rest]``, then over d1): no temporary the size of ``g``, and each
    reduction is short (the leaves' norms are then joined by one norm over their stack). One
    ``vector_norm`` over a flattened 500k-element row loses ~5e-6 (relative) on CPU; two stages
    lose ~1e-7, which keeps the clipped norms within C and the sums equal to a float64 reference
    to 1e-6."""
    if g.dim() == 2:
        return torch.linalg.vector_norm(g, dim=1, dtype=dtype)
    if g.dim() == 1:
        return torch.linalg.vector_norm(g[:, None], dim=1, dtype=dtype)
    rows = torch.linalg.vector_norm(g if g.dim() == 3 else g.flatten(2), dim=2, dtype=dtype)
    return torch.linalg.vector_norm(rows, dim=1)


def clip_and_sum(clipping_norm: float | tuple[float, ...], weighted: bool,
                 *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(*sums, norms)`` of the per-example gradient leaves ``tensors`` (``[B, *param]`` each;
    with ``weighted`` the last tensor is the examples' weights ``[B]``, 0 for the padding of a
    fixed-size chunk, which scale the clip factors). ``norms`` are the per-example norms before
    clipping (over all leaves); the sums are in the accumulation dtype (float32, or wider where a
    leaf is), the caller rounds them.

    ``clipping_norm`` is C (flat clipping: one factor per example from its norm over all leaves)
    or a tuple with one bound per leaf (per-layer clipping, Opacus' ``clipping="per_layer"``: each
    leaf's per-example slice is clipped to its own bound by its own norm; the example's whole
    gradient then has norm <= the L2 norm of the bounds). Each factor is still a ``[B]`` vector
    that weights one matrix-vector sum, the form ``ghost.py`` rewrites either way.

    Non-finite gradient elements count as 0 (opake's ``clip_pytree`` does the same): the norm
    and the clip factor stay finite, so one bad example cannot turn the whole sum into nan.
    Norms, clip factors and sums are taken in float32 or wider (opake promotes float16/bfloat16
    the same way): low-precision leaves are upcast one at a time, never concatenated."""
    leaves = tensors[:-1] if weighted else tensors
    leaves = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in leaves]
    acc = torch.float32
    for g in leaves:
        acc = torch.promote_types(acc, g.dtype)
    leaf_norms = [example_norms(g, acc) for g in leaves]
    norms = torch.linalg.vector_norm(torch.stack(leaf_norms, dim=1), dim=1)
    weight = tensors[-1].to(acc) if weighted else None
    if isinstance(clipping_norm, tuple):  # per layer: each leaf by its own norm and bound
        factors = [clip_factor(n, c, guard(acc, math.prod(g.shape[1:])))
                   for n, c, g in zip(leaf_norms, clipping_norm, leaves, strict=True)]
        factors = factors if weight is None else [f * weight for f in factors]
    else:  # flat: one factor for every leaf
        factor = clip_factor(norms, clipping_norm, guard(acc, sum(math.prod(g.shape[1:]) for g in leaves)))
        factors = [factor if weight is None else factor * weight] * len(leaves)
    with torch.autocast(norms.device.type, enabled=False):  # CUDA's autocast would run mv in half precision
        sums = tuple(_weighted_sum(g if g.dtype == acc else g.to(acc), f) for g, f in zip(leaves, factors))
    return (*sums, norms)


def _weighted_sum(g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``sum_i factor[i] * g[i]`` as a matrix-vector product: ``[B, n]`` directly, others
    through ``[B, -1]`` (the form ``ghost.py`` matches for a matrix gradient)."""
    if g.dim() == 2:
        return torch.mv(g.t(), factor)
    return torch.mv(g.reshape(g.shape[0], -1).t(), factor).reshape(g.shape[1:])


torch.compiler.allow_in_graph(clip_and_sum)
