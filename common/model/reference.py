"""The single-process reference model: the attention side plus a routed-experts function.

The layer loop keeps the MoE call an explicit seam (`experts_fn`), exactly the place where the
attention worker dispatches to expert workers; an in-process holder's per-slot outputs go to ffn_post
unsummed (`moe.routed_answer`: their slot sum runs inside hc_post).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.common.model.moe import ExpertsFn, routed_answer
from moemesh.common.model.state import DEFAULT_MAX_ROLLBACK_TOKENS, SequenceState


class ReferenceModel:
    def __init__(self, attention_side: AttentionSide, experts_fn: ExpertsFn) -> None:
        self.side = attention_side
        self.experts_fn = experts_fn
        self.config = attention_side.config

    def new_sequence(self, max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS) -> SequenceState:
        device = self.side.head.weight.device
        return SequenceState(self.config, max_rollback_tokens=max_rollback_tokens, dtype=self.side.dtype,
                             device=device)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, chunks: Sequence[SequenceChunk],
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T] (sequences concatenated in `chunks` order) -> logits [T, V] (or [B, V] for
        logits_indices [B]). Advances every chunk's SequenceState by its new tokens."""
        side = self.side
        batch = ForwardBatch(list(chunks), token_ids.device)
        if batch.num_tokens != token_ids.shape[0]:
            raise ValueError(f"{token_ids.shape[0]} token ids for {batch.num_tokens} new tokens in chunks")
        h = side.embed_tokens(token_ids, batch)  # [T, N, D]; the forward's RoPE tables
        for layer in range(self.config.num_hidden_layers):
            h = side.attn_block(layer, h, batch)
            x, post, comb = side.ffn_pre(layer, h)
            ids, weights = side.gate(layer, x, token_ids)
            shared = side.shared_expert(layer, x)
            routed = routed_answer(self.experts_fn, layer, x, ids, weights)  # the MoE seam: [T, K, D] or [T, D]
            h = side.ffn_post(layer, routed, h, post, comb, shared=shared)
        batch.finish()
        return side.logits(h, logits_indices)

    def forward_sequence(self, token_ids: torch.Tensor, state: SequenceState | None = None) -> torch.Tensor:
        """One sequence, all new tokens in one chunk -> logits [S, V]."""
        state = state if state is not None else self.new_sequence()
        return self.forward(token_ids, [SequenceChunk(state, token_ids.shape[0])])
