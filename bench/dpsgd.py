"""DP-SGD benchmark: clipped per-example gradient sums, fxmem against opake and a hand loop.

    python bench/dpsgd.py                      # the issue's shapes (CPU: several minutes)
    python bench/dpsgd.py --quick              # tiny shapes: writes dpsgd-quick.*
    python bench/dpsgd.py --inner eager        # fxmem's eager inner compiler (no Inductor compiles)

Model: a plain-PyTorch GPT (bench/dpsgd_models.py; 2 layers, hidden 128, 4 heads, vocab 4096, no
weight tying), batch 32, sequence 64, C = 1, side by side in one process:

- fxmem: ``fxmem.dpsgd.clipped_grad(..., microbatch_size=8)`` (chunked inside the compiler);
- opake: ``opake.dpsgd.clipping.clipped_grad(..., microbatch_size=8)``;
- hand loop: ``vmap(grad(loss))`` over chunks of 8, per-example norms, clip, sum, by hand (eager);
- fxmem auto: ``microbatch_size="auto"`` under each ``memory_budget`` (64, 128, 256 MB): the
  choice of fxmem/per_example/microbatch.py (two eager runs predict, one or two compiles are measured).

Every variant's clipped sum is checked against the hand loop (relative error per parameter:
max |a - b| / max |b|). Peak = exact peak of one step above what was live before it (CPU:
allocator events via fxmem.profiling.step_perf); time = median of ``--steps`` steps after warm-up,
the variants interleaved step by step so machine drift hits them alike. Writes
<out-dir>/<name>.json and .md (bench/common.py's writer; --out-dir defaults to bench/results).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import harness  # noqa: E402
from dpsgd_models import gpt, per_example_loss  # noqa: E402

from fxmem.dpsgd import clipped_grad  # noqa: E402
from fxmem.options import parse_bytes  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402

MIB = 2**20
RTOL = 1e-5
FULL = dict(vocab=4096, d=128, layers=2, heads=4, seq=64, batch=32, microbatch=8,
            budgets=("64MB", "128MB", "256MB"))
QUICK = dict(vocab=256, d=32, layers=1, heads=2, seq=16, batch=8, microbatch=2,
             budgets=("500KB", "700KB", "1MB"))


def hand_loop(loss, C: float, m: int):
    """What people write by hand: vmap(grad) over chunks of m, per-example global norms
    (per-parameter norms combined, no concatenation; each in two stages), clip factor min(1, C / norm) (opake's
    convention: no epsilon; opacus adds 1e-6 to the norm, a 1e-5 relative change at norm 0.1),
    weighted sum accumulated over chunks."""
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))

    def step(params, ids, labels):
        total = None
        with torch.no_grad():
            for s in range(0, ids.shape[0], m):
                g = per_example(params, ids[s:s + m], labels[s:s + m])
                # Norms in two stages (rows, then over them): one vector_norm over a 500k-element
                # row loses ~1e-5 on CPU, which would make this reference the least accurate.
                sq = sum(torch.linalg.vector_norm(torch.linalg.vector_norm(
                    v.reshape(v.shape[0], v.shape[1] if v.dim() > 2 else 1, -1), dim=2), dim=1) ** 2
                    for v in g.values())
                factor = (C / sq.sqrt()).clamp(max=1.0)
                part = {k: torch.einsum("b,b...->...", factor, v) for k, v in g.items()}
                del g
                total = part if total is None else {k: total[k] + part[k] for k in total}
        return total

    return step


def opake_variant(loss, C: float, m: int):
    from opake.dpsgd.clipping import clipped_grad as opake_clipped_grad

    fn, state = opake_clipped_grad(loss, clipping_norm=C, batch_argnums=(1, 2), microbatch_size=m)

    def step(params, ids, labels):
        out, _ = fn(params, ids, labels, state=state)
        return out.pytree  # a ClippedPytree: the sum and its sensitivity

    return step


def fxmem_variant(loss, C: float, inner: str, **kwargs):
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), options={"inner": inner}, **kwargs)
    return fn, (lambda params, ids, labels: fn(params, ids, labels))


def rel_err(got: dict, want: dict) -> float:
    worst = 0.0
    for k, w in want.items():
        err = ((got[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return worst


def run(args) -> tuple[list[dict], dict]:
    shape = QUICK if args.quick else FULL
    budgets = [b for b in args.budgets.split(",") if b] if args.budgets else list(shape["budgets"])
    m = args.microbatch or shape["microbatch"]
    C = 1.0
    model, params, ids, labels = gpt(shape["vocab"], shape["d"], shape["layers"], shape["heads"],
                                     shape["seq"], shape["batch"])
    loss = per_example_loss(model)
    n_params = sum(p.numel() for p in params.values())
    print(f"model: GPT {shape['layers']} layers, d={shape['d']}, {shape['heads']} heads, "
          f"vocab {shape['vocab']}, {n_params / 1e6:.2f}M params; batch {shape['batch']} x "
          f"seq {shape['seq']}, C={C}, microbatch {m}, fxmem inner {args.inner}", flush=True)

    variants: dict[str, dict] = {}
    variants["hand loop"] = dict(step=hand_loop(loss, C, m), microbatch=m, kind="hand")
    variants["opake"] = dict(step=opake_variant(loss, C, m), microbatch=m, kind="opake")
    fn, step = fxmem_variant(loss, C, args.inner, microbatch_size=m)
    variants["fxmem"] = dict(step=step, fn=fn, microbatch=m, kind="fxmem")
    for b in budgets:
        fn, step = fxmem_variant(loss, C, args.inner, microbatch_size="auto", memory_budget=b)
        variants[f"fxmem auto {b}"] = dict(step=step, fn=fn, microbatch=None, kind="auto",
                                           budget=b, budget_bytes=parse_bytes(b, "memory_budget"))

    rows, ref = [], None
    for i, (name, v) in enumerate(variants.items(), 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(variants)}] {name}: compile + warm-up ...", flush=True)
        row = dict(variant=name, kind=v["kind"], budget=v.get("budget"), budget_bytes=v.get("budget_bytes"))
        try:
            out = v["step"](params, ids, labels)  # first call: compiles (fxmem: auto picks m here)
            row["first_call_s"] = time.perf_counter() - t0
            out = v["step"](params, ids, labels)
        except MemoryError as e:  # fxmem auto: the budget is below one example at a time
            row.update(ok=False, error=str(e))
            print(f"    infeasible: {e}", flush=True)
            rows.append(row)
            v["skip"] = True
            continue
        if ref is None:
            ref = out
        row["rel_err"] = rel_err(out, ref)
        row["ok"] = row["rel_err"] <= RTOL
        del out
        with step_perf("cpu") as perf:
            out = v["step"](params, ids, labels)
        del out
        row["peak_bytes"] = perf.result.peak_bytes
        fn = v.get("fn")
        if fn is not None:
            # The per-example pass's decision for this step: the microbatch size in use (auto
            # resolves to a number at the first call), or why it did not chunk.
            row["microbatch"] = fn.chosen_microbatch_size()
            plan = fn.plans[-1] if fn.plans else None
            row["plan"] = plan.summary() if plan is not None else None
            if v["kind"] == "auto" and fn.auto is not None:  # microbatch.AutoChoice
                row["auto"] = dataclasses.asdict(fn.auto)
        else:
            row["microbatch"] = v["microbatch"]
        row["times"] = []
        rows.append(row)
        print(f"    m={row['microbatch']}  peak {row['peak_bytes'] / MIB:8.1f} MiB  "
              f"{'ok' if row['ok'] else 'MISMATCH'} ({row['rel_err']:.1e})  "
              f"[first call {row['first_call_s']:.1f} s]", flush=True)

    live = [(r, variants[r["variant"]]) for r in rows if "times" in r]
    print(f"timing: {args.steps} steps per variant, interleaved ...", flush=True)
    for s in range(args.steps):
        for r, v in live:
            with step_perf("cpu", memory=False) as perf:
                out = v["step"](params, ids, labels)
            del out
            r["times"].append(perf.result.time_s)
        print(f"    step {s + 1}/{args.steps}", flush=True)
    by = {r["variant"]: r for r in rows}
    opake_row, hand_row = by.get("opake"), by.get("hand loop")
    for r in rows:
        if "times" in r:
            r["time_s"] = statistics.median(r["times"])
    for r in rows:
        if "times" not in r:
            continue
        if opake_row and opake_row.get("peak_bytes"):
            r["peak_vs_opake"] = r["peak_bytes"] / opake_row["peak_bytes"]
            r["time_vs_opake"] = r["time_s"] / opake_row["time_s"]
        if hand_row and hand_row.get("peak_bytes"):
            r["peak_vs_hand"] = r["peak_bytes"] / hand_row["peak_bytes"]
        print(f"    {r['variant']:>22}: m={str(r['microbatch']):>4}  peak {r['peak_bytes'] / MIB:8.1f} MiB "
              f"({r.get('peak_vs_opake', float('nan')):.3f}x opake)  {r['time_s'] * 1e3:9.1f} ms "
              f"({r.get('time_vs_opake', float('nan')):.2f}x opake)  {'ok' if r['ok'] else 'MISMATCH'}",
              flush=True)
    targets = _targets(by)
    info = dict(shape={k: v for k, v in shape.items() if k != "budgets"}, microbatch=m, budgets=budgets,
                clipping_norm=C, params=n_params, inner=args.inner)
    return rows, dict(targets=targets, **info)


def _targets(by: dict) -> list[dict]:
    out = []
    m = by["fxmem"]["microbatch"] if "fxmem" in by else "?"
    fx, op, hand = by.get("fxmem"), by.get("opake"), by.get("hand loop")

    def add(text, value, limit, met):
        out.append(dict(target=text, value=value, limit=limit, met=bool(met)))

    if fx and op and "peak_bytes" in fx and "peak_bytes" in op:
        add(f"fxmem m={m} peak <= 0.8x opake's", fx["peak_bytes"] / op["peak_bytes"], 0.8,
            fx["peak_bytes"] <= 0.8 * op["peak_bytes"])
        add(f"fxmem m={m} step time <= opake's", fx["time_s"] / op["time_s"], 1.0, fx["time_s"] <= op["time_s"])
    if fx and hand and "peak_bytes" in fx and "peak_bytes" in hand:
        add(f"fxmem m={m} peak <= hand loop's", fx["peak_bytes"] / hand["peak_bytes"], 1.0,
            fx["peak_bytes"] <= hand["peak_bytes"])
    for name, r in by.items():
        if r["kind"] != "auto":
            continue
        if "peak_bytes" not in r:
            add(f"{name}: peak within the cap", None, r["budget_bytes"], False)
            continue
        add(f"{name}: peak within the cap (chosen m={r['microbatch']})", r["peak_bytes"], r["budget_bytes"],
            r["peak_bytes"] <= r["budget_bytes"])
        if fx and "first_call_s" in fx:
            add(f"{name}: first call (choice + compile) / fxmem m={m}'s first call",
                r["first_call_s"] / fx["first_call_s"], 2.0, r["first_call_s"] <= 2 * fx["first_call_s"])
    return out


def main(argv=None) -> int:
    ap = common.parser(__doc__, name="dpsgd")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "eager"),
                    help="fxmem's inner compiler")
    ap.add_argument("--microbatch", type=int, default=0, help="fixed microbatch size (default 8; quick 2)")
    ap.add_argument("--budgets", default="", help="comma-separated memory budgets for 'auto' "
                    "(default 64MB,128MB,256MB; quick 500KB,700KB,1MB)")
    ap.add_argument("--steps", type=int, default=5)
    args = common.parse(ap, argv)
    common.set_threads(args.threads)
    meta = common.metadata(args.command)
    t0 = time.perf_counter()
    rows, info = run(args)
    run_info = dict(name=args.name, steps=args.steps, threads=args.threads or torch.get_num_threads(),
                    wall_s=round(time.perf_counter() - t0, 1), **info)
    targets = run_info.pop("targets")
    jp, _ = harness.write(args.name, rows, args.out_dir, meta=meta, run=run_info, targets=targets,
                            spec="dpsgd")
    print("targets:", flush=True)
    for t in targets:
        print(f"    {t['target']}: {'met' if t['met'] else 'MISSED'}", flush=True)
    print(f"wrote {jp} and .md ({run_info['wall_s']:.0f} s)", flush=True)
    return 0 if all(r.get("ok") for r in rows if "peak_bytes" in r) else 1


if __name__ == "__main__":
    sys.exit(main())
