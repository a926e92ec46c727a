"""A private training loop: Poisson batches, clipped sum, Gaussian noise, optimizer step, epsilon.

    fn, trainable, frozen = make_functional(model)
    def loss_fn(trainable, frozen, ids, labels):                   # ONE example
        return fn(trainable, frozen, input_ids=ids[None], labels=labels[None]).loss

    loader = poisson_loader(dataset, expected_batch_size=32, steps=300)
    dp = DPSGD(loss_fn, trainable, torch.optim.Adam(trainable.values(), lr=1e-2),
               clipping_norm=1.0, noise_multiplier=1.0, expected_batch_size=32,
               dataset_size=len(dataset), frozen_args=(frozen,), microbatch_size=8)
    train(dp, loader, log_every=10, log=print)   # step 10/300: batch 31, loss 3.2101, epsilon 0.84 ...

One step (``DPSGD.step(*batch)``), as in Abadi et al. and opacus::

    sum   = clipped_grad(loss_fn)(params, *frozen_args, *batch)      # sum_i clip_C(g_i)
    p.grad = (sum + N(0, (sigma C)^2)) / expected_batch_size         # for every trainable tensor
    optimizer.step(); accountant.step(sigma, sample_rate)

Dividing by the *expected* batch size (not the sampled one) keeps the noisy mean's sensitivity
C / expected_batch_size (opacus does the same under Poisson sampling).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from .accounting import PrivacyAccountant
from .clipping import ClippedGradFn, clipped_grad
from .noise import add_noise, noised_

__all__ = ["DPSGD", "StepLog", "train"]

log = logging.getLogger("fxmem.dpsgd")


@dataclass(frozen=True)
class StepLog:
    """One step: its number (from 1), batch size, mean per-example loss (nan for an empty
    batch) and the epsilon spent after it (None where it was not computed)."""
    step: int
    batch_size: int
    loss: float
    epsilon: float | None

    def line(self, steps: int | None = None, delta: float | None = None) -> str:
        of = f"/{steps}" if steps else ""
        eps = "" if self.epsilon is None else f", epsilon {self.epsilon:.3f}" + (
            f" (delta {delta:g})" if delta is not None else "")
        return f"step {self.step}{of}: batch {self.batch_size}, loss {self.loss:.4f}{eps}"


class DPSGD:
    """DP-SGD over ``params`` (a dict or pytree of the tensors ``optimizer`` steps, e.g.
    :func:`make_functional`'s ``trainable``). ``loss_fn(params, *frozen_args, *batch)`` is a
    per-example loss, as for :func:`clipped_grad`; ``sample_rate`` is
    ``expected_batch_size / dataset_size``. ``generator`` draws the noise (reproducible runs).
    ``accountant`` is a :class:`PrivacyAccountant` (``"rdp"``, ``"prv"`` or ``"gdp"``);
    ``epsilon()`` is what it reports at ``delta``."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], params: Any, optimizer: torch.optim.Optimizer, *,
                 clipping_norm: float, noise_multiplier: float, expected_batch_size: int, dataset_size: int,
                 frozen_args: Sequence[Any] = (), microbatch_size: int | str | None = 8,
                 delta: float = 1e-5, accountant: str = "rdp", generator: torch.Generator | None = None,
                 memory_budget: int | str | None = None, options: Mapping[str, Any] | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"DPSGD: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, v in (("expected_batch_size", expected_batch_size), ("dataset_size", dataset_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DPSGD: {name} must be a positive int, got {v!r}")
        if expected_batch_size > dataset_size:
            raise ValueError(f"DPSGD: expected_batch_size {expected_batch_size} is larger than "
                             f"dataset_size {dataset_size}")
        self.loss_fn, self.params, self.optimizer = loss_fn, params, optimizer
        self.clipping_norm, self.noise_multiplier = clipping_norm, noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.sample_rate = expected_batch_size / dataset_size
        self.frozen_args = tuple(frozen_args)
        self.microbatch_size, self.memory_budget, self.options = microbatch_size, memory_budget, options
        self.delta, self.generator = delta, generator
        self.accountant = PrivacyAccountant(accountant)
        self.accountant.epsilon(delta)  # a bad delta is named now, not after the first step
        self.steps = 0
        self.tensors = [t for t in pytree.tree_leaves(params) if isinstance(t, torch.Tensor)]
        self._clipped: dict[int, ClippedGradFn] = {}
        # noise arguments checked before any compile
        add_noise({"x": torch.zeros(1)}, noise_multiplier, clipping_norm)

    def clipped(self, n_batch_args: int) -> ClippedGradFn:
        """The :func:`clipped_grad` step for batches of ``n_batch_args`` arguments (made once)."""
        if n_batch_args not in self._clipped:
            first = 1 + len(self.frozen_args)
            self._clipped[n_batch_args] = clipped_grad(
                self.loss_fn, self.clipping_norm, argnums=0,
                batch_argnums=tuple(range(first, first + n_batch_args)),
                microbatch_size=self.microbatch_size, memory_budget=self.memory_budget,
                return_losses=True, options=self.options)
        return self._clipped[n_batch_args]

    def step(self, *batch: Any, epsilon: bool = True) -> StepLog:
        """One private step on ``batch`` (the batch arguments of ``loss_fn``, batch dim 0; any
        size, 0 included). ``epsilon=False`` skips computing epsilon (it is still accounted)."""
        if not batch:
            raise ValueError("DPSGD.step: no batch arguments given")
        grads, losses = self.clipped(len(batch))(self.params, *self.frozen_args, *batch)
        leaves = pytree.tree_leaves(grads)  # this step's own sums: noised and divided in place
        del grads
        std = self.noise_multiplier * self.clipping_norm
        for i, t in enumerate(self.tensors):
            g, leaves[i] = leaves[i], None
            t.grad = noised_(g, std, self.generator).div_(self.expected_batch_size).to(t.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.steps += 1
        loss = losses.float().mean().item() if losses.numel() else math.nan
        return StepLog(self.steps, int(losses.shape[0]), loss, self.epsilon() if epsilon else None)

    def epsilon(self) -> float:
        """The privacy spent so far, at ``delta``, from the accountant."""
        return self.accountant.epsilon(self.delta)


def train(dp: DPSGD, batches: Iterable[Any], steps: int | None = None, log_every: int = 1,
          log: Callable[[str], None] | None = None) -> list[StepLog]:
    """``dp.step`` on each of ``batches`` (e.g. a :func:`poisson_loader`; a tuple or list batch
    is unpacked into the batch arguments, anything else is one), at most ``steps`` of them.
    Every ``log_every`` steps and at the last, epsilon is computed and a line is logged (to
    ``log``, e.g. ``print``, or else to the ``fxmem.dpsgd`` logger at INFO). Returns the steps'
    :class:`StepLog`."""
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every <= 0:
        raise ValueError(f"train: log_every must be a positive int, got {log_every!r}")
    total = steps if steps is not None else (len(batches) if hasattr(batches, "__len__") else None)
    out: list[StepLog] = []
    for i, batch in enumerate(batches, 1):
        if steps is not None and i > steps:
            break
        last = total is not None and i == total
        args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        rec = dp.step(*args, epsilon=(i % log_every == 0 or last))
        out.append(rec)
        if rec.epsilon is not None:
            (log or log_info)(rec.line(total, dp.delta))
    return out


def log_info(line: str) -> None:
    log.info("%s", line)
