"""Probabilistic drafting with a sparse, exactly transmitted proposal distribution.

Lossless rejection sampling (services/attention/sampling/verify.py) needs, at every draft slot,
the exact distribution q the draft was drawn from. The drafter's Markov-corrected softmax has
a full vocabulary (129,280 floats per slot on V4-Flash): too large for the control plane, which
the torch-free router relays. So the drafter draws from a sparse q instead: the
`max_support` most probable tokens of softmax((U_k + W1[x_{k-1}] W2) / T), renormalised, and
exactly zero elsewhere. Any q keeps rejection sampling lossless as long as the verifier uses the
same q; the truncation only lowers acceptance by the tail mass it drops. q travels as
(token ids, float32 probabilities) per slot, and a float32 survives msgpack's float64 exactly,
so the verifier rebuilds the very tensor the draft was sampled from (`dense_distribution`).

The random draw is `sample_from_probs` on the dense q with the stream
(seed, Purpose.DRAFT, output position), as in `DSparkDrafter.sampled_chain`: with max_support
None (no truncation) this chain draws exactly the tokens `sampled_chain` draws.
Legend: G slots, V vocab, S support size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.model.dspark import DSparkDrafter
from services.attention.sampling.draw import sample_from_probs
from services.attention.sampling.rng import Purpose, stream


@dataclass(frozen=True)
class SparseDraftChain:
    """token_ids [G] int64; probs [G] q(token) fp32; confidences [G]; support_ids / support_probs:
    per slot the S_k tokens with q > 0 and their q (fp32, summing to 1 up to rounding)."""

    token_ids: torch.Tensor
    probs: torch.Tensor
    confidences: torch.Tensor
    support_ids: tuple[torch.Tensor, ...]
    support_probs: tuple[torch.Tensor, ...]


def truncated_distribution(logits: torch.Tensor, temperature: float, max_support: int | None) -> torch.Tensor:
    """logits [V] -> dense q [V] fp32: softmax(logits / T), kept on its max_support largest
    entries and renormalised (None: the full softmax, untouched)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if max_support is None or max_support >= probs.shape[-1]:
        return probs
    top_probs, top_ids = torch.topk(probs, max_support)
    dense = torch.zeros_like(probs)
    dense[top_ids] = top_probs / top_probs.sum()
    return dense


def dense_distribution(support_ids: Sequence[int], support_probs: Sequence[float], vocab_size: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The verifier's side: one slot's sparse q (as sent in DraftProposal) -> dense [V] fp32."""
    dense = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    dense[torch.tensor(list(support_ids), dtype=torch.long, device=device)] = torch.tensor(
        list(support_probs), dtype=torch.float32, device=device)
    return dense


@torch.no_grad()
def sparse_sampled_chain(drafter: DSparkDrafter, base_logits: torch.Tensor, hidden: torch.Tensor,
                         seed_token_id: int, *, temperature: float, seed: int, output_positions: Sequence[int],
                         max_support: int | None) -> SparseDraftChain:
    """Left to right over the G slots: q_k from the Markov-corrected logits given x_{k-1}
    (x_0 = seed token), x_k ~ q_k from stream (seed, DRAFT, output_positions[k]),
    c_k = confidence(h_k, W1[x_{k-1}]). base_logits [G, V], hidden [G, D] (pre-norm)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy requests use greedy_chain)")
    num_slots = base_logits.shape[0]
    if len(output_positions) != num_slots:
        raise ValueError(f"{len(output_positions)} output positions for {num_slots} slots")
    device = base_logits.device
    token_ids = torch.empty(num_slots, dtype=torch.long, device=device)
    chosen_probs = torch.empty(num_slots, dtype=torch.float32, device=device)
    confidences = torch.empty(num_slots, dtype=torch.float32, device=device)
    support_ids, support_probs = [], []
    prev = torch.tensor(seed_token_id, device=device)
    for k in range(num_slots):
        logits, embedding = drafter.markov_logits(base_logits[k], prev)  # [V], [r]
        q = truncated_distribution(logits, temperature, max_support)  # [V]
        confidences[k] = drafter.confidence(hidden[k], embedding)
        generator = stream(seed, Purpose.DRAFT, int(output_positions[k]), device)
        token = int(sample_from_probs(q[None], [generator])[0])
        token_ids[k] = token
        chosen_probs[k] = q[token]
        ids = torch.nonzero(q, as_tuple=True)[0]  # [S]
        support_ids.append(ids)
        support_probs.append(q[ids])
        prev = torch.tensor(token, device=device)
    return SparseDraftChain(token_ids, chosen_probs, confidences, tuple(support_ids), tuple(support_probs))
