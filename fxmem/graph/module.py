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

__all__ = ["graph_module"]


def graph_module(root: torch.nn.Module | dict, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)``, its code generated at the first call."""
    return _LazyGraphModule(root, graph, class_name)
