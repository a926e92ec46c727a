"""The recompute planner inside a flat per-example chunk graph.

After AOTAutograd a ``vmap(grad(loss))`` region is one flat forward-only graph: the inner
forward, the gradient seed ``ones_like(loss)``, then the inner backward as explicit aten ops.
That is a joint graph in disguise. :func:`plan_flat` turns the seed into a tangent placeholder
(and the loss into a forward output), runs fxmem's partitioner on it (the same plan and split as
for training graphs: levels, rules, budget, report), and joins the two halves back into one
flat graph whose backward half recomputes what the plan did not keep. The seed is rebuilt from
the loss in the joined graph, so the values are the same whichever ``ones_like`` is taken.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph.module import graph_module
from ..remat.partition import Partitioner

__all__ = ["find_seed", "plan_flat"]

aten = torch.ops.aten


def _descendants(graph: fx.Graph, root: fx.Node) -> set[fx.Node]:
    out = {root}
    for n in graph.nodes:
        if any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def find_seed(gm: fx.GraphModule) -> fx.Node | None:
    """The gradient seed: a ``ones_like`` whose descendants reach the graph's outputs."""
    outputs = set(pytree.arg_tree_leaves(*gm.graph.output_node().args))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.ones_like.default:
            if _descendants(gm.graph, n) & outputs:
                return n
    return None


def _as_joint(gm: fx.GraphModule, seed: fx.Node) -> tuple[fx.GraphModule, int, list[tuple[str, int]], Any]:
    """A joint-graph copy: ``seed`` becomes the tangent, outputs are (loss, forward outputs...,
    backward outputs...). Returns it, the number of forward outputs, where each original
    output went (("fwd" | "bwd", index)) and the original outputs' structure."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = g.node_copy(n)
    tangent = g.placeholder("tangents_seed")
    tangent.meta = dict(seed.meta)
    env[seed] = tangent
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n is seed:
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    backward = _descendants(gm.graph, seed)
    (outs,) = gm.graph.output_node().args
    flat, spec = pytree.tree_flatten(outs)
    fwd, bwd, where = [env[seed.args[0]]], [], []
    for o in flat:
        if isinstance(o, fx.Node) and o in backward:
            where.append(("bwd", len(bwd)))
            bwd.append(env[o])
        else:
            where.append(("fwd", len(fwd)))
            fwd.append(env[o] if isinstance(o, fx.Node) else o)
    g.output(tuple(fwd + bwd))
    g.lint()
    return graph_module(gm, g), len(fwd), where, spec


def _join(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd: int, n_tensors: int, where, spec) -> fx.GraphModule:
    """One graph: ``fw``, then ``bw`` fed with fw's saved values and ``ones_like(loss)``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in fw.graph.nodes:
        if n.op != "output":
            env[n] = g.node_copy(n, lambda a: env[a])
    (fw_out,) = fw.graph.output_node().args
    fw_vals = [env[o] if isinstance(o, fx.Node) else o for o in fw_out]
    # fw returns (forward outputs, saved tensors, saved SymInts); bw takes (SymInts, tensors, seed).
    fwd, tensors, syms = fw_vals[:num_fwd], fw_vals[num_fwd:num_fwd + n_tensors], fw_vals[num_fwd + n_tensors:]
    bw_inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    seed = g.call_function(aten.ones_like.default, (fwd[0],))
    assert len(bw_inputs) == len(tensors) + len(syms) + 1, "one tangent: the seed"
    benv = dict(zip(bw_inputs, [*syms, *tensors, seed]))
    for n in bw.graph.nodes:
        if n.op not in ("placeholder", "output"):
            benv[n] = g.node_copy(n, lambda a: benv[a])
    (bw_out,) = bw.graph.output_node().args
    bwd = [benv[o] if isinstance(o, fx.Node) else o for o in bw_out]
    flat = [fwd[i] if side == "fwd" else bwd[i] for side, i in where]
    g.output(pytree.tree_unflatten(flat, spec))
    g.lint()
    return graph_module(fw, g)


def plan_flat(gm: fx.GraphModule, partitioner: Partitioner) -> fx.GraphModule:
    """``gm`` with ``partitioner``'s recompute plan applied to its inner forward/backward, or
    ``gm`` itself when it has no gradient seed."""
    seed = find_seed(gm)
    if seed is None:
        return gm
    joint, num_fwd, where, spec = _as_joint(gm, seed)
    fw, bw = partitioner(joint, None, num_fwd_outputs=num_fwd)
    return _join(fw, bw, num_fwd, _saved_tensors(fw, num_fwd), where, spec)


def _saved_tensors(fw: fx.GraphModule, num_fwd: int) -> int:
    """How many saved tensors ``fw`` returns after its ``num_fwd`` outputs (then SymInts)."""
    saved = fw.graph.output_node().args[0][num_fwd:]
    return sum(not isinstance(o.meta.get("val"), torch.SymInt) for o in saved)
