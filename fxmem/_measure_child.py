"""Run by ``fxmem.measurements`` in a fresh process: reads {"threads", "configs"} as JSON on
stdin, prints one JSON list: per config, the bytes its op allocated at its peak beyond the fresh
tensors it returned (torch only: no fxmem import, no profiler of the parent's)."""

import itertools
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def _arg(spec):
    if isinstance(spec, dict) and "shape" in spec:
        dtype = getattr(torch, spec["dtype"])
        make = torch.randn if dtype.is_floating_point else torch.zeros
        value = make(spec["shape"], dtype=dtype)
        if "stride" in spec:  # a non-contiguous layout (channels-last; stride 0: an expanded, vmapped weight)
            shape, stride = spec["shape"], spec["stride"]
            storage = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
            return make(storage, dtype=dtype).as_strided(shape, stride)  # copy_ refuses overlapping elements
        return value
    if isinstance(spec, list):
        return [_arg(s) for s in spec]
    return spec


def _flat(x):
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _flat(y)]
    return [x] if isinstance(x, torch.Tensor) else []


def transient(config) -> int:
    op = getattr(getattr(torch.ops.aten, config["op"]), config["overload"])
    args = [_arg(a) for a in config["args"]]
    op(*args)  # warm-up: oneDNN's primitive caches
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        out = op(*args)
    events = sorted((e for e in p.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    peak = max(itertools.accumulate(e.nbytes() for e in events), default=0)
    inputs = {t.untyped_storage().data_ptr() for t in _flat(args)}
    fresh = sum(t.untyped_storage().nbytes() for t in _flat(out) if t.untyped_storage().data_ptr() not in inputs)
    return max(0, peak - fresh)


def main() -> None:
    request = json.loads(sys.stdin.read())
    torch.set_num_threads(request["threads"])
    with torch.no_grad():
        print(json.dumps([transient(c) for c in request["configs"]]))


if __name__ == "__main__":
    main()
