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
from moemesh.tools.train.unit_windows import UnitWindows

LOG_EVERY_STEPS = 25
CALIBRATION_STEPS = 12
EXPORT_RESERVE_S = 25.0  # export + evaluation of the exported files + card (~6 s on an H200)


def autocast(settings: TrainSettings, device: torch.device):
    if settings.precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fit_steps(fixed: int | None, steps_done: int, step_times: list[float], deadline: float) -> int | None:
    """None while calibrating; then the total step count that ends by `deadline`."""
    if fixed is not None:
        return fixed
    if steps_done < CALIBRATION_STEPS:
        return None
    per_step = float(np.median(step_times[2:]))
    return steps_done + max(0, int((deadline - time.monotonic()) / per_step))


class Throughput:
    """Step timing without a host sync per step: the first CALIBRATION_STEPS steps are timed one by one
    (synchronised; they fix the step count), after that the device is synchronised only at log steps
    and the interval is divided by its step count. Loss and token count are summed on the device."""

    def __init__(self, device) -> None:
        self.device = device
        self.step_times: list[float] = []
        self.calibration_start = self.interval_start = time.monotonic()
        self.interval_steps = 0
        self.loss_sum = torch.zeros((), device=device)
        self.token_sum = torch.zeros((), device=device)
        self.tokens_total = 0  # window tokens (B·S per step), known on the host

    def step_started(self, step: int) -> None:
        if step < CALIBRATION_STEPS:
            _sync(self.device)
            self.calibration_start = time.monotonic()

    def step_done(self, step: int, loss: torch.Tensor, num_tokens: torch.Tensor, window_tokens: int) -> None:
        self.loss_sum += loss.detach().float()
        self.token_sum += num_tokens.detach().float()
        self.tokens_total += window_tokens
        self.interval_steps += 1
        if step <= CALIBRATION_STEPS:
            _sync(self.device)
            self.step_times.append(time.monotonic() - self.calibration_start)

    def read(self, window_tokens: int) -> dict:
        """Synchronise; figures of the steps since the last read (mean loss, s/step, tok/s)."""
        _sync(self.device)
        now = time.monotonic()
        steps = max(1, self.interval_steps)
        seconds = now - self.interval_start
        out = {"loss": round(float(self.loss_sum) / steps, 4), "step_s": round(seconds / steps, 4),
               "tokens_per_s": round(window_tokens * steps / max(seconds, 1e-9)),
               "target_tokens_per_s": round(float(self.token_sum) / max(seconds, 1e-9))}
        self.loss_sum.zero_()
        self.token_sum.zero_()
        self.interval_start, self.interval_steps = now, 0
        return out


def _maybe_compile(fn, settings: TrainSettings, device, log, name: str):
    """torch.compile(fn) on CUDA when settings.compile; the eager fn if compiling fails at the first call."""
    if not settings.compile or device.type != "cuda":
        return fn
    compiled = torch.compile(fn, dynamic=False)
    state = {"fn": None}

    def call(*args):
        if state["fn"] is not None:
            return state["fn"](*args)
        started = time.monotonic()
        try:
            out = compiled(*args)
            state["fn"] = compiled
            log(f"{name}.compiled", seconds=round(time.monotonic() - started, 1))
        except Exception as error:  # noqa: BLE001 (any compile failure: train eagerly instead)
            log(f"{name}.compile_failed", error=f"{type(error).__name__}: {str(error)[:500]}")
            state["fn"] = fn
            out = fn(*args)
        return out

    return call


def _shadow(settings: TrainSettings, config: ModelConfig, named: dict):
    from moemesh.tools.train.quant_shadow import QuantShadow

    return QuantShadow.for_modules(config, named) if settings.qat else None


def _quantized(shadow):
    return shadow.quantized() if shadow is not None else contextlib.nullcontext()


def train_target(config: ModelConfig, settings: TrainSettings, data, device, log, deadline: float,
                 init_from=None):
    from moemesh.tools.train.quant_shadow import stacked_expert_names

    target = TrainableTarget(config, settings.seed, device)
    if init_from is not None:
        from moemesh.tools.train.resume import load_target

        load_target(target, init_from)
    params = [p for p in target.parameters() if p.requires_grad]
    shadow = _shadow(settings, config, {**dict(target.side.named_parameters()),
                                         **stacked_expert_names(lambda layer: f"layers.{layer}.", target.experts)})
    log("target.model", num_params=sum(p.numel() for p in target.parameters()),
        num_trainable=sum(p.numel() for p in params), init_from=str(init_from) if init_from else None,
        qat_params=shadow.num_params if shadow else 0)
    optimizer = torch.optim.AdamW(params, lr=settings.target_lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay,
                                  **({"fused": True} if device.type == "cuda" else {}))
    train = UnitWindows(data["train"], settings.seq_len, settings.batch_size, settings.seed, device)
    target_deadline = time.monotonic() + settings.target_time_share * (deadline - time.monotonic())
    total_steps = settings.target_steps
    window_tokens = settings.batch_size * train.seq_len

    def loss_fn(ids, mask):
        with autocast(settings, device):
            h, _ = target.forward_streams(ids, batched=settings.batched_attention)
            logits = target.logits_from_streams(h).view(ids.shape[0], ids.shape[1], -1)
        return masked_cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                    mask[:, 1:].reshape(-1))

    step_loss = _maybe_compile(loss_fn, settings, device, log, "target")
    meter = Throughput(device)
    curve = []
    step = 0
    started_all = time.monotonic()
    while total_steps is None or step < total_steps:
        meter.step_started(step)
        lr = cosine_lr(step, total_steps or 10**9, settings.target_warmup_steps, settings.target_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask = train.next_batch()
        with _quantized(shadow):
            loss, num_tokens = step_loss(ids, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        counts = target.experts.reset_counts()
        balance_router_biases(target.gates, counts, settings.bias_update_rate)
        step += 1
        meter.step_done(step, loss, num_tokens, window_tokens)
        if total_steps is None:
            total_steps = _fit_steps(None, step, meter.step_times, target_deadline)
            if total_steps is not None:
                log("target.steps_fixed", total_steps=total_steps, median_step_s=float(np.median(meter.step_times[2:])))
        if step % settings.log_every_steps == 0 or step == 1 or step == total_steps:
            load = [round(float(c.max() / c.mean().clamp_min(1e-9)), 3) for c in counts]
            figures = meter.read(window_tokens)
            curve.append({"step": step, "loss": figures["loss"]})
            log("target.step", step=step, lr=lr, grad_norm=round(float(grad_norm), 3), epochs=round(
                train.passes(step * settings.batch_size), 3), **figures, max_over_mean_expert_load=load)
    seconds = time.monotonic() - started_all
    if shadow is not None:
        shadow.project()  # the weights evaluated and exported are the quantised ones
    target.eval()
    for param in target.parameters():
        param.requires_grad_(False)

    def logits_fn(ids):
        with autocast(settings, device):
            h, _ = target.forward_streams(ids, batched=settings.batched_attention)
            return target.logits_from_streams(h).view(ids.shape[0], ids.shape[1], -1)

    val = validation_loss(logits_fn, *data["validation"], settings.eval_batch_size, device)
    log("target.validation", weights="quantised (as exported)" if shadow else "float (before export)", **val)
    tokens = step * window_tokens
    summary = {"steps": total_steps, "seconds": round(seconds, 1), "tokens": tokens,
               "tokens_per_s": round(tokens / max(seconds, 1e-9)),
               "passes": round(train.passes(step * settings.batch_size), 3)}
    log("target.done", **summary)
    return target, {**summary, "final_train_loss": curve[-1]["loss"] if curve else None, "validation_float": val,
                    "median_step_s": float(np.median(meter.step_times)) if meter.step_times else None,
                    "loss_curve": curve, "init_from": str(init_from) if init_from else None}


def train_drafter(config: ModelConfig, settings: TrainSettings, target: TrainableTarget, data, device, log,
                  deadline: float, init_from=None):
    from moemesh.tools.train.quant_shadow import stacked_expert_names

    trainable = TrainableDrafter(config, target, settings.seed + 1, device)
    resumed = False
    if init_from is not None:
        from moemesh.tools.train.resume import has_drafter, load_drafter

        if has_drafter(init_from):
            load_drafter(trainable, init_from)
            resumed = True
    params = [p for p in trainable.parameters() if p.requires_grad]
    shadow = _shadow(settings, config, {**{name: p for name, p in trainable.drafter.named_parameters()
                                           if p.requires_grad},
                                        **stacked_expert_names(lambda stage: f"mtp.{stage}.", trainable.experts)})
    log("drafter.model", num_params=sum(p.numel() for p in trainable.parameters()), resumed=resumed,
        qat_params=shadow.num_params if shadow else 0)
    optimizer = torch.optim.AdamW(params, lr=settings.drafter_lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay,
                                  **({"fused": True} if device.type == "cuda" else {}))
    train = UnitWindows(data["train"], settings.seq_len, settings.batch_size, settings.seed + 2, device)
    anchor_generator = torch.Generator().manual_seed(settings.seed + 3)
    drafter_deadline = deadline - EXPORT_RESERVE_S
    block_size = config.dspark.block_size
    total_steps = settings.drafter_steps
    window_tokens = settings.batch_size * train.seq_len

    def loss_fn(ids, mask, anchors):
        with autocast(settings, device):
            features, teacher = teacher_outputs(target, ids, settings.batched_attention)
            return drafter_loss(trainable, ids, mask, features, teacher, anchors)

    step_terms = _maybe_compile(loss_fn, settings, device, log, "drafter")
    meter = Throughput(device)
    term_sums: dict[str, torch.Tensor] = {}
    step = 0
    started_all = time.monotonic()
    while total_steps is None or step < total_steps:
        meter.step_started(step)
        lr = cosine_lr(step, total_steps or 10**9, settings.drafter_warmup_steps, settings.drafter_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask = train.next_batch()
        anchors = sample_anchors(ids.shape[0], ids.shape[1], block_size, settings.anchors_per_sequence,
                                 anchor_generator).to(device, non_blocking=True)
        with _quantized(shadow):
            terms = step_terms(ids, mask, anchors)
            optimizer.zero_grad(set_to_none=True)
            terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        counts = trainable.experts.reset_counts()
        balance_router_biases(trainable.gates, counts, settings.bias_update_rate)
        step += 1
        for key, value in terms.items():
            term_sums[key] = term_sums.get(key, 0.0) + value.detach().float()
        meter.step_done(step, terms["loss"], torch.zeros((), device=device), window_tokens)
        if total_steps is None:
            total_steps = _fit_steps(None, step, meter.step_times, drafter_deadline)
            if total_steps is not None:
                log("drafter.steps_fixed", total_steps=total_steps, median_step_s=float(np.median(meter.step_times[2:])))
        if step % settings.log_every_steps == 0 or step == 1 or step == total_steps:
            steps_in = max(1, meter.interval_steps)
            figures = meter.read(window_tokens)
            means = {k: round(float(v) / steps_in, 4) for k, v in term_sums.items()}
            term_sums = {}
            log("drafter.step", step=step, lr=lr, step_s=figures["step_s"], tokens_per_s=figures["tokens_per_s"], **means)
    seconds = time.monotonic() - started_all
    if shadow is not None:
        shadow.project()
    trainable.eval()
    acceptance = _validation_acceptance(trainable, target, settings, data, device)
    log("drafter.validation_acceptance", weights="quantised (as exported)" if shadow else "float (before export)",
        **acceptance)
    return trainable, {"steps": total_steps, "seconds": round(seconds, 1), "resumed": resumed,
                       "final_terms": {k: float(v.detach()) for k, v in terms.items()},
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
