"""Quantization-aware training: fine-tune a ModelOpt fake-quantized model (TensorRT placement) from its PTQ ranges.

The model to train is ``modelopt_quantizer.calibrated_model``'s: Conv+BN folded, skip-input residual quantizers,
depthwise inputs equalized, the chosen PTQ method's ranges. Its quantizers stay as calibrated (``ranges: frozen``,
ModelOpt's ``cnn_qat`` recipe); the weights learn through ModelOpt's straight-through fake quantization.

Objectives (``QatConfig.objective``):
- ``supervised``: cross entropy on labels (segmentation: per pixel, ``ignore_index`` left out);
- ``distill``: KL(teacher ‖ student) on temperature-softened logits, per pixel for segmentation, against the
  frozen FP32 model: no labels, any image folder works (NVIDIA's YOLOv7 QAT recipe distils the same way);
- ``both``: cross entropy + ``distill_weight`` · KL.

Determinism and resume. The training set is decoded once into memory (uint8). Epoch e shuffles with a generator
seeded by (seed, e) and augments with another seeded by (seed, e), and the LR is a function of the global step, so
an epoch's result depends only on the state at its start. A checkpoint (model, optimizer, log) is written
atomically after every epoch; ``resume`` restarts from it and reaches what an uninterrupted run reaches.
A non-finite loss stops training at once; the last checkpoint (the last good epoch) is kept.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from qdeploy.config import QatConfig
from qdeploy.errors import QDeployError
from qdeploy.quantize.learned_ranges import PARAM as LEARNED_AMAX
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import atomic_path, write_json
from qdeploy.utils.faults import kill_point
from qdeploy.utils.log import console, log

CHECKPOINT = "qat-checkpoint.pt"
TRAIN_LOG = "qat-log.json"


class QatError(QDeployError):
    """QAT cannot start or continue (bad data, mismatched checkpoint, non-finite loss)."""


@dataclass
class TrainingSet:
    images: np.ndarray             # uint8 (N, C, H, W)
    labels: Optional[np.ndarray]   # int64 (N,) or (N, H, W); None for label-free distillation
    mean: np.ndarray               # (C,) float32, already scaled to 0-255 pixel units
    std: np.ndarray


def _augment(x: torch.Tensor, y: Optional[torch.Tensor], task: str, gen: torch.Generator):
    """Seeded random horizontal flip and a crop of the same size from a 1/8-padded image (reflect for images;
    segmentation labels are padded with ignore by the caller's choice of fill)."""
    n, _, h, w = x.shape
    pixel_labels = get_task(task).pixel_labels  # label maps move with their image
    flip = torch.rand(n, generator=gen) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if y is not None and pixel_labels:
        y = torch.where(flip[:, None, None], y.flip(-1), y)
    ph, pw = max(1, h // 8), max(1, w // 8)
    dy = torch.randint(0, 2 * ph + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pw + 1, (n,), generator=gen)
    xp = F.pad(x, (pw, pw, ph, ph), mode="reflect")
    out = torch.stack([xp[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    if y is not None and pixel_labels:
        yp = F.pad(y, (pw, pw, ph, ph), value=-1)
        y = torch.stack([yp[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    return out, y


def outputs_are_probabilities(out: torch.Tensor) -> bool:
    """Does the model end in a softmax (keras.applications' default ``classifier_activation="softmax"``)? Its
    outputs are then non-negative and sum to 1 over the class axis; logits essentially never do."""
    out = out.detach().float()
    return bool(out.min() >= 0) and bool(((out.sum(1) - 1).abs() <= 1e-3).all())


def output_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Squared error between raw outputs, each output channel (axis 1) divided by the teacher's mean square in the
    batch: a relative error costs the same in box pixels as in [0, 1] scores (a detector's head, ``Task.distillation``
    output-mse). The mean square, not the variance: a channel nearly constant over a batch (a score channel of a
    background-only batch) would otherwise blow its error up (measured: the loss diverged from 149 to 86,350 in two
    epochs on a tiny detector); floored at 1e-4 of the largest channel's."""
    s, t = student.float(), teacher.float()
    dims = [d for d in range(t.dim()) if d != 1]
    scale = t.pow(2).mean(dim=dims, keepdim=True)
    scale = scale.clamp_min(1e-4 * float(scale.max()) + 1e-12)
    return ((s - t) ** 2 / scale).mean()


def objective_loss(cfg: QatConfig, student: torch.Tensor, teacher: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                   ignore_index: int, probabilities: bool = False, distillation: str = "softmax-kl") -> torch.Tensor:
    """The training loss of ``cfg.objective`` (classification (N, K) or segmentation (N, K, H, W) logits).

    ``probabilities``: the model's outputs are softmax probabilities, not logits. Read as logits, their softmax is
    nearly uniform: the distillation loss vanishes (measured 0.0002 on a Keras EfficientNet, no learning) and cross
    entropy is flattened. Their logarithm is a valid set of logits (softmax(log p) = p), so the losses take that."""
    if probabilities and distillation == "softmax-kl":
        student = torch.log(student.float().clamp_min(1e-12))
        teacher = torch.log(teacher.float().clamp_min(1e-12)) if teacher is not None else None
    loss = student.new_zeros(())
    if cfg.objective in ("supervised", "both"):
        loss = loss + F.cross_entropy(student.float(), labels, ignore_index=ignore_index)
    if cfg.objective in ("distill", "both") and distillation == "output-mse":
        loss = loss + (cfg.distill_weight if cfg.objective == "both" else 1.0) * output_mse(student, teacher)
    elif cfg.objective in ("distill", "both"):
        t = cfg.temperature
        log_p = F.log_softmax(student.float() / t, dim=1)
        q = F.softmax(teacher.float() / t, dim=1)
        # KL(q ‖ p) summed over classes, averaged over samples (and pixels); t² keeps gradients comparable across t
        kl = (q * (torch.log(q.clamp_min(1e-12)) - log_p)).sum(1).mean() * t * t
        loss = loss + (cfg.distill_weight if cfg.objective == "both" else 1.0) * kl
    return loss


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class QatTrainer:
    def __init__(self, model: nn.Module, teacher: Optional[nn.Module], cfg: QatConfig, data: TrainingSet, task: str,
                 ignore_index: int, out_dir: Path, run_fingerprint: str, device: str,
                 evaluate: Optional[Callable[[nn.Module], float]] = None, rank: int = 0, world: int = 1):
        self.model, self.teacher, self.cfg, self.data, self.task = model, teacher, cfg, data, task
        self.ignore_index, self.out_dir, self.fp, self.device, self.evaluate = ignore_index, Path(out_dir), run_fingerprint, device, evaluate
        # several processes (torchrun): every rank takes its shard of the same seeded epoch order, as
        # DistributedSampler does; batch_size is per rank; only rank 0 writes files and evaluates
        self.rank, self.world = rank, world
        self.probabilities: Optional[bool] = None  # the model ends in a softmax (outputs_are_probabilities)
        self.net = model
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None)
        self.steps_per_epoch = math.ceil(len(data.images) / (cfg.batch_size * world))
        self.total_steps = max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.warmup = int(round(cfg.warmup_epochs * self.steps_per_epoch))
        self._equalized, self._adam_rescale = _train_equalized_in_original_units(model, cfg.optimizer)
        # learned activation ranges (learned_ranges.py) train without weight decay: decay would only shrink them
        ranges = [p for n, p in model.named_parameters() if n.endswith("." + LEARNED_AMAX) and p.requires_grad]
        ids = {id(p) for p in ranges}
        params = [{"params": [p for p in model.parameters() if p.requires_grad and id(p) not in ids]}]
        if ranges:
            params.append({"params": ranges, "weight_decay": 0.0})
        if cfg.optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        else:
            self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.log: list[dict] = []
        self.mean = torch.tensor(data.mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(data.std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    # -------------------------------------------------------------- checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT

    def _save(self, epochs_done: int, step: int) -> None:
        if self.rank != 0:
            return
        with atomic_path(self.checkpoint_path) as tmp:
            torch.save({"fingerprint": self.fp, "epochs_done": epochs_done, "step": step, "model": self.model.state_dict(),
                        "optimizer": self.opt.state_dict(), "log": self.log, "complete": step >= self.total_steps}, tmp)
        write_json(self.out_dir / TRAIN_LOG, {"fingerprint": self.fp, "epochs": self.log})

    def _load(self) -> tuple[int, int]:
        path = self.checkpoint_path
        if not path.is_file():
            raise QatError(f"--resume: no checkpoint {path} (start without --resume)")
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state.get("fingerprint") != self.fp:
            raise QatError(f"--resume: checkpoint {path} belongs to another model, data or QAT config "
                           f"(fingerprint {state.get('fingerprint')} ≠ this run's {self.fp}); start without --resume or use its config")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.log = state["log"]
        log(f"qat: resumed from {path} after epoch {state['epochs_done']} (step {state['step']})")
        return state["epochs_done"], state["step"]

    # -------------------------------------------------------------- training
    def _batch(self, idx: np.ndarray, gen: torch.Generator):
        x = torch.from_numpy(self.data.images[idx]).float()
        y = torch.from_numpy(self.data.labels[idx]).long() if self.data.labels is not None else None
        if self.cfg.augment:
            x, y = _augment(x, y, self.task, gen)
        if y is not None and get_task(self.task).pixel_labels:
            y = torch.where(y < 0, torch.full_like(y, self.ignore_index), y)
        x = (x.to(self.device) - self.mean) / self.std
        return x, (y.to(self.device) if y is not None else None)

    def _set_train_mode(self, epoch: int) -> None:
        self.model.train()
        # dropout stays off: QAT is a short fine-tune of a trained model, where dropout only adds noise (and, when
        # distilling, a mismatch against the eval-mode teacher); stochastic depth is already an identity in the
        # ModelOpt graph (modelopt_torch.prepare_for_quantization). Measured on EfficientNet-B0: docs/results/
        # issue9_qat_effb0_dropout_on.json vs issue9_qat_effb0_dropout_off.json (docs/qat.md).
        for m in self.model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.eval()
        if self.cfg.freeze_bn_after is not None and epoch >= self.cfg.freeze_bn_after:
            for m in self.model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()

    def fit(self, resume: bool = False) -> list[dict]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        start_epoch, step = self._load() if resume else (0, 0)
        n = len(self.data.images)
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        amp = self.cfg.amp and self.device.startswith("cuda")
        if self.teacher is not None:
            self.teacher.eval().requires_grad_(False)
        with Progress(TextColumn("qat epoch {task.fields[epoch]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("loss {task.fields[loss]:.4f}  lr {task.fields[lr]:.2e}  {task.fields[ips]:.0f} img/s"),
                      TimeRemainingColumn(), console=console, transient=True, disable=self.rank != 0) as bar:
            task = bar.add_task("qat", total=self.total_steps, completed=step, epoch=start_epoch + 1, loss=float("nan"), lr=0.0, ips=0.0)
            for epoch in range(start_epoch, epochs):
                self._set_train_mode(epoch)
                torch.manual_seed(self.cfg.seed * 104_729 + epoch)  # dropout / stochastic depth: the same after a resume
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)).numpy()
                if self.world > 1:  # DistributedSampler: pad to a multiple of the ranks, then every world-th sample
                    order = np.resize(order, self.steps_per_epoch * self.cfg.batch_size * self.world)[self.rank::self.world]
                aug = torch.Generator().manual_seed(self.cfg.seed * 7_919 + epoch + 1)
                t0, seen, losses = time.perf_counter(), 0, []
                for b in range(self.steps_per_epoch):
                    if step >= self.total_steps:
                        break
                    idx = order[b * self.cfg.batch_size:(b + 1) * self.cfg.batch_size]
                    x, y = self._batch(idx, aug)
                    lr = lr_at(step, self.total_steps, self.warmup, self.cfg.lr)
                    for g in self.opt.param_groups:
                        g["lr"] = lr
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                        out = self.net(x)
                        teacher_out = None
                        if self.teacher is not None:
                            with torch.no_grad():
                                teacher_out = self.teacher(x)
                    if self.probabilities is None:  # decided once, on the FP32 teacher's outputs where there is one
                        self.probabilities = outputs_are_probabilities(teacher_out if teacher_out is not None else out)
                        if self.probabilities:
                            log("qat: the model's outputs are probabilities (non-negative, summing to 1 over the classes: "
                                "it ends in a softmax); the losses take their logarithm as logits")
                    loss = objective_loss(self.cfg, out, teacher_out, y, self.ignore_index, self.probabilities,
                                          get_task(self.task).distillation)
                    finite = bool(torch.isfinite(loss))
                    if self.world > 1:  # every rank stops together (one rank's NaN would leave the others in all-reduce)
                        import torch.distributed as dist

                        flag = torch.tensor([0.0 if finite else 1.0], device=loss.device)
                        dist.all_reduce(flag)
                        finite = float(flag) == 0.0
                    if not finite:
                        kept = (f"the last good checkpoint {self.checkpoint_path} (after epoch {epoch}) is kept"
                                if self.checkpoint_path.is_file() else "no epoch had finished, so there is no checkpoint")
                        raise QatError(f"QAT loss became {float(loss)} at step {step + 1} (epoch {epoch + 1}, batch {b + 1}); "
                                       f"training stopped, {kept}. Try a lower qat.lr or qat.grad_clip")
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if self.cfg.grad_clip:
                        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                    optimizer_step(self.opt, self._adam_rescale)
                    step += 1
                    seen += len(idx) * self.world
                    losses.append(float(loss.detach()))
                    ips = seen / max(time.perf_counter() - t0, 1e-9)
                    bar.update(task, advance=1, epoch=epoch + 1, loss=losses[-1], lr=lr, ips=ips)
                seconds = time.perf_counter() - t0
                entry = {"epoch": epoch + 1, "steps": step, "images": seen, "loss": float(np.mean(losses)) if losses else None,
                         "lr_end": lr_at(step - 1, self.total_steps, self.warmup, self.cfg.lr), "seconds": round(seconds, 3),
                         "images_per_s": round(seen / max(seconds, 1e-9), 1)}
                if self.evaluate is not None and self.rank == 0:
                    entry["metric"] = self.evaluate(self.model)
                self.log.append(entry)
                self._save(epoch + 1, step)
                kill_point("qat-epoch")
                log(f"qat: epoch {epoch + 1}/{epochs}: loss {entry['loss']:.4f}, {entry['images_per_s']:.0f} img/s"
                    + (f", metric {entry['metric']:.4f}" if "metric" in entry else ""))
        self.model.eval()
        for handle in self._equalized:
            handle.remove()
        self._equalized = []
        return self.log


def optimizer_step(opt: torch.optim.Optimizer, rescale: list) -> None:
    """``opt.step()``; with AdamW, each equalized depthwise weight then keeps 1/g of its step (see below)."""
    before = [w.detach().clone() for w, _ in rescale]
    opt.step()
    with torch.no_grad():
        for (w, inv_g), old in zip(rescale, before):
            w.copy_(old + (w - old) * inv_g)


def finished_checkpoint(folder: Path, fingerprint: str) -> Optional[dict]:
    """The checkpoint in ``folder`` when it holds the *finished* training ``fingerprint``, else None."""
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state if state.get("fingerprint") == fingerprint and state.get("complete") else None


def _train_equalized_in_original_units(model: nn.Module, optimizer: str = "sgd") -> tuple[list, list]:
    """Depthwise convs equalized for PTQ (input ·g, weights /g; quantize/equalize.py) train as before equalization.

    The rewrite is exact in the forward pass but not for the optimizer: the gradient of W' = W/g is g times that of W.
    - SGD: a step then moves the function g² times further, and g reaches 256 (65,536x the learning rate on those
      channels; on EfficientNet-B0 QAT lost accuracy instead of gaining). A gradient hook divides W''s gradient by
      g², which makes SGD's step on W' exactly the step on W (momentum and weight decay included: the decay of W' is
      proportional).
    - AdamW: Adam's step m/√v ignores a constant gradient scale, so W' moves what W would, i.e. W moves g times
      too far. The step on W' is divided by g after each optimizer step instead (exact for Adam's moments; the
      decoupled weight decay part, lr·wd·W', is then 1/g too small, negligible at QAT's lr·wd of ~1e-8).
    (A torch parametrization W = W_original / g would be cleaner, but ModelOpt's quantized conv then skips its
    weight quantizer.) Returns (gradient hook handles, [(weight, 1/g view)] to rescale after Adam's steps)."""
    handles, rescale = [], []
    for m in model.modules():
        q = getattr(m, "input_quantizer", None)
        g = getattr(q, "pre_quant_scale", None) if q is not None else None
        w = getattr(m, "weight", None)
        if g is None or not isinstance(w, nn.Parameter):
            continue
        inv_g = 1.0 / g.detach().reshape(-1, *([1] * (w.dim() - 1))).to(w.device, w.dtype)
        if optimizer == "adamw":
            rescale.append((w, inv_g))
        else:
            handles.append(w.register_hook(lambda grad, s=inv_g ** 2: grad * s))
    return handles, rescale
