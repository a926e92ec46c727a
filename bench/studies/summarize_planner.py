"""Check the recompute planner's targets (issue "[planner]") against a benchmark run.

    python bench/studies/summarize_planner.py                      # bench/results/planner.{json,md}
    python bench/studies/summarize_planner.py --name planner-quick

Reads ``bench/results/<name>.json`` (written by ``bench/run.py``) and writes the comparisons, one
record per table row, to ``bench/results/<name>-targets.{json,md}`` through ``harness.write``
(table spec ``planner-targets``). Prints the markdown too.

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
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402
import results_format  # noqa: E402

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


def _fmt_frac(f: float) -> str:
    return f"{f:g}"


def _pf(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "FAIL")


class Results:
    """A run.py study's records by (model, config), and the interleaved runs' step times."""

    def __init__(self, records: list[dict], interleaved: dict[str, list[dict]]):
        self.by = {(r["model"], r["config"]): r for r in records}
        # (model, config) -> (interleaved run, its record): step times taken side by side
        self.side = {(row["model"], row["config"]): (run, row) for run, rows in interleaved.items() for row in rows
                     if "median_s" in row}

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


def load(results_dir: Path, name: str, times: list[str]) -> tuple[Results, dict]:
    """The run ``name`` and the interleaved runs ``times`` of ``results_dir`` (the one format)."""
    run = results_format.read(results_dir / f"{name}.json")
    inter = {t: [results_format.unflatten(r) for r in results_format.read(results_dir / f"{t}.json").records().values()]
             for t in times}
    return Results([results_format.unflatten(r) for r in run.records().values()], inter), run.meta.get("run", {})


def _time_ratio(a: dict, b: dict) -> dict:
    """Median over median (per-round pairs when one interleaved run timed both), and fastest over
    fastest step (to judge noise)."""
    out = {"time_ratio_min": min(a["step_times_s"]) / min(b["step_times_s"])}
    if "timed_in" in a:  # paired: the two steps of each round ran side by side
        out.update(time_ratio=statistics.median(x / y for x, y in zip(a["step_times_s"], b["step_times_s"])),
                   timed_in=a["timed_in"])
    else:
        out["time_ratio"] = a["step_time_median_s"] / b["step_time_median_s"]
    return out


def _pair(res: Results, m: str, cfg: str, base: str) -> dict:
    """``cfg`` against ``base``: both peaks and step times, their ratios (empty ratios where one is missing)."""
    a, b = res.pair(m, cfg, base)
    rec = {"config": cfg, "base": base, "fx_status": res.status(m, cfg), "base_status": res.status(m, base)}
    if a is not None:
        rec.update(fx_peak_bytes=a["peak_bytes"], fx_step_s=a["step_time_median_s"])
    if b is not None:
        rec.update(base_peak_bytes=b["peak_bytes"], base_step_s=b["step_time_median_s"])
    if a is not None and b is not None:
        rec.update(peak_ratio=a["peak_bytes"] / b["peak_bytes"], **_time_ratio(a, b))
    return rec


def _scored(res: Results, tally: dict, m: str, table: str, inner: str, cfg: str, base: str, peak_max: float,
            time_max: float) -> dict:
    rec = {"table": table, "model": m, "inner": inner, **_pair(res, m, cfg, base)}
    if "peak_ratio" not in rec:
        _count(tally, m, False, False)
        rec.update(peak_ok=False, time_ok=False)
        return rec
    rec.update(peak_ok=rec["peak_ratio"] <= peak_max, time_ok=rec["time_ratio"] <= time_max)
    _count(tally, m, rec["peak_ok"], rec["time_ok"])
    return rec


def level0(res: Results, models: list[str], tally: dict) -> list[dict]:
    return [_scored(res, tally, m, "level0", f"{label} ({base})", f"fxmem-{inner}", base, LEVEL0_PEAK, LEVEL0_TIME)
            for m in models for inner, (label, base) in INNERS.items()]


def level1(res: Results, models: list[str], tally: dict) -> list[dict]:
    out = []
    for m in models:
        for inner, (label, _) in INNERS.items():
            cfg = f"fxmem-{inner}-level1"
            if res.get(m, "eager+hf_ckpt") is None and res.status(m, "eager+hf_ckpt") == "skipped":
                out.append({"table": "level1", "model": m, "inner": label, **_pair(res, m, cfg, "eager+hf_ckpt")})
                continue
            out.append(_scored(res, tally, m, "level1", label, cfg, "eager+hf_ckpt", 1.0, 1.0))
    return out


def sweep(res: Results, models: list[str], tally: dict) -> list[dict]:
    out = []
    for m in models:
        for inner, (label, _) in INNERS.items():
            base = INNERS[inner][1] if res.has(m, f"{INNERS[inner][1]}+budget0.9") else "inductor"
            prev = res.get(m, f"fxmem-{inner}")
            rows = [(1.0, f"fxmem-{inner}", base)] + [
                (f, f"fxmem-{inner}+budget{_fmt_frac(f)}", f"{base}+budget{_fmt_frac(f)}") for f in FRACTIONS]
            for f, cfg, icfg in rows:
                ref = f == 1.0
                rec = {"table": "sweep", "model": m, "inner": label, "fraction": f, **_pair(res, m, cfg, icfg)}
                out.append(rec)
                a = res.get(m, cfg)
                if a is None:
                    infeasible = rec["fx_status"].startswith("infeasible")
                    rec["verdict"] = "n/a" if (infeasible or ref) else "FAIL"
                    if not (infeasible or ref):
                        _count(tally, m, False)
                    continue
                if not ref:
                    rec["monotone"] = prev is None or a["peak_bytes"] <= prev["peak_bytes"]
                    prev = a
                if "base_peak_bytes" in rec:
                    rec.update(peak_ok=rec["fx_peak_bytes"] <= rec["base_peak_bytes"], time_ok=rec["time_ratio"] <= 1.0)
                if ref:
                    rec["verdict"] = "reference"
                else:
                    ok = bool(rec["monotone"]) and rec.get("peak_ok") is True and rec.get("time_ok") is True
                    rec["verdict"] = _pf(ok)
                    _count(tally, m, ok)
    return out


def pareto(res: Results, models: list[str]) -> list[dict]:
    """Informational: each of torch's points against fxmem's fastest point at no higher peak."""
    out = []
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
                        ratio = _time_ratio(a, b)
                        if best is None or ratio["time_ratio"] < best[0]["time_ratio"]:
                            best = (ratio, cfg, a)
                rec = {"table": "pareto", "model": m, "inner": label, "torch_config": theirs,
                       "torch_peak_bytes": t["peak_bytes"]}
                if best is not None:
                    ratio, cfg, a = best
                    rec.update(fx_config=cfg, fx_peak_bytes=a["peak_bytes"], **ratio,
                               dominated=ratio["time_ratio"] <= 1.0)
                else:
                    rec["dominated"] = False
                out.append(rec)
    return out


def _count(tally: dict, model: str, *oks: bool) -> None:
    if model not in TARGET_MODELS:
        return
    for ok in oks:
        tally["pass" if ok else "fail"] += 1


def targets(res: Results, run: dict) -> list[dict]:
    """Every comparison as a record (``table``: level0, level1, sweep, pareto; then the tally)."""
    models = list(run.get("models") or sorted({m for m, _ in res.by}))
    models = [m for m in TARGET_MODELS if m in models] + [m for m in models if m not in TARGET_MODELS]
    tally = {"pass": 0, "fail": 0}
    rows = level0(res, models, tally) + level1(res, models, tally) + sweep(res, models, tally) + pareto(res, models)
    return rows + [{"table": "tally", "model": "target models", **tally}]


def main(argv: list[str] | None = None, name: str = "planner", suffix: str = "-targets", spec: str = "planner-targets",
         records=None, description: str = __doc__) -> int:
    """Write ``records(results, run)`` (default ``targets``) for ``<dir>/<name>.json`` to
    ``<dir>/<name><suffix>.{json,md}``; summarize_lowering.py runs this with its own."""
    p = common.parser(description, name=name, quick=False, threads=None, script=sys.argv[0])
    p.add_argument("--dir", dest="out_dir", type=Path, default=argparse.SUPPRESS,
                   help="the same as --out-dir: where <name>.json is and the targets go (default bench/results)")
    p.add_argument("--note", action="append", default=[],
                   help="a line to show under the heading (e.g. how the run was invoked); repeatable")
    p.add_argument("--times", action="append", default=[], metavar="NAME",
                   help="an interleaved.py run (<dir>/NAME.json): a comparison whose two configurations it "
                        "timed side by side uses its step times; repeatable")
    a = common.parse(p, argv)
    d = Path(a.out_dir)
    res, run = load(d, a.name, a.times)
    _, mp = harness.write(a.name + suffix, (records or targets)(res, run), d, meta=common.metadata(a.command),
                          spec=spec, run={"source": a.name, "times": a.times, "notes": a.note})
    print(mp.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
