"""Inner compilers: what runs fxmem's forward and backward graphs.

``eager`` runs the graph modules as they are, with two memory habits of a real compiler: the
boxed calling convention (inputs are freed at their last use) and in-place reuse of dead
intermediates by elementwise ops (``add(a, b)`` writes into ``a`` when nothing reads ``a`` later).
Inductor does both on its own. Its graphs are traced with eager's own kernels where torch's
tracing would swap one for a Python decomposition that rounds differently (:func:`eager_kernels`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.fx as fx

from .graph.module import copied
from .graph.reuse import reuse_dead_buffers

aten = torch.ops.aten
log = logging.getLogger("fxmem")
CONTROL_DEPS = "torch.ops.higher_order.control_deps"  # the name Inductor's cacheable() looks up
TRACE_TIMER = "fxmem_trace_flat"  # trace_flat's seconds in Dynamo's compilation_time_metrics


def tolerant_views(gm: fx.GraphModule) -> int:
    """``aten.view`` -> ``aten.reshape`` (a view whenever ``view`` would succeed, else a copy), in
    ``gm``'s graph.

    Traced strides can disagree with what CPU kernels return: ``native_dropout_backward`` on a
    transposed gradient returns a permuted layout where its meta function says contiguous, and
    a later ``view`` then fails at run time (found by the property suite, in torch's own
    ``aot_eager`` too). The graphs are functional, so a copy in place of a view is safe.
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default
            count += 1
    return count  # (the caller recompiles ``gm``)


# Ops whose Python decomposition torch runs in place of the kernel while AOTAutograd traces (registered
# with ``py_impl`` on the Autograd and CompositeImplicitAutograd keys, which only the Python
# dispatcher reads), and whose decomposition gives other numbers than eager's kernel: the linear
# and cubic interpolations gather the four (eight, sixteen) neighbours with ``_unsafe_index`` and
# blend them in another order, and their backward scatters with ``_unsafe_index_put(accumulate)``
# instead of ``upsample_*_backward``: forward and gradients differ in the last bits (MobileViT's
# segmentation loss, issue #56). The nearest modes' decompositions give eager's bits (checked in
# tests/test_bitwise_conv.py), so they stay.
EAGER_KERNELS = ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d")


@contextlib.contextmanager
def eager_kernels() -> Iterator[None]:
    """While a graph for the eager inner compiler is traced: the ops of ``EAGER_KERNELS`` stay in
    the graph as the one kernel eager runs (``aten.upsample_bilinear2d.default``...), with the
    backward eager runs (``upsample_bilinear2d_backward``), so that the step gives eager's bits.
    This costs no memory: the kernels' backward saves nothing but sizes, where the decomposition
    saves index and weight vectors and makes output-sized temporaries.

    The ``.default`` overloads lose their Python decomposition; the ``.vec`` ones (what
    ``F.interpolate`` calls) get what their C++ composite does (the output size from the scale
    factors, then ``.default``), except where a size is symbolic: the kernels' backward has no
    symbolic meta function (its sizes are ``int[]``), so there torch's decomposition stays (and
    its last bits differ from eager's). Torch's kernels are restored on exit (they are
    process-wide, for every other trace)."""
    from torch._C import DispatchKey

    keys = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
    ops = [getattr(getattr(aten, name), overload) for name in EAGER_KERNELS for overload in ("vec", "default")]
    saved = [(op, dict(op.py_kernels)) for op in ops]
    try:
        for name in EAGER_KERNELS:
            packet = getattr(aten, name)
            decomposed = packet.vec.py_kernels.get(DispatchKey.CompositeImplicitAutograd)
            if decomposed is None:  # a torch that traces the kernel as it is
                continue
            vec = _vec_to_default(packet.default, decomposed)
            for k in keys:
                packet.default.py_kernels.pop(k, None)
                packet.vec.py_kernels[k] = vec
            for op in (packet.vec, packet.default):
                op._dispatch_cache.clear()  # the Python dispatcher's resolved kernels per key
        yield
    finally:
        for op, kernels in saved:
            op.py_kernels.clear()
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()


def _vec_to_default(default: Any, decomposed: Callable) -> Callable:
    """An interpolation's ``.vec`` overload as ATen's composite runs it: ``default(input,
    output_size, align_corners, *scales)``, the size computed from the scale factors if not given;
    ``decomposed`` (torch's Python decomposition) where a size is symbolic."""
    from torch._decomp.decompositions import upsample_compute_output_size

    def vec(input: torch.Tensor, output_size: Any, align_corners: bool, scale_factors: Any) -> torch.Tensor:
        size = upsample_compute_output_size(input.size(), output_size, scale_factors)
        if not all(isinstance(d, int) for d in (*input.shape, *size)):
            return decomposed(input, output_size, align_corners, scale_factors)
        scales = list(scale_factors) if scale_factors else [None] * len(size)
        return default(input, size, align_corners, *scales)
    return vec


def eager(gm: fx.GraphModule, example_inputs: Any):
    """Run the graph as it is, boxed: the graph clears its argument list after unpacking it, so
    each saved tensor is freed at its last use in the backward, not when the backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    reuse_dead_buffers(gm)
    tolerant_views(gm)
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    run = gm.forward
    box = lambda args: run(args)  # noqa: E731
    box._boxed_call = True  # type: ignore[attr-defined]
    return box


def compile_joint(gm: fx.GraphModule, example_inputs: list, inner: str, partition_fn: Any,
                  on_code: Callable[[str, str], None] | None = None, config: Mapping[str, Any] = MappingProxyType({}),
                  strict: bool = False):
    """A training graph: AOTAutograd with ``partition_fn`` (fxmem's partitioner), then the inner
    compiler (``"eager"`` or ``"inductor"``) on the forward and backward graphs. ``on_code(kind,
    source)``: Inductor's wrapper code of the ``"forward"`` and, when it is compiled (at the first
    backward for static shapes), the ``"backward"``; ``config``: Inductor config patches
    (``Options.inductor_config``); ``strict``: a backward Inductor cannot compile raises (else it
    runs with the eager inner compiler, :func:`_inductor_inner`)."""
    from torch._dynamo.backends.common import aot_autograd

    if inner == "eager":
        with eager_kernels():
            return aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition_fn)(gm, example_inputs)
    import torch._inductor.config as inductor_config
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    # A hit in AOTAutograd's cache skips the partitioner, so the graph would have no plan or
    # report; Inductor's FX graph cache still serves the compiled forward and backward. The
    # backward orders its kernels with control_deps (``remat.fences``), which Inductor's cache
    # refuses unless marked: its subgraphs are submodules, pickled into the key like the graph.
    cacheable = {**inductor_config.unsafe_marked_cacheable_functions, CONTROL_DEPS: torch.__version__}
    patches = {"custom_partitioner_fn": partition_fn, "unsafe_marked_cacheable_functions": cacheable,
               **config}
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches=patches, inner_compile=_inductor_inner(on_code, strict))


def _inductor_inner(on_code: Callable[[str, str], None] | None, strict: bool) -> Callable:
    """Inductor's ``inner_compile``, handing each compiled graph's wrapper code to ``on_code``
    (a cache hit's too: its ``source_code`` is the cached wrapper). A backward that Inductor
    fails to compile (its C++ code generation failed on a bf16 GPT-NeoX backward: two reductions
    of one input into two outputs) runs with the eager inner compiler, with one warning (under
    ``strict`` it raises): the backward is compiled at the first ``backward()``, past the
    compile stages whose failures fall back to a safe plan, and the forward has run already."""
    from torch._inductor.compile_fx import compile_fx_inner

    from .fallback import is_failure, reason
    from .warn import brief, warn

    def inner_compile(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        backward = bool(kwargs.get("is_backward"))
        # Inductor's passes rewrite the graph in place: the fallback runs a copy of it as given
        kept = copied(gm)[0] if backward and not strict else None
        try:
            out = compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as e:  # noqa: BLE001 - the failure policy: the backward runs eagerly instead
            if kept is None or not is_failure(e):
                raise
            why = reason(e)
            warn(f"fxmem: Inductor could not compile a backward ({type(e).__name__}: {brief(why, 50)}); it runs "
                 "eagerly (strict=True raises)", RuntimeWarning,
                 detail=f"fxmem: Inductor failed to compile a backward graph ({type(e).__name__}: {why}); it "
                        "runs with the eager inner compiler (its plan unchanged). Pass options={'strict': True} to "
                        "raise instead.")
            return eager(kept, example_inputs)
        code = getattr(out, "source_code", None)
        if on_code is not None and isinstance(code, str):
            on_code("backward" if backward else "forward", code)
        return out
    return inner_compile


def compile_safe(gm: fx.GraphModule, example_inputs: list):
    """The safe path: AOTAutograd's plain partition (save everything) and the eager inner compiler."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    with eager_kernels():
        return aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=default_partition)(gm, example_inputs)


def trace_flat(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule | None:
    """``gm``'s functional aten graph in one tracing pass, as AOTAutograd traces an inference
    graph (functionalized, fake inputs, each node's module stack and source kept), or None
    where AOTAutograd's bookkeeping is needed: an input is mutated, an input is not a plain
    tensor or number, or the trace fails (the reason logged at DEBUG on the ``fxmem`` logger).

    AOTAutograd runs a graph twice to trace it (once to collect what is mutated and aliased,
    once to trace); a per-example chunk runs its whole ``vmap(grad(...))`` under functorch
    each time, which is most of a chunk's compile. A chunk's inputs are
    real tensors, it runs without an outer backward and returns new tensors, so one pass with
    the same functionalization gives the same graph."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._dynamo.utils import dynamo_timed
    from torch._functorch._aot_autograd.functional_utils import from_fun, has_data_mutation, to_fun
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.fx import traceback as fx_traceback
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.random import fork_rng
    from torch.utils import _pytree as pytree

    plain = (torch.Tensor, torch.nn.Parameter, int, float, bool)
    odd = [type(t).__name__ for t in example_inputs if type(t) not in plain]
    if odd:
        return _not_traced(f"inputs of type {', '.join(sorted(set(odd)))}")
    mutated = []

    def run(*args):
        exclude = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with exclude, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")  # as AOTAutograd does
            fun = [to_fun(a) for a in args]
            # anomaly mode records each forward op on its autograd node: the inner backward's nodes
            # get their forward's module stack, as in AOTAutograd's graph
            with fx_traceback.preserve_node_meta(), torch.autograd.detect_anomaly(check_nan=False):
                outs = fx.Interpreter(gm).run(*fun)
        mutated.extend(i for i, f in enumerate(fun) if isinstance(f, FunctionalTensor) and has_data_mutation(f))
        return pytree.tree_map(from_fun, outs)

    fake = FakeTensorMode()
    args = [fake.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    try:
        # lazy GraphModules: the traced graph's Python is generated only if it is ever run as is
        # (fxmem's passes rewrite it first)
        with dynamo_timed(TRACE_TIMER), _use_lazy_graph_module(True), fork_rng(devices=[]), fake, \
                enable_python_dispatcher(), eager_kernels(), \
                FunctionalTensorMode(pre_dispatch=False, export=False, _allow_token_discovery=True), \
                torch.autograd.set_multithreading_enabled(False):
            traced = make_fx(run, record_module_stack=True)(*args)
    except Exception as e:  # noqa: BLE001 - AOTAutograd traces it instead (and reports what fails)
        return _not_traced(f"{type(e).__name__}: {e}")
    if mutated:
        return _not_traced(f"it writes into input(s) {mutated}")
    left = [n.name for n in traced.graph.nodes if getattr(n.target, "_schema", None) is not None
            and n.target._schema.is_mutable]
    if left:
        return _not_traced(f"mutating ops left after functionalization: {left[:3]}")
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def _not_traced(why: str) -> None:
    log.debug("fxmem: AOTAutograd traces the chunk (trace_flat: %s)", why)
    return None


def _as_inference(run: Callable[[list], Any]) -> Callable:
    """A boxed graph traced by ``trace_flat``, called as AOTAutograd calls an inference graph:
    without autograd and, where autocast was on when it was traced (its casts are in the graph),
    with autocast off, so that no op is cast twice."""
    amp_off = torch._C._DisableAutocast if torch._C._is_any_autocast_enabled() else contextlib.nullcontext

    def call(*args):
        with torch.no_grad(), amp_off():
            return run(list(args))
    return call


def compile_flat(gm: fx.GraphModule, example_inputs: list, inner: str, plan: Any, rewrite: Any = None,
                 config: Mapping[str, Any] = MappingProxyType({})):
    """A graph that runs without an outer backward (a per-example chunk): its flat aten graph
    (``trace_flat``, else AOTAutograd's); ``rewrite`` (ghost norms, optional) runs on it before
    Inductor's decompositions, ``plan`` (the recompute plan of the inner backward) after them;
    then the inner compiler."""
    from torch._dynamo.backends.common import aot_autograd

    if inner == "eager":
        def fw(g, ins):
            return eager(plan(rewrite(g) if rewrite else g), ins)

        flat = trace_flat(gm, example_inputs)
        if flat is not None:
            return _as_inference(fw(flat, example_inputs))
        with eager_kernels():
            return aot_autograd(fw_compiler=fw, bw_compiler=eager)(gm, example_inputs)
    from functorch.compile import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g, ins, **kwargs):
        return compile_fx_inner(plan(g), ins, **kwargs)

    patches = dict(config)
    if rewrite is None:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    def fw(g, ins):
        return make_boxed_func(compile_fx(rewrite(g), ins, inner_compile=inner_compile, config_patches=patches))

    return aot_autograd(fw_compiler=fw, bw_compiler=eager)(gm, example_inputs)
