"""Why an AOTInductor package crashes at load on the GPU machine (issue #22): faulthandler stack of the crash, a CPU-only
package, and torch.export.save/load + torch.compile's portable cache (save/load_cache_artifacts) as the fallback.

    python bench/gpu_aoti_diag.py > $OUT/diag.log 2>&1
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

work = tempfile.mkdtemp()
res = {"torch": torch.__version__}


def fresh(code: str, *argv) -> dict:
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *argv], capture_output=True, text=True, timeout=240)
    return {"rc": p.returncode, "stdout": p.stdout[-600:], "stderr": p.stderr[-2500:]}


model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 10))
for device in ("cpu", "cuda"):
    m = model.to(device).eval()
    x = torch.randn(2, 3, 8, 8, device=device)
    ep = torch.export.export(m, (x,))
    path = os.path.join(work, f"lin-{device}.pt2")
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
        res[f"aoti_{device}"] = fresh(
            "import sys, torch; r = torch._inductor.aoti_load_package(sys.argv[1]); "
            f"print(r(torch.randn(2, 3, 8, 8, device='{device}')).shape)", path)
        res[f"aoti_{device}_single_thread"] = fresh(
            "import sys, torch; from torch._inductor.package import load_package; "
            "r = load_package(sys.argv[1], run_single_threaded=True); "
            f"print(r(torch.randn(2, 3, 8, 8, device='{device}')).shape)", path)
    except Exception as e:  # noqa: BLE001
        res[f"aoti_{device}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps({k: v for k, v in res.items() if k.startswith(f"aoti_{device}")})[:4000], flush=True)

# fallback: exported program + compile cache, reloaded in a fresh process
m = model.cuda().eval()
x = torch.randn(2, 3, 8, 8, device="cuda")
ep = torch.export.export(m, (x,))
ep_path = os.path.join(work, "lin.pt2ep")
torch.export.save(ep, ep_path)
t0 = time.perf_counter()
cm = torch.compile(ep.module(), mode="max-autotune-no-cudagraphs")
cm(x)
res["compile_s"] = round(time.perf_counter() - t0, 1)
try:
    blob, info = torch.compiler.save_cache_artifacts()
    cache_path = os.path.join(work, "cache.bin")
    open(cache_path, "wb").write(blob)
    res["cache_bytes"] = len(blob)
    res["reload"] = fresh(
        "import sys, time, torch; torch.compiler.load_cache_artifacts(open(sys.argv[2], 'rb').read()); "
        "ep = torch.export.load(sys.argv[1]); t0 = time.perf_counter(); "
        "cm = torch.compile(ep.module(), mode='max-autotune-no-cudagraphs'); "
        "y = cm(torch.randn(2, 3, 8, 8, device='cuda')); torch.cuda.synchronize(); "
        "print('warm compile s', round(time.perf_counter() - t0, 1), y.shape)", ep_path, cache_path)
except Exception as e:  # noqa: BLE001
    res["cache"] = f"{type(e).__name__}: {e}"[:500]
print(json.dumps({k: v for k, v in res.items() if not k.startswith("aoti")}), flush=True)
