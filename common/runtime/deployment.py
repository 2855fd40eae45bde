"""One TOML file describes a whole deployment; parsed once into frozen dataclasses.

Example (every key optional except the model path and one attention and expert worker):

    [model]
    path = "models/tiny-dsv4"
    dtype = "auto"                 # auto: float32 on CPU, bfloat16 on GPUs
    name = "org/tiny-dsv4"         # optional: the served model name (default: the directory's name)

    [paths]
    run_dir = "/tmp/moemesh"       # ipc sockets live here
    log_dir = "/tmp/moemesh/logs"

    [router]
    host = "127.0.0.1"
    port = 8000
    max_body_bytes = 33554432      # larger request bodies: 413
    max_json_depth = 64            # deeper JSON nesting: 400, found before parsing
    max_concurrent_tokenizations = 2   # worker threads parsing large bodies and tokenizing long prompts

    [network]
    base_port = 5600               # tcp ports for the internal endpoints (multi-host only)

    [timeouts]
    dispatch_s = 5.0
    step_s = 30.0
    ready_s = 600.0
    drain_s = 30.0                 # the router lets open requests finish this long on SIGTERM
    heartbeat_interval_s = 1.0
    recovery_s = 90.0              # a request waits this long for a restarting worker, then 503

    [scheduler]                    # the router's chunking of long prompts (services/router/scheduler/config.py)
    long_prefill_token_threshold = 1024   # the most tokens one prompt computes per step
    shared_prefill_token_threshold = 256  # the same while short requests are about (one arrived within the
    short_request_window_s = 2.0          # window): a short request's first token waits on a short chunk
    snapshot_interval_blocks = 16         # a long prompt's resume snapshots kept for the prefix cache
    graph_prefill_token_threshold = 64    # with CUDA graphs in every attention worker: at most this many tokens
                                          # left to compute go in graph-sized chunks (8 a step, at most 8 live
                                          # sequences); 0: never

    [warm_up]                      # synthetic steps before /health turns 200 (services/router/warm_up.py)
    mode = "auto"                  # auto: on when the attention worker runs on a CUDA device; on; off
    step_timeout_s = 600.0         # the router's step timeout while warming up (first compiles, captures)
    max_context_tokens = 0         # longest synthetic context; 0: max_model_len

    [kv]                           # KV pool geometry: the router's scheduler and every attention worker
    block_size_tokens = 128        # a multiple of every compression ratio (128 for DeepSeek-V4)
    num_primary_blocks = 256       # blocks in each attention worker's device pool
    num_cpu_blocks = 256           # blocks in the host (swap) tier; 0: preempted requests are recomputed
    num_primary_snapshots = 256    # resume snapshots on the device (window rows and compressor inputs at a block
                                   # end, for prefix hits and swap-ins; a few per running sequence plus the cache's)
    num_cpu_snapshots = 64         # resume snapshots in the host tier (one per swapped-out sequence)
    prefix_caching = true          # share full blocks between requests with the same prefix
    max_model_len = 0              # prompt + output tokens of one request; 0: the model's positions, capped
                                   # by the device pool (a larger value than either fails at start)

    [[attention]]
    name = "attention-0"
    device = "cuda:0"
    placement = "none"             # routed experts it computes itself, as [[expert]] placement (default none)
    kv_dtype = "bf16"              # window and compressed KV rows: bf16 (the activation dtype) or fp8 (584-byte rows)

    [[expert]]
    name = "expert-0"
    device = "cuda:0"
    placement = "all"              # "all", "none" (joins empty; `placement apply` gives it experts), or a file
    expert_dtype = "native"        # native (as stored), fp8 (FP4 re-encoded to FP8 e4m3 at load), bf16 (debugging)
    memory_limit = "60GiB"         # optional, any worker: cap on what it may plan on its device (default: free)

    [draft]
    enabled = true
    device = "cuda:0"
    placement = "process"          # its own service (default); "attention": inside every attention worker's
                                   # process, on its device (no feature or draft messages; device/host unused)

    [security]                     # see common/security and deploy/README.md
    keys_dir = "/etc/moemesh/keys" # CURVE on every socket; absent: plain (loopback/ipc only)
    insecure = false               # true: allow tcp beyond loopback without CURVE
    api_key_file = "/etc/moemesh/api_keys"   # gateway Bearer tokens, one per line

Overrides (`--set key=value`, dotted, list entries by index: `expert[1].device=cpu`, or
without an index when the list has one entry: `attention.device=cuda:0`) are applied to
the raw table before validation, so every error names the full key that is wrong. An index
one past the end appends an entry: `--set expert[2].name=expert-2 --set expert[2].placement=none`
starts a worker the file does not list, which registers with the router and joins empty.
Endpoints are derived in `derive_endpoints` and nowhere else.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moemesh.common.model.kv_sizing import DEFAULT_NUM_CPU_SNAPSHOTS, DEFAULT_NUM_PRIMARY_SNAPSHOTS
from moemesh.common.model.kv_storage import KV_DTYPES
from moemesh.common.runtime.toml_tables import TableError, apply_override, build_dataclass
from moemesh.common.security.cli_args import add_security_arguments


class DeploymentError(ValueError):
    """A deployment config that cannot be used; the message starts with the bad key."""


@dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str = "auto"
    name: str | None = None  # the model name clients send; None: the checkpoint directory's name


@dataclass(frozen=True)
class PathsConfig:
    run_dir: str = "/tmp/moemesh"
    log_dir: str = "/tmp/moemesh/logs"


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024
    max_json_depth: int = 64
    max_concurrent_tokenizations: int = 2


@dataclass(frozen=True)
class NetworkConfig:
    base_port: int = 5600


@dataclass(frozen=True)
class TimeoutsConfig:
    dispatch_s: float = 5.0
    step_s: float = 30.0
    ready_s: float = 600.0
    drain_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    recovery_s: float = 90.0  # how long a request waits for a restarting worker before a 503



@dataclass(frozen=True)
class SchedulingConfig:
    """The router scheduler's chunking and prefix-cache resume points ([scheduler]; the meaning of each key
    is SchedulerConfig's, services/router/scheduler/config.py)."""

    long_prefill_token_threshold: int = 1024
    shared_prefill_token_threshold: int = 256
    short_request_window_s: float = 2.0
    snapshot_interval_blocks: int = 16
    graph_prefill_token_threshold: int = 64


WARM_UP_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class WarmUpConfig:
    """The router's start-time warm-up (services/router/warm_up.py): synthetic requests through the
    scheduler and the workers before `/health` turns 200, so that first-use compiles and graph captures
    happen before any client waits on them. mode "auto": on when the first attention worker's device is
    CUDA; step_timeout_s replaces `timeouts.step_s` for the warm-up's own steps; max_context_tokens caps
    the longest synthetic context (0: max_model_len)."""

    mode: str = "auto"
    step_timeout_s: float = 600.0
    max_context_tokens: int = 0

    def enabled_for(self, attention_device: str) -> bool:
        return self.mode == "on" or (self.mode == "auto" and attention_device.startswith("cuda"))


@dataclass(frozen=True)
class KVConfig:
    """The KV pool geometry, in one place so the router's block bookkeeping and the attention
    workers' pools cannot disagree (a block id the router hands out must exist in the pool)."""

    block_size_tokens: int = 128
    num_primary_blocks: int = 256
    num_cpu_blocks: int = 256
    num_primary_snapshots: int = DEFAULT_NUM_PRIMARY_SNAPSHOTS
    num_cpu_snapshots: int = DEFAULT_NUM_CPU_SNAPSHOTS
    prefix_caching: bool = True
    max_model_len: int = 0  # 0: min(max_position_embeddings, num_primary_blocks x block_size_tokens)


@dataclass(frozen=True)
class AttentionWorkerConfig:
    name: str
    device: str = "cpu"
    host: str | None = None  # None: the router's host (single-host deployments)
    memory_limit: str | None = None  # "40GiB": plan within this much of the device (None: its free memory)
    data_plane: str = "zmq"  # "cuda_ipc": Dispatch/Combine tensors through device rings shared by CUDA IPC
    cuda_graphs: bool = False  # replay decode steps as CUDA graphs per batch bucket (CUDA devices)
    placement: str = "none"  # routed experts it holds and computes itself: "none", "all" or a placement file
    kv_dtype: str = "bf16"  # how window and compressed KV rows are stored (common/model/kv_storage.py): bf16 or fp8


@dataclass(frozen=True)
class ExpertWorkerConfig:
    name: str
    device: str = "cpu"
    placement: str = "all"  # "all", "none" or a placement file
    host: str | None = None
    memory_limit: str | None = None
    expert_dtype: str = "native"  # "native", "fp8" or "bf16": what the worker keeps of its routed experts
    endpoint: str | None = None  # bind here instead of the derived endpoint (a worker added later, other hosts)


DRAFT_PLACEMENTS = ("process", "attention")


@dataclass(frozen=True)
class DraftWorkerConfig:
    """placement "process": the draft worker is a service of its own (device, host, memory_limit
    are its); "attention": every attention worker runs the drafter in its process, on its device."""

    enabled: bool = False
    device: str = "cpu"
    name: str = "draft"
    host: str | None = None
    memory_limit: str | None = None
    placement: str = "process"

    @property
    def runs_process(self) -> bool:
        """A draft worker service runs (its endpoint, key, heartbeats, memory budget)."""
        return self.enabled and self.placement == "process"

    @property
    def in_attention(self) -> bool:
        return self.enabled and self.placement == "attention"


@dataclass(frozen=True)
class SecurityConfig:
    """CURVE between services and Bearer keys at the gateway (common/security reads it).
    `api_keys` is excluded from repr so logging a config does not print secrets."""

    keys_dir: str | None = None  # None: no CURVE; tcp beyond loopback then needs `insecure`
    allowed_clients_dir: str | None = None  # None: the public keys in keys_dir
    insecure: bool = False
    api_key_file: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Deployment:
    model: ModelConfig
    attention: tuple[AttentionWorkerConfig, ...]
    expert: tuple[ExpertWorkerConfig, ...]
    paths: PathsConfig = field(default_factory=PathsConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    draft: DraftWorkerConfig = field(default_factory=DraftWorkerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    warm_up: WarmUpConfig = field(default_factory=WarmUpConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)

    @property
    def is_multi_host(self) -> bool:
        workers = (*self.attention, *self.expert, *((self.draft,) if self.draft.runs_process else ()))
        hosts = [worker.host for worker in workers if worker.host]
        return any(host != self.router.host for host in hosts)


@dataclass(frozen=True)
class Endpoints:
    """Every internal endpoint of a deployment. `supervisor` receives Ready and Heartbeat."""

    supervisor: str
    attention: dict[str, str]  # worker name -> endpoint it binds
    expert: dict[str, str]
    draft: str | None


def derive_endpoints(deployment: Deployment) -> Endpoints:
    """ipc:// sockets under run_dir on one host; tcp:// (host:base_port + offset) when any
    worker names a host other than the router's. The one place endpoints are made."""
    _check_unique_names(deployment)
    names = ["supervisor", *(w.name for w in deployment.attention), *(w.name for w in deployment.expert)]
    if deployment.draft.runs_process:
        names.append(deployment.draft.name)
    hosts = {"supervisor": deployment.router.host}
    for worker in (*deployment.attention, *deployment.expert, deployment.draft):
        hosts[worker.name] = worker.host or deployment.router.host
    if deployment.is_multi_host:
        port_of = {name: deployment.network.base_port + offset for offset, name in enumerate(names)}
        endpoint_of = {name: f"tcp://{hosts[name]}:{port_of[name]}" for name in names}
    else:
        run_dir = Path(deployment.paths.run_dir)
        endpoint_of = {name: f"ipc://{run_dir / (name + '.sock')}" for name in names}
    return Endpoints(
        supervisor=endpoint_of["supervisor"],
        attention={w.name: endpoint_of[w.name] for w in deployment.attention},
        expert={w.name: w.endpoint or endpoint_of[w.name] for w in deployment.expert},
        draft=endpoint_of[deployment.draft.name] if deployment.draft.runs_process else None,
    )


def pick_worker(workers, name: str | None, role: str):
    """The deployment entry called `name` (or the only one when name is None)."""
    if name is None:
        if len(workers) != 1:
            raise DeploymentError(f"{role}: {len(workers)} workers configured, pass --name")
        return workers[0]
    for worker in workers:
        if worker.name == name:
            return worker
    raise DeploymentError(f"{role}: no worker named {name!r} (have {[w.name for w in workers]})")


# ------------------------------------------------------------------ loading


def load_deployment(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Deployment:
    """Read, override and validate a deployment TOML file."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise DeploymentError(f"{path}: cannot read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise DeploymentError(f"{path}: not valid TOML: {error}") from None
    return parse_deployment(raw, overrides)


EXPERT_DTYPES = ("native", "fp8", "bf16")


def parse_deployment(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Deployment:
    try:
        for override in overrides:
            apply_override(raw, override)
        deployment = build_dataclass(Deployment, raw, "")
    except TableError as error:
        raise DeploymentError(str(error)) from None
    if not deployment.attention:
        raise DeploymentError("attention: at least one attention worker is required")
    if not deployment.expert:
        raise DeploymentError("expert: at least one expert worker is required")
    if deployment.timeouts.heartbeat_interval_s <= 0:
        raise DeploymentError("timeouts.heartbeat_interval_s: must be > 0")
    if deployment.timeouts.recovery_s <= 0:
        raise DeploymentError("timeouts.recovery_s: must be > 0")
    if deployment.timeouts.drain_s < 0:
        raise DeploymentError("timeouts.drain_s: must be >= 0")
    for key in ("long_prefill_token_threshold", "shared_prefill_token_threshold", "snapshot_interval_blocks"):
        if getattr(deployment.scheduler, key) < 1:
            raise DeploymentError(f"scheduler.{key}: must be >= 1")
    if deployment.scheduler.graph_prefill_token_threshold < 0:
        raise DeploymentError("scheduler.graph_prefill_token_threshold: must be >= 0 (0: prefills never go in "
                              "graph-sized chunks)")
    if deployment.scheduler.short_request_window_s < 0:
        raise DeploymentError("scheduler.short_request_window_s: must be >= 0 (0: chunks never shrink)")
    if deployment.warm_up.mode not in WARM_UP_MODES:
        raise DeploymentError(f"warm_up.mode: {deployment.warm_up.mode!r} is not one of {', '.join(WARM_UP_MODES)}")
    if not deployment.warm_up.step_timeout_s > 0:
        raise DeploymentError("warm_up.step_timeout_s: must be > 0")
    if deployment.warm_up.max_context_tokens < 0:
        raise DeploymentError("warm_up.max_context_tokens: must be >= 0 (0: max_model_len)")
    if deployment.router.max_body_bytes < 1024:
        raise DeploymentError("router.max_body_bytes: must be >= 1024")
    if not 2 <= deployment.router.max_json_depth <= 512:
        raise DeploymentError("router.max_json_depth: must be in [2, 512]")
    if deployment.router.max_concurrent_tokenizations < 1:
        raise DeploymentError("router.max_concurrent_tokenizations: must be >= 1")
    if deployment.kv.block_size_tokens < 1:
        raise DeploymentError("kv.block_size_tokens: must be >= 1")
    if deployment.kv.num_primary_blocks < 1:
        raise DeploymentError("kv.num_primary_blocks: must be >= 1")
    for key in ("num_cpu_blocks", "num_primary_snapshots", "num_cpu_snapshots"):
        if getattr(deployment.kv, key) < 0:
            raise DeploymentError(f"kv.{key}: must be >= 0")
    if deployment.kv.max_model_len < 0 or deployment.kv.max_model_len == 1:
        raise DeploymentError("kv.max_model_len: must be 0 (from the model and the pool) or >= 2")
    pool_tokens = deployment.kv.num_primary_blocks * deployment.kv.block_size_tokens
    if deployment.kv.max_model_len > pool_tokens:
        raise DeploymentError(f"kv.max_model_len: {deployment.kv.max_model_len} tokens do not fit the device pool "
                              f"(num_primary_blocks x block_size_tokens = {pool_tokens})")
    for index, worker in enumerate(deployment.attention):
        if worker.kv_dtype not in KV_DTYPES:
            raise DeploymentError(f"attention[{index}].kv_dtype: {worker.kv_dtype!r} is not one of "
                                  f"{', '.join(KV_DTYPES)}")
    for index, worker in enumerate(deployment.expert):
        if worker.expert_dtype not in EXPERT_DTYPES:
            raise DeploymentError(f"expert[{index}].expert_dtype: {worker.expert_dtype!r} is not one of "
                                  f"{', '.join(EXPERT_DTYPES)}")
    if deployment.draft.placement not in DRAFT_PLACEMENTS:
        raise DeploymentError(f"draft.placement: {deployment.draft.placement!r} is not one of "
                              f"{', '.join(DRAFT_PLACEMENTS)}")
    _check_unique_names(deployment)
    return deployment


def _check_unique_names(deployment: Deployment) -> None:
    """Names key the endpoints and log files, so they must differ ('supervisor' is taken)."""
    seen = {"supervisor": "the supervisor endpoint"}
    keyed = [(f"attention[{i}].name", w.name) for i, w in enumerate(deployment.attention)]
    keyed += [(f"expert[{i}].name", w.name) for i, w in enumerate(deployment.expert)]
    if deployment.draft.runs_process:
        keyed.append(("draft.name", deployment.draft.name))
    for key, name in keyed:
        if name in seen:
            raise DeploymentError(f"{key}: {name!r} is already used by {seen[name]}")
        seen[name] = key


def add_deployment_arguments(parser: Any) -> None:
    """`--config PATH` and repeatable `--set KEY=VALUE` on an argparse parser."""
    parser.add_argument("--config", required=True, help="deployment TOML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key, e.g. --set attention.device=cuda:0 (repeatable)",
    )
    add_security_arguments(parser, dest="overrides")  # --keys-dir, --insecure, --api-key[-file]
