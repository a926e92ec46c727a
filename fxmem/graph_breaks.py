"""Graph breaks that split a training step, and the ones fxmem avoids.

A graph break splits a step into graphs that fxmem plans one by one: the planner cannot see a
value's lifetime across the break, and a pattern (a loss after a model) cannot match across it.

- Hugging Face models call ``logger.warning_once`` inside ``forward`` (e.g. the causal LMs'
  "``loss_type=None`` ... ``ForCausalLMLoss``" notice): Dynamo breaks the graph there. fxmem
  adds ``logging.Logger.warning_once`` (transformers attaches it to ``Logger``) to Dynamo's
  ``ignore_logger_methods``, so stock HF models compile into one graph; in compiled code those
  once-only notices are then not printed.
- Hugging Face models that return per-layer outputs through hooks (MoE routers' logits with
  ``output_router_logits=True``, ``output_hidden_states``, ``output_attentions``) install those
  hooks lazily on their first call (``maybe_install_capturing_hooks``), under a
  ``threading.Lock`` Dynamo cannot enter, and registering a hook mutates a class attribute Dynamo
  refuses: an MoE LM was two graphs per step, for ever (the break is compiled in). fxmem gives
  Dynamo a stand-in for that function that runs the real one at trace time (as
  ``assume_constant_result`` does), so the hooks exist before Dynamo traces the layers and are
  traced with them; the compiled code is guarded on the model's identity, as Dynamo guards any
  object passed to such a function.
- transformers' state-space models (Mamba, FalconMamba, Jamba, Zamba) run their selective scan
  as a loop in eager and as torch's ``associative_scan`` under Dynamo: fxmem has Dynamo trace
  the loop (:func:`_eager_scan`), the step eager runs, which peaks lower, over up to
  :data:`SCAN_LOOP_MAX` (256) steps by default (``FXMEM_SCAN_LOOP_MAX``): Dynamo unrolls the
  loop, so its compile time grows with the sequence; longer sequences keep the associative scan.
- transformers' ``deprecate_kwarg`` wraps many ``forward`` methods (attention, layers, stacks)
  in one wrapper function, so one code object: where Dynamo starts a frame at a decorated
  ``forward`` (its caller ran eagerly, e.g. after a graph break in a layer loop), every
  decorated method and call signature is one more compile of that one code, and past
  ``recompile_limit`` (8) Dynamo runs it, and every frame under it, eagerly for the rest of the
  process (an Autoformer step: 8 compiles, then the decoder eager). fxmem has Dynamo skip the
  wrapper's own frame (it only renames keyword arguments) and compile the method it calls,
  a code object per method (:func:`_skip_shared_wrappers`); calls Dynamo inlines are unchanged.
- transformers' Autoformer aggregates ``k`` rolled copies of the values in training with
  ``roll(shifts=-int(top_k_delays_index[i]))``: ``int()`` of a tensor is a graph break inside
  the loop, so Dynamo ran the attention's whole ``forward`` eagerly, keeping every copy for the
  backward where fxmem could recompute none (level 1: 2.27x HF checkpointing's peak). fxmem has
  Dynamo trace that ``forward`` with ``capture_scalar_outputs`` (:func:`_traced_delays`: the
  delay an unbacked integer, as the user's own ``torch._dynamo.config.capture_scalar_outputs =
  True`` would, for that method alone: other models' ``.item()`` calls still break the graph).
  torch 2.13 only: 2.14.1's Dynamo fails inside on that method with the flag.
- :func:`breaks_since` tells what broke a step's graph, for ``fxmem.explain`` and ``clipped_grad``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from collections import Counter
from typing import Mapping

import torch

from .options import ENV_SCAN_LOOP_MAX, SCAN_LOOP_MAX, env_value, parse_scan_loop_max  # noqa: F401 (SCAN_LOOP_MAX)


def ignore_once_warnings(*_: object) -> None:
    """Let Dynamo skip HF's ``logger.warning_once`` calls instead of breaking the graph. Runs at
    the start of every Dynamo compile (transformers may be imported after fxmem): registered as
    a compile-start callback, again by each backend call since ``torch._dynamo.reset()`` clears
    those callbacks (the config entry itself survives a reset)."""
    method = getattr(logging.Logger, "warning_once", None)
    if method is not None and method not in torch._dynamo.config.ignore_logger_methods:
        torch._dynamo.config.ignore_logger_methods.add(method)
    handler = torch._dynamo.callback.callback_handler
    if ignore_once_warnings not in handler.start_callbacks:
        handler.register_start_callback(ignore_once_warnings)
    _trace_time_output_hooks()
    _skip_shared_wrappers()


# transformers' decorators whose one wrapper function wraps many ``forward`` methods:
# (module, a function of it that makes the wrapper when called with a function)
_SHARED_WRAPPERS = (("transformers.utils.deprecation",
                     lambda m: m.deprecate_kwarg("fxmem_unused", "0.0", new_name="fxmem_unused_new")),)


@functools.cache
def _wrapper_code(module: str):
    """The code object of the wrapper that ``module``'s decorator makes (one for every function
    it decorates), or None where transformers has no such decorator."""
    make = dict(_SHARED_WRAPPERS)[module]
    try:
        return make(sys.modules[module])(lambda self: None).__code__
    except Exception:  # noqa: BLE001 - another transformers version: nothing to skip
        return None


def _skip_shared_wrappers() -> None:
    """Have Dynamo skip the frames of transformers' shared wrappers (only theirs: the functions
    they call are compiled as usual). Again at every compile start: ``torch._dynamo.reset()``
    forgets what it was told of a code object it compiled."""
    from torch._dynamo.eval_frame import skip_code

    for module, _ in _SHARED_WRAPPERS:
        if module in sys.modules and (code := _wrapper_code(module)) is not None:
            skip_code(code)


_CAPTURING = "transformers.utils.output_capturing"
# transformers' state-space models whose selective scan, in plain PyTorch, is a loop over the
# sequence in eager and torch's ``associative_scan`` when Dynamo traces it (config.use_associative_scan)
_SCANS = tuple(f"transformers.models.{m}.modeling_{m}" for m in ("mamba", "falcon_mamba", "jamba", "zamba"))


def _trace_time_output_hooks() -> None:
    """Register, once per process (Dynamo keeps polyfills across ``torch._dynamo.reset()``, which
    drops compile-start callbacks), fxmem's stand-ins for transformers' functions: each now if its
    module is loaded, else right after the module is imported."""
    for name, install in _STAND_INS.items():
        module = sys.modules.get(name)
        if module is not None:
            install(module)
        elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())


def _output_hooks(capturing) -> None:
    """The stand-in for ``maybe_install_capturing_hooks``: it runs the real one at trace time."""
    original = getattr(capturing, "maybe_install_capturing_hooks", None)
    if original is None or getattr(original, _MARK, False):
        return

    @torch._dynamo.assume_constant_result
    def install_now(model: torch.nn.Module) -> bool:
        original(model)
        return True

    def stand_in(model):
        install_now(model)

    torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(stand_in)
    setattr(original, _MARK, True)


def _eager_scan(modeling) -> None:
    """Make Dynamo trace the selective-scan loop that eager runs, for sequences of at most
    :func:`scan_loop_max` steps. transformers' Mamba, FalconMamba, Jamba and Zamba (scan in plain
    PyTorch: no CUDA kernels) switch to torch's ``associative_scan`` (generic mode off CUDA) where
    ``is_torchdynamo_compiling()`` and ``use_associative_scan`` (``config.use_associative_scan``,
    on by default): another algorithm, whose tree levels and full-size slice gradients held a
    Jamba step at 1.27x eager's peak under ``aot_eager`` (fxmem level 0 1.30x; no plan of that
    graph peaks lower), where the loop traced peaks at eager's or below and computes eager's values
    (bench/studies/outside_zoo.py: jamba). But Dynamo unrolls the loop, one set of ops per time
    step, so compiling takes time linear in the sequence: a 2-layer Mamba's compile and first step
    took 22 / 60 / 90 s at 16 / 64 / 256 steps, against 10 / - / 15 s with the associative scan.
    So the module's ``mamba_selective_scan`` (which the mixers call through the module global;
    with ``kernels`` installed, an ``nn.Module`` that ``use_kernelized_func`` routes to each
    model's own copy: the wrapper calls it as it is) is wrapped: asked for the associative scan
    over at most ``scan_loop_max()`` steps, it asks for the loop (``use_associative_scan=False``);
    longer sequences, eager (not compiling) and calls that did not ask are passed on unchanged."""
    original = getattr(modeling, "mamba_selective_scan", None)
    if original is None or getattr(original, _MARK, False):
        return
    modeling.mamba_selective_scan = _loop_up_to_the_limit(original)


def _loop_up_to_the_limit(original):
    """``original`` (a ``mamba_selective_scan``) asking for the loop instead of the associative
    scan when compiling a sequence of at most ``scan_loop_max()`` steps."""

    def mamba_selective_scan(*args, **kwargs):
        if kwargs.get("use_associative_scan") and torch.compiler.is_compiling():
            hidden_states = args[0] if args else kwargs["hidden_states"]  # (batch, channels, seq_len)
            if hidden_states.shape[-1] <= scan_loop_max():  # a SymInt under dynamic shapes: a guard
                kwargs["use_associative_scan"] = False
        return original(*args, **kwargs)

    functools.update_wrapper(mamba_selective_scan, original, updated=())  # an nn.Module with ``kernels``
    setattr(mamba_selective_scan, _MARK, True)
    return mamba_selective_scan


@torch._dynamo.assume_constant_result  # read when Dynamo traces a scan (not guarded on)
def scan_loop_max(env: Mapping[str, str] | None = None) -> int:
    """The longest sequence whose selective scan fxmem has Dynamo trace as eager's loop:
    ``FXMEM_SCAN_LOOP_MAX`` (a whole number >= 0; 0: the associative scan wherever it is asked
    for), else :data:`SCAN_LOOP_MAX`. A bad value is a ``ValueError`` naming the variable, raised
    as it is through Dynamo (:class:`fxmem.OptionError`), and checked too when options resolve."""
    return parse_scan_loop_max(env_value(ENV_SCAN_LOOP_MAX, env))


_AUTOFORMER = "transformers.models.autoformer.modeling_autoformer"


# torch 2.14.1's Dynamo fails inside (``PendingUnbackedSymbolNotFound``, any backend) on the
# method's ``x[:, top_k_delays_index[i]]`` with ``capture_scalar_outputs``: from there on the
# method's loop stays a graph break, as without fxmem
DELAYS_UNTRACEABLE_FROM = (2, 14)


def _traced_delays(modeling) -> None:
    """Have Dynamo trace ``AutoformerAttention.forward`` with ``capture_scalar_outputs`` on:
    ``int()`` of the delay gives an unbacked integer instead of a graph break. The method runs
    inside ``torch._dynamo.patch_dynamo_config(capture_scalar_outputs=True)``, which Dynamo
    applies while it traces the method and which, where the method runs eagerly (a caller Dynamo
    skipped), is ``torch._dynamo.config.patch`` around the call: the frames Dynamo compiles under
    it (the method's own, behind transformers' ``deprecate_kwarg`` wrapper) capture the scalar.
    The values are the method's own. The class is changed for the process, for any backend,
    once fxmem has compiled (as the other stand-ins here)."""
    attention = getattr(modeling, "AutoformerAttention", None)
    patch = getattr(torch._dynamo, "patch_dynamo_config", None)
    if (attention is None or patch is None or getattr(attention.forward, _MARK, False)
            or torch.torch_version.TorchVersion(torch.__version__) >= DELAYS_UNTRACEABLE_FROM):
        return
    original = attention.forward

    def forward(self, *args, **kwargs):
        with patch(capture_scalar_outputs=True):
            return original(self, *args, **kwargs)

    functools.update_wrapper(forward, original)
    setattr(forward, _MARK, True)
    attention.forward = forward


_STAND_INS = {_CAPTURING: _output_hooks, _AUTOFORMER: _traced_delays, **{name: _eager_scan for name in _SCANS},
              **{name: lambda _: _skip_shared_wrappers() for name, _ in _SHARED_WRAPPERS}}
_MARK = "__fxmem_stand_in__"  # set on a function given a stand-in: Dynamo refuses a second registration


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of the modules fxmem gives stand-ins for is imported, lets
    the other finders load it and registers the stand-ins right after the module runs."""

    def find_spec(self, name, path, target=None):
        if name not in _STAND_INS:
            return None
        sys.meta_path.remove(self)  # find_spec below must not come back here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _STAND_INS[name](module)

        spec.loader.exec_module = exec_module
        return spec


def break_count() -> Counter:
    """Dynamo's graph-break reasons so far, with their counts (pass it to :func:`breaks_since`)."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def breaks_since(before: Counter) -> list[str]:
    """The reasons of the graph breaks Dynamo counted since ``before`` (most frequent first)."""
    from torch._dynamo.utils import counters

    new = Counter(counters["graph_break"]) - before
    return [reason.splitlines()[0][:200] for reason, _ in new.most_common()]
