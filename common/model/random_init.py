"""Random DeepSeek-V4 layers at any width, built directly on the device in the checkpoint's formats.

For benchmarks and tests that need true V4-Flash sizes without a checkpoint: `random_model(config,
device)` returns an `AttentionSide` whose FP8 linears (attention, indexer `wq_b`, shared expert) are
`Fp8Linear`s and a `QuantizedRoutedExperts` with every layer's routed experts stacked in FP4 (or
FP8 when `config.expert_dtype == "fp8"`). Which tensors are FP8 comes from the checkpoint inventory
(`common.model.inventory`), so it matches what a real checkpoint stores; everything else has
the inventory's dtype at the activation dtype (bf16 tensors), fp32 where the model keeps fp32.

Fast by construction: FP8 bytes are drawn as e4m3 values of a normal distribution and FP4 bytes
as uniform random bytes (every e2m1 code), with power-of-two scales chosen so that each linear's
output keeps O(1) magnitude (weight std ≈ in_features^-1/2), all generated on the device. No float
weight is ever quantized. Paths transformers leaves inert (sinks, gate bias, ape, HC base/scale;
docs/model.md §7.4) are random too. Values are for timing and plumbing, not language modelling.

`fill_random_context` writes a random `num_tokens`-token history into a `SequenceState` through
the stores' own append methods (window ring, compressor inputs and rows), far faster than a
prefill; `PreallocatedRowStore` keeps compressed rows in one fixed tensor so that a decode step
allocates nothing that outlives it (needed for CUDA-graph capture).
Legend: E experts, N out features, K in features, V vocab, D hidden.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from moemesh.common.model.inventory import StorageKind, tensor_inventory
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.config import AttentionKind, ModelConfig, NumericsConfig
from moemesh.common.model.quantized import KernelBackend, swap_fp8_linears
from moemesh.common.model.quantized_experts import ExpertFormat, QuantizedRoutedExperts
from moemesh.common.model.state import SequenceState

_FP8_VALUE_STD = 32.0  # e4m3 values drawn N(0, 32²), clipped to ±448: uses most of the e4m3 range
_FP4_CODE_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # uniform codes
_UE8M0_BIAS = 127
_KIND_CODES = {AttentionKind.WINDOW: 0, AttentionKind.CSA: 4, AttentionKind.HCA: 128}
LAYER_KIND_NAMES = {"window": AttentionKind.WINDOW, "csa": AttentionKind.CSA, "hca": AttentionKind.HCA}


def flash_config(layer_kinds: list[AttentionKind] | tuple[AttentionKind, ...], **overrides: Any) -> ModelConfig:
    """V4-Flash at true width with the given attention layers (learned routers everywhere;
    docs/model.md §1.1 values from `presets`). `overrides` are hub config keys."""
    from moemesh.common.model.presets import v4_flash_hub_dict

    d = v4_flash_hub_dict()
    d.update(num_hidden_layers=len(layer_kinds), compress_ratios=[_KIND_CODES[k] for k in layer_kinds],
             num_hash_layers=0, num_nextn_predict_layers=0)
    d.update(overrides)
    return ModelConfig.from_dict(d)


def tiny_flash_like_config(layer_kinds: list[AttentionKind] | tuple[AttentionKind, ...],
                           kernel_friendly: bool = False, **overrides: Any) -> ModelConfig:
    """A small model with the same structure, for CPU runs of the benchmark and tests.

    kernel_friendly: widths that are multiples of 128 (what the Triton kernels need at K).
    `overrides`: hub config keys applied last."""
    wide = 256 if kernel_friendly else 64
    settings = dict(
        vocab_size=512, hidden_size=wide, moe_intermediate_size=128 if kernel_friendly else 32,
        num_attention_heads=4, head_dim=128 if kernel_friendly else 32, qk_rope_head_dim=16 if kernel_friendly else 8,
        q_lora_rank=128 if kernel_friendly else 32, o_groups=2, o_lora_rank=128 if kernel_friendly else 16,
        n_routed_experts=16, num_experts_per_tok=2, sliding_window=16, index_n_heads=16,
        index_head_dim=32 if kernel_friendly else 16, index_topk=4, compress_rate_hca=16,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1},
    )
    settings.update(overrides)
    return flash_config(layer_kinds, **settings)


# ------------------------------------------------------------------------------------ raw formats
def random_fp8_linear(num_out: int, num_in: int, *, generator: torch.Generator | None = None,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [N, K], scale ue8m0 bytes uint8 [ceil(N/128), ceil(K/128)]).

    Dequantised std ≈ K^-1/2: scale 2^e with 32 · 2^e ≈ K^-1/2, each block's exponent jittered
    by -1, 0 or +1 so the scales are not all equal."""
    values = torch.randn(num_out, num_in, generator=generator, device=device).mul_(_FP8_VALUE_STD).clamp_(-448, 448)
    weight = values.to(torch.float8_e4m3fn)
    exponent = round(math.log2(num_in**-0.5 / _FP8_VALUE_STD))
    grid = (-(-num_out // 128), -(-num_in // 128))
    jitter = torch.randint(-1, 2, grid, generator=generator, device=device)
    scale = (jitter + exponent + _UE8M0_BIAS).to(torch.uint8)
    return weight, scale


def random_fp4_stack(num_experts: int, num_out: int, num_in: int, *, generator: torch.Generator | None = None,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [E, N, K/2] with every e2m1 code equally likely, ue8m0 bytes [E, N, K/32])."""
    if num_in % 32:
        raise ValueError(f"FP4 input width {num_in} must be a multiple of 32")
    packed = torch.randint(0, 256, (num_experts, num_out, num_in // 2), generator=generator, device=device,
                           dtype=torch.uint8)
    exponent = round(math.log2(num_in**-0.5 / _FP4_CODE_RMS))
    jitter = torch.randint(-1, 2, (num_experts, num_out, num_in // 32), generator=generator, device=device)
    return packed, (jitter + exponent + _UE8M0_BIAS).to(torch.uint8)


def random_fp8_stack(num_experts: int, num_out: int, num_in: int, *, generator=None, device="cpu"):
    """FP8 experts (`expert_dtype fp8`): weight [E, N, K] e4m3, scale [E, ceil(N/128), ceil(K/128)]."""
    pairs = [random_fp8_linear(num_out, num_in, generator=generator, device=device) for _ in range(num_experts)]
    return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])


# ------------------------------------------------------------------------------------ the model
def fp8_linear_names(config: ModelConfig) -> list[str]:
    """Hub names of the attention-side weights a quantized checkpoint stores as FP8 (docs/model.md §4.2)."""
    quantized = dataclasses.replace(config, fp8_block_size=(128, 128))
    return [name for name, spec in tensor_inventory(quantized).items()
            if spec.storage is StorageKind.FP8_BLOCK and spec.is_attention_side]


def _random_plain(name: str, shape: tuple[int, ...], dtype: torch.dtype, config: ModelConfig,
                  generator: torch.Generator, device) -> torch.Tensor:
    """Values for a non-quantized tensor, by role (same choices as `checkpoint.writer`)."""

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).mul_(std).add_(mean).to(dtype)

    stem = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):  # distinct random experts per token
        keys = torch.rand(shape[0], config.n_routed_experts, generator=generator, device=device)
        return keys.argsort(dim=1)[:, : shape[1]].to(dtype)
    if "hc_" in name:
        if name.endswith("_fn"):
            return normal(0.02)
        return normal(0.5) if name.endswith("_base") else normal(0.1, mean=1.0)
    if name.endswith(("attn_sink", ".ape")):
        return normal(0.5 if name.endswith("attn_sink") else 0.1)
    if name.endswith("gate.bias"):
        return normal(0.01)
    if "norm" in stem:
        return normal(0.1, mean=1.0)
    if name == "embed.weight":
        return normal(1.0)
    if len(shape) == 2:
        return normal(shape[1] ** -0.5)
    return normal(0.02)


def _materialise(side: nn.Module, config: ModelConfig, generator: torch.Generator, device) -> None:
    """Give every meta parameter/buffer a random device tensor of its own shape and dtype."""
    for name, tensor in list(side.named_parameters()) + list(side.named_buffers()):
        if not tensor.is_meta:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = side.get_submodule(owner_name) if owner_name else side
        value = _random_plain(name, tuple(tensor.shape), tensor.dtype, config, generator, device)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value


def random_attention_side(config: ModelConfig, numerics: NumericsConfig, device, *, seed: int = 0,
                          backend: KernelBackend = KernelBackend.AUTO) -> AttentionSide:
    generator = torch.Generator(device=device).manual_seed(seed)
    side = AttentionSide(config, numerics, device="meta")
    quantized = {}
    for name in fp8_linear_names(config):
        module = side.get_submodule(name.removesuffix(".weight"))
        quantized[name] = random_fp8_linear(module.out_features, module.in_features, generator=generator,
                                            device=device)
    swap_fp8_linears(side, quantized, backend=backend)
    _materialise(side, config, generator, device)
    side.move_rope_tables(device)
    return side.eval()


def random_routed_experts(config: ModelConfig, numerics: NumericsConfig, device, *, seed: int = 1,
                          layers: list[int] | None = None,
                          backend: KernelBackend = KernelBackend.AUTO) -> QuantizedRoutedExperts:
    """Every expert of `layers` (default all), stacked per layer in the config's expert format."""
    generator = torch.Generator(device=device).manual_seed(seed)
    num_experts, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    make = random_fp8_stack if config.expert_dtype == "fp8" else random_fp4_stack
    stacks = {}
    for layer in layers if layers is not None else range(config.num_hidden_layers):
        w1, s1 = make(num_experts, inter, hidden, generator=generator, device=device)
        w2, s2 = make(num_experts, hidden, inter, generator=generator, device=device)
        w3, s3 = make(num_experts, inter, hidden, generator=generator, device=device)
        if config.expert_dtype == "fp8":
            w1, w2, w3 = (w.to(torch.float8_e4m3fn) if w.dtype != torch.float8_e4m3fn else w for w in (w1, w2, w3))
        stacks[layer] = (list(range(num_experts)), (w1, s1, w2, s2, w3, s3))
    fmt = ExpertFormat.FP8 if config.expert_dtype == "fp8" else ExpertFormat.FP4
    return QuantizedRoutedExperts(stacks, num_experts, config.swiglu_limit, expert_format=fmt,
                                  route_weight_before_w2=numerics.route_weight_before_w2, backend=backend)


def random_model(config: ModelConfig, device, *, numerics: NumericsConfig | None = None, seed: int = 0,
                 backend: KernelBackend = KernelBackend.AUTO) -> tuple[AttentionSide, QuantizedRoutedExperts]:
    """(attention side, routed experts) with random weights in the checkpoint formats, on `device`."""
    device = torch.device(device)
    if numerics is None:
        numerics = NumericsConfig(dtype="bfloat16" if device.type == "cuda" else "float32")
    with torch.no_grad():
        side = random_attention_side(config, numerics, device, seed=seed, backend=backend)
        experts = random_routed_experts(config, numerics, device, seed=seed + 1, backend=backend)
    experts.connect_gates(side.gates())  # one process: the gates build the experts' route layouts
    return side, experts


# ------------------------------------------------------------------------------------ state
class PreallocatedRowStore:
    """Compressed rows of one compressor in a fixed [max_rows, row_dim] tensor (a `RowStore`).

    Never reallocates, so a captured decode step keeps writing into memory it does not own."""

    def __init__(self, max_rows: int, row_dim: int, dtype: torch.dtype, device) -> None:
        self._rows = torch.zeros(max_rows, row_dim, dtype=dtype, device=device)

    def write(self, first_row: int, rows: torch.Tensor) -> None:
        end = first_row + rows.shape[0]
        if end > self._rows.shape[0]:
            raise IndexError(f"row {end - 1} beyond the preallocated {self._rows.shape[0]} rows")
        self._rows[first_row:end] = rows.to(self._rows.dtype)

    def read(self, num_rows: int) -> torch.Tensor:
        return self._rows[:num_rows]


def new_sequence_state(config: ModelConfig, max_tokens: int, dtype: torch.dtype, device,
                       max_rollback_tokens: int = 8) -> SequenceState:
    """A SequenceState whose compressed rows are preallocated for `max_tokens` tokens."""

    def factory(layer: int, which: str, row_dim: int) -> PreallocatedRowStore:
        ratio = config.compress_ratio(layer) or 1
        return PreallocatedRowStore(max_tokens // ratio + 1, row_dim, dtype, device)

    return SequenceState(config, max_rollback_tokens=max_rollback_tokens, dtype=dtype, device=device,
                         row_store_factory=factory)


def fill_random_context(state: SequenceState, num_tokens: int, *, generator: torch.Generator | None = None) -> None:
    """Append a random `num_tokens`-token history to every store of `state` and advance it.

    Goes through the stores' own append/write methods, so every counter and ring stays consistent.
    Rows get unit-RMS random values (what normed rows have); pending compressor inputs are random
    too. Equivalent, for timing, to a prefill of that many tokens; not a model output."""
    c = state.config
    device, dtype = _state_device_dtype(state)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device)

    for layer, layer_state in enumerate(state.layers):
        layer_state.window.append(randn(num_tokens, c.head_dim).to(dtype))
        kind = c.layer_types[layer]
        overlap = 2 if kind is AttentionKind.CSA else 1
        stores = ((layer_state.compressor, c.head_dim), (layer_state.indexer, c.index_head_dim))
        for store, row_dim in stores:
            if store is None:
                continue
            first_row = store.num_rows
            inputs = randn(num_tokens, overlap * row_dim)
            store.append_inputs(inputs, inputs)
            if store.num_rows > first_row:
                store.write_rows(first_row, randn(store.num_rows - first_row, row_dim).to(dtype))
    state.advance(num_tokens)


def _state_device_dtype(state: SequenceState) -> tuple[torch.device, torch.dtype]:
    window = state.layers[0].window.read(state.num_tokens)  # [0, C]: an empty view with the ring's dtype
    return window.device, window.dtype
