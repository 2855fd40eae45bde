"""What a hub-format DeepSeek-V4 checkpoint holds for a given config (docs/model.md §4.2).

`tensor_inventory(config)` lists every *logical* tensor under its hub name (the official
`inference/` names: `layers.{i}.attn.wq_a.weight`, no `model.` prefix). A quantized logical
tensor is stored as two safetensors entries: the `.weight` (FP8 e4m3 or packed FP4) and its
`.scale` (ue8m0). `TensorSpec.stored_entries()` gives those entries with the exact shape and
safetensors dtype string a valid checkpoint must have, which is what the reader validates
against and what the writer produces.

This module does not import torch: dtypes are safetensors dtype strings (`"BF16"`, `"F8_E4M3"`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moemesh.common.model.config import AttentionKind, ConfigError, ModelConfig, RouterKind

FP4_BLOCK_SIZE = 32


class StorageKind(enum.Enum):
    """How a logical tensor is stored on disk."""

    FP8_BLOCK = "fp8"  # float8_e4m3fn weight + float8_e8m0fnu scale per 2-D block
    FP4_BLOCK = "fp4"  # int8 weight (two e2m1 per byte, low nibble first) + e8m0 scale per 32 inputs
    FLOAT = "float"  # unquantized linear of a non-quantized checkpoint: BF16, F16 or F32
    BF16 = "bf16"
    F32 = "f32"
    I64 = "i64"


class ParamGroup(enum.Enum):
    """Accounting groups used by `moemesh check-model` (docs/model.md §8 table rows)."""

    EMBED = "embed"
    HEAD = "head"  # head.weight and the final norm
    ATTENTION = "attention"  # attention linears, norms, sinks
    COMPRESSOR = "compressor"
    INDEXER = "indexer"
    HC = "hc"
    ROUTER = "router"  # gate weight, bias, tid2eid
    SHARED_EXPERT = "shared_expert"
    ROUTED_EXPERT = "routed_expert"
    MTP = "mtp"  # everything under mtp.* (plain MTP block or DSpark stages)


SAFETENSORS_DTYPE_BYTES: dict[str, int] = {
    "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4,
}
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_SINGLE_DTYPE = {StorageKind.BF16: "BF16", StorageKind.F32: "F32", StorageKind.I64: "I64"}


@dataclass(frozen=True)
class StoredEntry:
    """One safetensors entry: name, exact shape, accepted dtype strings (first = what we write)."""

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of the checkpoint.

    `shape` is the logical (dequantized) shape. `layer` is the main-model layer (None for
    top-level and `mtp.*` tensors), `mtp_block` the `mtp.{j}` index, `expert` the routed-expert
    index (only for routed experts, always with `layer`). `block_size` is the quantization block
    (rows, cols) for FP8/FP4 storage and None otherwise.
    """

    name: str
    shape: tuple[int, ...]
    storage: StorageKind
    group: ParamGroup
    layer: int | None = None
    expert: int | None = None
    mtp_block: int | None = None
    block_size: tuple[int, int] | None = None

    @property
    def is_quantized(self) -> bool:
        return self.storage in (StorageKind.FP8_BLOCK, StorageKind.FP4_BLOCK)

    @property
    def is_routed_expert(self) -> bool:
        return self.expert is not None

    @property
    def is_mtp(self) -> bool:
        return self.mtp_block is not None

    @property
    def is_attention_side(self) -> bool:
        """Everything the attention worker loads: not a routed expert, not `mtp.*`."""
        return not self.is_routed_expert and not self.is_mtp

    @property
    def scale_name(self) -> str | None:
        if not self.is_quantized:
            return None
        return self.name.removesuffix(".weight") + ".scale"

    @property
    def num_params(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def stored_entries(self) -> tuple[StoredEntry, ...]:
        """The safetensors entries of this tensor (weight first, then its scale if quantized)."""
        if self.storage is StorageKind.FP8_BLOCK:
            rows, cols = self.shape
            block_rows, block_cols = self.block_size
            grid = (-(-rows // block_rows), -(-cols // block_cols))
            return (
                StoredEntry(self.name, self.shape, ("F8_E4M3",)),
                StoredEntry(self.scale_name, grid, ("F8_E8M0",)),
            )
        if self.storage is StorageKind.FP4_BLOCK:
            rows, cols = self.shape
            return (
                StoredEntry(self.name, (rows, cols // 2), ("I8",)),
                StoredEntry(self.scale_name, (rows, cols // self.block_size[1]), ("F8_E8M0",)),
            )
        if self.storage is StorageKind.FLOAT:
            return (StoredEntry(self.name, self.shape, _FLOAT_DTYPES),)
        return (StoredEntry(self.name, self.shape, (_SINGLE_DTYPE[self.storage],)),)

    @property
    def num_bytes(self) -> int:
        """Bytes on disk as we write it (FLOAT linears counted as BF16)."""
        total = 0
        for entry in self.stored_entries():
            count = 1
            for size in entry.shape:
                count *= size
            total += count * SAFETENSORS_DTYPE_BYTES[entry.dtypes[0]]
        return total


class _Builder:
    """Collects TensorSpecs for one config; `linear()` picks the storage from the config."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.specs: dict[str, TensorSpec] = {}
        self.fp8_block_size = None if config.fp8_block_size is None else tuple(config.fp8_block_size)
        self.expert_storage, self.expert_block_size = _expert_storage(config, self.fp8_block_size)

    def add(self, name: str, shape: tuple[int, ...], storage: StorageKind, group: ParamGroup, **where) -> None:
        if name in self.specs:
            raise AssertionError(f"inventory lists {name} twice")
        block = None
        if storage is StorageKind.FP8_BLOCK:
            block = self.fp8_block_size
        elif storage is StorageKind.FP4_BLOCK:
            block = (1, FP4_BLOCK_SIZE)
        self.specs[name] = TensorSpec(name, tuple(shape), storage, group, block_size=block, **where)

    def linear(self, name: str, shape: tuple[int, int], group: ParamGroup, **where) -> None:
        """A dense linear weight: FP8 with `.scale` when the checkpoint is quantized."""
        storage = StorageKind.FLOAT if self.fp8_block_size is None else StorageKind.FP8_BLOCK
        self.add(name, shape, storage, group, **where)


def _expert_storage(config: ModelConfig, fp8_block_size) -> tuple[StorageKind, tuple[int, int] | None]:
    """Routed experts: FP4 (V4-Flash), FP8 blocks (V4-Base) or plain floats."""
    expert_dtype = config.expert_dtype
    if expert_dtype == "fp4":
        return StorageKind.FP4_BLOCK, (1, FP4_BLOCK_SIZE)
    if expert_dtype == "fp8":
        if fp8_block_size is None:
            raise ConfigError("expert_dtype='fp8' needs quantization_config.weight_block_size")
        return StorageKind.FP8_BLOCK, fp8_block_size
    if expert_dtype == "bf16":
        return StorageKind.FLOAT, None
    raise ConfigError(f"expert_dtype={expert_dtype!r} is not one of fp4, fp8, bf16")


def _add_block(b: _Builder, prefix: str, kind: AttentionKind, router: RouterKind, group_of, where: dict) -> None:
    """One transformer block's tensors under `prefix` (`layers.{i}.` or `mtp.{j}.`).

    `group_of(default_group)` maps a group to the one to record (everything is MTP under mtp.*).
    """
    c = b.config
    hidden, head_dim, num_heads = c.hidden_size, c.head_dim, c.num_attention_heads
    num_hc_mix = (2 + c.hc_mult) * c.hc_mult  # pre + post + comb rows
    for site in ("attn", "ffn"):
        b.add(f"{prefix}hc_{site}_fn", (num_hc_mix, c.hc_mult * hidden), StorageKind.F32, group_of(ParamGroup.HC), **where)
        b.add(f"{prefix}hc_{site}_base", (num_hc_mix,), StorageKind.F32, group_of(ParamGroup.HC), **where)
        b.add(f"{prefix}hc_{site}_scale", (3,), StorageKind.F32, group_of(ParamGroup.HC), **where)
    attn = group_of(ParamGroup.ATTENTION)
    b.add(f"{prefix}attn_norm.weight", (hidden,), StorageKind.BF16, attn, **where)
    b.add(f"{prefix}ffn_norm.weight", (hidden,), StorageKind.BF16, attn, **where)
    b.add(f"{prefix}attn.attn_sink", (num_heads,), StorageKind.F32, attn, **where)
    b.linear(f"{prefix}attn.wq_a.weight", (c.q_lora_rank, hidden), attn, **where)
    b.add(f"{prefix}attn.q_norm.weight", (c.q_lora_rank,), StorageKind.BF16, attn, **where)
    b.linear(f"{prefix}attn.wq_b.weight", (num_heads * head_dim, c.q_lora_rank), attn, **where)
    b.linear(f"{prefix}attn.wkv.weight", (head_dim, hidden), attn, **where)
    b.add(f"{prefix}attn.kv_norm.weight", (head_dim,), StorageKind.BF16, attn, **where)
    group_in = num_heads * head_dim // c.o_groups
    b.linear(f"{prefix}attn.wo_a.weight", (c.o_groups * c.o_lora_rank, group_in), attn, **where)
    b.linear(f"{prefix}attn.wo_b.weight", (hidden, c.o_groups * c.o_lora_rank), attn, **where)

    if kind is not AttentionKind.WINDOW:
        ratio = c.csa_compress_ratio if kind is AttentionKind.CSA else c.hca_compress_ratio
        overlap = 2 if kind is AttentionKind.CSA else 1  # CSA pools two half-windows
        comp = group_of(ParamGroup.COMPRESSOR)
        width = overlap * head_dim
        b.add(f"{prefix}attn.compressor.wkv.weight", (width, hidden), StorageKind.BF16, comp, **where)
        b.add(f"{prefix}attn.compressor.wgate.weight", (width, hidden), StorageKind.BF16, comp, **where)
        b.add(f"{prefix}attn.compressor.ape", (ratio, width), StorageKind.F32, comp, **where)
        b.add(f"{prefix}attn.compressor.norm.weight", (head_dim,), StorageKind.BF16, comp, **where)
    if kind is AttentionKind.CSA:
        idx = group_of(ParamGroup.INDEXER)
        index_width = 2 * c.index_head_dim
        b.linear(f"{prefix}attn.indexer.wq_b.weight", (c.index_n_heads * c.index_head_dim, c.q_lora_rank), idx, **where)
        b.add(f"{prefix}attn.indexer.weights_proj.weight", (c.index_n_heads, hidden), StorageKind.BF16, idx, **where)
        b.add(f"{prefix}attn.indexer.compressor.wkv.weight", (index_width, hidden), StorageKind.BF16, idx, **where)
        b.add(f"{prefix}attn.indexer.compressor.wgate.weight", (index_width, hidden), StorageKind.BF16, idx, **where)
        b.add(f"{prefix}attn.indexer.compressor.ape", (c.csa_compress_ratio, index_width), StorageKind.F32, idx, **where)
        b.add(f"{prefix}attn.indexer.compressor.norm.weight", (c.index_head_dim,), StorageKind.BF16, idx, **where)

    router_group = group_of(ParamGroup.ROUTER)
    b.add(f"{prefix}ffn.gate.weight", (c.n_routed_experts, hidden), StorageKind.BF16, router_group, **where)
    if router is RouterKind.HASH:
        b.add(f"{prefix}ffn.gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), StorageKind.I64, router_group, **where)
    else:
        b.add(f"{prefix}ffn.gate.bias", (c.n_routed_experts,), StorageKind.F32, router_group, **where)

    inter = c.moe_intermediate_size
    routed = group_of(ParamGroup.ROUTED_EXPERT)
    for expert in range(c.n_routed_experts):
        for proj, shape in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))):
            b.add(f"{prefix}ffn.experts.{expert}.{proj}.weight", shape, b.expert_storage, routed, expert=expert, **where)
    if c.n_shared_experts:
        shared_inter = inter * c.n_shared_experts  # the reference has exactly one shared expert
        shared = group_of(ParamGroup.SHARED_EXPERT)
        b.linear(f"{prefix}ffn.shared_experts.w1.weight", (shared_inter, hidden), shared, **where)
        b.linear(f"{prefix}ffn.shared_experts.w2.weight", (hidden, shared_inter), shared, **where)
        b.linear(f"{prefix}ffn.shared_experts.w3.weight", (shared_inter, hidden), shared, **where)


def _add_hc_head(b: _Builder, prefix: str, group: ParamGroup, **where) -> None:
    c = b.config
    b.add(f"{prefix}hc_head_fn", (c.hc_mult, c.hc_mult * c.hidden_size), StorageKind.F32, group, **where)
    b.add(f"{prefix}hc_head_base", (c.hc_mult,), StorageKind.F32, group, **where)
    b.add(f"{prefix}hc_head_scale", (1,), StorageKind.F32, group, **where)


def _add_mtp(b: _Builder) -> None:
    """`mtp.*`: the plain MTP block(s) or, with `config.dspark`, the DSpark stages (docs/speculation.md §3)."""
    c = b.config
    num_blocks = c.num_nextn_predict_layers or 0
    hidden, mtp = c.hidden_size, ParamGroup.MTP
    for j in range(num_blocks):
        prefix, where = f"mtp.{j}.", {"mtp_block": j}
        _add_block(b, prefix, AttentionKind.WINDOW, RouterKind.LEARNED, lambda _group: mtp, where)
        if c.dspark is None:
            b.linear(f"{prefix}e_proj.weight", (hidden, hidden), mtp, **where)
            b.linear(f"{prefix}h_proj.weight", (hidden, hidden), mtp, **where)
            b.add(f"{prefix}enorm.weight", (hidden,), StorageKind.BF16, mtp, **where)
            b.add(f"{prefix}hnorm.weight", (hidden,), StorageKind.BF16, mtp, **where)
            b.add(f"{prefix}norm.weight", (hidden,), StorageKind.BF16, mtp, **where)
            _add_hc_head(b, prefix, mtp, **where)
            continue
        if j == 0:
            num_features = len(c.dspark.target_layer_ids) * hidden
            b.linear(f"{prefix}main_proj.weight", (hidden, num_features), mtp, **where)
            b.add(f"{prefix}main_norm.weight", (hidden,), StorageKind.BF16, mtp, **where)
        if j == num_blocks - 1:
            rank = c.dspark.markov_rank
            b.add(f"{prefix}norm.weight", (hidden,), StorageKind.BF16, mtp, **where)
            _add_hc_head(b, prefix, mtp, **where)
            b.add(f"{prefix}markov_head.markov_w1.weight", (c.vocab_size, rank), StorageKind.BF16, mtp, **where)
            b.add(f"{prefix}markov_head.markov_w2.weight", (c.vocab_size, rank), StorageKind.BF16, mtp, **where)
            b.add(f"{prefix}confidence_head.proj.weight", (1, hidden + rank), StorageKind.BF16, mtp, **where)


def tensor_inventory(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every logical tensor a hub checkpoint holds for `config`, keyed by hub name, in file order
    (embed, layers 0.., head/norm/hc_head, mtp.*)."""
    b = _Builder(config)
    b.add("embed.weight", (config.vocab_size, config.hidden_size), StorageKind.BF16, ParamGroup.EMBED)
    for layer in range(config.num_hidden_layers):
        where = {"layer": layer}
        kind, router = config.layer_types[layer], config.mlp_layer_types[layer]
        _add_block(b, f"layers.{layer}.", kind, router, lambda group: group, where)
    b.add("head.weight", (config.vocab_size, config.hidden_size), StorageKind.BF16, ParamGroup.HEAD)
    b.add("norm.weight", (config.hidden_size,), StorageKind.BF16, ParamGroup.HEAD)
    _add_hc_head(b, "", ParamGroup.HC)
    _add_mtp(b)
    return b.specs


def stored_name_index(inventory: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
    """safetensors entry name (weights and scales) -> the logical TensorSpec it belongs to."""
    index: dict[str, TensorSpec] = {}
    for spec in inventory.values():
        for entry in spec.stored_entries():
            index[entry.name] = spec
    return index
