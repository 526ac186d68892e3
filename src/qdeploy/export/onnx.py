"""PyTorch → ONNX export, verification in ONNX Runtime, and an on-disk export cache."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.transformers.float16 import convert_float_to_float16
from torch import nn

from qdeploy import __version__
from qdeploy.config import ExportSpec, ModelSpec, VerifySpec
from qdeploy.errors import ExportError, ModelError
from qdeploy.models.loader import model_fingerprint
from qdeploy.utils.cache import default_cache_dir
from qdeploy.utils.atomic import atomic_path, write_json
from qdeploy.utils.compare import compare_outputs
from qdeploy.utils.faults import kill_point
from qdeploy.utils.inputs import check_onnx_file
from qdeploy.utils.log import log

INPUT_NAME = "input"
OUTPUT_NAME = "output"


@dataclass
class OnnxArtifact:
    path: Path
    input_name: str
    output_name: str
    opset: int
    exporter: str  # torchscript | dynamo | user
    cached: bool = False
    verify: Optional[dict] = None
    fingerprint: Optional[str] = None

    @property
    def size_mb(self) -> float:
        return self.path.stat().st_size / 2**20

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        d["size_mb"] = round(self.size_mb, 3)
        return d


def export_fingerprint(spec: ModelSpec, export: ExportSpec, model: Optional[nn.Module] = None) -> str:
    """Hash of everything that changes the exported graph: the model (spec, weights, code), options, versions."""
    payload = {
        "model": model_fingerprint(spec, model),
        "export": export.model_dump(mode="json", exclude={"verify", "cache"}),
        "torch": torch.__version__,
        "qdeploy": __version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _safe_name(source: str) -> str:
    stem = source.rpartition(":")[2] or Path(source).stem
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:40] or "model"


def _dummy_input(spec: ModelSpec, batch: int = 2) -> torch.Tensor:
    # batch 2, not 1: some exporters specialise a size-1 dimension and lose the dynamic batch axis
    h, w = spec.preprocess.input_size
    return torch.randn(batch, spec.preprocess.channels, h, w)


def _export_torchscript(model: nn.Module, x: torch.Tensor, path: Path, export: ExportSpec) -> None:
    axes = {}
    if export.dynamic_batch:
        axes[0] = "batch"
    if export.dynamic_hw:
        axes.update({2: "height", 3: "width"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated in torch >= 2.9, still the most robust
        torch.onnx.export(
            model, (x,), str(path), dynamo=False, opset_version=export.opset,
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: axes, OUTPUT_NAME: {0: "batch"} if export.dynamic_batch else {}},
            do_constant_folding=True,
        )


def _export_dynamo(model: nn.Module, x: torch.Tensor, path: Path, export: ExportSpec) -> None:
    dims = {}
    if export.dynamic_batch:
        dims[0] = torch.export.Dim("batch", min=1, max=4096)
    if export.dynamic_hw:
        dims[2] = torch.export.Dim("height", min=8, max=8192)
        dims[3] = torch.export.Dim("width", min=8, max=8192)
    buf = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(
            model, (x,), dynamo=True, opset_version=export.opset, input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME], dynamic_shapes=({k: v for k, v in dims.items()},), verbose=False,
        )
        program.save(str(path), external_data=False)


def export_onnx(
    model: nn.Module,
    spec: ModelSpec,
    export: ExportSpec,
    verify_inputs: Optional[np.ndarray] = None,
    cache_dir: Optional[Path] = None,
) -> OnnxArtifact:
    """Export ``model`` to a single self-contained ONNX file, verify it, and cache it by fingerprint."""
    size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    if size > PROTOBUF_LIMIT:  # said before hashing and exporting: the exporters would fail minutes later on external data
        raise ExportError(f"{spec.source} has {size / 2**30:.2f} GiB of weights: above the 2 GiB protobuf limit of a "
                          "single ONNX file, and qdeploy keeps every model in one self-contained file (external-data "
                          "ONNX is not supported yet)")
    fingerprint = export_fingerprint(spec, export, model)
    cache_dir = Path(cache_dir or default_cache_dir()) / "exports"
    path = cache_dir / f"{_safe_name(spec.source)}-{fingerprint[:16]}.onnx"
    meta_path = path.with_suffix(".json")
    cached = export.cache and path.is_file() and meta_path.is_file()
    if cached:
        meta = json.loads(meta_path.read_text())
        log(f"export: cache hit {path}")
        artifact = OnnxArtifact(path, INPUT_NAME, OUTPUT_NAME, meta["opset"], meta["exporter"], True, None, fingerprint)
    else:
        artifact = _export_uncached(model, spec, export, path, fingerprint)
        if export.cache:
            write_json(meta_path, {"opset": artifact.opset, "exporter": artifact.exporter, "source": spec.source})
    kill_point("export")
    if verify_inputs is not None:
        artifact.verify = verify_onnx(model, artifact, verify_inputs, export.verify)
    return artifact


def _export_uncached(model, spec, export, path: Path, fingerprint: str) -> OnnxArtifact:
    order = {"auto": ["torchscript", "dynamo"], "torchscript": ["torchscript"], "dynamo": ["dynamo"]}[export.exporter]
    errors = []
    x = _dummy_input(spec)
    log(f"export: {spec.source} → ONNX (opset {export.opset}, dynamic batch={export.dynamic_batch}, dynamic H/W={export.dynamic_hw})")
    for name in order:
        try:
            with atomic_path(path) as tmp:  # renamed onto `path` only if every check below passes
                (_export_torchscript if name == "torchscript" else _export_dynamo)(model, x, tmp, export)
                proto = onnx.load(str(tmp), load_external_data=False)
                onnx.checker.check_model(proto)
                if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
                    raise ExportError("wrote external data; qdeploy needs one self-contained file")
                opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), export.opset)
        except ModelError:
            raise
        except Exception as e:
            # first line only, without the terminal colour codes the dynamo exporter puts in its messages
            first_line = re.sub(r"\x1b\[[0-9;]*m", "", (str(e).strip().splitlines() or [""])[0])
            errors.append(f"{name}: {type(e).__name__}: {first_line}")
            continue
        return OnnxArtifact(path, INPUT_NAME, OUTPUT_NAME, opset, name, False, None, fingerprint)
    raise ExportError(f"ONNX export of {spec.source} failed: " + " | ".join(errors))


# protobuf refuses to serialise a message above 2 GB: bigger models keep their weights in external data files
PROTOBUF_LIMIT = 2**31 - 2**24


def external_data_files(proto: "onnx.ModelProto", folder: Path) -> list[Path]:
    """The files an ONNX model keeps its tensors in (``location`` of each external tensor, relative to its folder)."""
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    names = {ExternalDataInfo(t).location for t in _get_all_tensors(proto) if uses_external_data(t)}
    return [folder / n for n in sorted(names)]


def use_onnx_file(source: str, cache_dir: Optional[Path] = None, decode: Optional[str] = None) -> OnnxArtifact:
    """Accept a user-supplied ONNX model: check it loads and has one input.

    ``decode`` is a detector's ``model.decode`` (None for other tasks): with ``onnx-nms`` the graph's NMS node is cut
    off into a cached copy (:mod:`qdeploy.tasks.detection_nms_graph`); a detector whose graph holds NMS under another
    decoder is refused with a message (its outputs are final detections, not a head a decoder reads).

    The user's file is only read. A model with external data (``model.onnx`` + ``model.onnx.data``, what
    ``torch.onnx.export`` writes above 2 GB and many hubs ship) is copied into the cache, self-contained where it fits
    protobuf's 2 GB (every tool downstream, and the copy in --out, then loads it alone), else with its data files beside
    it; every derived file (ONNX Runtime's pre-processed copy, FP16, INT8) is written next to that copy, in the cache."""
    path = Path(source).expanduser()
    check_onnx_file(path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        why = (str(e).splitlines() or [""])[0][:120]
        raise ModelError(f"ONNX model file {path} cannot be parsed ({type(e).__name__}{': ' + why if why else ''}): it is "
                         "not an ONNX protobuf or it is truncated; export it again (torch.onnx.export) or download it "
                         "again, and check it with python -c \"import onnx; onnx.checker.check_model('FILE')\"") from None
    if not proto.graph.node:
        raise ModelError(f"ONNX model file {path} holds no graph (0 nodes): it is not an ONNX model, or an empty one; "
                         "export it again")
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ModelError(f"ONNX model {path} has {len(inputs)} inputs {inputs}; qdeploy supports one image input")
    if not proto.graph.output:
        raise ModelError(f"ONNX model {path} has no outputs")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if decode is not None:
        from qdeploy.tasks.detection_nms_graph import graph_nms_of, no_nms_node

        graph_nms = graph_nms_of(path)
        if graph_nms is None and decode == "onnx-nms":
            raise no_nms_node(path)
        if graph_nms is not None and decode != "onnx-nms":
            raise ModelError(f"ONNX model {path} ends in {graph_nms.describe()}: its outputs are final detections, not a "
                             f"head for model.decode {decode}; set model.decode: onnx-nms (qdeploy then works on the "
                             "network up to that node and applies the same NMS itself)")
        if graph_nms is not None:
            cut = _nms_cut(path, graph_nms, cache_dir)
            if opset < QDQ_MIN_OPSET:
                return _opset_upgraded(cut.path, inputs[0], cut.output_name, opset, cache_dir)
            return cut
    data = external_data_files(proto, path.parent)
    outside = [d for d in data if not d.is_relative_to(path.parent) or ".." in d.relative_to(path.parent).parts]
    if outside:  # ONNX reads external data only from the model's folder (and below); copies of it must keep that layout
        raise ModelError(f"ONNX model {path} keeps its weights in {outside[0]}, outside its folder: put the external data "
                         "file(s) beside the .onnx file and save the model again with that location")
    missing = [d for d in data if not d.is_file()]
    if missing:
        raise ModelError(f"ONNX model {path} keeps its weights in {missing[0].relative_to(path.parent)}, which is not in "
                         f"{path.parent}: put the external data file(s) beside the .onnx file, under the name the model "
                         "gives them")
    if not data and opset < QDQ_MIN_OPSET:
        return _opset_upgraded(path, inputs[0], proto.graph.output[0].name, opset, cache_dir)
    if not data:
        return OnnxArtifact(path, inputs[0], proto.graph.output[0].name, opset, "user")
    digest = hashlib.sha256()
    for f in [path, *data]:
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                digest.update(chunk)
    fingerprint = digest.hexdigest()
    folder = Path(cache_dir or default_cache_dir()) / "sources" / f"{_safe_name(path.stem)}-{fingerprint[:16]}"
    copy = folder / f"{_safe_name(path.stem)}.onnx"
    if not copy.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        size = path.stat().st_size + sum(d.stat().st_size for d in data)
        if size < PROTOBUF_LIMIT:
            full = onnx.load(str(path))  # reads the external data
            with atomic_path(copy) as tmp:
                onnx.save_model(full, str(tmp), save_as_external_data=False)
            log(f"model: {path.name} keeps its weights in {', '.join(d.name for d in data)}: working from a self-contained "
                f"copy in the cache ({size / 2**20:.1f} MB)")
        else:
            import shutil

            for d in data:  # under the location the model reads them by (relative to its folder)
                target = folder / d.relative_to(path.parent)
                target.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(target) as tmp:
                    shutil.copyfile(d, tmp)
            with atomic_path(copy) as tmp:
                shutil.copyfile(path, tmp)
            log(f"model: {path.name} is {size / 2**30:.2f} GB with external data: working from a copy in the cache "
                "(its data files beside it)")
    return OnnxArtifact(copy, inputs[0], proto.graph.output[0].name, opset, "user", fingerprint=fingerprint)


# Q/DQ with per-channel weight scales (QuantizeLinear's axis) needs opset 13; so do TensorRT's explicit quantization and
# ONNX Runtime's QDQ quantizer. Detectors are often exported at opset 11 or 12 (FastestDet: 11; YOLOv5's default: 12).
QDQ_MIN_OPSET = 13


def _opset_upgraded(path: Path, input_name: str, output_name: str, opset: int, cache_dir: Optional[Path]) -> OnnxArtifact:
    """A user's ONNX below :data:`QDQ_MIN_OPSET` converted by onnx's own version converter into the cache (the user's
    file untouched), checked by onnx's checker and against the original in ONNX Runtime on one random input; a
    conversion that fails or changes the outputs is one ModelError naming both opsets."""
    from onnx import version_converter

    fingerprint = hashlib.sha256(path.read_bytes() + f"opset{QDQ_MIN_OPSET} onnx {onnx.__version__}".encode()).hexdigest()
    folder = Path(cache_dir or default_cache_dir()) / "sources" / f"{_safe_name(path.stem)}-{fingerprint[:16]}"
    copy = folder / f"{_safe_name(path.stem)}-opset{QDQ_MIN_OPSET}.onnx"
    if not copy.is_file():
        why = None
        try:
            converted = version_converter.convert_version(onnx.load(str(path)), QDQ_MIN_OPSET)
            onnx.checker.check_model(converted)
        except Exception as e:  # onnx's converter lacks an adapter for some op, or leaves an invalid graph
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        if why is None:
            a = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            b = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in a.get_inputs()[0].shape]
            x = np.random.default_rng(0).random(shape, dtype=np.float32)
            ya, yb = a.run(None, {input_name: x})[0], b.run(None, {input_name: x})[0]
            err = float(np.max(np.abs(ya - yb))) / max(float(np.max(np.abs(ya))), 1e-12) if ya.size else 0.0
            if ya.shape != yb.shape or err > 1e-5:
                why = f"its outputs differ from the original's (relative difference {err:.2g})"
        if why is not None:
            raise ModelError(f"ONNX model {path} is opset {opset}; INT8 Q/DQ needs opset {QDQ_MIN_OPSET} and onnx's "
                             f"version converter could not upgrade it ({why}): export it again with opset "
                             f"{QDQ_MIN_OPSET} or newer")
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(copy) as tmp:
            onnx.save_model(converted, str(tmp))
        log(f"model: {path.name} is opset {opset}: working from a copy converted to opset {QDQ_MIN_OPSET} by "
            "onnx.version_converter (outputs checked equal in ONNX Runtime)")
    return OnnxArtifact(copy, input_name, output_name, QDQ_MIN_OPSET, "user", fingerprint=fingerprint)


def _nms_cut(path: Path, graph_nms, cache_dir: Optional[Path]) -> OnnxArtifact:
    """The user's detector without its NMS node (:func:`qdeploy.tasks.detection_nms_graph.cut_at_nms`) in the cache,
    the user's file untouched; checked by onnx's checker and loaded by ONNX Runtime, whose output must be (N, A, 4 + C).
    """
    from qdeploy.tasks.detection_nms_graph import HEAD_OUTPUT, cut_at_nms

    fingerprint = hashlib.sha256(path.read_bytes() + b"nms-cut 1").hexdigest()
    folder = Path(cache_dir or default_cache_dir()) / "sources" / f"{_safe_name(path.stem)}-{fingerprint[:16]}"
    copy = folder / f"{_safe_name(path.stem)}-without-nms.onnx"
    if not copy.is_file():
        if external_data_files(onnx.load(str(path), load_external_data=False), path.parent):
            raise ModelError(f"ONNX model {path} keeps its weights in external data files and ends in "
                             f"{graph_nms.describe()}: save it self-contained (onnx.save_model(..., "
                             "save_as_external_data=False)) for qdeploy to cut its NMS off")
        proto = cut_at_nms(onnx.load(str(path)), graph_nms)
        try:
            onnx.checker.check_model(proto)
            sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ModelError(f"ONNX model {path}: the graph up to its {graph_nms.describe()} is not a valid model "
                             f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in sess.get_inputs()[0].shape]
        y = sess.run(None, {sess.get_inputs()[0].name: np.zeros(shape, np.float32)})[0]
        if y.ndim != 3 or y.shape[2] < 5:
            raise ModelError(f"ONNX model {path}: the inputs of its {graph_nms.describe()} join to shape {y.shape}, not "
                             "(N, boxes, 4 + classes)")
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(copy) as tmp:
            onnx.save_model(proto, str(tmp))
        log(f"model: {path.name} ends in {graph_nms.describe()}: working from a copy without it (output "
            f"{HEAD_OUTPUT} {tuple(y.shape)}: its boxes, then its {y.shape[2] - 4} class scores); the same NMS runs "
            "after every variant")
    saved = onnx.load(str(copy), load_external_data=False)
    opset = next((o.version for o in saved.opset_import if o.domain in ("", "ai.onnx")), 0)
    initializers = {t.name for t in saved.graph.initializer}
    inputs = [i.name for i in saved.graph.input if i.name not in initializers]
    return OnnxArtifact(copy, inputs[0], HEAD_OUTPUT, opset, "user", fingerprint=fingerprint)


def verify_onnx(model: nn.Module, artifact: OnnxArtifact, inputs: np.ndarray, spec: VerifySpec) -> dict:
    """Run the ONNX file in ONNX Runtime (CPU) on real images and compare with PyTorch FP32."""
    x = np.ascontiguousarray(inputs[: spec.samples], dtype=np.float32)
    with torch.inference_mode():
        ref = model(torch.from_numpy(x)).float().numpy()
    return verify_against(ref, x, artifact, spec, "PyTorch")


def verify_against(ref: np.ndarray, x: np.ndarray, artifact: OnnxArtifact, spec: VerifySpec, reference: str) -> dict:
    """ONNX Runtime (CPU) on ``x`` against ``reference``'s outputs ``ref`` on the same images (PyTorch, Keras):
    within export.verify's tolerances, or an ExportError naming the file."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(artifact.path), opts, providers=["CPUExecutionProvider"])
    fixed = sess.get_inputs()[0].shape[0]
    if isinstance(fixed, int) and fixed > 0 and len(x) % fixed:  # a fixed-batch export takes whole batches only
        x, ref = x[: len(x) - len(x) % fixed], ref[: len(x) - len(x) % fixed]
    step = fixed if isinstance(fixed, int) and fixed > 0 else len(x)
    got = np.concatenate([sess.run(None, {artifact.input_name: x[i:i + step]})[0] for i in range(0, len(x), step)])
    try:
        cmp = compare_outputs(got, ref)
    except ValueError:
        raise ExportError(f"ONNX output shape {got.shape} differs from {reference}'s {ref.shape} ({artifact.path})") from None
    diff, cos = cmp["max_abs_diff"], cmp["min_cosine"]
    limit = spec.atol + spec.rtol * cmp["max_abs_reference"]
    result = {"samples": len(x), "reference": reference, "max_abs_diff": diff, "tolerance": limit, "cosine": cos,
              "min_cosine": spec.min_cosine}
    # outputs no larger than the absolute tolerance have no direction worth comparing (rounding decides it): there the
    # absolute difference alone decides
    cosine_applies = cmp["max_abs_reference"] > spec.atol
    result["cosine_checked"] = cosine_applies
    diff_ok = bool(np.isfinite(diff) and diff <= limit)
    cos_ok = (not cosine_applies) or cos >= spec.min_cosine
    result["passed"] = diff_ok and cos_ok
    log(f"verify: ONNX Runtime vs {reference} on {len(x)} real images: max |diff| {diff:.3g} (tolerance {limit:.3g}), "
        f"min cosine {cos:.6f}" + ("" if cosine_applies else " (not checked: outputs within the absolute tolerance of 0)"))
    if not result["passed"]:
        failed = ([f"max |diff| {diff:.3g} > tolerance {limit:.3g}"] if not diff_ok else []) + \
                 ([f"min cosine {cos:.6f} < {spec.min_cosine}"] if not cos_ok else [])
        raise ExportError(f"ONNX export {artifact.path} does not match {reference}: {' and '.join(failed)} "
                          "(export.verify sets the tolerances)")
    return result


def convert_fp16(fp32_path: Path, out_path: Path) -> Path:
    """FP16 copy of an FP32 ONNX (FP32 inputs/outputs kept, so callers feed the same arrays)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True)
    with atomic_path(out_path) as tmp:
        onnx.save(proto, str(tmp))
    return Path(out_path)
