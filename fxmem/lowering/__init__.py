"""Pattern lowering: find the patterns of :data:`patterns.PATTERNS` in a Dynamo graph and replace
each by a call of a fused ``fxmem_kernels`` kernel, before AOTAutograd differentiates the graph.

    gm, lowered = lower(gm, example_inputs, options.lowering)   # before AOTAutograd

``options.lowering``: True (every pattern), False (none), or a dict pattern -> bool in which
patterns not named stay on; the default, ``{"dropout": False}``, is every pattern but seeded
dropout (see fxmem/options.py; the backend then declines the futile matches:
:attr:`patterns.Match.futile`). ``lower`` works on a copy: the graph it was given stays as it
was, for a fallback compile. The kernels run with ``impl="auto"``: their portable PyTorch
implementations, on CUDA too unless ``FXMEM_KERNELS_TRITON=1`` (fxmem_kernels/_common.py: the
Triton kernels are not yet tested on a GPU).

Why the Dynamo (torch-level) graph and not the joint aten graph
----------------------------------------------------------------
A pattern is replaced by a call of the kernel's autograd API (``fxmem_kernels.layer_norm``, ...,
see :mod:`.functions`); AOTAutograd then traces that call like any other, so its joint graph
holds the fused forward op and, from the Function's backward, the fused backward op, and the
planner sizes and places them like every other node (what a custom op returns and the backward
reads is kept: the fused ops' true saved bytes; tests/test_lowering.py checks that the planned
saved bytes equal what autograd holds). Checked with torch 2.13 before choosing (and asserted by
tests/test_lowering.py on every run):

- plain training: a ``call_function`` node calling an ``autograd.Function`` that Dynamo never saw
  is traced by AOTAutograd into the joint graph as ``fxmem::<op>`` in the forward and
  ``fxmem::<op>_backward`` in the backward; losses and gradients equal the unlowered graph's.
- ``vmap(grad(...))``: Dynamo's graph keeps the region as functorch calls
  (``_vmap_increment_nesting`` ... ``_autograd_grad`` ... ``_remove_batch_dim``) with the
  per-example ops between them; a call placed there is run by AOTAutograd under the same
  transforms, so the flat graph gets the fused forward op (batched by its vmap rule: one call on
  the stacked rows for the norms, activations and per-token cross-entropy) and the backward ops
  (once per example where a parameter gradient must stay per example). Per-example gradients
  equal the unlowered ones.

Matching the torch-level graph sees one node per ``F.cross_entropy``/``F.layer_norm`` call, with
its arguments as written, in plain training and inside vmap regions alike; the joint graph would
need a forward pattern and a backward pattern per kernel, in two spellings (the joint graph and
the flat vmap graph, where the backward is explicit batched aten ops after decomposition), and a
rewrite that keeps forward and backward consistent. The cost of this route: a pattern Dynamo
cannot see (e.g. the dropout inside ``scaled_dot_product_attention``) cannot be lowered, and a
custom ``torch.autograd.Function`` in the user's code is left alone. One Function is ours: under
``vmap`` the kernel's own cross-entropy API runs a per-example loop that calls its Python
implementation (AOTAutograd cannot trace it: its target check reads a value), so inside vmap
regions the loss goes through per-token losses and :class:`functions._RowsLCEBackward`.

Where it runs: on every graph the backend compiles, whole graphs and the chunk graphs of a
per-example region (``microbatch_size`` set, or ``ghost_clipping`` on, the default) alike; in
chunk graphs with ghost clipping the fused cross-entropy only when asked for by name or by
``lowering=True`` (``fxmem.backend._chunk_lowering``).

The logits: an HF causal LM returns its logits as well as the loss. The loss is lowered anyway;
the logits stay computed (by ``functions.returned_logits``: ``F.linear``) for the output and the
loss reads them. In a graph the backend compiles whole (``lower(..., reattach=True)``) they are
returned without a gradient and get it outside the compiled graph, only when the caller
differentiates them (:mod:`.returned`): AOTAutograd would otherwise hand the backward a
[tokens, vocab] zero gradient for them. A loss whose fused form is declined as futile stays
unfused, and its returned logits still leave the graph without a gradient
(``functions.returned_alias``: the unfused linear's output, reattached the same way). Compile a
module that returns only the loss to not have the logits at all (bench/results/lowering.md).

Bytes saved per lowering are what autograd keeps for backward from the matched subgraph minus
what the fused call keeps, on meta tensors at the compiled shape (:mod:`.savings`).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from ..graph.module import graph_module
from . import amp, splice
from .patterns import PATTERNS, Context, Match, Pattern, Skip, enabled
from .returned import KEEP_META, Spec, alias, detach, reattached
from .savings import bytes_saved

__all__ = ["PATTERNS", "Pattern", "Lowered", "Lowering", "lower", "enabled", "reattached"]

log = logging.getLogger("fxmem")
UNCOMPARED = "not applied: its plan could not be compared (the ops it replaces read a value that is not a tensor)"


@dataclass(frozen=True)
class Lowered:
    """One replaced occurrence."""
    pattern: str
    node: str                 # the graph node whose value the fused call now computes
    bytes_saved: int | None   # saved-for-backward bytes, unfused minus fused (None: unknown)
    per_example: bool         # inside a vmap region
    note: str = ""
    proven: bool = False      # never raises the planned peak (patterns.Match.proven)
    compared: bool = False    # marked for the partitioner's comparison (kept only if it wins)


@dataclass
class Lowering:
    """What :func:`lower` did to one graph: the occurrences it replaced and the anchors it left
    alone (with why)."""
    lowered: list[Lowered] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (pattern, node, reason)
    regions: list = field(default_factory=list, repr=False)  # splice.Region: the marked compared matches
    # returned logits made non-differentiable outputs (:mod:`.returned`): what the compiled
    # callable needs to give them their gradient (``reattached(compiled, returned)``)
    returned: list[Spec] = field(default_factory=list, repr=False)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for x in self.lowered:
            out[x.pattern] = out.get(x.pattern, 0) + 1
        return out

    def notes(self) -> list[str]:
        return [f"left alone: {pattern} at {node}: {why}" for pattern, node, why in self.skipped]

    def declined(self, why: str) -> "Lowering":
        """The same graph with none of its matches applied, each left alone for ``why``."""
        return Lowering([], [(x.pattern, x.node, why) for x in self.lowered] + self.skipped)

    def declined_compared(self, why: str) -> "Lowering":
        """Only the matches applied as they are; the compared ones left alone for ``why``."""
        return Lowering([x for x in self.lowered if not x.compared],
                        [(x.pattern, x.node, why) for x in self.lowered if x.compared] + self.skipped)


def lower(gm: fx.GraphModule, example_inputs: Any, lowering: bool | Mapping[str, bool],
          proven_only: bool = False, decline_futile: bool = False,
          compare: bool = False, compare_proven: bool = False,
          reattach: bool = False) -> tuple[fx.GraphModule, Lowering]:
    """``gm`` with every enabled pattern replaced by its fused call (a copy: ``gm`` itself is left
    as it is, for a fallback compile), and what was done. ``lowering`` (the option): True (all),
    False (none) or a dict pattern -> bool (patterns not named stay on). ``proven_only``: only the
    matches that never raise the planned peak (:attr:`patterns.Match.proven`);
    ``decline_futile``: matches that cannot lower it (:attr:`patterns.Match.futile`) are left
    alone, with that reason, unless ``lowering`` asks for their pattern by name (or is True);
    ``compare``: the matches neither proven nor futile are marked for the partitioner's
    comparison (:mod:`.splice`; their regions in ``Lowering.regions``), the proven ones too with
    ``compare_proven`` (a peak budget: see :mod:`.decide`), except inside a vmap
    region of a graph that is differentiated again: applied as they are there (where a fused
    backward is differentiated again, the backend compiles the graph unlowered); ``reattach``:
    logits returned beside a fused loss become non-differentiable outputs, the graph's outputs
    are extended (:func:`.returned.detach`), and the compiled graph must be wrapped by
    ``reattached(compiled, result.returned)`` (a graph the backend compiles whole)."""
    result = Lowering()
    patterns = enabled(lowering)
    if not patterns:
        return gm, result
    unknown = amp.unknown_devices(amp.states(gm.graph))
    if unknown:  # the fused calls make autocast's casts themselves: only where its op lists are known
        result.skipped.append(("lowering", "graph", f"autocast on {', '.join(unknown)}: fxmem knows its op lists "
                                                    f"for {', '.join(amp.DEVICES)} only"))
        return gm, result
    original, gm = gm, _copy(gm)
    graph = gm.graph
    erased: set[fx.Node] = set()
    aliased = False
    order = {n: i for i, n in enumerate(graph.nodes)} if compare else {}
    for pattern in patterns:
        ctx = Context.of(graph)
        for node in list(graph.nodes):
            if node in erased:
                continue
            try:
                found = pattern.find(node, ctx)
            except Exception as e:  # a finder's bug must not break a compile: leave the node alone
                log.debug("fxmem lowering: %s finder failed at %s", pattern.name, node.name, exc_info=True)
                found = Skip(pattern.name, node, f"matcher error ({type(e).__name__}: {e})")
            if isinstance(found, Match) and decline_futile and found.futile and not _named(lowering, found.pattern):
                if reattach:  # the logits it would have returned without a gradient: still so
                    aliased |= any(alias(graph, n, args, kwargs) for n, _, args, kwargs in found.kept)
                found = Skip(found.pattern, found.output, found.futile)
            if isinstance(found, Skip):
                result.skipped.append((found.pattern, found.node.name, found.reason))
            elif isinstance(found, Match) and (found.proven or not proven_only):
                marked = (compare and (compare_proven or not found.proven)
                          and found.output not in ctx.region)  # (vmap: as is)
                if marked and not splice.markable(found):
                    if not found.proven:
                        result.skipped.append((found.pattern, found.output.name, UNCOMPARED))
                        continue
                    marked = False  # proven: applied as it is
                result.lowered.append(_apply(graph, found, ctx, erased, result.regions if marked else None))
    splice.locate(result.regions, graph, order)
    if not result.lowered and not aliased:
        gm = original
    else:
        if reattach:
            result.returned = detach(graph)
        graph.lint()
        gm.recompile()
    return gm, result


def _named(lowering: bool | Mapping[str, bool], pattern: str) -> bool:
    """``pattern`` asked for explicitly: ``lowering=True`` or ``{pattern: True}``."""
    return lowering is True or (isinstance(lowering, Mapping) and lowering.get(pattern) is True)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node meta shallow-copied), sharing its
    parameters, with Dynamo's extra attributes (``meta``, parameter sources, ...)."""
    new = graph_module(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    for old, n in zip(gm.graph.nodes, new.graph.nodes):  # e.g. Dynamo's placeholder._dynamo_source
        for key, value in old.__dict__.items():
            if key not in n.__dict__:
                setattr(n, key, value)
    for key, value in gm.__dict__.items():
        if key not in new.__dict__:
            setattr(new, key, value)
    new.meta.update(gm.meta)
    return new


def _apply(graph: fx.Graph, m: Match, ctx: Context, erased: set, regions: list | None = None) -> Lowered:
    """Replace ``m`` by its fused call; with ``regions``, mark it for comparison (:mod:`.splice`)
    and add its region there."""
    region = ctx.region.get(m.output)
    batch = region[0] if region is not None and isinstance(region[0], int) else 1
    saved = bytes_saved(m.nodes, m.output, m.call, m.args, m.kwargs, batch, ctx.autocast.get(m.output))
    through = lambda a: a  # noqa: E731
    if regions is not None:
        compared, inputs = splice.extract(m, len(regions), ctx.autocast.get(m.output, {}))
        regions.append(compared)
        marks = splice.mark(graph, compared, inputs)
        through = lambda a: fx.map_arg(a, lambda x: marks.get(x, x))  # noqa: E731
    with graph.inserting_before(m.output):
        new = graph.call_function(m.call, through(m.args), through(m.kwargs))
    new.meta.update({k: m.output.meta[k] for k in KEEP_META if k in m.output.meta})
    name = m.output.name
    m.output.replace_all_uses_with(new)
    replaced = [new]
    for n, call, args, kwargs in m.kept:  # still used elsewhere (e.g. returned): computed by ``call`` instead
        with graph.inserting_before(n):
            kept = graph.call_function(call, through(args), through(kwargs))
        kept.meta.update({k: n.meta[k] for k in KEEP_META if k in n.meta})
        n.replace_all_uses_with(kept)
        replaced.append(kept)
    if regions is not None:
        splice.mark_outputs(graph, compared, replaced)
    for n in reversed(m.nodes):
        if not n.users:
            graph.erase_node(n)
            erased.add(n)
    return Lowered(m.pattern, name, saved, region is not None, m.note, m.proven, regions is not None)
