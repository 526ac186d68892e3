"""Issue #24's two Keras models, trained on ../shared/data/cifar10/train (20,000 images) with the Keras 3 torch backend.

The weights are not kept in the repository: this script recreates them (on a GPU: a few minutes each; the device run
is bench/keras_cifar_call.sh, data packed by bench/keras_cifar_stage.sh).

    KERAS_BACKEND=torch python bench/keras_cifar.py train resnet20 --packed cifar_train.npz --out DIR --minutes 4.5
    KERAS_BACKEND=torch python bench/keras_cifar.py train efficientnet_b0 --packed cifar_train.npz --out DIR --minutes 8

- ``resnet20_cifar.keras``: ResNet-20 for CIFAR (He et al. 2016; 3x3 conv 16 → BN → ReLU, 3 stages x 3 BasicBlocks
  of 16/32/64 filters, stride 2 at stages 2 and 3 with a 1x1 conv + BN projection shortcut, global average pooling,
  Dense(10) logits). Input: 32x32 RGB, keras.applications' "caffe" preprocessing outside the model (qdeploy preset
  keras-caffe). SGD (momentum 0.9, Nesterov) lr 0.1, L2 1e-4, batch 128.
- ``efficientnet_b0_64.keras``: ``keras.applications.EfficientNetB0(weights=None, input_shape=(64, 64, 3),
  classes=10)`` (softmax output, its own rescaling inside: 0..255 pixels, qdeploy preset keras-none). Images resized
  32 → 64 with PIL bilinear, exactly as qdeploy's data pipeline does. AdamW lr 1e-3, weight decay 1e-4, label
  smoothing 0.1, batch 128.

Both: random crop (padding 1/8 of the side) + horizontal flip; a cosine learning-rate schedule over the wall-clock
budget (``--minutes``) after a 3 % warm-up, so the schedule ends when time does; float32 (TF32 convolutions on the GPU).
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time

import numpy as np
from PIL import Image

CAFFE_MEAN_BGR = np.array([103.939, 116.779, 123.68], np.float32)


def caffe(x_rgb_uint8: np.ndarray) -> np.ndarray:
    """keras.applications.imagenet_utils.preprocess_input(mode="caffe") on NHWC RGB 0..255."""
    return x_rgb_uint8[..., ::-1].astype(np.float32) - CAFFE_MEAN_BGR


def decode_packed(path: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    d = np.load(path)
    data, offs = d["data"].tobytes(), d["offsets"]
    imgs = []
    for i in range(len(offs) - 1):
        img = Image.open(io.BytesIO(data[offs[i]:offs[i + 1]])).convert("RGB")
        if size != 32:
            img = img.resize((size, size), Image.BILINEAR)
        imgs.append(np.asarray(img, np.uint8))
    return np.stack(imgs), d["labels"]


def resnet20(keras):
    L = keras.layers
    reg = keras.regularizers.l2(1e-4)

    def conv(x, filters, k, stride, name):
        return L.Conv2D(filters, k, strides=stride, padding="same", use_bias=False, kernel_initializer="he_normal",
                        kernel_regularizer=reg, name=name)(x)

    inp = keras.Input((32, 32, 3), name="image")
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(conv(inp, 16, 3, 1, "stem_conv")))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            p = f"s{stage + 1}b{block + 1}"
            y = L.ReLU(name=f"{p}_relu1")(L.BatchNormalization(name=f"{p}_bn1")(conv(x, filters, 3, stride, f"{p}_conv1")))
            y = L.BatchNormalization(name=f"{p}_bn2")(conv(y, filters, 3, 1, f"{p}_conv2"))
            if stride != 1 or x.shape[-1] != filters:
                x = L.BatchNormalization(name=f"{p}_proj_bn")(conv(x, filters, 1, stride, f"{p}_proj"))
            x = L.ReLU(name=f"{p}_relu2")(L.Add(name=f"{p}_add")([x, y]))
    x = L.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inp, L.Dense(10, kernel_regularizer=reg, name="logits")(x), name="resnet20_cifar")


def augment(x: np.ndarray, rng, pad: int) -> np.ndarray:
    n, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    out = np.empty_like(x)
    dy, dx = rng.integers(0, 2 * pad + 1, n), rng.integers(0, 2 * pad + 1, n)
    flip = rng.random(n) < 0.5
    for i in range(n):
        crop = padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop[:, ::-1] if flip[i] else crop
    return out


def train(args) -> None:
    import keras

    print(f"keras {keras.__version__} backend {keras.config.backend()}", flush=True)
    keras.utils.set_random_seed(0)
    size = 64 if args.model == "efficientnet_b0" else 32
    t0 = time.time()
    X, Y = decode_packed(args.packed, size)
    print(f"decoded {len(X)} images at {size}x{size} in {time.time() - t0:.1f} s", flush=True)
    if args.model == "resnet20":
        model, prep, batch, pad = resnet20(keras), caffe, args.batch or 128, 4
        opt = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
        loss, onehot, lr0 = keras.losses.SparseCategoricalCrossentropy(from_logits=True), False, 0.1
        name = "resnet20_cifar.keras"
    else:
        model = keras.applications.EfficientNetB0(weights=None, input_shape=(64, 64, 3), classes=10)
        # Keras' torch backend spends ~160 ms per EfficientNet step whatever the batch (per-op overhead): large batches
        prep, batch, pad = (lambda a: a.astype(np.float32)), args.batch or 128, 8
        # 3e-3 with weight decay 0.05 reached 37 % train accuracy in 17 epochs (2026-11-25): 1e-3, decay 1e-4 now
        opt = keras.optimizers.AdamW(args.lr or 1e-3, weight_decay=1e-4)
        loss, onehot, lr0 = keras.losses.CategoricalCrossentropy(label_smoothing=0.1), True, args.lr or 1e-3
        name = "efficientnet_b0_64.keras"
    model.compile(optimizer=opt, loss=loss, metrics=["accuracy"], jit_compile=False)
    budget = args.minutes * 60
    rng = np.random.default_rng(0)
    steps = len(X) // batch
    start = time.time()
    epoch, log = 0, []
    while True:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        order = rng.permutation(len(X))
        losses, accs = [], []
        for s in range(steps):
            frac = (time.time() - start) / budget
            if frac >= 1:
                break
            lr = lr0 * (frac / 0.03 if frac < 0.03 else 0.5 * (1 + math.cos(math.pi * (frac - 0.03) / 0.97)))
            opt.learning_rate.assign(lr)
            idx = order[s * batch:(s + 1) * batch]
            xb = prep(augment(X[idx], rng, pad))
            yb = np.eye(10, dtype=np.float32)[Y[idx]] if onehot else Y[idx]
            out = model.train_on_batch(xb, yb, return_dict=True)
            losses.append(float(out["loss"]))
            accs.append(float(out["accuracy"]))
        epoch += 1
        log.append({"epoch": epoch, "loss": float(np.mean(losses)), "train_acc": float(np.mean(accs)),
                    "elapsed_s": round(time.time() - start, 1), "lr": float(lr)})
        print(json.dumps(log[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    # saved without the optimizer's state (a compiled model's .keras file carries it: 3x the size of the weights)
    bare = resnet20(keras) if args.model == "resnet20" else \
        keras.applications.EfficientNetB0(weights=None, input_shape=(64, 64, 3), classes=10)
    bare.set_weights(model.get_weights())
    bare.save(os.path.join(args.out, name))
    with open(os.path.join(args.out, name.replace(".keras", ".train.json")), "w") as f:
        json.dump({"model": args.model, "epochs": epoch, "seconds": round(time.time() - start, 1), "log": log,
                   "keras": keras.__version__, "backend": keras.config.backend()}, f, indent=1)
    print(f"saved {name} after {epoch} epochs", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("model", choices=["resnet20", "efficientnet_b0"])
    t.add_argument("--packed", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--minutes", type=float, default=4.5)
    t.add_argument("--batch", type=int, default=None)
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (EfficientNet: AdamW, default 1e-3)")
    args = ap.parse_args()
    train(args)


if __name__ == "__main__":
    sys.exit(main())
