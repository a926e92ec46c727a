"""Classify the code after a per-example region: which values are per example (and along which
dim the batch runs), which are sums over the batch, and which do not depend on the region.

The analysis proves, op by op, that a value is computed from each example independently
(``Batched``) or is a sum over the examples (a *partial-sum point*: ``sum`` over the batch dim).
Ops it cannot prove raise :class:`Unsupported` with the op named; the caller then keeps the
unchunked graph. The vocabulary is what clipping code uses: pointwise math, views and reshapes
that keep the batch leading, reductions over other dims, ``cat`` along other dims, norms, and
``clip.clip_and_sum`` (``fxmem.dpsgd``'s whole epilogue as one call).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .clip import clip_and_sum
from .regions import Region, Unsupported


def _op(node: fx.Node) -> str:
    """A node as an error names it: its name and its op, not the whole node."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name!r} ({target})"


@dataclass(frozen=True)
class Batched:
    dim: int            # where the batch runs in this value


OUTER, REDUCED = "outer", "reduced"  # independent of the region / downstream of a batch sum

_POINTWISE_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.clamp, torch.clip,
    torch.sqrt, torch.rsqrt, torch.square, torch.abs, torch.exp, torch.log, torch.reciprocal,
    torch.maximum, torch.minimum, torch.where, torch.pow, torch.nan_to_num,
}
_POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "clamp", "clip", "clamp_min", "clamp_max", "sqrt",
    "rsqrt", "square", "abs", "exp", "log", "reciprocal", "pow", "neg", "maximum", "minimum",
    "float", "double", "half", "bfloat16", "to", "type", "type_as", "detach", "contiguous",
    "nan_to_num",
}
_REDUCE_FUNCS = {torch.sum: "sum", torch.mean: "mean", torch.amax: "amax", torch.norm: "norm",
                 torch.linalg.vector_norm: "norm", torch._C._linalg.linalg_vector_norm: "norm"}
_REDUCE_METHODS = {"sum": "sum", "mean": "mean", "amax": "amax", "norm": "norm"}
_VIEW_METHODS = {"view", "reshape"}


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_batch(size, batch) -> bool:
    """Whether a traced size is the batch size: equal ints, or the same symbol (compared as
    expressions, so no shape guard is added after tracing)."""
    if isinstance(batch, fx.Node):
        val = batch.meta.get("example_value")
        if isinstance(size, torch.SymInt) and isinstance(val, torch.SymInt):
            return size.node.expr == val.node.expr
        batch = val.node.maybe_as_int() if isinstance(val, torch.SymInt) else val
    return isinstance(size, int) and size == batch


def arg_nodes(args) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out


def _kind_of(node: fx.Node) -> tuple[str, str]:
    if node.op == "call_function":
        if node.target in _POINTWISE_FUNCS:
            return "pointwise", ""
        if node.target in _REDUCE_FUNCS:
            return "reduce", _REDUCE_FUNCS[node.target]
        if node.target is torch.cat:
            return "cat", ""
        if node.target is torch.reshape:
            return "view", ""
    if node.op == "call_method":
        if node.target in _POINTWISE_METHODS:
            return "pointwise", ""
        if node.target in _REDUCE_METHODS:
            return "reduce", _REDUCE_METHODS[node.target]
        if node.target in _VIEW_METHODS:
            return "view", ""
    return "other", ""


class Epilogue:
    """``kinds[node]``: ``Batched``, ``OUTER`` or ``REDUCED`` for every node outside the region;
    ``partials``: the batch sums, in graph order; ``batch_shape_args``: view nodes whose leading
    shape argument is the literal batch size (the chunk graph rewrites it); ``matvec_sums``: how
    many of the sums ``clip_and_sum`` takes (as matrix-vector products)."""

    def __init__(self, graph: fx.Graph, region: Region):
        self.region = region
        self.kinds: dict[fx.Node, object] = {}
        self.partials: list[fx.Node] = []
        self.batch_shape_args: list[fx.Node] = []
        self.matvec_sums = 0
        inside = set(region.nodes)
        for node in graph.nodes:
            if node in inside:
                if node in region.outputs:
                    self.kinds[node] = Batched(0)
                continue
            if node.op == "output":
                continue
            self.kinds[node] = self._classify(node)

    def _classify(self, node: fx.Node):
        kinds = [self.kinds.get(a, OUTER) for a in arg_nodes((node.args, node.kwargs))]
        if any(a in self.region.nodes and a not in self.region.outputs
               for a in arg_nodes((node.args, node.kwargs))):
            raise Unsupported(f"{_op(node)} reads a value from inside the vmap region")
        batched = [k for k in kinds if isinstance(k, Batched)]
        if not batched:
            return REDUCED if REDUCED in kinds else OUTER
        if REDUCED in kinds:
            raise Unsupported(f"{_op(node)} mixes per-example values with a batch sum "
                              "(it needs the whole batch at once)")
        if node.op == "call_function" and node.target is clip_and_sum:
            return self._clip_and_sum(node, kinds)
        source = node.args[0] if node.target is operator.getitem else None
        if isinstance(source, fx.Node) and source.target is clip_and_sum:
            if node.args[1] == len(source.args) - 2 - int(source.args[1]):  # the last output: the norms
                return Batched(0)
            self.partials.append(node)  # a leaf's batch sum
            return REDUCED
        kind, name = _kind_of(node)
        rule = {"pointwise": self._pointwise, "reduce": self._reduce, "cat": self._cat,
                "view": self._view}.get(kind)
        if rule is None:
            raise Unsupported(f"cannot prove that {_op(node)} acts on each example "
                              "independently")
        return rule(node, name) if kind == "reduce" else rule(node)

    def _clip_and_sum(self, node: fx.Node, kinds: list):
        """``clip_and_sum(C, weighted, *tensors)``: every tensor per example along dim 0 (its
        outputs are classified at their ``getitem``s)."""
        if node.kwargs or any(k != Batched(0) for k in kinds) or len(kinds) != len(node.args) - 2:
            raise Unsupported(f"{_op(node)} takes values that are not per example along dim 0")
        self.matvec_sums += len(kinds) - int(node.args[1])
        return Batched(0)

    def _pointwise(self, node: fx.Node):
        out = _shape(node)
        if out is None:
            raise Unsupported(f"no shape known for {_op(node)}")
        dims = set()
        for a in arg_nodes((node.args, node.kwargs)):
            shape, kind = _shape(a), self.kinds.get(a, OUTER)
            if shape is None:
                continue
            offset = len(out) - len(shape)
            if isinstance(kind, Batched):
                dims.add(kind.dim + offset)
            else:
                dims.add(None)  # checked below, once the batch dim is known
        batch_dims = {d for d in dims if d is not None}
        if len(batch_dims) != 1:
            raise Unsupported(f"{_op(node)} combines per-example values whose batch dims "
                              "do not line up")
        (d,) = batch_dims
        for a in arg_nodes((node.args, node.kwargs)):
            shape, kind = _shape(a), self.kinds.get(a, OUTER)
            if shape is None or isinstance(kind, Batched):
                continue
            pos = d - (len(out) - len(shape))
            if pos >= 0 and shape[pos] != 1:
                raise Unsupported(f"{_op(node)} broadcasts {a.name} across the batch dim")
        return Batched(d)

    def _reduce(self, node: fx.Node, name: str):
        (src,) = [a for a in arg_nodes(node.args[:1])]
        d = self.kinds[src].dim
        shape = _shape(src)
        dim = node.kwargs.get("dim", node.args[2] if name == "norm" and len(node.args) > 2 else
                              node.args[1] if name != "norm" and len(node.args) > 1 else None)
        keepdim = node.kwargs.get("keepdim", False)
        if name == "norm" and node.op == "call_function" and node.target is torch.norm:
            dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if dim is None:
            dims = set(range(len(shape)))
        else:
            dims = {x % len(shape) for x in (dim if isinstance(dim, (tuple, list)) else (dim,))}
        if any(not isinstance(x, int) for x in dims):
            raise Unsupported(f"{_op(node)}: reduction dims are not constants")
        if d not in dims:
            return Batched(d if keepdim else d - sum(1 for x in dims if x < d))
        if name != "sum":
            raise Unsupported(f"{_op(node)} takes a {name} over the batch; only a sum over "
                              "the batch can be accumulated chunk by chunk")
        self.partials.append(node)
        return REDUCED

    def _cat(self, node: fx.Node):
        tensors = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        kinds = {self.kinds.get(t, OUTER) for t in tensors}
        if len(kinds) != 1 or not isinstance(next(iter(kinds)), Batched):
            raise Unsupported(f"{_op(node)} concatenates per-example and other values")
        d = next(iter(kinds)).dim
        if dim % len(_shape(tensors[0])) == d:
            raise Unsupported(f"{_op(node)} concatenates along the batch dim")
        return Batched(d)

    def _view(self, node: fx.Node):
        src = node.args[0]
        if self.kinds[src] != Batched(0):
            raise Unsupported(f"{_op(node)} reshapes a value whose batch dim is not leading")
        out = _shape(node)
        B = self.region.batch_size
        shape = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) \
            else node.args[1:]
        shape = node.kwargs.get("shape", shape)
        if out is None or not out or not _is_batch(out[0], B) or not shape or not (
                shape[0] is B or shape[0] == -1 or _is_batch(shape[0], B)):
            raise Unsupported(f"{_op(node)} does not keep the batch as its leading dim")
        # Rows of a row-major reshape with B leading rows are exactly the examples.
        if shape[0] is B or (shape[0] != -1 and _is_batch(shape[0], B)):
            self.batch_shape_args.append(node)
        return Batched(0)
