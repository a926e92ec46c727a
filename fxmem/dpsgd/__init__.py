"""DP-SGD with fxmem: clipped per-example gradients compiled with microbatching, noise, accounting.

Opacus' API on a plain loop (``private.py``)::

    model, optimizer, loader = make_private(module=model, optimizer=optimizer, data_loader=loader,
                                            noise_multiplier=1.1, max_grad_norm=1.0)
    for x, y in loader:
        optimizer.zero_grad(); criterion(model(x), y).backward(); optimizer.step()
    optimizer.accountant.epsilon(1e-5)             # accountant "prv" by default, as Opacus' engine

Logical batches in physical ones: ``with BatchMemoryManager(data_loader=loader,
max_physical_batch_size=8, optimizer=optimizer) as physical: for x, y in physical: ...``.

The functional API underneath:

    from fxmem.dpsgd import clipped_grad, make_functional, add_noise, PrivacyAccountant

    fn, trainable, frozen = make_functional(model)               # only requires_grad params train
    def loss_fn(trainable, frozen, x, y):                        # ONE example, no batch dim
        return F.cross_entropy(fn(trainable, frozen, x[None]), y[None])

    grad_fn = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(2, 3), microbatch_size=8)
    acct = PrivacyAccountant("rdp")
    for x, y in loader:                                          # Poisson-sampled batches
        grads = add_noise(grad_fn(trainable, frozen, x, y), noise_multiplier=1.1, clipping_norm=1.0)
        for k, p in trainable.items():
            p.grad = grads[k] / expected_batch_size
        opt.step()
        acct.step(noise_multiplier=1.1, sample_rate=expected_batch_size / len(dataset))
    acct.epsilon(delta=1e-5)

or the whole loop (``training.py``): ``train(DPSGD(loss_fn, trainable, opt, clipping_norm=1.0,
noise_multiplier=1.1, expected_batch_size=32, dataset_size=len(dataset), frozen_args=(frozen,)),
poisson_loader(dataset, 32), log_every=10, log=print)``; ``python -m fxmem dpsgd-demo`` runs one.

Accounting needs ``opacus`` (the ``dpsgd`` extra).
"""

from .accounting import ACCOUNTANTS, PrivacyAccountant, epsilon, noise_multiplier_for
from .batch_memory_manager import BatchMemoryManager
from .clipping import ClippedGradFn, clip_factor, clipped_grad
from .functional import make_functional
from .noise import add_noise
from .private import DPOptimizer, PrivacyEngine, PrivateModule, make_private, make_private_with_epsilon
from .sampling import PoissonSampler, poisson_loader
from .training import DPSGD, StepLog, train
from .validate import ModuleValidator, UnsupportedModuleError, fix, validate

__all__ = [
    "ACCOUNTANTS",
    "BatchMemoryManager",
    "ClippedGradFn",
    "DPOptimizer",
    "DPSGD",
    "ModuleValidator",
    "PoissonSampler",
    "StepLog",
    "PrivacyAccountant",
    "PrivacyEngine",
    "PrivateModule",
    "UnsupportedModuleError",
    "add_noise",
    "clip_factor",
    "clipped_grad",
    "epsilon",
    "fix",
    "make_functional",
    "make_private",
    "make_private_with_epsilon",
    "noise_multiplier_for",
    "poisson_loader",
    "train",
    "validate",
]
