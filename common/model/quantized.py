"""Quantized weights kept quantized on the device: FP8 linears and stacked FP4 routed experts.

`Fp8Linear` / `Fp8GroupedLinear` are drop-ins for `Linear` / `GroupedLinear` (same forward
signature, same math) that hold the checkpoint's FP8 e4m3 weight and ue8m0 128x128 block scales.
`QuantizedRoutedExperts` has the exact interface of `RoutedExperts` and holds each layer's experts
stacked (FP4 e2m1 packed + ue8m0 1x32 scales, or FP8), as the grouped kernel reads them.

Backends (`KernelBackend`): on CUDA with bf16/fp16 activations the Triton kernels (`common.kernels.fp8_linear`,
`common.kernels.fp4_experts`) convert weights in registers, so device memory holds 1 byte (FP8) or
~0.53 byte (FP4 + scales) per parameter; elsewhere the weight is dequantised per call to the
activation dtype and multiplied with torch (the CPU float32 path: `F.linear` on the same values as
`Linear` on dequantised weights). The model is never dequantised as a whole: the torch path
materialises a block of 1024 output rows of an FP8 linear, or one expert, at a time.

The CUDA routed-expert path never synchronises with the host (no `.item()`, `unique`,
`nonzero`, `bincount`), so a decode step that uses it can be captured in a CUDA graph.
`swap_fp8_linears` does the module surgery on an `AttentionSide` from outside, so the model files
stay untouched.
Legend: T tokens, K top-k, E experts (held, stacked), R = T·K routed rows, D hidden, I expert width,
N out features, G groups.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.kernels.moe_layout import ExpertLayout, sum_slots_in_order
from moemesh.common.kernels.reference import dequant_fp4, dequant_fp8_blockwise, scale_bytes
from moemesh.common.model.linear import GroupedLinear, KeptWideWeight, Linear
from moemesh.common.model.moe import ExpertNotHeld, RouteLayoutHandoff, _swiglu

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


# ------------------------------------------------------------------------------------------ experts
class ExpertFormat(enum.Enum):
    FP4 = "fp4"  # w [E, N, K/2] packed e2m1 (low nibble = even column), s [E, N, K/32] ue8m0
    FP8 = "fp8"  # w [E, N, K] e4m3, s [E, ceil(N/128), ceil(K/128)] ue8m0


def _dequant_stacked(w: torch.Tensor, s: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """One expert's (or a stack's) weight -> fp32."""
    if fmt is ExpertFormat.FP4:
        return dequant_fp4(w, s)
    if w.dim() == 2:
        return dequant_fp8_blockwise(w, s)
    return torch.stack([dequant_fp8_blockwise(w[e], s[e]) for e in range(w.shape[0])])


class _LayerExperts:
    """One layer's held experts: stacked weights and the global-id -> stack-index map."""

    def __init__(self, expert_ids: Sequence[int], tensors: Sequence[torch.Tensor], fmt: ExpertFormat,
                 num_routed_experts: int) -> None:
        self.expert_ids = sorted(int(e) for e in expert_ids)
        if list(expert_ids) != self.expert_ids or len(set(self.expert_ids)) != len(self.expert_ids):
            raise ValueError("expert ids of a layer must be given ascending and distinct")
        self.fmt = fmt
        self.w1, self.s1, self.w2, self.s2, self.w3, self.s3 = (t.contiguous() for t in tensors)
        device = self.w1.device
        self.holds_all = len(self.expert_ids) == num_routed_experts
        # local[e] = stack index of global expert e; held[e] = whether it is here
        self.local = torch.zeros(num_routed_experts, dtype=torch.int64, device=device)
        self.held = torch.zeros(num_routed_experts, dtype=torch.bool, device=device)
        ids = torch.tensor(self.expert_ids, dtype=torch.int64, device=device)
        self.local[ids] = torch.arange(len(self.expert_ids), device=device)
        self.held[ids] = True
        self.kept: dict[int, KeptWideWeight] = {}  # stack index -> its dequantised matrices (small, on the CPU)

    def matrices(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert `index`'s (w1, w2, w3) in x's dtype, exact: kept after the first call on the CPU when small
        (linear.KeptWideWeight: a drafter's or the default model's experts), else dequantised now."""
        pairs = ((self.w1, self.s1), (self.w2, self.s2), (self.w3, self.s3))

        def build(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return tuple(_dequant_stacked(w[index], s[index], self.fmt).to(dtype) for w, s in pairs)

        values_per_element = 2 if self.fmt is ExpertFormat.FP4 else 1  # two e2m1 codes a byte
        numel = sum(w[index].numel() for w, _ in pairs) * values_per_element
        sources = tuple(t for pair in pairs for t in pair)  # the whole stacks: any write rebuilds
        kept = self.kept.setdefault(index, KeptWideWeight()).get(x, sources, numel, build)
        return kept if kept is not None else build(x.dtype)

    def kernel_weights(self):
        from moemesh.common.kernels.fp4_experts import ExpertWeights, WeightFormat

        fmt = WeightFormat.FP4_E2M1 if self.fmt is ExpertFormat.FP4 else WeightFormat.FP8_E4M3
        return ExpertWeights(self.w1, self.s1, self.w3, self.s3, self.w2, self.s2, fmt)

    def num_bytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.w1, self.s1, self.w2, self.s2, self.w3, self.s3))


def layout_by_expert(local_ids: torch.Tensor, num_experts: int) -> ExpertLayout:
    """Stable sort of [T, K] stack indices by expert, without a host sync (offsets by searchsorted,
    where `moe_layout.sort_by_expert`'s bincount may read the maximum back on CUDA)."""
    top_k = local_ids.shape[1]
    flat = local_ids.reshape(-1)  # [R]
    sorted_ids, row_slot_ids = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)  # [E+1], rows < e before e
    return ExpertLayout(row_token_ids=row_slot_ids // top_k, row_slot_ids=row_slot_ids, expert_offsets=offsets)


def _unsort_rows(y: torch.Tensor, row_slot_ids: torch.Tensor) -> torch.Tensor:
    """y [R, D] in expert order -> [R, D] in slot-flat order (row i of y is slot row_slot_ids[i]).

    A gather through the inverse permutation: the scatter `rows[row_slot_ids] = y` it replaces ran as
    torch's index_put at ~0.9 ms per 8K-token layer (docs/performance.md), a gather at ~0.1."""
    inverse = torch.empty_like(row_slot_ids)
    inverse[row_slot_ids] = torch.arange(row_slot_ids.numel(), device=row_slot_ids.device, dtype=row_slot_ids.dtype)
    return y.index_select(0, inverse)


class QuantizedRoutedExperts:
    """`RoutedExperts` with weights kept quantized, stacked per layer.

    layers: {layer: (expert_ids ascending, (w1, s1, w2, s2, w3, s3))}, tensors stacked over those
    experts in that order (hub layouts: w1/w3 [E, I, ...], w2 [E, D, ...]). Slot results are
    summed in slot order (`sum_slots_in_order`), as `RoutedExperts` does, so results do not depend
    on which holder computes which expert.
    """

    def __init__(self, layers: Mapping[int, tuple[Sequence[int], Sequence[torch.Tensor]]], num_routed_experts: int,
                 swiglu_limit: float | None, *, expert_format: ExpertFormat = ExpertFormat.FP4,
                 route_weight_before_w2: bool = False, backend: KernelBackend = KernelBackend.AUTO) -> None:
        self.num_routed_experts = num_routed_experts
        self.swiglu_limit = swiglu_limit
        self.route_weight_before_w2 = route_weight_before_w2
        self.backend = backend
        self._layers = {int(layer): _LayerExperts(ids, tensors, expert_format, num_routed_experts)
                        for layer, (ids, tensors) in layers.items()}
        self._layout_handoffs: dict[int, RouteLayoutHandoff] = {}

    def connect_gates(self, gates: Mapping[int, nn.Module]) -> None:
        """Let the gate of every layer whose experts are all here build this holder's route layout in its launch
        (`moe.RouteLayoutHandoff`); gates: {layer: Gate} of the model whose layers feed this holder in-process."""
        for layer, gate in gates.items():
            held = self._layers.get(layer)
            if held is None or not held.holds_all:
                gate.layout_handoff = None
                self._layout_handoffs.pop(layer, None)
                continue
            handoff = RouteLayoutHandoff(len(held.expert_ids), held.local)
            gate.layout_handoff = handoff
            self._layout_handoffs[layer] = handoff

    @classmethod
    def from_config(cls, layers, config, numerics=None, **kwargs) -> "QuantizedRoutedExperts":
        from moemesh.common.model.config import NumericsConfig

        numerics = numerics or NumericsConfig()
        fmt = ExpertFormat.FP8 if config.expert_dtype == "fp8" else ExpertFormat.FP4
        return cls(layers, config.n_routed_experts, config.swiglu_limit, expert_format=fmt,
                   route_weight_before_w2=numerics.route_weight_before_w2, **kwargs)

    @classmethod
    def from_expert_tensors(cls, experts: Mapping[tuple[int, int], Sequence[torch.Tensor]], num_routed_experts: int,
                            swiglu_limit: float | None, **kwargs) -> "QuantizedRoutedExperts":
        """{(layer, expert): (w1, s1, w2, s2, w3, s3)} per-expert checkpoint tensors -> stacked holder."""
        by_layer: dict[int, list[int]] = {}
        for layer, expert in sorted(experts):
            by_layer.setdefault(layer, []).append(expert)
        layers = {}
        for layer, ids in by_layer.items():
            parts = [torch.stack([experts[(layer, e)][i] for e in ids]) for i in range(6)]
            layers[layer] = (ids, parts)
        return cls(layers, num_routed_experts, swiglu_limit, **kwargs)

    # ----------------------------------------------------------------------- RoutedExperts interface
    @property
    def pairs(self) -> list[tuple[int, int]]:
        return sorted((layer, e) for layer, held in self._layers.items() for e in held.expert_ids)

    def holds(self, layer: int, expert: int) -> bool:
        held = self._layers.get(layer)
        return held is not None and expert in held.expert_ids

    def held_mask(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] -> bool [T, K]: which slots this holder can compute."""
        held = self._layers.get(layer)
        if held is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        return held.held.to(ids.device)[ids]

    def bytes_per_expert(self, layer: int) -> int:
        return self._layers[layer].num_bytes_per_expert()

    def per_expert_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           slot_mask: torch.Tensor | None = None, *, check_held: bool = True) -> torch.Tensor:
        """Weighted output of every (token, slot) -> [T, K, D]; zero where slot_mask is False.

        Raises ExpertNotHeld if a selected slot's expert is not here (checked without a host sync
        only when this holder has every expert of the layer and no mask is given). check_held=False:
        the caller's mask selects held experts only; no check, so no host sync on a device."""
        held = self._layers.get(layer)
        if held is None:
            raise ExpertNotHeld(f"layer {layer} has no experts here")
        if check_held and (slot_mask is not None or not held.holds_all):
            selected = torch.ones_like(ids, dtype=torch.bool) if slot_mask is None else slot_mask
            missing = selected & ~held.held[ids]
            if bool(missing.any()):
                raise ExpertNotHeld(f"layer {layer}: experts {sorted(set(ids[missing].tolist()))} are not held here")
        num_tokens, top_k = ids.shape
        if _use_kernel(self.backend, hidden):
            handoff = self._layout_handoffs.get(layer)
            layout = handoff.take(ids, weights) if handoff is not None and slot_mask is None else None
            rows = self._slot_rows_kernel(held, hidden, ids, weights, slot_mask, stack_table=held.local,
                                          layout=layout)  # [R, D]
            return rows.view(num_tokens, top_k, -1)  # masked slots already zero
        local = held.local[ids]  # [T, K]
        rows = self._rows_torch(held, hidden, local, weights, slot_mask)
        out = rows.view(num_tokens, top_k, -1)
        if slot_mask is not None:
            out = out * slot_mask[..., None].to(out.dtype)
        return out

    def __call__(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], ids/weights [T, K] -> routed sum [T, D]. Raises ExpertNotHeld.

        On the kernel path at decode sizes: the three launches of `_slot_rows_kernel`, then the slot
        sum (one launch on CUDA). The model's layer loops take `per_expert_outputs` instead
        (`moe.routed_answer`) and leave the sum to hc_post's launch."""
        return sum_slots_in_order(self.per_expert_outputs(layer, hidden, ids, weights))

    # ----------------------------------------------------------------------- backends
    def _rows_kernel(self, held: _LayerExperts, hidden: torch.Tensor, local: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """Grouped Triton kernels on stack indices local [T, K] -> [T·K, D] rows indexed by flat slot t·K + k."""
        return self._slot_rows_kernel(held, hidden, local, weights, None, stack_table=None)

    def _slot_rows_kernel(self, held: _LayerExperts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          slot_mask: torch.Tensor | None, *, stack_table: torch.Tensor | None,
                          layout=None) -> torch.Tensor:
        """hidden [T, D], ids / weights [T, K] (ids read through stack_table when given, else stack indices),
        slot_mask [T, K] or None -> [T·K, D] rows indexed by flat slot t·K + k, exact zeros where masked.
        layout: the route layout of these ids and weights when the gate's launch already built it.

        Three launches, no host sync: the route layout (`route_layout.route_layout`: stable sort of the
        selected slots by expert, masked slots after every expert's rows), `grouped_gate_up` reading x
        through the rows' token ids, `grouped_down` writing each row to its slot and zeros to the
        masked slots. Masked slots are not computed. Long FP4 prefill takes `_rows_dequant`."""
        from moemesh.common.kernels.fp4_experts import grouped_down, grouped_gate_up, quartered_handoff
        from moemesh.common.kernels.route_layout import route_layout

        if self._uses_dequant_path(held, hidden, ids.numel()):
            local = stack_table[ids] if stack_table is not None else ids  # [T, K]
            rows = self._rows_dequant(held, hidden, local, weights)  # [T·K, D]
            if slot_mask is None:
                return rows
            return (rows.view(*ids.shape, -1) * slot_mask[..., None].to(rows.dtype)).view(rows.shape)
        if layout is None:
            layout = route_layout(ids, weights, len(held.expert_ids), stack_table=stack_table, slot_mask=slot_mask)
        stacked = held.kernel_weights()
        quartered = quartered_handoff(ids.numel(), stacked, hidden.dtype, hidden.device)
        h = grouped_gate_up(hidden, layout.expert_offsets, stacked, swiglu_limit=self.swiglu_limit,
                            x_row_ids=layout.row_token_ids, quartered_out=quartered)  # [R, I] in expert order
        if self.route_weight_before_w2:  # a per-row scale: the same in either column order
            h = (h.float() * layout.row_weights[:, None]).to(hidden.dtype)
            return grouped_down(h, layout.expert_offsets, stacked, out_row_ids=layout.row_slot_ids,
                                hidden_quartered=quartered)
        return grouped_down(h, layout.expert_offsets, stacked, row_weights=layout.row_weights,
                            out_row_ids=layout.row_slot_ids, hidden_quartered=quartered)  # [R, D] in slot order

    def _uses_dequant_path(self, held: _LayerExperts, hidden: torch.Tensor, num_rows: int) -> bool:
        """Long FP4 prefill: each expert dequantised once, grouped bf16 GEMMs (one host sync; never in decode)."""
        from moemesh.common.kernels.fp4_prefill import use_dequant_path

        return (held.fmt is ExpertFormat.FP4 and hidden.dtype == torch.bfloat16 and not self.route_weight_before_w2
                and hidden.is_cuda and use_dequant_path(num_rows, len(held.expert_ids)))

    def _rows_dequant(self, held: _LayerExperts, hidden: torch.Tensor, local: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """The long-prefill path on stack indices local [T, K] -> [T·K, D] rows indexed by flat slot."""
        from moemesh.common.kernels.fp4_prefill import grouped_experts_dequant

        layout = layout_by_expert(local, len(held.expert_ids))
        x_sorted = hidden[layout.row_token_ids]  # [R, D]
        row_weights = weights.reshape(-1)[layout.row_slot_ids].float()  # [R]
        y = grouped_experts_dequant(x_sorted, layout.expert_offsets, held.kernel_weights(),
                                    swiglu_limit=self.swiglu_limit, row_weights=row_weights)
        return _unsort_rows(y, layout.row_slot_ids)

    def _rows_torch(self, held: _LayerExperts, hidden: torch.Tensor, local: torch.Tensor, weights: torch.Tensor,
                    slot_mask: torch.Tensor | None) -> torch.Tensor:
        """Per expert: its three matrices in the activation dtype (`_LayerExperts.matrices`), then `RoutedExperts`'
        math."""
        top_k = local.shape[1]
        rows = hidden.new_zeros(local.numel(), hidden.shape[1])
        flat_local = local.reshape(-1)
        usable = torch.ones_like(flat_local, dtype=torch.bool) if slot_mask is None else slot_mask.reshape(-1)
        for index in torch.unique(flat_local[usable]).tolist():  # ascending stack index = ascending id
            (slots,) = torch.where((flat_local == index) & usable)
            x = hidden[slots // top_k]
            w1, w2, w3 = held.matrices(index, hidden)
            route = weights.reshape(-1)[slots][:, None]
            act = _swiglu(F.linear(x, w1), F.linear(x, w3), self.swiglu_limit)
            if self.route_weight_before_w2:
                rows[slots] = F.linear(act * route.to(act.dtype), w2)
            else:
                rows[slots] = F.linear(act, w2) * route.to(act.dtype)
        return rows


def dequantized_expert_weights(experts: QuantizedRoutedExperts, pairs: Iterable[tuple[int, int]] | None = None
                               ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{(layer, expert): (w1, w2, w3)} fp32, the `RoutedExperts` weights equal to a quantized holder."""
    out = {}
    for layer, expert in (pairs if pairs is not None else experts.pairs):
        held = experts._layers[layer]
        index = held.expert_ids.index(expert)
        out[(layer, expert)] = tuple(_dequant_stacked(w[index], s[index], held.fmt)
                                     for w, s in ((held.w1, held.s1), (held.w2, held.s2), (held.w3, held.s3)))
    return out
