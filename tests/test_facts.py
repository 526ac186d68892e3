"""Engine facts (qdeploy.facts): plain functions of the machine, tested on flag sets."""
from qdeploy.facts.onnxruntime import reduce_range_reason, u8s8_saturates


def test_u8s8_saturates_exactly_without_vnni():
    assert u8s8_saturates(["avx2", "fma"])                    # AVX2 only: VPMADDUBSW saturates int16 sums
    assert u8s8_saturates(["avx2", "avx512f"])                # AVX-512 without VNNI: still VPMADDUBSW
    assert not u8s8_saturates(["avx2", "avx512f", "avx512_vnni"])
    assert not u8s8_saturates(["avx2", "avx_vnni"])           # AVX-VNNI (Alder Lake and later)
    assert reduce_range_reason(True) and "VNNI" in reduce_range_reason(True) and reduce_range_reason(False) is None
