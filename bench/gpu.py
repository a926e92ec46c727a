"""The GPU run: everything fxmem needs measured on a CUDA device, in one process, in one command.

    python -m bench.gpu                        # on one H100/H200-class GPU: under 10 minutes
    python -m bench.gpu --dry-run              # every step at tiny sizes (CPU: kernels in Triton's interpreter)
    python -m bench.gpu --only kernels,loss    # some steps (kernels, replay, peaks, loss, dpsgd)

Steps, in order (bench/README.md, "The GPU run", has the sizes and the expected durations):

1. ``kernels``: every fused kernel's Triton path (``impl="triton"``) against its portable path
   (``impl="torch"``) and the plain PyTorch expression, fp32 and bf16, forward, backward and
   ``vmap(grad)`` where the kernel claims it; then ``pytest -m cuda tests/fused_kernels`` in this
   process.
2. ``replay``: dropout replay on CUDA: HF GPT-2 with dropout compiled by fxmem at levels 0/1/2 and
   a memory budget; loss, every gradient and the generator after the step bit-identical to eager.
3. ``peaks``: GPT-2 small and a ~1B Llama at real vocabularies under bf16 autocast: eager, HF
   checkpointing, ``torch.compile``, Inductor's ``activation_memory_budget`` 0.5, fxmem default /
   level 1 / ``peak_budget``, and offload (issue #58: fxmem ``memory_budget=0.0``, ``peak_budget`` 0.8 x
   its peak with ``offload``, ``offload`` at level 1, the seed's HF checkpointing + ``save_on_cpu``):
   measured peak (``max_memory_allocated``) against fxmem's ``predict_peak``, median step times side
   by side (the host copies' cost and overlap show in the step times).
4. ``loss``: fused linear cross-entropy at a Gemma-2-like vocabulary (256k x 2304, 8k and 16k
   tokens, bf16): fxmem (Triton and portable), torch's chunked ``F.linear_cross_entropy``,
   Liger-Kernel's and Cut Cross-Entropy's (when installed), against the unfused loss.
5. ``dpsgd``: the DP bench's GPT (bench/dpsgd_models.py) scaled to ~5M parameters at batch 256:
   fxmem's ghost clipping against Opacus ghost clipping and the explicit per-example reference.

Each step runs under a time limit (unused time flows to later steps; ``--time-limit`` caps the
whole run) inside try/except: a failure or a time-out records a row and the run goes on. Every row
is written as soon as it is measured (``harness.write``, table spec ``gpu``: ``<out-dir>/<name>.json``
and ``.md``; default bench/results/gpu.*), so a partial run leaves its results; the table is printed at
the end. Without CUDA every step records ``skipped: no CUDA``; ``--dry-run`` runs every step at tiny
sizes on whatever device there is (Inductor replaced by fxmem's eager inner compiler and torch's
min-cut partitioner with nop compilers: Inductor compiles take minutes on a CPU), writing to a
temporary folder unless ``--out-dir`` is given. Exit status 1 if a row is an error or a mismatch.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import math
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import harness  # noqa: E402
import results_format  # noqa: E402
import tables  # noqa: E402

MIB = 2**20
NO_CUDA = "skipped: no CUDA"
GPU_CASE = tables.spec_for("gpu").case
STATUS_BAD = ("error", "MISMATCH")


# --- time limits -------------------------------------------------------------------------------


class TimeLimit(BaseException):
    """Raised by SIGALRM in the main thread when a limit's time is up. A BaseException, as
    KeyboardInterrupt is: code that falls back on ``except Exception`` (fxmem's safe plans, Dynamo's
    wrapping of backend errors) does not swallow it."""

    def __init__(self, token: object, what: str):
        super().__init__(f"time limit: {what}")
        self.token = token


class Limits:
    """Nested wall-clock limits on the main thread (one SIGALRM timer armed for the earliest)."""

    def __init__(self) -> None:
        self.active: list[tuple[float, object, str]] = []

    def _arm(self) -> None:
        if not self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        left = min(end for end, _, _ in self.active) - time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3) if math.isfinite(left) else 0)

    def _fire(self, signum, frame) -> None:
        now = time.monotonic()
        expired = [(end, tok, what) for end, tok, what in self.active if end <= now + 1e-3]
        if not expired:  # a stale timer: re-arm for what is left
            self._arm()
            return
        _, tok, what = min(expired, key=lambda e: e[0])
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # again in a second, should something swallow this one
        raise TimeLimit(tok, what)

    @contextlib.contextmanager
    def limit(self, seconds: float, what: str):
        entry = (time.monotonic() + max(seconds, 0.0), object(), what)
        if not self.active:
            signal.signal(signal.SIGALRM, self._fire)
        self.active.append(entry)
        self._arm()
        try:
            yield entry[1]
        finally:  # no alarm while the list changes (one due now is delivered after, and finds its entry)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            try:
                self.active.remove(entry)
                self._arm()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})

    def left(self) -> float:
        """Seconds until the earliest active limit (infinite without one)."""
        return min((end for end, _, _ in self.active), default=math.inf) - time.monotonic()

    def guarded(self, seconds: float, what: str, fn: Callable[[], Any]) -> tuple[str, Any]:
        """``fn()`` under a limit of ``seconds``: ``("ok", value)``, ``("skipped: time limit ...", None)``
        when its own limit ran out, ``("error", "Type: first line")`` when it raised. An outer
        limit that runs out propagates."""
        with self.limit(seconds, what) as token:
            try:
                return "ok", fn()
            except TimeLimit as e:
                if e.token is not token:
                    raise
                return f"skipped: time limit ({seconds:.0f} s)", None
            except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
                wrapped = _chained(e, TimeLimit)  # e.g. Dynamo's BackendCompilerFailed around it
                if wrapped is not None and wrapped.token is not token:
                    raise wrapped from e
                if wrapped is not None:
                    return f"skipped: time limit ({seconds:.0f} s)", None
                traceback.print_exc()
                return "error", _first_line(e)


def _chained(e: BaseException, kind: type) -> Any:
    """The first exception of type ``kind`` among ``e``'s causes and contexts, or None."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, kind):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:400]


# --- the run: rows, files, table ---------------------------------------------------------------


@dataclass
class Ctx:
    device: str  # "cuda" or "cpu"
    dry: bool
    steps: int  # timed steps per measurement (medians)
    limits: Limits
    add: Callable[..., dict]  # add(step, item, status, **metrics) -> the row (written at once)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def free(self) -> None:
        import torch
        import torch._dynamo

        torch._dynamo.reset()
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# --- step 1: fused kernels ---------------------------------------------------------------------

TOL = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}  # (rtol, atol): tests/fused_kernels/util.py's


def _ratio(a, b, tol: tuple[float, float]) -> float:
    """max |a - b| / (atol + rtol |b|): <= 1 is ``torch.testing.assert_close``'s pass."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    rtol, atol = tol
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs() / (atol + rtol * b.abs())).max().item()


def _worst(xs, ys, tol) -> float:
    return max((_ratio(x, y, tol) for x, y in zip(xs, ys)), default=0.0)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: str  # which inputs (see _kernel_inputs)
    fused: Callable  # fused(*inputs, impl) -> tensor
    reference: Callable  # reference(*inputs) -> tensor
    in_dims: tuple | None  # vmap(grad) over dim 0 of these inputs (None: shared); None: no vmap claim


LCE_KW = dict(label_smoothing=0.1, softcap=30.0, z_loss=1e-4)  # test_cuda_triton_matches' options


def kernel_specs() -> list[KernelSpec]:
    import torch
    import torch.nn.functional as F
    from kernel_cases.norms import _rms_llama

    from fxmem_kernels import bias_gelu, geglu, layer_norm, linear_cross_entropy, rms_norm, swiglu
    from fxmem_kernels.linear_cross_entropy import reference as lce_reference

    def gemma(x, w, eps=1e-6):  # transformers' GemmaRMSNorm.forward
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)

    specs = []
    for a in ("none", "tanh"):
        specs.append(KernelSpec(f"bias_gelu {a}", "x,bias", lambda x, b, impl, a=a: bias_gelu(x, b, a, impl),
                                lambda x, b, a=a: F.gelu(x + b, approximate=a), (0, None)))
    specs.append(KernelSpec("swiglu", "gate,up", lambda g, u, impl: swiglu(g, u, impl),
                            lambda g, u: F.silu(g) * u, (0, 0)))
    for a in ("none", "tanh"):
        specs.append(KernelSpec(f"geglu {a}", "gate,up", lambda g, u, impl, a=a: geglu(g, u, a, impl),
                                lambda g, u, a=a: F.gelu(g, approximate=a) * u, (0, 0)))
    specs += [
        KernelSpec("layer_norm", "x,w,b", lambda x, w, b, impl: layer_norm(x, w, b, impl=impl),
                   lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), (0, None, None)),
        KernelSpec("rms_norm (Llama)", "x,w", lambda x, w, impl: rms_norm(x, w, impl=impl), _rms_llama, (0, None)),
        KernelSpec("rms_norm (Gemma, offset 1)", "x,w", lambda x, w, impl: rms_norm(x, w, offset=1.0, impl=impl),
                   gemma, (0, None)),
    ]
    for red in ("mean", "none"):
        specs.append(KernelSpec(
            f"linear_cross_entropy {red}", "lce",
            lambda h, w, b, t, impl, red=red: linear_cross_entropy(h, w, t, b, reduction=red, workspace_bytes=2**20,
                                                                    impl=impl, **LCE_KW),
            lambda h, w, b, t, red=red: lce_reference(h, w, t, b, reduction=red, **LCE_KW), (0, None, None, 0)))
    return specs


def _kernel_inputs(kind: str, dtype, device: str, dry: bool) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    b, n, h = (2, 3, 33) if dry else (4, 16, 1000)  # GPU: the CUDA tests' 64 x 1000

    def rand(*shape, scale=1.0, shift=0.0, grad=True):
        return (torch.randn(shape, generator=g) * scale + shift).to(device, dtype).requires_grad_(grad)

    if kind == "x,bias":
        return [rand(b, n, h), rand(h)]
    if kind == "gate,up":
        return [rand(b, n, h, scale=3.0), rand(b, n, h)]
    if kind == "x,w,b":
        return [rand(b, n, h), rand(h, scale=0.1, shift=1.0), rand(h)]
    if kind == "x,w":
        return [rand(b, n, h), rand(h, scale=0.1, shift=1.0)]
    if kind == "lce":
        n, hd, v = (3, 8, 40) if dry else (75, 64, 5000)
        t = torch.randint(0, v, (b, n), generator=g)
        t.view(-1)[::5] = -100
        return [rand(b, n, hd), rand(v, hd, scale=1 / 8), rand(v), t.to(device)]
    raise ValueError(kind)


def _fwd_bwd(fn, inputs):
    """``fn(*inputs)`` and the gradients of ``sum(out * weight)`` (a random weight) w.r.t. the float inputs."""
    import torch

    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    diff = [t for t in inputs if t.requires_grad]
    return out.detach(), torch.autograd.grad((out.float() * weight).sum(), diff)


def _per_example(fn, inputs, in_dims):
    """Per-example gradients of ``sum(fn(*example)^2)``: ``vmap(grad)`` over dim 0 of the batched inputs."""
    from torch.func import grad, vmap

    argnums = tuple(i for i, t in enumerate(inputs) if t.requires_grad)
    loss = lambda *args: fn(*args).float().square().sum()
    return vmap(grad(loss, argnums=argnums), in_dims=in_dims)(*[t.detach() for t in inputs])


def check_kernel(spec: KernelSpec, dtype, ctx: Ctx, impls: tuple[str, ...]) -> dict:
    """Worst error / tolerance of each path against the reference and the paths against each other."""
    import functools

    inputs = _kernel_inputs(spec.inputs, dtype, ctx.device, ctx.dry)
    tol = TOL[str(dtype).removeprefix("torch.")]
    ref_out, ref_grads = _fwd_bwd(spec.reference, inputs)
    paths = {impl: _fwd_bwd(functools.partial(spec.fused, impl=impl), inputs) for impl in impls}
    pairs = [(paths[i], (ref_out, ref_grads)) for i in impls]
    if len(impls) == 2:
        pairs.append((paths[impls[0]], paths[impls[1]]))
    out = {"fwd": max(_ratio(a[0], b[0], tol) for a, b in pairs),
           "bwd": max(_worst(a[1], b[1], tol) for a, b in pairs)}
    if spec.in_dims is not None:
        ref_v = _per_example(spec.reference, inputs, spec.in_dims)
        per = {i: _per_example(functools.partial(spec.fused, impl=i), inputs, spec.in_dims) for i in impls}
        worst = [_worst(per[i], ref_v, tol) for i in impls]
        if len(impls) == 2:
            worst.append(_worst(per[impls[0]], per[impls[1]], tol))
        out["vmap"] = max(worst)
    return out


def check_dropout(dtype, ctx: Ctx, impls: tuple[str, ...]) -> dict:
    """seeded_dropout per path: y = x * keep / (1 - p) and dx = w * keep / (1 - p) with keep = (y != 0);
    the same seed gives the same values; the kept fraction is 1 - p; vmap(grad) likewise per example.
    (The two paths draw different masks for one seed, so they are not compared with each other.)"""
    import torch
    from torch.func import grad, vmap

    from fxmem_kernels import seeded_dropout

    p, seed = 0.2, 42
    b, n, h = (2, 3, 33) if ctx.dry else (4, 16, 1000)
    tol = TOL[str(dtype).removeprefix("torch.")]
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(b, n, h, generator=g) + 0.5).to(ctx.device, dtype)  # nonzero: kept = (y != 0)
    w = torch.randn(b, n, h, generator=g).to(ctx.device)
    fwd = bwd = vm = 0.0
    for impl in impls:
        xs = x.clone().requires_grad_()
        y = seeded_dropout(xs, p, seed, impl=impl)
        (dx,) = torch.autograd.grad((y.float() * w).sum(), xs)
        keep = y.detach() != 0
        again = seeded_dropout(x, p, seed, impl=impl)
        fwd = max(fwd, _ratio(y, x * keep / (1 - p), tol), 0.0 if torch.equal(again, y.detach()) else math.inf)
        bwd = max(bwd, _ratio(dx, (w * keep / (1 - p)).to(dtype), tol))
        rate = keep.float().mean().item()
        if abs(rate - (1 - p)) > 4 * math.sqrt(p * (1 - p) / keep.numel()):
            fwd = math.inf
        yv = vmap(lambda e, impl=impl: seeded_dropout(e, p, seed, impl=impl))(x)
        gv = vmap(grad(lambda e, we, impl=impl: (seeded_dropout(e, p, seed, impl=impl).float() * we).sum()))(x, w)
        vm = max(vm, _ratio(gv, (w * (yv != 0) / (1 - p)).to(dtype), tol))
    return {"fwd": fwd, "bwd": bwd, "vmap": vm}


def check_clip(dtype, ctx: Ctx, impls: tuple[str, ...]) -> dict:
    """clipped_sum (per-example norms, clip factors, fp32 sums): each path against the plain expression
    in fp32 (bench/kernel_cases/clip_accumulate.py's) and the paths against each other. Not differentiable."""
    import torch
    from kernel_cases.clip_accumulate import _unfused

    from fxmem_kernels import clipped_sum

    m = 4 if ctx.dry else 32
    shapes = [(5, 7), (7,), (2, 3, 5)] if ctx.dry else [(300, 257), (257,), (4, 8, 33)]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(m, *s, generator=g).to(ctx.device, dtype) for s in shapes]
    c = math.sqrt(sum(math.prod(s) for s in shapes))  # about the median norm: half get clipped
    want_sums, want_norms = _unfused(c)(*[t.float() for t in grads])
    tol = (1e-4, 1e-5)
    got = {i: clipped_sum(grads, c, impl=i) for i in impls}
    worst = [max(_worst(s, want_sums, tol), _ratio(nm, want_norms, tol)) for s, nm in got.values()]
    if len(impls) == 2:
        (s0, n0), (s1, n1) = got.values()
        worst.append(max(_worst(s0, s1, tol), _ratio(n0, n1, tol)))
    return {"fwd": max(worst)}


def _pytest_cuda() -> dict:
    """``pytest -m cuda tests/fused_kernels`` in this process: the gate for FXMEM_KERNELS_TRITON."""
    import pytest

    counts: dict[str, int] = {}
    failed: list[str] = []

    class Count:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.when == "setup" and not report.passed):
                outcome = report.outcome if report.when == "call" or report.skipped else "error"
                counts[outcome] = counts.get(outcome, 0) + 1
                if outcome in ("failed", "error"):
                    failed.append(report.nodeid)

    # pytest puts tests/ on sys.path and imports tests/fused_kernels as "fused_kernels", the name of
    # bench/fused_kernels.py: move bench's modules of such names aside while it runs, and drop its after.
    tests = HERE.parent / "tests"
    names = {p.stem for p in tests.iterdir()}
    aside = {n: m for n, m in sys.modules.items() if n.split(".")[0] in names}
    path = list(sys.path)
    for n in aside:
        del sys.modules[n]
    try:
        args = ["-q", "-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts=", str(tests / "fused_kernels")]
        rc = pytest.main(args, plugins=[Count()])
    finally:
        for n, m in list(sys.modules.items()):
            if str(getattr(m, "__file__", None) or "").startswith(str(tests)):
                del sys.modules[n]
        sys.modules.update(aside)
        sys.path[:] = path
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no tests"
    return {"status": "ok" if int(rc) == 0 else "MISMATCH", "paths": summary,
            "reason": ("failed: " + ", ".join(failed))[:600] if failed else None}


def step_kernels(ctx: Ctx) -> None:
    import torch

    from fxmem_kernels._common import ENV_TRITON, HAS_TRITON

    if not ctx.cuda and not ctx.dry:
        ctx.add("kernels", "all kernels", NO_CUDA)
        return
    checks: list[tuple[str, Callable]] = [(s.name, lambda dt, im, s=s: check_kernel(s, dt, ctx, im))
                                          for s in kernel_specs()]
    checks += [("seeded_dropout", lambda dt, im: check_dropout(dt, ctx, im)),
               ("clipped_sum", lambda dt, im: check_clip(dt, ctx, im))]
    for dtype in (torch.float32, torch.bfloat16):
        impls: tuple[str, ...] = ("triton", "torch") if HAS_TRITON else ("torch",)
        note = None if HAS_TRITON else "triton not installed: portable path only"
        if not ctx.cuda and dtype == torch.bfloat16:
            # NOTES.md: bf16 tl.dot multiplies raw bits in the interpreter; casts truncate
            impls, note = ("torch",), "Triton path not run: bf16 in Triton's interpreter is not meaningful"
        for name, fn in checks:
            t0 = time.perf_counter()
            status, res = ctx.limits.guarded(60, f"kernel {name}", lambda fn=fn, dt=dtype, im=impls: fn(dt, im))
            row = dict(dtype=str(dtype).removeprefix("torch."), paths="+".join(
                ("triton (interpreter)" if i == "triton" and not ctx.cuda else i) for i in impls),
                wall_s=time.perf_counter() - t0, reason=note)
            if status == "ok":
                row.update(res)
                status = "ok" if all(v <= 1.0 for k, v in res.items()) else "MISMATCH"
            else:
                row["reason"] = res
            ctx.add("kernels", name, status, **row)
    # The CUDA tests themselves; without CUDA (a dry run) they skip, which checks that they collect.
    old = os.environ.pop(ENV_TRITON, None)  # the tests set it themselves where they need it
    try:
        t0 = time.perf_counter()
        status, res = ctx.limits.guarded(120, "pytest -m cuda", _pytest_cuda)
    finally:
        if old is not None:
            os.environ[ENV_TRITON] = old
    row = res if status == "ok" else {"status": status, "reason": res}
    status = row.pop("status")
    ctx.add("kernels", "pytest -m cuda tests/fused_kernels", status if ctx.cuda or status != "ok" else NO_CUDA,
            wall_s=time.perf_counter() - t0, **row)


# --- step 2: dropout replay --------------------------------------------------------------------

REPLAY_OPTIONS = {"level 0": {"level": 0}, "level 1": {"level": 1}, "level 2": {"level": 2},
                  "memory_budget 0.5": {"memory_budget": 0.5}}


def step_replay(ctx: Ctx) -> None:
    """tests/test_replay.py's check on the device: one training step of HF GPT-2 with dropout (0.1:
    embeddings, attention, residuals) under fxmem (eager inner compiler, no lowering) equals eager's
    with the same seed, bit for bit: loss, every gradient, and the generator's state after."""
    if not ctx.cuda and not ctx.dry:
        ctx.add("replay", "all configs", NO_CUDA)
        return
    import configs
    import torch

    from fxmem.models import build

    kw = dict(configs.MODELS["hf_gpt2"]["full"])
    if ctx.dry:
        kw = dict(batch=2, seq=32, vocab=256, d=32, layers=2, heads=2)
    w = build("hf_gpt2", **{**kw, "dropout": 0.1})
    w.model.to(ctx.device)
    batch = {k: v.to(ctx.device) for k, v in w.batch.items()}

    def step(fn, model, seed):
        torch.manual_seed(seed)  # every device's generator
        model.zero_grad(set_to_none=True)
        loss = w.loss(fn(**batch))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], torch.rand(4, device=ctx.device)

    def compare(got, want) -> dict:
        same = [torch.equal(a, b) for a, b in zip(got[1], want[1])]
        diff = max((float((a.double() - b.double()).abs().max()) for a, b in zip(got[1], want[1])), default=0.0)
        return {"loss_equal": torch.equal(got[0], want[0]), "grads_equal": f"{sum(same)}/{len(same)}",
                "all_grads": all(same), "rng_equal": torch.equal(got[2], want[2]), "max_grad_diff": diff}

    ref, ref2 = step(w.model, w.model, 123), step(w.model, w.model, 7)
    t0 = time.perf_counter()
    r = compare(step(w.model, w.model, 123), ref)
    ok = r.pop("all_grads") and r["loss_equal"] and r["rng_equal"]
    ctx.add("replay", "eager, repeated (control)", "ok" if ok else "MISMATCH", wall_s=time.perf_counter() - t0,
            reason=None if ok else "eager itself is not deterministic here: fxmem cannot be bit-identical", **r)
    for name, opts in REPLAY_OPTIONS.items():
        def run(opts=opts):
            torch._dynamo.reset()
            model = copy.deepcopy(w.model)
            compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "lowering": False, **opts})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = compare(step(compiled, model, 123), ref)
                out["second_equal"] = compare(step(compiled, model, 7), ref2)["all_grads"]
            return out

        t0 = time.perf_counter()
        status, res = ctx.limits.guarded(60, f"replay {name}", run)
        row = {"wall_s": time.perf_counter() - t0}
        if status == "ok":
            good = res.pop("all_grads") and res["loss_equal"] and res["rng_equal"] and res["second_equal"]
            row.update(res)
            status = "ok" if good else "MISMATCH"
        else:
            row["reason"] = res
        ctx.add("replay", name, status, **row)


# --- step 3: peaks -----------------------------------------------------------------------------


def peak_models(dry: bool, scale: float) -> dict[str, tuple[str, dict]]:
    """name -> (fxmem.models builder, keyword arguments). GPU: GPT-2 small as GPT2Config ships it (dropout
    0.1) at 16 x 1024 tokens, a 1.2B Llama (hidden 2048, 16 layers, 16 heads, MLP 8192, vocab 32000) at
    8 x 2048; ``--batch-scale`` multiplies the batches."""
    import configs

    if dry:
        return {"gpt2_small": ("hf_gpt2", dict(batch=2, seq=32, vocab=512, d=32, layers=2, heads=2, dropout=0.1)),
                "llama_1b": ("hf_llama", dict(batch=2, seq=32, vocab=512, d=32, layers=2, heads=2))}
    b = lambda n: max(1, round(n * scale))  # noqa: E731
    return {"gpt2_small": ("hf_gpt2", dict(configs.MODELS["gpt2_small"]["full"], batch=b(16), seq=1024)),
            "llama_1b": ("hf_llama", dict(batch=b(8), seq=2048, vocab=32000, d=2048, layers=16, heads=16))}


def peak_configs(dry: bool, offload: bool = True) -> list:
    """bench/configs.py configurations. The dry run swaps Inductor for nop compilers (``mincut_eager``:
    the same min-cut partitioner and ``activation_memory_budget``) and fxmem's eager inner compiler.
    ``offload=False`` leaves offload's four out (the dry run's second model: CI's time for it)."""
    import configs

    tc = "mincut_eager" if dry else "inductor"
    inner = "eager" if dry else "inductor"
    fx = lambda name, **o: configs.Config(name, "fxmem", {"inner": inner, "lowering": "default", **o},  # noqa: E731
                                          f"fxmem's defaults{', ' if o else ''}{o or ''}")
    # The ones without a compile first, then the most wanted: a model whose time runs out keeps those.
    return [configs.parse("eager"), configs.parse("eager+hf_ckpt"), fx("fxmem default"), configs.parse(tc),
            fx("fxmem level 1", level=1), configs.parse(f"{tc}+budget0.5"),
            fx("fxmem peak_budget"),  # its bytes: 0.6 x fxmem default's predicted peak, set when it runs
            # offload (issue #58): recompute's least peak, 0.8 x it with offload, offload's own least
            # peak, and the seed's recipe (HF checkpointing + save_on_cpu) beside them
            *([fx("fxmem recompute-only", memory_budget=0.0), fx("fxmem offload@0.8", offload=True),
               fx("fxmem offload", level=1, offload=True), configs.parse("eager+hf_ckpt+save_on_cpu")]
              if offload else [])]


def measure_peak(ctx: Ctx, base, loss_of, batch: dict, cfg) -> dict:
    """One configuration: a copy of the model, compiled (or not), 2 warm-up steps (the first compiles),
    1 step for the peak (``step_perf``: max_memory_allocated above what was live at entry), then
    ``ctx.steps`` timed steps (median). bf16 autocast around forward and loss."""
    import statistics

    import configs
    import torch

    import fxmem
    from fxmem.profiling import step_perf

    torch._dynamo.reset()
    model = copy.deepcopy(base)
    try:
        fn = configs.build(model, cfg)
    except configs.Skip as e:
        return {"status": f"skipped: {e}"}

    def step():
        with torch.autocast(ctx.device, dtype=torch.bfloat16):
            loss = loss_of(fn(**batch))
        loss.backward()
        return loss.detach()

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = step()
    if ctx.cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    with step_perf(ctx.device) as perf:
        step()
    peak = perf.result.peak_bytes
    times = []
    for _ in range(ctx.steps):
        model.zero_grad(set_to_none=True)
        with step_perf(ctx.device, memory=False) as tp:
            step()
        times.append(tp.result.time_s)
    median = statistics.median(times)
    out = {"status": "ok", "peak_bytes": peak, "peak_mib": peak / MIB, "step_ms": median * 1e3,
           "step_times_s": times, "compile_s": max(0.0, first - median), "loss": float(loss), "options": dict(
               cfg.options)}
    if ctx.cuda and perf.result.baseline_bytes is not None:
        out["device_fill"] = (perf.result.baseline_bytes + peak) / torch.cuda.get_device_properties(0).total_memory
    if cfg.kind == "fxmem":
        try:
            rep = fxmem.report(fn)
            out["graphs"] = len(rep.graphs)
            out["predicted_bytes"] = rep.predict_peak()
            out["predicted_mib"] = out["predicted_bytes"] / MIB
            out["predicted_ratio"] = out["predicted_bytes"] / peak if peak else None
        except Exception as e:  # noqa: BLE001 - the measurement stands without a prediction
            out["reason"] = f"no prediction: {_first_line(e)}"
    return out


def step_peaks(ctx: Ctx, scale: float = 1.0) -> None:
    if not ctx.cuda and not ctx.dry:
        ctx.add("peaks", "all models", NO_CUDA)
        return
    models = peak_models(ctx.dry, scale)
    for i, (model_name, (builder, kwargs)) in enumerate(models.items()):
        share = ctx.limits.left() / (len(models) - i)  # a slow model leaves the next its share
        status, res = ctx.limits.guarded(share, f"peaks {model_name}",
                                         lambda a=(ctx, model_name, builder, kwargs): peaks_of_model(*a))
        ctx.free()
        if status != "ok":
            ctx.add("peaks", "the configurations not listed", status, model=model_name, reason=res)


def peaks_of_model(ctx: Ctx, model_name: str, builder: str, kwargs: dict) -> None:
    """Every configuration of ``peak_configs`` on one model, ratios to eager's row."""
    import configs

    from fxmem.models import build

    t0 = time.perf_counter()
    w = build(builder, **kwargs)
    base = w.model.to(ctx.device)
    batch = {k: v.to(ctx.device) for k, v in w.batch.items()}
    n_params = sum(p.numel() for p in base.parameters())
    shape = f"batch {kwargs['batch']} x seq {kwargs['seq']}, vocab {kwargs['vocab']}, {n_params / 1e6:.0f}M params"
    print(f"[peaks] {model_name}: {shape} (built in {time.perf_counter() - t0:.0f} s)", flush=True)
    eager = predicted_default = least_recompute = None
    for cfg in peak_configs(ctx.dry, offload=not ctx.dry or model_name == "gpt2_small"):
        if cfg.name == "fxmem peak_budget":
            ref = predicted_default or (eager or {}).get("peak_bytes")
            if not ref:
                ctx.add("peaks", cfg.name, "skipped: no fxmem default or eager peak to set it from", model=model_name)
                continue
            cfg = configs.Config(cfg.name, "fxmem", {**cfg.options, "peak_budget": int(0.6 * ref)}, cfg.description)
        if cfg.name == "fxmem offload@0.8":
            if not least_recompute:
                ctx.add("peaks", cfg.name, "skipped: no fxmem recompute-only peak to set it from", model=model_name)
                continue
            cfg = configs.Config(cfg.name, "fxmem", {**cfg.options, "peak_budget": int(0.8 * least_recompute)},
                                 cfg.description)
        t0 = time.perf_counter()
        status, res = ctx.limits.guarded(90 if ctx.dry else 150, f"{model_name} {cfg.name}",
                                         lambda cfg=cfg: measure_peak(ctx, base, w.loss, batch, cfg))
        row = {"model": model_name, "shape": shape, "wall_s": time.perf_counter() - t0}
        if status == "ok":
            status = res.pop("status")
            row.update(res)
        else:
            row["reason"] = res
        ctx.free()
        if status == "ok" and cfg.name == "eager":
            eager = row
        if status == "ok" and cfg.name == "fxmem default":
            predicted_default = row.get("predicted_bytes")
        if status == "ok" and cfg.name == "fxmem recompute-only":
            least_recompute = row["peak_bytes"]
        if status == "ok" and eager:
            row["peak_vs_eager"] = row["peak_bytes"] / eager["peak_bytes"] if eager["peak_bytes"] else None
            row["time_vs_eager"] = row["step_ms"] / eager["step_ms"]
        ctx.add("peaks", cfg.name, status, **row)


# --- step 4: fused loss ------------------------------------------------------------------------


def _optional(module: str, attr: str) -> tuple[Any, str | None]:
    """(the attribute, None), or (None, why it is not there)."""
    try:
        return getattr(importlib.import_module(module), attr), None
    except ImportError as e:
        return None, _first_line(e)
    except Exception as e:  # noqa: BLE001 - e.g. a library that fails to import without a GPU
        return None, f"import failed: {_first_line(e)}"


@dataclass(frozen=True)
class Variant:
    fn: Callable | None  # fn(hidden, weight, target) -> loss; None: not run
    status: str = ""  # why not run: "not installed" or "skipped: ..."
    reason: str | None = None


def loss_variants(ctx: Ctx) -> dict[str, Variant]:
    """The step's variants by name; the first is the reference."""
    import torch
    import torch.nn.functional as F

    from fxmem_kernels import linear_cross_entropy
    from fxmem_kernels._common import HAS_TRITON

    out = {"unfused (HF: logits, fp32 upcast, cross_entropy)": Variant(
        lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t))}
    out["fxmem (Triton)"] = (Variant(lambda h, w, t: linear_cross_entropy(h, w, t, impl="triton")) if HAS_TRITON
                             else Variant(None, "not installed", "triton"))
    out["fxmem (portable)"] = Variant(lambda h, w, t: linear_cross_entropy(h, w, t, impl="torch"))
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        opts = torch.nn.LinearCrossEntropyOptions()
        out["torch chunked F.linear_cross_entropy"] = Variant(
            lambda h, w, t: F.linear_cross_entropy(h, w, t, options=opts))
    else:
        out["torch chunked F.linear_cross_entropy"] = Variant(None, f"skipped: not in torch {torch.__version__}")
    for name, module, attr, call in [
            ("Liger-Kernel", "liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss",
             lambda cls: (lambda h, w, t: cls()(w, h, t))),
            ("Cut Cross-Entropy", "cut_cross_entropy", "linear_cross_entropy",
             lambda fn: (lambda h, w, t: fn(h, w, t)))]:
        found, why = _optional(module, attr)
        if found is None:
            out[name] = Variant(None, "not installed", why)
        elif not ctx.cuda:  # Triton kernels for CUDA only
            out[name] = Variant(None, NO_CUDA)
        else:
            out[name] = Variant(call(found))
    return out


def step_loss(ctx: Ctx) -> None:
    """Each variant side by side with the unfused loss (bench/fused_kernels.py's ``run_case``: loss and
    gradients checked against the first variant, exact peak of one forward + backward, median time of
    interleaved steps), one case per variant so that one failing library costs only its row."""
    if not ctx.cuda and not ctx.dry:
        ctx.add("loss", "all variants", NO_CUDA)
        return
    import torch
    from fused_kernels import run_case
    from kernel_cases import Case

    # Gemma-2 2B's head: vocabulary 256000, hidden 2304. The dry run: fp32 (bf16 is not meaningful
    # in Triton's interpreter), tiny.
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    h, v = (16, 512) if ctx.dry else (2304, 256000)
    variants = loss_variants(ctx)
    ref_name = next(iter(variants))
    reference = variants[ref_name].fn
    for n in ((64,) if ctx.dry else (8192, 16384)):
        shape = f"N={n} H={h} V={v} {str(dtype).removeprefix('torch.')}"

        def make(n=n):
            g = torch.Generator(ctx.device).manual_seed(0)
            hidden = torch.randn(n, h, generator=g, device=ctx.device).to(dtype).requires_grad_()
            weight = (torch.randn(v, h, generator=g, device=ctx.device) / h**0.5).to(dtype).requires_grad_()
            return hidden, weight, torch.randint(0, v, (n,), generator=g, device=ctx.device)

        ref_row = None
        for name, var in list(variants.items())[1:]:
            if var.fn is None:
                ctx.add("loss", name, var.status, case=shape, reason=var.reason)
                continue
            case = Case("linear_cross_entropy", shape, make, {ref_name: reference, name: var.fn},
                        rtol=1e-4 if dtype == torch.float32 else 2e-2)
            status, res = ctx.limits.guarded(60, f"loss {shape} {name}", lambda case=case: run_case(case, ctx.steps,
                                                                                                   ctx.device))
            ctx.free()
            if status != "ok":
                ctx.add("loss", name, status, case=shape, reason=res)
                continue
            note = "Triton's interpreter on CPU: its time means nothing" if "Triton" in name and not ctx.cuda else None
            for r in res:
                r = {"case": shape, "rel_err": r["rel_err"], "peak_bytes": r["peak_bytes"], "peak_mib":
                     r["peak_bytes"] / MIB, "ms": r["time_s"] * 1e3, "times_s": r["times"],
                     "peak_ratio": r["peak_ratio"], "time_ratio": r["time_ratio"], "variant": r["variant"],
                     "status": "ok" if r["ok"] else "MISMATCH"}
                if r["variant"] == ref_name:
                    if ref_row is None:  # the reference's row once per shape (each case runs it again)
                        ref_row = ctx.add("loss", ref_name, r.pop("status"), **r)
                    continue
                ctx.add("loss", name, r.pop("status"), reason=note, **r)


# --- step 5: DP-SGD ----------------------------------------------------------------------------

DP_SHAPE = dict(vocab=4096, d=256, layers=4, heads=4, seq=64, batch=256)  # bench/dpsgd_models.py's GPT, ~5.3M params


def step_dpsgd(ctx: Ctx) -> None:
    """fxmem's ``clipped_grad`` (ghost clipping, the whole batch in one chunk) against Opacus ghost
    clipping and a non-private step, each checked against the explicit per-example reference
    (bench/ghost.py's variants and reference, run side by side by bench/fused_kernels.py's
    ``run_case``, one case per variant)."""
    if not ctx.cuda and not ctx.dry:
        ctx.add("dpsgd", "all variants", NO_CUDA)
        return
    import ghost
    import torch
    from dpsgd_models import gpt, per_example_loss
    from fused_kernels import run_case
    from kernel_cases import Case

    s = ghost.QUICK if ctx.dry else DP_SHAPE
    C, B = 1.0, s["batch"]
    model, _, ids, labels = gpt(s["vocab"], s["d"], s["layers"], s["heads"], s["seq"], B)
    model.to(ctx.device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids, labels = ids.to(ctx.device), labels.to(ctx.device)
    loss = per_example_loss(model)
    n = sum(p.numel() for p in params.values())
    print(f"[dpsgd] GPT {s['layers']} layers, d={s['d']}, vocab {s['vocab']}, {n / 1e6:.2f}M params, batch {B} x "
          f"seq {s['seq']}", flush=True)
    inner = "eager" if ctx.dry else "inductor"
    variants: dict[str, Callable] = {
        "fxmem ghost clipping": lambda: ghost.fxmem_variant(loss, C, B, inner, ghost=True)[1],
        "Opacus ghost clipping": lambda: ghost.opacus_variant(model, C, B),
        "non-private step (no clipping)": lambda: ghost.nonprivate_variant(model),
    }
    reference = ghost.reference(loss, C, m=8 if ctx.dry else 64)  # vmap(grad) over chunks of m, float64 norms
    rtol = 1e-4 if ctx.cuda else 1e-5  # bench/ghost.py's 1e-5 on CPU; other summation orders on a GPU
    _, no_opacus = _optional("opacus", "GradSampleModule")
    grads_of = lambda fn, inputs: (torch.zeros(()), [g for _, g in sorted(fn(*inputs).items())])  # noqa: E731
    rows = {}
    for name, make in variants.items():
        t0 = time.perf_counter()
        if name.startswith("Opacus") and no_opacus:
            rows[name] = {"status": "not installed", "reason": no_opacus}
            continue

        def run(make=make, name=name):
            case = Case("dpsgd", name, lambda: (params, ids, labels),
                        {"per-example reference": reference, name: make()}, grad_of=grads_of, rtol=rtol)
            return run_case(case, ctx.steps, ctx.device)

        status, res = ctx.limits.guarded(60 if ctx.dry else 90, f"dpsgd {name}", run)
        ctx.free()
        row = {"params": n, "batch": B, "wall_s": time.perf_counter() - t0}
        if status == "ok":
            r = res[1]
            row.update(rel_err=r["rel_err"], peak_bytes=r["peak_bytes"], peak_mib=r["peak_bytes"] / MIB,
                       ms=r["time_s"] * 1e3, times_s=r["times"])
            status = "ok" if r["ok"] or name.startswith("non-private") else "MISMATCH"
            if name.startswith("non-private"):
                row["rel_err"] = None  # not clipped: differs from the reference by design
        else:
            row["reason"] = res
        rows[name] = row
        row["status"] = status
    op = rows.get("Opacus ghost clipping", {})
    for row in rows.values():
        if row["status"] == "ok" and op.get("status") == "ok":
            row["peak_vs_opacus"] = row["peak_bytes"] / op["peak_bytes"] if op["peak_bytes"] else None
            row["time_vs_opacus"] = row["ms"] / op["ms"]
    for name, row in rows.items():
        ctx.add("dpsgd", name, row.pop("status"), **row)


# --- main --------------------------------------------------------------------------------------

# name -> (function, seconds it is given at least: 570 in all, the run's default limit)
STEPS: dict[str, tuple[Callable[..., None], float]] = {
    "kernels": (step_kernels, 90), "replay": (step_replay, 45), "peaks": (step_peaks, 300),
    "loss": (step_loss, 60), "dpsgd": (step_dpsgd, 75),
}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, name="gpu", quick=False, threads=0, out_dir=False)
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny sizes (CPU: Triton's interpreter)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where results go (default bench/results; with --dry-run a new temporary folder)")
    ap.add_argument("--only", default="", help=f"comma-separated steps (default all): {', '.join(STEPS)}")
    ap.add_argument("--time-limit", type=float, default=sum(s for _, s in STEPS.values()),
                    help="seconds for the whole run (default %(default)s): each step gets its share, and the "
                         "time earlier steps leave")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 5; dry run 2)")
    ap.add_argument("--batch-scale", type=float, default=1.0, help="multiplies the peaks step's batch sizes")
    a = common.parse(ap, argv)
    a.command = a.command.replace("python bench/gpu.py", "python -m bench.gpu", 1)
    only = common.split(a.only) or list(STEPS)
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {', '.join(STEPS)}")
    common.set_threads(a.threads)
    if a.dry_run and not a.name.endswith("-dry-run"):
        a.name += "-dry-run"
    out_dir = a.out_dir or (Path(tempfile.mkdtemp(prefix="fxmem-gpu-dry-run-")) if a.dry_run else common.RESULTS)

    import torch

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "name": a.name, "dry_run": a.dry_run, "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else None,
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "time_limit_s": a.time_limit, "steps": only, "timed_steps": a.steps or (2 if a.dry_run else 5),
        "batch_scale": a.batch_scale, "fxmem_kernels_triton_env": os.environ.get("FXMEM_KERNELS_TRITON"),
        "step_s": {}, "wall_s": 0.0,
    }
    meta = common.metadata(a.command)
    rows: list[dict] = []
    t_start = time.monotonic()

    def write() -> None:
        info["wall_s"] = time.monotonic() - t_start
        harness.write(a.name, rows, out_dir, meta=meta, run=info, spec="gpu")

    def add(step: str, item: str, status: str, **metrics) -> dict:
        row = {"step": step, "item": item, "status": status, **{k: v for k, v in metrics.items() if v is not None}}
        taken, n = {results_format.case_name(r, GPU_CASE) for r in rows}, 1
        while results_format.case_name(row, GPU_CASE) in taken:  # a retry, a step's error after its rows: told apart
            n += 1
            row["item"] = f"{item} ({n})"
        rows.append(row)
        write()
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()
                 if k not in ("step", "item", "status") and not isinstance(v, (list, dict))}
        print(f"[{step}] {item}: {status}  {shown}", flush=True)
        return row

    limits = Limits()
    ctx = Ctx(info["device"], a.dry_run, info["timed_steps"], limits, add)
    print(f"bench.gpu: {info['device']} ({info['device_name'] or 'no CUDA'}), {'dry run' if a.dry_run else 'full'}; "
          f"steps {', '.join(only)}; writing {out_dir / a.name}.json and .md", flush=True)
    write()
    for i, name in enumerate(only):
        fn, share = STEPS[name]
        left = a.time_limit - (time.monotonic() - t_start)
        later = sum(STEPS[s][1] for s in only[i + 1:])
        budget = min(left, max(share, left - later))
        t0 = time.monotonic()
        if budget <= 1:
            add(name, "step", "skipped: time limit (the run's)")
            continue
        print(f"== step {i + 1}/{len(only)}: {name} ({budget:.0f} s at most)", flush=True)
        kwargs = {"scale": a.batch_scale} if name == "peaks" else {}
        status, res = limits.guarded(budget, f"step {name}", lambda fn=fn, kw=kwargs: fn(ctx, **kw))
        if status != "ok":
            add(name, "step", status, reason=res)
        if not any(r["step"] == name for r in rows):
            add(name, "step", "error", reason="the step recorded no result")
        info["step_s"][name] = time.monotonic() - t0
        with contextlib.suppress(Exception):
            ctx.free()
        write()
    write()
    print()
    print((out_dir / f"{a.name}.md").read_text())
    bad = [r for r in rows if r["status"] in STATUS_BAD]
    print(f"wrote {out_dir / a.name}.json and .md in {info['wall_s']:.0f} s; "
          f"{len(rows)} rows, {len(bad)} errors or mismatches", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
