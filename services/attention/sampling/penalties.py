"""Presence, frequency and repetition penalties, and the token histories they read.

Semantics (applied to raw logits, before temperature; repetition first, then the other two,
the order vLLM uses):
- repetition penalty r (HF / vLLM): for every token that appears in the prompt or in the
  generated output, logit / r if logit > 0, else logit * r. r = 1 is a no-op.
- frequency f and presence a (OpenAI): logit - f * count - a * (count > 0), where count is how
  often the token appears among the *generated* tokens only (never the prompt).

Legend: P rows that have penalties, V vocabulary, W draft slots, W1 = W + 1 verified slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenHistory:
    """What the penalties need to know about the tokens of P rows.

    output_counts [P, V] float32: occurrences of each token among generated tokens.
    seen_mask [P, V] bool: the token occurs in the prompt or among generated tokens.
    Rows are aligned with SamplingBatch.penalty_rows.
    """

    output_counts: torch.Tensor
    seen_mask: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.output_counts.shape[0]


def _scatter_ids(
    token_ids: Sequence[Sequence[int]], num_vocab: int, device: torch.device
) -> torch.Tensor:
    """Counts of each id per row, [P, V] float32, built from ragged lists without padding."""
    row_ids = [row for row, ids in enumerate(token_ids) for _ in ids]
    flat_ids = [token for ids in token_ids for token in ids]
    counts = torch.zeros(len(token_ids), num_vocab, dtype=torch.float32, device=device)
    if flat_ids:
        rows = torch.tensor(row_ids, dtype=torch.int64).to(device, non_blocking=True)
        cols = torch.tensor(flat_ids, dtype=torch.int64).to(device, non_blocking=True)
        counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
    return counts


def build_token_history(
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    num_vocab: int,
    device: torch.device | str,
) -> TokenHistory:
    """History of P rows from their prompt and generated ids (lists, one per row)."""
    if len(prompt_token_ids) != len(output_token_ids):
        raise ValueError(
            f"{len(prompt_token_ids)} prompts but {len(output_token_ids)} outputs"
        )
    device = torch.device(device)
    output_counts = _scatter_ids(output_token_ids, num_vocab, device)
    prompt_counts = _scatter_ids(prompt_token_ids, num_vocab, device)
    return TokenHistory(output_counts, (output_counts > 0) | (prompt_counts > 0))


def extend_with_drafts(history: TokenHistory, draft_token_ids: torch.Tensor) -> TokenHistory:
    """Per-slot histories for verification: slot j sees the row's history plus drafts 0..j-1.

    history: P rows; draft_token_ids [P, W] int64. Returns a history of P * W1 rows ordered
    row-major (row p, slot j -> p * W1 + j), matching a [P, W1, V] tensor flattened. Slot j's
    history assumes drafts before j were accepted, which is the only case in which slot j's
    distribution is used. Built with one scatter into a padding column (no host sync).
    """
    num_rows, num_vocab = history.output_counts.shape
    num_slots = draft_token_ids.shape[1] + 1  # W1
    device = draft_token_ids.device
    slot = torch.arange(num_slots, device=device).view(1, num_slots, 1)  # [1, W1, 1]
    draft_slot = torch.arange(num_slots - 1, device=device).view(1, 1, num_slots - 1)  # [1, 1, W]
    # [P, W1, W]: draft i counts at slot j iff i < j; the others land in padding column V
    cols = torch.where(
        draft_slot < slot,
        draft_token_ids.view(num_rows, 1, num_slots - 1).expand(num_rows, num_slots, num_slots - 1),
        num_vocab,
    )
    added = torch.zeros(num_rows, num_slots, num_vocab + 1, dtype=torch.float32, device=device)
    added.scatter_add_(2, cols, torch.ones_like(cols, dtype=torch.float32))
    added = added[:, :, :num_vocab]  # [P, W1, V]
    counts = history.output_counts.unsqueeze(1) + added  # [P, W1, V]
    seen = history.seen_mask.unsqueeze(1) | (added > 0)
    return TokenHistory(
        counts.reshape(num_rows * num_slots, num_vocab),
        seen.reshape(num_rows * num_slots, num_vocab),
    )


def apply_penalties(
    logits: torch.Tensor,
    history: TokenHistory,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of logits [P, V] float32; the penalty tensors are [P]."""
    repetition = repetition_penalties.unsqueeze(1)  # [P, 1]
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.where(history.seen_mask, scaled, logits)
    counts = history.output_counts
    penalised = penalised - frequency_penalties.unsqueeze(1) * counts
    return penalised - presence_penalties.unsqueeze(1) * (counts > 0).float()
