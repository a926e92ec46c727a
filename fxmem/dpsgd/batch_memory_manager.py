"""``BatchMemoryManager``: Opacus' ``opacus.utils.batch_memory_manager.BatchMemoryManager`` on
fxmem's private optimizer. A logical (Poisson) batch runs as physical batches of at most
``max_physical_batch_size`` examples; their clipped per-example sums add up on ``.grad`` and
one noisy, accounted step is taken per logical batch::

    model, optimizer, loader = PrivacyEngine().make_private(module=model, optimizer=optimizer,
                                                            data_loader=loader, ...)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=optimizer) as physical:
        for x, y in physical:                 # at most 8 examples each
            optimizer.zero_grad()             # kept inside a logical batch
            criterion(model(x), y).backward()
            optimizer.step()                  # noise, step and accounting once per logical batch

As Opacus': the loader's batch sampler is wrapped so that each logical batch's indices are cut
into ``ceil(n / max_physical_batch_size)`` near-equal pieces (``numpy.array_split``'s sizes);
before emitting a piece it tells the optimizer (``signal_skip_step``) whether the step after
that piece ends the logical batch. An empty logical batch is one empty physical batch (a
step). fxmem's chunks already bound the per-example memory of one ``backward()``
(``microbatch_size``); this bounds the forward that computes the loss as well.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy
from torch.utils.data import BatchSampler, DataLoader, Sampler

from .private import DPOptimizer
from .sampling import PoissonSampler

__all__ = ["BatchMemoryManager", "BatchSplittingSampler", "wrap_data_loader"]


def _split(indices: list[int], max_batch_size: int) -> list[list[int]]:
    """``indices`` in ``ceil(n / max_batch_size)`` near-equal pieces (Opacus' cut)."""
    return [piece.tolist() for piece in numpy.array_split(indices, math.ceil(len(indices) / max_batch_size))]


class BatchSplittingSampler(Sampler[list[int]]):
    """The batch sampler ``sampler``'s logical batches in physical pieces of at most
    ``max_batch_size`` indices, signalling ``optimizer`` before each piece whether its step is
    skipped (not the logical batch's last piece)."""

    def __init__(self, *, sampler: Sampler[list[int]], max_batch_size: int, optimizer: DPOptimizer):
        self.sampler, self.max_batch_size, self.optimizer = sampler, max_batch_size, optimizer

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler:
            if len(batch) == 0:
                self.optimizer.signal_skip_step(do_skip=False)
                yield []
                continue
            pieces = _split(list(batch), self.max_batch_size)
            for piece in pieces[:-1]:
                self.optimizer.signal_skip_step(do_skip=True)
                yield piece
            self.optimizer.signal_skip_step(do_skip=False)
            yield pieces[-1]

    def __len__(self) -> int:
        """Expected number of physical batches (Opacus' estimate)."""
        if isinstance(self.sampler, BatchSampler):
            return math.ceil(len(self.sampler) * self.sampler.batch_size / self.max_batch_size)
        if isinstance(self.sampler, PoissonSampler):
            expected = self.sampler.sample_rate * self.sampler.num_samples
            return math.ceil(len(self.sampler) * expected / self.max_batch_size)
        return len(self.sampler)


def wrap_data_loader(*, data_loader: DataLoader, max_batch_size: int, optimizer: DPOptimizer) -> DataLoader:
    """A new ``DataLoader`` over the same dataset, collate function and workers whose batch
    sampler is ``data_loader.batch_sampler`` split by :class:`BatchSplittingSampler`."""
    return DataLoader(
        dataset=data_loader.dataset,
        batch_sampler=BatchSplittingSampler(sampler=data_loader.batch_sampler, max_batch_size=max_batch_size,
                                            optimizer=optimizer),
        num_workers=data_loader.num_workers, collate_fn=data_loader.collate_fn,
        pin_memory=data_loader.pin_memory, timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn, multiprocessing_context=data_loader.multiprocessing_context,
        generator=data_loader.generator, prefetch_factor=data_loader.prefetch_factor,
        persistent_workers=data_loader.persistent_workers)


class BatchMemoryManager:
    """Opacus' context manager, same signature: ``with BatchMemoryManager(data_loader=,
    max_physical_batch_size=, optimizer=) as loader`` gives a loader of physical batches of at
    most ``max_physical_batch_size`` examples; ``optimizer`` (the :class:`DPOptimizer` that
    ``make_private`` returned) skips the step, the noise and the accounting until the logical
    batch is complete, and ``.grad`` then holds the logical batch's clipped sum / expected
    batch size. ``data_loader`` is not modified. Not under ``torch.distributed`` (fxmem
    all-reduces in each ``backward()``; ranks' Poisson batches split into different numbers
    of physical batches)."""

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: DPOptimizer):
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError("BatchMemoryManager: optimizer must be the DPOptimizer fxmem's make_private "
                             f"returned, got {type(optimizer).__name__}")
        if not isinstance(data_loader, DataLoader) or data_loader.batch_sampler is None:
            raise ValueError("BatchMemoryManager: data_loader must be a torch DataLoader with a batch sampler "
                             f"(the one make_private returned), got {data_loader!r}")
        if isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int) \
                or max_physical_batch_size <= 0:
            raise ValueError("BatchMemoryManager: max_physical_batch_size must be a positive int, got "
                             f"{max_physical_batch_size!r}")
        if optimizer.module.dist is not None:
            raise NotImplementedError("BatchMemoryManager under torch.distributed: fxmem all-reduces the "
                                      "clipped sums in every backward(), and ranks' Poisson batches split "
                                      "into different numbers of physical batches")
        self.data_loader, self.optimizer = data_loader, optimizer
        self.max_physical_batch_size = max_physical_batch_size

    def __enter__(self) -> DataLoader:
        return wrap_data_loader(data_loader=self.data_loader, max_batch_size=self.max_physical_batch_size,
                                optimizer=self.optimizer)

    def __exit__(self, exc_type, exc, tb) -> None:
        # Signals a loop left early had queued (loader workers run ahead) would skip later steps.
        self.optimizer._step_skip_queue.clear()
