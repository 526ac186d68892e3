"""Latency and throughput per batch size.

Each timed iteration is one complete inference on inputs already staged where the engine reads them:
CUDA events + synchronize on the GPU, ``perf_counter`` on the CPU. Warm-up iterations (lazy init,
autotuning, graph capture) are excluded.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from qdeploy.engines.base import Engine
from qdeploy.utils.log import progress


def latency_stats(samples_ms: Sequence[float]) -> dict:
    a = np.asarray(samples_ms, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def fill_batch(images: np.ndarray, batch_size: int) -> np.ndarray:
    """A batch of real images (repeated if there are fewer than ``batch_size``)."""
    reps = -(-batch_size // len(images))
    return np.ascontiguousarray(np.concatenate([images] * reps)[:batch_size])


def time_iterations(engine: Engine, step, warmup: int, iterations: int, advance=None) -> list[float]:
    timer = engine.timer()
    for _ in range(warmup):
        step()
    engine.synchronize()
    samples = []
    for _ in range(iterations):
        if timer is not None:
            samples.append(timer.time_ms(step))
        else:
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
        if advance:
            advance()
    return samples


def benchmark(engine: Engine, images: np.ndarray, batch_sizes: Sequence[int], warmup: int, iterations: int) -> dict:
    """``images``: preprocessed float32 (N, C, H, W) real inputs. Returns latency/throughput keyed by batch size."""
    latency, samples_out, throughput = {}, {}, {}
    with progress(f"bench {engine.variant.label}", len(batch_sizes) * iterations) as advance:
        for bs in batch_sizes:
            step = engine.prepare_timed(fill_batch(images, bs))
            samples = time_iterations(engine, step, warmup, iterations, advance)
            stats = latency_stats(samples)
            key = str(bs)
            latency[key] = stats
            samples_out[key] = [round(s, 5) for s in samples]
            throughput[key] = bs * 1000.0 / stats["mean"]
    return {"latency_ms": latency, "latency_samples_ms": samples_out, "throughput_ips": throughput}
