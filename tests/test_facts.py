"""Engine facts (qdeploy.facts): plain functions of the machine or a layer, tested on flag sets and small layers."""
import pytest

from qdeploy.facts.onnxruntime import reduce_range_reason, u8s8_saturates


def test_u8s8_saturates_exactly_without_vnni():
    assert u8s8_saturates(["avx2", "fma"])                    # AVX2 only: VPMADDUBSW saturates int16 sums
    assert u8s8_saturates(["avx2", "avx512f"])                # AVX-512 without VNNI: still VPMADDUBSW
    assert not u8s8_saturates(["avx2", "avx512f", "avx512_vnni"])
    assert not u8s8_saturates(["avx2", "avx_vnni"])           # AVX-VNNI (Alder Lake and later)
    assert reduce_range_reason(True) and "VNNI" in reduce_range_reason(True) and reduce_range_reason(False) is None


def test_torchao_quantizes_only_the_linear_layers_its_matmul_kernel_takes():
    """torch._int_mm needs in and out features that are multiples of 8 and more than 16 rows, and torchao's INT8 dynamic
    scheme checks neither: a 10-class head failed the whole candidate at its first call on the GPU, and a head fed one
    pooled vector an image has as many rows as the batch (1 at batch 1). Such layers stay in float; a layer on tokens
    is quantized."""
    pytest.importorskip("torchao", reason="torchao is a dependency; this environment lacks it")
    import torch

    from qdeploy.facts.torchao import apply_torchao, quantizable, rows_per_image

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(64, 32)      # on 20 tokens an image
            self.proj = torch.nn.Linear(32, 16)     # on the pooled vector: rows = batch
            self.head = torch.nn.Linear(16, 10)     # 10 classes: not a multiple of 8
            self.unused = torch.nn.Linear(64, 64)   # never called

        def forward(self, x):
            return self.head(self.proj(self.mlp(x).mean(1)))

    model = Tokens().eval()
    x = torch.randn(4, 20, 64)
    rows = rows_per_image(model, x)
    assert rows == {model.mlp: 20, model.proj: 1, model.head: 1}
    layers = [model.mlp, model.proj, model.head, model.unused]
    assert [quantizable("int8-dynamic", m, rows.get(m)) for m in layers] == [True, False, False, False]
    assert [quantizable("float8-dynamic", m, rows.get(m)) for m in layers] == [True, True, False, True]
    assert [quantizable("int8-weight-only", m, rows.get(m)) for m in layers] == [True, True, True, True]
    with pytest.raises(ValueError, match="example input"):
        apply_torchao(model, "int8-dynamic")
    apply_torchao(model, "int8-dynamic", example=x)
    assert [type(m.weight.data) is torch.Tensor for m in layers] == [False, True, True, True]
    assert not quantizable("int8-dynamic", model.mlp, 20)  # quantized once
    assert model(x).shape == (4, 10)


def test_a_patch_convolution_as_one_matmul_gives_the_convolutions_output_and_exports_with_a_dynamic_batch():
    """facts/patch_matmul.py: a convolution whose stride equals its kernel is one matmul over the patches; the rewrite
    must give the convolution's output for square and non-square kernels, without a bias, on channels_last input and
    on an input whose size is not a multiple of the kernel (the convolution drops the remainder), and leave every
    other convolution alone."""
    import torch
    from torch import nn

    from qdeploy.facts.patch_matmul import PatchMatmul, is_patch_convolution, patch_convolutions, \
        rewrite_patch_convolutions

    torch.manual_seed(0)
    for conv, size in ((nn.Conv2d(3, 24, 16, 16), (64, 64)), (nn.Conv2d(3, 8, 4, 4, bias=False), (30, 21)),
                       (nn.Conv2d(5, 6, (2, 4), (2, 4)), (9, 17))):
        x = torch.randn(3, conv.in_channels, *size)
        want = conv(x)
        for inp in (x, x.contiguous(memory_format=torch.channels_last)):
            got = PatchMatmul(conv)(inp)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not is_patch_convolution(nn.Conv2d(3, 8, 4, 4, padding=1))
    assert not is_patch_convolution(nn.Conv2d(3, 8, 3, 2))         # overlapping windows
    assert not is_patch_convolution(nn.Conv2d(8, 8, 2, 2, groups=8))
    assert not is_patch_convolution(nn.Conv2d(3, 8, 1))            # a matmul already
    assert not is_patch_convolution(type("StdConv", (nn.Conv2d,), {})(3, 8, 4, 4))  # its own forward

    class TinyViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
            self.patch = nn.Conv2d(16, 32, 8, 8)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            tokens = self.patch(self.stem(x)).flatten(2).transpose(1, 2)
            return self.head(tokens.mean(1))

    model = TinyViT().eval()
    x = torch.randn(2, 3, 32, 32)
    want = model(x)
    assert patch_convolutions(model) == ["patch"]
    assert rewrite_patch_convolutions(model) == ["patch"] and isinstance(model.patch, PatchMatmul)
    assert isinstance(model.stem[0], nn.Conv2d) and patch_convolutions(model) == []
    torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)
    from qdeploy.artifacts.torch_program import ProgramSettings, export_dynamic_batch

    ep = export_dynamic_batch(model, ProgramSettings(device="cpu", precision="fp32", input_shape=(3, 32, 32)))
    x3 = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(ep.module()(x3), model(x3), rtol=1e-4, atol=1e-4)


def test_a_depthwise_convolution_as_a_stencil_gives_the_convolutions_output_for_every_padding_stride_and_dtype():
    """facts/depthwise_stencil.py: the sum of the kernel's shifted taps is the depthwise convolution, for odd and even
    kernels, strides, dilation, "same" / "valid" / explicit asymmetric-free padding, with and without a bias, on
    channels_last input, and in half precision summed in FP32 (the output in the input's dtype); every other
    convolution is left alone."""
    import torch
    from torch import nn

    from qdeploy.facts.depthwise_stencil import DepthwiseStencil, depthwise_convolutions, is_depthwise_convolution, \
        rewrite_depthwise_convolutions

    torch.manual_seed(0)
    cases = ((7, 1, 3, 1, True), (3, 2, 1, 1, False), (5, 2, 2, 1, True), (3, 1, 2, 2, True), (3, 1, "same", 1, True),
             (4, 1, "same", 1, False), (3, 1, "valid", 1, True), ((3, 5), (2, 1), (1, 2), 1, True))
    for k, stride, pad, dil, bias in cases:
        conv = nn.Conv2d(6, 6, k, stride=stride, padding=pad, dilation=dil, groups=6, bias=bias).eval()
        x = torch.randn(2, 6, 13, 16)
        want = conv(x)
        for inp in (x, x.contiguous(memory_format=torch.channels_last)):
            got = DepthwiseStencil(conv)(inp)
            assert got.shape == want.shape and got.dtype == inp.dtype, (k, stride, pad)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    conv = nn.Conv2d(16, 16, 7, padding=3, groups=16).eval()
    x = torch.randn(1, 16, 12, 12)
    got = DepthwiseStencil(conv).half()(x.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), conv(x), rtol=2e-2, atol=2e-2)
    assert not is_depthwise_convolution(nn.Conv2d(8, 8, 1, groups=8))       # a per-channel scale
    assert not is_depthwise_convolution(nn.Conv2d(8, 16, 3, groups=8))      # two filters a group
    assert not is_depthwise_convolution(nn.Conv2d(8, 8, 3, groups=4))       # grouped, not depthwise
    assert not is_depthwise_convolution(nn.Conv2d(8, 8, 3, groups=8, padding=1, padding_mode="reflect"))
    assert not is_depthwise_convolution(type("SameConv", (nn.Conv2d,), {})(8, 8, 3, groups=8))  # its own forward

    import torchvision

    model = torchvision.models.mobilenet_v3_small(num_classes=4).eval()
    x = torch.randn(2, 3, 64, 64)
    want = model(x)
    names = depthwise_convolutions(model)
    assert len(names) == 11 and rewrite_depthwise_convolutions(model) == names and depthwise_convolutions(model) == []
    torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)


def test_the_model_rewrites_table_applies_each_rewrite_asked_for_and_refuses_an_unknown_one():
    """facts/model_rewrites.py: what the engine times and what the program saves apply the rewrites from one table."""
    import pytest
    import torch
    from torch import nn

    from qdeploy.artifacts.torch_program import ProgramSettings
    from qdeploy.engines.torch_engine import TorchOptions
    from qdeploy.facts.model_rewrites import REWRITES, apply_rewrites

    model = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.Conv2d(8, 8, 3, padding=1, groups=8)).eval()
    x = torch.randn(1, 3, 16, 16)
    want = model(x)
    assert apply_rewrites(model, ["depthwise_stencil", "patch_matmul"]) == {"patch_matmul": ["0"],
                                                                           "depthwise_stencil": ["1"]}
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown model rewrite"):
        apply_rewrites(model, ["winograd"])
    for name in REWRITES:  # each rewrite is a flag of both the engine's options and the saved program's settings
        assert name in TorchOptions.model_fields and name in ProgramSettings.__dataclass_fields__


def test_a_saved_program_with_the_patch_matmul_has_no_convolution_left_and_gives_the_models_output(tmp_path):
    """artifacts/torch_program.save_program applies the rewrite before export (ProgramSettings.patch_matmul), so the
    saved graph, which a fresh process loads without qdeploy, runs the matmul and not the convolution."""
    import torch
    from torch import nn

    from qdeploy.artifacts.torch_program import ProgramSettings, save_program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 4, 4), nn.Flatten(), nn.Linear(16 * 4 * 4, 5)).eval()
    manifest = save_program(model, ProgramSettings(device="cpu", precision="fp32", patch_matmul=True,
                                                   batch_sizes=(1, 2), input_shape=(3, 16, 16)), tmp_path)
    assert manifest["patch_matmul"] is True
    ep = torch.export.load(str(tmp_path / manifest["programs"]["dynamic"]))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("conv" in o for o in ops), ops
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-4, atol=1e-4)
    assert isinstance(model[0], nn.Conv2d)  # the user's model is not rewritten


def test_a_saved_program_with_depthwise_stencils_has_no_convolution_left_and_gives_the_models_output(tmp_path):
    """save_program applies the stencil rewrite before export (ProgramSettings.depthwise_stencil): the saved graph
    holds no convolution, and loaded without qdeploy it gives the model's output."""
    import torch
    from torch import nn

    from qdeploy.artifacts.torch_program import ProgramSettings, save_program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 5, padding=2, groups=3), nn.Flatten(), nn.Linear(3 * 8 * 8, 5)).eval()
    manifest = save_program(model, ProgramSettings(device="cpu", precision="fp32", depthwise_stencil=True,
                                                   batch_sizes=(1, 2), input_shape=(3, 8, 8)), tmp_path)
    assert manifest["depthwise_stencil"] is True
    ep = torch.export.load(str(tmp_path / manifest["programs"]["dynamic"]))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("conv" in o for o in ops), ops
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    assert isinstance(model[0], nn.Conv2d)


class _Mlp:
    """An MLP block as timm / torchvision / Hugging Face write it, on tokens (B, N, C) and on NHWC maps (ConvNeXt)."""

    @staticmethod
    def build(shared_hidden: bool = False, bias: bool = True):
        import torch
        from torch import nn

        class Mlp(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.act, self.fc2 = nn.Linear(8, 32, bias=bias), nn.GELU(), nn.Linear(32, 8)
                self.side = nn.Linear(32, 8)

            def forward(self, x):
                h = self.fc1(x)
                y = self.fc2(self.act(h))
                return y + self.side(h) if shared_hidden else y  # the Linear's output used twice: not fused

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.mlp, self.head = nn.Conv2d(3, 8, 4, 4), Mlp(), nn.Linear(8, 5)

            def forward(self, x):
                t = self.embed(x).permute(0, 2, 3, 1)    # NHWC, as ConvNeXt's block
                t = t + self.mlp(t)
                return self.head(self.mlp(t.flatten(1, 2)).mean(1))   # tokens, as a ViT's block

        torch.manual_seed(0)
        return Net().eval()


def test_a_linear_and_its_gelu_become_one_matmul_with_the_gelu_epilogue_for_tokens_and_maps():
    """facts/gelu_epilogue.rewrite: every Linear whose only user is a GELU, on 4-D (NHWC) and 3-D (tokens) inputs,
    becomes one _addmm_activation in a program exported again with a dynamic batch; the output is the model's (the CPU
    kernel computes the erf GELU; CUDA's epilogue the tanh one, within 5e-4)."""
    import torch
    from torch.export import Dim

    from qdeploy.facts.gelu_epilogue import count_fused, has_linear_and_gelu, linear_gelu_pairs, rewrite

    model = _Mlp.build()
    args, dyn = (torch.randn(2, 3, 16, 16),), ({0: Dim("batch", min=1)},)
    ep = torch.export.export(model, args, dynamic_shapes=dyn, strict=False)
    assert len(linear_gelu_pairs(ep.graph)) == 2 and count_fused(ep) == 0
    fused, pairs = rewrite(ep, args, dyn)
    assert pairs == 2 and count_fused(fused) == 2
    assert not any(n.target is torch.ops.aten.gelu.default for n in fused.graph.nodes)
    for batch in (1, 5):
        x = torch.randn(batch, 3, 16, 16)
        torch.testing.assert_close(fused.module()(x), model(x), rtol=1e-5, atol=1e-5)
    assert has_linear_and_gelu(model) and not has_linear_and_gelu(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_linear_whose_output_is_used_twice_or_has_no_bias_is_not_fused():
    import torch
    from torch.export import Dim

    from qdeploy.facts.gelu_epilogue import linear_gelu_pairs, rewrite

    for model in (_Mlp.build(shared_hidden=True), _Mlp.build(bias=False)):
        args, dyn = (torch.randn(2, 3, 16, 16),), ({0: Dim("batch", min=1)},)
        ep = torch.export.export(model, args, dynamic_shapes=dyn, strict=False)
        assert linear_gelu_pairs(ep.graph) == []
        assert rewrite(ep, args, dyn) == (ep, 0)


def test_a_saved_program_with_the_gelu_epilogue_loads_without_qdeploy_and_refuses_a_model_without_a_pair(tmp_path):
    """save_program rewrites the exported graph (ProgramSettings.gelu_epilogue): what a fresh process loads holds the
    fused operator and gives the model's output; asked for on a model without a Linear → GELU it raises instead of
    saving the base program under the rewrite's name."""
    import torch
    from torch import nn

    from qdeploy.artifacts.torch_program import ProgramSettings, save_program

    model = _Mlp.build()
    settings = ProgramSettings(device="cpu", precision="fp32", gelu_epilogue=True, batch_sizes=(1, 2),
                               input_shape=(3, 16, 16))
    manifest = save_program(model, settings, tmp_path / "fused")
    assert manifest["gelu_epilogue"] is True
    ep = torch.export.load(str(tmp_path / "fused" / manifest["programs"]["dynamic"]))
    assert sum(n.target is torch.ops.aten._addmm_activation.default for n in ep.graph.nodes) == 2
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no Linear"):
        save_program(nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 5)).eval(), settings, tmp_path / "none")
