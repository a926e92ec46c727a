"""End-to-end private training: Opacus, opake, fxmem and the non-private step on the same run.

    python bench/e2e_dpsgd.py                  # GPT 2 layers, hidden 128, Poisson batches of mean 32, 20 steps
    python bench/e2e_dpsgd.py --quick          # tiny shapes, 8 steps: writes dpsgd-e2e-quick.*
    python bench/e2e_dpsgd.py --inner eager    # fxmem's eager inner compiler (no Inductor compiles)
    python bench/e2e_dpsgd.py --model gpt5m    # the 5.3M GPT (4 x 256, vocab 4096): dpsgd-e2e-gpt5m.*
    python bench/e2e_dpsgd.py --model bert --inner eager --no-opake --threads 2
                                               # BERT-base-like classifier (12 x 768, vocab 30522, seq 32)

Model: the plain-PyTorch GPT of bench/dpsgd_models.py (2 layers, hidden 128, 4 heads, vocab 4096,
sequence 64, no weight tying). Not an HF model: every parametrized layer here (nn.Linear,
nn.Embedding, nn.LayerNorm) has a native Opacus grad sampler, whereas HF GPT-2's ``Conv1D`` and
HF Llama's ``LlamaRMSNorm`` have none (Opacus would fall back to functorch for them, which is not
what its hooks mode or ghost clipping measure); it is also the model of bench/dpsgd.py,
ghost.py and poisson.py, so the figures compare.

Data: ``--dataset`` random token sequences (labels = inputs, next-token loss). Every variant
starts from the same weights (its own copy), trains with Adam (lr 1e-3) for ``--steps`` steps
and sees the *same* Poisson batches: expected size 32 (sample rate 32 / dataset), each step's
mask drawn by ``torch.rand(N, generator) < q`` from one seed, which is what both fxmem's
``PoissonSampler`` and Opacus's ``UniformWithReplacementSampler`` do (Opacus's generator is set to
the seeded one after ``make_private``). Private variants: C = 1, noise multiplier 1.0, RDP
accountant, delta 1e-5; physical batch cap ``--microbatch`` (8) for all of them:

- non-private: ``loss.backward()`` on the whole batch, ``Adam.step()`` (eager);
- opacus hooks: ``PrivacyEngine(accountant="rdp").make_private(..., poisson_sampling=True)``,
  ``BatchMemoryManager(max_physical_batch_size=8)``; one step = every physical batch of one
  logical batch, up to the optimizer step that is not skipped;
- opacus ghost: the same with ``grad_sample_mode="ghost"`` and the ``DPLossFastGradientClipping``
  criterion ``make_private`` returns (two backward passes per physical batch);
- opake: ``opake.dpsgd.clipping.clipped_grad(..., microbatch_size=8)`` for the clipped sum, then
  the same noise, division by the expected batch size, Adam step and accountant as fxmem's;
- fxmem: ``fxmem.dpsgd.DPSGD(..., microbatch_size=8).step`` (fixed chunks of 8, the last padded:
  one compile for every batch size; ghost clipping on);
- fxmem make_private: Opacus' loop on ``fxmem.dpsgd.make_private(..., microbatch_size=8)``
  (``loss.backward(); optimizer.step()``; the forward runs once more inside the chunks), on the
  whole logical batch, and on physical batches of 8 (one ``backward()`` each, as Opacus'
  ``BatchMemoryManager`` runs them).

Per variant: median step time over the steps after ``--warmup`` (compiles happen there), the
variants interleaved step by step; peak = exact peak of one step above what was live before it
(fxmem.profiling.step_perf, allocator events), the maximum over the last ``--peak-steps`` steps
(profiled separately, not timed); compiles = Dynamo graphs compiled during the variant's steps
(``counters["stats"]["unique_graphs"]``) plus fxmem's chunk-graph compiles; epsilon after the run.
Writes <out-dir>/<name>.json and .md (bench/common.py's writer).
"""
from __future__ import annotations

import copy
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from dpsgd_models import GPT, BertClassifier, Logits  # noqa: E402

import fxmem.per_example.stage  # noqa: E402
from fxmem.dpsgd import DPSGD, PoissonSampler, PrivacyAccountant, add_noise, make_functional, make_private  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402

MIB = 2**20
FULL = dict(model="gpt", vocab=4096, d=128, layers=2, heads=4, seq=64, batch=32, dataset=1024, steps=20, warmup=3,
            peak_steps=3, microbatch=8)
QUICK = dict(model="gpt", vocab=256, d=32, layers=1, heads=2, seq=16, batch=8, dataset=128, steps=8, warmup=2,
             peak_steps=2, microbatch=4)
# --model: [dp-parity]'s end-to-end models. gpt5m: bench/dpsgd_parity.py's 5.3M GPT; bert: a
# BERT-base-like classifier (12 x 768, vocab 30522, dropout 0.1), sequences of 32, 2 classes.
MODELS = {
    "gpt5m": dict(model="gpt", vocab=4096, d=256, layers=4, heads=4, seq=64, batch=32, dataset=1024, steps=8,
                  warmup=2, peak_steps=2, microbatch=8),
    "bert": dict(model="bert", vocab=30522, d=768, layers=12, heads=12, seq=32, batch=32, dataset=1024, steps=7,
                 warmup=2, peak_steps=2, microbatch=8),
}
C, SIGMA, DELTA, LR, SEED = 1.0, 1.0, 1e-5, 1e-3, 0
# Opacus's hooks warn on every backward that no input requires grad (token ids): expected here.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


SPEC = "dpsgd-e2e"  # its table spec in bench/tables.py, whatever --name says

def _build(s: dict) -> nn.Module:
    if s["model"] == "bert":
        return BertClassifier(s["vocab"], s["d"], s["layers"], s["heads"], s["seq"])
    return GPT(s["vocab"], s["d"], s["layers"], s["heads"], s["seq"])


class NonPrivate:
    def __init__(self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], batches: list[list[int]]):
        self.model, self.data, self.batches = model, data, batches
        self.opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step(self, s: int) -> float:
        ids, labels = (t[self.batches[s]] for t in self.data)
        loss = self.model(ids, labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class Opacus:
    """make_private with Poisson sampling, BatchMemoryManager; ``ghost``: ghost clipping."""

    def __init__(self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], batch: int, cap: int,
                 ghost: bool):
        from opacus import PrivacyEngine
        from opacus.utils.batch_memory_manager import BatchMemoryManager

        self.engine = PrivacyEngine(accountant="rdp")
        module, self.loss = Logits(model), model.loss
        loader = DataLoader(TensorDataset(*data), batch_size=batch)
        common_kw = dict(module=module, optimizer=torch.optim.Adam(module.parameters(), lr=LR), data_loader=loader,
                         noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=True)
        if ghost:
            self.module, self.opt, self.criterion, loader = self.engine.make_private(
                **common_kw, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost")
        else:
            self.module, self.opt, loader = self.engine.make_private(**common_kw, grad_sample_mode="hooks")
            self.criterion = None
        loader.batch_sampler.generator = torch.Generator().manual_seed(SEED)  # the same batches as the others
        self.bmm = BatchMemoryManager(data_loader=loader, max_physical_batch_size=cap, optimizer=self.opt)
        self.it = iter(self.bmm.__enter__())
        self.sizes: list[int] = []

    def step(self, s: int) -> float:
        losses, n = [], 0
        while True:
            ids, labels = next(self.it)
            n += ids.shape[0]
            loss = self.loss(self.module(ids), labels, self.criterion)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if not self.opt._is_last_step_skipped:  # the logical batch's last physical batch
                break
        self.sizes.append(n)
        return statistics.fmean(losses)

    def epsilon(self) -> float:
        return self.engine.get_epsilon(DELTA)


def _one_example_loss(fn):
    """``loss(trainable, frozen, ids [t], labels [t])`` for ONE example (make_functional's ``fn``)."""
    return lambda tr, fr, ids, labels: fn(tr, fr, ids[None], labels[None])


class Opake:
    """opake's clipped sum, then noise / expected batch / Adam / accountant, as fxmem's DPSGD does."""

    def __init__(self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], batches: list[list[int]],
                 batch: int, cap: int):
        from opake.dpsgd.clipping import clipped_grad as opake_clipped_grad

        self.data, self.batches, self.batch = data, batches, batch
        fn, self.trainable, self.frozen = make_functional(model)
        self.tensors = list(self.trainable.values())
        self.opt = torch.optim.Adam(self.tensors, lr=LR)
        self.fn, self.state = opake_clipped_grad(_one_example_loss(fn), clipping_norm=C, batch_argnums=(2, 3),
                                                 microbatch_size=cap)
        self.accountant = PrivacyAccountant("rdp")
        self.generator = torch.Generator().manual_seed(SEED + 1)

    def step(self, s: int) -> float:
        ids, labels = (t[self.batches[s]] for t in self.data)
        out, _ = self.fn(self.trainable, self.frozen, ids, labels, state=self.state)
        noisy = add_noise(dict(out.pytree), SIGMA, C, self.generator)
        for t, k in zip(self.tensors, self.trainable):
            t.grad = noisy[k].div_(self.batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.accountant.step(SIGMA, self.batch / self.data[0].shape[0])
        return float("nan")

    def epsilon(self) -> float:
        return self.accountant.epsilon(DELTA)


class Fxmem:
    """fxmem's functional DP-SGD: ``DPSGD`` over ``clipped_grad`` (fixed chunks of ``m``)."""

    def __init__(self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], batches: list[list[int]],
                 batch: int, m: int, inner: str):
        self.data, self.batches = data, batches
        fn, trainable, frozen = make_functional(model)
        self.dp = DPSGD(_one_example_loss(fn), trainable, torch.optim.Adam(trainable.values(), lr=LR),
                        clipping_norm=C, noise_multiplier=SIGMA, expected_batch_size=batch,
                        dataset_size=data[0].shape[0], frozen_args=(frozen,), microbatch_size=m, delta=DELTA,
                        accountant="rdp", generator=torch.Generator().manual_seed(SEED + 1),
                        options={"inner": inner})

    def step(self, s: int) -> float:
        ids, labels = (t[self.batches[s]] for t in self.data)
        return self.dp.step(ids, labels, epsilon=False).loss

    def epsilon(self) -> float:
        return self.dp.epsilon()


class FxmemPrivate:
    """fxmem's Opacus-style loop: ``make_private`` (chunks of ``m``), then ``loss.backward();
    optimizer.step()`` on the logits module; fed the harness's Poisson batches (make_private's
    own loader is not used), expected batch size ``batch``. ``physical``: the logical batch in
    physical batches of at most that many, one ``backward()`` each, one ``step()`` (what Opacus'
    ``BatchMemoryManager`` does; make_private's clipped sums add up on ``.grad``)."""

    def __init__(self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], batches: list[list[int]],
                 batch: int, m: int, inner: str, physical: int | None = None):
        self.data, self.batches, self.loss, self.physical = data, batches, model.loss, physical
        module = Logits(model)
        loader = DataLoader(TensorDataset(*data), batch_size=batch)
        self.module, self.opt, _ = make_private(
            module=module, optimizer=torch.optim.Adam(module.parameters(), lr=LR), data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=C, accountant="rdp", microbatch_size=m, options={"inner": inner},
            noise_generator=torch.Generator().manual_seed(SEED + 1))

    def step(self, s: int) -> float:
        ids, labels = (t[self.batches[s]] for t in self.data)
        losses = []
        for i in range(0, len(ids), self.physical or max(len(ids), 1)):
            cut = slice(i, i + (self.physical or len(ids)))
            loss = self.loss(self.module(ids[cut]), labels[cut])
            loss.backward()
            losses.append(loss.item())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return statistics.fmean(losses) if losses else float("nan")

    def epsilon(self) -> float:
        return self.opt.epsilon(DELTA)


def run(args) -> tuple[list[dict], dict]:
    s = QUICK if args.quick else MODELS.get(args.model, FULL)
    if args.model != "gpt" and args.name == "dpsgd-e2e":
        args.name = f"dpsgd-e2e-{args.model}"
    steps = args.steps or s["steps"]
    warmup, peak_steps = s["warmup"], s["peak_steps"]
    m, B, N = args.microbatch or s["microbatch"], s["batch"], s["dataset"]
    torch.manual_seed(SEED)
    base = _build(s)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, s["vocab"], (N, s["seq"]), generator=g)
    data = (ids, ids if s["model"] == "gpt" else torch.randint(0, 2, (N,), generator=g))
    batches = list(PoissonSampler(N, B / N, steps, generator=torch.Generator().manual_seed(SEED)))
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: {type(base).__name__} {s['layers']} layers, d={s['d']}, vocab {s['vocab']}, "
          f"{n_params / 1e6:.2f}M params; dataset {N} x seq {s['seq']}, Poisson batches of mean {B}: "
          f"{[len(b) for b in batches]}; physical cap / microbatch {m}; fxmem inner {args.inner}", flush=True)

    def fresh() -> nn.Module:
        return copy.deepcopy(base)

    variants = {
        "non-private": NonPrivate(fresh(), data, batches),
        "opacus hooks": Opacus(fresh(), data, B, m, ghost=False),
        "opacus ghost": Opacus(fresh(), data, B, m, ghost=True),
        **({"opake": Opake(fresh(), data, batches, B, m)} if not args.no_opake else {}),
        f"fxmem m={m}": Fxmem(fresh(), data, batches, B, m, args.inner),
        f"fxmem make_private m={m}": FxmemPrivate(fresh(), data, batches, B, m, args.inner),
        f"fxmem make_private m={m}, physical {m}": FxmemPrivate(fresh(), data, batches, B, m, args.inner, m),
    }
    chunk_compiles = {"n": 0}
    real = fxmem.per_example.stage.compile_chunk

    def counting(*a, **k):
        chunk_compiles["n"] += 1
        return real(*a, **k)

    fxmem.per_example.stage.compile_chunk = counting
    rows = {name: dict(variant=name, times=[], peaks=[], losses=[], compiles=0, first_step_s=None)
            for name in variants}
    try:
        for step in range(steps):
            profiled = step >= steps - peak_steps
            for name, v in variants.items():
                r = rows[name]
                g0, c0 = counters["stats"]["unique_graphs"], chunk_compiles["n"]
                with step_perf("cpu", memory=profiled) as perf:
                    loss = v.step(step)
                r["compiles"] += counters["stats"]["unique_graphs"] - g0 + chunk_compiles["n"] - c0
                r["losses"].append(loss)
                if step == 0:
                    r["first_step_s"] = perf.result.time_s
                if profiled:
                    r["peaks"].append(perf.result.peak_bytes)
                elif step >= warmup:
                    r["times"].append(perf.result.time_s)
            print(f"step {step + 1}/{steps} (batch {len(batches[step])}): " + "  ".join(
                f"{n} {rows[n]['times'][-1] * 1e3:.0f} ms" if rows[n]["times"] and not profiled else
                f"{n} {(rows[n]['peaks'] or [0])[-1] / MIB:.1f} MiB" if profiled else n for n in variants),
                flush=True)
    finally:
        fxmem.per_example.stage.compile_chunk = real
    for name, v in variants.items():
        r = rows[name]
        r["time_s"] = statistics.median(r["times"])
        r["peak_bytes"] = max(r["peaks"])
        r["epsilon"] = v.epsilon() if hasattr(v, "epsilon") else None
        if isinstance(v, Opacus):
            r["batch_sizes"] = v.sizes
            r["same_batches"] = v.sizes == [len(b) for b in batches]
    out = list(rows.values())
    np_row, ghost = rows["non-private"], rows["opacus ghost"]
    for r in out:
        # paired: the median over the timed steps of this step's time / the other's on the same
        # batch in the same round (less exposed to machine drift than a ratio of medians)
        r["paired_time_vs_nonprivate"] = statistics.median(a / b for a, b in zip(r["times"], np_row["times"]))
        r["paired_time_vs_opacus_ghost"] = statistics.median(a / b for a, b in zip(r["times"], ghost["times"]))
        r["time_vs_nonprivate"] = r["time_s"] / np_row["time_s"]
        r["peak_vs_nonprivate"] = r["peak_bytes"] / np_row["peak_bytes"]
        r["time_vs_opacus_ghost"] = r["time_s"] / ghost["time_s"]
        r["peak_vs_opacus_ghost"] = r["peak_bytes"] / ghost["peak_bytes"]
    fx, mp = rows[f"fxmem m={m}"], rows[f"fxmem make_private m={m}"]
    mp_phys = rows[f"fxmem make_private m={m}, physical {m}"]
    targets = [
        dict(target=f"fxmem m={m} step time / non-private step", value=fx["time_vs_nonprivate"], limit=1.25),
        dict(target=f"fxmem m={m} step time / non-private step, paired per step", value=fx["paired_time_vs_nonprivate"],
             limit=1.25),
        dict(target=f"fxmem m={m} peak / non-private step", value=fx["peak_vs_nonprivate"], limit=1.1),
        dict(target=f"fxmem m={m} step time / Opacus ghost (< 1)", value=fx["time_vs_opacus_ghost"], limit=1.0),
        dict(target=f"fxmem m={m} peak / Opacus ghost (< 1)", value=fx["peak_vs_opacus_ghost"], limit=1.0),
        dict(target=f"fxmem make_private m={m} step time / Opacus ghost (< 1)", value=mp["time_vs_opacus_ghost"],
             limit=1.0),
        dict(target=f"fxmem make_private m={m} peak / Opacus ghost (< 1)", value=mp["peak_vs_opacus_ghost"],
             limit=1.0),
        dict(target=f"fxmem make_private m={m}, physical {m} step time / Opacus ghost (< 1)",
             value=mp_phys["time_vs_opacus_ghost"], limit=1.0),
        dict(target=f"fxmem make_private m={m}, physical {m} peak / Opacus ghost (< 1)",
             value=mp_phys["peak_vs_opacus_ghost"], limit=1.0),
    ]
    for t in targets:
        t["met"] = bool(t["value"] <= t["limit"])
    info = dict(shape=s, steps=steps, warmup=warmup, peak_steps=peak_steps, microbatch=m, params=n_params,
                batch_sizes=[len(b) for b in batches], inner=args.inner, clipping_norm=C, noise_multiplier=SIGMA,
                delta=DELTA, lr=LR, targets=targets)
    for r in out:
        print(f"    {r['variant']:>34}: {r['time_s'] * 1e3:7.1f} ms ({r['time_vs_nonprivate']:.2f}x non-private, "
              f"{r['time_vs_opacus_ghost']:.2f}x opacus ghost)  peak {r['peak_bytes'] / MIB:6.1f} MiB "
              f"({r['peak_vs_nonprivate']:.2f}x, {r['peak_vs_opacus_ghost']:.2f}x)  compiles {r['compiles']}  "
              f"epsilon {r['epsilon'] if r['epsilon'] is None else round(r['epsilon'], 3)}", flush=True)
    return out, info


def main(argv=None) -> int:
    ap = common.parser(__doc__, name="dpsgd-e2e")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "eager"), help="fxmem's inner compiler")
    ap.add_argument("--microbatch", type=int, default=0, help="physical batch cap / microbatch (default 8; quick 4)")
    ap.add_argument("--steps", type=int, default=0, help="training steps (default 20; quick 8)")
    ap.add_argument("--model", choices=("gpt", *MODELS), default="gpt",
                    help="gpt (default: 2 x 128), gpt5m (the 5.3M GPT) or bert (BERT-base-like classifier); "
                         "writes dpsgd-e2e-<model>.* unless --name says otherwise")
    ap.add_argument("--no-opake", action="store_true", help="leave opake out (it takes 4x a step)")
    return common.run_with_targets(ap, run, argv, spec=SPEC)


if __name__ == "__main__":
    sys.exit(main())
