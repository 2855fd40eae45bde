"""The two training loops (target, then drafter), seeded, with step counts fixed up front or
fitted to the time budget after timing the first steps.
Legend: B windows per batch, S tokens per window, V vocab.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from moemesh.common.model.config import ModelConfig
from moemesh.tools.train.drafter import TrainableDrafter, drafter_loss, greedy_acceptance, sample_anchors, teacher_outputs
from moemesh.tools.train.evaluate import validation_loss
from moemesh.tools.train.settings import TrainSettings
from moemesh.tools.train.target import TrainableTarget, balance_router_biases, cosine_lr, masked_cross_entropy

LOG_EVERY_STEPS = 25
CALIBRATION_STEPS = 12
EXPORT_RESERVE_S = 25.0  # export + evaluation of the exported files + card (~6 s on an H200)


def autocast(settings: TrainSettings, device: torch.device):
    if settings.precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class WindowSampler:
    """Seeded epochs over the training windows: a fresh permutation per epoch."""

    def __init__(self, num_windows: int, batch_size: int, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.num_windows = num_windows
        self.batch_size = batch_size
        self.order: list[int] = []

    def next_batch(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.num_windows, generator=self.generator).tolist()
        batch, self.order = self.order[: self.batch_size], self.order[self.batch_size:]
        return batch


def _batch(data, indices, device):
    ids, mask = data
    return (torch.from_numpy(ids[indices].astype(np.int64)).to(device),
            torch.from_numpy(mask[indices].astype(np.float32)).to(device))


def _fit_steps(fixed: int | None, steps_done: int, step_times: list[float], deadline: float) -> int | None:
    """None while calibrating; then the total step count that ends by `deadline`."""
    if fixed is not None:
        return fixed
    if steps_done < CALIBRATION_STEPS:
        return None
    per_step = float(np.median(step_times[2:]))
    return steps_done + max(0, int((deadline - time.monotonic()) / per_step))


def train_target(config: ModelConfig, settings: TrainSettings, data, device, log, deadline: float):
    target = TrainableTarget(config, settings.seed, device)
    params = [p for p in target.parameters() if p.requires_grad]
    log("target.model", num_params=sum(p.numel() for p in target.parameters()),
        num_trainable=sum(p.numel() for p in params))
    optimizer = torch.optim.AdamW(params, lr=settings.target_lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    sampler = WindowSampler(data["train"][0].shape[0], settings.batch_size, settings.seed)
    target_deadline = time.monotonic() + settings.target_time_share * (deadline - time.monotonic())
    total_steps = settings.target_steps
    step_times: list[float] = []
    step = 0
    while total_steps is None or step < total_steps:
        started = time.monotonic()
        lr = cosine_lr(step, total_steps or 10**9, settings.target_warmup_steps, settings.target_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask = _batch(data["train"], sampler.next_batch(), device)
        with autocast(settings, device):
            h, _ = target.forward_streams(ids, batched=settings.batched_attention)
            logits = target.logits_from_streams(h).view(ids.shape[0], ids.shape[1], -1)
        loss, num_tokens = masked_cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                mask[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        counts = target.experts.reset_counts()
        balance_router_biases(target.gates, counts, settings.bias_update_rate)
        step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.monotonic() - started)
        if total_steps is None:
            total_steps = _fit_steps(None, step, step_times, target_deadline)
            if total_steps is not None:
                log("target.steps_fixed", total_steps=total_steps, median_step_s=float(np.median(step_times[2:])))
        if step % LOG_EVERY_STEPS == 0 or step == 1 or step == total_steps:
            load = [round(float(c.max() / c.mean().clamp_min(1e-9)), 3) for c in counts]
            log("target.step", step=step, loss=round(float(loss.detach()), 4), lr=lr, grad_norm=round(float(grad_norm), 3),
                tokens=int(num_tokens), step_s=round(step_times[-1], 3), max_over_mean_expert_load=load)
    target.eval()
    for param in target.parameters():
        param.requires_grad_(False)

    def logits_fn(ids):
        with autocast(settings, device):
            h, _ = target.forward_streams(ids, batched=settings.batched_attention)
            return target.logits_from_streams(h).view(ids.shape[0], ids.shape[1], -1)

    val = validation_loss(logits_fn, *data["validation"], settings.eval_batch_size, device)
    log("target.validation", weights="float (before export)", **val)
    return target, {"steps": total_steps, "final_train_loss": float(loss.detach()), "validation_float": val,
                    "median_step_s": float(np.median(step_times)) if step_times else None}


def train_drafter(config: ModelConfig, settings: TrainSettings, target: TrainableTarget, data, device, log,
                  deadline: float):
    trainable = TrainableDrafter(config, target, settings.seed + 1, device)
    params = [p for p in trainable.parameters() if p.requires_grad]
    log("drafter.model", num_params=sum(p.numel() for p in trainable.parameters()))
    optimizer = torch.optim.AdamW(params, lr=settings.drafter_lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    sampler = WindowSampler(data["train"][0].shape[0], settings.batch_size, settings.seed + 2)
    anchor_generator = torch.Generator().manual_seed(settings.seed + 3)
    drafter_deadline = deadline - EXPORT_RESERVE_S
    block_size = config.dspark.block_size
    total_steps = settings.drafter_steps
    step_times: list[float] = []
    step = 0
    while total_steps is None or step < total_steps:
        started = time.monotonic()
        lr = cosine_lr(step, total_steps or 10**9, settings.drafter_warmup_steps, settings.drafter_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask = _batch(data["train"], sampler.next_batch(), device)
        anchors = sample_anchors(ids.shape[0], ids.shape[1], block_size, settings.anchors_per_sequence, anchor_generator)
        with autocast(settings, device):
            features, teacher = teacher_outputs(target, ids, settings.batched_attention)
            terms = drafter_loss(trainable, ids, mask, features, teacher, anchors)
        optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        counts = trainable.experts.reset_counts()
        balance_router_biases(trainable.gates, counts, settings.bias_update_rate)
        step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.monotonic() - started)
        if total_steps is None:
            total_steps = _fit_steps(None, step, step_times, drafter_deadline)
            if total_steps is not None:
                log("drafter.steps_fixed", total_steps=total_steps, median_step_s=float(np.median(step_times[2:])))
        if step % LOG_EVERY_STEPS == 0 or step == 1 or step == total_steps:
            log("drafter.step", step=step, lr=lr, step_s=round(step_times[-1], 3),
                **{k: round(float(v.detach()), 4) for k, v in terms.items()})
    trainable.eval()
    acceptance = _validation_acceptance(trainable, target, settings, data, device)
    log("drafter.validation_acceptance", weights="float (before export)", **acceptance)
    return trainable, {"steps": total_steps, "final_terms": {k: float(v.detach()) for k, v in terms.items()},
                       "validation_acceptance": acceptance}


@torch.no_grad()
def _validation_acceptance(trainable, target, settings, data, device) -> dict:
    ids_all, _ = data["validation"]
    generator = torch.Generator().manual_seed(settings.seed + 4)
    totals: dict[str, float] = {}
    num_blocks = 0
    for start in range(0, ids_all.shape[0], settings.eval_batch_size):
        ids = torch.from_numpy(ids_all[start:start + settings.eval_batch_size].astype(np.int64)).to(device)
        anchors = sample_anchors(ids.shape[0], ids.shape[1], trainable.drafter.dspark.block_size,
                                 settings.anchors_per_sequence, generator)
        with autocast(settings, device):
            features, teacher = teacher_outputs(target, ids, settings.batched_attention)
            part = greedy_acceptance(trainable, ids, features, teacher, anchors)
        n = part.pop("num_blocks")
        for key, value in part.items():
            totals[key] = totals.get(key, 0.0) + value * n
        num_blocks += n
    return {**{k: v / max(1, num_blocks) for k, v in totals.items()}, "num_blocks": num_blocks}
