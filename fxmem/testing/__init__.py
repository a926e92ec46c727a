"""Test that fxmem leaves your model's training step unchanged.

    from fxmem.testing import assert_same_training_step
    assert_same_training_step(model, {"input_ids": ids, "labels": ids}, options={"level": 1})

and property-test it over random models and options with the hypothesis strategies in
:mod:`fxmem.testing.strategies` (``model_specs``, ``options``, ``plan_options``,
``rule_strings``) and :func:`fxmem.testing.models.build`.
"""
from .checks import StepCheck, assert_same_clipped_sum, assert_same_training_step, per_example_reference
from .models import ModelSpec, build

__all__ = ["ModelSpec", "StepCheck", "assert_same_clipped_sum", "assert_same_training_step", "build",
           "per_example_reference"]
