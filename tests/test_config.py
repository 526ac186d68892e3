"""Config contract: the issue's example is accepted; unknown keys and wrong types are named."""
import pytest
import yaml

from qdeploy.config import Int8Config, VariantSpec, load_config, parse_config
from qdeploy.engines import resolve_variants
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
    assert [v.label for v in resolve_variants(cfg)] == ["torch-fp32", "onnxruntime-fp32"]
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
        resolve_variants(parse_config(d, "c.yaml"))
    assert "variants[1].precison: not an option of engine 'onnxruntime' (did you mean 'precision'?)" in str(e.value)


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
    with pytest.raises(ConfigError, match=r"variants\[0\].engine: unknown engine 'tensorflow' \(did you mean 'tensorrt'\?\); engines: onnxruntime, openvino, tensorrt, torch"):
        resolve_variants(parse_config(d))
    del d["data"]["eval"]["root"]
    with pytest.raises(ConfigError, match="data.eval.root: required key is missing"):
        parse_config(d)


def test_engine_specific_option_on_the_wrong_engine():
    d = _data()
    d["variants"][1]["channels_last"] = True
    with pytest.raises(ConfigError, match=r"variants\[1\].channels_last: not an option of engine 'onnxruntime'; its options: "
                                          "cuda_graphs, graph_optimization, providers"):
        resolve_variants(parse_config(d))


def test_engine_option_of_the_wrong_type_is_named():
    d = _data()
    d["variants"][0]["compile"] = "fastest"
    with pytest.raises(ConfigError, match=r"variants\[0\] \(engine torch\)"):
        resolve_variants(parse_config(d))


def test_precision_the_engine_does_not_run():
    d = _data()
    d["variants"][0]["precision"] = "int8"
    with pytest.raises(ConfigError, match="engine 'torch' runs fp32, fp16, bf16, not int8"):
        resolve_variants(parse_config(d))


def test_two_variants_that_would_get_the_same_label_are_rejected():
    d = _data()
    d["variants"].append({"engine": "torch", "threads": 2})  # threads are not part of the label
    with pytest.raises(ConfigError, match=r"variants\[2\] and variants\[0\] would both be labelled 'torch-fp32'"):
        resolve_variants(parse_config(d))
    d["variants"][2]["name"] = "torch-fp32-2threads"
    assert [v.label for v in resolve_variants(parse_config(d))][-1] == "torch-fp32-2threads"


def test_int8_settings_are_one_object_and_labels_tell_settings_apart():
    d = _data()
    d["variants"] = [
        {"engine": "onnxruntime", "precision": "int8"},
        {"engine": "onnxruntime", "precision": "int8", "method": "mse", "placement": "tensorrt"},
        {"engine": "onnxruntime", "precision": "int8", "method": "mse", "placement": "tensorrt", "exclude": ["fc"]},
        {"engine": "onnxruntime", "precision": "int8", "method": "mse", "placement": "tensorrt", "exclude": ["conv1"]},
        {"engine": "onnxruntime", "precision": "int8", "int8": {"method": "percentile", "percentile": 99.9}, "quantizer": "onnx"},
    ]
    cfg = parse_config(d)
    assert cfg.variants[0].int8 == Int8Config()  # defaults in one place
    assert cfg.variants[4].int8.quantizer == "onnx" and cfg.variants[4].int8.percentile == 99.9
    labels = [v.label for v in resolve_variants(cfg)]
    assert labels == ["onnxruntime-int8-mean-minmax", "onnxruntime-int8-trt-mse", "onnxruntime-int8-trt-mse-excl-fc",
                      "onnxruntime-int8-trt-mse-excl-conv1", "onnxruntime-int8-onnx-percentile99.9"]


def test_renamed_and_misplaced_int8_keys():
    with pytest.raises(ValueError, match="'calibrator' was renamed to 'method'"):
        VariantSpec.model_validate({"engine": "onnxruntime", "precision": "int8", "calibrator": "max"})
    with pytest.raises(ValueError, match="'target' was renamed to 'placement'"):
        VariantSpec.model_validate({"engine": "onnxruntime", "precision": "int8", "target": "tensorrt"})
    with pytest.raises(ValueError, match="option 'method' applies only to precision int8"):
        VariantSpec.model_validate({"engine": "onnxruntime", "method": "max"})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        VariantSpec.model_validate({"engine": "onnxruntime", "precision": "int8", "exclude": ["(unclosed"]})


def test_unknown_quantizer_name():
    d = _data()
    d["variants"] = [{"engine": "onnxruntime", "precision": "int8", "quantizer": "olive"}]
    with pytest.raises(ConfigError, match="unknown quantizer 'olive' \\(known: auto, modelopt, nncf, onnx, qat\\)"):
        resolve_variants(parse_config(d))


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


def test_every_config_error_is_one_line(tmp_path):
    """The CLI prints one line per error: several problems are joined on it, YAML's caret diagram is not copied."""
    d = _data()
    d["bench"]["warmup"] = -1
    d["bench"]["iterations"] = 0
    with pytest.raises(ConfigError) as e:
        parse_config(d, "c.yaml")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("invalid config c.yaml: bench.warmup:") and "; bench.iterations:" in msg
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {source: m.py:f\ndata: [\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert "\n" not in str(e.value)
    assert "bad.yaml is not valid YAML" in str(e.value) and "at line 2, column 5" in str(e.value)


@pytest.mark.parametrize("source", ["torchvision:resnet18", "timm:resnet10t"])
def test_torchvision_and_timm_sources_need_weights_or_weights_random(source):
    """issue #20 item 8: no weights would silently measure a randomly initialised network."""
    d = _data()
    d["model"]["source"] = source
    del d["model"]["weights"]
    with pytest.raises(ConfigError) as e:
        parse_config(d, "c.yaml")
    assert f"model.weights: missing for {source}" in str(e.value) and "model.weights: random" in str(e.value)
    d["model"]["kwargs"] = {"weights": None}  # torchvision's own default: not a decision either
    with pytest.raises(ConfigError, match="model.weights: missing"):
        parse_config(d, "c.yaml")
    d["model"]["weights"] = "random"
    cfg = parse_config(d, "c.yaml")
    assert cfg.model.weights == "random" and cfg.model.weights_file is None
    # pretrained weights that the library itself loads are weights too
    d["model"].pop("weights")
    d["model"]["kwargs"] = {"weights": "DEFAULT"} if source.startswith("torchvision") else {"pretrained": True}
    assert parse_config(d, "c.yaml").model.weights is None


def test_weights_random_is_not_a_path_and_file_sources_keep_their_own_init(tmp_path):
    path = tmp_path / "c.yaml"
    d = _data()
    d["model"]["source"] = "torchvision:resnet18"
    d["model"]["weights"] = "random"
    path.write_text(yaml.safe_dump(d))
    assert load_config(path).model.weights == "random"  # not resolved to tmp_path/random
    d = _data()
    del d["model"]["weights"]  # a file.py factory may load its own weights
    assert parse_config(d).model.weights is None


def test_weights_for_an_onnx_source_are_refused():
    d = _data()
    d["model"]["source"] = "model.onnx"
    with pytest.raises(ConfigError, match="model.weights: applies to PyTorch sources only"):
        parse_config(d, "c.yaml")


def test_dataset_specs_know_their_config_key():
    d = _data()
    d["qat"] = {"data": {"root": "train"}}
    cfg = parse_config(d)
    assert (cfg.data.eval.key, cfg.data.calibration.key, cfg.qat.data.key) == ("data.eval", "data.calibration", "qat.data")
    # calibration never needs labels; evaluation does (it measures accuracy)
    assert cfg.data.calibration.labels_optional and not cfg.data.eval.labels_optional
    again = parse_config(parse_config(d).model_dump(mode="json"))  # optimize re-parses dumped configs
    assert again.data.eval.key == "data.eval" and again.data.calibration.labels_optional
