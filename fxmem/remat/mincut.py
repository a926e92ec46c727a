"""The min-cut: choose the saved set of minimum bytes (plus lambda x recompute cost).

Each forward-side node ``n`` becomes an edge ``n.in -> n.out`` whose capacity is what saving ``n``
costs (its bytes at the plan shape; 0 for graph inputs, which are alive anyway; infinite for what
cannot be saved). Data edges ``u.out -> v.in`` are infinite. ``n.out -> sink`` where the backward
reads ``n``. ``source -> n.in`` is infinite where ``n`` cannot be recomputed (it must come from the
forward) and ``lam * cost(n)`` where it can: a node on the sink side is recomputed and pays its
cost. A minimum cut is a saved set; of all minimum cuts we take the one closest to the sink, i.e.
the least recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch.fx as fx
from networkx.algorithms.flow import preflow_push

from ..graph.joint import JointGraph, is_multi_output, is_sym

SOURCE, SINK = "source", "sink"


class NoPlan(ValueError):
    """The constraints leave no finite cut (something can be neither saved nor recomputed)."""


@dataclass(frozen=True)
class CutProblem:
    joint: JointGraph
    nbytes: dict[fx.Node, int]  # bytes at the plan shape
    cost: dict[fx.Node, float]  # recompute cost at the plan shape
    recomputable: frozenset[fx.Node]  # may run again in backward
    no_save: frozenset[fx.Node] = frozenset()  # must not be saved (user rules / annotations)


def _network(p: CutProblem, lam: float) -> tuple[nx.DiGraph, list[fx.Node]]:
    joint = p.joint
    nodes = [n for n in joint.gm.graph.nodes
             if n not in joint.backward and n.op in ("placeholder", "call_function") and not is_sym(n)]
    inside = set(nodes)
    g = nx.DiGraph()
    for n in nodes:
        cap = {}
        if n.op == "placeholder":
            cap = {"capacity": 0}
        elif not is_multi_output(n) and n not in p.no_save:
            cap = {"capacity": p.nbytes[n]}
        g.add_edge((n, "in"), (n, "out"), **cap)  # no capacity attribute = infinite
        if n.op == "placeholder" or (n in joint.forward and n not in p.recomputable):
            g.add_edge(SOURCE, (n, "in"))
        elif n in joint.forward:
            g.add_edge(SOURCE, (n, "in"), capacity=lam * p.cost[n])
        for u in n.users:
            if u in inside:
                g.add_edge((n, "out"), (u, "in"))
            elif u in joint.backward or u.op == "output" and n in joint.bwd_outputs:
                g.add_edge((n, "out"), SINK)
    return g, nodes


def cut(p: CutProblem, lam: float) -> tuple[list[fx.Node], float]:
    """(saved set in joint-graph order, recompute cost) of the cheapest cut at weight ``lam``."""
    g, nodes = _network(p, lam)
    if SINK not in g:
        return [], 0.0
    try:
        r = preflow_push(g, SOURCE, SINK)
    except nx.NetworkXUnbounded:
        r = None
    if r is None or r.graph["flow_value"] >= r.graph["inf"]:
        bad = [n.name for n in nodes if n in p.no_save and n not in p.recomputable]
        raise NoPlan(f"values that may not be saved cannot be recomputed either: {', '.join(bad[:8]) or '?'}")
    # Nodes that still reach the sink through residual capacity form the sink side.
    sink_side, todo = {SINK}, [SINK]
    while todo:
        v = todo.pop()
        for u in r.predecessors(v):
            e = r[u][v]
            if u not in sink_side and e["capacity"] - e["flow"] > 0:
                sink_side.add(u)
                todo.append(u)
    saved = [n for n in nodes if (n, "in") not in sink_side and (n, "out") in sink_side]
    cost = sum(p.cost.get(n, 0.0) for n in nodes if (n, "in") in sink_side and n in p.recomputable)
    return saved, cost


def solve(p: CutProblem, lam: float) -> list[fx.Node]:
    """The saved set (joint-graph order) of the cheapest cut at recompute weight ``lam``."""
    return cut(p, lam)[0]


def saved_bytes(p: CutProblem, saved) -> int:
    return sum(p.nbytes.get(n, 0) for n in saved if n.op != "placeholder")


def frontier(p: CutProblem, lo: float, hi: float, max_solves: int = 64) -> list[tuple[list[fx.Node], float]]:
    """Every distinct cheapest cut for recompute weights in [lo, hi] with a weight at which it is
    cheapest, most saved bytes first.

    Each cut's value is a line in the weight, bytes + lam * cost; the cheapest-cut value is their
    lower envelope. Eisner and Severance's search: solve where the lines of two known cuts cross;
    a cut strictly below both is a new breakpoint to search on either side of, otherwise the two
    are neighbours. ``2k - 1`` solves find ``k`` cuts (at most ``max_solves`` are made).
    """
    def at(lam):
        saved, cost = cut(p, lam)
        return saved, saved_bytes(p, saved), cost, lam

    first, last = at(lo), at(hi)
    found, todo, solves = [first, last], [(first, last)], 2
    while todo and solves < max_solves:
        a, z = todo.pop()  # a: the low weight's cut (fewer bytes, more recompute)
        if a[2] <= z[2] or a[1] >= z[1]:
            continue  # same line, or z is no cheaper to recompute: nothing between them
        lam = (z[1] - a[1]) / (a[2] - z[2])
        m = at(lam)
        solves += 1
        if m[1] + lam * m[2] >= (a[1] + lam * a[2]) * (1 - 1e-12):
            continue
        found.append(m)
        todo += [(a, m), (m, z)]
    unique = {(b, c): (s, lam) for s, b, c, lam in found}
    return [unique[k] for k in sorted(unique, key=lambda k: (-k[0], k[1]))]
