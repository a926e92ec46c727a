"""Level 2's compromised plans: keep a narrower tensor than the activation itself.

Boolean masks (comparison results, dropout's) cost a byte an element; the backward can rebuild
them from a bitmask at an eighth of that. ``pack_masks`` inserts the packing after each mask the
backward reads and the unpacking before the backward's reads; the min-cut then keeps whichever
is cheaper. A dropout mask whose generator is replayed is not packed: the backward can draw it
again from a few bytes of state. Widening casts need no rewrite: the min-cut already keeps the narrower input of a
cast when the cast can be recomputed.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..graph.joint import JointGraph
from .replay import wrapped_target

aten = torch.ops.aten
_MIN_NUMEL = 1024  # smaller masks are not worth two extra kernels


def _call(graph: fx.Graph, fake_mode, target, *args, **kwargs) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with fake_mode:
        node.meta["val"] = target(*vals, **kwargs)
    return node


def _static_numel(val) -> int | None:
    return val.numel() if all(isinstance(d, int) for d in val.shape) else None


def _replayed(mask: fx.Node) -> bool:
    return mask.target is operator.getitem and wrapped_target(mask.args[0]) is not None


def pack_masks(joint: JointGraph) -> int:
    """Rewrite ``joint.gm`` in place; returns how many masks now have a bitmask to keep instead."""
    graph = joint.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    packed = 0
    for m in list(graph.nodes):
        val = m.meta.get("val")
        if (m.op not in ("call_function", "placeholder") or m in joint.backward or not isinstance(val, torch.Tensor)
                or val.dtype != torch.bool):
            continue
        numel = _static_numel(val)
        bw_users = [u for u in m.users if u in joint.backward]
        if numel is None or numel < _MIN_NUMEL or not bw_users or _replayed(m):
            continue
        fake = detect_fake_mode([val])
        pad = (-numel) % 8
        with graph.inserting_before(m.next):  # forward: pack right after the mask
            flat = _call(graph, fake, aten.reshape.default, m, [-1])
            byte = _call(graph, fake, aten._to_copy.default, flat, dtype=torch.uint8)
            padded = _call(graph, fake, aten.constant_pad_nd.default, byte, [0, pad], 0)
            groups = _call(graph, fake, aten.view.default, padded, [(numel + pad) // 8, 8])
            shifts = _call(graph, fake, aten.arange.start, 0, 8, dtype=torch.uint8, device=val.device)
            bits = _call(graph, fake, aten.bitwise_left_shift.Tensor, groups, shifts)
            pack = _call(graph, fake, aten.sum.dim_IntList, bits, [-1], dtype=torch.uint8)
        with graph.inserting_before(min(bw_users, key=order.__getitem__)):  # backward: unpack before use
            spread = _call(graph, fake, aten.unsqueeze.default, pack, -1)
            shifted = _call(graph, fake, aten.bitwise_right_shift.Tensor, spread, shifts)
            one = _call(graph, fake, aten.bitwise_and.Scalar, shifted, 1)
            flat_bits = _call(graph, fake, aten.view.default, one, [numel + pad])
            trimmed = _call(graph, fake, aten.slice.Tensor, flat_bits, 0, 0, numel)
            as_bool = _call(graph, fake, aten._to_copy.default, trimmed, dtype=torch.bool)
            mask = _call(graph, fake, aten.view.default, as_bool, list(val.shape))
        for u in bw_users:
            u.replace_input_with(m, mask)
        packed += 1
    if packed:
        graph.lint()
        joint.gm.recompile()
    return packed
