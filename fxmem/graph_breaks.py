"""Graph breaks that split a training step, and the ones fxmem avoids.

A graph break splits a step into graphs that fxmem plans one by one: the planner cannot see a
value's lifetime across the break, and a pattern (a loss after a model) cannot match across it.

- Hugging Face models call ``logger.warning_once`` inside ``forward`` (e.g. the causal LMs'
  "``loss_type=None`` ... ``ForCausalLMLoss``" notice): Dynamo breaks the graph there. fxmem
  adds ``logging.Logger.warning_once`` (transformers attaches it to ``Logger``) to Dynamo's
  ``ignore_logger_methods``, so stock HF models compile into one graph; in compiled code those
  once-only notices are then not printed.
- :func:`breaks_since` tells what broke a step's graph, for ``fxmem.explain`` and ``clipped_grad``.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch


def ignore_once_warnings(*_: object) -> None:
    """Let Dynamo skip HF's ``logger.warning_once`` calls instead of breaking the graph. Runs at
    the start of every Dynamo compile (transformers may be imported after fxmem): registered as
    a compile-start callback, again by each backend call since ``torch._dynamo.reset()`` clears
    those callbacks (the config entry itself survives a reset)."""
    method = getattr(logging.Logger, "warning_once", None)
    if method is not None and method not in torch._dynamo.config.ignore_logger_methods:
        torch._dynamo.config.ignore_logger_methods.add(method)
    handler = torch._dynamo.callback.callback_handler
    if ignore_once_warnings not in handler.start_callbacks:
        handler.register_start_callback(ignore_once_warnings)


def break_count() -> Counter:
    """Dynamo's graph-break reasons so far, with their counts (pass it to :func:`breaks_since`)."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def breaks_since(before: Counter) -> list[str]:
    """The reasons of the graph breaks Dynamo counted since ``before`` (most frequent first)."""
    from torch._dynamo.utils import counters

    new = Counter(counters["graph_break"]) - before
    return [reason.splitlines()[0][:200] for reason, _ in new.most_common()]
