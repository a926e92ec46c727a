"""Reading Dynamo's torch-level FX graphs: one name per operation however it was spelled.

Dynamo records ``0.5 * x`` as ``operator.mul``, ``x.pow(2)`` as a ``call_method``, ``F.linear`` as
``torch._C._nn.linear``; :func:`op` maps all of them to one canonical name, :func:`arg` reads an
argument by position or keyword (a method's ``self`` is position 0), :func:`val` is the fake
tensor Dynamo recorded for a node (logical, per-example shapes inside a ``vmap``).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

_FUNCTIONS = {
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    torch.true_divide: "div", operator.pow: "pow", torch.pow: "pow", operator.neg: "neg",
    torch.neg: "neg", torch.tanh: "tanh", torch.erf: "erf", torch.rsqrt: "rsqrt",
    torch.sqrt: "sqrt", torch.square: "square", torch.mean: "mean",
    F.gelu: "gelu", F.silu: "silu", F.layer_norm: "layer_norm", torch.layer_norm: "layer_norm",
    F.cross_entropy: "cross_entropy", F.linear: "linear", torch.addmm: "addmm",
    F.dropout: "dropout", operator.getitem: "getitem", torch.flatten: "flatten",
    torch.reshape: "reshape", F.scaled_dot_product_attention: "scaled_dot_product_attention",
}
_METHODS = {
    "add", "sub", "mul", "div", "pow", "neg", "tanh", "erf", "rsqrt", "sqrt", "square", "mean",
    "view", "reshape", "flatten", "contiguous", "float", "to", "type_as",
}
# What a method call's arguments are called (self first), for keyword lookups.
_PARAMS = {
    "cross_entropy": ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                      "reduction", "label_smoothing"),
    "layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
    "linear": ("input", "weight", "bias"),
    "addmm": ("input", "mat1", "mat2"),
    "gelu": ("input", "approximate"),
    "silu": ("input", "inplace"),
    "dropout": ("input", "p", "training", "inplace"),
    "scaled_dot_product_attention": ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                                     "enable_gqa"),
    "mean": ("input", "dim", "keepdim"),
    "pow": ("input", "exponent"),
    "to": ("input", "dtype"),
}
POINTWISE = {"add", "sub", "mul", "div", "pow", "neg", "tanh", "erf", "sqrt", "rsqrt", "square"}


def op(node: Any) -> str | None:
    """The canonical name of what ``node`` computes, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method" and node.target in _METHODS:
        return node.target
    return None


def arg(node: fx.Node, i: int, name: str | None = None, default: Any = None) -> Any:
    """Argument ``i`` (counting a method's ``self`` as 0), or keyword ``name``, or ``default``."""
    if i < len(node.args):
        return node.args[i]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    if name is None:
        params = _PARAMS.get(op(node) or "", ())
        if i < len(params) and params[i] in node.kwargs:
            return node.kwargs[params[i]]
    return default


def val(node: Any) -> Any:
    """The example value Dynamo recorded (a fake tensor, a SymInt, ...); constants as they are."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def tensor(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def only_users(node: fx.Node, allowed) -> bool:
    """Every user of ``node`` is in ``allowed``."""
    return all(u in allowed for u in node.users)


def commuted(node: fx.Node) -> list[tuple[Any, Any]]:
    """``(a, b)`` and, for add/mul, ``(b, a)``: the operand orders to try."""
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    return [(a, b), (b, a)] if op(node) in ("add", "mul") else [(a, b)]


def is_cast_to(node: Any, dtype: torch.dtype | None = None) -> bool:
    """``x.float()``, ``x.to(dtype)`` or ``x.type_as(y)`` (to ``dtype`` when given)."""
    o = op(node)
    if o not in ("float", "to", "type_as"):
        return False
    v = tensor(node)
    if o == "to":
        extra = list(node.args[1:]) + [x for k, x in node.kwargs.items() if k != "copy"]
        if len(extra) != 1 or not isinstance(extra[0], torch.dtype):
            return False  # device moves, non_blocking, ... are not plain casts
    if o == "float" and (len(node.args) != 1 or node.kwargs):
        return False
    return v is not None and (dtype is None or v.dtype == dtype)


def same_shape(a: Any, b: Any) -> bool:
    ta, tb = tensor(a), tensor(b)
    return ta is not None and tb is not None and tuple(ta.shape) == tuple(tb.shape)


def last_dim_vector(node: Any, size) -> bool:
    """A 1-D tensor of length ``size`` (a bias or a norm weight)."""
    t = tensor(node)
    return t is not None and t.dim() == 1 and t.shape[0] == size
