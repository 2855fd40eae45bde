"""Routed experts read from a checkpoint straight into the layouts the expert kernels use.

An expert worker holds a set of (layer, expert) pairs. Per layer, its experts live in one stack per
matrix, ordered by ascending expert id, as `QuantizedRoutedExperts` and the grouped kernels read them:

- FP4 (`ExpertFormat.FP4`): w [E, N, K/2] uint8 (two e2m1 codes per byte, low nibble = even column),
  s [E, N, K/32] uint8 ue8m0 bytes;
- FP8 (`ExpertFormat.FP8`): w [E, N, K] float8_e4m3fn, s [E, ceil(N/128), ceil(K/128)] uint8.

Each stack is allocated once on the worker's device; each expert's safetensors entry is read from the
memory-mapped shard and copied into its slot, so no dense copy of a layer or a stack ever exists.
`ExpertDtype` picks what is kept: the checkpoint's own format (`native`), FP8 re-encoded at load
(`fp8`: see `fp4_to_fp8_block`), or dense bf16 matrices (`bf16`, for debugging). Experts a checkpoint
stores as plain floats (transformers' save format) are kept dense at their stored dtype under
`native`. Legend: E experts of a layer held here, N out features, K in features, I expert width, D hidden.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moemesh.common.checkpoint.errors import CheckpointError
from moemesh.common.model.inventory import StorageKind
from moemesh.common.checkpoint.quant import dequantize_fp4, dequantize_fp8_block, quantize_fp8_block

MATRICES = ("w1", "w2", "w3")
FP8_KERNEL_BLOCK = (128, 128)
DenseWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w1 [I, D], w2 [D, I], w3 [I, D]


class ExpertDtype(enum.Enum):
    """What an expert worker keeps of its routed experts (`--expert-dtype`)."""

    NATIVE = "native"  # the checkpoint's format: FP4 stays FP4, FP8 stays FP8, floats stay floats
    FP8 = "fp8"  # FP8 e4m3 with 128x128 ue8m0 block scales, re-encoded at load where stored otherwise
    BF16 = "bf16"  # dense bf16 matrices (debugging)


class ResidentFormat(enum.Enum):
    FP4 = "fp4"
    FP8 = "fp8"
    DENSE = "dense"


def expert_weight_name(layer: int, expert: int, which: str, prefix: str = "layers.") -> str:
    """Hub name of a routed expert matrix; prefix "mtp." names the drafter stages' experts (layer = stage)."""
    return f"{prefix}{layer}.ffn.experts.{expert}.{which}.weight"


def stored_expert_kind(reader) -> StorageKind:
    """How the checkpoint stores its routed experts (read from the first expert's headers)."""
    return reader.stored_kind(expert_weight_name(0, 0, "w1"))


def resident_format(stored: StorageKind, expert_dtype: ExpertDtype) -> ResidentFormat:
    if expert_dtype is ExpertDtype.BF16:
        return ResidentFormat.DENSE
    if expert_dtype is ExpertDtype.FP8:
        return ResidentFormat.FP8
    if stored is StorageKind.FP4_BLOCK:
        return ResidentFormat.FP4
    if stored is StorageKind.FP8_BLOCK:
        return ResidentFormat.FP8
    return ResidentFormat.DENSE


def expert_stored_nbytes(reader, layer: int, expert: int) -> int:
    """Bytes on disk of one routed expert: its three matrices with their scales."""
    return sum(reader.logical_stored_nbytes(expert_weight_name(layer, expert, w)) for w in MATRICES)


def fp4_to_fp8_block(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 e2m1 [N, K/2] with ue8m0 1x32 scales -> FP8 e4m3 [N, K] with ue8m0 128x128 scales.

    The block scale is 2^t with t = ceil(log2(amax / 448)) over the 128x128 block (the smallest
    power of two that keeps the block in range), and each value c·2^s is stored as c·2^(s-t) in e4m3.
    That is exact when s - t >= -8 for every non-zero element of the block (e4m3's smallest step is
    2^-9 and every e2m1 value is a multiple of 0.5); an element of a 32-group whose scale sits more than
    8 powers of two below the block's top loses low bits (rounded to nearest even, error at most
    2^(t-10)) or flushes to zero. docs/checkpoints.md states the bound.
    """
    dense = dequantize_fp4(packed, scale, torch.float32)  # [N, K], one matrix at a time
    return quantize_fp8_block(dense, FP8_KERNEL_BLOCK)


def _matrix_in(reader, name: str, fmt: ResidentFormat, dense_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One expert matrix from the checkpoint in the resident format: (w, s) or (dense,)."""
    raw = reader.load_quantized(name)
    if fmt is ResidentFormat.DENSE:
        if raw.storage is StorageKind.FP4_BLOCK:
            return (dequantize_fp4(raw.weight, raw.scale, dense_dtype),)
        if raw.storage is StorageKind.FP8_BLOCK:
            return (dequantize_fp8_block(raw.weight, raw.scale, dense_dtype, raw.block_size),)
        return (raw.weight if dense_dtype is None else raw.weight.to(dense_dtype),)
    if fmt is ResidentFormat.FP4:
        return raw.weight.view(torch.uint8), raw.scale.view(torch.uint8)
    # FP8 resident
    if raw.storage is StorageKind.FP8_BLOCK:
        if tuple(raw.block_size) != FP8_KERNEL_BLOCK:
            w, s = quantize_fp8_block(dequantize_fp8_block(raw.weight, raw.scale, torch.float32, raw.block_size),
                                      FP8_KERNEL_BLOCK)
            return w, s.view(torch.uint8)
        return raw.weight, raw.scale.view(torch.uint8)
    if raw.storage is StorageKind.FP4_BLOCK:
        w, s = fp4_to_fp8_block(raw.weight, raw.scale)
        return w, s.view(torch.uint8)
    w, s = quantize_fp8_block(raw.weight.to(torch.float32), FP8_KERNEL_BLOCK)  # a float checkpoint: lossy
    return w, s.view(torch.uint8)


def _stack_shapes(config, fmt: ResidentFormat) -> list[tuple[tuple[int, int], torch.dtype]]:
    """(shape, dtype) of one expert's slot in each of the six stacks w1, s1, w2, s2, w3, s3."""
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    out = []
    for num_out, num_in in ((inter, hidden), (hidden, inter), (inter, hidden)):
        if fmt is ResidentFormat.FP4:
            out += [((num_out, num_in // 2), torch.uint8), ((num_out, num_in // 32), torch.uint8)]
        else:
            grid = (-(-num_out // FP8_KERNEL_BLOCK[0]), -(-num_in // FP8_KERNEL_BLOCK[1]))
            out += [((num_out, num_in), torch.float8_e4m3fn), (grid, torch.uint8)]
    return out


def _checked_copy(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(source.shape) != tuple(target.shape) or source.dtype != target.dtype:
        raise CheckpointError(f"{name}: read {source.dtype} {list(source.shape)}, the expert stack needs "
                              f"{target.dtype} {list(target.shape)}")
    target.copy_(source)


ExpertSource = Callable[[int, int], Sequence[torch.Tensor] | None]  # (layer, expert) -> six held tensors or None


def build_layer_stack(reader, config, layer: int, expert_ids: Sequence[int], fmt: ResidentFormat,
                      device: torch.device, held: ExpertSource | None = None,
                      prefix: str = "layers.") -> tuple[torch.Tensor, ...]:
    """(w1, s1, w2, s2, w3, s3) stacked over `expert_ids` (ascending) on `device`.

    Each stack is allocated once; an expert already held elsewhere (`held(layer, e)`: its six slot
    tensors) is copied from there, any other is read from the checkpoint one matrix at a time."""
    shapes = _stack_shapes(config, fmt)
    stacks = [torch.empty((len(expert_ids), *shape), dtype=dtype, device=device) for shape, dtype in shapes]
    for slot, expert in enumerate(expert_ids):
        existing = held(layer, expert) if held is not None else None
        if existing is not None:
            for stack, tensor in zip(stacks, existing):
                stack[slot].copy_(tensor)
            continue
        for index, which in enumerate(MATRICES):
            name = expert_weight_name(layer, expert, which, prefix)
            weight, scale = _matrix_in(reader, name, fmt, None)
            _checked_copy(stacks[2 * index][slot], weight, name)
            _checked_copy(stacks[2 * index + 1][slot], scale, name.removesuffix(".weight") + ".scale")
    return tuple(stacks)


def read_dense_experts(reader, pairs: Iterable[tuple[int, int]], dtype: torch.dtype | None,
                       device: torch.device) -> dict[tuple[int, int], DenseWeights]:
    """{(layer, expert): (w1, w2, w3)} dense on `device`; dtype None keeps a float checkpoint's own dtype
    (quantized storage is then dequantized to bfloat16)."""
    out = {}
    for layer, expert in pairs:
        matrices = []
        for which in MATRICES:
            name = expert_weight_name(layer, expert, which)
            stored_float = reader.stored_kind(name) is StorageKind.FLOAT
            target = dtype if dtype is not None or stored_float else torch.bfloat16
            (matrix,) = _matrix_in(reader, name, ResidentFormat.DENSE, target)
            matrices.append(matrix.to(device).contiguous())
        out[(layer, expert)] = tuple(matrices)
    return out


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's stack must hold after a load or a drop."""

    layer: int
    expert_ids: tuple[int, ...]


def plan_layers(pairs: Iterable[tuple[int, int]]) -> list[LayerPlan]:
    by_layer: dict[int, set[int]] = {}
    for layer, expert in pairs:
        by_layer.setdefault(int(layer), set()).add(int(expert))
    return [LayerPlan(layer, tuple(sorted(ids))) for layer, ids in sorted(by_layer.items())]


def held_slot_source(layers: Mapping[int, object]) -> ExpertSource:
    """An `ExpertSource` over `QuantizedRoutedExperts._layers` ({layer: _LayerExperts})."""

    def source(layer: int, expert: int):
        held = layers.get(layer)
        if held is None or expert not in held.expert_ids:
            return None
        index = held.expert_ids.index(expert)
        return tuple(t[index] for t in (held.w1, held.s1, held.w2, held.s2, held.w3, held.s3))

    return source
