"""Liveness: simulate a graph's allocations in order and find its peak.

Every non-view op allocates its output; a storage is freed after the last read of any node that
views it (boxed graphs free their inputs the same way). Graph outputs stay alive.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from .sizes import SymbolicSizes


def is_alias(node: fx.Node) -> bool:
    """A view or a getitem: shares its input's storage."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def storage_roots(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    root: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        aliases = n.op == "call_function" and is_alias(n) and isinstance(n.args[0], fx.Node)
        root[n] = root.get(n.args[0], n.args[0]) if aliases else n
    return root


def last_reads(gm: fx.GraphModule, root: dict[fx.Node, fx.Node]) -> dict[fx.Node, int]:
    """Storage root -> position of the last node reading it through any alias (the output node
    reads what the graph returns)."""
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        for a in n.all_input_nodes:
            last[root[a]] = max(last.get(root[a], -1), i)
    return last


@dataclass(frozen=True)
class Liveness:
    peak: int
    peak_at: fx.Node | None
    live_at_peak: tuple[tuple[str, int], ...]  # (node name, bytes), largest first


def simulate(gm: fx.GraphModule, sizes: SymbolicSizes, inputs_freed: bool = True) -> Liveness:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root = storage_roots(gm)
    last = last_reads(gm, root)
    live: dict[fx.Node, int] = {}
    peak, peak_at, snapshot = 0, None, ()
    for n in nodes:
        if n.op == "placeholder" or (n.op == "call_function" and root[n] is n):
            live[n] = sizes.at(sizes.nbytes(n))
        total = sum(live.values())
        if total > peak:
            peak, peak_at = total, n
            snapshot = tuple(sorted(((k.name, v) for k, v in live.items()), key=lambda kv: -kv[1]))
        for r in [r for r in live if last.get(r, -1) == pos[n] or (last.get(r) is None and r is n)]:
            if r.op != "placeholder" or inputs_freed:
                del live[r]
    return Liveness(peak, peak_at, snapshot)
