"""The zoo table on model families that are not in the zoo (issue [generality]: the claims must
hold on families fxmem's tests never saw). Each is built here from its Hugging Face config at the
zoo's tiny sizes, dropout as the config ships, and measured as ``zoo_table.py`` measures the zoo:

    python bench/studies/outside_zoo.py [--inner inductor] [--capture] [MODEL ...]
        # writes bench/results/outside[-capture]-tiny[-inductor].{json,md}

``--capture``: Dynamo keeps data-dependent operators in the graph (``capture_scalar_outputs``,
``capture_dynamic_output_shape_ops``): their sizes are unbacked symbols (issue #56).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # zoo_table

import zoo_table  # noqa: E402

from fxmem.models import Workload, _tokens  # noqa: E402
from fxmem.testing import zoo  # noqa: E402
from fxmem.testing.zoo import RecurrentLM, _causal, _hf, _images, _masked, _plain, _seq2seq  # noqa: E402


def _decoder(name: str, cls: str, **config):
    def build(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0):
        return _causal(name, cls, batch, seq, vocab, seed, hidden_size=d, num_hidden_layers=layers,
                       num_attention_heads=heads, max_position_embeddings=64, bos_token_id=1, eos_token_id=1,
                       **config)
    return build


def bert(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0):
    """BERT, masked LM (dropout 0.1)."""
    return _hf("bert", "BertForMaskedLM", _masked(batch, seq, vocab, seed, mask_id=3), seed, vocab_size=vocab,
               hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * d,
               max_position_embeddings=64)


def segformer(batch=2, size=32, classes=4, seed=0):
    """SegFormer: a hierarchical transformer encoder with overlapping conv patch embeddings and an
    all-MLP decode head (dropout 0.0, drop path 0.1)."""
    batch_ = _images(batch, size, classes, seed)
    batch_["labels"] = batch_["labels"][:, None, None].expand(batch, size, size).contiguous()
    return _hf("segformer", "SegformerForSemanticSegmentation", batch_, seed, num_channels=3, num_encoder_blocks=2,
               depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
               num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=classes)


def _segmentation(batch: dict, size: int) -> dict:
    """An image batch whose labels are a per-pixel class map (``size`` x ``size``)."""
    b = batch["labels"].shape[0]
    batch["labels"] = batch["labels"][:, None, None].expand(b, size, size).contiguous()
    return batch


def segformer_b(batch=2, size=64, classes=4, seed=0):
    """SegFormer at four stages (MiT-b0's layout: depths 2 each, reduction ratios 8/4/2/1) on 64x64
    images: the larger sibling of ``segformer``."""
    images = _segmentation(_images(batch, size, classes, seed), size)
    return _hf("segformer_b", "SegformerForSemanticSegmentation", images, seed, num_channels=3, num_encoder_blocks=4,
               depths=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1], hidden_sizes=[16, 32, 40, 64], patch_sizes=[7, 3, 3, 3],
               strides=[4, 2, 2, 2], num_attention_heads=[1, 2, 2, 4], mlp_ratios=[2, 2, 2, 2], decoder_hidden_size=32,
               num_labels=classes)


def dpt(batch=2, size=32, patch=8, d=32, layers=4, heads=4, classes=4, seed=0):
    """DPT: a ViT backbone whose layers 1..4 feed a convolutional reassemble-and-fuse neck, a
    segmentation head and an auxiliary head (dropout 0.1 in the heads)."""
    return _hf("dpt", "DPTForSemanticSegmentation", _segmentation(_images(batch, size, classes, seed), size), seed,
               image_size=size, patch_size=patch, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
               intermediate_size=2 * d, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 16, 32],
               fusion_hidden_size=16, reassemble_factors=[4, 2, 1, 0.5], num_labels=classes,
               auxiliary_loss_weight=0.4)


def mobilevit(batch=2, size=64, classes=4, seed=0):
    """MobileViT (DeepLabV3 head): inverted-residual conv stages with transformer blocks over
    unfolded patches (dropout 0.1 in the head, 0.0 elsewhere)."""
    images = _segmentation(_images(batch, size, classes, seed), size)
    return _hf("mobilevit", "MobileViTForSemanticSegmentation", images, seed, image_size=size,
               hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2,
               aspp_out_channels=32, atrous_rates=[2, 4, 6], num_labels=classes)


def _series(batch: int, length: int, seed: int, channels: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, length) if channels is None else (batch, length, channels)
    return torch.randn(shape, generator=g).cumsum(1)


def _forecast(name: str, cls: str, batch: int, context: int, horizon: int, d: int, layers: int, heads: int,
              seed: int, **config):
    """A probabilistic forecaster (TimeSeriesTransformer, Informer, Autoformer): lags, one time
    feature, the distribution head's negative log-likelihood (dropout 0.1 as shipped)."""
    lags = [1, 2, 3]
    past, future = context + max(lags), horizon
    values = _series(batch, past + future, seed)
    time = torch.linspace(0, 1, past + future).expand(batch, -1)[..., None].contiguous()
    batch_ = {"past_values": values[:, :past].contiguous(), "past_time_features": time[:, :past].contiguous(),
              "past_observed_mask": torch.ones(batch, past), "future_values": values[:, past:].contiguous(),
              "future_time_features": time[:, past:].contiguous()}
    return _hf(name, cls, batch_, seed, prediction_length=horizon, context_length=context, lags_sequence=lags,
               num_time_features=1, d_model=d, encoder_layers=layers, decoder_layers=layers,
               encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * d,
               decoder_ffn_dim=2 * d, **config)


def time_series(batch=4, context=32, horizon=8, d=32, layers=2, heads=4, seed=0):
    return _forecast("time_series", "TimeSeriesTransformerForPrediction", batch, context, horizon, d, layers, heads,
                     seed)


def informer(batch=4, context=32, horizon=8, d=32, layers=2, heads=4, seed=0):
    """Informer: ProbSparse attention, distilling convolutions between the encoder layers."""
    return _forecast("informer", "InformerForPrediction", batch, context, horizon, d, layers, heads, seed)


def autoformer(batch=4, context=32, horizon=8, d=32, layers=2, heads=4, seed=0):
    """Autoformer: series decomposition blocks, auto-correlation in place of attention (FFT)."""
    return _forecast("autoformer", "AutoformerForPrediction", batch, context, horizon, d, layers, heads, seed)


def patchtst(batch=4, context=64, horizon=8, channels=3, d=32, layers=2, heads=4, seed=0):
    """PatchTST: channel-independent patches, a BatchNorm transformer encoder, MSE forecast loss."""
    values = _series(batch, context + horizon, seed, channels)
    batch_ = {"past_values": values[:, :context].contiguous(), "future_values": values[:, context:].contiguous()}
    return _hf("patchtst", "PatchTSTForPrediction", batch_, seed, num_input_channels=channels,
               context_length=context, prediction_length=horizon, patch_length=8, patch_stride=8, d_model=d,
               num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=2 * d)


class EncoderClassifier(nn.Module):
    """A plain ``nn.TransformerEncoder`` classifier (post-norm, ReLU, dropout 0.1 as it ships, no
    mask): token and learned position embeddings, mean pooling, a linear head."""

    def __init__(self, vocab=512, seq=16, d=32, layers=2, heads=4, classes=4, **layer):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, **{"dim_feedforward": 4 * d, "batch_first": True, **layer})
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        return F.cross_entropy(self.head(self.encoder(x).mean(1)), labels)


def encoder_classifier(batch=4, seq=32, vocab=512, d=32, layers=4, heads=4, classes=4, seed=0, **layer) -> Workload:
    batch_ = _tokens(batch, seq, vocab, seed)
    batch_["labels"] = batch_["labels"][:, 0] % classes
    return _plain("encoder_classifier", lambda: EncoderClassifier(vocab, seq, d, layers, heads, classes, **layer),
                  batch_, seed)


def gru_lm(batch=4, seq=16, vocab=512, d=64, layers=2, seed=0) -> Workload:
    """An ``nn.GRU`` language model (two stacked layers, one module)."""
    return _plain("gru_lm", lambda: RecurrentLM(vocab, d, layers, cell=nn.GRU), _tokens(batch, seq, vocab, seed), seed)


def jamba(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, seed=0):
    """Jamba: a hybrid state-space model, a Mamba layer then an attention layer with 4 experts
    (top-2), as its config ships otherwise (``use_associative_scan=True``; no CUDA kernels here:
    the selective scan is a Python loop over the sequence in eager)."""
    return _causal("jamba", "JambaForCausalLM", batch, seq, vocab, seed, hidden_size=d, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=2, intermediate_size=2 * d, num_experts=4,
                   num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   max_position_embeddings=64)


def switch_transformers(batch=2, seq=16, vocab=512, d=32, layers=2, heads=4, experts=4, seed=0):
    """SwitchTransformers: a T5 encoder-decoder whose every other layer routes each token to one of
    ``experts`` experts (top-1, capacity-limited: the router's dispatch is a dynamic-shape op,
    a graph break in every sparse layer), dropout 0.1. The batch holds the attention mask: without
    it the stacks' ``forward`` subscripts ``None`` under Dynamo (transformers builds the all-ones
    mask only when not compiling), so Dynamo gives up on those frames and runs them eagerly."""
    batch_ = _seq2seq(batch, seq, vocab, seed)
    batch_["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    return _hf("switch_transformers", "SwitchTransformersForConditionalGeneration", batch_, seed,
               vocab_size=vocab, d_model=d, d_kv=d // heads, d_ff=2 * d, num_layers=layers,
               num_decoder_layers=layers, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=heads,
               num_experts=experts, expert_capacity=seq, decoder_start_token_id=0, use_cache=False)


def llava(batch=2, seq=24, vocab=512, size=32, patch=8, d=32, layers=2, heads=4, seed=0):
    """LLaVA: a CLIP vision tower, a two-layer projector, a Llama decoder whose ``image_token_id``
    positions take the image's patch features (``(size // patch) ** 2`` of them, after one text
    token); the loss on the text after the image. transformers checks the image tokens' count
    with ``torch._check_tensor_all``: a ``Tensor.item()`` graph break."""
    g = torch.Generator().manual_seed(seed)
    image = (size // patch) ** 2
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    ids[:, 1:1 + image] = 3
    labels = ids.clone()
    labels[:, :1 + image] = -100
    batch_ = {"input_ids": ids, "pixel_values": torch.randn(batch, 3, size, size, generator=g), "labels": labels}
    tower = dict(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads)
    return _hf("llava", "LlavaForConditionalGeneration", batch_, seed, image_token_id=3,
               vision_feature_layer=-1, vision_feature_select_strategy="default",
               vision_config=dict(tower, model_type="clip_vision_model", image_size=size, patch_size=patch),
               text_config=dict(tower, model_type="llama", vocab_size=vocab, num_key_value_heads=heads,
                                max_position_embeddings=64, use_cache=False))


def qwen2_5_vl(batch=2, seq=24, vocab=512, size=32, patch=4, d=32, layers=2, heads=4, seed=0):
    """Qwen2.5-VL: a vision encoder with window attention (windows of 2x2 merged patches, the
    last block full attention; the windows' lengths are read from tensors: data-dependent
    operators, graph breaks), 2D rotary, a patch merger, a Qwen2 decoder with multimodal rotary
    positions; one image a row after a vision-start token, the loss on the text after it."""
    g = torch.Generator().manual_seed(seed)
    grid = size // patch
    image = grid * grid // 4  # tokens after the 2x2 merge
    ids = torch.randint(8, vocab, (batch, seq), generator=g)
    ids[:, 1], ids[:, 2:2 + image], ids[:, 2 + image] = 4, 3, 5  # vision start, image tokens, vision end
    labels = ids.clone()
    labels[:, :3 + image] = -100
    batch_ = {"input_ids": ids, "pixel_values": torch.randn(batch * grid * grid, 3 * 2 * patch * patch, generator=g),
              "image_grid_thw": torch.tensor([[1, grid, grid]] * batch), "labels": labels}
    return _hf("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", batch_, seed, image_token_id=3, video_token_id=6,
               vision_start_token_id=4, vision_end_token_id=5,
               vision_config=dict(depth=layers, hidden_size=d, intermediate_size=2 * d, num_heads=heads,
                                  patch_size=patch, temporal_patch_size=2, spatial_merge_size=2, window_size=4 * patch,
                                  out_hidden_size=d, fullatt_block_indexes=[layers - 1]),
               text_config=dict(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=64,
                                bos_token_id=1, eos_token_id=2, use_cache=False,
                                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                 "rope_theta": 10000.0}))


OUTSIDE = {
    "opt": _decoder("opt", "OPTForCausalLM", ffn_dim=128, word_embed_proj_dim=32, pad_token_id=0),
    "phi": _decoder("phi", "PhiForCausalLM", intermediate_size=128),
    "qwen2": _decoder("qwen2", "Qwen2ForCausalLM", num_key_value_heads=2, intermediate_size=96),
    "olmoe": _decoder("olmoe", "OlmoeForCausalLM", intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      pad_token_id=0),
    "gemma": _decoder("gemma", "GemmaForCausalLM", num_key_value_heads=1, head_dim=8, intermediate_size=128,
                      pad_token_id=0),
    "bert": bert,
    "segformer": segformer,
    "segformer_b": segformer_b,
    "dpt": dpt,
    "mobilevit": mobilevit,
    "time_series": time_series,
    "informer": informer,
    "autoformer": autoformer,
    "patchtst": patchtst,
    "encoder_classifier": encoder_classifier,
    "gru_lm": gru_lm,
    "jamba": jamba,
    "switch_transformers": switch_transformers,
    "llava": llava,
    "qwen2_5_vl": qwen2_5_vl,
}
FAMILY = {"opt": "decoder", "phi": "decoder (parallel attention)", "qwen2": "decoder", "olmoe": "moe",
          "gemma": "decoder (multi-query)", "bert": "encoder", "segformer": "vision (conv + attention)",
          "segformer_b": "segmentation", "dpt": "segmentation", "mobilevit": "segmentation",
          "time_series": "time series", "informer": "time series", "autoformer": "time series",
          "patchtst": "time series", "encoder_classifier": "encoder (torch)", "gru_lm": "rnn",
          "jamba": "hybrid state-space (scan + attention + moe)",
          "switch_transformers": "encoder-decoder (routed experts)", "llava": "vision-language",
          "qwen2_5_vl": "vision-language (window attention)"}


def main(argv: list[str] | None = None) -> None:
    zoo.ZOO.update(OUTSIDE)
    zoo.FAMILY.update(FAMILY)
    zoo.PROFILES["tiny"].update({name: {} for name in OUTSIDE})
    zoo_table.FAMILY.update(FAMILY)
    argv = list(sys.argv[1:] if argv is None else argv)
    capture = "--capture" in argv
    argv = [a for a in argv if a != "--capture"]
    if not [a for a in argv if a in OUTSIDE]:
        argv += list(OUTSIDE)
    if capture:
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
    zoo_table.main(argv, prefix="outside-capture" if capture else "outside",
                   script="bench/studies/outside_zoo.py" + (" --capture" if capture else ""))


if __name__ == "__main__":
    main()
