"""``--out`` written whole (utils/atomic.OutputDir), and never deleting what qdeploy did not write (issue #20, item 11):
the output folder's file list, the refusals, files that appear during a run, stale staging folders of dead runs.
Real files, real processes; the kill-point matrix is tests/test_faults.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import SRC
from qdeploy import api
from qdeploy.cli import main
from qdeploy.errors import QDeployError
from qdeploy.utils.atomic import OUTPUT_MARKER, OutputDir, foreign_files, read_manifest


def _write(out_dir: OutputDir, files: dict) -> None:
    for name, text in files.items():
        out_dir.path(name).parent.mkdir(parents=True, exist_ok=True)
        out_dir.path(name).write_text(text)


def _leftovers(folder) -> list:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


@pytest.mark.parametrize("swap", ["exchange", "rename"])
def test_the_file_list_and_a_whole_replacement(tmp_path, monkeypatch, swap):
    if swap == "rename":
        monkeypatch.setenv("QDEPLOY_SWAP", "rename")
    out = tmp_path / "out"
    first = OutputDir(out)
    _write(first, {"results.json": "{}", "plots/a.png": "png"})
    assert first.commit() == out
    manifest = read_manifest(out)
    assert set(manifest["files"]) == {"results.json", "plots/a.png"} and manifest["dirs"] == ["plots"]
    assert manifest["files"]["results.json"]["size"] == 2 and len(manifest["files"]["results.json"]["sha256"]) == 64
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode
    second = OutputDir(out)
    _write(second, {"results.json": '{"run": 2}'})
    second.commit()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [OUTPUT_MARKER, "results.json"]
    assert _leftovers(out) == []


@pytest.mark.slow
def test_a_file_the_user_put_in_an_earlier_output_is_refused_and_kept(tiny_config, tmp_path, capsys):
    tiny_config["variants"] = [{"engine": "onnxruntime"}]
    tiny_config["bench"] = {"enabled": False}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    out = tmp_path / "out"
    argv = ["run", str(cfg), "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    (out / "notes.txt").write_text("my analysis")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "notes.txt" in err and "did not write" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(out) == []
    # moved out: the folder is qdeploy's again and is replaced
    (out / "notes.txt").unlink()
    assert main(argv) == 0


def test_a_changed_file_is_refused_a_touched_one_is_not(tmp_path):
    out = tmp_path / "out"
    o = OutputDir(out)
    _write(o, {"results.json": "{}", "report.md": "# report"})
    o.commit()
    later = time.time() + 5
    os.utime(out / "report.md", (later, later))  # touched: same bytes, new mtime
    OutputDir(out).abort()
    (out / "report.md").write_text("# report, with my notes")
    with pytest.raises(QDeployError, match=r"did not write \(e\.g\. report\.md, changed since qdeploy wrote it\)"):
        OutputDir(out)
    assert (out / "report.md").read_text() == "# report, with my notes"


def test_a_folder_the_user_made_inside_is_refused(tmp_path):
    out = tmp_path / "out"
    o = OutputDir(out)
    _write(o, {"results.json": "{}"})
    o.commit()
    (out / "mine").mkdir()
    assert "e.g. mine)" in foreign_files(out)
    with pytest.raises(QDeployError, match="did not write"):
        OutputDir(out)


def test_an_output_without_a_file_list_is_refused(tmp_path):
    """An older qdeploy's marker (no file list) or a folder of someone else's: nothing says which files are qdeploy's."""
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / OUTPUT_MARKER).write_text("written by qdeploy; this folder is replaced whole by the next run\n")
    (legacy / "results.json").write_text("{}")
    with pytest.raises(QDeployError, match="older qdeploy wrote it without a file list"):
        OutputDir(legacy)
    empty = tmp_path / "empty"
    empty.mkdir()
    OutputDir(empty).abort()  # an empty folder is fine


def test_files_that_appear_during_a_run_are_kept_and_the_output_goes_beside(tmp_path):
    out = tmp_path / "out"
    o = OutputDir(out)
    _write(o, {"results.json": "1"})
    o.commit()
    run = OutputDir(out)                       # opened while out held only qdeploy's files ...
    (out / "draft.tex").write_text("mine")     # ... then the user saved a file into it
    _write(run, {"results.json": "2"})
    final = run.commit()
    assert final == tmp_path / "out-2" and (final / "results.json").read_text() == "2"
    assert (out / "draft.tex").read_text() == "mine" and (out / "results.json").read_text() == "1"
    assert _leftovers(out) == []


def test_a_symlinked_out_replaces_the_folder_it_points_at(tmp_path):
    target = tmp_path / "real"
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    target.mkdir()
    o = OutputDir(link)
    _write(o, {"results.json": "{}"})
    o.commit()
    assert link.is_symlink() and (target / "results.json").is_file()


def test_recovery_deletes_the_staging_folder_of_a_dead_run_only(tmp_path):
    """A staging folder is locked by the run that writes it: a second run into the same --out leaves a live one alone,
    and deletes it once its run has died (SIGKILL: nothing of it ran its cleanup)."""
    out = tmp_path / "out"
    code = ("import sys, time; from qdeploy.utils.atomic import OutputDir; o = OutputDir(sys.argv[1]); "
            "print(o.staging, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(SRC)))
    try:
        staging = proc.stdout.readline().strip()
        assert staging and os.path.isdir(staging)
        OutputDir(out).abort()
        assert os.path.isdir(staging)  # its run is alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        OutputDir(out).abort()
        assert not os.path.exists(staging) and _leftovers(out) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_qat_writes_its_output_whole_and_keeps_the_checkpoint_in_the_cache(tmp_path):
    """`qdeploy qat` into a folder holding a user's file is refused before training; its checkpoint lives in the
    training folder (the cache, keyed by --out), with a copy in --out."""
    from test_qat import _config

    from qdeploy.quantize.qat_quantizer import command_folder

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cfg = _config(tmp_path, "distill", epochs=1.0)
    with pytest.raises(QDeployError, match=r"did not write \(e\.g\. keep\.txt\)"):
        api.qat(cfg, out, cache_dir=tmp_path / "cache")
    assert not command_folder(tmp_path / "cache", out).exists()  # refused before any training
    (out / "keep.txt").unlink()
    summary = api.qat(cfg, out, cache_dir=tmp_path / "cache")
    work = command_folder(tmp_path / "cache", out)
    assert summary["training_folder"] == str(work) and (work / "qat-checkpoint.pt").is_file()
    assert (out / "qat-checkpoint.pt").read_bytes() == (work / "qat-checkpoint.pt").read_bytes()
    assert set(read_manifest(out)["files"]) == {p.name for p in out.iterdir()} - {OUTPUT_MARKER}
    assert json.loads((out / "qat.json").read_text())["artifact"] == "qat.onnx" and _leftovers(out) == []
