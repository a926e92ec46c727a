"""The memory report's data: what each compiled graph keeps and recomputes, as formulas.

A ``GraphReport`` is plain data (JSON round-trips it): clusters with their savings, the saved
bytes, and the forward and backward allocation schedules as byte formulas of the input symbols,
so ``predict_peak`` and ``max_batch`` work at any shape, from a live compile or from a file.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Mapping

import sympy
import torch

from ..graph.liveness import Event, evaluate, peak, step_schedules, storage_roots
from ..options import OPTIMIZER_STATE, parse_bytes
from .modules import TOP, by_module, common, owners

if TYPE_CHECKING:
    from ..remat.partition import PlannedGraph

log = logging.getLogger("fxmem")

SCHEMA_VERSION = 1
_ARGS = re.compile(r"\bargs\[(\d+)\]")


@dataclass(frozen=True)
class ClusterRow:
    id: str
    config: str  # the rule that reproduces this row's decision, e.g. "add+gelu+:1:-1"
    enabled: bool  # recomputed (not kept) in at least one occurrence
    frequency: int  # occurrences in the graph
    recomputed: int  # occurrences recomputed
    saving_bytes: int  # bytes not kept thanks to the recomputed occurrences, at the compiled shape
    saving_formula: str  # one occurrence's bytes, readable names
    module: str = ""  # the module of its occurrences (transformer.h.*.mlp for one a layer), see report.modules


@dataclass(frozen=True)
class LoweringRow:
    """One pattern that fxmem.lowering replaced by a fused kernel in this graph."""
    pattern: str  # the option key, e.g. "fused_linear_cross_entropy"
    count: int  # occurrences lowered
    bytes_saved: int | None  # saved-for-backward bytes, unfused minus fused, at the compiled shape
    replacement: str  # the fused ops
    notes: list[str] = field(default_factory=list)



def optimizer_state_per_byte(optimizer: str | float | None) -> float:
    """Bytes of optimizer state per byte of trainable parameter (see ``MemoryReport.max_batch``)."""
    per_byte = OPTIMIZER_STATE.get(optimizer) if isinstance(optimizer, str) or optimizer is None else optimizer
    if per_byte is None or isinstance(per_byte, bool) or not isinstance(per_byte, (int, float)) or per_byte < 0:
        raise ValueError(f"optimizer must be one of {', '.join(repr(k) for k in OPTIMIZER_STATE)} or bytes of "
                         f"state per trainable byte (a number >= 0), got {optimizer!r}")
    return per_byte


def batch_peak(g: "GraphReport", shapes: dict[str, Any]) -> Callable[[int], int]:
    """The predicted peak of ``g`` as a function of the batch (dimension 0 of every input), the
    other dimensions given as ``max_batch`` takes them."""
    values = batch_values(g, shapes)
    return lambda b: g.peak_at_values(values(b))


def batch_values(g: "GraphReport", shapes: dict[str, Any]) -> Callable[[int], dict[str, int]]:
    """``g``'s symbol values as a function of the batch (dimension 0 of every input)."""
    batch_syms = {s for s, n in g.symbols.items() if n.endswith(".size(0)")}
    if not batch_syms:
        fixed0 = sorted(f"{n}={v}" for n, v in g.static_dims.items() if n.endswith(".size(0)"))
        why = (f" (specialized when compiled: {', '.join(fixed0)}; Dynamo specializes sizes 0 and 1)"
               if fixed0 else "")
        raise ValueError(f"max_batch: the graph has no dynamic batch dimension{why}; compile with "
                         "dynamic=True at a batch of 2 or more")
    shapes = dict(shapes)
    seq = shapes.pop("seq", None)
    fixed = g.values_at(**shapes)
    if seq is not None:
        fixed.update({s: seq for s, n in g.symbols.items() if n.endswith(".size(1)")})
    return lambda b: {**fixed, **{s: b for s in batch_syms}}


def _values_where_named(g: "GraphReport", shapes: Mapping[str, Any]) -> dict[str, int]:
    """``g.values_at`` for the shapes naming ``g``'s inputs (one graph of a step need not take
    every input of the step)."""
    names = {n.split(".size(")[0] for n in [*g.symbols.values(), *g.static_dims]} | set(g.symbols)
    return g.values_at(**{k: v for k, v in shapes.items() if k in names})


def largest_batch(fits: Callable[[int], bool], limit: int) -> int:
    """The largest b <= ``limit`` with ``fits(b)`` (``fits`` monotone), 0 if none."""
    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= limit and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, limit + 1)  # lo fits, hi does not (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class GraphReport:
    index: int
    level: int
    options: str
    symbols: dict[str, str]  # raw symbol (s52) -> readable name (input_ids.size(0))
    values: dict[str, int]  # raw symbol -> value at the compiled (plan) shape
    saved_bytes: int
    saved_formula: str
    saved_expr: str  # raw symbols: for evaluation
    recompute_cost: float  # FLOPs (or elements) recomputed, at the compiled shape
    clusters: list[ClusterRow]
    applied_rules: list[list]
    notes: list[str]
    forward: list[list]  # schedule: [kind, name, bytes formula (raw symbols)]
    backward: list[list]
    frontier: list[list] = field(default_factory=list)  # [saved bytes, recompute cost, lambda]
    chosen_lambda: float = 0.0
    plain_bytes: int = 0  # what a plain partition (no recompute) would keep
    level0_bytes: int = 0  # what level 0 without rules or budget keeps
    lowerings: list[LoweringRow] = field(default_factory=list)  # patterns lowered to fused kernels
    lowering_notes: list[str] = field(default_factory=list)  # patterns found but left alone, and why
    compile_id: str = ""  # Dynamo's compile ("0/1") this graph came from; index counts within it
    static_dims: dict[str, int] = field(default_factory=dict)  # input dims Dynamo specialized -> size
    model_bytes: int = 0  # parameters and buffers the graph takes (alive before and after the step)
    trainable_bytes: int = 0  # of which trainable parameters (optimizer state is per trainable byte)
    modules: list[list] = field(default_factory=list)  # [module, kept bytes, recomputed bytes], largest first
    owners: dict[str, str] = field(default_factory=dict)  # scheduled value name -> module that produced it
    forward_cost: float = 0.0  # the forward's FLOPs (or elements), at the compiled shape
    # Bytes crossing between the step's phases, formulas (raw symbols): "kept" (forward to
    # backward), "outputs" (the forward's other outputs), "tangents" (the backward's incoming
    # gradients), "gradients" (what the backward returns). For a step of several graphs.
    crossing: dict[str, str] = field(default_factory=dict)
    # ``step_in_backward``: the parameters whose optimizer step this graph's backward runs, in
    # the order it runs them (the others are updated when the backward ends)
    in_backward: list[str] = field(default_factory=list)

    def with_names(self, positional: list[str]) -> "GraphReport":
        """This report with inputs Dynamo named ``args[i]`` (a module called positionally) named
        ``positional[i]`` instead (the module's ``forward`` parameters)."""
        def name(text: str) -> str:
            return _ARGS.sub(lambda m: positional[int(m.group(1))] if int(m.group(1)) < len(positional)
                             else m.group(0), text)

        if not positional or not any(_ARGS.search(n) for n in [*self.symbols.values(), *self.static_dims]):
            return self
        return replace(self, symbols={s: name(n) for s, n in self.symbols.items()},
                       saved_formula=name(self.saved_formula),
                       clusters=[replace(c, saving_formula=name(c.saving_formula)) for c in self.clusters],
                       static_dims={name(k): v for k, v in self.static_dims.items()})

    def values_at(self, **shapes: Any) -> dict[str, int]:
        """Symbol values for shapes given by input name: ``input_ids=(64, 2048)``, or by symbol."""
        values = dict(self.values)
        for key, dims in shapes.items():
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            hit = False
            for sym, name in self.symbols.items():
                if sym == key and len(dims) == 1:
                    values[sym], hit = dims[0], True
                elif name.startswith(f"{key}.size(") and int(name[len(key) + 6:-1]) < len(dims):
                    values[sym], hit = dims[int(name[len(key) + 6:-1])], True
            for i, d in enumerate(dims):
                fixed = self.static_dims.get(f"{key}.size({i})")
                if fixed is not None and d != fixed:
                    raise ValueError(
                        f"predict_peak: {key}.size({i}) was specialized to {fixed} when graph {self.index} was "
                        f"compiled (Dynamo specializes sizes 0 and 1, and every size without dynamic=True), so "
                        f"the plan says nothing about {d}; compile at a size >= 2 with dynamic=True, or mark "
                        f"the dimension with torch._dynamo.mark_dynamic")
                hit = hit or fixed is not None
            if not hit:
                known = sorted({n.split(".size")[0] for n in self.symbols.values()} | set(self.symbols))
                raise ValueError(f"predict_peak: {key!r} names no dynamic input dimension of graph {self.index}; "
                                 f"allowed: {', '.join(known) or 'none (compiled with static shapes)'}")
        return values

    def predict_peak(self, **shapes: Any) -> int:
        """Peak bytes allocated during the step (forward, then backward), at the given shapes.

        Counted: the forward's intermediates; then the kept values, the incoming gradients and
        the backward's buffers (parameter gradients included). Not counted: parameters and the
        inputs, which exist before the step. Outputs other than the kept values (e.g. logits)
        are assumed dropped before backward, as in ``loss = model(**batch).loss``.
        """
        return self.peak_at_values(self.values_at(**shapes))

    def peak_at_values(self, values: Mapping[str, int]) -> int:
        fw, bw = self._parsed
        return max(peak(fw, values).peak, peak(bw, values).peak)

    def peak_breakdown(self, **shapes: Any) -> dict:
        """What is alive at the predicted peak: ``{"phase": "forward" | "backward", "peak": bytes,
        "at": the node whose allocation reached it, "live": [(value name, bytes), ...] largest
        first}``. In the backward, kept values carry their forward names."""
        values = self.values_at(**shapes)
        fw, bw = (peak(events, values) for events in self._parsed)
        phase, at = ("forward", fw) if fw.peak >= bw.peak else ("backward", bw)
        return {"phase": phase, "peak": at.peak, "at": at.peak_at, "live": [list(kv) for kv in at.live_at_peak]}

    @cached_property
    def _parsed(self) -> tuple[list[Event], list[Event]]:
        return _events(self.forward), _events(self.backward)

    def evaluate(self, formula: str, **shapes: Any) -> int:
        """A formula of this report (raw symbols) at the given shapes."""
        return evaluate(sympy.sympify(formula), self.values_at(**shapes))


def _events(raw: list[list]) -> list[Event]:
    return [(kind, name, sympy.sympify(text)) for kind, name, text in raw]


@dataclass(frozen=True)
class Phases:
    """One graph's part in a training step, in bytes at some shape (see :func:`chained_peak`):
    its forward's and backward's peaks above what was alive before each, and what crosses from
    one phase to the next (``GraphReport.crossing``)."""
    forward: int     # the forward's peak (its intermediates; inputs not counted)
    kept: int        # values kept for the backward (alive from the forward to the backward)
    outputs: int     # the forward's other outputs (the next graph's inputs, or the loss)
    backward: int    # the backward's peak (kept values, incoming gradients, its buffers and outputs)
    tangents: int    # the incoming gradients of its outputs (the next graph's backward made them)
    gradients: int   # what the backward returns: parameter gradients and its inputs' gradients

    @classmethod
    def of(cls, g: "GraphReport", values: Mapping[str, int]) -> "Phases":
        fw, bw = g._parsed
        at = {k: evaluate(sympy.sympify(g.crossing.get(k, "0")), values)
              for k in ("kept", "outputs", "tangents", "gradients")}
        return cls(peak(fw, values).peak, at["kept"], at["outputs"], peak(bw, values).peak, at["tangents"],
                   at["gradients"])


def chained_peak(parts: list[Phases]) -> int:
    """The peak of a training step that runs several graphs (Dynamo split it at graph breaks):
    their forwards in order, then their backwards in reverse. Each forward runs above the kept
    values and outputs of the graphs before it (a graph's outputs are the next one's inputs and
    are alive until that one's backward, which usually keeps them); each backward runs above
    those too and above the parameter gradients the later graphs' backwards left (their
    inputs' gradients are this backward's incoming gradients, counted in its peak). One graph:
    its own forward and backward peaks. Work between the graphs (code Dynamo ran eagerly) is
    not seen."""
    best = held = 0
    for p in parts:
        best = max(best, held + p.forward)
        held += p.kept + p.outputs
    grads = 0
    for j in reversed(range(len(parts))):
        p = parts[j]
        held -= p.kept + p.outputs
        best = max(best, held + grads + p.backward)
        grads += p.gradients - (parts[j - 1].tangents if j else 0)
    return best


@dataclass
class MemoryReport:
    """Every graph fxmem compiled for a model, latest last."""

    graphs: list[GraphReport]
    plans: list = field(default_factory=list, repr=False)  # live plans (for frontiers), when known
    per_example: list[dict] = field(default_factory=list)  # microbatching decisions (ChunkPlan.summary)
    # Lowerings in graphs without a backward to plan (e.g. vmap(grad(...)) with no outer
    # backward): {"rows": [LoweringRow as dict], "notes": [str]} per graph.
    unplanned_lowerings: list[dict] = field(default_factory=list)
    # What Dynamo ran outside fxmem's graphs in this process: with no graphs, the frames it
    # could not trace (why it ran the code eagerly); else its graph breaks (what runs between).
    dynamo_unsupported: list[str] = field(default_factory=list)
    # The latest step's graphs (indices into ``graphs``) in the order their forwards ran, a graph
    # once per call: several where graph breaks split the step. Empty: the latest graph alone.
    step: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        from .render import lowering_lines, per_example_lines, table

        parts = [table(g) for g in self.graphs] + per_example_lines(self.per_example)
        for u in self.unplanned_lowerings:
            rows = [LoweringRow(**r) for r in u["rows"]]
            parts.append("\n".join(["graph without a backward to plan:", *lowering_lines(rows, u["notes"])]))
        if parts:
            if self.graphs and self.dynamo_unsupported:
                parts.append("\n".join(["Dynamo ran outside these graphs (graph breaks in this process):",
                                        *[f"  {u}" for u in self.dynamo_unsupported]]))
            return "\n\n".join(parts)
        lines = ["fxmem: no graphs compiled (Dynamo handed fxmem nothing to plan: it ran the model eagerly)"]
        if self.dynamo_unsupported:
            lines += ["Dynamo could not trace, in this process:", *[f"  {u}" for u in self.dynamo_unsupported]]
        return "\n".join(lines)

    def _graph(self) -> GraphReport:
        if not self.graphs:
            raise ValueError("the report holds no graphs: nothing was compiled with backend='fxmem'")
        return self.graphs[-1]

    def step_graphs(self) -> list[GraphReport]:
        """The graphs of the latest step, in the order their forwards ran (a graph once per call);
        the latest graph alone when the step is not known (a report read from JSON without it)."""
        return [self.graphs[i] for i in self.step] if self.step else [self._graph()]

    def predict_peak(self, **shapes: Any) -> int:
        """Predicted peak bytes of a training step at the given input shapes: the whole step,
        every graph of it where graph breaks split it (:func:`chained_peak`); shapes apply to
        the graphs that take inputs of those names."""
        graphs = self.step_graphs()
        if len(graphs) == 1:
            return graphs[0].predict_peak(**shapes)
        return self._chained(lambda g: _values_where_named(g, shapes))

    def _chained(self, values_of: Callable[[GraphReport], dict[str, int]]) -> int:
        order = self.step or [len(self.graphs) - 1]
        parts = {i: Phases.of(self.graphs[i], values_of(self.graphs[i])) for i in set(order)}
        return chained_peak([parts[i] for i in order])

    def peak_breakdown(self, **shapes: Any) -> dict:
        """Tensors alive at the predicted peak at the given input shapes (latest graph); see
        ``GraphReport.peak_breakdown``."""
        return self._graph().peak_breakdown(**shapes)

    def max_batch(self, cap: int | str, limit: int = 1 << 20, optimizer: str | float | None = None,
                  **shapes: Any) -> int:
        """Largest batch (dimension 0 of the inputs) whose step fits in ``cap`` on the device:
        the parameters and buffers, the optimizer's state, and the step's predicted peak (which
        holds the gradients).

        ``optimizer``: None (no state), "sgd" (none), "momentum" (one buffer per trainable
        parameter), "adam"/"adamw" (two), or bytes of state per byte of trainable parameter.
        Other dimensions by keyword: ``seq=2048`` sets dimension 1, or give inputs by name
        (``input_ids=(1, 2048)``: its first entry is replaced by each candidate batch).
        """
        state, cap_bytes = self.resident_bytes(optimizer), parse_bytes(cap, "cap")
        if len(self.step_graphs()) == 1:
            peak_of = batch_peak(self.step_graphs()[0], shapes)
        else:  # every graph of the step at the candidate batch (dimension 0 of each one's inputs)
            values = {id(g): batch_values(g, shapes) for g in self.step_graphs()}
            peak_of = lambda b: self._chained(lambda g: values[id(g)](b))  # noqa: E731
        return largest_batch(lambda b: state + peak_of(b) <= cap_bytes, limit)

    def resident_bytes(self, optimizer: str | float | None = None) -> int:
        """Bytes alive across steps (latest graph): parameters, buffers and the optimizer's state
        (see ``max_batch``)."""
        g = self._graph()
        return g.model_bytes + int(optimizer_state_per_byte(optimizer) * g.trainable_bytes)

    def to_dict(self) -> dict:
        return {"fxmem_report": SCHEMA_VERSION, "graphs": [asdict(g) for g in self.graphs],
                "per_example": self.per_example, "unplanned_lowerings": self.unplanned_lowerings,
                "dynamo_unsupported": self.dynamo_unsupported, "step": self.step}

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str) -> "MemoryReport":
        text = path_or_text
        if not path_or_text.lstrip().startswith("{"):
            with open(path_or_text) as f:
                text = f.read()
        data = json.loads(text)
        if data.get("fxmem_report") != SCHEMA_VERSION:
            raise ValueError(f"not an fxmem report of schema {SCHEMA_VERSION}: {str(data)[:80]}")
        graphs = []
        for g in data["graphs"]:
            g = dict(g, clusters=[ClusterRow(**c) for c in g["clusters"]],
                     lowerings=[LoweringRow(**r) for r in g.get("lowerings", [])])
            graphs.append(GraphReport(**g))
        return cls(graphs, per_example=data.get("per_example", []),
                   unplanned_lowerings=data.get("unplanned_lowerings", []),
                   dynamo_unsupported=data.get("dynamo_unsupported", []), step=data.get("step", []))

    def plot(self, path: str) -> str:
        """Saved bytes against recompute cost over the recompute weight; the chosen plan marked."""
        from .render import plot

        g = self._graph()
        if not g.frontier and self.plans:
            g.frontier.extend([list(p) for p in self.plans[-1].frontier()])
        return plot(g, path)


def report_json_path(path: str, g: GraphReport) -> str:
    """Where graph ``g``'s report goes for ``options.report_path = path``: ``r.json`` gives
    ``r.<compile>.<index>.json`` (compile ``0/1`` written ``0_1``)."""
    stem = path[:-5] if path.endswith(".json") else path
    tag = f"{g.compile_id.replace('/', '_')}." if g.compile_id else ""
    return f"{stem}.{tag}{g.index}.json"


def build(index: int, options_key: str, plan, split, sizes, primal_names: set[str], *,
          lowerings: list[LoweringRow] = (), lowering_notes: list[str] = (), compile_id: str = "",
          static_dims: dict[str, int] | None = None, model_bytes: tuple[int, int] = (0, 0),
          in_backward: list[str] = ()) -> GraphReport:
    """A GraphReport from a live plan, its split and its sizes, and the graph's lowering rows."""
    saved_names = {n.name for n in split.saved}
    inputs = plan.problem.joint.input_names() if plan.problem is not None else set()

    def nbytes(n):  # a view of a graph input (a weight's transpose) keeps no storage of its own
        return sympy.Integer(0) if n.name in inputs else sizes.nbytes(n)

    owner = owners(plan.problem.joint.gm if plan.problem is not None else split.fw)

    by_id: dict[str, list] = {}
    for c in plan.clusters:
        by_id.setdefault(c.id, []).append(c)
    rows = []
    for cid, occ in by_id.items():
        rec = [c for c in occ if c.stash.name not in saved_names]
        one = nbytes(occ[0].stash)
        count = -1 if len(rec) in (0, len(occ)) else len(rec)
        rows.append(ClusterRow(cid, f"{cid}:{1 if rec else 0}:{count}", bool(rec), len(occ), len(rec),
                               sum(sizes.at(nbytes(c.stash)) for c in rec), sizes.pretty(one),
                               common([owner.get(c.stash.name, TOP) for c in occ])))
    rows.sort(key=lambda r: (-r.saving_bytes, r.id))
    cost = plan.problem.cost if plan.problem is not None else {}
    fw, bw = step_schedules(split.fw, split.bw, sizes, primal_names)
    root = storage_roots(plan.problem.joint.gm) if plan.problem is not None else {}
    kept = {root.get(n, n).name: sizes.at(nbytes(root.get(n, n))) for n in split.saved}
    recomputed = {c.stash.name: sizes.at(nbytes(c.stash)) for c in plan.clusters if c.stash.name not in saved_names}
    scheduled = {e[1] for e in [*fw, *bw]}
    crossing = {k: str(v) for k, v in _crossing(split, bw, sizes, nbytes).items()}
    return GraphReport(
        index=index, level=plan.level, options=options_key,
        symbols={s.name: n for s, n in sizes.names.items()},
        values={s.name: v for s, v in sizes.values.items() if s in sizes.names},
        saved_bytes=plan.saved_bytes, saved_formula=sizes.pretty(plan.saved_bytes_expr),
        saved_expr=str(plan.saved_bytes_expr),
        recompute_cost=float(sum(cost.get(n, 0.0) for n in split.recomputed)),
        clusters=rows, applied_rules=[list(r) for r in plan.applied_rules], notes=list(plan.notes),
        forward=[[k, n, str(e)] for k, n, e in fw], backward=[[k, n, str(e)] for k, n, e in bw],
        chosen_lambda=plan.lam, plain_bytes=plan.plain_bytes, level0_bytes=plan.level0_bytes,
        lowerings=list(lowerings), lowering_notes=list(lowering_notes), compile_id=compile_id,
        static_dims=dict(static_dims or {}), model_bytes=model_bytes[0], trainable_bytes=model_bytes[1],
        modules=by_module(owner, kept, recomputed), owners={k: v for k, v in owner.items() if k in scheduled},
        forward_cost=float(sum(cost.values())), crossing=crossing, in_backward=list(in_backward),
    )


def inner_schedules(rep: GraphReport, graph: "PlannedGraph") -> GraphReport:
    """``rep`` with the forward's and backward's schedules the inner compiler's code states
    (``graph.inner_code``: Inductor's wrapper, read by ``graph.inductor_code``), where it is there and
    reads; else ``rep`` as it is (fxmem's simulation of the split's graphs). The crossing kept
    values and tangents follow the backward's schedule."""
    from ..graph.inductor_code import schedule
    from ..graph.scratch import scratch_bytes

    changes: dict[str, Any] = {}
    values = {x.name: v for x, v in graph.sizes.values.items()}
    fresh: list[bool] = []  # per forward output: a storage the forward allocated
    try:
        for kind, gm in (("forward", graph.split.fw), ("backward", graph.split.bw)):
            code = graph.inner_code.get(kind)
            if code is None:
                continue
            inputs = list(gm.graph.find_nodes(op="placeholder"))
            counted = {n.name for n in inputs if kind == "backward" and n.name not in graph.primal_names}
            if kind == "backward" and fresh:  # kept values that are the forward's copies (a weight
                saved = [n.name for n in inputs if not n.name.startswith("tangents")]  # in channels-last)
                counted |= {n for n, f in zip(saved, fresh[len(fresh) - len(saved):]) if f}
            dtypes = {n.name: v.dtype for n in inputs if isinstance(v := n.meta.get("val"), torch.Tensor)}
            scratch = {n.name: (str(n.target), b) for n in gm.graph.nodes
                       if n.op == "call_function" and (b := scratch_bytes(n)) != 0}
            made = {n.name: (str(n.target), n.meta.get("val")) for n in gm.graph.nodes if n.op == "call_function"}
            events, returned = schedule(code, {n: graph.sizes.nbytes(p) for p in inputs if (n := p.name) in counted},
                                        dtypes, counted, scratch, values, made)
            if kind == "forward":
                fresh = returned
            changes[kind] = [[k, n, str(e)] for k, n, e in events]
    except Exception as e:  # noqa: BLE001 - a report is about the compile, never its failure
        log.debug("fxmem report: the inner compiler's code could not be read (%s: %s); the report keeps "
                  "fxmem's simulation", type(e).__name__, e)
        return rep
    if "backward" in changes:
        taken = _taken(graph.split, _events(changes["backward"]))
        changes["crossing"] = {**rep.crossing, **{k: str(v) for k, v in taken.items()}}
    return replace(rep, **changes) if changes else rep


def _crossing(split, bw: list[Event], sizes, nbytes: Callable) -> dict[str, sympy.Expr]:
    """``GraphReport.crossing``: the backward's counted placeholders (kept values and tangents, as
    its schedule allocates them), the forward's outputs it does not keep, the backward's outputs."""
    placeholders = {n.name for n in split.bw.graph.find_nodes(op="placeholder")}
    fw_out = {n for n in split.fw.graph.output_node().all_input_nodes if n.name not in placeholders}
    bw_out = set(split.bw.graph.output_node().all_input_nodes)
    return {**_taken(split, bw), "outputs": _sum(nbytes(n) for n in fw_out if n.op != "placeholder"),
            "gradients": _sum(sizes.nbytes(n) for n in bw_out)}


def _taken(split, bw: list[Event]) -> dict[str, sympy.Expr]:
    """The kept values and the tangents the backward's schedule ``bw`` allocates at its start
    (its counted placeholders)."""
    placeholders = {n.name for n in split.bw.graph.find_nodes(op="placeholder")}
    taken = [(n, e) for k, n, e in bw if k == "alloc" and n in placeholders]
    return {"kept": _sum(e for n, e in taken if not n.startswith("tangents")),
            "tangents": _sum(e for n, e in taken if n.startswith("tangents"))}


def _sum(terms) -> sympy.Expr:
    return sympy.Add(*terms, sympy.Integer(0))
