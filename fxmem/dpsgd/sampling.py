"""Poisson sampling for DP-SGD: every example joins a step's batch independently with probability
``sample_rate``, so batch sizes vary (0 included), as the privacy accounting assumes.

    loader = poisson_loader(dataset, expected_batch_size=32, steps=300)   # a torch DataLoader
    loader = poisson_loader(my_loader)                  # a user's DataLoader: same dataset, collate,
                                                        # workers; expected batch = its batch_size
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

__all__ = ["PoissonSampler", "poisson_loader"]


class PoissonSampler(Sampler[list[int]]):
    """A batch sampler: ``steps`` batches, each holding every index of ``range(num_samples)``
    independently with probability ``sample_rate`` (in index order). ``steps`` defaults to one
    epoch in expectation, ``round(1 / sample_rate)``. ``generator`` makes the draws
    reproducible."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f"PoissonSampler: num_samples must be a positive int, got {num_samples!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise ValueError(f"PoissonSampler: sample_rate must be a number in (0, 1], got {sample_rate!r}")
        if steps is None:
            steps = max(1, round(1 / sample_rate))
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"PoissonSampler: steps must be an int >= 0, got {steps!r}")
        self.num_samples, self.sample_rate, self.steps = num_samples, float(sample_rate), steps
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()


def _empty_safe(collate: Callable, dataset: Dataset) -> Callable:
    """``collate`` that turns an empty batch into the collated first example cut to 0 rows (the
    right types and shapes for the step), since collate functions cannot collate nothing."""
    def collate_fn(batch: list) -> Any:
        if batch:
            return collate(batch)
        one = collate([dataset[0]])
        return pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)
    return collate_fn


def poisson_loader(data: Dataset | DataLoader, expected_batch_size: int | None = None, *,
                   steps: int | None = None, generator: torch.Generator | None = None,
                   sample_rate: float | None = None, **loader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` over ``data`` (a map-style dataset, or a user's ``DataLoader``, whose
    dataset, collate function, workers and pin_memory it keeps) whose batches are Poisson
    samples of expected size ``expected_batch_size`` (default: the user loader's batch_size),
    or with probability ``sample_rate`` per example (instead of ``expected_batch_size``).
    Its ``batch_sampler`` is the :class:`PoissonSampler`; ``sample_rate`` is on it."""
    if sample_rate is not None and expected_batch_size is not None:
        raise ValueError("poisson_loader: give expected_batch_size or sample_rate, not both")
    if isinstance(data, DataLoader):
        src = data
        dataset = src.dataset
        if expected_batch_size is None and sample_rate is None:
            expected_batch_size = src.batch_size
        loader_kwargs = dict(num_workers=src.num_workers, pin_memory=src.pin_memory,
                             collate_fn=src.collate_fn, **loader_kwargs)
    else:
        dataset = data
    if expected_batch_size is None and sample_rate is None:
        raise ValueError("poisson_loader: expected_batch_size is needed (a DataLoader without "
                         "batch_size, or a dataset, has none)")
    try:
        n = len(dataset)
    except TypeError:
        raise ValueError("poisson_loader: the dataset must have a length (a map-style dataset)") from None
    if sample_rate is None:
        if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, int) or \
                not 0 < expected_batch_size <= n:
            raise ValueError(f"poisson_loader: expected_batch_size must be an int in [1, {n}] (the dataset's "
                             f"size), got {expected_batch_size!r}")
        sample_rate = expected_batch_size / n
    sampler = PoissonSampler(n, sample_rate, steps, generator)  # checks sample_rate
    collate = loader_kwargs.pop("collate_fn", None) or default_collate
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=_empty_safe(collate, dataset), **loader_kwargs)
