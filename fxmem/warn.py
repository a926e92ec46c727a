"""fxmem's warnings, pointed at the user's line, and short.

A warning raised while Dynamo compiles would name a line inside fxmem or torch
(``fxmem/remat/plan.py:163``); the user's line is the call that made the compile happen, the
innermost frame outside torch, fxmem and the standard library's ``logging``. A warning says what
happened and what to do in at most :data:`MAX_CHARS` characters; the details go to the report's
notes (the caller adds them) and to the ``fxmem`` log at INFO (``TORCH_LOGS=fxmem``).
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from pathlib import Path
from types import FrameType

import torch

_SKIP = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, logging)) + (
    str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "fxmem_kernels"))


def _outside(frame: FrameType) -> bool:
    return _outside_file(frame.f_code.co_filename)


@functools.lru_cache(maxsize=4096)
def _outside_file(path: str) -> bool:
    """Whether ``path`` lies outside torch, fxmem and logging; cached: resolving a path costs
    system calls, and a warning walks some 40 frames."""
    return not path.startswith("<") and not str(Path(path).resolve()).startswith(_SKIP)


def user_line(frame: FrameType | None = None) -> tuple[str, int] | None:
    """(file, line) of the innermost caller outside torch, fxmem and logging; None if none is."""
    frame = frame or sys._getframe(1)
    while frame is not None and not _outside(frame):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None


MAX_CHARS = 150  # a warning's length; its details are in the report and the log

log = logging.getLogger("fxmem")


def brief(message: str, limit: int = MAX_CHARS) -> str:
    """``message`` cut to ``limit`` characters at a word (a safety net: callers write short ones)."""
    if len(message) <= limit:
        return message
    return message[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"


def warn(message: str, category: type[Warning] = UserWarning, detail: str | None = None) -> None:
    """``warnings.warn`` at the user's line (its filters and once-per-location rule apply there),
    ``message`` at most :data:`MAX_CHARS` long; ``detail`` (the whole story) logged at INFO."""
    if detail:
        log.info("%s", detail)
    frame, level = sys._getframe(1), 2
    while frame is not None and not _outside(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(brief(message), category, stacklevel=level if frame is not None else 2)
