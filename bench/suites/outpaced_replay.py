"""The GPU search's OUTPACED rule (optimize/steps/torch_runtimes.outpaced_by) replayed on recorded torch-cuda searches:
for every precision and layout with a CUDA-graph brief timing, would the rule have left its compile out, and where the
search compiled it anyway, was that compiled program slower than the fastest one (a right call) or not (a wrong one)?

    python bench/suites/outpaced_replay.py [OPTIMIZE_JSON ...] --json docs/results/outpaced_replay.json

Default input: every optimize.json of a torch-cuda search under docs/results. Only plain compiled programs with CUDA
graphs count as "compiled" (not the rewrites: frozen, patch matmul, torchao); the fastest of them stands for the search's
first compile, the one the rule measures the gain on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qdeploy.optimize.candidates import TARGETS, CompiledCandidate, CudaGraphCandidate
from qdeploy.optimize.decide import LATENCY_TIE
from qdeploy.optimize.steps.torch_runtimes import outpaced_by

ROOT = Path(__file__).resolve().parents[2]
REWRITES = ("frozen", "patchmm", "-ao-")


def candidates(record: dict) -> tuple[list, list]:
    target = TARGETS["torch-cuda"]
    graphs, compiled = [], []
    for c in record["candidates"]:
        p50 = {int(k): v for k, v in (c.get("brief_p50_ms") or {}).items() if v}
        if not p50 or c.get("precision") not in ("fp32", "fp16", "bf16"):
            continue
        key = (c["precision"], bool(c.get("channels_last")), bool(c.get("tf32")))
        if c.get("runtime") == "cudagraph":
            cand = CudaGraphCandidate.planned(target, *key)
        elif c.get("compile") and c.get("cuda_graphs") and not any(r in c["variant"] for r in REWRITES):
            cand = CompiledCandidate.planned(target, *key, "default", True)
        else:
            continue
        cand.timed_briefly(p50, c.get("compile_s") or 0.0)
        (graphs if c.get("runtime") == "cudagraph" else compiled).append(cand)
    return graphs, compiled


def replay(path: Path) -> dict | None:
    record = json.loads(path.read_text())
    if record.get("target") != "torch-cuda":
        return None
    graphs, compiled = candidates(record)
    if not graphs or not compiled:
        return None
    best = min(compiled, key=lambda c: c.brief_rank)
    rows = []
    for g in graphs:
        cand = CompiledCandidate.planned(TARGETS["torch-cuda"], g.precision, g.channels_last, g.tf32, "default", True)
        why = outpaced_by(cand, graphs, [best])
        actual = next((c.brief_rank for c in compiled if c.variant == cand.variant), None)
        rows.append({"variant": cand.variant, "graph_ms": round(g.brief_rank, 4), "pruned": why is not None, "why": why,
                     "compiled_ms": None if actual is None else round(actual, 4),
                     "wrong": bool(why and actual is not None and actual <= best.brief_rank * (1 + LATENCY_TIE))})
    return {"search": str(path.relative_to(ROOT)), "fastest_compiled": best.variant,
            "fastest_compiled_ms": round(best.brief_rank, 4), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    files = a.files or sorted(p for p in (ROOT / "docs/results").rglob("*.json") if "optimize" in p.name)
    out = [r for r in map(replay, files) if r]
    pruned = [x for r in out for x in r["rows"] if x["pruned"]]
    checked = [x for x in pruned if x["compiled_ms"] is not None]
    wrong = [x for x in pruned if x["wrong"]]
    for r in out:
        print(f"{r['search']}: fastest compiled {r['fastest_compiled']} {r['fastest_compiled_ms']:.3f} ms")
        for x in r["rows"]:
            print(f"   {x['variant']:34s} graph {x['graph_ms']:8.3f}  {'left out' if x['pruned'] else 'compiled':9s}"
                  + (f"  compiled in the record: {x['compiled_ms']:.3f} ms" if x["compiled_ms"] is not None else "")
                  + ("  WRONG" if x["wrong"] else ""))
    summary = {"searches": len(out), "left_out": len(pruned), "left_out_but_compiled_in_the_record": len(checked),
               "wrong": len(wrong)}
    print(json.dumps(summary))
    if a.json:
        a.json.write_text(json.dumps({"command": "python bench/suites/outpaced_replay.py --json " + str(a.json),
                                      "summary": summary, "searches": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
