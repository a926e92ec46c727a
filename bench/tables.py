"""Table specs: for each kind of study, which fields name a case and how its rows become tables.

A study's results name their spec in ``meta["spec"]`` (``harness.write`` sets it; ``spec_name``
finds it from the study's name otherwise). A spec without tables gets ``harness.default_table``:
every scalar metric a column. ``DOC_TABLES`` are the tables README.md and docs/benchmarks.md
show between ``<!-- bench:NAME -->`` and ``<!-- /bench -->`` (``bench/render.py``); a study's own
table is named ``<study>:<table>`` there.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Sequence

from harness import MIB, Column, Results, Table, fmt

Records = dict[str, dict]


@dataclass(frozen=True)
class Spec:
    """``case``: the record fields that name a case, in order; ``tables``, or ``tables_fn`` giving
    them from the records; ``note``: a line under the header; ``notes``: lines after the tables."""

    name: str
    case: tuple[str, ...]
    tables: Sequence[Table] = ()
    title: Callable[[Results], str] | None = None
    note: str = ""
    notes: Callable[[Records], list[str]] | None = None
    tables_fn: Callable[[Records], Sequence[Table]] | None = field(default=None)


# --- bench/run.py: one fresh process per (model, configuration) -----------------------------------


def _graphs(r: dict) -> str:
    g = str(r.get("graphs", ""))
    if r.get("graph_breaks"):
        g += f" ({r['graph_breaks']} breaks)"
    if r.get("recompiles"):
        g += f" (+{r['recompiles']} recompiled)"
    return g


def _first_line(r: dict) -> str:
    return r.get("reason_first_line") or (str(r.get("reason", "")).strip().splitlines() or [""])[0]


def _status(r: dict) -> str:
    s = r.get("status", "")
    return f"infeasible (floor {r['floor_fraction']:.3f})" if s == "infeasible" else s


def _amp(records: Records) -> bool:
    return any(r.get("autocast", "off") != "off" for r in records.values())


RUN_COLUMNS = (
    Column("peak MiB", "peak_bytes", "mib"),
    Column("peak / eager", "peak_vs_eager", ".2f"),
    Column("after fwd MiB", "fwd_live_bytes", "mib"),
    Column("step ms", "step_time_median_s", "ms"),
    Column("time / eager", "time_vs_eager", ".2f"),
    Column("compile s", "compile_s", ".1f"),
    Column("graphs", _graphs),
    Column("loss & grad vs eager", "check", number=False),
)


def run_table(amp: bool, where: Callable[[dict], bool] | None = None, name: str = "main") -> Table:
    keys = [Column("model", "model", number=False)]
    if amp:
        keys.append(Column("autocast", lambda r: r.get("autocast", "off"), number=False))
    keys.append(Column("config", "config", number=False))
    blank = len(RUN_COLUMNS) - 1

    def failed(r: dict) -> list[str] | None:
        if r.get("status", "ok") == "ok":
            return None
        return [c.cell(r) for c in keys] + [_status(r)] + [""] * blank

    return Table(name, (*keys, *RUN_COLUMNS), where=where, replace_row=failed)


def _run_notes(records: Records) -> list[str]:
    out = []
    lowered = [r for r in records.values() if r.get("status") == "ok" and any(k.startswith("lowered.") for k in r)]
    if lowered:
        out += ["Lowered patterns (fxmem rows; the fused loss's reason where it was left alone):", ""]
        for r in lowered:
            where = r["model"] + ("" if r.get("autocast", "off") == "off" else f" {r['autocast']}")
            counts = ", ".join(f"{k[len('lowered.'):]} {v}" for k, v in r.items() if k.startswith("lowered.")) or "none"
            why = r.get("left_alone.fused_linear_cross_entropy")
            out.append(f"- {where} / `{r['config']}`: {counts}" + (f"; fused loss left alone: {why}" if why else ""))
        out.append("")
    failed = [r for r in records.values() if r.get("status", "ok") != "ok"]
    if failed:
        out += ["Not measured (skipped, infeasible or failed; first line of the reason):", ""]
        out += [f"- {r['model']} / {r['config']}: {_status(r)}: {_first_line(r)}" for r in failed]
    return out


RUN = Spec("run", ("model", "config", "autocast"),
           tables_fn=lambda recs: (run_table(_amp(recs)),),
           title=lambda res: f"Benchmark `{res.study}`",
           note="Peak = bytes allocated during forward + backward (gradients included, parameters not); "
                "ratios to `eager` of the same model; step ms the median of the timed steps; compile s the "
                "first step minus the median (bench/README.md).",
           notes=_run_notes)

# --- bench/studies/interleaved.py: step times side by side in one process ---------------------------

INTERLEAVED = Spec("interleaved", ("model", "config"), tables=(Table("main", (
    Column("config", "config", number=False),
    Column("median ms", "median_s", "ms"),
    Column("fastest ms", "min_s", "ms"),
    Column("median / first", "median_ratio", ".3f"),
    Column("fastest / first", "min_ratio", ".3f"),
), replace_row=lambda r: [r["config"], f"left out: {fmt(r['left_out'], 'str')}", "", "", ""]
    if "left_out" in r else None),),
    title=lambda res: f"Interleaved step time: `{res.study}`",
    note="Every configuration compiled in one process and stepped in rotating order, round after round; "
         "ratios to the first configuration.")


def _by(metric: str, how: str, header: str | None = None) -> Column:
    return Column(header or metric, metric, how)


def _check(r: dict) -> str:
    """A clipped sum or gradient against its reference: ok / MISMATCH with the relative error."""
    return "" if "rel_err" not in r else f"{'ok' if r.get('ok') else 'MISMATCH'} ({r['rel_err']:.1e})"


def _mib2(v: float) -> str:
    return f"{v / MIB:.2f}"


def _ms1(v: float) -> str:
    return f"{v * 1e3:.1f}"


def _paired(metric: str) -> Callable[[dict], str]:
    return lambda r: f"{r[metric]:.2f} ({r['paired_' + metric]:.2f})"


def _kernel_targets(r: dict) -> str:
    tgt = {k[len("targets."):]: v for k, v in r.items() if k.startswith("targets.")}
    if not tgt:
        return ""
    good = all(r.get(k) is not None and r[k] <= v for k, v in tgt.items())
    return ", ".join(f"{k} <= {v}" for k, v in tgt.items()) + (" (met)" if good else " (MISSED)")


ZOO = Spec("zoo", ("model",))
SPECS: dict[str, Spec] = {s.name: s for s in (
    RUN, INTERLEAVED, ZOO,
    Spec("budget-bound", ("model",)),
    Spec("budget-floor", ("model",)),
    Spec("budget-compile-time", ("layers", "config"), tables=(Table("main", (
        Column("layers", "layers", "d"), Column("config", "config", number=False),
        _by("seconds", ".1f", "compile s"), _by("ratio", ".2f", "/ level 0"))),)),
    Spec("budget-ilp", ("model", "graph", "fraction")),
    Spec("budget-zoo", ("model",)),
    Spec("dpsgd", ("variant",), title=lambda res: f"DP-SGD benchmark: {res.study}",
         note="Peak = exact peak of one step above what was live before it; time = median of the timed steps, "
              "variants interleaved; clipped sums checked against the hand loop (max relative error per parameter).",
         tables=(Table("main", (
             Column("variant", "variant", number=False), Column("m", "microbatch", "d"),
             Column("clipped sum", _check, number=False), Column("peak MiB", "peak_bytes", "mib"),
             Column("vs opake", "peak_vs_opake", ".3f"), Column("vs hand loop", "peak_vs_hand", ".3f"),
             Column("ms", "time_s", _ms1), Column("vs opake", "time_vs_opake", ".2f"),
             Column("first call s", "first_call_s", ".1f"))),)),
    Spec("dpsgd-e2e", ("variant",), title=lambda res: f"End-to-end private training: {res.study}",
         note="Time = median step (variants interleaved, the same Poisson batches); in brackets the median of the "
              "per-step ratios on the same batch; peak = exact peak of a step above what was live before it.",
         tables=(Table("main", (
             Column("variant", "variant", number=False), Column("ms / step", "time_s", _ms1),
             Column("vs non-private (paired)", _paired("time_vs_nonprivate")),
             Column("vs Opacus ghost (paired)", _paired("time_vs_opacus_ghost")),
             Column("peak MiB", "peak_bytes", "mib"), Column("vs non-private", "peak_vs_nonprivate", ".2f"),
             Column("vs Opacus ghost", "peak_vs_opacus_ghost", ".2f"), Column("compiles", "compiles", "d"),
             Column("epsilon", "epsilon", ".3f"), Column("first step s", "first_step_s", ".1f"))),)),
    Spec("dpsgd-lora", ("variant",), title=lambda res: f"DP-SGD with LoRA: {res.study}",
         tables=(Table("main", (
             Column("variant", "variant", number=False), Column("peak MiB", "peak_bytes", _mib2),
             Column("vs non-private", "peak_vs_nonprivate", ".3f"), Column("error vs loop", "rel_err", ".1e"),
             Column("step s", "step_s", ".3f"), Column("first call s", "first_call_s", ".1f"))),)),
    Spec("ghost", ("variant",), title=lambda res: f"Ghost clipping benchmark: {res.study}",
         note="Peak = exact peak of one step above what was live before it; time = median of the timed steps, "
              "variants interleaved; clipped sums checked against an explicit per-example reference.",
         tables=(Table("main", (
             Column("variant", "variant", number=False), Column("clipped sum", _check, number=False),
             Column("peak MiB", "peak_bytes", "mib"), Column("vs non-private", "peak_vs_nonprivate", ".3f"),
             Column("vs Opacus", "peak_vs_opacus", ".3f"), Column("ms", "time_s", _ms1),
             Column("vs non-private", "time_vs_nonprivate", ".2f"), Column("vs Opacus", "time_vs_opacus", ".2f"),
             Column("first call s", "first_call_s", ".1f"))),)),
    Spec("kernels", ("family", "case", "variant"), title=lambda res: f"Kernel benchmark: {res.study}",
         note="Time = median of the timed steps, variants interleaved; peak = exact peak of one forward + backward "
              "above what was live before it; ratios against the first (unfused) variant of each case.",
         tables=(Table("main", (
             Column("family", "family", number=False), Column("case", "case", number=False),
             Column("variant", "variant", number=False), Column("grads", _check, number=False),
             Column("peak MiB", "peak_bytes", "mib"), Column("peak ratio", "peak_ratio", ".3f"),
             Column("ms", "time_s", _ms1), Column("time ratio", "time_ratio", ".2f"),
             Column("targets", _kernel_targets, number=False))),)),
    Spec("lowering-ce-ratio", ("model", "vocab", "hidden", "tokens"), tables=(Table("main", (
        Column("model", "model", number=False), Column("vocab", "vocab", "d"), Column("hidden", "hidden", "d"),
        Column("tokens", "tokens", "d"), Column("logits / kept grads", "ratio", ".2f"),
        Column("decision", "decision", number=False), Column("level 0 peak ratio", "level0", ".3f"),
        Column("level 1 peak ratio", "level1", ".3f"))),)),
    Spec("lowering-glu", ("model", "pattern", "size")),
    Spec("poisson", ("step",), title=lambda res: f"Poisson-sampled DP-SGD: {res.study}",
         note="Error = max relative error per parameter against an explicit per-example loop; peak = exact peak "
              "of one step above what was live before it.",
         tables=(Table("main", (
             Column("step", "step", "d"), Column("batch", "batch", "d"), Column("error", "rel_err", ".1e"),
             Column("peak MiB", "peak_bytes", _mib2), Column("call s", "call_s", ".2f"))),)),
    Spec("realistic-compile-time", ("config",)),
    Spec("realistic-plan-7b", ("level",), tables=(Table("main", (
        Column("level", "level", "d"), Column("plan s", "seconds", ".1f"), Column("peak GiB", "peak", "gib"),
        Column("resident GiB", "resident", "gib"), Column("resident + Adam GiB", "resident_adam", "gib"),
        Column("max batch", "max_batch", "d"), Column("max batch (Adam)", "max_batch_adam", "d"))),)),
    Spec("report", ("model", "plan")),
    Spec("gpu", ("step", "case")),
)}

# study name -> spec name, first match wins (exact names first)
PATTERNS = (
    ("realistic-compile-time", "realistic-compile-time"),
    ("realistic-plan-7b", "realistic-plan-7b"),
    ("realistic-time-*", "interleaved"),
    ("budget-time-*", "interleaved"),
    ("eager-time-*", "interleaved"),
    ("zoo-*", "zoo"),
    ("realistic-*", "run"),
    ("planner-*", "run"),
    ("lowering", "run"),
    ("defaults-*", "run"),
    ("architecture-*", "run"),
)


def spec_name(study: str) -> str:
    """The spec of a study named ``study`` (its own name when none of ``PATTERNS`` matches)."""
    if study in SPECS:
        return study
    for pattern, name in PATTERNS:
        if fnmatch.fnmatchcase(study, pattern):
            return name
    return study


def spec_for(name: str) -> Spec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"no table spec {name!r} in bench/tables.py; known: {', '.join(sorted(SPECS))}") from None


def tables_of(spec: Spec, records: Records) -> Sequence[Table]:
    return spec.tables_fn(records) if spec.tables_fn else spec.tables


# --- the tables of README.md and docs/benchmarks.md ---------------------------------------------------


def _cell(results: dict[str, Results], study: str, case: str, metric: str, how: str) -> str:
    try:
        value = results[study].records()[case][metric]
    except KeyError:
        raise KeyError(f"doc table: {study}.json has no {metric!r} for case {case!r}") from None
    return fmt(value, how)


def readme_peaks(results: dict[str, Results]) -> list[str]:
    """README: each configuration's peak on GPT-2 and Llama (planner-final)."""
    what = {"eager": "the model as is", "eager+hf_ckpt": "HF gradient checkpointing",
            "mincut_eager": "torch's min-cut partitioner, eager graphs", "inductor": "`torch.compile()`",
            "fxmem-eager": "fxmem level 0, eager graphs", "fxmem-inductor": "fxmem level 0, Inductor",
            "fxmem-eager-level1": "fxmem level 1, eager graphs", "fxmem-inductor-level1": "fxmem level 1, Inductor",
            "inductor+budget0.5": "Inductor, `activation_memory_budget` 0.5",
            "fxmem-inductor+budget0.5": "fxmem, `memory_budget` 0.5, Inductor"}
    out = ["| config | what | GPT-2 peak MiB | / eager | Llama peak MiB | / eager |", "|---|---|---:|---:|---:|---:|"]
    for config, text in what.items():
        cells = [f"`{config}`", text]
        for model in ("hf_gpt2", "hf_llama"):
            case = f"{model}/{config}"
            cells += [_cell(results, "planner-final", case, "peak_bytes", "mib"),
                      _cell(results, "planner-final", case, "peak_vs_eager", ".2f")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def readme_realistic(results: dict[str, Results]) -> list[str]:
    """README: the models at their real size, eager graphs (realistic-<model>)."""
    models = (("GPT-2 small (50257)", "gpt2_small"), ("Llama-family (32000)", "llama_small"),
              ("BERT-base masked LM (30522)", "bert_base"))
    configs = ("eager", "eager+hf_ckpt", "fxmem-eager", "fxmem-eager-level1")
    out = ["| model (vocab) | eager | HF checkpointing | fxmem level 0 | fxmem level 1 |", "|---|---:|---:|---:|---:|"]
    for label, model in models:
        cells = [_cell(results, f"realistic-{model}", f"{model}/{c}", "peak_bytes", "mib") for c in configs]
        out.append("| " + " | ".join([label, *cells]) + " |")
    return out


DOC_TABLES: dict[str, Callable[[dict[str, Results]], list[str]]] = {
    "readme-peaks": readme_peaks,
    "readme-realistic": readme_realistic,
}
