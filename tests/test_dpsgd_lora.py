"""LoRA through peft on a tiny Llama (from a LlamaConfig): per-example gradients for the adapters
only, equal to an explicit per-example loop, and a private step that peaks no higher than 1.2x
the non-private LoRA step on the same batch."""

import pytest
import torch
from helpers import load_bench_module

from fxmem.dpsgd import clipped_grad, make_functional
from fxmem.models import build
from fxmem.profiling import step_perf

pytest.importorskip("peft")
loop = load_bench_module("dpsgd_lora").loop  # the explicit per-example loop: grad, clip, add

V, S, B = 64, 16, 16


def lora_llama():
    """A 2-layer Llama (hidden 64) with rank-4 LoRA adapters on q_proj and v_proj."""
    return build("hf_llama_lora", batch=B, seq=S, vocab=V, d=64, layers=2, heads=2, rank=4).model


def peak(fn):
    fn()  # warm-up (and compile)
    with step_perf("cpu") as perf:
        out = fn()
    del out
    return perf.result.peak_bytes


@pytest.mark.slow
def test_lora_per_example_grads_for_adapters_only_match_the_loop_within_1_2x_the_nonprivate_peak():
    model = lora_llama()
    fn, trainable, frozen = make_functional(model)
    assert trainable and all("lora_" in k for k in trainable)
    assert sum(v.numel() for v in trainable.values()) < sum(v.numel() for v in frozen.values()) / 10

    def loss(tr, fr, ids):  # ONE example
        return fn(tr, fr, input_ids=ids[None], labels=ids[None]).loss

    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    C = 0.5
    want = loop(loss, C, trainable, frozen, ids)
    step = clipped_grad(loss, C, batch_argnums=(2,), microbatch_size=B, options={"inner": "eager"})
    grads = step(trainable, frozen, ids)
    assert step.chosen_microbatch_size() == B
    assert set(grads) == set(trainable)
    for k in want:
        err = ((grads[k] - want[k]).abs().max() / want[k].abs().max()).item()
        assert err <= 1e-5, f"{k}: relative error {err:.1e}"

    def nonprivate():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    private, plain = peak(lambda: step(trainable, frozen, ids)), peak(nonprivate)
    assert private <= 1.2 * plain, (private, plain)
