"""Per-tensor formats and per-worker weight bytes of a checkpoint (`moemesh check-model`).

`tensor_rows` lists every stored logical tensor with its on-disk format and bytes (weight plus
scale). `worker_rows` gives, for each worker of a deployment TOML or a placement file, the bytes of
what it will hold as stored in the checkpoint and the bytes those weights will occupy on its device
(`common.placement.worker_budget`: FP8/FP4 at their stored bytes, `--expert-dtype` conversions, the
rest in the compute dtype; the drafter with its own embedding and head). Header reads only.
"""

from __future__ import annotations

from typing import Any

from moemesh.common.model.inventory import StorageKind

_FORMAT = {StorageKind.FP8_BLOCK: "fp8 e4m3 + ue8m0 {rows}x{cols}", StorageKind.FP4_BLOCK: "fp4 e2m1 + ue8m0 1x32"}


def tensor_format(reader, spec) -> str:
    kind = reader.stored_kind(spec.name)
    if kind is StorageKind.FP8_BLOCK:
        return _FORMAT[kind].format(rows=spec.block_size[0], cols=spec.block_size[1])
    if kind is StorageKind.FP4_BLOCK:
        return _FORMAT[kind]
    return (reader.found_dtype(spec.name) or "?").lower()


def tensor_rows(reader) -> list[dict[str, Any]]:
    rows = []
    for spec in reader.inventory.values():
        if reader.found_dtype(spec.name) is None:
            continue
        rows.append({"name": spec.name, "shape": list(spec.shape), "format": tensor_format(reader, spec),
                     "stored_bytes": reader.logical_stored_nbytes(spec.name)})
    return rows


def format_totals(rows: list[dict]) -> list[dict[str, Any]]:
    totals: dict[str, list[int]] = {}
    for row in rows:
        entry = totals.setdefault(row["format"], [0, 0])
        entry[0] += 1
        entry[1] += row["stored_bytes"]
    return [{"format": fmt, "num_tensors": count, "stored_bytes": size} for fmt, (count, size) in sorted(totals.items())]


def _expert_stored(reader, pairs) -> int:
    from moemesh.common.checkpoint.expert_stacks import expert_stored_nbytes

    return sum(expert_stored_nbytes(reader, layer, expert) for layer, expert in pairs)


def worker_rows(reader, *, deployment_path: str | None = None, placement_path: str | None = None,
                dtype: str = "auto", expert_dtype: str = "native") -> list[dict[str, Any]]:
    """One row per worker: name, role, device, num_pairs, stored_bytes, resident_bytes."""
    from moemesh.common.checkpoint.side_loading import attention_stored_bytes, drafter_stored_bytes
    from moemesh.common.placement.worker_budget import worker_resident_bytes

    config = reader.config
    rows = []

    def add(name, role, device, pairs=(), worker_dtype=dtype, worker_expert_dtype=expert_dtype):
        if role == "expert":
            stored = _expert_stored(reader, pairs)
        elif role == "attention":
            stored = attention_stored_bytes(reader) + _expert_stored(reader, pairs)
        else:
            stored = drafter_stored_bytes(reader)
        resident = worker_resident_bytes(config, role, device=device, dtype=worker_dtype, num_pairs=len(pairs),
                                         expert_dtype=worker_expert_dtype)
        rows.append({"name": name, "role": role, "device": device, "num_pairs": len(pairs),
                     "expert_dtype": worker_expert_dtype if role == "expert" else None,
                     "stored_bytes": stored, "resident_bytes": resident})

    if deployment_path is not None:
        from moemesh.common.runtime.deployment import load_deployment
        from moemesh.common.placement.worker_holdings import holdings_for

        deployment = load_deployment(deployment_path)
        for worker in deployment.attention:
            held = holdings_for(worker.name, worker.placement, config.num_hidden_layers, config.n_routed_experts).held
            add(worker.name, "attention", worker.device, held, worker_dtype=deployment.model.dtype)
        for worker in deployment.expert:
            held = holdings_for(worker.name, worker.placement, config.num_hidden_layers, config.n_routed_experts).held
            add(worker.name, "expert", worker.device, held, deployment.model.dtype, worker.expert_dtype)
        if deployment.draft.runs_process:
            add(deployment.draft.name, "draft", deployment.draft.device, worker_dtype=deployment.model.dtype)
        elif deployment.draft.in_attention:  # a drafter in every attention worker's process, on its device
            for worker in deployment.attention:
                add(f"{worker.name}/draft", "draft", worker.device, worker_dtype=deployment.model.dtype)
    elif placement_path is not None:
        from moemesh.common.placement.placement_file import read_placement, validate_placement

        placement = read_placement(placement_path)
        validate_placement(placement, config.num_hidden_layers, config.n_routed_experts)
        for worker in placement.workers:
            add(worker.name, "expert", worker.device, worker.held_ids)
    return rows
