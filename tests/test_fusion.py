"""Inductor's fusion as the planner models it (``fxmem.remat.fusion``): which values are never
stored, and what their readers read instead."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.graph.liveness import NodeFacts
from fxmem.remat.fusion import fused_away, fused_facts

aten = torch.ops.aten


def test_the_fusion_model_stores_no_pointwise_chain_a_kernel_can_inline():
    """``remat.fusion``: a pointwise chain read only by pointwise ops or a reduction is never
    stored (Inductor computes it inside the reader's loop); a pointwise op a matmul reads, an
    output, and a view of a stored value are stored; a reader of a fused-away op reads what that
    op read."""
    def graph(x, w):
        a = aten.mul.Tensor(x, 2.0)
        b = aten.exp.default(a)
        s = aten.sum.dim_IntList(b, [1])
        c = aten.relu.default(x)
        m = aten.mm.default(c, w)
        v = aten.view.default(aten.neg.default(x), [-1])
        return s, m, v, aten.cos.default(x)

    gm = make_fx(graph)(torch.randn(4, 4), torch.randn(4, 4))
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    outputs = gm.graph.output_node().all_input_nodes
    gone = fused_away(body, outputs)
    assert {n.name for n in gone} == {"mul", "exp"}
    facts = fused_facts(NodeFacts(gm.graph.nodes), body, gone)
    (s,) = [n for n in body if n.name == "sum_1"]
    assert [a.name for a in facts.reads[s]] == ["x_1"]
