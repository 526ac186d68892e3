"""Build stage: every artifact a run needs, each built once, cached on disk by fingerprint.

Recipes by kind (one place each):
  PYTORCH     models.build_torch_model (weights checked key by key)
  ONNX_FP32   export.export_onnx (verified against PyTorch on real images) or the user's .onnx
  ONNX_FP16   export.convert_fp16 of ONNX_FP32
  ONNX_FP16_CALIBRATED  export.fp16.convert_fp16_calibrated of ONNX_FP32 on data.calibration (TensorRT 11's FP16)
  ONNX_INT8   quantize.quantize(ONNX_FP32 / the PyTorch model, Int8Config) + TensorRT calibration cache
  OPENVINO_IR       export.openvino_ir.convert_fp32 of ONNX_FP32 (or of the PyTorch module, where faster)
  OPENVINO_IR_INT8  quantize.nncf_quantizer.quantize_openvino_ir (NNCF's OpenVINO backend) of ONNX_FP32's ov.Model

Engines never build: they get the :class:`Artifact` this stage made and only load it.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

import qdeploy
from qdeploy import __version__
from qdeploy.artifacts.types import Artifact, ArtifactKind, ArtifactRequest
from qdeploy.config import Int8Config, RunConfig, source_format
from qdeploy.errors import DataError, ModelError
from qdeploy.export import convert_fp16, export_onnx, use_onnx_file
from qdeploy.models import build_torch_model, is_keras_source, model_fingerprint, resolve_weights_path
from qdeploy.quantize import QuantizeInputs, quantize
from qdeploy.utils.atomic import write_json
from qdeploy.utils.cache import default_cache_dir
from qdeploy.facts.onnxruntime import u8s8_saturates
from qdeploy.utils.hashing import sha256_file, sha256_json, source_fingerprint
from qdeploy.sysinfo import dist_version
from qdeploy.utils.log import log

# Code that shapes an INT8 artifact: a cached one built by other code is stale.
# the code an INT8 artifact depends on: the quantizers, and the placement rules and fixes they read (lint/)
_QUANTIZE_CODE = (Path(qdeploy.__file__).parent / "quantize", Path(qdeploy.__file__).parent / "lint",
                  Path(qdeploy.__file__).parent / "facts")


@functools.lru_cache(maxsize=1)
def _quantize_code_fingerprint() -> str:
    return source_fingerprint(*_QUANTIZE_CODE)  # read once per process, not once per INT8 variant


@functools.lru_cache(maxsize=1)
def _ir_code_fingerprint() -> str:
    """The code that converts a model to OpenVINO IR (read once per process)."""
    return source_fingerprint(Path(qdeploy.__file__).parent / "export" / "openvino_ir.py")


def dataset_identity(batches) -> dict:
    """The exact images a data set holds (paths and sizes, in order), not just its folder name."""
    samples = [str(s[0]) for s in getattr(batches.dataset, "samples", [])]
    sizes = [os.path.getsize(p) if os.path.exists(p) else -1 for p in samples]
    return {"count": batches.num_samples, "samples": sha256_json([samples, sizes])}


class Builder:
    """Builds the artifacts of one run. ``calibration``: the Batches of data.calibration (or None);
    ``check_inputs``: a loader of real preprocessed images for export checks."""

    def __init__(self, cfg: RunConfig, cache_dir: Optional[Path] = None, calibration=None,
                 check_inputs: Optional[Callable[[], np.ndarray]] = None):
        self.cfg = cfg
        self.spec = cfg.model
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.calibration = calibration
        self._check_inputs = check_inputs
        self._check_cache: Optional[np.ndarray] = None
        self._torch: Optional[nn.Module] = None
        self._trainable: Optional[nn.Module] = None
        self._built: dict[str, Artifact] = {}
        self.memo: dict = {}  # statistics passes shared by the INT8 artifacts of this run

    # ---------------------------------------------------------------- inputs
    @property
    def has_torch(self) -> bool:
        """The source is a PyTorch model (not an ONNX file or a Keras model)."""
        return source_format(self.spec.source) == "pytorch"

    def torch_model(self) -> nn.Module:
        """The FP32 CPU reference module (engines copy it before changing device or dtype)."""
        if not self.has_torch:
            raise ModelError(f"model source {self.spec.source} is an ONNX or Keras model: there is no PyTorch model")
        if self._torch is None:
            self._torch = build_torch_model(self.spec)
        return self._torch

    def trainable_model(self) -> nn.Module:
        """What QAT fine-tunes: the PyTorch model, or for an ONNX or Keras source its FP32 ONNX as a PyTorch module
        (export/onnx_to_torch.py: onnx2torch, checked equal to ONNX Runtime on the run's real images)."""
        if self.has_torch:
            return self.torch_model()
        if self._trainable is None:
            from qdeploy.export.onnx_to_torch import torch_from_onnx

            fp32 = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
            self._trainable = torch_from_onnx(fp32.path, self.check_inputs(), self.cfg.export.verify)
        return self._trainable

    def check_inputs(self) -> Optional[np.ndarray]:
        if self._check_cache is None and self._check_inputs is not None:
            self._check_cache = self._check_inputs()
        return self._check_cache

    # ---------------------------------------------------------------- building
    def build(self, request: ArtifactRequest) -> Artifact:
        key = request.key()
        if key not in self._built:
            recipe = {ArtifactKind.PYTORCH: self._pytorch, ArtifactKind.ONNX_FP32: self._onnx_fp32,
                      ArtifactKind.ONNX_FP16: self._onnx_fp16, ArtifactKind.ONNX_INT8: self._onnx_int8,
                      ArtifactKind.ONNX_FP16_CALIBRATED: self._onnx_fp16_calibrated, ArtifactKind.TRT_ENGINE: self._trt_engine,
                      ArtifactKind.OPENVINO_IR: self._openvino_ir,
                      ArtifactKind.OPENVINO_IR_INT8: self._openvino_ir_int8}[request.kind]
            self._built[key] = recipe(request.int8) if request.kind in (ArtifactKind.ONNX_INT8,
                                                                        ArtifactKind.OPENVINO_IR_INT8) else \
                recipe(request) if request.kind == ArtifactKind.TRT_ENGINE else recipe()
        return self._built[key]

    def built(self) -> list[Artifact]:
        return list(self._built.values())

    def _pytorch(self) -> Artifact:
        model = self.torch_model()
        path = resolve_weights_path(self.spec.weights_file) if self.spec.weights_file else None  # None for weights: random
        return Artifact(ArtifactKind.PYTORCH, model_fingerprint(self.spec, model), f"model source {self.spec.source}",
                        inputs=[str(path)] if path else [], path=path, module=model)

    def _onnx_fp32(self) -> Artifact:
        if self.has_torch:
            torch_art = self.build(ArtifactRequest(ArtifactKind.PYTORCH))
            onnx = export_onnx(self.torch_model(), self.spec, self.cfg.export, self.check_inputs(), self.cache_dir)
            return Artifact(ArtifactKind.ONNX_FP32, onnx.fingerprint, f"export ({onnx.exporter} exporter, opset {onnx.opset})",
                            inputs=[torch_art.ref], path=onnx.path, input_name=onnx.input_name, output_name=onnx.output_name,
                            opset=onnx.opset, info={"verify": onnx.verify}, cache_hit=onnx.cached)
        if is_keras_source(self.spec.source):
            from qdeploy.export.keras import export_keras

            onnx = export_keras(self.spec, self.cfg.export, self.check_inputs(), self.cache_dir)
            return Artifact(ArtifactKind.ONNX_FP32, onnx.fingerprint, f"Keras model converted by tf2onnx (opset {onnx.opset}, "
                            "NCHW input)", inputs=[str(Path(self.spec.source).expanduser())], path=onnx.path,
                            input_name=onnx.input_name, output_name=onnx.output_name, opset=onnx.opset,
                            info={"verify": onnx.verify}, cache_hit=onnx.cached)
        onnx = use_onnx_file(self.spec.source, self.cache_dir, decode=self.spec.decode)
        return Artifact(ArtifactKind.ONNX_FP32, onnx.fingerprint or sha256_file(onnx.path), "user's ONNX file",
                        inputs=[str(Path(self.spec.source).expanduser())],
                        path=onnx.path, input_name=onnx.input_name, output_name=onnx.output_name, opset=onnx.opset)

    def _cached(self, kind: ArtifactKind, fingerprint: str) -> tuple[Path, Path]:
        folder = self.cache_dir / "artifacts"
        stem = f"{kind.value}-{fingerprint[:20]}"
        return folder / f"{stem}.onnx", folder / f"{stem}.json"

    def _onnx_fp16(self) -> Artifact:
        fp32 = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        fingerprint = sha256_json({"fp32": fp32.fingerprint, "onnxruntime": ort.__version__, "qdeploy": __version__})
        path, meta = self._cached(ArtifactKind.ONNX_FP16, fingerprint)
        hit = path.is_file() and meta.is_file()
        if hit:
            log(f"build: cache hit {path}")
        else:
            convert_fp16(fp32.path, path)
            write_json(meta, {"fingerprint": fingerprint})
        return Artifact(ArtifactKind.ONNX_FP16, fingerprint, "onnxruntime float16 conversion (FP32 inputs/outputs kept)",
                        inputs=[fp32.ref], path=path, input_name=fp32.input_name, output_name=fp32.output_name,
                        opset=fp32.opset, cache_hit=hit)

    def _onnx_fp16_calibrated(self) -> Artifact:
        from qdeploy.data import normalize
        from qdeploy.export.fp16 import convert_fp16_calibrated

        fp32 = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        if self.calibration is None:
            raise ModelError("an FP16 ONNX for TensorRT 11 keeps FP32 only where real activations overflow FP16: "
                             "add data.calibration (images like the deployment's)")
        fingerprint = sha256_json({"fp32": fp32.fingerprint, "calibration": dataset_identity(self.calibration),
                                   "preprocess": self.spec.preprocess.model_dump(mode="json"), "onnxruntime": ort.__version__,
                                   "qdeploy": __version__, "code": sha256_file(Path(qdeploy.__file__).parent / "export" / "fp16.py")})
        path, meta = self._cached(ArtifactKind.ONNX_FP16_CALIBRATED, fingerprint)
        hit = path.is_file() and meta.is_file()
        if hit:
            info = json.loads(meta.read_text())["info"]
            log(f"build: cache hit {path}")
        else:
            info = convert_fp16_calibrated(fp32.path, path, (normalize(x, self.spec.preprocess) for x, _ in self.calibration))
            write_json(meta, {"fingerprint": fingerprint, "info": info})
            kept = ", ".join(k["node"] for k in info["kept_fp32"]) or "none"
            log(f"build: FP16 ONNX from {info['images']} calibration images; kept FP32: {kept}")
        return Artifact(ArtifactKind.ONNX_FP16_CALIBRATED, fingerprint,
                        "FP16 conversion, FP32 kept where calibration activations exceed FP16's range / 4",
                        inputs=[fp32.ref, f"data.calibration:{self.calibration.num_samples} images"], path=path,
                        input_name=fp32.input_name, output_name=fp32.output_name, opset=fp32.opset, info=info, cache_hit=hit)

    def trt_profiles(self, input_name: str, explicit: Optional[list]) -> list:
        """The optimization profile of a TensorRT variant: explicit, or from bench.batch_sizes and the input size."""
        from qdeploy.artifacts.tensorrt import derive_profile, explicit_profiles

        if explicit:
            return explicit_profiles(explicit)
        pre = self.spec.preprocess
        return [derive_profile(input_name, pre.channels, tuple(pre.input_size), list(self.cfg.bench.batch_sizes))]

    def _trt_engine(self, request: ArtifactRequest) -> Artifact:
        """A TensorRT engine for this GPU and TensorRT version (build_engine), cached with its sidecar; a cached engine
        that is missing, differs from the size and sha256 its sidecar recorded, or whose sidecar is missing or names
        another GPU or version is rebuilt from its ONNX (engine_problem: the integrity and portability guard)."""
        from qdeploy.artifacts.tensorrt import engine_problem, plan_build, write_sidecar
        from qdeploy.artifacts.tensorrt.engine_build import build_engine, precision_shortfall
        from qdeploy.facts.tensorrt import tensorrt_version

        opts = json.loads(request.options or "{}")
        version = tensorrt_version()
        if version is None or not torch.cuda.is_available():
            raise ModelError("a TensorRT engine needs TensorRT and a CUDA GPU on the machine that builds it")
        plan = plan_build(version, opts["precision"], opts.get("int8_mode", "qdq"))
        source = self.build(ArtifactRequest(ArtifactKind(opts["source"]), request.int8))
        onnx_art = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32)) if plan.calibration_cache else source
        calib = next((c.path for c in source.companions if c.kind == ArtifactKind.TRT_CALIBRATION_CACHE), None)
        gpu, cc = torch.cuda.get_device_name(0), "%d.%d" % torch.cuda.get_device_capability(0)
        profiles = self.trt_profiles(onnx_art.input_name, opts.get("profiles"))
        fingerprint = sha256_json({"onnx": onnx_art.fingerprint, "calibration_cache": sha256_file(calib) if plan.calibration_cache else None,
                                   "plan": plan.to_json(), "options": opts, "tensorrt": version, "gpu": gpu, "cc": cc,
                                   "profiles": [p.to_json() for p in profiles]})
        folder = self.cache_dir / "artifacts"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{ArtifactKind.TRT_ENGINE.value}-{fingerprint[:20]}.engine"
        meta = path.with_suffix(".json")
        hit = False
        if meta.is_file():  # built before: the engine file must be intact (size, sha256) and from this GPU and version
            problem = engine_problem(path, version, gpu, cc)
            hit = problem is None
            log(f"build: cache hit {path}" if hit else f"build: cached engine {path} is not usable here ({problem}); rebuilding")
        if hit:
            info = json.loads(meta.read_text())["info"]
        else:
            (self.cache_dir / "tensorrt").mkdir(parents=True, exist_ok=True)  # the timing cache's folder
            built = build_engine(onnx_art.path, path, plan, profiles, workspace_mib=opts.get("workspace_mib"),
                                 optimization_level=opts.get("optimization_level"),
                                 timing_cache=(self.cache_dir / "tensorrt" / f"timing-{version}-{cc}.cache")
                                 if opts.get("timing_cache", True) else None,
                                 calibration_cache=calib, layer_info=path.with_suffix(".layers.json"))
            precisions = built["precisions"]
            info = {"tensorrt_version": version, "plan": plan.to_json(), "gpu": {"name": gpu, "compute_capability": cc},
                    "profiles": [p.to_json() for p in profiles], "source_onnx": onnx_art.path.name, "precisions": precisions,
                    "precision_shortfall": precision_shortfall(opts["precision"], precisions), "build_options": opts}
            write_sidecar(path, tensorrt_version=version, gpu_name=gpu, compute_capability=cc, precision=opts["precision"],
                          plan=plan.to_json(), profiles=info["profiles"], source_onnx=onnx_art.path.name,
                          source_sha256=sha256_file(onnx_art.path), build_options=opts,
                          layers={k: v for k, v in precisions.items() if k != "layers"})
            write_json(meta, {"fingerprint": fingerprint, "info": info})
        return Artifact(ArtifactKind.TRT_ENGINE, fingerprint, f"TensorRT {version} ({plan.summary})", inputs=[onnx_art.ref],
                        path=path, input_name=onnx_art.input_name, output_name=onnx_art.output_name, info=info,
                        companions=[onnx_art], cache_hit=hit)

    def qat_setup(self, fp32: Artifact):
        """QAT's inputs (``quantizer: qat`` variants and ``qdeploy qat``): training images listed now, decoded only if
        training runs; the caller may replace the run-specific fields (work_dir, evaluate, ranks...)."""
        from qdeploy.data import make_batches
        from qdeploy.quantize.qat_quantizer import QatSetup, TrainingData

        cfg = self.cfg
        q = cfg.qat_settings()
        spec = cfg.qat_training_data()
        batches = make_batches(spec, self.spec.preprocess, self.spec.task, batch_size=256, desc="decode training images")
        supervised = q.objective in ("supervised", "both")

        def training() -> TrainingData:
            images, labels = zip(*batches) if batches.num_samples else ((), ())
            if not images:
                raise DataError(f"qat: no training image under {spec.root} could be decoded")
            return TrainingData(np.concatenate(images), np.concatenate(labels) if supervised else None,
                                batches.num_classes, batches.class_names, str(spec.root))

        return QatSetup(config=q, task=self.spec.task, ignore_index=spec.ignore_index, training=training,
                        identity=dataset_identity(batches),
                        base_fingerprint=sha256_json({"fp32": fp32.fingerprint, "preprocess": self.spec.preprocess.model_dump(mode="json")}))

    def _int8_fingerprint(self, fp32: Artifact, int8: Int8Config, qat=None) -> str:
        payload = {
            "fp32": fp32.fingerprint, "int8": int8.model_dump(mode="json"),
            "calibration_cache": sha256_file(Path(int8.calibration_cache)) if int8.calibration_cache else None,
            "calibration": dataset_identity(self.calibration) if self.calibration is not None and not int8.calibration_cache else None,
            "preprocess": self.spec.preprocess.model_dump(mode="json"),
            "export": self.cfg.export.model_dump(mode="json", exclude={"verify", "cache"}),
            "code": _quantize_code_fingerprint(),
            # the ONNX Runtime and OpenVINO placements' weights depend on the CPU's kernels (facts/onnxruntime.py)
            "u8s8_saturates": u8s8_saturates() if int8.placement in ("onnxruntime", "openvino") else None,
            "versions": {"qdeploy": __version__, "torch": torch.__version__, "onnxruntime": ort.__version__,
                         "nvidia-modelopt": dist_version("nvidia-modelopt")},
        }
        if qat is not None:  # a QAT artifact is also what it was trained on, and how
            payload["qat"] = {"config": qat.config.model_dump(mode="json", exclude={"device"}), "train": qat.identity}
        return sha256_json(payload)

    def _onnx_int8(self, int8: Int8Config) -> Artifact:
        fp32 = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        qat = self.qat_setup(fp32) if int8.quantizer == "qat" else None
        fingerprint = self._int8_fingerprint(fp32, int8, qat)
        path, meta = self._cached(ArtifactKind.ONNX_INT8, fingerprint)
        trt_cache = path.with_suffix(".trtcache")
        if path.is_file() and meta.is_file() and trt_cache.is_file():
            stored = json.loads(meta.read_text())
            info, produced_by, hit = stored["info"], stored["produced_by"], True
            log(f"build: cache hit {path} ({produced_by})")
        else:
            inputs = QuantizeInputs(
                fp32_onnx=fp32.path, preprocess=self.spec.preprocess, calibration=self.calibration,
                # QAT trains an ONNX or Keras source as its onnx2torch twin; PTQ of one stays on its ONNX (quantizer onnx)
                torch_model=self.torch_model if self.has_torch else self.trainable_model if int8.quantizer == "qat" else None,
                check_inputs=self.check_inputs(),
                opset=self.cfg.export.opset, dynamic_batch=self.cfg.export.dynamic_batch, cache_dir=self.cache_dir,
                memo=self.memo, qat=qat,
                calibration_identity=dataset_identity(self.calibration) if self.calibration is not None else None)
            result = quantize(inputs, int8, path)
            info = result.info
            method = "ranges from a TensorRT cache" if int8.calibration_cache else \
                f"QAT from {int8.method} PTQ, {qat.config.objective}, {qat.config.epochs:g} epoch(s)" if qat is not None else f"{int8.method} ranges"
            produced_by = f"quantizer {info['quantizer']} ({method}, {int8.placement} placement)"
            write_json(meta, {"fingerprint": fingerprint, "produced_by": produced_by, "info": info})
            hit = False
        data_inputs = [int8.calibration_cache] if int8.calibration_cache else \
            [f"data.calibration:{self.calibration.num_samples} images"] if self.calibration is not None else []
        companions = [Artifact(ArtifactKind.TRT_CALIBRATION_CACHE, fingerprint, f"{produced_by}: activation ranges",
                               inputs=[fp32.ref], path=trt_cache, cache_hit=hit)]
        checkpoint = Path((info.get("qat") or {}).get("checkpoint") or "")
        if qat is not None and checkpoint.is_file():
            companions.append(Artifact(ArtifactKind.QAT_CHECKPOINT, fingerprint, f"{produced_by}: fine-tuned weights",
                                       inputs=[fp32.ref, f"qat training:{qat.identity.get('count')} images"], path=checkpoint,
                                       cache_hit=hit))
            data_inputs.append(f"qat training:{qat.identity.get('count')} images")
        return Artifact(ArtifactKind.ONNX_INT8, fingerprint, produced_by, inputs=[fp32.ref, *data_inputs], path=path,
                        input_name=fp32.input_name, output_name=fp32.output_name, opset=fp32.opset, info=info,
                        companions=companions, cache_hit=hit)

    # ---------------------------------------------------------------- OpenVINO IR
    def _ir_cached(self, kind: ArtifactKind, fingerprint: str) -> tuple[Path, Path]:
        """(model.xml, the metadata JSON) of an IR artifact: one folder per IR in the cache."""
        folder = self.cache_dir / "artifacts" / f"{kind.value}-{fingerprint[:20]}"
        return folder / "model.xml", folder.with_suffix(".json")

    def _ir_from_cache(self, xml: Path, meta: Path) -> Optional[dict]:
        if xml.is_file() and xml.with_suffix(".bin").is_file() and meta.is_file():
            stored = json.loads(meta.read_text())
            log(f"build: cache hit {xml.parent} ({stored['produced_by']})")
            return stored
        return None

    def _openvino_ir(self) -> Artifact:
        from qdeploy.export.openvino_ir import convert_fp32

        fp32 = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        fingerprint = sha256_json({"fp32": fp32.fingerprint, "openvino": dist_version("openvino"), "code": _ir_code_fingerprint(),
                                   "routes": "onnx+pytorch" if self.has_torch else "onnx"})
        xml, meta = self._ir_cached(ArtifactKind.OPENVINO_IR, fingerprint)
        stored = self._ir_from_cache(xml, meta)
        hit = stored is not None
        if stored is None:
            images = self.check_inputs() if self.has_torch else None
            xml, info = convert_fp32(fp32.path, xml.parent, self.torch_model if self.has_torch else None, images)
            produced_by = f"openvino.convert_model ({info['route']} route, FP32 weights)"
            write_json(meta, {"fingerprint": fingerprint, "produced_by": produced_by, "info": info})
            stored = {"produced_by": produced_by, "info": info}
        return Artifact(ArtifactKind.OPENVINO_IR, fingerprint, stored["produced_by"], inputs=[fp32.ref], path=xml,
                        input_name=fp32.input_name, output_name=fp32.output_name, opset=fp32.opset,
                        info=stored["info"], cache_hit=hit)

    def _openvino_ir_int8(self, int8: Int8Config) -> Artifact:
        from qdeploy.quantize.nncf_quantizer import quantize_openvino_ir

        fp32 = self.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        # the conversion (export/openvino_ir.py) shapes the INT8 IR too: the model NNCF quantizes is its output
        fingerprint = sha256_json({"int8": self._int8_fingerprint(fp32, int8), "openvino": dist_version("openvino"),
                                   "nncf": dist_version("nncf"), "conversion": _ir_code_fingerprint()})
        xml, meta = self._ir_cached(ArtifactKind.OPENVINO_IR_INT8, fingerprint)
        stored = self._ir_from_cache(xml, meta)
        hit = stored is not None
        if stored is None:
            inputs = QuantizeInputs(fp32_onnx=fp32.path, preprocess=self.spec.preprocess, calibration=self.calibration,
                                    torch_model=self.torch_model if self.has_torch else None,
                                    check_inputs=self.check_inputs() if self.has_torch else None,
                                    cache_dir=self.cache_dir, memo=self.memo)
            xml, info = quantize_openvino_ir(inputs, int8, xml.parent)
            produced_by = f"NNCF {info['nncf']} on the OpenVINO model ({int8.method} ranges, openvino placement)"
            write_json(meta, {"fingerprint": fingerprint, "produced_by": produced_by, "info": info})
            stored = {"produced_by": produced_by, "info": info}
        data_inputs = [f"data.calibration:{self.calibration.num_samples} images"] if self.calibration is not None else []
        return Artifact(ArtifactKind.OPENVINO_IR_INT8, fingerprint, stored["produced_by"], inputs=[fp32.ref, *data_inputs],
                        path=xml, input_name=fp32.input_name, output_name=fp32.output_name, opset=fp32.opset,
                        info=stored["info"], cache_hit=hit)
