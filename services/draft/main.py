"""`moemesh draft --config FILE [options]`: the DSpark draft worker's entry point.

The deployment file gives the model, the `[draft]` entry (device, name) and the endpoints; the
options below carry the speculation policy, which `moemesh serve` forwards to the drafter it
starts. Width checks against `dspark_block_size` happen here, before anything binds, so a bad
`--spec-width` fails at start with the message from width.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.runtime.deployment import Deployment, DeploymentError, derive_endpoints
from moemesh.common.speculation_width import DEFAULT_SURVIVAL_THRESHOLD, SpeculationMode

DEFAULT_MAX_SUPPORT = 64  # mirrors services.draft.worker (which imports torch; this module must not)


@dataclass(frozen=True)
class DraftOptions:
    """Command-line choices; mode / width None take the model's defaults (SpeculationConfig.for_model)."""

    mode: SpeculationMode | None = None
    width: int | None = None
    survival_threshold: float = DEFAULT_SURVIVAL_THRESHOLD
    max_support: int | None = DEFAULT_MAX_SUPPORT


def add_draft_arguments(parser) -> None:
    parser.add_argument("--speculation", choices=[mode.value for mode in SpeculationMode], default=None,
                        help="off, fixed or adaptive (default: adaptive when the checkpoint has a drafter)")
    parser.add_argument("--spec-width", type=int, default=None,
                        help="drafts per request (fixed) or their cap (adaptive); at most dspark_block_size")
    parser.add_argument("--spec-survival-threshold", type=float, default=DEFAULT_SURVIVAL_THRESHOLD,
                        help="adaptive mode stops where the cumulative survival probability drops below this")
    parser.add_argument("--draft-support", type=int, default=DEFAULT_MAX_SUPPORT,
                        help="tokens kept in a sampled draft's proposal distribution (0: full vocabulary)")


def options_from_args(args) -> DraftOptions:
    return DraftOptions(mode=SpeculationMode(args.speculation) if args.speculation else None, width=args.spec_width,
                        survival_threshold=args.spec_survival_threshold,
                        max_support=args.draft_support if args.draft_support and args.draft_support > 0 else None)


def run(deployment: Deployment, name: str | None = None, log_level: str = "info",
        options: DraftOptions = DraftOptions()) -> int:
    """Load the drafter named by the deployment's `[draft]` entry and serve until drained."""
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.load_progress import progress_dir_for
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.runtime.service import ServiceConfig, run_service
    from moemesh.common.wire.messages import ServiceRole
    from moemesh.common.speculation_width import SpeculationConfig
    from moemesh.services.draft.worker import DraftWorker, DraftWorkerConfig

    entry = deployment.draft
    if not entry.enabled:
        raise DeploymentError("draft.enabled: the deployment has no draft worker (set [draft] enabled = true)")
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
    worker = DraftWorker(DraftWorkerConfig(name=entry.name, checkpoint_path=deployment.model.path, device=entry.device,
                                           dtype=deployment.model.dtype, speculation=speculation,
                                           max_support=options.max_support))
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
