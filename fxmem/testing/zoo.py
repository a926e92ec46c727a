"""A zoo of tiny models, one or two of each architecture family fxmem should handle: the models of
the conformance suite (issue [zoo]: fxmem's step equals eager's on every one) and of the budget
matrix (issue [budget]: every memory budget on every model).

Hugging Face models are built from their config classes (no downloads), with the dropout each
family's config ships; the rest are plain PyTorch. Every builder takes its sizes and ``seed`` as
keyword arguments and returns a :class:`fxmem.models.Workload`; the defaults are tiny (an eager
step takes a few milliseconds to a few hundred).

    from fxmem.testing.zoo import ZOO, FAMILY, zoo_build
    w = zoo_build("t5")
    w.loss(w.model(**w.batch)).backward()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models import Workload, _tokens


def _hf(name: str, cls: str, batch: dict[str, torch.Tensor], seed: int, **config: Any) -> Workload:
    """``transformers.<cls>`` built from ``<cls>``'s config class (the name before ``For``/``LMHead``)."""
    import transformers

    model_cls = getattr(transformers, cls)
    torch.manual_seed(seed)
    model = model_cls(model_cls.config_class(**config))
    return Workload(name, model, batch, lambda out: out.loss)


def _masked(batch: int, seq: int, vocab: int, seed: int, mask_id: int, low: int = 4) -> dict[str, torch.Tensor]:
    """Tokens in ``[low, vocab)`` with 15% replaced by ``mask_id``: only those carry labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (batch, seq), generator=g)
    masked = torch.rand(batch, seq, generator=g) < 0.15
    masked[:, 0] = True  # at least one label a row
    return {"input_ids": torch.where(masked, mask_id, ids), "labels": torch.where(masked, ids, -100)}


def _seq2seq(batch: int, seq: int, vocab: int, seed: int, low: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (2, batch, seq), generator=g)
    return {"input_ids": ids[0], "labels": ids[1]}


def _images(batch: int, size: int, classes: int, seed: int, channels: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, channels, size, size, generator=g),
            "labels": torch.randint(0, classes, (batch,), generator=g)}


def _decoder(name: str, cls: str, batch: int, seq: int, vocab: int, d: int, layers: int, heads: int, kv_heads: int,
             seed: int, **config: Any) -> Workload:
    """A Llama-like causal LM (Llama, Mistral, Gemma2, Mixtral): the config fields they share."""
    return _hf(name, cls, _tokens(batch, seq, vocab, seed), seed, vocab_size=vocab, hidden_size=d,
               intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, max_position_embeddings=max(seq, 128), use_cache=False, **config)


# --- encoders, decoders, encoder-decoders -----------------------------------------------------


def roberta(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """RoBERTa masked LM (dropout 0.1); position ids start after the padding id 1, hence ``seq + 2``."""
    return _hf("roberta", "RobertaForMaskedLM", _masked(batch, seq, vocab, seed, mask_id=3), seed, vocab_size=vocab,
               hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * d,
               max_position_embeddings=seq + 2)


def gpt2(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """GPT-2 (dropout 0.1, tied head)."""
    w = _hf("gpt2", "GPT2LMHeadModel", _tokens(batch, seq, vocab, seed), seed, vocab_size=vocab, n_positions=seq,
            n_embd=d, n_layer=layers, n_head=heads, bos_token_id=vocab - 1, eos_token_id=vocab - 1, use_cache=False)
    w.model.loss_type = "ForCausalLM"  # else HF logs a warning inside forward: a graph break before the loss
    return w


def llama(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    return _decoder("llama", "LlamaForCausalLM", batch, seq, vocab, d, layers, heads, heads, seed)


def llama_tied(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """Llama whose head is the embedding (``tie_word_embeddings=True``): one parameter, two uses."""
    return _decoder("llama_tied", "LlamaForCausalLM", batch, seq, vocab, d, layers, heads, heads, seed,
                    tie_word_embeddings=True)


def mistral(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, kv_heads=2, seed=0) -> Workload:
    """Mistral: grouped-query attention (``kv_heads < heads``), sliding window shorter than ``seq``."""
    return _decoder("mistral", "MistralForCausalLM", batch, seq, vocab, d, layers, heads, kv_heads, seed,
                    sliding_window=seq // 2)


def gemma2(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, kv_heads=2, seed=0) -> Workload:
    """Gemma2: soft-capped attention and final logits, alternating sliding/full attention layers."""
    return _decoder("gemma2", "Gemma2ForCausalLM", batch, seq, vocab, d, layers, heads, kv_heads, seed,
                    head_dim=d // heads, query_pre_attn_scalar=d // heads, sliding_window=seq // 2)


def t5(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """T5 (dropout 0.1, relative position buckets); labels are shifted into the decoder's inputs."""
    return _hf("t5", "T5ForConditionalGeneration", _seq2seq(batch, seq, vocab, seed), seed, vocab_size=vocab,
               d_model=d, d_kv=d // heads, d_ff=2 * d, num_layers=layers, num_heads=heads, decoder_start_token_id=0,
               use_cache=False)


def bart(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """BART (dropout 0.1, ``final_logits_bias`` buffer, tied embeddings)."""
    return _hf("bart", "BartForConditionalGeneration", _seq2seq(batch, seq, vocab, seed), seed, vocab_size=vocab,
               d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
               decoder_attention_heads=heads, encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d,
               max_position_embeddings=max(seq, 64), use_cache=False)


# --- vision, MoE, state space, speech ---------------------------------------------------------


def vit(batch=2, size=32, patch=8, d=32, layers=2, heads=4, classes=10, seed=0) -> Workload:
    return _hf("vit", "ViTForImageClassification", _images(batch, size, classes, seed), seed, image_size=size,
               patch_size=patch, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
               intermediate_size=2 * d, num_labels=classes)


def resnet(batch=2, size=32, width=16, classes=10, seed=0) -> Workload:
    """A two-stage basic-block ResNet (BatchNorm in training mode: running stats are updated)."""
    return _hf("resnet", "ResNetForImageClassification", _images(batch, size, classes, seed), seed,
               embedding_size=width, hidden_sizes=[width, 2 * width], depths=[1, 1], layer_type="basic",
               num_labels=classes)


def mixtral(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, kv_heads=2, experts=4, seed=0) -> Workload:
    """Mixtral: top-2 routing over ``experts`` experts; the router's load-balancing loss is in the loss
    (its logits come through hooks that transformers installs on the first call: fxmem installs
    them before Dynamo traces, see :mod:`fxmem.graph_breaks`)."""
    return _decoder("mixtral", "MixtralForCausalLM", batch, seq, vocab, d, layers, heads, kv_heads, seed,
                    num_local_experts=experts, num_experts_per_tok=2, output_router_logits=True)


def qwen2_moe(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, kv_heads=2, experts=4, seed=0) -> Workload:
    """Qwen2-MoE: top-2 of ``experts`` routed experts plus a gated shared expert in every layer,
    load-balancing loss included."""
    return _decoder("qwen2_moe", "Qwen2MoeForCausalLM", batch, seq, vocab, d, layers, heads, kv_heads, seed,
                    num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=d,
                    shared_expert_intermediate_size=2 * d, output_router_logits=True)


def mamba(batch=2, seq=16, vocab=512, d=32, layers=2, seed=0) -> Workload:
    """Mamba: the selective scan in plain PyTorch (a loop over the sequence), no CUDA kernels."""
    return _hf("mamba", "MambaForCausalLM", _tokens(batch, seq, vocab, seed), seed, vocab_size=vocab,
               hidden_size=d, state_size=8, num_hidden_layers=layers, use_cache=False)


def whisper(batch=2, frames=32, mels=16, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """Whisper on ``frames`` frames of ``mels`` log-mel features (two convolutions, then the transformer)."""
    g = torch.Generator().manual_seed(seed)
    batch_ = {"input_features": torch.randn(batch, mels, frames, generator=g),
              "labels": torch.randint(4, vocab, (batch, seq), generator=g)}
    return _hf("whisper", "WhisperForConditionalGeneration", batch_, seed, vocab_size=vocab, num_mel_bins=mels,
               d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
               decoder_attention_heads=heads, encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d,
               max_source_positions=frames // 2, max_target_positions=max(seq, 64), pad_token_id=1, bos_token_id=2,
               eos_token_id=2, decoder_start_token_id=2, begin_suppress_tokens=None, use_cache=False)


# --- plain PyTorch ----------------------------------------------------------------------------


def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class ConvNet(nn.Module):
    """Two conv-BatchNorm-ReLU-pool stages, dropout, a linear classifier: ``forward`` returns the loss."""

    def __init__(self, width=16, classes=10, dropout=0.1):
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, width), nn.MaxPool2d(2), _conv_bn(width, 2 * width),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.features(pixel_values)), labels)


class LSTMLM(nn.Module):
    """Embedding, a stacked ``nn.LSTM``, a linear head: next-token loss. Dropout between the layers is
    ``nn.LSTM``'s default, 0: with it on, AOTAutograd's decomposition of the LSTM draws other masks than
    eager's fused kernel (any AOT backend: no equal step to compare with). Dynamo traces it only with
    ``torch._dynamo.config.allow_rnn = True`` (else it leaves the whole forward to eager)."""

    def __init__(self, vocab=512, d=32, layers=2, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.lstm(self.embed(input_ids))[0])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class UNet(nn.Module):
    """One level of a UNet: down (conv-BN, pool), bottleneck, up (upsample, concat the skip, conv-BN)."""

    def __init__(self, channels=3, width=16):
        super().__init__()
        self.down, self.mid = _conv_bn(channels, width), _conv_bn(width, 2 * width)
        self.up = _conv_bn(3 * width, width)
        self.out = nn.Conv2d(width, channels, 1)

    def forward(self, pixel_values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        skip = self.down(pixel_values)
        x = F.interpolate(self.mid(F.max_pool2d(skip, 2)), scale_factor=2, mode="nearest")
        return F.mse_loss(self.out(self.up(torch.cat([x, skip], dim=1))), target)


def _plain(name: str, make: Callable[[], nn.Module], batch: dict[str, torch.Tensor], seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload(name, make(), batch, lambda out: out)


def convnet(batch=2, size=32, width=16, classes=10, seed=0) -> Workload:
    return _plain("convnet", lambda: ConvNet(width, classes), _images(batch, size, classes, seed), seed)


def lstm(batch=2, seq=16, vocab=512, d=32, layers=2, dropout=0.0, seed=0) -> Workload:
    return _plain("lstm", lambda: LSTMLM(vocab, d, layers, dropout), _tokens(batch, seq, vocab, seed), seed)


def unet(batch=2, size=32, width=16, seed=0) -> Workload:
    g = torch.Generator().manual_seed(seed)
    batch_ = {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
              "target": torch.randn(batch, 3, size, size, generator=g)}
    return _plain("unet", lambda: UNet(3, width), batch_, seed)


ZOO: dict[str, Callable[..., Workload]] = {
    "roberta": roberta, "gpt2": gpt2, "llama": llama, "llama_tied": llama_tied, "mistral": mistral,
    "gemma2": gemma2, "t5": t5, "bart": bart, "vit": vit, "resnet": resnet, "mixtral": mixtral, "mamba": mamba,
    "whisper": whisper, "convnet": convnet, "lstm": lstm, "unet": unet, "qwen2_moe": qwen2_moe,
}

FAMILY: dict[str, str] = {
    "roberta": "encoder", "gpt2": "decoder", "llama": "decoder", "llama_tied": "decoder", "mistral": "decoder",
    "gemma2": "decoder", "t5": "encoder-decoder", "bart": "encoder-decoder", "vit": "vision", "resnet": "conv",
    "mixtral": "moe", "mamba": "state-space", "whisper": "speech", "convnet": "conv", "lstm": "rnn", "unet": "conv",
    "qwen2_moe": "moe",
}


# The ``thorough`` profile: shapes where activations, not parameters, make the peak (so that
# recompute and lowering can pay), real vocabulary sizes; a step takes up to a second here.
_TEXT = dict(batch=4, seq=128, vocab=32000, d=128, layers=4, heads=4)
_IMAGE = dict(batch=8, size=64)
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {name: {} for name in ZOO},
    "thorough": {
        **{name: _TEXT for name in ("roberta", "gpt2", "llama", "llama_tied", "mistral", "gemma2", "t5", "bart",
                                    "mixtral", "qwen2_moe")},
        "vit": dict(_IMAGE, patch=4, d=128, layers=4, heads=4),
        "resnet": dict(_IMAGE, width=32), "convnet": dict(_IMAGE, width=32), "unet": dict(_IMAGE, width=32),
        "mamba": dict(batch=4, seq=64, vocab=32000, d=128, layers=4),  # the scan is unrolled over seq
        "whisper": dict(batch=4, frames=256, mels=80, seq=128, vocab=32000, d=128, layers=4, heads=4),
        "lstm": dict(batch=4, seq=32, vocab=8192, d=128, layers=2),  # unrolled over seq too
    },
}


def zoo_build(name: str, profile: str = "tiny", **kwargs: Any) -> Workload:
    """The zoo model ``name`` at the sizes of ``profile`` ("tiny": CI's, "thorough"), updated
    with ``kwargs`` (its sizes, ``seed``)."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(sorted(ZOO))}")
    if profile not in PROFILES:
        raise ValueError(f"unknown zoo profile {profile!r}; known: {', '.join(PROFILES)}")
    return ZOO[name](**{**PROFILES[profile][name], **kwargs})


def eager_step(model: nn.Module, w: Workload) -> torch.Tensor:
    """One training step of ``model`` on ``w.batch`` (seed 1: the same dropout masks every time):
    the loss, detached."""
    torch.manual_seed(1)
    loss = w.loss(model(**w.batch))
    loss.backward()
    return loss.detach()


@dataclass
class Conformance:
    """One compiled step against eager's (:func:`conform`)."""
    compiled: Any                 # the compiled model (for its reports)
    peak_bytes: int               # the measured peak of the third step
    fallbacks: list[str]          # "falling back to a safe plan" warnings
    mismatches: list[str]         # the loss or a parameter gradient not equal to eager's

    @property
    def ok(self) -> bool:
        return not self.fallbacks and not self.mismatches


def conform(w: Workload, options: dict, reference: tuple[nn.Module, torch.Tensor], rtol: float = 1e-4,
            atol: float = 1e-6) -> Conformance:
    """Compile a copy of ``w.model`` with fxmem ``options`` (eager inner compiler unless they say
    otherwise), run a step and two more (the third measured: HF classification heads recompile
    on the second call), and compare the first with ``reference`` (the eager model after
    :func:`eager_step`, its loss): the loss and every parameter gradient."""
    import copy
    import warnings

    import fxmem
    from fxmem.profiling import step_perf

    ref, ref_loss = reference
    model = copy.deepcopy(w.model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(allow_rnn=True):
        warnings.simplefilter("always")
        loss = eager_step(compiled, w)
        grads = [None if q.grad is None else q.grad.clone() for q in model.parameters()]
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with step_perf("cpu") as perf:
                eager_step(compiled, w)
    fallbacks = [str(c.message) for c in caught if "falling back to a safe plan" in str(c.message)]
    mismatches = [] if fxmem.report(compiled).graphs else ["fxmem compiled no graph (Dynamo ran the model eagerly)"]
    pairs = [("loss", loss, ref_loss)] + [(n, g, p.grad) for (n, p), g in zip(ref.named_parameters(), grads)]
    for name, got, want in pairs:
        if (got is None) != (want is None):
            mismatches.append(f"{name}: gradient {'missing' if got is None else 'unexpected'}")
        elif got is not None:
            try:
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
            except AssertionError as e:
                mismatches.append(f"{name}: {' '.join(str(e).split())}")
    return Conformance(compiled, perf.result.peak_bytes, fallbacks, mismatches)
