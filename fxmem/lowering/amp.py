"""Autocast in a Dynamo graph: which autocast is on at each node, and the dtype autocast would
run a matched op in, so that a fused call can make the same casts itself.

Autocast reaches a Dynamo graph in two ways: around the compiled call (no nodes: the state is
the one :func:`torch.is_autocast_enabled` reports while the backend runs, and AOTAutograd traces
under it) or entered inside the model (``_enter_autocast``/``_exit_autocast`` nodes around the
ops it covers). Either way the fake values Dynamo recorded already carry autocast's dtypes: a
linear of fp32 operands has a bf16 value. Autocast leaves the fused ``fxmem_kernels`` ops alone
(custom ops are in none of its lists: their autocast kernel is a fallthrough), so a lowered call
must cast its inputs as autocast would have cast the ops it replaces; with those casts made
explicitly, a call computes the same thing under any autocast state (and on meta tensors).

Autocast's op lists (torch 2.13: ``aten/src/ATen/autocast_mode.{h,cpp}``; checked on CPU by
``tests/test_lowering.py``): matmuls (``linear``, ``addmm``, ``mm``, ...) run in the autocast
dtype on CPU and CUDA; ``cross_entropy`` computes in fp32 on both (CPU lists
``cross_entropy_loss``, CUDA ``log_softmax`` and ``nll_loss``); ``layer_norm`` (and ``pow``,
``rsqrt``) are fp32 ops on CUDA and on no list on CPU (they run in their inputs' dtype there);
GELU, SiLU, dropout, ``mean`` and pointwise arithmetic are on no list on either. The patterns need
the first three; RMSNorm's statistics are fp32 as written, and a written-out GELU whose ``pow``
CUDA ran in fp32 is caught by its output dtype (:mod:`.patterns`).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

# Devices whose lists this module knows; autocast on another one turns lowering off.
DEVICES = ("cpu", "cuda")
# Ops our patterns match that autocast runs in fp32, by device ("lower": the autocast dtype).
_FP32 = {"cpu": frozenset({"cross_entropy"}), "cuda": frozenset({"cross_entropy", "layer_norm"})}

State = dict  # device type -> the dtype autocast casts matmuls to there (only enabled devices)


def ambient() -> State:
    """The autocast enabled around the compiled call (while the backend runs)."""
    return {d: torch.get_autocast_dtype(d) for d in _supported() if torch.is_autocast_enabled(d)}


def _supported() -> tuple[str, ...]:
    return tuple(torch._C._autocast_supported_devices())


def states(graph: fx.Graph) -> dict[fx.Node, State]:
    """The autocast on at each node that runs under some (nodes under none are left out)."""
    out, stack, state = {}, [], ambient()
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _enter_autocast:
            stack.append(state)
            device, dtype, enabled = (list(n.args) + [None, None, True])[:3]
            device = n.kwargs.get("device_type", device)
            dtype, enabled = n.kwargs.get("dtype", dtype), n.kwargs.get("enabled", enabled)
            state = {k: v for k, v in state.items() if k != device}
            if enabled:
                state[device] = dtype if dtype is not None else torch.get_autocast_dtype(device)
        elif n.op == "call_function" and n.target is _exit_autocast and stack:
            state = stack.pop()
        elif state:
            out[n] = state
    return out


def unknown_devices(states_: dict[fx.Node, State]) -> list[str]:
    """Devices autocast is on for whose op lists this module does not know."""
    return sorted({d for s in states_.values() for d in s if d not in DEVICES})


def compute_dtype(op: str, device: str, autocast: torch.dtype) -> torch.dtype | None:
    """The dtype autocast runs ``op`` in on ``device`` (``"matmul"``: the autocast dtype), or
    None: on no list there, it runs in its inputs' dtypes."""
    if op == "matmul":
        return autocast
    return torch.float32 if op in _FP32.get(device, ()) else None
