"""Bytes an op allocates and frees inside itself, invisible as graph values, where known.

Liveness adds them as a transient allocation at the op, on top of what is alive there. Known:
fxmem's fused linear cross-entropy, which keeps a chunk of logits in flight (its workspace).
Unknown, so not counted: ATen kernels' internal buffers (e.g. the CPU attention kernel's blocks).
"""

from __future__ import annotations

from typing import Any, Callable

import sympy
import torch.fx as fx

from .sizes import dim_expr


def _arguments(node: fx.Node) -> dict[str, Any]:
    schema = node.target._schema
    return {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema.arguments)}


def _linear_cross_entropy(node: fx.Node) -> sympy.Expr:
    from fxmem_kernels._common import use_triton
    from fxmem_kernels.linear_cross_entropy import row_bytes

    a = _arguments(node)
    h, w, t = (a[k].meta["val"] for k in ("hidden", "weight", "target"))
    triton_path = h.is_cuda and use_triton(a["impl"], h)  # the path the kernel will take
    row = row_bytes(int(w.shape[0]), h.dtype, a["softcap"], triton_path)
    rows = sympy.Mul(*[dim_expr(d) for d in t.shape], sympy.Integer(1))
    return sympy.Min(rows, max(1, a["workspace_bytes"] // row)) * row


_SCRATCH: dict[str, Callable[[fx.Node], sympy.Expr]] = {
    "fxmem::linear_cross_entropy": _linear_cross_entropy,
    "fxmem::linear_cross_entropy_backward": _linear_cross_entropy,
}


def scratch_bytes(node: fx.Node) -> sympy.Expr:
    name = getattr(getattr(node.target, "overloadpacket", None), "_qualified_op_name", None)
    return _SCRATCH[name](node) if name in _SCRATCH else sympy.Integer(0)
