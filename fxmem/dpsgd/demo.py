"""``python -m fxmem dpsgd-demo``: train a tiny Llama (built from a config, nothing downloaded)
privately on data it generates, printing loss and epsilon as it goes.

The data: token sequences that follow a fixed random permutation of the vocabulary (each token
determines the next), so the loss can fall from ln(vocab) towards 0. Each step is a Poisson
sample of the dataset (:func:`poisson_loader`), its clipped per-example gradient sum is computed
in fixed-size microbatches (one compile for every batch size), noised, averaged over the
expected batch size and applied by Adam; opacus' accountant reports epsilon.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import TensorDataset

from .accounting import ACCOUNTANTS
from .functional import make_functional
from .sampling import poisson_loader
from .training import DPSGD, train


def model(vocab: int, d: int, layers: int, seq: int):
    from ..models import hf_llama

    m = hf_llama(batch=1, seq=seq, vocab=vocab, d=d, layers=layers, heads=2).model
    m.set_attn_implementation("eager")  # vmap has batching rules for eager attention's ops
    return m


def dataset(n: int, seq: int, vocab: int, generator: torch.Generator) -> TensorDataset:
    perm = torch.randperm(vocab, generator=generator)
    ids = torch.empty(n, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n,), generator=generator)
    for t in range(1, seq):
        ids[:, t] = perm[ids[:, t - 1]]
    return TensorDataset(ids)


def run(steps: int = 300, batch: int = 64, microbatch: int = 32, noise: float = 1.0, clip: float = 1.0,
        lr: float = 5e-3, dataset_size: int = 4096, vocab: int = 32, d: int = 32, layers: int = 1,
        seq: int = 12, delta: float = 1e-5, accountant: str = "rdp", inner: str = "eager",
        log_every: int = 25, seed: int = 0, log=print):
    """Train and return the steps' :class:`StepLog`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = dataset(dataset_size, seq, vocab, g)
    net = model(vocab, d, layers, seq)
    fn, trainable, frozen = make_functional(net)

    def loss_fn(trainable, frozen, ids):  # ONE example
        return fn(trainable, frozen, input_ids=ids[None], labels=ids[None]).loss

    dp = DPSGD(loss_fn, trainable, torch.optim.Adam(trainable.values(), lr=lr), clipping_norm=clip,
               noise_multiplier=noise, expected_batch_size=batch, dataset_size=dataset_size,
               frozen_args=(frozen,), microbatch_size=microbatch, delta=delta, accountant=accountant,
               generator=torch.Generator().manual_seed(seed + 1), options={"inner": inner})
    n_params = sum(t.numel() for t in trainable.values())
    log(f"DP-SGD: Llama ({layers} layer(s), hidden {d}, vocab {vocab}, {n_params / 1e3:.1f}k params), "
        f"{dataset_size} sequences of {seq} tokens; Poisson batches of expected size {batch} "
        f"(sample rate {dp.sample_rate:.4g}), microbatch {microbatch}, C={clip}, noise multiplier {noise}, "
        f"{accountant} accountant, delta {delta:g}; Adam lr {lr}; fxmem inner compiler {inner}")
    loader = poisson_loader(data, batch, steps=steps, generator=torch.Generator().manual_seed(seed + 2))
    t0 = time.perf_counter()
    logs = train(dp, loader, log_every=log_every, log=log)
    first = next((s.loss for s in logs if s.batch_size), float("nan"))
    log(f"done in {time.perf_counter() - t0:.0f} s: loss {first:.4f} -> {logs[-1].loss:.4f} "
        f"(ln vocab = {torch.log(torch.tensor(float(vocab))).item():.4f}); "
        f"({dp.epsilon():.3f}, {delta:g})-DP; fxmem compiles: {len(dp.clipped(1).plans)}")
    return logs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fxmem dpsgd-demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="expected (Poisson) batch size")
    p.add_argument("--microbatch", type=int, default=32)
    p.add_argument("--noise", type=float, default=1.0, help="noise multiplier sigma")
    p.add_argument("--clip", type=float, default=1.0, help="clipping norm C")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--accountant", default="rdp", choices=ACCOUNTANTS)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    p.add_argument("--log-every", type=int, default=25)
    a = p.parse_args(argv)
    run(steps=a.steps, batch=a.batch, microbatch=a.microbatch, noise=a.noise, clip=a.clip, lr=a.lr,
        accountant=a.accountant, delta=a.delta, inner=a.inner, log_every=a.log_every)
