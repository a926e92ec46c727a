import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.graph.liveness import simulate
from fxmem.graph.reuse import reuse_dead_buffers
from fxmem.graph.sizes import SymbolicSizes

aten = torch.ops.aten


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_add_writes_into_dead_fresh_buffer():
    def f(x, y):
        a = torch.exp(x)          # fresh, dies at the add
        b = torch.add(y, a)       # input first: swapped so that it writes into `a`
        c = torch.tanh(b)
        d = torch.mul(c, c)       # both args the same buffer: never in place
        return torch.sub(d, x), b  # `b` is an output: still fine, `d` dies here

    x, y = torch.randn(4, 5), torch.randn(4, 5)
    gm = _trace(f, x, y)
    n = reuse_dead_buffers(gm)
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert aten.add_.Tensor in targets and aten.sub_.Tensor in targets and aten.mul.Tensor in targets
    assert n == 2
    ref = f(x, y)
    out = gm(x, y)
    for r, o in zip(ref, out):
        assert torch.equal(r, o)


def test_live_or_input_buffers_are_not_overwritten():
    def f(x):
        a = torch.exp(x)
        b = torch.add(a, 1.0)     # `a` is read again below: not in place
        c = torch.add(x, b)       # `x` is an input, `b` is read below: not in place
        return c * b, a

    x = torch.randn(3, 3)
    gm = _trace(f, x)
    assert reuse_dead_buffers(gm) == 1  # only the final mul (c dies there)
    for r, o in zip(f(x), gm(x)):
        assert torch.equal(r, o)


def test_view_keeps_storage_alive():
    def f(x):
        a = torch.exp(x)
        v = a.view(-1)
        b = torch.add(a, 2.0)      # `a`'s storage is read later through `v`
        return b, v.sum()

    x = torch.randn(2, 3)
    gm = _trace(f, x)
    assert reuse_dead_buffers(gm) == 0


def test_liveness_peak_of_known_graph():
    def f(x):
        a = torch.exp(x)        # 400 bytes
        b = torch.tanh(a)       # 400; a dies here
        c = b.sum()             # 4
        return c

    gm = _trace(f, torch.randn(10, 10))
    live = simulate(gm, SymbolicSizes())
    assert live.peak == 800 and live.peak_at.startswith("exp")  # x freed after exp (boxed)
    kept = simulate(gm, SymbolicSizes(), inputs_freed=False)
    assert kept.peak == 1200 and kept.peak_at.startswith("tanh")  # x, a, b


def test_softmax_backwards_write_into_dead_gradient():
    def f(x, g):
        lsm = torch.log_softmax(x, -1)
        sm = torch.softmax(x, -1)
        grad = g * 2.0                       # fresh, dies at the backward op
        a = aten._log_softmax_backward_data(grad, lsm, -1, torch.float32)
        grad2 = g * 3.0
        b = aten._softmax_backward_data(grad2, sm, -1, torch.float32)
        return a, b

    x, g = torch.randn(64, 333), torch.randn(64, 333)
    gm = _trace(f, x, g)
    assert reuse_dead_buffers(gm) == 2
    for r, o in zip(f(x, g), gm(x, g)):
        assert torch.equal(r, o)


def test_dropout_backward_writes_into_dead_gradient_bit_for_bit_with_one_temporary():
    """``native_dropout_backward`` rewritten to ``grad.mul_(mask).mul_(scale)`` where its gradient
    dies: the same bits (negative zeros included), and one full-size temporary (the mask's float
    copy) instead of ATen's result and temporary; the simulator's peak drops by that result."""
    from fxmem.profiling import step_perf

    def f(x, m):
        grad = x * 2.0                       # fresh, dies at the backward op
        return aten.native_dropout_backward(grad, m, 1.25)

    torch.manual_seed(0)
    x, m = torch.randn(256, 1024), torch.rand(256, 1024) > 0.3
    gm = _trace(f, x, m)
    plain = _trace(f, x, m)
    sizes = SymbolicSizes.of(gm)
    before = simulate(plain, sizes).peak
    assert reuse_dead_buffers(gm) == 1
    got = gm(x, m)
    want = f(x, m)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (got.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()  # negative zeros kept
    after = simulate(gm, sizes).peak
    full = x.numel() * 4
    assert before - after == full
    measured = []
    for module in (plain, gm):
        with step_perf("cpu") as perf:
            module(x, m)
        measured.append(perf.result.peak_bytes)
    # the gradient, then ATen's result and temporary (and a few bytes of its own) / the mask's copy
    assert 3 * full <= measured[0] < 3 * full + 64 and measured[1] == 2 * full
