"""The step simulator (``fxmem.graph.liveness.walk``): the buffer reuse it simulates is the one the
eager inner compiler applies, its two byte models agree, and kept views count their storage once."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.graph.liveness import AtShape, Formulas, NodeFacts, peak, peak_bytes, schedule, walk
from fxmem.graph.reuse import dead_writes, reuse_dead_buffers
from fxmem.graph.sizes import SymbolicSizes


def _chain(x, y):
    a = torch.exp(x)          # dies at the add: the add writes into it
    b = torch.add(y, a)
    c = torch.tanh(b)
    d = torch.mul(c, 2.0)     # writes into c (dies here)
    return torch.sub(d, x), b.sum()


def _lists(gm):
    nodes = list(gm.graph.nodes)
    return ([n for n in nodes if n.op == "placeholder"], [n for n in nodes if n.op not in ("placeholder", "output")],
            gm.graph.output_node().all_input_nodes, NodeFacts(nodes))


def test_simulated_reuse_is_the_rewrite():
    """Walking the graph with the reuse analysis gives the events of the rewritten graph."""
    x = torch.randn(8, 16)
    gm = make_fx(_chain, tracing_mode="fake")(x, x)
    inputs, body, outputs, facts = _lists(gm)
    simulated = walk(inputs, body, outputs, Formulas(SymbolicSizes()), facts, counted=inputs, reuse=dead_writes)
    plain = walk(inputs, body, outputs, Formulas(SymbolicSizes()), facts, counted=inputs)
    assert reuse_dead_buffers(gm) == 3  # the add into exp's buffer, the mul into c's, the sub into d's
    assert simulated == schedule(gm, SymbolicSizes()) != plain
    values = {}
    assert peak(simulated, values).peak == 512 * 3  # x, y and one buffer (8 x 16 floats each)
    assert peak(plain, values).peak == 512 * 4  # x, y, exp and the add's own buffer


def test_formulas_and_plan_shape_integers_give_one_peak():
    gm = make_fx(_chain, tracing_mode="fake")(torch.randn(8, 16), torch.randn(8, 16))
    inputs, body, outputs, facts = _lists(gm)
    sizes = SymbolicSizes()
    for counted in ((), inputs):
        ints = walk(inputs, body, outputs, AtShape(sizes), facts, counted=counted, reuse=dead_writes)
        formulas = walk(inputs, body, outputs, Formulas(sizes), facts, counted=counted, reuse=dead_writes)
        assert [(k, n, int(b)) for k, n, b in formulas] == ints
        assert peak_bytes(ints) == peak(formulas, {}).peak


def test_kept_views_hold_their_storage_once():
    """Two inputs viewing one 2 KiB storage (slices of a fused projection) allocate it once, at
    the storage's bytes, and free it after the last read of either."""
    def f(q, k):
        return torch.exp(q) + torch.exp(k)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 16), torch.randn(4, 16))
    storage = make_fx(lambda w: w * 2, tracing_mode="fake")(torch.randn(8, 64))
    owner = next(n for n in storage.graph.nodes if n.op == "call_function")
    inputs, body, outputs, facts = _lists(gm)
    q, k = inputs
    shared = {q: (q, owner), k: (q, owner)}
    events = walk(inputs, body, outputs, AtShape(SymbolicSizes()), facts, counted=inputs, shared=shared)
    allocs = [(n, b) for kind, n, b in events if kind == "alloc"]
    assert allocs[0] == (q.name, 8 * 64 * 4) and k.name not in dict(allocs)
    frees = [n for kind, n, _ in events if kind == "free"]
    exp_k = body[1]
    assert exp_k.args[0] is k and events.index(("free", q.name, 2048)) == events.index(("alloc", exp_k.name, 256)) + 1
    assert q.name in frees


def test_size_reads_are_hoisted_so_a_dead_buffer_takes_the_write():
    """A size read after a tensor's last data read (make_fx records it where the code asked,
    e.g. BART's ``logits.view(-1, vocab)`` after ``logits + bias``) kept ``y`` alive past
    ``y + b``; hoisted next to ``y`` it reads the same size, and the add may write into ``y``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxmem.graph.joint import hoist_size_reads
    from fxmem.graph.liveness import last_reads, storage_roots
    from fxmem.graph.reuse import dead_writes

    def f(x, w, b):
        y = x @ w
        z = y + b
        return z.reshape(y.shape[0] * y.shape[1])

    x, w, b = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    gm = make_fx(f, tracing_mode="symbolic")(x, w, b)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    read = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sym_size.int and n.args[1] == 0)
    read.args = (mm, 0)  # y.size(0), read after y + b (as x.size(0): the same size)
    gm.recompile()

    def writes(gm):
        nodes = list(gm.graph.nodes)
        root = storage_roots(gm)
        return dead_writes(nodes, root, last_reads(gm, root), {n: i for i, n in enumerate(nodes)}, set(nodes))

    assert not writes(gm)
    assert hoist_size_reads(gm) >= 1
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.sym_size.int:
            assert n.prev is n.args[0] or n.prev.target is torch.ops.aten.sym_size.int, n
    assert [n.target for n in writes(gm)] == [torch.ops.aten.add.Tensor]
    torch.testing.assert_close(gm(x, w, b), f(x, w, b))
