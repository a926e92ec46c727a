"""The benchmark's models and configurations, each in one table.

A configuration turns a model into the callable a training step calls (``fn(**batch)``). It has
a name, a *kind* (how it is built) and an options dict that the kind interprets:

    eager           the model as is                                   (no options)
    hf_ckpt         HF gradient checkpointing, non-reentrant           (no options)
    aot_eager       torch.compile(backend="aot_eager")                 (no options)
    aot_eager_plain torch.compile(backend="aot_eager_default_partitioner")
    mincut_eager    aot_autograd(nop compilers, partition_fn=min_cut_rematerialization_partition);
                    option ``activation_memory_budget`` as for inductor
    inductor        torch.compile(); option ``activation_memory_budget``: torch's min-cut
                    partitioner runs with torch._functorch.config.activation_memory_budget set to
                    it (for this compile only), every other option goes to Inductor's config
    fxmem           torch.compile(backend="fxmem", options=<options>)
    floor           no step: the model's physical floor (bench/floor.py), measured by the worker

Adding a configuration is one line in CONFIGS (or ``register(...)``), e.g.

    Config("fxmem-eager-level1", "fxmem", {"inner": "eager", "level": 1}, "fxmem level 1")

and any configuration can be varied on the command line without registering it:
``--configs 'fxmem-eager:{"level":1}'`` merges the JSON object into the options of
``fxmem-eager`` (the result row is named by the whole spec).

The ``fxmem`` kind also takes ``"loss_only": true`` (a benchmark setting, not an fxmem option):
it compiles a wrapper whose ``forward`` returns only ``model(**batch).loss``, so the compiled
graph does not return the logits (an HF model returns them; a lowered loss that must still
produce them for the output keeps them, and AOTAutograd materializes a zero gradient for them).

Model shapes can be overridden for a whole run with the environment variable
``FXMEM_BENCH_MODEL_KWARGS`` (a JSON object merged into every model's keyword arguments; the
result JSON records the shapes used), e.g. the lowering run at vocab 32768:

    FXMEM_BENCH_MODEL_KWARGS='{"vocab": 32768}' python bench/run.py --name lowering \
        --models hf_gpt2,hf_llama --configs eager,fxmem-eager+loss_only,...
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# --- models --------------------------------------------------------------------------------
# Keyword arguments for fxmem.models.build, per model, for the full and the --quick run.
_HF = dict(batch=8, seq=256, vocab=8192, d=256, layers=4, heads=4)
_HF_QUICK = dict(batch=2, seq=64, vocab=2048, d=64, layers=2, heads=2)
MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "hf_gpt2": {"full": dict(_HF, dropout=0.0), "quick": dict(_HF_QUICK, dropout=0.0)},
    "hf_llama": {"full": dict(_HF), "quick": dict(_HF_QUICK)},
    # issue "[defaults]": a real vocabulary (32768), the loss decides the peak
    "hf_qwen2": {"full": dict(batch=4, seq=256, vocab=32768, d=256, layers=4, heads=4),
                 "quick": dict(batch=2, seq=64, vocab=4096, d=64, layers=2, heads=2)},
    # Activations (2 x depth x batch x width fp32 = 128 MiB) dwarf the weights and their
    # gradients (16 MiB each), so what a configuration keeps for backward decides the peak.
    "mlp_chain": {"full": dict(batch=2048, width=512, depth=16), "quick": dict(batch=256, width=128, depth=8)},
}
# issue "[realistic]": models as their configs ship (dropout where the family has it), real
# vocabularies, real sizes. "full" is the real size; "quick" the small profile of the same family.
_REAL = dict(batch=2, seq=512, d=768, layers=12, heads=12)
_REAL_QUICK = dict(batch=4, seq=256, d=128, layers=4, heads=4)
MODELS.update({
    "gpt2_small": {"full": dict(_REAL, vocab=50257, dropout=0.1), "quick": dict(_REAL_QUICK, vocab=2000, dropout=0.1)},
    "llama_small": {"full": dict(_REAL, vocab=32000), "quick": dict(_REAL_QUICK, vocab=32000)},
    "bert_base": {"full": dict(_REAL, vocab=30522, dropout=0.1), "quick": dict(_REAL_QUICK, vocab=30522, dropout=0.1)},
})
BUILDER = {"gpt2_small": "hf_gpt2", "llama_small": "hf_llama", "bert_base": "hf_bert"}  # bench model -> fxmem.models
DEFAULT_MODELS = ("hf_gpt2", "hf_llama", "mlp_chain")


ENV_MODEL_KWARGS = "FXMEM_BENCH_MODEL_KWARGS"


def model_kwargs(model: str, quick: bool) -> dict[str, Any]:
    """The model's keyword arguments, with ``$FXMEM_BENCH_MODEL_KWARGS`` (a JSON object) merged in."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    kwargs = dict(MODELS[model]["quick" if quick else "full"])
    extra = os.environ.get(ENV_MODEL_KWARGS, "").strip()
    if extra:
        try:
            override = json.loads(extra)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_MODEL_KWARGS} must be a JSON object ({e})") from None
        if not isinstance(override, dict):
            raise ValueError(f"{ENV_MODEL_KWARGS} must be a JSON object, got {extra!r}")
        kwargs.update(override)
    return kwargs


# --- configurations ------------------------------------------------------------------------


class Skip(Exception):
    """A configuration does not apply to a model; the message says why."""


@dataclass(frozen=True)
class Config:
    name: str
    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def with_options(self, extra: Mapping[str, Any], name: str) -> "Config":
        return Config(name, self.kind, {**self.options, **extra}, self.description + f" + {json.dumps(dict(extra))}")


def _no_options(cfg: Config) -> None:
    if cfg.options:
        raise ValueError(f"config {cfg.name!r} (kind {cfg.kind!r}) takes no options, got {dict(cfg.options)}")


def _eager(model, cfg: Config):
    _no_options(cfg)
    return model


def _hf_ckpt(model, cfg: Config):
    _no_options(cfg)
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise Skip(f"{type(model).__name__} has no HF gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not model.training:
        raise Skip("HF gradient checkpointing acts in training mode only, and the model is in eval mode")
    return model


def _save_on_cpu(model, cfg: Config):
    """The seed documents' recipe: HF gradient checkpointing (where the model has it) with every
    saved tensor in host memory (``fxmem.host_memory.save_on_host``: ``save_on_cpu``'s hooks; pinned
    buffers on CUDA, buffers outside torch's allocator on a CPU)."""
    from fxmem.host_memory import save_on_host

    _no_options(cfg)
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(*args, **kwargs):
        with save_on_host():
            return model(*args, **kwargs)

    return step


def _compile(backend: str):
    def build(model, cfg: Config):
        import torch

        _no_options(cfg)
        return torch.compile(model, backend=backend)

    return build


def _budget(cfg: Config) -> tuple[float | None, dict]:
    """(``activation_memory_budget`` or None, the other options)."""
    opts = dict(cfg.options)
    budget = opts.pop("activation_memory_budget", None)
    return (None if budget is None else float(budget)), opts


def _with_budget(fn, budget: float | None):
    """``fn`` run with torch._functorch.config.activation_memory_budget = ``budget``: the min-cut
    partitioner reads it when it partitions, inside the compile."""
    import functools

    import torch

    if budget is None:
        return fn

    @functools.wraps(fn)
    def patched(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return fn(*args, **kwargs)

    return patched


def _mincut_eager(model, cfg: Config):
    import torch
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    budget, rest = _budget(cfg)
    if rest:
        raise ValueError(f"config {cfg.name!r} (kind mincut_eager) takes only activation_memory_budget, "
                         f"got {dict(cfg.options)}")
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                           partition_fn=_with_budget(min_cut_rematerialization_partition, budget))
    return torch.compile(model, backend=backend)


def _inductor(model, cfg: Config):
    """With a budget, a backend function of its own: ``torch.compile(backend="inductor")`` with
    equal options reuses an earlier compile of the same model class (Dynamo's cache is per code
    object, and Inductor's backend wrappers compare equal), so a budget set globally for a second
    compile in the same process would be ignored."""
    import torch
    from torch._inductor.compile_fx import compile_fx

    budget, opts = _budget(cfg)
    if budget is None:
        return torch.compile(model, backend="inductor", options=opts or None)
    return torch.compile(model, backend=_with_budget(
        lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=opts or None), budget))


class _LossOutput:
    """What the worker's ``wl.loss`` reads from an HF model's output: ``.loss``."""

    def __init__(self, loss):
        self.loss = loss


def _loss_only(model):
    import torch

    class LossOnly(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, **batch):
            return self.m(**batch).loss

    return LossOnly(model)


def _fxmem(model, cfg: Config, optimizer=None):
    import torch

    import fxmem  # noqa: F401  (registers the backend even without the entry point)

    # The planner's configurations measure it without pattern lowering (fxmem's default lowers
    # every pattern but dropout, as its sizes and plans decide); a configuration that wants
    # lowering says so, and ``"lowering": "default"`` (the "fxmem-*-defaults" ones) leaves fxmem its own default.
    opts = dict(cfg.options)
    if opts.get("lowering") == "default":
        del opts["lowering"]
    else:
        opts.setdefault("lowering", False)
    if opts.get("step_in_backward"):  # the step's optimizer (bench/worker.py --optimizer)
        if optimizer is None:
            raise Skip("step_in_backward needs an optimizer: run with --optimizer")
        opts["step_in_backward"] = optimizer
    if opts.pop("loss_only", False):
        if not hasattr(model, "loss_function"):
            raise Skip("loss_only applies to Hugging Face models (the others return only their loss)")
        compiled = torch.compile(_loss_only(model), backend="fxmem", options=opts)
        return lambda **batch: _LossOutput(compiled(**batch))
    return torch.compile(model, backend="fxmem", options=opts)


def _floor(model, cfg: Config):
    """Not a step: bench/worker.py measures the model's physical floor (bench/floor.py) instead;
    anything else that builds steps (bench/studies/interleaved.py) leaves it out."""
    _no_options(cfg)
    raise Skip("'floor' is not a step: bench/run.py measures it (bench/floor.py)")


KINDS: dict[str, Callable[[Any, Config], Any]] = {
    "eager": _eager,
    "hf_ckpt": _hf_ckpt,
    "save_on_cpu": _save_on_cpu,
    "aot_eager": _compile("aot_eager"),
    "aot_eager_plain": _compile("aot_eager_default_partitioner"),
    "mincut_eager": _mincut_eager,
    "inductor": _inductor,
    "fxmem": _fxmem,
    "floor": _floor,
}

CONFIGS: list[Config] = [
    Config("eager", "eager", description="plain PyTorch, no compile"),
    Config("eager+hf_ckpt", "hf_ckpt", description="HF gradient checkpointing (use_reentrant=False) per layer"),
    Config("eager+hf_ckpt+save_on_cpu", "save_on_cpu", description="the seed's recipe: HF gradient checkpointing "
           "with save_on_cpu's hooks (every saved tensor in host memory)"),
    Config("aot_eager", "aot_eager",
           description="torch's aot_eager backend (in torch 2.13 it uses the min-cut partitioner)"),
    Config("aot_eager_plain", "aot_eager_plain",
           description="aot_eager with the default partitioner: saves what the forward computed, recomputes nothing"),
    Config("mincut_eager", "mincut_eager",
           description="aot_autograd(nop compilers, partition_fn=min_cut_rematerialization_partition)"),
    Config("inductor", "inductor", description="torch.compile default (Inductor, min-cut partitioner)"),
    Config("inductor+budget0.5", "inductor", {"activation_memory_budget": 0.5},
           description="Inductor with torch._functorch.config.activation_memory_budget = 0.5"),
    Config("inductor+budget0.1", "inductor", {"activation_memory_budget": 0.1},
           description="Inductor with torch._functorch.config.activation_memory_budget = 0.1"),
    Config("floor", "floor", description="the physical floor (bench/floor.py): max(parameter gradients, layer "
           "boundaries + max(one layer's working set, the loss's working set)), measured in eager; no step is timed"),
    Config("fxmem-eager", "fxmem", {"inner": "eager"}, description="fxmem with the eager inner compiler"),
    Config("fxmem-inductor", "fxmem", {"inner": "inductor"}, description="fxmem with the Inductor inner compiler"),
    # The recompute planner (issue "[planner]"): level 1 and the memory-budget sweep.
    Config("fxmem-eager-level1", "fxmem", {"inner": "eager", "level": 1},
           description="fxmem level 1 (layerwise recompute), eager inner compiler"),
    Config("fxmem-inductor-level1", "fxmem", {"inner": "inductor", "level": 1},
           description="fxmem level 1 (layerwise recompute), Inductor inner compiler"),
]
# Pattern lowering (issue "[lowering]"): the same fxmem configuration with and without fused
# kernels; "+loss_only" compiles the model returning only its loss (see the module docstring).
for _inner in ("eager", "inductor"):
    for _lvl, _lname in ((0, ""), (1, "-level1")):
        _base = {"inner": _inner, **({"level": 1} if _lvl else {})}
        _what = f"fxmem{_lname}, {_inner} inner compiler"
        CONFIGS.append(Config(f"fxmem-{_inner}{_lname}+loss_only", "fxmem", {**_base, "loss_only": True},
                              description=f"{_what}, no lowering, model returns only its loss"))
        CONFIGS.append(Config(f"fxmem-{_inner}{_lname}+lowering+loss_only", "fxmem",
                              {**_base, "lowering": True, "loss_only": True},
                              description=f"{_what}, every lowering pattern, model returns only its loss"))
    CONFIGS.append(Config(f"fxmem-{_inner}+lowering", "fxmem", {"inner": _inner, "lowering": True},
                          description=f"fxmem, {_inner} inner compiler, every lowering pattern "
                                      "(the HF model also returns its logits)"))
# The optimizer's step in the backward (issue "[release]"): fxmem's defaults at level 1, with the
# step's optimizer (bench/worker.py --optimizer) run inside the backward.
for _inner in ("eager", "inductor"):
    CONFIGS.append(Config(f"fxmem-{_inner}-level1-defaults", "fxmem",
                          {"inner": _inner, "level": 1, "lowering": "default"},
                          description=f"fxmem level 1, default lowering, {_inner} inner compiler"))
    CONFIGS.append(Config(f"fxmem-{_inner}-level1-defaults+step_in_backward", "fxmem",
                          {"inner": _inner, "level": 1, "lowering": "default", "step_in_backward": True},
                          description=f"fxmem level 1, default lowering, {_inner} inner compiler, the optimizer's "
                                      "step in the backward"))
# fxmem's default options (issue "[defaults]"): lowering on for every pattern but dropout, as the backend decides.
for _inner in ("eager", "inductor"):
    CONFIGS.append(Config(f"fxmem-{_inner}-defaults+loss_only", "fxmem",
                          {"inner": _inner, "lowering": "default", "loss_only": True},
                          description=f"fxmem's default options (lowering as the backend decides, dropout off), "
                                      f"{_inner} inner compiler, model returns only its loss"))
# Budget sweeps. fxmem's ``memory_budget`` as a float is a fraction of level 0's saved bytes;
# Inductor's ``activation_memory_budget`` a fraction of its min-cut plan's. A fxmem budget below
# its feasible floor fails at compile time (the result's status is then "infeasible").
BUDGET_FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1)
BUDGET_BASES = ("fxmem-eager", "fxmem-inductor", "inductor", "mincut_eager")


def _pretty(name: str) -> str:
    return "Inductor" if name == "inductor" else name


def budget_config(base: Config, fraction: float) -> Config:
    """``base`` with a budget of ``fraction``: fxmem's ``memory_budget``, torch's
    ``activation_memory_budget`` for the Inductor and min-cut configurations."""
    if base.kind == "fxmem":
        return Config(f"{base.name}+budget{fraction}", "fxmem", {**base.options, "memory_budget": fraction},
                      description=f"fxmem level 0, {_pretty(base.options['inner'])} inner compiler, memory_budget = "
                                  f"{fraction} (fraction of level 0's saved bytes)")
    return Config(f"{base.name}+budget{fraction}", base.kind, {"activation_memory_budget": fraction},
                  description=f"{_pretty(base.name)} with torch._functorch.config.activation_memory_budget = "
                              f"{fraction}")


_BY_NAME = {c.name: c for c in CONFIGS}
for _base in BUDGET_BASES:
    for _b in BUDGET_FRACTIONS:
        if f"{_base}+budget{_b}" not in _BY_NAME:  # inductor+budget0.5 and 0.1 are registered above
            CONFIGS.append(budget_config(_BY_NAME[_base], _b))
REGISTRY: dict[str, Config] = {c.name: c for c in CONFIGS}
DEFAULT_CONFIGS = tuple(c.name for c in CONFIGS)
BASELINE = "eager"


def register(cfg: Config) -> Config:
    if cfg.kind not in KINDS:
        raise ValueError(f"config {cfg.name!r}: unknown kind {cfg.kind!r}; known: {', '.join(KINDS)}")
    if cfg.name in REGISTRY:
        raise ValueError(f"config {cfg.name!r} is already registered")
    CONFIGS.append(cfg)
    REGISTRY[cfg.name] = cfg
    return cfg


def parse(spec: str) -> Config:
    """``name`` or ``name:{json object}`` (the object is merged into the config's options)."""
    spec = spec.strip()
    name, sep, extra = spec.partition(":")
    base, plus, fraction = name.rpartition("+budget")
    if name not in REGISTRY and plus and base in REGISTRY and base in BUDGET_BASES:
        try:  # any fraction, not only the registered sweep's: e.g. fxmem-inductor+budget0.96
            return budget_config(REGISTRY[base], float(fraction))
        except ValueError:
            pass
    if name not in REGISTRY:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(REGISTRY)}")
    if not sep:
        return REGISTRY[name]
    try:
        opts = json.loads(extra)
    except json.JSONDecodeError as e:
        raise ValueError(f"config {spec!r}: options after ':' must be a JSON object ({e})") from None
    if not isinstance(opts, dict):
        raise ValueError(f"config {spec!r}: options after ':' must be a JSON object, got {opts!r}")
    return REGISTRY[name].with_options(opts, spec)


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs, keeping commas inside ``{...}`` JSON."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


def build(model, cfg: Config, optimizer=None):
    """The callable a step calls in place of ``model``; raises Skip if ``cfg`` does not apply.
    ``optimizer``: the step's (a configuration with ``step_in_backward`` runs it in the backward)."""
    if cfg.kind == "fxmem":
        return _fxmem(model, cfg, optimizer)
    return KINDS[cfg.kind](model, cfg)
