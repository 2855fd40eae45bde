"""`moemesh attention --config FILE [--name NAME] [options]`: the attention worker's entry point.

The deployment file gives the model, device, endpoints and expert workers; the options below are
what it does not carry yet (micro-batches, placement-invariant combine). The KV pool geometry comes
from the deployment's `[kv]` table, which the router's scheduler reads too, so the two cannot
disagree; `--kv-*` override it only for router-less use (`moemesh generate --distributed`). How the
worker stores its KV rows (`--kv-dtype`, the entry's `kv_dtype`) is its own business and may be given
either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moemesh.common.model.kv_storage import KV_DTYPES, parse_kv_storage
from moemesh.common.runtime.deployment import Deployment, derive_endpoints, pick_worker
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.common.drafting.options import DraftOptions, add_draft_arguments
from moemesh.common.drafting.options import options_from_args as draft_options_from_args


@dataclass(frozen=True)
class AttentionOptions:
    num_micro_batches: int = 1
    placement_invariant: bool = False
    # None: the deployment's [kv] table, what the router uses (`moemesh attention` without --kv-*);
    # a KVPoolConfig only where no router runs (moemesh generate --distributed, its LocalCluster)
    kv: KVPoolConfig | None = field(default_factory=KVPoolConfig)
    routing_stats_out: str | None = None  # Lucebox hotness tables, written on shutdown and on request
    replica_policy: str = "least_loaded"  # how replicas of an expert share its tokens (replica_routing.py)
    # None: the deployment's [[attention]] keys (data_plane, cuda_graphs); a value given here overrides them
    data_plane: str | None = None  # "cuda_ipc": device rings shared with expert workers on the same host (cuda_ipc.py)
    cuda_graphs: bool | None = None  # decode steps replayed as CUDA graphs per batch bucket (graph_decode.py)
    kv_dtype: str | None = None  # "bf16" | "fp8": how KV rows are stored (None: the entry's kv_dtype)
    draft: DraftOptions = DraftOptions()  # the drafter's policy when it runs in this process ([draft] placement)


def add_attention_arguments(parser) -> None:
    defaults = KVPoolConfig()
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (>= 2 overlaps "
                        "one micro-batch's attention with another's expert round trip)")
    parser.add_argument("--placement-invariant", action="store_true",
                        help="experts return per-slot outputs; the attention worker sums them in expert-id order")
    parser.add_argument("--kv-block-size", type=int, default=None, help="tokens per KV block (default: the "
                        f"deployment's [kv] table; {defaults.block_size_tokens} for the others when any --kv-* is given). "
                        "Only without a router: the router reads [kv] only, set it with --set kv.KEY=VALUE")
    parser.add_argument("--kv-primary-blocks", type=int, default=None, help="blocks in the device pool (see --kv-block-size)")
    parser.add_argument("--kv-cpu-blocks", type=int, default=None, help="blocks in the CPU tier (see --kv-block-size)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                        help="how window and compressed KV rows are stored: bf16 (the compute dtype) or fp8 (584-byte "
                        "V4-Flash rows, read by the attention kernels directly); overrides the entry's kv_dtype")
    parser.add_argument("--routing-stats-out", default=None, metavar="FILE",
                        help="count expert activations per (layer, expert) and write them as Lucebox hotness tables "
                        "(FILE, FILE.prefill.csv, FILE.decode.csv) on shutdown and on a WriteRoutingStats request")
    parser.add_argument("--replica-policy", choices=("least_loaded", "round_robin"), default="least_loaded",
                        help="which copy of a replicated expert gets its tokens: the worker with the least work in "
                        "flight (default) or each copy in turn")
    parser.add_argument("--data-plane", choices=("zmq", "cuda_ipc", "mailbox"), default=None,
                        help="how Dispatch/Combine tensors travel: through ZeroMQ (default), through CUDA device "
                        "rings shared by IPC with expert workers on CUDA devices of this host, or through host-memory "
                        "mailboxes with CPU expert workers of this host (others stay on ZeroMQ)")
    parser.add_argument("--cuda-graphs", choices=("on", "off"), default=None,
                        help="replay decode steps as CUDA graphs captured per batch-size bucket (CUDA devices only; "
                        "prefill, verification and steps that fit no bucket stay eager)")
    add_draft_arguments(parser)  # used when the deployment's [draft] placement is "attention"


def _kv_from_args(args) -> KVPoolConfig | None:
    values = (args.kv_block_size, args.kv_primary_blocks, args.kv_cpu_blocks)
    if all(value is None for value in values):
        return None
    defaults = KVPoolConfig()
    return KVPoolConfig(
        block_size_tokens=defaults.block_size_tokens if args.kv_block_size is None else args.kv_block_size,
        num_primary_blocks=defaults.num_primary_blocks if args.kv_primary_blocks is None else args.kv_primary_blocks,
        num_cpu_blocks=defaults.num_cpu_blocks if args.kv_cpu_blocks is None else args.kv_cpu_blocks)


def kv_pool_config(deployment: Deployment) -> KVPoolConfig:
    """The attention worker's pool geometry from the deployment's [kv] table."""
    kv = deployment.kv
    return KVPoolConfig(block_size_tokens=kv.block_size_tokens, num_primary_blocks=kv.num_primary_blocks,
                        num_cpu_blocks=kv.num_cpu_blocks, num_primary_snapshots=kv.num_primary_snapshots,
                        num_cpu_snapshots=kv.num_cpu_snapshots)


def attention_kv_config(deployment: Deployment, entry, options: AttentionOptions) -> KVPoolConfig:
    """The worker's KV pool: geometry from --kv-* or the deployment's [kv], row storage from --kv-dtype or
    the entry's kv_dtype."""
    kv_dtype = options.kv_dtype if options.kv_dtype is not None else entry.kv_dtype
    return dataclasses.replace(options.kv or kv_pool_config(deployment), kv_storage=parse_kv_storage(kv_dtype))


def options_from_args(args) -> AttentionOptions:
    return AttentionOptions(
        num_micro_batches=args.micro_batches, placement_invariant=args.placement_invariant,
        kv=_kv_from_args(args),
        routing_stats_out=getattr(args, "routing_stats_out", None),
        replica_policy=getattr(args, "replica_policy", "least_loaded"),
        data_plane=getattr(args, "data_plane", None),
        cuda_graphs=None if getattr(args, "cuda_graphs", None) is None else args.cuda_graphs == "on",
        kv_dtype=getattr(args, "kv_dtype", None),
        draft=draft_options_from_args(args) if hasattr(args, "spec_survival_threshold") else DraftOptions())


def main(deployment: Deployment, name: str | None, log_level: str = "info",
         options: AttentionOptions = AttentionOptions()) -> int:
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.runtime.load_progress import progress_dir_for
    from moemesh.common.runtime.service import ServiceConfig, run_service
    from moemesh.common.runtime.deployment_security import socket_security_for
    from moemesh.common.wire.messages import ServiceRole
    from moemesh.services.attention.recovery import RecoveryConfig, budget_for
    from moemesh.services.attention.routing_config import RoutingStatsConfig
    from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
    from moemesh.common.placement.worker_holdings import holdings_for

    entry = pick_worker(deployment.attention, name, "attention")
    configure_logging(entry.name, deployment.paths.log_dir, log_level)
    endpoints = derive_endpoints(deployment)
    security = socket_security_for(deployment, entry.name)  # fails at start-up, before loading weights
    model_config = ModelConfig.load(deployment.model.path)
    holdings = tuple(holdings_for(w.name, w.placement, model_config.num_hidden_layers, model_config.n_routed_experts)
                     for w in deployment.expert)
    local = holdings_for(entry.name, entry.placement, model_config.num_hidden_layers, model_config.n_routed_experts)
    kv = attention_kv_config(deployment, entry, options)
    data_plane = options.data_plane if options.data_plane is not None else entry.data_plane
    cuda_graphs = options.cuda_graphs if options.cuda_graphs is not None else entry.cuda_graphs
    if options.data_plane is None and data_plane != "zmq":  # from the file: refuse a plane that cannot work
        import sys

        import structlog

        from moemesh.common.runtime.data_plane import DataPlaneRefused, check_deployment_data_plane
        try:
            check_deployment_data_plane(deployment, data_plane)
        except DataPlaneRefused as error:
            structlog.get_logger().error("attention.data_plane_refused", error=str(error))
            print(f"moemesh attention: {error}", file=sys.stderr)
            return 2
    if not _budget_fits(entry, deployment, model_config, kv, len(local.held)):
        return 3  # the plan does not fit the device: the message is on stderr and in the log
    worker = AttentionWorker(AttentionWorkerConfig(
        name=entry.name, checkpoint_path=deployment.model.path,
        expert_endpoints=tuple(endpoints.expert[w.name] for w in deployment.expert), expert_workers=holdings,
        device=entry.device, dtype=deployment.model.dtype, num_micro_batches=options.num_micro_batches,
        placement_invariant=options.placement_invariant, kv=kv, dispatch_timeout_s=deployment.timeouts.dispatch_s,
        routing_stats=RoutingStatsConfig(out_path=options.routing_stats_out),
        recovery=RecoveryConfig(budget_s=budget_for(deployment.timeouts.step_s, deployment.timeouts.dispatch_s)),
        security=security, draft_endpoint=endpoints.draft, replica_policy=options.replica_policy,
        drafter=_drafter_config(deployment, entry, model_config, options.draft, cuda_graphs),
        data_plane=data_plane, cuda_graphs=cuda_graphs, local_holdings=local))
    service_config = ServiceConfig(name=entry.name, role=ServiceRole.ATTENTION,
                                   endpoint=endpoints.attention[entry.name], supervisor_endpoint=endpoints.supervisor,
                                   device=entry.device, heartbeat_interval_s=deployment.timeouts.heartbeat_interval_s,
                                   security=security,
                                   progress_dir=str(progress_dir_for(deployment.paths.run_dir)))
    return run_service(worker, service_config)


def _drafter_config(deployment: Deployment, entry, model_config, options: DraftOptions, cuda_graphs: bool):
    """The draft worker's config for a drafter in this process ([draft] placement = "attention"), else None.
    A bad --spec-width fails here, before loading anything."""
    if not deployment.draft.in_attention:
        return None
    from moemesh.common.runtime.deployment import DeploymentError
    from moemesh.common.speculation_width import SpeculationConfig
    from moemesh.common.drafting.proposer import DrafterConfig

    if model_config.dspark is None:
        raise DeploymentError(f"model.path: {deployment.model.path} has no DSpark drafter (no dspark_* keys)")
    speculation = SpeculationConfig.for_model(options.mode, options.width, model_config.dspark.block_size,
                                              survival_threshold=options.survival_threshold)
    return DrafterConfig(name=f"{entry.name}/draft", checkpoint_path=deployment.model.path, device=entry.device,
                         dtype=deployment.model.dtype, speculation=speculation, max_support=options.max_support,
                         draft_sampling=options.draft_sampling, cuda_graphs=cuda_graphs)


def _budget_fits(entry, deployment: Deployment, model_config, kv: KVPoolConfig, num_local_pairs: int) -> bool:
    """Log `attention.memory_budget` (weights, its own routed experts, KV pools, activations) against the
    device's free memory before loading anything; False (message on stderr) when it does not fit."""
    import sys

    from moemesh.common.placement.worker_budget import attention_worker_budget, check_at_start, measure_free_bytes

    budget = attention_worker_budget(
        model_config, service="attention", device=entry.device, dtype=deployment.model.dtype,
        block_size_tokens=kv.block_size_tokens, num_primary_blocks=kv.num_primary_blocks,
        num_cpu_blocks=kv.num_cpu_blocks, free_bytes=measure_free_bytes(entry.device, entry.memory_limit),
        num_local_pairs=num_local_pairs, kv_storage=kv.kv_storage, num_primary_snapshots=kv.num_primary_snapshots,
        num_cpu_snapshots=kv.num_cpu_snapshots,
        with_drafter=deployment.draft.in_attention and model_config.dspark is not None)
    refusal = check_at_start(budget, entry.name)
    if refusal is not None:
        print(refusal, file=sys.stderr)
    return refusal is None
