"""Ghost clipping benchmark: DP-SGD clipped sums at the memory of ordinary training.

    python bench/ghost.py                      # the issue's shapes (CPU: a few minutes)
    python bench/ghost.py --quick              # tiny shapes: writes ghost-quick.*
    python bench/ghost.py --inner eager        # fxmem's eager inner compiler (no Inductor compiles)

Model: the plain-PyTorch GPT of bench/dpsgd_models.py (2 layers, hidden 128, 4 heads, vocab 4096,
no weight tying), batch 32, sequence 64, C = 1, the full batch in one chunk, side by side in one
process:

- fxmem ghost: ``fxmem.dpsgd.clipped_grad(..., microbatch_size=32)`` (ghost clipping is on by
  default: ghost norms + book-keeping for the linear and embedding weights, fxmem/per_example/ghost/);
- fxmem materialized: the same with ``options={"ghost_clipping": False}`` ([m, *param] per-example
  gradients, clipped and summed by matvecs);
- non-private: one ordinary training step of the same model and batch (``loss.backward()``, eager);
- non-private step, torch.compile: the same step compiled with Inductor (for context: the
  targets compare with the plain eager step, as the issue states them);
- Opacus ghost: ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True, max_grad_norm=1)``
  with ``DPOptimizerFastGradientClipping`` (noise_multiplier 0) and ``DPLossFastGradientClipping``:
  its two backward passes leave the clipped sum in ``p.grad`` (read before the optimizer step,
  which would add noise and divide by the batch size). It runs on a copy of the model (same
  weights): Opacus's hooks would otherwise fire in the other variants' forwards.

Clipped sums are checked against an explicit per-example reference (``vmap(grad)`` over chunks of
8, norms in float64, eager), max relative error per parameter. Conventions: fxmem clips with
``min(1, C' / norm)`` (opake's rule, C' = C less a few ULPs), Opacus with
``min(1, C / (norm + 1e-6))``: a relative difference of about 1e-6 / norm on clipped examples.
Opacus needs the positions batched (``wpe(pos.expand(b, t))``, same values) and the per-example loss
as the mean over each sequence's tokens (``loss_reduction="mean"`` with ``shape=(b, t - 1)``), which
is the per-example loss that fxmem differentiates.

Peak = exact peak of one step above what was live before it (CPU: allocator events via
fxmem.profiling.step_perf; gradients set to None before the non-private and Opacus steps, so their
allocation counts as fxmem's outputs do); time = median of ``--steps`` steps after warm-up, the
variants interleaved step by step. Writes <out-dir>/<name>.json and .md (bench/common.py's
writer; --out-dir defaults to bench/results).
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.func import grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import harness  # noqa: E402
from dpsgd import rel_err  # noqa: E402
from dpsgd_models import Logits, gpt, per_example_loss  # noqa: E402

from fxmem.dpsgd import clipped_grad  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402

MIB = 2**20
RTOL = 1e-5
FULL = dict(vocab=4096, d=128, layers=2, heads=4, seq=64, batch=32)
QUICK = dict(vocab=256, d=32, layers=1, heads=2, seq=16, batch=8)


def reference(loss, C: float, m: int = 8):
    """Explicit per-example clipped sum: vmap(grad) over chunks of m, norms in float64."""
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))

    def step(params, ids, labels):
        total = None
        with torch.no_grad():
            for s in range(0, ids.shape[0], m):
                g = per_example(params, ids[s:s + m], labels[s:s + m])
                sq = sum((v.double() ** 2).reshape(v.shape[0], -1).sum(1) for v in g.values())
                factor = (C / sq.sqrt()).clamp(max=1.0)
                part = {k: torch.einsum("b,b...->...", factor, v.double()) for k, v in g.items()}
                total = part if total is None else {k: total[k] + part[k] for k in total}
        return {k: v.float() for k, v in total.items()}

    return step


def fxmem_variant(loss, C: float, batch: int, inner: str, ghost: bool):
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=batch,
                      options={"inner": inner, "ghost_clipping": ghost})
    return fn, (lambda params, ids, labels: fn(params, ids, labels))


def nonprivate_variant(model: nn.Module, compiled: bool = False):
    names = [k for k, _ in model.named_parameters()]
    run = torch.compile(model) if compiled else model  # compiled: Inductor, for context only

    def step(params, ids, labels):
        model.zero_grad(set_to_none=True)
        run(ids, labels).backward()
        return {k: p.grad for k, p in zip(names, model.parameters())}

    return step


def opacus_variant(model: nn.Module, C: float, batch: int):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = copy.deepcopy(model)  # Opacus hooks its modules: keep them away from the other variants
    wrapped = GradSampleModuleFastGradientClipping(Logits(model), batch_first=True, loss_reduction="mean",
                                                   max_grad_norm=C, use_ghost_clipping=True)
    sgd = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    optimizer = DPOptimizerFastGradientClipping(sgd, noise_multiplier=0.0, max_grad_norm=C,
                                                expected_batch_size=batch, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss(), loss_reduction="mean")
    names = [k for k, _ in model.named_parameters()]
    params = list(model.parameters())

    def step(_params, ids, labels):
        for p in params:
            p.grad = None
        logits = wrapped(ids)
        b, t, v = logits.shape
        loss = criterion(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), shape=(b, t - 1))
        loss.backward()  # two backward passes: norms (ghost), then the clip-weighted sum
        return {k: p.grad for k, p in zip(names, params)}

    return step


def run(args) -> tuple[list[dict], dict]:
    shape = QUICK if args.quick else FULL
    C = 1.0
    B = shape["batch"]
    model, params, ids, labels = gpt(shape["vocab"], shape["d"], shape["layers"], shape["heads"],
                                     shape["seq"], B)
    loss = per_example_loss(model)
    n_params = sum(p.numel() for p in params.values())
    print(f"model: GPT {shape['layers']} layers, d={shape['d']}, {shape['heads']} heads, vocab "
          f"{shape['vocab']}, {n_params / 1e6:.2f}M params; batch {B} x seq {shape['seq']}, C={C}, "
          f"one chunk of {B}, fxmem inner {args.inner}", flush=True)
    ref = reference(loss, C)(params, ids, labels)

    variants: dict[str, dict] = {}
    fn, step = fxmem_variant(loss, C, B, args.inner, ghost=True)
    variants["fxmem ghost"] = dict(step=step, fn=fn, kind="fxmem")
    fn, step = fxmem_variant(loss, C, B, args.inner, ghost=False)
    variants["fxmem materialized"] = dict(step=step, fn=fn, kind="fxmem")
    variants["non-private step"] = dict(step=nonprivate_variant(model), kind="nonprivate")
    variants["opacus ghost"] = dict(step=opacus_variant(model, C, B), kind="opacus")
    if args.compiled_baseline:
        variants["non-private step, torch.compile"] = dict(step=nonprivate_variant(model, compiled=True),
                                                           kind="nonprivate")

    rows = []
    for i, (name, v) in enumerate(variants.items(), 1):
        print(f"[{i}/{len(variants)}] {name}: compile + warm-up ...", flush=True)
        t0 = time.perf_counter()
        out = v["step"](params, ids, labels)
        row = dict(variant=name, kind=v["kind"], first_call_s=time.perf_counter() - t0)
        out = v["step"](params, ids, labels)
        if v["kind"] != "nonprivate":
            row["rel_err"] = rel_err(out, ref)
            row["ok"] = row["rel_err"] <= RTOL
        del out
        with step_perf("cpu") as perf:
            out = v["step"](params, ids, labels)
        del out
        row["peak_bytes"] = perf.result.peak_bytes
        if v.get("fn") is not None:
            plan = v["fn"].plans[-1] if v["fn"].plans else None
            row["plan"] = plan.summary() if plan is not None else None
        row["times"] = []
        rows.append(row)
        check = "" if "rel_err" not in row else f"  {'ok' if row['ok'] else 'MISMATCH'} ({row['rel_err']:.1e})"
        print(f"    peak {row['peak_bytes'] / MIB:8.1f} MiB{check}  [first call {row['first_call_s']:.1f} s]",
              flush=True)

    print(f"timing: {args.steps} steps per variant, interleaved ...", flush=True)
    for s in range(args.steps + 1):
        for r in rows:
            with step_perf("cpu", memory=False) as perf:
                out = variants[r["variant"]]["step"](params, ids, labels)
            del out
            if s > 0:  # one more warm-up round
                r["times"].append(perf.result.time_s)
    by = {r["variant"]: r for r in rows}
    base, op = by["non-private step"], by["opacus ghost"]
    for r in rows:
        r["time_s"] = statistics.median(r["times"])
    for r in rows:
        r["peak_vs_nonprivate"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_nonprivate"] = r["time_s"] / base["time_s"]
        r["peak_vs_opacus"] = r["peak_bytes"] / op["peak_bytes"]
        r["time_vs_opacus"] = r["time_s"] / op["time_s"]
        print(f"    {r['variant']:>20}: peak {r['peak_bytes'] / MIB:8.1f} MiB ({r['peak_vs_nonprivate']:.2f}x "
              f"non-private, {r['peak_vs_opacus']:.2f}x opacus)  {r['time_s'] * 1e3:8.1f} ms "
              f"({r['time_vs_nonprivate']:.2f}x non-private, {r['time_vs_opacus']:.2f}x opacus)", flush=True)
    fx = by["fxmem ghost"]
    targets = [
        dict(target="fxmem ghost peak <= 1.2x non-private step", value=fx["peak_vs_nonprivate"], limit=1.2),
        dict(target="fxmem ghost peak <= 0.8x Opacus ghost clipping", value=fx["peak_vs_opacus"], limit=0.8),
        dict(target="fxmem ghost time <= 1.5x non-private step", value=fx["time_vs_nonprivate"], limit=1.5),
        dict(target="fxmem ghost time <= Opacus ghost clipping", value=fx["time_vs_opacus"], limit=1.0),
    ] + [dict(target=f"{r['variant']}: clipped sum equals the per-example reference (rel {RTOL:g})",
              value=r["rel_err"], limit=RTOL) for r in rows if "rel_err" in r]
    for t in targets:
        t["met"] = bool(t["value"] <= t["limit"])
    info = dict(shape=shape, clipping_norm=C, params=n_params, inner=args.inner, targets=targets,
                param_names=list(params))
    return rows, info


def main(argv=None) -> int:
    ap = common.parser(__doc__, name="ghost")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "eager"), help="fxmem's inner compiler")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--no-compiled-baseline", dest="compiled_baseline", action="store_false",
                    help="skip the informational non-private step compiled with Inductor")
    args = common.parse(ap, argv)
    common.set_threads(args.threads)
    meta = common.metadata(args.command)
    t0 = time.perf_counter()
    rows, info = run(args)
    run_info = dict(name=args.name, steps=args.steps, threads=args.threads or torch.get_num_threads(),
                    wall_s=round(time.perf_counter() - t0, 1), **info)
    targets = run_info.pop("targets")
    jp, _ = harness.write(args.name, rows, args.out_dir, meta=meta, run=run_info, targets=targets,
                            spec="ghost")
    print("targets:", flush=True)
    for t in targets:
        print(f"    {t['target']}: {'met' if t['met'] else 'MISSED'} ({t['value']:.3g} vs {t['limit']:.3g})",
              flush=True)
    print(f"wrote {jp} and .md ({run_info['wall_s']:.0f} s)", flush=True)
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
