"""Confirm (or refute) lint findings from a real TensorRT engine: build it, read the engine inspector.

Where ``tensorrt`` imports, :func:`confirm_findings` builds an engine from the Q/DQ ONNX with Polygraphy's
loaders, reads ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)`` (profiling verbosity
DETAILED: fused layers, the ONNX nodes in each, tensor formats/precisions) and writes one sentence per
finding into ``Finding.confirmed``; the report then says "confirmed by TensorRT X.Y". Without TensorRT, or
when the build fails, it says "static analysis" and leaves the findings alone.

Two build paths, chosen by the version string: TensorRT 10.x (Q/DQ INT8 needs ``BuilderFlag.INT8``; FP16 is
allowed too so float layers may pick FP16) and TensorRT 11.x (strongly typed networks, no precision flags:
float layers keep the ONNX's float type). Other versions are not attempted.

What ran where: nothing in this module has run against a real TensorRT (docs/tensorrt.md keeps that list). The
TensorRT names it touches, its own and those Polygraphy 0.53.6 touches for it,
are listed in ``TRT_NAMES_USED`` and checked by tests/test_lint_tensorrt.py against the API surfaces dumped
from the 10.3.0, 10.16.1 and 11.4.0 Python bindings (API conformance only). The inspector's JSON layout
(``Layers``, ``Name``, ``LayerType``/``ParameterType``, ``Metadata`` "[ONNX Layer: …]", ``Inputs``/
``Outputs`` with ``Format/Datatype``) follows NVIDIA's trt-engine-explorer parser, not an engine seen here.
"""
from __future__ import annotations

import json
import re

import onnx

from qdeploy.lint.placement import COMPUTE_OPS, compute_nodes  # noqa: F401 (the one compute-op list, re-exported)
from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.facts.tensorrt import NAMES_USED, tensorrt_version  # noqa: F401 (tensorrt_version: re-exported)

# Path "10": TensorRT 10.x; path "11": TensorRT 11.x (declared with the other TensorRT facts)
TRT_NAMES_USED = NAMES_USED["lint_confirm"]
# Checked in this order: BF16 before Half/Float, UInt8 before Int8. Covers "Int8"/"Half"/"Float" (kgen names),
# "FP16"/"FP32"/"INT8" inside long format strings ("Channel major FP16 format where channel % 8 == 0").
_PRECISIONS = [("UInt8", r"uint8"), ("BF16", r"bf16|bfloat16"), ("Half", r"fp16|half"), ("Float", r"fp32|float"),
               ("FP8", r"fp8"), ("FP4", r"fp4"), ("Int8", r"int8"), ("Int4", r"int4"), ("Int32", r"int32"),
               ("Int64", r"int64"), ("Bool", r"bool")]
_REFORMAT = re.compile(r"reformat|scale|quantiz", re.I)  # layer types of requantize/reformat kernels


def precision_of(fmt: str) -> str:
    """"Int8" / "Half" / "Float" / "BF16" / ... from an inspector "Format/Datatype" string; "Unknown" else."""
    for name, pat in _PRECISIONS:
        if re.search(rf"(?<![a-z0-9])(?:{pat})(?![0-9a-z])", fmt or "", re.I):
            return name
    return "Unknown"


def split_layer_name(name: str) -> list[str]:
    """ONNX node names in a fused layer name: "a + b", "PWN(PWN(a), b)"; engine-made suffixes kept."""
    parts = re.split(r" \+ |, |PWN\(|\)", name)
    return [p.strip() for p in parts if p.strip()]


def profile_shapes(onnx_path, batch: int = 1) -> dict[str, list[int]]:
    """{input: shape} for ONNX inputs whose batch dim (only) is symbolic: min = opt = max = ``batch``."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for inp in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in inp.type.tensor_type.shape.dim]
        if inp.name not in inits and dims and dims[0] is None and None not in dims[1:]:
            out[inp.name] = [batch] + dims[1:]
    return out  # other symbolic dims: Polygraphy's default profile (1) fills them


def _tensor_info(tensors) -> tuple[list[str], list[str], list[str]]:
    names, raw = [], []
    for t in tensors or []:
        t = t if isinstance(t, dict) else {"Name": str(t)}
        names.append(str(t.get("Name", "")))
        raw.append(str(t.get("Format/Datatype") or " ".join(str(v) for k, v in t.items() if "Format" in k or "Type" in k)))
    return names, raw, [precision_of(r) for r in raw]


def parse_engine_information(text: str) -> list[dict]:
    """Normalise the inspector's JSON (a dict with "Layers", or a list) into one dict per engine layer."""
    data = json.loads(text)
    layers = data.get("Layers", []) if isinstance(data, dict) else data
    out = []
    for layer in layers:
        layer = layer if isinstance(layer, dict) else {"Name": str(layer)}  # LAYER_NAMES_ONLY: names only
        name = str(layer.get("Name", ""))
        meta = re.findall(r"\[ONNX Layer: ([^\]\x1e\x1f]*)\]", str(layer.get("Metadata", "")))
        nodes = list(dict.fromkeys(meta + split_layer_name(name)))
        in_names, in_raw, in_prec = _tensor_info(layer.get("Inputs"))
        out_names, out_raw, out_prec = _tensor_info(layer.get("Outputs"))
        out.append({"name": name, "type": layer.get("ParameterType") or layer.get("LayerType"), "onnx_nodes": nodes,
                    "input_precisions": in_prec, "output_precisions": out_prec, "input_formats": in_raw,
                    "output_formats": out_raw, "inputs": in_names, "outputs": out_names})
    return out


def inspect_engine_layers(onnx_path, batch: int = 1) -> list[dict]:
    """Build an engine from the Q/DQ ONNX (TensorRT 10.x or 11.x) and return its layers (see parse_engine_information)."""
    import tensorrt as trt
    from polygraphy.backend.trt import CreateConfig, NetworkFromOnnxPath, Profile, engine_from_network
    from polygraphy.logger import G_LOGGER

    major = int(str(trt.__version__).split(".")[0])
    if major not in (10, 11):
        raise RuntimeError(f"TensorRT {trt.__version__} is not supported here (10.x or 11.x)")
    shapes = profile_shapes(onnx_path, batch)
    profiles = [Profile()] if shapes else None
    for name, shape in shapes.items():
        profiles[0].add(name, shape, shape, shape)
    verbosity = trt.ProfilingVerbosity.DETAILED
    if major == 10:  # implicit-precision builder: Q/DQ layers run INT8 only with the INT8 flag; FP16 allowed
        network = NetworkFromOnnxPath(str(onnx_path))
        config = CreateConfig(int8=True, fp16=True, profiles=profiles, profiling_verbosity=verbosity)
    else:  # 11.x: strongly typed, no precision flags
        network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
        config = CreateConfig(profiles=profiles, profiling_verbosity=verbosity)
    with G_LOGGER.verbosity(G_LOGGER.ERROR):
        engine = engine_from_network(network, config=config)
    inspector = engine.create_engine_inspector()
    return parse_engine_information(inspector.get_engine_information(trt.LayerInformationFormat.JSON))


def _prec(layer: dict) -> str:
    return (layer["input_precisions"] or layer["output_precisions"] or ["Unknown"])[0]


def _describe(layers: list[dict]) -> str:
    return ", ".join(f"'{l['name']}' ({_prec(l)})" for l in layers)


def _judge(rule: str, nodes: list[str], where: dict[str, list[int]], layers: list[dict]) -> str:
    found = {n: where.get(n, []) for n in nodes}
    missing = [n for n, ix in found.items() if not ix]
    first, last = (found[nodes[0]], found[nodes[-1]]) if nodes else ([], [])
    if rule in ("QD001", "QD006", "QD007") and len(nodes) >= 2:
        # QD001 lists [add, conv]; QD006 [conv, act]; QD007 [conv, gate, mul]
        if set(first) & set(last):
            return f"refuted: TensorRT fused them anyway ({_describe([layers[i] for i in set(first) & set(last)])})"
        if first and last:
            return f"confirmed: separate layers {_describe([layers[i] for i in first])} and {_describe([layers[i] for i in last])}"
    elif rule in ("QD010", "QD011") and nodes and first:
        precs = {_prec(layers[i]) for i in first}
        verdict = "refuted: TensorRT runs it in Int8" if precs == {"Int8"} else "confirmed: runs in " + "/".join(sorted(precs))
        return f"{verdict} ({_describe([layers[i] for i in first])})"
    elif rule in ("QD004", "QD005") and nodes:
        mine = set(first)
        tensors = {t for i in mine for t in layers[i]["inputs"] + layers[i]["outputs"]}
        near = [l for i, l in enumerate(layers) if i not in mine
                and (_REFORMAT.search(str(l["type"])) or l["name"].startswith("Reformatting"))
                and (tensors & set(l["inputs"] + l["outputs"]) or nodes[0] in l["name"])]
        if near:
            return f"confirmed: reformat/scale layer(s) next to it: {_describe(near)}"
        if mine:
            return f"refuted: no reformat or scale layer next to {_describe([layers[i] for i in mine])}"
    elif any(found.values()):
        seen = "; ".join(f"{n} in {_describe([layers[i] for i in ix])}" for n, ix in found.items() if ix)
        return f"observed: {seen}" + (f"; in no layer: {', '.join(missing)}" if missing else "")
    return f"not decided: {', '.join(missing) or 'its nodes'} not found in any engine layer (fused away or renamed)"


def confirm_findings(onnx_path, findings: list, structure: QdqGraph | None = None, batch: int = 1) -> dict:
    """Set ``finding.confirmed`` from a built engine; return who confirmed, and a layer-precision summary.

    ``structure`` is the QdqGraph of ``onnx_path`` when the caller has one (the lint's), else it is loaded.
    Returns {"by": "static analysis", "tensorrt": None} without TensorRT (findings untouched);
    {"by": "static analysis (TensorRT X.Y build failed: …)", "tensorrt": "X.Y.Z", "error": …} on any failure;
    else {"by": "TensorRT X.Y", "tensorrt": "X.Y.Z", "layers": {"total", "Int8", "Half", "Float", "other"},
    "float_compute_nodes": [...], "unmatched_compute_nodes": [...]}.
    """
    version = tensorrt_version()
    if version is None:
        return {"by": "static analysis", "tensorrt": None}
    short = ".".join(version.split(".")[:2])
    try:
        layers = inspect_engine_layers(onnx_path, batch)
        g = structure if structure is not None else QdqGraph.load(onnx_path)
    except Exception as e:  # never raise, never pretend
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return {"by": f"static analysis (TensorRT {short} build failed: {line})", "tensorrt": version, "error": line}
    where: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        for n in layer["onnx_nodes"]:
            where.setdefault(n, []).append(i)
    for f in findings:
        f.confirmed = _judge(f.rule, [n for n in f.nodes if not n.startswith("... ")], where, layers)
    summary = {"total": len(layers), "Int8": 0, "Half": 0, "Float": 0, "other": 0}
    for layer in layers:
        p = _prec(layer)
        summary[p if p in summary else "other"] += 1
    compute = [n.name or n.output[0] for n in compute_nodes(g)]
    return {"by": f"TensorRT {short}", "tensorrt": version, "layers": summary,
            "float_compute_nodes": [n for n in compute if n in where and any(_prec(layers[i]) != "Int8" for i in where[n])],
            "unmatched_compute_nodes": [n for n in compute if n not in where]}
