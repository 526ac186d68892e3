"""Metrics against hand-computed values, and latency statistics."""
import time

import numpy as np
import pytest

from qdeploy.benchmark.latency import NOISY_CV, benchmark, best_repeat, fill_batch, latency_stats
from qdeploy.config import VariantSpec
from qdeploy.engines.base import Engine
from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.engines.base import NoOptions, Variant
from qdeploy.utils.memory import MemoryProbe
from qdeploy.evaluate import ClassificationMetrics, SegmentationMetrics, agreement


def test_topk_accumulates_over_batches():
    m = ClassificationMetrics()
    logits = np.array([[0.1, 0.9, 0, 0, 0, 0], [0.8, 0.1, 0.05, 0.03, 0.02, 0], [0, 0, 0, 0, 0.1, 0.2]])
    m.update(logits[:2], np.array([1, 2]))  # hit, top-3 only
    m.update(logits[2:], np.array([0]))  # 0 is tied-lowest → outside top-5 of 6 classes only if ranked 6th
    r = m.result()
    assert r["samples"] == 3 and r["top1"] == pytest.approx(1 / 3)
    ranks = np.argsort(-logits[2], kind="stable")
    expected_top5 = (2 + int(0 in ranks[:5])) / 3
    assert r["top5"] == pytest.approx(expected_top5)
    assert m.predictions.tolist() == [1, 0, 5]


def test_miou_from_one_confusion_matrix_ignores_void():
    m = SegmentationMetrics(num_classes=3, ignore_index=255, class_names=["a", "b", "c"])
    labels = np.array([[[0, 0, 1, 255]], [[2, 2, 2, 1]]])
    pred = np.array([[[0, 1, 1, 2]], [[2, 2, 0, 1]]])
    logits = np.eye(3)[pred].transpose(0, 3, 1, 2)  # one-hot logits whose argmax is `pred`
    m.update(logits[:1], labels[:1])
    m.update(logits[1:], labels[1:])
    r = m.result()
    # class a: tp1 fp1 fn1 → 1/3; b: tp2 fp1 fn0 → 2/3; c: tp2 fp0 fn1 → 2/3 (void pixel predicted c is ignored)
    assert r["per_class_iou"] == pytest.approx({"a": 1 / 3, "b": 2 / 3, "c": 2 / 3})
    assert r["miou"] == pytest.approx((1 / 3 + 2 / 3 + 2 / 3) / 3)
    assert r["pixel_acc"] == pytest.approx(5 / 7)
    assert r["excluded_pixels"] == 1


def test_absent_class_is_none_and_left_out_of_the_mean():
    m = SegmentationMetrics(num_classes=3, ignore_index=255)
    m.update_predictions(np.array([[[0, 1]]]), np.array([[[0, 1]]]))
    r = m.result()
    assert r["per_class_iou"]["2"] is None and r["miou"] == 1.0


def test_agreement():
    assert agreement(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])) == 0.75
    assert agreement(np.array([1]), np.array([1, 2])) is None


def test_latency_stats_and_fill_batch():
    s = latency_stats(list(range(1, 101)))
    assert s["mean"] == 50.5 and s["p50"] == 50.5 and s["min"] == 1 and s["max"] == 100
    assert s["p99"] == pytest.approx(99.01) and s["p90"] == pytest.approx(90.1)
    assert s["cv"] == pytest.approx(np.std(np.arange(1, 101), ddof=1) / 50.5) and s["noisy"] is True
    imgs = np.arange(3 * 2, dtype=np.float32).reshape(3, 2, 1, 1)
    b = fill_batch(imgs, 7)
    assert b.shape == (7, 2, 1, 1) and b[3, 0, 0, 0] == imgs[0, 0, 0, 0]


def test_memory_probe_sees_a_real_allocation():
    import mmap

    with MemoryProbe() as probe:
        # fresh pages from the OS: a malloc'ed block could reuse heap memory that is already resident
        block = mmap.mmap(-1, 64 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1  # touch every page: 64 MiB resident
        block.close()
    r = probe.result()
    assert r["rss_delta"] >= 50, r
    assert r["rss_peak"] >= r["rss_delta"]


# ----------------------------------------------------------------------------- timing honesty
class ScheduledEngine(Engine):
    """A real engine over numpy whose timed step sleeps ``delays_ms[k]`` on its k-th call: a stand-in for
    a machine whose load changes between repeats, with a known answer for which repeat is the best."""

    name = "scheduled"

    @classmethod
    def probe(cls):
        return [{"engine": cls.name, "device": "cpu", "precisions": ["fp32"], "usable": True, "note": "test engine"}]

    @classmethod
    def artifact(cls, variant):
        return ArtifactRequest(ArtifactKind.ONNX_FP32)

    def __init__(self, delays_ms):
        spec = VariantSpec(engine="scheduled", name="scheduled")
        super().__init__(Variant(spec, "scheduled", type(self), NoOptions(), 0), artifact=None)
        self.delays_ms = list(delays_ms)
        self.calls = 0

    def load(self):
        pass

    def infer(self, batch):
        return batch.reshape(len(batch), -1).mean(axis=1, keepdims=True)

    def prepare_timed(self, batch):
        def step():
            delay = self.delays_ms[min(self.calls, len(self.delays_ms) - 1)]
            self.calls += 1
            time.sleep(delay / 1e3)
            return self.infer(batch)

        return step

    def describe(self):
        return {"delays_ms": self.delays_ms}


def test_latency_stats_cv_and_noisy_flag():
    steady = latency_stats([10.0, 10.2, 9.9, 10.1, 10.0])
    assert steady["cv"] < NOISY_CV and steady["noisy"] is False
    jumpy = latency_stats([10.0, 20.0, 10.0, 20.0])
    assert jumpy["cv"] == pytest.approx(np.std([10, 20, 10, 20], ddof=1) / 15) and jumpy["noisy"] is True
    assert latency_stats([3.0])["cv"] == 0.0  # one sample: no spread, not noisy
    assert NOISY_CV == 0.10


def test_best_repeat_keeps_the_lowest_median():
    samples, stats = best_repeat([[5, 5, 5], [1, 2, 9], [2, 2, 2]])
    assert samples == [1, 2, 9]  # median 2, first of the two repeats with median 2
    assert stats["repeats"] == 3 and stats["repeat_p50s"] == [5.0, 2.0, 2.0]
    assert stats["p50"] == 2.0 and stats["mean"] == pytest.approx(4.0)  # the kept repeat's own stats
    with pytest.raises(ValueError):
        best_repeat([])


@pytest.mark.slow
def test_benchmark_repeats_keep_the_fastest_repeat():
    # warm-up until stable: windows of 5 calls and 50 ms; with 10 warm-up calls of >= 11 ms at a constant speed
    # the two windows inside the minimum already agree, so each repeat makes exactly warmup + iterations calls
    warmup, iterations = 10, 6
    per_repeat = warmup + iterations
    # repeat 0 is slow (busy machine), repeat 1 fast, repeat 2 in between; batch size 2 then runs at 13 ms
    delays = [24.0] * per_repeat + [11.0] * per_repeat + [16.0] * per_repeat + [13.0]
    engine = ScheduledEngine(delays)
    images = np.random.default_rng(0).random((3, 3, 4, 4), dtype=np.float32)
    out = benchmark(engine, images, [1, 2], warmup=warmup, iterations=iterations, repeats=3)
    assert engine.calls == 2 * 3 * per_repeat  # warm-up repeated with every repeat, for every batch size
    lat = out["latency_ms"]["1"]
    assert lat["warmup_calls"] == [warmup] * 3
    assert lat["repeats"] == 3 and len(lat["repeat_p50s"]) == 3
    p50s = lat["repeat_p50s"]
    assert p50s.index(min(p50s)) == 1 and p50s[0] > p50s[2] > p50s[1]
    assert lat["p50"] == min(p50s)  # the kept repeat is the best one
    assert 11.0 <= lat["p50"] < 16.0
    assert len(out["latency_samples_ms"]["1"]) == iterations
    assert out["throughput_ips"]["1"] == pytest.approx(1000.0 / lat["mean"])
    assert out["throughput_ips"]["2"] == pytest.approx(2000.0 / out["latency_ms"]["2"]["mean"])
    assert isinstance(lat["noisy"], bool) and lat["cv"] >= 0


def test_benchmark_flags_noisy_timings():
    # alternating fast/slow iterations from the first call on: however many calls the warm-up makes until stable
    engine = ScheduledEngine([1.0, 8.0] * 60)
    out = benchmark(engine, np.zeros((1, 3, 2, 2), np.float32), [1], warmup=1, iterations=10)
    lat = out["latency_ms"]["1"]
    assert lat["repeats"] == 1 and len(lat["repeat_p50s"]) == 1
    assert lat["cv"] > NOISY_CV and lat["noisy"] is True
    with pytest.raises(ValueError, match="repeats"):
        benchmark(engine, np.zeros((1, 3, 2, 2), np.float32), [1], warmup=0, iterations=1, repeats=0)
