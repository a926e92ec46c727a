"""Find per-example regions in a Dynamo graph: a ``vmap`` (over a ``grad``) appears as
``_vmap_increment_nesting(B, randomness)`` ... ``_vmap_decrement_nesting()``, its batched inputs
as ``_add_batch_dim(x, in_dim, level)`` and its outputs as ``_remove_batch_dim(y, level, B,
out_dim)``. Everything between the two nesting calls computes each example independently by
construction, so the region can run over any slice of the batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch._dynamo.exc import ShortenTraceback
from torch._functorch import predispatch

_INC, _DEC = predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting
ADD_BATCH_DIM, REMOVE_BATCH_DIM = predispatch._add_batch_dim, predispatch._remove_batch_dim


class Unsupported(ShortenTraceback):  # a RuntimeError
    """The graph cannot be chunked; the message says why (it goes into the report). Raised to
    the user only under ``strict=True``, as itself (a ShortenTraceback, so Dynamo does not wrap
    it)."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.first_useful_frame = None


@dataclass
class Region:
    start: fx.Node                    # _vmap_increment_nesting
    end: fx.Node                      # _vmap_decrement_nesting
    batch_size: int | fx.Node         # the literal, or the SymInt node carrying it
    nodes: list[fx.Node]              # start..end, graph order
    batched: dict[fx.Node, int]       # _add_batch_dim node -> in_dim of the value it batches
    outputs: list[fx.Node]            # _remove_batch_dim nodes (out_dim 0)


def find_regions(graph: fx.Graph) -> list[Region]:
    """The outermost vmap regions of ``graph``, in order (nested vmaps stay inside theirs)."""
    regions, depth, start, body = [], 0, None, []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _INC:
            depth += 1
            if depth == 1:
                start, body = node, []
        if depth:
            body.append(node)
        if node.op == "call_function" and node.target is _DEC:
            depth -= 1
            if depth == 0:
                regions.append(_region(start, node, body))
    return regions


def _region(start: fx.Node, end: fx.Node, body: list[fx.Node]) -> Region:
    size = start.args[0]  # an int, or a SymInt node (dynamic batch: Poisson-sampled DP-SGD)
    if not isinstance(size, (int, fx.Node)):
        raise Unsupported(f"the vmap batch size {size!r} is neither a constant nor a graph value")
    level = None
    batched, outputs = {}, []
    inside = set(body)
    for node in body:
        if node.target is ADD_BATCH_DIM:
            _, in_dim, lvl = node.args
            if level is None:
                level = lvl
            if lvl == level:
                batched[node] = in_dim
        elif node.target is REMOVE_BATCH_DIM and node.args[1] == level:
            if node.args[3] != 0:
                raise Unsupported(f"vmap out_dims={node.args[3]}; only out_dims=0 is chunked")
            outputs.append(node)
    if not batched:
        raise Unsupported("the vmap region has no batched input")
    for node in body:
        for user in node.users:
            if user not in inside and node not in outputs and node is not end:
                raise Unsupported(f"{node.name} is used outside the vmap region without _remove_batch_dim")
    return Region(start, end, size, body, batched, outputs)
