"""Whether a deployment's data plane can run where its workers are placed.

The data plane (`common.wire.cuda_ipc.DataPlane`) is how the attention worker's Dispatch/Combine
tensors reach the expert workers: ZeroMQ frames with pinned host staging, CUDA device rings
shared once by CUDA IPC, with ZeroMQ carrying only the control message (README "Fast
disaggregated path"), or mailboxes with no message per layer: host memory served by a native loop in CPU
expert workers, device memory served by a CUDA graph per step in expert workers on the attention worker's
GPU. `moemesh serve` checks its layout and the attention worker checks a deployment file with the same
rules, before anything starts. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.common.runtime.deployment import Deployment, DeploymentError
from moemesh.common.wire.cuda_ipc import DataPlane


class DataPlaneRefused(DeploymentError):
    """The deployment asks for a data plane its worker placement cannot use."""


@dataclass(frozen=True)
class WorkerPlace:
    """Where a worker runs: its torch device and host (None: the router's host)."""

    name: str
    device: str
    host: str | None = None


def _is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def parse_data_plane(data_plane: str | DataPlane) -> DataPlane:
    try:
        return DataPlane(data_plane)
    except ValueError:
        choices = ", ".join(p.value for p in DataPlane)
        raise DataPlaneRefused(f"data plane {data_plane!r} is not one of {choices}") from None


def check_data_plane(data_plane: str | DataPlane, attention: WorkerPlace, experts: Sequence[WorkerPlace]) -> DataPlane:
    """The data plane, or DataPlaneRefused saying why it cannot run.

    cuda_ipc maps device memory between processes, which CUDA allows only on one host: the attention
    worker and every expert worker must run on CUDA devices of the same host (different GPUs of that
    host are fine). The worker itself would fall back to ZeroMQ per worker at run time
    (`attention.data_plane_fallback`); refusing here turns a silent slow path into a clear error at
    start. A mixed deployment (a CPU or remote expert worker next to local GPU ones) can still pass
    `moemesh attention --data-plane cuda_ipc` to its attention worker and accept the fallback."""
    plane = parse_data_plane(data_plane)
    if plane is DataPlane.ZMQ:
        return plane
    if plane is DataPlane.MAILBOX:
        return _check_mailbox(attention, experts)
    if not _is_cuda(attention.device):
        raise DataPlaneRefused(f"data plane cuda_ipc needs the attention worker on a CUDA device: "
                               f"{attention.name} is on {attention.device!r}")
    for expert in experts:
        if expert.host != attention.host:
            raise DataPlaneRefused(
                f"data plane cuda_ipc needs every expert worker on the attention worker's host: {expert.name} "
                f"is on host {expert.host or 'of the router'}, {attention.name} on {attention.host or 'of the router'}")
        if not _is_cuda(expert.device):
            raise DataPlaneRefused(f"data plane cuda_ipc needs every expert worker on a CUDA device: {expert.name} "
                                   f"is on {expert.device!r} (use zmq, or give it a GPU)")
    return plane


def _same_gpu(a: str, b: str) -> bool:
    return _is_cuda(a) and _is_cuda(b) and (a == b or "cuda" in (a, b))


def _check_mailbox(attention: WorkerPlace, experts: Sequence[WorkerPlace]) -> DataPlane:
    """mailbox: the CPU expert workers of the attention worker's host (host memory) and the expert workers on
    the attention worker's own GPU (device memory, CUDA IPC) take it; workers elsewhere stay on ZeroMQ (each
    refuses the offer), so at least one must qualify."""
    if not any(expert.host == attention.host and (expert.device == "cpu" or _same_gpu(expert.device, attention.device))
               for expert in experts):
        raise DataPlaneRefused(f"data plane mailbox needs an expert worker on the CPU of {attention.name}'s host or "
                               f"on its GPU ({attention.device}); the expert workers are on "
                               f"{sorted({e.device for e in experts}) or 'no device'}")
    return DataPlane.MAILBOX


def check_deployment_data_plane(deployment: Deployment, data_plane: str | DataPlane) -> DataPlane:
    """`check_data_plane` for every attention worker of a deployment file against all its expert workers."""
    router_host = deployment.router.host  # a worker without a host runs on the router's

    def place(worker) -> WorkerPlace:
        return WorkerPlace(worker.name, worker.device, worker.host or router_host)

    plane = parse_data_plane(data_plane)
    experts = [place(w) for w in deployment.expert]
    for worker in deployment.attention:
        check_data_plane(plane, place(worker), experts)
    return plane
