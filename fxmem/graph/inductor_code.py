"""Inductor's buffers, read back from the wrapper code it generated for a graph.

fxmem's simulator counts one buffer per FX node; Inductor fuses pointwise chains into kernels
whose intermediates never exist, reuses dead buffers in place (``buf3 = buf0; del buf0  #
reuse``) and frees each buffer where its last reader ran (``del buf0``). The wrapper's ``call``
function states all of it, for a fresh compile and a cache hit alike (``CompiledFxGraph.
source_code``), so the report reads Inductor's schedule from there:

- ``buf = empty_strided_cpu(shape, stride, dtype)``: an allocation of the buffer's storage;
- ``buf = torch.ops...(...)`` (an extern kernel that returns its output): an allocation at the
  call of the size its ``assert_size_stride`` states (or of each ``buf[i]`` item's, for several
  outputs), in the dtype of the FX node it came from (named in the ``Source Nodes`` comment
  above the call; Inductor does not print it), else of its first floating-point argument;
- ``a = b`` and ``a = reinterpret_tensor(b, ...)``: another name for ``b``'s storage;
- ``del name``: one name fewer; the storage is freed when no name is left;
- ``buf = torch.ops.fxmem.offload.default(x)``: a copy in host memory, no device bytes;
- the inputs: ``counted`` ones (a backward's kept values and incoming gradients) exist when the
  graph starts and are freed at their ``del``; the others (parameters, the batch) are not counted;
- an extern kernel's own buffers, allocated and freed around the call: a CPU convolution's
  scratch measured for the layouts Inductor gives it (``graph.measured``: oneDNN's reorders
  depend on them, and Inductor picks channels-last where eager would not), scaled with the
  batch; another op's from fxmem's scratch formula of the FX node it came from (named in the
  ``Source Nodes`` comment), else from its model of the op on the call's arguments.

Events are ``(kind, name, bytes formula)`` as ``graph.liveness.walk`` makes them, in the
symbols of the graph's shape environment (Inductor prints the same ``s0``-style names), so
``predict_peak`` evaluates them at any shape. Work inside an extern kernel (a convolution's
scratch) is counted where fxmem's scratch model knows the op.
"""
from __future__ import annotations

import ast
import re
from typing import Mapping

import sympy
import torch

from .liveness import Event

__all__ = ["CodeError", "schedule"]

_ALLOC = re.compile(r"^empty_strided(_\w+)?$")
_VIEW = {"reinterpret_tensor", "as_strided"}
_CONVOLUTION = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")


class CodeError(ValueError):
    """The wrapper code has a statement the reader does not know (the report keeps fxmem's own
    simulation of the graph then)."""


def _call_body(code: str) -> list[str]:
    lines = code.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"\s*def call\((self, )?args\):", ln)), None)
    if start is None:
        raise CodeError("no call(args) function in the wrapper code")
    indent = len(lines[start]) - len(lines[start].lstrip()) + 4
    body = []
    for ln in lines[start + 1:]:
        if ln.strip() and len(ln) - len(ln.lstrip()) < indent:
            break
        body.append(ln.strip())
    return body


_ORIGINS = re.compile(r"^# (?:Topologically Sorted |Unsorted )?Source Nodes: \[([^\]]*)\]")


def _statements(line: str) -> list[str]:
    if not line or line.startswith("#"):
        return [line] if _ORIGINS.match(line) else []
    line = line.split("  #")[0]
    return [s.strip() for s in line.split("; ") if s.strip()]


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def _resolve(func: str) -> object:
    """``torch.ops.aten.mm.default`` -> that op; None for anything else."""
    if not func.startswith("torch.ops."):
        return None
    obj: object = torch
    for part in func.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _dtypes(out: object) -> object:
    """An op's outputs as their dtypes, in the same structure."""
    if isinstance(out, torch.Tensor):
        return out.dtype
    return [_dtypes(o) for o in out] if isinstance(out, (list, tuple)) else None


def _dtype(val: object) -> torch.dtype | None:
    if isinstance(val, torch.Tensor):
        return val.dtype
    return val if isinstance(val, torch.dtype) else None


def _item(node: ast.Subscript) -> tuple[str | None, list[int]]:
    """``buf7[1][0]`` -> ("buf7", [1, 0]); (None, []) for anything else."""
    path = []
    while isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, int):
        path.insert(0, node.slice.value)
        node = node.value
    return (node.id, path) if isinstance(node, ast.Name) and path else (None, [])


class _Reader:
    def __init__(self, input_bytes: Mapping[str, sympy.Expr], input_dtypes: Mapping[str, torch.dtype],
                 counted: set[str], scratch: Mapping[str, tuple[str, sympy.Expr]], values: Mapping[str, int],
                 outputs: Mapping[str, tuple[str, object]]):
        self.input_bytes, self.counted, self.scratch, self.values = input_bytes, counted, scratch, values
        self.outputs = outputs
        self.origins: list[str] = []
        self.layout: dict[str, tuple[list[sympy.Expr], list[sympy.Expr]]] = {}  # name -> (shape, stride)
        self.dtype: dict[str, torch.dtype] = dict(input_dtypes)
        self.storage: dict[str, str] = {}   # name -> the storage (its first name) it points into
        self.refs: dict[str, int] = {}      # storage -> names pointing into it
        self.size: dict[str, sympy.Expr] = {}  # storage -> bytes
        # extern outputs whose size is still to come -> (their value as the FX node's meta has it,
        # or their dtype; the call's event: its outputs are allocated there, once their asserts
        # state their sizes)
        self.pending: dict[str, tuple[object, int]] = {}
        self.tuples: dict[str, tuple[object, int]] = {}   # the calls, for their items
        # A call's result holds its items until it is deleted, whatever names of them are deleted
        # first (``buf26 = buf25[0]; ...; del buf26; ...; del buf25``): item -> its call's name,
        # and a call's name -> the items it holds.
        self.item_of: dict[str, str] = {}
        self.held: dict[str, list[str]] = {}
        self.subs: dict[sympy.Symbol, sympy.Expr] = {}
        self.events: list[Event] = []
        self.inputs: set[str] = set()
        self.fresh: list[bool] = []  # per returned value: a storage this graph allocated

    def expr(self, node: ast.AST) -> sympy.Expr:
        return sympy.sympify(ast.unparse(node)).xreplace(self.subs)

    def alloc(self, name: str, nbytes: sympy.Expr) -> None:
        self.storage[name], self.refs[name], self.size[name] = name, 1, nbytes
        self.events.append(("alloc", name, nbytes))

    def alias(self, name: str, of: str) -> None:
        root = self.storage.get(of)
        if root is None:  # a view of an input that is not counted (a parameter): nothing to free
            return
        self.storage[name] = root
        self.refs[root] += 1
        self.dtype.setdefault(name, self.dtype.get(of))

    def drop(self, name: str) -> None:
        root = self.storage.pop(name, None)
        if root is not None:
            self.unref(root)
        self.tuples.pop(name, None)
        for item in self.held.pop(name, ()):  # a call's result deleted: its items' last holder
            self.unref(item)

    def unref(self, root: str) -> None:
        self.refs[root] -= 1
        if self.refs[root] == 0:
            self.events.append(("free", root, self.size[root]))

    def sized(self, name: str, shape: ast.AST, stride: ast.AST, dtype: torch.dtype | None,
              at: int | None = None) -> None:
        """``name`` is a buffer of this shape, strides and dtype: allocated now, or (an extern
        kernel's output, sized by a later assert) at the call, event ``at``."""
        dims = [self.expr(e) for e in shape.elts] if isinstance(shape, ast.Tuple) else []
        steps = [self.expr(e) for e in stride.elts] if isinstance(stride, ast.Tuple) else []
        elements = sympy.Integer(1) + sympy.Add(*[(d - 1) * s for d, s in zip(dims, steps)])
        nbytes = sympy.expand(elements * (dtype or torch.float32).itemsize)
        self.dtype[name] = dtype or torch.float32
        self.layout[name] = (dims, steps)
        if at is None:
            self.alloc(name, nbytes)
            return
        self.storage[name], self.refs[name], self.size[name] = name, 1, nbytes
        self.events[at][2].append((name, nbytes))

    def produced(self, func: str, call: ast.Call) -> object:
        """What an extern call returns, as the FX node it came from has it (a tensor or a
        structure of them), else the dtype of its first tensor argument."""
        for name in self.origins:
            target, val = self.outputs.get(name, ("", None))
            if target and target in func and val is not None:
                return val
        op = _resolve(func)
        if op is not None:  # run it on fake tensors of its arguments: its outputs' dtypes
            from torch._subclasses.fake_tensor import FakeTensorMode

            try:
                args = [self.value(a) for a in call.args]
                kwargs = {k.arg: self.value(k.value) for k in call.keywords}
                with FakeTensorMode(allow_non_fake_inputs=True):
                    if "rng_state" in func:  # a random op's replay: its op's outputs (after the state)
                        out = args[1](*args[2:], **kwargs) if "run_with" in func else \
                            [torch.empty(0, dtype=torch.uint8), args[0](*args[1:], **kwargs)]
                    else:
                        out = op(*args, **kwargs)
                return _dtypes(out)
            except Exception:  # noqa: BLE001 - an argument it cannot stand in for
                pass
        return self.first_dtype(call)

    def first_dtype(self, call: ast.Call) -> torch.dtype | None:
        """The dtype of the call's first floating-point tensor argument (indices and masks are
        not what a kernel returns), else of its first tensor argument."""
        found = [self.dtype[n.id] for a in call.args for n in ast.walk(a)
                 if isinstance(n, ast.Name) and self.dtype.get(n.id) is not None]
        return next((d for d in found if d.is_floating_point), found[0] if found else None)

    def extern(self, func: str, call: ast.Call) -> None:
        """An extern kernel's own buffers: fxmem's scratch formula of the FX node it came from
        (in the graph's symbols), else fxmem's scratch model of the op on these arguments (a
        fake tensor each, in the layouts Inductor gives them: a measured convolution's reorders
        depend on them), at the compiled shape, scaled with the first argument's first dimension
        (the batch: a per-example temporary)."""
        from .measured import MEASURED
        from .scratch import op_scratch

        op, nodes, keywords = _resolve(func), list(call.args), {k.arg: k.value for k in call.keywords}
        if func == "extern_kernels.convolution":  # aten.convolution's arguments, by keyword
            op, keywords = torch.ops.aten.convolution.default, {}
            nodes = nodes[:2] + [{k.arg: k.value for k in call.keywords}.get(k, ast.Constant(None))
                                 for k in _CONVOLUTION[2:]]
        if op not in MEASURED:
            for name in self.origins:
                target, nbytes = self.scratch.get(name, ("", 0))
                if target and target in func:
                    self.events += [("alloc", f"{name}.scratch", nbytes), ("free", f"{name}.scratch", nbytes)]
                    return
        if op is None:
            return
        try:
            args = [self.value(a) for a in nodes]
            kwargs = {k: self.value(v) for k, v in keywords.items()}
            nbytes = op_scratch(op, args, kwargs, None)
            batch = self.batch(nodes[0]) if nodes else None
        except Exception:  # noqa: BLE001 - an argument it cannot stand in for: not counted
            return
        if nbytes != 0:
            if batch is not None and batch.free_symbols:  # on the compiled batch's fake tensors
                nbytes = nbytes * batch / int(batch.xreplace({x: self.values[x.name] for x in batch.free_symbols}))
            self.events += [("alloc", f"{func}.scratch", nbytes), ("free", f"{func}.scratch", nbytes)]

    def batch(self, a: ast.AST) -> sympy.Expr | None:
        """The first dimension of a tensor argument, as a formula."""
        if isinstance(a, ast.Call) and _dotted(a.func) in _VIEW and isinstance(a.args[1], ast.Tuple):
            return self.expr(a.args[1].elts[0]) if a.args[1].elts else None
        if isinstance(a, ast.Name) and self.layout.get(a.id, ([], []))[0]:
            return self.layout[a.id][0][0]
        return None

    def value(self, a: ast.AST) -> object:
        """A call's argument as the op would see it: a fake CPU tensor of the buffer's shape,
        strides and dtype at the compiled shape, or the literal."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        def ints(exprs):
            return [int(e.xreplace({x: self.values[x.name] for x in e.free_symbols})) for e in exprs]

        if isinstance(a, ast.Attribute):  # an op passed along (a random op's replay): torch.ops...
            return _resolve(_dotted(a))
        if isinstance(a, (ast.List, ast.Tuple)):
            return type(ast.literal_eval("[]") if isinstance(a, ast.List) else ())(self.value(e) for e in a.elts)
        if isinstance(a, ast.Call) and _dotted(a.func) in _VIEW:
            shape, stride = ([self.expr(e) for e in t.elts] for t in a.args[1:3])
            dtype = self.dtype[a.args[0].id]
        elif isinstance(a, ast.Name) and a.id in self.layout:
            (shape, stride), dtype = self.layout[a.id], self.dtype[a.id]
        else:
            return ast.literal_eval(a)
        with FakeTensorMode():
            return torch.empty_strided(ints(shape), ints(stride), dtype=dtype or torch.float32)

    def statement(self, s: str) -> None:
        origins = _ORIGINS.match(s)
        if origins:
            self.origins = [n.strip() for n in origins.group(1).split(",")]
            return
        try:
            tree = ast.parse(s).body[0]
        except (SyntaxError, IndexError) as e:
            raise CodeError(f"cannot parse {s!r}") from e
        if isinstance(tree, ast.Delete):
            for t in tree.targets:
                if isinstance(t, ast.Name):
                    self.drop(t.id)
            return
        if isinstance(tree, ast.Expr) and isinstance(tree.value, ast.Call):
            call = tree.value
            if _dotted(call.func) == "assert_size_stride" and isinstance(call.args[0], ast.Name):
                name = call.args[0].id
                if name in self.pending:
                    val, at = self.pending.pop(name)
                    self.sized(name, call.args[1], call.args[2], _dtype(val), at)
                    call_name = self.item_of.pop(name, None)
                    if call_name in self.tuples:  # still held by the call's result
                        self.refs[name] += 1
                        self.held.setdefault(call_name, []).append(name)
                elif name not in self.layout and all(isinstance(t, ast.Tuple) for t in call.args[1:3]):
                    self.layout[name] = ([self.expr(e) for e in call.args[1].elts],
                                         [self.expr(e) for e in call.args[2].elts])  # an input's
            else:  # a kernel writing into buffers it was given
                self.extern(_dotted(call.func), call)
            return
        if isinstance(tree, ast.Assign) and len(tree.targets) == 1:
            target, value = tree.targets[0], tree.value
            if isinstance(target, ast.Tuple):  # the inputs: a, b, c = args
                if _dotted(value) == "args":
                    self.inputs = {t.id for t in target.elts}
                    for t in target.elts:
                        if t.id in self.counted:
                            self.dtype.setdefault(t.id, None)
                            self.alloc(t.id, self.input_bytes[t.id])
                return
            name = target.id if isinstance(target, ast.Name) else None
            if name is None:
                return
            if isinstance(value, ast.Name) and value.id in self.pending:  # an extern output, renamed
                self.pending[name] = self.pending.pop(value.id)
                self.tuples.pop(value.id, None)
            elif isinstance(value, ast.Name):
                self.alias(name, value.id)
                if value.id in self.layout:
                    self.layout[name] = self.layout[value.id]
            elif isinstance(value, ast.Subscript) and _item(value)[0] in self.tuples:
                base, path = _item(value)
                val, at = self.tuples[base]
                for i in path:  # the item's value, where the node's is a structure
                    val = val[i] if isinstance(val, (list, tuple)) and i < len(val) else val
                self.pending[name] = (val, at)  # sized by its assert_size_stride
                self.item_of[name] = base
            elif isinstance(value, ast.Call):
                func = _dotted(value.func)
                if _ALLOC.match(func):
                    dtype = getattr(torch, _dotted(value.args[2]).split(".")[-1])
                    self.sized(name, value.args[0], value.args[1], dtype)
                elif func in _VIEW:
                    if isinstance(value.args[0], ast.Name):
                        self.alias(name, value.args[0].id)
                        self.dtype.setdefault(name, self.dtype.get(value.args[0].id))
                        if all(isinstance(t, ast.Tuple) for t in value.args[1:3]):
                            self.layout[name] = tuple([self.expr(e) for e in t.elts] for t in value.args[1:3])
                elif func.endswith("fxmem.offload.default"):  # a host copy (``fxmem.host_memory``): no device bytes
                    return
                elif not any(k.arg == "out" for k in value.keywords):  # an extern kernel's own output
                    self.pending[name] = self.tuples[name] = (self.produced(func, value), len(self.events))
                    self.events.append(("outputs", name, []))
                    self.extern(func, value)
            elif not isinstance(value, ast.Constant):  # a size: ps0 = 512*s0
                try:
                    self.subs[sympy.Symbol(name)] = self.expr(value)
                except (sympy.SympifyError, TypeError, SyntaxError):
                    pass
            return
        if isinstance(tree, ast.Return):
            elts = tree.value.elts if isinstance(tree.value, ast.Tuple) else [tree.value]
            for e in elts:
                base = e.args[0] if isinstance(e, ast.Call) and _dotted(e.func) in _VIEW else e
                root = self.storage.get(base.id) if isinstance(base, ast.Name) else None
                self.fresh.append(root is not None and root not in self.inputs)
            return
        # anything else (an if for a guard, a loop) is not part of the buffers' story


def schedule(code: str, input_bytes: Mapping[str, sympy.Expr], input_dtypes: Mapping[str, torch.dtype],
             counted: set[str], scratch: Mapping[str, tuple[str, sympy.Expr]] = {},  # noqa: B006
             values: Mapping[str, int] = {}, outputs: Mapping[str, tuple[str, object]] = {},  # noqa: B006
             ) -> tuple[list[Event], list[bool]]:
    """The allocations and frees of the wrapper ``code``'s ``call`` in order. ``counted``: the
    inputs that exist only for this graph (freed at their ``del``), with ``input_bytes`` their
    sizes; ``input_dtypes``: every input's dtype (an extern kernel's output takes its first
    argument's); ``scratch``: FX node name -> (its target, its scratch bytes), for the nodes
    that have any; ``values``: the symbols' values at the compiled shape (a measured op's
    layouts); ``outputs``: FX node name -> (its target, its meta value), for extern outputs'
    dtypes. Also, per value it returns, whether its storage is one this graph allocated (a
    forward's copy of a weight in another layout, kept for the backward under the weight's
    name, is). Raises :class:`CodeError` on a statement it cannot read."""
    r = _Reader(input_bytes, input_dtypes, counted, scratch, values, outputs)
    for line in _call_body(code):
        for s in _statements(line):
            r.statement(s)
    alive = {root for root in r.storage.values()}
    r.events += [("free", root, r.size[root]) for root in sorted(alive, key=list(r.size).index)]
    events = []  # an extern call's outputs, allocated at the call (those never sized: unknown, not counted)
    for kind, name, b in r.events:
        events += [("alloc", n, e) for n, e in b] if kind == "outputs" else [(kind, name, b)]
    return events, r.fresh
