"""``python -m fxmem estimate``: will a model's training step fit a device, before running it.

The model is built from a Hugging Face ``config.json`` (or by a ``module:function`` of the
user's) on the meta device: no weights are allocated, nothing is downloaded. Each level is
planned by :func:`fxmem.explain` (``dynamic=True``), the planner and step simulator of a real
compile; a model deeper than :data:`PROBES` allows is planned at two small depths and
extrapolated (:func:`fxmem.explain_layers`). Printed per level: the predicted step peak (the
step's activations, gradients and buffers), the resident bytes (weights and optimizer state,
alive across steps) and the largest batch whose step fits the device beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from .options import parse_bytes
from .report.render import human

LEVELS = (0, 1, 2)
PROBES = (2, 3)  # depths planned for deeper models (the line through them gives the real depth)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZERS = {"adamw": "adamw", "sgd": "sgd", "none": None}


CPU_PROBE_LIMIT = 2 * 2**30  # weights of a probe that may run on CPU (a model with dropout, see plan_device)


@dataclass
class Spec:
    """How to build the model at a depth and what one training step's inputs are."""
    build: Callable[[int | None, str], torch.nn.Module]  # (depth or None: as configured, device) -> model
    layers: int | None  # the configured depth, None when it cannot be changed (a module:function)
    name: str
    positions: int | None = None  # the longest sequence the model takes (the config's max_position_embeddings)


def step_inputs(model: torch.nn.Module, batch: int, seq: int, dtype: torch.dtype,
                device: str = "meta") -> dict[str, torch.Tensor]:
    """A training batch for an HF-style model: ``input_ids`` and ``labels`` (token labels for
    language models, one class per example for classifiers), or ``pixel_values`` and class
    labels for vision models; random on a real device, empty on meta."""
    cfg = getattr(model, "config", None)
    main = getattr(model, "main_input_name", "input_ids")
    classes = getattr(cfg, "num_labels", 2)
    labels = torch.randint(0, classes, (batch,), device=device)
    if main == "pixel_values":
        size = getattr(cfg, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        x = torch.randn(batch, getattr(cfg, "num_channels", 3), h, w, dtype=dtype, device=device)
        return {"pixel_values": x, "labels": labels}
    if main == "input_features":  # speech encoder-decoders (Whisper): log-mel frames of the config's length
        frames = 2 * getattr(cfg, "max_source_positions", 1500)  # the encoder's two strided convolutions halve it
        x = torch.randn(batch, getattr(cfg, "num_mel_bins", 80), frames, dtype=dtype, device=device)
        tokens = torch.randint(0, getattr(cfg, "vocab_size", 2), (batch, seq), device=device)
        return {"input_features": x, "labels": tokens}
    if main != "input_ids":
        raise ValueError(f"estimate: the model's main input is {main!r}; allowed: input_ids (text), pixel_values "
                         "(vision) or input_features (speech, e.g. Whisper)")
    ids = torch.randint(0, getattr(cfg, "vocab_size", 2), (batch, seq), device=device)
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    # token labels are a tensor of their own, as a data loader gives them (one tensor passed as
    # both would be one graph input, named after whichever the model reads first)
    return {"input_ids": ids, "labels": labels if classifier else ids.clone()}


def plan_device(model: torch.nn.Module) -> str:
    """Where to plan ``model`` (built on meta): "meta", or "cpu" when it has active dropout, which
    the planner cannot replay on the meta device (it reads the device's generator state)."""
    cfg = getattr(model, "config", None)
    config_drop = cfg is not None and any("drop" in k and isinstance(v, float) and v > 0 for k, v in vars(cfg).items())
    module_drop = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    if not (config_drop or module_drop):
        return "meta"
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if weights > CPU_PROBE_LIMIT:
        raise ValueError(f"estimate: the model has dropout, which fxmem plans only on a real device, and its "
                         f"{weights / 2**30:.1f} GiB probe is too big for this machine's CPU; set the config's "
                         "dropout probabilities to 0 to estimate without dropout masks")
    return "cpu"


def _hf_class(config: Any) -> type:
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModelForMaskedLM",
                 "AutoModelForImageClassification", "AutoModelForSequenceClassification"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(f"estimate: no trainable head for model_type {config.model_type!r}; name one in the config's "
                     "\"architectures\" (e.g. LlamaForCausalLM) or pass a module:function that builds the model")


def _depth_attr(config: Any) -> str | None:
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, attr, None), int):
            return attr
    return None


def hf_spec(path: str, dtype: torch.dtype) -> Spec:
    """A model from an HF ``config.json`` (a file, or a folder holding one)."""
    import copy

    import transformers

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"estimate: no such config file: {file}")
    with open(file) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"estimate: {file} is not JSON ({e})") from None
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"estimate: {file} needs a \"model_type\" that transformers knows (llama, gpt2, bert, vit, "
                         f"...), got {model_type!r}")
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as e:  # noqa: BLE001 - a value transformers refuses (its validators raise their own types)
        raise ValueError(f"estimate: transformers cannot build a {model_type} config from {file}: {_complaint(e)}") \
            from None
    config.use_cache = False  # training: no KV cache (it also trips Dynamo on the meta device)
    cls, attr = _hf_class(config), _depth_attr(config)
    if cls.__name__.endswith("ForSequenceClassification") or cls.__name__.endswith("ForImageClassification"):
        config.problem_type = "single_label_classification"  # set on the first call otherwise: a recompile

    def build(depth: int | None, device: str = "meta") -> torch.nn.Module:
        cfg = copy.deepcopy(config)
        if depth is not None:
            setattr(cfg, attr, depth)
        with torch.device(device):
            torch.manual_seed(0)
            try:
                model = cls(cfg)
            except Exception as e:  # noqa: BLE001 - e.g. a negative size: torch refuses the layer's tensor
                raise ValueError(f"estimate: transformers cannot build {cls.__name__} from {file}: "
                                 f"{_complaint(e)}") from None
            model = model.to(dtype)
        if hasattr(model, "loss_type"):
            model.loss_type = getattr(cfg, "loss_type", None) or _loss_type(cls)
        return model.train()

    positions = next((v for k in ("max_position_embeddings", "n_positions", "max_target_positions")
                      if isinstance(v := getattr(config, k, None), int) and v > 0), None)
    return Spec(build, getattr(config, attr) if attr else None, f"{cls.__name__} ({os.path.basename(file)})",
                positions)


def _complaint(e: BaseException) -> str:
    """The library's own message, on one line: the innermost cause's (validators wrap theirs)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return " ".join(str(e).split()) or type(e).__name__


def _loss_type(cls: type) -> str | None:
    """HF models log (and Dynamo graph-breaks) when ``loss_type`` is unset: name it up front."""
    name = cls.__name__
    for suffix, loss in (("ForCausalLM", "ForCausalLM"), ("ForMaskedLM", "ForMaskedLM"),
                         ("ForSequenceClassification", "ForSequenceClassification"),
                         ("ForImageClassification", "ForImageClassification")):
        if name.endswith(suffix):
            return loss
    return None


def function_spec(target: str, dtype: torch.dtype) -> Spec:
    """A model from ``module:function``: the function takes no arguments and returns an
    ``nn.Module`` taking HF-style inputs (built on any device: each plan calls it and moves the
    result to the meta device); its depth is planned as it is (no extrapolation)."""
    module_name, _, fn_name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"estimate: cannot import {target} ({e})") from None
    made = fn()  # checked once; each plan builds its own
    if not isinstance(made, torch.nn.Module):
        raise ValueError(f"estimate: {target}() returned a {type(made).__name__}; it must return a torch.nn.Module")

    def build(depth: int | None, device: str = "meta") -> torch.nn.Module:
        return fn().to(device=device, dtype=dtype).train()  # a fresh one: moving to meta drops the weights

    return Spec(build, None, target)


def spec_for(source: str, dtype: torch.dtype) -> Spec:
    if source.endswith(".json") or os.path.isdir(source):
        return hf_spec(source, dtype)
    if ":" in source:
        return function_spec(source, dtype)
    raise ValueError(f"estimate: {source!r} is neither a config.json (or a folder holding one) nor module:function")


def plan(spec: Spec, level: int, batch: int, seq: int, dtype: torch.dtype, log: Callable[[str], None],
         in_backward: str | None = None, offload: bool = False) -> Any:
    """The report of ``level``'s plan (a ``LayerScaledReport`` for models deeper than the probes);
    ``in_backward``: the optimizer (an ``OPTIMIZERS`` name) whose step runs in the backward
    (``step_in_backward``): its gradients die where they are made; ``offload``: the level's plan
    with saved values in host memory where that lowers the peak (the ``offload`` option)."""
    import fxmem

    options: dict[str, Any] = {"inner": "eager", "level": level, "offload": offload}
    if in_backward is not None:
        stepper = _in_backward_optimizer(in_backward)
        options["step_in_backward"] = stepper
        spec = replace(spec, build=_stepped(spec.build, stepper))
    plan_batch = _plan_batch(batch, seq, spec)
    deep = spec.layers is not None and spec.layers > 2 * PROBES[1]  # else one compile costs less than two
    device = plan_device(spec.build(PROBES[1] if deep else None, "meta"))
    where = "" if device == "meta" else " on CPU (dropout)"
    if deep:
        a, b = PROBES
        log(f"level {level}: planning {a} and {b} of {spec.layers} layers{where}, extrapolating; {a} layers first")

        def build(k: int) -> torch.nn.Module:
            return spec.build(k, device)

        def progress(depth: int, seconds: float) -> None:
            if depth == a:  # a compile's time grows with the layers traced: b / a of this one next
                log(f"level {level}: {a} layers planned in {seconds:.0f} s; {b} layers next, about "
                    f"{seconds * b / a:.0f} s")

        batch_ = step_inputs(spec.build(a, "meta"), plan_batch, seq, dtype, device)
        return fxmem.explain_layers(build, spec.layers, options, PROBES, progress, **batch_)
    log(f"level {level}: planning the whole model{where}")
    model = spec.build(None, device)
    return fxmem.explain(model, options, **step_inputs(model, plan_batch, seq, dtype, device))


def _plan_batch(batch: int, seq: int, spec: Spec) -> int:
    """The batch to plan at: ``batch``, but at least 2 (Dynamo specializes a batch of 1: no batch
    symbol to scale with) and unlike every other input dimension (Dynamo gives equal sizes one
    symbol: a batch equal to the sequence length would scale both)."""
    sample = step_inputs(spec.build(1 if spec.layers else None, "meta"), 2, seq, torch.float32)
    others = {d for t in sample.values() for d in t.shape[1:]}
    planned = max(batch, 2)
    while planned in others:
        planned += 1
    return planned


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` on the meta device as on a real one. Torch picks its
    fused kernel by the device's type and the meta device has none, so a plan on meta would get
    the math path: the [batch, heads, length, length] scores and probabilities saved for the
    backward, which no real device keeps. Inside this context a call on meta tensors that the CPU
    would run fused runs the CPU's flash kernel (its meta kernel: the output and the row
    log-sum-exp, kept for the backward, as the CUDA flash and efficient kernels keep them); any
    other call is torch's own."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type == "meta" and cpu_runs_flash(query, key, value, attn_mask, dropout_p, enable_gqa):
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch does: an additive mask
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def composite_autograd_on_meta() -> Iterator[None]:
    """Gradients through torch's composite ops on the meta device under tracing. About a hundred
    aten ops (``nll_loss``, ``where.ScalarOther``, ``var``, ``dropout``, ...) have a Python meta
    kernel beside their composite definition; tracing enables torch's Python dispatcher, which
    then finds a meta kernel and no autograd one, and backpropagates nothing through them
    (torch warns "an autograd kernel was not registered"): a plan on meta would miss the loss's
    and the masks' backward. Inside this context those Python meta kernels are set aside, so
    the composite definition runs (its ops have meta kernels and derivatives)."""
    from torch._C import DispatchKey

    ops = _meta_over_composite()
    kernels = {op: op.py_kernels.pop(DispatchKey.Meta) for op in ops if DispatchKey.Meta in op.py_kernels}
    for op in kernels:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in kernels.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


@functools.cache
def _meta_over_composite() -> tuple:
    """The aten overloads with a Python meta kernel and a composite (implicit autograd) one."""
    import torch._meta_registrations  # noqa: F401 - registers them
    from torch._C import DispatchKey

    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            if DispatchKey.Meta in op.py_kernels and torch._C._dispatch_has_kernel_for_dispatch_key(
                    op.name(), "CompositeImplicitAutograd"):
                found.append(op)
    return tuple(found)


_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _flash_takes_3d() -> bool:
    """Whether this torch's CPU runs unbatched ([heads, length, dim]) attention with its flash
    kernel: torch 2.14 does, 2.13 does not. Asked once, at import (not while Dynamo traces)."""
    try:
        from torch.nn.attention import SDPBackend

        q = torch.zeros(2, 4, 16)
        return SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, False)) == SDPBackend.FLASH_ATTENTION
    except Exception:  # noqa: BLE001 - a torch without the query: the 4-d rule alone
        return False


_FLASH_3D = _flash_takes_3d()


def cpu_runs_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, enable_gqa: bool) -> bool:
    """Whether torch 2.13's CPU runs ``F.scaled_dot_product_attention`` of these arguments with
    its flash kernel (``torch._fused_sdp_choice`` on CPU; tests/test_estimate.py checks the two
    agree over a grid): [batch, heads, length, dim] inputs (or [heads, length, dim] where this
    torch takes those: 2.14) of one float dtype, one head size, no
    dropout, as many query heads as key heads (or a multiple, with ``enable_gqa``), a 2-d or 4-d
    mask, bool or of the inputs' dtype, without a gradient (T5's position bias has one: math path;
    a True answer always agrees with torch's). Plain Python
    over shapes and dtypes, so that Dynamo traces it."""
    dims = {t.dim() for t in (query, key, value)}
    if not (dims == {4} or (dims == {3} and _FLASH_3D)) or query.dtype not in _FLASH_DTYPES:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or dropout_p != 0:
        return False
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or key.shape[-3] != value.shape[-3]:
        return False
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return False
    return attn_mask is None or (attn_mask.dtype in (torch.bool, query.dtype) and attn_mask.dim() in (2, 4)
                                 and not attn_mask.requires_grad)


def _in_backward_optimizer(name: str) -> torch.optim.Optimizer:
    """An optimizer of kind ``name`` to which each model planned adds its parameters (its step
    never runs: the plan only counts where the gradients die and the step's temporaries)."""
    if OPTIMIZERS.get(name) is None:
        raise ValueError(f"estimate: --step-in-backward needs an optimizer; --optimizer is {name!r}, allowed: "
                         f"{', '.join(k for k, v in OPTIMIZERS.items() if v)}")
    seed = [torch.nn.Parameter(torch.zeros(1, device="meta"))]
    return torch.optim.AdamW(seed) if name == "adamw" else torch.optim.SGD(seed, lr=0.0)


def _stepped(build: Callable[..., torch.nn.Module], opt: torch.optim.Optimizer) -> Callable[..., torch.nn.Module]:
    """``build`` whose models' parameters join ``opt`` (one param group per model)."""
    def built(*args: Any) -> torch.nn.Module:
        model = build(*args)
        opt.add_param_group({"params": [p for p in model.parameters() if p.requires_grad]})
        return model
    return built


def _shapes(inputs: dict[str, torch.Tensor], batch: int) -> dict[str, tuple]:
    """The shapes at ``batch`` of the inputs whose sizes the step's memory depends on (what
    ``predict_peak`` takes): the main input, and a speech model's token labels."""
    names = [n for n in ("input_ids", "pixel_values", "input_features") if n in inputs]
    names += ["labels"] if "input_features" in inputs else []
    return {n: (batch, *inputs[n].shape[1:]) for n in names}


def sequence_input(shapes: dict[str, tuple]) -> str | None:
    """The input whose dimension 1 is ``--seq``: the tokens (a speech model's labels); None for images."""
    return "input_ids" if "input_ids" in shapes else "labels" if "labels" in shapes else None


def describe(shapes: dict[str, tuple]) -> str:
    """The step's input as a person reads it: ``sequence 512``, ``images 3x224x224``, or a speech
    model's ``audio features 80x3000 ..., labels sequence 64``."""
    if "input_ids" in shapes:
        return f"sequence {shapes['input_ids'][1]}"
    if "input_features" in shapes:
        return (f"audio features {'x'.join(map(str, shapes['input_features'][1:]))} (the config's num_mel_bins and "
                f"2 x max_source_positions), labels sequence {shapes['labels'][1]}")
    return f"images {'x'.join(map(str, shapes['pixel_values'][1:]))} (the config's image_size and num_channels)"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def estimate(source: str, batch: int, seq: int = 512, levels=(1,), device: str | int | None = None,
             optimizer: str = "adamw", dtype: str = "fp32", log: Callable[[str], None] = lambda s: None,
             step_in_backward: bool = False, offload: bool = False) -> dict:
    """Predicted step peak, resident bytes and, given ``device``, the largest fitting batch at
    ``seq``, what stops the next batch (:func:`limit`) and the largest sequence at ``batch``
    (text models) per level (see the module docstring); with ``offload``, each level's plan with
    offload and the host bytes its step holds (``host_bytes``; the peaks are the device's); the
    dict ``--json`` prints, plus ``"reports"`` (level -> report) for plotting."""
    if dtype not in DTYPES:
        raise ValueError(f"estimate: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"estimate: optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"estimate: levels must be some of {LEVELS}, got {levels!r}")
    if not (isinstance(batch, int) and batch >= 1 and isinstance(seq, int) and seq >= 1):
        raise ValueError(f"estimate: batch and seq must be positive integers, got {batch!r} and {seq!r}")
    cap = parse_bytes(device, "device") if device is not None else None
    torch_dtype, opt = DTYPES[dtype], OPTIMIZERS[optimizer]
    spec = spec_for(source, torch_dtype)
    sample = step_inputs(spec.build(1 if spec.layers else None, "meta"), 2, seq, torch_dtype)  # a bad config fails here
    shapes = _shapes(sample, batch)
    tokens = sequence_input(shapes)

    def shapes_at(b: int) -> dict[str, tuple]:
        return {name: (b, *dims[1:]) for name, dims in shapes.items()}
    log(f"{spec.name}: batch {batch}, {describe(shapes)}, {dtype}, optimizer {optimizer}; "
        f"{len(levels)} level{'s' if len(levels) > 1 else ''} to plan ({', '.join(map(str, levels))})")
    out: dict[str, Any] = {"peak_bytes": {}, "resident_bytes": None, "max_batch": {}, "limit": {}, "max_seq": {},
                           "host_bytes": {}, "reports": {}}
    took: list[float] = []
    for i, level in enumerate(levels):
        started = time.monotonic()
        with warnings.catch_warnings():  # kept as a safety net: composite_autograd_on_meta removes the cause
            warnings.filterwarnings("ignore", message=r"aten::\w+: an autograd kernel was not registered")
            # floats (a norm's eps) as constants, as a static compile has them: dynamic=True would
            # make a module's float attribute a graph input, which no lowering can take as its eps
            with fused_attention_on_meta(), composite_autograd_on_meta(), \
                    torch._dynamo.config.patch(specialize_float=True):
                rep = plan(spec, level, batch, seq, torch_dtype, log, optimizer if step_in_backward else None, offload)
        key = str(level)
        out["reports"][key] = rep
        out["peak_bytes"][key] = rep.predict_peak(**shapes)
        if offload:
            out["host_bytes"][key] = rep.host_bytes(**shapes)
        out["resident_bytes"] = rep.resident_bytes(opt)
        if cap is not None:
            best = rep.max_batch(cap, optimizer=opt, **shapes_at(1))  # (dimension 0 replaced by each batch)
            out["max_batch"][key] = best
            out["limit"][key] = limit(rep, cap, out["resident_bytes"], best, shapes_at)
            if tokens is not None:
                out["max_seq"][key] = max_seq(rep, cap, out["resident_bytes"], shapes, tokens, spec.positions)
        took.append(time.monotonic() - started)
        left = len(levels) - i - 1
        log(f"level {level}: planned in {_seconds(took[-1])}"
            + (f"; {left} level{'s' if left > 1 else ''} left, about {_seconds(left * sum(took) / len(took))}"
               if left else ""))
    out["shapes"] = shapes
    return out


def limit(rep: Any, cap: int, resident: int, best: int, shapes_at: Callable[[int], dict]) -> dict:
    """What stops the batch after ``best`` (the largest that fits) from fitting: the bytes it
    needs and how far over ``cap`` they are, the bytes each example adds there, and the predicted
    peak's phase, the op whose allocation reaches it and the largest values alive then (with
    the modules that made them): ``{"batch", "needs", "over", "per_example", "phase", "at",
    "module", "live": [[name, bytes, module], ...]}``."""
    over = best + 1
    peak = rep.predict_peak(**shapes_at(over))
    before = rep.predict_peak(**shapes_at(best)) if best >= 1 else 0
    breakdown = rep.peak_breakdown(**shapes_at(over))
    owners = rep.owners()
    live = [[name, b, owners.get(name, "")] for name, b in breakdown["live"][:3]]
    return {"batch": over, "needs": resident + peak, "over": resident + peak - cap,
            "per_example": peak - before if best >= 1 else None, "phase": breakdown["phase"],
            "at": breakdown["at"], "module": owners.get(breakdown["at"] or "", ""), "live": live}


def max_seq(rep: Any, cap: int, resident: int, shapes: dict[str, tuple], tokens: str, positions: int | None) -> int:
    """The longest sequence (dimension 1 of ``tokens``) whose step at ``shapes`` fits ``cap``
    beside ``resident`` bytes (at most ``positions``, the model's longest; 0 if none fits)."""
    from .report.model import largest_batch

    def fits(s: int) -> bool:
        return resident + rep.predict_peak(**{**shapes, tokens: (shapes[tokens][0], s)}) <= cap

    return largest_batch(fits, positions or 1 << 24)


def table(result: dict, device: str | None, batch: int | None = None) -> str:
    """The per-level rows, then (with ``device``) what limits each level's largest batch and the
    longest sequence at ``batch``."""
    text = sequence_input(result.get("shapes", {"input_ids": ()})) is not None
    host = result.get("host_bytes") or {}
    lines = [f"{'level':>5s}  {'step peak':>10s}  {'+ resident':>10s}  {'total':>10s}"
             + (f"  {'host':>10s}" if host else "")
             + ("  largest batch that fits" if device else "")
             + (f"  longest sequence at batch {batch}" if device and text and batch else "")]
    for level, peak in result["peak_bytes"].items():
        total = peak + result["resident_bytes"]
        row = f"{level:>5s}  {human(peak):>10s}  {human(result['resident_bytes']):>10s}  {human(total):>10s}"
        if host:
            row += f"  {human(host[level]):>10s}"
        if device:
            row += f"  {str(result['max_batch'][level]) + f' (on {device})':24s}"
            if text and batch and level in result.get("max_seq", {}):
                row += f"  {result['max_seq'][level]}"
        lines.append(row.rstrip())
    lines.append("step peak: activations, gradients and the step's buffers (predicted); resident: weights, "
                 "buffers and optimizer state" + ("; host: saved values offloaded to host memory (not in the "
                                                  "device's total)" if host else ""))
    for level, why in (result.get("limit") or {}).items():
        lines.append(f"level {level}: {limit_line(why, result['resident_bytes'], device)}")
    return "\n".join(lines)


def limit_line(why: dict, resident: int, device: str | None) -> str:
    """:func:`limit`'s answer in one sentence."""
    where = f"{why['at']}" + (f" ({why['module']})" if why["module"] else "")
    live = ", ".join(f"{n} {human(b)}" + (f" ({m})" if m else "") for n, b, m in why["live"])
    head = (f"batch {why['batch']} needs {human(why['needs'])} ({human(resident)} resident), "
            f"{human(why['over'])} over {device}")
    if why["per_example"] is not None:
        head += f"; each example adds {human(why['per_example'])} there"
    return f"{head}; its peak is in the {why['phase']} at {where}, the largest alive: {live}"


def plot(result: dict, path: str, device: str | None, batch: int) -> str:
    """Memory (resident + step peak) against the batch size, one line per level, the device's size dashed."""
    from .report.render import axes, save

    cap = parse_bytes(device, "device") if device else None
    top = max([batch * 2, *[2 * b for b in result["max_batch"].values()]])
    batches = sorted({max(1, round(top * i / 40)) for i in range(41)})
    shapes = result["shapes"]
    fig, ax = axes("estimate --plot")
    styles = ["-", "--", ":"]
    for i, (level, rep) in enumerate(result["reports"].items()):
        total = [(result["resident_bytes"] + rep.predict_peak(**{n: (b, *d[1:]) for n, d in shapes.items()})) / 2**30
                 for b in batches]
        best = result["max_batch"].get(level)
        label = f"level {level}" + (f" (largest batch {best})" if best is not None else "")
        ax.plot(batches, total, styles[i % 3], linewidth=2, label=label)
    if cap:
        ax.axhline(cap / 2**30, color="black", linestyle="-.", label=f"device {device}")
        ax.set_ylim(0, 2 * cap / 2**30)  # the region that decides what fits
    return save(fig, ax, path, "batch size", "memory (GiB): weights, optimizer state and step peak",
                "fxmem estimate: training-step memory by batch size")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fxmem estimate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Predict a training step's memory per fxmem level, and the largest batch that fits a device, "
                    "without running the model (planned on the meta device).")
    p.add_argument("model", help="an HF config.json (or a folder holding one), or module:function returning the model")
    p.add_argument("--batch", type=int, default=8, help="batch size")
    p.add_argument("--seq", type=int, default=None, help="sequence length (text models; default 512); vision models "
                   "take the config's image_size")
    p.add_argument("--level", choices=["0", "1", "2", "all"], default="1",
                   help="fxmem level to plan (each takes one plan; 0 is fxmem's default compile, 1 recomputes "
                        "layerwise), or all three")
    p.add_argument("--device", default=None, help="device memory, e.g. 80GB or 24GiB: prints the largest batch at "
                   "--seq, what stops the next one, and the longest sequence at --batch")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw", help="optimizer state kept per weight")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights' and activations' dtype")
    p.add_argument("--step-in-backward", action="store_true",
                   help="the optimizer's step runs in the backward (options step_in_backward): gradients die there")
    p.add_argument("--offload", action="store_true",
                   help="plan with offload (option offload): saved values in host memory where that lowers the "
                        "peak; prints the host bytes")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="plot memory against batch size per level")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    levels = LEVELS if a.level == "all" else (int(a.level),)

    def log(msg: str) -> None:
        print(f"[fxmem estimate] {msg}", file=sys.stderr, flush=True)

    result = estimate(a.model, a.batch, a.seq or 512, levels, a.device, a.optimizer, a.dtype, log,
                      a.step_in_backward, a.offload)
    if a.seq is not None and sequence_input(result["shapes"]) is None:
        log(f"--seq {a.seq} does not apply: the model takes {describe(result['shapes'])}")
    if a.plot:
        log(f"plot written to {plot(result, a.plot, a.device, a.batch)}")
    if a.json:
        keys = ("peak_bytes", "resident_bytes", "max_batch", "limit", "max_seq")
        keys += ("host_bytes",) if a.offload else ()
        print(json.dumps({**{k: result[k] for k in keys}, "inputs": {k: list(v) for k, v in result["shapes"].items()}}))
    else:
        print(table(result, a.device, a.batch))
