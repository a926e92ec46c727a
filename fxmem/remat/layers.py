"""Layers from the graph: which forward nodes belong to which repeated block.

Dynamo records, for every node, the stack of module *calls* it ran in
(``node.meta["nn_module_stack"]``: one entry per call, keyed by the module and, for the second
and later calls of one module, ``@1``, ``@2``...). A layer is a call of a *repeated block*: a
module with submodules (a leaf such as ``Linear`` or a norm is an op, not a block) whose class is
called at least twice at one depth of the module tree. So are found alike Hugging Face's numbered
blocks (``model.layers.3``), ``nn.TransformerEncoder``'s layers, conv stages and residual
blocks, MoE decoder layers and one layer applied several times with shared weights (an
ALBERT-style stack: three calls, three layers, keyed ``...layer_groups.0``, ``...0@1``,
``...0@2``). The outermost repeated blocks are taken, unless one is itself a stack: when the
repeated blocks inside a call cover most of it (a T5 or Whisper encoder of numbered blocks), its
inner blocks are the layers. A numbered sibling of a layer (Jamba's one attention layer among
Mamba layers, DeepSeek's dense first layer) is a layer too. Without repeated blocks, the
top-level modules with submodules are the layers when there are two or more (a UNet's ``down``,
``mid``, ``up``). Else a recurrent module (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``, any leaf module
that applies one weight again and again along a chain: AOTAutograd unrolls the recurrence over
the sequence) has its *steps* as layers (``rnn.step3``): each step starts at a heavy op that reads
the weights the step before read and what it computed (``h_{t-1} @ W_hh``); the hidden state is
the boundary, everything a step computes from it (gates, the next state) is recomputed. Else
there are none (``layers`` returns ``{}``).
Nodes that decompositions created without a module stack inherit the layer of their inputs. A
layer's *boundary* is every tensor it reads from outside itself (the residual stream, plus small
shared inputs such as rotary tables) and every tensor of it that code outside the layers reads
(the last layer's output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.fx as fx

from ..graph.joint import JointGraph
from ..graph.liveness import storage_roots
from .allowlist import CHEAP, HEAVY, kind
from .replay import is_state

_ITEM = re.compile(r"(?:\._modules)?\['?([^'\]]+)'?\]")
STACK = 0.8  # the share of a repeated block's nodes that repeated blocks inside it must hold for it to be a stack


def module_path(raw: str) -> list[str]:
    """``L['args'][0]._modules['layers']._modules['0'].fc`` -> ``['layers', '0', 'fc']``."""
    parts = [p for p in _ITEM.sub(lambda m: "." + m.group(1), raw).split(".") if p]
    if parts[:1] == ["L"]:
        parts = parts[1:]
    if parts[:1] == ["self"]:
        return parts[1:]
    return parts[2:] if parts[:1] == ["args"] else parts[1:]


@dataclass
class _Call:
    """One call of a module: where it sits and the forward nodes it ran."""
    key: str                       # Dynamo's key of the call: the module's, with ``@n`` on its n-th repeat
    path: tuple[str, ...]          # the module's path in the compiled module, () for that module itself
    cls: str
    depth: int
    parent: str | None
    nodes: list[fx.Node] = field(default_factory=list)
    children: dict[str, None] = field(default_factory=dict)  # calls made inside it, in graph order

    @property
    def name(self) -> str:
        """The layer key: the module path, with the repeat's ``@n`` for a module called again."""
        repeat = self.key.rpartition("@")[2] if "@" in self.key else ""
        return ".".join(self.path) + (f"@{repeat}" if repeat else "")


def _calls(nodes) -> dict[str, _Call]:
    calls: dict[str, _Call] = {}
    for n in nodes:
        stack = list((n.meta.get("nn_module_stack") or {}).items())
        for depth, (key, (raw, cls)) in enumerate(stack):
            call = calls.get(key)
            if call is None:
                call = calls[key] = _Call(key, tuple(module_path(raw)), str(cls), depth,
                                          stack[depth - 1][0] if depth else None)
            call.nodes.append(n)
            if depth + 1 < len(stack):
                call.children[stack[depth + 1][0]] = None
    return calls


def _layer_calls(calls: dict[str, _Call]) -> list[_Call]:
    """The calls that are layers (see the module's docstring), disjoint, in graph order."""
    groups: dict[tuple[str, int], list[_Call]] = {}
    for c in calls.values():
        if c.children and c.path:  # not the compiled module itself (its stack entry, where Dynamo has one)
            groups.setdefault((c.cls, c.depth), []).append(c)
    repeated = {c.key for group in groups.values() if len(group) >= 2 for c in group}

    def outermost(call: _Call) -> list[_Call]:
        """The repeated calls inside ``call`` (itself excluded) not inside another one."""
        found = []
        for k in call.children:
            child = calls[k]
            found.extend([child] if k in repeated else outermost(child))
        return found

    def expand(call: _Call) -> list[_Call]:
        """``call``, or the layers inside it when it is a stack: two or more calls of one repeated
        block hold most of its nodes."""
        inner = outermost(call)
        same: dict[tuple[str, int], list[_Call]] = {}
        for c in inner:
            same.setdefault((c.cls, c.depth), []).append(c)
        if any(len(g) >= 2 and sum(len(c.nodes) for c in g) >= STACK * len(call.nodes) for g in same.values()):
            return [layer for c in inner for layer in expand(c)]
        return [call]

    roots = [c for c in calls.values() if c.parent is None]
    chosen = [layer for c in roots for top in ([c] if c.key in repeated else outermost(c)) for layer in expand(top)]
    if chosen:  # numbered siblings of a layer that are blocks of another class
        numbered = {(c.parent, c.path[:-1]) for c in chosen if c.path and c.path[-1].isdigit()}
        keys = {c.key for c in chosen}
        chosen += [c for c in calls.values() if c.key not in keys and c.children and c.path
                   and c.path[-1].isdigit() and (c.parent, c.path[:-1]) in numbered]
    else:
        top = [c for c in calls.values() if len(c.path) == 1 and c.children]
        chosen = top if len(top) >= 2 else []
    return chosen


def _steps(joint: JointGraph, calls: dict[str, _Call]) -> dict[fx.Node, str]:
    """Forward node -> step key (``rnn.step3``) inside the recurrent leaf calls (see the module's
    docstring); ``{}`` when there are none. A step's nodes are those whose latest step-starting
    ancestor inside the call is its start; the call's nodes before its first step (the input
    projection of the whole sequence) belong to no step."""
    root = storage_roots(joint.gm)
    key: dict[fx.Node, str] = {}
    for call in calls.values():
        if call.children or not call.path:
            continue
        groups: dict[frozenset, list[fx.Node]] = {}
        for n in call.nodes:  # heavy ops by the graph inputs (weights) they read
            if kind(n) == HEAVY:
                weights = frozenset(root[a] for a in n.all_input_nodes if root[a].op == "placeholder")
                if weights:
                    groups.setdefault(weights, []).append(n)
        ops = [n for g in groups.values() if len(g) >= 2 for n in g]
        if not ops:
            continue
        order = {n: i for i, n in enumerate(call.nodes)}
        inside = set(call.nodes)
        latest: dict[fx.Node, int] = {}  # node -> position of its latest ancestor among ``ops`` (-1: none)
        starts = set(ops)
        for n in call.nodes:
            before = max((latest.get(a, -1) for a in n.all_input_nodes if a in inside), default=-1)
            latest[n] = order[n] if n in starts else before
        chained = [n for g in groups.values() if len(g) >= 2 and all(
            max((latest.get(a, -1) for a in b.all_input_nodes if a in inside), default=-1) >= order[a_]
            for a_, b in zip(g, g[1:])) for n in g]
        if not chained:
            continue
        starts = set(chained)
        index = {n: i for i, n in enumerate(sorted(chained, key=order.__getitem__))}
        step: dict[fx.Node, int] = {}
        name = ".".join(call.path)
        for n in call.nodes:
            steps = [step[a] for a in n.all_input_nodes if a in step]
            if n in starts:
                step[n] = index[n]
            elif steps:
                step[n] = max(steps)
            else:
                continue
            key[n] = f"{name}.step{step[n]}"
    return key


def layers(joint: JointGraph) -> dict[fx.Node, str]:
    """Forward node -> layer key, for nodes inside a layer (``{}`` when the graph has none)."""
    forward = [n for n in joint.gm.graph.nodes if n in joint.forward and n.op == "call_function"]
    calls = _calls(forward)
    chosen = _layer_calls(calls)
    if not chosen:
        return _steps(joint, calls)
    of_call = {c.key: c.name for c in chosen}
    key: dict[fx.Node, str] = {}
    for n in forward:
        stack = n.meta.get("nn_module_stack")
        k = next((of_call[c] for c in (stack or {}) if c in of_call), None)
        if k is None and not stack:  # made by a decomposition: inherit
            ks = {key.get(a) for a in n.all_input_nodes if a.op != "placeholder"} - {None}
            k = ks.pop() if len(ks) == 1 else None  # ignore layer-less inputs (lifted constants)
        if k is not None:
            key[n] = k
    return key


def boundaries(joint: JointGraph, key: dict[fx.Node, str]) -> set[fx.Node]:
    """Tensors a layer reads from outside itself, and layer outputs that code outside the layers
    reads (the last layer's output, which the head normalizes): what layerwise checkpointing
    keeps. Not graph inputs (those are kept anyway), nor what cheap ops compute from graph inputs
    and generator states alone (the token embedding, a dropout's random numbers): recomputing
    them reruns no earlier layer."""
    from_inputs: set[fx.Node] = set()
    for n in joint.gm.graph.nodes:  # topological order
        if n.op == "placeholder" or is_state(n) or (n.op == "call_function" and n in joint.forward and kind(n) == CHEAP
                                     and all(a in from_inputs for a in n.all_input_nodes)):
            from_inputs.add(n)
    out = set()
    for n in joint.forward:
        if n.op != "call_function":
            continue
        k = key.get(n)
        for a in n.all_input_nodes:  # read across a layer's edge: into a layer, or out of one into the head
            if a not in from_inputs and key.get(a) != k and a in joint.forward and (k is not None or a in key):
                out.add(a)
    return out


def every_kth(joint: JointGraph, key: dict[fx.Node, str], fences: set[fx.Node], k: int) -> set[fx.Node]:
    """The boundaries that a checkpoint every ``k`` layers keeps (the sqrt(n) schedule for
    ``k ~ sqrt(n)``): those read by layers ``0, k, 2k, ...`` (in graph order) or by code outside
    the layers (the head); the others are recomputed with the layers between two kept ones."""
    order = {name: i for i, name in enumerate(dict.fromkeys(key[n] for n in joint.gm.graph.nodes if n in key))}
    return {a for a in fences
            if any(u in joint.forward and key.get(u) != key.get(a)
                   and (key.get(u) is None or order[key[u]] % k == 0) for u in a.users)}
