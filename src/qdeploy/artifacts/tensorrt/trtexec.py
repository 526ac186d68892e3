"""The trtexec command line equivalent to a qdeploy TensorRT build, for the installed (or each supported) major version.

Recorded for every TensorRT variant, built or skipped, so a user can reproduce the engine by hand.
10.x: precision by flags (``--fp16``, ``--int8``, ``--calib=CACHE`` for the legacy path).
11.x: ``--stronglyTyped`` and no precision flags: the ONNX (FP16 or Q/DQ) decides.
"""
from __future__ import annotations

import shlex
from typing import Optional

from qdeploy.artifacts.tensorrt.profiles import InputProfile
from qdeploy.facts.tensorrt import TrtPlan


def trtexec_command(plan: TrtPlan, onnx_file: str, engine_file: str, profiles: list[InputProfile],
                    workspace_mib: Optional[int] = None, optimization_level: Optional[int] = None,
                    timing_cache: Optional[str] = None, calibration_cache: Optional[str] = None,
                    layer_info: Optional[str] = None) -> str:
    args = ["trtexec", f"--onnx={onnx_file}", f"--saveEngine={engine_file}"]
    if plan.strongly_typed:
        args.append("--stronglyTyped")
    for flag in plan.builder_flags:
        args.append({"FP16": "--fp16", "INT8": "--int8"}[flag])
    if plan.calibration_cache:
        args.append(f"--calib={calibration_cache or 'CALIBRATION.trtcache'}")
    if profiles:
        for which, opt in (("min", "--minShapes"), ("opt", "--optShapes"), ("max", "--maxShapes")):
            args.append(f"{opt}=" + ",".join(p.shape_arg(which) for p in profiles))
    if workspace_mib:
        args.append(f"--memPoolSize=workspace:{int(workspace_mib)}M")
    if optimization_level is not None:
        args.append(f"--builderOptimizationLevel={int(optimization_level)}")
    if timing_cache:
        args.append(f"--timingCacheFile={timing_cache}")
    if layer_info:
        args += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    return " ".join(shlex.quote(a) for a in args)
