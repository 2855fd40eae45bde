"""A CPU emulator for the PTX the inline weight decoders use (`common/kernels/ptx_decode.py`), vectorised with numpy.

It runs one `_asm_block` string over arrays of operand values, so that the decoders' bit placement can be checked
against `reference.py` exhaustively without a GPU. Supported: `.reg .b32` declarations and mov, prmt, shl, shr,
and, or (all .b32) and mul.bf16x2 (each lane rounded to nearest even, subnormals kept, as on sm_90).
"""

from __future__ import annotations

import re

import numpy as np


def run_block(asm: str, operands: dict[int, np.ndarray], num_outputs: int) -> list[np.ndarray]:
    """Run `asm` with $i bound to `operands[i]` (uint32 arrays, one shape) -> the uint32 values of $0..$n-1."""
    shape = next(iter(operands.values())).shape
    registers: dict[str, np.ndarray] = {f"${i}": np.asarray(v, dtype=np.uint32) for i, v in operands.items()}
    for statement in asm.replace("{", "").replace("}", "").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        opcode, _, rest = statement.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        values = [_value(a, registers, shape) for a in args[1:]]
        registers[args[0]] = _execute(opcode, values)
    return [registers[f"${i}"] for i in range(num_outputs)]


def _value(token: str, registers: dict[str, np.ndarray], shape) -> np.ndarray:
    if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", token):
        return np.full(shape, int(token, 0), dtype=np.uint32)
    return registers[token]


def _execute(opcode: str, values: list[np.ndarray]) -> np.ndarray:
    if opcode == "mov.b32":
        return values[0].copy()
    if opcode == "and.b32":
        return values[0] & values[1]
    if opcode == "or.b32":
        return values[0] | values[1]
    if opcode == "shl.b32":
        return (values[0].astype(np.uint64) << values[1].astype(np.uint64)).astype(np.uint32)
    if opcode == "shr.b32":
        return values[0] >> values[1]
    if opcode == "prmt.b32":
        return _prmt(*values)
    if opcode == "mul.bf16x2":
        return _mul_bf16x2(*values)
    raise ValueError(f"the emulator does not know {opcode!r}")


def _prmt(a: np.ndarray, b: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """Default-mode prmt: byte i of the result is byte (selector nibble i & 7) of {b, a}, or with nibble bit 3 that
    byte's sign replicated."""
    source = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)  # bytes 0..3 from a, 4..7 from b
    result = np.zeros(a.shape, dtype=np.uint32)
    for i in range(4):
        nibble = (selector >> np.uint32(4 * i)) & np.uint32(0xF)
        byte = ((source >> (8 * (nibble & 7)).astype(np.uint64)) & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(nibble & 8, np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0)), byte)
        result |= byte << np.uint32(8 * i)
    return result


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def float_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even (float32 first: exact for the products of two bf16 values this emulator forms)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return rounded.astype(np.uint32) & np.uint32(0xFFFF)


def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lanes = []
    for shift in (0, 16):
        x = bf16_bits_to_float((a >> np.uint32(shift)) & np.uint32(0xFFFF))
        y = bf16_bits_to_float((b >> np.uint32(shift)) & np.uint32(0xFFFF))
        lanes.append(float_to_bf16_bits(x * y))
    return lanes[0] | (lanes[1] << np.uint32(16))
