"""The demo's model: a small CNN for 16x16 grayscale digits (importable as ``qdeploy.demo.model:digits_cnn``)."""
from torch import nn


def digits_cnn(num_classes: int = 10, width: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),  # 8x8
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),  # 4x4
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(2 * width * 16, num_classes),
    )
