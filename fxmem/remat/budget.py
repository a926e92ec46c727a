"""The memory budgets: the least recompute whose saved bytes (``memory_budget``) or simulated step
peak (``peak_budget``) fit a cap, never refused.

Candidates are the level's own plan, every cut on the min-cut frontier (each the cheapest cut
for some recompute weight) with fewer saved bytes, and layerwise checkpoints (level 1's plan and
every k-th layer boundary kept). Layer boundaries are not kept by force: fewer saved bytes can
still mean a higher step peak (a recomputed value is alive again in the backward, perhaps at its
peak), so each candidate's peak is simulated and the choice (:func:`_choose`) walks the caps
from the most bytes down, taking at each the least recompute among the plans at most as high as
the choice above; only where no plan within a cap peaks that low does the cap win over the peak.
The candidate list and the rule do not depend on the cap. A cap below every candidate gets the
plan of least simulated peak with a warning (``strict``: :class:`BudgetError`); fraction 0 asks
for that plan.

Frontier cuts of a model with identical layers jump by whole sets of layers (recomputing the MLP
in every layer or in none), so a cap just under a cut's bytes would pay for far more recompute
than it needs. Between two neighbouring cuts the candidates therefore also include the one with
fewer bytes plus a growing part of the other's extra kept values, in two orders: the last layer's
first (the backward frees them first), and the smallest first (so the largest stay recomputed);
a superset of a valid saved set is valid: it only recomputes less. At most ``STEPS`` such plans
per pair and order keep the simulations few on deep models. The cheapest plan under a cap can
also mix cuts projection by projection (two layers' gate projections and one query projection):
a greedy walk over the units in which neighbouring cuts differ, with every plan one unit off the
walk, adds those. Only candidates that no other beats on both bytes and recompute are simulated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch.fx as fx

from ..options import OptionError
from ..warn import warn
from .candidate import SLACK, Candidate
from .context import PlanContext
from .mincut import CutProblem, frontier, saved_bytes
from .offload import NONE, Offloaded, cheapest_with_offload, least_peak_with_offload, to_bytes
from .settings import PlanSettings
from .split import Walk

LAM_LO, LAM_HI = 1e-9, 1e4
STEPS = 8
SIMULATED = 64  # candidates simulated, about (the frontier's cuts and layerwise plans besides)


class BudgetError(OptionError):
    pass


def _cost(walk: Walk, p: CutProblem, saved) -> float:
    """Recompute cost of a saved set (what :func:`split` would recompute, priced by ``p``)."""
    return sum(p.cost.get(n, 0.0) for n in walk(saved))


def _units(walk: Walk, more: list[fx.Node], fewer: list[fx.Node]) -> list[tuple[set, set]]:
    """How two neighbouring cuts differ, in independent units ``(drop, add)``: going from ``more``
    to ``fewer`` in one unit drops its values of ``more``, keeps its values of ``fewer`` instead
    and recomputes its ops. A unit is a connected group (by data edges) of the values and ops in
    which the cuts differ, e.g. one layer's gate projection with its output."""
    a, b = set(more), set(fewer)
    members = {n for n in a ^ b if n.op != "placeholder"} | (walk(b) ^ walk(a))
    seen: set[fx.Node] = set()
    units = []
    for start in (n for n in walk.joint.gm.graph.nodes if n in members and n not in seen):
        todo, group = [start], set()
        seen.add(start)
        while todo:
            n = todo.pop()
            group.add(n)
            for m in [*n.all_input_nodes, *n.users]:
                if m in members and m not in seen:
                    seen.add(m)
                    todo.append(m)
        if group & (a - b):
            units.append((group & (a - b), group & (b - a)))
    return units


def _greedy(walk: Walk, cuts: list[list[fx.Node]], p: CutProblem,
            pos: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """The plans of a greedy walk from the first cut down to the last. Each step applies the
    unit (of any neighbouring pair of cuts, :func:`_units`) that frees bytes at the least extra
    recompute cost per byte freed, as priced once against its own pair's cut with more bytes (the
    units are independent groups, and pricing each once keeps the walk linear in the graph: a
    model with identical layers has the same units in every layer). This mixes the cuts layer by
    layer and projection by projection (e.g. two layers' gate projections and one query
    projection), which the cuts alone and the steps between two of them do not."""
    allowed = p.recomputable | walk(cuts[0])  # the level's own plan may recompute more
    priced = []
    for more, fewer in zip(cuts, cuts[1:]):
        base = _cost(walk, p, more)
        for drop, add in _units(walk, more, fewer):
            freed = saved_bytes(p, drop) - saved_bytes(p, add - drop)
            if freed > 0:
                extra = _cost(walk, p, (set(more) - drop) | add) - base
                priced.append((extra / freed, min(pos[n] for n in drop), drop, add))
    priced.sort(key=lambda u: (u[0], -u[1]))  # equal rates: the last layer's first
    current, plans, todo = set(cuts[0]), [], [(drop, add) for _, _, drop, add in priced]
    progress = True
    while progress:  # a unit waits until the values it drops are kept (an earlier pair's unit)
        progress = False
        for i, (drop, add) in enumerate(todo):
            if drop <= current:
                step = (current - drop) | add
                del todo[i]
                if walk(step) <= allowed and saved_bytes(p, step) < saved_bytes(p, current):
                    current = step
                    plans.append(sorted(step, key=pos.__getitem__))
                progress = True
                break
    return plans


def _between(more: list[fx.Node], fewer: list[fx.Node], pos: dict[fx.Node, int],
             nbytes: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """``fewer`` plus the first j of ``more``'s extra kept values (graph inputs cost nothing and
    are left out), for at most ``STEPS`` evenly spaced j, neither end, in two orders: last in the
    graph first (the backward frees them first), and smallest first (what stays recomputed is the
    largest values: the fewest recomputed for the bytes, e.g. two MLP projections rather than a
    projection and two attention inputs)."""
    kept = set(fewer)
    extra = [n for n in more if n not in kept and n.op != "placeholder"]
    ends = sorted({len(extra) * i // (STEPS + 1) for i in range(1, STEPS + 1)} - {0, len(extra)})
    plans: dict[tuple[fx.Node, ...], list[fx.Node]] = {}
    for order in (sorted(extra, key=lambda n: -pos[n]), sorted(extra, key=lambda n: (nbytes.get(n, 0), -pos[n]))):
        for j in ends:
            plan = sorted(fewer + order[:j], key=pos.__getitem__)
            plans.setdefault(tuple(plan), plan)
    return list(plans.values())


def _trimmed(walk: Walk, saved: list[fx.Node], p: CutProblem, pos: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """``saved`` less its j smallest kept values (j = 1 .. ``STEPS``), and less one value of each
    size (the last in the graph), where what that recomputes may be recomputed."""
    allowed = p.recomputable | walk(saved)
    kept = sorted((n for n in saved if n.op != "placeholder" and p.nbytes.get(n, 0) > 0),
                  key=lambda n: (p.nbytes[n], -pos[n]))
    drops = [set(kept[:j]) for j in range(1, min(STEPS, len(kept)) + 1)]
    drops += [{n} for n in {p.nbytes[n]: n for n in reversed(kept)}.values()]
    plans = []
    for drop in drops:
        plan = [n for n in saved if n not in drop]
        if walk(plan) <= allowed:
            plans.append(plan)
    return plans


def candidate_of(walk: Walk, p: CutProblem, saved, lam: float) -> Candidate:
    return Candidate(tuple(saved), lam, saved_bytes(p, saved), _cost(walk, p, saved))


def _pareto(walk: Walk, p: CutProblem, candidates: list[tuple[list[fx.Node], float]],
            anchors: set[tuple]) -> list[Candidate]:
    """The candidates that no other beats on both bytes and cost, most bytes first; the first
    candidate (the level's own plan) always. Only these are simulated: a plan with more bytes and
    more cost than another is never worth its peak. On deep models they are thinned to about
    ``SIMULATED``, evenly along the bytes, keeping ``anchors`` (the frontier's cuts): each
    simulation walks the whole graph."""
    first, *rest = [candidate_of(walk, p, *c) for c in candidates]
    kept: list[Candidate] = []
    for c in sorted(rest, key=lambda c: (c.nbytes, c.cost)):  # fewest bytes first; stable: the first of equals
        if c.nbytes < first.nbytes and (not kept or c.cost < kept[-1].cost):
            kept.append(c)
    every = -(-len(kept) // SIMULATED)  # ceil: 1 (all kept) up to SIMULATED candidates
    kept = [c for i, c in enumerate(kept) if i % every == 0 or i == len(kept) - 1 or c.saved in anchors]
    return [first] + sorted(kept, key=lambda c: -c.nbytes)


def candidates(ctx: PlanContext, saved0: list[fx.Node], recomp: set[fx.Node], p: CutProblem,
               layerwise: list[list[fx.Node]] = ()) -> tuple[list[Candidate], str]:
    """Every candidate strategy's plans, each with its bytes, recompute cost and simulated peak:
    the level's own plan ``saved0`` first, the frontier's cuts (``p``, recomputing ``recomp``)
    with fewer bytes, the steps between neighbouring cuts (:func:`_between`), the greedy mixes
    (:func:`_greedy`), thinned to those no other beats on bytes and recompute (:func:`_pareto`),
    the ``layerwise`` checkpoints, and the least peak's plan less a few small values
    (:func:`_trimmed`). Also how to name them in notes."""
    walk, peak_of, joint = ctx.walk, ctx.peak, ctx.joint
    level_bytes = saved_bytes(p, saved0)
    cuts = [(saved0, LAM_HI)] + [c for c in frontier(p, LAM_LO, LAM_HI) if saved_bytes(p, c[0]) < level_bytes]
    pos = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    plans = [cuts[0]]
    for (more, _), (fewer, lam) in zip(cuts, cuts[1:]):
        plans += [(c, lam) for c in _between(more, fewer, pos, p.nbytes)] + [(fewer, lam)]
    # A greedy plan's weight (reported only) is that of the cut just above it in bytes.
    plans += [(c, min((lam for cut, lam in cuts if saved_bytes(p, cut) >= saved_bytes(p, c)), default=LAM_HI))
              for c in _greedy(walk, [c for c, _ in cuts], p, pos)]
    found = _pareto(walk, p, plans, {tuple(c) for c, _ in cuts})
    known = {c.saved for c in found}
    found += [candidate_of(walk, p, c, LAM_HI) for c in layerwise if tuple(c) not in known]
    scored = [replace(c, peak=peak_of(c.saved)) for c in found]
    lowest = min(scored, key=_least_peak)
    # Plans with fewer bytes than the least peak's usually peak much higher; the least peak's
    # plan less a few small values gives caps just below it a plan that peaks about as low.
    known = {c.saved for c in scored}
    for c in _trimmed(walk, list(lowest.saved), p, pos):
        if tuple(c) not in known:
            known.add(tuple(c))
            scored.append(replace(candidate_of(walk, p, c, lowest.lam), peak=peak_of(c)))
    how = (f"{len(scored)} candidate plans (frontier cuts, steps between them, greedy mixes, those no other beats "
           "on bytes and recompute, and layerwise checkpoints)")
    return scored, how


def least_peak(ctx: PlanContext, saved0: list[fx.Node], recomputable: set[fx.Node], keep: set[fx.Node],
               problem: Callable[[frozenset], CutProblem], layerwise: list[list[fx.Node]] = (),
               fewest_bytes: bool = False, tie: Callable[[Candidate], int] | None = None,
               continued: bool = False) -> tuple[Candidate, list[Candidate], str, set[fx.Node]]:
    """A level's plan where its own does not lower the peak: among the :func:`candidates`, the
    least recompute of those whose simulated peak is the least (``SLACK`` allowed), so that
    recompute that lowers nothing is not paid for; with ``fewest_bytes`` (a graph that is one part
    of a step), :func:`step_part` of them (``continued``: compiled at a graph break); with ``tie``,
    the least ``tie`` among them first (a second peak model). Returns
    (that plan, every candidate scored with ``saved0``'s first, how they are named, the
    recomputable set less ``keep``: a chosen plan's recomputable set is that and what the plan
    recomputes)."""
    recomp = recomputable - keep
    scored, how = candidates(ctx, saved0, recomp, problem(frozenset(recomp)), layerwise)
    chosen = step_part(ctx, scored, continued) if fewest_bytes else \
        _cheapest_under(scored, int(min(c.peak for c in scored) * (1 + SLACK)), tie)
    return chosen, scored, how, recomp


def within_budget(ctx: PlanContext, settings: PlanSettings, saved0: list[fx.Node],
                  recomputable: set[fx.Node], keep: set[fx.Node], problem: Callable[[frozenset], CutProblem],
                  notes: list[str], layerwise: list[list[fx.Node]] = ()
                  ) -> tuple[list[fx.Node], float, set[fx.Node], Offloaded]:
    """(saved set, recompute weight, recomputable set, what goes to host memory) for
    ``settings.memory_budget`` or ``settings.peak_budget``, chosen among the :func:`candidates`;
    never refused. With ``settings.offload``, a cap is met by keeping, recomputing and offloading
    at the least modelled time (``offload.cheapest_with_offload``; a memory budget no recompute
    plan meets: the least peak's plan with its earliest values offloaded to the cap).

    ``recomputable``: cheap ops anywhere, heavy ones inside layers (a model's head, e.g. the
    vocabulary projection, is needed first thing in the backward: recomputing it saves nothing
    at the peak). Layer boundaries are not kept by force (that is level 1's heuristic): the
    simulated peak judges every plan. Always kept: ``keep`` (user annotations). ``layerwise``:
    checkpointing plans (level 1's, every k-th boundary) added to the candidates as they are.

    ``memory_budget``: :func:`_choose` walks the caps from the most bytes down. A fraction that
    only plans peaking higher than a higher fraction's meet is unmet (a fraction stays monotone
    in the peak); bytes are a hard cap, met at the higher peak with a warning. ``peak_budget``:
    :func:`_cheapest_under`. An unmet cap gets the plan of least simulated peak with one warning
    (``strict``: :class:`BudgetError`); fraction 0 asks for that plan.
    """
    recomp = recomputable - keep
    p = problem(frozenset(recomp))
    level_bytes = saved_bytes(p, saved0)
    budget = settings.memory_budget
    cap = int(budget * level_bytes) if isinstance(budget, float) else budget
    scored, how = candidates(ctx, saved0, recomp, p, layerwise)
    lowest, least = min(scored, key=_least_peak), min(c.nbytes for c in scored)
    moved = NONE
    if settings.peak_budget is not None:
        chosen, what = _cheapest_under(scored, settings.peak_budget), f"peak budget {settings.peak_budget} bytes"
        if settings.offload:
            found = cheapest_with_offload(ctx, scored, settings.peak_budget)
            if found is None:  # unmet: the least peak keeping, recomputing and offloading reach
                low_c, moved, low = least_peak_with_offload(ctx, scored)
                lowest, chosen = replace(low_c, peak=low), None
            else:
                chosen, moved = found
                chosen = replace(chosen, peak=ctx.peak(chosen.saved, frozenset(moved.nodes)))
        if chosen is None:
            _unmet(settings, f"fxmem peak_budget={settings.peak_budget:,} bytes is below every plan's step peak",
                   f"option 'peak_budget': {settings.peak_budget!r} bytes is below every plan's simulated "
                            f"step peak{' (with offload)' if settings.offload else ''}; the least is {lowest.peak} "
                            f"bytes among {how}", lowest, notes)
    else:
        chosen, ceiling = _choose(scored, cap)
        what = f"memory budget {cap} bytes"
        # the fewest bytes a cap is met with: any plan (bytes), or one at the least peak (a fraction)
        met = least if isinstance(budget, int) else min(c.nbytes for c in scored if c.peak <= lowest.peak * (1 + SLACK))
        if isinstance(budget, float) and budget == 0.0:
            chosen = step_part(ctx, scored, settings.continued) if ctx.partial else lowest
        elif chosen is None or isinstance(budget, float) and chosen.peak > ceiling * (1 + SLACK):
            # no plan within the cap, or (a fraction: a knob along the plans, monotone in the
            # peak) only plans that peak higher than a higher fraction's
            if settings.offload:  # the least peak's plan, its earliest values in host memory to the cap
                chosen, moved = lowest, to_bytes(ctx, lowest, cap)
                chosen = replace(chosen, peak=ctx.peak(chosen.saved, frozenset(moved.nodes)))
                if chosen.nbytes - moved.nbytes <= cap:
                    notes.append(f"{what}: met with offload ({moved.nbytes} bytes in host memory)")
                    return _chosen(ctx, settings, chosen, moved, what, level_bytes, how, recomp, notes)
            _unmet(settings, f"fxmem memory_budget={budget!r} is infeasible (the least is {met:,} bytes)",
                   f"option 'memory_budget': {budget!r} ({cap} bytes of saved activations) is infeasible; "
                            f"the smallest feasible budget is {met} bytes ({met / max(level_bytes, 1):.3f} of "
                            f"level {settings.level}'s {level_bytes}) among {how}"
                            + ("" if chosen is None else
                               f"; fewer bytes than the least-peak plan's peak higher ({chosen.peak} bytes at the "
                               f"least against {lowest.peak})"), lowest, notes)
            chosen = None
        elif chosen.peak > ceiling * (1 + SLACK):  # bytes: a hard cap, met at a higher peak
            msg = (f"option 'memory_budget': {budget!r} ({cap} bytes of saved activations) is met only by plans that "
                   f"peak higher than a higher budget's: simulated peak {chosen.peak} bytes against {ceiling} (every "
                   f"plan that saves fewer bytes recomputes more values alive at the peak); memory_budget=0.0 or "
                   f"peak_budget asks for the least peak")
            warn(f"fxmem memory_budget={budget!r} is met only at a higher peak ({chosen.peak:,} bytes, not "
                 f"{ceiling:,}); memory_budget=0.0 asks for the least peak", detail=msg)
            notes.append(msg)
    return _chosen(ctx, settings, chosen or lowest, moved, what, level_bytes, how, recomp, notes)


def _chosen(ctx: PlanContext, settings: PlanSettings, chosen: Candidate, moved: Offloaded, what: str,
            level_bytes: int, how: str, recomp: set[fx.Node], notes: list[str]):
    host = f", {moved.nbytes} of them in host memory ({len(moved.nodes)} values)" if moved.nodes else ""
    notes.append(f"{what}: saved {chosen.nbytes} bytes{host} (level {settings.level} alone: {level_bytes}), "
                 f"simulated peak {chosen.peak} bytes, recompute cost {chosen.cost:.4g}, recompute weight "
                 f"{chosen.lam:.3g}; chosen among {how}")
    return list(chosen.saved), chosen.lam, recomp | ctx.walk(chosen.saved), moved



def least_with_offload(ctx: PlanContext, settings: PlanSettings, saved0: list[fx.Node], recomputable: set[fx.Node],
                       keep: set[fx.Node], problem: Callable[[frozenset], CutProblem], notes: list[str],
                       layerwise: list[list[fx.Node]] = ()) -> tuple[list[fx.Node], float, set[fx.Node], Offloaded]:
    """``offload`` without a budget: (saved set, recompute weight, recomputable set, offloaded) of
    the least simulated peak that keeping, recomputing what the level may (``recomputable``) and
    offloading reach, at the least modelled time (``offload.least_peak_with_offload``)."""
    recomp = recomputable - keep
    p = problem(frozenset(recomp))
    scored, how = candidates(ctx, saved0, recomp, p, layerwise)
    chosen, moved, peak = least_peak_with_offload(ctx, scored)
    what = f"level {settings.level} with offload (the least peak, then the least modelled time)"
    return _chosen(ctx, settings, replace(chosen, peak=peak), moved, what, saved_bytes(p, saved0), how, recomp,
                   notes)


def step_part(ctx: PlanContext, scored: list[Candidate], continued: bool) -> Candidate:
    """The plan of a graph that is one part of a step: of those :func:`in_a_step` allows (no worse
    than level 0's in any phase of the step), where Dynamo compiled it at a graph break
    (``continued``: its frame goes on, so more of the step runs while what it keeps is alive,
    forward and backward, and its own peak counts once), the fewest kept bytes, then the least
    peak (SwitchTransformers' encoder pieces: the step 458,184 -> 433,608 bytes, below HF
    checkpointing's); else (compiled at its frame's return: what runs after it may be only a
    loss) the least peak, then the fewest bytes (a diffusers UNet whose loss runs eagerly:
    fewest bytes first peaked 1.10x)."""
    return min(in_a_step(ctx, scored), key=_fewest_bytes if continued else _least_peak)


def in_a_step(ctx: PlanContext, scored: list[Candidate]) -> list[Candidate]:
    """For a graph that is one part of a step (``PlanContext.partial``): the candidates no worse
    than the first (the level's own plan, level 0's where a budget or level 1 starts from it) in
    each of what the step adds up (``report.memory.chained_peak``): the forward's peak (above what
    the graphs before it hold), the kept bytes (alive while every graph after it runs) and the
    backward's peak. A plan of a lower peak of its own that keeps more, or whose forward peaks
    higher, can raise the step's peak above level 0's though each graph's own peak is lower
    (issue #56 saw ``memory_budget=0.0`` at 1.068x level 0 on a time-series transformer that
    graph breaks split). The first is among them; on a graph that is the whole step, all are."""
    if not ctx.partial:
        return scored
    base = scored[0]
    fw0, bw0 = ctx.peak.phases(base.saved)
    out = [base]
    for c in scored[1:]:
        if c.nbytes <= base.nbytes:
            fw, bw = ctx.peak.phases(c.saved)
            if fw <= fw0 and bw <= bw0:
                out.append(c)
    return out


def _least_peak(c: Candidate) -> tuple:
    """The plan of least simulated peak, then fewest bytes, then least recompute."""
    return c.peak, c.nbytes, c.cost


def _fewest_bytes(c: Candidate) -> tuple:
    """The plan of fewest kept bytes, then least simulated peak, then least recompute."""
    return c.nbytes, c.peak, c.cost


def _unmet(settings: PlanSettings, short: str, msg: str, lowest: Candidate, notes: list[str]) -> None:
    """A cap no plan meets: :class:`BudgetError` under ``strict`` (``msg``), else one warning
    (``short``; ``msg`` in the notes): the plan of least simulated peak is used."""
    if settings.strict:
        raise BudgetError(msg)
    msg += (f"; using the plan of least simulated peak instead: {lowest.nbytes} bytes saved, simulated peak "
            f"{lowest.peak} bytes (strict=True raises)")
    warn(f"{short}; using the least-peak plan ({lowest.peak:,} bytes; strict=True raises)", detail=msg)
    notes.append(msg)


def _cheapest_under(scored: list[Candidate], peak: int,
                    tie: Callable[[Candidate], int] | None = None) -> Candidate | None:
    """The least recompute (then the lowest peak) among the plans whose simulated step peak is at
    most ``peak`` (the least ``tie`` first, where given); None when none is. Lowering the cap
    only removes plans, and the plan chosen above stays chosen while it fits: a lower cap never
    gives a higher simulated peak."""
    fits = [c for c in scored if c.peak <= peak]
    return min(fits, key=lambda c: (tie(c) if tie else 0, c.cost, c.peak, -c.nbytes)) if fits else None


def _choose(scored: list[Candidate], cap: int) -> tuple[Candidate | None, int]:
    """(the plan for ``cap`` or None when every candidate saves more, the least peak of the plans
    for higher caps). Walks the candidates' bytes from the most down to the cap: at each, among
    the plans within those bytes, the least recompute (then the most bytes) of those whose
    simulated peak is at most the least peak chosen so far (the level's own plan's at first,
    ``SLACK`` allowed: a scalar more is the same peak); where there is none, the cap is met at the
    least peak among the plans within it, which is higher: the caller warns."""
    ceiling = scored[0].peak
    for b in sorted({c.nbytes for c in scored}, reverse=True):
        fits = [c for c in scored if c.nbytes <= b]
        lower = [c for c in fits if c.peak <= ceiling * (1 + SLACK)]
        choice = min(lower, key=lambda c: (c.cost, -c.nbytes)) if lower else min(fits, key=lambda c: (c.peak, c.cost))
        if b <= cap:
            return choice, ceiling
        ceiling = min(ceiling, choice.peak)
    return None, ceiling
