"""The bench's one results format: what a measurement is, its long rows, and their reader.

Every bench program and study writes ``bench/results/<study>.json`` (through ``harness.write``)::

    {"study": "<study>", "meta": {commit, date_utc, command, machine, torch, packages, ...},
     "rows": [{"study", "case", "metric", "unit", "value", "commit", "time"}, ...]}

Long rows: one number (or string or bool) per row. ``case`` names what was measured
("hf_gpt2/fxmem-eager", "gpt2_small/level1/b8xs256"), ``metric`` the quantity ("peak_bytes",
"step_time_median_s"), ``unit`` its unit ("bytes", "s", "x" for ratios, "" otherwise). A program
that builds one dict per case (a *record*: ``{"model": .., "config": .., "peak_bytes": ..}``)
hands the records to ``harness.write``; ``records_to_rows`` flattens them by the study's case keys
(``bench/tables.py``), nested dicts and lists included (``frontier[2].bytes``), so no number is
dropped and a reader gets the record back with ``pivot``.

This module is the bottom of bench/: the table specs (``tables.py``) name its ``Results`` and the
writer and renderer (``harness.py``) build on both, so nothing here imports a bench sibling.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

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
