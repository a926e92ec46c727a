"""Issue [generality]'s measurements on every zoo family: level 0, level 1, ``memory_budget=0.0``,
level 1 without lowering, and Hugging Face's gradient checkpointing (eager, where the model
supports it); measured peak (third step, exact on CPU) and ``predict_peak`` per fxmem cell (the
largest over the step's graphs, with their count). It flags the families where level 1 is above
1.02x ``memory_budget=0.0``, above HF checkpointing, above level 0 while the budget is below it,
where lowering off peaks above level 1, and where a prediction misses by more than 5%.

    python bench/studies/generality.py [--profile tiny|thorough] [MODEL ...]
        # writes bench/results/generality-<profile>.{json,md} (long rows: case = model/cell)
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402

import fxmem  # noqa: E402
from fxmem.graph_breaks import break_count, breaks_since  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402
from fxmem.testing.zoo import FAMILY, PROFILES, ZOO, conform, eager_step, zoo_build  # noqa: E402

CELLS = {"L0": {"level": 0}, "L1": {"level": 1}, "budget 0.0": {"memory_budget": 0.0},
         "L1 no lowering": {"level": 1, "lowering": False}}
MISS = 0.05


def _hf_checkpointing_peak(w) -> int | None:
    """The eager step's peak with Hugging Face's layerwise checkpointing, None where unsupported."""
    model = copy.deepcopy(w.model)
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    peaks = []
    for _ in range(3):  # gradients freed before each step, as fxmem.testing.zoo.conform does
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            eager_step(model, w)
        peaks.append(perf.result.peak_bytes)
    return peaks[-1]


def measure(name: str, profile: str) -> dict:
    t = time.perf_counter()
    w = zoo_build(name, profile)
    ref = copy.deepcopy(w.model)
    reference = ref, eager_step(ref, w)
    out = {"model": name, "family": FAMILY[name], "cells": {}}
    for label, options in CELLS.items():
        before = break_count()
        try:
            c = conform(w, options, reference)
            graphs = fxmem.report(c.compiled).graphs
            predicted = max((g.predict_peak() for g in graphs), default=0)
            out["cells"][label] = dict(peak=c.peak_bytes, predicted=predicted, graphs=len(graphs), ok=c.ok,
                                       breaks=len(breaks_since(before)), problems=c.fallbacks + c.mismatches)
        except Exception as e:  # noqa: BLE001 - a failing cell is a result
            out["cells"][label] = dict(peak=0, predicted=0, graphs=0, ok=False, breaks=0,
                                       problems=[f"{type(e).__name__}: {str(e)[:300]}"])
    try:
        out["hf_ckpt"] = _hf_checkpointing_peak(w)
    except Exception as e:  # noqa: BLE001
        out["hf_ckpt"], out["hf_ckpt_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    out["seconds"] = time.perf_counter() - t
    print(json.dumps(out), flush=True)
    return out


def flags(r: dict) -> list[str]:
    c = r["cells"]
    l0, l1, b0, nl = (c[k]["peak"] for k in ("L0", "L1", "budget 0.0", "L1 no lowering"))
    found = []
    if l1 > 1.02 * b0:
        found.append(f"L1 {l1 / b0:.3f}x budget 0.0")
    if b0 < l0 and l1 >= l0:
        found.append("L1 not below L0 though budget 0.0 is")
    if r.get("hf_ckpt") and l1 > r["hf_ckpt"]:
        found.append(f"L1 {l1 / r['hf_ckpt']:.3f}x HF checkpointing")
    if nl > l1:
        found.append(f"no lowering {nl / l1:.3f}x L1")
    for k, v in c.items():
        if v["peak"] and abs(v["predicted"] / v["peak"] - 1) > MISS:
            found.append(f"{k} predicted {100 * (v['predicted'] / v['peak'] - 1):+.1f}%")
        if not v["ok"]:
            found.append(f"{k} not eager's: {'; '.join(v['problems'])[:120]}")
    return found


def rows_of(results: list[dict], commit: str | None) -> list[dict]:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []

    def row(case, metric, unit, value):
        rows.append(dict(study="generality", case=case, metric=metric, unit=unit, value=value, commit=commit, time=now))

    for r in results:
        for k, v in r["cells"].items():
            case = f"{r['model']}/{k}"
            row(case, "peak", "bytes", v["peak"])
            row(case, "predicted_peak", "bytes", v["predicted"])
            row(case, "graphs", "", v["graphs"])
            row(case, "equals_eager", "", v["ok"])
        if r.get("hf_ckpt") is not None:
            row(f"{r['model']}/HF checkpointing", "peak", "bytes", r["hf_ckpt"])
    return rows


def markdown(results: list[dict], profile: str) -> str:
    kib = lambda b: f"{b / 1024:,.0f}"  # noqa: E731
    lines = [f"# Generality, {profile} profile", "",
             "Measured peak KiB of the third step (predict_peak's error; graphs per step when more than one). "
             "HF ckpt: the eager step with Hugging Face's gradient checkpointing.", "",
             "| model | family | " + " | ".join(CELLS) + " | HF ckpt | L1 / budget 0.0 | L1 / HF ckpt | flags |",
             "|---|---|" + "---:|" * (len(CELLS) + 3) + "---|"]
    for r in results:
        c = r["cells"]

        def cell(v):
            err = 100 * (v["predicted"] / v["peak"] - 1) if v["peak"] else 0.0
            return f"{kib(v['peak'])} ({err:+.1f}%)" + (f" [{v['graphs']}g]" if v["graphs"] > 1 else "") + (
                "" if v["ok"] else " !")
        hf = r.get("hf_ckpt")
        l1 = c["L1"]["peak"]
        lines.append(f"| {r['model']} | {r['family']} | " + " | ".join(cell(v) for v in c.values())
                     + f" | {kib(hf) if hf else '-'} | {l1 / max(c['budget 0.0']['peak'], 1):.3f} | "
                     + (f"{l1 / hf:.3f}" if hf else "-") + f" | {'; '.join(flags(r)) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=list(PROFILES), default="tiny")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("models", nargs="*", default=[])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    meta = common.metadata(f"python bench/studies/generality.py --profile {args.profile} " + " ".join(args.models))
    results = []
    for name in args.models or list(ZOO):
        results.append(measure(name, args.profile))
        out = Path(args.out)
        doc = {"study": f"generality-{args.profile}", "meta": meta, "rows": rows_of(results, meta.get("commit"))}
        (out / f"generality-{args.profile}.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / f"generality-{args.profile}.md").write_text(markdown(results, args.profile))


if __name__ == "__main__":
    main()
