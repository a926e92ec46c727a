"""Properties over random models (fxmem.testing.strategies) and option sets: fxmem never changes
a training step, its report's byte claims match measurement, and memory falls as asked."""
import warnings

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fxmem.profiling import step_perf
from fxmem.remat.plan import BudgetError
from fxmem.testing import ModelSpec, assert_same_training_step, build
from budget import examples
from fxmem.testing.strategies import model_specs, options


def _check(spec, opts, **kwargs):
    model, inputs = build(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return assert_same_training_step(model, inputs, opts, reference="unoptimized" if spec.dropout else "eager",
                                             **kwargs)
        except BudgetError:
            assume(False)  # infeasible budgets raise by design (tested in test_plan.py)


# Regression: CPU native_dropout_backward returns a permuted layout where its meta says
# contiguous; a later aten.view failed at run time (fixed by inner.tolerant_views).
@example(ModelSpec(vocab=16, d=4, blocks=("mlp", "conv1d"), norm="rmsnorm", hidden=8, heads=1,
                   residual=False, dropout=0.2, batch=2, seq=4), {"level": 0})
@example(ModelSpec(vocab=16, d=4, blocks=("mlp", "conv1d", "mlp"), norm="rmsnorm", activation="gelu_tanh",
                   hidden=24, heads=1, residual=False, dropout=0.2, batch=3, seq=4),
         {"level": 1, "memory_budget": 0.5})
@given(model_specs(), options())
@settings(max_examples=examples(15, 200))
def test_gradients_and_saved_bytes_match(spec, opts):
    check = _check(spec, opts)
    assert check.held_bytes == check.planned_saved_bytes[0]


# Regression: Dynamo's TensorifyScalarRestartAnalysis (control flow) was taken for a stage failure.
@example(ModelSpec(vocab=16, d=4, blocks=("mlp",), hidden=8, heads=1, residual=False, batch=1, seq=4), (2, 4))
@given(model_specs(dropout=False), st.sampled_from([(2, 4), (3, 7)]))
@settings(max_examples=examples(5, 30))
def test_dynamic_shapes_formulas_equal_measured_bytes_at_each_shape(spec, shape):
    """One dynamic compile; the saved-bytes formula evaluated at the run's shape is what autograd holds."""
    from dataclasses import replace

    assume(shape != (spec.batch, spec.seq))  # the second run must be a new shape for the compiled graph
    _check(spec, {}, dynamic=True)
    check = _check(replace(spec, batch=shape[0], seq=shape[1]), {}, dynamic=True, reset=False)
    assert check.held_bytes == check.planned_saved_bytes[0]


def _peak(spec, opts):
    model, inputs = build(spec)
    torch._dynamo.reset()
    step = torch.compile(model, backend="fxmem", options={"inner": "eager", **opts})
    step(**inputs).backward()  # compile, warm up
    model.zero_grad(set_to_none=True)
    with step_perf("cpu") as perf:
        step(**inputs).backward()
    model.zero_grad(set_to_none=True)
    return perf.result.peak_bytes


# Known failure (issue #3, the planner): on tiny models a lower budget can peak a few dozen bytes
# higher, e.g. ModelSpec(vocab=16, d=4, blocks=("attention",), hidden=8, heads=1, residual=False,
# batch=1, seq=4): budget 0.8 peaked at 1304 bytes, budget 1.0 at 1208 (the recomputed values
# meet the backward's largest buffers). Kept running, reported, until the planner guarantees it.
@pytest.mark.xfail(reason="issue #3: budget monotonicity of the measured peak fails on tiny models",
                   strict=False)
@given(model_specs(dropout=False))
@settings(max_examples=examples(5, 30))
def test_measured_peak_never_rises_as_the_budget_falls(spec):
    peaks = []
    for budget in (1.0, 0.8, 0.5, 0.2):
        try:
            peaks.append((budget, _peak(spec, {"memory_budget": budget})))
        except BudgetError:
            break  # lower budgets are infeasible too
    for (b1, p1), (b2, p2) in zip(peaks, peaks[1:]):
        assert p2 <= p1, f"budget {b2} peaked at {p2} bytes, above budget {b1}'s {p1}"
