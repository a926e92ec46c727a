"""Keep, recompute or offload: which saved values a plan hands to the backward in host memory.

A saved value in host memory (``fxmem.host_memory``) holds no device bytes between its last
forward read and its first backward read, where it is copied back: the forward's peak and the
backward's first layers see it gone, at the price of two copies over the host link. Recompute
pays FLOPs instead. One cost model prices both in seconds (:class:`CostModel`): recompute work
over the device's rate (the planner's recompute cost: FLOPs for matmuls and convolutions,
elements for the rest), bytes moved over the host link's bandwidth, times the part of the
transfer that no compute hides (all of it today: the copies run in the compute stream's order).

Which values: the earliest in the forward first (:func:`offloadable`). They are read last in the
backward, by which time the later layers' values are freed, so moving them lowers the peak where
every saved value is alive (the forward's end and the backward's start) while what is reloaded
comes back when memory is low; the first k of them for the least k that meets a cap
(:func:`least_offload`, by bisection over k: each step one simulation of the step). With a cap,
:func:`cheapest_with_offload` tries that on a spread of recompute candidates (from no recompute
to the least peak) and keeps the least modelled time: on a GPU recomputing a matmul usually costs
less than moving its output twice over PCIe; on a CPU, whose memory copies are fast next to its
FLOPs, moving usually costs less. Without a cap, :func:`least_peak_with_offload`: the least peak
the three reach together, then the least time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .candidate import SLACK, Candidate
from .context import PlanContext
from .replay import generator_state
from .split import handoff

TRIED = 8  # recompute candidates a cap tries offloading on (evenly spread by recompute cost)


@dataclass(frozen=True)
class CostModel:
    """Seconds of recompute work and of host transfers on one device kind. ``rate``: recompute
    work units (FLOPs, or elements for memory-bound ops) per second; ``link``: host link bytes per
    second each way; ``hidden``: the part of a transfer overlapped with compute."""
    rate: float
    link: float
    hidden: float = 0.0

    def recompute(self, cost: float) -> float:
        return cost / self.rate

    def transfer(self, nbytes: int) -> float:
        return 2 * nbytes / self.link * (1 - self.hidden)  # out in the forward, back in the backward


# First-order figures: a CPU's memcpy (several GB/s) against two cores' tens of GFLOP/s; an
# H100's PCIe 5 link (~50 GB/s achieved of 64) against its ~500 dense TFLOP/s (bf16) discounted
# to what a training step achieves. Only their ratio matters to a choice.
MODELS = {"cpu": CostModel(rate=5e10, link=8e9), "cuda": CostModel(rate=2e14, link=4e10)}


@dataclass(frozen=True)
class Offloaded:
    """A plan's saved values in host memory, its host bytes at the plan shape, and the modelled
    seconds of moving them."""
    nodes: tuple[fx.Node, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0


NONE = Offloaded()


def model_of(ctx: PlanContext) -> CostModel:
    devices = {v.device.type for n in ctx.joint.primals if isinstance(v := n.meta.get("val"), torch.Tensor)}
    return MODELS["cuda" if "cuda" in devices else "cpu"]


def offloadable(ctx: PlanContext, saved) -> list[fx.Node]:
    """The values keeping ``saved`` hands to the backward that may go to host memory, earliest in
    the forward first: a forward op's storage, whole (the op's output or a view of all of it, such
    as the reshape a matmul reads; not shared with another value handed over), that the forward
    does not return; not a generator state."""
    pos = {n: i for i, n in enumerate(ctx.joint.gm.graph.nodes)}
    _, tensors, _ = handoff(ctx.joint, set(saved), pos)
    roots: dict[fx.Node, int] = {}
    for n in tensors:
        roots[ctx.root.get(n, n)] = roots.get(ctx.root.get(n, n), 0) + 1
    returned = set(ctx.joint.fwd_outputs)
    whole = {n for n in tensors if n.op == "call_function" and n not in ctx.free and roots[ctx.root[n]] == 1
             and isinstance(n.meta.get("val"), torch.Tensor) and ctx.nbytes.get(n, 0) > 0
             and host_bytes(ctx, n) == ctx.nbytes[n]}
    return [n for n in tensors if n in whole and n.target is not generator_state
            and not {n, ctx.root[n]} & returned]


def host_bytes(ctx: PlanContext, n: fx.Node) -> int:
    """Bytes of ``n``'s copy in host memory (its own elements), at the plan shape."""
    return ctx.sizes.at(ctx.sizes.nbytes(n))


def offloaded_of(ctx: PlanContext, nodes) -> Offloaded:
    nbytes = sum(host_bytes(ctx, n) for n in nodes)
    return Offloaded(tuple(nodes), nbytes, model_of(ctx).transfer(nbytes)) if nodes else NONE


def least_offload(ctx: PlanContext, saved, cap: int | None) -> tuple[Offloaded, int]:
    """(the fewest of :func:`offloadable` (a prefix) that bring the simulated step peak of keeping
    ``saved`` to ``cap`` or below, that peak); ``cap=None``: to the least peak offloading reaches.
    Where no prefix meets ``cap``, all of them (the least peak)."""
    order = offloadable(ctx, saved)
    peak0 = ctx.peak(saved)
    if (cap is not None and peak0 <= cap) or not order:
        return NONE, peak0

    def peak(k: int) -> int:
        return ctx.peak(saved, frozenset(order[:k]))

    low = peak(len(order))
    if low >= peak0:  # the peak is where none of them is alive (the backward's last layer, say)
        return NONE, peak0
    target = low * (1 + SLACK) if cap is None or low > cap else cap
    lo, hi = 0, len(order)  # peak(lo) > target >= peak(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= target:
            hi = mid
        else:
            lo = mid
    return offloaded_of(ctx, order[:hi]), (low if hi == len(order) else peak(hi))


def _spread(scored: list[Candidate]) -> list[Candidate]:
    """:data:`TRIED` candidates spread from the least recompute to the most, and the least peak's."""
    by_cost = sorted(scored, key=lambda c: (c.cost, c.peak))
    tried = {by_cost[i * (len(by_cost) - 1) // max(1, TRIED - 1)] for i in range(min(TRIED, len(by_cost)))}
    tried.add(min(scored, key=lambda c: (c.peak, c.cost)))
    return sorted(tried, key=lambda c: c.cost)


def least_peak_with_offload(ctx: PlanContext, scored: list[Candidate]) -> tuple[Candidate, Offloaded, int]:
    """(candidate, offloaded values, simulated peak) of the least peak keeping, recomputing and
    offloading reach among :func:`_spread`'s candidates, each with :func:`least_offload` (the
    fewest bytes moved for its least peak), then of the least modelled seconds."""
    model = model_of(ctx)
    options = []
    for c in _spread(scored):
        moved, peak = least_offload(ctx, c.saved, None)
        options.append((peak, model.recompute(c.cost) + moved.seconds, c, moved))
    low = min(o[0] for o in options)
    peak, _, chosen, moved = min((o for o in options if o[0] <= low * (1 + SLACK)), key=lambda o: o[1])
    return chosen, moved, peak


def cheapest_with_offload(ctx: PlanContext, scored: list[Candidate], cap: int) -> tuple[Candidate, Offloaded] | None:
    """The recompute candidate and offloaded values of least modelled seconds (recompute plus
    transfers) whose simulated step peak is at most ``cap``; None when none is. Tries every
    candidate that fits without offload (the least recompute of those) and :func:`_spread`'s,
    each with :func:`least_offload`."""
    model = model_of(ctx)
    fits = sorted((c for c in scored if c.peak <= cap), key=lambda c: (c.cost, c.peak))
    options = [(model.recompute(fits[0].cost), fits[0].peak, fits[0], NONE)] if fits else []
    for c in _spread(scored):
        if fits and model.recompute(c.cost) >= options[0][0]:
            continue  # costs more than the cheapest plan that fits before moving a byte
        moved, peak = least_offload(ctx, c.saved, cap)
        if peak <= cap:
            options.append((model.recompute(c.cost) + moved.seconds, peak, c, moved))
    if not options:
        return None
    _, peak, chosen, moved = min(options, key=lambda o: (o[0], o[1]))
    return chosen, moved


def to_bytes(ctx: PlanContext, chosen: Candidate, cap: int) -> Offloaded:
    """The earliest offloadable values of ``chosen`` whose host copies bring its device-kept bytes
    to ``cap`` (all of them where that is not enough): a memory budget no recompute plan meets."""
    moved, over = [], chosen.nbytes - cap
    for n in offloadable(ctx, chosen.saved):
        if over <= 0:
            break
        moved.append(n)
        over -= host_bytes(ctx, n)
    return offloaded_of(ctx, moved)
