"""`engine: tensorrt` variants on a machine without TensorRT (this one): skipped with the reason, the rest of the run
goes on, and each records the trtexec command lines for TensorRT 10.x and 11.x with the ONNX files they use written
to --out (issue #10). Nothing here builds or runs an engine."""
import json

import pytest

from qdeploy import api
from qdeploy.facts.tensorrt import tensorrt_version
from test_qat import _config


@pytest.fixture
def no_tensorrt():
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here: this test covers its absence")


@pytest.mark.slow
def test_tensorrt_variants_without_tensorrt_are_skipped_with_trtexec_lines_and_onnx(tmp_path, no_tensorrt):
    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "fp32"},
                       {"engine": "tensorrt", "precision": "fp16", "workspace_mib": 512},
                       {"engine": "tensorrt", "precision": "int8", "method": "max"}]
    cfg["bench"] = {"batch_sizes": [1, 4], "warmup": 1, "iterations": 2}
    out = tmp_path / "out"
    results = api.run(cfg, out, cache_dir=tmp_path / "cache")
    by = {v["name"]: v for v in results["variants"]}
    assert by["onnxruntime-fp32"]["status"] == "ok"  # the rest of the run continues
    fp16, int8 = by["tensorrt-fp16-ws-512"], by["tensorrt-int8-max"]
    for v in (fp16, int8):
        assert v["status"] == "skipped" and "TensorRT is not installed" in v["reason"]
        assert set(v["trtexec"]) == {"10.x", "11.x"}
    # 10.x: precision by flag on the FP32 ONNX; 11.x: strongly typed on the calibrated FP16 ONNX, no precision flags
    assert "--fp16" in fp16["trtexec"]["10.x"] and "--onnx=model.onnx" in fp16["trtexec"]["10.x"]
    t11 = fp16["trtexec"]["11.x"]
    assert "--stronglyTyped" in t11 and "--fp16" not in t11 and "--onnx=model-fp16-calibrated.onnx" in t11
    assert "--memPoolSize=workspace:512M" in t11 and "--minShapes=input:1x3x16x16" in t11 and "--maxShapes=input:4x3x16x16" in t11
    # INT8: the TensorRT-placement Q/DQ ONNX for both majors; --int8 only on 10.x
    assert "--int8" in int8["trtexec"]["10.x"] and "--int8" not in int8["trtexec"]["11.x"]
    for v in (fp16, int8):
        for name in v["details"]["onnx"].values():
            assert (out / name).is_file(), name
    assert int8["details"]["onnx"]["10.x"] == int8["details"]["onnx"]["11.x"] == "tensorrt-int8-max.onnx"
    on_disk = json.loads((out / "results.json").read_text())
    assert {v["name"]: v.get("trtexec") for v in on_disk["variants"]}["tensorrt-fp16-ws-512"] == fp16["trtexec"]


@pytest.mark.slow
def test_legacy_calibration_cache_int8_is_a_10x_only_line(tmp_path, no_tensorrt):
    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["variants"] = [{"engine": "tensorrt", "precision": "int8", "int8_mode": "calibration-cache"}]
    cfg["bench"] = {"enabled": False}
    cfg["eval"] = {"enabled": False}
    v = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")["variants"][0]
    assert "--calib=" in v["trtexec"]["10.x"] and "--onnx=model.onnx" in v["trtexec"]["10.x"]
    assert v["trtexec"]["11.x"].startswith("not possible: TensorRT 11.4.0 removed implicit INT8 calibration")


def test_doctor_reports_tensorrt_absence_and_what_it_implies(capsys, no_tensorrt):
    from qdeploy.cli import main

    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    row = next(r for r in info["engines"] if r["engine"] == "tensorrt")
    assert row["usable"] is False and "trtexec lines and ONNX files are still written" in row["note"]


def test_bad_profile_is_refused_before_any_work(tmp_path):
    from qdeploy.errors import ConfigError

    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["variants"] = [{"engine": "tensorrt", "precision": "fp32",
                        "profiles": [{"input": "input", "min": [1, 3, 16, 16], "opt": [8, 3, 16, 16], "max": [4, 3, 16, 16]}]}]
    with pytest.raises(ConfigError, match=r"(?s)variants\[0\].*profiles: .*opt outside min..max"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("workspace", [0, -256])
def test_a_workspace_that_is_not_positive_is_refused_before_any_work(tmp_path, workspace):
    """A workspace of 0 MiB would leave TensorRT no scratch memory (and `if workspace_mib:` would read it as "no
    limit"): refused at config time, naming the variant and the key, before anything is exported or built."""
    from qdeploy.errors import ConfigError

    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "fp32"},
                       {"engine": "tensorrt", "precision": "fp16", "workspace_mib": workspace}]
    with pytest.raises(ConfigError, match=rf"(?s)variants\[1\] \(engine tensorrt\).*workspace_mib: .*greater than 0 "
                                          rf"\(got {workspace}\)"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out" / "results.json").exists()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.onnx"))


def test_qdeploy_build_writes_onnx_and_trtexec_lines(tmp_path, no_tensorrt, capsys):
    import yaml

    from qdeploy.cli import main

    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "fp32"}, {"engine": "tensorrt", "precision": "fp32"}]
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["build", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    assert "tensorrt-fp32: skipped: TensorRT is not installed" in printed and "trtexec (11.x): trtexec --onnx=model.onnx" in printed
    summary = json.loads((tmp_path / "out" / "build.json").read_text())
    assert summary["variants"]["onnxruntime-fp32"]["status"] == "ok"
    assert summary["variants"]["tensorrt-fp32"]["files"] == ["model.onnx"] and (tmp_path / "out" / "model.onnx").is_file()
    assert "--stronglyTyped" in summary["variants"]["tensorrt-fp32"]["trtexec"]["11.x"]


@pytest.mark.slow
def test_fp16_without_calibration_images_says_which_major_cannot(tmp_path, no_tensorrt):
    """TensorRT 11's FP16 needs the calibrated FP16 ONNX; without data.calibration only the 10.x line is possible."""
    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["data"].pop("calibration")
    cfg["variants"] = [{"engine": "tensorrt", "precision": "fp16"}]
    cfg["bench"] = {"enabled": False}
    v = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")["variants"][0]
    assert "--fp16" in v["trtexec"]["10.x"]
    assert v["trtexec"]["11.x"].startswith("not possible:") and "data.calibration" in v["trtexec"]["11.x"]


def test_explicit_profiles_give_a_file_name_safe_label():
    from qdeploy.config import parse_config
    from qdeploy.engines import resolve_variants

    cfg = parse_config({"model": {"source": "demo", "preprocess": {"input_size": [8, 8]}}, "data": {"eval": {"root": "x"}},
                        "variants": [{"engine": "tensorrt", "precision": "fp16",
                                      "profiles": [{"input": "input", "min": [1, 3, 8, 8], "opt": [4, 3, 8, 8], "max": [8, 3, 8, 8]}]}]})
    label = resolve_variants(cfg)[0].label
    assert label.startswith("tensorrt-fp16-profiles-") and all(c.isalnum() or c in "-_.+" for c in label), label


@pytest.mark.slow
def test_trtexec_lines_name_the_file_really_written_when_variants_share_an_artifact(tmp_path, no_tensorrt):
    """An ONNX Runtime TensorRT-placement variant and a TensorRT variant share one Q/DQ artifact; it is written once,
    under the first variant's name, and the TensorRT variant's trtexec lines must name that file."""
    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "method": "max"},
                       {"engine": "tensorrt", "precision": "int8", "method": "max"}]
    cfg["bench"] = {"enabled": False}
    out = tmp_path / "out"
    v = {x["name"]: x for x in api.run(cfg, out, cache_dir=tmp_path / "cache")["variants"]}["tensorrt-int8-max"]
    assert v["details"]["onnx"]["10.x"] == "onnxruntime-int8-trt-max.onnx" and (out / "onnxruntime-int8-trt-max.onnx").is_file()
    for line in v["trtexec"].values():
        assert "--onnx=onnxruntime-int8-trt-max.onnx" in line, line
