"""One-off: convert every bench/results/*.json of the legacy envelopes to the one format
(``harness``), keeping every number as stored. Run once, then deleted (git keeps it)."""

from __future__ import annotations

import json
import shlex
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


def convert(path: Path) -> harness.Results:
    doc = json.loads(path.read_text())
    if set(doc) == {"study", "meta", "rows"}:
        return harness.check(doc, str(path))
    meta, records = legacy(doc)
    study = path.stem
    meta["spec"] = tables.spec_name(study)
    meta["converted_from"] = "legacy envelope, by bench/convert_legacy.py (numbers as stored)"
    keys = tables.spec_for(meta["spec"]).case
    rows = harness.records_to_rows(study, records, keys, meta.get("commit"), meta.get("date_utc"))
    return harness.Results(study, meta, rows)


if __name__ == "__main__":
    for p in sorted(harness.RESULTS.glob("*.json")):
        res = convert(p)
        harness.save(res, harness.RESULTS)
        print(p.name, len(res.rows))
