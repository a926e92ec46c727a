"""Transformer layers from the graph: which forward nodes belong to which repeated block.

Dynamo records each node's module path (``node.meta["nn_module_stack"]``); a layer is the module
path up to its first integer segment (``transformer.h.3``, ``model.layers.0``, ``blocks.2``),
which covers plain ``nn.ModuleList`` models and Hugging Face models alike, when that module has
submodules (a numbered leaf, ``nn.Sequential(conv, bn, relu)``'s ``1``, is an op of the code
around it); without numbered blocks, the top-level modules with submodules (a UNet's stages).
Nodes that decompositions created without a path inherit the layer of their inputs. A layer's *boundary* is every tensor
it reads from outside itself (the residual stream, plus small shared inputs such as rotary tables)
and every tensor of it that code outside the layers reads (the last layer's output).
"""

from __future__ import annotations

import re

import torch.fx as fx

from ..graph.joint import JointGraph
from .allowlist import CHEAP, kind
from .replay import is_state

_ITEM = re.compile(r"(?:\._modules)?\['?([^'\]]+)'?\]")


def module_path(raw: str) -> list[str]:
    """``L['args'][0]._modules['layers']._modules['0'].fc`` -> ``['layers', '0', 'fc']``."""
    parts = [p for p in _ITEM.sub(lambda m: "." + m.group(1), raw).split(".") if p]
    if parts[:1] == ["L"]:
        parts = parts[1:]
    if parts[:1] == ["self"]:
        return parts[1:]
    return parts[2:] if parts[:1] == ["args"] else parts[1:]


def _paths(node: fx.Node) -> list[tuple[str, ...]]:
    """The module paths of ``node``'s stack, outermost first (the compiled module itself: ())."""
    return [tuple(module_path(raw)) for raw, _ in (node.meta.get("nn_module_stack") or {}).values()]


def _blocks(nodes) -> set[tuple[str, ...]]:
    """The repeated blocks: modules with submodules (a leaf such as ``features.1 = MaxPool2d`` is
    an op, not a block) that are numbered children (``transformer.h.3``, ``features.0``: the first
    numbered module on a path). A network without numbered blocks (a UNet's ``down``, ``mid``,
    ``up``) has its top-level modules with submodules instead, when there are two or more."""
    stacks = [_paths(n) for n in nodes]
    seen = {p for stack in stacks for p in stack}
    composite = {p[:i] for p in seen for i in range(1, len(p)) if p[:i] in seen}
    numbered = set()
    for stack in stacks:
        first = next((p for p in stack if p and p[-1].isdigit() and not any(s.isdigit() for s in p[:-1])), None)
        if first in composite:
            numbered.add(first)
    if numbered:
        return numbered
    top = {p for p in composite if len(p) == 1}
    return top if len(top) >= 2 else set()


def layer_key(node: fx.Node, blocks: set[tuple[str, ...]]) -> str | None:
    return next((".".join(p) for p in _paths(node) if p in blocks), None)


def layers(joint: JointGraph) -> dict[fx.Node, str]:
    """Forward node -> layer key, for nodes inside a repeated block."""
    forward = [n for n in joint.gm.graph.nodes if n in joint.forward and n.op == "call_function"]
    blocks = _blocks(forward)
    key: dict[fx.Node, str] = {}
    for n in forward:
        k = layer_key(n, blocks)
        if k is None and not n.meta.get("nn_module_stack"):  # made by a decomposition: inherit
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
