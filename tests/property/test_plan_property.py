"""Property: under any level, rule set and budget, gradients equal the unoptimized graph's and
the planned saved bytes equal the bytes autograd actually keeps."""

import warnings

import pytest
import torch
from functorch.compile import aot_function
from hypothesis import given
from hypothesis import strategies as st

from fxmem.inner import eager
from fxmem.options import resolve
from fxmem.remat.partition import Partitioner
from fxmem.testing.programs import program_inputs, programs, run_program


@st.composite
def plan_options(draw):
    opts = {"level": draw(st.sampled_from([0, 1, 2]))}
    if draw(st.booleans()):
        opts["memory_budget"] = draw(st.sampled_from([0.2, 0.5, 0.8, 1.0]))
    return opts


@pytest.mark.slow
@given(programs(), plan_options(), st.data())
def test_any_plan_keeps_gradients_and_its_byte_count(program, opts, data):
    n_w, steps = program
    inputs = program_inputs(n_w)
    fn = lambda *a: run_program(steps, a[0], a[1:])  # noqa: E731
    ref = torch.autograd.grad(fn(*inputs), inputs, allow_unused=True)

    # Rules are drawn from the cluster ids this program really has (plus one that matches nothing).
    probe = Partitioner(resolve({}, env={}))
    aot_function(fn, fw_compiler=eager, partition_fn=probe)(*inputs)
    ids = sorted({c.id for c in probe.planned[-1].plan.clusters}) + ["nosuch+"]
    rules = data.draw(st.lists(st.builds(lambda c, s, n: f"{c}:{s}:{n}", st.sampled_from(ids),
                                         st.sampled_from([0, 1, 2]), st.sampled_from([-1, 1, 2])), max_size=3))
    partitioner = Partitioner(resolve({**opts, "config": rules}, env={}))
    compiled = aot_function(fn, fw_compiler=eager, partition_fn=partitioner)
    held = []
    keep = {t.untyped_storage().data_ptr() for t in inputs}  # inputs and views of them are free
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "matches nothing" rule warns
        with torch.autograd.graph.saved_tensors_hooks(  # a budget is never refused (an unmet one warns)
                lambda t: held.append(0 if t.untyped_storage().data_ptr() in keep
                                      else t.numel() * t.element_size()) or t,
                lambda t: t):
            loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    torch.testing.assert_close(loss, fn(*inputs), rtol=1e-6, atol=0)
    for a, b in zip(grads, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert sum(held) == partitioner.planned[-1].plan.saved_bytes
