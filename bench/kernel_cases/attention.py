import torch
import torch.nn.functional as F

from fxmem_kernels.attention import attention, dropout_mask

from . import Case

P, SEED = 0.1, 1234


def _causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def cases(quick: bool):
    b, h, length, d = (1, 4, 128, 32) if quick else (2, 12, 512, 64)  # GPT-2 small at 2 x 512 tokens

    def make():
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randn(b, h, length, d, generator=g, requires_grad=True) for _ in range(3))

    def sdpa(q, k, v):  # CPU with dropout: torch's math path
        torch.manual_seed(SEED)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(length), dropout_p=P).sum()

    def fused(q, k, v):  # the same mask: drawn from the same generator state
        torch.manual_seed(SEED)
        return attention(q, k, v, _causal(length), dropout_mask(q, k, P), P).sum()

    return [Case("attention", f"B={b} H={h} L={length} D={d} p={P} causal fp32", make,
                 {"sdpa (math path)": sdpa, "fxmem": fused}, rtol=0.0,
                 notes="same dropout mask (same generator state): bit-identical losses and gradients")]
