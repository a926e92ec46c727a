"""Symbolic sizes: every tensor's bytes as a sympy expression of named input dimensions.

With ``dynamic=True`` Dynamo's symbols (``s52``) stand for input dimensions; we name them after the
first input they came from (``input_ids.size(0)``) so formulas read well. Static shapes give
plain integers. ``SymbolicSizes.at(expr)`` evaluates a formula at the plan shape.

Data-dependent sizes (``nonzero``, a boolean mask's selection, a size read with ``.item()``, under
``torch._dynamo.config.capture_dynamic_output_shape_ops`` / ``capture_scalar_outputs``) are
unbacked symbols (``u0``): they have no hint. Each is given a value (:func:`unbacked_value`): the
value seen at run time where the ShapeEnv recorded it (``propagate_real_tensors``), else the
upper bound of its value range (``nonzero``'s: the input's numel), else a default (Inductor's
``unbacked_symint_fallback``) within its range.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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


_UNBOUNDED = 2 ** 40  # an upper bound above this is no bound (``int_oo``, ``sys.maxsize - 1``)


def unbacked_value(env, sym: sympy.Symbol) -> tuple[int, str]:
    """(the value fxmem plans an unbacked symbol at, how it was chosen: ``"seen"``, ``"upper
    bound"`` or ``"default"``). The seen value where the ShapeEnv has one (real-tensor
    propagation), else the upper bound of the symbol's value range, else Inductor's
    ``unbacked_symint_fallback`` clamped into the range."""
    seen = getattr(env, "real_tensor_prop_unbacked_vals", {}).get(sym)
    if seen is not None:
        return int(seen), "seen"
    vr = env.var_to_range.get(sym)
    lo, hi = (vr.lower, vr.upper) if vr is not None else (0, None)
    if hi is not None and hi.is_number and hi < _UNBOUNDED:
        return int(hi), "upper bound"
    from torch._inductor import config as inductor_config

    value = int(inductor_config.unbacked_symint_fallback)
    if getattr(lo, "is_number", False) and lo > -_UNBOUNDED:
        value = max(value, int(lo))
    return value, "default"


def definitely(check: Callable[[], bool]) -> bool:
    """``check()``, False where it depends on a data-dependent size it cannot decide (a question
    about a shape with an unbacked symbol: the answer that assumes nothing)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return bool(check())
    except GuardOnDataDependentSymNode:
        return False


def _graph_symbols(gm: fx.GraphModule) -> list[sympy.Symbol]:
    """The symbols in the sizes (and symbolic integers) of ``gm``'s node values, in graph order."""
    found: dict[sympy.Symbol, None] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        for t in (v if isinstance(v, (tuple, list)) else [v]):
            dims = [t] if isinstance(t, torch.SymInt) else t.shape if isinstance(t, torch.Tensor) else ()
            for d in dims:
                if isinstance(d, torch.SymInt):
                    found.update(dict.fromkeys(sorted(d.node.expr.free_symbols, key=str)))
    return list(found)


def _is_unbacked(sym: sympy.Symbol) -> bool:
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return symbol_is_type(sym, SymT.UNBACKED_INT)


def _shape_env(gm: fx.GraphModule, placeholders: bool = True):
    """The ShapeEnv of the symbols of ``gm``'s placeholders (``placeholders=False``: of any node's
    value: a graph with static inputs has one where it makes a data-dependent size)."""
    nodes = gm.graph.find_nodes(op="placeholder") if placeholders else gm.graph.nodes
    for n in nodes:
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
    # unbacked (data-dependent) symbol -> how its value in ``values`` was chosen (:func:`unbacked_value`)
    unbacked: dict[sympy.Symbol, str] = field(default_factory=dict)
    _env: Any = field(default=None, repr=False)
    _cache: dict[fx.Node, sympy.Expr] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, gm: fx.GraphModule, plan_shape: Mapping[str, tuple[int, ...]] | None = None) -> "SymbolicSizes":
        env = _shape_env(gm) or _shape_env(gm, placeholders=False)
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
        sizes._env = env
        sizes.add_unbacked(_graph_symbols(gm))
        return sizes

    def add_unbacked(self, symbols) -> None:
        """Give the unbacked symbols among ``symbols`` that have none a value (:func:`unbacked_value`)."""
        for sym in symbols:
            if sym not in self.values and self._env is not None and _is_unbacked(sym):
                self.values[sym], self.unbacked[sym] = unbacked_value(self._env, sym)

    def unbacked_notes(self) -> list[str]:
        """One line per unbacked symbol: the value the plan took for it and why."""
        return [f"data-dependent size {s.name} planned at {self.values[s]} ({how})"
                for s, how in sorted(self.unbacked.items(), key=lambda kv: kv[0].name)]

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
        if not expr.free_symbols:
            return int(expr)
        self.add_unbacked(expr.free_symbols - self.values.keys())  # one made after the plan's start
        v = expr.xreplace(self.values)
        try:
            return int(v)
        except TypeError:  # a symbol without a value (not from this graph's ShapeEnv): count it as 1
            return int(v.xreplace({s: 1 for s in v.free_symbols}))

    def pretty(self, expr: sympy.Expr) -> str:
        """The formula with readable symbol names."""
        return str(expr.xreplace({s: sympy.Symbol(n) for s, n in self.names.items()}))

    def shape_at(self, val) -> tuple[int, ...]:
        return tuple(self.at(dim_expr(d)) for d in val.shape)
