"""FP8 linears kept quantized on the device (the routed experts' counterpart: `quantized_experts`).

`Fp8Linear` / `Fp8GroupedLinear` are drop-ins for `Linear` / `GroupedLinear` (same forward
signature, same math) that hold the checkpoint's FP8 e4m3 weight and ue8m0 128x128 block scales.

Backends (`KernelBackend`): on CUDA with bf16/fp16 activations the Triton kernels (`common.kernels.fp8_linear`,
`common.kernels.fp4_experts`) convert weights in registers, so device memory holds 1 byte (FP8) per
parameter; elsewhere the weight is dequantised to the activation dtype and multiplied with torch (the CPU
float32 path: `F.linear` on the same values as `Linear` on dequantised weights). A small CPU weight keeps its
dequantised copy (`linear.KeptWideWeight`); a larger one materialises a block of 1024 output rows at a time,
so the model is never dequantised as a whole.

`swap_fp8_linears` does the module surgery on an `AttentionSide` from outside, so the model files
stay untouched.
Legend: T tokens, N out features, K in features, G groups.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.kernels.reference import dequant_fp8_blockwise, scale_bytes
from moemesh.common.model.linear import GroupedLinear, KeptWideWeight, Linear

FP8_BLOCK = 128
TORCH_BLOCK_ROWS = 8 * FP8_BLOCK  # output rows dequantised at once on the torch (CPU) path


class KernelBackend(enum.Enum):
    AUTO = "auto"  # Triton kernels on CUDA tensors, torch dequantise + matmul elsewhere
    KERNEL = "kernel"  # always the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)
    TORCH = "torch"  # always dequantise + torch matmul


def _use_kernel(backend: KernelBackend, x: torch.Tensor) -> bool:
    """AUTO runs the Triton kernels for 16-bit activations on CUDA only: with fp32 activations their
    prefill tiles need more shared memory than an H200 has (measured: 286,720 > 232,448 bytes)."""
    if backend is KernelBackend.AUTO:
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    return backend is KernelBackend.KERNEL


def _as_e4m3(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.dtype == torch.float8_e4m3fn else weight.view(torch.float8_e4m3fn)


class Fp8Linear(nn.Module):
    """y = x · dequant(W)ᵀ with W kept FP8 e4m3 [N, K] and ue8m0 scales [ceil(N/128), ceil(K/128)].

    Buffers (not parameters: nothing here is trained) `weight` (float8_e4m3fn) and `scale` (uint8
    bytes). Output dtype = input dtype, as `Linear`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, *,
                 backend: KernelBackend = KernelBackend.AUTO) -> None:
        super().__init__()
        num_out, num_in = weight.shape
        expected = (-(-num_out // FP8_BLOCK), -(-num_in // FP8_BLOCK))
        if tuple(scale.shape) != expected:
            raise ValueError(f"scale {tuple(scale.shape)} does not match weight {tuple(weight.shape)}: {expected}")
        self.in_features = num_in
        self.out_features = num_out
        self.backend = backend
        self.register_buffer("weight", _as_e4m3(weight).contiguous())
        self.register_buffer("scale", scale_bytes(scale).contiguous())
        self._dense = KeptWideWeight()  # a small CPU linear's dequantised weight (linear.py)

    @property
    def num_bytes(self) -> int:
        """Bytes one forward reads from device memory for the weight (FP8 + scales)."""
        return self.weight.numel() + self.scale.numel()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequant_fp8_blockwise(self.weight, self.scale).to(dtype)

    def _cpu_dense(self, x: torch.Tensor) -> torch.Tensor | None:
        """[N, K] the dequantised weight in x's dtype, kept after the first call (exact: e4m3 times a power of
        two), when x and the weight are on the CPU and it is small (linear.CPU_WIDE_WEIGHT_MAX_BYTES: a step
        then does not dequantise it again, which for a small model costs ~30x the GEMV); None otherwise."""
        return self._dense.get(x, (self.weight, self.scale), self.weight.numel(), self.dequantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if _use_kernel(self.backend, x):
            from moemesh.common.kernels.fp8_dequant import fp8_linear_dequant, use_dequant_linear
            from moemesh.common.kernels.fp8_linear import fp8_linear

            if use_dequant_linear(x.numel() // self.in_features):  # prefill: transient bf16 weight + cuBLAS
                return fp8_linear_dequant(x, self.weight, self.scale)
            return fp8_linear(x, self.weight, self.scale)
        return self._blocked_linear(x)

    def _blocked_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path: the kept dense weight of a small CPU linear; otherwise `TORCH_BLOCK_ROWS` output rows
        at a time, each row block dequantised into a small fp32 scratch (exact: e4m3 times a power of two), so
        no full dequantised matrix is built."""
        dense = self._cpu_dense(x)
        if dense is not None:
            return F.linear(x, dense)
        if self.out_features <= TORCH_BLOCK_ROWS:
            return F.linear(x, self.dequantized(x.dtype))
        out = x.new_empty(*x.shape[:-1], self.out_features)  # [..., N]
        for start in range(0, self.out_features, TORCH_BLOCK_ROWS):
            stop = min(start + TORCH_BLOCK_ROWS, self.out_features)
            rows = dequant_fp8_blockwise(self.weight[start:stop],
                                         self.scale[start // FP8_BLOCK:-(-stop // FP8_BLOCK)])  # [B, K] fp32
            out[..., start:stop] = F.linear(x, rows.to(x.dtype))
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128"


class Fp8GroupedLinear(Fp8Linear):
    """FP8 form of `GroupedLinear` (`wo_a`): weight [G·O, I] viewed [G, O, I]; x [T, G, I] -> [T, G·O].

    On the kernel path the G groups are G "experts" of the grouped FP8 kernel (rows sorted by
    group = the transposed input), one launch; that needs O % 128 == 0 (each group owns whole
    scale rows) and I % 128 == 0, else the torch path runs."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, num_groups: int, *,
                 backend: KernelBackend = KernelBackend.AUTO) -> None:
        super().__init__(weight, scale, backend=backend)
        if self.out_features % num_groups:
            raise ValueError(f"out_features={self.out_features} not divisible by num_groups={num_groups}")
        self.num_groups = num_groups
        self.out_per_group = self.out_features // num_groups
        self._kernel_ok = self.out_per_group % FP8_BLOCK == 0 and self.in_features % FP8_BLOCK == 0
        self._offsets: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _group_rows(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([G + 1] int32 row offsets g·T of the rows sorted by group, [G·T] int32 row ids: sorted row g·T + t is
        row t·G + g of x viewed [T·G, I], and of the output viewed [T·G, O]), kept per (T, device) so a step
        launches nothing to rebuild them. Not kept when first built inside a CUDA-graph capture (its kernels
        are only recorded there, so the tensors hold no values outside the replay)."""
        key = (num_tokens, device)
        rows = self._offsets.get(key)
        if rows is None:
            offsets = torch.arange(0, self.num_groups + 1, device=device, dtype=torch.int32) * num_tokens
            tokens = torch.arange(num_tokens, device=device, dtype=torch.int32)
            groups = torch.arange(self.num_groups, device=device, dtype=torch.int32)
            row_ids = (tokens[None, :] * self.num_groups + groups[:, None]).reshape(-1)  # [G·T], group-major
            rows = (offsets, row_ids)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._offsets[key] = rows
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # T tokens, G groups, I input per group, O output per group
        num_tokens = x.shape[0]
        if self._kernel_ok and _use_kernel(self.backend, x):
            from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat, grouped_down
            from moemesh.common.kernels.fp8_dequant import dequant_fp8, use_dequant_linear

            if use_dequant_linear(num_tokens):  # prefill: transient 16-bit weight + batched cuBLAS
                weight = dequant_fp8(self.weight, self.scale, x.dtype).view(self.num_groups, -1, self.in_features)
                y = torch.bmm(x.transpose(0, 1), weight.transpose(1, 2))  # [G, T, O]
                return y.transpose(0, 1).reshape(num_tokens, -1)

            g, o, i = self.num_groups, self.out_per_group, self.in_features
            w = self.weight.view(g, o, i)
            s = self.scale.view(g, o // FP8_BLOCK, -1)
            stacked = ExpertWeights(w, s, w, s, w, s, WeightFormat.FP8_E4M3)
            offsets, row_ids = self._group_rows(num_tokens, x.device)
            y = grouped_down(x.reshape(num_tokens * g, i), offsets, stacked, x_row_ids=row_ids,
                             out_row_ids=row_ids)  # [T·G, O]: rows read and written in place, no transposes
            return y.view(num_tokens, g * o)
        dense = self._cpu_dense(x)
        weight = (dense if dense is not None else self.dequantized(x.dtype))
        weight = weight.view(self.num_groups, -1, self.in_features).transpose(1, 2)  # [G, I, O]
        y = torch.bmm(x.transpose(0, 1), weight)  # [G, T, O]
        return y.transpose(0, 1).reshape(num_tokens, -1)


def swap_fp8_linears(module: nn.Module, quantized: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *,
                     backend: KernelBackend = KernelBackend.AUTO, strict: bool = True) -> list[str]:
    """Replace, in place, every `Linear`/`GroupedLinear` (or already FP8) submodule whose `<name>.weight` is a key of
    `quantized` ({hub weight name: (fp8 weight, ue8m0 scale)}) by an `Fp8Linear`/`Fp8GroupedLinear`.

    Works on any module with hub-named submodules (an `AttentionSide`: `layers.3.attn.wq_b.weight`).
    Shapes must match the module being replaced. With `strict`, a key naming no Linear raises
    KeyError. Returns the swapped module names in module order."""
    swapped = []
    targets = {name.removesuffix(".weight"): pair for name, pair in quantized.items()}
    for name, child in list(module.named_modules()):
        if name not in targets or not isinstance(child, (Linear, Fp8Linear)):
            continue
        weight, scale = targets[name]
        if tuple(weight.shape) != (child.out_features, child.in_features):
            raise ValueError(f"{name}: FP8 weight {tuple(weight.shape)} for a "
                             f"[{child.out_features}, {child.in_features}] linear")
        if isinstance(child, (GroupedLinear, Fp8GroupedLinear)):
            replacement: Fp8Linear = Fp8GroupedLinear(weight, scale, child.num_groups, backend=backend)
        else:
            replacement = Fp8Linear(weight, scale, backend=backend)
        module.set_submodule(name, replacement)
        swapped.append(name)
    if strict and len(swapped) != len(targets):
        missing = sorted(set(targets) - set(swapped))
        raise KeyError(f"no Linear submodule for {missing[:10]}")
    return swapped
