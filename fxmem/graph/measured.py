"""Temporaries of CPU kernels whose buffers depend on the algorithm the library picks (oneDNN's
convolutions), measured once per configuration on this machine.

oneDNN picks a layout per shape and reorders into it: a convolution's temporaries range from
nothing (1x1) to several times its output, with no formula that holds across shapes, and they
depend on the inputs' memory layout too (a depthwise 7x7 backward with a channels-last input
allocates 3x what it does on contiguous ones). So they are measured: the op at the plan shape and
strides on random data, in a fresh Python process (the allocator's
events come from the profiler, and the caller may be profiling already), every configuration of a
graph in one run, cached in memory and on disk, keyed by torch's version and the thread count
(the child process and the cache file: :mod:`fxmem.measurements`). A symbolic batch: measured at
the plan's batch and one more example; the difference is the per-example part (reorders of the
activations, scaled with the image's area at other sizes), the rest is fixed (scratchpads, weight
reorders). Convolutions whose kernel follows a
formula (:func:`fxmem.graph.scratch.conv_formula`) are not measured. ``FXMEM_MEASURE_SCRATCH=0`` turns it off
(counted as 0).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from .. import measurements
from .sizes import dim_expr

log = logging.getLogger("fxmem")
aten = torch.ops.aten
MEASURED = {aten.convolution.default, aten.convolution_backward.default,
            # the interpolations the eager inner compiler keeps as eager's kernels (fxmem.inner.eager_kernels):
            # their CPU kernels copy a non-contiguous argument (a gradient sliced out of a concatenation's)
            *(getattr(aten, f"{name}{part}").default for name in ("upsample_linear1d", "upsample_bilinear2d",
                                                                   "upsample_trilinear3d", "upsample_bicubic2d")
              for part in ("", "_backward"))}


def _hint(d) -> int:
    if isinstance(d, torch.SymInt):
        return int(d.node.hint if d.node.hint is not None else d.node.shape_env.size_hint(d.node.expr))
    return int(d)


def value_of(a: Any) -> Any:
    """A call's argument as a value: a graph node's (fake) value, anything else as it is."""
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _spec(a: Any, batch: Any = None, extra: int = 0) -> Any:
    """An argument as JSON: a tensor as its shape and dtype at the plan shape (``extra`` more
    examples where its first dimension is the symbolic ``batch``)."""
    a = value_of(a)
    if isinstance(a, torch.Tensor):
        shape = [_hint(d) for d in a.shape]
        if extra and a.dim() and _same_symbol(a.shape[0], batch):
            shape[0] += extra
        spec = {"shape": shape, "dtype": str(a.dtype).removeprefix("torch.")}
        if not a.is_contiguous():  # a layout oneDNN reorders from (channels-last: ConvNeXt's depthwise convs)
            spec["stride"] = [_hint(d) for d in a.stride()]
        return spec
    if isinstance(a, (list, tuple)):
        return [_spec(x, batch, extra) for x in a]
    if isinstance(a, torch.SymInt):
        return _hint(a)
    return a


def _same_symbol(d: Any, batch: Any) -> bool:
    return isinstance(d, torch.SymInt) and isinstance(batch, torch.SymInt) and d.node.expr == batch.node.expr


def _batch(args: Sequence) -> torch.SymInt | None:
    """The call's symbolic batch (its first argument's first dimension), None when static."""
    first = value_of(args[0]) if args else None
    batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else None
    return batch if isinstance(batch, torch.SymInt) and _hint(batch) > 0 else None


def _config(target, args: Sequence, extra: int = 0) -> tuple[str, Any] | None:
    """(cache key, JSON config) of a call on CPU tensors (``extra`` more examples in its batch),
    else None."""
    first = value_of(args[0]) if args else None
    if not (isinstance(first, torch.Tensor) and first.device.type == "cpu"):
        return None
    batch = _batch(args)
    config = {"op": target._schema.name.split("::")[1], "overload": target._overloadname,
              "args": [_spec(a, batch, extra) for a in args]}
    key = json.dumps([torch.__version__, torch.get_num_threads(), config], sort_keys=True)
    return key, config


# A measurement is trusted up to PLAUSIBLE_RATIO times the bytes of its op's own tensors (arguments
# and results) plus PLAUSIBLE_SLACK; a cache entry above that is corrupt and measured again. Why so
# much: oneDNN's largest temporary is an im2col/col2im buffer, a tensor times the kernel's area
# (31x31 = 961 in the largest-kernel CNNs), reorders are 1-6x a tensor, and per-thread scratchpads
# have a fixed size (measured: 0.02-2.6x on the tests' shape classes, up to 32x and 2 MB on tiny
# tensors, the slack's case). 2**50 bytes on a 40 kB convolution is far outside.
PLAUSIBLE_RATIO = 1024
PLAUSIBLE_SLACK = 64 * 2**20


def _meta(spec: Any) -> Any:
    """A config's argument (see :func:`_spec`) as a meta tensor, or as it is."""
    if isinstance(spec, dict) and "shape" in spec:
        t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device="meta")
        return t.as_strided(spec["shape"], spec["stride"]) if "stride" in spec else t
    return [_meta(s) for s in spec] if isinstance(spec, list) else spec


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(map(_nbytes, x)) if isinstance(x, (list, tuple)) else 0


def plausible_max(key: str) -> int | None:
    """The most temporary bytes a measurement of the cache key ``key`` may hold: PLAUSIBLE_RATIO
    times its op's tensors (the results on the meta device) plus PLAUSIBLE_SLACK; None when the
    key is not one of :func:`_config`'s (never looked up)."""
    try:
        config = json.loads(key)[2]
        op = getattr(getattr(aten, config["op"]), config["overload"])
        args = [_meta(a) for a in config["args"]]
    except Exception:  # noqa: BLE001 - a key of another format or torch version: not ours to judge
        return None
    try:
        out = op(*args)
    except Exception:  # noqa: BLE001 - an op without a meta kernel: its arguments alone
        out = None
    return PLAUSIBLE_RATIO * (_nbytes(args) + _nbytes(out)) + PLAUSIBLE_SLACK


@functools.cache
def known() -> dict[str, int]:
    """The measurements of this process: the disk cache's plausible entries, then what it
    measures (a cache of machine facts, not of compile results: the same for every compile)."""
    path = measurements.cache_file()
    found = measurements.read(path)
    limits = {k: plausible_max(k) for k in found}
    bad = [k for k, v in found.items() if limits[k] is not None and v > limits[k]]
    if bad:
        key = bad[0]
        log.warning("fxmem: ignoring %d implausible entr%s of the kernel measurement cache %s (e.g. %d bytes "
                    "of temporaries for an aten.%s call; allowed: at most %d, %dx its tensors' bytes + %d MiB); "
                    "measured again", len(bad), "y" if len(bad) == 1 else "ies", path, found[key],
                    json.loads(key)[2]["op"], limits[key], PLAUSIBLE_RATIO, PLAUSIBLE_SLACK >> 20)
    return {k: v for k, v in found.items() if k not in bad}


def measured_scratch(target, args: Sequence, kwargs: dict, out: Any,
                     covered: Callable[[Any, Sequence], bool] | None = None) -> sympy.Expr:
    """Temporary bytes of a :data:`MEASURED` op on CPU, measured (and, for a call in a graph,
    every other such call of that graph with it that ``covered`` does not say a formula covers)."""
    if kwargs or not measurements.enabled():
        return sympy.Integer(0)
    found = _configs(target, args)
    if not found:
        return sympy.Integer(0)
    if any(key not in known() for key in found):
        graph = next((a.graph for a in args if isinstance(a, fx.Node)), None)
        calls = ([(n.target, n.args) for n in graph.nodes if n.target in MEASURED
                  and not (covered and covered(n.target, n.args))] if graph else [(target, args)])
        todo = {k: c for t, a in calls for k, c in _configs(t, a).items() if k not in known()}
        known().update(measurements.measure({**{k: c for k, c in found.items() if k not in known()}, **todo}))
    at, *more = (sympy.Integer(known()[key]) for key in found)
    if more:  # a symbolic batch: the line through the plan's batch and one more example
        batch, per_example = _batch(args), more[0] - at
        fixed = at - per_example * _hint(batch)
        return sympy.Max(0, fixed + per_example * dim_expr(batch) * _area_ratio(args))
    return at


def _area_ratio(args: Sequence) -> sympy.Expr:
    """The call's first argument's spatial size (its dimensions after batch and channels) over
    that size at the plan shape: per-example reorders grow with the image."""
    first = value_of(args[0])
    dims = list(first.shape[2:]) if isinstance(first, torch.Tensor) else []
    plan = 1
    for d in dims:
        plan *= _hint(d)
    return sympy.Mul(*[dim_expr(d) for d in dims], sympy.Integer(1)) / plan if plan else sympy.Integer(1)


def _configs(target, args: Sequence) -> dict[str, Any]:
    """The configurations measured for a call: at the plan shape, and, where its batch is
    symbolic, with one more example (oneDNN's reorders and scratchpads are partly per example,
    partly fixed: a ResNet's strided convolutions)."""
    found = [_config(target, args)] + ([_config(target, args, extra=1)] if _batch(args) is not None else [])
    return dict(c for c in found if c is not None)
