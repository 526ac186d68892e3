"""Keras / TensorFlow model → ONNX (tf2onnx), verified against Keras' own outputs on real images, cached.

A Keras source (``model.keras``, a legacy ``.h5``, a TensorFlow SavedModel folder) becomes one FP32 ONNX file, and from
there it is an ONNX model like any other: every engine, both INT8 placements, the lint and optimize read that file.

- **Converter:** tf2onnx on a ``tf.function`` of the model in inference mode. Keras 3's own
  ``model.export(format="onnx")`` calls the same tf2onnx function under the TensorFlow backend, with the same
  two defects this module repairs (below), so there is one TensorFlow path, not two.
- **Second route, only where tf2onnx cannot:** its ONNX is invalid (the checker, ONNX Runtime's load: Keras 3 compiles
  grouped convolutions, ConvNeXt's depthwise ones, with XLA on CPU and tf2onnx leaves that nested function as a
  ``StatefulPartitionedCall``; it has no ``Erfc`` for the exact GELU) or does not match Keras. Then Keras 3 under the
  torch backend, a torch module, is exported by torch.onnx (:mod:`qdeploy.export.keras_torch`, its own child process:
  the backend is chosen once per process), NCHW input as here, and verified against the same Keras (TensorFlow)
  outputs. The route, and why the first failed (one line), are recorded in the export's metadata, in
  ``OnnxArtifact.exporter`` (``tf2onnx`` or ``keras-torch/<exporter>``) and in its verification record; where neither
  route can, one error gives both reasons.
- **Layout, once:** Keras image models take NHWC. tf2onnx's ``inputs_as_nchw`` makes the ONNX input NCHW and its
  transpose optimizer pushes the layout change through the convolutions: the graph qdeploy quantizes has no
  Transpose left in a CNN, and the data pipeline feeds NCHW as for every other model. A model that already takes
  NCHW (``image_data_format="channels_first"``) is converted as it is.
- **Two repairs, both exact:** (1) tensors a Keras 3 layer computes once and captures as constants (the
  ``Normalization`` layer's mean and variance in keras.applications EfficientNet) come out of tf2onnx as extra graph
  *inputs*; they become initializers with the captured values. (2) tf2onnx folds BatchNorm into a regular Conv but
  leaves it as a per-channel Mul after a DepthwiseConv2D, and leaves explicit Pads before convs; ONNX Runtime's
  basic (standard-op, provider-independent) graph optimizations fold both into the Conv, so TensorRT's Conv+BN+act
  fusions and the Q/DQ placement rules see the same graph a PyTorch export gives.
- **Isolation:** TensorFlow runs in a child process (``python -m qdeploy.export.keras``), with no GPU visible to it:
  it never shares a process with PyTorch (importing both in either order has crashed) and it holds no GPU memory.
- **Verification:** the child also runs the Keras model on the run's real check images (also when tf2onnx fails, for
  the second route); ONNX Runtime must match within ``export.verify``'s tolerances
  (:func:`qdeploy.export.onnx.verify_against`), else the second route, else an ExportError.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from qdeploy import __version__
from qdeploy.config import ExportSpec, ModelSpec
from qdeploy.errors import ExportError, ModelError
from qdeploy.export.onnx import OnnxArtifact, _safe_name, verify_against
from qdeploy.utils.atomic import atomic_path, write_json
from qdeploy.utils.cache import default_cache_dir
from qdeploy.utils.hashing import sha256_file, sha256_json
from qdeploy.sysinfo import dist_version
from qdeploy.utils.log import log

KERAS_EXTRA = "pip install 'qdeploy[keras]'"
_TF_DISTS = ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-macos")


def keras_versions() -> dict:
    """Versions of the converter's pieces, read without importing TensorFlow (seconds and a GB of memory)."""
    tf = next((v for v in map(dist_version, _TF_DISTS) if v), None)
    return {"tensorflow": tf, "keras": dist_version("keras"), "tf2onnx": dist_version("tf2onnx")}


def keras_problem() -> Optional[str]:
    """None where Keras sources can be converted here, else one sentence saying what to install."""
    missing = [m for m in ("tensorflow", "keras", "tf2onnx") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed ({KERAS_EXTRA})"
    return None


def _source_digest(path: Path) -> str:
    """sha256 of a model file, or of a SavedModel folder's files (relative names and bytes)."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


class _ChildCrashed(ModelError):
    """The child process died without an answer (its last stderr line is the message)."""


_ROUTES = {  # route -> (module run as the child, its Keras backend, what the process is called in messages)
    "tf2onnx": ("qdeploy.export.keras", "tensorflow", "TensorFlow"),
    "keras-torch": ("qdeploy.export.keras_torch", "torch", "Keras torch-backend"),
}


def _run_child(request: dict, route: str = "tf2onnx") -> dict:
    """Run ``route``'s module in a fresh interpreter on ``request``: its JSON answer, or a ModelError with its reason
    (a _ChildCrashed with its last words where it died). The Keras backend is chosen once per process, at import."""
    module, backend, what = _ROUTES[route]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND=backend, CUDA_VISIBLE_DEVICES="-1",
               PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory(prefix="qdeploy-keras-") as tmp:
        req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req.write_text(json.dumps({**request, "answer": str(ans)}))
        proc = subprocess.run([sys.executable, "-m", module, str(req)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        answer = json.loads(ans.read_text()) if ans.is_file() else None
    if answer is None or proc.returncode != 0 and "error" not in answer:
        tail = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()][-1:] or [f"exit code {proc.returncode}"]
        raise _ChildCrashed(f"Keras model {request['source']}: the {what} process failed ({tail[0][:300]})")
    if "error" in answer:
        raise ModelError(f"Keras model {request['source']}: {answer['error']}")
    return answer


def _route_digest() -> str:
    """What the second route's output depends on besides the model: its code and torch's version."""
    return sha256_json({"code": sha256_file(Path(__file__).with_name("keras_torch.py")), "torch": dist_version("torch")})


def _verify(candidate: Path, meta: dict, ref: Optional[np.ndarray], x: Optional[np.ndarray], export: ExportSpec,
            exporter: str) -> Optional[dict]:
    """export.verify of ``candidate`` against Keras' outputs ``ref`` (None without check images); ExportError if off."""
    if x is None:
        return None
    art = OnnxArtifact(candidate, meta["input_name"], meta["output_name"], meta["opset"], exporter)
    return verify_against(ref, x, art, export.verify, "Keras")


def _mismatch(e: Exception) -> str:
    """An ExportError of verify_against as a short clause (the temporary file's name left out)."""
    m = re.search(r"does not match Keras: (.*?) \(export\.verify", str(e))
    return f"its ONNX does not match Keras ({m.group(1) if m else e})"


def export_keras(spec: ModelSpec, export: ExportSpec, verify_inputs: Optional[np.ndarray] = None,
                 cache_dir: Optional[Path] = None) -> OnnxArtifact:
    """The verified FP32 ONNX of the Keras model ``spec.source`` (NCHW input), converted once per model file.

    Route 1, tf2onnx under TensorFlow; where its ONNX is invalid or does not match Keras, route 2, Keras 3 under the
    torch backend exported by torch.onnx (:mod:`qdeploy.export.keras_torch`). Which route made the file, and why the
    first one failed, is in the cache's metadata, in ``artifact.exporter`` and in the verification record."""
    source = _checked_source(spec.source)
    pre = spec.preprocess
    versions = keras_versions()
    fingerprint = sha256_json({"source": _source_digest(source), "input": [pre.channels, *pre.input_size],
                               "output": spec.output, "opset": export.opset, "dynamic_batch": export.dynamic_batch,
                               "versions": versions, "qdeploy": __version__, "code": sha256_file(Path(__file__)),
                               "second_route": _route_digest()})
    folder = Path(cache_dir or default_cache_dir()) / "exports"
    path = folder / f"{_safe_name(source.name)}-{fingerprint[:16]}.onnx"
    meta_path = path.with_suffix(".json")
    request = {"source": str(source), "channels": pre.channels, "size": list(pre.input_size), "output": spec.output,
               "opset": export.opset, "dynamic_batch": export.dynamic_batch}
    cached = export.cache and path.is_file() and meta_path.is_file()
    meta: dict = {}
    if cached:
        meta = json.loads(meta_path.read_text())
        log(f"export: cache hit {path}")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        log(f"export: {source.name} → ONNX with tf2onnx {versions['tf2onnx']} (TensorFlow {versions['tensorflow']}, "
            f"Keras {versions['keras']}, opset {export.opset}) in a TensorFlow process")
    x = None if verify_inputs is None else np.ascontiguousarray(verify_inputs[: export.verify.samples], dtype=np.float32)
    ref_path = None if x is None else \
        path.with_name(f"{path.stem}.keras-ref-{hashlib.sha256(x.tobytes()).hexdigest()[:16]}.npy")
    need_ref = ref_path is not None and not ref_path.is_file()
    with tempfile.TemporaryDirectory(prefix="qdeploy-keras-") as tmp:
        tmp = Path(tmp)
        first_failed: Optional[str] = None  # why route 1 cannot, one line
        candidate: Optional[Path] = path if cached else None
        if not cached or need_ref:  # one TensorFlow process converts and/or computes Keras' outputs on the check images
            converted, converted_meta, first_failed = _first_route(request, tmp, cached, x, ref_path, need_ref)
            if converted is not None:
                candidate, meta = converted, converted_meta
        ref = None if x is None else np.load(ref_path)
        verify = None
        if candidate is not None:
            try:
                verify = _verify(candidate, meta, ref, x, export, meta.get("exporter", "tf2onnx"))
            except ExportError as e:
                if meta.get("route", "tf2onnx") != "tf2onnx":
                    raise
                first_failed, candidate = _mismatch(e), None
        if candidate is None:  # route 2: Keras 3 under the torch backend, exported by torch.onnx
            candidate, meta, verify = _second_route(request, tmp, source, first_failed, versions["keras"], ref, x, export)
        if candidate != path:
            with atomic_path(path) as t:
                shutil.copyfile(candidate, t)
            write_json(meta_path, meta)
    artifact = OnnxArtifact(path, meta["input_name"], meta["output_name"], meta["opset"], meta.get("exporter", "tf2onnx"),
                            cached, None, fingerprint)
    if verify is not None:
        # the route is recorded where the run's results keep the export's verification
        verify.update(route=meta.get("route", "tf2onnx"), exporter=artifact.exporter)
        if meta.get("first_route_failed"):
            verify["first_route_failed"] = meta["first_route_failed"]
        artifact.verify = verify
    return artifact


def _checked_source(source) -> Path:
    """``model.source`` as a path to a Keras model qdeploy can convert here (ModelError otherwise)."""
    source = Path(source).expanduser()
    if not source.exists():
        raise ModelError(f"Keras model {source} does not exist")
    if source.is_dir() and not (source / "saved_model.pb").is_file():
        raise ModelError(f"{source} is a folder without saved_model.pb: give a SavedModel folder, a .keras or a .h5 file")
    problem = keras_problem()
    if problem:
        raise ModelError(f"model.source {source} is a Keras model, which needs TensorFlow: {problem}")
    return source


_META_KEYS = ("input_name", "output_name", "opset", "layout", "input_shape", "repairs")


def _first_route(request: dict, tmp: Path, cached: bool, x: Optional[np.ndarray], ref_path: Optional[Path],
                 need_ref: bool) -> tuple[Optional[Path], dict, Optional[str]]:
    """Route 1, in one TensorFlow process: convert with tf2onnx (unless ``cached``) and, where ``need_ref``, compute
    Keras' outputs on the check images ``x`` into ``ref_path``. Returns (the converted ONNX in ``tmp`` or None, its
    metadata, why route 1 cannot convert: None when it could or was not asked to)."""
    first_failed = None
    job = {**request, "mode": "predict" if cached else "convert", "onnx": str(tmp / "model.onnx")}
    if need_ref:
        np.save(tmp / "x.npy", x)
        job.update(inputs=str(tmp / "x.npy"), outputs=str(tmp / "y.npy"))
    try:
        answer = _run_child(job)
    except _ChildCrashed as e:
        if cached:
            raise
        # died converting (tf2onnx, ONNX Runtime): Keras' own outputs in a process that only predicts
        first_failed = str(e).split(": ", 1)[-1]
        answer = _run_child({**job, "mode": "predict"}) if need_ref else {}
    if need_ref:
        with atomic_path(ref_path) as t, open(t, "wb") as f:
            np.save(f, np.load(tmp / "y.npy"))
    if cached or first_failed is not None:
        return None, {}, first_failed
    if "route_failed" in answer:
        return None, {}, answer["route_failed"]
    meta = {k: answer[k] for k in _META_KEYS}
    meta.update(route="tf2onnx", exporter="tf2onnx")
    log(f"export: Keras input {meta['input_shape']} ({meta['layout']}); ONNX input NCHW; " + "; ".join(meta["repairs"]))
    return tmp / "model.onnx", meta, None


def _second_route(request: dict, tmp: Path, source: Path, first_failed: str, keras_version: str,
                  ref: Optional[np.ndarray], x: Optional[np.ndarray], export: ExportSpec) -> tuple[Path, dict, Optional[dict]]:
    """Route 2: Keras 3 under the torch backend, exported by torch.onnx in a torch process, and verified. Returns (the
    ONNX in ``tmp``, its metadata, the verification record); ModelError/ExportError naming both routes' failures."""
    log(f"export: {first_failed}; second route: Keras {keras_version} under the torch backend → torch.onnx "
        f"(TorchScript, then dynamo) in a torch process")

    def neither(reason: str, error=ModelError):
        first = first_failed.removeprefix("tf2onnx ")
        return error(f"Keras model {source} converts by neither route: tf2onnx: {first}; Keras under the "
                     f"torch backend → torch.onnx: {reason}")

    if source.is_dir():
        raise neither("a SavedModel folder is a TensorFlow graph, which Keras under the torch backend cannot load "
                      "(give the .keras or .h5 file)")
    try:
        answer = _run_child({**request, "onnx": str(tmp / "torch.onnx")}, "keras-torch")
    except ModelError as e:
        raise neither(str(e).split(f"{source}: ", 1)[-1]) from None
    candidate = tmp / "torch.onnx"
    meta = {k: answer[k] for k in _META_KEYS}
    meta.update(route="keras-torch", exporter=f"keras-torch/{answer['exporter']}", first_route_failed=first_failed,
                tried=answer["tried"])
    log(f"export: {meta['exporter']} exported it" + (f" ({'; '.join(answer['tried'])})" if answer["tried"] else "")
        + f"; Keras input {meta['input_shape']} ({meta['layout']}); ONNX input NCHW; " + "; ".join(meta["repairs"]))
    try:
        verify = _verify(candidate, meta, ref, x, export, meta["exporter"])
    except ExportError as e:
        raise neither(_mismatch(e), ExportError) from None
    return candidate, meta, verify


# ---------------------------------------------------------------------------------------------------- child process
def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:240]}"


class _Refused(Exception):
    """A user-facing reason the child gives back (the parent raises it as a ModelError)."""


class _RouteFailed(Exception):
    """tf2onnx cannot convert this model (the parent then takes the second route, :mod:`qdeploy.export.keras_torch`)."""


def _select(out, key, names: list):
    """One output tensor of a Keras call (tensor, list/tuple or dict), like models.loader.SelectOutput."""
    if isinstance(out, dict):
        if key is None:
            if len(out) == 1:
                return next(iter(out.values()))
            raise _Refused(f"the model has outputs {sorted(out)}: set model.output to one of them")
        if key not in out:
            raise _Refused(f"model.output '{key}' is not among the model's outputs {sorted(out)}")
        return out[key]
    if isinstance(out, (list, tuple)):
        if len(out) == 1 and key in (None, 0, -1):
            return out[0]
        if isinstance(key, str) and key in names:
            return out[names.index(key)]
        if not isinstance(key, int) or not -len(out) <= key < len(out):
            raise _Refused(f"the model has {len(out)} outputs {names}: set model.output to an index or one of the names")
        return out[key]
    return out


def _load(source: Path):
    """(callable in inference mode, input shape, output names) of a .keras/.h5 file or a SavedModel folder."""
    import tensorflow as tf

    if source.is_dir():
        loaded = tf.saved_model.load(str(source))
        sig = loaded.signatures.get("serving_default")
        if sig is None:
            raise _Refused(f"the SavedModel has no serving_default signature (it has {sorted(loaded.signatures)})")
        _, kwargs = sig.structured_input_signature
        if len(kwargs) != 1:
            raise _Refused(f"the serving signature takes {len(kwargs)} inputs {sorted(kwargs)}; qdeploy feeds one image input")
        (name, spec), = kwargs.items()
        if spec.dtype != tf.float32:
            raise _Refused(f"the serving input '{name}' is {spec.dtype.name}; qdeploy feeds float32 images")
        outputs = sorted(sig.structured_outputs)
        return (lambda x: sig(**{name: x})), tuple(spec.shape.as_list()), outputs, (loaded, sig)
    import keras

    if keras.config.backend() != "tensorflow":
        raise _Refused(f"Keras runs on the {keras.config.backend()} backend here; the conversion needs TensorFlow")
    try:
        model = keras.models.load_model(str(source), compile=False)
    except Exception as e:
        raise _Refused(f"Keras cannot load it ({_first_line(e)})") from None
    if len(model.inputs) != 1:
        raise _Refused(f"the model takes {len(model.inputs)} inputs; qdeploy feeds one image input")
    if str(model.inputs[0].dtype) not in ("float32", "<dtype: 'float32'>"):
        raise _Refused(f"the model's input is {model.inputs[0].dtype}; qdeploy feeds float32 images")
    names = [getattr(t, "name", str(i)) for i, t in enumerate(model.outputs)]
    return (lambda x: model(x, training=False)), tuple(model.inputs[0].shape), names, model


def _layout(shape: tuple, channels: int, size: tuple[int, int]) -> str:
    """'NHWC' or 'NCHW' for the model's input shape, checked against preprocess.input_size and its channels."""
    if len(shape) != 4:
        raise _Refused(f"the model's input shape is {list(shape)}; qdeploy feeds images (N, H, W, C)")
    h, w = size

    def fits(dims, want):
        return all(d is None or d == t for d, t in zip(dims, want))

    if fits(shape[1:], (h, w, channels)):
        return "NHWC"
    if fits(shape[1:], (channels, h, w)):
        return "NCHW"
    raise _Refused(f"the model's input shape {list(shape)} does not take {channels}-channel {h}x{w} images: set "
                   "model.preprocess.input_size (and mode) to what the model was trained on")


def _strip_unused_domains(proto) -> None:
    used = {n.domain for n in proto.graph.node} | {""}
    keep = [o for o in proto.opset_import if o.domain in used or o.domain == "ai.onnx"]
    del proto.opset_import[:]
    proto.opset_import.extend(keep)


def _ort_basic(proto) -> tuple:
    """(2) ONNX Runtime's basic optimizations: standard ONNX ops only, for every execution provider (constant folding,
    Conv+Mul / Conv+Add / Pad+Conv fusion, transpose cancelling); the optimized file is what TensorRT and the
    quantizers read. (optimized proto, one note); _RouteFailed where non-standard ops are left."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="qdeploy-keras-") as tmp:
        raw, optimized = Path(tmp) / "raw.onnx", Path(tmp) / "optimized.onnx"
        onnx.save(proto, str(raw))
        before = len(proto.graph.node)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = str(optimized)
        opts.log_severity_level = 3
        ort.InferenceSession(str(raw), opts, providers=["CPUExecutionProvider"])
        proto = onnx.load(str(optimized))
    _strip_unused_domains(proto)
    if any(n.domain not in ("", "ai.onnx") for n in proto.graph.node):
        raise _RouteFailed("ONNX Runtime's basic optimizations left non-standard ops: " +
                           ", ".join(sorted({f"{n.domain}.{n.op_type}" for n in proto.graph.node if n.domain not in ("", "ai.onnx")})))
    return proto, [f"{before - len(proto.graph.node)} node(s) folded (BatchNorm scales and Pads into Convs, constants)"]


def _convert(req: dict) -> dict:
    import onnx
    import tensorflow as tf
    import tf2onnx
    from onnx import numpy_helper

    source = Path(req["source"])
    call, shape, names, _keep = _load(source)
    layout = _layout(shape, req["channels"], tuple(req["size"]))
    h, w = req["size"]
    c = req["channels"]
    spec = tf.TensorSpec((None, h, w, c) if layout == "NHWC" else (None, c, h, w), tf.float32, name="input")
    key = req["output"]

    @tf.function
    def fn(x):
        return _select(call(x), key, names)

    concrete = fn.get_concrete_function(spec)
    # (1) constants captured by value (not variables, which tf2onnx freezes): they would become graph inputs
    captured = {inner.name: outer for outer, inner in concrete.graph.captures if outer.dtype != tf.resource}
    try:
        proto, _ = tf2onnx.convert.from_function(fn, input_signature=(spec,), opset=req["opset"],
                                                 inputs_as_nchw=["input"] if layout == "NHWC" else None)
    except Exception as e:
        raise _RouteFailed(f"tf2onnx cannot convert it ({_first_line(e)})") from None
    unknown = [n for n in proto.graph.node if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)]
    if unknown:  # e.g. the nested XLA function Keras 3 compiles a grouped convolution into, on CPU
        kinds = sorted({n.op_type for n in unknown})
        raise _RouteFailed(f"tf2onnx left {len(unknown)} TensorFlow op(s) unconverted ({', '.join(kinds)}, first "
                           f"{unknown[0].name}): not a valid ONNX")
    repairs = []
    for graph_input in list(proto.graph.input):
        if graph_input.name in captured:
            proto.graph.initializer.append(numpy_helper.from_array(np.asarray(captured[graph_input.name].numpy()),
                                                                   graph_input.name))
            proto.graph.input.remove(graph_input)
            repairs.append(graph_input.name)
    inputs = [i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    if len(inputs) != 1:
        raise _RouteFailed(f"the converted graph has inputs {inputs}; expected one image input")
    notes = [f"{len(repairs)} captured constant(s) made initializers"] if repairs else []
    try:
        proto, folded = _ort_basic(proto)
        onnx.checker.check_model(proto)
    except _RouteFailed:
        raise
    except Exception as e:
        raise _RouteFailed(f"its ONNX is not valid ({_first_line(e)})") from None
    onnx.save(proto, req["onnx"])
    notes += folded
    return {"input_name": proto.graph.input[0].name, "output_name": proto.graph.output[0].name,
            "opset": next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), req["opset"]),
            "layout": layout, "input_shape": [None if d is None else int(d) for d in shape], "repairs": notes}


def _predict(req: dict) -> dict:
    """Keras' own outputs on the parent's NCHW float32 images (transposed to the model's layout)."""
    call, shape, names, _keep = _load(Path(req["source"]))
    layout = _layout(shape, req["channels"], tuple(req["size"]))
    x = np.load(req["inputs"])
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    outs = [np.asarray(_select(call(x[i:i + 32]), req["output"], names)) for i in range(0, len(x), 32)]
    np.save(req["outputs"], np.concatenate(outs).astype(np.float32))
    return {"samples": len(x)}


def _child_main(request_file: str) -> int:
    req = json.loads(Path(request_file).read_text())
    try:
        answer = {}
        if req["mode"] == "convert":
            try:
                answer = _convert(req)
            except _RouteFailed as e:  # Keras' outputs are still computed: the second route is checked against them
                answer = {"route_failed": str(e)}
        if "inputs" in req:
            answer.update(_predict(req))
    except _Refused as e:
        answer = {"error": str(e)}
    except ImportError as e:
        answer = {"error": f"{_first_line(e)} ({KERAS_EXTRA})"}
    Path(req["answer"]).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
