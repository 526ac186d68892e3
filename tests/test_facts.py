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
