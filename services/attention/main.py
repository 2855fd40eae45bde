"""`moemesh attention --config FILE [--name NAME] [options]`: the attention worker's entry point.

The deployment file gives the model, device, endpoints and expert workers; the options below are
what it does not carry yet (micro-batches, placement-invariant combine, KV pool geometry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.runtime.deployment import Deployment, derive_endpoints
from services.attention.kv_config import KVPoolConfig


@dataclass(frozen=True)
class AttentionOptions:
    num_micro_batches: int = 1
    placement_invariant: bool = False
    kv: KVPoolConfig = field(default_factory=KVPoolConfig)


def add_attention_arguments(parser) -> None:
    defaults = KVPoolConfig()
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (>= 2 overlaps "
                        "one micro-batch's attention with another's expert round trip)")
    parser.add_argument("--placement-invariant", action="store_true",
                        help="experts return per-slot outputs; the attention worker sums them in expert-id order")
    parser.add_argument("--kv-block-size", type=int, default=defaults.block_size_tokens, help="tokens per KV block")
    parser.add_argument("--kv-primary-blocks", type=int, default=defaults.num_primary_blocks,
                        help="blocks in the device pool")
    parser.add_argument("--kv-cpu-blocks", type=int, default=defaults.num_cpu_blocks, help="blocks in the CPU tier")


def options_from_args(args) -> AttentionOptions:
    return AttentionOptions(
        num_micro_batches=args.micro_batches, placement_invariant=args.placement_invariant,
        kv=KVPoolConfig(block_size_tokens=args.kv_block_size, num_primary_blocks=args.kv_primary_blocks,
                        num_cpu_blocks=args.kv_cpu_blocks))


def main(deployment: Deployment, name: str | None, log_level: str = "info",
         options: AttentionOptions = AttentionOptions()) -> int:
    from common.model.config import ModelConfig
    from common.runtime.logging import configure_logging
    from common.runtime.service import ServiceConfig, run_service
    from common.wire.messages import ServiceRole
    from services.attention.worker import AttentionWorker, AttentionWorkerConfig
    from services.expert.main import pick_worker
    from services.expert.placement import holdings_for

    entry = pick_worker(deployment.attention, name, "attention")
    configure_logging(entry.name, deployment.paths.log_dir, log_level)
    endpoints = derive_endpoints(deployment)
    model_config = ModelConfig.load(deployment.model.path)
    holdings = tuple(holdings_for(w.name, w.placement, model_config.num_hidden_layers, model_config.n_routed_experts)
                     for w in deployment.expert)
    worker = AttentionWorker(AttentionWorkerConfig(
        name=entry.name, checkpoint_path=deployment.model.path,
        expert_endpoints=tuple(endpoints.expert[w.name] for w in deployment.expert), expert_workers=holdings,
        device=entry.device, dtype=deployment.model.dtype, num_micro_batches=options.num_micro_batches,
        placement_invariant=options.placement_invariant, kv=options.kv, dispatch_timeout_s=deployment.timeouts.dispatch_s))
    service_config = ServiceConfig(name=entry.name, role=ServiceRole.ATTENTION,
                                   endpoint=endpoints.attention[entry.name], supervisor_endpoint=endpoints.supervisor,
                                   device=entry.device, heartbeat_interval_s=deployment.timeouts.heartbeat_interval_s)
    return run_service(worker, service_config)
