"""The one place that says which aten ops may be recomputed, and from which level.

CHEAP ops (pointwise, views, casts, cheap reductions, norms, and the fused norm, activation and
seeded-dropout ops of pattern lowering) are recomputable at every level.
HEAVY ops (matmuls, attention, convolutions) only at level 1-2 (inside detected layers), under a
memory budget, or when a user rule selects their cluster. Random ops are recomputable once they
replay their generator (see ``replay``: Inductor's seeded random ops, and aten's wrapped with
their generator state); a random op that does not, and the states themselves, never are. Neither
are ops that read an input the step mutates (BatchNorm's running statistics, counters, in-place
updates of arguments: :func:`fxmem.graph.joint.mark_mutated_reads` marks them from AOTAutograd's
mutation record). Anything not listed is never recomputed.
"""

from __future__ import annotations

import operator

import torch
import torch._inductor.inductor_prims  # noqa: F401 - registers prims.inductor_* (seeded random ops)
import torch.fx as fx

from ..graph.joint import READS_MUTATED, is_random
from .replay import wrapped_target

aten = torch.ops.aten
prims = torch.ops.prims

CHEAP, HEAVY, NEVER = "cheap", "heavy", "never"

_VIEWS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.split, aten.split_with_sizes,
    aten.unbind, aten.alias, aten.detach, aten.as_strided, aten.narrow, aten.chunk, aten.unflatten,
    aten.flatten, aten.view_as_real, aten.view_as_complex, aten.diagonal,
}
_COPIES = {
    aten.clone, aten._to_copy, prims.convert_element_type, aten.contiguous, aten.cat, aten.stack,
    aten.lift_fresh_copy, aten.full, aten.zeros, aten.ones, aten.scalar_tensor, aten.arange,
    aten.full_like, aten.zeros_like, aten.ones_like, aten.empty, aten.where, aten.index, prims.iota,
    aten.gather, aten.embedding, aten.constant_pad_nd, aten.repeat, aten.index_select,
    aten.slice_scatter, aten.select_scatter, aten.tril, aten.triu, aten.masked_fill, aten.empty_like,
    aten.new_empty, aten.empty_strided, aten.roll,
}
_REDUCTIONS_AND_NORMS = {
    aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.var_mean,
    aten.std, aten.prod, aten.norm, aten.linalg_vector_norm, aten.logsumexp, aten.cumsum,
    aten._softmax, aten._safe_softmax, aten._log_softmax, aten.native_layer_norm, aten.native_group_norm,
    aten._fused_rms_norm, aten.rsqrt, aten.any, aten.all, aten.argmax,
}
# fxmem_kernels' fused forward ops (pattern lowering puts them in the graph): norms and
# activations, and the dropout whose mask a saved seed regenerates exactly.
_FUSED_CHEAP = {"fxmem::layer_norm", "fxmem::rms_norm", "fxmem::bias_gelu", "fxmem::glu", "fxmem::seeded_dropout",
                "fxmem::attention_dropout_mask"}  # the last: a random op, cheap when replayed
# ... and the fused attention, recomputable at a matmul's cost like the attention kernels below.
_FUSED_HEAVY = {"fxmem::attention"}
# Random ops, cheap when their generator is replayed: Inductor's take their seed as an input;
# aten's run under ``run_with_rng_state`` (their attention and matmul forms are HEAVY as usual).
_RANDOM = {
    prims.inductor_random, prims.inductor_randint, aten.native_dropout,
    aten.bernoulli, aten.rand, aten.rand_like, aten.randn, aten.randn_like, aten.randint, aten.randint_like,
    aten.normal, aten.uniform, aten.exponential, aten.randperm, aten.multinomial,
}
_HEAVY = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.convolution,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten.native_batch_norm,
}


def is_view(node: fx.Node) -> bool:
    return getattr(node.target, "overloadpacket", None) in _VIEWS


# of _COPIES: buffers whose contents are not a function of the op's arguments
_UNINITIALIZED = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided}


def is_copy(node: fx.Node) -> bool:
    """Whether ``node`` only moves data into a buffer of its own (a roll, a repeat, a gather):
    running it a second time costs one copy and gives the same values (``split.run_twice``)."""
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and kind(node) == CHEAP and packet in _COPIES and packet not in _UNINITIALIZED


def kind(node: fx.Node) -> str:
    """CHEAP, HEAVY or NEVER for a call_function node."""
    if node.op != "call_function" or is_random(node) or node.meta.get(READS_MUTATED):
        return NEVER
    replayed = wrapped_target(node)
    return _kind(node.target if replayed is None else replayed)


def _kind(target) -> str:
    if target is operator.getitem:
        return CHEAP
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return NEVER
    if packet in _VIEWS or packet in _COPIES or packet in _REDUCTIONS_AND_NORMS or packet in _RANDOM:
        return CHEAP
    if getattr(packet, "_qualified_op_name", None) in _FUSED_CHEAP:
        return CHEAP
    if getattr(packet, "_qualified_op_name", None) in _FUSED_HEAVY:
        return HEAVY
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return CHEAP
    if packet in _HEAVY:
        return HEAVY
    return NEVER
