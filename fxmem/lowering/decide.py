"""The lowering stage's decision: which matches a graph is compiled with.

Proven matches (they never raise the planned peak: :attr:`.patterns.Match.proven`) are applied as
they are, futile ones (their sizes say they cannot lower it: :attr:`.patterns.Match.futile`) are
declined. The others are compared, and the comparison plans, it does not compile: they are
applied with their inputs and outputs marked (:mod:`.splice`), AOTAutograd traces that graph
once, and the partitioner plans the joint graph with them fused and with the ops they replaced
spliced back, keeping them only where the fused plan peaks lower (the report says why
otherwise; a tie is declined: the fused kernels' own buffers are the estimate's least certain
part). A graph nobody differentiates has no partitioner: there they are applied unmarked.

Under a peak budget (``peak_budget``, ``fit``) the proven matches are compared too, and the plan
without them is kept wherever it meets the cap: a budget asks for the fastest plan under a peak,
and a fused kernel's time is what the cost model does not price (the CPU attention kernel
recomputes its probabilities in its backward, slice by slice; Inductor fuses the ops it would
replace), so once the cap is met the inner compiler's own ops run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..options import Options
from . import Lowering, lower
from .splice import Compared


@dataclass
class Decision:
    """The lowering stage's result: the graph to compile, what was lowered or left alone, and the
    regions its partitioner compares (None: nothing to compare)."""
    gm: fx.GraphModule
    lowering: Lowering
    compared: Compared | None = None

    def outcome(self, declined: str | None) -> Lowering:
        """What was lowered once the partitioner compared: ``declined``, why the compared matches
        were not kept (None: they were)."""
        return self.lowering if declined is None else self.lowering.declined_compared(declined)


def decide(gm: fx.GraphModule, example_inputs: list[Any], options: Options) -> Decision:
    """The graph to compile and what was lowered."""
    capped = options.peak_budget is not None or options.fit is not None
    lowered_gm, lowered = lower(gm, example_inputs, options.lowering, decline_futile=True,
                                compare=_differentiated(example_inputs), compare_proven=capped, reattach=True)
    if not lowered.regions:
        return Decision(lowered_gm, lowered)
    return Decision(lowered_gm, lowered, Compared({r.id: r for r in lowered.regions}))


def _differentiated(example_inputs: list[Any]) -> bool:
    """AOTAutograd traces a joint graph (and calls the partitioner): an input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
