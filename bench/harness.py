"""The bench harness: what a measurement is, the one results format, its writer, reader and renderer.

Every bench program and study writes ``bench/results/<study>.json`` through ``write`` here::

    {"study": "<study>", "meta": {commit, date_utc, command, machine, torch, packages, ...},
     "rows": [{"study", "case", "metric", "unit", "value", "commit", "time"}, ...]}

Long rows: one number (or string or bool) per row. ``case`` names what was measured
("hf_gpt2/fxmem-eager", "gpt2_small/level1/b8xs256"), ``metric`` the quantity ("peak_bytes",
"step_time_median_s"), ``unit`` its unit ("bytes", "s", "x" for ratios, "" otherwise). A program
that builds one dict per case (a *record*: ``{"model": .., "config": .., "peak_bytes": ..}``)
hands the records to ``write``; ``records_to_rows`` flattens them by the study's case keys
(``bench/tables.py``), nested dicts and lists included (``frontier[2].bytes``), so no number is
dropped and a reader gets the record back with ``pivot``.

The markdown next to the JSON (``<study>.md``) is generated from the rows by ``render`` with the
study's table spec (``bench/tables.py``); ``bench/render.py`` regenerates every one of them and the
marked tables in README.md and docs/benchmarks.md, and ``--check`` fails when one differs.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
ROW_KEYS = ("study", "case", "metric", "unit", "value", "commit", "time")
MIB = 2**20


@dataclass(frozen=True)
class Case:
    """What one measurement is of: a model under a configuration at a shape, in a study. Programs
    that build rows one at a time name them with it (``Measurement(Case(...).name, ...)``); those
    that build one dict per case name it by their spec's case keys (``case_name``)."""

    model: str
    config: str = ""
    shape: str = ""
    study: str = ""

    @property
    def name(self) -> str:
        """The ``case`` of its rows: the non-empty parts of model/config/shape joined by "/"."""
        return "/".join(p for p in (self.model, self.config, self.shape) if p)


@dataclass(frozen=True)
class Measurement:
    """One number (or string or bool) measured for a case: one row of the results."""

    case: str
    metric: str
    value: Any
    unit: str = ""

    def row(self, study: str, commit: str | None, time: str | None) -> dict:
        return {"study": study, "case": self.case, "metric": self.metric, "unit": self.unit,
                "value": self.value, "commit": commit, "time": time}


def unit_of(metric: str) -> str:
    """The unit a metric's name implies: ``*bytes*`` bytes, ``*_s`` / ``seconds`` s, ratios x."""
    last = metric.rsplit(".", 1)[-1].split("[", 1)[0]
    if "bytes" in last or last in ("peak", "resident", "resident_adam", "cap", "peak_cap", "peak_budget"):
        return "bytes"
    if last.endswith("_s") or last in ("seconds", "times", "all"):
        return "s"
    if "_vs_" in last or "ratio" in last or last.startswith("vs_"):
        return "x"
    return ""


def _scalars(value: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    """(metric, value) for every scalar inside ``value``: dict keys joined by ".", list items as [i]."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _scalars(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _scalars(v, f"{prefix}[{i}]")
    elif value is not None:
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        yield prefix, value


def case_name(record: dict, keys: Sequence[str]) -> str:
    """The case of a record: its ``keys``' values joined by "/" (a missing key is left out)."""
    parts = [str(record[k]) for k in keys if record.get(k) not in (None, "")]
    if not parts:
        raise ValueError(f"record has none of the case keys {list(keys)}: {sorted(record)}")
    return "/".join(parts)


def records_to_rows(study: str, records: Sequence[dict], keys: Sequence[str], commit: str | None,
                    time: str | None) -> list[dict]:
    """Long rows from ``records`` (one dict per case): every scalar of each record, its case from
    ``keys``. Two records with the same case are an error (their rows could not be told apart)."""
    rows, seen = [], set()
    for rec in records:
        case = case_name(rec, keys)
        if case in seen:
            raise ValueError(f"study {study!r}: two records have the case {case!r} (case keys {list(keys)})")
        seen.add(case)
        rows += [Measurement(case, m, v, unit_of(m)).row(study, commit, time) for m, v in _scalars(rec, "")]
    return rows


def pivot(rows: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """``{case: {metric: value}}`` in the rows' order: the records back (nested keys flattened)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        out.setdefault(r["case"], {})[r["metric"]] = r["value"]
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    """A record of ``pivot`` back as nested dicts and lists (``a.b`` and ``a[0]`` in its metric names)."""
    out: dict = {}
    for key, value in flat.items():
        tokens = re.findall(r"\[(\d+)\]|([^.\[\]]+)", key)
        node: Any = out
        for i, (index, name) in enumerate(tokens):
            last = i == len(tokens) - 1
            step: Any = int(index) if index else name
            if isinstance(step, int):
                node.extend([None] * (step + 1 - len(node)))
            nxt_is_index = not last and bool(tokens[i + 1][0])
            if last:
                node[step] = value
            else:
                if (node[step] if isinstance(step, int) else node.get(step)) is None:
                    node[step] = [] if nxt_is_index else {}
                node = node[step]
    return out


# --- the results file ---------------------------------------------------------------------------


@dataclass
class Results:
    """One study's results: ``meta`` (the run's record) and its long rows."""

    study: str
    meta: dict
    rows: list[dict]

    def to_json(self) -> str:
        return json.dumps({"study": self.study, "meta": self.meta, "rows": self.rows}, indent=1, default=str) + "\n"

    def records(self) -> dict[str, dict[str, Any]]:
        return pivot(self.rows)


def check(doc: Any, where: str = "results") -> Results:
    """``doc`` as ``Results``, or ValueError naming what is wrong with it."""
    if not isinstance(doc, dict) or set(doc) != {"study", "meta", "rows"}:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{where}: expected an object with keys study, meta, rows; got {got}")
    if not isinstance(doc["rows"], list) or not isinstance(doc["meta"], dict):
        raise ValueError(f"{where}: 'rows' must be a list and 'meta' an object")
    for i, r in enumerate(doc["rows"]):
        if not isinstance(r, dict) or tuple(r) != ROW_KEYS:
            raise ValueError(f"{where}: row {i} must have the keys {', '.join(ROW_KEYS)} in that order; got {r!r}")
        if r["study"] != doc["study"]:
            raise ValueError(f"{where}: row {i} is of study {r['study']!r}, the file's is {doc['study']!r}")
        if isinstance(r["value"], (dict, list)) or r["value"] is None:
            raise ValueError(f"{where}: row {i} ({r['case']} {r['metric']}): value must be a number, string or bool")
    return Results(doc["study"], doc["meta"], doc["rows"])


def read(path: str | os.PathLike) -> Results:
    """Read and check ``<study>.json``."""
    path = Path(path)
    return check(json.loads(path.read_text()), str(path))


def read_all(results_dir: str | os.PathLike = RESULTS) -> dict[str, Results]:
    """Every ``*.json`` of ``results_dir`` by study name."""
    return {p.stem: read(p) for p in sorted(Path(results_dir).glob("*.json"))}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(results: Results, out_dir: str | os.PathLike = RESULTS) -> tuple[Path, Path]:
    """Write ``<out_dir>/<study>.json`` and the markdown generated from it (atomically, so a
    program may rewrite both after every measurement); return their paths."""
    check(json.loads(results.to_json()), results.study)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / f"{results.study}.json", out / f"{results.study}.md"
    _write(jp, results.to_json())
    _write(mp, render(results))
    return jp, mp


TARGET = "target/"  # the case prefix of a program's targets: {target, value, limit, met}


def write(study: str, records: Sequence[dict], out_dir: str | os.PathLike = RESULTS, *, meta: dict,
          run: dict | None = None, spec: str | None = None, targets: Sequence[dict] = ()) -> tuple[Path, Path]:
    """The one writer: ``records`` (one dict per case) as long rows of ``study`` with ``meta`` (from
    ``common.metadata``; ``run``, the program's settings, goes into ``meta["run"]``), then the
    markdown. ``spec``: the table spec's name when it is not ``study``'s (``tables.spec_for``).
    ``targets``: ``{target, value, limit, met}`` dicts, rows of the cases ``target/<target>``,
    rendered as a "Targets" table."""
    import tables

    meta = {**meta, "spec": spec or tables.spec_name(study)} | ({"run": run} if run is not None else {})
    keys = tables.spec_for(meta["spec"]).case
    when = meta.get("commit"), meta.get("date_utc")
    rows = records_to_rows(study, records, keys, *when)
    rows += records_to_rows(study, [{"case": TARGET + t["target"], **t} for t in targets], ("case",), *when)
    return save(Results(study, meta, rows), out_dir)


# --- the renderer -------------------------------------------------------------------------------


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


def md_header(meta: dict) -> str:
    """The command, and where and when it ran (what ``meta`` records of it): the lines under a
    results file's title."""
    m = meta.get("machine") or {}
    commit = meta.get("commit")
    where = []
    if meta.get("date_utc"):
        where.append(f"{meta['date_utc']} UTC")
    if commit:
        dirty = commit.endswith("-dirty")
        where.append(f"commit `{commit.removesuffix('-dirty')[:10]}`" + (" (uncommitted changes)" if dirty else ""))
    if meta.get("fxmem_source") not in (None, "fxmem"):
        where.append(f"fxmem from `{meta['fxmem_source']}`")
    pk = meta.get("packages") or {}
    soft = [f"torch {meta['torch']}"] if meta.get("torch") else []
    soft += [f"{k} {pk[k]}" for k in ("transformers", "opacus", "opake") if k in pk]
    soft += [f"Python {meta['python']}"] if meta.get("python") else []
    if soft:
        where.append(", ".join(soft))
    if m.get("cpu") or m.get("cpu_count"):
        cpus = f"{m.get('cpu') or 'unknown CPU'}, {m.get('cpu_count')} CPUs"
        if m.get("cpu_affinity") and m.get("cpu_affinity") != m.get("cpu_count"):
            cpus += f" ({m['cpu_affinity']} usable)"
        where.append(cpus + (f", {m['cuda']}" if m.get("cuda") else ""))
    return f"`{meta.get('command')}`\n\n" + ("; ".join(where) + ".\n" if where else "")


def _target(t: dict, key: str) -> str:
    """A target's value (3 significant digits) or limit (as given); a byte cap in MiB."""
    v = t.get(key)
    if v is None:
        return "-"
    if "cap" in t["target"] and abs(v) >= 2**10:
        return f"{v / MIB:.2f} MiB"
    return f"{v:.3g}" if key == "value" else f"{v:g}"


def render(results: Results) -> str:
    """``<study>.md``: the title, ``md_header``, the spec's note, its tables (``default_table``
    without one), the targets (cases ``target/...``) and the spec's notes."""
    import tables

    spec = tables.spec_for(results.meta.get("spec") or tables.spec_name(results.study))
    records = {c: {"__case__": c, **rec} for c, rec in results.records().items() if not c.startswith(TARGET)}
    targets = [rec for c, rec in results.records().items() if c.startswith(TARGET)]
    out = [f"# {spec.title(results) if spec.title else results.study}", "", md_header(results.meta).rstrip("\n"), ""]
    note = spec.note(results) if callable(spec.note) else spec.note
    if note:
        out += [note, ""]
    for t in tables.tables_of(spec, records) or (default_table(records),):
        if t.title:
            out += [f"## {t.title}", ""]
        out += t.lines(records) + [""]
    if targets:
        out += ["## Targets", "", "| target | value | limit | |", "|---|---:|---:|---|"]
        out += [f"| {t['target']} | {_target(t, 'value')} | {_target(t, 'limit')} | {'met' if t['met'] else 'MISSED'} |"
                for t in targets] + [""]
    if spec.notes is not None:
        notes = spec.notes(records)
        if notes:
            out += notes + [""]
    return "\n".join(out).rstrip("\n") + "\n"
