"""The confirm split: the reference and the chosen candidate, evaluated once on the images the search never saw, then
optimize.json, optimize.html and the chosen artifact into --out. A PyTorch target's answer is a saved program,
confirmed from --out in a fresh process (:func:`confirm_program`); where it cannot be, the next candidate within budget
is saved instead (:func:`confirm_a_program`)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from qdeploy.artifacts.torch_program import LOADER_NAME, MANIFEST, run_in_fresh_process, save_program
from qdeploy.config import parse_config
from qdeploy.data import normalize
from qdeploy.evaluate.metrics import agreement
from qdeploy.optimize.candidates import Candidate, program_settings
from qdeploy.optimize.decide import budget_check, fastest_within
from qdeploy.optimize.prepare import SearchPlan
from qdeploy.pipeline import copy_artifacts, open_run
from qdeploy.report.optimize_page import write_optimize_report
from qdeploy.evaluate.verdict_rules import SIBLING_GAP, SIBLINGS_NEEDED
from qdeploy.sysinfo import environment
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import write_json
from qdeploy.utils.hashing import sha256_file
from qdeploy.utils.log import log


def confirm(s, plan: SearchPlan, chosen: Optional[Candidate], budget_met_search: bool, out_dir, cache_dir) -> dict:
    """The reference and the chosen candidate, once, on the complement of the search split; then optimize.json,
    optimize.html and the chosen artifact into --out. Returns optimize.json's content."""
    o, base = plan.o, plan.base
    ref = s.reference
    # a PyTorch target's answer is a saved program: confirmed from --out in a fresh process (confirm_program)
    program_target = s.target.torch_program and chosen is not None
    confirm_specs = [ref.spec] + ([chosen.spec] if chosen is not None and chosen is not ref and not program_target else [])
    confirm_cfg = dict(base, variants=confirm_specs, bench={**base["bench"], "enabled": False},
                       data={**base["data"], "eval": {**base["data"]["eval"],
                                                      "subsplit": {"count": plan.n_search, "seed": o.seed, "complement": True}}})
    cctx = open_run(parse_config(confirm_cfg), out_dir, stages=("eval",), cache_dir=cache_dir)
    try:
        crecords = [s.run_in(cctx, v) for v in cctx.variants]
        s.evaluations["full"] += len(crecords)
        cref, cchosen = crecords[0], crecords[-1]
        ref_metric = cref.metrics.get(s.key)
        program = None
        if program_target:
            program, chosen = confirm_a_program(s, cctx, chosen, cref)
            if "error" in program:  # every attempt's failure was said by confirm_a_program
                chosen_metric, agree = None, None
            else:
                chosen_metric = program["metrics"].get(s.key)
                agree = agreement(program.pop("predictions"), cref.predictions)
            artifacts = program.pop("artifacts", [])
            chosen_file = next((a["path"] for a in artifacts if a["kind"] == "torch-program"), None)
        else:
            chosen_metric = cchosen.metrics.get(s.key)
            agree = agreement(cchosen.predictions, cref.predictions) if cchosen is not cref else 1.0
            artifacts = copy_artifacts(cctx, [cchosen]) if cchosen.artifact is not None else []
            chosen_file = next((a["path"] for a in artifacts if a["kind"].startswith(("onnx", "openvino"))), None)
        verdict = budget_check(o.budget, ref_metric, chosen_metric, agree)
        s.note(f"confirm split{' (the saved program, in a fresh process)' if program_target else ''}: "
               f"{chosen.variant if chosen else 'none'} {verdict.why}: "
               + ("within budget" if verdict.within else "OUTSIDE the budget"))
        summary = {
            **_settings(s, plan),
            "chosen": {**_chosen_row(s, chosen, chosen_file), "confirm_metric": chosen_metric,
                       "reference_confirm_metric": ref_metric, "confirm_agreement": agree},
            "budget_met": bool(budget_met_search and verdict.within), "budget_met_search": budget_met_search,
            **({"program": program_summary(program, s)} if program is not None else {}),
            "confirm": {"why": verdict.why, "margin": verdict.margin},
            **_search_record(s, plan),
            "environment": environment(),
            "metric": s.key, "time_s": round(time.perf_counter() - s.t_start, 2), "artifacts": artifacts,
            "resume_store": str(s.store.folder),
        }
        write_json(cctx.output.path("optimize.json"), summary)
        write_optimize_report(summary, cctx.output.path("optimize.html"), f"qdeploy optimize: {plan.cfg.model.source}")
        final = cctx.output.commit()
        summary["out"] = str(final)
    finally:
        cctx.output.abort()
    return summary


def _settings(s, plan: SearchPlan) -> dict:
    """optimize.json's settings: the target, the budget and how candidates were timed."""
    o = plan.o
    return {
        "target": o.target, "budget": o.budget.model_dump(exclude_none=True),
        "budget_text": o.budget_text(plan.cfg.model.task),
        # the agreement every candidate needed (budget.min_agreement or its default) and the siblings rule's numbers
        "agreement_floor": {"min_agreement": o.budget.floor, "default": o.budget.min_agreement is None,
                            "sibling_gap": SIBLING_GAP, "siblings_needed": SIBLINGS_NEEDED},
        "batch_size": s.batch_size,
        "threads": plan.threads,  # the CPU threads every candidate ran and was timed with (GPU targets: None)
        "latency_measured": s.target.measured, "timed_out": s.timed_out,
    }


def _chosen_row(s, c: Optional[Candidate], chosen_file: Optional[str]) -> dict:
    """optimize.json's ``chosen``, as measured on the search split."""
    ref = s.reference
    deploy = c.deploy(chosen_file) if c is not None else None
    return {"variant": c.variant if c else None, "kind": c.kind if c else None, "artifact": chosen_file,
            "search_metric": c.search_metric if c else None,
            "latency_p50_ms": c.latency_p50_ms if c else None,
            "reference_latency_p50_ms": ref.latency_p50_ms if ref else None,
            "reference_engine": ref.spec.get("engine") if ref else None,
            "float_layers": c.float_layers if c else None,
            "int8_share": c.int8_share if c else None, "int8_ops_share": c.int8_ops_share if c else None,
            "int8_share_basis": c.int8_share_basis if c else None,
            "float_macs_share": getattr(c, "float_macs_share", None),
            "stage": c.stage if c else None, "setting": c.spec if c else None,
            "description": c.describe() if c else None, "best_so_far": s.timed_out,
            **({"deploy": deploy} if deploy else {})}


def _search_record(s, plan: SearchPlan) -> dict:
    """optimize.json's record of the search: warnings, every candidate, the steps' records and decisions."""
    return {
        "warnings": s.warnings,
        **({"int8_op_profile": s.int8_op_profile} if s.int8_op_profile else {}),
        "int8_all_failed": any(w["code"] == "every-int8-variant-failed" for w in s.warnings),
        "candidates": [x.to_json() for x in s.candidates], "stages": s.stages, "decisions": s.decisions,
        "evaluations": s.evaluations,
        "splits": {"search": plan.n_search, "confirm": plan.n - plan.n_search, "seed": plan.o.seed},
    }


def confirm_a_program(s, cctx, chosen: Candidate, cref) -> tuple[dict, Candidate]:
    """(the confirmed program, the candidate it is): the chosen candidate saved and run from --out in a fresh process;
    where that fails (a program that ran in the search but not from the saved file: a CPU tensor the export kept, a
    compile that does not reload), the failure is said and the next fastest candidate within budget on the search split
    is saved and confirmed instead, down to FP32, so that a run never ends without an artifact while one can be saved
    and reloaded. What a failed attempt wrote into --out's staging folder is removed first."""
    staging = cctx.output.staging
    tried, errors, first_failure = [], [], None
    while True:
        before = {f.name for f in staging.iterdir()}
        program = confirm_program(s, cctx, chosen, cref)
        tried.append(chosen)
        if "error" not in program:
            if len(tried) > 1:
                program["replaces"] = [{"variant": c.variant, "error": e} for c, e in zip(tried, errors)]
            return program, chosen
        errors.append(program["error"])
        first_failure = first_failure or program
        s.note(f"{chosen.variant}: its saved program could not be confirmed from --out: {program['error']}",
               warning=True)
        for f in staging.iterdir():
            if f.name not in before and f.is_file():
                f.unlink()
        nxt = fastest_within([c for c in s.candidates if c.ok and all(c is not t for t in tried)])
        if nxt is None:  # none could be saved: the answer stays the chosen one, with its own failure
            return first_failure, tried[0]
        s.note(f"saving the next candidate within budget instead: {nxt.variant} ({nxt.verdict_text})")
        chosen = nxt


def program_summary(program: dict, s) -> dict:
    """optimize.json's ``program``: what was saved, how it loads, and what the fresh process measured."""
    fresh = program.get("fresh_process") or {}
    lat = fresh.get("latency_ms") or {}
    return {"error": program.get("error"), "replaces": program.get("replaces", []), "manifest": program.get("manifest"),
            "save_s": program.get("save_s"),
            "loader": "load_model.py", "fresh_process": fresh,
            "latency_p50_ms": {b: round(v["p50"], 5) for b, v in lat.items()},
            "first_call_s": {b: v.get("first_call_s") for b, v in lat.items()},
            "noisy": sorted(b for b, v in lat.items() if v.get("noisy")),
            "how_to_load": "import load_model; model = load_model.load(FOLDER); logits = model(images)  "
                           "# float32 NCHW, normalized as in model.preprocess; load_model.load(FOLDER, warm_up=True) "
                           "makes each batch size's first call (first_call_s) at load; python load_model.py FOLDER "
                           "--bench " + ",".join(str(b) for b in s.rank_batches) + " reproduces the latency"}


def confirm_program(s, cctx, chosen: Candidate, cref) -> dict:
    """Save the chosen candidate as a program in --out (artifacts/torch_program.py) and measure it the way a user
    would run it: its own ``load_model.py`` in a fresh process (no qdeploy, no model source imported there) on the
    confirm split, then timed at every ranked batch size. Returns the metrics, predictions, the loader's results and
    the artifact entries; a program that fails to save or to run is reported with why (``error``)."""
    cfg = cctx.cfg
    folder = cctx.output.staging
    eval_bs = cctx.eval_batches.batch_size
    input_shape = tuple(s.ctx.bench_inputs().shape[1:])
    settings = program_settings(chosen.spec, sorted(set(s.rank_batches) | {eval_bs}), input_shape)
    t0 = time.perf_counter()
    log(f"optimize: saving {chosen.variant} as a program (torch.export"
        + (", torch.compile's cache" if settings.compile else "") + f") into {cctx.output.final}")
    out = {"variant": chosen.variant}
    try:
        manifest = save_program(s.ctx.builder.torch_model(), settings, folder, s.aoti_probe)
    except Exception as e:  # noqa: BLE001 - export failures of arbitrary models: said, the search result stays
        out["error"] = f"saving {chosen.variant} failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return out
    out["save_s"] = round(time.perf_counter() - t0, 2)
    task = get_task(cfg.model.task).bind(cfg.model)  # detection: the decoder of the raw head outputs
    with tempfile.TemporaryDirectory(prefix="qdeploy-confirm-") as tmp:
        tmp = Path(tmp)
        images_npy, labels = tmp / "images.npy", []
        n = cctx.eval_batches.num_samples
        mm = None
        i = 0
        for images, y in cctx.eval_batches:
            x = normalize(images, cfg.model.preprocess)
            if mm is None:
                mm = np.lib.format.open_memmap(images_npy, mode="w+", dtype=np.float32, shape=(n, *x.shape[1:]))
            mm[i:i + len(x)] = x
            i += len(x)
            labels.append(np.asarray(y))
        mm.flush()
        del mm
        if i != n:  # on_error: skip dropped images: keep the ones decoded
            np.save(images_npy, np.load(images_npy, mmap_mode="r")[:i])
        log(f"optimize: {LOADER_NAME} in a fresh process on the {i} confirm images, then timed at batch "
            + ", ".join(str(b) for b in s.rank_batches))
        try:
            res = run_in_fresh_process(folder, images_npy, tmp / "outputs.npy",
                                       task.program_output, eval_bs, s.rank_batches,
                                       tmp / "result.json")
        except (RuntimeError, OSError, ValueError) as e:
            out["error"] = str(e)
            return out
        outputs = np.load(tmp / "outputs.npy")
    labels = np.concatenate(labels)
    metrics = task.metrics_of_program(outputs, labels, len((cref.metrics or {}).get("per_class_iou") or {}) or None,
                                      cfg.data.eval.ignore_index, cctx.eval_batches.class_names)
    out.update(metrics=metrics.result(), predictions=metrics.predictions, manifest=manifest,
               fresh_process={k: res.get(k) for k in ("load_s", "predict_s", "latency_ms", "environment", "log")})
    for line in res.get("log", []):
        log(f"optimize: {line}")
    kinds = {**{name: "torch-program" for name in manifest["programs"].values()}, LOADER_NAME: "loader",
             MANIFEST: "manifest", manifest.get("compile_cache") or "": "compile-cache"}
    out["artifacts"] = [{"variant": chosen.variant, "kind": kinds[f.name], "path": f.name,
                         "sha256": sha256_file(f), "produced_by": f"optimize (target {s.target.name})", "inputs": []}
                        for f in sorted(folder.iterdir()) if f.name in kinds]
    return out
