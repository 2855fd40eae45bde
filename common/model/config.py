"""DeepSeek-V4 model configuration: one frozen dataclass read from either config form.

Two spellings of the same model exist (docs/model.md §1, §5.2):
- the hub `config.json` ("legacy" keys: `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
  `rope_scaling`, `expert_dtype`, `quantization_config`, `dspark_*`), and
- transformers' `DeepseekV4Config` (`layer_types`, `mlp_layer_types`, `compress_rates`,
  `rope_parameters`, `partial_rotary_factor`).
`ModelConfig.from_dict` accepts both (mixed, too) and normalises them to one value, so the two forms
of one model compare equal. Values the model code cannot run raise `ConfigError` naming key and value.
Keys without architectural effect (`architectures`, `topk_method`, `initializer_range`, ...) are ignored.

Missing keys take transformers 5.23.0 defaults, which are V4-Flash's values except the attention
schedule (transformers defaults to a V4-Pro-like HCA/CSA pattern) and YaRN (absent unless given).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Hub `compress_ratios` codes; the real CSA/HCA rates may be overridden (`compress_rate_csa/_hca`).
_RATIO_CODE_WINDOW = 0
_RATIO_CODE_CSA = 4
_RATIO_CODE_HCA = 128


class ConfigError(ValueError):
    """A config value this implementation does not support; the message names key and value."""


class AttentionKind(enum.Enum):
    WINDOW = "sliding_attention"
    CSA = "compressed_sparse_attention"
    HCA = "heavily_compressed_attention"


class RouterKind(enum.Enum):
    HASH = "hash_moe"
    LEARNED = "moe"


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency scaling for compressed (CSA/HCA) layers only; no attention mscale (factor 1)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSparkConfig:
    """Drafter settings carried by `-0731`-style checkpoints (docs/speculation.md §3)."""

    block_size: int
    markov_rank: int
    target_layer_ids: tuple[int, ...]
    noise_token_id: int


@dataclass(frozen=True)
class NumericsConfig:
    """Numerical choices. The default reproduces transformers 5.23.0 (docs/model.md §6); each switch below,
    set the other way, gives one behaviour of the official reference (`reference()` sets all three).

    dtype: activation/weight dtype name ("float32" on CPU for exact comparison, "bfloat16" on GPU).
    shared_expert_clamp: transformers clamps the shared expert's SwiGLU like the routed ones (gate
        <= swiglu_limit, up within ±swiglu_limit); the reference does not (False = reference).
        Changes outputs only where a shared-expert pre-activation exceeds the limit.
    route_weight_before_w2: the reference multiplies the routing weight into the SwiGLU output
        before `w2`, transformers after `w2` (True = reference). Equal in exact arithmetic; differs
        by rounding only. `RoutedExperts.from_config` reads it; expert workers take it as
        `ExpertWorkerConfig.route_weight_before_w2`, which their launcher must set to match.
    kv_fp8_qat: the reference's FP8 e4m3 quant-dequant (block 64, power-of-two scale) of the first
        `nope_head_dim` channels of every window kv row and main-compressor row, after norm and
        RoPE (True = reference; `common.model.qat`), and of every CSA indexer row (one power-of-two scale per
        row, `qat.indexer_fp8_qat`: the values an FP8 indexer row stores).
    """

    dtype: str = "float32"
    shared_expert_clamp: bool = True
    route_weight_before_w2: bool = False
    kv_fp8_qat: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of float32, bfloat16, float16")

    @classmethod
    def reference(cls, dtype: str = "float32") -> "NumericsConfig":
        """All three reference switches on (no shared-expert clamp, weight before w2, KV FP8 QAT)."""
        return cls(dtype=dtype, shared_expert_clamp=False, route_weight_before_w2=True, kv_fp8_qat=True)

    def torch_dtype(self):  # -> torch.dtype; torch imported lazily so config stays torch-free
        import torch

        return getattr(torch, self.dtype)


def resolve_dtype(dtype: str, device: str):  # -> torch.dtype; torch imported lazily
    """The compute dtype a deployment's `dtype` names on `device`: "auto" is float32 on the CPU and
    bfloat16 elsewhere; float32, bfloat16 and float16 name themselves."""
    import torch

    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not auto, float32, bfloat16 or float16")
    return getattr(torch, dtype)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnConfig | None
    layer_types: tuple[AttentionKind, ...]
    mlp_layer_types: tuple[RouterKind, ...]
    csa_compress_ratio: int
    hca_compress_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_id: int | None
    max_position_embeddings: int
    num_nextn_predict_layers: int
    fp8_block_size: tuple[int, int] | None  # None: non-quantized checkpoint
    expert_dtype: str  # "fp4" | "fp8" | "bf16"
    dspark: DSparkConfig | None
    tie_word_embeddings: bool = False
    # Hub `compress_ratios` entries past the main layers (MTP / DSpark blocks), kept for round trips.
    extra_compress_ratios: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        _validate(self)

    # ----------------------------------------------------------------------------- queries
    def compress_ratio(self, layer: int) -> int | None:
        """Tokens per compressed row on `layer`; None for window-only layers."""
        kind = self.layer_types[layer]
        if kind is AttentionKind.CSA:
            return self.csa_compress_ratio
        if kind is AttentionKind.HCA:
            return self.hca_compress_ratio
        return None

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_hc_mix(self) -> int:
        """Width of one mHC projection: pre (n) + post (n) + comb (n*n)."""
        return (2 + self.hc_mult) * self.hc_mult

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """Read a checkpoint directory's `config.json` (or a config file path)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        from moemesh.common.model.config_parse import parse_config_dict

        return parse_config_dict(d)

    # ----------------------------------------------------------------------------- writing
    def to_hub_dict(self) -> dict[str, Any]:
        from moemesh.common.model.config_parse import config_to_hub_dict

        return config_to_hub_dict(self)

    def to_transformers_dict(self) -> dict[str, Any]:
        from moemesh.common.model.config_parse import config_to_transformers_dict

        return config_to_transformers_dict(self)


def _validate(c: ModelConfig) -> None:
    """Constraints the model code relies on (docs/model.md §7.2). Raises ConfigError naming the key."""

    def fail(message: str) -> None:
        raise ConfigError(message)

    for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
        "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
        "sliding_window", "csa_compress_ratio", "hca_compress_ratio", "index_n_heads", "index_head_dim",
        "index_topk", "hc_mult", "hc_sinkhorn_iters",
    ):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            fail(f"{name}={value!r} must be a positive integer")
    if c.num_attention_heads % c.o_groups:
        fail(f"num_attention_heads={c.num_attention_heads} is not divisible by o_groups={c.o_groups}")
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim < c.head_dim:
        fail(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even and in (0, head_dim={c.head_dim})")
    if c.index_head_dim < c.qk_rope_head_dim:
        fail(f"index_head_dim={c.index_head_dim} must be >= qk_rope_head_dim={c.qk_rope_head_dim}")
    if c.num_experts_per_tok > c.n_routed_experts:
        fail(f"num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_shared_experts != 1:
        fail(f"n_shared_experts={c.n_shared_experts} must be 1")
    if c.scoring_func != "sqrtsoftplus":
        fail(f"scoring_func={c.scoring_func!r} is not supported (only 'sqrtsoftplus')")
    if len(c.layer_types) != c.num_hidden_layers:
        fail(f"layer_types has {len(c.layer_types)} entries, num_hidden_layers={c.num_hidden_layers}")
    if len(c.mlp_layer_types) != c.num_hidden_layers:
        fail(f"mlp_layer_types has {len(c.mlp_layer_types)} entries, num_hidden_layers={c.num_hidden_layers}")
    if not all(isinstance(k, AttentionKind) for k in c.layer_types):
        fail(f"layer_types={c.layer_types!r} must hold AttentionKind values")
    if not all(isinstance(k, RouterKind) for k in c.mlp_layer_types):
        fail(f"mlp_layer_types={c.mlp_layer_types!r} must hold RouterKind values")
    if c.expert_dtype not in ("fp4", "fp8", "bf16"):
        fail(f"expert_dtype={c.expert_dtype!r} is not one of fp4, fp8, bf16")
    if c.fp8_block_size is not None and (len(c.fp8_block_size) != 2 or min(c.fp8_block_size) < 1):
        fail(f"quantization_config.weight_block_size={list(c.fp8_block_size)!r} must be two positive ints")
    for index, ratio in enumerate(c.extra_compress_ratios):
        if ratio not in (_RATIO_CODE_WINDOW, _RATIO_CODE_CSA, _RATIO_CODE_HCA):
            fail(f"compress_ratios[{c.num_hidden_layers + index}]={ratio} is not one of 0, 4, 128")
    if c.dspark is not None:
        for layer in c.dspark.target_layer_ids:
            if not 0 <= layer < c.num_hidden_layers:
                fail(f"dspark_target_layer_ids entry {layer} is not a main layer")
