"""A sampled draft slot's sparse proposal and its draw in two launches (the drafter's CUDA graphs).

What it computes is `chains.sparse_slot_draw` (the torch reference, the CPU and eager path): per row, the
support_k largest Markov-corrected logits ranked by `chains.support_keys` (the logit's order-preserving
integer, the lower token id first among equal logits, so the set is unique), their ids ascending,
q = softmax over those logits / T, and the exponential race argmax q / E against the slot's Exp(1) draws.
In torch that is a top-k over the vocabulary, a sort, gathers, a softmax, a division and an argmax per slot;
on an H200 the single-row top-k alone took about 47 µs of a 12,288-token vocabulary, five times a draft.

Design (no host read: capturable):
- `_chunk_candidates` (grid [R, P]): each program keys one chunk of CHUNK logits of a row (the int64 key
  `ordered(logit) · 2³² + (2³² - 1 - id)`, unique per token), sorts it descending in registers and stores
  its first K keys: every token of the row's top K is among its chunk's top K;
- `_select_and_draw` (grid [R]): sorts the row's P · K candidate keys descending, keeps the first K, sorts
  their ids ascending, reads their logits, divides by T, softmax, race; stores ids [R, K], q [R, K], the
  drawn token [R] and its q [R].
CHUNK is chosen so that P · K stays at most MAX_CANDIDATES (1,024 at the default model's 12,288 tokens and
K = 64, 2,048 at V4-Flash's 129,280).

Numerics: ids equal the reference's bit for bit (the same keys); q from the same fp32 logits differs from
torch's softmax by the exp and sum order only (tested within 1e-5 relative), so the drawn token equals the
reference's except where two q / E are that close. Legend: R rows, V vocab, K support, P chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CANDIDATES = 2048
_MIN_CHUNK = 256


@triton.jit
def _support_key(logits, ids):
    """fp32 logits, int64 ids -> int64 keys ordered as (logit descending, id ascending) when sorted descending."""
    bits = logits.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of the floats
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - ids)


@triton.jit
def _chunk_candidates(logits_ptr, keys_ptr, num_vocab, num_chunks,
                      CHUNK: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offsets = tl.arange(0, CHUNK)
    ids = chunk * CHUNK + offsets  # [CHUNK]
    inside = ids < num_vocab
    logits = tl.load(logits_ptr + row.to(tl.int64) * num_vocab + ids, mask=inside, other=0.0)
    keys = tl.where(inside, _support_key(logits, ids.to(tl.int64)), -9223372036854775807 - 1)
    keys = tl.sort(keys, descending=True)
    out = keys_ptr + (row.to(tl.int64) * num_chunks + chunk) * K
    tl.store(out + offsets, keys, mask=offsets < K)


@triton.jit
def _select_and_draw(keys_ptr, logits_ptr, divisors_ptr, noise_ptr, ids_out, probs_out, drawn_out, drawn_q_out,
                     num_vocab, num_candidates, K: tl.constexpr, CANDIDATES: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, CANDIDATES)
    keys = tl.load(keys_ptr + row.to(tl.int64) * num_candidates + offsets, mask=offsets < num_candidates,
                   other=-9223372036854775807 - 1)
    keys = tl.sort(keys, descending=True)  # the row's top K first
    kept = offsets < K
    ids = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    ids = tl.sort(tl.where(kept, ids, 9223372036854775807))  # the K ids ascending, then the rest
    logits = tl.load(logits_ptr + row.to(tl.int64) * num_vocab + ids, mask=kept, other=0.0)
    divisor = tl.load(divisors_ptr + row)
    scaled = tl.where(kept, tl.math.div_rn(logits, divisor), float("-inf"))
    exps = tl.exp(scaled - tl.max(scaled, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    noise = tl.load(noise_ptr + row.to(tl.int64) * K + offsets, mask=kept, other=1.0)
    pick = tl.argmax(tl.where(kept, probs / noise, -1.0), axis=0)
    drawn = tl.sum(tl.where(offsets == pick, ids, 0), axis=0)
    drawn_q = tl.sum(tl.where(offsets == pick, probs, 0.0), axis=0)
    tl.store(ids_out + row.to(tl.int64) * K + offsets, ids, mask=kept)
    tl.store(probs_out + row.to(tl.int64) * K + offsets, probs, mask=kept)
    tl.store(drawn_out + row, drawn)
    tl.store(drawn_q_out + row, drawn_q)


def chunk_size(num_vocab: int, support_k: int) -> int:
    """Logits per first-stage program: a power of two >= K, large enough that P · K <= MAX_CANDIDATES."""
    chunk = max(_MIN_CHUNK, triton.next_power_of_2(support_k))
    while triton.cdiv(num_vocab, chunk) * support_k > MAX_CANDIDATES:
        chunk *= 2
    return chunk


def sparse_slot_draw_kernel(logits: torch.Tensor, divisors: torch.Tensor, noise: torch.Tensor, support_k: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chains.sparse_slot_draw` in two launches: logits [R, V] fp32 (Markov-corrected), divisors [R, 1] fp32 (> 0),
    noise [R, K] fp32 -> (support ids [R, K] int64 ascending, q [R, K] fp32, drawn token [R] int64, its q [R])."""
    num_rows, num_vocab = logits.shape
    if support_k < 1 or support_k >= num_vocab or support_k & (support_k - 1):
        raise ValueError(f"support_k={support_k}: a power of two below the vocabulary ({num_vocab})")
    if noise.shape != (num_rows, support_k) or divisors.shape[0] != num_rows:
        raise ValueError(f"noise {tuple(noise.shape)} / divisors {tuple(divisors.shape)} for {num_rows} rows, "
                         f"K={support_k}")
    logits = logits.float().contiguous()
    divisors = divisors.float().reshape(num_rows).contiguous()
    noise = noise.float().contiguous()
    device = logits.device
    chunk = chunk_size(num_vocab, support_k)
    num_chunks = triton.cdiv(num_vocab, chunk)
    candidates = torch.empty(num_rows, num_chunks * support_k, dtype=torch.int64, device=device)
    _chunk_candidates[(num_rows, num_chunks)](logits, candidates, num_vocab, num_chunks, CHUNK=chunk, K=support_k,
                                              num_warps=4 if chunk <= 1024 else 8)
    ids = torch.empty(num_rows, support_k, dtype=torch.int64, device=device)
    probs = torch.empty(num_rows, support_k, dtype=torch.float32, device=device)
    drawn = torch.empty(num_rows, dtype=torch.int64, device=device)
    drawn_q = torch.empty(num_rows, dtype=torch.float32, device=device)
    width = triton.next_power_of_2(num_chunks * support_k)
    _select_and_draw[(num_rows,)](candidates, logits, divisors, noise, ids, probs, drawn, drawn_q, num_vocab,
                                  num_chunks * support_k, K=support_k, CANDIDATES=width,
                                  num_warps=4 if width <= 1024 else 8)
    return ids, probs, drawn, drawn_q
