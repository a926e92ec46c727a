"""Cost model: the work of recomputing a node, in FLOPs (matmul-like ops) or touched elements."""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .sizes import SymbolicSizes

log = logging.getLogger("fxmem")
aten = torch.ops.aten
# Ops torch's flop counter has no formula for, priced by one that computes the same thing (CPU
# flash attention would otherwise cost its output elements, making attention look free).
_SAME_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention}


def _shape(arg, sizes: SymbolicSizes):
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        return sizes.shape_at(val) if isinstance(val, torch.Tensor) else val
    return arg


def recompute_cost(node: fx.Node, sizes: SymbolicSizes) -> float:
    """FLOPs for ops torch's flop counter knows (mm, attention, conv); else output elements.

    Elementwise ops are memory-bound, so an element costs about as much time as a few FLOPs of a
    matmul on a CPU or GPU; 1 per element is the usual first-order model.
    """
    if node.op != "call_function":
        return 0.0
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(_SAME_FLOPS.get(packet, packet))
    val = node.meta.get("val")
    if formula is not None:
        try:
            out = sizes.shape_at(val[0] if isinstance(val, (tuple, list)) else val)
            args = [_shape(a, sizes) for a in node.args]
            kwargs = {k: _shape(v, sizes) for k, v in node.kwargs.items()}
            return float(formula(*args, out_val=out, **kwargs))
        except Exception as e:  # a formula that wants arguments we do not shape: fall back, visibly
            log.debug("recompute cost of %s: flop formula failed (%s: %s); counting output elements",
                      node.name, type(e).__name__, e)
    vals = val if isinstance(val, (tuple, list)) else [val]
    return float(sum(math.prod(sizes.shape_at(v)) for v in vals if isinstance(v, torch.Tensor)))
