"""Properties of the per-example pass over random models, batches and microbatch sizes: clipped
sums equal the per-example loop, and removing one example moves the sum by at most C."""
import math
import warnings
from dataclasses import replace

import pytest
import torch
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from fxmem.testing import assert_same_clipped_sum, build, per_example_reference
from fxmem.testing.strategies import model_specs


def _loss(model):
    def loss(params, ids, labels):
        return torch.func.functional_call(model, params, (ids[None], labels[None]))
    return loss


@pytest.mark.slow
@given(model_specs(max_blocks=2, dropout=False), st.integers(2, 6), st.sampled_from([None, 1, 2, 3]),
       st.sampled_from([0.05, 1.0]), st.booleans())
@settings(max_examples=examples(10, 100))
def test_clipped_sums_equal_the_loop_and_removal_moves_them_by_at_most_c(spec, batch, m, c, ghost):
    model, inputs = build(replace(spec, batch=batch))
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids, labels = inputs["input_ids"], inputs["labels"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        sums, _ = assert_same_clipped_sum(_loss(model), params, (ids, labels), c, microbatch_size=m,
                                          options={"ghost_clipping": ghost}, rtol=1e-5, atol=1e-6)
    fewer, _ = per_example_reference(_loss(model), params, (ids[1:], labels[1:]), c)
    moved = math.sqrt(sum(((sums[k].double() - fewer[k]) ** 2).sum().item() for k in fewer))
    assert moved <= c * (1 + 1e-5)
