"""Which modules DP-SGD cannot train as they are, and ``fix``: Opacus' ``ModuleValidator``.

    errors = validate(model)                 # [] when every module is fine
    model = fix(model)                       # a copy: BatchNorm -> GroupNorm, ...
    validate(model, raise_errors=True)       # UnsupportedModuleError naming each module and its fix

DP-SGD needs each example's gradient to depend on that example only, and nothing but the
clipped, noised gradient to leave the training data:

- BatchNorm in train mode normalizes with the batch's statistics (example i's output depends
  on every other example) and its running statistics are a non-private summary of the data:
  use GroupNorm (``fix`` replaces it, ``min(32, C)`` groups as Opacus does, with the same affine
  parameters);
- InstanceNorm with ``track_running_stats=True``: the running statistics leak the same way:
  ``fix`` turns the tracking off;
- ``nn.RNN``/``nn.GRU``/``nn.LSTM``: their fused ``_VF`` kernels cannot run under ``vmap`` (RNN,
  GRU) or break the Dynamo graph (LSTM): ``fix`` replaces them by :class:`~fxmem.dpsgd.rnn.LoopRNN`
  (their cell loops, same parameters); ``make_private`` differentiates such a loop copy itself.
"""

from __future__ import annotations

import copy

from torch import nn

from .rnn import LoopRNN

__all__ = ["ModuleValidator", "UnsupportedModuleError", "fix", "validate"]


class UnsupportedModuleError(ValueError):
    """A module that DP-SGD cannot train as it is; the message names the module and the fix."""


def _problem(module: nn.Module) -> str | None:
    kind = type(module).__name__
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or module.track_running_stats):
        return (f"{kind} mixes the examples of a batch (batch statistics) and keeps running statistics "
                "of the data: not supported by DP-SGD; use GroupNorm (fix() replaces it)")
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return (f"{kind} with track_running_stats=True keeps running statistics of the data: use "
                "track_running_stats=False (fix() turns it off)")
    if type(module) in (nn.RNN, nn.GRU, nn.LSTM):
        return (f"{kind} runs as one fused kernel that vmap cannot batch per example (or Dynamo cannot "
                "trace): fix() replaces it by its cell loop on the same parameters (LoopRNN); "
                "make_private does that itself")
    return None


def validate(module: nn.Module, raise_errors: bool = False) -> list[UnsupportedModuleError]:
    """Every submodule DP-SGD cannot train as it is (``name: what and the fix``); with
    ``raise_errors`` one UnsupportedModuleError listing them all, if there are any."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"validate: module must be a torch.nn.Module, got {type(module).__name__}")
    errors = [UnsupportedModuleError(f"{name or '<root>'}: {why}")
              for name, sub in module.named_modules() if (why := _problem(sub)) is not None]
    if errors and raise_errors:
        raise UnsupportedModuleError("fxmem.dpsgd: the module cannot be trained with DP-SGD as it is:\n"
                                     + "\n".join(f"  {e}" for e in errors)
                                     + "\nfxmem.dpsgd.fix(module) returns a copy with these fixed")
    return errors


def _fixed(module: nn.Module) -> nn.Module | None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        c = module.num_features
        groups = next(g for g in range(min(32, c), 0, -1) if c % g == 0)
        gn = nn.GroupNorm(groups, c, eps=module.eps, affine=module.affine)
        if module.affine:
            gn.weight.data.copy_(module.weight.data)
            gn.bias.data.copy_(module.bias.data)
        ref = next(iter([*module.parameters(), *module.buffers()]), None)
        return gn if ref is None else gn.to(ref.device)
    if type(module) in (nn.RNN, nn.GRU, nn.LSTM):
        return LoopRNN(module)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        out = copy.deepcopy(module)
        out.track_running_stats = False
        out.running_mean = out.running_var = out.num_batches_tracked = None
        return out
    return None


def fix(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every fixable problem of :func:`validate` fixed (BatchNorm ->
    GroupNorm with ``min(32, C)`` groups, or the largest count dividing C; InstanceNorm without
    running statistics; RNN/GRU/LSTM -> LoopRNN). The original is not modified."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"fix: module must be a torch.nn.Module, got {type(module).__name__}")
    out = copy.deepcopy(module)
    root = _fixed(out)
    if root is not None:
        return root
    for name, sub in list(out.named_modules()):
        new = _fixed(sub)
        if new is not None:
            parent_name, _, attr = name.rpartition(".")
            setattr(out.get_submodule(parent_name), attr, new)
    return out


class ModuleValidator:
    """Opacus' ``opacus.validators.ModuleValidator`` spelling of :func:`validate` and :func:`fix`,
    so that an Opacus script's ``ModuleValidator.fix(model)`` runs with only its import changed."""

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> list[UnsupportedModuleError]:
        """Opacus' ``validate``: the problems as a list; ``strict=True`` raises them instead."""
        return validate(module, raise_errors=strict)

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        return not validate(module)

    @staticmethod
    def fix(module: nn.Module, **kwargs) -> nn.Module:
        """Opacus' ``fix``: a copy with every fixable problem fixed. Opacus hands ``kwargs`` to its
        fixers; fxmem's take none, so any is an error naming it."""
        if kwargs:
            raise TypeError(f"fxmem.dpsgd.ModuleValidator.fix takes no options (got {', '.join(sorted(kwargs))}): "
                            "BatchNorm becomes GroupNorm with min(32, C) groups, as Opacus' default")
        return fix(module)

    @staticmethod
    def fix_and_validate(module: nn.Module) -> nn.Module:
        fixed = fix(module)
        validate(fixed, raise_errors=True)
        return fixed
