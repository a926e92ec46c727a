"""fxmem_kernels.attention against torch's SDPA math path with the same dropout mask: bit-identical
outputs and gradients on CPU (the same ops per slice), in fp32 and bf16, with bool, float and
no masks, uneven slices, cross attention; the mask is torch's; clear errors for bad input."""
import pytest
import torch
import torch.nn.functional as F

from fxmem.profiling import saved_tensor_bytes
from fxmem_kernels.attention import attention, dropout_mask, heads_per_slice

MiB = 2**20


def _qkv(shape_q, keys, v_dim, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    b, h, length, dim = shape_q
    make = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()
    return make(b, h, length, dim), make(b, h, keys, dim), make(b, h, keys, v_dim)


def _both(q, k, v, mask, p, scale=None, slice_bytes=2 * MiB):
    """(eager SDPA, the kernel): outputs and q/k/v gradients under the same generator state."""
    go = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(9)).to(q.dtype)
    torch.manual_seed(0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    torch.manual_seed(0)
    keep = dropout_mask(q, k, p) if p else None
    out = attention(q, k, v, mask, keep, p, scale=scale, slice_bytes=slice_bytes)
    grads = torch.autograd.grad(out, (q, k, v), go)
    return (ref, *ref_grads), (out, *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bool_causal", "float_padding"])
def test_equals_the_math_path_bit_for_bit(dtype, mask):
    q, k, v = _qkv((2, 5, 24, 8), 24, 8, dtype)
    m = {"none": None, "bool_causal": torch.ones(24, 24, dtype=torch.bool).tril().expand(2, 1, 24, 24),
         "float_padding": torch.zeros(2, 1, 1, 24).index_fill_(-1, torch.tensor([20, 21]), float("-inf"))}[mask]
    ref, got = _both(q, k, v, m, 0.1)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("scale", [0.3, -0.3])
@pytest.mark.parametrize("slice_bytes", [1, 3 * 24 * 30 * 4, 2 * MiB])
def test_uneven_slices_cross_attention_and_a_given_scale(slice_bytes, scale):
    """Slices of 1 head, of 3 heads out of 5 (the last one short), and of all heads; keys of another
    length and v of another width than q; an explicit scale, negative too (q's factor negated)."""
    q, k, v = _qkv((2, 5, 24, 8), 30, 6, torch.float32)
    ref, got = _both(q, k, v, torch.rand(24, 30) > 0.3, 0.25, scale=scale, slice_bytes=slice_bytes)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_no_keys_gives_what_the_math_path_gives():
    q, k, v = _qkv((1, 2, 3, 4), 0, 4, torch.float32)
    ref, got = _both(q, k, v, None, 0.1)
    for a, b in zip(ref, got):
        assert a.shape == b.shape and torch.equal(a, b)


def test_without_dropout_it_is_attention_within_rounding():
    q, k, v = _qkv((1, 3, 16, 8), 16, 8, torch.float32)
    ref, got = _both(q, k, v, None, 0.0)  # eager takes the flash kernel here: other rounding
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_mask_is_torchs_dropout_mask():
    x, k = torch.randn(2, 3, 7, 9), torch.randn(2, 3, 9, 5)
    torch.manual_seed(4)
    _, mask = torch.ops.aten.native_dropout(x, 0.2, True)
    torch.manual_seed(4)
    assert torch.equal(dropout_mask(x[..., :5], k, 0.2), mask)


def test_keeps_nothing_but_its_inputs_where_the_math_path_keeps_scores():
    """Autograd keeps q, k, v and the bool mask (the caller's), nothing more; the math path keeps
    fp32 [B, H, L, S] buffers besides."""
    q, k, v = _qkv((2, 4, 64, 16), 64, 16, torch.float32)
    keep = dropout_mask(q, k, 0.1)
    assert saved_tensor_bytes(attention, q, k, v, None, keep, 0.1) == 0
    math_path = saved_tensor_bytes(F.scaled_dot_product_attention, q, k, v, dropout_p=0.1)
    assert math_path >= 2 * keep.numel() * 4


def test_heads_per_slice():
    assert int(heads_per_slice(12, 512, 512, 2 * MiB)) == 2
    assert int(heads_per_slice(12, 4096, 4096, 2 * MiB)) == 1  # at least one head
    assert int(heads_per_slice(3, 8, 8, 2 * MiB)) == 3  # at most all


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: attention(q[0], k, v, None, None, 0.0), r"\[batch, heads, length, dim\]"),
    (lambda q, k, v: attention(q, k[:, :2], v, None, None, 0.0), "shapes do not fit"),
    (lambda q, k, v: attention(q, k, v, None, None, 0.1), "keep .* must be given exactly when dropout_p > 0"),
    (lambda q, k, v: attention(q, k, v, None, torch.ones(2, 3, 4, 4), 0.1), "keep must be a bool tensor"),
    (lambda q, k, v: attention(q, k, v, None, None, 1.0), r"dropout_p must be in \[0, 1\)"),
    (lambda q, k, v: attention(q, k, v, torch.zeros(3, 4), None, 0.0), "does not broadcast"),
])
def test_bad_input_is_a_clear_error(call, match):
    q, k, v = _qkv((2, 3, 4, 5), 4, 5, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)
