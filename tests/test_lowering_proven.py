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

MODELS = ["gpt2", "llama", "llama_tied", "mistral", "gemma2", "t5", "bart", "roberta", "vit", "whisper"]


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
        assert {x.pattern for x in lowered.lowered} <= {"rms_norm", "layer_norm"}
        proven = backend._trial(lowered_gm, inputs, opts).peak
        plain = backend._trial(gm, inputs, resolve({"inner": "eager", "level": level, "lowering": False})).peak
        assert proven <= plain, (name, level, proven, plain)
