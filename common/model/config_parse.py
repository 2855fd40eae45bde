"""Reading and writing `ModelConfig` in its two dict forms (hub `config.json`, transformers kwargs).

Kept apart from `config.py` so the dataclass file stays a readable list of fields. Precedence follows
transformers 5.23.0's `DeepseekV4Config.__post_init__`: explicit `layer_types` > legacy
`compress_ratios`; explicit `mlp_layer_types` > `num_hash_layers`; `compress_rates` overridden by the
scalar `compress_rate_csa` / `compress_rate_hca`; `partial_rotary_factor` > `qk_rope_head_dim`.
"""

from __future__ import annotations

import enum
from typing import Any

from moemesh.common.model.config import (
    _RATIO_CODE_CSA,
    _RATIO_CODE_HCA,
    _RATIO_CODE_WINDOW,
    AttentionKind,
    ConfigError,
    DSparkConfig,
    ModelConfig,
    RouterKind,
    YarnConfig,
)

_CODE_TO_KIND = {
    _RATIO_CODE_WINDOW: AttentionKind.WINDOW,
    _RATIO_CODE_CSA: AttentionKind.CSA,
    _RATIO_CODE_HCA: AttentionKind.HCA,
}
_KIND_TO_CODE = {kind: code for code, kind in _CODE_TO_KIND.items()}

# transformers 5.23.0 DeepseekV4Config defaults (V4-Flash values).
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1.0e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1.0e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
_DEFAULT_NUM_HASH_LAYERS = 3


def _get(d: dict[str, Any], key: str) -> Any:
    value = d.get(key)
    return _DEFAULTS[key] if value is None else value


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ConfigError(f"{key}={value!r} must be an integer")
    return int(value)


def _parse_layer_types(d: dict[str, Any], num_layers: int) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
    """Returns (main-layer kinds, extra hub ratio codes past the main layers)."""
    legacy = d.get("compress_ratios")
    extra: tuple[int, ...] = ()
    if legacy is not None:
        for index, code in enumerate(legacy):
            if code not in _CODE_TO_KIND:
                raise ConfigError(f"compress_ratios[{index}]={code!r} is not one of 0, 4, 128")
        if len(legacy) < num_layers:
            raise ConfigError(f"compress_ratios has {len(legacy)} entries, num_hidden_layers={num_layers}")
        extra = tuple(int(code) for code in legacy[num_layers:])
    explicit = d.get("layer_types")
    if explicit is not None:
        return _parse_kinds("layer_types", explicit, AttentionKind)[:num_layers], extra
    if legacy is not None:
        return tuple(_CODE_TO_KIND[code] for code in legacy[:num_layers]), extra
    # transformers' default: two HCA bootstrap layers, then HCA/CSA alternating (V4-Pro-like).
    kinds = [AttentionKind.HCA] * min(num_layers, 2)
    kinds += [AttentionKind.CSA if i % 2 else AttentionKind.HCA for i in range(max(num_layers - 2, 0))]
    return tuple(kinds), extra


def _parse_kinds(field: str, names: list, kind_enum: type[enum.Enum]) -> tuple:
    """A config list of enum values -> the enum members; ConfigError naming the first unknown one."""
    kinds = []
    for index, name in enumerate(names):
        try:
            kinds.append(kind_enum(name))
        except ValueError:
            allowed = ", ".join(kind.value for kind in kind_enum)
            raise ConfigError(f"{field}[{index}]={name!r} is not one of {allowed}") from None
    return tuple(kinds)


def _parse_mlp_layer_types(d: dict[str, Any], num_layers: int) -> tuple[RouterKind, ...]:
    explicit = d.get("mlp_layer_types")
    if explicit is not None:
        return _parse_kinds("mlp_layer_types", explicit, RouterKind)[:num_layers]
    num_hash = d.get("num_hash_layers")
    num_hash = _DEFAULT_NUM_HASH_LAYERS if num_hash is None else _as_int("num_hash_layers", num_hash)
    if num_hash < 0:
        raise ConfigError(f"num_hash_layers={num_hash} must be >= 0")
    return tuple([RouterKind.HASH] * min(num_layers, num_hash) + [RouterKind.LEARNED] * max(0, num_layers - num_hash))


def _parse_rates(d: dict[str, Any]) -> tuple[int, int]:
    rates = dict(d.get("compress_rates") or {})
    csa = rates.get(AttentionKind.CSA.value, _RATIO_CODE_CSA)
    hca = rates.get(AttentionKind.HCA.value, _RATIO_CODE_HCA)
    if d.get("compress_rate_csa") is not None:
        csa = d["compress_rate_csa"]
    if d.get("compress_rate_hca") is not None:
        hca = d["compress_rate_hca"]
    return _as_int("compress_rates.csa", csa), _as_int("compress_rates.hca", hca)


def _parse_yarn(raw: dict[str, Any] | None, key: str) -> YarnConfig | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ConfigError(f"{key}.type={rope_type!r} is not supported (only 'yarn')")
    attention_factor = raw.get("attention_factor")
    if attention_factor is not None and attention_factor != 1.0:
        raise ConfigError(f"{key}.attention_factor={attention_factor!r} must be 1.0 (DeepSeek-V4 uses no mscale)")
    for name in ("factor", "original_max_position_embeddings"):
        if raw.get(name) is None:
            raise ConfigError(f"{key}.{name} is missing")
    return YarnConfig(
        factor=float(raw["factor"]),
        original_max_position_embeddings=_as_int(f"{key}.original_max_position_embeddings",
                                                 raw["original_max_position_embeddings"]),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
    )


def _parse_rope(d: dict[str, Any]) -> tuple[float, float, YarnConfig | None]:
    """(rope_theta, compress_rope_theta, yarn) from `rope_parameters` (nested or flat) or `rope_scaling`."""
    rope_theta = float(_get(d, "rope_theta"))
    compress_theta = float(_get(d, "compress_rope_theta"))
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ConfigError(f"rope_parameters.main.rope_type={main.get('rope_type')!r} must be 'default'")
        rope_theta = float(main.get("rope_theta", rope_theta))
        compress_theta = float(compress.get("rope_theta", compress_theta))
        return rope_theta, compress_theta, _parse_yarn(compress, "rope_parameters.compress")
    if isinstance(params, dict) and params:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        return rope_theta, compress_theta, _parse_yarn(flat, "rope_parameters")
    return rope_theta, compress_theta, _parse_yarn(d.get("rope_scaling"), "rope_scaling")


def _parse_rope_dim(d: dict[str, Any], head_dim: int) -> int:
    factor = d.get("partial_rotary_factor")
    if factor is not None:
        return int(head_dim * float(factor))
    value = d.get("qk_rope_head_dim")
    if value is not None:
        return _as_int("qk_rope_head_dim", value)
    return head_dim // 8  # transformers' default_partial_rotary_factor = 64 / 512


def _parse_quantization(d: dict[str, Any]) -> tuple[tuple[int, int] | None, str]:
    quant = d.get("quantization_config")
    expert_dtype = d.get("expert_dtype")
    block: tuple[int, int] | None = None
    if quant:
        method = quant.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (only 'fp8')")
        fmt = quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"quantization_config.fmt={fmt!r} is not supported (only 'e4m3')")
        raw_block = quant.get("weight_block_size") or [128, 128]
        if len(raw_block) != 2:
            raise ConfigError(f"quantization_config.weight_block_size={raw_block!r} must have two entries")
        block = (_as_int("weight_block_size[0]", raw_block[0]), _as_int("weight_block_size[1]", raw_block[1]))
        if expert_dtype is None:
            expert_dtype = quant.get("expert_dtype", "fp8")
    if expert_dtype is None:
        expert_dtype = "bf16"
    return block, str(expert_dtype)


def _parse_dspark(d: dict[str, Any]) -> DSparkConfig | None:
    keys = ("dspark_block_size", "dspark_markov_rank", "dspark_target_layer_ids", "dspark_noise_token_id")
    present = [key for key in keys if d.get(key) is not None]
    if not present:
        return None
    if len(present) != len(keys):
        missing = sorted(set(keys) - set(present))
        raise ConfigError(f"dspark config is incomplete: {', '.join(missing)} missing")
    return DSparkConfig(
        block_size=_as_int("dspark_block_size", d["dspark_block_size"]),
        markov_rank=_as_int("dspark_markov_rank", d["dspark_markov_rank"]),
        target_layer_ids=tuple(_as_int("dspark_target_layer_ids", v) for v in d["dspark_target_layer_ids"]),
        noise_token_id=_as_int("dspark_noise_token_id", d["dspark_noise_token_id"]),
    )


def _token_id(d: dict[str, Any], key: str) -> int | None:
    value = d.get(key, _DEFAULTS[key])
    if isinstance(value, list):  # transformers allows a list of eos ids; we keep the first
        value = value[0] if value else None
    return None if value is None else _as_int(key, value)


def parse_config_dict(d: dict[str, Any]) -> ModelConfig:
    """Both config forms (and mixtures) -> ModelConfig. Raises ConfigError naming key and value."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    if _get(d, "num_key_value_heads") != 1:
        raise ConfigError(f"num_key_value_heads={d['num_key_value_heads']!r} must be 1")
    if _get(d, "hidden_act") != "silu":
        raise ConfigError(f"hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    if _get(d, "norm_topk_prob") is not True:
        raise ConfigError(f"norm_topk_prob={d['norm_topk_prob']!r} is not supported (only true)")
    if d.get("n_group") not in (None, 1) or d.get("topk_group") not in (None, 1):
        raise ConfigError(f"n_group={d.get('n_group')!r}/topk_group={d.get('topk_group')!r}: group-limited routing is not supported")
    num_layers = _as_int("num_hidden_layers", _get(d, "num_hidden_layers"))
    head_dim = _as_int("head_dim", _get(d, "head_dim"))
    layer_types, extra = _parse_layer_types(d, num_layers)
    csa_rate, hca_rate = _parse_rates(d)
    rope_theta, compress_theta, yarn = _parse_rope(d)
    block, expert_dtype = _parse_quantization(d)
    ints = {
        name: _as_int(name, _get(d, name))
        for name in (
            "vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "o_groups", "o_lora_rank",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
            "max_position_embeddings", "num_nextn_predict_layers",
        )
    }
    return ModelConfig(
        **ints,
        num_hidden_layers=num_layers,
        head_dim=head_dim,
        qk_rope_head_dim=_parse_rope_dim(d, head_dim),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor")),
        swiglu_limit=float(_get(d, "swiglu_limit")),
        scoring_func=str(_get(d, "scoring_func")),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        layer_types=layer_types,
        mlp_layer_types=_parse_mlp_layer_types(d, num_layers),
        csa_compress_ratio=csa_rate,
        hca_compress_ratio=hca_rate,
        hc_eps=float(_get(d, "hc_eps")),
        rms_norm_eps=float(_get(d, "rms_norm_eps")),
        bos_token_id=_token_id(d, "bos_token_id"),
        eos_token_id=_token_id(d, "eos_token_id"),
        fp8_block_size=block,
        expert_dtype=expert_dtype,
        dspark=_parse_dspark(d),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings")),
        extra_compress_ratios=extra,
    )


_COMMON_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "routed_scaling_factor", "swiglu_limit", "scoring_func", "sliding_window",
    "rope_theta", "compress_rope_theta", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "bos_token_id", "eos_token_id", "max_position_embeddings",
    "num_nextn_predict_layers", "tie_word_embeddings",
)


def _yarn_dict(yarn: YarnConfig) -> dict[str, Any]:
    return {
        "type": "yarn",
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
    }


def config_to_hub_dict(c: ModelConfig) -> dict[str, Any]:
    """Legacy hub keys, as the real `config.json` spells them."""
    out: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
    }
    out.update({key: getattr(c, key) for key in _COMMON_KEYS})
    out["qk_rope_head_dim"] = c.qk_rope_head_dim
    out["compress_ratios"] = [_KIND_TO_CODE[kind] for kind in c.layer_types] + list(c.extra_compress_ratios)
    if c.csa_compress_ratio != _RATIO_CODE_CSA:
        out["compress_rate_csa"] = c.csa_compress_ratio
    if c.hca_compress_ratio != _RATIO_CODE_HCA:
        out["compress_rate_hca"] = c.hca_compress_ratio
    num_hash = sum(1 for kind in c.mlp_layer_types if kind is RouterKind.HASH)
    if c.mlp_layer_types != tuple([RouterKind.HASH] * num_hash + [RouterKind.LEARNED] * (len(c.mlp_layer_types) - num_hash)):
        raise ConfigError("mlp_layer_types with hash layers after learned ones cannot be written as num_hash_layers")
    out["num_hash_layers"] = num_hash
    if c.yarn is not None:
        out["rope_scaling"] = _yarn_dict(c.yarn)
    if c.fp8_block_size is not None:
        out["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": list(c.fp8_block_size),
        }
    out["expert_dtype"] = c.expert_dtype
    if c.dspark is not None:
        out["dspark_block_size"] = c.dspark.block_size
        out["dspark_markov_rank"] = c.dspark.markov_rank
        out["dspark_target_layer_ids"] = list(c.dspark.target_layer_ids)
        out["dspark_noise_token_id"] = c.dspark.noise_token_id
    return out


def config_to_transformers_dict(c: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for `transformers.DeepseekV4Config` (architecture only, no quantization)."""
    out: dict[str, Any] = {key: getattr(c, key) for key in _COMMON_KEYS}
    out["num_key_value_heads"] = 1
    out["layer_types"] = [kind.value for kind in c.layer_types]
    out["mlp_layer_types"] = [kind.value for kind in c.mlp_layer_types]
    out["compress_rates"] = {
        AttentionKind.CSA.value: c.csa_compress_ratio,
        AttentionKind.HCA.value: c.hca_compress_ratio,
    }
    rotary_factor = c.qk_rope_head_dim / c.head_dim
    out["partial_rotary_factor"] = rotary_factor
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": c.compress_rope_theta,
                                "partial_rotary_factor": rotary_factor}
    if c.yarn is not None:
        compress.update(
            rope_type="yarn",
            factor=c.yarn.factor,
            original_max_position_embeddings=c.yarn.original_max_position_embeddings,
            beta_fast=c.yarn.beta_fast,
            beta_slow=c.yarn.beta_slow,
            attention_factor=1.0,
        )
    out["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": rotary_factor},
        "compress": compress,
    }
    return out
