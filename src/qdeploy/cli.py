"""``qdeploy`` command line: a thin layer over :mod:`qdeploy.api`.

Stage modules are imported inside the commands on purpose: they pull in torch and ONNX Runtime
(seconds), which ``qdeploy --help``, argument errors and user errors should not wait for. Before importing them,
``main`` loads the config, applies the command line's overrides and checks --out, the data folders, the first image
and the model files (:func:`_checked_config`, with qdeploy.config and qdeploy.utils.inputs: pydantic, PyYAML, numpy
and PIL), with the messages the stages give for the same problems.

User errors (bad config, missing files, corrupt images...) print one line and exit with code 2;
``--debug`` shows the traceback as well.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from qdeploy import __version__
from qdeploy.errors import QDeployError

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


_EXIT_RUN = ("exit codes: 0 the run completed (read the report for degraded variants); 1 every variant failed or was "
             "skipped; 2 user error (one line on stderr, nothing written); 4 the config had INT8 variants and none ran; "
             "130 interrupted")
_EXIT_OPTIMIZE = ("exit codes: 0 the budget was met on the confirm split; 2 user error (one line on stderr; --out "
                  "untouched); 3 the budget was missed on the confirm split; 4 the search had INT8 "
                  "candidates and none of them ran (the answer is a float candidate; the first line says why); 130 "
                  "interrupted. A traceback (exit 1) is a bug in qdeploy, not a result")
_CACHE_HELP = "cache folder for exported/quantized artifacts (default: $QDEPLOY_CACHE or ~/.cache/qdeploy); must not overlap --out"


def _add_config_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run config (YAML); its relative paths are relative to the file")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output folder: new, empty, or an earlier qdeploy output folder (replaced whole when the command "
                        "succeeds); a folder holding other files is refused")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR", help=_CACHE_HELP)


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_config_out(p)
    p.add_argument("--variant", action="append", metavar="NAME",
                   help="only the variant with this label or name (repeatable); labels as in the report, e.g. onnxruntime-fp32")


def _sub(sub, name: str, summary: str, description: str, examples: list[str], extra: str = "") -> argparse.ArgumentParser:
    """A subcommand with its one-line summary (in ``qdeploy --help``), a description and examples (``qdeploy NAME --help``)."""
    import textwrap

    epilog = "example:\n" + "\n".join(f"  {e}" for e in examples) + (f"\n\n{textwrap.fill(extra, 100)}" if extra else "")
    return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{textwrap.fill(description, 100)}",
                          epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qdeploy", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare a vision model across engines and precisions on real data.",
        epilog="example:\n  qdeploy run examples/cifar10_resnet20.yaml --out runs/r20\n\n"
               "qdeploy COMMAND --help shows each command's options and an example.")
    parser.add_argument("--version", action="version", version=f"qdeploy {__version__}", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--quiet", action="store_true", help="no log lines or progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _sub(sub, "run", "the whole comparison: export, evaluate, benchmark, report",
             "Builds every variant's artifact (ONNX, FP16, INT8 Q/DQ...), evaluates and benchmarks each on the config's "
             "images and writes results.json, report.md, report.html and the deployable files into --out.",
             ["qdeploy run examples/cifar10_resnet20.yaml --out runs/r20"], _EXIT_RUN)
    _add_common(p)
    p = _sub(sub, "eval", "accuracy only (no benchmark)",
             "Like run, without the latency/throughput measurements.",
             ["qdeploy eval config.yaml --out runs/acc --variant onnxruntime-fp32"], _EXIT_RUN)
    _add_common(p)
    p = _sub(sub, "bench", "latency/throughput/memory only (no accuracy)",
             "Like run, without the accuracy evaluation; --batch-sizes and --iterations override the config's bench: section.",
             ["qdeploy bench config.yaml --out runs/speed --batch-sizes 1,32 --iterations 200"], _EXIT_RUN)
    _add_common(p)
    p.add_argument("--batch-sizes", default=None, metavar="N,N", help="override bench.batch_sizes, e.g. 1,32")
    p.add_argument("--iterations", type=int, default=None, metavar="N", help="override bench.iterations (timed runs per batch size)")
    p = _sub(sub, "export", "export to ONNX and verify against PyTorch",
             "Exports the config's PyTorch model (or reuses the cached export), checks its outputs against PyTorch on real "
             "images and writes DIR/model.onnx and DIR/export.json.",
             ["qdeploy export config.yaml --out runs/onnx"])
    _add_config_out(p)
    p = _sub(sub, "quantize", "calibrate and write the INT8 artifacts of the config's int8 variants",
             "Calibrates on data.calibration and writes each int8 variant's Q/DQ ONNX, its TensorRT calibration cache and "
             "its Q/DQ structure, without measuring.",
             ["qdeploy quantize config.yaml --out runs/int8 --variant onnxruntime-int8-mean-minmax"])
    _add_common(p)
    p = _sub(sub, "optimize", "the fastest artifact within optimize.budget",
             "Searches FP32/FP16/INT8 candidates (and per-layer fallback, optionally QAT) on a seeded search split of "
             "data.eval, confirms the choice once on the rest and writes optimize.json, optimize.html and the chosen "
             "artifact.",
             ["qdeploy optimize config.yaml --out runs/opt",
              "qdeploy optimize config.yaml --out runs/opt-cpu --target cpu --max-drop 0.5 --time-limit 600"],
             _EXIT_OPTIMIZE)
    _add_config_out(p)
    # each flag sets one field of the config's optimize: section (its other settings stay) and is validated like it:
    # values are checked by the config model, not here, so a bad one gets the config's own message, naming the flag
    p.add_argument("--target", default=None, metavar="TARGET",
                   help="override optimize.target: onnxruntime-cpu, cpu (ONNX Runtime or OpenVINO, whichever is faster), "
                        "tensorrt, torch-cuda, torch-cpu, onnxruntime-cuda")
    p.add_argument("--max-drop", default=None, metavar="POINTS",
                   help="override optimize.budget.max_drop: at most this many points of top-1/mIoU lost against FP32 "
                        "(replaces budget.relative; budget.min_agreement stays, as a floor)")
    p.add_argument("--min-agreement", default=None, metavar="SHARE",
                   help="override optimize.budget.min_agreement: the share of FP32's predictions kept, in (0, 1]; a floor "
                        "beside max_drop/relative (the config's or --max-drop), else the budget alone")
    p.add_argument("--time-limit", default=None, metavar="SECONDS",
                   help="override optimize.time_limit: seconds for the search (the best candidate so far is kept); "
                        "saving the chosen artifact and its confirm run come after it")
    p = _sub(sub, "build", "build every variant's artifact without measuring",
             "Writes each variant's artifact (ONNX, Q/DQ ONNX, TensorRT engine + sidecar) and build.json; TensorRT "
             "variants also record their trtexec command lines.",
             ["qdeploy build config.yaml --out runs/build"])
    _add_common(p)
    p = _sub(sub, "qat", "quantization-aware training from the PTQ model (qat: section)",
             "Fine-tunes the calibrated INT8 model and writes qat.onnx (TensorRT placement), qat-onnxruntime.onnx, "
             "qat.json and qat.html; the training images must not be evaluation images.",
             ["qdeploy qat examples/cifar10_resnet20_qat_tensorrt.yaml --out runs/qat",
              "qdeploy qat examples/cifar10_resnet20_qat_tensorrt.yaml --out runs/qat --resume"])
    _add_config_out(p)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run into the same --out from its last epoch checkpoint (kept in the cache; same model, data and qat: config)")
    p = _sub(sub, "lint", "why a Q/DQ ONNX will or won't run fast in TensorRT (rules, fixes)",
             "Lints a Q/DQ ONNX for TensorRT's explicit quantization: each finding names the layer, the rule and the fix.",
             ["qdeploy lint model_qdq.onnx", "qdeploy lint model_qdq.onnx --fix model_fixed.onnx"],
             "exit codes: 0 clean (or only 'fine' findings); 1 findings that block INT8 or cost reformats; 2 the file "
             "cannot be linted")
    p.add_argument("model", help="Q/DQ ONNX (qdeploy's, ModelOpt's, ONNX Runtime's quantize_static QDQ output, a QAT export)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema qdeploy.lint/1)")
    p.add_argument("--fix", metavar="OUT.onnx", default=None, help="apply the safe fixes and write the result here (a new file)")
    p.add_argument("--no-confirm", action="store_true", help="static analysis only, even where TensorRT is installed")
    p = _sub(sub, "doctor", "which engines, devices and versions are usable here",
             "Prints the Python, CPU, GPU and library versions, each engine × device with whether it is usable, the "
             "registered quantizers and TensorRT's status.",
             ["qdeploy doctor", "qdeploy doctor --json > env.json"])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = _sub(sub, "demo", "train a small CNN on scikit-learn's digits and compare it (offline)",
             "Writes the bundled digits as PNG folders, trains a small CNN (cached) and runs the normal comparison on "
             "the held-out split: about 1-2 minutes on a CPU, no download.",
             ["qdeploy demo", "qdeploy demo --out runs/demo2"])
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="output folder (default: runs/demo)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR", help=_CACHE_HELP)
    p.add_argument("--prepare", default=None, metavar="DIR",
                   help="instead of the comparison: write the demo's images (DIR/train, DIR/test) and trained weights "
                        "(DIR/digits_cnn.pt) as files, for examples/digits_cnn.yaml (which reads runs/digits)")
    return parser


# ---------------------------------------------------------------------------------------------
# Before the stages are imported: the config, the command line's overrides and the input files, checked with
# qdeploy.config, PIL and the standard library only. torch, ONNX, ONNX Runtime, OpenVINO and ModelOpt take seconds to
# import; a typo or a missing file is named in about a second instead, with the message the full run gives (the
# checks and their messages live once, in config.py and utils/inputs.py, and the stages call the same functions).

# commands that read data.eval and the model and write --out through the pipeline's open_run (or optimize's own
# validation, which makes the same checks first); qat checks its own sections in its own order: config only
_CHECKED_EARLY = ("run", "eval", "bench", "build", "quantize", "export", "optimize")
# optimize flag → (field path in the optimize: section, fields of the same budget it replaces)
_OPTIMIZE_FLAGS = {"--target": (("target",), ()), "--time-limit": (("time_limit",), ()),
                   "--max-drop": (("budget", "max_drop"), ("relative",)),
                   "--min-agreement": (("budget", "min_agreement"), ())}


def _flag_error(flag_values: dict, err) -> QDeployError:
    """A ValidationError of a config field set from the command line, as one line: the flags, then the config's own
    message ('--max-drop -1: optimize.budget.max_drop: Input should be greater than or equal to 0')."""
    from qdeploy.config import RunConfig, format_validation_error

    flags = " ".join(f"{f} {v}" for f, v in flag_values.items())
    return QDeployError(f"{flags}: " + format_validation_error(err, "", RunConfig).removeprefix("invalid config : "))


def _apply_overrides(cfg, args):
    """The command line's overrides of config fields, assigned to the parsed config: the models validate them."""
    from pydantic import ValidationError

    if args.command == "bench" and (args.batch_sizes or args.iterations is not None):
        section, given = cfg.bench.model_dump(exclude_unset=True), {}
        if args.batch_sizes:
            try:
                section["batch_sizes"] = [int(b) for b in args.batch_sizes.split(",")]
            except ValueError:
                raise QDeployError(f"--batch-sizes '{args.batch_sizes}': expected integers separated by commas") from None
            given["--batch-sizes"] = args.batch_sizes
        if args.iterations is not None:
            section["iterations"] = given["--iterations"] = args.iterations
        try:
            cfg.bench = section  # the bench: section with the flags' fields, validated whole by BenchSpec
        except ValidationError as e:
            raise _flag_error(given, e) from None
    if args.command == "optimize":
        given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in _OPTIMIZE_FLAGS}
        given = {flag: value for flag, value in given.items() if value is not None}
        if given:
            # the optimize: section as written (unset keys keep their defaults), the flags' fields set in it, then
            # assigned whole: OptimizeConfig and BudgetSpec validate the result together (the budget's rules included)
            section = cfg.optimize.model_dump(exclude_unset=True) if cfg.optimize is not None else {}
            for flag, value in given.items():
                path, replaces = _OPTIMIZE_FLAGS[flag]
                holder = section
                for key in path[:-1]:
                    holder = holder.setdefault(key, {})
                holder[path[-1]] = value
                for key in replaces:
                    holder.pop(key, None)
            try:
                cfg.optimize = section
            except ValidationError as e:
                raise _flag_error(given, e) from None
    return cfg


def _check_data_root(spec) -> None:
    """A data section's folder: present and a folder (what building its data set checks first, same message)."""
    from qdeploy.errors import DataError
    from qdeploy.utils.inputs import existing_dir, keyed_data_error

    if spec.format != "imagefolder":  # SegNet layouts: checked by the data stage
        return
    try:
        existing_dir(spec.root, "dataset folder")
    except DataError as e:
        raise keyed_data_error(e, spec.key) from None


def _first_image(spec, task: str):
    """The first image the data stage decodes from ``spec`` when that is certain (the whole image folder is read and an
    unreadable image stops the run), else None (the data stage checks it, in its own order)."""
    from qdeploy.tasks import get_task
    from qdeploy.utils.inputs import class_folders, folder_images, has_loose_images, unlabelled_images

    if spec.format != "imagefolder" or spec.on_error != "error" or spec.count is not None or spec.subsplit is not None:
        return None
    root = Path(spec.root).expanduser()
    if not spec.labels or (spec.labels_optional and has_loose_images(root)):  # data.datasets.UnlabelledImages
        return next(iter(unlabelled_images(root)), None)
    if get_task(task).dataset_format != "imagefolder":  # only the image folder of class folders is read here
        return None
    for name in class_folders(root):  # data.datasets.ImageFolderDataset: class folders in order, images sorted
        files = folder_images(root / name)
        if files:
            return files[0]
    return None


def _check_first_image(spec, task: str) -> None:
    from qdeploy.errors import UnreadableImage
    from qdeploy.utils.inputs import open_image, unreadable_image_message

    path = _first_image(spec, task)
    if path is not None:
        try:
            open_image(str(path))
        except UnreadableImage as e:
            raise UnreadableImage(unreadable_image_message(str(e), spec.key)) from None


def _check_model_files(cfg) -> None:
    """model.source's file and model.weights (the model stage's own checks and messages)."""
    from qdeploy.config import source_format
    from qdeploy.utils.inputs import check_model_file, check_onnx_file, check_weights_file

    source, kind = cfg.model.source, source_format(cfg.model.source)
    if kind == "onnx":
        check_onnx_file(Path(source).expanduser())
    if kind != "pytorch":
        return
    module_part, sep, attr = source.rpartition(":")
    if sep and attr and module_part.endswith(".py"):
        check_model_file(Path(module_part).expanduser())
    weights = cfg.model.weights_file
    if weights and not weights.startswith("pkg:"):
        check_weights_file(Path(weights).expanduser())


def _check_inputs(cfg, args) -> None:
    """What the command's first stage would refuse, in the order it checks: --out, data.eval's folder, the calibration
    data (when every variant runs and an INT8 one needs it), data.eval's first image, the model's files."""
    from qdeploy.config import check_output_folder
    from qdeploy.utils.atomic import OutputDir
    from qdeploy.utils.inputs import check_calibration_cache

    check_output_folder(cfg, args.out, args.cache_dir)
    OutputDir(args.out).abort()  # a folder holding the user's files is refused now (it is opened again later)
    task = cfg.model.task
    _check_data_root(cfg.data.eval)
    int8 = [v for v in cfg.variants if v.int8 is not None]
    if args.command in ("run", "eval", "bench", "build", "quantize") and not args.variant \
            and not any(v.int8.quantizer == "qat" for v in int8):
        for i, v in enumerate(cfg.variants):
            if v.int8 is not None and v.int8.calibration_cache:
                check_calibration_cache(i, v.int8.calibration_cache)
        if cfg.data.calibration is not None and any(not v.int8.calibration_cache for v in int8):
            _check_data_root(cfg.data.calibration)
            _check_first_image(cfg.data.calibration, task)
    _check_first_image(cfg.data.eval, task)
    _check_model_files(cfg)


def _checked_config(args):
    """The config, loaded and validated, with the command line's overrides, and (for the commands that read data and
    write --out) the input files checked: all before torch or ONNX is imported."""
    from qdeploy.config import load_config

    cfg = _apply_overrides(load_config(args.config), args)
    if args.command in _CHECKED_EARLY:
        _check_inputs(cfg, args)
    return cfg


def _cmd_run(args, cfg, stages) -> int:
    from qdeploy import api

    results = api.run(cfg, args.out, stages=stages, only=args.variant, cache_dir=args.cache_dir)
    return run_exit_code(results)


def optimize_exit_code(summary: dict) -> int:
    """`qdeploy optimize`'s exit code: 4 when the search had INT8 candidates and none of them ran (the answer is then
    a float candidate, and the first line says why every INT8 candidate failed); 3 when the budget was missed on the
    confirm split; 0 otherwise."""
    if summary.get("int8_all_failed"):
        return 4
    return 0 if summary.get("budget_met") else 3


def run_exit_code(results: dict) -> int:
    """`qdeploy run/eval/bench`'s exit code (README, "Exit codes"; 2 = user error, 3 = optimize's budget missed):
    1 when no variant ran (every one failed or was skipped); 4 when the run had INT8 variants and none of them ran
    (results.json warnings[].code "every-int8-variant-failed"); else 0. A degraded variant ran: it counts as run."""
    from qdeploy.evaluate.verdict_rules import INT8_ALL_FAILED, RAN_STATUSES

    if not any(v["status"] in RAN_STATUSES for v in results["variants"]):
        return 1
    if any(w.get("code") == INT8_ALL_FAILED for w in results.get("warnings") or []):
        return 4
    return 0


def _cmd_lint(args) -> int:
    from qdeploy import api

    if args.fix and Path(args.fix).resolve() == Path(args.model).resolve():
        raise QDeployError(f"--fix {args.fix}: write the fixed model to a new file, not over the input")
    report = api.lint(args.model, fix_to=args.fix, confirm=not args.no_confirm)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from qdeploy.report import print_lint

        print_lint(report)
        if args.fix:
            print(f"wrote {args.fix}")
    return 0 if report["verdict"] == "clean" else 1


def _cmd_doctor(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from qdeploy.engines import engine_table
    from qdeploy.quantize import QUANTIZERS
    from qdeploy.sysinfo import environment

    env, rows = environment(), engine_table()
    trt = _tensorrt_line()
    keras = _keras_line()
    quantizers = {name: q.description for name, q in QUANTIZERS.items()}
    if args.json:
        print(json.dumps({"environment": env, "engines": rows, "quantizers": quantizers, "tensorrt": trt, "keras": keras},
                         indent=2))
        return 0
    console = Console()
    # every line is plain text (install hints like pip install 'qdeploy[tensorrt]', versions, notes): printed without
    # markup, so that rich does not take [tensorrt] for a style and drop it; only the usable column is coloured
    plain = dict(markup=False, highlight=False)
    console.print(f"qdeploy {__version__} — python {env['python']} on {env['platform']}", **plain)
    console.print(f"CPU: {env['cpu']} ({env['cpu_count']} cores; {' '.join(env['cpu_flags']) or 'no AVX2/VNNI flags seen'})", **plain)
    console.print(f"GPU: {env['gpu'] or 'none visible to PyTorch'}" + (f" (CUDA {env['cuda']}, cuDNN {env['cudnn']})" if env["gpu"] else ""),
                  **plain)
    console.print("versions: " + ", ".join(f"{k} {env[k]}" for k in ("torch", "torchvision", "onnx", "onnxruntime", "numpy", "timm")
                                           if env.get(k)), **plain)
    table = Table("engine", "device", "precisions", "usable", "note")
    for r in rows:
        table.add_row(escape(r["engine"]), escape(r["device"]), escape(" ".join(r["precisions"])),
                      "[green]yes[/green]" if r["usable"] else "[red]no[/red]", escape(r["note"] or ""))
    console.print(table)
    console.print("quantizers (int8 variants' quantizer:, auto picks): " + "; ".join(f"{k}: {v}" for k, v in quantizers.items()),
                  **plain)
    console.print(f"tensorrt: {trt}", **plain)
    console.print(f"keras: {keras}", **plain)
    return 0


def _keras_line() -> str:
    """Whether Keras / TensorFlow sources (.keras, .h5, SavedModel) can be converted here (the keras extra)."""
    from qdeploy.export.keras import keras_problem, keras_versions

    problem = keras_problem()
    if problem:
        return f"Keras sources (.keras, .h5, SavedModel folders) cannot be converted: {problem}"
    v = keras_versions()
    return (f"Keras sources converted to ONNX by tf2onnx {v['tf2onnx']} (TensorFlow {v['tensorflow']}, Keras {v['keras']}, "
            "in a separate TensorFlow process)")


def _tensorrt_line() -> str:
    """The TensorRT version or its absence, and what that implies for tensorrt variants."""
    from qdeploy.facts.tensorrt import tensorrt_version

    version = tensorrt_version()
    if version is None:
        return ("TensorRT is not installed (pip install 'qdeploy[tensorrt]' needs NVIDIA's package index): engine: tensorrt "
                "variants are skipped with that reason; their trtexec command lines (10.x and 11.x) and the ONNX files "
                "they use are still written. The engine build and runner have not run against a real TensorRT yet "
                "(docs/tensorrt.md)")
    major = version.split(".")[0]
    how = {"10": "precision by builder flags (FP16, INT8 on Q/DQ or a calibration cache)",
           "11": "strongly typed networks only (FP16 = FP16 ONNX, INT8 = Q/DQ ONNX)"}.get(major)
    return (f"TensorRT {version}: " + (how if how else "not supported (qdeploy builds with 10.x and 11.x)") +
            "; engines are tied to this GPU and TensorRT version (sidecar .engine.json)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from qdeploy.utils.log import set_debug, set_quiet

    set_quiet(args.quiet)
    set_debug(args.debug)
    try:
        # the config and the input files first, before any stage (and torch, ONNX...) is imported
        cfg = _checked_config(args) if getattr(args, "config", None) is not None else None
        if args.command == "run":
            return _cmd_run(args, cfg, ("eval", "bench"))
        if args.command == "eval":
            return _cmd_run(args, cfg, ("eval",))
        if args.command == "bench":
            return _cmd_run(args, cfg, ("bench",))
        if args.command == "export":
            from qdeploy import api

            summary = api.export(cfg, args.out, cache_dir=args.cache_dir)
            print(f"wrote {summary['copied_to']} ({summary['produced_by']}, {summary['size_mb']:.2f} MB)")
            return 0
        if args.command == "optimize":
            from qdeploy import api

            summary = api.optimize(cfg, args.out, cache_dir=args.cache_dir)
            if not args.quiet:
                from qdeploy.report.console import print_optimize

                print_optimize(summary)
            from qdeploy.report.optimize_page import chosen_line

            print(chosen_line(summary))
            print(f"wrote {summary['out']}/optimize.json")
            return optimize_exit_code(summary)
        if args.command == "build":
            from qdeploy import api

            summary = api.build(cfg, args.out, only=args.variant, cache_dir=args.cache_dir)
            for name, info in summary["variants"].items():
                state = "built" if info["status"] == "ok" else f"{info['status']}: {info['reason']}"
                print(f"{name}: {state}; files: {', '.join(info['files']) or 'none'}")
                for major, line in (info.get("trtexec") or {}).items():
                    print(f"  trtexec ({major}): {line}")
            print(f"wrote {summary['out']}/build.json")
            return 0 if all(i["status"] in ("ok", "skipped") for i in summary["variants"].values()) else 1
        if args.command == "quantize":
            from qdeploy import api

            summary = api.quantize(cfg, args.out, only=args.variant, cache_dir=args.cache_dir)
            failed = 0
            for name, info in summary["variants"].items():
                if info["status"] != "ok":
                    failed += 1
                    print(f"{name}: {info['status']} at {info['failed_stage']}: {info['reason']}")
                    continue
                from qdeploy.lint import structure_line

                lint = info.get("lint") or {}
                print(f"{name}: {summary['out']}/{info['artifact']} — {structure_line(info['structure'])}"
                      + (f"; TensorRT lint: {lint['verdict']}" if "verdict" in lint else ""))
            return 1 if failed == len(summary["variants"]) else 0
        if args.command == "qat":
            from qdeploy import api

            summary = api.qat(cfg, args.out, resume=args.resume, cache_dir=args.cache_dir)
            if "metric" not in summary:  # a torchrun rank other than 0: rank 0 reports
                return 0
            print(f"{summary['metric']}: FP32 {summary['fp32']:.4f}, PTQ {summary['before']:.4f}, QAT {summary['after']:.4f}; "
                  f"wrote {Path(summary.get('out') or args.out) / summary['artifact']} and {Path(summary.get('out') or args.out) / 'qat.json'}")
            return 0
        if args.command == "lint":
            return _cmd_lint(args)
        if args.command == "doctor":
            return _cmd_doctor(args)
        if args.command == "demo":
            if args.prepare:
                from qdeploy.demo import prepare_files

                print(f"wrote {prepare_files(args.prepare, cache_dir=args.cache_dir)}: train/, test/, digits_cnn.pt")
                return 0
            from qdeploy.demo import run_demo

            from qdeploy.evaluate.verdict_rules import RAN_STATUSES

            results = run_demo(args.out, cache_dir=args.cache_dir)
            return 0 if any(v["status"] in RAN_STATUSES for v in results["variants"]) else 1
    except QDeployError as e:
        if args.debug:
            raise
        message = str(e) if sys.stderr.isatty() else _ANSI.sub("", str(e))
        print(f"qdeploy: error: {message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("qdeploy: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
