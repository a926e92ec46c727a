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


def mamba(batch=2, seq=16, vocab=512, d=32, layers=2, seed=0, associative_scan=False) -> Workload:
    """Mamba: the selective scan in plain PyTorch (a loop over the sequence), no CUDA kernels.

    transformers' Mamba runs that loop in eager but switches to torch's ``associative_scan``
    (``config.use_associative_scan``, on by default) when Dynamo traces it: another algorithm,
    whose backward holds more (its tree levels and full-size slice gradients). The zoo pins the
    loop so that the compiled step computes what the eager step and Hugging Face's checkpointing
    compute under any backend; ``associative_scan=True`` builds the config's default, which
    fxmem also has Dynamo trace as the loop up to 256 steps (``fxmem.graph_breaks``;
    docs/benchmarks.md).
    """
    return _hf("mamba", "MambaForCausalLM", _tokens(batch, seq, vocab, seed), seed, vocab_size=vocab,
               hidden_size=d, state_size=8, num_hidden_layers=layers, use_cache=False,
               use_associative_scan=associative_scan)


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


def _causal(name: str, cls: str, batch: int, seq: int, vocab: int, seed: int, **config: Any) -> Workload:
    return _hf(name, cls, _tokens(batch, seq, vocab, seed), seed, vocab_size=vocab, use_cache=False, **config)


def gptj(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """GPT-J: attention and MLP in parallel from one LayerNorm, partial rotary (dropout 0.0)."""
    return _causal("gptj", "GPTJForCausalLM", batch, seq, vocab, seed, n_positions=max(seq, 64), n_embd=d,
                   n_layer=layers, n_head=heads, rotary_dim=d // heads // 2, bos_token_id=1, eos_token_id=1)


def gpt_neox(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """GPT-NeoX (Pythia): parallel residual with two LayerNorms, fused QKV, rotary (dropout 0.0)."""
    return _causal("gpt_neox", "GPTNeoXForCausalLM", batch, seq, vocab, seed, hidden_size=d, num_hidden_layers=layers,
                   num_attention_heads=heads, intermediate_size=4 * d, max_position_embeddings=max(seq, 64),
                   bos_token_id=1, eos_token_id=1)


def bloom(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """BLOOM: ALiBi position biases, LayerNorm after the embedding (dropout 0.0)."""
    return _causal("bloom", "BloomForCausalLM", batch, seq, vocab, seed, hidden_size=d, n_layer=layers, n_head=heads,
                   bos_token_id=1, eos_token_id=1)


def mpt(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """MPT: ALiBi, no biases, LayerNorm without bias (dropout 0.0)."""
    return _causal("mpt", "MptForCausalLM", batch, seq, vocab, seed, d_model=d, n_layers=layers, n_heads=heads,
                   max_seq_len=max(seq, 64))


def falcon(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """Falcon-7B style: multi-query attention (one key/value head), parallel attention and MLP."""
    return _causal("falcon", "FalconForCausalLM", batch, seq, vocab, seed, hidden_size=d, num_hidden_layers=layers,
                   num_attention_heads=heads, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                   bos_token_id=1, eos_token_id=1)


def gpt_bigcode(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """GPTBigCode (StarCoder): multi-query attention, learned positions (dropout 0.1)."""
    return _causal("gpt_bigcode", "GPTBigCodeForCausalLM", batch, seq, vocab, seed, n_positions=max(seq, 64), n_embd=d,
                   n_layer=layers, n_head=heads, multi_query=True, bos_token_id=1, eos_token_id=1)


def deepseek_v3(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, experts=4, seed=0) -> Workload:
    """DeepSeek-V3: multi-head latent attention, a dense first layer, then routed experts beside a
    shared expert (group-limited top-2 routing)."""
    return _decoder("deepseek_v3", "DeepseekV3ForCausalLM", batch, seq, vocab, d, layers, heads, heads, seed,
                    n_routed_experts=experts, num_experts_per_tok=2, moe_intermediate_size=d, n_shared_experts=1,
                    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)


def albert(batch=2, seq=16, vocab=512, d=32, layers=3, heads=4, seed=0) -> Workload:
    """ALBERT masked LM: one layer's weights applied ``layers`` times, factorized embedding (dropout 0)."""
    return _hf("albert", "AlbertForMaskedLM", _masked(batch, seq, vocab, seed, mask_id=3), seed, vocab_size=vocab,
               embedding_size=d // 2, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
               intermediate_size=2 * d, max_position_embeddings=max(seq, 64))


def deberta_v2(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    """DeBERTa-v2 masked LM: disentangled attention (content-to-position and position-to-content over
    log-bucketed relative positions), dropout 0.1."""
    return _hf("deberta_v2", "DebertaV2ForMaskedLM", _masked(batch, seq, vocab, seed, mask_id=3), seed,
               vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
               intermediate_size=2 * d, max_position_embeddings=max(seq, 64), relative_attention=True,
               pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=seq, position_biased_input=False)


def swin(batch=2, size=32, patch=4, d=16, heads=2, window=4, classes=10, seed=0) -> Workload:
    """Swin: windowed attention with shifted windows, patch merging between two stages."""
    return _hf("swin", "SwinForImageClassification", _images(batch, size, classes, seed), seed, image_size=size,
               patch_size=patch, embed_dim=d, depths=[2, 1], num_heads=[heads, 2 * heads], window_size=window,
               num_labels=classes)


def convnext(batch=2, size=32, width=16, classes=10, seed=0) -> Workload:
    """ConvNeXt: depthwise 7x7 convolutions on channels-last activations, two stages."""
    return _hf("convnext", "ConvNextForImageClassification", _images(batch, size, classes, seed), seed,
               num_stages=2, hidden_sizes=[width, 2 * width], depths=[2, 1], num_labels=classes)


def clip(batch=2, seq=16, vocab=512, size=32, patch=8, d=32, layers=2, heads=4, seed=0) -> Workload:
    """CLIP: a text and a vision transformer, the symmetric contrastive loss over the batch's pairs
    (CLIP's own ``image_text_contrastive_loss``, taken from the outputs: the batch holds tensors only)."""
    from transformers.models.clip.modeling_clip import image_text_contrastive_loss

    g = torch.Generator().manual_seed(seed)
    batch_ = {"input_ids": torch.randint(3, vocab, (batch, seq), generator=g),
              "pixel_values": torch.randn(batch, 3, size, size, generator=g)}
    tower = dict(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * d)
    w = _hf("clip", "CLIPModel", batch_, seed, projection_dim=d,
            text_config=dict(tower, vocab_size=vocab, max_position_embeddings=max(seq, 64), pad_token_id=0,
                             bos_token_id=1, eos_token_id=2),
            vision_config=dict(tower, image_size=size, patch_size=patch))
    return Workload("clip", w.model, batch_, lambda out: image_text_contrastive_loss(out.logits_per_text))


def wav2vec2(batch=2, samples=800, d=32, layers=2, heads=4, classes=4, seed=0) -> Workload:
    """Wav2Vec2 utterance classifier: a 1D conv feature extractor (strides 5, 2, 2) with group
    norm, a convolutional position embedding, the transformer; SpecAugment's time masks off (they
    are drawn with numpy, outside torch's generator)."""
    g = torch.Generator().manual_seed(seed)
    batch_ = {"input_values": torch.randn(batch, samples, generator=g),
              "labels": torch.randint(0, classes, (batch,), generator=g)}
    return _hf("wav2vec2", "Wav2Vec2ForSequenceClassification", batch_, seed, hidden_size=d,
               num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * d,
               conv_dim=[16, 16, 16], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3], num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=4, mask_time_prob=0.0, num_labels=classes, classifier_proj_size=d)


# --- plain PyTorch ----------------------------------------------------------------------------


def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class ConvStack(nn.Module):
    """A plain PyTorch conv net: ``depth`` conv-BatchNorm-ReLU blocks at one resolution (BatchNorm
    in training mode: running stats updated), global average pooling, a linear classifier; its
    activations, not its 66k parameters (at the defaults), make its step."""

    def __init__(self, width: int = 16, depth: int = 8, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, width), *[_conv_bn(width, width) for _ in range(depth - 1)])
        self.head = nn.Linear(width, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.features(pixel_values).mean((2, 3))), labels)


class ConvNet(nn.Module):
    """Two conv-BatchNorm-ReLU-pool stages, dropout, a linear classifier: ``forward`` returns the loss."""

    def __init__(self, width=16, classes=10, dropout=0.1):
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, width), nn.MaxPool2d(2), _conv_bn(width, 2 * width),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.features(pixel_values)), labels)


class RecurrentLM(nn.Module):
    """Embedding, a stacked recurrent layer (``nn.LSTM`` or ``nn.GRU``), a linear head: next-token
    loss. Dropout between the layers is their default, 0: with it on, AOTAutograd's decomposition
    draws other masks than eager's fused kernel (any AOT backend: no equal step to compare with).
    Dynamo traces them only with ``torch._dynamo.config.allow_rnn = True`` (else it leaves the
    whole forward to eager)."""

    def __init__(self, vocab=512, d=32, layers=2, dropout=0.0, cell: type[nn.Module] = nn.LSTM):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = cell(d, d, layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class TransformerLM(nn.Module):
    """A plain ``nn.TransformerEncoder`` (post-norm, ReLU, dropout 0.1 as it ships) under a causal
    mask, learned positions, a linear head: next-token loss."""

    def __init__(self, vocab=512, seq=16, d=32, layers=2, heads=4):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(torch.arange(seq, device=input_ids.device))
        logits = self.head(self.encoder(x, mask=mask, is_causal=True))
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
    return _plain("lstm", lambda: RecurrentLM(vocab, d, layers, dropout), _tokens(batch, seq, vocab, seed), seed)


def gru(batch=2, seq=8, vocab=512, d=32, layers=2, seed=0) -> Workload:
    return _plain("gru", lambda: RecurrentLM(vocab, d, layers, cell=nn.GRU), _tokens(batch, seq, vocab, seed), seed)


def torch_encoder(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0) -> Workload:
    batch_ = _tokens(batch, seq, vocab, seed)
    return _plain("torch_encoder", lambda: TransformerLM(vocab, seq, d, layers, heads), batch_, seed)


def unet(batch=2, size=32, width=16, seed=0) -> Workload:
    g = torch.Generator().manual_seed(seed)
    batch_ = {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
              "target": torch.randn(batch, 3, size, size, generator=g)}
    return _plain("unet", lambda: UNet(3, width), batch_, seed)


def diffusion_unet(batch=2, size=16, width=16, seed=0) -> Workload:
    """A ``diffusers`` UNet2DModel (DDPM's): ResNet blocks with GroupNorm and SiLU, a timestep
    embedding, self-attention at the lower resolution, skip connections; the loss is the noise
    prediction's MSE."""
    from diffusers import UNet2DModel

    g = torch.Generator().manual_seed(seed)
    batch_ = {"sample": torch.randn(batch, 3, size, size, generator=g),
              "timestep": torch.randint(0, 1000, (batch,), generator=g)}
    noise = torch.randn(batch, 3, size, size, generator=g)
    torch.manual_seed(seed)
    model = UNet2DModel(sample_size=size, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(width, 2 * width), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    return Workload("diffusion_unet", model, batch_, lambda out: F.mse_loss(out.sample, noise))


ZOO: dict[str, Callable[..., Workload]] = {
    "roberta": roberta, "gpt2": gpt2, "llama": llama, "llama_tied": llama_tied, "mistral": mistral,
    "gemma2": gemma2, "t5": t5, "bart": bart, "vit": vit, "resnet": resnet, "mixtral": mixtral, "mamba": mamba,
    "whisper": whisper, "convnet": convnet, "lstm": lstm, "unet": unet, "qwen2_moe": qwen2_moe,
    "gptj": gptj, "gpt_neox": gpt_neox, "bloom": bloom, "mpt": mpt, "falcon": falcon, "gpt_bigcode": gpt_bigcode,
    "deepseek_v3": deepseek_v3, "albert": albert, "deberta_v2": deberta_v2, "swin": swin, "convnext": convnext,
    "clip": clip, "wav2vec2": wav2vec2, "diffusion_unet": diffusion_unet, "torch_encoder": torch_encoder,
    "gru": gru,
}

FAMILY: dict[str, str] = {
    "roberta": "encoder", "gpt2": "decoder", "llama": "decoder", "llama_tied": "decoder", "mistral": "decoder",
    "gemma2": "decoder", "t5": "encoder-decoder", "bart": "encoder-decoder", "vit": "vision", "resnet": "conv",
    "mixtral": "moe", "mamba": "state-space", "whisper": "speech", "convnet": "conv", "lstm": "rnn", "unet": "conv",
    "qwen2_moe": "moe", "gptj": "decoder", "gpt_neox": "decoder", "bloom": "decoder", "mpt": "decoder",
    "falcon": "decoder", "gpt_bigcode": "decoder", "deepseek_v3": "moe", "albert": "encoder",
    "deberta_v2": "encoder", "swin": "vision", "convnext": "conv", "clip": "contrastive", "wav2vec2": "speech",
    "diffusion_unet": "diffusion", "torch_encoder": "encoder", "gru": "rnn",
}


# The ``thorough`` profile: shapes where activations, not parameters, make the peak (so that
# recompute and lowering can pay), real vocabulary sizes; a step takes up to a second here.
_TEXT = dict(batch=4, seq=128, vocab=32000, d=128, layers=4, heads=4)
_IMAGE = dict(batch=8, size=64)
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {name: {} for name in ZOO},
    "thorough": {
        **{name: _TEXT for name in ("roberta", "gpt2", "llama", "llama_tied", "mistral", "gemma2", "t5", "bart",
                                    "mixtral", "qwen2_moe", "gptj", "gpt_neox", "bloom", "mpt", "falcon",
                                    "gpt_bigcode", "deepseek_v3", "albert", "deberta_v2", "torch_encoder")},
        "vit": dict(_IMAGE, patch=4, d=128, layers=4, heads=4),
        "resnet": dict(_IMAGE, width=32), "convnet": dict(_IMAGE, width=32), "unet": dict(_IMAGE, width=32),
        "mamba": dict(batch=4, seq=64, vocab=32000, d=128, layers=4),  # the scan is unrolled over seq
        "whisper": dict(batch=4, frames=256, mels=80, seq=128, vocab=32000, d=128, layers=4, heads=4),
        "lstm": dict(batch=4, seq=32, vocab=8192, d=128, layers=2),  # unrolled over seq too
        "gru": dict(batch=4, seq=32, vocab=8192, d=128, layers=2),
        "swin": dict(_IMAGE, d=64, heads=2, window=8), "convnext": dict(_IMAGE, width=64),
        "clip": dict(batch=8, seq=32, vocab=32000, size=64, patch=8, d=128, layers=4, heads=4),
        "wav2vec2": dict(batch=4, samples=16000, d=128, layers=4, heads=4),
        "diffusion_unet": dict(batch=8, size=32, width=32),
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
        model.zero_grad(set_to_none=True)
        eager_step(compiled, w)  # the second step: HF classification heads recompile on it
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:  # the third, measured
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
