"""`python -m moemesh.bench.fullsize_expert --config FILE --name NAME --timing-dir DIR`: a timed expert worker.

The moemesh expert worker (`ExpertWorker`, loading its pairs from the deployment's checkpoint), built as
`services.expert.main` builds it, that also records every Dispatch it answers: step, layer, tokens,
selected slots, distinct experts touched (so bytes read are counted, not estimated), and the
monotonic clock at arrival and when the answer is ready (after a device sync on CUDA, so it is the
compute time). `time.perf_counter` is CLOCK_MONOTONIC on Linux, shared by every process of the host,
so the benchmark can line these up with the attention worker's own timestamps. On every
QueryInventory the records are written to DIR/NAME.json and cleared (the benchmark asks after each
measured run); nothing is written per dispatch. A refused Dispatch (an ErrorReply, e.g. not_found)
also keeps what arrived (ids, slot mask; at most `_MAX_REFUSED` of them), so the benchmark can put it
next to what the attention side sent (`bench.fullsize_verify.explain_refusals`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moemesh.common.wire.messages import ErrorReply
from moemesh.services.expert.worker import ExpertWorker

_MAX_REFUSED = 20


class TimedExpertWorker(ExpertWorker):
    def __init__(self, config, model_config=None, timing_path: Path | None = None) -> None:
        super().__init__(config, model_config)
        self.timing_path = timing_path
        self.records: list[list[float]] = []
        self.refused: list[dict] = []  # received content of refused Dispatches (see the module docstring)

    def handle_dispatch(self, dispatch):
        began_s = time.perf_counter()
        reply = super().handle_dispatch(dispatch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ended_s = time.perf_counter()
        mask = dispatch.slot_mask
        ids = dispatch.expert_ids
        selected = ids[mask] if mask is not None else ids.reshape(-1)
        if isinstance(reply, ErrorReply) and len(self.refused) < _MAX_REFUSED:
            self.refused.append({"dispatch_id": dispatch.dispatch_id, "step_id": dispatch.step_id,
                                 "layer": dispatch.layer, "expert_ids": ids.tolist(),
                                 "slot_mask": None if mask is None else mask.int().tolist(),
                                 "code": str(reply.code), "message": reply.message[:300]})
        num_touched = int(torch.unique(selected).numel()) if selected.numel() else 0
        self.records.append([dispatch.step_id, dispatch.layer, dispatch.micro_batch, int(ids.shape[0]),
                             int(selected.numel()), num_touched, began_s, ended_s])
        return reply

    def inventory(self):
        if self.timing_path is not None:
            payload = {"name": self.config.name, "device": str(self.device),
                       "fields": ["step_id", "layer", "micro_batch", "num_tokens", "num_slots", "num_experts",
                                  "began_s", "ended_s"],
                       "bytes_per_expert": self._bytes_per_expert(), "records": self.records,
                       "num_threads": (runner.num_threads if (runner := getattr(self, "_cpu_runner", None))
                                       is not None else torch.get_num_threads()),
                       "num_empty_selections": getattr(self, "num_empty_selections", None),
                       "refused": self.refused}
            self.timing_path.write_text(json.dumps(payload), encoding="utf-8")
            self.records = []
            self.refused = []
        return super().inventory()

    def _bytes_per_expert(self) -> int:
        """What one held expert occupies on this worker (its weights over its pairs)."""
        num_pairs = len(self.holdings)
        return self.holdings.resident_bytes() // num_pairs if num_pairs else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--timing-dir", required=True)
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch threads of a CPU worker")
    args = parser.parse_args(argv)

    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.deployment import derive_endpoints, load_deployment
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.runtime.service import ServiceConfig, run_service
    from moemesh.common.wire.messages import ServiceRole
    from moemesh.common.runtime.deployment import pick_worker
    from moemesh.common.placement.worker_holdings import holdings_for
    from moemesh.services.expert.worker import ExpertWorkerConfig

    deployment = load_deployment(args.config)
    entry = pick_worker(deployment.expert, args.name, "expert")
    configure_logging(entry.name, deployment.paths.log_dir, args.log_level)
    endpoints = derive_endpoints(deployment)
    model_config = ModelConfig.load(deployment.model.path)
    pairs = holdings_for(entry.name, entry.placement, model_config.num_hidden_layers,
                         model_config.n_routed_experts).held
    if torch.device(entry.device).type == "cuda":
        torch.cuda.set_device(torch.device(entry.device))
    elif args.cpu_threads:  # leave cores to the attention worker and the GPU expert worker
        torch.set_num_threads(args.cpu_threads)
    worker = TimedExpertWorker(ExpertWorkerConfig(name=entry.name, checkpoint_path=deployment.model.path,
                                                  device=entry.device, dtype=deployment.model.dtype,
                                                  pairs=tuple(pairs)),
                               model_config, timing_path=Path(args.timing_dir) / f"{entry.name}.json")
    service_config = ServiceConfig(name=entry.name, role=ServiceRole.EXPERT, endpoint=endpoints.expert[entry.name],
                                   supervisor_endpoint=endpoints.supervisor, device=entry.device,
                                   heartbeat_interval_s=deployment.timeouts.heartbeat_interval_s)
    return run_service(worker, service_config)


if __name__ == "__main__":
    sys.exit(main())
