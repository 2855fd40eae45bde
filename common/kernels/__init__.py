"""Triton kernels for the quantized weights of DeepSeek-V4 (docs/model.md §4.3).

Each kernel sits beside a slow torch reference (`reference.py`); the check suites in `bench/checks/`
compare the two on random inputs (tests run them under `TRITON_INTERPRET=1` on CPU and at real
sizes on CUDA), and `bench/kernels.py` times the kernels against measured device ceilings.

Modules:
- `reference`:   dequantizers (FP8 e4m3 128x128 ue8m0, FP4 e2m1 1x32 ue8m0) and fp32 matmuls.
- `fp8_linear`:  y = x @ W^T with W FP8 in memory; decode (split-K) and prefill schedules.
- `fp4_experts`: grouped SwiGLU experts over tokens sorted by expert, FP4 (or FP8) weights.
- `dequant_tiles`: the in-kernel FP4/FP8 tile loaders (triton device functions).
- `moe_layout`:  sort routed token copies by expert and build the per-expert offsets (torch only).
- `fp8_dequant`: FP8 linears at prefill sizes: transient bf16 weight + cuBLAS (from 1,024 tokens).
- `fp4_prefill`: routed experts at prefill sizes: each expert dequantised once + grouped bf16 GEMMs.

Importing this package imports nothing heavy; `fp8_linear` and `fp4_experts` need triton.
"""
