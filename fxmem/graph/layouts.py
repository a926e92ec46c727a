"""Views that copy when the graph runs on CPU: where a CPU kernel returns another layout than
its traced (fake) value says, a later ``view`` of it cannot view, and the eager inner compiler's
``reshape`` (``inner.tolerant_views``) copies instead.

Known: CPU batch norm (forward and backward) returns its output contiguous (channels-last for a
channels-last 4-D input), where the meta function keeps the input's strides: PatchTST normalizes
a transposed ``[batch, d, seq]`` view, transposes it back and feeds it to the attention's
projections, whose ``view(-1, d)`` then copies on CPU (three copies of a layer's activations,
measured: 24 KiB of a 225 KiB step that the simulator counted as views).

:func:`mark_copies` follows the real layouts from those kernels through the ops after them (each
op rerun on meta tensors with the real layouts, until a layout agrees with the traced one again)
and marks the views that would copy (``meta["copies"] = True``): the simulator then counts them as
allocations (``liveness.is_alias``), and the dead-buffer reuse never writes into them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

COPIES = "copies"
# CPU kernels whose output 0 is laid out by the input's suggested memory format (argument index)
_SUGGESTED_FORMAT = {
    aten.native_batch_norm.default: 0,
    aten._native_batch_norm_legit.default: 0,
    aten._native_batch_norm_legit_functional.default: 0,
    aten._native_batch_norm_legit.no_stats: 0,
    aten.native_batch_norm_backward.default: 1,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _hint(d) -> int:
    if isinstance(d, torch.SymInt):
        node = d.node
        return int(node.hint if node.hint is not None else node.shape_env.size_hint(node.expr))
    return int(d)


def _meta(v: torch.Tensor, strides=None) -> torch.Tensor:
    shape = [_hint(d) for d in v.shape]
    return torch.empty_strided(shape, strides or [_hint(s) for s in v.stride()], dtype=v.dtype, device="meta")


def _suggested(v: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``v`` in the layout a CPU kernel gives it (``suggest_memory_format``)."""
    cl = v.dim() == 4 and v.is_contiguous(memory_format=torch.channels_last) and not v.is_contiguous()
    return torch.empty(v.shape, dtype=v.dtype, device="meta",
                       memory_format=torch.channels_last if cl else torch.contiguous_format)


def _same(a: Any, fake: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(fake, torch.Tensor):
        return a.stride() == tuple(_hint(s) for s in fake.stride()) or a.numel() <= 1
    if isinstance(a, (tuple, list)) and isinstance(fake, (tuple, list)) and len(a) == len(fake):
        return all(_same(x, y) for x, y in zip(a, fake))
    return True


def _arg(a: Any, real: dict[fx.Node, Any]) -> Any:
    if isinstance(a, fx.Node):
        if a in real:
            return real[a]
        v = a.meta.get("val")
        return _meta(v) if isinstance(v, torch.Tensor) else (_hint(v) if isinstance(v, torch.SymInt) else v)
    if isinstance(a, (list, tuple)):
        return type(a)(_arg(x, real) for x in a)
    return _hint(a) if isinstance(a, torch.SymInt) else a


def mark_copies(gm: fx.GraphModule) -> int:
    """Mark the views of ``gm`` that copy on CPU (see the module's docstring); returns how many."""
    real: dict[fx.Node, Any] = {}  # node -> its value's real layout (meta tensors), where it differs from the fake
    marked = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        if n.target in _SUGGESTED_FORMAT:
            x = n.args[_SUGGESTED_FORMAT[n.target]]
            xv = real.get(x, x.meta.get("val") if isinstance(x, fx.Node) else None)
            if not (isinstance(val, (tuple, list)) and isinstance(xv, torch.Tensor)
                    and isinstance(val[0], torch.Tensor) and val[0].device.type == "cpu"):
                continue
            out = [_meta(v) if isinstance(v, torch.Tensor) else v for v in val]
            out[0] = _suggested(_meta(val[0]))
            if not _same(out, val):
                real[n] = tuple(out)
            continue
        if not any(a in real for a in n.all_input_nodes):
            continue
        if n.target is operator.getitem:
            src = real[n.args[0]]
            got = src[n.args[1]] if isinstance(src, (tuple, list)) else None
        elif n.target in _VIEWS:
            src = real.get(n.args[0])
            shape = [_hint(d) for d in val.shape] if isinstance(val, torch.Tensor) else None
            if not isinstance(src, torch.Tensor) or shape is None:
                continue
            try:
                got = aten.view.default(src, shape)
            except (RuntimeError, ValueError):  # not viewable: reshape copies into a contiguous tensor
                n.meta[COPIES] = True
                marked += 1
                got = torch.empty(shape, dtype=src.dtype, device="meta")
        elif isinstance(n.target, torch._ops.OpOverload):
            try:
                got = n.target(*_arg(n.args, real), **_arg(n.kwargs, real))
            except Exception:  # noqa: BLE001 - no meta kernel for it: stop following this layout
                continue
        else:
            continue
        if got is not None and not _same(got, val):
            real[n] = got
    return marked
