"""``options={"fit": "24GB", "optimizer": "adamw"}``: the cheapest plan whose step fits the device.

The number a user knows is the device's size; the planner's ``peak_budget`` caps the step's own
peak (activations, gradients, the step's buffers) above what lives across steps. So ``fit`` is a
derivation into the planner's settings, made once per graph when the backend knows the graph's
parameters: ``peak_budget = fit - (parameters and buffers the graph takes) - (optimizer state per
trainable byte x trainable bytes)``; the budget machinery
(:func:`fxmem.remat.budget.within_budget`) then picks the least recompute among the plans whose
simulated peak fits. ``optimizer`` defaults to AdamW (two moments per weight: the usual case, and
the larger reservation).

A model split by graph breaks gives each graph the whole device: the pieces run one after the
other, but each counts only its own parameters, so the fit is approximate then.
"""

from __future__ import annotations

from .options import Options
from .report.model import optimizer_state_per_byte
from .warn import warn

DEFAULT_OPTIMIZER = "adamw"


def resident_bytes(model_bytes: tuple[int, int], optimizer: str | None) -> int:
    """Bytes alive across steps: parameters and buffers, and the optimizer's state."""
    total, trainable = model_bytes
    return total + int(optimizer_state_per_byte(optimizer) * trainable)


def peak_budget(opts: Options, model_bytes: tuple[int, int]) -> int | None:
    """The step's ``peak_budget`` that ``fit`` leaves for a graph whose (parameters and buffers,
    trainable parameters) take ``model_bytes``; None without ``fit``. The backend derives it once
    per graph into the planner's settings (:class:`fxmem.remat.settings.PlanSettings`)."""
    if opts.fit is None:
        return None
    optimizer = opts.optimizer or (opts.step_in_backward.state_kind() if opts.step_in_backward else None) \
        or DEFAULT_OPTIMIZER
    resident = resident_bytes(model_bytes, optimizer)
    room = opts.fit - resident
    if room <= 0:
        warn(f"fxmem fit={opts.fit:,} bytes: weights and {optimizer} state alone take {resident:,}; "
             "planning the least peak", RuntimeWarning)
    return max(room, 0)
