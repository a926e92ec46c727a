"""Split a graph around its per-example region and run the region in microbatches.

    outer graph   everything that does not depend on the region (run once)
    chunk graph   the region for m examples + the per-example epilogue + each batch sum over
                  those m examples (one compiled graph per distinct chunk size: m, and the
                  remainder when m does not divide the batch)
    rest graph    what follows the batch sums (run once, on the accumulated sums)

Batch sums accumulate in fp32 across chunks; per-example graph outputs (norms, losses) are
concatenated. So the ``[batch, *param]`` per-example gradients never exist, only ``[m, *param]``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph.module import graph_module
from .epilogue import OUTER, REDUCED, Batched, Epilogue, arg_nodes
from .regions import REMOVE_BATCH_DIM, Region


@dataclass(frozen=True)
class ChunkGraph:
    """The chunk graph for m examples, and how many global norms it takes without a concat."""
    gm: fx.GraphModule
    fused_norms: int


@dataclass
class RegionSplit:
    """The three graphs and how values flow between them (node names of the original graph)."""
    region: Region
    outer: fx.GraphModule
    outer_outputs: list[str]
    chunk_inputs: list[tuple[str, int | None]]   # (outer value, in_dim to slice or None)
    partials: list[str]
    partial_dtypes: list[torch.dtype]
    chunk_batched_outputs: list[tuple[str, int]]  # (value, batch dim) concatenated across chunks
    rest: fx.GraphModule
    rest_inputs: list[str]
    rest_outputs: list[str]
    output_spec: Any                              # the graph's output structure over names
    make_chunk: Callable[[int], "ChunkGraph"] = field(repr=False, default=None)
    fused_sums: int = 0                           # clip-weighted batch sums done as matvecs


def _gm(owner: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    graph.lint()
    return graph_module(owner, graph)


def split_region(gm: fx.GraphModule, region: Region) -> RegionSplit:
    epi = Epilogue(gm.graph, region)
    kinds = epi.kinds
    inside = set(region.nodes)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    chunk_part = [n for n in gm.graph.nodes if n in inside or isinstance(kinds.get(n), Batched)
                  or n in epi.partials]
    chunk_set = set(chunk_part)
    rest_part = [n for n in gm.graph.nodes if kinds.get(n) == REDUCED and n not in epi.partials]
    outer_part = [n for n in gm.graph.nodes if kinds.get(n) == OUTER and n not in inside]

    def reads(nodes):
        return [a for n in nodes for a in arg_nodes((n.args, n.kwargs))]

    out_refs = arg_nodes(output_node.args)
    needed_outer = list(dict.fromkeys(a for a in reads(chunk_part) + reads(rest_part) + out_refs
                                      if kinds.get(a) == OUTER and a not in inside))
    # -- outer ---------------------------------------------------------------------------------
    g, env = fx.Graph(), {}
    for n in outer_part:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in needed_outer))
    outer = _gm(gm, g)

    # -- chunk (built per size) ----------------------------------------------------------------
    def slot(n: fx.Node, a: fx.Node) -> tuple[str, int | None]:
        """Which chunk input feeds ``a`` to ``n``: the batch slice for a vmap's batched input."""
        return (a.name, region.batched[n]) if n in region.batched and a is n.args[0] else (a.name, None)

    chunk_inputs = list(dict.fromkeys(slot(n, a) for n in chunk_part
                                      for a in arg_nodes((n.args, n.kwargs)) if a not in chunk_set))
    batched_outputs = [n for n in chunk_part if isinstance(kinds.get(n), Batched)
                       and any(u is output_node for u in n.users)]
    batch_args = set(epi.batch_shape_args)
    fused = {p: f for p in epi.partials if (f := _weighted_sum(p, kinds)) is not None}
    skipped = {p.args[0] for p in fused}

    def make_chunk(m: int) -> ChunkGraph:
        g, env = fx.Graph(), {}
        slots = {key: g.placeholder(f"{key[0]}_chunk" if key[1] is not None else key[0])
                 for key in chunk_inputs}
        for n in chunk_part:
            if n in skipped:
                continue
            if n in fused:
                env[n] = _emit_matvec(g, env, *fused[n], m)
                continue
            new = g.node_copy(n, lambda a, n=n: env[a] if a in env else slots[slot(n, a)])
            if n is region.start:
                new.args = (m, *new.args[1:])
            elif n.target is REMOVE_BATCH_DIM and n in region.outputs:
                new.args = (new.args[0], new.args[1], m, new.args[3])
            elif n in batch_args:
                new.args = _with_leading(new.args, m)
            env[n] = new
        g.output(tuple(env[p] for p in epi.partials) + tuple(env[n] for n in batched_outputs))
        fused_norms = _split_cat_norms(g)
        return ChunkGraph(_gm(gm, g), fused_norms)

    by_name = {n.name: n for n in gm.graph.nodes}
    # -- rest ----------------------------------------------------------------------------------
    g, env = fx.Graph(), {}
    rest_inputs = list(dict.fromkeys(
        [p.name for p in epi.partials]
        + [a.name for a in reads(rest_part) if kinds.get(a) == OUTER and a not in inside]))
    for name in rest_inputs:
        env[by_name[name]] = g.placeholder(name)
    for n in rest_part:
        env[n] = g.node_copy(n, lambda a: env[a])
    rest_outputs = [n.name for n in rest_part if any(u is output_node for u in n.users)]
    g.output(tuple(env[by_name[name]] for name in rest_outputs))
    rest = _gm(gm, g)

    spec = fx.node.map_arg(output_node.args[0], lambda n: n.name)
    return RegionSplit(region, outer, [n.name for n in needed_outer], chunk_inputs,
                 [p.name for p in epi.partials],
                 [p.meta["example_value"].dtype for p in epi.partials],
                 [(n.name, kinds[n].dim) for n in batched_outputs],
                 rest, rest_inputs, rest_outputs, spec, make_chunk, len(fused) + epi.matvec_sums)


def _with_leading(args: tuple, m: int) -> tuple:
    """``view``/``reshape`` args with the leading (batch) size replaced by ``m``."""
    if len(args) == 2 and isinstance(args[1], (tuple, list)):
        return (args[0], (m, *args[1][1:]))
    return (args[0], m, *args[2:])


_MULS = {operator.mul, torch.mul}


def _weighted_sum(node: fx.Node, kinds: dict):
    """``(g * f.view(-1, 1, ...)).sum(0)`` with ``g`` per example ``[B, *s]`` and ``f`` a per-example
    scalar ``[B]`` (the clip factor): returns ``(g, f)``, else None. As a matvec
    ``g.reshape(B, -1).t() @ f`` it needs no clipped copy of ``g``."""
    if not (node.op == "call_method" and node.target == "sum") or node.kwargs.get("keepdim"):
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    mul = node.args[0]
    if dims not in (0, (0,), [0]) or len(mul.users) != 1 or not (
            (mul.op == "call_function" and mul.target in _MULS and not mul.kwargs)
            or (mul.op == "call_method" and mul.target == "mul")):
        return None
    for g, fv in (mul.args, mul.args[::-1]):
        if not (isinstance(g, fx.Node) and isinstance(fv, fx.Node)):
            return None
        if not (fv.op == "call_method" and fv.target in ("view", "reshape")
                and kinds.get(g) == Batched(0)):
            continue
        f = fv.args[0]
        gv, fval, out = (x.meta.get("example_value") for x in (g, f, node))
        if (isinstance(fval, torch.Tensor) and fval.dim() == 1 and kinds.get(f) == Batched(0)
                and gv.dim() >= 1 and all(s == 1 for s in fv.meta["example_value"].shape[1:])
                and gv.dtype == fval.dtype == out.dtype):
            return g, f
    return None


def _emit_matvec(graph: fx.Graph, env: dict, g: fx.Node, f: fx.Node, m: int) -> fx.Node:
    shape = tuple(g.meta["example_value"].shape[1:])
    rows = graph.call_method("reshape", (env[g], m, -1))
    mv = graph.call_function(torch.mv, (graph.call_method("t", (rows,)), env[f]))
    return graph.call_method("reshape", (mv, shape))


_NORMS = {torch.linalg.vector_norm, torch._C._linalg.linalg_vector_norm}


def _split_cat_norms(graph: fx.Graph) -> int:
    """``vector_norm(cat([g1.reshape(m, -1), g2...], 1), dim=1)`` -> ``sqrt(sum_i norm(g_i)^2)``:
    the same per-example global norm without an ``[m, P]`` copy of every gradient."""
    count = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target in _NORMS):
            continue
        cat = node.args[0]
        extra = set(node.kwargs) - {"dim"} or len(node.args) > 1
        if extra or node.kwargs.get("dim") not in (1, -1, (1,), [1]) or not (
                isinstance(cat, fx.Node) and cat.op == "call_function" and cat.target is torch.cat):
            continue
        parts, dim = cat.args[0], cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
        if dim not in (1, -1) or len(cat.users) != 1:
            continue
        with graph.inserting_before(node):
            squares = [graph.call_method("pow", (graph.call_function(
                torch.linalg.vector_norm, (p,), {"dim": 1, "dtype": torch.float32}), 2)) for p in parts]
            total = graph.call_function(torch.stack, (squares,), {"dim": 1})
            norm = graph.call_method("sqrt", (graph.call_method("sum", (total, 1)),))
            val = node.meta.get("example_value")
            if isinstance(val, torch.Tensor) and val.dtype != torch.float32:
                norm = graph.call_method("to", (norm, val.dtype))
        node.replace_all_uses_with(norm)
        graph.erase_node(node)
        graph.erase_node(cat)
        count += 1
    return count
