"""The DSpark drafter without a checkpoint: random weights in the checkpoint's formats (benchmarks).

A random model directory (`services.expert.random_weights`: config.json + random_weights.json, no
safetensors) whose config.json carries the `dspark_*` keys and `num_nextn_predict_layers` is
loaded by the draft worker like a checkpoint: `load_drafter` sees `is_random_model(path)` and calls
`random_drafter_for`, which generates on the worker's own device
- the stages' own weights (`mtp.*`): the linears a real checkpoint stores as FP8 (the inventory's
  FP8 `mtp.*` entries: attention, shared expert, `main_proj`) as `Fp8Linear`s (e4m3 + ue8m0
  128x128 scales), the routed experts of every stage as one `QuantizedRoutedExperts` (FP4 e2m1
  packed + ue8m0 1x32 scales, or FP8 for `expert_dtype fp8`), everything else (norms, mHC, sinks,
  gate, Markov and confidence heads) at its inventory dtype (bf16 tensors at the activation dtype,
  fp32 where the model keeps fp32). Nothing is expanded: on CUDA with bf16 activations the Triton
  kernels read the quantized bytes; on the CPU the same modules dequantise one matrix per call and
  compute in float32 (the CPU default numerics, architecture.md §10).
- the target's `embed` and `head`: exactly the attention worker's, because they come from the
  attention worker's own function (`services.attention.random_weights.random_attention_side_for`)
  on the same seed. Their values depend on the generator's position after every attention-side
  tensor drawn before them, so the whole attention side is built once and all but embed/head is
  dropped (transient: ~8.8 GB on a GPU at V4-Flash size, a few seconds); equal values need the
  same device type and dtype as the attention worker (CPU and CUDA generators differ).

Seeds (RandomWeightsSpec.seed = s): attention side s (shared embed/head), stage weights
`_STAGE_SEED_BASE·(s+1)`, stage j's routed experts `_EXPERT_SEED_BASE·(s+1) + L + j` (L main
layers: hub block index L + j, the `compress_ratios` entry of the stage), each a generator of its
own, so the drafter's experts never repeat a main layer's. The spec's routing skew is applied to
the stage gates as to the main layers (ranks of block L + j).

`dspark_hub_keys` / `with_dspark` give the V4-Flash drafter's config keys (dspark.md §3.2) for a
model of any depth. `meta_drafter` builds the same modules on the meta device (shapes and dtypes,
no memory) so that `drafter_weight_bytes` can account a V4-Flash drafter anywhere.
Legend: E routed experts, N out features, K in features, V vocab, r Markov rank, L main layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLASH_DSPARK_BLOCK_SIZE = 5
FLASH_DSPARK_MARKOV_RANK = 256
FLASH_DSPARK_NOISE_TOKEN_ID = 128799
FLASH_DSPARK_NUM_STAGES = 3
FLASH_DSPARK_NUM_TARGET_LAYERS = 3  # the last three main layers (40, 41, 42 of 43)
_STAGE_SEED_BASE = 2_000_029
_EXPERT_SEED_BASE = 1_000_003


def dspark_hub_keys(num_hidden_layers: int, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The `dspark_*` keys and `num_nextn_predict_layers` of V4-Flash's drafter (dspark.md §3.2) for a
    model of `num_hidden_layers` layers: target layers = the last three. vocab_size: when the mask
    token 128799 is not a token of a smaller (tiny) vocabulary, the last token id stands in for it."""
    if num_hidden_layers < FLASH_DSPARK_NUM_TARGET_LAYERS:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: the drafter reads the last "
                         f"{FLASH_DSPARK_NUM_TARGET_LAYERS} layers")
    noise_token_id = FLASH_DSPARK_NOISE_TOKEN_ID
    if vocab_size is not None and noise_token_id >= vocab_size:
        noise_token_id = vocab_size - 1
    first_target = num_hidden_layers - FLASH_DSPARK_NUM_TARGET_LAYERS
    return {
        "dspark_block_size": FLASH_DSPARK_BLOCK_SIZE,
        "dspark_markov_rank": FLASH_DSPARK_MARKOV_RANK,
        "dspark_target_layer_ids": list(range(first_target, num_hidden_layers)),
        "dspark_noise_token_id": noise_token_id,
        "num_nextn_predict_layers": FLASH_DSPARK_NUM_STAGES,
    }


def with_dspark(hub_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `hub_config` with the drafter's keys added (`dspark_hub_keys`) and, when it has
    `compress_ratios`, one ratio-0 entry per stage after the main layers (as `-0731`: 43 + 3)."""
    out = dict(hub_config)
    num_layers = int(out["num_hidden_layers"])
    out.update(dspark_hub_keys(num_layers, vocab_size=out.get("vocab_size")))
    if out.get("compress_ratios") is not None:
        out["compress_ratios"] = list(out["compress_ratios"][:num_layers]) + [0] * FLASH_DSPARK_NUM_STAGES
    return out


# ------------------------------------------------------------------------------------ building
def _generator(device, seed: int):
    """A generator on `device` seeded `seed`; None on the meta device (nothing is drawn there)."""
    import torch

    device = torch.device(device)
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


def drafter_fp8_names(config) -> list[str]:
    """Hub names of the drafter's weights a quantized checkpoint stores as FP8 (inventory `mtp.*`,
    not routed experts): per stage the attention linears and shared expert, plus `mtp.0.main_proj`."""
    from common.checkpoint.inventory import StorageKind, tensor_inventory

    quantized = dataclasses.replace(config, fp8_block_size=(128, 128))
    return [name for name, spec in tensor_inventory(quantized).items()
            if spec.is_mtp and not spec.is_routed_expert and spec.storage is StorageKind.FP8_BLOCK]


def _stage_experts(config, numerics, device, seed: int, backend):
    """Every stage's routed experts, stacked per stage and keyed by the stage index j (the `layer`
    argument of the drafter's ExpertsFn seam), in the config's expert format."""
    import torch

    from common.model.quantized import QuantizedRoutedExperts
    from common.model.random_init import random_fp4_stack, random_fp8_stack

    make = random_fp8_stack if config.expert_dtype == "fp8" else random_fp4_stack
    num_experts, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    stacks = {}
    for stage in range(config.num_nextn_predict_layers):
        generator = _generator(device, _EXPERT_SEED_BASE * (seed + 1) + config.num_hidden_layers + stage)
        tensors = []
        for num_out, num_in in ((inter, hidden), (hidden, inter), (inter, hidden)):  # w1, w2, w3 as (N, K)
            w, s = make(num_experts, num_out, num_in, generator=generator, device=device)
            if config.expert_dtype == "fp8" and w.dtype != torch.float8_e4m3fn:
                w = w.to(torch.float8_e4m3fn)
            tensors += [w, s]
        stacks[stage] = (list(range(num_experts)), tuple(tensors))
    return QuantizedRoutedExperts.from_config(stacks, config, numerics, backend=backend)


def _apply_stage_skew(drafter, config, seed: int, strength: float) -> None:
    """Stage j's gate bias = -strength·ln(1 + rank) with the ranks of hub block L + j (the expert
    workers' and attention worker's rule for main layers, `skew_ranks`)."""
    import torch

    from services.expert.random_weights import skew_ranks

    if strength <= 0.0:
        return
    for stage, block in enumerate(drafter.mtp):
        ranks = torch.tensor(skew_ranks(config.n_routed_experts, config.num_hidden_layers + stage, seed),
                             dtype=torch.float32)
        bias = block.ffn.gate.bias
        bias.data.copy_((-strength * torch.log1p(ranks)).to(bias.device, bias.dtype))


def build_random_drafter(config, numerics, device, embed, head, *, seed: int = 0, routing_skew: float = 0.0,
                         backend=None):
    """A `DSparkDrafter` with random weights in the checkpoint formats on `device` (see the module).

    embed / head: the target's (`target_embed_head`), held by reference. device "meta" builds the
    same modules without memory (`meta_drafter`). Weights frozen, module in eval mode."""
    import torch

    from common.model.dspark import DSparkDrafter
    from common.model.quantized import KernelBackend, swap_fp8_linears
    from common.model.random_init import _materialise, random_fp8_linear
    from common.model.rope import RotaryTable

    if config.dspark is None:
        raise ValueError("config has no dspark_* keys: add them with with_dspark()")
    if not 0 <= config.dspark.noise_token_id < config.vocab_size:
        raise ValueError(f"dspark_noise_token_id={config.dspark.noise_token_id} outside the vocabulary "
                         f"of {config.vocab_size}")
    backend = backend or KernelBackend.AUTO
    device = torch.device(device)
    generator = _generator(device, _STAGE_SEED_BASE * (seed + 1))
    with torch.no_grad():
        drafter = DSparkDrafter(config, embed, head, numerics, device="meta")
        quantized = {}
        for name in drafter_fp8_names(config):
            module = drafter.get_submodule(name.removesuffix(".weight"))
            quantized[name] = random_fp8_linear(module.out_features, module.in_features, generator=generator,
                                                device=device)
        swap_fp8_linears(drafter, quantized, backend=backend)
        _materialise(drafter, config, generator, device)  # the attention side's value rules, by name
        for block in drafter.mtp:  # RoPE tables on the device: no host copy inside a forward
            rope = block.attn.rope
            block.attn.rope = RotaryTable(rope.name, rope.rope_dim, rope.inv_freq.to(device))
        _apply_stage_skew(drafter, config, seed, routing_skew)
        drafter.set_experts(_stage_experts(config, drafter.numerics, device, seed, backend))
    for param in drafter.parameters():
        param.requires_grad_(False)
    return drafter.eval()


def target_embed_head(model_dir: str | Path, dtype, device):
    """(embed, head) of the random model at `model_dir`, equal to the attention worker's on the same
    device type and dtype: built by its own `random_attention_side_for` (see the module for the cost)."""
    import torch

    from services.attention.random_weights import random_attention_side_for

    device = torch.device(device)
    _config, side = random_attention_side_for(str(model_dir), dtype, device)
    embed, head = side.embed, side.head
    del side
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the dropped attention side's memory back
    return embed, head


def random_drafter_for(model_dir: str | Path, device, numerics, *, backend=None):
    """The drafter of the random model at `model_dir` on `device` with `numerics` (what the draft
    worker's `load_drafter` calls for a random model directory)."""
    import structlog
    import torch

    from common.model.config import ModelConfig
    from services.expert.random_weights import read_random_spec

    config = ModelConfig.load(str(model_dir))
    spec = read_random_spec(model_dir)
    embed, head = target_embed_head(model_dir, numerics.torch_dtype(), device)
    for module in (embed, head):
        module.requires_grad_(False)
    drafter = build_random_drafter(config, numerics, device, embed, head, seed=spec.seed,
                                   routing_skew=spec.routing_skew, backend=backend)
    sizes = drafter_weight_bytes(drafter)
    structlog.get_logger("draft").info(
        "draft.random_weights", seed=spec.seed, routing_skew=spec.routing_skew, device=str(torch.device(device)),
        num_stages=config.num_nextn_predict_layers, fp8_linear_bytes=sizes.fp8_linear_bytes,
        routed_expert_bytes=sizes.routed_expert_bytes, other_bytes=sizes.other_bytes,
        shared_bytes=sizes.shared_bytes)
    return drafter


def meta_drafter(config, numerics=None):
    """The random drafter's modules on the meta device: every shape and dtype, no memory, no values."""
    from common.model.config import NumericsConfig
    from common.model.linear import Embedding, Linear

    numerics = numerics or NumericsConfig(dtype="bfloat16")
    dtype = numerics.torch_dtype()
    embed = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device="meta")
    head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, device="meta")
    return build_random_drafter(config, numerics, "meta", embed, head)


# ------------------------------------------------------------------------------------ accounting
@dataclass(frozen=True)
class DrafterWeightBytes:
    """Bytes a drafter holds, by kind. fp8_linear_bytes: FP8 weights + ue8m0 scales (stages'
    attention and shared expert, main_proj); routed_expert_bytes: every stage's routed experts
    (FP4 packed + scales, or FP8 + scales); other_bytes: the drafter's remaining own tensors at their
    runtime dtypes; shared_bytes: the target's embed + head the drafter holds (its own copy in a
    separate process, not part of `mtp.*`)."""

    fp8_linear_bytes: int
    routed_expert_bytes: int
    other_bytes: int
    shared_bytes: int

    @property
    def quantized_bytes(self) -> int:
        return self.fp8_linear_bytes + self.routed_expert_bytes

    @property
    def own_bytes(self) -> int:
        """The drafter's own (`mtp.*`) tensors."""
        return self.quantized_bytes + self.other_bytes

    @property
    def total_bytes(self) -> int:
        return self.own_bytes + self.shared_bytes


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def drafter_weight_bytes(drafter) -> DrafterWeightBytes:
    """Count a built (or meta) drafter's tensors; routed experts via its `QuantizedRoutedExperts`."""
    from common.model.quantized import Fp8Linear, QuantizedRoutedExperts

    fp8_modules = [m for m in drafter.modules() if isinstance(m, Fp8Linear)]
    fp8_ids = {id(t) for m in fp8_modules for t in (m.weight, m.scale)}
    fp8 = _nbytes(t for m in fp8_modules for t in (m.weight, m.scale))
    other = _nbytes(t for t in list(drafter.parameters()) + list(drafter.buffers()) if id(t) not in fp8_ids)
    experts = drafter.experts_fn
    if not isinstance(experts, QuantizedRoutedExperts):
        raise TypeError(f"routed experts are a {type(experts).__name__}, not QuantizedRoutedExperts")
    routed = sum(experts.bytes_per_expert(layer) for layer, _expert in experts.pairs)
    shared = _nbytes(list(drafter.embed.parameters()) + list(drafter.head.parameters()))
    return DrafterWeightBytes(fp8, routed, other, shared)


__all__ = [
    "DrafterWeightBytes", "build_random_drafter", "drafter_fp8_names", "drafter_weight_bytes", "dspark_hub_keys",
    "meta_drafter", "random_drafter_for", "target_embed_head", "with_dspark",
]
