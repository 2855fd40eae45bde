"""The tensors of a random checkpoint (`bench.random_checkpoint`): which safetensors entries a config
has, the bytes of each, and one shard streamed to disk.

`checkpoint_entries(config, routing_skew)` lists every stored entry of the config's inventory
(`common.model.inventory`) in file order with the rule its values follow; `entry_chunks` yields an
entry's bytes in pieces of at most `CHUNK_BYTES` from a generator of its own, seeded by (seed, entry
name); `write_shard` writes one safetensors file (header, then the entries' bytes) without holding more
than one piece in memory. The value rules are in `bench.random_checkpoint`'s docstring; the routing skew
is `skew_bias`. Legend: N out features, K in features, E routed experts, V vocab.
"""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_BYTES = 64 << 20
_FP8_VALUE_STD = 32.0  # e4m3 codes follow N(0, 32²): most of the e4m3 range, far from the ±448 limit
_FP4_CODE_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # RMS of uniform e2m1 codes
_UE8M0_BIAS = 127


# ------------------------------------------------------------------------------------ routing skew
def skew_ranks(num_experts: int, layer: int, seed: int) -> list[int]:
    """rank[e] of every expert of hub block `layer` under the skewed gate bias (0 = the most favoured).
    A per-layer permutation, so hot experts are different ids in different layers. DSpark stage j uses
    block num_hidden_layers + j."""
    import torch

    generator = torch.Generator().manual_seed(10_007 * (seed + 1) + layer)
    order = torch.randperm(num_experts, generator=generator).tolist()  # order[r] = expert of rank r
    ranks = [0] * num_experts
    for rank, expert in enumerate(order):
        ranks[expert] = rank
    return ranks


def skew_bias(num_experts: int, layer: int, seed: int, strength: float) -> np.ndarray:
    """float32 [E]: the gate bias -strength·ln(1 + rank) of block `layer` (see `skew_ranks`)."""
    if not strength >= 0.0:
        raise ValueError(f"routing skew {strength} must be >= 0")
    ranks = np.asarray(skew_ranks(num_experts, layer, seed), dtype=np.float64)
    return (-strength * np.log1p(ranks)).astype(np.float32)


# ------------------------------------------------------------------------------------ values
def _quantile_table(num_levels: int, std: float, mean: float = 0.0):
    """float32 [num_levels]: the (i + 0.5) / num_levels quantiles of N(mean, std²)."""
    import torch

    p = (torch.arange(num_levels, dtype=torch.float64) + 0.5) / num_levels
    return (mean + std * math.sqrt(2.0) * torch.erfinv(2 * p - 1)).float()


_TABLES: dict[tuple, np.ndarray] = {}


def _e4m3_table() -> np.ndarray:
    """uint8 [256]: e4m3 codes of the 256 quantiles of N(0, 32²) (|v| < 100: never 0x7F/0xFF, NaN)."""
    import torch

    key = ("e4m3",)
    if key not in _TABLES:
        values = _quantile_table(256, _FP8_VALUE_STD)
        _TABLES[key] = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().copy()
    return _TABLES[key]


def _bf16_normal_table(std: float, mean: float) -> np.ndarray:
    """uint16 [65536]: bf16 bit patterns of the 65536 quantiles of N(mean, std²)."""
    import torch

    key = ("bf16", std, mean)
    if key not in _TABLES:
        values = _quantile_table(1 << 16, std, mean)
        _TABLES[key] = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    return _TABLES[key]


def _random_bytes(rng: np.random.Generator, num_bytes: int) -> np.ndarray:
    """uint8 [num_bytes], uniform (drawn 8 bytes at a time: the fastest numpy path)."""
    words = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=-(-num_bytes // 8),
                         dtype=np.int64, endpoint=True)
    return words.view(np.uint8)[:num_bytes]


def _scale_bytes(rng: np.random.Generator, count: int, num_in: int, code_rms: float) -> np.ndarray:
    """uint8 [count] ue8m0 scales: 2^e with code_rms · 2^e ≈ num_in^-1/2, e jittered by -1, 0 or +1."""
    exponent = round(math.log2(num_in**-0.5 / code_rms))
    jitter = rng.integers(-1, 2, size=count, dtype=np.int16)
    return (jitter + exponent + _UE8M0_BIAS).astype(np.uint8)


@dataclass(frozen=True)
class Entry:
    """One safetensors entry to write: name, dtype string, shape, and how its values are drawn."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str  # "fp8", "fp8_scale", "fp4", "fp4_scale", "normal", "tid2eid", "skew"
    num_in: int = 0  # in features of the linear a weight or scale belongs to
    std: float = 0.0
    mean: float = 0.0
    skew_layer: int = 0

    @property
    def num_bytes(self) -> int:
        from moemesh.common.model.inventory import SAFETENSORS_DTYPE_BYTES

        return math.prod(self.shape) * SAFETENSORS_DTYPE_BYTES[self.dtype]


def _plain_role(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(std, mean) of a BF16/F32 tensor by its role (see the module docstring)."""
    stem = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if "hc_" in name:
        if name.endswith("_fn"):
            return 0.02, 0.0
        return (0.5, 0.0) if name.endswith("_base") else (0.1, 1.0)
    if name.endswith("attn_sink"):
        return 0.5, 0.0
    if name.endswith(".ape"):
        return 0.1, 0.0
    if name.endswith("gate.bias"):
        return 0.01, 0.0
    if "norm" in stem:
        return 0.1, 1.0
    if name == "embed.weight":
        return 1.0, 0.0
    if len(shape) == 2:
        return shape[1] ** -0.5, 0.0
    return 0.02, 0.0


def checkpoint_entries(config, routing_skew: float) -> list[Entry]:
    """Every safetensors entry of `config`'s inventory, in file order, with its value rule."""
    from moemesh.common.model.inventory import StorageKind, tensor_inventory
    from moemesh.common.model.config import RouterKind

    out = []
    for spec in tensor_inventory(config).values():
        entries = spec.stored_entries()
        if spec.storage in (StorageKind.FP8_BLOCK, StorageKind.FP4_BLOCK):
            fp8 = spec.storage is StorageKind.FP8_BLOCK
            weight, scale = entries
            num_in = spec.shape[1]
            out.append(Entry(weight.name, weight.dtypes[0], weight.shape, "fp8" if fp8 else "fp4", num_in))
            out.append(Entry(scale.name, scale.dtypes[0], scale.shape, "fp8_scale" if fp8 else "fp4_scale", num_in))
            continue
        (entry,) = entries
        dtype = entry.dtypes[0]
        if spec.storage is StorageKind.I64:
            out.append(Entry(entry.name, dtype, entry.shape, "tid2eid"))
            continue
        if spec.name.endswith("ffn.gate.bias") and routing_skew > 0.0:
            block = spec.layer if spec.layer is not None else config.num_hidden_layers + spec.mtp_block
            learned = spec.layer is None or config.mlp_layer_types[spec.layer] is RouterKind.LEARNED
            if learned:
                out.append(Entry(entry.name, dtype, entry.shape, "skew", skew_layer=block))
                continue
        std, mean = _plain_role(spec.name, spec.shape)
        out.append(Entry(entry.name, dtype, entry.shape, "normal", std=std, mean=mean))
    return out


def entry_chunks(entry: Entry, config, seed: int, routing_skew: float) -> Iterator[np.ndarray]:
    """The entry's values in storage order, in arrays of about `CHUNK_BYTES`, from its own generator
    (seed, name); their raw bytes are what the shard holds."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(entry.name.encode())])))
    if entry.kind == "skew":
        yield skew_bias(entry.shape[0], entry.skew_layer, seed, routing_skew)
        return
    rows = entry.shape[0] if entry.shape else 1
    row_bytes = entry.num_bytes // max(rows, 1)
    rows_per_chunk = max(1, CHUNK_BYTES // max(row_bytes, 1))
    for first in range(0, rows, rows_per_chunk):
        count = min(rows_per_chunk, rows - first)
        num = count * math.prod(entry.shape[1:])  # elements in this chunk
        if entry.kind == "fp4":
            yield _random_bytes(rng, num)
        elif entry.kind == "fp8":
            yield _e4m3_table()[_random_bytes(rng, num)]
        elif entry.kind == "fp8_scale":
            yield _scale_bytes(rng, num, entry.num_in, _FP8_VALUE_STD)
        elif entry.kind == "fp4_scale":
            yield _scale_bytes(rng, num, entry.num_in, _FP4_CODE_RMS)
        elif entry.kind == "tid2eid":  # k distinct experts per token id
            keys = rng.random((count, config.n_routed_experts), dtype=np.float32)
            yield np.argsort(keys, axis=1)[:, : entry.shape[1]].astype(np.int64)
        elif entry.dtype == "BF16":
            table = _bf16_normal_table(entry.std, entry.mean)
            yield table[_random_bytes(rng, 2 * num).view(np.uint16)]
        elif entry.dtype == "F32":
            values = rng.standard_normal(num, dtype=np.float32) * np.float32(entry.std) + np.float32(entry.mean)
            yield values.astype(np.float32)
        else:
            raise AssertionError(f"{entry.name}: no rule for {entry.kind} {entry.dtype}")


def shard_plan(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Greedy in file order; a tensor larger than the limit gets a shard of its own. A quantized weight
    and its scale stay in one shard."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        is_scale = entry.kind in ("fp8_scale", "fp4_scale")
        if shards[-1] and not is_scale and size + entry.num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.num_bytes
    return shards


def safetensors_header(entries: list[Entry]) -> bytes:
    """A safetensors header (8-byte length, JSON padded with spaces to a multiple of 8)."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        doc[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                           "data_offsets": [offset, offset + entry.num_bytes]}
        offset += entry.num_bytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, entries: list[Entry], hub: dict[str, Any], seed: int,
                 routing_skew: float) -> tuple[int, float]:
    """Stream one shard to `path`: (bytes of tensor data written, seconds)."""
    from moemesh.common.model.config import ModelConfig

    config = ModelConfig.from_dict(hub)
    began_s = time.perf_counter()
    shard_bytes = 0
    with open(path, "wb") as handle:
        handle.write(safetensors_header(entries))
        for entry in entries:
            written = 0
            for piece in entry_chunks(entry, config, seed, routing_skew):
                data = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)  # written without a copy
                handle.write(data)
                written += data.nbytes
            if written != entry.num_bytes:
                raise AssertionError(f"{entry.name}: wrote {written} bytes, expected {entry.num_bytes}")
            shard_bytes += written
    return shard_bytes, time.perf_counter() - began_s
