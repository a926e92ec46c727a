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
    """A pre-norm transformer block; ``causal=False``: bidirectional attention (an encoder's)."""

    def __init__(self, d: int, heads: int, causal: bool = True, dropout: float = 0.0):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.drop = nn.Dropout(dropout)
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
        if self.causal:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf"))
        y = self.drop(att.softmax(dim=-1)) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


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

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t).contiguous()  # batched: Opacus views it
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, criterion=None) -> torch.Tensor:
        """Mean next-token cross-entropy; ``criterion``: Opacus's ghost-clipping criterion."""
        b, t, v = logits.shape
        args = (logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))
        if criterion is None:
            return F.cross_entropy(*args)
        return criterion(*args, shape=(b, t - 1))  # Opacus's ghost criterion: per-example mean over tokens

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.logits(input_ids), labels)


class BertClassifier(nn.Module):
    """A BERT-base-like sequence classifier in plain PyTorch (``nn.Linear``, ``nn.Embedding``,
    ``nn.LayerNorm``: every layer has a native Opacus grad sampler): token, position and segment
    embeddings, ``layers`` bidirectional blocks (BERT-base: 12 x 768, 12 heads, FFN 3072,
    dropout 0.1 as its config ships, pre-norm here), a tanh pooler on the first token and a
    linear head. ``forward(input_ids [b, t], labels [b])`` -> mean cross-entropy."""

    def __init__(self, vocab: int = 30522, d: int = 768, layers: int = 12, heads: int = 12, max_seq: int = 512,
                 classes: int = 2, dropout: float = 0.1):
        super().__init__()
        self.wte, self.wpe, self.wtt = nn.Embedding(vocab, d), nn.Embedding(max_seq, d), nn.Embedding(2, d)
        self.ln_e, self.drop = nn.LayerNorm(d), nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, causal=False, dropout=dropout) for _ in range(layers))
        self.ln_f, self.pooler, self.head = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, classes)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t).contiguous()
        x = self.drop(self.ln_e(self.wte(input_ids) + self.wpe(pos) + self.wtt(torch.zeros_like(input_ids))))
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(torch.tanh(self.pooler(self.ln_f(x)[:, 0]))))

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, criterion=None) -> torch.Tensor:
        return (criterion or F.cross_entropy)(logits, labels)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.logits(input_ids), labels)


class Logits(nn.Module):
    """``model.logits`` as a module's forward (the same parameters): what Opacus and
    ``make_private`` wrap, the criterion applied outside."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m.logits(ids)


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
