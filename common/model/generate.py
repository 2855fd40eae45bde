"""Greedy / temperature generation with the reference model: prefill, then decode step by step.

All prompts run together: each step is one forward with one chunk per unfinished sequence
(the whole prompt on the first step, one token afterwards), so this also exercises batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.reference import ReferenceModel


@dataclass(frozen=True)
class GenerationConfig:
    """max_new_tokens per prompt; temperature 0 = greedy; seed makes sampling reproducible;
    generation of a prompt stops after a token in stop_token_ids (which is kept in the output)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """logits [B, V] -> one token id per row."""
    if temperature == 0.0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).tolist()


@torch.inference_mode()
def generate_batch(model: ReferenceModel, prompts: Sequence[Sequence[int]], config: GenerationConfig
                   ) -> list[list[int]]:
    """Token ids generated for each prompt (prompt not included)."""
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    device = model.side.head.weight.device
    generator = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    states = [model.new_sequence() for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    pending: list[list[int]] = [list(prompt) for prompt in prompts]  # tokens to feed next step
    active = list(range(len(prompts)))
    while active:
        chunks = [SequenceChunk(states[i], len(pending[i])) for i in active]
        token_ids = torch.tensor([t for i in active for t in pending[i]], dtype=torch.long, device=device)
        last = (torch.tensor([len(pending[i]) for i in active]).cumsum(0) - 1).to(device)  # [B]
        picks = _pick(model.forward(token_ids, chunks, logits_indices=last), config.temperature, generator)
        still_active = []
        for i, token in zip(active, picks):
            outputs[i].append(token)
            pending[i] = [token]
            if len(outputs[i]) < config.max_new_tokens and token not in config.stop_token_ids:
                still_active.append(i)
        active = still_active
    return outputs


def generate(model: ReferenceModel, prompt: Sequence[int], config: GenerationConfig) -> list[int]:
    return generate_batch(model, [prompt], config)[0]
