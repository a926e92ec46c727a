"""Inner compilers: what runs fxmem's forward and backward graphs.

``eager`` runs the graph modules as they are, with two memory habits of a real compiler: the
boxed calling convention (inputs are freed at their last use) and in-place reuse of dead
intermediates by elementwise ops (``add(a, b)`` writes into ``a`` when nothing reads ``a`` later).
Inductor does both on its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .graph.liveness import last_reads, storage_roots

aten = torch.ops.aten

# out-of-place op -> in-place op writing into its first argument (same values, bit for bit)
_INPLACE = {aten.add.Tensor: aten.add_.Tensor, aten.sub.Tensor: aten.sub_.Tensor,
            aten.mul.Tensor: aten.mul_.Tensor, aten.div.Tensor: aten.div_.Tensor}
_COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def _log_softmax_backward_into_grad(grad, output, dim, dtype):
    # Row-wise two-pass kernel (sum, then write at the index it read): safe to alias grad and
    # the result; tests/test_inner.py checks bit equality.
    return aten._log_softmax_backward_data.out(grad, output, dim, dtype, out=grad)


def _softmax_backward_into_grad(grad, output, dim, dtype):
    return aten._softmax_backward_data.out(grad, output, dim, dtype, grad_input=grad)


_log_softmax_backward_into_grad._fxmem_writes_first = True  # liveness: no new storage
_softmax_backward_into_grad._fxmem_writes_first = True


# ops whose first argument (the incoming gradient) can receive their result
_INTO_FIRST = {aten._log_softmax_backward_data.default: _log_softmax_backward_into_grad,
               aten._softmax_backward_data.default: _softmax_backward_into_grad}


def _fresh_contiguous(val, like) -> bool:
    return (isinstance(val, torch.Tensor) and isinstance(like, torch.Tensor) and val.shape == like.shape
            and val.dtype == like.dtype and val.is_contiguous() and like.is_contiguous())


def reuse_dead_buffers(gm: fx.GraphModule) -> int:
    """Turn ``c = op(a, b)`` into ``c = op_(a, b)`` where ``a``'s storage dies at this node.

    ``a``'s storage must have been allocated by this graph (not an input: the caller may hold
    it), every node viewing that storage must be read no later than here, and ``c`` must have
    ``a``'s shape, dtype and contiguous layout. Returns how many ops were rewritten.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root = storage_roots(gm)  # a getitem counts as its whole tuple's storage: conservative
    last_use = last_reads(gm, root)

    def can_write(a, others, n) -> bool:
        r = root.get(a) if isinstance(a, fx.Node) else None
        return (r is not None and r.op == "call_function" and last_use[r] == pos[n]
                and _fresh_contiguous(n.meta.get("val"), a.meta.get("val"))
                and all(isinstance(b, (int, float)) or (_broadcasts_to(b, a) and root[b] is not r) for b in others))

    rewritten = 0
    for n in nodes:
        if n.op == "call_function" and n.target in _INTO_FIRST and can_write(n.args[0], [n.args[1]], n):
            n.target = _INTO_FIRST[n.target]
            rewritten += 1
            continue
        if n.op != "call_function" or n.target not in _INPLACE or len(n.args) != 2:
            continue
        a, b = n.args
        if can_write(a, [b], n):
            n.target = _INPLACE[n.target]
        elif n.target in _COMMUTATIVE and not n.kwargs and can_write(b, [a], n):  # x + y == y + x, bitwise
            n.target, n.args = _INPLACE[n.target], (b, a)
        else:
            continue
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _broadcasts_to(b, a: fx.Node) -> bool:
    if not isinstance(b, fx.Node):
        return False
    vb, va = b.meta.get("val"), a.meta.get("val")
    if not isinstance(vb, torch.Tensor):
        return False
    try:
        return torch.broadcast_shapes(vb.shape, va.shape) == va.shape
    except RuntimeError:
        return False


def tolerant_views(gm: fx.GraphModule) -> int:
    """``aten.view`` -> ``aten.reshape`` (a view whenever ``view`` would succeed, else a copy).

    Traced strides can disagree with what CPU kernels return: ``native_dropout_backward`` on a
    transposed gradient returns a permuted layout where its meta function says contiguous, and
    a later ``view`` then fails at run time (found by the property suite, in torch's own
    ``aot_eager`` too). The graphs are functional, so a copy in place of a view is safe.
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default
            count += 1
    if count:
        gm.recompile()
    return count


def eager(gm: fx.GraphModule, example_inputs: Any):
    """Run the graph as it is, boxed: the graph clears its argument list after unpacking it, so
    each saved tensor is freed at its last use in the backward, not when the backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    reuse_dead_buffers(gm)
    tolerant_views(gm)
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    run = gm.forward
    box = lambda args: run(args)  # noqa: E731
    box._boxed_call = True  # type: ignore[attr-defined]
    return box
