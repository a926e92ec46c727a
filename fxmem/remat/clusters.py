"""Recompute clusters, the way ONNX Runtime's memory optimizer names them.

Starting from each stashed activation (what a plain partition keeps), walk back through
recomputable ops to values that are stashed anyway, graph inputs, or ops that cannot be
recomputed. The walked subgraph is the cluster; its id is the op names in topological order,
each followed by ``+`` (``native_layer_norm+view+addmm+``). One id covers every occurrence (one a
layer, typically); occurrences are numbered in topological order of their stashed node.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from ..graph.joint import JointGraph, is_sym
from .allowlist import NEVER, kind
from .replay import wrapped_target


@dataclass(frozen=True)
class Cluster:
    id: str
    stash: fx.Node  # the activation the cluster would stop stashing
    nodes: tuple[fx.Node, ...]  # the subgraph recomputed instead, topological order


def op_name(node: fx.Node) -> str:
    target = wrapped_target(node) or node.target  # a replayed random op is named as itself
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", str(target)))


def find_clusters(joint: JointGraph, stashed: list[fx.Node]) -> list[Cluster]:
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    stops = set(stashed)
    out = []
    for s in stashed:
        if s.op != "call_function" or kind(s) == NEVER:
            continue
        seen, todo = set(), [s]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for a in n.all_input_nodes:
                if a not in stops and a.op == "call_function" and not is_sym(a) and kind(a) != NEVER:
                    todo.append(a)
        nodes = tuple(sorted(seen, key=order.__getitem__))
        cid = "".join(op_name(n) + "+" for n in nodes if n.target is not operator.getitem)
        if cid:  # a bare getitem of a kept tuple is no cluster
            out.append(Cluster(cid, s, nodes))
    return out
