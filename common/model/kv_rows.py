"""KV rows as stored: bf16, or FP8 in the layout the production V4 kernels read, and what a context token costs.

Main rows (window rows and compressed rows; head dim = nope + rope, 448 + 64 in V4-Flash), FP8 layout:
    bytes [0, nope)                  the nope channels as e4m3 codes, in blocks of 64
    bytes [nope, nope + 2·rope)      the rope channels as bf16
    bytes [.., + ceil(nope / 64))    one ue8m0 scale per block (the byte is the exponent + 127: 2^(byte − 127))
    pad to a multiple of 8           (V4-Flash: 448 + 128 + 7 + 1 = 584 bytes)
Each block's scale is the power of two `common.model.qat` computes (amax floored at 1e-4, times 1/448, rounded
up), so a row the reference's FP8 QAT already rounded (`kv_nope_fp8_qat`) packs and unpacks to exactly itself,
and packing any row gives the QAT's values: FP8 storage with `kv_fp8_qat` on is the reference's arithmetic.
Indexer rows (head dim 128), FP8 layout:
    bytes [0, dim)                   the channels as e4m3 codes
    bytes [dim, dim + 4)             one fp32 scale for the whole row          (V4-Flash: 128 + 4 = 132 bytes)
The scale is the FP8 activation quantization of the production indexer cache with ue8m0 scales, held as an fp32:
the power of two 2^ceil(log2(max(amax, 1e-4) / 448)) over the row's channels (`qat.fp8_block_scales` with one
block per row). A row rounded by `indexer_fp8_qat` packs and unpacks to exactly itself, and packing any row
gives that function's values, in fp32 and bf16 alike (codes times a power of two are exact in both).

The layouts' byte arithmetic is in common/model/kv_layouts.py (torch-free). `KVStorage` (common/model/kv_storage.py)
names the format; `RowFormat` is how one store keeps its rows (the
sequence state's window ring and row stores, the KV pool's blocks): `encode` on write, `decode` on read;
`kv_bytes_per_token` adds up what one more context token stores across the model's layers (compressed rows
grow by 1 / ratio per token; window rows are a fixed cost per sequence).
Decoded FP8 rows are exact in fp32 and bf16 (e4m3 values times powers of two ≥ 2^-31, rope already bf16), not
always in fp16 (the smallest values of a tiny-amax block underflow); the reference never runs fp16.
Legend: R rows (any leading dims), C channels, B blocks, N nope channels, P rope channels, Ws stored width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.kv_layouts import IndexerRowLayout, MainRowLayout
from moemesh.common.model.kv_storage import KVStorage
from moemesh.common.model.qat import E4M3_MAX, fp8_block_scales

UE8M0_BIAS = 127
POISON_BYTE = 0xFF  # an FP8 row of these bytes decodes to NaN (e4m3 0xFF, bf16 0xFFFF, ue8m0 2^128, fp32 NaN)


def pack_main_rows(rows: torch.Tensor, layout: MainRowLayout) -> torch.Tensor:
    """rows [R, N + P] (any float dtype) -> uint8 [R, row_bytes]."""
    nope, rope = rows[..., :layout.nope_dim], rows[..., layout.nope_dim:]
    if rope.shape[-1] != layout.rope_dim:
        raise ValueError(f"rows of {rows.shape[-1]} channels, the layout holds {layout.nope_dim} + {layout.rope_dim}")
    leading = rows.shape[:-1]
    scales = fp8_block_scales(nope.reshape(-1, layout.nope_dim), layout.block_size)  # [R, B] powers of two
    padded = torch.zeros(scales.shape[0], layout.num_blocks * layout.block_size, dtype=torch.float32,
                         device=rows.device)
    padded[:, :layout.nope_dim] = nope.reshape(-1, layout.nope_dim).float()
    blocks = padded.view(-1, layout.num_blocks, layout.block_size)  # [R, B, b]
    codes = (blocks / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(scales.shape[0], layout.row_bytes, dtype=torch.uint8, device=rows.device)
    out[:, :layout.nope_dim] = codes.view(torch.uint8).flatten(1)[:, :layout.nope_dim]
    out[:, layout.rope_offset:layout.scale_offset] = (
        rope.reshape(-1, layout.rope_dim).to(torch.bfloat16).contiguous().view(torch.uint8))
    exponents = torch.frexp(scales)[1] - 1  # scale = 2^(exponent)
    out[:, layout.scale_offset:layout.scale_offset + layout.num_blocks] = (exponents + UE8M0_BIAS).to(torch.uint8)
    return out.view(*leading, layout.row_bytes)


def unpack_main_rows(packed: torch.Tensor, layout: MainRowLayout) -> torch.Tensor:
    """uint8 [R, row_bytes] -> float32 [R, N + P]."""
    leading = packed.shape[:-1]
    flat = packed.reshape(-1, layout.row_bytes)
    codes = torch.zeros(flat.shape[0], layout.num_blocks * layout.block_size, dtype=torch.uint8, device=flat.device)
    codes[:, :layout.nope_dim] = flat[:, :layout.nope_dim]
    values = codes.view(torch.float8_e4m3fn).float().view(-1, layout.num_blocks, layout.block_size)  # [R, B, b]
    exponents = flat[:, layout.scale_offset:layout.scale_offset + layout.num_blocks].to(torch.int32) - UE8M0_BIAS
    nope = torch.ldexp(values, exponents[..., None]).flatten(1)[:, :layout.nope_dim]
    rope = flat[:, layout.rope_offset:layout.scale_offset].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).view(*leading, layout.nope_dim + layout.rope_dim)


def pack_indexer_rows(rows: torch.Tensor, layout: IndexerRowLayout) -> torch.Tensor:
    """rows [R, C] -> uint8 [R, C + 4]: e4m3 codes with one power-of-two scale per row, stored as fp32."""
    if rows.shape[-1] != layout.dim:
        raise ValueError(f"rows of {rows.shape[-1]} channels, the layout holds {layout.dim}")
    leading = rows.shape[:-1]
    flat = rows.reshape(-1, layout.dim).float()
    scale = fp8_block_scales(flat, layout.dim)  # [R, 1] powers of two
    codes = (flat / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)
    return out.view(*leading, layout.row_bytes)


def unpack_indexer_rows(packed: torch.Tensor, layout: IndexerRowLayout) -> torch.Tensor:
    """uint8 [R, C + 4] -> float32 [R, C]."""
    leading = packed.shape[:-1]
    flat = packed.reshape(-1, layout.row_bytes)
    codes = flat[:, :layout.dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = flat[:, layout.dim:].contiguous().view(torch.float32)  # [R, 1]
    return (codes * scale).view(*leading, layout.dim)


@dataclass(frozen=True)
class RowFormat:
    """How a store keeps rows of `dim` channels: in `dtype` as they are (`layout` None), or packed as FP8 rows of
    `layout` (main or indexer rows, uint8 [.., row_bytes]). `dtype` is the activation dtype, what `decode`
    returns."""

    dim: int
    dtype: torch.dtype
    layout: MainRowLayout | IndexerRowLayout | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.dim != self.dim:
            raise ValueError(f"a store of {self.dim} channels with FP8 rows of {self.layout.dim}")

    @classmethod
    def main(cls, config: ModelConfig, storage: KVStorage, dtype: torch.dtype) -> RowFormat:
        """The format of the main rows (window and compressed rows, head_dim channels) in `storage`."""
        return cls(config.head_dim, dtype, MainRowLayout.of(config) if storage is KVStorage.FP8 else None)

    @classmethod
    def indexer(cls, config: ModelConfig, storage: KVStorage, dtype: torch.dtype) -> RowFormat:
        """The format of the CSA indexer's rows (index_head_dim channels) in `storage`."""
        return cls(config.index_head_dim, dtype, IndexerRowLayout.of(config) if storage is KVStorage.FP8 else None)

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8 if self.layout is not None else self.dtype

    @property
    def stored_width(self) -> int:
        """Ws: elements of `stored_dtype` per stored row (bytes for FP8 rows)."""
        return self.layout.row_bytes if self.layout is not None else self.dim

    def empty(self, num_rows: int, device) -> torch.Tensor:
        """Zeroed storage for num_rows rows -> [num_rows, Ws] stored_dtype."""
        return torch.zeros(num_rows, self.stored_width, dtype=self.stored_dtype, device=device)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [R, dim] (any float dtype) -> [R, Ws] stored_dtype."""
        if rows.shape[-1] != self.dim:
            raise ValueError(f"rows of {rows.shape[-1]} channels for a store of {self.dim}")
        if self.layout is None:
            return rows.to(self.dtype)
        if isinstance(self.layout, MainRowLayout):
            return pack_main_rows(rows, self.layout)
        return pack_indexer_rows(rows, self.layout)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """[R, Ws] as stored -> rows [R, dim] (plain rows come back as they are, FP8 rows in `dtype`)."""
        if self.layout is None:
            return stored
        if isinstance(self.layout, MainRowLayout):
            return unpack_main_rows(stored, self.layout).to(self.dtype)
        return unpack_indexer_rows(stored, self.layout).to(self.dtype)

    def poison_(self, stored: torch.Tensor) -> torch.Tensor:
        """Fill stored rows [R, Ws] so that they decode to NaN (a snapshot that could not be captured)."""
        return stored.fill_(POISON_BYTE if self.layout is not None else float("nan"))


@dataclass(frozen=True)
class KVBytes:
    """Bytes one more context token stores, per layer kind and in all (compressed rows and indexer rows grow
    with the context), and the fixed window rows of one sequence."""

    per_token_by_kind: dict[str, float]
    per_token: float
    window_bytes_per_sequence: int


def kv_bytes_per_token(config: ModelConfig, storage: KVStorage) -> KVBytes:
    """The whole model's KV growth per context token in `storage` (main layers only)."""
    if storage is KVStorage.FP8:
        main_row = MainRowLayout.of(config).row_bytes
        indexer_row = IndexerRowLayout(config.index_head_dim).row_bytes
    else:
        main_row, indexer_row = 2 * config.head_dim, 2 * config.index_head_dim
    by_kind = {"csa": 0.0, "csa_indexer": 0.0, "hca": 0.0}
    for kind in config.layer_types:
        if kind is AttentionKind.CSA:
            by_kind["csa"] += main_row / config.csa_compress_ratio
            by_kind["csa_indexer"] += indexer_row / config.csa_compress_ratio
        elif kind is AttentionKind.HCA:
            by_kind["hca"] += main_row / config.hca_compress_ratio
    window = config.num_hidden_layers * config.sliding_window * main_row
    return KVBytes(by_kind, sum(by_kind.values()), window)
