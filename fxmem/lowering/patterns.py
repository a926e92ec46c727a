"""The pattern table: every graph pattern fxmem lowers to a fused kernel, in one place.

Each :class:`Pattern` names an option key (``lowering={"<name>": False}`` turns it off), says in
words what it matches and what replaces it, and has a finder: given one node of a Dynamo graph,
it returns a :class:`Match` (the nodes to replace, the node whose value the replacement takes
over, and the call from :mod:`.functions` that computes it), a :class:`Skip` (the anchor op is
there but the rest does not fit: left alone, with the reason) or None.

A match must be whole: every node it replaces other than its output is used only inside the
pattern (the one exception: logits that are also a graph output stay computed for it), shapes
and dtypes are those the kernel computes. Patterns run in table order, so SwiGLU/GeGLU take
their GELU before bias-GELU looks for one.

A match is ``proven`` when its fused form never raises the planned step peak and ``futile`` when
it cannot lower it; the backend applies the first and declines the second (unless its pattern is
asked for by name) without comparing plans, and compares the rest (one trace, a second plan:
``fxmem.lowering.splice``; what that costs: bench/results/realistic-compile-time.md).
Proven: the two norms (checked on the model zoo at levels 0, 1 and 2 by ``tests/test_lowering_proven.py``), attention
with dropout on CPU (it keeps what the math path keeps but the dropout mask as bool, and holds
slices where the math path holds whole score buffers) and the fused
cross-entropy where its logits are at least CE_PROVEN_FROM times the gradients it keeps from the
forward (without autocast: under it the fused loss is compared, see CE_PROVEN_FROM); futile: the
fused cross-entropy below CE_FUTILE_BELOW times, whose fixed buffers then outweigh the logits
(bench/results/lowering-ce-ratio.md), and SwiGLU/GeGLU, which never changed the planned peak on
the zoo (bench/results/lowering-glu.md; under a memory budget the fused SwiGLU measured above its
simulation). Bias-GELU is compared: whether it lowers the peak depends on the model (it does on GPT-2's
written-out tanh GELU, not with ``F.gelu``: docs/lowering.md).

Under autocast (:mod:`.amp`) the finders read the dtypes Dynamo recorded, which are autocast's,
and hand the fused call the dtype autocast would have run the replaced ops in (``dtype=``): the
fused loss casts hidden states, weight and bias to the autocast dtype and returns an fp32 loss, a
LayerNorm casts to fp32 on CUDA, a matmul before a GELU casts its bias; SwiGLU/GeGLU, RMSNorm
(its statistics are fp32 as written) and dropout run on no autocast list and need no cast. A match
whose fused output dtype would differ from the graph's is left alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._functorch import predispatch
from torch.fx.experimental.symbolic_shapes import optimization_hint as hint_int

from ..options import LOWERING_PATTERNS
from . import amp
from . import functions as fn
from .match import POINTWISE, arg, commuted, is_cast_to, is_number, last_dim_vector, only_users, op, same_shape, tensor

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Match:
    pattern: str
    output: fx.Node                  # its value is what the replacement computes
    nodes: list[fx.Node]             # replaced (erased once unused), graph order
    call: Callable                   # from .functions
    args: tuple
    kwargs: dict = field(default_factory=dict)
    note: str = ""
    kept: tuple = ()                 # (node, call, args, kwargs): a replaced node the graph still needs
    # Never raises the planned step peak (see PROVEN): applied without the backend's comparison.
    proven: bool = False
    # Why it cannot lower the planned peak (here): unless the pattern is asked for by name (or
    # lowering=True), the backend declines it without comparing plans.
    futile: str = ""


@dataclass
class Skip:
    pattern: str
    node: fx.Node
    reason: str


@dataclass(frozen=True)
class Context:
    """What finders need to know about the graph beyond a node's neighbours."""
    region: dict  # node -> (batch_size, randomness) of the innermost vmap region holding it
    batched: frozenset  # nodes computed from a vmap-batched input
    autocast: dict = field(default_factory=dict)  # node -> amp.State: the autocast on where it runs

    def amp(self, node: fx.Node) -> tuple[str, torch.dtype] | None:
        """(device type, autocast dtype) of the autocast on where ``node`` runs, for the device of
        its value; None where none is."""
        t = tensor(node)
        state = self.autocast.get(node, {})
        if t is None or t.device.type not in state:
            return None
        return t.device.type, state[t.device.type]

    @classmethod
    def of(cls, graph: fx.Graph) -> "Context":
        region, stack, batched = {}, [], set()
        for n in graph.nodes:
            if n.op == "call_function" and n.target is predispatch._vmap_increment_nesting:
                stack.append((n.args[0], n.args[1] if len(n.args) > 1 else "error"))
            elif n.op == "call_function" and n.target is predispatch._vmap_decrement_nesting and stack:
                stack.pop()
            elif stack:
                region[n] = stack[-1]
            if n.op == "call_function" and n.target is predispatch._add_batch_dim:
                batched.add(n)
            elif any(a in batched for a in n.all_input_nodes):
                batched.add(n)
        return cls(region, frozenset(batched), amp.states(graph))


Finder = Callable[[fx.Node, Context], "Match | Skip | None"]


@dataclass(frozen=True)
class Pattern:
    name: str           # the option key (fxmem.options.LOWERING_PATTERNS)
    matches: str        # what it matches, in words
    replacement: str    # the fused ops that replace it
    find: Finder


def _whole(nodes: list[fx.Node], output: fx.Node, keep_for_output: tuple = ()) -> bool:
    """Every node but ``output`` is used only inside the pattern (nodes in ``keep_for_output``
    may also be used by the graph's output node)."""
    inside = set(nodes)
    for n in nodes:
        if n is output:
            continue
        extra = {u for u in n.users if u not in inside}
        if extra and not (n in keep_for_output and all(u.op == "output" for u in extra)):
            return False
    return True


def _ordered(nodes) -> list[fx.Node]:
    nodes = list(dict.fromkeys(nodes))
    graph = nodes[0].graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(nodes, key=pos.__getitem__)


# -- fused linear cross-entropy ---------------------------------------------------------------
def _leading_slice(index, ndim: int) -> bool:
    """``logits[index]`` slices leading dims only (the vocab dim stays whole)."""
    idx = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) for i in idx):
        return False
    if len(idx) < ndim:
        return True
    return len(idx) == ndim and idx[-1] == slice(None, None, None)


def _slice_after_reshape(ops: list) -> bool:
    """A slice follows a reshape: the slice indexes the reshaped rows, which the rewrite (slices
    on the hidden states, then one reshape) does not reproduce."""
    reshaped = False
    for o in ops:
        reshaped |= o in ("view", "reshape", "flatten")
        if o == "getitem" and reshaped:
            return True
    return False


def find_linear_cross_entropy(n: fx.Node, ctx: Context):
    if op(n) != "cross_entropy":
        return None
    name = "fused_linear_cross_entropy"

    def skip(reason):
        return Skip(name, n, reason)

    x, target = arg(n, 0, "input"), arg(n, 1, "target")
    if arg(n, 2, "weight") is not None:
        return skip("class weights")
    if arg(n, 3, "size_average") is not None or arg(n, 5, "reduce") is not None:
        return skip("legacy size_average/reduce arguments")
    ignore_index, reduction = arg(n, 4, "ignore_index", -100), arg(n, 6, "reduction", "mean")
    smoothing = arg(n, 7, "label_smoothing", 0.0)
    if not (isinstance(ignore_index, int) and reduction in ("mean", "sum", "none")
            and is_number(smoothing)):
        return skip("non-constant ignore_index, reduction or label_smoothing")
    tx, tt = tensor(x), tensor(target)
    if tx is None or tt is None or tx.dim() != 2 or tt.dim() != 1 or tt.dtype.is_floating_point:
        return skip("logits are not [tokens, vocab] with integer [tokens] targets")
    chain, index, cur, logit_bias = [], [], x, None
    while op(cur) != "linear":
        o, t_in = op(cur), tensor(arg(cur, 0)) if isinstance(cur, fx.Node) else None
        t_out = tensor(cur)
        if t_in is None or t_out is None:
            return skip("the logits do not come from a linear layer")
        if o == "add":  # BART's lm_head(h) + final_logits_bias: one more bias of the linear
            found = [(a, c) for a, c in commuted(cur) if same_shape(a, cur) and _logit_bias(c, t_out)]
            if not found or logit_bias is not None:
                return skip("the logits add something other than one [1, vocab] bias")
            chain.append(cur)
            cur, logit_bias = found[0]
            continue
        if o in ("view", "reshape", "flatten"):
            if t_in.shape[-1] != t_out.shape[-1]:
                return skip("a reshape of the logits mixes the vocab dim")
        elif o == "getitem":
            if not _leading_slice(arg(cur, 1), t_in.dim()):
                return skip("the logits are indexed along the vocab dim")
            index.append(arg(cur, 1))
        elif o == "contiguous" or is_cast_to(cur, torch.float32):
            pass
        else:
            return skip("the logits do not come from a linear layer (or pass an op other than "
                        "view/reshape/flatten/slice/contiguous/float)")
        chain.append(cur)
        cur = arg(cur, 0)
    lin = cur
    if _slice_after_reshape([op(c) for c in reversed(chain)]):  # chain order: from the linear on
        return skip("the logits are sliced after a reshape")
    h, w, b = arg(lin, 0, "input"), arg(lin, 1, "weight"), arg(lin, 2, "bias")
    th, tw, tb = tensor(h), tensor(w), tensor(b) if b is not None else None
    if th is None or tw is None or tw.dim() != 2 or (b is not None and tb is None):
        return skip("the linear layer's operands are not tensors")
    biases = [t for t in (tb, tensor(logit_bias)) if t is not None]
    autocast, cast = ctx.amp(lin), None
    if autocast is not None:  # the matmul runs in autocast's dtype: the fused call casts to it
        cast = amp.compute_dtype("matmul", *autocast)
        if logit_bias is not None:
            return skip("a logit bias under autocast (the add promotes the logits to fp32)")
        if tensor(lin).dtype != cast or any(t.dtype not in FLOATS for t in (th, tw, *biases)):
            return skip(f"under autocast the linear runs in {tensor(lin).dtype}, not its {cast}")
    elif th.dtype not in FLOATS or tw.dtype != th.dtype or any(t.dtype != th.dtype for t in biases):
        return skip(f"dtypes {th.dtype}/{tw.dtype} are not one float dtype")
    if tx.shape[-1] != tw.shape[0]:
        return skip("the logits' last dim is not the linear layer's output dim")
    region = ctx.region.get(n)
    if region is not None and any(p in ctx.batched for p in (w, b, logit_bias)):
        return skip("per-example weights inside vmap")
    nodes = _ordered([lin, *chain, n])
    # the full logits: the linear's output, or its sum with the logit bias added right after it
    top = chain[-1] if chain and op(chain[-1]) == "add" else lin
    returned = any(u.op == "output" for u in top.users)
    if not _whole(nodes, n, keep_for_output=(top,)):
        return skip("the logits (or a view of them) are used by other ops")
    call = fn.per_example_linear_cross_entropy if region is not None else fn.linear_cross_entropy
    kwargs = dict(index=tuple(index[::-1]), hidden=int(tw.shape[1]), ignore_index=ignore_index,
                  label_smoothing=float(smoothing), reduction=reduction, out_dtype=tensor(n).dtype)
    if cast is not None:
        kwargs["dtype"] = cast
    if logit_bias is not None:
        kwargs["logit_bias"] = logit_bias
    note = ("the logits are also a graph output: computed once, for it and the loss; their "
            "backward is skipped when their gradient is zero (return only the loss to save them "
            "too)") if returned else ""
    kept = ((top, fn.returned_logits, (h, w, b, logit_bias), dict(dtype=cast)),) if returned and region is None else ()
    if kept:
        kwargs["logits"] = top  # computed for the output anyway: the loss reads them
    ratio = _logits_per_gradient(tx, tw)
    futile = "" if region is not None or ratio >= CE_FUTILE_BELOW else (
        f"not applied: its {hint_int(tx.shape[0]):,} x {int(tw.shape[0]):,} logits are fewer than the "
        f"{int(tw.shape[1]):,}-wide gradients of its input and weight it keeps from the forward "
        f"(ratio {ratio:.2f} < {CE_FUTILE_BELOW}: never a lower planned peak on the zoo, "
        "bench/results/lowering-ce-ratio.md)")
    return Match(name, n, nodes, call, (h, w, b, target), kwargs, note, kept,
                 proven=region is None and ratio >= CE_PROVEN_FROM and cast is None, futile=futile)


# The fused loss by the ratio of its logits to the gradients it computes in the forward and keeps
# for the backward, tokens x vocab / ((tokens + vocab) x hidden), at the compiled shape. Measured
# on the zoo at levels 0 and 1 (bench/studies/ce_ratio.py; tests/test_lowering_proven.py checks
# 0-2): below CE_FUTILE_BELOW it never lowered the planned peak (declined without comparing plans),
# from CE_PROVEN_FROM on it never raised it (applied without comparing; BART still peaked higher at
# 1.78, lower from 1.88); in between the backend compares. Under autocast it is always compared: the
# kernel's chunk of logits stays fp32 (plus a bf16 copy) while the unfused logits shrink, and at
# ratio 3.1 (HF GPT-2 and Llama, vocab 512, hidden 32, 124 tokens, logits returned too) its plan
# peaked 3% higher than the unfused one (tests/integration/test_autocast.py).
CE_FUTILE_BELOW, CE_PROVEN_FROM = 1.0, 2.5


def _logits_per_gradient(logits: torch.Tensor, weight: torch.Tensor) -> float:
    """tokens x vocab / ((tokens + vocab) x hidden), sizes at their hints (a dynamic shape's
    decision holds at the size it was compiled for)."""
    rows, (vocab, hidden) = hint_int(logits.shape[0]), (int(s) for s in weight.shape)
    return rows * vocab / ((rows + vocab) * hidden)


def _logit_bias(c: Any, logits: torch.Tensor) -> bool:
    """``c`` adds one value per vocabulary entry to every row: shape [vocab] or [1, .., vocab]."""
    t = tensor(c)
    return isinstance(c, fx.Node) and t is not None and t.dim() >= 1 and t.shape[-1] == logits.shape[-1] \
        and all(s == 1 for s in t.shape[:-1]) and t.dim() <= logits.dim()


# -- SwiGLU / GeGLU -------------------------------------------------------------------------
def _glu_finder(name: str, activations: tuple[str, ...]) -> Finder:
    def find(n: fx.Node, ctx: Context):
        if op(n) != "mul":
            return None
        for a, up in commuted(n):
            if op(a) not in activations or not isinstance(up, fx.Node):
                continue
            gate = arg(a, 0, "input")
            if op(a) == "silu":
                if arg(a, 1, "inplace", False):
                    return Skip(name, n, "in-place SiLU")
                activation = "silu"
            else:
                approx = arg(a, 1, "approximate", "none")
                if approx not in ("none", "tanh"):
                    return Skip(name, n, f"GELU approximate={approx!r}")
                activation = "gelu_tanh" if approx == "tanh" else "gelu"
            tg, tu, ty = tensor(gate), tensor(up), tensor(n)
            if tg is None or tu is None or ty is None:
                continue
            if not (tuple(tg.shape) == tuple(tu.shape) == tuple(ty.shape)) or tg.dtype != tu.dtype \
                    or tg.dtype not in FLOATS + (torch.float64,):
                return Skip(name, n, "gate and up differ in shape or dtype (broadcasting)")
            nodes = _ordered([a, n])
            if not _whole(nodes, n):
                return Skip(name, n, "the activation's output is used by other ops")
            return Match(name, n, nodes, fn.glu, (gate, up), dict(activation=activation), futile=GLU_FUTILE)
        return None

    return find


# Whole-graph SwiGLU/GeGLU unless asked for by name: on the zoo (Llama, Mistral, Mixtral, Gemma2;
# levels 0-2, vocab 512 and 32000) the fused form left the planned peak unchanged every time
# (bench/results/lowering-glu.md), and under a memory budget it measured above its simulation.
GLU_FUTILE = ("not applied by default: its fused form never changed the planned peak on the zoo "
              "(bench/results/lowering-glu.md); name it in `lowering` to have the plans compared")


# -- bias + GELU ----------------------------------------------------------------------------
_PROBE = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
_GELU_REFS = {a: F.gelu(_PROBE, approximate=a) for a in ("none", "tanh")}


def _pointwise_cone(out: fx.Node, stop: Any = None, limit: int = 16):
    """The pointwise ops ``out`` is computed by, walking up to ``stop`` (or to non-pointwise
    nodes): (nodes, leaves) with Python numbers not counted as leaves; None if too large."""
    nodes, leaves, todo = set(), set(), [out]
    while todo:
        m = todo.pop()
        if m in nodes or m in leaves:
            continue
        if m is stop or op(m) not in POINTWISE:
            leaves.add(m)
            continue
        if len(nodes) >= limit:
            return None
        nodes.add(m)
        for a in list(m.args) + list(m.kwargs.values()):
            if isinstance(a, fx.Node):
                todo.append(a)
            elif not is_number(a):
                return None
    return _ordered(nodes), leaves


def _formula_of_one(out: fx.Node):
    """``out`` as pointwise ops of a single tensor ``x``: (nodes, x), taking the ``x`` closest
    to ``out`` (so that ``gelu(h + b)`` written out yields ``x = h + b``)."""
    full = _pointwise_cone(out)
    if full is None:
        return None
    nodes, leaves = full
    for x in [*reversed(nodes[:-1]), *leaves]:
        cone = _pointwise_cone(out, stop=x)
        if cone is not None and cone[1] == {x}:
            return cone[0], x
    return None


def _evaluate(nodes: list[fx.Node], leaf: fx.Node, out: fx.Node, x: torch.Tensor):
    env = {leaf: x}
    for m in nodes:
        args = fx.node.map_arg(m.args, env.__getitem__)
        kwargs = fx.node.map_arg(m.kwargs, env.__getitem__)
        if m.op == "call_method":
            env[m] = getattr(args[0], m.target)(*args[1:], **kwargs)
        else:
            env[m] = m.target(*args, **kwargs)
    return env[out]


def _written_out_gelu(t: fx.Node):
    """GELU written in pointwise ops around ``t`` (a tanh or erf): (nodes, x, out, approximate).

    The candidate outputs are t's pointwise descendants (a few levels); the largest that is a
    formula of one tensor and equals GELU numerically on [-6, 6] (fp64) wins."""
    candidates, frontier = [], [t]
    for _ in range(4):
        frontier = [u for m in frontier for u in m.users if op(u) in POINTWISE]
        candidates += frontier
    best = None
    for out in candidates:
        found = _formula_of_one(out)
        if found is None or t not in found[0] or not isinstance(found[1], fx.Node):
            continue
        nodes, leaf = found
        try:
            with torch.no_grad():
                y = _evaluate(nodes, leaf, out, _PROBE)
        except Exception:  # an op the probe cannot run: not a formula of one tensor
            continue
        for approx, ref in _GELU_REFS.items():
            if isinstance(y, torch.Tensor) and y.shape == ref.shape and torch.allclose(y, ref, rtol=1e-9, atol=1e-9):
                if best is None or len(nodes) > len(best[0]):
                    best = (nodes, leaf, out, approx)
    return best


def _bias_of(z: fx.Node, inside: list[fx.Node], ctx: Context):
    """How the GELU input ``z`` adds a bias: (extra nodes, call, args, kwargs) or None. Under
    autocast a matmul's operands and bias are cast to its dtype, by the fused call too."""
    tz = tensor(z)
    if tz is None or not only_users(z, set(inside)):
        return None
    h = tz.shape[-1]
    autocast = ctx.amp(z)
    cast = amp.compute_dtype("matmul", *autocast) if autocast is not None else None
    if cast is not None and cast != tz.dtype:
        cast = None  # not a matmul autocast ran (e.g. in fp64): only the add below can match
    if op(z) == "add":
        for x, b in commuted(z):
            if isinstance(x, fx.Node) and last_dim_vector(b, h) and same_shape(x, z) \
                    and tensor(b).dtype == tensor(x).dtype == tz.dtype:
                return [z], fn.bias_gelu, (x, b), {}
    if op(z) == "linear" and arg(z, 2, "bias") is not None and last_dim_vector(arg(z, 2, "bias"), h):
        return [z], fn.linear_bias_gelu, (arg(z, 0, "input"), arg(z, 1, "weight"), arg(z, 2, "bias")), dict(dtype=cast)
    mm, shape = z, None
    if op(z) == "view" and op(arg(z, 0)) == "addmm" and len(arg(z, 0).users) == 1:
        mm = arg(z, 0)
        shape = tuple(z.args[1]) if len(z.args) == 2 and isinstance(z.args[1], (tuple, list)) else tuple(z.args[1:])
    if op(mm) == "addmm" and not mm.kwargs and len(mm.args) == 3 and last_dim_vector(mm.args[0], h) \
            and (cast is not None or tensor(mm.args[0]).dtype == tz.dtype):
        nodes = [mm] if mm is z else [mm, z]
        return nodes, fn.addmm_bias_gelu, (mm.args[0], mm.args[1], mm.args[2]), dict(shape=shape, dtype=cast)
    return None


def find_bias_gelu(n: fx.Node, ctx: Context):
    name = "bias_gelu"
    if op(n) == "gelu":
        z, approx = arg(n, 0, "input"), arg(n, 1, "approximate", "none")
        if approx not in ("none", "tanh"):
            return Skip(name, n, f"approximate={approx!r}")
        nodes, out = [n], n
    elif op(n) in ("tanh", "erf"):
        found = _written_out_gelu(n)
        if found is None:
            return None  # a tanh/erf that is not GELU
        nodes, z, out, approx = found
        if not _whole(nodes, out):
            return Skip(name, n, "GELU written out, but an intermediate is used by other ops")
    else:
        return None
    tz, ty = tensor(z), tensor(out)
    if tz is None or ty is None or tz.dtype not in FLOATS + (torch.float64,) or tuple(tz.shape) != tuple(ty.shape):
        return Skip(name, n, "not a float tensor GELU")
    if ty.dtype != tz.dtype:  # e.g. CUDA autocast runs the written-out tanh formula's pow in fp32
        return Skip(name, n, f"the GELU's output dtype {ty.dtype} differs from its input's {tz.dtype}")
    bias = _bias_of(z, nodes, ctx)
    if bias is None:
        if op(n) == "gelu":
            return None  # F.gelu without a bias: nothing to fuse
        return Match(name, out, nodes, fn.bias_gelu, (z, None), dict(approximate=approx),
                     "GELU written out in pointwise ops, no bias")
    extra, call, args, kwargs = bias
    return Match(name, out, _ordered(extra + nodes), call, args, dict(kwargs, approximate=approx))


# -- RMSNorm written out --------------------------------------------------------------------
def _last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def find_rms_norm(n: fx.Node, ctx: Context):
    """``w * (xf * rsqrt(mean(xf^2, -1, keepdim=True) + eps)).to(x.dtype)`` with
    ``xf = x.to(float32)`` (HF Llama/Mistral/Qwen), or ``w * (x * rsqrt(...))`` (HF T5, whose
    cast back happens only for half weights), anchored at the rsqrt."""
    name = "rms_norm"
    if op(n) != "rsqrt":
        return None
    skip = lambda why: Skip(name, n, why)  # noqa: E731
    ve = arg(n, 0, "input")
    if op(ve) != "add":
        return skip("rsqrt of something other than mean + eps")
    v = eps = None
    for a, c in commuted(ve):
        if op(a) == "mean" and is_number(c):
            v, eps = a, float(c)
    if v is None or not eps > 0:
        return skip("rsqrt of something other than mean + eps")
    sq = arg(v, 0, "input")
    tsq = tensor(sq)
    if tsq is None or not _last_dim(arg(v, 1, "dim"), tsq.dim()) or arg(v, 2, "keepdim", False) is not True \
            or arg(v, 3, "dtype") is not None:
        return skip("mean over other dims than the last (keepdim)")
    o = op(sq)
    if o in ("pow",) and arg(sq, 1, "exponent") == 2:
        xf = arg(sq, 0)
    elif o == "square":
        xf = arg(sq, 0)
    elif o == "mul" and arg(sq, 0) is arg(sq, 1):
        xf = arg(sq, 0)
    else:
        return skip("mean of something other than x**2")
    if len(n.users) != 1:
        return skip("rsqrt used twice")
    up = is_cast_to(xf) and isinstance(arg(xf, 0), fx.Node)
    x = arg(xf, 0) if up else xf
    y = next(iter(n.users))
    # Llama multiplies the fp32 copy, T5 the input itself (promoted to fp32 by the product: the
    # same values)
    if op(y) != "mul" or not any(a in (xf, x) and b is n for a, b in commuted(y)):
        return skip("rsqrt(...) does not multiply x")
    txf, ty, tx = tensor(xf), tensor(y), tensor(x)
    if txf is None or ty is None or tx is None or txf.dtype not in (torch.float32, torch.float64) \
            or ty.dtype != txf.dtype or tuple(ty.shape) != tuple(txf.shape):
        return skip("statistics not in fp32")
    nodes = ([xf] if up else []) + [sq, v, ve, n, y]
    out = y
    users = list(y.users)
    if len(users) == 1 and is_cast_to(users[0]):
        out = users[0]
        nodes.append(out)
    if tensor(out).dtype != tx.dtype:
        return skip(f"normalized values not cast back to the input dtype {tx.dtype}")
    weight = None
    users = list(out.users)
    if len(users) == 1 and op(users[0]) == "mul":
        for a, w in commuted(users[0]):
            if a is out and isinstance(w, fx.Node) and last_dim_vector(w, txf.shape[-1]) \
                    and same_shape(users[0], out):
                weight, out = w, users[0]
                nodes.append(out)
                break
    expect = torch.promote_types(tx.dtype, tensor(weight).dtype) if weight is not None else tx.dtype
    if tensor(out).dtype != expect:
        return skip("output dtype differs from the kernel's")
    if not _whole(nodes, out):
        return skip("an intermediate is used by other ops")
    return Match(name, out, nodes, fn.rms_norm, (x, weight), dict(eps=eps), proven=True)


# -- LayerNorm ------------------------------------------------------------------------------
def find_layer_norm(n: fx.Node, ctx: Context):
    name = "layer_norm"
    if op(n) != "layer_norm":
        return None
    x, shape = arg(n, 0, "input"), arg(n, 1, "normalized_shape")
    w, b, eps = arg(n, 2, "weight"), arg(n, 3, "bias"), arg(n, 4, "eps", 1e-5)
    tx = tensor(x)
    if tx is None or tx.dtype not in FLOATS + (torch.float64,):
        return Skip(name, n, "not a float tensor")
    shape = (shape,) if isinstance(shape, int) else tuple(shape) if isinstance(shape, (list, tuple)) else None
    if shape is None or len(shape) != 1 or shape[0] != tx.shape[-1] or not is_number(eps):
        return Skip(name, n, "normalizes over more than the last dim")
    autocast = ctx.amp(n)
    cast = amp.compute_dtype("layer_norm", *autocast) if autocast is not None else None  # fp32 on CUDA
    for p in (w, b):
        if p is not None and not (last_dim_vector(p, tx.shape[-1])
                                  and (cast is not None or tensor(p).dtype in (tx.dtype, torch.float32))):
            return Skip(name, n, "weight/bias shapes or dtypes")
    if tensor(n).dtype != (cast or tx.dtype):
        return Skip(name, n, f"output dtype {tensor(n).dtype} differs from the kernel's {cast or tx.dtype}")
    return Match(name, n, [n], fn.layer_norm, (x, w, b), dict(eps=float(eps), dtype=cast), proven=True)


# -- dropout --------------------------------------------------------------------------------
def find_dropout(n: fx.Node, ctx: Context):
    name = "dropout"
    if op(n) != "dropout":
        return None
    x, p = arg(n, 0, "input"), arg(n, 1, "p", 0.5)
    training, inplace = arg(n, 2, "training", True), arg(n, 3, "inplace", False)
    if not is_number(p) or training is not True or inplace is not False:
        return None if training is False else Skip(name, n, "non-constant p/training, or in place")
    if p == 0:
        return None  # the identity: AOTAutograd drops it
    if not 0 < p < 1:
        return Skip(name, n, f"p={p}")
    tx = tensor(x)
    if tx is None or not tx.is_floating_point():
        return Skip(name, n, "not a float tensor")
    region = ctx.region.get(n)
    if region is not None and region[1] != "different":
        return Skip(name, n, f"inside vmap with randomness={region[1]!r} (seeded dropout draws "
                             "a different mask per example)")
    return Match(name, n, [n], fn.dropout, (x,), dict(p=float(p)))


# -- attention with dropout -------------------------------------------------------------------
def find_attention_dropout(n: fx.Node, ctx: Context):
    """SDPA with dropout on CPU, which takes torch's math path (four [B, H, L, S] fp32 buffers per
    layer between forward and backward); the flash kernels (no dropout, or CUDA) are left alone."""
    name = "attention_dropout"
    if op(n) != "scaled_dot_product_attention":
        return None
    q, k, v = arg(n, 0, "query"), arg(n, 1, "key"), arg(n, 2, "value")
    mask, p = arg(n, 3, "attn_mask"), arg(n, 4, "dropout_p", 0.0)
    causal, scale, gqa = arg(n, 5, "is_causal", False), arg(n, 6, "scale"), arg(n, 7, "enable_gqa", False)
    if not is_number(p) or p == 0:
        return None  # no dropout: the flash kernel, nothing to gain
    tq, tk, tv, tm, out = tensor(q), tensor(k), tensor(v), tensor(mask), tensor(n)
    if any(t is None for t in (tq, tk, tv, out)) or (mask is not None and tm is None):
        return Skip(name, n, "q, k, v or the mask is not a tensor")
    if tq.device.type != "cpu":
        return Skip(name, n, f"on {tq.device.type}: torch's fused kernels take dropout there")
    if not 0 < p < 1 or not isinstance(causal, bool) or gqa is not False or not (scale is None or is_number(scale)):
        return Skip(name, n, "dropout_p, is_causal, scale or enable_gqa not plain constants (or GQA)")
    if ctx.region.get(n) is not None:
        return Skip(name, n, "inside vmap")
    if any(t.dim() != 4 for t in (tq, tk, tv)) or tq.shape[:2] != tk.shape[:2] or tk.shape[:3] != tv.shape[:3]:
        return Skip(name, n, "not [batch, heads, length, dim] q, k, v with the same batch and heads")
    if causal and mask is not None:
        return Skip(name, n, "both attn_mask and is_causal")
    if tm is not None and (tm.requires_grad or tm.dim() > 4 or not (tm.dtype == torch.bool or tm.is_floating_point())):
        return Skip(name, n, "the mask needs a gradient, has more than 4 dims, or is not bool/float")
    autocast = ctx.amp(n)
    cast = amp.compute_dtype("matmul", *autocast) if autocast is not None else None  # CPU autocast lists SDPA
    if any(t.dtype not in FLOATS + (torch.float64,) for t in (tq, tk, tv)) or out.dtype != (cast or tq.dtype):
        return Skip(name, n, f"dtypes: q {tq.dtype}, output {out.dtype}")
    return Match(name, n, [n], fn.attention, (q, k, v, mask),
                 dict(dropout_p=float(p), scale=None if scale is None else float(scale), is_causal=causal,
                      dtype=cast), proven=True)


PATTERNS: tuple[Pattern, ...] = (
    Pattern("fused_linear_cross_entropy",
            "F.cross_entropy(linear(h, W, b) [+ a [1, vocab] bias (BART's final_logits_bias)] "
            "[-> slice leading dims] [-> view/reshape/flatten] "
            "[-> .float()], target, ignore_index, label_smoothing, reduction) (incl. HF's causal-LM "
            "loss); inside vmap(grad): per-token losses reduced in the graph",
            "fxmem::linear_cross_entropy (+ fxmem::linear_cross_entropy_backward per example "
            "under vmap)", find_linear_cross_entropy),
    Pattern("swiglu", "F.silu(gate) * up, same shapes and dtype", "fxmem::glu(silu) + fxmem::glu_backward",
            _glu_finder("swiglu", ("silu",))),
    Pattern("geglu", "F.gelu(gate, approximate) * up, same shapes and dtype",
            "fxmem::glu(gelu | gelu_tanh) + fxmem::glu_backward", _glu_finder("geglu", ("gelu",))),
    Pattern("bias_gelu",
            "gelu(x + b), gelu(linear(x, W, b)), gelu(addmm(b, x, W)[.view]) with F.gelu or GELU "
            "written out in pointwise ops (erf or GPT-2's tanh formula; also without a bias)",
            "fxmem::bias_gelu + fxmem::bias_gelu_backward (the matmul keeps no bias)",
            find_bias_gelu),
    Pattern("rms_norm", "w * (x.float() * rsqrt(mean(x.float()^2, -1, keepdim) + eps)).to(x.dtype) or "
            "w * (x * rsqrt(...)) (HF Llama/Mistral/Qwen/T5 RMSNorm; weight optional)",
            "fxmem::rms_norm + fxmem::rms_norm_backward", find_rms_norm),
    Pattern("layer_norm", "F.layer_norm over the last dim", "fxmem::layer_norm + fxmem::layer_norm_backward",
            find_layer_norm),
    Pattern("dropout", "F.dropout(x, p > 0, training=True)", "fxmem::seeded_dropout (+ backward): "
            "mask regenerated from a seed", find_dropout),
    Pattern("attention_dropout", "F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p > 0) on CPU "
            "(the math path)", "fxmem::attention + fxmem::attention_backward: (batch, head) slices, "
            "torch's dropout mask drawn as a bool input", find_attention_dropout),
)
BY_NAME = {p.name: p for p in PATTERNS}
assert set(BY_NAME) == set(LOWERING_PATTERNS), "fxmem.options.LOWERING_PATTERNS and the table disagree"


def enabled(lowering) -> tuple[Pattern, ...]:
    """The patterns an ``Options.lowering`` value turns on (a dict: names not listed stay on)."""
    if lowering is True:
        return PATTERNS
    if lowering is False:
        return ()
    return tuple(p for p in PATTERNS if lowering.get(p.name, True))
