"""What each worker plans to put on its device, measured before it allocates anything big.

`budget.py` is the arithmetic; this module fills it in for the three workers from the model
config (the checkpoint inventory gives every tensor's logical shape) and the worker's settings:

- expert worker: its routed experts in the format it keeps them (`--expert-dtype`: FP4 / FP8 bytes
  with their scales, or dense bf16), the transient peak while loading (one layer's new stack beside
  the old one on a LoadExperts, and one matrix's conversion temporaries), plus the activations of
  one full Dispatch (max batched tokens x top-k x hidden, a few copies);
- attention worker: every non-expert tensor of the main model, FP8 linears at their stored bytes
  (they stay FP8 on the device) and the rest in the compute dtype, the KV pools (blocks and resume
  snapshots) in the worker's `kv_dtype` (the device pool; the CPU tier too when the device is the CPU),
  the transient of one FP8 matrix dequantised on the CPU path, and the activations of one step (the
  mHC residual streams and a few [T, D] intermediates per token, plus the sampled rows' logits);
- draft worker: the `mtp.*` / DSpark tensors (FP8 linears at their stored bytes) plus its own copy
  of the embedding and the head, and small activations.
A reserve (`RESERVE_FRACTION` of the plan + `RESERVE_BYTES`) covers allocator fragmentation and
the framework's own buffers. CUDA graphs are not captured by the workers yet: 0 bytes.

Free memory: `torch.cuda.mem_get_info` on CUDA devices, `MemAvailable` of /proc/meminfo on the
CPU, capped by the deployment's `memory_limit` for the worker (an operator's cap when several
workers share a device, and the knob the tests use to make a start fail). Only
`measure_free_bytes` touches torch or files; everything else is arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.model.kv_sizing import KVPoolSizing
from moemesh.common.model.kv_storage import KVStorage
from moemesh.common.placement.budget import MemoryBudget
from moemesh.common.placement.devices import parse_size

RESERVE_FRACTION = 0.02
RESERVE_BYTES = 256 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StepShape:
    """The largest step a worker must hold activations for."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64


def dtype_bytes(dtype: str, device: str) -> int:
    """Bytes per element of the compute dtype ("auto": float32 on the CPU, bfloat16 elsewhere)."""
    if dtype == "auto":
        return 4 if device.split(":")[0] == "cpu" else 2
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not auto, float32, bfloat16 or float16")
    return _DTYPE_BYTES[dtype]


def measure_free_bytes(device: str, memory_limit: str | None = None) -> int:
    """Free memory of `device` now, capped by `memory_limit` ("40GiB"; None: no cap)."""
    if device.split(":")[0] == "cuda":
        import torch

        free_bytes = int(torch.cuda.mem_get_info(torch.device(device))[0])
    else:
        free_bytes = _mem_available_bytes()
    if memory_limit is not None:
        free_bytes = min(free_bytes, parse_size(memory_limit))
    return free_bytes


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _reserve(planned_bytes: int) -> int:
    return int(planned_bytes * RESERVE_FRACTION) + RESERVE_BYTES


def resident_bytes_per_expert(config, expert_dtype: str = "native") -> int:
    """Bytes one routed expert (w1 [I, D], w2 [D, I], w3 [I, D]) occupies on an expert worker keeping
    `expert_dtype` ("native": as stored; "fp8": e4m3 with 128x128 scales; "bf16": dense)."""
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    params = 3 * inter * hidden
    stored = config.expert_dtype
    if expert_dtype == "bf16" or (expert_dtype == "native" and stored == "bf16"):
        return 2 * params
    if expert_dtype == "fp8" or stored == "fp8":
        return params + 3 * (-(-inter // 128)) * (-(-hidden // 128))  # e4m3 + one scale per 128x128 block
    return params // 2 + params // 32  # FP4 e2m1 + ue8m0 per 32


def expert_load_peak_bytes(config, expert_dtype: str = "native", num_experts_per_layer: int = 0) -> int:
    """Transient bytes while loading: one layer's new stack (a LoadExperts restacks a layer beside its old
    stack) plus one matrix's conversion temporaries (dequantised fp32 and its padded copy)."""
    matrix = config.moe_intermediate_size * config.hidden_size
    conversion = 3 * 4 * matrix if expert_dtype != "native" else matrix
    return num_experts_per_layer * resident_bytes_per_expert(config, expert_dtype) + conversion


def _tensor_bytes(spec, element_bytes: int) -> int:
    """A non-expert tensor as a worker holds it (common/checkpoint/module_loader.py): FP8 at its stored
    bytes; a bf16 projection or embedding matrix as stored when that is narrower than the compute dtype;
    norm weights in float32; f32 / i64 as stored; anything else in the compute dtype."""
    from moemesh.common.model.inventory import StorageKind

    if spec.is_quantized:
        return spec.num_bytes
    if spec.storage is StorageKind.F32:
        return 4 * spec.num_params
    if spec.storage is StorageKind.I64:
        return 8 * spec.num_params
    if spec.name.endswith("norm.weight"):
        return 4 * spec.num_params
    if len(spec.shape) == 2 and not spec.name.endswith("ffn.gate.weight"):
        return min(2, element_bytes) * spec.num_params
    return spec.num_params * element_bytes


def _largest_fp8_matrix(specs) -> int:
    return max((spec.num_params for spec in specs if spec.is_quantized), default=0)


def expert_worker_budget(config, *, service: str, device: str, dtype: str, num_pairs: int, free_bytes: int,
                         expert_dtype: str = "native", step: StepShape = StepShape()) -> MemoryBudget:
    element = dtype_bytes(dtype, device)
    # hidden in, per-slot outputs and a few grouped intermediates of one Dispatch
    tokens = step.max_num_batched_tokens
    activations = tokens * config.num_experts_per_tok * (4 * config.hidden_size + 3 * config.moe_intermediate_size)
    activation_bytes = activations * element
    expert_bytes = num_pairs * resident_bytes_per_expert(config, expert_dtype)
    per_layer = min(num_pairs, config.n_routed_experts)
    loading = expert_load_peak_bytes(config, expert_dtype, per_layer)
    return MemoryBudget(service, device, free_bytes, expert_bytes=expert_bytes, activation_bytes=activation_bytes,
                        load_peak_bytes=loading, reserve_bytes=_reserve(expert_bytes + activation_bytes))


def attention_weight_bytes(config, element_bytes: int) -> int:
    from moemesh.common.model.inventory import tensor_inventory

    return sum(_tensor_bytes(spec, element_bytes) for spec in tensor_inventory(config).values()
               if spec.is_attention_side)


def draft_weight_bytes(config, element_bytes: int) -> int:
    """The `mtp.*` tensors plus the drafter's own copy of the embedding and the head."""
    from moemesh.common.model.inventory import tensor_inventory

    inventory = tensor_inventory(config)
    own = sum(_tensor_bytes(spec, element_bytes) for spec in inventory.values() if spec.is_mtp)
    shared = sum(_tensor_bytes(inventory[name], element_bytes) for name in ("embed.weight", "head.weight")
                 if name in inventory)
    return own + shared


def kv_block_bytes(config, block_size_tokens: int, element_bytes: int,
                   kv_storage: KVStorage = KVStorage.BF16) -> int:
    """Bytes of one KV block in the pool with rows stored as `kv_storage` says (element_bytes: the compute dtype's,
    for plain rows): its compressed and indexer rows, the segments services/attention/kv_pool.py allocates
    (`common.model.kv_sizing`)."""
    return _kv_sizing(config, block_size_tokens, element_bytes, kv_storage).bytes_per_block


def _kv_sizing(config, block_size_tokens: int, element_bytes: int, kv_storage: KVStorage) -> KVPoolSizing:
    return KVPoolSizing.of(config, block_size_tokens=block_size_tokens, num_primary_blocks=1, num_cpu_blocks=0,
                           kv_storage=kv_storage, activation_bytes=element_bytes)


def attention_worker_budget(config, *, service: str, device: str, dtype: str, block_size_tokens: int,
                            num_primary_blocks: int, num_cpu_blocks: int, free_bytes: int,
                            step: StepShape = StepShape(), num_local_pairs: int = 0,
                            kv_storage: KVStorage = KVStorage.BF16, with_drafter: bool = False,
                            num_primary_snapshots: int = 0, num_cpu_snapshots: int = 0) -> MemoryBudget:
    """num_local_pairs: routed experts its own placement gives it (kept as stored); kv_storage: how its KV rows
    are stored (the `kv_dtype` setting: the pool is priced in it); num_primary_snapshots / num_cpu_snapshots: its
    pool's resume snapshots per tier (the CPU tier counts only on a CPU device); with_drafter: it also runs the DSpark
    drafter in its process (`[draft] placement = "attention"`), whose weights and activations count here."""
    from moemesh.common.model.inventory import tensor_inventory

    element = dtype_bytes(dtype, device)
    weights = attention_weight_bytes(config, element)
    loading = _largest_fp8_matrix(s for s in tensor_inventory(config).values() if s.is_attention_side) * element
    expert_bytes = num_local_pairs * resident_bytes_per_expert(config)
    if num_local_pairs:
        loading = max(loading, expert_load_peak_bytes(config, "native", min(num_local_pairs, config.n_routed_experts)))
    sizing = _kv_sizing(config, block_size_tokens, element, kv_storage)
    on_cpu = device.split(":")[0] == "cpu"
    kv = sizing.bytes_per_block * (num_primary_blocks + (num_cpu_blocks if on_cpu else 0))
    kv += sizing.bytes_per_snapshot * (num_primary_snapshots + (num_cpu_snapshots if on_cpu else 0))
    tokens = step.max_num_batched_tokens
    hc_mult = getattr(config, "hc_mult", 1) or 1
    activations = tokens * config.hidden_size * (2 * hc_mult + 8) * element  # residual streams + intermediates
    activations += step.max_num_seqs * config.vocab_size * 4  # fp32 logits of the sampled rows
    if with_drafter:
        weights += draft_weight_bytes(config, element)
        activations += _draft_activation_bytes(config, step, element)
    return MemoryBudget(service, device, free_bytes, weights_bytes=weights, kv_pool_bytes=kv, expert_bytes=expert_bytes,
                        activation_bytes=activations, load_peak_bytes=loading,
                        reserve_bytes=_reserve(weights + kv + activations + expert_bytes))


def draft_worker_budget(config, *, service: str, device: str, dtype: str, free_bytes: int,
                        step: StepShape = StepShape()) -> MemoryBudget:
    element = dtype_bytes(dtype, device)
    weights = draft_weight_bytes(config, element)
    activations = _draft_activation_bytes(config, step, element)
    return MemoryBudget(service, device, free_bytes, weights_bytes=weights, activation_bytes=activations,
                        reserve_bytes=_reserve(weights + activations))


def _draft_activation_bytes(config, step: StepShape, element: int) -> int:
    return step.max_num_seqs * (config.hidden_size * 16 * element + config.vocab_size * 4)


def check_at_start(budget: MemoryBudget, worker_name: str) -> str | None:
    """Log `<service>.memory_budget` (service = the role); None when the plan fits, else the
    message the worker exits with (it names the worker, the device and the shortfall)."""
    from moemesh.common.placement.budget import BudgetShortfall, report_and_check

    try:
        report_and_check(budget)
    except BudgetShortfall as error:
        return f"{worker_name}: refusing to start: {error}"
    return None


def expert_headroom_bytes(budget: MemoryBudget) -> int:
    """What is left for routed experts: free memory minus everything else the plan holds."""
    return budget.free_bytes - (budget.needed_bytes - budget.expert_bytes)


def worker_resident_bytes(config, role: str, *, device: str = "cpu", dtype: str = "auto", num_pairs: int = 0,
                          expert_dtype: str = "native") -> int:
    """Weight bytes a worker of `role` ("attention", "expert", "draft") will hold (`moemesh check-model`);
    num_pairs: its routed experts (an attention worker keeps its own as stored)."""
    element = dtype_bytes(dtype, device)
    if role == "expert":
        return num_pairs * resident_bytes_per_expert(config, expert_dtype)
    if role == "attention":
        return attention_weight_bytes(config, element) + num_pairs * resident_bytes_per_expert(config)
    return draft_weight_bytes(config, element)
