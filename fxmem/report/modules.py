"""The model's terms for a plan: which module produced each kept or recomputed value.

Dynamo records each forward node's module stack (``nn_module_stack``) and AOTAutograd copies it
onto the backward's nodes (``fwd_nn_module_stack``); the innermost entry, parsed by
:func:`fxmem.remat.layers.module_path`, names the module (``transformer.h.3.attn``). Nodes that
decompositions made without a stack take the module of their first input that has one; values
outside every submodule (the loss of a model that computes it in ``forward``) belong to
``(model)``, named by the function that made them when Dynamo recorded one (``(model).cross_entropy``).

Repeated layers print once: :func:`pattern` folds ``transformer.h.0.attn`` and
``transformer.h.1.attn`` into ``transformer.h.*.attn``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from ..remat.layers import module_path

TOP = "(model)"
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _stack_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return None
    raw, _ = list(stack.values())[-1]
    return ".".join(module_path(raw)) or None


def _source_fn(node: fx.Node) -> str | None:
    stack = node.meta.get("source_fn_stack") or []
    if not stack:
        return None
    _, fn = stack[-1]
    name = getattr(fn, "__name__", fn if isinstance(fn, str) else None)
    return name if isinstance(name, str) and name.isidentifier() else None


def owners(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> the module that produced it (see the module docstring)."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        path = _stack_path(n)
        if path is None:
            path = next((out[a.name] for a in n.all_input_nodes if a.name in out and out[a.name] != TOP), None)
        if path is None:
            fn = _source_fn(n)
            path = f"{TOP}.{fn}" if fn else TOP
        out[n.name] = path
    return out


def pattern(path: str) -> str:
    """``transformer.h.3.attn`` -> ``transformer.h.*.attn``: one name for a repeated layer's module."""
    return _NUMBER.sub("*", path)


@dataclass(frozen=True)
class ModuleRow:
    module: str  # a module path, or a pattern of repeated ones (transformer.h.*.attn)
    count: int  # modules the row covers
    kept_bytes: int  # activations the plan keeps for the backward, at the compiled shape
    recomputed_bytes: int  # activations a plain partition keeps that the plan recomputes instead


def by_module(owner: dict[str, str], kept: dict[str, int], recomputed: dict[str, int]) -> list[list]:
    """[module, kept bytes, recomputed bytes] per module that keeps or recomputes anything,
    largest first; ``kept``/``recomputed``: value name -> bytes."""
    rows: dict[str, list[int]] = {}
    for i, values in enumerate((kept, recomputed)):
        for name, nbytes in values.items():
            rows.setdefault(owner.get(name, TOP), [0, 0])[i] += nbytes
    return sorted(([m, k, r] for m, (k, r) in rows.items() if k or r), key=lambda row: (-row[1] - row[2], row[0]))


def folded(rows: list[list]) -> list[ModuleRow]:
    """``by_module``'s rows with repeated layers folded into one pattern each, largest first."""
    out: dict[str, list[int]] = {}
    for module, kept, recomputed in rows:
        acc = out.setdefault(pattern(module), [0, 0, 0])
        acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + kept, acc[2] + recomputed
    rows_ = [ModuleRow(m, c, k, r) for m, (c, k, r) in out.items()]
    return sorted(rows_, key=lambda r: (-r.kept_bytes - r.recomputed_bytes, r.module))


def holders(owner: dict[str, str], live: list, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` modules holding the most of ``live`` ([value name, bytes] pairs), largest first."""
    total: dict[str, int] = {}
    for name, nbytes in live:
        total[owner.get(name, TOP)] = total.get(owner.get(name, TOP), 0) + nbytes
    return sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def common(paths: list[str]) -> str:
    """One name for the modules of a cluster's occurrences: the module, or its pattern when the
    occurrences are one module per layer (``transformer.h.*.mlp``), else the first and a count."""
    unique = list(dict.fromkeys(paths))
    if not unique:
        return ""
    if len(unique) == 1:
        return unique[0]
    patterns = set(map(pattern, unique))
    return patterns.pop() if len(patterns) == 1 else f"{unique[0]} and {len(unique) - 1} more"
