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
import numpy as np
import scipy.sparse as sp
import torch.fx as fx
from networkx.algorithms.flow import edmonds_karp, preflow_push
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

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


def _edges(p: CutProblem) -> tuple[list, list[fx.Node]]:
    """The network's edges ``(u, v, bytes, cost)``: capacity ``bytes + lam * cost``, infinite where
    both are None (a source edge carries only ``cost``, a node's own edge only ``bytes``)."""
    joint = p.joint
    nodes = [n for n in joint.gm.graph.nodes
             if n not in joint.backward and n.op in ("placeholder", "call_function") and not is_sym(n)]
    inside = set(nodes)
    edges = []
    for n in nodes:
        cap = None
        if n.op == "placeholder":
            cap = 0
        elif not is_multi_output(n) and n not in p.no_save:
            cap = p.nbytes[n]
        edges.append(((n, "in"), (n, "out"), cap, None))
        if n.op == "placeholder" or (n in joint.forward and n not in p.recomputable):
            edges.append((SOURCE, (n, "in"), None, None))
        elif n in joint.forward:
            edges.append((SOURCE, (n, "in"), None, p.cost[n]))
        for u in n.users:
            if u in inside:
                edges.append(((n, "out"), (u, "in"), None, None))
            elif u in joint.backward or u.op == "output" and n in joint.bwd_outputs:
                edges.append(((n, "out"), SINK, None, None))
    return list({(u, v): (u, v, b, c) for u, v, b, c in edges}.values()), nodes  # one per pair


def _network(p: CutProblem, lam: float) -> tuple[nx.DiGraph, list[fx.Node]]:
    edges, nodes = _edges(p)
    g = nx.DiGraph()
    for u, v, nbytes, cost in edges:
        if nbytes is None and cost is None:
            g.add_edge(u, v)  # no capacity attribute = infinite
        else:
            g.add_edge(u, v, capacity=(nbytes or 0) + lam * (cost or 0.0))
    return g, nodes


def cut(p: CutProblem, lam: float) -> tuple[list[fx.Node], float]:
    """(saved set in joint-graph order, recompute cost) of the cheapest cut at weight ``lam``."""
    g, nodes = _network(p, lam)
    if SINK not in g:
        return [], 0.0
    try:
        try:
            r = preflow_push(g, SOURCE, SINK)
        except IndexError:
            # networkx's preflow-push can index past its height levels, depending on the node order
            # (seen with a data-dependent graph's ``_assert_scalar`` nodes, which no source edge
            # reaches); another max-flow algorithm's residual network gives the same cut: the
            # nodes that reach the sink in the residual of any maximum flow are the same
            r = edmonds_karp(g, SOURCE, SINK)
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
    return _sides(p, nodes, [(n, "in") in sink_side for n in nodes], [(n, "out") in sink_side for n in nodes])


def _sides(p: CutProblem, nodes: list[fx.Node], ins, outs) -> tuple[list[fx.Node], float]:
    """(saved set, recompute cost) of a cut, from which side each node's in and out lie on (True:
    the sink's): saved where only its out is, recomputed where its in is too."""
    saved = [n for n, i, o in zip(nodes, ins, outs) if not i and o]
    cost = sum(p.cost.get(n, 0.0) for n, i in zip(nodes, ins) if i and n in p.recomputable)
    return saved, cost


class ScaledCut:
    """Cheapest cuts of one problem at many weights, fast: scipy's max-flow (C) over the network
    built once. scipy takes 32-bit integer capacities, so each weight's capacities are scaled to
    sum to at most 2**30 and rounded down: the cut found is within a rounding per edge of the
    cheapest (a floor-rounded flow is a flow of the real network, so it bounds the cheapest from
    below), which is what the budget's frontier needs (its candidates are scored exactly)."""

    def __init__(self, p: CutProblem):
        edges, self.nodes = _edges(p)
        index = {SOURCE: 0, SINK: 1}
        for n in self.nodes:
            index[(n, "in")], index[(n, "out")] = len(index), len(index) + 1
        self.p, self.size = p, len(index)
        self.u = np.array([index[u] for u, *_ in edges], dtype=np.int64)
        self.v = np.array([index[v] for _, v, *_ in edges], dtype=np.int64)
        self.inf = np.array([b is None and c is None for _, _, b, c in edges])
        self.nbytes = np.array([b or 0 for _, _, b, _ in edges], dtype=np.float64)
        self.cost = np.array([c or 0.0 for *_, c in edges], dtype=np.float64)
        self._in = np.array([index[(n, "in")] for n in self.nodes], dtype=np.int64)
        self._out = np.array([index[(n, "out")] for n in self.nodes], dtype=np.int64)
        infinite = sp.csr_array((np.ones(int(self.inf.sum())), (self.u[self.inf], self.v[self.inf])),
                                shape=(self.size, self.size))
        self.unbounded = 1 in breadth_first_order(infinite, 0, directed=True, return_predecessors=False)

    def __call__(self, lam: float) -> tuple[list[fx.Node], float] | None:
        """(saved set, recompute cost) of a cheapest cut at weight ``lam``; None when every cut is
        infinite."""
        if self.unbounded:
            return None
        cap = self.nbytes + lam * self.cost
        scale = 2.0 ** 30 / max(float(cap[~self.inf].sum()), 1.0)
        ints = np.where(self.inf, 2 ** 30 + 1, np.floor(cap * scale)).astype(np.int32)  # > any finite cut
        graph = sp.csr_array((ints, (self.u, self.v)), shape=(self.size, self.size))
        result = maximum_flow(graph, 0, 1)
        flow = result.flow[self.u, self.v]
        # residual edges: forward where not full, backward where flow runs; the sink side is
        # what still reaches the sink through them
        rows = np.concatenate([self.u[ints > flow], self.v[flow > 0]])
        cols = np.concatenate([self.v[ints > flow], self.u[flow > 0]])
        residual = sp.csr_array((np.ones(len(rows)), (cols, rows)), shape=(self.size, self.size))  # reversed
        sink_side = np.zeros(self.size, dtype=bool)
        sink_side[breadth_first_order(residual, 1, directed=True, return_predecessors=False)] = True
        return _sides(self.p, self.nodes, sink_side[self._in], sink_side[self._out])


def solve(p: CutProblem, lam: float) -> list[fx.Node]:
    """The saved set (joint-graph order) of the cheapest cut at recompute weight ``lam``."""
    return cut(p, lam)[0]


def saved_bytes(p: CutProblem, saved) -> int:
    return sum(p.nbytes.get(n, 0) for n in saved if n.op != "placeholder")


def frontier(p: CutProblem, lo: float, hi: float, max_solves: int = 64) -> list[tuple[list[fx.Node], float]]:
    """Every distinct cheapest cut for recompute weights in [lo, hi] with a weight at which it is
    cheapest, most saved bytes first.

    Each cut's value is a line in the weight, bytes + lam * cost; the cheapest-cut value is their
    lower envelope (each cut by :class:`ScaledCut`). Eisner and Severance's search: solve where
    the lines of two known cuts cross; a cut strictly below both is a new breakpoint to search on
    either side of, otherwise the two are neighbours. ``2k - 1`` solves find ``k`` cuts (at most
    ``max_solves`` are made).
    """
    fast = ScaledCut(p)

    def at(lam):
        saved, cost = fast(lam) or cut(p, lam)  # no finite cut: the exact solver names why
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
