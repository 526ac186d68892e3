"""Small real Keras models for tests/test_keras_source.py, written by a TensorFlow child process (run as a script:
TensorFlow never shares the pytest process with PyTorch). `python keras_models.py OUT_DIR` writes:

- ``convbn.keras`` (Keras 3 format), ``convbn.h5`` (legacy HDF5) and ``convbn_savedmodel/`` (a SavedModel folder) of one
  NHWC model: Conv+BN+ReLU, a DepthwiseConv+BN residual branch, GlobalAveragePooling, Dense (non-trivial BatchNorm
  statistics, so folding them is checked);
- ``two_outputs.keras``: a model with two outputs (model.output must choose);
- ``normalization.keras``: a model with a Keras ``Normalization`` layer (the constants tf2onnx leaves as inputs);
- ``se.keras``: a squeeze-excitation block as keras.applications EfficientNet writes it;
- ``pixels.npy`` (uint8 NHWC) and ``caffe.npy``/``tf.npy``/``torch.npy``: keras.applications' own preprocess_input of
  those pixels in each mode (the presets are checked against them).
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

import numpy as np  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


def convbn() -> keras.Model:
    inp = keras.Input((8, 8, 3), name="pixels")
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem_conv")(inp)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU()(x)
    y = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw_conv")(x)
    y = keras.layers.BatchNormalization(name="dw_bn")(y)
    x = keras.layers.ReLU()(keras.layers.Add(name="residual")([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(3, name="logits")(x)
    model = keras.Model(inp, out)
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(0, 0.1, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n).astype("float32"))
            layer.gamma.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0.2, 0.1, n).astype("float32"))
        if isinstance(layer, keras.layers.Dense):
            layer.bias.assign(rng.normal(0, 0.5, 3).astype("float32"))
    return model


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    keras.utils.set_random_seed(0)
    model = convbn()
    model.save(os.path.join(out, "convbn.keras"))
    model.save(os.path.join(out, "convbn.h5"))
    model.export(os.path.join(out, "convbn_savedmodel"), format="tf_saved_model")

    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inp)
    x = keras.layers.GlobalAveragePooling2D()(x)
    keras.Model(inp, [keras.layers.Dense(3, name="a")(x), keras.layers.Dense(2, name="b")(x)]).save(
        os.path.join(out, "two_outputs.keras"))

    inp = keras.Input((8, 8, 3))
    x = keras.layers.Rescaling(1 / 255)(inp)
    x = keras.layers.Normalization(mean=[0.4, 0.5, 0.6], variance=[0.04, 0.09, 0.16])(x)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="swish")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    keras.Model(inp, keras.layers.Dense(3)(x)).save(os.path.join(out, "normalization.keras"))

    # keras.applications EfficientNet's squeeze-excitation block: GlobalAveragePooling2D → Reshape → Conv2D(swish) →
    # Conv2D(sigmoid) → multiply (tf2onnx writes the pooling as GlobalAveragePool → Squeeze → Reshape in NCHW)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="swish", name="stem")(inp)
    se = keras.layers.GlobalAveragePooling2D(name="se_squeeze")(x)
    se = keras.layers.Reshape((1, 1, 16), name="se_reshape")(se)
    se = keras.layers.Conv2D(4, 1, activation="swish", name="se_reduce")(se)
    se = keras.layers.Conv2D(16, 1, activation="sigmoid", name="se_expand")(se)
    x = keras.layers.multiply([x, se], name="se_excite")
    x = keras.layers.Conv2D(16, 1, name="project")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    keras.Model(inp, keras.layers.Dense(3)(x)).save(os.path.join(out, "se.keras"))

    pixels = np.random.default_rng(1).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    np.save(os.path.join(out, "pixels.npy"), pixels)
    for mode in ("caffe", "tf", "torch"):
        pre = keras.applications.imagenet_utils.preprocess_input(pixels.astype("float32"), mode=mode)
        np.save(os.path.join(out, f"{mode}.npy"), np.asarray(pre))
    print(tf.__version__, keras.__version__)


if __name__ == "__main__":
    main(sys.argv[1])
