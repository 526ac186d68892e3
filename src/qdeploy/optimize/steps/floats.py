"""The FP32 reference and the target's float candidates (its reduced precisions, the other CPU engines' FP32/BF16,
CUDA-graph replays), measured first: every budget is measured against the reference."""
from __future__ import annotations

import time

from qdeploy.optimize.candidates import PtqCandidate
from qdeploy.optimize.steps.base import Step, register_step


@register_step
class FloatStep(Step):
    name = "floats"

    def run(self) -> None:
        s = self.s
        if s.target.placement is not None:  # every candidate of these targets starts from the ONNX: fail now, saying why
            s.load_fp32_onnx()
        first = [c for c in s.planned if not isinstance(c, PtqCandidate)]
        t0 = time.perf_counter()
        s.measure(first[0])  # the reference
        s.check_reference(time.perf_counter() - t0)
        s.measure_all(first[1:])
