"""A model's whole memory report: every graph fxmem compiled for it, as text, JSON and a plot.

``MemoryReport`` is what ``fxmem.report(...)`` returns. It holds one ``GraphReport`` per graph
(``model.py``: the data and the per-graph predictions) and predicts the whole step's peak across
graph breaks (:func:`chained_peak`); its text and plot are the renderings of ``render.py``. It sits
above both: the data model knows nothing of how it is printed, and the renderings know the data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any, Callable, Mapping

import sympy

from ..graph.liveness import evaluate, peak
from ..options import parse_bytes
from .model import (
    ClusterRow,
    GraphReport,
    LoweringRow,
    batch_peak,
    batch_values,
    largest_batch,
    optimizer_state_per_byte,
)
from .render import lowering_lines, per_example_lines, plot, table

SCHEMA_VERSION = 1


def _values_where_named(g: GraphReport, shapes: Mapping[str, Any]) -> dict[str, int]:
    """``g.values_at`` for the shapes naming ``g``'s inputs (one graph of a step need not take
    every input of the step)."""
    return g.values_at(**{k: v for k, v in shapes.items() if k in _names(g)})


def _names(g: GraphReport) -> set[str]:
    """The input names (and raw symbols) shapes may name for ``g``."""
    return g.inputs() | set(g.symbols)


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
    def of(cls, g: GraphReport, values: Mapping[str, int]) -> "Phases":
        fw, bw = g._parsed
        at = {k: evaluate(sympy.sympify(g.crossing.get(k, "0")), values)
              for k in ("kept", "outputs", "tangents", "gradients")}
        return cls(peak(fw, values).peak, at["kept"], at["outputs"], peak(bw, values).peak, at["tangents"],
                   at["gradients"])


class EagerGrad(IntEnum):
    """How a parameter gradient that eager backward code makes lives (:func:`eager_grad_rows`)."""
    NEW = 0      # the parameter's first gradient: held from then on, as the graphs' own
    SUMMED = 1   # added out of place to a gradient a graph's backward made as a view: both and the sum alive
    IN_PLACE = 2  # added in place to the gradient made before: alive only while it is added


def eager_grad_rows(params: list[Mapping[int, tuple[int, bool]]], grads: list[list[tuple[int, int]]],
                    viewed: list[set[int]]) -> list[list[list[int]]]:
    """Per forward run of a step, ``[bytes, EagerGrad]`` of each parameter gradient that eager
    code on the way to its inputs makes in the backward (``grads[k]``: (bytes, parameter's
    address)), from the parameters each run took (``params[k]``: address -> (bytes, trainable))
    and those whose gradient its backward returned as a view (``viewed[k]``). Autograd sums a
    parameter's gradients in one buffer before it accumulates them, in place where that buffer
    is the only user of its storage: a graph's gradient that is a view of another tensor (the
    eager inner compiler's ``mm(...).t()`` of a tied head's weight: SwitchTransformers' decoder
    embedding) gets the eager one added out of place, both and the sum alive; every other sum
    is in place."""
    rows: list[list[list[int]]] = [[] for _ in grads]
    made: set[int] = set()   # parameters with a gradient by this point of the backward
    views: set[int] = set()  # those whose gradient so far is a view
    for k in reversed(range(len(grads))):
        made |= {p for p, (_, trainable) in params[k].items() if trainable}  # run k's backward, then its eager code's
        views |= viewed[k]
        for nbytes, p in grads[k]:
            how = EagerGrad.SUMMED if p in views else EagerGrad.IN_PLACE if p in made else EagerGrad.NEW
            made.add(p)
            views.discard(p)  # the sum is a tensor of its own
            rows[k].append([nbytes, int(how)])
    return rows


def chained_peak(parts: list[Phases], lives: list[list[tuple]] | None = None,
                 made: list[list[tuple[int, int, int]]] | None = None,
                 eager_grads: list[list[list[int]]] | None = None) -> int:
    """The peak of a training step that runs several graphs (Dynamo split it at graph breaks):
    their forwards in order, then their backwards in reverse. Each forward runs above the kept
    values of the graphs before it and above their outputs still alive; each backward runs above
    those that stay alive until it and above the parameter gradients the later graphs' backwards
    left (their inputs' gradients are this backward's incoming gradients, counted in its peak).
    One graph: its own forward and backward peaks.

    ``lives[k]``: how long run ``k``'s outputs stayed alive in the step that ran
    (``(fraction of its outputs' bytes, later forward runs it outlived or -1: until the backward, ...)``
    each, :class:`fxmem.compilation.Outputs`); a value the next graph consumed and dropped is then
    held through that graph only, one that a later graph keeps (or the caller holds) until this
    graph's backward. Without it every output is held until its graph's backward. ``made[k]``:
    ``(bytes, later runs outlived or -1)`` of each value eager code made between the graphs that
    run ``k`` took first (held from run ``k`` on, as long as it lived). Each entry of both ends
    with the run in whose backward the value died (-1: not seen; then its own run's): a value
    alive at the backward's start is held until that backward ends (an upper bound: a graph's
    saved input may be freed at its last use there, before that backward's peak).

    What eager code between the graphs saves for its backward, on the way to a graph's input
    (a layer norm's input and statistics, a dropout mask), is in ``made`` (found through eager
    autograd's nodes, :func:`fxmem.compilation._eager_saved`), and so are the parameter gradients
    its backward makes (``eager_grads[k]``, :func:`eager_grad_rows`: after run ``k``'s backward).
    Other work between the graphs is not seen: eager temporaries, eager backward's other buffers,
    and what eager code saves on a path that reaches no graph (e.g. a loss computed eagerly after
    the last graph)."""
    def lived(later: int, k: int, at: int) -> bool:
        return later < 0 or at - k <= later

    def alive(k: int, at: int) -> int:
        """Run ``k``'s outputs alive during forward run ``at`` (> k) and the values eager code made
        that it took (``at`` >= k)."""
        taken = sum(b for b, n, _ in made[k] if lived(n, k, at)) if made is not None and k < len(made) else 0
        if at == k:
            return taken
        if lives is None or k >= len(lives) or not lives[k]:
            return parts[k].outputs + taken
        return round(parts[k].outputs * sum(f for f, n, _ in lives[k] if lived(n, k, at))) + taken

    def until(k: int) -> list[tuple[int, int]]:
        """What run ``k`` left alive at the backward's start: (bytes, the run in whose backward
        it dies: where it was seen to die, else run ``k``'s own)."""
        if lives is None or k >= len(lives) or not lives[k]:
            out = [(parts[k].outputs, k)]
        else:
            out = [(round(parts[k].outputs * f), k if j < 0 else j) for f, n, j in lives[k] if n < 0]
        if made is not None and k < len(made):
            out += [(b, k if j < 0 else j) for b, n, j in made[k] if n < 0]
        return out

    best = kept = 0
    for i, p in enumerate(parts):
        best = max(best, kept + sum(alive(k, i) for k in range(i + 1)) + p.forward)
        kept += p.kept
    left = [e for k in range(len(parts)) for e in until(k)]
    grads = 0
    for j in reversed(range(len(parts))):
        p = parts[j]
        kept -= p.kept  # its own kept values are in its backward's peak
        held = kept + sum(b for b, r in left if r <= j)  # those dying in this backward: held through it
        best = max(best, held + grads + p.backward)
        grads += p.gradients
        if eager_grads is not None and j < len(eager_grads) and eager_grads[j]:  # eager backward before run j-1's
            after = kept + sum(b for b, r in left if r < j) + grads
            for b, how in eager_grads[j]:
                if how == EagerGrad.NEW:
                    grads, after = grads + b, after + b
                best = max(best, after + {EagerGrad.NEW: 0, EagerGrad.SUMMED: 2 * b, EagerGrad.IN_PLACE: b}[how])
        grads -= parts[j - 1].tangents if j else 0
    return best


def _at_shape(g: GraphReport, position: int, nbytes: int, values: Mapping[str, int]) -> int:
    """``nbytes`` measured for ``g``'s input ``position`` at the compiled shape, at ``values``."""
    if position >= len(g.input_bytes):
        return nbytes
    formula = sympy.sympify(g.input_bytes[position])
    compiled = evaluate(formula, g.values)
    return nbytes if not compiled else round(nbytes * evaluate(formula, values) / compiled)


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
    # Per entry of ``step``: how long that run's outputs stayed alive (see :func:`chained_peak`).
    step_outputs: list[list[list]] = field(default_factory=list)
    # [parameter bytes, trainable parameter bytes] every graph of the latest step took (several
    # graphs: each takes its own layers' parameters); empty: the latest graph's
    step_params: list[int] = field(default_factory=list)
    # Per entry of ``step``: the parameter gradients eager code makes in its backward (see
    # :func:`eager_grad_rows`)
    step_eager_grads: list[list[list[int]]] = field(default_factory=list)

    def __str__(self) -> str:
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

    def _one_graph(self) -> bool:
        """Whether the step is one graph's own: no graph breaks, no eager backward code making
        parameter gradients (then it is predicted as the chain of its graphs and that code)."""
        return len(self.step_graphs()) == 1 and not any(self.step_eager_grads)

    def predict_peak(self, **shapes: Any) -> int:
        """Predicted peak bytes of a training step at the given input shapes: the whole step,
        every graph of it where graph breaks split it (:func:`chained_peak`); shapes apply to
        the graphs that take inputs of those names."""
        if self._one_graph():
            return self.step_graphs()[0].predict_peak(**shapes)
        return self._chained(lambda g: _values_where_named(g, shapes))

    def _chained(self, values_of: Callable[[GraphReport], dict[str, int]]) -> int:
        order = self.step or [len(self.graphs) - 1]
        parts = {i: Phases.of(self.graphs[i], values_of(self.graphs[i])) for i in set(order)}
        lives = self.step_outputs if self.step and len(self.step_outputs) == len(order) else None
        made = None
        if lives is not None:
            made = [[(_at_shape(self.graphs[i], -2 - e[0], e[1], values_of(self.graphs[i])), e[2], e[3])
                     for e in lives[k] if len(e) == 4] for k, i in enumerate(order)]
            lives = [[tuple(e) for e in entry if len(e) == 3] for entry in lives]
        eager = self.step_eager_grads if len(self.step_eager_grads) == len(order) else None
        return chained_peak([parts[i] for i in order], lives, made, eager)

    def host_bytes(self, **shapes: Any) -> int:
        """Host bytes a step holds at the given input shapes: the saved values its graphs hand to
        the backward in host memory (``offload``), every graph run of the step counted (each run's
        values wait for its own backward). Not in ``predict_peak``, which counts device bytes."""
        order = self.step or [len(self.graphs) - 1]
        return sum(self.graphs[i].host_bytes(**{k: v for k, v in shapes.items()
                                                if k in _names(self.graphs[i])}) for i in order)

    def peak_breakdown(self, **shapes: Any) -> dict:
        """Tensors alive at the predicted peak at the given input shapes (latest graph); see
        ``GraphReport.peak_breakdown``."""
        return self._graph().peak_breakdown(**shapes)

    def owners(self) -> dict[str, str]:
        """Scheduled value name -> module that made it (latest graph)."""
        return self._graph().owners

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
        if self._one_graph():
            peak_of = batch_peak(self.step_graphs()[0], shapes)
        else:  # every graph of the step at the candidate batch (dimension 0 of each one's inputs)
            values = {id(g): batch_values(g, shapes) for g in self.step_graphs()}
            peak_of = lambda b: self._chained(lambda g: values[id(g)](b))  # noqa: E731
        return largest_batch(lambda b: state + peak_of(b) <= cap_bytes, limit)

    def resident_bytes(self, optimizer: str | float | None = None) -> int:
        """Bytes alive across steps: parameters, buffers and the optimizer's state (see
        ``max_batch``). Where graph breaks split the step: the parameters every graph of the
        latest step took (at least the latest graph's parameters and buffers); else the latest
        graph's."""
        g = self._graph()
        if len(self.step_params) == 2 and len(self.step_graphs()) > 1:
            model, trainable = max(self.step_params[0], g.model_bytes), self.step_params[1]
        else:
            model, trainable = g.model_bytes, g.trainable_bytes
        return model + int(optimizer_state_per_byte(optimizer) * trainable)

    def to_dict(self) -> dict:
        return {"fxmem_report": SCHEMA_VERSION, "graphs": [asdict(g) for g in self.graphs],
                "per_example": self.per_example, "unplanned_lowerings": self.unplanned_lowerings,
                "dynamo_unsupported": self.dynamo_unsupported, "step": self.step,
                "step_outputs": self.step_outputs, "step_params": self.step_params,
                "step_eager_grads": self.step_eager_grads}

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
                   dynamo_unsupported=data.get("dynamo_unsupported", []), step=data.get("step", []),
                   step_outputs=data.get("step_outputs", []), step_params=data.get("step_params", []),
                   step_eager_grads=data.get("step_eager_grads", []))

    def plot(self, path: str) -> str:
        """Saved bytes against recompute cost over the recompute weight; the chosen plan marked."""
        g = self._graph()
        if not g.frontier and self.plans:
            g.frontier.extend([list(p) for p in self.plans[-1].frontier()])
        return plot(g, path)
