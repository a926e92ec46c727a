"""Symbolic sizes: every tensor's bytes as a sympy expression of named input dimensions.

With ``dynamic=True`` Dynamo's symbols (``s52``) stand for input dimensions; we name them after the
first input they came from (``input_ids.size(0)``) so formulas read well. Static shapes give
plain integers. ``SymbolicSizes.at(expr)`` evaluates a formula at the plan shape.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx

from ..options import OptionError

_SOURCE = re.compile(r"\['([^'\]]+)'\]\.size\(\)\[(\d+)\]$")
_POSITIONAL = re.compile(r"\['args'\]\[(\d+)\]\.size\(\)\[(\d+)\]$")


def readable(source_name: str) -> str:
    """``L['kwargs']['input_ids'].size()[0]`` -> ``input_ids.size(0)``; a positional argument of a
    module's call, ``L['args'][0].size()[1]``, -> ``args[0].size(1)`` (``fxmem.report`` names it
    after the module's ``forward`` parameter)."""
    m = _POSITIONAL.search(source_name)
    if m:
        return f"args[{m.group(1)}].size({m.group(2)})"
    m = _SOURCE.search(source_name)
    return f"{m.group(1)}.size({m.group(2)})" if m else source_name


def input_dims(gm: fx.GraphModule) -> dict[str, int | str]:
    """Readable name -> size (a static dimension) or symbol (a dynamic one, ``"s52"``) of every
    dimension of the inputs of a Dynamo graph that are not parameters or buffers."""
    out: dict[str, int | str] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        arg = n.meta.get("grapharg")
        example = getattr(arg, "example", None)
        if not isinstance(example, torch.Tensor) or isinstance(example, torch.nn.Parameter):
            continue
        name = arg.source.name
        if "._buffers[" in name or "._parameters[" in name:
            continue
        for i, d in enumerate(n.meta["example_value"].shape):
            out[readable(f"{name}.size()[{i}]")] = str(d.node.expr) if isinstance(d, torch.SymInt) else int(d)
    return out


def static_dims(gm: fx.GraphModule) -> dict[str, int]:
    """Readable name -> size of every input dimension Dynamo specialized (``input_ids.size(0)``
    of a batch of 1, which Dynamo never makes dynamic), for the inputs of a Dynamo graph that
    are not parameters or buffers: a prediction at another size of these must refuse."""
    return {name: d for name, d in input_dims(gm).items() if isinstance(d, int)}


def forward_parameters(module: Any) -> list[str]:
    """The names of a module's ``forward`` positional parameters: what Dynamo's ``args[i]`` are."""
    if not isinstance(module, torch.nn.Module):
        return []
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def traced_parameters() -> list[str]:
    """The forward parameters of the module whose call Dynamo is compiling now, where Dynamo
    traced it through its ``fn(*args)`` wrapper (``torch.compile`` of an ``nn.Sequential``):
    there its inputs are named ``args[i]``. Empty elsewhere."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):  # not inside a Dynamo compile
        return []
    return forward_parameters(getattr(tx, "f_locals", {}).get("fn"))


def check_plan_shape(gm: fx.GraphModule, plan_shape: Mapping[str, tuple[int, ...]] | None,
                     positional: list[str] | None = None) -> Mapping[str, tuple[int, ...]] | None:
    """``plan_shape`` in the Dynamo graph ``gm``'s names; raise :class:`OptionError` unless every
    key names an input of ``gm`` (with at most as many sizes as it has dimensions) or one of its
    dynamic dimensions' symbols (with one size). An input Dynamo named ``args[i]`` may also be
    named by the module's ``forward`` parameter (``positional``, default :func:`traced_parameters`):
    ``input`` for an ``nn.Sequential``'s ``args[0]``. Checked on Dynamo's graph, where inputs have
    their names; :meth:`SymbolicSizes.of` then applies the sizes of the dynamic dimensions (a
    static one keeps the only size its graph runs at)."""
    if not plan_shape:
        return plan_shape
    dims = input_dims(gm)
    rank: dict[str, int] = {}
    for name in dims:
        input_name = name.rsplit(".size(", 1)[0]
        rank[input_name] = rank.get(input_name, 0) + 1
    symbols = list(dict.fromkeys(d for d in dims.values() if isinstance(d, str) and d.isidentifier()))
    names = traced_parameters() if positional is None else positional
    alias = {}  # forward parameter -> args[i]
    for key in rank:
        m = re.fullmatch(r"args\[(\d+)\]", key)
        if m and int(m.group(1)) < len(names) and names[int(m.group(1))] not in (*rank, *symbols):
            alias[names[int(m.group(1))]] = key
    listed = ", ".join(f"{name} = {d}" for name, d in dims.items()) or "none"
    aka = {key: a for a, key in alias.items()}
    accepted = [f"{aka[k]!r} or {k!r}" if k in aka else repr(k) for k in rank]
    accepted = [f"{a} (at most {n} sizes)" for a, n in zip(accepted, rank.values())]
    accepted = ", ".join([*accepted, *(f"{sym!r} (one size)" for sym in symbols)]) or "none"
    out = {}
    for key, sizes in plan_shape.items():
        name = alias.get(key, key)
        if (name in rank and len(sizes) <= rank[name]) or (name in symbols and len(sizes) == 1):
            out[name] = sizes
            continue
        if name in rank or name in symbols:
            want = f"at most {rank[name]} sizes" if name in rank else "one size"
            raise OptionError(f"option 'plan_shape': {key!r}: got {list(sizes)}; allowed: {want}; "
                              f"the graph's dims: {listed}")
        raise OptionError(f"option 'plan_shape': {key!r} names no input or dimension of this graph; the graph's "
                          f"dims: {listed}; allowed keys: {accepted}")
    return out


def model_state_bytes(gm: fx.GraphModule) -> tuple[int, int]:
    """(bytes of the parameters and buffers a Dynamo graph takes, bytes of those that train):
    what a device holds beside the step's peak (the trainable ones also get optimizer state)."""
    total = trainable = 0
    for n in gm.graph.find_nodes(op="placeholder"):
        example = getattr(n.meta.get("grapharg"), "example", None)
        name = getattr(getattr(n.meta.get("grapharg"), "source", None), "name", "")
        if isinstance(example, torch.nn.Parameter) or (isinstance(example, torch.Tensor) and "._buffers[" in name):
            b = example.numel() * example.element_size()
            total += b
            trainable += b if example.requires_grad else 0
    return total, trainable


def dim_expr(d) -> sympy.Expr:
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d)


def tensor_bytes(val) -> sympy.Expr:
    """Bytes of a (fake) tensor, a tuple of tensors, or 0 for anything else."""
    if isinstance(val, torch.Tensor):
        return sympy.Mul(*[dim_expr(d) for d in val.shape], sympy.Integer(val.element_size()))
    if isinstance(val, (tuple, list)):
        return sympy.Add(*[tensor_bytes(v) for v in val], sympy.Integer(0))
    return sympy.Integer(0)


def _shape_env(gm: fx.GraphModule):
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        for d in ([v] if isinstance(v, torch.SymInt) else getattr(v, "shape", ())):
            if isinstance(d, torch.SymInt):
                return d.node.shape_env
    return None


@dataclass
class SymbolicSizes:
    """Byte formulas of a graph's nodes and the values of their symbols at the plan shape."""

    names: dict[sympy.Symbol, str] = field(default_factory=dict)  # symbol -> readable name
    # symbol -> the other input dimensions it stands for: Dynamo gives equal sizes one symbol
    # (duck sizing), so ``labels.size(1)`` may be ``input_ids.size(1)``'s symbol
    aliases: dict[sympy.Symbol, list[str]] = field(default_factory=dict)
    values: dict[sympy.Symbol, int] = field(default_factory=dict)  # symbol -> value at plan shape
    _cache: dict[fx.Node, sympy.Expr] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, gm: fx.GraphModule, plan_shape: Mapping[str, tuple[int, ...]] | None = None) -> "SymbolicSizes":
        env = _shape_env(gm)
        sizes = cls()
        if env is None:
            return sizes
        for sym, sources in env.var_to_sources.items():
            if sources and sym.name.startswith("s"):  # sizes; skip float/unbacked symbols
                sizes.names[sym] = readable(sources[0].name)
                others = list(dict.fromkeys(readable(src.name) for src in sources[1:]))
                if others := [n for n in others if n != sizes.names[sym]]:
                    sizes.aliases[sym] = others
        for sym, val in env.backed_var_to_val.items():
            if sym in sizes.names:
                sizes.values[sym] = int(val)
        if plan_shape:
            sizes.values.update(sizes._resolve_plan_shape(plan_shape))
        return sizes

    def _resolve_plan_shape(self, plan_shape: Mapping[str, tuple[int, ...]]) -> dict[sympy.Symbol, int]:
        """The values ``plan_shape`` gives this graph's symbols (its keys were checked against the
        Dynamo graph's inputs: :func:`check_plan_shape`)."""
        by_name = {s.name: s for s in self.names}
        out = {}
        for key, dims in plan_shape.items():
            if key in by_name and len(dims) == 1:  # by symbol name: {"s52": [64]}
                out[by_name[key]] = dims[0]
                continue
            for sym, name in self.names.items():
                for n in (name, *self.aliases.get(sym, ())):
                    m = re.fullmatch(rf"{re.escape(key)}\.size\((\d+)\)", n)
                    if m and int(m.group(1)) < len(dims):
                        out[sym] = dims[int(m.group(1))]
        return out

    def nbytes(self, node: fx.Node) -> sympy.Expr:
        if node not in self._cache:
            self._cache[node] = tensor_bytes(node.meta.get("val"))
        return self._cache[node]

    def at(self, expr: sympy.Expr) -> int:
        """The formula's value at the plan shape."""
        v = expr.xreplace(self.values) if expr.free_symbols else expr
        try:
            return int(v)
        except TypeError:  # a symbol without a value (unbacked): count it as 1
            return int(v.xreplace({s: 1 for s in v.free_symbols}))

    def pretty(self, expr: sympy.Expr) -> str:
        """The formula with readable symbol names."""
        return str(expr.xreplace({s: sympy.Symbol(n) for s, n in self.names.items()}))

    def shape_at(self, val) -> tuple[int, ...]:
        return tuple(self.at(dim_expr(d)) for d in val.shape)
