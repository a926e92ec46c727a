"""Fixed-size chunks of a batch, so that one compile serves every batch size (Poisson sampling).

Dynamo specializes a ``vmap``'s batch size: a step compiled for 31 examples recompiles for 33,
and after ``torch._dynamo.config.recompile_limit`` sizes it runs eagerly. ``clipped_grad`` with
``microbatch_size=m`` therefore always calls its compiled step on exactly ``m`` examples:

    for start in range(0, B, m):                       # B = 0 runs no chunk at all
        args_c, weights = pad(args, batch_argnums, start, m)   # last chunk: padded to m
        acc += step(*args_c, weights)                  # weights 1 (real) or 0 (padding)

Padding repeats the chunk's last real example (valid data for any model, finite where the real
example is); its weight 0 multiplies its clip factor, so it adds exactly 0 to the clipped sum
(sensitivity stays C), and its norm and loss are cut off the per-example outputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

__all__ = ["Accumulator", "pad", "starts"]


def starts(batch: int, m: int) -> range:
    """The first example of every chunk of ``m`` (none for an empty batch)."""
    return range(0, batch, m)


def _pad_leaf(t: Any, start: int, size: int, m: int) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    part = t.narrow(0, start, size)
    if size == m:
        return part
    fill = part[-1:].expand(m - size, *part.shape[1:])
    return torch.cat([part, fill])


def pad(args: Sequence[Any], batch_argnums: Sequence[int], start: int, size: int, m: int,
              device: torch.device) -> tuple[list[Any], torch.Tensor]:
    """``args`` with every batch argument's examples ``start .. start + size`` padded to ``m``
    (repeating the last one), and the examples' weights: ``[m]`` float32, 1 real, 0 padding."""
    out = list(args)
    for i in batch_argnums:
        out[i] = pytree.tree_map(lambda t: _pad_leaf(t, start, size, m), args[i])
    weights = torch.zeros(m, dtype=torch.float32, device=device)
    weights[:size] = 1.0
    return out, weights


class Accumulator:
    """Sums of the chunks' clipped sums (in float32 or wider, rounded to ``dtypes`` once at the
    end) and the real examples' slices of their per-example outputs (norms, losses)."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] | None = None
        self.per_example: list[list[torch.Tensor]] = []

    def add(self, sums: list[torch.Tensor], per_example: Sequence[torch.Tensor], size: int) -> None:
        if self.sums is None:
            self.sums = [s.to(torch.promote_types(s.dtype, torch.float32), copy=True) for s in sums]
            self.per_example = [[] for _ in per_example]
        else:
            for a, s in zip(self.sums, sums):
                a.add_(s)
        for parts, t in zip(self.per_example, per_example):
            parts.append(t[:size])

    def result(self, dtypes: Sequence[torch.dtype]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        sums = [a.to(d) for a, d in zip(self.sums, dtypes)]
        return sums, [torch.cat(parts) for parts in self.per_example]
