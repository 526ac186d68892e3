"""Merge the rows a device call of bench/gpu_reference_call.sh brought back into docs/results/gpu_reference.json (by
model and batch size: a model's new rows replace its old ones, other rows keep their own date); copy the call's logs and
optimize.json files into docs/results/gpu_reference_runs/.
    python bench/gpu_reference_merge.py /work/.device/N
"""
import json
import shutil
import sys
from pathlib import Path

src = Path(sys.argv[1])
dest = Path(__file__).resolve().parent.parent / "docs/results"
rows = json.loads((src / "gpu_reference.json").read_text())
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
