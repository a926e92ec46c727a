"""A loop's per-iteration slice gradients written into one buffer, in the joint graph.

A loop over a sequence (a selective scan, an RNN written in plain PyTorch) reads one slice of a
whole-sequence tensor per iteration (``dA[:, :, t]``); the gradient of each read is
``select_backward(g_t, sizes, dim, t)``, a full-size buffer of zeros with ``g_t`` in slot ``t``,
and autograd sums them: ``acc = acc + select_backward(g_t, ...)``, once per iteration. Eager
autograd adds each one into its buffer in place, but still allocates the full-size zeros every
iteration; in the traced graph every iteration holds the sum, the new full-size summand and the
new sum. On a tiny Jamba (bench/studies/outside_zoo.py) two such sums (the scan's ``dA`` and
``dB*u``) made the step's peak, in the scan's backward, 1.02x eager's.

:func:`accumulate_slice_gradients` rewrites each sum of slice gradients over distinct slots into
``acc = select_scatter(acc, g_t, dim, t)``: the same values (a slot is written once, onto
zeros), one full-size buffer per sum, written in place by the eager inner compiler where the
previous sum dies there (``graph.inplace.INTO_FIRST``), as the simulator counts it.

Only the undecomposed op is matched: Inductor's joint graph holds torch's decomposition (a
``select_scatter`` into zeros), which Inductor re-inplaces itself.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.inplace import sum_into

aten = torch.ops.aten


_GRADS = {aten.select_backward.default: 4, aten.slice_backward.default: 6}  # op -> its arity


def _slot(n: object) -> tuple[tuple, tuple[int, int]] | None:
    """``(key, (start, end))`` of a ``select_backward`` or a step-1 ``slice_backward`` read only
    once, with a concrete slot; else None. Its key: the full size, the dimension, the dtype
    (summands with the same key fill one buffer)."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and _GRADS.get(n.target) == len(n.args)
            and len(n.users) == 1):
        return None
    v = n.meta.get("val")
    dim = n.args[2]
    if not (isinstance(v, torch.Tensor) and isinstance(dim, int)):
        return None
    dim = dim % v.dim()
    size = v.shape[dim]
    if not isinstance(size, int):  # a symbolic length: the slot's place is not known here
        return None
    if n.target is aten.select_backward.default:
        index = n.args[3]
        if not isinstance(index, int):
            return None
        start = index % size
        end = start + 1
    else:
        _, _, _, start, end, step = n.args
        if step != 1 or not (isinstance(start, int) and isinstance(end, int)):
            return None
        start, end = (min(max(i + size if i < 0 else i, 0), size) for i in (start, end))
        if start >= end:
            return None
    return (tuple(str(s) for s in n.args[1]), dim, v.dtype), (start, end)


def _overlaps(slot: tuple[int, int], covered: set[int]) -> bool:
    return any(i in covered for i in range(*slot))


def _scatter(acc: fx.Node, summand: fx.Node, start: int, end: int) -> tuple:
    """The scatter that writes ``summand``'s gradient into ``acc``: (op, args)."""
    g, _, dim = summand.args[:3]
    if summand.target is aten.select_backward.default:
        return aten.select_scatter.default, (acc, g, dim, start)
    return aten.slice_scatter.default, (acc, g, dim, start, end, 1)


def accumulate_slice_gradients(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: ``add(acc, select_backward(g, sizes, dim, t))`` (either order), where
    ``acc`` is a ``select_backward`` of the same full size, dimension and dtype or such a sum, and
    slot ``t`` is not yet filled in it -> ``select_scatter(acc, g, dim, t)``. Returns how many sums
    were rewritten."""
    filled: dict[fx.Node, tuple[tuple, set[int]]] = {}  # a buffer of slice gradients -> (key, the indices filled)
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        leaf = _slot(n)
        if leaf is not None:
            filled[n] = (leaf[0], set(range(*leaf[1])))
            continue
        if n.target is not aten.add.Tensor or n.kwargs or len(n.args) != 2:
            continue
        out = n.meta.get("val")
        for acc, summand in (n.args, n.args[::-1]):
            leaf = _slot(summand)
            if leaf is None or acc not in filled or filled[acc][0] != leaf[0] or _overlaps(leaf[1], filled[acc][1]):
                continue
            va = acc.meta.get("val")
            if not (isinstance(out, torch.Tensor) and isinstance(va, torch.Tensor) and va.shape == out.shape
                    and va.dtype == out.dtype):
                continue
            key, slots = filled[acc]
            slots = slots if len(acc.users) == 1 else set(slots)
            new = sum_into(gm, n, summand, *_scatter(acc, summand, *leaf[1]))
            filled.pop(summand, None)
            slots.update(range(*leaf[1]))
            filled[new] = (key, slots)
            count += 1
            break
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
