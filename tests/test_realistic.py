"""Answers a user planning a real run needs: specialized shapes refused, the device's whole load."""

from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.models import build


def test_predict_peak_refuses_a_size_the_compile_specialized():
    """Batch 1 is specialized by Dynamo even with dynamic=True: the plan says nothing about batch 4."""
    w = build("hf_gpt2", batch=1, seq=32, vocab=256, d=32, layers=2, heads=2)
    rep = fxmem.explain(w.model, {"inner": "eager"}, **w.batch)
    g = rep.graphs[-1]
    assert g.static_dims["input_ids.size(0)"] == 1 and "input_ids.size(1)" in g.symbols.values()
    assert rep.predict_peak(input_ids=(1, 64)) > rep.predict_peak(input_ids=(1, 32))  # seq is dynamic
    with pytest.raises(ValueError, match=r"input_ids.size\(0\) was specialized to 1 .* nothing about 4"):
        rep.predict_peak(input_ids=(4, 64))
    with pytest.raises(ValueError, match=r"no dynamic batch dimension \(specialized when compiled: input_ids.size"):
        rep.max_batch("1GB", seq=64)


def test_static_compile_refuses_every_other_shape():
    w = build("hf_gpt2", batch=2, seq=32, vocab=256, d=32, layers=2, heads=2)
    torch._dynamo.reset()
    compiled = torch.compile(w.model, backend="fxmem", options={"inner": "eager"}, dynamic=False)
    compiled(**w.batch).loss.backward()
    rep = fxmem.report(compiled)
    assert rep.predict_peak(input_ids=(2, 32)) == rep.predict_peak()
    with pytest.raises(ValueError, match=r"input_ids.size\(1\) was specialized to 32"):
        rep.predict_peak(input_ids=(2, 64))
