"""``graph_module``: a GraphModule that writes its Python code only when it is run or read.

fxmem's passes build several GraphModules per compile (the joint copy, the forward and
backward halves, the ghost rewrite's copy, the rejoined chunk graph) that are only read as
graphs; generating and ``compile()``-ing Python for each of them was most of the time those
passes spent outside the planner itself. torch's ``_LazyGraphModule`` (what Inductor's passes
use) defers that until the module is called or its ``code`` read; it is a GraphModule in every
other respect.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["copied", "graph_module"]


def graph_module(root: torch.nn.Module | dict, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)``, its code generated at the first call."""
    return _LazyGraphModule(root, graph, class_name)


def copied(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm``'s graph (new nodes, their metadata shared; the output's descriptors kept)
    over the same submodules, and the map from ``gm``'s nodes to the copy's: for a pass that
    must leave the original as it is."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out).meta = dict(gm.graph.output_node().meta)  # the outputs' descriptors
    return graph_module(gm, graph), env
