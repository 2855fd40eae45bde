"""Floors of `bench.layers`: bytes each step must read, FLOPs each prefill must do (docs/model.md §8).

Bytes are counted from the tensors actually built (FP8 weights + scales, FP4 packed + scales,
bf16/fp32 tensors), per layer and for the head, so the floor is the one of the model measured.
Decode reads, per step: every attention-side weight of each layer (attention, compressor, indexer,
gate, shared expert, mHC, norms; `tid2eid` is gathered, one row per token, and not counted), the
distinct routed experts the timed step selects (counted from its gates' ids; where not counted, the
expectation under uniform routing, `E·(1 − (1 − k/E)^B)`) times one expert's bytes, and the head
(final norm, hc_head, head matrix). KV reads are counted apart.
Prefill FLOPs: 2 · (matmul parameters a token passes through) per token, plus the attention core
over the keys a token must see (window, CSA top-k rows, HCA rows) and the CSA indexer's scoring.
Legend: B batch, E routed experts, k top-k, P prompt tokens, D hidden, H heads, hd head dim.
"""

from __future__ import annotations

from moemesh.common.model.config import AttentionKind, ModelConfig

FLASH_LAYER_COUNTS = {AttentionKind.WINDOW: 2, AttentionKind.CSA: 21, AttentionKind.HCA: 20}


def tensor_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def layer_weight_bytes(side, layer: int) -> int:
    """Attention-side bytes a step reads for one layer (everything but `tid2eid` and routed experts)."""
    block = side.layers[layer]
    total = tensor_bytes(block)
    tid2eid = getattr(block.ffn.gate, "tid2eid", None)
    return total - (tid2eid.numel() * tid2eid.element_size() if tid2eid is not None else 0)


def head_weight_bytes(side) -> int:
    return (tensor_bytes(side.head) + tensor_bytes(side.norm)
            + sum(t.numel() * t.element_size() for t in (side.hc_head_fn, side.hc_head_base, side.hc_head_scale)))


# Which decode kernel reads a layer tensor, by the tensor's module path (first match wins); every tensor
# of the block must match one rule (`kernel_read_bytes` raises naming the one that does not).
_KERNEL_OF_TENSOR = (
    ("attn.wo_a.", "_grouped_kernel"),  # wo_a's groups run as a grouped FP8 launch
    ("attn.compressor.norm.", "_compressor_step_kernel"),
    ("attn.indexer.compressor.norm.", "_compressor_step_kernel"),
    ("attn.compressor.", "_projections_kernel"),
    ("attn.indexer.compressor.", "_projections_kernel"),
    ("attn.indexer.weights_proj.", "_projections_kernel"),
    ("attn.attn_sink", "_sparse_attention_kernel"),
    ("attn.", "_fp8_linear_kernel"),  # wq_a, wq_b, wkv, wo_b, indexer.wq_b and the q / kv norms in their launches
    ("ffn.gate.", "_gate_kernel"),
    ("ffn.shared_experts.", "_fp8_linear_kernel"),
    ("attn_norm.", "_hc_finish_kernel"),
    ("ffn_norm.", "_hc_finish_kernel"),
    ("hc_attn_fn", "_hc_post_kernel"),  # the mix GEMV runs in the hc_post before the site
    ("hc_ffn_fn", "_hc_post_kernel"),
    ("hc_", "_hc_finish_kernel"),  # bases and scales
)


def kernel_read_bytes(side, config: ModelConfig, layer: int, batch_size: int, context_tokens: int,
                      kv_element_bytes: int, expert_bytes: int, activation_bytes: int,
                      distinct_experts: float | None = None) -> dict[str, float]:
    """Bytes each decode kernel of `layer` must read in one step, by kernel name (their sum is the
    layer's floor bytes plus its KV rows and mHC streams): the weights by `_KERNEL_OF_TENSOR`, the
    routed experts the step selects (`distinct_experts`, measured; None: the uniform-routing
    expectation) to the grouped kernel, the window / selected / HCA rows to sparse attention, the
    indexer rows to the indexer, the B·hc·D residual streams once to each mHC kernel."""
    block = side.layers[layer]
    tid2eid = getattr(block.ffn.gate, "tid2eid", None)
    out: dict[str, float] = {}
    for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
        if tid2eid is not None and tensor is tid2eid:
            continue  # gathered, one row per token
        kernel = next((k for prefix, k in _KERNEL_OF_TENSOR if name.startswith(prefix)), None)
        if kernel is None:
            raise ValueError(f"layer {layer} tensor {name}: no decode kernel reads it in layers_floors")
        out[kernel] = out.get(kernel, 0.0) + tensor.numel() * tensor.element_size()
    routed = expected_distinct_experts(config, batch_size) if distinct_experts is None else distinct_experts
    out["_grouped_kernel"] = out.get("_grouped_kernel", 0.0) + routed * expert_bytes
    attention_rows, indexer_rows = _kv_rows(config, layer, context_tokens)
    if indexer_rows:
        out["_indexer_scores_topk_kernel"] = batch_size * indexer_rows * config.index_head_dim * kv_element_bytes
    out["_sparse_attention_kernel"] = (out.get("_sparse_attention_kernel", 0.0)
                                       + batch_size * attention_rows * config.head_dim * kv_element_bytes)
    streams = batch_size * config.hc_mult * config.hidden_size * activation_bytes
    for kernel in ("_hc_post_kernel", "_hc_finish_kernel"):
        out[kernel] = out.get(kernel, 0.0) + 2 * streams  # two sites a layer
    return out


def kernel_read_bytes_per_layer(side, config: ModelConfig, batch_size: int, context_tokens: int, element_bytes: int,
                                expert_bytes: int, distinct_experts: list[float | None]) -> list[dict[str, float]]:
    """`kernel_read_bytes` of every layer, KV rows and residual streams in the activation dtype (`element_bytes`)."""
    return [kernel_read_bytes(side, config, layer, batch_size, context_tokens, element_bytes, expert_bytes,
                              element_bytes, distinct_experts[layer]) for layer in range(len(distinct_experts))]


def expected_distinct_experts(config: ModelConfig, batch_size: int) -> float:
    num_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    return num_experts * (1 - (1 - top_k / num_experts) ** batch_size)


def _kv_rows(config: ModelConfig, layer: int, context_tokens: int) -> tuple[int, int]:
    """(attention rows, indexer rows) one decode step reads for one sequence: the window and the selected
    (CSA) or all (HCA) compressed rows, head_dim wide; the CSA indexer's rows, index_head_dim wide."""
    kind = config.layer_types[layer]
    attention_rows, indexer_rows = min(context_tokens + 1, config.sliding_window), 0
    if kind is AttentionKind.CSA:
        indexer_rows = (context_tokens + 1) // config.csa_compress_ratio
        attention_rows += min(config.index_topk, indexer_rows)
    elif kind is AttentionKind.HCA:
        attention_rows += (context_tokens + 1) // config.hca_compress_ratio
    return attention_rows, indexer_rows


def kv_bytes_per_sequence(config: ModelConfig, layer: int, context_tokens: int, element_bytes: int) -> int:
    """Rows one decode step must read for one sequence (window, selected/all compressed rows, indexer rows)."""
    attention_rows, indexer_rows = _kv_rows(config, layer, context_tokens)
    return (attention_rows * config.head_dim + indexer_rows * config.index_head_dim) * element_bytes


def matmul_params_per_token(config: ModelConfig, layer: int) -> int:
    """Parameters of every matmul one token of `layer` passes through (6 routed + shared expert)."""
    c = config
    hidden, heads, head_dim = c.hidden_size, c.num_attention_heads, c.head_dim
    attention = (c.q_lora_rank * hidden + heads * head_dim * c.q_lora_rank + head_dim * hidden
                 + c.o_groups * c.o_lora_rank * (heads * head_dim // c.o_groups) + hidden * c.o_groups * c.o_lora_rank)
    kind = c.layer_types[layer]
    if kind is AttentionKind.CSA:
        attention += 2 * (2 * head_dim * hidden)  # compressor wkv, wgate (2·hd wide)
        attention += c.index_n_heads * c.index_head_dim * c.q_lora_rank + c.index_n_heads * hidden
        attention += 2 * (2 * c.index_head_dim * hidden)
    elif kind is AttentionKind.HCA:
        attention += 2 * (head_dim * hidden)
    mixing = 2 * c.num_hc_mix * c.hc_mult * hidden
    gate = c.n_routed_experts * hidden
    experts = (c.num_experts_per_tok + 1) * 3 * c.moe_intermediate_size * hidden
    return attention + mixing + gate + experts


def attention_core_flops(config: ModelConfig, layer: int, num_tokens: int) -> float:
    """Σ over prompt positions t of the QK and PV products over the keys t must see, + indexer."""
    c = config
    kind = c.layer_types[layer]
    total_keys = 0
    indexer_rows = 0
    for t in range(num_tokens):
        keys = min(t + 1, c.sliding_window)
        if kind is AttentionKind.CSA:
            visible = (t + 1) // c.csa_compress_ratio
            keys += min(c.index_topk, visible)
            indexer_rows += visible
        elif kind is AttentionKind.HCA:
            keys += (t + 1) // c.hca_compress_ratio
        total_keys += keys
    core = 2 * 2 * c.num_attention_heads * c.head_dim * total_keys
    indexer = 2 * c.index_n_heads * c.index_head_dim * indexer_rows
    return float(core + indexer)


def prefill_layer_flops(config: ModelConfig, layer: int, num_tokens: int) -> float:
    return 2.0 * matmul_params_per_token(config, layer) * num_tokens + attention_core_flops(config, layer, num_tokens)


def substitute_kind(kind: AttentionKind, measured: set[AttentionKind]) -> AttentionKind | None:
    """The measured kind that stands in for an unmeasured one in the 43-layer sum (or None)."""
    if kind in measured:
        return kind
    for candidate in (AttentionKind.HCA, AttentionKind.CSA, AttentionKind.WINDOW):
        if candidate in measured:
            return candidate
    return None


def extrapolate(per_kind_s: dict[AttentionKind, float], fixed_s: float,
                layer_counts: dict[AttentionKind, int] | None = None) -> tuple[float, dict[str, str]]:
    """Σ_kind count · per-layer time + fixed (embed + head) -> (seconds, {kind: kind used})."""
    counts = layer_counts or FLASH_LAYER_COUNTS
    total = fixed_s
    used = {}
    for kind, count in counts.items():
        stand_in = substitute_kind(kind, set(per_kind_s))
        if stand_in is None:
            raise ValueError("no layer kind measured")
        used[kind.name.lower()] = stand_in.name.lower()
        total += count * per_kind_s[stand_in]
    return total, used
