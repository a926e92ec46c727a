"""Fused kernels for fxmem: Triton on GPU, lean PyTorch on CPU, usable under ``vmap(grad(...))``.

Each family lives in its own module with its Triton kernels, its portable PyTorch
implementation, its functional ``torch.library`` ops (``fxmem::<name>`` and
``fxmem::<name>_backward``, for graph passes) and an eager API with autograd:

    linear_cross_entropy   loss from hidden states and the output projection, no logits kept
    bias_gelu              gelu(x + bias), backward recomputes the activation
    layer_norm, rms_norm   backward from the input and per-row statistics only
    swiglu, geglu          act(gate) * up, backward recomputes the activation
    seeded_dropout         mask regenerated from a seed in backward: nothing mask-sized kept
    attention              attention with dropout in (batch, head) slices: no [B, H, L, S] float buffer
    clip_and_accumulate    per-example norms, clip factors and fp32 clipped sums in one pass

Every function takes ``impl="auto" | "torch" | "triton"``: "auto" runs the portable PyTorch
implementation, and Triton on CUDA tensors when ``FXMEM_KERNELS_TRITON=1`` (off until the
kernels' CUDA tests, ``pytest -m cuda``, have passed on a GPU); "triton" always runs Triton (on
CPU tensors through the Triton interpreter: tests).
"""
from .attention import attention
from .attention import dropout_mask as attention_dropout_mask
from .bias_gelu import bias_gelu
from .clip_accumulate import clip_and_accumulate, clipped_sum, per_example_norms
from .dropout import seeded_dropout
from .glu import geglu, swiglu
from .linear_cross_entropy import linear_cross_entropy
from .norms import layer_norm, rms_norm

__all__ = [
    "attention", "attention_dropout_mask",
    "bias_gelu", "clip_and_accumulate", "clipped_sum", "geglu", "layer_norm", "linear_cross_entropy",
    "per_example_norms", "rms_norm", "seeded_dropout", "swiglu",
]
