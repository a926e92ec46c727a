"""The DP-SGD benchmark's model: a plain-PyTorch GPT without weight tying, and its per-example loss.

fxmem.models.TinyGPT ties the head to the embedding (as GPT-2 does); DP-SGD benchmarks count
every parameter's per-example gradient once, so this one keeps them apart. Shared by
bench/dpsgd.py and tests/test_dpsgd.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # Attention written out (nanoGPT's non-flash path): vmap has batching rules for these
        # ops, not for CPU flash attention, whose per-example fallback loops over the batch.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = att @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``forward(input_ids [b, t], labels [b, t])`` -> mean next-token cross-entropy."""

    def __init__(self, vocab: int = 4096, d: int = 128, layers: int = 2, heads: int = 4, max_seq: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)  # not tied to wte
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def gpt(vocab=4096, d=128, layers=2, heads=4, seq=64, batch=32, seed=0):
    """``(model, params, input_ids, labels)``: params detached (the clipped-gradient functions
    differentiate them functionally), tokens from a seeded generator."""
    torch.manual_seed(seed)
    model = GPT(vocab, d, layers, heads, seq)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return model, params, ids, ids.clone()


def per_example_loss(model: nn.Module):
    """``loss(params, ids [t], labels [t])`` for ONE example (no batch dim), via functional_call."""
    def loss(params, ids, labels):
        return functional_call(model, params, (ids[None], labels[None]))
    return loss
