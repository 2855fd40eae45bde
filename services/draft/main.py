"""`moemesh draft --config FILE [options]`: the DSpark draft worker's entry point.

The deployment file gives the model, the `[draft]` entry (device, name) and the endpoints; the
options (common/drafting/options.py) carry the speculation policy, which `moemesh serve` forwards to
the drafter it starts. Width checks against `dspark_block_size` happen here, before anything binds, so a bad
`--spec-width` fails at start with the message from width.py.
"""

from __future__ import annotations

from moemesh.common.drafting.options import DraftOptions
from moemesh.common.runtime.deployment import Deployment, DeploymentError, derive_endpoints


def run(deployment: Deployment, name: str | None = None, log_level: str = "info",
        options: DraftOptions = DraftOptions()) -> int:
    """Load the drafter named by the deployment's `[draft]` entry and serve until drained."""
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.load_progress import progress_dir_for
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.runtime.service import ServiceConfig, run_service
    from moemesh.common.wire.messages import ServiceRole
    from moemesh.common.speculation_width import SpeculationConfig
    from moemesh.common.drafting.proposer import DrafterConfig
    from moemesh.services.draft.worker import DraftWorker

    entry = deployment.draft
    if not entry.enabled:
        raise DeploymentError("draft.enabled: the deployment has no draft worker (set [draft] enabled = true)")
    if not entry.runs_process:
        raise DeploymentError(f"draft.placement: {entry.placement!r}: the drafter runs inside the attention workers, "
                              "there is no draft service to start")
    if name is not None and name != entry.name:
        raise DeploymentError(f"draft.name: no draft worker named {name!r} (have {entry.name!r})")
    configure_logging(entry.name, deployment.paths.log_dir, log_level)
    model_config = ModelConfig.load(deployment.model.path)
    block_size = model_config.dspark.block_size if model_config.dspark is not None else None
    speculation = SpeculationConfig.for_model(options.mode, options.width, block_size,
                                              survival_threshold=options.survival_threshold)
    if block_size is None:
        raise DeploymentError(f"model.path: {deployment.model.path} has no DSpark drafter (no dspark_* keys)")
    if not _budget_fits(entry, deployment, model_config):
        return 3  # the drafter does not fit its device: the message is on stderr and in the log
    endpoints = derive_endpoints(deployment)
    worker = DraftWorker(DrafterConfig(name=entry.name, checkpoint_path=deployment.model.path, device=entry.device,
                                           dtype=deployment.model.dtype, speculation=speculation,
                                           max_support=options.max_support,
                                           draft_sampling=options.draft_sampling))
    service_config = ServiceConfig(name=entry.name, role=ServiceRole.DRAFT, endpoint=endpoints.draft,
                                   supervisor_endpoint=endpoints.supervisor, device=entry.device,
                                   heartbeat_interval_s=deployment.timeouts.heartbeat_interval_s,
                                   progress_dir=str(progress_dir_for(deployment.paths.run_dir)))
    return run_service(worker, service_config)


def _budget_fits(entry, deployment: Deployment, model_config) -> bool:
    """Log `draft.memory_budget` (drafter weights, activations) against the device's free memory
    before loading; False (message on stderr) when it does not fit."""
    import sys

    from moemesh.common.placement.worker_budget import check_at_start, draft_worker_budget, measure_free_bytes

    budget = draft_worker_budget(model_config, service="draft", device=entry.device, dtype=deployment.model.dtype,
                                 free_bytes=measure_free_bytes(entry.device, entry.memory_limit))
    refusal = check_at_start(budget, entry.name)
    if refusal is not None:
        print(refusal, file=sys.stderr)
    return refusal is None
