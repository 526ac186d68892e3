"""Config contract: the issue's example is accepted; unknown keys and wrong types are named."""
import pytest
import yaml

from qdeploy.config import load_config, parse_config
from qdeploy.errors import ConfigError

CONTRACT = """
model:
  source: path/to/cifar_resnet.py:resnet20
  weights: path/to/resnet20.pt
  task: classification
  preprocess: {input_size: [32, 32], mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}
data:
  eval: {format: imagefolder, root: path/to/cifar10/test}
  calibration: {format: imagefolder, root: path/to/cifar10/train, count: 512, seed: 0}
variants:
  - {engine: torch, precision: fp32}
  - {engine: onnxruntime, precision: fp32}
bench: {batch_sizes: [1, 32], warmup: 10, iterations: 100}
"""


def test_contract_example_is_accepted_and_paths_are_relative_to_the_file(tmp_path):
    path = tmp_path / "sub" / "config.yaml"
    path.parent.mkdir()
    path.write_text(CONTRACT)
    cfg = load_config(path)
    assert cfg.model.source == f"{tmp_path}/sub/path/to/cifar_resnet.py:resnet20"
    assert cfg.model.weights == f"{tmp_path}/sub/path/to/resnet20.pt"
    assert cfg.data.calibration.count == 512
    assert [v.label for v in cfg.variants] == ["torch-fp32", "onnxruntime-fp32"]
    assert cfg.bench.batch_sizes == [1, 32]
    assert cfg.model.preprocess.input_size == (32, 32)


def _data():
    return yaml.safe_load(CONTRACT)


def test_unknown_key_is_named_with_a_suggestion():
    d = _data()
    d["bench"]["warmpu"] = 3
    with pytest.raises(ConfigError) as e:
        parse_config(d, "c.yaml")
    assert "bench.warmpu: unknown key (did you mean 'warmup'?)" in str(e.value)


def test_unknown_key_inside_a_list_item_is_named():
    d = _data()
    d["variants"][1]["precison"] = "fp16"
    with pytest.raises(ConfigError) as e:
        parse_config(d, "c.yaml")
    assert "variants[1].precison: unknown key (did you mean 'precision'?)" in str(e.value)


def test_wrong_types_are_named():
    d = _data()
    d["bench"]["iterations"] = "many"
    d["model"]["preprocess"]["mean"] = [0.5, 0.5]
    with pytest.raises(ConfigError) as e:
        parse_config(d, "c.yaml")
    msg = str(e.value)
    assert "bench.iterations" in msg and "'many'" in msg
    assert "model.preprocess" in msg and "mean needs 3 values" in msg


def test_bad_enum_and_missing_key():
    d = _data()
    d["variants"][0]["engine"] = "tensorflow"
    del d["data"]["eval"]["root"]
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    msg = str(e.value)
    assert "variants[0].engine" in msg and "tensorflow" in msg
    assert "data.eval.root: required key is missing" in msg


def test_engine_specific_option_on_the_wrong_engine():
    d = _data()
    d["variants"][1]["cuda_graphs"] = True
    with pytest.raises(ConfigError, match="cuda_graphs' does not apply to engine 'onnxruntime'"):
        parse_config(d)


def test_duplicate_variant_names_are_rejected():
    d = _data()
    d["variants"].append({"engine": "torch"})
    with pytest.raises(ConfigError, match="both named 'torch-fp32'"):
        parse_config(d)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(empty)
