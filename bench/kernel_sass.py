"""Compile the grouped expert kernel for sm_90 without a GPU and summarise its machine code.

Usage: python -m moemesh.bench.kernel_sass [--launch gate_up|down] [--rows-per-tile 16] ...

Triton ships ptxas and nvdisasm, so a kernel variant can be compiled for an H200 on any machine:
this catches compile errors before a device run and shows what a variant costs per K step
(instruction mix of the whole kernel, registers, spills, shared memory). Counts are static
(instructions in the binary, loops counted once), a guide for the sweep, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

HIDDEN, EXPERT_WIDTH, NUM_EXPERTS = 4096, 2048, 256


def compile_grouped(config, *, fused_gate_up: bool, weight_format: int = 0, x_quartered: bool = False,
                    dependent: int = 0):
    """The compiled kernel (triton CompiledKernel) for one launch of V4-Flash experts (`dependent`: as
    a programmatic dependent launch, its `USE_PDL` mode, `common/kernels/dependent_launch.py`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moemesh.common.kernels.fp4_experts import _grouped_kernel

    in_features = HIDDEN if fused_gate_up else EXPERT_WIDTH
    pointer_args = ("x_ptr", "wa_ptr", "sa_ptr", "wb_ptr", "sb_ptr", "out_ptr", "offsets_ptr", "row_weights_ptr",
                    "partial_ptr", "counter_ptr")
    pointer_types = ("*bf16", "*u8", "*u8", "*u8", "*u8", "*bf16", "*i32", "*fp32", "*fp32", "*i32")
    signature = dict(zip(pointer_args, pointer_types))
    signature.update({"num_experts": "i32", "out_features": "i32", "swiglu_limit": "fp32"})
    for name in ("stride_xr", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_or", "stride_ps"):
        signature[name] = "i32"
    constexprs = {
        "IN_FEATURES": in_features, "WEIGHT_FORMAT": weight_format, "FP4_DECODE": int(config.fp4_decode),
        "FUSE_SWIGLU": fused_gate_up, "HAS_LIMIT": fused_gate_up, "HAS_ROW_WEIGHTS": False,
        "SPLIT_K": config.split_k, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k, "BLOCK_E": NUM_EXPERTS, "X_QUARTERED": x_quartered, "USE_PDL": dependent,
    }
    for name in constexprs:
        signature[name] = "constexpr"
    # Pointers and the leading strides are 16-byte aligned / multiples of 16 in every real launch.
    aligned = [i for i, name in enumerate(_grouped_kernel.arg_names)
               if name.endswith("_ptr") or name in ("stride_xr", "stride_we", "stride_wn", "stride_or")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(_grouped_kernel, signature, constexprs=constexprs, attrs=attrs)
    return compile(source, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": config.num_warps, "num_stages": config.num_stages,
                            "launch_pdl": bool(dependent)})


def _tool(name: str) -> str:
    import os

    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_of(kernel) -> str:
    """nvdisasm's listing of the kernel's cubin."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        return subprocess.run([_tool("nvdisasm"), "-c", handle.name], capture_output=True, text=True,
                              check=True).stdout


def summarise(kernel) -> dict:
    """Registers, spills, shared memory and the SASS opcode histogram of a compiled kernel."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", handle.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    opcodes = collections.Counter()
    for line in sass_of(kernel).splitlines():
        match = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.\S+)?\s", line.split("*/")[-1])
        if match and "/*" in line:
            opcodes[match.group(1)] += 1
    return {
        "num_regs": int(regs.group(1)) if regs else None, "stack_bytes": int(stack.group(1)) if stack else None,
        "shared_bytes": kernel.metadata.shared, "num_instructions": sum(opcodes.values()),
        "opcodes": dict(opcodes.most_common(30)),
    }


def main(argv: list[str] | None = None) -> int:
    from moemesh.common.kernels.expert_configs import Fp4Decode, GroupedGemmConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--split-k", type=int, default=1)
    parser.add_argument("--decode", choices=[d.name for d in Fp4Decode], default="HALVES")
    parser.add_argument("--dump", choices=("none", "ttgir", "ptx", "sass"), default="none")
    args = parser.parse_args(argv)
    config = GroupedGemmConfig(args.block_m, args.block_n, args.block_k, args.num_warps, args.num_stages,
                               args.split_k, Fp4Decode[args.decode])
    kernel = compile_grouped(config, fused_gate_up=args.launch == "gate_up")
    if args.dump == "sass":
        print(sass_of(kernel))
    elif args.dump != "none":
        print(kernel.asm[args.dump])
    print(config.short(), args.launch, summarise(kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
