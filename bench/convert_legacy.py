"""One-off: convert every bench/results/*.json of the legacy envelopes to the one format
(``harness``), keeping every number as stored. Run once, then deleted (git keeps it)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import tables  # noqa: E402


def legacy(doc: dict) -> tuple[dict, list[dict]]:
    """(meta, records) of a legacy results document, whichever envelope it has."""
    if "meta" in doc:
        meta = dict(doc["meta"])
    elif "machine" in doc:  # bench/run.py before common.py: {machine, run, results}
        m = doc["machine"]
        meta = {"commit": m.get("git_commit"), "date_utc": m.get("date_utc"),
                "command": doc.get("run", {}).get("command"), "python": m.get("python"), "torch": m.get("torch"),
                "packages": {k: m[k] for k in ("transformers",) if k in m},
                "machine": {k: m.get(k) for k in ("platform", "cpu", "cpu_count", "cpu_affinity",
                                                  "torch_threads", "cuda")},
                "legacy_machine": {k: v for k, v in m.items() if k not in ("date_utc", "python", "torch")}}
    elif "argv" in doc:  # interleaved.py before common.py: {model, rounds, when, argv, rows, left_out}
        meta = {"command": shlex.join(["python", *doc["argv"]]), "date_utc": doc["when"].split(" UTC")[0],
                "when": doc["when"]}
    else:  # {command, results}
        meta = {"command": doc.get("command")}
    run = {k: v for k, v in doc.items() if k not in ("name", "meta", "machine", "results", "rows", "argv", "when")}
    if run:
        meta["run"] = run.get("run", run) if set(run) == {"run"} else run
    results = doc.get("results", doc.get("rows"))
    if isinstance(results, dict):  # realistic-compile-time: {rows, fxmem_stages}
        records = list(results["rows"]) + [{"config": "fxmem_stages", "stages": results["fxmem_stages"]}]
    else:
        records = list(results)
    model = doc.get("model")
    if model is not None:  # interleaved: the model is the run's
        records = [{"model": model, **r} for r in records]
    return meta, records


def convert(path: Path, text: str, base: str) -> harness.Results:
    doc = json.loads(text)
    if set(doc) == {"study", "meta", "rows"}:
        return harness.check(doc, str(path))
    meta, records = legacy(doc)
    study = path.stem
    if not meta.get("date_utc"):  # {command, results}: the date and torch were in the markdown only
        legacy_md = subprocess.run(["git", "show", f"{base}:bench/results/{study}.md"], capture_output=True,
                                   text=True, check=True, cwd=harness.BENCH).stdout
        found = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d) UTC; torch ([^,;]+)", legacy_md, re.M)
        if found:
            meta["date_utc"], meta["torch"] = found.groups()
    meta["spec"] = tables.spec_name(study)
    meta["converted_from"] = "legacy envelope, by bench/convert_legacy.py (numbers as stored)"
    keys = tables.spec_for(meta["spec"]).case
    when = meta.get("commit"), meta.get("date_utc")
    rows = harness.records_to_rows(study, records, keys, *when)
    targets = meta.get("run", {}).pop("targets", None) or meta.pop("targets", [])  # {meta, rows}: in meta
    rows += harness.records_to_rows(study, [{"case": harness.TARGET + t["target"], **t} for t in targets],
                                    ("case",), *when)
    return harness.Results(study, meta, rows)


if __name__ == "__main__":  # python bench/convert_legacy.py [COMMIT]: the legacy files as of COMMIT
    base = sys.argv[1] if len(sys.argv) > 1 else "ea174ec"
    for p in sorted(harness.RESULTS.glob("*.json")):
        legacy_text = subprocess.run(["git", "show", f"{base}:bench/results/{p.name}"], capture_output=True,
                                     text=True, check=True, cwd=harness.BENCH).stdout
        res = convert(p, legacy_text, base)
        harness.save(res, harness.RESULTS)
        print(p.name, len(res.rows))
