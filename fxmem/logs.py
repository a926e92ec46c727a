"""fxmem in PyTorch's logging: ``TORCH_LOGS=fxmem`` and plan artifacts in ``TORCH_TRACE`` runs.

``TORCH_LOGS=fxmem`` (or ``+fxmem`` for DEBUG) sets the ``fxmem`` logger's level, as for
torch's own components; each plan's table is logged at INFO. Every plan is also emitted as a
structured trace artifact named ``fxmem_plan`` (JSON: the graph's report), which tlparse lists
next to the graphs of the same compile.
"""

from __future__ import annotations

from typing import Any, Callable


def register_logs() -> None:
    """Make ``fxmem`` a named ``TORCH_LOGS`` setting (listed by ``TORCH_LOGS=help``). torch reads
    ``TORCH_LOGS`` once, at its import; a name it does not know but can import (``fxmem``) it
    imports and registers itself, so ``TORCH_LOGS=fxmem`` works whichever is imported first."""
    from torch._logging import _internal

    if not _internal.log_registry.is_log("fxmem"):
        _internal.register_log("fxmem", "fxmem")


def trace_plan(payload: Callable[[], str], compile_id: Any = None) -> None:
    """Emit one plan as the structured trace artifact ``fxmem_plan`` (a no-op without TORCH_TRACE)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": "fxmem_plan", "encoding": "json"},
                     payload_fn=payload, compile_id=compile_id)
