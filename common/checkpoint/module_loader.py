"""Fill a model module built on the meta device from a checkpoint, keeping quantized weights quantized.

Used by the attention worker (`AttentionSide`) and the draft worker (`DSparkDrafter`), whose
`state_dict()` names are hub names. Every FP8-stored linear (128x128 ue8m0 block scales) becomes an
`Fp8Linear` holding the checkpoint's e4m3 bytes and scales, copied once to the device; every other
tensor is read from the memory-mapped shard one tensor at a time, so no dense copy of a layer or of
the model is ever built: `Linear` and `Embedding` weights stored as floats narrower than the compute
dtype (bf16 on the float32 CPU path) stay as stored and are widened per call; everything else is
cast to its parameter's dtype. FP8 tensors with another block size are
dequantised (one tensor at a time) into their module's dense weight. Routed experts are read
elsewhere (`expert_stacks`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from moemesh.common.checkpoint.errors import CheckpointError
from moemesh.common.checkpoint.expert_stacks import FP8_KERNEL_BLOCK
from moemesh.common.model.inventory import StorageKind
from moemesh.common.model.linear import Embedding, Linear
from moemesh.common.model.quantized import KernelBackend, swap_fp8_linears

_STORED_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _held_dtype(module: nn.Module, name: str, reader, source: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is held in: a Linear/Embedding weight stored as a narrower float keeps it."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf != "weight" or not isinstance(owner, (Linear, Embedding)):
        return param_dtype
    stored = _STORED_FLOAT.get(reader.found_dtype(reader.spec(source).name) or "")
    if stored is None or not param_dtype.is_floating_point:
        return param_dtype
    return stored if torch.finfo(stored).bits < torch.finfo(param_dtype).bits else param_dtype


def fp8_linear_tensors(reader, names: Iterable[str], device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{hub weight name: (e4m3 weight, ue8m0 bytes)} on `device` for the FP8-stored tensors among `names`."""
    out = {}
    for name in names:
        spec = reader.spec(name)
        if spec.is_routed_expert or reader.stored_kind(name) is not StorageKind.FP8_BLOCK:
            continue
        if tuple(spec.block_size) != FP8_KERNEL_BLOCK:
            continue  # read dense below
        raw = reader.load_quantized(name)
        out[name] = (raw.weight.to(device), raw.scale.view(torch.uint8).to(device))
    return out


def fill_from_checkpoint(module: nn.Module, reader, device, *, shared: dict[str, str] | None = None,
                         backend: KernelBackend = KernelBackend.AUTO) -> nn.Module:
    """Give every meta tensor of `module` its checkpoint value on `device`; FP8 linears stay FP8.

    shared: {module tensor name: checkpoint name} for tensors stored under another name (a tied head)."""
    shared = shared or {}
    names = [name for name, tensor in module.state_dict(keep_vars=True).items() if tensor.is_meta]
    quantized = fp8_linear_tensors(reader, [shared.get(n, n) for n in names if n.endswith(".weight")], device)
    by_module_name = {n: quantized[shared.get(n, n)] for n in names if shared.get(n, n) in quantized}
    swap_fp8_linears(module, by_module_name, backend=backend)
    values = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_meta:
            continue
        source = shared.get(name, name)
        value = reader.load(source, _held_dtype(module, name, reader, source, tensor.dtype))
        if tuple(value.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: shape {list(value.shape)}, the model needs {list(tensor.shape)}")
        values[name] = value.to(device)
    module.load_state_dict(values, strict=False, assign=True)
    left = [name for name, tensor in module.state_dict(keep_vars=True).items() if tensor.is_meta]
    if left:
        raise CheckpointError(f"{left[0]}: not filled from {reader.path} ({len(left)} tensors)")
    for param in module.parameters():
        param.requires_grad_(False)
    return module


def module_weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` (each storage counted once)."""
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total
