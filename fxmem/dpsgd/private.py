"""``make_private``: Opacus' ``PrivacyEngine.make_private`` API on fxmem's compiled per-example
chunks, so that a plain PyTorch loop trains with DP-SGD unchanged:

    model, optimizer, loader = make_private(module=model, optimizer=optimizer, data_loader=loader,
                                            noise_multiplier=1.1, max_grad_norm=1.0)
    for x, y in loader:                       # Poisson-sampled batches (sizes vary, 0 included)
        optimizer.zero_grad()
        loss = criterion(model(x), y)         # criterion with reduction="mean" (or loss_reduction="sum")
        loss.backward()                       # .grad = sum_i clip(g_i) / expected batch size
        optimizer.step()                      # + N(0, (sigma C / expected batch size)^2), accounted
    optimizer.accountant.epsilon(delta=1e-5)

How: the wrapped module's forward runs the model without autograd and returns its output as
the output of an autograd Function; that Function's backward gets ``dL/d output`` ([B, ...]),
and the per-example gradient of example i is the vector-Jacobian product of the model's
output at example i with row i of it (times B for a mean-reduced loss: Opacus' rescaling). So
``backward`` calls :func:`clipped_grad` on the per-example "loss" ``<model(x_i), v_i>``: the
per-example region runs in fxmem's compiled chunks (ghost norms where they apply) and only the
clipped sum ever reaches ``.grad``. The forward therefore runs twice (once for the loss, once
inside the chunks), as Opacus' ghost clipping runs the backward twice.

Under ``torch.distributed`` (initialized when ``make_private`` is called) each rank Poisson-
samples its own shard of the dataset, the clipped sums are all-reduced (SUM) in backward, the
expected batch size is the global one, and the noise is drawn on rank 0 and broadcast, so
every rank applies the same noisy gradient (one draw of noise per step, as a single process).
"""

from __future__ import annotations

import math
import numbers
import secrets
from typing import Any, Mapping

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, Subset

from .accounting import PrivacyAccountant, noise_multiplier_for
from .clipping import _compile_options, check_clipping_norm, clipped_grad
from .functional import make_functional
from .rnn import shadow
from .sampling import poisson_loader
from .validate import validate

__all__ = ["DEFAULT_ACCOUNTANT", "DPOptimizer", "PrivacyEngine", "PrivateModule", "make_private",
           "make_private_with_epsilon"]

LOSS_REDUCTIONS = ("mean", "sum")
CLIPPINGS = ("flat", "per_layer")  # Opacus' third, "adaptive" (AdaClip), is refused by name
# Opacus' grad_sample_mode names -> how fxmem computes the clipped sum. Every mode runs the same
# route, fxmem's compiled per-example chunks (ghost norms where they pay, unless options say
# ghost_clipping=False): the modes differ in Opacus only in how it gets per-sample gradients,
# which fxmem gets its own way; the clipped sum is the same. The "ghost" modes return Opacus'
# 4-tuple (module, optimizer, criterion, data_loader) and insist on ghost norms.
GRAD_SAMPLE_MODES = {
    "hooks": "fxmem's compiled chunks (Opacus' default: per-sample gradients from module hooks)",
    "functorch": "fxmem's compiled chunks (Opacus: vmap(grad) per layer)",
    "ew": "fxmem's compiled chunks (Opacus: expanded weights)",
    "ghost": "fxmem's compiled chunks with ghost norms; returns (module, optimizer, criterion, data_loader)",
    "ghost_fsdp": "as 'ghost' (Opacus: ghost clipping under FSDP; fxmem all-reduces itself under "
                  "torch.distributed)",
}
UNSUPPORTED_GRAD_SAMPLE_MODES = {
    "ghost_tp": "ghost clipping under tensor parallelism",
    "no_op": "no per-sample gradients (the user computes them)",
}
# make_private arguments of Opacus 1.6 that fxmem refuses rather than silently ignore
OPACUS_OPTIMIZER_KWARGS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound",
                           "min_clipbound", "unclipped_num_std")  # AdaClipDPOptimizer's (clipping="adaptive")
DEFAULT_ACCOUNTANT = "prv"  # opacus.PrivacyEngine's default (opacus 1.6 privacy_engine.py): same script, same epsilon


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with 63 bits from the operating system's CSPRNG (``secrets``): no seed
    an attacker can guess or replay. (Opacus draws every number from torchcsprng's
    ``/dev/urandom`` generator instead; see docs/per-example.md.)"""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def _distributed() -> tuple[int, int] | None:
    """(rank, world size) when a process group is up, else None."""
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return None


def _example_loss(model: nn.Module):
    """Example i's "loss" ``scale * <model(x_i), v_i>`` (``v = dL/d output``, ``[B, ...]``) as a
    function of ``(trainable, frozen, scale, v_i, *x_i)``: its gradient is the vector-Jacobian
    product of the model's output at example i with row i, i.e. example i's gradient of the
    user's loss (``scale`` = B undoes a mean's 1/B)."""
    def example_loss(trainable, frozen, scale, v, *xs):
        out = functional_call(model, {**frozen, **trainable}, tuple(x[None] for x in xs))
        return (out * v[None]).sum() * scale
    return example_loss


class _PrivateOutput(torch.autograd.Function):
    """Identity on the model's output; its backward turns ``dL/d output`` into the clipped
    per-example gradient sum on the parameters' ``.grad``."""

    @staticmethod
    def forward(ctx, owner: "PrivateModule", anchor: torch.Tensor, out: torch.Tensor, *inputs):
        ctx.owner, ctx.inputs = owner, inputs
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        ctx.owner._accumulate(grad_out, ctx.inputs)
        return (None,) * (3 + len(ctx.inputs))


class PrivateModule(nn.Module):
    """The module :func:`make_private` returns (Opacus' ``GradSampleModule``): called on a batch
    of tensors (dim 0 the batch) with autograd on, its output's backward leaves
    ``sum_i clip(grad of example i) / expected_batch_size`` on each trainable parameter's
    ``.grad`` (added to what is there, as autograd does). Under ``torch.no_grad()`` it is the
    plain module. ``_module`` is the user's module."""

    def __init__(self, module: nn.Module, max_grad_norm: float | tuple[float, ...], expected_batch_size: int,
                 loss_reduction: str, microbatch_size: int | str | None, memory_budget,
                 options: Mapping[str, Any] | None, grad_sample: bool = False):
        super().__init__()
        self._module = module
        # A float (flat clipping) or one bound per trainable parameter, in ``_trainable``'s order
        # (per-layer clipping); ``max_grad_norm`` is then their L2 norm, the sensitivity of the
        # clipped sum (Opacus' DPPerLayerOptimizer reports and noises with the same).
        self.clipping_bounds = max_grad_norm
        self.max_grad_norm = math.hypot(*max_grad_norm) if isinstance(max_grad_norm, tuple) else max_grad_norm
        self.expected_batch_size = expected_batch_size
        self.loss_reduction = loss_reduction
        self.grad_sample = grad_sample
        _, self._trainable, self._frozen = make_functional(module, strict=False)  # validated (strict)
        self._shadow = shadow(module)  # RNNs as their cell loops, every tensor shared (rnn.py)
        self._pairs = list(zip(module.modules(), self._shadow.modules()))
        self._clip_args = dict(microbatch_size=microbatch_size, memory_budget=memory_budget,
                               options=dict(options or {}))
        self._grad_fns: dict[int, Any] = {}
        self._anchor = torch.zeros((), requires_grad=True)  # puts the output on the autograd graph
        self.dist = _distributed()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._module(*inputs)
        if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
            raise ValueError("make_private: the private module takes its batch as positional tensors "
                             f"(dim 0 the batch), got {[type(x).__name__ for x in inputs]}")
        if any(x.requires_grad for x in inputs):
            raise ValueError("make_private: an input requires grad; the private module computes "
                             "parameter gradients only (no gradient reaches its inputs)")
        with torch.no_grad():
            out = self._module(*inputs)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ValueError(f"make_private: the module must return one floating-point tensor, got "
                             f"{type(out).__name__}")
        return _PrivateOutput.apply(self, self._anchor, out, *inputs)

    def _grad_fn(self, n_inputs: int):
        """The compiled clipped sum for ``n_inputs`` batch tensors (one per arity)."""
        if n_inputs not in self._grad_fns:
            self._grad_fns[n_inputs] = clipped_grad(
                _example_loss(self._shadow), self.clipping_bounds, batch_argnums=tuple(range(3, 4 + n_inputs)),
                **self._clip_args)
        return self._grad_fns[n_inputs]

    def _grad_samples(self, scale: torch.Tensor, v: torch.Tensor, inputs: tuple) -> dict[str, torch.Tensor]:
        """Every example's unclipped gradient, ``[B, *p.shape]`` per trainable parameter: Opacus'
        ``p.grad_sample`` (of the per-example loss, a mean's 1/B undone, as Opacus scales it).
        Eager ``vmap(grad)`` over the whole batch, apart from the compiled chunks: it holds every
        per-example gradient at once (batch x the trainable parameters' bytes) and the batch's
        activations for one more forward and backward, which is why it runs only on request."""
        per_example = torch.func.vmap(torch.func.grad(_example_loss(self._shadow)), randomness="different",
                                      in_dims=(None, None, None, 0, *(0,) * len(inputs)))
        return per_example(self._trainable, self._frozen, scale, v, *inputs)

    def _accumulate(self, grad_out: torch.Tensor, inputs: tuple) -> None:
        batch = grad_out.shape[0]
        for orig, sh in self._pairs:  # train()/eval() since make_private
            sh.training = orig.training
        # The mean's 1/B undone inside each example's loss (a tensor: no recompile per batch
        # size), not on a copy of grad_out: an LM's is [B, T, vocab].
        scale = torch.tensor(float(batch if self.loss_reduction == "mean" else 1), device=grad_out.device)
        v = grad_out.detach().contiguous()
        if self.grad_sample:
            for name, g in self._grad_samples(scale, v, inputs).items():
                _add_grad_sample(self._trainable[name], g.detach())
        sums = self._grad_fn(len(inputs))(self._trainable, self._frozen, scale, v, *inputs)
        if self.dist is not None:
            flat = torch.cat([s.reshape(-1) for s in sums.values()])
            torch.distributed.all_reduce(flat)
            sums = dict(zip(sums, flat.split([s.numel() for s in sums.values()])))
        for name, p in self._trainable.items():  # the sums are this call's own: divided in place
            g = sums.pop(name).view_as(p).to(p.dtype).div_(self.expected_batch_size)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def _add_grad_sample(p: torch.Tensor, g: torch.Tensor) -> None:
    """``p.grad_sample`` as Opacus keeps it: this backward's ``[B, *p.shape]``, or a list of
    them when several backward calls come before ``zero_grad()``."""
    held = getattr(p, "grad_sample", None)
    p.grad_sample = g if held is None else [*held, g] if isinstance(held, list) else [held, g]


class DPOptimizer:
    """The optimizer :func:`make_private` returns (Opacus' ``DPOptimizer``): ``step()`` adds
    Gaussian noise of std ``noise_multiplier * max_grad_norm / expected_batch_size`` to every
    trainable parameter's ``.grad`` (the clipped mean that backward left there), steps the
    user's optimizer and records the step in ``accountant``. Everything else is the user's
    optimizer's (``zero_grad``, ``param_groups``, ``state_dict``...).

    Logical batches in physical ones (:class:`~fxmem.dpsgd.BatchMemoryManager`), as Opacus':
    ``signal_skip_step(True)`` queues a skip; a ``step()`` that pops one neither adds noise nor
    steps nor accounts (``_is_last_step_skipped`` is then True), and the ``zero_grad()`` after
    it keeps ``.grad``, where the physical batches' clipped sums add up; the next ``step()``
    that pops no skip noises and steps the logical batch's clipped sum / expected batch size."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: PrivateModule, noise_multiplier: float,
                 sample_rate: float, accountant: PrivacyAccountant, generator: torch.Generator | None,
                 secure_mode: bool):
        self.original_optimizer, self.module, self.accountant = optimizer, module, accountant
        self.noise_multiplier, self.sample_rate = noise_multiplier, sample_rate
        self.generator, self.secure_mode = generator, secure_mode
        self.noiseless_steps = 0  # steps with noise_multiplier 0 (not in the accountant: epsilon = inf)
        self._step_skip_queue: list[bool] = []
        self._is_last_step_skipped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["original_optimizer"], name)

    def _noise(self, p: torch.Tensor, std: float) -> torch.Tensor:
        if std == 0:
            return torch.zeros_like(p)
        if self.secure_mode:  # Opacus' defence against floating-point attacks: 4 draws, halved
            torch.normal(0.0, std, (1, 1), generator=self.generator, device=p.device)
            return sum(torch.normal(0.0, std, p.shape, generator=self.generator, device=p.device)
                       for _ in range(4)) / 2
        return torch.normal(0.0, std, p.shape, generator=self.generator, device=p.device)

    def add_noise(self) -> None:
        """The Gaussian mechanism on the clipped mean; one draw under torch.distributed (rank
        0's, broadcast)."""
        m = self.module
        std = self.noise_multiplier * m.max_grad_norm / m.expected_batch_size
        for p in m._trainable.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            noise = self._noise(p, std)
            if m.dist is not None:
                torch.distributed.broadcast(noise, src=0)
            p.grad.add_(noise.to(p.grad.dtype))

    @property
    def max_grad_norm(self) -> float:
        return self.module.max_grad_norm

    @property
    def max_grad_norms(self) -> list[float]:
        """Per-layer clipping's bounds, in the optimizer's parameter order (Opacus'
        ``DPPerLayerOptimizer.max_grad_norms``); flat clipping has none (AttributeError)."""
        bounds = self.module.clipping_bounds
        if not isinstance(bounds, tuple):
            raise AttributeError("max_grad_norms: this optimizer clips flat (one max_grad_norm); "
                                 "clipping='per_layer' has a bound per parameter")
        of = dict(zip(map(id, self.module._trainable.values()), bounds))
        return [of[id(p)] for g in self.param_groups for p in g["params"] if p.requires_grad]

    @property
    def expected_batch_size(self) -> int:
        return self.module.expected_batch_size

    @property
    def loss_reduction(self) -> str:
        return self.module.loss_reduction

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next ``step()`` ends a physical batch only (``True``: accumulate,
        no noise, no step, no accounting) or the logical batch (``False``). Opacus' method, called
        by the :class:`~fxmem.dpsgd.BatchMemoryManager`'s sampler as it emits each physical
        batch (a queue: loader workers run ahead of the loop)."""
        self._step_skip_queue.append(bool(do_skip))

    def step(self, closure=None):
        if self._step_skip_queue and self._step_skip_queue.pop(0):  # a physical batch inside a logical one
            if closure is not None:
                with torch.enable_grad():
                    closure()
            self._is_last_step_skipped = True
            return None
        self.add_noise()
        out = self.original_optimizer.step(closure)
        if self.noise_multiplier == 0:  # no privacy: epsilon is infinite from now on
            self.noiseless_steps += 1
        else:
            self.accountant.step(self.noise_multiplier, self.sample_rate)
        self._is_last_step_skipped = False
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The user's optimizer's ``zero_grad``, except after a skipped step (a physical batch
        inside a logical one): then ``.grad`` holds the logical batch's clipped sum so far and
        is kept (Opacus keeps its ``p.summed_grad`` then). ``p.grad_sample`` is cleared either
        way, as Opacus does."""
        for p in self.module._trainable.values():  # per-example gradients never outlive a step (as Opacus)
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None
        if self._is_last_step_skipped:
            return
        self.original_optimizer.zero_grad(set_to_none)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent at ``delta``; infinite after a step without noise."""
        return math.inf if self.noiseless_steps else self.accountant.epsilon(delta)

    def __repr__(self) -> str:
        return (f"DPOptimizer({type(self.original_optimizer).__name__}, noise_multiplier="
                f"{self.noise_multiplier}, sample_rate={self.sample_rate:.4g})")


def _positive(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"make_private: {name} must be a finite number {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value!r}")
    return float(value)


def _opacus_arguments(clipping: Any, grad_sample_mode: Any, batch_first: Any, wrap_model: Any, rand_on_empty: Any,
                      rest: Mapping[str, Any], options: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Check the arguments ``make_private`` shares with Opacus 1.6; return the fxmem ``options``
    that ``grad_sample_mode`` implies. Names Opacus does not know raise ValueError listing the
    ones it does; Opacus features fxmem does not have raise NotImplementedError naming them."""
    if clipping == "adaptive":
        raise NotImplementedError("make_private: clipping='adaptive' (Opacus' AdaClipDPOptimizer) is not "
                                  f"supported by fxmem; use one of {CLIPPINGS}")
    if clipping not in CLIPPINGS:
        raise ValueError(f"make_private: clipping must be one of {CLIPPINGS}, got {clipping!r}")
    if grad_sample_mode in UNSUPPORTED_GRAD_SAMPLE_MODES:
        raise NotImplementedError(f"make_private: grad_sample_mode={grad_sample_mode!r} (Opacus: "
                                  f"{UNSUPPORTED_GRAD_SAMPLE_MODES[grad_sample_mode]}) is not supported by "
                                  f"fxmem; use one of {tuple(GRAD_SAMPLE_MODES)}")
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"make_private: grad_sample_mode must be one of {tuple(GRAD_SAMPLE_MODES)}, "
                         f"got {grad_sample_mode!r}")
    for name, value, fxmem_value, why in (
            ("batch_first", batch_first, True, "fxmem takes the batch as dim 0 of every input"),
            ("wrap_model", wrap_model, True, "fxmem's clipping runs in the module it returns"),
            ("rand_on_empty", rand_on_empty, False, "fxmem runs empty Poisson batches as they are")):
        if not isinstance(value, bool):
            raise ValueError(f"make_private: {name} must be True or False, got {value!r}")
        if value != fxmem_value:
            raise NotImplementedError(f"make_private: {name}={value} is not supported by fxmem ({why})")
    if rest:
        adaptive = sorted(k for k in rest if k in OPACUS_OPTIMIZER_KWARGS)
        if adaptive:
            raise NotImplementedError(f"make_private: {adaptive} are Opacus' adaptive clipping arguments "
                                      "(clipping='adaptive'), which fxmem does not support")
        raise TypeError(f"make_private: unexpected arguments {sorted(rest)}")
    if grad_sample_mode.startswith("ghost"):
        if options is not None and options.get("ghost_clipping", True) is False:
            raise ValueError(f"make_private: grad_sample_mode={grad_sample_mode!r} asks for ghost norms, "
                             "options={'ghost_clipping': False} turns them off: pick one")
        options = {**(options or {}), "ghost_clipping": True}
    return options


def _per_layer_bounds(max_grad_norm: Any, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    """Per-layer clipping's bounds in the module's trainable-parameter order, from
    ``max_grad_norm`` given as Opacus takes it: one per parameter the optimizer steps, in the
    optimizer's order."""
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not isinstance(max_grad_norm, (list, tuple)) or len(max_grad_norm) != len(stepped):
        raise ValueError(f"make_private: clipping='per_layer' needs max_grad_norm as a list of {len(stepped)} "
                         f"bounds (one per parameter the optimizer steps, in its order), got {max_grad_norm!r}")
    bounds = {id(p): check_clipping_norm(c, "make_private (max_grad_norm)") for p, c in zip(stepped, max_grad_norm)}
    trainable = [p for p in module.parameters() if p.requires_grad]
    missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in bounds]
    if missing:
        raise ValueError(f"make_private: clipping='per_layer': the optimizer does not step the trainable "
                         f"parameters {missing}, so they have no bound")
    return tuple(bounds[id(p)] for p in trainable)


def _shard(loader: DataLoader, rank: int, world: int) -> DataLoader:
    """The user's loader over this rank's shard of the dataset (indices rank, rank + world, ...)."""
    dataset = loader.dataset
    return DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=loader.batch_size,
                      collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                      pin_memory=loader.pin_memory)


def _local(loader: DataLoader) -> DataLoader:
    """The loader this process steps through: the user's, or under torch.distributed this
    rank's shard of it."""
    dist = _distributed()
    return _shard(loader, *dist) if dist else loader


def _rates(local: DataLoader, loader: DataLoader) -> tuple[float, int]:
    """``(sample_rate, expected batch size)`` as Opacus' ``make_private``: ``1 / len(loader)``
    (one epoch in expectation per pass of the user's loader, whether or not its batch size
    divides the dataset) and ``int(len(dataset) * sample_rate)``. Under torch.distributed the
    rank's shard loader gives the rate (each rank samples its shard with it) and the whole
    dataset the (global) expected batch."""
    sample_rate = 1 / len(local)
    return sample_rate, max(1, int(len(loader.dataset) * sample_rate))


class PrivacyEngine:
    """Opacus' ``PrivacyEngine``: ``make_private``/``make_private_with_epsilon`` wrap a model,
    optimizer and loader; ``accountant`` (a :class:`PrivacyAccountant`, ``"prv"`` by default as
    Opacus', or ``"rdp"``/``"gdp"``) records every step;
    ``get_epsilon(delta)``; ``state_dict()``/``load_state_dict()`` save and resume the
    accounting. ``secure_mode``: noise and Poisson sampling from :func:`secure_generator`, noise
    drawn as Opacus' secure mode does."""

    def __init__(self, accountant: str = DEFAULT_ACCOUNTANT, secure_mode: bool = False):
        if not isinstance(secure_mode, bool):
            raise ValueError(f"PrivacyEngine: secure_mode must be True or False, got {secure_mode!r}")
        self.accountant = PrivacyAccountant(accountant)
        self.secure_mode = secure_mode
        self.optimizers: list[DPOptimizer] = []

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float | list[float], criterion: Any = None,
                     batch_first: bool = True, loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str = "flat", noise_generator: torch.Generator | None = None,
                     grad_sample_mode: str = "hooks", wrap_model: bool = True, rand_on_empty: bool = False,
                     microbatch_size: int | str | None = 8, memory_budget=None,
                     options: Mapping[str, Any] | None = None, strict: bool = True, grad_sample: bool = False,
                     **opacus_kwargs: Any) -> tuple:
        """``(module, optimizer, data_loader)`` that train privately in the user's loop;
        ``(module, optimizer, criterion, data_loader)`` for the ``"ghost"`` modes, as Opacus.

        Opacus' arguments keep their meaning: ``clipping="per_layer"`` with ``max_grad_norm`` a
        list (one bound per parameter the optimizer steps, in its order; the noise is scaled by
        their L2 norm), ``grad_sample_mode`` one of :data:`GRAD_SAMPLE_MODES` (how each maps to
        fxmem is written there), ``criterion`` returned as it is by the ghost modes (fxmem's
        clipping needs no wrapped loss). What fxmem cannot do is refused by name:
        ``clipping="adaptive"`` and its optimizer arguments, ``batch_first=False``,
        ``wrap_model=False``, ``rand_on_empty=True``, ``grad_sample_mode`` "ghost_tp"/"no_op".

        fxmem's own: ``microbatch_size``/``memory_budget``/``options`` go to
        :func:`clipped_grad` (the chunks the per-example region runs in); ``strict``: refuse a
        module that DP-SGD cannot train (:func:`validate`; ``fix`` repairs the usual cases);
        ``grad_sample``: also leave every example's unclipped gradient on ``p.grad_sample``
        (``[B, *p.shape]``, Opacus' attribute) after each backward, at the cost of holding them
        all at once plus one more eager forward and backward of the batch (off by default:
        fxmem's chunks never materialize them)."""
        options = _opacus_arguments(clipping, grad_sample_mode, batch_first, wrap_model, rand_on_empty,
                                    opacus_kwargs, options)
        if not isinstance(grad_sample, bool):
            raise ValueError(f"make_private: grad_sample must be True or False, got {grad_sample!r}")
        if not isinstance(module, nn.Module):
            raise ValueError(f"make_private: module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"make_private: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(data_loader, DataLoader) or not data_loader.batch_size:
            raise ValueError("make_private: data_loader must be a torch DataLoader with a batch_size, got "
                             f"{data_loader!r}")
        sigma = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
        if clipping == "flat":
            C = check_clipping_norm(max_grad_norm, "make_private (max_grad_norm)")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"make_private: loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        _compile_options(microbatch_size, memory_budget, options)  # checked now, not at the first backward
        if strict:
            validate(shadow(module), raise_errors=True)  # RNNs are differentiated as their loops
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        if not trainable or any(id(p) not in trainable for g in optimizer.param_groups for p in g["params"]
                                if p.requires_grad):
            raise ValueError("make_private: the optimizer must step the module's trainable parameters "
                             "(and the module needs at least one)")
        if clipping == "per_layer":
            C = _per_layer_bounds(max_grad_norm, module, optimizer)
        if noise_generator is not None and self.secure_mode:  # Opacus' own refusal: a seeded noise is guessable
            raise ValueError("make_private: noise_generator cannot be given in secure mode (its noise comes from "
                             "the OS CSPRNG; Opacus: 'Passing seed is prohibited in secure mode')")
        local = _local(data_loader)
        generator = noise_generator
        if self.secure_mode:
            generator = secure_generator(next(module.parameters()).device)
        sample_rate, expected = _rates(local, data_loader)
        if poisson_sampling:
            sampler_gen = secure_generator() if self.secure_mode else None
            local = poisson_loader(local, sample_rate=sample_rate, steps=len(local), generator=sampler_gen)
        private = PrivateModule(module, C, expected, loss_reduction, microbatch_size, memory_budget, options,
                                grad_sample)
        dp_opt = DPOptimizer(optimizer, private, sigma, sample_rate, self.accountant, generator, self.secure_mode)
        self.optimizers.append(dp_opt)
        if grad_sample_mode.startswith("ghost"):
            return private, dp_opt, criterion, local
        return private, dp_opt, local

    def make_private_with_epsilon(self, *, target_epsilon: float, target_delta: float, epochs: int,
                                  data_loader: DataLoader, **kwargs: Any):
        """:meth:`make_private` with the smallest noise multiplier whose epsilon after ``epochs``
        epochs (``epochs * len(data_loader)`` steps) is at most ``target_epsilon``."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
            raise ValueError(f"make_private_with_epsilon: epochs must be a positive int, got {epochs!r}")
        if not isinstance(data_loader, DataLoader) or not data_loader.batch_size:
            raise ValueError("make_private_with_epsilon: data_loader must be a torch DataLoader with a batch_size")
        local = _local(data_loader)
        sigma = noise_multiplier_for(target_epsilon, target_delta, _rates(local, data_loader)[0],
                                     epochs * len(local), accountant=self.accountant.accountant)
        return self.make_private(data_loader=data_loader, noise_multiplier=sigma, **kwargs)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent at ``delta``; infinite after a step without noise."""
        if any(o.noiseless_steps for o in self.optimizers):
            return math.inf
        return self.accountant.epsilon(delta)

    def state_dict(self) -> dict:
        return {"accountant": self.accountant.state_dict(), "secure_mode": self.secure_mode}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])


def make_private(*, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                 noise_multiplier: float, max_grad_norm: float, poisson_sampling: bool = True,
                 secure_mode: bool = False, accountant: str = DEFAULT_ACCOUNTANT, **kwargs: Any
                 ) -> tuple[PrivateModule, DPOptimizer, DataLoader]:
    """``PrivacyEngine(accountant, secure_mode).make_private(...)``; the engine's accountant is
    ``optimizer.accountant``."""
    return PrivacyEngine(accountant, secure_mode).make_private(
        module=module, optimizer=optimizer, data_loader=data_loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=poisson_sampling, **kwargs)


def make_private_with_epsilon(*, target_epsilon: float, target_delta: float, epochs: int,
                              secure_mode: bool = False, accountant: str = DEFAULT_ACCOUNTANT, **kwargs: Any):
    """``PrivacyEngine(accountant, secure_mode).make_private_with_epsilon(...)``."""
    return PrivacyEngine(accountant, secure_mode).make_private_with_epsilon(
        target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, **kwargs)

