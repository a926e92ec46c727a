"""The recompute planner inside a per-example chunk graph.

After AOTAutograd a ``vmap(grad(loss))`` region is one flat forward-only graph: the inner
forward, the gradient seed ``ones_like(loss)``, then the inner backward as explicit aten ops.
That is a joint graph in disguise. :func:`plan_flat` turns the seed into a tangent placeholder
(and the loss into a forward output), runs fxmem's partitioner on it (the same plan and split as
for training graphs: levels, rules, budget, report), and joins the two halves back into one
flat graph whose backward half recomputes what the plan did not keep. The seed is rebuilt from
the loss in the joined graph, so the values are the same whichever ``ones_like`` is taken.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..inputs import Inputs
from ..options import Options
from ..remat.partition import Partitioner
from .ghost import Pass as Ghost

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


def _as_joint(gm: fx.GraphModule, seed: fx.Node) -> tuple[fx.GraphModule, int, list[tuple[str, int]]]:
    """A joint-graph copy: ``seed`` becomes the tangent, outputs are (loss, forward outputs...,
    backward outputs...). Returns it, the number of forward outputs, and where each original
    output went (("fwd" | "bwd", index))."""
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
    joint = fx.GraphModule(gm, g)
    joint._fxmem_out_spec = spec
    return joint, len(fwd), where


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
    return fx.GraphModule(fw, g)


def plan_flat(gm: fx.GraphModule, options: Options, input_ids: Inputs | None = None) -> fx.GraphModule:
    """``gm`` with fxmem's recompute plan applied to its inner forward/backward, or ``gm`` itself
    when it has no gradient seed."""
    seed = find_seed(gm)
    if seed is None:
        return gm
    joint, num_fwd, where = _as_joint(gm, seed)
    partitioner = Partitioner(options, input_ids)
    fw, bw = partitioner(joint, None, num_fwd_outputs=num_fwd)
    from ..backend import COMPILES

    COMPILES.append(partitioner)
    split = partitioner.records[-1].split
    return _join(fw, bw, num_fwd, len(split.saved), where, joint._fxmem_out_spec)


def compile_chunk(gm: fx.GraphModule, example_inputs: list, options: Options):
    """AOTAutograd + the inner compiler for a chunk graph, with :func:`plan_flat` applied to
    the flat graph first. The chunk runs without an outer backward (inference). In a chunked
    graph ``memory_budget`` caps the whole step (it chooses the microbatch size), so the inner
    planner gets the level and rules only. Under ``ghost_clipping`` ghost.py rewrites the flat
    graph before the planner (and before Inductor's decompositions)."""
    from dataclasses import replace

    from torch._dynamo.backends.common import aot_autograd

    from .. import inner

    options = replace(options, memory_budget=None)
    ids = Inputs(example_inputs)  # weak: a freed chunk's ids must not match a later model
    ghost = Ghost(options, gm)  # ghost norms + book-keeping on the flat graph (ghost.py)
    materialized = lambda ins: compile_chunk(gm, ins, replace(options, ghost_clipping=False))  # noqa: E731
    if options.inner == "eager":
        def fw(g, ins):
            return inner.eager(plan_flat(ghost(g), options, ids), ins)

        return ghost.guard(aot_autograd(fw_compiler=fw, bw_compiler=inner.eager)(gm, example_inputs), materialized)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g, ins, **kwargs):
        return compile_fx_inner(plan_flat(g, options, ids), ins, **kwargs)

    if ghost.enabled:  # rewrite before Inductor's decompositions, then compile the result
        from functorch.compile import make_boxed_func

        return ghost.guard(aot_autograd(fw_compiler=lambda g, ins: make_boxed_func(compile_fx(
            ghost(g), ins, inner_compile=inner_compile)), bw_compiler=inner.eager)(gm, example_inputs), materialized)
    return compile_fx(gm, example_inputs, inner_compile=inner_compile)
