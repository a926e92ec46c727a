"""Check the recompute planner's targets (issue "[planner]") against a benchmark run.

    python bench/studies/summarize_planner.py                      # bench/results/planner.{json,md}
    python bench/studies/summarize_planner.py --name planner-quick

Reads ``bench/results/<name>.json`` (written by ``bench/run.py``) and appends a "Targets" section
to ``bench/results/<name>.md``, replacing any earlier one (run.py rewrites the table above it,
so rerunning this after run.py is always safe). Prints the section too.

Targets, per target model (hf_gpt2, hf_llama) and inner compiler (eager, Inductor):

- level 0 (``fxmem-<inner>``): peak <= 0.85 x the min-cut partitioner's with the same inner
  compiler (``mincut_eager`` / ``inductor``), median step time <= 1.05 x its;
- level 1 (``fxmem-<inner>-level1``): peak <= ``eager+hf_ckpt``'s, median step time <= its;
- budget sweep (``fxmem-<inner>+budget<f>``, f = fraction of level 0's saved bytes): peak
  non-increasing as f falls (level 0 counts as f = 1.0), and at each f peak <= and median step
  time <= Inductor with ``activation_memory_budget`` = f (``inductor+budget<f>``; f = 1.0 is
  plain ``inductor``). A budget below fxmem's feasible floor is rejected at compile time: shown as
  "infeasible (floor F)", neither pass nor fail, and left out of the monotonicity check.

Times come from the run's own steps, one process per configuration, unless ``--times NAME`` names
an ``interleaved.py`` run that timed both configurations of a comparison side by side: the time
ratio is then the median over its rounds of the two steps' ratio in that round (each round runs
every configuration once, back to back), and the row says so.

Other models in the run (mlp_chain) get the same tables, marked informational, outside the tally.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402

MIB = 2**20
TARGET_MODELS = ("hf_gpt2", "hf_llama")
INNERS = {  # inner compiler -> (label, min-cut baseline of the same inner compiler)
    "eager": ("eager", "mincut_eager"),
    "inductor": ("Inductor", "inductor"),
}
# The budget sweep's baseline per inner compiler: torch's min-cut partitioner with
# ``activation_memory_budget`` = f, run by the same inner compiler (Inductor's own for "inductor";
# nop compilers for "eager"), when the run has it.
LEVEL0_PEAK, LEVEL0_TIME = 0.85, 1.05
FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1)
HEADING = "## Targets"


def _fmt_frac(f: float) -> str:
    return f"{f:g}"


def _pf(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "**FAIL**")


class Results:
    def __init__(self, doc: dict):
        self.by = {(r["model"], r["config"]): r for r in doc["results"]}
        # (model, config) -> (interleaved run, its row): step times taken side by side
        # (an interleaved.py JSON: rows under "results"; before bench/common.py, under "rows")
        self.side = {(run["model"], row["config"]): (run["name"], row)
                     for run in doc.get("interleaved", []) for row in run.get("results", run.get("rows", []))}

    def get(self, model: str, config: str) -> dict | None:
        r = self.by.get((model, config))
        return r if r is not None and r["status"] == "ok" else None

    def pair(self, model: str, x: str, y: str) -> tuple[dict | None, dict | None]:
        """The records of ``x`` and ``y``; when one interleaved run timed both, with its times."""
        a, b = self.get(model, x), self.get(model, y)
        sa, sb = self.side.get((model, x)), self.side.get((model, y))
        if a is None or b is None or not sa or not sb or sa[0] != sb[0]:
            return a, b
        return tuple(dict(r, step_time_median_s=row["median_s"], step_times_s=row["step_times_s"], timed_in=run)
                     for r, (run, row) in ((a, sa), (b, sb)))

    def has(self, model: str, config: str) -> bool:
        return (model, config) in self.by

    def status(self, model: str, config: str) -> str:
        r = self.by.get((model, config))
        if r is None:
            return "not run"
        if r["status"] == "infeasible":
            return f"infeasible (floor {r['floor_fraction']:.3f})"
        return r["status"]


def _mib(r: dict | None) -> str:
    return "" if r is None else f"{r['peak_bytes'] / MIB:.1f}"


def _ms(r: dict | None) -> str:
    return "" if r is None else f"{r['step_time_median_s'] * 1e3:.0f}"


def _time_ratio(a: dict, b: dict) -> tuple[float, str]:
    """Median over median, and (for judging noise) fastest over fastest step."""
    mins = min(a["step_times_s"]) / min(b["step_times_s"])
    if "timed_in" in a:  # paired: the two steps of each round ran side by side
        med = statistics.median(x / y for x, y in zip(a["step_times_s"], b["step_times_s"]))
        return med, f"{med:.2f} (min {mins:.2f}; per-round pairs in `{a['timed_in']}`)"
    med = a["step_time_median_s"] / b["step_time_median_s"]
    return med, f"{med:.2f} (min {mins:.2f})"


def level0(res: Results, models: list[str], tally: dict) -> list[str]:
    out = [f"### Level 0 vs the min-cut partitioner (peak <= {LEVEL0_PEAK}x, step time <= {LEVEL0_TIME}x)", "",
           "| model | inner | fxmem peak MiB | min-cut peak MiB | peak ratio | peak | fxmem ms | min-cut ms | "
           "time ratio (median; min) | time |",
           "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for m in models:
        for inner, (label, base) in INNERS.items():
            name = m if m in TARGET_MODELS else f"{m} (informational)"
            out.append(_pair_row(res, tally, m, f"| {name} | {label} ({base}) ", f"fxmem-{inner}", base,
                                 LEVEL0_PEAK, LEVEL0_TIME))
    return out + [""]


def _pair_row(res: Results, tally: dict, m: str, head: str, cfg: str, base: str, peak_max: float,
              time_max: float) -> str:
    """One scored row: ``cfg`` against ``base`` on peak ratio and median time ratio."""
    a, b = res.pair(m, cfg, base)
    if a is None or b is None:
        _count(tally, m, False, False)
        why = f"{cfg}: {res.status(m, cfg)}; {base}: {res.status(m, base)}"
        return f"{head}| {_mib(a)} | {_mib(b)} | {why} | **FAIL** | | | | **FAIL** |"
    pr = a["peak_bytes"] / b["peak_bytes"]
    tr, trs = _time_ratio(a, b)
    pok, tok = pr <= peak_max, tr <= time_max
    _count(tally, m, pok, tok)
    return f"{head}| {_mib(a)} | {_mib(b)} | {pr:.3f} | {_pf(pok)} | {_ms(a)} | {_ms(b)} | {trs} | {_pf(tok)} |"


def level1(res: Results, models: list[str], tally: dict) -> list[str]:
    out = ["### Level 1 vs eager + HF gradient checkpointing (peak <= 1x, step time <= 1x)", "",
           "| model | inner | fxmem L1 peak MiB | hf_ckpt peak MiB | peak ratio | peak | fxmem L1 ms | hf_ckpt ms | "
           "time ratio (median; min) | time |",
           "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for m in models:
        for inner, (label, _) in INNERS.items():
            cfg = f"fxmem-{inner}-level1"
            a, b = res.get(m, cfg), res.get(m, "eager+hf_ckpt")
            name = m if m in TARGET_MODELS else f"{m} (informational)"
            if b is None and res.status(m, "eager+hf_ckpt") == "skipped":
                out.append(f"| {name} | {label} | {_mib(a) or res.status(m, cfg)} | skipped (no HF checkpointing) | "
                           f"| n/a | {_ms(a)} | | | n/a |")
                continue
            out.append(_pair_row(res, tally, m, f"| {name} | {label} ", cfg, "eager+hf_ckpt", 1.0, 1.0))
    return out + [""]


def sweep(res: Results, models: list[str], tally: dict) -> list[str]:
    out = ["### Budget sweep vs torch's `activation_memory_budget` at the same fraction", "",
           "fxmem: `memory_budget` = fraction of level 0's saved bytes; Inductor: `activation_memory_budget` "
           "(a fraction of its own min-cut plan's). Row 1.0 is level 0 vs the baseline without a budget (the "
           "reference the sweep starts from; its peak/time columns are not targets). \"monotone\": peak <= the "
           "previous feasible row's (higher fraction). \"pass\": monotone, peak <= Inductor's and median time <= "
           "Inductor's. The baseline runs torch's min-cut partitioner with `activation_memory_budget` under the "
           "same inner compiler as fxmem (`mincut_eager+budget<f>` for the eager one; runs without those "
           "configs compare the eager inner compiler against Inductor).", ""]
    for m in models:
        for inner, (label, _) in INNERS.items():
            name = m if m in TARGET_MODELS else f"{m} (informational)"
            base = INNERS[inner][1] if res.has(m, f"{INNERS[inner][1]}+budget0.9") else "inductor"
            out += [f"**{name}, {label} inner** (baseline: `{base}` with `activation_memory_budget`)", "",
                    "| fraction | fxmem peak MiB | baseline peak MiB | peak <= baseline | fxmem ms | baseline ms | "
                    "time ratio (median; min) | time <= baseline | monotone | pass |",
                    "|---:|---:|---:|---|---:|---:|---:|---|---|---|"]
            prev = res.get(m, f"fxmem-{inner}")
            rows = [(1.0, f"fxmem-{inner}", base)] + [
                (f, f"fxmem-{inner}+budget{_fmt_frac(f)}", f"{base}+budget{_fmt_frac(f)}") for f in FRACTIONS]
            mono_all = True
            for f, cfg, icfg in rows:
                a, b = res.pair(m, cfg, icfg)
                ref = f == 1.0
                frac = "1.0 (level 0 / `inductor`)" if ref else _fmt_frac(f)
                fxcell = _mib(a) or res.status(m, cfg)
                icell = _mib(b) or res.status(m, icfg)
                if a is None:
                    infeasible = res.status(m, cfg).startswith("infeasible")
                    verdict = "n/a" if (infeasible or ref) else "**FAIL**"
                    out.append(f"| {frac} | {fxcell} | {icell} | | | {_ms(b)} | | | | {verdict} |")
                    if not (infeasible or ref):
                        _count(tally, m, False)
                    continue
                mono = None
                if not ref:
                    mono = prev is None or a["peak_bytes"] <= prev["peak_bytes"]
                    mono_all &= mono
                    prev = a
                pok = tok = None
                trs = ""
                if b is not None:
                    pok = a["peak_bytes"] <= b["peak_bytes"]
                    tr, trs = _time_ratio(a, b)
                    tok = tr <= 1.0
                if ref:
                    verdict = "reference"
                else:
                    ok = bool(mono) and pok is True and tok is True
                    verdict = _pf(ok)
                    _count(tally, m, ok)
                # the reference row's comparisons are shown as yes/no: they are not targets
                cmp = (lambda ok: "" if ok is None else ("yes" if ok else "no")) if ref else (
                    lambda ok: "" if ok is None else _pf(ok))
                out.append(f"| {frac} | {fxcell} | {icell} | {cmp(pok)} | "
                           f"{_ms(a)} | {_ms(b)} | {trs} | {cmp(tok)} | "
                           f"{'' if mono is None else ('yes' if mono else '**NO**')} | {verdict} |")
            out += ["", f"Monotone (feasible budgets, level 0 first): {'yes' if mono_all else '**NO**'}.", ""]
    return out


def pareto(res: Results, models: list[str]) -> list[str]:
    """Informational: each of torch's points against fxmem's fastest point at no higher peak."""
    out = ["### Every torch budget point against fxmem's fastest point at no higher peak (informational)", "",
           "The fractions mean different things (fxmem's is of its own level 0, already well below torch's "
           "min-cut), so this compares the two memory/time curves directly: for each of torch's "
           "configurations, among fxmem's (level 0, level 1 and every budget, same inner compiler) whose peak "
           "is at most torch's, the one with the lowest time ratio.", "",
           "| model | inner | torch config | torch peak MiB | fxmem config | fxmem peak MiB "
           "| time ratio (median; min) | dominated |", "|---|---|---|---:|---|---:|---:|---|"]
    for m in models:
        for inner, (label, base) in INNERS.items():
            budget_base = base if res.has(m, f"{base}+budget0.9") else "inductor"
            ours = [f"fxmem-{inner}", f"fxmem-{inner}-level1"] + [
                f"fxmem-{inner}+budget{_fmt_frac(f)}" for f in FRACTIONS]
            for theirs in [base] + [f"{budget_base}+budget{_fmt_frac(f)}" for f in FRACTIONS]:
                t = res.get(m, theirs)
                if t is None:
                    continue
                best = None
                for cfg in ours:
                    a, b = res.pair(m, cfg, theirs)
                    if a is not None and a["peak_bytes"] <= t["peak_bytes"]:
                        ratio, text = _time_ratio(a, b)
                        if best is None or ratio < best[0]:
                            best = (ratio, text, cfg, a)
                if best is None:
                    out.append(f"| {m} | {label} | `{theirs}` | {_mib(t)} | none at this peak | | | no |")
                    continue
                ratio, text, cfg, a = best
                out.append(f"| {m} | {label} | `{theirs}` | {_mib(t)} | `{cfg}` | {_mib(a)} | {text} | "
                           f"{'yes' if ratio <= 1.0 else '**no**'} |")
    return out + [""]


def _count(tally: dict, model: str, *oks: bool) -> None:
    if model not in TARGET_MODELS:
        return
    for ok in oks:
        tally["pass" if ok else "fail"] += 1


def targets(doc: dict, notes: list[str] = ()) -> str:
    res = Results(doc)
    models = list(doc["run"]["models"])
    models = [m for m in TARGET_MODELS if m in models] + [m for m in models if m not in TARGET_MODELS]
    tally = {"pass": 0, "fail": 0}
    body = level0(res, models, tally) + level1(res, models, tally) + sweep(res, models, tally) + pareto(res, models)
    head = [HEADING, "",
            "Written by `python bench/studies/summarize_planner.py` from the JSON of this run. Target models: "
            + ", ".join(f"`{m}`" for m in TARGET_MODELS) + "; others are informational and not counted. Time "
            "ratios are of median step times; \"min\" is the ratio of the fastest steps, to judge timing noise "
            "(see `step_times_s` in the JSON). Peaks are exact (CPU profiler), times are not.", "",
            *[f"Note: {n}\n" for n in notes],
            f"Tally over the target models: {tally['pass']} pass, {tally['fail']} fail "
            "(infeasible budgets and the 1.0 reference rows not counted).", ""]
    return "\n".join(head + body)


def main(argv: list[str] | None = None, name: str = "planner", heading: str = HEADING, section=None,
         description: str = __doc__) -> int:
    """Append the section ``section(doc, notes)`` writes to ``<dir>/<name>.md`` (replacing the
    one under ``heading``) and print it; summarize_lowering.py runs this with its own."""
    p = common.parser(description, name=name, quick=False, threads=None, script=sys.argv[0])
    p.add_argument("--dir", dest="out_dir", type=Path, default=argparse.SUPPRESS,
                   help="the same as --out-dir: where <name>.json and .md are (default bench/results)")
    p.add_argument("--note", action="append", default=[],
                   help="a line to print under the heading (e.g. how the run was invoked); repeatable")
    p.add_argument("--times", action="append", default=[], metavar="NAME",
                   help="an interleaved.py run (<dir>/NAME.json): a comparison whose two configurations it "
                        "timed side by side uses its step times; repeatable")
    a = common.parse(p, argv)
    d = Path(a.out_dir)
    doc = json.loads((d / f"{a.name}.json").read_text())
    doc["interleaved"] = [dict(json.loads((d / f"{t}.json").read_text()), name=t) for t in a.times]
    md_path = d / f"{a.name}.md"
    md = md_path.read_text()
    cut = md.find("\n" + heading + "\n")
    if cut >= 0:
        md = md[:cut + 1]
    text = (section or targets)(doc, a.note)
    md_path.write_text(md.rstrip("\n") + "\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
