"""Batched attention kernels against the per-sequence torch path, on whole attention layers.

Each case builds window-only, CSA and HCA `Attention` layers with random weights, two identical
sets of sequence states, and runs a script of forwards through both paths: the torch reference
(`AttentionBackend.TORCH`) and the Triton kernels (`AttentionBackend.TRITON`: sparse attention,
indexer scores + top-k, ring and row writes, window pooling). After every forward it compares the
layer outputs and every tensor the next step can read (`SequenceState.live_tensors`), so a wrong
ring slot, row, pooled value, top-k pick or visibility shows up. Scripts mix sequences of
different lengths in one batch, prefill chunks longer than the ring, windows closing inside a
chunk, CSA sequences with fewer closed windows than top-k, several tokens per sequence
(speculative verification) and rollbacks between forwards.

`python -m moemesh.bench.checks.attention --suite interpret` (meant for TRITON_INTERPRET=1 on
CPU, tiny fp32 layers) or `--suite cuda` (V4-Flash width, bf16) prints one JSON object per case:
relative error = max over compared tensors of ‖kernel − torch‖ / ‖torch‖.
Legend: T tokens, D hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from moemesh.bench.checks.quantized_kernels import CheckResult, patch_interpreter_bf16_dot
from moemesh.common.model.attention import Attention
from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.random_init import fill_random_context, flash_config, new_sequence_state, tiny_flash_like_config
from moemesh.common.model.rope import RotaryTable
from moemesh.common.model.state import SequenceState

FP32_TOLERANCE = 2e-4
BF16_TOLERANCE = 3e-2  # the torch path rounds logits and probabilities to bf16; the kernel keeps fp32

# one forward: per sequence (index, new tokens); or ("rollback", index, tokens)
Step = tuple


@dataclass(frozen=True)
class Case:
    case_id: str
    name: str
    steps: tuple[Step, ...]
    num_sequences: int
    random_context: tuple[int, ...] = ()  # tokens of random history per sequence (instead of a prefill)
    row_store: str = "own"  # "own" | "preallocated" | "paged"


def patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar into a loop bound with `int(array)`, which
    numpy >= 2.4 refuses for a shape-(1,) array; take the single element instead. A no-op
    outside `TRITON_INTERPRET=1` (compiled kernels never see numpy)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_moemesh_scalar_index", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._moemesh_scalar_index = True


def random_layers(config: ModelConfig, dtype: torch.dtype, device, seed: int) -> list[Attention]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    layers = []
    for layer in range(config.num_hidden_layers):
        attn = Attention(config, layer, dtype=dtype, device=device)
        with torch.no_grad():
            for name, param in attn.named_parameters():
                if param.dim() == 2 and not name.endswith("ape"):
                    values = torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5
                elif name.endswith("attn_sink") or name.endswith("ape"):
                    values = torch.randn(param.shape, generator=generator) * 0.5
                else:  # norm weights
                    values = 1 + 0.1 * torch.randn(param.shape, generator=generator)
                param.copy_(values.to(param.dtype))
                param.requires_grad_(False)
        # RoPE frequencies on the device: no host-to-device copy inside a (captured) forward
        attn.rope = RotaryTable(attn.rope.name, attn.rope.rope_dim, attn.rope.inv_freq.to(device))
        layers.append(attn.eval())
    return layers


def _states(config: ModelConfig, case: Case, dtype, device) -> list[SequenceState]:
    if case.row_store == "preallocated":
        return [new_sequence_state(config, 4096, dtype, device) for _ in range(case.num_sequences)]
    if case.row_store == "paged":
        from moemesh.services.attention.kv_config import KVPoolConfig
        from moemesh.services.attention.kv_pool import BlockTable, KVPool

        ratios = [config.compress_ratio(layer) or 1 for layer in range(config.num_hidden_layers)]
        block_size = max(32, *ratios)  # a multiple of every ratio (powers of two)
        num_blocks = 8 * case.num_sequences + 8
        pool = KVPool(config, KVPoolConfig(block_size_tokens=block_size, num_primary_blocks=num_blocks), dtype,
                      device)
        states = []
        for index in range(case.num_sequences):
            table = BlockTable(torch.device(device))
            table.update([num_blocks - 1 - 8 * index - k for k in range(8)])  # scattered, descending blocks
            states.append(SequenceState(config, dtype=dtype, device=device,
                                        row_store_factory=pool.row_store_factory(table)))
        states[0]._pool_keepalive = pool  # noqa: SLF001 - the pool must outlive the states
        return states
    return [SequenceState(config, dtype=dtype, device=device) for _ in range(case.num_sequences)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run_case(case: Case, config: ModelConfig, dtype: torch.dtype, device, tolerance: float) -> CheckResult:
    torch.manual_seed(0)
    layers = random_layers(config, dtype, device, seed=1)
    reference_states = _states(config, case, dtype, device)
    if case.random_context:
        generator = torch.Generator(device=device).manual_seed(2)
        for state, num_tokens in zip(reference_states, case.random_context):
            fill_random_context(state, num_tokens, generator=generator)
    kernel_states = [state.clone() for state in reference_states] if case.row_store != "paged" else None
    if kernel_states is None:  # paged stores share one pool: give the kernel side its own
        kernel_states = _states(config, case, dtype, device)
    worst, finite = 0.0, True
    generator = torch.Generator(device="cpu").manual_seed(3)
    with torch.inference_mode():
        for step in case.steps:
            if step[0] == "rollback":
                _, index, num_tokens = step
                reference_states[index].rollback(num_tokens)
                kernel_states[index].rollback(num_tokens)
                continue
            num_tokens = sum(n for _, n in step)
            x = torch.randn(num_tokens, config.hidden_size, generator=generator).to(device, dtype)  # [T, D]
            outputs = []
            for states, backend in ((reference_states, AttentionBackend.TORCH),
                                    (kernel_states, AttentionBackend.TRITON)):
                batch = ForwardBatch([SequenceChunk(states[i], n) for i, n in step], device, attention_backend=backend)
                if backend is AttentionBackend.TRITON and batch.attention_tables is None:
                    raise RuntimeError(f"{case.case_id}: the kernel path has no tables")
                outputs.append([layer(x, batch) for layer in layers])
                batch.finish()
            for ref, out in zip(*outputs):
                finite &= bool(torch.isfinite(out).all())
                worst = max(worst, _relative(out, ref))
            for ref_state, kernel_state in zip(reference_states, kernel_states):
                ref_live, kernel_live = ref_state.live_tensors(), kernel_state.live_tensors()
                for name, ref in ref_live.items():
                    if ref.numel():
                        worst = max(worst, _relative(kernel_live[name], ref))
    return CheckResult(case.name, worst, tolerance, finite)


def check_indexer_scores(config: ModelConfig, dtype: torch.dtype, device, tolerance: float) -> CheckResult:
    """Indexer scores of 3 sequences (random histories of 23 / 64 / 90 tokens, 2 new tokens each)
    against a torch evaluation of the formula, with one and with four row blocks per program."""
    from moemesh.common.kernels.indexer_topk import indexer_scores

    layer = next(i for i, kind in enumerate(config.layer_types) if kind is AttentionKind.CSA)
    ratio = config.csa_compress_ratio
    generator = torch.Generator(device=device).manual_seed(5)
    states = []
    for num_tokens in (23, 64, 90):
        state = new_sequence_state(config, 256, dtype, device)
        fill_random_context(state, num_tokens, generator=generator)
        states.append(state)
    batch = ForwardBatch([SequenceChunk(s, 2) for s in states], device, attention_backend=AttentionBackend.TRITON)
    for state in states:  # the rows the new tokens close (in the run they are emitted before scoring)
        store = state.layers[layer].indexer
        store.write_rows(0, torch.randn(store.num_rows + 1, config.index_head_dim, generator=generator,
                                        device=device).to(dtype))
    heads, dim = config.index_n_heads, config.index_head_dim
    queries = torch.randn(batch.num_tokens, heads, dim, generator=generator, device=device).to(dtype)  # [T, H, d]
    weights = torch.randn(batch.num_tokens, heads, generator=generator, device=device)  # [T, H]
    worst, finite = 0.0, True
    expected = torch.full((batch.num_tokens, batch.attention_tables.max_rows_visible(ratio)), float("-inf"),
                          device=device)
    for state, sl in zip(states, batch.slices):
        store = state.layers[layer].indexer
        rows = store.row_store.read(store.num_rows + 1).float()  # [N, d]
        logits = torch.relu(torch.einsum("thd,nd->thn", queries[sl].float(), rows)) * dim**-0.5
        scores = (logits * weights[sl, :, None]).sum(1)  # [S, N]
        visible = (batch.positions[sl] + 1) // ratio
        for row, (score, count) in enumerate(zip(scores, visible.tolist())):
            expected[sl.start + row, :count] = score[:count]
    for blocks_per_program in (1, 4):
        got = indexer_scores(queries, weights, batch.attention_tables, layer, ratio=ratio, block_n=4,
                             blocks_per_program=blocks_per_program)
        finite &= bool(torch.equal(torch.isinf(got), torch.isinf(expected)))
        worst = max(worst, _relative(got[torch.isfinite(expected)], expected[torch.isfinite(expected)]))
    return CheckResult("indexer scores vs the formula, 1 and 4 row blocks per program", worst, tolerance, finite)


def check_rotate_back(config: ModelConfig, dtype: torch.dtype, device) -> CheckResult:
    """Sparse attention that rotates its output back in the launch equals, bit for bit, the same launch
    followed by a separate `apply_rope(..., inverse=True)`: one and three key splits (the combine kernel
    writes the output then), window and compressed layers, 3 sequences decoding 2 tokens each."""
    from moemesh.common.kernels.norm_rope import apply_rope
    from moemesh.common.kernels.sparse_attention import sparse_attention
    from moemesh.common.kernels.sparse_attention_plan import SparseAttentionConfig

    generator = torch.Generator(device=device).manual_seed(7)
    states = []
    for num_tokens in (23, 64, 90):
        state = new_sequence_state(config, 256, dtype, device)
        fill_random_context(state, num_tokens, generator=generator)
        states.append(state)
    batch = ForwardBatch([SequenceChunk(s, 2) for s in states], device, attention_backend=AttentionBackend.TRITON)
    heads, head_dim = config.num_attention_heads, config.head_dim
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=generator, device=device).to(dtype)  # [T, H, hd]
    kv = torch.randn(batch.num_tokens, head_dim, generator=generator, device=device).to(dtype)  # [T, hd]
    sink = torch.randn(heads, generator=generator, device=device)
    equal, finite = True, True
    for layer, kind in enumerate(config.layer_types):
        ratio = config.compress_ratio(layer) if kind is not AttentionKind.WINDOW else 0
        cos, sin = batch.cos_sin(RotaryTable.for_config(config, compressed=kind is not AttentionKind.WINDOW))
        for num_splits in (1, 3):
            launch = SparseAttentionConfig(block_h=min(16, heads), block_n=16, num_warps=4, num_splits=num_splits)
            args = (q, kv, sink, head_dim**-0.5, batch.attention_tables, layer)
            kwargs = {"window": config.sliding_window, "ratio": ratio, "config": launch}
            fused = sparse_attention(*args, **kwargs, rotate_back=(cos, sin))
            separate = apply_rope(sparse_attention(*args, **kwargs), cos, sin, inverse=True)
            finite &= bool(torch.isfinite(fused).all())
            equal &= torch.equal(fused, separate)
    return CheckResult("attention output rotated back in the launch == separate inverse RoPE",
                       0.0 if equal else float("inf"), 0.0, finite)


def _decode_steps(num_sequences: int, num_steps: int, tokens: int = 1) -> tuple[Step, ...]:
    return tuple(tuple((i, tokens) for i in range(num_sequences)) for _ in range(num_steps))


INTERPRET_CASES = (
    Case("mixed_prefill_decode_verify", "3 sequences: prefill 37/5/70, decode, verify 3/1/4, rollback, decode",
         steps=(((0, 37), (1, 5), (2, 70)), ((0, 1), (1, 1), (2, 1)), ((0, 3), (1, 1), (2, 4)),
                ("rollback", 0, 2), ("rollback", 2, 3), ((0, 2), (1, 1), (2, 3)))
         + _decode_steps(3, 3), num_sequences=3),
    Case("few_rows_csa", "CSA with fewer closed windows than top-k; window not yet full",
         steps=(((0, 3), (1, 9)), ((0, 1), (1, 2)), ((0, 4), (1, 1))) + _decode_steps(2, 2), num_sequences=2),
    Case("preallocated_rows", "rows in preallocated stores (the benchmark's), random history, decode + verify",
         steps=_decode_steps(4, 3) + (((0, 3), (1, 2), (2, 1), (3, 4)),), num_sequences=4,
         random_context=(40, 17, 66, 3), row_store="preallocated"),
    Case("paged_rows", "rows in the attention worker's paged pool with scattered blocks",
         steps=(((0, 50), (1, 21)), ((0, 1), (1, 1)), ((0, 3), (1, 2))) + _decode_steps(2, 3), num_sequences=2,
         row_store="paged"),
)


def cuda_cases() -> tuple[Case, ...]:
    return (
        Case("flash_decode_b8", "V4-Flash width, 8 sequences of 129..3000 tokens (CSA top-k picks from up to "
             "750 rows), decode + verify",
             steps=_decode_steps(8, 4) + (tuple((i, 3) for i in range(8)),), num_sequences=8,
             random_context=(300, 3000, 1023, 1024, 517, 129, 2500, 640), row_store="preallocated"),
        Case("flash_prefill_chunks", "V4-Flash width, prefill 1500 + 600 tokens then chunk 300 + decode",
             steps=(((0, 1500), (1, 600)), ((0, 300), (1, 1)), ((0, 1), (1, 1))), num_sequences=2),
        Case("flash_paged", "V4-Flash width, rows in the paged pool (128-token blocks), prefill 700 / 260, "
             "decode, verify 3", steps=(((0, 700), (1, 260)), ((0, 1), (1, 1)), ((0, 3), (1, 3))), num_sequences=2,
             row_store="paged"),
    )


def run_suite(suite: str, emit: Callable[[dict], None], only: str | None = None) -> bool:
    kinds = (AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA)
    if suite == "interpret":
        patch_interpreter_bf16_dot()
        patch_interpreter_scalar_index()
        config = tiny_flash_like_config(kinds)
        cases, dtype, device, tolerance = INTERPRET_CASES, torch.float32, "cpu", FP32_TOLERANCE
    else:
        config = flash_config(kinds)
        cases, dtype, device, tolerance = cuda_cases(), torch.bfloat16, "cuda", BF16_TOLERANCE
    ok = True
    if only in (None, "indexer_scores"):
        result = check_indexer_scores(config, dtype, device, tolerance)
        ok &= result.passed
        emit({"case_id": "indexer_scores", **asdict(result), "passed": result.passed})
    if only in (None, "rotate_back"):
        result = check_rotate_back(config, dtype, device)
        ok &= result.passed
        emit({"case_id": "rotate_back", **asdict(result), "passed": result.passed})
    for case in cases:
        if only is not None and case.case_id != only:
            continue
        result = run_case(case, config, dtype, device, tolerance)
        ok &= result.passed
        emit({"case_id": case.case_id, **asdict(result), "passed": result.passed})
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("interpret", "cuda"), default="interpret")
    parser.add_argument("--case", default=None, help="run only this case id")
    args = parser.parse_args(argv)
    ok = run_suite(args.suite, lambda record: print(json.dumps(record), flush=True), only=args.case)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
