"""The search of the PyTorch targets (torch-cuda, torch-cpu): which way of running the model is fastest within budget.

At the batch sizes of small vision models a GPU is bound by kernel launches, not by arithmetic: eager PyTorch is 6-13x
slower than the same kernels replayed as a CUDA graph or fused by torch.compile. The candidates are precision (FP32
strict, FP32 with TF32 math, FP16, BF16) × memory layout (contiguous, channels_last) × runtime (eager, CUDA-graph replay,
torch.compile per mode, with and without CUDA graphs). Too many to evaluate each, and torch.compile costs seconds to
minutes per candidate, so:

1. **Accuracy per precision** (eager, contiguous): the reference and each reduced precision are evaluated on the whole
   search split. A precision outside the budget is dropped with everything built on it.
2. **Brief timing** of every eager and CUDA-graph candidate of the precisions kept (a few dozen calls per batch size;
   strict FP32 only as its reference where FP32-TF32 is kept: ``TF32_DOMINATES_WHY``; each new shape and layout costs
   cuDNN's autotuning, 9-14 s an eager channels_last candidate of EfficientNet-B0 on an H200).
3. **Compilation** of every precision kept in step 1 (strict FP32 not where TF32 is kept: ``TF32_DOMINATES_WHY``; on
   a GPU, not a precision whose CUDA graph is too slow for compiling to catch up with the fastest: ``OUTPACED_WHY``), each
   in its faster layout by step 2, both layouts where step 2
   cannot separate them (``compile_pairs``: brief eager timings do not rank precisions, compiled ones do), in each
   mode of ``optimize.compile_modes``, with CUDA graphs first, then without (``compile_order``) where the graph could
   not be captured (``GRAPH_DOMINATES_WHY``); each compile's time
   is recorded and counted against ``time_limit``: a compile that would not fit in the time left (estimated from the
   ones before) is skipped, and the log and optimize.json's ``stages`` name every one skipped.
   Once each precision has its program (on a GPU each precision of the fastest tensor-core tier:
   ``TENSOR_CORE_FIRST_WHY``; before the tied layouts and the programs without graphs), the fastest is compiled again
   with each rewrite the model calls for: Inductor's freezing (``optimize.freezing``: weights as
   constants, facts/inductor.py), its patch convolutions as one matmul (``optimize.patch_matmul``,
   facts/patch_matmul.py), where asked for its depthwise convolutions as fused stencils
   (``optimize.depthwise_stencil``, facts/depthwise_stencil.py) and, on torch-cuda, each Linear's GELU in its matmul's
   epilogue (``optimize.gelu_epilogue``, facts/gelu_epilogue.py); at the end, on torch-cuda, the fastest BF16/FP16
   one with each torchao scheme of ``optimize.torchao`` on its Linear layers; each one compile more, under the same
   rule.
4. **Full measurement** (evaluation on the search split + the configured timing) of the ``optimize.finalists`` fastest by
   brief timing: layout, capture and compilation change the kernels and so the numerics a little, so a candidate's
   own predictions decide its budget verdict, never its precision's. The fastest is measured even past the time limit
   (``FASTEST_MEASURED_WHY``).

Candidates are ranked by the geometric mean of their p50 over the ranked batch sizes (each batch size counts by ratio).
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

from qdeploy.benchmark.latency import fill_batch, time_iterations
from qdeploy.config import VariantSpec
from qdeploy.engines.base import create_engine, resolve_variant
from qdeploy.facts.inductor import FREEZING_GPU_WHY, freezing_default
from qdeploy.facts.depthwise_stencil import (DEPTHWISE_STENCIL_DEFAULT_WHY, depthwise_convolutions,
                                              depthwise_stencil_by_default)
from qdeploy.facts.gelu_epilogue import gelu_epilogue_by_default
from qdeploy.facts.patch_matmul import patch_matmul_by_default
from qdeploy.facts.torchao import torchao_problem
from qdeploy.optimize.candidates import (Candidate, CompiledCandidate, CudaGraphCandidate, EagerCandidate,
                                         DepthwiseStencilCandidate, FrozenCandidate, GeluEpilogueCandidate,
                                         PatchMatmulCandidate, TorchaoCandidate, TorchCandidate)
from qdeploy.optimize.decide import LATENCY_TIE
from qdeploy.optimize.steps.base import Step, register_step

BRIEF_WARMUP = 10
BRIEF_ITERATIONS = 40
RESERVE = 1.5      # a compile is started only when the time left is this many times its estimate
# What follows the search when the torch targets' default time limit covers the whole optimize (a limit the user sets
# bounds the search alone): the saved program's compile for its cache (``save_compile_estimate``) and the confirm run in
# a fresh process (load, first calls, 1,000 images, timing: 27-33 s at 224 px on the H200).
CONFIRM_RESERVE_S = 30.0
# The saved program's compile where it hits Inductor's cache of the search's compile of the same exported program, as a
# share of a candidate's compile: the whole save (export, the cache-hit compile, writing) took 5.8 s after a 36.7 s
# compile (ResNet-50), 5.5 s after 18.9 s (DeiT-S) and 3.2 s after 14.0 s (DeiT-S with the patch matmul) on an H200.
SAVE_CACHE_HIT_SHARE = 0.3


def save_compile_estimate(chosen, estimate):
    """The saved program's compile if ``chosen`` (a compiled candidate; None: not known) is the answer: a cache hit
    (SAVE_CACHE_HIT_SHARE of ``estimate``) where the search compiled its exported program, a whole compile where it is
    frozen (AOTAutograd caches no frozen graph, so the save traces and folds it again: facts/inductor.py; on the H200
    ResNet-50's and MobileNetV3-L's frozen saves compiled in 16.0 / 20.2 s after 27.2 / 34.0 s in the search) or was
    compiled from the model (torch.export failed: the saved programs are other graphs)."""
    if estimate is None:
        return None
    if chosen is None or chosen.exported is not True or chosen.spec.get("freezing"):
        return estimate
    return SAVE_CACHE_HIT_SHARE * estimate


def compile_fits(left, estimate, limit_covers_saving: bool, save_estimate=None) -> bool:
    """Whether one more compile (of about ``estimate`` s, None: none timed yet) is started with ``left`` s of the time
    limit (None: no limit): RESERVE x its estimate, plus the save's compile (``save_estimate``, None: as long as a
    candidate's) and the confirm run where the limit covers them (CONFIRM_RESERVE_S)."""
    if left is None or estimate is None:
        return True
    save = estimate if save_estimate is None else save_estimate
    return left >= RESERVE * estimate + ((save + CONFIRM_RESERVE_S) if limit_covers_saving else 0.0)


TF32_DOMINATES_WHY = (
    "strict FP32 is neither compiled nor timed beyond its reference run where FP32 with TF32 math is within budget: "
    "TF32 changes only how matmuls and convolutions compute (tensor cores in place of FP32 FMA units; PyTorch's "
    "allow_tf32 flags) and every other kernel is the same, so the strict program cannot run faster than the TF32 one "
    "beyond noise, and its compile costs as much as any other, its brief timing cuDNN's autotuning of its own "
    "convolutions (ResNet-50 at 224 on an H200: strict 2.159 / 10.757 ms against TF32 0.602 / 2.679 ms at batch 1 / 32, "
    "compiled with CUDA graphs in 13.4 s; docs/results/realsize/gpu_resnet50_2026-11-29/)")

GRAPH_DOMINATES_WHY = (
    "a compiled program is not compiled again without CUDA graphs where its graph was captured: the graph replays the "
    "very kernels the program launches, at the same fixed batch size, without the launches between them, so the program "
    "alone cannot run faster beyond noise (ResNet-50 at 224 on an H200: 0.457 / 1.455 ms with the graph, 2.050 / 2.147 "
    "ms without, at batch 1 / 32; docs/results/realsize/gpu_resnet50_2026-11-29/), and each such compile costs time "
    "that the 5-minute search needs. Where capture fails, the program alone is compiled")


# How much more compiling may gain a precision than it gained the fastest one, where a CUDA graph of both was timed.
# Measured on an H200 at 224 px (graph → compile + graph, geometric mean over batch 32 and 128): ConvNeXt-T FP16 1.48x,
# FP32-TF32 1.36x; DeiT-S BF16 1.17x, FP32-TF32 1.09-1.10x (docs/results/realsize/gpu_lanes_2026-11-30/). The slower
# precision gained less both times (its matmuls and convolutions, which compiling leaves to cuBLAS and cuDNN, are a larger
# share of its time); the margin allows a quarter more than the fastest precision's gain all the same.
COMPILE_GAIN_MARGIN = 0.25

OUTPACED_WHY = (
    "a precision is not compiled where its CUDA graph, timed briefly, is so much slower than the fastest precision's "
    "that compiling it cannot catch up: a graph replays the eager kernels without their launches, and compiling fuses "
    "the kernels around the matmuls and convolutions, which stay cuBLAS's and cuDNN's at the precision's speed; the "
    "bound is the gain compiling gave the fastest precision (its graph against its compiled program) plus "
    "COMPILE_GAIN_MARGIN. Tensor-core FP16 against FP32 with TF32 math on an H200 at 224 px: ConvNeXt-T 3.18 against "
    "5.33 ms as graphs at batch 32, 2.21 against 3.98 ms compiled, two TF32 compiles of 15 s spent on that")


def outpaced_by(cand: TorchCandidate, uncompiled: list, compiled: list, margin: float = COMPILE_GAIN_MARGIN,
                tie: float = LATENCY_TIE) -> Optional[str]:
    """Why ``cand`` (a compiled candidate, not yet compiled) is not worth its compile (OUTPACED_WHY), or
    None: its CUDA-graph twin's brief rank, divided by (1 + ``margin``) times the gain compiling gave the fastest
    compiled program over its own CUDA-graph twin, is still slower than that program by more than ``tie``. Only where
    both twins were timed: a target without CUDA graphs, whose eager timings are launch-bound, never prunes this way."""
    def twin(c):
        return next((u for u in uncompiled if isinstance(u, CudaGraphCandidate) and u.brief_rank is not None
                     and (u.precision, u.tf32, u.channels_last) == (c.precision, c.tf32, c.channels_last)), None)

    mine = twin(cand)  # compiled without graphs, a program is no faster than with them (GRAPH_DOMINATES_WHY)
    if mine is None:
        return None
    best = min((c for c in compiled if c.cuda_graphs and c.brief_rank is not None and twin(c) is not None),
               key=lambda c: c.brief_rank, default=None)
    if best is None or (best.precision, best.tf32) == (cand.precision, cand.tf32):
        return None
    gain = max(1.0, twin(best).brief_rank / best.brief_rank)
    bound = mine.brief_rank / (gain * (1 + margin))
    if bound <= best.brief_rank * (1 + tie):
        return None
    return (f"its graph {mine.brief_rank:.3f} ms / ({gain:.2f}x, {best.variant}'s gain, + {margin:.0%}) = {bound:.3f} ms "
            f"> {best.variant} {best.brief_rank:.3f} ms")


# The rate of a GPU's tensor cores per precision, as tiers (0 the fastest): FP16 and BF16 run at one rate, FP32 with
# TF32 math at half of it, strict FP32 on the FMA units at a fraction of that (dense TFLOPS in NVIDIA's data sheets: A100
# 312 / 156 / 19.5, H100 SXM 989 / 494 / 67).
TENSOR_CORE_TIER = {("fp16", False): 0, ("bf16", False): 0, ("fp32", True): 1, ("fp32", False): 2}

TENSOR_CORE_FIRST_WHY = (
    "on a GPU the programs compiled first, the ones the rewrites (freezing, patch matmul) start from, are those of the "
    "precisions at the fastest tensor-core rate within budget (FP16, BF16: twice FP32-TF32's rate); a slower-rate "
    "precision is compiled after the rewrites and the tied layouts. Its CUDA graph may time faster at small batch "
    "sizes, where launches bound a graph and arithmetic does not, but compiled it was slower in every search recorded: "
    "the 16 of 18 torch-cuda searches at 32-640 px that compiled both (docs/results/outpaced_replay.json: FP32-TF32 "
    "1.05-2.47x the fastest FP16/BF16 program) and EfficientNet-B0 at batch 1 / 8 on an H200, whose FP32-TF32 graph "
    "ran 0.802 / 1.445 ms against FP16's 0.895 / 1.486 and compiled 0.560 / 0.929 against 0.500 / 0.790; "
    "compiled first there, it left the frozen FP16 program no time in the 300 s limit "
    "(docs/results/realsize/gpu_b128_b8_2026-11-30/efficientnet_b0.log)")


def tensor_core_first(pairs: list[tuple], primary: int) -> tuple[list[tuple], int]:
    """``pairs`` (``compile_pairs``: the first ``primary`` one per precision, then the tied layouts) in the GPU's
    compile order (TENSOR_CORE_FIRST_WHY): the fastest tensor-core tier's first, then its tied layouts, then each slower
    tier's the same way; and how many lead (the first block, before the rewrites)."""
    keyed = sorted(enumerate(pairs), key=lambda ip: (TENSOR_CORE_TIER.get(ip[1][:2], len(TENSOR_CORE_TIER)),
                                                    ip[0] >= primary, ip[0]))
    ordered = [pair for _, pair in keyed]
    top = TENSOR_CORE_TIER.get(ordered[0][:2]) if ordered else None
    lead = sum(1 for i, pair in keyed if i < primary and TENSOR_CORE_TIER.get(pair[:2]) == top)
    return ordered, lead


FASTEST_MEASURED_WHY = (
    "the fastest candidate by brief timing is measured even once the time limit is reached: it is already built, its "
    "evaluation is one pass over the search split, and without it the answer would be the fastest candidate evaluated "
    "in step 1, an eager one (DeiT-S at 224 on an H200: bf16-eager 6.32 / 5.76 ms at batch 32 / 128 against "
    "1.34 / 4.40 ms compiled with a CUDA graph)")


@register_step
class TorchRuntimesStep(Step):
    name = "torch-runtimes"

    def run(self) -> None:
        evaluate_torch(self.s, self.s.planned)


def evaluate_torch(s, planned: list[Candidate]) -> None:
    """The search for a PyTorch target; ``s`` is the session.SearchSession (measure, note, time_left, rank_batches)."""
    if "compile" in s.target.runtimes and s.o.compile_modes and s.aoti_probe is None:
        from qdeploy.artifacts.torch_program import AotiProbe

        s.aoti_probe = AotiProbe(s.target.engine["device"], s.cache_root / "torch-program")  # in the background
    t0 = time.perf_counter()
    s.measure(planned[0])
    s.check_reference(time.perf_counter() - t0, len(s.reference.predictions))
    # 1. accuracy per precision
    kept = [(planned[0].precision, False)]
    for cand in planned[1:]:
        if s.out_of_time():
            s.timed_out = True
            break
        s.measure(cand)
        if cand.within_budget:
            kept.append((cand.precision, isinstance(cand, TorchCandidate) and cand.tf32))
    dropped = [c.variant for c in planned[1:] if c.status != "planned" and not c.within_budget]
    s.note("precisions kept for the runtime search: " + ", ".join(p + ("-tf32" if t else "") for p, t in kept)
           + (f" (outside the budget or failed: {', '.join(dropped)})" if dropped else ""))
    # 2. brief timing of eager and CUDA-graph candidates
    measured = {c.variant: c for c in s.candidates}
    brief: list[TorchCandidate] = []
    planned_brief, strict_dominated = brief_plan(s.target, kept, s.reference)
    for cand in planned_brief:
        if s.out_of_time():
            s.timed_out = True
            break
        brief.append(_time_briefly(s, measured.get(cand.variant, cand)))
    if strict_dominated:
        s.note("not timed (TF32_DOMINATES_WHY in optimize/steps/torch_runtimes.py): " + ", ".join(strict_dominated))
        s.stages["torch_strict_fp32_not_timed"] = strict_dominated
    _note_brief(s, "eager and CUDA-graph", brief)
    # 3. compile the best pairs
    if "compile" in s.target.runtimes and s.o.compile_modes and not s.timed_out:
        pairs = compile_pairs(brief)
        primary = len({(p, t) for p, t, _ in pairs})
        name = [f"{p}{'-tf32' if t else ''}{'-cl' if cl else ''}" for p, t, cl in pairs]
        s.note("compiled: one layout per precision within budget, the faster by brief timing: " + ", ".join(name[:primary])
               + (f"; and the other layout where brief timing cannot separate the two (within "
                  f"{LATENCY_TIE:.0%}): " + ", ".join(name[primary:]) if pairs[primary:] else ""))
        compiled, rewritten, estimate = compile_stage(s, pairs, primary, brief)
        brief += compiled + rewritten
        if s.target.name == "torch-cuda" and s.o.torchao and not s.timed_out:
            brief += _torchao_stage(s, compiled, estimate)
    # 4. the finalists, measured fully
    timed = sorted((c for c in brief if c.brief_rank is not None), key=lambda c: c.brief_rank)
    finalists = [c for c in timed if c.variant not in measured][: s.o.finalists]
    s.note("measured fully (evaluation + timing): " + (", ".join(c.variant for c in finalists) or "none"))
    for i, cand in enumerate(finalists):
        if s.out_of_time():
            s.timed_out = True
            if i > 0:
                s.note(f"{cand.variant}: not measured, optimize.time_limit reached")
                break
            s.note(f"{cand.variant}: measured past optimize.time_limit ({FASTEST_MEASURED_WHY})")
        s.measure(cand)
    for cand in brief:  # the rows of candidates only timed briefly
        if cand not in s.candidates:
            s.candidates.append(cand)
    if s.out_of_time():
        s.timed_out = True


def brief_plan(target, kept: list[tuple], reference) -> tuple[list, list[str]]:
    """(the eager and CUDA-graph candidates step 2 times briefly, in order; the strict FP32 ones it leaves out) for the
    precisions ``kept`` ((precision, tf32) within budget) on ``target``; ``reference``: the strict FP32 reference
    candidate, measured in step 1, which stands for its contiguous eager twin. Strict FP32 is timed only as that
    reference where FP32-TF32 is kept (TF32_DOMINATES_WHY)."""
    kinds = [EagerCandidate] + ([CudaGraphCandidate] if "cudagraph" in target.runtimes else [])
    plan, strict_dominated = [], []
    for precision, tf32 in kept:
        for channels_last in (False, True):
            for kind in kinds:
                cand = kind.planned(target, precision, channels_last, tf32)
                if cand.variant == f"{reference.precision}-eager":
                    plan.append(reference)  # the strict FP32 reference is the contiguous FP32 eager candidate
                elif (precision, tf32) == ("fp32", False) and ("fp32", True) in kept:
                    strict_dominated.append(cand.variant)
                else:
                    plan.append(cand)
    return plan, strict_dominated


def compile_stage(s, pairs: list[tuple], primary: int, uncompiled: list = ()) -> tuple[list, list, Optional[float]]:
    """Step 3: compile ``pairs`` (``compile_pairs``: the first ``primary`` one per precision) in ``compile_order``, the
    rewrites of the fastest program after each precision's first program (on a GPU after those of the fastest
    tensor-core tier: ``tensor_core_first``); ``uncompiled``: step 2's briefly timed eager
    and CUDA-graph candidates (``outpaced_by``). Returns (the compiled candidates, the rewritten ones, the longest
    compile)."""
    compiled: list[TorchCandidate] = []
    skipped, dominated, outpaced = [], [], []
    if s.target.engine["device"] == "cuda":
        pairs, primary = tensor_core_first(pairs, primary)  # TENSOR_CORE_FIRST_WHY
    order = compile_order(pairs, s.o.compile_modes, "cudagraph" in s.target.runtimes)
    # The first block (each precision in its faster layout, in the first kind of runtime; on a GPU those of the
    # fastest tensor-core tier) holds the fastest program, which the rewrites start from. They come before the tied
    # layouts and the programs without graphs, which the time limit cuts first: a rewrite's gain is measured (freezing
    # 1.15x on BatchNorm CNNs on a GPU), a tied layout's is within LATENCY_TIE by definition, and a ResNet-50 search
    # that compiled the tied layout first had 112 s of the default limit left, too few for the frozen program.
    first = primary * len(s.o.compile_modes)
    estimate = _compile_each(s, order[:first], compiled, None, skipped, dominated, uncompiled, outpaced)
    rewritten = _rewrite_stages(s, compiled, estimate)
    estimate = _compile_each(s, order[first:], compiled, estimate, skipped, dominated, uncompiled, outpaced)
    if outpaced:
        s.note("not compiled, too slow as a CUDA graph for compiling to catch up with the fastest program (OUTPACED_WHY "
               "in optimize/steps/torch_runtimes.py): " + "; ".join(outpaced))
        s.stages["torch_compile_outpaced"] = outpaced
    if dominated:
        s.note("not compiled without CUDA graphs, the same program replayed as a graph ran (the graph replays its "
               "kernels without the launches; GRAPH_DOMINATES_WHY in optimize/steps/torch_runtimes.py): "
               + ", ".join(dominated))
        s.stages["torch_compile_alone_dominated"] = dominated
    if skipped:
        s.note(f"not compiled ({len(skipped)} of {len(skipped) + len(compiled)}, the least promising; "
               f"optimize.time_limit left less than {RESERVE:g}x the longest compile so far, {estimate:.0f} s"
               + (f", plus the saved program's compile (a cache hit, {SAVE_CACHE_HIT_SHARE:g}x that, or all of it for a "
                  f"frozen program) and {CONFIRM_RESERVE_S:g} s for its confirm run, which the default limit covers"
                  if s.limit_covers_saving else "") + "): "
               + ", ".join(skipped))
        s.stages["torch_compile_not_tried"] = skipped
    _note_brief(s, "torch.compile", compiled)
    return compiled, rewritten, estimate


def _compile_each(s, order: list[tuple], compiled: list, estimate, skipped: list, dominated: list,
                  uncompiled=(), outpaced: Optional[list] = None):
    """Compile and time briefly each (precision, tf32, channels_last, mode, cuda_graphs) of ``order`` that fits the time
    left, appending to ``compiled`` (and the variants left out to ``skipped`` / ``dominated`` / ``outpaced``); returns
    the longest compile so far, the estimate of the next."""
    for precision, tf32, channels_last, mode, cuda_graphs in order:
        cand = CompiledCandidate.planned(s.target, precision, channels_last, tf32, mode, cuda_graphs)
        if not cuda_graphs and graph_twin_ran(cand, compiled):  # GRAPH_DOMINATES_WHY
            dominated.append(cand.variant)
            continue
        why = outpaced_by(cand, uncompiled, compiled)  # OUTPACED_WHY
        if why is not None:
            if outpaced is not None:
                outpaced.append(f"{cand.variant} ({why})")
            continue
        fastest = min((c for c in compiled if c.brief_rank is not None), key=lambda c: c.brief_rank, default=None)
        if not compile_fits(s.time_left(), estimate, s.limit_covers_saving, save_compile_estimate(fastest, estimate)):
            skipped.append(cand.variant)
            continue
        _time_briefly(s, cand)
        compiled.append(cand)
        if cand.compile_s is not None:
            estimate = max(estimate or 0.0, cand.compile_s)
    return estimate


def _rewrite_stages(s, compiled: list, estimate) -> list:
    """The fastest compiled program once more with each rewrite the model calls for: Inductor's freezing
    (optimize.freezing, facts/inductor.py), then the patch convolutions as matmuls (optimize.patch_matmul,
    facts/patch_matmul.py) on the faster of that program and its frozen one, so that where freezing won the two are
    tried together, then the depthwise convolutions as stencils (optimize.depthwise_stencil, facts/depthwise_stencil.py)
    and each Linear's GELU in its matmul's epilogue (optimize.gelu_epilogue, facts/gelu_epilogue.py), each on the
    fastest of those before it; each is said where it is not tried by default."""
    device = s.target.engine["device"]
    model = s.ctx.builder.torch_model() if s.ctx.builder.has_torch and (
        s.o.freezing is None or s.o.patch_matmul is None or s.o.depthwise_stencil is None
        or s.o.gelu_epilogue is None) else None
    out = []
    tried, folds = (s.o.freezing, []) if s.o.freezing is not None else \
        freezing_default(device, model, _one_image(s) if model is not None and device == "cuda" else None)
    if not tried and s.o.freezing is None:
        s.note(f"Inductor freezing: {FREEZING_GPU_WHY}")
    elif tried and not s.timed_out:
        if folds:
            s.note("Inductor freezing tried: on this model it folds " + "; ".join(folds))
        out += _rewrite_stage(s, compiled, estimate, FrozenCandidate)
    # a model without a patch convolution has nothing to rewrite: not worth a line
    if (s.o.patch_matmul or (s.o.patch_matmul is None and patch_matmul_by_default(model))) and not s.timed_out:
        out += _rewrite_stage(s, compiled + out, estimate, PatchMatmulCandidate)
    stencil = s.o.depthwise_stencil
    if stencil is None and model is not None and depthwise_convolutions(model):
        stencil = depthwise_stencil_by_default(model, device)
        if not stencil:
            s.note(f"depthwise convolutions as stencils: {DEPTHWISE_STENCIL_DEFAULT_WHY}")
    if stencil and not s.timed_out:
        out += _rewrite_stage(s, compiled + out, estimate, DepthwiseStencilCandidate)
    # a model without a Linear → GELU has nothing to rewrite: not worth a line
    if (s.o.gelu_epilogue or (s.o.gelu_epilogue is None and gelu_epilogue_by_default(model, device))) \
            and not s.timed_out:
        out += _rewrite_stage(s, compiled + out, estimate, GeluEpilogueCandidate)
    return out


def _one_image(s):
    """One of the run's real preprocessed images as a batch of one (a CPU tensor), or None."""
    import numpy as np
    import torch

    images = s.ctx.builder.check_inputs()
    return None if images is None else torch.from_numpy(np.ascontiguousarray(images[:1]))


def graph_twin_ran(cand: TorchCandidate, compiled: list[TorchCandidate]) -> bool:
    """Whether the same compiled program (precision, TF32, layout, mode) already ran replayed as a CUDA graph: then
    ``cand``, that program without the graph, is not compiled (GRAPH_DOMINATES_WHY)."""
    key = (cand.precision, cand.tf32, cand.channels_last, cand.compile_mode)
    return any(c.cuda_graphs and c.brief_rank is not None and (c.precision, c.tf32, c.channels_last, c.compile_mode) == key
               for c in compiled)


def compile_order(pairs: list[tuple], modes: list[str], cudagraph: bool) -> list[tuple]:
    """(precision, tf32, channels_last, mode, cuda_graphs) in the order they are compiled: with CUDA graphs before
    without, then by ``pairs``' order (the most promising precision and layout first), then by ``modes``' order, so
    that a time limit cuts the least promising. Why graphs first: at the batch sizes a search times, a compiled
    program's launches still cost what the graph removes (a torchvision Swin at batch 1 on an H200: FP16 compile
    2.9 ms, compile + CUDA graph 0.584 ms), and a time-limited search compiled the slow kind first and then stopped."""
    graphs = (True, False) if cudagraph else (False,)
    return [(p, t, cl, mode, g) for g in graphs for (p, t, cl) in pairs for mode in modes]


def compile_pairs(brief: list, tie: float = LATENCY_TIE) -> list[tuple]:
    """(precision, tf32, channels_last) to compile: every precision that reached the runtime search (within budget),
    each in its faster layout by brief timing, fastest first; then the other layout of each precision whose brief
    timing is within ``tie`` of the faster one's (the time limit cuts from the end, so these first).

    Why not the best two pairs overall: eager and CUDA-graph timings at small batch sizes are launch-bound and noisy
    and do not predict compiled speed (EfficientNet-B0 eager FP16 10.9 ms vs FP32 4.9 ms in one run, while
    FP16 compiled was 1.13-1.28x faster than the FP32-TF32 compiled program chosen; a Hugging Face ViT got FP32 in one run
    and FP16 in another). Only compiled timings rank the precisions.
    Why both layouts on a tie: where a brief timing cannot separate the layouts (a ViT's, whose only convolution is
    the patch embedding: 0.226/0.377 ms contiguous vs 0.229/0.379 ms channels_last in one run, channels_last 7 % faster
    at batch 32 in the next), picking one by it is a coin toss that repeated runs answer differently; compiled, both
    are timed and the choice is made (or the tie named) among compiled candidates.
    One precision is left out by a fact, not a timing: strict FP32 where FP32 with TF32 math is within budget
    (TF32_DOMINATES_WHY)."""
    best: dict = {}
    layouts: dict = {}
    for c in sorted((c for c in brief if c.brief_rank is not None), key=lambda c: c.brief_rank):
        best.setdefault((c.precision, c.tf32), (c.precision, c.tf32, c.channels_last))
        layouts.setdefault((c.precision, c.tf32, c.channels_last), c.brief_rank)
    if ("fp32", True) in best:  # TF32_DOMINATES_WHY
        best.pop(("fp32", False), None)
    tied = [(p, t, not cl) for (p, t, cl) in best.values()
            if (p, t, not cl) in layouts and layouts[(p, t, not cl)] <= layouts[(p, t, cl)] * (1 + tie)]
    return list(best.values()) + tied


def _rewrite_stage(s, compiled: list, estimate, kind) -> list:
    """``kind`` (a RewrittenCandidate class) on the fastest compiled candidate, one compile more under the time limit's
    rule. Said plainly when it is not faster."""
    base = min((c for c in compiled if c.brief_rank is not None), key=lambda c: c.brief_rank, default=None)
    if base is None:
        return []
    cand = kind.planned_from(base)
    left = s.time_left()
    # were it chosen, its save: a whole compile for a frozen program, else a cache hit as its base's
    if not compile_fits(left, estimate, s.limit_covers_saving,
                        estimate if cand.spec.get("freezing") else save_compile_estimate(base, estimate)):
        s.note(f"{cand.variant}: not compiled, {left:.0f} s left of optimize.time_limit")
        return []
    _time_briefly(s, cand)
    if cand.brief_rank is not None:
        s.note(f"{kind.label} on {base.variant}: " + "/".join(f"{v:.3f}" for v in cand.brief_p50_ms.values())
               + " ms vs " + "/".join(f"{v:.3f}" for v in base.brief_p50_ms.values()) + " ms without"
               + (f" (compile {cand.compile_s:.1f} s)" if cand.compile_s is not None else "")
               + (": faster, a candidate" if cand.brief_rank < base.brief_rank else ": not faster here"))
    return [cand]


def _torchao_stage(s, compiled: list, estimate) -> list:
    """torchao's schemes (facts/torchao.py) on the fastest compiled BF16/FP16 candidate: the same runtime with its
    Linear layers quantized. Said plainly when a scheme cannot run here or is not faster than its base."""
    # not a program with the GELU epilogue: torchao replaces the very matmuls (its own kernels) the epilogue is in
    base = min((c for c in compiled if c.brief_rank is not None and c.precision in ("bf16", "fp16")
                and not c.spec.get("gelu_epilogue")), key=lambda c: c.brief_rank, default=None)
    if base is None:
        s.note("torchao: no compiled BF16/FP16 candidate to start from")
        return []
    out = []
    for scheme in s.o.torchao:
        problem = torchao_problem(scheme, s.target.engine["device"])
        if problem:
            s.note(f"torchao {scheme}: not tried: {problem}")
            continue
        cand = TorchaoCandidate.planned_from(base, scheme)
        left = s.time_left()
        if not compile_fits(left, estimate, s.limit_covers_saving, save_compile_estimate(base, estimate)):
            s.note(f"{cand.variant}: not compiled, {left:.0f} s left of optimize.time_limit")
            continue
        _time_briefly(s, cand)
        out.append(cand)
        if cand.brief_rank is not None:
            faster = cand.brief_rank < base.brief_rank
            s.note(f"torchao {scheme} on {base.variant}'s Linear layers: "
                   + "/".join(f"{v:.3f}" for v in cand.brief_p50_ms.values()) + " ms vs "
                   + "/".join(f"{v:.3f}" for v in base.brief_p50_ms.values()) + " ms without"
                   + (f" (compile {cand.compile_s:.1f} s)" if cand.compile_s is not None else "")
                   + (": faster, a candidate" if faster else ": not faster here (the quantize/dequantize work costs more "
                      "than the Linear matmuls it speeds up at these sizes)"))
    return out


def _time_briefly(s, cand: TorchCandidate) -> TorchCandidate:
    """Load the candidate (compiling it, capturing its graphs) and time it for a few dozen calls per ranked batch size
    on the run's real inputs, in memory; a failure is the candidate's, with its reason."""
    spec = VariantSpec.model_validate(cand.spec)
    variant = resolve_variant(spec, 0)
    t0 = time.perf_counter()
    engine, loaded = None, False
    try:
        artifact = s.ctx.builder.build(variant.artifact_request())
        variant.engine.check(variant, s.ctx.builder.has_torch)
        engine = create_engine(variant, artifact)
        engine.load()
        loaded = True
        images = s.ctx.bench_inputs()
        p50 = {}
        for b in s.rank_batches:
            step = engine.prepare_timed(fill_batch(images, b))
            step()  # compile / capture for this shape: counted in compile_s, not in the timing
            engine.synchronize()
            p50[b] = statistics.median(time_iterations(engine, step, BRIEF_WARMUP, BRIEF_ITERATIONS))
        # compile time: loading plus the first calls (Inductor compiles per shape on first call), minus the timing
        spent = time.perf_counter() - t0
        timing = sum(p50.values()) * (BRIEF_WARMUP + BRIEF_ITERATIONS) / 1e3
        cand.timed_briefly(p50, max(0.0, spent - timing))
        cand.exported = getattr(engine, "exported", None)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot compile or capture is listed, with why
        if cand.ok:  # measured fully already (the reference, an eager precision): its verdict stands
            s.note(f"{cand.variant}: brief timing failed ({type(e).__name__}); ranked by its full measurement")
            return cand
        cand.status, cand.failed_stage = "failed", "bench" if loaded else "load"
        cand.reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        cand.verdict_text = f"failed ({cand.failed_stage}): {cand.reason}"
        s.note(f"{cand.variant}: failed while timing briefly: {cand.reason}", warning=True)
    finally:
        if engine is not None:
            engine.close()
    return cand


def _note_brief(s, what: str, cands: list[TorchCandidate]) -> None:
    ok = sorted((c for c in cands if c.brief_rank is not None), key=lambda c: c.brief_rank)
    if not ok:
        return
    s.note(f"{what} candidates timed briefly ({BRIEF_ITERATIONS} calls after {BRIEF_WARMUP} per batch size "
           f"{', '.join(str(b) for b in s.rank_batches)}; p50 ms): "
           + "; ".join(f"{c.variant} " + "/".join(f"{v:.3f}" for v in c.brief_p50_ms.values())
                       + (f" (compile {c.compile_s:.1f} s)" if c.compile_mode else "") for c in ok))


def brief_only(cands) -> list:
    return [c for c in cands if isinstance(c, TorchCandidate) and c.status == "timed briefly only"]


__all__ = ["TorchRuntimesStep", "brief_only", "compile_fits", "compile_order", "compile_pairs", "evaluate_torch",
           "graph_twin_ran", "outpaced_by", "FASTEST_MEASURED_WHY", "OUTPACED_WHY"]
