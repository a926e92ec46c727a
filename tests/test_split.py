"""The split accepts any valid saved set: random programs, random saved sets, same gradients."""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from hypothesis import given
from hypothesis import strategies as st

from fxmem.graph.joint import JointGraph, is_multi_output
from fxmem.remat.split import InvalidSavedSet, split
from fxmem.testing.programs import D, program_inputs, programs, run_program


def _joint_and_split(fn, inputs, choose):
    """Compile ``fn`` with a partition function that splits with ``choose(joint)`` as saved set."""
    chosen = {}

    def partition(gm, joint_inputs, *, num_fwd_outputs, **_):
        joint = JointGraph.of(gm, num_fwd_outputs)
        result = split(joint, choose(joint))
        chosen["split"] = result
        return result.fw, result.bw

    compiled = aot_function(fn, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                            partition_fn=partition)
    return compiled(*inputs), chosen


@given(programs(), st.data())
def test_random_saved_sets_give_same_gradients(program, data):
    n_w, steps = program
    x, *ws = program_inputs(n_w)
    fn = lambda x, *ws: run_program(steps, x, ws)  # noqa: E731
    ref = fn(x, *ws)
    ref_grads = torch.autograd.grad(ref, [x, *ws], allow_unused=True)

    def choose(joint):
        candidates = [n for n in joint.gm.graph.nodes if n.op == "call_function"
                      and n not in joint.backward and not is_multi_output(n)]
        return data.draw(st.sets(st.sampled_from(candidates)) if candidates else st.just(set()))

    loss, chosen = _joint_and_split(fn, [x, *ws], choose)
    grads = torch.autograd.grad(loss, [x, *ws], allow_unused=True)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    s = chosen["split"]
    # the backward's tensor inputs are exactly the saved tensors, in order
    bw_inputs = [n.name for n in s.bw.graph.find_nodes(op="placeholder")]
    assert bw_inputs[len(s.saved_syms):len(s.saved_syms) + len(s.saved)] == [n.name for n in s.saved]


def test_save_nothing_recomputes_everything():
    x = torch.randn(4, D, requires_grad=True)
    w = torch.randn(D, D, requires_grad=True)
    fn = lambda x, w: torch.tanh(F.gelu(x @ w) @ w).sum()  # noqa: E731
    ref = torch.autograd.grad(fn(x, w), [x, w])
    loss, chosen = _joint_and_split(fn, [x, w], lambda joint: set())
    torch.testing.assert_close(torch.autograd.grad(loss, [x, w]), ref)
    s = chosen["split"]
    assert {n.op for n in s.saved} == {"placeholder"}  # only inputs cross over
    assert any("mm" in str(n.target) for n in s.recomputed)


def test_saving_a_backward_node_is_rejected():
    x = torch.randn(4, D, requires_grad=True)

    def choose(joint):
        return {next(iter(joint.backward - set(joint.tangents)))}

    with pytest.raises(InvalidSavedSet, match="backward-only or tuples"):
        _joint_and_split(lambda x: torch.tanh(x).sum(), [x], choose)


def test_recomputing_a_random_op_is_rejected():
    x = torch.randn(4, D, requires_grad=True)
    with pytest.raises(InvalidSavedSet, match="random ops"):
        _joint_and_split(lambda x: (F.dropout(x, 0.5, training=True) * x).sum(), [x], lambda joint: set())
