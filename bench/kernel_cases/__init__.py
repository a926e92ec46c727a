"""Kernel benchmark cases: one module per kernel family, each with ``cases(quick) -> [Case]``.

A Case builds its inputs once and names several variants of the same computation; the first
variant is the reference (the unfused PyTorch expression). Every variant is a function of the
inputs that returns a scalar loss; ``bench/fused_kernels.py`` runs forward + backward of each, checks
the loss and the gradients against the reference, and measures peak memory and time side by
side.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Case:
    family: str
    name: str                                   # shape and options, e.g. "N=4096 H=256 V=32768 fp32"
    make_inputs: Callable[[], tuple]            # tensors that need grad have requires_grad set
    variants: dict[str, Callable[..., torch.Tensor]]  # first = reference
    rtol: float = 1e-5
    atol: float = 1e-6
    grad_of: Callable | None = None             # custom step: returns (loss, grads); e.g. vmap(grad)
    notes: str = ""
    targets: dict = field(default_factory=dict)  # e.g. {"peak_ratio": 0.15, "time_ratio": 1.3}


def all_cases(quick: bool = False, families: list[str] | None = None) -> list[Case]:
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if families and info.name not in families:
            continue
        out += importlib.import_module(f"{__name__}.{info.name}").cases(quick)
    return out
