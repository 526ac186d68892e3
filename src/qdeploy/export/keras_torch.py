"""Keras model → ONNX, second route: Keras 3 under the torch backend is a torch module, and torch.onnx exports it.

Taken only where tf2onnx cannot (:mod:`qdeploy.export.keras` calls it): its ONNX fails the checker or ONNX Runtime's
load, or its outputs do not match Keras'. Keras 3 compiles grouped convolutions (ConvNeXt's depthwise convs) with XLA
on CPU under TensorFlow; tf2onnx leaves that nested function as an unconverted ``StatefulPartitionedCall``.

- **Backend per process:** Keras chooses its backend once, at import, so this runs as a child process
  (``python -m qdeploy.export.keras_torch``) with ``KERAS_BACKEND=torch`` and no GPU visible: it loads the
  ``.keras`` / ``.h5`` file with ``keras.saving.load_model`` (the same weights, now torch parameters).
- **Layout as the first route gives it:** the ONNX input is NCHW. A module permutes NCHW → NHWC before calling the
  Keras model; the permute cancels the one Keras' torch convolution puts before the first conv, and ONNX Runtime's
  basic optimizations (as in the first route) cancel and fold the rest they can. A Keras conv adds its bias after
  permuting its output back to NHWC: that Add is folded into the Conv (exact), so the conv looks as a PyTorch export's.
- **Exporters:** torch.onnx with ``dynamo=False`` (TorchScript) first, then ``dynamo=True``, as qdeploy exports PyTorch
  models; a file is kept only if it passes the checker, loads in ONNX Runtime and matches the Keras (torch) model on a
  batch of another size than the traced one (a batch size baked into a reshape is caught here). The parent then checks
  it against the Keras (TensorFlow) outputs on the run's real images, as for the first route.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

from qdeploy.export.keras import KERAS_EXTRA, _first_line, _layout, _ort_basic, _Refused, _select

EXPORTERS = ("torchscript", "dynamo")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # the dynamo exporter colours its messages


def _fold_conv_bias(proto) -> int:
    """Conv → Transpose(0,2,3,1) → Add(per-channel constant) becomes Conv(with that bias) → Transpose: exact.
    Returns how many Adds were folded."""
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    consumers: dict[str, list] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in proto.graph.output}
    producer = {o: n for n in proto.graph.node for o in n.output}
    dead, folded = [], 0
    for add in proto.graph.node:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for k in (0, 1):
            t, b = producer.get(add.input[k]), add.input[1 - k]
            if t is None or t.op_type != "Transpose" or b not in inits:
                continue
            perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
            conv = producer.get(t.input[0])
            if perm != [0, 2, 3, 1] or conv is None or conv.op_type != "Conv":
                continue
            if len(consumers.get(conv.output[0], [])) != 1 or len(consumers.get(t.output[0], [])) != 1 \
                    or conv.output[0] in graph_outputs or t.output[0] in graph_outputs:
                continue
            w = inits.get(conv.input[1])
            bias = numpy_helper.to_array(inits[b])
            if w is None or bias.dtype != np.float32 or bias.size != w.dims[0] \
                    or any(d != 1 for d in bias.shape[:-1]) or (bias.ndim and bias.shape[-1] != w.dims[0]):
                continue
            bias = bias.reshape(-1)
            if len(conv.input) > 2 and conv.input[2]:
                if conv.input[2] not in inits:
                    continue
                bias = bias + numpy_helper.to_array(inits[conv.input[2]]).reshape(-1)
            name = f"{conv.name or conv.output[0]}.folded_bias"
            proto.graph.initializer.append(numpy_helper.from_array(bias.astype(np.float32), name))
            inits[name] = proto.graph.initializer[-1]
            del conv.input[2:]
            conv.input.append(name)
            t.output[0] = add.output[0]  # the Transpose now writes what the Add wrote
            producer[add.output[0]] = t
            dead.append(add)
            folded += 1
            break
    for n in dead:
        proto.graph.node.remove(n)
    used = {i for n in proto.graph.node for i in n.input}
    for t in [t for t in proto.graph.initializer if t.name not in used]:
        proto.graph.initializer.remove(t)
    return folded


def _wrap(model, layout: str, key, names: list):
    import torch

    class NCHW(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            if layout == "NHWC":
                x = x.permute(0, 2, 3, 1)
            return _select(self.m(x, training=False), key, names)

    return NCHW(model).eval()


def _export_one(name: str, module, x, path: Path, opset: int, dynamic_batch: bool) -> None:
    import torch

    buf = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf), torch.no_grad():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        if name == "torchscript":
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=opset, input_names=["input"],
                              output_names=["output"], do_constant_folding=True,
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}} if dynamic_batch else None)
        else:
            dims = ({0: torch.export.Dim("batch", min=1, max=4096)},) if dynamic_batch else None
            program = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset, input_names=["input"],
                                        output_names=["output"], dynamic_shapes=dims, verbose=False)
            program.save(str(path), external_data=False)


def _export(req: dict) -> dict:
    import keras
    import onnx
    import onnxruntime as ort
    import torch

    if keras.config.backend() != "torch":
        raise _Refused(f"Keras runs on the {keras.config.backend()} backend in this process; this route needs torch")
    source = Path(req["source"])
    if source.is_dir():
        raise _Refused("a SavedModel folder is a TensorFlow graph, which Keras under the torch backend cannot load "
                       "(give the .keras or .h5 file)")
    try:
        model = keras.saving.load_model(str(source), compile=False)
    except Exception as e:
        raise _Refused(f"Keras under the torch backend cannot load it ({_first_line(e)})") from None
    if len(model.inputs) != 1:
        raise _Refused(f"the model takes {len(model.inputs)} inputs; qdeploy feeds one image input")
    shape = tuple(model.inputs[0].shape)
    layout = _layout(shape, req["channels"], tuple(req["size"]))
    names = [getattr(t, "name", str(i)) for i, t in enumerate(model.outputs)]
    module = _wrap(model, layout, req["output"], names)
    h, w = req["size"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, req["channels"], h, w, generator=gen)
    check = torch.randn(3 if req.get("dynamic_batch", True) else 2, req["channels"], h, w, generator=gen)
    with torch.no_grad():
        ref = np.asarray(module(check).detach().cpu().numpy(), dtype=np.float32)
    errors = []
    for name in EXPORTERS:
        with tempfile.TemporaryDirectory(prefix="qdeploy-keras-torch-") as tmp:
            raw = Path(tmp) / "raw.onnx"
            try:
                _export_one(name, module, x, raw, req["opset"], req.get("dynamic_batch", True))
                proto = onnx.load(str(raw))
                onnx.checker.check_model(proto)
                proto, notes = _ort_basic(proto)
                folded = _fold_conv_bias(proto)
                if folded:  # the folded Adds free Transposes that ONNX Runtime can now push through or cancel
                    proto, _ = _ort_basic(proto)
                    notes.append(f"{folded} conv bias Add(s) after the NHWC transpose folded into the Conv")
                onnx.checker.check_model(proto)
                onnx.save(proto, req["onnx"])
                opts = ort.SessionOptions()
                opts.log_severity_level = 3
                sess = ort.InferenceSession(req["onnx"], opts, providers=["CPUExecutionProvider"])
                got = sess.run(None, {sess.get_inputs()[0].name: check.numpy()})[0]
                diff = float(np.max(np.abs(got - ref))) if got.shape == ref.shape else None
                if diff is None or not np.isfinite(diff) or diff > 1e-4 + 1e-3 * float(np.max(np.abs(ref))):
                    raise ValueError(f"ONNX Runtime differs from the Keras (torch) model on a batch of {len(check)}: "
                                     + (f"output shape {got.shape} vs {ref.shape}" if diff is None else f"max |diff| {diff:.3g}"))
            except Exception as e:
                errors.append(f"{name}: {_COLOUR.sub('', _first_line(e))}")
                continue
        return {"input_name": proto.graph.input[0].name, "output_name": proto.graph.output[0].name,
                "opset": next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), req["opset"]),
                "layout": layout, "input_shape": [None if d is None else int(d) for d in shape], "exporter": name,
                "tried": errors, "repairs": notes, "versions": {"keras": keras.__version__, "torch": torch.__version__}}
    raise _Refused("torch.onnx cannot export it (" + "; ".join(errors) + ")")


def _child_main(request_file: str) -> int:
    req = json.loads(Path(request_file).read_text())
    try:
        answer = _export(req)
    except _Refused as e:
        answer = {"error": str(e)}
    except ImportError as e:
        answer = {"error": f"{_first_line(e)} ({KERAS_EXTRA})"}
    Path(req["answer"]).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
