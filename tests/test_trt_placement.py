"""TensorRT placement on the ONNX route (quantizer onnx): ONNX Runtime places Q/DQ, lint's safe fixes bring
the graph to TensorRT's form. Both quantizers must produce what `qdeploy lint` calls clean."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import write_image_folder
from qdeploy import api
from qdeploy.lint import lint_onnx
from qdeploy.utils.onnx_graph import OnnxGraph

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    """stem → residual block with a 1x1 downsample shortcut → activation+activation Add → ConvTranspose →
    a conv too narrow for TensorRT's INT8 kernels → classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv1 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32))
        self.down = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2), nn.BatchNorm2d(32))
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        # 16→4 has an INT8 kernel (16 inputs, a multiple of 8); 4→4 does not
        self.narrow = nn.Sequential(nn.Conv2d(16, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.stem(x)
        y = torch.relu(self.conv2(self.conv1(x)) + self.down(x))
        y = torch.relu(y) + torch.sigmoid(y)          # activation + activation
        y = torch.relu(self.narrow(self.up(y)))
        return self.fc(y.mean((2, 3)))


def net():
    torch.manual_seed(0)
    return Net()
'''


@pytest.fixture
def placement_config(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text(MODEL)
    evalset = write_image_folder(tmp_path / "eval", per_class=2, size=(16, 16))
    calib = write_image_folder(tmp_path / "calib", per_class=6, size=(16, 16), seed=3)
    return {
        "model": {"source": f"{model_file}:net", "preprocess": {"input_size": [16, 16]}},
        "data": {"eval": {"root": str(evalset), "workers": 0}, "calibration": {"root": str(calib), "workers": 0}},
        "variants": [{"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt", "quantizer": q}
                     for q in ("onnx", "modelopt")],
        "bench": {"enabled": False},
    }


@pytest.mark.slow
def test_both_quantizers_place_qdq_by_tensorrts_rules(placement_config, tmp_path):
    summary = api.quantize(placement_config, tmp_path / "q", cache_dir=tmp_path / "cache")
    for name, info in summary["variants"].items():
        assert info["status"] == "ok", (name, info["reason"])
        path = tmp_path / "q" / info["artifact"]
        report = lint_onnx(path, confirm=False)
        st = report.structure
        # the downsample block: skip (the 1x1 shortcut conv) quantized, the main path float → one fused kernel
        forms = st["residual_add_forms"]
        assert forms.get("fusible") == 1 and forms.get("shared-scale") == 1 and sum(forms.values()) == 2, (name, forms)
        # the 4→4 conv has no INT8 kernel in TensorRT: left float, an explained finding
        assert len(info["excluded_small_channel_convs"]) == 1, (name, info["excluded_small_channel_convs"])
        narrow = next(o for o in st["ops"] if o["op"] == "Conv" and not o["int8_input"])
        assert not narrow["int8_weights"]
        assert st["compute_ops_int8"] == st["compute_ops"] - 1
        assert info["lint"]["verdict"] == "clean", (name, info["lint"])
        # ConvTranspose weights per channel along axis 0 (one scale per input channel of the 32×16×2×2 weight)
        g = OnnxGraph(onnx.load(str(path)))
        deconv = next(n for n in g.nodes if n.op_type == "ConvTranspose")
        dq = g.producer[deconv.input[1]]
        assert dq.op_type == "DequantizeLinear"
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        assert axis == 0 and np.size(g.constant_value(dq.input[1])) == 32, (name, axis)
        # no Q/DQ inside a Conv→BN→ReLU chain, none on a residual conv path
        assert not {f.rule for f in report.findings} & {"QD001", "QD006", "QD007", "QD008", "QD009"}


SE_MODEL = '''
import torch
from torch import nn
from torchvision.ops import SqueezeExcitation


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU())
        self.se = SqueezeExcitation(32, 8, activation=nn.SiLU)
        self.proj = nn.Conv2d(32, 16, 1)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.proj(self.se(self.stem(x))).mean((2, 3)))


def net():
    torch.manual_seed(0)
    return Net()
'''


@pytest.mark.slow
@pytest.mark.parametrize("placement, quantizer", [("onnxruntime", "onnx"), ("tensorrt", "onnx"), ("tensorrt", "modelopt")])
def test_squeeze_excitation_branch_stays_float(placement, quantizer, tmp_path):
    """NNCF's SE_BLOCK rule: the pooled 1×1 convs that compute the gate stay float in every placement, and the
    TensorRT lint explains them instead of flagging them."""
    model_file = tmp_path / "se.py"
    model_file.write_text(SE_MODEL)
    evalset = write_image_folder(tmp_path / "eval", per_class=2, size=(16, 16))
    calib = write_image_folder(tmp_path / "calib", per_class=6, size=(16, 16), seed=3)
    cfg = {"model": {"source": f"{model_file}:net", "preprocess": {"input_size": [16, 16]}},
           "data": {"eval": {"root": str(evalset), "workers": 0}, "calibration": {"root": str(calib), "workers": 0}},
           "variants": [{"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": placement,
                         "quantizer": quantizer, "name": "v"}]}
    summary = api.quantize(cfg, tmp_path / "q", cache_dir=tmp_path / "cache")
    info = summary["variants"]["v"]
    assert info["status"] == "ok", info["reason"]
    se = info["excluded_squeeze_excitation"]
    assert len(se) >= 2 and all(("fc1" in n or "fc2" in n or "avgpool" in n or "activation" in n) for n in se), se
    g = OnnxGraph(onnx.load(str(tmp_path / "q" / info["artifact"])))
    se_convs = [n for n in g.nodes if n.op_type == "Conv" and ("fc1" in n.name or "fc2" in n.name)]
    other_convs = [n for n in g.nodes if n.op_type in ("Conv", "QLinearConv") and n not in se_convs]
    assert len(se_convs) == 2 and not any(g.is_dequantized(c.input[0]) for c in se_convs)
    # ONNX Runtime's placement leaves float the convs it cannot run as QLinearConv (the stem conv, whose output goes to
    # a SiLU kept whole: lint.placement.CONV_FLOAT_OUTPUT_WHY), and says which
    kernel_less = set(info.get("float_convs_without_int8_kernel") or [])
    assert bool(kernel_less) == (placement == "onnxruntime"), kernel_less
    assert other_convs and all(c.op_type == "QLinearConv" or g.is_dequantized(c.input[0]) or c.name in kernel_less
                               for c in other_convs)
    if placement == "tensorrt":
        assert info["lint"]["verdict"] == "clean", info["lint"]
        assert any("squeeze-excitation" in f["fix"] for f in info["lint"]["findings"])
