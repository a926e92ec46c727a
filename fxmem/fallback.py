"""The failure policy: a stage of fxmem that raises on a graph must not break training.

Outside ``strict`` mode, a failing stage gives one warning naming the stage and the reason, and
the graph falls back to a safe plan (the stage is skipped: save everything, no lowering, no
chunking); a report that cannot be built or written (the last stage) leaves the compile as it is,
without that report. Errors in what the user asked for (bad options, an infeasible budget) are
not stage failures: they always raise.
"""
from __future__ import annotations

import logging

from torch._dynamo.exc import RestartAnalysis, SkipFrame

from .options import OptionError
from .warn import brief, warn

# The user's errors, and Dynamo's control flow (it restarts or skips a frame by raising).
_NOT_FAILURES = (OptionError, RestartAnalysis, SkipFrame)

log = logging.getLogger("fxmem")

STAGES = ("per_example", "ghost", "lowering", "plan", "split", "compile", "report")
# what the caller does instead: in the log, and (short) in the warning
_SAFE_PLAN = ("falling back to a safe plan for this graph (save everything, no lowering, no chunking)",
              "falling back to a safe plan")
_INSTEAD = {"report": ("the compile goes on without this graph's report",) * 2,
            "ghost": ("this chunk graph's per-example gradients stay materialized (no ghost norms)",
                      "no ghost norms for this chunk graph")}


def is_failure(error: BaseException) -> bool:
    """A stage's failure, not the user's error or Dynamo's control flow (those always raise)."""
    return not isinstance(error, _NOT_FAILURES)


def reason(error: BaseException) -> str:
    """What a warning says of ``error``: the first line of its message, at most 200 characters."""
    return (str(error).strip().splitlines() or [""])[0][:200]


def stage_failed(stage: str, error: BaseException, options) -> None:
    """Re-raise ``error`` under ``strict`` (or when it is the user's error); otherwise warn once
    with the stage and the reason, and let the caller take its safe path."""
    assert stage in STAGES, stage
    if options.strict or not is_failure(error):
        raise error
    why = reason(error)
    instead, short = _INSTEAD.get(stage, _SAFE_PLAN)
    log.warning("fxmem: stage %r failed (%s: %s); %s. Pass options={'strict': True} to raise instead.",
                stage, type(error).__name__, why, instead)
    warn(f"fxmem: stage {stage!r} failed ({type(error).__name__}: {brief(why, 60)}); {short} "
         "(strict=True raises)", RuntimeWarning)
