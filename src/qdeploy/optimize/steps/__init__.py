"""The steps of ``qdeploy optimize``: each owns one kind of candidate and registers itself by name in
:data:`STEPS`; a target lists the steps it runs (``candidates.Target.steps``) and ``search.py`` runs them in order.

- ``floats`` (floats.py): the FP32 reference and the target's float candidates;
- ``engine-placements`` (cpu_engines.py): the other CPU engines' own INT8 placement (OpenVINO: NNCF), before PTQ;
- ``ptq`` (ptq.py): INT8 post-training quantization, its range methods ranked on a subset;
- ``cpu-engines`` (cpu_engines.py): the CPU placements a profile or a lint finding asks for, and the other CPU engines'
  INT8 from the same Q/DQ ONNX;
- ``fallback`` (fallback.py): per-layer fallback and QAT where PTQ misses the budget, or a fallback for speed;
- ``nncf-accuracy-control`` (accuracy_control.py): NNCF's quantize_with_accuracy_control beside the fallback, as a peer;
- ``final-timing`` (final_timing.py): the CPU targets' fastest candidates within budget timed again in interleaved
  rounds, so that one timing each minutes apart does not order near-equal ones;
- ``torch-runtimes`` (torch_runtimes.py): the PyTorch targets' precision x layout x runtime search.

The confirm split (confirm.py) follows every search.
"""
from qdeploy.optimize.steps import (accuracy_control, cpu_engines, fallback, final_timing, floats, ptq,  # noqa: F401 (they register)
                                   torch_runtimes)
from qdeploy.optimize.steps.base import STEPS, Step, register_step

__all__ = ["STEPS", "Step", "register_step"]
