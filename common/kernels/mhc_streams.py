"""Kernels that write the mHC residual streams (docs/model.md §2.2): `hc_post` and the embedding, each able to do the
next hc_pre's first launch in the same launch (`MixPartials`, taken by `mhc.hc_pre`).

- `_hc_post_kernel` (grid [T, D/BD]): h'[t, k, d] = post_k·y[t, d] + Σ_j comb[j, k]·h[t, j, d], with the
  reference's three roundings to h's dtype reproduced (post·y, the matmul, the sum), so bf16 results
  match torch bit for bit up to fp32 summation order; y may come as two addends (the MoE's routed and
  shared outputs), summed and rounded to the dtype first as torch's `routed + shared` does, and the routed
  part as the experts' per-slot outputs [T, K, D], added in slot order first by the slot sum's own code
  (`route_layout.sum_slot_row`, bit for bit `sum_slots_in_order`): no slot-sum launch.
- `_embed_streams_kernel` (grid [T, D/BD]): N copies of each token's embedding row.
Up to MAX_FUSED_MIX_TOKENS tokens either can also do launch 1 of the hc_pre that reads its output next
(`next_fn`): each D slice's partial mix and Σ h² of the values it just rounded and stored, one split per slice
(`_store_mix_partials`), so that hc_pre is one launch. Nothing is read on the host: graph-capturable.
Legend: T tokens, N streams, NP N padded to a power of two, D hidden, M mix rows, BM M padded, K routed slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.dependent_launch import dependent_launch, wait_for_inputs
from moemesh.common.kernels.route_layout import sum_slot_row


@triton.jit
def _hc_post_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, hidden,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, addend_ptr=None,
                    next_fn_ptr=None, mix_part_ptr=None, sq_part_ptr=None, num_mix=0, BLOCK_M: tl.constexpr = 1,
                    Y_SLOTS: tl.constexpr = 0, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # y [T, D], or with Y_SLOTS = K the routed slots [T, K, D] summed in slot order (`sum_slot_row`),
    # (+ addend [T, D], rounded to the dtype), h [T, N, D] (same dtype), post [T, N], comb [T, N, N] fp32
    # -> out [T, N, D]; with next_fn [M, N·D] fp32 also the next hc_pre's launch-1 partials of out over
    # this program's D slice: mix_part [D/BD, T, BM], sq_part [D/BD, T]
    pid_t, pid_d, dims, dim_mask, streams, stream_mask = _stream_tile(hidden, N, NP, BLOCK_D)
    dtype = out_ptr.dtype.element_ty
    post = tl.load(post_ptr + pid_t * N + streams, mask=stream_mask, other=0.0).to(dtype).to(tl.float32)
    if Y_SLOTS:  # the routed slots' in-order sum, bit for bit what `_sum_slots_kernel` stores
        slot_row = y_ptr + pid_t.to(tl.int64) * Y_SLOTS * hidden + dims  # [BD] slot 0 of this token
        y = sum_slot_row(slot_row, hidden, dim_mask, Y_SLOTS, dtype == tl.bfloat16).to(tl.float32)
    else:
        y = tl.load(y_ptr + pid_t.to(tl.int64) * hidden + dims, mask=dim_mask, other=0.0).to(tl.float32)
    if addend_ptr is not None:  # y + addend in the dtype, as torch adds two tensors of it
        addend = tl.load(addend_ptr + pid_t.to(tl.int64) * hidden + dims, mask=dim_mask, other=0.0).to(tl.float32)
        y = (y + addend).to(dtype).to(tl.float32)
    scaled = (post[:, None] * y[None, :]).to(dtype).to(tl.float32)  # [NP, BD], rounded as torch's post·y
    mixed = tl.zeros([NP, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        comb_row = tl.load(comb_ptr + pid_t * N * N + j * N + streams, mask=stream_mask, other=0.0)
        comb_row = comb_row.to(dtype).to(tl.float32)  # comb[j, :] as torch casts it
        h_row = tl.load(h_ptr + (pid_t.to(tl.int64) * N + j) * hidden + dims, mask=dim_mask, other=0.0)
        mixed += comb_row[:, None] * h_row.to(tl.float32)[None, :]
    out = scaled + mixed.to(dtype).to(tl.float32)
    _store_streams(out, out_ptr, hidden, pid_t, pid_d, dims, dim_mask, streams, stream_mask, next_fn_ptr, mix_part_ptr,
                   sq_part_ptr, num_mix, N, BLOCK_M, BLOCK_D)


@triton.jit
def _stream_tile(hidden, N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's token and D slice: (pid_t, pid_d, dims [BD], dim_mask [BD], streams [NP], stream_mask [NP])."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    streams = tl.arange(0, NP)
    return pid_t, pid_d, dims, dims < hidden, streams, streams < N


@triton.jit
def _store_streams(out, out_ptr, hidden, pid_t, pid_d, dims, dim_mask, streams, stream_mask, next_fn_ptr,
                   mix_part_ptr, sq_part_ptr, num_mix, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store token pid_t's streams out [NP, BD] (this D slice) in out's dtype; with next_fn also the next hc_pre's
    launch-1 partials over the values just stored (`_store_mix_partials`)."""
    stored = out.to(out_ptr.dtype.element_ty)
    out_rows = pid_t.to(tl.int64) * N + streams
    tl.store(out_ptr + out_rows[:, None] * hidden + dims[None, :], stored, mask=stream_mask[:, None] & dim_mask[None, :])
    if next_fn_ptr is not None:
        rounded = tl.where(dim_mask[None, :], stored.to(tl.float32), 0.0)  # [NP, BD]
        _store_mix_partials(rounded, streams, dims, dim_mask, next_fn_ptr, mix_part_ptr, sq_part_ptr, num_mix, hidden,
                            pid_t, pid_d, N, BLOCK_M, BLOCK_D)


@triton.jit
def _store_mix_partials(rounded, streams, dims, dim_mask, next_fn_ptr, mix_part_ptr, sq_part_ptr, num_mix, hidden,
                        pid_t, pid_d, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Launch 1 of an hc_pre over one D slice of token pid_t's streams rounded [NP, BD] (fp32 of the stored values,
    zeros past D): its row of mix_part [D/BD, T, BM] (Σ h·fnᵀ over the slice) and of sq_part [D/BD, T] (Σ h²)."""
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_mix
    products = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    squares = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(N):
        stream_k = tl.sum(tl.where(streams[:, None] == k, rounded, 0.0), axis=0)  # [BD], row k exactly
        w = tl.load(next_fn_ptr + rows[:, None] * (N * hidden) + k * hidden + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BM, BD]
        products += w * stream_k[None, :]
        squares += stream_k * stream_k
    part_row = pid_d * tl.num_programs(0) + pid_t
    tl.store(mix_part_ptr + part_row.to(tl.int64) * BLOCK_M + rows, tl.sum(products, axis=1))
    tl.store(sq_part_ptr + part_row, tl.sum(squares, axis=0))


@triton.jit
def _embed_streams_kernel(ids_ptr, table_ptr, out_ptr, hidden, N: tl.constexpr, NP: tl.constexpr,
                          BLOCK_D: tl.constexpr, next_fn_ptr=None, mix_part_ptr=None, sq_part_ptr=None, num_mix=0,
                          BLOCK_M: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    wait_for_inputs(USE_PDL)
    # ids [T] int, table [V, D] -> out [T, N, D] (N copies of the token's row, in out's dtype); with next_fn [M, N·D]
    # fp32 also the first hc_pre's launch-1 partials over this program's D slice, as `_hc_post_kernel` does them
    pid_t, pid_d, dims, dim_mask, streams, stream_mask = _stream_tile(hidden, N, NP, BLOCK_D)
    dtype = out_ptr.dtype.element_ty
    token = tl.load(ids_ptr + pid_t).to(tl.int64)
    row = tl.load(table_ptr + token * hidden + dims, mask=dim_mask, other=0.0).to(dtype)  # [BD]
    out = tl.zeros([NP, BLOCK_D], dtype=dtype) + row[None, :]  # [NP, BD]
    _store_streams(out, out_ptr, hidden, pid_t, pid_d, dims, dim_mask, streams, stream_mask, next_fn_ptr, mix_part_ptr,
                   sq_part_ptr, num_mix, N, BLOCK_M, BLOCK_D)


@dataclass(frozen=True)
class MixPartials:
    """Launch 1 of an hc_pre, done ahead by the hc_post that wrote its h: per split the partial mix
    Σ h·fnᵀ and Σ h² of each token, for the fn named here (hc_pre uses them only for that fn and that h)."""

    h: torch.Tensor  # [T, N, D], the streams they were computed from
    fn: torch.Tensor  # [M, N·D] fp32
    mix_part: torch.Tensor  # [S, T, BM] fp32
    sq_part: torch.Tensor  # [S, T] fp32
    block_m: int

    def serves(self, h: torch.Tensor, fn: torch.Tensor) -> bool:
        return h is self.h and fn.data_ptr() == self.fn.data_ptr() and fn.shape == self.fn.shape


def default_block_d(num_tokens: int) -> int:
    """D slice per program: narrow at one or two tokens, so that a decode launch still spreads over ~64 programs
    (the next hc_pre's mix, done in the same launch, reads its [M, N·BD] slice of fn per program)."""
    if num_tokens <= 2:
        return 64
    if num_tokens <= 4:
        return 128
    return 256 if num_tokens <= 64 else 1024


# above, the next hc_pre's mix in hc_post's (or the embedding's) launch costs more than its own launch: each D-slice
# program re-reads its [M, N·BD] slice of fn per token (measured at 64 tokens on an H200)
MAX_FUSED_MIX_TOKENS = 16


def _next_mix(out: torch.Tensor, next_fn: torch.Tensor | None, num_d_blocks: int
              ) -> tuple[MixPartials | None, dict]:
    """(partials, kernel arguments) for a launch writing streams out [T, N, D] that also does the next hc_pre's
    launch 1 with next_fn [M, N·D] fp32, one split per D slice; (None, {}) without next_fn or above
    MAX_FUSED_MIX_TOKENS tokens."""
    num_tokens, num_streams, hidden = out.shape
    if next_fn is None or num_tokens > MAX_FUSED_MIX_TOKENS:
        return None, {}
    if next_fn.dtype != torch.float32 or not next_fn.is_contiguous() or next_fn.shape[1] != num_streams * hidden:
        raise ValueError(f"next_fn {tuple(next_fn.shape)} {next_fn.dtype} is not a contiguous fp32 "
                         f"[M, {num_streams * hidden}]")
    block_m = triton.next_power_of_2(next_fn.shape[0])
    mix_part = torch.empty(num_d_blocks, num_tokens, block_m, dtype=torch.float32, device=out.device)
    sq_part = torch.empty(num_d_blocks, num_tokens, dtype=torch.float32, device=out.device)
    partials = MixPartials(out, next_fn, mix_part, sq_part, block_m)
    return partials, {"next_fn_ptr": next_fn, "mix_part_ptr": mix_part, "sq_part_ptr": sq_part,
                      "num_mix": next_fn.shape[0], "BLOCK_M": block_m}


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            block_d: int | None = None, y_addend: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `common.model.hyper.hc_post`: y [T, D] or routed slots [T, K, D] (+ y_addend [T, D]),
    h [T, N, D] -> [T, N, D] in h's dtype."""
    return hc_post_with_mix(y, h, post, comb, None, block_d=block_d, y_addend=y_addend)[0]


def embed_streams(token_ids: torch.Tensor, table: torch.Tensor, num_streams: int, dtype: torch.dtype,
                  next_fn: torch.Tensor | None = None, block_d: int | None = None
                  ) -> tuple[torch.Tensor, MixPartials | None]:
    """token_ids [T], table [V, D] -> (streams [T, N, D] in dtype: N copies of each token's row, partials): with
    next_fn [M, N·D] fp32 (the first hc_pre) at T <= MAX_FUSED_MIX_TOKENS the same launch computes its launch 1
    as `hc_post_with_mix` does for the later ones; else None. One launch."""
    num_tokens, hidden = token_ids.shape[0], table.shape[1]
    out = torch.empty(num_tokens, num_streams, hidden, dtype=dtype, device=table.device)
    if num_tokens == 0:
        return out, None
    block_d = block_d or default_block_d(num_tokens)
    num_d_blocks = triton.cdiv(hidden, block_d)
    partials, mix_args = _next_mix(out, next_fn, num_d_blocks)
    _embed_streams_kernel[(num_tokens, num_d_blocks)](token_ids.contiguous(), table.contiguous(), out, hidden,
                                                       N=num_streams, NP=triton.next_power_of_2(num_streams),
                                                       BLOCK_D=block_d, num_warps=4, **mix_args,
                                                       **dependent_launch(out.device))
    return out, partials


def hc_post_with_mix(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     next_fn: torch.Tensor | None, block_d: int | None = None, y_addend: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, MixPartials | None]:
    """`hc_post` -> ([T, N, D], partials). y [T, D], or the routed experts' per-slot outputs [T, K, D], summed
    in slot order in the same launch (bit for bit `moe_layout.sum_slots_in_order`). next_fn [M, N·D] fp32 (the
    hc_pre that reads the result next): at T <= MAX_FUSED_MIX_TOKENS the same launch also computes that
    hc_pre's launch 1 (`MixPartials`); else None."""
    if y.dtype != h.dtype or (y_addend is not None and y_addend.dtype != y.dtype):
        raise ValueError(f"y dtype {y.dtype}, y_addend {None if y_addend is None else y_addend.dtype} != h dtype {h.dtype}")
    num_tokens, num_streams, hidden = h.shape
    num_slots = y.shape[1] if y.dim() == 3 else 0  # K routed slots, or 0: y is the block output itself
    if y.shape[0] != num_tokens or y.shape[-1] != hidden or (y.dim() == 3 and num_slots == 0):
        raise ValueError(f"y {tuple(y.shape)} for h {tuple(h.shape)}: [T, D] or [T, K >= 1, D]")
    y, h = y.contiguous(), h.contiguous()
    y_addend = None if y_addend is None else y_addend.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(h)
    if num_tokens == 0:
        return out, None
    block_d = block_d or default_block_d(num_tokens)
    num_d_blocks = triton.cdiv(hidden, block_d)
    grid = (num_tokens, num_d_blocks)
    partials, mix_args = _next_mix(out, next_fn, num_d_blocks)
    _hc_post_kernel[grid](y, h, post, comb, out, hidden, N=num_streams, NP=triton.next_power_of_2(num_streams),
                          BLOCK_D=block_d, addend_ptr=y_addend, Y_SLOTS=num_slots, num_warps=4, **mix_args,
                          **dependent_launch(out.device))
    return out, partials
