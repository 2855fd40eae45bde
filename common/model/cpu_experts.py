"""Quantized routed experts on the CPU: the native FP4 kernel, or torch dequantisation in cache-sized blocks.

Native path (default): `common.kernels.cpu_fp4` (C, built at first use, OpenMP) decodes e2m1 nibbles
in vector registers right before the FMAs, so weights stream at memory speed; one call per layer
runs every selected row through its expert (w1 and w3 fused over the same rows, SwiGLU in the
epilogue, then w2) in one parallel region with two barriers. `MOEMESH_CPU_KERNEL=torch` forces the
torch path, which is also used (after one `cpu_fp4.unavailable` warning) when no compiler is found or
the build fails.

Torch path: `QuantizedRoutedExperts`' own torch path dequantises a whole matrix through several
full-size fp32 temporaries (nibble unpack to int64, a 16-entry lookup, a scale repeat, a multiply) before
one matmul; on the CPU that costs ~8x the blocked path below (measured: 149 ms vs 18 ms single-threaded
for one 2048x4096 FP4 matrix and one token). Here each matrix is done in blocks of `block_rows` output
rows: the packed bytes are read two at a time as one 16-bit index into a 65,536 x 4 fp32 table (four
e2m1 values, 1 MiB, cache-resident; each row gathered as one complex128 element), the block is scaled
by its ue8m0 factors (exact powers of two) and multiplied at once, so the dequantised block stays in cache.

Both paths give exactly the reference's weight values (same e2m1 values, same power-of-two scales,
multiplication by a power of two is exact), and each expert sees the same rows as `RoutedExperts`
would, so results equal the reference's up to summation order (1e-5 relative in the tests).
FP8 experts fall back to `QuantizedRoutedExperts`' own torch path.
Legend: T tokens, K top-k slots, D hidden, I expert width, R selected rows, B block rows.
"""

from __future__ import annotations

import weakref

import structlog
import torch
import torch.nn.functional as F

from moemesh.common.kernels.reference import e2m1_lut

log = structlog.get_logger("expert")

DEFAULT_BLOCK_ROWS = 256
_FP4_PER_INDEX = 4  # one int16 index covers two packed bytes = four e2m1 codes
_FP4_BLOCK = 32  # inputs per ue8m0 scale

_tables: dict[tuple[torch.dtype, int], torch.Tensor] = {}
_CARRIERS = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16}  # bytes -> one element


def fp4_pair_table(dtype: torch.dtype = torch.float32, codes_per_index: int = _FP4_PER_INDEX) -> torch.Tensor:
    """[256^(codes/2), codes]: the e2m1 values of `codes_per_index` / 2 packed bytes (low byte first,
    low nibble first), e.g. [65536, 4] for two bytes."""
    key = (dtype, codes_per_index)
    table = _tables.get(key)
    if table is None:
        lut = e2m1_lut("cpu")  # [16]
        byte = torch.arange(256)
        table = torch.stack([lut[byte & 15], lut[byte >> 4]], dim=1)  # [256, 2]
        if codes_per_index == 4:
            index = torch.arange(65536)
            table = torch.cat([table[index & 255], table[index >> 8]], dim=1)  # [65536, 4]
        table = table.to(dtype).contiguous()
        _tables[key] = table
    return table


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table [R, c] gathered at index [...] -> [..., c]. Each row travels as one wide element
    (complex128 for four fp32): a 1-D index_select, ~7x faster on the CPU than `F.embedding`'s
    row copies for rows this short (measured: 1.3 vs 9.0 ms for 256K indices, one thread)."""
    row_bytes = table.shape[1] * table.element_size()
    carrier = _CARRIERS.get(row_bytes)
    if carrier is None:
        return F.embedding(index, table)
    wide = table.view(carrier).reshape(-1)  # [R]
    return wide.index_select(0, index.reshape(-1)).view(table.dtype).view(*index.shape, table.shape[1])


def _scale_factors(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> fp32 2^(byte - 127) by placing the byte in the exponent field: exact for bytes
    1..254 (2^-126 .. 2^127, every scale a checkpoint stores); byte 0 would give 0 instead of 2^-127 and
    255 infinity instead of NaN (`ue8m0_to_float` has those), not checked per call for speed."""
    return (scale.to(torch.int32) << 23).view(torch.float32)


def default_block_rows() -> int:
    """Rows per block: enough indices per op that every intra-op thread gets work (torch splits
    elementwise work in grains of 32K elements; a 256-row block of a 4096-wide FP4 matrix is 256K)."""
    return max(DEFAULT_BLOCK_ROWS, 128 * torch.get_num_threads())


@torch.inference_mode()  # pool threads do not inherit the caller's mode; `out` may be an inference tensor
def _fp4_block_into(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, factors: torch.Tensor,
                    begin: int, end: int) -> None:
    """out[:, begin:end] = x [R, K] @ dequant(rows begin..end of packed [N, K/2])ᵀ (factors [N, K/32])."""
    half_in = packed.shape[1]
    num_in = 2 * half_in
    table = fp4_pair_table(x.dtype, _FP4_PER_INDEX if half_in % 2 == 0 else 2)
    if half_in % 2 == 0:
        index = packed[begin:end].view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)  # [B, K/4]
    else:  # odd packed width: one byte at a time ([256, 2] table)
        index = packed[begin:end].to(torch.int32)  # [B, K/2]
    weight = _gather_rows(table, index)  # [B, K/4, 4] or [B, K/2, 2]
    weight = weight.view(end - begin, num_in // _FP4_BLOCK, _FP4_BLOCK)
    weight.mul_(factors[begin:end, :, None])
    out[:, begin:end] = F.linear(x, weight.view(end - begin, num_in))


def _check_shapes(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    num_out, half_in = packed.shape
    if 2 * half_in != x.shape[1] or scale.shape != (num_out, 2 * half_in // _FP4_BLOCK):
        raise ValueError(f"FP4 weight {tuple(packed.shape)} / scale {tuple(scale.shape)} for input {tuple(x.shape)}")


class CpuBlockRunner:
    """Runs FP4 linears and experts on the CPU with `num_threads` threads: through the native kernel
    (OpenMP threads, `native` not None) or, as fallback, as torch block jobs serially (`num_threads` 1)
    or on a pool of Python threads, one block per job.

    Torch path with a pool: torch's own intra-op threading should be 1 (the worker sets it): a parallel
    torch op ends in a barrier that waits for every OpenMP thread, and when the machine is busier than
    its cores (attention worker, GPU expert worker, this one) a descheduled thread stalls every op for a
    scheduler quantum (measured on a loaded 2-core host: 2 threads 65x slower than 1). Jobs of ~1 ms
    release the GIL inside torch, so threads overlap; each job writes its own column block, so results
    are the serial ones exactly. The native kernel takes its thread count per call, whatever torch's is.

    use_native: None = the default (native unless `MOEMESH_CPU_KERNEL=torch` or the build fails),
    False = torch blocks only, True = native or raise `cpu_fp4.NativeBuildError`."""

    def __init__(self, num_threads: int = 1, block_rows: int = DEFAULT_BLOCK_ROWS,
                 use_native: bool | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from moemesh.common.kernels import cpu_fp4

        self.num_threads = max(1, num_threads)
        self.block_rows = block_rows
        if use_native is None:
            self.native = cpu_fp4.native_kernel()
        else:
            self.native = cpu_fp4.load_native() if use_native else None
        use_pool = self.native is None and self.num_threads > 1
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="fp4") if use_pool else None
        log.info("expert.cpu_fp4_path", kernel="native" if self.native else "torch", num_threads=self.num_threads,
                 isa=self.native.isa if self.native else None,
                 openmp=self.native.has_openmp if self.native else None)

    def linear(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """jobs: (out [R, N], x [R, K], packed [N, K/2], scale [N, K/32]); fills every out."""
        if self.native is not None:
            for out, x, packed, scale in jobs:
                _check_shapes(x, packed, scale)
                direct = out.dtype == torch.float32 and out.is_contiguous()
                result = self.native.linear(x, packed, scale, self.num_threads, out=out if direct else None)
                if not direct:
                    out.copy_(result)
            return
        blocks = []
        for out, x, packed, scale in jobs:
            _check_shapes(x, packed, scale)
            factors = _scale_factors(scale).to(x.dtype)  # [N, K/32] exact powers of two
            num_out = packed.shape[0]
            blocks += [(out, x, packed, factors, b, min(num_out, b + self.block_rows))
                       for b in range(0, num_out, self.block_rows)]
        if self._pool is None or len(blocks) == 1:
            for block in blocks:
                _fp4_block_into(*block)
            return
        for future in [self._pool.submit(_fp4_block_into, *block) for block in blocks]:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, runner: CpuBlockRunner | None = None
               ) -> torch.Tensor:
    """x [R, K] @ dequant(packed [N, K/2], scale [N, K/32])ᵀ -> [R, N] in x's dtype, by `runner`
    (default: native on torch's thread count, else torch blocks on one thread)."""
    out = x.new_empty(x.shape[0], packed.shape[0])
    (runner or default_runner()).linear([(out, x, packed, scale)])
    return out


_default_runners: dict[int, CpuBlockRunner] = {}


def default_runner() -> CpuBlockRunner:
    """A runner for callers that pass none: the native kernel on torch.get_num_threads() threads, or the
    serial torch blocks (one per thread count, kept)."""
    num_threads = torch.get_num_threads()
    runner = _default_runners.get(num_threads)
    if runner is None:
        from moemesh.common.kernels import cpu_fp4

        native = cpu_fp4.native_kernel()
        runner = CpuBlockRunner(num_threads if native else 1, default_block_rows(), use_native=native is not None)
        _default_runners[num_threads] = runner
    return runner


def fp4_linear_blocked(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       block_rows: int | None = None) -> torch.Tensor:
    """x [R, K] @ dequant(packed [N, K/2], scale [N, K/32])ᵀ -> [R, N] in x's dtype, block by block
    (the torch path, whatever the native kernel's availability)."""
    out = x.new_empty(x.shape[0], packed.shape[0])
    CpuBlockRunner(1, block_rows or default_block_rows(), use_native=False).linear([(out, x, packed, scale)])
    return out


def expert_rows(held, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_mask: torch.Tensor | None,
                swiglu_limit: float | None, route_weight_before_w2: bool,
                runner: CpuBlockRunner | None = None) -> torch.Tensor:
    """Weighted output of every selected slot -> [T, K, D] (zeros elsewhere), FP4 stacks of one layer.

    held: a layer's stacked experts (`quantized_experts._LayerExperts`: w1/s1/w2/s2/w3/s3, `local`, expert_ids).
    Per expert, the rows are its selected slots in ascending (token, slot) order, as the reference has.
    Native kernel: one call for the whole layer. Torch path: every expert's w1 and w3 blocks run as one
    batch of jobs, then every expert's w2 blocks."""
    from moemesh.common.model.moe import _swiglu

    runner = runner or default_runner()
    if runner.native is not None:
        return _native_expert_rows(runner, held, hidden, ids, weights, slot_mask, swiglu_limit, route_weight_before_w2)
    num_tokens, top_k = ids.shape
    out = hidden.new_zeros(num_tokens * top_k, hidden.shape[1])  # [T·K, D]
    flat_ids = ids.reshape(-1)
    usable = torch.ones_like(flat_ids, dtype=torch.bool) if slot_mask is None else slot_mask.reshape(-1)
    flat_route = weights.reshape(-1)
    groups = []  # (slots [R], stack index, x [R, D], gate [R, I], up [R, I])
    for expert in torch.unique(flat_ids[usable]).tolist():  # ascending expert id
        (slots,) = torch.where((flat_ids == expert) & usable)
        index = int(held.local[expert])
        x = hidden[slots // top_k]  # [R, D]
        inter = held.w1.shape[1]
        groups.append((slots, index, x, x.new_empty(len(slots), inter), x.new_empty(len(slots), inter)))
    runner.linear([job for slots, index, x, gate, up in groups
                   for job in ((gate, x, held.w1[index], held.s1[index]), (up, x, held.w3[index], held.s3[index]))])
    down_jobs, routes = [], []
    for slots, index, x, gate, up in groups:
        act = _swiglu(gate, up, swiglu_limit)
        route = flat_route[slots][:, None].to(act.dtype)
        routes.append(route)
        y = x.new_empty(len(slots), held.w2.shape[1])
        down_jobs.append((y, act * route if route_weight_before_w2 else act, held.w2[index], held.s2[index]))
    runner.linear(down_jobs)
    for (slots, *_), (y, *_), route in zip(groups, down_jobs, routes):
        out[slots] = y if route_weight_before_w2 else y * route
    return out.view(num_tokens, top_k, -1)


_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # held layer -> its cpu_fp4.ExpertStacks


def layer_stacks(held):
    """The byte views of a held layer's stacks, made once per layer object (views cost ~20 us a call)."""
    from moemesh.common.kernels.cpu_fp4 import ExpertStacks

    stacks = _stacks.get(held)
    if stacks is None or stacks.w1.data_ptr() != held.w1.data_ptr():
        stacks = _stacks[held] = ExpertStacks.from_tensors(held.w1, held.s1, held.w3, held.s3, held.w2, held.s2)
    return stacks


def _native_expert_rows(runner: CpuBlockRunner, held, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        slot_mask: torch.Tensor | None, swiglu_limit: float | None,
                        route_weight_before_w2: bool) -> torch.Tensor:
    """expert_rows through the native kernel, grouped in C in the reference's order (ascending expert,
    each expert's slots ascending); it writes each selected slot's fp32 row of out [T·K, D] (unselected
    rows stay zero)."""
    num_tokens, top_k = ids.shape
    out = torch.zeros(num_tokens * top_k, hidden.shape[1], dtype=torch.float32)  # [T·K, D]
    runner.native.routed_experts(hidden, ids, weights, slot_mask, held.local, layer_stacks(held), swiglu_limit,
                                 route_weight_before_w2, out, runner.num_threads)
    return out.view(num_tokens, top_k, -1).to(hidden.dtype)
