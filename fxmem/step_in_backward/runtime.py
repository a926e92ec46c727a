"""The runtime of ``step_in_backward`` (see the package): the option's check, each parameter's
slot, the update of one parameter, the end-of-backward pass, the user's ``optimizer.step()``, and
the op ``fxmem::step_in_backward`` that a rewritten backward calls."""


from __future__ import annotations

import logging
import math
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger("fxmem")

# torch.optim optimizers whose update of a parameter reads only its own gradient and state
SUPPORTED = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, n))


class StepInBackwardError(RuntimeError):
    """What ``step_in_backward`` cannot do, named with the alternative."""


def check_optimizer(value: Any, key: str = "step_in_backward") -> "InBackward | None":
    """The option's value: None, or a supported ``torch.optim`` optimizer (its :class:`InBackward`),
    on one process (under DDP/FSDP2 a gradient is reduced across ranks after the backward
    returns it: an update inside the backward would use this rank's part alone)."""
    if value is None:
        return None
    world = _world_size()
    if world > 1:
        raise ValueError(f"option {key!r}: torch.distributed runs {world} processes; the step in the backward "
                         "would update each rank's parameters from its own gradient, before DDP or FSDP2 reduce "
                         "them across ranks. Leave step_in_backward out there and call optimizer.step() after "
                         "backward()")
    if isinstance(value, InBackward):
        return value
    names = ", ".join(c.__name__ for c in SUPPORTED)
    if not isinstance(value, torch.optim.Optimizer):
        raise ValueError(f"option {key!r}: got {value!r}; allowed: None or a torch.optim optimizer over the "
                         f"compiled module's parameters ({names})")
    if type(value) not in SUPPORTED:
        raise ValueError(f"option {key!r}: got a {type(value).__name__}; allowed: {names} (optimizers whose update "
                         "of a parameter reads only that parameter's gradient and state). Leave the option out "
                         "and call optimizer.step() after backward() instead")
    return InBackward.of(value)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(eq=False)
class _Slot:
    """One parameter under ``step_in_backward``: where its gradient goes."""
    owner: "InBackward"
    param: Tensor
    name: str
    frames: set = field(default_factory=set)  # Dynamo frames whose compiled graphs update it
    shared: bool = False  # two frames' graphs read it: accumulated, updated when the backward ends
    updated: int = 0  # updates since the user's last optimizer.step() (gradient accumulation)
    in_graph: bool = False  # a graph's op got its gradient in this backward
    updated_early: bool = False  # ... and updated it there (a later part cannot be added)
    probed: bool = False  # a backward ran with it: the uses it found are the parameter's uses
    mine: Any = None  # (.grad, its version) as the op left it, accumulating


# The op's key (its slot's id) -> the slot: keys are baked into compiled graphs, which hold their
# options, which hold the InBackward owning the slots; weak, so that it holds nothing alive.
_SLOTS: "weakref.WeakValueDictionary[int, _Slot]" = weakref.WeakValueDictionary()


class InBackward:
    """The runtime of ``step_in_backward`` for one optimizer: its parameters' slots, the update
    of one parameter, the end-of-backward pass for the gradients autograd accumulated, and the
    user's ``optimizer.step()`` made a no-op. One per optimizer (:meth:`of`)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._step = _raw_step(optimizer)
        self._slots: dict[int, _Slot] = {}  # id(param) -> its slot
        self._queued = False
        self._warned = False
        self._user_stepped = False  # optimizer.step() was called since the option was given
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._key(p)
        _wrap_user_step(self)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "InBackward":
        """The optimizer's runtime, made at its first compile (kept on the optimizer)."""
        found = getattr(optimizer, "_fxmem_in_backward", None)
        if found is None:
            found = optimizer._fxmem_in_backward = cls(optimizer)
        return found

    def scratch_bytes(self, p: Tensor) -> tuple[float, int | None]:
        """The temporaries of ``p``'s update: (bytes per byte of the gradient the optimizer's
        single-tensor step allocates and frees before it returns, the bytes of the block it
        steps at a time or None for the whole parameter; :func:`_blocks`). The simulator adds
        them at the op. Measured with the profiler's allocator events on CPU, fp32 and bf16
        (tests/test_step_in_backward.py measures each again)."""
        per_byte = scratch_per_byte(self.optimizer, _group_of(self.optimizer, p))
        row = _row_bytes(p)
        blocked = type(self.optimizer) in _BLOCKED and p.dim() and 0 < row <= BLOCK_BYTES
        return per_byte, (BLOCK_BYTES // row * row if blocked else None)

    def state_kind(self) -> str | None:
        """The ``optimizer`` name whose state ``fit`` reserves (``fxmem.options.OPTIMIZER_STATE``):
        the optimizer's own, where it is one of those; None (the default) otherwise."""
        opt = self.optimizer
        if type(opt) is torch.optim.SGD:
            return "momentum" if any(g.get("momentum", 0) for g in opt.param_groups) else "sgd"
        return {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}.get(type(opt))

    def __repr__(self) -> str:  # stable: goes into the report's options
        return f"InBackward({type(self.optimizer).__name__})"

    def _key(self, p: Tensor) -> int:
        slot = self._slots.get(id(p))
        if slot is None or slot.param is not p:
            slot = self._slots[id(p)] = _Slot(self, p, _param_name(self.optimizer, p))
            _SLOTS[id(slot)] = slot
            p.register_post_accumulate_grad_hook(self._accumulated)
        return id(slot)

    def keys(self, inputs: Sequence[Any], frame: Any, names: Sequence[str] = ()) -> dict[int, int]:
        """Graph input index -> key, for the inputs that are this optimizer's parameters, claimed
        for ``frame`` (Dynamo's frame id: recompiles of one frame replace each other, graphs of
        two frames run in one step, so a parameter two frames read is ``shared``). ``names``:
        Dynamo's source of each input (``L['self']._modules['fc']._parameters['weight']``), for
        the report and errors (``fc.weight``)."""
        mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        out = {}
        for i, t in enumerate(inputs):
            if isinstance(t, Tensor) and id(t) in mine and t.requires_grad:
                key = self._key(t)
                slot = _SLOTS[key]  # (alive: self._slots holds it)
                if i < len(names) and names[i]:
                    slot.name = _dotted(names[i])
                slot.frames.add(frame)
                if len(slot.frames) > 1 and not slot.shared:
                    slot.shared = True
                    log.info("fxmem step_in_backward: %s is read by two compiled graphs (a graph break); its "
                             "update runs when the backward ends", slot.name)
                out[i] = key
        return out

    def update(self, slot: _Slot, grad: Tensor) -> None:
        """The optimizer's step on ``slot``'s parameter alone, with ``grad`` as its gradient
        (its group's hyperparameters as they are now); the gradient is dropped after. A large
        parameter of an elementwise optimizer whose state exists is stepped in row blocks
        (:func:`_blocks`): its temporaries are one block's, not the parameter's."""
        p, opt = slot.param, self.optimizer
        group = _group_of(opt, p)
        groups, params = opt.param_groups, group["params"]
        opt.param_groups = [group]
        try:
            for part, part_grad in _blocks(opt, p, grad):
                group["params"] = [part]
                part.grad = part_grad
                try:
                    self._step(opt)
                finally:
                    part.grad = None
        finally:
            opt.param_groups, group["params"] = groups, params
        opt._opt_called = True  # LR schedulers check that the optimizer stepped
        slot.updated += 1

    def in_graph(self, slot: _Slot, grad: Tensor) -> None:
        """A compiled backward's gradient for ``slot``: the update now; or, while the parameter
        is not known to get its whole gradient here (its first backward, a parameter other code
        reads too), accumulated in ``.grad`` and updated when the backward ends."""
        if slot.param.grad is not None:  # another part came first (plain PyTorch code, another graph)
            slot.shared = True
        slot.in_graph = True
        self._queue()  # (clears in_graph when the backward ends)
        if slot.shared or not slot.probed:
            p = slot.param
            p.grad = grad.clone() if p.grad is None else p.grad.add_(grad)
            slot.mine = (p.grad, p.grad._version)  # the hook tells autograd's parts from this
            return
        slot.updated_early = True
        self.update(slot, grad)

    def _accumulated(self, p: Tensor) -> None:
        """Autograd accumulated a gradient into ``p.grad`` (plain PyTorch code, a graph that fell
        back): the update when the backward ends, from the whole gradient. (Autograd runs the
        hook for the None a compiled backward returns for a parameter it updated, too.)"""
        slot = self._slots[id(p)]
        if p.grad is None or (slot.mine is not None and slot.mine[0] is p.grad and slot.mine[1] == p.grad._version):
            return
        if slot.in_graph:
            slot.shared = True  # from now on: accumulated, updated when the backward ends
        if slot.updated_early:
            self._abandon()
            raise StepInBackwardError(
                f"fxmem step_in_backward: parameter {slot.name!r} got a gradient from code outside fxmem's "
                "compiled graph after its update had run in the compiled backward (a use its earlier backwards "
                "did not have): this step's update of it missed that part; from the next backward on it is "
                "updated when the backward ends. Keep every use of a parameter inside the compiled forward, or "
                "leave step_in_backward out")
        self._queue()

    def _abandon(self) -> None:
        """This backward stops with an error: no update when it ends, no gradient left for the next."""
        self._queued = False
        for slot in self._slots.values():
            slot.param.grad = None
            slot.in_graph = slot.updated_early = False
            slot.mine = None

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._queued = False
        for slot in self._slots.values():
            if slot.param.grad is not None:
                self.update(slot, slot.param.grad)
            slot.probed |= slot.in_graph  # its uses are known: the next backward updates it early
            slot.in_graph = slot.updated_early = False
            slot.mine = None

    def user_step(self, step: Callable, closure: Callable | None = None) -> Any:
        """``optimizer.step()`` called by the user: each update already ran in the backward."""
        if closure is not None:
            raise StepInBackwardError(
                "fxmem step_in_backward: optimizer.step(closure) cannot run: the updates run inside the "
                "backward, one pass per step. Call loss = closure() (which runs backward) instead")
        slots = list(self._slots.values())
        many = [s.name for s in slots if s.updated > 1]
        for s in slots:
            s.updated = 0
        seen, self._user_stepped = self._user_stepped, True
        if many and seen:  # a step() every few backwards: the cadence of gradient accumulation
            raise StepInBackwardError(
                f"fxmem step_in_backward: {len(many)} parameter(s) (e.g. {many[0]!r}) were updated by several "
                "backward passes between two optimizer.step() calls: gradient accumulation cannot work with the "
                "step in the backward (each backward applies its own update). Use one larger batch (fxmem's "
                "options level=1 or memory_budget make it fit), or leave step_in_backward out")
        if not self._warned:
            self._warned = True
            warnings.warn("fxmem step_in_backward: optimizer.step() does nothing here: each parameter was updated "
                          "in the backward (and zero_grad() finds no gradient); call only loss.backward() and the "
                          "LR scheduler's step()", UserWarning, stacklevel=3)
        return step()


def slot(key: int) -> _Slot:
    """The slot of an op's key (its compiled graph's options keep it alive)."""
    return _SLOTS[key]


BLOCK_BYTES = 4 * 2**20  # a parameter above this is stepped in row blocks of about this size
_BLOCKED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # elementwise, state known
_SCALAR_STATE = ("step",)  # per-parameter counters: one increment per update, not per block


def _row_bytes(p: Tensor) -> int:
    """Bytes of one row (index along the first dimension) of ``p``, from its shape alone."""
    return math.prod(p.shape[1:]) * p.element_size()


def _blocks(opt: torch.optim.Optimizer, p: Tensor, grad: Tensor):
    """``(tensor to step, its gradient)``: ``p`` whole, or, for a parameter over
    :data:`BLOCK_BYTES` of an elementwise optimizer (SGD, Adam, AdamW) whose state exists (from
    its second update on), row blocks of it, each stepped with its rows of the state: the same
    arithmetic on every entry as the whole step's (no entry reads another), with one block's
    temporaries alive instead of the parameter's. The state's counters advance once."""
    state = opt.state.get(p)
    block_rows = BLOCK_BYTES // max(1, _row_bytes(p)) if p.dim() else 0
    if (type(opt) not in _BLOCKED or not state or block_rows < 1 or p.shape[0] <= block_rows
            or any(k not in _SCALAR_STATE and not (isinstance(v, Tensor) and v.shape == p.shape)
                   for k, v in state.items())):
        yield p, grad
        return
    counters = {k: v for k, v in state.items() if k in _SCALAR_STATE}
    flat = p.detach()
    for start in range(0, p.shape[0], block_rows):
        rows = slice(start, start + block_rows)
        part = flat[rows]
        opt.state[part] = {k: (v.clone() if k in _SCALAR_STATE else v[rows]) for k, v in state.items()}
        try:
            yield part, grad[rows]
            advanced = {k: opt.state[part][k] for k in counters}
        finally:
            del opt.state[part]
    state.update(advanced)


def scratch_per_byte(opt: torch.optim.Optimizer, group: dict) -> float:
    """Temporaries of one parameter's step, per byte of the parameter (see
    :meth:`InBackward.scratch_per_byte`): each option that makes a new gradient (weight decay
    added to it, ``maximize``'s negation, Nesterov's look-ahead) keeps one alive; Adam's
    denominator takes two (``sqrt``, then the division); ``foreach`` one, ``fused`` none.
    Optimizers not listed: three, an upper bound of those measured."""
    flags = sum(bool(group.get(k)) for k in ("maximize",)) + \
        bool(group.get("weight_decay")) * (type(opt) is not torch.optim.AdamW)
    if type(opt) is torch.optim.SGD:
        return float(min(2, flags + bool(group.get("nesterov"))))
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        if group.get("fused"):
            return 0.0
        return 1.0 if group.get("foreach") else 2.0 + flags
    if type(opt) in (torch.optim.RMSprop, torch.optim.Adagrad) and not flags:
        return 1.0
    return 3.0


def _raw_step(opt: torch.optim.Optimizer) -> Callable:
    """The optimizer class's step function without torch's hook wrapper (the user's step hooks
    run once per ``optimizer.step()``, not once per parameter)."""
    step = type(opt).step
    return getattr(step, "__wrapped__", step)


def _wrap_user_step(owner: InBackward) -> None:
    opt = owner.optimizer
    original = opt.step

    def step(closure: Callable | None = None) -> Any:
        return owner.user_step(original, closure)
    if getattr(original, "_wrapped_by_lr_sched", False):  # a scheduler made before: it checks the mark
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step  # type: ignore[method-assign]


def _group_of(opt: torch.optim.Optimizer, p: Tensor) -> dict:
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            return group
    raise StepInBackwardError("fxmem step_in_backward: a parameter the compiled graph updates is in none of the "
                              "optimizer's param_groups any more; compile again after changing them")


def _dotted(source: str) -> str:
    """``L['self']._modules['fc']._parameters['weight']`` -> ``fc.weight`` (else as given)."""
    parts = re.findall(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", source)
    return ".".join(parts) if parts else source


def _param_name(opt: torch.optim.Optimizer, p: Tensor) -> str:
    for gi, group in enumerate(opt.param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return f"param_groups[{gi}].params[{pi}] {tuple(p.shape)}"
    return f"parameter {tuple(p.shape)}"


@torch.library.custom_op("fxmem::step_in_backward", mutates_args=("grad",))
def step_in_backward(grad: Tensor, after: list[Tensor], key: int) -> None:
    """The optimizer's update of parameter ``key`` from ``grad``. ``after``: values computed from
    the parameter that must exist before it changes (a compiler that reorders the backward runs
    the op after them; the eager inner compiler runs the graph in its order and passes none).
    ``grad`` is declared written so that no compiler drops the op, which returns nothing; the
    parameter is not declared (a declared write bumps its version counter, and an earlier
    graph's backward that saved it for later would refuse to run)."""
    slot(key).owner.in_graph(slot(key), grad)


@step_in_backward.register_fake
def _(grad, after, key):
    return None


