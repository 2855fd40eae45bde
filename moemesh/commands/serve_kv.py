"""The KV pool `moemesh serve` gives the attention worker: `--kv-tokens`, `--kv-cpu-tokens`, `--max-model-len`.

Token counts are rounded up to whole blocks of `block_size_tokens` (128). `--kv-tokens auto` sizes the device
pool from memory: the attention device's free memory times `--gpu-memory-utilization`, less what every worker on
that device plans at start (weights, its routed experts, activations, the loading peak and the reserve, priced
as each worker's own start-up budget prices them, `common.placement.worker_budget`), over the bytes of one block
in the chosen `kv_dtype` (its compressed and indexer rows, `common.model.kv_sizing`) with its reserve; the
deployment's resume snapshots (`[kv] num_primary_snapshots`) are a fixed part of what the worker plans. Free memory
is read in a short child process on CUDA (serve itself keeps no CUDA context), from /proc/meminfo on the CPU.
The CPU tier is pinned host memory and not counted against a GPU. `--max-model-len` (default: the model's
positions, capped by the device pool) is checked against both here, before any service starts.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

BLOCK_SIZE_TOKENS = 128
AUTO = "auto"


@dataclass(frozen=True)
class KVRequest:
    """What the command line asked for. device_tokens: a token count or None for `auto`."""

    device_tokens: int | None
    cpu_tokens: int
    max_model_len: int  # 0: from the model and the pool
    memory_utilization: float = 0.9


def parse_kv_request(kv_tokens: str, kv_cpu_tokens: int, max_model_len: int | None,
                     memory_utilization: float) -> KVRequest:
    """The flags, checked (ValueError naming the flag)."""
    text = str(kv_tokens).strip().lower()
    if text == AUTO:
        device_tokens = None
    else:
        try:
            device_tokens = int(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"--kv-tokens must be a token count or 'auto', got {kv_tokens!r}") from None
        if device_tokens < 1:
            raise ValueError(f"--kv-tokens must be >= 1, got {device_tokens}")
    if kv_cpu_tokens < 0:
        raise ValueError(f"--kv-cpu-tokens must be >= 0, got {kv_cpu_tokens}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {memory_utilization}")
    return KVRequest(device_tokens, kv_cpu_tokens, max_model_len or 0, memory_utilization)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE_TOKENS)


def check_max_model_len(max_model_len: int, max_positions: int, num_primary_blocks: int) -> None:
    """ValueError when an asked-for length exceeds the model's positions or the device pool."""
    if not max_model_len:
        return
    if max_model_len > max_positions:
        raise ValueError(f"--max-model-len {max_model_len} is past the model's max_position_embeddings "
                         f"({max_positions})")
    pool_tokens = num_primary_blocks * BLOCK_SIZE_TOKENS
    if max_model_len > pool_tokens:
        raise ValueError(f"--max-model-len {max_model_len} does not fit the device KV pool of {pool_tokens} tokens "
                         f"(raise --kv-tokens)")


def measure_free_bytes_isolated(device: str) -> int:
    """Free memory of `device` now: a child process asks CUDA, the CPU reads /proc/meminfo."""
    if device.split(":")[0] != "cuda":
        from moemesh.common.placement.worker_budget import measure_free_bytes

        return measure_free_bytes(device)
    code = "import sys, torch; print(torch.cuda.mem_get_info(torch.device(sys.argv[1]))[0])"
    done = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ValueError(f"--kv-tokens auto: cannot read the free memory of {device}: {done.stderr.strip()[-300:]}")
    return int(done.stdout.strip().splitlines()[-1])


def planned_bytes_beside_kv(deployment, model_config) -> tuple[int, int]:
    """(bytes every worker on the attention worker's device plans without the device KV pool, bytes of one
    pool block with its share of the reserve). A CPU attention device also holds the CPU tier, counted here."""
    from moemesh.common.model.kv_storage import KVStorage
    from moemesh.common.placement.worker_budget import (RESERVE_FRACTION, attention_worker_budget,
                                                        draft_worker_budget, dtype_bytes, expert_worker_budget,
                                                        kv_block_bytes)
    from moemesh.common.placement.worker_holdings import holdings_for

    attention = deployment.attention[0]
    device = attention.device
    dtype = deployment.model.dtype
    layers, experts = model_config.num_hidden_layers, model_config.n_routed_experts
    kv = deployment.kv
    storage = KVStorage(attention.kv_dtype)
    own_pairs = len(holdings_for(attention.name, attention.placement, layers, experts).held)
    total = attention_worker_budget(
        model_config, service="attention", device=device, dtype=dtype, block_size_tokens=kv.block_size_tokens,
        num_primary_blocks=0, num_cpu_blocks=kv.num_cpu_blocks, free_bytes=0, num_local_pairs=own_pairs,
        kv_storage=storage, with_drafter=deployment.draft.in_attention and model_config.dspark is not None,
        num_primary_snapshots=kv.num_primary_snapshots, num_cpu_snapshots=kv.num_cpu_snapshots,
    ).needed_bytes
    for entry in deployment.expert:
        if entry.device == device:
            pairs = len(holdings_for(entry.name, entry.placement, layers, experts).held)
            total += expert_worker_budget(model_config, service="expert", device=device, dtype=dtype,
                                          num_pairs=pairs, free_bytes=0, expert_dtype=entry.expert_dtype).needed_bytes
    if deployment.draft.runs_process and deployment.draft.device == device and model_config.dspark is not None:
        total += draft_worker_budget(model_config, service="draft", device=device, dtype=dtype,
                                     free_bytes=0).needed_bytes
    per_block = kv_block_bytes(model_config, kv.block_size_tokens, dtype_bytes(dtype, device), storage)
    return total, int(per_block * (1 + RESERVE_FRACTION)) + 1


def auto_device_blocks(free_bytes: int, memory_utilization: float, planned_bytes: int, block_bytes: int,
                       device: str) -> int:
    """Blocks of the device pool that fit; ValueError (with the figures) when not even one does."""
    from moemesh.common.placement.devices import format_bytes

    usable = int(free_bytes * memory_utilization) - planned_bytes
    blocks = usable // block_bytes
    if blocks < 1:
        raise ValueError(f"--kv-tokens auto: no room for KV on {device}: {format_bytes(free_bytes)} free x "
                         f"{memory_utilization} leaves {format_bytes(max(usable, 0))} after the workers' "
                         f"{format_bytes(planned_bytes)}; a block needs {format_bytes(block_bytes)}")
    return int(blocks)
