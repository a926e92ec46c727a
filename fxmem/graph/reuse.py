"""The eager inner compiler's buffer reuse: an analysis and a rewrite of an fx graph.

An elementwise op whose argument's storage dies at it may write its result into that argument
(``add(a, b)`` -> ``add_(a, b)`` when nothing reads ``a`` later), as a real compiler does.
:func:`dead_writes` says which ops may; :func:`reuse_dead_buffers` rewrites a graph module so,
and the step simulator (:func:`.liveness.walk`) applies the same analysis to the node lists it
walks, so that what it simulates is what the eager inner compiler runs.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Sequence

import torch
import torch.fx as fx

from .inplace import COMMUTATIVE, INPLACE, INTO_FIRST
from .liveness import last_reads, storage_roots
from .sizes import definitely


def _fresh_contiguous(val, like) -> bool:
    return (isinstance(val, torch.Tensor) and isinstance(like, torch.Tensor) and val.dtype == like.dtype
            and definitely(lambda: val.shape == like.shape and val.is_contiguous() and like.is_contiguous()))


def _broadcasts_to(b, a: fx.Node) -> bool:
    if not isinstance(b, fx.Node):
        return False
    vb, va = b.meta.get("val"), a.meta.get("val")
    if not isinstance(vb, torch.Tensor):
        return False
    try:
        return torch.broadcast_shapes(vb.shape, va.shape) == va.shape
    except RuntimeError:
        return False


def write_candidates(n: fx.Node) -> list[tuple[fx.Node, Any]]:
    """``(a, b)``: an argument ``n`` may write its result into and the operand beside it, in the
    order :func:`dead_writes` tries them, where shapes, dtypes and layouts allow (whether ``a``'s
    storage dies at ``n`` is the graph's to say)."""
    pairs = []
    if n.op == "call_function" and n.target in INTO_FIRST:  # (its other operands may have any shape)
        a = n.args[0]
        return [(a, n.args[1])] if isinstance(a, fx.Node) and _fresh_contiguous(n.meta.get("val"), a.meta.get("val")) \
            else []
    elif n.op == "call_function" and n.target in INPLACE and len(n.args) == 2:
        a, b = n.args
        pairs = [(a, b)] + ([(b, a)] if n.target in COMMUTATIVE and not n.kwargs else [])  # x + y == y + x, bitwise
    return [(a, b) for a, b in pairs
            if isinstance(a, fx.Node) and _fresh_contiguous(n.meta.get("val"), a.meta.get("val"))
            and (isinstance(b, (int, float)) or _broadcasts_to(b, a))]


_SCATTERS = {torch.ops.aten.index_put.default: 2, torch.ops.aten._unsafe_masked_index_put_accumulate.default: 3}


def scatter_candidates(n: fx.Node) -> list[tuple[fx.Node, Any]]:
    """``(a, values)`` for an accumulating scatter into ``a`` (``index_put(a, ..., accumulate=True)``,
    the masked form torch decomposes an embedding's gradient into): what Inductor re-inplaces
    where ``a`` dies there, as the tied embedding's gradient scattered into the head's
    (``remat.fences.scatter_into_sums``). Inductor's write reuse as far as the simulator models it."""
    if n.op != "call_function" or n.target not in _SCATTERS:
        return []
    if n.target is torch.ops.aten.index_put.default and not (len(n.args) > 3 and n.args[3] is True):
        return []
    a, values = n.args[0], n.args[_SCATTERS[n.target]]
    return [(a, values)] if isinstance(a, fx.Node) and _fresh_contiguous(n.meta.get("val"), a.meta.get("val")) else []


def dead_writes(body: Sequence[fx.Node], root: Mapping[fx.Node, fx.Node], last: Mapping[fx.Node, int],
                pos: Mapping[fx.Node, int], ran: Collection[fx.Node],
                candidates: Callable[[fx.Node], list] = write_candidates) -> dict[fx.Node, tuple[fx.Node, Any]]:
    """Node -> ``(a, b)``: the argument it writes its result into and the operand beside it.

    ``a``'s storage (``root``) must have been allocated by the graph (an op in ``ran``, not an
    input: the caller may hold it), every node viewing it must be read no later than here
    (``last``: storage -> position of its last read; ``pos``: node -> position), ``b`` must not
    view it, and the result must have ``a``'s shape, dtype and contiguous layout; not a view that
    the simulator counts as a copy (``layouts.mark_copies``: were it a view after all, the write
    would reach its source)."""
    written = {}
    for n in body:
        for a, b in candidates(n):
            r = root[a]
            if (r in ran and r.op == "call_function" and last.get(r) == pos[n] and not r.meta.get("copies")
                    and not (isinstance(b, fx.Node) and root[b] is r)):
                written[n] = (a, b)
                break
    return written


def reuse_dead_buffers(gm: fx.GraphModule) -> int:
    """Turn ``c = op(a, b)`` into ``c = op_(a, b)`` where ``a``'s storage dies at this node
    (:func:`dead_writes`). Returns how many ops were rewritten."""
    nodes = list(gm.graph.nodes)
    root = storage_roots(gm)
    written = dead_writes(nodes, root, last_reads(gm, root), {n: i for i, n in enumerate(nodes)}, set(nodes))
    for n, (a, b) in written.items():
        if n.target in INTO_FIRST:
            n.target = INTO_FIRST[n.target]
        else:
            n.target, n.args = INPLACE[n.target], (a, b)
    if written:
        gm.recompile()
    return len(written)
