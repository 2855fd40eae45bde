"""Grammar token masks: packed allowed-token bitmasks applied to logits rows before sampling.

A mask row is ceil(V_m / 32) int32 words; bit j of word w (least significant first) allows
token 32 * w + j. The router computes one row per sampled position of a constrained request
(services/router/guided_decoding.py) and sends them in `StepPlan.token_masks`; the worker
applies them to the logits rows they describe before the sampler and the verifier see the
logits, so plain sampling, greedy verification and rejection sampling all draw from the
constrained distribution. Tokens beyond the mask's 32 * words (a model vocabulary larger
than the tokenizer's) are disallowed. Disallowed logits become -inf.
Legend: R logits rows, V vocabulary, M mask rows, N masked rows, Wd words per mask row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BITS_PER_WORD = 32


def _bit_values(device: torch.device) -> torch.Tensor:
    """[32] int32: 1 << j for each bit j (bit 31 is the sign bit, -2^31)."""
    values = [1 << j for j in range(BITS_PER_WORD)]
    values[-1] -= 1 << 32
    return torch.tensor(values, dtype=torch.int32).to(device)


def unpack_token_masks(words: torch.Tensor, num_vocab: int) -> torch.Tensor:
    """[N, Wd] int32 packed masks -> [N, V] bool, True where the token is allowed."""
    num_rows, num_words = words.shape
    bits = words.unsqueeze(-1).bitwise_and(_bit_values(words.device)) != 0  # [N, Wd, 32]
    allowed = bits.view(num_rows, num_words * BITS_PER_WORD)  # [N, Wd * 32]
    if allowed.shape[1] >= num_vocab:
        return allowed[:, :num_vocab]
    return torch.cat([allowed, allowed.new_zeros(num_rows, num_vocab - allowed.shape[1])], dim=1)


def apply_token_masks(
    logits: torch.Tensor, masks: torch.Tensor, logit_rows: Sequence[int], mask_rows: Sequence[int]
) -> torch.Tensor:
    """logits [R, V] with row logit_rows[i] restricted by masks[mask_rows[i]] ([M, Wd] int32,
    any device). Returns a new tensor; rows not listed are unchanged."""
    if len(logit_rows) != len(mask_rows):
        raise ValueError(f"{len(logit_rows)} logits rows for {len(mask_rows)} mask rows")
    if not logit_rows:
        return logits
    device = logits.device
    mask_index = torch.tensor(list(mask_rows), dtype=torch.int64)
    words = masks.index_select(0, mask_index.to(masks.device)).to(device, non_blocking=True)  # [N, Wd]
    allowed = unpack_token_masks(words, logits.shape[1])  # [N, V]
    if list(logit_rows) == list(range(logits.shape[0])):  # every row constrained, in order
        return torch.where(allowed, logits, float("-inf"))
    logit_index = torch.tensor(list(logit_rows), dtype=torch.int64).to(device, non_blocking=True)
    out = logits.clone()
    out[logit_index] = torch.where(allowed, logits[logit_index], float("-inf"))  # [N, V]
    return out


def pack_token_masks(allowed: torch.Tensor) -> torch.Tensor:
    """Reference packing (tests, tools): [N, V] bool -> [N, ceil(V / 32)] int32 words."""
    num_rows, num_vocab = allowed.shape
    num_words = -(-num_vocab // BITS_PER_WORD)
    padded = torch.zeros(num_rows, num_words * BITS_PER_WORD, dtype=torch.int64)
    padded[:, :num_vocab] = allowed.to(torch.int64)
    weights = torch.tensor([1 << j for j in range(BITS_PER_WORD)], dtype=torch.int64)  # [32]
    words = (padded.view(num_rows, num_words, BITS_PER_WORD) * weights).sum(dim=-1)  # [N, Wd] in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
