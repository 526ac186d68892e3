"""Latency and throughput per batch size.

Each timed iteration is one complete inference on inputs already staged where the engine reads them:
CUDA events + synchronize on the GPU, ``perf_counter`` on the CPU. Warm-up iterations (lazy init,
autotuning, graph capture) are excluded.

Honesty about noise: every batch size reports the coefficient of variation (CV = std/mean) of its
samples and a ``noisy`` flag above :data:`NOISY_CV`. With ``repeats > 1`` the whole timing of a batch
size (warm-up + iterations) is run several times and the repeat with the lowest median is kept: a
background burst on a shared machine slows a whole repeat, and the best one is the closest to what the
model costs on an idle machine; every repeat's median is kept too, so the spread stays visible.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from qdeploy.utils.log import progress

if TYPE_CHECKING:  # annotations only: the report imports NOISY_CV and must not pull in torch through engines
    from qdeploy.engines.base import Engine

# Above this CV (std/mean of the kept samples) a timing is flagged as noisy in results and reports.
NOISY_CV = 0.10


def latency_stats(samples_ms: Sequence[float]) -> dict:
    """Summary of per-iteration latencies (ms): mean, std, percentiles, min/max, ``cv`` and ``noisy``."""
    a = np.asarray(samples_ms, dtype=np.float64)
    mean = float(a.mean())
    std = float(a.std(ddof=1)) if len(a) > 1 else 0.0
    cv = std / mean if mean > 0 else 0.0
    return {
        "mean": mean,
        "std": std,
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
        "cv": cv,
        "noisy": cv > NOISY_CV,
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


def best_repeat(repeats: Sequence[Sequence[float]]) -> tuple[list[float], dict]:
    """The repeat with the lowest median, its stats, plus ``repeats`` and every repeat's median."""
    if not repeats:
        raise ValueError("best_repeat needs at least one repeat of samples")
    medians = [float(np.percentile(np.asarray(r, dtype=np.float64), 50)) for r in repeats]
    best = int(np.argmin(medians))  # first of equal medians: deterministic
    stats = latency_stats(repeats[best])
    stats["repeats"] = len(repeats)
    stats["repeat_p50s"] = medians
    return list(repeats[best]), stats


def benchmark(engine: Engine, images: np.ndarray, batch_sizes: Sequence[int], warmup: int, iterations: int,
              repeats: int = 1) -> dict:
    """``images``: preprocessed float32 (N, C, H, W) real inputs. Returns latency/throughput keyed by batch size.

    With ``repeats > 1`` each batch size is timed ``repeats`` times (warm-up included each time) and the
    repeat with the lowest median is kept: its samples, its stats and its throughput. Throughput is
    sustained throughput, batch size / mean latency of back-to-back inferences of the kept repeat.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    latency, samples_out, throughput = {}, {}, {}
    with progress(f"bench {engine.variant.label}", len(batch_sizes) * iterations * repeats) as advance:
        for bs in batch_sizes:
            step = engine.prepare_timed(fill_batch(images, bs))
            runs = [time_iterations(engine, step, warmup, iterations, advance) for _ in range(repeats)]
            samples, stats = best_repeat(runs)
            key = str(bs)
            latency[key] = stats
            samples_out[key] = [round(s, 5) for s in samples]
            throughput[key] = bs * 1000.0 / stats["mean"]
    return {"latency_ms": latency, "latency_samples_ms": samples_out, "throughput_ips": throughput}
