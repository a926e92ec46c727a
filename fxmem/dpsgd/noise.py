"""Gaussian noise for DP-SGD: ``add_noise(grads, noise_multiplier, clipping_norm)``."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .clipping import check_clipping_norm

__all__ = ["add_noise"]


def add_noise(grads: Any, noise_multiplier: float, clipping_norm: float,
              generator: torch.Generator | None = None) -> Any:
    """``grads`` (a pytree of tensors, e.g. :func:`clipped_grad`'s sum) plus independent
    Gaussian noise of standard deviation ``noise_multiplier * clipping_norm`` on every element:
    the Gaussian mechanism for a sum of sensitivity ``clipping_norm``. Returns a new pytree of
    the same structure; ``grads`` is not modified.

    ``generator``: a ``torch.Generator`` on the tensors' device, for reproducible noise (the
    leaves draw from it in pytree order). Noise for float16/bfloat16 leaves is drawn and added in
    float32, then rounded once.
    """
    if (isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, numbers.Real)
            or not math.isfinite(noise_multiplier) or noise_multiplier < 0):
        raise ValueError(f"add_noise: noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    C = check_clipping_norm(clipping_norm, "add_noise")
    if not math.isfinite(C):
        raise ValueError("add_noise: clipping_norm must be finite "
                         "(the noise scale is noise_multiplier * clipping_norm)")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"add_noise: generator must be a torch.Generator or None, got {generator!r}")
    std = float(noise_multiplier) * C
    leaves, spec = pytree.tree_flatten(grads)
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise ValueError("add_noise: grads holds no tensor")
    out = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        if not t.is_floating_point():
            raise ValueError(f"add_noise: grads must be floating point, got a {t.dtype} tensor")
        out.append(noised_(t.to(_work(t), copy=True), std, generator).to(t.dtype))
    return pytree.tree_unflatten(out, spec)


def _work(t: torch.Tensor) -> torch.dtype:
    """The dtype noise is drawn and added in: float32 for half types, else the tensor's."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def noised_(t: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``t`` plus Gaussian noise of std ``std``, in place where ``t`` is in its working dtype
    (float32 for half types: then a float32 copy); the numbers :func:`add_noise` gives (the same
    draw from ``generator``, the same products and sums). For sums that are the caller's own
    (``DPSGD.step``): no second set of gradient-sized tensors."""
    if generator is not None and torch.device(generator.device).type != t.device.type:
        raise ValueError(f"add_noise: generator is on {generator.device}, a tensor on {t.device}")
    t = t.to(_work(t))
    return t.add_(torch.randn(t.shape, generator=generator, dtype=t.dtype, device=t.device).mul_(std))
