"""Table specs: for each kind of study, which fields name a case and how its rows become tables.

A study's results name their spec in ``meta["spec"]`` (``harness.write`` sets it; ``spec_name``
finds it from the study's name otherwise). A spec without tables gets ``default_table``:
every scalar metric a column. ``DOC_TABLES`` are the tables README.md and docs/benchmarks.md
show between ``<!-- bench:NAME -->`` and ``<!-- /bench -->`` (``bench/render.py``); a study's own
table is named ``<study>:<table>`` there.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from results_format import MIB, Results, unit_of

# --- the vocabulary of a spec: a column, a table ------------------------------------------------


def fmt(value: Any, how: str | Callable[[Any], str]) -> str:
    """A cell: ``how`` is a callable, ``mib`` (bytes as MiB, .1f), ``ms`` (seconds as ms, .0f),
    ``gib`` (bytes as GiB, .2f), ``str``, or a format spec (``.2f``, ``.3g``, ``d``)."""
    if value is None or value == "":
        return ""
    if callable(how):
        return how(value)
    if how == "str" or isinstance(value, (str, bool)):
        return str(value).replace("|", "\\|").replace("\n", " ")
    if how == "mib":
        return f"{value / MIB:.1f}"
    if how == "gib":
        return f"{value / 2**30:.2f}"
    if how == "ms":
        return f"{value * 1e3:.0f}"
    return format(value, how)


@dataclass(frozen=True)
class Column:
    """A table column: ``header``, the ``metric`` it shows (or a callable on the case's record),
    how to format it, and whether it is a number (right-aligned)."""

    header: str
    metric: str | Callable[[dict], Any]
    how: str | Callable[[Any], str] = "str"
    number: bool = True

    def cell(self, rec: dict) -> str:
        value = self.metric(rec) if callable(self.metric) else rec.get(self.metric)
        return fmt(value, self.how)


@dataclass(frozen=True)
class Table:
    """A markdown table of a study: ``columns``, the cases it shows (``where`` on the record; all
    by default) in the rows' order, and an optional ``title`` (a ``##`` heading)."""

    name: str
    columns: tuple[Column, ...]
    where: Callable[[dict], bool] | None = None
    title: str = ""
    replace_row: Callable[[dict], list[str] | None] | None = None
    each: str = ""  # a list of a record (``rows``): one table row per item, its fields beside the record's
    sort: Callable[[dict], Any] | None = None  # the rows' order (default: the results')

    def lines(self, records: dict[str, dict]) -> list[str]:
        out = ["| " + " | ".join(c.header for c in self.columns) + " |",
               "|" + "|".join("---:" if c.number else "---" for c in self.columns) + "|"]
        shown = expand(records, self.each) if self.each else list(records.values())
        for rec in sorted(shown, key=self.sort) if self.sort else shown:
            if self.where is not None and not self.where(rec):
                continue
            cells = self.replace_row(rec) if self.replace_row else None
            if cells is None:
                cells = [c.cell(rec) for c in self.columns]
            out.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
        return out


def expand(records: dict[str, dict], field: str) -> list[dict]:
    """Each record's items of the list ``field`` (metrics ``field[i].x``) as ``{**record, x: ...}``."""
    out = []
    for rec in records.values():
        items: dict[int, dict] = {}
        for m, v in rec.items():
            if m.startswith(field + "["):
                i, _, rest = m[len(field) + 1:].partition("]")
                items.setdefault(int(i), {})[rest.lstrip(".")] = v
        out += [{**rec, **items[i]} for i in sorted(items)]
    return out


def default_table(records: dict[str, dict]) -> Table:
    """Every scalar metric of the records a column (list items left out), in first-seen order."""
    metrics: dict[str, None] = {}
    for rec in records.values():
        for m, v in rec.items():
            if "[" not in m and not (isinstance(v, str) and len(v) > 80):
                metrics.setdefault(m, None)
    cols = [Column("case", lambda r: r["__case__"], number=False)]
    cols += [Column(m, m, lambda v, m=m: _auto(m, v), number=True) for m in metrics]
    return Table("all", tuple(cols))


def _auto(metric: str, value: Any) -> str:
    if isinstance(value, (str, bool)):
        return fmt(value, "str")
    unit = unit_of(metric)
    if unit == "bytes":
        return f"{value / MIB:.1f} MiB"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


Records = dict[str, dict]


@dataclass(frozen=True)
class Spec:
    """``case``: the record fields that name a case, in order; ``tables``, or ``tables_fn`` giving
    them from the records; ``note``: a line under the header; ``notes``: lines after the tables."""

    name: str
    case: tuple[str, ...]
    tables: Sequence[Table] = ()
    title: Callable[[Results], str] | None = None
    note: str | Callable[[Results], str] = ""
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

# --- bench/run.py --optimizer: the whole step, the optimizer's included (issue #55 [release]) -----

RELEASE = Spec("release", ("model", "config", "autocast"), tables=(Table("main", (
    Column("model", "model", number=False), Column("autocast", lambda r: r.get("autocast", "off"), number=False),
    Column("config", "config", number=False), Column("peak MiB", "peak_bytes", "mib"),
    Column("peak / HF ckpt", "peak_vs_hf_ckpt", ".3f"), Column("peak / eager", "peak_vs_eager", ".2f"),
    Column("predicted MiB", "predicted_peak_bytes", "mib"),
    Column("predicted / measured", "predicted_vs_measured", ".4f"),
    Column("step ms", "step_time_median_s", "ms"), Column("time / eager", "time_vs_eager", ".2f"),
    Column("graphs", _graphs), Column("first update vs eager", "check", number=False),
), replace_row=lambda r: None if r.get("status", "ok") == "ok" else
        [r["model"], r.get("autocast", "off"), r["config"], _status(r)] + [""] * 8),),
    title=lambda res: f"The whole training step, the optimizer's included: `{res.study}`",
    note="Peak = bytes allocated during forward, backward and the optimizer's step over those alive before "
         "it (parameters and AdamW state not counted; gradients, activations and the step's temporaries "
         "are); `+step_in_backward` runs the step inside the backward (docs/options.md#step_in_backward). "
         "Predicted: fxmem's `predict_peak` at the batch, against the measured peak of what fxmem compiled "
         "(forward and backward; the whole step with `+step_in_backward`). Step ms: median of the timed steps; "
         "they compare only within one invocation of bench/run.py (rows re-measured with `--keep` ran at "
         "another time and load: their time ratios are not measurements side by side).",
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


def _gflop(metric: str) -> Callable[[dict], str]:
    """GFLOP and its share of the step (``step_flops``); "no plan" where none is within the cap."""
    def cell(r: dict) -> str:
        x = r.get(metric)
        if x is None:
            return "-"
        return "no plan" if x in (float("inf"), "inf") else f"{x / 1e9:.3g} ({100 * x / r['step_flops']:.1f}%)"
    return cell


def _ns_ms(metric: str) -> Callable[[dict], str]:
    def cell(r: dict) -> str:
        x = r.get(metric)
        return "-" if x is None else "no plan" if x in (float("inf"), "inf") else f"{x / 1e6:.1f}"
    return cell


def _over_bound(r: dict) -> str:
    fx, b = r.get("fxmem_flops"), r.get("bound_flops")
    return f"{fx / b:.2f}" if fx is not None and b not in (None, 0, float("inf"), "inf") else ""


def _listed(prefix: str) -> list:
    return lambda r: [v for k, v in r.items() if k.startswith(prefix + "[")]


def _heavy(r: dict) -> str:
    return ", ".join(_listed("torch.recomputed_heavy")(r)) or "none"


def _alive(r: dict) -> str:
    names, sizes = [], []
    for k, v in r.items():
        if k.startswith("live[") and k.endswith("[0]"):
            names.append(v)
        elif k.startswith("live[") and k.endswith("[1]"):
            sizes.append(v)
    live = ", ".join(f"{n} {b / MIB:.1f}" for n, b in zip(names, sizes))
    return f"{live}, and {r['live_count'] - len(names)} more"


def _floor_row(r: dict) -> list[str] | None:
    if "error" not in r:
        return None
    why = r["error"].split("infeasible; ")[-1].split(";")[0]
    return [r["model"], r["label"], f"refused: {why}", "", "", "", "", ""]


def _thousands(v: int) -> str:
    return f"{v:,}"


def _kib(v: float) -> str:
    return f"{v / 1024:,.0f}"


def _kib0(v: float) -> str:
    return f"{v / 1024:.0f}"


def _labels(records: Records, prefix: str, suffix: str) -> list[str]:
    """The ``X`` of every metric ``<prefix>X<suffix>`` in the records, in first-seen order."""
    seen: dict[str, None] = {}
    for r in records.values():
        for k in r:
            if k.startswith(prefix) and k.endswith(suffix):
                seen.setdefault(k[len(prefix):len(k) - len(suffix)], None)
    return list(seen)


def _zoo_cell(label: str) -> Callable[[dict], str]:
    def cell(r: dict) -> str:
        c = f"cells.{label}."
        graphs = r.get(c + "graphs", 1)
        return (f"{_kib(r[c + 'peak'])} ({100 * r[c + 'error']:+.1f}%)" + (f" [{graphs}g]" if graphs > 1 else "")
                + ("" if r[c + "ok"] else " !"))
    return cell


def _ratio(key: str) -> Callable[[dict], str]:
    return lambda r: f"{r[key]:.3f}" if r.get(key) is not None else "-"


def _zoo_tables(records: Records) -> tuple[Table, ...]:
    labels = _labels(records, "cells.", ".peak")
    return (Table("main", (
        Column("model", "model", number=False), Column("family", "family", number=False),
        Column("eager", "eager", _kib), Column("min-cut", lambda r: _kib(r["mincut"]) if r.get("mincut") else "-"),
        Column("HF ckpt", lambda r: _kib(r["hf_ckpt"]) if r.get("hf_ckpt") else "-"),
        *[Column(label, _zoo_cell(label)) for label in labels],
        Column("L1 / budget 0.0", _ratio("l1_over_least")), Column("L1 / HF ckpt", _ratio("l1_over_hf")),
        Column("L1 / eager", lambda r: r["cells.L1.peak"] / r["eager"], ".2f"),
        Column("lowered (L1)", lambda r: ", ".join(_listed("cells.L1.lowered")(r)) or "-", number=False),
        Column("s", "seconds", ".0f"))),)


def _zoo_notes(records: Records) -> list[str]:
    rows = list(records.values())
    labels = _labels(records, "cells.", ".peak")
    cells = [(r, f"cells.{lb}.", lb) for r in rows for lb in labels]
    count = lambda key: f"{sum(bool(r.get(key)) for r in rows)} of {sum(key in r for r in rows)}"  # noqa: E731
    hf = [r for r in rows if r.get("l1_over_hf") is not None]
    out = [f"{sum(bool(r[c + 'ok']) for r, c, _ in cells)} of {len(cells)} cells equal eager without a fallback; "
           f"{sum(r[c + 'peak'] > 0 and abs(r[c + 'error']) <= 0.05 for r, c, _ in cells)} of {len(cells)} "
           "predicted within 5% (the whole "
           f"step: every graph of a step that graph breaks split, `[Ng]`); levels 1/2 and the budgets at most "
           f"level 0 on {count('levels_le_l0')} models; level 1 below level 0 wherever `memory_budget=0.0` is, "
           f"and at most 1.02x `memory_budget=0.0`, on {count('l1_le_least')}; level 1 at most HF checkpointing "
           f"on {sum(r['l1_over_hf'] <= 1 for r in hf)} of {len(hf)} (the models that support it)"]
    if any("lowering_no_raise" in r for r in rows):
        off = [r for r in rows if "cells.L0 no lowering.peak" in r]
        within = sum(all(r[k] <= r["cells.L0 no lowering.peak"] for k in r
                         if k.startswith("cells.L") and k.endswith(" no lowering.peak")) for r in off)
        out[0] += (f"; lowering never raised the peak (levels 0, 1, 2) on {count('lowering_no_raise')}, and with "
                   f"lowering off levels 1 and 2 were at most level 0 on {within} of {len(off)}")
    out[0] += "."
    problems = [f"- {r['model']}, {lb}: {'; '.join(_listed(c + 'problems')(r))[:240]}"
                for r, c, lb in cells if _listed(c + "problems")(r)]
    return out + (["", "Problems:", *problems] if problems else [])


def _budget_zoo_tables(records: Records) -> tuple[Table, ...]:
    fractions = ("0.9", "0.7", "0.5", "0.3", "0.1", "0.0")
    n = max((len(_listed("peaks")(r)) for r in records.values()), default=0)
    return (Table("main", (
        Column("model", "model", number=False), Column("family", "family", number=False),
        Column("L0", "level0", _kib0), Column("L1", "level1", _kib0),
        *[Column(fractions[i] if i < len(fractions) else f"peaks[{i}]", f"peaks[{i}]", _kib0) for i in range(n)],
        Column("grads", lambda r: "ok" if r["grads_ok"] else "MISMATCH", number=False),
        Column("monotone", lambda r: "yes" if r["monotone"] else ", ".join(_listed("rises")(r)), number=False),
        Column("0 <= L1", lambda r: "yes" if r["zero_le_level1"] else "NO", number=False),
        Column("warned at", lambda r: ", ".join(map(str, _listed("warned")(r))) or "-", number=False),
        Column("peak cap", "peak_cap", _kib0), Column("peak", "peak_budget", _kib0),
        Column("cap met or warned", lambda r: "met" if r["cap_met"] else "warned" if r["cap_warned"] else "NO",
               number=False),
        Column("s", "seconds", ".0f"))),)


def _ce_notes(records: Records) -> list[str]:
    peaks = {d: [r[f"level{lv}"] for r in records.values() if r["decision"] == d for lv in (0, 1)]
             for d in ("applied", "declined")}
    if not all(peaks.values()):
        return []
    return [f"Applied without comparing: peak ratio {min(peaks['applied']):.3f}-{max(peaks['applied']):.3f} (never "
            f"above 1). Declined without comparing: {min(peaks['declined']):.3f}-{max(peaks['declined']):.3f} "
            "(never below 1)."]


def _ilp_gap(r: dict) -> str:
    return "unmet" if not r["met"] else "-" if r.get("gap") is None else f"{100 * r['gap']:.2f}%"


def _ilp_notes(records: Records) -> list[str]:
    by_model: dict[str, float] = {}
    gaps = [r["gap"] for r in records.values() if r.get("gap") is not None]
    for r in records.values():
        if r.get("gap") is not None:
            by_model[r["model"]] = max(by_model.get(r["model"], 0.0), r["gap"])
    if not gaps:
        return []
    return [f"Largest gap: {100 * max(gaps):.2f}% over {len(gaps)} plans within their cap; per model: "
            + ", ".join(f"{m} {100 * g:.2f}%" for m, g in by_model.items()) + "."]


# --- bench/studies/summarize_planner.py and summarize_lowering.py: comparisons of a run.py study ----


def _pf(ok) -> str:
    return "n/a" if ok is None else ("pass" if ok else "**FAIL**")


def _yes(ok) -> str:
    return "" if ok is None else ("yes" if ok else "**NO**")


def _ratio_text(r: dict) -> str:
    if "time_ratio" not in r:
        return ""
    where = f"; per-round pairs in `{r['timed_in']}`" if r.get("timed_in") else ""
    return f"{r['time_ratio']:.2f} (min {r['time_ratio_min']:.2f}{where})"


def _peak_or_status(peak: str, status: str) -> Callable[[dict], str]:
    return lambda r: fmt(r[peak], "mib") if peak in r else r[status]


def _is(table: str) -> Callable[[dict], bool]:
    return lambda r: r.get("table") == table


def _verdict(r: dict) -> str:
    v = r.get("verdict", "")
    return "**FAIL**" if v == "FAIL" else v


def _pair_columns(fx: str, base: str) -> tuple[Column, ...]:
    return (Column(f"{fx} peak MiB", _peak_or_status("fx_peak_bytes", "fx_status")),
            Column(f"{base} peak MiB", _peak_or_status("base_peak_bytes", "base_status")),
            Column("peak ratio", "peak_ratio", ".3f"), Column("peak", lambda r: _pf(r.get("peak_ok")), number=False),
            Column(f"{fx} ms", "fx_step_s", "ms"), Column(f"{base} ms", "base_step_s", "ms"),
            Column("time ratio (median; min)", _ratio_text), Column("time", lambda r: _pf(r.get("time_ok")),
                                                                     number=False))


def _model(r: dict) -> str:
    return r["model"] if r["model"] in ("hf_gpt2", "hf_llama") else f"{r['model']} (informational)"


def _targets_note(res: Results) -> str:
    run = res.meta.get("run", {})
    tally = res.records().get("tally/target models", {})
    notes = "".join(f"\n\nNote: {n}" for n in run.get("notes", []))
    return (f"Comparisons of `{run.get('source')}` (bench/studies/summarize_planner.py: its docstring states the "
            "targets); time ratios of median step times, \"min\" the ratio of the fastest steps (timing noise); "
            "per-round pairs where an interleaved run timed both side by side. Tally over the target models "
            f"(hf_gpt2, hf_llama): {tally.get('pass')} pass, {tally.get('fail')} fail (infeasible budgets and the 1.0 "
            f"reference rows not counted).{notes}")


PLANNER_TARGETS = Spec(
    "planner-targets", ("table", "model", "inner", "fraction", "torch_config"), note=_targets_note,
    title=lambda res: f"Targets: `{res.meta.get('run', {}).get('source')}`",
    tables=(
        Table("level0", (Column("model", _model, number=False), Column("inner", "inner", number=False),
                         *_pair_columns("fxmem", "min-cut")), where=_is("level0"),
              title="Level 0 vs the min-cut partitioner (peak <= 0.85x, step time <= 1.05x)"),
        Table("level1", (Column("model", _model, number=False), Column("inner", "inner", number=False),
                         *_pair_columns("fxmem L1", "hf_ckpt")), where=_is("level1"),
              title="Level 1 vs eager + HF gradient checkpointing (peak <= 1x, step time <= 1x)"),
        Table("sweep", (Column("model", _model, number=False), Column("inner", "inner", number=False),
                        Column("fraction", "fraction", "g"), Column("baseline", "base", number=False),
                        *_pair_columns("fxmem", "baseline"), Column("monotone", lambda r: _yes(r.get("monotone")),
                                                                    number=False),
                        Column("verdict", _verdict, number=False)), where=_is("sweep"),
              title="Budget sweep vs torch's `activation_memory_budget` at the same fraction (1.0: level 0 vs the "
                    "baseline without a budget, the reference)"),
        Table("pareto", (Column("model", "model", number=False), Column("inner", "inner", number=False),
                         Column("torch config", lambda r: f"`{r['torch_config']}`", number=False),
                         Column("torch peak MiB", "torch_peak_bytes", "mib"),
                         Column("fxmem config", lambda r: f"`{r['fx_config']}`" if "fx_config" in r else
                                "none at this peak", number=False),
                         Column("fxmem peak MiB", "fx_peak_bytes", "mib"),
                         Column("time ratio (median; min)", _ratio_text),
                         Column("dominated", lambda r: "yes" if r["dominated"] else "**no**", number=False)),
              where=_is("pareto"),
              title="Every torch budget point against fxmem's fastest point at no higher peak (informational)"),
    ))


LOWERING_TARGETS = Spec(
    "lowering-targets", ("model", "config"), title=lambda res: f"Targets: `{res.meta.get('run', {}).get('source')}`",
    note=lambda res: ("Each lowered configuration against the same configuration without lowering (same inner "
                      "compiler, same level): peak at most 0.6x, median step time at most 1.1x; loss within 1e-5 and "
                      "gradient norm within 1e-4 of eager (bench/studies/summarize_lowering.py). `+loss_only` "
                      "compiles the model returning only its loss; the last row of each model is the HF model as is."
                      + "".join(f"\n\nNote: {n}" for n in res.meta.get("run", {}).get("notes", []))),
    tables=(Table("main", (
        Column("model", "model", number=False), Column("lowered", lambda r: f"`{r['config']}`", number=False),
        Column("against", lambda r: f"`{r['base']}`", number=False),
        Column("peak ratio", lambda r: f"{r['peak_ratio']:.2f}" if "peak_ratio" in r else "not run"),
        Column("time ratio (median; min)", _ratio_text), Column("loss & grads", "check", number=False),
        Column("target", lambda r: _pf(r.get("ok")) if "ok" in r else "", number=False))),))


# --- bench/gpu.py: per step, its title and its table's columns (header, row key, format) -------------

_R = ".2f"  # a ratio
GPU_COLUMNS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "kernels": ("1. Fused kernels: Triton vs portable vs plain PyTorch (worst |error| / tolerance; <= 1 passes)", [
        ("kernel", "item", ""), ("dtype", "dtype", ""), ("paths", "paths", ""), ("forward", "fwd", ".2g"),
        ("backward", "bwd", ".2g"), ("vmap(grad)", "vmap", ".2g"), ("s", "wall_s", ".1f")]),
    "replay": ("2. Dropout replay: fxmem vs eager, same seed (bit for bit)", [
        ("config", "item", ""), ("loss", "loss_equal", ""), ("grads equal", "grads_equal", ""),
        ("generator after", "rng_equal", ""), ("max |grad diff|", "max_grad_diff", ".3g"),
        ("second step", "second_equal", ""), ("s", "wall_s", ".1f")]),
    "peaks": ("3. Step peaks under bf16 autocast: measured vs fxmem's prediction; step times", [
        ("model", "model", ""), ("config", "item", ""), ("peak MiB", "peak_mib", ".1f"),
        ("predicted MiB", "predicted_mib", ".1f"), ("predicted / measured", "predicted_ratio", ".3f"),
        ("peak / eager", "peak_vs_eager", _R), ("of device", "device_fill", ".0%"), ("step ms", "step_ms", ".1f"),
        ("time / eager", "time_vs_eager", _R), ("compile s", "compile_s", ".1f")]),
    "loss": ("4. Fused linear cross-entropy at a large vocabulary", [
        ("shape", "case", ""), ("variant", "item", ""), ("loss & grads rel err", "rel_err", ".1e"),
        ("peak MiB", "peak_mib", ".1f"), ("peak / unfused", "peak_ratio", ".3f"), ("ms", "ms", ".2f"),
        ("time / unfused", "time_ratio", _R)]),
    "dpsgd": ("5. DP-SGD: clipped per-example gradient sums", [
        ("variant", "item", ""), ("clipped sum rel err", "rel_err", ".1e"), ("peak MiB", "peak_mib", ".1f"),
        ("peak / Opacus", "peak_vs_opacus", _R), ("ms", "ms", ".1f"), ("time / Opacus", "time_vs_opacus", _R)]),
}




def _gpu_cell(how: str) -> str | Callable:
    return lambda v: ("yes" if v else "NO") if isinstance(v, bool) else (format(v, how) if how and not
                                                                          isinstance(v, str) else fmt(v, "str"))


def _gpu_notes(records: Records) -> list[str]:
    notes: dict[str, list[str]] = {}  # reason -> the rows that give it
    for r in records.values():
        if r.get("reason"):
            notes.setdefault(f"{r['step']}: {r['reason']}", []).append(str(r.get("item")))
    return [f"- {', '.join(dict.fromkeys(items))} ({why})" for why, items in notes.items()]


GPU = Spec("gpu", ("step", "model", "case", "item"), notes=_gpu_notes,
           title=lambda res: f"GPU run `{res.study}`",
           note=lambda res: (f"Device `{res.meta.get('run', {}).get('device')}` "
                             f"({res.meta.get('run', {}).get('device_name') or 'no CUDA'}), "
                             + ("dry run (tiny sizes)" if res.meta.get("run", {}).get("dry_run") else "full sizes")
                             + ". See bench/README.md, \"The GPU run\"."),
           tables=tuple(Table(step, (*[Column(h, k, _gpu_cell(f), number=bool(f)) for h, k, f in cols],
                                     Column("status", "status", number=False)),
                              where=lambda r, step=step: r["step"] == step, title=title)
                        for step, (title, cols) in GPU_COLUMNS.items()))


ZOO = Spec("zoo", ("model",), tables_fn=_zoo_tables, notes=_zoo_notes,
           title=lambda res: (f"The zoo, {res.study.removeprefix('zoo-')} profile" if res.study.startswith("zoo-")
                              else f"Families outside the zoo, {res.study.removeprefix('outside-')} profile"),
           note=lambda res: (
               ("Every zoo model (`fxmem.testing.zoo`, dropout as shipped), " if res.study.startswith("zoo-") else
                "Model families that are not in the zoo (built in `bench/studies/outside_zoo.py`, dropout as "
                "their configs ship), measured as the zoo table measures the zoo's, ") +
               f"{res.meta.get('run', {}).get('inner', 'eager')} inner compiler, fxmem's default lowering unless "
               "the column says otherwise. Each fxmem cell: measured peak KiB (the whole step's predict_peak "
               "error; `[Ng]`: N graph runs in a step that graph breaks split); `!` marks a step that is not "
               "eager's (loss or a gradient) or fell back. Peaks measured on the third step. min-cut: torch's "
               "`min_cut_rematerialization_partition` with nop compilers; HF ckpt: the eager step with Hugging "
               "Face's gradient checkpointing (`-`: the model does not support it)."))


def _parity_tolerance(r: dict) -> float:
    """release-parity's bar: 1e-5 in fp32; under autocast 2 x the StepLR(2, 0.5) learning rates' sum."""
    if r["autocast"] == "off":
        return 1e-5
    return 2 * sum(r["lr"] * 0.5 ** (i // 2) for i in range(r["steps"]))


SPECS: dict[str, Spec] = {s.name: s for s in (
    RUN, RELEASE, INTERLEAVED, ZOO, PLANNER_TARGETS, LOWERING_TARGETS, GPU,
    Spec("dpsgd-parity", ("world", "step"), tables=(Table("main", (
        Column("ranks", "world", "d"), Column("step", "step", "d"), Column("batch", "batch", "d"),
        Column("loss", "loss", ".3f"), Column("epsilon", "epsilon", ".3f"), Column("step s", "step_s", ".1f"),
    )),), title=lambda res: "DP-SGD with `make_private` in the plain loop: the 5.3M GPT",
         note="`python -m bench.dpsgd_parity --steps 3 [--world 2]`: Opacus' loop (`loss.backward(); "
              "optimizer.step()`) on fxmem's make_private, Poisson batches of expected size 32 x seq 64, chunks "
              "of 8, noise 1.0, delta 1e-5; batch and loss are rank 0's; random tokens (the loop runs and is "
              "accounted; nothing is learned)."),
    Spec("budget-bound", ("model",), title=lambda res: f"Recompute a budget needs: `{res.study}`",
         note="GFLOP of matmuls and attention that the backward recomputes (cheap ops not counted); % = of one "
              "eager step's FLOPs. *Bound*: the least any plan keeping at most the cap recomputes (min-cut "
              "frontier hull, every forward op recomputable); fxmem: its plan at that `memory_budget`; torch: "
              "Inductor with `activation_memory_budget` at the same fraction. *ms*: the same with each matmul and "
              "attention priced by its own time alone at its shapes.",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("step GFLOP", "step_flops", lambda v: f"{v / 1e9:.1f}"),
             Column("level 0 bytes", "level0_bytes", _thousands), Column("fraction", "fraction", "g"),
             Column("cap bytes", "cap_bytes", _thousands), Column("bound GFLOP (% step)", _gflop("bound_flops")),
             Column("fxmem bytes", lambda r: f"{r['fxmem_bytes']:,}" if "fxmem_bytes" in r else "infeasible"),
             Column("fxmem GFLOP", _gflop("fxmem_flops")), Column("fxmem / bound", _over_bound),
             Column("torch GFLOP", _gflop("torch.recompute_flops")), Column("bound ms", _ns_ms("bound_ns")),
             Column("fxmem ms", _ns_ms("fxmem_ns")), Column("torch ms", _ns_ms("torch.recompute_ns")),
             Column("torch recomputes", _heavy, number=False)), each="rows"),)),
    Spec("budget-floor", ("model",), title=lambda res: f"Below the budget floor: `{res.study}`",
         note="Eager inner compiler (its simulated peak is exact). *Head recomputable*: the plan fxmem would make "
              "if a budget could rerun the vocabulary projection in the backward (it cannot).",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("budget", "label", number=False),
             Column("saved bytes", "saved_bytes", _thousands), Column("measured peak MiB", "measured_peak", "mib"),
             Column("predicted MiB", "predicted_peak", "mib"),
             Column("peak at", lambda r: f"{r['phase']} `{r['at']}`", number=False),
             Column("largest alive (MiB)", _alive, number=False),
             Column("floor bytes", "floor_bytes", _thousands)), each="rows", replace_row=_floor_row),)),
    Spec("dpsgd-first-call", ("inner", "start", "variant"),
         title=lambda res: "DP-SGD's first call against torch.compile's first training step",
         note="The README's DP-SGD block (HF GPT-2 2 x 64, vocab 512, batch 8 x 32, chunks of 4); each run a fresh "
              "process with empty caches, medians of the rounds (`runs`: every round's first call). *cold*: the "
              "process's first compile; *warm*: after one compile of an unrelated function with the plain variant's "
              "backend (Dynamo's and AOTAutograd's imports paid, fxmem's own first use not). "
              "tracing / AOT / Inductor: Dynamo's timers, each summed over its calls (AOT includes the partitioner, "
              "fxmem's planner, and fxmem's one-pass trace of a chunk under the eager inner compiler; nested calls "
              "count twice: with Inductor, fxmem's chunk is compiled inside the outer graph's AOT call, so AOT s can "
              "exceed the first call).",
         tables=(Table("main", (
             Column("inner", "inner", number=False), Column("start", "start", number=False),
             Column("variant", "variant", number=False), _by("first_s", ".2f", "first call s"),
             _by("ratio", ".2f", "/ torch.compile"), _by("tracing_s", ".2f", "tracing s"), _by("aot_s", ".2f", "AOT s"),
             _by("inner_s", ".2f", "Inductor s"), _by("second_s", ".3f", "second call s"),
             Column("runs", "runs", number=False))),)),
    Spec("budget-compile-time", ("layers", "config"), tables=(Table("main", (
        Column("layers", "layers", "d"), Column("config", "config", number=False),
        _by("seconds", ".1f", "compile s"), _by("ratio", ".2f", "/ level 0"))),)),
    Spec("budget-ilp", ("model", "graph", "fraction"), title=lambda res: "The budget's recompute against the exact "
         "optimum", notes=_ilp_notes,
         note="Zoo models (tiny configs, eager inner compiler, lowering off). *cap*: the fraction of level 0's saved "
              "bytes; *fxmem*: the recompute cost (FLOPs, elements for cheap ops) of its plan; *ILP*: the least of "
              "any saved set within the cap (scipy milp over the same network and costs); *gap*: fxmem / ILP - 1 "
              "where fxmem's plan is within the cap. Bar: <= 5%.",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("family", "family", number=False),
             Column("graph", "graph", "d"), Column("fraction", "fraction", "g"), Column("cap bytes", "cap", _thousands),
             Column("fxmem bytes", "fxmem_bytes", _thousands), Column("fxmem cost", "fxmem_cost", ".4g"),
             Column("ILP cost", "ilp_cost", ".4g"), Column("gap", _ilp_gap))),)),
    Spec("budget-zoo", ("model",), tables_fn=_budget_zoo_tables, title=lambda res: "Memory budget on the zoo",
         note="Every zoo model (fxmem.testing.zoo, tiny configs, dropout as shipped), eager inner compiler, lowering "
              "off. Peaks in KiB, measured on the third step. `monotone`: no fraction peaks above the one before; "
              "`0 <= L1`: fraction 0 at most level 1's peak; peak_budget = 0.6x level 0's measured peak: met (+3%) "
              "or warned."),
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
             Column("first call s", "first_call_s", ".1f"))),
             Table("decisions", (
                 Column("variant", "variant", number=False),
                 Column("parameter", lambda r: r.get("param") or f"output {r['output']}", number=False),
                 Column("kind", "kind", number=False),
                 Column("per-example gradient", lambda r: "x".join(map(str, _listed("shape")(r))), number=False),
                 Column("T", "tokens", "d"), Column("2T^2 vs P*Q", "reason", number=False),
                 Column("choice", "choice", number=False)), each="plan.ghost", title="Per-layer decisions"))),
    Spec("kernels", ("family", "case", "variant"), title=lambda res: f"Kernel benchmark: {res.study}",
         note="Time = median of the timed steps, variants interleaved; peak = exact peak of one forward + backward "
              "above what was live before it; ratios against the first (unfused) variant of each case.",
         tables=(Table("main", (
             Column("family", "family", number=False), Column("case", "case", number=False),
             Column("variant", "variant", number=False), Column("grads", _check, number=False),
             Column("peak MiB", "peak_bytes", "mib"), Column("peak ratio", "peak_ratio", ".3f"),
             Column("ms", "time_s", _ms1), Column("time ratio", "time_ratio", ".2f"),
             Column("targets", _kernel_targets, number=False))),)),
    Spec("lowering-ce-ratio", ("model", "vocab", "hidden", "tokens"), notes=_ce_notes,
         title=lambda res: "The fused cross-entropy's planned peak against its logits-to-gradients ratio",
         note="Planned step peak with the fused loss / without it (norms lowered in both; eager inner compiler), zoo "
              "models at batch 2. ratio = tokens x vocab / ((tokens + vocab) x hidden); the backend declines the "
              "fused loss below the lower bound and applies it from the upper one without comparing plans; in "
              "between it compares (fxmem/lowering/patterns.py).",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("vocab", "vocab", "d"), Column("hidden", "hidden", "d"),
             Column("tokens", "tokens", "d"), Column("ratio", "ratio", ".2f"),
             Column("decision", "decision", number=False), Column("level 0", "level0", ".3f"),
             Column("level 1", "level1", ".3f")), sort=lambda r: (r["ratio"], r["model"])),)),
    Spec("release-parity", ("inner", "autocast"), title=lambda res: "The step in the backward against eager "
         "AdamW (issue #55)", note="Llama-family at the bench's `llama_small` size (12 layers, 768 wide, vocab 32000, "
         "batch 2 x 512); AdamW (lr 1e-5) with StepLR(2, 0.5), five steps on fresh batches; eager PyTorch "
         "(`loss.backward(); optimizer.step()`) against fxmem level 1 with `step_in_backward` "
         "(`bench/studies/release_parity.py`). Difference: the largest |parameter difference| after the last "
         "step over the largest |parameter|. Tolerance: 1e-5 in fp32 (the issue's bar); under bf16 autocast 2 x "
         "the learning rates' sum over the steps (fxmem's fused ops round differently from eager's bf16 ops, and "
         "Adam normalises each entry's update: an entry whose near-zero gradient flips sign moves by up to 2 x lr "
         "a step).",
         tables=(Table("main", (
             Column("inner", "inner", number=False), Column("autocast", "autocast", number=False),
             Column("steps", "steps", "d"), Column("max abs diff", "max_abs_diff", ".2e"),
             Column("/ largest", "rel_to_largest", ".2e"),
             Column("tolerance", lambda r: f"{_parity_tolerance(r):.1e}", number=False),
             Column("met", lambda r: "yes" if r["rel_to_largest"] <= _parity_tolerance(r) else "no", number=False),
             Column("gradients left", "grads_left", "d"), Column("fxmem s", "fxmem_s", ".0f"),
             Column("eager s", "eager_s", ".0f"))),)),
    Spec("loss-floor", ("layers", "inner", "dropout"), title=lambda res: "A tied LM's step peak above its "
         "gradients (issue #55)", note="HF GPT2LMHeadModel from GPT2Config (vocab 50257, 768 wide, 12 heads, tied "
         "head), batch 2 x 512, fp32, fxmem level 1 with its default lowering; exact allocator peak of the third "
         "step (`bench/studies/loss_floor.py`). G: every parameter gradient (312.5 MiB at 6 layers); one logits "
         "buffer: 1024 x 50257 x 4 B = 196.3 MiB; target: at most 0.25 of it above G. Phase: where the peak is "
         "(forward: the returned logits and the fused loss's weight gradient; backward: a layer's recompute and "
         "gradients: the MLP's, and the attention's in slices where dropout sends SDPA to its math path on CPU, "
         "fxmem's `attention_dropout` lowering).",
         tables=(Table("main", (
             Column("layers", "layers", "d"), Column("inner", "inner", number=False),
             Column("dropout", "dropout", ".1f"), Column("peak MiB", "peak", "mib"), Column("G MiB", "grads", "mib"),
             Column("above G MiB", "above_grads", "mib"), Column("/ logits", "above_grads_per_logits", ".3f"),
             Column("<= 0.25", lambda r: "yes" if r["met"] else "no", number=False),
             Column("phase", "phase", number=False), Column("fused loss", "fused_loss", number=False))),)),
    Spec("offload", ("model", "inner", "config"), title=lambda res: "Keep, recompute or offload (issue #58)",
         note="Exact allocator peak of the third step; median step time of --rounds more steps per configuration, in "
              "interleaved rounds with the other configurations of the model (`bench/studies/offload.py`), in CPU "
              "seconds of the process on one thread (--clock cpu: other processes' load on the shared machine does "
              "not count). seed: the seed documents' recipe in eager PyTorch (HF gradient checkpointing where the "
              "model supports it, else torch.utils.checkpoint around each block, with save_on_cpu's hooks); "
              "save_on_cpu alone: the hooks without checkpointing (every saved tensor to host). recompute-only: fxmem "
              "memory_budget=0.0 (the least peak recompute alone reaches). offload@0.8: peak_budget = 0.8 x that "
              "measured peak with offload=True; met: measured <= 1.02 x the budget; bitwise: gradients and buffers "
              "equal bit for bit to the same plan with the offloaded values kept on the device (eager: its own row, "
              "same plan, no offload; Inductor: both compiled and run on one thread, since its CPU scatters accumulate "
              "in an order that depends on the threads). offload@seed: peak_budget = 0.95 x the seed's measured peak "
              "with offload=True. Host copies, fxmem's and the seed's, live in numpy buffers outside torch's allocator "
              "(fxmem/host_memory.py), so the peak is the device's; host MiB: fxmem's host bytes.",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("inner", "inner", number=False),
             Column("config", "config", number=False), Column("peak MiB", "peak", "mib"),
             Column("predicted / measured", lambda r: r["predicted"] / r["peak"] if r.get("predicted") else None,
                    ".3f"),
             Column("budget MiB", "budget", "mib"), Column("met", lambda r: None if "met" not in r else
                                                           "yes" if r["met"] else "no", number=False),
             Column("bitwise", lambda r: None if "bitwise" not in r else "yes" if r["bitwise"] else "no",
                    number=False),
             Column("host MiB", "host", "mib"), Column("values offloaded", "offloaded", "d"),
             Column("step s", "step_s", ".2f"), Column("peak / seed", "vs_seed_peak", ".2f"),
             Column("time / seed", "vs_seed_time", ".2f"))),)),
    Spec("lowering-glu", ("model", "pattern", "size"), title=lambda res: "Fused SwiGLU / GeGLU: planned peak with "
         "/ without", note="Planned step peak with the pattern lowered / without it (norms lowered in both; eager "
                           "inner compiler).",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("pattern", "pattern", number=False),
             Column("size", "size", number=False), Column("level 0", "level0", ".3f"),
             Column("level 1", "level1", ".3f"), Column("level 2", "level2", ".3f"))),)),
    Spec("poisson", ("step",), title=lambda res: f"Poisson-sampled DP-SGD: {res.study}",
         note="Error = max relative error per parameter against an explicit per-example loop; peak = exact peak "
              "of one step above what was live before it.",
         tables=(Table("main", (
             Column("step", "step", "d"), Column("batch", "batch", "d"), Column("error", "rel_err", ".1e"),
             Column("peak MiB", "peak_bytes", _mib2), Column("call s", "call_s", ".2f"))),)),
    Spec("realistic-compile-time", ("config",), title=lambda res: "Compile time at 32 layers: fxmem against "
         "aot_eager", note="Llama config, 32 layers, hidden 64, vocab 32000, batch 2 x seq 128; first step (compile "
                           "+ run), median of interleaved fresh compiles.",
         tables=(Table("main", (
             Column("config", "config", number=False), Column("first step s", "seconds", ".1f"),
             Column("/ aot_eager", "ratio", ".2f"),
             Column("every run s", lambda r: ", ".join(f"{t:.1f}" for t in _listed("all")(r)))),
             where=lambda r: r["config"] != "fxmem_stages"),
             Table("stages", (Column("stage", lambda r: f"`{r['[0]']}`", number=False), Column("s", "[1]", ".2f")),
                   where=lambda r: r["config"] == "fxmem_stages", each="stages",
                   title="fxmem's stages in one level-1 compile (cProfile cumulative seconds)"))),
    Spec("realistic-plan-7b", ("level",), tables=(Table("main", (
        Column("level", "level", "d"), Column("plan s", "seconds", ".1f"), Column("peak GiB", "peak", "gib"),
        Column("resident GiB", "resident", "gib"), Column("resident + Adam GiB", "resident_adam", "gib"),
        Column("max batch", "max_batch", "d"), Column("max batch (Adam)", "max_batch_adam", "d"))),)),
    Spec("report", ("model", "plan"), title=lambda res: f"Benchmark `{res.study}`: predicted vs measured step peak",
         note="CPU; fxmem eager inner compiler; one `dynamic=True` compile per row group. Peak = bytes allocated "
              "during forward + backward (gradients included, parameters and inputs not), measured on the second "
              "step at each shape.",
         tables=(Table("main", (
             Column("model", "model", number=False), Column("plan", "plan", number=False),
             Column("batch x seq", lambda r: f"{r['batch']}x{r['seq']}", number=False),
             Column("measured MiB", "measured", _mib2), Column("predicted MiB", "predicted", _mib2),
             Column("error", "error", "+.3%")), each="shapes"),
             Table("caps", (
                 Column("model", "model", number=False), Column("plan", "plan", number=False),
                 Column("cap MiB", "cap_mib", "d"), Column("max_batch", "max_batch", "d"),
                 Column("measured MiB at max_batch", "measured_at_max", "mib"),
                 Column("fits", lambda r: "yes" if r["fits"] else "no", number=False),
                 Column("predicted MiB at max_batch+1", "predicted_next", "mib"),
                 Column("exceeds", lambda r: "yes" if r["next_exceeds"] else "no", number=False)),
                 each="caps", title="max_batch"))),
)}

# study name -> spec name, first match wins (exact names first)
PATTERNS = (
    ("release-parity*", "release-parity"),
    ("release*", "release"),
    ("realistic-compile-time", "realistic-compile-time"),
    ("realistic-plan-7b", "realistic-plan-7b"),
    ("realistic-time-*", "interleaved"),
    ("budget-time-*", "interleaved"),
    ("eager-time-*", "interleaved"),
    ("zoo-*", "zoo"),
    ("outside-*", "zoo"),
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
