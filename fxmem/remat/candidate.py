"""A plan a budget or level may choose, as every candidate strategy returns it: :class:`Candidate`."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

SLACK = 1e-4  # simulated peaks this close count as equal (a scalar, a rounding)


@dataclass(frozen=True)
class Candidate:
    """One plan a budget may choose: what it keeps, the recompute weight of the cut it came from
    (reported only), its saved bytes and recompute cost, and its simulated step peak (None until
    simulated). Every candidate strategy below returns saved sets that become these."""
    saved: tuple[fx.Node, ...]
    lam: float
    nbytes: int
    cost: float
    peak: int | None = None
