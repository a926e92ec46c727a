"""Proven lowerings (``fxmem.lowering.patterns.Match.proven``) never raise the planned step peak:
the backend applies them without comparing plans, so this is checked here, on every zoo model
they match, at levels 0, 1 and 2: the plan of the graph with the proven matches lowered peaks no
higher than the plan of the unlowered graph."""
from __future__ import annotations

import pytest
import torch

from fxmem import backend, lowering
from fxmem.options import resolve
from fxmem.testing import zoo

MODELS = ["gpt2", "llama", "llama_tied", "mistral", "gemma2", "t5", "bart", "roberta", "vit", "whisper", "mixtral"]


def _dynamo_graph(workload):
    captured = []

    def grab(gm, example_inputs, **kwargs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    workload.loss(torch.compile(workload.model, backend=grab)(**workload.batch))
    assert len(captured) == 1, "one graph expected"
    return captured[0]


@pytest.mark.parametrize("name", MODELS)
def test_proven_lowerings_never_raise_the_planned_peak(name):
    gm, inputs = _dynamo_graph(getattr(zoo, name)())
    for level in (0, 1, 2):
        opts = resolve({"inner": "eager", "level": level, "lowering": True})
        lowered_gm, lowered = lowering.lower(gm, inputs, opts, proven_only=True)
        assert lowered.lowered and all(x.proven for x in lowered.lowered), name
        assert {x.pattern for x in lowered.lowered} <= {"rms_norm", "layer_norm", "swiglu", "geglu", "bias_gelu"}
        proven = backend._trial(lowered_gm, inputs, opts).peak
        plain = backend._trial(gm, inputs, resolve({"inner": "eager", "level": level, "lowering": False})).peak
        assert proven <= plain, (name, level, proven, plain)


@pytest.mark.slow
def test_the_fused_loss_is_kept_uncompared_only_where_the_graph_without_it_peaks_no_lower():
    """backend._peak_clear_of_loss skips planning the graph without the fused loss; wherever it
    does, that graph's plan peaks at least as high (checked here by planning it anyway), and it
    does not fire where the loss's buffers are alive at the peak."""
    seen = set()
    for name, layers in (("llama", 2), ("llama", 8), ("gpt2", 8), ("roberta", 6)):
        gm, inputs = _dynamo_graph(getattr(zoo, name)(layers=layers))
        for level in (0, 1):
            opts = resolve({"inner": "eager", "level": level})
            lowered_gm, lowered = lowering.lower(gm, inputs, opts)
            assert {x.pattern for x in lowered.unproven()} == {backend.LOSS}, name
            trial = backend._trial(lowered_gm, inputs, opts)
            clear = backend._peak_clear_of_loss(trial)
            seen.add(clear)
            if clear:
                base_gm, _ = lowering.lower(gm, inputs, opts, proven_only=True)
                assert backend._trial(base_gm, inputs, opts).peak >= trial.peak, (name, layers, level)
    assert seen == {True, False}, "both cases must occur for this test to check anything"
