"""Which model a compiled graph belongs to: weak references to its example inputs.

Reports are matched to a model by its parameters, which Dynamo passes to the backend as example
inputs. Ids alone are not enough: Python reuses an id once the object is freed, so a graph of a
model long gone would match a new model's parameter.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch


class Inputs:
    def __init__(self, tensors: Iterable[Any] = ()):
        self._refs = {id(t): weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor)}

    def __and__(self, ids: set[int]) -> set[int]:
        """The ids in ``ids`` of inputs that are still alive (so the ids are still theirs)."""
        return {i for i, r in self._refs.items() if i in ids and r() is not None}
