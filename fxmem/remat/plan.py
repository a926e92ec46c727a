"""The recompute plan: levels, user rules, annotations and the memory budget, solved by min-cut."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import sympy
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..graph.joint import READS_MUTATED, JointGraph, is_multi_output, is_sym
from ..warn import brief, warn
from .allowlist import CHEAP, HEAVY, kind
from .budget import Candidate, candidate_of, least_peak, least_with_offload, within_budget
from .clusters import Cluster
from .context import PlanContext
from .layers import every_kth
from .mincut import CutProblem, NoPlan, ScaledCut, solve
from .offload import NONE
from .settings import PlanSettings

log = logging.getLogger("fxmem")

TIEBREAK = 1e-6  # recompute weight when only bytes matter: picks the cheaper of equal-byte cuts
# Level 1's layerwise plan is kept while its simulated peak is within this of the least peak's
# plan (whose extra recompute would buy less than this); the bar is 2% above it.
LEVEL_SLACK = 0.01


@dataclass(frozen=True)
class Plan:
    saved: tuple[fx.Node, ...]
    level: int
    lam: float
    saved_bytes: int  # at the plan shape
    saved_bytes_expr: sympy.Expr
    clusters: tuple[Cluster, ...]
    applied_rules: tuple[tuple[str, str, int], ...]  # (rule, cluster id, occurrences affected)
    notes: tuple[str, ...]
    problem: CutProblem | None = field(default=None, compare=False, repr=False)  # for frontiers
    plain_bytes: int = 0  # what a plain partition (no recompute) keeps, at the plan shape
    level0_bytes: int = 0  # what level 0 without rules or budget keeps
    offloaded: tuple[fx.Node, ...] = ()  # of ``saved``: handed to the backward in host memory (``offload``)
    host_bytes: int = 0  # their bytes at the plan shape (part of ``saved_bytes``, none of them on the device)

    def frontier(self, lams=tuple(10.0 ** k for k in range(-9, 5))) -> list[tuple[int, float, float]]:
        """(saved bytes, recompute cost, lambda) of the cheapest cut at each recompute weight."""
        from .split import split as split_

        out = []
        for lam in lams:
            saved = solve(self.problem, lam)
            recomputed = split_(self.problem.joint, saved).recomputed
            out.append((sum(self.problem.nbytes.get(n, 0) for n in saved if n.op != "placeholder"),
                        sum(self.problem.cost.get(n, 0.0) for n in recomputed), lam))
        return out


def _tagged(n: fx.Node, *policies) -> bool:
    return n.meta.get("recompute") in policies


def _annotations(joint: JointGraph) -> tuple[set[fx.Node], set[fx.Node]]:
    """(must save, must recompute) from torch.utils.checkpoint / selective-checkpoint tags."""
    save = {n for n in joint.forward if _tagged(n, CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)}
    # A tagged node that reads an input the step mutates (BatchNorm under torch.utils.checkpoint)
    # is kept instead: recomputed, it would read the new value.
    recompute = {n for n in joint.forward if not n.meta.get(READS_MUTATED)
                 and _tagged(n, CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)}
    # A checkpointed region's outputs feed untagged forward code: those are kept (as torch does).
    outputs = {n for n in recompute if any(
        u in joint.forward and (u not in recompute or u.meta.get("ac_graph_id") != n.meta.get("ac_graph_id"))
        for u in n.users)}
    save |= outputs
    recompute -= outputs
    return save, recompute


def _recomputable(ctx: PlanContext, settings: PlanSettings, notes: list[str]) -> set[fx.Node]:
    if settings.level == 0:
        return set(ctx.cheap)
    if not ctx.layer:
        return set(ctx.cheap)
    notes.append(f"level {settings.level}: {len(set(ctx.layer.values()))} layers found; everything inside them is "
                 "recomputed from their boundary tensors")
    return (ctx.cheap | ctx.heavy_inside) - ctx.fences


def _apply_rules(settings: PlanSettings, clusters: list[Cluster], recomputable: set[fx.Node],
                 no_save: set[fx.Node], notes: list[str]) -> list[tuple[str, str, int]]:
    """Apply the user's rules in order; the rules that match no cluster give one warning in all."""
    applied, unmatched = [], []
    by_id: dict[str, list[Cluster]] = {}
    for c in clusters:
        by_id.setdefault(c.id, []).append(c)
    for rule in settings.config:
        matching = by_id.get(rule.cluster)
        if not matching:
            unmatched.append(rule)
            continue
        chosen = matching if rule.count == -1 else matching[: rule.count]
        for c in chosen:
            if rule.strategy == 0:  # the last rule for an occurrence wins
                recomputable.discard(c.stash)
                no_save.discard(c.stash)
            else:
                recomputable.update(n for n in c.nodes if kind(n) != "never")
                no_save.add(c.stash)
        applied.append((str(rule), rule.cluster, len(chosen)))
    if unmatched:
        _warn_unmatched(unmatched, sorted(by_id), notes)
    return applied


def _warn_unmatched(rules: list, ids: list[str], notes: list[str]) -> None:
    """One warning (and one note, with the graph's cluster ids) for all the rules that match nothing."""
    if len(rules) == 1:
        short = f"rule {brief(str(rules[0]), 60)} matches no cluster of this graph"
        note = f"rule {rules[0]}: cluster {rules[0].cluster!r} matches nothing"
    else:
        listed = ", ".join(str(r) for r in rules)
        short = brief(f"{len(rules)} rules match no cluster of this graph: {listed}", 110)
        note = f"{len(rules)} rules match nothing: {listed}"
    msg = f"{note}; clusters in this graph: {', '.join(ids)}"
    warn(f"fxmem: {short} (fxmem.report lists them)", detail=msg)
    notes.append(msg)


def plan(ctx: PlanContext, settings: PlanSettings) -> Plan:
    """The saved set for ``settings`` (level, rules, annotations, budget) on the graph of ``ctx``."""
    joint, sizes, nbytes, cost = ctx.joint, ctx.sizes, ctx.nbytes, ctx.cost
    notes: list[str] = []
    recomputable = _recomputable(ctx, settings, notes)
    no_save: set[fx.Node] = set()
    applied: list[tuple[str, str, int]] = []
    if settings.config and settings.level > 0:
        notes.append(f"level {settings.level}: user config ignored (as in ONNX Runtime)")
    elif settings.config:
        applied = _apply_rules(settings, ctx.clusters, recomputable, no_save, notes)
    must_save, must_recompute = _annotations(joint)
    recomputable = (recomputable | must_recompute) - must_save
    no_save = (no_save | {n for n in must_recompute if not is_multi_output(n)}) - must_save
    if must_save or must_recompute:
        notes.append(f"user annotations: {len(must_save)} must-save, {len(must_recompute)} recompute-tagged nodes")

    def problem(recomp: frozenset[fx.Node]) -> CutProblem:
        return CutProblem(joint, nbytes, cost, recomp, frozenset(no_save))

    lam, final = TIEBREAK, recomputable
    try:
        saved = solve(problem(frozenset(recomputable)), lam)
    except NoPlan as e:  # e.g. a rule or tag asks to recompute what cannot be: keep those instead
        msg = f"fxmem: the requested recomputation is impossible ({e}); those values are kept instead"
        warn("fxmem: a rule or tag asks to recompute values that cannot be; they are kept (see fxmem.report)",
             detail=msg)
        notes.append(msg)
        no_save.clear()
        saved = solve(problem(frozenset(recomputable)), lam)
    plain0 = not (settings.config or settings.budgeted or must_save or must_recompute)
    level0 = saved if settings.level == 0 and plain0 else solve(
        CutProblem(joint, nbytes, cost, frozenset(n for n in ctx.fwd_nodes if kind(n) == CHEAP)), TIEBREAK)
    # Recompute that does not lower the (simulated) peak is pure cost: keep level 0's plan then
    # (a budget starts from it too: its cap is a fraction of the level's plan, and it may only
    # lower that plan's peak).
    unruled = not (settings.config or must_save or must_recompute)
    heavy = {n for n in (ctx.layer or joint.gm.graph.nodes) if n not in joint.backward and kind(n) == HEAVY}
    cheap = {n for n in ctx.fwd_nodes if kind(n) == CHEAP}
    if settings.level > 0 and unruled and not settings.budgeted:
        own = saved if ctx.layer and ctx.peak(saved) < ctx.peak(level0) else None
        saved, lam, final = _least_peak(ctx, settings, level0, (own, lam, final), cheap | heavy, must_save,
                                        problem, notes)
    elif settings.level > 0 and unruled and (not ctx.layer or ctx.peak(saved) >= ctx.peak(level0)):
        saved, final = level0, cheap  # a budget starts from level 0's plan and chooses below
    moved = NONE
    if settings.budgeted:
        saved, lam, final, moved = within_budget(ctx, settings, saved, final | heavy, must_save, problem, notes,
                                                 _layerwise(ctx, must_save, problem))
    elif settings.offload:  # no cap: the least peak the level's recompute and offload reach together, from
        # keeping everything level 0 keeps (offloaded, a layer's values come back one at a time) to the level's plan
        start = level0 if unruled else saved
        saved, lam, final, moved = least_with_offload(ctx, settings, start, final | cheap, must_save, problem, notes,
                                                      _layerwise(ctx, must_save, problem) if settings.level else [])
    kept = {ctx.root[n] for n in saved if n.op != "placeholder" and not is_sym(n) and n not in ctx.free}
    expr = sympy.Add(*[sizes.nbytes(n) for n in kept], sympy.Integer(0))
    return Plan(tuple(saved), settings.level, lam, sizes.at(expr), expr, tuple(ctx.clusters), tuple(applied),
                tuple(notes), CutProblem(joint, nbytes, cost, frozenset(final), frozenset(no_save)),
                _bytes(ctx.stashed, nbytes), _bytes(level0, nbytes), moved.nodes, moved.nbytes)


def _least_peak(ctx: PlanContext, settings: PlanSettings, level0: list[fx.Node], own: tuple,
                recomputable: set[fx.Node], must_save: set[fx.Node], problem,
                notes: list[str]) -> tuple[list[fx.Node], float, set[fx.Node]]:
    """Level 1's (and 2's) plan: its own layerwise plan ``own`` = (saved, weight, recomputable)
    where that lowers level 0's peak and comes within ``LEVEL_SLACK`` of the least simulated peak
    among the budget's candidates, unless a candidate peaking no higher keeps fewer bytes and
    recomputes less (:func:`_dominates`: then the fewest bytes among those); else the plan of
    least simulated peak (as ``memory_budget=0.0`` would, but the least recompute at that peak):
    level 0's where nothing peaks lower. Layer boundaries are a heuristic; the simulated peak
    judges it. A graph that is one part of a step (no loss in it) takes ``memory_budget=0.0``'s
    plan (``budget.step_part``); one for an inner compiler whose peak the simulator does not model exactly
    (``Target.exact_peak``) ranks the plans at the least peak with its fusion modeled
    (``StepPeak.fused``)."""
    saved, lam, final = own
    # A graph that returns no scalar to differentiate (a loss) passes its outputs on to more of
    # the step (Dynamo split the step at a graph break): what it keeps is alive while the rest
    # runs, which its own simulated peak does not see (``budget.step_part``).
    partial = ctx.partial
    # An inner compiler that fuses ops the simulator allocates (Inductor): plans tied at the
    # least simulated peak (its backward's peak in ops every plan runs alike) are ranked with
    # that fusion modeled (``fusion``), then by recompute.
    fused = not partial and not ctx.target.exact_peak
    chosen, scored, how, recomp = least_peak(ctx, level0, recomputable, must_save, problem,
                                             _layerwise(ctx, must_save, problem), fewest_bytes=partial,
                                             continued=settings.continued,
                                             tie=(lambda c: ctx.peak.fused(c.saved)) if fused else None)
    first = scored[0]
    fewest = partial and settings.continued
    which = ("the plan of fewest kept bytes no worse than level 0's in the step's phases" if fewest else
             "the plan of least simulated peak" + (
                 f" (of those, the least peak with {ctx.target.name}'s fusion modeled, then the least recompute)"
                 if fused else ""))
    level = f"level {settings.level}"
    if saved is not None and partial:
        why = "its graph returns no loss (a graph break splits the step) and what it keeps stays alive after it"
    elif saved is not None:
        mine = replace(candidate_of(ctx.walk, problem(frozenset()), saved, lam), peak=ctx.peak(saved))
        if mine.peak > chosen.peak * (1 + LEVEL_SLACK):
            why = f"its layerwise plan's simulated peak ({mine.peak} bytes) is {mine.peak / chosen.peak:.3f}x the least"
        elif not (dominant := [c for c in scored if _dominates(c, mine)]):
            return saved, lam, final
        else:
            chosen, which = min(dominant, key=lambda c: (c.nbytes, c.cost)), "that plan"
            why = (f"a plan peaking no higher keeps {chosen.nbytes} bytes and recomputes {chosen.cost:.4g} "
                   f"(its layerwise plan: {mine.nbytes} bytes, {mine.cost:.4g})")
    else:
        why = "no repeated layers found in the graph" if not ctx.layer else \
            "its plan's simulated peak is not below level 0's"
    # (a tie ranked by fusion: the level's own plan comes first, so another was ranked lower)
    better = ((chosen.nbytes, chosen.peak) < (first.nbytes, first.peak) if fewest
              else (chosen.peak, chosen.nbytes) < (first.peak, first.nbytes) if partial
              else chosen.saved != first.saved if fused else chosen.peak < first.peak)
    if chosen.saved == first.saved or not better:
        notes.append(f"{level}: {why}; using level 0's plan (no plan among {how} peaks lower)")
        return level0, TIEBREAK, {n for n in ctx.fwd_nodes if kind(n) == CHEAP}
    notes.append(f"{level}: {why}; using {which} among {how}: saved "
                 f"{chosen.nbytes} bytes, simulated peak {chosen.peak} bytes (level 0's plan: {first.nbytes} bytes, "
                 f"{first.peak})")
    return list(chosen.saved), chosen.lam, recomp | ctx.walk(chosen.saved)


def _dominates(a: Candidate, b: Candidate) -> bool:
    """``a`` is no worse than ``b`` in simulated peak, kept bytes and recompute, and better in one
    of the last two: nothing is gained by ``b`` (a layerwise plan within the slack of the least
    peak can keep more and recompute more than the least peak's plan; the simulated peak is the
    estimate's least certain part under Inductor, whose fusion it does not model)."""
    return (a.peak <= b.peak and a.nbytes <= b.nbytes and a.cost <= b.cost
            and (a.nbytes, a.cost) != (b.nbytes, b.cost))


def _layerwise(ctx: PlanContext, must_save: set[fx.Node], problem) -> list[list[fx.Node]]:
    """Layerwise checkpointing plans for the budget's candidates: level 1's (keep every layer
    boundary, recompute everything inside the layers) and, on deeper models, keeping only every
    k-th boundary for k = 2 and k = sqrt(n) (the layers between two kept boundaries are recomputed
    together)."""
    n = len(set(ctx.layer.values()))
    if n == 0:
        return []
    plans = []
    for k in sorted({1, 2, math.isqrt(n)} - {0}):
        if k >= n and k > 1:
            continue
        kept = ctx.fences if k == 1 else every_kth(ctx.joint, ctx.layer, ctx.fences, k)
        p = problem(frozenset((ctx.cheap | ctx.heavy_inside | ctx.fences) - kept - must_save))
        found = ScaledCut(p)(TIEBREAK)  # a candidate: a cut within rounding of the cheapest will do
        if found is not None:  # else no finite cut: a rule or tag that asks for the impossible
            plans.append(found[0])
    return plans


def _bytes(saved, nbytes: dict[fx.Node, int]) -> int:
    return sum(nbytes.get(n, 0) for n in saved if n.op != "placeholder")
