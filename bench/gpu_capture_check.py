"""Issue 35 item 2 on the GPU: do the held-out torchvision Swin and Hugging Face ViT (bench/train_heldout.py, weights
in bench/heldout/) capture as CUDA graphs, eagerly in this process and as saved programs (artifacts/torch_program.py)
reloaded by their own load_model.py in a fresh process? Outputs compared with the eager model's.

    python bench/gpu_capture_check.py --json OUT.json        # needs a CUDA GPU (bench/gpu_capture_call.sh)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]


def _model(name: str) -> torch.nn.Module:
    import train_heldout

    m = getattr(train_heldout, name)()
    state = torch.load(ROOT / "bench" / "heldout" / f"{name}.pt", map_location="cpu")
    m.load_state_dict({k: v.float() for k, v in state.items()} if isinstance(state, dict) else state)
    return m.eval()


def main() -> int:
    from qdeploy.artifacts.torch_program import ProgramSettings, run_in_fresh_process, save_program
    from qdeploy.artifacts.torch_program_loader import capture_cuda_graph

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    x = torch.randn(8, 3, 32, 32)
    for name in ("tv_swin", "hf_vit"):
        model = _model(name)
        with torch.no_grad():
            ref = model(x).float().numpy()
        for prec, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            row = {"model": name, "precision": prec}
            m = model.to(device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
            xd = x.to(device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            try:
                graph, static_in, static_out = capture_cuda_graph(m, xd)
                static_in.copy_(xd)
                graph.replay()
                torch.cuda.synchronize()
                row["eager_cuda_graph"] = {"ok": True, "max_abs_diff": float(np.abs(static_out.float().cpu().numpy() - ref).max())}
            except Exception as e:  # noqa: BLE001
                row["eager_cuda_graph"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            for compile_mode in (None, "default"):
                key = f"program_{compile_mode or 'eager'}_cuda_graph"
                settings = ProgramSettings(device="cuda", precision=prec, channels_last=True, compile=compile_mode,
                                           cuda_graphs=True, batch_sizes=(1, 8), input_shape=(3, 32, 32))
                with tempfile.TemporaryDirectory() as tmp:
                    tmp = Path(tmp)
                    try:
                        t0 = time.perf_counter()
                        manifest = save_program(_model(name), settings, tmp / "prog")
                        np.save(tmp / "x.npy", x.numpy())
                        res = run_in_fresh_process(tmp / "prog", tmp / "x.npy", tmp / "y.npy", "logits", 8, [1, 8],
                                                   tmp / "r.json")
                        y = np.load(tmp / "y.npy")
                        row[key] = {"ok": True, "format": manifest["format"], "max_abs_diff": float(np.abs(y - ref).max()),
                                    "p50_ms": {b: v["p50"] for b, v in (res.get("latency_ms") or {}).items()},
                                    "s": round(time.perf_counter() - t0, 1)}
                    except Exception as e:  # noqa: BLE001
                        row[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-400:]}",
                                    "trace": traceback.format_exc()[-600:]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows,
           "command": "python bench/gpu_capture_check.py --json " + str(a.json)}
    a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
