"""Hugging Face MoE causal LMs compile into one graph (issue [generality]): the output-capturing
hooks that carry the routers' logits are installed before Dynamo traces (``fxmem.graph_breaks``),
so no ``lock`` context manager splits the step, and fxmem's step equals eager's."""

from __future__ import annotations

import copy

import pytest

import fxmem
from fxmem.graph_breaks import break_count, breaks_since
from fxmem.testing.zoo import _decoder, conform, eager_step, zoo_build

# Routed experts only (Mixtral, Qwen3-MoE, OLMoE), with a shared expert (Qwen2-MoE), and
# DeepSeek-V3's shared experts behind a dense first layer, with multi-head latent attention.
MOE = {
    "mixtral": lambda: zoo_build("mixtral"),
    "qwen2_moe": lambda: zoo_build("qwen2_moe"),
    "qwen3_moe": lambda: _decoder("qwen3_moe", "Qwen3MoeForCausalLM", 2, 16, 512, 32, 2, 4, 2, 0, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True),
    "olmoe": lambda: _decoder("olmoe", "OlmoeForCausalLM", 2, 16, 512, 32, 2, 4, 2, 0, num_experts=4,
                              num_experts_per_tok=2, output_router_logits=True, pad_token_id=0, eos_token_id=1),
    "deepseek_v3": lambda: zoo_build("deepseek_v3"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MOE))
def test_an_hf_moe_lm_is_one_graph_without_breaks_and_equals_eager(name):
    w = MOE[name]()
    ref = copy.deepcopy(w.model)
    reference = ref, eager_step(ref, w)
    before = break_count()
    result = conform(w, {"level": 1}, reference)
    assert breaks_since(before) == []
    assert len(fxmem.report(result.compiled).graphs) == 1
    assert result.ok, (result.fallbacks, result.mismatches)
