"""Merge the rows a device call of bench/device/gpu_reference_call.sh brought back into docs/results/gpu/gpu_reference.json (by
model and batch size: a model's new rows replace its old ones, other rows keep their own date); copy the call's logs and
optimize.json files into docs/results/gpu/gpu_reference_runs/.
    python bench/suites/gpu_reference_merge.py /work/.device/N
    python bench/suites/gpu_reference_merge.py --from-log MODEL /work/.device/N   # a call cut off by its time limit before
        gpu_reference.py wrote its rows: the rows are read from MODEL.log (the references timed, the fresh-process p50s
        of optimize's confirm step, the confirm split's top-1), the references not reached are named
"""
import datetime
import json
import re
import shutil
import sys
from pathlib import Path

REFERENCES = ("eager FP32", "eager FP16", "CUDA-graph FP16 channels_last", "torch.compile reduce-overhead FP16 channels_last",
              "torch.compile + hand CUDA graph FP16 channels_last", "torch.compile + hand CUDA graph BF16 channels_last",
              "torch.compile max-autotune FP16 channels_last")


def rows_from_log(model: str, log: Path) -> list:
    text = log.read_text()
    facts = json.loads(next(line for line in text.splitlines() if line.startswith('{"gpu"')))
    refs = {}
    for name in REFERENCES:
        m = re.search(rf"^{re.escape(name)}: b1 ([0-9.]+) ms, b32 ([0-9.]+) ms", text, re.M)
        if m:
            refs[name] = {1: float(m.group(1)), 32: float(m.group(2))}
    fresh = {int(b): float(v) for b, v in re.findall(r"^qdeploy optimize: load_model: batch (\d+): p50 ([0-9.]+) ms", text, re.M)}
    chosen = re.search(r"^chosen: torch (\S+) \((\S+)\); top-1 search [0-9.]+ %, confirm ([0-9.]+) % vs FP32 ([0-9.]+) %; "
                       r"(budget met|budget NOT met)", text, re.M)
    t = re.search(r"^optimize exit (\d+) in (\d+) s", text, re.M)
    rows = []
    for b in (1, 32):
        r = {k: v[b] for k, v in refs.items()}
        best = min(r.values())
        rows.append({"model": model, "weights": ".devheld/" + model + ".pt", "batch_size": b, "gpu": facts["gpu"],
                     "date": datetime.date.fromtimestamp(log.stat().st_mtime).isoformat(), "torch": facts["torch"],
                     "versions": {k: facts.get(k) for k in ("torchvision", "timm", "transformers")},
                     "nvidia_smi": facts.get("nvidia_smi"), "references": r,
                     "references_not_measured": [n for n in REFERENCES if n not in refs],
                     "source": "read from the log of a device call cut off by its 600 s limit (bench/suites/gpu_reference_merge.py "
                               "--from-log); the program was not reloaded inside the benchmark",
                     "qdeploy": {"variant": chosen.group(1), "artifact": chosen.group(2), "p50_ms": fresh[b],
                                 "ratio_to_best_reference": round(fresh[b] / best, 4), "fresh_process_p50_ms": fresh[b],
                                 "ratio_from": "fresh_process_p50_ms",
                                 "confirm_drop": round(float(chosen.group(4)) - float(chosen.group(3)), 3),
                                 "budget_met": chosen.group(5) == "budget met", "optimize_time_s": int(t.group(2))}})
    return rows


if sys.argv[1] == "--from-log":
    src = Path(sys.argv[3])
    rows = rows_from_log(sys.argv[2], src / f"{sys.argv[2]}.log")
else:
    src = Path(sys.argv[1])
    rows = json.loads((src / "gpu_reference.json").read_text())
dest = Path(__file__).resolve().parents[2] / "docs/results"
path = dest / "gpu_reference.json"
old = json.loads(path.read_text()) if path.is_file() else []
new_keys = {(r["model"], r["batch_size"]) for r in rows}
path.write_text(json.dumps([r for r in old if (r["model"], r["batch_size"]) not in new_keys] + rows, indent=1))
(dest / "gpu_reference_runs").mkdir(exist_ok=True)
for f in list(src.glob("*.log")) + list(src.glob("*.optimize.json")):
    shutil.copy(f, dest / "gpu_reference_runs" / f.name)
for r in rows:
    q = r["qdeploy"]
    print(f"{r['model']} b{r['batch_size']}: {q['variant']} {q['p50_ms']} ms, best hand-written {min(r['references'].values())} "
          f"ms, ratio {q['ratio_to_best_reference']}, confirm drop {q['confirm_drop']}")
