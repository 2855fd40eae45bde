"""Correctness check suites: fast paths against their references on fresh random inputs.

Shared by the tests (in-process, or `python -m moemesh.bench.checks.<suite> --suite interpret` in a
child under `TRITON_INTERPRET=1`) and the device scripts (`bench/device/*.sh`, real sizes on CUDA);
each suite prints one JSON object per case when run as a module.

Suites:
- `quantized_kernels`: FP8 linears and FP4/FP8 grouped experts against `common.kernels.reference`;
  also the random FP4/FP8 weights and interpreter patches the other suites and benchmarks use.
- `fp4_decode_probe`: the in-kernel FP4 decoders bit for bit against `reference.dequant_fp4` (CUDA).
- `prefill`:          both prefill paths (dequantise + bf16 GEMMs) against the references.
- `glue_kernels`:     mHC, RMS norm and RoPE kernels against their torch references;
  `glue_kernel_runs` runs them in a child, compiles them for sm_90, and checks the tiny model with them.
- `attention`:        batched attention kernels against the per-sequence torch path on whole layers.
- `decode_graphs`:    decode steps through `DecodeGraphs` against ModelRunner's eager loop.
- `tiny_model`:       the docs/model.md §7.1 tiny model and its transformers oracle, for model-level checks.
"""
