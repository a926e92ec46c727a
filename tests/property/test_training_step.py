"""Properties over random models (fxmem.testing.strategies) and option sets: fxmem never changes
a training step, its report's byte claims match measurement, and memory falls as asked."""
import warnings

import pytest
import torch
from budget import examples
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fxmem.profiling import step_perf
from fxmem.testing import ModelSpec, assert_same_training_step, build
from fxmem.testing.strategies import model_specs, options


def _check(spec, opts, **kwargs):
    model, inputs = build(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a budget is never refused: one that cannot be met warns and takes the least-peak plan
        return assert_same_training_step(model, inputs, opts, reference="unoptimized" if spec.dropout else "eager",
                                         **kwargs)


# Regression: CPU native_dropout_backward returns a permuted layout where its meta says
# contiguous; a later aten.view failed at run time (fixed by inner.tolerant_views).
@example(ModelSpec(vocab=16, d=4, blocks=("mlp", "conv1d"), norm="rmsnorm", hidden=8, heads=1,
                   residual=False, dropout=0.2, batch=2, seq=4), {"level": 0})
@example(ModelSpec(vocab=16, d=4, blocks=("mlp", "conv1d", "mlp"), norm="rmsnorm", activation="gelu_tanh",
                   hidden=24, heads=1, residual=False, dropout=0.2, batch=3, seq=4),
         {"level": 1, "memory_budget": 0.5})
# Regression: the reference lowered every match where fxmem, declining the fused kernels, lowered
# the layer norm alone; the dropout then drew different numbers (fixed: the reference follows
# fxmem's lowering decision).
@example(ModelSpec(vocab=16, d=4, blocks=("mlp",), norm="layernorm", activation="gelu", hidden=8, heads=1,
                   residual=False, tied=False, dropout=0.2, batch=1, seq=4),
         {"level": 0, "lowering": True, "microbatch_size": None})
@given(model_specs(), options())
@settings(max_examples=examples(15, 200))
def test_gradients_and_saved_bytes_match(spec, opts):
    check = _check(spec, opts)
    assert check.held_bytes == check.planned_saved_bytes[0]


# Regression: Dynamo's TensorifyScalarRestartAnalysis (control flow) was taken for a stage failure.
@pytest.mark.slow
@example(ModelSpec(vocab=16, d=4, blocks=("mlp",), hidden=8, heads=1, residual=False, batch=1, seq=4), (2, 4))
# Regression: dynamic shapes pass the RMSNorm's eps as a 0-d float64 input that autograd saves;
# the check counted it as an activation (460 bytes held, 452 planned).
@example(ModelSpec(vocab=16, d=4, blocks=("mlp",), norm="rmsnorm", activation="gelu", hidden=8, heads=1,
                   residual=False, batch=1, seq=4), (2, 4))
@given(model_specs(dropout=False), st.sampled_from([(2, 4), (3, 7)]))
@settings(max_examples=examples(5, 30))
def test_dynamic_shapes_formulas_equal_measured_bytes_at_each_shape(spec, shape):
    """One dynamic compile; the saved-bytes formula evaluated at the run's shape is what autograd holds."""
    from dataclasses import replace

    assume(shape != (spec.batch, spec.seq))  # the second run must be a new shape for the compiled graph
    _check(spec, {}, dynamic=True)
    check = _check(replace(spec, batch=shape[0], seq=shape[1]), {}, dynamic=True, reset=False)
    assert check.held_bytes == check.planned_saved_bytes[0]


def _attention_scratch(spec) -> int:
    """Bytes the CPU attention kernel allocates inside one forward or backward call at this
    spec's shape (measured: they depend on the thread count and ATen's block sizes). fxmem's
    simulated peak cannot see them, so a plan may peak up to this much above its simulation."""
    if "attention" not in spec.blocks:
        return 0
    import itertools

    from torch.profiler import ProfilerActivity, profile

    def scratch(fn):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        mem = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
        return max(itertools.accumulate(e.nbytes() for e in mem)) - sum(t.nbytes for t in out)

    aten = torch.ops.aten
    q, k, v = (torch.randn(spec.batch, spec.heads, spec.seq, spec.d // spec.heads) for _ in range(3))
    o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[:2]
    return max(scratch(lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[:2]),
               scratch(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
                   torch.ones_like(o), q, k, v, o, lse, 0.0, True)))


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


# Regression: budget 0.8 peaked at 1304 bytes, budget 1.0 at 1208: the recomputed attention met
# the backward's largest buffers (fixed: only plans whose simulated peak does not rise are chosen).
@pytest.mark.slow
@example(ModelSpec(vocab=16, d=4, blocks=("attention",), hidden=8, heads=1, residual=False, batch=1, seq=4))
@example(ModelSpec(vocab=16, d=4, blocks=("attention", "mlp"), norm="layernorm", activation="gelu", hidden=8, heads=1,
                   residual=False, batch=1, seq=4))
# Regression: budget 0.8 peaked at 4664 bytes, budget 1.0 at 4472, where both plans simulate to
# 4912 (fixed: a plan is admissible only if it simulates strictly below every plan with more bytes).
@example(ModelSpec(vocab=16, d=8, blocks=("swiglu", "mlp"), norm="layernorm", activation="gelu", hidden=8, heads=1,
                   residual=False, batch=2, seq=7))
# Regression: budget 0.8 measured 984 bytes against 1.0's 920: 0.8 is unmet, and the lowering
# decision, planning under strict, got no peak to compare and lowered the loss to the fused kernel
# (fixed: an unmet budget's comparison plans fall back as the real compile does).
@example(ModelSpec(vocab=16, d=4, blocks=("mlp",), norm="layernorm", activation="gelu", hidden=8, heads=1,
                   residual=False, tied=False, dropout=0.0, batch=1, seq=4))
@given(model_specs(dropout=False))
@settings(max_examples=examples(5, 30))
def test_measured_peak_never_rises_as_the_budget_falls(spec):
    """Exactly, but for the attention kernel's internal scratch (see _attention_scratch)."""
    slack, peaks = _attention_scratch(spec), []
    for budget in (1.0, 0.8, 0.5, 0.2, 0.0):
        peaks.append((budget, _peak(spec, {"memory_budget": budget})))  # never refused
    for (b1, p1), (b2, p2) in zip(peaks, peaks[1:]):
        assert p2 <= p1 + slack, f"budget {b2} peaked at {p2} bytes, above budget {b1}'s {p1} (+{slack} slack)"


@pytest.mark.slow
@example(ModelSpec(vocab=16, d=8, blocks=("attention",), norm="rmsnorm", activation="gelu", hidden=8, heads=1,
                   residual=False, batch=1, seq=4))
# Regression: level 1 peaked at 2016 bytes, level 0 at 1920, where both plans simulate to 2024 (a
# level 1 plan is kept only if it simulates strictly lower).
@example(ModelSpec(vocab=16, d=4, blocks=("swiglu", "mlp"), norm="layernorm", activation="gelu", hidden=8, heads=1,
                   residual=False, batch=1, seq=7))
@given(model_specs(dropout=False))
@settings(max_examples=examples(5, 30))
def test_measured_peak_never_rises_as_the_level_rises(spec):
    """Exactly, but for the attention kernel's internal scratch (see _attention_scratch)."""
    p0, p1, slack = _peak(spec, {"level": 0}), _peak(spec, {"level": 1}), _attention_scratch(spec)
    assert p1 <= p0 + slack, f"level 1 peaked at {p1} bytes, above level 0's {p0} (+{slack} slack)"


@pytest.mark.inductor
@given(model_specs(), options())
@settings(max_examples=examples(3, 50))
def test_inductor_gradients_match(spec, opts):
    """The same property with the Inductor inner compiler (the default): loss and gradients within
    Inductor's float reassociation (1e-4 relative); dropout masks drawn alike under
    ``fallback_random`` (Inductor's own random ops draw other numbers than eager's)."""
    with torch._inductor.config.patch(fallback_random=True):
        _check(spec, {**opts, "inner": "inductor"}, rtol=1e-4, atol=1e-6, check_saved_bytes=False)
