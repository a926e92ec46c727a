"""The backward as fxmem hands it to Inductor: kept in the order the plan was measured in.

The split orders the backward so that a layer's forward is recomputed just before its own
gradients need it, and fxmem's peak is predicted from that order. Inductor changes the order in
the ways below, each measured (on HF GPT-2 with dropout at level 1 unless named);
:func:`for_inductor` undoes them on a copy of the backward (the report reads the split's own):

- **Fusion across layers.** The scheduler fuses kernels that read a common buffer (the causal
  mask every layer reads, the graph's seed buffer), and pulled several layers' recomputed
  attention into one kernel at the start of the backward: 65 MiB against 35 MiB planned (4
  layers, batch 4 x seq 256). :func:`fence_recompute` orders each recompute entry after the
  matmul the backward ran before it, with ``control_deps``, the op torch itself orders random
  ops with: fusing it with an earlier layer's work would make a cycle, which the scheduler
  refuses. The dependency orders only; it keeps no buffer alive.
- **Masks kept between kernels.** A dropout mask read by the recomputed forward and by its
  gradient was stored in fp32 between the two kernels. :func:`regenerate_random` gives each
  reader its own draw (same seed, same numbers), fused into the reader's kernel.
- **Late matmuls.** ``add(mm(a, b), c)`` becomes ``addmm(c, a, b)`` (a post-grad pattern), which
  runs the matmul when ``c`` is ready. With tied embeddings the head's weight gradient then waited
  for the embedding's, keeping the vocabulary-sized logits gradient alive through the whole
  backward: GPT-2 small at full size measured 821 MiB against 769 for HF checkpointing.
  The add is wrapped in ``control_deps``, which the pattern does not match.
- **Sums in new buffers.** The tied embedding's gradient was the head's plus a scatter into
  zeros, summed into a third vocabulary-sized buffer at the end of the backward (GPT-2 small:
  787 MiB). :func:`scatter_into_sums` scatters into the head's gradient instead (the sum in
  another order: equal to float reassociation, as Inductor's own fusions are).
- **Sums inlined into the embedding's gradient.** The residual gradient and the first norm's
  input gradient were added inside the embedding backward's kernel (with its zero fill), so both
  stayed alive while the vocabulary-sized gradient was allocated, at the very end of the backward
  where every other gradient is alive too: Llama at full size (12 x 768) measured 625.6 MiB
  against 622.6 for HF checkpointing. ``control_deps`` does not stop that fusion (it orders, and
  the order is kept inside the fused kernel). :func:`extern_scatter_sums` runs such a scatter
  as an opaque op (``fxmem::scatter_add_into_zeros``, the same aten kernel): the add becomes a
  kernel of its own, in place into a dead summand, and the gradient is allocated after it.
  Where the scatter is torch's decomposition of ``embedding_dense_backward`` it runs as eager's
  kernel (``fxmem::embedding_grad``): the decomposition's mask, clamped ids and negated mask are
  not allocated there (GPT-NeoX's step peaked 320 bytes above HF checkpointing's on them).
- **Late weight gradients.** Inductor's peak-memory reordering ran a weight gradient (a matmul
  only the output reads) after the rest of the backward, holding its input (a head's logits
  gradient) throughout. :func:`_early_weight_gradients` orders the next matmul after it, unless
  it reads a recomputed matmul's product (there Inductor's own order measured lower), where
  memory comes first (level >= 1, budgets; level 0 leaves Inductor its order).
"""

from __future__ import annotations

import bisect
import operator

import torch
import torch.fx as fx
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch._prims.rng_prims import run_and_save_rng_state
from torch.utils._ordered_set import OrderedSet

from ..graph.joint import is_random
from ..graph.module import copied
from .allowlist import HEAVY, is_view, kind

aten, prims = torch.ops.aten, torch.ops.prims


def _source(node: fx.Node) -> fx.Node:
    """The op a chain of views and getitems starts from (a view is no kernel of its own)."""
    while (node.op == "call_function" and (node.target is operator.getitem or is_view(node))
           and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def for_inductor(bw: fx.GraphModule, recomputed: set[str], weight_gradients: bool = True) -> fx.GraphModule:
    """A copy of ``bw`` (``recomputed``: the names of its recomputed nodes) that Inductor runs
    in the planned order (see the module doc); ``weight_gradients``: with
    :func:`_early_weight_gradients` (where memory comes first: level 0 leaves Inductor its order)."""
    gm, _ = copied(bw)  # the split's own graph is what the report reads
    recomputed = set(recomputed)
    regenerate_random(gm, recomputed)
    scatter_into_sums(gm)
    extern_scatter_sums(gm)
    accumulate_matmul_sums(gm)
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for found in (_recompute_fences(gm, recomputed), _early_matmuls(gm),
                  _early_weight_gradients(gm, recomputed) if weight_gradients else {}):
        for n, before in found.items():
            deps.setdefault(n, OrderedSet()).update(before)
    if deps:
        preserve_node_ordering(gm.graph, deps)
        gm.graph.lint()
        gm.recompile()
    return gm


def random_in_order(fw: fx.GraphModule) -> fx.GraphModule:
    """A copy of the forward whose random ops (a dropout, its replayable form
    ``run_and_save_rng_state``) run in graph order: each waits for the one before it, with
    ``control_deps``. Each draws from the global generator, so their order is their numbers:
    Inductor ordered the two forms apart (the replayable one is a higher-order op), and under
    ``fallback_random`` a T5 step drew other masks than eager's (loss 6.8692 against 6.8398)."""
    def drawing(n: fx.Node) -> bool:
        return n.op == "call_function" and (is_random(n) or n.target is run_and_save_rng_state)

    drawn = [n for n in fw.graph.nodes if drawing(n)]
    if len(drawn) < 2:
        return fw
    gm, env = copied(fw)
    ordered = [env[n] for n in drawn]
    preserve_node_ordering(gm.graph, {b: OrderedSet([a]) for a, b in zip(ordered, ordered[1:])})
    gm.graph.lint()
    gm.recompile()
    return gm


def _drawn(bw: fx.GraphModule, recomputed: set[str]) -> set[fx.Node]:
    """Recomputed values that depend on seeds alone: a seeded draw and the pointwise ops over it
    (a dropout's mask, its float form)."""
    drawn: set[fx.Node] = set()
    for n in bw.graph.nodes:
        if n.op != "call_function" or n.name not in recomputed:
            continue
        if n.target is prims.inductor_random.default or (
                torch.Tag.pointwise in getattr(n.target, "tags", ())
                and n.all_input_nodes and all(a in drawn for a in n.all_input_nodes)):
            drawn.add(n)
    return drawn


def regenerate_random(bw: fx.GraphModule, recomputed: set[str]) -> int:
    """Give each reader of drawn values (see :func:`_drawn`) its own draw, so that Inductor fuses
    the draw into the reader's kernel instead of keeping a value between kernels: a dropout mask
    is regenerated in the gradient kernel, where it would otherwise stay alive in fp32 from the
    recomputed forward on (a full attention matrix per layer). Same seed, same shape: the same
    numbers. The draws' names join ``recomputed``. Returns how many readers got their own draw."""
    drawn = _drawn(bw, recomputed)
    readers = [u for u in bw.graph.nodes if u not in drawn and any(a in drawn for a in u.all_input_nodes)]
    for u in readers:
        env: dict[fx.Node, fx.Node] = {}
        for a in [a for a in u.all_input_nodes if a in drawn]:
            u.replace_input_with(a, _copy_chain(bw.graph, a, u, drawn, env))
        recomputed.update(n.name for n in env.values())
    if readers:
        for n in reversed([n for n in bw.graph.nodes if n in drawn]):  # the shared draws, now unread
            if not n.users:
                bw.graph.erase_node(n)
        bw.graph.lint()
        bw.recompile()
    return len(readers)


def _copy_chain(graph: fx.Graph, value: fx.Node, before: fx.Node, drawn: set[fx.Node],
                env: dict[fx.Node, fx.Node]) -> fx.Node:
    def copy(n: fx.Node) -> fx.Node:
        if n not in drawn:
            return n
        if n not in env:
            for a in n.all_input_nodes:  # inputs first: topological
                copy(a)
            with graph.inserting_before(before):
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
        return env[n]

    return copy(value)


def _recompute_fences(bw: fx.GraphModule, recomputed: set[str]) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """Each recompute entry (a recomputed op that reads no other recomputed op) -> the last
    matmul before it."""
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    last_heavy = None
    for n in bw.graph.nodes:
        if n.op != "call_function":
            continue
        if n.name not in recomputed:
            if kind(n) == HEAVY:
                last_heavy = n
            continue
        if last_heavy is None or n.target is operator.getitem or is_view(n):
            continue
        if not any(_source(a).op == "call_function" and _source(a).name in recomputed for a in n.all_input_nodes):
            deps[n] = OrderedSet([last_heavy])
    return deps


def _early_matmuls(bw: fx.GraphModule) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """Each ``add(mm(a, b), c)`` whose ``c`` is ready only after some later matmul -> its mm
    (a dependency the add has anyway: the wrapper is what keeps the matmul early)."""
    pos = {n: i for i, n in enumerate(bw.graph.nodes)}
    heavy = [pos[n] for n in bw.graph.nodes if n.op == "call_function" and kind(n) == HEAVY]
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for n in bw.graph.nodes:
        if n.op != "call_function" or n.target is not aten.add.Tensor or len(n.all_input_nodes) != 2:
            continue
        for mm, other in (n.args, n.args[::-1]):
            if (isinstance(mm, fx.Node) and mm.target is aten.mm.default and len(mm.users) == 1
                    and isinstance(other, fx.Node)
                    and (i := bisect.bisect_right(heavy, pos[mm])) < len(heavy) and heavy[i] < pos[other]):
                deps[n] = OrderedSet([mm])
    return deps


def _returned(n: fx.Node) -> bool:
    """``n`` is read only by the graph's output, directly or through views."""
    return bool(n.users) and all(u.op == "output" or (u.op == "call_function" and is_view(u) and _returned(u))
                                 for u in n.users)


def _early_weight_gradients(bw: fx.GraphModule, recomputed: set[str]) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """The matmul after each weight gradient's (a heavy op read only by the output) -> that
    weight gradient's: it runs where the plan put it, next to its input's other readers. Not
    where it reads a recomputed matmul's product (a plan that recomputes the forward's layers
    first): there Inductor's own order keeps fewer recomputed values alive."""
    heavy, late = [], set()
    for n in bw.graph.nodes:
        if n.op != "call_function":
            continue
        is_heavy = kind(n) == HEAVY
        if is_heavy:
            heavy.append(n)
        if (is_heavy and n.name in recomputed) or any(a in late for a in n.all_input_nodes):
            late.add(n)
    return {after: OrderedSet([n]) for n, after in zip(heavy, heavy[1:]) if _returned(n) and n not in late}


_SAME_SHAPE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}


def _matmul_product(x: fx.Node) -> tuple[fx.Node, bool] | None:
    """``(mm, transposed)`` where ``x`` is a matmul's product read through 2-D transposes and
    views that keep its shape, each read by nothing else; else None."""
    transposed = False
    while not (x.op == "call_function" and x.target is aten.mm.default):
        if x.op != "call_function" or len(x.users) != 1 or not x.args or not isinstance(x.args[0], fx.Node):
            return None
        val, arg = x.meta.get("val"), x.args[0].meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor)):
            return None
        shape, source = val.shape, arg.shape
        if x.target is aten.t.default and len(shape) == 2:
            transposed = not transposed
        elif x.target is aten.transpose.int and len(shape) == 2:
            transposed ^= x.args[1] % 2 != x.args[2] % 2
        elif x.target is aten.permute.default and len(shape) == 2:
            transposed ^= [d % 2 for d in x.args[1]] == [1, 0]
        elif x.target not in _SAME_SHAPE_VIEWS or shape != source:
            return None
        x = x.args[0]
    return (x, transposed) if len(x.users) == 1 else None


def _like(v: object, val: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.shape == val.shape and v.dtype == val.dtype


def accumulate_matmul_sums(bw: fx.GraphModule) -> int:
    """``add(s, mm(a, b))``, ``s`` a sum of matmul products ready before the matmul ->
    ``addmm(s, a, b)`` (rewrites ``bw`` in place); returns how many.

    A weight applied at many places (an RNN's time steps, a shared layer) gets its gradient as a
    chain of such adds. Inductor fused the whole chain into one kernel after the last matmul, so
    every product stayed alive until then: an LSTM of 16 steps held 16 weight-sized products
    (405 KiB against eager's 204). An ``addmm`` is an extern kernel: each partial sum is written
    as its product arrives (the sum in the same order; the matmul adds into it, equal up to
    float rounding as Inductor's own fusions are)."""
    pos = {n: i for i, n in enumerate(bw.graph.nodes)}
    links: dict[fx.Node, tuple] = {}  # add -> (product, mm, transposed), in graph order
    for n in bw.graph.nodes:
        if not (n.op == "call_function" and n.target is aten.add.Tensor and not n.kwargs and len(n.args) == 2
                and all(isinstance(a, fx.Node) for a in n.args)):
            continue
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() == 2 and val.is_floating_point()
                and all(_like(a.meta.get("val"), val) for a in n.args)):
            continue
        for product, partial in (n.args[::-1], n.args):
            found = _matmul_product(product)
            source = _source(partial)
            if found is not None and (source in links or _matmul_product(partial) is not None) \
                    and pos[source] < pos[found[0]]:
                links[n] = (product, *found)
                break
    for n in links:  # in graph order: a link's partial sum is rewritten before it
        product, mm, transposed = links[n]
        partial = n.args[0] if n.args[1] is product else n.args[1]  # an earlier link rewritten: its addmm
        a, b = mm.args
        with bw.graph.inserting_before(n):
            if transposed:  # (a @ b).T = b.T @ a.T
                a, b = (bw.graph.call_function(aten.t.default, (x,)) for x in (b, a))
                for t, x in zip((a, b), mm.args[::-1]):
                    t.meta["val"] = x.meta["val"].t()
            new = bw.graph.call_function(aten.addmm.default, (partial, a, b))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        bw.graph.erase_node(n)
        while product is not mm:  # the product's views, then the matmul: now unread
            up = product.args[0]
            bw.graph.erase_node(product)
            product = up
        bw.graph.erase_node(mm)
    if links:
        bw.graph.lint()
        bw.recompile()
    return len(links)


@torch.library.custom_op("fxmem::scatter_add_into_zeros", mutates_args=("values",))
def scatter_add_into_zeros(mask: torch.Tensor, indices: list[torch.Tensor], values: torch.Tensor,
                           shape: list[int]) -> torch.Tensor:
    """``_unsafe_masked_index_put_accumulate(zeros(shape), mask, indices, values)`` (as torch
    decomposes it: clamped indices, masked values), opaque to Inductor. ``values`` (dead after it:
    Inductor re-inplaces the op) is masked in place, so the one new buffer is the result."""
    out = values.new_zeros(shape)
    clamped = [i.clamp(min=-out.size(d), max=out.size(d) - 1) for d, i in enumerate(indices)]
    return out.index_put_(clamped, values.masked_fill_(~mask, 0), accumulate=True)


@scatter_add_into_zeros.register_fake
def _(mask, indices, values, shape):
    return values.new_empty(shape)


@torch.library.custom_op("fxmem::embedding_grad", mutates_args=())
def embedding_grad(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """``aten.embedding_dense_backward`` (eager's kernel), opaque to Inductor: no mask, clamped
    indices or negated mask besides the gradient (the decomposition's
    :func:`scatter_add_into_zeros` form allocates those, a few hundred bytes at the backward's
    end, where every parameter gradient is alive)."""
    return aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, False)


@embedding_grad.register_fake
def _(grad, indices, num_weights, padding_idx):
    return grad.new_empty((num_weights, *grad.shape[indices.dim():]))


def _scalar_of(n: object, target, value: object) -> fx.Node | None:
    """``x`` where ``n`` is ``target(x, value)``; else None."""
    ok = isinstance(n, fx.Node) and n.target is target and len(n.args) == 2 and isinstance(n.args[0], fx.Node)
    return n.args[0] if ok and (value is None or n.args[1] == value) else None


def _embedding_padding(mask: fx.Node, index: fx.Node, rows: int) -> int | None:
    """``padding_idx`` where ``mask`` is torch's ``embedding_dense_backward`` decomposition's
    (``(i >= 0) & (i < rows) & (i != padding_idx)``, unsqueezed to the gradient's rank, of
    ``index``); else None."""
    while mask.op == "call_function" and mask.target is aten.unsqueeze.default:
        mask = mask.args[0]
    if mask.target is not aten.bitwise_and.Tensor:
        return None
    valid, ne = mask.args
    if _scalar_of(ne, aten.ne.Scalar, None) is not index or not isinstance(valid, fx.Node) \
            or valid.target is not aten.bitwise_and.Tensor:
        return None
    ge, lt = valid.args
    if _scalar_of(ge, aten.ge.Scalar, 0) is not index or _scalar_of(lt, aten.lt.Scalar, rows) is not index:
        return None
    return ne.args[1] if isinstance(ne.args[1], int) else None


def extern_scatter_sums(bw: fx.GraphModule) -> int:
    """A masked accumulating scatter into fresh zeros, of a sum -> ``fxmem::embedding_grad``
    where it is an embedding's gradient as torch decomposes it, else
    ``fxmem::scatter_add_into_zeros`` (rewrites ``bw`` in place); returns how many."""
    count = 0
    for n in list(bw.graph.nodes):
        if not (n.op == "call_function" and n.target is aten._unsafe_masked_index_put_accumulate.default
                and _scatter_into_zeros(n)):
            continue
        base, mask, indices, values = n.args
        if not (isinstance(values, fx.Node) and values.target is aten.add.Tensor):
            continue
        shape = list(base.args[0])
        padding = _embedding_padding(mask, indices[0], shape[0]) if len(indices) == 1 else None
        with bw.graph.inserting_before(n):
            if padding is not None:
                new = bw.graph.call_function(torch.ops.fxmem.embedding_grad.default,
                                             (values, indices[0], shape[0], padding))
            else:
                new = bw.graph.call_function(torch.ops.fxmem.scatter_add_into_zeros.default,
                                             (mask, indices, values, shape))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        bw.graph.erase_node(n)
        bw.graph.erase_node(base)
        _erase_unread(bw.graph, mask)
        count += 1
    if count:
        bw.graph.lint()
        bw.recompile()
    return count


def _erase_unread(graph: fx.Graph, n: object) -> None:
    """Erase ``n`` and the ops it alone read, where nothing reads it (a replaced op's mask)."""
    if isinstance(n, fx.Node) and n.op == "call_function" and not n.users:
        inputs = n.all_input_nodes
        graph.erase_node(n)
        for a in inputs:
            _erase_unread(graph, a)


_SCATTERS = (aten._unsafe_masked_index_put_accumulate.default, aten.index_put.default)


def _scatter_into_zeros(n: fx.Node) -> bool:
    """An accumulating scatter into a fresh zero tensor read only here (an embedding's gradient)."""
    if not (isinstance(n, fx.Node) and n.target in _SCATTERS and len(n.users) == 1):
        return False
    if n.target is aten.index_put.default and not (len(n.args) > 3 and n.args[3] is True):
        return False
    base = n.args[0]
    return (isinstance(base, fx.Node) and len(base.users) == 1
            and (base.target is aten.zeros.default or (base.target is aten.full.default and base.args[1] == 0)))


def scatter_into_sums(bw: fx.GraphModule) -> int:
    """``add(a, scatter(zeros, ...))`` -> ``scatter(a, ...)`` where ``a`` has the sum's shape and
    dtype (rewrites ``bw`` in place); returns how many sums were rewritten."""
    count = 0
    for n in list(bw.graph.nodes):
        if n.op != "call_function" or n.target is not aten.add.Tensor or n.kwargs or len(n.args) != 2:
            continue
        for a, sc in (n.args, n.args[::-1]):
            if not (_scatter_into_zeros(sc) and isinstance(a, fx.Node)):
                continue
            va, vn = a.meta.get("val"), n.meta.get("val")
            if not (isinstance(va, torch.Tensor) and va.shape == vn.shape and va.dtype == vn.dtype):
                continue
            zeros = sc.args[0]
            with bw.graph.inserting_before(n):
                new = bw.graph.call_function(sc.target, (a, *sc.args[1:]), dict(sc.kwargs))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            for dead in (n, sc, zeros):
                bw.graph.erase_node(dead)
            count += 1
            break
    if count:
        bw.graph.lint()
        bw.recompile()
    return count
