"""The same plan without offload: what a plan with ``offload`` is compared with bit for bit."""

from __future__ import annotations

import contextlib

from ..remat import partition


@contextlib.contextmanager
def kept_on_device():
    """Compiles inside the block keep every value their plan offloads on the device: the split
    is told to offload none, so the plan (what is kept and recomputed) is the same."""
    real = partition.split
    partition.split = lambda joint, saved, input_views=True, offloaded=(), **kwargs: real(joint, saved, input_views,
                                                                                        **kwargs)
    try:
        yield
    finally:
        partition.split = real
