"""Keep, recompute or offload (issue #58): fxmem's ``offload`` against recompute alone and against
the seed's recipe, on three models whose activations dominate their step.

    python bench/studies/offload.py --models bert,llama,convnet --inner eager,inductor
    # writes bench/results/offload.{json,md}

Per model and inner compiler, one run, side by side: exact allocator peaks of the third step (the
first compiles); step times the median of ``--rounds`` more steps per configuration, taken in
interleaved rounds (one step of each configuration per round) so that load on the shared machine
falls on every configuration alike. ``--clock cpu`` (the default) times each step in CPU seconds
of this process on one thread (``time.process_time``; ``torch.set_num_threads(1)``): another
process's load on the machine then does not count, where wall time on a loaded two-core machine
measured steps 20x their idle time; ``--clock wall``: wall seconds with torch's threads:

- ``recompute-only``: fxmem ``memory_budget=0.0``, the least peak recompute alone reaches;
- ``offload@0.8``: ``peak_budget`` = 0.8 x that measured peak, ``offload=True``; its gradients
  and buffers compared bit for bit with the same plan run without offload (the split told to
  keep the offloaded values on the device; with Inductor both on one thread: its CPU scatters
  accumulate in an order that depends on the threads); with the eager inner compiler that plan's
  own row, ``same plan, no offload``;
- ``offload@seed``: ``peak_budget`` = 0.95 x the seed's measured peak, ``offload=True``: the least
  modelled time below the seed's peak;
- ``seed``: the seed documents' recipe in eager PyTorch: Hugging Face gradient checkpointing
  (a plain model: ``torch.utils.checkpoint`` around each block, as HF wraps each layer) with
  ``torch.autograd.graph.save_on_cpu``'s hooks; ``save_on_cpu alone``: the hooks without
  checkpointing (every saved tensor to host memory: the least peak, the most copies). On these
  CPU-only machines both fxmem's host copies and the seed's come from the same host pool
  (``fxmem.host_memory``: numpy buffers, outside torch's allocator), so the allocator's peak is
  the device's for both.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

import fxmem  # noqa: E402  (registers the backend)
from fxmem.host_memory import save_on_host  # noqa: E402
from fxmem.models import Workload, hf_llama  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402
from fxmem.testing.offload import kept_on_device  # noqa: E402

MiB = 2**20
CLOCK = [time.process_time]  # --clock: the step timer
BUDGET = 0.8  # of the least recompute-only peak (issue #58)
SEED = 0.95  # offload@seed's peak_budget: this much of the seed's recipe's measured peak


def convnet(batch=16, size=64, seed=0) -> Workload:
    """:class:`ConvStack` on 64 px images: eight layers' activations, 66k parameters."""
    from fxmem.testing.zoo import ConvStack, _images

    torch.manual_seed(seed)
    return Workload("convnet", ConvStack(), _images(batch, size, 10, seed), lambda out: out)


def bert(batch=32, seq=128, d=128, layers=4, heads=2, seed=0) -> Workload:
    """A BERT encoder with a sequence-classification head (dropout 0.1 as it ships), at a large batch:
    no vocabulary-sized logits, the encoder's activations are the step."""
    from fxmem.testing.zoo import _hf

    g = torch.Generator().manual_seed(seed)
    batch_ = {"input_ids": torch.randint(1000, 30522, (batch, seq), generator=g),
              "labels": torch.randint(0, 2, (batch,), generator=g)}
    return _hf("bert", "BertForSequenceClassification", batch_, seed, hidden_size=d, num_hidden_layers=layers,
               num_attention_heads=heads, intermediate_size=4 * d, num_labels=2)


MODELS = {
    "bert": bert,
    "llama": lambda: hf_llama(batch=8, seq=256, vocab=1024, d=128, layers=6, heads=2),
    "convnet": convnet,
}


def _prepared(w: Workload, model, fn, hooks=None) -> tuple[dict, Callable[[], float]]:
    """Two warm-up steps (the first compiles), then one whose peak, loss, gradients and buffers
    are kept; and a timer of one more step (timed later, interleaved with the other configurations)."""
    def one(measure: bool = False):
        for p in model.parameters():
            p.grad = None
        gc.collect()
        torch.manual_seed(1)
        with step_perf("cpu", memory=measure) as perf:
            start = CLOCK[0]()
            with hooks() if hooks else contextlib.nullcontext():
                loss = w.loss(fn(**w.batch))
            loss.backward()
            seconds = CLOCK[0]() - start
        return loss, perf, seconds

    for _ in range(2):
        one()
    loss, perf, _ = one(measure=True)
    return dict(peak=perf.result.peak_bytes, loss=float(loss),
                grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                buffers={n: b.clone() for n, b in model.named_buffers()}), lambda: one()[2]


def _fxmem(w: Workload, inner: str, options: dict, no_offload: bool = False) -> tuple[dict, Callable[[], float]]:
    torch._dynamo.reset()
    model = copy.deepcopy(w.model)
    fn = torch.compile(model, backend="fxmem", options={"inner": inner, **options})
    same = kept_on_device() if no_offload else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, same:
        warnings.simplefilter("always")
        r, timer = _prepared(w, model, fn)
    rep = fxmem.report(fn)
    r.update(predicted=rep.predict_peak(), host=rep.host_bytes(), offloaded=sum(len(g.offloaded) for g in rep.graphs),
             warnings=[str(x.message)[:160] for x in caught if "fxmem" in str(x.message)])
    return r, timer


class _Checkpointed(torch.nn.Module):
    """One block of a plain PyTorch model under ``torch.utils.checkpoint`` (non-reentrant), as
    Hugging Face's gradient checkpointing wraps each layer."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _seed(w: Workload, checkpointing: bool = True) -> tuple[dict, Callable[[], float]]:
    """The seed's recipe: checkpointing (HF's where the model has it, else ``torch.utils.checkpoint``
    around each block of a plain model's ``features`` stack) with save_on_cpu's hooks; without
    ``checkpointing``, save_on_cpu alone (every saved tensor to host memory)."""
    model = copy.deepcopy(w.model)
    recipe = "save_on_cpu alone"
    if checkpointing and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        recipe = "HF checkpointing + save_on_cpu"
    elif checkpointing:
        for i, block in enumerate(model.features):
            model.features[i] = _Checkpointed(block)
        recipe = "torch.utils.checkpoint per block + save_on_cpu"
    r, timer = _prepared(w, model, model, hooks=save_on_host)
    r["recipe"] = recipe
    return r, timer


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bitwise_pair(w: Workload, inner: str, options: dict) -> bool:
    """The plan with offload and the same plan without, bit for bit. Inductor's CPU kernels
    accumulate some scatters (an embedding's gradient) in an order that depends on the threads:
    two compiles of one plan differ there with two threads, so Inductor's pair runs on one."""
    threads = torch.get_num_threads()
    if inner == "inductor":
        torch.set_num_threads(1)
    try:
        (a, _), (b, _) = _fxmem(w, inner, options), _fxmem(w, inner, options, no_offload=True)
    finally:
        torch.set_num_threads(threads)
    return a["offloaded"] > 0 and _same(a["grads"], b["grads"]) and _same(a["buffers"], b["buffers"])


def measure(name: str, inners: list[str], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    w = MODELS[name]()
    runs: dict[tuple[str, str], tuple[dict, Callable[[], float], dict]] = {}

    def add(inner, config, r, timer, **extra):
        runs[inner, config] = (r, timer, extra)
        print(f"{name} {inner} {config}: peak {r['peak'] / MiB:.1f} MiB, predicted "
              f"{(r.get('predicted') or 0) / MiB:.1f}, host {r.get('host', 0) / MiB:.1f} MiB {extra}", flush=True)

    seed, timer = _seed(w)
    add("eager", "seed", seed, timer, recipe=seed["recipe"])
    alone, timer = _seed(w, checkpointing=False)
    add("eager", "save_on_cpu alone", alone, timer, recipe=alone["recipe"])
    for inner in inners:
        add(inner, "recompute-only", *_fxmem(w, inner, {"memory_budget": 0.0}))
        options = {"peak_budget": int(BUDGET * runs[inner, "recompute-only"][0]["peak"]), "offload": True}
        off, off_timer = _fxmem(w, inner, options)
        if inner == "eager":  # the same plan without offload: its peak and time beside offload's
            add(inner, "same plan, no offload", *_fxmem(w, inner, options, no_offload=True))
        add(inner, "offload@0.8", off, off_timer, budget=options["peak_budget"],
            met=off["peak"] <= 1.02 * options["peak_budget"], bitwise=_bitwise_pair(w, inner, options),
            bitwise_threads=1 if inner == "inductor" else torch.get_num_threads())
        below = int(SEED * seed["peak"])  # below the seed's recipe's peak, at the least modelled time
        r, timer = _fxmem(w, inner, {"peak_budget": below, "offload": True})
        add(inner, "offload@seed", r, timer, budget=below, met=r["peak"] <= below)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    for _ in range(rounds):  # interleaved: the machine's load falls on every configuration alike
        for key, (_, timer, _) in runs.items():
            times[key].append(timer())
    rows, seed_time = [], statistics.median(times["eager", "seed"])
    for (inner, config), (r, _, extra) in runs.items():
        rows.append({"model": name, "inner": inner, "config": config, "peak": r["peak"],
                     "step_s": statistics.median(times[inner, config]), "predicted": r.get("predicted"),
                     "host": r.get("host", 0), "offloaded": r.get("offloaded", 0), "loss": r["loss"],
                     "vs_seed_peak": r["peak"] / seed["peak"],
                     "vs_seed_time": statistics.median(times[inner, config]) / seed_time,
                     "warnings": "; ".join(r.get("warnings", [])), **extra})
        print(f"  {inner} {config}: median step {rows[-1]['step_s']:.2f} s over {rounds} interleaved rounds "
              f"({rows[-1]['vs_seed_time']:.2f}x the seed's), peak {rows[-1]['vs_seed_peak']:.2f}x the seed's",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--inner", default="eager,inductor")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per configuration, interleaved")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: CPU seconds of this process on one thread (others' load does not count); "
                         "wall: wall seconds with torch's threads")
    ap.add_argument("--name", default="offload")
    ap.add_argument("--keep", action="store_true", help="keep the results file's rows of the models not measured")
    args = ap.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
        torch.set_num_threads(1)
    else:
        CLOCK[0] = time.perf_counter
    rows = []
    if args.keep:
        import results_format

        old = results_format.read(Path(harness.RESULTS) / f"{args.name}.json")
        rows = [r for r in (results_format.unflatten(x) for x in old.records().values())
                if r.get("model") in MODELS and r["model"] not in args.models.split(",")]
    for name in args.models.split(","):
        rows += [{**r, "clock": args.clock} for r in measure(name, args.inner.split(","), args.rounds)]
    harness.write(args.name, rows, meta=common.metadata(), spec="offload")


if __name__ == "__main__":
    main()
