"""The report reads Inductor's buffers from the wrapper code it generated
(``fxmem/graph/inductor_code.py``): what it allocates, reuses and frees, so that ``predict_peak``
with the Inductor inner compiler is Inductor's step, not one buffer per FX node."""
import pytest
import sympy
import torch
from torch import nn

import fxmem
from fxmem.graph.inductor_code import CodeError, schedule
from fxmem.graph.liveness import peak_bytes
from fxmem.profiling import step_perf

WRAPPER = '''
class Runner:
    def call(self, args):
        primals_1, saved_1, tangents_1 = args
        args.clear()
        s0 = primals_1
        assert_size_stride(saved_1, (s0, 8), (8, 1), 'input')
        buf0 = empty_strided_cpu((s0, 8), (8, 1), torch.float32)
        # Topologically Sorted Source Nodes: [mul], Original ATen: [aten.mul]
        cpp_fused_mul_0(saved_1, tangents_1, buf0)
        del saved_1
        buf1 = buf0; del buf0  # reuse
        buf2 = reinterpret_tensor(buf1, (8, s0), (1, 8), 0)
        buf3 = torch.ops.aten.some_op.default(buf1)
        buf4 = buf3[0]
        assert_size_stride(buf4, (s0, 4), (4, 1), 'torch.ops.aten.some_op.default')
        buf5 = buf3[1]
        assert_size_stride(buf5, (4, ), (1, ), 'torch.ops.aten.some_op.default')
        del buf3
        del buf1
        del buf4
        buf6 = empty_strided_cpu((16, ), (1, ), torch.bfloat16)
        return (buf2, buf5, buf6, primals_1)
'''


def _events(code=WRAPPER):
    s0 = sympy.Symbol("s0")
    return schedule(code, {"saved_1": 32 * s0, "tangents_1": 32 * s0},
                    {"saved_1": torch.float32, "tangents_1": torch.float32}, {"saved_1", "tangents_1"})


def test_the_wrapper_code_gives_allocations_reuse_and_frees_in_order():
    events, fresh = _events()
    s0 = sympy.Symbol("s0")
    assert [(k, n) for k, n, _ in events] == [
        ("alloc", "saved_1"), ("alloc", "tangents_1"), ("alloc", "buf0"), ("free", "saved_1"),
        ("alloc", "buf4"), ("alloc", "buf5"), ("free", "buf4"), ("alloc", "buf6"),
        # alive at the end (returned, or never deleted): freed after the call, oldest first
        ("free", "tangents_1"), ("free", "buf0"), ("free", "buf5"), ("free", "buf6")]
    sizes = {n: e for k, n, e in events if k == "alloc"}
    assert sizes["buf0"] == 32 * s0 and sizes["buf4"] == 16 * s0 and sizes["buf5"] == 16 and sizes["buf6"] == 32
    # buf1 (the reuse of buf0) and buf2 (a view of it) are names of buf0's storage: no allocation,
    # and deleting buf1 frees nothing while buf2 holds it
    at = [(k, n, int(e.subs(s0, 4))) for k, n, e in events]
    assert peak_bytes(at) == 3 * 128  # both inputs and buf0; saved_1 is freed before buf4 and buf5
    assert fresh == [True, True, True, False]  # the returned input is not this graph's storage


def test_an_item_outlives_its_del_while_its_calls_result_holds_it():
    """``buf1 = buf0[0]; del buf1`` frees nothing while ``buf0`` (the call's result, a tuple) is
    alive: Inductor deletes the tuple later (measured on an MoE backward, where it held an
    expert's gradient through the next expert's kernels)."""
    code = '''
class Runner:
    def call(self, args):
        x_1, = args
        args.clear()
        buf0 = torch.ops.aten.some_op.default(x_1)
        buf1 = buf0[0]
        assert_size_stride(buf1, (16, ), (1, ), 'torch.ops.aten.some_op.default')
        del buf1
        buf2 = empty_strided_cpu((8, ), (1, ), torch.float32)
        buf3 = buf0[1]
        assert_size_stride(buf3, (4, ), (1, ), 'torch.ops.aten.some_op.default')
        del buf0
        buf4 = empty_strided_cpu((2, ), (1, ), torch.float32)
        return (buf2, buf3, buf4)
'''
    events, _ = schedule(code, {"x_1": sympy.Integer(64)}, {"x_1": torch.float32}, set())
    assert [(k, n) for k, n, _ in events] == [
        ("alloc", "buf1"), ("alloc", "buf3"), ("alloc", "buf2"), ("free", "buf1"), ("alloc", "buf4"),
        ("free", "buf2"), ("free", "buf3"), ("free", "buf4")]


def test_an_unreadable_statement_is_a_code_error_and_the_report_keeps_its_simulation():
    with pytest.raises(CodeError, match="cannot parse"):
        _events(WRAPPER.replace("del buf3", "del buf3 ("))
    with pytest.raises(CodeError, match="no call"):
        _events("x = 1\n")


class MLP(nn.Module):
    def __init__(self, d=64, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(layers))
        self.head = nn.Linear(d, 10)

    def forward(self, x, y):
        for layer in self.layers:
            x = x + layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("level", [0, 1])
def test_inductor_steps_are_predicted_from_inductors_own_buffers(level):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(4, 32, 64), torch.randint(0, 10, (4, 32))
    compiled = torch.compile(model, backend="fxmem", options={"inner": "inductor", "level": level})
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            compiled(x, y).backward()
    rep = fxmem.report(compiled)
    g = rep.graphs[-1]
    assert any(n.startswith("buf") for _, n, _ in g.forward) and any(n.startswith("buf") for _, n, _ in g.backward)
    assert abs(rep.predict_peak() / perf.result.peak_bytes - 1) <= 0.05, (rep.predict_peak(), perf.result.peak_bytes)
    # fxmem's own simulation of the split graphs (one buffer per node) is what it replaces
    planned = next(p for c in fxmem.compilations(compiled) for p in c.graphs)
    assert abs(planned.peak() / perf.result.peak_bytes - 1) > abs(rep.predict_peak() / perf.result.peak_bytes - 1)


@pytest.mark.slow
def test_inductor_predictions_hold_at_another_batch_under_bf16_autocast():
    """Compiled dynamic at batch 4, stepped at batch 8: the schedule read from Inductor's code is
    in the graph's symbols (its sizes, and the kernels' temporaries scaled with the batch)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="fxmem", dynamic=True, options={"inner": "inductor", "level": 1})
    for batch in (4, 8):
        x, y = torch.randn(batch, 32, 64), torch.randint(0, 10, (batch, 32))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with step_perf("cpu") as perf, torch.autocast("cpu", dtype=torch.bfloat16):
                compiled(x, y).backward()
        rep = fxmem.report(compiled)
        assert len(rep.graphs) == 1  # one dynamic compile serves both
        predicted = rep.predict_peak(x=(batch, 32, 64))
        assert abs(predicted / perf.result.peak_bytes - 1) <= 0.05, (batch, predicted, perf.result.peak_bytes)
