"""Per-example (``vmap(grad(...))``) regions: find them, prove what follows them is per example
or a batch sum, and run them in microbatches (``options={"microbatch_size": m | "auto"}``,
``microbatch.py``). The backend's stage is :class:`~fxmem.per_example.stage.PerExampleStage`."""
from __future__ import annotations

from .plan import ChunkPlan
from .regions import Unsupported
from .stage import PerExampleStage

__all__ = ["ChunkPlan", "PerExampleStage", "Unsupported"]
