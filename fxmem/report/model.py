"""The memory report's data: what each compiled graph keeps and recomputes, as formulas.

A ``GraphReport`` is plain data (JSON round-trips it): clusters with their savings, the saved
bytes, and the forward and backward allocation schedules as byte formulas of the input symbols,
so ``predict_peak`` and ``max_batch`` work at any shape, from a live compile or from a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Mapping

import sympy
import torch

from ..graph.liveness import Event, evaluate, peak, step_schedules, storage_roots
from ..options import OPTIMIZER_STATE
from .modules import TOP, by_module, common, owners

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
    batch_syms = {s for s in g.symbols if any(n.endswith(".size(0)") for n in g.dims(s))}
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
        fixed.update({s: seq for s in g.symbols if any(n.endswith(".size(1)") for n in g.dims(s))})
    return lambda b: {**fixed, **{s: b for s in batch_syms}}


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
    # raw symbol -> the other input dimensions it stands for (Dynamo gives equal sizes one
    # symbol: ``labels.size(1)`` may be ``input_ids.size(1)``'s); shapes may name any of them
    aliases: dict[str, list[str]] = field(default_factory=dict)
    # ``offload``: the kept values handed to the backward in host memory, one row each:
    # [value name, module, bytes at the compiled shape, bytes formula (raw symbols), the backward
    # op before which it is copied back]. Their bytes are in ``saved_bytes``, not in the schedules.
    offloaded: list[list] = field(default_factory=list)
    # Bytes of each forward input (formulas, raw symbols), in the order the compiled graph takes
    # them: the values eager code made between graph breaks are priced at any shape from these.
    input_bytes: list[str] = field(default_factory=list)

    def dims(self, sym: str) -> list[str]:
        """Every input dimension the raw symbol ``sym`` stands for, its readable name first."""
        return [self.symbols[sym], *self.aliases.get(sym, [])]

    def inputs(self) -> set[str]:
        """The names of the inputs with a dimension in this graph's formulas or specialized."""
        return {n.split(".size(")[0] for s in self.symbols for n in self.dims(s)} | \
            {n.split(".size(")[0] for n in self.static_dims}

    def host_bytes(self, **shapes: Any) -> int:
        """Host bytes the offloaded values take at the given shapes (the compiled one by default)."""
        values = self.values_at(**shapes)
        return sum(evaluate(sympy.sympify(row[3]), values) for row in self.offloaded)

    def with_names(self, positional: list[str]) -> "GraphReport":
        """This report with inputs Dynamo named ``args[i]`` (a module called positionally) named
        ``positional[i]`` instead (the module's ``forward`` parameters)."""
        def name(text: str) -> str:
            return _ARGS.sub(lambda m: positional[int(m.group(1))] if int(m.group(1)) < len(positional)
                             else m.group(0), text)

        every = [*self.symbols.values(), *self.static_dims, *(n for a in self.aliases.values() for n in a)]
        if not positional or not any(_ARGS.search(n) for n in every):
            return self
        return replace(self, symbols={s: name(n) for s, n in self.symbols.items()},
                       aliases={s: [name(n) for n in a] for s, a in self.aliases.items()},
                       saved_formula=name(self.saved_formula),
                       clusters=[replace(c, saving_formula=name(c.saving_formula)) for c in self.clusters],
                       static_dims={name(k): v for k, v in self.static_dims.items()})

    def values_at(self, **shapes: Any) -> dict[str, int]:
        """Symbol values for shapes given by input name: ``input_ids=(64, 2048)``, or by symbol."""
        values = dict(self.values)
        for key, dims in shapes.items():
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            hit = False
            for sym in self.symbols:
                if sym == key and len(dims) == 1:
                    values[sym], hit = dims[0], True
                    continue
                for name in self.dims(sym):
                    if name.startswith(f"{key}.size(") and int(name[len(key) + 6:-1]) < len(dims):
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
                known = sorted({n.split(".size")[0] for s in self.symbols for n in self.dims(s)} | set(self.symbols))
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
        return as_events(self.forward), as_events(self.backward)

    def evaluate(self, formula: str, **shapes: Any) -> int:
        """A formula of this report (raw symbols) at the given shapes."""
        return evaluate(sympy.sympify(formula), self.values_at(**shapes))


def as_events(raw: list[list]) -> list[Event]:
    """A schedule as JSON holds it (``[kind, name, formula text]`` rows) as events."""
    return [(kind, name, sympy.sympify(text)) for kind, name, text in raw]


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
        aliases={s.name: list(a) for s, a in sizes.aliases.items() if s in sizes.names},
        values={s.name: v for s, v in sizes.values.items() if s in sizes.names or s in sizes.unbacked},
        saved_bytes=plan.saved_bytes, saved_formula=sizes.pretty(plan.saved_bytes_expr),
        saved_expr=str(plan.saved_bytes_expr),
        recompute_cost=float(sum(cost.get(n, 0.0) for n in split.recomputed)),
        clusters=rows, applied_rules=[list(r) for r in plan.applied_rules],
        notes=[*plan.notes, *sizes.unbacked_notes()],
        forward=[[k, n, str(e)] for k, n, e in fw], backward=[[k, n, str(e)] for k, n, e in bw],
        chosen_lambda=plan.lam, plain_bytes=plan.plain_bytes, level0_bytes=plan.level0_bytes,
        lowerings=list(lowerings), lowering_notes=list(lowering_notes), compile_id=compile_id,
        static_dims=dict(static_dims or {}), model_bytes=model_bytes[0], trainable_bytes=model_bytes[1],
        modules=by_module(owner, kept, recomputed), owners={k: v for k, v in owner.items() if k in scheduled},
        forward_cost=float(sum(cost.values())), crossing=crossing, in_backward=list(in_backward),
        offloaded=_offloaded(split, sizes, owner), input_bytes=_input_bytes(split, sizes),
    )


def _input_bytes(split, sizes) -> list[str]:
    try:
        return [str(sizes.nbytes(p)) for p in split.fw.graph.find_nodes(op="placeholder")]
    except Exception:  # noqa: BLE001 - informative: without them eager-made inputs keep their measured bytes
        return []


def _offloaded(split, sizes, owner: dict[str, str]) -> list[list]:
    """``GraphReport.offloaded``'s rows: each value in host memory, its module, bytes, and the
    backward op its reload runs before."""
    reader = {}
    for n in split.bw.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.fxmem.reload.default:
            reader[n.name] = next(iter(n.users)).name if n.users else "?"
    return [[n.name, owner.get(n.name, TOP), sizes.at(sizes.nbytes(n)), str(sizes.nbytes(n)), reader.get(n.name, "?")]
            for n in split.offloaded]


def _crossing(split, bw: list[Event], sizes, nbytes: Callable) -> dict[str, sympy.Expr]:
    """``GraphReport.crossing``: the backward's counted placeholders (kept values and tangents, as
    its schedule allocates them), the forward's outputs it does not keep, the backward's outputs.
    An output that is a view holds its whole storage (the value of a fused projection returned
    as a slice keeps the projection), counted once however many outputs share it, and not where
    a kept value holds it already."""
    root = storage_roots(split.fw)
    # The forward returns its outputs, then the values it hands to the backward (``split.saved``,
    # then the SymInts): told apart by position, not by name (``replay.bind_states`` renames a
    # kept generator state after the split: the backward's placeholder keeps the state's name)
    outs = list(split.fw.graph.output_node().args[0])
    n_out = len(outs) - len(split.saved) - len(split.saved_syms)
    kept = {root[n] for n in outs[n_out:] if isinstance(n, torch.fx.Node)}
    held = dict.fromkeys(root[n] for n in outs[:n_out] if isinstance(n, torch.fx.Node))
    bw_out = set(split.bw.graph.output_node().all_input_nodes)
    return {**taken(split, bw),
            "outputs": _sum(nbytes(r) for r in held if r.op != "placeholder" and r not in kept),
            "gradients": _sum(sizes.nbytes(n) for n in bw_out)}


def taken(split, bw: list[Event]) -> dict[str, sympy.Expr]:
    """The kept values and the tangents the backward's schedule ``bw`` allocates at its start
    (its counted placeholders)."""
    placeholders = {n.name for n in split.bw.graph.find_nodes(op="placeholder")}
    taken = [(n, e) for k, n, e in bw if k == "alloc" and n in placeholders]
    return {"kept": _sum(e for n, e in taken if not n.startswith("tangents")),
            "tangents": _sum(e for n, e in taken if n.startswith("tangents"))}


def _sum(terms) -> sympy.Expr:
    return sympy.Add(*terms, sympy.Integer(0))
