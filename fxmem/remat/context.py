"""What the planner knows about one joint graph, computed once: :class:`PlanContext`.

The candidate strategies (the level's cut, the frontier, the steps between cuts, the greedy
mixes, layerwise checkpoints) and the selection all read the same context: the storage each
forward value holds, its recompute cost, its layer, the target's memory model, and one step
simulator (:class:`~.steppeak.StepPeak`) shared by every candidate scored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.fx as fx

from ..graph.cost import recompute_cost
from ..graph.joint import JointGraph
from ..graph.liveness import storage_roots
from ..graph.sizes import SymbolicSizes
from .allowlist import CHEAP, HEAVY, kind
from .clusters import Cluster, find_clusters
from .layers import boundaries, layers
from .settings import Target
from .split import Walk
from .steppeak import StepPeak


@dataclass
class PlanContext:
    joint: JointGraph
    sizes: SymbolicSizes
    target: Target
    fwd_nodes: list[fx.Node]  # the forward's ops
    root: dict[fx.Node, fx.Node]  # node -> the node whose storage it is
    free: set[fx.Node]  # views of inputs: keeping them costs no new storage
    nbytes: dict[fx.Node, int]  # bytes keeping each forward op holds (its whole storage), at the plan shape
    cost: dict[fx.Node, float]  # recompute cost of each forward op
    stashed: list[fx.Node]  # what a plain partition keeps
    clusters: list[Cluster]  # ONNX Runtime's clusters of the stashed values (for rules)
    layer: dict[fx.Node, str]  # node -> the repeated layer it belongs to ({}: none found)
    fences: set[fx.Node]  # layer inputs: recompute chains stop here at level 1 and under a budget
    # backward outputs that die where they are made (``step_in_backward``: the optimizer takes them)
    released: frozenset[fx.Node] = frozenset()

    @classmethod
    def of(cls, joint: JointGraph, sizes: SymbolicSizes, target: Target,
           released: frozenset[fx.Node] = frozenset()) -> "PlanContext":
        fwd_nodes = [n for n in joint.gm.graph.nodes if n not in joint.backward and n.op == "call_function"]
        root = storage_roots(joint.gm)
        free = {n for n in fwd_nodes if root[n].op == "placeholder"}
        nbytes = {n: 0 if n in free else sizes.at(sizes.nbytes(root[n])) for n in fwd_nodes}
        cost = {n: recompute_cost(n, sizes) for n in fwd_nodes}
        stashed = joint.default_saved()
        key = layers(joint)
        return cls(joint, sizes, target, fwd_nodes, root, free, nbytes, cost, stashed, find_clusters(joint, stashed),
                   key, boundaries(joint, key), released)

    @functools.cached_property
    def cheap(self) -> set[fx.Node]:
        """Forward ops every level may recompute (views, elementwise ops, ...)."""
        return {n for n in self.joint.gm.graph.nodes if n not in self.joint.backward and kind(n) == CHEAP}

    @functools.cached_property
    def heavy_inside(self) -> set[fx.Node]:
        """Heavy ops (matmuls, convolutions, ...) inside the repeated layers."""
        return {n for n in self.layer if kind(n) == HEAVY}

    @functools.cached_property
    def walk(self) -> Walk:
        return Walk(self.joint)

    @functools.cached_property
    def partial(self) -> bool:
        """The graph is one part of a training step (Dynamo split the step at a graph break): its
        backward takes no scalar gradient (it returns no loss), so what it keeps stays alive while
        the graphs after it run, and its forward and backward run above what they hold."""
        return not any(_scalar(t) for t in self.joint.tangents)

    @functools.cached_property
    def peak(self) -> StepPeak:
        """The step simulator: ``ctx.peak(saved)`` is the simulated step peak of keeping ``saved``."""
        return StepPeak(self.joint, self.sizes, self.target, released=self.released)


def _scalar(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return val is not None and hasattr(val, "numel") and val.dim() == 0
