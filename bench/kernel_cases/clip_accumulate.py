"""DP-SGD clip-and-sum of per-example gradients: the parameter shapes of a small GPT.

Variants return ``(sums, norms)``; ``grad_of`` turns that into the driver's ``(loss, grads)``
(the op is not differentiable: the "gradients" compared are the clipped sums and the norms).
"unfused" is the plain expression (per-parameter norms, factor, ``(g * factor).sum(0)``: one
clipped copy per parameter); "einsum (Opacus)" is Opacus's ``DPOptimizer.clip_and_accumulate``
(``torch.einsum("i,i...", factor, g.to(float32))``); "fxmem" is
:func:`fxmem_kernels.clip_accumulate.clipped_sum`.
"""
import math

import torch

from fxmem_kernels.clip_accumulate import clipped_sum

from . import Case


def _gpt_shapes(d: int, layers: int, vocab: int, ctx: int) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),      # ln_1, attention
                   (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln_2, MLP
    return shapes + [(d,), (d,)]                                         # ln_f


def _norms(grads):
    m = grads[0].shape[0]
    per_param = [torch.linalg.vector_norm(g.reshape(m, -1), dim=-1, dtype=torch.float32)
                 for g in grads]
    return torch.stack(per_param, dim=1).norm(2, dim=1)


def _factor(norms, c):
    return (c / (norms + 1e-6)).clamp(max=1.0)


def _unfused(c):
    def run(*grads):
        norms = _norms(grads)
        f = _factor(norms, c)
        return [(g * f.view(-1, *[1] * (g.dim() - 1))).sum(0) for g in grads], norms
    return run


def _einsum(c):
    def run(*grads):
        norms = _norms(grads)
        f = _factor(norms, c)
        return [torch.einsum("i,i...", f, g.to(torch.float32)) for g in grads], norms
    return run


def _fxmem(c):
    return lambda *grads: clipped_sum(list(grads), c)


def _step(fn, inputs):
    sums, norms = fn(*inputs)
    return norms.sum(), [*sums, norms.float()]


def cases(quick: bool):
    m, d, layers, vocab, ctx = (8, 128, 2, 2048, 128) if quick else (32, 256, 2, 4096, 256)
    shapes = _gpt_shapes(d, layers, vocab, ctx)
    params = sum(math.prod(s) for s in shapes)
    c = math.sqrt(params)  # the median-ish per-example norm below: about half get clipped

    def make(dtype):
        def inputs():
            g = torch.Generator().manual_seed(0)
            scale = 0.5 + torch.rand(m, generator=g)  # per-example norms from 0.5 to 1.5 * c
            return tuple((torch.randn(m, *s, generator=g) * scale.view(-1, *[1] * len(s)))
                         .to(dtype) for s in shapes)
        return inputs

    out = []
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        if quick and dtype != torch.float32:
            continue
        out.append(Case(
            "clip_accumulate",
            f"m={m} GPT d={d} L={layers} V={vocab}: {len(shapes)} tensors, "
            f"{params / 1e6:.1f}M params, {tag}, C=sqrt(P)",
            make(dtype),
            {"unfused": _unfused(c), "einsum (Opacus)": _einsum(c), "fxmem": _fxmem(c)},
            grad_of=_step, rtol=1e-4,
            notes="not differentiable: compares the clipped sums and the norms; rtol 1e-4 "
                  "because the reference's float32 norm of a 1M-element row is off by ~1e-5 "
                  "(fxmem's, summed in runs: ~1e-7)"))
    return out
