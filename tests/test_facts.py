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
    """torch._int_mm needs in and out features that are multiples of 8 and torchao's INT8 dynamic scheme does not check:
    a 10-class head failed the whole candidate at its first call on the GPU. Such layers stay in float."""
    pytest.importorskip("torchao", reason="torchao is a dependency; this environment lacks it")
    import torch

    from qdeploy.facts.torchao import apply_torchao, quantizable

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))
    assert [quantizable("int8-dynamic", m) for m in model] == [True, False, False]
    assert [quantizable("float8-dynamic", m) for m in model] == [True, False, False]
    assert [quantizable("int8-weight-only", m) for m in model] == [True, False, True]
    apply_torchao(model, "int8-dynamic")
    assert type(model[0].weight.data) is not torch.Tensor and type(model[2].weight.data) is torch.Tensor
    assert not quantizable("int8-dynamic", model[0])  # quantized once
