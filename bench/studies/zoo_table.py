"""The zoo table (issues [zoo], [generality]): every zoo model under every option set, side by
side with eager, torch's min-cut partitioner and Hugging Face's gradient checkpointing. Per cell:
the step equals eager's (loss and every gradient, no fallback: ``fxmem.testing.zoo.conform``),
the measured peak (the third step, exact on CPU), ``predict_peak``'s error against it (the whole
step's prediction, every graph of a step that Dynamo splits), graphs and graph breaks. Per model,
the checks of [generality]: level 1 below level 0 wherever ``memory_budget=0.0`` is, level 1 at
most 1.02x ``memory_budget=0.0`` and at most HF checkpointing, levels 1/2 with lowering off at
most level 0 with lowering off (not at most the default itself wherever the fused loss is what
lowers the peak: no recompute removes the logits and their gradient). Lowering as fxmem's
default (every pattern but dropout) unless the column says "no lowering".

    python bench/studies/zoo_table.py [--profile tiny|thorough] [--inner inductor] [MODEL ...]
        # writes bench/results/zoo-<profile>[-inductor].{json,md}; --inner inductor: levels 0 and 1,
        # memory_budget=0.0 with the Inductor inner compiler (predictions of Inductor's buffers),
        # under Inductor's fallback_random (dropout draws eager's masks, so the step can equal eager's)
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, configs

import common  # noqa: E402
import configs  # noqa: E402
import harness  # noqa: E402
import results_format  # noqa: E402

import fxmem  # noqa: E402
from fxmem.graph_breaks import break_count, breaks_since  # noqa: E402
from fxmem.profiling import step_perf  # noqa: E402
from fxmem.testing.zoo import FAMILY, PROFILES, ZOO, conform, eager_step, zoo_build  # noqa: E402

OPTIONS = {
    "L0": {"level": 0},
    "L1": {"level": 1, "strict": True},
    "L2": {"level": 2},
    "L2 budget 0.3": {"level": 2, "memory_budget": 0.3},
    "L0 no lowering": {"level": 0, "lowering": False},
    "L1 no lowering": {"level": 1, "lowering": False},
    "L2 no lowering": {"level": 2, "lowering": False},
    "budget 0.0": {"memory_budget": 0.0},
}
INDUCTOR = ("L0", "L1", "budget 0.0")  # the cells measured with --inner inductor
BAR = 0.05  # predict_peak's error
OVER_LEAST = 1.02  # level 1 at most this times memory_budget=0.0's peak


def _peak(fn, w) -> int:
    """The measured peak of the third step of ``fn`` (a module, or a compiled one, over
    ``w.batch``), gradients freed before each step as ``conform`` and the HF checkpointing
    baseline free them (else the gradients of the step before are already allocated and their
    bytes are missing from the peak: a gradient-bound model looked lighter in eager)."""
    with torch._dynamo.config.patch(allow_rnn=True):
        for _ in range(3):
            fn.zero_grad(set_to_none=True)
            with step_perf("cpu") as perf:
                eager_step(fn, w)
    return perf.result.peak_bytes


def _mincut(w) -> int | None:
    """The step's peak under torch's min-cut partitioner with nop compilers, None where its
    graphs fail to run (PatchTST: a ``view`` of CPU batch norm's output, whose layout is not
    the traced one; fxmem's eager inner compiler reshapes there)."""
    torch._dynamo.reset()
    try:
        return _peak(configs.build(copy.deepcopy(w.model), configs.parse("mincut_eager")), w)
    except RuntimeError as e:
        print(f"{w.name}: min-cut baseline failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
        return None


def _hf_checkpointing(w) -> int | None:
    """The eager step's peak with Hugging Face's layerwise checkpointing, None where the model
    does not support it (gradients freed before each step, as ``conform`` does)."""
    model = copy.deepcopy(w.model)
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            eager_step(model, w)
    return perf.result.peak_bytes


def model_row(name: str, profile: str, inner: str = "eager") -> dict:
    t = time.perf_counter()
    w = zoo_build(name, profile)
    ref = copy.deepcopy(w.model)
    reference = ref, eager_step(ref, w)
    torch._dynamo.reset()
    row = dict(model=name, family=FAMILY[name], eager=_peak(copy.deepcopy(w.model), w),
               mincut=_mincut(w), hf_ckpt=_hf_checkpointing(w), cells={})
    options = OPTIONS if inner == "eager" else {k: OPTIONS[k] for k in INDUCTOR}
    for label, opts in options.items():
        before = break_count()
        try:
            c = conform(w, {**opts, "inner": inner}, reference)
            rep = fxmem.report(c.compiled)
            predicted = rep.predict_peak()
            cell = dict(ok=c.ok, peak=c.peak_bytes, predicted=predicted, error=predicted / c.peak_bytes - 1,
                        graphs=len(rep.step_graphs()), breaks=len(breaks_since(before)),
                        problems=c.fallbacks + c.mismatches,
                        lowered=sorted({r.pattern for g in rep.graphs for r in g.lowerings}))
        except Exception as e:  # noqa: BLE001 - a cell that fails is a result, not the end of the run
            cell = dict(ok=False, peak=0, predicted=0, error=0.0, graphs=0, breaks=0,
                        problems=[f"{type(e).__name__}: {e}"], lowered=[])
        row["cells"][label] = cell
        print(name, label, {k: v for k, v in cell.items() if k != "problems"}, cell["problems"][:2], flush=True)
    row.update(checks(row), ok=all(c["ok"] for c in row["cells"].values()),
               predicted_within=all(c["peak"] > 0 and abs(c["error"]) <= BAR for c in row["cells"].values()),
               seconds=time.perf_counter() - t)
    return row


def checks(row: dict) -> dict:
    """[generality]'s per-model checks (those whose cells were measured)."""
    peak = {k: c["peak"] for k, c in row["cells"].items()}
    out = {}
    l0, l1, least = peak.get("L0"), peak.get("L1"), peak.get("budget 0.0")
    if l1 and least:
        out["l1_over_least"] = l1 / least
        out["l1_le_least"] = l1 <= OVER_LEAST * least and (l1 < l0 or least >= l0)
    if l1 and row.get("hf_ckpt"):
        out["l1_over_hf"] = l1 / row["hf_ckpt"]
    levels = [k for k in ("L1", "L2", "L2 budget 0.3", "budget 0.0") if k in peak]
    out["levels_le_l0"] = all(peak[k] <= l0 for k in levels)
    off = [k for k in peak if k.endswith(" no lowering")]
    if off:  # lowering off: never below its level with lowering; levels 1/2 at most level 0's (both off)
        out["lowering_no_raise"] = all(peak[k.removesuffix(" no lowering")] <= peak[k] for k in off)
        out["off_levels_le_l0"] = all(peak[k] <= peak["L0 no lowering"] for k in off)
    return out


def main(argv=None, prefix: str = "zoo", script: str = "bench/studies/zoo_table.py") -> None:
    """The command line; ``prefix`` and ``script``: the results' name and the command they quote
    (``outside_zoo.py`` runs it on families it adds to ``ZOO``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=list(PROFILES), default="tiny")
    ap.add_argument("--inner", choices=("eager", "inductor"), default="eager")
    ap.add_argument("--merge", action="store_true",
                    help="measure the MODELs named and replace their rows in the committed results, keeping the others")
    ap.add_argument("models", nargs="*", choices=[[], *ZOO], default=[])
    args = ap.parse_args(argv)
    names = args.models or list(ZOO)
    torch.set_num_threads(1)
    inner = "" if args.inner == "eager" else f" --inner {args.inner}"
    meta = common.metadata(f"python {script} --profile {args.profile}{inner} "
                           + ("--merge " if args.merge else "") + " ".join(args.models))
    study = f"{prefix}-{args.profile}" + ("" if args.inner == "eager" else f"-{args.inner}")
    rows = []
    if args.merge:  # the committed rows, in zoo order, those of the models named measured again
        old = results_format.read(results_format.RESULTS / f"{study}.json")
        rows = list(old.records().values())  # flat records: written back as the same rows
        meta = {**meta, "merged": f"{', '.join(names)} measured again at this commit; the other rows "
                                  f"from commit {old.meta.get('commit')}"}
    if args.inner == "inductor":
        torch._inductor.config.fallback_random = True
    for name in names:  # rewritten after every model: a long run keeps what it measured
        rows = [r for r in rows if r["model"] != name]
        rows.append(model_row(name, args.profile, args.inner))
        rows.sort(key=lambda r: list(ZOO).index(r["model"]))
        harness.write(study, rows, meta=meta, spec="zoo",
                      run={"profile": args.profile, "inner": args.inner, "bar": BAR, "over_least": OVER_LEAST})


if __name__ == "__main__":
    main()
