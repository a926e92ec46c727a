"""Cost model: the work of recomputing a node, in FLOPs (matmul-like ops) or touched elements."""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .sizes import SymbolicSizes

log = logging.getLogger("fxmem")
aten = torch.ops.aten
# Ops torch's flop counter has no formula for, priced by one that computes the same thing (CPU
# flash attention would otherwise cost its output elements, making attention look free).
_SAME_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention}


def flops(node: fx.Node, shape: Callable[[torch.Tensor], tuple] = lambda t: tuple(t.shape)) -> float | None:
    """FLOPs of a call by torch's flop formulas (matmuls, attention, convolutions), with each
    tensor's shape given by ``shape`` (of its ``meta["val"]``); None for ops without a formula."""
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(_SAME_FLOPS.get(packet, packet))
    if node.op != "call_function" or formula is None:
        return None

    def of(arg):
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
        return shape(val) if isinstance(val, torch.Tensor) else val

    try:
        val = node.meta.get("val")
        out = shape(val[0] if isinstance(val, (tuple, list)) else val)
        return float(formula(*[of(a) for a in node.args], out_val=out, **{k: of(v) for k, v in node.kwargs.items()}))
    except Exception as e:  # a formula that wants arguments we do not shape: no figure, visibly
        log.debug("flops of %s: flop formula failed (%s: %s)", node.name, type(e).__name__, e)
        return None


def recompute_cost(node: fx.Node, sizes: SymbolicSizes) -> float:
    """FLOPs for ops torch's flop counter knows (mm, attention, conv); else output elements.

    Elementwise ops are memory-bound, so an element costs about as much time as a few FLOPs of a
    matmul on a CPU or GPU; 1 per element is the usual first-order model.
    """
    if node.op != "call_function":
        return 0.0
    f = flops(node, sizes.shape_at)
    if f is not None:
        return f
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return float(sum(math.prod(sizes.shape_at(v)) for v in vals if isinstance(v, torch.Tensor)))
