"""Load and run a model that ``qdeploy optimize`` saved for PyTorch (targets torch-cuda, torch-cpu).

This file is copied into the output folder as ``load_model.py``. It imports torch and numpy only: neither qdeploy nor
the model's source code (timm, torchvision, your repository) is needed to run the saved program.

    import load_model
    model = load_model.load("path/to/out")        # reads qdeploy-program.json beside the program
    logits = model(images)                         # float32 NCHW torch.Tensor or numpy array, already normalized
    model = load_model.load("path/to/out", warm_up=True)  # each saved batch size's first call (compile, graph) now

    python load_model.py [FOLDER] --bench 1,32     # reproduces the latency qdeploy measured (CUDA events)
    python load_model.py FOLDER --images x.npy --save out.npy [--outputs argmax]

What is in the folder (``qdeploy-program.json`` says which):
- ``format: aoti``: an AOTInductor package (``model.pt2``): compiled kernels, loaded without compiling;
- ``format: exported``: the exported program (``torch.export.save``); with ``compile`` set, torch.compile runs on it at
  load, warm-started from ``compile-cache.bin`` (``torch.compiler.save_cache_artifacts``), so a fresh process compiles
  from the cache instead of from scratch;
- ``cuda_graphs: true``: one CUDA graph is captured per input shape on its first call and replayed afterwards (the
  captured output tensor is reused: copy it if you keep it across calls).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

MANIFEST = "qdeploy-program.json"
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# timing: the same statistics as qdeploy's benchmark (a copy: this file imports nothing of qdeploy; the reasons for
# these bars are given in qdeploy/benchmark/latency.py)
NOISY_CV = 0.10
NOISY_P50 = 0.05
NOISY_DRIFT = 0.10
DRIFT_SIGMAS = 3.0
DRIFT_MIN_PER_THIRD = 5
SOURCES = ("qdeploy", "timm", "torchvision")


class Program:
    """The saved model, callable on float32 NCHW inputs; casts to its precision and layout, returns float32."""

    def __init__(self, folder: Path, manifest: dict, device: str):
        self.folder, self.manifest, self.device = folder, manifest, device
        self.dtype = _DTYPES[manifest["precision"]]
        self.memory_format = torch.channels_last if manifest.get("channels_last") else torch.contiguous_format
        self.cuda_graphs = bool(manifest.get("cuda_graphs")) and device == "cuda"
        self._graphs: dict = {}
        self._modules: dict = {}
        self._compiled: set = set()
        # a compiled program's Inductor settings (facts/inductor.py), applied at each shape's first (compiling) call
        self._inductor_config = (manifest.get("inductor_config") or {}) if manifest.get("compile") else {}
        self.load_s = 0.0
        t0 = time.perf_counter()
        _set_math_flags(manifest, device)
        if manifest.get("compile") and manifest["format"] == "exported" and manifest.get("compile_cache"):
            cache = folder / manifest["compile_cache"]  # None where torch.compile saved no cache: compiled at load
            if cache.is_file():
                torch.compiler.load_cache_artifacts(cache.read_bytes())
        programs = manifest["programs"]  # {"dynamic": file} or {"<batch>": file}
        for key, name in programs.items():
            self._modules[key] = self._load_one(folder / name)
        self.load_s = time.perf_counter() - t0

    def _load_one(self, path: Path):
        m = self.manifest
        if m["format"] == "aoti":
            return torch._inductor.aoti_load_package(str(path))
        module = constants_to_device(torch.export.load(str(path)).module(), self.device)
        if m.get("compile"):
            module = torch.compile(module, mode=None if m["compile"] == "default" else m["compile"], dynamic=False)
        return module

    def _module_for(self, batch: int):
        if "dynamic" in self._modules:
            return self._modules["dynamic"]
        if str(batch) not in self._modules:
            raise ValueError(f"this program was saved for batch sizes {sorted(self._modules, key=int)}, not {batch}")
        return self._modules[str(batch)]

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        module = self._module_for(x.shape[0])
        if self._inductor_config and tuple(x.shape) not in self._compiled:
            # the first call on a shape compiles: under the Inductor settings the program was measured with, and only
            # then (they are not this process's to change)
            from torch._inductor import config as inductor

            with inductor.patch(self._inductor_config):
                out = module(x)
            self._compiled.add(tuple(x.shape))
        else:
            out = module(x)
        return out[0] if isinstance(out, (list, tuple)) else out

    def _graph(self, x: torch.Tensor):
        key = tuple(x.shape)
        if key not in self._graphs:
            self._graphs[key] = capture_cuda_graph(self._run, x)
        return self._graphs[key]

    def stage(self, images) -> torch.Tensor:
        """float32 NCHW (numpy or torch) → a tensor on the device, in the program's precision and layout."""
        x = torch.as_tensor(images)
        if self.device == "cuda" and x.device.type == "cpu":
            x = x.pin_memory().to("cuda", non_blocking=True)
        return x.to(device=self.device, dtype=self.dtype).contiguous(memory_format=self.memory_format)

    def forward_staged(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda_graphs:
            graph, static_in, static_out = self._graph(x)
            static_in.copy_(x)
            graph.replay()
            return static_out
        with torch.inference_mode():
            return self._run(x)

    def __call__(self, images) -> torch.Tensor:
        return self.forward_staged(self.stage(images)).float()

    def timed_step(self, images):
        """A zero-argument call of one inference on inputs already on the device (what the latency measures)."""
        x = self.stage(images)
        if self.cuda_graphs:
            graph = self._graph(x)[0]
            return graph.replay
        return lambda: self.forward_staged(x)

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def warm_up(self, batch_sizes=None) -> dict:
        """One call per batch size (default: every one it was saved for) on zeros, so that what a shape's first call
        does (compile, from the saved cache where there is one; capture its CUDA graph) happens now rather than in the
        first request: {batch size: seconds}."""
        sizes = list(batch_sizes) if batch_sizes is not None else list(self.manifest["batch_sizes"])
        took = {}
        for b in sizes:
            t0 = time.perf_counter()
            self.forward_staged(self.stage(torch.zeros((b, *self.manifest["input_shape"]))))
            self.synchronize()
            took[b] = round(time.perf_counter() - t0, 3)
        return took


def constants_to_device(module: torch.nn.Module, device: str) -> torch.nn.Module:
    """Move the tensor constants of an exported program's module (``ExportedProgram.module()``) onto ``device``.

    Why: a forward that makes a tensor with ``torch.tensor(...)`` (torchvision's Swin builds its shifted-window mask
    so) exports it as a lifted constant, a CPU tensor kept as a plain attribute, which ``Module.to`` does not move; the
    program then copies it to the GPU on every call, which a CUDA graph capture refuses ("Cannot copy between CPU and
    CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"). On the device it is the same value."""
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.device.type != torch.device(device).type:
                setattr(sub, name, value.to(device))
    return module


def capture_cuda_graph(run, x: torch.Tensor) -> tuple:
    """(graph, static input, static output) of ``run`` on ``x``'s shape: three warm-up calls on a side stream first
    (lazy initialisation, cuDNN autotuning and torch.compile's first call must happen outside the capture). Replay:
    copy the new input into the static input, ``graph.replay()``, read the static output. qdeploy's torch engine uses
    this function too, so what optimize measured is what this file replays."""
    static_in = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            run(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        static_out = run(static_in)
    return graph, static_in, static_out


def _set_math_flags(manifest: dict, device: str) -> None:
    """FP32 math as measured: TF32 on or off for cuDNN convolutions and cuBLAS matmuls (PyTorch's own defaults differ:
    cuDNN allows TF32, matmuls do not); cuDNN's autotuner on, as qdeploy measured."""
    if device != "cuda":
        return
    tf32 = bool(manifest.get("tf32"))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True


def load(folder=None, device: str | None = None, warm_up: bool = False) -> Program:
    """The program saved in ``folder`` (default: this file's folder), on ``device`` (default: the one it was saved
    for); ``warm_up``: each saved batch size's first call made here (``Program.warm_up``), as a server does before
    it takes requests (a compiled program's first call per shape compiles: seconds, more for a frozen program)."""
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parent
    manifest = json.loads((folder / MANIFEST).read_text())
    device = device or manifest["device"]
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{folder / MANIFEST} was saved for a CUDA GPU; torch.cuda.is_available() is False here")
    program = Program(folder, manifest, device)
    if warm_up:
        program.warm_up()
    return program


# ---------------------------------------------------------------------------- timing (CUDA events / perf_counter)
def _ms(x: float) -> str:
    digits = max(1, 2 - int(np.floor(np.log10(x)))) if x > 0 else 1
    return f"{x:.{digits}f}"


def noise_reasons(a: np.ndarray) -> list:
    """"scatter: p50 … ± 5.5 % (95 % interval of the median …)" and/or "drift: first third median 88.0 ms, last third
    40.1 ms" (see qdeploy's benchmark)."""
    reasons = []
    if len(a) > 1:
        s, median = np.sort(a), float(np.median(a))
        half_rank = 1.96 * np.sqrt(len(a)) / 2
        lo = s[max(0, int(np.floor(len(a) / 2 - half_rank)))]
        hi = s[min(len(a) - 1, int(np.ceil(len(a) / 2 + half_rank)))]
        half = (hi - lo) / 2 / median if median > 0 else 0.0
        if half > NOISY_P50:
            reasons.append(f"scatter: p50 {_ms(median)} ms ± {100 * half:.1f} % (95 % interval of the median "
                           f"{_ms(lo)}-{_ms(hi)} ms)")
    third = len(a) // 3
    if third >= DRIFT_MIN_PER_THIRD:
        first, last = a[:third], a[-third:]
        m1, m3 = float(np.median(first)), float(np.median(last))
        sigma = 1.4826 * 0.5 * (np.median(np.abs(first - m1)) + np.median(np.abs(last - m3)))
        shift = abs(m3 - m1)
        if shift > NOISY_DRIFT * min(m1, m3) and shift > DRIFT_SIGMAS * 1.2533 * sigma * np.sqrt(2.0 / third):
            reasons.append(f"drift: first third median {_ms(m1)} ms, last third {_ms(m3)} ms")
    return reasons


def latency_stats(samples_ms) -> dict:
    a = np.asarray(samples_ms, dtype=np.float64)
    mean = float(a.mean())
    std = float(a.std(ddof=1)) if len(a) > 1 else 0.0
    cv = std / mean if mean > 0 else 0.0
    reasons = noise_reasons(a)
    return {"mean": mean, "std": std, "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)), "min": float(a.min()),
            "max": float(a.max()), "cv": cv, "noisy": bool(reasons), "noisy_reason": "; ".join(reasons) or None}


def _time_once(step, cuda: bool) -> float:
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def warm_up(step, cuda: bool, chunk: int = 10, max_s: float = 3.0) -> int:
    """Until stable: chunks of ``chunk`` calls until a chunk's median is within 5 % of the one before (clocks, caches
    and allocators settled), at most ``max_s`` seconds. Returns the calls made."""
    calls, last, t0 = 0, None, time.perf_counter()
    while True:
        med = statistics.median(_time_once(step, cuda) for _ in range(chunk))
        calls += chunk
        if (last is not None and abs(med - last) <= 0.05 * last) or time.perf_counter() - t0 > max_s:
            return calls
        last = med


def bench(program: Program, images: np.ndarray, batch_sizes, iterations: int = 200, repeats: int = 3) -> dict:
    """Per batch size: the first call's time (compile from the cache, graph capture), then ``repeats`` timings of
    ``iterations`` calls after a warm-up until stable; the repeat with the lowest median is kept, every median shown."""
    cuda = program.device == "cuda"
    out = {}
    for bs in batch_sizes:
        reps = -(-bs // len(images))
        batch = np.ascontiguousarray(np.concatenate([images] * reps)[:bs])
        t0 = time.perf_counter()
        step = program.timed_step(batch)
        step()
        program.synchronize()
        first_call_s = time.perf_counter() - t0
        runs, warm = [], 0
        for _ in range(repeats):
            warm += warm_up(step, cuda)
            runs.append([_time_once(step, cuda) for _ in range(iterations)])
        medians = [float(np.percentile(r, 50)) for r in runs]
        best = int(np.argmin(medians))
        stats = latency_stats(runs[best])
        stats.update(repeats=repeats, repeat_p50s=medians, iterations=iterations, warmup_calls=warm,
                     first_call_s=round(first_call_s, 3), timer="cuda-events" if cuda else "perf_counter")
        out[str(bs)] = stats
    return out


def predict(program: Program, images: np.ndarray, batch_size: int, outputs: str = "logits") -> np.ndarray:
    """Outputs for every image, in batches of ``batch_size``; the last batch is padded to that size (a new shape would
    compile again and capture another CUDA graph) and the padding dropped."""
    parts = []
    for i in range(0, len(images), batch_size):
        chunk = images[i:i + batch_size]
        n = len(chunk)
        if n < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - n, axis=0)])
        y = program(np.ascontiguousarray(chunk))[:n]
        parts.append((y.argmax(dim=1).to(torch.uint8 if y.shape[1] <= 256 else torch.int32) if outputs == "argmax"
                      else y).cpu().numpy())
    return np.concatenate(parts)


def environment(device: str) -> dict:
    d = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device,
         "imported_sources": [m for m in SOURCES if m in sys.modules]}
    if device == "cuda":
        d["gpu"] = torch.cuda.get_device_name()
        d["cuda"] = torch.version.cuda
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run a program saved by qdeploy optimize: outputs and latency.")
    ap.add_argument("folder", nargs="?", default=None, help="the folder with qdeploy-program.json (default: this file's)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--images", help=".npy of float32 NCHW images, already normalized (default for --bench: random)")
    ap.add_argument("--save", help="write the outputs for --images here (.npy)")
    ap.add_argument("--outputs", choices=["logits", "argmax"], default="logits")
    ap.add_argument("--batch-size", type=int, default=None, help="for --images (default: the largest saved batch size)")
    ap.add_argument("--bench", default=None, help="batch sizes to time, e.g. 1,32 (default: the ones it was saved for)")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    program = load(args.folder, args.device)
    m = program.manifest
    res = {"manifest": m, "load_s": round(program.load_s, 3)}
    images = np.load(args.images, mmap_mode="r") if args.images else None
    sizes = [int(b) for b in args.bench.split(",")] if args.bench else list(m["batch_sizes"])
    sample = np.asarray(images[:max(sizes)]) if images is not None else \
        np.random.default_rng(0).standard_normal((max(sizes), *m["input_shape"]), dtype=np.float32)
    # timed first: each batch size's first call after the reload (compile from the cache, graph capture) is reported
    res["latency_ms"] = bench(program, sample, sizes, args.iterations, args.repeats)
    if images is not None and args.save:
        t0 = time.perf_counter()
        np.save(args.save, predict(program, images, args.batch_size or max(m["batch_sizes"]), args.outputs))
        res["predict_s"] = round(time.perf_counter() - t0, 3)
    res["environment"] = environment(program.device)  # after running: a lazy import would show here
    imported = res["environment"]["imported_sources"]
    print(f"load_model: {m['format']} program, {m['precision']}"
          f"{', channels_last' if m.get('channels_last') else ''}{', compile ' + m['compile'] if m.get('compile') else ''}"
          f"{', CUDA graphs' if program.cuda_graphs else ''} on {program.device}; loaded in {res['load_s']:.2f} s; "
          + ("imports torch and numpy only (" + ", ".join(SOURCES) + " not imported)" if not imported
             else "imported " + ", ".join(imported)))
    for bs, st in res["latency_ms"].items():
        print(f"load_model: batch {bs}: p50 {st['p50']:.4f} ms (CV {st['cv']:.3f}"
              f"{', NOISY: ' + st['noisy_reason'] if st['noisy'] else ''}), "
              f"first call {st['first_call_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
