"""DP-SGD's first call against plain ``torch.compile``'s first training step (issue [dp-parity]):
the README's DP-SGD block (HF GPT-2, 2 layers, hidden 64, vocab 512, batch 8 x sequence 32),
``fxmem.dpsgd.clipped_grad`` in chunks of 4, against the same model's first ``torch.compile``
training step (forward, loss, backward) with the same inner compiler: ``aot_eager`` for fxmem's
``inner="eager"``, Inductor for its default.

Each measurement runs in a fresh process (empty Inductor and fxmem caches), the variants
interleaved over ``--rounds`` rounds; the median is reported. *cold*: the process's first compile
(what a script's first step costs: Dynamo's and AOTAutograd's imports included); *warm*: after one
compile of an unrelated function with the plain variant's backend (``aot_eager`` or Inductor: the
imports of Dynamo and AOTAutograd paid; fxmem's own first use, its kernels and networkx, is not).
Dynamo's own timers (``compilation_time_metrics``) split each first call: Dynamo's bytecode
tracing, AOTAutograd (the partitioner, so fxmem's planner, included) or, for a per-example chunk
with the eager inner compiler, fxmem's one-pass trace of it (``inner.trace_flat``), the Inductor
compiles; the rest is running the step and what lies outside those timers.

    python bench/studies/first_call.py [--rounds 3] [--inner eager inductor]
        # writes bench/results/dpsgd-first-call.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # bench/: common, harness

BAR = 2.0  # fxmem's first call at most this times plain torch.compile's first step
PLAIN_BACKEND = {"eager": "aot_eager", "inductor": "inductor"}
TIMERS = {"tracing": ("bytecode_tracing",),  # Dynamo tracing the Python (nested compiles included)
          # AOTAutograd with the partitioner (fxmem's planner), or fxmem's own trace of a chunk
          "aot": ("create_aot_dispatcher_function", "fxmem_trace_flat"),
          "inner": ("compile_fx_inner",)}  # Inductor's compile of each graph


def _readme_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, use_cache=False,
                                       eos_token_id=0, bos_token_id=0))
    return model, torch.randint(0, 512, (8, 32))


def _warm_up(backend: str) -> None:
    import torch

    x = torch.randn(4, 4, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)(x).backward()


def _timers() -> dict[str, float]:
    """Seconds in Dynamo's timed phases so far (each the sum over its calls)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {phase: sum(sum(compilation_time_metrics.get(n, ())) for n in keys) for phase, keys in TIMERS.items()}


def child(variant: str, inner: str, warm: bool) -> dict:
    """One fresh process's measurement: the first and the second call of ``variant``."""
    import torch

    warnings.filterwarnings("ignore")
    import fxmem  # noqa: F401  (registers the backend)
    from fxmem.dpsgd import clipped_grad, make_functional

    if warm:
        _warm_up(PLAIN_BACKEND[inner])
    before = _timers()
    model, ids = _readme_model()
    if variant == "plain":
        compiled = torch.compile(model, backend=PLAIN_BACKEND[inner])

        def call():
            compiled(input_ids=ids, labels=ids).loss.backward()
    else:
        fn, trainable, frozen = make_functional(model)

        def loss(p, ids, labels):
            return fn(p, frozen, input_ids=ids[None], labels=labels[None]).loss

        step = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), microbatch_size=4,
                            options={"inner": inner})

        def call():
            step(trainable, ids, ids)
    t = time.perf_counter()
    call()
    first = time.perf_counter() - t
    after = _timers()
    t = time.perf_counter()
    call()
    second = time.perf_counter() - t
    return dict(first_s=first, second_s=second, **{f"{k}_s": after[k] - before[k] for k in TIMERS})


def _spawn(variant: str, inner: str, warm: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "FXMEM_CACHE": f"{tmp}/fxmem"}
        args = [sys.executable, __file__, "--child", variant, "--inner", inner] + (["--warm"] if warm else [])
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(rounds: int, inners: list[str]) -> None:
    import common
    import harness

    records, targets = [], []
    for inner in inners:
        for warm in (False, True):
            runs: dict[str, list[dict]] = {"plain": [], "fxmem": []}
            for _ in range(rounds):
                for variant in runs:  # interleaved: the machine's noise hits both alike
                    runs[variant].append(_spawn(variant, inner, warm))
                    print(inner, "warm" if warm else "cold", variant, round(runs[variant][-1]["first_s"], 2),
                          flush=True)
            med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
            start = "warm" if warm else "cold"
            for variant, m in med.items():
                name = f"torch.compile ({PLAIN_BACKEND[inner]})" if variant == "plain" else "fxmem clipped_grad m=4"
                records.append(dict(inner=inner, start=start, variant=name, **m,
                                    ratio=m["first_s"] / med["plain"]["first_s"],
                                    runs=", ".join(f"{r['first_s']:.2f}" for r in runs[variant])))
            ratio = med["fxmem"]["first_s"] / med["plain"]["first_s"]
            targets.append(dict(target=f"fxmem first call / torch.compile first step, inner {inner}, {start}",
                                value=ratio, limit=BAR, met=ratio <= BAR))
    command = "python bench/studies/first_call.py" + (f" --rounds {rounds}" if rounds != 3 else "") \
        + (f" --inner {' '.join(inners)}" if inners != ["eager", "inductor"] else "")
    harness.write("dpsgd-first-call", records, meta=common.metadata(command), targets=targets)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner", nargs="+", choices=list(PLAIN_BACKEND), default=["eager", "inductor"])
    ap.add_argument("--child", choices=("plain", "fxmem"))
    ap.add_argument("--warm", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.inner[0], a.warm)))
    else:
        main(a.rounds, a.inner)
