"""The fault suite (issue #20): qdeploy stopped by SIGINT or SIGKILL at fixed kill points (utils/faults.py) during
export, calibration, build, eval, bench, a QAT epoch and the output swap (before it, between its two halves, after
it). At each, ``--out`` must be the previous output or the new one, whole (never a mix, never lost), and the next
run must recover (finish or roll back the swap, delete the dead run's staging folder: no ``.DIR.*`` left) and reuse
what the killed run cached (the export at least).

Every run is the real CLI (``qdeploy.cli.main``: argument parsing, exit codes) in a real process, killed by a real
signal it sends itself. To keep the suite inside its time budget on two cores, the runs are forked from one
process that has imported qdeploy, torch and ONNX Runtime once (``_Forker``; an import costs ~8 s here, a run of
the tiny model ~2 s); one case also runs the ordinary way, ``python -m qdeploy`` in a subprocess of its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import SRC, TINY_MODEL, write_image_folder
from qdeploy.utils.atomic import OUTPUT_MARKER, read_manifest, recover

FORKER = r'''
import json, os, signal, sys, time, traceback
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises KeyboardInterrupt even if started ignoring it
import qdeploy.cli, qdeploy.pipeline, qdeploy.optimize.search, onnxruntime  # once; every job is forked from here
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if "preload" in job:
        for name in job["preload"]:
            __import__(name)
        print(json.dumps({"loaded": job["preload"]}), flush=True)
        continue
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        rc = 99
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(job["env"])
            rc = qdeploy.cli.main(job["argv"])
        except KeyboardInterrupt:
            rc = 130
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc if isinstance(rc, int) else 1)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall_s": time.perf_counter() - t0}), flush=True)
'''


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    env.pop("QDEPLOY_KILL_AT", None)
    env.pop("QDEPLOY_SWAP", None)
    return dict(env, **extra)


class _Forker:
    """One process with qdeploy imported; ``run(argv, env)`` forks a child that runs ``qdeploy.cli.main(argv)``."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=_env(), cwd=workdir)
        assert self.proc.stdout.readline().strip() == "ready"
        self.jobs = 0

    def preload(self, *modules: str) -> None:
        self.proc.stdin.write(json.dumps({"preload": list(modules)}) + "\n")
        self.proc.stdin.flush()
        assert "loaded" in json.loads(self.proc.stdout.readline())

    def run(self, argv: list, log: Path, **env) -> dict:
        self.jobs += 1
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        reply["log"] = log.read_text(errors="replace")
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ----------------------------------------------------------------------------------------------- what --out holds

def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _state(out: Path, previous: dict, result_file: str) -> str:
    """'previous' (byte for byte), 'new' (complete by its file list, and nothing else in it) or 'missing';
    anything else fails the test."""
    if not out.exists():
        return "missing"
    snap = _snapshot(out)
    if snap == previous:
        return "previous"
    manifest = read_manifest(out)
    assert manifest is not None, f"{out} is neither the previous output nor a complete new one: {sorted(snap)}"
    assert set(snap) == set(manifest["files"]) | {OUTPUT_MARKER}, f"a mix: {sorted(snap)} vs {sorted(manifest['files'])}"
    for rel, meta in manifest["files"].items():
        assert snap[rel] == meta["sha256"], f"{rel} is not the file the new output lists"
    json.loads((out / result_file).read_text())
    return "new"


def _leftovers(out: Path) -> list:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _make_previous(forker: _Forker, argv: list, out: Path, log: Path) -> dict:
    reply = forker.run(argv, log)
    assert reply["rc"] in (0, 3), reply["log"][-3000:]
    return reply


# ----------------------------------------------------------------------------------------------- qdeploy run

RUN_POINTS = ["export", "calibration", "build", "eval", "bench", "swap-before", "swap-between", "swap-after"]
# where the previous output must still be, and where the new one must already be (SIGINT during the swap acts once
# the swap is done; SIGKILL after the folders were exchanged leaves the new one)
EXPECTED = {("swap-between", "SIGINT"): "new", ("swap-between", "SIGKILL"): "new",
            ("swap-after", "SIGINT"): "new", ("swap-after", "SIGKILL"): "new"}
RUNS: list = []  # (command, point, signal, swap mode, state after the kill, rerun seconds, first-run seconds)


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    f = _Forker(tmp_path_factory.mktemp("forker"))
    yield f
    f.close()
    if RUNS:
        lines = [f"{len(RUNS)} killed runs, each followed by a recovering run:"]
        lines += [f"  {c:8s} {p:14s} {s:7s} {m:8s} → {st:8s} rerun {r:5.2f} s (first run {t:5.2f} s)" for c, p, s, m, st, r, t in RUNS]
        print("\n".join(lines))


@pytest.fixture(scope="module")
def run_setup(forker, tmp_path_factory):
    """A config of the tiny model (FP32 and INT8 in ONNX Runtime, 18 eval and 9 calibration images of 8x8) and a
    previous --out written by a first run (cold cache)."""
    root = tmp_path_factory.mktemp("run")
    (root / "tiny_model.py").write_text(TINY_MODEL)
    write_image_folder(root / "eval", per_class=6, size=(8, 8), seed=0)
    write_image_folder(root / "calib", per_class=3, size=(8, 8), seed=1)
    cfg = {"model": {"source": f"{root / 'tiny_model.py'}:tiny",
                     "preprocess": {"input_size": [8, 8], "mean": [0.5] * 3, "std": [0.25] * 3}},
           "data": {"eval": {"root": str(root / "eval"), "batch_size": 6, "workers": 0},
                    "calibration": {"root": str(root / "calib"), "batch_size": 9, "workers": 0}},
           "variants": [{"engine": "onnxruntime"}, {"engine": "onnxruntime", "precision": "int8", "method": "max"}],
           "bench": {"batch_sizes": [1], "warmup": 1, "iterations": 3}}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    first = _make_previous(forker, ["run", root / "cfg.yaml", "--out", root / "previous", "--cache-dir", root / "cache-prev"],
                           root / "previous", root / "previous.log")
    assert "export: cache hit" not in first["log"]
    return {"root": root, "cfg": root / "cfg.yaml", "previous": root / "previous", "first_s": first["wall_s"]}


def _kill_and_recover(forker, command: str, argv_of, template: Path, tmp_path: Path, point: str, sig: str, result_file: str,
                      swap: str = "exchange", expected: str = "previous", rerun_args: tuple = ()):
    """Copy the previous output to tmp_path/out, run `command` killed at `point` with `sig` (a cold cache), check --out,
    run again without the kill (same cache): check it recovered. Returns (killed reply, state, rerun reply)."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    shutil.copytree(template, out)  # copy2: sizes and mtimes kept, so the copy's file list still matches it
    previous = _snapshot(out)
    env = {"QDEPLOY_KILL_AT": f"{point}:{sig}"}
    if swap == "rename":
        env["QDEPLOY_SWAP"] = "rename"
    killed = forker.run(argv_of(out, cache), tmp_path / "killed.log", **env)
    assert killed["rc"] == (-9 if sig == "SIGKILL" else 130), killed["log"][-3000:]
    state = _state(out, previous, result_file)
    if state == "missing":  # only between the two renames of the fallback swap: the next open puts a whole one back
        assert (point, sig, swap) == ("swap-between", "SIGKILL", "rename"), _leftovers(out)
        assert any(".old-" in n for n in _leftovers(out)), _leftovers(out)
        recover(out)  # what the next run does first (OutputDir.__init__)
        state = "recovered-" + _state(out, previous, result_file)
        assert state == "recovered-new", state
    else:
        assert state == expected, (state, killed["log"][-2000:])
    again = forker.run(argv_of(out, cache, *rerun_args), tmp_path / "rerun.log")
    assert again["rc"] in (0, 3), again["log"][-3000:]
    assert _state(out, previous, result_file) == "new"
    assert _leftovers(out) == [], _leftovers(out)
    return killed, state, again


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
@pytest.mark.parametrize("point", RUN_POINTS)
def test_run_killed_at_every_point(forker, run_setup, tmp_path, point, sig):
    argv = lambda out, cache: ["run", run_setup["cfg"], "--out", out, "--cache-dir", cache]  # noqa: E731
    killed, state, again = _kill_and_recover(forker, "run", argv, run_setup["previous"], tmp_path, point, sig, "results.json",
                                             expected=EXPECTED.get((point, sig), "previous"))
    # the next run reuses what the killed one cached: the export always (every point comes after it), the INT8
    # artifact when the kill came after every variant was built ("build" stops after the first one)
    assert "export: cache hit" in again["log"], again["log"][-2000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    int8 = next(v for v in results["variants"] if v["precision"] == "int8")
    if RUN_POINTS.index(point) >= RUN_POINTS.index("eval"):
        assert int8["stages"]["build"]["cache_hit"] is True
    RUNS.append(("run", point, sig, "exchange", state, again["wall_s"], run_setup["first_s"]))


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
def test_run_killed_between_the_two_renames_of_the_fallback_swap(forker, run_setup, tmp_path, sig):
    """Where the atomic exchange is not available: DIR moved aside, staging not yet in. SIGKILL: DIR is missing until
    the next open finishes the swap (the staging folder is complete by its file list); SIGINT waits for the swap."""
    argv = lambda out, cache: ["run", run_setup["cfg"], "--out", out, "--cache-dir", cache]  # noqa: E731
    killed, state, again = _kill_and_recover(forker, "run", argv, run_setup["previous"], tmp_path, "swap-between", sig,
                                             "results.json", swap="rename", expected="new")
    assert "export: cache hit" in again["log"]
    RUNS.append(("run", "swap-between", sig, "rename", state, again["wall_s"], run_setup["first_s"]))


@pytest.mark.slow
def test_rolled_back_when_the_staging_folder_is_incomplete(forker, run_setup, tmp_path):
    """Killed between the renames, and the new output's staging folder then damaged (a file of its list gone): the
    next open cannot finish the swap, so it rolls back: the previous output, byte for byte."""
    out = tmp_path / "out"
    shutil.copytree(run_setup["previous"], out)
    previous = _snapshot(out)
    killed = forker.run(["run", run_setup["cfg"], "--out", out, "--cache-dir", tmp_path / "cache"], tmp_path / "k.log",
                        QDEPLOY_KILL_AT="swap-between:SIGKILL", QDEPLOY_SWAP="rename")
    assert killed["rc"] == -9 and not out.exists()
    staging = next(tmp_path.glob(".out.staging-*"))
    (staging / "report.md").unlink()
    done = recover(out)
    assert _state(out, previous, "results.json") == "previous" and _leftovers(out) == [] and "restored" in done[0]


@pytest.mark.slow
def test_the_first_run_into_a_new_folder_killed_at_the_swap_leaves_nothing(forker, run_setup, tmp_path):
    """No previous output: killed before the (single) rename there is no --out, only a staging folder that the next
    run deletes; killed after it, the whole new output."""
    out = tmp_path / "out"
    argv = ["run", run_setup["cfg"], "--out", out, "--cache-dir", tmp_path / "cache"]
    assert forker.run(argv, tmp_path / "k1.log", QDEPLOY_KILL_AT="swap-before:SIGKILL")["rc"] == -9
    assert not out.exists() and [n for n in _leftovers(out) if ".staging-" in n]
    assert forker.run(argv, tmp_path / "k2.log", QDEPLOY_KILL_AT="swap-between:SIGKILL")["rc"] == -9
    assert _state(out, {}, "results.json") == "new" and _leftovers(out) == []


@pytest.mark.slow
def test_the_real_entry_point_killed_between_the_renames(run_setup, tmp_path):
    """The same through `python -m qdeploy` in a subprocess of its own (no fork): SIGKILL mid-swap, then a run that
    recovers and finishes."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    shutil.copytree(run_setup["previous"], out)
    previous = _snapshot(out)
    cmd = [sys.executable, "-m", "qdeploy", "run", str(run_setup["cfg"]), "--out", str(out), "--cache-dir", str(cache)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=_env(QDEPLOY_KILL_AT="swap-between:SIGKILL", QDEPLOY_SWAP="rename"))
    assert p.returncode == -9 and not out.exists()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "its complete new output is now in place" in p.stderr and "export: cache hit" in p.stderr
    assert _state(out, previous, "results.json") == "new" and _leftovers(out) == []


# ----------------------------------------------------------------------------------------------- qdeploy optimize

@pytest.fixture(scope="module")
def optimize_setup(forker, tmp_path_factory):
    from test_qat import _config

    root = tmp_path_factory.mktemp("optimize")
    cfg = _config(root, "distill")
    cfg.pop("qat")
    cfg["data"]["eval"]["batch_size"] = 12
    cfg["bench"] = {"batch_sizes": [4], "warmup": 1, "iterations": 3}
    cfg["optimize"] = {"target": "onnxruntime-cpu", "methods": ["max"], "budget": {"max_drop": 100.0}}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    first = _make_previous(forker, ["optimize", root / "cfg.yaml", "--out", root / "previous", "--cache-dir", root / "cache-prev"],
                           root / "previous", root / "previous.log")
    return {"cfg": root / "cfg.yaml", "previous": root / "previous", "first_s": first["wall_s"]}


@pytest.mark.slow
@pytest.mark.parametrize("point, sig, swap, expected", [
    ("eval@2", "SIGKILL", "exchange", "previous"),     # mid-search: the first candidate is in the resume store
    ("calibration", "SIGINT", "exchange", "previous"),
    ("swap-before", "SIGINT", "exchange", "previous"),
    ("swap-between", "SIGKILL", "rename", "new"),
])
def test_optimize_killed(forker, optimize_setup, tmp_path, point, sig, swap, expected):
    argv = lambda out, cache: ["optimize", optimize_setup["cfg"], "--out", out, "--cache-dir", cache]  # noqa: E731
    killed, state, again = _kill_and_recover(forker, "optimize", argv, optimize_setup["previous"], tmp_path, point, sig,
                                             "optimize.json", swap=swap, expected=expected)
    assert "export: cache hit" in again["log"], again["log"][-2000:]
    summary = json.loads((tmp_path / "out" / "optimize.json").read_text())
    if point == "eval@2" or point.startswith("swap"):  # candidates evaluated before the kill are replayed, not re-run
        assert summary["evaluations"]["cached"] >= 1, summary["evaluations"]
    RUNS.append(("optimize", point, sig, swap, state, again["wall_s"], optimize_setup["first_s"]))


# ----------------------------------------------------------------------------------------------- qdeploy qat

@pytest.fixture(scope="module")
def qat_setup(forker, tmp_path_factory):
    from test_qat import _config

    root = tmp_path_factory.mktemp("qat")
    (root / "cfg.yaml").write_text(yaml.safe_dump(_config(root, "distill", epochs=2.0)))
    forker.preload("qdeploy.quantize.qat_quantizer", "qdeploy.report.qat_page", "modelopt.torch.quantization")
    first = _make_previous(forker, ["qat", root / "cfg.yaml", "--out", root / "previous", "--cache-dir", root / "cache-prev"],
                           root / "previous", root / "previous.log")
    return {"cfg": root / "cfg.yaml", "previous": root / "previous", "first_s": first["wall_s"]}


@pytest.mark.slow
@pytest.mark.parametrize("point, sig, swap, expected", [
    ("qat-epoch", "SIGKILL", "exchange", "previous"),  # after epoch 1's checkpoint: --resume trains epoch 2 only
    ("eval", "SIGINT", "exchange", "previous"),        # training finished: --resume trains nothing
    ("swap-between", "SIGKILL", "rename", "new"),
])
def test_qat_killed_then_resumed(forker, qat_setup, tmp_path, point, sig, swap, expected):
    argv = lambda out, cache, *more: ["qat", qat_setup["cfg"], "--out", out, "--cache-dir", cache, *more]  # noqa: E731
    killed, state, again = _kill_and_recover(forker, "qat", argv, qat_setup["previous"], tmp_path, point, sig, "qat.json",
                                             swap=swap, expected=expected, rerun_args=("--resume",))
    log = again["log"]
    assert "export: cache hit" in log and "calibrate: cache hit" in log, log[-2000:]
    summary = json.loads((tmp_path / "out" / "qat.json").read_text())
    assert [e["epoch"] for e in summary["log"]] == [1, 2]
    if point == "qat-epoch":
        assert "resumed from" in log and "after epoch 1" in log
    else:
        assert "already finished" in log
    previous = json.loads((qat_setup["previous"] / "qat.json").read_text())
    assert summary["after"] == previous["after"]  # resumed training reaches what an uninterrupted one reaches
    RUNS.append(("qat", point, sig, swap, state, again["wall_s"], qat_setup["first_s"]))

