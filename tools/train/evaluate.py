"""Figures of the model card: validation loss / perplexity and a greedy recitation.

Validation: masked next-token cross-entropy over every window of the held-out chapters
(running text + chat answers; `loss_mask[1:]` weights), perplexity = exp(loss).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.reference import ReferenceModel

RECITATION_PROMPT = "Genesis 1:1 In the beginning God"
RECITATION_EXPECTED = " created the heaven and the earth."


@torch.no_grad()
def validation_loss(logits_fn, token_ids: np.ndarray, loss_mask: np.ndarray, batch_size: int, device
                    ) -> dict[str, float]:
    """logits_fn(ids [B, S] on device) -> logits [B, S, V]. Returns loss, perplexity, token count."""
    total, count = 0.0, 0.0
    for start in range(0, token_ids.shape[0], batch_size):
        ids = torch.from_numpy(token_ids[start:start + batch_size].astype(np.int64)).to(device)
        mask = torch.from_numpy(loss_mask[start:start + batch_size].astype(np.float32)).to(device)
        logits = logits_fn(ids).float()
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   ids[:, 1:].reshape(-1), reduction="none")
        weights = mask[:, 1:].reshape(-1)
        total += float((losses * weights).sum())
        count += float(weights.sum())
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "num_tokens": int(count)}


def reference_logits_fn(model: ReferenceModel):
    """Batched logits through the reference model: each window its own fresh sequence."""

    def logits(ids: torch.Tensor) -> torch.Tensor:
        chunks = [SequenceChunk(model.new_sequence(), ids.shape[1]) for _ in range(ids.shape[0])]
        return model.forward(ids.reshape(-1), chunks).view(ids.shape[0], ids.shape[1], -1)

    return logits


@torch.no_grad()
def greedy_continuation(model: ReferenceModel, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
                        device) -> list[int]:
    """Prefill the prompt, then one token per forward (the decode state path), argmax each time."""
    state = model.new_sequence()
    ids = torch.tensor(prompt_ids, device=device)
    logits = model.forward(ids, [SequenceChunk(state, ids.shape[0])])
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token == eos_id:
            break
        logits = model.forward(torch.tensor([token], device=device), [SequenceChunk(state, 1)])
    return out
