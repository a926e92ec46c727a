"""One compile, one record: what fxmem decided for one Dynamo graph, carried by its compiled callable.

The backend makes a :class:`Compilation` per graph Dynamo hands it and writes the stages' results
into it (the per-example pass's chunk plan, each graph the partitioner planned with its report,
what lowering replaced); the callable Dynamo caches, :class:`Compiled`, holds it.
Nothing is held at module level, so a compile's graphs die with its compiled function (when the
model is freed and Dynamo's cache dropped, e.g. by ``torch._dynamo.reset()``): the live records
are listed in a weak set (:data:`_LIVE`), which holds none of them alive.

:func:`compilations` finds the records of a compiled model or function: those whose graphs took
the model's parameters, else where Dynamo keeps them (each cache entry of the model's code
objects, its modules' ``forward`` and the resume functions Dynamo made at graph breaks, names the
compiled callables it runs); for a ``torch.compile``d callable, only those compiled with its
``options=`` (two compiles of one module with different options keep their records apart).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, NamedTuple

import torch
from torch._dynamo.eval_frame import _TorchDynamoContext, innermost_backend

from .inputs import Inputs
from .options import Options

if TYPE_CHECKING:
    from .lowering import Lowering
    from .per_example.plan import ChunkPlan
    from .remat.partition import PlannedGraph


@dataclass(eq=False)
class Compilation:
    """Everything fxmem decided for one Dynamo graph (and the chunk graphs it runs)."""
    options: Options
    inputs: Inputs  # weak references to the example inputs: which model this graph belongs to
    compile_id: Any = None  # Dynamo's CompileId ("0/1"): names report files, tags trace artifacts
    static_dims: dict[str, int] = field(default_factory=dict)  # input dimensions Dynamo specialized
    model_bytes: tuple[int, int] = (0, 0)  # (parameters and buffers, trainable parameters) in bytes
    graphs: list["PlannedGraph"] = field(default_factory=list)  # in compile order
    chunk_plan: "ChunkPlan | None" = None  # the per-example pass's decision, when it found a region
    # Lowerings of graphs compiled without a backward to plan (no outer backward): one per graph.
    unplanned_lowerings: list["Lowering"] = field(default_factory=list)
    # The ``options=`` torch.compile passed, as given ({} for none): which compiled callable it is for.
    requested: Any = field(default_factory=dict)
    # ``options.plan_shape`` in this graph's input names (an nn.Sequential's ``input`` as ``args[0]``).
    plan_shape: Mapping[str, tuple[int, ...]] | None = None
    created_ns: int = field(default_factory=time.monotonic_ns)
    called_ns: int = 0  # when its compiled step last ran (fxmem.explain takes the graphs its step ran)

    def __repr__(self) -> str:
        chunked = f", chunk_plan={self.chunk_plan.summary()}" if self.chunk_plan is not None else ""
        return (f"Compilation(compile_id={self.compile_id}, level={self.options.level}, "
                f"inner={self.options.inner!r}, graphs={len(self.graphs)}{chunked})")


# Every live record, weakly (a record dies with its compiled function): compilations() reads it
# instead of scanning the heap.
_LIVE: "weakref.WeakSet[Compilation]" = weakref.WeakSet()
_ANY = object()  # the options= of a callable torch.compile did not make (a module, a function): any


def as_requested(options: Any) -> Any:
    """``options=`` as a record keeps it and a compiled callable is matched by it: a dict copy
    ({} for none), or the :class:`~fxmem.options.Options` object itself."""
    return dict(options) if isinstance(options, Mapping) else {} if options is None else options


class Compiled:
    """The callable the backend returns to Dynamo: the compiled step and its record."""
    __slots__ = ("fn", "compilation")

    def __init__(self, fn: Callable, compilation: Compilation):
        self.fn, self.compilation = fn, compilation
        _LIVE.add(compilation)  # live once returned: a compile Dynamo restarts leaves no record

    def __call__(self, *args: Any) -> Any:
        self.compilation.called_ns = time.monotonic_ns()
        if _WATCHED.open:
            _watch(_RUNS[0])  # outputs that died before this run outlived the runs up to the last one
        out = self.fn(*args)
        _log_step(self.compilation, out, args)
        return out


# The latest forward and backward runs of compiled graphs, oldest first (weakly): a step that
# graph breaks split runs several graphs, some of them several times (a layer's resume
# function); :func:`last_step` reads the latest step back from here. A forward run carries its
# :class:`Outputs` (how long each output stayed alive).
_CALLS: "deque[tuple[weakref.ref[Compilation], bool, Outputs | None]]" = deque(maxlen=4096)
_FORWARD, _BACKWARD = True, False


@dataclass(eq=False)
class Outputs:
    """What one forward run of a step made or took alive, and how long each stayed alive: its
    outputs (those that are not its inputs) and, with ``taken[i]`` its input position, the
    inputs that eager code made between the graphs (an input with a ``grad_fn`` that no watched
    run returned: what the caller's code computed, which this graph may keep for its backward)
    and what that eager code's autograd nodes saved for their backward on the way to them (with
    the position of the input they were found from: they scale with it).
    ``later[i]`` is the number of the step's later forward runs it outlived (None: alive when the
    backward began, held by a graph's saved tensors, an eager autograd node or the caller). Read
    from weak references to their storages after each later run."""
    nbytes: list[int]
    refs: list[Any]  # torch.multiprocessing.reductions.StorageWeakRef, dropped once decided
    later: list[int | None]
    run: int  # this run's number among the process's forward runs
    taken: list[int | None] = field(default_factory=list)  # None: an output; else the input's position
    # the forward run (number) in whose backward each value alive at the backward's start died
    # (seen at the next graph's backward, or when the next step begins); None: not seen
    freed: list[int | None] = field(default_factory=list)
    # the parameters this run took: storage address -> (bytes, trainable): the step's resident bytes
    params: dict[int, tuple[int, bool]] = field(default_factory=dict)
    # (bytes, parameter's storage address) of each parameter gradient that eager code on the way to
    # this run's inputs makes in its backward (:func:`_eager_saved`)
    eager_grads: list[tuple[int, int]] = field(default_factory=list)
    # the parameters (storage addresses) whose gradient this run's backward returns as a view of
    # another tensor (a weight's ``mm(...).t()``: ``PlannedGraph.grad_views``, read at compile time:
    # a post-hook on the backward would keep its incoming gradients alive): autograd adds another
    # gradient to it out of place
    viewed: set[int] = field(default_factory=set)

    def shares(self) -> list[list]:
        """``[fraction of the outputs' bytes, later runs outlived (-1: to the backward), the run
        in whose backward it died]`` per output; then ``[-2 - input position, bytes, later runs
        outlived, the run in whose backward it died]`` per eager-made input."""
        kinds = self.taken or [None] * len(self.nbytes)
        freed = self.freed or [None] * len(self.nbytes)
        total = sum(b for b, k in zip(self.nbytes, kinds) if k is None) or 1
        rows = zip(self.nbytes, self.later, kinds, freed)
        out = [[b / total, -1 if n is None else n, f] for b, n, k, f in rows if k is None]
        return out + [[-2 - k, b, -1 if n is None else n, f]
                      for b, n, k, f in zip(self.nbytes, self.later, kinds, freed) if k is not None]


@dataclass(eq=False)
class _Watched:
    """The step watcher's state, one per process: ``open``, the forward runs whose outputs are
    still watched (those since the latest backward began; at most ``_CALLS.maxlen``); ``dying``,
    the step's values alive when its backward began, watched until they die (cleared when the
    next step begins)."""
    open: list[Outputs] = field(default_factory=list)
    dying: list[Outputs] = field(default_factory=list)
    # ids of the eager autograd nodes whose saved tensors this step's forward already counted
    # (:func:`_eager_saved`; cleared when the backward begins)
    walked: set[int] = field(default_factory=set)


_WATCHED = _Watched()
_RUNS = [0]  # forward runs so far
_LAST_BACKWARD: list[int | None] = [None]  # the forward run whose backward ran last


def _outputs(outs: tuple, args: tuple, views: frozenset[int] = frozenset()) -> Outputs:
    """``views``: the input positions whose gradient the graph's backward returns as a view
    (``PlannedGraph.grad_views``)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if _WATCHED.dying:  # a new step: the last step's backward is over
        _died_in_backward()
        for o in _WATCHED.dying:
            o.refs = [None] * len(o.refs)
        _WATCHED.dying.clear()

    def key(t: torch.Tensor):
        try:
            return StorageWeakRef(t.untyped_storage())
        except Exception:  # noqa: BLE001 - a tensor without a storage (a subclass): not watched
            return None

    refs: dict[int, tuple[int, Any, int | None]] = {}
    for t in outs:
        if isinstance(t, torch.Tensor) and (r := key(t)) is not None:
            refs.setdefault(r.cdata, (t.untyped_storage().nbytes(), r, None))
    watched = {r.cdata for o in _WATCHED.open for r in o.refs if r is not None and not r.expired()}
    params: dict[int, tuple[int, bool]] = {}
    viewed: set[int] = set()
    for i, a in enumerate(args):
        if isinstance(a, torch.nn.Parameter):
            params[ptr := a.untyped_storage().data_ptr()] = (a.untyped_storage().nbytes(), a.requires_grad)
            if i in views and a.requires_grad:
                viewed.add(ptr)
        if isinstance(a, torch.Tensor) and (r := key(a)) is not None:
            refs.pop(r.cdata, None)  # an input (or a view of one) returned: not made by this run
            if a.grad_fn is not None and r.cdata not in watched and not isinstance(a, torch.nn.Parameter):
                refs[r.cdata] = (a.untyped_storage().nbytes(), r, i)  # made by eager code
                watched.add(r.cdata)
    grads: list[tuple[int, int]] = []
    for i, a in enumerate(args):  # what the eager code that made an input saved for its backward
        if isinstance(a, torch.Tensor) and a.grad_fn is not None:
            found = _eager_saved(a.grad_fn)
            grads += found.grads
            for t in found.saved:
                if (r := key(t)) is not None and r.cdata not in watched and r.cdata not in refs:
                    refs[r.cdata] = (t.untyped_storage().nbytes(), r, i)
                    watched.add(r.cdata)
    _RUNS[0] += 1
    values = list(refs.values())
    return Outputs([b for b, _, _ in values], [r for _, r, _ in values], [None] * len(values), _RUNS[0],
                   [k for _, _, k in values], params=params, eager_grads=grads, viewed=viewed)


@functools.cache
def _held_by_autograd_only() -> int:
    """``sys.getrefcount`` of a saved tensor no Python code holds (this Python's count, probed once)."""
    probe = torch.ones(1, requires_grad=True) * torch.ones(1)
    return _refcount(probe.grad_fn, "_saved_other")[1]


def _refcount(node: Any, name: str) -> tuple[torch.Tensor, int]:
    import sys

    t = getattr(node, name)
    return t, sys.getrefcount(t)


class EagerNodes(NamedTuple):
    """What :func:`_eager_saved` found in eager autograd's nodes."""
    saved: list[torch.Tensor]  # what they save for the backward
    grads: list[tuple[int, int]]  # (bytes, parameter's storage address): the parameter gradients they make


def _eager_saved(fn: Any) -> EagerNodes:
    """The tensors that eager autograd nodes save for the backward, from ``fn`` back to the
    compiled graphs' nodes and the leaves: what the eager code between two graphs (Dynamo ran it
    outside any graph) keeps alive until its backward, unseen by the graphs' own plans. A node
    walked once this step is not walked again. Counted: saved tensors with a gradient history
    (made by the step's forward) and those without one that no Python code holds (a dropout
    mask, a layer norm's statistics); not counted: what Python code holds as well (a batch
    tensor, a buffer: alive before the step), parameters. Nothing under saved-tensor hooks
    (offloading, checkpointing: the nodes hold what the hooks packed).

    And the parameter gradients those nodes' backward makes (an eager embedding's dense
    [vocab, dim] gradient): buffers of the backward no graph's plan holds."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return EagerNodes([], [])
    walked, out, grads, todo = _WATCHED.walked, [], [], [fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in walked:
            continue
        walked.add(id(node))
        kind = type(node).__name__
        if kind == "AccumulateGrad" or kind.startswith("CompiledFunction"):
            continue  # a leaf, or a compiled graph's backward (its saved values are its plan's)
        for name in _saved_names(type(node)):
            try:
                t, count = _refcount(node, name)
            except Exception:  # noqa: BLE001 - released, or not a tensor to unpack
                continue
            if (isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
                    and (t.requires_grad or count <= _held_by_autograd_only())):
                out.append(t)
        for f, _ in node.next_functions:  # a parameter's gradient: its shape and dtype
            if type(f).__name__ == "AccumulateGrad" and isinstance(p := f.variable, torch.nn.Parameter):
                grads.append((p.numel() * p.element_size(), p.untyped_storage().data_ptr()))
        todo += [f for f, _ in node.next_functions]
    return EagerNodes(out, grads)


@functools.cache
def _saved_names(kind: type) -> tuple[str, ...]:
    """The ``_saved_*`` attributes of an autograd node type."""
    return tuple(a for a in dir(kind) if a.startswith("_saved_"))


def _watch(run: int) -> None:
    """The watched outputs that died by now outlived the forward runs up to number ``run``."""
    for o in list(_WATCHED.open):
        for i, r in enumerate(o.refs):
            if r is not None and r.expired():
                o.later[i], o.refs[i] = run - o.run, None
        if not any(o.refs):
            _WATCHED.open.remove(o)


def _log_step(c: Compilation, out: Any, args: tuple = ()) -> None:
    """Log a forward run that has a backward to come (an output with a ``grad_fn``), and that
    backward's run when autograd reaches it (a pre-hook on the output's ``grad_fn``)."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    fn = next((t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
    if fn is None:
        return
    ref = weakref.ref(c)
    watched = _outputs(tuple(outs), args, c.graphs[-1].grad_views if c.graphs else frozenset())
    _watch(watched.run)  # those this run consumed and freed outlived it
    if any(watched.refs):
        _WATCHED.open.append(watched)
        if len(_WATCHED.open) > _CALLS.maxlen:  # forwards without a backward, their outputs kept: stop watching
            _WATCHED.open.pop(0).refs = []
    _CALLS.append((ref, _FORWARD, watched))
    fn.register_prehook(lambda grads: _backward(ref, watched.run))


def _backward(ref: "weakref.ref[Compilation]", run: int) -> None:
    """A logged run's backward is about to run: what died since the previous one died in that
    one's backward (or in eager backward code after it)."""
    if _WATCHED.open:  # the step's backward begins: what is alive now stays until it dies in a backward
        _watch(_RUNS[0])
        for o in _WATCHED.open:
            o.freed = [None] * len(o.refs)
        _WATCHED.dying[:] = [o for o in _WATCHED.open if any(o.refs)]
        _WATCHED.open.clear()
        _WATCHED.walked.clear()
        _LAST_BACKWARD[0] = None
    _died_in_backward()
    _LAST_BACKWARD[0] = run
    _CALLS.append((ref, _BACKWARD, None))


def _died_in_backward() -> None:
    last = _LAST_BACKWARD[0]
    for o in list(_WATCHED.dying):
        for i, r in enumerate(o.refs):
            if r is not None and r.expired():
                o.refs[i] = None
                o.freed[i] = last
        if not any(o.refs):
            _WATCHED.dying.remove(o)


def last_step(comps: list[Compilation], others: bool = False) -> list[Compilation]:
    """The forward runs of the latest training step among ``comps``, in order: the latest run of
    forwards with no backward between them (a step's forwards, then its backwards). Empty when
    none of them ran with a backward to come.

    ``others``: with the forward runs of every other record in that step too (the step is the
    unit: a graph that takes none of the model's parameters, e.g. a loss or a router's glue
    that a graph break left on its own, or a frame Dynamo reached through a function it could
    not trace, holds memory in the same step): the whole run of forwards, of any record, that
    holds ``comps``' latest one."""
    return [c for c, _ in last_step_runs(comps, others)]


def last_step_runs(comps: list[Compilation], others: bool = False) -> list[tuple[Compilation, Outputs]]:
    """:func:`last_step` with each forward run's :class:`Outputs`."""
    if _WATCHED.dying and all(o.refs is not None for o in _WATCHED.dying):
        _died_in_backward()  # what died since the last graph's backward began died in it
    mine = {id(c) for c in comps}
    runs = [(c, kind, o) for c, kind, o in ((r(), kind, o) for r, kind, o in _CALLS) if c is not None]
    if not others:
        runs = [(c, kind, o) for c, kind, o in runs if id(c) in mine]
    last = max((i for i, (c, kind, _) in enumerate(runs) if kind is _FORWARD and id(c) in mine), default=None)
    if last is None:
        return []
    end = last + 1
    while end < len(runs) and runs[end][1] is _FORWARD:
        end += 1
    start = last
    while start and runs[start - 1][1] is _FORWARD:
        start -= 1
    return [(c, o) for c, _, o in runs[start:end]]


def compilations(compiled: Any = None, match: Iterable[torch.Tensor] | None = None) -> list[Compilation]:
    """The records of every graph fxmem compiled for ``compiled`` (a ``torch.compile``d module or
    function, or the module itself), oldest first.

    For a ``torch.compile``d module or function (or a module after ``module.compile()``), only
    the records compiled with its ``options=`` count: ``torch.compile(m, options=A)`` and
    ``torch.compile(m, options=B)`` each have their own (compiles with equal options share
    Dynamo's graphs, and so their records). A module itself gives the records of every compile.

    A record belongs to a module when its graph took one of the module's parameters (or one of
    ``match``'s tensors) as an input: every live record is searched, so graphs of frames that a
    graph break left on their own (a nested function's, e.g. a loss) count too. When none
    belongs, e.g. for a second instance of an already compiled class, whose calls Dynamo serves
    from the first one's graphs, the records of the graphs Dynamo runs for the module's code
    are returned. With ``match`` for a function, only those are searched (no scan of the heap:
    cheap enough to call every step). With no argument: every live record in this process.
    """
    if compiled is None:
        return _live()
    asked = _requested(compiled)

    def ours(comps: list[Compilation]) -> list[Compilation]:
        return [c for c in comps if asked is _ANY or c.requested == asked]

    if match is None:
        module = getattr(compiled, "_orig_mod", compiled)
        if isinstance(module, torch.nn.Module):
            ids = {id(t) for t in module.parameters()}
            mine = ours([c for c in _live() if c.inputs & ids]) if ids else []
            return mine or ours(_by_code(compiled))
        return ours(_by_code(compiled))
    ids = {id(t) for t in match}
    found = ours(_by_code(compiled))
    return [c for c in found if c.inputs & ids] or found


def _live() -> list[Compilation]:
    return sorted(_LIVE, key=lambda c: c.created_ns)


def _requested(compiled: Any) -> Any:
    """The ``options=`` that ``torch.compile`` gave the backend for ``compiled`` (as
    :func:`as_requested` keeps them), or :data:`_ANY` when it is no ``torch.compile``d callable.
    Read from Dynamo's context for it: an optimized module's ``dynamo_ctx``, a compiled
    function's closure, a module's ``module.compile()``d call."""
    if isinstance(compiled, torch.nn.Module) and not hasattr(compiled, "dynamo_ctx"):
        compiled = getattr(compiled, "_compiled_call_impl", None)
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:  # a compiled function: its context is in its closure
        cells = [_contents(c) for c in getattr(compiled, "__closure__", None) or ()]
        ctx = next((c for c in cells if isinstance(c, _TorchDynamoContext)), None)
    backend = innermost_backend(ctx.callback) if ctx is not None and callable(ctx.callback) else None
    kwargs = getattr(backend, "kwargs", None)  # torch.compile's backend wrapper passes these on
    return as_requested(kwargs.get("options")) if isinstance(kwargs, dict) else _ANY


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _by_code(compiled: Any) -> list[Compilation]:
    found = {id(c): c for c in _cached(_roots(compiled))}
    return sorted(found.values(), key=lambda c: c.created_ns)


def _roots(compiled: Any) -> list[tuple[Any, dict]]:
    """(code object, globals) of every function Dynamo may have compiled frames of for ``compiled``:
    a function and those it wraps (``functools.wraps``' ``__wrapped__``), a module's forwards and
    what they wrap (a decorated ``forward`` whose wrapper's frame Dynamo skips:
    :mod:`fxmem.graph_breaks`)."""
    orig = getattr(compiled, "_orig_mod", None) or getattr(compiled, "_torchdynamo_orig_callable", None) or compiled
    fns: list[Callable] = []
    starts = [type(m).forward for m in orig.modules()] if isinstance(orig, torch.nn.Module) else [orig]
    if isinstance(orig, torch.nn.Module):
        fns.append(torch.nn.Module._call_impl)  # module.compile() compiles the module's call
    for fn in starts:
        while fn is not None and fn not in fns:
            fns.append(fn)
            fn = getattr(fn, "__wrapped__", None)
    out, seen = [], set()
    for fn in fns:
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None and code not in seen:
            seen.add(code)
            out.append((code, fn.__globals__))
    return out


def _cached(roots: list[tuple[Any, dict]]) -> list[Compilation]:
    """The records of the compiled callables that Dynamo's cache entries for ``roots`` run,
    following resume functions (the code after a graph break) to their own entries."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    out: list[Compilation] = []
    todo, seen = list(roots), set()
    while todo:
        code, scope = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        for entry in _debug_get_cache_entry_list(code):
            for name in entry.code.co_names:
                obj = scope.get(name)
                while name.startswith("__compiled_fn") and hasattr(obj, "__wrapped__"):
                    obj = obj.__wrapped__  # Dynamo installs the callable wrapped by torch._dynamo.disable
                if isinstance(obj, Compiled):
                    out.append(obj.compilation)
                elif name.startswith("__resume_at") and hasattr(obj, "__code__"):
                    todo.append((obj.__code__, obj.__globals__))
    return out
