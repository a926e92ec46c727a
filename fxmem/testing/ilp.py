"""An exact reference for the memory budget: the least recompute cost whose saved bytes fit a cap.

For tests and the bench only (the planner never calls it): a mixed-integer program over the same
network and cost model as :mod:`fxmem.remat.mincut`, solved by ``scipy.optimize.milp`` (HiGHS).
Each forward node ``n`` has two 0/1 variables, ``i_n`` and ``o_n``: whether its input and its
output side lie on the backward's side of the cut. ``i_n = 1`` means ``n`` is recomputed (it pays
``cost[n]``), ``o_n = 1`` that the backward has its value, and ``o_n - i_n = 1`` that it is saved
(it pays ``nbytes[n]`` against the cap). The network's infinite edges are constraints: a value the
backward reads has ``o = 1``; a recomputed node's inputs are available (``o_u >= i_n``); a node that
may not be recomputed has ``i = 0``; one that may not be saved (or has several outputs) has
``o <= i``. Every saved set that :func:`fxmem.remat.split.split` accepts is such an assignment, so
the optimum is a lower bound on any plan's recompute cost at that cap: fxmem's gap to it is
``cost / optimum - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from ..graph.joint import is_multi_output, is_sym
from ..remat.mincut import CutProblem


@dataclass(frozen=True)
class Optimum:
    saved: tuple[fx.Node, ...]  # joint-graph order
    saved_bytes: int
    cost: float  # recompute cost, priced as CutProblem.cost


def least_recompute(p: CutProblem, cap: int, time_limit: float = 60.0) -> Optimum | None:
    """The saved set of least recompute cost with at most ``cap`` saved bytes; None if none fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    joint = p.joint
    nodes = [n for n in joint.gm.graph.nodes
             if n not in joint.backward and n.op in ("placeholder", "call_function") and not is_sym(n)]
    index = {n: k for k, n in enumerate(nodes)}
    m = len(nodes)
    i_, o_ = (lambda n: index[n]), (lambda n: m + index[n])  # variable columns
    lo, hi = np.zeros(2 * m), np.ones(2 * m)
    rows, lows, highs = [], [], []

    def row(coefs: dict[int, float], low: float, high: float) -> None:
        rows.append(coefs)
        lows.append(low)
        highs.append(high)

    for n in nodes:
        if n.op == "placeholder" or (n in joint.forward and n not in p.recomputable):
            hi[i_(n)] = 0  # comes from the forward
        if n.op != "placeholder" and (is_multi_output(n) or n in p.no_save):
            row({o_(n): 1, i_(n): -1}, -np.inf, 0)  # may not be saved: available only if recomputed
        for u in n.users:
            if u in index:
                row({o_(n): 1, i_(u): -1}, 0, np.inf)  # a recomputed user needs this value
            elif u in joint.backward or u.op == "output" and n in joint.bwd_outputs:
                lo[o_(n)] = 1  # the backward reads it
    # saved bytes: sum nbytes * (o - i) <= cap, over what may be saved (graph inputs are free)
    sized = {n: p.nbytes.get(n, 0) for n in nodes if n.op != "placeholder"}
    budget = {}
    for n, b in sized.items():
        budget[o_(n)] = budget.get(o_(n), 0) + b
        budget[i_(n)] = budget.get(i_(n), 0) - b
    row(budget, -np.inf, cap)
    a = np.zeros((len(rows), 2 * m))
    for r, coefs in enumerate(rows):
        for col, v in coefs.items():
            a[r, col] += v
    c = np.zeros(2 * m)
    for n in nodes:
        c[i_(n)] = p.cost.get(n, 0.0) if n in p.recomputable else 0.0
    # saved = o - i must be 0 or 1: o >= i
    diff = np.zeros((m, 2 * m))
    for n in nodes:
        diff[index[n], o_(n)], diff[index[n], i_(n)] = 1, -1
    res = milp(c, constraints=[LinearConstraint(a, lows, highs), LinearConstraint(diff, 0, 1)],
               integrality=np.ones(2 * m), bounds=Bounds(lo, hi), options={"time_limit": time_limit})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    saved = tuple(n for n in nodes if n.op != "placeholder" and x[o_(n)] - x[i_(n)] == 1)
    return Optimum(saved, sum(sized[n] for n in saved), float(c @ x))
