"""The last step of a CPU search: the fastest candidates within budget timed again side by side, in interleaved rounds,
before the answer is chosen.

Why: every candidate is timed once, when the search reaches it, minutes apart from the others; on a shared 16-core
Xeon at 224-640 px one variant's median moves by up to 14 % from one round to the next (the rounds of
bench/suites/realsize_ceiling.py), so a single timing can order near-equal candidates wrongly. Measured: DeepLabV3 at
360x480, batch 1, 16 threads: the search timed OpenVINO on the ONNX Runtime-placement Q/DQ ONNX at 6.947 ms and NNCF's
own INT8 IR at 7.039 ms and chose the former (a tie, the larger budget margin deciding), while the harness's
interleaved rounds timed that Q/DQ file at 9.30 ms and NNCF's IR of the same model (its own quantization) at 7.44 ms
(docs/results/realsize_cpu_xeon.json). Timing the finalists in the same rounds, each round in another order, gives each
the same machine state; the median of the round medians decides, as the harness's does.

Finalists: the candidates within budget whose search p50 is within :data:`FINALIST_BAND` of the fastest one's, one
per build first (:func:`build_of`: siblings that differ only in their calibration ranges compile to the same graph and
run at the same speed), then the others, at most :data:`MAX_FINALISTS`, and the FP32 reference (the answer's speed-up
over it comes from the same rounds). Their artifacts are built already (the build cache); the rounds time about
``bench.iterations`` calls per finalist in all (at least 10 a round), the first round after a warm-up until stable,
the others after two calls; ``optimize.retime_rounds`` 0 turns the step off.
"""
from __future__ import annotations

import statistics
import time

from qdeploy.benchmark.latency import fill_batch, timed_run
from qdeploy.engines import create_engine
from qdeploy.errors import QDeployError
from qdeploy.optimize.decide import FINALIST_BAND
from qdeploy.optimize.steps.base import Step, register_step
from qdeploy.pipeline import release_build_memory
from qdeploy.utils.hashing import sha256_json

# at most MAX_FINALISTS (the band: decide.FINALIST_BAND), so that the step costs seconds a round
MAX_FINALISTS = 5
MIN_CALLS_PER_ROUND = 10  # a round's median of fewer calls is mostly their own scatter
REWARM_CALLS = 2


def host_timed(engine, step, warm: int, calls: int) -> list[float]:
    """``warm`` untimed calls, then ``calls`` timed on the host clock (ms): the CPU engines have no device timer."""
    for _ in range(warm):
        step()
    engine.synchronize()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def build_of(c) -> str:
    """What decides a candidate's speed: its spec without its name and calibration method (the ranges change the
    scales a Q/DQ node holds, not the graph an engine compiles)."""
    return sha256_json({k: v for k, v in c.spec.items() if k not in ("name", "method")})


def finalists(candidates: list) -> list:
    """The candidates within budget whose latency key is within FINALIST_BAND of the fastest one's, the fastest of each
    build first and then the others, at most MAX_FINALISTS, fastest first, and the FP32 reference (the answer's
    speed-up is read against it: from the same rounds); none where fewer than two other than the reference qualify, or
    keys are not latencies."""
    timed = sorted((c for c in candidates if c.ok and c.within_budget and (c.rank_key or 0) > 0),
                   key=lambda c: c.rank_key)
    offers = [c for c in timed if not c.reference]
    if len(offers) < 2:
        return []
    # the reference is timed beside them whatever its speed, so it takes none of the MAX_FINALISTS places (the band
    # is still measured from the fastest, the reference where it is)
    band = [c for c in offers if c.rank_key <= timed[0].rank_key * (1 + FINALIST_BAND)]
    firsts, builds = [], set()
    for c in band:
        if build_of(c) not in builds:
            builds.add(build_of(c))
            firsts.append(c)
    near = sorted((firsts + [c for c in band if c not in firsts])[:MAX_FINALISTS], key=lambda c: c.rank_key)
    if len(near) < 2:
        return []
    return near + [c for c in timed if c.reference]


@register_step
class FinalTimingStep(Step):
    name = "final-timing"

    def run(self) -> None:
        s = self.s
        rounds = s.o.retime_rounds
        if not rounds or not s.target.measured or s.out_of_time():
            return
        chosen = finalists(s.candidates)
        if not chosen:
            return
        bench = s.ctx.cfg.bench
        loaded, failed = [], {}
        try:
            for c in chosen:
                engine = None
                try:
                    engine = create_engine(s.variant_of(c.spec), s.built_record(c.spec).artifact)
                    release_build_memory()
                    engine.load()
                    loaded.append((c, engine, engine.prepare_timed(fill_batch(s.ctx.bench_inputs(), s.batch_size))))
                except (QDeployError, OSError, RuntimeError) as e:  # the search's own timing stands for this one
                    failed[c.variant] = str(e).splitlines()[0][:200]
                    if engine is not None and all(engine is not e_ for _, e_, _ in loaded):
                        engine.close()
            if len(loaded) < 2:
                return
            p50s: dict[str, list[float]] = {c.variant: [] for c, _, _ in loaded}
            # about bench.iterations timed calls per finalist in all, as the search's own timing: a round of a
            # 100 ms model at batch 16 must not cost 100 calls per finalist
            calls = max(MIN_CALLS_PER_ROUND, -(-bench.iterations // rounds))
            for r in range(rounds):
                if r and s.out_of_time():
                    break
                order = loaded[r % len(loaded):] + loaded[:r % len(loaded)]  # each round starts with another one
                for c, engine, step in order:
                    if r == 0:  # warm until stable once; later rounds re-warm caches the other finalists evicted
                        samples, _ = timed_run(engine, step, bench.warmup, calls)
                    else:
                        samples = host_timed(engine, step, REWARM_CALLS, calls)
                    p50s[c.variant].append(float(statistics.median(samples)))
        finally:
            for _, engine, _ in loaded:
                engine.close()
        self.record(loaded, p50s, failed)

    def record(self, loaded: list, p50s: dict, failed: dict) -> None:
        """Each finalist's latency key becomes the median of its round medians (its search p50 kept beside it)."""
        s = self.s
        done = min(len(v) for v in p50s.values())
        before = sorted(loaded, key=lambda x: x[0].rank_key)[0][0].variant
        changes = []
        for c, _, _ in loaded:
            final = float(statistics.median(p50s[c.variant][:done]))
            c.search_p50_ms = c.latency_p50_ms
            c.retimed_p50s_ms = [round(v, 4) for v in p50s[c.variant][:done]]
            c.latency_p50_ms = c.rank_key = final
            changes.append(f"{c.variant} {c.search_p50_ms:.3f} -> {final:.3f} ms")
        after = sorted(loaded, key=lambda x: x[0].rank_key)[0][0].variant
        s.note(f"final timing: the candidates within budget within {100 * FINALIST_BAND:g} % of the fastest and the FP32 "
               f"reference, timed again in {done} interleaved rounds (each round in another order; the median of the "
               f"round medians decides): {', '.join(changes)}"
               + (f"; the fastest is now {after} (the search's single timing had {before})" if after != before else "")
               + (f"; not timed again (could not be loaded): {', '.join(f'{k} ({v})' for k, v in failed.items())}"
                  if failed else ""))
        s.stages["final_timing"] = {
            "rounds": done, "band": FINALIST_BAND, "search_fastest": before, "fastest": after,
            "finalists": {c.variant: {"search_p50_ms": c.search_p50_ms, "round_p50s_ms": c.retimed_p50s_ms,
                                      "p50_ms": c.latency_p50_ms} for c, _, _ in loaded},
            **({"not_retimed": failed} if failed else {})}
