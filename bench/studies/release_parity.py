"""The parameters after a few AdamW steps with the step inside the backward, against eager PyTorch
(issue #55 [release]): the Llama-family model at the bench's ``llama_small`` size (12 layers,
768 wide, vocab 32000, batch 2 x 512), AdamW with a StepLR schedule, five steps on fresh batches.

    python bench/studies/release_parity.py --inner eager,inductor --autocast off,bf16
    # writes bench/results/release-parity.{json,md}

Reference: the same model in eager PyTorch, ``loss.backward(); optimizer.step(); zero_grad();
scheduler.step()``. fxmem: ``torch.compile(backend="fxmem", options={"level": 1, "inner": ...,
"step_in_backward": optimizer})``, ``loss.backward(); scheduler.step()``. The figure is the
largest |parameter difference| over the largest |parameter| after the last step. Under autocast
both run their forward under ``torch.autocast("cpu", bfloat16)``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, configs

import common  # noqa: E402
import configs  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

import fxmem  # noqa: E402,F401  (registers the backend)
from fxmem.models import build  # noqa: E402

LR, STEPS = 1e-5, 5


def _batches(w, steps: int) -> list[dict]:
    """``steps`` batches of random tokens shaped like the workload's (the first is its own)."""
    out = [w.batch]
    for i in range(1, steps):
        g = torch.Generator().manual_seed(i)
        out.append({k: torch.randint(0, w.model.config.vocab_size, v.shape, generator=g) for k, v in w.batch.items()})
    return out


def _train(model, batches, loss_of, autocast: str, compiled_options: dict | None) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    fn = model if compiled_options is None else torch.compile(
        model, backend="fxmem", options={**compiled_options, "step_in_backward": opt})
    t0 = time.perf_counter()
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
            loss = loss_of(fn(**batch))
        loss.backward()
        if compiled_options is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", default="eager,inductor")
    ap.add_argument("--autocast", default="off,bf16")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--name", default="release-parity")
    args = ap.parse_args()
    kwargs = configs.model_kwargs("llama_small", quick=False)
    rows = []
    for autocast in args.autocast.split(","):
        w = build(configs.BUILDER["llama_small"], **kwargs)
        start = copy.deepcopy(w.model.state_dict())
        batches = _batches(w, args.steps)
        ref = copy.deepcopy(w.model)
        ref_s = _train(ref, batches, w.loss, autocast, None)
        largest = max(p.abs().max().item() for p in ref.parameters())
        for inner in args.inner.split(","):
            torch._dynamo.reset()
            w.model.load_state_dict(start)
            model = copy.deepcopy(w.model)
            s = _train(model, batches, w.loss, autocast, {"level": 1, "inner": inner})
            diff = max((a.double() - b.double()).abs().max().item()
                       for a, b in zip(model.parameters(), ref.parameters()))
            left = sum(p.grad is not None for p in model.parameters())
            rows.append(dict(model="llama_small", inner=inner, autocast=autocast, steps=args.steps, lr=LR,
                             max_abs_diff=diff, largest=largest, rel_to_largest=diff / largest,
                             met=diff / largest <= 1e-5, grads_left=left, fxmem_s=s, eager_s=ref_s))
            print(rows[-1], flush=True)
    harness.write(args.name, rows, meta=common.metadata(" ".join(["python bench/studies/release_parity.py",
                                                                  *sys.argv[1:]])), spec="release-parity")


if __name__ == "__main__":
    main()
