"""Every hint an error message gives works when followed (issue #33).

An error that says "set X", "add Y", "did you mean Z", "list them in data.eval.classes" is only useful if doing exactly
that makes the run pass the check. For each case of tests/test_bad_inputs.py whose message carries such a hint, the
table below applies the hint as the message states it (nothing more) and runs the same command again: it must then
exit 0. Every other case is listed in ``NO_CONFIG_HINT`` with why its message has nothing to apply mechanically, so a
new bad-input case must say which of the two it is (``test_every_case_is_classified``).
"""
from __future__ import annotations

import copy
import shutil
from typing import Callable

import pytest
import yaml

from qdeploy.cli import main
from test_bad_inputs import CASES, Env, base_config, template  # noqa: F401 - template is a fixture

pytestmark = pytest.mark.slow


def _rename_key(section: str, old: str, new: str) -> Callable[[Env], None]:
    def follow(e: Env) -> None:
        e.cfg[section][new] = e.cfg[section].pop(old)
    return follow


def _rename_variant_key(old: str, new: str) -> Callable[[Env], None]:
    def follow(e: Env) -> None:
        # new dicts: the case's setup put the CASES table's own list into the config
        e.cfg["variants"] = [{(new if k == old else k): x for k, x in v.items()} for v in e.cfg["variants"]]
        # the renamed variant is INT8: it then needs calibration images, which the next check asks for with its own
        # hint (calib-absent-for-int8 follows that one)
        _add_calibration(e)
    return follow


def _list_all_model_classes(e: Env) -> None:
    # "list all 5 of them in output order in data.eval.classes: a YAML list of folder names (classes: [a, b, c, ...])"
    e.cfg["data"]["eval"]["classes"] = ["a", "b", "c", "d", "e"]


def _add_missing_class_line(e: Env) -> None:
    # "class folder .../c is not listed in the class-list file ...: list every class of the model, in its output order"
    e.file("classes.txt", "a first\nb second\nc third\n")


def _on_error_skip(section: str) -> Callable[[Env], None]:
    def follow(e: Env) -> None:
        e.cfg["data"][section]["on_error"] = "skip"
    return follow


def _labels_false(e: Env) -> None:
    e.cfg["data"]["eval"]["labels"] = False


def _one_name_per_class(e: Env) -> None:
    e.cfg["data"]["eval"]["class_names"] = ["x", "y", "z"]


def _add_calibration(e: Env) -> None:
    e.cfg["data"]["calibration"] = {"root": "data/calib", "workers": 0}


def _disjoint_split(e: Env) -> None:
    # "use a disjoint folder or split (count + complement)": one folder, a seeded half each
    e.cfg["data"]["eval"].update(count=6, seed=0)
    e.cfg["data"]["calibration"].update(root="data/eval", count=6, seed=0, complement=True)


def _weights_random(e: Env) -> None:
    e.cfg["model"]["weights"] = "random"


def _remove_weights(e: Env) -> None:
    del e.cfg["model"]["weights"]


def _onnx_as_source(e: Env) -> None:
    # "give it as model.source (and remove model.weights)"
    e.cfg["model"]["source"] = e.cfg["model"].pop("weights")
    e.cfg["variants"] = [{"engine": "onnxruntime"}]


def _new_out(e: Env) -> None:
    e.out = e.root / "new-out"


def _did_you_mean_torchvision(e: Env) -> None:
    e.cfg["model"]["source"] = "torchvision:mobilenet_v3_small"
    e.cfg["model"]["kwargs"] = {"num_classes": 3}
    e.cfg["model"]["preprocess"]["input_size"] = [32, 32]  # MobileNetV3 downsamples 32x: 8x8 would be 0x0


# case id -> the hint, applied as its message words it
HINT_FIXES: dict[str, Callable[[Env], None]] = {
    "config-unknown-key": _rename_key("bench", "iteratoins", "iterations"),          # did you mean 'iterations'?
    "config-renamed-key": _rename_variant_key("calibrator", "method"),                # 'calibrator' was renamed to 'method'
    "model-unknown-torchvision": _did_you_mean_torchvision,                           # did you mean mobilenet_v3_small
    "model-output-count": _list_all_model_classes,                                    # list all 5 of them in data.eval.classes
    "weights-torchvision-missing": _weights_random,                                   # write model.weights: random
    "weights-onnx": _onnx_as_source,                                                  # give it as model.source
    "weights-for-onnx-source": _remove_weights,                                       # remove model.weights
    "data-corrupt-jpeg": _on_error_skip("eval"),                                      # set data.eval.on_error: skip
    "calib-corrupt-image": _on_error_skip("calibration"),                             # set data.calibration.on_error: skip
    "data-flat-folder": _labels_false,                                                # set labels: false
    "data-label-map-missing-class": _add_missing_class_line,                          # list every class of the model
    "data-class-names-count": _one_name_per_class,                                    # give one name per class
    "calib-absent-for-int8": _add_calibration,                                        # add data.calibration
    "calib-overlaps-eval": _disjoint_split,                                           # split (count + complement)
    "out-user-folder": _new_out,                                                      # choose a new or empty folder
    "out-inside-eval-data": _new_out,                                                 # choose an output folder outside
    "out-is-model-weights": _new_out,                                                 # choose another output folder
    "out-is-cache-dir": _new_out,
    "out-parent-is-file": _new_out,
}

# case id -> why its message has no hint a test could apply to the config (the fix is the user's file or code)
NO_CONFIG_HINT = {
    "config-wrong-type": "names the key and the bad value; the right value is the user's",
    "config-missing-source": "names the missing key; its value is the user's model",
    "config-unknown-engine": "'did you mean tensorrt' for 'tensorflow' is a spelling guess, not a fix (TensorRT is absent here)",
    "config-negative-batch-size": "states the rule (positive integers)",
    "config-yaml-syntax": "points at the line and column to fix",
    "config-file-missing": "names the file",
    "config-empty": "names the file",
    "config-top-level-list": "states the rule",
    "config-two-errors": "names both keys and the rules",
    "config-unknown-variant-flag": "lists the labels to choose from",
    "model-source-file-missing": "names the file",
    "model-onnx-garbage": "export the model again: the user's model",
    "model-onnx-two-inputs": "a model property",
    "model-input-size-rejected": "the right size is the model's",
    "model-not-callable": "name the factory: the user's code",
    "model-factory-raises": "the user's code",
    "model-factory-raises-multiline": "the user's code",
    "model-file-syntax-error": "the user's code",
    "model-kwargs-rejected": "the user's code",
    "model-nan-output": "check normalisation or weights: a diagnosis, not an edit",
    "model-output-not-classes": "set model.output or model.task: which one depends on the model",
    "model-source-not-a-source": "lists the accepted forms",
    "model-module-not-importable": "the user's environment",
    "weights-missing-file": "names the file",
    "weights-png": "the user's checkpoint",
    "weights-jpeg": "the user's checkpoint",
    "weights-empty": "the user's checkpoint",
    "weights-other-architecture": "the user's checkpoint or kwargs",
    "weights-text": "the user's checkpoint",
    "weights-zip": "the user's archive",
    "weights-whole-module": "re-save the checkpoint: the user's code",
    "weights-key-missing": "lists the keys there are",
    "weights-truncated": "the user's file",
    "data-root-missing": "names the folder",
    "data-empty-folder": "states the expected layout",
    "data-non-images": "lists the image suffixes",
    "data-classes-file-missing": "names the file",
    "data-classes-file-duplicate": "names both lines",
    "data-root-is-file": "names the path",
    "data-format-task-mismatch": "states the mismatch",
    "data-all-corrupt-skipped": "the user's images",
    "calib-folder-missing": "names the folder",
    "calib-empty": "states the expected layout",
    "calib-cache-missing": "names the file",
    "calib-root-is-file": "names the path",
    "calib-all-corrupt-skipped": "the user's images",
    "calib-count-zero": "states the rule",
    "out-is-file": "names the path",
    "out-user-folder-optimize": "same message and fix as out-user-folder",
    "out-is-calibration-data": "same fix as out-is-model-weights",
    "out-is-project-folder": "same fix as out-is-model-weights",
    "out-parent-not-writable": "the user's permissions",
}

_CASES = {c[0]: c for c in CASES}


def test_every_case_is_classified():
    assert set(HINT_FIXES) | set(NO_CONFIG_HINT) == set(_CASES), sorted(set(_CASES) ^ (set(HINT_FIXES) | set(NO_CONFIG_HINT)))
    assert not set(HINT_FIXES) & set(NO_CONFIG_HINT)


def _run(e: Env, capsys) -> tuple[int, str]:
    e.config_path = e.project / "config.yaml"
    e.config_path.write_text(e.config_text if e.config_text is not None else yaml.safe_dump(e.cfg, sort_keys=False))
    capsys.readouterr()
    rc = main(["--quiet", e.command, str(e.config_path), "--out", str(e.out), "--cache-dir", str(e.cache), *e.extra_args])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("case_id", sorted(HINT_FIXES))
def test_following_the_hint_passes(case_id, template, tmp_path, monkeypatch, capsys):  # noqa: F811
    _, _, setup, expected = _CASES[case_id]
    project = tmp_path / "project"
    shutil.copytree(template, project)
    monkeypatch.chdir(tmp_path)
    e = Env(root=tmp_path, project=project, cfg=copy.deepcopy(base_config()), out=tmp_path / "out", cache=tmp_path / "cache")
    setup(e)
    rc, err = _run(e, capsys)
    assert rc == 2 and expected in err, err  # the case fails as tests/test_bad_inputs.py says, with its hint
    HINT_FIXES[case_id](e)
    rc, err = _run(e, capsys)
    assert rc == 0, f"followed the hint of '{case_id}', still: {err}"
