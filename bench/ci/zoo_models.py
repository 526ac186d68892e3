"""Model factories for bench/ci/zoo.py that qdeploy's own sources (torchvision:NAME, timm:NAME, a .keras file) do not cover:
Hugging Face transformers image classifiers built from small configs, with random weights.

Used as ``model.source: bench/ci/zoo_models.py:hf_classifier`` with ``model.kwargs: {arch: vit, image_size: 32}``.
The wrapper returns the logits tensor (transformers returns an ImageClassifierOutput)."""
from __future__ import annotations

import torch
from torch import nn

# arch -> (config class, model class, small config kwargs); image_size/num_labels are filled in by hf_classifier.
_TINY_BLOCK = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
HF_ARCHS = {
    "vit": ("ViTConfig", "ViTForImageClassification", {**_TINY_BLOCK, "patch_size": 8}),
    "deit": ("DeiTConfig", "DeiTForImageClassification", {**_TINY_BLOCK, "patch_size": 8}),
    "beit": ("BeitConfig", "BeitForImageClassification", {**_TINY_BLOCK, "patch_size": 8, "use_mean_pooling": True,
                                                          "use_relative_position_bias": True}),
    "swin": ("SwinConfig", "SwinForImageClassification", {"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2],
                                                          "window_size": 4, "patch_size": 2}),
    "swinv2": ("Swinv2Config", "Swinv2ForImageClassification", {"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2],
                                                                "window_size": 4, "patch_size": 2}),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", {"hidden_sizes": [16, 32, 32, 64],
                                                                      "depths": [1, 1, 1, 1]}),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2ForImageClassification", {"hidden_sizes": [16, 32, 32, 64],
                                                                            "depths": [1, 1, 1, 1]}),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", {}),
    "levit": ("LevitConfig", "LevitForImageClassificationWithTeacher", {}),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", {"embedding_size": 16, "hidden_sizes": [16, 32, 64, 64],
                                                                "depths": [1, 1, 1, 1]}),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", {}),
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification", {"width_coefficient": 0.25,
                                                                                  "depth_coefficient": 0.25,
                                                                                  "hidden_dim": 320}),  # 1280 x 0.25
    "poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification", {"hidden_sizes": [16, 32, 64, 64],
                                                                           "depths": [1, 1, 1, 1]}),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", {**_TINY_BLOCK, "patch_size": 8}),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2ForImageClassification", {"depth_multiplier": 0.35}),
}


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def hf_classifier(arch: str, image_size: int = 32, num_labels: int = 3) -> nn.Module:
    import transformers

    cfg_name, model_name, extra = HF_ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(image_size=image_size, num_labels=num_labels, **extra)
    torch.manual_seed(0)
    return Logits(getattr(transformers, model_name)(cfg)).eval()
