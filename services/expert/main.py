"""`moemesh expert --config FILE [--name NAME]`: build the worker's config from the deployment, serve."""

from __future__ import annotations

from moemesh.common.runtime.deployment import Deployment, derive_endpoints, pick_worker


def main(deployment: Deployment, name: str | None, log_level: str = "info", expert_dtype: str | None = None) -> int:
    """Run the expert worker `name`; `expert_dtype` (the command line's) overrides the deployment's."""
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.runtime.load_progress import progress_dir_for
    from moemesh.common.runtime.service import ServiceConfig, run_service
    from moemesh.common.wire.messages import ServiceRole
    from moemesh.common.placement.worker_holdings import holdings_for
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    from moemesh.common.runtime.deployment_security import socket_security_for

    entry = pick_worker(deployment.expert, name, "expert")
    configure_logging(entry.name, deployment.paths.log_dir, log_level)
    endpoints = derive_endpoints(deployment)
    security = socket_security_for(deployment, entry.name)  # fails at start-up, before loading weights
    model_config = ModelConfig.load(deployment.model.path)
    pairs = holdings_for(entry.name, entry.placement, model_config.num_hidden_layers,
                         model_config.n_routed_experts).held
    expert_dtype = expert_dtype or entry.expert_dtype
    budget = _startup_budget(entry, deployment, model_config, len(pairs), expert_dtype)
    if budget is None:
        return 3  # the plan does not fit the device: the message is on stderr and in the log
    worker = ExpertWorker(ExpertWorkerConfig(name=entry.name, checkpoint_path=deployment.model.path,
                                             device=entry.device, dtype=deployment.model.dtype, pairs=tuple(pairs),
                                             expert_dtype=expert_dtype, expert_budget_bytes=budget),
                          model_config)
    service_config = ServiceConfig(name=entry.name, role=ServiceRole.EXPERT, endpoint=endpoints.expert[entry.name],
                                   supervisor_endpoint=endpoints.supervisor, device=entry.device,
                                   heartbeat_interval_s=deployment.timeouts.heartbeat_interval_s, security=security,
                                   progress_dir=str(progress_dir_for(deployment.paths.run_dir)))
    return run_service(worker, service_config)


def _startup_budget(entry, deployment: Deployment, model_config, num_pairs: int, expert_dtype: str) -> int | None:
    """Log `expert.memory_budget` and check it before loading anything: the bytes left for routed experts after the rest of the plan, or None (message on stderr) when
    the worker's pairs do not fit its device's free memory (or `memory_limit`)."""
    import sys

    from moemesh.common.placement.worker_budget import (
        check_at_start, expert_headroom_bytes, expert_worker_budget, measure_free_bytes,
    )

    budget = expert_worker_budget(model_config, service="expert", device=entry.device, dtype=deployment.model.dtype,
                                  num_pairs=num_pairs, free_bytes=measure_free_bytes(entry.device, entry.memory_limit),
                                  expert_dtype=expert_dtype)
    refusal = check_at_start(budget, entry.name)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return None
    return expert_headroom_bytes(budget)
