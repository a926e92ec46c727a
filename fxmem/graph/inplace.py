"""In-place forms of out-of-place ops: what the eager inner compiler may rewrite a node into.

Kept apart from the rewrite itself (``fxmem.graph.reuse``) because liveness reads
:data:`WRITES_INTO_FIRST` too: a call that writes into its first argument allocates nothing.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# out-of-place op -> in-place op writing into its first argument (same values, bit for bit)
INPLACE = {aten.add.Tensor: aten.add_.Tensor, aten.sub.Tensor: aten.sub_.Tensor,
         aten.mul.Tensor: aten.mul_.Tensor, aten.div.Tensor: aten.div_.Tensor}
COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def _log_softmax_backward_into_grad(grad, output, dim, dtype):
    # Row-wise two-pass kernel (sum, then write at the index it read): safe to alias grad and
    # the result; tests/test_inner.py checks bit equality.
    return aten._log_softmax_backward_data.out(grad, output, dim, dtype, out=grad)


def _softmax_backward_into_grad(grad, output, dim, dtype):
    return aten._softmax_backward_data.out(grad, output, dim, dtype, grad_input=grad)


def _dropout_backward_into_grad(grad, mask, scale):
    # ATen computes ``grad * mask * scale`` into a new tensor through a temporary: in place, the
    # same two products in the same order (bit for bit), and only the mask's float copy is
    # allocated (the scratch model's ``native_dropout_backward`` temporary).
    return grad.mul_(mask).mul_(scale)


# ops whose first argument (the incoming gradient) can receive their result
INTO_FIRST = {aten._log_softmax_backward_data.default: _log_softmax_backward_into_grad,
              aten._softmax_backward_data.default: _softmax_backward_into_grad,
              aten.native_dropout_backward.default: _dropout_backward_into_grad}

# functions whose result is their first argument's storage (liveness: no new allocation)
WRITES_INTO_FIRST = frozenset(INTO_FIRST.values())
