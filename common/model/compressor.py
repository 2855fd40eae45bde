"""KV compressors (docs/model.md §2.5): CSA (ratio m = 4, overlapping) and HCA (m = 128, disjoint).

Per token p: K_p = x_p · wkvᵀ, Z_p = x_p · wgateᵀ + ape[p mod m]. When window w (tokens w·m ..
w·m+m-1) closes, one row is pooled per channel: C_w = Σ_slot softmax_slot(Z) ⊙ K, then RMS-normed
and rotated at position w·m. Without overlap the slots are the window's m tokens. With overlap K
and Z are 2·d wide: the slots are the first halves ("a") of window w-1's tokens and the second
halves ("b") of window w's tokens (2m slots, stride m); window 0 has no a-slots (gate -inf).
With `fp8_qat_nope_dim` set (reference numerics), each row's first channels are FP8
quant-dequantized after norm and RoPE, before being stored (docs/model.md §2.5, `common.model.qat`), in blocks
of `fp8_qat_block_size` channels (64 for main rows; the indexer's whole row).
The same class, at the indexer's width, is the CSA indexer's compressor.
On CUDA at decode sizes `project` (both projections and the `ape` term) is one launch
(`common.kernels.projections`; the indexer adds its head weights to the same launch); the torch code is
the CPU and prefill path and the reference.
Legend: T tokens, S tokens of one sequence, W closed windows, m ratio, d row dim, C = c·d input dim.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.common.kernels.glue import use_triton_glue
from moemesh.common.model.linear import Linear, RMSNorm, parameter
from moemesh.common.model.qat import KV_FP8_BLOCK_SIZE, kv_nope_fp8_qat
from moemesh.common.model.rope import RotaryTable, apply_rope
from moemesh.common.model.state import CompressorStore


def projection_kernel_applies(x: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether the projections of `linears` (plain `Linear`s) of x run as one `common.kernels.projections`
    launch: CUDA (the glue rule of `common.kernels.glue`), decode sizes, 16-bit weights of x's dtype."""
    if not all(type(linear) is Linear for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    if not use_triton_glue(x, positions, ape, *weights):
        return False
    from moemesh.common.kernels import projections

    return projections.supports(x, *weights)


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, row_dim: int, ratio: int, overlap: bool, eps: float, *,
                 dtype: torch.dtype, device=None, fp8_qat_nope_dim: int | None = None,
                 fp8_qat_block_size: int = KV_FP8_BLOCK_SIZE) -> None:
        """fp8_qat_nope_dim: leading row channels to FP8-simulate (reference QAT); None = none;
        fp8_qat_block_size: channels per scale of that simulation."""
        super().__init__()
        if fp8_qat_nope_dim is not None and not 0 <= fp8_qat_nope_dim <= row_dim:
            raise ValueError(f"fp8_qat_nope_dim={fp8_qat_nope_dim} outside [0, row_dim={row_dim}]")
        self.fp8_qat_nope_dim = fp8_qat_nope_dim
        self.fp8_qat_block_size = fp8_qat_block_size
        width = (2 if overlap else 1) * row_dim
        self.ratio = ratio
        self.overlap = overlap
        self.row_dim = row_dim
        self.wkv = Linear(hidden_size, width, dtype=dtype, device=device)
        self.wgate = Linear(hidden_size, width, dtype=dtype, device=device)
        self.ape = parameter(ratio, width, dtype=torch.float32, device=device)
        self.norm = RMSNorm(row_dim, eps, device=device)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], positions [T] -> (K [T, C] x's dtype, Z [T, C] fp32); batched over every sequence's tokens.

        One launch on CUDA at decode sizes (`common.kernels.projections`), the torch code elsewhere."""
        if projection_kernel_applies(x, positions, self.ape, self.wkv, self.wgate):
            from moemesh.common.kernels.projections import compressor_projections

            return compressor_projections(x, self.wkv.weight, self.wgate.weight, self.ape, positions)
        kv = self.wkv(x)
        score = self.wgate(x) + self.ape[positions % self.ratio]
        return kv, score

    def emit(self, store: CompressorStore, kv: torch.Tensor, score: torch.Tensor, rope: RotaryTable) -> None:
        """Push one sequence's new inputs (K, Z [S, C]) and write the rows of windows they close."""
        m, d = self.ratio, self.row_dim
        first_row = store.num_rows
        end_row = (store.num_tokens + kv.shape[0]) // m
        num_new_rows = end_row - first_row
        if num_new_rows == 0:
            store.append_inputs(kv, score)
            return
        start = store.first_needed_position()
        old_kv, old_score = store.read_inputs(start)
        all_kv = torch.cat([old_kv, kv.float()])  # [P, C] positions start .. end
        all_score = torch.cat([old_score, score.float()])
        offset = first_row * m - start  # flat index of window first_row's first token
        win_kv = all_kv[offset: offset + num_new_rows * m].view(num_new_rows, m, -1)  # [W, m, C]
        win_score = all_score[offset: offset + num_new_rows * m].view(num_new_rows, m, -1)
        if self.overlap:
            slot_kv = win_kv.new_zeros(num_new_rows, 2 * m, d)  # [W, 2m, d]
            slot_score = win_score.new_full((num_new_rows, 2 * m, d), float("-inf"))
            slot_kv[:, m:] = win_kv[..., d:]
            slot_score[:, m:] = win_score[..., d:]
            if first_row >= 1:  # previous window's a-halves are in the buffer just before `offset`
                prev_kv = all_kv[offset - m: offset - m + num_new_rows * m].view(num_new_rows, m, -1)
                prev_score = all_score[offset - m: offset - m + num_new_rows * m].view(num_new_rows, m, -1)
                slot_kv[:, :m] = prev_kv[..., :d]
                slot_score[:, :m] = prev_score[..., :d]
            elif num_new_rows > 1:  # window 0 keeps -inf a-slots
                slot_kv[1:, :m] = win_kv[:-1, :, :d]
                slot_score[1:, :m] = win_score[:-1, :, :d]
        else:
            slot_kv, slot_score = win_kv, win_score
        pooled = (slot_kv * torch.softmax(slot_score, dim=1)).sum(dim=1)  # [W, d], per-channel softmax
        rows = self.norm(pooled.to(kv.dtype))
        row_positions = torch.arange(first_row, end_row, device=kv.device) * m  # first token of each window
        cos, sin = rope.cos_sin(row_positions)
        rows = apply_rope(rows, cos, sin)
        if self.fp8_qat_nope_dim is not None:
            rows = kv_nope_fp8_qat(rows, self.fp8_qat_nope_dim, self.fp8_qat_block_size)
        store.append_inputs(kv, score)
        store.write_rows(first_row, rows)
