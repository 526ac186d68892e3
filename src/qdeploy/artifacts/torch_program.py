"""The deployable artifact of a PyTorch candidate (targets torch-cuda, torch-cpu): a saved program a fresh process
loads without the model's source code, plus the loader that runs it (``torch_program_loader.py``, copied as
``load_model.py``).

The format, in order of preference:
1. ``aoti``: an AOTInductor package (``torch._inductor.aoti_compile_and_package``), for a compiled candidate, where a
   package loads on this machine. Loading is checked in a fresh process on a one-layer model first (cached per torch
   version and device): on torch 2.11+cu130 on the project's H100 every package crashed the process at load, CPU and CUDA.
2. ``exported``: the exported program (``torch.export.save``); for a compiled candidate torch.compile runs on it at load,
   warm-started from torch.compile's portable cache (``torch.compiler.save_cache_artifacts``) written here after
   compiling it for every batch size the program serves.

One program with a dynamic batch dimension serves every batch size where torch.export can trace it so; otherwise one
program per batch size (the manifest says which). The loader pads a last, smaller batch to the full size.
"""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from qdeploy.artifacts.torch_program_loader import constants_to_device
from qdeploy.facts.inductor import program_inductor_config
from qdeploy.facts.model_rewrites import REWRITES, apply_rewrites
from qdeploy.facts.torchao import apply_torchao
from qdeploy.utils.log import log

LOADER_SOURCE = Path(__file__).with_name("torch_program_loader.py")
LOADER_NAME = "load_model.py"
MANIFEST = "qdeploy-program.json"
PROGRAM = "model.pt2"
COMPILE_CACHE = "compile-cache.bin"
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ProgramSettings:
    """How the saved program runs: what the chosen candidate was measured as."""

    device: str
    precision: str
    channels_last: bool = False
    tf32: bool = False
    compile: Optional[str] = None       # a torch.compile mode, or None: eager
    cuda_graphs: bool = False
    torchao: Optional[str] = None       # a facts.torchao scheme applied to the Linear layers before export
    freezing: bool = False              # compiled with Inductor's freezing (facts/inductor.py)
    patch_matmul: bool = False          # patch convolutions exported as matmuls (facts/patch_matmul.py)
    depthwise_stencil: bool = False     # depthwise convolutions exported as stencils (facts/depthwise_stencil.py)
    gelu_epilogue: bool = False         # Linear → GELU exported as one matmul + GELU epilogue (facts/gelu_epilogue.py)
    batch_sizes: tuple = (1,)           # the batch sizes it is compiled (and timed) for
    input_shape: tuple = ()             # (C, H, W)


def _example(settings: ProgramSettings, batch: int) -> torch.Tensor:
    fmt = torch.channels_last if settings.channels_last else torch.contiguous_format
    x = torch.randn(batch, *settings.input_shape, device=settings.device)
    return x.to(dtype=_DTYPES[settings.precision]).contiguous(memory_format=fmt)


def export_dynamic_batch(module: torch.nn.Module, settings: ProgramSettings):
    """The exported program of ``module`` (on ``settings``' device, precision and layout) with a dynamic batch
    dimension, traced at batch 2 (torch.export specialises a dimension of size 0 or 1); raises where torch.export cannot
    trace it so. One function for the saved program and for the torch engine's compiled candidates: the same exported
    graph compiled in both gives Inductor's cache the same key, so the saved program's compile (and a fresh process's)
    reuses the search's instead of compiling it again."""
    from torch.export import Dim

    return _exported(module, settings, (_example(settings, 2),), ({0: Dim("batch", min=1)},))


def _exported(module: torch.nn.Module, settings: ProgramSettings, args: tuple, dynamic_shapes=None):
    """torch.export of ``module`` on ``args``, with the graph rewrites ``settings`` asks for (facts/gelu_epilogue.py);
    raises where one was asked for and the graph has nothing it rewrites (the candidate would be its base again)."""
    from torch.export import export

    with torch.inference_mode(False), torch.no_grad():
        program = export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
        if settings.gelu_epilogue:
            from qdeploy.facts.gelu_epilogue import rewrite

            program, pairs = rewrite(program, args, dynamic_shapes)
            if not pairs:
                raise ValueError("gelu_epilogue: the exported program has no Linear (with a bias) whose only user is "
                                 "a GELU")
    return program


def _export(module: torch.nn.Module, settings: ProgramSettings) -> dict:
    """{"dynamic": ExportedProgram} with a dynamic batch dimension, else {"<batch>": ExportedProgram} per batch size."""
    try:
        return {"dynamic": export_dynamic_batch(module, settings)}
    except Exception as e:  # noqa: BLE001 - any export failure: one static program per batch size instead
        log(f"torch.export with a dynamic batch dimension failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "one program per batch size instead")
    return {str(b): _exported(module, settings, (_example(settings, b),)) for b in sorted(set(settings.batch_sizes))}


_PROBE = """
import json, subprocess, sys, tempfile, torch
device, pkg = sys.argv[1], tempfile.mkdtemp(prefix="qdeploy-aoti-probe-") + "/probe.pt2"
try:
    ep = torch.export.export(torch.nn.Linear(8, 4).to(device).eval(), (torch.randn(2, 8, device=device),))
    torch._inductor.aoti_compile_and_package(ep, package_path=pkg)
except Exception as e:
    print(json.dumps({"loads": False, "why": "AOTInductor could not compile a probe package (%s)" % type(e).__name__}))
    sys.exit(0)
code = ("import torch; r = torch._inductor.aoti_load_package(%r); print(tuple(r(torch.randn(2, 8, device=%r)).shape))"
        % (pkg, device))
p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
if p.returncode == 0 and "(2, 4)" in p.stdout:
    why = "a probe package loaded in a fresh process"
elif p.returncode < 0:
    why = "a probe package crashed the process that loaded it (signal %d)" % -p.returncode
else:
    why = "a probe package failed to load: " + " | ".join(p.stderr.strip().splitlines()[-2:])[-300:]
print(json.dumps({"loads": why.startswith("a probe package loaded"), "why": why}))
"""


class AotiProbe:
    """Whether an AOTInductor package loads on this machine: a one-Linear package compiled and then loaded in fresh
    processes (a crash at load, SIGSEGV, kills only those), started in the background when a search begins and read
    when the chosen program is saved; the answer is kept per torch version and device in ``cache_dir``."""

    def __init__(self, device: str, cache_dir: Path):
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        self.key = f"{torch.__version__}|{device}|{name}"
        self.memo = cache_dir / "aoti-loads.json"
        self.known = _read_json(self.memo)
        self.proc = None
        if self.key not in self.known:
            self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, device], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)

    def result(self, timeout: float = 600) -> tuple[bool, str]:
        if self.key not in self.known:
            try:
                out, _ = self.proc.communicate(timeout=timeout)
                answer = json.loads(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                self.proc.kill()
                return False, "the AOTInductor probe did not answer"
            self.known = {**_read_json(self.memo), self.key: answer}
            try:
                self.memo.parent.mkdir(parents=True, exist_ok=True)
                self.memo.write_text(json.dumps(self.known, indent=1))
            except OSError:
                pass
        return self.known[self.key]["loads"], self.known[self.key]["why"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_program(module: torch.nn.Module, settings: ProgramSettings, folder: Path,
                 aoti: Optional[AotiProbe] = None) -> dict:
    """Write the program, its manifest and the loader into ``folder``; returns the manifest. ``aoti``: the probe that
    says whether an AOTInductor package loads here (compiled candidates only); None: never a package."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fmt = torch.channels_last if settings.channels_last else torch.contiguous_format
    model = copy.deepcopy(module)
    apply_rewrites(model, [name for name in REWRITES if getattr(settings, name)])
    model = model.to(device=settings.device, dtype=_DTYPES[settings.precision], memory_format=fmt).eval()
    if settings.torchao:
        # its weights are torchao tensor subclasses: loading needs torchao
        apply_torchao(model, settings.torchao, example=_example(settings, 1))
    with torch.inference_mode(False), torch.no_grad():
        programs = _export(model, settings)
    export_s = time.perf_counter() - t0
    why_format = "eager candidate: the exported program runs as traced"
    use_aoti = False
    if settings.compile is not None:
        use_aoti, why = aoti.result() if aoti is not None else (False, "not asked for")
        why_format = f"AOTInductor package ({why})" if use_aoti else \
            f"no AOTInductor package ({why}): torch.compile's cache travels with the exported program instead"
    files, t1 = {}, time.perf_counter()
    for key, ep in programs.items():
        name = PROGRAM if key == "dynamic" else f"model-b{key}.pt2"
        if use_aoti:
            from torch._inductor import config as inductor

            with inductor.patch(program_inductor_config(settings.torchao, settings.freezing)):
                torch._inductor.aoti_compile_and_package(ep, package_path=str(folder / name))
        else:
            with warnings.catch_warnings():
                # torch.export.save groups storages that share memory and warns when none of a group is "complete"
                # (a view of another weight, e.g. a tied or sliced parameter); the saved program is still whole
                warnings.filterwarnings("ignore", message="No complete tensor found in the group")
                torch.export.save(ep, str(folder / name))
        files[key] = name
    manifest = {"format": "aoti" if use_aoti else "exported", "why_format": why_format, "programs": files,
                "dynamic_batch": "dynamic" in programs, **asdict(settings),
                "input_shape": list(settings.input_shape), "batch_sizes": sorted(set(settings.batch_sizes)),
                "torch": torch.__version__, "export_s": round(export_s, 2),
                "requires": ["torch", "numpy"] + (["torchao"] if settings.torchao else []),
                # the Inductor settings it was compiled under, which the loader compiles under too (facts/inductor.py)
                "inductor_config": program_inductor_config(settings.torchao, settings.freezing)}
    if settings.compile is not None and not use_aoti:
        manifest.update(_compile_cache(folder, programs, settings))
    manifest["package_s"] = round(time.perf_counter() - t1, 2)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.copyfile(LOADER_SOURCE, folder / LOADER_NAME)
    return manifest


def _compile_cache(folder: Path, programs: dict, settings: ProgramSettings) -> dict:
    """Compile the exported program(s) as the loader will (same mode, static shapes per batch size) and save
    torch.compile's portable cache. Compiling the loaded program, not the original module: that is what hits the cache
    in a fresh process."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    t0 = time.perf_counter()
    mode = None if settings.compile == "default" else settings.compile
    for key, ep in programs.items():
        # as the loader compiles it (constants on the device), so that a fresh process hits this cache
        compiled = torch.compile(constants_to_device(ep.module(), settings.device), mode=mode, dynamic=False)
        sizes = settings.batch_sizes if key == "dynamic" else (int(key),)
        with torch.inference_mode(), \
                torch._inductor.config.patch(program_inductor_config(settings.torchao, settings.freezing)):
            for b in sorted(set(sizes)):
                compiled(_example(settings, b))
    if settings.device == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {"compile_cache": None, "compile_s": round(compile_s, 2),
                "compile_cache_note": "torch.compiler.save_cache_artifacts saved nothing: a fresh process compiles from scratch"}
    blob, _info = saved
    (folder / COMPILE_CACHE).write_bytes(blob)
    return {"compile_cache": COMPILE_CACHE, "compile_s": round(compile_s, 2), "compile_cache_bytes": len(blob)}


def run_in_fresh_process(folder: Path, images_npy: Optional[Path], save: Optional[Path], outputs: str, batch_size: int,
                         bench: list[int], result_json: Path, timeout: float = 1800) -> dict:
    """Run the folder's own ``load_model.py`` in a new Python process (no qdeploy, no model source imported there):
    outputs for the images and the latency per batch size. Raises RuntimeError with the tail of its stderr."""
    cmd = [sys.executable, str(folder / LOADER_NAME), str(folder), "--json", str(result_json),
           "--bench", ",".join(str(b) for b in bench), "--batch-size", str(batch_size), "--outputs", outputs]
    if images_npy is not None:
        cmd += ["--images", str(images_npy)]
    if save is not None:
        cmd += ["--save", str(save)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=folder)
    if p.returncode != 0 or not result_json.is_file():
        how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
        tail = " | ".join(p.stderr.strip().splitlines()[-6:])[-800:]
        raise RuntimeError(f"{folder / LOADER_NAME} failed in a fresh process ({how}): {tail}")
    res = json.loads(result_json.read_text())
    res["log"] = [ln for ln in p.stdout.splitlines() if ln.startswith("load_model:")]
    return res
