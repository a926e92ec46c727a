"""The zoo table on model families that are not in the zoo (issue [generality]: the claims must
hold on families fxmem's tests never saw). Each is built here from its Hugging Face config at the
zoo's tiny sizes, dropout as the config ships, and measured as ``zoo_table.py`` measures the zoo:

    python bench/studies/outside_zoo.py [--inner inductor] [MODEL ...]
        # writes bench/results/outside-tiny[-inductor].{json,md}
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # zoo_table

import zoo_table  # noqa: E402

from fxmem.testing import zoo  # noqa: E402
from fxmem.testing.zoo import _causal, _hf, _images, _masked, _seq2seq  # noqa: E402


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
    "switch_transformers": switch_transformers,
    "llava": llava,
    "qwen2_5_vl": qwen2_5_vl,
}
FAMILY = {"opt": "decoder", "phi": "decoder (parallel attention)", "qwen2": "decoder", "olmoe": "moe",
          "gemma": "decoder (multi-query)", "bert": "encoder", "segformer": "vision (conv + attention)",
          "switch_transformers": "encoder-decoder (routed experts)", "llava": "vision-language",
          "qwen2_5_vl": "vision-language (window attention)"}


def main(argv: list[str] | None = None) -> None:
    zoo.ZOO.update(OUTSIDE)
    zoo.FAMILY.update(FAMILY)
    zoo.PROFILES["tiny"].update({name: {} for name in OUTSIDE})
    zoo_table.FAMILY.update(FAMILY)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not [a for a in argv if a in OUTSIDE]:
        argv += list(OUTSIDE)
    zoo_table.main(argv, prefix="outside", script="bench/studies/outside_zoo.py")


if __name__ == "__main__":
    main()
