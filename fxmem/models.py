"""Small models built from configs (no downloads): the demo's GPT, the benchmark and test models.

Every builder returns a :class:`Workload`: a module, one batch of inputs as keyword arguments and
how to get the scalar loss out of the module's output, so callers treat all models alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Workload:
    name: str
    model: nn.Module
    batch: dict[str, torch.Tensor]
    loss: Callable[[Any], torch.Tensor]  # model output -> scalar loss


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


def _tensor_loss(out: torch.Tensor) -> torch.Tensor:
    return out


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# --- a plain-PyTorch GPT (nanoGPT-style): the demo's model -------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A GPT in plain PyTorch: ``forward(input_ids, labels)`` returns the mean cross-entropy."""

    def __init__(self, vocab=4096, d=256, layers=4, heads=4, max_seq=1024, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for p in self.parameters():  # GPT-2's init: keeps the initial loss near log(vocab)
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def tiny_gpt(batch=8, seq=256, vocab=4096, d=256, layers=4, heads=4, dropout=0.0, seed=0) -> Workload:
    torch.manual_seed(seed)
    model = TinyGPT(vocab, d, layers, heads, max(seq, 1024), dropout)
    return Workload("tiny_gpt", model, _tokens(batch, seq, vocab, seed), _tensor_loss)


# --- Hugging Face models from configs ---------------------------------------------------------


def hf_gpt2(batch=8, seq=256, vocab=8192, d=256, layers=4, heads=4, dropout=0.0, seed=0) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=max(seq, 1024), n_embd=d, n_layer=layers, n_head=heads,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,  # training: no KV cache
    )
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # else HF logs a warning inside forward: a graph break before the loss
    return Workload("hf_gpt2", model, _tokens(batch, seq, vocab, seed), _hf_loss)


def hf_llama(batch=8, seq=256, vocab=8192, d=256, layers=4, heads=4, seed=0) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max(seq, 1024),
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return Workload("hf_llama", model, _tokens(batch, seq, vocab, seed), _hf_loss)


def hf_llama_lora(batch=8, seq=256, vocab=8192, d=256, layers=4, heads=4, rank=4, seed=0) -> Workload:
    """:func:`hf_llama` with peft LoRA adapters of ``rank`` on ``q_proj`` and ``v_proj``: only the
    adapters require grad. ``lora_B`` starts random (peft's zeros would give ``lora_A`` no
    gradient at the first step). Eager attention (vmap has batching rules for its ops)."""
    from peft import LoraConfig, get_peft_model

    w = hf_llama(batch, seq, vocab, d, layers, heads, seed)
    w.model.set_attn_implementation("eager")
    model = get_peft_model(w.model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                               lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return Workload("hf_llama_lora", model, w.batch, _hf_loss)


def hf_qwen2(batch=4, seq=256, vocab=32768, d=256, layers=4, heads=4, seed=0) -> Workload:
    """A Qwen2-family causal LM as its configs ship (grouped-query attention, untied head), with
    a real vocabulary: the logits and their loss dominate the step's memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=d, intermediate_size=11 * d // 4, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=max(seq, 1024),
        use_cache=False, tie_word_embeddings=False,
    )
    return Workload("hf_qwen2", Qwen2ForCausalLM(cfg), _tokens(batch, seq, vocab, seed), _hf_loss)


def hf_bert(batch=8, seq=256, vocab=30522, d=256, layers=4, heads=4, dropout=0.1, seed=0) -> Workload:
    """A BERT-family masked LM as its configs ship (dropout 0.1): 15% of the tokens are masked and
    only those carry labels (the others are -100, ignored by the loss)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * d, max_position_embeddings=max(seq, 512), hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, seq), generator=g)
    masked = torch.rand(batch, seq, generator=g) < 0.15
    labels = torch.where(masked, ids, -100)
    batch_ = {"input_ids": torch.where(masked, 103, ids), "labels": labels}  # 103: BERT's [MASK]
    return Workload("hf_bert", BertForMaskedLM(cfg), batch_, _hf_loss)


# --- a deep MLP chain -------------------------------------------------------------------------


class MLPChain(nn.Module):
    """``depth`` blocks of Linear -> GELU; ``forward(x, target)`` returns the mean squared error."""

    def __init__(self, width=512, depth=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(x, target)


def mlp_chain(batch=256, width=512, depth=16, seed=0) -> Workload:
    torch.manual_seed(seed)
    model = MLPChain(width, depth)
    g = torch.Generator().manual_seed(seed)
    batch_ = {"x": torch.randn(batch, width, generator=g), "target": torch.randn(batch, width, generator=g)}
    return Workload("mlp_chain", model, batch_, _tensor_loss)


BUILDERS: dict[str, Callable[..., Workload]] = {
    "tiny_gpt": tiny_gpt, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama, "hf_llama_lora": hf_llama_lora,
    "hf_qwen2": hf_qwen2, "hf_bert": hf_bert, "mlp_chain": mlp_chain,
}


def build(name: str, **kwargs: Any) -> Workload:
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(BUILDERS))}")
    return BUILDERS[name](**kwargs)

