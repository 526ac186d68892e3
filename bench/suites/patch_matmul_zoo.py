"""The patch-matmul rewrite (facts/patch_matmul.py) on other implementations of the same layer: timm, torchvision and
Hugging Face transformers' ViTs, Swins, ConvNeXts, EVA-02, CLIP's and DINOv2's vision towers. For each: which
convolutions the rule takes, the rewritten model's output against the model's (FP32, CPU, random weights, zero-initialised
weights such as torchvision's ViT head drawn again so the output is not zero), and the same for the rewritten model
exported with a dynamic batch as the torch engine exports it (``export_dynamic_batch``) at another batch size. A model
whose library is not installed is skipped with the reason. JSON lines to --json:

    python bench/suites/patch_matmul_zoo.py --json docs/results/patch_matmul_zoo.jsonl
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def _timm(name):
    import timm

    return lambda: timm.create_model(name, pretrained=False, num_classes=10)


def _torchvision(name):
    import torchvision

    return lambda: torchvision.models.get_model(name, num_classes=10)


class _HF(torch.nn.Module):
    """A transformers vision model as an image → tensor module (its logits, else its pooled output)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(pixel_values=x)
        return out.logits if hasattr(out, "logits") else out.pooler_output


def _hf(kind):
    def make():
        import transformers as t

        small = dict(image_size=224, hidden_size=192, num_hidden_layers=2, num_attention_heads=3)
        if kind == "vit":
            return _HF(t.ViTForImageClassification(t.ViTConfig(**small, intermediate_size=384, num_labels=10)))
        if kind == "clip":
            return _HF(t.CLIPVisionModel(t.CLIPVisionConfig(**small, intermediate_size=384, patch_size=32)))
        return _HF(t.Dinov2Model(t.Dinov2Config(**small, patch_size=14)))
    return make


MODELS = {
    "timm vit_tiny_patch16_224": _timm("vit_tiny_patch16_224"),
    "timm deit_tiny_distilled_patch16_224": _timm("deit_tiny_distilled_patch16_224"),
    "timm swin_tiny_patch4_window7_224": _timm("swin_tiny_patch4_window7_224"),
    "timm convnext_atto": _timm("convnext_atto"),
    "timm eva02_tiny_patch14_224": _timm("eva02_tiny_patch14_224"),
    "torchvision vit_b_16": _torchvision("vit_b_16"),
    "torchvision swin_t": _torchvision("swin_t"),
    "torchvision convnext_tiny": _torchvision("convnext_tiny"),
    "transformers ViT (2 layers)": _hf("vit"),
    "transformers CLIP vision (2 layers, patch 32)": _hf("clip"),
    "transformers DINOv2 (2 layers, patch 14)": _hf("dinov2"),
}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def row(name: str, make) -> dict:
    from qdeploy.artifacts.torch_program import ProgramSettings, export_dynamic_batch
    from qdeploy.facts.patch_matmul import rewrite_patch_convolutions

    torch.manual_seed(0)
    try:
        model = make().eval()
    except ImportError as e:
        return {"model": name, "skipped": f"not installed: {e}"}
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and not p.any():
                p.normal_(0, 0.02)
    rewritten = copy.deepcopy(model)
    names = rewrite_patch_convolutions(rewritten)
    x2, x3 = torch.randn(2, 3, 224, 224), torch.randn(3, 3, 224, 224)
    program = export_dynamic_batch(rewritten, ProgramSettings(device="cpu", precision="fp32", input_shape=(3, 224, 224)))
    with torch.no_grad():
        eager = _rel(rewritten(x2), model(x2))
        exported = _rel(program.module()(x3), model(x3))
    return {"model": name, "rewritten": names, "rel_err": eager, "exported_rel_err": exported,
            "ok": bool(names) and eager < 1e-4 and exported < 1e-4, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    rows = [row(name, make) for name, make in MODELS.items()]
    with args.json.open("w") as f:
        for r in rows:
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")
    bad = [r["model"] for r in rows if r.get("ok") is False]
    if bad:
        raise SystemExit(f"patch_matmul_zoo.py: the rewrite changed the output or found nothing in {bad}")


if __name__ == "__main__":
    main()
