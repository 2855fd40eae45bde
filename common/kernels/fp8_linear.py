"""y = x @ W^T with W FP8 e4m3 [N, K] and ue8m0 128x128 block scales, dequantised in the kernel.

Legend: T tokens (rows of x), N output features, K input features, S split-K parts.

The weight stays FP8 in device memory (1 byte per element) and is converted to the activation
dtype in registers; each 128x128 block's scale is a power of two, so folding it into the
converted weight is exact (bf16 and fp32 share fp32's exponent range). Accumulation is fp32.

The kernel computes the transposed tile y^T [N-tile, T-tile] = W_tile @ x_tile^T, so the
dequantised weight is the left dot operand: on Hopper that operand can stay in registers
(wgmma's A) while x goes through shared memory, and the token dimension, which is tiny in decode,
is the narrow side of the tile (minimum 16).

Schedules (`fp8_linear_config.choose_fp8_linear_config`):
- decode (T <= 64): narrow N tiles and split-K, so that there are at least ~2 programs per SM and
  each weight byte is read once. Split-K stays one launch: each program writes its fp32 partial
  [T, N-tile] into a workspace [S, T, N], and the last program of the tile to arrive sums the S
  partials in a fixed order and stores the output (`split_k.py`); no second kernel.
- prefill: 128x128 output tiles over the full K, no split.

`RowNorm` (decode): the linear's output is normalised in the same launch, per group of G columns of a row
(the whole row, or one attention head), with RoPE on the group's trailing channels: every output tile, once
stored (after its split-K fix-up), takes a ticket from its group's counter, and the last tile of the group
runs `norm_rope._norm_rope_row` in place over the group's rows; what `norm_rope.norm_rope` would do to the
output in a second launch, with its roundings (its fp32 sum of squares may be ordered differently).

`fp8_gate_up_swiglu` runs the same kernel over two weights of the same x (an MLP's gate and up, the
shared expert's w1 and w3): each program accumulates both tiles from one x tile and the epilogue
applies the SwiGLU (clamps, silu, product) with the roundings of the unfused torch code; one launch
for two linears and four elementwise kernels.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moemesh.common.kernels.dependent_launch import (
    dependent_launch, prefetch_rows_to_l2, wait_for_inputs, weight_rows_prefetchable,
)
from moemesh.common.kernels.norm_rope import NormKind, _norm_rope_row
from moemesh.common.kernels.ptx_decode import fp8_tile_bf16_asm, fp8_tile_quarters_bf16_asm
from moemesh.common.kernels.reference import FP8_BLOCK_SIZE, scale_bytes
from moemesh.common.kernels.fp8_linear_config import Fp8LinearConfig, choose_fp8_linear_config, device_num_sms
from moemesh.common.kernels.split_k import take_ticket, tile_counters

_LIBDEVICE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")  # the interpreter has no libdevice


@dataclass(frozen=True)
class RowNorm:
    """Norm and RoPE applied to each `group` output columns of a row in the linear's launch (see the module doc).

    norm: NormKind (NONE: RoPE only); weight [group] fp32 with WEIGHTED; cos / sin [T, H] fp32: RoPE on the
    group's trailing 2·H channels (None: no rotation). Same contract as `norm_rope.norm_rope` on the output
    viewed [T, N / group, group]."""

    group: int
    norm: NormKind
    eps: float = 0.0
    weight: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.norm is NormKind.WEIGHTED) != (self.weight is not None):
            raise ValueError("a weight is given exactly when norm is WEIGHTED")
        if (self.cos is None) != (self.sin is None):
            raise ValueError("cos and sin come together")


@triton.jit
def _accumulate_step(acc, x, w_bytes, w_ptr, s_ptr, offs_n, mask_n, k_step, in_features, stride_wn, stride_sn,
                     USE_FMA: tl.constexpr, ASM_DECODE: tl.constexpr, ASM_QUAD: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, QUANT_BLOCK: tl.constexpr):
    """acc [BN, BT] (or [BN, BK] for one token by FMA) += W[offs_n, k_step·BK : +BK] @ x^T, x [BT, BK].

    w_bytes: the step's e4m3 bytes [BN, BK], loaded by the caller (read by the portable decode only; the
    inline-PTX decodes load their own words)."""
    if ASM_QUAD:
        q0, q1, q2, q3 = fp8_tile_quarters_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_step * BLOCK_K, in_features,
                                                    stride_wn, stride_sn, BLOCK_K)  # [BN, BK/4] each
        x_b0, x_b1 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_K // 4, 2, 2]))  # k % 2 == 0 / 1
        x_0, x_2 = tl.split(x_b0)  # k % 4 == 0 / 2: [BT, BK/4]
        x_1, x_3 = tl.split(x_b1)
        acc = tl.dot(q0, tl.trans(x_0), acc)
        acc = tl.dot(q1, tl.trans(x_1), acc)
        acc = tl.dot(q2, tl.trans(x_2), acc)
        acc = tl.dot(q3, tl.trans(x_3), acc)
    elif ASM_DECODE:
        w_bf16 = fp8_tile_bf16_asm(w_ptr, s_ptr, offs_n, mask_n, k_step * BLOCK_K, in_features, stride_wn,
                                   stride_sn, BLOCK_K)  # [BN, BK] bf16
        acc = tl.dot(w_bf16, tl.trans(x), acc)
    else:
        s_bytes = tl.load(s_ptr + (offs_n // QUANT_BLOCK) * stride_sn + (k_step * BLOCK_K) // QUANT_BLOCK,
                          mask=mask_n, other=127)
        scale = (s_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # [BN] 2^(byte-127)
        w = w_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        if USE_FMA and BLOCK_T == 1:  # one token: elementwise partial sums, reduced after the loop
            acc += w * x.to(tl.float32)
        elif USE_FMA:  # [BN, 1, BK] * [1, BT, BK] summed over k
            acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    return acc


@triton.jit
def _precise_exp(x):
    """e^x as torch's CUDA kernels compute it (libdevice expf; `tl.exp` is the faster ex2.approx); numpy's
    in the interpreter."""
    if _LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _swiglu_rounded(gate, up, swiglu_limit, HAS_LIMIT: tl.constexpr, dtype: tl.constexpr):
    """silu(min(gate, L)) · clamp(up, -L, L) from fp32 accumulators, rounded to `dtype` where the unfused
    torch code rounds: each product, the silu (fp32 x / (1 + exp(-x)), as torch's kernel), the final product."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if HAS_LIMIT:  # the limit arrives rounded to `dtype`, as torch's clamp rounds its scalar
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    silu = tl.math.div_rn(gate, 1.0 + _precise_exp(-gate)).to(dtype).to(tl.float32)
    return silu * up


@triton.jit
def _normalise_group(out_ptr, counter_ptr, norm_weight_ptr, cos_ptr, sin_ptr, num_tokens, stride_ot, rope_half,
                     norm_eps, pid_n, pid_t, NORM_GROUP: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                     ROPE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """After this tile's output is stored: the last of its group's NORM_GROUP / BLOCK_N tiles to arrive (per token
    tile; counter_ptr at this group's counters) normalises (+ rotates) the group's columns of every row, in place."""
    group = (pid_n * BLOCK_N) // NORM_GROUP
    if take_ticket(counter_ptr + group * tl.num_programs(1) + pid_t, NORM_GROUP // BLOCK_N):
        pairs = tl.arange(0, ROPE_BLOCK)
        for r in range(0, BLOCK_T):
            token = pid_t * BLOCK_T + r
            if token < num_tokens:
                cos = tl.zeros([ROPE_BLOCK], dtype=tl.float32)
                sin = tl.zeros([ROPE_BLOCK], dtype=tl.float32)
                if ROPE:
                    cos = tl.load(cos_ptr + token * rope_half + pairs, mask=pairs < rope_half, other=0.0)
                    sin = tl.load(sin_ptr + token * rope_half + pairs, mask=pairs < rope_half, other=0.0)
                row = out_ptr + token.to(tl.int64) * stride_ot + group * NORM_GROUP
                _norm_rope_row(row, row, norm_weight_ptr, cos, sin, NORM_GROUP, rope_half, norm_eps, NORM, ROPE, False,
                               NORM_GROUP, ROPE_BLOCK, IN_PLACE=True)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, w_up_ptr, s_up_ptr, out_ptr, partial_ptr, counter_ptr,
    num_tokens, out_features, in_features, swiglu_limit,
    stride_xt, stride_wn, stride_sn, stride_ot, stride_ps, stride_pt,
    SPLIT_K: tl.constexpr, K_STEPS_PER_SPLIT: tl.constexpr, USE_FMA: tl.constexpr, ASM_DECODE: tl.constexpr,
    ASM_QUAD: tl.constexpr, GATE_UP: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, QUANT_BLOCK: tl.constexpr,
    norm_weight_ptr=None, cos_ptr=None, sin_ptr=None, rope_half=0, norm_eps=0.0,
    NORM_GROUP: tl.constexpr = 0, NORM: tl.constexpr = 0, ROPE: tl.constexpr = False, ROPE_BLOCK: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False, PREFETCH_L2: tl.constexpr = False,
):
    # GATE_UP: w / s are the gate weight, w_up / s_up the up weight (same shape and scale grid); the output is
    # the SwiGLU of the two products. The split-K workspace then holds [S, T, 2N]: gate partials, then up.
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    mask_n = offs_n < out_features
    mask_t = offs_t < num_tokens
    if PREFETCH_L2:  # this program's weight bytes towards L2 while the previous kernel drains
        k_first = pid_s * K_STEPS_PER_SPLIT * BLOCK_K
        span = tl.minimum(K_STEPS_PER_SPLIT * BLOCK_K, in_features - k_first)  # bytes per row (multiple of 16)
        rows_ok = mask_n & (pid_t == 0) & (span > 0)  # one token tile fetches; the others hit L2
        prefetch_rows_to_l2(w_ptr + offs_n * stride_wn + k_first, span + offs_n * 0, rows_ok)
        if GATE_UP:
            prefetch_rows_to_l2(w_up_ptr + offs_n * stride_wn + k_first, span + offs_n * 0, rows_ok)
    wait_for_inputs(USE_PDL)

    WIDE: tl.constexpr = USE_FMA and BLOCK_T == 1
    acc = tl.zeros([BLOCK_N, BLOCK_K if WIDE else BLOCK_T], dtype=tl.float32)  # y^T tile (or its k-partials)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K if WIDE else BLOCK_T], dtype=tl.float32)  # GATE_UP only
    # Every split runs the same trip count, a compile-time constant (fixed per layer shape, so few
    # variants get compiled); steps past K (last split only) load nothing (masked).
    for step in range(0, K_STEPS_PER_SPLIT):
        k_step = pid_s * K_STEPS_PER_SPLIT + step
        k = k_step * BLOCK_K + offs_k
        mask_k = k < in_features
        w_offs = offs_n[:, None] * stride_wn + k[None, :]
        w_mask = mask_n[:, None] & mask_k[None, :]
        w_bytes = tl.load(w_ptr + w_offs, mask=w_mask, other=0)  # [BN, BK] e4m3 bytes
        x = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0
        )  # [BT, BK]
        acc = _accumulate_step(acc, x, w_bytes, w_ptr, s_ptr, offs_n, mask_n, k_step, in_features, stride_wn,
                               stride_sn, USE_FMA, ASM_DECODE, ASM_QUAD, BLOCK_T, BLOCK_K, QUANT_BLOCK)
        if GATE_UP:
            w_up_bytes = tl.load(w_up_ptr + w_offs, mask=w_mask, other=0)
            acc_up = _accumulate_step(acc_up, x, w_up_bytes, w_up_ptr, s_up_ptr, offs_n, mask_n, k_step, in_features,
                                      stride_wn, stride_sn, USE_FMA, ASM_DECODE, ASM_QUAD, BLOCK_T, BLOCK_K,
                                      QUANT_BLOCK)
    if WIDE:
        acc = tl.sum(acc, axis=1)[:, None]  # [BN, 1]
        acc_up = tl.sum(acc_up, axis=1)[:, None]
    store_mask = mask_n[:, None] & mask_t[None, :]  # [BN, BT]
    if SPLIT_K > 1:
        part_offs = offs_t[None, :] * stride_pt + offs_n[:, None]  # [BN, BT]
        tl.store(partial_ptr + pid_s * stride_ps + part_offs, acc, mask=store_mask)
        if GATE_UP:
            tl.store(partial_ptr + pid_s * stride_ps + part_offs + out_features, acc_up, mask=store_mask)
        tile = pid_n * tl.num_programs(1) + pid_t
        is_last = take_ticket(counter_ptr + tile, SPLIT_K)
        store_mask = store_mask & is_last
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sum
            acc += tl.load(partial_ptr + s * stride_ps + part_offs, mask=store_mask, other=0.0, cache_modifier=".cg")
            if GATE_UP:
                acc_up += tl.load(partial_ptr + s * stride_ps + part_offs + out_features, mask=store_mask, other=0.0,
                                  cache_modifier=".cg")
    if GATE_UP:
        acc = _swiglu_rounded(acc, acc_up, swiglu_limit, HAS_LIMIT, out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + offs_t[None, :] * stride_ot + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)
    if NORM_GROUP > 0:  # RowNorm: group counters follow the split-K tile counters
        group_counters = counter_ptr + tl.num_programs(0) * tl.num_programs(1)
        if SPLIT_K > 1:
            if is_last:
                _normalise_group(out_ptr, group_counters, norm_weight_ptr, cos_ptr, sin_ptr, num_tokens, stride_ot,
                                 rope_half, norm_eps, pid_n, pid_t, NORM_GROUP, NORM, ROPE, ROPE_BLOCK, BLOCK_N,
                                 BLOCK_T)
        else:
            _normalise_group(out_ptr, group_counters, norm_weight_ptr, cos_ptr, sin_ptr, num_tokens, stride_ot,
                             rope_half, norm_eps, pid_n, pid_t, NORM_GROUP, NORM, ROPE, ROPE_BLOCK, BLOCK_N, BLOCK_T)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: Fp8LinearConfig | None = None,
    row_norm: RowNorm | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequant(weight [N, K] FP8, scale [ceil(N/128), ceil(K/128)])^T.

    row_norm: the output's groups normalised / rotated in the same launch (`RowNorm`; x 2-D [T, K]).

    Returns [..., N] in `out_dtype` (default x.dtype). The weight may be float8_e4m3fn or its uint8
    bytes; scales float8_e8m0fnu or uint8. Scale byte 0 (2^-127) is read as 0 and 255 (NaN) as
    2^128: neither occurs in real checkpoints. With the inline-PTX decode (the default for bf16
    activations on the GPU, `PTX_DECODE_BY_DEFAULT`) results are exact for scale bytes <= 134,
    i.e. weights below 2^7 * 448 in magnitude (real checkpoints: scale bytes ~110..125).
    """
    x2d, lead_shape = _flat_input(x, weight)
    w_bytes, s_bytes = _weight_operands(weight, scale)
    out = _launch(x2d, (w_bytes, s_bytes), None, out_dtype or x.dtype, config, swiglu_limit=None, row_norm=row_norm)
    return out.reshape(*lead_shape, weight.shape[0])


def fp8_gate_up_swiglu(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_scale: torch.Tensor,
    up_weight: torch.Tensor,
    up_scale: torch.Tensor,
    *,
    swiglu_limit: float | None,
    out_dtype: torch.dtype | None = None,
    config: Fp8LinearConfig | None = None,
) -> torch.Tensor:
    """SwiGLU hidden of two FP8 linears of the same x in one launch: x [..., K] -> [..., N] (`out_dtype`, default x's).

    h = silu(min(g, L)) · clamp(u, -L, L) with g = `fp8_linear(x, gate_weight, gate_scale)` and
    u = `fp8_linear(x, up_weight, up_scale)` (L = `swiglu_limit`; None: no clamps). Both products come from the
    tiles and split-K order `fp8_linear` uses for one of them (the default `config` is the one it would pick for
    [N, K]), so with the same warps (the inline-PTX decode, bf16 on the GPU) they are bit for bit its results;
    the portable decode runs 8 warps here (two fp32 weight tiles a step would spill at 4), its products equal to
    fp32 rounding. The epilogue then rounds to `out_dtype` wherever the unfused torch code does (g and u, the
    limit, silu, the product), so h equals the model's `_swiglu(g, u, L)` up to the exponential's last fp32 bit
    (libdevice's expf, as torch's CUDA silu). The two weights stay where they are (no stacked copy): same shape,
    scale grid and row stride. Meant for decode sizes (T <= DECODE_MAX_TOKENS): two accumulators per tile.
    """
    if gate_weight.shape != up_weight.shape or gate_scale.shape != up_scale.shape:
        raise ValueError(f"gate {tuple(gate_weight.shape)} / {tuple(gate_scale.shape)} and up "
                         f"{tuple(up_weight.shape)} / {tuple(up_scale.shape)} differ")
    x2d, lead_shape = _flat_input(x, gate_weight)
    gate = _weight_operands(gate_weight, gate_scale)
    up = _weight_operands(up_weight, up_scale)
    if gate[0].stride(0) != up[0].stride(0) or gate[1].stride(0) != up[1].stride(0):
        raise ValueError("gate and up weights must have the same row strides")
    out_dtype = out_dtype or x.dtype
    limit = None if swiglu_limit is None else float(torch.tensor(swiglu_limit, dtype=out_dtype))  # torch's clamp
    out = _launch(x2d, gate, up, out_dtype, config, swiglu_limit=limit)
    return out.reshape(*lead_shape, gate_weight.shape[0])


def _flat_input(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """x [..., K] -> (x2d [T, K] with unit column stride, the leading shape)."""
    num_in = weight.shape[1]
    if x.shape[-1] != num_in:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {num_in}")
    x2d = x.reshape(-1, num_in)
    return (x2d if x2d.stride(-1) == 1 else x2d.contiguous()), x.shape[:-1]


def _weight_operands(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes [N, K] with unit column stride, contiguous ue8m0 bytes)."""
    w_bytes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    if w_bytes.stride(-1) != 1:
        w_bytes = w_bytes.contiguous()
    return w_bytes, scale_bytes(scale).contiguous()


def row_norm_fits(num_tokens: int, num_out: int, num_in: int, group: int, device: torch.device) -> bool:
    """Whether a default-config launch of [N, K] at T tokens can carry a RowNorm of `group` columns."""
    block_n = choose_fp8_linear_config(num_tokens, num_out, num_in, device_num_sms(device)).block_n
    return group > 0 and not group & (group - 1) and group % block_n == 0 and num_out % group == 0


def _row_norm_args(row_norm: RowNorm | None, num_tokens: int, num_out: int, block_n: int) -> tuple[dict, int]:
    """(the kernel's RowNorm arguments, number of groups) checked against the launch; ({}, 0) without."""
    if row_norm is None:
        return {}, 0
    group = row_norm.group
    if group <= 0 or group & (group - 1) or group % block_n or num_out % group:
        raise ValueError(f"RowNorm group {group} must be a power of two, a multiple of block_n {block_n} and divide "
                         f"N = {num_out}")
    rope_half = 0 if row_norm.cos is None else row_norm.cos.shape[-1]
    if row_norm.cos is not None and (tuple(row_norm.cos.shape) != (num_tokens, rope_half)
                                     or row_norm.sin.shape != row_norm.cos.shape or 2 * rope_half > group):
        raise ValueError(f"cos {tuple(row_norm.cos.shape)} / sin {tuple(row_norm.sin.shape)} do not fit "
                         f"[{num_tokens}, <= {group // 2}]")
    if row_norm.weight is not None and row_norm.weight.numel() != group:
        raise ValueError(f"norm weight has {row_norm.weight.numel()} values for groups of {group}")
    weight = row_norm.weight.float().contiguous() if row_norm.weight is not None else None
    cos = row_norm.cos.float().contiguous() if row_norm.cos is not None else None
    sin = row_norm.sin.float().contiguous() if row_norm.sin is not None else None
    args = {"norm_weight_ptr": weight, "cos_ptr": cos, "sin_ptr": sin, "rope_half": rope_half,
            "norm_eps": float(row_norm.eps), "NORM_GROUP": group, "NORM": int(row_norm.norm),
            "ROPE": cos is not None, "ROPE_BLOCK": triton.next_power_of_2(max(rope_half, 1))}
    return args, num_out // group


def _launch(x2d: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor] | None,
            out_dtype: torch.dtype, config: Fp8LinearConfig | None, *, swiglu_limit: float | None,
            row_norm: RowNorm | None = None) -> torch.Tensor:
    """One launch of `_fp8_linear_kernel`: x2d [T, K] -> [T, N]; with `up`, the SwiGLU of the two products; with
    `row_norm`, the output's groups normalised (and rotated) by the launch's last tile of each group."""
    w_bytes, s_bytes = gate
    num_out, num_in = w_bytes.shape
    num_tokens = x2d.shape[0]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if config is None:
        ptx_possible = (x2d.dtype == torch.bfloat16 and x2d.is_cuda and not interpreted
                        and num_in % 4 == 0 and w_bytes.stride(0) % 4 == 0)
        config = choose_fp8_linear_config(num_tokens, num_out, num_in, device_num_sms(x2d.device),
                                          ptx_decode_possible=ptx_possible)
        if up is not None and not config.asm_decode and config.num_warps < 8:
            # two fp32 weight tiles per step: 4 warps spill (sm_90: 312 bytes a thread), 8 do not
            config = dataclasses.replace(config, num_warps=8)
    if config.asm_decode and (x2d.dtype != torch.bfloat16 or interpreted):
        raise ValueError("asm_decode needs bf16 activations and a compiled (not interpreted) kernel")
    if config.asm_decode and config.asm_quad and (num_in % 4 or w_bytes.stride(0) % 4):
        raise ValueError("asm_quad reads the weight as 32-bit words: K and the row stride must be multiples of 4")
    k_steps = triton.cdiv(num_in, config.block_k)
    k_steps_per_split = triton.cdiv(k_steps, config.split_k)
    split_k = triton.cdiv(k_steps, k_steps_per_split)
    num_parts = 1 if up is None else 2  # gate (and up) partials per split
    out = torch.empty(num_tokens, num_out, dtype=out_dtype, device=x2d.device)
    grid = (triton.cdiv(num_out, config.block_n), triton.cdiv(num_tokens, config.block_t), split_k)
    norm_args, num_groups = _row_norm_args(row_norm, num_tokens, num_out, config.block_n)
    if up is not None and row_norm is not None:
        raise ValueError("RowNorm applies to a plain linear, not the gate-up SwiGLU")
    counters = s_bytes  # never read without split-K or RowNorm
    if split_k > 1 or num_groups:
        counters = tile_counters(x2d.device, grid[0] * grid[1] + num_groups * grid[1])
    if split_k > 1:
        partials = torch.empty(split_k, num_tokens, num_parts * num_out, dtype=torch.float32, device=x2d.device)
    else:
        partials = out  # never read
    w_up, s_up = up if up is not None else gate  # never read without GATE_UP
    _fp8_linear_kernel[grid](
        x2d, w_bytes, s_bytes, w_up, s_up, out, partials, counters,
        num_tokens, num_out, num_in, swiglu_limit if swiglu_limit is not None else 0.0,
        x2d.stride(0), w_bytes.stride(0), s_bytes.stride(0), out.stride(0),
        partials.stride(0) if split_k > 1 else 0, partials.stride(1) if split_k > 1 else 0,
        SPLIT_K=split_k, K_STEPS_PER_SPLIT=k_steps_per_split, USE_FMA=config.use_fma, ASM_DECODE=config.asm_decode,
        ASM_QUAD=config.asm_decode and config.asm_quad, GATE_UP=up is not None, HAS_LIMIT=swiglu_limit is not None,
        BLOCK_N=config.block_n, BLOCK_T=config.block_t, BLOCK_K=config.block_k, QUANT_BLOCK=FP8_BLOCK_SIZE,
        num_warps=config.num_warps, num_stages=config.num_stages, **norm_args, **dependent_launch(out.device),
        PREFETCH_L2=weight_rows_prefetchable(out.device, (w_bytes, w_up), num_in, k_steps_per_split * config.block_k),
    )
    return out
