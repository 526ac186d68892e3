"""Latency and throughput per batch size.

Each timed iteration is one complete inference on inputs already staged where the engine reads them:
CUDA events + synchronize on the GPU, ``perf_counter`` on the CPU. Warm-up iterations (lazy init,
autotuning, graph capture, caches and clocks settling) are excluded: the warm-up runs at least
``bench.warmup`` calls and then goes on until the engine stops getting faster (:func:`warm_up`).

Honesty about noise: every batch size reports the coefficient of variation (CV = std/mean) of its
samples, and ``noisy`` with a ``noisy_reason`` when the timing is not one number (:func:`noise_reasons`):
``scatter`` (the samples pin the p50 down no better than ±:data:`NOISY_P50`), ``drift`` (the first and the last third of the iterations run
at different speeds: an unfinished warm-up or a load change, which a low CV does not show) or ``batch``
(a batch slower than a larger batch of the same variant, :func:`flag_batch_inversions`). With
``repeats > 1`` the whole timing of a batch size (warm-up + iterations) is run several times and the
repeat with the lowest median is kept: a background burst on a shared machine slows a whole repeat, and
the best one is the closest to what the model costs on an idle machine; every repeat's median is kept
too, so the spread stays visible.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from qdeploy.utils.log import progress

if TYPE_CHECKING:  # annotations only: the report imports NOISY_CV and must not pull in torch through engines
    from qdeploy.engines.base import Engine

# The spread of a timing we tolerate: 10 %. Records written before noisy_reason existed were flagged on their CV
# (std/mean) above it (report.tables.noisy reads them so).
NOISY_CV = 0.10
# Scatter is judged on the headline itself, the p50: a timing is noisy when the samples pin their median down no better
# than ±NOISY_P50 (half of the 10 % band), by the distribution-free 95 % confidence interval of a median (the order
# statistics at ranks n/2 ± 1.96·√n/2; Conover, Practical Nonparametric Statistics, 1999). Not on std/mean: on a
# shared machine a few preempted calls put the CV at 15-30 % while the p50 moves by under 2 % from run to run (the
# digits demo on 2 cores: CV 16-34 %, median interval ±0.2-5.5 %, p50s of two runs within 8 %); and a bimodal timing
# whose two levels each hold about half the calls, whose p50 can land on either level, gets a wide interval whatever
# its CV.
NOISY_P50 = 0.05
# Drift: the medians of the first and the last third of the timed iterations differ by more than this share.
# The same 10 % as the scatter bar: a timing whose level moves by more than the spread we tolerate is not
# one number. It must also exceed DRIFT_SIGMAS standard errors of that difference (from the thirds' own
# spread), so that a short or widely scattered series is not called drifting by chance: with 33 samples
# per third at a CV of 10 %, one third's median has a standard error of about 1.25 × 10 % / √33 ≈ 2 %.
NOISY_DRIFT = 0.10
DRIFT_SIGMAS = 3.0
DRIFT_MIN_PER_THIRD = 5  # the median of fewer samples is mostly their own scatter: no drift judged below 15 iterations
# A batch of N images cannot take less time than a batch of fewer in the same engine (it does at least the
# same work): when the smaller batch's p50 exceeds the larger one's by more than the scatter we tolerate
# (equal costs, e.g. a GPU bound by launch latency, can invert by that much), the smaller one was timed
# while something else slowed it.
NOISY_BATCH = NOISY_CV

# Warm-up until stable: windows of at least WARMUP_WINDOW_CALLS calls (a median of 5 ignores 2 preempted
# calls) and WARMUP_WINDOW_S seconds (longer than a CPU frequency governor's update period, ~10 ms, and a
# scheduler time slice, a few ms: a window sees one settled level, not a ramp). It stops once a window's
# median is less than WARMUP_SETTLED below the one before (5 %, half the scatter bar, the same rule as the
# saved program's load_model.py), or after WARMUP_MAX_S: an engine still getting faster after that is
# sharing the machine rather than warming up, and the drift check then says so.
WARMUP_WINDOW_CALLS = 5
WARMUP_WINDOW_S = 0.05
WARMUP_SETTLED = 0.05
WARMUP_MAX_S = 10.0


def _ms(x: float) -> str:
    """A latency with three significant digits at least: 88.0, 5.00, 0.0410."""
    digits = max(1, 2 - math.floor(math.log10(x))) if x > 0 else 1
    return f"{x:.{digits}f}"


def median_interval(samples_ms: Sequence[float]) -> tuple[float, float]:
    """The distribution-free 95 % confidence interval of the median of ``samples_ms`` (order statistics at ranks
    n/2 ± 1.96·√n/2, clipped to the samples)."""
    a = np.sort(np.asarray(samples_ms, dtype=np.float64))
    half = 1.96 * math.sqrt(len(a)) / 2
    lo, hi = max(0, math.floor(len(a) / 2 - half)), min(len(a) - 1, math.ceil(len(a) / 2 + half))
    return float(a[lo]), float(a[hi])


def noise_reasons(samples_ms: Sequence[float]) -> list[str]:
    """Why a series of per-iteration latencies is not one number: ``"scatter: p50 0.254 ms ± 5.5 % (95 % interval
    of the median 0.240-0.268 ms)"`` and/or ``"drift: first third median 88.0 ms, last third 40.1 ms"``; [] for a
    steady timing."""
    a = np.asarray(samples_ms, dtype=np.float64)
    reasons = []
    if len(a) > 1:
        median = float(np.median(a))
        lo, hi = median_interval(a)
        half = (hi - lo) / 2 / median if median > 0 else 0.0
        if half > NOISY_P50:
            reasons.append(f"scatter: p50 {_ms(median)} ms ± {100 * half:.1f} % (95 % interval of the median "
                           f"{_ms(lo)}-{_ms(hi)} ms)")
    third = len(a) // 3
    if third >= DRIFT_MIN_PER_THIRD:
        first, last = a[:third], a[-third:]
        m1, m3 = float(np.median(first)), float(np.median(last))
        # robust spread (MAD) inside the thirds: a drift between them does not inflate it
        sigma = 1.4826 * 0.5 * (np.median(np.abs(first - m1)) + np.median(np.abs(last - m3)))
        se_diff = 1.2533 * sigma * math.sqrt(2.0 / third)  # standard error of a difference of two medians
        shift = abs(m3 - m1)
        if shift > NOISY_DRIFT * min(m1, m3) and shift > DRIFT_SIGMAS * se_diff:
            reasons.append(f"drift: first third median {_ms(m1)} ms, last third {_ms(m3)} ms")
    return reasons


def latency_stats(samples_ms: Sequence[float]) -> dict:
    """Summary of per-iteration latencies (ms): mean, std, percentiles, min/max, ``cv``, ``noisy`` and
    ``noisy_reason`` (None, or "kind: detail" clauses joined by "; ", kinds scatter, drift, batch)."""
    a = np.asarray(samples_ms, dtype=np.float64)
    mean = float(a.mean())
    std = float(a.std(ddof=1)) if len(a) > 1 else 0.0
    cv = std / mean if mean > 0 else 0.0
    reasons = noise_reasons(a)
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
        "noisy": bool(reasons),
        "noisy_reason": "; ".join(reasons) or None,
    }


def flag_batch_inversions(latency: Mapping[str, dict]) -> None:
    """Mark noisy (kind ``batch``) every batch size whose p50 exceeds a larger batch size's p50 of the same
    variant by more than :data:`NOISY_BATCH`. ``latency``: :func:`latency_stats` dicts keyed by batch size."""
    sizes = sorted((int(bs) for bs in latency), reverse=True)
    for i, small in enumerate(sizes):
        stats = latency[str(small)]
        larger = [b for b in sizes[:i] if stats["p50"] > (1 + NOISY_BATCH) * latency[str(b)]["p50"]]
        if larger:
            big = max(larger)
            reason = (f"batch: p50 {_ms(stats['p50'])} ms at batch {small} above {_ms(latency[str(big)]['p50'])} ms "
                      f"at batch {big}, which does more work")
            stats["noisy"] = True
            stats["noisy_reason"] = "; ".join(filter(None, [stats.get("noisy_reason"), reason]))


def fill_batch(images: np.ndarray, batch_size: int) -> np.ndarray:
    """A batch of real images (repeated if there are fewer than ``batch_size``)."""
    reps = -(-batch_size // len(images))
    return np.ascontiguousarray(np.concatenate([images] * reps)[:batch_size])


def _clock(engine: Engine) -> Callable[[Callable[[], object]], float]:
    """One call's latency in ms: the engine's device timer, else the host clock."""
    timer = engine.timer()
    if timer is not None:
        return timer.time_ms

    def host(step) -> float:
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    return host


def warm_up(engine: Engine, step, minimum: int, clock=None) -> int:
    """Call ``step`` at least ``minimum`` times, then until stable: windows of :data:`WARMUP_WINDOW_CALLS` calls
    and :data:`WARMUP_WINDOW_S` seconds, until a window's median is no more than :data:`WARMUP_SETTLED` below
    the window before, or :data:`WARMUP_MAX_S` have passed. Returns the calls made."""
    clock = clock or _clock(engine)
    calls, window, window_s, medians = 0, [], 0.0, []
    t0 = time.perf_counter()
    while True:
        ms = clock(step)
        calls += 1
        window.append(ms)
        window_s += ms / 1e3
        if len(window) < WARMUP_WINDOW_CALLS or window_s < WARMUP_WINDOW_S:
            if calls >= minimum and time.perf_counter() - t0 > WARMUP_MAX_S:
                break
            continue
        medians.append(float(np.median(window)))
        window, window_s = [], 0.0
        if calls < minimum:
            continue
        settled = len(medians) >= 2 and medians[-1] >= (1 - WARMUP_SETTLED) * medians[-2]
        if settled or time.perf_counter() - t0 > WARMUP_MAX_S:
            break
    engine.synchronize()
    return calls


def timed_run(engine: Engine, step, warmup: int, iterations: int, advance=None) -> tuple[list[float], int]:
    """(per-iteration latencies in ms, warm-up calls made): :func:`warm_up`, then ``iterations`` timed calls."""
    clock = _clock(engine)
    warm = warm_up(engine, step, warmup, clock)
    samples = []
    for _ in range(iterations):
        samples.append(clock(step))
        if advance:
            advance()
    return samples, warm


def time_iterations(engine: Engine, step, warmup: int, iterations: int, advance=None) -> list[float]:
    """The latencies of ``iterations`` calls after a warm-up until stable (at least ``warmup`` calls)."""
    return timed_run(engine, step, warmup, iterations, advance)[0]


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
    repeat with the lowest median is kept: its samples, its stats and its throughput; ``warmup_calls`` lists
    each repeat's warm-up calls. Throughput is sustained throughput, batch size / mean latency of back-to-back
    inferences of the kept repeat. Batch sizes slower than a larger one are flagged (:func:`flag_batch_inversions`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    latency, samples_out, throughput = {}, {}, {}
    with progress(f"bench {engine.variant.label}", len(batch_sizes) * iterations * repeats) as advance:
        for bs in batch_sizes:
            step = engine.prepare_timed(fill_batch(images, bs))
            runs = [timed_run(engine, step, warmup, iterations, advance) for _ in range(repeats)]
            samples, stats = best_repeat([r[0] for r in runs])
            stats["warmup_calls"] = [r[1] for r in runs]
            key = str(bs)
            latency[key] = stats
            samples_out[key] = [round(s, 5) for s in samples]
            throughput[key] = bs * 1000.0 / stats["mean"]
    flag_batch_inversions(latency)
    return {"latency_ms": latency, "latency_samples_ms": samples_out, "throughput_ips": throughput}
