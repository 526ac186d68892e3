"""Merge zoo sweeps run in parts (device calls, a local Keras run) into docs/results/zoo/zoo.json and docs/zoo.md.

    python bench/ci/zoo_merge.py PART.json [PART.json ...] --json docs/results/zoo/zoo.json --markdown docs/zoo.md

A part may be an earlier merge (docs/results/zoo/zoo.json itself): its parts and rows are kept, later parts replace the
rows they ran (a ``--checks openvino`` part replaces only its checks: zoo.merge_row). Each part keeps its own machine, command, jobs/threads and wall time under ``runs``; rows a part did not run (deadline)
are taken from a later part that did; the summary (pass rates, failures by cause) is computed over the merged rows by
bench/ci/zoo.py's own ``summarize``, and the table by its ``markdown``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    rows, runs = {}, []
    for p in a.parts:
        doc = json.loads(p.read_text())
        real = [zoo.upgrade_row(r) for r in doc["rows"] if not r.get("not_run")]
        if doc.get("runs"):  # an earlier merge: keep its parts as they were, each row with the part it came from
            runs.extend(doc["runs"])
            for r in real:
                rows[r["model"]] = zoo.merge_row(rows.get(r["model"]), r)
            continue
        runs.append({"file": p.name, "machine": doc.get("machine"), "command": doc.get("command"), "jobs": doc.get("jobs", 1),
                     "threads": doc.get("threads"), "sweep_wall_s": doc.get("sweep_wall_s"), "models": len(real)})
        for r in real:
            r["run"] = p.name
            rows[r["model"]] = zoo.merge_row(rows.get(r["model"]), r)
    order = {e.label: i for i, e in enumerate(zoo.registry())}
    all_rows = sorted(rows.values(), key=lambda r: order.get(r["model"], 1 << 30))
    by_source: dict[str, float] = {}
    for r in all_rows:
        by_source[r["source"]] = round(by_source.get(r["source"], 0) + r.get("wall_s", 0), 1)
    doc = {"schema": "qdeploy.zoo/1", "command": "python bench/ci/zoo_merge.py " + " ".join(sys.argv[1:]),
           "commands": [r["command"] for r in runs], "runs": runs,
           "machine": "; ".join(sorted({r["machine"] for r in runs if r["machine"]})), "threads": runs[0]["threads"],
           "jobs": max(r["jobs"] or 1 for r in runs), "sweep_wall_s": round(sum(r["sweep_wall_s"] or 0 for r in runs), 1),
           "started": min(json.loads(p.read_text()).get("started", "") for p in a.parts),
           "elapsed_s": round(sum(r.get("wall_s", 0) for r in all_rows), 1), "elapsed_s_by_source": by_source,
           "baseline": None, "note": a.note, "checks": zoo.CHECKS, "summary": zoo.summarize(all_rows), "rows": all_rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if a.markdown:
        a.markdown.write_text(zoo.markdown(doc))
    unmet = zoo.unmet_criteria(doc["summary"])
    print(f"{len(all_rows)} models from {len(runs)} part(s); unmet: {unmet or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
