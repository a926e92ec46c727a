"""Proven lowerings (``fxmem.lowering.patterns.Match.proven``) never raise the planned step peak:
the backend applies them without comparing plans, so this is checked here, on every zoo model
they match, at levels 0, 1 and 2: the plan of the graph with the proven matches lowered peaks no
higher than the plan of the unlowered graph. Futile ones (``Match.futile``) never lower it: the
backend declines them without comparing, unless asked for by name."""
from __future__ import annotations

import pytest

from fxmem import lowering
from fxmem.lowering import patterns
from fxmem.options import resolve
from fxmem.remat.budget import SLACK
from fxmem.remat.settings import PlanSettings
from fxmem.testing import zoo
from fxmem.testing.lowering import dynamo_graph, planned_peak, planned_peaks

MODELS = ["gpt2", "llama", "llama_tied", "mistral", "gemma2", "t5", "bart", "roberta", "vit", "whisper"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_proven_lowerings_never_raise_the_planned_peak(name):
    gm, inputs = dynamo_graph(getattr(zoo, name)())
    for level in (0, 1, 2):
        opts = resolve({"inner": "eager", "level": level, "lowering": True})
        lowered_gm, lowered = lowering.lower(gm, inputs, opts.lowering, proven_only=True)
        assert lowered.lowered and all(x.proven for x in lowered.lowered), name
        assert {x.pattern for x in lowered.lowered} <= {"rms_norm", "layer_norm", "attention_dropout"}
        proven = planned_peak(lowered_gm, inputs, PlanSettings.of(opts))
        plain = planned_peak(gm, inputs, PlanSettings.of(resolve({"inner": "eager", "level": level})))
        # simulated peaks within SLACK (1e-4) count as equal: a level may take the plan of least
        # recompute among them (gemma2 at level 1: 3 bytes in 270,600)
        assert proven <= plain * (1 + SLACK), (name, level, proven, plain)


def _ratio(vocab: int, hidden: int, tokens: int) -> float:
    return tokens * vocab / ((tokens + vocab) * hidden)


# Just either side of the thresholds: (vocab, hidden, seq) at batch 2.
PROVEN_SIZE, FUTILE_SIZE = (512, 32, 48), (2048, 32, 16)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama_tied", "bart", "whisper"])
def test_the_fused_loss_is_proven_from_its_ratio_on_and_futile_below_the_other(name):
    """At a logits-to-gradients ratio just above ``CE_PROVEN_FROM`` the fused cross-entropy never
    raises the planned peak (and is marked proven); just below ``CE_FUTILE_BELOW`` it never lowers
    it (and is marked futile), levels 0-2, on models with tied and untied heads, a logit bias
    (BART) and an encoder-decoder with audio input (Whisper)."""
    (pv, ph, ps), (fv, fh, fs) = PROVEN_SIZE, FUTILE_SIZE
    assert _ratio(pv, ph, 2 * ps) >= patterns.CE_PROVEN_FROM and _ratio(fv, fh, 2 * fs) < patterns.CE_FUTILE_BELOW
    for (vocab, hidden, seq), proven in ((PROVEN_SIZE, True), (FUTILE_SIZE, False)):
        gm, inputs = dynamo_graph(getattr(zoo, name)(vocab=vocab, d=hidden, seq=seq))
        ce = [n for n in gm.graph.nodes if patterns.op(n) == "cross_entropy"]
        found = patterns.find_linear_cross_entropy(ce[0], patterns.Context.of(gm.graph))
        assert isinstance(found, patterns.Match) and found.proven == proven and bool(found.futile) != proven
        for level in (0, 1, 2):
            with_, without = planned_peaks(gm, inputs, "fused_linear_cross_entropy", level)
            assert (with_ <= without) if proven else (with_ >= without), (name, vocab, level, with_, without)
