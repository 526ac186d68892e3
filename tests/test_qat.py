"""Quantization-aware training (issue #9) on a tiny real model, CPU, real ModelOpt fake quantization and export."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import write_image_folder
from qdeploy import api
from qdeploy.errors import QDeployError

MODEL = '''
import torch
from torch import nn


class Small(nn.Module):
    """conv-bn-relu → residual block → pool → fc: what the TensorRT placement handles (skip-input Add quantizer)."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.body(x))
        return self.fc(x.mean((2, 3)))


def small(num_classes=3):
    torch.manual_seed(0)
    m = Small(num_classes)
    with torch.no_grad():  # confident logits, as a trained model's: the INT8 error shows in the KL
        m.fc.weight.mul_(40)
    return m


def small_softmax(num_classes=3):
    """The same model ending in a softmax (keras.applications' default head): it outputs probabilities."""
    return nn.Sequential(small(num_classes), nn.Softmax(dim=1))
'''


def _config(tmp_path, objective="distill", epochs=2.0, **qat):
    model_file = tmp_path / "small.py"
    if not model_file.exists():
        model_file.write_text(MODEL)
    roots = {name: tmp_path / name for name in ("train", "calib", "eval")}
    for seed, (name, root) in enumerate(roots.items()):
        if not root.exists():
            write_image_folder(root, per_class=8, size=(16, 16), seed=seed)
    data = {"eval": {"root": str(roots["eval"]), "batch_size": 8, "workers": 0},
            "calibration": {"root": str(roots["calib"]), "batch_size": 8, "workers": 0},
            "train": {"root": str(roots["train"]), "batch_size": 8, "workers": 0}}
    return {"model": {"source": f"{model_file}:small", "preprocess": {"input_size": [16, 16], "mean": [0.5] * 3, "std": [0.25] * 3}},
            "data": data, "qat": {"objective": objective, "epochs": epochs, "batch_size": 8, "lr": 1e-3, "method": "max", **qat}}


@pytest.fixture(scope="module")
def qat_runs(tmp_path_factory):
    """``qat_runs(objective, epochs, **qat)``: one ``api.qat`` of that config per module, on one project (model file,
    image folders, cache). Several tests read the same finished run: each QAT of the small model costs seconds."""
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("qat-runs")
    done = {}

    def run(objective="distill", epochs=2.0, **qat):
        key = (objective, epochs, tuple(sorted(qat.items())))
        if key not in done:
            cfg = _config(root, objective, epochs, **qat)
            out, cache = root / f"out{len(done)}", root / "cache"
            done[key] = SimpleNamespace(cfg=cfg, out=out, cache=cache, root=root,
                                        summary=api.qat(cfg, out, cache_dir=cache))
        return done[key]
    run.root, run.cache = root, root / "cache"
    return run


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["distill", "supervised", "both"])
def test_qat_trains_exports_and_reports(qat_runs, objective):
    run = qat_runs(objective)
    summary, out = run.summary, run.out
    on_disk = json.loads((out / "qat.json").read_text())
    assert on_disk["artifact"] == "qat.onnx" and (out / "qat.onnx").is_file() and (out / "qat.trtcache").is_file()
    for key in ("fp32", "before", "after", "after_onnx"):
        assert 0.0 <= on_disk[key] <= 1.0
    # the shipped artifact scores what the fine-tuned fake-quant model scores (24 images: at most one may flip)
    assert abs(on_disk["after_onnx"] - on_disk["after"]) <= 1 / 24 + 1e-9
    assert on_disk["epochs"] == 2.0 and on_disk["images_per_s"] > 0
    assert [e["epoch"] for e in on_disk["log"]] == [1, 2] and all(e["loss"] is not None for e in on_disk["log"])
    # the same TensorRT placement as PTQ: every compute op INT8, the residual Add fusible, lint clean
    st = summary["structure"]
    assert st["compute_ops_int8"] == st["compute_ops"] == 4, st
    assert st["residual_add_forms"] == {"fusible": 1}
    assert summary["lint"]["verdict"] == "clean"
    assert summary["export_check"]["min_cosine"] >= 0.99
    assert (out / "qat-checkpoint.pt").is_file() and json.loads((out / "qat-log.json").read_text())["epochs"] == on_disk["log"]
    # agreement with the FP32 model's predictions, and the ONNX Runtime-placement artifact from the fine-tuned weights
    assert set(on_disk["agreement"]) == {"before", "after", "after_onnx", "onnxruntime"}
    assert all(0.0 <= a <= 1.0 for a in on_disk["agreement"].values())
    ort = on_disk["onnxruntime"]
    assert ort["artifact"] == "qat-onnxruntime.onnx" and (out / ort["artifact"]).is_file() and 0.0 <= ort["metric"] <= 1.0
    assert ort["structure"]["compute_ops_int8"] == ort["structure"]["compute_ops"]
    # the report: the result table, the per-epoch log and the curves (an embedded PNG)
    page = (out / "qat.html").read_text()
    assert "Training log" in page and page.count("data:image/png;base64,") == 1 and "QAT curves" in page


@pytest.mark.fast
def test_losses_of_a_softmax_model_equal_those_of_its_logits():
    """Probabilities read as logits flatten every loss (softmax of values in [0, 1] is nearly uniform); with
    ``probabilities`` the losses equal the logits' exactly."""
    from qdeploy.config import QatConfig
    from qdeploy.quantize.qat import objective_loss, outputs_are_probabilities

    g = torch.Generator().manual_seed(0)
    zs, zt = 6 * torch.randn(16, 10, generator=g), 6 * torch.randn(16, 10, generator=g)
    labels = torch.randint(0, 10, (16,), generator=g)
    ps, pt = zs.softmax(1), zt.softmax(1)
    assert outputs_are_probabilities(pt) and not outputs_are_probabilities(zt) and not outputs_are_probabilities(zt.sigmoid())
    for objective in ("distill", "supervised", "both"):
        cfg = QatConfig(objective=objective, temperature=2.0)
        want = objective_loss(cfg, zs, zt, labels, -100)
        assert torch.allclose(objective_loss(cfg, ps, pt, labels, -100, probabilities=True), want, rtol=1e-4, atol=1e-5)
    # what QAT did before: the distillation loss of probabilities taken as logits is a small fraction of the real one
    cfg = QatConfig(objective="distill")
    assert objective_loss(cfg, ps, pt, None, -100) < 0.1 * objective_loss(cfg, zs, zt, None, -100)


@pytest.mark.slow
def test_qat_of_a_model_ending_in_softmax_distills_its_logits(qat_runs, tmp_path, capsys):
    # the same network without its softmax, trained the same way: the same losses (KL of the same distributions)
    plain = qat_runs("distill", 2.0, lr=5e-3, augment=False).summary
    capsys.readouterr()
    cfg = _config(qat_runs.root, "distill", epochs=2.0, lr=5e-3, augment=False)
    cfg["model"]["source"] = cfg["model"]["source"].replace(":small", ":small_softmax")
    summary = api.qat(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert "the model's outputs are probabilities" in capsys.readouterr().err
    assert summary["outputs"] == "probabilities"
    assert plain["outputs"] == "logits"
    for a, b in zip(summary["log"], plain["log"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05), (summary["log"], plain["log"])


@pytest.mark.slow
def test_qat_changes_the_weights_and_distillation_lowers_its_loss(qat_runs):
    summary = qat_runs("distill", 2.0, lr=5e-3, augment=False).summary
    losses = [e["loss"] for e in summary["log"]]
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_resume_reaches_the_uninterrupted_result(qat_runs, tmp_path, monkeypatch):
    """Two epochs in one go vs. killed right after epoch 1's checkpoint, then --resume: the same weights, bit for bit.
    The interrupted run leaves no --out at all (it is written whole, at the end); its checkpoint is in the training
    folder that --resume into the same --out finds."""
    from qdeploy.quantize.qat import QatTrainer
    from qdeploy.quantize.qat_quantizer import command_folder

    uninterrupted = qat_runs("both", 2.0)  # the run test_qat_trains_exports_and_reports checks
    cfg, whole = uninterrupted.cfg, uninterrupted.summary
    save = QatTrainer._save

    def save_then_die(self, epochs_done, step):
        save(self, epochs_done, step)
        if epochs_done == 1:
            raise KeyboardInterrupt  # the process is killed after the checkpoint of epoch 1
    monkeypatch.setattr(QatTrainer, "_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        api.qat(cfg, tmp_path / "part", cache_dir=tmp_path / "cache")
    monkeypatch.undo()
    assert torch.load(command_folder(tmp_path / "cache", tmp_path / "part") / "qat-checkpoint.pt", weights_only=False)["epochs_done"] == 1
    assert not (tmp_path / "part").exists() and not list(tmp_path.glob(".part.*"))
    resumed = api.qat(cfg, tmp_path / "part", resume=True, cache_dir=tmp_path / "cache")
    a = torch.load(uninterrupted.out / "qat-checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "part" / "qat-checkpoint.pt", weights_only=False)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    strip = lambda log: [{k: v for k, v in e.items() if k not in ("seconds", "images_per_s")} for e in log]  # noqa: E731
    assert strip(resumed["log"]) == strip(whole["log"])
    assert resumed["after"] == whole["after"]


def test_supervised_without_labelled_data_is_refused_before_work(tmp_path):
    cfg = _config(tmp_path, "supervised")
    del cfg["data"]["train"]
    with pytest.raises(QDeployError, match="data.train"):
        api.qat(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out" / "qat.onnx").exists()


def test_training_classes_must_match_the_model_outputs(tmp_path):
    cfg = _config(tmp_path, "supervised")
    write_image_folder(tmp_path / "train4", classes=("a", "b", "c", "d"), per_class=4, size=(16, 16))
    cfg["data"]["train"]["root"] = str(tmp_path / "train4")
    with pytest.raises(QDeployError, match="has 4 classes .* but the model outputs 3"):
        api.qat(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_config(qat_runs):
    finished = qat_runs("distill", 1.0)
    with pytest.raises(QDeployError, match="belongs to another model, data or QAT config"):
        api.qat(_config(finished.root, "distill", epochs=1.0, lr=3e-3), finished.out, resume=True, cache_dir=finished.cache)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    # lr 1e30: the first update sends the weights to inf, the second step's loss is not finite
    with pytest.raises(QDeployError, match=r"QAT loss became (nan|inf) at step \d+ .*training stopped"):
        api.qat(_config(tmp_path, "supervised", epochs=2.0, lr=1e30, optimizer="sgd", momentum=0.0), tmp_path / "out",
                cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out" / "qat.onnx").exists() and not (tmp_path / "out" / "qat.json").exists()


SEG_MODEL = '''
import torch
from torch import nn


class Seg(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                  nn.ReLU())
        self.head = nn.Conv2d(16, num_classes, 1)

    def forward(self, x):
        return {"out": self.head(self.body(x)) * 20}


def seg(num_classes=3):
    torch.manual_seed(0)
    return Seg(num_classes)
'''


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["supervised", "distill"])
def test_segmentation_qat_with_ignore_index(tmp_path, objective):
    """Per-pixel cross entropy with ignore_index (label 3 = void) and per-pixel KL; mIoU before and after."""
    import numpy as np
    from PIL import Image

    (tmp_path / "seg.py").write_text(SEG_MODEL)
    rng = np.random.default_rng(0)
    root = tmp_path / "camvid"
    for split, n in (("train", 12), ("val", 6), ("test", 6)):
        (root / split).mkdir(parents=True)
        (root / f"{split}annot").mkdir()
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(root / split / f"f{i}.png")
            Image.fromarray(rng.integers(0, 4, (16, 24), dtype=np.uint8)).save(root / f"{split}annot" / f"f{i}.png")
    spec = lambda split: {"format": "segnet", "root": str(root), "split": split, "ignore_index": 3, "workers": 0, "batch_size": 4}  # noqa: E731
    cfg = {"model": {"source": f"{tmp_path / 'seg.py'}:seg", "task": "segmentation", "output": "out",
                     "preprocess": {"input_size": [16, 24], "mean": [0.5] * 3, "std": [0.25] * 3}},
           "data": {"eval": spec("test"), "calibration": spec("val"), "train": spec("train")},
           "qat": {"objective": objective, "epochs": 2, "batch_size": 4, "lr": 1e-3, "method": "max"}}
    summary = api.qat(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    # distill trains on the calibration images by default (no labels needed), supervised on data.train
    assert summary["metric"] == "miou" and summary["train_images"] == (12 if objective == "supervised" else 6)
    assert all(0.0 <= summary[k] <= 1.0 for k in ("fp32", "before", "after", "after_onnx"))
    assert len(summary["log"]) == 2 and all(np.isfinite(e["loss"]) for e in summary["log"])
    assert summary["structure"]["compute_ops_int8"] == summary["structure"]["compute_ops"]


@pytest.mark.slow
def test_torchrun_two_processes_on_the_cpu(tmp_path):
    """`torchrun --nproc_per_node=2 -m qdeploy qat`: gloo on the CPU, each rank a shard of every epoch, rank 0 alone
    writes qat.json / qat.onnx / the checkpoint."""
    import os
    import subprocess
    import sys

    import yaml

    cfg = _config(tmp_path, "distill", epochs=1.0)
    (tmp_path / "qat.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]), QDEPLOY_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
                        "-m", "qdeploy", "qat", str(tmp_path / "qat.yaml"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "qat.json").read_text())
    assert summary["processes"] == 2
    # 24 calibration images, 8 per rank per step: 2 steps cover the epoch (16 images per step across the ranks)
    assert summary["log"][0]["steps"] == 2 and summary["log"][0]["images"] == 32
    assert (tmp_path / "out" / "qat.onnx").is_file()
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == [  # .qdeploy-output: the file list (utils/atomic.py)
        ".qdeploy-output", "qat-checkpoint.pt", "qat-log.json", "qat-onnxruntime.onnx", "qat-onnxruntime.trtcache", "qat.html", "qat.json",
        "qat.onnx", "qat.trtcache"]


@pytest.mark.slow
def test_torchrun_with_more_processes_than_gpus_is_refused(tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    cfg = _config(tmp_path, "distill", epochs=1.0, device="cuda")
    (tmp_path / "qat.yaml").write_text(yaml.safe_dump(cfg))
    gpus = torch.cuda.device_count()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]), QDEPLOY_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus + 1}", f"--master_port={_free_port()}",
                        "-m", "qdeploy", "qat", str(tmp_path / "qat.yaml"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode != 0
    expected = (f"only {gpus} GPU(s) are visible" if gpus else "no CUDA GPU is visible")
    assert expected in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_float_model_carries_the_fine_tuned_weights_without_quantizers():
    """float_model(): quantizers off, the depthwise equalization (pre_quant_scale g, weights / g) folded back: the
    result computes what the student computes with its quantizers disabled, and has no Mul left."""
    from torch import nn

    from qdeploy.config import Int8Config, Preprocess
    from qdeploy.quantize.modelopt_torch import quantize_torch_model
    from qdeploy.quantize.qat_quantizer import float_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4)).eval()
    with torch.no_grad():  # channels of very different ranges: equalization gives them gains g > 1
        model[0].weight[:4].mul_(0.02)
    x = torch.randn(16, 3, 8, 8)
    qm, _, _ = quantize_torch_model(model, [x.numpy()], 16, "max")
    gains = [m.input_quantizer.pre_quant_scale for m in qm.modules() if getattr(getattr(m, "input_quantizer", None), "pre_quant_scale", None) is not None]
    assert gains and float(gains[0].max()) > 1.5  # the equalization is really there
    f = float_model(qm)
    with torch.no_grad():
        ref = model(x)
        got = f(x)
    # BN folding and g·(W/g) round in float32 only
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (got - ref).abs().max()
    # the student itself is untouched (still quantized)
    assert any(m.is_enabled for m in qm.modules() if type(m).__name__ == "TensorQuantizer")


@pytest.mark.slow
def test_qat_variant_in_run_trains_once_and_ships_its_checkpoint(tmp_path):
    """`quantizer: qat` in a normal run: the TensorRT and ONNX Runtime placements share one training, cached; a second
    run builds nothing; the checkpoint travels with the artifact; the report shows the QAT table and curves."""
    cfg = _config(tmp_path, "distill", epochs=1.0)
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "fp32"},
                       {"engine": "onnxruntime", "precision": "int8", "quantizer": "qat", "placement": "tensorrt", "method": "max"},
                       {"engine": "onnxruntime", "precision": "int8", "quantizer": "qat", "method": "max"}]
    cfg["bench"] = {"enabled": False}
    from qdeploy.quantize.qat import QatTrainer

    fits = []
    fit = QatTrainer.fit

    def counting_fit(self, resume=False):
        fits.append(resume)
        return fit(self, resume)
    QatTrainer.fit = counting_fit
    try:
        r1 = api.run(cfg, tmp_path / "run1", cache_dir=tmp_path / "cache")
        r2 = api.run(cfg, tmp_path / "run2", cache_dir=tmp_path / "cache")
    finally:
        QatTrainer.fit = fit
    assert fits == [False], fits  # trained once: the second placement reused the finished checkpoint, run 2 hit the cache
    qat = [v for v in r1["variants"] if v["precision"] == "int8"]
    assert [v["status"] for v in qat] == ["ok", "ok"], [(v["status"], v["reason"]) for v in qat]
    for v in qat:
        q = v["quantization"]
        assert q["qat"]["objective"] == "distill" and len(q["qat"]["log"]) == 1 and q["qat"]["images_per_s"] > 0
        assert 0.0 <= v["metrics"]["top1"] <= 1.0
    assert qat[0]["quantization"]["placement"] == "tensorrt" and qat[1]["quantization"]["placement"] == "onnxruntime"
    names = {a["path"] for a in r1["artifacts"]}
    for v in qat:  # each variant ships the checkpoint of the training it came from (the same one here)
        ckpt = torch.load(tmp_path / "run1" / f"{v['name']}.qat-checkpoint.pt", weights_only=False)
        assert ckpt["complete"] is True and ckpt["epochs_done"] == 1
    assert all(v["status"] == "ok" for v in r2["variants"])
    page = (tmp_path / "run1" / "report.html").read_text()
    assert "Quantization-aware training" in page and "QAT curves" in page


def test_qat_variant_refuses_training_on_evaluation_images(tmp_path):
    cfg = _config(tmp_path, "distill")
    cfg["qat"]["data"] = cfg["data"]["eval"]
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "int8", "quantizer": "qat"}]
    with pytest.raises(QDeployError, match="include 24 of data.eval"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_residual_quantizers_false_leaves_the_residual_add_float(qat_runs, tmp_path):
    """QAT without the skip-input quantizers (``residual_quantizers: false``): no Q/DQ on either input of the residual
    Add. Same project and cache as the run with them: a cache key that ignored the option would give the same model."""
    with_q = qat_runs("distill", 1.0).summary
    without = api.qat(_config(qat_runs.root, "distill", epochs=1.0, residual_quantizers=False), tmp_path / "without",
                      cache_dir=qat_runs.cache)
    assert with_q["structure"]["residual_add_forms"] == {"fusible": 1}
    assert "fusible" not in without["structure"]["residual_add_forms"], without["structure"]["residual_add_forms"]
    assert without["fingerprint"] != with_q["fingerprint"]


@pytest.mark.slow
def test_learned_ranges_train_the_activation_amax_and_export_them(tmp_path):
    """ranges: learned: ModelOpt gives INT8 amax no gradient, so qdeploy's LSQ backend does; the trained amax end up in
    the quantizers, the checkpoint and the exported Q/DQ scales (the export check compares ONNX with the fake-quant model)."""
    import onnx
    from onnx import numpy_helper

    frozen = api.qat(_config(tmp_path, "distill", epochs=2.0, lr=5e-2), tmp_path / "frozen", cache_dir=tmp_path / "cache")
    learned = api.qat(_config(tmp_path, "distill", epochs=2.0, lr=5e-2, ranges="learned"), tmp_path / "learned",
                      cache_dir=tmp_path / "cache")
    lr = learned["learned_ranges"]
    assert frozen["learned_ranges"] is None and lr["quantizers"] >= 3
    assert lr["amax_ratio_min"] != 1.0 or lr["amax_ratio_max"] != 1.0, lr  # the ranges moved
    state = torch.load(tmp_path / "learned" / "qat-checkpoint.pt", weights_only=False)["model"]
    assert any(k.endswith("input_quantizer.learned_amax") for k in state)
    assert learned["export_check"]["min_cosine"] >= 0.99

    def activation_scales(path):
        m = onnx.load(str(path))
        inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node if n.op_type == "Constant"}
        return sorted(float((inits.get(n.input[1]) if n.input[1] in inits else consts.get(n.input[1]))) for n in m.graph.node
                      if n.op_type == "QuantizeLinear" and (inits.get(n.input[1], consts.get(n.input[1])) is not None)
                      and (inits.get(n.input[1], consts.get(n.input[1]))).size == 1)
    assert activation_scales(tmp_path / "learned" / "qat.onnx") != activation_scales(tmp_path / "frozen" / "qat.onnx")


def test_adamw_steps_equalized_weights_as_if_unequalized():
    """AdamW on W' = W/g (input ·g) with the step rescaled by 1/g moves g·W' exactly as AdamW moves W."""
    from types import SimpleNamespace

    from torch import nn

    from qdeploy.quantize.qat import _train_equalized_in_original_units, optimizer_step

    torch.manual_seed(0)
    g = torch.tensor([1.0, 4.0, 64.0, 256.0])
    plain = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    eq = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    with torch.no_grad():
        eq.weight.copy_(plain.weight / g.view(-1, 1, 1, 1))
    eq.input_quantizer = SimpleNamespace(pre_quant_scale=g.view(1, -1, 1, 1))
    hooks, rescale = _train_equalized_in_original_units(eq, "adamw")
    assert hooks == [] and len(rescale) == 1
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-12, weight_decay=0.0)
    opt_e = torch.optim.AdamW([eq.weight], lr=1e-2, eps=1e-12, weight_decay=0.0)
    for _ in range(3):
        x = torch.randn(2, 4, 6, 6)
        for conv, opt, inp, res in ((plain, opt_p, x, []), (eq, opt_e, x * g.view(1, -1, 1, 1), rescale)):
            opt.zero_grad()
            conv(inp).square().mean().backward()
            optimizer_step(opt, res)
    assert torch.allclose(eq.weight * g.view(-1, 1, 1, 1), plain.weight, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_resume_of_a_finished_run_reuses_it_without_training(qat_runs, monkeypatch):
    """`qdeploy qat --resume` after the run finished: no epoch runs again, and the same result is written."""
    from qdeploy.quantize.qat import QatTrainer

    finished = qat_runs("distill", 1.0)
    first = finished.summary
    monkeypatch.setattr(QatTrainer, "fit", lambda self, resume=False: pytest.fail("trained again"))
    again = api.qat(finished.cfg, finished.out, resume=True, cache_dir=finished.cache)
    for key in ("fp32", "before", "after", "after_onnx"):
        assert again[key] == first[key], key
    assert again["log"] == first["log"]


VIT = '''
import timm
import torch


def vit(num_classes=3):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=num_classes, img_size=16,
                             patch_size=4, depth=2, embed_dim=32, num_heads=2)
'''


@pytest.mark.slow
def test_qat_of_a_transformer_trains_its_linear_layers_and_keeps_attention_float(tmp_path):
    """Issue 21 item 5: the QAT path handles Linear/MatMul layers: a timm ViT fine-tunes, exports the TensorRT placement
    (every Linear INT8, attention's matmuls float by lint/placement.py) and lints clean."""
    pytest.importorskip("timm")
    cfg = _config(tmp_path, "distill", epochs=1.0)
    (tmp_path / "vit.py").write_text(VIT)
    cfg["model"]["source"] = f"{tmp_path / 'vit.py'}:vit"
    summary = api.qat(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    st = summary["structure"]
    # 2 blocks x (qkv, proj, fc1, fc2) + patch conv + head = 10 INT8; 2 x 2 attention matmuls float by rule
    assert st["compute_ops"] == 14 and st["compute_ops_int8"] == 10, st
    assert summary["lint"]["verdict"] == "clean"
    on_disk = json.loads((tmp_path / "out" / "qat.json").read_text())
    assert on_disk["log"] and all(e["loss"] is not None for e in on_disk["log"])
    assert abs(on_disk["after_onnx"] - on_disk["after"]) <= 1 / 24 + 1e-9


DETECTOR = '''
import torch
from torch import nn


class TinyYolo(nn.Module):
    """(N, 4 + 2, 16) like Ultralytics' export: 16 anchors of a 4x4 grid, cx cy w h in input pixels, 2 class scores."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Conv2d(16, 6, 1)
        gy, gx = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
        self.register_buffer("grid", torch.stack([gx, gy]).reshape(1, 2, 16))

    def forward(self, x):
        h = self.head(self.body(x)).flatten(2)
        return torch.cat([(self.grid + torch.sigmoid(h[:, :2])) * 8, torch.sigmoid(h[:, 2:4]) * 16,
                          torch.sigmoid(h[:, 4:] * 4)], 1)


def tiny():
    torch.manual_seed(0)
    return TinyYolo()
'''


def _detection_project(tmp_path):
    from PIL import Image
    import numpy as np

    (tmp_path / "det.py").write_text(DETECTOR)
    rng = np.random.default_rng(0)
    for folder in ("voc", "train", "cal"):  # evaluation, QAT's labelled training set, calibration/distillation images
        (tmp_path / folder).mkdir()
        for i in range(12):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / folder / f"{i}.png")
            if folder != "cal":
                (tmp_path / folder / f"{i}.xml").write_text(
                    f"<annotation><filename>{i}.png</filename><size><width>32</width><height>32</height><depth>3</depth>"
                    "</size><object><name>a</name><bndbox><xmin>2</xmin><ymin>3</ymin><xmax>16</xmax><ymax>20</ymax>"
                    "</bndbox></object></annotation>")
    data = {"format": "voc", "root": str(tmp_path / "voc"), "classes": ["a", "b"], "batch_size": 4, "workers": 0}
    return {"model": {"source": f"{tmp_path / 'det.py'}:tiny", "weights": "random", "task": "detection",
                      "decode": "yolov8", "preprocess": {"input_size": [32, 32]}},
            "data": {"eval": data, "calibration": {"root": str(tmp_path / "cal"), "labels": False, "batch_size": 4,
                                                   "workers": 0}},
            "variants": [{"engine": "onnxruntime", "precision": "fp32"},
                         {"engine": "onnxruntime", "precision": "int8", "quantizer": "qat", "placement": "tensorrt",
                          "method": "max"}],
            "bench": {"enabled": False},
            "qat": {"objective": "distill", "epochs": 2, "batch_size": 4, "lr": 1e-3, "method": "max"}}


def test_a_detector_distils_on_its_head_outputs_and_refuses_supervised_qat(tmp_path):
    """issue 37: QAT of a detector distils its raw head (each channel's squared error over the teacher's variance: box
    pixels and scores weigh alike), not a softmax over boxes and classes; the loss falls; the variant is evaluated in
    mAP. Supervised QAT of a detector is refused with the reason (its loss needs the head's box assignment)."""
    from qdeploy.quantize.qat import output_mse

    t = torch.tensor([[[10.0, 20.0], [0.5, 0.7]]])  # channel 0: pixels, channel 1: scores
    assert output_mse(t, t) == 0
    # a 10 % error costs the same in pixels as in scores
    assert torch.isclose(output_mse(t * torch.tensor([[[1.1], [1.0]]]), t), output_mse(t * torch.tensor([[[1.0], [1.1]]]), t))
    cfg = _detection_project(tmp_path)
    r = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    qat = next(v for v in r["variants"] if v["precision"] == "int8")
    assert qat["status"] == "ok", qat.get("reason")
    log = qat["quantization"]["qat"]["log"]
    assert len(log) == 2 and log[-1]["loss"] < log[0]["loss"]
    assert 0.0 <= qat["metrics"]["map"] <= 1.0
    cfg["qat"]["objective"] = "supervised"
    cfg["data"]["train"] = {**cfg["data"]["eval"], "root": str(tmp_path / "train")}
    from qdeploy.errors import ConfigError

    with pytest.raises(ConfigError, match="objective: distill"):  # before any work: preflight
        api.run(cfg, tmp_path / "out2", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out2" / "results.json").exists()
