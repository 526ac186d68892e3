"""Model intake from every source kind, and its bad-input errors."""
import pytest
import torch

from qdeploy.config import ModelSpec
from qdeploy.errors import ModelError
from qdeploy.models import build_torch_model

PRE = {"input_size": [8, 8]}


def spec(**kw):
    return ModelSpec(preprocess=PRE, **kw)


def test_file_factory_with_weights_loads_them(tiny_model_file, tiny_weights):
    model = build_torch_model(spec(source=f"{tiny_model_file}:tiny", weights=str(tiny_weights)))
    saved = torch.load(tiny_weights, weights_only=True)
    assert torch.equal(model.model.conv.weight, saved["conv.weight"])
    assert not model.training
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3)


def test_torchvision_source_with_kwargs():
    model = build_torch_model(spec(source="torchvision:resnet18", kwargs={"num_classes": 7, "weights": None}, weights="random"))
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def test_package_module_source_and_dict_output_selection(tiny_model_file):
    model = build_torch_model(spec(source="qdeploy.demo.model:digits_cnn", kwargs={"num_classes": 4}))
    assert model(torch.randn(1, 1, 16, 16)).shape == (1, 4)
    seg = build_torch_model(spec(source=f"{tiny_model_file}:tiny_seg", task="segmentation", output="out"))
    assert seg(torch.randn(1, 3, 8, 8)).shape == (1, 3, 8, 8)
    ambiguous = build_torch_model(spec(source=f"{tiny_model_file}:tiny_seg", task="segmentation"))
    with pytest.raises(ModelError, match="set model.output"):
        ambiguous(torch.randn(1, 3, 8, 8))


def test_timm_source():
    pytest.importorskip("timm")
    model = build_torch_model(spec(source="timm:resnet10t", kwargs={"num_classes": 5}, weights="random"))
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 5)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match=r"model file .*nope\.py does not exist"):
        build_torch_model(spec(source=f"{tmp_path}/nope.py:net"))


def test_model_file_that_fails_to_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import does_not_exist_anywhere\n")
    with pytest.raises(ModelError, match=r"broken\.py failed to import: ModuleNotFoundError"):
        build_torch_model(spec(source=f"{bad}:net"))


def test_factory_not_callable_and_missing(tiny_model_file):
    with pytest.raises(ModelError, match="'NOT_CALLABLE' is a int, not a callable factory"):
        build_torch_model(spec(source=f"{tiny_model_file}:NOT_CALLABLE"))
    with pytest.raises(ModelError, match="has no attribute 'nope'"):
        build_torch_model(spec(source=f"{tiny_model_file}:nope"))


def test_unknown_source_forms():
    with pytest.raises(ModelError, match="is not one of"):
        build_torch_model(spec(source="resnet18"))
    with pytest.raises(ModelError, match="torchvision:no_such_net"):
        build_torch_model(spec(source="torchvision:no_such_net", weights="random"))


def test_weights_that_do_not_match_name_the_keys(tiny_model_file, tmp_path):
    state = {"conv.weight": torch.zeros(8, 3, 5, 5), "conv.bias": torch.zeros(8), "extra.weight": torch.zeros(1)}
    path = tmp_path / "wrong.pt"
    torch.save(state, path)
    with pytest.raises(ModelError) as e:
        build_torch_model(spec(source=f"{tiny_model_file}:tiny", weights=str(path)))
    msg = str(e.value)
    assert "wrong.pt do not match the model architecture" in msg
    assert "missing: bn.weight" in msg and "fc.weight" in msg
    assert "unexpected: extra.weight" in msg
    assert "conv.weight (8, 3, 5, 5) vs model (8, 3, 3, 3)" in msg


def test_missing_and_unreadable_weights(tiny_model_file, tmp_path):
    with pytest.raises(ModelError, match="weights file .*absent.pt does not exist"):
        build_torch_model(spec(source=f"{tiny_model_file}:tiny", weights=str(tmp_path / "absent.pt")))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match=r"junk.pt is not a PyTorch checkpoint \(it is a text file"):
        build_torch_model(spec(source=f"{tiny_model_file}:tiny", weights=str(junk)))


def test_wrapped_and_module_prefixed_checkpoints_load(tiny_model_file, tiny_weights, tmp_path):
    state = torch.load(tiny_weights, weights_only=True)
    path = tmp_path / "wrapped.pt"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    model = build_torch_model(spec(source=f"{tiny_model_file}:tiny", weights=str(path)))
    assert torch.equal(model.model.fc.weight, state["fc.weight"])
