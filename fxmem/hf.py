"""Hugging Face ``Trainer``: compile with fxmem and say what it did at the first step.

``TrainingArguments(torch_compile_backend="fxmem")`` is refused inside accelerate, which checks
backend names against its own list (``'FXMEM' is not a valid DynamoBackend``); making it accept
another name would mean patching accelerate for every backend. One line instead:

    Trainer(model=model, args=args, train_dataset=data, callbacks=[fxmem.hf.FxmemCallback({"level": 1})])

:class:`FxmemCallback` compiles the model in place (``model.compile(backend="fxmem", options=...)``)
when training begins and, after the first step, logs the summary of each graph fxmem planned
(the report's first five lines). :func:`report` gives a trainer's full report at any time.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from transformers import TrainerCallback

from .report import MemoryReport
from .report import report as _report
from .report.render import summary


def report(trainer: Any) -> MemoryReport:
    """The memory report of every graph fxmem compiled for ``trainer.model``."""
    return _report(trainer.model)


def summarize(rep: MemoryReport) -> str:
    """Each graph's five-line summary (level used, predicted peak, kept, recompute, top modules)."""
    if not rep.graphs:
        return "fxmem: no graphs compiled yet (nothing reached backend='fxmem')"
    return "\n\n".join("\n".join(summary(g)) for g in rep.graphs)


class FxmemCallback(TrainerCallback):
    """Compile the Trainer's model with fxmem (``options`` as ``torch.compile`` takes them;
    ``compile=False`` when the model is compiled already) and log what fxmem did after the first
    training step, with ``log`` (default ``print``)."""

    def __init__(self, options: Mapping[str, Any] | None = None, compile: bool = True,
                 log: Callable[[str], None] = print):
        self.options, self.compile, self.log = dict(options or {}), compile, log
        self.reported = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.compile and model is not None:
            model.compile(backend="fxmem", options=self.options)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.reported and model is not None:
            self.reported = True
            self.log(summarize(_report(model)))
