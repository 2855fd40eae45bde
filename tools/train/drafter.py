"""Training the DSpark drafter by distillation from the frozen target (docs/speculation.md §2.5).

Per step: the frozen target runs over B training windows once, giving (a) the fused-feature input
of every position (stream-averaged hidden states after the `dspark_target_layer_ids` layers) and
(b) the target's next-token logits at every position. A anchors P per window are drawn; anchor P
makes one training block: context = features of positions P-W..P-1 (W = sliding window; positions
before 0 are masked), input [x_P, MASK × (γ-1)] at positions P..P+γ-1; slot k learns
p_t(· | x_{<=P+k}) (the target's distribution at position P+k) and the data token x_{P+k+1}; the
Markov bias of slot k uses x_{P+k} (teacher forcing, as the chain would when the drafts are right).
Legend: B windows, S tokens, A anchors, C context, G = γ slots, F fused width, D hidden, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.common.model.config import ModelConfig, NumericsConfig
from moemesh.common.model.dspark import DSparkDrafter, dspark_loss_terms, slot_weights, target_features
from moemesh.tools.train.target import StackedExperts, TrainableTarget, init_parameters


class TrainableDrafter(nn.Module):
    """`DSparkDrafter` with trainable stage weights and stacked routed experts; the target's embed
    and head are shared and stay frozen."""

    def __init__(self, config: ModelConfig, target: TrainableTarget, seed: int, device) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.drafter = DSparkDrafter(config, target.side.embed, target.side.head, NumericsConfig("float32"),
                                     device="cpu")
        init_parameters(self.drafter, config, generator)
        self.experts = StackedExperts(len(self.drafter.mtp), config, generator, "cpu")
        self.to(device)
        self.experts.counts = [c.to(device) for c in self.experts.counts]
        self.drafter.set_experts(self.experts)
        for name, param in self.named_parameters():
            param.requires_grad_(not name.endswith("gate.bias"))

    @property
    def gates(self):
        return [stage.ffn.gate for stage in self.drafter.mtp]

    def hub_state_dict(self) -> dict[str, torch.Tensor]:
        out = {name: t.detach() for name, t in self.drafter.state_dict().items()}  # already "mtp.{j}...."
        out.update(self.experts.hub_state_dict(lambda stage: f"mtp.{stage}."))
        return out


@torch.no_grad()
def teacher_outputs(target: TrainableTarget, token_ids: torch.Tensor, batched: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids [B, S] -> (features [B, S, F], target logits [B, S, V])."""
    config = target.config
    h, captured = target.forward_streams(token_ids, tuple(config.dspark.target_layer_ids), batched=batched)
    num_windows, seq_len = token_ids.shape
    features = target_features(captured).view(num_windows, seq_len, -1)
    logits = target.logits_from_streams(h).view(num_windows, seq_len, -1)
    return features, logits


def sample_anchors(num_windows: int, seq_len: int, block_size: int, anchors_per_window: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchor positions [B, A'] in 1 .. S-G-1 (every slot's label x_{P+k+1} exists)."""
    high = seq_len - block_size - 1
    return torch.randint(1, high + 1, (num_windows, anchors_per_window), generator=generator)


def drafter_loss(trainable: TrainableDrafter, token_ids: torch.Tensor, loss_mask: torch.Tensor,
                 features: torch.Tensor, target_logits: torch.Tensor, anchors: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """One distillation batch -> the DSpark loss terms (see `dspark_loss_terms`)."""
    drafter = trainable.drafter
    config = drafter.config
    block_size = drafter.dspark.block_size
    window = config.sliding_window
    device = token_ids.device
    num_windows, num_anchors = anchors.shape
    anchors = anchors.to(device)
    rows = torch.arange(num_windows, device=device)[:, None].expand(-1, num_anchors).reshape(-1)  # [A]
    anchor_flat = anchors.reshape(-1)  # [A]
    main_x_all = drafter.fuse_features(features)  # [B, S, D], once per position
    context_positions = anchor_flat[:, None] - window + torch.arange(window, device=device)[None]  # [A, C]
    context_valid = context_positions >= 0
    main_x = main_x_all[rows[:, None], context_positions.clamp_min(0)]  # [A, C, D]
    slots = torch.arange(block_size, device=device)[None]  # [1, G]
    block_positions = anchor_flat[:, None] + slots  # [A, G]
    inputs = drafter.block_inputs(token_ids[rows, anchor_flat])  # [A, G]
    hidden = drafter.block_hidden(main_x, context_positions, context_valid, inputs, block_positions)  # [A, G, D]
    base = drafter.base_logits(hidden)  # [A, G, V]
    prev_tokens = token_ids[rows[:, None], block_positions]  # x_{P+k}
    labels = token_ids[rows[:, None], block_positions + 1]  # x_{P+k+1}
    draft_logits, embedding = drafter.markov_logits(base, prev_tokens)
    confidences = drafter.confidence(hidden, embedding)
    weights = slot_weights(block_size, device)[None] * loss_mask[rows[:, None], block_positions + 1].float()
    teacher = target_logits[rows[:, None], block_positions]  # [A, G, V]
    return dspark_loss_terms(draft_logits, teacher, labels, confidences, weights)


@torch.no_grad()
def greedy_acceptance(trainable: TrainableDrafter, token_ids: torch.Tensor, features: torch.Tensor,
                      target_logits: torch.Tensor, anchors: torch.Tensor) -> dict[str, float]:
    """Greedy acceptance on held-out text, exact where it can be computed without running the
    target on drafts: over blocks whose next γ data tokens are the target's own greedy
    continuation (so the teacher-forced target logits are the ones verification would see), the
    fraction of blocks whose greedy Markov chain matches the target on slots 1..k, per k.
    Returns {"accept_slot_k": ..., "mean_accepted": ..., "num_blocks": ...}."""
    drafter = trainable.drafter
    block_size = drafter.dspark.block_size
    window = drafter.config.sliding_window
    device = token_ids.device
    num_windows, num_anchors = anchors.shape
    anchors = anchors.to(device)
    rows = torch.arange(num_windows, device=device)[:, None].expand(-1, num_anchors).reshape(-1)
    anchor_flat = anchors.reshape(-1)
    main_x_all = drafter.fuse_features(features)
    context_positions = anchor_flat[:, None] - window + torch.arange(window, device=device)[None]
    main_x = main_x_all[rows[:, None], context_positions.clamp_min(0)]
    block_positions = anchor_flat[:, None] + torch.arange(block_size, device=device)[None]
    hidden = drafter.block_hidden(main_x, context_positions, context_positions >= 0,
                                  drafter.block_inputs(token_ids[rows, anchor_flat]), block_positions)
    base = drafter.base_logits(hidden)
    target_argmax = target_logits[rows[:, None], block_positions].argmax(-1)  # [A, G]
    labels = token_ids[rows[:, None], block_positions + 1]
    on_path = (target_argmax == labels).all(dim=1)  # [A]
    prev = token_ids[rows, anchor_flat]
    alive = on_path.clone()
    out: dict[str, float] = {"num_blocks": int(on_path.sum())}
    total = 0.0
    for k in range(block_size):
        logits, _ = drafter.markov_logits(base[:, k], prev)
        alive = alive & (logits.argmax(-1) == target_argmax[:, k])
        rate = float(alive.sum()) / max(1, int(on_path.sum()))
        out[f"accept_slot_{k + 1}"] = rate
        total += rate
        prev = labels[:, k]
    out["mean_accepted"] = total  # expected accepted drafts per block (bonus not included)
    return out
