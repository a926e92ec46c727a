"""Small random models for property tests: a spec (plain data, shrinks well) and its module."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCKS = ("mlp", "swiglu", "attention", "conv1d")
NORMS = ("layernorm", "rmsnorm", "none")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


@dataclass(frozen=True)
class ModelSpec:
    """A stack of residual blocks over token embeddings, ending in a (maybe tied) output head."""
    vocab: int = 32
    d: int = 16
    blocks: tuple[str, ...] = ("mlp",)
    norm: str = "layernorm"
    activation: str = "gelu"
    hidden: int = 32          # MLP / SwiGLU width
    heads: int = 2
    residual: bool = True
    tied: bool = False
    dropout: float = 0.0
    batch: int = 2
    seq: int = 8


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):  # as Llama writes it: fp32 statistics, cast back, then the weight
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _act(name: str, x):
    return {"gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
            "silu": F.silu, "relu": F.relu}[name](x)


class Block(nn.Module):
    def __init__(self, kind: str, spec: ModelSpec):
        super().__init__()
        self.kind, self.spec = kind, spec
        d, h = spec.d, spec.hidden
        self.norm = {"layernorm": lambda: nn.LayerNorm(d), "rmsnorm": lambda: RMSNorm(d),
                     "none": nn.Identity}[spec.norm]()
        if kind == "mlp":
            self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)
        elif kind == "swiglu":
            self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
            self.down = nn.Linear(h, d, bias=False)
        elif kind == "attention":
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        elif kind == "conv1d":
            self.conv = nn.Conv1d(d, d, kernel_size=3, padding=2)
        else:
            raise ValueError(f"block kind {kind!r}; allowed: {BLOCKS}")
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x):
        y = self.norm(x)
        if self.kind == "mlp":
            y = self.down(_act(self.spec.activation, self.up(y)))
        elif self.kind == "swiglu":
            y = self.down(F.silu(self.gate(y)) * self.up(y))
        elif self.kind == "attention":
            b, t, d = y.shape
            heads = self.spec.heads
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in self.qkv(y).split(d, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = self.proj(y.transpose(1, 2).reshape(b, t, d))
        else:  # causal conv over the sequence
            y = self.conv(y.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        y = self.drop(y)
        return x + y if self.spec.residual else y


class Net(nn.Module):
    """``Net(spec)(input_ids, labels) -> scalar loss``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.d)
        self.blocks = nn.ModuleList(Block(k, spec) for k in spec.blocks)
        self.head = nn.Linear(spec.d, spec.vocab, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight
        with torch.no_grad():  # small outputs keep random models' gradients well scaled
            for p in self.parameters():
                if p.dim() > 1:
                    p.mul_(1 / math.sqrt(p.shape[-1]))

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(spec: ModelSpec, seed: int = 0) -> tuple[Net, dict[str, torch.Tensor]]:
    """The module (seeded) and a batch of inputs for it."""
    torch.manual_seed(seed)
    model = Net(spec)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)
    return model, {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
