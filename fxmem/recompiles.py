"""One warning when Dynamo's recompile limit sends a frame that fxmem compiled to eager.

Past ``torch._dynamo.config.recompile_limit`` compiles of one frame (8 shapes with
``dynamic=False``, or 8 option sets tried on one model class in a notebook), Dynamo runs the
frame eagerly: every saving fxmem made is gone, and Dynamo's own log line names neither fxmem nor
what to do. fxmem watches for that log record (a :class:`logging.Filter` on Dynamo's
``convert_frame`` logger; it never drops or changes the record) and, when the backend of the
frame being compiled is fxmem, warns once per frame, at the user's line that made the call.
"""

from __future__ import annotations

import logging
import sys
import warnings
from types import CodeType, FrameType
from typing import Callable

import torch

from .warn import user_line

_LOGGER = "torch._dynamo.convert_frame"
_MARK = "hit config."  # Dynamo's message: "torch._dynamo hit config.%s (%s)" (recompile_limit, ...)


class RecompileLimitWarning(UserWarning):
    """Dynamo's recompile limit sent a frame that fxmem compiled to eager."""


class _Watch(logging.Filter):
    def __init__(self) -> None:
        super().__init__("fxmem.recompiles")
        self.warned: set = set()  # Dynamo's ids of the frames already warned about
        self.backend: Callable | None = None  # fxmem's backend function

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and _MARK in record.msg:
            try:
                self._check(record)
            except Exception:  # noqa: BLE001 - a diagnostic must never break Dynamo's logging
                pass
        return True

    def _check(self, record: logging.LogRecord) -> None:
        found = _compiling(sys._getframe(), self.backend)
        if found is None:
            return
        code, limit = found
        compile_id = torch._guards.CompileContext.current_compile_id()
        key = compile_id.frame_id if compile_id is not None else code
        if key in self.warned:
            return
        self.warned.add(key)
        name = record.args[0] if isinstance(record.args, tuple) and record.args else "recompile_limit"
        filename, lineno = user_line(sys._getframe()) or (code.co_filename, code.co_firstlineno)
        args = record.args if isinstance(record.args, tuple) else ()
        reason = str(args[3]) if len(args) > 3 else ""
        if "__code__" in reason:  # a guard on which function a wrapper's closure holds
            fix = (f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno}) is one code object shared by "
                   f"several functions (a decorator's wrapper), each one more compile: raise "
                   f"torch._dynamo.config.{name} above their number")
        else:
            fix = f"Use dynamic=True or raise torch._dynamo.config.{name}"
        warnings.warn_explicit(
            f"fxmem: Dynamo's {name} ({limit}) was reached: this call now runs eagerly, without fxmem. {fix}",
            RecompileLimitWarning, filename, lineno)


def _compiling(frame: FrameType | None, fxmem_backend: Callable | None) -> tuple[CodeType, int] | None:
    """(the code Dynamo was compiling, the limit) when its backend is ``fxmem_backend``: read from
    the frame of Dynamo's compile function that logs the record (its locals ``code`` and
    ``compiler_fn``)."""
    from torch._dynamo import config
    from torch._dynamo.eval_frame import innermost_backend

    for _ in range(30):
        if frame is None:
            return None
        local = frame.f_locals
        if "compiler_fn" in local and isinstance(local.get("code"), CodeType):
            backend = innermost_backend(local["compiler_fn"])
            backend = getattr(backend, "compiler_fn", backend)  # torch.compile(..., options=) wraps it
            if backend is fxmem_backend:
                return local["code"], config.recompile_limit
            return None
        frame = frame.f_back
    return None


_WATCH = _Watch()


def watch(backend: Callable) -> None:
    """Install the watch for frames compiled by ``backend`` (fxmem's; idempotent)."""
    _WATCH.backend = backend
    logger = logging.getLogger(_LOGGER)
    if _WATCH not in logger.filters:
        logger.addFilter(_WATCH)
