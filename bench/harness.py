"""The bench harness: the one writer of results and their markdown renderer.

``write`` turns a program's records into the long rows of ``bench/results_format.py`` (the one results
format) under the study's table spec and saves ``bench/results/<study>.json``; the markdown next
to it (``<study>.md``) is generated from the rows by ``render`` with the study's table spec
(``bench/tables.py``); ``bench/render.py`` regenerates every one of them and the marked tables in
README.md and docs/benchmarks.md, and ``--check`` fails when one differs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import tables
from results_format import MIB, RESULTS, Results, check, records_to_rows


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
    meta = {**meta, "spec": spec or tables.spec_name(study)} | ({"run": run} if run is not None else {})
    keys = tables.spec_for(meta["spec"]).case
    when = meta.get("commit"), meta.get("date_utc")
    rows = records_to_rows(study, records, keys, *when)
    rows += records_to_rows(study, [{"case": TARGET + t["target"], **t} for t in targets], ("case",), *when)
    return save(Results(study, meta, rows), out_dir)


# --- the renderer -------------------------------------------------------------------------------


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
    spec = tables.spec_for(results.meta.get("spec") or tables.spec_name(results.study))
    records = {c: {"__case__": c, **rec} for c, rec in results.records().items() if not c.startswith(TARGET)}
    targets = [rec for c, rec in results.records().items() if c.startswith(TARGET)]
    out = [f"# {spec.title(results) if spec.title else results.study}", "", md_header(results.meta).rstrip("\n"), ""]
    note = spec.note(results) if callable(spec.note) else spec.note
    if note:
        out += [note, ""]
    for t in tables.tables_of(spec, records) or (tables.default_table(records),):
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
