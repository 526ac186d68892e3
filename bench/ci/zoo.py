"""Conformance sweep over many architectures with random weights (issue 34 item 2).

    python bench/ci/zoo.py --list                              # the registry
    python bench/ci/zoo.py --slice fast --json OUT.json        # ~10 diverse models (the CI slice)
    python bench/ci/zoo.py --all --json docs/results/zoo/zoo.json --markdown docs/zoo.md
    python bench/ci/zoo.py --only resnet18 --only timm/deit --json OUT.json --merge
    python bench/ci/zoo.py --all --checks openvino --json OUT.json --merge   # only the OpenVINO checks, laid over OUT's rows
    python bench/ci/zoo.py --all --source timm --jobs 8 --threads 2 --part 1/3 --deadline 430 --stop-at 540 --json OUT.json
                                                            # 8 models at a time, a third of them, within a time limit
                                                            # (bench/device/zoo_device.sh: the device machine's 16 cores)

Each model runs in its own Python subprocess (``--worker``), so a crash, an out-of-memory kill or a hang ends that model's
row only (``--timeout-per-model``). The worker drives qdeploy through its public API: ``api.open_run`` with a config dict
(model.source torchvision:NAME / timm:NAME with ``weights: random``, bench/ci/zoo_models.py:hf_classifier for Hugging Face
transformers, a saved .keras file for keras.applications), random PNG folders at the model's input size (eval: 3 classes
x 8 images; calibration: 16 images), then ``api.build_variant`` + ``api.run_variant`` (the eval stage: every variant is
built, loaded and run on the images) for these variants (``--checks openvino``: fp32, ort and openvino-ir only):

    fp32                onnxruntime fp32 (the export, verified against PyTorch/Keras by qdeploy's export.verify)
    trt-onnx            onnxruntime int8, placement tensorrt, quantizer onnx
    trt-auto            onnxruntime int8, placement tensorrt, quantizer auto (PyTorch sources): the route optimize takes,
                        ModelOpt on the PyTorch model, or the ONNX quantizer where ModelOpt cannot place the placement plan
                        (the row's ``quantizer_auto`` says which, and ``quantizer_fallback`` why)
    ort                 onnxruntime int8, placement onnxruntime
    openvino-ir         openvino int8, placement openvino: the INT8 IR NNCF's OpenVINO backend makes from the ov.Model
                        of the FP32 ONNX, compiled by OpenVINO's CPU plugin (float layers f32)
    openvino-qdq        openvino int8, placement onnxruntime: ort's Q/DQ ONNX through OpenVINO's ONNX frontend

Checks (``true`` or a one-line reason; a check that does not apply to a source is absent from its row):

    export_verified             the FP32 ONNX was exported and verified (ONNX Runtime vs the framework's outputs)
    tensorrt_onnx_builds        trt-onnx built and ran (exact Q/DQ in ONNX Runtime)
    tensorrt_auto_builds        trt-auto built and ran
    int8_macs_90_onnx           >= 90 % of MACs INT8 in trt-onnx (optimize.candidates.int8_macs_share over the FP32
    int8_macs_90_auto           ONNX's per-layer MACs from optimize.sensitivity.layer_sensitivity, as optimize does)
    lint_clean_onnx             no blocks-int8 finding left in the quantizer's lint (after its explained exclusions)
    lint_clean_auto
    onnxruntime_placement_runs  ort built and ran
    openvino_ir_int8_runs       openvino-ir built (NNCF), loaded (compiled) and ran
    openvino_ir_agreement       openvino-ir's top-1 agreement with fp32's predictions on the eval images >= ort's (else
                                both numbers); the row's ``openvino_ir`` holds them, each one's max relative output
                                difference from fp32 (max |out - fp32| / max |fp32|), the IR's INT8 compute ops and the
                                precisions its compute layers ran in
    openvino_qdq_int8_runs      openvino-qdq built, loaded (compiled) and ran (named openvino_loads_int8 in older rows)
    torch_program_reloads       the PyTorch model saved as a torch-cpu program (artifacts.torch_program.save_program,
                                what optimize --target torch-cpu saves) reloads in a fresh process (its own
                                load_model.py) with outputs equal to the PyTorch model's (max |diff| <= 1e-4 x max |ref|)

``tensorrt_int8_macs_share`` in a row: the share of the route optimize takes (quantizer auto; onnx for Keras sources,
which have no PyTorch model); each quantizer's in ``..._by_quantizer``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ZOO_MODELS = Path(__file__).resolve().parent / "zoo_models.py"
NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
CLASSES = 3
# eval images per class: 24 in all, so that an agreement of 1 image in 24 (4 %) separates two INT8 variants
EVAL_PER_CLASS = 8
MACS_LIMIT = 0.90
CHECKS = ["export_verified", "tensorrt_onnx_builds", "tensorrt_auto_builds", "int8_macs_90_onnx",
          "int8_macs_90_auto", "lint_clean_onnx", "lint_clean_auto", "onnxruntime_placement_runs",
          "openvino_ir_int8_runs", "openvino_ir_agreement", "openvino_qdq_int8_runs", "torch_program_reloads"]
# --checks: what each mode runs (openvino: the variants its checks need, no TensorRT placement, lint, MACs or program)
MODES = {"all": CHECKS,
         "openvino": ["export_verified", "onnxruntime_placement_runs", "openvino_ir_int8_runs", "openvino_ir_agreement"]}
# checks without a PyTorch model to run on (Keras sources)
PYTORCH_ONLY = ("tensorrt_auto_builds", "int8_macs_90_auto", "lint_clean_auto", "torch_program_reloads")
# older rows' names of a check (read by upgrade_row): the Q/DQ ONNX in OpenVINO was the only OpenVINO INT8 check
RENAMED_CHECKS = {"openvino_loads_int8": "openvino_qdq_int8_runs"}
SHORT = {"export_verified": "export", "tensorrt_onnx_builds": "trt onnx", "tensorrt_auto_builds": "trt auto",
         "int8_macs_90_onnx": "MACs≥90% onnx", "int8_macs_90_auto": "MACs≥90% auto",
         "lint_clean_onnx": "lint onnx", "lint_clean_auto": "lint auto",
         "onnxruntime_placement_runs": "ORT int8", "openvino_ir_int8_runs": "OV IR int8",
         "openvino_ir_agreement": "OV IR agr ≥ ORT", "openvino_qdq_int8_runs": "OV Q/DQ int8",
         "torch_program_reloads": "torch-cpu program"}


# ------------------------------------------------------------------------------------------------ the registry
class Entry:
    """One architecture: ``kind`` torchvision / timm / hf / keras, the name it is built by, input size, extra kwargs."""

    def __init__(self, kind: str, name: str, size: int = 64, kwargs: dict | None = None, label: str | None = None,
                 family: str | None = None):
        self.kind, self.name, self.size, self.kwargs = kind, name, size, dict(kwargs or {})
        self.label = label or f"{kind}/{name}"
        self.family = family or name

    def to_dict(self) -> dict:
        return {"model": self.label, "source": self.kind, "name": self.name, "input_size": self.size,
                "kwargs": self.kwargs, "family": self.family}


def _torchvision_entries() -> list[Entry]:
    """Every torchvision classification builder (list_models of torchvision.models, not the detection/segmentation/
    video/optical-flow/quantized submodules), small inputs; the ones that need more than 64 px get what they need."""
    try:
        import torchvision
        names = torchvision.models.list_models(module=torchvision.models)
    except Exception:  # noqa: BLE001 - --list without torchvision
        return []
    size = {"inception_v3": 96, "googlenet": 64}
    kw = {"inception_v3": {"aux_logits": False, "init_weights": False}, "googlenet": {"aux_logits": False, "init_weights": False}}
    out = []
    for n in sorted(names):
        k = dict(kw.get(n, {}))
        s = size.get(n, 64)
        if n.startswith("vit_"):
            k["image_size"] = 64 if n.endswith(("_16", "_32")) else 56   # patch 14: 56 = 4 x 14
            s = k["image_size"]
        if n.startswith("maxvit"):  # partition size 7 at every stage: 224 px (64 px fails in torchvision's own check)
            s = 224
            k["input_size"] = (224, 224)
        out.append(Entry("torchvision", n, s, k))
    return out


# one model per timm family: (family, model name, input size, kwargs)
TIMM_FAMILIES = [
    ("resnet", "resnet18", 64, {}), ("resnetv2", "resnetv2_50", 64, {}), ("resnext", "resnext26ts", 64, {}),
    ("regnet", "regnetx_002", 64, {}), ("efficientnet", "efficientnet_b0", 64, {}),
    ("efficientnetv2", "efficientnetv2_rw_t", 64, {}), ("mobilenetv3", "mobilenetv3_small_050", 64, {}),
    ("mobilenetv4", "mobilenetv4_conv_small", 64, {}), ("ghostnet", "ghostnet_050", 64, {}),
    ("ghostnetv2", "ghostnetv2_100", 64, {}), ("mnasnet", "mnasnet_small", 64, {}), ("fbnet", "fbnetc_100", 64, {}),
    ("densenet", "densenet121", 64, {}), ("dla", "dla34", 64, {}), ("dpn", "dpn48b", 64, {}),
    ("hrnet", "hrnet_w18_small", 64, {}), ("vgg", "vgg11", 64, {}), ("repvgg", "repvgg_a0", 64, {}),
    ("repvit", "repvit_m0_9", 64, {}), ("rexnet", "rexnet_100", 64, {}), ("res2net", "res2net50_14w_8s", 64, {}),
    ("resnest", "resnest14d", 64, {}), ("cspnet", "cspresnet50", 64, {}), ("darknet", "cspdarknet53", 64, {}),
    ("nfnet", "nf_regnet_b0", 64, {}), ("convnext", "convnext_atto", 64, {}), ("convnextv2", "convnextv2_atto", 64, {}),
    ("edgenext", "edgenext_xx_small", 64, {}), ("poolformer", "poolformer_s12", 64, {}),
    ("poolformerv2", "poolformerv2_s12", 64, {}), ("mobilevit", "mobilevit_xxs", 64, {}),
    ("mobilevitv2", "mobilevitv2_050", 64, {}), ("fastvit", "fastvit_t8", 64, {}), ("mobileone", "mobileone_s0", 64, {}),
    ("efficientformer", "efficientformer_l1", 224, {}),  # attention bias fixed at 7x7: 224 px only
    ("efficientformerv2", "efficientformerv2_s0", 64, {"img_size": 64}),
    ("levit", "levit_128s", 64, {"img_size": 64}), ("vit", "vit_tiny_patch16_224", 64, {"img_size": 64}),
    ("deit", "deit_tiny_patch16_224", 64, {"img_size": 64}), ("beit", "beit_base_patch16_224", 64,
                                                              {"img_size": 64, "depth": 2}),
    ("swin", "swin_tiny_patch4_window7_224", 64, {"img_size": 64, "window_size": 4}),
    ("swinv2", "swinv2_tiny_window8_256", 64, {"img_size": 64, "window_size": 4}),
    ("maxvit", "maxvit_nano_rw_256", 64, {"img_size": 64}), ("coatnet", "coatnet_nano_rw_224", 64, {"img_size": 64}),
    ("convit", "convit_tiny", 64, {"img_size": 64}), ("cait", "cait_xxs24_224", 64, {"img_size": 64, "depth": 4}),
    ("xcit", "xcit_nano_12_p16_224", 64, {"img_size": 64}), ("pvt_v2", "pvt_v2_b0", 64, {}),
    ("twins", "twins_pcpvt_small", 64, {"img_size": 64}), ("tinyvit", "tiny_vit_5m_224", 224, {}),  # no img_size argument
    ("mixer", "mixer_s32_224", 64, {"img_size": 64}), ("resmlp", "resmlp_12_224", 64, {"img_size": 64}),
    ("gcvit", "gcvit_xxtiny", 64, {"img_size": 64}), ("hgnet", "hgnetv2_b0", 64, {}), ("inception", "inception_v3", 96, {}),
    ("xception", "xception41", 96, {}), ("sequencer", "sequencer2d_s", 64, {"img_size": 64}),
    ("crossvit", "crossvit_tiny_240", 240, {}),  # two patch sizes (12, 16): its own 240
    ("eva", "eva02_tiny_patch14_224", 56, {"img_size": 56}),
    ("vovnet", "ese_vovnet19b_dw", 64, {}), ("selecsls", "selecsls42b", 64, {}), ("tresnet", "tresnet_m", 64, {}),
    ("lambda", "lambda_resnet26t", 64, {}), ("botnet", "botnet26t_256", 64, {"img_size": 64}),
    ("inception_next", "inception_next_tiny", 64, {}), ("focalnet", "focalnet_tiny_srf", 64, {}),
    ("davit", "davit_tiny", 64, {}), ("nextvit", "nextvit_small", 64, {}),
]

HF_FAMILIES = [("vit", 32), ("deit", 32), ("beit", 32), ("swin", 32), ("swinv2", 32), ("convnext", 64),
               ("convnextv2", 64), ("mobilevit", 64), ("levit", 64), ("resnet", 64), ("regnet", 64),
               ("efficientnet", 64), ("poolformer", 64), ("dinov2", 32), ("mobilenet_v2", 64)]

# keras.applications builders; the Inception/Xception/NASNet families need larger inputs
KERAS_MIN = {"InceptionV3": 96, "InceptionResNetV2": 96, "Xception": 96, "NASNetMobile": 96, "NASNetLarge": 96}


def _keras_entries() -> list[Entry]:
    names = ["ConvNeXtTiny", "ConvNeXtSmall", "ConvNeXtBase", "ConvNeXtLarge", "ConvNeXtXLarge", "DenseNet121",
             "DenseNet169", "DenseNet201", "EfficientNetB0", "EfficientNetB1", "EfficientNetB2", "EfficientNetB3",
             "EfficientNetB4", "EfficientNetB5", "EfficientNetB6", "EfficientNetB7", "EfficientNetV2B0",
             "EfficientNetV2B1", "EfficientNetV2B2", "EfficientNetV2B3", "EfficientNetV2S", "EfficientNetV2M",
             "EfficientNetV2L", "InceptionResNetV2", "InceptionV3", "MobileNet", "MobileNetV2", "MobileNetV3Small",
             "MobileNetV3Large", "NASNetMobile", "NASNetLarge", "ResNet50", "ResNet101", "ResNet152", "ResNet50V2",
             "ResNet101V2", "ResNet152V2", "VGG16", "VGG19", "Xception"]
    return [Entry("keras", n, KERAS_MIN.get(n, 64)) for n in names]


def registry() -> list[Entry]:
    out = _torchvision_entries()
    out += [Entry("timm", name, size, {"num_classes": CLASSES, **kw}, family=fam) for fam, name, size, kw in TIMM_FAMILIES]
    out += [Entry("hf", arch, size, label=f"hf/{arch}") for arch, size in HF_FAMILIES]
    out += _keras_entries()
    return out


FAST = ["torchvision/resnet18", "torchvision/mobilenet_v3_small", "torchvision/efficientnet_b0",
        "torchvision/regnet_y_400mf", "torchvision/convnext_tiny", "torchvision/vit_b_32", "torchvision/swin_t",
        "timm/deit_tiny_patch16_224", "timm/mobilevit_xxs", "hf/vit"]


def find(entries: list[Entry], key: str) -> list[Entry]:
    exact = [e for e in entries if key in (e.label, e.name, f"{e.kind}/{e.family}")]
    return exact or [e for e in entries if key in e.label]


# ------------------------------------------------------------------------------------------------ the worker
def _write_images(root: Path, size: int, classes: int | None, per_class: int, seed: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes or 1):
        d = root / f"c{c}" if classes else root
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            # smooth random images (a low-resolution field upsampled + noise): activations with structure, not white noise
            low = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            img = Image.fromarray(low).resize((size, size), Image.BILINEAR)
            arr = np.clip(np.asarray(img, dtype=np.int16) + rng.integers(-20, 21, (size, size, 3)), 0, 255)
            Image.fromarray(arr.astype(np.uint8)).save(d / f"{i}.png")


def _keras_file(e: Entry, work: Path) -> Path:
    import keras

    keras.utils.set_random_seed(0)
    fn = getattr(keras.applications, e.name)
    kw = {"weights": None, "input_shape": (e.size, e.size, 3), "classes": CLASSES}
    if e.name.startswith("MobileNetV3"):
        kw["include_preprocessing"] = True
    model = fn(**kw)
    path = work / f"{e.name}.keras"
    model.save(path)
    return path


def _model_section(e: Entry, work: Path) -> dict:
    pre = {"input_size": [e.size, e.size], "resize": [e.size, e.size], **NORM}
    if e.kind == "torchvision":
        return {"source": f"torchvision:{e.name}", "kwargs": {"num_classes": CLASSES, **e.kwargs}, "weights": "random",
                "preprocess": pre}
    if e.kind == "timm":
        return {"source": f"timm:{e.name}", "kwargs": e.kwargs, "weights": "random", "preprocess": pre}
    if e.kind == "hf":
        return {"source": f"{ZOO_MODELS}:hf_classifier",
                "kwargs": {"arch": e.name, "image_size": e.size, "num_labels": CLASSES}, "preprocess": pre}
    if e.kind == "keras":
        return {"source": str(_keras_file(e, work)), "preprocess": pre}
    raise ValueError(e.kind)


def applicable(e: Entry, mode: str = "all") -> list[str]:
    """The checks a --checks mode runs on this model's source."""
    return [c for c in MODES[mode] if e.kind != "keras" or c not in PYTORCH_ONLY]


def upgrade_row(r: dict) -> dict:
    """A row of an older sweep with today's check names (RENAMED_CHECKS)."""
    checks = {RENAMED_CHECKS.get(c, c): v for c, v in r.get("checks", {}).items()}
    return {**r, "checks": checks}


def merge_row(old: dict | None, new: dict) -> dict:
    """The row kept for a model that ``old`` already has a row of: ``new`` whole when it ran every check; a row not
    run leaves ``old``; a row of fewer checks (--checks openvino) is laid over ``old``: its checks and their numbers
    replace old's, old's other checks stay, and what the partial run took is kept under ``partial_runs``."""
    if old is None:
        return new
    if new.get("not_run"):
        return old
    if new.get("checks_mode", "all") == "all" or old.get("not_run"):
        return new
    old = upgrade_row(old)
    keep = ("checks", "times_s", "variants", "wall_s", "run", "checks_mode")
    merged = {**old, **{k: v for k, v in new.items()
                        if (k not in keep and k not in old) or k in ("openvino_ir", "export_verify")}}
    merged["checks"] = {**old["checks"], **new["checks"]}
    merged["partial_runs"] = {**old.get("partial_runs", {}), new["checks_mode"]: {
        k: new.get(k) for k in ("wall_s", "times_s", "variants", "run") if k in new}}
    return merged


def _one_line(x) -> str:
    s = " ".join(str(x).split())
    return s[:400] if s else type(x).__name__


def _record_reason(rec) -> str:
    return _one_line(f"{rec.failed_stage or rec.status}: {rec.reason}")


def _variants(pytorch: bool, mode: str, threads: int) -> list[dict]:
    """The variants a --checks mode needs: fp32 (the reference) and the ONNX Runtime placement always; the OpenVINO IR
    INT8 (NNCF on the ov.Model) always; the TensorRT placements and the Q/DQ ONNX in OpenVINO in mode all only."""
    out = [{"engine": "onnxruntime", "precision": "fp32"}]
    if mode == "all":
        out.append({"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "quantizer": "onnx"})
        if pytorch:
            out.append({"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "quantizer": "auto"})
    out += [{"engine": "onnxruntime", "precision": "int8", "placement": "onnxruntime"},
            {"engine": "openvino", "precision": "int8", "placement": "openvino"}]
    if mode == "all":
        out.append({"engine": "openvino", "precision": "int8", "placement": "onnxruntime"})
    for v in out:  # each engine keeps to the worker's threads (their defaults take every core: --jobs contention)
        v["threads"] = threads
    return out


def _find(records: dict, engine: str, placement: str | None = None, quantizer: str | None = None):
    """The record of the variant on ``engine`` with this INT8 placement (None: the FP32 one) and quantizer (None: any)."""
    for r in records.values():
        i8 = r.variant.int8
        if r.variant.spec.engine != engine or (placement is None) != (i8 is None):
            continue
        if placement is None or (i8.placement == placement and (quantizer is None or i8.quantizer == quantizer)):
            return r
    return None


def _ran(r) -> bool | str:
    return True if r is not None and r.ok else (_record_reason(r) if r is not None else "variant not resolved")


def worker(e: Entry, work: Path, threads: int, mode: str = "all") -> dict:
    import numpy as np
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    from qdeploy import api
    from qdeploy.artifacts import ArtifactKind, ArtifactRequest

    row = {**e.to_dict(), "checks_mode": mode, "checks": {}, "tensorrt_int8_macs_share": None,
           "tensorrt_int8_macs_share_by_quantizer": {}, "times_s": {}}
    checks = row["checks"]
    pytorch = e.kind != "keras"
    t0 = time.perf_counter()
    _write_images(work / "eval", e.size, CLASSES, EVAL_PER_CLASS, 0)
    _write_images(work / "calib", e.size, None, 16, 1)
    try:
        model = _model_section(e, work)
    except Exception as ex:  # noqa: BLE001 - a keras.applications model that does not build at this size
        reason = _one_line(f"model does not build: {type(ex).__name__}: {ex}")
        for c in applicable(e, mode):
            checks[c] = reason
        return row
    cfg = {"model": model, "data": {"eval": {"root": str(work / "eval")}, "calibration": {"root": str(work / "calib")}},
           "variants": _variants(pytorch, mode, threads), "bench": {"enabled": False}, "report": {}}
    try:
        ctx = api.open_run(cfg, work / "out", stages=("eval",), cache_dir=work / "cache")
    except BaseException as ex:  # noqa: BLE001 - the model does not build/run: every check fails with why
        reason = _one_line(f"open: {type(ex).__name__}: {ex}")
        for c in applicable(e, mode):
            checks[c] = reason
        row["times_s"]["total"] = round(time.perf_counter() - t0, 1)
        return row
    row["times_s"]["open"] = round(time.perf_counter() - t0, 1)
    try:
        t = time.perf_counter()
        try:
            fp32 = ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
            v = fp32.info.get("verify") or getattr(fp32, "verify", None)
            checks["export_verified"] = True if v else "exported but no verification recorded"
            row["export_verify"] = v
        except Exception as ex:  # noqa: BLE001
            checks["export_verified"] = _one_line(f"{type(ex).__name__}: {ex}")
            fp32 = None
        row["times_s"]["export"] = round(time.perf_counter() - t, 1)
        macs = _layer_macs(ctx, fp32, row) if mode == "all" else {}
        records = {}
        for v in ctx.variants:
            t = time.perf_counter()
            rec = api.build_variant(ctx, v)
            rec = api.run_variant(ctx, v, rec)
            records[v.label] = rec
            row["times_s"][v.label] = round(time.perf_counter() - t, 1)
        row["variants"] = {k: {"status": r.status, "failed_stage": r.failed_stage, "reason": r.reason}
                           for k, r in records.items()}
        if mode == "all":
            _tensorrt_checks(row, records, macs, fp32, pytorch)
        checks["onnxruntime_placement_runs"] = _ran(_find(records, "onnxruntime", "onnxruntime"))
        t = time.perf_counter()
        _openvino_checks(ctx, row, records, mode)
        row["times_s"]["openvino_outputs"] = round(time.perf_counter() - t, 1)
        if pytorch and mode == "all":
            t = time.perf_counter()
            checks["torch_program_reloads"] = _torch_program(ctx, e, work, np, torch)
            row["times_s"]["torch_program"] = round(time.perf_counter() - t, 1)
    finally:
        ctx.output.abort()
    row["times_s"]["total"] = round(time.perf_counter() - t0, 1)
    return row


def _layer_macs(ctx, fp32, row: dict) -> dict:
    """Per-layer MACs of the FP32 ONNX (optimize.sensitivity.layer_sensitivity, as optimize counts them); {} on failure,
    with why in the row."""
    from qdeploy import api
    from qdeploy.optimize.sensitivity import layer_sensitivity

    if fp32 is None:
        return {}
    try:
        one = api.normalize(ctx.eval_batches.first(1)[0], ctx.cfg.model.preprocess)
        return {d["name"]: d["macs"] or 0 for d in layer_sensitivity(fp32.path, one)}
    except Exception as ex:  # noqa: BLE001
        row["macs_error"] = _one_line(f"{type(ex).__name__}: {ex}")
        return {}


def _tensorrt_checks(row: dict, records: dict, macs: dict, fp32, pytorch: bool) -> None:
    """The TensorRT placements' checks: each quantizer's variant built and ran, its INT8 MAC share, its lint."""
    from qdeploy.optimize.candidates import int8_macs_share

    checks = row["checks"]
    for q in (["onnx", "auto"] if pytorch else ["onnx"]):
        r = _find(records, "onnxruntime", "tensorrt", q)
        checks[f"tensorrt_{q}_builds"] = _ran(r)
        if r is None or r.artifact is None:
            reason = "no INT8 artifact: " + (_record_reason(r) if r is not None else "variant not resolved")
            checks[f"int8_macs_90_{q}"] = checks[f"lint_clean_{q}"] = reason
            continue
        info = r.artifact.info
        if q == "auto":
            row["quantizer_auto"] = info.get("quantizer")
            if info.get("quantizer_fallback"):
                row["quantizer_fallback"] = [_one_line(f"{f['quantizer']}: {f['reason']}") for f in info["quantizer_fallback"]]
        share = None
        try:
            share = int8_macs_share(r, info.get("structure") or {}, macs, fp32.path if fp32 else None)
        except Exception as ex:  # noqa: BLE001
            row.setdefault("macs_errors", {})[q] = _one_line(f"{type(ex).__name__}: {ex}")
        row["tensorrt_int8_macs_share_by_quantizer"][q] = share
        if share is None:
            checks[f"int8_macs_90_{q}"] = "MAC share unknown: " + (row.get("macs_error") or (row.get("macs_errors") or {}).get(q)
                                                                   or "Q/DQ layers not paired with the FP32 ONNX's")
        elif share >= MACS_LIMIT:
            checks[f"int8_macs_90_{q}"] = True
        else:
            try:
                where = _float_macs(info, macs, fp32.path, r.artifact.path)
            except Exception as ex:  # noqa: BLE001 - the explanation only; the share stands
                where = f"(where: {type(ex).__name__}: {ex})"
            checks[f"int8_macs_90_{q}"] = _one_line(f"{share:.1%} of MACs INT8 (< 90 %); {where}")
        checks[f"lint_clean_{q}"] = _lint_check(info.get("lint") or {})
        row.setdefault("lint_counts", {})[q] = (info.get("lint") or {}).get("counts")
    by_q = row["tensorrt_int8_macs_share_by_quantizer"]
    row["tensorrt_int8_macs_share"] = by_q.get("auto" if pytorch else "onnx")


def _lint_check(lint: dict) -> bool | str:
    blocking = [f for f in lint.get("findings", []) if f.get("severity") == "blocks-int8"]
    if not lint or "counts" not in lint:
        return _one_line(f"no lint recorded: {lint}")
    if blocking:
        ids = sorted({f"{f['rule']} {f['name']}" for f in blocking})
        return _one_line(f"blocks-int8 findings: {', '.join(ids)} ({len(blocking)}): {blocking[0].get('message', '')}")
    return True


def _openvino_checks(ctx, row: dict, records: dict, mode: str) -> None:
    """openvino_ir_int8_runs, openvino_ir_agreement (and in mode all openvino_qdq_int8_runs); the numbers behind the
    agreement check in ``row["openvino_ir"]``."""
    checks = row["checks"]
    ir = _find(records, "openvino", "openvino")
    checks["openvino_ir_int8_runs"] = _ran(ir)
    if mode == "all":
        checks["openvino_qdq_int8_runs"] = _ran(_find(records, "openvino", "onnxruntime"))
    fp32, ort = _find(records, "onnxruntime"), _find(records, "onnxruntime", "onnxruntime")
    nums = row["openvino_ir"] = _ir_numbers(ctx, fp32, ort, ir)
    if ir is None or not ir.ok:
        checks["openvino_ir_agreement"] = "no OpenVINO IR INT8 predictions: " + str(checks["openvino_ir_int8_runs"])
    elif fp32 is None or fp32.predictions is None:
        checks["openvino_ir_agreement"] = "no FP32 predictions: " + str(_ran(fp32))
    elif ort is None or ort.predictions is None:
        checks["openvino_ir_agreement"] = (f"OpenVINO IR INT8 agrees with FP32 on {_pct(nums['agreement_ir'])}; the ONNX "
                                           f"Runtime placement has no predictions to compare: {_ran(ort)}")
    elif nums["agreement_ir"] >= nums["agreement_ort"]:
        checks["openvino_ir_agreement"] = True
    else:
        diff = nums.get("max_relative_difference") or {}
        checks["openvino_ir_agreement"] = _one_line(
            f"OpenVINO IR INT8 agrees with FP32 on {_pct(nums['agreement_ir'])} of {nums['images']} images < the ONNX "
            f"Runtime placement's {_pct(nums['agreement_ort'])}; max relative output difference from FP32 "
            f"{_num(diff.get('openvino_ir'))} (IR) vs {_num(diff.get('onnxruntime'))} (ONNX Runtime)")


def _pct(x) -> str:
    return "–" if x is None else f"{x:.1%}"


def _num(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _ir_numbers(ctx, fp32, ort, ir) -> dict:
    """Top-1 agreement with the FP32 variant's predictions of the ONNX Runtime placement and of the OpenVINO IR INT8,
    the max relative output difference of each from the FP32 outputs (max |out - fp32| / max |fp32| over the eval
    images), the IR's INT8 share of compute ops and the precisions its compute layers ran in."""
    import numpy as np

    from qdeploy.evaluate import agreement

    ref = fp32.predictions if fp32 is not None else None
    out = {"images": None if ref is None else int(len(ref)),
           "agreement_ir": agreement(ir.predictions, ref) if ir is not None and ir.predictions is not None else None,
           "agreement_ort": agreement(ort.predictions, ref) if ort is not None and ort.predictions is not None else None}
    if ir is not None and ir.artifact is not None:
        s = ir.artifact.info.get("structure") or {}
        out["ir_compute_ops_int8"] = f"{s.get('compute_ops_int8')}/{s.get('compute_ops')}"
        out["model_type"] = ir.artifact.info.get("model_type")
        out["runtime_precisions"] = ir.details.get("compute_layer_precisions")
    try:
        ref_out = _outputs(ctx, fp32) if fp32 is not None and fp32.ok else None
        if ref_out is not None:
            scale = float(np.abs(ref_out).max()) or 1.0
            out["max_relative_difference"] = {
                name: (float(np.abs(o - ref_out).max()) / scale if o.shape == ref_out.shape else None)
                for name, r in (("onnxruntime", ort), ("openvino_ir", ir)) if r is not None and r.ok
                for o in [_outputs(ctx, r)]}
    except Exception as ex:  # noqa: BLE001 - the numbers only; the checks stand on the predictions
        out["outputs_error"] = _one_line(f"{type(ex).__name__}: {ex}")
    return out


def _outputs(ctx, rec):
    """The variant's outputs on the eval images, its artifact loaded again (an IR from its compile cache)."""
    import numpy as np

    from qdeploy import api

    engine = api.create_engine(rec.variant, rec.artifact)
    try:
        engine.load()
        return np.concatenate([engine.infer(api.normalize(images, ctx.cfg.model.preprocess))
                               for images, _ in ctx.eval_batches])
    finally:
        engine.close()


def _float_macs(info: dict, macs: dict, fp32_onnx: Path, qdq_onnx: Path) -> str:
    """Where the MACs left out of INT8 are: per op type, the count of compute ops and their share of the MACs."""
    from qdeploy.optimize.sensitivity import layer_names_map

    mapping = layer_names_map(fp32_onnx, qdq_onnx) or {}
    total = sum(macs.values()) or 1
    per = defaultdict(lambda: [0, 0.0, None])
    for op in (info.get("structure") or {}).get("ops", []):
        if op.get("int8_input") and op.get("int8_weights"):
            continue
        m = macs.get(mapping.get(op["name"], op["name"]), 0) / total
        kind = op.get("op", "?") + ("" if op.get("int8_input") or op.get("int8_weights") else " float") + \
            (" (input INT8, weights float)" if op.get("int8_input") and not op.get("int8_weights") else "") + \
            (" (weights INT8, input float)" if op.get("int8_weights") and not op.get("int8_input") else "")
        p = per[kind]
        p[0] += 1
        p[1] += m
        if p[2] is None or m > 0:
            p[2] = p[2] or op["name"]
    parts = sorted(per.items(), key=lambda kv: -kv[1][1])
    return "not INT8: " + "; ".join(f"{n} x {k} = {m:.1%} of MACs (e.g. {ex})" for k, (n, m, ex) in parts[:3])


def _torch_program(ctx, e: Entry, work: Path, np, torch):
    """Save the PyTorch model as optimize --target torch-cpu saves its FP32 eager choice, reload it in a fresh process
    by its own load_model.py, compare the outputs with the PyTorch model's on the eval images."""
    from qdeploy import api
    from qdeploy.artifacts.torch_program import ProgramSettings, run_in_fresh_process, save_program

    try:
        module = ctx.builder.torch_model()
        x = api.normalize(ctx.eval_batches.first(8)[0], ctx.cfg.model.preprocess).astype(np.float32)
        with torch.no_grad():
            ref = module(torch.from_numpy(x)).float().numpy()
        folder = work / "program"
        save_program(module, ProgramSettings(device="cpu", precision="fp32", batch_sizes=(1, 4),
                                             input_shape=tuple(x.shape[1:])), folder)
        np.save(work / "images.npy", x)
        run_in_fresh_process(folder, work / "images.npy", work / "outputs.npy", "logits", 4, [1], work / "program.json",
                             timeout=600)
        got = np.load(work / "outputs.npy")
    except Exception as ex:  # noqa: BLE001
        return _one_line(f"{type(ex).__name__}: {ex}")
    if got.shape != ref.shape:
        return f"output shape {got.shape} differs from PyTorch's {ref.shape}"
    diff = float(np.abs(got - ref).max())
    limit = 1e-4 * max(1.0, float(np.abs(ref).max()))
    return True if diff <= limit else f"outputs differ: max |diff| {diff:.3g} > {limit:.3g}"


# ------------------------------------------------------------------------------------------------ the driver
def _not_run_row(e: Entry, why: str, mode: str = "all") -> dict:
    """A model the sweep did not run (or stopped) at its --deadline / --stop-at: every applicable check says why and
    ``not_run`` marks the row, so the summary leaves it out and a later ``--merge`` run keeps an older real row."""
    return {**e.to_dict(), "checks_mode": mode, "checks": {c: why for c in applicable(e, mode)},
            "tensorrt_int8_macs_share": None, "not_run": why, "wall_s": 0.0}


def run_one(e: Entry, timeout: float, threads: int, keep: Path | None, cpus: set[int] | None = None,
            stop_at: float | None = None, mode: str = "all") -> dict:
    """One model in its own worker subprocess. ``cpus``: pin the worker (and its children) to these CPUs, so that
    parallel workers do not share cores (OpenVINO sizes its pool from the CPUs it may use; ONNX Runtime's default
    pool, sized from all cores, stays confined to them). ``stop_at``: a time.perf_counter() instant past which the worker is killed and the row marked not run."""
    if stop_at is not None and stop_at - time.perf_counter() < 1:
        return _not_run_row(e, "not run: deadline", mode)
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        work = Path(tmp)
        result = work / "row.json"
        # the repo's src first, then whatever PYTHONPATH the sweep was started with (the device's carried site-packages)
        pypath = os.pathsep.join([str(REPO / "src")] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TF_NUM_INTRAOP_THREADS": str(threads),
               "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": pypath}
        cut = stop_at is not None and stop_at - time.perf_counter() < timeout
        if cut:
            timeout = max(1.0, stop_at - time.perf_counter())
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", e.label, "--workdir", str(work),
               "--threads", str(threads), "--checks", mode]
        t0 = time.perf_counter()
        log = work / "worker.log"
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO)
            if cpus:
                try:  # before the worker has imported anything (its threads and children inherit the mask)
                    os.sched_setaffinity(p.pid, cpus)
                except OSError:
                    pass
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own process group (it and its children)
                p.wait()
                rc = None
        elapsed = round(time.perf_counter() - t0, 1)
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{e.label.replace('/', '__')}.log").write_text(log.read_text(errors="replace"))
        if result.is_file():
            row = json.loads(result.read_text())
        elif rc is None and cut:
            row = _not_run_row(e, f"not run: deadline (stopped after {elapsed:g} s)", mode)
        else:
            why = f"timed out after {timeout:g} s" if rc is None else \
                (f"worker killed by signal {-rc}" if rc < 0 else f"worker exit {rc}") + f": {tail}"
            row = {**e.to_dict(), "checks_mode": mode, "checks": {c: why for c in applicable(e, mode)},
                   "tensorrt_int8_macs_share": None}
        row["wall_s"] = elapsed
        return row


def cause(reason: str) -> str:
    """A reason's first two clauses with its model-specific parts (numbers, paths, hashes, quoted names) blanked: rows
    with the same cause group together."""
    s = re.sub(r"(?<!\w)/[^\s:'\"]+", "<path>", reason)
    s = re.sub(r"\b[0-9a-f]{12,}\b", "<hash>", s)
    s = re.sub(r"'[^']*'|\"[^\"]*\"", "<name>", s)
    s = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", s)
    return ":".join(s.split(":")[:2])[:160]  # stage + what happened; the model's own list (of layers, ...) after that


def summarize(rows: list[dict]) -> dict:
    not_run = [r["model"] for r in rows if r.get("not_run")]
    rows = [r for r in rows if not r.get("not_run")]
    per_check = {}
    for c in CHECKS:
        vals = [r["checks"][c] for r in rows if c in r.get("checks", {})]
        if vals:
            ok = sum(v is True for v in vals)
            per_check[c] = {"pass": ok, "of": len(vals), "share": round(ok / len(vals), 4)}
    # the MAC share is measured by the TensorRT checks only (not by --checks openvino)
    shares = [r.get("tensorrt_int8_macs_share") for r in rows if "int8_macs_90_onnx" in r.get("checks", {})]
    # one group per root cause: a check that failed because an earlier one did ("no INT8 artifact: <why>") joins the
    # group of <why>; each group lists the checks it failed and the models
    groups = defaultdict(lambda: {"checks": [], "models": [], "example": None})
    for r in rows:
        for c, v in r.get("checks", {}).items():
            if v is not True:
                root = str(v).removeprefix("no INT8 artifact: ")
                g = groups[cause(root)]
                if r["model"] not in g["models"]:
                    g["models"].append(r["model"])
                if c not in g["checks"]:
                    g["checks"].append(c)
                g["example"] = g["example"] or root
    return {"models": len(rows), "not_run": not_run, "checks": per_check,
            "macs_90": {"pass": sum(s is not None and s >= MACS_LIMIT for s in shares), "of": len(shares)},
            "failures_by_cause": dict(sorted(groups.items(), key=lambda kv: -len(kv[1]["models"])))}


def _estimate(rows: list[dict]) -> str:
    """The whole registry's time at the measured mean per model of each source (an extrapolation, said as one)."""
    reg, total, said = _registered(), 0.0, []
    mean_all = sum(r.get("wall_s", 0) for r in rows) / max(1, len(rows))
    for k, n in reg.items():
        got = [r.get("wall_s", 0) for r in rows if r["source"] == k]
        mean = sum(got) / len(got) if got else mean_all
        total += mean * n
        said.append(f"{k} {mean:.0f} s/model")
    return (f"Mean per model measured: {', '.join(said)}; at those means the whole registry ({sum(reg.values())} "
            f"models, `--all`) would take about {total / 3600:.1f} h on this machine (an extrapolation, not a measurement: "
            "the larger torchvision/keras variants take longer than the small ones run so far).")


def _registered() -> dict:
    out = defaultdict(int)
    for e in registry():
        out[e.kind] += 1
    return dict(out)


def _cell(v) -> str:
    return "✓" if v is True else ("–" if v is None else "✗")


# scripts that moved since a recorded command ran: the page shows the command as it is run now (the JSON keeps it as run)
MOVED_SCRIPTS = {"bench/zoo.py": "bench/ci/zoo.py", "bench/zoo_merge.py": "bench/ci/zoo_merge.py"}


def current_paths(command: str) -> str:
    for old, new in MOVED_SCRIPTS.items():
        command = command.replace(f"python {old}", f"python {new}")
    return command


def markdown(doc: dict) -> str:
    rows, s = doc["rows"], doc["summary"]
    out = ["# Zoo sweep: conformance over many architectures (random weights)", "",
           *([doc["note"], ""] if doc.get("note") else
             ["**Baseline** measured before issue 34's placement-plan refactor: what qdeploy does today on each "
              "architecture, failures included (nothing in src/ was changed for it).", ""]),
           *[f"- part `{r['file']}`: {r['models']} models on {r['machine']}, {r['jobs']} at a time x {r['threads']} "
             f"thread(s), {r['sweep_wall_s'] or 0:.0f} s wall" for r in doc.get("runs", [])], "",
           "Commands (run in this order, each merging its rows into the JSON):", "",
           *[f"    {c if len(c) < 240 else c[:240] + ' …'}" for c in map(current_paths, doc.get("commands", [doc["command"]]))],
           "",
           f"Machine: {doc['machine']}  ",
           f"Started {doc['started']}; {len(rows)} models; {doc['elapsed_s']:.0f} s in all (sum of the per-model wall "
           f"times, " + ("models run one after another" if doc.get("jobs", 1) == 1 else f"{doc['jobs']} models at a time")
           + f", {doc['threads']} thread(s) per worker"
           + (": the other core was left to a concurrent test run" if doc.get("jobs", 1) == 1 else "")
           + (f"; this command's wall time {doc['sweep_wall_s']:.0f} s" if doc.get("sweep_wall_s") else "")
           + "); by source: "
           + ", ".join(f"{k} {v:.0f} s" for k, v in doc.get("elapsed_s_by_source", {}).items()) + ". "
           + _estimate(rows), "",
           "Written by `bench/ci/zoo.py` (its docstring says what each check is). Each model runs in its own subprocess "
           "with random weights at a small input size; images are random (smooth) PNGs: 3 classes x 8 eval images "
           "(x 4 in rows measured before the OpenVINO IR checks), 16 calibration images. A check a row did not run is `–` (Keras sources "
           "have no PyTorch model: no ModelOpt quantizer, no torch-cpu program; a row measured before a check existed). "
           "OpenVINO: `OV IR int8` is the INT8 IR NNCF makes on the ov.Model (placement openvino), compiled and run; "
           "`OV IR agr ≥ ORT` says its top-1 agreement with the FP32 variant's predictions is at least the ONNX Runtime "
           "placement's (`OV IR / ORT agreement`: both, on the eval images); `OV Q/DQ int8` is the ONNX Runtime "
           "placement's Q/DQ ONNX compiled by OpenVINO's ONNX frontend.", "",
           "How to run: `python bench/ci/zoo.py --list` (the registry), `--slice fast` (10 models, the CI slice), "
           "`--only NAME` (repeatable; a label, a name or `SOURCE/FAMILY`), `--all [--source timm]`, "
           "`--checks openvino` (only the variants the OpenVINO checks need; with `--merge` its checks replace those of "
           "the rows already there), `--timeout-per-model S`, `--json OUT [--merge]`, `--markdown OUT`, `--require` "
           "(exit 1 unless every "
           "check passes on >= 95 % of the models and >= 90 % of MACs are INT8 on >= 95 % of them).", "",
           "Coverage so far: " + ", ".join(f"{k} {sum(r['source'] == k for r in rows)} of {n} registered"
                                            for k, n in _registered().items()) + ".", "",
           "## Pass rates", "",
           "| check | pass | of | share |", "|---|---:|---:|---:|"]
    for c, v in s["checks"].items():
        out.append(f"| {c} | {v['pass']} | {v['of']} | {v['share']:.0%} |")
    m = s["macs_90"]
    if m["of"]:
        out.append(f"| ≥ 90 % of MACs INT8 (TensorRT placement, the route optimize takes: quantizer auto) | {m['pass']} | "
                   f"{m['of']} | {m['pass'] / max(1, m['of']):.0%} |")
    out += ["", "## Per model", "", *_model_table(rows), "", "## Failures by cause", ""]
    if not s["failures_by_cause"]:
        out.append("None.")
    for k, g in s["failures_by_cause"].items():
        out.append(f"- **{len(g['models'])} model(s)**: {', '.join(g['models'])}  \n  checks failed: "
                   f"{', '.join(g['checks'])}  \n  reason (first model's): {g['example'].replace('|', '/')}")
    return "\n".join(out) + "\n"


def _model_table(rows: list[dict]) -> list[str]:
    """The per-model table: a column per check some row ran, the INT8 MAC shares where measured, the OpenVINO IR's and
    the ONNX Runtime placement's agreement with FP32, the worker's seconds."""
    shown = [c for c in CHECKS if any(c in r.get("checks", {}) for r in rows)]
    macs = any("int8_macs_90_onnx" in r.get("checks", {}) for r in rows)
    ov = any(r.get("openvino_ir") for r in rows)
    out = ["| model | source | size | " + " | ".join(SHORT[c] for c in shown)
           + (" | INT8 MACs onnx | INT8 MACs auto" if macs else "") + (" | OV IR / ORT agreement" if ov else "") + " | s |",
           "|---|---|---:|" + "---|" * len(shown) + ("---:|---:|" if macs else "") + ("---:|" if ov else "") + "---:|"]
    for r in rows:
        by = r.get("tensorrt_int8_macs_share_by_quantizer") or {}
        nums = r.get("openvino_ir") or {}
        out.append(f"| {r['model']} | {r['source']} | {r.get('input_size')} | "
                   + " | ".join(_cell(r["checks"].get(c)) for c in shown)
                   + (f" | {_pct(by.get('onnx'))} | {_pct(by.get('auto'))}" if macs else "")
                   + (f" | {_pct(nums.get('agreement_ir'))} / {_pct(nums.get('agreement_ort'))}" if ov else "")
                   + f" | {r.get('wall_s', 0):.0f} |")
    return out


def machine() -> str:
    try:
        name = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                     .splitlines() if ln.startswith("Model name")), platform.processor())
    except OSError:
        name = platform.processor()
    return f"{name}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python {platform.python_version()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the registry and exit")
    ap.add_argument("--slice", choices=["fast"], help="fast: ~10 diverse models (the CI slice)")
    ap.add_argument("--only", action="append", default=[], help="a model label, name or family (repeatable)")
    ap.add_argument("--all", action="store_true", help="every registered model")
    ap.add_argument("--checks", choices=sorted(MODES), default="all",
                    help="all (default): every check; openvino: only export_verified, onnxruntime_placement_runs and the "
                         "OpenVINO IR checks (fp32, the ONNX Runtime placement and the OpenVINO IR INT8 variants; no "
                         "TensorRT placement, lint, MACs or torch-cpu program). With --merge its checks are laid over "
                         "the rows already in --json")
    ap.add_argument("--source", action="append", default=[], help="with --all: only these sources (torchvision, timm, hf, keras)")
    ap.add_argument("--timeout-per-model", type=float, default=900)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker (default 1)")
    ap.add_argument("--jobs", type=int, default=1, help="models run at once, each in its own worker (default 1); with "
                    "jobs x threads <= the CPUs, each worker is pinned to its own --threads CPUs")
    ap.add_argument("--no-pin", action="store_true", help="with --jobs: do not pin the workers to separate CPUs")
    ap.add_argument("--part", help="K/N: only the chosen models whose registry index %% N == K-1 (N calls split a sweep)")
    ap.add_argument("--deadline", type=float, help="start no model after this many seconds; the rest are rows "
                    "'not run: deadline' (a --merge run later fills them in)")
    ap.add_argument("--stop-at", type=float, help="kill models still running after this many seconds (rows 'not run: "
                    "deadline'), so the sweep ends and writes its JSON before an outer time limit")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--merge", action="store_true", help="keep the rows of models not run from an existing --json")
    ap.add_argument("--markdown", type=Path, help="write the Markdown table here (from the whole --json)")
    ap.add_argument("--logs", type=Path, help="keep each worker's log in this folder")
    ap.add_argument("--require", action="store_true", help="exit 1 unless issue 34's done criteria hold (>= 95 %% per check)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.threads < 1:
        ap.error("--jobs and --threads must be >= 1")
    part = None
    if a.part:
        m = re.fullmatch(r"(\d+)/(\d+)", a.part)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            ap.error(f"--part K/N with 1 <= K <= N, not {a.part!r}")
        part = int(m.group(1)), int(m.group(2))
    entries = registry()
    if a.worker:
        e = next(x for x in entries if x.label == a.worker)
        row = worker(e, a.workdir, a.threads, a.checks)
        (a.workdir / "row.json").write_text(json.dumps(row, default=str))
        return 0
    if a.list:
        for e in entries:
            print(f"{e.label:45s} {e.kind:12s} {e.size:4d} {json.dumps(e.kwargs)}" + ("   [fast]" if e.label in FAST else ""))
        print(f"{len(entries)} models")
        return 0
    chosen = []
    if a.slice == "fast":
        chosen += [e for k in FAST for e in find(entries, k)]
    for k in a.only:
        got = find(entries, k)
        if not got:
            ap.error(f"no model matches {k!r} (see --list)")
        chosen += got
    if a.all:
        chosen += [e for e in entries if not a.source or e.kind in a.source]
    chosen = list({e.label: e for e in chosen}.values())
    if part:
        index = {e.label: i for i, e in enumerate(entries)}
        chosen = [e for e in chosen if index[e.label] % part[1] == part[0] - 1]
    if not chosen:
        ap.error("nothing to run: --slice fast, --only NAME or --all" + (f" (none in --part {a.part})" if part else ""))
    old, prev = {}, {}
    if a.merge and a.json and a.json.is_file():
        prev = json.loads(a.json.read_text())
        old = {r["model"]: upgrade_row(r) for r in prev.get("rows", [])}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t0 = time.perf_counter()
    rows = _sweep(a, chosen, prev, old, started, t0)
    a.sweep_wall_s = round(time.perf_counter() - t0, 1)
    doc = _write(a, prev, old, rows, started) if a.json else {"summary": summarize(rows)}
    print(json.dumps(doc["summary"]["checks"], indent=1))
    if a.require:
        unmet = unmet_criteria(doc["summary"])
        for u in unmet:
            print(f"not met: {u}")
        return 1 if unmet else 0
    return 0


def _sweep(a, chosen: list[Entry], prev: dict, old: dict, started: str, t0: float) -> list[dict]:
    """Run ``chosen`` with ``a.jobs`` workers at once (threads of one pool, each waiting on its model's subprocess);
    progress lines in the order the models finish, the JSON rewritten after each (rows in registry order)."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    deadline = None if a.deadline is None else t0 + a.deadline
    stop_at = None if a.stop_at is None else t0 + a.stop_at
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slots: queue.Queue = queue.Queue()
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = a.jobs > 1 and not a.no_pin and a.jobs * a.threads <= ncpu and len(mine) >= a.jobs * a.threads
    for j in range(a.jobs):  # one CPU set per job slot: a worker takes a free slot and gives it back when done
        slots.put(set(mine[j * a.threads:(j + 1) * a.threads]) if pin else None)
    lock = threading.Lock()
    done: dict[int, dict] = {}

    def one(i: int, e: Entry) -> None:
        if deadline is not None and time.perf_counter() >= deadline:
            row = _not_run_row(e, "not run: deadline", a.checks)
        else:
            cpus = slots.get()
            try:
                row = run_one(e, a.timeout_per_model, a.threads, a.logs, cpus, stop_at, a.checks)
            except Exception as ex:  # noqa: BLE001 - the driver's own failure on one model ends that row only
                why = _one_line(f"driver: {type(ex).__name__}: {ex}")
                row = {**_not_run_row(e, why, a.checks), "not_run": None}
            finally:
                slots.put(cpus)
        with lock:
            done[i] = row
            bad = {c: v for c, v in row["checks"].items() if v is not True}
            if row.get("not_run"):
                print(f"[{len(done)}/{len(chosen)}] {e.label}: {row['not_run']}", flush=True)
            else:
                print(f"[{len(done)}/{len(chosen)}] {e.label}: {row['wall_s']:.0f} s, "
                      f"{sum(v is True for v in row['checks'].values())}/{len(row['checks'])} checks, INT8 MACs "
                      f"{row.get('tensorrt_int8_macs_share')}" + "".join(f"\n    {c}: {v}" for c, v in bad.items()),
                      flush=True)
            if a.json:  # after every model: a killed sweep keeps what it measured
                a.sweep_wall_s = round(time.perf_counter() - t0, 1)
                _write(a, prev, old, [done[k] for k in sorted(done)], started)

    if a.jobs > 1:
        print(f"{len(chosen)} models, {a.jobs} at a time, {a.threads} thread(s) each"
              + (" (workers pinned to separate CPUs)" if pin else ""), flush=True)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for f in [pool.submit(one, i, e) for i, e in enumerate(chosen)]:
            f.result()
    return [done[k] for k in sorted(done)]


def unmet_criteria(s: dict, share: float = 0.95) -> list[str]:
    """Issue 34's done criteria: each check passes on >= 95 % of the models it applies to; >= 90 % of MACs INT8 in the
    TensorRT placement on >= 95 % of the models."""
    out = [f"{c}: {v['pass']}/{v['of']} < {share:.0%}" for c, v in s["checks"].items() if v["pass"] < share * v["of"]]
    m = s["macs_90"]
    if m["of"] and m["pass"] < share * m["of"]:
        out.append(f">= 90 % of MACs INT8: {m['pass']}/{m['of']} < {share:.0%}")
    return out


def _write(a, prev: dict, old: dict, rows: list[dict], started: str) -> dict:
    merged = dict(old)
    # a row this run did not run (deadline) leaves an older measured row of that model in place; a --checks openvino
    # row is laid over it
    for r in rows:
        merged[r["model"]] = merge_row(old.get(r["model"]), r)
    order = {e.label: i for i, e in enumerate(registry())}
    all_rows = sorted(merged.values(), key=lambda r: order.get(r["model"], 1 << 30))
    cmd = "python bench/ci/zoo.py " + " ".join(sys.argv[1:])
    commands = list(prev.get("commands") or ([prev["command"]] if prev.get("command") else [])) + [cmd]
    by_source = defaultdict(float)
    for r in all_rows:
        by_source[r["source"]] += r.get("wall_s", 0)
    doc = {"schema": "qdeploy.zoo/1", "command": cmd, "commands": commands, "machine": machine(), "threads": a.threads,
           "jobs": a.jobs, "part": a.part, "sweep_wall_s": getattr(a, "sweep_wall_s", None),
           "started": prev.get("started", started),
           "elapsed_s": round(sum(r.get("wall_s", 0) for r in all_rows), 1),
           "elapsed_s_by_source": {k: round(v, 1) for k, v in by_source.items()},
           "baseline": "before issue 34's placement-plan refactor", "checks": CHECKS,
           "checks_mode": a.checks,
           "summary": summarize(all_rows), "rows": all_rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        a.markdown.write_text(markdown(doc))
    return doc


if __name__ == "__main__":
    sys.exit(main())
