"""Lint stage: why a Q/DQ ONNX will or will not run fast in TensorRT.

    report = lint_onnx("model-int8.onnx")          # LintReport: findings, structure, verdict
    fixed = fix_onnx("model-int8.onnx", "fixed.onnx")   # the safe fixes, then a fresh report

- (TensorRT kernel facts: qdeploy.facts.tensorrt, shared with the quantizers and the engine builder)
- qdq_graph.py       the Q/DQ-aware graph view every rule, fix and report reads
- rules.py           the rules (ids QD001...), each yielding Findings with a severity and a fix
- fixes.py           the safe fixes (``--fix``), also used by the ONNX TensorRT placement
- structure.py       per compute op / residual Add: what TensorRT will do
- tensorrt_confirm.py  where TensorRT is installed: the built engine's layers confirm the findings

Works on any Q/DQ ONNX: qdeploy's, ModelOpt's ``modelopt.onnx.quantization``, ONNX Runtime's
``quantize_static`` (QDQ format) and QAT exports.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import onnx

from qdeploy.errors import QDeployError
from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.lint.rules import RULES, SEVERITIES, Finding, run_rules
from qdeploy.lint.structure import qdq_structure, structure_line

# Q/DQ needs opset 10; per-channel scales (axis) and TensorRT's ONNX parser need 13.
MIN_OPSET = 13
QOPERATOR_OPS = ("QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul", "ConvInteger", "MatMulInteger", "QGemm",
                 "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearSigmoid", "QLinearLeakyRelu")


class LintInputError(QDeployError):
    """The file cannot be linted: not ONNX, missing external data, unsupported opset, broken Q/DQ nodes."""


class FloatModel(QDeployError):
    """The ONNX has no Q/DQ nodes: nothing for TensorRT's explicit quantization to read."""


@dataclass
class LintReport:
    file: str
    nodes: int
    opset: int
    findings: list[Finding]
    structure: dict
    by: str = "static analysis"            # or "TensorRT X.Y" when a built engine's layers confirmed the findings
    time_s: float = 0.0
    fixed: dict = field(default_factory=dict)   # rule id -> fixes applied (``--fix``)
    tensorrt: Optional[dict] = None

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}

    @property
    def verdict(self) -> str:
        c = self.counts()
        if c["blocks-int8"]:
            return "blocks INT8"
        if c["costs-reformat"]:
            return "costs reformats"
        return "clean"

    def explain(self, reasons: dict[str, str]) -> None:
        """Mark findings whose nodes were left float on purpose (user excludes, TensorRT's conv rule)."""
        for f in self.findings:
            why = [reasons[n] for n in f.nodes if n in reasons]
            if why and f.rule in ("QD011", "QD013"):
                f.fix = f"explained: {why[0]}"
                f.severity = "fine"

    def to_dict(self, with_ops: bool = False) -> dict:
        st = dict(self.structure)
        if not with_ops:
            st.pop("ops", None)
            st.pop("adds", None)
        return {"schema": "qdeploy.lint/1", "file": self.file, "nodes": self.nodes, "opset": self.opset, "by": self.by,
                "verdict": self.verdict, "counts": self.counts(), "time_s": self.time_s,
                "findings": [f.to_dict() for f in self.findings], "structure": st, "fixed": self.fixed,
                "tensorrt": self.tensorrt}


def load_qdq_model(path) -> onnx.ModelProto:
    """Load and validate an ONNX for linting; every refusal names the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise LintInputError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise LintInputError(f"{path} is not an ONNX model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'cannot parse'})") from None
    if not model.graph.node:
        raise LintInputError(f"{path} is not an ONNX model (no graph nodes)")
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        try:
            from onnx.external_data_helper import load_external_data_for_model
            load_external_data_for_model(model, str(path.parent))
        except Exception as e:
            raise LintInputError(f"{path}: its external data is missing or unreadable (initializer '{external[0]}': "
                                 f"{str(e).splitlines()[0]}); keep the .data file next to the .onnx") from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise LintInputError(f"{path}: opset {opset} is not supported; Q/DQ with per-channel weights and TensorRT's ONNX "
                             f"parser need opset ≥ {MIN_OPSET} (re-export with opset_version={MIN_OPSET} or newer)")
    if opset > onnx.defs.onnx_opset_version():
        raise LintInputError(f"{path}: opset {opset} is newer than this onnx {onnx.__version__} knows "
                             f"(≤ {onnx.defs.onnx_opset_version()}); upgrade onnx")
    qop = sorted({n.op_type for n in model.graph.node if n.op_type in QOPERATOR_OPS})
    if qop:
        raise LintInputError(f"{path} is an ONNX Runtime QOperator model ({', '.join(qop)}): TensorRT reads only Q/DQ "
                             "(QuantizeLinear/DequantizeLinear) graphs; quantize with quant_format=QDQ")
    QdqGraph(model).ensure_node_names()
    g = QdqGraph(model)
    for node in g.qdq_nodes():
        scale = node.input[1] if len(node.input) > 1 else ""
        if not scale or (scale not in g.constants and scale not in g.producer and scale not in g.input_names):
            raise LintInputError(f"{path}: {node.op_type} '{node.name}' has no scale input"
                                 + (f" ('{scale}' is defined nowhere)" if scale else "") + "; the Q/DQ graph is broken")
    return model


def float_model_message(path, model: onnx.ModelProto) -> str:
    """What `qdeploy quantize` would do with a float model (the TensorRT placement's plan)."""
    from qdeploy.lint.placement import compute_nodes, conv_runs_int8_in_tensorrt

    g = QdqGraph(model)
    compute = compute_nodes(g)
    narrow = [n.name for n in compute if n.op_type == "Conv" and conv_runs_int8_in_tensorrt(g, n) is False]
    adds = g.residual_adds()
    with_conv = sum(g.residual_conv_input(a)[0] is not None for a in adds)
    return (f"{path} is a float model (no QuantizeLinear/DequantizeLinear nodes): there is nothing for TensorRT's explicit "
            f"quantization to read. `qdeploy quantize` with placement: tensorrt would put Q/DQ on the inputs and weights of "
            f"{len(compute) - len(narrow)} of {len(compute)} compute ops ({len(narrow)} too narrow for TensorRT's INT8 kernels), "
            f"on the skip input of {with_conv} residual Adds and on both inputs (one scale) of {len(adds) - with_conv} "
            "activation+activation Adds.")


def lint_model(model: onnx.ModelProto, file: str = "<model>") -> LintReport:
    t0 = time.perf_counter()
    g = QdqGraph(model)
    findings = run_rules(g)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: (order[f.severity], f.rule))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return LintReport(file, len(model.graph.node), opset, findings, qdq_structure(g), time_s=round(time.perf_counter() - t0, 3))


def lint_onnx(path, confirm: bool = True) -> LintReport:
    """Lint a Q/DQ ONNX file. A float model, or one that cannot be read, raises with a one-line reason."""
    t0 = time.perf_counter()
    model = load_qdq_model(path)
    if not QdqGraph(model).qdq_nodes():
        raise FloatModel(float_model_message(path, model))
    report = lint_model(model, str(path))
    if confirm:
        _confirm(report, Path(path))
    report.time_s = round(time.perf_counter() - t0, 3)
    return report


def _confirm(report: LintReport, path: Path) -> None:
    from qdeploy.lint.tensorrt_confirm import confirm_findings  # TensorRT itself is optional inside it

    result = confirm_findings(path, report.findings)
    report.by = result.get("by", "static analysis")
    report.tensorrt = result if result.get("tensorrt") else None


def structure_of(path) -> dict:
    """The Q/DQ structure (compute ops INT8, residual Add forms) of an ONNX file, without the findings."""
    return qdq_structure(QdqGraph(load_qdq_model(path)))


def fix_onnx(path, out_path, rules: Optional[set[str]] = None) -> LintReport:
    """Apply the safe fixes to a copy of ``path`` written atomically to ``out_path``; returns the new report."""
    from qdeploy.lint.fixes import apply_fixes
    from qdeploy.utils.atomic import atomic_path

    model = load_qdq_model(path)
    if not QdqGraph(model).qdq_nodes():
        raise FloatModel(float_model_message(path, model))
    applied = apply_fixes(model, rules)
    onnx.checker.check_model(model)
    with atomic_path(Path(out_path)) as tmp:
        onnx.save(model, str(tmp))
    report = lint_onnx(out_path)
    report.fixed = applied
    return report


__all__ = ["RULES", "Finding", "FloatModel", "LintInputError", "LintReport", "fix_onnx", "lint_model", "lint_onnx",
           "load_qdq_model", "qdq_structure", "structure_line", "structure_of"]
