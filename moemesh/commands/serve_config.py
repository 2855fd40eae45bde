"""The deployment `moemesh serve` writes for one host: TOML text, validated by the loader.

The raw table is built here, rendered to TOML (the subset the deployment file uses:
scalars, tables, arrays of tables), written to `<run_dir>/deployment.toml` and read back
with `common.runtime.deployment.load_deployment`, so serve and every service it starts see
exactly the same, validated config. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moemesh.common.model.kv_sizing import DEFAULT_NUM_PRIMARY_SNAPSHOTS
from moemesh.common.runtime.data_plane import WorkerPlace, check_data_plane
from moemesh.common.runtime.deployment import Deployment, load_deployment
from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.wire.cuda_ipc import DataPlane

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "kjv-dsv4-mini"


DRAFT_NAME = "draft"


@dataclass(frozen=True)
class ServeLayout:
    """What `moemesh serve` was asked for; everything else keeps the deployment defaults."""

    model_path: str
    run_dir: str
    log_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    num_expert_workers: int = 1
    devices: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"
    placement_path: str | None = None  # a placement file when several expert workers split the experts
    with_drafter: bool = False  # run the DSpark drafter (on devices[0])
    draft_placement: str = "attention"  # in the attention worker's process, or "process": a draft worker of its own
    data_plane: str = "zmq"  # "cuda_ipc": Dispatch/Combine tensors through shared device rings (DataPlane)
    cuda_graphs: bool = False  # the attention worker replays decode steps as CUDA graphs
    api_key_file: str | None = None  # the gateway's Bearer keys (serve writes them to <run_dir>/api_keys)
    model_name: str | None = None  # the served model name (a hub id); None: the directory's name
    recovery_timeout_s: float | None = None  # timeouts.recovery_s; None: the deployment default
    step_timeout_s: float | None = None  # timeouts.step_s; None: the deployment default
    drain_s: float = 30.0  # the router lets open requests finish this long on SIGTERM
    router_limits: tuple[tuple[str, int], ...] = ()  # [router] request limits: (key, value), e.g. max_json_depth
    expert_dtype: str = "native"  # what expert workers keep of the routed experts (native, fp8, bf16)
    # routed experts the attention worker computes itself: "none", "all" (expert workers join empty) or a
    # placement file naming attention-0 and every expert worker (`--experts-in-attention`)
    experts_in_attention: str = "none"
    kv_dtype: str = "bf16"  # how the attention worker stores window and compressed KV rows (bf16, fp8)
    kv_num_primary_blocks: int = 256  # [kv] pool geometry (moemesh/commands/serve_kv.py sizes it)
    kv_num_cpu_blocks: int = 256
    kv_num_primary_snapshots: int = DEFAULT_NUM_PRIMARY_SNAPSHOTS  # [kv] resume snapshots on the device
    max_model_len: int = 0  # [kv] max_model_len; 0: the model's positions capped by the device pool
    warm_up: str = "auto"  # [warm_up] mode: auto (on with a CUDA attention worker), on, off
    warm_up_context_tokens: int | None = None  # [warm_up] max_context_tokens; None: max_model_len
    long_prefill_tokens: int = 1024  # [scheduler] long_prefill_token_threshold
    shared_prefill_tokens: int = 256  # [scheduler] shared_prefill_token_threshold
    graph_prefill_tokens: int = 64  # [scheduler] graph_prefill_token_threshold


def check_layout_data_plane(layout: ServeLayout) -> DataPlane:
    """The layout's data plane; `moemesh serve` runs every worker on this host."""
    experts = [WorkerPlace(f"expert-{index}", device)
               for index, device in enumerate(expert_devices(layout.devices, layout.num_expert_workers))]
    return check_data_plane(layout.data_plane, WorkerPlace("attention-0", layout.devices[0]), experts)


def expert_devices(devices: tuple[str, ...], num_workers: int) -> list[str]:
    """Expert worker i runs on devices[i mod len(devices)] (the attention worker on devices[0])."""
    return [devices[index % len(devices)] for index in range(num_workers)]


def write_split_placement(model_path: str, path: Path, how: str, num_workers: int, devices: Sequence[str]) -> str:
    """A placement file splitting the model's experts over expert-0..N-1 (round_robin or contiguous)."""
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.placement.placement_file import write_placement
    from moemesh.common.placement.worker_budget import resident_bytes_per_expert
    from moemesh.common.placement.worker_holdings import contiguous, round_robin

    config = ModelConfig.load(model_path)
    build = {"round_robin": round_robin, "contiguous": contiguous}[how]
    names = [f"expert-{index}" for index in range(num_workers)]
    # a planning figure only (one expert as the workers keep it natively); nothing is sized from it here
    write_placement(path, build(names, expert_devices(tuple(devices), num_workers), config.num_hidden_layers,
                                config.n_routed_experts, resident_bytes_per_expert(config)))
    return str(path)


def deployment_table(layout: ServeLayout) -> dict[str, Any]:
    experts = []
    for index, device in enumerate(expert_devices(layout.devices, layout.num_expert_workers)):
        placement = "all" if layout.placement_path is None else layout.placement_path
        if layout.experts_in_attention != "none":
            placement = "none" if layout.experts_in_attention == "all" else layout.experts_in_attention
        experts.append({"name": f"expert-{index}", "device": device, "placement": placement,
                        **({"expert_dtype": layout.expert_dtype} if layout.expert_dtype != "native" else {})})
    return {
        "model": {"path": layout.model_path, "dtype": layout.dtype,
                  **({"name": layout.model_name} if layout.model_name else {})},
        "paths": {"run_dir": layout.run_dir, "log_dir": layout.log_dir},
        "router": {"host": layout.host, "port": layout.port, **dict(layout.router_limits)},
        "timeouts": {"drain_s": float(layout.drain_s),
                     **({"recovery_s": float(layout.recovery_timeout_s)} if layout.recovery_timeout_s is not None else {}),
                     **({"step_s": float(layout.step_timeout_s)} if layout.step_timeout_s is not None else {})},
        "attention": [{"name": "attention-0", "device": layout.devices[0],
                       **({"data_plane": layout.data_plane} if layout.data_plane != "zmq" else {}),
                       **({"cuda_graphs": True} if layout.cuda_graphs else {}),
                       **({"placement": layout.experts_in_attention} if layout.experts_in_attention != "none" else {}),
                       **({"kv_dtype": layout.kv_dtype} if layout.kv_dtype != "bf16" else {})}],
        "expert": experts,
        "scheduler": {"long_prefill_token_threshold": layout.long_prefill_tokens,
                      "shared_prefill_token_threshold": layout.shared_prefill_tokens,
                      "graph_prefill_token_threshold": layout.graph_prefill_tokens},
        "warm_up": {"mode": layout.warm_up,
                    **({"max_context_tokens": layout.warm_up_context_tokens}
                       if layout.warm_up_context_tokens is not None else {})},
        "kv": {"num_primary_blocks": layout.kv_num_primary_blocks, "num_cpu_blocks": layout.kv_num_cpu_blocks,
               "num_primary_snapshots": layout.kv_num_primary_snapshots,
               **({"max_model_len": layout.max_model_len} if layout.max_model_len else {})},
        **({"draft": {"enabled": True, "name": DRAFT_NAME, "device": layout.devices[0],
                      "placement": layout.draft_placement}} if layout.with_drafter else {}),
        **({"security": {"api_key_file": layout.api_key_file}} if layout.api_key_file is not None else {}),
    }


def write_deployment(layout: ServeLayout) -> tuple[Path, Deployment]:
    """Write `<run_dir>/deployment.toml` and load it back (validation included). Raises
    DataPlaneRefused (a DeploymentError) before writing when the data plane cannot run."""
    check_layout_data_plane(layout)
    path = write_deployment_file(Path(layout.run_dir) / "deployment.toml", deployment_table(layout))
    return path, load_deployment(path)
