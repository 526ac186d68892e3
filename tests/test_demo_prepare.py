"""`qdeploy demo --prepare DIR` (issue #33): the demo's images and weights as files for examples/digits_cnn.yaml. The
whole path (training included) runs in CI through bench/ci/readme_walkthrough.py; here: a user's folder is refused before
any work, and nothing of it is touched."""
from __future__ import annotations

from qdeploy.cli import main


def test_prepare_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.md").write_text("keep me\n")
    rc = main(["--quiet", "demo", "--prepare", str(dest), "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "holds files qdeploy did not write (e.g. notes.md)" in err[0], err
    assert [p.name for p in dest.iterdir()] == ["notes.md"] and (dest / "notes.md").read_text() == "keep me\n"
    assert not (tmp_path / "cache").exists()  # refused before the digits were written or the CNN trained


def test_prepare_refuses_a_file(tmp_path, capsys):
    dest = tmp_path / "digits"
    dest.write_text("x")
    assert main(["--quiet", "demo", "--prepare", str(dest), "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "a file, not a folder" in capsys.readouterr().err and dest.read_text() == "x"
