"""``qdeploy qat``'s report: one self-contained HTML page (same style as the run report) with FP32 / PTQ / QAT
side by side, the per-epoch training log, and the loss and accuracy curves."""
from __future__ import annotations

from collections.abc import Mapping
from html import escape
from pathlib import Path

from qdeploy.report import plots
from qdeploy.report import tables as T
from qdeploy.report.htmlpage import CSS, _figure, _table
from qdeploy.tasks import task_of_metric
from qdeploy.utils.atomic import atomic_path


def _metric_label(summary: Mapping) -> str:
    task = task_of_metric(summary.get("metric"))
    return task.metric_label if task is not None else "mIoU"  # any other key reads as mIoU, as this page always did


def qat_tables(summary: Mapping) -> list[T.Table]:
    metric = _metric_label(summary)
    agree = T.section(summary, "agreement")
    ort = T.section(summary, "onnxruntime")
    t = T.Table("qat-result", f"{metric} on data.eval", ["Model", metric, "Δ vs FP32", "Agreement with FP32", "Artifact"],
                [False, True, True, True, False],
                caption="PTQ and QAT: ModelOpt fake-quant in PyTorch; the exported artifacts run in ONNX Runtime with exact "
                        "Q/DQ semantics (the TensorRT-placement one simulates what TensorRT computes).")
    fp32 = T.num(summary.get("fp32"))

    def add(name, value, key, artifact=T.DASH):
        v = T.num(value)
        t.add([name, T.pct(v), T.fmt(None if v is None or fp32 is None else 100 * (v - fp32), 2),
               T.pct(agree.get(key)) if key else T.DASH, artifact])

    add("FP32", summary.get("fp32"), None)
    add(f"PTQ ({summary.get('method')})", summary.get("before"), "before")
    add("QAT (fake-quant, PyTorch)", summary.get("after"), "after")
    add("QAT, TensorRT placement (ONNX Runtime)", summary.get("after_onnx"), "after_onnx", str(summary.get("artifact")))
    if ort:
        add("QAT weights, ONNX Runtime placement", ort.get("metric"), "onnxruntime", str(ort.get("artifact")))
    log = T.Table("qat-log", "Training log", ["Epoch", "Loss", "LR at end", "Images/s", "Seconds", metric],
                  [True] * 6, caption=f"objective {summary.get('objective')}, {summary.get('train_images')} training images, "
                                      f"{summary.get('processes', 1)} process(es) on {summary.get('device')}")
    for e in summary.get("log") or []:
        log.add([str(e.get("epoch")), T.fmt(e.get("loss"), 4), T.fmt(e.get("lr_end"), 6), T.fmt(e.get("images_per_s"), 0, sep=True),
                 T.fmt(e.get("seconds"), 1), T.pct(e.get("metric"))])
    return [t, log]


def render_qat_html(summary: Mapping, title: str) -> str:
    metric = _metric_label(summary) + " %"
    body = [f"<h1>{escape(title)}</h1>"]
    for t in qat_tables(summary):
        body.append(_table(t))
    body.append(_figure(plots.qat_curves([("qat", summary.get("log") or [])], metric), "QAT curves",
                        "Training loss per epoch, and the data.eval metric after each epoch."))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body><main>\n"
            + "\n".join(body) + "\n</main></body>\n</html>\n")


def write_qat_report(summary: Mapping, path: Path, title: str) -> Path:
    with atomic_path(Path(path)) as tmp:
        Path(tmp).write_text(render_qat_html(summary, title), encoding="utf-8")
    return Path(path)
