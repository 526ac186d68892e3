"""TensorRT Q/DQ placement of the ModelOpt quantizer, asserted on the exported Q/DQ ONNX of small real models.

TensorRT developer guide, "Q/DQ layer-placement recommendations" and ModelOpt's ONNX path
(graph_utils.get_fusible_backbone / build_non_residual_input_map): only the skip input of a residual Add is
quantized, the conv-path input stays float (Conv+BN+ReLU+Add fuse into one INT8 kernel); two inputs with no
Conv backbone share one scale; convs TensorRT will not run in INT8 stay float; pools carry no Q/DQ of their own;
ConvTranspose weights are per-channel along axis 0. Plus the EfficientNet-B0 export-check regression (real data).
"""
import glob
import json
import random

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from qdeploy.quantize.modelopt_torch import export_qdq_onnx, quantize_torch_model

torch.manual_seed(0)


class Graph:
    """Producers and constants of an exported ONNX, for asserting on where Q/DQ sits."""

    def __init__(self, path):
        self.model = onnx.load(str(path))
        self.producer = {o: n for n in self.model.graph.node for o in n.output}
        self.consts = {i.name: numpy_helper.to_array(i) for i in self.model.graph.initializer}
        for n in self.model.graph.node:
            if n.op_type == "Constant":
                self.consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def nodes(self, op_type):
        return [n for n in self.model.graph.node if n.op_type == op_type]

    def dq_of(self, tensor):
        """The DequantizeLinear that produces ``tensor`` (through Cast/Identity), or None."""
        node = self.producer.get(tensor)
        while node is not None and node.op_type in ("Cast", "Identity"):
            node = self.producer.get(node.input[0])
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    def scale(self, dq):
        return self.consts[dq.input[1]]


def _quantize(model, tmp_path, method="max", shape=(3, 16, 16)):
    x = np.random.default_rng(0).standard_normal((16, *shape)).astype(np.float32)
    qm, amax, details = quantize_torch_model(model.eval(), [x[:8], x[8:]], 16, method)
    path = tmp_path / "q.onnx"
    export_qdq_onnx(qm, torch.from_numpy(x[:2]), path, 17)
    json.dumps(details)  # the details are JSON-serialisable
    return Graph(path), details


def _stem():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())


class Block(nn.Module):
    """torchvision-style BasicBlock after a conv stem; ``downsample``: a 1x1 conv+BN on the skip path."""

    def __init__(self, downsample=False):
        super().__init__()
        self.stem = _stem()
        self.conv1, self.bn1 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32 if downsample else 16, 3, padding=1), nn.BatchNorm2d(32 if downsample else 16)
        self.down = nn.Sequential(nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32)) if downsample else None

    def forward(self, x):
        x = self.stem(x)
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        skip = self.down(x) if self.down is not None else x
        return torch.relu(out + skip)


def _add_inputs(g):
    (add,) = [n for n in g.nodes("Add") if all(i not in g.consts for i in n.input)]
    return add, [g.dq_of(i) for i in add.input]


@pytest.mark.parametrize("downsample", [False, True])
def test_residual_add_quantizes_only_the_skip_input(downsample, tmp_path):
    g, details = _quantize(Block(downsample), tmp_path)
    add, dqs = _add_inputs(g)
    conv_in = [i for i in add.input if g.producer[i].op_type == "Conv" and "conv2" in g.producer[i].name]
    assert len(conv_in) == 1, [g.producer[i].name for i in add.input]
    conv_side = list(add.input).index(conv_in[0])
    assert dqs[conv_side] is None  # conv path float: TensorRT fuses Conv+BN+Add(+ReLU)
    assert dqs[1 - conv_side] is not None  # the skip input quantized
    (info,) = details["residual_adds"].values()
    assert info["rule"].startswith("both conv outputs")  # both inputs have a backbone (stem or downsample conv); conv2 is the longer path
    assert info["skip"] == ("lhs", "rhs")[1 - conv_side] and info["conv_path"] == ("lhs", "rhs")[conv_side]
    if downsample:  # the skip input is the downsample conv's output
        q = g.producer[g.dq_of(add.input[1 - conv_side]).input[0]]  # DQ ← Q ← the quantized tensor
        assert q.op_type == "QuantizeLinear"
        source = g.producer[q.input[0]]
        assert source.op_type == "Conv" and "down" in source.name, (source.op_type, source.name)
    assert not details["excluded_small_channel_convs"]


class ActAct(nn.Module):
    """An Add of two activations that no Conv fuses into: both inputs quantized with one scale. (A conv after it: with
    the softmaxes and the Add leading straight to the output, they would be a prediction head, float by its rule.)"""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(3, 16, 3, padding=1)
        self.c = nn.Conv2d(16, 4, 1)

    def forward(self, x):  # a softmax is no conv epilogue (QdqGraph.backbone): neither input is a conv path
        return self.c(torch.softmax(self.a(x), 1) + torch.softmax(torch.relu(self.b(x)) * 3.0, 1))


def test_add_of_two_activations_quantizes_both_with_one_scale(tmp_path):
    g, details = _quantize(ActAct(), tmp_path)
    add, dqs = _add_inputs(g)
    assert all(d is not None for d in dqs)
    s0, s1 = (g.scale(d) for d in dqs)
    assert s0.size == 1 and s0 == s1
    (info,) = details["residual_adds"].values()
    assert info["skip"] == "both" and info["rule"] == "activation+activation"
    assert details["shared_scale_groups"] == [["residual_add_0.lhs_input_quantizer", "residual_add_0.rhs_input_quantizer"]]


def test_maxpool_has_one_qdq_after_it_and_none_inside_conv_relu(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 16, 3, padding=1), nn.LeakyReLU(0.1), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(256, 10))
    g, details = _quantize(model, tmp_path)
    (pool,) = g.nodes("MaxPool")
    assert g.dq_of(pool.input[0]) is None  # pool input float...
    conv2 = [n for n in g.nodes("Conv") if g.producer.get(n.input[0]) is not None][1]
    assert g.dq_of(conv2.input[0]) is not None  # ...its consumer quantized: TensorRT moves that Q across the MaxPool
    assert len(details["excluded_pool_inputs"]) == 2
    # no Q/DQ between a Conv and its activation (ModelOpt would quantize nn.LeakyReLU's input)
    (leaky,) = g.nodes("LeakyRelu")
    assert g.dq_of(leaky.input[0]) is None and details["excluded_inside_conv_chains"] == ["5.input_quantizer"]
    (relu,) = g.nodes("Relu")
    assert g.dq_of(relu.input[0]) is None
    (gemm,) = g.nodes("Gemm")
    assert g.dq_of(gemm.input[0]) is not None and g.dq_of(gemm.input[1]) is not None


def test_conv_transpose_weights_are_per_channel_along_axis_0(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(16, 32, 2, stride=2))
    g, _ = _quantize(model, tmp_path)
    (deconv,) = g.nodes("ConvTranspose")
    dq = g.dq_of(deconv.input[1])
    assert dq is not None and g.dq_of(deconv.input[0]) is not None
    axis = {a.name: a.i for a in dq.attribute}.get("axis", 1)
    assert axis == 0
    assert g.scale(dq).shape == (16,)  # one scale per weight dim 0 (the ConvTranspose's input channels)


def test_small_channel_convs_tensorrt_runs_in_float_are_left_float(tmp_path):
    # 3→8 consuming the input: INT8 (first layer); 8→3 and 3→8 inside the network: not supported by TensorRT in INT8
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1), nn.ReLU(),
                          nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 1))
    g, details = _quantize(model, tmp_path)
    convs = g.nodes("Conv")
    quantized = [g.dq_of(c.input[0]) is not None and g.dq_of(c.input[1]) is not None for c in convs]
    floats = [g.dq_of(c.input[0]) is None and g.dq_of(c.input[1]) is None for c in convs]
    assert quantized == [True, False, False, True]  # 8→16: in 8 (a multiple of 8) and out 16 → INT8
    assert floats == [False, True, True, False]
    assert details["excluded_small_channel_convs"] == ["2", "4"]


# ---- EfficientNet-B0 export check (real data) -------------------------------------------------------------------

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def _images(root, n, size, seed):
    from PIL import Image

    files = sorted(glob.glob(str(root / "*" / "*.png")))
    random.Random(seed).shuffle(files)
    arr = [((np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR), np.float32) / 255 - MEAN) / STD)
           .transpose(2, 0, 1) for f in files[:n]]
    return np.ascontiguousarray(np.stack(arr))


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("method", ["mse", "percentile"])
def test_efficientnet_b0_export_matches_the_fake_quantized_model(method, tmp_path):
    from conftest import shared_path

    import torchvision

    from qdeploy.quantize.calibrate import check_qdq_export

    weights = shared_path("models", "cifar10-dev", "efficientnet_b0_48.pt")
    model = torchvision.models.efficientnet_b0(num_classes=10)
    model.load_state_dict(torch.load(weights, weights_only=True))
    cal = _images(shared_path("data", "cifar10", "train"), 512, 48, seed=0)
    qm, _, details = quantize_torch_model(model.eval(), (cal[i:i + 128] for i in range(0, 512, 128)), 512, method)
    assert details["excluded_pool_inputs"]  # the 16 squeeze-excitation pools + the head's
    path = tmp_path / "eff.onnx"
    export_qdq_onnx(qm, torch.from_numpy(cal[:2]), path, 17)
    x = _images(shared_path("data", "cifar10", "test"), 64, 48, seed=1)
    # EfficientNet-B0's INT8 network is ill-conditioned: the fake-quant model disagrees with itself run in float64
    # (min cosine < 0.99), so the check compares the export with that noise floor; it must pass, and stay close
    result = check_qdq_export(qm, path, x)
    assert result["passed_by"] in ("min cosine", "median cosine (a rounding-tie cascade on a few images)") \
        or result["passed_by"].startswith("within the fake-quant model's own noise")
    assert result["mean_cosine"] >= 0.995, result
    # a real export fault is caught: one weight scale doubled moves the output far beyond the float64 noise
    import onnx
    from qdeploy.errors import QDeployError

    from qdeploy.utils.onnx_graph import OnnxGraph

    m = onnx.load(str(path))
    g = OnnxGraph(m)
    # the DequantizeLinear of a per-channel weight (its Q reads a constant): give it 4x its Q's scale
    q = next(n for n in g.nodes if n.op_type == "QuantizeLinear" and g.is_constant(g.source(n.input[0]))
             and np.ndim(g.constant_value(n.input[1])) == 1)
    dq = next(n for n in g.nodes if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    m.graph.initializer.append(numpy_helper.from_array(g.constant_value(q.input[1]) * 4, "wrong_scale"))
    dq.input[1] = "wrong_scale"
    onnx.save(m, str(tmp_path / "bad.onnx"))
    with pytest.raises(QDeployError, match="does not match ModelOpt's fake-quantized model"):
        check_qdq_export(qm, tmp_path / "bad.onnx", x)


def test_tiny_activations_export_like_the_fake_quantized_model(tmp_path):
    """Activations of ~1e-9 (an untrained MobileNetV2's logits): ModelOpt's fake quantization zeroes anything with
    amax ≤ 2**-24, the exported QuantizeLinear does not; the amax floor sits above that so both agree."""
    from qdeploy.quantize.calibrate import check_qdq_export
    from qdeploy.quantize.modelopt_torch import AMAX_FLOOR

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(),
                          nn.Linear(16 * 8 * 8, 10)).eval()
    with torch.no_grad():
        model[2].weight.mul_(1e-8)
        model[2].bias.zero_()
        model[4].bias.zero_()  # logits come from the tiny activations only
    x = np.random.default_rng(0).normal(size=(8, 3, 8, 8)).astype(np.float32)
    qm, amax, _ = quantize_torch_model(model, [x], 8, "max")
    assert min(min(np.ravel(v)) for v in amax.values()) >= AMAX_FLOOR > 2.0 ** -24
    path = tmp_path / "tiny.onnx"
    export_qdq_onnx(qm, torch.from_numpy(x[:2]), path, 17)
    assert check_qdq_export(qm, path, x)["mean_cosine"] > 0.99


def test_exported_weights_sit_on_the_grid_so_every_reader_rounds_them_like_modelopt(tmp_path):
    """FP16-stored weights put weight/scale near half integers often; ModelOpt rounds w·(127/amax), ONNX Runtime and
    TensorRT round w/scale, and the two disagree there (timm DeiT-tiny: one flipped patch-embedding weight moved the
    export check to cosine 0.94). The export snaps weights to their fake-quantized values: every reader gets ModelOpt's
    integers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()
    with torch.no_grad():  # weights at a float rounding of half a step: what FP16 checkpoints give now and then
        rng = np.random.default_rng(1)
        w = model[2].weight.numpy()
        amax = np.abs(w).reshape(64, -1).max(1)
        k = rng.integers(-120, 120, w.shape)
        ties = ((k + 0.5) * (amax / np.float32(127)).reshape(-1, 1, 1, 1)).astype(np.float32)
        w[:, :, 1:, :] = ties[:, :, 1:, :]  # row 0 keeps each channel's amax
        model[2].weight.copy_(torch.from_numpy(w))
    x = np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32)
    qm, _, _ = quantize_torch_model(model, [x[:8], x[8:]], 16, "max")
    convs = [m for m in qm.modules() if isinstance(m, nn.Conv2d) and getattr(m, "weight_quantizer", None) is not None]

    def disagreements():
        n = 0
        with torch.no_grad():
            for m in convs:
                w = m.weight.numpy()
                s = (m.weight_quantizer.amax.numpy().reshape(-1) / 127).astype(np.float32).reshape(-1, 1, 1, 1)
                ort_int = np.clip(np.rint(w / s), -128, 127)
                n += int(np.sum(ort_int != np.rint(m.weight_quantizer(m.weight).numpy() / s)))
        return n

    assert disagreements() > 0, "no rounding tie in these weights: the test would prove nothing"
    path = tmp_path / "q.onnx"
    export_qdq_onnx(qm, torch.from_numpy(x[:2]), path, 17)
    assert disagreements() == 0
    g = Graph(path)
    for conv in g.nodes("Conv"):
        dq = g.dq_of(conv.input[1])
        q = g.producer[dq.input[0]]
        w, s = g.consts[q.input[0]], g.scale(q)
        ratio = w / s.reshape(-1, 1, 1, 1)
        assert np.abs(ratio - np.rint(ratio)).max() < 1e-3  # exact multiples of the scale: no tie left to resolve


def test_scale_step_noise_floor_leaves_the_model_alone_and_moves_only_rounding(tmp_path):
    """The export check's noise floor reruns the fake-quant model with scales two float32 steps apart (the x·(127/amax)
    vs x/scale difference): outputs move by rounding flips only, and the checked model keeps its own amax."""
    from qdeploy.quantize.calibrate import _with_scales_one_step_apart

    torch.manual_seed(0)
    model = nn.Sequential(_stem(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10)).eval()
    x = np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32)
    qm, amax, _ = quantize_torch_model(model, [x[:8], x[8:]], 16, "max")
    before = {n: m.amax.clone() for n, m in qm.named_modules() if hasattr(m, "amax") and getattr(m, "is_enabled", False)
              and m.amax is not None}
    with torch.inference_mode():
        ref = qm(torch.from_numpy(x)).numpy()
    shifted = _with_scales_one_step_apart(qm, x)
    after = {n: m.amax for n, m in qm.named_modules() if n in before}
    assert all(torch.equal(before[n], after[n]) for n in before)
    cos = (ref * shifted).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(shifted, axis=1)
    assert cos.min() > 0.99  # rounding flips only, not a different model
